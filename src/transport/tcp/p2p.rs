//! The TCP data path: isend/irecv/test over one or more streams, driven from
//! the caller of `test` (and eagerly from isend/irecv), or by the process's
//! helper pool ([`super::helper`]). No allocation after a
//! comm is built; a dead or misbehaving peer fails every pending and later
//! request of the comm with an error naming it.
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use std::os::fd::{AsRawFd, RawFd};

pub use super::helper::{Drive, Helper};
use super::StreamCfg;
use crate::error::{Errno, Error, Result};
use crate::profiler::{Fields, OpenEvent, Parent, Profiler, MAX_EVENTS_PER_PARENT, SOCK_RECV, SOCK_SEND};
use crate::proto::pool::{Pool, ReqId};
use crate::proto::wire::{self, MsgHeader, RecvSpec, HDR_LEN, MAX_STREAMS};
use crate::transport::sock::{Io, Socket, MAX_IOV};
use crate::transport::{Completion, RawBuf, RecvBuf, MAX_P2P_BYTES, MAX_RECVS, MAX_REQUESTS};

/// Staging buffer for stream 0 (headers and small payloads).
const STAGE_LEN: usize = 64 << 10;
/// Bytes one gather write offers before it stops adding queued pieces.
const WRITE_BATCH: usize = 1 << 20;
/// Payload remainders at least this large are read straight into NCCL's buffer.
const DIRECT_READ: usize = 16 << 10;

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
}

struct SendReq {
    size: usize,
    pieces_left: usize,
}

struct SendStream {
    sock: Socket,
    q: VecDeque<Piece>,
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

/// The sending end of a TCP connection, driven by whoever holds it.
pub struct SendCore {
    streams: Vec<SendStream>,
    reqs: Pool<SendReq>,
    failed: Option<Error>,
    peer: SocketAddr,
    min_chunk: usize,
    timeout_s: i64,
    acks: AckWatch,
}

// SAFETY: the raw pointers in queued pieces are NCCL buffers that stay valid
// until their request completes (the isend contract); the comm is only used
// by one thread at a time (behind the boundary's mutex).
unsafe impl Send for SendCore {}

impl SendCore {
    /// Build from connected streams.
    pub fn new(socks: Vec<Socket>, peer: SocketAddr, cfg: StreamCfg) -> SendCore {
        SendCore {
            streams: socks.into_iter().map(|sock| SendStream { sock, q: VecDeque::with_capacity(SEND_SLOTS) }).collect(),
            reqs: Pool::new(SEND_SLOTS),
            failed: None,
            peer,
            min_chunk: cfg.min_chunk,
            timeout_s: cfg.timeout_s,
            acks: AckWatch::default(),
        }
    }

    /// Peer address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
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
                Err(e) => {
                    self.failed = Some(io_error(&self.peer, "TCP_INFO", e));
                    return;
                }
            }
        }
        let timeout_ms = self.timeout_s.max(1) as u64 * 1000;
        if let Some(ms) = self.acks.look(now, timeout_ms, states[..n].iter().copied()) {
            self.failed = Some(peer_error(
                &self.peer,
                format!(
                    "no acknowledgement for {:.1} s while it owes one (RUSTNET_SOCKET_TIMEOUT={}): peer host down or network cut",
                    f64::from(ms) / 1000.0,
                    self.timeout_s
                ),
            ));
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
        let idle = self.streams.iter().all(|st| st.q.is_empty());
        if buf.len == 0 {
            let ev = parent.and_then(|p| self.streams[0].event(p, 0));
            self.streams[0].q.push_back(Piece { req: id, hdr, hdr_len: HDR_LEN, data: std::ptr::null(), len: 0, done: 0, ev });
        }
        for (s, off, len) in wire::chunks(buf.len, self.streams.len(), self.min_chunk) {
            let hdr_len = if s == 0 { HDR_LEN } else { 0 };
            // SAFETY: off < buf.len, inside the caller's buffer.
            let data = unsafe { buf.ptr.add(off) } as *const u8;
            let ev = parent.filter(|_| s < MAX_EVENTS_PER_PARENT).and_then(|p| self.streams[s].event(p, len));
            self.streams[s].q.push_back(Piece { req: id, hdr, hdr_len, data, len, done: 0, ev });
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
        if self.failed.is_some() {
            return;
        }
        let mut iov = [(std::ptr::null::<u8>(), 0usize); MAX_IOV];
        for st in &mut self.streams {
            while !st.q.is_empty() {
                let mut n = 0;
                let mut offered = 0;
                for p in st.q.iter() {
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
                        while wrote > 0 {
                            let p = st.q.front_mut().expect("wrote more than queued");
                            let left = p.hdr_len + p.len - p.done;
                            let take = left.min(wrote);
                            p.done += take;
                            wrote -= take;
                            if p.done == p.hdr_len + p.len {
                                let req = p.req;
                                st.q.pop_front();
                                if let Ok(r) = self.reqs.get_mut(req) {
                                    r.pieces_left -= 1;
                                }
                            }
                        }
                        if short {
                            break;
                        }
                    }
                    Ok(_) => break,
                    Err(e) => {
                        self.failed = Some(io_error(&self.peer, "send", e));
                        return;
                    }
                }
            }
        }
    }

    /// `Ok(Some(size))` when the send is done, `Ok(None)` while in flight.
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        let r = self.reqs.get(id).map_err(|s| Error::Usage(format!("test on send request: {s}")))?;
        // already sent in an earlier gather write: no system call to say so
        if r.pieces_left > 0 {
            self.progress();
        }
        let r = self.reqs.get(id).unwrap();
        let (done, size) = (r.pieces_left == 0, r.size);
        if !done {
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
}

// SAFETY: as for SendComm: raw pointers are NCCL receive buffers valid until
// completion, and the comm is used by one thread at a time.
unsafe impl Send for RecvCore {}

enum Step {
    Progress,
    Blocked,
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

    /// Build from accepted streams.
    pub fn new(socks: Vec<Socket>, peer: SocketAddr, cfg: StreamCfg) -> RecvCore {
        RecvCore {
            streams: socks.into_iter().map(|sock| RecvStream { sock, q: VecDeque::with_capacity(MAX_REQUESTS * MAX_RECVS) }).collect(),
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
        }
    }

    /// Peer address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
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
                self.drained = n < want;
                Ok(Step::Progress)
            }
            Ok(Io::Again) => Ok(Step::Blocked),
            Ok(Io::Eof) if self.streams[0].q.is_empty() && self.stage_hi == 0 => {
                Err(peer_error(&peer, "closed the connection while receives were posted (peer process exited or closed its send comm)"))
            }
            Ok(Io::Eof) => Err(peer_error(&peer, "closed the connection in the middle of a message")),
            Err(e) => Err(io_error(&peer, "receive", e)),
        }
    }

    /// Stream 0: headers and chunk 0 of each message.
    fn step_stream0(&mut self) -> Result<Step> {
        let peer = self.peer;
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
                        self.drained = n < need + HDR_LEN;
                        self.stage_hi = n.saturating_sub(need);
                        n.min(need)
                    }
                    Ok(Io::Again) => return Ok(Step::Blocked),
                    Ok(Io::Eof) => return Err(peer_error(&peer, "closed the connection in the middle of a message")),
                    Err(e) => return Err(io_error(&peer, "receive", e)),
                }
            } else {
                return self.refill();
            };
            x.got += moved;
            if x.got == x.len {
                let req = x.req;
                st0.q.pop_front();
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
        if r.unmatched == 0 {
            self.order.retain(|&o| o != id);
        }
        Ok(Step::Progress)
    }

    /// Move bytes until every stream would block or has nothing expected.
    pub fn progress(&mut self) {
        if self.failed.is_some() {
            return;
        }
        self.drained = false;
        loop {
            match self.step_stream0() {
                Ok(Step::Progress) => continue,
                Ok(Step::Blocked) => break,
                Err(e) => return self.fail(e),
            }
        }
        let peer = self.peer;
        for st in self.streams.iter_mut().skip(1) {
            while let Some(x) = st.q.front_mut() {
                // SAFETY: x.ptr+x.got .. x.ptr+x.len is the rest of this stream's chunk,
                // inside a posted receive buffer that NCCL keeps writable until the
                // request completes.
                match unsafe { st.sock.read_raw(x.ptr.add(x.got), x.len - x.got) } {
                    Ok(Io::Done(n)) => {
                        let short = n < x.len - x.got;
                        x.got += n;
                        if x.got == x.len {
                            let req = x.req;
                            st.q.pop_front();
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
                    Err(e) => {
                        self.failed = Some(io_error(&peer, "receive", e));
                        return;
                    }
                }
            }
        }
    }

    /// `Ok(Some(sizes))` when every buffer of the receive is filled.
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        let r = self.reqs.get(id).map_err(|s| Error::Usage(format!("test on receive request: {s}")))?;
        // already filled by an earlier read: no system call to say so
        if r.unmatched > 0 || r.pieces_left > 0 {
            self.progress();
        }
        if let Some(e) = &self.failed {
            let e = e.clone();
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
            return Ok(Some(c));
        }
        Ok(None)
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

    /// Build from connected streams.
    pub fn new(socks: Vec<Socket>, peer: SocketAddr, cfg: StreamCfg) -> SendComm {
        let core = SendCore::new(socks, peer, cfg);
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
                let left = c.streams.iter().any(|st| !st.q.is_empty());
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
            SendComm::Helper(h) => match h.sh.try_lock_core() {
                Some(mut c) => c.test(id),
                None => Ok(None),
            },
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

    /// Build from accepted streams.
    pub fn new(socks: Vec<Socket>, peer: SocketAddr, cfg: StreamCfg) -> RecvComm {
        let core = RecvCore::new(socks, peer, cfg);
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
            RecvComm::Helper(h) => match h.sh.try_lock_core() {
                Some(mut c) => c.test(id),
                None => Ok(None),
            },
        }
    }
}

#[cfg(test)]
#[path = "p2p_tests.rs"]
mod tests;
