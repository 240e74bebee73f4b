//! The TCP transport: works on every host, needs nothing but IP.
pub mod connect;
pub mod device;
pub mod helper;
pub mod p2p;
pub mod recv;
pub mod resume;
pub mod send;

use std::path::Path;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::proto::handle::{Handle, HandleKind};
use crate::proto::wire::MAX_STREAMS;
use crate::transport::netif::{self, NetIf};
use crate::transport::oob::OobCfg;
use crate::transport::DeviceProps;

pub use connect::{TcpConnecting, TcpListen};
pub use recv::RecvComm;
pub use send::SendComm;

/// RUSTNET_SOCKET_HELPER=-1 starts helper threads when this process has at
/// least this many CPUs per rank on its host: there the pool's threads find
/// cores of their own, while on a crowded host it competes with the proxy
/// threads and the application. Measured: on 2 cores the helper moved 2-4x
/// the bytes of NCCL's loop under NCCL's pattern but spent 1.1-1.6x the CPU
/// per byte (docs/tcp-performance.md); under real NCCL on a 16-CPU host it
/// raised busbw 1.1-1.5x over NCCL's socket transport at 2 and 4 ranks
/// (8 and 4 CPUs per rank) and lowered it to 0.64-0.97x at 8 ranks (2 per rank).
pub const HELPER_AUTO_MIN_CPUS_PER_RANK: usize = 4;

/// Launcher variables that say how many ranks share this host, in the order
/// they are trusted: torchrun, Open MPI, MPICH/Hydra, Intel MPI/PMIx-style, Slurm.
pub const LOCAL_RANKS_VARS: [&str; 5] =
    ["LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"];

/// Ranks on this host, from the first launcher variable that holds a
/// positive integer (Slurm's "8(x2)" form counts as 8); `None` when no
/// launcher said.
pub fn local_ranks(get: impl Fn(&str) -> Option<String>) -> Option<(usize, &'static str)> {
    LOCAL_RANKS_VARS.iter().find_map(|&v| {
        let s = get(v)?;
        let digits: String = s.trim().chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<usize>().ok().filter(|&n| n > 0).map(|n| (n, v))
    })
}

/// RUSTNET_SOCKET_HELPER=-1: on when `cpus` / `ranks` (ranks 1 when no
/// launcher said) reaches [`HELPER_AUTO_MIN_CPUS_PER_RANK`]; the reason for the log.
pub fn helper_auto(cpus: usize, ranks: Option<(usize, &'static str)>) -> (bool, String) {
    let (n, from) = ranks.unwrap_or((1, "no launcher variable"));
    let per = cpus / n.max(1);
    let on = per >= HELPER_AUTO_MIN_CPUS_PER_RANK;
    (
        on,
        format!(
            "helper pool {} ({cpus} CPU(s) / {n} rank(s) on this host [{from}] = {per} per rank; on from {HELPER_AUTO_MIN_CPUS_PER_RANK}; RUSTNET_SOCKET_HELPER=0|1 forces it)",
            if on { "on" } else { "off" }
        ),
    )
}

/// RUSTNET_SOCKET_HELPER as set, or decided by [`helper_auto`]; the reason
/// for the "using TCP" INFO line.
pub fn helper_choice(cfg: &Config) -> (bool, String) {
    match cfg.socket_helper.get() {
        0 => (false, "helper threads off (RUSTNET_SOCKET_HELPER=0)".into()),
        1 => (true, "helper pool on (RUSTNET_SOCKET_HELPER=1)".into()),
        _ => {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            helper_auto(cpus, local_ranks(|v| std::env::var(v).ok()))
        }
    }
}

/// Most threads of the helper pool: RUSTNET_SOCKET_HELPER_THREADS, or with
/// 0 [`helper::auto_threads`] of the CPUs and the launcher's ranks per host.
pub fn helper_threads(cfg: &Config) -> usize {
    match cfg.socket_helper_threads.get() {
        0 => {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            let ranks = local_ranks(|v| std::env::var(v).ok()).map_or(1, |r| r.0);
            helper::auto_threads(cpus, ranks)
        }
        n => n as usize,
    }
}

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
    /// The process's helper pool moves the comm's bytes (RUSTNET_SOCKET_HELPER).
    pub helper: bool,
    /// Most threads of that pool (RUSTNET_SOCKET_HELPER_THREADS, or from the CPUs per rank).
    pub helper_threads: usize,
    /// Connection set-up timeout, seconds (`RUSTNET_CONNECT_TIMEOUT`).
    pub connect_timeout_s: i64,
    /// Accepted connections without a valid hello a listener keeps (`RUSTNET_LISTEN_MAX_STRANGERS`).
    pub max_strangers: usize,
    /// Recovery window, seconds (`RUSTNET_RECOVERY_TIMEOUT`; 0: off).
    pub recovery_s: i64,
    /// Testing: `RUSTNET_FAULT_TCP_RESET`.
    pub fault_reset: Option<resume::ResetPlan>,
    /// `RUSTNET_SOCKET_KERNEL_ACK`: with recovery, sends complete on the
    /// receiving kernel's acknowledgement where the receiver counts its
    /// queues (and, receiving, count them and say so).
    pub kernel_ack: bool,
}

impl StreamCfg {
    /// The settings of its connection set-up ([`crate::transport::oob`]).
    pub fn oob(&self) -> OobCfg {
        OobCfg {
            timeout_s: self.timeout_s,
            bufsize: self.bufsize,
            connect_timeout_s: self.connect_timeout_s,
            max_strangers: self.max_strangers,
        }
    }

    /// From the knob table (an invalid RUSTNET_FAULT_TCP_RESET is an error).
    pub fn from_config(cfg: &Config) -> Result<StreamCfg> {
        let threads = cfg.socket_nthreads.get().max(1) as usize;
        Ok(StreamCfg {
            nstreams: (threads * cfg.nsocks_per_thread.get() as usize).clamp(1, MAX_STREAMS),
            min_chunk: cfg.socket_min_chunk.0.max(1) as usize,
            timeout_s: cfg.socket_timeout.get(),
            bufsize: cfg.socket_bufsize.0,
            helper: helper_choice(cfg).0,
            helper_threads: helper_threads(cfg),
            connect_timeout_s: cfg.connect_timeout.get(),
            max_strangers: cfg.listen_max_strangers.get() as usize,
            recovery_s: cfg.recovery_timeout.get(),
            fault_reset: resume::ResetPlan::parse(&cfg.fault_tcp_reset)?,
            kernel_ack: cfg.socket_kernel_ack.get() == 1,
        })
    }

    /// Receiving: do this end's resume offsets count the bytes its kernel
    /// holds unread, and say so in its acceptances (`REPLY_QUEUED_OFFSETS`)?
    /// Not with the receive side of `RUSTNET_FAULT_TCP_RESET`: that
    /// injection dissolves the connection locally (`connect(AF_UNSPEC)`),
    /// which purges the receive queue, where a reset from the peer or a
    /// middlebox, or `ss -K`, leaves it readable.
    pub fn queued_offsets(&self) -> bool {
        self.recovery_s > 0 && self.kernel_ack && self.fault_reset.is_none_or(|p| p.send)
    }

    /// Hold this process's resume port at `addr`'s address (recovery on).
    pub fn resume_port(&self, addr: std::net::SocketAddr) -> Result<Option<resume::PortRef>> {
        if self.recovery_s <= 0 {
            return Ok(None);
        }
        resume::PortRef::acquire(addr, self.max_strangers, std::time::Duration::from_secs(self.timeout_s.max(1) as u64)).map(Some)
    }
}

/// The IP TOS byte for a traffic class (0..255 checked by the context; a
/// v10 connect's class out of range is ignored, as over verbs).
fn tos_of(tc: Option<i32>) -> Option<u8> {
    tc.and_then(|t| u8::try_from(t).ok())
}

/// The TCP transport's device table.
pub struct TcpNet {
    ifs: Vec<NetIf>,
    props: Vec<DeviceProps>,
    cfg: StreamCfg,
    helper_why: String,
}

impl TcpNet {
    /// Discover interfaces per the knobs.
    pub fn new(cfg: &Config) -> Result<TcpNet> {
        let ifs = netif::discover(cfg)?;
        let props = ifs.iter().enumerate().map(|(i, f)| device::properties(f, i, Path::new("/sys"))).collect();
        let helper_why = helper_choice(cfg).1;
        let cfg = StreamCfg::from_config(cfg)?;
        Ok(TcpNet { ifs, props, cfg, helper_why })
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

    /// Whether comms are served by the helper pool, and why (for the log).
    pub fn helper_reason(&self) -> &str {
        &self.helper_why
    }

    /// The init log's line: interfaces, streams per connection, helper choice.
    pub fn summary(&self) -> String {
        let list: Vec<String> = self.ifs.iter().enumerate().map(|(i, f)| format!("[{i}]{}:{}", f.name, f.addr.ip())).collect();
        let pool = if self.cfg.helper { format!(", at most {} pool thread(s)", self.cfg.helper_threads) } else { String::new() };
        format!("using TCP on {} ({} stream(s) per connection; {}{pool})", list.join(" "), self.cfg.nstreams, self.helper_why)
    }

    /// Properties of `dev`.
    pub fn props(&self, dev: usize) -> Result<DeviceProps> {
        self.props.get(dev).copied().ok_or_else(|| Error::InvalidArg(format!("device {dev} out of range (have {})", self.ifs.len())))
    }

    /// Listen on `dev`; accepted sockets carry the traffic class `tc` as
    /// their IP TOS / IPv6 traffic class byte when set.
    pub fn listen(&self, dev: usize, tc: Option<i32>) -> Result<(TcpListen, Handle)> {
        let ifc = self.ifs.get(dev).ok_or_else(|| Error::InvalidArg(format!("device {dev} out of range (have {})", self.ifs.len())))?;
        let (l, h) = TcpListen::new(ifc.addr, self.cfg)?;
        Ok((l.with_tos(tos_of(tc))?, h))
    }

    /// Start connecting from device `dev` to the listener in `h`; the data
    /// sockets carry the traffic class `tc` when set. With recovery on, this
    /// process's resume port on `dev`'s address stays open while the comm
    /// lives (a waiting receiver probes it).
    pub fn connect(&self, dev: usize, h: &Handle, tc: Option<i32>) -> Result<TcpConnecting> {
        if h.kind != HandleKind::Tcp {
            return Err(Error::Usage(format!(
                "the peer listens with the {:?} transport but this process uses TCP: set the same RUSTNET_TRANSPORT on every rank",
                h.kind
            )));
        }
        let local = self.ifs.get(dev).or(self.ifs.first()).map(|f| f.addr);
        TcpConnecting::start(h, self.cfg, tos_of(tc), local)
    }
}

/// Unload: the resume ports and their registry.
///
/// # Safety
/// No TCP comm is alive.
pub(crate) unsafe fn release() {
    // SAFETY: our caller's promise.
    unsafe { resume::release() }
}

#[cfg(test)]
mod helper_tests {
    use super::*;

    #[test]
    fn local_ranks_come_from_the_first_launcher_variable_that_says() {
        let env =
            |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        assert_eq!(local_ranks(env(&[])), None);
        assert_eq!(local_ranks(env(&[("MPI_LOCALNRANKS", "8")])), Some((8, "MPI_LOCALNRANKS")));
        assert_eq!(local_ranks(env(&[("MPI_LOCALNRANKS", "8"), ("LOCAL_WORLD_SIZE", "4")])), Some((4, "LOCAL_WORLD_SIZE")));
        assert_eq!(local_ranks(env(&[("SLURM_NTASKS_PER_NODE", "8(x2)")])), Some((8, "SLURM_NTASKS_PER_NODE")));
        // garbage and zero are skipped, not trusted
        assert_eq!(
            local_ranks(env(&[("LOCAL_WORLD_SIZE", "x"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "0"), ("MPI_LOCALNRANKS", "2")])),
            Some((2, "MPI_LOCALNRANKS"))
        );
    }

    #[test]
    fn the_helper_is_on_only_with_cores_to_spare_per_rank() {
        // the H200 host of the GPU check: 16 CPUs
        assert!(helper_auto(16, Some((2, "MPI_LOCALNRANKS"))).0);
        assert!(helper_auto(16, Some((4, "MPI_LOCALNRANKS"))).0);
        assert!(!helper_auto(16, Some((8, "MPI_LOCALNRANKS"))).0);
        // a typical 8-GPU node
        assert!(helper_auto(128, Some((8, "LOCAL_WORLD_SIZE"))).0);
        // no launcher: the whole host
        assert!(helper_auto(16, None).0);
        assert!(!helper_auto(2, None).0);
        let (_, why) = helper_auto(16, Some((8, "MPI_LOCALNRANKS")));
        assert!(why.contains("off") && why.contains("MPI_LOCALNRANKS") && why.contains("2 per rank"), "{why}");
    }
}
