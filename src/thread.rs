//! Threads the plugin starts for its own work, made so that `dlclose` can
//! still unmap the library once they are joined.
//!
//! glibc keeps a library mapped while any living thread holds a
//! thread-local destructor that the library registered. `std::thread::spawn`
//! registers one in the *calling* thread (its thread-local state for the
//! spawned thread's handle), and the caller here is NCCL's thread, which
//! lives on after `dlclose`. So the plugin's threads are bare pthreads: the
//! new thread's own thread-locals are destroyed when it ends, and the caller
//! is left with nothing of ours. Locks shared with such a thread must not
//! park the caller in parking_lot either (a parked thread gets thread-local
//! state with a destructor): use std's locks there.
use std::ffi::CStr;

/// A started thread that must be joined ([`BareThread::join`]); dropping it
/// without joining detaches nothing and leaks nothing but the thread itself,
/// so owners join in their `Drop`.
pub struct BareThread {
    id: libc::pthread_t,
}

type Body = Box<dyn FnOnce() + Send + 'static>;

extern "C" fn start(arg: *mut libc::c_void) -> *mut libc::c_void {
    // SAFETY: `spawn` passed a Box<(name, Body)> made by Box::into_raw and
    // gave up its ownership when pthread_create succeeded.
    let b = unsafe { Box::from_raw(arg.cast::<(&'static CStr, Body)>()) };
    let (name, body) = *b;
    // SAFETY: names the calling thread; `name` is NUL-terminated and at most
    // 15 characters (checked in `spawn`).
    unsafe { libc::pthread_setname_np(libc::pthread_self(), name.as_ptr()) };
    // a panic must not unwind out of a C start routine; the body reports
    // its own failures, this only keeps the process alive
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    std::ptr::null_mut()
}

impl BareThread {
    /// Start `body` on a new thread named `name` (at most 15 bytes).
    pub fn spawn(name: &'static CStr, body: impl FnOnce() + Send + 'static) -> std::io::Result<BareThread> {
        if name.to_bytes().len() > 15 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "thread name longer than 15 bytes"));
        }
        let arg: Box<(&'static CStr, Body)> = Box::new((name, Box::new(body)));
        let arg = Box::into_raw(arg);
        // SAFETY: pthread_t is a plain integer on Linux; pthread_create writes it.
        let mut id: libc::pthread_t = unsafe { std::mem::zeroed() };
        // SAFETY: `start` takes ownership of `arg` (a Box given up just
        // above) when the thread is created; default attributes (NULL).
        let rc = unsafe { libc::pthread_create(&mut id, std::ptr::null(), start, arg.cast()) };
        if rc != 0 {
            // SAFETY: no thread was created, so `arg` is still ours to free.
            drop(unsafe { Box::from_raw(arg) });
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        Ok(BareThread { id })
    }

    /// Wait for the thread to end.
    pub fn join(self) {
        // SAFETY: a thread we created and have neither joined nor detached:
        // `self` is consumed here, once.
        unsafe { libc::pthread_join(self.id, std::ptr::null_mut()) };
    }
}
