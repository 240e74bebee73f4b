//! The rdma_cm connection path (librdmacm), for iWARP: the system ring of
//! it. Every `unsafe` block of the rdma_cm side lives here, each with a
//! `// SAFETY:` line.
//!
//! - [`CmLib`]: `dlopen("librdmacm.so.1", RTLD_NOW|RTLD_LOCAL)` and `dlvsym`
//!   with `RDMACM_1.0`, like libibverbs in [`super::verbs`]: nothing is
//!   linked, so the plugin loads (and IB/RoCE work) on hosts without
//!   librdmacm, and `readelf -d` shows no NEEDED entry for it.
//! - Non-blocking throughout: every connection or listener owns an event
//!   channel whose fd is O_NONBLOCK; `poll` methods take what is there and
//!   return. [`CmConn`] never waits for the peer's accept (the per-comm
//!   connect of all QPs is `CmConnect` in [`super::notice_path`]);
//!   [`CmListener`] hands out requests as they arrive.
//! - QPs stay ours: they are created with `ibv_create_qp` on our own context
//!   and PD ([`super::verbs::Qp::create`], left in INIT) and named to
//!   rdma_cm by number in `rdma_conn_param::qp_num`; the kernel's iw_cm
//!   moves them to RTS when the connection is established. (librdmacm's own
//!   `rdma_create_qp` would insist on its own device context.)
//! - The listener binds the device's IP address with port 0; its
//!   [`CmListener::addr`] is what the listen handle carries to the peer.
//!   Private data (up to [`MAX_PRIVATE`] bytes) travels with the request: a
//!   magic, the QP's index and count, and the comm's cookie, which the receiver checks
//!   before it accepts with that index's QP (see [`super::notice_path`]).
//! - Failures name the peer (its address and the name the caller gives).
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::cmffi::*;
use super::verbs::{dlerror_string, sym};
use crate::error::{Errno, Error, Result};

/// The soname we load.
pub const LIBRDMACM: &str = "librdmacm.so.1";

/// Private data that fits in both a connect request and an accept over iWARP
/// (MPA allows 512 bytes; rdma_cm takes at most 196 on accept for TCP).
pub const MAX_PRIVATE: usize = 196;

type FnCreateEventChannel = unsafe extern "C" fn() -> *mut rdma_event_channel;
type FnDestroyEventChannel = unsafe extern "C" fn(*mut rdma_event_channel);
type FnCreateId = unsafe extern "C" fn(*mut rdma_event_channel, *mut *mut rdma_cm_id, *mut c_void, rdma_port_space) -> c_int;
type FnDestroyId = unsafe extern "C" fn(*mut rdma_cm_id) -> c_int;
type FnBindAddr = unsafe extern "C" fn(*mut rdma_cm_id, *mut libc::sockaddr) -> c_int;
type FnListen = unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int;
type FnResolveAddr = unsafe extern "C" fn(*mut rdma_cm_id, *mut libc::sockaddr, *mut libc::sockaddr, c_int) -> c_int;
type FnResolveRoute = unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int;
type FnConnect = unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int;
type FnReject = unsafe extern "C" fn(*mut rdma_cm_id, *const c_void, u8) -> c_int;
type FnDisconnect = unsafe extern "C" fn(*mut rdma_cm_id) -> c_int;
type FnGetCmEvent = unsafe extern "C" fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int;
type FnAckCmEvent = unsafe extern "C" fn(*mut rdma_cm_event) -> c_int;
type FnMigrateId = unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_event_channel) -> c_int;
type FnEventStr = unsafe extern "C" fn(rdma_cm_event_type) -> *const c_char;
type FnGetPort = unsafe extern "C" fn(*mut rdma_cm_id) -> u16;

/// The resolved entry points of librdmacm.
pub struct CmLib {
    create_event_channel: FnCreateEventChannel,
    destroy_event_channel: FnDestroyEventChannel,
    create_id: FnCreateId,
    destroy_id: FnDestroyId,
    bind_addr: FnBindAddr,
    listen: FnListen,
    resolve_addr: FnResolveAddr,
    resolve_route: FnResolveRoute,
    connect: FnConnect,
    accept: FnConnect,
    reject: FnReject,
    disconnect: FnDisconnect,
    get_cm_event: FnGetCmEvent,
    ack_cm_event: FnAckCmEvent,
    migrate_id: FnMigrateId,
    event_str: FnEventStr,
    get_src_port: FnGetPort,
}

static LIB: crate::unload::Global<std::result::Result<CmLib, String>> = crate::unload::Global::new();

/// Unload: forget why librdmacm could not be loaded (a loaded table stays,
/// like libibverbs' in [`super::verbs::release`]).
///
/// # Safety
/// As [`crate::unload::Global::clear`].
pub(crate) unsafe fn release() {
    if matches!(LIB.get(), Some(Err(_))) {
        // SAFETY: our caller guarantees Global::clear's contract (no
        // reference into LIB alive or used again); besides, a failed load
        // left no library that any thread could be using.
        unsafe { LIB.clear() };
    }
}

macro_rules! need {
    ($h:expr, $name:literal, $ty:ty) => {{
        let p = sym($h, $name, "RDMACM_1.0").ok_or_else(|| format!("{LIBRDMACM} lacks {}@RDMACM_1.0", $name))?;
        // SAFETY: the symbol is the versioned librdmacm function whose C
        // prototype $ty transcribes from <rdma/rdma_cma.h>.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
    }};
}

impl CmLib {
    fn load() -> std::result::Result<CmLib, String> {
        let so = CString::new(LIBRDMACM).unwrap();
        // SAFETY: dlopen with a valid C string; the handle is never closed
        // (the function pointers below live for the process).
        let h = unsafe { libc::dlopen(so.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err(format!("cannot load {LIBRDMACM}: {} (install librdmacm1)", dlerror_string()));
        }
        Ok(CmLib {
            create_event_channel: need!(h, "rdma_create_event_channel", FnCreateEventChannel),
            destroy_event_channel: need!(h, "rdma_destroy_event_channel", FnDestroyEventChannel),
            create_id: need!(h, "rdma_create_id", FnCreateId),
            destroy_id: need!(h, "rdma_destroy_id", FnDestroyId),
            bind_addr: need!(h, "rdma_bind_addr", FnBindAddr),
            listen: need!(h, "rdma_listen", FnListen),
            resolve_addr: need!(h, "rdma_resolve_addr", FnResolveAddr),
            resolve_route: need!(h, "rdma_resolve_route", FnResolveRoute),
            connect: need!(h, "rdma_connect", FnConnect),
            accept: need!(h, "rdma_accept", FnConnect),
            reject: need!(h, "rdma_reject", FnReject),
            disconnect: need!(h, "rdma_disconnect", FnDisconnect),
            get_cm_event: need!(h, "rdma_get_cm_event", FnGetCmEvent),
            ack_cm_event: need!(h, "rdma_ack_cm_event", FnAckCmEvent),
            migrate_id: need!(h, "rdma_migrate_id", FnMigrateId),
            event_str: need!(h, "rdma_event_str", FnEventStr),
            get_src_port: need!(h, "rdma_get_src_port", FnGetPort),
        })
    }

    /// The process-wide library, loaded on first use; the error says why not.
    pub fn get() -> std::result::Result<&'static CmLib, String> {
        LIB.get_or_init(CmLib::load).as_ref().map_err(Clone::clone)
    }

    fn event_name(&self, ev: rdma_cm_event_type) -> String {
        // SAFETY: rdma_event_str returns a static string for any value.
        let p = unsafe { (self.event_str)(ev) };
        if p.is_null() {
            return format!("rdma_cm event {ev}");
        }
        // SAFETY: non-NULL static C string from librdmacm.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Whether iWARP ports can be connected here, or why not: the data path is
/// built in and librdmacm loads. Discovery leaves iWARP ports out on `Err`
/// (the text goes into the port's seen-line), so NCCL never gets a port
/// whose every connect would fail.
pub fn iwarp_usable() -> std::result::Result<(), String> {
    if !super::iwarp::IWARP_DATA_PATH {
        return Err(super::iwarp::IWARP_WHY.to_string());
    }
    CmLib::get().map(|_| ()).map_err(|e| format!("librdmacm not loadable: {e}"))
}

// ---------------------------------------------------------------- channel

struct Chan {
    lib: &'static CmLib,
    ptr: *mut rdma_event_channel,
}

// SAFETY: librdmacm's objects may be used from any thread; each of ours is
// driven by one thread at a time (the comm that owns it).
unsafe impl Send for Chan {}
// SAFETY: a shared &Chan only hands its pointer to librdmacm calls, which
// may be made from any thread, and only the comm that owns the channel polls
// it; the fields themselves are never written after construction.
unsafe impl Sync for Chan {}

impl Drop for Chan {
    fn drop(&mut self) {
        // SAFETY: every id on this channel holds an Arc of it, so none is left.
        unsafe { (self.lib.destroy_event_channel)(self.ptr) };
    }
}

/// One event, copied out and acknowledged at once (rdma_destroy_id waits
/// for unacknowledged events, so none is ever kept).
struct Ev {
    kind: rdma_cm_event_type,
    status: i32,
    id: *mut rdma_cm_id,
    private: Vec<u8>,
}

impl Chan {
    fn new(lib: &'static CmLib) -> Result<Arc<Chan>> {
        // SAFETY: plain constructor; NULL on failure.
        let ptr = unsafe { (lib.create_event_channel)() };
        if ptr.is_null() {
            return Err(Error::last_os("rdma_create_event_channel"));
        }
        let ch = Arc::new(Chan { lib, ptr });
        // SAFETY: ptr is a live channel; fd is its open descriptor.
        let fd = unsafe { (*ptr).fd };
        // SAFETY: fcntl on an fd we own through the channel.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: F_SETFL on the same fd, open as long as the channel `ch` is.
        if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
            return Err(Error::last_os("fcntl(rdma_cm channel, O_NONBLOCK)"));
        }
        Ok(ch)
    }

    /// The next event, if one is there (never blocks: the fd is O_NONBLOCK).
    fn next(&self) -> Result<Option<Ev>> {
        let mut e: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: live channel, valid out-pointer.
        let r = unsafe { (self.lib.get_cm_event)(self.ptr, &mut e) };
        if r != 0 {
            let errno = Errno::last();
            if errno.0 == libc::EAGAIN || errno.0 == libc::EWOULDBLOCK || errno.0 == libc::EINTR {
                return Ok(None);
            }
            return Err(Error::sys("rdma_get_cm_event", errno));
        }
        // SAFETY: e is the event just returned; its connection parameters
        // name private_data_len readable bytes (or none).
        let ev = unsafe {
            let conn = (*e).param.conn.as_ref();
            let private = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(conn.private_data as *const u8, conn.private_data_len as usize).to_vec()
            };
            Ev { kind: (*e).event, status: (*e).status, id: (*e).id, private }
        };
        // SAFETY: e came from rdma_get_cm_event and is acked exactly once;
        // nothing read from it is used after this point but copies.
        unsafe { (self.lib.ack_cm_event)(e) };
        Ok(Some(ev))
    }
}

// ---------------------------------------------------------------- ids

/// One rdma_cm id and the channel its events arrive on.
struct Id {
    ptr: *mut rdma_cm_id,
    chan: Arc<Chan>,
    connected: bool,
}

// SAFETY: librdmacm's ids may be used from any thread (its calls lock
// internally), and each Id is driven by the one comm that owns it; the Arc
// keeps its channel alive wherever it goes.
unsafe impl Send for Id {}
// SAFETY: a shared &Id only reads its pointer for librdmacm calls, which may
// be made from any thread; mutation (`connected`) needs &mut.
unsafe impl Sync for Id {}

impl Drop for Id {
    fn drop(&mut self) {
        let lib = self.chan.lib;
        if self.connected {
            // SAFETY: live id; a failed disconnect only means the peer went first.
            unsafe { (lib.disconnect)(self.ptr) };
        }
        // SAFETY: live id, destroyed once; every event on it was acked in
        // Chan::next, so rdma_destroy_id does not wait.
        unsafe { (lib.destroy_id)(self.ptr) };
    }
}

impl Id {
    fn new(chan: Arc<Chan>) -> Result<Id> {
        let mut p: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: live channel, valid out-pointer; RDMA_PS_TCP = reliable connected.
        let r = unsafe { (chan.lib.create_id)(chan.ptr, &mut p, std::ptr::null_mut(), RDMA_PS_TCP) };
        if r != 0 || p.is_null() {
            return Err(Error::last_os("rdma_create_id"));
        }
        Ok(Id { ptr: p, chan, connected: false })
    }

    /// Name of the RDMA device the id is bound to, once it is.
    fn device_name(&self) -> Option<String> {
        // SAFETY: live id; `verbs` is NULL or librdmacm's context of the
        // device, whose `device` and name stay valid while the id lives.
        unsafe {
            let v = (*self.ptr).verbs;
            if v.is_null() || (*v).device.is_null() {
                return None;
            }
            Some(CStr::from_ptr((*(*v).device).name.as_ptr()).to_string_lossy().into_owned())
        }
    }
}

struct SockAddr(libc::sockaddr_storage);

impl SockAddr {
    fn new(a: SocketAddr) -> SockAddr {
        SockAddr(crate::transport::sock::to_sockaddr(&a).0)
    }

    fn ptr(&mut self) -> *mut libc::sockaddr {
        &mut self.0 as *mut _ as *mut libc::sockaddr
    }
}

/// RDMA READs a connection lets be in flight each way (soft-iWARP allows 128).
const READ_DEPTH: u8 = 16;

fn conn_param(qpn: u32, private: &[u8]) -> Result<rdma_conn_param> {
    if private.len() > MAX_PRIVATE {
        return Err(Error::Internal(format!("{} bytes of rdma_cm private data (max {MAX_PRIVATE})", private.len())));
    }
    Ok(rdma_conn_param {
        private_data: private.as_ptr() as *const c_void,
        private_data_len: private.len() as u8,
        // the iWARP sender's delivery fence: one RDMA READ per lane, up to a
        // FIFO's worth in flight on a QP (more wait in its send queue)
        responder_resources: READ_DEPTH,
        initiator_depth: READ_DEPTH,
        flow_control: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        srq: 0,
        qp_num: qpn,
    })
}

// ---------------------------------------------------------------- listener

/// A passive rdma_cm id bound to one device's address: the receiving side.
pub struct CmListener {
    id: Id,
    addr: SocketAddr,
}

/// A connection request, not yet answered.
pub struct CmRequest {
    id: Id,
    /// What the peer sent with its request.
    pub private: Vec<u8>,
    /// Where the request came from (its source address), when rdma_cm says.
    pub src: Option<IpAddr>,
}

impl CmListener {
    /// Listen on `ip` (the address of the iWARP device's netdev), port chosen
    /// by the kernel.
    pub fn new(ip: IpAddr) -> Result<CmListener> {
        let lib = CmLib::get().map_err(Error::Usage)?;
        let id = Id::new(Chan::new(lib)?)?;
        let mut sa = SockAddr::new(SocketAddr::new(ip, 0));
        // SAFETY: live id; sa is a valid sockaddr for the call.
        if unsafe { (lib.bind_addr)(id.ptr, sa.ptr()) } != 0 {
            return Err(Error::last_os(format!("rdma_bind_addr({ip})")));
        }
        // SAFETY: live, bound id.
        if unsafe { (lib.listen)(id.ptr, 128) } != 0 {
            return Err(Error::last_os(format!("rdma_listen({ip})")));
        }
        // SAFETY: live, bound id.
        let port = u16::from_be(unsafe { (lib.get_src_port)(id.ptr) });
        Ok(CmListener { id, addr: SocketAddr::new(ip, port) })
    }

    /// Where the peer connects: what the listen handle carries.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The RDMA device the listener is bound to (None when bound to all).
    pub fn device_name(&self) -> Option<String> {
        self.id.device_name()
    }

    /// The next connection request, if one arrived (never waits).
    pub fn poll(&self) -> Result<Option<CmRequest>> {
        while let Some(ev) = self.id.chan.next()? {
            if ev.kind == RDMA_CM_EVENT_CONNECT_REQUEST {
                // a new id on our channel: give it a channel of its own, so
                // its later events never mix with other requests
                let lib = self.id.chan.lib;
                let chan = Chan::new(lib)?;
                // SAFETY: ev.id is the new id (ours to own from here); its
                // only event so far was acked in Chan::next.
                let r = unsafe { (lib.migrate_id)(ev.id, chan.ptr) };
                let id = Id { ptr: ev.id, chan, connected: false };
                if r != 0 {
                    return Err(Error::last_os("rdma_migrate_id"));
                }
                // SAFETY: id.ptr is the live id of this request; its route's
                // destination is the requester's address (a sockaddr_storage
                // that rdma_cm filled before it raised the event).
                let src = unsafe { sockaddr_ip(&(*id.ptr).route.addr.__bindgen_anon_2.dst_storage as *const _ as *const libc::sockaddr) };
                return Ok(Some(CmRequest { id, private: ev.private, src }));
            }
            tracing::debug!("rdma_cm listener {}: ignoring event {}", self.addr, self.id.chan.lib.event_name(ev.kind));
        }
        Ok(None)
    }
}

/// The IP address in a sockaddr (None: not AF_INET or AF_INET6).
///
/// # Safety
/// `sa` points to a sockaddr_storage (or a sockaddr as large as its family says).
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    // SAFETY: the caller's pointer is readable for the family's size.
    unsafe {
        match (*sa).sa_family as c_int {
            libc::AF_INET => {
                let s = &*(sa as *const libc::sockaddr_in);
                Some(IpAddr::from(u32::from_be(s.sin_addr.s_addr).to_be_bytes()))
            }
            libc::AF_INET6 => {
                let s = &*(sa as *const libc::sockaddr_in6);
                let v6 = std::net::Ipv6Addr::from(s.sin6_addr.s6_addr);
                Some(v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4))
            }
            _ => None,
        }
    }
}

/// The RDMA device rdma_cm binds `ip` to (None: no RDMA device serves that
/// address). How an iWARP device finds its own address: siw and most iWARP
/// NICs show no netdev link in sysfs, and rdma_cm's answer is the one its
/// connections will follow anyway.
pub fn device_of(ip: IpAddr) -> Result<Option<String>> {
    let lib = CmLib::get().map_err(Error::Usage)?;
    let id = Id::new(Chan::new(lib)?)?;
    let mut sa = SockAddr::new(SocketAddr::new(ip, 0));
    // SAFETY: live id; sa is a valid sockaddr for the call.
    if unsafe { (lib.bind_addr)(id.ptr, sa.ptr()) } != 0 {
        return Ok(None);
    }
    Ok(id.device_name())
}

impl CmRequest {
    /// The RDMA device the request arrived on.
    pub fn device_name(&self) -> Option<String> {
        self.id.device_name()
    }

    /// Accept with our QP (`qpn`, in INIT on that device) and our private
    /// data; the connection is usable once [`CmConn::poll`] says so.
    pub fn accept(mut self, qpn: u32, private: &[u8], peer: &str) -> Result<CmConn> {
        let mut p = conn_param(qpn, private)?;
        let lib = self.id.chan.lib;
        // SAFETY: live id with a pending request; p and the private data it
        // points to live for the call (librdmacm copies them).
        if unsafe { (lib.accept)(self.id.ptr, &mut p) } != 0 {
            return Err(Error::Remote { peer: peer.into(), what: format!("rdma_accept: {}", Errno::last()) });
        }
        self.id.connected = true;
        Ok(CmConn { id: self.id, peer: peer.into(), state: ConnState::Connecting, private: Vec::new() })
    }

    /// Refuse the request (the peer's connect fails with REJECTED).
    pub fn reject(self) {
        // SAFETY: live id with a pending request; no private data.
        unsafe { (self.id.chan.lib.reject)(self.id.ptr, std::ptr::null(), 0) };
    }
}

// ---------------------------------------------------------------- active side

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnState {
    ResolvingAddr,
    ResolvingRoute,
    /// Route known: the caller creates its QP on [`CmConn::device_name`] and calls [`CmConn::connect`].
    RouteReady,
    Connecting,
    Established,
}

impl ConnState {
    /// After rdma_connect / rdma_accept: a DISCONNECTED then means the peer
    /// (or the fabric) closed the connection, whether or not it had become
    /// ESTABLISHED. Treating it as a failure only once ESTABLISHED left a
    /// receiver waiting forever for a connection its sender had given up.
    fn connect_sent(self) -> bool {
        matches!(self, ConnState::Connecting | ConnState::Established)
    }
}

/// What [`CmConn::poll`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    /// Nothing new: poll again later.
    Pending,
    /// (Active side) the route is resolved: create the QP on the device
    /// [`CmConn::device_name`] names and call [`CmConn::connect`].
    NeedQp,
    /// Connected: the QP is in RTS and both sides may post. Carries the
    /// private data of the peer's accept (active side; empty on the passive side).
    Established(Vec<u8>),
}

/// One rdma_cm connection, active (from [`CmConn::start`]) or passive (from
/// `CmRequest::accept`).
pub struct CmConn {
    id: Id,
    peer: String,
    state: ConnState,
    private: Vec<u8>,
}

/// How long rdma_cm may take to resolve the address and the route (ms).
const RESOLVE_MS: c_int = 5000;

impl CmConn {
    /// Start connecting from `src` (the local iWARP device's address) to a
    /// listener at `dst`; `peer` names the peer in errors. Returns at once.
    pub fn start(src: IpAddr, dst: SocketAddr, peer: &str) -> Result<CmConn> {
        let lib = CmLib::get().map_err(Error::Usage)?;
        let id = Id::new(Chan::new(lib)?)?;
        let mut s = SockAddr::new(SocketAddr::new(src, 0));
        let mut d = SockAddr::new(dst);
        // SAFETY: live id; both sockaddrs valid for the call.
        if unsafe { (lib.resolve_addr)(id.ptr, s.ptr(), d.ptr(), RESOLVE_MS) } != 0 {
            return Err(Error::Remote {
                peer: format!("{peer} ({dst})"),
                what: format!("rdma_resolve_addr from {src}: {}", Errno::last()),
            });
        }
        Ok(CmConn { id, peer: format!("{peer} ({dst})"), state: ConnState::ResolvingAddr, private: Vec::new() })
    }

    /// The RDMA device the connection runs on (known from [`Progress::NeedQp`] on).
    pub fn device_name(&self) -> Option<String> {
        self.id.device_name()
    }

    /// Whom errors name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Send the connect request with our QP (`qpn`, INIT) and private data.
    /// `Ok(false)`: not sent, because the local TCP port rdma_cm picked for
    /// this id is taken (`EADDRINUSE`: soft-iWARP binds rdma_cm's port in
    /// the kernel's TCP port space, which rdma_cm does not consult); the
    /// caller starts over with a new connection ([`CmConn::start`]).
    pub fn connect(&mut self, qpn: u32, private: &[u8]) -> Result<bool> {
        if self.state != ConnState::RouteReady {
            return Err(Error::Internal(format!("rdma_cm connect to {} in state {:?}", self.peer, self.state)));
        }
        let mut p = conn_param(qpn, private)?;
        // SAFETY: live id with a resolved route; p and its private data live
        // for the call (librdmacm copies them).
        if unsafe { (self.id.chan.lib.connect)(self.id.ptr, &mut p) } != 0 {
            let e = Errno::last();
            if e.0 == libc::EADDRINUSE {
                return Ok(false);
            }
            return Err(Error::Remote { peer: self.peer.clone(), what: format!("rdma_connect: {e}") });
        }
        self.id.connected = true;
        self.state = ConnState::Connecting;
        Ok(true)
    }

    /// Take the events that arrived and say where the connection stands.
    pub fn poll(&mut self) -> Result<Progress> {
        let lib = self.id.chan.lib;
        while let Some(ev) = self.id.chan.next()? {
            let what = || format!("{} (status {})", lib.event_name(ev.kind), ev.status);
            match (self.state, ev.kind) {
                (ConnState::ResolvingAddr, RDMA_CM_EVENT_ADDR_RESOLVED) => {
                    // SAFETY: live id with a resolved address.
                    if unsafe { (lib.resolve_route)(self.id.ptr, RESOLVE_MS) } != 0 {
                        return Err(Error::Remote { peer: self.peer.clone(), what: format!("rdma_resolve_route: {}", Errno::last()) });
                    }
                    self.state = ConnState::ResolvingRoute;
                }
                (ConnState::ResolvingRoute, RDMA_CM_EVENT_ROUTE_RESOLVED) => self.state = ConnState::RouteReady,
                (ConnState::Connecting, RDMA_CM_EVENT_ESTABLISHED) => {
                    self.state = ConnState::Established;
                    self.private = ev.private;
                }
                (st, RDMA_CM_EVENT_DISCONNECTED) if st.connect_sent() => {
                    self.id.connected = false;
                    return Err(Error::Remote { peer: self.peer.clone(), what: "closed the rdma_cm connection".into() });
                }
                (_, RDMA_CM_EVENT_REJECTED) => {
                    self.id.connected = false;
                    return Err(Error::Remote {
                        peer: self.peer.clone(),
                        what: format!("refused the rdma_cm connection ({}): is it listening there?", what()),
                    });
                }
                (_, RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR | RDMA_CM_EVENT_UNREACHABLE | RDMA_CM_EVENT_CONNECT_ERROR) => {
                    self.id.connected = false;
                    return Err(Error::Remote { peer: self.peer.clone(), what: format!("rdma_cm connection failed: {}", what()) });
                }
                (_, RDMA_CM_EVENT_DEVICE_REMOVAL) => {
                    return Err(Error::Remote { peer: self.peer.clone(), what: "the local RDMA device was removed".into() });
                }
                _ => tracing::debug!("rdma_cm to {}: event {} in state {:?}", self.peer, what(), self.state),
            }
        }
        Ok(match self.state {
            ConnState::RouteReady => Progress::NeedQp,
            ConnState::Established => Progress::Established(std::mem::take(&mut self.private)),
            _ => Progress::Pending,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disconnect_after_connect_or_accept_fails_the_connection() {
        assert!(ConnState::Connecting.connect_sent(), "accepted, or connect sent: a DISCONNECTED is a failure");
        assert!(ConnState::Established.connect_sent());
        for s in [ConnState::ResolvingAddr, ConnState::ResolvingRoute, ConnState::RouteReady] {
            assert!(!s.connect_sent(), "{s:?}: nothing to disconnect yet");
        }
    }

    #[test]
    fn private_data_is_bounded() {
        assert!(conn_param(7, &[0u8; MAX_PRIVATE]).is_ok());
        let e = conn_param(7, &[0u8; MAX_PRIVATE + 1]).err().unwrap().to_string();
        assert!(e.contains("197 bytes"), "{e}");
    }

    #[test]
    fn sockaddr_v4_is_network_order() {
        let s = SockAddr::new("10.198.0.2:4791".parse().unwrap());
        // SAFETY: SockAddr::new wrote a sockaddr_in for a V4 address.
        let sin = unsafe { &*(&s.0 as *const _ as *const libc::sockaddr_in) };
        assert_eq!(sin.sin_family as i32, libc::AF_INET);
        assert_eq!(u16::from_be(sin.sin_port), 4791);
        assert_eq!(u32::from_be(sin.sin_addr.s_addr), u32::from(std::net::Ipv4Addr::new(10, 198, 0, 2)));
    }
}
