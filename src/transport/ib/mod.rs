//! The verbs transport: NCCL traffic over InfiniBand and RoCE RC QPs,
//! receiver-driven and zero-copy. Laid out like NCCL's `net_ib/`:
//!
//! - [`verbs`]: libibverbs loaded at run time, RAII wrappers (most of the `unsafe`; the rest sits beside the calls it wraps, each with a `// SAFETY:` line);
//! - [`device`]: discovery, filtering, ordering, properties, async events ([`port`]: link layer and state words);
//! - [`gid`]: the RoCE GID choice;
//! - [`caps`]: the depth of every queue (QPs, CQ) and the inline sizes, per end of a connection;
//! - [`handshake`]: the out-of-band exchange's steps and QP bring-up (imports no comm);
//! - [`establish`]: connect/accept, sequencing the handshake into comms;
//! - [`p2p`]: isend/irecv/test over RDMA writes: the executor of the protocol machines
//!   ([`crate::proto::tx`], [`crate::proto::rx`], through [`crate::proto::nic`]); [`entry`]: the
//!   comms' entry points (NCCL's arguments checked, the call handed to the machine); [`link`]: what
//!   both ends share (QPs, CQ, failure, liveness, profiler events); [`ready`]: the handshake's
//!   last steps, run from the data path;
//! - [`recover`] / [`reconnect`]: a comm recovering in place after a fabric fault (new QPs, the
//!   restart points exchanged on the out-of-band socket, the resend decided by the machines,
//!   [`crate::proto::recover`]);
//! - [`reg`]: the registration cache; [`slab`]: the comms' small control regions from shared blocks per device;
//! - [`gdr`]: GPUDirect per device (ptrSupport, dma-buf probe, flush);
//! - [`vdev`]: several ports or NICs as one NCCL device (v8 self-merge, v9+ makeVDevice);
//! - [`comm`]: what the plugin holds: one send, receive and registration type for plain and merged devices;
//! - [`topo`]: PCI path and NUMA node of each device (helper thread and control memory placement);
//! - [`iwarp`] / [`rdmacm`] (types in [`cmffi`]): iWARP connection set-up through librdmacm
//!   (iWARP QPs are connected by the CM, not by hand); [`notice_path`]: iWARP's connection
//!   and completions without immediates (rules in [`crate::proto::notice`]), used by [`p2p`]'s executor.
pub mod caps;
pub mod cmffi;
pub mod comm;
pub mod device;
pub mod entry;
pub mod establish;
pub mod ffi;
pub mod gdr;
pub mod gid;
pub mod handshake;
pub mod iwarp;
pub mod keeper;
pub mod link;
pub mod neigh;
pub mod notice_path;
pub mod p2p;
pub mod port;
pub mod rdmacm;
pub mod ready;
pub mod reconnect;
pub mod recover;
pub mod reg;
pub mod slab;
pub mod topo;
pub mod vdev;
pub mod verbs;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::proto::handle::Handle;
use crate::transport::netif::{self, NetIf};
use crate::transport::{DeviceProps, MemKind, RawBuf};

/// Unload: free the process-wide verbs state (library tables, GID and
/// GPUDirect records).
///
/// # Safety
/// As [`crate::unload::Global::clear`].
pub(crate) unsafe fn release() {
    // (first: its thread may be in the middle of a look at verbs state)
    // SAFETY: our caller guarantees that no comm is alive, so no
    // registration is used again.
    unsafe { keeper::release() };
    // SAFETY: our caller guarantees Global::clear's contract for all verbs
    // state (no reference into it is alive or used again), which is verbs::release's.
    unsafe { verbs::release() };
    // SAFETY: our caller guarantees Global::clear's contract for all verbs
    // state, librdmacm's record included (no reference into it is alive or
    // used again), which is rdmacm::release's.
    unsafe { rdmacm::release() };
    gid::release();
    gdr::release();
}

pub use comm::{Connecting, IbRecv, IbReg, IbSend, Listen, Side};
pub use device::IbDev;
pub use establish::{IbConnecting, IbListen};
pub use handshake::ConnCfg;
pub use p2p::{RecvComm, SendComm};
pub use reg::IbMr;
pub use vdev::set_nccl_fuses;
pub use verbs::Access;

/// The verbs transport's device table.
pub struct IbNet {
    devs: Vec<Arc<IbDev>>,
    /// The devices NCCL sees (plain, merged); see [`vdev`].
    slots: parking_lot::RwLock<Vec<vdev::Slot>>,
    /// NUMA node per physical device (control memory placement, [`topo`]).
    numa: Vec<Option<i32>>,
    oob: NetIf,
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
        let oob = netif::discover(cfg)
            .map_err(|e| Error::Usage(format!("RDMA ports found, but no IP interface for the out-of-band connection setup: {e}")))?
            .into_iter()
            .next()
            .ok_or_else(|| Error::Usage("no IP interface for the out-of-band connection setup".into()))?;
        let spec = vdev::MergeSpec::parse(&cfg.ib_merge_nics).map_err(Error::Usage)?;
        let groups = if vdev::nccl_fuses() { Vec::new() } else { vdev::plan(&devs, &spec)? };
        let slots = parking_lot::RwLock::new(vdev::slots(&devs, &groups));
        let numa = devs.iter().map(|d| topo::numa_node(Path::new("/sys"), &d.dev_name)).collect();
        let cc = Arc::new(ConnCfg::from_config(cfg));
        let dev_cc = devs
            .iter()
            .map(|d| {
                if d.iwarp {
                    return Arc::new(notice_path::conn_cfg(&cc, d));
                }
                let flush = gdr::flush_needed(&d.gdr, cc.flush) && !cc.flush;
                // the eager path copies with the CPU: host memory only
                let no_eager = cc.eager > 0 && d.gdr.decision.ptr_support != crate::transport::PTR_HOST;
                if flush || no_eager {
                    let eager = if no_eager { 0 } else { cc.eager };
                    Arc::new(ConnCfg { flush: cc.flush || flush, eager, ..(*cc).clone() })
                } else {
                    cc.clone()
                }
            })
            .collect();
        Ok(IbNet { devs, slots, numa, oob, cc, dev_cc })
    }

    /// The ports in use.
    pub fn devices(&self) -> &[Arc<IbDev>] {
        &self.devs
    }

    /// Number of devices NCCL sees (merged devices count once).
    pub fn ndev(&self) -> usize {
        self.slots.read().len()
    }

    /// The out-of-band interface.
    pub fn oob(&self) -> &NetIf {
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

    /// Properties of NCCL's device `dev`.
    pub fn props(&self, dev: usize) -> Result<DeviceProps> {
        let s = self.slots.read();
        s.get(dev).map(|x| x.props).ok_or_else(|| Error::InvalidArg(format!("device {dev} out of range (have {})", s.len())))
    }

    /// Physical members of NCCL's device `dev` (one for a plain device).
    pub fn members(&self, dev: usize) -> Result<Vec<usize>> {
        let s = self.slots.read();
        s.get(dev).map(|x| x.members.clone()).ok_or_else(|| Error::InvalidArg(format!("device {dev} out of range (have {})", s.len())))
    }

    /// The physical devices behind NCCL's device `dev` (vProps): itself
    /// unless merged (and itself when out of range).
    pub fn vprops_members(&self, dev: i32) -> Vec<i32> {
        self.members(dev.max(0) as usize).map(|v| v.into_iter().map(|x| x as i32).collect()).unwrap_or_else(|_| vec![dev])
    }

    /// The rail of NCCL's device `dev` (ABI v12 `railId`; `None` =
    /// `NCCL_NET_ID_UNDEF`). A physical port is its own rail, numbered by
    /// its place in the device list, which is PCI order and so the same rail
    /// on every node (device.rs); that tells NCCL what its default (same NIC
    /// and port) already assumes, and keeps NCCL_NET_MERGE_POLICY=RAIL from
    /// fusing different ports. A merged device spans rails: undefined, as
    /// NCCL's net_ib reports for members of different rails.
    pub fn rail(&self, dev: i32) -> Option<i16> {
        let physical = dev >= 0 && (dev as usize) < self.ndev() && self.vprops_members(dev) == [dev];
        physical.then(|| i16::try_from(dev).ok()).flatten()
    }

    /// NCCL's makeVDevice: a merged device over the *physical* devices
    /// `members`, appended after the others; returns its index.
    pub fn make_vdevice(&self, members: &[usize]) -> Result<usize> {
        vdev::check_members(&self.devs, members)?;
        let mut s = self.slots.write();
        if let Some(i) = s.iter().position(|x| x.members == members) {
            return Ok(i);
        }
        s.push(vdev::Slot { members: members.to_vec(), props: vdev::merged_props(&self.devs, members) });
        let i = s.len() - 1;
        tracing::info!("virtual device {i} {} over devices {members:?}", s[i].props.name.to_string_lossy());
        Ok(i)
    }

    /// Listen on NCCL's device `dev` (plain or merged); the handles go into NCCL's buffer.
    pub fn listen_any(&self, dev: usize) -> Result<(Listen, vdev::Handles)> {
        let m = self.members(dev)?;
        if m.len() == 1 {
            let (l, h) = self.listen(m[0])?;
            return Ok((Listen::One(l, self.numa[m[0]]), vdev::Handles(vec![h])));
        }
        let mut rails = Vec::new();
        let mut hs = Vec::new();
        for &p in &m {
            let (l, h) = self.listen(p)?;
            rails.push((l, None, self.numa[p]));
            hs.push(h);
        }
        Ok((Listen::Multi(rails, dev), vdev::Handles(hs)))
    }

    /// Connect from NCCL's device `dev` (plain or merged) to the listener
    /// whose handle is `raw` (`h` decoded from it).
    pub fn connect_any(
        &self,
        dev: usize,
        raw: &[u8; crate::proto::handle::HANDLE_SIZE],
        h: &Handle,
        tc: Option<i32>,
    ) -> Result<Connecting> {
        let m = self.members(dev)?;
        let peer = vdev::decode_handles(h, raw);
        let devs: Vec<_> = m.iter().map(|&p| (self.devs[p].clone(), self.dev_cc[p].clone(), self.numa[p])).collect();
        Connecting::start(&devs, dev, &peer, tc)
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
        // SAFETY: `buf` stays mapped until the registration is dropped (this
        // fn's contract), which is all register requires.
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
        // SAFETY: the memory behind `fd` stays allocated until the registration
        // is dropped (this fn's contract), which is all register_dmabuf requires.
        unsafe { d.mrs.register_dmabuf(dev, buf.ptr, buf.len, fd, offset, access) }
    }

    /// The init log's line: devices, QPs per connection, timeouts.
    pub fn summary(&self) -> String {
        let c = &self.cc;
        format!(
            "using verbs on {} ({} QP(s) per connection{}, NCCL_IB_TIMEOUT={} NCCL_IB_RETRY_CNT={})",
            self.describe(),
            c.nqps,
            if c.split { ", split" } else { "" },
            c.timeout,
            c.retry_cnt
        )
    }

    /// One line per device for the init log.
    pub fn describe(&self) -> String {
        let list: Vec<String> = self
            .devs
            .iter()
            .enumerate()
            .map(|(i, d)| format!("[{i}]{}:{}/{} ({} Mbps)", d.dev_name, d.port, d.kind_name(), d.speed_mbps))
            .collect();
        let oob: SocketAddr = self.oob.addr;
        format!("{}; OOB {}:{}", list.join(" "), self.oob.name, oob.ip())
    }
}
