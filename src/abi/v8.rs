//! `ncclNetPlugin_v8`: the primary export (NCCL 2.20 and later accept it).
use std::ffi::{c_int, c_void};

use super::common::{self as c, c_str_or_null, NET_NAME};
use super::sys::*;
use super::{guard, out, VoidPtr};

/// Hands NCCL's logger to the log module.
pub(crate) fn logger(f: ncclDebugLogger_t) -> Option<crate::log::NcclLogger> {
    // SAFETY: identical C signatures; the level enum is passed as a 32-bit int either way.
    f.map(|f| unsafe { std::mem::transmute::<_, crate::log::NcclLogger>(f) })
}

/// init of v6-v8 (v9 adds its fusing rule, v10+ the profiler).
pub(crate) unsafe extern "C" fn init(log: ncclDebugLogger_t) -> ncclResult_t {
    c::init(logger(log))
}

/// devices of every version (one C signature from v6 to v12).
pub(crate) unsafe extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v6_t..v12_t define it (ndev: an out-pointer for one
    // int), which is all c::devices assumes; it checks NULLs and handles itself.
    unsafe { c::devices(ndev) }
}

unsafe extern "C" fn get_properties(dev: c_int, props: *mut ncclNetProperties_v8_t) -> ncclResult_t {
    guard("getProperties", || {
        // SAFETY: out-pointer from NCCL.
        let p = unsafe { out(props, "getProperties", "props")? };
        let d = c::properties(dev)?;
        *p = ncclNetProperties_v8_t {
            name: d.name.as_ptr() as *mut _,
            pciPath: c_str_or_null(d.pci_path),
            guid: d.guid,
            ptrSupport: d.ptr_support,
            regIsGlobal: d.reg_is_global as c_int,
            speed: d.speed_mbps,
            port: d.port,
            latency: d.latency_us,
            maxComms: d.max_comms,
            maxRecvs: d.max_recvs,
            netDeviceType: ncclNetDeviceType::NCCL_NET_DEVICE_HOST,
            netDeviceVersion: NCCL_NET_DEVICE_INVALID_VERSION as c_int,
        };
        Ok(())
    })
}

pub(crate) unsafe extern "C" fn listen(dev: c_int, handle: *mut c_void, lc: *mut VoidPtr) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (handle: NCCL_NET_HANDLE_MAXSIZE
    // writable bytes; listenComm: an out-pointer), which is all c::listen assumes; it checks NULLs
    // and handles itself.
    unsafe { c::listen(c::Ctx::Implicit, dev, handle, lc) }
}

/// connect of v7-v9 (one C signature: every devComm handle type is v7's).
pub(crate) unsafe extern "C" fn connect(
    dev: c_int,
    handle: *mut c_void,
    sc: *mut VoidPtr,
    dc: *mut *mut ncclNetDeviceHandle_v7_t,
) -> ncclResult_t {
    // SAFETY: dc is NULL or NCCL's devComm out-pointer (ncclNet_v7_t..v9_t's connect).
    unsafe { super::no_dev_comm(dc) };
    // SAFETY: NCCL calls this slot as ncclNet_v7_t..v9_t define it (handle: the NCCL_NET_HANDLE_MAXSIZE
    // bytes the peer's listen filled; sendComm: an out-pointer), which is all c::connect assumes;
    // it checks NULLs and handles itself.
    unsafe { c::connect(c::Ctx::Implicit, dev, handle, sc, None) }
}

/// accept of v7-v12 (one C signature: every devComm handle type is v7's).
pub(crate) unsafe extern "C" fn accept(lc: *mut c_void, rc: *mut VoidPtr, dc: *mut *mut ncclNetDeviceHandle_v7_t) -> ncclResult_t {
    // SAFETY: dc is NULL or NCCL's devComm out-pointer (ncclNet_v7_t..v12_t's accept).
    unsafe { super::no_dev_comm(dc) };
    // SAFETY: NCCL calls this slot as ncclNet_v7_t..v12_t define it (listenComm: what listen returned;
    // recvComm: an out-pointer), which is all c::accept assumes; it checks NULLs and handles
    // itself.
    unsafe { c::accept(lc, rc) }
}

pub(crate) unsafe extern "C" fn reg_mr(comm: *mut c_void, data: *mut c_void, size: usize, ty: c_int, mh: *mut VoidPtr) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (data: `size` bytes of memory of type
    // `type`, allocated until deregMr; mhandle: an out-pointer), which is all c::reg_mr assumes; it
    // checks NULLs and handles itself.
    unsafe { c::reg_mr(comm, data, size, ty, mh) }
}

pub(crate) unsafe extern "C" fn reg_mr_dmabuf(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    offset: u64,
    fd: c_int,
    mh: *mut VoidPtr,
) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (data: `size` bytes of memory of type
    // `type`, which fd/offset also describe, allocated until deregMr; mhandle: an out-pointer),
    // which is all c::reg_mr_dmabuf assumes; it checks NULLs and handles itself.
    unsafe { c::reg_mr_dmabuf(comm, data, size, ty, offset, fd, mh) }
}

pub(crate) unsafe extern "C" fn dereg_mr(comm: *mut c_void, mh: *mut c_void) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (mhandle: what regMr returned, used
    // by no pending request), which is all c::dereg_mr assumes; it checks NULLs and handles itself.
    unsafe { c::dereg_mr(comm, mh) }
}

pub(crate) unsafe extern "C" fn isend(
    sc: *mut c_void,
    data: *mut c_void,
    size: c_int,
    tag: c_int,
    mh: *mut c_void,
    req: *mut VoidPtr,
) -> ncclResult_t {
    if size < 0 {
        return guard("isend", || Err(crate::error::Error::InvalidArg(format!("isend size {size} is negative"))));
    }
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (data: `size` bytes under mhandle,
    // valid until test reports the request done; request: an out-pointer), which is all c::isend
    // assumes; it checks NULLs and handles itself.
    unsafe { c::isend(sc, data, size as usize, tag, mh, req) }
}

pub(crate) unsafe extern "C" fn irecv(
    rc: *mut c_void,
    n: c_int,
    data: *mut VoidPtr,
    sizes: *mut c_int,
    tags: *mut c_int,
    mh: *mut VoidPtr,
    req: *mut VoidPtr,
) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (data, sizes, tags, mhandles: n
    // entries each, the buffers valid until test reports the request done; request: an
    // out-pointer), which is all c::irecv_p assumes (no parent handles before v10: NULL); it
    // checks n, NULLs and handles itself.
    unsafe { c::irecv_p(rc, n, data, sizes, tags, mh, std::ptr::null_mut(), req) }
}

pub(crate) unsafe extern "C" fn iflush(
    rc: *mut c_void,
    n: c_int,
    data: *mut VoidPtr,
    sizes: *mut c_int,
    mh: *mut VoidPtr,
    req: *mut VoidPtr,
) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (data, sizes, mhandles: n entries
    // each; request: an out-pointer), which is all c::iflush assumes; it checks NULLs and handles
    // itself.
    unsafe { c::iflush(rc, n, data, sizes, mh, req) }
}

pub(crate) unsafe extern "C" fn test(req: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (request: what isend/irecv/iflush
    // returned; done: an out-pointer; sizes: NULL or room for the request's n ints), which is all
    // c::test assumes; it checks NULLs and handles itself.
    unsafe { c::test(req, done, sizes) }
}

pub(crate) unsafe extern "C" fn close_send(c: *mut c_void) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (a send comm handle, on which NCCL
    // makes no other call from now on), which is all c::close_send assumes; it checks NULLs and
    // handles itself.
    unsafe { c::close_send(c) }
}

pub(crate) unsafe extern "C" fn close_recv(c: *mut c_void) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (a receive comm handle, on which NCCL
    // makes no other call from now on), which is all c::close_recv assumes; it checks NULLs and
    // handles itself.
    unsafe { c::close_recv(c) }
}

pub(crate) unsafe extern "C" fn close_listen(c: *mut c_void) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v8_t defines it (a listen comm handle, on which NCCL
    // makes no other call from now on), which is all c::close_listen assumes; it checks NULLs and
    // handles itself.
    unsafe { c::close_listen(c) }
}

/// A vtable in a `static`: the raw `name` pointer is to a `'static` C string.
#[repr(transparent)]
pub struct Vtable<T>(pub T);
// SAFETY: the tables are immutable; their only pointer is a 'static string.
unsafe impl<T> Sync for Vtable<T> {}

/// The v8 vtable NCCL looks up.
#[no_mangle]
pub static ncclNetPlugin_v8: Vtable<ncclNet_v8_t> = Vtable(ncclNet_v8_t {
    name: NET_NAME.as_ptr(),
    init: Some(init),
    devices: Some(devices),
    getProperties: Some(get_properties),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    regMr: Some(reg_mr),
    regMrDmaBuf: Some(reg_mr_dmabuf),
    deregMr: Some(dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
});
