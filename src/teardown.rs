//! The library's unload hook: frees every process-wide state when nothing
//! can use it any more (the rules are in [`crate::unload`]). It is the one
//! module that reaches every owner of state, and no module imports it, so
//! the owners can import the leaf [`crate::unload`] (its guard and
//! [`Global`](crate::unload::Global)) without an import circle.
use crate::unload;

/// Runs when the library is unloaded (`dlclose`) or the process exits.
extern "C" fn on_unload() {
    if !unload::is_serving() {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        // NCCL's logger may be gone already (exit): plain stderr from here on
        crate::log::set_nccl_logger(None);
        if !unload::begin_teardown() || crate::plugin::connecting() != 0 || !crate::abi::handles::teardown() {
            // still in use (a process exiting with comms open): keep it all
            unload::cancel_teardown();
            return;
        }
        // SAFETY: no call is inside the plugin (begin_teardown saw none and
        // refuses new ones), no handle is alive and no connect is pending,
        // so no reference into these states remains.
        unsafe {
            crate::stats::release();
            crate::plugin::teardown();
            crate::context::release();
            crate::transport::ib::release();
            crate::transport::tcp::release();
            crate::gpu::release();
            crate::fault::release();
            crate::intern::release();
        }
    });
}

#[used]
#[link_section = ".fini_array"]
static ON_UNLOAD: extern "C" fn() = on_unload;
