//! The verbs transport: NCCL traffic over InfiniBand and RoCE RC QPs,
//! receiver-driven and zero-copy. Laid out like NCCL's `net_ib/`:
//!
//! - [`verbs`]: libibverbs loaded at run time, RAII wrappers (all `unsafe` is there);
//! - [`device`]: discovery, filtering, ordering, properties, async events;
//! - [`gid`]: the RoCE GID choice;
//! - [`connect`]: out-of-band exchange and QP bring-up;
//! - [`p2p`]: isend/irecv/test over RDMA writes (rules in [`crate::proto::fifo`]);
//! - [`reg`]: the registration cache;
//! - [`gdr`]: GPUDirect per device (ptrSupport, dma-buf probe, flush);
//! - [`topo`]: PCI path and NUMA node of each device (helper thread and control memory placement).
pub mod connect;
pub mod device;
pub mod ffi;
pub mod gdr;
pub mod gid;
pub mod p2p;
pub mod reg;
pub mod topo;
pub mod verbs;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::proto::handle::Handle;
use crate::transport::tcp::device as tcpdev;
use crate::transport::{DeviceProps, MemKind, RawBuf};

pub use connect::{ConnCfg, IbConnecting, IbListen};
pub use device::IbDev;
pub use p2p::{RecvComm, SendComm};
pub use reg::IbMr;
pub use verbs::Access;

/// The verbs transport's device table.
pub struct IbNet {
    devs: Vec<Arc<IbDev>>,
    props: Vec<DeviceProps>,
    oob: tcpdev::NetIf,
    cc: Arc<ConnCfg>,
    /// Per device: `cc` with `flush` on where that device flushes (GPUDirect
    /// on and NCCL_GDR_FLUSH_DISABLE=0, or forced): its receive comms get
    /// the loopback flush QP, the others none.
    dev_cc: Vec<Arc<ConnCfg>>,
}

impl IbNet {
    /// Load libibverbs and find the usable ports. The error says what was
    /// found (`RUSTNET_TRANSPORT=ib` reports it; `auto` logs it and uses TCP).
    pub fn new(cfg: &Config) -> Result<IbNet> {
        let lib = verbs::Lib::get().map_err(Error::Usage)?;
        p2p::set_stats_dump(cfg.stats.get() == 1);
        let devs = device::discover(lib, cfg, Path::new("/sys"))?;
        let oob = tcpdev::discover(cfg)
            .map_err(|e| Error::Usage(format!("RDMA ports found, but no IP interface for the out-of-band connection setup: {e}")))?
            .into_iter()
            .next()
            .ok_or_else(|| Error::Usage("no IP interface for the out-of-band connection setup".into()))?;
        let props = devs.iter().map(|d| d.props()).collect();
        let cc = Arc::new(ConnCfg::from_config(cfg));
        let dev_cc = devs
            .iter()
            .map(|d| if gdr::flush_needed(d, &cc) && !cc.flush { Arc::new(ConnCfg { flush: true, ..(*cc).clone() }) } else { cc.clone() })
            .collect();
        Ok(IbNet { devs, props, oob, cc, dev_cc })
    }

    /// The ports in use.
    pub fn devices(&self) -> &[Arc<IbDev>] {
        &self.devs
    }

    /// Number of devices.
    pub fn ndev(&self) -> usize {
        self.devs.len()
    }

    /// The out-of-band interface.
    pub fn oob(&self) -> &tcpdev::NetIf {
        &self.oob
    }

    /// Connection settings.
    pub fn conn_cfg(&self) -> &ConnCfg {
        &self.cc
    }

    fn dev(&self, dev: usize) -> Result<&Arc<IbDev>> {
        self.devs.get(dev).ok_or_else(|| Error::InvalidArg(format!("device {dev} out of range (have {})", self.devs.len())))
    }

    /// Access rights of receive-buffer registrations: the peer writes them,
    /// and the flush QP reads them where flushes happen (forced, or any
    /// device with GPUDirect on). [`IbNet::recv_access_on`] is per device.
    pub fn recv_access(&self) -> Access {
        if self.dev_cc.iter().any(|c| c.flush) {
            Access::REMOTE_WRITE.with(Access::REMOTE_READ)
        } else {
            Access::REMOTE_WRITE
        }
    }

    /// Access rights of receive-buffer registrations on `dev`: the peer
    /// writes them, and the flush QP reads them when that device flushes
    /// (GPUDirect on, or forced).
    pub fn recv_access_on(&self, dev: usize) -> Access {
        if self.dev_cc.get(dev).is_some_and(|c| c.flush) {
            Access::REMOTE_WRITE.with(Access::REMOTE_READ)
        } else {
            Access::REMOTE_WRITE
        }
    }

    /// Properties of `dev`.
    pub fn props(&self, dev: usize) -> Result<DeviceProps> {
        self.props.get(dev).copied().ok_or_else(|| Error::InvalidArg(format!("device {dev} out of range (have {})", self.devs.len())))
    }

    /// Listen on `dev`.
    pub fn listen(&self, dev: usize) -> Result<(IbListen, Handle)> {
        let d = self.dev(dev)?;
        IbListen::new(d, &self.dev_cc[dev], self.oob.addr)
    }

    /// Start connecting from `dev` to the listener in `h`.
    pub fn connect(&self, dev: usize, h: &Handle, traffic_class: Option<i32>) -> Result<IbConnecting> {
        let d = self.dev(dev)?;
        IbConnecting::start(d, &self.dev_cc[dev], h, traffic_class)
    }

    /// Register host memory, or CUDA memory where peer memory makes
    /// `ibv_reg_mr` work on it (else the error gives the device's reason), on
    /// `dev` with `access`.
    ///
    /// # Safety
    /// `buf` must stay mapped until the returned registration is dropped.
    pub unsafe fn reg_mr(&self, dev: usize, buf: RawBuf, kind: MemKind, access: Access) -> Result<IbMr> {
        let d = self.dev(dev)?;
        d.gdr.check_reg(kind, buf.ptr, buf.len)?;
        // SAFETY: forwarded from our caller.
        unsafe { d.mrs.register(dev, buf.ptr, buf.len, access) }
    }

    /// Register the dma-buf `fd` (from `offset`) behind `buf` on `dev`
    /// (NCCL's regMrDmaBuf); refused with the device's reason when its
    /// ptrSupport lacks DMABUF. `fd` may be closed once this returns.
    ///
    /// # Safety
    /// The memory behind `fd` must stay allocated until the returned
    /// registration is dropped.
    pub unsafe fn reg_mr_dmabuf(&self, dev: usize, buf: RawBuf, fd: i32, offset: u64, access: Access) -> Result<IbMr> {
        let d = self.dev(dev)?;
        d.gdr.check_dmabuf(buf.ptr, buf.len, fd)?;
        // SAFETY: forwarded from our caller.
        unsafe { d.mrs.register_dmabuf(dev, buf.ptr, buf.len, fd, offset, access) }
    }

    /// One line per device for the init log.
    pub fn describe(&self) -> String {
        let list: Vec<String> = self
            .devs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                format!("[{i}]{}:{}/{} ({} Mbps)", d.dev_name, d.port, if d.link_layer == device::LINK_ETH { "RoCE" } else { "IB" }, d.speed_mbps)
            })
            .collect();
        let oob: SocketAddr = self.oob.addr;
        format!("{}; OOB {}:{}", list.join(" "), self.oob.name, oob.ip())
    }
}
