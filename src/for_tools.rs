//! What other crates may use of the plugin's internals: the tools crate
//! (`rustnet-tools`: the stand-in driver, the doctor, the benchmark) and the
//! plugin's own integration tests (`tests/*.rs`: the device tests drive the
//! verbs transport directly). Every other module of this crate is
//! `pub(crate)`, so this list is the whole surface another crate reaches: a
//! change inside `transport/` breaks another crate only where it changes an
//! item named here, and an item that is not here is free to change.
//!
//! Not an API for applications and without a stability promise: NCCL sees
//! only the `ncclNetPlugin_v6`..`v12` symbols of `librustnet.so`. The sans-IO
//! core is a crate of its own, re-exported as [`crate::proto`].
//!
//! The layout mirrors the modules the items live in (`for_tools::ib::gid` is
//! `transport::ib::gid`), so a path here says where to read the item.

/// NCCL's C types (bindgen over `nccl-headers/`): the driver calls the
/// vtables with them, `tests/abi_layout.rs` checks their layout.
pub use crate::abi::sys;

/// The plugin's knob table (`rustnet knobs`, the doctor's configuration check).
pub mod config {
    pub use crate::config::{knobs_markdown, Bytes, Config, KnobValue, NameList, KNOBS};
}

/// The implicit (v6-v10) plugin context, for tests that open comms directly.
pub mod context {
    pub use crate::context::implicit;
}

/// GPUDirect facts: the doctor reports them, `tests/verbs_gdr.rs` checks them.
pub mod gpu {
    pub use crate::gpu::{detect_peermem, DmabufProbe, PeerMem};
    /// The CUDA driver as the plugin sees it.
    pub mod cuda {
        pub use crate::gpu::cuda::info;
    }
}

/// Logging through the plugin's log module (for tests that call the core directly).
pub mod log {
    pub use crate::log::install;
}

/// The plugin core: init and the transport choice.
pub mod plugin {
    pub use crate::plugin::{init, select_net, Net, Plugin};
}

/// NCCL profiler events: what the driver's checking callback expects.
pub mod profiler {
    pub use crate::abi::profiler::{IbDescrV1, SockDescrV1, DESCR_TYPE, DESCR_VER, NET_TYPE_IB, NET_TYPE_SOCK};
    pub use crate::profiler::{OP_RDMA_WRITE, OP_RDMA_WRITE_WITH_IMM, OP_RECV, OP_RECV_RDMA_WITH_IMM, OP_SEND, SOCK_RECV, SOCK_SEND};
}

/// The statistics file (`RUSTNET_STATS_DIR`): its format, read back by
/// `rustnet stats` and `tests/stats.rs`.
pub mod stats {
    pub use crate::stats::{hostname, prom, WORK_OPS, WRITER_NAME};
}

/// Transport-neutral types and the shared socket code.
pub mod transport {
    pub use crate::transport::{MemKind, RawBuf, RecvBuf, MAX_P2P_BYTES, MAX_RECVS, PTR_CUDA, PTR_DMABUF, PTR_HOST};
    /// Interface choice (`NCCL_SOCKET_IFNAME`, families).
    pub mod netif {
        pub use crate::transport::netif::{candidates, select};
    }
    /// Socket system calls.
    pub mod sock {
        pub use crate::transport::sock::interfaces;
    }
}

/// The verbs transport: what the doctor inspects and the device tests
/// (`tests/verbs*.rs`, `tests/iwarp_cm.rs`, `tests/topo.rs`) drive.
pub mod ib {
    /// libibverbs' C types (bindgen).
    pub use crate::transport::ib::ffi;
    pub use crate::transport::ib::{Access, IbMr, IbNet, IbRecv, IbSend, RecvComm, SendComm};
    /// Device discovery: naming and the link-layer words.
    pub mod device {
        pub use crate::transport::ib::device::{order_and_name, pci_path, Candidate, LINK_ETH};
    }
    /// GPUDirect decisions per device.
    pub mod gdr {
        pub use crate::transport::ib::gdr::decisions;
    }
    /// The RoCE GID choice.
    pub mod gid {
        pub use crate::transport::ib::gid::{choose, is_v4, last_choice, parse_gid, show, GidTable, NetdevState, Prefs, SysfsGids};
    }
    /// The out-of-band handshake's local address.
    pub mod handshake {
        pub use crate::transport::ib::handshake::local_addr;
    }
    /// iWARP: which ports are iWARP, and whether this build connects them.
    pub mod iwarp {
        pub use crate::transport::ib::iwarp::{sysfs_is_iwarp, IWARP_DATA_PATH, IWARP_HOW, IWARP_WHY};
    }
    /// Per-QP statistics of the data path.
    pub mod p2p {
        pub use crate::transport::ib::p2p::{format_stats, set_stats_dump, QpStat};
    }
    /// librdmacm: whether it loads, and the connection objects `tests/iwarp_cm.rs` drives.
    pub mod rdmacm {
        pub use crate::transport::ib::rdmacm::{iwarp_usable, CmConn, CmLib, CmListener, Progress, LIBRDMACM};
    }
    /// PCI paths, NUMA nodes, CPU binding.
    pub mod topo {
        pub use crate::transport::ib::topo::{bind_current_thread, gpus, nearest_nic, nic_key, node_cpus, numa_node, pci_path};
    }
    /// Several ports or NICs as one device.
    pub mod vdev {
        pub use crate::transport::ib::vdev::{MultiRecv, MultiSend, MAX_MEMBERS};
    }
    /// The RAII layer over libibverbs.
    pub mod verbs {
        pub use crate::transport::ib::verbs::{
            empty_wc, Access, Context, Cq, HostRegion, Init, Lib, Pd, Qp, QpCaps, RtrParams, Rts, RtsParams, SendWr,
        };
    }
}
