//! Connection set-up over sockets, shared by both transports: a listener
//! that hands out a handle (address, nonce) and gathers the streams of each
//! incoming connection by their hellos, and a connector that opens the
//! streams and sends the hellos. All non-blocking (NCCL drives both from one
//! thread, interleaved, in some paths). The TCP transport's data streams are
//! these sockets (`HandleKind::Tcp`: connect completes once the listener's
//! accept has taken every stream, as it answers each hello); the verbs
//! transport's out-of-band socket is one (`HandleKind::Ib`: connect
//! completes once the hello is out; the receiver's metadata, read later, is
//! the answer there). Imports neither transport.
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::error::{Errno, Error, Result};
use crate::proto::handle::{Handle, HandleKind, PROTO_VERSION};
use crate::proto::resume::HelloExt;
use crate::proto::wire::{Hello, Reply, Verdict, HELLO_LEN, REPLY_LEN, TCP_HELLO_LEN};
use crate::random::random_u64;
use crate::transport::sock::{nofile_limit, Io, Poller, Socket, POLL_BATCH};

/// Socket settings of connection set-up, from the knob table.
#[derive(Debug, Clone, Copy)]
pub struct OobCfg {
    /// Dead-peer timeout, seconds (`RUSTNET_SOCKET_TIMEOUT`): also the age
    /// at which a connection without a hello is closed.
    pub timeout_s: i64,
    /// SO_SNDBUF/SO_RCVBUF (0 = autotune).
    pub bufsize: u64,
    /// Connection set-up timeout, seconds (`RUSTNET_CONNECT_TIMEOUT`).
    pub connect_timeout_s: i64,
    /// Accepted connections without a valid hello a listener keeps (`RUSTNET_LISTEN_MAX_STRANGERS`).
    pub max_strangers: usize,
}

impl OobCfg {
    /// From the knob table.
    pub fn from_config(cfg: &Config) -> OobCfg {
        OobCfg {
            timeout_s: cfg.socket_timeout.get(),
            bufsize: cfg.socket_bufsize.0,
            connect_timeout_s: cfg.connect_timeout.get(),
            max_strangers: cfg.listen_max_strangers.get() as usize,
        }
    }
}

/// At most one WARN of a kind per this long per listener.
const WARN_EVERY: Duration = Duration::from_secs(5);
/// Connections a WARN names before it only counts.
const WARN_NAMES: usize = 8;
/// Ready connections one accept call reads (level triggered: the rest are
/// still ready at the next call).
const READY_PER_CALL: usize = 4 * POLL_BATCH;
/// Strangers closed to make room when accept runs out of descriptors, per call.
const EVICT_PER_CALL: usize = 16;

/// A socket we accepted, until its hello is complete.
struct Pending {
    sock: Socket,
    peer: SocketAddr,
    /// The hello (a TCP stream's carries the [`HelloExt`] after it).
    buf: [u8; TCP_HELLO_LEN],
    got: usize,
}

/// Streams of one incoming connection, gathered by connection id.
struct Group {
    nstreams: usize,
    streams: Vec<Option<Socket>>,
    peer: SocketAddr,
    /// TCP: the first stream's hello extension (every stream must carry the same).
    ext: Option<HelloExt>,
}

/// One incoming connection with all its streams.
pub struct Incoming {
    /// Its streams, in order.
    pub socks: Vec<Socket>,
    /// The connecting side's address.
    pub peer: SocketAddr,
    /// The connection id of its hellos.
    pub conn_id: u64,
    /// TCP: what its hellos carried after the hello (resume token, the sender's resume port).
    pub ext: Option<HelloExt>,
}

/// Connections a listener turned away, logged at most every [`WARN_EVERY`]:
/// the first at once, the rest summed up with the first few addresses.
#[derive(Default)]
struct Rejections {
    last: Option<Instant>,
    count: u64,
    named: Vec<(SocketAddr, String)>,
}

impl Rejections {
    fn note(&mut self, peer: SocketAddr, why: String) {
        self.count += 1;
        if self.named.len() < WARN_NAMES {
            self.named.push((peer, why));
        }
    }

    fn flush(&mut self, now: Instant, listener: SocketAddr) {
        if self.count == 0 || self.last.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            return;
        }
        self.last = Some(now);
        let (p, why) = &self.named[0];
        if self.count == 1 {
            tracing::warn!("listener {listener}: rejected connection from {p}: {why}");
        } else {
            let list: Vec<String> = self.named[1..].iter().map(|(p, w)| format!("{p} ({w})")).collect();
            let unnamed = self.count - self.named.len() as u64;
            let unnamed = if unnamed > 0 { format!("; {unnamed} not named") } else { String::new() };
            tracing::warn!(
                "listener {listener}: rejected connection from {p}: {why}; and {} more: {}{unnamed}",
                self.count - 1,
                list.join("; ")
            );
        }
        self.count = 0;
        self.named.clear();
    }
}

/// A listening endpoint. Connections that have not yet sent a valid hello
/// (strangers) are bounded in number (`RUSTNET_LISTEN_MAX_STRANGERS`, the
/// oldest goes) and in age (`RUSTNET_SOCKET_TIMEOUT`); an accept call reads
/// only those with something to read (an epoll set), so its cost does not
/// grow with the strangers attached. Running out of descriptors is "not
/// yet", not an error: connections wait in the kernel's queue.
pub struct Listener {
    sock: Socket,
    addr: SocketAddr,
    nonce: u64,
    kind: HandleKind,
    poll: Poller,
    pending: HashMap<u64, Pending>,
    /// Tokens in arrival order (entries of connections already gone are skipped).
    order: VecDeque<(u64, Instant)>,
    next_token: u64,
    groups: HashMap<u64, Group>,
    cfg: OobCfg,
    rejected: Rejections,
    fd_warned: Option<Instant>,
    fd_failures: u64,
    /// IP TOS / IPv6 traffic class of the accepted data sockets (the context's class).
    tos: Option<u8>,
    /// TCP: the port of this process's resume listener, told to every
    /// accepted stream in its reply (0: no recovery).
    resume_port: u16,
    /// TCP: the reply's flags (`REPLY_QUEUED_OFFSETS`).
    reply_flags: u16,
}

impl Listener {
    /// Listen on `local` (port 0); returns the endpoint and its handle.
    pub fn new(local: SocketAddr, kind: HandleKind, cfg: OobCfg) -> Result<(Listener, Handle)> {
        let (sock, addr) = Socket::listen(local)?;
        let poll = Poller::new()?;
        let nonce = random_u64();
        let h = Handle { kind, addr, nonce, stage: 0, resume_port: 0 };
        let l = Listener {
            sock,
            addr,
            nonce,
            kind,
            poll,
            pending: HashMap::new(),
            order: VecDeque::new(),
            next_token: 0,
            groups: HashMap::new(),
            cfg,
            rejected: Rejections::default(),
            fd_warned: None,
            fd_failures: 0,
            tos: None,
            resume_port: 0,
            reply_flags: 0,
        };
        Ok((l, h))
    }

    /// Accepted data sockets (and this one's SYN-ACKs) carry `tos` as their
    /// IP TOS / IPv6 traffic class byte: the listening context's class.
    pub fn with_tos(mut self, tos: Option<u8>) -> Result<Listener> {
        if let Some(t) = tos {
            self.sock.set_tos(self.addr.is_ipv6(), t)?;
        }
        self.tos = tos;
        Ok(self)
    }

    /// Tell every accepted TCP stream that this process's resume listener
    /// is at `port` on this listener's address (0: no recovery).
    pub fn with_resume_port(mut self, port: u16) -> Listener {
        self.resume_port = port;
        self
    }

    /// The flags every TCP acceptance carries (`Reply::flags`).
    pub fn with_reply_flags(mut self, flags: u16) -> Listener {
        self.reply_flags = flags;
        self
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Bytes of a hello on this listener's streams.
    fn hello_len(&self) -> usize {
        if self.kind == HandleKind::Tcp {
            TCP_HELLO_LEN
        } else {
            HELLO_LEN
        }
    }

    /// Accepted connections still without a valid hello.
    #[cfg(test)]
    pub fn strangers(&self) -> usize {
        self.pending.len()
    }

    /// Accept whatever has arrived; `Ok(None)` until one connection has all
    /// its streams. Strangers speaking anything else are dropped with a WARN
    /// and the listener keeps serving.
    pub fn accept_streams(&mut self) -> Result<Option<(Vec<Socket>, SocketAddr)>> {
        Ok(self.accept_incoming()?.map(|i| (i.socks, i.peer)))
    }

    /// [`Self::accept_streams`] with the connection id and (TCP) the hello extension.
    pub fn accept_incoming(&mut self) -> Result<Option<Incoming>> {
        let now = Instant::now();
        self.take_new(now)?;
        self.expire(now);
        self.read_ready()?;
        self.rejected.flush(now, self.addr);
        let ready = self.groups.iter().find(|(_, g)| g.streams.iter().all(Option::is_some)).map(|(k, _)| *k);
        if let Some(id) = ready {
            let g = self.groups.remove(&id).unwrap();
            let socks: Vec<Socket> = g.streams.into_iter().map(Option::unwrap).collect();
            for s in &socks {
                s.tune_stream(self.cfg.timeout_s, self.cfg.bufsize)?;
                if let Some(t) = self.tos {
                    s.set_tos(self.addr.is_ipv6(), t)?;
                }
            }
            return Ok(Some(Incoming { socks, peer: g.peer, conn_id: id, ext: g.ext }));
        }
        self.check_groups()?;
        Ok(None)
    }

    /// Accept what waits in the kernel's queue.
    fn take_new(&mut self, now: Instant) -> Result<()> {
        let mut evicted = 0;
        loop {
            match self.sock.accept() {
                Ok(Some((sock, peer))) => {
                    let token = self.next_token;
                    self.next_token += 1;
                    if let Err(e) = self.poll.add(&sock, token) {
                        self.rejected.note(peer, format!("cannot watch it: {e}"));
                        continue;
                    }
                    self.pending.insert(token, Pending { sock, peer, buf: [0; TCP_HELLO_LEN], got: 0 });
                    self.order.push_back((token, now));
                    while self.pending.len() > self.cfg.max_strangers.max(1) {
                        let Some(p) = self.pop_oldest() else { break };
                        let why = format!(
                            "no hello yet and {} newer connections without one (RUSTNET_LISTEN_MAX_STRANGERS={})",
                            self.cfg.max_strangers, self.cfg.max_strangers
                        );
                        self.refuse(p, Verdict::TooMany, why);
                    }
                }
                Ok(None) => return Ok(()),
                Err(Error::Sys { errno, .. }) if is_resource_shortage(errno) => {
                    // Our own strangers may be what holds the descriptors:
                    // the oldest make room (a real peer's hello comes within
                    // a round trip of its connect), a bounded number per call.
                    if evicted < EVICT_PER_CALL {
                        if let Some(p) = self.pop_oldest() {
                            evicted += 1;
                            let why = "no hello yet; closed to free a descriptor (accept: out of descriptors)".to_string();
                            self.refuse(p, Verdict::TooMany, why);
                            continue;
                        }
                    }
                    self.out_of_descriptors(errno, now);
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Accept failed for want of descriptors or memory: the connection stays
    /// in the kernel's queue, and the caller hears "not yet".
    fn out_of_descriptors(&mut self, errno: Errno, now: Instant) {
        self.fd_failures += 1;
        if self.fd_warned.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            return;
        }
        self.fd_warned = Some(now);
        let limit = match errno.0 {
            libc::EMFILE => match nofile_limit() {
                Some(n) => format!("this process has reached its open-file limit (RLIMIT_NOFILE {n}; raise `ulimit -n`)"),
                None => "this process has reached its open-file limit (RLIMIT_NOFILE)".to_string(),
            },
            libc::ENFILE => "the system's open-file table is full (fs.file-max)".to_string(),
            _ => "the kernel is short of memory for sockets".to_string(),
        };
        tracing::warn!(
            "listener {}: cannot accept: {errno}: {limit}; connections wait in the kernel's queue until descriptors free up \
             ({} failed attempt(s) since the last such WARN, {} connection(s) without a hello held)",
            self.addr,
            std::mem::take(&mut self.fd_failures),
            self.pending.len()
        );
    }

    /// Remove and return the oldest connection still without a hello.
    fn pop_oldest(&mut self) -> Option<Pending> {
        while let Some((tok, _)) = self.order.pop_front() {
            if let Some(p) = self.pending.remove(&tok) {
                return Some(p);
            }
        }
        None
    }

    /// Close connections whose hello is overdue.
    fn expire(&mut self, now: Instant) {
        let max_age = Duration::from_secs(self.cfg.timeout_s.max(1) as u64);
        while let Some(&(tok, t)) = self.order.front() {
            if !self.pending.contains_key(&tok) {
                self.order.pop_front();
                continue;
            }
            let age = now.duration_since(t);
            if age < max_age {
                break;
            }
            self.order.pop_front();
            let p = self.pending.remove(&tok).expect("checked above");
            let why = format!(
                "{} of {} hello bytes after {:.1} s (RUSTNET_SOCKET_TIMEOUT={})",
                p.got,
                self.hello_len(),
                age.as_secs_f64(),
                self.cfg.timeout_s
            );
            self.refuse(p, Verdict::Late, why);
        }
        // entries of connections that left early: keep the queue in proportion
        if self.order.len() > 2 * self.pending.len() + 1024 {
            let pending = &self.pending;
            self.order.retain(|(t, _)| pending.contains_key(t));
        }
    }

    /// Read the hellos of the connections with something to read.
    fn read_ready(&mut self) -> Result<()> {
        let mut toks = [0u64; POLL_BATCH];
        let mut seen = 0;
        while seen < READY_PER_CALL {
            let n = self.poll.ready(&mut toks)?;
            for &tok in &toks[..n] {
                self.read_hello(tok)?;
            }
            seen += n;
            if n < POLL_BATCH {
                break;
            }
        }
        Ok(())
    }

    fn read_hello(&mut self, tok: u64) -> Result<()> {
        let need = self.hello_len();
        let Some(p) = self.pending.get_mut(&tok) else { return Ok(()) };
        let failed = match p.sock.read_on(&mut p.buf[..need], &mut p.got) {
            Ok(Io::Done(_)) => None,
            // the hello proper is in: a wrong version or nonce is answered
            // at once, not after waiting for an extension an older build
            // never sends
            Ok(Io::Again) if p.got >= HELLO_LEN => {
                let Err(r) = Hello::decode(p.buf[..HELLO_LEN].try_into().unwrap(), self.nonce) else { return Ok(()) };
                let p = self.pending.remove(&tok).expect("looked up above");
                self.poll.remove(&p.sock);
                self.refuse(p, r.verdict, r.why);
                return Ok(());
            }
            Ok(Io::Again) => return Ok(()),
            Ok(Io::Eof) => Some(format!("closed after {} of {} hello bytes", p.got, need)),
            Err(e) => Some(format!("read failed: {e}")),
        };
        let p = self.pending.remove(&tok).expect("looked up above");
        self.poll.remove(&p.sock);
        if let Some(why) = failed {
            self.rejected.note(p.peer, why);
            return Ok(());
        }
        let ext = if need > HELLO_LEN {
            match HelloExt::decode(p.buf[HELLO_LEN..need].try_into().unwrap()) {
                Ok(e) => Some(e),
                Err(r) => {
                    self.refuse(p, r.verdict, r.why);
                    return Ok(());
                }
            }
        } else {
            None
        };
        match Hello::decode(p.buf[..HELLO_LEN].try_into().unwrap(), self.nonce) {
            Ok(h) => self.add_stream(h, ext, p),
            Err(r) => {
                self.refuse(p, r.verdict, r.why);
                Ok(())
            }
        }
    }

    /// Tell the connection why (one short write, best effort), close it and note it for the WARN.
    fn refuse(&mut self, p: Pending, verdict: Verdict, why: String) {
        let _ = p.sock.write(&Reply { verdict, version: PROTO_VERSION, resume_port: 0, flags: 0 }.encode());
        self.rejected.note(p.peer, why);
    }

    /// A connection whose hello carried our nonce is a real peer: if it
    /// closes a stream before its other streams arrived (its connect failed
    /// half-way), nothing more will come and waiting would hang this rank's
    /// accept, so that is an error.
    fn check_groups(&mut self) -> Result<()> {
        let closed = self.groups.iter().find_map(|(id, g)| {
            g.streams.iter().enumerate().find_map(|(k, s)| match s.as_ref()?.peer_closed() {
                Ok(false) => None,
                // a reset: it closed with our acceptance unread
                Ok(true) | Err(Errno(libc::ECONNRESET)) => Some((*id, k, "closed".to_string())),
                Err(e) => Some((*id, k, format!("failed ({e})"))),
            })
        });
        let Some((id, k, why)) = closed else { return Ok(()) };
        let g = self.groups.remove(&id).expect("found above");
        let missing = g.streams.iter().filter(|s| s.is_none()).count();
        if g.ext.is_some_and(|e| e.token.is_set()) {
            // a connector that recovers dials again after a link fault
            // part-way (under a new id): this one is only dropped
            tracing::warn!(
                "TCP connection from {} (id {id:#x}): {why} stream {k} of {} while {missing} had not arrived; dropped \
                 (its connector dials again after a link fault)",
                g.peer,
                g.nstreams
            );
            return Ok(());
        }
        Err(Error::Remote {
            peer: g.peer.to_string(),
            what: format!(
                "{why} stream {k} of its {}-stream connection while {missing} stream(s) had not arrived \
                 (its connect failed part-way; see that rank's log)",
                g.nstreams
            ),
        })
    }

    fn add_stream(&mut self, h: Hello, ext: Option<HelloExt>, p: Pending) -> Result<()> {
        let g = self.groups.entry(h.conn_id).or_insert_with(|| Group {
            nstreams: h.nstreams as usize,
            streams: (0..h.nstreams).map(|_| None).collect(),
            peer: p.peer,
            ext,
        });
        if g.nstreams != h.nstreams as usize || g.streams[h.stream as usize].is_some() || g.ext != ext {
            let why = format!("stream {}/{} inconsistent with its connection", h.stream, h.nstreams);
            self.refuse(p, Verdict::Inconsistent, why);
            return Ok(());
        }
        // A TCP connector completes connect only on this answer. (On the
        // verbs out-of-band socket the receiver's metadata is the answer.)
        // 16 bytes into a fresh socket's empty buffer: one write; if the
        // peer is already gone, check_groups sees it.
        if self.kind == HandleKind::Tcp {
            let r = Reply { verdict: Verdict::Accepted, version: PROTO_VERSION, resume_port: self.resume_port, flags: self.reply_flags };
            let _ = p.sock.write(&r.encode());
        }
        g.streams[h.stream as usize] = Some(p.sock);
        Ok(())
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // what the rate limit held back
        self.rejected.last = None;
        self.rejected.flush(Instant::now(), self.addr);
    }
}

/// accept(2) errors that mean "no room now", not "this listener is broken".
fn is_resource_shortage(e: Errno) -> bool {
    matches!(e.0, libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
}

struct ConnStream {
    sock: Socket,
    connected: bool,
    /// The hello (TCP: and its extension), `hello_len` bytes of it.
    hello: [u8; TCP_HELLO_LEN],
    hello_len: usize,
    sent: usize,
    reply: [u8; REPLY_LEN],
    got: usize,
}

/// An outgoing connection in progress.
pub struct Connector {
    peer: SocketAddr,
    streams: Vec<ConnStream>,
    cfg: OobCfg,
    /// Wait for the listener's acceptance (TCP; the verbs exchange has its own).
    confirm: bool,
    started: Instant,
    conn_id: u64,
    /// The resume port the listener named in its reply to stream 0 (TCP).
    resume_port: u16,
    /// The flags of that reply (0 until it is read).
    reply_flags: u16,
    /// Set when `progress` failed on a link-class errno (a cut or reset
    /// stream): where the connection stood then.
    cut: Option<Cut>,
    /// Tests: fail the first `progress` that finds the connection at this
    /// stage as if the link had been cut there (ECONNRESET).
    #[cfg(test)]
    pub(crate) inject_cut: Option<Cut>,
}

/// Where a connection stood when a link fault (a reset, unreachable or
/// timed-out stream) failed it: what the connecting side may do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Some stream had not written its whole hello: the listener cannot
    /// have accepted the connection, so dialling again is safe.
    BeforeHellos,
    /// Every hello was written and some acceptance was not read: the
    /// listener may have accepted it (and its process handed the comm to
    /// NCCL), so only a reconnection under the same id is safe.
    AwaitingReply,
}

/// Is `errno` one a cut or reset link reports (not a refusal or a bug)?
fn link_errno(errno: i32) -> bool {
    crate::proto::resume::fault_of(errno) == crate::proto::resume::Fault::Link
}

/// Is `e` a system call's failure that a down or cut link explains?
pub(crate) fn link_fault(e: &Error) -> bool {
    matches!(e, Error::Sys { errno, .. } if link_errno(errno.0))
}

impl Connector {
    /// Open `nstreams` sockets to the listener in `h`.
    pub fn start(h: &Handle, nstreams: usize, cfg: OobCfg) -> Result<Connector> {
        Connector::start_tos(h, nstreams, cfg, None)
    }

    /// [`Connector::start`] with every stream carrying `tos` as its IP
    /// TOS / IPv6 traffic class byte (the communicator's traffic class),
    /// from the SYN on.
    pub fn start_tos(h: &Handle, nstreams: usize, cfg: OobCfg, tos: Option<u8>) -> Result<Connector> {
        let ext = (h.kind == HandleKind::Tcp).then_some(HelloExt {
            token: crate::proto::resume::Token::NONE,
            probe: None,
            answers: false,
            kernel_acks: false,
        });
        Connector::start_ext(h, nstreams, cfg, tos, ext)
    }

    /// [`Connector::start_tos`] with the hello extension of a TCP
    /// connection (`h.kind` TCP) on every stream.
    pub fn start_ext(h: &Handle, nstreams: usize, cfg: OobCfg, tos: Option<u8>, ext: Option<HelloExt>) -> Result<Connector> {
        let conn_id = random_u64();
        let mut streams = Vec::with_capacity(nstreams);
        for i in 0..nstreams {
            let sock = Socket::connect_start_tos(h.addr, tos)?;
            let mut hello = [0u8; TCP_HELLO_LEN];
            hello[..HELLO_LEN].copy_from_slice(
                &Hello { version: PROTO_VERSION, stream: i as u16, nstreams: nstreams as u16, conn_id, nonce: h.nonce }.encode(),
            );
            let hello_len = match (h.kind, ext) {
                (HandleKind::Tcp, e) => {
                    hello[HELLO_LEN..].copy_from_slice(
                        &e.unwrap_or(HelloExt { token: Default::default(), probe: None, answers: false, kernel_acks: false }).encode(),
                    );
                    TCP_HELLO_LEN
                }
                _ => HELLO_LEN,
            };
            streams.push(ConnStream { sock, connected: false, hello, hello_len, sent: 0, reply: [0; REPLY_LEN], got: 0 });
        }
        Ok(Connector {
            peer: h.addr,
            streams,
            cfg,
            confirm: h.kind == HandleKind::Tcp,
            started: Instant::now(),
            conn_id,
            resume_port: 0,
            reply_flags: 0,
            cut: None,
            #[cfg(test)]
            inject_cut: None,
        })
    }

    /// The connection id its hellos carry.
    pub fn conn_id(&self) -> u64 {
        self.conn_id
    }

    /// TCP, once connected: the resume port the listener named (0: none).
    pub fn resume_port(&self) -> u16 {
        self.resume_port
    }

    /// TCP, once connected: the flags of the listener's acceptance (0: none read).
    pub fn reply_flags(&self) -> u16 {
        self.reply_flags
    }

    /// Count the connect timeout from `t` (an earlier dial's start).
    pub fn started_at(mut self, t: Instant) -> Connector {
        self.started = t;
        self
    }

    /// After `progress` failed: was it a link fault, and where did the
    /// connection stand? (`None`: another failure, or none.)
    pub fn cut(&self) -> Option<Cut> {
        self.cut
    }

    /// Where the connection stands now, were a link fault to end it.
    fn stage(&self) -> Cut {
        if self.streams.iter().all(|s| s.connected && s.sent == s.hello_len) {
            Cut::AwaitingReply
        } else {
            Cut::BeforeHellos
        }
    }

    /// Advance; `Ok(true)` once every stream is connected, has sent its
    /// hello and (TCP) the listener accepted it. Fails once
    /// `RUSTNET_CONNECT_TIMEOUT` has passed without that.
    pub fn progress(&mut self) -> Result<bool> {
        let peer = self.peer;
        let remote = |what: String| Error::Remote { peer: peer.to_string(), what };
        #[cfg(test)]
        if let Some(c) = self.inject_cut.filter(|c| *c == self.stage()) {
            self.inject_cut = None;
            self.cut = Some(c);
            return Err(remote(format!("injected cut: {}", crate::error::Errno(libc::ECONNRESET))));
        }
        let mut all = true;
        // a link fault while reading an acceptance: where the others stood
        let mut read_fault: Option<(Error, bool)> = None;
        for (k, s) in self.streams.iter_mut().enumerate() {
            if !s.connected {
                s.connected = match s.sock.connect_done(&self.peer) {
                    Ok(c) => c,
                    Err(e) => {
                        if link_fault(&e) {
                            self.cut = Some(Cut::BeforeHellos);
                        }
                        return Err(e);
                    }
                };
                if !s.connected {
                    all = false;
                    continue;
                }
                s.sock.tune_stream(self.cfg.timeout_s, self.cfg.bufsize)?;
            }
            match s.sock.write_on(&s.hello[..s.hello_len], &mut s.sent) {
                Ok(true) => {}
                Ok(false) => {
                    all = false;
                    continue;
                }
                Err(e) => {
                    if link_errno(e.0) {
                        self.cut = Some(Cut::BeforeHellos);
                    }
                    return Err(Error::Remote { peer: peer.to_string(), what: format!("sending hello: {e}") });
                }
            }
            if !self.confirm || s.got == REPLY_LEN {
                continue;
            }
            match s.sock.read_on(&mut s.reply, &mut s.got) {
                Ok(Io::Done(_)) => {}
                Ok(Io::Again) => {
                    all = false;
                    continue;
                }
                Ok(Io::Eof) => {
                    return Err(remote(format!(
                        "closed the connection without accepting it ({} of {REPLY_LEN} answer bytes): not a librustnet \
                         listener for this handle (a stale handle, or another program has the port)",
                        s.got
                    )))
                }
                Err(e) => {
                    read_fault = Some((remote(format!("waiting for the listener to accept: {e}")), link_errno(e.0)));
                    break;
                }
            }
            let r = Reply::decode(&s.reply).map_err(|what| Error::Protocol { peer: peer.to_string(), what: what.to_string() })?;
            if r.verdict != Verdict::Accepted {
                return Err(remote(format!("the listener refused the connection: {}", r.verdict.explain())));
            }
            if k == 0 {
                self.resume_port = r.resume_port;
                self.reply_flags = r.flags;
            }
        }
        if let Some((err, link)) = read_fault {
            if link {
                // this stream wrote its hello; the others may not have yet
                self.cut = Some(self.stage());
            }
            return Err(err);
        }
        if !all && self.started.elapsed() >= Duration::from_secs(self.cfg.connect_timeout_s.max(1) as u64) {
            return Err(remote(self.overdue()));
        }
        Ok(all)
    }

    /// What did not happen in time.
    fn overdue(&self) -> String {
        let t = self.cfg.connect_timeout_s;
        let waiting = self.streams.iter().filter(|s| !s.connected).count();
        if waiting > 0 {
            format!(
                "TCP connect of {waiting} of {} stream(s) not answered within RUSTNET_CONNECT_TIMEOUT={t} s \
                 (SYNs unanswered: host down, address unreachable from here, or a firewall dropping them)",
                self.streams.len()
            )
        } else if self.streams.iter().any(|s| s.sent < s.hello_len) {
            format!("the listener took no hello bytes within RUSTNET_CONNECT_TIMEOUT={t} s")
        } else {
            format!(
                "connected, but the listener did not accept the connection within RUSTNET_CONNECT_TIMEOUT={t} s: \
                 that rank is not calling accept, or the port belongs to a program that is not a librustnet listener"
            )
        }
    }

    /// The connected sockets (after `progress` returned true).
    pub fn into_streams(self) -> (Vec<Socket>, SocketAddr) {
        (self.streams.into_iter().map(|s| s.sock).collect(), self.peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    fn cfg() -> OobCfg {
        OobCfg { timeout_s: 30, bufsize: 0, connect_timeout_s: 60, max_strangers: 256 }
    }

    fn listener() -> (Listener, Handle) {
        Listener::new("127.0.0.1:0".parse().unwrap(), HandleKind::Tcp, cfg()).unwrap()
    }

    fn listener_with(c: OobCfg) -> (Listener, Handle) {
        Listener::new("127.0.0.1:0".parse().unwrap(), HandleKind::Tcp, c).unwrap()
    }

    /// Drive a connect and the listener together until both are done.
    fn both(c: &mut Connector, l: &mut Listener) -> (Vec<Socket>, SocketAddr) {
        let t0 = Instant::now();
        let (mut got, mut done) = (None, false);
        while got.is_none() || !done {
            if !done {
                done = c.progress().unwrap();
            }
            if got.is_none() {
                got = l.accept_streams().unwrap();
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "no connection (connect done {done}, accepted {})", got.is_some());
        }
        got.unwrap()
    }

    /// A recovering connector's dial cut part-way (2 of its 3 hellos
    /// delivered, then closed) is dropped, not an accept error: that
    /// connector dials again under a new id, which the listener takes.
    /// Without a token (no recovery) it stays an error naming the cause.
    #[test]
    fn a_part_way_dial_of_a_recovering_connector_is_dropped_not_an_accept_error() {
        use crate::proto::resume::Token;
        for token in [Token([9; 16]), Token::NONE] {
            let (mut l, h) = listener();
            let ext = HelloExt { token, probe: None, answers: false, kernel_acks: false };
            let conn_id = 0x5151;
            let mut socks = Vec::new();
            for k in 0..2u16 {
                let mut s = TcpStream::connect(h.addr).unwrap();
                let mut b = [0u8; TCP_HELLO_LEN];
                b[..HELLO_LEN].copy_from_slice(&Hello { version: PROTO_VERSION, stream: k, nstreams: 3, conn_id, nonce: h.nonce }.encode());
                b[HELLO_LEN..].copy_from_slice(&ext.encode());
                s.write_all(&b).unwrap();
                socks.push(s);
            }
            // the listener takes both hellos, then the streams close
            let t0 = Instant::now();
            while l.groups.get(&conn_id).is_none_or(|g| g.streams.iter().flatten().count() < 2) {
                assert!(l.accept_streams().unwrap().is_none());
                assert!(t0.elapsed() < Duration::from_secs(5), "the hellos never arrived");
            }
            drop(socks);
            let t0 = Instant::now();
            let outcome = loop {
                match l.accept_streams() {
                    Err(e) => break Some(e.to_string()),
                    Ok(Some(_)) => panic!("a part-way connection was accepted"),
                    Ok(None) if l.groups.is_empty() => break None,
                    Ok(None) => {}
                }
                assert!(t0.elapsed() < Duration::from_secs(5), "the closed streams were never noticed");
                std::thread::sleep(Duration::from_millis(2));
            };
            if token.is_set() {
                assert_eq!(outcome, None, "dropped quietly (a WARN), the listener goes on");
                let mut c = Connector::start_ext(&h, 3, cfg(), None, Some(ext)).unwrap();
                let (got, _) = both(&mut c, &mut l);
                assert_eq!(got.len(), 3, "the next dial is accepted");
            } else {
                let e = outcome.expect("without recovery it is an accept error");
                assert!(e.contains("closed stream") && e.contains("had not arrived"), "{e}");
            }
        }
    }

    /// Drive a connect (and the listener, when given) until it answers; the error text.
    fn connect_error(c: &mut Connector, mut l: Option<&mut Listener>, limit: Duration) -> (String, Duration) {
        let t0 = Instant::now();
        loop {
            match c.progress() {
                Err(e) => return (e.to_string(), t0.elapsed()),
                Ok(true) => panic!("connect completed toward a listener that never accepted it"),
                Ok(false) => {}
            }
            if let Some(l) = l.as_deref_mut() {
                let _ = l.accept_streams();
            }
            assert!(t0.elapsed() < limit, "connect neither completed nor failed within {limit:?}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// What a stranger's socket hears from the listener: the reply's verdict
    /// (if any) and whether it was closed, within `limit`.
    fn heard(s: &mut TcpStream, limit: Duration) -> (Option<Verdict>, bool) {
        use std::io::Read;
        s.set_read_timeout(Some(limit)).unwrap();
        let mut b = [0u8; REPLY_LEN];
        let mut got = 0;
        loop {
            match s.read(&mut b[got..]) {
                Ok(0) => break,
                Ok(n) => {
                    got += n;
                    if got == REPLY_LEN {
                        let v = Reply::decode(&b).unwrap().verdict;
                        let mut rest = [0u8; 1];
                        let closed = matches!(s.read(&mut rest), Ok(0) | Err(_));
                        return (Some(v), closed);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => return (None, false),
                Err(_) => return (None, true),
            }
        }
        (None, true)
    }

    #[test]
    fn connect_fails_after_the_timeout_when_syns_vanish() {
        // A listen socket with a full backlog drops every SYN, as a host
        // that is gone or a firewall does.
        let full = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = full.local_addr().unwrap();
        // SAFETY: full's fd is open for the call; listen(2) only changes its backlog.
        assert_eq!(unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&full), 0) }, 0);
        let mut held = Vec::new();
        while held.len() < 8 {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
                Ok(s) => held.push(s),
                Err(_) => break,
            }
        }
        assert!(held.len() < 8, "the backlog never filled: cannot make SYNs vanish here");
        let h = Handle { kind: HandleKind::Tcp, addr, nonce: 5, stage: 0, resume_port: 0 };
        let mut c = Connector::start(&h, 2, OobCfg { connect_timeout_s: 1, ..cfg() }).unwrap();
        let (e, took) = connect_error(&mut c, None, Duration::from_secs(20));
        eprintln!("connect with vanishing SYNs failed after {took:?}: {e}");
        assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(5), "{took:?}");
        assert!(e.contains(&addr.to_string()) && e.contains("RUSTNET_CONNECT_TIMEOUT=1") && e.contains("SYN"), "{e}");
        // the verbs out-of-band connector is the same code without the acceptance wait
        let hib = Handle { kind: HandleKind::Ib, ..h };
        let mut c = Connector::start(&hib, 1, OobCfg { connect_timeout_s: 1, ..cfg() }).unwrap();
        let (e, _) = connect_error(&mut c, None, Duration::from_secs(20));
        assert!(e.contains("RUSTNET_CONNECT_TIMEOUT=1") && e.contains(&addr.to_string()), "{e}");
    }

    #[test]
    fn a_server_that_accepts_but_never_answers_fails_connect() {
        // Not a librustnet listener: it takes the connection and reads.
        let srv = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = srv.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut s, _) = srv.accept().unwrap();
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut s, &mut sink);
        });
        let h = Handle { kind: HandleKind::Tcp, addr, nonce: 5, stage: 0, resume_port: 0 };
        let mut c = Connector::start(&h, 1, OobCfg { connect_timeout_s: 1, ..cfg() }).unwrap();
        let (e, took) = connect_error(&mut c, None, Duration::from_secs(20));
        assert!(took >= Duration::from_secs(1), "{took:?}");
        assert!(e.contains(&addr.to_string()) && e.contains("did not accept") && e.contains("RUSTNET_CONNECT_TIMEOUT=1"), "{e}");
        drop(c);
        reader.join().unwrap();
        // one that answers with something else fails at once
        let srv = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = srv.local_addr().unwrap();
        let talker = std::thread::spawn(move || {
            let (mut s, _) = srv.accept().unwrap();
            s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").unwrap();
            std::thread::sleep(Duration::from_millis(500));
        });
        let mut c = Connector::start(&Handle { addr, ..h }, 1, cfg()).unwrap();
        let (e, _) = connect_error(&mut c, None, Duration::from_secs(5));
        assert!(e.contains("not a librustnet reply"), "{e}");
        talker.join().unwrap();
    }

    #[test]
    fn a_stale_handle_is_refused_with_the_reason() {
        let (mut l, h) = listener();
        let stale = Handle { nonce: h.nonce ^ 0x10, ..h };
        let mut c = Connector::start(&stale, 2, cfg()).unwrap();
        let (e, took) = connect_error(&mut c, Some(&mut l), Duration::from_secs(5));
        assert!(took < Duration::from_secs(2), "{took:?}");
        assert!(e.contains("refused") && e.contains("stale handle") && e.contains(&h.addr.to_string()), "{e}");
        // and the listener serves the right handle
        let mut c = Connector::start(&h, 2, cfg()).unwrap();
        let got = both(&mut c, &mut l);
        assert_eq!(got.0.len(), 2);
    }

    #[test]
    fn connect_completes_only_once_the_listener_accepted() {
        let (mut l, h) = listener();
        let mut c = Connector::start(&h, 2, cfg()).unwrap();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(300) {
            assert!(!c.progress().unwrap(), "connect completed before accept ran");
            std::thread::sleep(Duration::from_millis(5));
        }
        // interleaved, as NCCL drives both from one thread
        let mut r = None;
        let mut done = false;
        while r.is_none() || !done {
            if r.is_none() {
                r = l.accept_streams().unwrap();
            }
            if !done {
                done = c.progress().unwrap();
            }
            assert!(t0.elapsed() < Duration::from_secs(5));
        }
    }

    #[test]
    fn strangers_are_bounded_in_number_oldest_first() {
        let (mut l, h) = listener_with(OobCfg { max_strangers: 8, ..cfg() });
        let mut s: Vec<TcpStream> = Vec::new();
        for _ in 0..20 {
            s.push(TcpStream::connect(h.addr).unwrap());
            // one by one, so that arrival order is known
            let _ = l.accept_streams().unwrap();
        }
        assert_eq!(l.strangers(), 8);
        for (i, st) in s.iter_mut().enumerate() {
            let (v, closed) = heard(st, Duration::from_millis(if i < 12 { 2000 } else { 50 }));
            if i < 12 {
                assert_eq!((v, closed), (Some(Verdict::TooMany), true), "stranger {i}");
            } else {
                assert_eq!((v, closed), (None, false), "stranger {i} should still be held");
            }
        }
        // a real peer still gets in
        let mut c = Connector::start(&h, 2, cfg()).unwrap();
        let _got = both(&mut c, &mut l);
    }

    #[test]
    fn strangers_are_closed_after_the_socket_timeout_and_closed_ones_freed() {
        let (mut l, h) = listener_with(OobCfg { timeout_s: 1, ..cfg() });
        let mut quiet: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(h.addr).unwrap()).collect();
        let gone: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(h.addr).unwrap()).collect();
        let mut half = TcpStream::connect(h.addr).unwrap();
        half.write_all(&hello(&h, 3, 0)[..10]).unwrap();
        assert!(settle(&mut l).unwrap().is_none());
        assert_eq!(l.strangers(), 11);
        drop(gone);
        let t0 = Instant::now();
        while l.strangers() > 6 {
            assert!(t0.elapsed() < Duration::from_secs(2), "closed strangers still held: {}", l.strangers());
            let _ = l.accept_streams().unwrap();
        }
        std::thread::sleep(Duration::from_millis(1100));
        assert!(l.accept_streams().unwrap().is_none());
        assert_eq!(l.strangers(), 0, "strangers older than RUSTNET_SOCKET_TIMEOUT still held");
        for st in quiet.iter_mut().chain(std::iter::once(&mut half)) {
            assert_eq!(heard(st, Duration::from_secs(2)), (Some(Verdict::Late), true));
        }
    }

    fn hello(h: &Handle, conn_id: u64, stream: u16) -> [u8; TCP_HELLO_LEN] {
        let mut b = [0u8; TCP_HELLO_LEN];
        b[..HELLO_LEN].copy_from_slice(&Hello { version: PROTO_VERSION, stream, nstreams: 2, conn_id, nonce: h.nonce }.encode());
        b
    }

    /// Call accept_streams until it answers something other than "not yet".
    fn settle(l: &mut Listener) -> Result<Option<(Vec<Socket>, SocketAddr)>> {
        let t0 = Instant::now();
        loop {
            match l.accept_streams() {
                Ok(None) if t0.elapsed() < Duration::from_millis(500) => std::thread::sleep(Duration::from_millis(5)),
                other => return other,
            }
        }
    }

    #[test]
    fn peer_closing_a_stream_before_the_rest_arrive_fails_accept() {
        let (mut l, h) = listener();
        let mut s0 = TcpStream::connect(h.addr).unwrap();
        s0.write_all(&hello(&h, 7, 0)).unwrap();
        assert!(settle(&mut l).unwrap().is_none(), "one of two streams: not yet");
        drop(s0); // its connect failed before stream 1
        let e = match settle(&mut l) {
            Err(e) => e.to_string(),
            Ok(r) => panic!("accept kept waiting for a connection that cannot complete: {:?}", r.map(|x| x.1)),
        };
        assert!(e.contains("closed stream 0 of its 2-stream connection") && e.contains("1 stream(s) had not arrived"), "{e}");
        // the listener serves the next connection
        let mut a = TcpStream::connect(h.addr).unwrap();
        let mut b = TcpStream::connect(h.addr).unwrap();
        a.write_all(&hello(&h, 8, 0)).unwrap();
        b.write_all(&hello(&h, 8, 1)).unwrap();
        assert_eq!(settle(&mut l).unwrap().unwrap().0.len(), 2);
    }

    #[test]
    fn an_incomplete_connection_that_is_alive_keeps_its_early_data() {
        let (mut l, h) = listener();
        let mut s0 = TcpStream::connect(h.addr).unwrap();
        s0.write_all(&hello(&h, 9, 0)).unwrap();
        // the sender may start sending on stream 0 as soon as its hellos are out
        s0.write_all(b"early bytes").unwrap();
        assert!(settle(&mut l).unwrap().is_none());
        let mut s1 = TcpStream::connect(h.addr).unwrap();
        s1.write_all(&hello(&h, 9, 1)).unwrap();
        let (socks, _) = settle(&mut l).unwrap().expect("both streams arrived");
        let mut got = [0u8; 11];
        let mut n = 0;
        let t0 = Instant::now();
        while n < got.len() && t0.elapsed() < Duration::from_secs(5) {
            if let Ok(Io::Done(k)) = socks[0].read(&mut got[n..]) {
                n += k;
            }
        }
        assert_eq!(&got, b"early bytes", "the liveness look must not take data");
        drop(s1);
    }
}
