//! Multi-QP striping and multi-NIC devices, proven by the per-QP counters
//! every verbs comm keeps (`SendComm::qp_stats`, `RecvComm::qp_stats`; the
//! same numbers are logged at TRACE on close and at INFO with RUSTNET_STATS=1).
//!
//! Device tests are `#[ignore]`d with their reason, so a plain `cargo test`
//! on a host without RDMA counts them as ignored; `tests/rxe-vm/verbs-suite.sh`
//! runs them with `--include-ignored`, and there a missing device fails them.
//! `RUSTNET_TEST_DEVICE` (rxe0) is the device; the merged-device tests need
//! `RUSTNET_TEST_RAILS="rxe0,rxe2;rxe1,rxe3"` (two veth pairs, RXE_VM_PAIRS=2).
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustnet::config::Config;
use rustnet::proto::fifo;
use rustnet::transport::ib::p2p::QpStat;
use rustnet::transport::ib::{Access, IbMr, IbNet, RecvComm, SendComm};
use rustnet::transport::{MemKind, RawBuf, RecvBuf};

const DEADLINE: Duration = Duration::from_secs(60);

fn device() -> String {
    match std::env::var("RUSTNET_TEST_DEVICE") {
        Ok(d) if !d.trim().is_empty() => d.trim().to_string(),
        _ => panic!("RUSTNET_TEST_DEVICE is not set: this test needs an RDMA device (tests/rxe-vm/verbs-suite.sh runs it on soft-RoCE)"),
    }
}

fn config(extra: &[(&str, &str)]) -> Config {
    let m: HashMap<String, String> = extra.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Config::from_lookup(&|k| m.get(k).cloned().or_else(|| std::env::var(k).ok())).expect("config")
}

/// An IbNet over exactly `devs` (NCCL_IB_HCA), with `extra` knobs.
fn net(devs: &[&str], extra: &[(&str, &str)]) -> IbNet {
    let hca = format!("={}", devs.join(","));
    let mut kv: Vec<(&str, &str)> = vec![("NCCL_IB_HCA", hca.as_str()), ("RUSTNET_TRANSPORT", "ib")];
    kv.extend_from_slice(extra);
    IbNet::new(&config(&kv)).unwrap_or_else(|e| panic!("the verbs transport finds none of {devs:?}: {e}"))
}

fn index_of(n: &IbNet, name: &str) -> usize {
    let names: Vec<String> = (0..n.ndev()).map(|i| n.props(i).unwrap().name.to_string_lossy().into_owned()).collect();
    names.iter().position(|x| x == name).unwrap_or_else(|| panic!("no device named {name} among {names:?}"))
}

fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < DEADLINE, "timed out after {DEADLINE:?} waiting for {what}");
        std::hint::spin_loop();
    }
}

fn pair(n: &IbNet, sdev: usize, rdev: usize) -> (SendComm, RecvComm) {
    let (mut l, h) = n.listen(rdev).expect("listen");
    let mut c = n.connect(sdev, &h, None).expect("connect start");
    until("connect", || c.progress().expect("connect").then_some(()));
    let s = c.into_send_comm().expect("send comm");
    let r = until("accept", || l.accept().expect("accept"));
    (s, r)
}

struct Buf {
    v: Vec<u64>,
    len: usize,
}

impl Buf {
    fn new(len: usize) -> Buf {
        Buf { v: vec![0u64; len.div_ceil(8) + 1], len }
    }
    fn raw(&mut self) -> RawBuf {
        RawBuf { ptr: self.v.as_mut_ptr() as *mut u8, len: self.len }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: the Vec holds at least len bytes.
        unsafe { std::slice::from_raw_parts(self.v.as_ptr() as *const u8, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(self.v.as_mut_ptr() as *mut u8, self.len) }
    }
    fn fill(&mut self, seed: u8) {
        for (i, b) in self.bytes_mut().iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
    }
}

fn reg(n: &IbNet, dev: usize, b: &mut Buf, access: Access) -> IbMr {
    // SAFETY: the buffer outlives the registration in every test.
    unsafe { n.reg_mr(dev, b.raw(), MemKind::Host, access).expect("reg_mr") }
}

/// Send `sizes` one message at a time; check payload and sizes.
fn one_by_one(n: &IbNet, s: &mut SendComm, r: &mut RecvComm, sizes: &[usize]) {
    let (sd, rd) = (s.dev(), r.dev());
    for (k, &size) in sizes.iter().enumerate() {
        let mut src = Buf::new(size);
        src.fill(k as u8);
        let mut dst = Buf::new(size + 256);
        dst.bytes_mut().fill(0xee);
        let smr = reg(n, sd, &mut src, Access::LOCAL_READ);
        let rmr = reg(n, rd, &mut dst, Access::REMOTE_WRITE);
        let rb = [RecvBuf { buf: dst.raw(), tag: 3 }];
        // SAFETY: buffers and registrations live until both requests completed below.
        let rid = unsafe { r.irecv(&rb, &[Some(&rmr)]) }.expect("irecv").expect("irecv slot");
        let mut rdone = None;
        let sid = until("isend to be accepted", || {
            if rdone.is_none() {
                rdone = r.test(rid).expect("recv test");
            }
            // SAFETY: as above.
            unsafe { s.isend(src.raw(), 3, Some(&smr)) }.expect("isend")
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
            let n = net(&[&d], &[("NCCL_IB_QPS_PER_CONNECTION", &q), ("NCCL_IB_SPLIT_DATA_ON_QPS", sp)]);
            let i = index_of(&n, &d);
            let (mut s, mut r) = pair(&n, i, i);
            one_by_one(&n, &mut s, &mut r, &SIZES);
            let (ss, rs) = (s.qp_stats().to_vec(), r.qp_stats().to_vec());
            let want = expected(&SIZES, nqps, split);
            eprintln!("{nqps} QP(s), split={sp}: send {}", rustnet::transport::ib::p2p::format_stats(&ss));
            eprintln!("{nqps} QP(s), split={sp}: recv {}", rustnet::transport::ib::p2p::format_stats(&rs));
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

struct Capture(Arc<Mutex<Vec<(tracing::Level, String)>>>);
struct Msg(String);
impl tracing::field::Visit for Msg {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        if f.name() == "message" {
            self.0 = format!("{v:?}");
        }
    }
}
impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, e: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut m = Msg(String::new());
        e.record(&mut m);
        self.0.lock().unwrap().push((*e.metadata().level(), m.0));
    }
}

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
        let n = net(&[&d], &[("NCCL_IB_QPS_PER_CONNECTION", "2"), ("RUSTNET_STATS", "1")]);
        let i = index_of(&n, &d);
        let (mut s, mut r) = pair(&n, i, i);
        one_by_one(&n, &mut s, &mut r, &SIZES[..4]);
        let q = (s.qpns(), r.qpns());
        drop(s);
        drop(r);
        rustnet::transport::ib::p2p::set_stats_dump(false);
        q
    });
    let lines: Vec<String> = log.lock().unwrap().iter().filter(|(l, m)| *l == tracing::Level::INFO && m.starts_with("stats:")).map(|x| x.1.clone()).collect();
    eprintln!("{lines:#?}");
    assert_eq!(lines.len(), 2, "one line per comm: {lines:?}");
    assert!(lines[0].contains("send comm to") && lines[1].contains("recv comm to"), "{lines:?}");
    for (line, qpns) in [(&lines[0], &sq), (&lines[1], &rq)] {
        for q in qpns.iter() {
            assert!(line.contains(&format!("qp {q:#x}: 2 msgs")), "{line} lacks QP {q:#x} with 2 messages");
        }
    }
}
