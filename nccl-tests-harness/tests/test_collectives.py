import unittest

import _util  # noqa: F401
from ncclharness.collectives import COLLECTIVES, algbw_gbps, busbw_gbps, parse_collectives
from ncclharness.sizes import format_size, parse_size, short_size, size_sweep


class BusBwFactors(unittest.TestCase):
    """nccl-tests' definitions: all_reduce 2(n-1)/n; all_gather, reduce_scatter,
    alltoall (n-1)/n; sendrecv 1."""

    def test_factors(self):
        for n in (2, 3, 4, 8, 16):
            self.assertAlmostEqual(COLLECTIVES["all_reduce"].bus_factor(n), 2 * (n - 1) / n)
            for c in ("all_gather", "reduce_scatter", "alltoall"):
                self.assertAlmostEqual(COLLECTIVES[c].bus_factor(n), (n - 1) / n)
            self.assertEqual(COLLECTIVES["sendrecv"].bus_factor(n), 1.0)

    def test_two_ranks(self):
        self.assertEqual(COLLECTIVES["all_reduce"].bus_factor(2), 1.0)
        self.assertEqual(COLLECTIVES["all_gather"].bus_factor(2), 0.5)

    def test_algbw_busbw(self):
        # 1 GB in 0.5 s = 2 GB/s algbw; all_reduce over 4 ranks: x1.5
        self.assertAlmostEqual(algbw_gbps(1e9, 0.5), 2.0)
        self.assertAlmostEqual(busbw_gbps("all_reduce", 10**9, 0.5, 4), 3.0)
        self.assertAlmostEqual(busbw_gbps("alltoall", 10**9, 0.5, 4), 1.5)
        self.assertAlmostEqual(busbw_gbps("sendrecv", 10**9, 0.5, 4), 2.0)
        with self.assertRaises(ValueError):
            algbw_gbps(1, 0)

    def test_matches_fixture_row(self):
        # all_reduce_perf printed 1048576 B in 640.5 us -> 1.64 GB/s at 2 ranks
        self.assertAlmostEqual(busbw_gbps("all_reduce", 1048576, 640.5e-6, 2), 1.637, places=3)

    def test_buffer_rounding_like_nccl_tests(self):
        # all_gather with 3 ranks at 1 MiB: base = (262144//3) & ~3 = 87380
        count, reported = COLLECTIVES["all_gather"].buffer_elements(1 << 20, 3)
        self.assertEqual(count, 87380)
        self.assertEqual(reported, 87380 * 3 * 4)
        # all_reduce keeps the whole size
        self.assertEqual(COLLECTIVES["all_reduce"].buffer_elements(1 << 20, 3), (262144, 1 << 20))
        self.assertEqual(COLLECTIVES["sendrecv"].buffer_elements(4096, 8), (1024, 4096))
        # a size too small for the ranks gives zero elements
        self.assertEqual(COLLECTIVES["alltoall"].buffer_elements(32, 16)[0], 0)
        # powers of two with 2 ranks are exact
        for c in ("all_gather", "reduce_scatter", "alltoall"):
            self.assertEqual(COLLECTIVES[c].buffer_elements(1 << 20, 2), (131072, 1 << 20))

    def test_parse_collectives(self):
        self.assertEqual(parse_collectives("all"), ["all_reduce", "all_gather", "reduce_scatter", "alltoall",
                                                    "sendrecv"])
        self.assertEqual(parse_collectives("allreduce,alltoall_perf,all_reduce"), ["all_reduce", "alltoall"])
        with self.assertRaises(ValueError):
            parse_collectives("broadcast")


class Sizes(unittest.TestCase):
    def test_parse(self):
        self.assertEqual(parse_size("1K"), 1024)
        self.assertEqual(parse_size("64MiB"), 64 << 20)
        self.assertEqual(parse_size("1G"), 1 << 30)
        self.assertEqual(parse_size("4096"), 4096)
        self.assertEqual(parse_size("1.5K"), 1536)
        for bad in ("", "1Q", "-1", "0.3"):
            with self.assertRaises(ValueError):
                parse_size(bad)

    def test_format(self):
        self.assertEqual(format_size(1024), "1 KiB")
        self.assertEqual(format_size(1536), "1.5 KiB")
        self.assertEqual(format_size(1 << 30), "1 GiB")
        self.assertEqual(format_size(100), "100 B")
        self.assertEqual(short_size(64 << 20), "64M")

    def test_sweep(self):
        s = size_sweep(1024, 1 << 30)
        self.assertEqual(len(s), 21)
        self.assertEqual((s[0], s[-1]), (1024, 1 << 30))
        self.assertEqual(size_sweep(1, 100, 10), [1, 10, 100])
        with self.assertRaises(ValueError):
            size_sweep(10, 1)


if __name__ == "__main__":
    unittest.main()
