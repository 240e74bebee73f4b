//! A stand-in for NCCL's profiler callback (`ncclProfilerCallback`,
//! `src/plugin/profiler.cc` in NCCL), which checks what the plugin reports.
//!
//! With [`enable`] (or `RUSTNET_DRIVER_PROFILER=check|count` in the
//! environment) before `init`, a v10 `init` passes [`callback`] and
//! every isend/irecv passes fresh parent handles (one per request / per
//! receive buffer; never dereferenced). `check` verifies each call: a start
//! names a parent handed out and not yet completed, a known plugin id and a
//! well-formed descriptor whose direction matches the parent's; every stop
//! names an open event; no event is open when `test` reports its request
//! done or failed; no parent gets more than 8 events. `count` only counts (for measuring the cost).
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};

use parking_lot::Mutex;

use rustnet::for_tools::profiler::{IbDescrV1, SockDescrV1, DESCR_TYPE, DESCR_VER, NET_TYPE_IB, NET_TYPE_SOCK};
use rustnet::for_tools::profiler::{OP_RDMA_WRITE, OP_RDMA_WRITE_WITH_IMM, OP_RECV, OP_RECV_RDMA_WITH_IMM, OP_SEND, SOCK_RECV, SOCK_SEND};
use rustnet::for_tools::sys::ncclResult_t;

/// 0 off, 1 count, 2 check (3: not read from the environment yet).
static MODE: AtomicU8 = AtomicU8::new(3);
static STARTS: AtomicU64 = AtomicU64::new(0);
static STOPS: AtomicU64 = AtomicU64::new(0);
static NEXT: AtomicUsize = AtomicUsize::new(1);

/// How the driver's callback works.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No callback: init passes NULL, isend/irecv pass no parents.
    Off,
    /// Count starts and stops only.
    Count,
    /// Check every call (see the module doc).
    Check,
}

/// The mode in force (`RUSTNET_DRIVER_PROFILER` unless set by [`enable`]).
pub fn mode() -> Mode {
    let mut m = MODE.load(Ordering::Relaxed);
    if m == 3 {
        m = match std::env::var("RUSTNET_DRIVER_PROFILER").as_deref() {
            Ok("check") => 2,
            Ok("count") => 1,
            _ => 0,
        };
        MODE.store(m, Ordering::Relaxed);
    }
    match m {
        1 => Mode::Count,
        2 => Mode::Check,
        _ => Mode::Off,
    }
}

/// Choose the mode (before `init`).
pub fn enable(m: Mode) {
    MODE.store(
        match m {
            Mode::Off => 0,
            Mode::Count => 1,
            Mode::Check => 2,
        },
        Ordering::Relaxed,
    );
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Send,
    Recv,
}

struct ParentState {
    dir: Dir,
    done: bool,
    events: u64,
}

#[derive(Default)]
struct State {
    parents: HashMap<usize, ParentState>,
    /// open event handle -> its parent
    open: HashMap<usize, usize>,
    /// request -> its parents
    reqs: HashMap<usize, Vec<usize>>,
    ib: u64,
    sock: u64,
    errors: Vec<String>,
    bytes: u64,
}

static ST: Mutex<Option<State>> = Mutex::new(None);

fn err(st: &mut State, e: String) {
    if st.errors.len() < 20 {
        st.errors.push(e);
    }
}

/// What the callback saw.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Start calls.
    pub starts: u64,
    /// Stop calls.
    pub stops: u64,
    /// Events open now.
    pub open: usize,
    /// QP events (IB descriptors).
    pub ib: u64,
    /// Socket events.
    pub sock: u64,
    /// Sum of the descriptors' lengths.
    pub bytes: u64,
    /// Parents handed out that got at least one event / in all.
    pub parents_with_events: usize,
    /// Parents handed out.
    pub parents: usize,
    /// What the checks found (empty: all well).
    pub errors: Vec<String>,
}

/// The counts so far.
pub fn report() -> Report {
    let g = ST.lock();
    let (open, ib, sock, bytes, pe, pn, errors) = match &*g {
        Some(s) => {
            (s.open.len(), s.ib, s.sock, s.bytes, s.parents.values().filter(|p| p.events > 0).count(), s.parents.len(), s.errors.clone())
        }
        None => (0, 0, 0, 0, 0, 0, Vec::new()),
    };
    Report {
        starts: STARTS.load(Ordering::SeqCst),
        stops: STOPS.load(Ordering::SeqCst),
        open,
        ib,
        sock,
        bytes,
        parents_with_events: pe,
        parents: pn,
        errors,
    }
}

/// A fresh parent handle for a send (or a receive buffer).
pub(crate) fn new_parent(send: bool) -> *mut c_void {
    let v = 0x7e57_0000_0000usize + 16 * NEXT.fetch_add(1, Ordering::Relaxed);
    if mode() == Mode::Check {
        let mut g = ST.lock();
        let st = g.get_or_insert_with(State::default);
        st.parents.insert(v, ParentState { dir: if send { Dir::Send } else { Dir::Recv }, done: false, events: 0 });
    }
    v as *mut c_void
}

/// `req` (None: not taken) was posted with `parents`.
pub(crate) fn posted(req: Option<*mut c_void>, parents: &[*mut c_void]) {
    if mode() != Mode::Check {
        return;
    }
    let mut g = ST.lock();
    let st = g.get_or_insert_with(State::default);
    match req {
        Some(r) => {
            st.reqs.insert(r as usize, parents.iter().map(|p| *p as usize).collect());
        }
        None => {
            // not taken: the parents are never used; an event under one
            // would be an error (the plugin kept a parent it refused)
            for p in parents {
                if let Some(ps) = st.parents.get_mut(&(*p as usize)) {
                    ps.done = true;
                }
            }
        }
    }
}

/// `test` reported `req` done or failed: none of its events may be open.
pub(crate) fn ended(req: *mut c_void, how: &str) {
    if mode() != Mode::Check {
        return;
    }
    let mut g = ST.lock();
    let st = g.get_or_insert_with(State::default);
    let Some(ps) = st.reqs.remove(&(req as usize)) else { return };
    for p in ps {
        let open = st.open.values().filter(|&&x| x == p).count();
        if open > 0 {
            let e = format!("{open} event(s) of parent {p:#x} still open when test reported its request {how}");
            err(st, e);
        }
        if let Some(s) = st.parents.get_mut(&p) {
            s.done = true;
        }
    }
}

/// What `init` passes (v10+): the callback, or NULL when off.
pub(crate) fn callback_for_init() -> rustnet::for_tools::sys::ncclProfilerCallback_t {
    if mode() == Mode::Off {
        None
    } else {
        Some(callback)
    }
}

/// The callback the driver hands to a v10+ `init` (NCCL's signature).
pub extern "C" fn callback(eh: *mut *mut c_void, ty: c_int, ph: *mut c_void, plugin_id: i64, ext: *mut c_void) -> ncclResult_t {
    // never unwind into the plugin
    let r = std::panic::catch_unwind(|| on_call(eh, ty, ph, plugin_id, ext));
    if r.is_err() {
        let mut g = ST.lock();
        err(g.get_or_insert_with(State::default), "the driver's profiler callback panicked".into());
    }
    ncclResult_t::ncclSuccess
}

fn on_call(eh: *mut *mut c_void, ty: c_int, ph: *mut c_void, plugin_id: i64, ext: *mut c_void) {
    let check = mode() == Mode::Check;
    if eh.is_null() {
        let mut g = ST.lock();
        return err(g.get_or_insert_with(State::default), format!("callback type {ty} with a NULL eHandle pointer"));
    }
    match ty {
        0 => {
            STARTS.fetch_add(1, Ordering::SeqCst);
            let h = 0xe000_0000_0000usize + 16 * NEXT.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the plugin passes a valid eHandle out-pointer (checked non-NULL).
            let before = unsafe { std::ptr::replace(eh, h as *mut c_void) };
            if !check {
                return;
            }
            let mut g = ST.lock();
            let st = g.get_or_insert_with(State::default);
            if !before.is_null() {
                err(st, format!("start with *eHandle = {before:p}, not NULL"));
            }
            let dir = match st.parents.get_mut(&(ph as usize)) {
                None => return err(st, format!("start under parent {ph:p}, which the driver never handed out")),
                Some(p) if p.done => return err(st, format!("start under parent {ph:p}, whose request already completed")),
                Some(p) => {
                    p.events += 1;
                    (p.dir, p.events)
                }
            };
            let (dir, n) = dir;
            if n == 9 {
                err(st, format!("a 9th event under parent {ph:p} (NCCL's example profiler keeps 8 per step)"));
            }
            st.open.insert(h, ph as usize);
            if ext.is_null() {
                return err(st, "start without a descriptor".into());
            }
            if plugin_id == NET_TYPE_IB | DESCR_VER {
                // SAFETY: the plugin id says the descriptor is ncclProfilerNetIbDescr_v1_t.
                let d = unsafe { *(ext as *const IbDescrV1) };
                st.ib += 1;
                st.bytes += d.qp.length as u64;
                let ok_op = match dir {
                    Dir::Send => [OP_RDMA_WRITE, OP_RDMA_WRITE_WITH_IMM, OP_SEND].contains(&d.qp.opcode),
                    Dir::Recv => [OP_RECV_RDMA_WITH_IMM, OP_RECV].contains(&d.qp.opcode),
                };
                if d.ty != DESCR_TYPE || !ok_op || d.qp.qp_num == 0 || d.qp.device < 0 {
                    err(st, format!("bad QP descriptor {d:?} for a {} parent", if dir == Dir::Send { "send" } else { "receive" }));
                }
            } else if plugin_id == NET_TYPE_SOCK | DESCR_VER {
                // SAFETY: the plugin id says the descriptor is ncclProfilerNetSockDescr_v1_t.
                let d = unsafe { *(ext as *const SockDescrV1) };
                st.sock += 1;
                st.bytes += d.sock.length as u64;
                let want = if dir == Dir::Send { SOCK_SEND } else { SOCK_RECV };
                if d.ty != DESCR_TYPE || d.sock.op != want || d.sock.fd < 0 {
                    err(st, format!("bad socket descriptor {d:?} (op {want} expected)"));
                }
            } else {
                err(st, format!("unknown plugin id {plugin_id:#x}"));
            }
        }
        1 => {
            STOPS.fetch_add(1, Ordering::SeqCst);
            // SAFETY: eh is non-NULL (checked on entry) and the plugin's
            // stop passes the address of its own live eHandle variable.
            let h = unsafe { *eh } as usize;
            if !check {
                return;
            }
            let mut g = ST.lock();
            let st = g.get_or_insert_with(State::default);
            if !ph.is_null() || plugin_id != 0 || !ext.is_null() {
                err(st, format!("stop with pHandle {ph:p}, pluginId {plugin_id}, extData {ext:p} (NCCL's transports pass NULL, 0, NULL)"));
            }
            if st.open.remove(&h).is_none() {
                err(st, format!("stop of {h:#x}, which is not an open event (no start, or stopped twice)"));
            }
        }
        t => {
            let mut g = ST.lock();
            err(g.get_or_insert_with(State::default), format!("callback type {t}: the plugin only starts and stops"));
        }
    }
}
