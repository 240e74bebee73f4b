//! What the two ends of a verbs connection tell each other over the
//! out-of-band TCP socket (after the TCP [`Hello`](crate::wire::Hello)):
//! one fixed-size [`Meta`] each way, then a [`READY`] word from the sender
//! once its QPs are in RTS. Little endian, explicit offsets.
//!
//! ```text
//!   0 magic   u64  "RNIBMETA"
//!   8 version u16  PROTO_VERSION
//!  10 nqps    u16  QPs in the connection (1..=MAX_QPS)
//!  12 mtu     u8   active MTU (ibv_mtu: 1=256 .. 5=4096)
//!  13 link    u8   1 = InfiniBand, 2 = Ethernet (RoCE), 3 = iWARP (LINK_IWARP)
//!  14 port    u8
//!  15 gid_idx u8   local GID index
//!  16 lid     u16
//!  18 tc      u8   traffic class the sender chose (receiver follows it)
//!  19 sl      u8   service level the sender chose
//!  20 split   u8   1: messages are split across all QPs
//!  21 family  u8   address family of the GID: 4, 6 (RoCE); 0 unknown / InfiniBand
//!  22 rocever u8   RoCE version of the GID: 1, 2; 0 unknown / InfiniBand
//!  23 flags   u8   bit 0 (FLAG_RECOVERY): this end recovers a comm in place after a fabric fault (recover.rs);
//!                  bit 1 (FLAG_LATE_RING): the eager ring may come late (eager.rs);
//!                  bit 2 (FLAG_CM_SECRET): iWARP: this end echoes (sender) or checks (receiver) `secret`,
//!                  and a sender's `gid` is the address its rdma_cm connections come from;
//!                  bit 3 (FLAG_FENCE): iWARP receiver: its QPs answer the sender's delivery fence
//!  24 gid     [u8; 16]
//!  40 addr    u64  sender: its CTS FIFO; receiver: its sizes area
//!  48 rkey    u32
//!  52 secret  u32  iWARP receiver: random; its rdma_cm listener accepts only requests carrying it
//!  56 name    [u8; 32]  device name, for messages
//!  88 qpn     [u32; MAX_QPS]
//! 600 eager   u32  sender: the eager limit it offers; receiver: the one both use (0 = off)
//! 604 ring_rkey u32  receiver: rkey of its eager ring
//! 608 ring    u64  receiver: address of its eager ring (mailbox first)
//! ```
//!
//! On iWARP (`link` 3) QPs are connected by rdma_cm, not by GID and QP
//! number: the receiver's `gid` holds the address of its rdma_cm listener
//! (IPv4 as `::ffff:a.b.c.d`) and `lid` its port; the sender connects one
//! rdma_cm connection per QP there (`transport/ib/notice_path.rs`).
use crate::error::ProtoError;
use crate::handle::PROTO_VERSION;

/// Most QPs per connection (NCCL_IB_QPS_PER_CONNECTION's upper bound).
pub const MAX_QPS: usize = 128;
/// Bytes of [`Meta`] on the wire.
pub const META_LEN: usize = EAGER_OFF + 16;
const EAGER_OFF: usize = 88 + 4 * MAX_QPS;
/// Magic of [`Meta`].
pub const META_MAGIC: u64 = u64::from_le_bytes(*b"RNIBMETA");
/// `link` of an iWARP end (its port reads Ethernet, like RoCE).
pub const LINK_IWARP: u8 = 3;
/// [`Meta::flags`]: this end speaks the recovery messages of
/// [`crate::recover`] after READY (builds before them left the byte 0, and
/// a comm recovers only when both ends set it).
pub const FLAG_RECOVERY: u8 = 1;
/// [`Meta::flags`]: the eager ring may come late ([`crate::eager`]). A
/// sender sets it when it can take a ring announced after connect; a
/// receiver answers with it (and no ring) when it will announce its ring
/// later. Builds before it leave the bit 0 and ignore it.
pub const FLAG_LATE_RING: u8 = 2;
/// [`Meta::flags`]: iWARP connection requests carry the receiver's random
/// [`Meta::secret`] (a sender echoes it, a receiver refuses requests without
/// it), and a sender's `gid` names the address its rdma_cm connections come
/// from (the receiver refuses others). Builds before it leave the bit 0: a
/// receiver then checks what those builds sent, as they did.
pub const FLAG_CM_SECRET: u8 = 4;
/// [`Meta::flags`], an iWARP receiver's: its QPs answer RDMA READs of its
/// sizes area (`addr`, `rkey`), the sender's delivery fence, which makes a
/// send complete only once the receiver has it. A sender fences only when
/// the receiver sets it: builds before it leave the bit 0, and their QPs
/// would refuse the read (the comm would fail at its first message).
pub const FLAG_FENCE: u8 = 8;
/// The sender's "my QPs are in RTS" word.
pub const READY: [u8; 8] = *b"RNREADY1";

/// One end's connection data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// QP numbers.
    pub qpns: Vec<u32>,
    /// Active MTU (ibv_mtu enum).
    pub mtu: u8,
    /// Link layer (1 IB, 2 Ethernet).
    pub link: u8,
    /// Port.
    pub port: u8,
    /// GID index.
    pub gid_index: u8,
    /// LID.
    pub lid: u16,
    /// Traffic class.
    pub tc: u8,
    /// Service level.
    pub sl: u8,
    /// Split messages across QPs.
    pub split: bool,
    /// GID.
    pub gid: [u8; 16],
    /// Address family of the GID (4, 6; 0 = unknown or InfiniBand).
    pub family: u8,
    /// RoCE version of the GID (1, 2; 0 = unknown or InfiniBand).
    pub roce_version: u8,
    /// FIFO (sender) or sizes area (receiver).
    pub addr: u64,
    /// Its rkey.
    pub rkey: u32,
    /// Device name.
    pub name: String,
    /// Eager limit (offered by the sender, agreed by the receiver; 0 = off).
    pub eager: u32,
    /// Receiver: its eager ring (address, rkey).
    pub ring: (u64, u32),
    /// FLAG_* bits (unknown bits are ignored).
    pub flags: u8,
    /// iWARP receiver with [`FLAG_CM_SECRET`]: what the sender's rdma_cm
    /// requests must carry (random per comm; 0 elsewhere).
    pub secret: u32,
}

impl Meta {
    /// To the wire.
    pub fn encode(&self) -> [u8; META_LEN] {
        assert!(!self.qpns.is_empty() && self.qpns.len() <= MAX_QPS);
        let mut b = [0u8; META_LEN];
        b[0..8].copy_from_slice(&META_MAGIC.to_le_bytes());
        b[8..10].copy_from_slice(&PROTO_VERSION.to_le_bytes());
        b[10..12].copy_from_slice(&(self.qpns.len() as u16).to_le_bytes());
        b[12] = self.mtu;
        b[13] = self.link;
        b[14] = self.port;
        b[15] = self.gid_index;
        b[16..18].copy_from_slice(&self.lid.to_le_bytes());
        b[18] = self.tc;
        b[19] = self.sl;
        b[20] = self.split as u8;
        b[21] = self.family;
        b[22] = self.roce_version;
        b[23] = self.flags;
        b[24..40].copy_from_slice(&self.gid);
        b[40..48].copy_from_slice(&self.addr.to_le_bytes());
        b[48..52].copy_from_slice(&self.rkey.to_le_bytes());
        b[52..56].copy_from_slice(&self.secret.to_le_bytes());
        // at most 31 bytes, cut at a character boundary so the peer decodes
        // exactly this name (a cut inside a character became U+FFFD, and the
        // name changed at every round trip)
        let nb = self.name.as_bytes();
        let mut l = nb.len().min(31);
        while !self.name.is_char_boundary(l) {
            l -= 1;
        }
        b[56..56 + l].copy_from_slice(&nb[..l]);
        for (i, q) in self.qpns.iter().enumerate() {
            b[88 + 4 * i..92 + 4 * i].copy_from_slice(&q.to_le_bytes());
        }
        b[EAGER_OFF..EAGER_OFF + 4].copy_from_slice(&self.eager.to_le_bytes());
        b[EAGER_OFF + 4..EAGER_OFF + 8].copy_from_slice(&self.ring.1.to_le_bytes());
        b[EAGER_OFF + 8..EAGER_OFF + 16].copy_from_slice(&self.ring.0.to_le_bytes());
        b
    }

    /// From the wire; the error says what is wrong.
    pub fn decode(b: &[u8; META_LEN]) -> Result<Meta, ProtoError> {
        let magic = u64::from_le_bytes(b[0..8].try_into().unwrap());
        if magic != META_MAGIC {
            return Err(ProtoError::MetaMagic(magic));
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != PROTO_VERSION {
            return Err(ProtoError::MetaVersion { version, ours: PROTO_VERSION });
        }
        let nqps = u16::from_le_bytes([b[10], b[11]]) as usize;
        if nqps == 0 || nqps > MAX_QPS {
            return Err(ProtoError::MetaQps { n: nqps, max: MAX_QPS });
        }
        if !(1..=5).contains(&b[12]) {
            return Err(ProtoError::MetaMtu(b[12]));
        }
        if !matches!(b[21], 0 | 4 | 6) {
            return Err(ProtoError::MetaFamily(b[21]));
        }
        if b[22] > 2 {
            return Err(ProtoError::MetaRoce(b[22]));
        }
        let name_end = b[56..88].iter().position(|&c| c == 0).unwrap_or(32);
        let eager = u32::from_le_bytes(b[EAGER_OFF..EAGER_OFF + 4].try_into().unwrap());
        if eager as usize > crate::eager::MAX_EAGER {
            return Err(ProtoError::MetaEager(eager));
        }
        Ok(Meta {
            qpns: (0..nqps).map(|i| u32::from_le_bytes(b[88 + 4 * i..92 + 4 * i].try_into().unwrap())).collect(),
            mtu: b[12],
            link: b[13],
            port: b[14],
            gid_index: b[15],
            lid: u16::from_le_bytes([b[16], b[17]]),
            tc: b[18],
            sl: b[19],
            split: b[20] != 0,
            gid: b[24..40].try_into().unwrap(),
            family: b[21],
            roce_version: b[22],
            addr: u64::from_le_bytes(b[40..48].try_into().unwrap()),
            rkey: u32::from_le_bytes(b[48..52].try_into().unwrap()),
            name: String::from_utf8_lossy(&b[56..56 + name_end]).into_owned(),
            eager,
            ring: (
                u64::from_le_bytes(b[EAGER_OFF + 8..EAGER_OFF + 16].try_into().unwrap()),
                u32::from_le_bytes(b[EAGER_OFF + 4..EAGER_OFF + 8].try_into().unwrap()),
            ),
            flags: b[23],
            secret: u32::from_le_bytes(b[52..56].try_into().unwrap()),
        })
    }
}

/// MTU code (ibv_mtu) to bytes.
pub fn mtu_bytes(code: u8) -> u32 {
    128u32 << code.clamp(1, 5)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Meta {
        Meta {
            qpns: vec![0x11, 0x22],
            mtu: 3,
            link: 2,
            port: 1,
            gid_index: 1,
            lid: 0,
            tc: 184,
            sl: 3,
            split: true,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 199, 0, 1],
            family: 4,
            roce_version: 2,
            addr: 0xdead_beef_0000,
            rkey: 0x1234,
            name: "rxe0".into(),
            eager: 8192,
            ring: (0x7000_1000, 0x55),
            flags: FLAG_RECOVERY | FLAG_LATE_RING | FLAG_CM_SECRET,
            secret: 0x9e37_79b9,
        }
    }

    #[test]
    fn roundtrip() {
        let m = sample();
        assert_eq!(Meta::decode(&m.encode()).unwrap(), m);
        let b = m.encode();
        assert_eq!(
            (b[21], b[22], b[23]),
            (4, 2, FLAG_RECOVERY | FLAG_LATE_RING | FLAG_CM_SECRET),
            "family, RoCE version and flags at their offsets"
        );
        assert_eq!(b[52..56], 0x9e37_79b9u32.to_le_bytes(), "the iWARP secret in the word that was padding");
        // a build before the secret sent zeros there and no flag: read as no secret
        let mut pre = b;
        pre[23] &= !FLAG_CM_SECRET;
        pre[52..56].fill(0);
        let d = Meta::decode(&pre).unwrap();
        assert_eq!((d.flags & FLAG_CM_SECRET, d.secret), (0, 0));
        // a build before the late ring left its bit 0: the flag is not read as set
        let mut old = b;
        old[23] &= !FLAG_LATE_RING;
        assert_eq!(Meta::decode(&old).unwrap().flags & FLAG_LATE_RING, 0);
        assert_eq!(mtu_bytes(3), 1024);
        assert_eq!(mtu_bytes(5), 4096);
    }

    #[test]
    fn long_names_are_cut_at_a_character_boundary() {
        // found by the ib_meta fuzz target: 30 ASCII bytes then a 2-byte character
        let m = Meta { name: format!("{}\u{e9}x", "a".repeat(30)), ..sample() };
        let m2 = Meta::decode(&m.encode()).unwrap();
        assert_eq!(m2.name, "a".repeat(30));
        assert_eq!(m2.encode(), m.encode(), "a second round trip is stable");
        let m = Meta { name: "\u{fffd}".repeat(20), ..sample() };
        assert_eq!(Meta::decode(&m.encode()).unwrap().name, "\u{fffd}".repeat(10));
    }

    #[test]
    fn rejects_garbage_with_reason() {
        let mut b = sample().encode();
        b[0] = 0;
        assert_eq!(Meta::decode(&b), Err(ProtoError::MetaMagic(META_MAGIC & !0xff)));
        let mut b = sample().encode();
        b[8] = 99;
        let e = Meta::decode(&b).unwrap_err();
        assert_eq!(e, ProtoError::MetaVersion { version: 99 | (PROTO_VERSION & 0xff00), ours: PROTO_VERSION });
        assert!(e.to_string().starts_with("peer speaks librustnet protocol 99, we speak"));
        let mut b = sample().encode();
        b[10] = 0;
        b[11] = 0;
        assert_eq!(Meta::decode(&b), Err(ProtoError::MetaQps { n: 0, max: MAX_QPS }));
        let mut b = sample().encode();
        b[12] = 9;
        assert_eq!(Meta::decode(&b), Err(ProtoError::MetaMtu(9)));
        let mut b = sample().encode();
        b[21] = 5;
        assert_eq!(Meta::decode(&b), Err(ProtoError::MetaFamily(5)));
        let mut b = sample().encode();
        b[22] = 3;
        assert_eq!(Meta::decode(&b).unwrap_err().to_string(), "peer announces RoCE version 3");
    }
}
