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
//! state with a destructor): use std's locks there, or [`Lock`] where the
//! data path takes it (a comm's lock).
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

/// A mutex for state that NCCL's threads and the plugin's own share (a
/// comm, which the recovery keeper also takes): a futex word, no
/// thread-local state (so a waiting NCCL thread keeps nothing of ours,
/// unlike parking_lot, see above), no poisoning (a panic under it fails
/// the comm, whose state is then not trusted anyway), and an uncontended
/// lock and unlock of one atomic operation each, inlined (std's Mutex
/// costs a call and a panic check, 26 instructions per `test()` under
/// callgrind).
pub struct Lock<T> {
    /// 0: free; 1: held; 2: held and someone may wait in the kernel.
    state: std::sync::atomic::AtomicU32,
    value: std::cell::UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and one guard exists
// at a time (the state word's acquire/release pairs order the accesses), so
// sharing the lock shares the value between threads one at a time: what T:
// Send allows.
unsafe impl<T: Send> Sync for Lock<T> {}

/// Holds a [`Lock`]; unlocks when dropped.
pub struct LockGuard<'a, T> {
    lock: &'a Lock<T>,
}

impl<T> Lock<T> {
    /// A free lock around `v`.
    pub const fn new(v: T) -> Lock<T> {
        Lock { state: std::sync::atomic::AtomicU32::new(0), value: std::cell::UnsafeCell::new(v) }
    }

    /// Wait for it (spinning a little, then asleep in the kernel).
    #[inline]
    pub fn lock(&self) -> LockGuard<'_, T> {
        use std::sync::atomic::Ordering::{Acquire, Relaxed};
        if self.state.compare_exchange(0, 1, Acquire, Relaxed).is_err() {
            self.lock_slow();
        }
        LockGuard { lock: self }
    }

    /// Take it if free.
    #[inline]
    pub fn try_lock(&self) -> Option<LockGuard<'_, T>> {
        use std::sync::atomic::Ordering::{Acquire, Relaxed};
        self.state.compare_exchange(0, 1, Acquire, Relaxed).ok().map(|_| LockGuard { lock: self })
    }

    #[cold]
    fn lock_slow(&self) {
        use std::sync::atomic::Ordering::{Acquire, Relaxed};
        for _ in 0..100 {
            if self.state.load(Relaxed) == 0 && self.state.compare_exchange(0, 1, Acquire, Relaxed).is_ok() {
                return;
            }
            std::hint::spin_loop();
        }
        // from here on the word says "someone may wait": the unlock wakes one
        while self.state.swap(2, Acquire) != 0 {
            // SAFETY: FUTEX_WAIT on a live, aligned u32 of ours; it returns
            // at once if the word is no longer 2, on a wake or a signal.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    self.state.as_ptr(),
                    libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                    2u32,
                    std::ptr::null::<libc::timespec>(),
                )
            };
        }
    }

    #[inline]
    fn unlock(&self) {
        if self.state.swap(0, std::sync::atomic::Ordering::Release) == 2 {
            self.wake();
        }
    }

    #[cold]
    fn wake(&self) {
        // SAFETY: FUTEX_WAKE of one waiter on a live, aligned u32 of ours.
        unsafe { libc::syscall(libc::SYS_futex, self.state.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1u32) };
    }
}

impl<T> std::ops::Deref for LockGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock: no other reference to the value exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> std::ops::DerefMut for LockGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds the lock, and &mut self makes this the only use of it.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for LockGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_excludes_and_wakes_its_waiters() {
        let l = Lock::new(0u64);
        {
            let _g = l.lock();
            assert!(l.try_lock().is_none(), "held: try_lock fails");
        }
        assert!(l.try_lock().is_some(), "free again");
        // 4 threads, 20,000 increments each, some holding it across a yield
        // so that others sleep in the kernel
        std::thread::scope(|s| {
            for t in 0..4 {
                let l = &l;
                s.spawn(move || {
                    for i in 0..20_000u64 {
                        let mut g = l.lock();
                        *g += 1;
                        if (i + t) % 1000 == 0 {
                            std::thread::sleep(std::time::Duration::from_micros(200));
                        }
                    }
                });
            }
        });
        assert_eq!(*l.lock(), 80_000);
    }
}
