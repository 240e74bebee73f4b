//! The verbs sender as a state machine (quinn-proto style): it owns the send
//! requests, the FIFO head and the group being filled, the messages in
//! flight per FIFO slot, the eager ring's sender side and the mailbox timer.
//! The transport (`transport::ib::entry`, with `p2p`'s executor) hands it
//! the FIFO memory the receiver writes, the sends NCCL posts, the
//! completions of its writes and the time; it posts what the machine plans:
//! a complete group's writes (built with [`crate::fifo::plan_lane`]), an
//! eager write, a mailbox write. No I/O, no clock, no allocation after
//! [`Sender::new`] (the text of a mismatch excepted, which fails the comm).
//!
//! Rules kept here:
//! - a CTS slot is taken only when every element of it landed with the
//!   marker of its sequence number and the elements agree on the count;
//! - a slot is reused only after the previous lap's writes completed;
//! - the k-th send of a tag fills the k-th buffer posted with that tag,
//!   eagerly (ring slot, credits permitting) or by rendezvous, never both;
//! - a sender stuck at one FIFO head for [`Config::mailbox_after`] writes
//!   that head into the receiver's mailbox, once per head.
use std::time::{Duration, Instant};

use crate::eager::{self, EagerTx, RingAnn, HDR_BYTES, RING_ANN_BYTES, RING_ANN_OFF, RING_REQ, RING_REQ_OFF, RING_SLOTS};
use crate::error::ProtoError;
use crate::fifo::{self, Cts, FailCode, Group, SendFifo, Slot, ELEM_BYTES, FIFO_BYTES, FIFO_DEPTH};
use crate::mem::{Mem, MemMut};
use crate::pool::{Pool, ReqId, Stale};
use crate::recover::TxPoint;
use crate::{MAX_RECVS, MAX_REQUESTS};

mod drive;

/// Sends still possible per comm: NCCL may post MAX_REQUESTS x maxRecvs.
pub const SEND_SLOTS: usize = MAX_REQUESTS * MAX_RECVS;
/// A sender stuck this long at one CTS slot tells the receiver (mailbox).
pub const MAILBOX_AFTER: Duration = Duration::from_millis(1);
/// Signal one eager write in this many.
pub const EAGER_SIGNAL: usize = 16;
/// Eager-path writes QP 0 may hold (part of its send queue).
pub const EAGER_SQ: usize = 2 * eager::RING_SLOTS;

/// How the connection was set up.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// QPs (lanes).
    pub nqps: usize,
    /// Messages split over all QPs (else rotated).
    pub split: bool,
    /// Eager limit both ends agreed on (0: no eager path).
    pub eager: usize,
    /// How long a blocked sender waits before it writes the mailbox.
    pub mailbox_after: Duration,
    /// The receiver's eager ring comes late (both ends said so): no eager
    /// write before its address arrived, which the first send that could go
    /// eagerly asks for ([`crate::eager`]).
    pub late_ring: bool,
}

/// Where the head FIFO slot stands (`Sender::head`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    /// The slot's previous lap still awaits its completions (poll, retry).
    Busy,
    /// Its CTS has not (fully) landed.
    NotYet,
    /// Loaded: sends can match it.
    Ready,
}

/// What a send did (`Sender::send`).
#[derive(Debug, Clone)]
pub enum Sent {
    /// Matched a buffer; `group` is the slot, complete now: post its writes,
    /// then `Sender::on_posted`.
    Taken {
        /// The send's request.
        id: ReqId,
        /// The complete group, if this send completed it.
        group: Option<Group>,
    },
    /// Every request slot is busy: not now.
    Full,
    /// The head receive has no free buffer of this tag: not yet.
    NoTag,
    /// The send does not fit the buffer its tag matched: post `group`'s
    /// writes with `code` (the receiver fails that receive) and fail.
    Mismatch {
        /// The abandoned group.
        group: Group,
        /// Told to the receiver.
        code: FailCode,
        /// For the error.
        what: String,
    },
}

/// One eager write to post on QP 0 (`Sender::plan_eager`): `len` bytes at
/// `off` of the staging (header and trailer written, the payload to copy to
/// `off + HDR_BYTES` first) to the same offset of the receiver's ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EagerWr {
    /// The send's request (done already: the bytes are copied); `None`
    /// when it is written again after a fault (the staging holds it).
    pub id: Option<ReqId>,
    /// Ring index.
    pub idx: u64,
    /// Offset in staging and ring.
    pub off: usize,
    /// Bytes on the wire.
    pub len: usize,
    /// Eager-path WRs its completion frees (when signaled): put it in the wr_id.
    pub count: u64,
    /// Signal it.
    pub signaled: bool,
}

/// What the eager path says about a send (`Sender::plan_eager`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EagerPlan {
    /// Not eagerly (tag, size, credits, request slots, or no eager path).
    No,
    /// The eager part of QP 0's send queue is full: poll completions, ask again.
    Full,
    /// Post this.
    Go(EagerWr),
}

/// A signaled 8-byte write of staging offset 0 to the receiver's mailbox
/// (ring offset 0); `count` goes in the wr_id like an eager write's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MailboxWr {
    /// Eager-path WRs its completion frees.
    pub count: u64,
    /// The head it reports (+1).
    pub value: u64,
}

/// A signaled 8-byte write of [`RING_REQ`], staged at [`RING_REQ_OFF`] of
/// the sizes staging, to the same offset of the receiver's sizes area: the
/// sender asks for a late eager ring. `count` goes in the wr_id like an
/// eager write's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingRequestWr {
    /// Eager-path WRs its completion frees.
    pub count: u64,
}

/// Where a late eager ring stands, seen from the sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxRing {
    /// Known (given at connect, or announced): eager writes may go.
    Known,
    /// Not asked for yet.
    Unasked,
    /// Asked for; its address has not arrived.
    Asked,
}

/// A data write of slot `seq` completed (`Sender::on_write_done`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteDone {
    /// The sends of the group (`n` entries, `None` for eager elements).
    pub reqs: [Option<ReqId>; MAX_RECVS],
    /// Elements.
    pub n: usize,
    /// The group's last lane: its sends are done.
    pub last: bool,
}

/// What a resume resent (`Sender::resume`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Replayed {
    /// Lanes of rendezvous messages written again.
    pub lanes: u64,
    /// Eager messages written again.
    pub eager: u64,
    /// Payload bytes of both.
    pub bytes: u64,
    /// Lanes the receiver had but whose completion the sender never saw.
    pub confirmed: u64,
}

#[derive(Debug, Clone, Copy)]
struct SendReq {
    size: usize,
    done: bool,
}

/// A posted group whose lanes have not all completed: kept whole, so a
/// resume after a fault can post the lanes the receiver lacks again (the
/// sends' buffers stay NCCL's until then: a send is done only when every
/// lane of its group is known to have landed).
#[derive(Debug, Clone)]
struct Inflight {
    g: Group,
    nlanes: usize,
    /// Lanes known landed (their completion, or the receiver's word at a resume).
    done: u128,
    active: bool,
}

impl Inflight {
    fn all(&self) -> u128 {
        lanes_mask(self.nlanes)
    }
}

/// The bits of lanes `0..n`.
#[inline]
pub fn lanes_mask(n: usize) -> u128 {
    if n >= 128 {
        u128::MAX
    } else {
        (1u128 << n) - 1
    }
}

struct EagerState {
    st: EagerTx,
    /// Eager-path WRs on QP 0 whose SQ entries are not known free yet.
    pending: usize,
    /// Unsignaled eager writes since the last signaled one.
    quiet: usize,
    /// Stuck at this FIFO head since then.
    blocked: Option<(u64, Instant)>,
    /// Last mailbox value written (head + 1).
    mailbox: u64,
    /// The receiver's ring.
    ring: TxRing,
    /// Last head an empty probe write was posted for (+ 1): a late ring
    /// not known yet, and stuck.
    probed: u64,
    /// Bytes on the wire of each ring slot's message (for a resend).
    wire_len: [u32; RING_SLOTS],
}

/// The sending end's protocol state.
pub struct Sender {
    nqps: usize,
    split: bool,
    mailbox_after: Duration,
    fifo: SendFifo,
    reqs: Pool<SendReq>,
    inflight: Box<[Inflight; FIFO_DEPTH]>,
    eager: Option<EagerState>,
    eager_stats: (u64, u64),
    /// Where the CQ is read into ([`crate::nic::CqBuf`]).
    cqes: drive::CqBuf,
}

impl Default for Sender {
    fn default() -> Self {
        Sender::new()
    }
}

impl Sender {
    /// Before the connection is set up: no QPs, nothing sendable.
    pub fn new() -> Sender {
        Sender {
            nqps: 1,
            split: false,
            mailbox_after: MAILBOX_AFTER,
            fifo: SendFifo::new(),
            reqs: Pool::new(SEND_SLOTS),
            inflight: Box::new(std::array::from_fn(|_| Inflight { g: Group::default(), nlanes: 0, done: 0, active: false })),
            eager: None,
            eager_stats: (0, 0),
            cqes: drive::NO_CQES,
        }
    }

    /// The connection is set up.
    pub fn connected(&mut self, cfg: Config) {
        assert!(cfg.nqps >= 1);
        self.nqps = cfg.nqps;
        self.split = cfg.split;
        self.mailbox_after = cfg.mailbox_after;
        let ring = if cfg.late_ring { TxRing::Unasked } else { TxRing::Known };
        self.eager = (cfg.eager > 0).then(|| EagerState {
            st: EagerTx::new(cfg.eager),
            pending: 0,
            quiet: 0,
            blocked: None,
            mailbox: 0,
            ring,
            probed: 0,
            wire_len: [0; RING_SLOTS],
        });
    }

    /// Is the eager path on?
    #[inline]
    pub fn eager_on(&self) -> bool {
        self.eager.is_some()
    }

    /// Is the receiver's eager ring known (eager writes may go)? False
    /// without the eager path.
    #[inline]
    pub fn ring_known(&self) -> bool {
        self.eager.as_ref().is_some_and(|e| e.ring == TxRing::Known)
    }

    /// A late ring's address, if the receiver's announcement landed in
    /// `fifo_mem` (the FIFO region). An error if it names another limit
    /// than the one agreed, or no ring.
    pub(crate) fn read_ring_ann(&self, fifo_mem: &(impl Mem + ?Sized)) -> Result<Option<RingAnn>, ProtoError> {
        let Some(e) = self.eager.as_ref().filter(|e| e.ring != TxRing::Known) else { return Ok(None) };
        if fifo_mem.read_u64(RING_ANN_OFF + RING_ANN_BYTES - 8) != eager::RING_ANN_MARKER {
            return Ok(None);
        }
        let mut b = [0u8; RING_ANN_BYTES];
        fifo_mem.read(RING_ANN_OFF, &mut b);
        let Some(a) = RingAnn::decode(&b) else { return Ok(None) };
        if a.max as usize != e.st.max || a.addr == 0 {
            return Err(ProtoError::EagerRing { addr: a.addr, max: a.max, agreed: e.st.max });
        }
        Ok(Some(a))
    }

    /// After a fault: a late ring asked for but not known is asked for again
    /// (the request may have been lost with the old QPs; a second one is
    /// harmless), and a stuck head may be probed again.
    pub(crate) fn resume_late_ring(&mut self) {
        if let Some(e) = &mut self.eager {
            if e.ring == TxRing::Asked {
                e.ring = TxRing::Unasked;
            }
            e.probed = 0;
        }
    }

    /// The late ring's address arrived and our staging is ready: eager
    /// writes may go from now on.
    pub(crate) fn on_ring(&mut self) {
        if let Some(e) = &mut self.eager {
            e.ring = TxRing::Known;
        }
    }

    /// A send of `tag`/`size` found no CTS: if the late ring was never
    /// asked for and this send could have gone eagerly, ask now (the
    /// request word is staged at [`RING_REQ_OFF`] of `stage`, the sizes
    /// staging). The send itself waits for its CTS.
    pub(crate) fn plan_ring_request(&mut self, tag: i32, size: usize, stage: &mut (impl MemMut + ?Sized)) -> Option<RingRequestWr> {
        let e = self.eager.as_mut().filter(|e| e.ring == TxRing::Unasked)?;
        if e.st.tag() != Some(tag) || size > e.st.max {
            return None;
        }
        stage.write(RING_REQ_OFF, &RING_REQ.to_le_bytes());
        let count = e.quiet as u64 + 1;
        e.pending += 1;
        e.quiet = 0;
        e.ring = TxRing::Asked;
        Some(RingRequestWr { count })
    }

    /// Eager messages sent and their payload bytes.
    #[inline]
    pub fn eager_stats(&self) -> (u64, u64) {
        self.eager_stats
    }

    /// Live requests.
    #[inline]
    pub fn live(&self) -> usize {
        self.reqs.len()
    }

    /// Can another send be taken (a request slot is free)?
    #[inline]
    pub fn has_room(&self) -> bool {
        self.reqs.len() < SEND_SLOTS
    }

    /// Sequence number of the head FIFO slot.
    #[inline]
    pub fn head_seq(&self) -> u64 {
        self.fifo.head()
    }

    /// The receiver's credit counter, read from the word after the FIFO
    /// (0 without the eager path). Read it before `Sender::head`: the
    /// receiver writes CTS before credits on the same QP, so every CTS that
    /// came before these credits is then loaded, and the head an eager
    /// message reports is as fresh as the credits it spends.
    pub fn read_credits(&self, fifo_mem: &(impl Mem + ?Sized)) -> u64 {
        if self.eager.is_some() {
            fifo_mem.read_u64(FIFO_BYTES)
        } else {
            0
        }
    }

    /// Bring the head FIFO slot to where a send can match it: its previous
    /// lap completed and its CTS landed (`fifo_mem`: the FIFO region the
    /// receiver writes). Slots every buffer of which already got an eager
    /// message are stepped over.
    pub(crate) fn head(&mut self, fifo_mem: &(impl Mem + ?Sized)) -> Result<Head, ProtoError> {
        loop {
            if self.head_busy() {
                return Ok(Head::Busy);
            }
            if !self.load_head(fifo_mem)? {
                return Ok(Head::NotYet);
            }
            if self.fifo.current().is_some_and(|g| g.complete()) {
                // every buffer of the slot already got an eager message: nothing to write
                self.fifo.advance();
                continue;
            }
            return Ok(Head::Ready);
        }
    }

    /// Does the head slot's previous lap still await its completions?
    #[inline]
    pub fn head_busy(&self) -> bool {
        self.inflight[(self.fifo.head() % FIFO_DEPTH as u64) as usize].active
    }

    /// Take the head slot if all of it landed; true when a group is loaded.
    fn load_head(&mut self, mem: &(impl Mem + ?Sized)) -> Result<bool, ProtoError> {
        if self.fifo.current().is_some() {
            return Ok(true);
        }
        let seq = self.fifo.head();
        if mem.read_u64(fifo::elem_offset(seq, 0) + fifo::MARKER_OFFSET) != fifo::marker(seq) {
            return Ok(false);
        }
        let mut elems = [Cts::default(); MAX_RECVS];
        let mut b = [0u8; ELEM_BYTES];
        let mut n = 1;
        let mut i = 0;
        while i < n {
            let off = fifo::elem_offset(seq, i);
            if mem.read_u64(off + fifo::MARKER_OFFSET) != fifo::marker(seq) {
                return Ok(false); // the rest of the slot is still landing
            }
            mem.read(off, &mut b);
            match Cts::decode(&b, seq, i) {
                Slot::Ready(c) => {
                    n = c.n as usize;
                    elems[i] = c;
                }
                Slot::NotYet => return Ok(false),
                Slot::Bad(why) => return Err(why),
            }
            i += 1;
        }
        if elems[..n].iter().any(|e| e.n as usize != n) {
            return Err(ProtoError::CtsCount { seq });
        }
        let mut filled = 0;
        if let Some(e) = &mut self.eager {
            let mut tags = [0i32; MAX_RECVS];
            for (t, c) in tags.iter_mut().zip(&elems[..n]) {
                *t = c.tag;
            }
            filled = e.st.on_load(seq, &tags[..n]);
        }
        self.fifo.load(&elems[..n], filled);
        Ok(true)
    }

    /// The capacity of the buffer a send of `tag` would fill next (head
    /// loaded, [`Head::Ready`]); `None`: the head receive has no free buffer
    /// of that tag.
    #[inline]
    pub(crate) fn peek_cap(&self, tag: i32) -> Option<usize> {
        let g = self.fifo.current()?;
        self.fifo.match_send(tag, 0).ok().map(|i| g.elems[i].cap as usize)
    }

    /// A send of `size` bytes from `src` (local key `lkey`) with `tag`,
    /// against the loaded head ([`Head::Ready`]).
    #[inline]
    pub(crate) fn send(&mut self, tag: i32, size: usize, src: u64, lkey: u32) -> Sent {
        match self.fifo.match_send(tag, size) {
            Ok(i) => {
                let Some(id) = self.reqs.alloc(SendReq { size, done: false }) else { return Sent::Full };
                if let Some(e) = &mut self.eager {
                    e.st.on_rendezvous(tag);
                    e.blocked = None;
                }
                let group = if self.fifo.record(i, size, src, lkey, id) { self.fifo.advance() } else { None };
                Sent::Taken { id, group }
            }
            // As NCCL's IB transport does: a tag the head receive has no free
            // buffer for is "not yet", not an error (with shared comms the
            // next step of one rank can arrive before another rank's send
            // completes the current group).
            Err(m) if m.code == FailCode::NoTag => Sent::NoTag,
            Err(m) => {
                let group = self.fifo.advance().expect("a mismatch against a loaded slot");
                Sent::Mismatch { group, code: m.code, what: m.what }
            }
        }
    }

    /// `g`'s writes were posted on its lanes (`nlanes` of them, each ending
    /// with a signaled write). Its sends are done when every lane completed.
    #[inline]
    pub(crate) fn on_posted(&mut self, g: &Group, nlanes: usize) {
        let f = &mut self.inflight[(g.seq % FIFO_DEPTH as u64) as usize];
        f.g.clone_from(g);
        f.nlanes = nlanes;
        f.done = 0;
        f.active = true;
    }

    /// Which QPs slot `seq`'s writes use: `(first, count)`.
    #[inline]
    pub fn lanes(&self, seq: u64) -> (usize, usize) {
        fifo::lanes(seq, self.nqps, self.split)
    }

    /// The signaled last write of a lane of slot `seq` completed on our QP
    /// `qp`. `None`: not a write this machine waits for (an old lap's, or a
    /// lane already known landed).
    #[inline]
    pub(crate) fn on_write_done(&mut self, seq: u64, qp: usize) -> Option<WriteDone> {
        let (first, _) = self.lanes(seq);
        let nqps = self.nqps;
        let f = &mut self.inflight[(seq % FIFO_DEPTH as u64) as usize];
        if !f.active || f.g.seq != seq {
            return None;
        }
        let lane = if f.nlanes == 1 { 0 } else { (qp + nqps - first) % nqps };
        let bit = 1u128 << lane.min(127);
        if lane >= f.nlanes || f.done & bit != 0 {
            return None;
        }
        f.done |= bit;
        let last = f.done == f.all();
        let (reqs, n) = (f.g.reqs, f.g.n);
        if last {
            self.finish_group((seq % FIFO_DEPTH as u64) as usize);
        }
        Some(WriteDone { reqs, n, last })
    }

    /// Every lane of the group in `slot` landed: its sends are done and the
    /// slot may take its next lap.
    fn finish_group(&mut self, slot: usize) {
        let f = &mut self.inflight[slot];
        f.active = false;
        let (reqs, n) = (f.g.reqs, f.g.n);
        for r in reqs[..n].iter().flatten() {
            if let Ok(q) = self.reqs.get_mut(*r) {
                q.done = true;
            }
        }
    }

    /// Where this side stands, for the peer of a recovering connection
    /// (taken once the QPs stopped and every completion was read).
    pub fn restart_point(&self) -> TxPoint {
        let (eager_posted, mailbox) = self.eager.as_ref().map_or((0, 0), |e| (e.st.posted(), e.mailbox));
        TxPoint { fifo_head: self.fifo.head(), eager_posted, mailbox }
    }

    /// Should a send of `tag`/`size` go into the receiver's ring now, with
    /// `freed` the credit counter read before `Sender::head`? On
    /// [`EagerPlan::Go`] the header and trailer are in `stage` (the ring's
    /// layout); copy the payload, post, and the send is done.
    pub(crate) fn plan_eager(
        &mut self,
        tag: i32,
        size: usize,
        freed: u64,
        stage: &mut (impl MemMut + ?Sized),
    ) -> Result<EagerPlan, ProtoError> {
        let head = self.fifo.head();
        let Some(e) = self.eager.as_mut().filter(|e| e.ring == TxRing::Known) else { return Ok(EagerPlan::No) };
        e.st.check_credits(freed)?;
        if e.st.refuse(tag, size, freed).is_some() {
            return Ok(EagerPlan::No);
        }
        if e.pending + 1 >= EAGER_SQ {
            return Ok(EagerPlan::Full);
        }
        // the bytes are copied before the post: the send is complete once posted
        let Some(id) = self.reqs.alloc(SendReq { size, done: true }) else { return Ok(EagerPlan::No) };
        let (idx, h) = e.st.take(size, head);
        let off = eager::slot_offset(idx, e.st.max);
        let len = eager::wire_len(size);
        e.wire_len[(idx % RING_SLOTS as u64) as usize] = len as u32;
        stage.write(off, &h.encode(idx));
        stage.write(off + len - 8, &eager::marker(idx).to_le_bytes());
        // a completion every EAGER_SIGNAL writes frees the SQ entries before it
        let signaled = e.quiet + 1 >= EAGER_SIGNAL;
        let count = e.quiet as u64 + 1;
        e.pending += 1;
        e.quiet = if signaled { 0 } else { e.quiet + 1 };
        e.blocked = None;
        self.eager_stats.0 += 1;
        self.eager_stats.1 += size as u64;
        Ok(EagerPlan::Go(EagerWr { id: Some(id), idx, off, len, count, signaled }))
    }

    /// Payload offset of an eager write in the staging.
    #[inline]
    pub fn payload_off(w: &EagerWr) -> usize {
        w.off + HDR_BYTES
    }

    /// A send could not go at `now`: once stuck at this FIFO head for
    /// [`Config::mailbox_after`], write the head into the receiver's
    /// mailbox (it may hold CTS writes back, or owe credits). The word is
    /// staged at offset 0 of `stage`.
    pub(crate) fn on_blocked(&mut self, now: Instant, stage: &mut (impl MemMut + ?Sized)) -> Option<MailboxWr> {
        let head = self.fifo.head();
        let after = self.mailbox_after;
        let e = self.eager.as_mut().filter(|e| e.ring == TxRing::Known)?;
        match e.blocked {
            Some((h, since)) if h == head => {
                if e.mailbox == head + 1 || now.saturating_duration_since(since) < after {
                    return None;
                }
            }
            _ => {
                e.blocked = Some((head, now));
                return None;
            }
        }
        e.mailbox = head + 1;
        stage.write(0, &(head + 1).to_le_bytes());
        let count = e.quiet as u64 + 1;
        e.pending += 1;
        e.quiet = 0;
        Some(MailboxWr { count, value: head + 1 })
    }

    /// A send could not go at `now`, and the late ring is not known (no
    /// mailbox yet): once stuck at this FIFO head for
    /// [`Config::mailbox_after`], post a signaled empty write to the
    /// receiver (`Some(count)`: [`crate::nic::SendNic::post_fence`]), once per
    /// head. It asks nothing of the receiver; its completion, or its error,
    /// says whether the receiver is still reachable, as the mailbox write
    /// does with a ring (a sender waiting for a CTS has nothing else on
    /// the wire to fail by when the link goes).
    pub(crate) fn on_blocked_probe(&mut self, now: Instant) -> Option<u64> {
        let head = self.fifo.head();
        let after = self.mailbox_after;
        let e = self.eager.as_mut().filter(|e| e.ring != TxRing::Known)?;
        match e.blocked {
            Some((h, since)) if h == head => {
                if e.probed == head + 1 || now.saturating_duration_since(since) < after {
                    return None;
                }
            }
            _ => {
                e.blocked = Some((head, now));
                return None;
            }
        }
        e.probed = head + 1;
        let count = e.quiet as u64 + 1;
        e.pending += 1;
        e.quiet = 0;
        Some(count)
    }

    /// When `Sender::on_blocked` would write the mailbox (a blocked
    /// sender that has not told the receiver yet), if ever. (The transport
    /// has no timer: every `isend` that could not go asks `on_blocked`.)
    #[cfg(test)]
    fn poll_timeout(&self) -> Option<Instant> {
        let e = self.eager.as_ref()?;
        let (h, since) = e.blocked?;
        (h == self.fifo.head() && e.mailbox != h + 1).then(|| since + self.mailbox_after)
    }

    /// A signaled eager-path write planned with `count` completed (or failed).
    #[inline]
    pub(crate) fn on_eager_done(&mut self, count: u64) {
        if let Some(e) = &mut self.eager {
            e.pending = e.pending.saturating_sub(count as usize);
        }
    }

    /// Closing: unsignaled eager writes at the tail need a signaled empty
    /// write behind them (RC order) to be known complete; `Some(count)`:
    /// post one with that count.
    pub(crate) fn close_eager(&mut self) -> Option<u64> {
        let e = self.eager.as_mut().filter(|e| e.quiet > 0)?;
        let count = e.quiet as u64 + 1;
        e.pending += 1;
        e.quiet = 0;
        Some(count)
    }

    /// Writes posted whose completion has not been seen yet.
    #[inline]
    pub fn outstanding(&self) -> usize {
        self.inflight.iter().filter(|f| f.active).count() + self.eager.as_ref().map_or(0, |e| e.pending)
    }

    /// Is send `id` done?
    #[inline(always)]
    pub fn is_done(&self, id: ReqId) -> Result<bool, Stale> {
        self.reqs.get(id).map(|r| r.done)
    }

    /// Free `id` (done or failed); its size.
    #[inline]
    pub(crate) fn release(&mut self, id: ReqId) -> Option<usize> {
        self.reqs.release(id).ok().map(|r| r.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fifo::{ImmKind, FIFO_DEPTH};

    fn sender(eager: usize) -> Sender {
        let mut s = Sender::new();
        s.connected(Config { nqps: 1, split: false, eager, mailbox_after: MAILBOX_AFTER, late_ring: false });
        s
    }

    fn fifo_mem() -> Vec<u8> {
        vec![0; FIFO_BYTES + 64]
    }

    /// The receiver's CTS for slot `seq`: `(tag, cap)` per buffer.
    fn cts(mem: &mut [u8], seq: u64, bufs: &[(i32, u32)]) {
        for (i, &(tag, cap)) in bufs.iter().enumerate() {
            let c = Cts { addr: 0x1000 * (i as u64 + 1), rkey: 3, cap, tag, n: bufs.len() as u8, i: i as u8 };
            mem.write(fifo::elem_offset(seq, i), &c.encode(seq));
        }
    }

    #[test]
    fn a_slot_is_taken_when_all_of_it_landed_and_sends_match_by_tag() {
        let mut s = sender(0);
        let mut m = fifo_mem();
        assert_eq!(s.head(&m[..]), Ok(Head::NotYet));
        cts(&mut m, 0, &[(1, 10), (2, 10)]);
        m[fifo::elem_offset(0, 1) + fifo::MARKER_OFFSET] = 0; // element 1 still landing
        assert_eq!(s.head(&m[..]), Ok(Head::NotYet));
        cts(&mut m, 0, &[(1, 10), (2, 10)]);
        assert_eq!(s.head(&m[..]), Ok(Head::Ready));
        assert_eq!(s.peek_cap(2), Some(10));
        assert!(matches!(s.send(3, 1, 0, 0), Sent::NoTag));
        let Sent::Taken { id: a, group: None } = s.send(2, 4, 0x50, 7) else { panic!() };
        let Sent::Taken { id: b, group: Some(g) } = s.send(1, 10, 0x60, 7) else { panic!() };
        assert_eq!((g.seq, g.n, g.sizes[0], g.sizes[1], g.reqs[0], g.reqs[1]), (0, 2, 10, 4, Some(b), Some(a)));
        assert_eq!(g.imm().kind, ImmKind::Sizes(2));
        assert_eq!(s.head_seq(), 1);
        s.on_posted(&g, 1);
        assert_eq!((s.is_done(a), s.outstanding()), (Ok(false), 1));
        assert_eq!(s.on_write_done(7, 0), None, "not a write of ours");
        assert!(s.on_write_done(0, 0).unwrap().last);
        assert_eq!(s.is_done(a), Ok(true));
        assert_eq!(s.release(a), Some(4));
        assert_eq!(s.outstanding(), 0);
    }

    #[test]
    fn a_send_larger_than_its_buffer_is_a_mismatch() {
        let mut s = sender(0);
        let mut m = fifo_mem();
        cts(&mut m, 0, &[(1, 10)]);
        assert_eq!(s.head(&m[..]), Ok(Head::Ready));
        let Sent::Mismatch { group, code, .. } = s.send(1, 11, 0, 0) else { panic!() };
        assert_eq!((group.seq, code), (0, FailCode::TooLarge));
        assert_eq!(s.head_seq(), 1);
    }

    #[test]
    fn corrupt_cts_is_typed() {
        let mut s = sender(0);
        let mut m = fifo_mem();
        let c = Cts { addr: 1, rkey: 1, cap: 1, tag: 1, n: 1, i: 3 };
        m.write(fifo::elem_offset(0, 0), &c.encode(0));
        assert!(matches!(s.head(&m[..]), Err(ProtoError::CtsElement { claims_i: 3, .. })));
        let mut s = sender(0);
        let mut m = fifo_mem();
        m.write(fifo::elem_offset(0, 0), &Cts { n: 3, i: 0, ..c }.encode(0));
        m.write(fifo::elem_offset(0, 1), &Cts { n: 2, i: 1, ..c }.encode(0));
        assert_eq!(s.head(&m[..]), Err(ProtoError::CtsCount { seq: 0 }));
    }

    #[test]
    fn a_slot_is_reused_only_after_its_previous_writes_completed() {
        let mut s = sender(0);
        let mut m = fifo_mem();
        for seq in 0..FIFO_DEPTH as u64 {
            cts(&mut m, seq, &[(1, 8)]);
            assert_eq!(s.head(&m[..]), Ok(Head::Ready));
            let Sent::Taken { group: Some(g), .. } = s.send(1, 8, 0, 0) else { panic!() };
            s.on_posted(&g, 1);
        }
        cts(&mut m, FIFO_DEPTH as u64, &[(1, 8)]);
        assert_eq!(s.head(&m[..]), Ok(Head::Busy));
        assert!(s.head_busy());
        s.on_write_done(0, 0);
        assert_eq!(s.head(&m[..]), Ok(Head::Ready));
    }

    #[test]
    fn eager_sends_spend_credits_and_skip_filled_buffers() {
        let mut s = sender(64);
        let mut m = fifo_mem();
        let mut st = vec![0u8; eager::ring_bytes(64)];
        // no eager tag before the first CTS
        assert_eq!(s.plan_eager(5, 8, 0, &mut st[..]), Ok(EagerPlan::No));
        cts(&mut m, 0, &[(5, 100)]);
        assert_eq!(s.head(&m[..]), Ok(Head::Ready));
        let Sent::Taken { group: Some(g), .. } = s.send(5, 100, 0, 0) else { panic!() };
        s.on_posted(&g, 1);
        let mut ids = Vec::new();
        for k in 0..eager::RING_SLOTS as u64 {
            let EagerPlan::Go(w) = s.plan_eager(5, 8, 0, &mut st[..]).unwrap() else { panic!("eager send {k}") };
            assert_eq!((w.idx, w.off, w.len), (k, eager::slot_offset(k, 64), eager::wire_len(8)));
            assert_eq!(w.signaled, (k + 1) % EAGER_SIGNAL as u64 == 0);
            assert_eq!(st.as_slice().read_u64(w.off + w.len - 8), eager::marker(k));
            ids.push(w.id);
        }
        assert_eq!(s.is_done(ids[0].unwrap()), Ok(true), "copied: done at post");
        assert_eq!(s.plan_eager(5, 8, 0, &mut st[..]), Ok(EagerPlan::No), "out of credits");
        assert!(matches!(s.plan_eager(5, 8, 1, &mut st[..]), Ok(EagerPlan::Go(_))));
        assert!(matches!(s.plan_eager(5, 8, 100, &mut st[..]), Err(ProtoError::EagerCredits { freed: 100, .. })));
        // the CTS of slot 1 comes later; its buffer was filled eagerly: stepped over
        cts(&mut m, 1, &[(5, 8)]);
        assert_eq!(s.head(&m[..]), Ok(Head::NotYet));
        assert_eq!(s.head_seq(), 2);
        assert_eq!(s.eager_stats(), (33, 33 * 8));
    }

    #[test]
    fn a_late_ring_is_asked_for_once_and_used_once_its_address_landed() {
        let late = |eager| {
            let mut s = Sender::new();
            s.connected(Config { nqps: 1, split: false, eager, mailbox_after: MAILBOX_AFTER, late_ring: true });
            s
        };
        let mut s = late(64);
        let mut m = fifo_mem();
        let mut sizes = vec![0u8; eager::SIZES_AREA_BYTES];
        let mut st = vec![0u8; eager::ring_bytes(64)];
        // no eager tag before the first CTS: nothing to ask for
        assert_eq!(s.plan_ring_request(5, 8, &mut sizes[..]), None);
        cts(&mut m, 0, &[(5, 100)]);
        assert_eq!(s.head(&m[..]), Ok(Head::Ready));
        let Sent::Taken { group: Some(g), .. } = s.send(5, 100, 0, 0) else { panic!() };
        s.on_posted(&g, 1);
        s.on_write_done(0, 0);
        assert!(s.eager_on() && !s.ring_known());
        assert_eq!(s.plan_eager(5, 8, 0, &mut st[..]), Ok(EagerPlan::No), "no eager write before the ring is known");
        let t0 = Instant::now();
        assert_eq!(s.on_blocked(t0, &mut st[..]), None);
        assert_eq!(s.on_blocked(t0 + 10 * MAILBOX_AFTER, &mut st[..]), None, "no mailbox before the ring is known");
        // an empty probe instead, once per head, after the same wait
        assert_eq!(s.on_blocked_probe(t0 + MAILBOX_AFTER / 2), None);
        let p = s.on_blocked_probe(t0 + 10 * MAILBOX_AFTER).unwrap();
        assert_eq!(s.on_blocked_probe(t0 + 20 * MAILBOX_AFTER), None, "once per head");
        s.on_eager_done(p);
        assert_eq!(s.plan_ring_request(6, 8, &mut sizes[..]), None, "not the eager tag");
        assert_eq!(s.plan_ring_request(5, 65, &mut sizes[..]), None, "over the limit");
        let r = s.plan_ring_request(5, 8, &mut sizes[..]).unwrap();
        assert_eq!(sizes.as_slice().read_u64(RING_REQ_OFF), RING_REQ);
        assert_eq!((r.count, s.outstanding()), (1, 1));
        assert_eq!(s.plan_ring_request(5, 8, &mut sizes[..]), None, "asked once");
        s.on_eager_done(r.count);
        assert_eq!(s.read_ring_ann(&m[..]), Ok(None));
        // the address lands, marker last
        let ann = RingAnn { addr: 0x7000, rkey: 0x42, max: 64 }.encode();
        m.write(RING_ANN_OFF, &ann[..RING_ANN_BYTES - 8]);
        assert_eq!(s.read_ring_ann(&m[..]), Ok(None), "not before its marker");
        m.write(RING_ANN_OFF, &ann);
        assert_eq!(s.read_ring_ann(&m[..]), Ok(Some(RingAnn { addr: 0x7000, rkey: 0x42, max: 64 })));
        s.on_ring();
        assert!(s.ring_known());
        assert_eq!(s.read_ring_ann(&m[..]), Ok(None), "read once");
        let EagerPlan::Go(w) = s.plan_eager(5, 8, 0, &mut st[..]).unwrap() else { panic!("eager once the ring is known") };
        assert_eq!((w.idx, st.as_slice().read_u64(w.off + 24)), (0, eager::marker(0)));
        // an address for another limit than the one agreed is the receiver's error
        let s = late(32);
        assert_eq!(s.read_ring_ann(&m[..]), Err(ProtoError::EagerRing { addr: 0x7000, max: 64, agreed: 32 }));
        // a ring given at connect needs no address
        assert!(sender(64).ring_known() && !sender(0).ring_known());
    }

    #[test]
    fn the_mailbox_is_written_once_per_head_after_the_timeout() {
        let mut s = sender(64);
        let mut st = vec![0u8; eager::ring_bytes(64)];
        let t0 = Instant::now();
        assert_eq!(s.poll_timeout(), None);
        assert_eq!(s.on_blocked(t0, &mut st[..]), None, "the clock starts");
        assert_eq!(s.poll_timeout(), Some(t0 + MAILBOX_AFTER));
        assert_eq!(s.on_blocked(t0 + MAILBOX_AFTER / 2, &mut st[..]), None);
        let m = s.on_blocked(t0 + MAILBOX_AFTER, &mut st[..]).unwrap();
        assert_eq!((m.value, m.count), (1, 1));
        assert_eq!(st.as_slice().read_u64(0), 1);
        assert_eq!(s.on_blocked(t0 + 10 * MAILBOX_AFTER, &mut st[..]), None, "once per head");
        assert_eq!(s.poll_timeout(), None);
        assert_eq!(s.outstanding(), 1);
        s.on_eager_done(m.count);
        assert_eq!(s.outstanding(), 0);
        // no eager path: no mailbox
        assert_eq!(sender(0).on_blocked(t0, &mut st[..]), None);
    }
}
