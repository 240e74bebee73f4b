//! The verbs transport's out-of-band exchange (NCCL's net_ib connect.cc):
//! an out-of-band TCP connection (the TCP transport's listener and
//! connector, with `HandleKind::Ib`) carries one [`Meta`] each way and the
//! sender's [`READY`](crate::proto::ib_meta::READY). This module owns its
//! steps: the connection knobs ([`ConnCfg`]), our address and GID, the QPs
//! and their bring-up against the peer's [`Meta`] (`connect_qps`,
//! `receiver_qps`), and the non-blocking socket I/O with its timeout.
//! [`super::establish`] sequences the steps and builds the comms; it imports
//! this module, never the other way round. Everything is non-blocking, and
//! `connect` never waits for `accept`:
//!
//! ```text
//! sender (connect)                         receiver (accept)
//!   TCP connect + hello  ----------------->  TCP accept + hello
//!   create QPs (INIT), FIFO
//!   Meta(sender)         ----------------->  create QPs, INIT -> RTR -> RTS
//!   connect returns a SendComm               sizes area
//!                        <-----------------  Meta(receiver); accept returns
//!   (in isend/test) RTR -> RTS                a RecvComm that writes no CTS
//!   READY                ----------------->  until READY arrives
//! ```
use std::net::SocketAddr;
use std::sync::Arc;

use super::caps::{self, Limits, Role};
use super::device::{IbDev, LINK_ETH};
use super::gid::{self, SysfsGids};
use super::verbs::{Access, Cq, HostRegion, Init, Qp, RtrParams, Rts, RtsParams};
use crate::config::{AddrRange, Config, Family};
use crate::error::{Error, Result};
use crate::proto::eager;
use crate::proto::fifo::FIFO_BYTES;
use crate::proto::ib_meta::{Meta, FLAG_LATE_RING, LINK_IWARP};
use crate::transport::oob::OobCfg;
use crate::transport::sock::Socket;
pub(super) use crate::transport::sock::{read_some, write_some};

/// Connection knobs, parsed once.
#[derive(Debug, Clone)]
pub struct ConnCfg {
    /// QPs per connection.
    pub nqps: usize,
    /// Split each message across all QPs.
    pub split: bool,
    /// NCCL_IB_TIMEOUT.
    pub timeout: u8,
    /// NCCL_IB_RETRY_CNT.
    pub retry_cnt: u8,
    /// NCCL_IB_PKEY (index).
    pub pkey: u16,
    /// NCCL_IB_TC (-1 = the communicator's, else 0).
    pub tc: i32,
    /// NCCL_IB_FIFO_TC: traffic class of the receiver's QPs (its CTS writes); -1 = the data TC.
    pub fifo_tc: i32,
    /// NCCL_IB_SL (-1 = 0).
    pub sl: i32,
    /// NCCL_IB_GID_INDEX (-1 = auto).
    pub gid_index: i64,
    /// NCCL_IB_ADDR_FAMILY.
    pub family: Family,
    /// NCCL_IB_ROCE_VERSION_NUM.
    pub roce_version: u8,
    /// NCCL_IB_ADDR_RANGE.
    pub addr_range: AddrRange,
    /// NCCL_IB_USE_INLINE.
    pub use_inline: bool,
    /// RUSTNET_IB_EAGER: the eager limit this end offers (0 = off).
    pub eager: u32,
    /// RUSTNET_IB_EAGER_LAZY: the eager ring may come late ([`crate::proto::eager`]).
    pub eager_lazy: bool,
    /// iflush posts a loopback RDMA READ even for host memory
    /// (RUSTNET_FORCE_FLUSH=1 and not NCCL_GDR_FLUSH_DISABLE=1).
    pub flush: bool,
    /// Out-of-band socket settings.
    pub stream: OobCfg,
    /// iWARP: QPs connect through rdma_cm and each lane ends with a notice
    /// SEND instead of a write with immediate ([`super::notice_path`]).
    pub notices: bool,
    /// RUSTNET_RECOVERY_TIMEOUT: seconds a comm may recover after a fabric
    /// fault (0: it fails at the first).
    pub recovery_s: u32,
    /// RUSTNET_IB_RECOVERY_KEEPER: the keeper thread moves the recovery of
    /// a comm NCCL is not calling ([`super::keeper`]).
    pub keeper: bool,
    /// RUSTNET_IWARP_FENCE: an iWARP sender follows each lane's notice with
    /// a delivery fence where the receiver answers it
    /// ([`super::notice_path::NoticeTx::fence`]).
    pub fence: bool,
}

impl ConnCfg {
    /// [`Meta::flags`] this end announces: recovery unless the knob is 0
    /// (on iWARP too since stop 38: new QPs are connected by rdma_cm; a
    /// peer of an earlier build does not announce it on iWARP, so such a
    /// pair fails at the first fault, as before).
    pub fn meta_flags(&self) -> u8 {
        if self.recovery_s > 0 {
            crate::proto::ib_meta::FLAG_RECOVERY
        } else {
            0
        }
    }
}

impl ConnCfg {
    /// From the knob table.
    pub fn from_config(cfg: &Config) -> ConnCfg {
        ConnCfg {
            nqps: cfg.ib_qps_per_connection.get() as usize,
            split: cfg.ib_split_data_on_qps.get() == 1,
            timeout: cfg.ib_timeout.get() as u8,
            retry_cnt: cfg.ib_retry_cnt.get() as u8,
            pkey: cfg.ib_pkey.get() as u16,
            tc: cfg.ib_tc.get() as i32,
            fifo_tc: cfg.ib_fifo_tc.get() as i32,
            sl: cfg.ib_sl.get() as i32,
            gid_index: cfg.ib_gid_index.get(),
            family: cfg.ib_addr_family,
            roce_version: cfg.ib_roce_version.get() as u8,
            addr_range: cfg.ib_addr_range,
            use_inline: cfg.ib_use_inline.get() == 1,
            eager: cfg.ib_eager.get() as u32,
            eager_lazy: cfg.ib_eager_lazy.get() == 1,
            flush: cfg.force_flush.get() == 1 && cfg.gdr_flush_disable.get() == 0,
            stream: OobCfg::from_config(cfg),
            notices: false,
            recovery_s: cfg.recovery_timeout.get() as u32,
            keeper: cfg.ib_recovery_keeper.get() == 1,
            fence: cfg.iwarp_fence.get() == 1,
        }
    }
}

impl ConnCfg {
    /// What this end's queue depths depend on ([`caps`]): `sender` or not
    /// (a receiver's CQ also serves its flush QP).
    pub fn shape(&self, sender: bool) -> caps::Shape {
        caps::Shape {
            nqps: self.nqps,
            split: self.split,
            use_inline: self.use_inline,
            notices: self.notices,
            eager: self.eager > 0,
            flush: !sender && self.flush,
        }
    }
}

/// How this end of a connection is addressed (read fresh per connection).
#[derive(Debug, Clone, Copy)]
pub struct LocalAddr {
    /// Active MTU code.
    pub mtu: u8,
    /// LID.
    pub lid: u16,
    /// GID.
    pub gid: [u8; 16],
    /// GID index.
    pub gid_index: u8,
    /// Address family of the GID (RoCE: 4 or 6; 0 on InfiniBand).
    pub family: u8,
    /// RoCE version of the GID (1, 2; 0 when unknown or InfiniBand).
    pub roce_version: u8,
    /// RoCE: the interface index of the GID's netdev in this network
    /// namespace (0: InfiniBand, iWARP, or not visible here).
    pub ifindex: u32,
}

/// The GID selection preferences of `cc`.
pub fn gid_prefs(cc: &ConnCfg) -> gid::Prefs {
    gid::Prefs {
        family: Some(cc.family),
        version: cc.roce_version,
        range: cc.addr_range,
        forced: (cc.gid_index >= 0).then_some(cc.gid_index as u32),
    }
}

/// Choose the GID of `dev` for a new connection from a fresh read of its
/// table (RoCE), with the reason; the choice is recorded per port and logged
/// at INFO when it is new or changed.
pub fn choose_gid(dev: &IbDev, gid_tbl_len: u32, cc: &ConnCfg) -> Result<gid::GidChoice> {
    let t = SysfsGids::new(std::path::Path::new("/sys"), &dev.dev_name, dev.port, gid_tbl_len);
    let c = gid::choose(&t, &format!("{}:{}", dev.dev_name, dev.port), &gid_prefs(cc))?;
    gid::remember(&c);
    Ok(c)
}

/// Query the port and choose the GID for a new connection.
pub fn local_addr(dev: &IbDev, cc: &ConnCfg) -> Result<LocalAddr> {
    let pa = dev.port_attr()?;
    if pa.state != super::ffi::IBV_PORT_ACTIVE {
        return Err(Error::Usage(format!("{} is {} now (was ACTIVE at init)", dev.describe(), super::device::port_state_name(pa.state))));
    }
    let mtu = pa.active_mtu.clamp(1, 5) as u8;
    if dev.iwarp {
        // addressed through rdma_cm, not by GID: its one GID is for messages only
        let g = dev.ctx.query_gid(dev.port, 0).unwrap_or([0; 16]);
        return Ok(LocalAddr { mtu, lid: 0, gid: g, gid_index: 0, family: 0, roce_version: 0, ifindex: 0 });
    }
    if dev.link_layer != LINK_ETH {
        // InfiniBand: GID 0 (LID routing inside the subnet)
        let g = dev.ctx.query_gid(dev.port, 0)?;
        return Ok(LocalAddr { mtu, lid: pa.lid, gid: g, gid_index: 0, family: 0, roce_version: 0, ifindex: 0 });
    }
    // The verbs stack's own view of the entry: sysfs and it agree unless the
    // table changed in between; then choose again, once.
    let mut again = true;
    let (c, g) = loop {
        let c = choose_gid(dev, pa.gid_tbl_len.max(0) as u32, cc)?;
        let g = dev.ctx.query_gid(dev.port, c.index)?;
        if g == c.gid {
            break (c, g);
        }
        if !again {
            return Err(Error::Usage(format!(
                "{}: GID {} changed while it was chosen (sysfs {}, verbs {}): the address table is moving",
                dev.describe(),
                c.index,
                gid::show(&c.gid),
                gid::show(&g)
            )));
        }
        again = false;
    };
    let ifindex = c.ndev.as_deref().map_or(0, crate::transport::sock::if_index);
    Ok(LocalAddr {
        mtu,
        lid: pa.lid,
        gid: g,
        gid_index: c.index as u8,
        family: c.family_code(),
        roce_version: c.version.unwrap_or(0),
        ifindex,
    })
}

fn family_text(code: u8) -> &'static str {
    match code {
        4 => "IPv4",
        6 => "IPv6",
        _ => "?",
    }
}

/// Both ends of a RoCE connection must use GIDs of one address family and
/// one RoCE version; the error names both GIDs.
pub fn check_peer_gid(dev: &IbDev, local: &LocalAddr, remote: &Meta) -> Result<()> {
    if dev.link_layer != LINK_ETH {
        return Ok(());
    }
    let fam_differs = local.family != 0 && remote.family != 0 && local.family != remote.family;
    let ver_differs = local.roce_version != 0 && remote.roce_version != 0 && local.roce_version != remote.roce_version;
    if !fam_differs && !ver_differs {
        return Ok(());
    }
    let what = if fam_differs { "address families" } else { "RoCE versions" };
    Err(Error::Usage(format!(
        "RoCE GID mismatch ({what} differ): this end uses {}:{} GID {} {} ({}, RoCE v{}), the peer uses {}:{} GID {} {} ({}, RoCE v{}); \
         set the same NCCL_IB_ADDR_FAMILY, NCCL_IB_ROCE_VERSION_NUM and NCCL_IB_ADDR_RANGE (or none) on every rank",
        dev.dev_name,
        dev.port,
        local.gid_index,
        gid::show(&local.gid),
        family_text(local.family),
        local.roce_version,
        remote.name,
        remote.port,
        remote.gid_index,
        gid::show(&remote.gid),
        family_text(remote.family),
        remote.roce_version
    )))
}

/// RTR parameters toward `remote` (MTU = the smaller of both ends).
pub fn rtr_params(dev: &IbDev, local: &LocalAddr, remote: &Meta, qp_index: usize, tc: u8, sl: u8) -> RtrParams {
    let global = dev.link_layer == LINK_ETH || local.gid[..8] != remote.gid[..8];
    RtrParams {
        dest_qpn: remote.qpns[qp_index % remote.qpns.len()],
        mtu: local.mtu.min(remote.mtu) as u32,
        port: dev.port,
        global,
        dgid: remote.gid,
        sgid_index: local.gid_index,
        dlid: remote.lid,
        tc,
        sl,
    }
}

/// What either end creates before it knows its peer.
pub(super) struct Setup {
    pub dev: Arc<IbDev>,
    pub cq: Cq,
    pub qps: Vec<Qp<Init>>,
    pub local: LocalAddr,
    /// Sender: the CTS FIFO the peer writes. Receiver: the sizes area the peer writes.
    pub region: HostRegion,
    /// Sender: sizes staging. Receiver: CTS staging.
    pub stage: HostRegion,
    /// The eager limit this end offers (0 = off).
    pub eager: u32,
    /// ... and whether its ring may come late (RUSTNET_IB_EAGER_LAZY).
    pub late_ok: bool,
    /// What its queues were sized from (a recovery makes new QPs and a new CQ alike).
    pub plan: caps::Plan,
    /// [`Meta::flags`] this end announces (the late ring's bit aside: `meta` adds it).
    pub flags: u8,
}

/// What a connection's QPs let the peer do: write; on iWARP a receiver's
/// QPs also answer RDMA READs, the sender's delivery fence
/// ([`super::notice_path::NoticeTx::fence`]). A sender's QPs never
/// admit a read: nobody reads a sender.
pub fn qp_access(cc: &ConnCfg, sender: bool) -> Access {
    if cc.notices && !sender {
        Access::REMOTE_WRITE.with(Access::REMOTE_READ)
    } else {
        Access::REMOTE_WRITE
    }
}

impl Setup {
    pub fn new(dev: &Arc<IbDev>, cc: &ConnCfg, sender: bool) -> Result<Setup> {
        let local = local_addr(dev, cc)?;
        let nqps = cc.nqps;
        let role = if sender { Role::Send } else { Role::Recv };
        let plan = caps::Plan { role, shape: cc.shape(sender), lim: Limits::new(dev.max_qp_wr, dev.max_cqe) };
        let cq = Cq::new(&dev.ctx, plan.cqe() as i32)?;
        let mut qps = Vec::with_capacity(nqps);
        for i in 0..nqps {
            qps.push(Qp::create(&dev.pd, &cq, plan.qp(i), dev.port, cc.pkey, qp_access(cc, sender))?);
        }
        // small regions from the device's shared blocks (slab.rs): the one
        // the peer writes with a registration of its own, the staging without
        let ctl = &dev.ctl;
        let (region, stage) = if sender {
            // the FIFO, then the credit word the receiver writes
            let fifo = ctl.region(FIFO_BYTES + eager::CREDIT_BYTES, Access::REMOTE_WRITE)?;
            (fifo, ctl.region(eager::SIZES_AREA_BYTES, Access::LOCAL_READ)?)
        } else {
            // CTS staging, then the credit word's source
            let stage = ctl.region(FIFO_BYTES + eager::CREDIT_BYTES, Access::LOCAL_READ)?;
            // (iWARP: the sender's delivery fence reads one byte of it)
            let access = if cc.notices { Access::REMOTE_WRITE.with(Access::REMOTE_READ) } else { Access::REMOTE_WRITE };
            (ctl.region(eager::SIZES_AREA_BYTES, access)?, stage)
        };
        Ok(Setup { dev: dev.clone(), cq, qps, local, region, stage, eager: cc.eager, late_ok: cc.eager_lazy, plan, flags: cc.meta_flags() })
    }

    pub fn meta(&self, tc: u8, sl: u8, split: bool) -> Meta {
        Meta {
            qpns: self.qps.iter().map(|q| q.qpn()).collect(),
            mtu: self.local.mtu,
            link: wire_link(&self.dev),
            port: self.dev.port,
            gid_index: self.local.gid_index,
            lid: self.local.lid,
            tc,
            sl,
            split,
            gid: self.local.gid,
            family: self.local.family,
            roce_version: self.local.roce_version,
            addr: self.region.addr() as u64,
            rkey: self.region.rkey(),
            name: self.dev.dev_name.clone(),
            eager: self.eager,
            ring: (0, 0),
            // a sender takes a ring announced later (a receiver's answer is RecvComm::local_meta)
            flags: self.flags | if self.eager > 0 && self.late_ok { FLAG_LATE_RING } else { 0 },
            secret: 0,
        }
    }
}

/// A connection's QPs on their way to RTS: those moved, those left in INIT,
/// and when to try again after the link went away inside a move.
pub(super) struct Bringup {
    done: Vec<Qp<Rts>>,
    left: std::collections::VecDeque<Qp<Init>>,
    /// Not before this (a retry waits for the port, then a little).
    pub next: std::time::Instant,
    /// Why the last move failed.
    pub why: Error,
    /// Moves the link cut short so far (the first few get a WARN each).
    tries: u32,
}

/// What [`connect_qps`] / [`bring_up`] got to.
pub(super) enum Brought {
    /// Every QP is in RTS.
    Up(Vec<Qp<Rts>>),
    /// The link went away inside a move to RTR ([`link_lost`]): the QPs
    /// wait, in INIT from the one that failed on, to be moved again once the
    /// port is ACTIVE ([`retry_bringup`]).
    Later(Box<Bringup>),
}

/// How soon a move the link cut short is tried again (once the port is ACTIVE).
const RTR_RETRY: std::time::Duration = std::time::Duration::from_millis(50);

/// Where a connection's QPs go: our port and address, the peer's metadata,
/// the traffic class and service level, the connection's knobs, and the
/// peer's out-of-band address (for messages).
#[derive(Clone, Copy)]
pub(super) struct Toward<'a> {
    pub dev: &'a IbDev,
    pub local: &'a LocalAddr,
    pub remote: &'a Meta,
    pub tc: u8,
    pub sl: u8,
    pub cc: &'a ConnCfg,
    pub peer: &'a SocketAddr,
}

/// Bring `qps` to RTS toward `t.remote`.
pub(super) fn connect_qps(t: &Toward<'_>, qps: Vec<Qp<Init>>) -> Result<Brought> {
    let Toward { dev, local, remote, .. } = *t;
    if remote.qpns.len() != qps.len() {
        return Err(Error::Usage(format!(
            "the peer uses {} QPs per connection and we use {}: set the same NCCL_IB_QPS_PER_CONNECTION on every rank",
            remote.qpns.len(),
            qps.len()
        )));
    }
    check_peer_gid(dev, local, remote)?;
    settle_neighbour(dev, local, remote);
    let b = Bringup {
        done: Vec::with_capacity(qps.len()),
        left: qps.into(),
        next: std::time::Instant::now(),
        why: Error::Internal("no move failed".into()),
        tries: 0,
    };
    bring_up(t, Box::new(b))
}

/// Move what is left of `b` to RTS, in order.
pub(super) fn bring_up(t: &Toward<'_>, mut b: Box<Bringup>) -> Result<Brought> {
    let Toward { dev, local, remote, tc, sl, cc, peer } = *t;
    let rts = RtsParams { timeout: cc.timeout, retry_cnt: cc.retry_cnt };
    while let Some(q) = b.left.pop_front() {
        let i = b.done.len();
        let seen = dev.health.port_events(dev.port);
        let (moved, injected) = if crate::fault::take_rtr() {
            let e =
                Error::sys(format!("ibv_modify_qp(QP {:#x} -> RTR) [RUSTNET_FAULT_RTR]", q.qpn()), crate::error::Errno(libc::ETIMEDOUT));
            (Err((q, e)), true)
        } else {
            (q.try_rtr(&rtr_params(dev, local, remote, i, tc, sl)), false)
        };
        match moved {
            Ok(r) => b.done.push(r.to_rts(&rts)?),
            Err((q, e)) if injected || link_lost(dev, &e, seen) => {
                b.tries += 1;
                let what = || {
                    format!(
                        "{}: moving QP {:#x} to RTR failed while connecting to {peer}: {e}; the link went away inside the call \
                         (RoCE: the kernel resolves the peer's address there): trying again once the port is ACTIVE (up to RUSTNET_CONNECT_TIMEOUT={} s)",
                        dev.name,
                        q.qpn(),
                        cc.stream.connect_timeout_s.max(1)
                    )
                };
                if b.tries <= 3 {
                    tracing::warn!("{}", what());
                } else {
                    tracing::debug!("{}", what());
                }
                b.left.push_front(q);
                b.next = std::time::Instant::now() + RTR_RETRY;
                b.why = e;
                return Ok(Brought::Later(b));
            }
            Err((_, e)) => return Err(e),
        }
    }
    Ok(Brought::Up(std::mem::take(&mut b.done)))
}

/// Did a move to RTR fail because the link went away inside it (a flap
/// during connect), so the same move may work once the port is back? A
/// failed `ibv_modify_qp` to RTR (RoCE resolves the peer's address inside
/// that call, which then times out) while the port is not ACTIVE now, or
/// after it reported an event since `seen` (taken before the call).
/// Anything else is not retried: another step, or a move that fails with
/// the port up and steady (a wrong route, an unreachable GID) fails at once
/// as before.
pub(super) fn link_lost(dev: &IbDev, e: &Error, seen: (u32, u32)) -> bool {
    let Error::Sys { op, .. } = e else { return false };
    op.contains("-> RTR)")
        && (dev.health.port_events(dev.port) != seen || dev.port_attr().is_ok_and(|p| p.state != super::ffi::IBV_PORT_ACTIVE))
}

/// A connect whose QPs wait after [`Brought::Later`]: may it try again now?
/// `Ok(false)`: not yet (the port is not ACTIVE, or the pause after a
/// failed move is not over); an error once RUSTNET_CONNECT_TIMEOUT has
/// passed since `since` (the handshake's start), naming the last failure.
pub(super) fn retry_bringup(dev: &IbDev, cc: &ConnCfg, b: &Bringup, since: std::time::Instant, peer: &SocketAddr) -> Result<bool> {
    let t = cc.stream.connect_timeout_s.max(1) as u64;
    if since.elapsed() >= std::time::Duration::from_secs(t) {
        return Err(Error::Remote {
            peer: peer.to_string(),
            what: format!(
                "{}: could not move the QPs to RTR within RUSTNET_CONNECT_TIMEOUT={t} s: the link went away while connecting, {} tries failed, the last: {}",
                dev.describe(),
                b.tries,
                b.why
            ),
        });
    }
    if std::time::Instant::now() < b.next {
        return Ok(false);
    }
    Ok(dev.port_attr().is_ok_and(|p| p.state == super::ffi::IBV_PORT_ACTIVE))
}

/// Most a first connect waits for the peer's neighbour entry.
const NEIGH_CONNECT_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// RoCE: make sure the kernel has the peer's MAC before `ibv_modify_qp` to
/// RTR asks for it: when the entry is missing (a peer never talked to over
/// IP, or one whose entry expired), the resolution inside that call can
/// miss its own answer and sleep a whole second ([`super::neigh`]). A
/// valid entry costs one netlink question; InfiniBand, link-local GIDs and
/// netdevs this namespace does not see, none.
pub(super) fn settle_neighbour(dev: &IbDev, local: &LocalAddr, remote: &Meta) {
    if dev.link_layer != LINK_ETH || local.ifindex == 0 || gid::is_link_local(&local.gid) || gid::is_link_local(&remote.gid) {
        return;
    }
    if local.gid == remote.gid {
        return; // (a loopback connection on this port: no neighbour)
    }
    let (src, dst) = (gid::ip_of(&local.gid), gid::ip_of(&remote.gid));
    match super::neigh::settle(src, dst, local.ifindex, NEIGH_CONNECT_WAIT) {
        super::neigh::Settled::Already => {}
        super::neigh::Settled::NoResolution(s) => {
            tracing::debug!("{}: {dst} needs no neighbour entry here (it stays {s}): nothing to wait for", dev.name)
        }
        super::neigh::Settled::Resolved(was, took) => tracing::info!(
            "{}: the neighbour entry of {dst} was {was}: resolved in {:.1} ms before connecting the QPs",
            dev.name,
            took.as_secs_f64() * 1e3
        ),
        super::neigh::Settled::NotYet(was) => tracing::info!(
            "{}: the neighbour entry of {dst} was {was} and is still being resolved after {} ms: connecting anyway (the kernel resolves it inside ibv_modify_qp)",
            dev.name,
            NEIGH_CONNECT_WAIT.as_millis()
        ),
    }
}

/// A sender waiting for the receiver's metadata (the receiver's acceptance)
/// since `since`: an error naming the peer and the knob once
/// `RUSTNET_CONNECT_TIMEOUT` has passed (a listener that took the TCP
/// connection but never answers is not a librustnet receiver).
pub(super) fn within_connect_timeout(since: std::time::Instant, cc: &ConnCfg, peer: &SocketAddr) -> Result<()> {
    let t = cc.stream.connect_timeout_s.max(1);
    if since.elapsed() < std::time::Duration::from_secs(t as u64) {
        return Ok(());
    }
    Err(Error::Remote {
        peer: peer.to_string(),
        what: format!(
            "connected, but the receiver did not answer with its connection metadata within RUSTNET_CONNECT_TIMEOUT={t} s: \
             that rank is not calling accept, or the port belongs to a program that is not a librustnet listener"
        ),
    })
}

/// The traffic class and service level a sender uses for its (data) QPs.
/// Precedence as in NCCL 2.26+: `NCCL_IB_TC` when set, else the
/// communicator's traffic class (ABI v10 `connect`), else 0; `NCCL_IB_SL`
/// when set, else 0. Both travel in the metadata and the receiver follows
/// them (its traffic class only unless `NCCL_IB_FIFO_TC` is set).
pub fn choose_tc_sl(cc: &ConnCfg, comm_tc: Option<i32>) -> (u8, u8) {
    let tc = if cc.tc >= 0 { cc.tc } else { comm_tc.filter(|&t| (0..=255).contains(&t)).unwrap_or(0) };
    let sl = if cc.sl >= 0 { cc.sl } else { 0 };
    (tc as u8, sl as u8)
}

/// The traffic class of the receiver's QPs, which carry its CTS writes:
/// `NCCL_IB_FIFO_TC` when set (RoCE only, as NCCL), else the sender's.
pub fn receiver_tc(cc: &ConnCfg, link_layer: u8, sender_tc: u8) -> u8 {
    if cc.fifo_tc >= 0 && link_layer == LINK_ETH {
        cc.fifo_tc as u8
    } else {
        sender_tc
    }
}

/// What [`Meta::link`] says about `dev`: its link layer, or
/// [`LINK_IWARP`] for an iWARP device (whose link layer reads Ethernet).
pub fn wire_link(dev: &IbDev) -> u8 {
    if dev.iwarp {
        LINK_IWARP
    } else {
        dev.link_layer
    }
}

fn link_name(link: u8) -> &'static str {
    match link {
        LINK_ETH => "RoCE",
        LINK_IWARP => "iWARP",
        _ => "InfiniBand",
    }
}

/// Both ends must be on the same kind of network (IB, RoCE or iWARP); the
/// error names both.
pub fn check_peer_link(dev: &IbDev, remote: &Meta, peer: &SocketAddr) -> Result<()> {
    if remote.link == wire_link(dev) {
        return Ok(());
    }
    Err(Error::Usage(format!(
        "peer {peer} connects from a {} port ({}) to our {} ({}): link layers differ",
        link_name(remote.link),
        remote.name,
        link_name(wire_link(dev)),
        dev.describe()
    )))
}

/// What [`receiver_qps`] got to: the set-up (its QPs taken out), the
/// established QPs and the connection knobs; or, when the link went away
/// inside a move to RTR (logged), why: the accept starts over with new QPs
/// once the port is back (the sender has not seen these).
pub(super) type Accepted = std::result::Result<(Setup, Vec<Qp<Rts>>, ConnCfg), Error>;

/// The receiver's half of the exchange once the sender's [`Meta`] arrived:
/// check that the two ports can talk (link layer, GIDs), create our QPs and
/// bring them to RTS against the sender's. Returns the set-up (its QPs taken
/// out), the established QPs and the connection knobs as the sender asked
/// (split). On a GID mismatch the sender is told who we are first, so both
/// ends fail naming both GIDs.
pub(super) fn receiver_qps(dev: &Arc<IbDev>, cc: &ConnCfg, sock: &Socket, peer: &SocketAddr, remote: &Meta) -> Result<Accepted> {
    check_peer_link(dev, remote, peer)?;
    let setup = Setup::new(dev, cc, false)?;
    if let Err(e) = check_peer_gid(dev, &setup.local, remote) {
        // Tell the sender who we are before failing, so that it fails
        // with the same message naming both GIDs (one short write; the
        // socket buffer holds it).
        let tx = setup.meta(0, 0, remote.split).encode();
        let mut sent = 0;
        let _ = write_some(sock, &tx, &mut sent, peer, "connection metadata");
        return Err(e);
    }
    let tc = receiver_tc(cc, dev.link_layer, remote.tc);
    let mut cc = cc.clone();
    cc.split = remote.split;
    // (a move the link cut short: accept waits for the port and starts
    // over with new QPs, which the sender has not seen yet)
    let to = Toward { dev, local: &setup.local, remote, tc, sl: remote.sl, cc: &cc, peer };
    let qps = match connect_qps(&to, setup.qps)? {
        Brought::Up(q) => q,
        Brought::Later(b) => return Ok(Err(b.why)),
    };
    let setup = Setup { qps: Vec::new(), ..setup };
    Ok(Ok((setup, qps, cc)))
}
