//! The C boundary: the only code that touches NCCL's pointers.
//!
//! Every vtable slot is a few lines: [`guard`] catches panics and maps errors,
//! the `ptr_*` helpers reject NULLs and decode, and the core does the work.
//! Comms and memory handles are boxes only `close*`/`deregMr` free; request
//! pointers encode (comm, slot, generation) so a stale one is caught.
#![allow(clippy::missing_safety_doc)]

pub mod result;
pub mod sys;
mod v10;
mod v6;
mod v7;
mod v8;
mod v9;

pub(crate) mod common;

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use sys::ncclResult_t;

use crate::error::{Error, Result};

/// Run one slot body: catch panics (never unwind into NCCL), log and map errors.
pub(crate) fn guard(slot: &'static str, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    let r = catch_unwind(AssertUnwindSafe(|| {
        if let Ok(p) = crate::plugin::get() {
            if !p.cfg.fault_panic.is_empty() && p.cfg.fault_panic == slot {
                panic!("RUSTNET_FAULT_PANIC={slot}: injected panic");
            }
        }
        f()
    }));
    match r {
        Ok(Ok(())) => ncclResult_t::ncclSuccess,
        Ok(Err(e)) => {
            tracing::warn!("{slot}: {e}");
            result::to_nccl(&e)
        }
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            // Logging itself must not unwind out of here.
            let _ = catch_unwind(AssertUnwindSafe(|| tracing::warn!("{slot}: internal panic caught at the NCCL boundary: {msg}")));
            ncclResult_t::ncclInternalError
        }
    }
}

/// Borrow a non-null out-pointer.
pub(crate) unsafe fn out<'a, T>(p: *mut T, slot: &'static str, arg: &'static str) -> Result<&'a mut T> {
    // SAFETY: NCCL passes valid out-pointers; NULL is rejected.
    unsafe { p.as_mut() }.ok_or(Error::NullArg { slot, arg })
}

/// Require a non-null pointer.
pub(crate) fn nonnull<T>(p: *const T, slot: &'static str, arg: &'static str) -> Result<*const T> {
    if p.is_null() {
        Err(Error::NullArg { slot, arg })
    } else {
        Ok(p)
    }
}

/// A void pointer NCCL stores, as `*mut c_void`.
pub(crate) type VoidPtr = *mut c_void;
