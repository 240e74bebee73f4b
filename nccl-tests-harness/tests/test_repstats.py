"""Median, range and the verdict over repeated, interleaved runs."""

import unittest

import _util  # noqa: F401  (import path)
from ncclharness.repstats import (aggregate, describe_verdict, format_points, format_ratio_matrix,
                                  plot_series, summary_rows, verdict)

M = 1 << 20


def meas(coll, n, net, size, rep, busbw):
    return {"collective": coll, "nranks": n, "net": net, "size": size, "rep": rep, "busbw": busbw}


def full(plugin, builtin, colls=("all_reduce", "sendrecv"), ranks=(2, 4, 8), sizes=(M, 16 * M)):
    """Every judged point with the given per-repeat values."""
    out = []
    for c in colls:
        for n in ranks:
            for s in sizes:
                for rep, (p, b) in enumerate(zip(plugin, builtin), 1):
                    out.append(meas(c, n, "plugin", s, rep, p))
                    out.append(meas(c, n, "builtin", s, rep, b))
    return out


class Aggregate(unittest.TestCase):
    def test_median_range_paired(self):
        pts = aggregate([meas("all_reduce", 2, "plugin", M, 1, 3.0), meas("all_reduce", 2, "plugin", M, 2, 1.0),
                         meas("all_reduce", 2, "plugin", M, 3, 2.0),
                         meas("all_reduce", 2, "builtin", M, 1, 2.0), meas("all_reduce", 2, "builtin", M, 2, 2.5),
                         meas("all_reduce", 2, "builtin", M, 3, 1.0)])
        self.assertEqual(len(pts), 1)
        p = pts[0]
        self.assertEqual((p.plugin.median, p.plugin.lo, p.plugin.hi, p.plugin.n), (2.0, 1.0, 3.0, 3))
        self.assertEqual((p.builtin.median, p.builtin.lo, p.builtin.hi), (2.0, 1.0, 2.5))
        self.assertAlmostEqual(p.ratio, 1.0)
        # per-repeat ratios pair the runs of the same repeat: 3/2, 1/2.5, 2/1
        self.assertEqual([round(r, 3) for r in p.paired], [1.5, 0.4, 2.0])

    def test_even_count_median_is_the_mean_of_the_middle_two(self):
        pts = aggregate([meas("sendrecv", 4, "plugin", M, r, v) for r, v in ((1, 1.0), (2, 4.0), (3, 2.0), (4, 3.0))])
        self.assertEqual(pts[0].plugin.median, 2.5)
        self.assertIsNone(pts[0].ratio)            # no built-in side
        self.assertEqual(pts[0].builtin.n, 0)

    def test_points_are_per_collective_ranks_size_in_order(self):
        pts = aggregate([meas("sendrecv", 2, "plugin", M, 1, 1), meas("all_reduce", 8, "plugin", M, 1, 1),
                         meas("all_reduce", 2, "plugin", 4 * M, 1, 1), meas("all_reduce", 2, "plugin", M, 1, 1)])
        self.assertEqual([p.key for p in pts], [("all_reduce", 2, M), ("all_reduce", 2, 4 * M),
                                                ("all_reduce", 8, M), ("sendrecv", 2, M)])


class Verdict(unittest.TestCase):
    def test_met_on_the_median_even_with_one_repeat_below(self):
        v = verdict(aggregate(full(plugin=(2.2, 1.5, 2.4), builtin=(2.0, 2.0, 2.0))), sizes=[M, 16 * M])
        self.assertTrue(v.ok, describe_verdict(v))
        self.assertEqual(v.checked, 12)
        self.assertIn("GOAL MET", describe_verdict(v))

    def test_not_met_lists_the_points_below(self):
        data = full(plugin=(2.2, 2.2, 2.2), builtin=(2.0, 2.0, 2.0))
        data = [dict(m, busbw=1.0) if (m["net"], m["collective"], m["nranks"], m["size"]) ==
                ("plugin", "sendrecv", 8, 16 * M) else m for m in data]
        v = verdict(aggregate(data))
        self.assertFalse(v.ok)
        self.assertEqual([p.key for p in v.below], [("sendrecv", 8, 16 * M)])
        text = describe_verdict(v)
        self.assertIn("GOAL NOT MET", text)
        self.assertIn("below: sendrecv    n=8    16 MiB  median 1.000 < 2.000", text)
        self.assertIn("lowest median ratio rustnet/Socket: 0.500", text)

    def test_sizes_below_1mib_do_not_count(self):
        data = full(plugin=(2.2,) * 3, builtin=(2.0,) * 3) + [
            meas("all_reduce", 2, n, 256 << 10, r, v) for r in (1, 2, 3) for n, v in (("plugin", 0.1), ("builtin", 1))]
        self.assertTrue(verdict(aggregate(data)).ok)

    def test_missing_repeat_makes_it_incomplete_not_a_pass(self):
        data = [m for m in full(plugin=(2.2,) * 3, builtin=(2.0,) * 3)
                if not (m["collective"] == "all_reduce" and m["nranks"] == 4 and m["rep"] == 3 and m["net"] == "plugin")]
        v = verdict(aggregate(data))
        self.assertFalse(v.ok)
        self.assertFalse(v.shown)
        self.assertEqual(len(v.incomplete), 2)   # 1 MiB and 16 MiB of all_reduce n=4
        self.assertIn("GOAL NOT SHOWN", describe_verdict(v))
        self.assertIn("2 plugin / 3 built-in value(s) of 3", describe_verdict(v))

    def test_a_rank_count_without_data_is_incomplete(self):
        data = [m for m in full(plugin=(2.2,) * 3, builtin=(2.0,) * 3) if m["nranks"] != 8]
        v = verdict(aggregate(data))
        self.assertFalse(v.ok)
        self.assertIn((("all_reduce", 8, 0), "no measurement >= 1 MiB"), v.incomplete)

    def test_a_planned_size_without_data_is_incomplete(self):
        data = [m for m in full(plugin=(2.2,) * 3, builtin=(2.0,) * 3) if m["size"] != 16 * M]
        v = verdict(aggregate(data), sizes=[256 << 10, M, 16 * M])
        self.assertFalse(v.ok)
        self.assertEqual(len(v.incomplete), 6)
        self.assertTrue(all(why == "not measured" for _k, why in v.incomplete))

    def test_stretch(self):
        v = verdict(aggregate(full(plugin=(2.5,) * 3, builtin=(2.0,) * 3)))
        self.assertTrue(v.stretch_ok)
        self.assertEqual(v.stretch_checked, 6)     # 16 MiB only, 2 tests x 3 rank counts
        self.assertIn("STRETCH MET", describe_verdict(v))
        v = verdict(aggregate(full(plugin=(2.2,) * 3, builtin=(2.0,) * 3)))
        self.assertTrue(v.ok)
        self.assertFalse(v.stretch_ok)
        self.assertIn("STRETCH NOT MET: median ratio >= 1.2x at every size >= 16 MiB: 0 of 6", describe_verdict(v))


class Output(unittest.TestCase):
    def setUp(self):
        self.pts = aggregate(full(plugin=(2.2, 1.5, 2.4), builtin=(2.0, 2.1, 1.9), ranks=(2,), sizes=(M,)))

    def test_table_has_median_range_and_counts(self):
        t = format_points(self.pts)
        self.assertIn("all_reduce, 2 ranks", t)
        self.assertIn("1 MiB            2.200  1.500-2.400   3           2.000  1.900-2.100   3   1.100", t)
        self.assertIn("0.714-1.263", t)   # 1.5/2.1 .. 2.4/1.9

    def test_ratio_matrix(self):
        t = format_ratio_matrix(self.pts)
        self.assertIn("all_reduce n=2", t)
        self.assertIn("1.100", t)

    def test_summary_rows_and_plot_series(self):
        rows = summary_rows(self.pts)
        self.assertEqual(rows[0]["plugin_median"], 2.2)
        self.assertEqual((rows[0]["plugin_min"], rows[0]["plugin_max"]), (1.5, 2.4))
        self.assertEqual((rows[0]["goal_point"], rows[0]["below_goal"]), (1, 0))
        s = plot_series(self.pts)
        self.assertEqual({(m["collective"], m["net"]) for m in s},
                         {("all_reduce n=2", "plugin"), ("all_reduce n=2", "builtin"),
                          ("sendrecv n=2", "plugin"), ("sendrecv n=2", "builtin")})
        self.assertEqual([(m["busbw"], m["busbw_lo"], m["busbw_hi"]) for m in s if m["net"] == "plugin"][0],
                         (2.2, 1.5, 2.4))


if __name__ == "__main__":
    unittest.main()
