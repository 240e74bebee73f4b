//! Verbs transport tests against a real RDMA device (soft-RoCE in
//! `tests/rxe-vm/`). Selected by `RUSTNET_TEST_DEVICE` (e.g. `rxe0`) and,
//! for the two-device tests, `RUSTNET_TEST_DEVICE2` (e.g. `rxe1`); the
//! out-of-band interface follows `NCCL_SOCKET_IFNAME`.
//!
//! Every device test is `#[ignore]`d with its reason, so a plain `cargo test`
//! on a host without RDMA counts them as ignored; the VM suite runs them with
//! `--include-ignored`. Included without `RUSTNET_TEST_DEVICE`, or with a
//! missing device, they fail: these tests never pass without having moved bytes. The host-behaviour test
//! (`host_without_rdma_*`) runs in both worlds and checks the one that applies.
//!
//! Run them one at a time (`--test-threads=1`): rxe loses completions with
//! concurrent QPs on one device in some kernels.
#[path = "common/ib.rs"]
mod ib;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ib::{captured, device, device2, net, one_by_one, pair, reg, until, Buf, DEADLINE};
use rustnet::for_tools::config::Config;
use rustnet::for_tools::ib::{handshake, Access, IbMr, IbNet, RecvComm, SendComm};
use rustnet::for_tools::plugin::{select_net, Net};
use rustnet::for_tools::transport::{MemKind, RawBuf, RecvBuf, PTR_HOST};
use rustnet::proto::pool::ReqId;
use rustnet::Error;

const SIZES: [usize; 10] = [0, 1, 8, 127, 4095, 4096, 65536, 65537, 1 << 20, (4 << 20) + 3];

// ---------------------------------------------------------------- host behaviour

/// Without an RDMA device (our build hosts: `ibv_get_device_list` fails with
/// ENOSYS) `auto` is TCP with exactly one INFO line and `ib` is an init error
/// naming what was found. With a device, `auto` picks verbs.
#[test]
fn host_without_rdma_falls_back_to_tcp_and_ib_fails_with_reason() {
    let base = [("NCCL_SOCKET_IFNAME", std::env::var("NCCL_SOCKET_IFNAME").unwrap_or_else(|_| "lo".into()))];
    let kv = |t: &'static str| -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = base.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        v.push(("RUSTNET_TRANSPORT".into(), t.into()));
        v
    };
    let cfg_of = |t: &'static str| {
        let m: HashMap<String, String> = kv(t).into_iter().collect();
        Config::from_lookup(&|k| m.get(k).cloned().or_else(|| std::env::var(k).ok().filter(|_| k.starts_with("NCCL_IB")))).unwrap()
    };
    if let Some(d) = std::env::var("RUSTNET_TEST_DEVICE").ok().filter(|d| !d.is_empty()) {
        let (n, _) = captured(|| select_net(&cfg_of("auto")));
        match n.expect("auto with a device") {
            Net::Ib(n) => assert!(n.devices().iter().any(|x| x.dev_name == d), "auto chose verbs but not {d}"),
            Net::Tcp(_) => panic!("RUSTNET_TEST_DEVICE={d} is set but auto chose TCP"),
        }
        return;
    }
    let why = match IbNet::new(&cfg_of("ib")) {
        Ok(n) => {
            eprintln!("SKIPPED: this host has RDMA devices ({}) but RUSTNET_TEST_DEVICE is not set", n.describe());
            return;
        }
        Err(e) => e.to_string(),
    };
    assert!(why.contains("ibv_get_device_list") || why.contains("libibverbs") || why.contains("RDMA"), "{why}");
    let (n, log) = captured(|| select_net(&cfg_of("auto")));
    assert!(matches!(n.expect("auto falls back"), Net::Tcp(_)));
    let info: Vec<&String> = log.iter().filter(|(l, _)| *l == tracing::Level::INFO).map(|(_, m)| m).collect();
    assert_eq!(info.len(), 1, "want exactly one INFO line, got {log:?}");
    assert!(info[0].starts_with("no RDMA devices (") && info[0].ends_with("): using TCP"), "{}", info[0]);
    assert!(log.iter().all(|(l, _)| *l != tracing::Level::WARN), "no WARN expected: {log:?}");
    let e = match select_net(&cfg_of("ib")) {
        Err(e) => e,
        Ok(_) => panic!("ib without devices must fail"),
    };
    assert!(matches!(e, Error::Usage(_)));
    let m = e.to_string();
    assert!(m.contains("RUSTNET_TRANSPORT=ib") && m.contains(&why), "{m}");
}

// ---------------------------------------------------------------- device tests

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn device_found_with_sane_properties_and_ipv4_roce_v2_gid() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let dev = &n.devices()[idx[0]];
    let p = n.props(idx[0]).unwrap();
    assert_eq!(p.name.to_str().unwrap(), d, "one port: the device name");
    assert_eq!(p.port, 1);
    assert!(p.speed_mbps > 0 && p.max_comms > 0);
    assert_eq!((p.max_recvs, p.ptr_support, p.reg_is_global), (8, PTR_HOST, true));
    let a = handshake::local_addr(dev, n.conn_cfg()).expect("local address");
    eprintln!("{}: GID index {} = {}, MTU code {}", dev.describe(), a.gid_index, rustnet::for_tools::ib::gid::show(&a.gid), a.mtu);
    if dev.link_layer == rustnet::for_tools::ib::device::LINK_ETH {
        assert!(rustnet::for_tools::ib::gid::is_v4(&a.gid), "RoCE: want the IPv4 RoCE v2 GID");
    }
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn gid_index_knob_is_honoured_and_an_empty_index_is_an_error() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let auto = handshake::local_addr(&n.devices()[idx[0]], n.conn_cfg()).expect("auto GID");
    let want = auto.gid_index.to_string();
    let (n, idx) = net(&[&d], &[("NCCL_IB_GID_INDEX", want.as_str())]);
    let a = handshake::local_addr(&n.devices()[idx[0]], n.conn_cfg()).expect("explicit GID");
    assert_eq!((a.gid_index, a.gid), (auto.gid_index, auto.gid));
    // and traffic over the explicit index
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    one_by_one(&n, &mut s, &mut r, &[8, 4096]);
    if n.devices()[idx[0]].link_layer == rustnet::for_tools::ib::device::LINK_ETH {
        let (n, idx) = net(&[&d], &[("NCCL_IB_GID_INDEX", "1000")]);
        let e = handshake::local_addr(&n.devices()[idx[0]], n.conn_cfg()).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("GID index 1000") && e.contains("NCCL_IB_GID_INDEX"), "{e}");
        let (mut l, h) = n.listen(idx[0]).unwrap();
        let mut c = n.connect(idx[0], &h, None).unwrap();
        let t0 = Instant::now();
        let err = loop {
            match c.progress() {
                Err(e) => break e,
                Ok(_) => {
                    let _ = l.accept();
                    assert!(t0.elapsed() < DEADLINE, "connect with an empty GID index did not fail");
                }
            }
        };
        assert!(err.to_string().contains("GID index 1000"), "{err}");
    }
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn loopback_on_one_device_all_sizes() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    one_by_one(&n, &mut s, &mut r, &SIZES);
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn across_two_devices_all_sizes() {
    let (d1, d2) = device2();
    let (n, idx) = net(&[&d1, &d2], &[]);
    let (mut s, mut r) = pair(&n, idx[0], idx[1]);
    one_by_one(&n, &mut s, &mut r, &SIZES);
    // and the other way round
    let (mut s, mut r) = pair(&n, idx[1], idx[0]);
    one_by_one(&n, &mut s, &mut r, &SIZES[..6]);
}

fn grouped(n: &IbNet, s: &mut SendComm, r: &mut RecvComm, rounds: usize) {
    let (sd, rd) = (s.dev(), r.dev());
    for round in 0..rounds {
        let sizes = [0usize, 1, 4096, 100, 70000, 8, 3, 1 << 16];
        let tags = [5, 6, 4, 7, 8, 9, 10, 11];
        let nb = 1 + (round % 8);
        let mut srcs: Vec<Buf> = (0..nb).map(|i| Buf::new(sizes[i])).collect();
        let mut dsts: Vec<Buf> = (0..nb).map(|i| Buf::new(sizes[i] + 100)).collect();
        for (i, b) in srcs.iter_mut().enumerate() {
            b.fill((round * 8 + i) as u8);
        }
        let smrs: Vec<IbMr> = srcs.iter_mut().map(|b| reg(n, sd, b, Access::LOCAL_READ)).collect();
        let rmrs: Vec<IbMr> = dsts.iter_mut().map(|b| reg(n, rd, b, Access::REMOTE_WRITE)).collect();
        let rbs: Vec<RecvBuf> = dsts.iter_mut().enumerate().map(|(i, b)| RecvBuf { buf: b.raw(), tag: tags[i] }).collect();
        let mrefs: Vec<Option<&IbMr>> = rmrs.iter().map(Some).collect();
        // SAFETY: buffers outlive the requests (checked complete below).
        let rid = unsafe { r.irecv(&rbs, &mrefs) }.unwrap().unwrap();
        // send in reverse order: matching is by tag, not position
        let mut sids = Vec::new();
        let mut rc = None;
        for i in (0..nb).rev() {
            let id = until("grouped isend", || {
                if rc.is_none() {
                    rc = r.test(rid).unwrap();
                }
                // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
                unsafe { s.isend(srcs[i].raw(), tags[i], Some(&smrs[i])) }.unwrap()
            });
            sids.push((id, sizes[i]));
        }
        for (id, sz) in sids {
            let c = until("grouped send completion", || s.test(id).unwrap());
            assert_eq!(c.sizes[0], sz);
        }
        let c = match rc {
            Some(c) => c,
            None => until("grouped receive", || r.test(rid).unwrap()),
        };
        assert_eq!(c.n, nb);
        for i in 0..nb {
            assert_eq!(c.sizes[i], sizes[i], "round {round} buffer {i}");
            assert!(dsts[i].bytes()[..sizes[i]] == srcs[i].bytes()[..], "round {round} buffer {i} bytes");
        }
    }
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn grouped_receives_match_tags_and_report_exact_sizes() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    grouped(&n, &mut s, &mut r, 16);
}

fn many_in_flight(n: &IbNet, s: &mut SendComm, r: &mut RecvComm, rounds: usize, per: usize) {
    let (sd, rd) = (s.dev(), r.dev());
    let size = 3000;
    let mut src = Buf::new(size * per);
    let mut dst = Buf::new(size * per);
    let smr = reg(n, sd, &mut src, Access::LOCAL_READ);
    let rmr = reg(n, rd, &mut dst, Access::REMOTE_WRITE);
    for round in 0..rounds {
        src.fill(round as u8);
        dst.bytes_mut().fill(0);
        let base_s = src.raw();
        let base_d = dst.raw();
        let piece = |b: RawBuf, i: usize| RawBuf { ptr: b.ptr.wrapping_add(i * size), len: size - i };
        let mut rids: Vec<ReqId> = Vec::new();
        for i in 0..per {
            let rb = [RecvBuf { buf: piece(base_d, i), tag: i as i32 }];
            // SAFETY: dst outlives the requests.
            rids.push(unsafe { r.irecv(&rb, &[Some(&rmr)]) }.unwrap().expect("32 receives in flight must fit"));
        }
        let mut rdone = vec![false; per];
        let test_recv = |r: &mut RecvComm, i: usize, rdone: &mut Vec<bool>| {
            if !rdone[i] {
                if let Some(c) = r.test(rids[i]).unwrap() {
                    assert_eq!(c.sizes[0], size - i);
                    rdone[i] = true;
                }
            }
        };
        let mut sids = Vec::new();
        for i in 0..per {
            sids.push(until("isend", || {
                test_recv(r, 0, &mut rdone);
                // SAFETY: src outlives the requests.
                unsafe { s.isend(piece(base_s, i), i as i32, Some(&smr)) }.unwrap()
            }));
        }
        let mut sdone = vec![false; per];
        until("all completions", || {
            for i in 0..per {
                if !sdone[i] {
                    sdone[i] = s.test(sids[i]).unwrap().is_some();
                }
                test_recv(r, i, &mut rdone);
            }
            (rdone.iter().all(|&d| d) && sdone.iter().all(|&d| d)).then_some(())
        });
        for i in 0..per {
            let o = i * size;
            assert!(dst.bytes()[o..o + size - i] == src.bytes()[o..o + size - i], "round {round} message {i}");
        }
    }
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn thirty_two_requests_in_flight_wrap_the_fifo() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    many_in_flight(&n, &mut s, &mut r, 5, 32);
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn two_qps_rotating_and_split() {
    let d = device();
    for split in ["0", "1"] {
        let (n, idx) = net(&[&d], &[("NCCL_IB_QPS_PER_CONNECTION", "2"), ("NCCL_IB_SPLIT_DATA_ON_QPS", split)]);
        let (mut s, mut r) = pair(&n, idx[0], idx[0]);
        assert_eq!(s.qpns().len(), 0, "QPs reach RTS only after the receiver answered");
        one_by_one(&n, &mut s, &mut r, &SIZES);
        assert_eq!(s.qpns().len(), 2);
        grouped(&n, &mut s, &mut r, 8);
        many_in_flight(&n, &mut s, &mut r, 2, 32);
    }
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn without_inline_sends() {
    let d = device();
    let (n, idx) = net(&[&d], &[("NCCL_IB_USE_INLINE", "0")]);
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    one_by_one(&n, &mut s, &mut r, &SIZES[..7]);
    grouped(&n, &mut s, &mut r, 8);
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn oversized_send_fails_both_ends_with_usage_errors() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    let mut src = Buf::new(200);
    let mut dst = Buf::new(100);
    let smr = reg(&n, idx[0], &mut src, Access::LOCAL_READ);
    let rmr = reg(&n, idx[0], &mut dst, Access::REMOTE_WRITE);
    // SAFETY: buffers outlive the requests.
    let rid = unsafe { r.irecv(&[RecvBuf { buf: dst.raw(), tag: 1 }], &[Some(&rmr)]) }.unwrap().unwrap();
    let e = until("isend to fail", || {
        let _ = r.test(rid);
        // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
        match unsafe { s.isend(src.raw(), 1, Some(&smr)) } {
            Ok(None) => None,
            Ok(Some(_)) => panic!("an oversized send was accepted"),
            Err(e) => Some(e),
        }
    });
    assert!(matches!(e, Error::Usage(_)) && e.to_string().contains("larger"), "{e}");
    let e = until("receive to fail", || match r.test(rid) {
        Ok(None) => None,
        Ok(Some(_)) => panic!("the receive completed"),
        Err(e) => Some(e),
    });
    assert!(e.to_string().contains("larger"), "{e}");
}

/// A peer that passed the listener's nonce check and then dies (or sends
/// metadata we cannot read) before the handshake is through fails `accept`
/// naming it: dropping it with a WARN left the receiving rank waiting forever.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn accept_fails_when_a_real_peer_dies_mid_handshake() {
    use rustnet::proto::handle::PROTO_VERSION;
    use rustnet::proto::wire::Hello;
    use std::io::Write;
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    for (what, payload, want) in [
        ("closes after its hello", Vec::new(), "closed the connection while we waited for connection metadata"),
        (
            "sends garbage metadata",
            vec![0x5a; rustnet::proto::ib_meta::META_LEN],
            "broke the protocol: not a librustnet verbs connection message",
        ),
    ] {
        let (mut l, h) = n.listen(idx[0]).unwrap();
        let mut c = std::net::TcpStream::connect(h.addr).unwrap();
        c.write_all(&Hello { version: PROTO_VERSION, stream: 0, nstreams: 1, conn_id: 42, nonce: h.nonce }.encode()).unwrap();
        c.write_all(&payload).unwrap();
        if payload.is_empty() {
            drop(c);
        }
        let e = until("accept to fail", || match l.accept() {
            Ok(None) => None,
            Ok(Some(_)) => panic!("{what}: accepted"),
            Err(e) => Some(e),
        });
        let m = e.to_string();
        eprintln!("{what}: {m}");
        assert!(m.contains(want), "{what}: {m}");
    }
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn flush_is_a_no_op_for_host_memory_unless_forced() {
    let d = device();
    for forced in [false, true] {
        let (n, idx) = net(&[&d], &[("RUSTNET_FORCE_FLUSH", if forced { "1" } else { "0" })]);
        let (mut s, mut r) = pair(&n, idx[0], idx[0]);
        one_by_one(&n, &mut s, &mut r, &[8]);
        let mut dst = Buf::new(4096);
        let rmr = reg(&n, idx[0], &mut dst, n.recv_access());
        let bufs = [RawBuf { ptr: dst.raw().ptr, len: 0 }, RawBuf { ptr: dst.raw().ptr, len: 100 }];
        // with NCCL's mhandle for the buffer (no registration lookup)
        match r.iflush(&bufs, &[None, Some(&rmr)]).expect("iflush") {
            None => assert!(!forced, "a forced flush must post a read"),
            Some(id) => {
                assert!(forced, "host memory needs no flush unless forced");
                let c = until("flush completion", || r.test(id).expect("flush test"));
                assert_eq!(c.n, 0);
            }
        }
        // nothing to flush when every buffer is empty
        assert!(r.iflush(&bufs[..1], &[]).unwrap().is_none());
        drop(rmr);
    }
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn registration_cache_is_refcounted_and_page_aligned() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let dev = &n.devices()[idx[0]];
    let before = dev.mrs.len();
    let mut b = Buf::new(3 * 4096);
    let raw = b.raw();
    let m1 = reg(&n, idx[0], &mut b, Access::REMOTE_WRITE);
    // the same pages with weaker access reuse the registration
    let page = (raw.ptr as usize).div_ceil(4096) * 4096 - raw.ptr as usize;
    // SAFETY: b outlives every registration below.
    let m2 = unsafe { n.reg_mr(idx[0], raw, MemKind::Host, Access::LOCAL_READ) }.unwrap();
    assert_eq!(m1.lkey(), m2.lkey());
    assert_eq!(dev.mrs.len(), before + 1);
    // a sub-range gets its own registration: the rest of a larger one may
    // map pages that were unmapped and mapped again since
    // SAFETY: b outlives every registration below, and this range lies inside it.
    let m3 =
        unsafe { n.reg_mr(idx[0], RawBuf { ptr: raw.ptr.wrapping_add(page + 100), len: 50 }, MemKind::Host, Access::LOCAL_READ) }.unwrap();
    assert_ne!(m1.lkey(), m3.lkey());
    assert_eq!(dev.mrs.len(), before + 2);
    drop(m1);
    assert_eq!(dev.mrs.len(), before + 2, "still referenced");
    drop(m2);
    drop(m3);
    assert_eq!(dev.mrs.len(), before);
}

// ---------------------------------------------------------------- failures

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex128(h: &str) -> [u8; 128] {
    let mut hb = [0u8; 128];
    for (i, b) in hb.iter_mut().enumerate() {
        *b = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).expect("handle hex");
    }
    hb
}

/// The peer process of the tests below. Role `sender`: connects to the
/// handle in `RUSTNET_TEST_PEER_HANDLE` and streams 1 MiB messages until
/// killed. Role `receiver`: listens, prints `HANDLE <hex>`, accepts and
/// receives until killed.
#[test]
#[ignore = "helper process for the peer-death tests"]
fn peer_process() {
    let Ok(role) = std::env::var("RUSTNET_TEST_PEER_ROLE") else { return };
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let mut buf = Buf::new(1 << 20);
    buf.fill(1);
    if role == "sender" {
        let hb = unhex128(&std::env::var("RUSTNET_TEST_PEER_HANDLE").unwrap());
        let h = rustnet::proto::handle::Handle::decode(&hb).unwrap();
        let mut c = n.connect(idx[0], &h, None).unwrap();
        until("connect", || c.progress().unwrap().then_some(()));
        let mut s = c.into_send_comm().unwrap();
        let smr = reg(&n, idx[0], &mut buf, Access::LOCAL_READ);
        loop {
            // SAFETY: buf outlives the process.
            if let Some(id) = unsafe { s.isend(buf.raw(), 0, Some(&smr)) }.unwrap() {
                while s.test(id).unwrap().is_none() {}
            }
        }
    } else {
        let (mut l, h) = n.listen(idx[0]).unwrap();
        let mut hb = [0u8; 128];
        h.encode(&mut hb);
        let out = std::env::var("RUSTNET_TEST_PEER_OUT").unwrap();
        std::fs::write(format!("{out}.tmp"), hex(&hb)).unwrap();
        std::fs::rename(format!("{out}.tmp"), &out).unwrap();
        let mut r = until("accept", || l.accept().unwrap());
        let rmr = reg(&n, idx[0], &mut buf, Access::REMOTE_WRITE);
        loop {
            // SAFETY: buf outlives the process.
            if let Some(id) = unsafe { r.irecv(&[RecvBuf { buf: buf.raw(), tag: 0 }], &[Some(&rmr)]) }.unwrap() {
                while r.test(id).unwrap().is_none() {}
            }
        }
    }
}

/// Where a receiver peer leaves its handle.
fn peer_out() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("rustnet-verbs-peer-{}", std::process::id()))
}

fn spawn_peer(role: &str, handle: Option<&rustnet::proto::handle::Handle>) -> std::process::Child {
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "peer_process", "--ignored", "--nocapture", "--test-threads=1"])
        .env("RUSTNET_TEST_PEER_ROLE", role)
        .env("RUSTNET_TEST_PEER_OUT", peer_out())
        .stdout(std::process::Stdio::null());
    if let Some(h) = handle {
        let mut hb = [0u8; 128];
        h.encode(&mut hb);
        c.env("RUSTNET_TEST_PEER_HANDLE", hex(&hb));
    }
    c.spawn().expect("spawn peer")
}

/// A receiver whose sender is killed mid-stream fails its pending receive
/// instead of hanging.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
#[allow(clippy::zombie_processes)] // a failed assertion ends the test process; the peer then exits on its own
fn sender_killed_mid_transfer_fails_pending_receive() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let (mut l, h) = n.listen(idx[0]).unwrap();
    let mut child = spawn_peer("sender", Some(&h));
    let mut r = until("accept from the peer process", || l.accept().unwrap());
    let mut dst = Buf::new(1 << 20);
    let rmr = reg(&n, idx[0], &mut dst, Access::REMOTE_WRITE);
    let mut got = 0;
    let mut killed_at = None;
    let t0 = Instant::now();
    let err = 'outer: loop {
        // SAFETY: dst outlives the requests (the comm fails or completes them).
        let rid = match unsafe { r.irecv(&[RecvBuf { buf: dst.raw(), tag: 0 }], &[Some(&rmr)]) } {
            Ok(Some(id)) => id,
            Ok(None) => continue,
            Err(e) => break e,
        };
        loop {
            match r.test(rid) {
                Ok(None) => assert!(t0.elapsed() < DEADLINE, "no progress and no error"),
                Ok(Some(_)) => break,
                Err(e) => break 'outer e,
            }
        }
        got += 1;
        if got == 3 {
            child.kill().unwrap();
            child.wait().unwrap();
            killed_at = Some(Instant::now());
        }
    };
    if killed_at.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let k = killed_at.unwrap_or_else(|| panic!("error before the peer was killed: {err}"));
    eprintln!("receiver failed {:?} after the kill: {err}", k.elapsed());
    assert!(matches!(err, Error::Remote { .. }), "{err}");
    assert!(k.elapsed() < Duration::from_secs(30));
}

/// A sender whose receiver process dies fails within the retry timeout:
/// its next isend or pending send returns an error, never hangs.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn receiver_killed_mid_transfer_fails_sender() {
    let d = device();
    let (n, idx) = net(&[&d], &[("NCCL_IB_TIMEOUT", "14"), ("NCCL_IB_RETRY_CNT", "2")]);
    let mut child = spawn_peer("receiver", None);
    let line = until("the peer's handle", || {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("the peer process exited ({st}) without writing its handle");
        }
        std::fs::read_to_string(peer_out()).ok()
    });
    let _ = std::fs::remove_file(peer_out());
    let hb = unhex128(line.trim());
    let h = rustnet::proto::handle::Handle::decode(&hb).unwrap();
    let mut c = n.connect(idx[0], &h, None).unwrap();
    until("connect", || c.progress().unwrap().then_some(()));
    let mut s = c.into_send_comm().unwrap();
    let mut src = Buf::new(1 << 20);
    let smr = reg(&n, idx[0], &mut src, Access::LOCAL_READ);
    let mut sent = 0;
    let mut killed_at = None;
    let t0 = Instant::now();
    let err = 'outer: loop {
        assert!(t0.elapsed() < DEADLINE, "no progress and no error");
        // SAFETY: src outlives the requests.
        let id = match unsafe { s.isend(src.raw(), 0, Some(&smr)) } {
            Ok(Some(id)) => id,
            Ok(None) => continue,
            Err(e) => break e,
        };
        loop {
            match s.test(id) {
                Ok(None) => assert!(t0.elapsed() < DEADLINE, "no progress and no error"),
                Ok(Some(_)) => break,
                Err(e) => break 'outer e,
            }
        }
        sent += 1;
        if sent == 3 {
            child.kill().unwrap();
            child.wait().unwrap();
            killed_at = Some(Instant::now());
        }
    };
    let k = killed_at.unwrap_or_else(|| panic!("error before the peer was killed: {err}"));
    eprintln!("sender failed {:?} after the kill: {err}", k.elapsed());
    assert!(matches!(err, Error::Remote { .. }), "{err}");
    assert!(k.elapsed() < Duration::from_secs(30));
}

/// A sender whose receiver's QP is gone (comm closed without the sender
/// knowing: we drop the receive comm but keep its socket semantics by
/// dropping only after posting) gets a completion error naming the status,
/// the QP and the peer within NCCL_IB_TIMEOUT x NCCL_IB_RETRY_CNT.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn completion_error_names_status_qp_and_peer() {
    let d = device();
    let (n, idx) = net(&[&d], &[("NCCL_IB_TIMEOUT", "12"), ("NCCL_IB_RETRY_CNT", "1")]);
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    one_by_one(&n, &mut s, &mut r, &[8]);
    // the receiver advertises a buffer, then its registration disappears:
    // the sender's write gets a remote access error
    let mut src = Buf::new(4096);
    let mut dst = Buf::new(4096);
    let smr = reg(&n, idx[0], &mut src, Access::LOCAL_READ);
    let rmr = reg(&n, idx[0], &mut dst, Access::REMOTE_WRITE);
    // SAFETY: the buffer outlives the request; its registration is dropped
    // on purpose before the data arrives (the NIC refuses the write).
    let rid = unsafe { r.irecv(&[RecvBuf { buf: dst.raw(), tag: 0 }], &[Some(&rmr)]) }.unwrap().unwrap();
    until("CTS to leave", || r.test(rid).unwrap().map(|_| ()).or(Some(())));
    drop(rmr);
    let qpns = r.qpns();
    let t0 = Instant::now();
    let e = until("the send to fail", || {
        let _ = r.test(rid);
        // SAFETY: src outlives the request.
        match unsafe { s.isend(src.raw(), 0, Some(&smr)) } {
            Ok(None) => None,
            Ok(Some(id)) => loop {
                match s.test(id) {
                    Ok(None) => assert!(t0.elapsed() < DEADLINE),
                    Ok(Some(_)) => panic!("write into a deregistered buffer completed"),
                    Err(e) => break Some(e),
                }
            },
            Err(e) => Some(e),
        }
    });
    let m = e.to_string();
    eprintln!("{m}");
    assert!(matches!(e, Error::Remote { .. }), "{m}");
    assert!(m.contains("work completion error") && m.contains("status") && m.contains(&format!("{:#x}", qpns[0])), "{m}");
    assert!(m.contains(&s.peer().to_string()), "{m}");
}

/// The netdev under `dev`'s port 1 (rxe0 -> veth0).
fn netdev_of(dev: &str) -> Option<String> {
    std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/0")).ok().map(|s| s.trim().to_string())
}

fn ip(args: &[&str]) -> String {
    let o = std::process::Command::new("ip").args(args).output().expect("run ip");
    assert!(o.status.success() || args.first() == Some(&"route"), "ip {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn port_active(dev: &str) -> bool {
    std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/state")).is_ok_and(|s| s.contains("ACTIVE"))
}

/// `ip link set <netdev> down` in the middle of a stream between two
/// devices, for good: both ends stop at the RC retry limit (a PORT_ERR
/// alone fails no comm), recover, wait for the port, and fail when the
/// recovery window (RUSTNET_RECOVERY_TIMEOUT, 3 s here) is spent, naming
/// the knob; nothing hangs. Named to run last: it disturbs the VM's network, and puts
/// the link and its routes back afterwards.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn zz_link_down_mid_transfer_fails_both_ends() {
    let (d1, d2) = device2();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: needs root to take the link down");
        return;
    }
    let ifname = netdev_of(&d1).unwrap_or_else(|| panic!("cannot find the netdev under {d1}"));
    let (n, idx) = net(&[&d1, &d2], &[("NCCL_IB_TIMEOUT", "14"), ("NCCL_IB_RETRY_CNT", "2"), ("RUSTNET_RECOVERY_TIMEOUT", "3")]);
    let (mut s, mut r) = pair(&n, idx[0], idx[1]);
    let mut src = Buf::new(1 << 20);
    let mut dst = Buf::new(1 << 20);
    let smr = reg(&n, idx[0], &mut src, Access::LOCAL_READ);
    let rmr = reg(&n, idx[1], &mut dst, Access::REMOTE_WRITE);
    // the routes the rig put on the veths, to restore after the link comes back
    let routes: Vec<String> =
        ip(&["-o", "route", "show", "table", "all"]).lines().filter(|l| l.contains(" dev veth")).map(String::from).collect();
    let mut done = 0;
    let mut down_at: Option<Instant> = None;
    let (mut serr, mut rerr) = (None, None);
    let t0 = Instant::now();
    let mut rid = None;
    let mut sid = None;
    while serr.is_none() || rerr.is_none() {
        assert!(t0.elapsed() < DEADLINE, "hang: send error {serr:?}, receive error {rerr:?}");
        if rerr.is_none() {
            match rid {
                None => {
                    // SAFETY: dst outlives the requests.
                    match unsafe { r.irecv(&[RecvBuf { buf: dst.raw(), tag: 0 }], &[Some(&rmr)]) } {
                        Ok(id) => rid = id,
                        Err(e) => rerr = Some(e),
                    }
                }
                Some(id) => match r.test(id) {
                    Ok(Some(_)) => {
                        rid = None;
                        done += 1;
                        if done == 2 && down_at.is_none() {
                            ip(&["link", "set", &ifname, "down"]);
                            down_at = Some(Instant::now());
                        }
                    }
                    Ok(None) => {}
                    Err(e) => rerr = Some(e),
                },
            }
        }
        if serr.is_none() {
            match sid {
                // SAFETY: src outlives the requests.
                None => match unsafe { s.isend(src.raw(), 0, Some(&smr)) } {
                    Ok(id) => sid = id,
                    Err(e) => serr = Some(e),
                },
                Some(id) => match s.test(id) {
                    Ok(Some(_)) => sid = None,
                    Ok(None) => {}
                    Err(e) => serr = Some(e),
                },
            }
        }
    }
    let k = down_at.map(|t| t.elapsed());
    ip(&["link", "set", &ifname, "up"]);
    for l in &routes {
        let args: Vec<&str> = std::iter::once("route").chain(std::iter::once("replace")).chain(l.split_whitespace()).collect();
        ip(&args);
    }
    let t1 = Instant::now();
    while !(port_active(&d1) && port_active(&d2)) && t1.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (serr, rerr) = (serr.unwrap(), rerr.unwrap());
    eprintln!("after link down ({k:?}):\n  sender: {serr}\n  receiver: {rerr}");
    assert!(k.is_some(), "failed before the link went down: {serr} / {rerr}");
    assert!(k.unwrap() < Duration::from_secs(30));
    for e in [&serr, &rerr] {
        assert!(matches!(e, Error::Remote { .. } | Error::Sys { .. }), "{e}");
        assert!(e.to_string().contains("RUSTNET_RECOVERY_TIMEOUT=3"), "the error names the recovery window: {e}");
    }
    assert!(port_active(&d1) && port_active(&d2), "ports did not come back");
}

// ---------------------------------------------------------------- eager path

/// Receive `size` bytes into a fresh buffer of `cap` bytes and send one
/// message of `size` bytes filled from `seed`; returns the receive completion.
fn exchange(n: &IbNet, s: &mut SendComm, r: &mut RecvComm, size: usize, cap: usize, seed: u8) -> Vec<u8> {
    exchange2(n, n, s, r, size, cap, seed)
}

/// [`exchange`] between comms of two nets (`ns` the sender's, `nr` the receiver's).
fn exchange2(ns: &IbNet, nr: &IbNet, s: &mut SendComm, r: &mut RecvComm, size: usize, cap: usize, seed: u8) -> Vec<u8> {
    let mut src = Buf::new(size);
    src.fill(seed);
    let mut dst = Buf::new(cap);
    let smr = reg(ns, s.dev(), &mut src, Access::LOCAL_READ);
    let rmr = reg(nr, r.dev(), &mut dst, Access::REMOTE_WRITE);
    // SAFETY: buffers and registrations outlive the requests (completed below).
    let rid = unsafe { r.irecv(&[RecvBuf { buf: dst.raw(), tag: 3 }], &[Some(&rmr)]) }.unwrap().unwrap();
    let mut rc = None;
    let sid = until("isend", || {
        if rc.is_none() {
            rc = r.test(rid).unwrap();
        }
        // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
        unsafe { s.isend(src.raw(), 3, Some(&smr)) }.unwrap()
    });
    until("send completion", || s.test(sid).unwrap());
    let rc = rc.unwrap_or_else(|| until("receive completion", || r.test(rid).unwrap()));
    assert_eq!(rc.sizes[0], size);
    assert_eq!(&dst.bytes()[..size], src.bytes(), "payload of a {size}-byte message");
    dst.bytes()[..size].to_vec()
}

/// Exchange 8-byte messages until one went eagerly (a late ring is made
/// when the sender first asks: the messages before go by CTS).
fn eager_ring_up(n: &IbNet, s: &mut SendComm, r: &mut RecvComm) {
    eager_ring_up2(n, n, s, r)
}

/// [`eager_ring_up`] between comms of two nets.
fn eager_ring_up2(ns: &IbNet, nr: &IbNet, s: &mut SendComm, r: &mut RecvComm) {
    for k in 0..50 {
        if s.eager_stats().0 > 0 {
            assert!(s.eager_registered() && r.eager_registered());
            return;
        }
        exchange2(ns, nr, s, r, 8, 8, k);
    }
    panic!("no eager message in 50 small exchanges: sender {:?}, receiver {:?}", s.eager_stats(), r.eager_stats());
}

/// Small messages go into the receiver's eager ring (one RDMA write, no
/// clear-to-send on the critical path), arrive intact with their exact
/// sizes, whether the ring was registered at connect or on the sender's
/// first request (RUSTNET_IB_EAGER_LAZY), and RUSTNET_IB_EAGER=0 turns the
/// path off.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn eager_small_messages_skip_the_cts_and_arrive_intact() {
    let (d1, d2) = device2();
    for (eager, lazy, want_eager) in [("4096", "1", true), ("4096", "0", true), ("0", "1", false)] {
        let (n, idx) = net(&[&d1, &d2], &[("RUSTNET_IB_EAGER", eager), ("RUSTNET_IB_EAGER_LAZY", lazy)]);
        let (mut s, mut r) = pair(&n, idx[0], idx[1]);
        let sizes: Vec<usize> = (0..200).map(|k| [0, 1, 8, 100, 4095, 4096, 4097, 70_000][k % 8]).collect();
        for (k, &size) in sizes.iter().enumerate() {
            exchange(&n, &mut s, &mut r, size, size + (k % 3) * 64, k as u8);
        }
        let (se, re) = (s.eager_stats(), r.eager_stats());
        eprintln!("RUSTNET_IB_EAGER={eager} RUSTNET_IB_EAGER_LAZY={lazy}: sender eager {se:?}, receiver eager {re:?}");
        assert_eq!(se, re, "both ends count the same eager messages and bytes");
        if want_eager {
            // messages up to 4096 bytes whose CTS was not there yet: most of the small ones
            assert!(se.0 >= 75, "only {} of 150 small messages went eagerly", se.0);
        } else {
            assert_eq!(se.0, 0, "RUSTNET_IB_EAGER=0 still sent eagerly");
        }
    }
}

/// A late eager ring (the default) costs nothing until small messages come:
/// receives above the limit register nothing; the first receive only an
/// eager message could fill (or the sender's request, its first small send
/// with no CTS) has the ring registered on both ends. With
/// RUSTNET_IB_EAGER_LAZY=0 on either end it is registered at connect.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn a_late_eager_ring_is_registered_only_when_small_messages_come() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    for k in 0..20 {
        exchange(&n, &mut s, &mut r, 8192, 8192, k);
    }
    assert!(!s.eager_registered() && !r.eager_registered(), "a ring for a connection that never sent a small message");
    eager_ring_up(&n, &mut s, &mut r);
    for k in 0..20 {
        exchange(&n, &mut s, &mut r, 1 + k as usize * 100, 4096, k);
    }
    assert_eq!(s.eager_stats(), r.eager_stats());
    // one end at RUSTNET_IB_EAGER_LAZY=0 (or a build before late rings): at connect
    for (a, b) in [("0", "1"), ("1", "0")] {
        let (na, ia) = net(&[&d], &[("RUSTNET_IB_EAGER_LAZY", a)]);
        let (nb, ib) = net(&[&d], &[("RUSTNET_IB_EAGER_LAZY", b)]);
        let (mut l, h) = nb.listen(ib[0]).expect("listen");
        let mut c = na.connect(ia[0], &h, None).expect("connect start");
        until("connect", || c.progress().expect("connect").then_some(()));
        let mut s = c.into_send_comm().expect("send comm");
        let mut r = until("accept", || l.accept().expect("accept"));
        exchange2(&na, &nb, &mut s, &mut r, 8, 8, 1);
        assert!(r.eager_registered(), "sender lazy={a}, receiver lazy={b}: the ring is registered at connect");
        eager_ring_up2(&na, &nb, &mut s, &mut r);
    }
}

/// Eager messages sent before their receives are posted wait in the ring;
/// the sender stops at 32 (the ring) until the receiver hands slots back,
/// and every message still lands in its own receive, in order.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn eager_messages_wait_for_their_receives_and_credits_come_back() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    exchange(&n, &mut s, &mut r, 8, 8, 0); // the first receive sets the eager tag
    eager_ring_up(&n, &mut s, &mut r);
    let before = r.eager_stats().0;
    const N: usize = 70;
    let mut src: Vec<Buf> = (0..N).map(|k| Buf::new(16 + k)).collect();
    let mut dst: Vec<Buf> = (0..N).map(|k| Buf::new(16 + k)).collect();
    let smr: Vec<IbMr> = src
        .iter_mut()
        .enumerate()
        .map(|(k, b)| {
            b.fill(k as u8 + 1);
            reg(&n, idx[0], b, Access::LOCAL_READ)
        })
        .collect();
    let rmr: Vec<IbMr> = dst.iter_mut().map(|b| reg(&n, idx[0], b, Access::REMOTE_WRITE)).collect();
    // no receive posted: the ring takes exactly its 32 slots
    let mut sids = Vec::new();
    for k in 0..N {
        // SAFETY: buffers and registrations outlive the requests.
        match unsafe { s.isend(src[k].raw(), 3, Some(&smr[k])) }.unwrap() {
            Some(id) => sids.push(id),
            None => break,
        }
    }
    // (less the slots of the eager messages that brought the ring up, unless their credits came back)
    let slots = rustnet::proto::eager::RING_SLOTS;
    assert!(
        (slots - before as usize..=slots).contains(&sids.len()),
        "{} sends accepted with no receive posted: the ring has {slots} slots, {before} used before",
        sids.len()
    );
    // now post the receives; the rest of the sends follow as credits come back
    let (mut posted, mut rids, mut done) = (0, Vec::new(), vec![false; N]);
    let t0 = Instant::now();
    while done.iter().any(|d| !d) {
        assert!(t0.elapsed() < DEADLINE, "stuck: {} sent, {posted} posted, {} done", sids.len(), done.iter().filter(|d| **d).count());
        if posted < N {
            // SAFETY: the buffer and its registration outlive the request: the loop ends only when every request is done.
            if let Some(id) = unsafe { r.irecv(&[RecvBuf { buf: dst[posted].raw(), tag: 3 }], &[Some(&rmr[posted])]) }.unwrap() {
                rids.push((posted, id));
                posted += 1;
            }
        }
        if sids.len() < N {
            let k = sids.len();
            // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
            if let Some(id) = unsafe { s.isend(src[k].raw(), 3, Some(&smr[k])) }.unwrap() {
                sids.push(id);
            }
        }
        let mut keep = Vec::new();
        for (k, id) in rids.drain(..) {
            match r.test(id).unwrap() {
                Some(c) => {
                    assert_eq!(c.sizes[0], 16 + k, "size of message {k}");
                    assert_eq!(dst[k].bytes(), src[k].bytes(), "message {k} landed in its own receive");
                    done[k] = true;
                }
                None => keep.push((k, id)),
            }
        }
        rids = keep;
    }
    for id in sids {
        until("send completion", || s.test(id).unwrap());
    }
    assert!(r.eager_stats().0 - before >= 32, "{:?}", r.eager_stats());
}

/// A message larger than its receive buffer is an error on both ends, not a
/// hang, whether it came eagerly (it fits the ring) or had to wait for a
/// clear-to-send the receiver was holding back (it does not).
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn eager_truncation_fails_with_sizes_instead_of_hanging() {
    let d = device();
    for (size, cap) in [(100usize, 8usize), (8000, 16)] {
        let (n, idx) = net(&[&d], &[]);
        let (mut s, mut r) = pair(&n, idx[0], idx[0]);
        exchange(&n, &mut s, &mut r, 8, 8, 0);
        eager_ring_up(&n, &mut s, &mut r);
        let mut src = Buf::new(size);
        let mut dst = Buf::new(cap);
        let smr = reg(&n, idx[0], &mut src, Access::LOCAL_READ);
        let rmr = reg(&n, idx[0], &mut dst, Access::REMOTE_WRITE);
        // SAFETY: buffers outlive the requests.
        let rid = unsafe { r.irecv(&[RecvBuf { buf: dst.raw(), tag: 3 }], &[Some(&rmr)]) }.unwrap().unwrap();
        let (mut se, mut re) = (None, None);
        let t0 = Instant::now();
        while se.is_none() || re.is_none() {
            assert!(t0.elapsed() < DEADLINE, "{size} bytes into {cap}: sender {se:?}, receiver {re:?}");
            if re.is_none() {
                match r.test(rid) {
                    Ok(None) => {}
                    Ok(Some(c)) => panic!("a {size}-byte message completed a {cap}-byte receive: {c:?}"),
                    Err(e) => re = Some(e.to_string()),
                }
            }
            if se.is_none() {
                // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
                match unsafe { s.isend(src.raw(), 3, Some(&smr)) } {
                    Ok(Some(id)) => {
                        // eager: the send itself completes; the receiver reports
                        let _ = until("send completion", || s.test(id).ok().flatten());
                        se = Some("accepted".into());
                    }
                    Ok(None) => {}
                    Err(e) => se = Some(e.to_string()),
                }
            }
        }
        let (se, re) = (se.unwrap(), re.unwrap());
        eprintln!("{size} bytes into {cap}: sender: {se}; receiver: {re}");
        assert!(re.contains(&size.to_string()) || re.contains("larger"), "receiver error names the sizes: {re}");
        if size > 4096 {
            assert!(se.contains("larger") && se.contains(&cap.to_string()), "sender error names the sizes: {se}");
        }
    }
}

/// Twenty 8-buffer receives posted before the sender's handshake finished:
/// their 160 CTS elements are more writes than the receiver's send queue
/// holds at once, so they go out in pieces as completions free it (a
/// flush that waited for room for all of them never went out).
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn many_grouped_receives_before_ready_all_complete() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let (mut s, mut r) = pair(&n, idx[0], idx[0]);
    const R: usize = 20;
    let mut dst: Vec<Buf> = (0..R * 8).map(|_| Buf::new(256)).collect();
    let rmr: Vec<IbMr> = dst.iter_mut().map(|b| reg(&n, idx[0], b, Access::REMOTE_WRITE)).collect();
    let mut src: Vec<Buf> = (0..R * 8)
        .map(|k| {
            let mut b = Buf::new(100 + k % 50);
            b.fill(k as u8);
            b
        })
        .collect();
    let smr: Vec<IbMr> = src.iter_mut().map(|b| reg(&n, idx[0], b, Access::LOCAL_READ)).collect();
    let mut rids = Vec::new();
    for g in 0..R {
        let bufs: Vec<RecvBuf> = (0..8).map(|i| RecvBuf { buf: dst[g * 8 + i].raw(), tag: i as i32 }).collect();
        let mrs: Vec<Option<&IbMr>> = (0..8).map(|i| Some(&rmr[g * 8 + i])).collect();
        // SAFETY: buffers and registrations outlive the requests.
        rids.push(until("irecv", || unsafe { r.irecv(&bufs, &mrs) }.unwrap()));
    }
    let (mut next, mut sids, mut done) = (0usize, Vec::new(), 0usize);
    let t0 = Instant::now();
    while done < R {
        assert!(t0.elapsed() < DEADLINE, "stuck: {next} of {} sends taken, {done} of {R} receives done", R * 8);
        if next < R * 8 {
            // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
            if let Some(id) = unsafe { s.isend(src[next].raw(), (next % 8) as i32, Some(&smr[next])) }.unwrap() {
                sids.push(id);
                next += 1;
            }
        }
        sids.retain(|&id| s.test(id).unwrap().is_none());
        if let Some(c) = r.test(rids[done]).unwrap() {
            for i in 0..8 {
                let k = done * 8 + i;
                assert_eq!(c.sizes[i], 100 + k % 50, "size of buffer {i} of receive {done}");
                assert_eq!(&dst[k].bytes()[..c.sizes[i]], src[k].bytes(), "buffer {i} of receive {done}");
            }
            done += 1;
        }
    }
}
