//! Fault injection for tests: `RUSTNET_FAULT_PANIC` names places where the
//! plugin panics on purpose, to prove the boundary catches the panic and
//! fails the comm it hit. Sites:
//! - a vtable slot name (`isend`, `test`, `accept`, ...): on entry, before
//!   anything changed;
//! - `isend:queued`: inside isend, after the transport took the send (its
//!   request slot is used, bytes may be on the wire) and before NCCL gets
//!   the request;
//! - `test:progressed`: inside test, after the transport retired a finished
//!   request and before NCCL hears it is done.
//!
//! Why a run-time variable and not a cargo feature: the conformance suite
//! tests the very `.so` that ships, not a special build. It cannot be
//! tripped by accident: the name says what it does, `init` rejects any value
//! that is not a site, and the knob table lists it as testing only. Cost
//! when unset: one relaxed load of a word nobody writes after `init`, and a
//! never-taken branch, per site passed.
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::{Error, Result};

/// A place inside an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Site {
    /// `isend:queued`.
    IsendQueued = 1 << 0,
    /// `test:progressed`.
    TestProgressed = 1 << 1,
    /// On entry to a slot (the slot's name is compared, only when armed).
    SlotEntry = 1 << 2,
}

static ARMED: AtomicU32 = AtomicU32::new(0);
static SLOT: crate::unload::Global<String> = crate::unload::Global::new();

const SLOTS: &[&str] = &[
    "init",
    "devices",
    "getProperties",
    "listen",
    "connect",
    "accept",
    "regMr",
    "regMrDmaBuf",
    "deregMr",
    "isend",
    "irecv",
    "iflush",
    "test",
    "closeSend",
    "closeRecv",
    "closeListen",
    "makeVDevice",
];

/// The sites a `RUSTNET_FAULT_PANIC` value arms (0: none), `None` when it
/// names no site.
fn panic_sites(v: &str) -> Option<u32> {
    match v.trim() {
        "" => Some(0),
        "isend:queued" => Some(Site::IsendQueued as u32),
        "test:progressed" => Some(Site::TestProgressed as u32),
        s if SLOTS.contains(&s) => Some(Site::SlotEntry as u32),
        _ => None,
    }
}

/// Is `v` a value `RUSTNET_FAULT_PANIC` accepts (the knob table's check; nothing is armed)?
pub fn panic_spec_ok(v: &str) -> bool {
    panic_sites(v).is_some()
}

/// Parse `RUSTNET_FAULT_PANIC` (empty: nothing armed).
pub fn arm(v: &str) -> Result<()> {
    let v = v.trim();
    let Some(bits) = panic_sites(v) else {
        return Err(Error::Config {
            name: "RUSTNET_FAULT_PANIC",
            value: v.into(),
            accepts: format!("a vtable slot name ({}), isend:queued or test:progressed", SLOTS.join(", ")),
        });
    };
    if bits == Site::SlotEntry as u32 {
        SLOT.get_or_init(|| v.to_string());
    }
    ARMED.store(bits, Ordering::Relaxed);
    Ok(())
}

/// Panic here when `site` is armed.
#[inline(always)]
pub fn point(site: Site) {
    if ARMED.load(Ordering::Relaxed) & site as u32 != 0 {
        injected(site)
    }
}

/// Panic on entry to `slot` when it is armed.
#[inline(always)]
pub fn slot_entry(slot: &str) {
    if ARMED.load(Ordering::Relaxed) & Site::SlotEntry as u32 != 0 && SLOT.get().is_some_and(|s| s == slot) {
        panic!("RUSTNET_FAULT_PANIC={slot}: injected panic");
    }
}

#[cold]
#[inline(never)]
fn injected(site: Site) -> ! {
    panic!("RUSTNET_FAULT_PANIC: injected panic at {site:?}, after the transport changed its state");
}

// ---------------------------------------------------------------- QP errors

/// Which comms `RUSTNET_FAULT_QP_ERROR` hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpSide {
    /// Send comms (counted at each lane posted).
    Send,
    /// Receive comms (counted at each chain of control writes posted).
    Recv,
}

const QP_OFF: u8 = 0;
const QP_SEND: u8 = 1;
const QP_RECV: u8 = 2;
const QP_RANDOM: u8 = 3;

static QP_MODE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(QP_OFF);
static QP_AT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static QP_EVERY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static QP_POSTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static QP_RNG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// `RUSTNET_FAULT_QP_ERROR` as (mode, N or P, K); nothing is armed.
fn parse_qp(v: &str) -> Result<(u8, u64, u64)> {
    let bad = || Error::Config {
        name: "RUSTNET_FAULT_QP_ERROR",
        value: v.into(),
        accepts: "send:N[:K], recv:N[:K] (the N-th post, then every K-th) or random:P (per mille per post)".into(),
    };
    let parts: Vec<&str> = v.trim().split(':').collect();
    let num = |s: &str| s.parse::<u64>().map_err(|_| bad());
    let (mode, at, every) = match parts.as_slice() {
        [""] => (QP_OFF, 0, 0),
        ["send", n] => (QP_SEND, num(n)?, 0),
        ["recv", n] => (QP_RECV, num(n)?, 0),
        ["send", n, k] => (QP_SEND, num(n)?, num(k)?),
        ["recv", n, k] => (QP_RECV, num(n)?, num(k)?),
        ["random", p] if num(p)? <= 1000 => (QP_RANDOM, num(p)?, 0),
        _ => return Err(bad()),
    };
    if mode != QP_OFF && mode != QP_RANDOM && at == 0 {
        return Err(bad());
    }
    Ok((mode, at, every))
}

/// Is `v` a value `RUSTNET_FAULT_QP_ERROR` accepts (the knob table's check; nothing is armed)?
pub fn qp_spec_ok(v: &str) -> bool {
    parse_qp(v).is_ok()
}

/// `RUSTNET_FAULT_TCP_RESET` (`send:N[:K]`, `recv:N[:K]`, N >= 1; empty:
/// none) as (send comms?, N, K).
pub fn parse_tcp_reset(v: &str) -> Result<Option<(bool, u64, u64)>> {
    let v = v.trim();
    if v.is_empty() {
        return Ok(None);
    }
    let bad = || Error::Config { name: "RUSTNET_FAULT_TCP_RESET", value: v.into(), accepts: "send:N[:K] or recv:N[:K] (N >= 1)".into() };
    let mut parts = v.split(':');
    let send = match parts.next() {
        Some("send") => true,
        Some("recv") => false,
        _ => return Err(bad()),
    };
    let first: u64 = parts.next().and_then(|n| n.parse().ok()).filter(|&n| n >= 1).ok_or_else(bad)?;
    let every: u64 = match parts.next() {
        None => 0,
        Some(k) => k.parse().map_err(|_| bad())?,
    };
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(Some((send, first, every)))
}

/// Parse `RUSTNET_FAULT_QP_ERROR` (`send:N[:K]`, `recv:N[:K]`,
/// `random:P`; empty: off) and `RUSTNET_FAULT_SEED`.
pub fn arm_qp(v: &str, seed: u64) -> Result<()> {
    let (mode, at, every) = parse_qp(v)?;
    let v = v.trim();
    let seed = if seed == 0 && mode == QP_RANDOM {
        let s = crate::random::random_u64() | 1;
        tracing::warn!("RUSTNET_FAULT_QP_ERROR={v}: seed {s} (set RUSTNET_FAULT_SEED={s} to repeat)");
        s
    } else {
        seed | 1
    };
    QP_RNG.store(seed, Ordering::Relaxed);
    QP_AT.store(at, Ordering::Relaxed);
    QP_EVERY.store(every, Ordering::Relaxed);
    QP_POSTS.store(0, Ordering::Relaxed);
    QP_MODE.store(mode, Ordering::Relaxed);
    if mode != QP_OFF {
        tracing::warn!("RUSTNET_FAULT_QP_ERROR={v}: QPs will be moved to the error state on purpose (testing only)");
    }
    Ok(())
}

/// A post on a comm of `side` was made: is a QP error due now?
#[inline(always)]
pub fn qp_error_due(side: QpSide) -> bool {
    let mode = QP_MODE.load(Ordering::Relaxed);
    mode != QP_OFF && qp_due_slow(mode, side)
}

#[cold]
fn qp_due_slow(mode: u8, side: QpSide) -> bool {
    match (mode, side) {
        (QP_SEND, QpSide::Send) | (QP_RECV, QpSide::Recv) => {
            let n = QP_POSTS.fetch_add(1, Ordering::Relaxed) + 1;
            let (at, every) = (QP_AT.load(Ordering::Relaxed), QP_EVERY.load(Ordering::Relaxed));
            n == at || (every > 0 && n > at && (n - at).is_multiple_of(every))
        }
        (QP_RANDOM, _) => {
            // xorshift; a lost update between threads only changes which post
            let mut x = QP_RNG.load(Ordering::Relaxed);
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            QP_RNG.store(x, Ordering::Relaxed);
            x % 1000 < QP_AT.load(Ordering::Relaxed)
        }
        _ => false,
    }
}

/// Unload: forget the armed slot name.
///
/// # Safety
/// As [`crate::unload::Global::clear`].
pub(crate) unsafe fn release() {
    ARMED.store(0, Ordering::Relaxed);
    QP_MODE.store(QP_OFF, Ordering::Relaxed);
    // SAFETY: our caller guarantees Global::clear's contract (no reference from get/get_or_init is alive or used again).
    unsafe { SLOT.clear() };
}

// ---------------------------------------------------------------- RUSTNET_FAULT_RTR

static RTR_LEFT: AtomicU32 = AtomicU32::new(0);

/// Arm `RUSTNET_FAULT_RTR`: the next `n` moves of a connection's QPs to RTR fail.
pub fn arm_rtr(n: u32) {
    RTR_LEFT.store(n, Ordering::Relaxed);
    if n > 0 {
        tracing::warn!("RUSTNET_FAULT_RTR={n}: the next {n} move(s) of a connection's QPs to RTR will fail on purpose (testing only)");
    }
}

/// Should this move of a connection's QP to RTR fail on purpose? Takes one
/// of the armed failures. (Once per QP per connect: off the data path.)
pub fn take_rtr() -> bool {
    RTR_LEFT.load(Ordering::Relaxed) != 0 && RTR_LEFT.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qp_error_specs_parse_or_name_what_is_accepted() {
        for bad in ["send", "send:0", "send:x", "recv:1:y", "random:1001", "other:3", "send:1:2:3"] {
            let e = arm_qp(bad, 0).unwrap_err().to_string();
            assert!(e.contains("RUSTNET_FAULT_QP_ERROR") && e.contains("send:N[:K]"), "{bad}: {e}");
        }
        assert_eq!(QP_MODE.load(Ordering::Relaxed), QP_OFF, "a refused value arms nothing");
        // (the counters are process-wide; this test is the only one that arms them)
        arm_qp("send:3:2", 0).unwrap();
        let hits: Vec<bool> = (0..9).map(|_| qp_error_due(QpSide::Send)).collect();
        assert_eq!(hits, [false, false, true, false, true, false, true, false, true], "the 3rd post, then every 2nd");
        assert!(!qp_error_due(QpSide::Recv), "send comms only");
        arm_qp("random:1000", 5).unwrap();
        assert!(qp_error_due(QpSide::Recv) && qp_error_due(QpSide::Send), "1000 per mille: every post");
        arm_qp("random:0", 5).unwrap();
        assert!(!qp_error_due(QpSide::Send));
        arm_qp("", 0).unwrap();
        assert!(!qp_error_due(QpSide::Send));
    }

    #[test]
    fn the_knob_checks_agree_with_what_arming_accepts() {
        for (v, ok) in
            [("", true), ("isend", true), ("isend:queued", true), ("test:progressed", true), ("isend:later", false), ("x", false)]
        {
            assert_eq!(panic_spec_ok(v), ok, "{v:?}");
        }
        for (v, ok) in [("", true), ("send:3", true), ("recv:1:5", true), ("random:1000", true), ("send:0", false), ("random:1001", false)]
        {
            assert_eq!(qp_spec_ok(v), ok, "{v:?}");
        }
        assert_eq!(parse_tcp_reset("send:2:3").unwrap(), Some((true, 2, 3)));
        assert_eq!(parse_tcp_reset(" ").unwrap(), None);
        for bad in ["send", "recv:0", "send:1:x", "both:1", "send:1:2:3"] {
            let e = parse_tcp_reset(bad).unwrap_err().to_string();
            assert!(e.contains("RUSTNET_FAULT_TCP_RESET") && e.contains("send:N[:K]"), "{bad}: {e}");
        }
    }

    #[test]
    fn rtr_faults_are_taken_once_each() {
        arm_rtr(2);
        assert!(take_rtr() && take_rtr(), "the two armed moves fail");
        assert!(!take_rtr() && !take_rtr(), "then none: the count does not wrap");
        arm_rtr(0);
        assert!(!take_rtr());
    }
}
