//! TCP's listen, connect and accept: the socket set-up of
//! [`crate::transport::oob`] (shared with the verbs out-of-band exchange)
//! with `HandleKind::Tcp`, finished as TCP comms. With recovery on
//! (`RUSTNET_RECOVERY_TIMEOUT`), the connecting side draws the connection's
//! resume token and sends it in its hellos with its own resume port; the
//! listener's replies name the receiving process's resume port; an accepted
//! comm is registered there under its token ([`super::resume`]).
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::recv::{RecvComm, RecvResume};
use super::resume::{self, PortRef, SenderReg};
use super::send::{SendComm, SendResume};
use super::StreamCfg;
use crate::error::Result;
use crate::proto::handle::PROTO_VERSION;
use crate::proto::handle::{Handle, HandleKind};
use crate::proto::resume::{HelloExt, SenderQuery, Token, REPLY_QUEUED_OFFSETS};
use crate::transport::oob::{link_fault, Connector, Cut, Listener};

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
        let (inner, mut h) = Listener::new(local, HandleKind::Tcp, cfg.oob())?;
        let port = cfg.resume_port(h.addr)?;
        // named in every acceptance, and in the handle: a connector cut off
        // before our acceptance reached it reconnects there
        h.resume_port = port.as_ref().map_or(0, |p| p.addr().port());
        let flags = if port.is_some() && cfg.queued_offsets() { REPLY_QUEUED_OFFSETS } else { 0 };
        let inner = inner.with_resume_port(h.resume_port).with_reply_flags(flags);
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
            // where our offsets count what the streams hold unread, the port
            // knows their descriptors before it can answer for the comm
            let fds: Vec<std::os::fd::RawFd> = inc.socks.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
            let queued = self.cfg.queued_offsets();
            match resume::register(inc.conn_id, ext.token, inc.socks.len(), port, queued.then_some(&fds[..])) {
                Some(reg) => {
                    // a sender whose port answers is asked about its comm, not only its process
                    let query = ext.answers.then_some(SenderQuery { version: PROTO_VERSION, conn_id: inc.conn_id, token: ext.token });
                    // its sender completes on our kernel's acknowledgements
                    let kernel_acks = queued && ext.kernel_acks;
                    rs = Some(RecvResume { reg, probe: ext.probe, query, tos: self.tos, queued, kernel_acks })
                }
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
///
/// With recovery on, a link fault during set-up (a cut or reset stream, an
/// unreachable network while the link is down) does not fail the connect
/// while `RUSTNET_CONNECT_TIMEOUT` lasts:
/// - before every hello is written the listener cannot have accepted the
///   connection: it is dialled again from scratch (a new id), with back-off;
/// - after the hellos, with an acceptance unread, the listener may already
///   have accepted it: the connect finishes as a send comm that starts out
///   recovering through the listening process's resume port (named in the
///   handle), under the same id and token.
pub struct TcpConnecting {
    /// `None` between a cut attempt and the next dial.
    inner: Option<Connector>,
    handle: Handle,
    cfg: StreamCfg,
    tos: Option<u8>,
    token: Token,
    /// This dial's place in the registry of send comms (its receiver may
    /// ask about it), dropped before `port`.
    sreg: Option<SenderReg>,
    /// Our resume port, held for the comm (recovery on).
    port: Option<PortRef>,
    /// When the first dial started (the connect timeout counts from it).
    began: Instant,
    /// The next dial, after a cut one.
    redial_at: Option<Instant>,
    /// Dials so far.
    dials: u32,
    /// Why the last dial failed (kept for the timeout's message).
    last_cut: Option<String>,
    /// The set-up was cut after the hellos: finish as a recovering comm.
    resume_cut: Option<String>,
}

/// Dial again after a cut one: 100 ms, doubling up to 1 s.
fn redial_delay(dials: u32) -> Duration {
    Duration::from_millis(100u64 << dials.saturating_sub(1).min(4)).min(Duration::from_secs(1))
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
        let mut c = TcpConnecting {
            inner: None,
            handle: *h,
            cfg,
            tos,
            token,
            sreg: None,
            port,
            began: Instant::now(),
            redial_at: None,
            dials: 0,
            last_cut: None,
            resume_cut: None,
        };
        c.dial()?;
        Ok(c)
    }

    /// Tests: make the first dial fail at `at` as if the link were cut there.
    #[cfg(test)]
    pub(crate) fn inject_cut(&mut self, at: Cut) {
        if let Some(c) = self.inner.as_mut() {
            c.inject_cut = Some(at);
        }
    }

    /// How many times it dialled.
    #[cfg(test)]
    pub(crate) fn dials(&self) -> u32 {
        self.dials
    }

    /// Does this connect ride out link faults (recovery on at our end)?
    fn rides_out_cuts(&self) -> bool {
        self.port.is_some()
    }

    /// Open the streams; a link fault while the link is down (no route,
    /// unreachable) schedules another dial.
    fn dial(&mut self) -> Result<()> {
        let probe = self.port.as_ref().map(PortRef::addr);
        let ext = HelloExt { token: self.token, probe, answers: probe.is_some(), kernel_acks: self.cfg.kernel_ack };
        self.dials += 1;
        match Connector::start_ext(&self.handle, self.cfg.nstreams, self.cfg.oob(), self.tos, Some(ext)) {
            Ok(c) => {
                // (a replaced dial's registration goes: its listener never took it)
                self.sreg = self.port.as_ref().map(|p| resume::register_sender(c.conn_id(), self.token, p));
                // one RUSTNET_CONNECT_TIMEOUT for every dial together
                self.inner = Some(c.started_at(self.began));
                self.redial_at = None;
                Ok(())
            }
            Err(e) if self.rides_out_cuts() && link_fault(&e) => {
                self.cut_before_hellos(e.to_string());
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// A dial failed before the listener could accept it: dial again later.
    fn cut_before_hellos(&mut self, why: String) {
        if self.last_cut.is_none() {
            tracing::warn!(
                "TCP connect to {}: {why}; dialling again until RUSTNET_CONNECT_TIMEOUT={} s has passed (the link may be \
                 down, or this address not routable from here)",
                self.handle.addr,
                self.cfg.connect_timeout_s
            );
        }
        self.inner = None;
        self.redial_at = Some(Instant::now() + redial_delay(self.dials));
        self.last_cut = Some(why);
    }

    /// Advance; `Ok(true)` once the listener accepted every stream (or the
    /// set-up was cut after the hellos: the comm then recovers).
    pub fn progress(&mut self) -> Result<bool> {
        if self.resume_cut.is_some() {
            return Ok(true);
        }
        let Some(inner) = self.inner.as_mut() else {
            let timeout = Duration::from_secs(self.cfg.connect_timeout_s.max(1) as u64);
            if self.began.elapsed() >= timeout {
                return Err(crate::error::Error::Remote {
                    peer: self.handle.addr.to_string(),
                    what: format!(
                        "no connection within RUSTNET_CONNECT_TIMEOUT={} s: {} dial(s) failed on a link fault, the last: {}",
                        self.cfg.connect_timeout_s,
                        self.dials,
                        self.last_cut.as_deref().unwrap_or("none")
                    ),
                });
            }
            if self.redial_at.is_some_and(|t| Instant::now() < t) {
                return Ok(false);
            }
            self.dial()?;
            return Ok(false);
        };
        match inner.progress() {
            Ok(done) => Ok(done),
            Err(e) if self.port.is_none() => Err(e),
            // the overall timeout, after earlier dials were cut: say so
            Err(crate::error::Error::Remote { peer, what }) if inner.cut().is_none() && self.last_cut.is_some() => {
                Err(crate::error::Error::Remote {
                    peer,
                    what: format!(
                        "{what} (dial {}; the earlier ones failed on a link fault, the last: {})",
                        self.dials,
                        self.last_cut.as_deref().unwrap_or_default()
                    ),
                })
            }
            Err(e) => match inner.cut() {
                Some(Cut::BeforeHellos) => {
                    self.cut_before_hellos(e.to_string());
                    Ok(false)
                }
                Some(Cut::AwaitingReply) if self.handle.resume_port != 0 || inner.resume_port() != 0 => {
                    tracing::warn!(
                        "TCP connect to {}: {e}, after every hello was sent: the listener may have accepted the connection; \
                         finishing the connect as a comm that reconnects through the listening process's resume port",
                        self.handle.addr
                    );
                    let why = match &e {
                        crate::error::Error::Remote { what, .. } => what.clone(),
                        other => other.to_string(),
                    };
                    self.resume_cut = Some(format!("its set-up was cut before the acceptance arrived ({why})"));
                    Ok(true)
                }
                _ => Err(e),
            },
        }
    }

    /// Finish as a TCP send comm (one that recovers when both ends offered it).
    pub fn into_send_comm(self) -> Result<SendComm> {
        let Some(inner) = self.inner else {
            return Err(crate::error::Error::Internal("TCP into_send_comm before the connection was made".into()));
        };
        // the acceptance's port, or the handle's when no acceptance arrived
        // (the same listener names the same port in both)
        let resume_port = match inner.resume_port() {
            0 => self.handle.resume_port,
            p => p,
        };
        let conn_id = inner.conn_id();
        // the receiver counts what its kernel holds in its resume offsets:
        // a send may complete on that kernel's acknowledgement (not when
        // the acceptance was never read: a set-up cut before it)
        let kernel_acks = self.cfg.kernel_ack && inner.reply_flags() & REPLY_QUEUED_OFFSETS != 0;
        let rs = (self.token.is_set() && resume_port != 0).then(|| {
            let mut addr = self.handle.addr;
            addr.set_port(resume_port);
            SendResume {
                conn_id,
                token: self.token,
                addr,
                tos: self.tos,
                reg: self.sreg,
                port: self.port,
                cut: self.resume_cut,
                kernel_acks,
            }
        });
        let (socks, peer) = inner.into_streams();
        Ok(SendComm::new(socks, peer, self.cfg, rs))
    }
}
