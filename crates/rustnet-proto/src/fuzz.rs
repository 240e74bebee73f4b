//! Fuzz targets for every decoder that reads bytes a peer (or NCCL) wrote.
//!
//! Each target takes arbitrary bytes, feeds them to the decoder the way the
//! transport does, and asserts what must hold for any input: no panic, no
//! index outside the buffers the transport reads, the invariants a caller
//! relies on after `Ok`, and a stable round trip (`decode(encode(decode(x)))
//! == decode(x)`, and the meaningful bytes of `x` come back at their offsets).
//! The stateful targets (`eager`, `fifo`) drive the receiver's ring and the
//! sender's CTS FIFO from fuzzed peer writes, mirroring the polling code of
//! `transport::ib::p2p`, so a decoded field that would make the transport
//! read or write out of bounds fails the target.
//!
//! Two drivers run them: `tests/fuzz_decoders.rs` (stable, no coverage,
//! mutates the committed corpus in `fuzz/corpus/<target>/` for a bounded
//! time; CI) and the cargo-fuzz crate in `fuzz/` (libFuzzer with coverage,
//! nightly; deeper local runs). See docs/fuzzing.md.
use std::collections::HashMap;

use crate::eager::{self, EagerRx, EagerTx, Header, HDR_BYTES, MAX_EAGER, RING_SLOTS};
use crate::fifo::{self, Cts, FailCode, Imm, ImmKind, PlannedWr, SendFifo, Slot, WrKind, ELEM_BYTES, FIFO_BYTES, FIFO_DEPTH, MAX_LANE_WRS};
use crate::handle::{Handle, HANDLE_SIZE, PROTO_VERSION};
use crate::ib_meta::{Meta, META_LEN};
use crate::pool::ReqId;
use crate::resume::{
    self, Ack, HelloExt, ResumeHello, ResumeReply, SenderQuery, ACK_LEN, HELLO_EXT_LEN, RESUME_HELLO_LEN, RESUME_REPLY_LEN,
};
use crate::wire::{self, Hello, MsgHeader, RecvSpec, Reply, Verdict, HDR_LEN, HELLO_LEN, REPLY_LEN};
use crate::MAX_RECVS;

/// A fuzz target: any bytes in, panics only on a broken property.
pub type Target = fn(&[u8]);

/// Every target by name (the names of the corpus directories and of the
/// cargo-fuzz targets).
pub const TARGETS: &[(&str, Target)] = &[
    ("handle", handle),
    ("hello", hello),
    ("reply", reply),
    ("wire_header", wire_header),
    ("ib_meta", ib_meta),
    ("eager", eager),
    ("fifo", fifo),
    ("recover", recover),
    ("resume", resume_records),
];

/// Reads fixed-size fields from fuzz input; zeros once it runs out, so
/// every input is a valid program.
struct Input<'a> {
    b: &'a [u8],
}

impl<'a> Input<'a> {
    fn left(&self) -> bool {
        !self.b.is_empty()
    }
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut o = [0u8; N];
        let n = self.b.len().min(N);
        o[..n].copy_from_slice(&self.b[..n]);
        self.b = &self.b[n..];
        o
    }
    fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    fn i32(&mut self) -> i32 {
        i32::from_le_bytes(self.bytes())
    }
    /// A tag: mostly from a small set, so matches happen.
    fn tag(&mut self) -> i32 {
        match self.u8() {
            t @ 0..=239 => (t % 3) as i32,
            _ => self.i32(),
        }
    }
}

fn prefix<const N: usize>(data: &[u8]) -> [u8; N] {
    Input { b: data }.bytes()
}

// ------------------------------------------------------------------ handle

/// `Handle::decode`: the 128 bytes NCCL carries from the listener to the connector.
pub fn handle(data: &[u8]) {
    let b: [u8; HANDLE_SIZE] = prefix(data);
    let h = match Handle::decode(&b) {
        Ok(h) => h,
        Err(e) => return assert!(!e.to_string().is_empty()),
    };
    assert_ne!(h.addr.port(), 0);
    let mut e = [0u8; HANDLE_SIZE];
    h.encode(&mut e);
    assert_eq!(Handle::decode(&e).expect("an encoded handle decodes"), h);
    // magic, version, kind, family, port; nonce and stage
    assert_eq!(e[..14], b[..14]);
    assert_eq!(e[40..56], b[40..56]);
    let ip_end = if b[11] == 4 { 20 } else { 36 };
    assert_eq!(e[16..ip_end], b[16..ip_end]);
    let stage = u64::from_le_bytes(prefix(data.get(HANDLE_SIZE..).unwrap_or(&[])));
    let mut s = b;
    Handle::set_stage(&mut s, stage);
    assert_eq!(Handle::decode(&s).expect("set_stage keeps a handle valid"), Handle { stage, ..h });
}

// ------------------------------------------------------------------ TCP hello

/// `Hello::decode`: the first 32 bytes on every accepted TCP socket (both
/// transports' out-of-band connection). Bytes 32..40, when present, are the
/// listener's nonce; otherwise the hello's own nonce is expected (the
/// accepting path).
pub fn hello(data: &[u8]) {
    let b: [u8; HELLO_LEN] = prefix(data);
    let expect = match data.get(HELLO_LEN..HELLO_LEN + 8) {
        Some(n) => u64::from_le_bytes(n.try_into().unwrap()),
        None => u64::from_le_bytes(b[24..32].try_into().unwrap()),
    };
    let h = match Hello::decode(&b, expect) {
        Ok(h) => h,
        Err(r) => {
            // the refusal the listener answers with must reach the connector intact
            assert!(!r.why.is_empty() && r.verdict != Verdict::Accepted, "{r:?}");
            let back = Reply::decode(&Reply { verdict: r.verdict, version: PROTO_VERSION, resume_port: 0, flags: 0 }.encode())
                .expect("our reply decodes");
            return assert_eq!(back.verdict, r.verdict);
        }
    };
    assert_eq!(h.version, PROTO_VERSION);
    assert!(h.nstreams >= 1 && h.nstreams <= 64 && h.stream < h.nstreams, "{h:?}");
    assert_eq!(h.nonce, expect);
    let e = h.encode();
    assert_eq!(e[..14], b[..14]);
    assert_eq!(e[16..], b[16..]);
    assert_eq!(Hello::decode(&e, expect), Ok(h));
}

// ------------------------------------------------------------------ listener's reply

/// `Reply::decode`: the 16 bytes a connector reads back from whatever
/// listens at the handle's address (maybe not librustnet at all).
pub fn reply(data: &[u8]) {
    let b: [u8; REPLY_LEN] = prefix(data);
    let r = match Reply::decode(&b) {
        Ok(r) => r,
        Err(w) => return assert!(!w.to_string().is_empty()),
    };
    assert!(!r.verdict.explain().is_empty());
    let e = r.encode();
    assert_eq!(e[..12], b[..12]);
    assert_eq!(Reply::decode(&e), Ok(r));
}

// ------------------------------------------------------------------ TCP recovery records

/// The records of TCP recovery (`proto::resume`), chosen by the first byte:
/// 0 `HelloExt::decode` (after a TCP stream's hello, from any client of a
/// listen port), 1 `ResumeHello::decode` or, by its magic, `SenderQuery::decode`
/// (any client of a resume port),
/// 2 `ResumeReply::decode` (whatever answers at a resume port), 3
/// `Ack::decode` against fuzzed per-stream byte counts (the receiving peer),
/// then `rewind` over a fuzzed piece and offset. Round trips are stable, a
/// refusal is never "accepted", an acknowledgement never passes what was sent.
pub fn resume_records(data: &[u8]) {
    let mut r = Input { b: data };
    match r.u8() % 4 {
        0 => {
            let b: [u8; HELLO_EXT_LEN] = r.bytes();
            match HelloExt::decode(&b) {
                Ok(e) => {
                    assert!(e.probe.map_or(true, |p| p.port() != 0));
                    assert_eq!(HelloExt::decode(&e.encode()), Ok(e));
                    assert_eq!(e.encode()[..16], b[..16], "the token comes back");
                }
                Err(f) => assert!(!f.why.is_empty() && f.verdict != Verdict::Accepted),
            }
        }
        1 => {
            let b: [u8; RESUME_HELLO_LEN] = r.bytes();
            if SenderQuery::is_query(&b) {
                match SenderQuery::decode(&b) {
                    Ok(q) => {
                        assert_eq!(q.version, PROTO_VERSION);
                        let e = q.encode();
                        assert_eq!((e[..10].to_vec(), &e[16..24], &e[48..]), (b[..10].to_vec(), &b[16..24], &b[48..]));
                        assert_eq!(SenderQuery::decode(&e), Ok(q));
                    }
                    Err(f) => assert!(!f.why.is_empty() && f.verdict != Verdict::Accepted),
                }
                return;
            }
            match ResumeHello::decode(&b) {
                Ok(h) => {
                    assert_eq!(h.version, PROTO_VERSION);
                    assert!(h.nstreams >= 1 && usize::from(h.nstreams) <= wire::MAX_STREAMS && h.stream < h.nstreams && h.epoch > 0);
                    let e = h.encode();
                    assert_eq!(e[..14], b[..14]);
                    assert_eq!(e[16..44], b[16..44]);
                    assert_eq!(e[48..], b[48..]);
                    assert_eq!(ResumeHello::decode(&e), Ok(h));
                }
                Err(f) => assert!(!f.why.is_empty() && f.verdict != Verdict::Accepted),
            }
        }
        2 => {
            let b: [u8; RESUME_REPLY_LEN] = r.bytes();
            match ResumeReply::decode(&b) {
                Ok(x) => {
                    assert!(!x.verdict.explain().is_empty());
                    assert_eq!(ResumeReply::decode(&x.encode()), Ok(x));
                }
                Err(w) => assert!(!w.to_string().is_empty()),
            }
        }
        _ => {
            let b: [u8; ACK_LEN] = r.bytes();
            let n = 1 + r.u8() as usize % wire::MAX_STREAMS;
            let sent: Vec<u64> = (0..n).map(|_| r.u64()).collect();
            if let Ok(a) = Ack::decode(&b, &sent) {
                assert!(usize::from(a.stream) < n && a.offset <= sent[usize::from(a.stream)]);
                assert_eq!(Ack::decode(&a.encode(), &sent), Ok(a));
            }
            let (start, len, at) = (r.u64() >> 1, r.u32() as u64, r.u64() >> 1);
            match resume::rewind(start, start + len, at) {
                resume::Rewind::Held => assert!(start + len <= at),
                resume::Rewind::From(d) => assert!(d < len.max(1) && (d == 0 || start + d == at)),
            }
        }
    }
}

// ------------------------------------------------------------------ TCP message header

/// `MsgHeader::decode` on stream 0, then what the TCP receiver does with
/// it: match it against a posted (grouped) receive (`match_recv`, specs from
/// the input after the header) and cut the payload over the streams
/// (`chunks`). The chunk plan must cover `0..size` exactly once, in at most
/// `nstreams` chunks (stream `j` gets chunk `j`: more would index past the
/// streams).
pub fn wire_header(data: &[u8]) {
    let b: [u8; HDR_LEN] = prefix(data);
    let h = match MsgHeader::decode(&b) {
        Ok(h) => h,
        Err(w) => return assert!(!w.to_string().is_empty()),
    };
    assert_eq!(h.encode(), b);
    let mut r = Input { b: data.get(HDR_LEN..).unwrap_or(&[]) };
    let n = 1 + r.u8() as usize % MAX_RECVS;
    let mut specs = [RecvSpec { cap: 0, tag: 0, matched: false }; MAX_RECVS];
    for s in &mut specs[..n] {
        // capacities as NCCL passes them: an int (v6-v8) or a size_t (v9+)
        let cap = r.u64();
        *s = RecvSpec {
            cap: if cap >> 63 == 0 { cap as usize & 0xffff_ffff } else { cap as usize },
            tag: r.tag(),
            matched: r.u8() & 1 == 1,
        };
    }
    let nstreams = 1 + r.u8() as usize % 64;
    let min_chunk = r.u32() as usize;
    let i = match wire::match_recv(&specs[..n], h.tag, h.size) {
        Ok(i) => i,
        Err(w) => return assert!(!w.to_string().is_empty()),
    };
    assert!(i < n && !specs[i].matched && specs[i].tag == h.tag && h.size <= specs[i].cap as u64);
    check_chunks(h.size as usize, nstreams, min_chunk);
    // the sender cuts whatever size NCCL hands it the same way
    check_chunks(specs[i].cap, nstreams, min_chunk);
}

fn check_chunks(size: usize, nstreams: usize, min_chunk: usize) {
    let mut next = 0usize;
    for (k, (s, off, len)) in wire::chunks(size, nstreams, min_chunk).take(nstreams + 1).enumerate() {
        assert!(s == k && s < nstreams, "size {size} over {nstreams} streams (min chunk {min_chunk}): chunk on stream {s}");
        assert_eq!(off, next, "size {size}: chunk {k} does not continue the previous one");
        assert!(len > 0 && len <= size - off, "size {size}: chunk {k} has length {len} at {off}");
        next = off + len;
    }
    assert_eq!(next, size, "size {size} over {nstreams} streams (min chunk {min_chunk}): the plan covers {next} bytes");
}

// ------------------------------------------------------------------ verbs connection metadata

/// `Meta::decode`: the verbs connection data read from the out-of-band socket.
pub fn ib_meta(data: &[u8]) {
    let b: [u8; META_LEN] = prefix(data);
    let m = match Meta::decode(&b) {
        Ok(m) => m,
        Err(w) => return assert!(!w.to_string().is_empty()),
    };
    assert!(!m.qpns.is_empty() && m.qpns.len() <= crate::ib_meta::MAX_QPS);
    assert!((1..=5).contains(&m.mtu) && m.eager as usize <= MAX_EAGER);
    let e = m.encode();
    let m2 = Meta::decode(&e).expect("an encoded Meta decodes");
    // the name is informative only: cut to 31 bytes, invalid UTF-8 replaced
    assert_eq!(Meta { name: String::new(), ..m2.clone() }, Meta { name: String::new(), ..m.clone() });
    // every field but the name comes back at its offset (split as 0/1, the
    // flags byte as it came: unknown bits are kept, not read; the iWARP
    // secret at 52..56 as it came)
    let mut want = b;
    want[20] = (b[20] != 0) as u8;
    assert_eq!(e[..56], want[..56]);
    let q = 88 + 4 * m.qpns.len();
    assert_eq!(e[88..q], b[88..q]);
    assert_eq!(e[600..], b[600..]);
    assert!(e[q..600].iter().all(|&c| c == 0));
    assert_eq!(m2.encode(), e, "a second round trip is stable");
}

// ------------------------------------------------------------------ recovery messages

/// `RcMsg::decode`: what a peer writes on the out-of-band socket after
/// READY (recovery messages), as it arrives: any prefix is "not yet" or
/// the same error, a message decodes to what encodes back to its bytes,
/// and the restart points it carries keep their own rules.
pub fn recover(data: &[u8]) {
    use crate::recover::{Point, RcMsg, RC_HDR, RC_MAX_PAYLOAD};
    let whole = RcMsg::decode(data);
    let (m, used) = match whole {
        Ok(Some(x)) => x,
        Ok(None) => return assert!(data.len() < RC_HDR + RC_MAX_PAYLOAD),
        Err(w) => return assert!(!w.to_string().is_empty()),
    };
    assert!(used >= RC_HDR && used <= data.len() && used <= RC_HDR + RC_MAX_PAYLOAD);
    for k in [0, 3, RC_HDR - 1, used - 1] {
        if k < used {
            assert_eq!(RcMsg::decode(&data[..k]), Ok(None), "a prefix of {k} bytes of a whole message");
        }
    }
    let mut e = Vec::new();
    m.encode(&mut e);
    assert_eq!(RcMsg::decode(&e), Ok(Some((m.clone(), e.len()))), "an encoded message decodes to itself");
    // the bytes come back but for the header's reserved byte and the address's padding
    assert_eq!(e.len(), used);
    if let RcMsg::State { addr, point, .. } = &m {
        assert!((1..=crate::ib_meta::MAX_QPS).contains(&addr.nqps));
        if let Point::Rx(r) = **point {
            assert!(r.n <= crate::fifo::FIFO_DEPTH && r.cts_written <= r.next_seq && r.credit <= r.eager_next);
            assert!(r.inflight[..r.n].iter().all(|f| f.seq < r.next_seq));
        }
    }
}

// ------------------------------------------------------------------ eager ring (header and trailer)

/// The verbs receiver's eager ring: the peer writes headers, payloads and
/// trailers (well formed or garbage) into the ring memory; the receiver
/// polls it as `transport::ib::p2p` does (marker, header, size limit,
/// trailer, `EagerRx::arrived`, copy into the posted buffer `j`) and posts
/// receives (`assign`, `take_early`). Asserted: every read stays inside the
/// message's ring slot and the ring, a message lands only in a posted
/// buffer it fits, each buffer at most once, and the credit counter never
/// runs ahead of what arrived. Also the sender's side of the credits.
pub fn eager(data: &[u8]) {
    let mut r = Input { b: data };
    let max = match r.u8() % 4 {
        0 => 8,
        1 => 1 + r.u16() as usize % 4096,
        2 => 8192,
        _ => MAX_EAGER,
    };
    let stride = eager::slot_stride(max);
    let mut ring = vec![0u8; eager::ring_bytes(max)];
    let mut rx = EagerRx::new(max);
    let mut tx = EagerTx::new(max);
    // posted buffers of the eager tag: j -> capacity (p2p keeps a window of these)
    let mut posted: HashMap<u64, usize> = HashMap::new();
    let mut seq = 0u64;
    let mut delivered = 0u64;
    let u64at = |ring: &[u8], o: usize| u64::from_le_bytes(ring[o..o + 8].try_into().unwrap());
    // copy ring message idx into buffer j; Err: the comm fails (a protocol error)
    let deliver = |ring: &[u8], rx: &mut EagerRx, posted: &mut HashMap<u64, usize>, idx: u64, j: u64| -> Result<(), ()> {
        let off = eager::slot_offset(idx, max);
        let h = Header::decode(&ring[off..off + HDR_BYTES].try_into().unwrap(), idx).ok_or(())?;
        let cap = posted.remove(&j).ok_or(())?;
        let size = h.size as usize;
        if size > cap || size > max {
            return Err(());
        }
        assert!(off + HDR_BYTES + size <= ring.len() && HDR_BYTES + size <= stride, "payload of #{idx} leaves its slot");
        rx.release(idx);
        Ok(())
    };
    while r.left() {
        match r.u8() % 6 {
            // the peer writes a message for ring index next()+k
            0 => {
                let idx = rx.next() + (r.u8() % 3) as u64;
                let h = Header { j: r.u64() % 64, size: r.u32() % (max as u32 + 2), tag: r.tag(), head: r.u64() };
                let off = eager::slot_offset(idx, max);
                ring[off..off + HDR_BYTES].copy_from_slice(&h.encode(idx));
                let t = off + eager::wire_len(h.size as usize) - 8;
                if t + 8 <= ring.len() && r.u8() & 3 != 0 {
                    ring[t..t + 8].copy_from_slice(&eager::marker(idx).to_le_bytes());
                }
            }
            // the peer writes garbage anywhere in the ring
            1 => {
                let at = r.u32() as usize % ring.len();
                let len = (r.u8() as usize % 40).min(ring.len() - at);
                let junk: [u8; 40] = r.bytes();
                ring[at..at + len].copy_from_slice(&junk[..len]);
            }
            // the receiver polls the ring
            2 => {
                for _ in 0..RING_SLOTS {
                    let idx = rx.next();
                    let off = eager::slot_offset(idx, max);
                    assert!(off + stride <= ring.len(), "slot of #{idx} outside the ring");
                    if u64at(&ring, off + HDR_BYTES - 8) != eager::marker(idx) {
                        break;
                    }
                    let Some(h) = Header::decode(&ring[off..off + HDR_BYTES].try_into().unwrap(), idx) else { break };
                    assert_eq!(Header::decode(&h.encode(idx), idx), Some(h));
                    if h.size as usize > max {
                        return; // protocol error: the comm fails
                    }
                    let t = off + eager::wire_len(h.size as usize) - 8;
                    assert!(t + 8 <= off + stride, "trailer of #{idx} ({} bytes, limit {max}) outside its slot", h.size);
                    if u64at(&ring, t) != eager::marker(idx) {
                        break; // payload still landing
                    }
                    match rx.arrived(&h) {
                        Err(w) => return assert!(!w.to_string().is_empty()),
                        Ok(eager::Arrival::Posted(j)) => {
                            if deliver(&ring, &mut rx, &mut posted, idx, j).is_err() {
                                return;
                            }
                            delivered += 1;
                        }
                        Ok(eager::Arrival::Early) => {}
                    }
                }
            }
            // NCCL posts a (grouped) receive
            3 => {
                let n = 1 + r.u8() as usize % MAX_RECVS;
                let mut tags = [0i32; MAX_RECVS];
                let mut caps = [0usize; MAX_RECVS];
                for k in 0..n {
                    tags[k] = r.tag();
                    caps[k] = r.u16() as usize % (2 * max + 1);
                }
                let mut js = [None; MAX_RECVS];
                rx.assign(seq, &tags[..n], &mut js[..n]);
                seq += 1;
                for (k, j) in js[..n].iter().enumerate() {
                    let Some(j) = *j else { continue };
                    assert!(posted.insert(j, caps[k]).is_none(), "buffer number {j} handed out twice");
                    if let Some(idx) = rx.take_early(j) {
                        assert!(idx < rx.next(), "early message #{idx} not yet arrived");
                        if deliver(&ring, &mut rx, &mut posted, idx, j).is_err() {
                            return;
                        }
                        delivered += 1;
                    }
                }
            }
            // the receiver reports credits
            4 => {
                if let Some(v) = rx.credits_due(r.u8() & 1 == 1) {
                    assert!(v <= rx.next() && v <= delivered, "credits {v} ahead of {delivered} delivered");
                    rx.reported(v);
                }
            }
            // the sender: CTS loads, sends, and a credit word from the peer
            _ => {
                let tags = [r.tag(), r.tag()];
                let k = 1 + (r.u8() & 1) as usize;
                let mask = tx.on_load(r.u8() as u64 % 3, &tags[..k]);
                assert!(mask >> k == 0);
                let (tag, size, freed) = (r.tag(), r.u32() as usize % (2 * max + 1), r.u64() % 80);
                if tx.check_credits(freed).is_ok() && tx.refuse(tag, size, freed).is_none() {
                    let before = tx.posted();
                    let (idx, h) = tx.take(size, r.u64());
                    assert!(idx == before && h.size as usize <= max && tx.posted() - freed <= RING_SLOTS as u64);
                } else {
                    tx.on_rendezvous(tag);
                }
            }
        }
    }
}

// ------------------------------------------------------------------ CTS FIFO element and what follows

/// The verbs sender's CTS FIFO: `Cts::decode` of one element (round trip),
/// then the sender's `load_head` over FIFO memory the peer wrote (as
/// `transport::ib::p2p` reads it), tag matching of fuzzed sends, and the
/// write plan per lane (`plan_lane`: within the matched sizes, each byte of
/// each element written exactly once over the lanes). Then the receiver's
/// side of the completion: `Imm::decode` of the immediate and
/// `sizes_from_imm` over a fuzzed sizes slot.
pub fn fifo(data: &[u8]) {
    let mut r = Input { b: data };
    // one element
    let seq = r.u64() % (3 * FIFO_DEPTH as u64);
    let i = r.u8() as usize % MAX_RECVS;
    let b: [u8; ELEM_BYTES] = r.bytes();
    match Cts::decode(&b, seq, i) {
        Slot::Ready(c) => {
            assert!(c.n >= 1 && c.n as usize <= MAX_RECVS && c.i as usize == i && i < c.n as usize);
            let e = c.encode(seq);
            assert_eq!(e[..22], b[..22]);
            assert_eq!(e[24..], b[24..]);
        }
        Slot::NotYet => assert_ne!(u64::from_le_bytes(b[24..].try_into().unwrap()), fifo::marker(seq)),
        Slot::Bad(w) => assert!(!w.to_string().is_empty()),
    }

    // the sender's FIFO, written by the peer
    let mut mem = vec![0u8; FIFO_BYTES];
    let mut sf = SendFifo::new();
    let nqps = 1 + r.u8() as usize % 4;
    let split = r.u8() & 1 == 1;
    let mut req = 0u32;
    for _ in 0..r.u8() % 4 {
        // the peer writes the head slot's elements (or garbage)
        let head = sf.head();
        let n = 1 + r.u8() as usize % MAX_RECVS;
        for k in 0..n {
            let c = Cts { addr: r.u64(), rkey: r.u32(), cap: r.u32() % 70_000, tag: r.tag(), n: n as u8, i: k as u8 };
            let mut e = c.encode(head);
            match r.u8() % 8 {
                0 => e = r.bytes(),
                1 => e[20] = r.u8(),
                2 => e[21] = r.u8(),
                _ => {}
            }
            let off = fifo::elem_offset(head, k);
            assert!(off + ELEM_BYTES <= mem.len());
            mem[off..off + ELEM_BYTES].copy_from_slice(&e);
        }
        // load_head, as p2p does it
        let mut elems = [Cts::default(); MAX_RECVS];
        let (mut n, mut k) = (1usize, 0usize);
        let mut bad = false;
        while k < n {
            let off = fifo::elem_offset(head, k);
            let eb: [u8; ELEM_BYTES] = mem[off..off + ELEM_BYTES].try_into().unwrap();
            match Cts::decode(&eb, head, k) {
                Slot::Ready(c) => {
                    n = c.n as usize;
                    elems[k] = c;
                }
                Slot::NotYet | Slot::Bad(_) => {
                    bad = true;
                    break;
                }
            }
            k += 1;
        }
        if bad || elems[..n].iter().any(|e| e.n as usize != n) {
            return; // not yet / protocol error
        }
        let eager_mask = r.u8() & ((1u16 << n) - 1) as u8;
        sf.load(&elems[..n], eager_mask);
        // sends until the group is complete or a mismatch fails it
        let mut fail = None;
        while !sf.current().unwrap().complete() {
            let (tag, size) = (r.tag(), r.u32() as usize % 80_000);
            match sf.match_send(tag, size) {
                Ok(m) => {
                    let g = sf.current().unwrap();
                    assert!(m < g.n && !g.is_eager(m) && g.reqs[m].is_none() && g.elems[m].tag == tag && size <= g.elems[m].cap as usize);
                    sf.record(m, size, 0x1000, 7, ReqId { slot: req as u8, gen: (req >> 8) as u8 });
                    req += 1;
                }
                Err(mm) => {
                    assert!(!mm.what.is_empty());
                    if !r.left() || r.u8() & 1 == 0 {
                        fail = Some(mm.code);
                        break;
                    }
                }
            }
        }
        let g = sf.advance().unwrap();
        let (_, nl) = fifo::lanes(g.seq, nqps, split);
        let mut covered = [0usize; MAX_RECVS];
        let mut out = [PlannedWr { kind: WrKind::Empty, imm: None }; MAX_LANE_WRS];
        for lane in 0..nl {
            let k = fifo::plan_lane(&g, lane, nl, fail, &mut out);
            assert!((1..=MAX_LANE_WRS).contains(&k));
            assert!(out[k - 1].imm.is_some(), "a lane's last write carries the immediate");
            for w in &out[..k] {
                if let WrKind::Data { elem, off, len } = w.kind {
                    assert!(elem < g.n && !g.is_eager(elem) && len > 0);
                    assert!(off + len <= g.sizes[elem] as usize && off + len <= g.elems[elem].cap as usize);
                    assert_eq!(off % fifo::CHUNK_ALIGN, 0);
                    covered[elem] += len;
                }
            }
            let imm = Imm::decode(out[k - 1].imm.unwrap()).expect("our own immediate decodes");
            assert_eq!(imm.slot as u64, g.seq % FIFO_DEPTH as u64);
        }
        if fail.is_none() {
            for (e, &bytes) in covered.iter().enumerate().take(g.n) {
                assert_eq!(bytes, if g.is_eager(e) { 0 } else { g.sizes[e] as usize }, "element {e}");
            }
        }
    }

    // the receiver: an immediate and a sizes slot from the peer
    let v = r.u32();
    let n = 1 + r.u8() as usize % MAX_RECVS;
    let mut caps = [0usize; MAX_RECVS];
    for c in &mut caps[..n] {
        *c = r.u32() as usize;
    }
    let sizes: [u8; fifo::SIZES_SLOT_BYTES] = r.bytes();
    let Ok(imm) = Imm::decode(v) else { return };
    let again = Imm::decode(imm.encode()).expect("re-encoded immediate decodes");
    assert_eq!(again.slot, imm.slot);
    match imm.kind {
        ImmKind::Fail(_) => assert!(matches!(again.kind, ImmKind::Fail(_))),
        k => assert_eq!(again.kind, k),
    }
    if let Ok(got) = fifo::sizes_from_imm(imm.kind, &caps[..n], || fifo::decode_sizes(&sizes)) {
        assert!(!matches!(imm.kind, ImmKind::Fail(FailCode::TooLarge | FailCode::NoTag | FailCode::Other)));
        for k in 0..n {
            if let Some(s) = got[k] {
                assert!(s <= caps[k], "buffer {k}: {s} bytes reported for a {}-byte buffer", caps[k]);
            }
        }
        assert!(got[n..].iter().all(Option::is_none));
    }
}
