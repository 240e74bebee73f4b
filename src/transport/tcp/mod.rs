//! The TCP transport: works on every host, needs nothing but IP.
pub mod connect;
pub mod device;
pub mod p2p;
pub mod sys;

use std::path::Path;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::proto::handle::{Handle, HandleKind};
use crate::transport::DeviceProps;

pub use connect::{TcpConnecting, TcpListen};
pub use device::NetIf;
pub use p2p::{RecvComm, SendComm};

/// RUSTNET_SOCKET_HELPER=-1 starts helper threads on hosts with at least
/// this many CPUs: there a thread per comm finds a core of its own, while on
/// a small host it competes with the proxy and the application (on 2 cores
/// it moved 2-4x the bytes of NCCL's loop under NCCL's pattern but spent
/// 1.1-1.6x the CPU per byte; docs/tcp-performance.md).
pub const HELPER_AUTO_MIN_CPUS: usize = 8;

/// Per-connection stream settings from the knob table.
#[derive(Debug, Clone, Copy)]
pub struct StreamCfg {
    /// Streams per connection.
    pub nstreams: usize,
    /// Smallest striping chunk.
    pub min_chunk: usize,
    /// Dead-peer timeout, seconds.
    pub timeout_s: i64,
    /// SO_SNDBUF/SO_RCVBUF (0 = autotune).
    pub bufsize: u64,
    /// One helper thread per comm moves its bytes (RUSTNET_SOCKET_HELPER).
    pub helper: bool,
    /// Connection set-up timeout, seconds (`RUSTNET_CONNECT_TIMEOUT`).
    pub connect_timeout_s: i64,
    /// Accepted connections without a valid hello a listener keeps (`RUSTNET_LISTEN_MAX_STRANGERS`).
    pub max_strangers: usize,
}

impl StreamCfg {
    /// From the knob table.
    pub fn from_config(cfg: &Config) -> StreamCfg {
        let threads = cfg.socket_nthreads.get().max(1) as usize;
        StreamCfg {
            nstreams: (threads * cfg.nsocks_per_thread.get() as usize).clamp(1, 64),
            min_chunk: cfg.socket_min_chunk.0.max(1) as usize,
            timeout_s: cfg.socket_timeout.get(),
            bufsize: cfg.socket_bufsize.0,
            helper: match cfg.socket_helper.get() {
                0 => false,
                1 => true,
                _ => std::thread::available_parallelism().map_or(1, |n| n.get()) >= HELPER_AUTO_MIN_CPUS,
            },
            connect_timeout_s: cfg.connect_timeout.get(),
            max_strangers: cfg.listen_max_strangers.get() as usize,
        }
    }
}

/// The TCP transport's device table.
pub struct TcpNet {
    ifs: Vec<NetIf>,
    props: Vec<DeviceProps>,
    cfg: StreamCfg,
}

impl TcpNet {
    /// Discover interfaces per the knobs.
    pub fn new(cfg: &Config) -> Result<TcpNet> {
        let ifs = device::discover(cfg)?;
        let props = ifs.iter().enumerate().map(|(i, f)| device::properties(f, i, Path::new("/sys"))).collect();
        let cfg = StreamCfg::from_config(cfg);
        Ok(TcpNet { ifs, props, cfg })
    }

    /// The interfaces in use.
    pub fn interfaces(&self) -> &[NetIf] {
        &self.ifs
    }

    /// Number of devices.
    pub fn ndev(&self) -> usize {
        self.ifs.len()
    }

    /// Stream settings.
    pub fn stream_cfg(&self) -> StreamCfg {
        self.cfg
    }

    /// Properties of `dev`.
    pub fn props(&self, dev: usize) -> Result<DeviceProps> {
        self.props.get(dev).copied().ok_or_else(|| Error::InvalidArg(format!("device {dev} out of range (have {})", self.ifs.len())))
    }

    /// Listen on `dev`.
    pub fn listen(&self, dev: usize) -> Result<(TcpListen, Handle)> {
        let ifc = self.ifs.get(dev).ok_or_else(|| Error::InvalidArg(format!("device {dev} out of range (have {})", self.ifs.len())))?;
        TcpListen::new(ifc.addr, HandleKind::Tcp, self.cfg)
    }

    /// Start connecting to the listener in `h`.
    pub fn connect(&self, h: &Handle) -> Result<TcpConnecting> {
        if h.kind != HandleKind::Tcp {
            return Err(Error::Usage(format!(
                "the peer listens with the {:?} transport but this process uses TCP: set the same RUSTNET_TRANSPORT on every rank",
                h.kind
            )));
        }
        TcpConnecting::start(h, self.cfg.nstreams, self.cfg)
    }
}
