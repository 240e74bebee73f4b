//! The plugin core: one process-wide [`Plugin`] chosen at `init`, the comm
//! objects NCCL holds, and the operations the vtable slots call. Safe Rust:
//! the raw pointers of NCCL stop at `abi/`.
use std::collections::HashMap;
use std::sync::Arc;

use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use crate::config::{Config, TransportChoice};
use crate::context::{Member, NetContext};
use crate::error::{Error, Result};
use crate::profiler::Parent;
use crate::proto::handle::{Handle, HANDLE_SIZE};
use crate::proto::pool::ReqId;
use crate::stats;
use crate::transport::ib::{self, IbNet};
use crate::transport::tcp::{self, TcpConnecting, TcpListen, TcpNet};
use crate::transport::{Completion, DeviceProps, MemKind, RawBuf, RecvBuf};

/// The network chosen at init.
pub enum Net {
    /// TCP sockets.
    Tcp(TcpNet),
    /// ibverbs RC QPs (InfiniBand, RoCE, and iWARP through librdmacm).
    Ib(IbNet),
}

/// Process-wide plugin state.
pub struct Plugin {
    /// The parsed knob table.
    pub cfg: Config,
    /// The transport in use.
    pub net: Net,
}

static PLUGIN: crate::unload::Global<std::result::Result<Plugin, Error>> = crate::unload::Global::new();

/// Initialise (once per process; later calls return the first outcome).
pub fn init() -> Result<&'static Plugin> {
    crate::log::install();
    PLUGIN.get_or_init(Plugin::create).as_ref().map_err(Clone::clone)
}

/// The plugin, if `init` succeeded.
pub fn get() -> Result<&'static Plugin> {
    match PLUGIN.get() {
        Some(Ok(p)) => Ok(p),
        _ => Err(Error::NotInitialised),
    }
}

impl Plugin {
    fn create() -> Result<Plugin> {
        let cfg = Config::from_env()?;
        crate::fault::arm(&cfg.fault_panic)?;
        crate::fault::arm_qp(&cfg.fault_qp_error, cfg.fault_seed.get() as u64)?;
        crate::fault::arm_rtr(cfg.fault_rtr.get() as u32);
        crate::log::set_max_level(cfg.nccl_debug);
        let net = select_net(&cfg)?;
        let p = Plugin { cfg, net };
        p.log_devices();
        crate::stats::configure(&p.cfg.stats_dir, p.cfg.stats_interval.get(), p.transport_name());
        Ok(p)
    }

    fn log_devices(&self) {
        let line = match &self.net {
            Net::Tcp(t) => t.summary(),
            Net::Ib(n) => n.summary(),
        };
        tracing::info!("{line}");
    }

    /// Transport name for logs and the vtable.
    pub fn transport_name(&self) -> &'static str {
        match &self.net {
            Net::Tcp(_) => "socket",
            Net::Ib(_) => "ib",
        }
    }

    /// Number of devices.
    pub fn devices(&self) -> usize {
        match &self.net {
            Net::Tcp(t) => t.ndev(),
            Net::Ib(n) => n.ndev(),
        }
    }

    /// Properties of `dev`.
    pub fn properties(&self, dev: i32) -> Result<DeviceProps> {
        let dev = usize::try_from(dev).map_err(|_| Error::InvalidArg(format!("device {dev} is negative")))?;
        match &self.net {
            Net::Tcp(t) => t.props(dev),
            Net::Ib(n) => n.props(dev),
        }
    }

    /// NCCL's makeVDevice (ABI v9+): fuse `members` into one device,
    /// appended after the others; verbs only.
    pub fn make_vdevice(&self, members: &[i32]) -> Result<i32> {
        let m: Vec<usize> = members
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| Error::InvalidArg(format!("makeVDevice: device {d} is negative"))))
            .collect::<Result<_>>()?;
        match &self.net {
            Net::Tcp(_) => {
                Err(Error::Usage("makeVDevice: the TCP transport does not fuse devices (it stripes over streams instead)".into()))
            }
            Net::Ib(n) => Ok(n.make_vdevice(&m)? as i32),
        }
    }

    /// The physical devices behind `dev` (vProps): itself unless merged.
    pub fn vdev_members(&self, dev: i32) -> Vec<i32> {
        match &self.net {
            Net::Ib(n) => n.vprops_members(dev),
            Net::Tcp(_) => vec![dev],
        }
    }

    /// Listen on `dev` for context `ctx`; fills NCCL's handle. The comms
    /// accepted on it belong to `ctx` (on TCP their sockets carry its traffic
    /// class; over verbs the receiver follows the sender's class).
    pub fn listen(&self, ctx: &Arc<NetContext>, dev: i32, handle: &mut [u8; HANDLE_SIZE]) -> Result<ListenComm> {
        ctx.check_live("listen")?;
        let dev = usize::try_from(dev).map_err(|_| Error::InvalidArg(format!("device {dev} is negative")))?;
        match &self.net {
            Net::Tcp(t) => {
                let (l, h) = t.listen(dev, ctx.traffic_class())?;
                h.encode(handle);
                Ok(ListenComm { inner: Mutex::new(AnyListen::Tcp(Box::new(l))), ctx: ctx.member(), dev })
            }
            Net::Ib(n) => {
                // plain or merged (vdev.rs): the member listeners' handles in one
                let (l, h) = n.listen_any(dev)?;
                h.encode(handle);
                Ok(ListenComm { inner: Mutex::new(AnyListen::Ib(Box::new(l))), ctx: ctx.member(), dev })
            }
        }
    }

    /// The rail and plane of `dev` (ABI v12 `railId`/`planeId`; `None` =
    /// `NCCL_NET_ID_UNDEF`): verbs ports are rails ([`IbNet::rail`]); planes
    /// and the TCP transport's interfaces: undefined (nothing here knows them).
    pub fn rail_plane(&self, dev: i32) -> (Option<i16>, Option<i16>) {
        match &self.net {
            Net::Ib(n) => (n.rail(dev), None),
            Net::Tcp(_) => (None, None),
        }
    }

    /// ABI v9+: NCCL fuses devices itself (makeVDevice), so the verbs
    /// transport never self-merges; called by those versions' `init`.
    pub fn nccl_fuses_devices() {
        ib::set_nccl_fuses(true);
    }

    /// Connect to the listener whose handle NCCL passes (the same buffer on
    /// every retry); `Ok(None)` means "call again".
    ///
    /// The connection belongs to `ctx`; its traffic class is `traffic_class`
    /// (ABI v10 passes it per connect) or else the context's (v11+).
    pub fn connect(
        &self,
        ctx: &Arc<NetContext>,
        dev: i32,
        handle: &mut [u8; HANDLE_SIZE],
        traffic_class: Option<i32>,
    ) -> Result<Option<Comm>> {
        ctx.check_live("connect")?;
        let h = Handle::decode(handle)?;
        let tc = traffic_class.or(ctx.traffic_class());
        let mut st = if h.stage == 0 {
            match &self.net {
                Net::Tcp(t) => {
                    let dev = usize::try_from(dev).map_err(|_| Error::InvalidArg(format!("device {dev} is negative")))?;
                    Connecting::Tcp(Box::new(t.connect(dev, &h, tc)?))
                }
                Net::Ib(n) => {
                    let dev = usize::try_from(dev).map_err(|_| Error::InvalidArg(format!("device {dev} is negative")))?;
                    Connecting::Ib(Box::new(n.connect_any(dev, handle, &h, tc)?))
                }
            }
        } else {
            let (st, _, owner) = CONNECTING.lock().as_mut().and_then(|m| m.remove(&h.stage)).ok_or_else(|| {
                Error::InvalidArg(format!(
                    "connect handle carries progress token {:#x} that this process never issued, or whose context was \
                     finalized (handle reused or corrupted)",
                    h.stage
                ))
            })?;
            if owner != ctx.serial() {
                Handle::set_stage(handle, 0);
                return Err(Error::InvalidArg(format!(
                    "connect: this handle's connection was started under another plugin context than communicator {:#x}'s \
                     (a handle shared between communicators)",
                    ctx.comm_id()
                )));
            }
            st
        };
        let done = match &mut st {
            Connecting::Tcp(c) => c.progress(),
            Connecting::Ib(c) => c.progress(),
        };
        match done {
            Ok(true) => {
                Handle::set_stage(handle, 0);
                let mut c = match st {
                    Connecting::Tcp(c) => Comm::new(CommBody::Send(CommLock::new(AnySend::Tcp(c.into_send_comm()?))), ctx.member()),
                    Connecting::Ib(c) => Comm::new(CommBody::Send(CommLock::new(AnySend::Ib(c.into_send()?))), ctx.member()),
                };
                c.stats = self.comm_stats(&c.body, dev, ctx.comm_id());
                Ok(Some(c))
            }
            Ok(false) => {
                let token = crate::random::random_u64();
                let mut g = CONNECTING.lock();
                let m = g.get_or_insert_with(HashMap::new);
                // NCCL calls connect again and again until it is done, and
                // each call re-files the attempt; one left alone for this
                // long was abandoned (e.g. the communicator was aborted):
                // free its sockets and queue pairs.
                let now = std::time::Instant::now();
                m.retain(|_, (_, t, _)| now.duration_since(*t) < ABANDONED_CONNECT);
                m.insert(token, (st, now, ctx.serial()));
                Handle::set_stage(handle, token);
                Ok(None)
            }
            Err(e) => {
                Handle::set_stage(handle, 0);
                Err(e)
            }
        }
    }

    /// Accept; `Ok(None)` means "call again".
    /// The receive comm belongs to the listen comm's context.
    pub fn accept(&self, l: &ListenComm) -> Result<Option<Comm>> {
        let ctx = l.ctx.ctx();
        ctx.check_live("accept")?;
        let mut g = l.inner.lock();
        let c = match &mut *g {
            AnyListen::Tcp(t) => t.accept()?.map(|r| Comm::new(CommBody::Recv(CommLock::new(AnyRecv::Tcp(r))), ctx.member())),
            AnyListen::Ib(l) => l.accept()?.map(|r| Comm::new(CommBody::Recv(CommLock::new(AnyRecv::Ib(r))), ctx.member())),
        };
        drop(g);
        Ok(c.map(|mut c| {
            c.stats = self.comm_stats(&c.body, l.dev as i32, ctx.comm_id());
            c
        }))
    }

    /// NCCL's name of device `dev`.
    fn dev_name(&self, dev: i32) -> String {
        self.properties(dev).map_or_else(|_| format!("dev{dev}"), |p| p.name.to_string_lossy().into_owned())
    }

    /// Counters of a new comm on `dev` of NCCL communicator `nccl_comm`
    /// (0: unknown, ABI v6-v10) for the statistics file (None when off).
    fn comm_stats(&self, body: &CommBody, dev: i32, nccl_comm: u64) -> Option<std::sync::Arc<stats::CommStats>> {
        if !stats::enabled() {
            return None;
        }
        let ib_stats = |side: ib::Side<'_>| match &self.net {
            Net::Ib(n) => n.stats_of(side),
            Net::Tcp(_) => (String::new(), Vec::new()),
        };
        let (way, peer, qps, recovery) = match body {
            CommBody::Send(s) => match &*s.lock() {
                AnySend::Tcp(t) => (stats::Way::Send, t.peer().to_string(), Vec::new(), t.recovery_stats()),
                AnySend::Ib(c) => {
                    let (peer, qps) = ib_stats(ib::Side::Send(c));
                    (stats::Way::Send, peer, qps, Default::default())
                }
            },
            CommBody::Recv(r) => match &*r.lock() {
                AnyRecv::Tcp(t) => (stats::Way::Recv, t.peer().to_string(), Vec::new(), t.recovery_stats()),
                AnyRecv::Ib(c) => {
                    let (peer, qps) = ib_stats(ib::Side::Recv(c));
                    (stats::Way::Recv, peer, qps, Default::default())
                }
            },
        };
        let nccl_comm = (nccl_comm != 0).then(|| format!("{nccl_comm:#018x}"));
        stats::open_comm(way, self.transport_name(), self.dev_name(dev), peer, nccl_comm, qps, recovery)
    }

    /// Register memory for `comm`.
    pub fn reg_mr(&self, comm: &Comm, buf: RawBuf, kind: MemKind) -> Result<MemHandle> {
        match &self.net {
            Net::Tcp(_) => {
                if kind != MemKind::Host {
                    return Err(Error::Usage(format!(
                        "the TCP transport moves host memory only (ptrSupport=HOST) but NCCL registered {kind:?} memory at {:p}; \
                         GPU buffers need the verbs transport with GPUDirect",
                        buf.ptr
                    )));
                }
                Ok(MemHandle { buf, kind, reg: MemReg::Tcp })
            }
            Net::Ib(n) => {
                let plan = ib_side(comm, |side| n.reg_plan(side))?;
                // SAFETY: NCCL's regMr contract: the buffer stays mapped until deregMr,
                // which drops the MemHandle and with it this registration.
                let reg = unsafe { n.register(&plan, buf, kind)? };
                Ok(MemHandle { buf, kind, reg: MemReg::Ib(reg) })
            }
        }
    }

    /// Register a dma-buf (GPU memory): only the verbs transport can, on
    /// devices whose ptrSupport has DMABUF (else the error says why not).
    pub fn reg_mr_dmabuf(&self, comm: &Comm, buf: RawBuf, fd: i32, offset: u64) -> Result<MemHandle> {
        match &self.net {
            Net::Tcp(_) => Err(Error::Usage(format!(
                "regMrDmaBuf({:p}, {} bytes): the {} transport has no dma-buf support (ptrSupport lacks NCCL_PTR_DMABUF)",
                buf.ptr,
                buf.len,
                self.transport_name()
            ))),
            Net::Ib(n) => {
                let plan = ib_side(comm, |side| n.reg_plan(side))?;
                // SAFETY: NCCL's regMrDmaBuf contract: the memory stays allocated
                // until deregMr drops the MemHandle (the fd may close at once).
                let reg = unsafe { n.register_dmabuf(&plan, buf, fd, offset)? };
                Ok(MemHandle { buf, kind: MemKind::Cuda, reg: MemReg::Ib(reg) })
            }
        }
    }
}

/// `f` on the verbs end of `comm`, under its lock.
fn ib_side<R>(comm: &Comm, f: impl FnOnce(ib::Side<'_>) -> R) -> Result<R> {
    let tcp = || Error::Internal("TCP comm where a verbs comm was expected".into());
    match &comm.body {
        CommBody::Send(s) => match &*s.lock() {
            AnySend::Ib(c) => Ok(f(ib::Side::Send(c))),
            AnySend::Tcp(_) => Err(tcp()),
        },
        CommBody::Recv(r) => match &*r.lock() {
            AnyRecv::Ib(c) => Ok(f(ib::Side::Recv(c))),
            AnyRecv::Tcp(_) => Err(tcp()),
        },
    }
}

/// The transport `init` chooses: `socket` is TCP; `ib` is verbs or an error
/// saying what was found; `auto` is verbs when an active RDMA port exists,
/// else TCP with one INFO line saying why.
pub fn select_net(cfg: &Config) -> Result<Net> {
    match cfg.transport {
        TransportChoice::Socket => Ok(Net::Tcp(TcpNet::new(cfg)?)),
        TransportChoice::Ib => match IbNet::new(cfg) {
            Ok(n) => Ok(Net::Ib(n)),
            Err(e) => Err(Error::Usage(format!("RUSTNET_TRANSPORT=ib, but no usable RDMA device: {e}"))),
        },
        TransportChoice::Auto => match IbNet::new(cfg) {
            Ok(n) => Ok(Net::Ib(n)),
            Err(e) => {
                tracing::info!("no RDMA devices ({}): using TCP", auto_reason(&e));
                Ok(Net::Tcp(TcpNet::new(cfg)?))
            }
        },
    }
}

fn auto_reason(e: &Error) -> String {
    match e {
        Error::Usage(m) => m.clone(),
        other => other.to_string(),
    }
}

/// Unload: drop the plugin and the connections in progress. The caller
/// ([`crate::unload`]) makes sure no call is running and no handle is alive.
///
/// # Safety
/// No reference returned by [`get`]/[`init`] may be alive or used again.
pub(crate) unsafe fn teardown() {
    drop(CONNECTING.lock().take());
    // SAFETY: this fn's contract is Global::clear's: no reference from
    // get/init is alive or used again (the unload hook checked that no call
    // is inside the plugin and no handle is alive).
    unsafe { PLUGIN.clear() };
}

/// Drop the connect attempts in progress under the context numbered
/// `serial` (its `finalize`); how many there were.
pub(crate) fn drop_connecting_of(serial: u64) -> usize {
    let mut g = CONNECTING.lock();
    let Some(m) = g.as_mut() else { return 0 };
    let before = m.len();
    m.retain(|_, (_, _, owner)| *owner != serial);
    before - m.len()
}

/// Connect attempts in progress (NCCL may still call connect for them).
pub(crate) fn connecting() -> usize {
    CONNECTING.lock().as_ref().map_or(0, HashMap::len)
}

/// Outgoing connections in progress, by the token stored in NCCL's handle:
/// the attempt, when it was last touched, the serial of its context.
#[allow(clippy::type_complexity)]
static CONNECTING: Mutex<Option<HashMap<u64, (Connecting, std::time::Instant, u64)>>> = Mutex::new(None);

/// An in-progress connect not retried for this long is dropped.
const ABANDONED_CONNECT: std::time::Duration = std::time::Duration::from_secs(120);

enum Connecting {
    Tcp(Box<TcpConnecting>),
    Ib(Box<ib::Connecting>),
}

/// Listening endpoint NCCL holds.
pub struct ListenComm {
    inner: Mutex<AnyListen>,
    /// The context it was made under.
    ctx: Member,
    /// The device it listens on (names the accepted comms' device).
    dev: usize,
}

impl ListenComm {
    /// The context it belongs to.
    pub fn context(&self) -> &Arc<NetContext> {
        self.ctx.ctx()
    }
}

enum AnyListen {
    Tcp(Box<TcpListen>),
    Ib(Box<ib::Listen>),
}

/// A send or receive comm NCCL holds.
pub struct Comm {
    /// What it is.
    pub body: CommBody,
    /// Set when a call on this comm panicked: what panicked. Its state may
    /// be half-updated, so every later call but close fails naming it.
    failed: OnceCell<String>,
    /// Its counters in the statistics file (`RUSTNET_STATS_DIR`), if on.
    stats: Option<std::sync::Arc<stats::CommStats>>,
    /// Its watch by the verbs recovery keeper (a verbs comm that may
    /// recover, once NCCL holds its handle); ended before the comm goes.
    /// (std's lock: see crate::thread.)
    keeping: std::sync::Mutex<Option<ib::keeper::Registration>>,
    /// The context it was made under (declared last: dropped after the body).
    ctx: Member,
}

/// A comm's address, for the keeper's thread.
struct KeptComm(*const Comm);

// SAFETY: a Comm is Sync (its body behind a lock, its other fields
// immutable or atomic), so its address may be used from another thread;
// the keeper uses it only while the comm's registration lives, which
// `stop_keeping` ends before the comm is freed.
unsafe impl Send for KeptComm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // (closeSend/closeRecv ended it already, before taking the box)
        self.stop_keeping();
        if let Some(s) = &self.stats {
            // its counts join the device totals; the last comm's close writes the file
            stats::close_comm(s);
        }
    }
}

/// Send or receive side.
pub enum CommBody {
    /// Sending end.
    Send(CommLock<AnySend>),
    /// Receiving end.
    Recv(CommLock<AnyRecv>),
}

/// A comm's lock ([`crate::thread::Lock`]): the recovery keeper's thread
/// takes it too (`try_lock`), and an NCCL thread that waits for it must not
/// park in parking_lot, which would give it thread-local state of ours and
/// keep the library mapped after `dlclose` (`crate::thread`).
pub type CommLock<T> = crate::thread::Lock<T>;

/// Transport-specific sending end: one arm per transport, each the
/// transport's own comm (the verbs one hides plain and merged devices).
#[allow(clippy::large_enum_variant)] // the verbs comm is boxed; the TCP one stays inline (its owner's call)
pub enum AnySend {
    /// TCP.
    Tcp(tcp::SendComm),
    /// Verbs.
    Ib(ib::IbSend),
}

/// Transport-specific receiving end.
#[allow(clippy::large_enum_variant)] // the verbs comm is boxed; the TCP one stays inline (its owner's call)
pub enum AnyRecv {
    /// TCP.
    Tcp(tcp::RecvComm),
    /// Verbs.
    Ib(ib::IbRecv),
}

/// A registration NCCL holds.
pub struct MemHandle {
    /// What was registered.
    pub buf: RawBuf,
    /// Host or device memory.
    pub kind: MemKind,
    /// The transport's registration (dropped, and released, with the handle).
    pub reg: MemReg,
}

/// Transport-specific registration.
pub enum MemReg {
    /// TCP registers nothing.
    Tcp,
    /// The verbs registration (one per member on a merged device).
    Ib(ib::IbReg),
}

impl MemHandle {
    /// Its verbs registration, if any.
    #[inline]
    fn ib(&self) -> Option<&ib::IbReg> {
        match &self.reg {
            MemReg::Ib(r) => Some(r),
            MemReg::Tcp => None,
        }
    }
}

/// The verbs registrations of a grouped call's `mrs` (none past MAX_RECVS).
#[inline]
fn ib_regs<'a>(mrs: &[Option<&'a MemHandle>]) -> [Option<&'a ib::IbReg>; crate::transport::MAX_RECVS] {
    let mut v = [None; crate::transport::MAX_RECVS];
    for (o, m) in v.iter_mut().zip(mrs) {
        *o = m.and_then(MemHandle::ib);
    }
    v
}

/// Which way a request goes (for `test`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// A send.
    Send,
    /// A receive.
    Recv,
}

impl Comm {
    fn new(body: CommBody, ctx: Member) -> Comm {
        Comm { body, failed: OnceCell::new(), stats: None, keeping: std::sync::Mutex::new(None), ctx }
    }

    /// NCCL holds this comm now, at this address until its close: a verbs
    /// comm that may recover is watched by the recovery keeper
    /// ([`ib::keeper`]), so that it recovers even while NCCL calls nothing
    /// on it.
    ///
    /// # Safety
    /// `self` stays at this address until [`Comm::stop_keeping`] returned
    /// (the handle table's close calls it before it frees the comm).
    pub unsafe fn start_keeping(&self) {
        let fds = match &self.body {
            CommBody::Send(s) => match &*s.lock() {
                AnySend::Ib(c) => c.keeper_fds(),
                AnySend::Tcp(_) => None,
            },
            CommBody::Recv(r) => match &*r.lock() {
                AnyRecv::Ib(c) => c.keeper_fds(),
                AnyRecv::Tcp(_) => None,
            },
        };
        let Some(fds) = fds else { return };
        let me = KeptComm(self);
        let mut seen = ib::keeper::Seen::default();
        let look: ib::keeper::Look = Box::new(move |now| {
            let me = &me;
            // SAFETY: the registration this closure belongs to is dropped
            // by stop_keeping before the comm is freed (this fn's
            // contract), and the keeper calls it only while it lives.
            let c = unsafe { &*me.0 };
            c.keep(&mut seen, now)
        });
        let reg = ib::keeper::register(fds, look);
        *self.keeping.lock().unwrap_or_else(|p| p.into_inner()) = reg;
    }

    /// End the keeper's watch (waits for a look in progress).
    pub fn stop_keeping(&self) {
        let reg = self.keeping.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(reg);
    }

    /// The keeper's look: the comm's lock without waiting (NCCL is in the
    /// comm otherwise), then the transport's. A panic fails the comm as one
    /// in NCCL's call would.
    fn keep(&self, seen: &mut ib::keeper::Seen, now: std::time::Instant) -> ib::keeper::Kept {
        use ib::keeper::Kept;
        if self.failed.get().is_some() {
            return Kept::Done;
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &self.body {
            CommBody::Send(s) => match s.try_lock().as_deref_mut() {
                Some(AnySend::Ib(c)) => c.keep(seen, now),
                Some(AnySend::Tcp(_)) => Kept::Done,
                None => Kept::Busy,
            },
            CommBody::Recv(r) => match r.try_lock().as_deref_mut() {
                Some(AnyRecv::Ib(c)) => c.keep(seen, now),
                Some(AnyRecv::Tcp(_)) => Kept::Done,
                None => Kept::Busy,
            },
        }));
        r.unwrap_or_else(|p| {
            let msg = crate::error::panic_text(&*p);
            tracing::warn!("the verbs recovery keeper panicked on a comm ({msg}); the comm is failed");
            self.fail_after_panic("the recovery keeper", &msg);
            Kept::Done
        })
    }

    /// The context it belongs to.
    pub fn context(&self) -> &Arc<NetContext> {
        self.ctx.ctx()
    }

    /// Mark the comm failed after a panic in `slot` (the first panic wins).
    pub fn fail_after_panic(&self, slot: &str, msg: &str) {
        let _ = self.failed.set(format!("{slot} ({msg})"));
        // A TCP helper thread would go on moving bytes with the state the
        // panic left behind: stop it (close joins it).
        match &self.body {
            CommBody::Send(s) => {
                if let AnySend::Tcp(t) = &*s.lock() {
                    t.halt();
                }
            }
            CommBody::Recv(r) => {
                if let AnyRecv::Tcp(t) = &*r.lock() {
                    t.halt();
                }
            }
        }
    }

    /// Err when an earlier panic failed this comm, or its context was
    /// finalized (two atomic loads otherwise).
    #[inline]
    pub fn check_usable(&self) -> Result<()> {
        match self.failed.get() {
            None => self.ctx.ctx().check_comm(),
            Some(why) => Err(Error::Internal(format!(
                "this comm was failed by an earlier panic in {why}; its state is not trusted, only close works now"
            ))),
        }
    }

    /// Send or receive.
    pub fn dir(&self) -> Dir {
        match self.body {
            CommBody::Send(_) => Dir::Send,
            CommBody::Recv(_) => Dir::Recv,
        }
    }

    /// Post a send. `Ok(None)`: no request slot free, NCCL retries.
    ///
    /// # Safety
    /// `buf` must stay readable until the request completes.
    /// `parent`: NCCL's profiler parent handle (events are linked to it).
    pub unsafe fn isend(&self, buf: RawBuf, tag: i32, mr: Option<&MemHandle>, parent: Option<Parent>) -> Result<Option<ReqId>> {
        let CommBody::Send(s) = &self.body else { return Err(Error::InvalidArg("isend on a receive comm".into())) };
        let r = match &mut *s.lock() {
            // SAFETY: `buf` stays readable until the request completes (this
            // fn's contract), which is all the TCP isend requires.
            AnySend::Tcp(t) => unsafe { t.isend_p(buf, tag, parent) },
            // SAFETY: `buf` stays readable until the request completes (this fn's
            // contract), and its registration too: NCCL deregisters only after.
            AnySend::Ib(c) => unsafe { c.isend_p(buf, tag, mr.and_then(MemHandle::ib), parent) },
        };
        if let Some(st) = &self.stats {
            match &r {
                Ok(Some(_)) => st.msgs.add(1),
                Ok(None) => {}
                Err(_) => st.errors.add(1),
            }
        }
        if matches!(r, Ok(Some(_))) {
            // the transport took the send; NCCL never learns its request
            crate::fault::point(crate::fault::Site::IsendQueued);
        }
        r
    }

    /// Post a (grouped) receive.
    ///
    /// # Safety
    /// Every buffer must stay writable until the request completes.
    /// `parents[i]`: NCCL's profiler parent handle of buffer i.
    pub unsafe fn irecv(&self, bufs: &[RecvBuf], mrs: &[Option<&MemHandle>], parents: &[Option<Parent>]) -> Result<Option<ReqId>> {
        let CommBody::Recv(r) = &self.body else { return Err(Error::InvalidArg("irecv on a send comm".into())) };
        // SAFETY: irecv_inner's contract is this fn's: every buffer stays
        // writable until the request completes (our caller promised it).
        let res = unsafe { self.irecv_inner(r, bufs, mrs, parents) };
        if let Some(st) = &self.stats {
            match &res {
                Ok(Some(_)) => st.msgs.add(bufs.len() as u64),
                Ok(None) => {}
                Err(_) => st.errors.add(1),
            }
        }
        res
    }

    /// # Safety
    /// As [`Comm::irecv`].
    unsafe fn irecv_inner(
        &self,
        r: &CommLock<AnyRecv>,
        bufs: &[RecvBuf],
        mrs: &[Option<&MemHandle>],
        parents: &[Option<Parent>],
    ) -> Result<Option<ReqId>> {
        match &mut *r.lock() {
            // SAFETY: every buffer stays writable until the request completes
            // (this fn's contract), which is all the TCP irecv requires.
            AnyRecv::Tcp(t) => unsafe { t.irecv_p(bufs, parents) },
            AnyRecv::Ib(c) => {
                let regs = ib_regs(mrs);
                // SAFETY: every buffer stays writable until the request completes (this
                // fn's contract), and its registration too: NCCL deregisters only after.
                unsafe { c.irecv_p(bufs, &regs[..mrs.len().min(crate::transport::MAX_RECVS)], parents) }
            }
        }
    }

    /// Flush received data to the GPU; `Ok(None)`: nothing to flush.
    pub fn iflush(&self, bufs: &[RawBuf], mrs: &[Option<&MemHandle>]) -> Result<Option<ReqId>> {
        let CommBody::Recv(r) = &self.body else { return Err(Error::InvalidArg("iflush on a send comm".into())) };
        match &mut *r.lock() {
            AnyRecv::Tcp(_) => Ok(None),
            AnyRecv::Ib(c) => c.iflush(bufs, &ib_regs(mrs)[..mrs.len().min(crate::transport::MAX_RECVS)]),
        }
    }

    /// Drive and check one request.
    #[inline]
    pub fn test(&self, id: ReqId) -> Result<Option<Completion>> {
        let r = self.test_inner(id);
        if let Ok(None) = r {
            return r; // (the polling loop's common case: nothing to count)
        }
        if let Some(st) = &self.stats {
            match &r {
                Ok(Some(c)) => {
                    st.completions.add(1);
                    st.bytes.add(c.sizes[..c.n].iter().map(|&s| s as u64).sum());
                }
                Ok(None) => {}
                Err(_) => st.errors.add(1),
            }
        }
        if matches!(r, Ok(Some(_))) {
            // the transport retired the request; NCCL never learns it is done
            crate::fault::point(crate::fault::Site::TestProgressed);
        }
        r
    }

    #[inline]
    fn test_inner(&self, id: ReqId) -> Result<Option<Completion>> {
        match &self.body {
            CommBody::Send(s) => match &mut *s.lock() {
                AnySend::Tcp(t) => t.test(id),
                AnySend::Ib(c) => c.test(id),
            },
            CommBody::Recv(r) => match &mut *r.lock() {
                AnyRecv::Tcp(t) => t.test(id),
                AnyRecv::Ib(c) => c.test(id),
            },
        }
    }
}
