//! The keeper: recovery of verbs comms that NCCL is not calling.
//!
//! A comm recovers inside NCCL's calls on it ([`super::reconnect`]). A rank
//! whose NCCL calls nothing on a comm for a while (it writes a checkpoint,
//! or waits in a collective on other peers) would therefore not answer its
//! peer's Halt: the peer, whose NCCL waits on the comm, spends its whole
//! `RUSTNET_RECOVERY_TIMEOUT` waiting for a State that comes only when the
//! late rank calls again, and fails. NCCL's net_ib rides such a flap out in
//! the HCA, which retransmits without the CPU.
//!
//! So each verbs comm that may recover is registered here, with its
//! out-of-band sockets, when NCCL gets its handle; one thread per process
//! ("rustnet-keeper", a bare pthread started with the first registration and
//! joined when the last goes) sleeps in epoll on those sockets (one-shot:
//! a socket is watched again after a look found nothing to do, so a comm
//! costs the thread nothing until it has news). When a
//! recovery message arrives on a comm that NCCL has not called for
//! [`KEEP_IDLE`], or while such a comm recovers, the thread takes the
//! comm's lock without waiting (`try_lock`: a comm NCCL is in is left to
//! NCCL) and moves the recovery on exactly as NCCL's call would, every
//! [`KEEP_TICK`] until it has resumed. It never reads a comm's CQ outside a
//! recovery and never fails a comm on its own: a socket that only says
//! "closed" is left to NCCL's next call, which reports it with the
//! requests it concerns (and is not watched again: it would wake the
//! thread after every re-arm).
//!
//! Why a comm is left alone while NCCL calls it: it recovers there anyway,
//! and NCCL's thread should not wait for ours. A call that arrives in the
//! middle of a look does wait for it (microseconds, or at most one
//! `ibv_modify_qp` of the reconnect), on a std lock (`plugin::CommLock`:
//! a parking_lot one would leave NCCL's thread with thread-local state of
//! ours, see `crate::thread`). Profiler events are NCCL's threads' business:
//! the thread is muted, and the stops of the events whose requests its
//! drain completes reach NCCL at the comm's next call (`EventSlots`). Whether NCCL called it is read from the
//! comm's own counters (its CQ polls, its recovery steps), which the keeper
//! compares under the lock from one look to the next: nothing on the data
//! path is added for it.
//!
//! This module is the generic half (registrations, the thread, the
//! schedule); what a look does to a comm is `Comm::keep` and
//! [`super::reconnect::keep`].
use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::thread::BareThread;
use crate::transport::sock::{EventFd, Poller, POLL_BATCH};

/// A comm whose counters did not move for this long is one NCCL is not
/// calling (NCCL polls a comm it waits on every few microseconds).
pub const KEEP_IDLE: Duration = Duration::from_millis(100);
/// How often a recovering comm is moved on (the recovery's own port poll
/// is 50 ms).
pub const KEEP_TICK: Duration = Duration::from_millis(50);

/// What a look at a comm found, and so when to look again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Nothing to do: look again when one of its sockets is readable.
    Quiet,
    /// NCCL is calling it, or it is busy (its lock held, its handshake not
    /// finished): look again after [`KEEP_IDLE`].
    Busy,
    /// It recovers: look again after [`KEEP_TICK`].
    Recovering,
    /// Failed, closed by its peer or not recoverable: not looked at again
    /// (NCCL's next call reports it).
    Done,
}

impl Kept {
    /// Two rails' answers as one (a merged comm): any rail that recovers
    /// keeps the comm looked at, any that is done ends the watch (its
    /// socket would wake the thread for nothing).
    pub fn and(self, o: Kept) -> Kept {
        use Kept::*;
        match (self, o) {
            (Recovering, _) | (_, Recovering) => Recovering,
            (Done, _) | (_, Done) => Done,
            (Busy, _) | (_, Busy) => Busy,
            (Quiet, Quiet) => Quiet,
        }
    }
}

/// Whether NCCL left a comm alone: its call counters as last looked at.
#[derive(Debug, Default)]
pub struct Seen {
    calls: u64,
    since: Option<Instant>,
}

impl Seen {
    /// The comm's counters read `calls` now: has it been left alone for
    /// [`KEEP_IDLE`] (the counters unchanged since a look that long ago)?
    pub fn idle(&mut self, calls: u64, now: Instant) -> bool {
        match self.since {
            Some(t) if self.calls == calls => now.saturating_duration_since(t) >= KEEP_IDLE,
            _ => {
                self.calls = calls;
                self.since = Some(now);
                false
            }
        }
    }

    /// The keeper's own work moved the counters to `calls` (a drain polls
    /// the CQ): not NCCL's call, so the silence goes on.
    pub fn ours(&mut self, calls: u64) {
        self.calls = calls;
    }
}

/// A look at one comm (`Comm::keep` with the comm's address).
pub type Look = Box<dyn FnMut(Instant) -> Kept + Send>;

struct EntryState {
    /// None once deregistered.
    look: Option<Look>,
}

struct Entry {
    fds: Vec<RawFd>,
    st: Mutex<EntryState>,
}

struct Server {
    thread: BareThread,
    wake: Arc<EventFd>,
    stop: Arc<AtomicBool>,
}

struct Keeper {
    entries: HashMap<u64, Arc<Entry>>,
    /// The comms' sockets (one-shot: re-armed after a quiet look) and the
    /// wake-up descriptor (token 0). Registering adds to it directly, so
    /// thousands of comms cost the thread nothing until one has news.
    poller: Arc<Poller>,
    server: Option<Server>,
}

// std's locks: NCCL's threads take them (register, deregister), and a
// parking_lot lock would park them with thread-local state of ours (crate::thread)
static KEEPER: Mutex<Option<Keeper>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A comm's place with the keeper; dropping it (before the comm closes its
/// sockets) waits for a look in progress and ends the watch.
pub struct Registration {
    id: u64,
    entry: Arc<Entry>,
}

/// Watch a comm whose out-of-band sockets are `fds`; `look` is called on
/// the keeper's thread, never after the registration is dropped. `None`:
/// no thread could be started (the comm then recovers only in NCCL's
/// calls, as before; logged once).
pub fn register(fds: Vec<RawFd>, look: Look) -> Option<Registration> {
    let mut g = lock(&KEEPER);
    if g.is_none() {
        *g = Some(start()?);
    }
    let k = g.as_mut()?;
    // (process-wide, never reused: a thread being joined may still look up
    // an id it was woken for, and must not find a newer comm under it)
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    for (n, &fd) in fds.iter().enumerate() {
        if let Err(e) = k.poller.add_fd(fd, id, true) {
            for &f in &fds[..n] {
                k.poller.remove_fd(f);
            }
            drop(g);
            warn_once(e.to_string());
            return None;
        }
    }
    let entry = Arc::new(Entry { fds, st: Mutex::new(EntryState { look: Some(look) }) });
    k.entries.insert(id, entry.clone());
    Some(Registration { id, entry })
}

fn warn_once(e: String) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| tracing::warn!("verbs recovery keeper: {e}; a comm NCCL is not calling recovers only at its next call"));
}

fn start() -> Option<Keeper> {
    let made = (|| -> crate::error::Result<(Arc<Poller>, Arc<EventFd>)> {
        let poller = Arc::new(Poller::new()?);
        let wake = Arc::new(EventFd::new()?);
        poller.add_fd(wake.as_raw_fd(), 0, false)?;
        Ok((poller, wake))
    })();
    let (poller, wake) = match made {
        Ok(x) => x,
        Err(e) => {
            warn_once(format!("no thread ({e})"));
            return None;
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (p2, w2, s2) = (poller.clone(), wake.clone(), stop.clone());
    match BareThread::spawn(c"rustnet-keeper", move || serve(&p2, &w2, &s2)) {
        Ok(thread) => Some(Keeper { entries: HashMap::new(), poller, server: Some(Server { thread, wake, stop }) }),
        Err(e) => {
            warn_once(format!("no thread ({e})"));
            None
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // a look in progress finishes first (it may re-arm the sockets); none starts after
        lock(&self.entry.st).look = None;
        let mut g = lock(&KEEPER);
        let Some(k) = g.as_mut() else { return };
        // (before the comm closes them: a descriptor number reused by a new
        // comm must not carry this one's token)
        for &fd in &self.entry.fds {
            k.poller.remove_fd(fd);
        }
        k.entries.remove(&self.id);
        if !k.entries.is_empty() {
            return;
        }
        let server = g.take().and_then(|mut k| k.server.take());
        drop(g);
        // joined without the lock: the thread takes it for each look
        if let Some(s) = server {
            stop_server(s);
        }
    }
}

fn stop_server(s: Server) {
    s.stop.store(true, Ordering::Release);
    s.wake.notify();
    s.thread.join();
}

/// Stop the thread (the library is unloaded).
///
/// # Safety
/// No comm is alive (no registration is used again).
pub(crate) unsafe fn release() {
    let server = lock(&KEEPER).take().and_then(|mut k| k.server.take());
    if let Some(s) = server {
        stop_server(s);
    }
}

/// Comms registered now (tests).
#[cfg(test)]
pub fn registered() -> usize {
    lock(&KEEPER).as_ref().map_or(0, |k| k.entries.len())
}

fn serve(poller: &Poller, wake: &EventFd, stop: &AtomicBool) {
    crate::profiler::mute_this_thread();
    // when each comm is to be looked at next without a socket event
    let mut due: HashMap<u64, Instant> = HashMap::new();
    let mut out = [0u64; POLL_BATCH];
    loop {
        let next = due.values().min().copied();
        let timeout = match next {
            // rounded up: a wake a little early would find nothing due
            Some(d) => d.saturating_duration_since(Instant::now()).as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
            None => -1,
        };
        let n = match poller.wait(&mut out, timeout) {
            Ok(n) => n,
            Err(e) => {
                // (not expected of a valid epoll set: back off, try again)
                tracing::debug!("verbs recovery keeper: {e}");
                std::thread::sleep(KEEP_TICK);
                0
            }
        };
        if stop.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        for &id in &out[..n] {
            if id == 0 {
                wake.drain();
            } else {
                due.insert(id, now);
            }
        }
        let ready: Vec<u64> = due.iter().filter(|(_, &d)| d <= now).map(|(&id, _)| id).collect();
        for id in ready {
            due.remove(&id);
            let Some(e) = lock(&KEEPER).as_ref().and_then(|k| k.entries.get(&id).cloned()) else { continue };
            let mut st = lock(&e.st);
            let now = Instant::now();
            let Some(look) = st.look.as_mut() else { continue };
            match look(now) {
                Kept::Quiet => {
                    // (under the entry's lock: a deregistration removes them only after)
                    for &fd in &e.fds {
                        let _ = poller.rearm_fd(fd, id);
                    }
                }
                Kept::Busy => {
                    due.insert(id, now + KEEP_IDLE);
                }
                Kept::Recovering => {
                    due.insert(id, now + KEEP_TICK);
                }
                Kept::Done => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::AtomicUsize;

    // the registry is process-wide: these tests take turns
    static SERIAL: Mutex<()> = Mutex::new(());

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let t0 = Instant::now();
        while !f() {
            assert!(t0.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn the_idle_rule_needs_a_silence_of_keep_idle_and_ignores_our_own_work() {
        let t0 = Instant::now();
        let mut s = Seen::default();
        assert!(!s.idle(5, t0), "a first look only starts the clock");
        assert!(!s.idle(5, t0 + KEEP_IDLE / 2), "too soon");
        assert!(s.idle(5, t0 + KEEP_IDLE), "unchanged for KEEP_IDLE");
        s.ours(9);
        assert!(s.idle(9, t0 + KEEP_IDLE + Duration::from_millis(1)), "the keeper's own polls do not restart the silence");
        assert!(!s.idle(10, t0 + 2 * KEEP_IDLE), "NCCL called: the clock starts again");
        assert!(!s.idle(10, t0 + 2 * KEEP_IDLE + KEEP_IDLE / 2));
        assert!(s.idle(10, t0 + 3 * KEEP_IDLE));
    }

    #[test]
    fn answers_of_rails_combine_towards_what_needs_the_most_watching() {
        use Kept::*;
        assert_eq!(Quiet.and(Quiet), Quiet);
        assert_eq!(Quiet.and(Busy), Busy);
        assert_eq!(Busy.and(Done), Done);
        assert_eq!(Done.and(Recovering), Recovering);
        assert_eq!(Recovering.and(Quiet), Recovering);
    }

    /// A readable socket wakes the thread, which looks; a look that says
    /// "recovering" is repeated every tick without an event, and one that
    /// says "quiet" waits for the next event.
    #[test]
    fn a_socket_event_brings_a_look_and_recovering_brings_ticks() {
        let _g = lock(&SERIAL);
        let (mut a, b) = UnixStream::pair().unwrap();
        let looks = Arc::new(AtomicUsize::new(0));
        let recovering = Arc::new(AtomicBool::new(false));
        let (l2, r2) = (looks.clone(), recovering.clone());
        let mut b2 = b.try_clone().unwrap();
        b2.set_nonblocking(true).unwrap();
        let reg = register(
            vec![b.as_raw_fd()],
            Box::new(move |_| {
                l2.fetch_add(1, Ordering::SeqCst);
                let mut buf = [0u8; 16];
                let _ = b2.read(&mut buf);
                if r2.load(Ordering::SeqCst) {
                    Kept::Recovering
                } else {
                    Kept::Quiet
                }
            }),
        )
        .expect("a keeper thread");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(looks.load(Ordering::SeqCst), 0, "nothing readable: no look");
        a.write_all(b"x").unwrap();
        wait_for("a look after a byte", || looks.load(Ordering::SeqCst) == 1);
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(looks.load(Ordering::SeqCst), 1, "quiet, nothing readable: no second look");
        recovering.store(true, Ordering::SeqCst);
        a.write_all(b"y").unwrap();
        wait_for("ticks while recovering", || looks.load(Ordering::SeqCst) >= 6);
        drop(reg);
        let n = looks.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(looks.load(Ordering::SeqCst), n, "no look after the registration is dropped");
        assert_eq!(registered(), 0);
    }

    /// A socket that stays readable (a peer that closed) does not make the
    /// thread spin once a look says "done", and a busy comm is looked at
    /// again only after KEEP_IDLE.
    #[test]
    fn a_done_comm_is_not_looked_at_again_and_a_busy_one_only_after_keep_idle() {
        let _g = lock(&SERIAL);
        let (a, b) = UnixStream::pair().unwrap();
        drop(a); // b is readable (EOF) for good
        let looks = Arc::new(AtomicUsize::new(0));
        let l2 = looks.clone();
        let reg = register(
            vec![b.as_raw_fd()],
            Box::new(move |_| {
                l2.fetch_add(1, Ordering::SeqCst);
                Kept::Done
            }),
        )
        .unwrap();
        wait_for("the first look", || looks.load(Ordering::SeqCst) == 1);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(looks.load(Ordering::SeqCst), 1, "done: never again");
        drop(reg);

        let (c, d) = UnixStream::pair().unwrap();
        drop(c);
        let looks = Arc::new(Mutex::new(Vec::<Instant>::new()));
        let l2 = looks.clone();
        let reg = register(
            vec![d.as_raw_fd()],
            Box::new(move |now| {
                lock(&l2).push(now);
                Kept::Busy
            }),
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(550));
        drop(reg);
        let at = lock(&looks).clone();
        assert!((3..=7).contains(&at.len()), "busy: a look per KEEP_IDLE, not a spin: {}", at.len());
        for w in at.windows(2) {
            assert!(w[1] - w[0] >= KEEP_IDLE, "looks {:?} apart", w[1] - w[0]);
        }
    }

    /// Dropping a registration waits for a look in progress (the comm must
    /// not be freed under it), and the last one stops the thread.
    #[test]
    fn dropping_a_registration_waits_for_its_look_in_progress() {
        let _g = lock(&SERIAL);
        let (mut a, b) = UnixStream::pair().unwrap();
        let inside = Arc::new(AtomicBool::new(false));
        let finished = Arc::new(AtomicBool::new(false));
        let (i2, f2) = (inside.clone(), finished.clone());
        let reg = register(
            vec![b.as_raw_fd()],
            Box::new(move |_| {
                i2.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(300));
                f2.store(true, Ordering::SeqCst);
                Kept::Done
            }),
        )
        .unwrap();
        a.write_all(b"x").unwrap();
        wait_for("the look to start", || inside.load(Ordering::SeqCst));
        drop(reg);
        assert!(finished.load(Ordering::SeqCst), "the drop returned while the look was still running");
        assert_eq!(registered(), 0);
        assert!(lock(&KEEPER).is_none(), "the last registration stops the thread");
    }
}
