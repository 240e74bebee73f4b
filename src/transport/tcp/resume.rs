//! TCP recovery's socket half (the rules are `rustnet_proto::resume`):
//!
//! - **The resume ports.** Each process that has TCP comms which may recover
//!   keeps one listening socket per local address in use, open while any of
//!   those comms (or a listen comm) holds a [`PortRef`] on it. A receive
//!   comm's sender reconnects there after a failure; that it is open at all
//!   tells a waiting receiver that its sender's process is alive (a closed
//!   port is refused by the host: the process is gone). They live apart
//!   from NCCL's listen comms, which NCCL closes as soon as it accepted
//!   (`closeListen` right after `accept` in NCCL's proxy), and one per
//!   address rather than one per comm keeps the descriptors per comm as
//!   they were.
//! - **The registry.** A receive comm that may recover is registered under
//!   its connection id with its token ([`register`]); the registration goes
//!   with the comm. A reconnection is taken only for a registered comm and
//!   only with its token; anything else is refused with a reason and
//!   closed, strangers are bounded in number and age as at a listen port.
//! - **Serving.** One thread per process ("rustnet-resume", a bare pthread
//!   started with the first resume port and joined when the last closes),
//!   asleep in poll(2) on the ports and the connections still sending their
//!   hello, accepts what arrives, checks the hellos and, for a complete
//!   reconnection, answers each stream with the comm's byte count of it
//!   and leaves the streams in the comm's [`Mailbox`]. It answers for the
//!   comm only while the comm is not reading (a gate the comm holds while
//!   it moves bytes, one uncontended atomic exchange per progress call);
//!   otherwise the comm, which is busy anyway, answers at its next step. So
//!   a reconnection is answered even while NCCL calls nothing on that comm,
//!   or on any comm of the process (a rank between two collectives whose
//!   sender still waits for the acknowledgement of its last messages). The
//!   comm swaps in the new streams before its next read.
//! - **Send comms** that may recover are listed too ([`register_sender`]):
//!   a receiver waiting for its sender asks the sender's resume port about
//!   its connection ([`SenderQuery`]), and is told whether that send comm is
//!   still open, or closed or failed (then it fails at once instead of
//!   waiting out its window for a sender that will never come back).
//! - **The sender's attempt** ([`Attempt`]) and **the receiver's probe**
//!   ([`Prober`]) are the non-blocking client sides.
//!
//! Locks are std's (see `crate::thread`); the registry is freed at unload
//! ([`release`]).
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::proto::handle::PROTO_VERSION;
use crate::proto::resume::{
    resume_offset, ResumeHello, ResumeReply, SenderQuery, Token, ATTEMPT_MAX, REPLY_QUEUED_OFFSETS, RESUME_HELLO_LEN, RESUME_REPLY_LEN,
};
use crate::proto::wire::Verdict;
use crate::thread::BareThread;
use crate::transport::sock::{unread_fd, wait_readable, EventFd, Io, Socket};

// ------------------------------------------------------------ fault injection

/// `RUSTNET_FAULT_TCP_RESET`: which comms reset a stream, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResetPlan {
    /// Send comms (count their data writes), else receive comms (their reads).
    pub send: bool,
    /// The first write/read (from 1) after which a stream is reset.
    pub first: u64,
    /// Then every this many more (0: once).
    pub every: u64,
}

impl ResetPlan {
    /// Parse the knob's value (empty: none).
    pub fn parse(v: &str) -> Result<Option<ResetPlan>> {
        Ok(crate::fault::parse_tcp_reset(v)?.map(|(send, first, every)| ResetPlan { send, first, every }))
    }

    /// Reset after the `n`-th (from 1) write or read?
    pub fn hits(&self, n: u64) -> bool {
        n == self.first || (self.every > 0 && n > self.first && (n - self.first).is_multiple_of(self.every))
    }
}

// ------------------------------------------------------------ mailbox

/// A reconnection the resume port took for a comm: its streams in order,
/// each with the bytes the sender had written on it.
pub struct Resumed {
    /// The new streams, in order.
    pub socks: Vec<Socket>,
    /// The attempt number.
    pub epoch: u64,
    /// Bytes the sender had written on each stream.
    pub sent: Vec<u64>,
    /// How long the sender had been recovering, ms.
    pub elapsed_ms: u32,
    /// Where it came from.
    pub peer: SocketAddr,
    /// What the resume port already answered with, for the comm, per
    /// stream: the offset, and how many of the bytes in it the replaced
    /// socket held unread (None: the comm was busy; it answers itself).
    pub answered: Option<Vec<(u64, u64)>>,
}

/// Gate states: nobody, the comm (moving bytes), the resume port (answering for it).
const FREE: u8 = 0;
const COMM: u8 = 1;
const PORT: u8 = 2;

/// Where the resume port leaves a reconnection for its comm, and what it
/// may read of the comm to answer for it.
pub struct Mailbox {
    ready: AtomicBool,
    /// Reconnections not taken yet, oldest first: those the port answered
    /// for the comm (each newer one from where the one before stood), then
    /// at most one it did not.
    slot: Mutex<VecDeque<Resumed>>,
    /// Who may touch the comm's byte counts now ([`FREE`], [`COMM`], [`PORT`]).
    gate: AtomicU8,
    /// The comm's byte count per stream, as of its last step.
    taken: Box<[AtomicU64]>,
    /// Bytes per stream its replaced sockets still hold for it, as of then.
    held: Box<[AtomicU64]>,
    /// Its streams' descriptors, when its offsets count what they hold
    /// unread (`REPLY_QUEUED_OFFSETS`); -1: they do not (or it is closing).
    fds: Box<[AtomicI32]>,
    /// The comm failed: a reconnection is refused as for a closed comm.
    closed: AtomicBool,
}

impl Mailbox {
    fn new(nstreams: usize) -> Mailbox {
        Mailbox {
            ready: AtomicBool::new(false),
            slot: Mutex::new(VecDeque::new()),
            gate: AtomicU8::new(FREE),
            taken: (0..nstreams).map(|_| AtomicU64::new(0)).collect(),
            held: (0..nstreams).map(|_| AtomicU64::new(0)).collect(),
            fds: (0..nstreams).map(|_| AtomicI32::new(-1)).collect(),
            closed: AtomicBool::new(false),
        }
    }

    /// Anything waiting? (One relaxed load: checked on every call of the comm.)
    #[inline]
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// The comm is about to move bytes: false while the resume port
    /// answers for it (it skips this step; a few microseconds).
    #[inline]
    pub fn enter(&self) -> bool {
        self.gate.compare_exchange(FREE, COMM, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// The comm's step is over; its byte counts now (taken, held by replaced sockets).
    #[inline]
    pub fn leave(&self, counts: impl Iterator<Item = (u64, u64)>) {
        for ((a, h), (t, o)) in self.taken.iter().zip(self.held.iter()).zip(counts) {
            a.store(t, Ordering::Relaxed);
            h.store(o, Ordering::Relaxed);
        }
        self.gate.store(FREE, Ordering::Release);
    }

    /// The comm's current stream descriptors (its offsets count what they
    /// hold unread); the rest -1. Called by the comm at set-up, under its
    /// gate when it takes new streams, and holding the gate for good when
    /// it closes (empty: the port looks at none of them any more).
    pub fn publish(&self, fds: impl Iterator<Item = RawFd>) {
        let mut fds = fds;
        for a in self.fds.iter() {
            a.store(fds.next().unwrap_or(-1), Ordering::Relaxed);
        }
    }

    /// The comm failed: refuse reconnections from now on.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// Take the oldest that waits (call again until `None`).
    pub fn take(&self) -> Option<Resumed> {
        let mut s = lock(&self.slot);
        let r = s.pop_front();
        self.ready.store(!s.is_empty(), Ordering::Relaxed);
        r
    }

    /// A newer attempt replaces an older one not yet taken and not yet
    /// answered (its streams close: its sender wrote nothing on them). One
    /// the port answered stays, to be taken first: its sender may have
    /// written on its streams, and completed what this host's kernel
    /// acknowledged there, so the comm must take those streams before the
    /// newer ones (whose answers count what they hold unread).
    fn put(&self, r: Resumed) {
        Mailbox::put_locked(&mut lock(&self.slot), r, &self.ready);
    }

    fn put_locked(s: &mut VecDeque<Resumed>, r: Resumed, ready: &AtomicBool) {
        if s.back().is_some_and(|old| old.epoch > r.epoch) {
            return;
        }
        if s.back().is_some_and(|old| old.answered.is_none()) {
            s.pop_back();
        }
        s.push_back(r);
        ready.store(true, Ordering::Release);
    }

    /// The comm is closing: keep the port away from its sockets from now on.
    /// Waits while the port answers for it (microseconds); a gate the comm
    /// itself still holds (a panic inside its step) is simply kept.
    pub fn close_gate(&self) {
        loop {
            match self.gate.compare_exchange(FREE, COMM, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) | Err(COMM) => break,
                Err(_) => std::thread::yield_now(),
            }
        }
        self.publish(std::iter::empty());
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ------------------------------------------------------------ the hub

/// An accepted connection until its resume hello is complete.
struct PendingConn {
    sock: Socket,
    peer: SocketAddr,
    buf: [u8; RESUME_HELLO_LEN],
    got: usize,
    since: Instant,
}

/// The streams of one reconnection attempt, gathered by (connection, attempt).
struct Group {
    streams: Vec<Option<(Socket, u64)>>,
    peer: SocketAddr,
    elapsed_ms: u32,
    since: Instant,
}

/// One resume port.
struct Port {
    sock: Socket,
    addr: SocketAddr,
    refs: usize,
    pending: Vec<PendingConn>,
}

/// A registered receive comm.
struct Entry {
    token: Token,
    nstreams: usize,
    mailbox: Weak<Mailbox>,
    /// The last attempt taken (an older one is stale).
    epoch: u64,
}

/// A registered send comm (asked about by its waiting receiver).
struct SenderEntry {
    token: Token,
    /// Set once the comm failed (NCCL was told): "closed".
    failed: Arc<AtomicBool>,
}

/// The serving thread and how to stop it.
struct Server {
    thread: BareThread,
    wake: Arc<EventFd>,
    stop: Arc<AtomicBool>,
}

struct Hub {
    ports: HashMap<IpAddr, Port>,
    comms: HashMap<u64, Entry>,
    groups: HashMap<(u64, u64), Group>,
    /// Connections without a complete hello one port keeps (RUSTNET_LISTEN_MAX_STRANGERS).
    max_pending: usize,
    /// Their age limit (RUSTNET_SOCKET_TIMEOUT).
    max_age: Duration,
    warned: Option<Instant>,
    quiet: u64,
    /// Ids of the receive comms closed most recently (at most
    /// [`CLOSED_KEPT`]): a resume for one is told [`Verdict::Closed`], not
    /// "no such connection" (which a sender cut during set-up retries).
    closed: VecDeque<u64>,
    /// Send comms of this process that recover, by connection id.
    senders: HashMap<u64, SenderEntry>,
    /// Ids and tokens of the send comms closed most recently (at most
    /// [`CLOSED_KEPT`]; the token: a stranger learns nothing of them).
    closed_senders: VecDeque<(u64, Token)>,
    /// The serving thread (None when it could not start: comms then take
    /// reconnections only while NCCL calls them).
    server: Option<Server>,
}

static HUB: Mutex<Option<Hub>> = Mutex::new(None);

/// Connections one poll accepts per port at most (the rest wait in the kernel's queue).
const ACCEPT_PER_POLL: usize = 64;
/// An incomplete attempt is dropped after this long (its sender gave it up long before).
const GROUP_MAX: Duration = Duration::from_secs(10);
/// Closed receive comms the hub remembers (8 bytes each).
const CLOSED_KEPT: usize = 1024;
/// At most one WARN about refused reconnections per this long.
const WARN_EVERY: Duration = Duration::from_secs(5);
/// While connections wait for their hello (or an attempt for its other
/// streams), the serving thread wakes at least this often to age them out;
/// otherwise it sleeps until something arrives (an idle process costs no wake-up).
const SERVE_TICK_MS: i32 = 200;

/// The serving thread: sleep until a port or a pending connection has
/// something (or the tick), then serve.
fn serve(wake: Arc<EventFd>, stop: Arc<AtomicBool>) {
    let mut fds: Vec<RawFd> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        fds.clear();
        fds.push(wake.as_raw_fd());
        let mut waiting = false;
        {
            let g = hub();
            let Some(h) = g.as_ref() else { return };
            for p in h.ports.values() {
                fds.push(p.sock.as_raw_fd());
                fds.extend(p.pending.iter().map(|c| c.sock.as_raw_fd()));
                waiting |= !p.pending.is_empty();
            }
            waiting |= !h.groups.is_empty();
        }
        // a descriptor closed meanwhile only wakes us once: the next round lists what is open
        wait_readable(&fds, if waiting { SERVE_TICK_MS } else { -1 });
        wake.drain();
        if stop.load(Ordering::Acquire) {
            return;
        }
        poll();
    }
}

fn hub() -> MutexGuard<'static, Option<Hub>> {
    lock(&HUB)
}

/// A hold on this process's resume port at one address; the port closes
/// with the last hold.
pub struct PortRef {
    ip: IpAddr,
    addr: SocketAddr,
}

impl PortRef {
    /// The resume port on `at`'s address (its port is ignored; opened on
    /// first use). `max_pending` and `max_age` bound the connections without
    /// a hello (the first caller's values serve the process).
    pub fn acquire(at: SocketAddr, max_pending: usize, max_age: Duration) -> Result<PortRef> {
        let ip = at.ip();
        let mut g = hub();
        let h = g.get_or_insert_with(|| Hub {
            ports: HashMap::new(),
            comms: HashMap::new(),
            groups: HashMap::new(),
            max_pending: max_pending.max(1),
            max_age,
            warned: None,
            quiet: 0,
            closed: VecDeque::new(),
            senders: HashMap::new(),
            closed_senders: VecDeque::new(),
            server: None,
        });
        if let Some(p) = h.ports.get_mut(&ip) {
            p.refs += 1;
            return Ok(PortRef { ip, addr: p.addr });
        }
        let mut local = at;
        local.set_port(0);
        let (sock, addr) = Socket::listen(local)?;
        h.ports.insert(ip, Port { sock, addr, refs: 1, pending: Vec::new() });
        match &h.server {
            // a new port to watch
            Some(s) => s.wake.notify(),
            None => h.server = start_server(),
        }
        Ok(PortRef { ip, addr })
    }

    /// The port's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Another hold on the same port.
    pub fn share(&self) -> PortRef {
        let mut g = hub();
        let h = g.as_mut().expect("a PortRef holds the hub");
        h.ports.get_mut(&self.ip).expect("a PortRef holds its port").refs += 1;
        PortRef { ip: self.ip, addr: self.addr }
    }
}

fn start_server() -> Option<Server> {
    let wake = match EventFd::new() {
        Ok(w) => Arc::new(w),
        Err(e) => {
            tracing::warn!("TCP resume port: no serving thread ({e}); reconnections are taken only while NCCL calls the comm");
            return None;
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (w2, s2) = (wake.clone(), stop.clone());
    match BareThread::spawn(c"rustnet-resume", move || serve(w2, s2)) {
        Ok(thread) => Some(Server { thread, wake, stop }),
        Err(e) => {
            tracing::warn!("TCP resume port: no serving thread ({e}); reconnections are taken only while NCCL calls the comm");
            None
        }
    }
}

impl Drop for PortRef {
    fn drop(&mut self) {
        let mut g = hub();
        let Some(h) = g.as_mut() else { return };
        if let Some(p) = h.ports.get_mut(&self.ip) {
            p.refs -= 1;
            if p.refs == 0 {
                h.ports.remove(&self.ip);
                // the serving thread may be asleep in poll(2) on this port:
                // until it wakes, the kernel keeps the socket listening (poll
                // holds the file), and a waiting peer's probe would not be
                // refused
                if let Some(s) = &h.server {
                    s.wake.notify();
                }
            }
        }
        if h.ports.is_empty() && h.comms.is_empty() {
            let server = h.server.take();
            *g = None;
            drop(g);
            // joined without the lock: the thread takes it to serve
            if let Some(s) = server {
                s.stop.store(true, Ordering::Release);
                s.wake.notify();
                s.thread.join();
            }
        }
    }
}

/// A receive comm's place in the registry (removed when it is dropped).
pub struct Registration {
    conn_id: u64,
    mailbox: Arc<Mailbox>,
    /// Keeps the comm's resume port open.
    _port: PortRef,
}

impl Registration {
    /// Where reconnections for the comm arrive.
    pub fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut g = hub();
        let Some(h) = g.as_mut() else { return };
        if h.comms.get(&self.conn_id).is_some_and(|e| std::ptr::eq(e.mailbox.as_ptr(), Arc::as_ptr(&self.mailbox))) {
            h.comms.remove(&self.conn_id);
            let id = self.conn_id;
            h.groups.retain(|k, _| k.0 != id);
            if h.closed.len() == CLOSED_KEPT {
                h.closed.pop_front();
            }
            h.closed.push_back(id);
        }
    }
}

/// A send comm's place in the registry: its receiver's [`SenderQuery`] is
/// answered "open" while it lives and has not failed, "closed" after.
pub struct SenderReg {
    conn_id: u64,
    failed: Arc<AtomicBool>,
    /// Keeps this process's resume port (where the queries arrive) open.
    _port: PortRef,
}

impl SenderReg {
    /// The comm failed and NCCL was told: its receiver need not wait.
    pub fn close(&self) {
        self.failed.store(true, Ordering::Relaxed);
    }
}

impl Drop for SenderReg {
    fn drop(&mut self) {
        let mut g = hub();
        let Some(h) = g.as_mut() else { return };
        if h.senders.get(&self.conn_id).is_some_and(|e| Arc::ptr_eq(&e.failed, &self.failed)) {
            let e = h.senders.remove(&self.conn_id).expect("just looked up");
            if h.closed_senders.len() == CLOSED_KEPT {
                h.closed_senders.pop_front();
            }
            h.closed_senders.push_back((self.conn_id, e.token));
        }
    }
}

/// Register a send comm (a dial's connection id, with its token) on
/// `port`, this process's resume port, where its receiver may ask about it.
/// A second registration of one id replaces the first (ids are random).
pub fn register_sender(conn_id: u64, token: Token, port: &PortRef) -> SenderReg {
    let port = port.share();
    let failed = Arc::new(AtomicBool::new(false));
    let mut g = hub();
    let h = g.as_mut().expect("a PortRef holds the hub");
    h.closed_senders.retain(|&(id, _)| id != conn_id);
    h.senders.insert(conn_id, SenderEntry { token, failed: failed.clone() });
    drop(g);
    SenderReg { conn_id, failed, _port: port }
}

/// Register a receive comm: reconnections naming `conn_id` with `token` and
/// `nstreams` streams go to its mailbox. `None` when another comm of this
/// process already holds that id (two random 64-bit ids: a peer reusing one
/// on purpose), which then goes without recovery.
///
/// `fds`: the comm's stream descriptors, where its offsets count what they
/// hold unread (published before the port can answer for it).
pub fn register(conn_id: u64, token: Token, nstreams: usize, port: PortRef, fds: Option<&[RawFd]>) -> Option<Registration> {
    let mailbox = Arc::new(Mailbox::new(nstreams));
    if let Some(f) = fds {
        mailbox.publish(f.iter().copied());
    }
    let mut g = hub();
    let h = g.as_mut().expect("a PortRef holds the hub");
    if h.comms.get(&conn_id).is_some_and(|e| e.mailbox.strong_count() > 0) {
        return None;
    }
    h.comms.insert(conn_id, Entry { token, nstreams, mailbox: Arc::downgrade(&mailbox), epoch: 0 });
    drop(g);
    Some(Registration { conn_id, mailbox, _port: port })
}

/// Accept and check what arrived at this process's resume ports, answer
/// and hand complete reconnections to their comms (what the serving thread
/// does). Skips when another thread is at it.
pub fn poll() {
    let mut g = match HUB.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return,
    };
    if let Some(h) = g.as_mut() {
        h.poll(Instant::now());
    }
}

/// Refuse a connection (or answer a sender query): one short write of the
/// verdict, then close.
fn refuse(sock: &Socket, verdict: Verdict) {
    let _ = sock.write(&ResumeReply { verdict, version: PROTO_VERSION, offset: 0, flags: 0 }.encode());
}

/// Answer a reconnection for its comm with these (offset, unread) per
/// stream: false when refused (the sender claims fewer bytes) or when a
/// reply did not go out whole (the sender retries).
fn answer_for(r: &mut Resumed, offs: Vec<(u64, u64)>, flags: u16, notes: &mut Vec<(SocketAddr, SocketAddr, String)>) -> bool {
    if offs.len() != r.socks.len() || offs.iter().zip(&r.sent).any(|(t, s)| t.0 > *s) {
        for s in &r.socks {
            refuse(s, Verdict::Inconsistent);
        }
        notes.push((
            r.socks[0].local_addr().unwrap_or(r.peer),
            r.peer,
            format!("the sender claims {:?} bytes written per stream, fewer than the {offs:?} received", r.sent),
        ));
        return false;
    }
    // 24 bytes into each fresh socket: one write, or the attempt is dropped (the sender retries)
    let ok = r.socks.iter().zip(&offs).all(|(s, &(o, _))| {
        let b = ResumeReply { verdict: Verdict::Accepted, version: PROTO_VERSION, offset: o, flags }.encode();
        matches!(s.write(&b), Ok(Io::Done(n)) if n == b.len())
    });
    if ok {
        r.answered = Some(offs);
    }
    ok
}

impl Hub {
    fn poll(&mut self, now: Instant) {
        let mut done: Vec<(ResumeHello, PendingConn)> = Vec::new();
        let mut notes: Vec<(SocketAddr, SocketAddr, String)> = Vec::new();
        let mut queries: Vec<PendingConn> = Vec::new();
        for port in self.ports.values_mut() {
            for _ in 0..ACCEPT_PER_POLL {
                match port.sock.accept() {
                    Ok(Some((sock, peer))) => {
                        port.pending.push(PendingConn { sock, peer, buf: [0; RESUME_HELLO_LEN], got: 0, since: now });
                        if port.pending.len() > self.max_pending {
                            let old = port.pending.remove(0);
                            refuse(&old.sock, Verdict::TooMany);
                            notes.push((
                                port.addr,
                                old.peer,
                                "no resume hello yet and too many waiting (RUSTNET_LISTEN_MAX_STRANGERS)".into(),
                            ));
                        }
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            let max_age = self.max_age;
            let addr = port.addr;
            let mut i = 0;
            while i < port.pending.len() {
                let p = &mut port.pending[i];
                match p.sock.read_on(&mut p.buf, &mut p.got) {
                    Ok(Io::Done(_)) if SenderQuery::is_query(&p.buf) => {
                        let p = port.pending.swap_remove(i);
                        queries.push(p);
                    }
                    Ok(Io::Done(_)) => {
                        let p = port.pending.swap_remove(i);
                        match ResumeHello::decode(&p.buf) {
                            Ok(h) => done.push((h, p)),
                            Err(r) => {
                                refuse(&p.sock, r.verdict);
                                notes.push((addr, p.peer, r.why));
                            }
                        }
                    }
                    Ok(Io::Again) if now.duration_since(p.since) < max_age => i += 1,
                    Ok(Io::Again) => {
                        let p = port.pending.swap_remove(i);
                        refuse(&p.sock, Verdict::Late);
                        notes.push((addr, p.peer, format!("{} of {RESUME_HELLO_LEN} resume hello bytes in time", p.got)));
                    }
                    // a connection that closes without a byte is a waiting
                    // receiver asking whether this process is alive: it is
                    Ok(Io::Eof) | Err(_) => {
                        let p = port.pending.swap_remove(i);
                        if p.got > 0 {
                            notes.push((addr, p.peer, format!("closed after {} of {RESUME_HELLO_LEN} resume hello bytes", p.got)));
                        }
                    }
                }
            }
        }
        for p in queries {
            self.answer_query(p, &mut notes);
        }
        for (h, p) in done {
            self.take_stream(h, p, now, &mut notes);
        }
        self.groups.retain(|_, g| now.duration_since(g.since) < GROUP_MAX);
        self.warn(now, notes);
    }

    /// A waiting receiver asks about its send comm: answer and close.
    fn answer_query(&self, p: PendingConn, notes: &mut Vec<(SocketAddr, SocketAddr, String)>) {
        let q = match SenderQuery::decode(&p.buf) {
            Ok(q) => q,
            Err(r) => {
                refuse(&p.sock, r.verdict);
                return notes.push((p.sock.local_addr().unwrap_or(p.peer), p.peer, r.why));
            }
        };
        // without the connection's token the answer is that of an id never
        // used: a stranger learns nothing of which comms this process has
        let closed = |id: u64| self.closed_senders.iter().any(|(c, t)| *c == id && t.matches(&q.token));
        let verdict = match self.senders.get(&q.conn_id) {
            Some(e) if e.token.matches(&q.token) && e.failed.load(Ordering::Relaxed) => Verdict::Closed,
            Some(e) if e.token.matches(&q.token) => Verdict::Accepted,
            _ if closed(q.conn_id) => Verdict::Closed,
            known => {
                if known.is_some() {
                    notes.push((
                        p.sock.local_addr().unwrap_or(p.peer),
                        p.peer,
                        format!("a question about send comm {:#x} with the wrong token", q.conn_id),
                    ));
                }
                Verdict::UnknownComm
            }
        };
        // one short write into a fresh socket; the connection closes with `p`
        refuse(&p.sock, verdict);
    }

    /// A well-formed resume hello: check it against the registry, gather its attempt's streams.
    fn take_stream(&mut self, h: ResumeHello, p: PendingConn, now: Instant, notes: &mut Vec<(SocketAddr, SocketAddr, String)>) {
        let mut say = |p: &PendingConn, v: Verdict, why: String| {
            refuse(&p.sock, v);
            notes.push((p.sock.local_addr().unwrap_or(p.peer), p.peer, why));
        };
        let Some(e) = self.comms.get(&h.conn_id).filter(|e| e.mailbox.strong_count() > 0) else {
            if self.closed.contains(&h.conn_id) {
                return say(&p, Verdict::Closed, format!("the receive comm of connection {:#x} was closed", h.conn_id));
            }
            return say(
                &p,
                Verdict::UnknownComm,
                format!("no open receive comm with connection id {:#x} (closed, failed, or not accepted yet)", h.conn_id),
            );
        };
        if !e.token.matches(&h.token) {
            return say(&p, Verdict::BadToken, format!("wrong resume token for connection {:#x}", h.conn_id));
        }
        if usize::from(h.nstreams) != e.nstreams {
            return say(&p, Verdict::Inconsistent, format!("{} streams for a {}-stream connection", h.nstreams, e.nstreams));
        }
        if h.epoch <= e.epoch {
            return say(&p, Verdict::Stale, format!("attempt {} after attempt {} was taken", h.epoch, e.epoch));
        }
        let mailbox = e.mailbox.clone();
        let g = self.groups.entry((h.conn_id, h.epoch)).or_insert_with(|| Group {
            streams: (0..h.nstreams).map(|_| None).collect(),
            peer: p.peer,
            elapsed_ms: h.elapsed_ms,
            since: now,
        });
        let slot = &mut g.streams[usize::from(h.stream)];
        if slot.is_some() {
            return say(&p, Verdict::Inconsistent, format!("stream {} of attempt {} twice", h.stream, h.epoch));
        }
        *slot = Some((p.sock, h.sent));
        if !g.streams.iter().all(Option::is_some) {
            return;
        }
        let g = self.groups.remove(&(h.conn_id, h.epoch)).expect("just filled");
        // older attempts of this connection are over
        self.groups.retain(|k, _| k.0 != h.conn_id);
        if let Some(e) = self.comms.get_mut(&h.conn_id) {
            e.epoch = h.epoch;
        }
        let (socks, sent): (Vec<Socket>, Vec<u64>) = g.streams.into_iter().map(Option::unwrap).unzip();
        let Some(m) = mailbox.upgrade().filter(|m| !m.closed.load(Ordering::Relaxed)) else {
            for s in &socks {
                refuse(s, Verdict::Closed);
            }
            return;
        };
        let mut r = Resumed { socks, epoch: h.epoch, sent, elapsed_ms: g.elapsed_ms, peer: g.peer, answered: None };
        // (descriptors published: the comm counts its queues, and says so)
        let flags = if m.fds.iter().all(|f| f.load(Ordering::Relaxed) >= 0) { REPLY_QUEUED_OFFSETS } else { 0 };
        let mut slot = lock(&m.slot);
        if let Some(last) = slot.iter().rev().find(|x| x.answered.is_some()) {
            // the comm has not taken the last reconnection we answered for it
            // (it reads nothing of those streams before it does): this one
            // replaces those streams, so it stands where that answer stood
            // plus what they hold unread now (the comm takes both, in order)
            let before = last.answered.as_deref().unwrap_or_default();
            let offs: Vec<(u64, u64)> = last
                .socks
                .iter()
                .zip(before)
                .map(|(s, &(o, _))| {
                    let inq = if flags != 0 { s.unread().unwrap_or(0) } else { 0 };
                    (o + inq, inq)
                })
                .collect();
            if answer_for(&mut r, offs, flags, notes) {
                Mailbox::put_locked(&mut slot, r, &m.ready);
            }
            return;
        }
        drop(slot);
        if m.gate.compare_exchange(FREE, PORT, Ordering::Acquire, Ordering::Relaxed).is_ok() {
            // the comm is not reading: its byte counts hold still while we
            // answer, and its sockets stay open (it closes them only under
            // the gate); where it counts what they hold unread, so do we
            let offs: Vec<(u64, u64)> = (0..m.taken.len())
                .map(|k| {
                    let fd = m.fds[k].load(Ordering::Relaxed);
                    let inq = if fd >= 0 { unread_fd(fd).unwrap_or(0) } else { 0 };
                    (resume_offset(m.taken[k].load(Ordering::Relaxed), m.held[k].load(Ordering::Relaxed), inq), inq)
                })
                .collect();
            if answer_for(&mut r, offs, flags, notes) {
                m.put(r);
            }
            m.gate.store(FREE, Ordering::Release);
        } else {
            m.put(r);
        }
    }

    fn warn(&mut self, now: Instant, notes: Vec<(SocketAddr, SocketAddr, String)>) {
        if notes.is_empty() {
            return;
        }
        if self.warned.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            self.quiet += notes.len() as u64;
            return;
        }
        self.warned = Some(now);
        let (port, peer, why) = &notes[0];
        let more = notes.len() as u64 - 1 + std::mem::take(&mut self.quiet);
        let more = if more > 0 { format!(" (and {more} more refused since the last such WARN)") } else { String::new() };
        tracing::warn!("TCP resume port {port}: refused a reconnection from {peer}: {why}{more}");
    }
}

/// Unload: drop the registry and close the ports (the thread is joined
/// with the last port; this is for what a failed join left).
///
/// # Safety
/// No comm is alive.
pub(crate) unsafe fn release() {
    let mut g = hub();
    let server = g.as_mut().and_then(|h| h.server.take());
    *g = None;
    drop(g);
    if let Some(s) = server {
        s.stop.store(true, Ordering::Release);
        s.wake.notify();
        s.thread.join();
    }
}

/// Is a resume port open at `at`'s address? (tests)
#[cfg(test)]
pub fn has_port(at: SocketAddr) -> bool {
    hub().as_ref().is_some_and(|h| h.ports.contains_key(&at.ip()))
}

// ------------------------------------------------------------ the sender's attempt

struct AStream {
    sock: Socket,
    connected: bool,
    hello: [u8; RESUME_HELLO_LEN],
    sent: usize,
    reply: [u8; RESUME_REPLY_LEN],
    got: usize,
}

/// One reconnection attempt of a sender: its streams to the receiver's resume port.
pub struct Attempt {
    streams: Vec<AStream>,
    /// When it started.
    pub began: Instant,
    addr: SocketAddr,
    /// The comm was never confirmed accepted (its set-up was cut before
    /// the acceptance arrived): "no such connection" may mean "not accepted
    /// yet", so it is retried.
    unconfirmed: bool,
    /// The flags of the receiver's answer, once accepted (`REPLY_QUEUED_OFFSETS`).
    flags: u16,
}

/// Where an attempt stands.
#[derive(Debug)]
pub enum Step {
    /// Still going.
    Pending,
    /// Every stream accepted: the sockets and the receiver's byte count of each.
    Done(Vec<(Socket, u64)>),
    /// This attempt failed; another may work (the network, not the peer).
    Retry(String),
    /// The peer cannot take it any more: fail the comm.
    Fatal(String),
}

fn connect_fault(addr: SocketAddr, errno: i32) -> Step {
    let e = crate::error::Errno(errno);
    if errno == libc::ECONNREFUSED {
        Step::Fatal(format!("its host refused a connection to the receiver's resume port {addr} ({e}): the receiving process is gone, or has closed every comm on that address"))
    } else {
        Step::Retry(format!("connect to {addr}: {e}"))
    }
}

impl Attempt {
    /// Open one stream per hello to `addr`, carrying `tos` from the SYN on.
    pub fn start(addr: SocketAddr, hellos: &[ResumeHello], tos: Option<u8>) -> std::result::Result<Attempt, Step> {
        let mut streams = Vec::with_capacity(hellos.len());
        for h in hellos {
            let sock = match Socket::connect_start_tos(addr, tos) {
                Ok(s) => s,
                Err(Error::Sys { errno, .. }) => return Err(connect_fault(addr, errno.0)),
                Err(e) => return Err(Step::Retry(e.to_string())),
            };
            streams.push(AStream { sock, connected: false, hello: h.encode(), sent: 0, reply: [0; RESUME_REPLY_LEN], got: 0 });
        }
        Ok(Attempt { streams, began: Instant::now(), addr, unconfirmed: false, flags: 0 })
    }

    /// For a comm whose acceptance was never read: the receiver's process
    /// may not have accepted it yet, so "no such connection" is retried.
    pub fn unconfirmed(mut self, yes: bool) -> Attempt {
        self.unconfirmed = yes;
        self
    }

    /// Move it on (non-blocking).
    pub fn step(&mut self) -> Step {
        let addr = self.addr;
        let mut all = true;
        for s in &mut self.streams {
            if !s.connected {
                match s.sock.connect_status() {
                    Ok(None) => {
                        all = false;
                        continue;
                    }
                    Ok(Some(0)) => s.connected = true,
                    Ok(Some(e)) | Err(crate::error::Errno(e)) => return connect_fault(addr, e),
                }
            }
            match s.sock.write_on(&s.hello, &mut s.sent) {
                Ok(true) => {}
                Ok(false) => {
                    all = false;
                    continue;
                }
                Err(e) => return Step::Retry(format!("sending the resume hello to {addr}: {e}")),
            }
            if s.got < RESUME_REPLY_LEN {
                match s.sock.read_on(&mut s.reply, &mut s.got) {
                    Ok(Io::Done(_)) => {}
                    Ok(Io::Again) => {
                        all = false;
                        continue;
                    }
                    Ok(Io::Eof) => return Step::Retry(format!("{addr} closed the reconnection before answering")),
                    Err(e) => return Step::Retry(format!("waiting for {addr} to answer the reconnection: {e}")),
                }
            }
            let r = match ResumeReply::decode(&s.reply) {
                Ok(r) => r,
                Err(e) => return Step::Fatal(format!("its resume port {addr} {e}")),
            };
            match r.verdict {
                Verdict::Accepted => {}
                Verdict::Stale | Verdict::TooMany | Verdict::Late => {
                    return Step::Retry(format!("{addr} did not take this attempt: {}", r.verdict.explain()))
                }
                Verdict::UnknownComm if self.unconfirmed => {
                    return Step::Retry(format!("{addr} has not accepted the connection yet: {}", r.verdict.explain()))
                }
                v => return Step::Fatal(format!("the receiver refused to resume the connection: {}", v.explain())),
            }
        }
        if !all {
            return Step::Pending;
        }
        let mut out = Vec::with_capacity(self.streams.len());
        for (k, s) in self.streams.drain(..).enumerate() {
            let r = ResumeReply::decode(&s.reply).expect("checked above");
            if k == 0 {
                self.flags = r.flags;
            }
            out.push((s.sock, r.offset));
        }
        Step::Done(out)
    }

    /// The flags of the receiver's answer (after [`Step::Done`]).
    pub fn flags(&self) -> u16 {
        self.flags
    }

    /// Over [`ATTEMPT_MAX`] without an answer?
    pub fn overdue(&self, now: Instant) -> bool {
        now.duration_since(self.began) >= ATTEMPT_MAX
    }
}

// ------------------------------------------------------------ the receiver's probe

/// How often a waiting receiver asks whether its sender's process is alive.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// What a probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The port took the connection: the sender's process is there (and,
    /// when asked, its send comm is open, or it did not say).
    Alive,
    /// Refused by its host: the process is gone.
    Gone,
    /// The process is there, and says that the connection's send comm was
    /// closed or failed: it will never reconnect.
    CommClosed,
    /// No answer (a cut link, a host down): nothing learned.
    Unknown,
}

/// A probe under way.
struct Open {
    sock: Socket,
    since: Instant,
    connected: bool,
    sent: usize,
    reply: [u8; RESUME_REPLY_LEN],
    got: usize,
}

/// A waiting receiver's look at its sender's resume port: a connection
/// opened and, when the sender said its port answers them, a
/// [`SenderQuery`] about the connection (otherwise closed without a byte,
/// which the port closes without a WARN).
pub struct Prober {
    addr: SocketAddr,
    query: Option<[u8; RESUME_HELLO_LEN]>,
    open: Option<Open>,
    last: Option<Instant>,
}

impl Prober {
    /// Probes of `addr`; `query` asks about one send comm there.
    pub fn new(addr: SocketAddr, query: Option<SenderQuery>) -> Prober {
        Prober { addr, query: query.map(|q| q.encode()), open: None, last: None }
    }

    /// The address probed.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Move on; `Some` when a probe finished.
    pub fn step(&mut self, now: Instant) -> Option<Probe> {
        if let Some(o) = self.open.as_mut() {
            let late = now.duration_since(o.since) >= PROBE_EVERY;
            let r = Prober::advance(o, self.query.as_ref(), late)?;
            self.open = None;
            return Some(r);
        }
        if self.last.is_some_and(|t| now.duration_since(t) < PROBE_EVERY) {
            return None;
        }
        self.last = Some(now);
        match Socket::connect_start(self.addr) {
            Ok(sock) => self.open = Some(Open { sock, since: now, connected: false, sent: 0, reply: [0; RESUME_REPLY_LEN], got: 0 }),
            Err(Error::Sys { errno, .. }) if errno.0 == libc::ECONNREFUSED => return Some(Probe::Gone),
            Err(_) => return Some(Probe::Unknown),
        }
        None
    }

    /// One non-blocking step of an open probe; `late`: its time is up.
    fn advance(o: &mut Open, query: Option<&[u8; RESUME_HELLO_LEN]>, late: bool) -> Option<Probe> {
        if !o.connected {
            match o.sock.connect_status() {
                Ok(None) if !late => return None,
                Ok(None) => return Some(Probe::Unknown),
                Ok(Some(0)) => o.connected = true,
                Ok(Some(e)) | Err(crate::error::Errno(e)) if e == libc::ECONNREFUSED => return Some(Probe::Gone),
                _ => return Some(Probe::Unknown),
            }
        }
        // connected: the process is there; what follows only adds what it says of the comm
        let Some(q) = query else { return Some(Probe::Alive) };
        match o.sock.write_on(q, &mut o.sent) {
            Ok(true) => {}
            Ok(false) if !late => return None,
            Ok(false) | Err(_) => return Some(Probe::Alive),
        }
        match o.sock.read_on(&mut o.reply, &mut o.got) {
            Ok(Io::Done(_)) => {}
            Ok(Io::Again) if !late => return None,
            _ => return Some(Probe::Alive),
        }
        match ResumeReply::decode(&o.reply) {
            Ok(r) if r.verdict == Verdict::Closed => Some(Probe::CommClosed),
            // open, not known (never registered, or long forgotten), or not ours to judge
            _ => Some(Probe::Alive),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    /// One probe of `at` (with `query`), stepped until it finishes (at most 5 s).
    fn probe(at: SocketAddr, query: Option<SenderQuery>) -> Probe {
        let mut pr = Prober::new(at, query);
        let t0 = Instant::now();
        loop {
            if let Some(p) = pr.step(Instant::now()) {
                return p;
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "no answer from {at}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn reset_plans_parse_and_hit() {
        assert_eq!(ResetPlan::parse("").unwrap(), None);
        let p = ResetPlan::parse("send:3").unwrap().unwrap();
        assert!(p.send && !p.hits(2) && p.hits(3) && !p.hits(6));
        let p = ResetPlan::parse("recv:2:5").unwrap().unwrap();
        assert!(!p.send && p.hits(2) && !p.hits(3) && p.hits(7) && p.hits(12));
        for bad in ["send", "send:0", "both:1", "send:1:x", "send:1:2:3", "recv:-1"] {
            let e = ResetPlan::parse(bad).unwrap_err().to_string();
            assert!(e.contains("RUSTNET_FAULT_TCP_RESET") && e.contains("send:N[:K]"), "{bad}: {e}");
        }
    }

    /// An address of this test's own (the hub is per process and per
    /// address; other tests use 127.0.0.1 at the same time).
    fn lo() -> SocketAddr {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 77)), 0)
    }

    /// Poll the hub until `f` holds (or fail after 5 s).
    fn until(mut f: impl FnMut() -> bool, what: &str) {
        let t0 = Instant::now();
        while !f() {
            poll();
            assert!(t0.elapsed() < Duration::from_secs(5), "{what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn hello(conn_id: u64, stream: u16, nstreams: u16, epoch: u64, token: Token) -> ResumeHello {
        ResumeHello { version: PROTO_VERSION, stream, nstreams, conn_id, epoch, sent: 100 + u64::from(stream), elapsed_ms: 7, token }
    }

    /// Drive an attempt until it ends.
    fn finish(a: &mut Attempt) -> Step {
        let t0 = Instant::now();
        loop {
            poll();
            match a.step() {
                Step::Pending => assert!(t0.elapsed() < Duration::from_secs(5), "attempt hangs"),
                s => return s,
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    // The hub is process-wide: one test drives every case in turn.
    #[test]
    fn a_senders_resume_port_says_whether_its_comm_is_open() {
        let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 84)), 0);
        let port = PortRef::acquire(addr, 16, Duration::from_secs(5)).unwrap();
        let at = port.addr();
        let tok = |b| Token([b; 16]);
        let ask = |id: u64, t: Token| probe(at, Some(SenderQuery { version: PROTO_VERSION, conn_id: id, token: t }));
        // the port's answer itself (blocking, for the checks of what a stranger learns)
        let ask_raw = |id: u64, t: Token| {
            use std::io::{Read, Write};
            let mut c = std::net::TcpStream::connect(at).unwrap();
            c.write_all(&SenderQuery { version: PROTO_VERSION, conn_id: id, token: t }.encode()).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let mut b = [0u8; RESUME_REPLY_LEN];
            c.read_exact(&mut b).unwrap();
            ResumeReply::decode(&b).unwrap().verdict
        };
        let reg = register_sender(0x5e0d, tok(7), &port);
        assert_eq!(ask(0x5e0d, tok(7)), Probe::Alive, "an open send comm");
        assert_eq!(ask(0x5e0d, tok(8)), Probe::Alive, "a wrong token learns nothing");
        assert_eq!(ask_raw(0x5e0d, tok(8)), Verdict::UnknownComm, "a wrong token is answered as for an unknown id");
        assert_eq!(ask_raw(0x5e0d, tok(7)), Verdict::Accepted);
        assert_eq!(ask(0x0bad, tok(7)), Probe::Alive, "an unknown id is not taken for a closed comm");
        reg.close();
        assert_eq!(ask(0x5e0d, tok(7)), Probe::CommClosed, "a failed send comm");
        assert_eq!(ask_raw(0x5e0d, tok(8)), Verdict::UnknownComm);
        drop(reg);
        assert_eq!(ask(0x5e0d, tok(7)), Probe::CommClosed, "a dropped send comm");
        assert_eq!(ask_raw(0x5e0d, tok(8)), Verdict::UnknownComm, "nor is a closed comm told to a stranger");
        // a receiver of an older build only connects: still alive, no WARN
        assert_eq!(probe(at, None), Probe::Alive);
        // the registration held the port: the last hold closes it
        let reg = register_sender(0x5e0e, tok(9), &port);
        drop(port);
        assert!(has_port(at), "a registered send comm keeps its resume port open");
        drop(reg);
        assert!(!has_port(at));
    }

    #[test]
    fn the_resume_port_takes_only_a_registered_comm_with_its_token() {
        let token = Token([0x5a; 16]);
        let port = PortRef::acquire(lo(), 16, Duration::from_secs(5)).unwrap();
        let addr = port.addr();
        let reg = register(0x77, token, 2, port, None).unwrap();
        assert!(register(0x77, token, 2, PortRef::acquire(lo(), 16, Duration::from_secs(5)).unwrap(), None).is_none(), "an id taken twice");

        // a stranger with a wrong token is refused, and nothing reaches the comm
        let mut a = Attempt::start(addr, &[hello(0x77, 0, 2, 1, Token([1; 16])), hello(0x77, 1, 2, 1, Token([1; 16]))], None).unwrap();
        match finish(&mut a) {
            Step::Fatal(why) => assert!(why.contains("refused") && why.contains("token"), "{why}"),
            _ => panic!("a wrong token was not refused"),
        }
        assert!(!reg.mailbox().ready());
        // an unknown connection id: refused as a closed comm
        let mut a = Attempt::start(addr, &[hello(0x78, 0, 1, 1, token)], None).unwrap();
        match finish(&mut a) {
            Step::Fatal(why) => assert!(why.contains("receive comm was closed"), "{why}"),
            _ => panic!("an unknown comm was not refused"),
        }
        // the right token: both streams reach the mailbox, in order
        // (the comm "holds" the byte counts 50 and 51 and is busy: it answers itself)
        assert!(reg.mailbox().enter());
        reg.mailbox().leave([(50u64, 0u64), (51, 0)].into_iter());
        assert!(reg.mailbox().enter());
        let mut a = Attempt::start(addr, &[hello(0x77, 0, 2, 2, token), hello(0x77, 1, 2, 2, token)], None).unwrap();
        until(
            || {
                assert!(matches!(a.step(), Step::Pending));
                reg.mailbox().ready()
            },
            "a valid reconnection never reached the comm",
        );
        let r = reg.mailbox().take().unwrap();
        assert_eq!((r.epoch, r.sent.clone(), r.elapsed_ms, r.socks.len(), r.answered.is_some()), (2, vec![100, 101], 7, 2, false));
        // the comm answers each stream with its offset; the attempt completes
        for (k, s) in r.socks.iter().enumerate() {
            s.write(&ResumeReply { verdict: Verdict::Accepted, version: PROTO_VERSION, offset: 50 + k as u64, flags: 0 }.encode()).unwrap();
        }
        match finish(&mut a) {
            Step::Done(v) => assert_eq!(v.iter().map(|x| x.1).collect::<Vec<_>>(), [50, 51]),
            _ => panic!("accepted attempt did not complete"),
        }
        // an idle comm: the port answers for it with its published counts
        reg.mailbox().leave([(60u64, 0u64), (61, 0)].into_iter());
        let mut a = Attempt::start(addr, &[hello(0x77, 0, 2, 3, token), hello(0x77, 1, 2, 3, token)], None).unwrap();
        match finish(&mut a) {
            Step::Done(v) => assert_eq!(v.iter().map(|x| x.1).collect::<Vec<_>>(), [60, 61]),
            _ => panic!("an idle comm's reconnection was not answered"),
        }
        let r = reg.mailbox().take().unwrap();
        assert_eq!(r.answered, Some(vec![(60, 0), (61, 0)]));
        // an older attempt is stale
        let mut a = Attempt::start(addr, &[hello(0x77, 0, 2, 2, token), hello(0x77, 1, 2, 2, token)], None).unwrap();
        assert!(matches!(finish(&mut a), Step::Retry(why) if why.contains("later reconnection")));
        // a probe of a live port is Alive and leaves no WARN behind (closed without a byte)
        assert_eq!(probe(addr, None), Probe::Alive);
        // once the comm is gone, a reconnection is refused as closed, and the port closes with its last hold
        let keep = PortRef::acquire(lo(), 16, Duration::from_secs(5)).unwrap();
        drop(reg);
        let mut a = Attempt::start(addr, &[hello(0x77, 0, 2, 4, token), hello(0x77, 1, 2, 4, token)], None).unwrap();
        match finish(&mut a) {
            Step::Fatal(why) => assert!(why.contains("closed"), "{why}"),
            Step::Done(_) => panic!("a closed comm was resumed"),
            _ => {}
        }
        // a sender cut during its set-up retries "no such connection" (its
        // comm may not be accepted yet), but not "closed"
        let mut a = Attempt::start(addr, &[hello(0x77, 0, 2, 5, token), hello(0x77, 1, 2, 5, token)], None).unwrap().unconfirmed(true);
        assert!(matches!(finish(&mut a), Step::Fatal(why) if why.contains("failed or was closed")));
        let mut a = Attempt::start(addr, &[hello(0x99, 0, 1, 1, token)], None).unwrap().unconfirmed(true);
        assert!(matches!(finish(&mut a), Step::Retry(why) if why.contains("not accepted")));
        drop(keep);
        assert!(!has_port(lo()), "the resume port outlived its last comm");
        // (the kernel keeps the socket listening until the serving thread
        // wakes from poll(2) and lets go of it: under load a first probe may
        // still be answered; a waiting receiver probes again a second later)
        let t0 = Instant::now();
        let got = loop {
            let got = probe(addr, None);
            if got == Probe::Gone || t0.elapsed() > Duration::from_secs(3) {
                break got;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(got, Probe::Gone, "a closed port must read as a gone process (within a few probes)");
        match Attempt::start(addr, &[hello(0x77, 0, 1, 5, token)], None).map(|mut a| finish(&mut a)) {
            Ok(Step::Fatal(why)) | Err(Step::Fatal(why)) => assert!(why.contains("process is gone"), "{why}"),
            _ => panic!("a refused connection must be fatal"),
        }
    }
}
