//! The verbs data path's eager path for small messages, sans-IO.
//!
//! The receiver-driven protocol ([`super::fifo`]) costs two RDMA operations
//! on the critical path of every message: the receiver's clear-to-send (CTS)
//! write, then the sender's data write. For small messages the receiver
//! instead lends the sender a ring of [`RING_SLOTS`] bounce slots (registered
//! once per connection); a small send goes straight into the next slot with
//! one RDMA write, and the receiver copies it out when the matching receive
//! is posted. The receiver hands slots back ("credits") by writing a counter
//! into the sender's memory once half the ring was consumed.
//!
//! Matching stays NCCL's: the k-th send with tag `t` fills the k-th receive
//! buffer posted with tag `t`. Eager messages are allowed for one tag per
//! connection, the tag of the first buffer of the first receive (NCCL uses
//! one tag per connection unless connections are shared across ranks); both
//! ends count that tag's sends and buffers (`j`), so every eager message
//! names the buffer it fills, and a CTS element whose buffer was already
//! filled eagerly is skipped by the sender.
//!
//! Receives whose every buffer could only take an eager message (tag `t`,
//! capacity at most the eager limit) do not need their CTS at once: the
//! receiver defers those writes and sends them in batches ([`CtsQueue`]), so
//! a ping-pong of small messages costs one RDMA write per message. The sender
//! still walks every CTS slot in order; when it is stuck waiting for one, it
//! writes its FIFO head into the receiver's mailbox, which makes the receiver
//! flush at once (and hand back credits).
//!
//! The ring may come late (a feature both ends announce in their
//! [`Meta`](crate::ib_meta::Meta), [`FLAG_LATE_RING`](crate::ib_meta::FLAG_LATE_RING)):
//! the receiver then agrees on the limit at connect but registers no ring,
//! and a connection that never needs one never pays for it. The receiver
//! registers the ring the first time it posts a receive only eager messages
//! could fill (its CTS goes at once: no receive is deferred before the
//! ring exists), or when the sender asks: the first time a send of the
//! eager tag, small enough, finds no CTS, the sender writes [`RING_REQ`]
//! into the receiver's sizes area at [`RING_REQ_OFF`] (and sends that
//! message by rendezvous). The receiver writes the ring's address
//! ([`RingAnn`]) into the sender's credit block at [`RING_ANN_OFF`] with its
//! control writes; the sender registers its staging when it reads that, and
//! from then on everything is as above. No mailbox is written before.
//!
//! Ring slot layout (the sender writes header, payload and trailer in one
//! RDMA write; the marker words are `index + 1`, never 0):
//! ```text
//!   0 j      u64  index of the buffer among the tag's buffers
//!   8 size   u32
//!  12 tag    i32
//!  16 head   u64  the sender's FIFO head (CTS slots it has consumed)
//!  24 marker u64  ring index + 1 (header complete)
//!  32 payload, padded to 8 bytes, then the trailer: ring index + 1
//! ```
use std::collections::VecDeque;

use crate::error::ProtoError;
use crate::fifo::{FIFO_BYTES, FIFO_DEPTH, SIZES_BYTES};

/// Bounce slots per connection.
pub const RING_SLOTS: usize = 32;
/// Header bytes of a ring slot.
pub const HDR_BYTES: usize = 32;
/// The receiver's mailbox, at the start of its ring region.
pub const MAILBOX_BYTES: usize = 64;
/// The sender's credit word block, after its CTS FIFO.
pub const CREDIT_BYTES: usize = 64;
/// Largest eager limit the knob accepts.
pub const MAX_EAGER: usize = 64 << 10;
/// Deferred CTS writes are sent once this many are waiting (they normally go
/// out earlier, with the credit word, every RING_SLOTS / 2 eager messages).
pub const CTS_BATCH: usize = 24;
// A receive refused because its slot's previous lap still has a deferred
// CTS is then at least FIFO_DEPTH receives past the last CTS written, so
// the batch rule above already makes that CTS due: `Receiver::irecv`'s
// `force_cts` there is a second guard (scripts/model-mutants.py lists its
// removal as equivalent for this reason).
const _: () = assert!(CTS_BATCH < crate::fifo::FIFO_DEPTH);

/// Late ring: where the sender's request word goes, in the receiver's
/// sizes area (after the sizes slots; the area holds it).
pub const RING_REQ_OFF: usize = SIZES_BYTES;
/// Late ring: the request word.
pub const RING_REQ: u64 = u64::from_le_bytes(*b"RNRINGRQ");
/// Late ring: bytes of the receiver's sizes area (and of the sender's sizes
/// staging, where the request word is staged): the sizes slots, then the
/// request word.
pub const SIZES_AREA_BYTES: usize = RING_REQ_OFF + 8;
/// Late ring: where the receiver's [`RingAnn`] goes, in the sender's FIFO
/// region: the credit block after the FIFO, past the credit word (in its
/// staging at the same offset).
pub const RING_ANN_OFF: usize = FIFO_BYTES + 8;
/// Bytes of a [`RingAnn`] on the wire.
pub const RING_ANN_BYTES: usize = 24;
/// The marker that ends a [`RingAnn`] (written last, as a CTS element's).
pub const RING_ANN_MARKER: u64 = u64::from_le_bytes(*b"RNRINGOK");
const _: () = assert!(RING_ANN_OFF + RING_ANN_BYTES <= FIFO_BYTES + CREDIT_BYTES);

/// Late ring: the receiver's ring, as it tells the sender.
/// ```text
///   0 addr   u64  the ring (mailbox word first)
///   8 rkey   u32
///  12 max    u32  the eager limit it was sized for (the one agreed at connect)
///  16 marker u64  RING_ANN_MARKER
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingAnn {
    /// Address of the ring region.
    pub addr: u64,
    /// Its rkey.
    pub rkey: u32,
    /// The eager limit its slots hold.
    pub max: u32,
}

impl RingAnn {
    /// To the wire (marker last).
    pub fn encode(&self) -> [u8; RING_ANN_BYTES] {
        let mut b = [0u8; RING_ANN_BYTES];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        b[12..16].copy_from_slice(&self.max.to_le_bytes());
        b[16..24].copy_from_slice(&RING_ANN_MARKER.to_le_bytes());
        b
    }

    /// From the wire: `None` while the marker is not there.
    pub fn decode(b: &[u8; RING_ANN_BYTES]) -> Option<RingAnn> {
        if u64::from_le_bytes(b[16..24].try_into().unwrap()) != RING_ANN_MARKER {
            return None;
        }
        Some(RingAnn {
            addr: u64::from_le_bytes(b[0..8].try_into().unwrap()),
            rkey: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            max: u32::from_le_bytes(b[12..16].try_into().unwrap()),
        })
    }
}

/// Bytes on the wire for a `size`-byte message (header, padded payload, trailer).
pub fn wire_len(size: usize) -> usize {
    HDR_BYTES + size.div_ceil(8) * 8 + 8
}

/// Distance between ring slots for an eager limit of `max` bytes.
pub fn slot_stride(max: usize) -> usize {
    wire_len(max).div_ceil(64) * 64
}

/// Bytes of the receiver's ring region (mailbox + slots).
pub fn ring_bytes(max: usize) -> usize {
    MAILBOX_BYTES + RING_SLOTS * slot_stride(max)
}

/// Offset of ring slot for message `idx` in the receiver's region (and in
/// the sender's staging, which has the same layout).
pub fn slot_offset(idx: u64, max: usize) -> usize {
    MAILBOX_BYTES + (idx % RING_SLOTS as u64) as usize * slot_stride(max)
}

/// The marker of ring message `idx`.
pub fn marker(idx: u64) -> u64 {
    idx.wrapping_add(1)
}

/// The header of one eager message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Which of the tag's buffers it fills.
    pub j: u64,
    /// Payload bytes.
    pub size: u32,
    /// Its tag.
    pub tag: i32,
    /// The sender's FIFO head when it sent this.
    pub head: u64,
}

impl Header {
    /// Header bytes for ring message `idx` (marker last).
    pub fn encode(&self, idx: u64) -> [u8; HDR_BYTES] {
        let mut b = [0u8; HDR_BYTES];
        b[0..8].copy_from_slice(&self.j.to_le_bytes());
        b[8..12].copy_from_slice(&self.size.to_le_bytes());
        b[12..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.head.to_le_bytes());
        b[24..32].copy_from_slice(&marker(idx).to_le_bytes());
        b
    }

    /// Decode header bytes of ring message `idx`; `None` while its marker is not there.
    pub fn decode(b: &[u8; HDR_BYTES], idx: u64) -> Option<Header> {
        if u64::from_le_bytes(b[24..32].try_into().unwrap()) != marker(idx) {
            return None;
        }
        Some(Header {
            j: u64::from_le_bytes(b[0..8].try_into().unwrap()),
            size: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            tag: i32::from_le_bytes(b[12..16].try_into().unwrap()),
            head: u64::from_le_bytes(b[16..24].try_into().unwrap()),
        })
    }
}

// ---------------------------------------------------------------- sender

/// The sender's eager state.
#[derive(Debug, Clone)]
pub struct EagerTx {
    /// Largest eager message.
    pub max: usize,
    tag: Option<i32>,
    /// Sends of the eager tag accepted so far (eager or not).
    sent: u64,
    /// CTS elements of the eager tag loaded so far.
    seen: u64,
    /// Eager messages posted (the next ring index).
    posted: u64,
}

impl EagerTx {
    /// Eager messages up to `max` bytes.
    pub fn new(max: usize) -> EagerTx {
        EagerTx { max, tag: None, sent: 0, seen: 0, posted: 0 }
    }

    /// The eager tag, once the first CTS slot arrived.
    pub fn tag(&self) -> Option<i32> {
        self.tag
    }

    /// Eager messages posted so far.
    pub fn posted(&self) -> u64 {
        self.posted
    }

    /// A CTS slot was loaded (`seq` its sequence number, `tags` its
    /// buffers' tags): returns the mask of buffers already filled eagerly.
    pub fn on_load(&mut self, seq: u64, tags: &[i32]) -> u8 {
        if seq == 0 && self.tag.is_none() {
            self.tag = tags.first().copied();
        }
        let mut mask = 0u8;
        for (i, &t) in tags.iter().enumerate() {
            if Some(t) == self.tag {
                if self.seen < self.sent {
                    mask |= 1 << i;
                }
                self.seen += 1;
            }
        }
        mask
    }

    /// A send of `tag` matched a loaded CTS element.
    pub fn on_rendezvous(&mut self, tag: i32) {
        if Some(tag) == self.tag {
            self.sent += 1;
        }
    }

    /// Why a send of `tag`/`size` cannot go eagerly now (`None`: it can);
    /// `freed` is the receiver's credit counter.
    pub fn refuse(&self, tag: i32, size: usize, freed: u64) -> Option<&'static str> {
        if self.tag != Some(tag) {
            return Some("tag");
        }
        if size > self.max {
            return Some("size");
        }
        if self.posted.saturating_sub(freed) >= RING_SLOTS as u64 {
            return Some("credits");
        }
        None
    }

    /// Take the next ring slot for a send of the eager tag: `(ring index, header)`.
    pub fn take(&mut self, size: usize, head: u64) -> (u64, Header) {
        let idx = self.posted;
        let h = Header { j: self.sent, size: size as u32, tag: self.tag.unwrap_or(0), head };
        self.posted += 1;
        self.sent += 1;
        (idx, h)
    }

    /// Check a credit counter the receiver wrote.
    pub fn check_credits(&self, freed: u64) -> Result<(), ProtoError> {
        if freed > self.posted {
            return Err(ProtoError::EagerCredits { freed, posted: self.posted });
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- receiver

/// Where an arrived eager message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// To the posted buffer with this `j` (look it up).
    Posted(u64),
    /// No buffer yet: keep it in the ring until one is posted.
    Early,
}

/// The receiver's eager state.
#[derive(Debug)]
pub struct EagerRx {
    /// Largest eager message.
    pub max: usize,
    tag: Option<i32>,
    /// Buffers of the eager tag posted so far.
    posted: u64,
    /// Next ring index to look at.
    next: u64,
    /// Arrived before their buffer: (j, ring index), in j order.
    early: VecDeque<(u64, u64)>,
    done: [bool; RING_SLOTS],
    /// Ring slots released in order (the credit counter).
    freed: u64,
    reported: u64,
}

impl EagerRx {
    /// Eager messages up to `max` bytes.
    pub fn new(max: usize) -> EagerRx {
        EagerRx {
            max,
            tag: None,
            posted: 0,
            next: 0,
            early: VecDeque::with_capacity(RING_SLOTS),
            done: [false; RING_SLOTS],
            freed: 0,
            reported: 0,
        }
    }

    /// The eager tag, once the first receive was posted.
    pub fn tag(&self) -> Option<i32> {
        self.tag
    }

    /// Next ring index to poll.
    pub fn next(&self) -> u64 {
        self.next
    }

    /// Receive `seq` is being posted with these tags: arm on the first one
    /// and number the eager tag's buffers (`Some(j)` per buffer).
    pub fn assign(&mut self, seq: u64, tags: &[i32], out: &mut [Option<u64>]) {
        if seq == 0 && self.tag.is_none() {
            self.tag = tags.first().copied();
        }
        for (o, &t) in out.iter_mut().zip(tags) {
            *o = if Some(t) == self.tag {
                self.posted += 1;
                Some(self.posted - 1)
            } else {
                None
            };
        }
    }

    /// Buffer `j` was just posted: the ring index of its message if it
    /// already arrived.
    pub fn take_early(&mut self, j: u64) -> Option<u64> {
        match self.early.front() {
            Some(&(ej, idx)) if ej == j => {
                self.early.pop_front();
                Some(idx)
            }
            _ => None,
        }
    }

    /// Ring message `next()` arrived with header `h`: where it goes, or why
    /// it is not something a librustnet sender writes.
    pub fn arrived(&mut self, h: &Header) -> Result<Arrival, ProtoError> {
        let idx = self.next;
        if Some(h.tag) != self.tag {
            return Err(ProtoError::EagerTag { idx, tag: h.tag, want: self.tag });
        }
        if h.size as usize > self.max {
            return Err(ProtoError::EagerSize { idx, size: h.size, max: self.max });
        }
        if let Some(&(last, _)) = self.early.back() {
            if h.j <= last {
                return Err(ProtoError::EagerOrder { idx, j: h.j, last });
            }
        }
        self.next += 1;
        if h.j < self.posted {
            Ok(Arrival::Posted(h.j))
        } else {
            self.early.push_back((h.j, idx));
            Ok(Arrival::Early)
        }
    }

    /// Ring message `idx` was copied out: its slot can be reused.
    pub fn release(&mut self, idx: u64) {
        self.done[(idx % RING_SLOTS as u64) as usize] = true;
        while self.freed < self.next && self.done[(self.freed % RING_SLOTS as u64) as usize] {
            self.done[(self.freed % RING_SLOTS as u64) as usize] = false;
            self.freed += 1;
        }
    }

    /// The credit counter to write to the sender now, if any: once half the
    /// ring was freed since the last report, or on `force` when anything was.
    pub fn credits_due(&self, force: bool) -> Option<u64> {
        let new = self.freed - self.reported;
        if new >= (RING_SLOTS / 2) as u64 || (force && new > 0) {
            Some(self.freed)
        } else {
            None
        }
    }

    /// Ring slots released in order (the credit counter's value now).
    pub fn freed(&self) -> u64 {
        self.freed
    }

    /// The counter as last written.
    pub fn reported_value(&self) -> u64 {
        self.reported
    }

    /// The counter was written.
    pub fn reported(&mut self, v: u64) {
        self.reported = self.reported.max(v);
    }
}

// ---------------------------------------------------------------- CTS writes

/// Which CTS slots the receiver writes when: in sequence order, at once for
/// receives that may need a rendezvous, in batches for eager-only ones, and
/// never into a FIFO slot the sender may still be reading.
#[derive(Debug, Default, Clone)]
pub struct CtsQueue {
    /// Receives posted (next sequence number).
    next: u64,
    /// First sequence number not written yet.
    written: u64,
    /// Everything below this must be written as soon as there is room.
    must: u64,
    /// The sender has moved past every slot below this.
    head: u64,
    /// The sender said it waits for this slot.
    waiting: Option<u64>,
}

impl CtsQueue {
    /// Nothing posted.
    pub fn new() -> CtsQueue {
        CtsQueue::default()
    }

    /// Posted receives.
    pub fn next(&self) -> u64 {
        self.next
    }

    /// The sender's head as far as we know.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Written CTS slots (all below this).
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Can receive `seq` (= `next()`) take its slot? The previous lap's CTS
    /// must have gone out (its elements are kept per slot until then).
    /// Writing this one's CTS also waits for the sender to move past the
    /// previous lap ([`CtsQueue::due`]), but accepting the receive does not:
    /// a sender that reports its head late can never block a receive.
    pub fn can_post(&self) -> bool {
        let seq = self.next;
        seq < FIFO_DEPTH as u64 || self.written > seq - FIFO_DEPTH as u64
    }

    /// Receive `next()` was posted; `deferrable` when only eager messages can fill it.
    pub fn push(&mut self, deferrable: bool) {
        let seq = self.next;
        self.next += 1;
        if !deferrable || self.waiting.is_some_and(|w| w <= seq) {
            self.must = self.next;
        }
    }

    /// The sender moved past every slot below `head` (it told us, or a
    /// completion proves it).
    pub fn sender_head(&mut self, head: u64) {
        self.head = self.head.max(head);
        if self.waiting.is_some_and(|w| w < self.head) {
            self.waiting = None;
        }
    }

    /// The sender is stuck at slot `head`.
    pub fn sender_waiting(&mut self, head: u64) {
        self.sender_head(head);
        if head < self.head {
            return; // stale: the sender moved on since
        }
        self.waiting = Some(head);
        if head < self.next {
            self.must = self.must.max(head + 1);
        }
    }

    /// Force everything posted so far out (the previous lap of a slot a new
    /// receive needs, or an idle receiver).
    pub fn force(&mut self) {
        self.must = self.next;
    }

    /// The range `[from, to)` to write now, if any.
    #[inline]
    pub fn due(&self) -> Option<(u64, u64)> {
        if self.written >= self.next {
            return None; // (the polling loop's common case: every receive's CTS is out)
        }
        let want = if self.next - self.written >= CTS_BATCH as u64 { self.next } else { self.must.max(self.written) };
        let to = want.min(self.head + FIFO_DEPTH as u64);
        (to > self.written).then_some((self.written, to))
    }

    /// A recovering connection: the sender has moved past every slot below
    /// `head` and nothing at or above it is known to have landed. Every CTS
    /// from `head` on is written again, as soon as there is room.
    pub fn rewind(&mut self, head: u64) {
        self.sender_head(head);
        self.written = self.written.min(head.max(self.written.saturating_sub(FIFO_DEPTH as u64)));
        self.must = self.next;
    }

    /// `[written(), to)` went out.
    pub fn wrote(&mut self, to: u64) {
        debug_assert!(to >= self.written && to <= self.next);
        self.written = to;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        assert_eq!(wire_len(0), 40);
        assert_eq!(wire_len(8), 48);
        assert_eq!(wire_len(9), 56);
        assert_eq!(slot_stride(8192), 8256);
        assert_eq!(slot_offset(0, 8192), MAILBOX_BYTES);
        assert_eq!(slot_offset(RING_SLOTS as u64 + 1, 8192), MAILBOX_BYTES + 8256);
        assert_eq!(ring_bytes(8192), 64 + 32 * 8256);
    }

    #[test]
    fn header_roundtrip_and_laps() {
        let h = Header { j: 7, size: 13, tag: -3, head: 99 };
        let b = h.encode(5);
        assert_eq!(Header::decode(&b, 5), Some(h));
        assert_eq!(Header::decode(&b, 5 + RING_SLOTS as u64), None);
        assert_eq!(Header::decode(&[0; HDR_BYTES], 0), None);
    }

    #[test]
    fn sender_counts_and_skips_filled_elements() {
        let mut tx = EagerTx::new(64);
        // nothing before the first CTS: the tag is unknown
        assert_eq!(tx.refuse(5, 8, 0), Some("tag"));
        assert_eq!(tx.on_load(0, &[5]), 0);
        assert_eq!(tx.tag(), Some(5));
        tx.on_rendezvous(5); // slot 0 filled by the CTS path
                             // two eager sends before their CTS arrive
        assert_eq!(tx.refuse(5, 8, 0), None);
        assert_eq!(tx.refuse(5, 65, 0), Some("size"));
        assert_eq!(tx.refuse(6, 8, 0), Some("tag"));
        let (i, h) = tx.take(8, 1);
        assert_eq!((i, h.j, h.head), (0, 1, 1));
        let (i, h) = tx.take(4, 1);
        assert_eq!((i, h.j), (1, 2));
        // slot 1: (5, 6) -> first element already filled; slot 2: (6, 5, 5)
        assert_eq!(tx.on_load(1, &[5, 6]), 0b01);
        assert_eq!(tx.on_load(2, &[6, 5, 5]), 0b010);
        // the third tag-5 buffer of slot 2 waits for a rendezvous send
        tx.on_rendezvous(5);
        assert_eq!(tx.on_load(3, &[5]), 0);
        // credits
        for _ in 2..RING_SLOTS {
            tx.take(1, 0);
        }
        assert_eq!(tx.refuse(5, 1, 0), Some("credits"));
        assert_eq!(tx.refuse(5, 1, 1), None);
        assert!(tx.check_credits(RING_SLOTS as u64).is_ok());
        assert!(tx.check_credits(RING_SLOTS as u64 + 1).is_err());
    }

    #[test]
    fn receiver_matches_early_and_posted_messages() {
        let mut rx = EagerRx::new(64);
        let mut js = [None; 3];
        rx.assign(0, &[5, 6], &mut js[..2]);
        assert_eq!(&js[..2], &[Some(0), None]);
        let h = |j, size| Header { j, size, tag: 5, head: 0 };
        // buffer 0 is posted; the message for buffer 2 comes before its buffer
        assert_eq!(rx.arrived(&h(0, 8)), Ok(Arrival::Posted(0)));
        assert_eq!(rx.arrived(&h(2, 8)), Ok(Arrival::Early));
        // buffers 1 and 2 posted later: 1 is not in the ring (rendezvous), 2 is
        rx.assign(1, &[5, 5, 6], &mut js);
        assert_eq!(js, [Some(1), Some(2), None]);
        assert_eq!(rx.take_early(1), None);
        assert_eq!(rx.take_early(2), Some(1));
        // garbage
        assert!(rx.arrived(&Header { tag: 6, ..h(3, 1) }).is_err());
        assert!(rx.arrived(&h(3, 65)).is_err());
        // credits: freed in order only
        rx.release(1);
        assert_eq!(rx.credits_due(true), None);
        rx.release(0);
        assert_eq!(rx.credits_due(false), None);
        assert_eq!(rx.credits_due(true), Some(2));
        rx.reported(2);
        assert_eq!(rx.credits_due(true), None);
    }

    #[test]
    fn receiver_reports_credits_at_half_ring() {
        let mut rx = EagerRx::new(8);
        let mut js = [None; 1];
        for s in 0..RING_SLOTS as u64 {
            rx.assign(s, &[1], &mut js);
            assert_eq!(rx.arrived(&Header { j: s, size: 1, tag: 1, head: 0 }), Ok(Arrival::Posted(s)));
            rx.release(s);
            let due = rx.credits_due(false);
            if s + 1 == (RING_SLOTS / 2) as u64 {
                assert_eq!(due, Some(s + 1));
                rx.reported(s + 1);
            } else if s + 1 < (RING_SLOTS / 2) as u64 {
                assert_eq!(due, None);
            }
        }
    }

    #[test]
    fn cts_queue_defers_batches_and_respects_the_fifo() {
        let mut q = CtsQueue::new();
        // a receive that may need a rendezvous is written at once
        q.push(false);
        assert_eq!(q.due(), Some((0, 1)));
        q.wrote(1);
        // eager-only receives wait for a batch
        for _ in 0..CTS_BATCH - 1 {
            q.push(true);
            assert_eq!(q.due(), None);
        }
        q.push(true);
        assert_eq!(q.due(), Some((1, 1 + CTS_BATCH as u64)));
        q.wrote(1 + CTS_BATCH as u64);
        // a non-deferrable receive flushes the deferred ones before it
        q.push(true);
        q.push(false);
        let b = 1 + CTS_BATCH as u64;
        assert_eq!(q.due(), Some((b, b + 2)));
        q.wrote(b + 2);
        // the FIFO: slot seq reuses seq - FIFO_DEPTH's place
        while q.next() < FIFO_DEPTH as u64 {
            assert!(q.can_post());
            q.push(false);
            let (a, b) = q.due().unwrap();
            assert_eq!(a, q.written());
            q.wrote(b);
        }
        // slot 0's previous lap went out: the receive is taken, but its CTS
        // waits until the sender moved past slot 0
        assert!(q.can_post());
        q.push(false);
        assert_eq!(q.due(), None, "sender has not moved past slot 0");
        q.sender_head(1);
        assert_eq!(q.due(), Some((32, 33)));
        q.wrote(33);
        // a receive whose previous lap is unwritten cannot take the slot
        q.sender_head(40);
        let mut q2 = CtsQueue::new();
        for _ in 0..FIFO_DEPTH {
            q2.push(true);
        }
        q2.sender_head(FIFO_DEPTH as u64);
        assert!(!q2.can_post(), "slot 0 of the previous lap is not written yet");
        assert_eq!(q2.due(), Some((0, FIFO_DEPTH as u64)));
        q2.wrote(1);
        assert!(q2.can_post());
    }

    #[test]
    fn cts_queue_answers_a_waiting_sender() {
        let mut q = CtsQueue::new();
        q.push(false);
        q.wrote(1);
        q.push(true);
        q.push(true);
        assert_eq!(q.due(), None);
        // the sender is stuck at slot 1: write 1 (and what came with it)
        q.sender_waiting(1);
        assert_eq!(q.due(), Some((1, 2)));
        q.wrote(2);
        // it waits at slot 3, not posted yet: when posted, not deferred
        q.sender_waiting(3);
        q.push(true); // 3
        assert_eq!(q.due(), Some((2, 4)));
        q.wrote(4);
        q.sender_head(4);
        q.push(true);
        assert_eq!(q.due(), None);
    }

    // The model run of both ends (random interleavings, 1000 seeds) drives the
    // shipping machines, rx::Receiver and tx::Sender: tests/verbs_model.rs.
}
