//! The verbs transport: NCCL traffic over InfiniBand and RoCE RC QPs,
//! receiver-driven and zero-copy. Laid out like NCCL's `net_ib/`:
//!
//! - [`verbs`]: libibverbs loaded at run time, RAII wrappers (all `unsafe` is there);
//! - [`device`]: discovery, filtering, ordering, properties, async events;
//! - [`gid`]: the RoCE GID choice;
//! - [`connect`]: out-of-band exchange and QP bring-up;
//! - [`p2p`]: isend/irecv/test over RDMA writes (rules in [`crate::proto::fifo`]);
//! - [`reg`]: the registration cache.
pub mod connect;
pub mod device;
pub mod ffi;
pub mod gid;
pub mod p2p;
pub mod reg;
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
}

impl IbNet {
    /// Load libibverbs and find the usable ports. The error says what was
    /// found (`RUSTNET_TRANSPORT=ib` reports it; `auto` logs it and uses TCP).
    pub fn new(cfg: &Config) -> Result<IbNet> {
        let lib = verbs::Lib::get().map_err(Error::Usage)?;
        let devs = device::discover(lib, cfg, Path::new("/sys"))?;
        let oob = tcpdev::discover(cfg)
            .map_err(|e| Error::Usage(format!("RDMA ports found, but no IP interface for the out-of-band connection setup: {e}")))?
            .into_iter()
            .next()
            .ok_or_else(|| Error::Usage("no IP interface for the out-of-band connection setup".into()))?;
        let props = devs.iter().map(|d| d.props()).collect();
        Ok(IbNet { devs, props, oob, cc: Arc::new(ConnCfg::from_config(cfg)) })
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
    /// and the flush QP reads them when flushes are forced.
    pub fn recv_access(&self) -> Access {
        if self.cc.flush {
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
        IbListen::new(d, &self.cc, self.oob.addr)
    }

    /// Start connecting from `dev` to the listener in `h`.
    pub fn connect(&self, dev: usize, h: &Handle, traffic_class: Option<i32>) -> Result<IbConnecting> {
        let d = self.dev(dev)?;
        IbConnecting::start(d, &self.cc, h, traffic_class)
    }

    /// Register host memory on `dev` with `access`.
    ///
    /// # Safety
    /// `buf` must stay mapped until the returned registration is dropped.
    pub unsafe fn reg_mr(&self, dev: usize, buf: RawBuf, kind: MemKind, access: Access) -> Result<IbMr> {
        if kind != MemKind::Host {
            return Err(Error::Usage(format!(
                "the verbs transport registers host memory only in this build (ptrSupport=HOST), but NCCL registered {kind:?} memory at {:p}",
                buf.ptr
            )));
        }
        let d = self.dev(dev)?;
        // SAFETY: forwarded from our caller.
        unsafe { d.mrs.register(dev, buf.ptr, buf.len, access) }
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
