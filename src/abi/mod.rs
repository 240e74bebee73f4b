//! The C boundary: the only code that touches NCCL's pointers.
//!
//! Every vtable slot is a few lines: `guard` catches panics and maps errors,
//! `out` and `nonnull` reject NULLs (and `out` hands back the
//! out-parameter), and the core does the work.
//! Comms, listen comms and memory handles are numbered slots of one table
//! (`handles.rs`), checked per kind without touching freed memory; request
//! values name (comm slot, comm generation, request slot, request generation).
#![allow(clippy::missing_safety_doc)]

pub(crate) mod handles;
pub mod profiler;
pub mod result;
pub mod sys;
mod v10;
mod v11;
mod v12;
mod v6;
mod v7;
mod v8;
mod v9;

pub(crate) mod common;

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use sys::ncclResult_t;

use crate::error::{Error, Result};

/// Run one slot body that needs no handle: counted as a call inside the
/// plugin (see [`crate::unload`]), panics caught (never unwind into NCCL),
/// errors logged and mapped.
pub(crate) fn guard(slot: &'static str, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    let Some(_in) = crate::unload::enter() else {
        return ncclResult_t::ncclInvalidUsage;
    };
    run(slot, std::ptr::null_mut(), f)
}

/// Run one slot body that works on the comm `owner` names (a comm handle or
/// a request value): as [`guard`], and a panic fails that comm, since its
/// state may be half-updated. Not counted: the live handle keeps the plugin
/// from being torn down.
#[inline]
pub(crate) fn guard_on(slot: &'static str, owner: VoidPtr, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    run(slot, owner, f)
}

#[inline]
fn run(slot: &'static str, owner: VoidPtr, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    let r = catch_unwind(AssertUnwindSafe(|| {
        crate::fault::slot_entry(slot);
        f()
    }));
    match r {
        Ok(Ok(())) => ncclResult_t::ncclSuccess,
        Ok(Err(e)) => {
            tracing::warn!("{slot}: {e}");
            result::to_nccl(&e)
        }
        Err(payload) => {
            let msg = crate::error::panic_text(&*payload);
            // Logging (and failing the comm) must not unwind out of here.
            let _ = catch_unwind(AssertUnwindSafe(|| {
                let failed = handles::comm_of(owner).map(|c| c.fail_after_panic(slot, &msg)).is_some();
                tracing::warn!(
                    "{slot}: internal panic caught at the NCCL boundary: {msg}{}",
                    if failed { "; its comm is failed: later calls on it return an error, close still frees it" } else { "" }
                )
            }));
            ncclResult_t::ncclInternalError
        }
    }
}

/// Borrow a non-null out-pointer.
pub(crate) unsafe fn out<'a, T>(p: *mut T, slot: &'static str, arg: &'static str) -> Result<&'a mut T> {
    // (a match, not ok_or: an error built eagerly is made and dropped on every call)
    // SAFETY: NCCL passes valid out-pointers; NULL is rejected.
    match unsafe { p.as_mut() } {
        Some(r) => Ok(r),
        None => Err(Error::NullArg { slot, arg }),
    }
}

/// Require a non-null pointer.
pub(crate) fn nonnull<T>(p: *const T, slot: &'static str, arg: &'static str) -> Result<*const T> {
    if p.is_null() {
        Err(Error::NullArg { slot, arg })
    } else {
        Ok(p)
    }
}

/// connect/accept of v7+: a host plugin gives NCCL no device comm, so
/// `*dc = NULL` where NCCL passed the out-pointer (every version's
/// `ncclNetDeviceHandle_vN_t` is v7's).
///
/// # Safety
/// `dc` is NULL or NCCL's out-pointer for one device-handle pointer.
pub(crate) unsafe fn no_dev_comm(dc: *mut *mut sys::ncclNetDeviceHandle_v7_t) {
    // SAFETY: dc is NULL (then as_mut gives None) or a valid out-pointer for
    // one pointer (this fn's contract).
    if let Some(d) = unsafe { dc.as_mut() } {
        *d = std::ptr::null_mut();
    }
}

/// A void pointer NCCL stores, as `*mut c_void`.
pub(crate) type VoidPtr = *mut c_void;
