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
use crate::transport::ib::{self, vdev, IbNet};
use crate::transport::tcp::{self, TcpConnecting, TcpListen, TcpNet};
use crate::transport::{Completion, DeviceProps, MemKind, RawBuf, RecvBuf};

/// The network chosen at init.
pub enum Net {
    /// TCP sockets.
    Tcp(TcpNet),
    /// ibverbs RC QPs (InfiniBand, RoCE).
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
        crate::log::set_max_level(cfg.nccl_debug);
        let net = select_net(&cfg)?;
        let p = Plugin { cfg, net };
        p.log_devices();
        crate::stats::configure(&p.cfg.stats_dir, p.cfg.stats_interval.get(), p.transport_name());
        Ok(p)
    }

    fn log_devices(&self) {
        match &self.net {
            Net::Tcp(t) => {
                let list: Vec<String> =
                    t.interfaces().iter().enumerate().map(|(i, f)| format!("[{i}]{}:{}", f.name, f.addr.ip())).collect();
                let c = t.stream_cfg();
                tracing::info!("using TCP on {} ({} stream(s) per connection; {})", list.join(" "), c.nstreams, t.helper_reason());
            }
            Net::Ib(n) => {
                let c = n.conn_cfg();
                tracing::info!(
                    "using verbs on {} ({} QP(s) per connection{}, NCCL_IB_TIMEOUT={} NCCL_IB_RETRY_CNT={})",
                    n.describe(),
                    c.nqps,
                    if c.split { ", split" } else { "" },
                    c.timeout,
                    c.retry_cnt
                );
            }
        }
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
            Net::Ib(n) => n.members(dev.max(0) as usize).map(|v| v.into_iter().map(|x| x as i32).collect()).unwrap_or_else(|_| vec![dev]),
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
                let (l, h) = t.listen(dev, tos_of(ctx.traffic_class()))?;
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
    /// `NCCL_NET_ID_UNDEF`). A physical verbs port is its own rail, numbered
    /// by its place in the device list, which is PCI order and so the same
    /// rail on every node (device.rs); that tells NCCL what its default
    /// (same NIC and port) already assumes, and keeps NCCL_NET_MERGE_POLICY=RAIL
    /// from fusing different ports. A merged device spans rails: undefined,
    /// as NCCL's net_ib reports for members of different rails. Planes and the
    /// TCP transport's interfaces: undefined (nothing here knows them).
    pub fn rail_plane(&self, dev: i32) -> (Option<i16>, Option<i16>) {
        match &self.net {
            Net::Ib(n) => {
                let m = self.vdev_members(dev);
                let physical = dev >= 0 && (dev as usize) < n.ndev() && m == [dev];
                (physical.then(|| i16::try_from(dev).ok()).flatten(), None)
            }
            Net::Tcp(_) => (None, None),
        }
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
                Net::Tcp(t) => Connecting::Tcp(t.connect(&h, tos_of(tc))?),
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
                    Connecting::Tcp(c) => Comm::new(CommBody::Send(Mutex::new(AnySend::Tcp(c.into_send_comm()))), ctx.member()),
                    Connecting::Ib(c) => Comm::new(
                        CommBody::Send(Mutex::new(match c.into_send()? {
                            vdev::AnySend::One(s) => AnySend::Ib(Box::new(s)),
                            vdev::AnySend::Multi(s) => AnySend::IbMulti(Box::new(s)),
                        })),
                        ctx.member(),
                    ),
                };
                c.stats = self.comm_stats(&c.body, dev, ctx.comm_id());
                Ok(Some(c))
            }
            Ok(false) => {
                let token = tcp::connect::random_u64();
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
            AnyListen::Tcp(t) => t.accept()?.map(|r| Comm::new(CommBody::Recv(Mutex::new(AnyRecv::Tcp(r))), ctx.member())),
            AnyListen::Ib(l) => l.accept()?.map(|r| {
                Comm::new(
                    CommBody::Recv(Mutex::new(match r {
                        vdev::AnyRecv::One(r) => AnyRecv::Ib(Box::new(r)),
                        vdev::AnyRecv::Multi(r) => AnyRecv::IbMulti(Box::new(r)),
                    })),
                    ctx.member(),
                )
            }),
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
        let qp_sets = |rails: Vec<(usize, std::sync::Arc<stats::QpTable>)>| -> Vec<(String, std::sync::Arc<stats::QpTable>)> {
            rails.into_iter().map(|(d, t)| (self.dev_name(d as i32), t)).collect()
        };
        let (way, peer, qps) = match body {
            CommBody::Send(s) => match &*s.lock() {
                AnySend::Tcp(t) => (stats::Way::Send, t.peer().to_string(), Vec::new()),
                AnySend::Ib(c) => (stats::Way::Send, c.peer().to_string(), qp_sets(vec![(c.dev(), c.qp_table())])),
                AnySend::IbMulti(c) => (
                    stats::Way::Send,
                    c.rails().first().map_or_else(String::new, |r| r.peer().to_string()),
                    qp_sets(c.rails().iter().map(|r| (r.dev(), r.qp_table())).collect()),
                ),
            },
            CommBody::Recv(r) => match &*r.lock() {
                AnyRecv::Tcp(t) => (stats::Way::Recv, t.peer().to_string(), Vec::new()),
                AnyRecv::Ib(c) => (stats::Way::Recv, c.peer().to_string(), qp_sets(vec![(c.dev(), c.qp_table())])),
                AnyRecv::IbMulti(c) => (
                    stats::Way::Recv,
                    c.rails().first().map_or_else(String::new, |r| r.peer().to_string()),
                    qp_sets(c.rails().iter().map(|r| (r.dev(), r.qp_table())).collect()),
                ),
            },
        };
        let nccl_comm = (nccl_comm != 0).then(|| format!("{nccl_comm:#018x}"));
        stats::open_comm(way, self.transport_name(), self.dev_name(dev), peer, nccl_comm, qps)
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
                Ok(MemHandle { buf, kind, ib: None, ib_rails: Vec::new() })
            }
            Net::Ib(n) => {
                if let Some((members, access)) = ib_members_access(n, comm) {
                    // merged device: one registration per member (vdev.rs)
                    // SAFETY: as below, for each member.
                    let rails = members.iter().map(|&d| unsafe { n.reg_mr(d, buf, kind, access) }).collect::<Result<Vec<_>>>()?;
                    return Ok(MemHandle { buf, kind, ib: None, ib_rails: rails });
                }
                let (dev, access) = ib_dev_access(n, comm)?;
                // SAFETY: NCCL's regMr contract: the buffer stays mapped until deregMr,
                // which drops the MemHandle and with it this registration.
                let mr = unsafe { n.reg_mr(dev, buf, kind, access)? };
                Ok(MemHandle { buf, kind, ib: Some(mr), ib_rails: Vec::new() })
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
                if let Some((members, access)) = ib_members_access(n, comm) {
                    // SAFETY: as below, for each member (fd is still open during this call).
                    let rails =
                        members.iter().map(|&d| unsafe { n.reg_mr_dmabuf(d, buf, fd, offset, access) }).collect::<Result<Vec<_>>>()?;
                    return Ok(MemHandle { buf, kind: MemKind::Cuda, ib: None, ib_rails: rails });
                }
                let (dev, access) = ib_dev_access(n, comm)?;
                // SAFETY: NCCL's regMrDmaBuf contract: the memory stays allocated
                // until deregMr drops the MemHandle (the fd may close at once).
                let mr = unsafe { n.reg_mr_dmabuf(dev, buf, fd, offset, access)? };
                Ok(MemHandle { buf, kind: MemKind::Cuda, ib: Some(mr), ib_rails: Vec::new() })
            }
        }
    }
}

/// A comm on a merged device: its members and the access registrations need.
fn ib_members_access(n: &IbNet, comm: &Comm) -> Option<(Vec<usize>, ib::Access)> {
    match &comm.body {
        CommBody::Send(s) => match &*s.lock() {
            AnySend::IbMulti(c) => Some((c.members(), ib::Access::LOCAL_READ)),
            _ => None,
        },
        CommBody::Recv(r) => match &*r.lock() {
            AnyRecv::IbMulti(c) => {
                let m = c.members();
                let access = if m.iter().any(|&d| n.recv_access_on(d).covers(ib::Access::REMOTE_READ)) {
                    ib::Access::REMOTE_WRITE.with(ib::Access::REMOTE_READ)
                } else {
                    ib::Access::REMOTE_WRITE
                };
                Some((m, access))
            }
            _ => None,
        },
    }
}

/// The device of a verbs comm and the access its registrations need:
/// remote write only where the peer writes (receive buffers).
fn ib_dev_access(n: &IbNet, comm: &Comm) -> Result<(usize, ib::Access)> {
    match &comm.body {
        CommBody::Send(s) => match &*s.lock() {
            AnySend::Ib(c) => Ok((c.dev(), ib::Access::LOCAL_READ)),
            AnySend::Tcp(_) | AnySend::IbMulti(_) => {
                Err(Error::Internal("TCP or merged comm where a plain verbs comm was expected".into()))
            }
        },
        CommBody::Recv(r) => match &*r.lock() {
            AnyRecv::Ib(c) => {
                let d = c.dev();
                Ok((d, n.recv_access_on(d)))
            }
            AnyRecv::Tcp(_) | AnyRecv::IbMulti(_) => {
                Err(Error::Internal("TCP or merged comm where a plain verbs comm was expected".into()))
            }
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

/// The IP TOS byte for a traffic class (0..255 checked by the context; a
/// v10 connect's class out of range is ignored, as over verbs).
fn tos_of(tc: Option<i32>) -> Option<u8> {
    tc.and_then(|t| u8::try_from(t).ok())
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
    Tcp(TcpConnecting),
    Ib(Box<vdev::Connecting>),
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
    Ib(Box<vdev::Listen>),
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
    /// The context it was made under (declared last: dropped after the body).
    ctx: Member,
}

impl Drop for Comm {
    fn drop(&mut self) {
        if let Some(s) = &self.stats {
            // its counts join the device totals; the last comm's close writes the file
            stats::close_comm(s);
        }
    }
}

/// Send or receive side.
pub enum CommBody {
    /// Sending end.
    Send(Mutex<AnySend>),
    /// Receiving end.
    Recv(Mutex<AnyRecv>),
}

/// Transport-specific sending end.
pub enum AnySend {
    /// TCP.
    Tcp(tcp::SendComm),
    /// Verbs.
    Ib(Box<ib::SendComm>),
    /// Verbs on a merged device (one comm per member).
    IbMulti(Box<vdev::MultiSend>),
}

/// Transport-specific receiving end.
#[allow(clippy::large_enum_variant)] // the verbs comm is boxed; the TCP one stays inline (its owner's call)
pub enum AnyRecv {
    /// TCP.
    Tcp(tcp::RecvComm),
    /// Verbs.
    Ib(Box<ib::RecvComm>),
    /// Verbs on a merged device (one comm per member).
    IbMulti(Box<vdev::MultiRecv>),
}

/// A registration NCCL holds.
pub struct MemHandle {
    /// What was registered.
    pub buf: RawBuf,
    /// Host or device memory.
    pub kind: MemKind,
    /// The verbs registration (dropped, and its cache reference released, with the handle).
    pub ib: Option<ib::IbMr>,
    /// On a merged device: one registration per member, in member order (else empty).
    pub ib_rails: Vec<ib::IbMr>,
}

/// Member registrations of `m`, for a merged comm.
fn rail_mrs(m: Option<&MemHandle>) -> [Option<&ib::IbMr>; vdev::MAX_MEMBERS] {
    let mut v = [None; vdev::MAX_MEMBERS];
    if let Some(m) = m {
        for (o, x) in v.iter_mut().zip(&m.ib_rails) {
            *o = Some(x);
        }
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
        Comm { body, failed: OnceCell::new(), stats: None, ctx }
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
            AnySend::Ib(c) => unsafe { c.isend_p(buf, tag, mr.and_then(|m| m.ib.as_ref()), parent) },
            // SAFETY: `buf` stays readable until the request completes (this fn's
            // contract), and so do the rails' registrations: NCCL deregisters only after.
            AnySend::IbMulti(c) => unsafe { c.isend_p(buf, tag, &rail_mrs(mr), parent) },
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
        r: &Mutex<AnyRecv>,
        bufs: &[RecvBuf],
        mrs: &[Option<&MemHandle>],
        parents: &[Option<Parent>],
    ) -> Result<Option<ReqId>> {
        match &mut *r.lock() {
            // SAFETY: every buffer stays writable until the request completes
            // (this fn's contract), which is all the TCP irecv requires.
            AnyRecv::Tcp(t) => unsafe { t.irecv_p(bufs, parents) },
            AnyRecv::Ib(c) => {
                let mut ibm: [Option<&ib::IbMr>; crate::transport::MAX_RECVS] = [None; crate::transport::MAX_RECVS];
                for (o, m) in ibm.iter_mut().zip(mrs) {
                    *o = m.and_then(|m| m.ib.as_ref());
                }
                // SAFETY: every buffer stays writable until the request completes (this
                // fn's contract), and its registration too: NCCL deregisters only after.
                unsafe { c.irecv_p(bufs, &ibm[..mrs.len().min(crate::transport::MAX_RECVS)], parents) }
            }
            AnyRecv::IbMulti(c) => {
                const N: usize = crate::transport::MAX_RECVS;
                let mut per = [[None; vdev::MAX_MEMBERS]; N];
                for (p, m) in per.iter_mut().zip(mrs) {
                    *p = rail_mrs(*m);
                }
                let refs: [&[Option<&ib::IbMr>]; N] = std::array::from_fn(|j| &per[j][..]);
                // SAFETY: every buffer stays writable until the request completes (this
                // fn's contract), and so do the rails' registrations: NCCL deregisters only after.
                unsafe { c.irecv_p(bufs, &refs[..mrs.len().min(N)], parents) }
            }
        }
    }

    /// Flush received data to the GPU; `Ok(None)`: nothing to flush.
    pub fn iflush(&self, bufs: &[RawBuf], mrs: &[Option<&MemHandle>]) -> Result<Option<ReqId>> {
        let CommBody::Recv(r) = &self.body else { return Err(Error::InvalidArg("iflush on a send comm".into())) };
        const N: usize = crate::transport::MAX_RECVS;
        match &mut *r.lock() {
            AnyRecv::Tcp(_) => Ok(None),
            AnyRecv::Ib(c) => {
                let mut ibm: [Option<&ib::IbMr>; N] = [None; N];
                for (o, m) in ibm.iter_mut().zip(mrs) {
                    *o = m.and_then(|m| m.ib.as_ref());
                }
                c.iflush(bufs, &ibm[..mrs.len().min(N)])
            }
            AnyRecv::IbMulti(c) => {
                let mut per = [[None; vdev::MAX_MEMBERS]; N];
                for (p, m) in per.iter_mut().zip(mrs) {
                    *p = rail_mrs(*m);
                }
                let refs: [&[Option<&ib::IbMr>]; N] = std::array::from_fn(|j| &per[j][..]);
                c.iflush(bufs, &refs[..mrs.len().min(N)])
            }
        }
    }

    /// Drive and check one request.
    pub fn test(&self, id: ReqId) -> Result<Option<Completion>> {
        let r = self.test_inner(id);
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

    fn test_inner(&self, id: ReqId) -> Result<Option<Completion>> {
        match &self.body {
            CommBody::Send(s) => match &mut *s.lock() {
                AnySend::Tcp(t) => t.test(id),
                AnySend::Ib(c) => c.test(id),
                AnySend::IbMulti(c) => c.test(id),
            },
            CommBody::Recv(r) => match &mut *r.lock() {
                AnyRecv::Tcp(t) => t.test(id),
                AnyRecv::Ib(c) => c.test(id),
                AnyRecv::IbMulti(c) => c.test(id),
            },
        }
    }
}
