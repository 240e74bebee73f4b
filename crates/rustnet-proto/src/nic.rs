//! What the verbs machines ([`crate::tx::Sender`], [`crate::rx::Receiver`])
//! ask of the NIC, and what the NIC tells them: the executor's side of the
//! protocol, as two traits.
//!
//! The machines decide, the executor only executes. Every entry point of
//! the verbs data path (`isend`, `irecv`, `test`, `iflush`, the merged
//! device's look-ahead, close) is a method of the machine that takes the
//! executor as `&mut impl SendNic` / `&mut impl RecvNic`: the machine reads
//! the FIFO or the ring through it, asks it for completions, and tells it
//! what to post, copy, count and report, in the order the protocol needs.
//! The plugin's `transport::ib::p2p` implements the traits over ibverbs
//! (one verbs call per method); the model test (`tests/verbs_model.rs`)
//! implements them over a simulated NIC, so the 1000 seeds run the very
//! call order that ships. Neither calls the machines' finer methods (they
//! are `pub(crate)`).
//!
//! Why a trait and not a queue of actions: the CQ is read in the middle of
//! a decision ("the head slot is busy: reap completions, look again"), so
//! a queue would make every entry point re-entrant; a call through a
//! trait costs nothing (monomorphised, no `dyn`), allocates nothing, and
//! keeps the order where it is decided.
//!
//! Failures: a NIC method that fails returns its error; the machine
//! returns it as [`Fail::Nic`] or records it with `fail` and goes on, as
//! the protocol says. A completion with an error status arrives as a
//! [`Cqe`] with `ok: false`; the executor has recorded its error already
//! (it alone can name the status).
use std::time::Instant;

use crate::error::ProtoError;
use crate::fifo::{FailCode, Group, PlannedWr};
use crate::mem::{Mem, MemMut};
use crate::pool::{ReqId, Stale};
use crate::rx::{CtlChain, Deliver};
use crate::tx::{EagerWr, MailboxWr, RingRequestWr};
use crate::MAX_RECVS;

/// Completions asked for per poll.
pub const POLL_BATCH: usize = 16;
/// Profiler events per parent (per request): lanes beyond get none.
pub const MAX_EVENTS_PER_PARENT: usize = 8;

/// What one of our work requests was: its `wr_id` ([`WrId::encode`],
/// [`WrId::decode`]). Local to this process, never on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrId {
    /// A data write of FIFO slot `seq` that ends a lane (its immediate, or
    /// on iWARP the notice SEND after the lane's writes).
    Data(u64),
    /// iWARP: a lane's last data write, signaled only so siw copies it; its
    /// completion carries no news.
    DataDone(u64),
    /// An eager-path write (eager message, mailbox, late-ring request,
    /// close fence); a signaled one frees `count` eager-path send-queue entries.
    Eager(u64),
    /// A control write (CTS, credits) on our QP `qp`; a signaled one hands
    /// `count` to the receiver's send-queue budget.
    Ctl {
        /// Our QP index.
        qp: usize,
        /// Entries its completion frees.
        count: u64,
    },
    /// The flush read of request `ReqId`.
    Flush(ReqId),
    /// A posted receive (IB/RoCE: 0, receives are not tied to a request;
    /// iWARP: its notice ring id).
    Recv(u64),
}

const KIND_SHIFT: u32 = 60;
const K_DATA: u64 = 0;
const K_DATA_DONE: u64 = 1;
const K_EAGER: u64 = 2;
const K_CTL: u64 = 3;
const K_FLUSH: u64 = 4;
const K_RECV: u64 = 5;
const LOW: u64 = (1 << KIND_SHIFT) - 1;

impl WrId {
    /// The 64-bit `wr_id`: the kind in the top 4 bits, its value below.
    /// Data sequence numbers and counts stay below 2^60 (a sequence number
    /// grows by one per message: 2^60 of them never happen).
    #[inline]
    pub fn encode(self) -> u64 {
        let (k, v) = match self {
            WrId::Data(seq) => (K_DATA, seq & LOW),
            WrId::DataDone(seq) => (K_DATA_DONE, seq & LOW),
            WrId::Eager(count) => (K_EAGER, count & LOW),
            WrId::Ctl { qp, count } => (K_CTL, (qp as u64 & 0xfff) << 48 | count & 0xffff_ffff_ffff),
            WrId::Flush(id) => (K_FLUSH, (id.gen as u64) << 8 | id.slot as u64),
            WrId::Recv(id) => (K_RECV, id & LOW),
        };
        k << KIND_SHIFT | v
    }

    /// Back from a `wr_id` this process posted. `None`: not one of ours.
    #[inline]
    pub fn decode(w: u64) -> Option<WrId> {
        let v = w & LOW;
        Some(match w >> KIND_SHIFT {
            K_DATA => WrId::Data(v),
            K_DATA_DONE => WrId::DataDone(v),
            K_EAGER => WrId::Eager(v),
            K_CTL => WrId::Ctl { qp: (v >> 48) as usize, count: v & 0xffff_ffff_ffff },
            K_FLUSH => WrId::Flush(ReqId { slot: v as u8, gen: (v >> 8) as u8 }),
            K_RECV => WrId::Recv(v),
            _ => return None,
        })
    }
}

/// One completion, as the executor read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    /// Whose.
    pub wr: WrId,
    /// Our QP index, when the QP is one of the comm's.
    pub qp: Option<usize>,
    /// Success. `false`: the executor recorded the error (the comm failed).
    pub ok: bool,
    /// A receive's completion word (an immediate, or an iWARP notice's).
    pub word: Option<u32>,
}

impl Cqe {
    /// An empty slot.
    pub const EMPTY: Cqe = Cqe { wr: WrId::Recv(0), qp: None, ok: false, word: None };
}

impl Default for Cqe {
    fn default() -> Cqe {
        Cqe::EMPTY
    }
}

/// What a machine reads its CQ into (a field of each machine, kept between
/// polls, so a poll that finds nothing does not first fill a fresh array).
pub type CqBuf = [Cqe; POLL_BATCH];

/// A [`CqBuf`] of empty slots.
pub const NO_CQES: CqBuf = [Cqe::EMPTY; POLL_BATCH];

/// The kind of work a profiler event waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvOp {
    /// A plain RDMA write.
    Write,
    /// The write that ends a lane: with immediate (IB/RoCE), or the notice
    /// SEND after it (iWARP).
    LaneEnd,
    /// A receive's completion (write with immediate, or the notice).
    Recv,
}

/// A profiler event to open: request `id`'s event `slot` (per QP, or per
/// buffer and QP), for parent `parent` (the buffer index), on our QP `qp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ev {
    /// The request.
    pub id: ReqId,
    /// Its event slot.
    pub slot: usize,
    /// Which of NCCL's parent handles (buffer index).
    pub parent: usize,
    /// Our QP index.
    pub qp: usize,
    /// What it waits for.
    pub op: EvOp,
    /// The wr_id it reports.
    pub wr: WrId,
    /// Bytes.
    pub len: usize,
}

/// Why a machine's entry point stopped. The executor turns it into the
/// comm's error: `Nic` and `Proto` fail the comm, `Mismatch` fails it with
/// its QPs left running, `Stale` and `NoSlot` refuse the call only.
#[derive(Debug, Clone, PartialEq)]
pub enum Fail<E> {
    /// The peer broke the protocol, or the application sent more than a
    /// buffer holds ([`ProtoError::is_size_mismatch`]).
    Proto(ProtoError),
    /// A NIC call failed, or the comm failed earlier (the executor's error).
    Nic(E),
    /// This send does not fit the buffer its tag matched (why, and the
    /// code the receiver was told: its receive fails too). The comm fails,
    /// its QPs left running so that message still goes out.
    Mismatch(FailCode, String),
    /// `test` on a request id that is not live.
    Stale(Stale),
    /// Every request slot is taken (a flush found none).
    NoSlot,
}

/// Lane `lane` of `nlanes` of a complete group, to post on our QP `qp`:
/// the WRs [`crate::fifo::plan_lane`] planned for it.
#[derive(Debug, Clone, Copy)]
pub struct Lane<'a> {
    /// The group.
    pub g: &'a Group,
    /// Lane index.
    pub lane: usize,
    /// Lanes of the message.
    pub nlanes: usize,
    /// Our QP index.
    pub qp: usize,
    /// Its WRs, in order (the last one carries the immediate).
    pub plan: &'a [PlannedWr],
}

/// What both ends' executors do alike.
pub trait Link {
    /// The executor's error.
    type Error: Clone;
    /// Read up to [`POLL_BATCH`] completions into `out`; how many. An
    /// error fails the comm (the executor recorded it).
    fn poll_cq(&mut self, out: &mut [Cqe; POLL_BATCH]) -> Result<usize, Self::Error>;
    /// `Err`: the comm has failed (an earlier failure, an async event, the
    /// peer gone), with its first error.
    fn check(&mut self) -> Result<(), Self::Error>;
    /// A call made no progress: now and then look at the peer (liveness).
    /// `live`: requests the comm holds. `true` when it looked (the look
    /// may have failed the comm); `false`: nothing changed.
    fn tick(&mut self, live: usize) -> bool;
    /// Something moved (no liveness probe is due).
    fn progressed(&mut self);
    /// Is the comm recovering from a fault (its QPs stopped: nothing more
    /// completes on them until the resume)? A close stops waiting then.
    fn stopped(&self) -> bool {
        false
    }
    /// Fail the comm now (the first failure is the one reported).
    fn fail(&mut self, f: Fail<Self::Error>);
    /// Is the profiler on for this comm (any [`Ev`] to open)?
    fn profiling(&self) -> bool;
    /// Request `id` was taken: the parents NCCL gave with this call are its.
    fn taken(&mut self, id: ReqId);
    /// Open a profiler event.
    fn ev_start(&mut self, ev: &Ev);
    /// Close request `id`'s event `slot`, if open.
    fn ev_stop(&mut self, id: ReqId, slot: usize);
    /// Close every open event of request `id`.
    fn ev_stop_req(&mut self, id: ReqId);
    /// Count `bytes` carried by our QP `qp` (statistics).
    fn count(&mut self, qp: usize, bytes: u64);
    /// The time (for the mailbox and close's bound).
    fn now(&self) -> Instant;
}

/// The sending end's executor.
pub trait SendNic: Link {
    /// The CTS FIFO (and credit word) the receiver writes.
    type Fifo: Mem + ?Sized;
    /// Our staging areas.
    type Stage: MemMut + ?Sized;
    /// The CTS FIFO.
    fn fifo(&self) -> &Self::Fifo;
    /// The sizes staging (a grouped receive's sizes, written before its lanes).
    fn sizes_stage(&mut self) -> &mut Self::Stage;
    /// Post one lane's WRs.
    fn post_lane(&mut self, lane: &Lane<'_>) -> Result<(), Self::Error>;
    /// The eager staging (ring layout), when the eager path is on.
    fn eager_stage(&mut self) -> Option<&mut Self::Stage>;
    /// Post the eager write `w` on QP 0: first, with `copy: Some((src,
    /// len))`, copy the send's `len` payload bytes at `src` to the staging
    /// at [`crate::tx::Sender::payload_off`]; with `None` the staging
    /// already holds the message (written again after a fault).
    fn post_eager(&mut self, w: &EagerWr, copy: Option<(u64, usize)>) -> Result<(), Self::Error>;
    /// Post the mailbox write.
    fn post_mailbox(&mut self, m: &MailboxWr) -> Result<(), Self::Error>;
    /// Post a signaled empty eager-path write on QP 0 (to the ring, or
    /// without one to the sizes area): behind the unsignaled ones at close,
    /// or a blocked sender's probe; its completion frees `count`.
    fn post_fence(&mut self, count: u64) -> Result<(), Self::Error>;
    /// Post the late-ring request ([`RingRequestWr`]: the word staged in the
    /// sizes staging, to the receiver's sizes area) on QP 0.
    fn post_ring_request(&mut self, r: &RingRequestWr) -> Result<(), Self::Error>;
    /// The receiver's late ring is at `addr` (`rkey`), sized for `max`-byte
    /// messages: make the eager staging (ring layout) and write there from
    /// now on. An error fails the comm (the receiver may defer CTS from now
    /// on, which only a sender with staging, for the mailbox, can undo).
    fn ring_arrived(&mut self, addr: u64, rkey: u32, max: usize) -> Result<(), Self::Error>;
}

/// The receiving end's executor.
pub trait RecvNic: Link {
    /// The eager ring the sender writes (mailbox word first).
    type Ring: Mem + ?Sized;
    /// The CTS/credit staging.
    type Stage: MemMut + ?Sized;
    /// The eager ring, when the eager path is on.
    fn ring(&self) -> Option<&Self::Ring>;
    /// Copy an eager message out of the ring into its buffer, now.
    fn deliver(&self, d: &Deliver);
    /// The CTS/credit staging.
    fn stage(&mut self) -> &mut Self::Stage;
    /// Post a chain of control writes.
    fn post_ctl(&mut self, chain: &CtlChain) -> Result<(), Self::Error>;
    /// The sizes the sender wrote for the grouped receive of `seq`.
    fn sizes(&self, seq: u64) -> [u32; MAX_RECVS];
    /// May receive `first..first + nlanes`'s CTS go out with `in_flight`
    /// receives (it included) able to bring completions? (iWARP: every
    /// notice it allows must find a posted receive; IB/RoCE: always.)
    fn may_advertise(&self, first: usize, nlanes: usize, in_flight: usize) -> bool;
    /// Receive `seq` (taken now) will bring `nlanes` completion words.
    fn expect(&mut self, seq: u64, nlanes: usize) -> Result<(), Self::Error>;
    /// Late ring: has the sender's request word landed in the sizes area?
    fn ring_requested(&self) -> bool;
    /// Late ring: make the ring (registered for the sender's writes, zeroed,
    /// sized for `max`-byte messages); its address and rkey. [`Self::ring`]
    /// returns it from now on.
    fn make_ring(&mut self, max: usize) -> Result<(u64, u32), Self::Error>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wr_id_kind_round_trips_and_kinds_never_collide() {
        let ids = [
            WrId::Data(0),
            WrId::Data(LOW),
            WrId::DataDone(7),
            WrId::Eager(16),
            WrId::Ctl { qp: 3, count: 12 },
            WrId::Flush(ReqId { slot: 5, gen: 9 }),
            WrId::Recv(0),
            WrId::Recv(31),
        ];
        for id in ids {
            assert_eq!(WrId::decode(id.encode()), Some(id), "{id:?}");
        }
        let mut kinds: Vec<u64> = ids.iter().map(|i| i.encode() >> KIND_SHIFT).collect();
        kinds.dedup();
        assert_eq!(kinds.len(), 6, "one kind per variant");
        assert_eq!(WrId::decode(15 << KIND_SHIFT), None, "a wr_id not ours");
        // profiler events report a data write's wr_id: its sequence number, as before WrId
        assert_eq!(WrId::Data(77).encode(), 77);
    }
}
