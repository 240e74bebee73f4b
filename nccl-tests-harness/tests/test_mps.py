"""The MPS evidence: control.log / server.log lines, and the judgement."""

import os
import tempfile
import unittest

import _util  # noqa: F401  (import path)
from ncclharness import mps

CONTROL = """\
[2026-11-30 12:50:23.100 Control 13894] Starting control daemon using socket /tmp/rustnet-mps.x/pipe/control
[2026-11-30 12:50:23.347 Control 13894] Starting new server 13929 for user 0
[2026-11-30 12:50:24.870 Control 13894] NEW SERVER 13929: Ready
[2026-11-30 12:50:24.900 Control 13894] NEW CLIENT 19276 from user 0: Server already exists
[2026-11-30 12:50:24.901 Control 13894] Accepting connection...
"""
SERVER = """\
[2026-11-30 12:50:25.269 Server 13929] New client 19276 connected
[2026-11-30 12:50:25.270 Server 13929] New client 19277 connected
[2026-11-30 12:51:09.270 Server 13929] Client 19276 disconnected
"""


class MpsEvidence(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, rel, text):
        path = os.path.join(self.dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def test_clients_and_server_from_both_logs(self):
        self.write("control.log", CONTROL)
        self.write("server.log", SERVER)
        ev = mps.read_evidence(self.dir)
        self.assertEqual(ev.servers, {13929})
        self.assertEqual(ev.clients, {19276, 19277})
        ok, why = mps.judge(ev, [19276, 19277])
        self.assertTrue(ok, why)
        self.assertIn("1 server(s) (pid 13929), 2 client process(es)", why)

    def test_server_log_one_folder_deeper(self):
        """Newer drivers: <log dir>/<server name>/server.log."""
        self.write("control.log", CONTROL.splitlines()[0] + "\n")
        self.write("GPU-0123/server.log", SERVER)
        ev = mps.read_evidence(self.dir, server_list_text="13929\n")
        self.assertEqual(ev.clients, {19276, 19277})
        self.assertEqual(ev.servers, {13929})
        self.assertTrue(mps.judge(ev)[0])

    def test_a_rank_that_never_connected(self):
        self.write("control.log", CONTROL)
        self.write("server.log", SERVER)
        ok, why = mps.judge(mps.read_evidence(self.dir), [19276, 19277, 19300])
        self.assertFalse(ok)
        self.assertIn("1 of 3 rank process(es) never connected to MPS (pid 19300)", why)

    def test_daemon_up_but_no_client_came(self):
        """The daemon answered, but the ranks did not find its pipe: they time-sliced."""
        self.write("control.log", CONTROL.splitlines()[0] + "\n")
        ok, why = mps.judge(mps.read_evidence(self.dir))
        self.assertFalse(ok)
        self.assertIn("no MPS server was started", why)

    def test_no_log_at_all(self):
        ok, why = mps.judge(mps.read_evidence(self.dir))
        self.assertFalse(ok)
        self.assertIn("no MPS log", why)

    def test_server_failure_is_reported(self):
        self.write("control.log", CONTROL + "[2026-11-30 12:52:00.000 Control 13894] Server 13929 exited with status 1\n")
        self.write("server.log", SERVER)
        ok, why = mps.judge(mps.read_evidence(self.dir))
        self.assertFalse(ok)
        self.assertIn("exited with status 1", why)

    def test_cli_exit_codes(self):
        self.assertEqual(mps.main(["evidence", self.dir]), mps.EXIT_NO_MPS)
        self.write("control.log", CONTROL)
        self.write("server.log", SERVER)
        self.assertEqual(mps.main(["evidence", self.dir, "--pids", "19276,19277"]), 0)
        self.assertEqual(mps.main(["evidence", self.dir, "--pids", "1"]), mps.EXIT_NO_MPS)

    def test_server_list(self):
        self.assertEqual(mps.parse_server_list("123\n456\n"), {123, 456})
        self.assertEqual(mps.parse_server_list(""), set())


if __name__ == "__main__":
    unittest.main()
