//! What one `test()` of a receive that has not arrived yet costs the
//! receive machine, natively, with a NIC whose CQ is always empty: the
//! call NCCL's proxy makes thousands of times per message while it waits
//! (docs/verbs-cost.md). The executor's own part (the verbs poll, the
//! handle check) is not in it.
//!
//!   cargo run --release -p rustnet-proto --example idle_cost
use std::hint::black_box;
use std::time::Instant;

use rustnet_proto::fifo::Cts;
use rustnet_proto::nic::{Cqe, Ev, Fail, Link, RecvNic, POLL_BATCH};
use rustnet_proto::pool::ReqId;
use rustnet_proto::rx::{self, CtlChain, Deliver, Receiver};
use rustnet_proto::MAX_RECVS;

/// A NIC with nothing to report: an empty CQ, posts that go nowhere.
struct Idle {
    ring: Vec<u8>,
    stage: Vec<u8>,
    posts: u64,
}

impl Link for Idle {
    type Error = ();
    fn poll_cq(&mut self, _out: &mut [Cqe; POLL_BATCH]) -> Result<usize, ()> {
        Ok(0)
    }
    fn check(&mut self) -> Result<(), ()> {
        Ok(())
    }
    fn tick(&mut self, live: usize) -> bool {
        black_box(live);
        false
    }
    fn progressed(&mut self) {}
    fn fail(&mut self, _f: Fail<()>) {
        panic!("the idle NIC never fails");
    }
    fn profiling(&self) -> bool {
        false
    }
    fn taken(&mut self, _id: ReqId) {}
    fn ev_start(&mut self, _ev: &Ev) {}
    fn ev_stop(&mut self, _id: ReqId, _slot: usize) {}
    fn ev_stop_req(&mut self, _id: ReqId) {}
    fn count(&mut self, _qp: usize, _bytes: u64) {}
    fn now(&self) -> Instant {
        Instant::now()
    }
}

impl RecvNic for Idle {
    type Ring = [u8];
    type Stage = [u8];
    fn ring(&self) -> Option<&[u8]> {
        Some(&self.ring)
    }
    fn deliver(&self, _d: &Deliver) {}
    fn stage(&mut self) -> &mut [u8] {
        &mut self.stage
    }
    fn post_ctl(&mut self, chain: &CtlChain) -> Result<(), ()> {
        self.posts += chain.n as u64;
        Ok(())
    }
    fn sizes(&self, _seq: u64) -> [u32; MAX_RECVS] {
        [0; MAX_RECVS]
    }
    fn may_advertise(&self, _first: usize, _nlanes: usize, _in_flight: usize) -> bool {
        true
    }
    fn expect(&mut self, _seq: u64, _nlanes: usize) -> Result<(), ()> {
        Ok(())
    }
    fn ring_requested(&self) -> bool {
        false
    }
    fn make_ring(&mut self, _max: usize) -> Result<(u64, u32), ()> {
        Ok((0, 0))
    }
}

fn main() {
    println!("receive machine, one test() of a receive not arrived yet (empty CQ), ns per call, median of 7 x 2,000,000");
    for (what, eager) in [("eager ring on (8 KiB)", 8192usize), ("eager ring off", 0)] {
        let mut nic = Idle { ring: vec![0; rustnet_proto::eager::ring_bytes(eager.max(1))], stage: vec![0; 1 << 20], posts: 0 };
        let mut rx = Receiver::new(rx::Config { nqps: 1, split: false, eager, sq_depth: 64, late_ring: false });
        rx.handshake_done(&mut nic).expect("ready");
        let cts = [Cts { addr: 1 << 20, rkey: 1, cap: 1 << 19, tag: 0, n: 1, i: 0 }];
        let t = rx.irecv(&mut nic, &cts).expect("irecv").expect("taken");
        let mut v = Vec::new();
        for _ in 0..7 {
            let t0 = Instant::now();
            for _ in 0..2_000_000 {
                let r = rx.test(&mut nic, t.id).expect("test");
                assert!(r.is_none());
            }
            v.push(t0.elapsed().as_nanos() as f64 / 2e6);
        }
        v.sort_by(f64::total_cmp);
        println!("  {what:<24} {:>6.1} ns  [{:.1}-{:.1}]  ({} control writes posted)", v[3], v[0], v[6], nic.posts);
    }
}
