"""The harness is a package: its scripts import ncclharness without editing
sys.path, and pyproject.toml's commands name functions that exist."""

import importlib
import os
import re
import subprocess
import sys
import unittest

from _util import HARNESS

SCRIPTS = ["run_nccl_tests.py", "torch_sweep.py", "ddp_check.py"]


class Package(unittest.TestCase):
    def test_no_sys_path_edits(self):
        files = [os.path.join(HARNESS, s) for s in SCRIPTS]
        pkg = os.path.join(HARNESS, "ncclharness")
        files += [os.path.join(pkg, f) for f in os.listdir(pkg) if f.endswith(".py")]
        for f in files:
            with open(f) as fh:
                text = fh.read()
            self.assertIsNone(re.search(r"sys\.path\.(insert|append)|sys\.path\s*=", text), f)

    def test_scripts_run_from_any_folder(self):
        # Python puts a script's own folder first on sys.path: that is how they find ncclharness.
        for s in SCRIPTS:
            p = subprocess.run([sys.executable, os.path.join(HARNESS, s), "--help"], cwd="/",
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 0, f"{s}: {p.stderr}")
            self.assertIn("usage:", p.stdout)

    def test_module_commands_from_the_harness_folder(self):
        # gpu-check.sh runs `python3 -m ncclharness.<x>` with the harness folder as cwd
        for m in ("ncclharness.kitbench", "ncclharness.mps"):
            p = subprocess.run([sys.executable, "-m", m, "--help"], cwd=HARNESS, capture_output=True, text=True,
                               timeout=60)
            self.assertEqual(p.returncode, 0, f"{m}: {p.stderr}")

    def test_entry_points_resolve(self):
        try:
            import tomllib
        except ImportError:
            self.skipTest("SKIPPED: tomllib needs Python 3.11+ to read pyproject.toml")
        with open(os.path.join(HARNESS, "pyproject.toml"), "rb") as f:
            meta = tomllib.load(f)
        scripts = meta["project"]["scripts"]
        self.assertTrue(scripts)
        mods = set(meta["tool"]["setuptools"]["py-modules"])
        self.assertEqual(mods, {s[:-3] for s in SCRIPTS})
        for name, target in scripts.items():
            mod, func = target.split(":")
            self.assertTrue(callable(getattr(importlib.import_module(mod), func)), name)


if __name__ == "__main__":
    unittest.main()
