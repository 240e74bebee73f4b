//! What the verbs transport hands the plugin: connect and listen, one send
//! comm type, one receive comm type and one registration type, whether
//! NCCL's device is a single port or a merged one ([`vdev`]: member i
//! connects to the peer's member i). The plugin forwards NCCL's calls
//! to these without knowing QPs, rails or access rights: the member mapping
//! of registrations, the access each side's registrations need and the QP
//! counter tables for the statistics file are decided here.
//!
//! [`vdev`]: super::vdev
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use super::device::IbDev;
use super::establish::{IbConnecting, IbListen};
use super::handshake::ConnCfg;
use super::keeper::{Kept, Seen};
use super::p2p::{RecvComm, SendComm};
use super::reconnect::{self, Side as ReconnectSide};
use super::reg::IbMr;
use super::topo::NumaScope;
use super::vdev::{MultiRecv, MultiSend, MAX_MEMBERS};
use super::{Access, IbNet};
use crate::error::{Error, Result};
use crate::profiler::Parent;
use crate::proto::handle::Handle;
use crate::proto::pool::ReqId;
use crate::stats::QpTable;
use crate::transport::{Completion, MemKind, RawBuf, RecvBuf, MAX_RECVS};

// ---------------------------------------------------------------- connect / accept

/// An outgoing connection on a plain or merged device.
pub enum Connecting {
    /// One port.
    One(IbConnecting, Option<i32>),
    /// One connection per member.
    Multi(Vec<(IbConnecting, bool, Option<i32>)>, usize),
}

impl Connecting {
    /// Start: member i connects to the peer's member i.
    pub fn start(devs: &[(Arc<IbDev>, Arc<ConnCfg>, Option<i32>)], vdev: usize, peer: &[Handle], tc: Option<i32>) -> Result<Connecting> {
        if devs.len() == 1 && peer.len() == 1 {
            let (d, cc, numa) = &devs[0];
            return Ok(Connecting::One(IbConnecting::start(d, cc, &peer[0], tc)?, *numa));
        }
        if devs.len() != peer.len() {
            let names: Vec<&str> = devs.iter().map(|d| d.0.name.as_str()).collect();
            return Err(Error::Usage(format!(
                "rail-aligned merged devices need the same member count on both ends: ours is {} ({}), the peer's has {}; \
                 set the same RUSTNET_IB_MERGE_NICS / NCCL_NET_MERGE_LEVEL on every rank",
                devs.len(),
                names.join("+"),
                peer.len()
            )));
        }
        let mut rails = Vec::new();
        for ((d, cc, numa), h) in devs.iter().zip(peer) {
            // members are driven by peek_cap (the receiver's CTS): no eager path
            let cc = Arc::new(ConnCfg { eager: 0, ..(**cc).clone() });
            rails.push((IbConnecting::start(d, &cc, h, tc)?, false, *numa));
        }
        Ok(Connecting::Multi(rails, vdev))
    }

    /// Advance; true when every member connection is through its part.
    pub fn progress(&mut self) -> Result<bool> {
        match self {
            Connecting::One(c, numa) => {
                let _n = NumaScope::enter(*numa);
                c.progress()
            }
            Connecting::Multi(rails, _) => {
                let mut all = true;
                for (c, done, numa) in rails.iter_mut() {
                    if !*done {
                        let _n = NumaScope::enter(*numa);
                        *done = c.progress()?;
                    }
                    all &= *done;
                }
                Ok(all)
            }
        }
    }

    /// The send comm.
    pub fn into_send(self) -> Result<IbSend> {
        match self {
            Connecting::One(c, _) => Ok(IbSend::One(Box::new(c.into_send_comm()?))),
            Connecting::Multi(rails, vdev) => {
                let rails = rails.into_iter().map(|(c, _, _)| c.into_send_comm()).collect::<Result<Vec<_>>>()?;
                Ok(IbSend::Multi(Box::new(MultiSend::new(rails, vdev))))
            }
        }
    }
}

/// A listener on a plain or merged device.
#[allow(clippy::large_enum_variant)] // one per listen call, never on the data path
pub enum Listen {
    /// One port.
    One(IbListen, Option<i32>),
    /// One listener per member.
    Multi(Vec<(IbListen, Option<RecvComm>, Option<i32>)>, usize),
}

impl Listen {
    /// Accept; `Ok(None)` until every member connection arrived.
    pub fn accept(&mut self) -> Result<Option<IbRecv>> {
        match self {
            Listen::One(l, numa) => {
                let _n = NumaScope::enter(*numa);
                Ok(l.accept()?.map(|r| IbRecv::One(Box::new(r))))
            }
            Listen::Multi(rails, vdev) => {
                let mut all = true;
                for (l, got, numa) in rails.iter_mut() {
                    if got.is_none() {
                        let _n = NumaScope::enter(*numa);
                        *got = l.accept()?;
                    }
                    all &= got.is_some();
                }
                if !all {
                    return Ok(None);
                }
                let rails = rails.iter_mut().map(|(_, g, _)| g.take().unwrap()).collect();
                Ok(Some(IbRecv::Multi(Box::new(MultiRecv::new(rails, *vdev)))))
            }
        }
    }
}

// ---------------------------------------------------------------- comms

/// The sending end on a plain or merged device.
pub enum IbSend {
    /// One port.
    One(Box<SendComm>),
    /// Merged: one comm per member, rail-aligned.
    Multi(Box<MultiSend>),
}

/// The receiving end on a plain or merged device.
pub enum IbRecv {
    /// One port.
    One(Box<RecvComm>),
    /// Merged: one comm per member, rail-aligned.
    Multi(Box<MultiRecv>),
}

/// A registration NCCL holds for a verbs comm: one memory region on a plain
/// device, one per member (member order) on a merged one. Dropping it
/// releases the regions' cache references.
pub enum IbReg {
    /// On the comm's one port.
    One(IbMr),
    /// On each member of a merged device, in member order.
    Rails(Vec<IbMr>),
}

impl IbReg {
    /// The registration a plain comm uses (none when made for a merged one).
    #[inline]
    fn one(&self) -> Option<&IbMr> {
        match self {
            IbReg::One(m) => Some(m),
            IbReg::Rails(_) => None,
        }
    }

    /// Member registrations of `r` for a merged comm (none past its members,
    /// and none at all when made for a plain comm).
    #[inline]
    fn rails(r: Option<&IbReg>) -> [Option<&IbMr>; MAX_MEMBERS] {
        let mut v = [None; MAX_MEMBERS];
        if let Some(IbReg::Rails(m)) = r {
            for (o, x) in v.iter_mut().zip(m) {
                *o = Some(x);
            }
        }
        v
    }
}

/// Per buffer j of a grouped call, `regs[j]`'s region on a plain comm.
#[inline]
fn ones<'a>(regs: &[Option<&'a IbReg>]) -> [Option<&'a IbMr>; MAX_RECVS] {
    let mut v = [None; MAX_RECVS];
    for (o, r) in v.iter_mut().zip(regs) {
        *o = r.and_then(IbReg::one);
    }
    v
}

/// Per buffer j of a grouped call, `regs[j]`'s member regions on a merged comm.
#[inline]
fn per_rail<'a>(regs: &[Option<&'a IbReg>]) -> [[Option<&'a IbMr>; MAX_MEMBERS]; MAX_RECVS] {
    let mut v = [[None; MAX_MEMBERS]; MAX_RECVS];
    for (o, r) in v.iter_mut().zip(regs) {
        *o = IbReg::rails(*r);
    }
    v
}

impl IbSend {
    /// Post a send; `reg`: the registration of `buf` NCCL passed.
    ///
    /// # Safety
    /// `buf` must stay readable, and `reg` registered, until the request completes.
    #[inline]
    pub unsafe fn isend_p(&mut self, buf: RawBuf, tag: i32, reg: Option<&IbReg>, parent: Option<Parent>) -> Result<Option<ReqId>> {
        match self {
            // SAFETY: `buf` stays readable until the request completes (this fn's
            // contract), and its registration too: NCCL deregisters only after.
            IbSend::One(c) => unsafe { c.isend_p(buf, tag, reg.and_then(IbReg::one), parent) },
            // SAFETY: `buf` stays readable until the request completes (this fn's
            // contract), and so do the rails' registrations: NCCL deregisters only after.
            IbSend::Multi(c) => unsafe { c.isend_p(buf, tag, &IbReg::rails(reg), parent) },
        }
    }

    /// Drive and check one request.
    #[inline]
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        match self {
            IbSend::One(c) => c.test(id),
            IbSend::Multi(c) => c.test(id),
        }
    }

    /// The member comms, rail order (the one comm of a plain device).
    fn rails(&self) -> &[SendComm] {
        match self {
            IbSend::One(c) => std::slice::from_ref(&**c),
            IbSend::Multi(c) => c.rails(),
        }
    }

    fn rails_mut(&mut self) -> &mut [SendComm] {
        match self {
            IbSend::One(c) => std::slice::from_mut(&mut **c),
            IbSend::Multi(c) => c.rails_mut(),
        }
    }

    /// Does the comm recover in place (the keeper then watches it)? Its
    /// out-of-band sockets, one per rail; `None`: it does not.
    pub fn keeper_fds(&self) -> Option<Vec<RawFd>> {
        keeper_fds(self.rails().iter().map(|r| &r.io.link))
    }

    /// The recovery keeper's look (`transport::ib::keeper`), under the comm's lock.
    pub fn keep(&mut self, seen: &mut Seen, now: Instant) -> Kept {
        keep_rails(self.rails_mut(), seen, now)
    }
}

impl IbRecv {
    /// Post a (grouped) receive; `regs[j]`: the registration of `bufs[j]`.
    ///
    /// # Safety
    /// Every buffer must stay writable, and its registration alive, until the request completes.
    #[inline]
    pub unsafe fn irecv_p(&mut self, bufs: &[RecvBuf], regs: &[Option<&IbReg>], parents: &[Option<Parent>]) -> Result<Option<ReqId>> {
        let n = regs.len().min(MAX_RECVS);
        match self {
            IbRecv::One(c) => {
                let m = ones(regs);
                // SAFETY: every buffer stays writable until the request completes (this
                // fn's contract), and its registration too: NCCL deregisters only after.
                unsafe { c.irecv_p(bufs, &m[..n], parents) }
            }
            IbRecv::Multi(c) => {
                let per = per_rail(regs);
                let refs: [&[Option<&IbMr>]; MAX_RECVS] = std::array::from_fn(|j| &per[j][..]);
                // SAFETY: every buffer stays writable until the request completes (this
                // fn's contract), and so do the rails' registrations: NCCL deregisters only after.
                unsafe { c.irecv_p(bufs, &refs[..n], parents) }
            }
        }
    }

    /// Flush received data to the GPU; `Ok(None)`: nothing to flush.
    pub fn iflush(&mut self, bufs: &[RawBuf], regs: &[Option<&IbReg>]) -> Result<Option<ReqId>> {
        let n = regs.len().min(MAX_RECVS);
        match self {
            IbRecv::One(c) => c.iflush(bufs, &ones(regs)[..n]),
            IbRecv::Multi(c) => {
                let per = per_rail(regs);
                let refs: [&[Option<&IbMr>]; MAX_RECVS] = std::array::from_fn(|j| &per[j][..]);
                c.iflush(bufs, &refs[..n])
            }
        }
    }

    /// Drive and check one request.
    #[inline]
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        match self {
            IbRecv::One(c) => c.test(id),
            IbRecv::Multi(c) => c.test(id),
        }
    }

    /// The member comms, rail order (the one comm of a plain device).
    fn rails(&self) -> &[RecvComm] {
        match self {
            IbRecv::One(c) => std::slice::from_ref(&**c),
            IbRecv::Multi(c) => c.rails(),
        }
    }

    fn rails_mut(&mut self) -> &mut [RecvComm] {
        match self {
            IbRecv::One(c) => std::slice::from_mut(&mut **c),
            IbRecv::Multi(c) => c.rails_mut(),
        }
    }

    /// As [`IbSend::keeper_fds`].
    pub fn keeper_fds(&self) -> Option<Vec<RawFd>> {
        keeper_fds(self.rails().iter().map(|r| &r.io.link))
    }

    /// As [`IbSend::keep`].
    pub fn keep(&mut self, seen: &mut Seen, now: Instant) -> Kept {
        keep_rails(self.rails_mut(), seen, now)
    }
}

fn keeper_fds<'a>(links: impl Iterator<Item = &'a super::link::Link>) -> Option<Vec<RawFd>> {
    let mut fds = Vec::new();
    for l in links {
        // (a send comm may get its recovery state only at the end of its
        // handshake, in one of NCCL's later calls: the look waits for it)
        let may = l.cc.keeper && (l.rec.is_some() || (l.handshake && l.cc.recovery_s > 0));
        if !may {
            return None;
        }
        fds.push(l.oob.as_raw_fd());
    }
    (!fds.is_empty()).then_some(fds)
}

fn keep_rails<S: ReconnectSide>(rails: &mut [S], seen: &mut Seen, now: Instant) -> Kept {
    let calls = |rails: &mut [S]| rails.iter_mut().fold(0u64, |a, r| a.wrapping_add(r.link().calls()));
    if !seen.idle(calls(rails), now) {
        // NCCL calls it, and its calls move whatever there is to move: look
        // again only while something is (else its sockets are watched
        // again); a socket that only says "closed" would wake us at once
        // after every re-arm, so that watch ends (NCCL's calls report it)
        let mut k = Kept::Quiet;
        for r in rails.iter_mut() {
            let l = r.link();
            let unread = l.oob.unread();
            let closed = unread.is_err() || (unread == Ok(0) && l.oob.peer_closed().unwrap_or(true));
            k = k.and(if l.failed.is_some() || (closed && !l.halted()) {
                Kept::Done
            } else if l.halted() || l.handshake || unread.is_ok_and(|n| n > 0) {
                Kept::Busy
            } else {
                Kept::Quiet
            });
        }
        return k;
    }
    let k = rails.iter_mut().map(|r| reconnect::keep(r)).fold(Kept::Quiet, Kept::and);
    seen.ours(calls(rails));
    k
}

/// What registration and the counters need of one member comm, either way.
trait Rail {
    fn dev(&self) -> usize;
    fn peer(&self) -> std::net::SocketAddr;
    fn qp_table(&self) -> Arc<QpTable>;
}

impl Rail for SendComm {
    fn dev(&self) -> usize {
        SendComm::dev(self)
    }
    fn peer(&self) -> std::net::SocketAddr {
        SendComm::peer(self)
    }
    fn qp_table(&self) -> Arc<QpTable> {
        SendComm::qp_table(self)
    }
}

impl Rail for RecvComm {
    fn dev(&self) -> usize {
        RecvComm::dev(self)
    }
    fn peer(&self) -> std::net::SocketAddr {
        RecvComm::peer(self)
    }
    fn qp_table(&self) -> Arc<QpTable> {
        RecvComm::qp_table(self)
    }
}

/// Physical devices of `rails`, member order.
fn members_of<R: Rail>(rails: &[R]) -> Vec<usize> {
    rails.iter().map(R::dev).collect()
}

/// The peer (member 0's) and each member's QP counter table, by physical device.
fn stats_parts_of<R: Rail>(rails: &[R]) -> (String, Vec<(usize, Arc<QpTable>)>) {
    (rails.first().map_or_else(String::new, |r| r.peer().to_string()), rails.iter().map(|r| (r.dev(), r.qp_table())).collect())
}

/// One end of a verbs comm, for what both ends share (registration, counters).
#[derive(Clone, Copy)]
pub enum Side<'a> {
    /// A sending end.
    Send(&'a IbSend),
    /// A receiving end.
    Recv(&'a IbRecv),
}

/// Where a comm end's registrations go and with what rights (see
/// [`IbNet::reg_plan`]); taken under the comm's lock, used after it.
pub struct RegPlan {
    /// Physical devices, member order (one for a plain device).
    members: Vec<usize>,
    /// A merged device: one registration per member.
    merged: bool,
    access: Access,
}

impl IbNet {
    /// Where `side`'s registrations go (its physical devices, member order)
    /// and the access they need: local read where we send from; remote write
    /// where the peer writes (receive buffers), plus remote read where the
    /// flush QP reads them (any member that flushes).
    pub fn reg_plan(&self, side: Side<'_>) -> RegPlan {
        match side {
            Side::Send(c) => RegPlan { members: members_of(c.rails()), merged: matches!(c, IbSend::Multi(_)), access: Access::LOCAL_READ },
            Side::Recv(c) => {
                let members = members_of(c.rails());
                let access = if members.iter().any(|&d| self.recv_access_on(d).covers(Access::REMOTE_READ)) {
                    Access::REMOTE_WRITE.with(Access::REMOTE_READ)
                } else {
                    Access::REMOTE_WRITE
                };
                RegPlan { members, merged: matches!(c, IbRecv::Multi(_)), access }
            }
        }
    }

    /// Register `buf` (NCCL's regMr) as `plan` says: on the comm's port, or
    /// on each member of its merged device.
    ///
    /// # Safety
    /// `buf` must stay mapped until the returned registration is dropped.
    pub unsafe fn register(&self, plan: &RegPlan, buf: RawBuf, kind: MemKind) -> Result<IbReg> {
        if plan.merged {
            // SAFETY: `buf` stays mapped until the IbReg, and with it each member's
            // registration, is dropped (this fn's contract), which is reg_mr's.
            let rails = plan.members.iter().map(|&d| unsafe { self.reg_mr(d, buf, kind, plan.access) }).collect::<Result<Vec<_>>>()?;
            return Ok(IbReg::Rails(rails));
        }
        // SAFETY: `buf` stays mapped until the IbReg is dropped (this fn's
        // contract; NCCL's regMr: until deregMr), which is reg_mr's.
        Ok(IbReg::One(unsafe { self.reg_mr(plan.members[0], buf, kind, plan.access)? }))
    }

    /// Register the dma-buf `fd` (from `offset`) behind `buf` (NCCL's
    /// regMrDmaBuf) as `plan` says, as [`IbNet::register`].
    ///
    /// # Safety
    /// The memory behind `fd` must stay allocated until the returned
    /// registration is dropped (`fd` itself may close once this returns).
    pub unsafe fn register_dmabuf(&self, plan: &RegPlan, buf: RawBuf, fd: i32, offset: u64) -> Result<IbReg> {
        if plan.merged {
            // SAFETY: the memory behind `fd` stays allocated until the IbReg is
            // dropped (this fn's contract) and fd is open during this call,
            // which is reg_mr_dmabuf's contract for each member.
            let rails =
                plan.members.iter().map(|&d| unsafe { self.reg_mr_dmabuf(d, buf, fd, offset, plan.access) }).collect::<Result<Vec<_>>>()?;
            return Ok(IbReg::Rails(rails));
        }
        // SAFETY: the memory behind `fd` stays allocated until the IbReg is
        // dropped (this fn's contract; NCCL's: until deregMr), which is reg_mr_dmabuf's.
        Ok(IbReg::One(unsafe { self.reg_mr_dmabuf(plan.members[0], buf, fd, offset, plan.access)? }))
    }

    /// For the statistics file: `side`'s peer and, per member, NCCL's name
    /// of its device and its QP counter table.
    pub fn stats_of(&self, side: Side<'_>) -> (String, Vec<(String, Arc<QpTable>)>) {
        let (peer, tables) = match side {
            Side::Send(c) => stats_parts_of(c.rails()),
            Side::Recv(c) => stats_parts_of(c.rails()),
        };
        (peer, tables.into_iter().map(|(d, t)| (self.dev_name(d), t)).collect())
    }

    /// NCCL's name of its device `dev` (`dev{n}` if there is none).
    fn dev_name(&self, dev: usize) -> String {
        self.props(dev).map_or_else(|_| format!("dev{dev}"), |p| p.name.to_string_lossy().into_owned())
    }
}
