//! Nothing kept across unload. NCCL may `dlclose` the plugin and open it
//! again (and tools do it in loops); every copy of the library must give
//! back what it took, or each cycle leaks (it was ~34 KB: the tracing
//! subscriber, the config, the device tables, interned strings).
//!
//! - Logging keeps no heap state at all (`log.rs`: a static logger).
//! - Process-wide state that owns heap memory lives in a [`Global`], which
//!   `on_unload` can empty.
//! - `on_unload` (in `crate::teardown`, the one module that reaches every
//!   owner of state; this one is a leaf every owner imports) runs from
//!   `.fini_array`: at `dlclose` and at process exit.
//!   It frees only when nothing can still use the state: no handle alive (a
//!   live handle means NCCL may still call with it, e.g. a proxy thread at
//!   exit), no connect attempt pending, and no other call inside the plugin
//!   (calls without a handle count themselves in `enter`; a call that
//!   starts after teardown began is refused). Otherwise it keeps everything:
//!   a leak at exit costs nothing, a free under a running thread would crash.
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use once_cell::sync::OnceCell;

/// A process-wide value set once, which unload can drop.
pub struct Global<T> {
    cell: UnsafeCell<OnceCell<T>>,
}

// SAFETY: shared use goes through OnceCell's synchronised API; `clear`, the
// only mutation, requires (unsafe) that no other thread uses the value.
unsafe impl<T: Send + Sync> Sync for Global<T> {}

impl<T> Default for Global<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Global<T> {
    /// Empty.
    pub const fn new() -> Self {
        Global { cell: UnsafeCell::new(OnceCell::new()) }
    }

    fn cell(&self) -> &OnceCell<T> {
        // SAFETY: only `clear` writes through the UnsafeCell, under its contract.
        unsafe { &*self.cell.get() }
    }

    /// The value, if set.
    pub fn get(&self) -> Option<&T> {
        self.cell().get()
    }

    /// The value, set by `f` on first use.
    pub fn get_or_init(&self, f: impl FnOnce() -> T) -> &T {
        self.cell().get_or_init(f)
    }

    /// Drop the value.
    ///
    /// # Safety
    /// No reference from `get`/`get_or_init` is alive or used again, and no
    /// other thread uses this `Global` meanwhile.
    pub unsafe fn clear(&self) {
        // SAFETY: exclusive access by the contract above.
        unsafe { *self.cell.get() = OnceCell::new() };
    }
}

static TEARING_DOWN: AtomicBool = AtomicBool::new(false);
/// Set by the first `init` through a vtable: this copy serves NCCL (or a
/// driver) and owns the state above. A program that links the crate and
/// uses it directly (the tool, tests) never sets it, and `on_unload`
/// leaves its state alone at exit, whatever its threads are doing.
static SERVING: AtomicBool = AtomicBool::new(false);

/// Called by the vtables' `init`.
pub(crate) fn serving() {
    SERVING.store(true, Ordering::Relaxed);
}
static IN_CALL: AtomicUsize = AtomicUsize::new(0);

/// A call without a handle (init, devices, listen, connect, close...) is
/// inside the plugin until the returned guard drops; `None` while the
/// library is being unloaded.
pub(crate) fn enter() -> Option<InCall> {
    IN_CALL.fetch_add(1, Ordering::SeqCst);
    if TEARING_DOWN.load(Ordering::SeqCst) {
        IN_CALL.fetch_sub(1, Ordering::SeqCst);
        return None;
    }
    Some(InCall)
}

/// See [`enter`].
pub(crate) struct InCall;

impl Drop for InCall {
    fn drop(&mut self) {
        IN_CALL.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether a vtable's `init` ran in this copy (see [`SERVING`]).
pub(crate) fn is_serving() -> bool {
    SERVING.load(Ordering::Relaxed)
}

/// Refuse new calls from now on; true when no call is inside the plugin.
/// (The teardown hook, `crate::teardown`, then checks the handles.)
pub(crate) fn begin_teardown() -> bool {
    TEARING_DOWN.store(true, Ordering::SeqCst);
    IN_CALL.load(Ordering::SeqCst) == 0
}

/// Still in use after all: accept calls again and keep every state.
pub(crate) fn cancel_teardown() {
    TEARING_DOWN.store(false, Ordering::SeqCst);
}
