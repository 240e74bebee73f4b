//! `rustnet doctor` over sysfs fixture trees the test writes: a ConnectX-style
//! RoCE NIC with v1/v2 GID pairs and holes, a port that is down, a GPU under
//! the same PCIe switch, an NCCL_IB_HCA prefix pitfall, and a host with no
//! RDMA at all.
use std::path::{Path, PathBuf};
use std::process::Command;

struct Tree(PathBuf);

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn w(p: &Path, s: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, s).unwrap();
}

fn gid_text(g: &str) -> String {
    let ip: std::net::Ipv6Addr = g.parse().unwrap();
    ip.segments().iter().map(|s| format!("{s:04x}")).collect::<Vec<_>>().join(":")
}

/// mlx5_0 (port 1 ACTIVE, RoCE) and mlx5_1 (port 1 DOWN) under one switch,
/// mlx5_10 elsewhere, a GPU next to mlx5_0, netdev eth2 present.
fn fixture(tag: &str) -> Tree {
    let root = std::env::temp_dir().join(format!("rustnet-doctor-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let sw = root.join("devices/pci0000:00/0000:00:01.0/0000:01:00.0");
    for (dev, pci, state, ndev) in [
        ("mlx5_0", sw.join("0000:02:00.0"), "4: ACTIVE", "eth2"),
        ("mlx5_1", sw.join("0000:02:00.1"), "1: DOWN", "eth3"),
        ("mlx5_10", root.join("devices/pci0000:80/0000:80:01.0/0000:81:00.0"), "4: ACTIVE", "eth4"),
    ] {
        std::fs::create_dir_all(&pci).unwrap();
        w(&pci.join("numa_node"), if dev == "mlx5_10" { "1\n" } else { "0\n" });
        let d = root.join("class/infiniband").join(dev);
        std::fs::create_dir_all(&d).unwrap();
        std::os::unix::fs::symlink(&pci, d.join("device")).unwrap();
        let p = d.join("ports/1");
        w(&p.join("state"), &format!("{state}\n"));
        w(&p.join("phys_state"), if state.contains("ACTIVE") { "5: LinkUp\n" } else { "3: Disabled\n" });
        w(&p.join("link_layer"), "Ethernet\n");
        w(&p.join("rate"), "100 Gb/sec (4X EDR)\n");
        // ConnectX table: fe80 v1, fe80 v2, IPv4 v1, IPv4 v2, then empty slots
        let ip = if dev == "mlx5_0" { "10.0.0.1" } else { "10.0.1.1" };
        let rows = [
            ("fe80::1", "IB/RoCE v1"),
            ("fe80::1", "RoCE v2"),
            (&*format!("::ffff:{ip}"), "IB/RoCE v1"),
            (&*format!("::ffff:{ip}"), "RoCE v2"),
        ];
        for (i, (g, t)) in rows.iter().enumerate() {
            w(&p.join(format!("gids/{i}")), &format!("{}\n", gid_text(g)));
            w(&p.join(format!("gid_attrs/types/{i}")), &format!("{t}\n"));
            w(&p.join(format!("gid_attrs/ndevs/{i}")), &format!("{ndev}\n"));
        }
        for i in 4..16 {
            w(&p.join(format!("gids/{i}")), "0000:0000:0000:0000:0000:0000:0000:0000\n");
        }
    }
    std::fs::create_dir_all(root.join("class/net/eth2")).unwrap();
    // a GPU under the same switch as mlx5_0
    let gpu = sw.join("0000:03:00.0");
    w(&gpu.join("class"), "0x030200\n");
    w(&gpu.join("vendor"), "0x10de\n");
    w(&gpu.join("numa_node"), "0\n");
    std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
    std::os::unix::fs::symlink(&gpu, root.join("bus/pci/devices/0000:03:00.0")).unwrap();
    Tree(root)
}

fn doctor(root: &Path, args: &[&str], env: &[(&str, &str)]) -> (String, i32) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rustnet"));
    c.arg("doctor").arg("--sysfs").arg(root).arg("--devroot").arg(root.join("dev")).arg("--no-plugin").args(args);
    c.env("NCCL_SOCKET_IFNAME", "lo");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (String::from_utf8_lossy(&o.stdout).into_owned(), o.status.code().unwrap_or(-1))
}

#[test]
fn connectx_table_picks_ipv4_roce_v2_and_explains() {
    let t = fixture("cx");
    let (out, _) = doctor(&t.0, &[], &[]);
    assert!(out.contains("[PASS] mlx5_0:1 GID 3: ::ffff:10.0.0.1 RoCE v2 on eth2: IPv4 v2 preferred; skipped 2 link-local"), "{out}");
    assert!(out.contains("[WARN] mlx5_1:1:") && out.contains("not ACTIVE"), "{out}");
    assert!(out.contains("0000:03:00.0") && out.contains("nearest NIC mlx5_0"), "{out}");
    assert!(out.contains("nvidia-peermem not loaded"), "{out}");
    // eth4 (mlx5_10's netdev) is not in this "namespace" (no class/net/eth4)
    assert!(out.contains("eth4 is not in this network namespace"), "{out}");
    assert!(out.contains("/dev/infiniband"), "{out}");
    assert!(out.contains("<- chosen"), "{out}");
}

#[test]
fn json_and_export_env() {
    let t = fixture("json");
    let (js, _) = doctor(&t.0, &["--json"], &[]);
    assert!(js.starts_with('{') && js.contains("\"dev\":\"mlx5_0\"") && js.contains("\"gid_index\":3"), "{js}");
    let (ex, _) = doctor(&t.0, &["--export-env"], &[]);
    assert!(ex.contains("export NCCL_IB_HCA==mlx5_0:1,mlx5_10:1"), "{ex}");
    assert!(ex.contains("export NCCL_IB_GID_INDEX=3"), "{ex}");
    assert!(ex.contains("export NCCL_SOCKET_IFNAME==lo"), "{ex}");
}

#[test]
fn prefix_pitfall_and_forced_bad_index() {
    let t = fixture("pitfall");
    let (out, code) = doctor(&t.0, &[], &[("NCCL_IB_HCA", "mlx5_1"), ("NCCL_IB_GID_INDEX", "7")]);
    assert!(out.contains("NCCL_IB_HCA prefix") && out.contains("mlx5_10") && out.contains("NCCL_IB_HCA==mlx5_1"), "{out}");
    assert!(out.contains("excluded by NCCL_IB_HCA"), "{out}");
    assert!(
        out.contains(
            "[FAIL] mlx5_10:1 GID: NCCL_IB_GID_INDEX=7: GID index 7 on mlx5_10:1 is empty; usable: 0 fe80::1 RoCE v1 eth4 link-local"
        ),
        "{out}"
    );
    assert_eq!(code, 2);
    let (out, code) = doctor(&t.0, &[], &[("NCCL_SOCKET_FAMILY", "AF_DECnet")]);
    assert!(out.contains("[FAIL] knob values") && out.contains("NCCL_SOCKET_FAMILY"), "{out}");
    assert_eq!(code, 2);
}

/// One run names every bad value with its fix (the plugin's init stops at the
/// first), in the text report and in `--json`.
#[test]
fn every_bad_knob_in_one_run() {
    let t = fixture("badknobs");
    let env = [("RUSTNET_TRANSPORT", "bogus"), ("NCCL_IB_TIMEOUT", "99"), ("RUSTNET_SOCKET_TIMEOUT", "-3")];
    let (out, code) = doctor(&t.0, &[], &env);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("[FAIL] knob values: 3 bad value(s): RUSTNET_TRANSPORT, RUSTNET_SOCKET_TIMEOUT, NCCL_IB_TIMEOUT"), "{out}");
    for (name, value, accepts) in [
        ("RUSTNET_TRANSPORT", "bogus", "auto, ib or socket"),
        ("NCCL_IB_TIMEOUT", "99", "an integer 1..31"),
        ("RUSTNET_SOCKET_TIMEOUT", "-3", "seconds, 1..86400"),
    ] {
        let line = format!("[FAIL] {name}: \"{value}\" is not accepted: expected {accepts}");
        assert!(out.contains(&line), "missing {line:?}:\n{out}");
        assert!(out.contains(&format!("fix: set {name} to {accepts}, or unset it for the default")), "{name}: no fix\n{out}");
    }
    // the rest of the report still runs (with the bad values unset)
    assert!(out.contains("GID table mlx5_0:1"), "{out}");
    let (js, code) = doctor(&t.0, &["--json"], &env);
    assert_eq!(code, 2);
    for name in ["RUSTNET_TRANSPORT", "NCCL_IB_TIMEOUT", "RUSTNET_SOCKET_TIMEOUT"] {
        let item = format!("{{\"layer\":\"env\",\"what\":\"{name}\",\"status\":\"Fail\"");
        assert!(js.contains(&item), "{name} missing from --json: {js}");
    }
    for name in ["RUSTNET_TRANSPORT", "NCCL_IB_TIMEOUT", "RUSTNET_SOCKET_TIMEOUT"] {
        assert!(js.contains(&format!("\"fix\":\"set {name} to ")), "{name}: no fix in --json: {js}");
    }
}

/// The testing-only fault knobs: a malformed value is a knob error naming
/// what is accepted (init would refuse it), a valid one a warning that the
/// job would break itself on purpose.
#[test]
fn fault_knobs_are_checked_and_armed_ones_warned_about() {
    let t = fixture("faults");
    let (out, _) = doctor(&t.0, &[], &[]);
    assert!(out.contains("[PASS] fault injection: off"), "{out}");
    let bad = [("RUSTNET_FAULT_QP_ERROR", "send:0"), ("RUSTNET_FAULT_TCP_RESET", "both:1"), ("RUSTNET_FAULT_PANIC", "isend:later")];
    let (out, code) = doctor(&t.0, &[], &bad);
    assert_eq!(code, 2, "{out}");
    for (name, value) in bad {
        assert!(out.contains(&format!("[FAIL] {name}: \"{value}\" is not accepted")), "{name}:\n{out}");
    }
    let (out, code) = doctor(&t.0, &[], &[("RUSTNET_FAULT_QP_ERROR", "random:5"), ("RUSTNET_FAULT_TCP_RESET", "send:100:50")]);
    assert!(code >= 1, "{out}");
    let line = out.lines().find(|l| l.contains("fault injection")).unwrap_or_default();
    assert!(
        line.contains("[WARN]") && line.contains("RUSTNET_FAULT_QP_ERROR=random:5") && line.contains("RUSTNET_FAULT_TCP_RESET=send:100:50"),
        "{out}"
    );
    assert!(!line.contains("RUSTNET_FAULT_PANIC"), "{line}");
    assert!(out.contains("unset every RUSTNET_FAULT_* variable"), "{out}");
}

#[test]
fn no_rdma_host_says_so_and_reports_tcp() {
    let root = std::env::temp_dir().join(format!("rustnet-doctor-empty-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let t = Tree(root);
    let (out, code) = doctor(&t.0, &[], &[("NCCL_NET_PLUGIN", "rustnet")]);
    assert!(out.contains("RDMA devices: none") && out.contains("the plugin will use TCP"), "{out}");
    assert!(out.contains("TCP / out-of-band interfaces: lo 127.0.0.1"), "{out}");
    assert!(code <= 1, "{out}");
}

/// An iWARP device beside the ConnectX ones: soft-iWARP `siw0` as sysfs shows
/// it (node_type RNIC, link layer Ethernet, one MAC-based GID, no PCI device).
fn add_siw(t: &Tree) {
    let d = t.0.join("class/infiniband/siw0");
    w(&d.join("node_type"), "4: RNIC\n");
    let p = d.join("ports/1");
    w(&p.join("state"), "4: ACTIVE\n");
    w(&p.join("phys_state"), "5: LinkUp\n");
    w(&p.join("link_layer"), "Ethernet\n");
    w(&p.join("rate"), "25 Gb/sec (1X EDR)\n");
    w(&p.join("gids/0"), &format!("{}\n", gid_text("5254:ff:fe12:3456::")));
}

/// doctor tells iWARP apart from RoCE (node_type, not link layer): it says
/// that iWARP connects only through rdma_cm, whether librdmacm loads here,
/// and that the plugin uses the port (PASS) when it does, with what differs
/// there; a host without librdmacm gets a WARN and the fix. No RoCE GID
/// check runs on it.
#[test]
fn iwarp_port_is_named_with_the_rdma_cm_requirement() {
    let t = fixture("iwarp");
    add_siw(&t);
    let (out, _) = doctor(&t.0, &[], &[]);
    let line = out.lines().find(|l| l.contains("siw0:1:")).unwrap_or_else(|| panic!("no siw0 line: {out}"));
    assert!(line.contains("Ethernet (iWARP)"), "{line}");
    assert!(line.contains("iWARP connects only through rdma_cm"), "{line}");
    if line.contains("librdmacm.so.1 loads") {
        assert!(line.contains("[PASS]") && line.contains("the plugin uses it: rdma_cm connection set-up"), "{line}");
        assert!(line.contains("eager path off, host memory only"), "{line}");
    } else {
        assert!(line.contains("[WARN]") && line.contains("librdmacm NOT usable"), "{line}");
        assert!(line.contains("the plugin cannot connect it without librdmacm"), "{line}");
    }
    assert!(!out.contains("siw0:1 GID"), "no RoCE GID choice for iWARP: {out}");
    let (js, _) = doctor(&t.0, &["--json"], &[]);
    assert!(js.contains("\"dev\":\"siw0\"") && js.contains("\"iwarp\":true"), "{js}");
    assert!(js.contains("\"dev\":\"mlx5_0\"") && js.contains("\"iwarp\":false"), "{js}");
    // NCCL_IB_HCA rules apply as to any port
    let (out, _) = doctor(&t.0, &[], &[("NCCL_IB_HCA", "^siw0")]);
    assert!(out.lines().any(|l| l.contains("siw0:1:") && l.contains("excluded by NCCL_IB_HCA")), "{out}");
}
