//! The TCP helper threads (RUSTNET_SOCKET_HELPER=1): one bounded pool per
//! process moves the bytes of every helper-mode comm, instead of one thread
//! per comm. Each pool thread sleeps in epoll_wait(2) with no timeout on the
//! sockets of the comms it serves (edge-triggered, registered once) and on
//! an eventfd that posts ring; an idle comm costs no wake-up at all, so the
//! idle CPU and the wake-ups do not grow with the number of comms.
//!
//! The caller still moves what it can when it gets a comm's lock (`test`
//! uses `try_lock` and says "not done" while a pool thread holds it). A
//! panic while a pool thread drives a comm fails that comm (the caller's
//! next call reports it); the thread drops the comm and serves the others.
//!
//! Threads are started on demand up to the pool size (RUSTNET_SOCKET_HELPER_THREADS)
//! and are bare pthreads ([`crate::thread`]); when the last helper-mode comm
//! closes, every pool thread is stopped and joined, so nothing of the pool
//! outlives the comms (dlclose can unmap the library).
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};

use crate::error::{Errno, Error, Result};
use crate::proto::wire::MAX_STREAMS;
use crate::thread::BareThread;
use crate::transport::sock::EventFd;

/// What a pool thread needs from a comm core.
pub trait Drive: Send + 'static {
    /// Move what can move now without blocking. It must go on until each
    /// socket it has work for would block (a short read or write) or until
    /// nothing is left to move: the sockets are watched edge-triggered, so
    /// a socket left readable or writable with work for it gives no event.
    fn progress(&mut self);
    /// The comm's sockets; how many were written.
    fn fds(&self, out: &mut [RawFd; MAX_STREAMS]) -> usize;
    /// Whether the comm writes (watched for output) or reads (for input).
    fn sends(&self) -> bool;
    /// Fail the comm (first error wins): every pending and later request reports `e`.
    fn fail_with(&mut self, e: Error);
}

/// A comm core shared between its owner and a pool thread. std's Mutex,
/// not parking_lot's: NCCL's thread may wait on it while a pool thread
/// holds it, and a thread parking_lot parks keeps thread-local state of
/// ours that would pin the library after dlclose (see crate::thread).
pub struct Shared<T> {
    core: Mutex<T>,
    stop: AtomicBool,
}

impl<T> Shared<T> {
    /// The core, also after a panic while it was held (a poisoned lock): the
    /// pool fails the comm then, and the caller must still see that.
    pub fn lock_core(&self) -> MutexGuard<'_, T> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The core if nobody holds it.
    pub fn try_lock_core(&self) -> Option<MutexGuard<'_, T>> {
        match self.core.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}

/// A comm as a pool thread sees it (type-erased: send and receive cores).
trait Job: Send + Sync {
    /// Drive the comm once; false when the pool must drop it (halted, or
    /// it panicked and is failed).
    fn run(&self) -> bool;
    fn fds(&self, out: &mut [RawFd; MAX_STREAMS]) -> usize;
    fn events(&self) -> u32;
}

impl<T: Drive> Job for Shared<T> {
    fn run(&self) -> bool {
        if self.stop.load(Ordering::SeqCst) {
            return false;
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.lock_core().progress())) {
            Ok(()) => true,
            Err(p) => {
                // A bug: the core may be half-updated. Fail it so the caller
                // reports an error instead of waiting on a request that can
                // no longer finish, and stop touching NCCL's buffers.
                let what = crate::error::panic_text(&*p);
                tracing::warn!("TCP helper thread panicked: {what}; the comm is failed");
                self.lock_core().fail_with(Error::Internal(format!("the TCP helper thread panicked: {what}")));
                false
            }
        }
    }
    fn fds(&self, out: &mut [RawFd; MAX_STREAMS]) -> usize {
        self.lock_core().fds(out)
    }
    fn events(&self) -> u32 {
        let dir = if self.lock_core().sends() { libc::EPOLLOUT } else { libc::EPOLLIN | libc::EPOLLRDHUP };
        (dir | libc::EPOLLET) as u32
    }
}

/// Set by a pool thread once it no longer holds a comm (its owner waits for it).
#[derive(Default)]
struct Gone {
    done: Mutex<bool>,
    cv: Condvar,
}

impl Gone {
    fn set(&self) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.cv.notify_all();
    }
    fn wait(&self) {
        let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while !*d {
            d = self.cv.wait(d).unwrap_or_else(|p| p.into_inner());
        }
    }
}

enum Cmd {
    Attach(usize, Arc<dyn Job>),
    Run(usize),
    /// The comm has new sockets (a TCP recovery): watch them too (the old
    /// ones left the epoll set when they were closed).
    Rewatch(usize),
    Detach(usize, Arc<Gone>),
    Quit,
}

#[derive(Default)]
struct Inbox {
    cmds: Vec<Cmd>,
    /// The thread is (about to be) asleep in epoll_wait: a command needs the eventfd.
    sleeping: bool,
    /// Slot ids handed out (a slot is free again once its comm is detached).
    next: usize,
    free: Vec<usize>,
}

/// One pool thread's side that comms talk to.
struct Worker {
    ep: OwnedFd,
    wake: EventFd,
    inbox: Mutex<Inbox>,
}

/// The eventfd's token in the epoll set (comm slots are small integers).
const WAKE: u64 = u64::MAX;
/// Events one epoll_wait returns at most.
const EVENTS: usize = 256;

fn epoll_ctl(ep: &OwnedFd, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> std::result::Result<(), Errno> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: both descriptors are open (the epoll set is ours, `fd` belongs
    // to a comm the pool holds); `ev` is valid for the call (DEL ignores it
    // but kernels before 2.6.9 want it non-NULL).
    let r = unsafe { libc::epoll_ctl(ep.as_raw_fd(), op, fd, &mut ev) };
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(())
    }
}

impl Worker {
    fn new() -> Result<Worker> {
        // SAFETY: plain epoll_create1(2); the returned fd is owned below.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(Error::last_os("epoll_create1"));
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let ep = unsafe { OwnedFd::from_raw_fd(fd) };
        let wake = EventFd::new()?;
        epoll_ctl(&ep, libc::EPOLL_CTL_ADD, wake.as_raw_fd(), libc::EPOLLIN as u32, WAKE)
            .map_err(|e| Error::sys("epoll_ctl(ADD eventfd)", e))?;
        Ok(Worker { ep, wake, inbox: Mutex::new(Inbox::default()) })
    }

    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, c: Cmd) {
        let mut ib = self.inbox();
        ib.cmds.push(c);
        let wake = std::mem::replace(&mut ib.sleeping, false);
        drop(ib);
        if wake {
            self.wake.notify();
        }
    }

    fn slot(&self) -> usize {
        let mut ib = self.inbox();
        match ib.free.pop() {
            Some(id) => id,
            None => {
                ib.next += 1;
                ib.next - 1
            }
        }
    }
}

struct Entry {
    job: Arc<dyn Job>,
    queued: bool,
}

fn watch(w: &Worker, id: usize, job: &dyn Job, op: libc::c_int) {
    let mut fds = [-1; MAX_STREAMS];
    let n = job.fds(&mut fds);
    let ev = job.events();
    for &fd in &fds[..n] {
        if let Err(e) = epoll_ctl(&w.ep, op, fd, ev, id as u64) {
            if op == libc::EPOLL_CTL_ADD && e.0 == libc::EEXIST {
                continue; // still watched (a rewatch after a recovery)
            }
            // the comm then moves only from its caller's thread (test)
            tracing::warn!("TCP helper: epoll_ctl on socket {fd}: {e}; that stream moves only when NCCL tests its requests");
        }
    }
}

fn worker_loop(w: Arc<Worker>) {
    let mut slab: Vec<Option<Entry>> = Vec::new();
    let mut runnable: Vec<usize> = Vec::new();
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; EVENTS];
    let queue = |slab: &mut Vec<Option<Entry>>, runnable: &mut Vec<usize>, id: usize| {
        if let Some(Some(e)) = slab.get_mut(id) {
            if !e.queued {
                e.queued = true;
                runnable.push(id);
            }
        }
    };
    loop {
        let mut timeout = 0;
        if runnable.is_empty() {
            let mut ib = w.inbox();
            if ib.cmds.is_empty() {
                ib.sleeping = true;
                timeout = -1;
            }
        }
        // SAFETY: evs has room for EVENTS events; the epoll set is ours.
        let n = unsafe { libc::epoll_wait(w.ep.as_raw_fd(), evs.as_mut_ptr(), EVENTS as libc::c_int, timeout) };
        let cmds = {
            let mut ib = w.inbox();
            ib.sleeping = false;
            std::mem::take(&mut ib.cmds)
        };
        // n < 0: EINTR (or a broken set, then the comms move from test())
        for ev in &evs[..n.max(0) as usize] {
            let tok = ev.u64;
            if tok == WAKE {
                w.wake.drain();
            } else {
                queue(&mut slab, &mut runnable, tok as usize);
            }
        }
        for c in cmds {
            match c {
                Cmd::Attach(id, job) => {
                    if slab.len() <= id {
                        slab.resize_with(id + 1, || None);
                    }
                    watch(&w, id, &*job, libc::EPOLL_CTL_ADD);
                    slab[id] = Some(Entry { job, queued: false });
                    queue(&mut slab, &mut runnable, id);
                }
                Cmd::Run(id) => queue(&mut slab, &mut runnable, id),
                Cmd::Rewatch(id) => {
                    if let Some(Some(e)) = slab.get(id) {
                        let job = e.job.clone();
                        watch(&w, id, &*job, libc::EPOLL_CTL_ADD);
                    }
                    queue(&mut slab, &mut runnable, id);
                }
                Cmd::Detach(id, gone) => {
                    if let Some(e) = slab.get_mut(id).and_then(Option::take) {
                        watch(&w, id, &*e.job, libc::EPOLL_CTL_DEL);
                    }
                    w.inbox().free.push(id);
                    gone.set();
                }
                Cmd::Quit => return,
            }
        }
        for id in std::mem::take(&mut runnable) {
            let Some(Some(e)) = slab.get_mut(id) else { continue };
            e.queued = false;
            if !e.job.run() {
                // halted or failed by a panic: nothing moves any more; the
                // slot stays taken until its owner detaches it
                let e = slab[id].take().expect("entry checked above");
                watch(&w, id, &*e.job, libc::EPOLL_CTL_DEL);
            }
        }
    }
}

/// The process-wide pool: its threads and the number of comms they serve.
struct Pool {
    workers: Vec<(Arc<Worker>, BareThread, usize)>,
    comms: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool { workers: Vec::new(), comms: 0 });

fn pool() -> MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|p| p.into_inner())
}

/// How many pool threads run now (tests).
#[cfg(test)]
pub fn pool_threads() -> usize {
    pool().workers.len()
}

/// A worker for one more comm: an idle one, else a new one while fewer
/// than `max` run, else the least loaded; its index.
fn pick(p: &mut Pool, max: usize) -> Result<usize> {
    if let Some(i) = p.workers.iter().position(|w| w.2 == 0) {
        return Ok(i);
    }
    if p.workers.len() < max.max(1) {
        let w = Arc::new(Worker::new()?);
        let w2 = w.clone();
        match BareThread::spawn(c"rustnet-tcp-hlp", move || worker_loop(w2)) {
            Ok(t) => {
                p.workers.push((w, t, 0));
                return Ok(p.workers.len() - 1);
            }
            Err(e) if p.workers.is_empty() => return Err(Error::Internal(format!("start a TCP helper thread: {e}"))),
            Err(e) => tracing::warn!("start a TCP helper thread: {e}; sharing the {} running", p.workers.len()),
        }
    }
    Ok((0..p.workers.len()).min_by_key(|&i| p.workers[i].2).expect("a worker runs"))
}

/// The last comm left: stop and join every pool thread.
fn shutdown(p: &mut Pool) {
    for (w, t, _) in std::mem::take(&mut p.workers) {
        w.send(Cmd::Quit);
        t.join();
    }
}

/// A comm core driven by the process's helper pool. Dropping it (NCCL's
/// close) detaches it from its pool thread and waits until that thread no
/// longer holds it; the last one stops the pool.
pub struct Helper<T: Drive> {
    /// The shared core (pub for tests that check who still holds it).
    pub sh: Arc<Shared<T>>,
    w: Arc<Worker>,
    id: usize,
}

impl<T: Drive> Helper<T> {
    /// Hand the core to the pool (of at most `max_threads` threads); if no
    /// thread can serve it, the core comes back with the reason, so the
    /// caller's thread can drive it instead.
    pub fn start(core: T, max_threads: usize) -> std::result::Result<Helper<T>, (T, Error)> {
        let mut p = pool();
        let i = match pick(&mut p, max_threads) {
            Ok(i) => i,
            Err(e) => return Err((core, e)),
        };
        p.comms += 1;
        p.workers[i].2 += 1;
        let w = p.workers[i].0.clone();
        drop(p);
        let sh = Arc::new(Shared { core: Mutex::new(core), stop: AtomicBool::new(false) });
        let id = w.slot();
        w.send(Cmd::Attach(id, sh.clone()));
        Ok(Helper { sh, w, id })
    }

    /// Stop driving the comm without waiting (a comm failed by a panic at
    /// the boundary: its state is not trusted, so nothing moves any more).
    pub fn halt(&self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        self.w.send(Cmd::Run(self.id));
    }

    /// Tell the pool there is new work for this comm.
    pub fn posted(&self) {
        self.w.send(Cmd::Run(self.id));
    }

    /// The comm's sockets changed (a recovery): the pool watches the new ones.
    pub fn rewatch(&self) {
        self.w.send(Cmd::Rewatch(self.id));
    }
}

impl<T: Drive> Drop for Helper<T> {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        let gone = Arc::new(Gone::default());
        self.w.send(Cmd::Detach(self.id, gone.clone()));
        gone.wait();
        let mut p = pool();
        if let Some(k) = p.workers.iter().position(|x| Arc::ptr_eq(&x.0, &self.w)) {
            p.workers[k].2 -= 1;
        }
        p.comms -= 1;
        if p.comms == 0 {
            shutdown(&mut p);
        }
    }
}

/// RUSTNET_SOCKET_HELPER_THREADS=0: the pool size from the CPUs this
/// process may run on and the ranks on its host: one thread per CPU of the
/// rank, at least 4 (NCCL's usual 2 channels per peer give 2 send and 2
/// receive comms; sharing fewer threads among them cost 0.54x of the
/// per-comm threads' busbw at 32 KiB steps in `rustnet bench step`) and at most 8.
pub fn auto_threads(cpus: usize, ranks: usize) -> usize {
    (cpus / ranks.max(1)).clamp(4, 8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A core whose progress panics once asked to, as a bug would.
    struct Bomb {
        armed: Arc<AtomicBool>,
        failed: Arc<Mutex<Option<String>>>,
    }

    impl Drive for Bomb {
        fn progress(&mut self) {
            if self.armed.load(Ordering::SeqCst) {
                panic!("injected helper panic");
            }
        }
        fn fds(&self, _out: &mut [RawFd; MAX_STREAMS]) -> usize {
            0
        }
        fn sends(&self) -> bool {
            true
        }
        fn fail_with(&mut self, e: Error) {
            *self.failed.lock().unwrap() = Some(e.to_string());
        }
    }

    #[test]
    fn a_panic_in_the_pool_fails_the_comm_and_the_pool_lets_it_go() {
        let armed = Arc::new(AtomicBool::new(false));
        let failed = Arc::new(Mutex::new(None));
        let Ok(h) = Helper::start(Bomb { armed: armed.clone(), failed: failed.clone() }, 2) else { panic!("helper did not start") };
        armed.store(true, Ordering::SeqCst);
        h.posted();
        let t0 = Instant::now();
        while failed.lock().unwrap().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(10), "the helper's panic did not fail the comm");
            std::thread::sleep(Duration::from_millis(1));
        }
        let e = failed.lock().unwrap().clone().unwrap();
        assert!(e.contains("helper thread panicked") && e.contains("injected helper panic"), "{e}");
        // the pool dropped it: only the comm holds the shared state
        while Arc::strong_count(&h.sh) > 1 {
            assert!(t0.elapsed() < Duration::from_secs(10), "the pool went on holding a comm after its panic");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(h);
    }

    #[test]
    fn the_pool_size_follows_cpus_per_rank() {
        assert_eq!(auto_threads(2, 1), 4);
        assert_eq!(auto_threads(16, 2), 8);
        assert_eq!(auto_threads(16, 4), 4);
        assert_eq!(auto_threads(16, 8), 4);
        assert_eq!(auto_threads(128, 8), 8);
        assert_eq!(auto_threads(256, 1), 8);
    }
}
