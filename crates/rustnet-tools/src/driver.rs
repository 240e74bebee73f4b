//! A stand-in for NCCL: opens a plugin `.so` by path, looks up one exported
//! `ncclNetPlugin_vN` table and drives it exactly as NCCL's proxy does. The
//! benchmark and the conformance tests use it, so what they measure and check
//! is the real C boundary of the built library.
//!
//! Like NCCL, it passes raw pointers straight to the plugin: comm, request
//! and memory handles (the plugin checks these against its own registry, and
//! the conformance suite hands it stale and garbage ones on purpose) and
//! buffer addresses, which must stay valid for the plugin as NCCL's own
//! contract says (regMr'd memory, alive until `test` reports the request
//! done). The methods are not marked `unsafe` although a wrong buffer
//! address is undefined behaviour, exactly as it is for NCCL: this module is
//! the harness of our tests and bundled tools, not an API for applications,
//! hence the lint exception below.
#![allow(clippy::missing_safety_doc, clippy::not_unsafe_ptr_arg_deref)]
use std::ffi::{c_int, c_void, CStr, CString};
use std::path::Path;

use rustnet::for_tools::sys::*;

/// An `ncclResult_t` other than success, with the slot that returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclErr {
    /// The slot.
    pub slot: &'static str,
    /// The raw code (2 system, 3 internal, 4 invalid argument, 5 invalid usage, 6 remote).
    pub code: i32,
}

impl std::fmt::Display for NcclErr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.code {
            1 => "ncclUnhandledCudaError",
            2 => "ncclSystemError",
            3 => "ncclInternalError",
            4 => "ncclInvalidArgument",
            5 => "ncclInvalidUsage",
            6 => "ncclRemoteError",
            _ => "unknown",
        };
        write!(f, "{} returned {} ({name})", self.slot, self.code)
    }
}

impl std::error::Error for NcclErr {}

/// Result of a driven call.
pub type R<T> = Result<T, NcclErr>;

fn ck(slot: &'static str, r: ncclResult_t) -> R<()> {
    match r {
        ncclResult_t::ncclSuccess => Ok(()),
        other => Err(NcclErr { slot, code: other as i32 }),
    }
}

enum Table {
    V6(&'static ncclNet_v6_t),
    V7(&'static ncclNet_v7_t),
    V8(&'static ncclNet_v8_t),
    V9(&'static ncclNet_v9_t),
    V10(&'static ncclNet_v10_t),
    V11(&'static ncclNet_v11_t),
    V12(&'static ncclNet_v12_t),
}

/// The properties a driver needs, from any version.
#[derive(Debug, Clone)]
pub struct Props {
    /// Device name.
    pub name: String,
    /// PCI path, if any.
    pub pci_path: Option<String>,
    /// NCCL_PTR_* bits.
    pub ptr_support: i32,
    /// Mbps.
    pub speed: i32,
    /// Largest grouped receive.
    pub max_recvs: i32,
    /// netDeviceType (v7+), 0 = HOST.
    pub net_device_type: i32,
    /// maxP2pBytes (v9+), else 0.
    pub max_p2p_bytes: usize,
    /// maxMultiRequestSize (v11+), else 1 (what NCCL assumes for older plugins).
    pub max_multi_request_size: i32,
    /// railId and planeId (v12), else -1 (`NCCL_NET_ID_UNDEF`).
    pub rail_plane: (i16, i16),
}

/// An opaque pointer the plugin handed out (comm, mhandle, request).
pub type Ptr = *mut c_void;

/// A loaded plugin table of one ABI version.
pub struct Plugin {
    lib: *mut c_void,
    table: Table,
    /// ABI version in use.
    pub version: u32,
    /// v11+: the context `init` made, used by `listen`/`connect` (as one
    /// NCCL communicator); finalized on drop.
    ctx: std::sync::atomic::AtomicPtr<c_void>,
    /// Contexts of earlier `init`s, finalized on drop.
    retired: parking_lot::Mutex<Vec<usize>>,
}

/// The communicator id the driver's own context passes to a v11+ `init`.
pub const DRIVER_COMM_ID: u64 = 0x7275_7374_6e65_7401;

// SAFETY: the vtable is immutable; the plugin's entry points are thread-safe
// per NCCL's contract (different comms from different threads).
unsafe impl Send for Plugin {}
// SAFETY: &Plugin reads only the immutable vtable and calls entry points
// that NCCL's contract lets several threads call at once (different comms).
unsafe impl Sync for Plugin {}

impl Drop for Plugin {
    fn drop(&mut self) {
        // as NCCL: the communicator's context ends before the library is closed
        let ctx = self.ctx.swap(std::ptr::null_mut(), std::sync::atomic::Ordering::AcqRel);
        if !ctx.is_null() {
            let _ = self.finalize(ctx);
        }
        for c in std::mem::take(&mut *self.retired.lock()) {
            let _ = self.finalize(c as Ptr);
        }
        // SAFETY: lib came from dlopen and is closed once.
        unsafe { libc::dlclose(self.lib) };
    }
}

macro_rules! call {
    ($self:ident, $t:ident => $e:expr) => {
        match $self.table {
            Table::V6($t) => $e,
            Table::V7($t) => $e,
            Table::V8($t) => $e,
            Table::V9($t) => $e,
            Table::V10($t) => $e,
            Table::V11($t) => $e,
            Table::V12($t) => $e,
        }
    };
}

impl Plugin {
    /// `dlopen(path, RTLD_NOW|RTLD_LOCAL)` (as NCCL does) and find `ncclNetPlugin_v{version}`.
    pub fn open(path: &Path, version: u32) -> Result<Plugin, String> {
        let c = CString::new(path.as_os_str().to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: c is a valid path string.
        let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            // SAFETY: dlerror returns a valid string after a failed dlopen.
            let e = unsafe { CStr::from_ptr(libc::dlerror()) }.to_string_lossy().into_owned();
            return Err(format!("dlopen {}: {e}", path.display()));
        }
        let sym = CString::new(format!("ncclNetPlugin_v{version}")).unwrap();
        // SAFETY: lib is a valid handle, sym a valid name.
        let p = unsafe { libc::dlsym(lib, sym.as_ptr()) };
        if p.is_null() {
            // SAFETY: lib from dlopen.
            unsafe { libc::dlclose(lib) };
            return Err(format!("{} does not export ncclNetPlugin_v{version}", path.display()));
        }
        // SAFETY: the symbol is the vtable of that version (what NCCL assumes too).
        let table = unsafe {
            match version {
                6 => Table::V6(&*(p as *const ncclNet_v6_t)),
                7 => Table::V7(&*(p as *const ncclNet_v7_t)),
                8 => Table::V8(&*(p as *const ncclNet_v8_t)),
                9 => Table::V9(&*(p as *const ncclNet_v9_t)),
                10 => Table::V10(&*(p as *const ncclNet_v10_t)),
                11 => Table::V11(&*(p as *const ncclNet_v11_t)),
                12 => Table::V12(&*(p as *const ncclNet_v12_t)),
                v => {
                    libc::dlclose(lib);
                    return Err(format!("unsupported ABI version {v}"));
                }
            }
        };
        Ok(Plugin { lib, table, version, ctx: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()), retired: Default::default() })
    }

    /// The table's `name`.
    pub fn name(&self) -> String {
        // SAFETY: name points to a static C string in the plugin.
        call!(self, t => unsafe { CStr::from_ptr(t.name) }.to_string_lossy().into_owned())
    }

    /// Names of mandatory slots that are NULL (should be empty).
    pub fn missing_slots(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        macro_rules! chk {
            ($t:ident, $($f:ident),*) => { $( if $t.$f.is_none() { v.push(stringify!($f)); } )* };
        }
        call!(self, t => { chk!(t, init, devices, getProperties, listen, connect, accept, regMr, regMrDmaBuf, deregMr, isend, irecv, iflush, test, closeSend, closeRecv, closeListen); });
        v
    }

    /// `init` with no logger (the plugin then logs to stderr). v11+: the
    /// context it returns is the driver's own, which `listen`/`connect` use.
    pub fn init(&self) -> R<()> {
        // SAFETY: calling the plugin's entry point as NCCL does.
        unsafe {
            match self.table {
                Table::V6(t) => ck("init", t.init.unwrap()(None)),
                Table::V7(t) => ck("init", t.init.unwrap()(None)),
                Table::V8(t) => ck("init", t.init.unwrap()(None)),
                Table::V9(t) => ck("init", t.init.unwrap()(None)),
                Table::V10(t) => ck("init", t.init.unwrap()(None, prof::callback_for_init())),
                Table::V11(_) | Table::V12(_) => {
                    let c = self.init_context(DRIVER_COMM_ID, None)?;
                    let old = self.ctx.swap(c, std::sync::atomic::Ordering::AcqRel);
                    if !old.is_null() {
                        // init again (as NCCL for another communicator): the newer
                        // context serves from now on, the older one ends at drop
                        self.retired.lock().push(old as usize);
                    }
                    Ok(())
                }
            }
        }
    }

    /// Does this table have per-communicator contexts (v11+)?
    pub fn has_contexts(&self) -> bool {
        matches!(self.table, Table::V11(_) | Table::V12(_))
    }

    /// The driver's own context (v11+ after `init`; NULL before and for older versions).
    pub fn context(&self) -> Ptr {
        self.ctx.load(std::sync::atomic::Ordering::Acquire)
    }

    /// v11+ `init` for another communicator: a new context with traffic
    /// class `tc` (`None`: `NCCL_NET_TRAFFIC_CLASS_UNDEF`). Older versions: code 5.
    pub fn init_context(&self, comm_id: u64, tc: Option<i32>) -> R<Ptr> {
        let mut cfg = ncclNetCommConfig_v11_t { trafficClass: tc.unwrap_or(NCCL_NET_TRAFFIC_CLASS_UNDEF) };
        let mut c: Ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer and config for the call.
        unsafe {
            match self.table {
                Table::V11(t) => ck("init", t.init.unwrap()(&mut c, comm_id, &mut cfg, None, prof::callback_for_init()))?,
                Table::V12(t) => ck("init", t.init.unwrap()(&mut c, comm_id, &mut cfg, None, prof::callback_for_init()))?,
                _ => return Err(NcclErr { slot: "init", code: 5 }),
            }
        }
        Ok(c)
    }

    /// v11+ `finalize(ctx)`. Older versions: code 5.
    pub fn finalize(&self, ctx: Ptr) -> R<()> {
        // SAFETY: ctx as NCCL would pass it (checked by the plugin).
        unsafe {
            match self.table {
                Table::V11(t) => ck("finalize", t.finalize.unwrap()(ctx)),
                Table::V12(t) => ck("finalize", t.finalize.unwrap()(ctx)),
                _ => Err(NcclErr { slot: "finalize", code: 5 }),
            }
        }
    }

    /// v11+ `setNetAttr(ctx, attr)`. Older versions: code 5.
    pub fn set_net_attr(&self, ctx: Ptr, attr: &ncclNetAttr_v11_t) -> R<()> {
        let mut a = *attr;
        // SAFETY: a valid attribute struct for the call.
        unsafe {
            match self.table {
                Table::V11(t) => ck("setNetAttr", t.setNetAttr.unwrap()(ctx, &mut a)),
                Table::V12(t) => ck("setNetAttr", t.setNetAttr.unwrap()(ctx, &mut a)),
                _ => Err(NcclErr { slot: "setNetAttr", code: 5 }),
            }
        }
    }

    /// `devices`.
    pub fn devices(&self) -> R<i32> {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        call!(self, t => ck("devices", unsafe { t.devices.unwrap()(&mut n) }))?;
        Ok(n)
    }

    /// `devices(NULL)`: for boundary tests.
    pub fn devices_null(&self) -> R<()> {
        // SAFETY: deliberately NULL; the plugin must reject it.
        call!(self, t => ck("devices", unsafe { t.devices.unwrap()(std::ptr::null_mut()) }))
    }

    /// `getProperties`.
    pub fn properties(&self, dev: i32) -> R<Props> {
        // SAFETY: zeroed props structs are valid; the plugin fills them.
        unsafe {
            let cs = |p: *mut std::ffi::c_char| (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned());
            // one arm per version: the struct type, and the two fields older versions lack
            macro_rules! props {
                ($t:expr, $ty:ty, |$p:ident| $ndt:expr, $p2p:expr, $mmr:expr, $rp:expr) => {{
                    let mut $p: $ty = std::mem::zeroed();
                    ck("getProperties", $t.getProperties.unwrap()(dev, &mut $p))?;
                    Ok(Props {
                        name: cs($p.name).unwrap_or_default(),
                        pci_path: cs($p.pciPath),
                        ptr_support: $p.ptrSupport,
                        speed: $p.speed,
                        max_recvs: $p.maxRecvs,
                        net_device_type: $ndt,
                        max_p2p_bytes: $p2p,
                        max_multi_request_size: $mmr,
                        rail_plane: $rp,
                    })
                }};
            }
            let undef = (-1, -1);
            match self.table {
                Table::V6(t) => props!(t, ncclNetProperties_v6_t, |p| 0, 0, 1, undef),
                Table::V7(t) => props!(t, ncclNetProperties_v7_t, |p| p.netDeviceType as i32, 0, 1, undef),
                Table::V8(t) => props!(t, ncclNetProperties_v8_t, |p| p.netDeviceType as i32, 0, 1, undef),
                Table::V9(t) => props!(t, ncclNetProperties_v9_t, |p| p.netDeviceType as i32, p.maxP2pBytes, 1, undef),
                Table::V10(t) => props!(t, ncclNetProperties_v10_t, |p| p.netDeviceType as i32, p.maxP2pBytes, 1, undef),
                Table::V11(t) => {
                    props!(t, ncclNetProperties_v11_t, |p| p.netDeviceType as i32, p.maxP2pBytes, p.maxMultiRequestSize, undef)
                }
                Table::V12(t) => props!(
                    t,
                    ncclNetProperties_v12_t,
                    |p| p.netDeviceType as i32,
                    p.maxP2pBytes,
                    p.maxMultiRequestSize,
                    (p.railId, p.planeId)
                ),
            }
        }
    }

    /// `listen`: the 128-byte handle and the listen comm (v11+: in the driver's context).
    pub fn listen(&self, dev: i32) -> R<([u8; 128], Ptr)> {
        self.listen_in(self.context(), dev)
    }

    /// `listen` in context `ctx` (v11+; older versions have none and ignore it).
    pub fn listen_in(&self, ctx: Ptr, dev: i32) -> R<([u8; 128], Ptr)> {
        let mut h = [0u8; 128];
        let mut l: Ptr = std::ptr::null_mut();
        let hp = h.as_mut_ptr() as *mut c_void;
        // SAFETY: valid handle buffer and out-pointer.
        unsafe {
            match self.table {
                Table::V6(t) => ck("listen", t.listen.unwrap()(dev, hp, &mut l))?,
                Table::V7(t) => ck("listen", t.listen.unwrap()(dev, hp, &mut l))?,
                Table::V8(t) => ck("listen", t.listen.unwrap()(dev, hp, &mut l))?,
                Table::V9(t) => ck("listen", t.listen.unwrap()(dev, hp, &mut l))?,
                Table::V10(t) => ck("listen", t.listen.unwrap()(dev, hp, &mut l))?,
                Table::V11(t) => ck("listen", t.listen.unwrap()(ctx, dev, hp, &mut l))?,
                Table::V12(t) => ck("listen", t.listen.unwrap()(ctx, dev, hp, &mut l))?,
            }
        }
        Ok((h, l))
    }

    /// One `connect` attempt; `None` = call again with the same handle buffer
    /// (v11+: in the driver's context).
    pub fn connect(&self, dev: i32, handle: &mut [u8; 128]) -> R<Option<Ptr>> {
        self.connect_in(self.context(), dev, handle)
    }

    /// One `connect` attempt in context `ctx` (v11+; older versions ignore it).
    pub fn connect_in(&self, ctx: Ptr, dev: i32, handle: &mut [u8; 128]) -> R<Option<Ptr>> {
        let mut s: Ptr = std::ptr::null_mut();
        let hp = handle.as_mut_ptr() as *mut c_void;
        // SAFETY: valid handle buffer and out-pointers; devComm as NCCL passes it.
        unsafe {
            match self.table {
                Table::V6(t) => ck("connect", t.connect.unwrap()(dev, hp, &mut s))?,
                Table::V7(t) => {
                    let mut d: *mut ncclNetDeviceHandle_v7_t = std::ptr::null_mut();
                    ck("connect", t.connect.unwrap()(dev, hp, &mut s, &mut d))?
                }
                Table::V8(t) => {
                    let mut d: *mut ncclNetDeviceHandle_v8_t = std::ptr::null_mut();
                    ck("connect", t.connect.unwrap()(dev, hp, &mut s, &mut d))?
                }
                Table::V9(t) => {
                    let mut d: *mut ncclNetDeviceHandle_v9_t = std::ptr::null_mut();
                    ck("connect", t.connect.unwrap()(dev, hp, &mut s, &mut d))?
                }
                Table::V10(t) => {
                    let mut cfg = ncclNetCommConfig_v10_t { trafficClass: NCCL_NET_TRAFFIC_CLASS_UNDEF };
                    let mut d: *mut ncclNetDeviceHandle_v10_t = std::ptr::null_mut();
                    ck("connect", t.connect.unwrap()(dev, &mut cfg, hp, &mut s, &mut d))?
                }
                Table::V11(t) => {
                    let mut d: *mut ncclNetDeviceHandle_v11_t = std::ptr::null_mut();
                    ck("connect", t.connect.unwrap()(ctx, dev, hp, &mut s, &mut d))?
                }
                Table::V12(t) => {
                    let mut d: *mut ncclNetDeviceHandle_v12_t = std::ptr::null_mut();
                    ck("connect", t.connect.unwrap()(ctx, dev, hp, &mut s, &mut d))?
                }
            }
        }
        Ok((!s.is_null()).then_some(s))
    }

    /// One `accept` attempt; `None` = call again.
    pub fn accept(&self, l: Ptr) -> R<Option<Ptr>> {
        let mut r: Ptr = std::ptr::null_mut();
        // SAFETY: l from listen; valid out-pointers.
        unsafe {
            match self.table {
                Table::V6(t) => ck("accept", t.accept.unwrap()(l, &mut r))?,
                Table::V7(t) => ck("accept", t.accept.unwrap()(l, &mut r, std::ptr::null_mut()))?,
                Table::V8(t) => ck("accept", t.accept.unwrap()(l, &mut r, std::ptr::null_mut()))?,
                Table::V9(t) => ck("accept", t.accept.unwrap()(l, &mut r, std::ptr::null_mut()))?,
                Table::V10(t) => ck("accept", t.accept.unwrap()(l, &mut r, std::ptr::null_mut()))?,
                Table::V11(t) => ck("accept", t.accept.unwrap()(l, &mut r, std::ptr::null_mut()))?,
                Table::V12(t) => ck("accept", t.accept.unwrap()(l, &mut r, std::ptr::null_mut()))?,
            }
        }
        Ok((!r.is_null()).then_some(r))
    }

    /// `regMr` of host memory.
    pub fn reg_mr(&self, comm: Ptr, data: *mut u8, len: usize) -> R<Ptr> {
        self.reg_mr_typed(comm, data, len, NCCL_PTR_HOST as c_int)
    }

    /// `regMr` with an explicit pointer type.
    pub fn reg_mr_typed(&self, comm: Ptr, data: *mut u8, len: usize, ty: c_int) -> R<Ptr> {
        let mut m: Ptr = std::ptr::null_mut();
        let d = data as *mut c_void;
        // SAFETY: comm from connect/accept, valid out-pointer.
        unsafe {
            match self.table {
                Table::V6(t) => ck("regMr", t.regMr.unwrap()(comm, d, len as c_int, ty, &mut m))?,
                Table::V7(t) => ck("regMr", t.regMr.unwrap()(comm, d, len as c_int, ty, &mut m))?,
                Table::V8(t) => ck("regMr", t.regMr.unwrap()(comm, d, len, ty, &mut m))?,
                Table::V9(t) => ck("regMr", t.regMr.unwrap()(comm, d, len, ty, &mut m))?,
                Table::V10(t) => ck("regMr", t.regMr.unwrap()(comm, d, len, ty, &mut m))?,
                Table::V11(t) => ck("regMr", t.regMr.unwrap()(comm, d, len, ty, &mut m))?,
                Table::V12(t) => ck("regMr", t.regMr.unwrap()(comm, d, len, ty, &mut m))?,
            }
        }
        Ok(m)
    }

    /// `deregMr`.
    pub fn dereg_mr(&self, comm: Ptr, m: Ptr) -> R<()> {
        // SAFETY: m from regMr.
        call!(self, t => ck("deregMr", unsafe { t.deregMr.unwrap()(comm, m) }))
    }

    /// `isend`; `None` = not started, call again.
    pub fn isend(&self, comm: Ptr, data: *mut u8, len: usize, tag: i32, mh: Ptr) -> R<Option<Ptr>> {
        let mut r: Ptr = std::ptr::null_mut();
        let d = data as *mut c_void;
        // v10+: a fresh parent handle per send when the driver's profiler is on
        macro_rules! isend_p {
            ($t:expr) => {{
                let on = prof::mode() != prof::Mode::Off;
                let ph = if on { prof::new_parent(true) } else { std::ptr::null_mut() };
                let res = ck("isend", $t.isend.unwrap()(comm, d, len, tag, mh, ph, &mut r));
                if on {
                    prof::posted((res.is_ok() && !r.is_null()).then_some(r), &[ph]);
                }
                res?
            }};
        }
        // SAFETY: the caller keeps `data` valid until the request completes.
        unsafe {
            match self.table {
                Table::V6(t) => ck("isend", t.isend.unwrap()(comm, d, len as c_int, tag, mh, &mut r))?,
                Table::V7(t) => ck("isend", t.isend.unwrap()(comm, d, len as c_int, tag, mh, &mut r))?,
                Table::V8(t) => ck("isend", t.isend.unwrap()(comm, d, len as c_int, tag, mh, &mut r))?,
                Table::V9(t) => ck("isend", t.isend.unwrap()(comm, d, len, tag, mh, &mut r))?,
                Table::V10(t) => isend_p!(t),
                Table::V11(t) => isend_p!(t),
                Table::V12(t) => isend_p!(t),
            }
        }
        Ok((!r.is_null()).then_some(r))
    }

    /// `irecv` of `bufs` (ptr, capacity, tag, mhandle); `None` = call again.
    pub fn irecv(&self, comm: Ptr, bufs: &[(*mut u8, usize, i32, Ptr)]) -> R<Option<Ptr>> {
        // fixed arrays, as NCCL's proxy: no allocation per receive (a test
        // harness that allocates distorts latency under emulation)
        const N: usize = rustnet::for_tools::transport::MAX_RECVS;
        let k = bufs.len().min(N);
        let n = bufs.len() as c_int;
        let mut data: [*mut c_void; N] = [std::ptr::null_mut(); N];
        let mut isz = [0 as c_int; N];
        let mut usz = [0usize; N];
        let mut tags = [0 as c_int; N];
        let mut mh: [*mut c_void; N] = [std::ptr::null_mut(); N];
        for (i, b) in bufs[..k].iter().enumerate() {
            (data[i], isz[i], usz[i], tags[i], mh[i]) = (b.0 as *mut c_void, b.1 as c_int, b.1, b.2, b.3);
        }
        let mut r: Ptr = std::ptr::null_mut();
        let (d, t2, m) = (data.as_mut_ptr(), tags.as_mut_ptr(), mh.as_mut_ptr());
        // v10+: a fresh parent handle per buffer when the driver's profiler is on
        macro_rules! irecv_p {
            ($t:expr) => {{
                let on = prof::mode() != prof::Mode::Off;
                let mut ph: [*mut c_void; N] = [std::ptr::null_mut(); N];
                if on {
                    ph[..k].iter_mut().for_each(|p| *p = prof::new_parent(false));
                }
                let php = if on { ph.as_mut_ptr() } else { std::ptr::null_mut() };
                let res = ck("irecv", $t.irecv.unwrap()(comm, n, d, usz.as_mut_ptr(), t2, m, php, &mut r));
                if on {
                    prof::posted((res.is_ok() && !r.is_null()).then_some(r), &ph[..k]);
                }
                res?
            }};
        }
        // SAFETY: arrays of n entries; buffers kept valid by the caller until completion.
        unsafe {
            match self.table {
                Table::V6(t) => ck("irecv", t.irecv.unwrap()(comm, n, d, isz.as_mut_ptr(), t2, m, &mut r))?,
                Table::V7(t) => ck("irecv", t.irecv.unwrap()(comm, n, d, isz.as_mut_ptr(), t2, m, &mut r))?,
                Table::V8(t) => ck("irecv", t.irecv.unwrap()(comm, n, d, isz.as_mut_ptr(), t2, m, &mut r))?,
                Table::V9(t) => ck("irecv", t.irecv.unwrap()(comm, n, d, usz.as_mut_ptr(), t2, m, &mut r))?,
                Table::V10(t) => irecv_p!(t),
                Table::V11(t) => irecv_p!(t),
                Table::V12(t) => irecv_p!(t),
            }
        }
        Ok((!r.is_null()).then_some(r))
    }

    /// `makeVDevice` (ABI v9+): fuse devices `devs` into a new device and
    /// return its index. Older ABIs have no such slot: code 5 (invalid usage).
    pub fn make_vdevice(&self, devs: &[i32]) -> R<i32> {
        let mut d: c_int = -1;
        macro_rules! fuse {
            ($t:expr, $ty:ty) => {{
                // SAFETY: the vProps struct is plain data; all-zero is valid.
                let mut props: $ty = unsafe { std::mem::zeroed() };
                props.ndevs = devs.len() as c_int;
                for (o, &x) in props.devs.iter_mut().zip(devs) {
                    *o = x;
                }
                // SAFETY: valid out-pointer and props for the call.
                ck("makeVDevice", unsafe { $t.makeVDevice.unwrap()(&mut d, &mut props) })?
            }};
        }
        match self.table {
            Table::V9(t) => fuse!(t, ncclNetVDeviceProps_v9_t),
            Table::V10(t) => fuse!(t, ncclNetVDeviceProps_v10_t),
            Table::V11(t) => fuse!(t, ncclNetVDeviceProps_v11_t),
            Table::V12(t) => fuse!(t, ncclNetVDeviceProps_v12_t),
            _ => return Err(NcclErr { slot: "makeVDevice", code: 5 }),
        }
        Ok(d)
    }

    /// `iflush` of received buffers; `None` = nothing to flush.
    pub fn iflush(&self, comm: Ptr, bufs: &[(*mut u8, i32, Ptr)]) -> R<Option<Ptr>> {
        let mut data: Vec<*mut c_void> = bufs.iter().map(|b| b.0 as *mut c_void).collect();
        let mut sz: Vec<c_int> = bufs.iter().map(|b| b.1).collect();
        let mut mh: Vec<*mut c_void> = bufs.iter().map(|b| b.2).collect();
        let mut r: Ptr = std::ptr::null_mut();
        // SAFETY: arrays of n entries.
        call!(self, t => ck("iflush", unsafe {
            t.iflush.unwrap()(comm, bufs.len() as c_int, data.as_mut_ptr(), sz.as_mut_ptr(), mh.as_mut_ptr(), &mut r)
        }))?;
        Ok((!r.is_null()).then_some(r))
    }

    /// `test`; `Ok(true)` when done (sizes filled).
    pub fn test(&self, req: Ptr, sizes: &mut [i32]) -> R<bool> {
        let mut done: c_int = 0;
        let sp = if sizes.is_empty() { std::ptr::null_mut() } else { sizes.as_mut_ptr() };
        // SAFETY: req from isend/irecv/iflush; sizes has room for n entries.
        let r = call!(self, t => ck("test", unsafe { t.test.unwrap()(req, &mut done, sp) }));
        match (&r, done) {
            (Err(_), _) => prof::ended(req, "failed"),
            (Ok(()), 1) => prof::ended(req, "done"),
            _ => {}
        }
        r?;
        Ok(done != 0)
    }

    /// `closeSend`.
    pub fn close_send(&self, c: Ptr) -> R<()> {
        // SAFETY: c from connect.
        call!(self, t => ck("closeSend", unsafe { t.closeSend.unwrap()(c) }))
    }

    /// `closeRecv`.
    pub fn close_recv(&self, c: Ptr) -> R<()> {
        // SAFETY: c from accept.
        call!(self, t => ck("closeRecv", unsafe { t.closeRecv.unwrap()(c) }))
    }

    /// `closeListen`.
    pub fn close_listen(&self, c: Ptr) -> R<()> {
        // SAFETY: c from listen.
        call!(self, t => ck("closeListen", unsafe { t.closeListen.unwrap()(c) }))
    }

    /// Connect to `peer_handle` and accept on `listen` together from one
    /// thread (as NCCL may), until both are done or `timeout` passes.
    pub fn connect_accept(
        &self,
        dev: i32,
        peer_handle: &mut [u8; 128],
        listen: Ptr,
        timeout: std::time::Duration,
    ) -> Result<(Ptr, Ptr), String> {
        self.connect_accept_in(self.context(), dev, peer_handle, listen, timeout)
    }

    /// [`Plugin::connect_accept`] with the connect in context `ctx` (v11+).
    pub fn connect_accept_in(
        &self,
        ctx: Ptr,
        dev: i32,
        peer_handle: &mut [u8; 128],
        listen: Ptr,
        timeout: std::time::Duration,
    ) -> Result<(Ptr, Ptr), String> {
        let t0 = std::time::Instant::now();
        let (mut s, mut r) = (None, None);
        while s.is_none() || r.is_none() {
            if s.is_none() {
                s = self.connect_in(ctx, dev, peer_handle).map_err(|e| e.to_string())?;
            }
            if r.is_none() {
                r = self.accept(listen).map_err(|e| e.to_string())?;
            }
            if t0.elapsed() > timeout {
                return Err(format!("connect/accept not done after {timeout:?} (send {}, recv {})", s.is_some(), r.is_some()));
            }
            if s.is_none() || r.is_none() {
                std::thread::yield_now();
            }
        }
        Ok((s.unwrap(), r.unwrap()))
    }
}

/// Where the built plugin lies: `$RUSTNET_PLUGIN`, else `librustnet.so` next
/// to the running executable, one directory up (cargo's `deps/`), or in
/// `../lib` (the `make install` layout: `bin/rustnet`, `lib/librustnet.so`),
/// or in `../lib/<arch>-linux-gnu` (the Debian package: `/usr/bin/rustnet`,
/// `/usr/lib/x86_64-linux-gnu/librustnet.so`).
pub fn default_plugin_path() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("RUSTNET_PLUGIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    let up = dir.parent().map(Path::to_path_buf).unwrap_or_default();
    let multiarch = up.join("lib").join(format!("{}-linux-gnu", std::env::consts::ARCH));
    for d in [dir.clone(), up.clone(), up.join("lib"), multiarch] {
        let p = d.join("librustnet.so");
        if p.exists() {
            return p;
        }
    }
    dir.join("librustnet.so")
}

/// Hex encoding for passing handles between processes.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|c| format!("{c:02x}")).collect()
}

/// Inverse of [`hex`].
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

pub mod prof;
