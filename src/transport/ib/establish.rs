//! The verbs transport's connect and accept: drive the out-of-band exchange
//! of [`handshake`] (its picture is there) over the socket listener and
//! connector both transports use ([`crate::transport::oob`], `HandleKind::Ib`), and build the comms of [`p2p`] from what
//! it established. The sender's last steps (the receiver's [`Meta`], RTR ->
//! RTS, READY) run inside its [`SendComm`]; the receiver's comm waits for
//! READY before it writes any CTS.
//!
//! [`p2p`]: super::p2p
use std::net::SocketAddr;
use std::sync::Arc;

use super::device::IbDev;
use super::handshake::{self, choose_tc_sl, read_some, write_some, ConnCfg, Setup};
use super::notice_path::{self, RecvSide};
use super::p2p::{RecvComm, SendComm};
use crate::error::{Error, Result};
use crate::proto::handle::{Handle, HandleKind};
use crate::proto::ib_meta::{Meta, META_LEN};
use crate::transport::oob::{Connector, Listener};
use crate::transport::sock::Socket;

// ---------------------------------------------------------------- connect

enum ConnStage {
    Tcp(Connector),
    /// Connected, but our port is not ACTIVE (a flap during connect): wait for it.
    WaitPort {
        sock: Socket,
        peer: SocketAddr,
        since: std::time::Instant,
    },
    Meta {
        sock: Socket,
        peer: SocketAddr,
        setup: Box<Setup>,
        tx: Box<[u8; META_LEN]>,
        sent: usize,
    },
    Gone,
}

/// An outgoing verbs connection in progress.
pub struct IbConnecting {
    dev: Arc<IbDev>,
    cc: Arc<ConnCfg>,
    tc: u8,
    sl: u8,
    st: ConnStage,
}

impl IbConnecting {
    /// Start connecting to the listener in `h` from `dev`.
    pub fn start(dev: &Arc<IbDev>, cc: &Arc<ConnCfg>, h: &Handle, comm_tc: Option<i32>) -> Result<IbConnecting> {
        if h.kind != HandleKind::Ib {
            return Err(Error::Usage(format!(
                "the peer listens with the {:?} transport but this process uses verbs: set the same RUSTNET_TRANSPORT on every rank",
                h.kind
            )));
        }
        let (tc, sl) = choose_tc_sl(cc, comm_tc);
        let tcp = Connector::start(h, 1, cc.stream)?;
        Ok(IbConnecting { dev: dev.clone(), cc: cc.clone(), tc, sl, st: ConnStage::Tcp(tcp) })
    }

    /// Advance; `Ok(true)` once our metadata is on its way (the rest of the
    /// handshake finishes inside the send comm).
    pub fn progress(&mut self) -> Result<bool> {
        loop {
            match &mut self.st {
                ConnStage::Tcp(c) => {
                    if !c.progress()? {
                        return Ok(false);
                    }
                    let ConnStage::Tcp(c) = std::mem::replace(&mut self.st, ConnStage::Gone) else { unreachable!() };
                    let (mut socks, peer) = c.into_streams();
                    let sock = socks.pop().ok_or_else(|| Error::Internal("connector returned no socket".into()))?;
                    handshake_keepalive(&sock, &self.cc);
                    self.st = ConnStage::WaitPort { sock, peer, since: std::time::Instant::now() };
                }
                ConnStage::WaitPort { since, .. } => {
                    if !port_ready(&self.dev, &self.cc, *since)? {
                        return Ok(false);
                    }
                    let ConnStage::WaitPort { sock, peer, .. } = std::mem::replace(&mut self.st, ConnStage::Gone) else { unreachable!() };
                    let setup = Box::new(Setup::new(&self.dev, &self.cc, true)?);
                    let mut meta = setup.meta(self.tc, self.sl, self.cc.split);
                    if self.dev.iwarp {
                        notice_path::declare_source(&self.dev, &mut meta);
                    }
                    let tx = Box::new(meta.encode());
                    self.st = ConnStage::Meta { sock, peer, setup, tx, sent: 0 };
                }
                ConnStage::Meta { sock, peer, tx, sent, .. } => return write_some(sock, &tx[..], sent, peer, "connection metadata"),
                ConnStage::Gone => return Err(Error::Internal("connect progressed after failing".into())),
            }
        }
    }

    /// The send comm (after `progress` returned true).
    pub fn into_send_comm(self) -> Result<SendComm> {
        match self.st {
            ConnStage::Meta { sock, peer, setup, .. } => Ok(SendComm::new(*setup, sock, peer, self.cc, self.tc, self.sl)),
            _ => Err(Error::Internal("into_send_comm before the connection metadata was sent".into())),
        }
    }
}

/// The out-of-band connection of a comm that can recover outlives a link cut
/// during the handshake too (where it shares the fabric's link, as in
/// the VM soak, an 8 s cut while connecting ended it after
/// RUSTNET_SOCKET_TIMEOUT): its keepalive gives up only after
/// RUSTNET_CONNECT_TIMEOUT, which bounds the handshake anyway. A peer
/// process that dies still closes it at once. After READY the comm sets
/// its own (recovery window, or RUSTNET_SOCKET_TIMEOUT again).
fn handshake_keepalive(sock: &Socket, cc: &ConnCfg) {
    if cc.recovery_s > 0 && !cc.notices {
        let _ = sock.keepalive_within(cc.stream.connect_timeout_s.max(cc.stream.timeout_s));
    }
}

/// Is `dev`'s port ACTIVE, so a connection can be set up on it now? A
/// port that is down (a link flap during connect) is waited for, with one
/// WARN, up to RUSTNET_CONNECT_TIMEOUT from `since`; then the error names it.
fn port_ready(dev: &IbDev, cc: &ConnCfg, since: std::time::Instant) -> Result<bool> {
    let pa = dev.port_attr()?;
    if pa.state == super::ffi::IBV_PORT_ACTIVE {
        return Ok(true);
    }
    let state = super::device::port_state_name(pa.state);
    let t = cc.stream.connect_timeout_s.max(1) as u64;
    if since.elapsed() >= std::time::Duration::from_secs(t) {
        return Err(Error::Usage(format!(
            "{} has been {state} for RUSTNET_CONNECT_TIMEOUT={t} s while connecting (it was ACTIVE at init): check the cable, the switch port and `rustnet doctor`",
            dev.describe()
        )));
    }
    if since.elapsed() < std::time::Duration::from_millis(1) {
        tracing::warn!("{} is {state} while connecting: waiting up to RUSTNET_CONNECT_TIMEOUT={t} s for it", dev.describe());
    }
    Ok(false)
}

// ---------------------------------------------------------------- listen / accept

enum Accepting {
    ReadMeta {
        sock: Socket,
        peer: SocketAddr,
        rx: Box<[u8; META_LEN]>,
        got: usize,
    },
    /// The sender's metadata is here, but our port is not ACTIVE (or the
    /// link went away inside the move of our new QPs to RTR: then not
    /// before `next`): wait for it.
    WaitPort {
        sock: Socket,
        peer: SocketAddr,
        remote: Box<Meta>,
        since: std::time::Instant,
        next: std::time::Instant,
    },
    SendMeta {
        comm: Box<RecvComm>,
        peer: SocketAddr,
        tx: Box<[u8; META_LEN]>,
        sent: usize,
    },
}

/// A verbs listening endpoint.
pub struct IbListen {
    tcp: Listener,
    dev: Arc<IbDev>,
    cc: Arc<ConnCfg>,
    pending: Vec<Accepting>,
}

impl IbListen {
    /// Listen for connections to `dev` on the out-of-band address `oob`.
    pub fn new(dev: &Arc<IbDev>, cc: &Arc<ConnCfg>, oob: SocketAddr) -> Result<(IbListen, Handle)> {
        let (tcp, h) = Listener::new(oob, HandleKind::Ib, cc.stream)?;
        Ok((IbListen { tcp, dev: dev.clone(), cc: cc.clone(), pending: Vec::new() }, h))
    }

    /// Accept; `Ok(None)` until one connection completed its side of the handshake.
    pub fn accept(&mut self) -> Result<Option<RecvComm>> {
        while let Some((mut socks, peer)) = self.tcp.accept_streams()? {
            if let Some(sock) = socks.pop() {
                handshake_keepalive(&sock, &self.cc);
                self.pending.push(Accepting::ReadMeta { sock, peer, rx: Box::new([0; META_LEN]), got: 0 });
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            match &mut self.pending[i] {
                Accepting::ReadMeta { sock, peer, rx, got } => {
                    // The hello carried our nonce: this is the rank NCCL
                    // told to connect here, so a failure now fails accept
                    // (dropping it would leave this rank waiting forever).
                    match read_some(sock, &mut rx[..], got, peer, "connection metadata") {
                        Ok(false) => {
                            i += 1;
                            continue;
                        }
                        Ok(true) => {}
                        Err(e) => {
                            self.pending.swap_remove(i);
                            return Err(e);
                        }
                    }
                    let remote = match Meta::decode(rx) {
                        Ok(m) => m,
                        Err(what) => {
                            let peer = peer.to_string();
                            self.pending.swap_remove(i);
                            return Err(Error::Protocol { peer, what: what.to_string() });
                        }
                    };
                    let Accepting::ReadMeta { sock, peer, .. } = self.pending.swap_remove(i) else { unreachable!() };
                    let now = std::time::Instant::now();
                    self.pending.push(Accepting::WaitPort { sock, peer, remote: Box::new(remote), since: now, next: now });
                }
                Accepting::WaitPort { next, .. } if std::time::Instant::now() < *next => i += 1,
                Accepting::WaitPort { since, .. } => match port_ready(&self.dev, &self.cc, *since) {
                    Ok(false) => i += 1,
                    Ok(true) => {
                        let Accepting::WaitPort { sock, peer, remote, since, .. } = self.pending.swap_remove(i) else { unreachable!() };
                        let comm = if self.dev.iwarp {
                            self.build_recv_iwarp(sock, peer, &remote)?
                        } else {
                            match handshake::receiver_qps(&self.dev, &self.cc, &sock, &peer, &remote)? {
                                Ok((setup, qps, cc)) => RecvComm::new(setup, qps, sock, peer, Arc::new(cc), &remote, None)?,
                                // the link went away inside the move to RTR
                                // (logged): new QPs once the port is back (the
                                // sender has not seen these), within RUSTNET_CONNECT_TIMEOUT
                                Err(e) => {
                                    let t = self.cc.stream.connect_timeout_s.max(1) as u64;
                                    if since.elapsed() >= std::time::Duration::from_secs(t) {
                                        return Err(Error::Remote {
                                            peer: peer.to_string(),
                                            what: format!(
                                                "{}: could not move the QPs to RTR within RUSTNET_CONNECT_TIMEOUT={t} s: the link went away while accepting, the last try failed: {e}",
                                                self.dev.describe()
                                            ),
                                        });
                                    }
                                    let next = std::time::Instant::now() + std::time::Duration::from_millis(50);
                                    self.pending.push(Accepting::WaitPort { sock, peer, remote, since, next });
                                    // (the one swapped into slot i is looked at next)
                                    continue;
                                }
                            }
                        };
                        let tx = Box::new(comm.local_meta().encode());
                        self.pending.push(Accepting::SendMeta { comm: Box::new(comm), peer, tx, sent: 0 });
                    }
                    Err(e) => {
                        self.pending.swap_remove(i);
                        return Err(e);
                    }
                },
                Accepting::SendMeta { comm, peer, tx, sent } => match write_some(comm.oob(), &tx[..], sent, peer, "connection metadata") {
                    Ok(false) => i += 1,
                    Ok(true) => {
                        let Accepting::SendMeta { comm, .. } = self.pending.swap_remove(i) else { unreachable!() };
                        return Ok(Some(*comm));
                    }
                    // like a failed read above: this connection is done, and
                    // leaving it queued would fail every later accept on it
                    Err(e) => {
                        self.pending.swap_remove(i);
                        return Err(e);
                    }
                },
            }
        }
        Ok(None)
    }

    /// iWARP: our QPs stay in INIT for rdma_cm, which connects them once the
    /// sender dials the listener our metadata names (the comm follows it
    /// and posts nothing before; see [`super::notice_path`]).
    fn build_recv_iwarp(&self, sock: Socket, peer: SocketAddr, remote: &Meta) -> Result<RecvComm> {
        handshake::check_peer_link(&self.dev, remote, &peer)?;
        let mut cc = (*self.cc).clone();
        cc.split = remote.split;
        let mut setup = Setup::new(&self.dev, &cc, false)?;
        if remote.qpns.len() != setup.qps.len() {
            return Err(Error::Usage(format!(
                "the peer uses {} QPs per connection and we use {}: set the same NCCL_IB_QPS_PER_CONNECTION on every rank",
                remote.qpns.len(),
                setup.qps.len()
            )));
        }
        let qps = std::mem::take(&mut setup.qps);
        let qpns = qps.iter().map(|q| q.qpn()).collect();
        let side = RecvSide::new(&self.dev, &cc, &self.dev.pd, qpns, setup.region.addr() as u64, &peer, remote)?;
        // not RTS yet: the comm posts no send before RecvSide::cm_ready says
        // rdma_cm established every connection (its READY gate)
        let qps = qps.into_iter().map(|q| q.connected_by_cm()).collect();
        RecvComm::new(setup, qps, sock, peer, Arc::new(cc), remote, Some(side))
    }
}
