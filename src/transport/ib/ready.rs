//! The last steps of a verbs connection's handshake, run from the data
//! path because `connect` never waits for `accept` (README: the connect
//! protocol): the sender reads the receiver's metadata, connects its QPs
//! (by hand, or through rdma_cm on iWARP) and writes READY; the receiver
//! waits for READY (and on iWARP for its rdma_cm connections) before its
//! first CTS goes out. The steps before these are in `handshake.rs`
//! (the socket I/O and QP transitions) and `establish.rs` (connect/accept).
use super::handshake;
use super::link::SendHs;
use super::notice_path::{CmConnect, NoticeTx};
use super::p2p::{EagerSend, RecvComm, SendComm, SEND_SLOTS};
use super::verbs::{Access, HostRegion, Qp, Rts};
use crate::error::{Error, Result};
use crate::profiler::EventSlots;
use crate::proto::eager;
use crate::proto::ib_meta::{Meta, READY};
use crate::proto::tx;

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
                    let qps = handshake::connect_qps(&io.link.dev, &io.local, qps, &remote, io.tc, io.sl, &io.link.cc)?;
                    self.connected(qps, &remote)?;
                }
                Some(SendHs::Cm { cm, .. }) => {
                    let Some((qps, conns)) = cm.progress()? else { return Ok(()) };
                    let Some(SendHs::Cm { remote, .. }) = io.hs.take() else { unreachable!() };
                    let max_inline = qps.iter().map(|q| q.max_inline()).min().unwrap_or(0);
                    io.notices = Some(NoticeTx::new(&io.link.dev.pd, qps.len(), max_inline, conns)?);
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
        if remote.eager > 0 && remote.eager <= io.eager_offer && remote.ring.0 != 0 {
            limit = remote.eager as usize;
            io.eager = Some(EagerSend {
                stage: HostRegion::new(&io.link.dev.pd, eager::ring_bytes(limit), Access::LOCAL_READ)?,
                ring: remote.ring,
            });
        } else if remote.eager > 0 {
            return Err(Error::Protocol {
                peer: io.link.peer_name(),
                what: format!("receiver agreed to an eager limit of {} bytes; we offered {}", remote.eager, io.eager_offer),
            });
        }
        self.tx.connected(tx::Config { nqps: io.link.qps.len(), split: io.link.cc.split, eager: limit, mailbox_after: tx::MAILBOX_AFTER });
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
