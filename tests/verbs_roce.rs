//! RoCE tests against soft-RoCE in `tests/rxe-vm/`: the GID choice as the
//! node's addresses change (IPv6, a VLAN upper, an IPv4 address added after
//! start-up, NCCL_IB_ADDR_RANGE), the family check between the two ends, and
//! traffic classes seen on the wire (tcpdump on the veth: the IPv4 TOS byte
//! of the RoCE v2 packets, UDP 4791), also per plugin context (ABI v11/v12)
//! through the built `.so`.
//!
//! Every test here is `#[ignore]`d with the reason (on a build host they count
//! as ignored); `tests/rxe-vm/verbs-suite.sh` runs them with
//! `--include-ignored` and `RUSTNET_TEST_DEVICE=rxe0 RUSTNET_TEST_DEVICE2=rxe1`.
//! Run that way without `RUSTNET_TEST_DEVICE`, they fail: they never pass
//! without a device. They change the VM's addresses and put them back.
#[path = "common/ib.rs"]
mod ib;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ib::{captured, device, device2, net, pair_tc, reg, until, Buf, DEADLINE};
use rustnet::for_tools::ib::{gid, handshake, Access, IbNet, RecvComm, SendComm};
use rustnet::for_tools::transport::RecvBuf;
use rustnet_tools::driver::{self, Plugin, Ptr};

/// Move `sizes` one by one and check every byte.
fn transfer(n: &IbNet, s: &mut SendComm, r: &mut RecvComm, sizes: &[usize]) {
    let (sd, rd) = (s.dev(), r.dev());
    for (k, &size) in sizes.iter().enumerate() {
        let mut src = Buf::new(size);
        for (i, b) in src.bytes_mut().iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(13).wrapping_add(k as u8);
        }
        let mut dst = Buf::new(size);
        let smr = reg(n, sd, &mut src, Access::LOCAL_READ);
        let rmr = reg(n, rd, &mut dst, Access::REMOTE_WRITE);
        let rb = [RecvBuf { buf: dst.raw(), tag: 3 }];
        // SAFETY: buffers and registrations live until the requests complete.
        let rid = unsafe { r.irecv(&rb, &[Some(&rmr)]) }.expect("irecv").expect("irecv slot");
        let mut rdone = None;
        let sid = until("isend", || {
            if rdone.is_none() {
                rdone = r.test(rid).expect("recv test");
            }
            // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
            unsafe { s.isend(src.raw(), 3, Some(&smr)) }.expect("isend")
        });
        until("send completion", || s.test(sid).expect("send test"));
        let rc = match rdone {
            Some(c) => c,
            None => until("receive completion", || r.test(rid).expect("recv test")),
        };
        assert_eq!(rc.sizes[0], size);
        assert!(dst.bytes() == src.bytes(), "payload of message {k} ({size} bytes) differs");
    }
}

// ---------------------------------------------------------------- logs

fn gid_infos(log: &[(tracing::Level, String)]) -> Vec<String> {
    log.iter().filter(|(l, m)| *l == tracing::Level::INFO && m.starts_with("GID choice")).map(|(_, m)| m.clone()).collect()
}

// ---------------------------------------------------------------- the VM's network

fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().expect("run ip");
    assert!(o.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&o.stderr));
}

/// Undo `ip` commands when dropped (also when the test fails).
struct Undo(Vec<Vec<String>>);
impl Drop for Undo {
    fn drop(&mut self) {
        for a in self.0.iter().rev() {
            let _ = Command::new("ip").args(a).output();
        }
    }
}
impl Undo {
    fn run(&mut self, args: &[&str], undo: &[&str]) {
        ip(args);
        self.0.push(undo.iter().map(|s| s.to_string()).collect());
    }
}

fn gid_text(g: &str) -> String {
    let a: std::net::Ipv6Addr = g.parse().unwrap();
    a.segments().iter().map(|s| format!("{s:04x}")).collect::<Vec<_>>().join(":")
}

/// Wait until `gid` shows up in `dev`'s table (rxe fills it asynchronously); its index.
fn wait_gid(dev: &str, gid: &str) -> u32 {
    let want = gid_text(gid);
    until(&format!("GID {gid} in {dev}'s table"), || {
        let dir = format!("/sys/class/infiniband/{dev}/ports/1/gids");
        (0..64u32).find(|i| std::fs::read_to_string(format!("{dir}/{i}")).is_ok_and(|s| s.trim() == want))
    })
}

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn netdev_of(dev: &str) -> String {
    std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/0"))
        .expect("netdev of the device")
        .trim()
        .to_string()
}

// ---------------------------------------------------------------- GID choice

/// The reason is logged at INFO once per device, not per connection, and
/// is kept for diagnostics. Named to run first (the record is per process).
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn a0_gid_choice_logged_once_per_device_with_reason() {
    let d = device();
    let nd = netdev_of(&d);
    let ((), log) = captured(|| {
        let (n, idx) = net(&[&d], &[]);
        for _ in 0..3 {
            let (mut s, mut r) = pair_tc(&n, idx[0], idx[0], None);
            transfer(&n, &mut s, &mut r, &[4096]);
        }
    });
    let infos = gid_infos(&log);
    let c = gid::last_choice(&d, 1).expect("the choice is recorded per port");
    eprintln!("recorded: {}", c.reason());
    assert_eq!(infos.len(), 1, "one INFO line for 6 connection ends: {infos:?}");
    assert!(gid::is_v4(&c.gid) && c.version == Some(2), "{}", c.reason());
    let want = format!("{d}:1 GID {} {} RoCE v2 on {nd}: IPv4 v2 preferred; skipped 1 link-local", c.index, gid::show(&c.gid));
    assert_eq!(infos[0], format!("GID choice: {want}"));
    assert_eq!(c.reason(), want);
}

/// An IPv6 address: chosen with NCCL_IB_ADDR_FAMILY=AF_INET6 (and by an
/// IPv6 NCCL_IB_ADDR_RANGE), data moves over it; the default stays IPv4.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn ipv6_address_is_chosen_for_af_inet6_and_moves_data() {
    let d = device();
    assert!(root(), "needs root to add addresses (the VM runs as root)");
    let nd = netdev_of(&d);
    let mut u = Undo(vec![]);
    u.run(&["-6", "addr", "add", "fd99::1/64", "dev", &nd, "nodad"], &["-6", "addr", "del", "fd99::1/64", "dev", &nd]);
    let ix = wait_gid(&d, "fd99::1");
    for extra in [[("NCCL_IB_ADDR_FAMILY", "AF_INET6")], [("NCCL_IB_ADDR_RANGE", "fd99::/16")]] {
        let (n, idx) = net(&[&d], &extra);
        let a = handshake::local_addr(&n.devices()[idx[0]], n.conn_cfg()).expect("local address");
        let c = gid::last_choice(&d, 1).unwrap();
        eprintln!("{extra:?}: {}", c.reason());
        assert_eq!((a.gid_index as u32, gid::show(&a.gid), a.family), (ix, "fd99::1".to_string(), 6), "{}", c.reason());
        assert!(
            c.why.starts_with(if extra[0].0 == "NCCL_IB_ADDR_RANGE" { "IPv6 v2 in range fd99::/16" } else { "IPv6 v2 preferred" }),
            "{}",
            c.reason()
        );
        let (mut s, mut r) = pair_tc(&n, idx[0], idx[0], None);
        transfer(&n, &mut s, &mut r, &[1, 4096, 1 << 20]);
    }
    let (n, idx) = net(&[&d], &[]);
    let a = handshake::local_addr(&n.devices()[idx[0]], n.conn_cfg()).unwrap();
    assert!(gid::is_v4(&a.gid), "default stays IPv4: {}", gid::last_choice(&d, 1).unwrap().reason());
}

/// A VLAN upper with its own subnet: NCCL_IB_ADDR_RANGE selects its GID
/// (whose netdev is the VLAN device), and data moves over it.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn vlan_upper_selected_by_addr_range_moves_data() {
    let d = device();
    assert!(root(), "needs root to add a VLAN device (the VM runs as root)");
    let nd = netdev_of(&d);
    let vlan = format!("{nd}.7");
    let mut u = Undo(vec![]);
    u.run(&["link", "add", "link", &nd, "name", &vlan, "type", "vlan", "id", "7"], &["link", "del", &vlan]);
    ip(&["addr", "add", "10.199.77.1/24", "dev", &vlan]);
    ip(&["link", "set", &vlan, "up"]);
    let ix = wait_gid(&d, "::ffff:10.199.77.1");
    let (n, idx) = net(&[&d], &[("NCCL_IB_ADDR_RANGE", "10.199.77.0/24")]);
    let a = handshake::local_addr(&n.devices()[idx[0]], n.conn_cfg()).expect("local address");
    let c = gid::last_choice(&d, 1).unwrap();
    eprintln!("{}", c.reason());
    assert_eq!(a.gid_index as u32, ix);
    assert_eq!(c.ndev.as_deref(), Some(vlan.as_str()));
    assert!(c.reason().contains(&format!("on {vlan}: IPv4 v2 in range 10.199.77.0/24")), "{}", c.reason());
    let (mut s, mut r) = pair_tc(&n, idx[0], idx[0], None);
    transfer(&n, &mut s, &mut r, &[8, 65536]);
    // the VLAN device down: either its GID leaves the table (then nothing is
    // in the range: a clear error) or the choice says its netdev is down
    ip(&["link", "set", &vlan, "down"]);
    let what = until("the choice to notice the VLAN device is down", || match handshake::local_addr(&n.devices()[idx[0]], n.conn_cfg()) {
        Err(e) => Some(e.to_string()),
        Ok(_) => Some(gid::last_choice(&d, 1).unwrap().reason()).filter(|r| r.contains(&format!("netdev {vlan} is "))),
    });
    eprintln!("after {vlan} down: {what}");
    assert!(what.contains("NCCL_IB_ADDR_RANGE=10.199.77.0/24") || what.contains(&format!("netdev {vlan} is ")), "{what}");
}

/// An IPv4 address added after start-up: with NCCL_IB_ADDR_RANGE naming its
/// subnet, the connection before it fails clearly, the next one after it
/// uses the new GID (same IbNet, no restart) and moves data, and the INFO
/// line says the choice.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn ipv4_address_added_after_startup_is_used_by_the_next_connection() {
    let d = device();
    assert!(root(), "needs root to add addresses (the VM runs as root)");
    let nd = netdev_of(&d);
    let (n, idx) = net(&[&d], &[("NCCL_IB_ADDR_RANGE", "10.199.88.0/24")]);
    let e = handshake::local_addr(&n.devices()[idx[0]], n.conn_cfg()).map(|_| ()).unwrap_err().to_string();
    eprintln!("before: {e}");
    assert!(e.contains("no GID inside NCCL_IB_ADDR_RANGE=10.199.88.0/24") && e.contains("usable: "), "{e}");
    let mut u = Undo(vec![]);
    u.run(&["addr", "add", "10.199.88.1/24", "dev", &nd], &["addr", "del", "10.199.88.1/24", "dev", &nd]);
    let ix = wait_gid(&d, "::ffff:10.199.88.1");
    let ((), log) = captured(|| {
        let (mut s, mut r) = pair_tc(&n, idx[0], idx[0], None);
        transfer(&n, &mut s, &mut r, &[0, 4096, (1 << 20) + 3]);
    });
    let c = gid::last_choice(&d, 1).unwrap();
    eprintln!("after: {}", c.reason());
    assert_eq!((c.index, gid::show(&c.gid)), (ix, "::ffff:10.199.88.1".to_string()));
    let infos = gid_infos(&log);
    assert!(
        infos.len() == 1
            && infos[0].contains("GID choice")
            && infos[0].contains("::ffff:10.199.88.1")
            && infos[0].contains("in range 10.199.88.0/24"),
        "{infos:?}"
    );
}

/// One end on IPv6, the other on IPv4: both fail, naming both GIDs.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn family_mismatch_fails_both_ends_naming_both_gids() {
    let (d1, d2) = device2();
    assert!(root(), "needs root to add addresses (the VM runs as root)");
    let nd = netdev_of(&d1);
    let mut u = Undo(vec![]);
    u.run(&["-6", "addr", "add", "fd98::1/64", "dev", &nd, "nodad"], &["-6", "addr", "del", "fd98::1/64", "dev", &nd]);
    wait_gid(&d1, "fd98::1");
    let (n6, i6) = net(&[&d1], &[("NCCL_IB_ADDR_FAMILY", "AF_INET6")]);
    let (n4, i4) = net(&[&d2], &[]);
    let (mut l, h) = n4.listen(i4[0]).unwrap();
    let mut c = n6.connect(i6[0], &h, None).unwrap();
    until("connect", || c.progress().expect("connect").then_some(()));
    let mut s = c.into_send_comm().unwrap();
    let rerr = until("the receiver to refuse", || match l.accept() {
        Ok(None) => None,
        Ok(Some(_)) => panic!("accepted a connection whose GID families differ"),
        Err(e) => Some(e.to_string()),
    });
    let mut b = Buf::new(64);
    let smr = reg(&n6, i6[0], &mut b, Access::LOCAL_READ);
    let serr = until("the sender to fail", || {
        // SAFETY: b outlives the request.
        match unsafe { s.isend(b.raw(), 0, Some(&smr)) } {
            Ok(Some(_)) => panic!("isend accepted on a mismatched connection"),
            Ok(None) => None,
            Err(e) => Some(e.to_string()),
        }
    });
    eprintln!("receiver: {rerr}\nsender: {serr}");
    for e in [&rerr, &serr] {
        assert!(
            e.contains("RoCE GID mismatch") && e.contains("fd98::1") && e.contains("::ffff:") && e.contains("IPv6") && e.contains("IPv4"),
            "{e}"
        );
    }
}

// ---------------------------------------------------------------- traffic class on the wire

/// tcpdump on a veth, started before the traffic and stopped after.
struct Tcpdump {
    child: Child,
    out: std::path::PathBuf,
}

impl Tcpdump {
    fn start(ifname: &str) -> Tcpdump {
        let out = std::env::temp_dir().join(format!("rustnet-tcpdump-{}-{}.txt", std::process::id(), ifname));
        let f = std::fs::File::create(&out).expect("capture file");
        let mut child = Command::new("tcpdump")
            .args(["-i", ifname, "-nn", "-v", "-l", "--immediate-mode", "udp", "port", "4791"])
            .stdout(f)
            .stderr(Stdio::piped())
            .spawn()
            .expect("tcpdump (needed in the VM)");
        // wait for "listening on ..." so nothing is missed
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        err.read_line(&mut line).expect("tcpdump stderr");
        assert!(line.contains("listening on"), "tcpdump: {line}");
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
        Tcpdump { child, out }
    }

    /// Stop and return (src, dst, tos, udp payload length) per packet.
    fn stop(mut self) -> Vec<(String, String, u8, usize)> {
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let _ = std::fs::remove_file(&self.out);
        parse_tcpdump(&text)
    }
}

impl Drop for Tcpdump {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `IP (tos 0xb8, ttl 64, ...)` then `    10.199.0.1.49152 > 10.199.0.2.4791: UDP, length 48`.
fn parse_tcpdump(text: &str) -> Vec<(String, String, u8, usize)> {
    let mut out = Vec::new();
    let mut tos = None;
    for l in text.lines() {
        if let Some(p) = l.find("(tos 0x") {
            let h: String = l[p + 7..].chars().take_while(|c| c.is_ascii_hexdigit()).collect();
            tos = u8::from_str_radix(&h, 16).ok();
            continue;
        }
        let (Some(t), Some((a, rest))) = (tos, l.trim().split_once(" > ")) else { continue };
        let Some((b, rest)) = rest.split_once(": UDP, length ") else { continue };
        let strip = |s: &str| s.rsplit_once('.').map(|x| x.0.to_string()).unwrap_or_default();
        out.push((strip(a), strip(b), t, rest.trim().parse().unwrap_or(0)));
        tos = None;
    }
    out
}

/// RoCE v2 packets over IPv4: an ACK is BTH+AETH+ICRC (20 bytes of UDP
/// payload); anything longer from the receiver is a CTS write.
const ACK_LEN: usize = 20;

/// Move data rxe0 -> rxe1 with `env` and `comm_tc`; check the TOS of the
/// sender's packets (data writes) and of the receiver's (CTS writes, ACKs).
fn tos_case(env: &[(&str, &str)], comm_tc: Option<i32>, want_data: u8, want_cts: u8) {
    let (d1, d2) = device2();
    assert!(root(), "needs root for tcpdump (the VM runs as root)");
    let (ip0, ip1) = (std::env::var("RXE_VM_IP0").expect("RXE_VM_IP0"), std::env::var("RXE_VM_IP1").expect("RXE_VM_IP1"));
    let (n, idx) = net(&[&d1, &d2], env);
    let cap = Tcpdump::start(&netdev_of(&d1));
    let (mut s, mut r) = pair_tc(&n, idx[0], idx[1], comm_tc);
    transfer(&n, &mut s, &mut r, &[64, 4096, 65536]);
    drop((s, r));
    let pk = cap.stop();
    let data: Vec<_> = pk.iter().filter(|p| p.0 == ip0 && p.1 == ip1).collect();
    let back: Vec<_> = pk.iter().filter(|p| p.0 == ip1 && p.1 == ip0).collect();
    let cts: Vec<_> = back.iter().filter(|p| p.3 > ACK_LEN).collect();
    let tos_set = |v: &[&(String, String, u8, usize)]| v.iter().map(|p| format!("{:#04x}", p.2)).collect::<std::collections::BTreeSet<_>>();
    eprintln!(
        "{env:?} comm_tc={comm_tc:?}: {} packets; {ip0}->{ip1} (data): {} with tos {:?}; {ip1}->{ip0}: {} ({} CTS writes) with tos {:?}",
        pk.len(),
        data.len(),
        tos_set(&data),
        back.len(),
        cts.len(),
        tos_set(&back)
    );
    assert!(data.iter().filter(|p| p.3 > 1024).count() >= 1, "no data write captured: {pk:?}");
    assert!(!cts.is_empty(), "no CTS write captured: {pk:?}");
    for p in &data {
        assert_eq!(p.2, want_data, "sender packet {p:?}");
    }
    for p in &back {
        assert_eq!(p.2, want_cts, "receiver packet {p:?}");
    }
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn tos_default_is_zero() {
    tos_case(&[], None, 0, 0);
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn tos_nccl_ib_tc_184_on_data_and_cts() {
    tos_case(&[("NCCL_IB_TC", "184")], None, 0xb8, 0xb8);
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn tos_fifo_tc_104_on_the_receivers_cts_writes() {
    tos_case(&[("NCCL_IB_TC", "184"), ("NCCL_IB_FIFO_TC", "104")], None, 0xb8, 0x68);
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn tos_communicator_traffic_class_from_v10_connect() {
    tos_case(&[], Some(96), 0x60, 0x60);
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn tos_nccl_ib_tc_wins_over_the_communicators() {
    tos_case(&[("NCCL_IB_TC", "184")], Some(96), 0xb8, 0xb8);
}

/// One message of `size` bytes from `s` to `r` through the driver, checked.
fn drv_transfer(p: &Plugin, s: Ptr, r: Ptr, size: usize, fill: u8) {
    let mut src = vec![fill; size];
    let mut dst = vec![0u8; size];
    let smh = p.reg_mr(s, src.as_mut_ptr(), size).expect("regMr send");
    let rmh = p.reg_mr(r, dst.as_mut_ptr(), size).expect("regMr recv");
    let rq = until("irecv", || p.irecv(r, &[(dst.as_mut_ptr(), size, 3, rmh)]).expect("irecv"));
    let mut sizes = [0i32; 8];
    let mut rdone = false;
    let sq = until("isend", || {
        rdone = rdone || p.test(rq, &mut sizes).expect("test recv");
        p.isend(s, src.as_mut_ptr(), size, 3, smh).expect("isend")
    });
    until("send completion", || p.test(sq, &mut [0]).expect("test send").then_some(()));
    if !rdone {
        until("receive completion", || p.test(rq, &mut sizes).expect("test recv").then_some(()));
    }
    assert_eq!(sizes[0] as usize, size);
    assert!(dst == src, "payload of {size} bytes differs");
    p.dereg_mr(s, smh).unwrap();
    p.dereg_mr(r, rmh).unwrap();
}

/// ABI v11/v12 through the built `.so`, as NCCL 2.28+/2.30+ drive it: two
/// communicators' plugin contexts in one process, traffic classes 96 and
/// 184, each with a connection rxe0 -> rxe1, all four comms open before any
/// traffic. Every RoCE packet of each context's transfer, both ways (data
/// writes, CTS writes, ACKs), carries its context's class as the IPv4 TOS.
fn two_contexts_on_the_wire(version: u32) {
    let (d1, d2) = device2();
    assert!(root(), "needs root for tcpdump (the VM runs as root)");
    assert!(std::env::var_os("NCCL_IB_TC").is_none(), "NCCL_IB_TC is set: it would win over the contexts' classes");
    let (ip0, ip1) = (std::env::var("RXE_VM_IP0").expect("RXE_VM_IP0"), std::env::var("RXE_VM_IP1").expect("RXE_VM_IP1"));
    // the .so reads its knobs at init, from this process's environment
    std::env::set_var("NCCL_IB_HCA", format!("={d1},{d2}"));
    std::env::set_var("RUSTNET_TRANSPORT", "ib");
    let so = driver::default_plugin_path();
    let p = Plugin::open(&so, version).unwrap_or_else(|e| panic!("{e}"));
    p.init().expect("init");
    let n = p.devices().unwrap();
    let idx = |d: &str| {
        (0..n)
            .find(|&i| {
                let name = p.properties(i).unwrap().name;
                name == d || name.starts_with(&format!("{d}:"))
            })
            .unwrap_or_else(|| panic!("{d} not among the plugin's {n} devices"))
    };
    let (sd, rd) = (idx(&d1), idx(&d2));
    let ctxs = [(p.init_context(0xc1, Some(96)).unwrap(), 0x60u8), (p.init_context(0xc2, Some(184)).unwrap(), 0xb8u8)];
    let pairs: Vec<(Ptr, Ptr, Ptr)> = ctxs
        .iter()
        .map(|&(c, _)| {
            let (mut h, l) = p.listen_in(c, rd).expect("listen");
            let (s, r) = p.connect_accept_in(c, sd, &mut h, l, DEADLINE).expect("connect/accept");
            (s, r, l)
        })
        .collect();
    for (k, (&(_, want), &(s, r, _))) in ctxs.iter().zip(&pairs).enumerate() {
        let cap = Tcpdump::start(&netdev_of(&d1));
        for size in [64, 4096, 65536] {
            drv_transfer(&p, s, r, size, k as u8 + 1);
        }
        let pk = cap.stop();
        let data: Vec<_> = pk.iter().filter(|x| x.0 == ip0 && x.1 == ip1).collect();
        let back: Vec<_> = pk.iter().filter(|x| x.0 == ip1 && x.1 == ip0).collect();
        let tos: std::collections::BTreeSet<String> = pk.iter().map(|x| format!("{:#04x}", x.2)).collect();
        eprintln!(
            "v{version} context {} (traffic class {}): {} RoCE packets, {ip0}->{ip1} {} ({} data writes > 1 KiB), {ip1}->{ip0} {} ({} CTS writes); tos {tos:?}",
            k + 1,
            want,
            pk.len(),
            data.len(),
            data.iter().filter(|x| x.3 > 1024).count(),
            back.len(),
            back.iter().filter(|x| x.3 > ACK_LEN).count()
        );
        assert!(data.iter().any(|x| x.3 > 1024), "no data write captured: {pk:?}");
        assert!(back.iter().any(|x| x.3 > ACK_LEN), "no CTS write captured: {pk:?}");
        for x in &pk {
            assert_eq!(x.2, want, "context {} packet {x:?}", k + 1);
        }
    }
    for (s, r, l) in pairs {
        p.close_send(s).unwrap();
        p.close_recv(r).unwrap();
        p.close_listen(l).unwrap();
    }
    for (c, _) in ctxs {
        p.finalize(c).expect("finalize");
    }
    drop(p);
    std::env::remove_var("NCCL_IB_HCA");
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn tos_two_v11_contexts_on_the_wire() {
    two_contexts_on_the_wire(11);
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn tos_two_v12_contexts_on_the_wire() {
    two_contexts_on_the_wire(12);
}

#[test]
fn tcpdump_lines_parse() {
    let t = "12:00:00.000 IP (tos 0xb8, ttl 64, id 0, offset 0, flags [DF], proto UDP (17), length 1100)\n    10.199.0.1.49152 > 10.199.0.2.4791: UDP, length 1072\n\
             12:00:00.001 IP (tos 0x68, ttl 64, id 0, offset 0, flags [DF], proto UDP (17), length 48)\n    10.199.0.2.49153 > 10.199.0.1.4791: UDP, length 20\n";
    let p = parse_tcpdump(t);
    assert_eq!(p, vec![("10.199.0.1".into(), "10.199.0.2".into(), 0xb8, 1072), ("10.199.0.2".into(), "10.199.0.1".into(), 0x68, 20)]);
}
