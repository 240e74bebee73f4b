//! `ncclNetPlugin_v12` (NCCL 2.30 and later): the v11 calls, with up to 8
//! members per virtual device and the device's rail and plane in the
//! properties.
use std::ffi::c_int;

use super::common::{self as c, NET_NAME};
use super::sys::*;
use super::v8::{self, Vtable};
use super::{guard, out, v10, v11, v9};

unsafe extern "C" fn get_properties(dev: c_int, props: *mut ncclNetProperties_v12_t) -> ncclResult_t {
    guard("getProperties", || {
        // SAFETY: out-pointer from NCCL.
        let p = unsafe { out(props, "getProperties", "props")? };
        let d = c::properties(dev)?;
        let mut v = ncclNetVDeviceProps_v12_t { ndevs: 0, devs: [0; 8] };
        v.ndevs = v9::vprops_into(dev, &mut v.devs);
        let (rail, plane) = crate::plugin::get()?.rail_plane(dev);
        let undef = NCCL_NET_ID_UNDEF as i16;
        *p = v9::properties_v9_on!(
            ncclNetProperties_v12_t,
            &d,
            v,
            maxMultiRequestSize: v11::MAX_MULTI_REQUEST_SIZE,
            railId: rail.unwrap_or(undef),
            planeId: plane.unwrap_or(undef),
        );
        Ok(())
    })
}

/// The v12 vtable (NCCL 2.30 and later load it first).
#[no_mangle]
pub static ncclNetPlugin_v12: Vtable<ncclNet_v12_t> = Vtable(ncclNet_v12_t {
    name: NET_NAME.as_ptr(),
    init: Some(v11::init),
    devices: Some(v8::devices),
    getProperties: Some(get_properties),
    listen: Some(v11::listen),
    connect: Some(v11::connect),
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
    finalize: Some(v11::finalize),
    setNetAttr: Some(v11::set_net_attr),
});
