//! `rustnet doctor`'s lossless-Ethernet and counter sections, and `rustnet
//! watch`, over the committed mlx5 RoCE fixture (tests/fixtures/mlx5-roce:
//! sysfs tree + stand-ins for `dcb` and `ethtool -S`). Each test copies the
//! tree and changes the copy for the branch it checks.
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

struct Tree(PathBuf);

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (s, d) = (e.path(), to.join(e.file_name()));
        let ft = e.file_type().unwrap();
        if ft.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&s).unwrap(), &d).unwrap();
        } else if ft.is_dir() {
            copy(&s, &d);
        } else {
            std::fs::copy(&s, &d).unwrap();
        }
    }
}

fn fixture(tag: &str) -> Tree {
    let root = std::env::temp_dir().join(format!("rustnet-fabric-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    copy(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mlx5-roce"), &root);
    // a usable /dev/infiniband, so the verdict reflects the fabric checks
    w(&root.join("dev/infiniband/uverbs0"), "");
    Tree(root)
}

/// Atomic write (watch may read at any moment).
fn w(p: &Path, s: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let tmp = p.with_extension("tmp~");
    std::fs::write(&tmp, s).unwrap();
    std::fs::rename(&tmp, p).unwrap();
}

fn hw(t: &Tree, name: &str, v: u64) {
    w(&t.0.join("class/infiniband/mlx5_0/ports/1/hw_counters").join(name), &format!("{v}\n"));
}

fn doctor(t: &Tree, args: &[&str], env: &[(&str, &str)]) -> (String, i32) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rustnet"));
    c.arg("doctor")
        .arg("--sysfs")
        .arg(&t.0)
        .arg("--devroot")
        .arg(t.0.join("dev"))
        .arg("--no-plugin")
        .arg("--dcb")
        .arg(t.0.join("bin/dcb"))
        .arg("--ethtool")
        .arg(t.0.join("bin/ethtool"))
        .args(args);
    c.env_remove("NCCL_IB_TC")
        .env_remove("NCCL_IB_SL")
        .env_remove("NCCL_IB_HCA")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("NCCL_NET_PLUGIN", "rustnet");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (String::from_utf8_lossy(&o.stdout).into_owned(), o.status.code().unwrap_or(-1))
}

#[test]
fn tc_106_on_a_pfc_ecn_priority_passes_every_lossless_check() {
    let t = fixture("pass");
    let (out, _) = doctor(&t, &[], &[("NCCL_IB_TC", "106")]);
    for line in [
        "[PASS] mlx5_0:1 MTU: eth2 MTU 9000, RoCE MTU 4096 (expected (verbs not queried))",
        "[PASS] mlx5_0:1 traffic class: NCCL_IB_TC=106 (DSCP 26, ECN bits 2); NCCL_IB_SL=0",
        "[PASS] mlx5_0:1 DSCP map: trust dscp: DSCP 26 -> priority 3",
        "[PASS] mlx5_0:1 PFC: PFC on priorities 3: the plugin's priority 3 is lossless",
        "[PASS] mlx5_0:1 ECN: DCQCN on priority 3: roce_np and roce_rp enabled",
    ] {
        assert!(out.contains(line), "missing {line:?} in\n{out}");
    }
    assert!(out.contains("== lossless Ethernet"), "{out}");
    // counters once: the fixture's traffic, no error counter set
    assert!(out.contains("[PASS] mlx5_0:1 counters: ") && out.contains("traffic: mlx5_0 port 1: port_xmit_data 2500000"), "{out}");
    assert!(!out.contains("[FAIL]"), "{out}");
}

#[test]
fn default_traffic_class_misses_the_pfc_priority_and_fails_with_the_fix() {
    let t = fixture("tc0");
    let (out, code) = doctor(&t, &[], &[]);
    assert!(
        out.contains("[FAIL] mlx5_0:1 PFC: PFC on priorities 3 of eth2, but the plugin's traffic lands on priority 0")
            && out.contains("fix: export NCCL_IB_TC=96 (DSCP 24 -> priority 3)"),
        "{out}"
    );
    assert!(out.contains("[WARN] mlx5_0:1 ECN: DCQCN on the plugin's priority 0: roce_np off, roce_rp off"), "{out}");
    assert_eq!(code, 2, "{out}");
}

#[test]
fn mtu_1500_and_the_peer_and_no_dcb() {
    let t = fixture("mtu");
    w(&t.0.join("class/net/eth2/mtu"), "1500\n");
    std::fs::remove_file(t.0.join("tools/dcb/eth2.pfc")).unwrap();
    let (out, _) = doctor(&t, &["--peer-mtu", "1500"], &[("NCCL_IB_TC", "106")]);
    assert!(out.contains("[WARN] mlx5_0:1 MTU: eth2 MTU 1500: RoCE MTU 1024"), "{out}");
    assert!(out.contains("fix: if the fabric carries jumbo frames: ip link set dev eth2 mtu 9000"), "{out}");
    assert!(out.contains("[PASS] mlx5_0:1 path MTU: RoCE MTU 1024 with the peer's MTU 1500"), "{out}");
    assert!(
        out.contains("[WARN] mlx5_0:1 PFC / DSCP map: cannot read eth2's DCB state:") && out.contains("Operation not supported"),
        "{out}"
    );
    // jumbo here, 1500 at the peer
    w(&t.0.join("class/net/eth2/mtu"), "9000\n");
    let (out, _) = doctor(&t, &["--peer-mtu", "1500"], &[]);
    assert!(out.contains("[WARN] mlx5_0:1 path MTU: the peer's MTU 1500 caps the path at RoCE MTU 1024"), "{out}");
}

#[test]
fn doctor_names_error_counters_and_tools_it_could_not_run() {
    let t = fixture("cnt");
    hw(&t, "np_cnp_sent", 1200);
    hw(&t, "out_of_sequence", 7);
    let (out, _) = doctor(&t, &[], &[("NCCL_IB_TC", "106")]);
    let line = out.lines().find(|l| l.contains("mlx5_0:1 counters")).unwrap_or_default().to_string();
    assert!(line.starts_with("[WARN]"), "{out}");
    assert!(line.contains("loss: out-of-sequence on mlx5_0 port 1 (out_of_sequence 7)"), "{line}");
    assert!(line.contains("congestion: CNPs on mlx5_0 port 1 (np_cnp_sent 1200)"), "{line}");
    assert!(out.contains("rustnet watch"), "{out}");
    // without the tools: skipped, with the reason
    let mut c = Command::new(env!("CARGO_BIN_EXE_rustnet"));
    let o = c
        .args(["doctor", "--no-plugin", "--sysfs"])
        .arg(&t.0)
        .arg("--devroot")
        .arg(t.0.join("dev"))
        .env("NCCL_SOCKET_IFNAME", "lo")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("[ethtool not run: the sysfs root is not /sys"), "{out}");
    assert!(out.contains("cannot read eth2's DCB state: DCB not read: the sysfs root is not /sys"), "{out}");
}

fn watch(t: &Tree, args: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_rustnet"))
        .arg("watch")
        .arg("--sysfs")
        .arg(&t.0)
        .arg("--ethtool")
        .arg(t.0.join("bin/ethtool"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn watch_names_congestion_loss_and_pfc_as_they_rise() {
    let t = fixture("watch");
    let mut ch = watch(&t, &["--count", "1", "--interval", "0.5"]);
    let mut rd = BufReader::new(ch.stdout.take().unwrap());
    let mut header = String::new();
    rd.read_line(&mut header).unwrap();
    assert!(header.starts_with("rustnet watch: mlx5_0:1 (eth2) every 0.5 s"), "{header}");
    // the first sample is taken before the header: everything now is a rise
    hw(&t, "np_cnp_sent", 1200);
    hw(&t, "rp_cnp_handled", 300);
    hw(&t, "out_of_sequence", 5);
    let eth = std::fs::read_to_string(t.0.join("tools/ethtool/eth2.txt")).unwrap().replace("rx_prio3_pause: 0", "rx_prio3_pause: 50");
    w(&t.0.join("tools/ethtool/eth2.txt"), &eth);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut rd, &mut rest).unwrap();
    let code = ch.wait().unwrap().code();
    assert!(rest.starts_with("--- t="), "{rest}");
    assert!(rest.contains("mlx5_0:1 (eth2): np_cnp_sent +"), "{rest}");
    assert!(rest.contains("=> congestion: CNPs rising on mlx5_0 port 1 (np_cnp_sent +"), "{rest}");
    assert!(rest.contains("=> loss: out-of-sequence rising on mlx5_0 port 1 (out_of_sequence +"), "{rest}");
    assert!(
        rest.contains("=> PFC: pause frames on eth2 prio 3 (rx_prio3_pause +") && rest.contains("the switch is pausing this NIC"),
        "{rest}"
    );
    assert_eq!(code, Some(1), "loss makes the exit status 1: {rest}");
}

#[test]
fn watch_json_and_idle_and_no_ports() {
    let t = fixture("json");
    let o = watch(&t, &["--count", "2", "--interval", "0.05", "--json"]).wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[0].starts_with("{\"t\":") && lines[0].contains("\"dev\":\"mlx5_0\",\"port\":1,\"netdev\":\"eth2\",\"rates\":{}"),
        "{out}"
    );
    assert!(lines[0].contains("idle: no counter moved on mlx5_0 port 1"), "{out}");
    assert_eq!(o.status.code(), Some(0));
    let o = watch(&t, &["--count", "1", "--dev", "mlx5_9"]).wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no RDMA ports under"), "{o:?}");
    let o = watch(&t, &["--interval", "x"]).wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--interval \"x\": seconds"), "{o:?}");
}
