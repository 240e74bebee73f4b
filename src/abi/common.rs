//! Version-neutral slot bodies. Each exported version (v6..v10) converts its
//! own argument types and calls these.
use std::ffi::{c_char, c_int};

use super::{guard, nonnull, out, VoidPtr};
use crate::abi::sys::ncclResult_t;
use crate::error::{Error, Result};
use crate::plugin::{self, Comm, ListenComm, MemHandle, COMM_MAGIC, MR_MAGIC};
use crate::proto::handle::HANDLE_SIZE;
use crate::proto::pool::ReqId;
use crate::transport::{DeviceProps, MemKind, RawBuf, RecvBuf, MAX_RECVS, PTR_CUDA, PTR_DMABUF, PTR_HOST};

/// The `name` every vtable carries (what `NCCL_NET` matches).
pub(crate) const NET_NAME: &std::ffi::CStr = c"rustnet";

const ADDR_BITS: u32 = 48;
const ADDR_MASK: usize = (1usize << ADDR_BITS) - 1;

/// Box a comm for NCCL; its address must leave room for the request tag bits.
fn comm_into_raw(c: Comm) -> Result<VoidPtr> {
    let p = Box::into_raw(Box::new(c));
    if (p as usize) & !ADDR_MASK != 0 {
        // SAFETY: p came from Box::into_raw just above and was never shared.
        drop(unsafe { Box::from_raw(p) });
        return Err(Error::Internal("comm allocated above 2^48: request tagging impossible".into()));
    }
    Ok(p as VoidPtr)
}

/// Borrow a comm NCCL gave back.
unsafe fn comm_ref<'a>(p: VoidPtr, slot: &'static str) -> Result<&'a Comm> {
    let p = nonnull(p as *const Comm, slot, "comm")?;
    // SAFETY: NCCL passes back a pointer we returned from connect/accept and
    // has not closed it yet (the magic check catches some misuse).
    let c = unsafe { &*p };
    if c.magic != COMM_MAGIC {
        return Err(Error::InvalidArg(format!("{slot}: {p:p} is not a live librustnet comm")));
    }
    Ok(c)
}

fn encode_req(comm: &Comm, id: ReqId) -> VoidPtr {
    ((comm as *const Comm as usize) | (id.slot as usize) << ADDR_BITS | (id.gen as usize) << (ADDR_BITS + 8)) as VoidPtr
}

unsafe fn decode_req<'a>(r: VoidPtr) -> Result<(&'a Comm, ReqId)> {
    let v = r as usize;
    let addr = v & ADDR_MASK;
    if addr == 0 || addr % std::mem::align_of::<Comm>() != 0 {
        return Err(Error::InvalidArg(format!("test: {r:p} is not a librustnet request")));
    }
    // SAFETY: a request pointer we issued carries its comm's address; NCCL
    // tests requests only while the comm is open.
    let c = unsafe { comm_ref(addr as VoidPtr, "test")? };
    Ok((c, ReqId { slot: (v >> ADDR_BITS) as u8, gen: (v >> (ADDR_BITS + 8)) as u8 }))
}

/// init: remember NCCL's logger, parse the knobs, choose the transport.
pub(crate) fn init(logger: Option<crate::log::NcclLogger>) -> ncclResult_t {
    crate::log::set_nccl_logger(logger);
    guard("init", || plugin::init().map(|_| ()))
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

pub(crate) unsafe fn listen(dev: c_int, handle: VoidPtr, listen_comm: *mut VoidPtr) -> ncclResult_t {
    guard("listen", || {
        // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE bytes.
        let h = unsafe { (nonnull(handle as *const u8, "listen", "handle")? as *mut [u8; HANDLE_SIZE]).as_mut() }.unwrap();
        // SAFETY: out-pointer from NCCL.
        let lc = unsafe { out(listen_comm, "listen", "listenComm")? };
        let l = plugin::get()?.listen(dev, h)?;
        *lc = Box::into_raw(Box::new(l)) as VoidPtr;
        Ok(())
    })
}

pub(crate) unsafe fn connect(dev: c_int, handle: VoidPtr, send_comm: *mut VoidPtr, tc: Option<i32>) -> ncclResult_t {
    guard("connect", || {
        // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE bytes.
        let h = unsafe { (nonnull(handle as *const u8, "connect", "handle")? as *mut [u8; HANDLE_SIZE]).as_mut() }.unwrap();
        // SAFETY: out-pointer from NCCL.
        let sc = unsafe { out(send_comm, "connect", "sendComm")? };
        *sc = std::ptr::null_mut();
        if let Some(c) = plugin::get()?.connect(dev, h, tc)? {
            *sc = comm_into_raw(c)?;
        }
        Ok(())
    })
}

pub(crate) unsafe fn accept(listen_comm: VoidPtr, recv_comm: *mut VoidPtr) -> ncclResult_t {
    guard("accept", || {
        let l = nonnull(listen_comm as *const ListenComm, "accept", "listenComm")?;
        // SAFETY: out-pointer from NCCL.
        let rc = unsafe { out(recv_comm, "accept", "recvComm")? };
        *rc = std::ptr::null_mut();
        // SAFETY: a ListenComm we boxed in listen, not yet closed.
        if let Some(c) = plugin::get()?.accept(unsafe { &*l })? {
            *rc = comm_into_raw(c)?;
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
    guard("regMr", || {
        // SAFETY: comm from NCCL.
        let c = unsafe { comm_ref(comm, "regMr")? };
        // SAFETY: out-pointer from NCCL.
        let mh = unsafe { out(mhandle, "regMr", "mhandle")? };
        let m = plugin::get()?.reg_mr(c, RawBuf { ptr: data as *mut u8, len: size }, mem_kind(ty)?)?;
        *mh = Box::into_raw(Box::new(m)) as VoidPtr;
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
    guard("regMrDmaBuf", || {
        // SAFETY: comm from NCCL.
        let c = unsafe { comm_ref(comm, "regMrDmaBuf")? };
        // SAFETY: out-pointer from NCCL.
        let mh = unsafe { out(mhandle, "regMrDmaBuf", "mhandle")? };
        let m = plugin::get()?.reg_mr_dmabuf(c, RawBuf { ptr: data as *mut u8, len: size }, fd, offset)?;
        *mh = Box::into_raw(Box::new(m)) as VoidPtr;
        Ok(())
    })
}

unsafe fn mr_ref<'a>(m: VoidPtr) -> Option<&'a MemHandle> {
    // SAFETY: a MemHandle we boxed in regMr, not yet deregistered.
    let m = unsafe { (m as *const MemHandle).as_ref()? };
    (m.magic == MR_MAGIC).then_some(m)
}

pub(crate) unsafe fn dereg_mr(_comm: VoidPtr, mhandle: VoidPtr) -> ncclResult_t {
    guard("deregMr", || {
        let p = nonnull(mhandle as *const MemHandle, "deregMr", "mhandle")? as *mut MemHandle;
        // SAFETY: checked non-null; NCCL passes a handle from regMr.
        if unsafe { (*p).magic } != MR_MAGIC {
            return Err(Error::InvalidArg(format!("deregMr: {p:p} is not a live librustnet memory handle")));
        }
        // SAFETY: we own it from regMr; NCCL gives it back exactly once.
        let mut b = unsafe { Box::from_raw(p) };
        b.magic = 0;
        Ok(())
    })
}

pub(crate) unsafe fn isend(comm: VoidPtr, data: VoidPtr, size: usize, tag: c_int, mhandle: VoidPtr, request: *mut VoidPtr) -> ncclResult_t {
    guard("isend", || {
        // SAFETY: comm and out-pointer from NCCL.
        let (c, req) = unsafe { (comm_ref(comm, "isend")?, out(request, "isend", "request")?) };
        *req = std::ptr::null_mut();
        if size > 0 {
            nonnull(data as *const u8, "isend", "data")?;
        }
        // SAFETY: NCCL keeps `data` valid until the request completes; mhandle from regMr.
        let id = unsafe { c.isend(RawBuf { ptr: data as *mut u8, len: size }, tag, mr_ref(mhandle))? };
        if let Some(id) = id {
            *req = encode_req(c, id);
        }
        Ok(())
    })
}

/// `sizes` already converted to usize by the caller.
pub(crate) unsafe fn irecv(
    comm: VoidPtr,
    n: c_int,
    data: *mut VoidPtr,
    sizes: &[usize],
    tags: *mut c_int,
    mhandles: *mut VoidPtr,
    request: *mut VoidPtr,
) -> ncclResult_t {
    guard("irecv", || {
        // SAFETY: comm and out-pointer from NCCL.
        let (c, req) = unsafe { (comm_ref(comm, "irecv")?, out(request, "irecv", "request")?) };
        *req = std::ptr::null_mut();
        let n = n as usize;
        nonnull(data, "irecv", "data")?;
        nonnull(tags, "irecv", "tags")?;
        let mut bufs = [RecvBuf { buf: RawBuf::EMPTY, tag: 0 }; MAX_RECVS];
        let mut mrs: [Option<&MemHandle>; MAX_RECVS] = [None; MAX_RECVS];
        for i in 0..n {
            // SAFETY: NCCL passes arrays of n entries.
            unsafe {
                bufs[i] = RecvBuf { buf: RawBuf { ptr: *data.add(i) as *mut u8, len: sizes[i] }, tag: *tags.add(i) };
                if !mhandles.is_null() {
                    mrs[i] = mr_ref(*mhandles.add(i));
                }
            }
        }
        // SAFETY: NCCL keeps the buffers valid until the request completes.
        if let Some(id) = unsafe { c.irecv(&bufs[..n], &mrs[..n])? } {
            *req = encode_req(c, id);
        }
        Ok(())
    })
}

/// Convert NCCL's receive count and size array (int or size_t) to usize.
pub(crate) unsafe fn recv_sizes<T: Copy + TryInto<usize>>(n: c_int, sizes: *const T) -> Result<[usize; MAX_RECVS]> {
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
    guard("iflush", || {
        // SAFETY: comm and out-pointer from NCCL.
        let (c, req) = unsafe { (comm_ref(comm, "iflush")?, out(request, "iflush", "request")?) };
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
                        mrs[i] = mr_ref(*mhandles.add(i));
                    }
                }
            }
        }
        if let Some(id) = c.iflush(&bufs[..n], &mrs[..n])? {
            *req = encode_req(c, id);
        }
        Ok(())
    })
}

pub(crate) unsafe fn test(request: VoidPtr, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t {
    guard("test", || {
        // SAFETY: out-pointer from NCCL.
        let d = unsafe { out(done, "test", "done")? };
        *d = 0;
        // SAFETY: a request pointer we issued.
        let (c, id) = unsafe { decode_req(request)? };
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

unsafe fn close_comm(comm: VoidPtr, slot: &'static str) -> ncclResult_t {
    guard(slot, || {
        // SAFETY: comm from NCCL; checked before we take ownership.
        unsafe { comm_ref(comm, slot)? };
        // SAFETY: NCCL hands each comm back to close exactly once.
        let mut b = unsafe { Box::from_raw(comm as *mut Comm) };
        b.magic = 0;
        Ok(())
    })
}

pub(crate) unsafe fn close_send(comm: VoidPtr) -> ncclResult_t {
    // SAFETY: forwarded.
    unsafe { close_comm(comm, "closeSend") }
}

pub(crate) unsafe fn close_recv(comm: VoidPtr) -> ncclResult_t {
    // SAFETY: forwarded.
    unsafe { close_comm(comm, "closeRecv") }
}

pub(crate) unsafe fn close_listen(comm: VoidPtr) -> ncclResult_t {
    guard("closeListen", || {
        let p = nonnull(comm as *const ListenComm, "closeListen", "listenComm")? as *mut ListenComm;
        // SAFETY: a ListenComm we boxed in listen; NCCL closes it once.
        drop(unsafe { Box::from_raw(p) });
        Ok(())
    })
}
