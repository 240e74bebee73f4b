"""gpu-check.sh end to end on the nccl-tests kit path, with the stand-in
kit, mpiexec and nvidia-cuda-mps-control (tests/fakekit.py): MPS started,
proven and stopped; refusal without it; the full interleaved plan; the
time guard; a kill in the middle. The plugin file is the real build (the
preflight dlopens it)."""

import glob
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest

from _util import HARNESS, REPO
from fakekit import make_fake_kit

SO_DIR = os.path.join(REPO, "target", "release")
SCRIPT = os.path.join(HARNESS, "gpu-check.sh")


@unittest.skipUnless(os.path.exists(os.path.join(SO_DIR, "librustnet.so")), "plugin not built")
class GpuCheckKit(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        d = self.tmp.name
        self.kit, self.mpsbin = make_fake_kit(d)
        self.state = os.path.join(d, "state")
        os.makedirs(self.state)
        self.out = os.path.join(d, "out")
        self.record = os.path.join(d, "runs-record")
        self.mpsrec = os.path.join(d, "mps-record")
        self.before = set(glob.glob("/tmp/rustnet-mps.*"))

    def tearDown(self):
        self.tmp.cleanup()

    def env(self, mps=True, **extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "CUDA_MPS_", "GPU_CHECK_"))}
        env.update(OUT=self.out, PYTHON=sys.executable, FAKE_STATE_DIR=self.state, FAKE_RUN_RECORD=self.record,
                   FAKE_MPS_RECORD=self.mpsrec)
        if mps:
            env["PATH"] = self.mpsbin + os.pathsep + env["PATH"]
        env.update(extra)
        return env

    def run_check(self, *args, mps=True, timeout=240, **extra):
        p = subprocess.run(["bash", SCRIPT, "--kit", self.kit, "--plugin-dir", SO_DIR, *args],
                           env=self.env(mps, **extra), capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr

    def read(self, path, default=""):
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return default

    def assert_mps_stopped(self):
        lines = self.read(self.mpsrec).split()
        self.assertEqual(lines[0::2], ["start", "quit"], lines)
        self.assertEqual(set(glob.glob("/tmp/rustnet-mps.*")) - self.before, set(), "private MPS dir left behind")

    def assert_no_rank_left(self):
        alive = []
        for pid in os.listdir(os.path.join(self.state, "pids")) if os.path.isdir(
                os.path.join(self.state, "pids")) else []:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":      # a zombie has ended; its reaping is its parent's business
                alive.append(f"{pid} ({state})")
        self.assertEqual(alive, [], "rank processes outlived gpu-check.sh")

    def test_full_plan_pass(self):
        t0 = time.monotonic()
        bundle = os.path.join(self.tmp.name, "bundle")
        rc, out = self.run_check("--bundle", bundle)
        self.assertEqual(rc, 0, out)
        summary = self.read(os.path.join(self.out, "summary.txt"))
        self.assertIn("mode kit", summary)
        self.assertIn("MPS PROVEN", summary)
        self.assertIn("GOAL MET", summary)
        self.assertIn("runs: 40 ok, 0 failed or timed out, 0 skipped, of 40", summary)
        self.assertNotIn("PARTIAL", summary)
        self.assertIn("MPS: every rank a client in 40 of 40 runs", summary)
        self.assertIn("median busbw ratio rustnet/Socket", summary)
        self.assertIn("exports v6, v7, v8, v9, v10, v11, v12; vtable name(s): rustnet", out)
        self.assert_mps_stopped()
        order = [tuple(line.split()) for line in self.read(self.record).splitlines()]
        self.assertEqual(len(order), 40)
        # networks alternate run by run through the judged part; every pair is one (test, ranks)
        for i in range(0, 36, 2):
            self.assertEqual(order[i][:2], order[i + 1][:2])
            self.assertEqual({order[i][2], order[i + 1][2]}, {"rustnet", "Socket"})
        self.assertEqual([order[i][2] for i in (0, 12, 24)], ["rustnet", "Socket", "rustnet"])
        self.assertEqual({o[:2] for o in order[36:]}, {("all_gather", "8"), ("alltoall", "8")})
        for f in ("gpu-check.log", "summary.txt", "nccl-tests/report.txt", "nccl-tests/summary.csv",
                  "nccl-tests/results.csv", "nccl-tests/runs.csv", "nccl-tests/busbw.svg", "mps/control.log"):
            self.assertTrue(os.path.exists(os.path.join(self.out, f)), f)
        self.assertLess(time.monotonic() - t0, 200)
        # what the device tool can return: at most 8 plain files, flat here
        got = sorted(os.listdir(bundle))
        self.assertEqual(got, ["gpu-check-all.tgz", "gpu-check.log", "nccl-tests-busbw.svg", "nccl-tests-report.txt",
                               "nccl-tests-runs.csv", "nccl-tests-summary.csv", "summary.txt"])
        with tarfile.open(os.path.join(bundle, "gpu-check-all.tgz")) as tf:
            names = tf.getnames()
        self.assertIn("./nccl-tests/results.csv", names)
        self.assertIn("./mps/control.log", names)
        self.assertTrue(any(n.startswith("./nccl-tests/logs/r40-alltoall-n8-builtin-rep1.") for n in names))

    def test_processes_left_by_a_killed_run_are_ended(self):
        """A run killed with SIGKILL leaves its rank groups (own sessions) on
        the GPU; the next run ends what carries the run marker, only that."""
        gone = subprocess.Popen(["true"])
        gone.wait()                       # the pid of a gpu-check.sh that is no more
        marked = subprocess.Popen(["sleep", "300"], start_new_session=True,
                                  env=dict(os.environ, RUSTNET_GPU_CHECK_RUN=f"{gone.pid}-456"))
        # a run whose gpu-check.sh is alive (here: this test process) is not touched
        live = subprocess.Popen(["sleep", "300"], start_new_session=True,
                                env=dict(os.environ, RUSTNET_GPU_CHECK_RUN=f"{os.getpid()}-456"))
        unmarked = subprocess.Popen(["sleep", "300"], start_new_session=True)
        try:
            rc, out = self.run_check("--ranks", "2", "--repeats", "1", "--no-extras")
            self.assertEqual(rc, 0, out)
            self.assertIn(f"ending processes left by an earlier killed run: {marked.pid}\n", out)
            self.assertIsNotNone(marked.wait(timeout=10))
            self.assertIsNone(unmarked.poll())
            self.assertIsNone(live.poll())
        finally:
            for p in (marked, live, unmarked):
                if p.poll() is None:
                    p.kill()
                p.wait()

    def test_no_mps_tool_refuses_before_running_anything(self):
        rc, out = self.run_check(mps=False)
        self.assertEqual(rc, 4, out)
        self.assertIn("NO VERDICT: nvidia-cuda-mps-control is not on PATH", out)
        self.assertEqual(self.read(self.record), "")

    def test_mps_daemon_fails_to_start(self):
        rc, out = self.run_check("--ranks", "2", "--repeats", "1", "--no-extras", FAKE_MPS_FAIL="1")
        self.assertEqual(rc, 4, out)
        self.assertIn("NO VERDICT: nvidia-cuda-mps-control -d failed", out)
        self.assertEqual(self.read(self.record), "")

    def test_mps_daemon_does_not_answer(self):
        rc, out = self.run_check("--ranks", "2", "--repeats", "1", "--no-extras", FAKE_MPS_MUTE="1",
                                 GPU_CHECK_MPS_WAIT_S="2")
        self.assertEqual(rc, 4, out)
        self.assertIn("the MPS control daemon started but does not answer", out)
        self.assertEqual(set(glob.glob("/tmp/rustnet-mps.*")) - self.before, set())

    def test_daemon_holding_its_output_open_does_not_stall(self):
        pidfile = os.path.join(self.tmp.name, "holder.pid")
        t0 = time.monotonic()
        try:
            rc, out = self.run_check("--ranks", "2", "--repeats", "1", "--no-extras", FAKE_MPS_HOLD_STDOUT=pidfile)
            self.assertEqual(rc, 0, out)
            self.assertLess(time.monotonic() - t0, 25)   # the holder lives 30 s
        finally:
            try:
                os.kill(int(self.read(pidfile, "0")), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def test_ranks_not_served_by_mps(self):
        rc, out = self.run_check("--ranks", "2", "--repeats", "1", "--no-extras", FAKE_MPS_IGNORED="1")
        self.assertEqual(rc, 4, out)
        summary = self.read(os.path.join(self.out, "summary.txt"))
        self.assertIn("MPS NOT PROVEN: no MPS server was started", summary)
        self.assertIn("NO VERDICT", summary)
        self.assert_mps_stopped()

    def test_no_mps_option_runs_but_gives_no_verdict(self):
        rc, out = self.run_check("--ranks", "2", "--repeats", "1", "--no-extras", "--no-mps", mps=False)
        self.assertEqual(rc, 4, out)
        self.assertIn("WARNING: --no-mps", out)
        self.assertIn("NO VERDICT", self.read(os.path.join(self.out, "summary.txt")))
        self.assertEqual(len(self.read(self.record).splitlines()), 4)

    def test_part_of_the_plan_with_goal_not_met(self):
        rc, out = self.run_check("--ranks", "4", "--repeats", "3", "--no-extras", "--env", "NCCL_NSOCKS_PERTHREAD=4",
                                 "--kitbench", "-n 7 -e 16M", FAKE_GBPS_RUSTNET="1.9")
        self.assertIn("bin/all_reduce_perf -b 262144 -e 16777216 -f 4 -n 7 -w 5 -c 1 -g 1", out)
        self.assertIn("NCCL_NSOCKS_PERTHREAD=4", out)   # in both networks (env shown for run 1)
        self.assertEqual(rc, 1, out)
        summary = self.read(os.path.join(self.out, "summary.txt"))
        self.assertIn("GOAL NOT MET", summary)
        self.assertIn("PARTIAL PLAN: all_reduce,sendrecv at 4 ranks, 3 repeat(s)", summary)
        self.assertEqual(len(self.read(self.record).splitlines()), 12)

    def test_an_ab_run_of_two_plugin_settings(self):
        rc, out = self.run_check("--ranks", "2", "--repeats", "2", "--no-extras",
                                 "--kitbench", "-e 4M --ab-env FAKE_GBPS_RUSTNET=1.0", FAKE_GBPS_RUSTNET="2.0")
        self.assertEqual(rc, 0, out)
        summary = self.read(os.path.join(self.out, "summary.txt"))
        self.assertIn("A/B RUN: rustnet as set against rustnet[FAKE_GBPS_RUSTNET=1.0]", summary)
        self.assertNotIn("GOAL", summary)
        self.assertNotIn("Socket", self.read(self.record), "no run went over NCCL's Socket")

    def test_too_little_time(self):
        rc, out = self.run_check(GPU_CHECK_BUDGET_S="40")
        self.assertEqual(rc, 2, out)
        self.assertIn("FAIL: not enough time left for the nccl-tests runs", out)
        self.assert_mps_stopped()

    def test_killed_in_the_middle_stops_mps_and_the_ranks(self):
        p = subprocess.Popen(["bash", SCRIPT, "--kit", self.kit, "--plugin-dir", SO_DIR, "--ranks", "8"],
                             env=self.env(FAKE_HANG="all_reduce:8:rustnet"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while not os.path.isdir(os.path.join(self.state, "pids")) or \
                len(os.listdir(os.path.join(self.state, "pids"))) < 8:
            self.assertLess(time.monotonic(), deadline, "the hanging run never started")
            time.sleep(0.2)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
        self.assertNotEqual(p.returncode, 0, out)
        self.assertIn("interrupted", out)
        self.assertIn("MPS: stopped", out)
        self.assert_mps_stopped()
        self.assert_no_rank_left()

    def test_leftover_daemon_of_a_killed_run_is_stopped(self):
        live = tempfile.mkdtemp(prefix="rustnet-mps.", dir="/tmp")   # a run still going: left alone
        os.makedirs(os.path.join(live, "pipe"))
        with open(os.path.join(live, "owner"), "w") as f:
            f.write(str(os.getpid()))
        self.addCleanup(shutil.rmtree, live, True)
        old = tempfile.mkdtemp(prefix="rustnet-mps.", dir="/tmp")
        env = self.env(CUDA_MPS_PIPE_DIRECTORY=os.path.join(old, "pipe"), CUDA_MPS_LOG_DIRECTORY=os.path.join(old, "log"))
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
        self.before.discard(old)
        rc, out = self.run_check("--ranks", "2", "--repeats", "1", "--no-extras")
        self.assertEqual(rc, 0, out)
        self.assertIn("PARTIAL PLAN", out)
        self.assertIn(f"MPS: stopping a leftover daemon of an earlier run ({old})", out)
        self.assertFalse(os.path.exists(old))
        self.assertTrue(os.path.exists(live))
        lines = self.read(self.mpsrec).split()
        self.assertEqual(lines[0:4], ["start", os.path.join(old, "pipe"), "quit", os.path.join(old, "pipe")])


if __name__ == "__main__":
    unittest.main()
