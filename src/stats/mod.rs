//! Per-process statistics while the job runs: `RUSTNET_STATS_DIR` makes a
//! background thread rewrite `<host>-<pid>.prom` there every
//! `RUSTNET_STATS_INTERVAL` seconds, in the Prometheus text format that
//! node_exporter's textfile collector reads, and `rustnet stats DIR`
//! summarises a directory of them (`rustnet_tools::stats_summary`, outside
//! the .so; it reads the files with [`prom::parse`]).
//!
//! The data path only bumps counters: each comm owns a [`CommStats`] of
//! relaxed atomics, bumped by the plugin's isend/irecv/test, and on verbs a
//! [`QpTable`] per QP set, bumped by the comm under its own lock (so with
//! plain loads and stores); nothing there allocates or locks.
//! The registry below is touched when a comm opens or closes and by the
//! writer; a closing comm's counts are folded into per-device totals so the
//! file keeps them.
//!
//! The thread lives while comms are open: the first comm starts it, the
//! last close stops it after one last write (so a short job is captured) and
//! joins it. With no comm open no thread is left, and `dlclose` unloads the
//! library as before; `release`, called at unload, frees what the
//! registry holds. Two things would pin the library in memory after
//! `dlclose` (glibc keeps a library mapped while any thread holds a
//! thread-local destructor registered by it): `std::thread::spawn`, which
//! touches thread-locals with destructors in the *calling* thread (NCCL's,
//! alive for good), and parking_lot, whose parked threads get one. So the
//! writer is a bare pthread ([`crate::thread::BareThread`]), and the locks and the wake-up here are std's
//! (futex-based, no thread-local state); the writer's own thread-locals go
//! with it when it is joined.
pub mod prom;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::sync::{Condvar, Mutex, MutexGuard};

use once_cell::sync::OnceCell;

use prom::Family;

/// A counter bumped on the data path (relaxed: only totals are read).
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Add `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// Add `n` where only one thread ever adds (the comm's, under its lock):
    /// a load and a store instead of a locked read-modify-write; readers
    /// still see whole values.
    #[inline]
    pub fn add_single_writer(&self, n: u64) {
        self.0.store(self.0.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }

    /// The value now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What one QP of a verbs comm carried (a snapshot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QpStat {
    /// Our QP number.
    pub qpn: u32,
    /// Messages (lanes of a message in split mode) that used this QP.
    pub msgs: u64,
    /// Payload bytes this QP carried (data writes only, not CTS/sizes/immediates).
    pub bytes: u64,
}

/// One QP's live counters.
#[derive(Debug)]
pub struct QpCounter {
    /// Our QP number.
    pub qpn: u32,
    /// Messages (lanes) posted on it.
    pub msgs: Counter,
    /// Payload bytes posted on it.
    pub bytes: Counter,
}

/// What a verbs comm asked of its NIC, counted where the calls are made
/// (the comm's own calls, under its lock: single-writer adds): the
/// per-message cost in terms that carry from soft-RoCE to real HCAs.
/// `rustnet stats` divides them by the messages.
#[derive(Debug, Default)]
pub struct Work {
    /// `ibv_post_send` calls (each one doorbell on a real HCA).
    pub doorbells: Counter,
    /// Send WRs in them (data writes, immediates, CTS and credit writes, eager, flush reads).
    pub wrs: Counter,
    /// Of those, the signaled ones (each one CQE to reap).
    pub signaled: Counter,
    /// Receive WRs posted on the data path (`ibv_post_recv` calls, one WR
    /// each: a consumed receive put back; the fill at connect is not counted).
    pub recv_posts: Counter,
    /// `ibv_poll_cq` calls.
    pub polls: Counter,
    /// Of those, the ones that found nothing.
    pub empty_polls: Counter,
    /// Completions reaped.
    pub cqes: Counter,
    /// CTS writes (a receiver's; each WR of a CTS chain, the credit word included).
    pub cts: Counter,
}

/// A [`Work`] read at one moment (also what closed comms add up to).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WorkSnap {
    /// See [`Work`].
    pub doorbells: u64,
    /// See [`Work`].
    pub wrs: u64,
    /// See [`Work`].
    pub signaled: u64,
    /// See [`Work`].
    pub recv_posts: u64,
    /// See [`Work`].
    pub polls: u64,
    /// See [`Work`].
    pub empty_polls: u64,
    /// See [`Work`].
    pub cqes: u64,
    /// See [`Work`].
    pub cts: u64,
}

impl Work {
    /// One `ibv_post_send` of `wrs` WRs, `signaled` of them signaled.
    #[inline]
    pub fn post(&self, wrs: usize, signaled: usize) {
        self.doorbells.add_single_writer(1);
        self.wrs.add_single_writer(wrs as u64);
        self.signaled.add_single_writer(signaled as u64);
    }

    /// One `ibv_poll_cq` that returned `n` completions.
    #[inline]
    pub fn poll(&self, n: usize) {
        self.polls.add_single_writer(1);
        if n == 0 {
            self.empty_polls.add_single_writer(1);
        }
        self.cqes.add_single_writer(n as u64);
    }

    /// The counts now.
    pub fn snapshot(&self) -> WorkSnap {
        WorkSnap {
            doorbells: self.doorbells.get(),
            wrs: self.wrs.get(),
            signaled: self.signaled.get(),
            recv_posts: self.recv_posts.get(),
            polls: self.polls.get(),
            empty_polls: self.empty_polls.get(),
            cqes: self.cqes.get(),
            cts: self.cts.get(),
        }
    }
}

/// The `op` labels of `rustnet_device_verbs_work_total`, in the order of `WorkSnap::ops`.
pub const WORK_OPS: [&str; 8] = ["doorbell", "send_wr", "signaled_wr", "recv_wr", "poll", "empty_poll", "cqe", "cts_write"];

impl WorkSnap {
    /// The `op` label of each counter in the statistics file ([`WORK_OPS`]), with its value.
    pub fn ops(&self) -> [(&'static str, u64); 8] {
        let v = [self.doorbells, self.wrs, self.signaled, self.recv_posts, self.polls, self.empty_polls, self.cqes, self.cts];
        std::array::from_fn(|i| (WORK_OPS[i], v[i]))
    }

    /// Add `o`'s counts.
    pub fn add(&mut self, o: &WorkSnap) {
        self.doorbells += o.doorbells;
        self.wrs += o.wrs;
        self.signaled += o.signaled;
        self.recv_posts += o.recv_posts;
        self.polls += o.polls;
        self.empty_polls += o.empty_polls;
        self.cqes += o.cqes;
        self.cts += o.cts;
    }
}

/// The QP counters of one verbs comm, shared with the writer. Set once the
/// QPs exist (a sender learns them at the end of its handshake). Also what
/// the comm's recoveries did (a recovery replaces the QPs; their counters
/// go on under the first QPs' numbers).
#[derive(Debug, Default)]
pub struct QpTable {
    qps: OnceCell<Box<[QpCounter]>>,
    /// Recoveries the comm completed after a fabric fault.
    pub recoveries: Counter,
    /// Payload bytes they wrote again.
    pub replayed_bytes: Counter,
    /// The last recovery's length, microseconds (0: none yet).
    pub last_recovery_us: AtomicU64,
    /// Of the recoveries, those the recovery keeper thread completed while
    /// NCCL was not calling the comm (its rank away).
    pub unattended: Counter,
    /// What the comm asked of the NIC (its recoveries' QPs included).
    pub work: Work,
}

impl QpTable {
    /// Fix the QP numbers (a second call keeps the first set).
    pub fn set(&self, qpns: impl Iterator<Item = u32>) {
        let _ = self.qps.set(qpns.map(|qpn| QpCounter { qpn, msgs: Counter::default(), bytes: Counter::default() }).collect());
    }

    /// Count one message (lane) of `bytes` on QP `i`. Only the comm's own
    /// calls count (under the comm's lock), so no locked add per message.
    #[inline]
    pub fn bump(&self, i: usize, bytes: u64) {
        if let Some(q) = self.qps.get().and_then(|t| t.get(i)) {
            q.msgs.add_single_writer(1);
            q.bytes.add_single_writer(bytes);
        }
    }

    /// The counts now (empty until the QPs exist).
    pub fn snapshot(&self) -> Vec<QpStat> {
        self.qps
            .get()
            .map_or_else(Vec::new, |t| t.iter().map(|q| QpStat { qpn: q.qpn, msgs: q.msgs.get(), bytes: q.bytes.get() }).collect())
    }
}

/// What one comm's recoveries cost, bumped by its transport when the comm
/// recovers from a fabric fault (never on the data path) and read by the
/// writer. Every comm has one (zero until a recovery), whether or not a
/// statistics file is configured.
#[derive(Debug, Default)]
pub struct RecoveryStats {
    /// Recoveries completed (the comm went on after a reset, a cut link, ...).
    pub recoveries: Counter,
    /// Payload and header bytes sent a second time because the receiver had
    /// not taken them when the connection failed.
    pub replayed_bytes: Counter,
    /// How long the last recovery took, from the fault being noticed to
    /// traffic moving again, in microseconds (0: none yet).
    pub last_us: AtomicU64,
}

impl RecoveryStats {
    /// One recovery that took `took` and sent `replayed` bytes again.
    pub fn record(&self, took: Duration, replayed: u64) {
        self.recoveries.add(1);
        self.replayed_bytes.add(replayed);
        self.last_us.store(took.as_micros().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// The last recovery's duration in seconds (0: none yet).
    pub fn last_seconds(&self) -> f64 {
        self.last_us.load(Ordering::Relaxed) as f64 / 1e6
    }
}

/// Which way a comm moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Way {
    /// A send comm.
    Send,
    /// A receive comm.
    Recv,
}

impl Way {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Way::Send => "send",
            Way::Recv => "recv",
        }
    }
}

/// The counters of one comm.
#[derive(Debug)]
pub struct CommStats {
    /// Number of the comm in this process (the `comm` label).
    pub id: u64,
    /// Send or receive.
    pub way: Way,
    /// `socket` or `ib`.
    pub transport: &'static str,
    /// The device's name as NCCL sees it.
    pub device: String,
    /// The peer's address.
    pub peer: String,
    /// NCCL's communicator id (ABI v11+ `init`'s commId), hex.
    pub nccl_comm: Option<String>,
    /// Requests posted (isend: 1, irecv: one per buffer).
    pub msgs: Counter,
    /// Requests `test` reported done.
    pub completions: Counter,
    /// Payload bytes of completed requests.
    pub bytes: Counter,
    /// Calls on this comm that returned an error.
    pub errors: Counter,
    /// Verbs: the QP counters, with the device of each QP set (a merged
    /// device has one set per member).
    pub qps: Vec<(String, Arc<QpTable>)>,
    /// Its recoveries, shared with the transport's comm.
    pub recovery: Arc<RecoveryStats>,
}

/// Settings of the writer (from the knob table).
#[derive(Debug, Clone)]
struct Setup {
    dir: PathBuf,
    interval: Duration,
    transport: &'static str,
    host: String,
    rank: Option<String>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    msgs: u64,
    completions: u64,
    bytes: u64,
    errors: u64,
    comms: u64,
    recoveries: u64,
    replayed: u64,
    /// Verbs: recoveries the keeper completed for a comm NCCL was not calling.
    unattended: u64,
    /// Verbs work of the comms' QP sets.
    work: WorkSnap,
}

impl Totals {
    /// Count comm `c` in these totals.
    fn add(&mut self, c: &CommStats) {
        self.msgs += c.msgs.get();
        self.completions += c.completions.get();
        self.bytes += c.bytes.get();
        self.errors += c.errors.get();
        self.comms += 1;
        let (n, b) = c.recovered();
        self.recoveries += n;
        self.replayed += b;
        for (_, t) in &c.qps {
            self.work.add(&t.work.snapshot());
            self.unattended += t.unattended.get();
        }
    }
}

impl CommStats {
    /// Recoveries of this comm (every member of a merged device), and the bytes they wrote again.
    fn recovered(&self) -> (u64, u64) {
        // verbs count per member (QP table), TCP per comm (RecoveryStats)
        let tcp = (self.recovery.recoveries.get(), self.recovery.replayed_bytes.get());
        self.qps.iter().fold(tcp, |(n, b), (_, t)| (n + t.recoveries.get(), b + t.replayed_bytes.get()))
    }

    /// The longest of the members' last recoveries, seconds.
    fn last_recovery_s(&self) -> f64 {
        let tcp = self.recovery.last_us.load(Ordering::Relaxed);
        self.qps.iter().map(|(_, t)| t.last_recovery_us.load(Ordering::Relaxed)).fold(tcp, u64::max) as f64 / 1e6
    }
}

struct Registry {
    setup: Option<Setup>,
    live: Vec<Arc<CommStats>>,
    /// Closed comms, per (device, transport, way).
    retired: BTreeMap<(String, &'static str, Way), Totals>,
    next_id: u64,
    start: Option<SystemTime>,
}

static REG: Mutex<Registry> = Mutex::new(Registry { setup: None, live: Vec::new(), retired: BTreeMap::new(), next_id: 0, start: None });

/// A lock of ours (a panic while holding one leaves plain counters: keep going).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serialises starting and stopping the thread (held across the join, so a
/// comm opened meanwhile does not start a second writer on the same file).
static LIFE: Mutex<Option<Writer>> = Mutex::new(None);

/// Set when writing failed once (the WARN is not repeated every interval).
static WARNED: AtomicBool = AtomicBool::new(false);

struct Writer {
    shared: Arc<Shared>,
    thread: crate::thread::BareThread,
}

/// The stop flag and the wake-up of the writer.
struct Shared {
    stop: Mutex<bool>,
    wake: Condvar,
}

/// Launcher variables that carry the rank of this process, most specific
/// first: torchrun, Open MPI, PMIx, MPICH/Hydra and Intel MPI, Slurm. NCCL
/// does not tell a net plugin its rank.
pub const RANK_VARS: [&str; 5] = ["RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"];

/// The rank from the first launcher variable holding an integer.
pub fn rank_from(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    RANK_VARS.iter().find_map(|v| get(v).map(|s| s.trim().to_string()).filter(|s| !s.is_empty() && s.parse::<u64>().is_ok()))
}

/// This host's name.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if r != 0 || n == 0 {
        return "localhost".into();
    }
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// `RUSTNET_STATS_DIR` etc. from `init`: an empty dir turns the file off.
pub fn configure(dir: &str, interval_s: i64, transport: &'static str) {
    let mut r = lock(&REG);
    if dir.is_empty() {
        r.setup = None;
        return;
    }
    r.setup = Some(Setup {
        dir: PathBuf::from(dir),
        interval: Duration::from_secs(interval_s.max(1) as u64),
        transport,
        host: hostname(),
        rank: rank_from(|k| std::env::var(k).ok()),
    });
    tracing::info!(
        "statistics: {} every {interval_s} s (RUSTNET_STATS_DIR, RUSTNET_STATS_INTERVAL)",
        file_path(r.setup.as_ref().unwrap()).display()
    );
}

/// Is a statistics file configured?
pub fn enabled() -> bool {
    lock(&REG).setup.is_some()
}

fn file_path(s: &Setup) -> PathBuf {
    s.dir.join(format!("{}-{}.prom", s.host, std::process::id()))
}

/// Counters for a new comm, registered with the writer (which starts with
/// the first comm); `None` when no statistics file is configured.
pub fn open_comm(
    way: Way,
    transport: &'static str,
    device: String,
    peer: String,
    nccl_comm: Option<String>,
    qps: Vec<(String, Arc<QpTable>)>,
    recovery: Arc<RecoveryStats>,
) -> Option<Arc<CommStats>> {
    let mut life = lock(&LIFE);
    let mut r = lock(&REG);
    r.setup.as_ref()?;
    let id = r.next_id;
    r.next_id += 1;
    let c = Arc::new(CommStats {
        id,
        way,
        transport,
        device,
        peer,
        nccl_comm,
        msgs: Counter::default(),
        completions: Counter::default(),
        bytes: Counter::default(),
        errors: Counter::default(),
        qps,
        recovery,
    });
    r.live.push(c.clone());
    r.start.get_or_insert_with(SystemTime::now);
    drop(r);
    if life.is_none() {
        *life = start_writer();
    }
    Some(c)
}

/// A comm closed: fold its counts into its device's totals; the last one
/// stops the writer after its final write.
pub fn close_comm(c: &Arc<CommStats>) {
    let mut life = lock(&LIFE);
    let mut r = lock(&REG);
    r.live.retain(|x| !Arc::ptr_eq(x, c));
    let t = r.retired.entry((c.device.clone(), c.transport, c.way)).or_default();
    t.add(c);
    let last = r.live.is_empty();
    drop(r);
    if last {
        match life.take() {
            Some(w) => stop_writer(w),
            // no thread (it could not start): at least the close is written
            None => write_now(),
        }
    }
}

fn start_writer() -> Option<Writer> {
    let shared = Arc::new(Shared { stop: Mutex::new(false), wake: Condvar::new() });
    let sh = shared.clone();
    match crate::thread::BareThread::spawn(WRITER_NAME, move || writer_loop(&sh)) {
        Ok(thread) => Some(Writer { shared, thread }),
        Err(e) => {
            tracing::warn!("statistics: could not start the writer thread ({e}); the file is written when the last comm closes");
            None
        }
    }
}

/// The writer thread's name (`/proc/<pid>/task/*/comm`).
pub const WRITER_NAME: &std::ffi::CStr = c"rustnet-stats";

fn stop_writer(w: Writer) {
    *lock(&w.shared.stop) = true;
    w.shared.wake.notify_all();
    w.thread.join();
}

fn writer_loop(sh: &Shared) {
    let _ = std::panic::catch_unwind(write_now);
    let mut stop = lock(&sh.stop);
    loop {
        let interval = lock(&REG).setup.as_ref().map_or(Duration::from_secs(5), |s| s.interval);
        let deadline = std::time::Instant::now() + interval;
        while !*stop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            stop = sh.wake.wait_timeout(stop, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        let last = *stop;
        drop(stop);
        // the last write (on stop) has the closed comm in the totals
        let _ = std::panic::catch_unwind(write_now);
        if last {
            return;
        }
        stop = lock(&sh.stop);
    }
}

/// Render and replace the file now (temp file + rename: a reader never
/// sees half a file). Also what the writer thread calls.
pub fn write_now() {
    let (text, path) = {
        let r = lock(&REG);
        let Some(s) = &r.setup else { return };
        (render(&r, s, SystemTime::now()), file_path(s))
    };
    if let Err(e) = write_atomic(&path, &text) {
        if !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!("statistics: cannot write {}: {e} (RUSTNET_STATS_DIR); not repeated", path.display());
        }
    }
}

fn write_atomic(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    // not *.prom: the textfile collector never reads the temp file
    let tmp = path.with_extension("prom.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn render(r: &Registry, s: &Setup, now: SystemTime) -> String {
    let pid = std::process::id().to_string();
    let mut base: Vec<(&str, &str)> = vec![("host", &s.host), ("pid", &pid)];
    if let Some(rk) = &s.rank {
        base.push(("rank", rk));
    }
    fn join<'a>(base: &[(&'a str, &'a str)], extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        base.iter().chain(extra).copied().collect()
    }
    let mut out = String::with_capacity(4096);
    let ver = env!("CARGO_PKG_VERSION");
    let mut f =
        Family::gauge("rustnet_info", "librustnet in this process: the transport in use (socket or ib) and the library version; always 1.");
    f.sample(&join(&base, &[("transport", s.transport), ("version", ver)]), 1.0);
    f.finish(&mut out);
    let mut f = Family::gauge("rustnet_start_time_seconds", "Unix time this process opened its first comm (the counters start there).");
    f.sample(&base, unix(r.start.unwrap_or(now)));
    f.finish(&mut out);
    let mut f = Family::gauge("rustnet_write_time_seconds", "Unix time of this write of the file.");
    f.sample(&base, unix(now));
    f.finish(&mut out);

    // per device: closed comms plus open ones
    let mut dev: BTreeMap<(String, &'static str, Way), Totals> = r.retired.clone();
    let mut open: BTreeMap<(String, &'static str, Way), u64> = BTreeMap::new();
    for c in &r.live {
        let t = dev.entry((c.device.clone(), c.transport, c.way)).or_default();
        t.add(c);
        *open.entry((c.device.clone(), c.transport, c.way)).or_default() += 1;
    }
    type Get = fn(&Totals) -> u64;
    let dev_metrics: [(&'static str, &'static str, Get); 8] = [
        ("rustnet_device_bytes_total", "Payload bytes of completed requests, per device and direction (closed comms included).", |t| {
            t.bytes
        }),
        ("rustnet_device_messages_total", "Messages posted (isend: 1, irecv: one per buffer), per device and direction.", |t| t.msgs),
        ("rustnet_device_completions_total", "Requests test() reported done, per device and direction.", |t| t.completions),
        ("rustnet_device_errors_total", "Calls that returned an error on a comm of this device, per direction.", |t| t.errors),
        ("rustnet_device_comms_total", "Comms opened on this device, per direction (open and closed).", |t| t.comms),
        (
            "rustnet_device_recoveries_total",
            "Recoveries after a fabric fault completed by comms of this device, per direction (closed comms included).",
            |t| t.recoveries,
        ),
        ("rustnet_device_replayed_bytes_total", "Payload bytes those recoveries wrote again, per device and direction.", |t| t.replayed),
        (
            "rustnet_device_unattended_recoveries_total",
            "Verbs: of those recoveries, the ones the recovery keeper thread completed while NCCL was not calling the comm (its rank away), per device and direction.",
            |t| t.unattended,
        ),
    ];
    for (name, help, get) in dev_metrics {
        let mut f = Family::counter(name, help);
        for ((d, tr, w), t) in &dev {
            f.sample(&join(&base, &[("device", d), ("transport", tr), ("dir", w.as_str())]), get(t) as f64);
        }
        f.finish(&mut out);
    }
    let mut f = Family::counter(
        "rustnet_device_verbs_work_total",
        "What verbs comms asked of the NIC, per device, direction and op (doorbell: ibv_post_send calls; send_wr, signaled_wr, \
         recv_wr: WRs posted; poll, empty_poll: ibv_poll_cq calls, all and empty; cqe: completions reaped; cts_write: CTS writes); \
         divided by rustnet_device_messages_total it is the cost per message.",
    );
    for ((d, tr, w), t) in dev.iter().filter(|(k, _)| k.1 == "ib") {
        for (op, v) in t.work.ops() {
            f.sample(&join(&base, &[("device", d), ("transport", tr), ("dir", w.as_str()), ("op", op)]), v as f64);
        }
    }
    f.finish(&mut out);
    let mut f = Family::gauge("rustnet_device_comms_open", "Comms open now, per device and direction.");
    for (d, tr, w) in dev.keys() {
        let n = open.get(&(d.clone(), *tr, *w)).copied().unwrap_or(0);
        f.sample(&join(&base, &[("device", d), ("transport", tr), ("dir", w.as_str())]), n as f64);
    }
    f.finish(&mut out);

    // per open comm
    let ids: Vec<String> = r.live.iter().map(|c| c.id.to_string()).collect();
    type CGet = fn(&CommStats) -> f64;
    let comm_metrics: [(&'static str, &'static str, bool, CGet); 7] = [
        ("rustnet_comm_bytes_total", "Payload bytes of completed requests on an open comm.", true, |c| c.bytes.get() as f64),
        ("rustnet_comm_messages_total", "Messages posted on an open comm (isend: 1, irecv: one per buffer).", true, |c| {
            c.msgs.get() as f64
        }),
        ("rustnet_comm_completions_total", "Requests test() reported done on an open comm.", true, |c| c.completions.get() as f64),
        ("rustnet_comm_errors_total", "Calls on an open comm that returned an error.", true, |c| c.errors.get() as f64),
        ("rustnet_comm_recoveries_total", "Recoveries after a fabric fault an open comm completed.", true, |c| c.recovered().0 as f64),
        ("rustnet_comm_replayed_bytes_total", "Payload bytes an open comm's recoveries wrote again.", true, |c| c.recovered().1 as f64),
        ("rustnet_comm_last_recovery_seconds", "How long an open comm's last recovery took (0: none yet).", false, |c| c.last_recovery_s()),
    ];
    for (name, help, counter, get) in comm_metrics {
        let mut f = if counter { Family::counter(name, help) } else { Family::gauge(name, help) };
        for (c, id) in r.live.iter().zip(&ids) {
            let mut l = join(
                &base,
                &[("comm", id.as_str()), ("dir", c.way.as_str()), ("peer", &c.peer), ("device", &c.device), ("transport", c.transport)],
            );
            if let Some(n) = &c.nccl_comm {
                l.push(("nccl_comm", n));
            }
            f.sample(&l, get(c));
        }
        f.finish(&mut out);
    }

    // per QP (verbs)
    let mut qb = Family::counter("rustnet_qp_bytes_total", "Payload bytes written on one QP of an open verbs comm (data writes only).");
    let mut qm =
        Family::counter("rustnet_qp_messages_total", "Messages (lanes of a split message) posted on one QP of an open verbs comm.");
    for (c, id) in r.live.iter().zip(&ids) {
        for (d, t) in &c.qps {
            for q in t.snapshot() {
                let qpn = format!("{:#x}", q.qpn);
                let mut l =
                    join(&base, &[("comm", id.as_str()), ("dir", c.way.as_str()), ("device", d), ("qp", &qpn), ("transport", c.transport)]);
                if let Some(n) = &c.nccl_comm {
                    l.push(("nccl_comm", n));
                }
                qb.sample(&l, q.bytes as f64);
                qm.sample(&l, q.msgs as f64);
            }
        }
    }
    qb.finish(&mut out);
    qm.finish(&mut out);
    out += prom::END_MARKER;
    out.push('\n');
    out
}

/// Unload: stop the writer if it still runs and free the registry.
///
/// # Safety
/// No other thread uses the statistics (no comm is alive).
pub(crate) unsafe fn release() {
    if let Some(w) = lock(&LIFE).take() {
        stop_writer(w);
    }
    let mut r = lock(&REG);
    r.setup = None;
    r.live = Vec::new();
    r.retired = BTreeMap::new();
    r.start = None;
    r.next_id = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_comes_from_the_first_launcher_variable_with_an_integer() {
        let env =
            |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        assert_eq!(rank_from(env(&[])), None);
        assert_eq!(rank_from(env(&[("SLURM_PROCID", "7")])), Some("7".into()));
        assert_eq!(rank_from(env(&[("SLURM_PROCID", "1"), ("RANK", "9")])), Some("9".into()));
        assert_eq!(rank_from(env(&[("RANK", "x"), ("PMI_RANK", "3")])), Some("3".into()));
    }

    #[test]
    fn the_file_has_every_family_once_and_parses() {
        let s = Setup {
            dir: "/nonexistent".into(),
            interval: Duration::from_secs(1),
            transport: "ib",
            host: "h1".into(),
            rank: Some("3".into()),
        };
        let qt = Arc::new(QpTable::default());
        qt.set([0x11u32, 0x12].into_iter());
        qt.bump(1, 100);
        qt.bump(1, 50);
        qt.recoveries.add(1);
        qt.replayed_bytes.add(4096);
        qt.last_recovery_us.store(250_000, Ordering::Relaxed);
        qt.unattended.add(1);
        qt.work.post(2, 1);
        qt.work.post(1, 0);
        qt.work.poll(0);
        qt.work.poll(3);
        qt.work.recv_posts.add_single_writer(3);
        qt.work.cts.add_single_writer(1);
        let c = Arc::new(CommStats {
            id: 4,
            way: Way::Send,
            transport: "ib",
            device: "mlx5_0".into(),
            peer: "10.0.0.2:5000".into(),
            nccl_comm: Some("0x00000000deadbeef".into()),
            msgs: Counter::default(),
            completions: Counter::default(),
            bytes: Counter::default(),
            errors: Counter::default(),
            qps: vec![("mlx5_0".into(), qt)],
            recovery: Arc::default(),
        });
        c.msgs.add(2);
        c.completions.add(2);
        c.bytes.add(150);
        let mut retired = BTreeMap::new();
        retired.insert(
            ("mlx5_0".to_string(), "ib", Way::Send),
            Totals {
                msgs: 1,
                completions: 1,
                bytes: 1000,
                errors: 1,
                comms: 1,
                recoveries: 2,
                replayed: 10,
                unattended: 1,
                work: WorkSnap { doorbells: 5, ..WorkSnap::default() },
            },
        );
        let r = Registry { setup: None, live: vec![c], retired, next_id: 5, start: Some(UNIX_EPOCH + Duration::from_secs(100)) };
        let text = render(&r, &s, UNIX_EPOCH + Duration::from_secs(110));
        let e = prom::parse(&text).unwrap();
        assert!(e.complete, "{text}");
        let mut names: Vec<&str> = e.types.iter().map(|t| t.0.as_str()).collect();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a family twice:\n{text}");
        assert!(e.samples.iter().all(|s| s.name.starts_with("rustnet_") && s.label("host") == Some("h1") && s.label("rank") == Some("3")));
        assert_eq!(e.sum("rustnet_device_bytes_total", &[("device", "mlx5_0"), ("dir", "send")]), 1150.0);
        assert_eq!(e.sum("rustnet_device_errors_total", &[]), 1.0);
        assert_eq!(e.sum("rustnet_device_comms_open", &[]), 1.0);
        assert_eq!(e.sum("rustnet_comm_bytes_total", &[("comm", "4"), ("peer", "10.0.0.2:5000")]), 150.0);
        assert_eq!(e.sum("rustnet_qp_bytes_total", &[("qp", "0x12"), ("nccl_comm", "0x00000000deadbeef")]), 150.0);
        assert_eq!(e.sum("rustnet_qp_messages_total", &[("qp", "0x11")]), 0.0);
        assert_eq!(e.sum("rustnet_comm_recoveries_total", &[("comm", "4")]), 1.0);
        assert_eq!(e.sum("rustnet_comm_replayed_bytes_total", &[]), 4096.0);
        assert_eq!(e.first("rustnet_comm_last_recovery_seconds"), Some(0.25));
        assert_eq!(e.sum("rustnet_device_recoveries_total", &[("device", "mlx5_0")]), 3.0, "closed and open comms");
        assert_eq!(e.sum("rustnet_device_replayed_bytes_total", &[]), 4106.0);
        assert_eq!(e.sum("rustnet_device_unattended_recoveries_total", &[("device", "mlx5_0")]), 2.0, "closed and open comms");
        let op = |o: &str| e.sum("rustnet_device_verbs_work_total", &[("device", "mlx5_0"), ("dir", "send"), ("op", o)]);
        assert_eq!(op("doorbell"), 7.0, "open and closed comms");
        assert_eq!((op("send_wr"), op("signaled_wr"), op("recv_wr")), (3.0, 1.0, 3.0));
        assert_eq!((op("poll"), op("empty_poll"), op("cqe"), op("cts_write")), (2.0, 1.0, 3.0, 1.0));
        assert_eq!(e.first("rustnet_write_time_seconds"), Some(110.0));
        assert_eq!(e.first("rustnet_start_time_seconds"), Some(100.0));
    }

    #[test]
    fn tcp_recoveries_are_counted_per_comm_and_device() {
        let s = Setup { dir: "/nonexistent".into(), interval: Duration::from_secs(1), transport: "socket", host: "h1".into(), rank: None };
        let c = Arc::new(CommStats {
            id: 0,
            way: Way::Recv,
            transport: "socket",
            device: "eth0".into(),
            peer: "10.0.0.2:5000".into(),
            nccl_comm: None,
            msgs: Counter::default(),
            completions: Counter::default(),
            bytes: Counter::default(),
            errors: Counter::default(),
            qps: Vec::new(),
            recovery: Arc::default(),
        });
        c.recovery.record(Duration::from_millis(700), 100);
        c.recovery.record(Duration::from_millis(1500), 4096);
        let mut retired = BTreeMap::new();
        retired.insert(("eth0".to_string(), "socket", Way::Recv), Totals { comms: 1, recoveries: 2, replayed: 10, ..Totals::default() });
        let r = Registry { setup: None, live: vec![c.clone()], retired, next_id: 1, start: None };
        let e = prom::parse(&render(&r, &s, UNIX_EPOCH + Duration::from_secs(10))).unwrap();
        assert_eq!(e.sum("rustnet_comm_recoveries_total", &[("comm", "0"), ("peer", "10.0.0.2:5000"), ("dir", "recv")]), 2.0);
        assert_eq!(e.sum("rustnet_comm_replayed_bytes_total", &[("comm", "0")]), 4196.0);
        assert_eq!(e.first("rustnet_comm_last_recovery_seconds"), Some(1.5), "the last one, not the longest");
        assert_eq!(e.sum("rustnet_device_recoveries_total", &[("device", "eth0"), ("dir", "recv"), ("transport", "socket")]), 4.0);
        assert_eq!(e.sum("rustnet_device_replayed_bytes_total", &[("device", "eth0")]), 4206.0);
        // a closed comm's recoveries stay in the device totals
        let mut r = r;
        r.live.clear();
        let t = r.retired.get_mut(&("eth0".to_string(), "socket", Way::Recv)).unwrap();
        let (n, b) = c.recovered();
        (t.recoveries, t.replayed) = (t.recoveries + n, t.replayed + b);
        let e = prom::parse(&render(&r, &s, UNIX_EPOCH + Duration::from_secs(11))).unwrap();
        assert_eq!(e.sum("rustnet_device_recoveries_total", &[("device", "eth0")]), 4.0);
    }
}
