//! `ncclNetPlugin_v10` (NCCL 2.26 and later): profiler callback in init,
//! per-communicator traffic class in connect, profiler handles on isend/irecv.
use std::ffi::{c_int, c_void};

use super::common::{self as c, NET_NAME};
use super::sys::*;
use super::v8::{self, Vtable};
use super::{v9, VoidPtr};

unsafe extern "C" fn init(log: ncclDebugLogger_t, prof: ncclProfilerCallback_t) -> ncclResult_t {
    // NCCL fuses devices through makeVDevice: the plugin never self-merges
    crate::plugin::Plugin::nccl_fuses_devices();
    // v10 comms all belong to the implicit context: its profiler callback
    crate::context::implicit().set_profiler(super::profiler::core_callback(prof));
    let r = c::init(v8::logger(log));
    // the events' callback (process-wide, see abi/profiler.rs)
    super::profiler::set_callback(prof);
    r
}

unsafe extern "C" fn connect(
    dev: c_int,
    config: *mut ncclNetCommConfig_v10_t,
    handle: *mut c_void,
    sc: *mut VoidPtr,
    dc: *mut *mut ncclNetDeviceHandle_v10_t,
) -> ncclResult_t {
    // SAFETY: dc is NULL or NCCL's devComm out-pointer (ncclNet_v10_t's connect).
    unsafe { super::no_dev_comm(dc) };
    // SAFETY: config may be NULL (NCCL's GDR probe and bootstrap pass NULL).
    let tc = unsafe { config.as_ref() }.map(|c| c.trafficClass).filter(|&t| t != NCCL_NET_TRAFFIC_CLASS_UNDEF);
    // SAFETY: NCCL calls this slot as ncclNet_v10_t defines it (handle: the NCCL_NET_HANDLE_MAXSIZE
    // bytes the peer's listen filled; sendComm: an out-pointer), which is all c::connect assumes;
    // it checks NULLs and handles itself.
    unsafe { c::connect(c::Ctx::Implicit, dev, handle, sc, tc) }
}

pub(crate) unsafe extern "C" fn isend(
    sc: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    ph: *mut c_void,
    req: *mut VoidPtr,
) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v10_t defines it (data: `size` bytes under mhandle,
    // valid until test reports the request done; request: an out-pointer), which is all c::isend_p
    // assumes (ph: NULL or NCCL's profiler parent handle); it checks NULLs and handles itself.
    unsafe { c::isend_p(sc, data, size, tag, mh, ph, req) }
}

#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn irecv(
    rc: *mut c_void,
    n: c_int,
    data: *mut VoidPtr,
    sizes: *mut usize,
    tags: *mut c_int,
    mh: *mut VoidPtr,
    ph: *mut VoidPtr,
    req: *mut VoidPtr,
) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v10_t defines it (data, tags, mhandles: n entries
    // each, the buffers valid until test reports the request done; request: an out-pointer), which
    // is all c::irecv_p assumes (ph: NULL or n parent handles); it checks n, NULLs and handles itself.
    unsafe { c::irecv_p(rc, n, data, sizes, tags, mh, ph, req) }
}

/// The v10 vtable (NCCL 2.26 through 2.30 accept it).
#[no_mangle]
pub static ncclNetPlugin_v10: Vtable<ncclNet_v10_t> = Vtable(ncclNet_v10_t {
    name: NET_NAME.as_ptr(),
    init: Some(init),
    devices: Some(v8::devices),
    getProperties: Some(v9::get_properties),
    listen: Some(v8::listen),
    connect: Some(connect),
    accept: Some(v8::accept),
    regMr: Some(v8::reg_mr),
    regMrDmaBuf: Some(v8::reg_mr_dmabuf),
    deregMr: Some(v8::dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: Some(v8::iflush),
    test: Some(v8::test),
    closeSend: Some(v8::close_send),
    closeRecv: Some(v8::close_recv),
    closeListen: Some(v8::close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: Some(v9::make_vdevice),
});
