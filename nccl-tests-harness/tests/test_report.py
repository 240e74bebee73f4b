import csv
import os
import tempfile
import unittest
import xml.etree.ElementTree as ET

import _util  # noqa: F401
from ncclharness.report import (compare, describe_verdict, format_ratio_matrix, format_table, read_measurements_csv, svg_plot,
                                verdict, write_comparison_csv, write_measurements_csv, write_report)

MiB = 1 << 20


def m(net, coll, size, busbw, t=100.0):
    return {"source": "torch", "net": net, "network": "rustnet" if net == "plugin" else "Socket",
            "collective": coll, "nranks": 2, "size": size, "time_us": t, "algbw": busbw, "busbw": busbw,
            "iters": 5}


def sample(plugin_factor=1.1):
    out = []
    for coll in ("all_reduce", "sendrecv"):
        for i, size in enumerate([64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB]):
            b = 0.5 + i
            out.append(m("builtin", coll, size, b))
            out.append(m("plugin", coll, size, b * plugin_factor))
    return out


class Compare(unittest.TestCase):
    def test_pairs_and_ratio(self):
        rows = compare(sample(1.1))
        self.assertEqual(len(rows), 10)
        self.assertEqual([r["collective"] for r in rows[:5]], ["all_reduce"] * 5)   # nccl-tests order
        self.assertAlmostEqual(rows[0]["ratio"], 1.1)
        self.assertEqual(rows[0]["size"], 64 << 10)

    def test_goal_met(self):
        v = verdict(compare(sample(1.0)))     # equal counts as met (>=)
        self.assertTrue(v["ok"])
        self.assertEqual(v["checked"], 6)     # 3 sizes >= 1 MiB x 2 collectives
        self.assertIn("GOAL MET", describe_verdict(v))

    def test_small_sizes_do_not_count(self):
        ms = sample(1.0)
        for x in ms:
            if x["net"] == "plugin" and x["size"] < MiB:
                x["busbw"] = 0.01
        self.assertTrue(verdict(compare(ms))["ok"])

    def test_goal_not_met_names_the_points(self):
        ms = sample(1.0)
        for x in ms:
            if x["net"] == "plugin" and x["collective"] == "sendrecv" and x["size"] == 4 * MiB:
                x["busbw"] *= 0.9
        v = verdict(compare(ms))
        self.assertFalse(v["ok"])
        self.assertEqual(len(v["below"]), 1)
        text = describe_verdict(v)
        self.assertIn("GOAL NOT MET", text)
        self.assertIn("sendrecv", text)
        self.assertIn("4 MiB", text)
        self.assertIn("lowest ratio rustnet/Socket: 0.900", text)

    def test_one_sided_size_is_not_a_pass(self):
        ms = [x for x in sample(1.2) if not (x["net"] == "builtin" and x["size"] == 16 * MiB)]
        v = verdict(compare(ms))
        self.assertFalse(v["ok"])
        self.assertEqual(len(v["missing"]), 2)
        self.assertIn("missing", describe_verdict(v))

    def test_nothing_measured(self):
        v = verdict(compare([m("plugin", "all_reduce", 1024, 1.0)]))
        self.assertFalse(v["ok"])
        self.assertIn("GOAL NOT SHOWN", describe_verdict(v))

    def test_ratio_matrix(self):
        text = format_ratio_matrix(compare(sample(0.95)))
        lines = text.splitlines()
        self.assertIn("all_reduce", lines[1])
        self.assertIn("sendrecv", lines[1])
        self.assertEqual(len(lines), 2 + 5)           # header + 5 sizes
        self.assertIn("0.950<", lines[-1])            # 16 MiB below goal
        self.assertNotIn("<", lines[2])                # 64 KiB: below 1 MiB, not marked

    def test_table(self):
        text = format_table(compare(sample(0.95)), title="T")
        self.assertIn("all_reduce: busbw (GB/s)", text)
        self.assertIn("16 MiB", text)
        self.assertIn("0.950", text)
        self.assertIn("  <", text)    # marks points below the goal


class Files(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def test_csv_roundtrip(self):
        path = os.path.join(self.d, "r.csv")
        ms = sample()
        write_measurements_csv(path, ms)
        back = read_measurements_csv(path)
        self.assertEqual(len(back), len(ms))
        self.assertEqual(back[0]["size"], ms[0]["size"])
        self.assertAlmostEqual(back[1]["busbw"], ms[1]["busbw"])
        self.assertIsNone(back[0]["inplace_busbw"])
        self.assertFalse(os.path.exists(path + ".tmp"))

    def test_comparison_csv(self):
        path = os.path.join(self.d, "c.csv")
        write_comparison_csv(path, compare(sample()))
        with open(path) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(rows[0]["collective"], "all_reduce")
        self.assertAlmostEqual(float(rows[0]["ratio"]), 1.1)

    def test_svg_is_well_formed_and_has_both_series(self):
        path = os.path.join(self.d, "p.svg")
        svg_plot(path, sample(), "busbw <plugin> & built-in")   # title needs escaping
        root = ET.parse(path).getroot()
        ns = "{http://www.w3.org/2000/svg}"
        self.assertEqual(root.tag, ns + "svg")
        polylines = root.findall(f".//{ns}polyline")
        self.assertEqual(len(polylines), 4)            # 2 collectives x 2 networks
        for pl in polylines:
            self.assertEqual(len(pl.get("points").split()), 5)
        texts = [t.text for t in root.iter(ns + "text")]
        self.assertIn("busbw <plugin> & built-in", texts)
        self.assertIn("all_reduce", texts)
        self.assertIn("1M", texts)
        self.assertIn("rustnet busbw", texts)
        self.assertIn("Socket busbw", texts)
        # points lie inside the drawing
        w, h = float(root.get("width")), float(root.get("height"))
        for pl in polylines:
            for pt in pl.get("points").split():
                x, y = map(float, pt.split(","))
                self.assertTrue(0 <= x <= w and 0 <= y <= h, pt)

    def test_svg_single_size(self):
        path = os.path.join(self.d, "one.svg")
        svg_plot(path, [m("plugin", "alltoall", MiB, 0.0), m("builtin", "alltoall", MiB, 0.0)], "zero")
        ET.parse(path)

    def test_write_report(self):
        v = write_report(self.d, sample(), "title", proofs=["rustnet: proven"], echo=False)
        self.assertTrue(v["ok"])
        for f in ("results.csv", "comparison.csv", "busbw.svg", "report.txt"):
            self.assertTrue(os.path.exists(os.path.join(self.d, f)), f)
        with open(os.path.join(self.d, "report.txt")) as f:
            text = f.read()
        self.assertIn("GOAL MET", text)
        self.assertIn("rustnet: proven", text)


if __name__ == "__main__":
    unittest.main()
