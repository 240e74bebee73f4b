//! Sizes and offsets of NCCL's net ABI as NCCL lays them out on x86_64/aarch64
//! (LP64), pinned against our generated bindings: an accidental edit of
//! nccl-headers/ cannot pass unnoticed.
use std::mem::{offset_of, size_of};

use rustnet::for_tools::sys::*;

#[test]
fn properties_layouts() {
    assert_eq!(size_of::<ncclNetProperties_v6_t>(), 48);
    assert_eq!(offset_of!(ncclNetProperties_v6_t, ptrSupport), 24);
    assert_eq!(offset_of!(ncclNetProperties_v6_t, maxRecvs), 44);
    assert_eq!(size_of::<ncclNetProperties_v7_t>(), 56);
    assert_eq!(offset_of!(ncclNetProperties_v7_t, netDeviceType), 48);
    assert_eq!(size_of::<ncclNetProperties_v8_t>(), 64);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, regIsGlobal), 28);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, speed), 32);
    assert_eq!(offset_of!(ncclNetProperties_v8_t, netDeviceVersion), 56);
    assert_eq!(size_of::<ncclNetProperties_v9_t>(), 104);
    assert_eq!(offset_of!(ncclNetProperties_v9_t, forceFlush), 32);
    assert_eq!(offset_of!(ncclNetProperties_v9_t, vProps), 64);
    assert_eq!(offset_of!(ncclNetProperties_v9_t, maxP2pBytes), 88);
    assert_eq!(offset_of!(ncclNetProperties_v9_t, maxCollBytes), 96);
    assert_eq!(size_of::<ncclNetVDeviceProps_v9_t>(), 20);
    assert_eq!(size_of::<ncclNetProperties_v10_t>(), 104);
    // v11, v12: checked against NCCL 2.28.9 / 2.30.7 (nccl-headers/PROVENANCE.md)
    assert_eq!(size_of::<ncclNetProperties_v11_t>(), 112);
    assert_eq!(offset_of!(ncclNetProperties_v11_t, vProps), 64);
    assert_eq!(offset_of!(ncclNetProperties_v11_t, maxP2pBytes), 88);
    assert_eq!(offset_of!(ncclNetProperties_v11_t, maxCollBytes), 96);
    assert_eq!(offset_of!(ncclNetProperties_v11_t, maxMultiRequestSize), 104);
    assert_eq!(size_of::<ncclNetVDeviceProps_v11_t>(), 20);
    assert_eq!(size_of::<ncclNetProperties_v12_t>(), 128);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, vProps), 64);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, maxP2pBytes), 104);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, maxCollBytes), 112);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, maxMultiRequestSize), 120);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, railId), 124);
    assert_eq!(offset_of!(ncclNetProperties_v12_t, planeId), 126);
    assert_eq!(size_of::<ncclNetVDeviceProps_v12_t>(), 36);
}

#[test]
fn vtable_layouts() {
    let p = size_of::<usize>();
    assert_eq!(size_of::<ncclNet_v6_t>(), 17 * p);
    assert_eq!(size_of::<ncclNet_v7_t>(), 19 * p);
    assert_eq!(size_of::<ncclNet_v8_t>(), 19 * p);
    assert_eq!(size_of::<ncclNet_v9_t>(), 20 * p);
    assert_eq!(size_of::<ncclNet_v10_t>(), 20 * p);
    assert_eq!(offset_of!(ncclNet_v8_t, regMr), 7 * p);
    assert_eq!(offset_of!(ncclNet_v8_t, test), 13 * p);
    assert_eq!(offset_of!(ncclNet_v8_t, irecvConsumed), 18 * p);
    assert_eq!(offset_of!(ncclNet_v9_t, makeVDevice), 19 * p);
    assert_eq!(offset_of!(ncclNet_v10_t, makeVDevice), 19 * p);
    assert_eq!(size_of::<ncclNet_v11_t>(), 22 * p);
    assert_eq!(size_of::<ncclNet_v12_t>(), 22 * p);
    assert_eq!(offset_of!(ncclNet_v11_t, listen), 4 * p);
    assert_eq!(offset_of!(ncclNet_v11_t, connect), 5 * p);
    assert_eq!(offset_of!(ncclNet_v11_t, makeVDevice), 19 * p);
    assert_eq!(offset_of!(ncclNet_v11_t, finalize), 20 * p);
    assert_eq!(offset_of!(ncclNet_v11_t, setNetAttr), 21 * p);
    assert_eq!(offset_of!(ncclNet_v12_t, makeVDevice), 19 * p);
    assert_eq!(offset_of!(ncclNet_v12_t, finalize), 20 * p);
    assert_eq!(offset_of!(ncclNet_v12_t, setNetAttr), 21 * p);
}

#[test]
fn small_types() {
    assert_eq!(size_of::<ncclNetDeviceHandle_v7_t>(), 32);
    assert_eq!(offset_of!(ncclNetDeviceHandle_v7_t, needsProxyProgress), 24);
    assert_eq!(size_of::<ncclNetCommConfig_v10_t>(), 4);
    assert_eq!(size_of::<ncclNetCommConfig_v11_t>(), 4);
    assert_eq!(size_of::<ncclNetCommConfig_v12_t>(), 4);
    assert_eq!(size_of::<ncclNetCommAttr_v11_t>(), 16);
    assert_eq!(size_of::<ncclNetAttr_v11_t>(), 44);
    assert_eq!(offset_of!(ncclNetAttr_v11_t, recvCommAttr), 16);
    assert_eq!(offset_of!(ncclNetAttr_v11_t, op), 32);
    assert_eq!(offset_of!(ncclNetAttr_v11_t, proto), 40);
    assert_eq!(size_of::<ncclNetAttr_v12_t>(), 44);
    assert_eq!((NCCL_NET_TRAFFIC_CLASS_UNDEF, NCCL_NET_ATTR_UNDEF, NCCL_NET_ID_UNDEF), (-1, -1, -1));
    assert_eq!((NCCL_NET_MAX_DEVS_PER_NIC_V11, NCCL_NET_MAX_DEVS_PER_NIC_V12), (4, 8));
    assert_eq!(size_of::<ncclResult_t>(), 4);
    assert_eq!(NCCL_NET_HANDLE_MAXSIZE, 128);
    assert_eq!((NCCL_PTR_HOST, NCCL_PTR_CUDA, NCCL_PTR_DMABUF), (1, 2, 4));
    assert_eq!(ncclResult_t::ncclRemoteError as i32, 6);
}
