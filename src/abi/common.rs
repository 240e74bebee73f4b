//! Version-neutral slot bodies. Each exported version (v6..v12) converts its
//! own argument types and calls these.
//!
//! Safety contract of every `unsafe fn` here: the caller (a vtable slot)
//! passes the arguments NCCL passed it, as the slot's `ncclNet_vN_t` defines
//! them: out-pointers writable for one value of their type, `handle` pointing
//! at NCCL_NET_HANDLE_MAXSIZE bytes, arrays holding `n` entries, buffers
//! valid until their request completes (or, for regMr, until deregMr). NULLs
//! and comm, request or mhandle values this library did not hand out are
//! checked here and refused with an error: only what NCCL guarantees about
//! the non-NULL pointers it passes is assumed.
use std::ffi::{c_char, c_int};
use std::sync::Arc;

use super::handles::{self, comm_ref, mr_ref};
use super::{guard, guard_on, nonnull, out, VoidPtr};
use crate::abi::sys::ncclResult_t;
use crate::context::{NetAttr, NetContext};
use crate::error::{Error, Result};
use crate::plugin::{self, Dir, MemHandle};
use crate::profiler::{Parent, Profiler};
use crate::proto::handle::HANDLE_SIZE;
use crate::transport::{DeviceProps, MemKind, RawBuf, RecvBuf, MAX_RECVS, PTR_CUDA, PTR_DMABUF, PTR_HOST};

/// The `name` every vtable carries (what `NCCL_NET` matches).
pub(crate) const NET_NAME: &std::ffi::CStr = c"rustnet";

/// init: remember NCCL's logger, parse the knobs, choose the transport.
pub(crate) fn init(logger: Option<crate::log::NcclLogger>) -> ncclResult_t {
    crate::log::set_nccl_logger(logger);
    crate::unload::serving();
    guard("init", || plugin::init().map(|_| ()))
}

/// Which context a listen or connect works for.
#[derive(Clone, Copy)]
pub(crate) enum Ctx {
    /// v6-v10: the one implicit context.
    Implicit,
    /// v11+: the handle NCCL got from init.
    Handle(VoidPtr),
}

impl Ctx {
    fn get(self, slot: &'static str) -> Result<Arc<NetContext>> {
        match self {
            Ctx::Implicit => Ok(crate::context::implicit().clone()),
            Ctx::Handle(h) => {
                nonnull(h, slot, "ctx")?;
                Ok(handles::ctx_ref(h, slot)?.clone())
            }
        }
    }
}

/// v11+ init: the process-wide init (once), then a new context for the
/// communicator `comm_id` with its traffic class, handed to NCCL in `*ctx`.
pub(crate) unsafe fn init_ctx(
    ctx: *mut VoidPtr,
    comm_id: u64,
    traffic_class: Option<i32>,
    logger: Option<crate::log::NcclLogger>,
    profiler: crate::context::ProfilerCallback,
) -> ncclResult_t {
    crate::log::set_nccl_logger(logger);
    crate::unload::serving();
    guard("init", || {
        // SAFETY: out-pointer from NCCL.
        let out_ctx = unsafe { out(ctx, "init", "ctx")? };
        *out_ctx = std::ptr::null_mut();
        plugin::init()?;
        let c = NetContext::new(comm_id, traffic_class, profiler)?;
        tracing::debug!(
            "context for communicator {comm_id:#x}: traffic class {}",
            traffic_class.map_or_else(|| "undefined".to_string(), |t| t.to_string())
        );
        *out_ctx = handles::ctx_new(c)?;
        Ok(())
    })
}

/// v11+ finalize: the context's handle dies; refused (after that) while its
/// comms are open.
pub(crate) fn finalize(ctx: VoidPtr) -> ncclResult_t {
    guard("finalize", || {
        nonnull(ctx, "finalize", "ctx")?;
        let c = handles::ctx_take(ctx, "finalize")?;
        c.finalize(crate::plugin::drop_connecting_of)
    })
}

/// v11+ setNetAttr: record the hints on the context.
pub(crate) fn set_net_attr(ctx: VoidPtr, attr: Option<NetAttr>) -> ncclResult_t {
    guard("setNetAttr", || {
        nonnull(ctx, "setNetAttr", "ctx")?;
        let a = attr.ok_or(Error::NullArg { slot: "setNetAttr", arg: "netAttr" })?;
        handles::ctx_ref(ctx, "setNetAttr")?.set_attr(a)
    })
}

pub(crate) unsafe fn devices(ndev: *mut c_int) -> ncclResult_t {
    guard("devices", || {
        // SAFETY: out-pointer from NCCL.
        let n = unsafe { out(ndev, "devices", "ndev")? };
        *n = plugin::get()?.devices() as c_int;
        Ok(())
    })
}

/// Properties in neutral form, for the per-version getProperties.
pub(crate) fn properties(dev: c_int) -> Result<DeviceProps> {
    plugin::get()?.properties(dev)
}

pub(crate) fn c_str_or_null(s: Option<&'static std::ffi::CStr>) -> *mut c_char {
    s.map_or(std::ptr::null_mut(), |s| s.as_ptr() as *mut c_char)
}

pub(crate) unsafe fn listen(ctx: Ctx, dev: c_int, handle: VoidPtr, listen_comm: *mut VoidPtr) -> ncclResult_t {
    guard("listen", || {
        let ctx = ctx.get("listen")?;
        // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE bytes; NULL is rejected.
        let h = unsafe { out(handle as *mut [u8; HANDLE_SIZE], "listen", "handle")? };
        // SAFETY: out-pointer from NCCL.
        let lc = unsafe { out(listen_comm, "listen", "listenComm")? };
        let l = plugin::get()?.listen(&ctx, dev, h)?;
        *lc = handles::listen_new(l)?;
        Ok(())
    })
}

pub(crate) unsafe fn connect(ctx: Ctx, dev: c_int, handle: VoidPtr, send_comm: *mut VoidPtr, tc: Option<i32>) -> ncclResult_t {
    guard("connect", || {
        let ctx = ctx.get("connect")?;
        // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE bytes; NULL is rejected.
        let h = unsafe { out(handle as *mut [u8; HANDLE_SIZE], "connect", "handle")? };
        // SAFETY: out-pointer from NCCL.
        let sc = unsafe { out(send_comm, "connect", "sendComm")? };
        *sc = std::ptr::null_mut();
        if let Some(c) = plugin::get()?.connect(&ctx, dev, h, tc)? {
            *sc = handles::comm_new(c)?;
        }
        Ok(())
    })
}

pub(crate) unsafe fn accept(listen_comm: VoidPtr, recv_comm: *mut VoidPtr) -> ncclResult_t {
    guard("accept", || {
        nonnull(listen_comm, "accept", "listenComm")?;
        let l = handles::listen_ref(listen_comm, "accept")?;
        // SAFETY: out-pointer from NCCL.
        let rc = unsafe { out(recv_comm, "accept", "recvComm")? };
        *rc = std::ptr::null_mut();
        if let Some(c) = plugin::get()?.accept(l)? {
            *rc = handles::comm_new(c)?;
        }
        Ok(())
    })
}

fn mem_kind(ty: c_int) -> Result<MemKind> {
    match ty {
        t if t == PTR_HOST => Ok(MemKind::Host),
        t if t == PTR_CUDA || t == PTR_DMABUF => Ok(MemKind::Cuda),
        t => Err(Error::InvalidArg(format!("regMr: unknown pointer type {t}"))),
    }
}

pub(crate) unsafe fn reg_mr(comm: VoidPtr, data: VoidPtr, size: usize, ty: c_int, mhandle: *mut VoidPtr) -> ncclResult_t {
    guard_on("regMr", comm, || {
        let c = live_comm(comm, None, "regMr")?;
        // SAFETY: out-pointer from NCCL.
        let mh = unsafe { out(mhandle, "regMr", "mhandle")? };
        let m = plugin::get()?.reg_mr(c, RawBuf { ptr: data as *mut u8, len: size }, mem_kind(ty)?)?;
        *mh = handles::mr_new(m)?;
        Ok(())
    })
}

pub(crate) unsafe fn reg_mr_dmabuf(
    comm: VoidPtr,
    data: VoidPtr,
    size: usize,
    _ty: c_int,
    offset: u64,
    fd: c_int,
    mhandle: *mut VoidPtr,
) -> ncclResult_t {
    guard_on("regMrDmaBuf", comm, || {
        let c = live_comm(comm, None, "regMrDmaBuf")?;
        // SAFETY: out-pointer from NCCL.
        let mh = unsafe { out(mhandle, "regMrDmaBuf", "mhandle")? };
        let m = plugin::get()?.reg_mr_dmabuf(c, RawBuf { ptr: data as *mut u8, len: size }, fd, offset)?;
        *mh = handles::mr_new(m)?;
        Ok(())
    })
}

/// A comm that is not failed by an earlier panic.
#[inline]
fn live_comm<'a>(h: VoidPtr, dir: Option<Dir>, slot: &'static str) -> Result<&'a plugin::Comm> {
    nonnull(h, slot, "comm")?;
    let c = match dir {
        Some(d) => handles::comm_ref_dir(h, d, slot)?,
        None => comm_ref(h, slot)?,
    };
    c.check_usable()?;
    Ok(c)
}

/// An optional memory handle: NULL is none, anything else must be live.
#[inline]
fn opt_mr<'a>(h: VoidPtr, slot: &'static str) -> Result<Option<&'a MemHandle>> {
    if h.is_null() {
        Ok(None)
    } else {
        mr_ref(h, slot).map(Some)
    }
}

pub(crate) unsafe fn dereg_mr(_comm: VoidPtr, mhandle: VoidPtr) -> ncclResult_t {
    guard("deregMr", || {
        nonnull(mhandle, "deregMr", "mhandle")?;
        drop(handles::mr_take(mhandle, "deregMr")?);
        Ok(())
    })
}

pub(crate) unsafe fn isend(comm: VoidPtr, data: VoidPtr, size: usize, tag: c_int, mhandle: VoidPtr, request: *mut VoidPtr) -> ncclResult_t {
    // SAFETY: isend_p assumes what this fn's callers (the v6-v9 isend slots)
    // hold from NCCL: data valid for size bytes until the request is done,
    // request an out-pointer; it checks NULLs and handles itself. A NULL
    // parent handle: there is none before v10.
    unsafe { isend_p(comm, data, size, tag, mhandle, std::ptr::null_mut(), request) }
}

/// NCCL's profiler parent handle, when events are on (NULL: none).
#[inline]
fn parent(ph: VoidPtr) -> Option<Parent> {
    if Profiler::enabled() {
        Parent::from_addr(ph as usize)
    } else {
        None
    }
}

/// isend with NCCL's profiler parent handle `phandle` (v10+).
pub(crate) unsafe fn isend_p(
    comm: VoidPtr,
    data: VoidPtr,
    size: usize,
    tag: c_int,
    mhandle: VoidPtr,
    phandle: VoidPtr,
    request: *mut VoidPtr,
) -> ncclResult_t {
    guard_on("isend", comm, || {
        let c = live_comm(comm, Some(Dir::Send), "isend")?;
        // SAFETY: out-pointer from NCCL.
        let req = unsafe { out(request, "isend", "request")? };
        *req = std::ptr::null_mut();
        if size > 0 {
            nonnull(data as *const u8, "isend", "data")?;
        }
        // SAFETY: NCCL keeps `data` valid until the request completes; mhandle from regMr.
        let id = unsafe { c.isend(RawBuf { ptr: data as *mut u8, len: size }, tag, opt_mr(mhandle, "isend")?, parent(phandle))? };
        if let Some(id) = id {
            *req = handles::req_encode(comm, id);
        }
        Ok(())
    })
}

/// irecv of every version: `sizes` are NCCL's (int up to v8, size_t from
/// v9); `phandles` its profiler parent handles (v10+; the array, or NULL for
/// none). The count and sizes are checked first, then the comm.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn irecv_p<T: Copy + TryInto<usize>>(
    comm: VoidPtr,
    n: c_int,
    data: *mut VoidPtr,
    sizes: *const T,
    tags: *mut c_int,
    mhandles: *mut VoidPtr,
    phandles: *mut VoidPtr,
    request: *mut VoidPtr,
) -> ncclResult_t {
    guard_on("irecv", comm, || {
        // SAFETY: NCCL passes n sizes (recv_sizes checks n and NULL first).
        let sizes = unsafe { recv_sizes(n, sizes)? };
        let c = live_comm(comm, Some(Dir::Recv), "irecv")?;
        // SAFETY: out-pointer from NCCL.
        let req = unsafe { out(request, "irecv", "request")? };
        *req = std::ptr::null_mut();
        let n = n as usize;
        nonnull(data, "irecv", "data")?;
        nonnull(tags, "irecv", "tags")?;
        let mut bufs = [RecvBuf { buf: RawBuf::EMPTY, tag: 0 }; MAX_RECVS];
        let mut mrs: [Option<&MemHandle>; MAX_RECVS] = [None; MAX_RECVS];
        let mut parents = [None; MAX_RECVS];
        let with_parents = !phandles.is_null() && Profiler::enabled();
        for i in 0..n {
            // SAFETY: NCCL passes arrays of n entries (phandles too, when not NULL).
            unsafe {
                bufs[i] = RecvBuf { buf: RawBuf { ptr: *data.add(i) as *mut u8, len: sizes[i] }, tag: *tags.add(i) };
                if !mhandles.is_null() {
                    mrs[i] = opt_mr(*mhandles.add(i), "irecv")?;
                }
                if with_parents {
                    parents[i] = parent(*phandles.add(i));
                }
            }
        }
        // SAFETY: NCCL keeps the buffers valid until the request completes.
        if let Some(id) = unsafe { c.irecv(&bufs[..n], &mrs[..n], &parents[..n])? } {
            *req = handles::req_encode(comm, id);
        }
        Ok(())
    })
}

/// Convert NCCL's receive count and size array (int or size_t) to usize.
unsafe fn recv_sizes<T: Copy + TryInto<usize>>(n: c_int, sizes: *const T) -> Result<[usize; MAX_RECVS]> {
    if n < 1 || n as usize > MAX_RECVS {
        return Err(Error::InvalidArg(format!("irecv with n={n} (1..={MAX_RECVS} accepted, maxRecvs)")));
    }
    nonnull(sizes, "irecv", "sizes")?;
    let mut out = [0usize; MAX_RECVS];
    for (i, o) in out.iter_mut().enumerate().take(n as usize) {
        // SAFETY: NCCL passes n sizes.
        let v = unsafe { *sizes.add(i) };
        *o = v.try_into().map_err(|_| Error::InvalidArg(format!("irecv: size[{i}] is negative")))?;
    }
    Ok(out)
}

pub(crate) unsafe fn iflush(
    comm: VoidPtr,
    n: c_int,
    data: *mut VoidPtr,
    sizes: *mut c_int,
    mhandles: *mut VoidPtr,
    request: *mut VoidPtr,
) -> ncclResult_t {
    guard_on("iflush", comm, || {
        let c = live_comm(comm, Some(Dir::Recv), "iflush")?;
        // SAFETY: out-pointer from NCCL.
        let req = unsafe { out(request, "iflush", "request")? };
        *req = std::ptr::null_mut();
        let n = (n.max(0) as usize).min(MAX_RECVS);
        let mut bufs = [RawBuf::EMPTY; MAX_RECVS];
        let mut mrs: [Option<&MemHandle>; MAX_RECVS] = [None; MAX_RECVS];
        if !data.is_null() && !sizes.is_null() {
            for (i, b) in bufs.iter_mut().enumerate().take(n) {
                // SAFETY: NCCL passes n entries (and n mhandles from regMr when non-NULL).
                unsafe {
                    *b = RawBuf { ptr: *data.add(i) as *mut u8, len: (*sizes.add(i)).max(0) as usize };
                    if !mhandles.is_null() {
                        mrs[i] = opt_mr(*mhandles.add(i), "iflush")?;
                    }
                }
            }
        }
        if let Some(id) = c.iflush(&bufs[..n], &mrs[..n])? {
            *req = handles::req_encode(comm, id);
        }
        Ok(())
    })
}

pub(crate) unsafe fn test(request: VoidPtr, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t {
    guard_on("test", request, || {
        // SAFETY: out-pointer from NCCL.
        let d = unsafe { out(done, "test", "done")? };
        *d = 0;
        let (c, id) = handles::req_decode(request)?;
        c.check_usable()?;
        if let Some(comp) = c.test(id)? {
            *d = 1;
            if !sizes.is_null() {
                for i in 0..comp.n {
                    // SAFETY: NCCL's sizes array holds one int per receive buffer.
                    unsafe { *sizes.add(i) = comp.sizes[i].min(c_int::MAX as usize) as c_int };
                }
            }
        }
        Ok(())
    })
}

fn close_comm(comm: VoidPtr, d: Dir, slot: &'static str) -> ncclResult_t {
    guard(slot, || {
        nonnull(comm, slot, "comm")?;
        // the recovery keeper's thread lets go of the comm first (a look in
        // progress ends), while the comm is still only shared
        if let Ok(c) = handles::comm_ref_dir(comm, d, slot) {
            c.stop_keeping();
        }
        // a comm failed by a panic closes like any other: its drop frees
        // whatever state the panic left
        drop(handles::comm_take(comm, d, slot)?);
        after_close();
        Ok(())
    })
}

pub(crate) unsafe fn close_send(comm: VoidPtr) -> ncclResult_t {
    close_comm(comm, Dir::Send, "closeSend")
}

pub(crate) unsafe fn close_recv(comm: VoidPtr) -> ncclResult_t {
    close_comm(comm, Dir::Recv, "closeRecv")
}

pub(crate) unsafe fn close_listen(comm: VoidPtr) -> ncclResult_t {
    guard("closeListen", || {
        nonnull(comm, "closeListen", "listenComm")?;
        drop(handles::listen_take(comm, "closeListen")?);
        after_close();
        Ok(())
    })
}

/// The last comm closed: the heap the comms used goes back to the system
/// (thousands of comms leave hundreds of MB that the allocator would keep;
/// a handful leave too little to be worth the walk, see `TRIM_PEAK`).
fn after_close() {
    if handles::heap_trim_due() {
        crate::transport::give_back_heap();
    }
}
