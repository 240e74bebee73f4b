import unittest

from _util import fixture
from ncclharness.nccllog import check_network, merge_logs, parse_nccl_log


def plugin_logs():
    return merge_logs(parse_nccl_log(fixture("nccl-plugin-rank0.log")),
                      parse_nccl_log(fixture("nccl-plugin-rank1.log")))


class Parse(unittest.TestCase):
    def test_plugin_lines(self):
        procs = parse_nccl_log(fixture("nccl-plugin-rank0.log"))
        (p,) = procs.values()
        self.assertEqual((p.host, p.pid), ("gpu-node", 41630))
        self.assertEqual(p.using_networks, ["rustnet"])
        self.assertEqual(p.loaded_plugins, [["rustnet", 10]])
        self.assertEqual(p.assigned, ["rustnet"])
        self.assertEqual(p.net_channels, {"rustnet": 4})    # the "Channel 00/02 : 0 1" ring lines do not count
        self.assertEqual(p.local_channels, {})
        self.assertEqual(p.plugin_messages, ["using TCP on lo (1 stream(s) per connection)"])
        self.assertEqual(p.nccl_version, "2.28.9+cuda13.0")

    def test_old_format_with_timestamp_and_busid(self):
        procs = parse_nccl_log(fixture("nccl-builtin-2.18.log"))
        (p,) = procs.values()
        self.assertEqual(p.pid, 7001)
        self.assertEqual(p.using_networks, ["Socket"])
        self.assertEqual(p.net_channels, {"Socket": 4})

    def test_warn_lines(self):
        (p,) = parse_nccl_log(fixture("nccl-p2p-leak.log")).values()
        self.assertEqual(len(p.warnings), 1)
        self.assertIn("connection reset", p.warnings[0])
        self.assertEqual(p.local_channels, {"P2P": 2})

    def test_merge_same_process_from_two_sources(self):
        a = parse_nccl_log(fixture("nccl-plugin-rank0.log"))
        m = merge_logs(a, a)
        self.assertEqual(m["gpu-node:41630"].net_channels["rustnet"], 8)
        self.assertEqual(a["gpu-node:41630"].net_channels["rustnet"], 4)   # inputs untouched


class Proof(unittest.TestCase):
    def test_plugin_proven(self):
        proof = check_network(plugin_logs(), "rustnet", expected_processes=2)
        self.assertTrue(proof.ok, proof.describe())
        text = proof.describe()
        self.assertIn("PROVEN", text)
        self.assertIn("8 channel connection(s) via NET/rustnet", text)
        self.assertIn("loaded as ncclNet v10 by 2 process(es)", text)
        self.assertIn("using TCP on lo", text)
        self.assertIn("NCCL 2.28.9", text)

    def test_expected_process_list_from_nccl_tests(self):
        proof = check_network(plugin_logs(), "rustnet",
                              expected_processes=[("gpu-node", 41630), ("gpu-node.example.com", 41631)])
        self.assertTrue(proof.ok, proof.describe())
        proof = check_network(plugin_logs(), "rustnet", expected_processes=[("gpu-node", 41630), ("gpu-node", 9)])
        self.assertFalse(proof.ok)
        self.assertIn("gpu-node:9", proof.describe())

    def test_silent_fallback_is_refused(self):
        procs = parse_nccl_log(fixture("nccl-fallback.log"))
        proof = check_network(procs, "rustnet", expected_processes=2)
        self.assertFalse(proof.ok)
        text = proof.describe()
        self.assertIn("REFUSED", text)
        self.assertIn("used network 'Socket', not 'rustnet' (a fallback)", text)
        self.assertIn("via NET/Socket, not NET/rustnet", text)
        self.assertIn("no channel connection 'via NET/rustnet/'", text)
        # ... and the same log proves the built-in network
        self.assertTrue(check_network(procs, "Socket", expected_processes=2).ok)

    def test_case_insensitive_like_nccl(self):
        self.assertTrue(check_network(parse_nccl_log(fixture("nccl-builtin-2.18.log")), "socket",
                                      expected_processes=1).ok)

    def test_missing_rank_is_refused(self):
        procs = parse_nccl_log(fixture("nccl-plugin-rank0.log"))
        proof = check_network(procs, "rustnet", expected_processes=2)
        self.assertFalse(proof.ok)
        self.assertIn("only 1 of 2 processes", proof.describe())

    def test_p2p_bypass_refused_only_when_forbidden(self):
        procs = parse_nccl_log(fixture("nccl-p2p-leak.log"))
        self.assertFalse(check_network(procs, "rustnet").ok)
        self.assertIn("bypass the network", check_network(procs, "rustnet").describe())
        allowed = check_network(procs, "rustnet", forbid_local=False)
        self.assertTrue(allowed.ok, allowed.describe())
        self.assertIn("NCCL WARN", allowed.describe())

    def test_no_log_at_all(self):
        proof = check_network({}, "rustnet")
        self.assertFalse(proof.ok)
        self.assertIn("NCCL_DEBUG=INFO", proof.describe())

    def test_info_without_net_lines(self):
        # NCCL_DEBUG_SUBSYS=INIT only: "Using network" but no channel lines -> not proven
        text = "\n".join(ln for ln in fixture("nccl-plugin-rank0.log").splitlines() if "via NET" not in ln)
        proof = check_network(parse_nccl_log(text), "rustnet", expected_processes=1)
        self.assertFalse(proof.ok)
        self.assertIn("no channel connection", proof.describe())

    def test_roundtrip_dict(self):
        from ncclharness.nccllog import ProcessLog
        p = plugin_logs()["gpu-node:41631"]
        q = ProcessLog.from_dict(p.to_dict())
        self.assertEqual(q, p)
        self.assertEqual(q.key, "gpu-node:41631")


if __name__ == "__main__":
    unittest.main()
