//! The one two-process traffic loop (tests/conformance.rs and the soak rig,
//! crates/rustnet-rigs/src/soak.rs): both directions at once through the
//! driver, grouped receives of the peer's plan, every byte, the canary
//! behind it and the reported sizes checked.
use std::time::{Duration, Instant};

use rustnet_tools::driver::{Plugin, Ptr};

use super::{check, fill, plan, CANARY, CANARY_LEN};

/// A send in flight: its buffer stays alive until the comm is closed.
pub struct SendSlot {
    pub req: Ptr,
    pub buf: Vec<u8>,
    pub mh: Ptr,
    pub round: usize,
}

/// A grouped receive in flight.
pub struct RecvSlot {
    pub round: usize,
    pub req: Ptr,
    pub bufs: Vec<Vec<u8>>,
    pub mhs: Vec<Ptr>,
}

/// What is posted and not yet done: the caller keeps it (and its buffers)
/// until the comms are closed, whatever the outcome, since a failed comm may
/// still have requests in flight on them.
#[derive(Default)]
pub struct InFlight {
    pub sends: Vec<SendSlot>,
    pub recvs: Vec<RecvSlot>,
}

/// What was moved and checked.
#[derive(Default, Debug, Clone, Copy)]
pub struct Counters {
    pub bytes_checked: u64,
    pub msgs_checked: u64,
    pub bytes_sent: u64,
}

/// Why the loop stopped early.
#[derive(Debug)]
pub enum Stop {
    /// A call failed.
    Err(String),
    /// Wrong bytes, wrong size or an overwritten canary.
    Corrupt(String),
    /// `abort` said so (the soak's coordinator gave up on the cycle).
    Aborted(&'static str),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Err(e) | Stop::Corrupt(e) => f.write_str(e),
            Stop::Aborted(stage) => write!(f, "aborted ({stage})"),
        }
    }
}

/// One run of the loop: the comms, both plans' seeds and sizes.
pub struct Traffic<'a> {
    pub p: &'a Plugin,
    pub s: Ptr,
    pub r: Ptr,
    pub my_seed: u64,
    pub peer_seed: u64,
    pub rounds: usize,
    pub max_recvs: usize,
    pub max_big: usize,
    /// Fail with "traffic stuck" after this long (conformance); None: never (the soak's watchdog is its coordinator).
    pub deadline: Option<Duration>,
}

fn err(e: impl ToString) -> Stop {
    Stop::Err(e.to_string())
}

impl Traffic<'_> {
    /// Send our plan and receive the peer's, `window` rounds at most in
    /// flight each way; `abort` is asked every 64 spins.
    pub fn run(&self, fl: &mut InFlight, c: &mut Counters, abort: &dyn Fn() -> bool) -> Result<(), Stop> {
        let (p, s, r, rounds) = (self.p, self.s, self.r, self.rounds);
        let send_plan = plan(self.my_seed, rounds, self.max_recvs, self.max_big);
        let recv_plan = plan(self.peer_seed, rounds, self.max_recvs, self.max_big);
        let window = 4usize;
        let mut next_send = (0usize, 0usize); // (round, k in send_order)
        let mut next_recv = 0usize;
        let mut recv_done = 0usize;
        let mut sent_rounds_done = 0usize;
        let mut sends_done_per_round = vec![0usize; rounds];
        let t0 = Instant::now();
        let mut spin = 0u32;
        while recv_done < rounds || sent_rounds_done < rounds {
            spin = spin.wrapping_add(1);
            if spin.is_multiple_of(64) && abort() {
                return Err(Stop::Aborted("traffic"));
            }
            if self.deadline.is_some_and(|d| t0.elapsed() > d) {
                return Err(Stop::Err(format!("traffic stuck: recv {recv_done}/{rounds}, send rounds {sent_rounds_done}/{rounds}")));
            }
            // post receives
            while next_recv < rounds && fl.recvs.len() < window {
                let rd = &recv_plan[next_recv];
                let mut bufs: Vec<Vec<u8>> = rd.msgs.iter().map(|m| vec![CANARY; m.cap + CANARY_LEN]).collect();
                let mut mhs = Vec::new();
                for b in &mut bufs {
                    match p.reg_mr(r, b.as_mut_ptr(), b.len()) {
                        Ok(m) => mhs.push(m),
                        Err(e) => {
                            for m in mhs {
                                let _ = p.dereg_mr(r, m);
                            }
                            return Err(err(e));
                        }
                    }
                }
                let spec: Vec<_> =
                    rd.msgs.iter().zip(bufs.iter_mut()).zip(&mhs).map(|((m, b), mh)| (b.as_mut_ptr(), m.cap, m.tag, *mh)).collect();
                match p.irecv(r, &spec) {
                    Ok(Some(req)) => {
                        fl.recvs.push(RecvSlot { round: next_recv, req, bufs, mhs });
                        next_recv += 1;
                    }
                    res => {
                        for mh in mhs {
                            let _ = p.dereg_mr(r, mh);
                        }
                        match res {
                            Err(e) => return Err(err(e)),
                            _ => break,
                        }
                    }
                }
            }
            // post sends (the sender may run at most `window` rounds ahead)
            while next_send.0 < rounds && next_send.0 < sent_rounds_done + window {
                let (ri, k) = next_send;
                let rd = &send_plan[ri];
                let idx = rd.send_order[k];
                let m = rd.msgs[idx];
                let mut buf = vec![0u8; m.size.max(1)];
                fill(&mut buf[..m.size], self.my_seed, ri, idx);
                let mh = p.reg_mr(s, buf.as_mut_ptr(), buf.len()).map_err(err)?;
                match p.isend(s, buf.as_mut_ptr(), m.size, m.tag, mh) {
                    Ok(Some(req)) => {
                        fl.sends.push(SendSlot { req, buf, mh, round: ri });
                        c.bytes_sent += m.size as u64;
                        next_send = if k + 1 == rd.send_order.len() { (ri + 1, 0) } else { (ri, k + 1) };
                    }
                    res => {
                        let _ = p.dereg_mr(s, mh);
                        match res {
                            Err(e) => return Err(err(e)),
                            _ => break,
                        }
                    }
                }
            }
            // test sends
            let mut i = 0;
            while i < fl.sends.len() {
                if p.test(fl.sends[i].req, &mut [0i32; 1]).map_err(err)? {
                    let ss = fl.sends.swap_remove(i);
                    p.dereg_mr(s, ss.mh).map_err(err)?;
                    sends_done_per_round[ss.round] += 1;
                    while sent_rounds_done < rounds && sends_done_per_round[sent_rounds_done] == send_plan[sent_rounds_done].msgs.len() {
                        sent_rounds_done += 1;
                    }
                } else {
                    i += 1;
                }
            }
            // receives complete in posting order; test the oldest first
            let mut i = 0;
            while i < fl.recvs.len() {
                let mut sizes = [-1i32; 8];
                if p.test(fl.recvs[i].req, &mut sizes).map_err(err)? {
                    let rs = fl.recvs.remove(i);
                    let rd = &recv_plan[rs.round];
                    for (j, m) in rd.msgs.iter().enumerate() {
                        if sizes[j] != m.size as i32 {
                            return Err(Stop::Corrupt(format!(
                                "round {} buffer {j}: test reported {} bytes, peer sent {}",
                                rs.round, sizes[j], m.size
                            )));
                        }
                        if let Some(off) = check(&rs.bufs[j][..m.size], self.peer_seed, rs.round, j) {
                            return Err(Stop::Corrupt(format!(
                                "round {} buffer {j} (tag {}, {} bytes): data differs at offset {off}",
                                rs.round, m.tag, m.size
                            )));
                        }
                        if let Some(off) = rs.bufs[j][m.size..].iter().position(|&b| b != CANARY) {
                            return Err(Stop::Corrupt(format!(
                                "round {} buffer {j}: canary overwritten {off} bytes past the {}-byte message",
                                rs.round, m.size
                            )));
                        }
                        c.bytes_checked += m.size as u64;
                        c.msgs_checked += 1;
                    }
                    for mh in rs.mhs {
                        p.dereg_mr(r, mh).map_err(err)?;
                    }
                    recv_done += 1;
                } else {
                    i += 1;
                }
            }
        }
        Ok(())
    }
}
