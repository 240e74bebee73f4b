//! Recovering a verbs comm in place after a fabric fault: what a comm
//! keeps for it ([`RecLink`]) and which completion errors start one. The
//! steps and their order are [`crate::proto::recover::Recovery`]'s, what to
//! resend is the protocol machines' (`Sender::resume`, `Receiver::resume`);
//! [`super::reconnect`] stops and rebuilds QPs, reads the port, and moves
//! the recovery messages over the comm's out-of-band socket.
//!
//! What starts a recovery ([`Link::fault`]): a completion with a status a
//! healthy peer can come back from (retry exceeded, flushed, ...), a port
//! that went down and came back while requests were outstanding (the HCA
//! would retransmit only at its next timeout, up to seconds later), an
//! injected QP error (`RUSTNET_FAULT_QP_ERROR`), or the peer's Halt. What
//! ends it: traffic on new QPs, or the comm's failure once
//! `RUSTNET_RECOVERY_TIMEOUT` is spent, the peer gives up, or the peer is
//! gone (its out-of-band socket closes).
//!
//! While a comm recovers, NCCL's calls return "not yet" (no request
//! fails), and nothing is posted: the executors' post methods do nothing
//! while [`Link::halted`], and the resume posts again whatever the restart
//! points say is missing.
use std::time::{Duration, Instant};

use super::caps::Plan;
use super::handshake::LocalAddr;
use super::verbs::{Cq, Init, Qp};
use crate::proto::recover::{RcMsg, Recovery, RC_HDR, RC_MAX_PAYLOAD};

/// Completion statuses a healthy peer can come back from: the network
/// lost the path (retry exceeded, response timeout, a local transport
/// error while the link vanished) or the QP was stopped (flushed). Anything
/// else (access, protection, length, invalid request) is a bug on one end
/// and fails the comm.
pub(super) fn recoverable(status: u32) -> bool {
    use super::ffi::*;
    matches!(status, IBV_WC_RETRY_EXC_ERR | IBV_WC_WR_FLUSH_ERR | IBV_WC_RNR_RETRY_EXC_ERR | IBV_WC_RESP_TIMEOUT_ERR | IBV_WC_LOC_QP_OP_ERR)
}

/// How long after one "invalid request" on soft-RoCE another one fails the
/// comm instead of starting a recovery ([`recoverable_on`]).
pub(super) const INV_REQ_SPACING: Duration = Duration::from_secs(5);

/// [`recoverable`], and on soft-RoCE (`soft_roce`) an "invalid request"
/// (`IBV_WC_REM_INV_REQ_ERR`, at the writer and at the receiver whose
/// receive it was) too, unless the last one was less than
/// [`INV_REQ_SPACING`] ago (`since_last`). rxe's responder says "invalid
/// request" to a correct write now and then when the QP's packets arrive
/// out of order (rxe sends a QP's packets from whichever CPU kicks it; seen
/// twice in about 18 bandwidth runs of 6,000 messages in the VM, no loss
/// configured); nothing of the write is reported (no completion word), so
/// the restart points resend it whole. A write that is wrong itself fails
/// again as soon as it is resent, within the spacing: the comm then fails,
/// naming the status. Real HCAs keep the rule of [`recoverable`].
pub(super) fn recoverable_on(status: u32, soft_roce: bool, since_last: Option<Duration>) -> bool {
    recoverable(status) || (soft_roce && status == super::ffi::IBV_WC_REM_INV_REQ_ERR && since_last.is_none_or(|d| d >= INV_REQ_SPACING))
}

/// A comm's recovery state (on [`Link::rec`]; `None`: the comm does not
/// recover: the knob is 0, or the peer's build predates recovery, on
/// iWARP predates stop 38's).
pub(super) struct RecLink {
    pub(super) m: Recovery,
    pub(super) window_s: u32,
    pub(super) inbuf: Vec<u8>,
    pub(super) out: Vec<u8>,
    pub(super) sent: usize,
    /// What started the current episode (for the logs and the error).
    pub(super) cause: String,
    pub(super) halted_at: Instant,
    /// Receiver: QPs whose receive queue was flushed since the stop.
    pub(super) rq_flushed: u128,
    /// The last CQ read found nothing.
    pub(super) quiet: bool,
    pub(super) next_query: Instant,
    /// Our address once the port is back (the GID read fresh).
    pub(super) local: Option<LocalAddr>,
    pub(super) new_qps: Vec<Qp<Init>>,
    /// What the QPs and the CQ were sized from ([`super::caps`]): a recovery
    /// makes new QPs alike, and a new CQ as well (a flush of every queue at
    /// once may have overrun the old one, which is then unusable).
    pub(super) plan: Plan,
    pub(super) new_cq: Option<Cq>,
    pub(super) rtr_tc: u8,
    pub(super) rtr_sl: u8,
    /// PORT_ERR and PORT_ACTIVE counts of our port last looked at.
    pub(super) port_seen: (u32, u32),
    /// Our port was ACTIVE when last looked at: recovery messages go out
    /// only then (one written while the link is down waits in TCP's
    /// retransmission back-off, seconds past the link's return).
    pub(super) port_up: bool,
    /// A PORT_ERR was seen and no recovery or PORT_ACTIVE has answered it yet.
    pub(super) went_down: bool,
    /// Why the last look found the port not usable yet (logged once per change).
    pub(super) port_wait: String,
    /// Why the last attempt to connect new QPs failed (an epoch was started
    /// again); named when the window is spent.
    pub(super) retry_why: String,
    /// Soft-RoCE: when the last "invalid request" started a recovery.
    pub(super) inv_req_at: Option<Instant>,
    /// RoCE: since when the connect waits for the peer's neighbour entry
    /// ([`super::neigh`]), when it asks again, and whether it has sent the
    /// datagram that makes the kernel resolve it.
    pub(super) neigh_since: Option<Instant>,
    pub(super) neigh_next: Instant,
    pub(super) neigh_kicked: bool,
    /// Recovery steps made in NCCL's calls (the keeper's sign that NCCL
    /// calls the comm, beside its CQ polls).
    pub(super) nccl_calls: u64,
    /// iWARP: the connection closed under us (a flushed work request) with
    /// no fault of our own port in sight: when, and the completion error.
    /// The peer closing its comm and the peer's link going down look the
    /// same here, so the comm waits up to [`PEER_FLUSH_WAIT`] for the
    /// peer's word (its Halt, or its out-of-band socket closing) before it
    /// starts a recovery itself; NCCL's next post starts one at once.
    pub(super) peer_flush: Option<(Instant, String)>,
    /// Receive queues whose flush was read before the comm stopped (the
    /// completion error that started the recovery, or an iWARP connection
    /// closed under it): counted as flushed at the stop.
    pub(super) pre_flushed: u128,
    /// A QP of this comm was moved to the error state here
    /// (`RUSTNET_FAULT_QP_ERROR`) since the last stop: its flushes are our
    /// own fault, not the peer's close.
    pub(super) forced: bool,
    /// iWARP: the message whose write last failed with a local QP
    /// operation error (the same one again fails the comm).
    pub(super) loc_err_seq: Option<u64>,
}

/// How long an iWARP comm whose connection closed under it, with no fault
/// of its own port, waits for the peer's Halt or close before it recovers
/// on its own ([`RecLink::peer_flush`]). A peer that ends its comm (NCCL's
/// teardown, rank by rank) closes the out-of-band socket within a few
/// milliseconds of its rdma_cm connections; a peer whose link went down
/// sends its Halt when that link is back, about when our connection learns
/// it was closed.
pub(super) const PEER_FLUSH_WAIT: Duration = Duration::from_secs(1);

impl RecLink {
    pub(super) fn new(window_s: u32, plan: Plan, rtr_tc: u8, rtr_sl: u8, port_seen: (u32, u32)) -> RecLink {
        let now = Instant::now();
        RecLink {
            m: Recovery::new(Duration::from_secs(window_s as u64)),
            window_s,
            inbuf: Vec::with_capacity(RC_HDR + RC_MAX_PAYLOAD),
            out: Vec::new(),
            sent: 0,
            cause: String::new(),
            halted_at: now,
            rq_flushed: 0,
            quiet: false,
            next_query: now,
            local: None,
            new_qps: Vec::new(),
            plan,
            new_cq: None,
            rtr_tc,
            rtr_sl,
            port_seen,
            port_up: true,
            went_down: false,
            port_wait: String::new(),
            retry_why: String::new(),
            inv_req_at: None,
            neigh_since: None,
            neigh_next: now,
            neigh_kicked: false,
            nccl_calls: 0,
            peer_flush: None,
            pre_flushed: 0,
            forced: false,
            loc_err_seq: None,
        }
    }

    /// Queue `m` for the out-of-band socket.
    pub(super) fn send(&mut self, m: &RcMsg) {
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
        m.encode(&mut self.out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_statuses_a_healthy_peer_comes_back_from_are_recoverable() {
        use super::super::ffi::*;
        for s in [IBV_WC_RETRY_EXC_ERR, IBV_WC_WR_FLUSH_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_RESP_TIMEOUT_ERR, IBV_WC_LOC_QP_OP_ERR] {
            assert!(recoverable(s), "{s}");
        }
        for s in [IBV_WC_REM_ACCESS_ERR, IBV_WC_LOC_PROT_ERR, IBV_WC_LOC_LEN_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_GENERAL_ERR] {
            assert!(!recoverable(s), "{s}");
        }
    }

    #[test]
    fn an_invalid_request_is_recoverable_on_soft_roce_only_and_not_twice_in_a_row() {
        use super::super::ffi::*;
        let inv = IBV_WC_REM_INV_REQ_ERR;
        assert!(!recoverable_on(inv, false, None), "a real HCA: a bug on one end");
        assert!(recoverable_on(inv, true, None), "rxe: the first one");
        assert!(recoverable_on(inv, true, Some(INV_REQ_SPACING)), "rxe: one long after the last");
        assert!(!recoverable_on(inv, true, Some(Duration::from_millis(30))), "rxe: the resent write failed again: ours");
        assert!(recoverable_on(IBV_WC_RETRY_EXC_ERR, false, Some(Duration::ZERO)), "the usual rule is untouched");
        for s in [IBV_WC_REM_ACCESS_ERR, IBV_WC_LOC_PROT_ERR, IBV_WC_LOC_LEN_ERR, IBV_WC_GENERAL_ERR] {
            assert!(!recoverable_on(s, true, None), "{s}: not even on rxe");
        }
    }
}
