"""run_nccl_tests.py end to end against stand-in nccl-tests binaries and a
stand-in mpirun (tests/fakes), so the command lines, environments, log
proof, refusal and report are exercised without a GPU."""

import contextlib
import csv
import io
import os
import sys
import tempfile
import unittest
from unittest import mock

from _util import HARNESS, TESTS
import run_nccl_tests  # noqa: E402  (path set by _util)

FAKES = os.path.join(TESTS, "fakes")


def write_exe(path, body):
    with open(path, "w") as f:
        f.write(body)
    os.chmod(path, 0o755)


class RunNcclTests(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        d = self.tmp.name
        self.bin = os.path.join(d, "bin")
        self.mpibin = os.path.join(d, "mpibin")
        os.makedirs(self.bin)
        os.makedirs(self.mpibin)
        for coll in ("all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv"):
            write_exe(os.path.join(self.bin, f"{coll}_perf"),
                      f'#!/bin/sh\nexec "{sys.executable}" "{FAKES}/fake_perf.py" "$0" "$@"\n')
            # an "MPI build": the harness recognises it by the MPI_Init it references
            write_exe(os.path.join(self.mpibin, f"{coll}_perf_mpi"),
                      f'#!/bin/sh\n# references MPI_Init\nexec "{sys.executable}" "{FAKES}/fake_perf.py" "$0" "$@"\n')
        self.mpirun = os.path.join(d, "mpirun")
        write_exe(self.mpirun, f'#!/bin/sh\nexec "{sys.executable}" "{FAKES}/fake_mpirun.py" "$@"\n')
        self.plugin = os.path.join(d, "release")
        os.makedirs(self.plugin)
        with open(os.path.join(self.plugin, "librustnet.so"), "wb") as f:
            f.write(b"\x7fELF" + b"\0" * 60)
        self.out = os.path.join(d, "out")
        self.rankdir = os.path.join(d, "ranks")
        os.makedirs(self.rankdir)
        self.env = mock.patch.dict(os.environ, {"FAKE_RANKDIR": self.rankdir}, clear=False)
        self.env.start()
        for k in ("FAKE_FALLBACK", "FAKE_WRONG", "FAKE_P2P", "FAKE_RC", "OUT"):
            os.environ.pop(k, None)

    def tearDown(self):
        self.env.stop()
        self.tmp.cleanup()

    def run_main(self, *extra, tests_dir=None):
        argv = ["--nccl-tests-dir", tests_dir or self.bin, "--plugin-dir", self.plugin, "--out", self.out,
                "-b", "1M", "-e", "4M", "--timeout", "60"] + list(extra)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = run_nccl_tests.main(argv)
        return rc, buf.getvalue()

    def results(self):
        with open(os.path.join(self.out, "results.csv")) as f:
            return list(csv.DictReader(f))

    def test_gpus_layout_both_networks(self):
        rc, out = self.run_main("--layout", "gpus", "--tests", "all_reduce,sendrecv")
        self.assertEqual(rc, 0, out)
        self.assertIn("NCCL_NET_PLUGIN=rustnet", out)
        self.assertIn("NCCL_NET_PLUGIN=none", out)
        self.assertIn("NCCL_P2P_DISABLE=1", out)
        self.assertIn("PROVEN: NCCL's log shows the traffic went over 'rustnet'", out)
        self.assertIn("PROVEN: NCCL's log shows the traffic went over 'Socket'", out)
        self.assertIn("GOAL MET", out)
        rows = self.results()
        self.assertEqual({(r["net"], r["collective"]) for r in rows},
                         {("plugin", "all_reduce"), ("builtin", "all_reduce"),
                          ("plugin", "sendrecv"), ("builtin", "sendrecv")})
        self.assertEqual({r["size"] for r in rows}, {str(1 << 20), str(2 << 20), str(4 << 20)})
        for f in ("comparison.csv", "busbw.svg", "report.txt"):
            self.assertTrue(os.path.exists(os.path.join(self.out, f)), f)
        # NCCL's log went to per-process files, the table to stdout
        logs = os.listdir(os.path.join(self.out, "logs"))
        self.assertTrue(any(n.startswith("all_reduce-plugin.") and n.endswith(".nccl.log") for n in logs), logs)
        # the plugin file NCCL opens was staged under NCCL's name
        self.assertTrue(os.path.islink(os.path.join(self.out, "plugin-lib", "libnccl-net-rustnet.so")))

    def test_silent_fallback_fails_loudly(self):
        os.environ["FAKE_FALLBACK"] = "1"
        rc, out = self.run_main("--layout", "gpus", "--tests", "all_reduce", "--no-force-net")
        self.assertEqual(rc, 2, out)
        self.assertIn("REFUSED: NCCL's log does not prove the traffic went over 'rustnet'", out)
        self.assertIn("(a fallback)", out)
        self.assertIn("FAILED OR REFUSED RUNS", out)
        self.assertEqual({r["net"] for r in self.results()}, {"builtin"})   # refused numbers left out

    def test_forced_network_error_fails(self):
        # NCCL_NET=rustnet but NCCL cannot use the plugin: NCCL errors out (as real NCCL does)
        with mock.patch.object(run_nccl_tests, "network_env", side_effect=_no_plugin_env):
            rc, out = self.run_main("--layout", "gpus", "--tests", "all_reduce", "--nets", "plugin")
        self.assertEqual(rc, 2, out)
        self.assertIn("network rustnet not found", out)
        self.assertIn("exit status 1", out)

    def test_wrong_data_fails(self):
        os.environ["FAKE_WRONG"] = "1"
        rc, out = self.run_main("--layout", "gpus", "--tests", "all_reduce", "--nets", "plugin")
        self.assertEqual(rc, 2, out)
        self.assertIn("wrong elements (#wrong): data corrupted", out)

    def test_p2p_bypass_refused(self):
        os.environ["FAKE_P2P"] = "1"
        rc, out = self.run_main("--layout", "gpus", "--tests", "all_reduce", "--nets", "plugin")
        self.assertEqual(rc, 2, out)
        self.assertIn("bypass the network", out)

    def test_one_gpu_layout_through_mpirun(self):
        record = os.path.join(self.tmp.name, "mpirun-x")
        os.environ["FAKE_MPIRUN_RECORD"] = record
        try:
            rc, out = self.run_main("--tests", "all_reduce", "--mpirun", self.mpirun, "--nranks", "3",
                                    tests_dir=self.mpibin)
        finally:
            os.environ.pop("FAKE_MPIRUN_RECORD")
        self.assertEqual(rc, 0, out)
        self.assertIn("(MPI build)", out)
        self.assertIn("layout: one-gpu, ranks: 3, MPI: openmpi", out)
        self.assertIn("rank-env.sh", out)
        self.assertIn("NCCL_TESTS_DEVICE=0", out)
        self.assertIn("3 process(es) chose 'rustnet'", out)
        with open(record) as f:
            launches = f.read().splitlines()
        self.assertEqual(len(launches), 2)          # plugin run, then built-in run
        forwarded = launches[0].split()
        for k in ("NCCL_NET_PLUGIN", "NCCL_NET", "LD_LIBRARY_PATH", "NCCL_SHM_DISABLE", "NCCL_TESTS_DEVICE",
                  "NCCL_DEBUG_FILE"):
            self.assertIn(k, forwarded)
        rows = self.results()
        self.assertEqual({r["nranks"] for r in rows}, {"3"})
        # 3 ranks: all_reduce busbw factor 4/3
        r0 = [r for r in rows if r["net"] == "plugin"][0]
        self.assertAlmostEqual(float(r0["busbw"]) / float(r0["algbw"]), 4 / 3, delta=0.02)

    def test_no_mpi_and_one_gpu_is_explained(self):
        with mock.patch.object(run_nccl_tests, "count_gpus", return_value=1):
            rc, out = self.run_main("--tests", "all_reduce")
        self.assertEqual(rc, 2)
        self.assertIn("built without MPI", out)
        self.assertIn("torch_sweep.py", out)

    def test_missing_binary(self):
        empty = os.path.join(self.tmp.name, "empty")
        os.makedirs(empty)
        rc, out = self.run_main("--layout", "gpus", tests_dir=empty)
        self.assertEqual(rc, 2)
        self.assertIn("all_reduce_perf not found", out)

    def test_dry_run(self):
        rc, out = self.run_main("--layout", "gpus", "--dry-run", "--env", "NCCL_NSOCKS_PERTHREAD=4")
        self.assertEqual(rc, 0)
        self.assertIn("cmd:", out)
        self.assertIn("NCCL_NSOCKS_PERTHREAD=4", out)
        self.assertFalse(os.path.exists(os.path.join(self.out, "results.csv")))

    def test_rank_env_script(self):
        import subprocess
        script = os.path.join(HARNESS, "rank-env.sh")
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")}
        out = subprocess.run([script, "sh", "-c", "echo $NCCL_HOSTID"], env=dict(env, PMI_RANK="5"),
                             capture_output=True, text=True)
        self.assertEqual(out.stdout.strip(), "rustnet-harness-rank5")
        out = subprocess.run([script, "true"], env=env, capture_output=True, text=True)
        self.assertEqual(out.returncode, 2)
        self.assertIn("no MPI rank", out.stderr)


def _no_plugin_env(net, plugin_dir, base=None, **kw):
    """The plugin environment with a library path where the plugin is not."""
    from ncclharness.envs import network_env
    env = network_env(net, plugin_dir, base, **kw)
    env["LD_LIBRARY_PATH"] = "/nonexistent"
    return env


if __name__ == "__main__":
    unittest.main()
