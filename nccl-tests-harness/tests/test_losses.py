import math
import unittest

import _util  # noqa: F401
from ncclharness.losses import NET_ATOL, NET_RTOL, REF_RTOL, compare_losses


class Losses(unittest.TestCase):
    def setUp(self):
        self.a = [2.3 - 0.05 * i for i in range(30)]

    def test_identical(self):
        c = compare_losses(self.a, list(self.a))
        self.assertTrue(c.ok)
        self.assertTrue(c.bitwise_equal)
        self.assertEqual(c.max_abs, 0.0)
        self.assertIn("MATCH", c.describe("rustnet", "Socket", NET_RTOL, NET_ATOL))
        self.assertIn("bitwise identical: yes", c.describe("rustnet", "Socket", NET_RTOL, NET_ATOL))

    def test_rounding_noise_passes(self):
        b = [x * (1 + 3e-7) for x in self.a]       # a few fp32 ulps
        c = compare_losses(self.a, b)
        self.assertTrue(c.ok, c.problems)
        self.assertFalse(c.bitwise_equal)

    def test_transport_fault_fails_at_the_step(self):
        b = list(self.a)
        for i in range(12, 30):
            b[i] += 0.01 * (i - 11)       # divergence after a corrupted gradient at step 12
        c = compare_losses(self.a, b)
        self.assertFalse(c.ok)
        self.assertEqual(c.first_bad_step, 12)
        self.assertEqual(len(c.problems), 5)     # capped
        self.assertIn("step 12", c.problems[0])
        self.assertIn("MISMATCH", c.describe("a", "b", NET_RTOL, NET_ATOL))

    def test_nan_never_matches(self):
        b = list(self.a)
        b[3] = float("nan")
        c = compare_losses(b, b)
        self.assertFalse(c.ok)
        self.assertEqual(c.first_bad_step, 3)
        self.assertTrue(math.isinf(c.max_abs))

    def test_length_mismatch(self):
        c = compare_losses(self.a, self.a[:-1])
        self.assertFalse(c.ok)
        self.assertIn("different number of steps", c.problems[0])

    def test_empty(self):
        self.assertFalse(compare_losses([], []).ok)

    def test_reference_tolerance_is_looser(self):
        b = [x * (1 + 5e-4) for x in self.a]
        self.assertFalse(compare_losses(self.a, b).ok)
        self.assertTrue(compare_losses(self.a, b, rtol=REF_RTOL, atol=0).ok)

    def test_tolerance_boundary(self):
        # |diff| <= atol + rtol*|b|
        self.assertTrue(compare_losses([1.0 + 1e-5 + 1e-6], [1.0]).ok)
        self.assertFalse(compare_losses([1.0 + 1e-5 + 1e-6 + 1e-9], [1.0]).ok)


if __name__ == "__main__":
    unittest.main()
