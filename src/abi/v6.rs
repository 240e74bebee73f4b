//! `ncclNetPlugin_v6` (NCCL 2.13-2.18; still accepted by every later release).
use std::ffi::{c_int, c_void};

use super::common::{self as c, c_str_or_null, NET_NAME};
use super::sys::*;
use super::v8::{self, Vtable};
use super::{guard, out, VoidPtr};

unsafe extern "C" fn get_properties(dev: c_int, props: *mut ncclNetProperties_v6_t) -> ncclResult_t {
    guard("getProperties", || {
        // SAFETY: out-pointer from NCCL.
        let p = unsafe { out(props, "getProperties", "props")? };
        let d = c::properties(dev)?;
        *p = ncclNetProperties_v6_t {
            name: d.name.as_ptr() as *mut _,
            pciPath: c_str_or_null(d.pci_path),
            guid: d.guid,
            ptrSupport: d.ptr_support,
            speed: d.speed_mbps,
            port: d.port,
            latency: d.latency_us,
            maxComms: d.max_comms,
            maxRecvs: d.max_recvs,
        };
        Ok(())
    })
}

unsafe extern "C" fn connect(dev: c_int, handle: *mut c_void, sc: *mut VoidPtr) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v6_t defines it (handle: the NCCL_NET_HANDLE_MAXSIZE
    // bytes the peer's listen filled; sendComm: an out-pointer), which is all c::connect assumes;
    // it checks NULLs and handles itself.
    unsafe { c::connect(c::Ctx::Implicit, dev, handle, sc, None) }
}

unsafe extern "C" fn accept(lc: *mut c_void, rc: *mut VoidPtr) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v6_t defines it (listenComm: what listen returned;
    // recvComm: an out-pointer), which is all c::accept assumes; it checks NULLs and handles
    // itself.
    unsafe { c::accept(lc, rc) }
}

/// The v6 vtable (what NCCL 2.18 loads).
#[no_mangle]
pub static ncclNetPlugin_v6: Vtable<ncclNet_v6_t> = Vtable(ncclNet_v6_t {
    name: NET_NAME.as_ptr(),
    init: Some(v8::init),
    devices: Some(v8::devices),
    getProperties: Some(get_properties),
    listen: Some(v8::listen),
    connect: Some(connect),
    accept: Some(accept),
    regMr: Some(super::v7::reg_mr_int),
    regMrDmaBuf: Some(v8::reg_mr_dmabuf),
    deregMr: Some(v8::dereg_mr),
    isend: Some(v8::isend),
    irecv: Some(v8::irecv),
    iflush: Some(v8::iflush),
    test: Some(v8::test),
    closeSend: Some(v8::close_send),
    closeRecv: Some(v8::close_recv),
    closeListen: Some(v8::close_listen),
});
