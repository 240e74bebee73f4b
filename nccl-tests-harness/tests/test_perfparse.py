import unittest

from _util import fixture
from ncclharness.perfparse import parse_perf_output


class PerfParse(unittest.TestCase):
    def test_mpi_two_ranks(self):
        p = parse_perf_output(fixture("all_reduce_perf.mpi2.txt"))
        self.assertEqual(len(p.rows), 13)
        self.assertEqual(p.nranks, 2)
        self.assertEqual([r["pid"] for r in p.ranks], [41630, 41631])
        self.assertEqual(p.ranks[0]["host"], "gpu-node")
        first, last = p.rows[0], p.rows[-1]
        self.assertEqual((first.size, first.count, first.dtype, first.redop), (1024, 256, "float", "sum"))
        self.assertAlmostEqual(first.oop_time_us, 60.12)
        self.assertEqual(last.size, 4194304)
        self.assertAlmostEqual(last.oop_busbw, 1.82)
        self.assertAlmostEqual(last.ip_time_us, 2299.4)
        self.assertEqual(last.oop_wrong, 0)
        self.assertAlmostEqual(p.avg_busbw, 0.692308)
        self.assertEqual(p.out_of_bounds, 0)
        self.assertEqual((p.nthreads, p.ngpus), (1, 1))
        self.assertTrue(p.concluded)
        self.assertEqual(p.failures, [])
        self.assertEqual(p.wrong_total(), 0)

    def test_validation_off_and_log_lines_mixed_in(self):
        p = parse_perf_output(fixture("sendrecv_perf.old-format.txt"))
        self.assertEqual(len(p.rows), 3)
        self.assertIsNone(p.rows[0].oop_wrong)      # "N/A": -c 0
        self.assertEqual(p.rows[1].redop, "none")
        self.assertEqual({r["pid"] for r in p.ranks}, {7001})
        self.assertEqual(p.ngpus, 2)
        self.assertFalse(p.concluded)

    def test_wrong_elements_and_oob_failure(self):
        p = parse_perf_output(fixture("alltoall_perf.wrong.txt"))
        self.assertEqual(p.wrong_total(), 4096)
        self.assertEqual(p.out_of_bounds, 1)
        self.assertTrue(any("FAILED" in f for f in p.failures))

    def test_per_iteration_columns_do_not_shift_fields(self):
        p = parse_perf_output(fixture("all_gather_perf.per-iter.txt"))
        (r,) = p.rows
        self.assertAlmostEqual(r.oop_busbw, 1.05)
        self.assertAlmostEqual(r.ip_time_us, 1001.0)   # second "time", not i_min
        self.assertAlmostEqual(r.ip_busbw, 1.05)
        self.assertEqual(r.ip_wrong, 0)

    def test_failure_lines(self):
        text = fixture("all_reduce_perf.mpi2.txt").replace(
            "# Out of bounds values : 0 OK",
            "gpu-node: Test NCCL failure common.cu:412 'unhandled system error'\n# Out of bounds values : 0 OK")
        p = parse_perf_output(text)
        self.assertEqual(len(p.failures), 1)

    def test_without_header_uses_default_layout(self):
        p = parse_perf_output("     1048576        262144     float     sum      -1    640.5    1.64    1.64      0"
                              "    638.1    1.64    1.64      0\n")
        self.assertEqual(p.rows[0].size, 1048576)
        self.assertAlmostEqual(p.rows[0].ip_busbw, 1.64)

    def test_empty(self):
        p = parse_perf_output("bash: all_reduce_perf: command not found\n")
        self.assertEqual(p.rows, [])
        self.assertIsNone(p.nranks)


if __name__ == "__main__":
    unittest.main()
