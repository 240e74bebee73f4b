import unittest

import _util  # noqa: F401
from ncclharness.sweep import SweepOptions, choose_iters, estimate_seconds, run_sweep


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeOps:
    """Simulated ranks: op time = latency + bytes/bandwidth; agree_* act as if
    every rank saw the same values (max = the value, sum = n * value)."""

    def __init__(self, clock, n, gbps=2.0, latency=50e-6, bad=()):
        self.clock, self.n, self.gbps, self.latency, self.bad = clock, n, gbps, latency, set(bad)
        self.ops = []
        self.agreements = 0

    def prepare(self, coll, size):
        from ncclharness.collectives import COLLECTIVES
        count, reported = COLLECTIVES[coll].buffer_elements(size, self.n)
        if count == 0:
            return None

        def run():
            self.ops.append((coll, reported))
            self.clock.t += self.latency + reported / (self.gbps * 1e9)

        def check():
            run()
            return coll not in self.bad
        return reported, run, check

    def sync(self):
        pass

    def agree_max(self, values):
        self.agreements += 1
        return list(values)

    def agree_sum(self, values):
        self.agreements += 1
        return [v * self.n for v in values]

    def barrier(self):
        pass


class Sweep(unittest.TestCase):
    def test_measures_bandwidth(self):
        clock = FakeClock()
        ops = FakeOps(clock, 2, gbps=2.0, latency=0.0)
        sizes = [1 << 20, 4 << 20]
        meas, skipped, errors = run_sweep(ops, ["all_reduce", "all_gather"], sizes, 2,
                                          SweepOptions(target_s=0.01), clock=clock, net="plugin", network="rustnet")
        self.assertEqual((skipped, errors), ([], []))
        self.assertEqual(len(meas), 4)
        for x in meas:
            self.assertAlmostEqual(x["algbw"], 2.0)
            factor = 1.0 if x["collective"] == "all_reduce" else 0.5     # 2 ranks
            self.assertAlmostEqual(x["busbw"], 2.0 * factor)
            self.assertEqual((x["net"], x["network"], x["nranks"]), ("plugin", "rustnet", 2))
        self.assertAlmostEqual(meas[0]["time_us"], (1 << 20) / 2e9 * 1e6)

    def test_iteration_choice(self):
        o = SweepOptions(min_iters=2, max_iters=100, target_s=0.2)
        self.assertEqual(choose_iters(1.0, o), 2)
        self.assertEqual(choose_iters(0.01, o), 20)
        self.assertEqual(choose_iters(1e-6, o), 100)
        self.assertEqual(choose_iters(0.0, o), 100)

    def test_bad_data_stops_that_collective(self):
        clock = FakeClock()
        ops = FakeOps(clock, 2, bad={"alltoall"})
        meas, skipped, errors = run_sweep(ops, ["alltoall", "sendrecv"], [1024, 2048], 2,
                                          SweepOptions(target_s=0.001), clock=clock)
        self.assertEqual(len(errors), 1)
        self.assertIn("alltoall", errors[0])
        self.assertEqual({x["collective"] for x in meas}, {"sendrecv"})

    def test_too_small_sizes_are_skipped(self):
        clock = FakeClock()
        meas, skipped, errors = run_sweep(FakeOps(clock, 16), ["alltoall"], [32, 1 << 20], 16,
                                          SweepOptions(target_s=0.001), clock=clock)
        self.assertEqual(skipped, [{"collective": "alltoall", "size": 32, "why": "too small for 16 ranks"}])
        self.assertEqual(len(meas), 1)

    def test_time_budget_skips_large_sizes_and_is_shared(self):
        clock = FakeClock()
        ops = FakeOps(clock, 2, gbps=1.0, latency=0.0)
        sizes = [1 << 20 << i for i in range(11)]          # 1 MiB .. 1 GiB
        opts = SweepOptions(warmup=1, min_iters=2, target_s=0.05, budget_s=4.0)
        meas, skipped, errors = run_sweep(ops, ["all_reduce", "sendrecv"], sizes, 2, opts, clock=clock)
        self.assertEqual(errors, [])
        self.assertTrue(skipped)
        self.assertTrue(all(s["why"] == "time budget" for s in skipped))
        # both collectives got measured, each stopped at some size and skipped the rest
        for coll in ("all_reduce", "sendrecv"):
            got = [x["requested_size"] for x in meas if x["collective"] == coll]
            self.assertEqual(got, sizes[:len(got)])
            self.assertGreater(len(got), 3)
        # the whole run stays near the budget (one size may overrun the estimate)
        self.assertLess(clock.t, 4.0 * 1.5)

    def test_estimate(self):
        o = SweepOptions(warmup=1, min_iters=2, target_s=0.2, check=True)
        self.assertEqual(estimate_seconds(None, None, 1024, o), 0.0)
        # 1 s ops at 2x size -> 2 s each: check + warmup + max(0.2, 2 * 2)
        self.assertAlmostEqual(estimate_seconds(1.0, 1, 2, o), 2 * 2 + 4)


if __name__ == "__main__":
    unittest.main()
