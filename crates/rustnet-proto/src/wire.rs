//! TCP wire format and the pure rules around it (no I/O here).
//!
//! A TCP connection is `nstreams` sockets. Each socket starts with a 32-byte
//! [`Hello`], which the listener answers with a 16-byte [`Reply`] (accepted,
//! or why not; on the verbs out-of-band socket only a refusal is answered: the
//! receiver's metadata is its acceptance). The connector's `connect` completes
//! only once every stream is accepted, so no send can complete toward a
//! listener that never took the connection. Then stream 0 carries, per message, a 16-byte [`MsgHeader`]
//! followed by chunk 0 of the payload; stream `j` carries chunk `j`. The chunk
//! plan is a pure function of (size, nstreams, min_chunk), so both ends agree
//! without telling each other.

use crate::error::ProtoError;

/// Most streams (sockets) one TCP connection has: the hello refuses more,
/// the knobs are clamped to it, and a comm's poll set is sized by it.
pub const MAX_STREAMS: usize = 64;

/// Hello magic: "RNHELLO1".
pub const HELLO_MAGIC: u64 = u64::from_le_bytes(*b"RNHELLO1");
/// Size of [`Hello`] on the wire.
pub const HELLO_LEN: usize = 32;
/// Size of a TCP stream's hello: the [`Hello`] and the
/// [`HelloExt`](crate::resume::HelloExt) (resume token, the sender's resume port).
pub const TCP_HELLO_LEN: usize = HELLO_LEN + HELLO_EXT_LEN;
/// Size of the [`HelloExt`](crate::resume::HelloExt) after a TCP stream's hello.
pub const HELLO_EXT_LEN: usize = 64;
/// Reply magic: "RNREPLY1".
pub const REPLY_MAGIC: u64 = u64::from_le_bytes(*b"RNREPLY1");
/// Size of [`Reply`] on the wire.
pub const REPLY_LEN: usize = 16;
/// Header magic (per message).
pub const HDR_MAGIC: u32 = 0x524e_4d53; // "RNMS"
/// Size of [`MsgHeader`] on the wire.
pub const HDR_LEN: usize = 16;

/// First bytes on every stream of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version (must equal ours).
    pub version: u16,
    /// This stream's index.
    pub stream: u16,
    /// Streams in the connection.
    pub nstreams: u16,
    /// Random id grouping the streams of one connection.
    pub conn_id: u64,
    /// The listener nonce from the handle.
    pub nonce: u64,
}

/// Why a listener refused a connection (or 0: it took it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Verdict {
    /// The listener took the stream.
    Accepted = 0,
    /// The hello carried another listener's nonce.
    WrongNonce = 1,
    /// The hello speaks another protocol version.
    Version = 2,
    /// The bytes are not a well-formed hello.
    Malformed = 3,
    /// Too many connections without a hello were waiting (RUSTNET_LISTEN_MAX_STRANGERS).
    TooMany = 4,
    /// The hello did not arrive in time (the listener's RUSTNET_SOCKET_TIMEOUT).
    Late = 5,
    /// The stream does not fit the connection it names.
    Inconsistent = 6,
    /// A resume for a connection the receiving process does not have (never
    /// had, not accepted yet, or closed long ago).
    UnknownComm = 7,
    /// A resume whose token is not the connection's.
    BadToken = 8,
    /// A resume attempt older than one already taken.
    Stale = 9,
    /// A resume for a connection whose receive comm failed or was closed
    /// (unlike [`Verdict::UnknownComm`], which may also be one not yet
    /// accepted): the sender fails at once.
    Closed = 10,
}

impl Verdict {
    /// What the connecting side should be told.
    pub fn explain(self) -> &'static str {
        match self {
            Verdict::Accepted => "accepted",
            Verdict::WrongNonce => {
                "the handle's nonce belongs to no listener of that process: a stale handle (the listener it named was closed \
                 and another librustnet listener now has its port)"
            }
            Verdict::Version => "it speaks another librustnet protocol version: run the same librustnet on every node",
            Verdict::Malformed => "our hello was malformed",
            Verdict::TooMany => "too many connections without a hello were waiting at it (RUSTNET_LISTEN_MAX_STRANGERS there)",
            Verdict::Late => "our hello did not arrive within its RUSTNET_SOCKET_TIMEOUT",
            Verdict::Inconsistent => "our stream did not fit the connection it named",
            Verdict::UnknownComm => "that process has no such connection (never accepted, or its receive comm was closed)",
            Verdict::BadToken => "the resume token is not the connection's",
            Verdict::Stale => "a later reconnection attempt was already taken",
            Verdict::Closed => "that process's receive comm for this connection failed or was closed",
        }
    }

    /// The verdict of a wire code.
    pub fn from_code(c: u16) -> Option<Verdict> {
        use Verdict::*;
        [Accepted, WrongNonce, Version, Malformed, TooMany, Late, Inconsistent, UnknownComm, BadToken, Stale, Closed]
            .into_iter()
            .find(|v| *v as u16 == c)
    }
}

/// The listener's answer to a [`Hello`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    /// Accepted or why not.
    pub verdict: Verdict,
    /// The listener's protocol version.
    pub version: u16,
    /// TCP: the port of the receiving process's resume listener (same
    /// address as the listener), where the sender reconnects after a
    /// failure ([`crate::resume`]); 0: that end does not recover.
    pub resume_port: u16,
    /// Bytes 14-15 (0 from builds before 2026-12-04):
    /// [`REPLY_QUEUED_OFFSETS`] and nothing else yet.
    pub flags: u16,
}

/// [`Reply::flags`]: the receiver's resume offsets count the bytes its
/// host's kernel holds unread (on the stream that failed), and it reads
/// those from there before the new stream: its sender may complete a send
/// once the receiving *kernel* acknowledged it ([`crate::resume`]).
pub const REPLY_QUEUED_OFFSETS: u16 = 1;

impl Reply {
    /// Encode.
    pub fn encode(&self) -> [u8; REPLY_LEN] {
        let mut b = [0u8; REPLY_LEN];
        b[0..8].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
        b[8..10].copy_from_slice(&(self.verdict as u16).to_le_bytes());
        b[10..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..14].copy_from_slice(&self.resume_port.to_le_bytes());
        b[14..16].copy_from_slice(&self.flags.to_le_bytes());
        b
    }

    /// Decode; the error says what the bytes were instead.
    pub fn decode(b: &[u8; REPLY_LEN]) -> Result<Reply, ProtoError> {
        let magic = u64::from_le_bytes(b[0..8].try_into().unwrap());
        if magic != REPLY_MAGIC {
            let shown: String = b.iter().map(|c| format!("{c:02x}")).collect();
            return Err(ProtoError::ReplyNotOurs { shown });
        }
        let code = u16::from_le_bytes([b[8], b[9]]);
        let version = u16::from_le_bytes([b[10], b[11]]);
        let verdict = Verdict::from_code(code).ok_or(ProtoError::ReplyVerdict { code, version })?;
        Ok(Reply { verdict, version, resume_port: u16::from_le_bytes([b[12], b[13]]), flags: u16::from_le_bytes([b[14], b[15]]) })
    }
}

/// A hello the listener refuses: why, for the WARN, and the verdict for the reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// What the connector is told.
    pub verdict: Verdict,
    /// What the listener logs.
    pub why: String,
}

impl Hello {
    /// Encode.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10..12].copy_from_slice(&self.stream.to_le_bytes());
        b[12..14].copy_from_slice(&self.nstreams.to_le_bytes());
        b[16..24].copy_from_slice(&self.conn_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.nonce.to_le_bytes());
        b
    }

    /// Decode and check; the error says what was wrong with the bytes.
    pub fn decode(b: &[u8; HELLO_LEN], expect_nonce: u64) -> Result<Hello, Refused> {
        let refuse = |verdict, why| Refused { verdict, why };
        let magic = u64::from_le_bytes(b[0..8].try_into().unwrap());
        if magic != HELLO_MAGIC {
            let shown: String = b[..16].iter().map(|c| format!("{c:02x}")).collect();
            return Err(refuse(Verdict::Malformed, format!("not a librustnet hello (first bytes {shown})")));
        }
        let h = Hello {
            version: u16::from_le_bytes([b[8], b[9]]),
            stream: u16::from_le_bytes([b[10], b[11]]),
            nstreams: u16::from_le_bytes([b[12], b[13]]),
            conn_id: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            nonce: u64::from_le_bytes(b[24..32].try_into().unwrap()),
        };
        if h.version != crate::handle::PROTO_VERSION {
            return Err(refuse(
                Verdict::Version,
                format!(
                    "peer speaks librustnet protocol {}, we speak {}: run the same librustnet on every node",
                    h.version,
                    crate::handle::PROTO_VERSION
                ),
            ));
        }
        if h.nstreams == 0 || usize::from(h.nstreams) > MAX_STREAMS || h.stream >= h.nstreams {
            return Err(refuse(Verdict::Malformed, format!("bad stream numbering {}/{}", h.stream, h.nstreams)));
        }
        if h.nonce != expect_nonce {
            return Err(refuse(Verdict::WrongNonce, format!("handle nonce {:#x} does not belong to this listener", h.nonce)));
        }
        Ok(h)
    }
}

/// Per-message header on stream 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsgHeader {
    /// NCCL tag of the send.
    pub tag: i32,
    /// Payload bytes.
    pub size: u64,
}

impl MsgHeader {
    /// Encode.
    pub fn encode(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..4].copy_from_slice(&HDR_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.tag.to_le_bytes());
        b[8..16].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    /// Decode; an error means the stream is garbage (or out of step).
    pub fn decode(b: &[u8; HDR_LEN]) -> Result<MsgHeader, ProtoError> {
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap());
        if magic != HDR_MAGIC {
            return Err(ProtoError::HeaderMagic(magic));
        }
        Ok(MsgHeader { tag: i32::from_le_bytes(b[4..8].try_into().unwrap()), size: u64::from_le_bytes(b[8..16].try_into().unwrap()) })
    }
}

/// How a payload of `size` bytes is cut over `nstreams` streams: chunk `j`
/// (offset `j * chunk`) goes to stream `j`. Returns the chunk length; the
/// number of chunks is `ceil(size / chunk)` and never exceeds `nstreams`.
pub fn chunk_len(size: usize, nstreams: usize, min_chunk: usize) -> usize {
    if size == 0 {
        return 0;
    }
    let per = size.div_ceil(nstreams.max(1));
    // Round to 4 KiB so chunks start page-aligned in page-aligned buffers
    // (saturating: a size within 4 KiB of usize::MAX is one chunk, not a
    // wrapped 0-byte plan that would spill past the last stream).
    let per = per.div_ceil(4096).saturating_mul(4096);
    per.max(min_chunk.max(1)).min(size)
}

/// The chunk plan as (stream, offset, len) triples.
pub fn chunks(size: usize, nstreams: usize, min_chunk: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let c = chunk_len(size, nstreams, min_chunk);
    let n = if size == 0 { 0 } else { size.div_ceil(c) };
    (0..n).map(move |j| (j, j * c, c.min(size - j * c)))
}

/// One buffer of a posted (grouped) receive, for matching.
#[derive(Debug, Clone, Copy)]
pub struct RecvSpec {
    /// Capacity in bytes.
    pub cap: usize,
    /// Tag it expects.
    pub tag: i32,
    /// Already matched by an earlier message.
    pub matched: bool,
}

/// Pick the buffer of a grouped receive that a message with `tag`/`size`
/// lands in: the first unmatched buffer with that tag. Errors name the cause.
pub fn match_recv(specs: &[RecvSpec], tag: i32, size: u64) -> Result<usize, ProtoError> {
    let i = specs.iter().position(|s| !s.matched && s.tag == tag).ok_or_else(|| {
        let want: Vec<i32> = specs.iter().filter(|s| !s.matched).map(|s| s.tag).collect();
        ProtoError::NoTag { tag, want }
    })?;
    if size > specs[i].cap as u64 {
        return Err(ProtoError::TooLarge { size, tag, cap: specs[i].cap as u64 });
    }
    Ok(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_roundtrip_and_checks() {
        let h = Hello { version: crate::handle::PROTO_VERSION, stream: 1, nstreams: 2, conn_id: 7, nonce: 9 };
        assert_eq!(Hello::decode(&h.encode(), 9).unwrap(), h);
        let e = Hello::decode(&h.encode(), 8).unwrap_err();
        assert!(e.why.contains("nonce") && e.verdict == Verdict::WrongNonce);
        let mut b = h.encode();
        b[0] = b'X';
        assert!(Hello::decode(&b, 9).unwrap_err().why.contains("not a librustnet hello"));
        let bad = Hello { stream: 2, ..h };
        assert_eq!(Hello::decode(&bad.encode(), 9).unwrap_err().verdict, Verdict::Malformed);
        let old = Hello { version: 0, ..h };
        let e = Hello::decode(&old.encode(), 9).unwrap_err();
        assert!(e.why.contains("protocol 0") && e.verdict == Verdict::Version);
    }

    #[test]
    fn reply_roundtrip_and_checks() {
        for v in [
            Verdict::Accepted,
            Verdict::WrongNonce,
            Verdict::Version,
            Verdict::Malformed,
            Verdict::TooMany,
            Verdict::Late,
            Verdict::Inconsistent,
            Verdict::UnknownComm,
            Verdict::BadToken,
            Verdict::Stale,
            Verdict::Closed,
        ] {
            let r = Reply { verdict: v, version: 3, resume_port: 4242, flags: REPLY_QUEUED_OFFSETS };
            assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
            assert!(!v.explain().is_empty());
        }
        let mut b = Reply { verdict: Verdict::Accepted, version: 3, resume_port: 0, flags: 0 }.encode();
        b[8] = 99;
        assert_eq!(Reply::decode(&b), Err(ProtoError::ReplyVerdict { code: 99, version: 3 }));
        let http = *b"HTTP/1.0 200 OK\r";
        assert!(matches!(Reply::decode(&http), Err(ProtoError::ReplyNotOurs { .. })));
    }

    #[test]
    fn header_roundtrip() {
        let m = MsgHeader { tag: -3, size: 1 << 33 };
        assert_eq!(MsgHeader::decode(&m.encode()).unwrap(), m);
        assert!(MsgHeader::decode(&[0u8; HDR_LEN]).is_err());
    }

    #[test]
    fn chunk_plans_cover_exactly_once() {
        for &size in &[0usize, 1, 4095, 4096, 65536, 65537, 1 << 20, (4 << 20) + 3] {
            for ns in 1..=8 {
                for &minc in &[1usize, 4096, 65536] {
                    let mut next = 0;
                    for (k, (s, off, len)) in chunks(size, ns, minc).enumerate() {
                        assert_eq!(s, k);
                        assert!(s < ns, "size {size} ns {ns}: stream {s}");
                        assert_eq!(off, next);
                        assert!(len > 0);
                        next += len;
                    }
                    assert_eq!(next, size);
                }
            }
        }
        // small messages stay on stream 0
        assert_eq!(chunks(1000, 4, 65536).count(), 1);
    }

    #[test]
    fn chunk_plan_of_a_size_near_usize_max_stays_on_the_streams() {
        // found by the wire_header fuzz target: the 4 KiB rounding wrapped to 0
        for size in [usize::MAX, usize::MAX - 7, usize::MAX - 4095] {
            let plan: Vec<_> = chunks(size, 1, 0).take(2).collect();
            assert_eq!(plan, [(0, 0, size)]);
            let plan: Vec<_> = chunks(size, 3, 1).take(4).collect();
            assert!(plan.len() <= 3 && plan.iter().all(|&(s, _, _)| s < 3), "{plan:?}");
            assert_eq!(plan.iter().map(|p| p.2).sum::<usize>(), size);
        }
    }

    #[test]
    fn grouped_matching_by_tag_and_size() {
        let mut specs = [
            RecvSpec { cap: 100, tag: 5, matched: false },
            RecvSpec { cap: 10, tag: 6, matched: false },
            RecvSpec { cap: 100, tag: 5, matched: false },
        ];
        assert_eq!(match_recv(&specs, 6, 10).unwrap(), 1);
        specs[1].matched = true;
        let e = match_recv(&specs, 6, 1).unwrap_err();
        assert_eq!(e, ProtoError::NoTag { tag: 6, want: vec![5, 5] });
        assert_eq!(e.to_string(), "message with tag 6 arrived but the posted receive waits for tags [5, 5]");
        assert_eq!(match_recv(&specs, 5, 0).unwrap(), 0);
        specs[0].matched = true;
        assert_eq!(match_recv(&specs, 5, 101), Err(ProtoError::TooLarge { size: 101, tag: 5, cap: 100 }));
        assert_eq!(match_recv(&specs, 5, 100).unwrap(), 2);
    }
}
