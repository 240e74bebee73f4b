//! The verbs data path's receiver-driven protocol, sans-IO: the CTS FIFO
//! entries, the slot/sequence arithmetic, the sender's tag matching of a
//! (grouped) receive, the immediate-data encoding, the plan of RDMA writes
//! per QP, and the send-queue budget for selective signalling. No verbs and
//! no system calls here: `transport::ib::p2p` feeds bytes and completions in.
//!
//! How a message moves:
//! 1. `irecv` (receiver) RDMA-writes one [`Cts`] element per buffer into
//!    slot `seq % FIFO_DEPTH` of the sender's FIFO. Each element ends with a
//!    marker word `seq + 1`, so a stale or half-written slot is never taken
//!    for a fresh one. The FIFO is element-major: the first elements of all
//!    slots are contiguous, so the CTS of consecutive single-buffer receives
//!    go out as one small write.
//! 2. `isend` (sender) returns "not yet" until the head slot is valid, then
//!    matches its tag to an element ([`SendFifo::match_send`]). When every
//!    element of the slot has its send, the writes of [`plan_lane`] go out:
//!    data by RDMA WRITE, and on each lane one last WRITE_WITH_IMM, signaled.
//! 3. The receiver learns which receive completed (its FIFO slot) and the
//!    sizes from the immediate ([`ImmKind::Size`] for a single receive) or
//!    from its sizes slot, written just before the immediate of lane 0
//!    ([`ImmKind::Sizes`]).
//!
//! Small messages may skip steps 1-2: see [`super::eager`]; a CTS element an
//! eager message already filled is skipped by the sender.
use crate::error::ProtoError;
use crate::pool::ReqId;
use crate::{MAX_RECVS, MAX_REQUESTS};

/// CTS slots in the sender's FIFO (one per receive request in flight).
pub const FIFO_DEPTH: usize = MAX_REQUESTS;
/// Bytes per CTS element (half a cache line, marker last).
pub const ELEM_BYTES: usize = 32;
/// Bytes of one slot's elements (up to MAX_RECVS of them, not contiguous).
pub const SLOT_BYTES: usize = ELEM_BYTES * MAX_RECVS;
/// Bytes of the elements `i` of all slots (one row of the FIFO).
pub const ROW_BYTES: usize = ELEM_BYTES * FIFO_DEPTH;
/// Bytes of the whole FIFO.
pub const FIFO_BYTES: usize = SLOT_BYTES * FIFO_DEPTH;
/// Offset of the marker word inside an element.
pub const MARKER_OFFSET: usize = ELEM_BYTES - 8;
/// Bytes per sizes slot on the receiver (one u32 per buffer).
pub const SIZES_SLOT_BYTES: usize = 4 * MAX_RECVS;
/// Bytes of the receiver's sizes area.
pub const SIZES_BYTES: usize = SIZES_SLOT_BYTES * FIFO_DEPTH;
/// Data chunks are multiples of this when a message is split across QPs
/// (NCCL's LL/LL128 protocols need 128-byte granularity).
pub const CHUNK_ALIGN: usize = 128;
/// Most WRs one lane posts for one slot: a write per buffer plus the final one.
pub const MAX_LANE_WRS: usize = MAX_RECVS + 1;

/// Offset of slot `seq`'s first element in the FIFO (element-major layout:
/// slots `a..b` of one lap have their first elements at `slot_offset(a)..slot_offset(b)`).
pub fn slot_offset(seq: u64) -> usize {
    (seq % FIFO_DEPTH as u64) as usize * ELEM_BYTES
}

/// Offset of element `i` of slot `seq` in the FIFO.
pub fn elem_offset(seq: u64, i: usize) -> usize {
    i * ROW_BYTES + slot_offset(seq)
}

/// Offset of slot `seq` in the receiver's sizes area.
pub fn sizes_offset(seq: u64) -> usize {
    (seq % FIFO_DEPTH as u64) as usize * SIZES_SLOT_BYTES
}

/// The marker that makes slot `seq` valid (never 0, so zeroed memory is never valid).
pub fn marker(seq: u64) -> u64 {
    seq.wrapping_add(1)
}

/// One advertised receive buffer ("clear to send").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cts {
    /// Remote address to write to.
    pub addr: u64,
    /// Its rkey.
    pub rkey: u32,
    /// Capacity in bytes.
    pub cap: u32,
    /// Tag the buffer expects.
    pub tag: i32,
    /// Buffers in the grouped receive (1..=MAX_RECVS).
    pub n: u8,
    /// Index of this buffer in the group.
    pub i: u8,
}

/// What a FIFO element holds right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    /// Not (yet) written for this sequence number.
    NotYet,
    /// A valid element.
    Ready(Cts),
    /// Written for this sequence number but inconsistent.
    Bad(ProtoError),
}

impl Cts {
    /// Element bytes for slot `seq` (marker last).
    pub fn encode(&self, seq: u64) -> [u8; ELEM_BYTES] {
        let mut b = [0u8; ELEM_BYTES];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        b[12..16].copy_from_slice(&self.cap.to_le_bytes());
        b[16..20].copy_from_slice(&self.tag.to_le_bytes());
        b[20] = self.n;
        b[21] = self.i;
        // 22..24 unused
        b[MARKER_OFFSET..].copy_from_slice(&marker(seq).to_le_bytes());
        b
    }

    /// Decode element `i` of slot `seq`.
    pub fn decode(b: &[u8; ELEM_BYTES], seq: u64, i: usize) -> Slot {
        let m = u64::from_le_bytes(b[MARKER_OFFSET..].try_into().unwrap());
        if m != marker(seq) {
            return Slot::NotYet;
        }
        let c = Cts {
            addr: u64::from_le_bytes(b[0..8].try_into().unwrap()),
            rkey: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            cap: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            tag: i32::from_le_bytes(b[16..20].try_into().unwrap()),
            n: b[20],
            i: b[21],
        };
        if c.n == 0 || c.n as usize > MAX_RECVS || c.i as usize != i || i >= c.n as usize {
            return Slot::Bad(ProtoError::CtsElement { i, seq, claims_i: c.i, claims_n: c.n });
        }
        Slot::Ready(c)
    }
}

/// Largest size a single-receive immediate carries (larger ones go
/// through the sizes slot).
pub const IMM_MAX_SIZE: u32 = (1 << 25) - 1;
const KIND_SIZE: u32 = 0;
const KIND_SIZES: u32 = 1 << 30;
const KIND_FAIL: u32 = 3 << 30;
const SLOT_SHIFT: u32 = 25;
const _: () = assert!(FIFO_DEPTH == 32, "the immediate has 5 bits for the FIFO slot");
/// In a sizes slot: this buffer was filled by an eager message.
pub const EAGER_SIZE: u32 = u32::MAX;

/// Why a sender gave up on a slot (told to the receiver in the immediate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailCode {
    /// A send was larger than the buffer its tag matched.
    TooLarge,
    /// A send's tag matched no buffer of the slot.
    NoTag,
    /// Anything else.
    Other,
}

/// What the immediate of a lane's last write says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImmKind {
    /// Single receive: the exact size (at most [`IMM_MAX_SIZE`]).
    Size(u32),
    /// The n sizes are in the sizes slot.
    Sizes(u8),
    /// The sender failed this slot.
    Fail(FailCode),
}

/// The 32-bit immediate of the last write on a lane: which receive (FIFO
/// slot) it completes, and how to learn the sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Imm {
    /// `seq % FIFO_DEPTH` of the receive.
    pub slot: u8,
    /// The rest.
    pub kind: ImmKind,
}

impl Imm {
    /// For receive `seq`.
    pub fn new(seq: u64, kind: ImmKind) -> Imm {
        Imm { slot: (seq % FIFO_DEPTH as u64) as u8, kind }
    }

    /// To the wire.
    pub fn encode(self) -> u32 {
        let slot = (self.slot as u32) << SLOT_SHIFT;
        match self.kind {
            ImmKind::Size(s) => {
                debug_assert!(s <= IMM_MAX_SIZE);
                KIND_SIZE | slot | s
            }
            ImmKind::Sizes(n) => KIND_SIZES | slot | n as u32,
            ImmKind::Fail(FailCode::TooLarge) => KIND_FAIL | slot | 1,
            ImmKind::Fail(FailCode::NoTag) => KIND_FAIL | slot | 2,
            ImmKind::Fail(FailCode::Other) => KIND_FAIL | slot | 3,
        }
    }

    /// From the wire; `Err` for values no sender produces.
    pub fn decode(v: u32) -> Result<Imm, ProtoError> {
        let slot = ((v >> SLOT_SHIFT) & 0x1f) as u8;
        let low = v & ((1 << SLOT_SHIFT) - 1);
        let kind = match v & (3 << 30) {
            KIND_SIZE => ImmKind::Size(low),
            KIND_SIZES if (1..=MAX_RECVS as u32).contains(&low) => ImmKind::Sizes(low as u8),
            KIND_FAIL => ImmKind::Fail(match low {
                1 => FailCode::TooLarge,
                2 => FailCode::NoTag,
                _ => FailCode::Other,
            }),
            _ => return Err(ProtoError::Imm(v)),
        };
        Ok(Imm { slot, kind })
    }
}

/// The receiver's view of a finished rendezvous, turned into sizes: `None`
/// for a buffer the sender says it filled eagerly (its message comes through
/// the eager ring).
pub fn sizes_from_imm(
    imm: ImmKind,
    caps: &[usize],
    sizes_slot: impl FnOnce() -> [u32; MAX_RECVS],
) -> Result<[Option<usize>; MAX_RECVS], ProtoError> {
    let n = caps.len();
    let mut out = [None; MAX_RECVS];
    match imm {
        ImmKind::Size(s) if n == 1 => {
            if s as usize > caps[0] {
                return Err(ProtoError::ImmOverflow { size: s, cap: caps[0] });
            }
            out[0] = Some(s as usize);
        }
        ImmKind::Sizes(g) if g as usize == n => {
            let s = sizes_slot();
            for i in 0..n {
                if s[i] == EAGER_SIZE {
                    continue;
                }
                if s[i] as usize > caps[i] {
                    return Err(ProtoError::SizesOverflow { i, size: s[i], cap: caps[i] });
                }
                out[i] = Some(s[i] as usize);
            }
        }
        ImmKind::Fail(FailCode::TooLarge) => return Err(ProtoError::SenderTooLarge),
        ImmKind::Fail(FailCode::NoTag) => return Err(ProtoError::SenderNoTag),
        ImmKind::Fail(FailCode::Other) => return Err(ProtoError::SenderFailed),
        kind => return Err(ProtoError::ImmMisfit { kind: format!("{kind:?}"), n }),
    }
    Ok(out)
}

/// Sizes slot bytes (n u32 little endian).
pub fn encode_sizes(sizes: &[u32]) -> [u8; SIZES_SLOT_BYTES] {
    let mut b = [0u8; SIZES_SLOT_BYTES];
    for (i, s) in sizes.iter().enumerate() {
        b[4 * i..4 * i + 4].copy_from_slice(&s.to_le_bytes());
    }
    b
}

/// Decode a sizes slot.
pub fn decode_sizes(b: &[u8; SIZES_SLOT_BYTES]) -> [u32; MAX_RECVS] {
    let mut s = [0u32; MAX_RECVS];
    for (i, v) in s.iter_mut().enumerate() {
        *v = u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    }
    s
}

// ---------------------------------------------------------------- lanes

/// Which QPs message `seq` uses: `(first, count)`. Rotation (split off):
/// one QP, `seq % nqps`. Split: all of them.
pub fn lanes(seq: u64, nqps: usize, split: bool) -> (usize, usize) {
    if split {
        (0, nqps)
    } else {
        ((seq % nqps as u64) as usize, 1)
    }
}

/// Part `lane` of `nlanes` of a `size`-byte message: `(offset, len)`;
/// 128-byte aligned chunks, later lanes may be empty.
pub fn chunk(size: usize, lane: usize, nlanes: usize) -> (usize, usize) {
    if nlanes <= 1 {
        return (0, size);
    }
    let per = size.div_ceil(nlanes).div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN;
    let off = (lane * per).min(size);
    (off, per.min(size - off))
}

// ---------------------------------------------------------------- sender

/// Why a send cannot take the head slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Told to the receiver.
    pub code: FailCode,
    /// For the sender's error.
    pub what: String,
}

/// The slot the sender is filling.
#[derive(Debug, Clone, Default)]
pub struct Group {
    /// Sequence number of the slot.
    pub seq: u64,
    /// Its elements (n of them valid).
    pub elems: [Cts; MAX_RECVS],
    /// Buffers in the group.
    pub n: usize,
    /// Send size per element once matched.
    pub sizes: [u32; MAX_RECVS],
    /// Local source address per element once matched.
    pub src: [u64; MAX_RECVS],
    /// Local key per element once matched.
    pub lkey: [u32; MAX_RECVS],
    /// Send request per element once matched.
    pub reqs: [Option<ReqId>; MAX_RECVS],
    /// Elements already filled by eager messages (bit i = element i).
    pub eager: u8,
    matched: usize,
}

impl Group {
    /// Every element has its send.
    pub fn complete(&self) -> bool {
        self.matched == self.n
    }

    /// Element `i` was filled by an eager message.
    pub fn is_eager(&self, i: usize) -> bool {
        self.eager & (1 << i) != 0
    }

    /// The immediate this group's lanes end with.
    pub fn imm(&self) -> Imm {
        let kind = if self.n == 1 && self.eager == 0 && self.sizes[0] <= IMM_MAX_SIZE {
            ImmKind::Size(self.sizes[0])
        } else {
            ImmKind::Sizes(self.n as u8)
        };
        Imm::new(self.seq, kind)
    }

    /// What the sizes slot must say (eager elements marked [`EAGER_SIZE`]).
    pub fn wire_sizes(&self) -> [u32; MAX_RECVS] {
        let mut s = [0u32; MAX_RECVS];
        for (i, v) in s.iter_mut().enumerate().take(self.n) {
            *v = if self.is_eager(i) { EAGER_SIZE } else { self.sizes[i] };
        }
        s
    }
}

/// Sender-side FIFO state: the head sequence number and the group being filled.
#[derive(Debug, Default)]
pub struct SendFifo {
    head: u64,
    cur: Option<Group>,
}

impl SendFifo {
    /// Fresh state (slot 0 next).
    pub fn new() -> SendFifo {
        SendFifo::default()
    }

    /// Sequence number of the head slot.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// The group being filled, if the head slot was loaded.
    pub fn current(&self) -> Option<&Group> {
        self.cur.as_ref()
    }

    /// Take the head slot's elements (all valid, `elems[0].n` of them);
    /// `eager`: the elements eager messages already filled.
    pub fn load(&mut self, elems: &[Cts], eager: u8) {
        debug_assert!(self.cur.is_none() && !elems.is_empty() && elems.len() == elems[0].n as usize);
        let mut g = Group {
            seq: self.head,
            elems: [Cts::default(); MAX_RECVS],
            n: elems.len(),
            sizes: [0; MAX_RECVS],
            src: [0; MAX_RECVS],
            lkey: [0; MAX_RECVS],
            reqs: [None; MAX_RECVS],
            eager,
            matched: eager.count_ones() as usize,
        };
        g.elems[..elems.len()].copy_from_slice(elems);
        self.cur = Some(g);
    }

    /// Which element a send of `tag`/`size` fills: the first unmatched one
    /// with that tag (NCCL's rule). Nothing is recorded.
    pub fn match_send(&self, tag: i32, size: usize) -> Result<usize, Mismatch> {
        let g = self.cur.as_ref().expect("match_send without a loaded slot");
        let free = |i: usize| g.reqs[i].is_none() && !g.is_eager(i);
        let i = (0..g.n).find(|&i| free(i) && g.elems[i].tag == tag).ok_or_else(|| {
            let want: Vec<i32> = (0..g.n).filter(|&i| free(i)).map(|i| g.elems[i].tag).collect();
            Mismatch {
                code: FailCode::NoTag,
                what: format!("send with tag {tag} but the peer's receive #{} waits for tags {want:?}", g.seq),
            }
        })?;
        if size > g.elems[i].cap as usize {
            return Err(Mismatch {
                code: FailCode::TooLarge,
                what: format!(
                    "send of {size} bytes (tag {tag}) is larger than the peer's receive buffer of {} bytes (receive #{})",
                    g.elems[i].cap, g.seq
                ),
            });
        }
        Ok(i)
    }

    /// Record the send for element `i`; true when the group is complete.
    pub fn record(&mut self, i: usize, size: usize, src: u64, lkey: u32, req: ReqId) -> bool {
        let g = self.cur.as_mut().expect("record without a loaded slot");
        debug_assert!(g.reqs[i].is_none());
        g.sizes[i] = size as u32;
        g.src[i] = src;
        g.lkey[i] = lkey;
        g.reqs[i] = Some(req);
        g.matched += 1;
        g.complete()
    }

    /// Hand out the head group (complete, or abandoned after a mismatch)
    /// and move to the next slot.
    pub fn advance(&mut self) -> Option<Group> {
        let g = self.cur.take();
        if g.is_some() {
            self.head += 1;
        }
        g
    }
}

/// One RDMA write of the plan for a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrKind {
    /// Bytes `off..off+len` of element `elem`'s data.
    Data {
        /// Element.
        elem: usize,
        /// Offset in the message.
        off: usize,
        /// Length (> 0).
        len: usize,
    },
    /// The n sizes into the receiver's sizes slot.
    Sizes,
    /// Zero-length write, only for its immediate.
    Empty,
}

/// A planned write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedWr {
    /// What it carries.
    pub kind: WrKind,
    /// Immediate (only the last WR of a lane has one; it is also signaled).
    pub imm: Option<u32>,
}

/// The writes lane `lane` (of `nlanes`) posts for a complete group, in
/// order; the last carries the immediate. Elements filled eagerly carry no
/// data. `fail` replaces the data by a single empty write carrying a fail code.
pub fn plan_lane(g: &Group, lane: usize, nlanes: usize, fail: Option<FailCode>, out: &mut [PlannedWr; MAX_LANE_WRS]) -> usize {
    if let Some(code) = fail {
        out[0] = PlannedWr { kind: WrKind::Empty, imm: Some(Imm::new(g.seq, ImmKind::Fail(code)).encode()) };
        return 1;
    }
    let mut k = 0;
    for e in (0..g.n).filter(|&e| !g.is_eager(e)) {
        let (off, len) = chunk(g.sizes[e] as usize, lane, nlanes);
        if len > 0 {
            out[k] = PlannedWr { kind: WrKind::Data { elem: e, off, len }, imm: None };
            k += 1;
        }
    }
    let imm = g.imm();
    let word = imm.encode();
    if matches!(imm.kind, ImmKind::Sizes(_)) && lane == 0 {
        out[k] = PlannedWr { kind: WrKind::Sizes, imm: Some(word) };
        k += 1;
    } else if g.n == 1 && k > 0 {
        out[k - 1].imm = Some(word);
    } else {
        out[k] = PlannedWr { kind: WrKind::Empty, imm: Some(word) };
        k += 1;
    }
    k
}

// ---------------------------------------------------------------- selective signalling

/// Send-queue accounting for WRs that are mostly unsignaled (the
/// receiver's CTS writes): an unsignaled WR keeps its SQ entry until a later
/// signaled WR on the same QP completes.
#[derive(Debug, Clone)]
pub struct SqBudget {
    depth: u64,
    interval: u64,
    posted: u64,
    retired: u64,
    last_signaled: u64,
}

impl SqBudget {
    /// A queue of `depth` WRs, signaling at least every `interval` WRs.
    pub fn new(depth: usize, interval: usize) -> SqBudget {
        assert!(depth >= 2 && interval >= 1 && interval <= depth / 2);
        SqBudget { depth: depth as u64, interval: interval as u64, posted: 0, retired: 0, last_signaled: 0 }
    }

    /// WRs that still hold an SQ entry.
    pub fn outstanding(&self) -> u64 {
        self.posted - self.retired
    }

    /// Room for one more WR?
    pub fn has_room(&self) -> bool {
        self.outstanding() < self.depth
    }

    /// WRs that can still be posted.
    pub fn room(&self) -> usize {
        (self.depth - self.outstanding()) as usize
    }

    /// Account one WR; returns `Some(count)` when it must be signaled,
    /// `count` being the value to pass to [`SqBudget::retire`] when its
    /// completion arrives (encode it in the wr_id).
    pub fn post(&mut self) -> Option<u64> {
        debug_assert!(self.has_room());
        self.posted += 1;
        let must = self.posted - self.last_signaled >= self.interval || self.outstanding() >= self.depth / 2;
        if must {
            self.last_signaled = self.posted;
            Some(self.posted)
        } else {
            None
        }
    }

    /// The QP's send queue was emptied (it was replaced after a fault):
    /// nothing posted holds an entry any more.
    pub fn reset(&mut self) {
        self.retired = self.posted;
        self.last_signaled = self.posted;
    }

    /// A signaled WR numbered `count` completed: it and all before it are done.
    pub fn retire(&mut self, count: u64) {
        if count > self.retired && count <= self.posted {
            self.retired = count;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cts(tag: i32, cap: u32, n: u8, i: u8) -> Cts {
        Cts { addr: 0x1000 * (i as u64 + 1), rkey: 7, cap, tag, n, i }
    }

    #[test]
    fn layout_constants() {
        assert_eq!(FIFO_BYTES, 8192);
        assert_eq!(elem_offset(33, 0), 32);
        assert_eq!(elem_offset(33, 2), 2 * ROW_BYTES + 32);
        assert_eq!(slot_offset(5) - slot_offset(4), ELEM_BYTES, "first elements are contiguous");
        assert_eq!(sizes_offset(31), 31 * 32);
        assert_eq!(sizes_offset(32), 0);
    }

    #[test]
    fn element_roundtrip_and_marker() {
        let c = cts(-5, 4096, 3, 2);
        let b = c.encode(77);
        assert_eq!(Cts::decode(&b, 77, 2), Slot::Ready(c));
        // same bytes are stale for the next lap of the ring
        assert_eq!(Cts::decode(&b, 77 + FIFO_DEPTH as u64, 2), Slot::NotYet);
        // zeroed memory is never valid, even for seq 0
        assert_eq!(Cts::decode(&[0; ELEM_BYTES], 0, 0), Slot::NotYet);
        assert!(matches!(Cts::decode(&b, 77, 1), Slot::Bad(_)));
        let bad = Cts { n: 9, ..c }.encode(1);
        assert!(matches!(Cts::decode(&bad, 1, 2), Slot::Bad(_)));
    }

    #[test]
    fn imm_roundtrip() {
        for (seq, k) in [
            (0, ImmKind::Size(0)),
            (31, ImmKind::Size(1)),
            (32, ImmKind::Size(IMM_MAX_SIZE)),
            (5, ImmKind::Sizes(1)),
            (7, ImmKind::Sizes(8)),
            (63, ImmKind::Fail(FailCode::TooLarge)),
            (1, ImmKind::Fail(FailCode::NoTag)),
        ] {
            let v = Imm::new(seq, k);
            assert_eq!(v.slot as u64, seq % 32);
            assert_eq!(Imm::decode(v.encode()).unwrap(), v);
        }
        assert!(Imm::decode(0x8000_0001).is_err());
        assert!(Imm::decode(KIND_SIZES | 9).is_err());
        assert!(Imm::decode(KIND_SIZES).is_err());
    }

    #[test]
    fn sizes_from_completions() {
        assert_eq!(sizes_from_imm(ImmKind::Size(10), &[10], || unreachable!()).unwrap()[0], Some(10));
        let e = sizes_from_imm(ImmKind::Size(11), &[10], || unreachable!()).unwrap_err();
        assert_eq!(e, ProtoError::ImmOverflow { size: 11, cap: 10 });
        assert_eq!(e.to_string(), "peer wrote 11 bytes into a 10-byte receive buffer");
        let s = sizes_from_imm(ImmKind::Sizes(2), &[8, 8], || decode_sizes(&encode_sizes(&[3, 0]))).unwrap();
        assert_eq!(&s[..2], &[Some(3), Some(0)]);
        let s = sizes_from_imm(ImmKind::Sizes(2), &[8, 8], || decode_sizes(&encode_sizes(&[EAGER_SIZE, 4]))).unwrap();
        assert_eq!(&s[..2], &[None, Some(4)]);
        assert_eq!(
            sizes_from_imm(ImmKind::Sizes(2), &[8, 8], || decode_sizes(&encode_sizes(&[3, 9]))),
            Err(ProtoError::SizesOverflow { i: 1, size: 9, cap: 8 })
        );
        assert_eq!(
            sizes_from_imm(ImmKind::Sizes(3), &[8, 8], || unreachable!()),
            Err(ProtoError::ImmMisfit { kind: "Sizes(3)".into(), n: 2 })
        );
        assert_eq!(sizes_from_imm(ImmKind::Fail(FailCode::TooLarge), &[8], || unreachable!()), Err(ProtoError::SenderTooLarge));
    }

    #[test]
    fn chunks_cover_each_message_once() {
        for &size in &[0usize, 1, 127, 128, 129, 1000, 4096, 65537, 1 << 20] {
            for nl in 1..=4 {
                let mut next = 0;
                for l in 0..nl {
                    let (off, len) = chunk(size, l, nl);
                    if len > 0 {
                        assert_eq!(off, next, "size {size} nl {nl} lane {l}");
                        assert!(nl == 1 || off % CHUNK_ALIGN == 0);
                        next += len;
                    }
                }
                assert_eq!(next, size);
            }
        }
        assert_eq!(lanes(5, 2, false), (1, 1));
        assert_eq!(lanes(5, 2, true), (0, 2));
    }

    fn rid(slot: u8) -> ReqId {
        ReqId { slot, gen: 0 }
    }

    #[test]
    fn sender_matches_grouped_receive_by_tag() {
        let mut f = SendFifo::new();
        assert!(f.current().is_none());
        f.load(&[cts(1, 100, 3, 0), cts(2, 100, 3, 1), cts(1, 10, 3, 2)], 0);
        // tag 2 first, then the two tag-1 buffers in order
        let i = f.match_send(2, 50).unwrap();
        assert_eq!(i, 1);
        assert!(!f.record(i, 50, 0xa, 1, rid(0)));
        let i = f.match_send(1, 100).unwrap();
        assert_eq!(i, 0);
        assert!(!f.record(i, 100, 0xb, 1, rid(1)));
        let e = f.match_send(1, 11).unwrap_err();
        assert_eq!(e.code, FailCode::TooLarge);
        let e = f.match_send(3, 1).unwrap_err();
        assert_eq!(e.code, FailCode::NoTag);
        assert!(e.what.contains("[1]"), "{}", e.what);
        let i = f.match_send(1, 0).unwrap();
        assert!(f.record(i, 0, 0, 0, rid(2)));
        let g = f.advance().unwrap();
        assert_eq!((g.seq, g.n, &g.sizes[..3]), (0, 3, &[100u32, 50, 0][..]));
        assert_eq!(f.head(), 1);
        assert!(f.advance().is_none());
    }

    fn group(sizes: &[u32]) -> Group {
        let n = sizes.len() as u8;
        let mut f = SendFifo::new();
        let elems: Vec<Cts> = (0..n).map(|i| cts(i as i32, 1 << 30, n, i)).collect();
        f.load(&elems, 0);
        for (i, &s) in sizes.iter().enumerate() {
            f.record(i, s as usize, 0, 0, rid(i as u8));
        }
        f.advance().unwrap()
    }

    #[test]
    fn plans_end_each_lane_with_one_signaled_immediate() {
        let mut out = [PlannedWr { kind: WrKind::Empty, imm: None }; MAX_LANE_WRS];
        // single receive, one lane: the data write carries the size
        let n = plan_lane(&group(&[4096]), 0, 1, None, &mut out);
        assert_eq!(n, 1);
        assert_eq!(out[0], PlannedWr { kind: WrKind::Data { elem: 0, off: 0, len: 4096 }, imm: Some(4096) });
        // a single message too large for the immediate: sizes slot
        let n = plan_lane(&group(&[IMM_MAX_SIZE + 1]), 0, 1, None, &mut out);
        assert_eq!(n, 2);
        assert_eq!(out[1], PlannedWr { kind: WrKind::Sizes, imm: Some(Imm::new(0, ImmKind::Sizes(1)).encode()) });
        // zero bytes: one empty write with size 0
        let n = plan_lane(&group(&[0]), 0, 1, None, &mut out);
        assert_eq!(&out[..n], &[PlannedWr { kind: WrKind::Empty, imm: Some(0) }]);
        // an element filled eagerly carries no data and the sizes slot marks it
        let mut f = SendFifo::new();
        f.load(&[cts(1, 100, 2, 0), cts(2, 100, 2, 1)], 0b01);
        assert_eq!(f.match_send(1, 1).unwrap_err().code, FailCode::NoTag);
        assert!(f.record(1, 30, 0, 0, rid(1)));
        let g = f.advance().unwrap();
        assert_eq!(&g.wire_sizes()[..2], &[EAGER_SIZE, 30]);
        let n = plan_lane(&g, 0, 1, None, &mut out);
        assert_eq!(n, 2);
        assert_eq!(out[0].kind, WrKind::Data { elem: 1, off: 0, len: 30 });
        assert_eq!(out[1], PlannedWr { kind: WrKind::Sizes, imm: Some(Imm::new(0, ImmKind::Sizes(2)).encode()) });
        // grouped: data writes then the sizes write with the group immediate
        let n = plan_lane(&group(&[10, 0, 20]), 0, 1, None, &mut out);
        assert_eq!(n, 3);
        assert_eq!(out[2], PlannedWr { kind: WrKind::Sizes, imm: Some(Imm::new(0, ImmKind::Sizes(3)).encode()) });
        // split over two lanes: a small message leaves lane 1 with just the immediate
        let n = plan_lane(&group(&[100]), 1, 2, None, &mut out);
        assert_eq!(&out[..n], &[PlannedWr { kind: WrKind::Empty, imm: Some(100) }]);
        let n = plan_lane(&group(&[1000]), 1, 2, None, &mut out);
        assert_eq!(&out[..n], &[PlannedWr { kind: WrKind::Data { elem: 0, off: 512, len: 488 }, imm: Some(1000) }]);
        let n = plan_lane(&group(&[1000, 1000]), 1, 2, None, &mut out);
        assert_eq!(n, 3);
        assert_eq!(out[2].kind, WrKind::Empty);
        // failure: one empty write with the fail code
        let n = plan_lane(&group(&[1]), 0, 1, Some(FailCode::TooLarge), &mut out);
        assert_eq!(&out[..n], &[PlannedWr { kind: WrKind::Empty, imm: Some(Imm::new(0, ImmKind::Fail(FailCode::TooLarge)).encode()) }]);
        // every plan: exactly one immediate, last
        for sizes in [&[1u32][..], &[0, 0], &[5, 6, 7, 8, 9, 10, 11, 12]] {
            for nl in 1..=3 {
                for l in 0..nl {
                    let k = plan_lane(&group(sizes), l, nl, None, &mut out);
                    assert!(k <= MAX_LANE_WRS);
                    assert!(out[..k - 1].iter().all(|w| w.imm.is_none()) && out[k - 1].imm.is_some());
                }
            }
        }
    }

    #[test]
    fn sq_budget_signals_and_bounds() {
        let mut b = SqBudget::new(64, 16);
        let mut signaled = vec![];
        for _ in 0..32 {
            assert!(b.has_room());
            if let Some(c) = b.post() {
                signaled.push(c);
            }
        }
        assert_eq!(signaled, vec![16, 32]);
        assert_eq!(b.outstanding(), 32);
        // a full queue forces signals every time past half depth
        assert_eq!(b.post(), Some(33));
        b.retire(16);
        assert_eq!(b.outstanding(), 17);
        b.retire(10); // older completion: no effect
        assert_eq!(b.outstanding(), 17);
        b.retire(33);
        assert_eq!(b.outstanding(), 0);
        let mut b = SqBudget::new(4, 2);
        for _ in 0..4 {
            b.post();
        }
        assert!(!b.has_room());
    }
}
