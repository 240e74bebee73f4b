//! Multi-QP striping and multi-NIC devices, proven by the per-QP counters
//! every verbs comm keeps (`SendComm::qp_stats`, `RecvComm::qp_stats`; the
//! same numbers are logged at TRACE on close and at INFO with RUSTNET_STATS=1).
//!
//! Device tests are `#[ignore]`d with their reason, so a plain `cargo test`
//! on a host without RDMA counts them as ignored; `tests/rxe-vm/verbs-suite.sh`
//! runs them with `--include-ignored`, and there a missing device fails them.
//! `RUSTNET_TEST_DEVICE` (rxe0) is the device; the merged-device tests need
//! `RUSTNET_TEST_RAILS="rxe0,rxe2;rxe1,rxe3"` (two veth pairs, RXE_VM_PAIRS=2).
#[path = "common/ib.rs"]
mod ib;

use std::sync::{Arc, Mutex};

use ib::{device, ib_net, index_of, pair, reg, until, Buf, Capture};
use rustnet::for_tools::ib::p2p::QpStat;
use rustnet::for_tools::ib::{Access, IbMr, IbNet, RecvComm, SendComm};
use rustnet::for_tools::transport::RecvBuf;
use rustnet::proto::fifo;

/// Send `sizes` one message at a time (tag 3, 256 bytes of slack behind each receive); check payload and sizes.
fn one_by_one(n: &IbNet, s: &mut SendComm, r: &mut RecvComm, sizes: &[usize]) {
    ib::one_by_one_with(n, s, r, sizes, 3, 256)
}

/// Message sizes: small, unaligned, 128-byte multiples, large.
const SIZES: [usize; 9] = [1, 100, 128, 129, 1000, 4096, 65537, 300_000, 1 << 20];

/// What NCCL's rule predicts per QP for `sizes` sent one by one: split=0
/// message k on QP k % nqps; split=1 every message on every QP, cut in
/// 128-byte-aligned chunks.
fn expected(sizes: &[usize], nqps: usize, split: bool) -> Vec<(u64, u64)> {
    let mut e = vec![(0u64, 0u64); nqps];
    for (k, &size) in sizes.iter().enumerate() {
        let (first, nl) = fifo::lanes(k as u64, nqps, split);
        for lane in 0..nl {
            let q = (first + lane) % nqps;
            e[q].0 += 1;
            e[q].1 += fifo::chunk(size, lane, nl).1 as u64;
        }
    }
    e
}

fn counts(st: &[QpStat]) -> Vec<(u64, u64)> {
    st.iter().map(|q| (q.msgs, q.bytes)).collect()
}

/// 1, 2 and 4 QPs, both modes: every QP carried bytes, exactly the bytes
/// NCCL's rule gives it, on both ends; chunks are 128-byte aligned.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn striping_counters_show_every_qp_used_with_1_2_4_qps_both_modes() {
    let d = device();
    for nqps in [1usize, 2, 4] {
        for split in [false, true] {
            let q = nqps.to_string();
            let sp = if split { "1" } else { "0" };
            // the rendezvous path's striping (small messages would go eager on QP 0)
            let n = ib_net(&[&d], &[("NCCL_IB_QPS_PER_CONNECTION", &q), ("NCCL_IB_SPLIT_DATA_ON_QPS", sp), ("RUSTNET_IB_EAGER", "0")]);
            let i = index_of(&n, &d);
            let (mut s, mut r) = pair(&n, i, i);
            one_by_one(&n, &mut s, &mut r, &SIZES);
            let (ss, rs) = (s.qp_stats().to_vec(), r.qp_stats().to_vec());
            let want = expected(&SIZES, nqps, split);
            eprintln!("{nqps} QP(s), split={sp}: send {}", rustnet::for_tools::ib::p2p::format_stats(&ss));
            eprintln!("{nqps} QP(s), split={sp}: recv {}", rustnet::for_tools::ib::p2p::format_stats(&rs));
            assert_eq!(ss.len(), nqps, "send comm has {nqps} QPs");
            assert_eq!(rs.len(), nqps, "recv comm has {nqps} QPs");
            assert_eq!(counts(&ss), want, "sender counters, {nqps} QPs split={sp}");
            assert_eq!(counts(&rs), want, "receiver counters, {nqps} QPs split={sp}");
            assert!(ss.iter().all(|q| q.msgs > 0 && q.bytes > 0), "every QP used: {ss:?}");
            let total: u64 = SIZES.iter().map(|&x| x as u64).sum();
            assert_eq!(ss.iter().map(|q| q.bytes).sum::<u64>(), total);
            if split && nqps > 1 {
                // every message on every QP
                assert!(ss.iter().all(|q| q.msgs == SIZES.len() as u64), "{ss:?}");
            } else {
                // whole messages rotate: counts differ by at most one
                let (lo, hi) = (ss.iter().map(|q| q.msgs).min().unwrap(), ss.iter().map(|q| q.msgs).max().unwrap());
                assert!(hi - lo <= 1, "{ss:?}");
            }
        }
    }
}

// ---------------------------------------------------------------- logs

/// RUSTNET_STATS=1: closing each comm prints one INFO line with every QP's
/// counters.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn stats_dump_prints_one_info_line_per_comm_on_close() {
    use tracing_subscriber::prelude::*;
    let d = device();
    let log = Arc::new(Mutex::new(Vec::new()));
    let sub = tracing_subscriber::registry().with(Capture(log.clone()));
    let (sq, rq) = tracing::subscriber::with_default(sub, || {
        let n = ib_net(&[&d], &[("NCCL_IB_QPS_PER_CONNECTION", "2"), ("RUSTNET_STATS", "1"), ("RUSTNET_IB_EAGER", "0")]);
        let i = index_of(&n, &d);
        let (mut s, mut r) = pair(&n, i, i);
        one_by_one(&n, &mut s, &mut r, &SIZES[..4]);
        let q = (s.qpns(), r.qpns());
        drop(s);
        drop(r);
        rustnet::for_tools::ib::p2p::set_stats_dump(false);
        q
    });
    let lines: Vec<String> =
        log.lock().unwrap().iter().filter(|(l, m)| *l == tracing::Level::INFO && m.starts_with("stats:")).map(|x| x.1.clone()).collect();
    eprintln!("{lines:#?}");
    assert_eq!(lines.len(), 2, "one line per comm: {lines:?}");
    assert!(lines[0].contains("send comm to") && lines[1].contains("recv comm to"), "{lines:?}");
    for (line, qpns) in [(&lines[0], &sq), (&lines[1], &rq)] {
        for q in qpns.iter() {
            assert!(line.contains(&format!("qp {q:#x}: 2 msgs")), "{line} lacks QP {q:#x} with 2 messages");
        }
    }
}

// ---------------------------------------------------------------- merged devices

use rustnet::for_tools::ib::vdev::{self, MultiRecv, MultiSend};
use rustnet::for_tools::ib::{IbRecv, IbSend};

/// `RUSTNET_TEST_RAILS="rxe0,rxe2;rxe1,rxe3"`: the sender's members, then
/// the receiver's (member i of one is cabled to member i of the other).
fn rails() -> (Vec<String>, Vec<String>) {
    let v = std::env::var("RUSTNET_TEST_RAILS").unwrap_or_default();
    let g: Vec<Vec<String>> =
        v.split(';').map(|x| x.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()).collect();
    if g.len() != 2 || g[0].len() < 2 || g[0].len() != g[1].len() {
        panic!(
            "RUSTNET_TEST_RAILS={v:?}: this test needs two RDMA devices per side, e.g. \"rxe0,rxe2;rxe1,rxe3\" \
             (tests/rxe-vm/verbs-suite.sh boots RXE_VM_PAIRS=2 for it)"
        );
    }
    (g[0].clone(), g[1].clone())
}

fn multi_pair(n: &IbNet, sdev: usize, rdev: usize) -> (MultiSend, MultiRecv) {
    let (mut l, hs) = n.listen_any(rdev).expect("listen");
    let mut raw = [0u8; 128];
    hs.encode(&mut raw);
    let h = rustnet::proto::handle::Handle::decode(&raw).unwrap();
    let mut c = n.connect_any(sdev, &raw, &h, None).expect("connect start");
    until("connect", || c.progress().expect("connect").then_some(()));
    let IbSend::Multi(s) = c.into_send().expect("send comm") else { panic!("plain send comm on a merged device") };
    let IbRecv::Multi(r) = until("accept", || l.accept().expect("accept")) else { panic!("plain recv comm on a merged device") };
    (*s, *r)
}

/// Messages one by one through a merged pair; payload and sizes checked.
fn multi_one_by_one(n: &IbNet, s: &mut MultiSend, r: &mut MultiRecv, sizes: &[usize]) {
    let (sm, rm) = (s.members(), r.members());
    for (k, &size) in sizes.iter().enumerate() {
        let mut src = Buf::new(size);
        src.fill(k as u8 ^ 0x5a);
        let mut dst = Buf::new(size + 256);
        dst.bytes_mut().fill(0xee);
        let smr: Vec<IbMr> = sm.iter().map(|&d| reg(n, d, &mut src, Access::LOCAL_READ)).collect();
        let rmr: Vec<IbMr> = rm.iter().map(|&d| reg(n, d, &mut dst, Access::REMOTE_WRITE)).collect();
        let smr_o: Vec<Option<&IbMr>> = smr.iter().map(Some).collect();
        let rmr_o: Vec<Option<&IbMr>> = rmr.iter().map(Some).collect();
        let rb = [RecvBuf { buf: dst.raw(), tag: 9 }];
        // SAFETY: buffers and registrations live until both requests completed below.
        let rid = unsafe { r.irecv(&rb, &[&rmr_o[..]]) }.expect("irecv").expect("irecv slot");
        let mut rdone = None;
        let sid = until("isend to be accepted", || {
            if rdone.is_none() {
                rdone = r.test(rid).expect("recv test");
            }
            // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
            unsafe { s.isend(src.raw(), 9, &smr_o) }.expect("isend")
        });
        let sc = until("send completion", || s.test(sid).expect("send test"));
        assert_eq!(sc.sizes[0], size);
        let rc = match rdone {
            Some(c) => c,
            None => until("receive completion", || r.test(rid).expect("recv test")),
        };
        assert_eq!((rc.n, rc.sizes[0]), (1, size), "reported size of message {k}");
        assert!(dst.bytes()[..size] == src.bytes()[..], "payload of message {k} ({size} bytes) differs");
        assert!(dst.bytes()[size..].iter().all(|&b| b == 0xee), "message {k} wrote past its {size} bytes");
    }
}

/// Both ends' per-member counters: every member of both devices carried
/// bytes, and member i of the sender carried exactly what member i of the
/// receiver did (rail-aligned), in 128-byte-aligned chunks of each buffer.
fn check_rails(n: &IbNet, s: &MultiSend, r: &MultiRecv, sizes: &[usize], nqps: usize) {
    let name = |d: usize| n.devices()[d].name.clone();
    let (ss, rs) = (s.member_stats(), r.member_stats());
    for ((sd, sq), (rd, rq)) in ss.iter().zip(&rs) {
        eprintln!(
            "member {} -> {}: send {} | recv {}",
            name(*sd),
            name(*rd),
            rustnet::for_tools::ib::p2p::format_stats(sq),
            rustnet::for_tools::ib::p2p::format_stats(rq)
        );
        assert_eq!(sq.len(), nqps, "QPs per member");
        let sb: u64 = sq.iter().map(|q| q.bytes).sum();
        let rb: u64 = rq.iter().map(|q| q.bytes).sum();
        assert!(sb > 0, "member {} carried no bytes: {sq:?}", name(*sd));
        assert_eq!(sb, rb, "rail {} -> {} byte counts differ", name(*sd), name(*rd));
    }
    // receive capacity is size + 256: chunk i of each buffer, filled in order
    let k = ss.len();
    for (i, (_, sq)) in ss.iter().enumerate() {
        let want: u64 = sizes
            .iter()
            .map(|&size| {
                let cap = size + 256;
                let off: usize = (0..i).map(|j| fifo::chunk(cap, j, k).1).sum();
                let c = fifo::chunk(cap, i, k).1;
                (if i + 1 == k { size.saturating_sub(off) } else { size.saturating_sub(off).min(c) }) as u64
            })
            .sum();
        assert_eq!(sq.iter().map(|q| q.bytes).sum::<u64>(), want, "member {i}");
    }
    let total: u64 = sizes.iter().map(|&x| x as u64).sum();
    assert_eq!(ss.iter().flat_map(|(_, q)| q).map(|q| q.bytes).sum::<u64>(), total);
}

/// ABI v8 style: RUSTNET_IB_MERGE_NICS groups the devices itself; merged
/// devices replace their members, named a+b, speed summed.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn v8_self_merged_devices_rail_aligned_every_member_carries_bytes() {
    let (a, b) = rails();
    let all: Vec<&str> = a.iter().chain(&b).map(String::as_str).collect();
    let spec = format!("{};{}", a.join(","), b.join(","));
    for (nqps, split) in [("1", "0"), ("2", "1")] {
        let n =
            ib_net(&all, &[("RUSTNET_IB_MERGE_NICS", &spec), ("NCCL_IB_QPS_PER_CONNECTION", nqps), ("NCCL_IB_SPLIT_DATA_ON_QPS", split)]);
        assert_eq!(n.ndev(), 2, "two merged devices replace four");
        let (sa, sb) = (index_of(&n, &a.join("+")), index_of(&n, &b.join("+")));
        let pa = n.props(sa).unwrap();
        let one: i32 = a.iter().map(|d| n.devices().iter().find(|x| &x.dev_name == d).unwrap().speed_mbps).sum();
        assert_eq!(pa.speed_mbps, one, "speed is the members' sum");
        assert_eq!(n.members(sa).unwrap().len(), a.len());
        let (mut s, mut r) = multi_pair(&n, sa, sb);
        multi_one_by_one(&n, &mut s, &mut r, &SIZES);
        check_rails(&n, &s, &r, &SIZES, nqps.parse().unwrap());
        // member i talks to member i
        let sm: Vec<String> = s.members().iter().map(|&d| n.devices()[d].dev_name.clone()).collect();
        let rm: Vec<String> = r.members().iter().map(|&d| n.devices()[d].dev_name.clone()).collect();
        assert_eq!((sm, rm), (a.clone(), b.clone()));
    }
}

/// ABI v9+ style: NCCL calls makeVDevice; the new device comes after the
/// physical ones and lists its members (vProps).
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn make_vdevice_appends_fused_devices_that_move_data_on_every_member() {
    let (a, b) = rails();
    let all: Vec<&str> = a.iter().chain(&b).map(String::as_str).collect();
    let n = ib_net(&all, &[]);
    let phys = n.ndev();
    assert_eq!(phys, all.len());
    let ia: Vec<usize> = a.iter().map(|d| index_of(&n, d)).collect();
    let ib: Vec<usize> = b.iter().map(|d| index_of(&n, d)).collect();
    let va = n.make_vdevice(&ia).expect("makeVDevice");
    let vb = n.make_vdevice(&ib).expect("makeVDevice");
    assert_eq!((va, vb), (phys, phys + 1), "virtual devices are appended");
    assert_eq!(n.make_vdevice(&ia).unwrap(), va, "the same members give the same device");
    assert!(n.make_vdevice(&ia[..1]).is_err(), "one member is not a merge");
    assert_eq!(n.members(va).unwrap(), ia);
    assert_eq!(n.props(va).unwrap().name.to_str().unwrap(), a.join("+"));
    let (mut s, mut r) = multi_pair(&n, va, vb);
    multi_one_by_one(&n, &mut s, &mut r, &SIZES);
    check_rails(&n, &s, &r, &SIZES, 1);
    // a merged sender cannot talk to a plain receiver: the error says why
    let (_l, hs) = n.listen_any(ib[0]).unwrap();
    let mut raw = [0u8; 128];
    hs.encode(&mut raw);
    let h = rustnet::proto::handle::Handle::decode(&raw).unwrap();
    let e = n.connect_any(va, &raw, &h, None).err().expect("member count mismatch refused").to_string();
    assert!(e.contains("same member count"), "{e}");
    let _ = vdev::MAX_MEMBERS;
}
