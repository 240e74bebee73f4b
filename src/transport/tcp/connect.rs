//! TCP's listen, connect and accept: the socket set-up of
//! [`crate::transport::oob`] (shared with the verbs out-of-band exchange)
//! with `HandleKind::Tcp`, finished as TCP comms. With recovery on
//! (`RUSTNET_RECOVERY_TIMEOUT`), the connecting side draws the connection's
//! resume token and sends it in its hellos with its own resume port; the
//! listener's replies name the receiving process's resume port; an accepted
//! comm is registered there under its token ([`super::resume`]).
use std::net::SocketAddr;

use super::recv::{RecvComm, RecvResume};
use super::resume::{self, PortRef};
use super::send::{SendComm, SendResume};
use super::StreamCfg;
use crate::error::Result;
use crate::proto::handle::{Handle, HandleKind};
use crate::proto::resume::{HelloExt, Token};
use crate::transport::oob::{Connector, Listener};

/// A TCP listening endpoint (the strangers' rules are [`Listener`]'s).
pub struct TcpListen {
    inner: Listener,
    cfg: StreamCfg,
    tos: Option<u8>,
    /// This process's resume port at the listener's address (recovery on).
    port: Option<PortRef>,
}

impl TcpListen {
    /// Listen on `local` (port 0); returns the endpoint and its handle.
    pub fn new(local: SocketAddr, cfg: StreamCfg) -> Result<(TcpListen, Handle)> {
        let (inner, h) = Listener::new(local, HandleKind::Tcp, cfg.oob())?;
        let port = cfg.resume_port(h.addr)?;
        let inner = inner.with_resume_port(port.as_ref().map_or(0, |p| p.addr().port()));
        Ok((TcpListen { inner, cfg, tos: None, port }, h))
    }

    /// Accepted data sockets (and this one's SYN-ACKs) carry `tos` as their
    /// IP TOS / IPv6 traffic class byte: the listening context's class.
    pub fn with_tos(self, tos: Option<u8>) -> Result<TcpListen> {
        Ok(TcpListen { inner: self.inner.with_tos(tos)?, tos, ..self })
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr()
    }

    /// Accept a full TCP data connection; `Ok(None)` until one has all its streams.
    pub fn accept(&mut self) -> Result<Option<RecvComm>> {
        let Some(inc) = self.inner.accept_incoming()? else { return Ok(None) };
        let mut rs = None;
        if let (Some(p), Some(ext)) = (&self.port, inc.ext.filter(|e| e.token.is_set())) {
            // the comm holds the port open itself: NCCL closes this listener soon
            let port = self.cfg.resume_port(p.addr())?.expect("recovery is on");
            match resume::register(inc.conn_id, ext.token, inc.socks.len(), port) {
                Some(reg) => rs = Some(RecvResume { reg, probe: ext.probe, tos: self.tos }),
                None => tracing::warn!(
                    "TCP connection from {} reuses the id {:#x} of another open comm of this process: it runs without recovery",
                    inc.peer,
                    inc.conn_id
                ),
            }
        }
        Ok(Some(RecvComm::new(inc.socks, inc.peer, self.cfg, rs)))
    }
}

/// An outgoing TCP connection in progress.
pub struct TcpConnecting {
    inner: Connector,
    cfg: StreamCfg,
    tos: Option<u8>,
    token: Token,
    /// Our resume port, held for the comm (recovery on).
    port: Option<PortRef>,
    addr: SocketAddr,
}

impl TcpConnecting {
    /// Open `cfg.nstreams` sockets to the listener in `h`, every stream
    /// carrying `tos` as its IP TOS / IPv6 traffic class byte (the
    /// communicator's traffic class), from the SYN on. With recovery on,
    /// `local` is this rank's address for its own resume port.
    pub fn start(h: &Handle, cfg: StreamCfg, tos: Option<u8>, local: Option<SocketAddr>) -> Result<TcpConnecting> {
        let port = match local {
            Some(a) => cfg.resume_port(a)?,
            None => None,
        };
        let token = if port.is_some() { Token(crate::random::secret_128()) } else { Token::NONE };
        let ext = HelloExt { token, probe: port.as_ref().map(PortRef::addr) };
        let inner = Connector::start_ext(h, cfg.nstreams, cfg.oob(), tos, Some(ext))?;
        Ok(TcpConnecting { inner, cfg, tos, token, port, addr: h.addr })
    }

    /// Advance; `Ok(true)` once the listener accepted every stream.
    pub fn progress(&mut self) -> Result<bool> {
        self.inner.progress()
    }

    /// Finish as a TCP send comm (one that recovers when both ends offered it).
    pub fn into_send_comm(self) -> SendComm {
        let resume_port = self.inner.resume_port();
        let conn_id = self.inner.conn_id();
        let rs = (self.token.is_set() && resume_port != 0).then(|| {
            let mut addr = self.addr;
            addr.set_port(resume_port);
            SendResume { conn_id, token: self.token, addr, tos: self.tos, port: self.port }
        });
        let (socks, peer) = self.inner.into_streams();
        SendComm::new(socks, peer, self.cfg, rs)
    }
}
