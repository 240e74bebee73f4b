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

/// Parse `RUSTNET_FAULT_PANIC` (empty: nothing armed).
pub fn arm(v: &str) -> Result<()> {
    let v = v.trim();
    let bits = match v {
        "" => 0,
        "isend:queued" => Site::IsendQueued as u32,
        "test:progressed" => Site::TestProgressed as u32,
        s if SLOTS.contains(&s) => {
            SLOT.get_or_init(|| s.to_string());
            Site::SlotEntry as u32
        }
        _ => {
            return Err(Error::Config {
                name: "RUSTNET_FAULT_PANIC",
                value: v.into(),
                accepts: format!("a vtable slot name ({}), isend:queued or test:progressed", SLOTS.join(", ")),
            })
        }
    };
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

/// Unload: forget the armed slot name.
///
/// # Safety
/// As [`crate::unload::Global::clear`].
pub(crate) unsafe fn release() {
    ARMED.store(0, Ordering::Relaxed);
    // SAFETY: our caller guarantees Global::clear's contract (no reference from get/get_or_init is alive or used again).
    unsafe { SLOT.clear() };
}
