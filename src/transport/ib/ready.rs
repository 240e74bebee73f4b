//! Building a verbs connection's comms, and the last steps of its handshake, run from the data
//! path because `connect` never waits for `accept` (README: the connect
//! protocol): the sender reads the receiver's metadata, connects its QPs
//! (by hand, or through rdma_cm on iWARP) and writes READY; the receiver
//! waits for READY (and on iWARP for its rdma_cm connections) before its
//! first CTS goes out. The steps before these are in `handshake.rs`
//! (the socket I/O and QP transitions) and `establish.rs` (connect/accept).
use std::net::SocketAddr;
use std::sync::Arc;

use super::caps::{self, Limits, Role, RECV_CTL_SQ, RECV_WRS};
use super::device::IbDev;
use super::handshake::{self, Brought, ConnCfg, LocalAddr, Setup, Toward};
use super::link::{Link, SendHs};
use super::notice_path::{CmConnect, NoticeTx, RecvSide};
use super::p2p::{EagerRing, EagerSend, Flush, RecvComm, RecvIo, SendComm, SendIo, RECV_POOL, SEND_SLOTS};
use super::recover::RecLink;
use super::verbs::{self, Access, Cq, HostRegion, Qp, Rts};
use crate::error::{Error, Result};
use crate::profiler::EventSlots;
use crate::proto::ib_meta::{Meta, FLAG_FENCE, FLAG_LATE_RING, FLAG_RECOVERY, META_LEN, READY};
use crate::proto::nic::WrId;
use crate::proto::{eager, rx, tx};
use crate::transport::sock::Socket;
use crate::transport::MAX_RECVS;

impl super::p2p::SendIo {
    /// Where this comm's QPs go: toward the receiver whose metadata is `remote`.
    fn toward<'a>(&'a self, remote: &'a Meta) -> Toward<'a> {
        Toward { dev: &self.link.dev, local: &self.local, remote, tc: self.tc, sl: self.sl, cc: &self.link.cc, peer: &self.link.peer }
    }
}

impl SendComm {
    /// Move the handshake on as far as the socket allows.
    pub(super) fn progress_handshake(&mut self) -> Result<()> {
        loop {
            let io = &mut self.io;
            match &mut io.hs {
                None => return Ok(()),
                Some(SendHs::ReadMeta { rx, got, since, .. }) => {
                    if !handshake::read_some(&io.link.oob, &mut rx[..], got, &io.link.peer, "the receiver's connection metadata")? {
                        return handshake::within_connect_timeout(*since, &io.link.cc, &io.link.peer);
                    }
                    let remote = Meta::decode(rx).map_err(|w| Error::Protocol { peer: io.link.peer.to_string(), what: w.to_string() })?;
                    let Some(SendHs::ReadMeta { qps, since, .. }) = io.hs.take() else { unreachable!() };
                    if io.link.cc.notices {
                        let cm = CmConnect::start(&io.link.dev, &io.link.cc, qps, &remote, &io.link.peer, since)?;
                        io.hs = Some(SendHs::Cm { cm: Box::new(cm), remote: Box::new(remote) });
                        continue;
                    }
                    let to = io.toward(&remote);
                    match handshake::connect_qps(&to, qps)? {
                        Brought::Up(qps) => self.connected(qps, &remote)?,
                        // (the receiver has our QPs' numbers: the same QPs go on)
                        Brought::Later(b) => io.hs = Some(SendHs::Rtr { b, remote: Box::new(remote), since }),
                    }
                }
                Some(SendHs::Rtr { b, since, .. }) => {
                    if !handshake::retry_bringup(&io.link.dev, &io.link.cc, b, *since, &io.link.peer)? {
                        return Ok(());
                    }
                    let Some(SendHs::Rtr { b, remote, since }) = io.hs.take() else { unreachable!() };
                    handshake::settle_neighbour(&io.link.dev, &io.local, &remote);
                    let to = io.toward(&remote);
                    match handshake::bring_up(&to, b)? {
                        Brought::Up(qps) => {
                            tracing::info!("{}: send comm to {}: QPs connected after the link came back", io.link.dev.name, io.link.peer);
                            self.connected(qps, &remote)?
                        }
                        Brought::Later(b) => io.hs = Some(SendHs::Rtr { b, remote, since }),
                    }
                }
                Some(SendHs::Cm { cm, .. }) => {
                    let Some((qps, conns)) = cm.progress()? else { return Ok(()) };
                    let dial = cm.dial();
                    let Some(SendHs::Cm { remote, .. }) = io.hs.take() else { unreachable!() };
                    let max_inline = qps.iter().map(|q| q.max_inline()).min().unwrap_or(0);
                    // the delivery fence where the receiver answers it
                    let fence = if io.link.cc.fence && remote.flags & FLAG_FENCE != 0 {
                        Some((io.link.dev.ctl.region(64, Access::LOCAL_WRITE)?, (remote.addr, remote.rkey)))
                    } else {
                        if io.link.cc.fence {
                            static SAID: std::sync::Once = std::sync::Once::new();
                            SAID.call_once(|| {
                                tracing::info!(
                                    "{}: the receiver {} runs a build without the iWARP delivery fence: its sends complete once the NIC took them, so a fault with a message in flight may fail such a comm (said once per process)",
                                    io.link.dev.name,
                                    io.link.peer_name()
                                )
                            });
                        }
                        None
                    };
                    io.notices = Some(NoticeTx::new(&io.link.dev.pd, qps.len(), max_inline, conns, dial, fence)?);
                    self.connected(qps, &remote)?;
                }
                Some(SendHs::WriteReady { sent }) => {
                    if !handshake::write_some(&io.link.oob, &READY, sent, &io.link.peer, "READY")? {
                        return Ok(());
                    }
                    io.hs = None;
                    io.link.handshake = false;
                    let ours: Vec<u32> = io.link.qps.iter().map(|q| q.qpn()).collect();
                    tracing::debug!(
                        "{}: send comm to {} ready, QPs {ours:x?} -> {:x?}",
                        io.link.dev.name,
                        io.link.peer_name(),
                        io.link.peer_qpns
                    );
                    return Ok(());
                }
            }
        }
    }

    /// Our QPs are connected (by hand, or by rdma_cm on iWARP): the comm
    /// takes them and the receiver's parameters; READY goes out next.
    fn connected(&mut self, qps: Vec<Qp<Rts>>, remote: &Meta) -> Result<()> {
        let io = &mut self.io;
        io.link.qps = qps;
        io.link.init_stats();
        io.link.ev = EventSlots::new(SEND_SLOTS, io.link.qps.len());
        io.link.set_peer(remote);
        io.remote_sizes = (remote.addr, remote.rkey);
        let mut limit = 0;
        // the receiver's ring: given now (a build before late rings, or
        // RUSTNET_IB_EAGER_LAZY=0 there), or announced on our first request
        let late = remote.ring.0 == 0 && remote.flags & FLAG_LATE_RING != 0 && io.link.cc.eager_lazy;
        if remote.eager > 0 && remote.eager <= io.eager_offer && remote.ring.0 != 0 {
            limit = remote.eager as usize;
            io.eager = Some(EagerSend {
                stage: HostRegion::new(&io.link.dev.pd, eager::ring_bytes(limit), Access::LOCAL_READ)?,
                ring: remote.ring,
            });
        } else if remote.eager > 0 && remote.eager <= io.eager_offer && late {
            limit = remote.eager as usize;
        } else if remote.eager > 0 {
            return Err(Error::Protocol {
                peer: io.link.peer_name(),
                what: format!("receiver agreed to an eager limit of {} bytes; we offered {}", remote.eager, io.eager_offer),
            });
        }
        let cfg = tx::Config {
            nqps: io.link.qps.len(),
            split: io.link.cc.split,
            eager: limit,
            mailbox_after: tx::MAILBOX_AFTER,
            late_ring: late,
        };
        self.tx.connected(cfg);
        if io.link.cc.meta_flags() & remote.flags & FLAG_RECOVERY != 0 {
            let seen = io.link.dev.health.port_events(io.link.dev.port);
            io.link.rec = Some(Box::new(RecLink::new(io.link.cc.recovery_s, io.plan, io.tc, io.sl, seen)));
            // (best effort: recovery messages go soon after a link's return either way)
            let _ = io.link.oob.set_thin_linear_timeouts();
            // the out-of-band connection outlives a cut as long as the window
            // (a dead peer's process still closes it at once)
            let _ = io.link.oob.keepalive_within(i64::from(io.link.cc.recovery_s).max(io.link.cc.stream.timeout_s));
        } else {
            // (the handshake may have widened it: a comm that does not recover finds a dead peer as before)
            let _ = io.link.oob.keepalive_within(io.link.cc.stream.timeout_s);
        }
        io.hs = Some(SendHs::WriteReady { sent: 0 });
        Ok(())
    }
}

impl RecvComm {
    /// Wait for READY (and on iWARP our side of the rdma_cm connections,
    /// notice receives posted); then the deferred CTS go out.
    pub(super) fn progress_ready(&mut self) -> Result<()> {
        let io = &mut self.io;
        if io.ready.is_none() {
            return Ok(());
        }
        let cm_up = match &mut io.notices {
            Some(n) => n.cm_ready(&io.link.qps)?,
            None => true,
        };
        let Some((buf, got)) = &mut io.ready else { return Ok(()) };
        if !handshake::read_some(&io.link.oob, &mut buf[..], got, &io.link.peer, "READY")? {
            return Ok(());
        }
        if *buf != READY {
            return Err(Error::Protocol { peer: io.link.peer_name(), what: format!("expected READY, got {buf:02x?}") });
        }
        if !cm_up {
            return Ok(());
        }
        io.ready = None;
        io.link.handshake = false;
        self.rx.handshake_done(&mut self.io).map_err(|f| self.io.link.fail_by(f, "receive"))
    }
}

/// How many bytes a data or eager write may carry inline: the QPs' cap,
/// but only with NCCL_IB_USE_INLINE=1. On iWARP the QPs take 64 bytes
/// inline whatever the knob says, for the notices alone (NoticeTx reads the
/// QPs' own cap); NCCL_IB_USE_INLINE=0 still keeps data off the inline path.
pub(super) fn data_inline(use_inline: bool, qp_max_inline: u32) -> u32 {
    if use_inline {
        qp_max_inline
    } else {
        0
    }
}

impl SendComm {
    pub(super) fn new(setup: Setup, oob: Socket, peer: SocketAddr, cc: Arc<ConnCfg>, tc: u8, sl: u8) -> SendComm {
        let Setup { dev, cq, qps, local, region, stage, eager: eager_offer, plan, .. } = setup;
        let mut link = Link::new(&dev, cq, cc, oob, peer);
        link.local_gid = local.gid;
        link.max_inline = data_inline(link.cc.use_inline, qps.iter().map(|q| q.max_inline()).min().unwrap_or(0));
        let io = SendIo {
            link,
            hs: Some(SendHs::ReadMeta { qps, rx: Box::new([0; META_LEN]), got: 0, since: std::time::Instant::now() }),
            fifo_mem: region,
            stage,
            local,
            tc,
            sl,
            remote_sizes: (0, 0),
            eager_offer,
            eager: None,
            cur: None,
            notices: None,
            plan,
        };
        SendComm { io, tx: tx::Sender::new() }
    }
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
        let Setup { dev, cq, local, region, stage, eager: offer, late_ok, plan, .. } = setup;
        let mut link = Link::new(&dev, cq, cc, oob, peer);
        link.local_gid = local.gid;
        if link.cc.meta_flags() & remote.flags & FLAG_RECOVERY != 0 {
            let tc = handshake::receiver_tc(&link.cc, dev.link_layer, remote.tc);
            link.rec = Some(Box::new(RecLink::new(link.cc.recovery_s, plan, tc, remote.sl, dev.health.port_events(dev.port))));
            let _ = link.oob.set_thin_linear_timeouts();
            let _ = link.oob.keepalive_within(i64::from(link.cc.recovery_s).max(link.cc.stream.timeout_s));
        } else {
            // (the handshake may have widened it: a comm that does not recover finds a dead peer as before)
            let _ = link.oob.keepalive_within(link.cc.stream.timeout_s);
        }
        // control writes all go on QP 0 (the only one that asks for inline room)
        link.max_inline = qps.first().map_or(0, |q| q.max_inline());
        let nq = qps.len();
        for q in qps.iter().filter(|_| notices.is_none()) {
            for _ in 0..RECV_WRS {
                q.post_recv_empty(WrId::Recv(0).encode())?;
            }
        }
        link.qps = qps;
        link.init_stats();
        // events: one per receive buffer per QP (index buffer * nq + QP)
        link.ev = EventSlots::new(RECV_POOL, MAX_RECVS * nq);
        link.set_peer(remote);
        let flush = if link.cc.flush { Some(Flush::new(&dev, &link.cq, &local, &link.cc)?) } else { None };
        link.flush_qpn = flush.as_ref().map(|f| f.qp.qpn());
        let limit = offer.min(remote.eager) as usize;
        // a sender that takes a late ring gets none now: it asks when it first needs it
        let late_ring = limit > 0 && late_ok && remote.flags & FLAG_LATE_RING != 0;
        let eager = if limit > 0 && !late_ring {
            Some(EagerRing { ring: HostRegion::new(&dev.pd, eager::ring_bytes(limit), Access::REMOTE_WRITE)? })
        } else {
            None
        };
        let rx = rx::Receiver::new(rx::Config { nqps: nq, split: link.cc.split, eager: limit, sq_depth: RECV_CTL_SQ, late_ring });
        let io = RecvIo {
            link,
            flush,
            ready: Some(([0; 8], 0)),
            sizes_mem: region,
            stage,
            local,
            remote_fifo: (remote.addr, remote.rkey),
            eager,
            late_ring,
            notices,
            flush_at: Box::new([(0, 0); RECV_POOL]),
        };
        Ok(RecvComm { io, rx })
    }

    /// What we tell the sender.
    pub(super) fn local_meta(&self) -> Meta {
        let io = &self.io;
        let mut m = Meta {
            qpns: self.qpns(),
            mtu: io.local.mtu,
            link: io.link.dev.link_layer,
            port: io.link.dev.port,
            gid_index: io.local.gid_index,
            lid: io.local.lid,
            tc: 0,
            sl: 0,
            split: io.link.cc.split,
            gid: io.local.gid,
            family: io.local.family,
            roce_version: io.local.roce_version,
            addr: io.sizes_mem.addr() as u64,
            rkey: io.sizes_mem.rkey(),
            name: io.link.dev.dev_name.clone(),
            eager: self.rx.eager_limit() as u32,
            ring: io.eager.as_ref().map_or((0, 0), |e| (e.ring.addr() as u64, e.ring.rkey())),
            flags: io.link.cc.meta_flags() | if io.late_ring { FLAG_LATE_RING } else { 0 },
            secret: 0,
        };
        if let Some(n) = &io.notices {
            n.fill_meta(&mut m);
        }
        m
    }

    pub(super) fn oob(&self) -> &Socket {
        &self.io.link.oob
    }
}

impl Flush {
    pub(super) fn new(dev: &Arc<IbDev>, cq: &Cq, local: &LocalAddr, cc: &ConnCfg) -> Result<Flush> {
        let caps = caps::qp_caps(Role::Flush, 0, &cc.shape(false), Limits::new(dev.max_qp_wr, dev.max_cqe));
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
        Ok(Flush { qp, scratch: dev.ctl.region(64, Access::LOCAL_WRITE)? })
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
}
