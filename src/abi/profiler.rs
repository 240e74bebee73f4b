//! The C half of the profiler events ([`crate::profiler`] is the safe half):
//! NCCL's `ncclProfilerCallback_t` from init, and the event descriptors in
//! the layouts of NCCL's `src/include/plugin/profiler/net_ib_v1.h` and
//! `net_socket_v1.h` (checked by the tests below).
//!
//! Calls, as NCCL's own transports make them (`docs/profiler.md`):
//! start: `cb(&eHandle, 0, parent, pluginId, &descr)` with `eHandle` NULL
//! before the call (NCCL's profiler fills it, or leaves it NULL when net
//! events are not activated); stop: `cb(&eHandle, 1, NULL, 0, NULL)`.
//! NCCL reads the descriptor during the start call only, so it lives on
//! our stack.
use std::ffi::{c_int, c_void};
use std::num::NonZeroUsize;
use std::sync::atomic::Ordering;

use super::sys::{ncclProfilerCallback_t, ncclResult_t};
use crate::profiler::{Fields, Parent, Sink};

/// `ncclProfilerNetEventStart` (`src/include/nccl_common.h`).
pub const EVENT_START: c_int = 0;
/// `ncclProfilerNetEventStop`.
pub const EVENT_STOP: c_int = 1;
/// `NCCL_PROFILER_NET_TYPE_IB` (`1 << 16`, `src/include/plugin/nccl_profiler.h`).
pub const NET_TYPE_IB: i64 = 1 << 16;
/// `NCCL_PROFILER_NET_TYPE_SOCK` (`2 << 16`).
pub const NET_TYPE_SOCK: i64 = 2 << 16;
/// `NCCL_PROFILER_NET_IB_VER` / the socket descriptor version.
pub const DESCR_VER: i64 = 1;
/// `ncclProfileQp` / `ncclProfileSocket`: the descriptor's `type` byte.
pub const DESCR_TYPE: u8 = 1;

/// `ncclProfilerNetIbDescr_v1_t`: the type byte, then the union (aligned
/// to 8 by its `uint64_t`/`size_t` members) holding `qp`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbDescrV1 {
    /// `ncclProfileQp`.
    pub ty: u8,
    /// The `qp` member.
    pub qp: IbQpV1,
}

/// The `qp` member of `ncclProfilerNetIbDescr_v1_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbQpV1 {
    /// Network device id.
    pub device: c_int,
    /// Work request id.
    pub wr_id: u64,
    /// ibv opcode.
    pub opcode: c_int,
    /// QP number.
    pub qp_num: c_int,
    /// Work request data length.
    pub length: usize,
}

/// `ncclProfilerNetSockDescr_v1_t`: the type byte, then the union holding `sock`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SockDescrV1 {
    /// `ncclProfileSocket`.
    pub ty: u8,
    /// The `sock` member.
    pub sock: SockV1,
}

/// The `sock` member of `ncclProfilerNetSockDescr_v1_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SockV1 {
    /// Socket descriptor.
    pub fd: c_int,
    /// NCCL_SOCKET_SEND (0) or NCCL_SOCKET_RECV (1).
    pub op: c_int,
    /// Bytes.
    pub length: usize,
}

/// NCCL's callback as the core keeps it (an opaque address; see
/// [`crate::context::ProfilerCallback`]).
pub fn core_callback(cb: ncclProfilerCallback_t) -> crate::context::ProfilerCallback {
    crate::context::ProfilerCallback::from_addr(cb.map_or(0, |f| f as usize))
}

/// Install the callback NCCL passed to init (NULL: events off). Every
/// init that carries one (v10 `init`, v11/v12 `init(ctx, ...)`) calls
/// this after the plugin initialised; NCCL passes the same function to all
/// (`ncclProfilerCallback`, `src/plugin/net.cc`), so one process-wide value
/// serves every context. `RUSTNET_PROFILER=0` keeps events off whatever
/// NCCL passes.
pub fn set_callback(cb: ncclProfilerCallback_t) {
    let on = crate::plugin::get().map_or(true, |p| p.cfg.profiler.get() == 1);
    let v = if on { cb.map_or(0, |f| f as usize) } else { 0 };
    crate::profiler::install(v, Sink { start, stop });
}

type Cb = unsafe extern "C" fn(*mut *mut c_void, c_int, *mut c_void, i64, *mut c_void) -> ncclResult_t;

fn as_cb(addr: NonZeroUsize) -> Cb {
    // SAFETY: every non-zero address the core holds (its CB, copied into an
    // OpenEvent) came from a `ncclProfilerCallback_t` in `set_callback`,
    // the one caller of the crate-private `profiler::install`.
    unsafe { std::mem::transmute::<usize, Cb>(addr.get()) }
}

/// Start one event with the callback at `cb`; its handle, or `None` when
/// the callback failed.
fn start(cb: NonZeroUsize, parent: Parent, f: &Fields) -> Option<usize> {
    match *f {
        Fields::Qp { device, qpn, opcode, wr_id, len } => {
            let mut d = IbDescrV1 { ty: DESCR_TYPE, qp: IbQpV1 { device, wr_id, opcode, qp_num: qpn as c_int, length: len } };
            call_start(cb, parent, NET_TYPE_IB | DESCR_VER, &mut d as *mut IbDescrV1 as *mut c_void)
        }
        Fields::Sock { fd, op, len } => {
            let mut d = SockDescrV1 { ty: DESCR_TYPE, sock: SockV1 { fd, op, length: len } };
            call_start(cb, parent, NET_TYPE_SOCK | DESCR_VER, &mut d as *mut SockDescrV1 as *mut c_void)
        }
    }
}

fn call_start(cb: NonZeroUsize, parent: Parent, plugin_id: i64, descr: *mut c_void) -> Option<usize> {
    let mut eh: *mut c_void = std::ptr::null_mut();
    // SAFETY: NCCL's callback with its documented arguments: a valid
    // out-pointer, NCCL's own parent handle (non-NULL: Parent), and a
    // descriptor on our caller's stack that outlives the call (NCCL reads
    // it during the call only).
    let r = unsafe { as_cb(cb)(&mut eh, EVENT_START, parent.addr() as *mut c_void, plugin_id, descr) };
    if r != ncclResult_t::ncclSuccess {
        warn_once(r);
        return None;
    }
    Some(eh as usize)
}

/// Stop one event (called from `OpenEvent`'s drop: exactly once).
fn stop(cb: NonZeroUsize, handle: usize) {
    let mut eh = handle as *mut c_void;
    // SAFETY: the callback this event was started with; `eh` is what it
    // wrote at start (possibly NULL, which NCCL's own transports pass too).
    let _ = unsafe { as_cb(cb)(&mut eh, EVENT_STOP, std::ptr::null_mut(), 0, std::ptr::null_mut()) };
}

fn warn_once(r: ncclResult_t) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!("NCCL's profiler callback refused an event start ({r:?}); such events are skipped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// The layouts NCCL's headers give on LP64 (x86_64, aarch64): the
    /// union starts at 8 (its members are aligned to 8 by uint64_t /
    /// size_t).
    #[test]
    fn descriptor_layouts_match_nccl_headers() {
        assert_eq!(size_of::<IbDescrV1>(), 40);
        let q = offset_of!(IbDescrV1, qp);
        assert_eq!(q, 8);
        assert_eq!(q + offset_of!(IbQpV1, device), 8);
        assert_eq!(q + offset_of!(IbQpV1, wr_id), 16);
        assert_eq!(q + offset_of!(IbQpV1, opcode), 24);
        assert_eq!(q + offset_of!(IbQpV1, qp_num), 28);
        assert_eq!(q + offset_of!(IbQpV1, length), 32);
        assert_eq!(size_of::<SockDescrV1>(), 24);
        let k = offset_of!(SockDescrV1, sock);
        assert_eq!(k + offset_of!(SockV1, fd), 8);
        assert_eq!(k + offset_of!(SockV1, op), 12);
        assert_eq!(k + offset_of!(SockV1, length), 16);
    }
}
