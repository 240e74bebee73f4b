//! The system ring of the verbs transport: libibverbs loaded at run time and
//! RAII wrappers over its objects: most of the verbs side's `unsafe` (the
//! rest sits beside the calls it wraps: p2p, rdmacm, topo, comm, vdev, reg,
//! device, notice_path and ib/mod.rs; `git grep -c 'unsafe {' src/transport/ib`),
//! each block with a `// SAFETY:` line.
//!
//! - [`Lib`]: `dlopen("libibverbs.so.1", RTLD_NOW|RTLD_LOCAL)` and `dlvsym`
//!   with the symbol versions NCCL uses (`IBVERBS_1.1`; newer optional entry
//!   points with their own version, absent = feature off). Nothing is linked,
//!   so the plugin loads on hosts without rdma-core.
//! - Lifetimes as types: [`Context`] <- [`Pd`] <- [`Mr`]/[`Qp`], [`Context`] <-
//!   [`Cq`] <- [`Qp`]; each holds an `Arc` of what it depends on, so an object
//!   can never outlive its parent.
//! - QP bring-up is a typestate: [`Qp<Init>`] -> [`Qp<Rtr>`] -> [`Qp<Rts>`].
//! - Posting is `unsafe fn` with a `# Safety` contract: the memory named in a
//!   work request must stay valid and registered until its completion.
//! - `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` are header inlines
//!   that call through `context->ops`; we call the same table.
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::marker::PhantomData;
use std::sync::Arc;

use super::ffi::*;
use crate::error::{Errno, Error, Result};

/// The soname we load (as NCCL does after its own override variable).
pub const LIBIBVERBS: &str = "libibverbs.so.1";

type FnGetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
type FnFreeDeviceList = unsafe extern "C" fn(*mut *mut ibv_device);
type FnGetDeviceName = unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
type FnOpenDevice = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
type FnCloseDevice = unsafe extern "C" fn(*mut ibv_context) -> c_int;
type FnQueryDevice = unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
type FnQueryPort = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
type FnQueryGid = unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
type FnAllocPd = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
type FnDeallocPd = unsafe extern "C" fn(*mut ibv_pd) -> c_int;
type FnRegMr = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
type FnRegMrIova2 = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ibv_mr;
type FnRegDmabufMr = unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
type FnDeregMr = unsafe extern "C" fn(*mut ibv_mr) -> c_int;
type FnCreateCq = unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
type FnDestroyCq = unsafe extern "C" fn(*mut ibv_cq) -> c_int;
type FnCreateQp = unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
type FnModifyQp = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
type FnDestroyQp = unsafe extern "C" fn(*mut ibv_qp) -> c_int;
type FnGetAsyncEvent = unsafe extern "C" fn(*mut ibv_context, *mut ibv_async_event) -> c_int;
type FnAckAsyncEvent = unsafe extern "C" fn(*mut ibv_async_event);
type FnForkInit = unsafe extern "C" fn() -> c_int;
type FnStatusStr = unsafe extern "C" fn(c_uint) -> *const c_char;

/// The resolved entry points of libibverbs.
pub struct Lib {
    get_device_list: FnGetDeviceList,
    free_device_list: FnFreeDeviceList,
    get_device_name: FnGetDeviceName,
    open_device: FnOpenDevice,
    close_device: FnCloseDevice,
    query_device: FnQueryDevice,
    query_port: FnQueryPort,
    query_gid: FnQueryGid,
    alloc_pd: FnAllocPd,
    dealloc_pd: FnDeallocPd,
    reg_mr: FnRegMr,
    dereg_mr: FnDeregMr,
    create_cq: FnCreateCq,
    destroy_cq: FnDestroyCq,
    create_qp: FnCreateQp,
    modify_qp: FnModifyQp,
    destroy_qp: FnDestroyQp,
    get_async_event: FnGetAsyncEvent,
    ack_async_event: FnAckAsyncEvent,
    wc_status_str: FnStatusStr,
    event_type_str: FnStatusStr,
    /// `ibv_reg_mr_iova2` (IBVERBS_1.8): relaxed ordering; None when absent.
    pub reg_mr_iova2: Option<FnRegMrIova2>,
    /// `ibv_reg_dmabuf_mr` (IBVERBS_1.12): dma-buf registration; None when absent.
    pub reg_dmabuf_mr: Option<FnRegDmabufMr>,
}

static LIB: crate::unload::Global<std::result::Result<Lib, String>> = crate::unload::Global::new();

/// Unload: forget why libibverbs could not be loaded. A loaded table stays:
/// the async-event threads (device.rs) may still call through it until
/// they notice their device is gone (libibverbs itself stays loaded, see
/// [`Lib::load`]; the table holds no heap memory).
///
/// # Safety
/// As [`crate::unload::Global::clear`].
pub(crate) unsafe fn release() {
    if matches!(LIB.get(), Some(Err(_))) {
        // SAFETY: our caller guarantees Global::clear's contract (no reference
        // from get is used again); and a failed load gave no thread a table to use.
        unsafe { LIB.clear() };
    }
}

/// The last dlopen/dlsym error of this thread (also for librdmacm).
pub(super) fn dlerror_string() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated thread-local string.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dl error".into()
    } else {
        // SAFETY: non-NULL dlerror result is a valid C string.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// The versioned symbol `name@version` of the library `h` (also for librdmacm).
pub(super) fn sym(h: *mut c_void, name: &str, version: &str) -> Option<*mut c_void> {
    let n = CString::new(name).ok()?;
    let v = CString::new(version).ok()?;
    // SAFETY: h is a live handle from dlopen; n and v are valid C strings.
    let p = unsafe { libc::dlvsym(h, n.as_ptr(), v.as_ptr()) };
    (!p.is_null()).then_some(p)
}

macro_rules! need {
    ($h:expr, $name:literal, $ty:ty) => {{
        let p = sym($h, $name, "IBVERBS_1.1").ok_or_else(|| format!("{LIBIBVERBS} lacks {}@IBVERBS_1.1", $name))?;
        // SAFETY: the symbol is the versioned libibverbs function whose C
        // prototype $ty transcribes from <infiniband/verbs.h>.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
    }};
}

macro_rules! optional {
    ($h:expr, $name:literal, $ver:literal, $ty:ty) => {
        // SAFETY: the symbol is the versioned libibverbs function whose C
        // prototype $ty transcribes from <infiniband/verbs.h>.
        sym($h, $name, $ver).map(|p| unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
    };
}

impl Lib {
    fn load() -> std::result::Result<Lib, String> {
        let so = CString::new(LIBIBVERBS).unwrap();
        // SAFETY: dlopen with a valid C string; the handle is never closed
        // (the function pointers below live for the process).
        let h = unsafe { libc::dlopen(so.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err(format!("cannot load {LIBIBVERBS}: {} (install rdma-core / libibverbs1)", dlerror_string()));
        }
        let lib = Lib {
            get_device_list: need!(h, "ibv_get_device_list", FnGetDeviceList),
            free_device_list: need!(h, "ibv_free_device_list", FnFreeDeviceList),
            get_device_name: need!(h, "ibv_get_device_name", FnGetDeviceName),
            open_device: need!(h, "ibv_open_device", FnOpenDevice),
            close_device: need!(h, "ibv_close_device", FnCloseDevice),
            query_device: need!(h, "ibv_query_device", FnQueryDevice),
            query_port: need!(h, "ibv_query_port", FnQueryPort),
            query_gid: need!(h, "ibv_query_gid", FnQueryGid),
            alloc_pd: need!(h, "ibv_alloc_pd", FnAllocPd),
            dealloc_pd: need!(h, "ibv_dealloc_pd", FnDeallocPd),
            reg_mr: need!(h, "ibv_reg_mr", FnRegMr),
            dereg_mr: need!(h, "ibv_dereg_mr", FnDeregMr),
            create_cq: need!(h, "ibv_create_cq", FnCreateCq),
            destroy_cq: need!(h, "ibv_destroy_cq", FnDestroyCq),
            create_qp: need!(h, "ibv_create_qp", FnCreateQp),
            modify_qp: need!(h, "ibv_modify_qp", FnModifyQp),
            destroy_qp: need!(h, "ibv_destroy_qp", FnDestroyQp),
            get_async_event: need!(h, "ibv_get_async_event", FnGetAsyncEvent),
            ack_async_event: need!(h, "ibv_ack_async_event", FnAckAsyncEvent),
            wc_status_str: need!(h, "ibv_wc_status_str", FnStatusStr),
            event_type_str: need!(h, "ibv_event_type_str", FnStatusStr),
            reg_mr_iova2: optional!(h, "ibv_reg_mr_iova2", "IBVERBS_1.8", FnRegMrIova2),
            reg_dmabuf_mr: optional!(h, "ibv_reg_dmabuf_mr", "IBVERBS_1.12", FnRegDmabufMr),
        };
        if let Some(fork_init) = sym(h, "ibv_fork_init", "IBVERBS_1.1") {
            // SAFETY: ibv_fork_init takes no arguments; it is called once,
            // before any device is opened, as its manual asks.
            let r = unsafe { std::mem::transmute::<*mut c_void, FnForkInit>(fork_init)() };
            if r != 0 {
                tracing::debug!("ibv_fork_init failed ({}); continuing", Errno::last());
            }
        }
        Ok(lib)
    }

    /// The process-wide library, loaded on first use; the error says why not.
    pub fn get() -> std::result::Result<&'static Lib, String> {
        LIB.get_or_init(Lib::load).as_ref().map_err(Clone::clone)
    }

    /// Text of a work-completion status (`ibv_wc_status_str`).
    pub fn wc_status_str(&self, status: ibv_wc_status) -> String {
        // SAFETY: returns a static string for any value ("unknown" otherwise).
        let p = unsafe { (self.wc_status_str)(status) };
        if p.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-NULL static C string from libibverbs.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Text of an async event type (`ibv_event_type_str`).
    pub fn event_type_str(&self, ev: ibv_event_type) -> String {
        // SAFETY: as for wc_status_str.
        let p = unsafe { (self.event_type_str)(ev) };
        if p.is_null() {
            return format!("event {ev}");
        }
        // SAFETY: non-NULL static C string from libibverbs.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Open every RDMA device. `Err` says why none could be listed (e.g.
    /// "ibv_get_device_list: Function not implemented" on kernels without
    /// RDMA); devices that fail to open are returned as `(name, Err)`.
    pub fn open_all(&'static self) -> Result<Vec<(String, Result<Context>)>> {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer; the list is freed below.
        let list = unsafe { (self.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(Error::last_os("ibv_get_device_list"));
        }
        let mut out = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds n valid device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: dev is a live device of the list.
            let np = unsafe { (self.get_device_name)(dev) };
            let name = if np.is_null() {
                format!("device{i}")
            } else {
                // SAFETY: non-NULL device name is a C string owned by the device.
                unsafe { CStr::from_ptr(np) }.to_string_lossy().into_owned()
            };
            // SAFETY: dev is live; opening keeps its own reference, so the
            // context stays valid after the list is freed.
            let ctx = unsafe { (self.open_device)(dev) };
            let r = if ctx.is_null() {
                Err(Error::last_os(format!("ibv_open_device({name})")))
            } else {
                Ok(Context(Arc::new(CtxInner { lib: self, ptr: ctx, name: name.clone() })))
            };
            out.push((name, r));
        }
        // SAFETY: list came from get_device_list and is freed once.
        unsafe { (self.free_device_list)(list) };
        Ok(out)
    }
}

// ---------------------------------------------------------------- context

struct CtxInner {
    lib: &'static Lib,
    ptr: *mut ibv_context,
    name: String,
}

// SAFETY: ibv_context is thread-safe per libibverbs' documented threading
// model (all verbs may be called from any thread).
unsafe impl Send for CtxInner {}
// SAFETY: &CtxInner only hands the context pointer to verbs calls, which
// libibverbs allows from several threads at once (its threading model).
unsafe impl Sync for CtxInner {}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // SAFETY: every child object holds an Arc of this context, so none is alive.
        unsafe { (self.lib.close_device)(self.ptr) };
    }
}

/// An open device.
#[derive(Clone)]
pub struct Context(Arc<CtxInner>);

/// What we read of `ibv_device_attr`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceAttr {
    /// System image GUID (host order).
    pub sys_image_guid: u64,
    /// Node GUID (host order).
    pub node_guid: u64,
    /// Max QPs.
    pub max_qp: i32,
    /// Max WRs per queue.
    pub max_qp_wr: i32,
    /// Max CQ entries.
    pub max_cqe: i32,
    /// Physical ports.
    pub phys_port_cnt: u8,
    /// Vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
}

/// What we read of `ibv_port_attr`.
#[derive(Debug, Clone, Copy)]
pub struct PortAttr {
    /// IBV_PORT_* state.
    pub state: u32,
    /// Active MTU (ibv_mtu enum, 1..5).
    pub active_mtu: u32,
    /// GID table length.
    pub gid_tbl_len: i32,
    /// LID (IB).
    pub lid: u16,
    /// Width code.
    pub active_width: u8,
    /// Speed code.
    pub active_speed: u8,
    /// IBV_LINK_LAYER_*.
    pub link_layer: u8,
}

impl Context {
    /// Device name (`rxe0`, `mlx5_0`).
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The library.
    pub fn lib(&self) -> &'static Lib {
        self.0.lib
    }

    /// The device's `transport_type` (`IBV_TRANSPORT_IB`, `IBV_TRANSPORT_IWARP`, ...).
    pub fn transport_type(&self) -> ibv_transport_type {
        // SAFETY: ptr is a live context; ibv_open_device set its `device`,
        // which libibverbs keeps alive as long as the context.
        unsafe { (*(*self.0.ptr).device).transport_type }
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> Result<DeviceAttr> {
        let mut a = ibv_device_attr::default();
        // SAFETY: live context, valid out-struct.
        let r = unsafe { (self.0.lib.query_device)(self.0.ptr, &mut a) };
        if r != 0 {
            return Err(Error::sys(format!("ibv_query_device({})", self.name()), Errno(if r > 0 { r } else { Errno::last().0 })));
        }
        Ok(DeviceAttr {
            sys_image_guid: u64::from_be(a.sys_image_guid),
            node_guid: u64::from_be(a.node_guid),
            max_qp: a.max_qp,
            max_qp_wr: a.max_qp_wr,
            max_cqe: a.max_cqe,
            phys_port_cnt: a.phys_port_cnt,
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
        })
    }

    /// `ibv_query_port` (the IBVERBS_1.1 entry fills the compat prefix of
    /// the structure; the rest stays zeroed).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut a = ibv_port_attr::default();
        // SAFETY: live context; the struct is at least as large as what the
        // versioned symbol writes, and zero-initialised.
        let r = unsafe { (self.0.lib.query_port)(self.0.ptr, port, &mut a) };
        if r != 0 {
            return Err(Error::sys(format!("ibv_query_port({}:{port})", self.name()), Errno(if r > 0 { r } else { Errno::last().0 })));
        }
        Ok(PortAttr {
            state: a.state,
            active_mtu: a.active_mtu,
            gid_tbl_len: a.gid_tbl_len,
            lid: a.lid,
            active_width: a.active_width,
            active_speed: a.active_speed,
            link_layer: a.link_layer,
        })
    }

    /// `ibv_query_gid`.
    pub fn query_gid(&self, port: u8, index: u32) -> Result<[u8; 16]> {
        let mut g = ibv_gid { raw: [0; 16] };
        // SAFETY: live context, valid out-union.
        let r = unsafe { (self.0.lib.query_gid)(self.0.ptr, port, index as c_int, &mut g) };
        if r != 0 {
            return Err(Error::sys(format!("ibv_query_gid({}:{port}, index {index})", self.name()), Errno::last()));
        }
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Ok(unsafe { g.raw })
    }

    /// Make the async-event file descriptor non-blocking (so the event
    /// thread can poll it and stop when asked).
    pub fn async_fd_nonblocking(&self) -> Result<i32> {
        // SAFETY: live context; async_fd is a plain int field.
        let fd = unsafe { (*self.0.ptr).async_fd };
        // SAFETY: fcntl on the context's own descriptor.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: fcntl on the context's own descriptor, flags it just returned plus O_NONBLOCK.
        if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
            return Err(Error::last_os(format!("fcntl(async_fd of {}, O_NONBLOCK)", self.name())));
        }
        Ok(fd)
    }

    /// One pending async event, acknowledged; `None` when none is queued
    /// (after [`Context::async_fd_nonblocking`]).
    pub fn next_async_event(&self) -> Option<AsyncEvent> {
        // SAFETY: all-zero is a valid ibv_async_event to be filled.
        let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-struct.
        if unsafe { (self.0.lib.get_async_event)(self.0.ptr, &mut ev) } != 0 {
            return None;
        }
        let kind = ev.event_type;
        let detail = match kind {
            IBV_EVENT_PORT_ACTIVE
            | IBV_EVENT_PORT_ERR
            | IBV_EVENT_LID_CHANGE
            | IBV_EVENT_PKEY_CHANGE
            | IBV_EVENT_SM_CHANGE
            | IBV_EVENT_CLIENT_REREGISTER
            | IBV_EVENT_GID_CHANGE => {
                // SAFETY: for port events the union holds port_num.
                AsyncDetail::Port(unsafe { ev.element.port_num } as u8)
            }
            IBV_EVENT_QP_FATAL
            | IBV_EVENT_QP_REQ_ERR
            | IBV_EVENT_QP_ACCESS_ERR
            | IBV_EVENT_COMM_EST
            | IBV_EVENT_SQ_DRAINED
            | IBV_EVENT_PATH_MIG
            | IBV_EVENT_PATH_MIG_ERR
            | IBV_EVENT_QP_LAST_WQE_REACHED => {
                // SAFETY: for QP events the union holds a live QP pointer
                // (alive until the event is acked, which happens below).
                let qp = unsafe { ev.element.qp };
                // SAFETY: a non-null qp here is the live QP the event names (alive
                // until the event is acked, below); qp_num is a plain field.
                AsyncDetail::Qp(if qp.is_null() { 0 } else { unsafe { (*qp).qp_num } })
            }
            IBV_EVENT_DEVICE_FATAL => AsyncDetail::Device,
            _ => AsyncDetail::Other,
        };
        let name = self.0.lib.event_type_str(kind);
        // SAFETY: the event came from get_async_event and is acked exactly once.
        unsafe { (self.0.lib.ack_async_event)(&mut ev) };
        Some(AsyncEvent { kind, name, detail })
    }
}

/// An async event, already acknowledged.
#[derive(Debug, Clone)]
pub struct AsyncEvent {
    /// IBV_EVENT_*.
    pub kind: ibv_event_type,
    /// Its name.
    pub name: String,
    /// What it is about.
    pub detail: AsyncDetail,
}

/// The element an async event names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncDetail {
    /// A port.
    Port(u8),
    /// A QP (by number).
    Qp(u32),
    /// The whole device.
    Device,
    /// Something we do not track (CQ, SRQ, WQ).
    Other,
}

// ---------------------------------------------------------------- PD

struct PdInner {
    ptr: *mut ibv_pd,
    ctx: Context,
}

// SAFETY: PDs are usable from any thread (libibverbs threading model).
unsafe impl Send for PdInner {}
// SAFETY: &PdInner only hands the PD pointer to verbs calls (reg_mr,
// create_qp...), which libibverbs allows from several threads at once.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP holds an Arc of this PD, so none is alive.
        unsafe { (self.ctx.0.lib.dealloc_pd)(self.ptr) };
    }
}

/// A protection domain.
#[derive(Clone)]
pub struct Pd(Arc<PdInner>);

/// Memory access rights of a registration (IBV_ACCESS_* bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Access(pub u32);

impl Access {
    /// Only the local NIC reads it (send buffers).
    pub const LOCAL_READ: Access = Access(0);
    /// The local NIC writes it.
    pub const LOCAL_WRITE: Access = Access(ibv_access_flags::IBV_ACCESS_LOCAL_WRITE);
    /// The peer RDMA-writes it (receive buffers, FIFOs).
    pub const REMOTE_WRITE: Access = Access(ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE);
    /// A loopback QP RDMA-reads it (flush).
    pub const REMOTE_READ: Access = Access(ibv_access_flags::IBV_ACCESS_REMOTE_READ);

    /// Union.
    pub fn with(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }

    /// Does `self` grant everything `o` asks for?
    pub fn covers(self, o: Access) -> bool {
        self.0 & o.0 == o.0
    }
}

impl Pd {
    /// `ibv_alloc_pd`.
    pub fn new(ctx: &Context) -> Result<Pd> {
        // SAFETY: live context.
        let p = unsafe { (ctx.0.lib.alloc_pd)(ctx.0.ptr) };
        if p.is_null() {
            return Err(Error::last_os(format!("ibv_alloc_pd({})", ctx.name())));
        }
        Ok(Pd(Arc::new(PdInner { ptr: p, ctx: ctx.clone() })))
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.0.ctx
    }

    /// Register `[addr, addr+len)` with `access`.
    ///
    /// # Safety
    /// The range must be mapped memory of this process that stays mapped
    /// while the returned `Mr` lives (the NIC reads or writes it at any
    /// time while registered).
    pub unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> Result<Mr> {
        let lib = self.0.ctx.0.lib;
        // SAFETY: live PD; the caller guarantees the range.
        let p = unsafe { (lib.reg_mr)(self.0.ptr, addr as *mut c_void, len, access.0 as c_int) };
        if p.is_null() {
            let e = Errno::last();
            let hint =
                if e.0 == libc::ENOMEM || e.0 == libc::EPERM { " (locked-memory limit too low? try `ulimit -l unlimited`)" } else { "" };
            return Err(Error::sys(
                format!("ibv_reg_mr({:p}, {len} bytes, access {:#x}) on {}{hint}", addr, access.0, self.0.ctx.name()),
                e,
            ));
        }
        // SAFETY: p is a fresh MR.
        let (lkey, rkey) = unsafe { ((*p).lkey, (*p).rkey) };
        Ok(Mr { ptr: p, pd: self.clone(), addr, len, lkey, rkey, access })
    }

    /// NCCL's dma-buf probe on this PD: `ibv_reg_dmabuf_mr(pd, 0, 0, 0,
    /// fd=-1, 0)`. EOPNOTSUPP / EPROTONOSUPPORT mean the device (provider or
    /// kernel driver) cannot; any other failure (EBADF for the bad fd) means
    /// it can. No symbol (rdma-core < 34) is its own answer.
    pub fn probe_dmabuf(&self) -> crate::gpu::DmabufProbe {
        use crate::gpu::DmabufProbe;
        let Some(f) = self.0.ctx.0.lib.reg_dmabuf_mr else { return DmabufProbe::NoSymbol };
        // SAFETY: live PD; fd -1 names no memory, so nothing can be registered
        // (a provider that returns an MR anyway gets it deregistered below).
        let p = unsafe { f(self.0.ptr, 0, 0, 0, -1, 0) };
        if !p.is_null() {
            // SAFETY: p is a fresh MR from this PD, deregistered once.
            unsafe { (self.0.ctx.0.lib.dereg_mr)(p) };
            return DmabufProbe::Supported;
        }
        match Errno::last().0 {
            e if e == libc::EOPNOTSUPP || e == libc::EPROTONOSUPPORT => DmabufProbe::Refused(e),
            _ => DmabufProbe::Supported,
        }
    }

    /// `ibv_reg_dmabuf_mr(pd, offset, len, iova, fd, access)`: register
    /// `len` bytes of the dma-buf `fd` from `offset`, addressed by the NIC as
    /// `[iova, iova+len)` (NCCL passes the buffer's virtual address, so keys
    /// work with ordinary pointers). The MR holds its own reference on the
    /// dma-buf: the caller may close `fd` right after (NCCL does).
    ///
    /// # Safety
    /// The dma-buf's memory must stay allocated while the returned `Mr`
    /// lives (the exporter may move it; the kernel re-pins it for the MR).
    pub unsafe fn reg_dmabuf_mr(&self, offset: u64, len: usize, iova: u64, fd: i32, access: Access) -> Result<Mr> {
        let lib = self.0.ctx.0.lib;
        let Some(f) = lib.reg_dmabuf_mr else {
            return Err(Error::Usage(format!("{LIBIBVERBS} lacks ibv_reg_dmabuf_mr (rdma-core < 34): cannot register dma-buf fd {fd}")));
        };
        // SAFETY: live PD; the kernel validates fd, offset and len against the dma-buf.
        let p = unsafe { f(self.0.ptr, offset, len, iova, fd, access.0 as c_int) };
        if p.is_null() {
            return Err(Error::sys(
                format!(
                    "ibv_reg_dmabuf_mr(fd {fd}, offset {offset}, {len} bytes, iova {iova:#x}, access {:#x}) on {}",
                    access.0,
                    self.0.ctx.name()
                ),
                Errno::last(),
            ));
        }
        // SAFETY: p is a fresh MR.
        let (lkey, rkey) = unsafe { ((*p).lkey, (*p).rkey) };
        Ok(Mr { ptr: p, pd: self.clone(), addr: iova as *mut u8, len, lkey, rkey, access })
    }
}

// ---------------------------------------------------------------- MR

/// A memory registration; deregistered on drop.
pub struct Mr {
    ptr: *mut ibv_mr,
    pd: Pd,
    addr: *mut u8,
    len: usize,
    lkey: u32,
    rkey: u32,
    access: Access,
}

// SAFETY: an MR is an immutable handle once created; libibverbs allows
// using and deregistering it from any thread.
unsafe impl Send for Mr {}
// SAFETY: &Mr reads only the immutable lkey/rkey/access fields and the
// pointer; nothing mutates an MR after creation.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: p came from reg_mr and is deregistered once; the PD is alive (we hold it).
        unsafe { (self.pd.0.ctx.0.lib.dereg_mr)(self.ptr) };
    }
}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// Start address.
    pub fn addr(&self) -> *mut u8 {
        self.addr
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when zero-length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Access rights.
    pub fn access(&self) -> Access {
        self.access
    }
    /// Does the registration cover `[p, p+len)`?
    pub fn covers(&self, p: *const u8, len: usize) -> bool {
        let s = self.addr as usize;
        let a = p as usize;
        a >= s && a.checked_add(len).is_some_and(|e| e <= s + self.len)
    }
}

// ---------------------------------------------------------------- host memory the NIC writes

/// Zeroed host memory registered with the NIC: the FIFO the peer writes
/// its CTS entries into, the sizes slots, staging areas. Rust never takes a
/// reference to its bytes (the NIC may write them at any time): reads are
/// volatile copies, writes go through raw pointers. Its own page-aligned
/// allocation and registration ([`HostRegion::new`]), or a piece of a
/// shared block lent by the device's slab (`slab.rs`, [`HostRegion::lent`]).
pub struct HostRegion {
    ptr: *mut u8,
    len: usize,
    lkey: u32,
    rkey: u32,
    // Fields drop in order: the registration goes before the memory.
    mr: Option<Mr>,
    _mem: Backing,
}

/// Where a region's bytes come from (held for its Drop only).
enum Backing {
    /// Our own page-aligned allocation.
    Own { _alloc: RawAlloc },
    /// Lent: the owner takes the bytes back when dropped (after the
    /// region's own registration, if any: field order of HostRegion).
    Lent { _owner: Box<dyn std::any::Any + Send + Sync> },
}

struct RawAlloc {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Drop for RawAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in HostRegion::new, freed once,
        // after the MR over it was dropped (field order of HostRegion).
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

// SAFETY: a RawAlloc is plain memory owned by this struct, freed once.
unsafe impl Send for RawAlloc {}
// SAFETY: &RawAlloc exposes nothing (the region reaches the bytes).
unsafe impl Sync for RawAlloc {}

// SAFETY: the region is plain memory owned by this struct (or lent to it
// for its lifetime); its bytes are only touched through raw pointers
// (volatile reads, explicit copies).
unsafe impl Send for HostRegion {}
// SAFETY: &HostRegion reaches the bytes only through raw pointers (volatile
// reads, explicit copies), never through references, so concurrent use is
// no data race in Rust's sense; the protocol orders the writers.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Allocate `len` bytes (rounded up to a page) and register them.
    pub fn new(pd: &Pd, len: usize, access: Access) -> Result<HostRegion> {
        let len = len.max(1).div_ceil(4096) * 4096;
        let layout = std::alloc::Layout::from_size_align(len, 4096).map_err(|e| Error::Internal(format!("layout: {e}")))?;
        // SAFETY: non-zero size layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Internal(format!("out of memory allocating {len} bytes")));
        }
        let mem = RawAlloc { ptr, layout };
        // SAFETY: ptr..ptr+len is our allocation, freed only after the MR
        // is dropped (field order).
        let mr = unsafe { pd.reg_mr(ptr, len, access)? };
        Ok(HostRegion { ptr, len, lkey: mr.lkey(), rkey: mr.rkey(), mr: Some(mr), _mem: Backing::Own { _alloc: mem } })
    }

    /// A region over lent memory `[ptr, ptr+len)`: registered by `mr`
    /// (its keys are the region's), or, without one, covered by a
    /// registration with local key `lkey` (rkey 0: no remote access).
    ///
    /// # Safety
    /// The bytes must be zeroed, 8-byte aligned, valid and used by nothing
    /// else until `owner` is dropped; a registration behind `lkey` must
    /// outlive `owner`.
    pub unsafe fn lent(ptr: *mut u8, len: usize, lkey: u32, mr: Option<Mr>, owner: Box<dyn std::any::Any + Send + Sync>) -> HostRegion {
        let (lkey, rkey) = mr.as_ref().map_or((lkey, 0), |m| (m.lkey(), m.rkey()));
        HostRegion { ptr, len, lkey, rkey, mr, _mem: Backing::Lent { _owner: owner } }
    }

    /// Base address.
    pub fn addr(&self) -> *mut u8 {
        self.ptr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Always false (at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Remote key (0: not remotely accessible).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// Its own registration, if it has one (a lent local piece has none).
    pub fn own_mr(&self) -> Option<&Mr> {
        self.mr.as_ref()
    }

    /// Volatile read of the 8-byte word at `off` (a marker the peer writes
    /// last), followed by an acquire fence so later reads see what came before it.
    pub fn read_u64(&self, off: usize) -> u64 {
        assert!(off + 8 <= self.len() && off.is_multiple_of(8));
        // SAFETY: in bounds and aligned (the base is 8-byte aligned); volatile because the NIC writes it.
        let v = unsafe { std::ptr::read_volatile(self.ptr.add(off) as *const u64) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        v
    }

    /// Volatile copy of `out.len()` bytes from `off` (8-byte aligned).
    pub fn read(&self, off: usize, out: &mut [u8]) {
        assert!(off + out.len() <= self.len() && off.is_multiple_of(8) && out.len().is_multiple_of(8));
        for (i, c) in out.chunks_exact_mut(8).enumerate() {
            // SAFETY: in bounds and aligned; volatile because the NIC writes it.
            let w = unsafe { std::ptr::read_volatile(self.ptr.add(off + 8 * i) as *const u64) };
            c.copy_from_slice(&w.to_ne_bytes());
        }
    }

    /// Copy `data` to `off` (staging areas only the local NIC reads).
    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len());
        // SAFETY: in bounds; `data` is a separate Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
}

// ---------------------------------------------------------------- CQ

struct CqInner {
    ptr: *mut ibv_cq,
    ctx: Context,
}

// SAFETY: CQs are usable from any thread; our comms poll each CQ from one thread.
unsafe impl Send for CqInner {}
// SAFETY: &CqInner only hands the CQ pointer to verbs calls, which
// libibverbs allows from several threads (each comm polls its CQ from one).
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc of it, so none is alive.
        unsafe { (self.ctx.0.lib.destroy_cq)(self.ptr) };
    }
}

/// A completion queue.
#[derive(Clone)]
pub struct Cq(Arc<CqInner>);

/// An all-zero work completion, for arrays.
pub fn empty_wc() -> ibv_wc {
    // SAFETY: ibv_wc is plain old data; all-zero is valid.
    unsafe { std::mem::zeroed() }
}

impl Cq {
    /// `ibv_create_cq` with `cqe` entries.
    pub fn new(ctx: &Context, cqe: i32) -> Result<Cq> {
        // SAFETY: live context; no channel, vector 0.
        let p = unsafe { (ctx.0.lib.create_cq)(ctx.0.ptr, cqe, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if p.is_null() {
            return Err(Error::last_os(format!("ibv_create_cq({}, {cqe} entries)", ctx.name())));
        }
        Ok(Cq(Arc::new(CqInner { ptr: p, ctx: ctx.clone() })))
    }

    /// Poll up to `wcs.len()` completions; returns how many were written.
    /// Poll into `buf` (left uninitialized by the caller: no zeroing on
    /// the data path) and return the completions the provider wrote.
    /// (Inlined into the comms' polling loop: an empty poll is the common
    /// case, the errors are built out of line.)
    #[inline(always)]
    pub fn poll_some<'a>(&self, buf: &'a mut [std::mem::MaybeUninit<ibv_wc>]) -> Result<&'a [ibv_wc]> {
        // SAFETY: live CQ; ops.poll_cq is what the ibv_poll_cq inline calls.
        let f = unsafe { (*(*self.0.ptr).context).ops.poll_cq };
        let Some(f) = f else { return Err(no_poll_cq()) };
        // SAFETY: live CQ; buf has room for buf.len() entries, which the
        // provider writes (it never reads them).
        let n = unsafe { f(self.0.ptr, buf.len() as c_int, buf.as_mut_ptr() as *mut ibv_wc) };
        if n < 0 {
            return Err(self.poll_failed());
        }
        let n = (n as usize).min(buf.len());
        // SAFETY: the provider initialized the first n entries.
        Ok(unsafe { std::slice::from_raw_parts(buf.as_ptr() as *const ibv_wc, n) })
    }

    #[cold]
    #[inline(never)]
    fn poll_failed(&self) -> Error {
        Error::sys(format!("ibv_poll_cq on {}", self.0.ctx.name()), Errno(libc::EIO))
    }

    /// Poll into `wcs`; returns how many entries it filled.
    pub fn poll(&self, wcs: &mut [ibv_wc]) -> Result<usize> {
        // SAFETY: live CQ; ops.poll_cq is what the ibv_poll_cq inline calls.
        let f = unsafe { (*(*self.0.ptr).context).ops.poll_cq };
        let Some(f) = f else { return Err(Error::Internal("provider has no poll_cq".into())) };
        // SAFETY: live CQ, wcs valid for wcs.len() entries.
        let n = unsafe { f(self.0.ptr, wcs.len() as c_int, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(Error::sys(format!("ibv_poll_cq on {}", self.0.ctx.name()), Errno(libc::EIO)));
        }
        Ok(n as usize)
    }
}

// ---------------------------------------------------------------- QP

/// QP in INIT: may post receives? No (only from RTR on); may move to RTR.
pub struct Init;
/// QP in RTR: receives may be posted.
pub struct Rtr;
/// QP in RTS: sends may be posted.
pub struct Rts;

struct QpInner {
    ptr: *mut ibv_qp,
    qpn: u32,
    max_inline: u32,
    _pd: Pd,
    _send_cq: Cq,
    _recv_cq: Cq,
}

// SAFETY: QPs are usable from any thread; each comm posts from one thread.
unsafe impl Send for QpInner {}
// SAFETY: &QpInner only hands the QP pointer to verbs calls, which
// libibverbs allows from several threads (each comm posts from one).
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: live QP, destroyed once; PD and CQs outlive it (held here).
        unsafe { (self._pd.0.ctx.0.lib.destroy_qp)(self.ptr) };
    }
}

/// An RC queue pair in state `S`.
pub struct Qp<S> {
    inner: QpInner,
    _s: PhantomData<S>,
}

/// Queue sizes asked for at creation.
#[derive(Debug, Clone, Copy)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Wanted inline size (0 = none); the provider may grant less.
    pub max_inline: u32,
}

/// Where the remote QP is, for RTR.
#[derive(Debug, Clone, Copy)]
pub struct RtrParams {
    /// Remote QP number.
    pub dest_qpn: u32,
    /// Path MTU (ibv_mtu enum).
    pub mtu: u32,
    /// Local port.
    pub port: u8,
    /// Use the GRH (RoCE, or IB across subnets).
    pub global: bool,
    /// Remote GID (when global).
    pub dgid: [u8; 16],
    /// Local GID index.
    pub sgid_index: u8,
    /// Remote LID (IB).
    pub dlid: u16,
    /// Traffic class (GRH).
    pub tc: u8,
    /// Service level.
    pub sl: u8,
}

/// Timeouts for RTS.
#[derive(Debug, Clone, Copy)]
pub struct RtsParams {
    /// Ack timeout exponent (4.096 us * 2^timeout).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
}

impl<S> Qp<S> {
    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// Inline bytes the provider granted.
    pub fn max_inline(&self) -> u32 {
        self.inner.max_inline
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: u32, what: &str) -> Result<()> {
        // SAFETY: live QP, valid attr; mask names the fields we set.
        let r = unsafe { (self.inner._pd.0.ctx.0.lib.modify_qp)(self.inner.ptr, attr, mask as c_int) };
        if r != 0 {
            return Err(Error::sys(
                format!("ibv_modify_qp(QP {:#x} -> {what})", self.inner.qpn),
                Errno(if r > 0 { r } else { Errno::last().0 }),
            ));
        }
        Ok(())
    }

    fn into_state<T>(self) -> Qp<T> {
        Qp { inner: self.inner, _s: PhantomData }
    }

    /// Move to the ERROR state: every outstanding WR completes with
    /// IBV_WC_WR_FLUSH_ERR (used to stop a failed comm).
    pub fn set_error(&self) -> Result<()> {
        let mut a = ibv_qp_attr { qp_state: IBV_QPS_ERR, ..Default::default() };
        self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ERR")
    }
}

impl Qp<Init> {
    /// Create an RC QP on `pd` with both queues on `cq`, and move it to
    /// INIT on `port` with `access` for remote operations.
    pub fn create(pd: &Pd, cq: &Cq, caps: QpCaps, port: u8, pkey_index: u16, access: Access) -> Result<Qp<Init>> {
        let lib = pd.0.ctx.0.lib;
        let mut inline = caps.max_inline;
        let (ptr, granted) = loop {
            let mut ia = ibv_qp_init_attr {
                send_cq: cq.0.ptr,
                recv_cq: cq.0.ptr,
                qp_type: IBV_QPT_RC,
                cap: ibv_qp_cap {
                    max_send_wr: caps.max_send_wr,
                    max_recv_wr: caps.max_recv_wr,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: inline,
                },
                ..Default::default()
            };
            // SAFETY: live PD and CQ; valid init attributes.
            let p = unsafe { (lib.create_qp)(pd.0.ptr, &mut ia) };
            if !p.is_null() {
                break (p, ia.cap.max_inline_data);
            }
            let e = Errno::last();
            if inline > 0 && e.0 == libc::EINVAL {
                // The provider refuses this inline size: ask for less.
                inline = if inline > 64 { inline / 2 } else { 0 };
                continue;
            }
            return Err(Error::sys(
                format!("ibv_create_qp(RC, {} send / {} recv WRs) on {}", caps.max_send_wr, caps.max_recv_wr, pd.0.ctx.name()),
                e,
            ));
        };
        // SAFETY: fresh QP.
        let qpn = unsafe { (*ptr).qp_num };
        let qp = Qp::<Init> {
            inner: QpInner { ptr, qpn, max_inline: granted, _pd: pd.clone(), _send_cq: cq.clone(), _recv_cq: cq.clone() },
            _s: PhantomData,
        };
        let mut a = ibv_qp_attr { qp_state: IBV_QPS_INIT, pkey_index, port_num: port, qp_access_flags: access.0, ..Default::default() };
        use ibv_qp_attr_mask::*;
        qp.modify(&mut a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT")?;
        Ok(qp)
    }

    /// INIT -> RTR: point the QP at its peer.
    pub fn to_rtr(self, p: &RtrParams) -> Result<Qp<Rtr>> {
        self.try_rtr(p).map_err(|(_, e)| e)
    }

    /// [`Self::to_rtr`], giving the QP back when the move failed: a failed
    /// `ibv_modify_qp` changes nothing, so it is still in INIT, and a
    /// connect whose link went down inside the call (RoCE: the kernel's
    /// address resolution timed out) can move the same QP, whose number the
    /// peer already has, again once the port is back.
    pub fn try_rtr(self, p: &RtrParams) -> std::result::Result<Qp<Rtr>, (Qp<Init>, Error)> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: p.mtu,
            dest_qp_num: p.dest_qpn,
            rq_psn: 0,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..Default::default()
        };
        a.ah_attr.is_global = p.global as u8;
        a.ah_attr.dlid = p.dlid;
        a.ah_attr.sl = p.sl;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = p.port;
        if p.global {
            a.ah_attr.grh.dgid = ibv_gid { raw: p.dgid };
            a.ah_attr.grh.flow_label = 0;
            a.ah_attr.grh.sgid_index = p.sgid_index;
            a.ah_attr.grh.hop_limit = 255;
            a.ah_attr.grh.traffic_class = p.tc;
        }
        use ibv_qp_attr_mask::*;
        match self.modify(
            &mut a,
            IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
            "RTR",
        ) {
            Ok(()) => Ok(self.into_state()),
            Err(e) => Err((self, e)),
        }
    }
}

impl Qp<Init> {
    /// For iWARP: the QP, named to rdma_cm by number, is connected: the
    /// kernel's iw_cm moved it to RTS when rdma_cm reported ESTABLISHED
    /// (`rdmacm`), so only our type changes.
    pub fn connected_by_cm(self) -> Qp<Rts> {
        self.into_state()
    }
}

/// States in which receives may be posted.
pub trait CanRecv {}
impl CanRecv for Rtr {}
impl CanRecv for Rts {}

impl<S: CanRecv> Qp<S> {
    /// Post one receive WR with no scatter entries (it only consumes a
    /// WRITE_WITH_IMM); `wr_id` comes back in its completion.
    pub fn post_recv_empty(&self, wr_id: u64) -> Result<()> {
        let mut wr = ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: std::ptr::null_mut(), num_sge: 0 };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP; ops.post_recv is what the ibv_post_recv inline calls.
        let f = unsafe { (*(*self.inner.ptr).context).ops.post_recv };
        let Some(f) = f else { return Err(Error::Internal("provider has no post_recv".into())) };
        // SAFETY: a zero-SGE WR names no memory; wr lives for the call.
        let r = unsafe { f(self.inner.ptr, &mut wr, &mut bad) };
        if r != 0 {
            return Err(Error::sys(format!("ibv_post_recv(QP {:#x})", self.inner.qpn), Errno(r)));
        }
        Ok(())
    }
}

impl<S: CanRecv> Qp<S> {
    /// Post one receive WR with one scatter entry (a notice slot, iWARP:
    /// [`crate::proto::notice`]); `wr_id` comes back in its completion.
    ///
    /// # Safety
    /// `local` (address, length, lkey) must lie in memory registered with
    /// local write on this QP's PD and stay valid until the completion (or
    /// the QP's destruction).
    pub unsafe fn post_recv(&self, wr_id: u64, local: (u64, u32, u32)) -> Result<()> {
        let mut sge = ibv_sge { addr: local.0, length: local.1, lkey: local.2 };
        let mut wr = ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP; ops.post_recv is what the ibv_post_recv inline calls.
        let f = unsafe { (*(*self.inner.ptr).context).ops.post_recv };
        let Some(f) = f else { return Err(Error::Internal("provider has no post_recv".into())) };
        // SAFETY: wr and sge live for the call; the memory obligation is the caller's.
        let r = unsafe { f(self.inner.ptr, &mut wr, &mut bad) };
        if r != 0 {
            return Err(Error::sys(format!("ibv_post_recv(QP {:#x}, 1 SGE)", self.inner.qpn), Errno(r)));
        }
        Ok(())
    }
}

impl Qp<Rtr> {
    /// RTR -> RTS.
    pub fn to_rts(self, p: &RtsParams) -> Result<Qp<Rts>> {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            timeout: p.timeout,
            retry_cnt: p.retry_cnt,
            rnr_retry: 7,
            sq_psn: 0,
            max_rd_atomic: 1,
            ..Default::default()
        };
        use ibv_qp_attr_mask::*;
        self.modify(
            &mut a,
            IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )?;
        Ok(self.into_state())
    }
}

/// One send work request, in our terms.
#[derive(Debug, Clone, Copy)]
pub struct SendWr {
    /// Comes back in the completion.
    pub wr_id: u64,
    /// Local source (address, length, lkey); len 0 = no SGE.
    pub local: (u64, u32, u32),
    /// Remote destination (address, rkey).
    pub remote: (u64, u32),
    /// `Some(imm)`: RDMA_WRITE_WITH_IMM (imm in host order); else RDMA_WRITE.
    pub imm: Option<u32>,
    /// Generate a completion.
    pub signaled: bool,
    /// Copy the source into the WR (len must fit max_inline).
    pub inline: bool,
}

/// Most WRs one post chains together.
pub const MAX_CHAIN: usize = 16;

impl Qp<Rts> {
    /// Post one signaled RDMA READ of `remote` into `local` (the flush).
    ///
    /// # Safety
    /// `local` must lie in memory registered (lkey) with local write access
    /// on this QP's PD and stay valid until the completion; `remote` must be
    /// readable under its rkey (a peer's memory or, for a loopback QP, ours).
    pub unsafe fn post_read(&self, wr_id: u64, local: (u64, u32, u32), remote: (u64, u32)) -> Result<()> {
        let mut sge = ibv_sge { addr: local.0, length: local.1, lkey: local.2 };
        // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_RDMA_READ;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED;
        wr.wr.rdma = ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: remote.0, rkey: remote.1 };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; ops.post_send is what the ibv_post_send inline calls.
        let f = unsafe { (*(*self.inner.ptr).context).ops.post_send };
        let Some(f) = f else { return Err(Error::Internal("provider has no post_send".into())) };
        // SAFETY: wr and sge live for the call; memory obligations are the caller's.
        let r = unsafe { f(self.inner.ptr, &mut wr, &mut bad) };
        if r != 0 {
            return Err(Error::sys(format!("ibv_post_send(QP {:#x}, RDMA READ)", self.inner.qpn), Errno(r)));
        }
        Ok(())
    }

    /// Post one inline SEND of `data` (a notice, iWARP:
    /// [`crate::proto::notice`]). Inline: the bytes are copied at post time,
    /// so no memory obligation outlives the call.
    pub fn post_send_inline(&self, wr_id: u64, data: &[u8], signaled: bool) -> Result<()> {
        if data.len() > self.inner.max_inline as usize {
            return Err(Error::Internal(format!(
                "a {}-byte inline SEND on QP {:#x}, which takes {} inline",
                data.len(),
                self.inner.qpn,
                self.inner.max_inline
            )));
        }
        // the provider reads the bytes during the call only (IBV_SEND_INLINE)
        let mut sge = ibv_sge { addr: data.as_ptr() as u64, length: data.len() as u32, lkey: 0 };
        // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_INLINE | if signaled { ibv_send_flags::IBV_SEND_SIGNALED } else { 0 };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; ops.post_send is what the ibv_post_send inline calls.
        let f = unsafe { (*(*self.inner.ptr).context).ops.post_send };
        let Some(f) = f else { return Err(Error::Internal("provider has no post_send".into())) };
        // SAFETY: wr, sge and data live for the call; inline data is copied
        // before it returns, so nothing is referenced afterwards.
        let r = unsafe { f(self.inner.ptr, &mut wr, &mut bad) };
        if r != 0 {
            return Err(Error::sys(format!("ibv_post_send(QP {:#x}, inline SEND of {} bytes)", self.inner.qpn, data.len()), Errno(r)));
        }
        Ok(())
    }

    /// Post up to `MAX_CHAIN` RDMA writes as one chain.
    ///
    /// # Safety
    /// For every WR that is not inline, the local range must lie in memory
    /// registered (lkey) on this QP's PD, and stay valid and registered until
    /// the WR completes: its own completion if signaled, else the completion
    /// of a later signaled WR on this QP (or the QP's destruction).
    pub unsafe fn post_writes(&self, wrs: &[SendWr]) -> Result<()> {
        // SAFETY: this fn's contract is post_chain's, which our caller promised.
        unsafe { self.post_chain(wrs, false, None) }
    }

    /// [`Self::post_writes`], except that the last WR is a SEND (its
    /// `remote` and `imm` unused): a lane's RDMA writes and then its notice
    /// (iWARP, [`crate::proto::notice`]) in one post. RC places the writes
    /// before the SEND completes at the peer.
    ///
    /// # Safety
    /// As [`Self::post_writes`], for every WR including the SEND.
    pub unsafe fn post_writes_send(&self, wrs: &[SendWr]) -> Result<()> {
        // SAFETY: this fn's contract is post_chain's, which our caller promised.
        unsafe { self.post_chain(wrs, true, None) }
    }

    /// [`Self::post_writes`], except that the last WR of `wrs` is a SEND
    /// (its `remote` and `imm` unused), followed by the RDMA READ `read`
    /// (`local`: where the bytes land, `remote`: what it reads, signaled):
    /// a lane's RDMA writes, its notice and its delivery fence (iWARP,
    /// [`crate::proto::notice`]; the fence: `notice_path::NoticeTx`)
    /// in one post. RC places the writes before the SEND at the peer, and
    /// the READ's response leaves the peer only after both were placed.
    ///
    /// # Safety
    /// As [`Self::post_writes`], for every WR including the SEND; the READ's
    /// `local` must lie in memory registered with local write on this QP's
    /// PD, valid until the READ completes, and its `remote` be readable
    /// under its rkey.
    pub unsafe fn post_writes_send_read(&self, wrs: &[SendWr], read: &SendWr) -> Result<()> {
        // SAFETY: this fn's contract is post_chain's, which our caller promised.
        unsafe { self.post_chain(wrs, true, Some(read)) }
    }

    /// # Safety
    /// As [`Self::post_writes`] (and [`Self::post_writes_send_read`] for `read`).
    unsafe fn post_chain(&self, wrs: &[SendWr], send_last: bool, read: Option<&SendWr>) -> Result<()> {
        let n = wrs.len() + usize::from(read.is_some());
        assert!(!wrs.is_empty() && n <= MAX_CHAIN);
        let mut sges = [const { std::mem::MaybeUninit::<ibv_sge>::uninit() }; MAX_CHAIN];
        // only the n WRs posted are initialized (no 2 KiB memset per post)
        let mut ws = [const { std::mem::MaybeUninit::<ibv_send_wr>::uninit() }; MAX_CHAIN];
        for (i, w) in wrs.iter().chain(read).enumerate() {
            // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
            let sw = ws[i].write(unsafe { std::mem::zeroed() });
            sw.wr_id = w.wr_id;
            if w.local.1 > 0 {
                sges[i].write(ibv_sge { addr: w.local.0, length: w.local.1, lkey: w.local.2 });
                sw.num_sge = 1;
            }
            sw.opcode = if i == wrs.len() {
                IBV_WR_RDMA_READ
            } else if send_last && i + 1 == wrs.len() {
                IBV_WR_SEND
            } else if w.imm.is_some() {
                IBV_WR_RDMA_WRITE_WITH_IMM
            } else {
                IBV_WR_RDMA_WRITE
            };
            sw.send_flags = (if w.signaled { ibv_send_flags::IBV_SEND_SIGNALED } else { 0 })
                | (if w.inline && w.local.1 > 0 && i < wrs.len() { ibv_send_flags::IBV_SEND_INLINE } else { 0 });
            sw.__bindgen_anon_1.imm_data = w.imm.unwrap_or(0).to_be();
            sw.wr.rdma = ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: w.remote.0, rkey: w.remote.1 };
        }
        let base = ws.as_mut_ptr() as *mut ibv_send_wr;
        let sg = sges.as_mut_ptr() as *mut ibv_sge;
        for i in 0..n {
            // SAFETY: indices < n <= MAX_CHAIN: WRs initialized above, and an
            // SGE initialized wherever num_sge is 1.
            unsafe {
                if (*base.add(i)).num_sge == 1 {
                    (*base.add(i)).sg_list = sg.add(i);
                }
                (*base.add(i)).next = if i + 1 < n { base.add(i + 1) } else { std::ptr::null_mut() };
            }
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; ops.post_send is what the ibv_post_send inline calls.
        let f = unsafe { (*(*self.inner.ptr).context).ops.post_send };
        let Some(f) = f else { return Err(Error::Internal("provider has no post_send".into())) };
        // SAFETY: the chain and SGEs live for the call (the provider copies
        // them); memory obligations are the caller's (see # Safety).
        let r = unsafe { f(self.inner.ptr, base, &mut bad) };
        if r != 0 {
            return Err(Error::sys(format!("ibv_post_send(QP {:#x}, {n} WRs)", self.inner.qpn), Errno(r)));
        }
        Ok(())
    }
}

/// Registered memory read through the protocol machines' eyes.
impl crate::proto::mem::Mem for HostRegion {
    fn read_u64(&self, off: usize) -> u64 {
        HostRegion::read_u64(self, off)
    }
    fn read(&self, off: usize, out: &mut [u8]) {
        HostRegion::read(self, off, out)
    }
}

/// Staging the protocol machines write into.
impl crate::proto::mem::MemMut for HostRegion {
    fn write(&mut self, off: usize, data: &[u8]) {
        HostRegion::write(self, off, data)
    }
}

#[cold]
#[inline(never)]
fn no_poll_cq() -> Error {
    Error::Internal("provider has no poll_cq".into())
}
