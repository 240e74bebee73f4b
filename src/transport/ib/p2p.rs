//! The verbs data path (NCCL's net_ib p2p.cc): receiver-driven RDMA writes.
//! The protocol is sans-IO in the core: [`crate::proto::rx::Receiver`] and
//! [`crate::proto::tx::Sender`] own the requests, FIFO slots, CTS batching,
//! eager ring and mailbox timer (wire rules in [`crate::proto::fifo`] and
//! [`crate::proto::eager`]); this file reads registered memory and the CQ,
//! feeds them, and builds and posts the WRs they plan. Progress happens in
//! the caller of isend/irecv/test; no allocation after a comm is built, and nothing is
//! shared with other comms on the data path except one relaxed atomic load
//! of the device's async-event counters.
//!
//! Failures: a completion error, an async event on our port or device, or
//! the out-of-band socket closing (the peer process died or closed its
//! comm) fails the comm: every pending and later request returns the error,
//! which names the work-completion status, our QP and the peer.
use std::net::SocketAddr;
use std::sync::Arc;

use super::device::IbDev;
use super::ffi::{self, ibv_wc};
use super::handshake::{self, ConnCfg, LocalAddr, Setup, RECV_SQ_DEPTH};
use super::notice_path::{CmConnect, NoticeTx, RecvSide, DATA_DONE_FLAG};
use super::reg::IbMr;
use super::verbs::{self, Access, Cq, HostRegion, Init, Qp, Rts, SendWr};
use crate::error::{Errno, Error, Result};
use crate::profiler::{
    EventSlots, Fields, Parent, MAX_EVENTS_PER_PARENT, OP_RDMA_WRITE, OP_RDMA_WRITE_WITH_IMM, OP_RECV, OP_RECV_RDMA_WITH_IMM, OP_SEND,
};
use crate::proto::eager;
use crate::proto::fifo::{self, Cts, FailCode, Group, ImmKind, PlannedWr, WrKind, FIFO_DEPTH, MAX_LANE_WRS, SIZES_SLOT_BYTES};
use crate::proto::ib_meta::{Meta, META_LEN, READY};
use crate::proto::mem::{Mem, MemMut};
use crate::proto::pool::ReqId;
use crate::proto::{rx, tx, ProtoError};
use crate::transport::sock::{Io, Socket};
use crate::transport::{Completion, RawBuf, RecvBuf, MAX_P2P_BYTES, MAX_RECVS};

/// Completions polled per `ibv_poll_cq` call.
const POLL_BATCH: usize = 16;
/// Look at the clock every this many calls that made no progress...
const LIVENESS_EVERY: u32 = 64;
/// ...and ask the out-of-band socket about the peer at most this often (a
/// system call per few idle polls cost ~30% of rxe's bandwidth at 1 MiB
/// under emulation, where the kernel side of the NIC shares the CPUs).
const LIVENESS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);
/// wr_id bit of the receiver's CTS writes.
const CTS_FLAG: u64 = 1 << 63;
/// wr_id bit of flush reads (low 16 bits: the request id).
const FLUSH_FLAG: u64 = 1 << 62;
/// wr_id bit of the sender's eager and mailbox writes.
const EAGER_FLAG: u64 = 1 << 61;
/// wr_id of the receiver's (generic) receive WRs.
const RECV_WR: u64 = 1 << 60;
/// Receive WRs kept posted on each receiver QP (at most FIFO_DEPTH
/// immediates are outstanding per QP).
const RECV_WRS: usize = FIFO_DEPTH + 16;

// ---------------------------------------------------------------- per-QP counters

static STATS_DUMP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// RUSTNET_STATS=1: every comm prints one INFO line with its per-QP
/// counters when it closes (they are always logged at TRACE).
pub fn set_stats_dump(on: bool) {
    STATS_DUMP.store(on, std::sync::atomic::Ordering::Relaxed);
}

// What one QP of a comm carried: a snapshot of the comm's QpTable, whose
// relaxed counters the data path bumps and the statistics file reads.
pub use crate::stats::QpStat;
use crate::stats::QpTable;

/// `qp 0x11: 3 msgs, 4096 bytes; qp 0x12: ...`
pub fn format_stats(stats: &[QpStat]) -> String {
    let v: Vec<String> = stats.iter().map(|q| format!("qp {:#x}: {} msgs, {} bytes", q.qpn, q.msgs, q.bytes)).collect();
    v.join("; ")
}

// ---------------------------------------------------------------- shared by both ends

/// What both comm kinds share: the QPs, the CQ, the peer, the failure state.
pub(super) struct Link {
    // Declared first: QPs are destroyed before anything they point into.
    qps: Vec<Qp<Rts>>,
    cq: Cq,
    dev: Arc<IbDev>,
    cc: Arc<ConnCfg>,
    oob: Socket,
    peer: SocketAddr,
    peer_qpns: Vec<u32>,
    peer_dev: String,
    peer_gid: [u8; 16],
    failed: Option<Error>,
    health: (u32, u32),
    idle: u32,
    last_check: std::time::Instant,
    max_inline: u32,
    /// Per-QP counters, index = QP index in `qps` (shared with the statistics file).
    stats: Arc<QpTable>,
    /// Eager messages and their payload bytes (they ride QP 0).
    eager_stats: (u64, u64),
    /// Control writes posted: CTS (batches), credits, mailbox.
    ctl_posts: u64,
    /// The out-of-band socket still carries the connection handshake (the
    /// receiver's metadata, READY): liveness probes must not read it.
    handshake: bool,
    /// Open profiler events by request slot (None: profiling off when the
    /// comm was built). Declared after the QPs: dropped (stopped) last.
    ev: Option<EventSlots>,
}

fn is_remote_status(s: u32) -> bool {
    use ffi::*;
    matches!(
        s,
        IBV_WC_BAD_RESP_ERR
            | IBV_WC_REM_INV_REQ_ERR
            | IBV_WC_REM_ACCESS_ERR
            | IBV_WC_REM_OP_ERR
            | IBV_WC_RETRY_EXC_ERR
            | IBV_WC_RNR_RETRY_EXC_ERR
            | IBV_WC_REM_INV_RD_REQ_ERR
            | IBV_WC_REM_ABORT_ERR
            | IBV_WC_RESP_TIMEOUT_ERR
    )
}

impl Link {
    fn new(setup_dev: &Arc<IbDev>, cq: Cq, cc: Arc<ConnCfg>, oob: Socket, peer: SocketAddr) -> Link {
        Link {
            qps: Vec::new(),
            cq,
            dev: setup_dev.clone(),
            health: setup_dev.health.snapshot(setup_dev.port),
            cc,
            oob,
            peer,
            peer_qpns: Vec::new(),
            peer_dev: String::new(),
            peer_gid: [0; 16],
            failed: None,
            idle: 0,
            last_check: std::time::Instant::now(),
            max_inline: 0,
            stats: Arc::new(QpTable::default()),
            eager_stats: (0, 0),
            ctl_posts: 0,
            handshake: true,
            ev: None,
        }
    }

    /// Index of our QP `qpn`.
    fn qp_index(&self, qpn: u32) -> Option<usize> {
        self.qps.iter().position(|q| q.qpn() == qpn)
    }

    /// The failure ends every open event: nothing more moves.
    fn stop_events(&mut self) {
        if let Some(ev) = &mut self.ev {
            ev.stop_all();
        }
    }

    /// Fix the counters once the QPs are known.
    fn init_stats(&mut self) {
        self.stats.set(self.qps.iter().map(|q| q.qpn()));
    }

    /// Log the counters at close: TRACE always, INFO with RUSTNET_STATS=1.
    fn log_stats(&self, kind: &str) {
        let dump = STATS_DUMP.load(std::sync::atomic::Ordering::Relaxed);
        if !dump && !crate::log::trace_enabled() && !tracing::enabled!(tracing::Level::TRACE) {
            return;
        }
        let line = format!(
            "{}: {kind} comm to {}: {}; eager: {} msgs, {} bytes; control writes: {}",
            self.dev.name,
            self.peer_name(),
            format_stats(&self.stats.snapshot()),
            self.eager_stats.0,
            self.eager_stats.1,
            self.ctl_posts
        );
        if dump {
            tracing::info!("stats: {line}");
        } else {
            tracing::trace!("{line}");
        }
    }

    fn set_peer(&mut self, m: &Meta) {
        self.peer_qpns = m.qpns.clone();
        self.peer_dev = m.name.clone();
        self.peer_gid = m.gid;
    }

    fn peer_name(&self) -> String {
        if self.peer_dev.is_empty() {
            self.peer.to_string()
        } else {
            format!("{} ({} GID {})", self.peer, self.peer_dev, super::gid::show(&self.peer_gid))
        }
    }

    fn fail(&mut self, e: Error) {
        if self.failed.is_none() {
            tracing::warn!("{}: comm failed: {e}", self.dev.name);
            self.failed = Some(e);
            self.stop_events();
            // Stop the QPs so nothing more lands in our memory.
            for q in &self.qps {
                let _ = q.set_error();
            }
        }
    }

    /// Fail the link and return the error it now reports (the first one).
    fn fail_with(&mut self, e: Error) -> Error {
        self.fail(e.clone());
        self.failed.clone().unwrap_or(e)
    }

    /// Record a failure but leave the QPs running, so a "fail" immediate
    /// just posted still reaches the peer and tells it why (a send comm's
    /// QPs only let the peer write into our FIFO, which lives until drop).
    fn fail_soft(&mut self, e: Error) {
        if self.failed.is_none() {
            tracing::warn!("{}: comm failed: {e}", self.dev.name);
            self.failed = Some(e);
            self.stop_events();
        }
    }

    /// Fail now if an earlier failure or an async event says so.
    fn check(&mut self) -> Result<()> {
        if self.failed.is_none() {
            if let Some(why) = self.dev.health.changed_since(self.dev.port, self.health) {
                let e = Error::Remote { peer: self.peer_name(), what: format!("{}: {why}", self.dev.describe()) };
                self.fail(e);
            }
        }
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn wc_error(&self, wc: &ibv_wc, what: String) -> Error {
        let lib = verbs::Lib::get().ok();
        let status = lib.map_or_else(|| format!("status {}", wc.status), |l| l.wc_status_str(wc.status));
        let qi = self.qps.iter().position(|q| q.qpn() == wc.qp_num);
        let rq = qi.and_then(|i| self.peer_qpns.get(i)).map_or_else(|| "?".into(), |q| format!("{q:#x}"));
        let hint = match wc.status {
            ffi::IBV_WC_RETRY_EXC_ERR => format!(
                " (no acknowledgement within NCCL_IB_TIMEOUT={} x NCCL_IB_RETRY_CNT={}: the peer died or is unreachable)",
                self.cc.timeout, self.cc.retry_cnt
            ),
            ffi::IBV_WC_WR_FLUSH_ERR if self.cc.notices && self.failed.is_none() => {
                " (the iWARP connection was closed: the peer process exited or closed its comm)".into()
            }
            ffi::IBV_WC_WR_FLUSH_ERR => " (the QP had already failed)".into(),
            ffi::IBV_WC_REM_ACCESS_ERR => " (the peer refused the write: buffer deregistered or comm closed)".into(),
            _ => String::new(),
        };
        let msg = format!(
            "work completion error {status} (status {}, vendor_err {:#x}) on {} QP {:#x} -> peer QP {rq}, {what}{hint}",
            wc.status,
            wc.vendor_err,
            self.dev.describe(),
            wc.qp_num
        );
        // iWARP: the peer's TCP stream going away flushes our queues (no
        // retry-exceeded status as on IB); a flush that is the first error
        // means the connection ended there
        let flushed_by_peer = self.cc.notices && wc.status == ffi::IBV_WC_WR_FLUSH_ERR && self.failed.is_none();
        if is_remote_status(wc.status) || flushed_by_peer {
            Error::Remote { peer: self.peer_name(), what: msg }
        } else {
            Error::sys(format!("peer {}: {msg}", self.peer_name()), Errno(libc::EIO))
        }
    }

    /// Called when a call made no progress: every so often, ask the
    /// out-of-band socket whether the peer is still there.
    fn idle_tick(&mut self, pending: usize) {
        self.idle = self.idle.wrapping_add(1);
        // During the handshake its own reads see a peer that went away; a
        // probe here could swallow the bytes it waits for (the comm would
        // then wait for them forever, silently).
        if self.idle % LIVENESS_EVERY != 0 || self.failed.is_some() || self.handshake {
            return;
        }
        let now = std::time::Instant::now();
        if now.duration_since(self.last_check) < LIVENESS_INTERVAL {
            return;
        }
        self.last_check = now;
        let mut b = [0u8; 16];
        match self.oob.read(&mut b) {
            Ok(Io::Again) => {}
            Ok(Io::Done(n)) => {
                // nothing follows READY on this socket in our protocol
                let what = format!("sent {n} unexpected byte(s) on the out-of-band connection after the handshake: {:02x?}", &b[..n]);
                self.fail(Error::Protocol { peer: self.peer_name(), what });
            }
            Ok(Io::Eof) => {
                let what = format!("closed its connection (process exited or closed its comm) with {pending} request(s) of ours pending");
                self.fail(Error::Remote { peer: self.peer_name(), what });
            }
            Err(e) => {
                let what = format!("out-of-band connection failed: {e}");
                self.fail(Error::Remote { peer: self.peer_name(), what });
            }
        }
    }

    fn progressed(&mut self) {
        self.idle = 0;
    }
}

fn check_buf(what: &str, buf: RawBuf, mr: Option<&IbMr>, dev: &IbDev, access: Access) -> Result<u32> {
    if buf.len > MAX_P2P_BYTES {
        return Err(Error::Usage(format!("{what} of {} bytes exceeds maxP2pBytes ({MAX_P2P_BYTES})", buf.len)));
    }
    if buf.len == 0 {
        return Ok(mr.map_or(0, |m| m.lkey()));
    }
    let Some(m) = mr else {
        return Err(Error::Usage(format!("{what} of {} bytes at {:p} without a memory handle (regMr first)", buf.len, buf.ptr)));
    };
    if m.dev != dev.index {
        return Err(Error::Usage(format!(
            "{what}: memory handle registered on device {} used on device {} ({})",
            m.dev, dev.index, dev.name
        )));
    }
    if !m.covers(buf.ptr, buf.len) {
        return Err(Error::Usage(format!("{what}: {:p}+{} is outside its memory handle {m:?}", buf.ptr, buf.len)));
    }
    if !m.access().covers(access) {
        return Err(Error::Usage(format!(
            "{what}: memory handle {m:?} lacks the access this operation needs (registered for the other direction?)"
        )));
    }
    Ok(m.lkey())
}

// ---------------------------------------------------------------- send side

enum SendHs {
    /// Waiting for the receiver's metadata (its acceptance) since `since`.
    ReadMeta {
        qps: Vec<Qp<Init>>,
        rx: Box<[u8; META_LEN]>,
        got: usize,
        since: std::time::Instant,
    },
    /// iWARP: the rdma_cm connections of our QPs ([`super::notice_path`]).
    Cm {
        cm: Box<CmConnect>,
        remote: Box<Meta>,
    },
    WriteReady {
        sent: usize,
    },
}

/// Sends still possible per comm (see [`tx::SEND_SLOTS`]).
pub const SEND_SLOTS: usize = tx::SEND_SLOTS;

/// The sending end of a verbs connection.
pub struct SendComm {
    link: Link,
    hs: Option<SendHs>,
    /// The CTS FIFO the receiver writes.
    fifo_mem: HostRegion,
    /// Sizes staging (for a grouped receive when not inline).
    stage: HostRegion,
    local: LocalAddr,
    tc: u8,
    sl: u8,
    /// The protocol: requests, FIFO head, writes in flight, eager ring, mailbox timer.
    tx: tx::Sender,
    remote_sizes: (u64, u32),
    /// The eager limit we offer (0 = off).
    eager_offer: u32,
    /// The eager path, when both ends agreed on it.
    eager: Option<EagerSend>,
    /// iWARP: lanes end with notice SENDs (after `link`: dropped after the QPs).
    notices: Option<NoticeTx>,
}

/// The sender's half of the eager path (its bookkeeping is in the machine, [`tx::Sender`]).
struct EagerSend {
    /// Staging with the ring's layout: the mailbox word's source, then the slots.
    stage: HostRegion,
    /// The receiver's ring (address, rkey).
    ring: (u64, u32),
}

/// How many bytes a data or eager write may carry inline: the QPs' cap,
/// but only with NCCL_IB_USE_INLINE=1. On iWARP the QPs take 64 bytes
/// inline whatever the knob says, for the notices alone (NoticeTx reads the
/// QPs' own cap); NCCL_IB_USE_INLINE=0 still keeps data off the inline path.
fn data_inline(use_inline: bool, qp_max_inline: u32) -> u32 {
    if use_inline {
        qp_max_inline
    } else {
        0
    }
}

/// The `ibv_wr_opcode` a profiler event of a send reports: a WR that ends
/// a lane (it carries the immediate) is, on iWARP (`notices`), a plain
/// write followed by the notice SEND whose completion the event waits for.
fn send_opcode(notices: bool, ends_lane: bool) -> i32 {
    match (ends_lane, notices) {
        (false, _) => OP_RDMA_WRITE,
        (true, false) => OP_RDMA_WRITE_WITH_IMM,
        (true, true) => OP_SEND,
    }
}

/// The `ibv_wc_opcode` a receive's profiler event waits for: the notice's
/// plain receive on iWARP, the write-with-immediate's otherwise.
fn recv_opcode(notices: bool) -> i32 {
    if notices {
        OP_RECV
    } else {
        OP_RECV_RDMA_WITH_IMM
    }
}

impl SendComm {
    pub(super) fn new(setup: Setup, oob: Socket, peer: SocketAddr, cc: Arc<ConnCfg>, tc: u8, sl: u8) -> SendComm {
        let Setup { dev, cq, qps, local, region, stage, eager: eager_offer } = setup;
        let mut link = Link::new(&dev, cq, cc, oob, peer);
        link.max_inline = data_inline(link.cc.use_inline, qps.iter().map(|q| q.max_inline()).min().unwrap_or(0));
        SendComm {
            link,
            hs: Some(SendHs::ReadMeta { qps, rx: Box::new([0; META_LEN]), got: 0, since: std::time::Instant::now() }),
            fifo_mem: region,
            stage,
            local,
            tc,
            sl,
            tx: tx::Sender::new(),
            remote_sizes: (0, 0),
            eager_offer,
            eager: None,
            notices: None,
        }
    }

    /// Peer's out-of-band address.
    pub fn peer(&self) -> SocketAddr {
        self.link.peer
    }

    /// Device index.
    pub fn dev(&self) -> usize {
        self.link.dev.index
    }

    /// Our QP numbers (empty until the handshake finished).
    pub fn qpns(&self) -> Vec<u32> {
        self.link.qps.iter().map(|q| q.qpn()).collect()
    }

    /// Per-QP counters now (empty until the handshake finished).
    pub fn qp_stats(&self) -> Vec<QpStat> {
        self.link.stats.snapshot()
    }

    /// The live per-QP counters (for the statistics file).
    pub fn qp_table(&self) -> Arc<QpTable> {
        self.link.stats.clone()
    }

    /// Eager messages sent and their payload bytes.
    pub fn eager_stats(&self) -> (u64, u64) {
        self.tx.eager_stats()
    }

    /// True once the QPs are in RTS and READY was sent.
    pub fn is_ready(&self) -> bool {
        self.hs.is_none()
    }

    fn progress_handshake(&mut self) -> Result<()> {
        loop {
            match &mut self.hs {
                None => return Ok(()),
                Some(SendHs::ReadMeta { rx, got, since, .. }) => {
                    if !handshake::read_some(&self.link.oob, &mut rx[..], got, &self.link.peer, "the receiver's connection metadata")? {
                        return handshake::within_connect_timeout(*since, &self.link.cc, &self.link.peer);
                    }
                    let remote = Meta::decode(rx).map_err(|w| Error::Protocol { peer: self.link.peer.to_string(), what: w.to_string() })?;
                    let Some(SendHs::ReadMeta { qps, since, .. }) = self.hs.take() else { unreachable!() };
                    if self.link.cc.notices {
                        let cm = CmConnect::start(&self.link.dev, &self.link.cc, qps, &remote, &self.link.peer, since)?;
                        self.hs = Some(SendHs::Cm { cm: Box::new(cm), remote: Box::new(remote) });
                        continue;
                    }
                    let qps = handshake::connect_qps(&self.link.dev, &self.local, qps, &remote, self.tc, self.sl, &self.link.cc)?;
                    self.connected(qps, &remote)?;
                }
                Some(SendHs::Cm { cm, .. }) => {
                    let Some((qps, conns)) = cm.progress()? else { return Ok(()) };
                    let Some(SendHs::Cm { remote, .. }) = self.hs.take() else { unreachable!() };
                    let max_inline = qps.iter().map(|q| q.max_inline()).min().unwrap_or(0);
                    self.notices = Some(NoticeTx::new(&self.link.dev.pd, qps.len(), max_inline, conns)?);
                    self.connected(qps, &remote)?;
                }
                Some(SendHs::WriteReady { sent }) => {
                    if !handshake::write_some(&self.link.oob, &READY, sent, &self.link.peer, "READY")? {
                        return Ok(());
                    }
                    self.hs = None;
                    self.link.handshake = false;
                    tracing::debug!(
                        "{}: send comm to {} ready, QPs {:x?} -> {:x?}",
                        self.link.dev.name,
                        self.link.peer_name(),
                        self.qpns(),
                        self.link.peer_qpns
                    );
                    return Ok(());
                }
            }
        }
    }

    /// Our QPs are connected (by hand, or by rdma_cm on iWARP): the comm
    /// takes them and the receiver's parameters; READY goes out next.
    fn connected(&mut self, qps: Vec<Qp<Rts>>, remote: &Meta) -> Result<()> {
        self.link.qps = qps;
        self.link.init_stats();
        self.link.ev = EventSlots::new(SEND_SLOTS, self.link.qps.len());
        self.link.set_peer(remote);
        self.remote_sizes = (remote.addr, remote.rkey);
        let mut limit = 0;
        if remote.eager > 0 && remote.eager <= self.eager_offer && remote.ring.0 != 0 {
            limit = remote.eager as usize;
            self.eager = Some(EagerSend {
                stage: HostRegion::new(&self.link.dev.pd, eager::ring_bytes(limit), Access::LOCAL_READ)?,
                ring: remote.ring,
            });
        } else if remote.eager > 0 {
            return Err(Error::Protocol {
                peer: self.link.peer_name(),
                what: format!("receiver agreed to an eager limit of {} bytes; we offered {}", remote.eager, self.eager_offer),
            });
        }
        self.tx.connected(tx::Config {
            nqps: self.link.qps.len(),
            split: self.link.cc.split,
            eager: limit,
            mailbox_after: tx::MAILBOX_AFTER,
        });
        self.hs = Some(SendHs::WriteReady { sent: 0 });
        Ok(())
    }

    /// The capacity of the receive buffer a send of `tag` would fill next,
    /// once the receiver advertised it and an isend of that tag would be
    /// taken now (`Ok(None)`: not yet). A merged device (vdev.rs) cuts each
    /// message over its members by these, and posts only when every member
    /// answered.
    pub fn peek_cap(&mut self, tag: i32) -> Result<Option<usize>> {
        self.link.check()?;
        if !self.tx.has_room() || !self.head_ready()? {
            return Ok(None);
        }
        // a tag the head receive has no free buffer for: not yet, as in isend
        Ok(self.tx.peek_cap(tag))
    }

    /// Bring the head FIFO slot to where a send can match it: the connection
    /// handshake finished, the slot's previous lap completed, and the
    /// receiver's CTS for it arrived. `Ok(false)`: not yet (NCCL retries).
    fn head_ready(&mut self) -> Result<bool> {
        if self.hs.is_some() {
            if let Err(e) = self.progress_handshake() {
                return Err(self.link.fail_with(e));
            }
            if self.hs.is_some() {
                self.link.idle_tick(self.tx.live());
                return Ok(false);
            }
        }
        loop {
            match self.tx.head(&self.fifo_mem) {
                // The head slot's previous lap (seq - FIFO_DEPTH) may still await its
                // completion (the receiver saw the data before our ACK came back).
                Ok(tx::Head::Busy) => {
                    self.poll();
                    if self.tx.head_busy() {
                        // a dead receiver shows here sooner than by the retry timeout
                        self.link.idle_tick(self.tx.live());
                        self.link.check()?;
                        return Ok(false);
                    }
                }
                Ok(tx::Head::Ready) => return Ok(true),
                Ok(tx::Head::NotYet) => {
                    // with the eager path, isend tries it first and polls after
                    if !self.tx.eager_on() {
                        self.idle_work()?;
                    }
                    return Ok(false);
                }
                Err(e) => {
                    let e = proto_error(&self.link, e);
                    return Err(self.link.fail_with(e));
                }
            }
        }
    }

    /// Queue a send; `Ok(None)` until the receiver posted the matching
    /// receive (or while all request slots are busy). Small sends of the
    /// eager tag go into the receiver's eager ring when its CTS is not there yet.
    ///
    /// # Safety
    /// `buf` must stay readable, and `mr` registered, until `test` reports
    /// this request done or failed.
    pub unsafe fn isend(&mut self, buf: RawBuf, tag: i32, mr: Option<&IbMr>) -> Result<Option<ReqId>> {
        // SAFETY: isend_p's contract is this fn's (`buf` readable and `mr`
        // registered until test reports the request), which our caller promised.
        unsafe { self.isend_p(buf, tag, mr, None) }
    }

    /// [`Self::isend`] with NCCL's profiler parent handle: one event per
    /// QP the message's writes go out on.
    ///
    /// # Safety
    /// As [`Self::isend`].
    pub unsafe fn isend_p(&mut self, buf: RawBuf, tag: i32, mr: Option<&IbMr>, parent: Option<Parent>) -> Result<Option<ReqId>> {
        self.link.check()?;
        let lkey = check_buf("isend", buf, mr, &self.link.dev, Access::LOCAL_READ)?;
        // The credit word first, the CTS FIFO after: the receiver writes CTS
        // before credits on the same QP, so every CTS that came before these
        // credits is loaded below and the head an eager message reports is
        // as fresh as the credits it spends.
        let freed = self.tx.read_credits(&self.fifo_mem);
        if self.head_ready()? {
            match self.tx.send(tag, buf.len, buf.ptr as u64, lkey) {
                tx::Sent::Taken { id, group } => {
                    if let Some(ev) = &mut self.link.ev {
                        ev.set_parents(id, &[parent]);
                    }
                    self.link.progressed();
                    if let Some(g) = group {
                        if let Err(e) = self.post_group(&g, None) {
                            self.link.fail(e.clone());
                            return Err(e);
                        }
                    }
                    return Ok(Some(id));
                }
                tx::Sent::Full => return Ok(None),
                tx::Sent::NoTag => {
                    if !self.tx.eager_on() {
                        self.idle_work()?;
                    }
                }
                tx::Sent::Mismatch { group, code, what } => {
                    // Tell the receiver (its request fails too), then fail here
                    // without stopping the QPs, so that message goes out.
                    let _ = self.post_group(&group, Some(code));
                    let e = Error::Usage(format!("peer {}: {what}", self.link.peer_name()));
                    self.link.fail_soft(e.clone());
                    return Err(e);
                }
            }
        }
        // SAFETY: `buf` stays readable until test reports the request (this
        // fn's contract); try_eager needs it only until it returns.
        if let Some(id) = unsafe { self.try_eager(buf, tag, freed, parent)? } {
            return Ok(Some(id));
        }
        if self.tx.eager_on() {
            self.idle_work()?;
            self.note_blocked();
        }
        Ok(None)
    }

    /// A call that could not proceed: reap completions, look at the peer now and then.
    fn idle_work(&mut self) -> Result<()> {
        self.poll();
        self.link.idle_tick(self.tx.live());
        self.link.check()
    }

    /// Send into the receiver's eager ring if this send may: `Ok(None)` when not.
    ///
    /// # Safety
    /// `buf` must be readable (it is copied before this returns).
    unsafe fn try_eager(&mut self, buf: RawBuf, tag: i32, freed: u64, parent: Option<Parent>) -> Result<Option<ReqId>> {
        let Some(e) = &mut self.eager else { return Ok(None) };
        let mut plan = self.tx.plan_eager(tag, buf.len, freed, &mut e.stage);
        if plan == Ok(tx::EagerPlan::Full) {
            self.poll();
            let Some(e) = &mut self.eager else { return Ok(None) };
            plan = self.tx.plan_eager(tag, buf.len, freed, &mut e.stage);
        }
        let w = match plan {
            Ok(tx::EagerPlan::Go(w)) => w,
            Ok(_) => return Ok(None),
            Err(err) => {
                let err = proto_error(&self.link, err);
                return Err(self.link.fail_with(err));
            }
        };
        let Some(e) = &mut self.eager else { return Ok(None) };
        if buf.len > 0 {
            // SAFETY: the caller guarantees buf.ptr..+len is readable; it is
            // host memory (the eager path is off on GPUDirect devices).
            e.stage.write(tx::Sender::payload_off(&w), unsafe { std::slice::from_raw_parts(buf.ptr as *const u8, buf.len) });
        }
        let wr = SendWr {
            // a signaled WR says how many eager-path WRs its completion frees
            wr_id: EAGER_FLAG | w.count,
            local: (e.stage.addr() as u64 + w.off as u64, w.len as u32, e.stage.lkey()),
            remote: (e.ring.0 + w.off as u64, e.ring.1),
            imm: None,
            signaled: w.signaled,
            inline: w.len <= self.link.max_inline as usize,
        };
        if let Some(ev) = &mut self.link.ev {
            // one event for the one write on QP 0, until the send is reported done
            ev.set_parents(w.id, &[parent]);
            let f = Fields::Qp {
                device: self.link.dev.index as i32,
                qpn: self.link.qps[0].qpn(),
                opcode: OP_RDMA_WRITE,
                wr_id: wr.wr_id,
                len: buf.len,
            };
            ev.start(w.id, 0, 0, &f);
        }
        // SAFETY: the source is this slot of our staging, which lives in this
        // comm after the QPs (field order) and is rewritten only for message
        // idx + RING_SLOTS, which needs the receiver's credit for idx, i.e.
        // after this write landed.
        if let Err(err) = unsafe { self.link.qps[0].post_writes(&[wr]) } {
            if let Some(ev) = &mut self.link.ev {
                ev.stop_req(w.id);
            }
            self.tx.release(w.id);
            return Err(self.link.fail_with(err));
        }
        self.link.progressed();
        Ok(Some(w.id))
    }

    /// A send could not go: if we have been stuck at this FIFO head for a
    /// while, tell the receiver (it may be holding CTS writes back, or owe
    /// us credits).
    fn note_blocked(&mut self) {
        let Some(e) = &mut self.eager else { return };
        let Some(m) = self.tx.on_blocked(std::time::Instant::now(), &mut e.stage) else { return };
        let wr = SendWr {
            wr_id: EAGER_FLAG | m.count,
            local: (e.stage.addr() as u64, 8, e.stage.lkey()),
            remote: e.ring,
            imm: None,
            signaled: true,
            inline: 8 <= self.link.max_inline,
        };
        // SAFETY: the source is the first word of our staging (lives after
        // the QPs); rewriting it while this write is in flight only lets the
        // receiver see a newer head, which is as true.
        match unsafe { self.link.qps[0].post_writes(&[wr]) } {
            Ok(()) => self.link.ctl_posts += 1,
            Err(err) => self.link.fail(err),
        }
    }

    fn post_group(&mut self, g: &Group, fail: Option<FailCode>) -> Result<()> {
        let nqps = self.link.qps.len();
        let (first, nlanes) = self.tx.lanes(g.seq);
        let mut plan = [PlannedWr { kind: WrKind::Empty, imm: None }; MAX_LANE_WRS];
        let mut wrs = [SendWr { wr_id: 0, local: (0, 0, 0), remote: (0, 0), imm: None, signaled: false, inline: false }; MAX_LANE_WRS];
        let sizes_off = fifo::sizes_offset(g.seq);
        let sizes_len = 4 * g.n;
        if fail.is_none() && matches!(g.imm().kind, ImmKind::Sizes(_)) {
            self.stage.write(sizes_off, &fifo::encode_sizes(&g.wire_sizes()[..g.n])[..sizes_len]);
        }
        let inline = self.link.max_inline as usize;
        // Every data byte copied into the WRs at post time: NCCL may reuse
        // the buffers at once, so the sends complete now (like a TCP send
        // whose bytes reached the socket buffer); the signaled completion
        // still frees the slot, and close waits for it.
        let mut all_inline = fail.is_none();
        for lane in 0..nlanes {
            let k = fifo::plan_lane(g, lane, nlanes, fail, &mut plan);
            let mut lane_bytes = 0u64;
            for (w, p) in wrs.iter_mut().zip(&plan[..k]) {
                if let WrKind::Data { len, .. } = p.kind {
                    lane_bytes += len as u64;
                }
                let (local, remote) = match p.kind {
                    WrKind::Data { elem, off, len } => {
                        ((g.src[elem] + off as u64, len as u32, g.lkey[elem]), (g.elems[elem].addr + off as u64, g.elems[elem].rkey))
                    }
                    WrKind::Sizes => (
                        (self.stage.addr() as u64 + sizes_off as u64, sizes_len as u32, self.stage.lkey()),
                        (self.remote_sizes.0 + sizes_off as u64, self.remote_sizes.1),
                    ),
                    WrKind::Empty => ((0, 0, 0), (g.elems[0].addr, g.elems[0].rkey)),
                };
                let inl = local.1 as usize <= inline && local.1 > 0;
                if matches!(p.kind, WrKind::Data { .. }) && !inl {
                    all_inline = false;
                }
                *w = SendWr { wr_id: g.seq, local, remote, imm: p.imm, signaled: p.imm.is_some(), inline: inl };
            }
            let qi = (first + lane) % nqps;
            if fail.is_none() && self.link.ev.is_some() && lane < MAX_EVENTS_PER_PARENT {
                self.lane_events(g, qi, lane, nlanes, &plan[..k]);
            }
            // iWARP: the same data writes, then a notice SEND instead of the immediate
            let k = match &self.notices {
                Some(nt) => nt.lane(g, lane, nlanes, qi, &plan[..k], &mut wrs)?,
                None => k,
            };
            let qp = &self.link.qps[qi];
            self.link.stats.bump(qi, lane_bytes);
            // SAFETY: data sources lie in NCCL buffers whose registrations
            // were checked in isend and which NCCL keeps valid and registered
            // until the request completes, i.e. until this lane's signaled
            // last WR completes; the sizes staging and the notice staging
            // live in this comm, which outlives its QPs (field order), and
            // slot `seq % FIFO_DEPTH` of either is rewritten only after the
            // receiver completed `seq`.
            unsafe {
                if self.notices.is_some() {
                    qp.post_writes_send(&wrs[..k])?
                } else {
                    qp.post_writes(&wrs[..k])?
                }
            };
        }
        self.tx.on_posted(g, nlanes, all_inline);
        Ok(())
    }

    /// Profiler events of one lane about to be posted on QP `qi`: one per
    /// send of the group (as NCCL's IB transport: per request per QP), its
    /// share of the lane's bytes, the opcode of its write (a send with no
    /// bytes on this lane: the lane's last write, whose completion it waits for).
    fn lane_events(&mut self, g: &Group, qi: usize, lane: usize, nlanes: usize, plan: &[PlannedWr]) {
        let qpn = self.link.qps[qi].qpn();
        let device = self.link.dev.index as i32;
        let notices = self.link.cc.notices;
        let op = |w: &PlannedWr| send_opcode(notices, w.imm.is_some());
        let last = plan.last().map_or(send_opcode(notices, true), op);
        let Some(ev) = &mut self.link.ev else { return };
        for e in (0..g.n).filter(|&e| !g.is_eager(e)) {
            let Some(id) = g.reqs[e] else { continue };
            let len = fifo::chunk(g.sizes[e] as usize, lane, nlanes).1;
            let opcode = plan.iter().find(|w| matches!(w.kind, WrKind::Data { elem, .. } if elem == e)).map_or(last, op);
            ev.start(id, qi, 0, &Fields::Qp { device, qpn, opcode, wr_id: g.seq, len });
        }
    }

    /// Writes posted whose completion has not been seen yet.
    fn outstanding(&self) -> usize {
        self.tx.outstanding()
    }

    /// Drain the CQ.
    fn poll(&mut self) {
        let mut buf = [const { std::mem::MaybeUninit::<ibv_wc>::uninit() }; POLL_BATCH];
        loop {
            let wcs = match self.link.cq.poll_some(&mut buf) {
                Ok(w) => w,
                Err(e) => return self.link.fail(e),
            };
            let n = wcs.len();
            for wc in wcs {
                if wc.wr_id & EAGER_FLAG != 0 {
                    self.tx.on_eager_done(wc.wr_id & 0xffff);
                }
                if wc.status != ffi::IBV_WC_SUCCESS {
                    let what = if wc.wr_id & EAGER_FLAG != 0 {
                        "eager write".to_string()
                    } else {
                        format!("RDMA write of message #{}", wc.wr_id & !DATA_DONE_FLAG)
                    };
                    let e = self.link.wc_error(wc, what);
                    self.link.fail(e);
                    continue;
                }
                if wc.wr_id & (EAGER_FLAG | DATA_DONE_FLAG) != 0 {
                    continue;
                }
                let Some(d) = self.tx.on_write_done(wc.wr_id) else { continue };
                let qi = self.link.qp_index(wc.qp_num);
                if let (Some(ev), Some(qi)) = (&mut self.link.ev, qi) {
                    // this QP's share of each send is on the wire and acknowledged
                    for r in d.reqs[..d.n].iter().flatten() {
                        ev.stop(*r, qi);
                    }
                }
            }
            if n > 0 {
                self.link.progressed();
            }
            if n < POLL_BATCH {
                return;
            }
        }
    }

    /// `Ok(Some(size))` once the send is done.
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        let done = self.tx.is_done(id).map_err(|s| Error::Usage(format!("test on send request: {s}")))?;
        if !done {
            self.poll();
        }
        if self.tx.is_done(id) == Ok(true) {
            if let Some(ev) = &mut self.link.ev {
                ev.stop_req(id);
            }
            let size = self.tx.release(id).unwrap_or(0);
            return Ok(Some(Completion::one(size)));
        }
        if let Err(e) = self.link.check() {
            self.release(id);
            return Err(e);
        }
        self.link.idle_tick(self.tx.live());
        if let Err(e) = self.link.check() {
            self.release(id);
            return Err(e);
        }
        Ok(None)
    }

    /// Free a request NCCL is told about (done or failed): its events end first.
    fn release(&mut self, id: ReqId) {
        if let Some(ev) = &mut self.link.ev {
            ev.stop_req(id);
        }
        self.tx.release(id);
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        self.drain_on_close();
        // iWARP: disconnect and destroy the rdma_cm ids before `link` drops
        // the QPs (librdmacm's order: disconnect, destroy QP, destroy id)
        if let Some(n) = &mut self.notices {
            n.close_cm();
        }
    }
}

impl SendComm {
    /// Closing must not drop writes already posted (a send reported done
    /// early, inline, may still be on the wire): wait for their completions,
    /// bounded by the retry timeout, a failure, or the peer going away.
    fn drain_on_close(&mut self) {
        if self.hs.is_none() {
            self.link.eager_stats = self.tx.eager_stats();
            self.link.log_stats("send");
        }
        if self.hs.is_some() || self.link.failed.is_some() {
            return;
        }
        // unsignaled eager writes at the tail: a signaled empty write behind
        // them completes only after they did (RC order)
        if let (Some(e), Some(count)) = (&self.eager, self.tx.close_eager()) {
            let wr = SendWr { wr_id: EAGER_FLAG | count, local: (0, 0, 0), remote: e.ring, imm: None, signaled: true, inline: false };
            // SAFETY: no local memory is read.
            if unsafe { self.link.qps[0].post_writes(&[wr]) }.is_err() {
                // not posted: nothing of it to wait for
                self.tx.on_eager_done(1);
            }
        }
        if self.outstanding() == 0 {
            return;
        }
        let ack_s = 4.096e-6 * f64::from(1u32 << self.link.cc.timeout.min(31)) * f64::from(self.link.cc.retry_cnt + 1);
        let limit = std::time::Duration::from_secs_f64(ack_s.clamp(1.0, 30.0));
        let t0 = std::time::Instant::now();
        while self.outstanding() > 0 && self.link.failed.is_none() && t0.elapsed() < limit {
            self.poll();
            self.link.idle_tick(0);
        }
        if self.outstanding() > 0 && self.link.failed.is_none() {
            tracing::warn!(
                "{}: closing a send comm to {} with {} message(s) not acknowledged after {limit:?}",
                self.link.dev.name,
                self.link.peer_name(),
                self.outstanding()
            );
        }
    }
}

// ---------------------------------------------------------------- receive side

/// The receiver's eager ring (its bookkeeping is in the machine, [`rx::Receiver`]).
struct EagerRing {
    /// Mailbox word, then the ring slots the sender writes.
    ring: HostRegion,
}

/// A loopback QP and a scratch word: `iflush` RDMA-reads one byte of the
/// last received buffer through the NIC, so the NIC's earlier writes are
/// visible before NCCL reads (needed for GPU memory; forced for host memory
/// only by RUSTNET_FORCE_FLUSH=1).
struct Flush {
    qp: Qp<Rts>,
    scratch: HostRegion,
}

impl Flush {
    fn new(dev: &Arc<IbDev>, cq: &Cq, local: &LocalAddr, cc: &ConnCfg) -> Result<Flush> {
        let caps = verbs::QpCaps { max_send_wr: FIFO_DEPTH as u32, max_recv_wr: 1, max_inline: 0 };
        let qp = Qp::create(&dev.pd, cq, caps, dev.port, cc.pkey, Access::REMOTE_READ)?;
        let me = verbs::RtrParams {
            dest_qpn: qp.qpn(),
            mtu: local.mtu as u32,
            port: dev.port,
            global: dev.link_layer == super::device::LINK_ETH,
            dgid: local.gid,
            sgid_index: local.gid_index,
            dlid: local.lid,
            tc: 0,
            sl: 0,
        };
        let qp = qp.to_rtr(&me)?.to_rts(&verbs::RtsParams { timeout: cc.timeout, retry_cnt: cc.retry_cnt })?;
        Ok(Flush { qp, scratch: HostRegion::new(&dev.pd, 64, Access::LOCAL_WRITE)? })
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        self.link.eager_stats = self.rx.eager_stats();
        self.link.log_stats("recv");
        // iWARP: disconnect and destroy the rdma_cm ids before `link` drops
        // the QPs (librdmacm's order: disconnect, destroy QP, destroy id)
        if let Some(n) = &mut self.notices {
            n.close_cm();
        }
    }
}

/// Request slots of a receive comm (see [`rx::RECV_POOL`]).
pub const RECV_POOL: usize = rx::RECV_POOL;

/// Registered memory read through the protocol machines' eyes.
impl Mem for HostRegion {
    fn read_u64(&self, off: usize) -> u64 {
        HostRegion::read_u64(self, off)
    }
    fn read(&self, off: usize, out: &mut [u8]) {
        HostRegion::read(self, off, out)
    }
}

/// Staging the protocol machines write into.
impl MemMut for HostRegion {
    fn write(&mut self, off: usize, data: &[u8]) {
        HostRegion::write(self, off, data)
    }
}

/// Copy an eager message the receiver machine handed out into its buffer.
fn copy_delivery(ring: &HostRegion, d: &rx::Deliver) {
    if d.len > 0 {
        assert!(d.src + d.len <= ring.len());
        // SAFETY: the ring bytes src..+len were written before the trailer
        // the machine checked (acquire fence in read_u64) and lie inside the
        // ring (asserted); the destination is the posted buffer's CTS
        // address, whose capacity the machine checked against len, writable
        // until its request is reported done (irecv's contract), host
        // memory (eager is off with GPUDirect).
        unsafe { std::ptr::copy_nonoverlapping(ring.addr().add(d.src), d.dst as *mut u8, d.len) };
    }
}

/// The receiving end of a verbs connection.
pub struct RecvComm {
    link: Link,
    flush: Option<Flush>,
    /// READY bytes received so far; None once READY arrived.
    ready: Option<([u8; 8], usize)>,
    /// Sizes area the sender writes (grouped receives).
    sizes_mem: HostRegion,
    /// CTS staging (slot `seq % FIFO_DEPTH` at its FIFO offset), then the
    /// credit word's source.
    stage: HostRegion,
    local: LocalAddr,
    remote_fifo: (u64, u32),
    /// The protocol: requests, FIFO slots, CTS batching, eager bookkeeping.
    rx: rx::Receiver,
    eager: Option<EagerRing>,
    /// iWARP: rdma_cm and notices (after `link`: dropped after the QPs).
    notices: Option<Box<RecvSide>>,
}

impl RecvComm {
    /// `notices`: iWARP (its QPs are connected by rdma_cm later, and post
    /// their notice receives then).
    pub(super) fn new(
        setup: Setup,
        qps: Vec<Qp<Rts>>,
        oob: Socket,
        peer: SocketAddr,
        cc: Arc<ConnCfg>,
        remote: &Meta,
        notices: Option<Box<RecvSide>>,
    ) -> Result<RecvComm> {
        let Setup { dev, cq, local, region, stage, eager: offer, .. } = setup;
        let mut link = Link::new(&dev, cq, cc, oob, peer);
        link.max_inline = qps.iter().map(|q| q.max_inline()).min().unwrap_or(0);
        let nq = qps.len();
        for q in qps.iter().filter(|_| notices.is_none()) {
            for _ in 0..RECV_WRS {
                q.post_recv_empty(RECV_WR)?;
            }
        }
        link.qps = qps;
        link.init_stats();
        // events: one per receive buffer per QP (index buffer * nq + QP)
        link.ev = EventSlots::new(RECV_POOL, MAX_RECVS * nq);
        link.set_peer(remote);
        let flush = if link.cc.flush { Some(Flush::new(&dev, &link.cq, &local, &link.cc)?) } else { None };
        let limit = offer.min(remote.eager) as usize;
        let eager = if limit > 0 {
            Some(EagerRing { ring: HostRegion::new(&dev.pd, eager::ring_bytes(limit), Access::REMOTE_WRITE)? })
        } else {
            None
        };
        let rx = rx::Receiver::new(rx::Config { nqps: nq, split: link.cc.split, eager: limit, sq_depth: RECV_SQ_DEPTH });
        Ok(RecvComm {
            link,
            flush,
            ready: Some(([0; 8], 0)),
            sizes_mem: region,
            stage,
            local,
            remote_fifo: (remote.addr, remote.rkey),
            rx,
            eager,
            notices,
        })
    }

    /// What we tell the sender.
    pub(super) fn local_meta(&self) -> Meta {
        let mut m = Meta {
            qpns: self.link.qps.iter().map(|q| q.qpn()).collect(),
            mtu: self.local.mtu,
            link: self.link.dev.link_layer,
            port: self.link.dev.port,
            gid_index: self.local.gid_index,
            lid: self.local.lid,
            tc: 0,
            sl: 0,
            split: self.link.cc.split,
            gid: self.local.gid,
            family: self.local.family,
            roce_version: self.local.roce_version,
            addr: self.sizes_mem.addr() as u64,
            rkey: self.sizes_mem.rkey(),
            name: self.link.dev.dev_name.clone(),
            eager: self.rx.eager_limit() as u32,
            ring: self.eager.as_ref().map_or((0, 0), |e| (e.ring.addr() as u64, e.ring.rkey())),
        };
        if let Some(n) = &self.notices {
            n.fill_meta(&mut m);
        }
        m
    }

    pub(super) fn oob(&self) -> &Socket {
        &self.link.oob
    }

    /// Peer's out-of-band address.
    pub fn peer(&self) -> SocketAddr {
        self.link.peer
    }

    /// Device index.
    pub fn dev(&self) -> usize {
        self.link.dev.index
    }

    /// Our QP numbers.
    pub fn qpns(&self) -> Vec<u32> {
        self.link.qps.iter().map(|q| q.qpn()).collect()
    }

    /// The device's registration cache (for flush lookups).
    pub fn device(&self) -> &Arc<IbDev> {
        &self.link.dev
    }

    /// Per-QP counters.
    pub fn qp_stats(&self) -> Vec<QpStat> {
        self.link.stats.snapshot()
    }

    /// The live per-QP counters (for the statistics file).
    pub fn qp_table(&self) -> Arc<QpTable> {
        self.link.stats.clone()
    }

    /// Eager messages received and their payload bytes.
    pub fn eager_stats(&self) -> (u64, u64) {
        self.rx.eager_stats()
    }

    fn progress_ready(&mut self) -> Result<()> {
        if self.ready.is_none() {
            return Ok(());
        }
        // iWARP: our side of the rdma_cm connections up, notice receives posted
        let cm_up = match &mut self.notices {
            Some(n) => n.cm_ready(&self.link.qps)?,
            None => true,
        };
        let Some((buf, got)) = &mut self.ready else { return Ok(()) };
        if !handshake::read_some(&self.link.oob, &mut buf[..], got, &self.link.peer, "READY")? {
            return Ok(());
        }
        if *buf != READY {
            return Err(Error::Protocol { peer: self.link.peer_name(), what: format!("expected READY, got {buf:02x?}") });
        }
        if !cm_up {
            return Ok(());
        }
        self.ready = None;
        self.link.handshake = false;
        self.rx.on_ready();
        self.flush_ctl()
    }

    /// A protocol error of the peer's, as the comm reports it.
    fn proto_err(&self, e: ProtoError) -> Error {
        proto_error(&self.link, e)
    }

    /// Would `irecv` take a receive now? (A merged device asks every member
    /// before posting on any.) An error when this comm has failed.
    pub fn can_take_recv(&mut self) -> Result<bool> {
        self.link.check()?;
        if !self.rx.slot_free() {
            self.poll();
        }
        Ok(self.rx.can_take())
    }

    /// Post a (grouped) receive; `Ok(None)` when all request slots are busy.
    ///
    /// # Safety
    /// Every buffer must stay writable, and its registration alive, until
    /// `test` reports this request done or failed.
    pub unsafe fn irecv(&mut self, bufs: &[RecvBuf], mrs: &[Option<&IbMr>]) -> Result<Option<ReqId>> {
        // SAFETY: irecv_p's contract is this fn's (every buffer writable and
        // registered until test reports the request), which our caller promised.
        unsafe { self.irecv_p(bufs, mrs, &[]) }
    }

    /// [`Self::irecv`] with NCCL's profiler parent handle of each buffer:
    /// one event per buffer per QP the message's writes arrive on.
    ///
    /// # Safety
    /// As [`Self::irecv`].
    pub unsafe fn irecv_p(&mut self, bufs: &[RecvBuf], mrs: &[Option<&IbMr>], parents: &[Option<Parent>]) -> Result<Option<ReqId>> {
        self.link.check()?;
        let n = bufs.len();
        if n == 0 || n > MAX_RECVS {
            return Err(Error::InvalidArg(format!("irecv with n={n} (1..={MAX_RECVS} accepted)")));
        }
        let mut cts = [Cts::default(); MAX_RECVS];
        for (i, b) in bufs.iter().enumerate() {
            check_buf("irecv", b.buf, mrs.get(i).copied().flatten(), &self.link.dev, Access::REMOTE_WRITE)?;
            let rkey = mrs.get(i).copied().flatten().map_or(0, |m| m.rkey());
            cts[i] = Cts { addr: b.buf.ptr as u64, rkey, cap: b.buf.len as u32, tag: b.tag, n: n as u8, i: i as u8 };
        }
        if self.ready.is_some() {
            if let Err(e) = self.progress_ready() {
                return Err(self.link.fail_with(e));
            }
        }
        if !self.rx.slot_free() {
            self.poll();
            if !self.rx.slot_free() {
                // the slot's previous lap may still wait to be written
                self.rx.force_cts();
                if let Err(e) = self.flush_ctl() {
                    return Err(self.link.fail_with(e));
                }
                return Ok(None);
            }
        }
        if !self.rx.can_take() {
            return Ok(None);
        }
        // iWARP (no RNR retry): a CTS only while every notice it allows finds a receive
        let (_, first, nlanes) = self.rx.next_lanes();
        let in_flight = self.rx.in_flight() + 1;
        if self.notices.as_ref().is_some_and(|n| !n.may_advertise(first, nlanes, in_flight)) {
            return Ok(None);
        }
        // messages that arrived before their buffer was posted are copied here
        let ring = self.eager.as_ref().map(|e| &e.ring);
        let taken = self.rx.take_recv(&cts[..n], &mut |d| copy_delivery(ring.expect("eager delivery without a ring"), d));
        let t = match taken {
            Ok(Some(t)) => t,
            Ok(None) => return Ok(None),
            Err(e) => {
                let e = self.proto_err(e);
                return Err(self.link.fail_with(e));
            }
        };
        if let Some(nt) = &mut self.notices {
            let link = &self.link;
            if let Err(e) = nt.expect(t.seq, t.nlanes, || link.peer_name()) {
                self.rx.abandon(t.id);
                return Err(self.link.fail_with(e));
            }
        }
        if let Some(ev) = &mut self.link.ev {
            ev.set_parents(t.id, parents);
            let device = self.link.dev.index as i32;
            let nqps = self.link.qps.len();
            for lane in 0..t.nlanes.min(MAX_EVENTS_PER_PARENT) {
                let qi = (t.first + lane) % nqps;
                let qpn = self.link.qps[qi].qpn();
                for (i, b) in bufs.iter().enumerate() {
                    let len = fifo::chunk(b.buf.len, lane, t.nlanes).1;
                    ev.start(
                        t.id,
                        i * nqps + qi,
                        i,
                        &Fields::Qp { device, qpn, opcode: recv_opcode(self.link.cc.notices), wr_id: t.seq, len },
                    );
                }
            }
        }
        self.link.progressed();
        if let Err(e) = self.flush_ctl() {
            return Err(self.link.fail_with(e));
        }
        Ok(Some(t.id))
    }

    /// Post the control writes the machine plans now (CTS slots in order,
    /// the credit word), each chain one post on its QP.
    fn flush_ctl(&mut self) -> Result<()> {
        if !self.rx.has_ctl() {
            return Ok(()); // (the polling loop's common case: nothing to build)
        }
        let mut chain = rx::CtlChain::default();
        while self.rx.poll_ctl(&mut self.stage, &mut chain) {
            self.post_ctl(&chain)?;
        }
        Ok(())
    }

    /// Post a chain of `(offset, len)` ranges of the staging to the same
    /// place in the sender's FIFO region (CTS elements, the credit word).
    fn post_ctl(&mut self, chain: &rx::CtlChain) -> Result<()> {
        let mut wrs = [SendWr { wr_id: 0, local: (0, 0, 0), remote: (0, 0), imm: None, signaled: false, inline: false }; rx::CHAIN];
        let qi = chain.qp;
        for (w, c) in wrs.iter_mut().zip(chain.wrs()) {
            *w = SendWr {
                wr_id: CTS_FLAG | (qi as u64) << 48 | c.signal.unwrap_or(0),
                local: (self.stage.addr() as u64 + c.off as u64, c.len as u32, self.stage.lkey()),
                remote: (self.remote_fifo.0 + c.off as u64, self.remote_fifo.1),
                imm: None,
                signaled: c.signal.is_some(),
                inline: c.len <= self.link.max_inline as usize,
            };
        }
        // SAFETY: the sources are this comm's staging (it outlives the QPs,
        // field order); a slot's staging is rewritten only for seq +
        // FIFO_DEPTH, after this write landed and the sender moved past it
        // (CtsQueue::can_post); the credit word may be rewritten in flight,
        // which only shows the sender a larger, equally true count.
        unsafe { self.link.qps[qi].post_writes(&wrs[..chain.n])? };
        self.link.ctl_posts += 1;
        Ok(())
    }

    /// Look at the eager ring and the mailbox; post the credit write (and
    /// deferred CTS) when due.
    fn poll_eager(&mut self) -> Result<()> {
        let Some(e) = &self.eager else { return Ok(()) };
        let ring = &e.ring;
        let got = self.rx.poll_ring(ring, &mut |d| copy_delivery(ring, d)).map_err(|err| proto_error(&self.link, err))?;
        if got > 0 {
            self.link.progressed();
        }
        // credits due: they go now, deferred CTS with them (the same post)
        if self.rx.credit_due() {
            self.flush_ctl()?;
        }
        Ok(())
    }

    /// Drain the CQ, look at the eager ring, write what is due.
    fn poll(&mut self) {
        self.poll_with(true);
    }

    /// [`Self::poll`]; `eager: false` skips the ring (the caller just looked).
    fn poll_with(&mut self, eager: bool) {
        let mut buf = [const { std::mem::MaybeUninit::<ibv_wc>::uninit() }; POLL_BATCH];
        loop {
            let wcs = match self.link.cq.poll_some(&mut buf) {
                Ok(w) => w,
                Err(e) => return self.link.fail(e),
            };
            let n = wcs.len();
            for wc in wcs {
                let cts = wc.wr_id & CTS_FLAG != 0;
                if wc.status != ffi::IBV_WC_SUCCESS {
                    let what = if cts {
                        "CTS write".to_string()
                    } else if wc.wr_id & FLUSH_FLAG != 0 {
                        "flush read (loopback QP)".to_string()
                    } else {
                        "receive".to_string()
                    };
                    let e = self.link.wc_error(wc, what);
                    self.link.fail(e);
                    continue;
                }
                if cts {
                    // (control writes all go on QP 0, the one the budget counts)
                    self.rx.on_ctl_done(wc.wr_id & 0xffff_ffff_ffff);
                    continue;
                }
                if wc.wr_id & FLUSH_FLAG != 0 {
                    self.rx.on_flush_done(ReqId { slot: wc.wr_id as u8, gen: (wc.wr_id >> 8) as u8 });
                    continue;
                }
                if let Err(e) = self.complete_recv(wc) {
                    self.link.fail(e);
                }
            }
            if n > 0 {
                self.link.progressed();
            }
            if n < POLL_BATCH {
                break;
            }
        }
        if self.link.failed.is_some() {
            return;
        }
        let r = if eager { self.poll_eager() } else { Ok(()) }.and_then(|_| self.flush_ctl());
        if let Err(e) = r {
            self.link.fail(e);
        }
    }

    fn complete_recv(&mut self, wc: &ibv_wc) -> Result<()> {
        let qi = self.link.qp_index(wc.qp_num);
        let word = if let Some(nt) = &mut self.notices {
            // iWARP: the notice SEND carries the word (its receive reposted)
            let link = &self.link;
            let i = qi.ok_or_else(|| Error::Internal(format!("receive completion on unknown QP {:#x}", wc.qp_num)))?;
            nt.on_recv(wc, i, &link.qps[i], || link.peer_name())?
        } else {
            // keep the receive queue full (receive WRs are not tied to a receive)
            if let Some(q) = qi.map(|i| &self.link.qps[i]) {
                q.post_recv_empty(RECV_WR)?;
            }
            if wc.opcode != ffi::IBV_WC_RECV_RDMA_WITH_IMM || wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM == 0 {
                return Err(Error::Protocol {
                    peer: self.link.peer_name(),
                    what: format!("unexpected completion (opcode {}, wr_id {:#x}) on a receive QP", wc.opcode, wc.wr_id),
                });
            }
            // SAFETY: WITH_IMM is set, so the union holds imm_data.
            u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data })
        };
        self.on_word(qi, word)
    }

    /// A completion word (an immediate, or an iWARP notice's) on our QP
    /// `qi`: hand it to the machine, end the profiler events it answers,
    /// count the bytes.
    fn on_word(&mut self, qi: Option<usize>, word: u32) -> Result<()> {
        let sizes_mem = &self.sizes_mem;
        let notices = self.notices.as_deref();
        let read_sizes = |seq| {
            // iWARP: lane 0's notice carried a grouped receive's sizes
            if let Some(n) = notices {
                return n.sizes((seq % FIFO_DEPTH as u64) as usize);
            }
            let mut b = [0u8; SIZES_SLOT_BYTES];
            sizes_mem.read(fifo::sizes_offset(seq), &mut b);
            fifo::decode_sizes(&b)
        };
        // (the peer's name is formatted only on the error path: no allocation per message)
        let ev = self.rx.on_imm(word, read_sizes).map_err(|e| proto_error(&self.link, e))?;
        if let (Some(evs), Some(qi)) = (&mut self.link.ev, qi) {
            // what this QP carries of every buffer of the receive has landed
            let nq = self.link.qps.len();
            for i in 0..MAX_RECVS {
                evs.stop(ev.id, i * nq + qi);
            }
        }
        if let Some(sizes) = ev.sizes {
            // counters: the sender cut each buffer with the same rule (fifo::chunk)
            let nqps = self.link.qps.len();
            let (first, nlanes) = fifo::lanes(ev.seq, nqps, self.link.cc.split);
            for lane in 0..nlanes {
                let bytes: usize = sizes[..ev.n].iter().map(|&s| fifo::chunk(s, lane, nlanes).1).sum();
                self.link.stats.bump((first + lane) % nqps, bytes as u64);
            }
        }
        Ok(())
    }

    /// `Ok(Some(sizes))` once every buffer of the receive is filled.
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        let mut done = self.rx.is_done(id).map_err(|s| Error::Usage(format!("test on receive request: {s}")))?;
        // (and only while the send queue has room: the full poll retires it)
        let fast =
            !done && self.eager.is_some() && self.ready.is_none() && self.link.failed.is_none() && self.rx.ctl_room() >= RECV_SQ_DEPTH / 2;
        if fast {
            // fast path: the eager ring first, the CQ only if still not done
            if let Err(e) = self.poll_eager() {
                self.link.fail(e);
            }
            done = self.rx.is_done(id).unwrap_or(false);
        }
        if !done {
            if self.ready.is_some() {
                if let Err(e) = self.progress_ready() {
                    self.link.fail(e);
                }
            }
            self.poll_with(!fast);
        }
        if let Ok(Some(f)) = self.rx.finish(id) {
            if let Some(ev) = &mut self.link.ev {
                // buffers filled by eager messages had no completion of their own
                ev.stop_req(id);
            }
            return Ok(Some(Completion { n: f.n, sizes: f.sizes }));
        }
        if self.link.failed.is_none() {
            self.link.check().ok();
        }
        if self.link.failed.is_none() {
            self.link.idle_tick(self.rx.live());
        }
        if let Some(e) = self.link.failed.clone() {
            if let Some(ev) = &mut self.link.ev {
                ev.stop_req(id);
            }
            self.rx.abandon(id);
            return Err(e);
        }
        Ok(None)
    }

    /// Flush received data: `Ok(None)` (nothing to do) for host memory
    /// unless flushes are forced; then one RDMA READ of the last non-empty
    /// buffer through the loopback QP, completed by `test`.
    pub fn iflush(&mut self, bufs: &[RawBuf], mrs: &[Option<&IbMr>]) -> Result<Option<ReqId>> {
        self.link.check()?;
        let Some(f) = &self.flush else { return Ok(None) };
        let Some((i, b)) = bufs.iter().enumerate().rev().find(|(_, b)| b.len > 0) else { return Ok(None) };
        // NCCL's own handle for that buffer when it allows the read (no
        // shared lock on the data path); else look the registration up.
        let given = mrs.get(i).copied().flatten().filter(|m| m.covers(b.ptr, 1) && m.access().covers(Access::REMOTE_READ));
        let rkey = given.map(IbMr::rkey).or_else(|| self.link.dev.mrs.find_rkey(b.ptr, 1, Access::REMOTE_READ)).ok_or_else(|| {
            Error::Usage(format!(
                "iflush: {:p} is not in a receive registration that allows the flush read (regMr on this recv comm first)",
                b.ptr
            ))
        })?;
        // never Ok(None) here: to NCCL that would mean "nothing to flush"
        let Some(id) = self.rx.add_flush() else {
            return Err(Error::Internal(format!("iflush: all {RECV_POOL} request slots of the receive comm are in use")));
        };
        let wr_id = FLUSH_FLAG | (id.gen as u64) << 8 | id.slot as u64;
        // SAFETY: the scratch word is registered with local write and lives
        // in this comm after the flush QP (field order); the source is NCCL's
        // receive buffer under the rkey of its live registration.
        let r = unsafe { f.qp.post_read(wr_id, (f.scratch.addr() as u64, 1, f.scratch.lkey()), (b.ptr as u64, rkey)) };
        if let Err(e) = r {
            self.rx.abandon(id);
            self.link.fail(e.clone());
            return Err(e);
        }
        Ok(Some(id))
    }
}

/// A protocol error of the peer's, as a comm reports it: a size or tag
/// mismatch the sender reported (or an eager message too large for its
/// buffer) is the application's mistake, a usage error naming the peer;
/// anything else is the peer breaking the protocol.
fn proto_error(link: &Link, e: ProtoError) -> Error {
    if e.is_size_mismatch() {
        Error::Usage(format!("peer {}: {e}", link.peer_name()))
    } else {
        Error::Protocol { peer: link.peer_name(), what: e.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_goes_inline_only_when_nccl_ib_use_inline_says_so() {
        // iWARP QPs are created with 64 bytes inline for the notices
        assert_eq!(data_inline(false, 64), 0, "NCCL_IB_USE_INLINE=0 keeps data writes off the inline path");
        assert_eq!(data_inline(true, 64), 64);
        assert_eq!(data_inline(true, 0), 0);
    }

    #[test]
    fn profiler_opcodes_follow_the_data_path() {
        assert_eq!((OP_RDMA_WRITE, OP_RDMA_WRITE_WITH_IMM, OP_SEND), (0, 1, 2), "ibv_wr_opcode");
        assert_eq!((OP_RECV, OP_RECV_RDMA_WITH_IMM), (128, 129), "ibv_wc_opcode");
        assert_eq!(send_opcode(false, true), OP_RDMA_WRITE_WITH_IMM);
        assert_eq!(send_opcode(false, false), OP_RDMA_WRITE);
        assert_eq!(send_opcode(true, true), OP_SEND, "iWARP: a lane ends in the notice SEND");
        assert_eq!(send_opcode(true, false), OP_RDMA_WRITE);
        assert_eq!(recv_opcode(false), OP_RECV_RDMA_WITH_IMM);
        assert_eq!(recv_opcode(true), OP_RECV, "iWARP: the receive waits for the notice");
    }
}
