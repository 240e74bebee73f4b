//! The verbs data path (NCCL's net_ib p2p.cc): receiver-driven RDMA writes,
//! executed here and decided in the core. [`crate::proto::tx::Sender`] and
//! [`crate::proto::rx::Receiver`] own the requests, FIFO slots, CTS
//! batching, eager ring and mailbox timer, and the order in which their
//! rules apply: every entry point of [`SendComm`] / [`RecvComm`]
//! ([`super::entry`]) checks NCCL's arguments, then hands the call to its
//! machine with this file's executor ([`SendIo`] / [`RecvIo`], the
//! machines' `SendNic` / `RecvNic`), which reads registered memory and the
//! CQ and makes one verbs call per thing the machine asks for. Progress happens in the caller of isend/irecv/test; no allocation
//! after a comm is built (but for a late eager ring and its staging, made
//! once, when the sender first asks: [`crate::proto::eager`]), and nothing is shared with other comms on the
//! data path except one relaxed atomic load of the device's async-event
//! counters. Failures and liveness are [`super::link`]'s; the last steps of
//! the handshake (metadata, rdma_cm, READY) are [`super::ready`]'s.

use super::ffi::{self, ibv_wc};
use super::handshake::LocalAddr;
use super::link::{via_link, Link, SendHs};
use super::notice_path::{NoticeTx, RecvSide};
use super::verbs::{Access, HostRegion, Qp, Rts, SendWr};
use crate::error::{Error, Result};
use crate::proto::eager::{self, RING_REQ, RING_REQ_OFF};
use crate::proto::fifo::{self, WrKind, FIFO_DEPTH, MAX_LANE_WRS, SIZES_SLOT_BYTES};
use crate::proto::nic::{Cqe, Lane, RecvNic, SendNic, WrId, POLL_BATCH};
use crate::proto::pool::ReqId;
use crate::proto::tx::{EagerWr, MailboxWr, RingRequestWr};
use crate::proto::{rx, tx};
use crate::transport::{RawBuf, MAX_RECVS};

pub use super::link::{format_stats, set_stats_dump, QpStat};

/// Sends still possible per comm (see [`tx::SEND_SLOTS`]).
pub const SEND_SLOTS: usize = tx::SEND_SLOTS;
/// Request slots of a receive comm (see [`rx::RECV_POOL`]).
pub const RECV_POOL: usize = rx::RECV_POOL;

const NO_WR: SendWr = SendWr { wr_id: 0, local: (0, 0, 0), remote: (0, 0), imm: None, signaled: false, inline: false };

// ---------------------------------------------------------------- send side

/// The sending end of a verbs connection.
pub struct SendComm {
    pub(super) io: SendIo,
    /// The protocol: requests, FIFO head, writes in flight, eager ring, mailbox timer.
    pub(super) tx: tx::Sender,
}

/// What the sender's machine works through: the QPs, the memory the
/// receiver writes, our staging.
pub(super) struct SendIo {
    pub(super) link: Link,
    pub(super) hs: Option<SendHs>,
    /// The CTS FIFO the receiver writes.
    pub(super) fifo_mem: HostRegion,
    /// Sizes staging (for a grouped receive when not inline).
    pub(super) stage: HostRegion,
    pub(super) local: LocalAddr,
    pub(super) tc: u8,
    pub(super) sl: u8,
    pub(super) remote_sizes: (u64, u32),
    /// The eager limit we offer (0 = off).
    pub(super) eager_offer: u32,
    /// The eager path, when both ends agreed on it.
    pub(super) eager: Option<EagerSend>,
    /// The buffer of the `isend` in progress: the only memory an eager
    /// write copies from.
    pub(super) cur: Option<RawBuf>,
    /// iWARP: lanes end with notice SENDs (after `link`: dropped after the QPs).
    pub(super) notices: Option<NoticeTx>,
    /// What the QPs and the CQ were sized from (a recovery makes new ones alike).
    pub(super) plan: super::caps::Plan,
}

/// The sender's half of the eager path (its bookkeeping is in the machine, [`tx::Sender`]).
pub(super) struct EagerSend {
    /// Staging with the ring's layout: the mailbox word's source, then the slots.
    pub(super) stage: HostRegion,
    /// The receiver's ring (address, rkey).
    pub(super) ring: (u64, u32),
}

via_link!(SendIo);

impl SendIo {
    #[inline(always)]
    fn reap(&mut self, out: &mut [Cqe; POLL_BATCH]) -> Result<usize> {
        let what = |w: WrId| match w {
            WrId::Eager(_) => "eager write".to_string(),
            WrId::Data(seq) | WrId::DataDone(seq) => format!("RDMA write of message #{seq}"),
            w => format!("{w:?}"),
        };
        self.link.reap(out, what, |link, wc, _| {
            Err(Error::Protocol { peer: link.peer_name(), what: format!("a receive completion (wr_id {:#x}) on a send comm", wc.wr_id) })
        })
    }

    fn eager_wr(&self, e: &EagerSend, count: u64, local: (u64, u32, u32), off: u64, signaled: bool) -> SendWr {
        SendWr {
            // a signaled WR says how many eager-path WRs its completion frees
            wr_id: WrId::Eager(count).encode(),
            local,
            remote: (e.ring.0 + off, e.ring.1),
            imm: None,
            signaled,
            inline: local.1 > 0 && local.1 <= self.link.max_inline,
        }
    }
}

impl SendNic for SendIo {
    type Fifo = HostRegion;
    type Stage = HostRegion;

    #[inline]
    fn fifo(&self) -> &HostRegion {
        &self.fifo_mem
    }

    #[inline]
    fn sizes_stage(&mut self) -> &mut HostRegion {
        &mut self.stage
    }

    fn post_lane(&mut self, l: &Lane<'_>) -> Result<()> {
        if self.link.halted() {
            return Ok(()); // (the resume posts what the receiver lacks)
        }
        let g = l.g;
        let mut wrs = [NO_WR; MAX_LANE_WRS];
        let sizes_off = fifo::sizes_offset(g.seq);
        let sizes_len = 4 * g.n;
        let inline = self.link.max_inline as usize;
        let mut lane_bytes = 0u64;
        for (w, p) in wrs.iter_mut().zip(l.plan) {
            let (local, remote) = match p.kind {
                WrKind::Data { elem, off, len } => {
                    lane_bytes += len as u64;
                    ((g.src[elem] + off as u64, len as u32, g.lkey[elem]), (g.elems[elem].addr + off as u64, g.elems[elem].rkey))
                }
                WrKind::Sizes => (
                    (self.stage.addr() as u64 + sizes_off as u64, sizes_len as u32, self.stage.lkey()),
                    (self.remote_sizes.0 + sizes_off as u64, self.remote_sizes.1),
                ),
                WrKind::Empty => ((0, 0, 0), (g.elems[0].addr, g.elems[0].rkey)),
            };
            let inl = local.1 as usize <= inline && local.1 > 0;
            *w = SendWr { wr_id: WrId::Data(g.seq).encode(), local, remote, imm: p.imm, signaled: p.imm.is_some(), inline: inl };
        }
        // iWARP: the same data writes, then a notice SEND instead of the immediate
        let k = match &self.notices {
            Some(nt) => nt.lane(g, l.lane, l.nlanes, l.qp, l.plan, &mut wrs)?,
            None => l.plan.len(),
        };
        let qp = &self.link.qps[l.qp];
        self.link.stats.bump(l.qp, lane_bytes);
        let fence = self.notices.as_ref().and_then(|nt| nt.fence(g.seq));
        let fences = usize::from(fence.is_some());
        self.link.stats.work.post(k + fences, wrs[..k].iter().filter(|w| w.signaled).count() + fences);
        // SAFETY: data sources lie in NCCL buffers whose registrations were
        // checked in isend and which NCCL keeps valid and registered until
        // the request completes, i.e. until this lane's signaled last WR
        // completes; the sizes staging and the notice staging live in this
        // comm, which outlives its QPs (field order), and slot `seq %
        // FIFO_DEPTH` of either is rewritten only after the receiver
        // completed `seq`. iWARP: the fence's landing byte lies in the
        // NoticeTx's region (local write, this PD), which the comm also
        // keeps past its QPs; it reads the receiver's sizes area under the
        // rkey the receiver's metadata gave, registered readable for it
        // (handshake::Setup) for the comm's life.
        unsafe {
            match (&self.notices, &fence) {
                (Some(_), Some(f)) => qp.post_writes_send_read(&wrs[..k], f)?,
                (Some(_), None) => qp.post_writes_send(&wrs[..k])?,
                (None, _) => qp.post_writes(&wrs[..k])?,
            }
        };
        if crate::fault::qp_error_due(crate::fault::QpSide::Send) {
            let _ = qp.set_error();
            self.link.forced_error();
        }
        Ok(())
    }

    #[inline]
    fn eager_stage(&mut self) -> Option<&mut HostRegion> {
        self.eager.as_mut().map(|e| &mut e.stage)
    }

    fn post_eager(&mut self, w: &EagerWr, copy: Option<(u64, usize)>) -> Result<()> {
        let Some(e) = &self.eager else { return Err(Error::Internal("eager write without the eager path".into())) };
        if let Some((src, len)) = copy {
            let Some(buf) = self.cur.filter(|b| b.ptr as u64 == src && b.len == len) else {
                return Err(Error::Internal(format!("eager write of {len} bytes at {src:#x}, not the isend's buffer")));
            };
            if len > 0 {
                // SAFETY: `cur` is the buffer of the isend in progress (checked
                // above to be what the machine copies), readable for that call
                // (isend's contract); it is host memory (the eager path is off on
                // GPUDirect devices). The staging slot lies in our registered region.
                e.stage.write(tx::Sender::payload_off(w), unsafe { std::slice::from_raw_parts(buf.ptr as *const u8, len) });
            }
        }
        if self.link.halted() {
            return Ok(()); // staged: the resume writes it from there
        }
        let wr = self.eager_wr(e, w.count, (e.stage.addr() as u64 + w.off as u64, w.len as u32, e.stage.lkey()), w.off as u64, w.signaled);
        // SAFETY: the source is this slot of our staging, which lives in this
        // comm after the QPs (field order) and is rewritten only for message
        // idx + RING_SLOTS, which needs the receiver's credit for idx, i.e.
        // after this write landed.
        unsafe { self.link.qps[0].post_writes(&[wr])? };
        self.link.stats.work.post(1, wr.signaled as usize);
        Ok(())
    }

    fn post_mailbox(&mut self, m: &MailboxWr) -> Result<()> {
        let Some(e) = self.eager.as_ref().filter(|_| !self.link.halted()) else { return Ok(()) };
        let wr = self.eager_wr(e, m.count, (e.stage.addr() as u64, 8, e.stage.lkey()), 0, true);
        // SAFETY: the source is the first word of our staging (lives after
        // the QPs); rewriting it while this write is in flight only lets the
        // receiver see a newer head, which is as true.
        unsafe { self.link.qps[0].post_writes(&[wr])? };
        self.link.stats.work.post(1, 1);
        self.link.ctl_posts += 1;
        Ok(())
    }

    fn post_fence(&mut self, count: u64) -> Result<()> {
        if self.link.halted() {
            return Ok(());
        }
        let wr = match &self.eager {
            Some(e) => self.eager_wr(e, count, (0, 0, 0), 0, true),
            // a late ring not known yet: the probe goes to the sizes area (no bytes)
            None => SendWr {
                wr_id: WrId::Eager(count).encode(),
                local: (0, 0, 0),
                remote: self.remote_sizes,
                imm: None,
                signaled: true,
                inline: false,
            },
        };
        // SAFETY: an empty write: no local memory is read.
        unsafe { self.link.qps[0].post_writes(&[wr])? };
        self.link.stats.work.post(1, 1);
        Ok(())
    }

    fn post_ring_request(&mut self, r: &RingRequestWr) -> Result<()> {
        if self.link.halted() {
            return Ok(()); // the resume asks again
        }
        let wr = SendWr {
            wr_id: WrId::Eager(r.count).encode(),
            local: (self.stage.addr() as u64 + RING_REQ_OFF as u64, 8, self.stage.lkey()),
            remote: (self.remote_sizes.0 + RING_REQ_OFF as u64, self.remote_sizes.1),
            imm: None,
            signaled: true,
            inline: 8 <= self.link.max_inline,
        };
        // SAFETY: the source is the request word in our sizes staging, which
        // lives in this comm after the QPs (field order) and is written once.
        unsafe { self.link.qps[0].post_writes(&[wr])? };
        self.link.stats.work.post(1, 1);
        self.link.ctl_posts += 1;
        Ok(())
    }

    fn ring_arrived(&mut self, addr: u64, rkey: u32, max: usize) -> Result<()> {
        // the one registration on the data path, once per comm that uses the eager path
        let stage = HostRegion::new(&self.link.dev.pd, eager::ring_bytes(max), Access::LOCAL_READ)?;
        tracing::debug!(
            "{}: send comm to {}: eager ring at {addr:#x} announced, staging registered",
            self.link.dev.name,
            self.link.peer_name()
        );
        self.eager = Some(EagerSend { stage, ring: (addr, rkey) });
        Ok(())
    }
}

// ---------------------------------------------------------------- receive side

/// The receiver's eager ring (its bookkeeping is in the machine, [`rx::Receiver`]).
pub(super) struct EagerRing {
    /// Mailbox word, then the ring slots the sender writes.
    pub(super) ring: HostRegion,
}

/// A loopback QP and a scratch word: `iflush` RDMA-reads one byte of the
/// last received buffer through the NIC, so the NIC's earlier writes are
/// visible before NCCL reads (needed for GPU memory; forced for host memory
/// only by RUSTNET_FORCE_FLUSH=1).
pub(super) struct Flush {
    pub(super) qp: Qp<Rts>,
    pub(super) scratch: HostRegion,
}

/// The receiving end of a verbs connection.
pub struct RecvComm {
    pub(super) io: RecvIo,
    /// The protocol: requests, FIFO slots, CTS batching, eager bookkeeping.
    pub(super) rx: rx::Receiver,
}

/// What the receiver's machine works through.
pub(super) struct RecvIo {
    pub(super) link: Link,
    pub(super) flush: Option<Flush>,
    /// READY bytes received so far; None once READY arrived.
    pub(super) ready: Option<([u8; 8], usize)>,
    /// Sizes area the sender writes (grouped receives).
    pub(super) sizes_mem: HostRegion,
    /// CTS staging (slot `seq % FIFO_DEPTH` at its FIFO offset), then the
    /// credit word's source.
    pub(super) stage: HostRegion,
    pub(super) local: LocalAddr,
    pub(super) remote_fifo: (u64, u32),
    pub(super) eager: Option<EagerRing>,
    /// The eager ring comes late (the sender asks for it; `eager` is None until then).
    pub(super) late_ring: bool,
    /// iWARP: rdma_cm and notices (after `link`: dropped after the QPs).
    pub(super) notices: Option<Box<RecvSide>>,
    /// What each flush request reads (address, rkey), by request slot.
    pub(super) flush_at: Box<[(u64, u32); RECV_POOL]>,
}

via_link!(RecvIo);

impl RecvIo {
    /// Post the flush read of request `id` (its target in `flush_at`).
    pub(super) fn post_flush(&mut self, id: ReqId) -> Result<()> {
        let Some(f) = self.flush.as_ref().filter(|_| !self.link.halted()) else { return Ok(()) };
        let (addr, rkey) = self.flush_at[id.slot as usize];
        // SAFETY: the scratch word is registered with local write and lives
        // in this comm after the flush QP (field order); the source is one
        // byte of NCCL's receive buffer under the rkey of its registration,
        // which NCCL keeps until this flush request completes.
        unsafe { f.qp.post_read(WrId::Flush(id).encode(), (f.scratch.addr() as u64, 1, f.scratch.lkey()), (addr, rkey))? };
        self.link.stats.work.post(1, 1);
        Ok(())
    }

    #[inline(always)]
    fn reap(&mut self, out: &mut [Cqe; POLL_BATCH]) -> Result<usize> {
        let what = |w: WrId| match w {
            WrId::Ctl { .. } => "CTS write".to_string(),
            WrId::Flush(_) => "flush read (loopback QP)".to_string(),
            _ => "receive".to_string(),
        };
        let notices = &mut self.notices;
        self.link.reap(out, what, |link, wc, qi| recv_word(link, notices.as_deref_mut(), wc, qi))
    }
}

/// A receive completed on our QP `qi`: its completion word, the receive
/// reposted (IB/RoCE: from the immediate; iWARP: from the notice).
fn recv_word(link: &Link, notices: Option<&mut RecvSide>, wc: &ibv_wc, qi: Option<usize>) -> Result<u32> {
    if let Some(nt) = notices {
        let i = qi.ok_or_else(|| Error::Internal(format!("receive completion on unknown QP {:#x}", wc.qp_num)))?;
        return nt.on_recv(wc, i, &link.qps[i], || link.peer_name());
    }
    // keep the receive queue full (receive WRs are not tied to a receive)
    if let Some(q) = qi.map(|i| &link.qps[i]) {
        q.post_recv_empty(WrId::Recv(0).encode())?;
        link.stats.work.recv_posts.add_single_writer(1);
    }
    if wc.opcode != ffi::IBV_WC_RECV_RDMA_WITH_IMM || wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM == 0 {
        return Err(Error::Protocol {
            peer: link.peer_name(),
            what: format!("unexpected completion (opcode {}, wr_id {:#x}) on a receive QP", wc.opcode, wc.wr_id),
        });
    }
    // SAFETY: WITH_IMM is set, so the union holds imm_data.
    Ok(u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data }))
}

impl RecvNic for RecvIo {
    type Ring = HostRegion;
    type Stage = HostRegion;

    #[inline]
    fn ring(&self) -> Option<&HostRegion> {
        self.eager.as_ref().map(|e| &e.ring)
    }

    fn deliver(&self, d: &rx::Deliver) {
        let Some(e) = &self.eager else { return };
        if d.len > 0 {
            assert!(d.src + d.len <= e.ring.len());
            // SAFETY: the ring bytes src..+len were written before the
            // trailer the machine checked (acquire fence in read_u64) and lie
            // inside the ring (asserted); the destination is the posted
            // buffer's CTS address, whose capacity the machine checked
            // against len, writable until its request is reported done
            // (irecv's contract), host memory (eager is off with GPUDirect).
            unsafe { std::ptr::copy_nonoverlapping(e.ring.addr().add(d.src), d.dst as *mut u8, d.len) };
        }
    }

    #[inline]
    fn stage(&mut self) -> &mut HostRegion {
        &mut self.stage
    }

    fn post_ctl(&mut self, chain: &rx::CtlChain) -> Result<()> {
        if self.link.halted() {
            return Ok(()); // (the resume writes every CTS from the sender's head again)
        }
        let mut wrs = [NO_WR; rx::CHAIN];
        let qp = chain.qp;
        for (w, c) in wrs.iter_mut().zip(chain.wrs()) {
            *w = SendWr {
                wr_id: WrId::Ctl { qp, count: c.signal.unwrap_or(0) }.encode(),
                local: (self.stage.addr() as u64 + c.off as u64, c.len as u32, self.stage.lkey()),
                remote: (self.remote_fifo.0 + c.off as u64, self.remote_fifo.1),
                imm: None,
                signaled: c.signal.is_some(),
                inline: c.len <= self.link.max_inline as usize,
            };
        }
        // SAFETY: the sources are this comm's staging (it outlives the QPs,
        // field order); a slot's staging is rewritten only for seq +
        // FIFO_DEPTH, after this write landed and the sender moved past it
        // (CtsQueue::can_post); the credit word may be rewritten in flight,
        // which only shows the sender a larger, equally true count.
        unsafe { self.link.qps[qp].post_writes(&wrs[..chain.n])? };
        let w = &self.link.stats.work;
        w.post(chain.n, chain.wrs().iter().filter(|c| c.signal.is_some()).count());
        w.cts.add_single_writer(chain.n as u64);
        self.link.ctl_posts += 1;
        if crate::fault::qp_error_due(crate::fault::QpSide::Recv) {
            let _ = self.link.qps[qp].set_error();
            self.link.forced_error();
        }
        Ok(())
    }

    fn sizes(&self, seq: u64) -> [u32; MAX_RECVS] {
        // iWARP: lane 0's notice carried a grouped receive's sizes
        if let Some(n) = &self.notices {
            return n.sizes((seq % FIFO_DEPTH as u64) as usize);
        }
        let mut b = [0u8; SIZES_SLOT_BYTES];
        self.sizes_mem.read(fifo::sizes_offset(seq), &mut b);
        fifo::decode_sizes(&b)
    }

    #[inline]
    fn may_advertise(&self, first: usize, nlanes: usize, in_flight: usize) -> bool {
        self.notices.as_ref().is_none_or(|n| n.may_advertise(first, nlanes, in_flight))
    }

    fn expect(&mut self, seq: u64, nlanes: usize) -> Result<()> {
        let link = &self.link;
        match &mut self.notices {
            Some(nt) => nt.expect(seq, nlanes, || link.peer_name()),
            None => Ok(()),
        }
    }

    #[inline]
    fn ring_requested(&self) -> bool {
        self.late_ring && self.sizes_mem.read_u64(RING_REQ_OFF) == RING_REQ
    }

    fn make_ring(&mut self, max: usize) -> Result<(u64, u32)> {
        // the one registration on the data path, once per comm whose sender asks
        let ring = HostRegion::new(&self.link.dev.pd, eager::ring_bytes(max), Access::REMOTE_WRITE)?;
        let at = (ring.addr() as u64, ring.rkey());
        tracing::debug!(
            "{}: receive comm from {}: eager ring registered at {:#x} on request",
            self.link.dev.name,
            self.link.peer_name(),
            at.0
        );
        self.eager = Some(EagerRing { ring });
        Ok(at)
    }
}
