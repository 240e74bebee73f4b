//! The verbs transport over iWARP: what differs from IB/RoCE, kept out of
//! [`super::p2p`] except for short hooks.
//!
//! - Connection: the out-of-band TCP exchange of [`super::handshake`] stays
//!   (one [`Meta`] each way, then READY), but the QPs are connected by
//!   rdma_cm ([`super::rdmacm`]; iWARP refuses RTR -> RTS by hand). The
//!   receiver opens an rdma_cm listener on its device's address when the
//!   sender's metadata arrives and puts that address in its own metadata
//!   ([`RecvSide::fill_meta`]: `gid` = the address, `lid` = the port); the
//!   sender starts one rdma_cm connection per QP there ([`CmConnect`]) with
//!   its QP's number and, as private data, a cookie naming the receive comm,
//!   the QP index and the receiver's random secret (its metadata's `secret`,
//!   which only the out-of-band connection carried); the receiver accepts a
//!   request only if it carries all three and comes from the address the
//!   sender's metadata named (or the out-of-band peer's), with its QP of that
//!   index ([`RecvSide::cm_ready`]), and refuses anything else with a WARN
//!   naming where it came from.
//!   All of it is polled from the comms' existing progress points; nothing
//!   waits. The sender writes READY once its side is established; the
//!   receiver writes its first CTS only when READY came and its side is
//!   established too, its notice receives posted.
//! - Data: no immediates. Each lane of a message is its RDMA WRITEs then one
//!   SEND, the *notice* ([`crate::proto::notice`]), in one post
//!   ([`NoticeTx::lane`]); the receiver keeps [`RECV_DEPTH`] receives with
//!   buffers posted on every QP ([`RecvRing`]), decodes each notice into the
//!   word an immediate would have carried ([`RecvSide::on_recv`]), and
//!   [`super::p2p`] completes the receive exactly as on IB (sizes, checks,
//!   groups, failures); lane 0's notice carries a grouped receive's sizes
//!   ([`RecvSide::sizes`]) instead of the sizes write. irecv takes a receive (and
//!   so ever writes its CTS) only while [`RecvSide::may_advertise`] holds,
//!   otherwise NCCL retries it: iWARP has no RNR retry.
//! - Faults: a comm recovers as on IB/RoCE ([`super::reconnect`]), with
//!   rdma_cm in its rebuild: the receiver opens a new listener
//!   ([`RecvSide::restart`]) whose address its State carries, the sender
//!   dials it as it first did ([`NoticeTx::redial`], [`Dial`]), and both
//!   poll the new connections from the recovery's connect step; the notice
//!   rings start empty on the new QPs. A connection that closed under a
//!   comm shows as flushed work requests or, with nothing posted, as
//!   rdma_cm's DISCONNECTED (`connection_lost`, read at liveness looks).
//! - Off on iWARP, decided once per device ([`conn_cfg`], one INFO line):
//!   the eager path (the notice path is the one verified over iWARP, and one
//!   decision per comm keeps the two from mixing), the loopback flush QP (it
//!   cannot be brought up by hand), and GPUDirect ([`super::gdr::host_only`]).
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use super::device::IbDev;
use super::ffi::{ibv_wc, IBV_WC_RECV};
use super::handshake::ConnCfg;
use super::rdmacm::{self, CmConn, CmListener, Progress};
use super::verbs::{Access, HostRegion, Init, Pd, Qp, Rts, SendWr};
use crate::error::{Error, Result};
use crate::proto::error::ProtoError;
use crate::proto::fifo::{Group, Imm, ImmKind, PlannedWr, WrKind, FIFO_DEPTH, MAX_LANE_WRS};
use crate::proto::ib_meta::{Meta, FLAG_CM_SECRET, FLAG_FENCE, LINK_IWARP};
use crate::proto::nic::WrId;
use crate::proto::notice::{Assembler, Notice, RecvRing, MAX_LANES, NOTICE_BYTES, RECV_DEPTH};
use crate::transport::MAX_RECVS;

/// The connection settings of an iWARP device: notices on, the eager path
/// and flushes off, at most [`MAX_LANES`] QPs; says so once in the log.
pub fn conn_cfg(cc: &ConnCfg, dev: &IbDev) -> ConnCfg {
    let mut notes = Vec::new();
    if cc.eager > 0 {
        notes.push("eager path off (RUSTNET_IB_EAGER applies to IB/RoCE only)".to_string());
    }
    if cc.flush {
        notes.push("RUSTNET_FORCE_FLUSH ignored (host memory only: nothing to flush)".to_string());
    }
    if !cc.fence {
        notes.push(
            "RUSTNET_IWARP_FENCE=0: a send is done once the NIC took it, so a fault with a message in flight may fail the comm, naming the message"
                .to_string(),
        );
    }
    let nqps = cc.nqps.min(MAX_LANES);
    if nqps < cc.nqps {
        notes.push(format!("NCCL_IB_QPS_PER_CONNECTION={} capped at {MAX_LANES}", cc.nqps));
    }
    let extra = if notes.is_empty() { String::new() } else { format!("; {}", notes.join("; ")) };
    tracing::info!("{}: {}{extra}", dev.describe(), super::iwarp::IWARP_HOW);
    ConnCfg { notices: true, eager: 0, flush: false, nqps, ..cc.clone() }
}

/// The address rdma_cm binds to `dev`: the first of this host's addresses
/// (IPv4 first, then global IPv6) that rdma_cm maps to that device.
pub fn device_ip(dev: &IbDev) -> Result<IpAddr> {
    let mut cands: Vec<IpAddr> = crate::transport::sock::interfaces()?
        .into_iter()
        .filter(|i| i.running && !i.loopback)
        .map(|i| i.addr)
        .filter(|a| match a {
            IpAddr::V4(_) => true,
            // a link-local address would need its scope id
            IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 != 0xfe80,
        })
        .collect();
    cands.sort_by_key(|a| a.is_ipv6());
    for ip in &cands {
        if rdmacm::device_of(*ip)?.as_deref() == Some(dev.dev_name.as_str()) {
            return Ok(*ip);
        }
    }
    Err(Error::Usage(format!(
        "{}: none of this host's addresses {cands:?} belongs to it (rdma_cm binds none of them to {}): \
         give its network interface an IP address",
        dev.describe(),
        dev.dev_name
    )))
}

/// The rdma_cm listener address a receiver's [`Meta`] carries.
pub fn listener_addr(m: &Meta) -> SocketAddr {
    addr_of(m.gid, m.lid)
}

/// An rdma_cm address as a GID-shaped field carries it (IPv4 as
/// IPv4-mapped IPv6), with the port in the LID field: the metadata's and a
/// recovery State's way.
pub fn addr_of(gid: [u8; 16], port: u16) -> SocketAddr {
    SocketAddr::new(unmapped(IpAddr::V6(Ipv6Addr::from(gid))), port)
}

/// [`addr_of`]'s GID field for `ip`.
pub fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

const COOKIE_MAGIC: [u8; 4] = *b"RNCM";
/// Magic, QP index, QP count, cookie (builds before the secret sent this much).
const PRIVATE_LEN: usize = 16;
/// ... and the receiver's secret.
const PRIVATE_SECRET_LEN: usize = PRIVATE_LEN + 4;

/// The private data of the sender's connect request for QP `i` of `n`:
/// magic, QP index, QP count, the receive comm's cookie (the address of its
/// sizes area, from its metadata) and, for a receiver that asked for it
/// ([`FLAG_CM_SECRET`]), its secret. Returns the bytes and how many to send.
fn private(cookie: u64, secret: Option<u32>, i: usize, n: usize) -> ([u8; PRIVATE_SECRET_LEN], usize) {
    let mut b = [0u8; PRIVATE_SECRET_LEN];
    b[..4].copy_from_slice(&COOKIE_MAGIC);
    b[4..6].copy_from_slice(&(i as u16).to_le_bytes());
    b[6..8].copy_from_slice(&(n as u16).to_le_bytes());
    b[8..16].copy_from_slice(&cookie.to_le_bytes());
    match secret {
        Some(s) => {
            b[16..20].copy_from_slice(&s.to_le_bytes());
            (b, PRIVATE_SECRET_LEN)
        }
        None => (b, PRIVATE_LEN),
    }
}

/// Which QP a connect request is for, if it is one of ours for this comm
/// (with our `secret` when we require one); else why not.
fn parse_private(p: &[u8], cookie: u64, secret: Option<u32>, n: usize) -> std::result::Result<usize, &'static str> {
    if p.len() < PRIVATE_LEN || p[..4] != COOKIE_MAGIC {
        return Err("not a librustnet request");
    }
    let i = u16::from_le_bytes([p[4], p[5]]) as usize;
    let m = u16::from_le_bytes([p[6], p[7]]) as usize;
    let c = u64::from_le_bytes(p[8..16].try_into().map_err(|_| "short")?);
    if c != cookie {
        return Err("for another comm (cookie)");
    }
    if let Some(s) = secret {
        if p.len() < PRIVATE_SECRET_LEN || p[16..20] != s.to_le_bytes() {
            return Err("without this comm's secret");
        }
    }
    if m != n || i >= n {
        return Err("for a QP this comm does not have");
    }
    Ok(i)
}

/// A sender's metadata on iWARP: its `gid` names the address its rdma_cm
/// connections will come from (the receiver accepts only those), and it
/// says it echoes the receiver's secret ([`FLAG_CM_SECRET`]).
pub fn declare_source(dev: &IbDev, m: &mut Meta) {
    if let Ok(ip) = device_ip(dev) {
        (m.gid, m.family) = (gid_of(ip), if ip.is_ipv4() { 4 } else { 6 });
        m.flags |= FLAG_CM_SECRET;
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn unmapped(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// Who may connect to a receiver's listener: with a sender that declared
/// its rdma_cm address ([`FLAG_CM_SECRET`]), only that address or the
/// out-of-band peer's; with an older sender, anyone with the cookie (as
/// those builds did).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Admit {
    secret: Option<u32>,
    from: Vec<IpAddr>,
}

impl Admit {
    /// For the sender whose metadata is `sender`, met over the out-of-band
    /// connection from `oob`; `secret` is ours (in our metadata).
    fn new(sender: &Meta, oob: IpAddr, secret: u32) -> Admit {
        if sender.flags & FLAG_CM_SECRET == 0 {
            return Admit { secret: None, from: Vec::new() };
        }
        let declared = unmapped(IpAddr::V6(Ipv6Addr::from(sender.gid)));
        Admit { secret: Some(secret), from: vec![declared, unmapped(oob)] }
    }

    /// The QP index a request (its private data, its source) is for; else why it is refused.
    fn check(&self, private: &[u8], src: Option<IpAddr>, cookie: u64, n: usize) -> std::result::Result<usize, String> {
        if !self.from.is_empty() {
            match src.map(unmapped) {
                Some(a) if self.from.contains(&a) => {}
                Some(a) => {
                    return Err(format!(
                        "from {a}, not the peer ({})",
                        self.from.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(" or ")
                    ))
                }
                None => return Err("from an address rdma_cm did not give".into()),
            }
        }
        parse_private(private, cookie, self.secret, n).map_err(str::to_string)
    }
}

fn proto(peer: String, e: ProtoError) -> Error {
    Error::Protocol { peer, what: e.to_string() }
}

// ---------------------------------------------------------------- sender

/// The sender's QPs once rdma_cm connected them (RTS), and the connections
/// that keep them so.
pub type Connected = (Vec<Qp<Rts>>, Vec<CmConn>);

/// Where and how a sender dials the receiver's listener: what its connect
/// requests carry (the receive comm's cookie and secret) and whom errors
/// name. Kept by [`NoticeTx`] so that a recovery dials the receiver's new
/// listener the same way.
#[derive(Debug, Clone)]
pub struct Dial {
    cookie: u64,
    /// The receiver's secret, when it asked for one.
    secret: Option<u32>,
    /// The out-of-band peer and the receiver's device, for errors.
    label: String,
}

/// The sender's rdma_cm connections, one per QP, in progress.
pub struct CmConnect {
    conns: Vec<CmConn>,
    qps: Vec<Qp<Init>>,
    est: Vec<bool>,
    cookie: u64,
    /// The receiver's secret, when it asked for one.
    secret: Option<u32>,
    /// [`Dial::label`].
    label: String,
    dev: String,
    peer: String,
    since: Instant,
    timeout_s: u32,
    /// Where the connections go from and to (a connection whose local port
    /// was taken starts over, [`CmConn::connect`]).
    src: IpAddr,
    dst: SocketAddr,
    /// Connections started over so far (at most [`PORT_RETRIES`]).
    restarts: u32,
}

/// How many times one connect may start a connection over because the
/// local port rdma_cm picked was taken ([`CmConn::connect`]).
const PORT_RETRIES: u32 = 8;

impl CmConnect {
    /// Start connecting our `qps` (INIT) to the receiver whose metadata is
    /// `remote`; returns at once.
    /// `since` is when the connect began (before the metadata exchange), so
    /// RUSTNET_CONNECT_TIMEOUT bounds the whole connect, not each phase.
    pub fn start(dev: &IbDev, cc: &ConnCfg, qps: Vec<Qp<Init>>, remote: &Meta, oob_peer: &SocketAddr, since: Instant) -> Result<CmConnect> {
        if remote.link != LINK_IWARP {
            return Err(Error::Usage(format!(
                "peer {oob_peer} ({}) answered from a port that is not iWARP, to our {}: link layers differ",
                remote.name,
                dev.describe()
            )));
        }
        if remote.qpns.len() != qps.len() {
            return Err(Error::Usage(format!(
                "the peer uses {} QPs per connection and we use {}: set the same NCCL_IB_QPS_PER_CONNECTION on every rank",
                remote.qpns.len(),
                qps.len()
            )));
        }
        let dial = Dial {
            cookie: remote.addr,
            secret: (remote.flags & FLAG_CM_SECRET != 0).then_some(remote.secret),
            label: format!("{oob_peer} ({})", remote.name),
        };
        CmConnect::toward(dev, cc, qps, listener_addr(remote), dial, since)
    }

    /// Connect `qps` (INIT) to the listener at `dst` as `dial` says (a
    /// recovery: the receiver's new listener, from its State).
    pub fn toward(dev: &IbDev, cc: &ConnCfg, qps: Vec<Qp<Init>>, dst: SocketAddr, dial: Dial, since: Instant) -> Result<CmConnect> {
        let src = device_ip(dev)?;
        let peer = format!("{} rdma_cm {dst}", dial.label);
        let mut conns = Vec::with_capacity(qps.len());
        for _ in 0..qps.len() {
            conns.push(CmConn::start(src, dst, &dial.label)?);
        }
        let n = qps.len();
        Ok(CmConnect {
            conns,
            qps,
            est: vec![false; n],
            cookie: dial.cookie,
            secret: dial.secret,
            label: dial.label,
            dev: dev.dev_name.clone(),
            peer,
            since,
            timeout_s: cm_timeout_s(cc),
            src,
            dst,
            restarts: 0,
        })
    }

    /// How this connect dials (kept for a recovery's).
    pub fn dial(&self) -> Dial {
        Dial { cookie: self.cookie, secret: self.secret, label: self.label.clone() }
    }

    /// Advance every connection; the QPs (now RTS) and the connections to
    /// keep once all are established.
    pub fn progress(&mut self) -> Result<Option<Connected>> {
        let n = self.conns.len();
        for i in 0..n {
            if self.est[i] {
                continue;
            }
            match self.conns[i].poll()? {
                Progress::Pending => {}
                Progress::NeedQp => {
                    let on = self.conns[i].device_name();
                    if on.as_deref() != Some(self.dev.as_str()) {
                        return Err(Error::Usage(format!(
                            "rdma_cm routes the connection to {} through {}, not through {}, whose QPs we connect: \
                             the two devices' addresses must be reachable through their own interfaces",
                            self.peer,
                            on.unwrap_or_else(|| "no RDMA device".into()),
                            self.dev
                        )));
                    }
                    let qpn = self.qps[i].qpn();
                    let (p, len) = private(self.cookie, self.secret, i, n);
                    if !self.conns[i].connect(qpn, &p[..len])? {
                        // nothing was sent: the same QP over a new rdma_cm id (a new port)
                        self.restarts += 1;
                        if self.restarts > PORT_RETRIES {
                            return Err(Error::Remote {
                                peer: self.peer.clone(),
                                what: format!("rdma_connect: the local port was taken {PORT_RETRIES} times in a row (EADDRINUSE)"),
                            });
                        }
                        tracing::warn!(
                            "{}: rdma_cm connection {i} to {}: the local TCP port rdma_cm picked is taken (EADDRINUSE); starting it over on a new port",
                            self.dev,
                            self.peer
                        );
                        self.conns[i] = CmConn::start(self.src, self.dst, &self.label)?;
                    }
                }
                Progress::Established(_) => self.est[i] = true,
            }
        }
        if self.est.iter().all(|&e| e) {
            let qps = std::mem::take(&mut self.qps).into_iter().map(Qp::connected_by_cm).collect();
            return Ok(Some((qps, std::mem::take(&mut self.conns))));
        }
        cm_deadline(
            self.since,
            self.timeout_s,
            &self.est,
            &self.peer,
            "the receiver stopped accepting or its address is unreachable over iWARP",
        )?;
        Ok(None)
    }
}

/// The sender's notice side: a staging slot per (FIFO slot, QP) for notices
/// that do not go inline, and the rdma_cm connections (dropped after the QPs).
pub struct NoticeTx {
    stage: HostRegion,
    /// The delivery fence, where the receiver answers it and
    /// RUSTNET_IWARP_FENCE is on: its landing byte (every lane's read
    /// writes it), and what it reads, the receiver's sizes area (address,
    /// rkey).
    fence: Option<(HostRegion, (u64, u32))>,
    nqps: usize,
    max_inline: usize,
    conns: Vec<CmConn>,
    /// How to dial the receiver again (a recovery).
    dial: Dial,
    /// A recovery's connections to the receiver's new listener, in progress
    /// (they own the new QPs until every one is established).
    redial: Option<Box<CmConnect>>,
}

impl NoticeTx {
    /// For a connection of `nqps` QPs that take `max_inline` bytes inline.
    /// `fence`: with the delivery fence, where it lands (local write, a few
    /// bytes) and what it reads (the receiver's sizes area: its metadata's
    /// address and rkey), one byte of it.
    pub fn new(
        pd: &Pd,
        nqps: usize,
        max_inline: u32,
        conns: Vec<CmConn>,
        dial: Dial,
        fence: Option<(HostRegion, (u64, u32))>,
    ) -> Result<NoticeTx> {
        let stage = HostRegion::new(pd, FIFO_DEPTH * nqps * NOTICE_BYTES, Access::LOCAL_READ)?;
        Ok(NoticeTx { stage, fence, nqps, max_inline: max_inline as usize, conns, dial, redial: None })
    }

    /// Lane `seq`'s delivery fence, posted right after its notice in the
    /// same chain ([`super::verbs::Qp::post_writes_send_read`]): a one-byte
    /// RDMA READ of the receiver's sizes area, signaled with the lane's id
    /// ([`WrId::Data`]). On iWARP a SEND completes at the sender once it is
    /// handed to the transport (soft-iWARP: to TCP), before the receiver
    /// has it; the READ's response leaves the receiver only after every
    /// message before it on the connection was placed there, so the lane
    /// counts as landed (and NCCL's send as done) only when the receiver
    /// has its notice, as a write with immediate's completion means on IB.
    /// A connection lost before that leaves the lane to the recovery's
    /// resend instead of losing it. `None` without the fence (a receiver of
    /// an earlier build, or RUSTNET_IWARP_FENCE=0): the notice's own
    /// completion then ends the lane.
    pub fn fence(&self, seq: u64) -> Option<SendWr> {
        let (land, at) = self.fence.as_ref()?;
        Some(SendWr {
            wr_id: WrId::Data(seq).encode(),
            // (every lane's read lands on the same byte: nobody reads it)
            local: (land.addr() as u64, 1, land.lkey()),
            remote: *at,
            imm: None,
            signaled: true,
            inline: false,
        })
    }

    /// Disconnect and destroy the rdma_cm ids now. The send comm calls this
    /// in its Drop, before its QPs are destroyed: librdmacm's order is
    /// disconnect, destroy QP, destroy id (field order alone would destroy
    /// the QPs first, under a connection still up).
    pub fn close_cm(&mut self) {
        self.redial = None;
        self.conns.clear();
    }

    /// A recovery: is it connecting new QPs now?
    pub fn redialing(&self) -> bool {
        self.redial.is_some()
    }

    /// A recovery: start connecting the new `qps` (INIT) to the receiver's
    /// new listener at `dst` (from its State), as the first connect did.
    pub fn redial(&mut self, dev: &IbDev, cc: &ConnCfg, qps: Vec<Qp<Init>>, dst: SocketAddr) -> Result<()> {
        let cm = CmConnect::toward(dev, cc, qps, dst, self.dial.clone(), Instant::now())?;
        self.redial = Some(Box::new(cm));
        Ok(())
    }

    /// Move the recovery's connections on. `Some(qps)` (RTS) once all are
    /// established: the old connections are closed by then (before the
    /// caller drops the old QPs, librdmacm's order) and the new ones kept.
    /// An error drops the attempt (its QPs with it).
    pub fn redial_progress(&mut self) -> Result<Option<Vec<Qp<Rts>>>> {
        let Some(cm) = self.redial.as_mut() else { return Err(Error::Internal("rdma_cm reconnect without a dial in progress".into())) };
        match cm.progress() {
            Ok(None) => Ok(None),
            Ok(Some((qps, conns))) => {
                self.redial = None;
                self.conns = conns;
                Ok(Some(qps))
            }
            Err(e) => {
                self.redial = None;
                Err(e)
            }
        }
    }

    /// Has rdma_cm said that one of the connections closed (the peer's
    /// QP went to the error state, or its stream ended)? What it said.
    /// One non-blocking read of each connection's event channel.
    pub fn connection_lost(&mut self) -> Option<String> {
        if self.redial.is_some() {
            return None;
        }
        self.conns.iter_mut().find_map(|c| c.poll().err().map(|e| e.to_string()))
    }

    /// A recovery stopped again (or gave up): drop a dial in progress.
    pub fn abandon(&mut self) {
        self.redial = None;
    }

    /// Turn lane `lane`'s planned WRs (`plan`, built into `wrs[..plan.len()]`
    /// by the IB path) into its data writes without immediate, then the
    /// notice SEND: unsignaled with the delivery fence (which follows it,
    /// [`NoticeTx::fence`], completes after it and carries the lane's id),
    /// else signaled with the lane's id. Returns how many WRs to post, with
    /// [`super::verbs::Qp::post_writes_send_read`] or
    /// [`super::verbs::Qp::post_writes_send`].
    pub fn lane(
        &self,
        g: &Group,
        lane: usize,
        nlanes: usize,
        qi: usize,
        plan: &[PlannedWr],
        wrs: &mut [SendWr; MAX_LANE_WRS],
    ) -> Result<usize> {
        let word = plan.iter().find_map(|p| p.imm).ok_or_else(|| Error::Internal(format!("lane {lane} of #{} has no immediate", g.seq)))?;
        let imm = Imm::decode(word).map_err(|e| Error::Internal(format!("lane {lane} of #{}: {e}", g.seq)))?;
        let mut sizes = [0u32; MAX_RECVS];
        if let (0, ImmKind::Sizes(n)) = (lane, imm.kind) {
            let n = n as usize;
            sizes[..n].copy_from_slice(&g.wire_sizes()[..n]);
        }
        let notice = Notice { imm, lane: lane as u8, lanes: nlanes as u8, sizes };
        let mut k = 0;
        for (j, p) in plan.iter().enumerate() {
            // the sizes write and the empty write existed only for their immediate
            if matches!(p.kind, WrKind::Data { .. }) {
                wrs[k] = SendWr { imm: None, signaled: false, ..wrs[j] };
                k += 1;
            }
        }
        // Every data write is signaled, so siw sends it by its copy path.
        // siw sends an unsignaled write zero-copy: from NCCL's pages, read
        // when TCP transmits them, which can be after the notice behind it
        // completed and NCCL reused the buffer (seen as a grouped receive's
        // earlier buffers arriving with newer bytes on a loaded host); and
        // each FPDU's 4-byte CRC trailer then leaves as a TCP segment of its
        // own (twice the segments per byte, docs/iwarp.md). The completions
        // carry no news: the sender's poll skips them (WrId::DataDone), and
        // the CQ is sized for a completion per WR (handshake::Setup).
        for w in &mut wrs[..k] {
            w.signaled = true;
            w.wr_id = WrId::DataDone(g.seq).encode();
        }
        let (bytes, len) = notice.encode();
        let off = ((g.seq % FIFO_DEPTH as u64) as usize * self.nqps + qi) * NOTICE_BYTES;
        // rewritten only for seq + FIFO_DEPTH, after this slot's lanes completed
        self.stage.write(off, &bytes);
        let fenced = self.fence.is_some();
        wrs[k] = SendWr {
            wr_id: if fenced { WrId::DataDone(g.seq) } else { WrId::Data(g.seq) }.encode(),
            local: (self.stage.addr() as u64 + off as u64, len as u32, self.stage.lkey()),
            remote: (0, 0),
            imm: None,
            // (fenced: a failure still completes, with its error, and the
            // fence's completion frees the notice's send-queue slot)
            signaled: !fenced,
            inline: len <= self.max_inline,
        };
        Ok(k + 1)
    }
}

// ---------------------------------------------------------------- receiver

/// The receiver's iWARP side: its rdma_cm listener and connections, and the
/// notices' receive rings.
pub struct RecvSide {
    /// Open (fd, port, backlog) only until every connection is
    /// established: nothing polls it after, so it is dropped then.
    listener: Option<CmListener>,
    /// Its address, which our metadata carries.
    listen_addr: SocketAddr,
    cookie: u64,
    /// Random: in our metadata, required in every request (with a sender that echoes it).
    secret: u32,
    /// Whose requests we take.
    admit: Admit,
    qpns: Vec<u32>,
    conns: Vec<Option<CmConn>>,
    est: Vec<bool>,
    peer: String,
    /// When the cm phase began, and RUSTNET_CONNECT_TIMEOUT: a sender that
    /// never connects fails the comm instead of leaving it waiting forever.
    since: Instant,
    timeout_s: u32,
    /// All connections established and the receives posted.
    up: bool,
    /// Notice buffers: QP i's ring at `i * RECV_DEPTH * NOTICE_BYTES`.
    area: HostRegion,
    rings: Vec<RecvRing>,
    asm: Assembler,
    /// Lane 0's sizes per FIFO slot, once its receive has every notice.
    sizes: Box<[[u32; MAX_RECVS]; FIFO_DEPTH]>,
    /// When the last notice arrived ([`RecvSide::close_cm`]).
    last_notice: Option<Instant>,
}

/// How long a receive comm's close waits after its last notice before it
/// disconnects: the sender's delivery fence behind that notice is answered
/// by the iWARP device (soft-iWARP: a kernel thread) after the notice was
/// handed to us, and a disconnect drops an answer not yet sent, which
/// would leave the sender's last send waiting and then failing, though the
/// message had arrived. A real NIC answers within microseconds; soft-iWARP
/// in an emulated VM was seen to take longer than a test's close (one
/// conformance run in a full VM suite, stop 39). Only a comm whose last
/// notice is this recent waits, so closing thousands of idle comms costs
/// nothing.
const FENCE_LINGER: Duration = Duration::from_millis(20);

/// RUSTNET_CONNECT_TIMEOUT in seconds, at least 1.
fn cm_timeout_s(cc: &ConnCfg) -> u32 {
    cc.stream.connect_timeout_s.clamp(1, u32::MAX as i64) as u32
}

/// `Err` naming `peer` once `timeout_s` passed since `since` with not every
/// connection of `est` established; `hint` says what probably went wrong.
fn cm_deadline(since: Instant, timeout_s: u32, est: &[bool], peer: &str, hint: &str) -> Result<()> {
    if since.elapsed() < Duration::from_secs(timeout_s as u64) {
        return Ok(());
    }
    let k = est.iter().filter(|&&e| e).count();
    Err(Error::Remote {
        peer: peer.to_string(),
        what: format!("{k} of {} rdma_cm connections established within RUSTNET_CONNECT_TIMEOUT={timeout_s} s: {hint}", est.len()),
    })
}

impl RecvSide {
    /// Listen on `dev`'s address for the connections of QPs `qpns`; `cookie`
    /// is what our metadata's `addr` says (the sender echoes it).
    /// `cc`'s RUSTNET_CONNECT_TIMEOUT bounds the wait for the sender's
    /// connections, from now.
    /// `sender` is the sender's metadata: whether it echoes our secret and
    /// where its connections come from.
    pub fn new(dev: &IbDev, cc: &ConnCfg, pd: &Pd, qpns: Vec<u32>, cookie: u64, peer: &SocketAddr, sender: &Meta) -> Result<Box<RecvSide>> {
        let listener = CmListener::new(device_ip(dev)?)?;
        let n = qpns.len();
        // a secret, not an id: it must not be guessable by whoever can reach the listener
        let secret = u32::from_le_bytes(crate::random::secret_128()[..4].try_into().unwrap_or([1; 4]));
        let admit = Admit::new(sender, peer.ip(), secret);
        if admit.secret.is_none() {
            tracing::info!(
                "{}: peer {peer} is a build without the rdma_cm secret: its connections are checked by cookie only",
                dev.describe()
            );
        }
        Ok(Box::new(RecvSide {
            listen_addr: listener.addr(),
            listener: Some(listener),
            cookie,
            secret,
            admit,
            conns: (0..n).map(|_| None).collect(),
            est: vec![false; n],
            peer: peer.to_string(),
            since: Instant::now(),
            timeout_s: cm_timeout_s(cc),
            up: false,
            area: HostRegion::new(pd, n * RECV_DEPTH * NOTICE_BYTES, Access::LOCAL_WRITE)?,
            rings: (0..n).map(|_| RecvRing::new()).collect(),
            asm: Assembler::new(),
            sizes: Box::new([[0; MAX_RECVS]; FIFO_DEPTH]),
            qpns,
            last_notice: None,
        }))
    }

    /// Disconnect and destroy the rdma_cm ids (and the listener) now: the
    /// receive comm calls this in its Drop, before its QPs are destroyed
    /// (librdmacm's order: disconnect, destroy QP, destroy id).
    ///
    /// A notice that arrived less than [`FENCE_LINGER`] ago may still have
    /// the sender's delivery fence unanswered behind it: the close waits
    /// out the rest of that time first, with the connections up.
    pub fn close_cm(&mut self) {
        if let Some(t) = self.last_notice.take() {
            let left = FENCE_LINGER.saturating_sub(t.elapsed());
            if !left.is_zero() && self.conns.iter().any(Option::is_some) {
                std::thread::sleep(left);
            }
        }
        self.conns.clear();
        self.listener = None;
    }

    /// A recovery: the old connections closed (before their QPs go,
    /// librdmacm's order), a new listener on `dev`'s address for the QPs
    /// `qpns` (new, INIT), and their notice rings empty (the new QPs post
    /// every receive once connected, [`RecvSide::cm_ready`]). Messages whose
    /// notices are partly in stay as they are: the sender sends again only
    /// the lanes the restart point says are missing. Returns the listener's
    /// address, which the State tells the sender.
    pub fn restart(&mut self, dev: &IbDev, qpns: Vec<u32>) -> Result<SocketAddr> {
        self.conns.clear();
        self.listener = None;
        let listener = CmListener::new(device_ip(dev)?)?;
        let n = qpns.len();
        self.listen_addr = listener.addr();
        self.listener = Some(listener);
        self.conns = (0..n).map(|_| None).collect();
        self.est = vec![false; n];
        self.rings = (0..n).map(|_| RecvRing::new()).collect();
        self.qpns = qpns;
        self.since = Instant::now();
        self.up = false;
        Ok(self.listen_addr)
    }

    /// As [`NoticeTx::connection_lost`], once every connection is up.
    pub fn connection_lost(&mut self) -> Option<String> {
        if !self.up {
            return None;
        }
        self.conns.iter_mut().flatten().find_map(|c| c.poll().err().map(|e| e.to_string()))
    }

    /// Every connection established and the notice receives posted.
    pub fn is_up(&self) -> bool {
        self.up
    }

    /// Our metadata says where to connect: the listener's address.
    pub fn fill_meta(&self, m: &mut Meta) {
        let a = self.listen_addr;
        m.gid = gid_of(a.ip());
        m.lid = a.port();
        m.family = if a.is_ipv4() { 4 } else { 6 };
        m.link = LINK_IWARP;
        m.secret = self.secret;
        m.flags |= FLAG_CM_SECRET | FLAG_FENCE;
    }

    /// Accept the sender's requests and follow the connections; once all
    /// are established, post every QP's notice receives. True from then on.
    pub fn cm_ready(&mut self, qps: &[Qp<Rts>]) -> Result<bool> {
        if self.up {
            return Ok(true);
        }
        let n = self.qpns.len();
        let Some(listener) = &self.listener else {
            return Err(Error::Usage("rdma_cm listener closed before the connections were up".into()));
        };
        while let Some(req) = listener.poll()? {
            match self.admit.check(&req.private, req.src, self.cookie, n) {
                Ok(i) if self.conns[i].is_none() => {
                    self.conns[i] = Some(req.accept(self.qpns[i], &[], &self.peer)?);
                }
                Ok(i) => {
                    tracing::warn!(
                        "rdma_cm listener {} (comm from {}): refused a second request for QP {i} from {}",
                        self.listen_addr,
                        self.peer,
                        req.src.map_or("?".into(), |a| a.to_string())
                    );
                    req.reject();
                }
                Err(why) => {
                    tracing::warn!(
                        "rdma_cm listener {} (comm from {}): refused a connection request {why} (source {})",
                        self.listen_addr,
                        self.peer,
                        req.src.map_or("unknown".into(), |a| a.to_string())
                    );
                    req.reject();
                }
            }
        }
        for (c, e) in self.conns.iter_mut().zip(self.est.iter_mut()) {
            if let (Some(c), false) = (c, *e) {
                if let Progress::Established(_) = c.poll()? {
                    *e = true;
                }
            }
        }
        if !self.est.iter().all(|&e| e) {
            let hint = "the sender stopped connecting or cannot reach our address over iWARP";
            cm_deadline(self.since, self.timeout_s, &self.est, &self.peer, hint)?;
            return Ok(false);
        }
        for (i, q) in qps.iter().enumerate() {
            self.repost(i, q)?;
        }
        // every QP is connected: the listener has nothing more to hand out
        self.listener = None;
        self.up = true;
        Ok(true)
    }

    fn repost(&mut self, qi: usize, qp: &Qp<Rts>) -> Result<()> {
        let ring = &mut self.rings[qi];
        let ids = ring.to_post();
        let base = self.area.addr() as u64 + (qi * RECV_DEPTH * NOTICE_BYTES) as u64;
        for id in ids.clone() {
            let local = (base + RecvRing::slot(id) as u64, NOTICE_BYTES as u32, self.area.lkey());
            // SAFETY: the slot lies in `area`, registered with local write on
            // the QP's PD; `area` lives in this RecvSide, which the receive
            // comm drops after its QPs (field order), and a slot is reposted
            // only after its previous receive completed and was read.
            unsafe { qp.post_recv(WrId::Recv(id).encode(), local)? };
        }
        ring.posted(ids.end);
        Ok(())
    }

    /// May receive `seq`'s CTS go out, `in_flight` receives (it included)
    /// then able to bring notices on lanes `first..first + nlanes`?
    pub fn may_advertise(&self, first: usize, nlanes: usize, in_flight: usize) -> bool {
        let n = self.rings.len();
        (first..first + nlanes).all(|q| self.rings[q % n].may_advertise(in_flight))
    }

    /// Receive `seq` (posted now) will get `nlanes` notices.
    pub fn expect(&mut self, seq: u64, nlanes: usize, peer: impl Fn() -> String) -> Result<()> {
        self.asm.expect(seq, nlanes).map_err(|e| proto(peer(), e))
    }

    /// A receive completed on QP `qi`: read, repost and decode its notice.
    /// Returns the word an immediate would have carried.
    pub fn on_recv(&mut self, wc: &ibv_wc, qi: usize, qp: &Qp<Rts>, peer: impl Fn() -> String) -> Result<u32> {
        if wc.opcode != IBV_WC_RECV {
            return Err(Error::Protocol {
                peer: peer(),
                what: format!("unexpected completion (opcode {}, wr_id {:#x}) on an iWARP receive QP", wc.opcode, wc.wr_id),
            });
        }
        let Some(WrId::Recv(id)) = WrId::decode(wc.wr_id) else {
            return Err(Error::Internal(format!("notice receive with wr_id {:#x}", wc.wr_id)));
        };
        let off = self.rings[qi].take(id).map_err(|e| proto(peer(), e))?;
        let len = wc.byte_len as usize;
        if len > NOTICE_BYTES {
            return Err(Error::Protocol { peer: peer(), what: format!("a {len}-byte notice (at most {NOTICE_BYTES})") });
        }
        let mut b = [0u8; NOTICE_BYTES];
        self.area.read(qi * RECV_DEPTH * NOTICE_BYTES + off, &mut b);
        self.repost(qi, qp)?;
        let n = Notice::decode(&b[..len]).map_err(|e| proto(peer(), e))?;
        self.last_notice = Some(Instant::now());
        if let Some(first) = self.asm.on_notice(n).map_err(|e| proto(peer(), e))? {
            self.sizes[first.imm.slot as usize] = first.sizes;
        }
        Ok(n.imm.encode())
    }

    /// The sizes lane 0 carried for the receive in FIFO slot `slot`.
    pub fn sizes(&self, slot: usize) -> [u32; MAX_RECVS] {
        self.sizes[slot]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cm_phase_fails_after_the_connect_timeout_naming_the_peer() {
        let est = [true, false];
        let now = Instant::now();
        assert!(cm_deadline(now, 5, &est, "10.0.0.2:7 (rxe0)", "hint").is_ok(), "within the timeout");
        let Some(long_ago) = now.checked_sub(Duration::from_secs(6)) else {
            eprintln!("SKIP: this host's monotonic clock started less than 6 s ago");
            return;
        };
        let e = cm_deadline(long_ago, 5, &est, "10.0.0.2:7 (rxe0)", "the sender stopped connecting").unwrap_err().to_string();
        assert!(e.contains("10.0.0.2:7 (rxe0)"), "{e}");
        assert!(e.contains("1 of 2 rdma_cm connections") && e.contains("RUSTNET_CONNECT_TIMEOUT=5 s"), "{e}");
        assert!(e.contains("the sender stopped connecting"), "{e}");
        assert!(cm_deadline(long_ago, 5, &[true, true], "p", "h").is_err(), "the caller checks completion first");
    }

    #[test]
    fn private_data_names_comm_and_qp() {
        let (p, len) = private(0xfeed, None, 2, 4);
        assert_eq!(len, PRIVATE_LEN, "without a secret: what builds before it sent");
        let p = &p[..len];
        assert_eq!(parse_private(p, 0xfeed, None, 4), Ok(2));
        assert!(parse_private(p, 0xbeef, None, 4).is_err(), "another comm's request");
        assert!(parse_private(p, 0xfeed, None, 2).is_err(), "QP count differs");
        assert!(parse_private(&p[..8], 0xfeed, None, 4).is_err(), "short");
        assert!(parse_private(b"hello", 0xfeed, None, 4).is_err());
        // with the receiver's secret
        let (s, len) = private(0xfeed, Some(0x5ec2_e7a1), 3, 4);
        assert_eq!(parse_private(&s[..len], 0xfeed, Some(0x5ec2_e7a1), 4), Ok(3));
        assert_eq!(parse_private(&s[..len], 0xfeed, Some(0x5ec2_e7a0), 4), Err("without this comm's secret"));
        assert_eq!(parse_private(p, 0xfeed, Some(0x5ec2_e7a1), 4), Err("without this comm's secret"), "an old-style request");
        // a receiver of an older build reads the first 16 bytes and ignores the rest
        assert_eq!(parse_private(&s[..len], 0xfeed, None, 4), Ok(3));
    }

    fn sender_meta(flags: u8, gid_ip: &str) -> Meta {
        let ip: IpAddr = gid_ip.parse().unwrap();
        let gid = match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        Meta {
            qpns: vec![1, 2],
            mtu: 3,
            link: LINK_IWARP,
            port: 1,
            gid_index: 0,
            lid: 0,
            tc: 0,
            sl: 0,
            split: false,
            gid,
            family: 4,
            roce_version: 0,
            addr: 0xfeed,
            rkey: 0,
            name: "siw0".into(),
            eager: 0,
            ring: (0, 0),
            flags,
            secret: 0,
        }
    }

    #[test]
    fn a_stranger_is_refused_by_address_and_secret() {
        let oob: IpAddr = "10.0.0.1".parse().unwrap();
        let a = Admit::new(&sender_meta(FLAG_CM_SECRET, "10.198.0.1"), oob, 0xabcd_0123);
        let (good, len) = private(0xfeed, Some(0xabcd_0123), 1, 2);
        let good = &good[..len];
        let at = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        assert_eq!(a.check(good, at("10.198.0.1"), 0xfeed, 2), Ok(1), "from the address the sender named");
        assert_eq!(a.check(good, at("10.0.0.1"), 0xfeed, 2), Ok(1), "from the out-of-band peer's address");
        assert_eq!(a.check(good, at("::ffff:10.0.0.1"), 0xfeed, 2), Ok(1), "the same address, IPv4-mapped");
        let e = a.check(good, at("10.198.0.9"), 0xfeed, 2).unwrap_err();
        assert!(e.contains("from 10.198.0.9, not the peer (10.198.0.1 or 10.0.0.1)"), "{e}");
        assert!(a.check(good, None, 0xfeed, 2).is_err(), "no source address");
        // the right address, the cookie an attacker could guess, no secret
        let (old, len) = private(0xfeed, None, 1, 2);
        assert_eq!(a.check(&old[..len], at("10.198.0.1"), 0xfeed, 2), Err("without this comm's secret".into()));
        // an older sender: cookie only, from anywhere (what those builds checked)
        let legacy = Admit::new(&sender_meta(0, "10.198.0.1"), oob, 0xabcd_0123);
        assert_eq!(legacy.check(&old[..len], at("192.0.2.7"), 0xfeed, 2), Ok(1));
    }

    #[test]
    fn listener_address_round_trips_through_meta() {
        for a in ["10.198.0.2:4791", "[2001:db8::7]:18515"] {
            let a: SocketAddr = a.parse().unwrap();
            let mut m = Meta {
                qpns: vec![1],
                mtu: 3,
                link: LINK_IWARP,
                port: 1,
                gid_index: 0,
                lid: a.port(),
                tc: 0,
                sl: 0,
                split: false,
                gid: [0; 16],
                family: 0,
                roce_version: 0,
                addr: 0,
                rkey: 0,
                name: "siw1".into(),
                eager: 0,
                ring: (0, 0),
                flags: 0,
                secret: 0,
            };
            m.gid = match a.ip() {
                IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
                IpAddr::V6(v6) => v6.octets(),
            };
            let back = Meta::decode(&m.encode()).unwrap();
            assert_eq!(listener_addr(&back), a);
        }
    }
}
