"""Run torch_sweep.py or ddp_check.py with fake_torch_worker.py as the rank
script and torch taken as present (used by fake_python.sh)."""

import importlib.util
import os
import sys

script = sys.argv[1]
sys.path.insert(0, os.path.dirname(script))
spec = importlib.util.spec_from_file_location("under_test", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_torch_worker.py")
mod.torch_available = lambda: True
sys.exit(mod.main(sys.argv[2:]))
