//! What both ends of a verbs connection share, and the executor's half of
//! the protocol machines' [`Link`](crate::proto::nic::Link) trait: the QPs
//! and the CQ, the peer, the failure state, the liveness probe on the
//! out-of-band socket, the profiler events and the per-QP counters. The
//! data path proper (what to post and when) is decided by
//! [`crate::proto::tx::Sender`] / [`crate::proto::rx::Receiver`]; `p2p.rs`
//! executes it.
//!
//! Failures: a completion error, an async event on our port or device, or
//! the out-of-band socket closing (the peer process died or closed its
//! comm) fails the comm: every pending and later request returns the error,
//! which names the work-completion status, our QP and the peer.
use std::net::SocketAddr;
use std::sync::Arc;

use super::device::IbDev;
use super::ffi::{self, ibv_wc};
use super::handshake::ConnCfg;
use super::notice_path::CmConnect;
use super::reg::IbMr;
use super::verbs::{self, Access, Cq, Init, Qp, Rts};
use crate::error::{Errno, Error, Result};
use crate::profiler::{EventSlots, Fields, Parent, OP_RDMA_WRITE, OP_RDMA_WRITE_WITH_IMM, OP_RECV, OP_RECV_RDMA_WITH_IMM, OP_SEND};
use crate::proto::ib_meta::{Meta, META_LEN};
use crate::proto::nic::{Cqe, Ev, EvOp, Fail, WrId, POLL_BATCH};
use crate::proto::pool::ReqId;
use crate::proto::ProtoError;
use crate::transport::sock::{Io, Socket};
use crate::transport::{RawBuf, MAX_P2P_BYTES, MAX_RECVS};

/// Look at the clock every this many calls that made no progress...
const LIVENESS_EVERY: u32 = 64;
/// ...and ask the out-of-band socket about the peer at most this often (a
/// system call per few idle polls cost ~30% of rxe's bandwidth at 1 MiB
/// under emulation, where the kernel side of the NIC shares the CPUs).
const LIVENESS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);
/// A peer that closed its end while we had requests outstanding fails the
/// comm only once this long has passed since we saw the close: a peer that
/// took everything and closed at once (NCCL ends a job rank by rank) may
/// still have its last acknowledgements on the wire behind the close, and
/// the completions they make are the requests' rightful ends.
pub(super) const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

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

/// `verbs work: 10 doorbells, 12 send WRs (...)`: what the comm asked of the NIC.
pub fn format_work(w: &crate::stats::WorkSnap) -> String {
    let v: Vec<String> = w.ops().iter().map(|(op, n)| format!("{n} {op}")).collect();
    format!("verbs work: {}", v.join(", "))
}

/// What both comm kinds share: the QPs, the CQ, the peer, the failure state.
pub(super) struct Link {
    // Declared first: QPs are destroyed before anything they point into.
    pub(super) qps: Vec<Qp<Rts>>,
    pub(super) cq: Cq,
    pub(super) dev: Arc<IbDev>,
    pub(super) cc: Arc<ConnCfg>,
    pub(super) oob: Socket,
    pub(super) peer: SocketAddr,
    pub(super) peer_qpns: Vec<u32>,
    pub(super) peer_dev: String,
    pub(super) peer_gid: [u8; 16],
    /// Our GID (as the peer was told).
    pub(super) local_gid: [u8; 16],
    pub(super) failed: Option<Error>,
    /// Recovery after a fabric fault ([`super::recover`]); `None`: this comm
    /// fails on the first fault (the knob is 0, iWARP, or the peer's build
    /// does not recover).
    pub(super) rec: Option<Box<super::recover::RecLink>>,
    /// A member of a merged device: its name ("rxe0+rxe2") and this rail's
    /// index (what a recovery that waits for this port says it holds up).
    pub(super) member_of: Option<(Arc<str>, usize)>,
    /// The receiver's flush QP (its completions are the comm's too).
    pub(super) flush_qpn: Option<u32>,
    pub(super) health: (u32, u32),
    pub(super) idle: u32,
    pub(super) last_check: std::time::Instant,
    /// The last idle tick's liveness look ran (past its interval): iWARP
    /// then reads its rdma_cm events too.
    pub(super) looked: bool,
    pub(super) max_inline: u32,
    /// Per-QP counters, index = QP index in `qps` (shared with the statistics file).
    pub(super) stats: Arc<QpTable>,
    /// Eager messages and their payload bytes (they ride QP 0).
    pub(super) eager_stats: (u64, u64),
    /// Control writes posted: CTS (batches), credits, mailbox.
    pub(super) ctl_posts: u64,
    /// The out-of-band socket still carries the connection handshake (the
    /// receiver's metadata, READY): liveness probes must not read it.
    pub(super) handshake: bool,
    /// When a liveness probe first read the peer's close (outside a
    /// recovery): the comm fails [`CLOSE_GRACE`] later if its requests
    /// have not completed by then.
    pub(super) peer_closed: Option<std::time::Instant>,
    /// Open profiler events by request slot (None: profiling off when the
    /// comm was built). Declared after the QPs: dropped (stopped) last.
    pub(super) ev: Option<EventSlots>,
    /// NCCL's profiler parents of the call in progress (isend: one; irecv:
    /// one per buffer), given to the request the machine takes.
    pub(super) parents: [Option<Parent>; MAX_RECVS],
    pub(super) nparents: usize,
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

/// Where the sender's handshake stands: a send comm holds it until READY
/// is out ([`super::ready`] steps it; it lives here, beside the rest of
/// what a comm holds, so that the data path need not import its stepper).
pub(super) enum SendHs {
    /// Waiting for the receiver's metadata (its acceptance) since `since`.
    ReadMeta { qps: Vec<Qp<Init>>, rx: Box<[u8; META_LEN]>, got: usize, since: std::time::Instant },
    /// The link went away inside a move of our QPs to RTR: they wait for
    /// the port ([`super::handshake::retry_bringup`]); `since` is the
    /// handshake's start.
    Rtr { b: Box<super::handshake::Bringup>, remote: Box<Meta>, since: std::time::Instant },
    /// iWARP: the rdma_cm connections of our QPs ([`CmConnect`]).
    Cm { cm: Box<CmConnect>, remote: Box<Meta> },
    /// Writing READY (`sent` bytes of it so far).
    WriteReady { sent: usize },
}

impl Link {
    pub(super) fn new(setup_dev: &Arc<IbDev>, cq: Cq, cc: Arc<ConnCfg>, oob: Socket, peer: SocketAddr) -> Link {
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
            local_gid: [0; 16],
            failed: None,
            rec: None,
            member_of: None,
            flush_qpn: None,
            idle: 0,
            last_check: std::time::Instant::now(),
            looked: false,
            max_inline: 0,
            stats: Arc::new(QpTable::default()),
            eager_stats: (0, 0),
            ctl_posts: 0,
            handshake: true,
            peer_closed: None,
            ev: None,
            parents: [None; MAX_RECVS],
            nparents: 0,
        }
    }

    /// Index of our QP `qpn`.
    pub(super) fn qp_index(&self, qpn: u32) -> Option<usize> {
        self.qps.iter().position(|q| q.qpn() == qpn)
    }

    /// The failure ends every open event: nothing more moves.
    fn stop_events(&mut self) {
        if let Some(ev) = &mut self.ev {
            ev.stop_all();
        }
    }

    /// Fix the counters once the QPs are known.
    pub(super) fn init_stats(&mut self) {
        self.stats.set(self.qps.iter().map(|q| q.qpn()));
    }

    /// Log the counters at close: TRACE always, INFO with RUSTNET_STATS=1.
    pub(super) fn log_stats(&self, kind: &str) {
        let dump = STATS_DUMP.load(std::sync::atomic::Ordering::Relaxed);
        if !dump && !crate::log::trace_enabled() && !tracing::enabled!(tracing::Level::TRACE) {
            return;
        }
        let line = format!(
            "{}: {kind} comm to {}: {}; eager: {} msgs, {} bytes; control writes: {}; {}",
            self.dev.name,
            self.peer_name(),
            format_stats(&self.stats.snapshot()),
            self.eager_stats.0,
            self.eager_stats.1,
            self.ctl_posts,
            format_work(&self.stats.work.snapshot())
        );
        if dump {
            tracing::info!("stats: {line}");
        } else {
            tracing::trace!("{line}");
        }
    }

    pub(super) fn set_peer(&mut self, m: &Meta) {
        self.peer_qpns = m.qpns.clone();
        self.peer_dev = m.name.clone();
        self.peer_gid = m.gid;
    }

    pub(super) fn peer_name(&self) -> String {
        if self.peer_dev.is_empty() {
            self.peer.to_string()
        } else {
            format!("{} ({} GID {})", self.peer, self.peer_dev, super::gid::show(&self.peer_gid))
        }
    }

    pub(super) fn fail(&mut self, e: Error) {
        if self.failed.is_none() {
            tracing::warn!("{}: comm failed: {e}", self.dev.name);
            self.failed = Some(e);
            self.stop_events();
            // Stop the QPs so nothing more lands in our memory.
            for q in &self.qps {
                let _ = q.set_error();
            }
            self.tell_gave_up();
        }
    }

    /// A work request completed on our QPs, or a request was reported done
    /// (a receiver whose traffic is all eager may see no completion of its
    /// own for a while): after a resume, the fabric carries our work again
    /// and the recovery episode is over (`Recovery::settled`).
    #[inline(always)]
    pub(super) fn work_done(&mut self) {
        if let Some(r) = self.rec.as_mut() {
            if r.m.unsettled() {
                r.m.settled();
            }
        }
    }

    /// A comm that recovers and failed tells its peer (GiveUp, best
    /// effort), which then fails at once instead of at the end of its own
    /// recovery window.
    fn tell_gave_up(&mut self) {
        if self.handshake {
            return;
        }
        let Some(r) = self.rec.as_mut() else { return };
        if r.m.phase() == crate::proto::recover::Phase::Failed {
            return; // (the recovery's own give-up queued it already)
        }
        r.send(&crate::proto::recover::RcMsg::GiveUp { epoch: r.m.epoch() });
        let _ = self.oob.write_on(&r.out, &mut r.sent);
    }

    /// Fail the link and return the error it now reports (the first one).
    pub(super) fn fail_with(&mut self, e: Error) -> Error {
        self.fail(e.clone());
        self.failed.clone().unwrap_or(e)
    }

    /// Record a failure but leave the QPs running, so a "fail" immediate
    /// just posted still reaches the peer and tells it why (a send comm's
    /// QPs only let the peer write into our FIFO, which lives until drop).
    pub(super) fn fail_soft(&mut self, e: Error) {
        if self.failed.is_none() {
            tracing::warn!("{}: comm failed: {e}", self.dev.name);
            self.failed = Some(e);
            self.stop_events();
            self.tell_gave_up();
        }
    }

    /// Fail now if an earlier failure or an async event says so. Called a
    /// few times per `test`: the common answer (no failure, no fatal event)
    /// is inlined, the rest is [`Link::check_slow`].
    #[inline(always)]
    pub(super) fn check(&mut self) -> Result<()> {
        if self.failed.is_none() && self.dev.health.changed_since(self.dev.port, self.health).is_none() {
            return Ok(());
        }
        self.check_slow()
    }

    #[cold]
    #[inline(never)]
    fn check_slow(&mut self) -> Result<()> {
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

    pub(super) fn wc_error(&self, wc: &ibv_wc, what: String) -> Error {
        let lib = verbs::Lib::get().ok();
        let status = lib.map_or_else(|| format!("status {}", wc.status), |l| l.wc_status_str(wc.status));
        let qi = self.qps.iter().position(|q| q.qpn() == wc.qp_num);
        let rq = qi.and_then(|i| self.peer_qpns.get(i)).map_or_else(|| "?".into(), |q| format!("{q:#x}"));
        let hint = match wc.status {
            ffi::IBV_WC_RETRY_EXC_ERR => format!(
                " (no acknowledgement within NCCL_IB_TIMEOUT={} x NCCL_IB_RETRY_CNT={}: the peer died or is unreachable)",
                self.cc.timeout, self.cc.retry_cnt
            ),
            ffi::IBV_WC_WR_FLUSH_ERR if self.cc.notices && self.failed.is_none() && self.rec.is_some() => {
                " (the iWARP connection was closed: a link went down, or the peer process exited or closed its comm)".into()
            }
            ffi::IBV_WC_WR_FLUSH_ERR if self.cc.notices && self.failed.is_none() => {
                " (the iWARP connection was closed: the peer process exited or closed its comm, or a link went down)".into()
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
    /// `true` when it looked (which may have failed the link).
    #[inline(always)]
    pub(super) fn idle_tick(&mut self, pending: usize) -> bool {
        self.idle = self.idle.wrapping_add(1);
        // During the handshake its own reads see a peer that went away; a
        // probe here could swallow the bytes it waits for (the comm would
        // then wait for them forever, silently).
        if !self.idle.is_multiple_of(LIVENESS_EVERY) || self.failed.is_some() || self.handshake {
            return false;
        }
        self.looked = self.liveness(pending);
        true
    }

    /// Every [`LIVENESS_EVERY`] idle calls: the clock, and at most every
    /// [`LIVENESS_INTERVAL`] the out-of-band socket.
    /// `true` when it looked (the interval had passed).
    #[inline(never)]
    fn liveness(&mut self, pending: usize) -> bool {
        let now = std::time::Instant::now();
        if now.duration_since(self.last_check) < LIVENESS_INTERVAL {
            return false;
        }
        self.last_check = now;
        if let Some(r) = self.rec.as_mut().filter(|r| r.m.unsettled()) {
            // resumed, nothing completed on the new QPs yet: the window
            // counts while NCCL calls the comm (Recovery::observe)
            r.m.observe(now);
        }
        if self.rec.is_some() {
            // the socket carries recovery messages (a peer that stopped its
            // QPs says so here), and a flap of our port is noticed here
            self.check_flap(pending);
            let _ = self.pump();
            self.peer_flush_due(now, pending);
            return true;
        }
        let mut b = [0u8; 16];
        match self.oob.read(&mut b) {
            Ok(Io::Again) => {}
            Ok(Io::Done(n)) => {
                // nothing follows READY on this socket in our protocol
                let what = format!("sent {n} unexpected byte(s) on the out-of-band connection after the handshake: {:02x?}", &b[..n]);
                self.fail(Error::Protocol { peer: self.peer_name(), what });
            }
            Ok(Io::Eof) => {
                if self.close_grace(now) {
                    return true;
                }
                let what = format!("closed its connection (process exited or closed its comm) with {pending} request(s) of ours pending");
                self.fail(Error::Remote { peer: self.peer_name(), what });
            }
            Err(e) => {
                let what = format!("out-of-band connection failed: {e}");
                self.fail(Error::Remote { peer: self.peer_name(), what });
            }
        }
        true
    }

    /// iWARP: the connection closed under this comm (`cause`: a flushed
    /// work request, or rdma_cm's word): recover at once when our own port
    /// explains it, else wait for the peer's Halt or close
    /// ([`super::recover::RecLink::peer_flush`]).
    pub(super) fn connection_closed(&mut self, cause: String, err: Error) {
        if self.halted() || self.failed.is_some() {
            return;
        }
        if self.handshake || !self.closed_by_peer() {
            // (during the handshake fault() fails the comm: nothing would
            // resolve a wait for the peer's word there)
            self.fault(cause, err);
        } else if let Some(r) = self.rec.as_mut().filter(|r| r.peer_flush.is_none()) {
            r.peer_flush = Some((std::time::Instant::now(), cause));
        }
    }

    /// iWARP: a flushed work request that our own port does not explain
    /// (it is ACTIVE and reported nothing the comm has not looked at): the
    /// peer closed the connection, or its link went down.
    fn closed_by_peer(&self) -> bool {
        self.rec.is_some() && !self.own_fault() && self.dev.port_attr().is_ok_and(|p| p.state == ffi::IBV_PORT_ACTIVE)
    }

    /// Since the comm last looked: did our port report an event, or did
    /// our own fault injection (`RUSTNET_FAULT_QP_ERROR`) move a QP? Then a
    /// lost connection is explained on our side.
    fn own_fault(&self) -> bool {
        self.rec.as_ref().is_some_and(|r| r.forced || self.dev.health.port_events(self.dev.port) != r.port_seen)
    }

    /// A testing knob moved one of our QPs to the error state
    /// (`RUSTNET_FAULT_QP_ERROR`): its flushes are ours to recover from.
    #[cold]
    pub(super) fn forced_error(&mut self) {
        if let Some(r) = self.rec.as_mut() {
            r.forced = true;
        }
    }

    /// iWARP: the connection closed under us [`super::recover::PEER_FLUSH_WAIT`]
    /// ago and the peer has neither stopped its QPs nor closed its comm:
    /// recover now (a link between us that failed with neither port
    /// noticing, or a peer that is slow to say so). A comm that holds
    /// `pending` requests recovers at once, at this look: a peer that ends
    /// its comm normally has nothing of ours outstanding (each send is
    /// done only once the receiver has it, each receive once its data
    /// landed), and if the peer did close, the recovery's Halt finds its
    /// out-of-band socket closed and fails the comm naming it, as the wait
    /// would have. (The peer's own Halt may come late: it went out over a
    /// link that was down, where TCP's retransmission backs off.)
    pub(super) fn peer_flush_due(&mut self, now: std::time::Instant, pending: usize) {
        let Some(r) = self.rec.as_mut() else { return };
        let Some((t, _)) = &r.peer_flush else { return };
        if r.m.active() {
            r.peer_flush = None;
            return;
        }
        if self.peer_closed.is_some() || (pending == 0 && now.saturating_duration_since(*t) < super::recover::PEER_FLUSH_WAIT) {
            return;
        }
        if let Some((_, cause)) = r.peer_flush.take() {
            self.fault(cause, Error::Internal("iWARP connection closed".into()));
        }
    }

    /// The peer's close was read now (outside a recovery): is it still
    /// within [`CLOSE_GRACE`] of the first time (then the comm goes on, so
    /// that completions already on their way end its requests)?
    pub(super) fn close_grace(&mut self, now: std::time::Instant) -> bool {
        let first = *self.peer_closed.get_or_insert(now);
        now.saturating_duration_since(first) < CLOSE_GRACE
    }

    #[inline(always)]
    pub(super) fn progressed(&mut self) {
        self.idle = 0;
    }
}

pub(super) fn check_buf(what: &str, buf: RawBuf, mr: Option<&IbMr>, dev: &IbDev, access: Access) -> Result<u32> {
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

impl Link {
    /// Read up to [`POLL_BATCH`] completions as the machines see them.
    /// A failed one fails the comm here, with its status named (`what`
    /// says what the WR was); a receive's is turned into its completion
    /// word by `on_recv` (which reposts it), whose error fails the comm too.
    /// (Inlined: an empty poll, the polling loop's common case, returns
    /// here; what came is read out of line.)
    #[inline(always)]
    pub(super) fn reap(
        &mut self,
        out: &mut [Cqe; POLL_BATCH],
        what: impl Fn(WrId) -> String,
        on_recv: impl FnMut(&mut Link, &ibv_wc, Option<usize>) -> Result<u32>,
    ) -> Result<usize> {
        let mut buf = [const { std::mem::MaybeUninit::<ibv_wc>::uninit() }; POLL_BATCH];
        let wcs = match self.cq.poll_some(&mut buf) {
            Ok(w) => w,
            Err(e) => return Err(self.fail_with(e)),
        };
        self.stats.work.poll(wcs.len());
        if let Some(r) = &mut self.rec {
            r.quiet = wcs.is_empty();
        }
        if wcs.is_empty() {
            return Ok(0);
        }
        Ok(self.take_wcs(wcs, out, what, on_recv))
    }

    /// The completions a poll returned, as the machines see them ([`Link::reap`]).
    #[inline(never)]
    fn take_wcs(
        &mut self,
        wcs: &[ibv_wc],
        out: &mut [Cqe; POLL_BATCH],
        what: impl Fn(WrId) -> String,
        mut on_recv: impl FnMut(&mut Link, &ibv_wc, Option<usize>) -> Result<u32>,
    ) -> usize {
        let mut n = 0;
        let mut settled = false;
        for wc in wcs {
            let qp = self.qp_index(wc.qp_num);
            if qp.is_none() && self.rec.is_some() && Some(wc.qp_num) != self.flush_qpn {
                // a QP a recovery replaced: its late news was settled by the restart points
                continue;
            }
            let Some(wr) = WrId::decode(wc.wr_id) else {
                let e = Error::Internal(format!("completion with a wr_id not ours ({:#x}) on QP {:#x}", wc.wr_id, wc.qp_num));
                self.fail(e);
                continue;
            };
            let mut c = Cqe { wr, qp, ok: wc.status == ffi::IBV_WC_SUCCESS, word: None };
            // (a success on a data QP is the fabric carrying our work again;
            // the receiver's flush QP reads locally and proves nothing)
            settled |= c.ok && qp.is_some();
            if !c.ok {
                if self.halted() {
                    // the stop's flushes: a receive queue's says every word before it was read
                    if let (WrId::Recv(_), Some(i), Some(r)) = (wr, qp, &mut self.rec) {
                        r.rq_flushed |= 1u128 << i.min(127);
                    }
                } else {
                    if let (ffi::IBV_WC_WR_FLUSH_ERR, WrId::Recv(_), Some(i), Some(r)) = (wc.status, wr, qp, &mut self.rec) {
                        r.pre_flushed |= 1u128 << i.min(127);
                    }
                    let e = self.wc_error(wc, what(wr));
                    if self.recoverable(wc.status, wr) {
                        if self.cc.notices && wc.status == ffi::IBV_WC_WR_FLUSH_ERR {
                            self.connection_closed(e.to_string(), e);
                        } else {
                            self.fault(e.to_string(), e);
                        }
                    } else {
                        self.fail(e);
                    }
                }
            } else if let WrId::Recv(_) = wr {
                match on_recv(self, wc, qp) {
                    Ok(w) => c.word = Some(w),
                    Err(e) => {
                        self.fail(e);
                        c.ok = false;
                    }
                }
            }
            out[n] = c;
            n += 1;
        }
        if settled {
            self.work_done();
        }
        n
    }

    /// May completion status `status` start a recovery on this comm
    /// ([`super::recover::recoverable_on`])? Soft-RoCE's "invalid request"
    /// is noted (the next one within the spacing fails the comm) and logged.
    fn recoverable(&mut self, status: u32, wr: WrId) -> bool {
        if self.cc.notices {
            // iWARP: a link fault closes the connection, which flushes the
            // queues, and soft-iWARP fails the work request it was sending
            // with a local QP operation error. So does a buffer deregistered
            // under a post (a bug, which the call-sequence fuzz makes on
            // purpose): resent, that message fails again at once, so the
            // same message failing so twice in a row fails the comm.
            if status == ffi::IBV_WC_WR_FLUSH_ERR {
                return true;
            }
            if status != ffi::IBV_WC_LOC_QP_OP_ERR {
                return false;
            }
            let seq = match wr {
                WrId::Data(s) | WrId::DataDone(s) => Some(s),
                _ => None,
            };
            let ours = self.own_fault();
            let Some(r) = self.rec.as_mut() else { return false };
            if ours {
                // a QP error we injected (RUSTNET_FAULT_QP_ERROR), or our
                // port went down: the connection was lost, whichever message
                // it caught, and the same one may be caught again
                r.loc_err_seq = None;
                return true;
            }
            if seq.is_some() && r.loc_err_seq == seq {
                return false;
            }
            r.loc_err_seq = seq;
            return true;
        }
        if super::recover::recoverable(status) {
            return true;
        }
        let soft = self.dev.soft_roce;
        let Some(r) = self.rec.as_mut() else { return false };
        let now = std::time::Instant::now();
        let since = r.inv_req_at.map(|t| now.saturating_duration_since(t));
        if !super::recover::recoverable_on(status, soft, since) {
            return false;
        }
        r.inv_req_at = Some(now);
        tracing::warn!(
            concat!(
                "{}: comm to {}: soft-RoCE answered \"invalid request\" (it does so now and then to a correct write ",
                "whose packets it received out of order); recovering in place, the write is sent again whole; ",
                "another one within {:?} fails the comm"
            ),
            self.dev.name,
            self.peer_name(),
            super::recover::INV_REQ_SPACING
        );
        true
    }

    /// The comm's error for a machine's [`Fail`], the comm failed by it
    /// where the protocol says so (`req`: "send" or "receive", for a stale id).
    pub(super) fn fail_by(&mut self, f: Fail<Error>, req: &str) -> Error {
        match f {
            Fail::Nic(e) => self.fail_with(e),
            Fail::Proto(e) => {
                let e = proto_error(self, e);
                self.fail_with(e)
            }
            Fail::Mismatch(_, what) => {
                // the QPs keep running: the "fail" immediate just posted still
                // reaches the peer and tells it why
                let e = Error::Usage(format!("peer {}: {what}", self.peer_name()));
                self.fail_soft(e.clone());
                e
            }
            Fail::Stale(s) => Error::Usage(format!("test on {req} request: {s}")),
            Fail::NoSlot => Error::Internal(format!("all request slots of the {req} comm are in use")),
        }
    }

    /// The request the machine just took gets the call's profiler parents.
    pub(super) fn taken(&mut self, id: ReqId) {
        if let Some(ev) = &mut self.ev {
            ev.set_parents(id, &self.parents[..self.nparents]);
        }
    }

    /// Open a profiler event the machine asks for.
    pub(super) fn ev_start(&mut self, e: &Ev) {
        let notices = self.cc.notices;
        let Some(qpn) = self.qps.get(e.qp).map(|q| q.qpn()) else { return };
        let device = self.dev.index as i32;
        let Some(ev) = &mut self.ev else { return };
        let opcode = match e.op {
            EvOp::Write => OP_RDMA_WRITE,
            EvOp::LaneEnd => send_opcode(notices, true),
            EvOp::Recv => recv_opcode(notices),
        };
        let wr_id = match e.wr {
            // as before the machines: the slot's sequence number
            WrId::Data(seq) => seq,
            w => w.encode(),
        };
        ev.start(e.id, e.slot, e.parent, &Fields::Qp { device, qpn, opcode, wr_id, len: e.len });
    }
}

/// Implements the machines' [`Link`](crate::proto::nic::Link) for an
/// executor with a `link: Link` field, a `reap` method and its iWARP side
/// in `notices` (an `Option` of something with `connection_lost`).
macro_rules! via_link {
    ($t:ty) => {
        impl $t {
            /// iWARP, at a liveness look: did rdma_cm report a connection closed?
            #[cold]
            fn cm_look(&mut self) {
                if self.link.rec.is_none() || self.link.halted() || self.link.handshake {
                    return;
                }
                if let Some(why) = self.notices.as_mut().and_then(|n| n.connection_lost()) {
                    // (`why` names the peer: "peer ...: closed the rdma_cm connection")
                    self.link.connection_closed(why, crate::error::Error::Internal("iWARP connection closed".into()));
                }
            }
        }

        impl crate::proto::nic::Link for $t {
            type Error = crate::error::Error;
            #[inline]
            fn poll_cq(&mut self, out: &mut [crate::proto::nic::Cqe; crate::proto::nic::POLL_BATCH]) -> crate::error::Result<usize> {
                self.reap(out)
            }
            #[inline(always)]
            fn check(&mut self) -> crate::error::Result<()> {
                self.link.check()
            }
            #[inline(always)]
            fn tick(&mut self, live: usize) -> bool {
                let ticked = self.link.idle_tick(live);
                if ticked && self.notices.is_some() && std::mem::take(&mut self.link.looked) {
                    self.cm_look();
                }
                ticked
            }
            #[inline(always)]
            fn progressed(&mut self) {
                self.link.progressed()
            }
            #[inline]
            fn stopped(&self) -> bool {
                self.link.halted()
            }
            fn fail(&mut self, f: crate::proto::nic::Fail<crate::error::Error>) {
                self.link.fail_by(f, "");
            }
            #[inline]
            fn profiling(&self) -> bool {
                self.link.ev.is_some()
            }
            #[inline]
            fn taken(&mut self, id: crate::proto::pool::ReqId) {
                self.link.taken(id)
            }
            fn ev_start(&mut self, ev: &crate::proto::nic::Ev) {
                self.link.ev_start(ev)
            }
            fn ev_stop(&mut self, id: crate::proto::pool::ReqId, slot: usize) {
                if let Some(ev) = &mut self.link.ev {
                    ev.stop(id, slot);
                }
            }
            fn ev_stop_req(&mut self, id: crate::proto::pool::ReqId) {
                if let Some(ev) = &mut self.link.ev {
                    ev.stop_req(id);
                }
            }
            #[inline]
            fn count(&mut self, qp: usize, bytes: u64) {
                self.link.stats.bump(qp, bytes)
            }
            #[inline]
            fn now(&self) -> std::time::Instant {
                std::time::Instant::now()
            }
        }
    };
}
pub(super) use via_link;

/// The accessors both comm kinds offer (`$m`: their machine's field).
macro_rules! comm_accessors {
    ($t:ty, $m:ident) => {
        impl $t {
            /// Peer's out-of-band address.
            pub fn peer(&self) -> std::net::SocketAddr {
                self.io.link.peer
            }

            /// Device index.
            pub fn dev(&self) -> usize {
                self.io.link.dev.index
            }

            /// The device (its registration cache: flush lookups).
            pub fn device(&self) -> &std::sync::Arc<super::device::IbDev> {
                &self.io.link.dev
            }

            /// Our QP numbers (a send comm's: empty until the handshake finished).
            pub fn qpns(&self) -> Vec<u32> {
                self.io.link.qps.iter().map(|q| q.qpn()).collect()
            }

            /// Per-QP counters now.
            pub fn qp_stats(&self) -> Vec<crate::stats::QpStat> {
                self.io.link.stats.snapshot()
            }

            /// The live per-QP counters (for the statistics file).
            pub fn qp_table(&self) -> std::sync::Arc<crate::stats::QpTable> {
                self.io.link.stats.clone()
            }

            /// Eager messages and their payload bytes, sent or received.
            pub fn eager_stats(&self) -> (u64, u64) {
                self.$m.eager_stats()
            }

            /// Is this end's eager memory registered (the receiver's ring, the
            /// sender's staging)? With a late ring only once the sender asked.
            pub fn eager_registered(&self) -> bool {
                self.io.eager.is_some()
            }
        }
    };
}
pub(super) use comm_accessors;

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
