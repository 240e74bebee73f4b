//! NCCL profiler events (ABI v10+): start/stop events for the plugin's own
//! work, in the formats NCCL's IB and socket transports emit, linked to the
//! per-request parent handle NCCL passes to isend/irecv. See
//! `docs/profiler.md` for the formats and where they come from.
//!
//! This is the safe half. The C callback itself lives in
//! [`crate::abi::profiler`], which hands the core a [`Sink`] (its start and
//! stop functions) with the callback's address through `install`: the
//! core never names the abi ring. The core only sees:
//! - [`Profiler::enabled`]: one relaxed atomic load (no callback, or NCCL
//!   passed NULL: false, and nothing else runs);
//! - [`Profiler::start`] -> [`OpenEvent`]: an open event that is stopped
//!   exactly once, when it is dropped, so every
//!   path that ends an event (completion, failure, close) pairs it by
//!   construction;
//! - [`EventSlots`]: the open events of one comm, preallocated when the
//!   comm is built with profiling on and keyed by request slot, so the data
//!   path never allocates.
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::proto::pool::ReqId;
use crate::transport::MAX_RECVS;

/// NCCL's parent handle for one request (one receive buffer): the `phandle`
/// of isend, `phandles[i]` of irecv. Opaque: only handed back to NCCL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent(NonZeroUsize);

impl Parent {
    /// From NCCL's pointer value; NULL (bootstrap traffic, or an old ABI)
    /// is no parent, and then no events are emitted: NCCL's callback
    /// dereferences the parent on start.
    pub fn from_addr(addr: usize) -> Option<Parent> {
        NonZeroUsize::new(addr).map(Parent)
    }

    /// The pointer value.
    pub fn addr(self) -> usize {
        self.0.get()
    }
}

/// Events per parent handle at most: NCCL's IB transport never has more
/// per request (`MAX_QPS_PER_REQ`, `src/transport/net_ib/common.h`), and
/// NCCL's example profiler stores that many per proxy step without a bound
/// check (`MAX_EVENTS_PER_REQ`, `ext-profiler/example/event.h`). Pieces or
/// QPs beyond it move without an event.
pub const MAX_EVENTS_PER_PARENT: usize = 8;

/// `ibv_wr_opcode` IBV_WR_RDMA_WRITE.
pub const OP_RDMA_WRITE: i32 = 0;
/// `ibv_wr_opcode` IBV_WR_RDMA_WRITE_WITH_IMM.
pub const OP_RDMA_WRITE_WITH_IMM: i32 = 1;
/// `ibv_wr_opcode` IBV_WR_SEND: iWARP's notice, the last WR of a lane.
pub const OP_SEND: i32 = 2;
/// `ibv_wc_opcode` IBV_WC_RECV: what a receive event waits for on iWARP
/// (the notice SEND's receive).
pub const OP_RECV: i32 = 128;
/// `ibv_wc_opcode` IBV_WC_RECV_RDMA_WITH_IMM: what a receive event waits for
/// (receive WRs have no `ibv_wr_opcode`; WC opcodes start at 128, so the
/// two never collide).
pub const OP_RECV_RDMA_WITH_IMM: i32 = 129;
/// NCCL_SOCKET_SEND (`src/include/socket.h`).
pub const SOCK_SEND: i32 = 0;
/// NCCL_SOCKET_RECV.
pub const SOCK_RECV: i32 = 1;

/// What one event describes (the event kinds NCCL's own transports emit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fields {
    /// Verbs: one work request (or a request's share of one) on one QP
    /// (`ncclProfilerNetIbDescr_v1_t`, type `ncclProfileQp`).
    Qp {
        /// The plugin's device index (getProperties(device).name names it).
        device: i32,
        /// Our QP number.
        qpn: u32,
        /// `ibv_wr_opcode` of the posted write (or the notice's [`OP_SEND`] on
        /// iWARP), or the receive's [`OP_RECV_RDMA_WITH_IMM`] ([`OP_RECV`] on iWARP).
        opcode: i32,
        /// The work request id the completion will carry (the FIFO
        /// sequence number of the message; both ends report the same).
        wr_id: u64,
        /// Bytes this request moves on this QP (receive: at most).
        len: usize,
    },
    /// TCP: one piece of a message on one stream
    /// (`ncclProfilerNetSockDescr_v1_t`, type `ncclProfileSocket`).
    Sock {
        /// The stream's file descriptor.
        fd: i32,
        /// [`SOCK_SEND`] or [`SOCK_RECV`].
        op: i32,
        /// Payload bytes of the piece.
        len: usize,
    },
}

/// How events reach NCCL's callback: functions of the C boundary
/// ([`crate::abi::profiler`]), given the callback's address.
#[derive(Debug, Clone, Copy)]
pub struct Sink {
    /// Start an event under `parent` with the callback at the address;
    /// the event handle NCCL wrote, or `None` when the callback refused it.
    pub start: fn(NonZeroUsize, Parent, &Fields) -> Option<usize>,
    /// Stop the event with that handle (the callback it was started with).
    pub stop: fn(NonZeroUsize, usize),
}

/// The callback as an address (0: none).
static CB: AtomicUsize = AtomicUsize::new(0);
/// The C boundary's functions, set by the first [`install`] (always the same).
/// std's OnceLock (a futex on Linux): an init racing another waits without
/// leaving thread-local state of ours in NCCL's thread (see [`crate::thread`]).
static SINK: OnceLock<Sink> = OnceLock::new();

/// Install NCCL's callback (its address; 0: events off) and the functions
/// that call it. NCCL hands the same callback to every init (see
/// [`crate::abi::profiler::set_callback`], this function's one caller: the
/// sink's functions turn the address back into that callback).
pub(crate) fn install(cb: usize, sink: Sink) {
    SINK.get_or_init(|| sink);
    CB.store(cb, Ordering::Release);
}

thread_local! {
    // (a Cell<bool> needs no destructor: reading it from NCCL's threads
    // leaves them no thread-local state of ours, see crate::thread)
    static MUTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Start or stop no profiler events from the calling thread: one of the
/// plugin's own (the verbs recovery keeper, which may reap and resend for a
/// comm NCCL is not calling). A comm's events it would start stay as they
/// are; those it would stop wait in the comm's [`EventSlots`] until NCCL's
/// next call on it (or its close), so NCCL's profiler hears of events from
/// NCCL's threads only.
pub(crate) fn mute_this_thread() {
    MUTED.set(true);
}

#[inline]
fn muted() -> bool {
    MUTED.get()
}

/// The process-wide profiler facade.
pub struct Profiler;

impl Profiler {
    /// Is a callback installed? One relaxed load: the only cost when off.
    #[inline(always)]
    pub fn enabled() -> bool {
        CB.load(Ordering::Relaxed) != 0
    }

    /// Start an event under `parent`; `None` when profiling is off or the
    /// callback refused it (then there is nothing to stop).
    #[inline]
    pub fn start(parent: Parent, f: &Fields) -> Option<OpenEvent> {
        let cb = NonZeroUsize::new(CB.load(Ordering::Acquire))?;
        if MUTED.get() {
            return None;
        }
        let handle = (SINK.get()?.start)(cb, parent, f)?;
        Some(OpenEvent { cb, handle })
    }
}

/// A started event: stopped exactly once, when dropped. Carries the callback
/// it was started with, so a later init that changes the callback cannot
/// orphan it.
#[derive(Debug)]
pub struct OpenEvent {
    pub(crate) cb: NonZeroUsize,
    pub(crate) handle: usize,
}

impl Drop for OpenEvent {
    fn drop(&mut self) {
        // an event exists only after install set the sink
        if let Some(s) = SINK.get() {
            (s.stop)(self.cb, self.handle);
        }
    }
}

/// The open events of one comm: `per` event slots for each request slot,
/// and each request's parent handles (one per receive buffer; a send uses
/// the first). Allocated once, when the comm is built with profiling on.
pub struct EventSlots {
    per: usize,
    /// `nreq * per`: (generation of the request that owns it, the event).
    open: Box<[Option<(u8, OpenEvent)>]>,
    /// `nreq * MAX_RECVS`.
    parents: Box<[Option<Parent>]>,
    /// Events stopped on a muted thread ([`mute_this_thread`]): their stop
    /// goes to NCCL at the comm's next call from one of NCCL's threads.
    deferred: Vec<OpenEvent>,
}

/// Stop `ev` now, or (on a muted thread) at the next call from NCCL's.
fn release(deferred: &mut Vec<OpenEvent>, ev: Option<(u8, OpenEvent)>) {
    if let Some((_, e)) = ev {
        if muted() {
            deferred.push(e);
        }
    }
}

impl EventSlots {
    /// For `nreq` request slots with up to `per` events each; `None` (and no
    /// allocation) when profiling is off.
    pub fn new(nreq: usize, per: usize) -> Option<EventSlots> {
        if !Profiler::enabled() {
            return None;
        }
        Some(EventSlots {
            per: per.max(1),
            open: (0..nreq * per.max(1)).map(|_| None).collect(),
            parents: vec![None; nreq * MAX_RECVS].into_boxed_slice(),
            deferred: Vec::new(),
        })
    }

    /// On NCCL's thread: the stops a muted thread left (nothing to do, the
    /// common case, is one thread-local read and a length check).
    #[inline]
    fn catch_up(&mut self) -> bool {
        if muted() {
            return false;
        }
        if !self.deferred.is_empty() {
            self.deferred.clear();
        }
        true
    }

    /// Remember the parents of a request just posted (stops anything a
    /// previous request of the slot left open).
    pub fn set_parents(&mut self, id: ReqId, parents: &[Option<Parent>]) {
        self.catch_up();
        self.stop_slot(id.slot as usize);
        let base = id.slot as usize * MAX_RECVS;
        if base + MAX_RECVS > self.parents.len() {
            return;
        }
        let p = &mut self.parents[base..base + MAX_RECVS];
        p.fill(None);
        for (o, x) in p.iter_mut().zip(parents) {
            *o = *x;
        }
    }

    /// Parent `i` of request `id`.
    pub fn parent(&self, id: ReqId, i: usize) -> Option<Parent> {
        self.parents.get(id.slot as usize * MAX_RECVS + i).copied().flatten()
    }

    /// Start event `k` of request `id` under its parent `i` (stops one
    /// left open in that slot first: never two events in one slot).
    pub fn start(&mut self, id: ReqId, k: usize, i: usize, f: &Fields) {
        // (a muted thread leaves the slot's event as it is)
        if k >= self.per || !self.catch_up() {
            return;
        }
        let Some(parent) = self.parent(id, i) else { return };
        let at = id.slot as usize * self.per + k;
        let Some(slot) = self.open.get_mut(at) else { return };
        *slot = None;
        *slot = Profiler::start(parent, f).map(|e| (id.gen, e));
    }

    /// Is event `k` of `id` open?
    #[cfg(test)]
    pub fn is_open(&self, id: ReqId, k: usize) -> bool {
        k < self.per && matches!(self.open.get(id.slot as usize * self.per + k), Some(Some((g, _))) if *g == id.gen)
    }

    /// Stop event `k` of request `id` if it is open (and still `id`'s).
    pub fn stop(&mut self, id: ReqId, k: usize) {
        self.catch_up();
        if k >= self.per {
            return;
        }
        if let Some(slot) = self.open.get_mut(id.slot as usize * self.per + k) {
            if matches!(slot, Some((g, _)) if *g == id.gen) {
                release(&mut self.deferred, slot.take());
            }
        }
    }

    /// Stop every open event of request `id` (it completed or failed).
    pub fn stop_req(&mut self, id: ReqId) {
        self.catch_up();
        let base = id.slot as usize * self.per;
        if let Some(s) = self.open.get_mut(base..base + self.per) {
            for slot in s {
                if matches!(slot, Some((g, _)) if *g == id.gen) {
                    release(&mut self.deferred, slot.take());
                }
            }
        }
    }

    fn stop_slot(&mut self, slot: usize) {
        let base = slot * self.per;
        if let Some(s) = self.open.get_mut(base..base + self.per) {
            s.iter_mut().for_each(|x| release(&mut self.deferred, x.take()));
        }
    }

    /// Stop everything (the comm failed or closes).
    pub fn stop_all(&mut self) {
        self.catch_up();
        self.open.iter_mut().for_each(|x| release(&mut self.deferred, x.take()));
    }

    /// Events open now.
    #[cfg(test)]
    pub fn open_count(&self) -> usize {
        self.open.iter().filter(|x| x.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::{c_int, c_void};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::abi::sys::ncclResult_t;

    static STARTS: AtomicUsize = AtomicUsize::new(0);
    static STOPS: AtomicUsize = AtomicUsize::new(0);
    static NEXT: AtomicUsize = AtomicUsize::new(0x1000);

    extern "C" fn cb(eh: *mut *mut c_void, ty: c_int, _ph: *mut c_void, _id: i64, _ext: *mut c_void) -> ncclResult_t {
        // SAFETY: the plugin passes a valid out-pointer.
        unsafe {
            if ty == 0 {
                STARTS.fetch_add(1, Ordering::SeqCst);
                *eh = NEXT.fetch_add(16, Ordering::SeqCst) as *mut c_void;
            } else {
                STOPS.fetch_add(1, Ordering::SeqCst);
            }
        }
        ncclResult_t::ncclSuccess
    }

    /// The one test that installs a callback in this process (others see
    /// profiling off, or on for a moment without parents: no events).
    #[test]
    fn event_slots_pair_every_start_with_one_stop() {
        assert!(EventSlots::new(4, 2).is_none(), "off: no table, no allocation");
        crate::abi::profiler::set_callback(Some(cb));
        let f = Fields::Sock { fd: 3, op: SOCK_SEND, len: 8 };
        let p = Parent::from_addr(0x40).unwrap();
        let (a, b) = (ReqId { slot: 1, gen: 0 }, ReqId { slot: 2, gen: 0 });
        {
            let mut s = EventSlots::new(4, 2).expect("on");
            // no parent: nothing starts
            s.start(a, 0, 0, &f);
            assert_eq!(s.open_count(), 0);
            s.set_parents(a, &[Some(p)]);
            s.set_parents(b, &[Some(p)]);
            s.start(a, 0, 0, &f);
            s.start(a, 1, 0, &f);
            s.start(b, 0, 0, &f);
            assert_eq!(s.open_count(), 3);
            // a stale id (older generation of the slot) stops nothing
            s.stop(ReqId { slot: 1, gen: 7 }, 0);
            s.stop_req(ReqId { slot: 1, gen: 7 });
            assert_eq!(s.open_count(), 3);
            s.stop(a, 0);
            s.stop(a, 0); // twice: once only
            assert!(!s.is_open(a, 0) && s.is_open(a, 1));
            s.stop_req(a);
            assert_eq!(s.open_count(), 1);
            // restarting an open slot stops the old event first
            s.start(b, 0, 0, &f);
            assert_eq!(s.open_count(), 1);
            // out of range: ignored
            s.start(b, 9, 0, &f);
            // b stays open: dropping the table stops it
        }
        // a muted thread (the recovery keeper) starts and stops nothing
        // itself: its stops reach NCCL at the comm's next call from another
        {
            let mut s = EventSlots::new(4, 2).expect("on");
            s.set_parents(a, &[Some(p)]);
            s.start(a, 0, 0, &f);
            let calls = || (STARTS.load(Ordering::SeqCst), STOPS.load(Ordering::SeqCst));
            let before = calls();
            std::thread::scope(|sc| {
                sc.spawn(|| {
                    mute_this_thread();
                    s.start(a, 0, 0, &f); // (a resend: the open event stays)
                    s.start(a, 1, 0, &f);
                    assert_eq!(s.open_count(), 1);
                    s.stop_req(a);
                });
            });
            assert_eq!(calls(), before, "nothing from the muted thread");
            assert_eq!(s.open_count(), 0);
            s.stop(b, 0); // the comm's next call: the deferred stop goes out
            assert_eq!(calls(), (before.0, before.1 + 1));
        }
        // a plain event, stopped by drop
        drop(Profiler::start(p, &Fields::Qp { device: 0, qpn: 0x11, opcode: OP_RDMA_WRITE, wr_id: 1, len: 4 }));
        crate::abi::profiler::set_callback(None);
        assert!(!Profiler::enabled());
        assert!(Profiler::start(p, &f).is_none());
        assert_eq!(STARTS.load(Ordering::SeqCst), 6);
        assert_eq!(STOPS.load(Ordering::SeqCst), 6);
    }
}
