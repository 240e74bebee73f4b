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
//! receives are pending). A send completes once all of it is acknowledged,
//! not once it is written: until then its pieces stay queued. Where the
//! receiver's acceptance says its resume offsets count the bytes its kernel
//! holds unread (`REPLY_QUEUED_OFFSETS`, `RUSTNET_SOCKET_KERNEL_ACK` at both
//! ends, the default), the receiving *kernel's* acknowledgement is enough
//! (the sender reads `SIOCOUTQ`), so no send waits for the receiving process
//! to run; the receiver then reads on after a fault until its sockets are
//! empty, and after a reconnection reads what the replaced sockets held
//! before the new ones. When a stream is reset, or the receiver is silent past
//! `RUSTNET_SOCKET_TIMEOUT`, the send comm reconnects to the receiving
//! process's resume port with the connection's token, learns the receiver's
//! byte count per stream, and resends from there; the receive comm takes the
//! new streams and goes on where it stood. NCCL's requests stay pending
//! meanwhile. A dead peer (its resume port refused, or its comm closed) or
//! a spent window fails the comm with an error naming the peer.
//!
//! The sending end is [`super::send`], the receiving end [`super::recv`];
//! this module holds what both use: the data path's sizes, the errors that
//! name the peer, and the watch for a silent peer ([`AckWatch`]).
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::error::{Errno, Error};
use crate::proto::resume::ACK_LEN;
use crate::proto::wire::MAX_STREAMS;

/// Staging buffer for stream 0 (headers and small payloads).
pub(super) const STAGE_LEN: usize = 64 << 10;
/// Bytes one gather write offers before it stops adding queued pieces.
pub(super) const WRITE_BATCH: usize = 1 << 20;
/// Payload remainders at least this large are read straight into NCCL's buffer.
pub(super) const DIRECT_READ: usize = 16 << 10;
/// Room for one acknowledgement record per stream.
pub(super) const ACK_BUF: usize = MAX_STREAMS * ACK_LEN;
/// A send comm waiting for acknowledgements looks for them at most this
/// often after a look that found none.
pub(super) const ACK_POLL: Duration = Duration::from_micros(25);
/// The same where sends complete on the receiving kernel's
/// acknowledgements: the records then only tell of a closed receiver.
pub(super) const ACK_LIVENESS_POLL: Duration = Duration::from_millis(1);

pub(super) fn peer_error(peer: &SocketAddr, what: impl Into<String>) -> Error {
    Error::Remote { peer: peer.to_string(), what: what.into() }
}

pub(super) fn io_error(peer: &SocketAddr, dir: &str, e: Errno) -> Error {
    let hint = match e.0 {
        libc::ECONNRESET | libc::EPIPE => " (the peer process died or closed its comm)",
        libc::ETIMEDOUT => " (no answer within RUSTNET_SOCKET_TIMEOUT: peer host down or network cut)",
        _ => "",
    };
    peer_error(peer, format!("{dir} failed: {e}{hint}"))
}

/// "N s" for a window in an error.
pub(super) fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
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

#[cfg(test)]
#[path = "p2p_tests.rs"]
mod tests;
