//! The TCP data path: isend/irecv/test over one or more streams, driven from
//! the caller of `test` (and eagerly from isend/irecv), or by the process's
//! helper pool ([`super::helper`]). No allocation after a
//! comm is built; a dead or misbehaving peer fails every pending and later
//! request of the comm with an error naming it.
//!
//! **Recovery** (`RUSTNET_RECOVERY_TIMEOUT` > 0 at both ends; the rules are
//! `rustnet_proto::resume`, the sockets [`super::resume`]). The receiver
//! tells the sender how many bytes of each stream it has taken, in small
//! acknowledgement records on the reverse direction of stream 0 (at most
//! one write per [`ACK_DELAY`](crate::proto::resume::ACK_DELAY) while
//! receives are pending), and a send completes once all of it is
//! acknowledged, not once it is written: until then its pieces stay queued.
//! When a stream is reset, or the receiver is silent past
//! `RUSTNET_SOCKET_TIMEOUT`, the send comm reconnects to the receiving
//! process's resume port with the connection's token, learns the receiver's
//! byte count per stream, and resends from there; the receive comm takes the
//! new streams and goes on where it stood. NCCL's requests stay pending
//! meanwhile. A dead peer (its resume port refused, or its comm closed) or
//! a spent window fails the comm with an error naming the peer.
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::{AsRawFd, RawFd};

pub use super::helper::{Drive, Helper};
use super::resume::{Attempt, PortRef, Probe, Prober, Registration, ResetPlan, Step as AttemptStep};
use super::StreamCfg;
use crate::error::{Errno, Error, Result};
use crate::profiler::{Fields, OpenEvent, Parent, Profiler, MAX_EVENTS_PER_PARENT, SOCK_RECV, SOCK_SEND};
use crate::proto::handle::PROTO_VERSION;
use crate::proto::pool::{Pool, ReqId};
use crate::proto::resume::{
    check_resume_offset, fault_of, rewind, Ack, AckPolicy, Backoff, Fault, ResumeHello, ResumeReply, Rewind, Token, ACK_LEN, ATTEMPT_MAX,
};
use crate::proto::wire::{self, MsgHeader, RecvSpec, Verdict, HDR_LEN, MAX_STREAMS};
use crate::stats::RecoveryStats;
use crate::transport::sock::{Io, Socket, MAX_IOV};
use crate::transport::{Completion, RawBuf, RecvBuf, MAX_P2P_BYTES, MAX_RECVS, MAX_REQUESTS};

/// Staging buffer for stream 0 (headers and small payloads).
const STAGE_LEN: usize = 64 << 10;
/// Bytes one gather write offers before it stops adding queued pieces.
const WRITE_BATCH: usize = 1 << 20;
/// Payload remainders at least this large are read straight into NCCL's buffer.
const DIRECT_READ: usize = 16 << 10;
/// Room for one acknowledgement record per stream.
const ACK_BUF: usize = MAX_STREAMS * ACK_LEN;
/// A send comm waiting for acknowledgements looks for them at most this
/// often after a look that found none.
const ACK_POLL: Duration = Duration::from_micros(25);

/// Send requests in flight per comm: NCCL may post MAX_REQUESTS x maxRecvs.
pub const SEND_SLOTS: usize = MAX_REQUESTS * MAX_RECVS;

fn peer_error(peer: &SocketAddr, what: impl Into<String>) -> Error {
    Error::Remote { peer: peer.to_string(), what: what.into() }
}

fn io_error(peer: &SocketAddr, dir: &str, e: Errno) -> Error {
    let hint = match e.0 {
        libc::ECONNRESET | libc::EPIPE => " (the peer process died or closed its comm)",
        libc::ETIMEDOUT => " (no answer within RUSTNET_SOCKET_TIMEOUT: peer host down or network cut)",
        _ => "",
    };
    peer_error(peer, format!("{dir} failed: {e}{hint}"))
}

/// "N s" for a window in an error.
fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

// ---------------------------------------------------------------- send side

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

/// How often a send side waiting on its peer looks at TCP_INFO.
const ACK_LOOK_EVERY: Duration = Duration::from_millis(200);
/// How long "owes us an answer and silent past the timeout" must hold: a
/// window probe to a live receiver is answered within one round trip.
const ACK_SILENT_FOR: Duration = Duration::from_millis(500);

/// Dead-peer detection for a send side with data in flight: the peer has
/// not acknowledged anything for `RUSTNET_SOCKET_TIMEOUT` while it owes an
/// answer. A receiver that is alive but not reading (zero window) answers
/// the window probes and is never taken for dead. (Sans-IO: the caller
/// passes what TCP_INFO says.)
#[derive(Debug, Default)]
pub struct AckWatch {
    last_look: Option<Instant>,
    since: Option<Instant>,
}

impl AckWatch {
    /// Time for another look at the sockets?
    pub fn due(&mut self, now: Instant) -> bool {
        if self.last_look.is_some_and(|t| now.duration_since(t) < ACK_LOOK_EVERY) {
            return false;
        }
        self.last_look = Some(now);
        true
    }

    /// One look: per stream (owes an answer, ms since its last ack).
    /// `Some(ms)`: the peer is silent past the timeout; fail.
    pub fn look(&mut self, now: Instant, timeout_ms: u64, streams: impl IntoIterator<Item = (bool, u32)>) -> Option<u32> {
        let silent = streams.into_iter().filter(|&(owed, ms)| owed && u64::from(ms) >= timeout_ms).map(|(_, ms)| ms).max();
        match (silent, self.since) {
            (None, _) => {
                self.since = None;
                None
            }
            (Some(_), None) => {
                self.since = Some(now);
                None
            }
            (Some(ms), Some(t)) => (now.duration_since(t) >= ACK_SILENT_FOR).then_some(ms),
        }
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
    /// This process's resume port, held open while the comm lives: a
    /// receiver waiting for us finds it open, so it knows we are alive.
    pub port: Option<PortRef>,
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
    /// When a look for acknowledgements last found none.
    acks_empty_at: Option<Instant>,
}

/// A send comm between a failure and its reconnection.
struct Recovering {
    since: Instant,
    cause: String,
    backoff: Backoff,
    next: Instant,
    attempt: Option<Attempt>,
    last: String,
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
        let rec = resume.filter(|_| cfg.recovery_s > 0).map(|r| {
            Box::new(SendRec {
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
        SendCore {
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
        }
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
        });
    }

    /// Move the reconnection on: an attempt, its answer, the back-off, the window.
    fn recover_step(&mut self) {
        let now = Instant::now();
        let nstreams = self.streams.len();
        let Some(r) = self.rec.as_deref_mut() else { return };
        let Some(st) = r.state.as_mut() else { return };
        let mut outcome = None;
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
                AttemptStep::Done(s) => outcome = Some(Outcome::Resume(s)),
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
                    Ok(a) => st.attempt = Some(a),
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
            Some(Outcome::Resume(s)) => self.resume_with(s, now),
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
    fn resume_with(&mut self, socks: Vec<(Socket, u64)>, now: Instant) {
        for (k, (_, off)) in socks.iter().enumerate() {
            let st = &self.streams[k];
            if let Err(e) = check_resume_offset(k, st.acked, st.sent, *off) {
                self.failed = Some(Error::Protocol { peer: self.peer.to_string(), what: e.to_string() });
                return;
            }
        }
        let Some(r) = self.rec.as_deref_mut() else { return };
        let rs = r.state.take().expect("recovering");
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
        tracing::warn!(
            "TCP send comm to {}: recovered after {} (attempt {}; it had failed: {}); {replayed} byte(s) sent again",
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
        // a look that finds nothing costs a system call: NCCL polls test()
        // in a loop, so look again only ACK_POLL after an empty one
        let now = Instant::now();
        if r.acks_empty_at.is_some_and(|t| now.duration_since(t) < ACK_POLL) {
            return;
        }
        r.acks_empty_at = None;
        let mut fault = None;
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
                    self.failed =
                        Some(peer_error(&self.peer, "closed the connection (its receive comm was closed, or its process exited)"));
                    return;
                }
                Err(e) => {
                    fault = Some(e);
                    break;
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
        if let Some(e) = &self.failed {
            let e = e.clone();
            let _ = self.reqs.release(id);
            self.stop_events();
            return Err(e);
        }
        if !done {
            return Ok(None);
        }
        self.reqs.release(id).unwrap();
        Ok(Some(Completion::one(size)))
    }
}

impl SendCore {
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

// ---------------------------------------------------------------- recv side

struct Expect {
    req: ReqId,
    ptr: *mut u8,
    len: usize,
    got: usize,
    /// Its profiler event (stopped when the piece is read or dropped).
    ev: Option<OpenEvent>,
}

struct RecvReq {
    n: usize,
    bufs: [RecvBuf; MAX_RECVS],
    specs: [RecvSpec; MAX_RECVS],
    sizes: [usize; MAX_RECVS],
    unmatched: usize,
    pieces_left: usize,
    /// NCCL's profiler parent handle of each buffer.
    parents: [Option<Parent>; MAX_RECVS],
}

struct RecvStream {
    sock: Socket,
    q: VecDeque<Expect>,
    /// Bytes taken from this stream in total (into NCCL's buffers or the
    /// staging buffer): what a reconnection resumes from.
    taken: u64,
}

/// What a receive comm needs to recover (both ends offered recovery at set-up).
pub struct RecvResume {
    /// Its place in the process's registry of resumable comms (with its resume port).
    pub reg: Registration,
    /// The sender process's resume port: probed while waiting, refused = gone.
    pub probe: Option<SocketAddr>,
    /// IP TOS / IPv6 traffic class of the streams (the listening context's).
    pub tos: Option<u8>,
}

/// A receive comm's recovery state.
struct RecvRec {
    window: Duration,
    r: RecvResume,
    bufsize: u64,
    timeout_s: i64,
    /// What each stream's acknowledgements said last.
    acked: [u64; MAX_STREAMS],
    /// Acknowledgement records not yet written (a short write leaves some).
    ack_out: [u8; ACK_BUF],
    ack_lo: usize,
    ack_hi: usize,
    policy: AckPolicy,
    waiting: Option<Waiting>,
    /// The last reconnection attempt taken.
    epoch: u64,
    /// New streams since the helper pool last registered ours.
    fds_changed: bool,
    /// Our acknowledgements unanswered past RUSTNET_SOCKET_TIMEOUT: a cut.
    watch: AckWatch,
}

/// A receive comm whose streams failed, until its sender reconnects.
struct Waiting {
    since: Instant,
    cause: String,
    prober: Option<Prober>,
}

/// The receiving end of a TCP connection, driven by whoever holds it.
pub struct RecvCore {
    streams: Vec<RecvStream>,
    reqs: Pool<RecvReq>,
    /// Posted receives that still wait for messages, in posting order.
    order: VecDeque<ReqId>,
    /// Bytes read from stream 0 ahead of where they belong.
    stage: Box<[u8]>,
    stage_lo: usize,
    stage_hi: usize,
    failed: Option<Error>,
    peer: SocketAddr,
    min_chunk: usize,
    /// The last message header announced a payload worth reading straight
    /// into NCCL's buffer: read the next header alone (16 bytes), not a
    /// staging buffer full of payload that would then be copied.
    big: bool,
    /// Stream 0 gave less than asked in this progress call: it is drained,
    /// another read would only say EAGAIN.
    drained: bool,
    /// Bytes were taken since the acknowledgement policy last heard of it.
    took: bool,
    /// A piece (or an empty message) was completed since then.
    done_piece: bool,
    /// Recovery (None: off at either end; nothing is acknowledged).
    rec: Option<Box<RecvRec>>,
    stats: Arc<RecoveryStats>,
    /// RUSTNET_FAULT_TCP_RESET for receive comms, and the reading steps so far.
    fault: Option<ResetPlan>,
    reads: u64,
}

// SAFETY: as for SendComm: raw pointers are NCCL receive buffers valid until
// completion, and the comm is used by one thread at a time.
unsafe impl Send for RecvCore {}

enum Step {
    Progress,
    Blocked,
    /// A reset or cut stream (only when the comm recovers).
    Link(Errno),
}

/// A read error: a reset or cut stream where the comm recovers, else the comm's failure.
fn read_error(resumable: bool, peer: &SocketAddr, e: Errno) -> Result<Step> {
    if resumable && fault_of(e.0) == Fault::Link {
        Ok(Step::Link(e))
    } else {
        Err(io_error(peer, "receive", e))
    }
}

impl RecvCore {
    /// The failure ends every open piece event: nothing more moves.
    fn stop_events(&mut self) {
        for st in &mut self.streams {
            for p in st.q.iter_mut() {
                p.ev = None;
            }
        }
    }

    /// Build from accepted streams; `resume` when both ends recover.
    pub fn new(socks: Vec<Socket>, peer: SocketAddr, cfg: StreamCfg, resume: Option<RecvResume>) -> RecvCore {
        let rec = resume.filter(|_| cfg.recovery_s > 0).map(|r| {
            Box::new(RecvRec {
                window: Duration::from_secs(cfg.recovery_s as u64),
                r,
                bufsize: cfg.bufsize,
                timeout_s: cfg.timeout_s,
                acked: [0; MAX_STREAMS],
                ack_out: [0; ACK_BUF],
                ack_lo: 0,
                ack_hi: 0,
                policy: AckPolicy::default(),
                waiting: None,
                epoch: 0,
                fds_changed: false,
                watch: AckWatch::default(),
            })
        });
        RecvCore {
            streams: socks
                .into_iter()
                .map(|sock| RecvStream { sock, q: VecDeque::with_capacity(MAX_REQUESTS * MAX_RECVS), taken: 0 })
                .collect(),
            reqs: Pool::new(MAX_REQUESTS),
            order: VecDeque::with_capacity(MAX_REQUESTS),
            stage: vec![0u8; STAGE_LEN].into_boxed_slice(),
            stage_lo: 0,
            stage_hi: 0,
            failed: None,
            peer,
            min_chunk: cfg.min_chunk,
            big: false,
            drained: false,
            took: false,
            done_piece: false,
            rec,
            stats: Arc::default(),
            fault: cfg.fault_reset.filter(|p| !p.send),
            reads: 0,
        }
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

    /// New streams since the last call (the helper pool must watch them).
    pub fn take_fds_changed(&mut self) -> bool {
        self.rec.as_mut().is_some_and(|r| std::mem::take(&mut r.fds_changed))
    }

    /// Waiting for the sender to reconnect?
    #[inline]
    fn waiting(&self) -> bool {
        self.rec.as_ref().is_some_and(|r| r.waiting.is_some())
    }

    /// Post a (grouped) receive; `Ok(None)` when all request slots are busy.
    ///
    /// # Safety
    /// Every buffer must stay writable until `test` reports this request done or failed.
    /// `parents[i]`: NCCL's profiler parent handle of buffer i.
    pub unsafe fn irecv(&mut self, bufs: &[RecvBuf], parents: &[Option<Parent>]) -> Result<Option<ReqId>> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(Error::InvalidArg(format!("irecv with n={} (1..={MAX_RECVS} accepted)", bufs.len())));
        }
        let mut r = RecvReq {
            n: bufs.len(),
            bufs: [RecvBuf { buf: RawBuf::EMPTY, tag: 0 }; MAX_RECVS],
            specs: [RecvSpec { cap: 0, tag: 0, matched: false }; MAX_RECVS],
            sizes: [0; MAX_RECVS],
            unmatched: bufs.len(),
            pieces_left: 0,
            parents: [None; MAX_RECVS],
        };
        for (i, b) in bufs.iter().enumerate() {
            r.bufs[i] = *b;
            r.specs[i] = RecvSpec { cap: b.buf.len, tag: b.tag, matched: false };
            r.parents[i] = parents.get(i).copied().flatten();
        }
        let Some(id) = self.reqs.alloc(r) else { return Ok(None) };
        self.order.push_back(id);
        if self.rec.is_some() {
            // an acknowledgement held back for the delay may go now
            self.note_taken();
            self.flush_acks(false);
        }
        // No I/O here (as NCCL's socket transport): the data of a receive
        // just posted is rarely there yet, and `test` reads it anyway.
        Ok(Some(id))
    }

    fn fail(&mut self, e: Error) {
        if self.failed.is_none() {
            self.failed = Some(e);
        }
    }

    /// Read more of stream 0 into the staging buffer (after moving what is
    /// left to its front). Small messages then cost one system call for many.
    fn refill(&mut self) -> Result<Step> {
        if self.drained {
            return Ok(Step::Blocked);
        }
        if self.stage_lo > 0 {
            self.stage.copy_within(self.stage_lo..self.stage_hi, 0);
            self.stage_hi -= self.stage_lo;
            self.stage_lo = 0;
        }
        let peer = self.peer;
        let hi = self.stage_hi;
        // a header after a large message: read just the header, its payload
        // then goes straight to NCCL's buffer
        let want = if self.big && self.streams[0].q.is_empty() && hi < HDR_LEN { HDR_LEN - hi } else { STAGE_LEN - hi };
        match self.streams[0].sock.read(&mut self.stage[hi..hi + want]) {
            Ok(Io::Done(n)) => {
                self.stage_hi += n;
                self.streams[0].taken += n as u64;
                self.took = true;
                self.drained = n < want;
                Ok(Step::Progress)
            }
            Ok(Io::Again) => Ok(Step::Blocked),
            Ok(Io::Eof) if self.streams[0].q.is_empty() && self.stage_hi == 0 => {
                Err(peer_error(&peer, "closed the connection while receives were posted (peer process exited or closed its send comm)"))
            }
            Ok(Io::Eof) => Err(peer_error(&peer, "closed the connection in the middle of a message")),
            Err(e) => read_error(self.rec.is_some(), &peer, e),
        }
    }

    /// Stream 0: headers and chunk 0 of each message.
    fn step_stream0(&mut self) -> Result<Step> {
        let peer = self.peer;
        let resumable = self.rec.is_some();
        let st0 = &mut self.streams[0];
        if let Some(x) = st0.q.front_mut() {
            let staged = self.stage_hi - self.stage_lo;
            let need = x.len - x.got;
            let moved = if staged > 0 {
                let n = staged.min(need);
                // SAFETY: x.ptr..x.ptr+x.len lies in a posted receive buffer;
                // the staging buffer is ours and does not overlap it.
                unsafe { std::ptr::copy_nonoverlapping(self.stage[self.stage_lo..].as_ptr(), x.ptr.add(x.got), n) };
                self.stage_lo += n;
                n
            } else if need >= DIRECT_READ {
                if self.drained {
                    return Ok(Step::Blocked);
                }
                // The payload's end and the next message's header in one
                // call: the header lands in the (empty) staging buffer.
                self.stage_lo = 0;
                self.stage_hi = 0;
                let hdr = (self.stage.as_mut_ptr(), HDR_LEN);
                // SAFETY: x.ptr+x.got .. +need is the rest of a posted receive buffer
                // (need = x.len - x.got); the staging buffer is ours, HDR_LEN <=
                // STAGE_LEN, and it does not overlap NCCL's buffer.
                match unsafe { st0.sock.read_raw2((x.ptr.add(x.got), need), hdr) } {
                    Ok(Io::Done(n)) => {
                        st0.taken += n as u64;
                        self.took = true;
                        self.drained = n < need + HDR_LEN;
                        self.stage_hi = n.saturating_sub(need);
                        n.min(need)
                    }
                    Ok(Io::Again) => return Ok(Step::Blocked),
                    Ok(Io::Eof) => return Err(peer_error(&peer, "closed the connection in the middle of a message")),
                    Err(e) => return read_error(resumable, &peer, e),
                }
            } else {
                return self.refill();
            };
            x.got += moved;
            if x.got == x.len {
                let req = x.req;
                st0.q.pop_front();
                self.done_piece = true;
                if let Ok(r) = self.reqs.get_mut(req) {
                    r.pieces_left -= 1;
                }
            }
            return Ok(Step::Progress);
        }
        if self.order.is_empty() {
            return Ok(Step::Blocked);
        }
        if self.stage_hi - self.stage_lo < HDR_LEN {
            return self.refill();
        }
        let hdr: [u8; HDR_LEN] = self.stage[self.stage_lo..self.stage_lo + HDR_LEN].try_into().unwrap();
        let h = MsgHeader::decode(&hdr).map_err(|w| Error::Protocol { peer: peer.to_string(), what: w.to_string() })?;
        // The message lands in the first posted receive that still has a
        // free buffer with its tag: per tag, sends and receives match in
        // posting order (with shared comms one rank's next step may arrive
        // before another rank's send completes the current group, as NCCL's
        // IB transport allows by answering "not yet").
        let target = self
            .order
            .iter()
            .copied()
            .find(|&id| self.reqs.get(id).is_ok_and(|r| r.specs[..r.n].iter().any(|s| !s.matched && s.tag == h.tag)));
        let Some(id) = target else {
            if self.order.len() == self.reqs.capacity() {
                // every receive slot holds a receive still waiting for
                // messages and none wants this tag: no receive NCCL can still
                // post would take it (slots holding finished receives free
                // up when NCCL tests them)
                let head = *self.order.front().unwrap();
                let r = self.reqs.get(head).map_err(|s| Error::Internal(format!("receive order queue: {s}")))?;
                let e = wire::match_recv(&r.specs[..r.n], h.tag, h.size).err().map(|e| e.to_string()).unwrap_or_default();
                return Err(Error::Usage(format!("{e} (and no other posted receive takes tag {})", h.tag)));
            }
            return Ok(Step::Blocked);
        };
        let r = self.reqs.get_mut(id).map_err(|s| Error::Internal(format!("receive order queue: {s}")))?;
        let i = wire::match_recv(&r.specs[..r.n], h.tag, h.size).map_err(|e| Error::Usage(e.to_string()))?;
        self.stage_lo += HDR_LEN;
        let size = h.size as usize;
        self.big = size >= DIRECT_READ;
        r.specs[i].matched = true;
        r.sizes[i] = size;
        r.unmatched -= 1;
        let base = r.bufs[i].buf.ptr;
        let parent = r.parents[i];
        let nstreams = self.streams.len();
        for (s, off, len) in wire::chunks(size, nstreams, self.min_chunk) {
            // SAFETY: off + len <= size <= the posted capacity (checked by match_recv).
            let ptr = unsafe { base.add(off) };
            let st = &mut self.streams[s];
            let ev = parent
                .filter(|_| s < MAX_EVENTS_PER_PARENT)
                .and_then(|p| Profiler::start(p, &Fields::Sock { fd: st.sock.as_raw_fd(), op: SOCK_RECV, len }));
            st.q.push_back(Expect { req: id, ptr, len, got: 0, ev });
            r.pieces_left += 1;
        }
        if size == 0 {
            self.done_piece = true;
        }
        if r.unmatched == 0 {
            self.order.retain(|&o| o != id);
        }
        Ok(Step::Progress)
    }

    /// Move bytes until every stream would block or has nothing expected;
    /// first take a reconnection that arrived. With recovery, under the
    /// gate the resume port checks before it answers for this comm.
    pub fn progress(&mut self) {
        if self.failed.is_some() {
            return;
        }
        let Some(r) = self.rec.as_deref() else { return self.progress_streams() };
        let m = r.r.reg.mailbox();
        if !m.enter() {
            // the resume port is answering for us right now: next time
            return;
        }
        if m.ready() {
            self.adopt();
        }
        if !self.waiting() {
            self.progress_streams();
        }
        if let Some(r) = self.rec.as_deref() {
            r.r.reg.mailbox().leave(self.streams.iter().map(|s| s.taken));
        }
    }

    fn progress_streams(&mut self) {
        if self.failed.is_some() {
            return;
        }
        let before = if self.fault.is_some() { self.streams.iter().map(|s| s.taken).sum::<u64>() } else { 0 };
        self.drained = false;
        loop {
            match self.step_stream0() {
                Ok(Step::Progress) => continue,
                Ok(Step::Blocked) => break,
                Ok(Step::Link(e)) => return self.link_fault(format!("receive failed: {e}")),
                Err(e) => return self.fail(e),
            }
        }
        let peer = self.peer;
        let resumable = self.rec.is_some();
        let mut link = None;
        'streams: for st in self.streams.iter_mut().skip(1) {
            while let Some(x) = st.q.front_mut() {
                // SAFETY: x.ptr+x.got .. x.ptr+x.len is the rest of this stream's chunk,
                // inside a posted receive buffer that NCCL keeps writable until the
                // request completes.
                match unsafe { st.sock.read_raw(x.ptr.add(x.got), x.len - x.got) } {
                    Ok(Io::Done(n)) => {
                        st.taken += n as u64;
                        self.took = true;
                        let short = n < x.len - x.got;
                        x.got += n;
                        if x.got == x.len {
                            let req = x.req;
                            st.q.pop_front();
                            self.done_piece = true;
                            if let Ok(r) = self.reqs.get_mut(req) {
                                r.pieces_left -= 1;
                            }
                        }
                        if short {
                            // drained: the next read would say EAGAIN
                            break;
                        }
                    }
                    Ok(Io::Again) => break,
                    Ok(Io::Eof) => {
                        self.failed = Some(peer_error(&peer, "closed a data stream in the middle of a message"));
                        return;
                    }
                    Err(e) => match read_error(resumable, &peer, e) {
                        Ok(_) => {
                            link = Some(e);
                            break 'streams;
                        }
                        Err(err) => {
                            self.failed = Some(err);
                            return;
                        }
                    },
                }
            }
        }
        if let Some(e) = link {
            return self.link_fault(format!("receive failed: {e}"));
        }
        if let Some(plan) = self.fault {
            if self.streams.iter().map(|s| s.taken).sum::<u64>() > before {
                self.reads += 1;
                if plan.hits(self.reads) {
                    let k = (self.reads as usize) % self.streams.len();
                    tracing::warn!("RUSTNET_FAULT_TCP_RESET: resetting stream {k} from {} after read {}", self.peer, self.reads);
                    self.streams[k].sock.reset_now();
                }
            }
        }
    }

    /// `Ok(Some(sizes))` when every buffer of the receive is filled.
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        let r = self.reqs.get(id).map_err(|s| Error::Usage(format!("test on receive request: {s}")))?;
        // already filled by an earlier read: no system call to say so
        let pending = r.unmatched > 0 || r.pieces_left > 0;
        if self.rec.is_some() {
            self.tick(pending);
        }
        if pending {
            self.progress();
            self.note_taken();
        }
        if let Some(e) = &self.failed {
            let e = e.clone();
            if let Some(r) = self.rec.as_deref() {
                r.r.reg.mailbox().close();
            }
            if self.reqs.release(id).is_ok() {
                self.order.retain(|&o| o != id);
            }
            // no byte moves any more: stop every piece's event before NCCL hears of it
            self.stop_events();
            return Err(e);
        }
        let r = self.reqs.get(id).unwrap();
        if r.unmatched == 0 && r.pieces_left == 0 {
            let mut c = Completion { n: r.n, sizes: [0; MAX_RECVS] };
            c.sizes[..r.n].copy_from_slice(&r.sizes[..r.n]);
            self.reqs.release(id).unwrap();
            if self.rec.is_some() && self.reqs.is_empty() {
                // nothing pending: no later call is sure to come, so the
                // sender hears now what it may complete
                self.flush_acks(true);
            }
            return Ok(Some(c));
        }
        Ok(None)
    }

    // ------------------------------------------------------------ recovery

    /// Bytes were taken: date the acknowledgement they are owed (one clock
    /// read per acknowledgement, not per read).
    #[inline]
    fn note_taken(&mut self) {
        if std::mem::take(&mut self.took) {
            if let Some(r) = self.rec.as_deref_mut() {
                if !r.policy.owed() {
                    r.policy.took(Instant::now());
                }
            }
        }
        if std::mem::take(&mut self.done_piece) {
            if let Some(r) = self.rec.as_deref_mut() {
                r.policy.completed();
            }
        }
    }

    /// Write the acknowledgements when the policy says so (`idle`: no
    /// receive pending), or the rest of a short earlier write.
    fn flush_acks(&mut self, idle: bool) {
        let Some(r) = self.rec.as_deref_mut() else { return };
        if r.waiting.is_some() {
            return;
        }
        if r.ack_lo == r.ack_hi {
            if !r.policy.owed() || !(idle || r.policy.due(Instant::now(), false)) {
                return;
            }
            let mut n = 0;
            for (k, st) in self.streams.iter().enumerate() {
                if st.taken > r.acked[k] {
                    r.ack_out[n..n + ACK_LEN].copy_from_slice(&Ack { stream: k as u16, offset: st.taken }.encode());
                    r.acked[k] = st.taken;
                    n += ACK_LEN;
                }
            }
            r.policy.sent();
            r.ack_lo = 0;
            r.ack_hi = n;
        }
        let mut fault = None;
        while r.ack_lo < r.ack_hi {
            match self.streams[0].sock.write(&r.ack_out[r.ack_lo..r.ack_hi]) {
                Ok(Io::Done(k)) => r.ack_lo += k,
                // the sender is not reading them now: the rest goes at a later call
                Ok(_) => break,
                Err(e) => {
                    fault = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = fault {
            match read_error(true, &self.peer, e) {
                Ok(_) => self.link_fault(format!("sending acknowledgements failed: {e}")),
                Err(_) => self.fail(io_error(&self.peer, "sending acknowledgements", e)),
            }
        }
    }

    /// A reset or cut stream: wait for the sender to reconnect (when on).
    fn link_fault(&mut self, cause: String) {
        let peer = self.peer;
        let Some(r) = self.rec.as_deref_mut() else {
            return self.fail(peer_error(&peer, cause));
        };
        if r.waiting.is_some() {
            return;
        }
        tracing::warn!(
            "TCP receive comm from {peer}: {cause}; waiting for the sender to reconnect \
             (RUSTNET_RECOVERY_TIMEOUT={} s; NCCL's receives stay pending)",
            r.window.as_secs()
        );
        r.waiting = Some(Waiting { since: Instant::now(), cause, prober: r.r.probe.map(Prober::new) });
    }

    /// The recovery's share of a `test`: a reconnection to take, the
    /// resume port to serve, a silence to notice, a wait to end, the
    /// acknowledgements to write.
    fn tick(&mut self, pending: bool) {
        self.note_taken();
        let Some(r) = self.rec.as_deref() else { return };
        if r.r.reg.mailbox().ready() {
            // take it before judging the wait (the resume port may have
            // answered for us while NCCL called nothing here)
            self.progress();
        }
        let Some(r) = self.rec.as_deref() else { return };
        if r.waiting.is_some() {
            return self.wait_step(Instant::now());
        }
        if pending {
            self.watch(Instant::now());
        }
        self.flush_acks(false);
    }

    /// Our acknowledgements owed an answer and none came for
    /// RUSTNET_SOCKET_TIMEOUT (a cut link): wait for the sender.
    fn watch(&mut self, now: Instant) {
        let Some(r) = self.rec.as_deref_mut() else { return };
        if !r.watch.due(now) {
            return;
        }
        let st = match self.streams[0].sock.ack_state() {
            Ok(s) => s,
            Err(e) => return self.link_fault(format!("TCP_INFO failed: {e}")),
        };
        let timeout_ms = r.timeout_s.max(1) as u64 * 1000;
        if let Some(ms) = r.watch.look(now, timeout_ms, [st]) {
            let t = r.timeout_s;
            self.link_fault(format!(
                "no acknowledgement of ours answered for {:.1} s (RUSTNET_SOCKET_TIMEOUT={t}): the link is cut or the sender's host is down",
                f64::from(ms) / 1000.0
            ));
        }
    }

    /// Waiting: is the sender's process still there, is the window spent?
    fn wait_step(&mut self, now: Instant) {
        let peer = self.peer;
        let Some(r) = self.rec.as_deref_mut() else { return };
        let window = r.window;
        let Some(w) = r.waiting.as_mut() else { return };
        let waited = now.duration_since(w.since);
        if let Some(p) = w.prober.as_mut() {
            if p.step(now) == Some(Probe::Gone) {
                let e = format!(
                    "its process is gone: its resume port {} refused a connection {} after the stream failed ({})",
                    p.addr(),
                    secs(waited),
                    w.cause
                );
                return self.fail(peer_error(&peer, e));
            }
        }
        if waited >= window {
            let e = format!(
                "the sender did not reconnect within RUSTNET_RECOVERY_TIMEOUT={} s (waited {}) after: {}",
                window.as_secs(),
                secs(waited),
                w.cause
            );
            self.fail(peer_error(&peer, e));
        }
    }

    /// A reconnection arrived: answer each new stream with our byte count
    /// of it (unless the resume port already did, while we stood still)
    /// and carry on from there. Called under the gate, before any read.
    fn adopt(&mut self) {
        let peer = self.peer;
        let failed = self.failed.is_some();
        let Some(r) = self.rec.as_deref_mut() else { return };
        let Some(m) = r.r.reg.mailbox().take() else { return };
        let answer = |socks: &[Socket], v: Verdict| {
            for s in socks {
                let _ = s.write(&ResumeReply { verdict: v, version: PROTO_VERSION, offset: 0 }.encode());
            }
        };
        if failed {
            // NCCL will close it: the sender should fail now, not retry
            return answer(&m.socks, Verdict::UnknownComm);
        }
        if let Some(offs) = &m.answered {
            // answered for us: by the gate, nothing was read since
            if offs.len() != self.streams.len() || self.streams.iter().zip(offs).any(|(st, &o)| st.taken != o) {
                let have: Vec<u64> = self.streams.iter().map(|s| s.taken).collect();
                return self.fail(Error::Internal(format!(
                    "TCP receive comm from {peer}: a reconnection was answered with {offs:?} bytes per stream but {have:?} were taken"
                )));
            }
        } else if m.socks.len() != self.streams.len() || self.streams.iter().zip(&m.sent).any(|(st, &s)| st.taken > s) {
            let have: Vec<u64> = self.streams.iter().map(|s| s.taken).collect();
            tracing::warn!(
                "TCP receive comm from {peer}: refused a reconnection from {} that claims to have written {:?} bytes per stream, \
                 less than the {have:?} received",
                m.peer,
                m.sent
            );
            return answer(&m.socks, Verdict::Inconsistent);
        }
        // the answers first: 24 bytes into each fresh socket go in one write,
        // or the attempt is dropped and the sender tries again
        if m.answered.is_none() {
            for (st, s) in self.streams.iter().zip(&m.socks) {
                let reply = ResumeReply { verdict: Verdict::Accepted, version: PROTO_VERSION, offset: st.taken }.encode();
                if !matches!(s.write(&reply), Ok(Io::Done(n)) if n == reply.len()) {
                    return;
                }
            }
        }
        let mut replayed = 0u64;
        for (k, (st, s)) in self.streams.iter_mut().zip(m.socks).enumerate() {
            let _ = s.tune_stream(r.timeout_s, r.bufsize);
            if let Some(t) = r.r.tos {
                let _ = s.set_tos(peer.is_ipv6(), t);
            }
            replayed += m.sent[k] - st.taken;
            st.sock.set_abortive_close();
            st.sock = s;
            r.acked[k] = st.taken;
        }
        r.ack_lo = 0;
        r.ack_hi = 0;
        r.policy.sent();
        r.epoch = m.epoch;
        r.fds_changed = true;
        r.watch = AckWatch::default();
        let noticed = r.waiting.take();
        let took = noticed.as_ref().map_or(Duration::from_millis(u64::from(m.elapsed_ms)), |w| w.since.elapsed());
        self.drained = false;
        self.stats.record(took, replayed);
        tracing::warn!(
            "TCP receive comm from {peer}: recovered after {} ({}); the sender resends {replayed} byte(s) from where this end stood",
            secs(took),
            noticed.map_or_else(|| "the sender reconnected before this end noticed".to_string(), |w| w.cause)
        );
    }
}

impl Drop for RecvCore {
    fn drop(&mut self) {
        if self.rec.is_some() {
            // our acknowledgements end with a FIN: the sender tells a closed comm from a fault
            self.streams[0].sock.shutdown_write();
        }
    }
}

impl Drive for RecvCore {
    fn progress(&mut self) {
        RecvCore::progress(self)
    }
    fn fail_with(&mut self, e: Error) {
        self.fail(e)
    }
    fn fds(&self, out: &mut [RawFd; MAX_STREAMS]) -> usize {
        for (o, st) in out.iter_mut().zip(&self.streams) {
            *o = st.sock.as_raw_fd();
        }
        self.streams.len().min(MAX_STREAMS)
    }
    fn sends(&self) -> bool {
        false
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

/// The receiving end of a TCP connection: driven from `test`, or by a
/// helper thread.
#[allow(clippy::large_enum_variant)] // the direct core stays inline: it is the common case, and one per comm
pub enum RecvComm {
    /// The caller of irecv/test moves the bytes.
    Direct(RecvCore),
    /// A helper thread moves them.
    Helper(Helper<RecvCore>),
}

impl RecvComm {
    /// Stop the helper thread, if any, without waiting (see [`Helper::halt`]).
    pub fn halt(&self) {
        if let RecvComm::Helper(h) = self {
            h.halt();
        }
    }

    /// Build from accepted streams; `resume` when both ends recover.
    pub fn new(socks: Vec<Socket>, peer: SocketAddr, cfg: StreamCfg, resume: Option<RecvResume>) -> RecvComm {
        let core = RecvCore::new(socks, peer, cfg, resume);
        if cfg.helper {
            match Helper::start(core, cfg.helper_threads) {
                Ok(h) => return RecvComm::Helper(h),
                Err((core, e)) => {
                    tracing::warn!("{e}; receiving from {peer} from the caller's thread instead");
                    return RecvComm::Direct(core);
                }
            }
        }
        RecvComm::Direct(core)
    }

    /// Peer address.
    pub fn peer(&self) -> SocketAddr {
        match self {
            RecvComm::Direct(c) => c.peer,
            RecvComm::Helper(h) => h.sh.lock_core().peer,
        }
    }

    /// Its recovery counters.
    pub fn recovery_stats(&self) -> Arc<RecoveryStats> {
        match self {
            RecvComm::Direct(c) => c.recovery_stats(),
            RecvComm::Helper(h) => h.sh.lock_core().recovery_stats(),
        }
    }

    /// Does it recover from a reset or silent stream (both ends said so)?
    pub fn recovers(&self) -> bool {
        match self {
            RecvComm::Direct(c) => c.recovers(),
            RecvComm::Helper(h) => h.sh.lock_core().recovers(),
        }
    }

    /// Post a (grouped) receive; `Ok(None)` when all request slots are busy.
    ///
    /// # Safety
    /// Every buffer must stay writable until `test` reports this request done or failed.
    pub unsafe fn irecv(&mut self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        // SAFETY: irecv_p's contract is this fn's (every buffer writable until
        // test reports the request), which our caller promised.
        unsafe { self.irecv_p(bufs, &[]) }
    }

    /// [`Self::irecv`] with NCCL's profiler parent handle of each buffer.
    ///
    /// # Safety
    /// As [`Self::irecv`].
    pub unsafe fn irecv_p(&mut self, bufs: &[RecvBuf], parents: &[Option<Parent>]) -> Result<Option<ReqId>> {
        match self {
            // SAFETY: every buffer stays writable until test reports the
            // request (this fn's contract), which is the inner irecv's contract.
            RecvComm::Direct(c) => unsafe { c.irecv(bufs, parents) },
            RecvComm::Helper(h) => {
                // SAFETY: every buffer stays writable until test reports the
                // request (this fn's contract); the helper writes only until then.
                let r = unsafe { h.sh.lock_core().irecv(bufs, parents) };
                if matches!(r, Ok(Some(_))) {
                    h.posted();
                }
                r
            }
        }
    }

    /// `Ok(Some(sizes))` when every buffer of the receive is filled.
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        match self {
            RecvComm::Direct(c) => c.test(id),
            RecvComm::Helper(h) => {
                let Some(mut c) = h.sh.try_lock_core() else { return Ok(None) };
                let r = c.test(id);
                let moved = c.take_fds_changed();
                drop(c);
                if moved {
                    h.rewatch();
                }
                r
            }
        }
    }
}

#[cfg(test)]
#[path = "p2p_tests.rs"]
mod tests;
