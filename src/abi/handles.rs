//! The handles NCCL holds (listen comms, send comms, receive comms, memory
//! handles, plugin contexts, requests) and the one checker per kind.
//!
//! Design: a handle is not an address but a number `kind | slot << 4 | gen << 24`
//! naming a slot of a process-wide table; the slot holds the boxed object and
//! a state word `gen << 8 | kind` (kind 0 = free). Looking a handle up reads
//! the table, never the memory the handle names, so a stale handle (double
//! close, use after close, a request of a closed comm), a handle of the wrong
//! kind (closeSend of a receive comm, regMr of a listen comm, deregMr of a
//! comm) or a foreign pointer is rejected with an error naming what it is,
//! without touching freed memory. A closed slot's generation moves on, so a
//! new object in the same slot does not make an old handle valid again (for
//! 2^24 reuses of that slot; requests carry the comm's generation mod 2^16).
//!
//! Why a table and not a set of live addresses: with addresses, the memory
//! of a closed comm is soon reused for the next one, and an old pointer names
//! the new comm (closing it twice closes the new one); and the data path would
//! have to take the set's lock on every call. Here creating and closing take
//! one mutex (not on the data path); `isend`/`irecv`/`test` pay two or three
//! atomic loads of memory that only create/close write (the segment pointer,
//! the slot's state word and object pointer: shared cache lines, no
//! write-sharing between threads) and a compare. Nothing on the data path
//! allocates.
//!
//! The table grows in segments of 1024 slots (up to 1M live handles),
//! allocated under the mutex and freed when the library is unloaded with no
//! handle left ([`teardown`]). A slot is never freed while its handle is
//! live; NCCL's contract (a handle is not used concurrently with its close)
//! is what makes the object behind a checked handle safe to use until the
//! call returns.
use std::ffi::c_void;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::context::NetContext;
use crate::error::{Error, Result};
use crate::plugin::{Comm, Dir, ListenComm, MemHandle};
use crate::proto::pool::ReqId;

/// What a handle names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Listen = 1,
    Send = 2,
    Recv = 3,
    Mr = 4,
    /// A plugin context (ABI v11+ `init`).
    Ctx = 6,
}

/// Tag of request values (never in the table: they name a comm's slot).
const REQ: u64 = 5;

impl Kind {
    fn from_tag(t: u64) -> Option<Kind> {
        match t {
            1 => Some(Kind::Listen),
            2 => Some(Kind::Send),
            3 => Some(Kind::Recv),
            4 => Some(Kind::Mr),
            6 => Some(Kind::Ctx),
            _ => None,
        }
    }
    fn what(self) -> &'static str {
        match self {
            Kind::Listen => "listen comm",
            Kind::Send => "send comm",
            Kind::Recv => "receive comm",
            Kind::Mr => "memory handle",
            Kind::Ctx => "plugin context",
        }
    }
    fn closer(self) -> &'static str {
        match self {
            Kind::Listen => "closeListen",
            Kind::Send => "closeSend",
            Kind::Recv => "closeRecv",
            Kind::Mr => "deregMr",
            Kind::Ctx => "finalize",
        }
    }
}

const SEG_BITS: u32 = 10;
const SEG: usize = 1 << SEG_BITS;
const NSEG: usize = 1024;
const SLOT_BITS: u32 = 20;
const GEN_BITS: u32 = 24;
const GEN_MASK: u64 = (1 << GEN_BITS) - 1;
const REQ_GEN_MASK: u64 = 0xffff;

struct Slot {
    /// `gen << 8 | kind`; kind 0 = free.
    state: AtomicU64,
    obj: AtomicPtr<c_void>,
}

static SEGS: [AtomicPtr<Slot>; NSEG] = [const { AtomicPtr::new(std::ptr::null_mut()) }; NSEG];

struct Alloc {
    /// Freed slots, reused first, oldest first: a slot's generation then
    /// moves on only as often as the whole free list turns over, not on every
    /// open/close of a loop (request values carry 16 bits of it).
    free: std::collections::VecDeque<u32>,
    /// Slots handed out so far (the next fresh one).
    next: u32,
    /// Handles alive now.
    live: usize,
    /// Of them, listen, send and receive comms.
    comms: usize,
    /// The most comms alive at once since the heap was last given back.
    peak: usize,
    /// Set by teardown: no more handles.
    closed: bool,
}

static ALLOC: Mutex<Alloc> =
    Mutex::new(Alloc { free: std::collections::VecDeque::new(), next: 0, live: 0, comms: 0, peak: 0, closed: false });

fn slot(i: u64) -> Option<&'static Slot> {
    let i = i as usize;
    let seg = SEGS.get(i >> SEG_BITS)?.load(Ordering::Acquire);
    // SAFETY: a non-null segment is a live allocation of SEG slots, freed
    // only by teardown when no handle is alive.
    (!seg.is_null()).then(|| unsafe { &*seg.add(i & (SEG - 1)) })
}

fn insert(kind: Kind, obj: *mut c_void) -> Result<u64> {
    let mut a = ALLOC.lock();
    if a.closed {
        return Err(Error::Usage("the plugin is being unloaded".into()));
    }
    let i = match a.free.pop_front() {
        Some(i) => i,
        None => {
            let i = a.next;
            if i as usize >= SEG * NSEG {
                return Err(Error::Usage(format!("more than {} handles alive at once", SEG * NSEG)));
            }
            let s = &SEGS[i as usize >> SEG_BITS];
            if s.load(Ordering::Relaxed).is_null() {
                let seg: Box<[Slot]> =
                    (0..SEG).map(|_| Slot { state: AtomicU64::new(0), obj: AtomicPtr::new(std::ptr::null_mut()) }).collect();
                s.store(Box::into_raw(seg) as *mut Slot, Ordering::Release);
            }
            a.next += 1;
            i
        }
    };
    let sl = slot(i as u64).expect("segment allocated above");
    let gen = match (sl.state.load(Ordering::Relaxed) >> 8) & GEN_MASK {
        0 => 1,
        g => g,
    };
    sl.obj.store(obj, Ordering::Relaxed);
    sl.state.store(gen << 8 | kind as u64, Ordering::Release);
    a.live += 1;
    a.comms += usize::from(matches!(kind, Kind::Listen | Kind::Send | Kind::Recv));
    a.peak = a.peak.max(a.comms);
    Ok(kind as u64 | (i as u64) << 4 | gen << (4 + SLOT_BITS))
}

/// Why `v` is not a live handle of kind `want` (called on the error path only).
fn explain(v: u64, want: Kind, slot_name: &str) -> Error {
    let p = v as *const c_void;
    let Some(k) = Kind::from_tag(v & 0xf) else {
        return Error::InvalidArg(format!("{slot_name}: {p:p} is not a librustnet {}", want.what()));
    };
    if k != want {
        return Error::InvalidArg(format!(
            "{slot_name}: {p:p} is a {}, not a {} ({} is the call for it)",
            k.what(),
            want.what(),
            k.closer()
        ));
    }
    match slot((v >> 4) & ((1 << SLOT_BITS) - 1)) {
        Some(_) if want == Kind::Mr => Error::InvalidArg(format!("{slot_name}: memory handle {p:p} was already deregistered")),
        Some(_) if want == Kind::Ctx => Error::InvalidArg(format!("{slot_name}: plugin context {p:p} was already finalized")),
        Some(_) => Error::InvalidArg(format!("{slot_name}: {} {p:p} was already closed", want.what())),
        None => Error::InvalidArg(format!("{slot_name}: {p:p} is not a librustnet {}", want.what())),
    }
}

/// The object behind a live handle of kind `want`.
#[inline]
fn lookup(v: u64, want: Kind, slot_name: &str) -> Result<*mut c_void> {
    if v & 0xf == want as u64 {
        if let Some(sl) = slot((v >> 4) & ((1 << SLOT_BITS) - 1)) {
            let gen = v >> (4 + SLOT_BITS);
            if sl.state.load(Ordering::Acquire) == (gen << 8 | want as u64) {
                return Ok(sl.obj.load(Ordering::Relaxed));
            }
        }
    }
    Err(explain(v, want, slot_name))
}

/// Take the object out of a live handle of kind `want`; the handle is dead after.
fn remove(v: u64, want: Kind, slot_name: &str) -> Result<*mut c_void> {
    let mut a = ALLOC.lock();
    lookup(v, want, slot_name)?;
    let i = (v >> 4) & ((1 << SLOT_BITS) - 1);
    let sl = slot(i).expect("looked up above");
    let next = match ((v >> (4 + SLOT_BITS)) + 1) & GEN_MASK {
        0 => 1,
        g => g,
    };
    sl.state.store(next << 8, Ordering::Release);
    let obj = sl.obj.swap(std::ptr::null_mut(), Ordering::Relaxed);
    a.free.push_back(i as u32);
    a.live -= 1;
    a.comms -= usize::from(matches!(want, Kind::Listen | Kind::Send | Kind::Recv));
    Ok(obj)
}

fn comm_kind(d: Dir) -> Kind {
    match d {
        Dir::Send => Kind::Send,
        Dir::Recv => Kind::Recv,
    }
}

/// Comms alive at once, at the peak, before the heap is worth giving back
/// when the last one closes: a few comms leave little freed heap, and
/// `malloc_trim` walks the whole heap (a process that opens and closes one
/// comm pair at a time would pay that walk per cycle: under the VM's
/// emulation that made 10000 connect/close cycles run past 10 minutes).
pub(crate) const TRIM_PEAK: usize = 64;

/// True once per "everything closed" after at least [`TRIM_PEAK`] comms
/// were alive at once: the caller gives the freed heap back.
pub(crate) fn heap_trim_due() -> bool {
    let mut a = ALLOC.lock();
    if a.comms == 0 && a.peak >= TRIM_PEAK {
        a.peak = 0;
        return true;
    }
    false
}

/// A new listen comm handle.
pub(crate) fn listen_new(l: ListenComm) -> Result<*mut c_void> {
    let p = Box::into_raw(Box::new(l));
    insert(Kind::Listen, p as *mut c_void).map(|v| v as *mut c_void).inspect_err(|_| {
        // SAFETY: p came from Box::into_raw just above, and insert failed, so
        // no slot holds it: this is its only owner.
        drop(unsafe { Box::from_raw(p) })
    })
}

/// The listen comm behind `h`.
pub(crate) fn listen_ref<'a>(h: *mut c_void, slot_name: &str) -> Result<&'a ListenComm> {
    let p = lookup(h as u64, Kind::Listen, slot_name)? as *const ListenComm;
    // SAFETY: a live listen slot holds a ListenComm box; it is freed only by
    // closeListen, which NCCL does not run concurrently with calls on it.
    Ok(unsafe { &*p })
}

/// Close `h`: the listen comm, for dropping.
pub(crate) fn listen_take(h: *mut c_void, slot_name: &str) -> Result<Box<ListenComm>> {
    let p = remove(h as u64, Kind::Listen, slot_name)? as *mut ListenComm;
    // SAFETY: the slot owned this box and has just given it up.
    Ok(unsafe { Box::from_raw(p) })
}

/// A new send or receive comm handle.
pub(crate) fn comm_new(c: Comm) -> Result<*mut c_void> {
    let k = comm_kind(c.dir());
    let p = Box::into_raw(Box::new(c));
    let v = insert(k, p as *mut c_void).map(|v| v as *mut c_void).inspect_err(|_| {
        // SAFETY: p came from Box::into_raw just above, and insert failed, so
        // no slot holds it: this is its only owner.
        drop(unsafe { Box::from_raw(p) })
    })?;
    // SAFETY: the slot owns the box until comm_take, and close_comm ends
    // the keeper's watch before it takes it; nothing holds a &mut to it.
    unsafe { (*p).start_keeping() };
    Ok(v)
}

/// The comm behind `h`, of either direction.
#[inline]
pub(crate) fn comm_ref<'a>(h: *mut c_void, slot_name: &str) -> Result<&'a Comm> {
    let v = h as u64;
    let want = if v & 0xf == Kind::Recv as u64 { Kind::Recv } else { Kind::Send };
    let p = lookup(v, want, slot_name)? as *const Comm;
    // SAFETY: a live comm slot holds a Comm box; it is freed only by its
    // close, which NCCL does not run concurrently with calls on the comm.
    Ok(unsafe { &*p })
}

/// The comm behind `h`, which must go in direction `d`.
#[inline]
pub(crate) fn comm_ref_dir<'a>(h: *mut c_void, d: Dir, slot_name: &str) -> Result<&'a Comm> {
    let p = lookup(h as u64, comm_kind(d), slot_name)? as *const Comm;
    // SAFETY: lookup checked that `h` names a live comm slot of direction `d`,
    // which holds a Comm box; it is freed only by its close, which NCCL does
    // not run concurrently with calls on the comm.
    Ok(unsafe { &*p })
}

/// Close `h`, which must be a comm of direction `d`.
pub(crate) fn comm_take(h: *mut c_void, d: Dir, slot_name: &str) -> Result<Box<Comm>> {
    let p = remove(h as u64, comm_kind(d), slot_name)? as *mut Comm;
    // SAFETY: the slot owned this box and has just given it up.
    Ok(unsafe { Box::from_raw(p) })
}

/// A new memory handle.
pub(crate) fn mr_new(m: MemHandle) -> Result<*mut c_void> {
    let p = Box::into_raw(Box::new(m));
    insert(Kind::Mr, p as *mut c_void).map(|v| v as *mut c_void).inspect_err(|_| {
        // SAFETY: p came from Box::into_raw just above, and insert failed, so
        // no slot holds it: this is its only owner.
        drop(unsafe { Box::from_raw(p) })
    })
}

/// The registration behind `h`.
#[inline]
pub(crate) fn mr_ref<'a>(h: *mut c_void, slot_name: &str) -> Result<&'a MemHandle> {
    let p = lookup(h as u64, Kind::Mr, slot_name)? as *const MemHandle;
    // SAFETY: a live memory slot holds a MemHandle box, freed only by deregMr,
    // which NCCL calls only once no request uses the registration.
    Ok(unsafe { &*p })
}

/// Deregister `h`.
pub(crate) fn mr_take(h: *mut c_void, slot_name: &str) -> Result<Box<MemHandle>> {
    let p = remove(h as u64, Kind::Mr, slot_name)? as *mut MemHandle;
    // SAFETY: the slot owned this box and has just given it up.
    Ok(unsafe { Box::from_raw(p) })
}

/// A new plugin context handle.
pub(crate) fn ctx_new(c: Arc<NetContext>) -> Result<*mut c_void> {
    let p = Box::into_raw(Box::new(c));
    insert(Kind::Ctx, p as *mut c_void).map(|v| v as *mut c_void).inspect_err(|_| {
        // SAFETY: p came from Box::into_raw just above, and the table refused
        // it, so nothing else holds it: this is its only owner.
        drop(unsafe { Box::from_raw(p) })
    })
}

/// The context behind `h`.
pub(crate) fn ctx_ref<'a>(h: *mut c_void, slot_name: &str) -> Result<&'a Arc<NetContext>> {
    let p = lookup(h as u64, Kind::Ctx, slot_name)? as *const Arc<NetContext>;
    // SAFETY: a live context slot holds an Arc<NetContext> box, freed only by
    // finalize, which NCCL does not run concurrently with calls naming it.
    Ok(unsafe { &*p })
}

/// Finalize `h`: the context, whose handle is dead after.
pub(crate) fn ctx_take(h: *mut c_void, slot_name: &str) -> Result<Arc<NetContext>> {
    let p = remove(h as u64, Kind::Ctx, slot_name)? as *mut Arc<NetContext>;
    // SAFETY: the slot owned this box (a thin pointer to the Arc, which the
    // table needs) and has just given it up.
    Ok(*unsafe { Box::from_raw(p) })
}

/// The request value for request `id` of the comm whose handle is `comm`:
/// `5 | comm slot << 4 | comm gen (16 bits) << 24 | id.slot << 40 | id.gen << 48`.
#[inline]
pub(crate) fn req_encode(comm: *mut c_void, id: ReqId) -> *mut c_void {
    let v = comm as u64;
    let slot_bits = v & (((1 << SLOT_BITS) - 1) << 4);
    let gen = (v >> (4 + SLOT_BITS)) & REQ_GEN_MASK;
    (REQ | slot_bits | gen << 24 | (id.slot as u64) << 40 | (id.gen as u64) << 48) as *mut c_void
}

/// The comm and request id a request value names; the comm is live.
#[inline]
pub(crate) fn req_decode<'a>(r: *mut c_void) -> Result<(&'a Comm, ReqId)> {
    let v = r as u64;
    let bad = || Error::InvalidArg(format!("test: {r:p} is not a librustnet request"));
    if v & 0xf != REQ || v >> 56 != 0 {
        return Err(bad());
    }
    let i = (v >> 4) & ((1 << SLOT_BITS) - 1);
    let sl = slot(i).ok_or_else(bad)?;
    let st = sl.state.load(Ordering::Acquire);
    // one compare: the kind is Send or Recv (they differ in bit 0 only) and
    // the generation is the request's
    const _: () = assert!(Kind::Send as u64 | 1 == Kind::Recv as u64 && Kind::Send as u64 & 1 == 0);
    let want = ((v >> 24) & REQ_GEN_MASK) << 8 | Kind::Send as u64;
    if (st ^ want) & (REQ_GEN_MASK << 8 | 0xfe) != 0 {
        return Err(Error::InvalidArg(format!("test: request {r:p} belongs to a comm that was closed")));
    }
    let id = ReqId { slot: (v >> 40) as u8, gen: (v >> 48) as u8 };
    // SAFETY: the slot's state says it holds a live send or receive comm of the
    // request's generation, i.e. a Comm box, freed only by its close, which
    // NCCL does not run concurrently with test on its requests.
    Ok((unsafe { &*(sl.obj.load(Ordering::Relaxed) as *const Comm) }, id))
}

/// The live comm a comm handle or a request value names, if any (for the
/// boundary to fail it after a panic).
pub(crate) fn comm_of<'a>(v: *mut c_void) -> Option<&'a Comm> {
    match (v as u64) & 0xf {
        REQ => req_decode(v).ok().map(|x| x.0),
        2 | 3 => comm_ref(v, "").ok(),
        _ => None,
    }
}

/// Unload: when no handle is alive, refuse new ones and free the table.
/// Returns false (and keeps everything) when some handle is still alive.
pub(crate) fn teardown() -> bool {
    let mut a = ALLOC.lock();
    if a.live != 0 {
        return false;
    }
    a.closed = true;
    for s in &SEGS {
        let p = s.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if !p.is_null() {
            // SAFETY: allocated in insert as a boxed slice of SEG slots; no
            // handle is alive, so no reference into it remains.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, SEG)) });
        }
    }
    a.free = std::collections::VecDeque::new();
    a.next = 0;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_stay_apart() {
        // a request value never passes as a handle, nor the reverse
        let h = (Kind::Send as u64 | 7 << 4 | 3 << 24) as *mut c_void;
        let r = req_encode(h, ReqId { slot: 9, gen: 200 });
        assert_eq!(r as u64 & 0xf, REQ);
        assert_eq!((r as u64 >> 4) & 0xfffff, 7);
        assert_eq!((r as u64 >> 24) & 0xffff, 3);
        assert_eq!((r as u64 >> 40) & 0xff, 9);
        assert_eq!((r as u64 >> 48) & 0xff, 200);
        assert!(r as u64 >> 56 == 0);
    }

    fn mr() -> MemHandle {
        MemHandle { buf: crate::transport::RawBuf::EMPTY, kind: crate::transport::MemKind::Host, reg: crate::plugin::MemReg::Tcp }
    }

    #[test]
    fn stale_and_wrong_kind_are_named_without_reading_the_object() {
        let h = mr_new(mr()).unwrap();
        assert!(mr_ref(h, "isend").is_ok());
        let e = listen_ref(h, "accept").err().unwrap().to_string();
        assert!(e.contains("is a memory handle, not a listen comm"), "{e}");
        drop(mr_take(h, "deregMr").unwrap());
        let e = mr_take(h, "deregMr").err().unwrap().to_string();
        assert!(e.contains("already deregistered"), "{e}");
        // the slot is reused by the next handle, the old value stays dead
        let h2 = mr_new(mr()).unwrap();
        assert_ne!(h, h2);
        assert!(mr_ref(h, "isend").is_err());
        assert!(mr_ref(h2, "isend").is_ok());
        drop(mr_take(h2, "deregMr").unwrap());
        for junk in [0x10usize, 0xdead_beef, usize::MAX, &h as *const _ as usize] {
            assert!(mr_ref(junk as *mut c_void, "isend").is_err());
            assert!(req_decode(junk as *mut c_void).is_err());
        }
    }

    #[test]
    fn lookup_cost() {
        // what the data path pays per handle check (printed; loose bound)
        let h = mr_new(mr()).unwrap();
        let n = 10_000_000u32;
        let t = std::time::Instant::now();
        for _ in 0..n {
            std::hint::black_box(mr_ref(std::hint::black_box(h), "isend").unwrap());
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!("handle lookup: {ns:.2} ns");
        assert!(ns < 200.0, "a handle lookup costs {ns:.1} ns");
        drop(mr_take(h, "deregMr").unwrap());
    }
}
