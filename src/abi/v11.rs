//! `ncclNetPlugin_v11` (NCCL 2.28 and later): per-communicator contexts.
//! `init` runs once per communicator and returns a context (the
//! process-wide set-up still happens once); `listen` and `connect` name it;
//! `finalize` ends it; `setNetAttr` passes NCCL's hints. The traffic class
//! comes with `init` instead of each `connect`. Everything else is v10.
use std::ffi::{c_int, c_void};

use super::common::{self as c, Ctx, NET_NAME};
use super::sys::*;
use super::v8::{self, Vtable};
use super::{guard, out, v10, v9, VoidPtr};
use crate::context::{CommAttr, NetAttr};

/// What a v11+ property struct reports for `maxMultiRequestSize`: one
/// request per multi-request, i.e. none grouped (what NCCL assumes for
/// plugins older than v11; `NCCL_NET_MULTI_REQUEST` is not consumed yet).
pub(crate) const MAX_MULTI_REQUEST_SIZE: c_int = 1;

/// init (v11, v12): a context for the communicator `comm_id`.
pub(crate) unsafe extern "C" fn init(
    ctx: *mut VoidPtr,
    comm_id: u64,
    config: *mut ncclNetCommConfig_v11_t,
    log: ncclDebugLogger_t,
    prof: ncclProfilerCallback_t,
) -> ncclResult_t {
    // NCCL fuses devices through makeVDevice: the plugin never self-merges
    crate::plugin::Plugin::nccl_fuses_devices();
    // SAFETY: config may be NULL (no class); else NCCL's struct for this call.
    let tc = unsafe { config.as_ref() }.map(|c| c.trafficClass).filter(|&t| t != NCCL_NET_TRAFFIC_CLASS_UNDEF);
    // SAFETY: NCCL calls this slot as ncclNet_v11_t defines it (ctx: an
    // out-pointer for the new context), which is all c::init_ctx assumes; it
    // checks NULL itself.
    let r = unsafe { c::init_ctx(ctx, comm_id, tc, v8::logger(log), super::profiler::core_callback(prof)) };
    // the events' callback (process-wide: NCCL passes the same one to every context)
    super::profiler::set_callback(prof);
    r
}

pub(crate) unsafe extern "C" fn listen(ctx: *mut c_void, dev: c_int, handle: *mut c_void, lc: *mut VoidPtr) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v11_t defines it (ctx: its
    // context handle; handle: NCCL_NET_HANDLE_MAXSIZE writable bytes;
    // listenComm: an out-pointer), which is all c::listen assumes; it checks
    // NULLs and handles (the context's too) itself.
    unsafe { c::listen(Ctx::Handle(ctx), dev, handle, lc) }
}

pub(crate) unsafe extern "C" fn connect(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    sc: *mut VoidPtr,
    dc: *mut *mut ncclNetDeviceHandle_v11_t,
) -> ncclResult_t {
    // SAFETY: dc is NULL or NCCL's devComm out-pointer (ncclNet_v11_t's connect).
    unsafe { super::no_dev_comm(dc) };
    // SAFETY: NCCL calls this slot as ncclNet_v11_t defines it (ctx: its
    // context handle; handle: the bytes the peer's listen filled; sendComm:
    // an out-pointer), which is all c::connect assumes; it checks NULLs and
    // handles (the context's too) itself.
    unsafe { c::connect(Ctx::Handle(ctx), dev, handle, sc, None) }
}

pub(crate) unsafe extern "C" fn finalize(ctx: *mut c_void) -> ncclResult_t {
    c::finalize(ctx)
}

fn comm_attr(a: &ncclNetCommAttr_v11_t) -> CommAttr {
    CommAttr {
        max_concurrent_peers: a.maxConcurrentPeers,
        min_concurrent_peers: a.minConcurrentPeers,
        max_flows_per_peer: a.maxFlowsPerPeer,
        min_flows_per_peer: a.minFlowsPerPeer,
    }
}

pub(crate) unsafe extern "C" fn set_net_attr(ctx: *mut c_void, attr: *mut ncclNetAttr_v11_t) -> ncclResult_t {
    // SAFETY: NCCL's struct for the duration of the call; NULL is reported.
    let a = unsafe { attr.as_ref() }.map(|a| NetAttr {
        send: comm_attr(&a.sendCommAttr),
        recv: comm_attr(&a.recvCommAttr),
        op: a.op,
        algo: a.algo,
        proto: a.proto,
    });
    c::set_net_attr(ctx, a)
}

unsafe extern "C" fn get_properties(dev: c_int, props: *mut ncclNetProperties_v11_t) -> ncclResult_t {
    guard("getProperties", || {
        // SAFETY: out-pointer from NCCL.
        let p = unsafe { out(props, "getProperties", "props")? };
        let d = c::properties(dev)?;
        let mut v = ncclNetVDeviceProps_v11_t { ndevs: 0, devs: [0; 4] };
        v.ndevs = v9::vprops_into(dev, &mut v.devs);
        *p = v9::properties_v9_on!(ncclNetProperties_v11_t, &d, v, maxMultiRequestSize: MAX_MULTI_REQUEST_SIZE);
        Ok(())
    })
}

/// The v11 vtable (NCCL 2.28, 2.29 load it first; 2.30 after v12).
#[no_mangle]
pub static ncclNetPlugin_v11: Vtable<ncclNet_v11_t> = Vtable(ncclNet_v11_t {
    name: NET_NAME.as_ptr(),
    init: Some(init),
    devices: Some(v8::devices),
    getProperties: Some(get_properties),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(v8::accept),
    regMr: Some(v8::reg_mr),
    regMrDmaBuf: Some(v8::reg_mr_dmabuf),
    deregMr: Some(v8::dereg_mr),
    isend: Some(v10::isend),
    irecv: Some(v10::irecv),
    iflush: Some(v8::iflush),
    test: Some(v8::test),
    closeSend: Some(v8::close_send),
    closeRecv: Some(v8::close_recv),
    closeListen: Some(v8::close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
    makeVDevice: Some(v9::make_vdevice),
    finalize: Some(finalize),
    setNetAttr: Some(set_net_attr),
});
