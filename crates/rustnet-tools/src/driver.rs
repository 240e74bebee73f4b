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

use rustnet::abi::sys::*;

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
}

/// An opaque pointer the plugin handed out (comm, mhandle, request).
pub type Ptr = *mut c_void;

/// A loaded plugin table of one ABI version.
pub struct Plugin {
    lib: *mut c_void,
    table: Table,
    /// ABI version in use.
    pub version: u32,
}

// SAFETY: the vtable is immutable; the plugin's entry points are thread-safe
// per NCCL's contract (different comms from different threads).
unsafe impl Send for Plugin {}
// SAFETY: &Plugin reads only the immutable vtable and calls entry points
// that NCCL's contract lets several threads call at once (different comms).
unsafe impl Sync for Plugin {}

impl Drop for Plugin {
    fn drop(&mut self) {
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
                v => {
                    libc::dlclose(lib);
                    return Err(format!("unsupported ABI version {v}"));
                }
            }
        };
        Ok(Plugin { lib, table, version })
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

    /// `init` with no logger (the plugin then logs to stderr).
    pub fn init(&self) -> R<()> {
        // SAFETY: calling the plugin's entry point as NCCL does.
        unsafe {
            match self.table {
                Table::V6(t) => ck("init", t.init.unwrap()(None)),
                Table::V7(t) => ck("init", t.init.unwrap()(None)),
                Table::V8(t) => ck("init", t.init.unwrap()(None)),
                Table::V9(t) => ck("init", t.init.unwrap()(None)),
                Table::V10(t) => ck("init", t.init.unwrap()(None, None)),
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
                ($t:expr, $ty:ty, |$p:ident| $ndt:expr, $p2p:expr) => {{
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
                    })
                }};
            }
            match self.table {
                Table::V6(t) => props!(t, ncclNetProperties_v6_t, |p| 0, 0),
                Table::V7(t) => props!(t, ncclNetProperties_v7_t, |p| p.netDeviceType as i32, 0),
                Table::V8(t) => props!(t, ncclNetProperties_v8_t, |p| p.netDeviceType as i32, 0),
                Table::V9(t) => props!(t, ncclNetProperties_v9_t, |p| p.netDeviceType as i32, p.maxP2pBytes),
                Table::V10(t) => props!(t, ncclNetProperties_v10_t, |p| p.netDeviceType as i32, p.maxP2pBytes),
            }
        }
    }

    /// `listen`: the 128-byte handle and the listen comm.
    pub fn listen(&self, dev: i32) -> R<([u8; 128], Ptr)> {
        let mut h = [0u8; 128];
        let mut l: Ptr = std::ptr::null_mut();
        // SAFETY: valid handle buffer and out-pointer.
        call!(self, t => ck("listen", unsafe { t.listen.unwrap()(dev, h.as_mut_ptr() as *mut c_void, &mut l) }))?;
        Ok((h, l))
    }

    /// One `connect` attempt; `None` = call again with the same handle buffer.
    pub fn connect(&self, dev: i32, handle: &mut [u8; 128]) -> R<Option<Ptr>> {
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
        // SAFETY: the caller keeps `data` valid until the request completes.
        unsafe {
            match self.table {
                Table::V6(t) => ck("isend", t.isend.unwrap()(comm, d, len as c_int, tag, mh, &mut r))?,
                Table::V7(t) => ck("isend", t.isend.unwrap()(comm, d, len as c_int, tag, mh, &mut r))?,
                Table::V8(t) => ck("isend", t.isend.unwrap()(comm, d, len as c_int, tag, mh, &mut r))?,
                Table::V9(t) => ck("isend", t.isend.unwrap()(comm, d, len, tag, mh, &mut r))?,
                Table::V10(t) => ck("isend", t.isend.unwrap()(comm, d, len, tag, mh, std::ptr::null_mut(), &mut r))?,
            }
        }
        Ok((!r.is_null()).then_some(r))
    }

    /// `irecv` of `bufs` (ptr, capacity, tag, mhandle); `None` = call again.
    pub fn irecv(&self, comm: Ptr, bufs: &[(*mut u8, usize, i32, Ptr)]) -> R<Option<Ptr>> {
        // fixed arrays, as NCCL's proxy: no allocation per receive (a test
        // harness that allocates distorts latency under emulation)
        const N: usize = rustnet::transport::MAX_RECVS;
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
        // SAFETY: arrays of n entries; buffers kept valid by the caller until completion.
        unsafe {
            match self.table {
                Table::V6(t) => ck("irecv", t.irecv.unwrap()(comm, n, d, isz.as_mut_ptr(), t2, m, &mut r))?,
                Table::V7(t) => ck("irecv", t.irecv.unwrap()(comm, n, d, isz.as_mut_ptr(), t2, m, &mut r))?,
                Table::V8(t) => ck("irecv", t.irecv.unwrap()(comm, n, d, isz.as_mut_ptr(), t2, m, &mut r))?,
                Table::V9(t) => ck("irecv", t.irecv.unwrap()(comm, n, d, usz.as_mut_ptr(), t2, m, &mut r))?,
                Table::V10(t) => ck("irecv", t.irecv.unwrap()(comm, n, d, usz.as_mut_ptr(), t2, m, std::ptr::null_mut(), &mut r))?,
            }
        }
        Ok((!r.is_null()).then_some(r))
    }

    /// `makeVDevice` (ABI v9+): fuse devices `devs` into a new device and
    /// return its index. Older ABIs have no such slot: code 5 (invalid usage).
    pub fn make_vdevice(&self, devs: &[i32]) -> R<i32> {
        // SAFETY: ncclNetVDeviceProps_v9_t is plain data; all-zero is valid.
        let mut props: ncclNetVDeviceProps_v9_t = unsafe { std::mem::zeroed() };
        props.ndevs = devs.len() as c_int;
        for (o, &d) in props.devs.iter_mut().zip(devs) {
            *o = d;
        }
        let mut d: c_int = -1;
        // SAFETY: valid out-pointer and props for the call.
        unsafe {
            match self.table {
                Table::V9(t) => ck("makeVDevice", t.makeVDevice.unwrap()(&mut d, &mut props))?,
                Table::V10(t) => ck("makeVDevice", t.makeVDevice.unwrap()(&mut d, &mut props))?,
                _ => return Err(NcclErr { slot: "makeVDevice", code: 5 }),
            }
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
        call!(self, t => ck("test", unsafe { t.test.unwrap()(req, &mut done, sp) }))?;
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
        let t0 = std::time::Instant::now();
        let (mut s, mut r) = (None, None);
        while s.is_none() || r.is_none() {
            if s.is_none() {
                s = self.connect(dev, peer_handle).map_err(|e| e.to_string())?;
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
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}
