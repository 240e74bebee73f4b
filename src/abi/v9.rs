//! `ncclNetPlugin_v9` (NCCL 2.24): size_t isend/irecv sizes, forceFlush,
//! virtual-device properties, max bytes per operation.
use std::ffi::{c_int, c_void};

use super::common::{self as c, NET_NAME};
use super::sys::*;
use super::v8::{self, Vtable};
use super::{guard, out, VoidPtr};
use crate::transport::DeviceProps;

unsafe extern "C" fn init(log: ncclDebugLogger_t) -> ncclResult_t {
    // NCCL fuses devices through makeVDevice: the plugin never self-merges
    crate::plugin::Plugin::nccl_fuses_devices();
    c::init(v8::logger(log))
}

/// A properties struct of v9 or later (`$ty`) from the device's properties
/// `$d` and its `vProps`, plus the fields that version adds: the fields v9
/// defined are the same in every later version, only the type differs.
macro_rules! properties_v9_on {
    ($ty:ident, $d:expr, $vprops:expr $(, $field:ident: $value:expr)* $(,)?) => {{
        let d = $d;
        $ty {
            name: d.name.as_ptr() as *mut _,
            pciPath: $crate::abi::common::c_str_or_null(d.pci_path),
            guid: d.guid,
            ptrSupport: d.ptr_support,
            regIsGlobal: d.reg_is_global as std::ffi::c_int,
            forceFlush: d.force_flush as std::ffi::c_int,
            speed: d.speed_mbps,
            port: d.port,
            latency: d.latency_us,
            maxComms: d.max_comms,
            maxRecvs: d.max_recvs,
            netDeviceType: ncclNetDeviceType::NCCL_NET_DEVICE_HOST,
            netDeviceVersion: NCCL_NET_DEVICE_INVALID_VERSION as std::ffi::c_int,
            vProps: $vprops,
            maxP2pBytes: d.max_p2p_bytes,
            maxCollBytes: d.max_coll_bytes,
            $($field: $value,)*
        }
    }};
}
pub(crate) use properties_v9_on;

pub(crate) fn fill_v9(dev: c_int, d: &DeviceProps) -> ncclNetProperties_v9_t {
    properties_v9_on!(ncclNetProperties_v9_t, d, vprops(dev))
}

/// vProps: the physical devices fused in `dev` (itself for a plain
/// device), into `devs` (4 entries up to v11, 8 in v12); the count.
pub(crate) fn vprops_into(dev: c_int, devs: &mut [c_int]) -> c_int {
    let m = crate::plugin::get().map(|p| p.vdev_members(dev)).unwrap_or_else(|_| vec![dev]);
    for (o, x) in devs.iter_mut().zip(&m) {
        *o = *x;
    }
    m.len().min(devs.len()) as c_int
}

fn vprops(dev: c_int) -> ncclNetVDeviceProps_v9_t {
    let mut v = ncclNetVDeviceProps_v9_t { ndevs: 0, devs: [0; 4] };
    v.ndevs = vprops_into(dev, &mut v.devs);
    v
}

/// The vProps struct of a version (v9 and v10: 4 devices; v11: 4; v12: 8).
pub(crate) trait VDeviceProps {
    /// `ndevs` and the `devs` array.
    fn members(&self) -> (c_int, &[c_int]);
}

impl VDeviceProps for ncclNetVDeviceProps_v9_t {
    fn members(&self) -> (c_int, &[c_int]) {
        (self.ndevs, &self.devs)
    }
}

impl VDeviceProps for ncclNetVDeviceProps_v11_t {
    fn members(&self) -> (c_int, &[c_int]) {
        (self.ndevs, &self.devs)
    }
}

impl VDeviceProps for ncclNetVDeviceProps_v12_t {
    fn members(&self) -> (c_int, &[c_int]) {
        (self.ndevs, &self.devs)
    }
}

/// makeVDevice (v9+, any version's vProps): fuse `props->devs[..ndevs]`
/// into a new device, index in `*d`.
pub(crate) unsafe extern "C" fn make_vdevice<P: VDeviceProps>(d: *mut c_int, props: *mut P) -> ncclResult_t {
    guard("makeVDevice", || {
        // SAFETY: pointers from NCCL; NULL rejected.
        let (out_d, p) = unsafe { (out(d, "makeVDevice", "d")?, out(props, "makeVDevice", "props")?) };
        let (ndevs, devs) = p.members();
        let n = usize::try_from(ndevs)
            .ok()
            .filter(|&n| n <= devs.len())
            .ok_or_else(|| crate::error::Error::InvalidArg(format!("makeVDevice: ndevs {ndevs} (1..={} accepted)", devs.len())))?;
        *out_d = crate::plugin::get()?.make_vdevice(&devs[..n])?;
        Ok(())
    })
}

pub(crate) unsafe extern "C" fn get_properties(dev: c_int, props: *mut ncclNetProperties_v9_t) -> ncclResult_t {
    guard("getProperties", || {
        // SAFETY: out-pointer from NCCL.
        let p = unsafe { out(props, "getProperties", "props")? };
        *p = fill_v9(dev, &c::properties(dev)?);
        Ok(())
    })
}

pub(crate) unsafe extern "C" fn isend(
    sc: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    req: *mut VoidPtr,
) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v9_t defines it (data: `size` bytes under mhandle,
    // valid until test reports the request done; request: an out-pointer), which is all c::isend
    // assumes; it checks NULLs and handles itself.
    unsafe { c::isend(sc, data, size, tag, mh, req) }
}

pub(crate) unsafe extern "C" fn irecv(
    rc: *mut c_void,
    n: c_int,
    data: *mut VoidPtr,
    sizes: *mut usize,
    tags: *mut c_int,
    mh: *mut VoidPtr,
    req: *mut VoidPtr,
) -> ncclResult_t {
    // SAFETY: NCCL calls this slot as ncclNet_v9_t defines it (data, sizes, tags, mhandles: n
    // entries each, the buffers valid until test reports the request done; request: an
    // out-pointer), which is all c::irecv_p assumes (no parent handles in v9: NULL); it checks n,
    // NULLs and handles itself.
    unsafe { c::irecv_p(rc, n, data, sizes, tags, mh, std::ptr::null_mut(), req) }
}

/// The v9 vtable (NCCL 2.24, 2.25). `makeVDevice` fuses devices (verbs; TCP refuses, which NCCL tolerates).
#[no_mangle]
pub static ncclNetPlugin_v9: Vtable<ncclNet_v9_t> = Vtable(ncclNet_v9_t {
    name: NET_NAME.as_ptr(),
    init: Some(init),
    devices: Some(v8::devices),
    getProperties: Some(get_properties),
    listen: Some(v8::listen),
    connect: Some(v8::connect),
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
    makeVDevice: Some(make_vdevice),
});
