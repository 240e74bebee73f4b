//! The executor's half of a comm's recovery after a fabric fault
//! ([`super::recover`] says what starts one): stop the QPs, read what
//! their CQ still holds, wait for the port, make new QPs and connect them
//! to the peer's, hand the peer's restart point to the machine, all driven
//! by [`crate::proto::recover::Recovery`]'s steps, and the recovery
//! messages over the comm's out-of-band socket.
use std::time::{Duration, Instant};

use super::caps::RECV_WRS;
use super::device::LINK_ETH;
use super::handshake;
use super::keeper::Kept;
use super::link::Link;
use super::p2p::{Flush, RecvComm, SendComm};
use super::verbs::{Cq, Qp, RtrParams, RtsParams};
use crate::error::{Error, Result};
use crate::proto::nic::WrId;
use crate::proto::recover::{Do, GiveUpWhy, Phase, Point, QpAddr, RcMsg, RC_HDR, RC_MAX_PAYLOAD};
use crate::proto::tx::lanes_mask;
use crate::transport::sock::Io;

/// How often a recovering comm asks whether its port is ACTIVE again.
const PORT_POLL: Duration = Duration::from_millis(50);
/// A receiver's drain ends when every QP's receive queue was flushed, or
/// after this long (a provider that flushes nothing: WARN).
const DRAIN_MAX: Duration = Duration::from_secs(1);
/// A sender's drain ends once its CQ was found empty this long after the stop.
const DRAIN_MIN: Duration = Duration::from_millis(5);

impl Link {
    /// The peer's State of this epoch (its new QPs' addresses), checked
    /// against the QPs we made; `Err`: the comm failed (a bug, or a peer
    /// that broke the protocol).
    fn peer_state(&mut self) -> Result<QpAddr> {
        let r = self.rec_mut()?;
        let Some((peer, _)) = r.m.peer() else {
            return Err(self.fail_with(Error::Internal("connect without the peer's State".into())));
        };
        let (peer, ours) = (*peer, r.new_qps.len());
        if peer.nqps != ours {
            let what = format!("recovered with {} QPs where the connection has {ours}", peer.nqps);
            return Err(self.fail_with(Error::Protocol { peer: self.peer_name(), what }));
        }
        Ok(peer)
    }

    /// New QPs are the comm's: what was known of the old ones' receive
    /// queues goes.
    fn qps_replaced(&mut self) {
        if let Some(r) = self.rec.as_mut() {
            r.rq_flushed = 0;
            r.pre_flushed = 0;
        }
    }

    /// Is the comm recovering (nothing may be posted)?
    #[inline]
    pub(super) fn halted(&self) -> bool {
        self.rec.as_ref().is_some_and(|r| r.m.active())
    }

    /// A fault on this comm (`cause` says what): recover when the comm
    /// can, else fail with `err`.
    pub(super) fn fault(&mut self, cause: String, err: Error) {
        if self.failed.is_some() {
            return;
        }
        if self.rec.is_none() || self.handshake {
            self.fail(err);
            return;
        }
        let peer = self.peer_name();
        let Some(r) = self.rec.as_mut() else { return };
        if !r.m.active() {
            tracing::warn!(
                "{}: comm to {peer}: {cause}; recovering in place: new QPs, then what the peer lacks is sent again (RUSTNET_RECOVERY_TIMEOUT={} s)",
                self.dev.name,
                r.window_s
            );
            r.cause = cause;
        }
        r.m.fault(Instant::now());
    }

    /// The port went down and came back while `pending` requests waited:
    /// recover now instead of waiting for the HCA's next retransmission
    /// (up to 4.096 us x 2^NCCL_IB_TIMEOUT later).
    pub(super) fn check_flap(&mut self, pending: usize) {
        let Some(r) = self.rec.as_mut() else { return };
        let now = self.dev.health.port_events(self.dev.port);
        if now == r.port_seen {
            return;
        }
        // a PORT_ERR not yet ridden out, then a PORT_ACTIVE (in one look or two)
        let went_down = now.0 > r.port_seen.0;
        r.went_down |= went_down;
        let came_back = r.went_down && now.1 > r.port_seen.1;
        r.port_seen = now;
        if came_back {
            r.went_down = false;
        }
        if pending == 0 || r.m.active() {
            return;
        }
        // Work outstanding when the link went down: stop and drain now, while
        // the link is down, so that only the rebuild is left for link-up. The
        // QPs would retransmit into a dead link until their retry budget is
        // spent (NCCL_IB_TIMEOUT x NCCL_IB_RETRY_CNT), and the side whose
        // QPs see no error would otherwise start only at PORT_ACTIVE.
        let cause = if came_back {
            format!("the link of {} went down and came back with {pending} request(s) outstanding", self.dev.describe())
        } else if went_down && self.dev.port_attr().is_ok_and(|p| p.state != super::ffi::IBV_PORT_ACTIVE) {
            format!("the link of {} went down (PORT_ERR) with {pending} request(s) outstanding", self.dev.describe())
        } else {
            return;
        };
        self.fault(cause, Error::Internal("port flap".into()));
    }

    /// About to post (an isend or irecv of a plain comm, or a merged device
    /// asking a member whether it would take one: a member then posts without
    /// looking again, so the answer it gave stands): if the port reported an
    /// event the comm has not looked at, look now. When the port is down
    /// now, the request about to be posted counts as outstanding, so the comm
    /// stops and recovers instead of posting into the dead link (the request
    /// waits in NCCL's retry and goes out on the new QPs); a flap already
    /// over is handled as before (a recovery only for work outstanding).
    /// Not during the handshake (a port event then waits for READY, as in
    /// the idle tick) nor during a recovery (which handles the port itself).
    /// On soft-RoCE a post into a dead link also leaves the kernel resolving
    /// the peer's address, an INCOMPLETE neighbour entry that after link-up
    /// answers only at its next ARP retry (1 s), which held the recovery
    /// messages on the same netdev that long (stop 37's trace of
    /// `verbs_late_rank_receiver_flap_recovers`). One compare of two counters
    /// when nothing happened.
    #[inline(always)]
    pub(super) fn flap_before_post(&mut self, live: usize) {
        if let Some(r) = self.rec.as_ref() {
            if self.dev.health.port_events(self.dev.port) != r.port_seen || r.peer_flush.is_some() {
                self.flap_seen(live);
            }
        }
    }

    #[cold]
    #[inline(never)]
    fn flap_seen(&mut self, live: usize) {
        if self.handshake || self.halted() {
            return;
        }
        // iWARP: the connection closed under us and NCCL posts: recover now
        // rather than post into a closed connection
        if let Some((_, cause)) = self.rec.as_mut().and_then(|r| r.peer_flush.take()) {
            if self.peer_closed.is_none() {
                self.fault(cause, Error::Internal("iWARP connection closed".into()));
                return;
            }
        }
        let down = self.dev.port_attr().is_ok_and(|p| p.state != super::ffi::IBV_PORT_ACTIVE);
        // iWARP: a link that went down took the QPs with it (soft-iWARP
        // moves every QP of the device to ERROR, and a post into such a QP
        // may never complete), so a flap already over recovers before the
        // post too, as if the request were outstanding
        let posting = down || self.cc.notices;
        self.check_flap(if posting { live + 1 } else { live });
    }

    /// Write what is queued, read what came, hand complete messages to the
    /// recovery. An error fails the comm (the peer is gone, or broke the
    /// protocol).
    pub(super) fn pump(&mut self) -> Result<()> {
        let Some(r) = self.rec.as_mut() else { return Ok(()) };
        // (a give-up goes out whatever the port: the out-of-band network may be another one)
        if r.sent < r.out.len() && (r.port_up || !r.m.active() || r.m.phase() == Phase::Failed) {
            let before = r.sent;
            if let Err(e) = self.oob.write_on(&r.out, &mut r.sent) {
                let what = format!("out-of-band connection failed while recovering: {e}");
                return Err(self.fail_with(Error::Remote { peer: self.peer_name(), what }));
            }
            let (wrote, left) = (r.sent - before, r.out.len() - r.sent);
            self.step_note(|| format!("wrote {wrote} byte(s) of recovery messages ({left} left)"));
        }
        loop {
            // (a field borrow: the oob socket is read while it is held)
            let Some(r) = self.rec.as_mut() else { return Err(self.fail_with(no_rec())) };
            let mut b = [0u8; 2048];
            let room = (RC_HDR + RC_MAX_PAYLOAD + 2048 - r.inbuf.len()).min(b.len());
            match self.oob.read(&mut b[..room]) {
                Ok(Io::Done(n)) => r.inbuf.extend_from_slice(&b[..n]),
                Ok(Io::Again) => break,
                Ok(Io::Eof) => {
                    let active = r.m.active();
                    if !active && self.close_grace(Instant::now()) {
                        // (a peer that took everything and closed: our last
                        // completions may still be on their way)
                        break;
                    }
                    let Some(r) = self.rec.as_mut() else { return Err(self.fail_with(no_rec())) };
                    let what = if active {
                        format!("closed its connection (process exited or closed its comm) while recovering from: {}", r.cause)
                    } else {
                        "closed its connection (process exited or closed its comm)".to_string()
                    };
                    return Err(self.fail_with(Error::Remote { peer: self.peer_name(), what }));
                }
                Err(e) => {
                    let what = format!("out-of-band connection failed: {e}");
                    return Err(self.fail_with(Error::Remote { peer: self.peer_name(), what }));
                }
            }
        }
        loop {
            let r = self.rec_mut()?;
            let (m, used) = match crate::proto::recover::RcMsg::decode(&r.inbuf) {
                Ok(Some(x)) => x,
                Ok(None) => return Ok(()),
                Err(e) => return Err(self.fail_with(Error::Protocol { peer: self.peer_name(), what: e.to_string() })),
            };
            r.inbuf.drain(..used);
            self.step_note(|| {
                let kind = match &m {
                    RcMsg::Halt { .. } => "Halt",
                    RcMsg::State { .. } => "State",
                    RcMsg::Go { .. } => "Go",
                    RcMsg::GiveUp { .. } => "GiveUp",
                };
                format!("the peer's {kind}({}) read", m.epoch())
            });
            let r = self.rec_mut()?;
            let was = r.m.active();
            if let Err(e) = r.m.on_msg(Instant::now(), m) {
                return Err(self.fail_with(Error::Protocol { peer: self.peer_name(), what: e.to_string() }));
            }
            if !r.m.active() && r.m.peer_gave_up() {
                // (a comm that had resumed: nothing steps the machine now,
                // and the peer's end is failed)
                if r.cause.is_empty() {
                    r.cause = "the peer's end failed after the recovery".into();
                }
                let e = self.give_up(GiveUpWhy::Peer);
                return Err(self.fail_with(e));
            }
            if !was && r.m.active() {
                r.cause = "the peer stopped its QPs (a fault on its side)".into();
                let peer = self.peer_name();
                tracing::warn!("{}: comm to {peer}: the peer stopped its QPs (a fault on its side); recovering in place", self.dev.name);
            }
        }
    }

    /// One INFO line per step of a recovery, with the time since its stop
    /// (`NCCL_DEBUG=INFO`): where a recovery's time goes.
    fn step_done(&self, what: &str) {
        if let Some(r) = &self.rec {
            let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            tracing::info!(
                "{}: comm to {}: recovery epoch {}: {what} at +{:.1} ms (unix {:.3})",
                self.dev.name,
                self.peer_name(),
                r.m.epoch(),
                r.halted_at.elapsed().as_secs_f64() * 1e3,
                unix.as_secs_f64()
            );
        }
    }

    /// [`Self::step_done`] at NCCL's TRACE (`NCCL_DEBUG=TRACE`): the recovery messages
    /// (`what` is only formatted when that level is on).
    fn step_note(&self, what: impl FnOnce() -> String) {
        if let Some(r) = &self.rec {
            if crate::log::trace_enabled() || tracing::enabled!(tracing::Level::DEBUG) {
                tracing::debug!(
                    "{}: comm to {}: recovery epoch {}: {} at +{:.1} ms",
                    self.dev.name,
                    self.peer_name(),
                    r.m.epoch(),
                    what(),
                    r.halted_at.elapsed().as_secs_f64() * 1e3
                );
            }
        }
    }

    fn stop_qps(&mut self) {
        for q in &self.qps {
            let _ = q.set_error();
        }
    }

    fn give_up(&mut self, why: GiveUpWhy) -> Error {
        let Some(r) = self.rec.as_ref() else { return no_rec() };
        // (the error names the peer once: a cause that is the peer's own error already starts with it)
        let peer = self.peer_name();
        let lead = format!("peer {peer}: ");
        let cause = r.cause.strip_prefix(&lead).unwrap_or(&r.cause);
        let what = match why {
            GiveUpWhy::Peer => format!(
                "{cause}; the peer's end of the comm gave up (its recovery window was spent, or it failed: its log says why; \
                 RUSTNET_RECOVERY_TIMEOUT={} s here)",
                r.window_s
            ),
            GiveUpWhy::Window { waited, charged, phase } => {
                let waiting = match phase {
                    Phase::Draining => "the completions of the stopped QPs".to_string(),
                    Phase::WaitPort | Phase::Rebuild => match &self.member_of {
                        Some((name, i)) => format!(
                            "{} to be ACTIVE again (member {i} of merged device {name}: the other members cannot take its share, \
                             librustnet has no failover between members yet)",
                            self.dev.describe()
                        ),
                        None => format!("{} to be ACTIVE again", self.dev.describe()),
                    },
                    Phase::Exchange => "the peer's new QPs (is its port up?)".into(),
                    Phase::WaitGo | Phase::Running | Phase::Failed => "the peer to resume".into(),
                };
                let last =
                    if r.retry_why.is_empty() { String::new() } else { format!(" (last attempt to connect new QPs: {})", r.retry_why) };
                // (silences between NCCL's calls count a tenth: see Recovery::observe)
                let counted = if waited.saturating_sub(charged) >= Duration::from_secs(1) {
                    format!(", {:.1} s of it counted (NCCL did not call the comm for the rest)", charged.as_secs_f64())
                } else {
                    String::new()
                };
                format!(
                    "{cause}; recovery gave up after {:.1} s{counted} waiting for {waiting}{last} (RUSTNET_RECOVERY_TIMEOUT={} s; 0 turns recovery off)",
                    waited.as_secs_f64(),
                    r.window_s
                )
            }
        };
        Error::Remote { peer, what }
    }
}

/// One end of a recovering comm, as the driver below sees it.
pub(super) trait Side {
    /// Its link.
    fn link(&mut self) -> &mut Link;
    /// Stop what the link does not own (the receiver's flush QP).
    fn halt_extra(&mut self) {}
    /// Read the CQ through the machine (its posts do nothing while halted).
    fn drain(&mut self);
    /// A receiver (its drain ends at its receive queues' flush).
    fn receiver(&self) -> bool;
    /// A receiver whose QPs have no receive posted (iWARP, stopped again
    /// before its new rdma_cm connections came up): nothing to flush.
    fn nothing_posted(&self) -> bool {
        false
    }
    /// The machine's restart point.
    fn point(&self) -> Point;
    /// iWARP, at the rebuild: the QPs `qpns` (new) will be connected by
    /// rdma_cm; a receiver opens a new listener and returns its address,
    /// which its State carries. `None`: not iWARP, or the sending end.
    fn restart_cm(&mut self, _qpns: Vec<u32>) -> Result<Option<std::net::SocketAddr>> {
        Ok(None)
    }
    /// iWARP: connect the new QPs through rdma_cm (a sender dials the
    /// listener the receiver's State named, a receiver accepts), polled.
    /// `None`: not iWARP (the QPs are brought to RTS by hand). `Some(Ok(true))`:
    /// connected, the new QPs are the comm's; `Some(Ok(false))`: not yet;
    /// `Some(Err)`: this attempt failed (the next epoch tries again).
    fn connect_cm(&mut self) -> Result<Option<std::result::Result<bool, Error>>> {
        Ok(None)
    }
    /// The new QPs are connected: post what they need (receives), rebuild
    /// the flush QP.
    fn connected(&mut self) -> Result<()>;
    /// Hand the peer's restart point to the machine; bytes written again.
    fn resume(&mut self, peer: &Point) -> Result<u64>;

    /// Is the comm recovering? Moves the recovery on first (`Err`: it failed).
    /// (Inlined into every `test`: the common answer is one load.)
    #[inline(always)]
    fn recovering(&mut self) -> Result<bool>
    where
        Self: Sized,
    {
        if !self.link().halted() {
            return Ok(false);
        }
        still_recovering(self)
    }
}

/// The recovery state went missing mid-step: a bug (it is made at connect
/// and never dropped), reported as one instead of a panic at NCCL's boundary.
#[cold]
fn no_rec() -> Error {
    Error::Internal("a comm's recovery state is missing in the middle of a recovery".into())
}

impl Link {
    /// The recovery state, in the middle of a recovery step; its absence
    /// (a bug) fails the comm.
    fn rec_mut(&mut self) -> Result<&mut super::recover::RecLink> {
        if self.rec.is_none() {
            return Err(self.fail_with(no_rec()));
        }
        self.rec.as_deref_mut().ok_or_else(no_rec)
    }
}

/// [`Side::recovering`] of a halted comm.
#[inline(never)]
fn still_recovering<S: Side>(s: &mut S) -> Result<bool> {
    progress(s, By::Nccl)?;
    Ok(s.link().halted())
}

/// Who moves a recovery on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum By {
    /// One of NCCL's calls on the comm: NCCL waits on it (a request
    /// pending, or an isend the comm cannot take yet), so the window counts
    /// in full ([`crate::proto::recover::Recovery::observe`]).
    Nccl,
    /// The keeper ([`super::keeper`]), for a comm NCCL has not called for a
    /// while: the window goes on as NCCL's silence has it.
    Keeper,
}

/// Move a comm's recovery on as far as it goes now. `Err`: the comm failed.
pub(super) fn progress<S: Side>(s: &mut S, by: By) -> Result<()> {
    if let Some(e) = &s.link().failed {
        return Err(e.clone());
    }
    for _ in 0..16 {
        s.link().pump()?;
        let now = Instant::now();
        let link = s.link();
        let Some(r) = link.rec.as_mut() else { return Ok(()) };
        if by == By::Nccl {
            r.m.observe(now);
            // (the keeper reads it: a comm NCCL calls is left to NCCL)
            r.nccl_calls = r.nccl_calls.wrapping_add(1);
        } else {
            r.m.unattended(now);
        }
        match r.m.step(now) {
            Do::Wait => return Ok(()),
            Do::Halt(msg) => {
                r.halted_at = now;
                r.peer_flush = None;
                r.forced = false;
                // (receive queues whose flush was read before this step, the
                // stop's or an earlier epoch's on these same QPs: nothing more
                // comes from them; the bits are cleared when QPs are replaced)
                r.rq_flushed |= std::mem::take(&mut r.pre_flushed);
                r.quiet = false;
                r.new_qps.clear();
                r.new_cq = None;
                r.port_wait.clear();
                r.neigh_since = None;
                r.neigh_kicked = false;
                r.send(&msg);
                link.stop_qps();
                let up = link.dev.port_attr().is_ok_and(|p| p.state == super::ffi::IBV_PORT_ACTIVE);
                let r = link.rec_mut()?;
                r.port_up = up;
                link.step_done(if up { "QPs stopped, port ACTIVE" } else { "QPs stopped, port down" });
                s.halt_extra();
            }
            Do::Drain => {
                s.drain();
                let receiver = s.receiver();
                let s_empty = s.nothing_posted();
                let link = s.link();
                let nq = link.qps.len();
                let r = link.rec_mut()?;
                let since = now.saturating_duration_since(r.halted_at);
                let done = if receiver {
                    r.rq_flushed & lanes_mask(nq) == lanes_mask(nq) || (r.quiet && s_empty)
                } else {
                    r.quiet && since >= DRAIN_MIN
                };
                if done || since >= DRAIN_MAX {
                    if !done {
                        tracing::warn!(
                            "{}: comm to {}: the stopped QPs' queues were not all flushed after {DRAIN_MAX:?}; going on",
                            link.dev.name,
                            link.peer_name()
                        );
                    }
                    let r = link.rec_mut()?;
                    r.m.drained();
                    link.step_done("drained");
                } else {
                    return Ok(());
                }
            }
            Do::QueryPort => {
                if now < r.next_query {
                    return Ok(());
                }
                r.next_query = now + PORT_POLL;
                // (iWARP: rdma_cm needs the device's interface running with
                // its address; soft-iWARP calls the port ACTIVE while its
                // netdev is admin up, carrier or not)
                let got = handshake::local_addr(&link.dev, &link.cc).and_then(|l| {
                    if link.cc.notices {
                        super::notice_path::device_ip(&link.dev).map(|_| l)
                    } else {
                        Ok(l)
                    }
                });
                match got {
                    Ok(l) => {
                        let seen = link.dev.health.port_events(link.dev.port);
                        let r = link.rec_mut()?;
                        r.local = Some(l);
                        r.port_up = true;
                        // the flap this recovery rides out is handled: no second one for its PORT_ACTIVE
                        r.port_seen = seen;
                        r.went_down = false;
                        r.m.port_active();
                        link.step_done("port ACTIVE, address read");
                    }
                    Err(e) => {
                        // what the port or its address table still lacks (once per change)
                        let why = e.to_string();
                        let (first, window_s) = (r.port_wait.is_empty(), r.window_s);
                        if first {
                            if let Some((name, i)) = &link.member_of {
                                // (once per episode: port_wait is cleared at each stop)
                                tracing::warn!(
                                    "{}: comm to {}: this port is member {i} of merged device {name}, and its share of every message on the comm \
                                     waits for it: librustnet does not move a member's traffic to the other members yet. The comm goes on when \
                                     the port is back, or fails after RUSTNET_RECOVERY_TIMEOUT={} s (raise it to wait longer)",
                                    link.dev.name,
                                    link.peer_name(),
                                    window_s
                                );
                            }
                        }
                        let Some(r) = link.rec.as_mut() else { return Err(link.fail_with(no_rec())) };
                        if r.port_wait != why {
                            r.port_wait = why;
                            link.step_done(&format!("waiting for the port: {}", link.rec.as_ref().map_or("", |r| r.port_wait.as_str())));
                        }
                        return Ok(());
                    }
                }
            }
            Do::Rebuild { epoch } => {
                let point = s.point();
                let sender = !s.receiver();
                let link = s.link();
                let r = link.rec_mut()?;
                let Some(local) = r.local else { return Err(link.fail_with(Error::Internal("rebuild before the port came back".into()))) };
                let plan = r.plan;
                let access = handshake::qp_access(&link.cc, sender);
                let cq = match Cq::new(&link.dev.ctx, plan.cqe() as i32) {
                    Ok(c) => c,
                    Err(e) => return Err(link.fail_with(e)),
                };
                let mut qps = Vec::with_capacity(link.qps.len());
                for i in 0..link.qps.len() {
                    match Qp::create(&link.dev.pd, &cq, plan.qp(i), link.dev.port, link.cc.pkey, access) {
                        Ok(q) => qps.push(q),
                        Err(e) => return Err(link.fail_with(e)),
                    }
                }
                let mut addr = QpAddr {
                    nqps: qps.len(),
                    gid: local.gid,
                    gid_index: local.gid_index,
                    lid: local.lid,
                    mtu: local.mtu,
                    ..QpAddr::default()
                };
                for (a, q) in addr.qpns.iter_mut().zip(&qps) {
                    *a = q.qpn();
                }
                let qpns: Vec<u32> = qps.iter().map(|q| q.qpn()).collect();
                let r = link.rec_mut()?;
                r.new_qps = qps;
                r.new_cq = Some(cq);
                // iWARP: the receiver's new rdma_cm listener, where the
                // sender dials (its address travels as the GID and LID, as
                // in the connection metadata)
                match s.restart_cm(qpns) {
                    Ok(Some(at)) => {
                        addr.gid = super::notice_path::gid_of(at.ip());
                        addr.lid = at.port();
                    }
                    Ok(None) => {}
                    Err(e) => {
                        // (the link flapped again since the port looked ACTIVE:
                        // the next epoch tries again, within the window)
                        let link = s.link();
                        tracing::warn!(
                            "{}: comm to {}: opening the recovery's rdma_cm listener failed in epoch {epoch}: {e}; trying again",
                            link.dev.name,
                            link.peer_name()
                        );
                        let r = link.rec_mut()?;
                        r.retry_why = e.to_string();
                        r.m.fault(now);
                        continue;
                    }
                }
                let link = s.link();
                let r = link.rec_mut()?;
                r.send(&RcMsg::State { epoch, addr: Box::new(addr), point: Box::new(point) });
                r.m.rebuilt();
                link.step_done("new QPs made, State sent");
            }
            Do::Connect { epoch } => {
                let t = Instant::now();
                let tried = match s.connect_cm()? {
                    None => {
                        let link = s.link();
                        if !neigh_ready(link, now)? {
                            return Ok(());
                        }
                        connect(link)?
                    }
                    Some(Ok(false)) => return Ok(()),
                    Some(Ok(true)) => Ok(()),
                    Some(Err(e)) => Err(e),
                };
                let link = s.link();
                if let Err(e) = tried {
                    // try again from the stop, in the next epoch (the peer
                    // joins it at our Halt); RUSTNET_RECOVERY_TIMEOUT bounds the tries
                    let peer = link.peer_name();
                    // (a field borrow: link.dev is read while it is held)
                    let Some(r) = link.rec.as_mut() else { return Err(link.fail_with(no_rec())) };
                    tracing::warn!(
                        "{}: comm to {peer}: connecting the new QPs failed in recovery epoch {epoch}: {e}; trying again (the fabric may still be settling)",
                        link.dev.name
                    );
                    r.retry_why = e.to_string();
                    r.m.fault(now);
                    continue;
                }
                let took = t.elapsed();
                if took > Duration::from_millis(100) {
                    // RoCE: ibv_modify_qp to RTR resolves the peer's address
                    // (ARP/ND) in the kernel and blocks until it has it; after
                    // a link flap the neighbour entry is gone
                    link.step_done(&format!(
                        "moving the new QPs to RTS took {:.0} ms (RoCE: the kernel resolves the peer's address inside ibv_modify_qp; after a flap its neighbour entry is gone)",
                        took.as_secs_f64() * 1e3
                    ));
                }
                if let Err(e) = s.connected() {
                    return Err(s.link().fail_with(e));
                }
                let r = s.link().rec_mut()?;
                r.send(&RcMsg::Go { epoch });
                r.m.connected();
                s.link().step_done("connected to the peer's new QPs, Go sent");
            }
            Do::Resume => {
                let Some((_, point)) = r.m.peer() else { return Ok(()) };
                let point = *point;
                let took = now.saturating_duration_since(r.m.since().unwrap_or(r.halted_at));
                let halts = r.m.halts();
                // traffic flows from here: the machine's resends must go out
                r.m.resumed();
                // (until the new QPs complete something the window counts
                // while NCCL waits on the comm: Recovery::settled)
                if let Some(r) = s.link().rec.as_mut().filter(|_| by == By::Nccl) {
                    r.m.observe(now);
                }
                let bytes = match s.resume(&point) {
                    Ok(b) => b,
                    Err(e) => return Err(s.link().fail_with(e)),
                };
                let link = s.link();
                link.stats.recoveries.add(1);
                link.stats.replayed_bytes.add(bytes);
                link.stats.last_recovery_us.store(took.as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
                if by == By::Keeper {
                    link.stats.unattended.add(1);
                }
                tracing::warn!(
                    "{}: comm to {} recovered in {:.3} s ({} stop(s)): new QPs {:x?}, {bytes} byte(s) written again{}",
                    link.dev.name,
                    link.peer_name(),
                    took.as_secs_f64(),
                    halts,
                    link.qps.iter().map(|q| q.qpn()).collect::<Vec<_>>(),
                    if by == By::Keeper { " (by the keeper thread: NCCL was not calling this comm)" } else { "" }
                );
            }
            Do::Fail { why, tell } => {
                if let Some(m) = tell {
                    r.send(&m);
                    let _ = link.pump();
                }
                let e = link.give_up(why);
                return Err(link.fail_with(e));
            }
        }
    }
    Ok(())
}

/// Most a recovery waits for the peer's neighbour entry before it connects
/// anyway (the kernel's own resolution inside `ibv_modify_qp` then runs).
const NEIGH_WAIT: Duration = Duration::from_millis(500);
/// How often it asks.
const NEIGH_POLL: Duration = Duration::from_millis(1);
/// How soon it tries again to send the datagram that starts the resolution.
const NEIGH_RETRY: Duration = Duration::from_millis(10);

/// RoCE: may the new QPs be connected now? `ibv_modify_qp` to RTR resolves
/// the peer's MAC in the kernel, and when the neighbour entry is not valid
/// (a flap flushes it) and the answer comes back before the kernel has put
/// its request on its wait list, that request sleeps a whole second
/// ([`super::neigh`]). So when the entry is not valid, make the kernel
/// resolve it (one empty datagram out of the GID's netdev) and wait, up to
/// [`NEIGH_WAIT`], until it is. InfiniBand, a link-local GID (the MAC is in
/// the GID), a netdev this namespace does not see or a kernel that cannot
/// answer: nothing to wait for.
fn neigh_ready(link: &mut Link, now: Instant) -> Result<bool> {
    let eth = link.dev.link_layer == LINK_ETH;
    let r = link.rec_mut()?;
    let (Some((peer, _)), Some(local)) = (r.m.peer(), r.local) else { return Ok(true) };
    if !eth || local.ifindex == 0 || super::gid::is_link_local(&peer.gid) || super::gid::is_link_local(&local.gid) || peer.gid == local.gid
    {
        return Ok(true);
    }
    if now < r.neigh_next {
        return Ok(false);
    }
    let (src, dst) = (super::gid::ip_of(&local.gid), super::gid::ip_of(&peer.gid));
    let since = *r.neigh_since.get_or_insert(now);
    let waited = now.saturating_duration_since(since);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    match super::neigh::lookup(dst, local.ifindex) {
        super::neigh::Neigh::Valid => {
            r.neigh_since = None;
            if std::mem::take(&mut r.neigh_kicked) {
                link.step_done(&format!("the kernel resolved {dst} after {:.1} ms", ms(waited)));
            }
            Ok(true)
        }
        super::neigh::Neigh::Unknown(why) => {
            r.neigh_since = None;
            tracing::debug!("{}: neighbour entry of {dst} not checked: {why}", link.dev.name);
            Ok(true)
        }
        super::neigh::Neigh::NotYet(state) => {
            if r.neigh_kicked && state != super::neigh::INCOMPLETE {
                // the datagram started no resolution: the kernel reaches
                // this peer without a neighbour entry here (a loopback)
                r.neigh_since = None;
                r.neigh_kicked = false;
                tracing::debug!("{}: {dst} needs no neighbour entry here (it stays {state}): nothing to wait for", link.dev.name);
                return Ok(true);
            }
            if waited >= NEIGH_WAIT {
                r.neigh_since = None;
                r.neigh_kicked = false;
                link.step_done(&format!(
                    "{dst} still not resolved after {:.0} ms (neighbour entry {state}); connecting anyway",
                    ms(waited)
                ));
                return Ok(true);
            }
            if !r.neigh_kicked {
                if let Err(e) = super::neigh::kick(src, dst, local.ifindex) {
                    // not sent (no route out of the netdev yet, just after
                    // link-up): again shortly, within NEIGH_WAIT
                    r.neigh_next = now + NEIGH_RETRY;
                    tracing::debug!("{}: could not make the kernel resolve {dst} yet: {e}", link.dev.name);
                    return Ok(false);
                }
                r.neigh_kicked = true;
                link.step_done(&format!("the peer's neighbour entry ({dst}) is {state}: resolving it before moving the new QPs to RTR"));
                // (asked again at once: the kick starts a resolution, or none, before it returns)
                return Ok(false);
            }
            if let Some(r) = link.rec.as_mut() {
                r.neigh_next = now + NEIGH_POLL;
            }
            Ok(false)
        }
    }
}

/// Bring the new QPs to RTS toward the peer's (its State), and make them the
/// comm's. `Err`: the comm failed (the peer broke the protocol); `Ok(Err)`:
/// moving the QPs failed, which a fabric that is still settling explains
/// (RoCE resolves the peer's address inside `ibv_modify_qp`, and a route or
/// neighbour missing just after a link comes back fails it): the caller
/// starts the next epoch instead of failing the comm.
fn connect(link: &mut Link) -> Result<std::result::Result<(), Error>> {
    let peer = link.peer_state()?;
    let r = link.rec_mut()?;
    let Some(local) = r.local else {
        return Err(link.fail_with(Error::Internal("connect before the port came back".into())));
    };
    let (tc, sl) = (r.rtr_tc, r.rtr_sl);
    let news = std::mem::take(&mut r.new_qps);
    let rts = RtsParams { timeout: link.cc.timeout, retry_cnt: link.cc.retry_cnt };
    let global = link.dev.link_layer == LINK_ETH || local.gid[..8] != peer.gid[..8];
    let mut qps = Vec::with_capacity(news.len());
    for (i, q) in news.into_iter().enumerate() {
        let p = RtrParams {
            dest_qpn: peer.qpns[i],
            mtu: local.mtu.min(peer.mtu).max(1) as u32,
            port: link.dev.port,
            global,
            dgid: peer.gid,
            sgid_index: local.gid_index,
            dlid: peer.lid,
            tc,
            sl,
        };
        match q.to_rtr(&p).and_then(|q| q.to_rts(&rts)) {
            Ok(q) => qps.push(q),
            // (the new QPs of this epoch are dropped: destroyed)
            Err(e) => return Ok(Err(e)),
        }
    }
    if link.peer_gid != peer.gid || link.local_gid != local.gid {
        tracing::warn!(
            "{}: comm to {}: GIDs after the fault: ours {}, the peer's {}",
            link.dev.name,
            link.peer_name(),
            super::gid::show(&local.gid),
            super::gid::show(&peer.gid)
        );
    }
    // the old QPs go first (destroyed), then their CQ with whatever it still held
    link.qps = qps;
    link.qps_replaced();
    if let Some(cq) = link.rec.as_mut().and_then(|r| r.new_cq.take()) {
        link.cq = cq;
    }
    link.peer_qpns = peer.qpns[..peer.nqps].to_vec();
    link.peer_gid = peer.gid;
    link.local_gid = local.gid;
    Ok(Ok(()))
}

// ---------------------------------------------------------------- the keeper's look

impl Link {
    /// What the keeper compares to tell whether NCCL calls the comm: its
    /// CQ polls (every `test` of an unfinished request makes one) and its
    /// recovery steps made in NCCL's calls. Read under the comm's lock.
    pub(super) fn calls(&self) -> u64 {
        self.stats.work.polls.get().wrapping_add(self.rec.as_ref().map_or(0, |r| r.nccl_calls))
    }
}

/// The keeper's look at one end (one rail) of a comm NCCL has left alone
/// for [`super::keeper::KEEP_IDLE`]: if a recovery message waits on its
/// out-of-band socket, or it recovers, move the recovery on as NCCL's call
/// would. Nothing else: its CQ is not read outside a recovery, and a socket
/// that only says "closed" is left to NCCL's next call (which may still
/// have completed requests to hand out before it reports the peer gone).
pub(super) fn keep<S: Side>(s: &mut S) -> Kept {
    let link = s.link();
    if link.handshake && link.failed.is_none() {
        // (its last bytes arrive on this socket, read by the handshake in
        // NCCL's call, which also decides whether the comm recovers)
        return Kept::Busy;
    }
    if link.failed.is_some() || link.rec.is_none() {
        return Kept::Done;
    }
    let was = link.halted();
    if !was {
        match link.oob.unread() {
            Ok(0) => return if link.oob.peer_closed().unwrap_or(true) { Kept::Done } else { Kept::Quiet },
            Ok(_) => {}
            Err(_) => return Kept::Done,
        }
    }
    let res = progress(s, By::Keeper);
    let link = s.link();
    if res.is_err() {
        // (the comm failed: its error waits for NCCL's next call)
        return Kept::Done;
    }
    if link.halted() {
        if !was {
            tracing::info!(
                "{}: comm to {}: NCCL has not called this comm for {} ms or more; the keeper thread moves its recovery on",
                link.dev.name,
                link.peer_name(),
                super::keeper::KEEP_IDLE.as_millis()
            );
        }
        Kept::Recovering
    } else {
        Kept::Quiet
    }
}

// ---------------------------------------------------------------- the two ends

impl Side for SendComm {
    fn link(&mut self) -> &mut Link {
        &mut self.io.link
    }
    fn drain(&mut self) {
        self.tx.poll(&mut self.io);
    }
    fn halt_extra(&mut self) {
        if let Some(n) = &mut self.io.notices {
            n.abandon();
        }
    }
    fn receiver(&self) -> bool {
        false
    }
    fn point(&self) -> Point {
        Point::Tx(self.tx.restart_point())
    }
    fn connect_cm(&mut self) -> Result<Option<std::result::Result<bool, Error>>> {
        let io = &mut self.io;
        let Some(nt) = io.notices.as_mut() else { return Ok(None) };
        let link = &mut io.link;
        if !nt.redialing() {
            let peer = link.peer_state()?;
            let dst = super::notice_path::addr_of(peer.gid, peer.lid);
            let qps = std::mem::take(&mut link.rec_mut()?.new_qps);
            if let Err(e) = nt.redial(&link.dev, &link.cc, qps, dst) {
                return Ok(Some(Err(e)));
            }
        }
        match nt.redial_progress() {
            Ok(None) => Ok(Some(Ok(false))),
            Ok(Some(qps)) => {
                // the old QPs go first (destroyed: their rdma_cm ids were
                // closed just before), then their CQ; the peer's new QP
                // numbers name the peer's end from now on (not before: an
                // old QP's late completion named the new peer QP)
                if let Some((peer, _)) = link.rec.as_ref().and_then(|r| r.m.peer()) {
                    link.peer_qpns = peer.qpns[..peer.nqps].to_vec();
                }
                link.qps = qps;
                link.qps_replaced();
                if let Some(cq) = link.rec.as_mut().and_then(|r| r.new_cq.take()) {
                    link.cq = cq;
                }
                Ok(Some(Ok(true)))
            }
            Err(e) => Ok(Some(Err(e))),
        }
    }
    fn connected(&mut self) -> Result<()> {
        Ok(())
    }
    fn resume(&mut self, peer: &Point) -> Result<u64> {
        let Point::Rx(p) = peer else {
            return Err(Error::Protocol { peer: self.io.link.peer_name(), what: "a send comm's restart point from the receiver".into() });
        };
        match self.tx.resume(&mut self.io, p) {
            Ok(r) => Ok(r.bytes),
            Err(f) => Err(self.io.link.fail_by(f, "send")),
        }
    }
}

impl Side for RecvComm {
    fn link(&mut self) -> &mut Link {
        &mut self.io.link
    }
    fn halt_extra(&mut self) {
        if let Some(f) = &self.io.flush {
            let _ = f.qp.set_error();
        }
    }
    fn drain(&mut self) {
        self.rx.poll(&mut self.io);
    }
    fn receiver(&self) -> bool {
        true
    }
    fn nothing_posted(&self) -> bool {
        self.io.notices.as_ref().is_some_and(|n| !n.is_up())
    }
    fn point(&self) -> Point {
        Point::Rx(self.rx.restart_point())
    }
    fn restart_cm(&mut self, qpns: Vec<u32>) -> Result<Option<std::net::SocketAddr>> {
        let io = &mut self.io;
        match io.notices.as_mut() {
            Some(n) => n.restart(&io.link.dev, qpns).map(Some),
            None => Ok(None),
        }
    }
    fn connect_cm(&mut self) -> Result<Option<std::result::Result<bool, Error>>> {
        let io = &mut self.io;
        let Some(nt) = io.notices.as_mut() else { return Ok(None) };
        let link = &mut io.link;
        if !link.rec_mut()?.new_qps.is_empty() {
            let peer = link.peer_state()?;
            let r = link.rec_mut()?;
            // The new QPs become the comm's now (the listener's accept names
            // them by number; nothing is posted on them while the comm is
            // halted, and their receives go up once connected). The old
            // QPs' rdma_cm ids were closed at the rebuild; the old QPs go
            // first, then their CQ.
            let qps = std::mem::take(&mut r.new_qps).into_iter().map(Qp::connected_by_cm).collect();
            let cq = r.new_cq.take();
            link.qps = qps;
            link.qps_replaced();
            if let Some(cq) = cq {
                link.cq = cq;
            }
            link.peer_qpns = peer.qpns[..peer.nqps].to_vec();
        }
        match nt.cm_ready(&link.qps) {
            Ok(up) => Ok(Some(Ok(up))),
            Err(e) => Ok(Some(Err(e))),
        }
    }
    fn connected(&mut self) -> Result<()> {
        let io = &mut self.io;
        if io.notices.is_some() {
            // (iWARP: every notice receive was posted when the connections came up)
            return Ok(());
        }
        for q in &io.link.qps {
            for _ in 0..RECV_WRS {
                q.post_recv_empty(WrId::Recv(0).encode())?;
            }
        }
        if io.flush.is_some() {
            let local = io.link.rec.as_ref().and_then(|r| r.local).unwrap_or(io.local);
            let f = Flush::new(&io.link.dev, &io.link.cq, &local, &io.link.cc)?;
            io.link.flush_qpn = Some(f.qp.qpn());
            io.flush = Some(f);
        }
        Ok(())
    }
    fn resume(&mut self, peer: &Point) -> Result<u64> {
        let Point::Tx(p) = peer else {
            return Err(Error::Protocol { peer: self.io.link.peer_name(), what: "a receive comm's restart point from the sender".into() });
        };
        match self.rx.resume(&mut self.io, p, |io, id| io.post_flush(id)) {
            Ok(()) => Ok(0),
            Err(f) => Err(self.io.link.fail_by(f, "receive")),
        }
    }
}
