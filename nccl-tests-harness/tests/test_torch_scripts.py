"""torch_sweep.py and ddp_check.py without torch: importable, clear message
when torch is missing, and their orchestration (rank processes, per-rank
environment, log proof, refusal, report, loss comparison) driven end to end
with a stand-in rank script."""

import contextlib
import glob
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from _util import HARNESS, TESTS
import ddp_check  # noqa: E402
import torch_sweep  # noqa: E402
from ncclharness.ranks import torch_available

FAKE = os.path.join(TESTS, "fakes", "fake_torch_worker.py")


class WithoutTorch(unittest.TestCase):
    def test_modules_do_not_import_torch(self):
        self.assertNotIn("torch", sys.modules)

    @unittest.skipIf(torch_available(), "torch is installed here")
    def test_missing_torch_is_explained(self):
        for script in ("torch_sweep.py", "ddp_check.py"):
            for extra in ([], ["--worker", "--net", "plugin", "--result", "/tmp/x.json"]):
                out = subprocess.run([sys.executable, os.path.join(HARNESS, script), "--plugin-dir", "/nonexistent"]
                                     + extra, capture_output=True, text=True, timeout=60)
                self.assertEqual(out.returncode, 3, out.stderr)
                self.assertIn("PyTorch is not importable", out.stderr)

    def test_help(self):
        for script in ("torch_sweep.py", "ddp_check.py", "run_nccl_tests.py"):
            out = subprocess.run([sys.executable, os.path.join(HARNESS, script), "--help"],
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 0)
            self.assertIn("usage", out.stdout)


class Orchestration(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        d = self.tmp.name
        self.plugin = os.path.join(d, "kit")
        os.makedirs(self.plugin)
        with open(os.path.join(self.plugin, "librustnet.so"), "wb") as f:
            f.write(b"\x7fELF" + b"\0" * 60)
        self.out = os.path.join(d, "out")
        self.patches = [mock.patch.object(torch_sweep, "WORKER_SCRIPT", FAKE),
                        mock.patch.object(ddp_check, "WORKER_SCRIPT", FAKE),
                        mock.patch.object(torch_sweep, "torch_available", return_value=True),
                        mock.patch.object(ddp_check, "torch_available", return_value=True),
                        mock.patch.dict(os.environ, {}, clear=False)]
        for p in self.patches:
            p.start()
        for k in ("FAKE_FALLBACK", "FAKE_SLOW_PLUGIN", "FAKE_DDP_DRIFT", "FAKE_RC", "OUT"):
            os.environ.pop(k, None)

    def tearDown(self):
        for p in reversed(self.patches):
            p.stop()
        self.tmp.cleanup()

    def call(self, mod, *argv):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = mod.main(list(argv))
        return rc, buf.getvalue()

    def sweep(self, *extra):
        return self.call(torch_sweep, "--plugin-dir", self.plugin, "--out", self.out, "--timeout", "60",
                         "--nranks", "3", *extra)

    def test_sweep_both_networks(self):
        rc, out = self.sweep("--rustnet-transport", "socket")
        self.assertEqual(rc, 0, out)
        self.assertIn("GOAL MET", out)
        self.assertIn("rustnet: proven rustnet", out)
        self.assertIn("Socket: proven Socket", out)
        self.assertIn("RUSTNET_TRANSPORT=socket", out)
        for f in ("results.csv", "comparison.csv", "busbw.svg", "report.txt", "torch-plugin.json",
                  "torch-builtin.json"):
            self.assertTrue(os.path.exists(os.path.join(self.out, f)), f)
        # every rank had its own NCCL_HOSTID, all on the same device, same rendezvous
        hostids, devices = set(), set()
        for path in glob.glob(os.path.join(self.out, "logs", "torch-plugin-rank*.nccl.log")):
            with open(path) as f:
                text = f.read()
            hostids.add(text.split("NCCL_HOSTID set by environment to ")[1].split()[0])
            devices.add(text.split(" device ")[1].split()[0])
        self.assertEqual(hostids, {"rustnet-harness-rank0", "rustnet-harness-rank1", "rustnet-harness-rank2"})
        self.assertEqual(devices, {"0"})

    def test_sweep_goal_not_met(self):
        os.environ["FAKE_SLOW_PLUGIN"] = "1"
        rc, out = self.sweep()
        self.assertEqual(rc, 1, out)
        self.assertIn("GOAL NOT MET", out)
        self.assertIn("below: all_reduce", out)

    def test_sweep_fallback_refused(self):
        os.environ["FAKE_FALLBACK"] = "1"
        rc, out = self.sweep("--no-force-net")
        self.assertEqual(rc, 2, out)
        self.assertIn("REFUSED", out)
        self.assertIn("(a fallback)", out)
        self.assertIn("torch sweep over rustnet: network not proven", out)

    def test_rank_failure_reported(self):
        os.environ["FAKE_RC"] = "7"
        rc, out = self.sweep("--nets", "builtin")
        self.assertEqual(rc, 2, out)
        self.assertIn("exit status 7", out)

    def test_report_from_worker_results(self):
        rc, _ = self.sweep()
        self.assertEqual(rc, 0)
        # the real worker stores its gathered log summaries in the JSON; add them as it would
        from ncclharness.launch import read_text
        from ncclharness.nccllog import merge_logs, parse_nccl_log
        for net in ("plugin", "builtin"):
            path = os.path.join(self.out, f"torch-{net}.json")
            with open(path) as f:
                res = json.load(f)
            logs = merge_logs(*[parse_nccl_log(read_text(p)) for p in
                                glob.glob(os.path.join(self.out, "logs", f"torch-{net}-rank*.nccl.log"))])
            res["rank_logs"] = [p.to_dict() for p in logs.values()]
            with open(path, "w") as f:
                json.dump(res, f)
        out2 = os.path.join(self.tmp.name, "report")
        rc, out = self.call(torch_sweep, "--report-from", os.path.join(self.out, "torch-plugin.json"),
                            os.path.join(self.out, "torch-builtin.json"), "--out", out2)
        self.assertEqual(rc, 0, out)
        self.assertTrue(os.path.exists(os.path.join(out2, "busbw.svg")))
        # a result whose ranks left no log summary proves nothing: refused
        bare = os.path.join(self.tmp.name, "bare.json")
        with open(os.path.join(self.out, "torch-plugin.json")) as f:
            res = json.load(f)
        res["rank_logs"] = []
        with open(bare, "w") as f:
            json.dump(res, f)
        rc, out = self.call(torch_sweep, "--report-from", bare, "--out", out2)
        self.assertEqual(rc, 2, out)
        self.assertIn("REFUSED", out)

    def test_ddp_match(self):
        rc, out = self.call(ddp_check, "--plugin-dir", self.plugin, "--out", self.out, "--timeout", "60",
                            "--steps", "12")
        self.assertEqual(rc, 0, out)
        self.assertIn("DDP CHECK PASSED", out)
        self.assertIn("rank 1: rustnet vs Socket: MATCH over 12 steps", out)
        self.assertIn("bitwise identical: yes", out)
        self.assertIn("rustnet vs reference: MATCH", out)
        with open(os.path.join(self.out, "losses.csv")) as f:
            header = f.readline().strip()
        self.assertEqual(header, "step,rank,rustnet,Socket,reference")

    def test_ddp_drift_fails(self):
        os.environ["FAKE_DDP_DRIFT"] = "1"
        rc, out = self.call(ddp_check, "--plugin-dir", self.plugin, "--out", self.out, "--timeout", "60",
                            "--steps", "12", "--no-reference")
        self.assertEqual(rc, 2, out)
        self.assertIn("MISMATCH", out)
        self.assertIn("step 5", out)
        self.assertIn("DDP CHECK FAILED", out)

    def test_ddp_fallback_refused(self):
        os.environ["FAKE_FALLBACK"] = "1"
        rc, out = self.call(ddp_check, "--plugin-dir", self.plugin, "--out", self.out, "--timeout", "60",
                            "--steps", "4", "--no-force-net")
        self.assertEqual(rc, 2, out)
        self.assertIn("REFUSED rustnet", out)


class CompareRuns(unittest.TestCase):
    def run_result(self, net, losses, digest="d"):
        return {"net": net, "network": "rustnet" if net == "plugin" else "Socket", "world_size": len(losses),
                "steps": len(losses[0]), "losses": losses, "digests": [digest] * len(losses), "errors": []}

    def test_digest_difference_is_informational(self):
        a = self.run_result("plugin", [[1.0, 0.9], [1.1, 1.0]], "x")
        b = self.run_result("builtin", [[1.0, 0.9], [1.1, 1.0]], "y")
        ok, lines, rows = ddp_check.compare_runs({"plugin": a, "builtin": b})
        self.assertTrue(ok)
        self.assertIn("differ in some bits", "\n".join(lines))
        self.assertEqual(len(rows), 4)

    def test_shape_mismatch(self):
        a = self.run_result("plugin", [[1.0, 0.9]])
        b = self.run_result("builtin", [[1.0, 0.9], [1.0, 0.9]])
        ok, lines, _ = ddp_check.compare_runs({"plugin": a, "builtin": b})
        self.assertFalse(ok)

    def test_rank_parameter_disagreement_fails(self):
        a = self.run_result("plugin", [[1.0]])
        a["errors"] = ["ranks ended with different parameters: aaa, bbb"]
        ok, lines, _ = ddp_check.compare_runs({"plugin": a, "builtin": self.run_result("builtin", [[1.0]])})
        self.assertFalse(ok)


if __name__ == "__main__":
    unittest.main()
