//! The sender's entry points: what `isend`, `test`, the merged device's
//! look-ahead and close do, in order, over an executor ([`SendNic`]). The
//! transport calls only these (and the read-only accessors); the rules they
//! apply are the machine's methods in [`super`].
use std::time::Duration;

use super::{EagerPlan, EagerWr, Head, Replayed, Sender, Sent};
use crate::eager::{self, RING_SLOTS};
use crate::fifo::{self, FailCode, Group, ImmKind, PlannedWr, WrKind, FIFO_DEPTH, MAX_LANE_WRS};
use crate::mem::MemMut;
use crate::nic::{Ev, EvOp, Fail, Lane, SendNic, WrId, MAX_EVENTS_PER_PARENT, POLL_BATCH};
use crate::pool::ReqId;
use crate::recover::RxPoint;
use crate::ProtoError;

type R<T, N> = Result<T, Fail<<N as crate::nic::Link>::Error>>;

// (for the machine's field: its own module does not import `nic`, which imports it)
pub(super) use crate::nic::{CqBuf, NO_CQES};

impl Sender {
    /// NCCL's `isend` of `size` bytes at `src` (local key `lkey`) with
    /// `tag`, once the connection is up: `Ok(None)` until the receiver
    /// posted the matching receive (or while every request slot is busy).
    /// Small sends of the eager tag go into the receiver's ring when its
    /// CTS is not there yet.
    pub fn isend<N: SendNic>(&mut self, nic: &mut N, tag: i32, size: usize, src: u64, lkey: u32) -> R<Option<ReqId>, N> {
        // The credit word first, the CTS FIFO after: the receiver writes CTS
        // before credits on the same QP, so every CTS that came before these
        // credits is loaded below and the head an eager message reports is
        // as fresh as the credits it spends.
        let freed = self.read_credits(nic.fifo());
        if self.head_ready(nic)? {
            match self.send(tag, size, src, lkey) {
                Sent::Taken { id, group } => {
                    nic.taken(id);
                    nic.progressed();
                    if let Some(g) = group {
                        self.post_group(nic, &g, None).map_err(Fail::Nic)?;
                    }
                    return Ok(Some(id));
                }
                Sent::Full => return Ok(None),
                Sent::NoTag => {
                    if !self.eager_on() {
                        self.idle_work(nic)?;
                    }
                }
                Sent::Mismatch { group, code, what } => {
                    // Tell the receiver (its request fails too), then fail
                    // without stopping the QPs, so that message goes out.
                    let _ = self.post_group(nic, &group, Some(code));
                    return Err(Fail::Mismatch(code, what));
                }
            }
        }
        if let Some(id) = self.try_eager(nic, tag, size, src, freed)? {
            return Ok(Some(id));
        }
        if self.eager_on() {
            self.idle_work(nic)?;
            self.note_blocked(nic);
        }
        Ok(None)
    }

    /// The capacity of the receive buffer a send of `tag` would fill next,
    /// once the receiver advertised it and an `isend` of that tag would be
    /// taken now (`Ok(None)`: not yet). A merged device cuts each message
    /// over its members by these.
    pub fn peek<N: SendNic>(&mut self, nic: &mut N, tag: i32) -> R<Option<usize>, N> {
        if !self.has_room() || !self.head_ready(nic)? {
            return Ok(None);
        }
        // a tag the head receive has no free buffer for: not yet, as in isend
        Ok(self.peek_cap(tag))
    }

    /// NCCL's `test` of send `id`: `Ok(Some(size))` once it is done (the
    /// request is freed then); an error frees it too.
    #[inline(always)]
    pub fn test<N: SendNic>(&mut self, nic: &mut N, id: ReqId) -> R<Option<usize>, N> {
        // a send not done before is done now only if the poll reaped something
        let news = self.is_done(id).map_err(Fail::Stale)? || self.poll(nic);
        if news && self.is_done(id) == Ok(true) {
            nic.ev_stop_req(id);
            return Ok(Some(self.release(id).unwrap_or(0)));
        }
        // (the tick does nothing on a failed link; one that fails it shows below)
        nic.tick(self.live());
        if let Err(e) = nic.check() {
            nic.ev_stop_req(id);
            self.release(id);
            return Err(Fail::Nic(e));
        }
        Ok(None)
    }

    /// Reap every completion the CQ holds; whether there was any.
    #[inline(always)]
    pub fn poll<N: SendNic>(&mut self, nic: &mut N) -> bool {
        let mut reaped = false;
        loop {
            let n = match nic.poll_cq(&mut self.cqes) {
                Ok(n) => n,
                Err(_) => return reaped, // (recorded: the comm failed)
            };
            reaped |= n > 0;
            for k in 0..n {
                let c = self.cqes[k];
                match c.wr {
                    // freed whether or not it succeeded
                    WrId::Eager(count) => self.on_eager_done(count),
                    // (a QP the comm no longer has: a stopped QP's late news, which
                    // the resume after a fault has already settled)
                    WrId::Data(seq) if c.ok && c.qp.is_some() => {
                        let qi = c.qp.unwrap_or(0);
                        let Some(d) = self.on_write_done(seq, qi) else { continue };
                        if nic.profiling() {
                            // this QP's share of each send is on the wire and acknowledged
                            for r in d.reqs[..d.n].iter().flatten() {
                                nic.ev_stop(*r, qi);
                            }
                        }
                    }
                    // failed (recorded), or a completion with no news
                    _ => {}
                }
            }
            if n > 0 {
                nic.progressed();
            }
            if n < POLL_BATCH {
                return reaped;
            }
        }
    }

    /// A connection recovering from a fault resumes on new QPs: the
    /// receiver's restart point `peer` says which lanes of every group
    /// still in flight it has (the others are written again, from the
    /// sends' buffers, which NCCL still lends us) and which eager messages
    /// it took (the rest are written again from our staging, which keeps
    /// each until its credit comes back). A group the receiver no longer
    /// waits for is done.
    /// `Err(Fail::Proto)`: the point contradicts ours (a broken peer).
    pub fn resume<N: SendNic>(&mut self, nic: &mut N, peer: &RxPoint) -> R<Replayed, N> {
        let mut out = Replayed::default();
        let head = self.fifo.head();
        let posted = self.eager.as_ref().map_or(0, |e| e.st.posted());
        if peer.eager_next > posted || peer.credit > peer.eager_next || peer.cts_written < head {
            return Err(Fail::Proto(ProtoError::RecoverField { what: "a receiver point ahead of what this sender wrote" }));
        }
        // A receive the peer still lacks lanes of must be one we still hold: a
        // message we completed is gone from NCCL's loan. (On iWARP a SEND
        // completes once TCP has it; since the delivery fence a lane counts
        // as done only at the READ behind its notice, so this guards against
        // a broken executor, not a fault.) Fail clearly rather than leave the
        // receiver waiting.
        // (With an eager ring a receive may still wait for a message that
        // went by the ring, which the ring's replay below brings; eager is
        // off on iWARP, where this loss can happen.)
        let lanes_only = if self.eager.is_none() { peer.n.min(FIFO_DEPTH) } else { 0 };
        for r in &peer.inflight[..lanes_only] {
            let all = super::lanes_mask(self.lanes(r.seq).1);
            if r.seq < head && r.got & all != all && !self.inflight.iter().any(|s| s.active && s.g.seq == r.seq) {
                return Err(Fail::Proto(ProtoError::RecoverLost { seq: r.seq }));
            }
        }
        if let Some(e) = &mut self.eager {
            // the old QP 0's send queue is gone, and with it every entry it held
            e.pending = 0;
            e.quiet = 0;
        }
        // a late ring asked for and not announced: the request may be lost, ask again
        self.resume_late_ring();
        let mut plan = [PlannedWr { kind: WrKind::Empty, imm: None }; MAX_LANE_WRS];
        for slot in 0..FIFO_DEPTH {
            if !self.inflight[slot].active {
                continue;
            }
            let seq = self.inflight[slot].g.seq;
            let all = self.inflight[slot].all();
            // The receiver's word decides which lanes are there: a lane this
            // end saw complete may still be missing (on iWARP a lane's notice
            // completes once TCP has it), and NCCL still lends the buffer of
            // a message in flight, so any lane the receiver lacks is resent.
            let listed = peer.got(seq);
            let got = listed.unwrap_or(all) & all;
            out.confirmed += u64::from((got & !self.inflight[slot].done).count_ones());
            self.inflight[slot].done = if listed.is_some() { got } else { all };
            if self.inflight[slot].done == all {
                self.finish_group(slot);
                continue;
            }
            let (first, nlanes) = self.lanes(seq);
            let g = self.inflight[slot].g.clone();
            for lane in (0..nlanes).filter(|&l| self.inflight[slot].done & (1u128 << l.min(127)) == 0) {
                let k = fifo::plan_lane(&g, lane, nlanes, None, &mut plan);
                out.bytes += plan[..k]
                    .iter()
                    .map(|w| match w.kind {
                        WrKind::Data { len, .. } => len as u64,
                        _ => 0,
                    })
                    .sum::<u64>();
                nic.post_lane(&Lane { g: &g, lane, nlanes, qp: (first + lane) % self.nqps, plan: &plan[..k] }).map_err(Fail::Nic)?;
                out.lanes += 1;
            }
        }
        if let Some(e) = &mut self.eager {
            let n = posted - peer.eager_next;
            for (i, idx) in (peer.eager_next..posted).enumerate() {
                let len = e.wire_len[(idx % RING_SLOTS as u64) as usize] as usize;
                // one completion for all of them, on the last
                let last = i as u64 + 1 == n;
                let w = EagerWr { id: None, idx, off: eager::slot_offset(idx, e.st.max), len, count: n, signaled: last };
                nic.post_eager(&w, None).map_err(Fail::Nic)?;
                out.eager += 1;
                out.bytes += (len - eager::HDR_BYTES - 8) as u64;
            }
            // (a mailbox write lost with the old QPs needs no second one:
            // the receiver's resume writes every CTS it holds at once)
            e.pending += n as usize;
        }
        nic.progressed();
        Ok(out)
    }

    /// Closing must not drop writes already posted (a send reported done
    /// early, eagerly, may still be on the wire): wait up to `limit` for
    /// their completions, or until the comm fails or stops to recover
    /// (nothing completes on stopped QPs: a fault found by this very wait,
    /// say a buffer NCCL deregistered before closing, used to hold the
    /// close for the whole `limit`). Returns the writes still outstanding.
    pub fn close<N: SendNic>(&mut self, nic: &mut N, limit: Duration) -> usize {
        if nic.check().is_err() {
            return self.outstanding();
        }
        // unsignaled eager writes at the tail: a signaled empty write behind
        // them completes only after they did (RC order)
        if let Some(count) = self.close_eager() {
            if nic.post_fence(count).is_err() {
                // not posted: nothing of it to wait for
                self.on_eager_done(1);
            }
        }
        let t0 = nic.now();
        while self.outstanding() > 0 && nic.check().is_ok() && !nic.stopped() && nic.now().saturating_duration_since(t0) < limit {
            self.poll(nic);
            nic.tick(0);
        }
        self.outstanding()
    }

    /// Bring the head FIFO slot to where a send can match it: its previous
    /// lap completed and the receiver's CTS for it arrived. `Ok(false)`:
    /// not yet (NCCL retries).
    fn head_ready<N: SendNic>(&mut self, nic: &mut N) -> R<bool, N> {
        loop {
            match self.head(nic.fifo()).map_err(Fail::Proto)? {
                // The head slot's previous lap (seq - FIFO_DEPTH) may still await its
                // completion (the receiver saw the data before our ACK came back).
                Head::Busy => {
                    self.poll(nic);
                    if self.head_busy() {
                        // a dead receiver shows here sooner than by the retry timeout
                        nic.tick(self.live());
                        nic.check().map_err(Fail::Nic)?;
                        return Ok(false);
                    }
                }
                Head::Ready => return Ok(true),
                Head::NotYet => {
                    // with the eager path, isend tries it first and polls after
                    if !self.eager_on() {
                        self.idle_work(nic)?;
                    }
                    return Ok(false);
                }
            }
        }
    }

    /// A call that could not proceed: reap completions, look at the peer now and then.
    fn idle_work<N: SendNic>(&mut self, nic: &mut N) -> R<(), N> {
        self.poll(nic);
        nic.tick(self.live());
        nic.check().map_err(Fail::Nic)
    }

    /// Send into the receiver's eager ring if this send may: `Ok(None)` when not.
    fn try_eager<N: SendNic>(&mut self, nic: &mut N, tag: i32, size: usize, src: u64, freed: u64) -> R<Option<ReqId>, N> {
        if !self.eager_on() {
            return Ok(None);
        }
        if !self.ring_known() && !self.late_ring(nic, tag, size)? {
            return Ok(None);
        }
        let Some(stage) = nic.eager_stage() else { return Ok(None) };
        let mut plan = self.plan_eager(tag, size, freed, stage);
        if plan == Ok(EagerPlan::Full) {
            self.poll(nic);
            let Some(stage) = nic.eager_stage() else { return Ok(None) };
            plan = self.plan_eager(tag, size, freed, stage);
        }
        let w = match plan {
            Ok(EagerPlan::Go(w)) => w,
            Ok(_) => return Ok(None),
            Err(e) => return Err(Fail::Proto(e)),
        };
        let Some(id) = w.id else { return Ok(None) };
        nic.taken(id);
        if nic.profiling() {
            // one event for the one write on QP 0, until the send is reported done
            nic.ev_start(&Ev { id, slot: 0, parent: 0, qp: 0, op: EvOp::Write, wr: WrId::Eager(w.count), len: size });
        }
        let id = w.id.unwrap_or(ReqId { slot: 0, gen: 0 });
        if let Err(e) = nic.post_eager(&w, Some((src, size))) {
            nic.ev_stop_req(id);
            self.release(id);
            return Err(Fail::Nic(e));
        }
        nic.progressed();
        Ok(Some(id))
    }

    /// A late eager ring: take its address if the receiver's announcement
    /// landed (our staging is registered then), else ask for it once, on
    /// the first send that could have gone eagerly. True once it is known.
    fn late_ring<N: SendNic>(&mut self, nic: &mut N, tag: i32, size: usize) -> R<bool, N> {
        if let Some(a) = self.read_ring_ann(nic.fifo()).map_err(Fail::Proto)? {
            nic.ring_arrived(a.addr, a.rkey, a.max as usize).map_err(Fail::Nic)?;
            self.on_ring();
            return Ok(true);
        }
        if let Some(r) = self.plan_ring_request(tag, size, nic.sizes_stage()) {
            nic.post_ring_request(&r).map_err(Fail::Nic)?;
            nic.progressed();
        }
        Ok(false)
    }

    /// A send could not go: if we have been stuck at this FIFO head for a
    /// while, tell the receiver (it may be holding CTS writes back, or owe
    /// us credits).
    fn note_blocked<N: SendNic>(&mut self, nic: &mut N) {
        let now = nic.now();
        if !self.ring_known() {
            // a late ring not known yet: no mailbox, but the receiver is probed
            if let Some(count) = self.on_blocked_probe(now) {
                if let Err(e) = nic.post_fence(count) {
                    nic.fail(Fail::Nic(e));
                }
            }
            return;
        }
        let Some(stage) = nic.eager_stage() else { return };
        let Some(m) = self.on_blocked(now, stage) else { return };
        if let Err(e) = nic.post_mailbox(&m) {
            nic.fail(Fail::Nic(e));
        }
    }

    /// Post a complete group's lanes (`fail`: tell the receiver its receive
    /// fails, with no data).
    fn post_group<N: SendNic>(&mut self, nic: &mut N, g: &Group, fail: Option<FailCode>) -> Result<(), N::Error> {
        let (first, nlanes) = self.lanes(g.seq);
        if fail.is_none() && matches!(g.imm().kind, ImmKind::Sizes(_)) {
            nic.sizes_stage().write(fifo::sizes_offset(g.seq), &fifo::encode_sizes(&g.wire_sizes()[..g.n])[..4 * g.n]);
        }
        let mut plan = [PlannedWr { kind: WrKind::Empty, imm: None }; MAX_LANE_WRS];
        // The sends complete when every lane's signaled write did (even when
        // its bytes went inline): until then a fault may need the buffers to
        // write a lane again.
        for lane in 0..nlanes {
            let k = fifo::plan_lane(g, lane, nlanes, fail, &mut plan);
            let qp = (first + lane) % self.nqps;
            if fail.is_none() && lane < MAX_EVENTS_PER_PARENT && nic.profiling() {
                lane_events(nic, g, qp, lane, nlanes, &plan[..k]);
            }
            nic.post_lane(&Lane { g, lane, nlanes, qp, plan: &plan[..k] })?;
        }
        self.on_posted(g, nlanes);
        Ok(())
    }
}

/// Profiler events of one lane about to be posted on QP `qp`: one per send
/// of the group (as NCCL's IB transport: per request per QP), its share of
/// the lane's bytes, the kind of its write (a send with no bytes on this
/// lane: the lane's last write, whose completion it waits for).
fn lane_events<N: SendNic>(nic: &mut N, g: &Group, qp: usize, lane: usize, nlanes: usize, plan: &[PlannedWr]) {
    let op = |w: &PlannedWr| if w.imm.is_some() { EvOp::LaneEnd } else { EvOp::Write };
    let last = plan.last().map_or(EvOp::LaneEnd, op);
    for e in (0..g.n).filter(|&e| !g.is_eager(e)) {
        let Some(id) = g.reqs[e] else { continue };
        let len = fifo::chunk(g.sizes[e] as usize, lane, nlanes).1;
        let op = plan.iter().find(|w| matches!(w.kind, WrKind::Data { elem, .. } if elem == e)).map_or(last, op);
        nic.ev_start(&Ev { id, slot: qp, parent: 0, qp, op, wr: WrId::Data(g.seq), len });
    }
}
