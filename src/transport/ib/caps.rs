//! How deep each queue of a verbs connection is, in one place: the send
//! and receive queues and the inline size of every QP, and the CQ, from
//! what that end of the connection can have outstanding. Comm construction
//! ([`super::handshake::Setup`], the flush QP in [`super::ready`]) asks here,
//! and a recovery re-creating a connection's QPs and CQ in place
//! (`reconnect.rs`) asks again through the connection's [`Plan`].
//!
//! Queue memory is most of what an idle comm costs (docs/scale.md): the
//! provider allocates every queue at its full depth when the QP or CQ is
//! created, rounded up (soft-RoCE and mlx5 to a power of two entries; on
//! soft-RoCE a send entry is 208 bytes plus the larger of the inline size
//! and the scatter list, rounded up to a power of two, so 48 inline bytes
//! cost nothing over none and 64 double the queue). So each side asks for
//! what its protocol machine can post, not one size for both:
//!
//! | queue | sender | receiver |
//! |---|---|---|
//! | send queue (per QP) | data lanes of every FIFO slot that can be in flight on it (`MAX_LANE_WRS` each), plus on QP 0 the eager path's writes | QP 0: the control writes' budget ([`RECV_CTL_SQ`], which the receive machine keeps); the other QPs post nothing |
//! | receive queue | 1 (posts none) | the receives kept posted per QP ([`RECV_WRS`]; iWARP: its notice ring) |
//! | inline | [`SEND_INLINE`] with NCCL_IB_USE_INLINE=1 (always on iWARP, for the notices) | [`RECV_INLINE`] with NCCL_IB_USE_INLINE=1 |
//! | CQ | one completion per lane in flight (iWARP: every write and notice), a few for the eager path | every posted receive, every control write that can be signaled, the flush reads |
//!
//! A CQ sized so holds every completion the machines ask for, not the
//! flush of every outstanding work request: a QP moved to the error state
//! completes all of them, unsignaled ones too, and can overflow it (harmless
//! for a comm that fails; a recovery makes a fresh CQ with its new QPs).
use super::verbs::QpCaps;
use crate::proto::fifo::{ELEM_BYTES, FIFO_DEPTH, MAX_LANE_WRS};
use crate::proto::notice::{NOTICE_BYTES, RECV_DEPTH as NOTICE_RECV_DEPTH};
use crate::proto::{eager, tx};

/// Send-queue entries the receiver's control writes (CTS, credits, the
/// eager ring's address) may hold on its QP 0: the budget the receive
/// machine keeps ([`crate::proto::rx::Config::sq_depth`]). Two per FIFO
/// slot: a one-buffer receive's CTS is one write (runs of them are one),
/// so 32 receives in flight need at most 32 plus credits, and NCCL's 8
/// steps of grouped receives at most 8 x 8.
pub const RECV_CTL_SQ: usize = 2 * FIFO_DEPTH;
// the receive machine's budget rule: at least 2 x CTL_SIGNAL
const _: () = assert!(RECV_CTL_SQ >= 2 * crate::proto::rx::CTL_SIGNAL);

/// Receive WRs kept posted on each receiver QP (IB/RoCE): at most
/// FIFO_DEPTH immediates are outstanding per QP, plus room so a
/// completion's repost never races the next immediate.
pub const RECV_WRS: usize = FIFO_DEPTH + 16;

/// Inline bytes a sender's QPs ask for (NCCL_IB_USE_INLINE=1, and always
/// on iWARP for the notices): an eager write of an 8-byte message (32-byte
/// header, payload, 8-byte trailer), an iWARP notice (40 bytes), a data
/// write of up to 48 bytes. 48 is also the most soft-RoCE takes without
/// doubling its send entries.
pub const SEND_INLINE: u32 = 48;
const _: () = assert!(SEND_INLINE as usize >= NOTICE_BYTES);
const _: () = assert!(SEND_INLINE as usize == eager::HDR_BYTES + 8 + 8);

/// Inline bytes a receiver's QPs ask for (NCCL_IB_USE_INLINE=1): one CTS
/// element (a one-buffer receive's CTS, the write on every rendezvous
/// message's critical path) or the credit word. Longer control writes
/// (runs of CTS slots, written while the sender is busy) are read from the
/// staging area.
pub const RECV_INLINE: u32 = ELEM_BYTES as u32;

/// Completions of the eager path a sender's CQ must hold: one signaled
/// write in every [`tx::EAGER_SIGNAL`] of its send-queue share, plus the
/// mailbox, the ring request and the closing fence.
const EAGER_CQE: usize = tx::EAGER_SQ / tx::EAGER_SIGNAL + 4;

/// Slack on the sender's QP 0 for the eager path's writes that the
/// machine does not hold to [`tx::EAGER_SQ`] (the mailbox, once per FIFO
/// head; the ring request; the closing fence).
const EAGER_SQ_SLACK: usize = 32;

/// What the queue depths depend on: the connection's knobs (from
/// [`super::handshake::ConnCfg::shape`]; this module imports no comm or
/// handshake type, so anything may ask it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// QPs per connection.
    pub nqps: usize,
    /// Messages split over all QPs (else rotated).
    pub split: bool,
    /// NCCL_IB_USE_INLINE.
    pub use_inline: bool,
    /// iWARP: lanes end with notice SENDs, receivers keep notice receives posted.
    pub notices: bool,
    /// This end offers the eager path (RUSTNET_IB_EAGER > 0).
    pub eager: bool,
    /// The receiver has a flush QP on its CQ.
    pub flush: bool,
}

/// Which end of a connection a queue serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A send comm's QPs.
    Send,
    /// A receive comm's QPs.
    Recv,
    /// A receive comm's loopback QP for `iflush` reads (one read per
    /// receive at most).
    Flush,
}

/// The device's limits on queue depths.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most WRs per queue (`max_qp_wr`).
    pub max_qp_wr: u32,
    /// Most CQ entries (`max_cqe`).
    pub max_cqe: u32,
}

impl Limits {
    /// From the device attributes (non-positive values read as small defaults).
    pub fn new(max_qp_wr: i32, max_cqe: i32) -> Limits {
        Limits { max_qp_wr: max_qp_wr.max(16) as u32, max_cqe: max_cqe.max(64) as u32 }
    }
}

/// What a connection's queues are sized from, kept with it so that QPs
/// and a CQ made again (recovery) are the same as the first.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// The end.
    pub role: Role,
    /// The connection's knobs.
    pub shape: Shape,
    /// The device's limits.
    pub lim: Limits,
}

impl Plan {
    /// QP `i`'s capabilities ([`qp_caps`]).
    pub fn qp(&self, i: usize) -> QpCaps {
        qp_caps(self.role, i, &self.shape, self.lim)
    }

    /// The CQ's entries ([`cq_entries`]).
    pub fn cqe(&self) -> u32 {
        cq_entries(self.role, &self.shape, self.lim)
    }
}

/// FIFO slots whose lanes can be in flight on one QP at once: every slot
/// uses every QP when messages are split, else slots rotate over the QPs.
fn lanes_per_qp(cc: &Shape) -> usize {
    if cc.split {
        FIFO_DEPTH
    } else {
        FIFO_DEPTH.div_ceil(cc.nqps.max(1))
    }
}

/// The capabilities QP `qp` (its index in the connection) of `role` asks
/// for, within the device's limits (the provider may grant less inline).
pub fn qp_caps(role: Role, qp: usize, cc: &Shape, lim: Limits) -> QpCaps {
    let cap = |v: usize| (v as u32).clamp(1, lim.max_qp_wr);
    match role {
        Role::Send => {
            let eager = if qp == 0 && cc.eager { tx::EAGER_SQ + EAGER_SQ_SLACK } else { 0 };
            QpCaps {
                // (iWARP: each lane's delivery fence, an RDMA READ, after its notice)
                max_send_wr: cap(lanes_per_qp(cc) * (MAX_LANE_WRS + usize::from(cc.notices)) + eager),
                max_recv_wr: 1,
                // notices (iWARP) always go inline: no source to keep alive;
                // data writes follow NCCL_IB_USE_INLINE (ready::data_inline)
                max_inline: if cc.use_inline || cc.notices { SEND_INLINE } else { 0 },
            }
        }
        Role::Recv => QpCaps {
            // control writes all go on QP 0
            max_send_wr: cap(if qp == 0 { RECV_CTL_SQ } else { 1 }),
            max_recv_wr: cap(if cc.notices { NOTICE_RECV_DEPTH } else { RECV_WRS }),
            max_inline: if cc.use_inline && qp == 0 { RECV_INLINE } else { 0 },
        },
        Role::Flush => QpCaps { max_send_wr: cap(FIFO_DEPTH), max_recv_wr: 1, max_inline: 0 },
    }
}

/// Entries of the CQ every QP of a `role` comm shares (a receiver's flush
/// QP too).
pub fn cq_entries(role: Role, cc: &Shape, lim: Limits) -> u32 {
    let lanes = if cc.split { cc.nqps.max(1) } else { 1 };
    let n = match role {
        Role::Send => {
            // completions per lane: the write that ends it; iWARP signals
            // every data write, the notice and the delivery fence
            let per_lane = if cc.notices { MAX_LANE_WRS + 2 } else { 1 };
            let eager = if cc.eager { EAGER_CQE } else { 0 };
            per_lane * FIFO_DEPTH * lanes + eager
        }
        Role::Recv | Role::Flush => {
            let recvs = if cc.notices { NOTICE_RECV_DEPTH } else { RECV_WRS };
            // the control budget signals at least every CTL_SIGNAL writes,
            // and every write once half of it is outstanding
            recvs * cc.nqps.max(1) + RECV_CTL_SQ + if cc.flush { FIFO_DEPTH } else { 0 }
        }
    };
    (n as u32).clamp(16, lim.max_cqe)
}

#[cfg(test)]
mod tests {
    use super::*;
    fn cc(nqps: usize, split: bool, inline: bool, eager: u32) -> Shape {
        Shape { nqps, split, use_inline: inline, notices: false, eager: eager > 0, flush: false }
    }

    const BIG: Limits = Limits { max_qp_wr: 1 << 15, max_cqe: 1 << 20 };

    #[test]
    fn a_sender_has_room_for_every_lane_in_flight_and_the_eager_path_on_qp_0() {
        let c = cc(1, false, true, 4096);
        let q = qp_caps(Role::Send, 0, &c, BIG);
        assert!(q.max_send_wr as usize >= FIFO_DEPTH * MAX_LANE_WRS + tx::EAGER_SQ);
        assert_eq!((q.max_recv_wr, q.max_inline), (1, SEND_INLINE));
        // four QPs, rotated: a quarter of the slots each; only QP 0 carries eager writes
        let c = cc(4, false, true, 4096);
        let (q0, q1) = (qp_caps(Role::Send, 0, &c, BIG), qp_caps(Role::Send, 1, &c, BIG));
        assert_eq!(q1.max_send_wr as usize, FIFO_DEPTH / 4 * MAX_LANE_WRS);
        assert_eq!(q0.max_send_wr - q1.max_send_wr, (tx::EAGER_SQ + EAGER_SQ_SLACK) as u32);
        // split: every slot has a lane on every QP
        let c = cc(4, true, false, 0);
        let q = qp_caps(Role::Send, 3, &c, BIG);
        assert_eq!((q.max_send_wr as usize, q.max_inline), (FIFO_DEPTH * MAX_LANE_WRS, 0));
    }

    #[test]
    fn a_receiver_asks_for_its_control_budget_and_its_posted_receives_only() {
        let c = cc(2, false, true, 4096);
        let (q0, q1) = (qp_caps(Role::Recv, 0, &c, BIG), qp_caps(Role::Recv, 1, &c, BIG));
        assert_eq!((q0.max_send_wr as usize, q0.max_recv_wr as usize, q0.max_inline), (RECV_CTL_SQ, RECV_WRS, RECV_INLINE));
        assert_eq!((q1.max_send_wr, q1.max_recv_wr as usize, q1.max_inline), (1, RECV_WRS, 0));
        assert_eq!(qp_caps(Role::Recv, 0, &cc(1, false, false, 0), BIG).max_inline, 0, "NCCL_IB_USE_INLINE=0");
    }

    #[test]
    fn iwarp_senders_keep_inline_notices_and_receivers_their_notice_ring() {
        let mut c = cc(1, false, false, 0);
        c.notices = true;
        assert_eq!(qp_caps(Role::Send, 0, &c, BIG).max_inline, SEND_INLINE);
        assert_eq!(qp_caps(Role::Recv, 0, &c, BIG).max_recv_wr as usize, NOTICE_RECV_DEPTH);
        assert!(cq_entries(Role::Send, &c, BIG) as usize >= (MAX_LANE_WRS + 1) * FIFO_DEPTH);
    }

    #[test]
    fn cqs_hold_what_the_machines_can_have_signaled() {
        let c = cc(1, false, true, 4096);
        assert_eq!(cq_entries(Role::Send, &c, BIG) as usize, FIFO_DEPTH + EAGER_CQE);
        assert_eq!(cq_entries(Role::Recv, &c, BIG) as usize, RECV_WRS + RECV_CTL_SQ);
        assert_eq!(cq_entries(Role::Recv, &Shape { flush: true, ..c }, BIG) as usize, RECV_WRS + RECV_CTL_SQ + FIFO_DEPTH);
        let c = cc(4, true, true, 0);
        assert_eq!(cq_entries(Role::Send, &c, BIG) as usize, 4 * FIFO_DEPTH);
        assert_eq!(cq_entries(Role::Recv, &c, BIG) as usize, 4 * RECV_WRS + RECV_CTL_SQ);
    }

    #[test]
    fn the_device_limits_cap_every_queue() {
        let lim = Limits::new(100, 80);
        let c = cc(1, false, true, 4096);
        assert_eq!(qp_caps(Role::Send, 0, &c, lim).max_send_wr, 100);
        assert_eq!(cq_entries(Role::Recv, &c, lim), 80);
        assert_eq!((Limits::new(0, -1).max_qp_wr, Limits::new(0, -1).max_cqe), (16, 64));
    }
}
