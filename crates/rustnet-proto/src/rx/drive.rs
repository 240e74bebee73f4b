//! The receiver's entry points: what `irecv`, `test`, `iflush`, the merged
//! device's look-ahead and the end of the handshake do, in order, over an
//! executor ([`RecvNic`]). The transport calls only these (and the read-only
//! accessors); the rules they apply are the machine's methods in [`super`].
use super::{CtlChain, Finished, Receiver, Taken};
use crate::fifo::{self, Cts};
use crate::nic::{Ev, EvOp, Fail, RecvNic, WrId, MAX_EVENTS_PER_PARENT, POLL_BATCH};
use crate::pool::ReqId;
use crate::recover::TxPoint;
use crate::MAX_RECVS;

type R<T, N> = Result<T, Fail<<N as crate::nic::Link>::Error>>;

// (for the machine's field: its own module does not import `nic`, which imports it)
pub(super) use crate::nic::{CqBuf, NO_CQES};

impl Receiver {
    /// The sender said READY: control writes may go from now on, and the
    /// CTS of receives posted before go out now.
    pub fn handshake_done<N: RecvNic>(&mut self, nic: &mut N) -> R<(), N> {
        self.on_ready();
        self.late_ring(nic)?;
        self.flush_ctl(nic)
    }

    /// Would [`Receiver::irecv`] take a receive now? (A merged device asks
    /// every member before posting on any.)
    pub fn would_take<N: RecvNic>(&mut self, nic: &mut N) -> bool {
        if !self.slot_free() {
            self.poll(nic);
        }
        self.can_take()
    }

    /// NCCL's `irecv` of a (grouped) receive, one CTS element per buffer
    /// (`n`/`i` filled in): `Ok(None)` when it cannot be taken now (its FIFO
    /// slot or every request slot busy, or on iWARP too few notice receives
    /// posted). Messages that arrived before their buffer are copied out
    /// before this returns.
    pub fn irecv<N: RecvNic>(&mut self, nic: &mut N, elems: &[Cts]) -> R<Option<Taken>, N> {
        if !self.slot_free() {
            self.poll(nic);
            if !self.slot_free() {
                // the slot's previous lap may still wait to be written
                self.force_cts();
                self.flush_ctl(nic)?;
                return Ok(None);
            }
        }
        if !self.can_take() {
            return Ok(None);
        }
        // iWARP (no RNR retry): a CTS only while every notice it allows finds a receive
        let (_, first, nlanes) = self.next_lanes();
        if !nic.may_advertise(first, nlanes, self.in_flight() + 1) {
            return Ok(None);
        }
        // messages that arrived before their buffer was posted are copied here
        let taken = {
            let nic_ref = &*nic;
            self.take_recv(elems, &mut |d| nic_ref.deliver(d))
        };
        let Some(t) = taken.map_err(Fail::Proto)? else { return Ok(None) };
        if let Err(e) = nic.expect(t.seq, t.nlanes) {
            self.abandon(t.id);
            return Err(Fail::Nic(e));
        }
        nic.taken(t.id);
        if nic.profiling() {
            for lane in 0..t.nlanes.min(MAX_EVENTS_PER_PARENT) {
                let qp = (t.first + lane) % self.nqps;
                for (i, c) in elems.iter().enumerate() {
                    let len = fifo::chunk(c.cap as usize, lane, t.nlanes).1;
                    nic.ev_start(&Ev { id: t.id, slot: i * self.nqps + qp, parent: i, qp, op: EvOp::Recv, wr: WrId::Data(t.seq), len });
                }
            }
        }
        nic.progressed();
        self.late_ring(nic)?;
        self.flush_ctl(nic)?;
        Ok(Some(t))
    }

    /// NCCL's `test` of receive (or flush) `id`: `Ok(Some(sizes))` once
    /// every buffer is filled (the request is freed then); an error frees
    /// it too.
    ///
    /// The polling loop's common call finds nothing: the link healthy, the
    /// eager ring and mailbox unchanged, the CQ empty. Such a *quiet* call
    /// changes no state, so it posts nothing (every entry point ends with
    /// the control writes that were due posted, or the send queue full,
    /// which only a reaped completion frees) and checks the link once:
    /// only a liveness probe could have failed it since.
    #[inline(always)]
    pub fn test<N: RecvNic>(&mut self, nic: &mut N, id: ReqId) -> R<Option<Finished>, N> {
        // (a failed link has no news worth reading: its error is below)
        let was_done = self.is_done(id).map_err(Fail::Stale)?;
        // did anything happen that can finish a request or change what is
        // due (a completion, an eager message, a ring made, a failure)? If
        // not, one not done before is not done now
        let mut news = was_done;
        let mut quiet = false;
        if !was_done && nic.check().is_ok() {
            // the eager ring first, the CQ only if still not done (and only
            // while the send queue has room: the full poll retires it);
            // the control writes due go once, after both
            let fast = self.eager.is_some() && self.ready && self.ctl_room() >= self.sq_depth / 2;
            let mut done = false;
            if fast {
                match self.look_eager(nic) {
                    // (only a message taken can have finished it)
                    Ok(took) => {
                        news = took;
                        done = took && self.is_done(id).unwrap_or(false);
                    }
                    Err(e) => {
                        nic.fail(e);
                        news = true;
                    }
                }
            }
            if !done {
                news |= self.poll_with(nic, !fast, !news);
                quiet = !news;
            } else if let Err(e) = self.flush_ctl(nic) {
                nic.fail(e);
            }
        }
        if news {
            if let Ok(Some(f)) = self.finish(id) {
                // buffers filled by eager messages had no completion of their own
                nic.ev_stop_req(id);
                return Ok(Some(f));
            }
        }
        // (the tick does nothing on a failed link; one that fails it shows below)
        if !nic.tick(self.live()) && quiet {
            return Ok(None);
        }
        if let Err(e) = nic.check() {
            nic.ev_stop_req(id);
            self.abandon(id);
            return Err(Fail::Nic(e));
        }
        Ok(None)
    }

    /// NCCL's `iflush`: a flush request, whose read `post` posts (its
    /// completion, [`WrId::Flush`], finishes it).
    pub fn iflush<N: RecvNic>(&mut self, nic: &mut N, post: impl FnOnce(&mut N, ReqId) -> Result<(), N::Error>) -> R<ReqId, N> {
        let id = self.add_flush().ok_or(Fail::NoSlot)?;
        if let Err(e) = post(nic, id) {
            self.abandon(id);
            return Err(Fail::Nic(e));
        }
        Ok(id)
    }

    /// A connection recovering from a fault resumes on new QPs: the
    /// sender's restart point `peer` says which CTS slot it stands at
    /// (every CTS from there on is written again: any may have been lost),
    /// the control writes' send queue starts empty, the credit counter is
    /// written again, and every flush read not completed is posted again
    /// (`flush`, as `iflush` posts one). `Err(Fail::Proto)`: the point
    /// contradicts ours (a broken peer).
    pub fn resume<N: RecvNic>(
        &mut self,
        nic: &mut N,
        peer: &TxPoint,
        mut flush: impl FnMut(&mut N, ReqId) -> Result<(), N::Error>,
    ) -> R<(), N> {
        let eager_next = self.eager.as_ref().map_or(0, |e| e.st.next());
        if peer.fifo_head > self.cts_written() || peer.eager_posted < eager_next {
            return Err(Fail::Proto(crate::ProtoError::RecoverField { what: "a sender point beyond what this receiver wrote or took" }));
        }
        self.cts.rewind(peer.fifo_head);
        self.batch = None;
        self.budget.reset();
        if let Some(e) = &self.eager {
            // the credit word may have been lost with the old QPs
            self.credit = Some(e.st.freed());
        }
        // and a late ring's address
        self.reannounce_ring();
        let mut ids = [None; super::RECV_POOL];
        for (slot, (id, r)) in ids.iter_mut().zip(self.reqs.iter()) {
            if r.flush && !r.done {
                *slot = Some(id);
            }
        }
        for id in ids.into_iter().flatten() {
            flush(nic, id).map_err(Fail::Nic)?;
        }
        nic.progressed();
        self.flush_ctl(nic)
    }

    /// Reap the CQ, look at the eager ring, write what is due.
    pub fn poll<N: RecvNic>(&mut self, nic: &mut N) {
        self.poll_with(nic, true, false);
    }

    /// [`Self::poll`]; `eager: false` skips the ring (the caller just
    /// looked); `quiet_ok`: the caller has just seen the link healthy and
    /// changed nothing since, so a poll that finds nothing changes nothing
    /// either: no second check, and no control writes to plan (see
    /// [`Self::test`]). Returns whether anything happened: a completion
    /// reaped, an eager message taken, a ring made, or a failure.
    #[inline(always)]
    fn poll_with<N: RecvNic>(&mut self, nic: &mut N, eager: bool, quiet_ok: bool) -> bool {
        let mut reaped = false;
        loop {
            let n = match nic.poll_cq(&mut self.cqes) {
                Ok(n) => n,
                Err(_) => return true, // (recorded: the comm failed)
            };
            reaped |= n > 0;
            for k in 0..n {
                let c = self.cqes[k];
                if !c.ok {
                    continue;
                }
                match (c.wr, c.word) {
                    // (control writes all go on QP 0, the one the budget counts)
                    (WrId::Ctl { count, .. }, _) => self.on_ctl_done(count),
                    (WrId::Flush(id), _) => self.on_flush_done(id),
                    (_, Some(word)) => {
                        if let Err(e) = self.on_word(nic, c.qp, word) {
                            nic.fail(e);
                        }
                    }
                    _ => {}
                }
            }
            if n > 0 {
                nic.progressed();
            }
            if n < POLL_BATCH {
                break;
            }
        }
        if (reaped || !quiet_ok) && nic.check().is_err() {
            return true;
        }
        let mut took = false;
        if eager {
            match self.look_eager(nic) {
                Ok(t) => took = t,
                Err(e) => {
                    nic.fail(e);
                    return true;
                }
            }
        }
        if quiet_ok && !reaped && !took {
            return false; // (the polling loop's common case: nothing new, nothing due)
        }
        // credits due go now, deferred CTS with them (the same post); and a
        // mailbox that said the sender waits makes its CTS due now too
        if let Err(e) = self.flush_ctl(nic) {
            nic.fail(e);
            return true;
        }
        reaped || took
    }

    /// A completion word (an immediate, or an iWARP notice's) on our QP
    /// `qp`: the receive it answers, the profiler events it ends, the bytes.
    fn on_word<N: RecvNic>(&mut self, nic: &mut N, qp: Option<usize>, word: u32) -> R<(), N> {
        let ev = {
            let nic_ref = &*nic;
            self.on_imm(word, qp, |seq| nic_ref.sizes(seq)).map_err(Fail::Proto)?
        };
        if let (true, Some(qp)) = (nic.profiling(), qp) {
            // what this QP carries of every buffer of the receive has landed
            for i in 0..MAX_RECVS {
                nic.ev_stop(ev.id, i * self.nqps + qp);
            }
        }
        if let Some(sizes) = ev.sizes {
            // counters: the sender cut each buffer with the same rule (fifo::chunk)
            let (first, nlanes) = fifo::lanes(ev.seq, self.nqps, self.split);
            for lane in 0..nlanes {
                let bytes: usize = sizes[..ev.n].iter().map(|&s| fifo::chunk(s, lane, nlanes).1).sum();
                nic.count((first + lane) % self.nqps, bytes as u64);
            }
        }
        Ok(())
    }

    /// Look at the eager ring and the mailbox (the caller posts the
    /// control writes that makes due): `Ok(true)` when messages were taken,
    /// a control write became due, or a late ring was made.
    #[inline(always)]
    fn look_eager<N: RecvNic>(&mut self, nic: &mut N) -> R<bool, N> {
        if self.ring_missing() {
            return self.late_ring(nic).map(|()| !self.ring_missing());
        }
        let (got, due) = {
            let nic_ref = &*nic;
            let Some(ring) = nic_ref.ring() else { return Ok(false) };
            self.poll_ring(ring, &mut |d| nic_ref.deliver(d)).map_err(Fail::Proto)?
        };
        if got > 0 {
            nic.progressed();
        }
        Ok(got > 0 || due)
    }

    /// A late eager ring is made when the sender asks for it (its first
    /// small send found no CTS) or when one of our receives only eager
    /// messages could fill was posted, once READY came; its address goes
    /// out with the next control writes (the caller flushes them).
    #[inline(always)]
    fn late_ring<N: RecvNic>(&mut self, nic: &mut N) -> R<(), N> {
        if !self.ready || !self.ring_missing() || !(self.ring_wanted() || nic.ring_requested()) {
            return Ok(()); // (the polling loop's common case)
        }
        self.make_late_ring(nic)
    }

    #[inline(never)]
    fn make_late_ring<N: RecvNic>(&mut self, nic: &mut N) -> R<(), N> {
        let (addr, rkey) = nic.make_ring(self.eager_limit()).map_err(Fail::Nic)?;
        self.ring_made(nic.stage(), addr, rkey);
        nic.progressed();
        Ok(())
    }

    /// Post the control writes planned now (CTS slots in order, the credit
    /// word), each chain one post.
    #[inline(always)]
    fn flush_ctl<N: RecvNic>(&mut self, nic: &mut N) -> R<(), N> {
        if !self.has_ctl() {
            return Ok(()); // (the polling loop's common case: nothing to build)
        }
        self.post_ctl_chains(nic)
    }

    #[inline(never)]
    fn post_ctl_chains<N: RecvNic>(&mut self, nic: &mut N) -> R<(), N> {
        let mut chain = CtlChain::default();
        while self.poll_ctl(nic.stage(), &mut chain) {
            nic.post_ctl(&chain).map_err(Fail::Nic)?;
        }
        Ok(())
    }
}
