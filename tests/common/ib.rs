//! Helpers shared by the verbs test files (tests/verbs.rs, tests/verbs_multi.rs,
//! tests/verbs_roce.rs, tests/verbs_gdr.rs): the test devices named by
//! `RUSTNET_TEST_DEVICE(2)`, an `IbNet` over exactly those devices, a
//! deadline-bounded wait, a connected send/receive pair, host buffers and
//! their registration, one-at-a-time transfers and log capture.
//!
//! Each file includes it with `#[path = "common/ib.rs"] mod ib;`; a file uses
//! only some of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustnet::for_tools::config::Config;
use rustnet::for_tools::ib::{Access, IbMr, IbNet, RecvComm, SendComm};
use rustnet::for_tools::transport::{MemKind, RawBuf, RecvBuf};

pub const DEADLINE: Duration = Duration::from_secs(60);

/// `RUSTNET_TEST_DEVICE`; panics (fails the test) when it is not set.
pub fn device() -> String {
    match std::env::var("RUSTNET_TEST_DEVICE") {
        Ok(d) if !d.trim().is_empty() => d.trim().to_string(),
        _ => {
            panic!("RUSTNET_TEST_DEVICE is not set: this test needs an RDMA device (tests/rxe-vm/verbs-suite.sh runs it on soft-RoCE)")
        }
    }
}

/// `RUSTNET_TEST_DEVICE` and `RUSTNET_TEST_DEVICE2`; panics when either is not set.
pub fn device2() -> (String, String) {
    let d = device();
    match std::env::var("RUSTNET_TEST_DEVICE2") {
        Ok(d2) if !d2.trim().is_empty() => (d, d2.trim().to_string()),
        _ => {
            panic!("RUSTNET_TEST_DEVICE2 is not set: this test needs two RDMA devices (tests/rxe-vm/verbs-suite.sh sets rxe1)")
        }
    }
}

/// The second device if there is one, else the first again (loopback on one device).
pub fn device2_or_first() -> String {
    std::env::var("RUSTNET_TEST_DEVICE2").ok().filter(|d| !d.trim().is_empty()).map(|d| d.trim().to_string()).unwrap_or_else(device)
}

/// The environment's knobs plus `extra` (which wins).
pub fn config(extra: &[(&str, &str)]) -> Config {
    let m: HashMap<String, String> = extra.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Config::from_lookup(&|k| m.get(k).cloned().or_else(|| std::env::var(k).ok())).expect("config")
}

/// An IbNet over exactly `devs` (NCCL_IB_HCA, a device named twice in a row
/// once), with `extra` knobs; the devices are not looked up (merged devices
/// carry other names: see [`index_of`]).
pub fn ib_net(devs: &[&str], extra: &[(&str, &str)]) -> IbNet {
    let mut uniq: Vec<&str> = devs.to_vec();
    uniq.dedup();
    let hca = format!("={}", uniq.join(","));
    let mut kv: Vec<(&str, &str)> = vec![("NCCL_IB_HCA", hca.as_str()), ("RUSTNET_TRANSPORT", "ib")];
    kv.extend_from_slice(extra);
    IbNet::new(&config(&kv))
        .unwrap_or_else(|e| panic!("RUSTNET_TEST_DEVICE names {devs:?}, but the verbs transport finds no such device: {e}"))
}

/// An IbNet over exactly `devs` and the index of each of them; panics (fails
/// the test) when one is missing.
pub fn net(devs: &[&str], extra: &[(&str, &str)]) -> (IbNet, Vec<usize>) {
    let n = ib_net(devs, extra);
    let idx = devs
        .iter()
        .map(|d| {
            n.devices()
                .iter()
                .position(|x| x.dev_name == *d)
                .unwrap_or_else(|| panic!("device {d} not among {:?}", n.devices().iter().map(|x| x.name.clone()).collect::<Vec<_>>()))
        })
        .collect();
    (n, idx)
}

/// The index of the NCCL device called `name` (its props' name).
pub fn index_of(n: &IbNet, name: &str) -> usize {
    let names: Vec<String> = (0..n.ndev()).map(|i| n.props(i).unwrap().name.to_string_lossy().into_owned()).collect();
    names.iter().position(|x| x == name).unwrap_or_else(|| panic!("no device named {name} among {names:?}"))
}

/// Poll `f` until it answers, failing the test after [`DEADLINE`].
pub fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < DEADLINE, "timed out after {DEADLINE:?} waiting for {what}");
        std::hint::spin_loop();
    }
}

/// A connected pair from `sdev` to `rdev`.
pub fn pair(n: &IbNet, sdev: usize, rdev: usize) -> (SendComm, RecvComm) {
    pair_tc(n, sdev, rdev, None)
}

/// A connected pair from `sdev` to `rdev`, connecting with the communicator's traffic class `comm_tc`.
pub fn pair_tc(n: &IbNet, sdev: usize, rdev: usize, comm_tc: Option<i32>) -> (SendComm, RecvComm) {
    let (mut l, h) = n.listen(rdev).expect("listen");
    let mut c = n.connect(sdev, &h, comm_tc).expect("connect start");
    // connect finishes without accept being called
    until("connect", || c.progress().expect("connect").then_some(()));
    let s = c.into_send_comm().expect("send comm");
    let r = until("accept", || l.accept().expect("accept"));
    (s, r)
}

/// 8-byte aligned host buffer.
pub struct Buf {
    v: Vec<u64>,
    len: usize,
}

impl Buf {
    pub fn new(len: usize) -> Buf {
        Buf { v: vec![0u64; len.div_ceil(8) + 1], len }
    }
    pub fn raw(&mut self) -> RawBuf {
        RawBuf { ptr: self.v.as_mut_ptr() as *mut u8, len: self.len }
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the Vec holds at least len bytes; u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts(self.v.as_ptr() as *const u8, self.len) }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the Vec holds at least len bytes, &mut self makes this the only view, and u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts_mut(self.v.as_mut_ptr() as *mut u8, self.len) }
    }
    pub fn fill(&mut self, seed: u8) {
        for (i, b) in self.bytes_mut().iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
    }
}

pub fn reg(n: &IbNet, dev: usize, b: &mut Buf, access: Access) -> IbMr {
    // SAFETY: the buffer outlives the registration in every test.
    unsafe { n.reg_mr(dev, b.raw(), MemKind::Host, access).expect("reg_mr") }
}

/// Send `sizes` one at a time (each with its own receive, tag 7, 64 bytes
/// of slack behind it) and check bytes and sizes.
pub fn one_by_one(n: &IbNet, s: &mut SendComm, r: &mut RecvComm, sizes: &[usize]) {
    one_by_one_with(n, s, r, sizes, 7, 64)
}

/// [`one_by_one`] with tag `tag` and `slack` bytes behind each receive buffer
/// (checked untouched).
pub fn one_by_one_with(n: &IbNet, s: &mut SendComm, r: &mut RecvComm, sizes: &[usize], tag: i32, slack: usize) {
    let (sd, rd) = (s.dev(), r.dev());
    for (k, &size) in sizes.iter().enumerate() {
        let mut src = Buf::new(size);
        src.fill(k as u8);
        let mut dst = Buf::new(size + slack);
        dst.bytes_mut().fill(0xee);
        let smr = reg(n, sd, &mut src, Access::LOCAL_READ);
        let rmr = reg(n, rd, &mut dst, Access::REMOTE_WRITE);
        let rb = [RecvBuf { buf: dst.raw(), tag }];
        // SAFETY: buffers and registrations live until the requests complete below.
        let rid = unsafe { r.irecv(&rb, &[Some(&rmr)]) }.expect("irecv").expect("irecv slot");
        let mut rdone = None;
        let sid = until("isend to be accepted", || {
            if rdone.is_none() {
                rdone = r.test(rid).expect("recv test");
            }
            // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
            unsafe { s.isend(src.raw(), tag, Some(&smr)) }.expect("isend")
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

// ---------------------------------------------------------------- logs

/// A tracing layer keeping every event's level and message in the vector.
pub struct Capture(pub Arc<Mutex<Vec<(tracing::Level, String)>>>);

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

/// Run `f` with a subscriber capturing its events on this thread; its result and the log.
pub fn captured<T>(f: impl FnOnce() -> T) -> (T, Vec<(tracing::Level, String)>) {
    use tracing_subscriber::prelude::*;
    let log = Arc::new(Mutex::new(Vec::new()));
    let sub = tracing_subscriber::registry().with(Capture(log.clone()));
    let out = tracing::subscriber::with_default(sub, f);
    let v = log.lock().unwrap().clone();
    (out, v)
}
