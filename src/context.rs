//! Per-communicator plugin contexts (ABI v11 and later).
//!
//! From net v11 NCCL calls `init` once per communicator and gets back a
//! context; `listen` and `connect` name the context they work for, and
//! `finalize(ctx)` ends it when the communicator is destroyed. What a
//! context carries here: NCCL's id of the communicator (`commId`), the
//! communicator's traffic class (applied to every connection made under the
//! context), the profiler callback NCCL handed to `init` (kept, opaque, for
//! the profiler module), and the hints NCCL passes through `setNetAttr`.
//!
//! The process-wide state (devices, knobs, transport) is still set up once by
//! the first `init` ([`crate::plugin::init`]); a context costs one small
//! allocation. v6-v10 have no contexts: their comms all belong to one
//! implicit context that is never finalized.
//!
//! Each listen, send and receive comm holds a [`Member`] of the context it was
//! made under: the context outlives its comms (no dangling pointer whatever
//! the call order), counts them, and a comm whose context was finalized fails
//! every call except close, naming the context. A `finalize` while comms are
//! still open is refused with an error that says how many (the context is
//! finalized anyway: NCCL does not call it twice).
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// NCCL's profiler callback as `init` passed it (v10+), kept as an opaque
/// address (0: none): the core never calls it (abi/profiler.rs does), so it
/// needs no NCCL type; `abi` converts at the boundary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfilerCallback(usize);

impl ProfilerCallback {
    /// No callback.
    pub const NONE: ProfilerCallback = ProfilerCallback(0);

    /// The callback at address `addr` (0: none).
    pub fn from_addr(addr: usize) -> ProfilerCallback {
        ProfilerCallback(addr)
    }

    /// Its address (0: none).
    pub fn addr(self) -> usize {
        self.0
    }

    /// Whether NCCL passed one.
    pub fn is_set(self) -> bool {
        self.0 != 0
    }
}

/// `setNetAttr` hints for one direction; -1 (`NCCL_NET_ATTR_UNDEF`) where NCCL gives none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommAttr {
    /// Peers NCCL may drive at once through this context's comms of this direction.
    pub max_concurrent_peers: i32,
    /// Peers it drives at least.
    pub min_concurrent_peers: i32,
    /// Flows (channels) per peer, at most.
    pub max_flows_per_peer: i32,
    /// Flows per peer, at least.
    pub min_flows_per_peer: i32,
}

impl CommAttr {
    /// All undefined.
    pub const UNDEF: CommAttr =
        CommAttr { max_concurrent_peers: -1, min_concurrent_peers: -1, max_flows_per_peer: -1, min_flows_per_peer: -1 };
}

/// What NCCL last told a context through `setNetAttr` (ABI v11+). NCCL calls
/// it when a connection is set up (upper bounds for the communicator) and
/// again from its progress thread whenever the operation being moved differs
/// from the last one it announced (peers, channels, op, algorithm, protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetAttr {
    /// Send side.
    pub send: CommAttr,
    /// Receive side.
    pub recv: CommAttr,
    /// Bit mask of NCCL functions (`1 << ncclFunc*`); `u32::MAX` undefined.
    pub op: u32,
    /// Bit mask of NCCL algorithms; `u32::MAX` undefined (point-to-point).
    pub algo: u32,
    /// Bit mask of NCCL protocols; `u32::MAX` undefined.
    pub proto: u32,
}

impl NetAttr {
    /// All undefined (NCCL's `NCCL_NET_ATTR_INIT`).
    pub const UNDEF: NetAttr = NetAttr { send: CommAttr::UNDEF, recv: CommAttr::UNDEF, op: u32::MAX, algo: u32::MAX, proto: u32::MAX };
}

/// One plugin context.
pub struct NetContext {
    /// Process-unique number (pending connects remember it).
    serial: u64,
    /// NCCL's communicator id (`commId`, the communicator's hash); 0 for the implicit context.
    comm_id: u64,
    /// The communicator's traffic class; `None` when NCCL passes
    /// `NCCL_NET_TRAFFIC_CLASS_UNDEF` (and for the implicit context).
    traffic_class: Option<i32>,
    profiler: OnceCell<ProfilerCallback>,
    attr: Mutex<NetAttr>,
    attr_calls: AtomicU64,
    open: AtomicUsize,
    finalized: AtomicBool,
    implicit: bool,
}

static SERIAL: AtomicU64 = AtomicU64::new(1);

impl NetContext {
    /// A context for the communicator `comm_id` (ABI v11+ `init`).
    pub fn new(comm_id: u64, traffic_class: Option<i32>, profiler: ProfilerCallback) -> Result<Arc<NetContext>> {
        if let Some(tc) = traffic_class {
            if !(0..=255).contains(&tc) {
                return Err(Error::InvalidArg(format!(
                    "init: communicator traffic class {tc} (commId {comm_id:#x}) is outside 0..255 \
                     (it becomes the IP TOS / GRH traffic class byte; -1 means none)"
                )));
            }
        }
        let c = NetContext::make(comm_id, traffic_class, false);
        let _ = c.profiler.set(profiler);
        Ok(Arc::new(c))
    }

    fn make(comm_id: u64, traffic_class: Option<i32>, implicit: bool) -> NetContext {
        NetContext {
            serial: SERIAL.fetch_add(1, Ordering::Relaxed),
            comm_id,
            traffic_class,
            profiler: OnceCell::new(),
            attr: Mutex::new(NetAttr::UNDEF),
            attr_calls: AtomicU64::new(0),
            open: AtomicUsize::new(0),
            finalized: AtomicBool::new(false),
            implicit,
        }
    }

    /// Process-unique number of this context.
    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// NCCL's communicator id (0: the implicit context of v6-v10).
    pub fn comm_id(&self) -> u64 {
        self.comm_id
    }

    /// The communicator's traffic class, if it set one.
    pub fn traffic_class(&self) -> Option<i32> {
        self.traffic_class
    }

    /// Is this the implicit context of the context-less ABIs (v6-v10)?
    pub fn is_implicit(&self) -> bool {
        self.implicit
    }

    /// The profiler callback `init` passed (NULL: none).
    pub fn profiler(&self) -> ProfilerCallback {
        self.profiler.get().copied().unwrap_or_default()
    }

    /// Keep the profiler callback of a v10 `init` (implicit context; the first one stays).
    pub fn set_profiler(&self, p: ProfilerCallback) {
        let _ = self.profiler.set(p);
    }

    /// Record NCCL's hints (`setNetAttr`). Called from NCCL's progress
    /// thread: a short lock, no allocation.
    pub fn set_attr(&self, a: NetAttr) -> Result<()> {
        self.check_live("setNetAttr")?;
        *self.attr.lock() = a;
        if self.attr_calls.fetch_add(1, Ordering::Relaxed) == 0 {
            tracing::debug!("context {:#x}: first setNetAttr {a:?}", self.comm_id);
        }
        Ok(())
    }

    /// The hints NCCL last passed and how many times it called `setNetAttr`.
    pub fn attr(&self) -> (NetAttr, u64) {
        (*self.attr.lock(), self.attr_calls.load(Ordering::Relaxed))
    }

    /// Listen, send and receive comms open under this context.
    pub fn open_comms(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Has `finalize` run?
    #[inline]
    pub fn is_finalized(&self) -> bool {
        self.finalized.load(Ordering::Acquire)
    }

    /// Err naming the context when it was finalized.
    #[inline]
    pub fn check_live(&self, slot: &str) -> Result<()> {
        if self.is_finalized() {
            Err(self.finalized_error(slot))
        } else {
            Ok(())
        }
    }

    /// Err, for a call on one of its comms, when the context was finalized.
    #[inline]
    pub fn check_comm(&self) -> Result<()> {
        if self.is_finalized() {
            Err(Error::Usage(format!(
                "this comm belongs to the plugin context of communicator {:#x}, which was already finalized: only close works now",
                self.comm_id
            )))
        } else {
            Ok(())
        }
    }

    #[cold]
    fn finalized_error(&self, slot: &str) -> Error {
        Error::Usage(format!(
            "{slot}: the plugin context of communicator {:#x} was already finalized; its comms accept only close now",
            self.comm_id
        ))
    }

    /// A new member (a comm made under this context).
    pub fn member(self: &Arc<Self>) -> Member {
        self.open.fetch_add(1, Ordering::AcqRel);
        Member(self.clone())
    }

    /// `finalize`: end the context. Its pending connect attempts are dropped
    /// by `drop_connecting` (given the context's serial, it returns how many;
    /// the plugin's `drop_connecting_of`, passed in by the
    /// caller so that this module needs no edge back to the plugin).
    /// Refused (an error naming the count) while comms are still open;
    /// those comms then fail every call but close.
    pub fn finalize(&self, drop_connecting: impl FnOnce(u64) -> usize) -> Result<()> {
        if self.implicit {
            return Err(Error::Internal("the implicit context of ABI v6-v10 is never finalized".into()));
        }
        self.finalized.store(true, Ordering::Release);
        let dropped = drop_connecting(self.serial);
        let open = self.open_comms();
        let (a, calls) = self.attr();
        tracing::debug!(
            "context {:#x} finalized ({calls} setNetAttr call(s), last {a:?}; {dropped} pending connect(s) dropped)",
            self.comm_id
        );
        if open > 0 {
            return Err(Error::Usage(format!(
                "finalize: the plugin context of communicator {:#x} still has {open} listen/send/receive comm(s) open; \
                 close them first (they now fail every call but close)",
                self.comm_id
            )));
        }
        Ok(())
    }
}

/// A comm's share of its context: keeps the context alive and counted.
pub struct Member(Arc<NetContext>);

impl Member {
    /// The context.
    #[inline]
    pub fn ctx(&self) -> &Arc<NetContext> {
        &self.0
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

static IMPLICIT: crate::unload::Global<Arc<NetContext>> = crate::unload::Global::new();

/// The one context of the ABIs without contexts (v6-v10).
pub fn implicit() -> &'static Arc<NetContext> {
    IMPLICIT.get_or_init(|| Arc::new(NetContext::make(0, None, true)))
}

/// Unload: drop the implicit context.
///
/// # Safety
/// As [`crate::unload::Global::clear`]: no reference from [`implicit`] is alive.
pub(crate) unsafe fn release() {
    // SAFETY: our caller guarantees that no reference from `implicit` is
    // alive or used again (the unload hook saw no call and no handle), which
    // is Global::clear's contract.
    unsafe { IMPLICIT.clear() };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_count_and_finalize_refuses_while_open() {
        let c = NetContext::new(0xabc, Some(96), ProfilerCallback::NONE).unwrap();
        assert_eq!(c.traffic_class(), Some(96));
        let m1 = c.member();
        let m2 = c.member();
        assert_eq!(c.open_comms(), 2);
        drop(m1);
        let e = c.finalize(|_| 0).unwrap_err().to_string();
        assert!(e.contains("0xabc") && e.contains("1 listen/send/receive comm(s) open"), "{e}");
        // the remaining member sees the context gone, and keeps it alive
        let e = m2.ctx().check_live("isend").unwrap_err().to_string();
        assert!(e.contains("isend") && e.contains("already finalized"), "{e}");
        drop(c);
        assert!(m2.ctx().is_finalized());
        drop(m2);
    }

    #[test]
    fn finalize_with_nothing_open_succeeds_and_hints_are_recorded() {
        let c = NetContext::new(7, None, ProfilerCallback::NONE).unwrap();
        assert_eq!(c.attr(), (NetAttr::UNDEF, 0));
        let mut a = NetAttr::UNDEF;
        a.send.max_concurrent_peers = 8;
        a.op = 1 << 3;
        c.set_attr(a).unwrap();
        assert_eq!(c.attr(), (a, 1));
        c.finalize(|_| 0).unwrap();
        assert!(c.set_attr(a).is_err());
    }

    #[test]
    fn traffic_class_out_of_range_is_refused() {
        for bad in [256, -2, i32::MAX] {
            let e = NetContext::new(1, Some(bad), ProfilerCallback::NONE).err().unwrap().to_string();
            assert!(e.contains(&bad.to_string()) && e.contains("0..255"), "{e}");
        }
        assert!(implicit().finalize(|_| 0).is_err());
    }
}
