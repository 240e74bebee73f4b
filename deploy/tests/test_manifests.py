"""Tests of deploy/: the manifests validate (and the validator rejects what it
must), and the training pod's environment, rendered from what its init
container writes with the real `rustnet doctor --export-env`, is what NCCL and
the plugin need.

    python3 -m unittest discover -s deploy/tests        (PyPI kubernetes-validate installed)
    RUSTNET_BIN=path/to/rustnet                          (default target/release/rustnet)
"""
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import yaml

DEPLOY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(DEPLOY)
sys.path.insert(0, DEPLOY)
import validate  # noqa: E402

RUSTNET = os.environ.get("RUSTNET_BIN", os.path.join(ROOT, "target", "release", "rustnet"))


def manifest(name):
    with open(os.path.join(DEPLOY, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def quiet_validate(files):
    """validate.main over files, its report captured; returns (status, report)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = validate.main(["--k8s", "1.37.0", *files])
    return rc, buf.getvalue()


class Manifests(unittest.TestCase):
    def test_every_manifest_validates(self):
        rc, out = quiet_validate([])
        self.assertEqual(rc, 0, out)
        for f in ("nad-macvlan.yaml", "nad-sriov.yaml", "training-job.yaml", "rustnet-agent-daemonset.yaml",
                  "rustnet-bisect-job.yaml", "rdma-shared-device-plugin-configmap.yaml"):
            self.assertIn(f"PASS {f}", out)

    def mutated(self, name, change):
        """Validate deploy/ with one file changed by change(docs); returns the report."""
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        files = []
        for f in sorted(os.listdir(DEPLOY)):
            if f.endswith(".yaml"):
                docs = manifest(f)
                if f == name:
                    change(docs)
                with open(os.path.join(tmp, f), "w") as out:
                    yaml.safe_dump_all(docs, out)
                files.append(os.path.join(tmp, f))
        rc, out = quiet_validate(files)
        self.assertEqual(rc, 1, f"the validator accepted a broken {name}:\n{out}")
        return out

    def test_strict_schema_rejects_a_misspelt_field(self):
        def typo(docs):
            c = docs[1]["spec"]["template"]["spec"]["containers"][0]
            c["securityContext"]["capabilites"] = c["securityContext"].pop("capabilities")
        out = self.mutated("training-job.yaml", typo)
        self.assertIn("FAIL training-job.yaml Job/training against Kubernetes 1.37 (strict)", out)

    def test_nad_without_config_and_bad_cni_json_fail(self):
        out = self.mutated("nad-macvlan.yaml", lambda d: d[0]["spec"].pop("config"))
        self.assertIn("'config' is a required property", out)
        out = self.mutated("nad-sriov.yaml", lambda d: d[0]["spec"].update(config='{"cniVersion": "0.3.1", "name": "x", "plugins": [{}]}'))
        self.assertIn("plugins[0] lacks type", out)

    def test_rdma_device_plugin_config_is_checked(self):
        def bad(docs):
            c = json.loads(docs[0]["data"]["config.json"])
            c["configList"][0]["resourceName"] = "hca-shared"  # the plugin accepts [a-zA-Z0-9_]+ only
            c["configList"][0]["devices"] = ["ib0"]  # and selectors or devices, not both
            docs[0]["data"]["config.json"] = json.dumps(c)
        out = self.mutated("rdma-shared-device-plugin-configmap.yaml", bad)
        self.assertIn("FAIL rdma-shared-device-plugin-configmap.yaml ConfigMap/rdma-devices config.json", out)
        # and the pods now request a resource nobody defines
        self.assertIn("requests rdma/hca_shared_devices_a, which the RDMA shared device plugin ConfigMap does not define", out)

    def test_rdma_without_ipc_lock_and_unknown_network_fail(self):
        def drop(docs):
            t = docs[1]["spec"]["template"]
            del t["spec"]["initContainers"][0]["securityContext"]
            t["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] = "rdma-macvlan-typo"
        out = self.mutated("training-job.yaml", drop)
        self.assertIn("container fabric-check: takes ['rdma/hca_shared_devices_a'] but lacks capabilities.add IPC_LOCK", out)
        self.assertIn("network 'rdma-macvlan-typo' is not a NetworkAttachmentDefinition", out)


def gid(ip4=None):
    """sysfs text of a GID: fe80::1 or ::ffff:ip4."""
    if ip4 is None:
        return "fe80:0000:0000:0000:0000:0000:0000:0001"
    a, b, c, d = (int(x) for x in ip4.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a * 256 + b:04x}:{c * 256 + d:04x}"


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def pod_sysfs(root):
    """What a pod on the rdma-macvlan network sees: one ConnectX-style RoCE port
    (mlx5_0 port 1, ACTIVE) whose GID table holds link-local and IPv4 entries,
    v1 and v2, on the pod's macvlan net1; /dev/infiniband/uverbs0 from the
    device plugin."""
    pci = os.path.join(root, "devices/pci0000:00/0000:00:02.0/0000:05:00.0")
    os.makedirs(pci)
    write(os.path.join(pci, "numa_node"), "0\n")
    dev = os.path.join(root, "class/infiniband/mlx5_0")
    os.makedirs(dev)
    os.symlink(pci, os.path.join(dev, "device"))
    port = os.path.join(dev, "ports/1")
    write(os.path.join(port, "state"), "4: ACTIVE\n")
    write(os.path.join(port, "phys_state"), "5: LinkUp\n")
    write(os.path.join(port, "link_layer"), "Ethernet\n")
    write(os.path.join(port, "rate"), "200 Gb/sec (4X HDR)\n")
    rows = [(gid(), "IB/RoCE v1"), (gid(), "RoCE v2"), (gid("192.168.100.17"), "IB/RoCE v1"), (gid("192.168.100.17"), "RoCE v2")]
    for i, (g, t) in enumerate(rows):
        write(os.path.join(port, f"gids/{i}"), g + "\n")
        write(os.path.join(port, f"gid_attrs/types/{i}"), t + "\n")
        write(os.path.join(port, f"gid_attrs/ndevs/{i}"), "net1\n")
    for i in range(4, 8):
        write(os.path.join(port, f"gids/{i}"), "0000:0000:0000:0000:0000:0000:0000:0000\n")
    os.makedirs(os.path.join(root, "class/net/net1"))
    write(os.path.join(root, "dev/infiniband/uverbs0"), "")


def env_of(container):
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


@unittest.skipUnless(os.access(RUSTNET, os.X_OK), f"SKIPPED: {RUSTNET} not built (cargo build --release)")
class TrainingPodEnvironment(unittest.TestCase):
    """Runs the training pod's two commands as written in training-job.yaml,
    with the real rustnet doctor over a fixture of what the pod sees, and
    /fabric mapped to a temporary directory."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)
        self.sysfs = os.path.join(self.tmp, "sys")
        pod_sysfs(self.sysfs)
        self.fabric = os.path.join(self.tmp, "fabric")
        os.makedirs(self.fabric)
        # `rustnet` on PATH is the real tool, told to read the fixture instead
        # of this machine's /sys and /dev (and not to initialise a plugin here).
        bin_dir = os.path.join(self.tmp, "bin")
        os.makedirs(bin_dir)
        write(os.path.join(bin_dir, "rustnet"),
              "#!/bin/sh\n"
              "if [ \"$1\" = doctor ]; then shift; exec \"$RUSTNET_REAL\" doctor --sysfs \"$FIXTURE\" "
              "--devroot \"$FIXTURE/dev\" --no-plugin \"$@\"; fi\n"
              "exec \"$RUSTNET_REAL\" \"$@\"\n")
        os.chmod(os.path.join(bin_dir, "rustnet"), 0o755)
        self.base_env = {"PATH": bin_dir + ":/usr/bin:/bin", "RUSTNET_REAL": os.path.abspath(RUSTNET), "FIXTURE": self.sysfs}
        job = manifest("training-job.yaml")[1]
        self.spec = job["spec"]["template"]["spec"]

    def run_container(self, c, args=None):
        """The container's command (+ args), /fabric mapped to the temp dir."""
        (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "fabric"]
        argv = [a.replace(mount, self.fabric) for a in c["command"]] + (args if args is not None else c.get("args", []))
        env = {**self.base_env, **env_of(c)}
        return subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)

    def test_init_container_output_becomes_the_trainers_environment(self):
        (init,) = self.spec["initContainers"]
        r = self.run_container(init)
        self.assertEqual(r.returncode, 0, f"init container failed:\n{r.stdout}\n{r.stderr}")
        self.assertIn("mlx5_0", r.stdout, "the doctor's report goes to the pod log")
        with open(os.path.join(self.fabric, "env.sh")) as f:
            lines = f.read().splitlines()
        # the real --export-env format: export NAME=VALUE lines only
        self.assertTrue(lines and all(l.startswith("export ") and "=" in l for l in lines), lines)
        exported = dict(l[len("export "):].split("=", 1) for l in lines)
        self.assertEqual(exported["NCCL_IB_HCA"], "=mlx5_0:1")
        self.assertEqual(exported["NCCL_IB_GID_INDEX"], "3", "the IPv4 RoCE v2 entry on net1")
        self.assertEqual(exported["NCCL_NET_PLUGIN"], "rustnet")

        (trainer,) = self.spec["containers"]
        dump = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
        self.assertEqual(trainer["args"][0], "torchrun", "the trainer's command execs its args after sourcing env.sh")
        r = self.run_container(trainer, args=dump)
        self.assertEqual(r.returncode, 0, r.stderr)
        env = json.loads(r.stdout)
        for k, v in exported.items():
            self.assertEqual(env.get(k), v, k)
        # the pod spec's own variables survive (env.sh does not touch them)
        self.assertEqual(env["NCCL_NET"], "rustnet")
        self.assertEqual(env["RUSTNET_TRANSPORT"], "ib")
        if "NCCL_SOCKET_IFNAME" in exported:
            self.assertTrue(exported["NCCL_SOCKET_IFNAME"].startswith("="), exported["NCCL_SOCKET_IFNAME"])

    def test_a_failing_doctor_stops_the_pod(self):
        (init,) = self.spec["initContainers"]
        # RDMA devices in sysfs but no /dev/infiniband files: the pod did not get
        # the device plugin's share. The doctor fails (exit 2), and so does the pod.
        os.remove(os.path.join(self.sysfs, "dev/infiniband/uverbs0"))
        r = self.run_container(init)
        self.assertEqual(r.returncode, 2, f"{r.stdout}\n{r.stderr}")
        self.assertIn("[FAIL] /dev/infiniband", r.stdout)
        self.assertFalse(os.path.exists(os.path.join(self.fabric, "env.sh")), "no environment from a failed check")

if __name__ == "__main__":
    unittest.main()
