"""kitbench: the run order, the time budget, and whole runs against the
stand-in kit (tests/fakekit.py): interleaving, median verdict, timeouts,
failures and refusals, without a GPU."""

import contextlib
import csv
import io
import os
import tempfile
import time
import unittest
from unittest import mock

from _util import REPO
from fakekit import make_fake_kit
from ncclharness import kitbench

M = 1 << 20


class Plan(unittest.TestCase):
    def test_default_plan_interleaved_repeat_major_extras_last(self):
        plan = kitbench.build_plan()
        self.assertEqual(len(plan), 3 * 2 * 3 * 2 + 2 * 2)
        self.assertEqual([s.idx for s in plan], list(range(1, len(plan) + 1)))
        main, extras = plan[:36], plan[36:]
        # repeat-major: all of repeat 1, then 2, then 3
        self.assertEqual([s.rep for s in main], [1] * 12 + [2] * 12 + [3] * 12)
        for i in range(0, 36, 2):
            a, b = main[i], main[i + 1]
            self.assertEqual((a.collective, a.nranks, a.rep), (b.collective, b.nranks, b.rep))
            # the two networks back to back, the first alternating with the repeat
            want = ("plugin", "builtin") if a.rep % 2 else ("builtin", "plugin")
            self.assertEqual((a.net, b.net), want)
        self.assertEqual([(s.collective, s.nranks) for s in main[:12:2]],
                         [("all_reduce", 2), ("all_reduce", 4), ("all_reduce", 8),
                          ("sendrecv", 2), ("sendrecv", 4), ("sendrecv", 8)])
        self.assertEqual([(s.collective, s.nranks, s.net, s.extra) for s in extras],
                         [("all_gather", 8, "plugin", True), ("all_gather", 8, "builtin", True),
                          ("alltoall", 8, "plugin", True), ("alltoall", 8, "builtin", True)])

    def test_each_network_first_equally_often_over_two_repeats(self):
        plan = kitbench.build_plan(repeats=2, extras=())
        first = [s.net for i, s in enumerate(plan) if i % 2 == 0]
        self.assertEqual(first.count("plugin"), first.count("builtin"))


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Budget(unittest.TestCase):
    def spec(self, n=2, net="plugin", coll="all_reduce", rep=1):
        return kitbench.RunSpec(1, coll, n, net, rep)

    def test_cap_by_ranks_then_3x_the_slowest_run(self):
        clk = FakeClock()
        s = kitbench.Scheduler(400, clock=clk)
        self.assertEqual(s.decide(self.spec(8)), (100, None))
        self.assertEqual(s.decide(self.spec(2)), (60, None))
        s.record(self.spec(2), "ok", 5.0)
        self.assertEqual(s.decide(self.spec(2, "builtin")), (30, None))   # max(min cap 30, 3 x 5)
        s.record(self.spec(2, "builtin"), "ok", 15.0)
        self.assertEqual(s.decide(self.spec(2)), (45, None))               # 3 x the slowest of the group
        s.record(self.spec(2, "builtin"), "ok", 25.0)
        self.assertEqual(s.decide(self.spec(2)), (60, None))               # never above the cap

    def test_never_past_the_budget_and_skip_when_it_does_not_fit(self):
        clk = FakeClock()
        s = kitbench.Scheduler(100, clock=clk)
        clk.t += 50
        self.assertEqual(s.decide(self.spec(8)), (50, None))      # cap 100, but 50 s left
        clk.t += 35
        t, why = s.decide(self.spec(8))                          # 15 s left, estimate 20 s
        self.assertEqual(t, 0)
        self.assertIn("skipped: budget (15s left, this run needs ~20s)", why)
        self.assertEqual(s.decide(self.spec(2))[1], None)         # 2 ranks: estimate 8 s fits

    def test_first_run_of_a_group_capped_by_its_rank_count_history(self):
        s = kitbench.Scheduler(400, clock=FakeClock())
        s.record(self.spec(8, "builtin", "all_reduce"), "ok", 20.0)
        self.assertEqual(s.decide(self.spec(8, "plugin", "sendrecv")), (60, None))   # 3 x 20, not 100
        self.assertEqual(s.decide(self.spec(4, "plugin", "sendrecv")), (75, None))   # no 4-rank history

    def test_two_timeouts_over_one_network_stop_that_network(self):
        s = kitbench.Scheduler(900, clock=FakeClock())
        s.record(self.spec(2, "plugin", "all_reduce"), "timeout", 60)
        self.assertIsNone(s.decide(self.spec(4, "plugin", "all_reduce"))[1])
        s.record(self.spec(4, "plugin", "all_reduce"), "timeout", 75)
        t, why = s.decide(self.spec(8, "plugin", "sendrecv"))
        self.assertEqual(t, 0)
        self.assertIn("2 runs over rustnet timed out already", why)
        self.assertIsNone(s.decide(self.spec(8, "builtin", "sendrecv"))[1])

    def test_after_a_timeout_the_same_run_is_not_repeated(self):
        s = kitbench.Scheduler(400, clock=FakeClock())
        s.record(self.spec(4, "plugin"), "timeout", 75)
        t, why = s.decide(self.spec(4, "plugin", rep=2))
        self.assertEqual(t, 0)
        self.assertIn("an earlier repeat timed out", why)
        self.assertIsNone(s.decide(self.spec(4, "builtin", rep=2))[1])   # the other network still runs


class WithFakeKit(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        d = self.tmp.name
        self.kit, self.mpsbin = make_fake_kit(d)
        self.state = os.path.join(d, "state")
        os.makedirs(self.state)
        self.out = os.path.join(d, "out")
        self.record = os.path.join(d, "record")
        self.plugin = os.path.join(REPO, "target", "release")
        if not os.path.exists(os.path.join(self.plugin, "librustnet.so")):
            # kitbench only needs an ELF file to name for NCCL here
            self.plugin = os.path.join(d, "release")
            os.makedirs(self.plugin)
            with open(os.path.join(self.plugin, "librustnet.so"), "wb") as f:
                f.write(b"\x7fELF" + b"\0" * 60)
        env = {"PATH": os.path.join(self.kit, "mpi", "bin") + os.pathsep + os.environ["PATH"],
               "HYDRA_LAUNCHER": "fork", "FAKE_STATE_DIR": self.state, "FAKE_RUN_RECORD": self.record}
        self.env = mock.patch.dict(os.environ, env)
        self.env.start()
        for k in [k for k in os.environ if k.startswith(("FAKE_GBPS", "FAKE_HANG", "FAKE_WRONG", "FAKE_FALLBACK",
                                                          "FAKE_P2P", "FAKE_RC", "CUDA_MPS_"))]:
            del os.environ[k]

    def tearDown(self):
        self.env.stop()
        self.tmp.cleanup()

    def bench(self, *extra):
        argv = ["--kit", self.kit, "--plugin-dir", self.plugin, "--out", self.out, "-b", "1M", "-e", "16M",
                "--ranks", "2", "--extras", "none"] + list(extra)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = kitbench.main(argv)
        return rc, buf.getvalue()

    def runs(self):
        with open(os.path.join(self.out, "runs.csv")) as f:
            return list(csv.DictReader(f))

    def test_median_verdict_end_to_end(self):
        """The plugin's 2nd repeat is below Socket; its median is not: met."""
        os.environ["FAKE_GBPS_RUSTNET"] = "2.2,1.5,2.4"
        os.environ["FAKE_GBPS_SOCKET"] = "2.0,2.1,1.9"
        rc, out = self.bench()
        self.assertEqual(rc, 0, out)
        self.assertIn("GOAL MET", out)
        with open(self.record) as f:
            order = [tuple(line.split()) for line in f]
        self.assertEqual(order, [("all_reduce", "2", "rustnet"), ("all_reduce", "2", "Socket"),
                                 ("sendrecv", "2", "rustnet"), ("sendrecv", "2", "Socket"),
                                 ("all_reduce", "2", "Socket"), ("all_reduce", "2", "rustnet"),
                                 ("sendrecv", "2", "Socket"), ("sendrecv", "2", "rustnet"),
                                 ("all_reduce", "2", "rustnet"), ("all_reduce", "2", "Socket"),
                                 ("sendrecv", "2", "rustnet"), ("sendrecv", "2", "Socket")])
        with open(os.path.join(self.out, "summary.csv")) as f:
            rows = {(r["collective"], int(r["size"])): r for r in csv.DictReader(f)}
        r = rows[("all_reduce", 16 * M)]
        # the fake's busbw is the scale less a 20 us latency share (0.3% at 16 MiB), printed to 0.01
        self.assertAlmostEqual(float(r["plugin_median"]), 2.2, delta=0.02)
        self.assertAlmostEqual(float(r["plugin_min"]), 1.5, delta=0.02)
        self.assertAlmostEqual(float(r["plugin_max"]), 2.4, delta=0.02)
        self.assertAlmostEqual(float(r["builtin_median"]), 2.0, delta=0.02)
        self.assertEqual((r["plugin_n"], r["builtin_n"]), ("3", "3"))
        self.assertAlmostEqual(float(r["ratio_min"]), 1.5 / 2.1, delta=0.01)
        self.assertTrue(all(x["status"] == "ok" for x in self.runs()))
        for f in ("report.txt", "results.csv", "busbw.svg"):
            self.assertTrue(os.path.exists(os.path.join(self.out, f)), f)

    def test_goal_not_met_exit_1(self):
        os.environ["FAKE_GBPS_RUSTNET"] = "1.8"
        rc, out = self.bench("--repeats", "1")
        self.assertEqual(rc, 1, out)
        self.assertIn("GOAL NOT MET", out)

    def test_a_hang_times_out_and_is_not_repeated(self):
        os.environ["FAKE_HANG"] = "sendrecv:2:rustnet:1"
        t0 = time.monotonic()
        rc, out = self.bench("--min-cap", "3", "--caps", "2:6")
        self.assertLess(time.monotonic() - t0, 60)
        self.assertEqual(rc, 2, out)
        runs = {(r["collective"], r["net"], r["rep"]): r for r in self.runs()}
        self.assertEqual(runs[("sendrecv", "plugin", "1")]["status"], "timeout")
        # capped at the min cap: the 2-rank all_reduce runs before it took well under 1 s
        self.assertIn("timed out after 3s", runs[("sendrecv", "plugin", "1")]["errors"])
        for rep in ("2", "3"):
            self.assertEqual(runs[("sendrecv", "plugin", rep)]["status"], "skipped")
            self.assertEqual(runs[("sendrecv", "builtin", rep)]["status"], "ok")
        self.assertIn("GOAL NOT SHOWN", out)
        # the hung ranks were ended with their group (a killed process may
        # linger a moment on a loaded host, or as a zombie nobody reaps yet)
        def running(pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            except OSError:
                return False
        pids = os.listdir(os.path.join(self.state, "pids"))
        deadline = time.monotonic() + 10
        alive = [p for p in pids if running(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in pids if running(p)]
        self.assertEqual(alive, [])

    def test_wrong_data_fails_the_run(self):
        os.environ["FAKE_WRONG"] = "1"
        rc, out = self.bench("--repeats", "1")
        self.assertEqual(rc, 2, out)
        self.assertIn("wrong elements (#wrong): data corrupted", out)

    def test_silent_fallback_is_refused(self):
        os.environ["FAKE_FALLBACK"] = "1"
        rc, out = self.bench("--repeats", "1")
        self.assertEqual(rc, 2, out)
        self.assertIn("network not proven", out)
        self.assertIn("NCCL used network 'Socket', not 'rustnet'", out)
        st = {(r["collective"], r["net"]): r["status"] for r in self.runs()}
        self.assertEqual(st[("all_reduce", "plugin")], "failed")
        self.assertEqual(st[("all_reduce", "builtin")], "ok")

    def test_no_budget_everything_skipped_incomplete(self):
        rc, out = self.bench("--budget", "0")
        self.assertEqual(rc, 2, out)
        self.assertEqual({r["status"] for r in self.runs()}, {"skipped"})
        self.assertIn("GOAL NOT SHOWN", out)

    def test_mps_coverage_per_run(self):
        """With a (fake) MPS daemon the ranks become its clients; each run
        says how many of its ranks the MPS logs saw."""
        pipe = os.path.join(self.tmp.name, "mps", "pipe")
        log = os.path.join(self.tmp.name, "mps", "log")
        os.environ.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=log,
                          PATH=self.mpsbin + os.pathsep + os.environ["PATH"])
        import subprocess
        subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
        rc, out = self.bench("--repeats", "1")
        self.assertEqual(rc, 0, out)
        self.assertEqual({r["mps_clients"] for r in self.runs()}, {"2/2"})
        self.assertIn("MPS: every rank a client in 4 of 4 runs", out)

    def test_kit_without_execute_bits(self):
        os.chmod(os.path.join(self.kit, "bin", "sendrecv_perf"), 0o644)
        rc, out = self.bench()
        self.assertEqual(rc, 2)
        self.assertIn("sendrecv_perf is not an executable file", out)

    def test_an_ab_run_sets_the_plugin_against_itself_with_other_settings(self):
        """--ab-env: the second network is the plugin again, with those variables only in its runs."""
        os.environ["FAKE_GBPS_RUSTNET"] = "2.0"
        rc, out = self.bench("--repeats", "2", "--ab-env", "FAKE_GBPS_RUSTNET=1.0")
        self.assertEqual(rc, 0, out)
        self.assertIn("A/B RUN: rustnet as set against rustnet[FAKE_GBPS_RUSTNET=1.0]", out)
        self.assertNotIn("GOAL", out)
        self.assertNotIn("PARTIAL PLAN", out)
        with open(self.record) as f:
            nets = {line.split()[2] for line in f}
        self.assertEqual(nets, {"rustnet"}, "both sides of an A/B run go through the plugin")
        with open(os.path.join(self.out, "summary.csv")) as f:
            rows = {(r["collective"], int(r["size"])): r for r in csv.DictReader(f)}
        r = rows[("all_reduce", 16 * M)]
        self.assertAlmostEqual(float(r["plugin_median"]), 2.0, delta=0.02)
        self.assertAlmostEqual(float(r["builtin_median"]), 1.0, delta=0.02)
        shown = [(x["net"], x["network"]) for x in self.runs()]
        self.assertEqual(shown[:4], [("plugin", "rustnet"), ("builtin", "rustnet[FAKE_GBPS_RUSTNET=1.0]")] * 2)
        self.assertTrue(all(x["status"] == "ok" for x in self.runs()), "a plugin run proven as the plugin")

    def test_an_ab_run_plan_names_its_second_setting(self):
        rc, out = self.bench("--dry-run", "--ab-env", "RUSTNET_RECOVERY_TIMEOUT=0")
        self.assertEqual(rc, 0)
        self.assertIn("[ 2] all_reduce n=2 rustnet[RUSTNET_RECOVERY_TIMEOUT=0] rep 1", out)

    def test_dry_run_prints_the_plan(self):
        rc, out = self.bench("--dry-run", "--ranks", "2,8", "--extras", "alltoall")
        self.assertEqual(rc, 0)
        self.assertIn("[ 1] all_reduce n=2 rustnet rep 1", out)
        self.assertIn("[ 5] sendrecv n=2 rustnet rep 1", out)
        self.assertIn("alltoall n=8 Socket rep 1 (extra)", out)
        self.assertFalse(os.path.exists(os.path.join(self.out, "runs.csv")))


if __name__ == "__main__":
    unittest.main()
