//! TCP's listen, connect and accept: the socket set-up of
//! [`crate::transport::oob`] (shared with the verbs out-of-band exchange)
//! with `HandleKind::Tcp`, finished as TCP comms.
use std::net::SocketAddr;

use super::p2p::{RecvComm, SendComm};
use super::StreamCfg;
use crate::error::Result;
use crate::proto::handle::{Handle, HandleKind};
use crate::transport::oob::{Connector, Listener};

/// A TCP listening endpoint (the strangers' rules are [`Listener`]'s).
pub struct TcpListen {
    inner: Listener,
    cfg: StreamCfg,
}

impl TcpListen {
    /// Listen on `local` (port 0); returns the endpoint and its handle.
    pub fn new(local: SocketAddr, cfg: StreamCfg) -> Result<(TcpListen, Handle)> {
        let (inner, h) = Listener::new(local, HandleKind::Tcp, cfg.oob())?;
        Ok((TcpListen { inner, cfg }, h))
    }

    /// Accepted data sockets (and this one's SYN-ACKs) carry `tos` as their
    /// IP TOS / IPv6 traffic class byte: the listening context's class.
    pub fn with_tos(self, tos: Option<u8>) -> Result<TcpListen> {
        Ok(TcpListen { inner: self.inner.with_tos(tos)?, cfg: self.cfg })
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr()
    }

    /// Accept a full TCP data connection; `Ok(None)` until one has all its streams.
    pub fn accept(&mut self) -> Result<Option<RecvComm>> {
        Ok(self.inner.accept_streams()?.map(|(socks, peer)| RecvComm::new(socks, peer, self.cfg)))
    }
}

/// An outgoing TCP connection in progress.
pub struct TcpConnecting {
    inner: Connector,
    cfg: StreamCfg,
}

impl TcpConnecting {
    /// Open `cfg.nstreams` sockets to the listener in `h`, every stream
    /// carrying `tos` as its IP TOS / IPv6 traffic class byte (the
    /// communicator's traffic class), from the SYN on.
    pub fn start(h: &Handle, cfg: StreamCfg, tos: Option<u8>) -> Result<TcpConnecting> {
        Ok(TcpConnecting { inner: Connector::start_tos(h, cfg.nstreams, cfg.oob(), tos)?, cfg })
    }

    /// Advance; `Ok(true)` once the listener accepted every stream.
    pub fn progress(&mut self) -> Result<bool> {
        self.inner.progress()
    }

    /// Finish as a TCP send comm.
    pub fn into_send_comm(self) -> SendComm {
        let (socks, peer) = self.inner.into_streams();
        SendComm::new(socks, peer, self.cfg)
    }
}
