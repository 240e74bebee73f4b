//! The sending end of the TCP data path ([`super::p2p`] tells the whole
//! path and its recovery, and holds what both ends share): [`SendCore`]
//! queues each send's pieces on the streams and writes them, and with
//! recovery keeps them until they are acknowledged and resends after a
//! reconnection; [`SendComm`] is the comm NCCL holds, driven from `test` or
//! by a helper thread.
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::{AsRawFd, RawFd};

use super::helper::{Drive, Helper};
use super::p2p::{io_error, peer_error, secs, AckWatch, ACK_BUF, ACK_LIVENESS_POLL, ACK_POLL, WRITE_BATCH};
use super::resume::{Attempt, PortRef, ResetPlan, SenderReg, Step as AttemptStep};
use super::StreamCfg;
use crate::error::{Errno, Error, Result};
use crate::profiler::{Fields, OpenEvent, Parent, Profiler, MAX_EVENTS_PER_PARENT, SOCK_SEND};
use crate::proto::handle::PROTO_VERSION;
use crate::proto::pool::{Pool, ReqId};
use crate::proto::resume::{
    check_resume_offset, fault_of, kernel_acked, rewind, Ack, Backoff, Fault, ResumeHello, Rewind, Token, ACK_LEN, ATTEMPT_MAX,
    REPLY_QUEUED_OFFSETS,
};
use crate::proto::wire::{self, MsgHeader, HDR_LEN, MAX_STREAMS};
use crate::stats::RecoveryStats;
use crate::transport::sock::{Io, Socket, MAX_IOV};
use crate::transport::{Completion, RawBuf, MAX_P2P_BYTES, MAX_RECVS, MAX_REQUESTS};

/// Send requests in flight per comm: NCCL may post MAX_REQUESTS x maxRecvs.
pub const SEND_SLOTS: usize = MAX_REQUESTS * MAX_RECVS;

struct Piece {
    req: ReqId,
    hdr: [u8; HDR_LEN],
    hdr_len: usize,
    data: *const u8,
    len: usize,
    done: usize,
    /// Its profiler event (stopped when the piece is written or dropped).
    ev: Option<OpenEvent>,
    /// The stream's byte count at the piece's end.
    end: u64,
}

struct SendReq {
    size: usize,
    /// Pieces not yet written (no recovery) or not yet acknowledged.
    pieces_left: usize,
}

struct SendStream {
    sock: Socket,
    /// Pieces from the oldest not yet retired (written, or with recovery
    /// acknowledged) to the last queued.
    q: VecDeque<Piece>,
    /// Index in `q` of the first piece not fully written (0 without recovery).
    wpos: usize,
    /// Bytes queued on the stream in total (the next piece starts there).
    queued: u64,
    /// Bytes written.
    sent: u64,
    /// Bytes the receiver acknowledged.
    acked: u64,
}

impl SendStream {
    /// A profiler event for a piece of `len` bytes on this stream.
    fn event(&self, parent: Parent, len: usize) -> Option<OpenEvent> {
        Profiler::start(parent, &Fields::Sock { fd: self.sock.as_raw_fd(), op: SOCK_SEND, len })
    }
}

/// What a send comm needs to recover (both ends offered recovery at set-up).
pub struct SendResume {
    /// The connection's id (its set-up hellos').
    pub conn_id: u64,
    /// The connection's token.
    pub token: Token,
    /// The receiving process's resume port.
    pub addr: SocketAddr,
    /// IP TOS / IPv6 traffic class of the streams.
    pub tos: Option<u8>,
    /// The comm's place in this process's registry of send comms: a
    /// receiver waiting for us asks about it (open, or closed once we
    /// failed). Dropped before `port`.
    pub reg: Option<SenderReg>,
    /// This process's resume port, held open while the comm lives: a
    /// receiver waiting for us finds it open, so it knows we are alive.
    pub port: Option<PortRef>,
    /// The set-up was cut after the hellos, before the acceptance was read
    /// (why): the comm starts out recovering, and until a reconnection is
    /// taken "no such connection" means "not accepted yet".
    pub cut: Option<String>,
    /// The receiver's resume offsets count what its kernel holds unread
    /// (`REPLY_QUEUED_OFFSETS`), and this end has `RUSTNET_SOCKET_KERNEL_ACK`:
    /// a send completes once the receiving kernel acknowledged it.
    pub kernel_acks: bool,
}

/// A send comm's recovery state.
struct SendRec {
    window: Duration,
    r: SendResume,
    bufsize: u64,
    /// Reconnection attempts so far.
    epoch: u64,
    /// Acknowledgement bytes read and not yet whole records.
    ack_in: [u8; ACK_BUF],
    ack_got: usize,
    state: Option<Recovering>,
    /// New streams since the helper pool last registered ours.
    fds_changed: bool,
    /// No acceptance read yet (the set-up was cut): see [`SendResume::cut`].
    unconfirmed: bool,
    /// When a look for acknowledgements last found none.
    acks_empty_at: Option<Instant>,
    /// Retire on the receiving kernel's acknowledgements ([`SendResume::kernel_acks`]).
    kernel_acks: bool,
    /// `RUSTNET_SOCKET_KERNEL_ACK` here: a reconnection's answer saying the
    /// receiver counts its queues turns `kernel_acks` on (a set-up cut
    /// before its acceptance learns it there).
    kernel_ack_knob: bool,
}

/// A send comm between a failure and its reconnection.
struct Recovering {
    since: Instant,
    cause: String,
    backoff: Backoff,
    next: Instant,
    attempt: Option<Attempt>,
    last: String,
    /// The window's clock runs (a comm cut during its set-up starts it at
    /// its first use: NCCL may connect long before it sends).
    clock: bool,
}

enum Outcome {
    Resume(Vec<(Socket, u64)>),
    /// The peer is gone or refused: fail now.
    Fail(String),
    /// The window is spent.
    Spent(String),
}

/// The sending end of a TCP connection, driven by whoever holds it.
pub struct SendCore {
    streams: Vec<SendStream>,
    reqs: Pool<SendReq>,
    failed: Option<Error>,
    peer: SocketAddr,
    min_chunk: usize,
    timeout_s: i64,
    acks: AckWatch,
    /// Recovery (None: off at either end; sends complete once written).
    rec: Option<Box<SendRec>>,
    stats: Arc<RecoveryStats>,
    /// RUSTNET_FAULT_TCP_RESET for send comms, and the writes so far.
    fault: Option<ResetPlan>,
    writes: u64,
}

// SAFETY: the raw pointers in queued pieces are NCCL buffers that stay valid
// until their request completes (the isend contract); the comm is only used
// by one thread at a time (behind the boundary's mutex).
unsafe impl Send for SendCore {}

impl SendCore {
    /// Build from connected streams; `resume` when both ends recover.
    pub fn new(socks: Vec<Socket>, peer: SocketAddr, cfg: StreamCfg, resume: Option<SendResume>) -> SendCore {
        let mut cut = None;
        let rec = resume.filter(|_| cfg.recovery_s > 0).map(|mut r| {
            cut = r.cut.take();
            Box::new(SendRec {
                kernel_acks: r.kernel_acks,
                kernel_ack_knob: cfg.kernel_ack,
                unconfirmed: cut.is_some(),
                window: Duration::from_secs(cfg.recovery_s as u64),
                r,
                bufsize: cfg.bufsize,
                epoch: 0,
                ack_in: [0; ACK_BUF],
                ack_got: 0,
                state: None,
                fds_changed: false,
                acks_empty_at: None,
            })
        });
        let mut core = SendCore {
            streams: socks
                .into_iter()
                .map(|sock| SendStream { sock, q: VecDeque::with_capacity(SEND_SLOTS), wpos: 0, queued: 0, sent: 0, acked: 0 })
                .collect(),
            reqs: Pool::new(SEND_SLOTS),
            failed: None,
            peer,
            min_chunk: cfg.min_chunk,
            timeout_s: cfg.timeout_s,
            acks: AckWatch::default(),
            rec,
            stats: Arc::default(),
            fault: cfg.fault_reset.filter(|p| p.send),
            writes: 0,
        };
        if let Some(cause) = cut {
            core.begin_recovery(cause);
        }
        core
    }

    /// Peer address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Does this comm recover from a reset or silent stream?
    pub fn recovers(&self) -> bool {
        self.rec.is_some()
    }

    /// Its recovery counters.
    pub fn recovery_stats(&self) -> Arc<RecoveryStats> {
        self.stats.clone()
    }

    /// Between a failure and its reconnection?
    #[inline]
    fn recovering(&self) -> bool {
        self.rec.as_ref().is_some_and(|r| r.state.is_some())
    }

    /// New streams since the last call (the helper pool must watch them).
    pub fn take_fds_changed(&mut self) -> bool {
        self.rec.as_mut().is_some_and(|r| std::mem::take(&mut r.fds_changed))
    }

    /// A send still in flight: is the peer answering?
    fn watch_acks(&mut self) {
        let now = Instant::now();
        if self.failed.is_some() || !self.acks.due(now) {
            return;
        }
        // at most MAX_STREAMS streams per connection (StreamCfg)
        let mut states = [(false, 0u32); MAX_STREAMS];
        let n = self.streams.len().min(states.len());
        for (st, o) in self.streams.iter().zip(states.iter_mut()) {
            match st.sock.ack_state() {
                Ok(s) => *o = s,
                Err(e) => return self.stream_fault("TCP_INFO", e),
            }
        }
        let timeout_ms = self.timeout_s.max(1) as u64 * 1000;
        if let Some(ms) = self.acks.look(now, timeout_ms, states[..n].iter().copied()) {
            let what = format!(
                "no acknowledgement for {:.1} s while it owes one (RUSTNET_SOCKET_TIMEOUT={}): peer host down or network cut",
                f64::from(ms) / 1000.0,
                self.timeout_s
            );
            if self.rec.is_some() {
                self.begin_recovery(what);
            } else {
                self.failed = Some(peer_error(&self.peer, what));
            }
        }
    }

    /// A read or write failed: a reset or cut stream starts a recovery (when
    /// on), anything else fails the comm.
    fn stream_fault(&mut self, what: &str, e: Errno) {
        if self.rec.is_some() && fault_of(e.0) == Fault::Link {
            self.begin_recovery(format!("{what} failed: {e}"));
        } else {
            self.failed = Some(io_error(&self.peer, what, e));
        }
    }

    fn begin_recovery(&mut self, cause: String) {
        let Some(r) = self.rec.as_deref_mut() else { return };
        if r.state.is_some() {
            return;
        }
        tracing::warn!(
            "TCP send comm to {}: {cause}; reconnecting to its resume port {} and resending what it did not take \
             (RUSTNET_RECOVERY_TIMEOUT={} s)",
            self.peer,
            r.r.addr,
            r.window.as_secs()
        );
        let now = Instant::now();
        r.state = Some(Recovering {
            since: now,
            cause,
            backoff: Backoff::new(now, r.window),
            next: now,
            attempt: None,
            last: "none finished".into(),
            clock: !r.unconfirmed,
        });
    }

    /// Move the reconnection on: an attempt, its answer, the back-off, the window.
    fn recover_step(&mut self) {
        let now = Instant::now();
        let nstreams = self.streams.len();
        let Some(r) = self.rec.as_deref_mut() else { return };
        let Some(st) = r.state.as_mut() else { return };
        if !st.clock {
            st.clock = true;
            st.since = now;
            st.backoff = Backoff::new(now, r.window);
            st.next = now;
        }
        let mut outcome = None;
        let mut flags = 0;
        if let Some(a) = st.attempt.as_mut() {
            let began = a.began;
            match a.step() {
                // (the window ends even under an attempt in flight)
                AttemptStep::Pending if !a.overdue(now) && !st.backoff.spent(now) => return,
                AttemptStep::Pending if !a.overdue(now) => {
                    st.last = format!("the one in flight to {} unanswered", r.r.addr);
                    st.attempt = None;
                }
                AttemptStep::Pending => {
                    st.last = format!("no answer from {} within {} ms", r.r.addr, ATTEMPT_MAX.as_millis());
                    st.next = st.backoff.failed(began);
                    st.attempt = None;
                }
                AttemptStep::Retry(why) => {
                    st.last = why;
                    st.next = st.backoff.failed(began);
                    st.attempt = None;
                }
                AttemptStep::Fatal(why) => outcome = Some(Outcome::Fail(why)),
                AttemptStep::Done(s) => {
                    flags = a.flags();
                    outcome = Some(Outcome::Resume(s));
                }
            }
        }
        if outcome.is_none() && st.attempt.is_none() {
            if st.backoff.spent(now) {
                outcome = Some(Outcome::Spent(format!("no reconnection (last attempt: {})", st.last)));
            } else if now >= st.next {
                r.epoch += 1;
                let elapsed_ms = now.duration_since(st.since).as_millis().min(u32::MAX as u128) as u32;
                let hellos: Vec<ResumeHello> = (0..nstreams)
                    .map(|k| ResumeHello {
                        version: PROTO_VERSION,
                        stream: k as u16,
                        nstreams: nstreams as u16,
                        conn_id: r.r.conn_id,
                        epoch: r.epoch,
                        sent: self.streams[k].sent,
                        elapsed_ms,
                        token: r.r.token,
                    })
                    .collect();
                match Attempt::start(r.r.addr, &hellos, r.r.tos) {
                    Ok(a) => st.attempt = Some(a.unconfirmed(r.unconfirmed)),
                    Err(AttemptStep::Fatal(why)) => outcome = Some(Outcome::Fail(why)),
                    Err(AttemptStep::Retry(why)) => {
                        st.last = why;
                        st.next = st.backoff.failed(now);
                    }
                    Err(_) => st.next = st.backoff.failed(now),
                }
            }
        }
        match outcome {
            None => {}
            Some(Outcome::Resume(s)) => self.resume_with(s, flags, now),
            Some(Outcome::Fail(why)) => {
                let st = r.state.as_ref().expect("recovering");
                let waited = secs(now.duration_since(st.since));
                let what = format!("{why}, {waited} into recovering from: {}", st.cause);
                self.failed = Some(peer_error(&self.peer, what));
            }
            Some(Outcome::Spent(why)) => {
                let st = r.state.as_ref().expect("recovering");
                let waited = secs(now.duration_since(st.since));
                let what = format!(
                    "{why} in {waited}: gave up recovering (RUSTNET_RECOVERY_TIMEOUT={} s); the connection had failed: {}",
                    r.window.as_secs(),
                    st.cause
                );
                self.failed = Some(peer_error(&self.peer, what));
            }
        }
    }

    /// The receiver took the reconnection: each stream restarts from the
    /// receiver's byte count; what it holds counts as acknowledged, the
    /// rest is sent again.
    fn resume_with(&mut self, socks: Vec<(Socket, u64)>, flags: u16, now: Instant) {
        for (k, (_, off)) in socks.iter().enumerate() {
            let st = &self.streams[k];
            if let Err(e) = check_resume_offset(k, st.acked, st.sent, *off) {
                let kernel = self.rec.as_ref().is_some_and(|r| r.kernel_acks) && *off < st.acked;
                let why = if kernel {
                    " (this end completed those bytes once the receiving host's kernel had acknowledged them: the receiver's \
                     socket lost bytes it held unread, which only a reset made on its own host does, or a TCP proxy on the way \
                     acknowledged them in its place; RUSTNET_SOCKET_KERNEL_ACK=0 waits for the receiving process instead)"
                } else {
                    ""
                };
                self.failed = Some(Error::Protocol { peer: self.peer.to_string(), what: format!("{e}{why}") });
                return;
            }
        }
        let Some(r) = self.rec.as_deref_mut() else { return };
        let rs = r.state.take().expect("recovering");
        r.unconfirmed = false;
        if r.kernel_ack_knob && flags & REPLY_QUEUED_OFFSETS != 0 {
            r.kernel_acks = true;
        }
        let mut replayed = 0u64;
        for (k, (sock, off)) in socks.into_iter().enumerate() {
            if let Err(e) = sock.tune_stream(self.timeout_s, r.bufsize) {
                self.failed = Some(e);
                return;
            }
            let st = &mut self.streams[k];
            replayed += st.sent - off;
            st.sock.set_abortive_close();
            st.sock = sock;
            while st.q.front().is_some_and(|p| p.end <= off) {
                let p = st.q.pop_front().expect("checked");
                if let Ok(q) = self.reqs.get_mut(p.req) {
                    q.pieces_left -= 1;
                }
            }
            for p in st.q.iter_mut() {
                let start = p.end - (p.hdr_len + p.len) as u64;
                p.done = match rewind(start, p.end, off) {
                    Rewind::Held => p.hdr_len + p.len,
                    Rewind::From(d) => d as usize,
                };
            }
            st.wpos = 0;
            st.sent = off;
            st.acked = off;
        }
        r.ack_got = 0;
        r.fds_changed = true;
        let took = now.duration_since(rs.since);
        self.stats.record(took, replayed);
        let mode = if r.kernel_acks {
            "completing sends on the receiving kernel's acknowledgement"
        } else {
            "completing sends on the receiving process's acknowledgement"
        };
        tracing::warn!(
            "TCP send comm to {}: recovered after {} (attempt {}; it had failed: {}; {mode}); {replayed} byte(s) sent again",
            self.peer,
            secs(took),
            r.epoch,
            rs.cause
        );
        self.acks = AckWatch::default();
        self.progress();
    }

    /// Read the receiver's acknowledgements and retire what they cover.
    fn read_acks(&mut self) {
        let n = self.streams.len();
        let mut sent = [0u64; MAX_STREAMS];
        for (o, st) in sent.iter_mut().zip(&self.streams) {
            *o = st.sent;
        }
        let Some(r) = self.rec.as_deref_mut() else { return };
        if r.state.is_some() {
            return;
        }
        let mut fault = None;
        let mut closed = false;
        if r.kernel_acks {
            // what the receiving kernel acknowledged is safe in its socket
            // queue (the receiver's resume offset counts it): one ioctl per
            // stream with written pieces waiting
            for st in self.streams.iter_mut().filter(|st| st.wpos > 0 && st.acked < st.sent) {
                match st.sock.unacked() {
                    Ok(q) => st.acked = st.acked.max(kernel_acked(st.sent, q)),
                    Err(e) => {
                        fault = Some(e);
                        break;
                    }
                }
            }
        }
        // a look that finds nothing costs a system call: NCCL polls test()
        // in a loop, so look again only ACK_POLL after an empty one
        let now = Instant::now();
        // (with kernel acknowledgements the records only tell of liveness,
        // and of a closed receiver: a look every ACK_LIVENESS_POLL)
        let poll = if r.kernel_acks { ACK_LIVENESS_POLL } else { ACK_POLL };
        let look = fault.is_none() && r.acks_empty_at.is_none_or(|t| now.duration_since(t) >= poll);
        if look {
            r.acks_empty_at = None;
        }
        if look {
            loop {
                let got = r.ack_got;
                match self.streams[0].sock.read(&mut r.ack_in[got..]) {
                    Ok(Io::Done(k)) => {
                        r.ack_got += k;
                        let whole = r.ack_got / ACK_LEN * ACK_LEN;
                        for rec in r.ack_in[..whole].chunks_exact(ACK_LEN) {
                            match Ack::decode(rec.try_into().expect("ACK_LEN bytes"), &sent[..n]) {
                                Ok(a) => {
                                    let st = &mut self.streams[usize::from(a.stream)];
                                    st.acked = st.acked.max(a.offset);
                                }
                                Err(e) => {
                                    self.failed = Some(Error::Protocol { peer: self.peer.to_string(), what: e.to_string() });
                                    return;
                                }
                            }
                        }
                        r.ack_in.copy_within(whole..r.ack_got, 0);
                        r.ack_got -= whole;
                        if k < ACK_BUF - got {
                            break;
                        }
                    }
                    Ok(Io::Again) => {
                        r.acks_empty_at = Some(now);
                        break;
                    }
                    Ok(Io::Eof) => {
                        closed = true;
                        break;
                    }
                    Err(e) => {
                        fault = Some(e);
                        break;
                    }
                }
            }
        }
        if closed && r.kernel_acks {
            // the receiver read what it had and closed its comm: its FIN
            // acknowledged everything its kernel took, so look once more
            for st in self.streams.iter_mut().filter(|st| st.wpos > 0 && st.acked < st.sent) {
                if let Ok(q) = st.sock.unacked() {
                    st.acked = st.acked.max(kernel_acked(st.sent, q));
                }
            }
        }
        for st in &mut self.streams {
            while st.wpos > 0 && st.q.front().is_some_and(|p| p.end <= st.acked) {
                let p = st.q.pop_front().expect("checked");
                st.wpos -= 1;
                if let Ok(q) = self.reqs.get_mut(p.req) {
                    q.pieces_left -= 1;
                }
            }
        }
        if closed {
            // (sends it took in full still complete: test reports them first)
            self.failed = Some(peer_error(&self.peer, "closed the connection (its receive comm was closed, or its process exited)"));
            return;
        }
        if let Some(e) = fault {
            self.stream_fault("reading acknowledgements", e);
        }
    }

    /// Number of TCP streams.
    pub fn nstreams(&self) -> usize {
        self.streams.len()
    }

    /// Queue a send; `Ok(None)` when all request slots are busy.
    ///
    /// # Safety
    /// `buf` must stay readable until `test` reports this request done or failed.
    /// `parent`: NCCL's profiler parent handle; each piece is one event.
    pub unsafe fn isend(&mut self, buf: RawBuf, tag: i32, parent: Option<Parent>) -> Result<Option<ReqId>> {
        if let Some(e) = &self.failed {
            self.tell_registry();
            return Err(e.clone());
        }
        if buf.len > MAX_P2P_BYTES {
            return Err(Error::Usage(format!("isend of {} bytes exceeds maxP2pBytes ({MAX_P2P_BYTES})", buf.len)));
        }
        let nchunks = wire::chunks(buf.len, self.streams.len(), self.min_chunk).count().max(1);
        let Some(id) = self.reqs.alloc(SendReq { size: buf.len, pieces_left: nchunks }) else { return Ok(None) };
        let hdr = MsgHeader { tag, size: buf.len as u64 }.encode();
        // Write at once only where nothing was queued before: a stream with
        // pieces still queued found its socket full at its last try, and a
        // write now would most likely only return EAGAIN.
        let idle = self.streams.iter().all(|st| st.wpos == st.q.len());
        if buf.len == 0 {
            let ev = parent.and_then(|p| self.streams[0].event(p, 0));
            let st = &mut self.streams[0];
            st.queued += HDR_LEN as u64;
            let end = st.queued;
            st.q.push_back(Piece { req: id, hdr, hdr_len: HDR_LEN, data: std::ptr::null(), len: 0, done: 0, ev, end });
        }
        for (s, off, len) in wire::chunks(buf.len, self.streams.len(), self.min_chunk) {
            let hdr_len = if s == 0 { HDR_LEN } else { 0 };
            // SAFETY: off < buf.len, inside the caller's buffer.
            let data = unsafe { buf.ptr.add(off) } as *const u8;
            let ev = parent.filter(|_| s < MAX_EVENTS_PER_PARENT).and_then(|p| self.streams[s].event(p, len));
            let st = &mut self.streams[s];
            st.queued += (hdr_len + len) as u64;
            let end = st.queued;
            st.q.push_back(Piece { req: id, hdr, hdr_len, data, len, done: 0, ev, end });
        }
        if idle {
            self.progress();
        }
        Ok(Some(id))
    }

    /// Move bytes until every stream has written all it has queued, or took
    /// less than offered (its socket buffer is full: the next write would
    /// only say EAGAIN, so it waits for the next call). Queued pieces go out
    /// in one gather write where they can (many small messages, one system
    /// call).
    pub fn progress(&mut self) {
        if self.failed.is_some() || self.recovering() {
            return;
        }
        let held = self.rec.is_some();
        let mut fault = None;
        let mut iov = [(std::ptr::null::<u8>(), 0usize); MAX_IOV];
        'streams: for st in &mut self.streams {
            while st.wpos < st.q.len() {
                let mut n = 0;
                let mut offered = 0;
                for p in st.q.range(st.wpos..) {
                    // one call moves at most about WRITE_BATCH: a single
                    // thread that also receives gets back to its reads soon
                    if n + 2 > MAX_IOV || offered >= WRITE_BATCH {
                        break;
                    }
                    offered += p.hdr_len + p.len - p.done;
                    if p.done < p.hdr_len {
                        iov[n] = (p.hdr[p.done..].as_ptr(), p.hdr_len - p.done);
                        n += 1;
                        if p.len > 0 {
                            iov[n] = (p.data, p.len);
                            n += 1;
                        }
                    } else {
                        // SAFETY: done - hdr_len < len: inside the piece's data.
                        iov[n] = (unsafe { p.data.add(p.done - p.hdr_len) }, p.hdr_len + p.len - p.done);
                        n += 1;
                    }
                }
                // SAFETY: headers live in the queued pieces (not moved during
                // the call); data are NCCL buffers kept valid by the isend contract.
                match unsafe { st.sock.writev_raw(&iov[..n]) } {
                    Ok(Io::Done(mut wrote)) => {
                        let short = wrote < offered;
                        st.sent += wrote as u64;
                        while wrote > 0 {
                            let p = st.q.get_mut(st.wpos).expect("wrote more than queued");
                            let left = p.hdr_len + p.len - p.done;
                            let take = left.min(wrote);
                            p.done += take;
                            wrote -= take;
                            if p.done == p.hdr_len + p.len {
                                if held {
                                    // written, kept until acknowledged
                                    p.ev = None;
                                    st.wpos += 1;
                                } else {
                                    let req = p.req;
                                    st.q.pop_front();
                                    if let Ok(r) = self.reqs.get_mut(req) {
                                        r.pieces_left -= 1;
                                    }
                                }
                            }
                        }
                        if let Some(plan) = &self.fault {
                            self.writes += 1;
                            if plan.hits(self.writes) {
                                tracing::warn!("RUSTNET_FAULT_TCP_RESET: resetting a stream to {} after write {}", self.peer, self.writes);
                                st.sock.reset_now();
                            }
                        }
                        if short {
                            break;
                        }
                    }
                    Ok(_) => break,
                    Err(e) => {
                        fault = Some(e);
                        break 'streams;
                    }
                }
            }
        }
        if let Some(e) = fault {
            self.stream_fault("send", e);
        }
    }

    /// `Ok(Some(size))` when the send is done, `Ok(None)` while in flight.
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        let r = self.reqs.get(id).map_err(|s| Error::Usage(format!("test on send request: {s}")))?;
        // already sent (and acknowledged) in an earlier call: no system call to say so
        if r.pieces_left > 0 {
            if self.recovering() {
                self.recover_step();
            } else {
                self.progress();
                if self.rec.is_some() {
                    self.read_acks();
                }
            }
        }
        let r = self.reqs.get(id).unwrap();
        let (done, size) = (r.pieces_left == 0, r.size);
        if !done && !self.recovering() {
            self.watch_acks();
        }
        if done {
            // whole before any failure (a receiver that took it all and closed)
            self.reqs.release(id).unwrap();
            return Ok(Some(Completion::one(size)));
        }
        if let Some(e) = &self.failed {
            let e = e.clone();
            let _ = self.reqs.release(id);
            self.stop_events();
            self.tell_registry();
            return Err(e);
        }
        Ok(None)
    }
}

impl SendCore {
    /// The comm failed and NCCL is told: from now on a receiver that waits
    /// for us and asks our resume port hears "closed", and fails at once.
    fn tell_registry(&self) {
        if let Some(g) = self.rec.as_ref().and_then(|r| r.r.reg.as_ref()) {
            g.close();
        }
    }

    /// The comm failed: stop the events of every piece still queued (no
    /// byte of theirs moves any more; NCCL learns of the failure next).
    fn stop_events(&mut self) {
        for st in &mut self.streams {
            for p in st.q.iter_mut() {
                p.ev = None;
            }
        }
    }
}

impl Drop for SendCore {
    fn drop(&mut self) {
        if self.rec.is_some() {
            // a FIN even with acknowledgements unread (a close alone would
            // reset): the receiver tells a closed comm from a network fault
            for st in &self.streams {
                st.sock.shutdown_write();
            }
        }
    }
}

impl Drive for SendCore {
    fn progress(&mut self) {
        SendCore::progress(self)
    }
    fn fail_with(&mut self, e: Error) {
        if self.failed.is_none() {
            self.failed = Some(e);
        }
    }
    fn fds(&self, out: &mut [RawFd; MAX_STREAMS]) -> usize {
        for (o, st) in out.iter_mut().zip(&self.streams) {
            *o = st.sock.as_raw_fd();
        }
        self.streams.len().min(MAX_STREAMS)
    }
    fn sends(&self) -> bool {
        true
    }
}

/// The sending end of a TCP connection: driven from `test` (NCCL's proxy
/// thread), or by a helper thread.
#[allow(clippy::large_enum_variant)] // the direct core stays inline: it is the common case, and one per comm
pub enum SendComm {
    /// The caller of isend/test moves the bytes.
    Direct(SendCore),
    /// A helper thread moves them.
    Helper(Helper<SendCore>),
}

impl SendComm {
    /// Stop the helper thread, if any, without waiting (see [`Helper::halt`]).
    pub fn halt(&self) {
        if let SendComm::Helper(h) = self {
            h.halt();
        }
    }

    /// Build from connected streams; `resume` when both ends recover.
    pub fn new(socks: Vec<Socket>, peer: SocketAddr, cfg: StreamCfg, resume: Option<SendResume>) -> SendComm {
        let core = SendCore::new(socks, peer, cfg, resume);
        if cfg.helper {
            match Helper::start(core, cfg.helper_threads) {
                Ok(h) => return SendComm::Helper(h),
                Err((core, e)) => {
                    tracing::warn!("{e}; sending to {peer} from the caller's thread instead");
                    return SendComm::Direct(core);
                }
            }
        }
        SendComm::Direct(core)
    }

    /// Peer address.
    pub fn peer(&self) -> SocketAddr {
        match self {
            SendComm::Direct(c) => c.peer,
            SendComm::Helper(h) => h.sh.lock_core().peer,
        }
    }

    /// Number of TCP streams.
    pub fn nstreams(&self) -> usize {
        match self {
            SendComm::Direct(c) => c.nstreams(),
            SendComm::Helper(h) => h.sh.lock_core().nstreams(),
        }
    }

    /// Its recovery counters.
    pub fn recovery_stats(&self) -> Arc<RecoveryStats> {
        match self {
            SendComm::Direct(c) => c.recovery_stats(),
            SendComm::Helper(h) => h.sh.lock_core().recovery_stats(),
        }
    }

    /// Tests: reset every stream from this end (the receiver gets a reset
    /// and keeps what its kernel holds, as from a middlebox).
    #[cfg(test)]
    pub(crate) fn reset_streams(&self) {
        self.reset_stream(None)
    }

    /// Tests: [`Self::reset_streams`], of stream `k` only (`Some(k)`).
    #[cfg(test)]
    pub(crate) fn reset_stream(&self, k: Option<usize>) {
        let reset =
            |c: &SendCore| c.streams.iter().enumerate().filter(|(i, _)| k.is_none_or(|k| k == *i)).for_each(|(_, s)| s.sock.reset_now());
        match self {
            SendComm::Direct(c) => reset(c),
            SendComm::Helper(h) => reset(&h.sh.lock_core()),
        }
    }

    /// Does it recover from a reset or silent stream (both ends said so)?
    pub fn recovers(&self) -> bool {
        match self {
            SendComm::Direct(c) => c.recovers(),
            SendComm::Helper(h) => h.sh.lock_core().recovers(),
        }
    }

    /// Queue a send; `Ok(None)` when all request slots are busy.
    ///
    /// # Safety
    /// `buf` must stay readable until `test` reports this request done or failed.
    pub unsafe fn isend(&mut self, buf: RawBuf, tag: i32) -> Result<Option<ReqId>> {
        // SAFETY: isend_p's contract is this fn's (`buf` readable until test
        // reports the request), which our caller promised.
        unsafe { self.isend_p(buf, tag, None) }
    }

    /// [`Self::isend`] with NCCL's profiler parent handle.
    ///
    /// # Safety
    /// As [`Self::isend`].
    pub unsafe fn isend_p(&mut self, buf: RawBuf, tag: i32, parent: Option<Parent>) -> Result<Option<ReqId>> {
        match self {
            // SAFETY: `buf` stays readable until test reports the request
            // (this fn's contract), which is the inner isend's contract.
            SendComm::Direct(c) => unsafe { c.isend(buf, tag, parent) },
            SendComm::Helper(h) => {
                let mut c = h.sh.lock_core();
                // the caller writes what fits at once (no hand-off for a
                // small message); the helper takes over what is left
                // SAFETY: `buf` stays readable until test reports the request
                // (this fn's contract); the helper thread reads it only until then.
                let r = unsafe { c.isend(buf, tag, parent) };
                let left = c.streams.iter().any(|st| st.wpos < st.q.len());
                drop(c);
                if left && matches!(r, Ok(Some(_))) {
                    h.posted();
                }
                r
            }
        }
    }

    /// `Ok(Some(size))` when the send is done, `Ok(None)` while in flight.
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        match self {
            SendComm::Direct(c) => c.test(id),
            // the helper holds the lock while it moves bytes: the request
            // is then not done yet; else the caller moves what it can
            SendComm::Helper(h) => {
                let Some(mut c) = h.sh.try_lock_core() else { return Ok(None) };
                let r = c.test(id);
                let moved = c.take_fds_changed();
                drop(c);
                if moved {
                    // a recovery brought new streams: the pool watches those now
                    h.rewatch();
                }
                r
            }
        }
    }
}
