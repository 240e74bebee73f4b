import os
import tempfile
import unittest

from _util import REPO
from ncclharness.envs import (apply_overrides, hostid_for_rank, network_env, one_host_env,
                              prepare_plugin_dir)


class NetworkEnv(unittest.TestCase):
    BASE = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/cuda/lib64", "NCCL_NET": "IB",
            "NCCL_HOSTID": "stale", "NCCL_DEBUG_FILE": "/tmp/old"}

    def test_plugin(self):
        env = network_env("plugin", "/opt/rustnet/lib", self.BASE)
        self.assertEqual(env["NCCL_NET_PLUGIN"], "rustnet")
        self.assertEqual(env["NCCL_NET"], "rustnet")
        self.assertEqual(env["LD_LIBRARY_PATH"], "/opt/rustnet/lib:/opt/cuda/lib64")
        self.assertEqual((env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]), ("INFO", "INIT,NET"))
        self.assertNotIn("NCCL_HOSTID", env)            # leftovers cleared
        self.assertNotIn("NCCL_DEBUG_FILE", env)
        self.assertNotIn("RUSTNET_TRANSPORT", env)
        self.assertEqual(env["PATH"], "/usr/bin")
        self.assertEqual(self.BASE["NCCL_NET"], "IB")    # base untouched

    def test_plugin_options(self):
        env = network_env("plugin", "/p", {}, force_net=False, rustnet_transport="socket")
        self.assertNotIn("NCCL_NET", env)
        self.assertEqual(env["RUSTNET_TRANSPORT"], "socket")
        self.assertEqual(env["LD_LIBRARY_PATH"], "/p")
        with self.assertRaises(ValueError):
            network_env("plugin", None, {})

    def test_builtin(self):
        env = network_env("builtin", None, self.BASE)
        self.assertEqual(env["NCCL_NET"], "Socket")
        self.assertEqual(env["NCCL_NET_PLUGIN"], "none")
        self.assertEqual(env["NCCL_IB_DISABLE"], "1")
        self.assertEqual(env["LD_LIBRARY_PATH"], "/opt/cuda/lib64")
        with self.assertRaises(ValueError):
            network_env("ib", None, {})

    def test_one_host(self):
        e = one_host_env()
        self.assertEqual((e["NCCL_P2P_DISABLE"], e["NCCL_SHM_DISABLE"], e["NCCL_SOCKET_IFNAME"]), ("1", "1", "lo"))
        self.assertNotEqual(hostid_for_rank(0), hostid_for_rank(1))

    def test_overrides(self):
        env = apply_overrides({"A": "1"}, ["A=2", "B=x=y"])
        self.assertEqual(env, {"A": "2", "B": "x=y"})
        with self.assertRaises(ValueError):
            apply_overrides({}, ["NOEQUALS"])


class PluginDir(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def elf(self, path):
        with open(path, "wb") as f:
            f.write(b"\x7fELF" + b"\0" * 60)

    def test_install_dir_used_as_is(self):
        lib = os.path.join(self.d, "lib")
        os.makedirs(lib)
        self.elf(os.path.join(lib, "libnccl-net-rustnet.so"))
        self.assertEqual(str(prepare_plugin_dir(lib, self.d)), os.path.realpath(lib))

    def test_build_dir_gets_nccl_names(self):
        rel = os.path.join(self.d, "release")
        os.makedirs(rel)
        self.elf(os.path.join(rel, "librustnet.so"))
        lib = prepare_plugin_dir(rel, os.path.join(self.d, "work"))
        for name in ("libnccl-net-rustnet.so", "librustnet.so", "libnccl-net-librustnet.so"):
            p = os.path.join(lib, name)
            self.assertEqual(os.path.realpath(p), os.path.realpath(os.path.join(rel, "librustnet.so")))
        # idempotent
        self.assertEqual(prepare_plugin_dir(rel, os.path.join(self.d, "work")), lib)
        # the .so itself works too
        self.assertEqual(prepare_plugin_dir(os.path.join(rel, "librustnet.so"), os.path.join(self.d, "work")), lib)

    def test_missing_or_not_elf(self):
        with self.assertRaises(FileNotFoundError) as cm:
            prepare_plugin_dir(self.d, self.d)
        self.assertIn("make-gpu-kit.sh", str(cm.exception))
        with open(os.path.join(self.d, "librustnet.so"), "w") as f:
            f.write("not a library")
        with self.assertRaises(FileNotFoundError):
            prepare_plugin_dir(self.d, self.d)


class Probe(unittest.TestCase):
    SO = os.path.join(REPO, "target", "release", "librustnet.so")

    @unittest.skipUnless(os.path.exists(SO), "plugin not built (cargo build --release)")
    def test_probe_built_plugin(self):
        from ncclharness.pluginprobe import probe
        info = probe(os.path.dirname(self.SO))
        self.assertIn(6, info["exports"])
        self.assertEqual(set(info["exports"].values()), {"rustnet"})

    def test_probe_bad_file(self):
        from ncclharness.pluginprobe import main
        with tempfile.NamedTemporaryFile(suffix=".so") as f:
            f.write(b"junk")
            f.flush()
            import contextlib
            import io
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                self.assertEqual(main(["x", f.name]), 1)
            self.assertIn("cannot dlopen", buf.getvalue())


if __name__ == "__main__":
    unittest.main()
