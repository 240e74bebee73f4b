//! The verbs receiver as a state machine (quinn-proto style): it owns the
//! receive requests, the FIFO slots they advertise, the CTS batching, the
//! eager ring's bookkeeping and the send-queue budget of the control
//! writes. The transport (`transport::ib::entry`, with `p2p`'s executor)
//! feeds it what happened (a receive posted, an immediate or notice word,
//! the ring memory, a control write completed) and posts what it plans
//! (`Receiver::poll_ctl`: CTS and credit writes, as runs of the staging
//! area, in chains). No I/O, no clock, no allocation after
//! [`Receiver::new`].
//!
//! Rules kept here (see [`crate::fifo`] and [`crate::eager`] for the wire):
//! - a receive takes FIFO slot `seq % FIFO_DEPTH` only once the slot's
//!   previous receive completed and its CTS went out ([`CtsQueue::can_post`]);
//! - CTS slots are written in order, never over a slot the sender has not
//!   moved past, in as few writes as the send queue allows; eager-only
//!   receives wait for a batch, a waiting sender (mailbox) flushes them;
//! - every completion word names a receive waiting for a rendezvous, each
//!   lane's word comes once, the sizes fit the buffers, no buffer is filled
//!   both eagerly and by a rendezvous;
//! - an eager message fills the buffer its `j` names, once, if it fits.
//!
//! Every violation comes out as a typed [`ProtoError`].
use crate::eager::{self, Arrival, CtsQueue, EagerRx, Header, RingAnn, HDR_BYTES, RING_ANN_BYTES, RING_ANN_OFF, RING_SLOTS};
use crate::error::ProtoError;
use crate::fifo::{self, Cts, Imm, ImmKind, SqBudget, ELEM_BYTES, FIFO_BYTES, FIFO_DEPTH};
use crate::mem::{Mem, MemMut};
use crate::pool::{Pool, ReqId, Stale};
use crate::recover::{InflightRecv, RxPoint};
use crate::{MAX_RECVS, MAX_REQUESTS};

mod drive;

/// Request slots: receives are held to `RECV_POOL - MAX_REQUESTS` (posted
/// plus completed-but-untested), leaving MAX_REQUESTS for flushes (at most
/// one per receive), so a flush never finds the pool full.
pub const RECV_POOL: usize = 3 * MAX_REQUESTS;
/// Window of eager-tag buffers tracked (32 receives x 8 buffers).
pub const JWIN: usize = FIFO_DEPTH * MAX_RECVS;
/// Most writes in one planned chain (one `ibv_post_send`).
pub const CHAIN: usize = 16;
/// Offset of the credit word, in our staging and in the sender's FIFO region.
pub const CREDIT_OFF: usize = FIFO_BYTES;
/// Signal at least one control write in this many.
pub const CTL_SIGNAL: usize = 16;
/// Receives whose CTS elements are kept: a receive is taken only once the
/// CTS of its slot's previous lap was written, which is at most a lap past
/// the sender's head, so receives run at most two laps ahead of the head;
/// every CTS from the head on can be written again after a fault.
pub const CTS_KEEP: usize = 2 * FIFO_DEPTH;

#[inline]
fn keep(seq: u64) -> usize {
    (seq % CTS_KEEP as u64) as usize
}

/// How the connection was set up.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// QPs (lanes) of the connection.
    pub nqps: usize,
    /// Messages split over all QPs (else rotated, one QP each).
    pub split: bool,
    /// Eager limit both ends agreed on (0: no eager path).
    pub eager: usize,
    /// Send-queue entries the control writes may hold on QP 0.
    pub sq_depth: usize,
    /// The eager ring comes late (both ends said so): registered when the
    /// sender first asks ([`crate::eager`]), not at connect.
    pub late_ring: bool,
}

/// One control write: `len` bytes at `off` of our staging go to the same
/// offset of the sender's FIFO region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CtlWr {
    /// Offset (staging and remote).
    pub off: usize,
    /// Bytes.
    pub len: usize,
    /// `Some(count)`: signal it, and hand `count` to
    /// `Receiver::on_ctl_done` when its completion comes.
    pub signal: Option<u64>,
}

/// Control writes to post as one chain, in order, on QP `qp`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CtlChain {
    /// Our QP index.
    pub qp: usize,
    /// Writes in `wrs`.
    pub n: usize,
    /// The writes.
    pub wrs: [CtlWr; CHAIN],
}

impl CtlChain {
    /// The planned writes.
    pub fn wrs(&self) -> &[CtlWr] {
        &self.wrs[..self.n]
    }
}

/// Copy an eager message out of the ring: `len` bytes at ring offset `src`
/// into the posted buffer at address `dst`. The machine counts the buffer
/// filled and the ring slot free when it hands this out: copy at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deliver {
    /// Ring index of the message.
    pub idx: u64,
    /// Payload offset in the ring region.
    pub src: usize,
    /// Destination (the CTS address of the buffer).
    pub dst: u64,
    /// Bytes (may be 0: nothing to copy).
    pub len: usize,
    /// The receive it fills, and which buffer.
    pub id: ReqId,
    /// Buffer index.
    pub i: usize,
}

/// A receive was taken (`Receiver::take_recv`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// Its request.
    pub id: ReqId,
    /// Its sequence number (FIFO slot `seq % FIFO_DEPTH`).
    pub seq: u64,
    /// First QP its rendezvous writes use.
    pub first: usize,
    /// How many QPs (lanes).
    pub nlanes: usize,
}

/// What a completion word did (`Receiver::on_imm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImmEvent {
    /// The receive it belongs to.
    pub id: ReqId,
    /// Its sequence number.
    pub seq: u64,
    /// `Some` on its last lane: the rendezvous bytes per buffer (0 for
    /// buffers filled eagerly), `n` of them.
    pub sizes: Option<[usize; MAX_RECVS]>,
    /// Buffers in the receive.
    pub n: usize,
}

/// A finished request (`Receiver::finish`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// Sizes reported (0 for a flush).
    pub n: usize,
    /// Bytes per buffer.
    pub sizes: [usize; MAX_RECVS],
}

#[derive(Debug)]
struct Req {
    flush: bool,
    seq: u64,
    n: usize,
    caps: [usize; MAX_RECVS],
    dst: [u64; MAX_RECVS],
    /// Rendezvous words still to come (one per lane).
    lanes_left: usize,
    /// Lanes whose word came (bit = lane): a lane's word comes once, and a
    /// recovering connection resends exactly the lanes not here.
    got: u128,
    imm: Option<ImmKind>,
    sizes: [usize; MAX_RECVS],
    /// Buffers filled (bit i), by rendezvous or eager message.
    filled: u8,
    done: bool,
}

impl Req {
    fn all_filled(&self) -> bool {
        self.filled as u32 == (1u32 << self.n) - 1
    }
}

struct EagerState {
    st: EagerRx,
    /// Posted buffers of the eager tag not filled yet, by `j % JWIN`: (j, request, buffer).
    by_j: Box<[Option<(u64, ReqId, u8)>; JWIN]>,
    /// Payload sizes of messages kept in the ring until their buffer is posted.
    early_size: [u32; RING_SLOTS],
    /// Last mailbox value acted on.
    mailbox: u64,
    /// The ring exists (at connect, or since the sender asked for it).
    made: bool,
    /// Its address still has to go to the sender (a late ring, just made).
    announce: bool,
    /// A receive only eager messages could fill was posted with no ring:
    /// make it (the receives after it may then wait for a batch).
    wanted: bool,
    /// The ring comes late (its address goes to the sender in a control write).
    late: bool,
}

/// A range of CTS slots being planned into chains.
#[derive(Debug, Clone, Copy)]
struct Batch {
    end: u64,
    /// Next slot whose further elements go out, and the element.
    q: u64,
    i: usize,
}

/// The receiving end's protocol state.
pub struct Receiver {
    nqps: usize,
    split: bool,
    ready: bool,
    reqs: Pool<Req>,
    by_slot: [Option<(u64, ReqId)>; FIFO_DEPTH],
    /// The CTS elements of each receive, by `seq % CTS_KEEP`, until the
    /// sender has moved past it (a recovering connection writes every CTS
    /// from the sender's head on again; receives run up to two laps ahead
    /// of that head, see [`CTS_KEEP`]), and their buffer counts.
    cts_store: Box<[[Cts; MAX_RECVS]; CTS_KEEP]>,
    slot_n: [u8; CTS_KEEP],
    budget: SqBudget,
    /// Send-queue entries the control writes may hold ([`Config::sq_depth`]).
    sq_depth: usize,
    cts: CtsQueue,
    eager: Option<EagerState>,
    batch: Option<Batch>,
    /// Credit counter to send with the next control writes.
    credit: Option<u64>,
    eager_stats: (u64, u64),
    /// Where the CQ is read into ([`crate::nic::CqBuf`]).
    cqes: drive::CqBuf,
}

impl Receiver {
    /// A connection's receiver (`sq_depth` at least 2 x CTL_SIGNAL).
    pub fn new(cfg: Config) -> Receiver {
        assert!(cfg.nqps >= 1);
        Receiver {
            nqps: cfg.nqps,
            split: cfg.split,
            ready: false,
            reqs: Pool::new(RECV_POOL),
            by_slot: [None; FIFO_DEPTH],
            cts_store: Box::new([[Cts::default(); MAX_RECVS]; CTS_KEEP]),
            slot_n: [0; CTS_KEEP],
            budget: SqBudget::new(cfg.sq_depth, CTL_SIGNAL),
            sq_depth: cfg.sq_depth,
            cts: CtsQueue::new(),
            eager: (cfg.eager > 0).then(|| EagerState {
                st: EagerRx::new(cfg.eager),
                by_j: Box::new([None; JWIN]),
                early_size: [0; RING_SLOTS],
                mailbox: 0,
                made: !cfg.late_ring,
                announce: false,
                wanted: false,
                late: cfg.late_ring,
            }),
            batch: None,
            credit: None,
            eager_stats: (0, 0),
            cqes: drive::NO_CQES,
        }
    }

    /// The eager limit (0: off).
    #[inline]
    pub fn eager_limit(&self) -> usize {
        self.eager.as_ref().map_or(0, |e| e.st.max)
    }

    /// The sender said READY: control writes may go from now on.
    #[inline]
    pub(crate) fn on_ready(&mut self) {
        self.ready = true;
    }

    /// Eager messages delivered and their payload bytes.
    #[inline]
    pub fn eager_stats(&self) -> (u64, u64) {
        self.eager_stats
    }

    /// Live requests (receives and flushes).
    #[inline]
    pub fn live(&self) -> usize {
        self.reqs.len()
    }

    /// Send-queue entries the control writes may still take.
    #[inline]
    pub fn ctl_room(&self) -> usize {
        self.budget.room()
    }

    /// Sequence number the next receive gets.
    #[inline]
    pub fn next_seq(&self) -> u64 {
        self.cts.next()
    }

    /// CTS slots written so far (all below this).
    #[inline]
    pub fn cts_written(&self) -> u64 {
        self.cts.written()
    }

    /// The lanes the next receive's writes will use: `(seq, first QP, count)`
    /// (a transport that must prepare for them before advertising, iWARP's
    /// notice receives, asks before `Receiver::take_recv`).
    #[inline]
    pub fn next_lanes(&self) -> (u64, usize, usize) {
        let seq = self.cts.next();
        let (first, n) = fifo::lanes(seq, self.nqps, self.split);
        (seq, first, n)
    }

    /// Receives waiting for a rendezvous completion (their FIFO slots busy).
    #[inline]
    pub fn in_flight(&self) -> usize {
        self.by_slot.iter().filter(|s| s.is_some()).count()
    }

    /// May the next receive take its FIFO slot (its previous receive
    /// completed, and that one's CTS went out)?
    #[inline]
    pub fn slot_free(&self) -> bool {
        let slot = (self.cts.next() % FIFO_DEPTH as u64) as usize;
        self.by_slot[slot].is_none() && self.cts.can_post()
    }

    /// Would `Receiver::take_recv` take a receive now?
    #[inline]
    pub fn can_take(&self) -> bool {
        self.slot_free() && self.reqs.len() < RECV_POOL - MAX_REQUESTS
    }

    /// Write every CTS posted so far as soon as there is room (a receive
    /// waits for its slot, or the receiver is idle).
    #[inline]
    pub(crate) fn force_cts(&mut self) {
        self.cts.force();
    }

    /// Post a (grouped) receive of `elems` (one CTS element per buffer, 1..=
    /// MAX_RECVS, `n`/`i` filled in). `Ok(None)`: not now (its slot is busy,
    /// see [`Receiver::slot_free`], or the request slots are). Messages that
    /// arrived before their buffer are handed to `deliver` before this returns.
    pub(crate) fn take_recv(&mut self, elems: &[Cts], deliver: &mut impl FnMut(&Deliver)) -> Result<Option<Taken>, ProtoError> {
        let n = elems.len();
        assert!((1..=MAX_RECVS).contains(&n));
        if !self.can_take() {
            return Ok(None);
        }
        let seq = self.cts.next();
        let slot = (seq % FIFO_DEPTH as u64) as usize;
        let (first, nlanes) = fifo::lanes(seq, self.nqps, self.split);
        let mut caps = [0usize; MAX_RECVS];
        let mut dst = [0u64; MAX_RECVS];
        let mut tags = [0i32; MAX_RECVS];
        for (i, c) in elems.iter().enumerate() {
            caps[i] = c.cap as usize;
            dst[i] = c.addr;
            tags[i] = c.tag;
        }
        let req =
            Req { flush: false, seq, n, caps, dst, lanes_left: nlanes, got: 0, imm: None, sizes: [0; MAX_RECVS], filled: 0, done: false };
        let Some(id) = self.reqs.alloc(req) else { return Ok(None) };
        let keep = keep(seq);
        self.cts_store[keep][..n].copy_from_slice(elems);
        self.slot_n[keep] = n as u8;
        self.by_slot[slot] = Some((seq, id));
        let mut deferrable = false;
        let mut js = [None; MAX_RECVS];
        if let Some(e) = &mut self.eager {
            e.st.assign(seq, &tags[..n], &mut js[..n]);
            // only eager messages can fill it: its CTS may wait for a batch
            // (once the ring exists: before, nothing can come eagerly, and
            // the first such receive asks for a late ring to be made)
            let eager_only = seq > 0 && js[..n].iter().all(Option::is_some) && caps[..n].iter().all(|&c| c <= e.st.max);
            deferrable = e.made && eager_only;
            e.wanted |= eager_only;
            for (i, j) in js[..n].iter().enumerate() {
                if let Some(j) = *j {
                    e.by_j[(j % JWIN as u64) as usize] = Some((j, id, i as u8));
                }
            }
        }
        // messages that arrived before their buffer was posted
        for j in js[..n].iter().flatten() {
            let early = self.eager.as_mut().and_then(|e| e.st.take_early(*j));
            if let Some(idx) = early {
                let size = self.eager.as_ref().map_or(0, |e| e.early_size[(idx % RING_SLOTS as u64) as usize]);
                self.deliver(idx, *j, size, deliver)?;
            }
        }
        self.cts.push(deferrable);
        Ok(Some(Taken { id, seq, first, nlanes }))
    }

    /// Count eager message `idx` (`size` bytes) into buffer `j` and hand its copy out.
    fn deliver(&mut self, idx: u64, j: u64, size: u32, deliver: &mut impl FnMut(&Deliver)) -> Result<(), ProtoError> {
        let Some(e) = &mut self.eager else { return Ok(()) };
        let w = (j % JWIN as u64) as usize;
        let Some((_, id, i)) = e.by_j[w].filter(|x| x.0 == j) else {
            return Err(ProtoError::EagerUnposted { idx, j });
        };
        e.by_j[w] = None;
        let i = i as usize;
        let Ok(r) = self.reqs.get_mut(id) else { return Err(ProtoError::EagerUnposted { idx, j }) };
        if r.filled & (1 << i) != 0 {
            return Err(ProtoError::EagerTwice { idx, i, seq: r.seq });
        }
        let size = size as usize;
        if size > r.caps[i] {
            return Err(ProtoError::EagerOverflow { size, cap: r.caps[i], seq: r.seq, i });
        }
        deliver(&Deliver { idx, src: eager::slot_offset(idx, e.st.max) + HDR_BYTES, dst: r.dst[i], len: size, id, i });
        r.sizes[i] = size;
        r.filled |= 1 << i;
        e.st.release(idx);
        self.eager_stats.0 += 1;
        self.eager_stats.1 += size as u64;
        if r.all_filled() {
            r.done = true;
            let slot = (r.seq % FIFO_DEPTH as u64) as usize;
            if self.by_slot[slot].is_some_and(|(s, _)| s == r.seq) {
                self.by_slot[slot] = None;
            }
        }
        Ok(())
    }

    /// Look at the eager ring (`ring`: the region the sender writes, mailbox
    /// word first): act on the mailbox, take every message that fully
    /// landed, hand the copies of those whose buffer is posted to
    /// `deliver`, and plan the credit write when one is due. Returns how
    /// many messages were taken, and whether a control write became due
    /// (the mailbox said the sender waits, or slots freed since, by a
    /// receive that copied early messages out, make a credit due) even when
    /// none was taken. Nothing to do without the eager path.
    pub(crate) fn poll_ring(
        &mut self,
        ring: &(impl Mem + ?Sized),
        deliver: &mut impl FnMut(&Deliver),
    ) -> Result<(usize, bool), ProtoError> {
        let Some(e) = &mut self.eager else { return Ok((0, false)) };
        let max = e.st.max;
        let mut force = false;
        let mb = ring.read_u64(0);
        if mb != 0 && mb != e.mailbox {
            e.mailbox = mb;
            self.cts.sender_waiting(mb - 1);
            force = true;
        }
        let mut taken = 0;
        while let Some(e) = &mut self.eager {
            let idx = e.st.next();
            let off = eager::slot_offset(idx, max);
            if ring.read_u64(off + HDR_BYTES - 8) != eager::marker(idx) {
                break;
            }
            let mut hb = [0u8; HDR_BYTES];
            ring.read(off, &mut hb);
            let Some(h) = Header::decode(&hb, idx) else { break };
            if h.size as usize > max {
                return Err(ProtoError::EagerSize { idx, size: h.size, max });
            }
            if ring.read_u64(off + eager::wire_len(h.size as usize) - 8) != eager::marker(idx) {
                break; // the payload is still landing
            }
            let to = e.st.arrived(&h)?;
            taken += 1;
            self.cts.sender_head(h.head);
            match to {
                Arrival::Posted(j) => self.deliver(idx, j, h.size, deliver)?,
                Arrival::Early => {
                    if let Some(e) = &mut self.eager {
                        e.early_size[(idx % RING_SLOTS as u64) as usize] = h.size;
                    }
                }
            }
        }
        // hand ring slots back when due (anything freed, when the sender waits)
        let mut due = force;
        if let Some(v) = self.eager.as_ref().and_then(|e| e.st.credits_due(force)) {
            // deferred CTS go along (the same post)
            self.cts.force();
            self.credit = Some(v);
            due = true;
        }
        Ok((taken, due))
    }

    /// A completion word arrived (a WRITE_WITH_IMM's immediate, or an iWARP
    /// notice's word) on our QP `qp`: which receive, and on its last lane
    /// the sizes. `sizes_slot` reads the sizes the sender wrote for a
    /// grouped receive (the sizes area on IB/RoCE, the notice on iWARP); it
    /// is called only when the word says so.
    pub(crate) fn on_imm(
        &mut self,
        word: u32,
        qp: Option<usize>,
        sizes_slot: impl FnOnce(u64) -> [u32; MAX_RECVS],
    ) -> Result<ImmEvent, ProtoError> {
        let imm = Imm::decode(word)?;
        let slot = imm.slot as usize;
        let Some((seq, id)) = self.by_slot[slot] else {
            return Err(ProtoError::ImmNoReceive { slot, imm: format!("{imm:?}") });
        };
        let nqps = self.nqps;
        let (first, nlanes) = fifo::lanes(seq, nqps, self.split);
        let Ok(r) = self.reqs.get_mut(id) else { return Err(ProtoError::ImmNoReceive { slot, imm: format!("{imm:?}") }) };
        // the lane: the QP it came on (a message on one QP has one lane)
        let lane = match qp {
            _ if nlanes == 1 => 0,
            Some(q) => (q + nqps - first) % nqps,
            None => (!r.got).trailing_zeros() as usize,
        };
        let bit = 1u128 << lane.min(127);
        if r.lanes_left == 0 || lane >= nlanes || r.got & bit != 0 {
            return Err(ProtoError::ImmExtra { seq });
        }
        r.got |= bit;
        r.lanes_left -= 1;
        if !matches!(r.imm, Some(ImmKind::Fail(_))) {
            r.imm = Some(imm.kind);
        }
        let n = r.n;
        if r.lanes_left > 0 {
            return Ok(ImmEvent { id, seq, sizes: None, n });
        }
        let kind = r.imm.unwrap_or(imm.kind);
        let rseq = r.seq;
        let sizes = fifo::sizes_from_imm(kind, &r.caps[..n], || sizes_slot(rseq))?;
        for (i, s) in sizes[..n].iter().enumerate() {
            if let Some(s) = *s {
                if r.filled & (1 << i) != 0 {
                    return Err(ProtoError::BothWays { i, seq });
                }
                r.sizes[i] = s;
                r.filled |= 1 << i;
            }
        }
        if r.all_filled() {
            r.done = true;
            self.by_slot[slot] = None;
        }
        // the sender moved past this slot
        self.cts.sender_head(seq + 1);
        Ok(ImmEvent { id, seq, sizes: Some(std::array::from_fn(|i| sizes[i].unwrap_or(0))), n })
    }

    /// Will `Receiver::poll_ctl` plan anything now? A cheap test for the
    /// polling loop: false when no CTS is due (deferred ones wait for their
    /// batch), no credit, no ring address and no chain is pending, or
    /// before READY.
    #[inline]
    pub fn has_ctl(&self) -> bool {
        self.ready
            && (self.credit.is_some()
                || self.batch.is_some()
                || self.cts.due().is_some()
                || self.eager.as_ref().is_some_and(|e| e.announce))
    }

    /// A late eager ring not made yet: the sender's request is what to look for.
    #[inline]
    pub fn ring_missing(&self) -> bool {
        self.eager.as_ref().is_some_and(|e| !e.made)
    }

    /// After a fault: a late ring made, its address written again (the
    /// write may have been lost with the old QPs).
    pub(crate) fn reannounce_ring(&mut self) {
        if let Some(e) = self.eager.as_mut().filter(|e| e.late && e.made) {
            e.announce = true;
        }
    }

    /// A late ring not made yet that our own receives want (one only eager
    /// messages could fill was posted): make it without waiting for the
    /// sender to ask.
    #[inline]
    pub fn ring_wanted(&self) -> bool {
        self.eager.as_ref().is_some_and(|e| !e.made && e.wanted)
    }

    /// The late ring was made at `addr` (`rkey`): stage its address for
    /// the sender ([`RingAnn`] at [`RING_ANN_OFF`] of `stage`); it goes with
    /// the next control writes, and eager-only receives may be deferred
    /// from now on.
    pub(crate) fn ring_made(&mut self, stage: &mut (impl MemMut + ?Sized), addr: u64, rkey: u32) {
        let Some(e) = self.eager.as_mut().filter(|e| !e.made) else { return };
        stage.write(RING_ANN_OFF, &RingAnn { addr, rkey, max: e.st.max as u32 }.encode());
        e.made = true;
        e.announce = true;
    }

    /// Is a credit write planned (the ring poll found credits due)?
    #[inline]
    pub fn credit_due(&self) -> bool {
        self.credit.is_some()
    }

    /// The credit counter last written to the sender (0 without the eager path).
    #[inline]
    pub fn credits_reported(&self) -> u64 {
        self.eager.as_ref().map_or(0, |e| e.st.reported_value())
    }

    /// Plan the next chain of control writes due now (CTS slots in order,
    /// the credit word), writing their bytes into `stage` (same layout as
    /// the sender's FIFO region). Call until it returns false, posting each
    /// chain before the next call. Nothing before `Receiver::on_ready`.
    /// (iWARP's gate, enough notice receives for what a CTS allows, is
    /// applied before a receive is taken, not here: a taken receive's CTS
    /// may always go.)
    pub(crate) fn poll_ctl(&mut self, stage: &mut (impl MemMut + ?Sized), out: &mut CtlChain) -> bool {
        out.qp = 0;
        out.n = 0;
        if !self.ready {
            self.credit = None;
            return false;
        }
        // a late ring's address first: nothing eager can come before it lands
        if self.eager.as_ref().is_some_and(|e| e.announce) && self.budget.has_room() {
            if let Some(e) = &mut self.eager {
                e.announce = false;
            }
            self.push(out, RING_ANN_OFF, RING_ANN_BYTES);
        }
        if self.batch.is_none() {
            self.batch = self.start_batch(stage);
            if let Some(b) = self.batch {
                // the first elements of the range are contiguous: one write
                let from = self.cts.written();
                self.push(out, fifo::slot_offset(from), (b.end - from) as usize * ELEM_BYTES);
            }
        }
        if let Some(mut b) = self.batch {
            // each further element of a grouped receive: one write more
            while b.q < b.end {
                let n = self.slot_n[keep(b.q)] as usize;
                while b.i < n {
                    if out.n == CHAIN {
                        self.batch = Some(b);
                        return true;
                    }
                    self.push(out, fifo::elem_offset(b.q, b.i), ELEM_BYTES);
                    b.i += 1;
                }
                b.q += 1;
                b.i = 1;
            }
            if out.n < CHAIN {
                if let Some(v) = self.credit.take() {
                    self.push_credit(stage, out, v);
                }
            }
            self.cts.wrote(b.end);
            self.batch = None;
            return true;
        }
        // nothing (more) to write now: the credit word alone, if it fits
        if let Some(v) = self.credit.take() {
            if self.budget.has_room() {
                self.push_credit(stage, out, v);
                return true;
            }
        }
        out.n > 0
    }

    /// The next range of CTS slots to write, staged: those of one lap that
    /// the send queue has room for (first elements one write, each further
    /// element one more, the credit word one).
    fn start_batch(&mut self, stage: &mut (impl MemMut + ?Sized)) -> Option<Batch> {
        let (from, to) = self.cts.due()?;
        let lap_end = to.min((from / FIFO_DEPTH as u64 + 1) * FIFO_DEPTH as u64);
        let mut room = self.budget.room().checked_sub(1 + self.credit.is_some() as usize)?;
        let mut end = from;
        while end < lap_end {
            let more = self.slot_n[keep(end)] as usize - 1;
            if more > room {
                break;
            }
            room -= more;
            end += 1;
        }
        if end == from {
            return None; // retried once completions free the queue
        }
        for q in from..end {
            let k = keep(q);
            for i in 0..self.slot_n[k] as usize {
                stage.write(fifo::elem_offset(q, i), &self.cts_store[k][i].encode(q));
            }
        }
        Some(Batch { end, q: from, i: 1 })
    }

    fn push(&mut self, out: &mut CtlChain, off: usize, len: usize) {
        out.wrs[out.n] = CtlWr { off, len, signal: self.budget.post() };
        out.n += 1;
    }

    fn push_credit(&mut self, stage: &mut (impl MemMut + ?Sized), out: &mut CtlChain, v: u64) {
        stage.write(CREDIT_OFF, &v.to_le_bytes());
        self.push(out, CREDIT_OFF, 8);
        if let Some(e) = &mut self.eager {
            e.st.reported(v);
        }
    }

    /// A signaled control write planned with `signal: Some(count)` completed.
    #[inline]
    pub(crate) fn on_ctl_done(&mut self, count: u64) {
        self.budget.retire(count);
    }

    /// Is request `id` done?
    #[inline(always)]
    pub fn is_done(&self, id: ReqId) -> Result<bool, Stale> {
        self.reqs.get(id).map(|r| r.done)
    }

    /// Where this side stands, for the peer of a recovering connection
    /// (taken once the QPs stopped and every completion word that landed
    /// was read).
    pub fn restart_point(&self) -> RxPoint {
        let mut p = RxPoint { cts_written: self.cts.written(), next_seq: self.cts.next(), ..RxPoint::default() };
        if let Some(e) = &self.eager {
            p.eager_next = e.st.next();
            p.credit = e.st.freed();
        }
        for (seq, id) in self.by_slot.iter().flatten() {
            let got = self.reqs.get(*id).map_or(0, |r| r.got);
            p.inflight[p.n] = InflightRecv { seq: *seq, got };
            p.n += 1;
        }
        p
    }

    /// If `id` is done: free it and say what it got.
    #[inline]
    pub(crate) fn finish(&mut self, id: ReqId) -> Result<Option<Finished>, Stale> {
        let r = self.reqs.get(id)?;
        if !r.done {
            return Ok(None);
        }
        let mut f = Finished { n: if r.flush { 0 } else { r.n }, sizes: [0; MAX_RECVS] };
        f.sizes[..r.n].copy_from_slice(&r.sizes[..r.n]);
        self.reqs.release(id)?;
        Ok(Some(f))
    }

    /// Free `id` unfinished (the comm failed; NCCL is told so).
    #[inline]
    pub(crate) fn abandon(&mut self, id: ReqId) {
        if let Ok(r) = self.reqs.release(id) {
            let slot = (r.seq % FIFO_DEPTH as u64) as usize;
            if !r.flush && self.by_slot[slot].is_some_and(|(s, _)| s == r.seq) {
                self.by_slot[slot] = None;
            }
        }
    }

    /// A flush request (completed by `Receiver::on_flush_done`); `None`
    /// only if the pool is full, which the receive limit rules out.
    pub(crate) fn add_flush(&mut self) -> Option<ReqId> {
        let req = Req {
            flush: true,
            seq: u64::MAX,
            n: 0,
            caps: [0; MAX_RECVS],
            dst: [0; MAX_RECVS],
            lanes_left: 0,
            got: 0,
            imm: None,
            sizes: [0; MAX_RECVS],
            filled: 0,
            done: false,
        };
        self.reqs.alloc(req)
    }

    /// The flush read of `id` completed.
    #[inline]
    pub(crate) fn on_flush_done(&mut self, id: ReqId) {
        if let Ok(r) = self.reqs.get_mut(id) {
            r.done = true;
        }
    }
}

#[cfg(test)]
mod tests;
