"""gpu-check.sh end to end with a stand-in python (tests/fakes/fake_python.sh):
the real plugin file is probed, the real torch_sweep.py and ddp_check.py
orchestrate stand-in ranks, and the script's budget, steps, summary and exit
status are checked. Needs the built plugin (cargo build --release)."""

import os
import subprocess
import sys
import tempfile
import unittest

from _util import HARNESS, REPO, TESTS
from fakekit import make_fake_kit

SO_DIR = os.path.join(REPO, "target", "release")


@unittest.skipUnless(os.path.exists(os.path.join(SO_DIR, "librustnet.so")), "plugin not built")
class GpuCheckScript(unittest.TestCase):
    """The torch path (no nccl-tests kit): MPS from the stand-in control tool."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        _kit, self.mpsbin = make_fake_kit(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def run_script(self, extra_env=None, *args, mps=True):
        with tempfile.TemporaryDirectory() as out:
            env = dict(os.environ, OUT=out, PYTHON=os.path.join(TESTS, "fakes", "fake_python.sh"),
                       REAL_PYTHON=sys.executable, **(extra_env or {}))
            for k in ("FAKE_FALLBACK", "FAKE_SLOW_PLUGIN", "FAKE_DDP_DRIFT", "FAKE_RC", "FAKE_MPS_IGNORED"):
                env.pop(k, None)
            env.update(extra_env or {})
            if mps:
                env["PATH"] = self.mpsbin + os.pathsep + env["PATH"]
            # --torch: this class tests the torch path even where .gpu/nccl-kit exists
            p = subprocess.run(["bash", os.path.join(HARNESS, "gpu-check.sh"), "--torch", "--plugin-dir", SO_DIR,
                                *args],
                               env=env, capture_output=True, text=True, timeout=300)
            files = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
            summary = ""
            if "summary.txt" in files:
                with open(os.path.join(out, "summary.txt")) as f:
                    summary = f.read()
            return p.returncode, p.stdout + p.stderr, files, summary

    def test_pass(self):
        rc, out, files, summary = self.run_script(None, "--quick")
        self.assertEqual(rc, 0, out)
        self.assertIn("exports v6, v7, v8, v9, v10, v11, v12; vtable name(s): rustnet", out)
        self.assertIn("GOAL MET", summary)
        self.assertIn("DDP CHECK PASSED", summary)
        self.assertIn("busbw ratio rustnet/Socket", summary)
        self.assertIn("timings: preflight", summary)
        self.assertIn("MPS PROVEN", summary)
        self.assertIn("MPS: stopped", out)
        for f in ("gpu-check.log", "summary.txt", "sweep/busbw.svg", "sweep/comparison.csv", "sweep/results.csv",
                  "sweep/report.txt", "ddp/losses.csv", "ddp/ddp-report.txt"):
            self.assertIn(f, files)
        self.assertTrue(any(f.startswith("sweep/logs/torch-plugin-rank1") for f in files))

    def test_goal_not_met_exit_1(self):
        rc, out, _files, summary = self.run_script({"FAKE_SLOW_PLUGIN": "1"}, "--quick")
        self.assertEqual(rc, 1, out)
        self.assertIn("GOAL NOT MET", summary)

    def test_refusal_exit_2(self):
        rc, out, _files, summary = self.run_script({"FAKE_FALLBACK": "1"}, "--quick")
        self.assertEqual(rc, 2, out)
        self.assertIn("REFUSED", out)

    def test_no_mps_no_verdict_exit_4(self):
        """Without nvidia-cuda-mps-control nothing runs and the exit is 4,
        neither pass (0) nor fail (1/2)."""
        rc, out, files, _summary = self.run_script(None, "--quick", mps=False)
        self.assertEqual(rc, 4, out)
        self.assertIn("NO VERDICT: nvidia-cuda-mps-control is not on PATH", out)
        self.assertNotIn("torch sweep", out)
        self.assertFalse(any(f.startswith("sweep/") for f in files))

    def test_ranks_not_mps_clients_exit_4(self):
        """MPS up, but the ranks never reached it (they would time-slice):
        the numbers are printed, the verdict is refused."""
        rc, out, _files, summary = self.run_script({"FAKE_MPS_IGNORED": "1"}, "--quick")
        self.assertEqual(rc, 4, out)
        self.assertIn("MPS NOT PROVEN", summary)
        self.assertIn("NO VERDICT", summary)
        self.assertIn("GOAL MET", summary)   # the sweep itself was fine

    def test_no_plugin(self):
        with tempfile.TemporaryDirectory() as empty:
            p = subprocess.run(["bash", os.path.join(HARNESS, "gpu-check.sh"), "--torch", "--plugin-dir", empty],
                               env=dict(os.environ, OUT=empty, PYTHON=os.path.join(TESTS, "fakes", "fake_python.sh"),
                                        REAL_PYTHON=sys.executable,
                                        PATH=self.mpsbin + os.pathsep + os.environ["PATH"]),
                               capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2)
        self.assertIn("does not load", p.stdout)


if __name__ == "__main__":
    unittest.main()
