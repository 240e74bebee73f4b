//! The receiving end of the TCP data path ([`super::p2p`] tells the whole
//! path and its recovery, and holds what both ends share): [`RecvCore`]
//! matches posted receives with the messages on the streams and reads their
//! bytes, and with recovery acknowledges what it took and takes a
//! reconnecting sender's new streams; [`RecvComm`] is the comm NCCL holds,
//! driven from `test` or by a helper thread.
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::{AsRawFd, RawFd};

use super::helper::{Drive, Helper};
use super::p2p::{io_error, peer_error, secs, AckWatch, ACK_BUF, DIRECT_READ, STAGE_LEN};
use super::resume::{Probe, Prober, Registration, ResetPlan};
use super::StreamCfg;
use crate::error::{Errno, Error, Result};
use crate::profiler::{Fields, OpenEvent, Parent, Profiler, MAX_EVENTS_PER_PARENT, SOCK_RECV};
use crate::proto::handle::PROTO_VERSION;
use crate::proto::pool::{Pool, ReqId};
use crate::proto::resume::{
    fault_of, resume_offset, Ack, AckPolicy, Fault, OldStreams, ResumeReply, SenderQuery, ACK_LEN, REPLY_QUEUED_OFFSETS,
};
use crate::proto::wire::{self, MsgHeader, RecvSpec, Verdict, HDR_LEN, MAX_STREAMS};
use crate::stats::RecoveryStats;
use crate::transport::sock::{Io, Socket};
use crate::transport::{Completion, RawBuf, RecvBuf, MAX_RECVS, MAX_REQUESTS};

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
    /// Sockets reconnections replaced that still hold bytes their kernel
    /// acknowledged (counted in the offsets answered): read before `sock`.
    old: OldStreams<Socket>,
}

/// Where a read of a stream goes: its oldest replaced socket that still
/// holds bytes (and at most how many), else its current one.
fn source(st: &RecvStream) -> (&Socket, usize, bool) {
    match st.old.source() {
        Some((s, n)) => (s, usize::try_from(n).unwrap_or(usize::MAX), true),
        None => (&st.sock, usize::MAX, false),
    }
}

/// `n` bytes were read from a replaced socket: close it once it gave all it held.
fn took_old(st: &mut RecvStream, n: usize) {
    if let Some(s) = st.old.took(n as u64) {
        s.set_abortive_close();
    }
}

/// A replaced socket ended before the bytes its kernel had acknowledged
/// were read: they are gone, and the sender completed them.
fn old_stream_lost(peer: &SocketAddr, k: usize, left: u64, how: &str) -> Error {
    peer_error(
        peer,
        format!(
            "stream {k}'s earlier connection {how} with {left} byte(s) still to read that this host had acknowledged \
             (and its sender completed): they are lost"
        ),
    )
}

/// What a receive comm needs to recover (both ends offered recovery at set-up).
pub struct RecvResume {
    /// Its place in the process's registry of resumable comms (with its resume port).
    pub reg: Registration,
    /// The sender process's resume port: probed while waiting, refused = gone.
    pub probe: Option<SocketAddr>,
    /// What to ask that port about the sender's comm (None: a build that
    /// does not answer; only its process is probed).
    pub query: Option<SenderQuery>,
    /// IP TOS / IPv6 traffic class of the streams (the listening context's).
    pub tos: Option<u8>,
    /// Resume offsets count the bytes this host holds unread, and those are
    /// read from the replaced sockets first (`REPLY_QUEUED_OFFSETS`, said in
    /// the acceptance).
    pub queued: bool,
    /// Its sender completes on this host's kernel acknowledgements (it said
    /// so in its hello, and `queued`): our acknowledgements only keep the
    /// connection's liveness ([`AckPolicy::liveness`]).
    pub kernel_acks: bool,
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
///
/// How long a receive comm whose sender is gone waits for NCCL to take the
/// bytes this host still holds of it, with nothing taken meanwhile.
const VERDICT_GRACE: Duration = Duration::from_secs(1);

/// The recovery window is charged in full only while NCCL waits on this
/// comm (a receive not yet reported) *and* the sender's process is not
/// known to be reachable (its resume port did not answer the last probe):
/// a sender that is alive and reachable again reconnects at its next send,
/// however late its rank gets there (a checkpoint, an evaluation), as it
/// would have sent had no fault happened; and a comm nobody waits on loses
/// nothing by waiting. That other time is charged at a tenth, so that the
/// wait ends after ten windows whatever happens. A dead sender is found by
/// the probe (refused) at once.
struct Waiting {
    since: Instant,
    cause: String,
    prober: Option<Prober>,
    /// The window's share of the wait so far.
    charged: Duration,
    /// When the wait was last looked at.
    last: Instant,
    /// A receive waited at the last look.
    awaited: bool,
    /// The last probe found the sender's resume port open.
    reachable: bool,
    /// The INFO line saying so was written.
    told_reachable: bool,
    /// The sender will not come back (its process is gone, or its comm
    /// closed), but this host still holds bytes of it: the failure waits
    /// until they are read (they may complete NCCL's receives), or until
    /// nothing was read of them for [`VERDICT_GRACE`]: the error, when the
    /// comm last took a byte (or the verdict came), its byte count then.
    verdict: Option<(String, Instant, u64)>,
}

impl Waiting {
    /// Charge the window with the time since the last look: in full if a
    /// receive waited then and the sender was not known reachable, else a
    /// tenth; remember what holds now.
    fn charge(&mut self, now: Instant, awaited: bool) {
        let dt = now.saturating_duration_since(self.last);
        // the rest at a tenth: a sender that never comes back (its comm
        // failed without a word reaching us, its process alive) still ends
        // the wait, after ten windows (as Recovery::observe on verbs)
        self.charged += if self.awaited && !self.reachable { dt } else { dt / crate::proto::recover::LATE_RATE };
        self.last = now;
        self.awaited = awaited;
    }
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

// SAFETY: the raw pointers in expected pieces and requests are NCCL receive
// buffers that stay valid until their request completes (the irecv
// contract); the comm is only used by one thread at a time (behind the
// boundary's mutex).
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
        // (the resume port has our descriptors from the registration)
        if let Some(r) = resume.as_ref().filter(|r| r.queued && cfg.recovery_s > 0) {
            if r.kernel_acks {
                // our acceptance was written soon after the hello arrived, which
                // puts a stream's delayed acknowledgements into "ping-pong"
                // mode: the kernel would then hold back the acknowledgement our
                // sender completes on (40 ms on Linux, per message)
                socks.iter().for_each(Socket::quickack);
            }
        }
        let rec = resume.filter(|_| cfg.recovery_s > 0).map(|r| {
            let policy = if r.kernel_acks { AckPolicy::liveness() } else { AckPolicy::default() };
            Box::new(RecvRec {
                window: Duration::from_secs(cfg.recovery_s as u64),
                r,
                bufsize: cfg.bufsize,
                timeout_s: cfg.timeout_s,
                acked: [0; MAX_STREAMS],
                ack_out: [0; ACK_BUF],
                ack_lo: 0,
                ack_hi: 0,
                policy,
                waiting: None,
                epoch: 0,
                fds_changed: false,
                watch: AckWatch::default(),
            })
        });
        RecvCore {
            streams: socks
                .into_iter()
                .map(|sock| RecvStream { sock, q: VecDeque::with_capacity(MAX_REQUESTS * MAX_RECVS), taken: 0, old: OldStreams::default() })
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

    /// Does this host still hold bytes of the sender's that were not read
    /// (where the offsets count them: its sends may have completed)?
    fn unread(&self) -> bool {
        self.rec.as_ref().is_some_and(|r| r.r.queued)
            && self.streams.iter().any(|st| !st.old.is_empty() || st.sock.unread().is_ok_and(|n| n > 0))
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
        let (sock, limit, old) = source(&self.streams[0]);
        let want = want.min(limit);
        let got = sock.read(&mut self.stage[hi..hi + want]);
        if old {
            return match got {
                Ok(Io::Done(n)) => {
                    self.stage_hi += n;
                    self.streams[0].taken += n as u64;
                    self.took = true;
                    took_old(&mut self.streams[0], n);
                    Ok(Step::Progress)
                }
                Ok(Io::Again) => Ok(Step::Blocked),
                Ok(Io::Eof) => Err(old_stream_lost(&peer, 0, limit as u64, "closed")),
                Err(e) => Err(old_stream_lost(&peer, 0, limit as u64, &format!("failed ({e})"))),
            };
        }
        match got {
            Ok(Io::Done(n)) => {
                self.stage_hi += n;
                self.streams[0].taken += n as u64;
                self.took = true;
                self.drained = n < want;
                Ok(Step::Progress)
            }
            Ok(Io::Again) => Ok(Step::Blocked),
            // a failed stream read on after the fault (its queue counts): its end
            Ok(Io::Eof) if self.waiting() => Ok(Step::Blocked),
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
        let waiting = self.waiting();
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
            } else if need >= DIRECT_READ && st0.old.is_empty() {
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
                    Ok(Io::Eof) if waiting => return Ok(Step::Blocked),
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
        // (oldest first: one the port answered for us, then a newer one)
        while self.rec.as_ref().is_some_and(|r| r.r.reg.mailbox().ready()) {
            self.adopt();
        }
        // where the offsets count the queues, a fault stops nothing: what
        // this host holds is in order, and its sender may have completed
        // it (and closed, and exited), so it is read on until the streams
        // say so (a reconnection then resumes after what was read)
        if !self.waiting() || self.rec.as_ref().is_some_and(|r| r.r.queued) {
            self.progress_streams();
        }
        if let Some(r) = self.rec.as_deref() {
            r.r.reg.mailbox().leave(self.streams.iter().map(|s| (s.taken, s.old.held())));
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
        let waiting = self.waiting();
        let mut link = None;
        'streams: for (k, st) in self.streams.iter_mut().enumerate().skip(1) {
            while let Some(x) = st.q.front_mut() {
                let (sock, limit, old) = match st.old.source() {
                    Some((s, n)) => (s, usize::try_from(n).unwrap_or(usize::MAX), true),
                    None => (&st.sock, usize::MAX, false),
                };
                let want = (x.len - x.got).min(limit);
                // SAFETY: x.ptr+x.got .. +want lies in the rest of this stream's chunk
                // (want <= x.len - x.got), inside a posted receive buffer that NCCL
                // keeps writable until the request completes.
                let got = unsafe { sock.read_raw(x.ptr.add(x.got), want) };
                if old && !matches!(got, Ok(Io::Done(_)) | Ok(Io::Again)) {
                    let how = match got {
                        Err(e) => format!("failed ({e})"),
                        _ => "closed".to_string(),
                    };
                    self.failed = Some(old_stream_lost(&peer, k, limit as u64, &how));
                    return;
                }
                match got {
                    Ok(Io::Done(n)) => {
                        st.taken += n as u64;
                        self.took = true;
                        // (a replaced socket read to its count: the current one is next)
                        let short = n < want && !old;
                        x.got += n;
                        if old {
                            if let Some(s) = st.old.took(n as u64) {
                                s.set_abortive_close();
                            }
                        }
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
                    Ok(Io::Eof) if waiting => break,
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
        // a receive whose bytes all arrived is reported as such, even where
        // the comm failed after (its sender completed, then its process
        // exited: the receive is whole)
        let r = self.reqs.get(id).unwrap();
        if r.unmatched == 0 && r.pieces_left == 0 {
            let mut c = Completion { n: r.n, sizes: [0; MAX_RECVS] };
            c.sizes[..r.n].copy_from_slice(&r.sizes[..r.n]);
            self.reqs.release(id).unwrap();
            if self.rec.is_some() && self.failed.is_none() && self.reqs.is_empty() {
                // nothing pending: no later call is sure to come, so the
                // sender hears now what it may complete
                self.flush_acks(true);
            }
            return Ok(Some(c));
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
            if !r.policy.owed() || !r.policy.due(Instant::now(), idle) {
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
        let wrote = r.ack_lo < r.ack_hi;
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
        if wrote && r.r.kernel_acks {
            // a write soon after a read puts the stream's delayed
            // acknowledgements into "ping-pong" mode, which holds back the
            // kernel acknowledgements our sender completes on (up to 40 ms
            // on Linux when this process does not read meanwhile): out of it
            self.streams[0].sock.quickack();
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
        let now = Instant::now();
        r.waiting = Some(Waiting {
            since: now,
            cause,
            prober: r.r.probe.map(|a| Prober::new(a, r.r.query)),
            charged: Duration::ZERO,
            last: now,
            // (noticed, perhaps, by the helper pool while NCCL called nothing)
            awaited: false,
            reachable: false,
            told_reachable: false,
            verdict: None,
        });
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
            // (this request may be done while others still wait for data)
            let awaited = pending || self.reqs.iter().any(|(_, q)| q.unmatched > 0 || q.pieces_left > 0);
            return self.wait_step(Instant::now(), awaited);
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
    /// `awaited`: NCCL has a receive on this comm not yet reported (see
    /// [`Waiting`] for what the window is charged with).
    fn wait_step(&mut self, now: Instant, awaited: bool) {
        let peer = self.peer;
        let unread = self.unread();
        let taken: u64 = self.streams.iter().map(|s| s.taken).sum();
        let Some(r) = self.rec.as_deref_mut() else { return };
        let window = r.window;
        let Some(w) = r.waiting.as_mut() else { return };
        let waited = now.duration_since(w.since);
        w.charge(now, awaited);
        if let Some((e, at, seen)) = w.verdict.take() {
            if unread && taken > seen {
                w.verdict = Some((e, now, taken));
                return;
            }
            if unread && now.duration_since(at) < VERDICT_GRACE {
                w.verdict = Some((e, at, seen));
                return;
            }
            let left = if unread {
                format!("; this host still holds bytes it sent, which no receive took for {}", secs(VERDICT_GRACE))
            } else {
                String::new()
            };
            return self.fail(peer_error(&peer, format!("{e}{left}")));
        }
        if let Some(p) = w.prober.as_mut() {
            let probe = p.step(now);
            let verdict = match probe {
                Some(Probe::Gone) => Some(format!(
                    "its process is gone, or has closed every comm on that address: its resume port {} refused a connection {} after the stream failed ({})",
                    p.addr(),
                    secs(waited),
                    w.cause
                )),
                Some(Probe::CommClosed) => Some(format!(
                    "its process is alive, but its end of this comm failed or was closed (its resume port {} said so {} after \
                     the stream failed: the sender will not reconnect) ({})",
                    p.addr(),
                    secs(waited),
                    w.cause
                )),
                _ => None,
            };
            if let Some(e) = verdict {
                if unread {
                    // what it sent before is read first (its sends completed)
                    w.verdict = Some((e, now, taken));
                    return;
                }
                return self.fail(peer_error(&peer, e));
            }
            match probe {
                Some(Probe::Alive) => {
                    w.reachable = true;
                    if !std::mem::replace(&mut w.told_reachable, true) {
                        tracing::info!(
                            "TCP receive comm from {peer}: the sender's process answers at {} again ({} after the fault); \
                             it reconnects at its next send, and this end waits for it: RUSTNET_RECOVERY_TIMEOUT counts \
                             in full only while the sender is unreachable and a receive waits (the rest at a tenth)",
                            p.addr(),
                            secs(waited)
                        );
                    }
                }
                Some(Probe::Unknown) => w.reachable = false,
                Some(Probe::Gone | Probe::CommClosed) | None => {}
            }
        }
        if w.charged >= window {
            let e = format!(
                "the sender did not reconnect within RUSTNET_RECOVERY_TIMEOUT={} s (waited {}, counted as {}: in full while a \
                 receive waited and the sender was unreachable, the rest at a tenth) after: {}",
                window.as_secs(),
                secs(waited),
                secs(w.charged),
                w.cause
            );
            self.fail(peer_error(&peer, e));
        }
    }

    /// A reconnection arrived: answer each new stream with where this end
    /// stands in it (unless the resume port already did, while we stood
    /// still) and carry on from there. Called under the gate, before any
    /// read. Where the offsets count the queues (`queued`), a stream stands
    /// at what it took, plus what its replaced sockets still hold for it,
    /// plus what the socket being replaced holds unread now; that socket is
    /// then read up to that count before the new one.
    fn adopt(&mut self) {
        let peer = self.peer;
        let failed = self.failed.is_some();
        let Some(r) = self.rec.as_deref_mut() else { return };
        let Some(m) = r.r.reg.mailbox().take() else { return };
        let answer = |socks: &[Socket], v: Verdict| {
            for s in socks {
                let _ = s.write(&ResumeReply { verdict: v, version: PROTO_VERSION, offset: 0, flags: 0 }.encode());
            }
        };
        if failed {
            // NCCL will close it: the sender should fail now, not retry
            return answer(&m.socks, Verdict::Closed);
        }
        if m.socks.len() != self.streams.len() {
            return answer(&m.socks, Verdict::Inconsistent);
        }
        // what each socket being replaced holds unread (the resume port's
        // figure when it answered: nothing was read since, by the gate)
        let mut inq = [0u64; MAX_STREAMS];
        for (k, st) in self.streams.iter().enumerate() {
            inq[k] = match &m.answered {
                Some(a) => a.get(k).map_or(0, |x| x.1),
                // (a socket that cannot say counts nothing: should its sender
                // have completed those bytes, it fails naming the cause)
                None if r.r.queued => st.sock.unread().unwrap_or(0),
                None => 0,
            };
        }
        let offset = |k: usize, st: &RecvStream| resume_offset(st.taken, st.old.held(), inq[k]);
        if let Some(a) = &m.answered {
            // answered for us: by the gate, nothing was read since
            if a.len() != self.streams.len() || self.streams.iter().enumerate().any(|(k, st)| offset(k, st) != a[k].0) {
                let have: Vec<u64> = self.streams.iter().enumerate().map(|(k, st)| offset(k, st)).collect();
                return self.fail(Error::Internal(format!(
                    "TCP receive comm from {peer}: a reconnection was answered with {a:?} (offset, unread) per stream but this end stands at {have:?}"
                )));
            }
        } else if self.streams.iter().enumerate().zip(&m.sent).any(|((k, st), &s)| offset(k, st) > s) {
            let have: Vec<u64> = self.streams.iter().enumerate().map(|(k, st)| offset(k, st)).collect();
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
            for (k, (st, s)) in self.streams.iter().zip(&m.socks).enumerate() {
                let flags = if r.r.queued { REPLY_QUEUED_OFFSETS } else { 0 };
                let reply = ResumeReply { verdict: Verdict::Accepted, version: PROTO_VERSION, offset: offset(k, st), flags }.encode();
                if !matches!(s.write(&reply), Ok(Io::Done(n)) if n == reply.len()) {
                    return;
                }
            }
        }
        let mut replayed = 0u64;
        let mut fds = [-1; MAX_STREAMS];
        for (k, (st, s)) in self.streams.iter_mut().zip(m.socks).enumerate() {
            let _ = s.tune_stream(r.timeout_s, r.bufsize);
            if let Some(t) = r.r.tos {
                let _ = s.set_tos(peer.is_ipv6(), t);
            }
            replayed += m.sent[k] - resume_offset(st.taken, st.old.held(), inq[k]);
            if r.r.kernel_acks {
                // (the resume reply was written soon after the hello: as at set-up)
                s.quickack();
            }
            fds[k] = s.as_raw_fd();
            let was = std::mem::replace(&mut st.sock, s);
            // its unread bytes are part of the offset answered: read them first
            if let Some(gone) = st.old.retire(was, inq[k]) {
                gone.set_abortive_close();
            }
            r.acked[k] = st.taken;
        }
        if r.r.queued {
            r.r.reg.mailbox().publish(fds[..self.streams.len()].iter().copied());
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
        let held: u64 = inq.iter().sum();
        let kept =
            if held > 0 { format!(" ({held} byte(s) this host held unread are read from the old stream first)") } else { String::new() };
        tracing::warn!(
            "TCP receive comm from {peer}: recovered after {} ({}); the sender resends {replayed} byte(s) from where this end stood{kept}",
            secs(took),
            noticed.map_or_else(|| "the sender reconnected before this end noticed".to_string(), |w| w.cause)
        );
    }
}

impl Drop for RecvCore {
    fn drop(&mut self) {
        if let Some(r) = self.rec.as_deref() {
            // the resume port must not look at our sockets (SIOCINQ on their
            // descriptors) while they close: hold the gate for good
            r.r.reg.mailbox().close_gate();
        }
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

    /// Tests: reset every stream from this end (as a middlebox would).
    #[cfg(test)]
    pub(crate) fn reset_streams(&self) {
        let reset = |c: &RecvCore| c.streams.iter().for_each(|s| s.sock.reset_now());
        match self {
            RecvComm::Direct(c) => reset(c),
            RecvComm::Helper(h) => reset(&h.sh.lock_core()),
        }
    }

    /// Tests: hold (or release) the gate the resume port checks before it
    /// answers for this comm, as the comm does while it moves bytes: held,
    /// a reconnection waits for the comm to answer it itself.
    #[cfg(test)]
    pub(crate) fn hold_gate(&self, hold: bool) {
        let g = |c: &RecvCore| {
            let m = c.rec.as_ref().expect("recovers").r.reg.mailbox();
            if hold {
                assert!(m.enter(), "the gate was taken");
            } else {
                m.leave(c.streams.iter().map(|s| (s.taken, s.old.held())));
            }
        };
        match self {
            RecvComm::Direct(c) => g(c),
            RecvComm::Helper(h) => g(&h.sh.lock_core()),
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
mod window_tests {
    use super::*;

    fn waiting(t0: Instant) -> Waiting {
        Waiting {
            since: t0,
            cause: String::new(),
            prober: None,
            charged: Duration::ZERO,
            last: t0,
            awaited: false,
            reachable: false,
            told_reachable: false,
            verdict: None,
        }
    }

    /// The window is charged in full with time a receive waited while the
    /// sender was not known reachable, and at a tenth otherwise; an idle
    /// stretch (NCCL called nothing, no receive posted) is charged at a
    /// tenth even when the call that ends it brings a receive.
    #[test]
    fn the_window_counts_only_while_a_receive_waits_for_an_unreachable_sender() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut w = waiting(t0);
        w.charge(at(10), true); // noticed; the first stretch is charged at a tenth
        assert_eq!(w.charged, Duration::from_millis(1));
        w.charge(at(510), true); // a receive waited, sender unreachable
        assert_eq!(w.charged, Duration::from_millis(501));
        w.charge(at(600), false); // a receive waited up to now
        assert_eq!(w.charged, Duration::from_millis(591));
        w.charge(at(60_600), true); // a minute of nothing posted, then a receive
        assert_eq!(w.charged, Duration::from_millis(6591), "an idle minute is charged at a tenth");
        w.reachable = true;
        w.charge(at(300_600), true); // four minutes waiting on a reachable (late) sender
        assert_eq!(w.charged, Duration::from_millis(30_591), "a reachable sender's lateness is charged at a tenth");
        w.reachable = false;
        w.charge(at(301_600), true); // unreachable again
        assert_eq!(w.charged, Duration::from_millis(31_591));
    }
}
