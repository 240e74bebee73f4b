//! Recovering a verbs connection in place after a fabric fault: the restart
//! points both ends exchange, the messages that carry them over the comm's
//! out-of-band socket, and the order of the steps ([`Recovery`]), as a
//! sans-IO machine. What to resend is decided by the protocol machines from
//! the peer's restart point (`tx::Sender::resume`, `rx::Receiver::resume`);
//! the executor (`transport::ib::recover`) only stops and rebuilds QPs and
//! moves these messages.
//!
//! ```text
//!  either end                              the other end
//!   a completion error, a port that came
//!   back with work outstanding, or the
//!   peer's Halt: QPs to the error state
//!   Halt(e)             ---------------->  (joins epoch e: QPs to error)
//!   drain the CQ (what landed is known)     drain the CQ
//!   wait for the port to be ACTIVE          wait for the port
//!   new QPs; State(e: QPs, restart point) <------------------>  State(e)
//!   connect to the peer's new QPs           connect
//!   Go(e)               <---------------->  Go(e)
//!   resume: resend what the peer's point
//!   says it lacks                           resume
//! ```
//!
//! Why it is exact: a receiver's completion word (immediate or notice) is
//! the only proof that a lane landed, and the receiver reports every word
//! it saw (its CQ is drained up to the flush of its receive queue, after
//! which its QP accepts nothing); the sender resends exactly the lanes not
//! reported, the eager messages from the receiver's next ring index on, and
//! the receiver rewrites every CTS from the sender's FIFO head on. A lane
//! word that comes twice is an error ([`crate::ProtoError::ImmExtra`]),
//! never a second completion. Epochs order failures: a fault during
//! recovery starts epoch e+1 on both ends, and everything of epoch e is
//! dropped.
use std::time::{Duration, Instant};

use crate::error::ProtoError;
use crate::fifo::FIFO_DEPTH;
use crate::ib_meta::MAX_QPS;

/// Magic of every recovery message.
pub const RC_MAGIC: u32 = u32::from_le_bytes(*b"RNRC");
/// Header bytes: magic u32, kind u8, 0 u8, payload length u16, epoch u32.
pub const RC_HDR: usize = 12;
/// Largest payload (a receiver's State with every QP and FIFO slot).
pub const RC_MAX_PAYLOAD: usize = ADDR_FIXED + 4 * MAX_QPS + 1 + RX_FIXED + FIFO_DEPTH * INFLIGHT_BYTES;
const ADDR_FIXED: usize = 24;
const RX_FIXED: usize = 33;
const TX_FIXED: usize = 24;
const INFLIGHT_BYTES: usize = 24;

const K_HALT: u8 = 1;
const K_STATE: u8 = 2;
const K_GO: u8 = 3;
const K_GIVE_UP: u8 = 4;

/// The sender's restart point: where its side of the protocol stands once
/// its QPs stopped and its completions were read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TxPoint {
    /// The FIFO head: the sender moved past every CTS slot below it.
    pub fifo_head: u64,
    /// Eager messages posted (the next ring index).
    pub eager_posted: u64,
    /// The last mailbox value written (head + 1; 0: never).
    pub mailbox: u64,
}

/// One receive still waiting for its rendezvous lanes: which lanes'
/// completion words arrived (bit = lane).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InflightRecv {
    /// Its sequence number.
    pub seq: u64,
    /// Lanes whose word arrived.
    pub got: u128,
}

/// The receiver's restart point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxPoint {
    /// CTS slots written (all below this were posted; not all may have landed).
    pub cts_written: u64,
    /// Receives taken (the next sequence number).
    pub next_seq: u64,
    /// Next eager ring index it looks at (every message below was taken).
    pub eager_next: u64,
    /// Its credit counter (ring slots freed).
    pub credit: u64,
    /// Receives waiting for lanes (`inflight[..n]`). A sequence number the
    /// sender posted that is not here was completed.
    pub n: usize,
    /// The receives.
    pub inflight: [InflightRecv; FIFO_DEPTH],
}

impl Default for RxPoint {
    fn default() -> RxPoint {
        RxPoint { cts_written: 0, next_seq: 0, eager_next: 0, credit: 0, n: 0, inflight: [InflightRecv::default(); FIFO_DEPTH] }
    }
}

impl RxPoint {
    /// The lanes of receive `seq` whose words arrived; `None`: the receive
    /// is not waiting any more (completed).
    pub fn got(&self, seq: u64) -> Option<u128> {
        self.inflight[..self.n].iter().find(|r| r.seq == seq).map(|r| r.got)
    }
}

/// Either end's restart point. (Large, but it travels boxed in
/// [`RcMsg::State`] and is copied out once per recovery.)
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// A send comm's.
    Tx(TxPoint),
    /// A receive comm's.
    Rx(RxPoint),
}

/// How to reach one end's new QPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAddr {
    /// QPs (`qpns[..nqps]`).
    pub nqps: usize,
    /// Their numbers.
    pub qpns: [u32; MAX_QPS],
    /// The GID (read fresh: it may have moved with the flap).
    pub gid: [u8; 16],
    /// The GID's index.
    pub gid_index: u8,
    /// LID (InfiniBand).
    pub lid: u16,
    /// Active MTU (ibv_mtu code).
    pub mtu: u8,
}

impl Default for QpAddr {
    fn default() -> QpAddr {
        QpAddr { nqps: 0, qpns: [0; MAX_QPS], gid: [0; 16], gid_index: 0, lid: 0, mtu: 0 }
    }
}

/// What the two ends of a comm tell each other while they recover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RcMsg {
    /// "My QPs stopped (epoch `epoch`): stop yours."
    Halt {
        /// The recovery's epoch.
        epoch: u32,
    },
    /// "My new QPs, and where my side stands."
    State {
        /// The recovery's epoch.
        epoch: u32,
        /// The new QPs.
        addr: Box<QpAddr>,
        /// The restart point.
        point: Box<Point>,
    },
    /// "My new QPs are connected to yours: resume."
    Go {
        /// The recovery's epoch.
        epoch: u32,
    },
    /// "I gave up (my recovery window is spent)."
    GiveUp {
        /// The recovery's epoch.
        epoch: u32,
    },
}

fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

struct Rd<'a> {
    b: &'a [u8],
    at: usize,
}

impl Rd<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], ProtoError> {
        let s = self.b.get(self.at..self.at + n).ok_or(ProtoError::RecoverField { what: "message shorter than its fields" })?;
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, ProtoError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap_or_default()))
    }
    fn u32(&mut self) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn u128(&mut self) -> Result<u128, ProtoError> {
        Ok(u128::from_le_bytes(self.take(16)?.try_into().unwrap_or_default()))
    }
}

impl RcMsg {
    /// The epoch it belongs to.
    pub fn epoch(&self) -> u32 {
        match self {
            RcMsg::Halt { epoch } | RcMsg::State { epoch, .. } | RcMsg::Go { epoch } | RcMsg::GiveUp { epoch } => *epoch,
        }
    }

    /// Its bytes, appended to `out` (a message is at most
    /// `RC_HDR + RC_MAX_PAYLOAD` bytes).
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        let kind = match self {
            RcMsg::Halt { .. } => K_HALT,
            RcMsg::State { .. } => K_STATE,
            RcMsg::Go { .. } => K_GO,
            RcMsg::GiveUp { .. } => K_GIVE_UP,
        };
        out.extend_from_slice(&RC_MAGIC.to_le_bytes());
        out.extend_from_slice(&[kind, 0, 0, 0]);
        out.extend_from_slice(&self.epoch().to_le_bytes());
        if let RcMsg::State { addr, point, .. } = self {
            assert!((1..=MAX_QPS).contains(&addr.nqps));
            out.extend_from_slice(&(addr.nqps as u16).to_le_bytes());
            out.extend_from_slice(&[addr.mtu, addr.gid_index]);
            out.extend_from_slice(&addr.lid.to_le_bytes());
            out.extend_from_slice(&[0, 0]);
            out.extend_from_slice(&addr.gid);
            for q in &addr.qpns[..addr.nqps] {
                out.extend_from_slice(&q.to_le_bytes());
            }
            match **point {
                Point::Tx(t) => {
                    out.push(1);
                    put_u64(out, t.fifo_head);
                    put_u64(out, t.eager_posted);
                    put_u64(out, t.mailbox);
                }
                Point::Rx(r) => {
                    out.push(2);
                    put_u64(out, r.cts_written);
                    put_u64(out, r.next_seq);
                    put_u64(out, r.eager_next);
                    put_u64(out, r.credit);
                    out.push(r.n as u8);
                    for f in &r.inflight[..r.n] {
                        put_u64(out, f.seq);
                        out.extend_from_slice(&f.got.to_le_bytes());
                    }
                }
            }
        }
        let len = (out.len() - start - RC_HDR) as u16;
        out[start + 6..start + 8].copy_from_slice(&len.to_le_bytes());
    }

    /// The first message of `b`, and the bytes it took; `Ok(None)` while
    /// `b` holds only part of it. Any byte that is not our protocol is an
    /// error (nothing but recovery messages follows READY on the socket).
    pub fn decode(b: &[u8]) -> Result<Option<(RcMsg, usize)>, ProtoError> {
        if b.len() < 4 {
            let prefix = b.iter().zip(RC_MAGIC.to_le_bytes()).all(|(a, m)| *a == m);
            return if prefix { Ok(None) } else { Err(magic_err(b)) };
        }
        let magic = u32::from_le_bytes(b[..4].try_into().unwrap_or_default());
        if magic != RC_MAGIC {
            return Err(magic_err(b));
        }
        if b.len() < RC_HDR {
            return Ok(None);
        }
        let kind = b[4];
        let len = u16::from_le_bytes([b[6], b[7]]) as usize;
        let epoch = u32::from_le_bytes(b[8..12].try_into().unwrap_or_default());
        let want = match kind {
            K_HALT | K_GO | K_GIVE_UP => 0..=0,
            K_STATE => (ADDR_FIXED + 4 + 1 + TX_FIXED)..=RC_MAX_PAYLOAD,
            k => return Err(ProtoError::RecoverKind { kind: k }),
        };
        if !want.contains(&len) {
            return Err(ProtoError::RecoverLength { kind, len });
        }
        if b.len() < RC_HDR + len {
            return Ok(None);
        }
        let p = &b[RC_HDR..RC_HDR + len];
        let msg = match kind {
            K_HALT => RcMsg::Halt { epoch },
            K_GO => RcMsg::Go { epoch },
            K_GIVE_UP => RcMsg::GiveUp { epoch },
            _ => {
                let (addr, point) = decode_state(p)?;
                RcMsg::State { epoch, addr: Box::new(addr), point: Box::new(point) }
            }
        };
        Ok(Some((msg, RC_HDR + len)))
    }
}

fn magic_err(b: &[u8]) -> ProtoError {
    let n = b.len().min(16);
    ProtoError::RecoverMagic { shown: b[..n].iter().map(|c| format!("{c:02x}")).collect() }
}

fn decode_state(p: &[u8]) -> Result<(QpAddr, Point), ProtoError> {
    let mut r = Rd { b: p, at: 0 };
    let mut a = QpAddr { nqps: r.u16()? as usize, ..QpAddr::default() };
    if !(1..=MAX_QPS).contains(&a.nqps) {
        return Err(ProtoError::RecoverField { what: "QP count outside 1..=128" });
    }
    a.mtu = r.u8()?;
    a.gid_index = r.u8()?;
    a.lid = r.u16()?;
    r.u16()?;
    a.gid.copy_from_slice(r.take(16)?);
    for q in &mut a.qpns[..a.nqps] {
        *q = r.u32()?;
    }
    let point = match r.u8()? {
        1 => Point::Tx(TxPoint { fifo_head: r.u64()?, eager_posted: r.u64()?, mailbox: r.u64()? }),
        2 => {
            let mut x = RxPoint { cts_written: r.u64()?, next_seq: r.u64()?, eager_next: r.u64()?, credit: r.u64()?, ..RxPoint::default() };
            x.n = r.u8()? as usize;
            if x.n > FIFO_DEPTH {
                return Err(ProtoError::RecoverField { what: "more waiting receives than FIFO slots" });
            }
            if x.cts_written > x.next_seq || x.credit > x.eager_next {
                return Err(ProtoError::RecoverField { what: "a receiver point that contradicts itself" });
            }
            for f in &mut x.inflight[..x.n] {
                f.seq = r.u64()?;
                f.got = r.u128()?;
                if f.seq >= x.next_seq {
                    return Err(ProtoError::RecoverField { what: "a waiting receive the receiver never took" });
                }
            }
            Point::Rx(x)
        }
        _ => return Err(ProtoError::RecoverField { what: "restart point of no known side" }),
    };
    if r.at != p.len() {
        return Err(ProtoError::RecoverField { what: "bytes after the restart point" });
    }
    Ok((a, point))
}

// ---------------------------------------------------------------- the steps

/// Where a comm's recovery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// No recovery: traffic flows.
    Running,
    /// QPs stopped; reading the completions that were already made.
    Draining,
    /// Waiting for the port to be ACTIVE again.
    WaitPort,
    /// The port is up: new QPs to make and our State to send.
    Rebuild,
    /// Our State sent: waiting for the peer's.
    Exchange,
    /// Connected to the peer's new QPs and Go sent: waiting for its Go.
    WaitGo,
    /// Given up: the comm has failed.
    Failed,
}

/// What the executor does next ([`Recovery::step`]). Each action either
/// moves the recovery on (the executor reports it done) or waits for the
/// next call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Do {
    /// Nothing now (come back on the next call).
    Wait,
    /// Move the QPs to the error state (nothing more lands in our memory)
    /// and send this Halt.
    Halt(RcMsg),
    /// Read the CQ through the machine; [`Recovery::drained`] once every
    /// completion the stopped QPs made was read.
    Drain,
    /// Look at the port; [`Recovery::port_active`] once it is ACTIVE.
    QueryPort,
    /// Make new QPs, compute our restart point, send our State of `epoch`;
    /// then [`Recovery::rebuilt`].
    Rebuild {
        /// The epoch the State belongs to.
        epoch: u32,
    },
    /// Connect the new QPs to the peer's ([`Recovery::peer`]), post what a
    /// new QP needs, send Go of `epoch`; then [`Recovery::connected`].
    Connect {
        /// The epoch.
        epoch: u32,
    },
    /// Hand the peer's restart point to the machine (it resends what the
    /// peer lacks); then [`Recovery::resumed`].
    Resume,
    /// Give up: fail the comm with `why`, telling the peer (GiveUp) when `tell`.
    Fail {
        /// Why, for the error.
        why: GiveUpWhy,
        /// Send GiveUp of `epoch` first.
        tell: Option<RcMsg>,
    },
}

/// Why a recovery failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUpWhy {
    /// The recovery window passed.
    Window {
        /// How long it tried (wall time since the episode's first fault).
        waited: Duration,
        /// How much of it the window was charged with (see [`Recovery::observe`]).
        charged: Duration,
        /// The phase it was in.
        phase: Phase,
    },
    /// The peer said it gave up.
    Peer,
}

/// Time a recovering comm spends without NCCL calling it (silences of over
/// [`CALL_GAP`]) is charged to its window at one part in this many
/// ([`Recovery::observe`]); the TCP receiver's wait for a live sender uses
/// the same share.
pub const LATE_RATE: u32 = 10;

/// Calls of a comm NCCL waits on come far closer together than this; a
/// longer silence between [`Recovery::observe`] calls counts as a comm NCCL
/// does not wait on.
pub const CALL_GAP: Duration = Duration::from_secs(1);

/// The recovery steps of one comm (both ends run one).
#[derive(Debug)]
pub struct Recovery {
    epoch: u32,
    phase: Phase,
    since: Option<Instant>,
    window: Duration,
    halt_due: bool,
    peer: Option<(Box<QpAddr>, Box<Point>)>,
    peer_go: bool,
    peer_gave_up: bool,
    done: u64,
    halts: u32,
    /// The window's share of the episode so far, up to `look`.
    charged: Duration,
    /// When the charge was last brought up to date.
    look: Option<Instant>,
    /// Resumed, and no work request has completed on the new QPs yet: the
    /// episode (and its window) goes on until one does.
    unsettled: bool,
    /// `observe` was called in this episode (the executor reports NCCL's
    /// calls; without them all the time counts).
    observed: bool,
}

impl Recovery {
    /// A comm that may recover for up to `window` (RUSTNET_RECOVERY_TIMEOUT)
    /// from the first fault of an episode.
    pub fn new(window: Duration) -> Recovery {
        Recovery {
            epoch: 0,
            phase: Phase::Running,
            since: None,
            window,
            halt_due: false,
            peer: None,
            peer_go: false,
            peer_gave_up: false,
            done: 0,
            halts: 0,
            charged: Duration::ZERO,
            look: None,
            unsettled: false,
            observed: false,
        }
    }

    /// Where it stands.
    #[inline]
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Is traffic stopped (recovering, or failed)?
    #[inline]
    pub fn active(&self) -> bool {
        self.phase != Phase::Running
    }

    /// The peer said it gave up (its GiveUp was read).
    pub fn peer_gave_up(&self) -> bool {
        self.peer_gave_up
    }

    /// The current epoch (0 before the first fault).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Recoveries completed so far.
    pub fn completed(&self) -> u64 {
        self.done
    }

    /// Resumed, and the new QPs have not completed a work request yet
    /// (the executor then reports the first one: [`Recovery::settled`]).
    #[inline]
    pub fn unsettled(&self) -> bool {
        self.unsettled
    }

    /// When the current episode began (its first fault).
    pub fn since(&self) -> Option<Instant> {
        self.since
    }

    /// Times the QPs were stopped in this episode (2+: a fault during recovery).
    pub fn halts(&self) -> u32 {
        self.halts
    }

    /// The peer's State of this epoch: its new QPs and restart point.
    pub fn peer(&self) -> Option<(&QpAddr, &Point)> {
        self.peer.as_ref().map(|(a, p)| (&**a, &**p))
    }

    /// What the window was charged with so far (at `now`).
    pub fn charged(&self, now: Instant) -> Duration {
        let Some(t) = self.look else { return self.charged };
        let dt = now.saturating_duration_since(t);
        if !self.observed {
            return self.charged + dt;
        }
        // NCCL polls a comm it waits on far more often than CALL_GAP: a
        // longer silence is a comm it does not wait on (a tenth while
        // recovering, nothing once resumed)
        let busy = dt.min(CALL_GAP);
        let idle = if self.active() { (dt - busy) / LATE_RATE } else { Duration::ZERO };
        self.charged + busy + idle
    }

    /// NCCL called the comm now (it waits on it: a request pending, or an
    /// `isend` the comm cannot take yet, alike). The window
    /// (RUSTNET_RECOVERY_TIMEOUT) is charged in full from call to call, and
    /// across a silence of over [`CALL_GAP`] at 1/[`LATE_RATE`] while
    /// recovering, and not at all once resumed (an idle comm may stay idle
    /// for hours before its next fault). A comm that never calls `observe`
    /// is charged in full with all the time since its episode's first
    /// fault.
    ///
    /// A reachable peer that sends nothing of the epoch (a late rank) is
    /// not told apart from one whose recovery is stuck: the soft-RoCE VM's
    /// `loss.sh` `cut-rec` showed a peer that looked late and never came.
    pub fn observe(&mut self, now: Instant) {
        if !self.active() && !self.unsettled {
            return;
        }
        self.charged = self.charged(now);
        self.look = Some(now);
        self.observed = true;
    }

    /// A step made without NCCL's call: the executor's keeper moves on a
    /// comm NCCL has not called for a while (a rank away, e.g. writing a
    /// checkpoint). From the episode's first such step its time is charged
    /// as a silence of NCCL's (one [`CALL_GAP`] in full, the rest at
    /// 1/[`LATE_RATE`] while recovering, nothing once resumed), as if
    /// NCCL's last call had been now; an episode NCCL already called in
    /// is unchanged (its silence runs from that call). Without this, an
    /// episode only the keeper moved would be charged in full, its idle
    /// time after the resume included, and the rank's first fault after
    /// it came back would find the window spent.
    pub fn unattended(&mut self, now: Instant) {
        if (!self.active() && !self.unsettled) || self.observed {
            return;
        }
        self.charged = self.charged(now);
        self.look = Some(now);
        self.observed = true;
    }

    fn restart(&mut self, now: Instant, epoch: u32) {
        if self.since.is_some() {
            // the episode goes on: the time up to now is charged as the
            // phase it passed in had it (an idle stretch after a resume is
            // not charged; once recovering it would count a tenth)
            self.charged = self.charged(now);
        } else {
            // a new episode: charged in full from its first fault until NCCL's calls say otherwise
            self.charged = Duration::ZERO;
            self.observed = false;
        }
        self.look = Some(now);
        self.epoch = epoch;
        self.phase = Phase::Draining;
        self.unsettled = false;
        self.since.get_or_insert(now);
        self.halt_due = true;
        self.peer = None;
        self.peer_go = false;
        self.halts += 1;
    }

    /// A local fault: a completion error, a port that came back while work
    /// was outstanding, an injected QP error. Ignored while the QPs are
    /// stopped already (it is one of the stop's echoes); on the new QPs
    /// (Exchange, WaitGo) or in traffic it starts the next epoch.
    pub fn fault(&mut self, now: Instant) {
        match self.phase {
            Phase::Running | Phase::Exchange | Phase::WaitGo => self.restart(now, self.epoch + 1),
            Phase::Draining | Phase::WaitPort | Phase::Rebuild | Phase::Failed => {}
        }
    }

    /// A message from the peer. `Err`: it breaks the recovery protocol
    /// (the comm fails with it).
    pub fn on_msg(&mut self, now: Instant, m: RcMsg) -> Result<(), ProtoError> {
        let e = m.epoch();
        if self.phase == Phase::Failed {
            return Ok(());
        }
        match m {
            // the peer stopped: join its epoch (ours crossed it if equal)
            RcMsg::Halt { .. } if e > self.epoch => self.restart(now, e),
            RcMsg::Halt { .. } => {}
            RcMsg::State { addr, point, .. } if e == self.epoch && self.active() => {
                if self.peer.is_some() {
                    return Err(ProtoError::RecoverOrder { epoch: e, what: "a second State" });
                }
                self.peer = Some((addr, point));
            }
            RcMsg::Go { .. } if e == self.epoch && self.active() => {
                if self.peer.is_none() {
                    return Err(ProtoError::RecoverOrder { epoch: e, what: "a Go before its State" });
                }
                self.peer_go = true;
            }
            RcMsg::State { .. } | RcMsg::Go { .. } if e > self.epoch => {
                return Err(ProtoError::RecoverOrder { epoch: e, what: "a State or Go before its Halt" });
            }
            // of an epoch given up for a newer one
            RcMsg::State { .. } | RcMsg::Go { .. } => {}
            RcMsg::GiveUp { .. } => self.peer_gave_up = true,
        }
        Ok(())
    }

    /// What to do now. Call again after each action is reported done,
    /// until it says [`Do::Wait`].
    pub fn step(&mut self, now: Instant) -> Do {
        if self.phase == Phase::Failed {
            return Do::Wait;
        }
        if self.peer_gave_up {
            self.phase = Phase::Failed;
            return Do::Fail { why: GiveUpWhy::Peer, tell: None };
        }
        if let Some(t0) = self.since.filter(|_| self.active()) {
            let charged = self.charged(now);
            if charged >= self.window {
                let (phase, waited) = (self.phase, now.saturating_duration_since(t0));
                self.phase = Phase::Failed;
                return Do::Fail { why: GiveUpWhy::Window { waited, charged, phase }, tell: Some(RcMsg::GiveUp { epoch: self.epoch }) };
            }
        }
        if self.halt_due {
            self.halt_due = false;
            return Do::Halt(RcMsg::Halt { epoch: self.epoch });
        }
        match self.phase {
            Phase::Running | Phase::Failed => Do::Wait,
            Phase::Draining => Do::Drain,
            Phase::WaitPort => Do::QueryPort,
            Phase::Rebuild => Do::Rebuild { epoch: self.epoch },
            Phase::Exchange if self.peer.is_some() => Do::Connect { epoch: self.epoch },
            Phase::WaitGo if self.peer_go => Do::Resume,
            Phase::Exchange | Phase::WaitGo => Do::Wait,
        }
    }

    /// Every completion the stopped QPs made was read.
    pub fn drained(&mut self) {
        if self.phase == Phase::Draining && !self.halt_due {
            self.phase = Phase::WaitPort;
        }
    }

    /// The port is ACTIVE.
    pub fn port_active(&mut self) {
        if self.phase == Phase::WaitPort {
            self.phase = Phase::Rebuild;
        }
    }

    /// New QPs made, our State sent.
    pub fn rebuilt(&mut self) {
        if self.phase == Phase::Rebuild {
            self.phase = Phase::Exchange;
        }
    }

    /// Connected to the peer's new QPs, Go sent.
    pub fn connected(&mut self) {
        if self.phase == Phase::Exchange {
            self.phase = Phase::WaitGo;
        }
    }

    /// The machine resumed: traffic may flow again. The episode ends only
    /// once a work request completes on the new QPs ([`Recovery::settled`]):
    /// a fabric that takes the connect but carries nothing (a blackhole
    /// behind an ACTIVE port, the out-of-band network fine) faults again
    /// after the HCA's retry budget, and that fault continues this episode,
    /// so its window ends the loop instead of each recovery opening a new one.
    pub fn resumed(&mut self) {
        if self.phase == Phase::WaitGo {
            self.phase = Phase::Running;
            self.peer = None;
            self.peer_go = false;
            self.done += 1;
            self.unsettled = true;
        }
    }

    /// A work request completed on the new QPs: the episode is over.
    pub fn settled(&mut self) {
        if self.phase == Phase::Running && self.unsettled {
            self.unsettled = false;
            self.since = None;
            self.charged = Duration::ZERO;
            self.look = None;
            self.halts = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(n: usize, base: u32) -> QpAddr {
        let mut a = QpAddr { nqps: n, gid: [7; 16], gid_index: 3, lid: 9, mtu: 3, ..QpAddr::default() };
        for (i, q) in a.qpns[..n].iter_mut().enumerate() {
            *q = base + i as u32;
        }
        a
    }

    fn rx_point() -> RxPoint {
        let mut r = RxPoint { cts_written: 40, next_seq: 41, eager_next: 12, credit: 10, n: 2, ..RxPoint::default() };
        r.inflight[0] = InflightRecv { seq: 38, got: 0b1010 };
        r.inflight[1] = InflightRecv { seq: 40, got: u128::MAX };
        r
    }

    fn round(m: &RcMsg) -> RcMsg {
        let mut b = Vec::new();
        m.encode(&mut b);
        assert!(b.len() <= RC_HDR + RC_MAX_PAYLOAD);
        // every prefix is "not yet", the whole is the message
        for k in 0..b.len() {
            assert_eq!(RcMsg::decode(&b[..k]), Ok(None), "prefix {k} of {m:?}");
        }
        b.extend_from_slice(&[0xaa; 3]);
        let (got, used) = RcMsg::decode(&b).unwrap().unwrap();
        assert_eq!(used, b.len() - 3);
        got
    }

    #[test]
    fn messages_round_trip() {
        for m in [
            RcMsg::Halt { epoch: 7 },
            RcMsg::Go { epoch: 1 },
            RcMsg::GiveUp { epoch: u32::MAX },
            RcMsg::State {
                epoch: 2,
                addr: Box::new(addr(4, 0x100)),
                point: Box::new(Point::Tx(TxPoint { fifo_head: 99, eager_posted: 5, mailbox: 3 })),
            },
            RcMsg::State { epoch: 3, addr: Box::new(addr(MAX_QPS, 1)), point: Box::new(Point::Rx(rx_point())) },
        ] {
            assert_eq!(round(&m), m);
        }
        let mut full = rx_point();
        full.n = FIFO_DEPTH;
        full.next_seq = 100;
        for (i, f) in full.inflight.iter_mut().enumerate() {
            f.seq = 60 + i as u64;
        }
        let m = RcMsg::State { epoch: 1, addr: Box::new(addr(MAX_QPS, 1)), point: Box::new(Point::Rx(full)) };
        let mut b = Vec::new();
        m.encode(&mut b);
        assert_eq!(b.len(), RC_HDR + RC_MAX_PAYLOAD, "the largest message is what RC_MAX_PAYLOAD says");
        assert_eq!(round(&m), m);
        assert_eq!((full.got(60), full.got(61), full.got(62)), (Some(0b1010), Some(u128::MAX), Some(0)));
        assert_eq!(full.got(5), None);
    }

    #[test]
    fn garbage_is_refused_with_the_reason() {
        assert!(matches!(RcMsg::decode(b"GET / HTTP/1.1"), Err(ProtoError::RecoverMagic { .. })));
        assert!(matches!(RcMsg::decode(b"RX"), Err(ProtoError::RecoverMagic { .. })), "a wrong first byte is refused at once");
        assert_eq!(RcMsg::decode(b"RN"), Ok(None));
        let mut b = Vec::new();
        RcMsg::Halt { epoch: 1 }.encode(&mut b);
        b[4] = 9;
        assert_eq!(RcMsg::decode(&b), Err(ProtoError::RecoverKind { kind: 9 }));
        b[4] = K_HALT;
        b[6] = 1;
        assert_eq!(RcMsg::decode(&b), Err(ProtoError::RecoverLength { kind: K_HALT, len: 1 }));
        let mut b = Vec::new();
        RcMsg::State { epoch: 3, addr: Box::new(addr(2, 1)), point: Box::new(Point::Rx(rx_point())) }.encode(&mut b);
        let n_at = RC_HDR + ADDR_FIXED + 8 + 1 + 32;
        b[n_at] = 33;
        assert!(matches!(RcMsg::decode(&b), Err(ProtoError::RecoverField { .. } | ProtoError::RecoverLength { .. })));
        b[n_at] = 2;
        b[RC_HDR] = 0;
        assert!(matches!(RcMsg::decode(&b), Err(ProtoError::RecoverField { .. })), "zero QPs");
    }

    /// Two ends' steps, with the executor's answers scripted: the messages
    /// each sends go to the other in order (one TCP stream each way).
    struct End {
        r: Recovery,
        out: Vec<RcMsg>,
        halted: u32,
        resumed: u32,
        failed: Option<GiveUpWhy>,
        port_up: bool,
    }

    impl End {
        fn new() -> End {
            End { r: Recovery::new(Duration::from_secs(10)), out: Vec::new(), halted: 0, resumed: 0, failed: None, port_up: true }
        }

        fn run(&mut self, now: Instant) {
            for _ in 0..20 {
                match self.r.step(now) {
                    Do::Wait => return,
                    Do::Halt(m) => {
                        self.halted += 1;
                        self.out.push(m);
                    }
                    Do::Drain => self.r.drained(),
                    Do::QueryPort if self.port_up => self.r.port_active(),
                    Do::QueryPort => return,
                    Do::Rebuild { epoch } => {
                        self.out.push(RcMsg::State { epoch, addr: Box::new(addr(1, 5)), point: Box::new(Point::Tx(TxPoint::default())) });
                        self.r.rebuilt();
                    }
                    Do::Connect { epoch } => {
                        self.out.push(RcMsg::Go { epoch });
                        self.r.connected();
                    }
                    Do::Resume => {
                        self.resumed += 1;
                        self.r.resumed();
                    }
                    Do::Fail { why, tell } => {
                        self.out.extend(tell);
                        self.failed = Some(why);
                        return;
                    }
                }
            }
            panic!("steps never settle: {:?}", self.r);
        }
    }

    fn deliver(from: &mut End, to: &mut End, now: Instant) {
        for m in std::mem::take(&mut from.out) {
            to.r.on_msg(now, m).unwrap();
        }
    }

    fn converge(a: &mut End, b: &mut End, now: Instant) {
        for _ in 0..10 {
            a.run(now);
            b.run(now);
            deliver(a, b, now);
            deliver(b, a, now);
        }
    }

    #[test]
    fn one_fault_one_recovery_on_both_ends() {
        let t = Instant::now();
        let (mut a, mut b) = (End::new(), End::new());
        a.r.fault(t);
        a.r.fault(t); // the stop's echoes change nothing
        converge(&mut a, &mut b, t);
        assert_eq!((a.halted, b.halted, a.resumed, b.resumed), (1, 1, 1, 1));
        assert_eq!((a.r.phase(), b.r.phase(), a.r.epoch(), b.r.epoch()), (Phase::Running, Phase::Running, 1, 1));
        assert_eq!(a.r.completed(), 1);
        assert!(a.r.since().is_some() && a.r.unsettled(), "the episode lasts until the new QPs complete something");
        a.r.settled();
        assert_eq!((a.r.since(), a.r.unsettled(), a.r.halts()), (None, false, 0));
    }

    #[test]
    fn faults_on_both_ends_at_once_make_one_epoch() {
        let t = Instant::now();
        let (mut a, mut b) = (End::new(), End::new());
        a.r.fault(t);
        b.r.fault(t);
        converge(&mut a, &mut b, t);
        assert_eq!((a.r.epoch(), b.r.epoch(), a.resumed, b.resumed), (1, 1, 1, 1));
    }

    #[test]
    fn a_fault_during_recovery_starts_the_next_epoch_and_drops_the_old_one() {
        let t = Instant::now();
        let (mut a, mut b) = (End::new(), End::new());
        a.r.fault(t);
        a.run(t);
        deliver(&mut a, &mut b, t);
        b.run(t);
        // b's State of epoch 1 is on its way; a's new QPs fail first
        assert_eq!(a.r.phase(), Phase::Exchange);
        a.r.fault(t);
        assert_eq!((a.r.epoch(), a.r.halts()), (2, 2));
        converge(&mut a, &mut b, t);
        assert_eq!((a.r.epoch(), b.r.epoch(), a.resumed, b.resumed), (2, 2, 1, 1));
        assert_eq!((a.halted, b.halted), (2, 2));
    }

    /// A fabric that takes the new QPs' connect but carries nothing (the
    /// port ACTIVE, the out-of-band network fine): each resume faults again
    /// after the retry budget. The faults continue one episode, and its
    /// window ends the loop; before, each resume opened a fresh window and
    /// the comm recovered forever without moving a byte.
    #[test]
    fn a_blackhole_behind_an_active_port_ends_at_the_window() {
        let t = Instant::now();
        let s = |x: u64| t + Duration::from_secs(x);
        let (mut a, mut b) = (End::new(), End::new());
        let mut x = 0;
        while a.failed.is_none() && x < 100 {
            a.r.fault(s(x));
            converge(&mut a, &mut b, s(x));
            x += 3; // the retry budget: resumed, nothing completes, fault again
        }
        assert!(matches!(a.failed, Some(GiveUpWhy::Window { .. })), "{:?} after {x} s", a.failed);
        assert!(x <= 15, "the window (10 s) ended it, not {x} s");
        // a recovery whose new QPs complete something ends its episode
        let (mut a, mut b) = (End::new(), End::new());
        for k in 0..10 {
            a.r.fault(s(3 * k));
            converge(&mut a, &mut b, s(3 * k));
            a.r.settled();
            b.r.settled();
        }
        assert_eq!((a.failed, a.resumed), (None, 10), "ten separate faults, each recovered");
        // resumed, then idle for an hour (nothing posted, nothing completes):
        // the next fault is a fresh start as far as the window goes, whether
        // NCCL's last call before the hour had a request pending or not
        let (mut a, mut b) = (End::new(), End::new());
        a.r.fault(t);
        converge(&mut a, &mut b, t);
        a.r.observe(s(1));
        a.r.fault(s(3600));
        a.run(s(3600));
        assert_eq!(a.failed, None, "an idle hour after a resume is not charged");
        assert!(a.r.charged(s(3600)) < Duration::from_secs(3), "{:?}", a.r.charged(s(3600)));
    }

    /// NCCL polls a comm it waits on; a silence longer than CALL_GAP is a
    /// comm it does not wait on, whatever the last call said.
    #[test]
    fn a_silence_between_calls_counts_as_not_waiting() {
        let t = Instant::now();
        let s = |x: u64| t + Duration::from_secs(x);
        let mut a = End::new();
        a.port_up = false;
        a.r.fault(t);
        a.run(t);
        a.r.observe(t);
        // no call for 51 s: one second in full, the rest at a tenth
        assert_eq!(a.r.charged(s(51)), Duration::from_secs(6));
        a.run(s(51));
        assert_eq!(a.failed, None);
    }

    /// While NCCL calls the comm, the window counts in full, whether the
    /// peer is silent (unreachable, or late) or takes part and is slow or
    /// its new QPs carry nothing (soft-RoCE VM, loss.sh cut-rec: 100% loss
    /// on the fabric, the out-of-band sockets on the host).
    #[test]
    fn a_called_comm_is_charged_in_full_whatever_the_peer_does() {
        let t = Instant::now();
        let s = |x: u64| t + Duration::from_secs(x);
        for peer_takes_part in [false, true] {
            let (mut a, mut b) = (End::new(), End::new());
            a.r.fault(t);
            a.run(t);
            if peer_takes_part {
                // b answers with its Halt, then stalls (its drain, a dead fabric)
                deliver(&mut a, &mut b, t);
                b.run(t);
                for m in b.out.drain(..).filter(|m| matches!(m, RcMsg::Halt { .. })) {
                    a.r.on_msg(t, m).unwrap();
                }
            }
            for x in 1..=9 {
                a.r.observe(s(x));
                a.run(s(x));
            }
            assert_eq!(a.failed, None);
            a.r.observe(s(10));
            a.r.observe(s(11));
            a.run(s(11));
            assert!(
                matches!(a.failed, Some(GiveUpWhy::Window { phase: Phase::Exchange, charged, .. }) if charged >= Duration::from_secs(10)),
                "peer takes part {peer_takes_part}: {:?}",
                a.failed
            );
        }
    }

    #[test]
    fn a_port_wait_counts_a_tenth_while_nccl_is_silent_and_in_full_while_it_calls() {
        let t = Instant::now();
        let s = |x: u64| t + Duration::from_secs(x);
        let mut a = End::new();
        a.port_up = false;
        a.r.fault(t);
        a.run(t);
        assert_eq!(a.r.phase(), Phase::WaitPort);
        // NCCL calls once, then nothing for a minute (its port down all along)
        a.r.observe(s(1));
        a.r.observe(s(61));
        a.run(s(61));
        assert_eq!((a.failed, a.r.charged(s(61))), (None, Duration::from_millis(7900)), "two seconds, then a tenth of the silence");
        // NCCL polls: the port wait counts in full
        for x in 62..=63 {
            a.r.observe(s(x));
            a.run(s(x));
        }
        assert_eq!(a.failed, None);
        a.r.observe(s(64));
        a.run(s(64));
        assert!(matches!(a.failed, Some(GiveUpWhy::Window { phase: Phase::WaitPort, .. })), "{:?}", a.failed);
    }

    /// A rank away (NCCL calls nothing on the comm): the executor's keeper
    /// moves its recovery on. Its time counts as NCCL's silence, not in
    /// full: a long port wait is charged at a tenth, and the idle time
    /// after the resume is not charged, so a fault after the rank is back
    /// does not find the window spent.
    #[test]
    fn an_unattended_recovery_is_charged_as_a_silence() {
        let t = Instant::now();
        let s = |x: u64| t + Duration::from_secs(x);
        let (mut a, mut b) = (End::new(), End::new());
        b.port_up = false;
        a.r.fault(t);
        a.run(t);
        deliver(&mut a, &mut b, t);
        // b's first step by the keeper (a's Halt came in)
        b.r.unattended(t);
        converge(&mut a, &mut b, t);
        assert_eq!(b.r.phase(), Phase::WaitPort);
        // b's port is down 9 s, nobody calls b: one second, then a tenth
        // (a, whose NCCL waits, is charged in full: 9 s of its 10)
        assert_eq!(b.r.charged(s(9)), Duration::from_millis(1800));
        b.run(s(9));
        b.port_up = true;
        converge(&mut a, &mut b, s(9));
        assert_eq!((a.resumed, b.resumed, a.failed, b.failed), (1, 1, None, None));
        // an hour later b's rank is back, and its first post faults
        b.r.observe(s(3609));
        assert!(b.r.charged(s(3609)) < Duration::from_secs(3), "the idle hour after the resume: {:?}", b.r.charged(s(3609)));
        b.r.fault(s(3609));
        b.run(s(3609));
        assert_eq!(b.failed, None, "a fault after the rank came back has its window");
        // without the keeper's word the same episode counts in full
        let mut c = End::new();
        c.port_up = false;
        c.r.fault(t);
        c.run(s(11));
        assert!(matches!(c.failed, Some(GiveUpWhy::Window { .. })), "{:?}", c.failed);
        // and an episode NCCL called in keeps the silence from that call
        let mut d = End::new();
        d.port_up = false;
        d.r.fault(t);
        d.r.observe(t);
        d.r.unattended(s(30));
        assert_eq!(d.r.charged(s(30)), Duration::from_millis(3900));
    }

    #[test]
    fn waiting_for_the_port_ends_at_the_window_and_tells_the_peer() {
        let t = Instant::now();
        let (mut a, mut b) = (End::new(), End::new());
        a.port_up = false;
        a.r.fault(t);
        converge(&mut a, &mut b, t);
        assert_eq!((a.r.phase(), b.r.phase()), (Phase::WaitPort, Phase::Exchange));
        a.run(t + Duration::from_secs(11));
        assert!(matches!(a.failed, Some(GiveUpWhy::Window { phase: Phase::WaitPort, .. })), "{:?}", a.failed);
        deliver(&mut a, &mut b, t);
        b.run(t + Duration::from_secs(1));
        assert_eq!(b.failed, Some(GiveUpWhy::Peer));
        assert_eq!(a.r.step(t), Do::Wait, "a failed recovery stays failed");
    }

    #[test]
    fn the_port_coming_back_late_still_recovers_within_the_window() {
        let t = Instant::now();
        let (mut a, mut b) = (End::new(), End::new());
        a.port_up = false;
        a.r.fault(t);
        converge(&mut a, &mut b, t);
        a.port_up = true;
        converge(&mut a, &mut b, t + Duration::from_secs(9));
        assert_eq!((a.resumed, b.resumed, a.failed, b.failed), (1, 1, None, None));
    }

    #[test]
    fn out_of_order_messages_are_protocol_errors() {
        let t = Instant::now();
        let mut r = Recovery::new(Duration::from_secs(1));
        let st = RcMsg::State { epoch: 1, addr: Box::new(addr(1, 1)), point: Box::new(Point::Tx(TxPoint::default())) };
        assert!(matches!(r.on_msg(t, st.clone()), Err(ProtoError::RecoverOrder { epoch: 1, .. })));
        r.on_msg(t, RcMsg::Halt { epoch: 1 }).unwrap();
        assert!(matches!(r.on_msg(t, RcMsg::Go { epoch: 1 }), Err(ProtoError::RecoverOrder { .. })));
        r.on_msg(t, st.clone()).unwrap();
        assert!(matches!(r.on_msg(t, st), Err(ProtoError::RecoverOrder { .. })));
        // stale epochs are dropped
        r.on_msg(t, RcMsg::Halt { epoch: 0 }).unwrap();
        assert_eq!(r.epoch(), 1);
    }
}
