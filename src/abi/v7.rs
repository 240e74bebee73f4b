//! `ncclNetPlugin_v7` (NCCL 2.19): like v8 without regIsGlobal, int regMr size.
use std::ffi::{c_int, c_void};

use super::common::{self as c, c_str_or_null, NET_NAME};
use super::sys::*;
use super::v8::{self, Vtable};
use super::{guard, out, VoidPtr};

unsafe extern "C" fn get_properties(dev: c_int, props: *mut ncclNetProperties_v7_t) -> ncclResult_t {
    guard("getProperties", || {
        // SAFETY: out-pointer from NCCL.
        let p = unsafe { out(props, "getProperties", "props")? };
        let d = c::properties(dev)?;
        *p = ncclNetProperties_v7_t {
            name: d.name.as_ptr() as *mut _,
            pciPath: c_str_or_null(d.pci_path),
            guid: d.guid,
            ptrSupport: d.ptr_support,
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

pub(crate) unsafe extern "C" fn reg_mr_int(comm: *mut c_void, data: *mut c_void, size: c_int, ty: c_int, mh: *mut VoidPtr) -> ncclResult_t {
    if size < 0 {
        return guard("regMr", || Err(crate::error::Error::InvalidArg(format!("regMr size {size} is negative"))));
    }
    // SAFETY: NCCL calls this slot as ncclNet_v7_t defines it (data: `size` bytes of memory of type
    // `type`, allocated until deregMr; mhandle: an out-pointer), which is all c::reg_mr assumes; it
    // checks NULLs and handles itself.
    unsafe { c::reg_mr(comm, data, size as usize, ty, mh) }
}

/// The v7 vtable (NCCL 2.19 prefers it).
#[no_mangle]
pub static ncclNetPlugin_v7: Vtable<ncclNet_v7_t> = Vtable(ncclNet_v7_t {
    name: NET_NAME.as_ptr(),
    init: Some(v8::init),
    devices: Some(v8::devices),
    getProperties: Some(get_properties),
    listen: Some(v8::listen),
    connect: Some(v8::connect),
    accept: Some(v8::accept),
    regMr: Some(reg_mr_int),
    regMrDmaBuf: Some(v8::reg_mr_dmabuf),
    deregMr: Some(v8::dereg_mr),
    isend: Some(v8::isend),
    irecv: Some(v8::irecv),
    iflush: Some(v8::iflush),
    test: Some(v8::test),
    closeSend: Some(v8::close_send),
    closeRecv: Some(v8::close_recv),
    closeListen: Some(v8::close_listen),
    getDeviceMr: None,
    irecvConsumed: None,
});
