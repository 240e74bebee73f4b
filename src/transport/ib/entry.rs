//! The verbs comms' entry points: isend/irecv/test/iflush of a [`SendComm`]
//! / [`RecvComm`] on one port, what a merged device asks before it posts
//! (`peek_cap`, `can_take_recv`), and close. Each checks NCCL's arguments
//! ([`super::link`]'s `check_buf`), finishes the handshake if needed
//! ([`super::ready`]), moves a recovery on and answers "not yet" while it
//! lasts ([`super::reconnect`]), then hands the call to its machine
//! ([`crate::proto::tx::Sender`] / [`crate::proto::rx::Receiver`]) with
//! [`super::p2p`]'s executor, which makes the verbs calls. Nothing here
//! decides a protocol step.
use super::link::{check_buf, comm_accessors};
use super::p2p::{RecvComm, RecvIo, SendComm, RECV_POOL};
use super::reconnect::Side as _;
use super::reg::IbMr;
use super::verbs::Access;
use crate::error::{Error, Result};
use crate::profiler::Parent;
use crate::proto::fifo::Cts;
use crate::proto::nic::Fail;
use crate::proto::pool::ReqId;
use crate::transport::{Completion, RawBuf, RecvBuf, MAX_RECVS};

comm_accessors!(SendComm, tx);

impl SendComm {
    /// True once the QPs are in RTS and READY was sent.
    pub fn is_ready(&self) -> bool {
        self.io.hs.is_none()
    }

    /// Is the connection up (the handshake done)? `Ok(false)`: not yet.
    fn up(&mut self) -> Result<bool> {
        if self.io.hs.is_some() {
            if let Err(e) = self.progress_handshake() {
                return Err(self.io.link.fail_with(e));
            }
            if self.io.hs.is_some() {
                self.io.link.idle_tick(self.tx.live());
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The capacity of the receive buffer a send of `tag` would fill next,
    /// once the receiver advertised it and an isend of that tag would be
    /// taken now (`Ok(None)`: not yet). A merged device (vdev.rs) cuts each
    /// message over its members by these, and posts only when every member
    /// answered.
    pub fn peek_cap(&mut self, tag: i32) -> Result<Option<usize>> {
        self.io.link.check()?;
        if !self.up()? {
            return Ok(None);
        }
        self.io.link.flap_before_post(self.tx.live());
        if self.recovering()? {
            return Ok(None);
        }
        self.tx.peek(&mut self.io, tag).map_err(|f| self.io.link.fail_by(f, "send"))
    }

    /// Queue a send; `Ok(None)` until the receiver posted the matching
    /// receive (or while all request slots are busy). Small sends of the
    /// eager tag go into the receiver's eager ring when its CTS is not there yet.
    ///
    /// # Safety
    /// `buf` must stay readable, and `mr` registered, until `test` reports
    /// this request done or failed.
    pub unsafe fn isend(&mut self, buf: RawBuf, tag: i32, mr: Option<&IbMr>) -> Result<Option<ReqId>> {
        // SAFETY: isend_p's contract is this fn's (`buf` readable and `mr`
        // registered until test reports the request), which our caller promised.
        unsafe { self.isend_p(buf, tag, mr, None) }
    }

    /// [`Self::isend`] with NCCL's profiler parent handle: one event per
    /// QP the message's writes go out on.
    ///
    /// # Safety
    /// As [`Self::isend`].
    pub unsafe fn isend_p(&mut self, buf: RawBuf, tag: i32, mr: Option<&IbMr>, parent: Option<Parent>) -> Result<Option<ReqId>> {
        self.io.link.check()?;
        let lkey = check_buf("isend", buf, mr, &self.io.link.dev, Access::LOCAL_READ)?;
        if !self.up()? {
            return Ok(None);
        }
        if self.io.link.member_of.is_none() {
            // (a merged device's member looked in peek_cap, and must post now)
            self.io.link.flap_before_post(self.tx.live());
        }
        if self.recovering()? {
            return Ok(None);
        }
        self.io.link.parents[0] = parent;
        self.io.link.nparents = 1;
        // the one buffer an eager write of this call may copy from
        self.io.cur = Some(buf);
        let r = self.tx.isend(&mut self.io, tag, buf.len, buf.ptr as u64, lkey);
        self.io.cur = None;
        r.map_err(|f| self.io.link.fail_by(f, "send"))
    }

    /// `Ok(Some(size))` once the send is done.
    #[inline(always)]
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        match self.recovering() {
            Ok(false) => {}
            Ok(true) if !self.tx.is_done(id).map_err(|s| self.io.link.fail_by(Fail::Stale(s), "send"))? => return Ok(None),
            // (a request that completed before the comm failed is still handed out: the error comes with the next)
            Err(e) if !self.tx.is_done(id).unwrap_or(false) => return Err(e),
            Ok(true) | Err(_) => {}
        }
        match self.tx.test(&mut self.io, id) {
            // (split: the common answer builds no Completion)
            Ok(None) => Ok(None),
            Ok(Some(n)) => {
                self.io.link.work_done();
                Ok(Some(Completion::one(n)))
            }
            Err(f) => Err(self.io.link.fail_by(f, "send")),
        }
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        self.drain_on_close();
        // iWARP: disconnect and destroy the rdma_cm ids before `link` drops
        // the QPs (librdmacm's order: disconnect, destroy QP, destroy id)
        if let Some(n) = &mut self.io.notices {
            n.close_cm();
        }
    }
}

impl SendComm {
    /// Closing must not drop writes already posted (a send reported done
    /// early, inline, may still be on the wire): wait for their completions,
    /// bounded by the retry timeout, a failure, or the peer going away.
    fn drain_on_close(&mut self) {
        if self.io.hs.is_some() {
            return;
        }
        if self.io.link.halted() {
            tracing::warn!("{}: closing a send comm to {} while it recovers", self.io.link.dev.name, self.io.link.peer_name());
            return;
        }
        self.io.link.eager_stats = self.tx.eager_stats();
        self.io.link.log_stats("send");
        let cc = &self.io.link.cc;
        let ack_s = 4.096e-6 * f64::from(1u32 << cc.timeout.min(31)) * f64::from(cc.retry_cnt + 1);
        let limit = std::time::Duration::from_secs_f64(ack_s.clamp(1.0, 30.0));
        let left = self.tx.close(&mut self.io, limit);
        if left > 0 && self.io.link.halted() {
            tracing::warn!(
                "{}: closing a send comm to {} that stopped to recover while it closed, with {left} message(s) not acknowledged",
                self.io.link.dev.name,
                self.io.link.peer_name()
            );
        } else if left > 0 && self.io.link.failed.is_none() {
            tracing::warn!(
                "{}: closing a send comm to {} with {left} message(s) not acknowledged after {limit:?}",
                self.io.link.dev.name,
                self.io.link.peer_name(),
            );
        }
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        self.io.link.eager_stats = self.rx.eager_stats();
        self.io.link.log_stats("recv");
        // iWARP: disconnect and destroy the rdma_cm ids before `link` drops
        // the QPs (librdmacm's order: disconnect, destroy QP, destroy id)
        if let Some(n) = &mut self.io.notices {
            n.close_cm();
        }
    }
}

comm_accessors!(RecvComm, rx);

impl RecvComm {
    /// Would `irecv` take a receive now? (A merged device asks every member
    /// before posting on any.) An error when this comm has failed.
    pub fn can_take_recv(&mut self) -> Result<bool> {
        self.io.link.check()?;
        self.io.link.flap_before_post(self.rx.live());
        Ok(!self.recovering()? && self.rx.would_take(&mut self.io))
    }

    /// Post a (grouped) receive; `Ok(None)` when all request slots are busy.
    ///
    /// # Safety
    /// Every buffer must stay writable, and its registration alive, until
    /// `test` reports this request done or failed.
    pub unsafe fn irecv(&mut self, bufs: &[RecvBuf], mrs: &[Option<&IbMr>]) -> Result<Option<ReqId>> {
        // SAFETY: irecv_p's contract is this fn's (every buffer writable and
        // registered until test reports the request), which our caller promised.
        unsafe { self.irecv_p(bufs, mrs, &[]) }
    }

    /// [`Self::irecv`] with NCCL's profiler parent handle of each buffer:
    /// one event per buffer per QP the message's writes arrive on.
    ///
    /// # Safety
    /// As [`Self::irecv`].
    pub unsafe fn irecv_p(&mut self, bufs: &[RecvBuf], mrs: &[Option<&IbMr>], parents: &[Option<Parent>]) -> Result<Option<ReqId>> {
        self.io.link.check()?;
        let n = bufs.len();
        if n == 0 || n > MAX_RECVS {
            return Err(Error::InvalidArg(format!("irecv with n={n} (1..={MAX_RECVS} accepted)")));
        }
        let mut cts = [Cts::default(); MAX_RECVS];
        for (i, b) in bufs.iter().enumerate() {
            let mr = mrs.get(i).copied().flatten();
            check_buf("irecv", b.buf, mr, &self.io.link.dev, Access::REMOTE_WRITE)?;
            cts[i] =
                Cts { addr: b.buf.ptr as u64, rkey: mr.map_or(0, |m| m.rkey()), cap: b.buf.len as u32, tag: b.tag, n: n as u8, i: i as u8 };
        }
        if self.io.ready.is_some() {
            if let Err(e) = self.progress_ready() {
                return Err(self.io.link.fail_with(e));
            }
        }
        if self.io.link.member_of.is_none() {
            // (a merged device's member looked in can_take_recv, and must post now)
            self.io.link.flap_before_post(self.rx.live());
        }
        if self.recovering()? {
            return Ok(None);
        }
        let np = parents.len().min(MAX_RECVS);
        self.io.link.parents[..np].copy_from_slice(&parents[..np]);
        self.io.link.nparents = np;
        match self.rx.irecv(&mut self.io, &cts[..n]) {
            Ok(t) => Ok(t.map(|t| t.id)),
            Err(f) => Err(self.io.link.fail_by(f, "receive")),
        }
    }

    /// `Ok(Some(sizes))` once every buffer of the receive is filled.
    #[inline(always)]
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        if self.io.ready.is_some() {
            if let Err(e) = self.progress_ready() {
                self.io.link.fail(e);
            }
        }
        match self.recovering() {
            Ok(false) => {}
            Ok(true) if !self.rx.is_done(id).map_err(|s| self.io.link.fail_by(Fail::Stale(s), "receive"))? => return Ok(None),
            // (a request that completed before the comm failed is still handed out: the error comes with the next)
            Err(e) if !self.rx.is_done(id).unwrap_or(false) => return Err(e),
            Ok(true) | Err(_) => {}
        }
        match self.rx.test(&mut self.io, id) {
            Ok(None) => Ok(None),
            Ok(Some(f)) => {
                self.io.link.work_done();
                Ok(Some(Completion { n: f.n, sizes: f.sizes }))
            }
            Err(f) => Err(self.io.link.fail_by(f, "receive")),
        }
    }

    /// Flush received data: `Ok(None)` (nothing to do) for host memory
    /// unless flushes are forced; then one RDMA READ of the last non-empty
    /// buffer through the loopback QP, completed by `test`.
    pub fn iflush(&mut self, bufs: &[RawBuf], mrs: &[Option<&IbMr>]) -> Result<Option<ReqId>> {
        self.io.link.check()?;
        if self.io.flush.is_none() {
            return Ok(None);
        }
        let Some((i, b)) = bufs.iter().enumerate().rev().find(|(_, b)| b.len > 0) else { return Ok(None) };
        let b = *b;
        // NCCL's own handle for that buffer when it allows the read (no
        // shared lock on the data path); else look the registration up.
        let given = mrs.get(i).copied().flatten().filter(|m| m.covers(b.ptr, 1) && m.access().covers(Access::REMOTE_READ));
        let rkey = given.map(IbMr::rkey).or_else(|| self.io.link.dev.mrs.find_rkey(b.ptr, 1, Access::REMOTE_READ)).ok_or_else(|| {
            Error::Usage(format!(
                "iflush: {:p} is not in a receive registration that allows the flush read (regMr on this recv comm first)",
                b.ptr
            ))
        })?;
        let post = |io: &mut RecvIo, id: ReqId| {
            // kept until the flush completes: a recovery posts it again
            io.flush_at[id.slot as usize] = (b.ptr as u64, rkey);
            io.post_flush(id)
        };
        // never Ok(None) here: to NCCL that would mean "nothing to flush"
        match self.rx.iflush(&mut self.io, post) {
            Ok(id) => Ok(Some(id)),
            Err(Fail::NoSlot) => Err(Error::Internal(format!("iflush: all {RECV_POOL} request slots of the receive comm are in use"))),
            Err(f) => Err(self.io.link.fail_by(f, "receive")),
        }
    }
}
