//! Completion notices for RDMA networks without immediate data (iWARP),
//! sans-IO: the wire format, which QPs carry a notice for a message, how the
//! receiver puts the lanes back together, and the receive-ring rule that
//! keeps a notice from ever arriving at a QP with no receive posted.
//!
//! On IB and RoCE each lane of a message ends with a WRITE_WITH_IMM whose
//! 32-bit immediate ([`super::fifo::Imm`]) names the receive (its FIFO slot)
//! and its size, or says the sizes are in the receiver's sizes slot. iWARP
//! refuses immediates at post time. There each lane ends instead with a
//! small SEND, the *notice*: the same 32-bit word, and on lane 0 of a grouped
//! receive the sizes themselves (so the sizes-slot write disappears too).
//! RC ordering (RFC 5040: a Send's completion at the responder implies that
//! the RDMA Writes before it on the connection are placed) makes the
//! notice's receive completion mean what the immediate's did: the lane's
//! data is in place. The receiver then reads sizes exactly as on IB, through
//! [`super::fifo::sizes_from_imm`]: same exact-size checks, same failure
//! codes, same eager markers, zero-byte messages alike (their lanes carry no
//! data but still their notice).
//!
//! iWARP has no receiver-not-ready retry: a SEND that finds no receive posted
//! ends the connection. Hence [`RecvRing`]: the receiver keeps [`RECV_DEPTH`]
//! receives posted on every QP before its first clear-to-send, reposts each
//! one as soon as its completion is taken, and writes the CTS of a receive
//! only while the receives posted but not yet completed cover every notice
//! that can then be in flight ([`RecvRing::may_advertise`]). A sender sends at
//! most one notice per QP per FIFO slot, and only after reading that slot's
//! CTS ([`plan`]); a CTS for `seq` exists only once `seq - FIFO_DEPTH`
//! completed. So at most `FIFO_DEPTH` notices per QP are ever unconsumed.
//!
//! Wire format of a notice (little endian, at most [`NOTICE_BYTES`], which
//! fits the 80 bytes siw sends inline):
//! ```text
//!   0 word   u32  fifo::Imm::encode (slot, Size / Sizes / Fail)
//!   4 lane   u8   lane index (0 carries the sizes of a Sizes word)
//!   5 lanes  u8   lanes of this message
//!   6 magic  u16  NOTICE_MAGIC
//!   8 sizes  u32 x n   (lane 0 of ImmKind::Sizes(n) only)
//! ```
use crate::error::ProtoError;
use crate::fifo::{Imm, ImmKind, FIFO_DEPTH};
use crate::MAX_RECVS;

/// Receives each QP keeps posted (one per FIFO slot: at most one notice per
/// QP per slot can be in flight).
pub const RECV_DEPTH: usize = FIFO_DEPTH;
// With a receive reposted as each notice is read (the executor's
// `repost`), notices in flight on a QP (at most one per FIFO slot in
// flight) never outnumber the receives posted: the notice gate
// (`may_advertise`) is a second guard for an executor that reposts late
// (scripts/model-mutants.py lists its removal as equivalent for this reason).
const _: () = assert!(RECV_DEPTH >= FIFO_DEPTH);
/// Header bytes of a notice.
pub const HDR_BYTES: usize = 8;
/// Largest notice (header and eight sizes); each posted receive has this much.
pub const NOTICE_BYTES: usize = HDR_BYTES + 4 * MAX_RECVS;
/// Marks our notices (and their version).
pub const NOTICE_MAGIC: u16 = 0x4e31;
/// Most QPs (lanes) one connection has.
pub const MAX_LANES: usize = 16;

/// One notice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notice {
    /// The word an immediate would have carried.
    pub imm: Imm,
    /// Which lane this is.
    pub lane: u8,
    /// How many lanes the message has.
    pub lanes: u8,
    /// Sizes of a grouped receive (lane 0 of `ImmKind::Sizes(n)`; else unused).
    pub sizes: [u32; MAX_RECVS],
}

impl Notice {
    /// Bytes on the wire.
    pub fn len(&self) -> usize {
        match self.imm.kind {
            ImmKind::Sizes(n) if self.lane == 0 => HDR_BYTES + 4 * n as usize,
            _ => HDR_BYTES,
        }
    }

    /// Never empty (the header is always there); for clippy's `len` rule.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// To the wire: the bytes are `out[..self.len()]`.
    pub fn encode(&self) -> ([u8; NOTICE_BYTES], usize) {
        let mut b = [0u8; NOTICE_BYTES];
        b[0..4].copy_from_slice(&self.imm.encode().to_le_bytes());
        b[4] = self.lane;
        b[5] = self.lanes;
        b[6..8].copy_from_slice(&NOTICE_MAGIC.to_le_bytes());
        let n = self.len();
        for (i, s) in self.sizes.iter().enumerate().take((n - HDR_BYTES) / 4) {
            b[HDR_BYTES + 4 * i..HDR_BYTES + 4 * i + 4].copy_from_slice(&s.to_le_bytes());
        }
        (b, n)
    }

    /// From the `len` bytes a receive completion reports.
    pub fn decode(b: &[u8]) -> Result<Notice, ProtoError> {
        if b.len() < HDR_BYTES {
            return Err(ProtoError::NoticeShort { len: b.len(), min: HDR_BYTES });
        }
        let magic = u16::from_le_bytes([b[6], b[7]]);
        if magic != NOTICE_MAGIC {
            return Err(ProtoError::NoticeMagic { magic, ours: NOTICE_MAGIC });
        }
        let imm = Imm::decode(u32::from_le_bytes(b[0..4].try_into().unwrap()))?;
        let (lane, lanes) = (b[4], b[5]);
        if lanes == 0 || lanes as usize > MAX_LANES || lane >= lanes {
            return Err(ProtoError::NoticeLane { lane, lanes });
        }
        let mut n = Notice { imm, lane, lanes, sizes: [0; MAX_RECVS] };
        if b.len() != n.len() {
            return Err(ProtoError::NoticeLength { len: b.len(), kind: format!("{:?}", imm.kind), lane, want: n.len() });
        }
        for (i, s) in n.sizes.iter_mut().enumerate().take((b.len() - HDR_BYTES) / 4) {
            *s = u32::from_le_bytes(b[HDR_BYTES + 4 * i..HDR_BYTES + 4 * i + 4].try_into().unwrap());
        }
        Ok(n)
    }
}

/// The sender's notices for FIFO slot `seq` on lanes `first..first + count`
/// (from [`super::fifo::lanes`]), in posting order: one per lane, each posted
/// on its QP after that lane's data writes; lane 0 carries the sizes.
pub fn plan(seq: u64, first: usize, count: usize, kind: ImmKind, sizes: &[u32]) -> impl Iterator<Item = (usize, Notice)> + '_ {
    let imm = Imm::new(seq, kind);
    (0..count).map(move |lane| {
        let mut s = [0u32; MAX_RECVS];
        if lane == 0 {
            if let ImmKind::Sizes(_) = kind {
                s[..sizes.len()].copy_from_slice(sizes);
            }
        }
        (first + lane, Notice { imm, lane: lane as u8, lanes: count as u8, sizes: s })
    })
}

// ---------------------------------------------------------------- receiver

/// The receives of one QP: which ring slots to (re)post, in order, and the
/// check that every notice that may come has one.
///
/// Work request ids are the running count of receives posted on the QP;
/// slot `id % RECV_DEPTH` of the QP's notice area (NOTICE_BYTES each) is
/// the buffer. RC completes receives in posting order, so the next
/// completion must carry the next id.
#[derive(Debug, Clone, Default)]
pub struct RecvRing {
    posted: u64,
    taken: u64,
}

impl RecvRing {
    /// Nothing posted yet.
    pub fn new() -> RecvRing {
        RecvRing::default()
    }

    /// Ids to post now (all of them before the first CTS; afterwards the one
    /// just taken): each names its slot, [`RecvRing::slot`].
    pub fn to_post(&self) -> std::ops::Range<u64> {
        self.posted..self.taken + RECV_DEPTH as u64
    }

    /// Record that the ids of [`RecvRing::to_post`] up to `end` are posted.
    pub fn posted(&mut self, end: u64) {
        debug_assert!(end >= self.posted && end <= self.taken + RECV_DEPTH as u64);
        self.posted = end;
    }

    /// Offset of receive `id`'s buffer in the QP's notice area.
    pub fn slot(id: u64) -> usize {
        (id % RECV_DEPTH as u64) as usize * NOTICE_BYTES
    }

    /// A receive completed with work request id `id`: it must be the oldest
    /// one posted. Returns the offset of its buffer.
    pub fn take(&mut self, id: u64) -> Result<usize, ProtoError> {
        if self.taken == self.posted {
            return Err(ProtoError::NoticeUnposted { id });
        }
        if id != self.taken {
            return Err(ProtoError::NoticeOrder { id, oldest: self.taken });
        }
        self.taken += 1;
        Ok(RecvRing::slot(id))
    }

    /// Receives posted and not yet completed: notices that can land now.
    pub fn outstanding(&self) -> u64 {
        self.posted - self.taken
    }

    /// May the receiver write a CTS after which `in_flight` receives on this
    /// QP (the new one included) can each bring one notice? Only when that
    /// many receives are posted: iWARP has no receiver-not-ready retry.
    pub fn may_advertise(&self, in_flight: usize) -> bool {
        self.outstanding() >= in_flight as u64
    }
}

/// The receiver's assembly of a message's notices across its lanes: the
/// receive of FIFO slot `s` completes when all its lanes' notices are in,
/// with the word and sizes of lane 0.
#[derive(Debug, Clone)]
pub struct Assembler {
    /// Lanes still to come per FIFO slot (0 = no receive expects notices there).
    missing: [u8; FIFO_DEPTH],
    /// Lanes expected per FIFO slot.
    lanes: [u8; FIFO_DEPTH],
    /// Lane 0's notice per FIFO slot, once in.
    first: [Option<Notice>; FIFO_DEPTH],
}

impl Default for Assembler {
    fn default() -> Self {
        Assembler { missing: [0; FIFO_DEPTH], lanes: [0; FIFO_DEPTH], first: [None; FIFO_DEPTH] }
    }
}

impl Assembler {
    /// No receive expects anything.
    pub fn new() -> Assembler {
        Assembler::default()
    }

    /// Receive `seq` is posted (its CTS goes out) and will get `lanes` notices.
    pub fn expect(&mut self, seq: u64, lanes: usize) -> Result<(), ProtoError> {
        let s = (seq % FIFO_DEPTH as u64) as usize;
        if self.missing[s] != 0 {
            return Err(ProtoError::NoticeSlotBusy { seq, slot: s });
        }
        if lanes == 0 || lanes > MAX_LANES {
            return Err(ProtoError::NoticeLanes { seq, lanes, max: MAX_LANES });
        }
        self.missing[s] = lanes as u8;
        self.lanes[s] = lanes as u8;
        self.first[s] = None;
        Ok(())
    }

    /// A notice came in. `Some(notice of lane 0)` once the receive of its
    /// slot has every lane; the caller turns it into sizes with
    /// [`super::fifo::sizes_from_imm`] (`sizes` of the returned notice).
    pub fn on_notice(&mut self, n: Notice) -> Result<Option<Notice>, ProtoError> {
        let s = n.imm.slot as usize;
        if self.missing[s] == 0 {
            return Err(ProtoError::NoticeNoReceive { slot: s });
        }
        if n.lanes != self.lanes[s] {
            return Err(ProtoError::NoticeLaneCount { lanes: n.lanes, slot: s, uses: self.lanes[s] });
        }
        if n.lane == 0 {
            if self.first[s].is_some() {
                return Err(ProtoError::NoticeTwice { slot: s });
            }
            self.first[s] = Some(n);
        } else if let Some(f) = self.first[s] {
            if f.imm != n.imm {
                return Err(ProtoError::NoticeDisagree {
                    lane: n.lane,
                    says: format!("{:?}", n.imm.kind),
                    first: format!("{:?}", f.imm.kind),
                    slot: s,
                });
            }
        }
        self.missing[s] -= 1;
        if self.missing[s] > 0 {
            return Ok(None);
        }
        Ok(Some(self.first[s].take().ok_or(ProtoError::NoticeNoFirst { slot: s })?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fifo::{lanes, sizes_from_imm, FailCode, EAGER_SIZE, IMM_MAX_SIZE};

    #[test]
    fn notices_round_trip_and_fit_inline() {
        for (kind, sizes) in [
            (ImmKind::Size(0), vec![]),
            (ImmKind::Size(IMM_MAX_SIZE), vec![]),
            (ImmKind::Sizes(3), vec![0, 7, 1 << 30]),
            (ImmKind::Sizes(8), vec![1, 2, 3, 4, 5, 6, 7, EAGER_SIZE]),
            (ImmKind::Fail(FailCode::TooLarge), vec![]),
        ] {
            for (qp, n) in plan(45, 1, 3, kind, &sizes) {
                let (b, len) = n.encode();
                assert!(len <= NOTICE_BYTES && NOTICE_BYTES <= 80, "siw sends up to 80 bytes inline");
                let back = Notice::decode(&b[..len]).unwrap();
                assert_eq!(back, n);
                assert_eq!(qp, 1 + n.lane as usize);
                assert_eq!(back.imm.slot as u64, 45 % FIFO_DEPTH as u64);
                if n.lane == 0 {
                    assert_eq!(&back.sizes[..sizes.len()], &sizes[..]);
                } else {
                    assert_eq!(len, HDR_BYTES, "only lane 0 carries sizes");
                }
            }
        }
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let (b, len) = plan(1, 0, 1, ImmKind::Sizes(2), &[1, 2]).next().unwrap().1.encode();
        assert_eq!(Notice::decode(&b[..4]), Err(ProtoError::NoticeShort { len: 4, min: HDR_BYTES }));
        assert_eq!(Notice::decode(&b[..4]).unwrap_err().to_string(), "a 4-byte notice (at least 8 expected)");
        assert!(matches!(Notice::decode(&b[..len - 4]), Err(ProtoError::NoticeLength { lane: 0, .. })));
        let mut bad = b;
        bad[6] ^= 1;
        assert!(matches!(Notice::decode(&bad[..len]), Err(ProtoError::NoticeMagic { .. })));
        let mut bad = b;
        bad[4] = 3; // lane 3 of 1
        assert_eq!(Notice::decode(&bad[..len]), Err(ProtoError::NoticeLane { lane: 3, lanes: 1 }));
    }

    #[test]
    fn ring_posts_depth_then_one_per_completion_in_order() {
        let mut r = RecvRing::new();
        assert!(!r.may_advertise(1), "nothing posted: no CTS may go out");
        assert_eq!(r.to_post(), 0..RECV_DEPTH as u64);
        r.posted(RECV_DEPTH as u64);
        assert!(r.may_advertise(FIFO_DEPTH));
        assert_eq!(r.take(1), Err(ProtoError::NoticeOrder { id: 1, oldest: 0 }));
        assert_eq!(r.take(0).unwrap(), 0);
        assert!(!r.may_advertise(FIFO_DEPTH), "taken but not reposted");
        assert_eq!(r.to_post(), RECV_DEPTH as u64..RECV_DEPTH as u64 + 1);
        r.posted(RECV_DEPTH as u64 + 1);
        assert!(r.may_advertise(FIFO_DEPTH));
        assert_eq!(RecvRing::slot(RECV_DEPTH as u64), 0, "the slot is reused");
        let mut e = RecvRing::new();
        assert_eq!(e.take(0), Err(ProtoError::NoticeUnposted { id: 0 }));
    }

    #[test]
    fn assembler_waits_for_every_lane_and_checks_them() {
        let mut a = Assembler::new();
        a.expect(3, 2).unwrap();
        assert_eq!(a.expect(35, 1), Err(ProtoError::NoticeSlotBusy { seq: 35, slot: 3 }));
        let ns: Vec<Notice> = plan(3, 0, 2, ImmKind::Sizes(2), &[10, 0]).map(|x| x.1).collect();
        // lane 1 may come first (another QP)
        assert_eq!(a.on_notice(ns[1]).unwrap(), None);
        let done = a.on_notice(ns[0]).unwrap().unwrap();
        let sizes = sizes_from_imm(done.imm.kind, &[16, 16], || done.sizes).unwrap();
        assert_eq!(&sizes[..2], &[Some(10), Some(0)]);
        assert_eq!(a.on_notice(ns[0]), Err(ProtoError::NoticeNoReceive { slot: 3 }));
        a.expect(4, 1).unwrap();
        let wrong = plan(4, 0, 2, ImmKind::Size(1), &[]).next().unwrap().1;
        assert_eq!(a.on_notice(wrong), Err(ProtoError::NoticeLaneCount { lanes: 2, slot: 4, uses: 1 }));
    }

    // ------------------------------------------------------------ model

    /// A deterministic xorshift for the model (no rand crate in the core).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// What travels on one QP, in order.
    enum Op {
        /// Data of FIFO slot `seq`, buffer `i`, bytes `off..off + len`.
        Write {
            seq: u64,
            i: usize,
            off: usize,
            data: Vec<u8>,
        },
        Notice(Notice),
    }

    /// A receive the model posted.
    struct Recv {
        seq: u64,
        caps: Vec<usize>,
        bufs: Vec<Vec<u8>>,
    }

    /// Sender, wire and receiver of one connection with `nqps` QPs, driven
    /// in a random order: the receiver posts grouped receives (1..=8
    /// buffers, sizes from 0 up, sometimes a send larger than its buffer),
    /// at most FIFO_DEPTH in flight; the sender matches each slot by tag and
    /// posts per lane its writes then its notice; the wire delivers each QP's
    /// operations in order, QPs interleaved at random. Checked: every notice
    /// finds a posted receive, every receive completes in order with exact
    /// sizes and bytes, or with the failure the sender reported.
    /// Model knobs: `repost` false = the receiver forgets to repost; `notice_first`
    /// true = the sender posts a lane's notice before its writes (both bugs).
    fn model(seed: u64, nqps: usize, split: bool, msgs: u64, repost: bool, notice_first: bool) -> Result<[u64; 3], String> {
        let mut stats = [0u64; 3]; // failures reported, zero-byte buffers, grouped receives
        let mut rng = Rng(seed | 1);
        let mut wire: Vec<std::collections::VecDeque<Op>> = (0..nqps).map(|_| Default::default()).collect();
        let mut rings: Vec<RecvRing> = (0..nqps).map(|_| RecvRing::new()).collect();
        let mut asm = Assembler::new();
        let mut posted: std::collections::VecDeque<Recv> = Default::default();
        let mut cts: std::collections::VecDeque<(u64, Vec<usize>)> = Default::default();
        let (mut next_recv, mut next_send, mut done) = (0u64, 0u64, 0u64);
        let mut completed: std::collections::BTreeMap<u64, Result<Vec<Option<usize>>, ProtoError>> = Default::default();
        let mut expected: std::collections::BTreeMap<u64, Result<Vec<Vec<u8>>, ()>> = Default::default();
        for r in rings.iter_mut() {
            let ids = r.to_post();
            r.posted(ids.end);
        }
        let mut steps = 0u64;
        while done < msgs {
            steps += 1;
            if steps > 1_000_000 {
                return Err(format!("stuck at {done} of {msgs}"));
            }
            match rng.below(3) {
                // receiver posts a receive (writes its CTS)
                0 if next_recv < msgs && next_recv - done < FIFO_DEPTH as u64 => {
                    let seq = next_recv;
                    let (first, count) = lanes(seq, nqps, split);
                    let in_flight = (next_recv - done) as usize + 1;
                    if let Some(q) = (first..first + count).find(|&q| !rings[q].may_advertise(in_flight)) {
                        return Err(format!("CTS {seq} would leave QP {q} short of receives"));
                    }
                    asm.expect(seq, count).map_err(|e| e.to_string())?;
                    let n = 1 + rng.below(MAX_RECVS as u64) as usize;
                    let caps: Vec<usize> = (0..n).map(|_| [0, 1, 100, 4096, 70_000][rng.below(5) as usize]).collect();
                    posted.push_back(Recv { seq, caps: caps.clone(), bufs: caps.iter().map(|&c| vec![0u8; c]).collect() });
                    cts.push_back((seq, caps));
                    next_recv += 1;
                }
                // sender fills the head slot: its writes and notices per lane
                1 if !cts.is_empty() => {
                    let (seq, caps) = cts.pop_front().unwrap();
                    assert_eq!(seq, next_send);
                    let over = rng.below(20) == 0;
                    let sizes: Vec<usize> = caps.iter().map(|&c| if c == 0 { 0 } else { rng.below(c as u64 + 1) as usize }).collect();
                    let (first, count) = lanes(seq, nqps, split);
                    let kind = if over {
                        ImmKind::Fail(FailCode::TooLarge)
                    } else if caps.len() == 1 {
                        ImmKind::Size(sizes[0] as u32)
                    } else {
                        ImmKind::Sizes(caps.len() as u8)
                    };
                    let data: Vec<Vec<u8>> =
                        sizes.iter().enumerate().map(|(i, &s)| (0..s).map(|k| (k as u64 ^ seq ^ i as u64) as u8).collect()).collect();
                    let s32: Vec<u32> = sizes.iter().map(|&s| s as u32).collect();
                    if notice_first {
                        for (q, n) in plan(seq, first, count, kind, &s32) {
                            wire[q].push_back(Op::Notice(n));
                        }
                    }
                    stats[0] += over as u64;
                    stats[1] += sizes.iter().filter(|&&s| s == 0).count() as u64;
                    stats[2] += (caps.len() > 1) as u64;
                    if !over {
                        for (i, d) in data.iter().enumerate() {
                            for lane in 0..count {
                                let (off, len) = crate::fifo::chunk(d.len(), lane, count);
                                if len > 0 {
                                    wire[first + lane].push_back(Op::Write { seq, i, off, data: d[off..off + len].to_vec() });
                                }
                            }
                        }
                    }
                    if !notice_first {
                        for (q, n) in plan(seq, first, count, kind, &s32) {
                            wire[q].push_back(Op::Notice(n));
                        }
                    }
                    expected.insert(seq, if over { Err(()) } else { Ok(data) });
                    next_send += 1;
                }
                // the wire delivers the next operation of some QP
                _ => {
                    let q = rng.below(nqps as u64) as usize;
                    let Some(op) = wire[q].pop_front() else { continue };
                    match op {
                        Op::Write { seq, i, off, data } => {
                            let r = posted.iter_mut().find(|r| r.seq == seq).ok_or("a write for no receive")?;
                            r.bufs[i][off..off + data.len()].copy_from_slice(&data);
                        }
                        Op::Notice(n) => {
                            // the SEND lands in QP q's oldest posted receive
                            let id = rings[q].posted - rings[q].outstanding();
                            rings[q].take(id).map_err(|e| format!("QP {q}: {e}: the connection would die"))?;
                            if repost {
                                let ids = rings[q].to_post();
                                rings[q].posted(ids.end);
                            }
                            let (b, len) = n.encode();
                            let n = Notice::decode(&b[..len]).map_err(|e| e.to_string())?;
                            if let Some(first) = asm.on_notice(n).map_err(|e| e.to_string())? {
                                let seq = posted.iter().find(|r| r.seq % FIFO_DEPTH as u64 == first.imm.slot as u64).unwrap().seq;
                                let r = posted.iter().find(|r| r.seq == seq).unwrap();
                                let res = sizes_from_imm(first.imm.kind, &r.caps, || first.sizes).map(|s| s[..r.caps.len()].to_vec());
                                completed.insert(seq, res);
                            }
                            // NCCL tests receives in order: complete the head while done
                            while let Some(res) = posted.front().and_then(|r| completed.remove(&r.seq)) {
                                let r = posted.pop_front().unwrap();
                                match (res, expected.remove(&r.seq).unwrap()) {
                                    (Ok(sizes), Ok(data)) => {
                                        for (i, d) in data.iter().enumerate() {
                                            if sizes[i] != Some(d.len()) || r.bufs[i][..d.len()] != d[..] {
                                                return Err(format!("receive {} buffer {i}: wrong size or bytes", r.seq));
                                            }
                                        }
                                    }
                                    (Err(e), Err(())) => assert_eq!(e, ProtoError::SenderTooLarge),
                                    (got, _) => return Err(format!("receive {}: {got:?} where the sender did otherwise", r.seq)),
                                }
                                done += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(done, msgs);
        Ok(stats)
    }

    #[test]
    fn model_every_receive_completes_exactly_and_no_notice_finds_an_empty_ring() {
        for seed in 1..=40u64 {
            for (nqps, split) in [(1, false), (2, false), (4, true), (3, true)] {
                let st = model(seed * 7919, nqps, split, 300, true, false).unwrap_or_else(|e| panic!("seed {seed} nqps {nqps}: {e}"));
                assert!(st[0] > 0 && st[1] > 0 && st[2] > 0, "the traffic must include failures, zero bytes and groups: {st:?}");
            }
        }
    }

    #[test]
    fn model_without_reposting_is_caught_before_a_notice_is_lost() {
        // the same traffic, but the receiver forgets to repost: the ring rule
        // refuses the CTS that would let a notice find no receive
        let e = model(12345, 1, false, 300, false, false).unwrap_err();
        assert!(e.contains("short of receives"), "{e}");
    }

    #[test]
    fn model_notice_before_its_writes_is_caught() {
        // the model's byte checks are live: a notice that overtakes its data
        // completes a receive whose bytes are not there yet
        let e = (1..=10u64).find_map(|s| model(s * 31, 2, true, 300, true, true).err()).expect("some seed must catch it");
        assert!(e.contains("wrong size or bytes"), "{e}");
    }
}
