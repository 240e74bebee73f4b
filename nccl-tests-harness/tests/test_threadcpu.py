"""threadcpu: CPU seconds per kind of thread, read from /proc."""

import os
import subprocess
import tempfile
import time
import unittest

import _util  # noqa: F401  (import path)
from ncclharness import threadcpu


class ParseTest(unittest.TestCase):
    def test_stat_line_with_spaces_and_parens_in_the_name(self):
        line = "4242 (NCCL Progress 0) S 1 2 3 4 5 6 7 8 9 10 150 25 0 0 20 0 9 0 100 0 0"
        self.assertEqual(threadcpu.parse_task_stat(line), ("NCCL Progress 0", 175))
        self.assertEqual(threadcpu.parse_task_stat("4242 (a) b) S 1 2 3 4 5 6 7 8 9 10 1 2 0"), ("a) b", 3))

    def test_garbage_is_none(self):
        for bad in ("", "no parens", "1 (x) S 1 2"):
            self.assertIsNone(threadcpu.parse_task_stat(bad))

    def test_kinds(self):
        k = threadcpu.kind_of
        self.assertEqual(k("all_reduce_perf", "all_reduce_perf"), "main")
        self.assertEqual(k("NCCL Progress 0", "all_reduce_perf"), "proxy")
        self.assertEqual(k("NCCL Service  0", "all_reduce_perf"), "proxy")
        self.assertEqual(k("rustnet-tcp-sen", "all_reduce_perf"), "plugin")
        self.assertEqual(k("cuda-EvtHandlr", "all_reduce_perf"), "cuda")
        self.assertEqual(k("whatever", "all_reduce_perf"), "other")

    def test_summary_takes_the_median(self):
        def r(total, idle):
            d = {f"cpu_{k}_s": 0.0 for k in threadcpu.KINDS}
            d.update(cpu_main_s=total, cpu_total_s=total, wall_s=1.0, idle_pct=idle, ranks=2)
            return d
        t = threadcpu.summary_table([("all_reduce", 8, "Socket", r(1.0, 10)),
                                     ("all_reduce", 8, "Socket", r(5.0, 30)),
                                     ("all_reduce", 8, "Socket", r(2.0, 20))])
        row = t.splitlines()[-1].split()
        self.assertEqual(row[:4], ["all_reduce", "8", "Socket", "3"])
        self.assertEqual(row[5], "2.0")       # cpu s: median of 1, 5, 2
        self.assertEqual(row[-1], "20%")


@unittest.skipUnless(os.path.isdir("/proc/self/task"), "needs Linux /proc")
class LiveTest(unittest.TestCase):
    def test_a_busy_process_is_seen_by_its_name(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "busy_perf")
            with open(path, "w") as f:
                f.write("#!/bin/sh\ni=0\nwhile [ $i -lt 100000000 ]; do i=$((i+1)); done\n")
            os.chmod(path, 0o755)
            s = threadcpu.ThreadCpu("busy_perf", period=0.05).start()
            p = subprocess.Popen([path])
            time.sleep(0.8)
            r = s.stop()
            p.kill()
            p.wait()
        self.assertEqual(r["ranks"], 1, r)
        # a share of a loaded machine, but more than nothing
        self.assertGreater(r["cpu_main_s"], 0.0, r)
        self.assertEqual(r["cpu_total_s"], r["cpu_main_s"], r)
        self.assertIn("main", threadcpu.describe(r))


if __name__ == "__main__":
    unittest.main()
