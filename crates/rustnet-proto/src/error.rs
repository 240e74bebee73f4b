//! Typed protocol errors: every way bytes from a peer (or NCCL's handle) can
//! fail the protocol's rules, one variant each, so callers and tests match on
//! the variant and the message (Display) stays the one the logs always showed.
//! A leaf of the crate: it imports none of the modules that return it (the
//! limits a message names travel in the variant).

/// Why bytes are not our protocol (or break one of its rules).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    // --- the listen handle (handle.rs): NCCL's bytes, so the caller reports an invalid argument
    /// The handle's magic is not ours.
    #[error(
        "connect handle is not a librustnet handle (magic {magic:#018x}): \
         both ranks must load the same plugin (NCCL_NET_PLUGIN) and transport"
    )]
    HandleMagic {
        /// What the handle held.
        magic: u64,
    },
    /// The handle comes from another protocol version.
    #[error(
        "connect handle speaks librustnet protocol {version}, this build speaks {ours}: \
         run the same librustnet version on every node"
    )]
    HandleVersion {
        /// The handle's version.
        version: u16,
        /// Ours (PROTO_VERSION).
        ours: u16,
    },
    /// Transport byte other than TCP (1) or verbs (2).
    #[error("connect handle names unknown transport {0}")]
    HandleTransport(u8),
    /// Address family other than 4 or 6.
    #[error("connect handle has unknown address family {0}")]
    HandleFamily(u8),
    /// Port 0.
    #[error("connect handle has port 0")]
    HandlePortZero,

    // --- the TCP wire (wire.rs)
    /// The listener's answer is not a librustnet reply (its bytes in hex).
    #[error("answered with bytes that are not a librustnet reply ({shown}): another program listens there")]
    ReplyNotOurs {
        /// The bytes, in hex.
        shown: String,
    },
    /// A reply verdict this build does not know.
    #[error("answered with unknown verdict {code} (protocol {version})")]
    ReplyVerdict {
        /// The verdict code.
        code: u16,
        /// The listener's protocol version.
        version: u16,
    },
    /// A data message header with the wrong magic: the stream is out of step.
    #[error("bad message header magic {0:#010x}")]
    HeaderMagic(u32),
    /// An acknowledgement record with the wrong magic: the reverse stream is out of step.
    #[error("bad acknowledgement magic {0:#010x}")]
    AckMagic(u32),
    /// An acknowledgement for a stream the connection does not have.
    #[error("acknowledgement for stream {stream} of a {nstreams}-stream connection")]
    AckStream {
        /// The stream named.
        stream: u16,
        /// Streams of the connection.
        nstreams: usize,
    },
    /// An acknowledgement of bytes never sent.
    #[error("acknowledgement of {offset} bytes on stream {stream}, but only {sent} were sent")]
    AckBeyond {
        /// The stream.
        stream: u16,
        /// Bytes acknowledged.
        offset: u64,
        /// Bytes written on it.
        sent: u64,
    },
    /// A resume offset outside what was acknowledged and what was written.
    #[error("resume from byte {offset} of stream {stream}, outside the {acked} bytes it acknowledged before and the {sent} written")]
    ResumeOffset {
        /// The stream.
        stream: usize,
        /// The receiver's offset.
        offset: u64,
        /// What it had acknowledged.
        acked: u64,
        /// What the sender wrote.
        sent: u64,
    },
    /// A message whose tag no posted buffer waits for.
    #[error("message with tag {tag} arrived but the posted receive waits for tags {want:?}")]
    NoTag {
        /// The message's tag.
        tag: i32,
        /// The tags still waited for.
        want: Vec<i32>,
    },
    /// A message larger than the buffer its tag matched.
    #[error("message of {size} bytes (tag {tag}) is larger than the posted receive buffer of {cap} bytes")]
    TooLarge {
        /// The message's size.
        size: u64,
        /// Its tag.
        tag: i32,
        /// The buffer's capacity.
        cap: u64,
    },

    // --- the verbs set-up record (ib_meta.rs)
    /// The record's magic is not ours.
    #[error("not a librustnet verbs connection message (magic {0:#018x}); is the peer using the TCP transport?")]
    MetaMagic(u64),
    /// The peer speaks another protocol version.
    #[error("peer speaks librustnet protocol {version}, we speak {ours}")]
    MetaVersion {
        /// The peer's version.
        version: u16,
        /// Ours (PROTO_VERSION).
        ours: u16,
    },
    /// QP count outside 1..=MAX_QPS.
    #[error("peer announces {n} QPs (1..={max} accepted)")]
    MetaQps {
        /// QPs announced.
        n: usize,
        /// MAX_QPS.
        max: usize,
    },
    /// MTU code outside 1..=5.
    #[error("peer announces MTU code {0}")]
    MetaMtu(u8),
    /// Address family other than 0, 4, 6.
    #[error("peer announces address family {0}")]
    MetaFamily(u8),
    /// RoCE version above 2.
    #[error("peer announces RoCE version {0}")]
    MetaRoce(u8),
    /// Eager limit above MAX_EAGER.
    #[error("peer announces an eager limit of {0} bytes")]
    MetaEager(u32),

    // --- the verbs FIFO (fifo.rs)
    /// A CTS element whose (i, n) do not fit its place in the slot.
    #[error("CTS element {i} of slot {seq} claims to be buffer {claims_i} of {claims_n}")]
    CtsElement {
        /// The element's place.
        i: usize,
        /// The slot's sequence number.
        seq: u64,
        /// The element's `i` field.
        claims_i: u8,
        /// The element's `n` field.
        claims_n: u8,
    },
    /// An immediate value no librustnet sender produces.
    #[error("immediate {0:#010x} is not a librustnet value")]
    Imm(u32),
    /// The immediate reports more bytes than the single buffer holds.
    #[error("peer wrote {size} bytes into a {cap}-byte receive buffer")]
    ImmOverflow {
        /// Bytes reported.
        size: u32,
        /// The buffer's capacity.
        cap: usize,
    },
    /// The sizes slot reports more bytes than buffer `i` holds.
    #[error("peer reports {size} bytes for buffer {i} of {cap} bytes")]
    SizesOverflow {
        /// Which buffer.
        i: usize,
        /// Bytes reported.
        size: u32,
        /// Its capacity.
        cap: usize,
    },
    /// The sender reported that its message is larger than our buffer.
    #[error("the matching send is larger than the posted receive buffer (sender reported a size mismatch)")]
    SenderTooLarge,
    /// The sender reported a tag this receive did not post.
    #[error("the peer sent a tag this receive did not post (sender reported a tag mismatch)")]
    SenderNoTag,
    /// The sender failed the message for another reason.
    #[error("the sender failed this message")]
    SenderFailed,
    /// A completion kind that does not fit a receive of `n` buffers.
    #[error("completion {kind} does not fit a receive of {n} buffer(s)")]
    ImmMisfit {
        /// What the immediate said (the `ImmKind`, as Debug prints it).
        kind: String,
        /// Buffers in the receive.
        n: usize,
    },

    // --- the verbs eager ring (eager.rs)
    /// The receiver returned more eager credits than were sent.
    #[error("receiver returned {freed} eager slots but only {posted} were sent")]
    EagerCredits {
        /// Credits returned.
        freed: u64,
        /// Messages sent.
        posted: u64,
    },
    /// An eager message with a tag other than the comm's eager tag.
    #[error("eager message #{idx} has tag {tag} but the eager tag is {want:?}")]
    EagerTag {
        /// The message's ring index.
        idx: u64,
        /// Its tag.
        tag: i32,
        /// The eager tag (None before the first one).
        want: Option<i32>,
    },
    /// An eager message over the limit.
    #[error("eager message #{idx} claims {size} bytes (limit {max})")]
    EagerSize {
        /// The message's ring index.
        idx: u64,
        /// Bytes claimed.
        size: u32,
        /// The limit.
        max: usize,
    },
    /// Eager messages out of buffer order.
    #[error("eager message #{idx} for buffer {j} arrived after one for buffer {last}")]
    EagerOrder {
        /// The message's ring index.
        idx: u64,
        /// Its buffer.
        j: u64,
        /// The buffer of the one before.
        last: u64,
    },

    /// A late eager ring's address that names no ring, or another limit.
    #[error("receiver announced an eager ring at {addr:#x} for {max}-byte messages; the limit agreed at connect is {agreed}")]
    EagerRing {
        /// The ring's address.
        addr: u64,
        /// The limit it claims.
        max: u32,
        /// The limit agreed.
        agreed: usize,
    },

    // --- the verbs protocol machines (rx.rs, tx.rs)
    /// A completion word for a FIFO slot where no receive waits.
    #[error("completion {imm} for FIFO slot {slot}, which has no receive waiting for a rendezvous")]
    ImmNoReceive {
        /// The FIFO slot.
        slot: usize,
        /// The decoded word (the `Imm`, as Debug prints it).
        imm: String,
    },
    /// More completion words than the receive has lanes.
    #[error("one completion too many for receive #{seq}")]
    ImmExtra {
        /// The receive's sequence number.
        seq: u64,
    },
    /// A buffer filled both by an eager message and by a rendezvous.
    #[error("buffer {i} of receive #{seq} was written by an eager message and a rendezvous")]
    BothWays {
        /// Which buffer.
        i: usize,
        /// The receive's sequence number.
        seq: u64,
    },
    /// An eager message for a buffer that is not posted (or already filled).
    #[error("eager message #{idx} for buffer {j}, which is not posted")]
    EagerUnposted {
        /// The message's ring index.
        idx: u64,
        /// The buffer it names.
        j: u64,
    },
    /// An eager message for a buffer the rendezvous already filled.
    #[error("eager message #{idx} for buffer {i} of receive #{seq}, which the sender also wrote")]
    EagerTwice {
        /// The message's ring index.
        idx: u64,
        /// Buffer index in the receive.
        i: usize,
        /// The receive's sequence number.
        seq: u64,
    },
    /// An eager message larger than the buffer it names (the sender's
    /// mistake, reported like a rendezvous size mismatch).
    #[error("sent {size} bytes (eager) for a {cap}-byte receive buffer (receive #{seq}, buffer {i})")]
    EagerOverflow {
        /// Bytes sent.
        size: usize,
        /// The buffer's capacity.
        cap: usize,
        /// The receive's sequence number.
        seq: u64,
        /// Buffer index in the receive.
        i: usize,
    },
    /// A CTS slot whose elements disagree on the buffer count.
    #[error("CTS slot {seq} has inconsistent buffer counts")]
    CtsCount {
        /// The slot's sequence number.
        seq: u64,
    },

    // --- recovery messages on the out-of-band socket (recover.rs)
    /// Bytes after READY that are not a recovery message (hex).
    #[error("sent bytes that are not a librustnet recovery message on the out-of-band connection ({shown})")]
    RecoverMagic {
        /// The first bytes, in hex.
        shown: String,
    },
    /// A recovery message of a kind this build does not know.
    #[error("sent a recovery message of unknown kind {kind}")]
    RecoverKind {
        /// Its kind byte.
        kind: u8,
    },
    /// A recovery message whose length does not fit its kind.
    #[error("sent a recovery message of kind {kind} with a {len}-byte body")]
    RecoverLength {
        /// Its kind byte.
        kind: u8,
        /// The length it claims.
        len: usize,
    },
    /// The receiver's restart point waits for a message this sender had
    /// already completed and released: nothing is left to send it again.
    #[error(
        "still waits for message #{seq}, which this end had completed and handed back to NCCL: it cannot be sent again (a send completed before the receiver had it, and the fault lost it: a bug, since every transport completes a send only once the receiver has it; on iWARP that is the delivery fence)"
    )]
    RecoverLost {
        /// The message's sequence number.
        seq: u64,
    },
    /// A recovery message whose fields break the rules.
    #[error("sent a recovery message with {what}")]
    RecoverField {
        /// What is wrong.
        what: &'static str,
    },
    /// A recovery message out of the protocol's order.
    #[error("sent {what} (recovery epoch {epoch})")]
    RecoverOrder {
        /// Its epoch.
        epoch: u32,
        /// What came.
        what: &'static str,
    },

    // --- iWARP completion notices (notice.rs)
    /// Fewer bytes than a notice header.
    #[error("a {len}-byte notice (at least {min} expected)")]
    NoticeShort {
        /// Bytes received.
        len: usize,
        /// The header's size.
        min: usize,
    },
    /// A notice whose magic is not ours.
    #[error("notice magic {magic:#06x} is not librustnet's {ours:#06x}")]
    NoticeMagic {
        /// What the notice held.
        magic: u16,
        /// NOTICE_MAGIC.
        ours: u16,
    },
    /// A lane index or lane count outside the rules.
    #[error("notice for lane {lane} of {lanes}")]
    NoticeLane {
        /// The notice's lane.
        lane: u8,
        /// The lanes it claims.
        lanes: u8,
    },
    /// A notice whose length does not fit its word.
    #[error("a {len}-byte notice for {kind} on lane {lane} ({want} expected)")]
    NoticeLength {
        /// Bytes received.
        len: usize,
        /// What its word said (the `ImmKind`, as Debug prints it).
        kind: String,
        /// Its lane.
        lane: u8,
        /// Bytes that word and lane call for.
        want: usize,
    },
    /// A receive completion on a QP with no receive posted.
    #[error("a notice completion (receive {id}) with no receive posted")]
    NoticeUnposted {
        /// The completion's work request id.
        id: u64,
    },
    /// Receives completing out of posting order.
    #[error("receive {id} completed before receive {oldest} (RC completes in order)")]
    NoticeOrder {
        /// The completion's work request id.
        id: u64,
        /// The oldest receive posted.
        oldest: u64,
    },
    /// A receive on a FIFO slot whose previous receive still waits.
    #[error("receive {seq} reuses FIFO slot {slot} before its previous receive completed")]
    NoticeSlotBusy {
        /// The receive's sequence number.
        seq: u64,
        /// Its FIFO slot.
        slot: usize,
    },
    /// A receive on no lanes or more than MAX_LANES.
    #[error("receive {seq} on {lanes} lanes (1..={max} accepted)")]
    NoticeLanes {
        /// The receive's sequence number.
        seq: u64,
        /// Lanes asked for.
        lanes: usize,
        /// MAX_LANES.
        max: usize,
    },
    /// A notice for a FIFO slot where no receive waits.
    #[error("a notice for FIFO slot {slot}, where no receive waits")]
    NoticeNoReceive {
        /// The FIFO slot.
        slot: usize,
    },
    /// A notice whose lane count differs from its receive's.
    #[error("a notice for {lanes} lanes where the receive of slot {slot} uses {uses}")]
    NoticeLaneCount {
        /// Lanes the notice claims.
        lanes: u8,
        /// The FIFO slot.
        slot: usize,
        /// Lanes the receive uses.
        uses: u8,
    },
    /// Lane 0's notice twice for one receive.
    #[error("two notices for lane 0 of FIFO slot {slot}")]
    NoticeTwice {
        /// The FIFO slot.
        slot: usize,
    },
    /// Lanes of one message whose words differ.
    #[error("lane {lane} says {says}, lane 0 said {first} (FIFO slot {slot})")]
    NoticeDisagree {
        /// The later lane.
        lane: u8,
        /// What it said.
        says: String,
        /// What lane 0 said.
        first: String,
        /// The FIFO slot.
        slot: usize,
    },
    /// Every lane in, lane 0's notice missing.
    #[error("FIFO slot {slot} completed without lane 0's notice")]
    NoticeNoFirst {
        /// The FIFO slot.
        slot: usize,
    },
}

impl ProtoError {
    /// Errors that report the peer's application's mistake (a send that
    /// did not fit the receive it matched), not a broken peer: the caller
    /// reports them as usage errors, like the sender does.
    pub fn is_size_mismatch(&self) -> bool {
        matches!(self, ProtoError::SenderTooLarge | ProtoError::SenderNoTag | ProtoError::SenderFailed | ProtoError::EagerOverflow { .. })
    }

    /// Errors in NCCL's handle bytes (the caller reports an invalid argument,
    /// not a peer's protocol error).
    pub fn is_handle(&self) -> bool {
        matches!(
            self,
            ProtoError::HandleMagic { .. }
                | ProtoError::HandleVersion { .. }
                | ProtoError::HandleTransport(_)
                | ProtoError::HandleFamily(_)
                | ProtoError::HandlePortZero
        )
    }
}
