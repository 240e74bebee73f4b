//! Which RDMA ports the verbs transport uses (NCCL's net_ib init): every
//! ACTIVE port of every device, InfiniBand or Ethernet link layer, that
//! passes `NCCL_IB_HCA`, in PCI path order so device i is the same rail on
//! every node. Also what `getProperties` reports for each, and the
//! per-device async-event watcher.
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};

use super::reg::MrCache;
use super::slab::CtlSlab;
use super::verbs::{Context, Lib, Pd, PortAttr};
use crate::config::{Config, NameList};
use crate::error::{Error, Result};
use crate::intern::intern;
use crate::transport::{DeviceProps, MAX_P2P_BYTES, MAX_RECVS};

pub use super::port::{port_state_name, LINK_ETH, LINK_IB};
/// NCCL's MAX_IB_DEVS.
pub const MAX_DEVS: usize = 32;

/// Fatal-event counters of one device context, bumped by its watcher
/// thread and read (one relaxed load) on the data path.
#[derive(Default)]
pub struct Health {
    /// DEVICE_FATAL events.
    pub fatal: AtomicU32,
    /// PORT_ERR events per port number (index 0 unused).
    pub port_err: [AtomicU32; 8],
    /// PORT_ACTIVE events per port number.
    pub port_up: [AtomicU32; 8],
}

impl Health {
    /// Counters for `port` now: compare later with [`Health::changed_since`].
    pub fn snapshot(&self, port: u8) -> (u32, u32) {
        (self.fatal.load(Ordering::Relaxed), self.port_err[port as usize & 7].load(Ordering::Relaxed))
    }

    /// What happened since `snap` that ends every comm of this context, if
    /// anything: only a fatal device error (the PD and every registration
    /// are gone). A port going down (PORT_ERR) is not: as NCCL's net_ib
    /// does, the comms keep their QPs and the HCA retransmits; a comm fails
    /// only when a work request then fails, or its peer is gone.
    #[inline]
    pub fn changed_since(&self, _port: u8, snap: (u32, u32)) -> Option<&'static str> {
        let now = self.fatal.load(Ordering::Relaxed);
        (now != snap.0).then_some("the device reported a fatal error (IBV_EVENT_DEVICE_FATAL)")
    }

    /// PORT_ERR events seen on `port` so far.
    pub fn port_errors(&self, port: u8) -> u32 {
        self.port_err[port as usize & 7].load(Ordering::Relaxed)
    }

    /// PORT_ERR and PORT_ACTIVE events seen on `port` so far.
    pub fn port_events(&self, port: u8) -> (u32, u32) {
        let p = port as usize & 7;
        (self.port_err[p].load(Ordering::Relaxed), self.port_up[p].load(Ordering::Relaxed))
    }
}

/// The vendor id soft-RoCE (rdma_rxe) reports (`RXE_VENDOR_ID` in the
/// kernel's rxe_param.h).
pub const RXE_VENDOR_ID: u32 = 0x00ff_ffff;

/// One usable port.
pub struct IbDev {
    /// Index in our device list.
    pub index: usize,
    /// Unique name we report: the device name, or `dev:port` when the device has several usable ports.
    pub name: String,
    /// Device name (`mlx5_0`, `rxe0`).
    pub dev_name: String,
    /// Port number.
    pub port: u8,
    /// Open device.
    pub ctx: Context,
    /// The device's protection domain (shared by every comm on it, like NCCL).
    pub pd: Pd,
    /// LINK_IB or LINK_ETH.
    pub link_layer: u8,
    /// An iWARP device ([`super::iwarp::Kind::Iwarp`]): QPs connect through
    /// rdma_cm and completions travel as notices ([`super::notice_path`]).
    pub iwarp: bool,
    /// Soft-RoCE (rdma_rxe, vendor id [`RXE_VENDOR_ID`]): its responder
    /// sometimes answers a correct write with "invalid request" when the
    /// QP's packets arrive out of order ([`super::recover::recoverable_on`]).
    pub soft_roce: bool,
    /// System image GUID (what NCCL reports: one per adapter).
    pub guid: u64,
    /// Mbps.
    pub speed_mbps: i32,
    /// Device QP limit.
    pub max_qp: i32,
    /// Device limit on WRs per queue.
    pub max_qp_wr: i32,
    /// Device limit on CQ entries.
    pub max_cqe: i32,
    /// sysfs PCI path (realpath of the device link).
    pub pci_path: Option<String>,
    /// The pciPath reported to NCCL ([`super::topo::nccl_pci_path`]).
    pub pci_report: Option<String>,
    /// Registration cache of this device.
    pub mrs: Arc<MrCache>,
    /// The comms' small control regions, from shared blocks ([`super::slab`]).
    pub ctl: Arc<CtlSlab>,
    /// Async-event counters of the device context.
    pub health: Arc<Health>,
    /// GPUDirect decision of the device (ptrSupport, flush, reason).
    pub gdr: super::gdr::Gdr,
}

impl IbDev {
    /// Current port attributes (state, MTU, LID), read fresh.
    pub fn port_attr(&self) -> Result<PortAttr> {
        self.ctx.query_port(self.port)
    }

    /// What `getProperties` reports.
    pub fn props(&self) -> DeviceProps {
        DeviceProps {
            name: intern(&self.name),
            pci_path: self.pci_report.as_deref().map(intern),
            guid: self.guid,
            ptr_support: self.gdr.decision.ptr_support,
            reg_is_global: true,
            force_flush: self.gdr.forced,
            speed_mbps: self.speed_mbps,
            port: self.port as i32,
            latency_us: 0.0,
            max_comms: self.max_qp.max(1),
            max_recvs: MAX_RECVS as i32,
            max_p2p_bytes: MAX_P2P_BYTES,
            max_coll_bytes: 512 << 20,
        }
    }

    /// `rxe0:1/RoCE` for logs.
    pub fn describe(&self) -> String {
        format!("{}:{}/{}", self.dev_name, self.port, self.kind_name())
    }

    /// `IB`, `RoCE` or `iWARP`.
    pub fn kind_name(&self) -> &'static str {
        if self.iwarp {
            "iWARP"
        } else if self.link_layer == LINK_IB {
            "IB"
        } else {
            "RoCE"
        }
    }
}

/// Port speed in Mbps from `active_speed` and `active_width` codes (NCCL's tables).
pub fn speed_mbps(active_speed: u8, active_width: u8) -> i32 {
    const SPEEDS: [i32; 9] = [2500, 5000, 10000, 10000, 14000, 25000, 50000, 100000, 200000];
    const WIDTHS: [i32; 5] = [1, 4, 8, 12, 2];
    let first_bit = |v: u8, n: usize| if v == 0 { 0 } else { (v.trailing_zeros() as usize).min(n - 1) };
    SPEEDS[first_bit(active_speed, SPEEDS.len())] * WIDTHS[first_bit(active_width, WIDTHS.len())]
}

/// sysfs PCI path of device `dev` (realpath of its `device` link); None for
/// virtual devices such as rxe (see `topo`).
pub fn pci_path(sysfs: &Path, dev: &str) -> Option<String> {
    super::topo::pci_path(sysfs, dev)
}

/// A port found during discovery, before it is opened for use.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Device name.
    pub dev: String,
    /// Port.
    pub port: u8,
    /// PCI path.
    pub pci: Option<String>,
}

/// Order ports by PCI path (devices without one last, by name), then port,
/// and name them uniquely.
pub fn order_and_name(mut c: Vec<Candidate>) -> Vec<(Candidate, String)> {
    c.sort_by(|a, b| (a.pci.is_none(), &a.pci, &a.dev, a.port).cmp(&(b.pci.is_none(), &b.pci, &b.dev, b.port)));
    let count = |d: &str| c.iter().filter(|x| x.dev == d).count();
    let names: Vec<String> = c.iter().map(|x| if count(&x.dev) > 1 { format!("{}:{}", x.dev, x.port) } else { x.dev.clone() }).collect();
    c.into_iter().zip(names).collect()
}

fn watch_async_events(ctx: Context, health: Weak<Health>, mut numa: Option<i32>) {
    let fd = match ctx.async_fd_nonblocking() {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!("{}: async events will not be watched: {e}", ctx.name());
            return;
        }
    };
    let name = format!("rustnet-async-{}", ctx.name());
    let spawned = std::thread::Builder::new().name(name).spawn(move || loop {
        if numa.is_some() {
            // first pass only: run on the NIC's NUMA node (topo.rs)
            super::topo::bind_current_thread_to_node(Path::new("/sys"), numa.take(), ctx.name());
        }
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd; the context (and its fd) is kept open by `ctx`, owned by this thread.
        let r = unsafe { libc::poll(&mut p, 1, 200) };
        let Some(h) = health.upgrade() else { return };
        if r <= 0 {
            continue;
        }
        while let Some(ev) = ctx.next_async_event() {
            use super::verbs::AsyncDetail::*;
            match ev.detail {
                Device => {
                    h.fatal.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("{}: async event {}: comms on this device fail", ctx.name(), ev.name);
                }
                Port(port) if ev.kind == super::ffi::IBV_EVENT_PORT_ERR => {
                    let n = h.port_err[port as usize & 7].fetch_add(1, Ordering::Relaxed) + 1;
                    tracing::warn!(
                        "{}:{port}: async event {} (link down, #{n}): comms on this port keep their QPs and the HCA retransmits \
                         for up to NCCL_IB_TIMEOUT x (NCCL_IB_RETRY_CNT+1) per message; a comm whose work request fails meanwhile \
                         waits for the link and recovers in place (RUSTNET_RECOVERY_TIMEOUT), and fails only when that window is \
                         spent or its peer is gone",
                        ctx.name(),
                        ev.name
                    );
                }
                Port(port) if ev.kind == super::ffi::IBV_EVENT_PORT_ACTIVE => {
                    h.port_up[port as usize & 7].fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        "{}:{port}: async event {}: the link is up again; comms that had requests outstanding recover now",
                        ctx.name(),
                        ev.name
                    )
                }
                Port(port) => tracing::info!("{}:{port}: async event {}", ctx.name(), ev.name),
                Qp(qpn) => tracing::warn!("{}: async event {} on QP {qpn:#x}", ctx.name(), ev.name),
                Other => tracing::warn!("{}: async event {}", ctx.name(), ev.name),
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the async-event thread: {e}");
    }
}

/// Open and filter every port. `Err` says what was found and why nothing is usable.
pub fn discover(lib: &'static Lib, cfg: &Config, sysfs: &Path) -> Result<Vec<Arc<IbDev>>> {
    let opened = lib.open_all().map_err(|e| Error::Usage(format!("{e}")))?;
    if opened.is_empty() {
        return Err(Error::Usage("ibv_get_device_list found no RDMA device".into()));
    }
    let hca: &NameList = &cfg.ib_hca;
    // Asked once: an iWARP port is offered only if it can be connected.
    let iwarp = super::rdmacm::iwarp_usable();
    let mut seen = Vec::new();
    let mut cands = Vec::new();
    let mut ctxs = Vec::new();
    for (name, r) in opened {
        let ctx = match r {
            Ok(c) => c,
            Err(e) => {
                seen.push(format!("{name} (cannot open: {e})"));
                continue;
            }
        };
        let attr = match ctx.query_device() {
            Ok(a) => a,
            Err(e) => {
                seen.push(format!("{name} ({e})"));
                continue;
            }
        };
        for port in 1..=attr.phys_port_cnt {
            let pa = match ctx.query_port(port) {
                Ok(p) => p,
                Err(e) => {
                    seen.push(format!("{name}:{port} ({e})"));
                    continue;
                }
            };
            let facts = super::iwarp::PortFacts {
                dev: &name,
                port,
                transport_type: ctx.transport_type(),
                link_layer: pa.link_layer,
                state: pa.state,
            };
            let (kind, said) = super::iwarp::verdict_with(&facts, hca, iwarp.as_ref().copied().map_err(String::as_str));
            if kind.is_none() && facts.transport_type == super::ffi::IBV_TRANSPORT_IWARP {
                tracing::info!("{said}");
            }
            seen.push(said);
            if kind.is_none() {
                continue;
            }
            cands.push((Candidate { dev: name.clone(), port, pci: pci_path(sysfs, &name) }, ctx.clone(), attr, pa));
        }
        ctxs.push(name);
    }
    if !hca.is_empty() {
        let amb = hca.ambiguous_prefixes(&ctxs);
        if !amb.is_empty() {
            tracing::warn!("NCCL_IB_HCA entries {amb:?} match several devices by prefix; use '=' for exact names");
        }
    }
    if cands.is_empty() {
        return Err(Error::Usage(format!("no ACTIVE RDMA port usable; found: {}", seen.join(", "))));
    }
    let order = order_and_name(cands.iter().map(|c| c.0.clone()).collect());
    // per device (not port): name, PD, registration cache, event counters, GPUDirect decision
    type PerDevice = (String, Pd, Arc<MrCache>, Arc<Health>, super::gdr::Gdr, Arc<CtlSlab>);
    let mut pds: Vec<PerDevice> = Vec::new();
    let mut out = Vec::new();
    for (cand, unique) in order.into_iter().take(MAX_DEVS) {
        let (_, ctx, attr, pa) = cands.iter().find(|c| c.0.dev == cand.dev && c.0.port == cand.port).unwrap();
        let shared = match pds.iter().find(|p| p.0 == cand.dev) {
            Some(p) => (p.1.clone(), p.2.clone(), p.3.clone(), p.4.clone(), p.5.clone()),
            None => {
                let pd = Pd::new(ctx)?;
                let health = Arc::new(Health::default());
                watch_async_events(ctx.clone(), Arc::downgrade(&health), super::topo::numa_node(sysfs, &cand.dev));
                let mrs = Arc::new(MrCache::new(pd.clone()));
                let mut gdr = super::gdr::decide(cfg, &cand.dev, &pd);
                if ctx.transport_type() == super::ffi::IBV_TRANSPORT_IWARP {
                    super::gdr::host_only(&mut gdr);
                }
                let ctl = Arc::new(CtlSlab::new(pd.clone()));
                pds.push((cand.dev.clone(), pd.clone(), mrs.clone(), health.clone(), gdr.clone(), ctl.clone()));
                (pd, mrs, health, gdr, ctl)
            }
        };
        out.push(Arc::new(IbDev {
            index: out.len(),
            name: unique,
            dev_name: cand.dev.clone(),
            port: cand.port,
            ctx: ctx.clone(),
            pd: shared.0,
            link_layer: if pa.link_layer == 0 { LINK_IB } else { pa.link_layer },
            iwarp: ctx.transport_type() == super::ffi::IBV_TRANSPORT_IWARP,
            soft_roce: attr.vendor_id == RXE_VENDOR_ID,
            guid: attr.sys_image_guid,
            speed_mbps: speed_mbps(pa.active_speed, pa.active_width),
            max_qp: attr.max_qp,
            max_qp_wr: attr.max_qp_wr,
            max_cqe: attr.max_cqe,
            pci_path: cand.pci.clone(),
            pci_report: cand.pci.as_deref().map(|p| super::topo::nccl_pci_path(p, cfg.ib_merge_vfs.get() == 1)),
            mrs: shared.1,
            health: shared.2,
            gdr: shared.3,
            ctl: shared.4,
        }));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speeds_follow_nccl_tables() {
        assert_eq!(speed_mbps(1, 1), 2500); // SDR 1x
        assert_eq!(speed_mbps(32, 2), 100_000); // EDR 4x
        assert_eq!(speed_mbps(64, 2), 200_000); // HDR 4x
        assert_eq!(speed_mbps(128, 2), 400_000); // NDR 4x
        assert_eq!(speed_mbps(0, 0), 2500);
    }

    #[test]
    fn pci_order_and_unique_names() {
        let c = |d: &str, p: u8, pci: Option<&str>| Candidate { dev: d.into(), port: p, pci: pci.map(String::from) };
        let got = order_and_name(vec![
            c("rxe0", 1, None),
            c("mlx5_1", 1, Some("/sys/devices/pci0000:00/0000:00:05.0")),
            c("mlx5_0", 2, Some("/sys/devices/pci0000:00/0000:00:03.0")),
            c("mlx5_0", 1, Some("/sys/devices/pci0000:00/0000:00:03.0")),
        ]);
        let names: Vec<&str> = got.iter().map(|x| x.1.as_str()).collect();
        assert_eq!(names, ["mlx5_0:1", "mlx5_0:2", "mlx5_1", "rxe0"]);
    }

    #[test]
    fn health_changes_are_seen() {
        let h = Health::default();
        let s = h.snapshot(1);
        assert!(h.changed_since(1, s).is_none());
        h.port_err[2].fetch_add(1, Ordering::Relaxed);
        assert!(h.changed_since(1, s).is_none());
        h.port_err[1].fetch_add(1, Ordering::Relaxed);
        assert!(h.changed_since(1, s).is_none(), "a port going down fails no comm by itself (as NCCL's net_ib)");
        assert_eq!(h.port_errors(1), 1);
        h.fatal.fetch_add(1, Ordering::Relaxed);
        assert!(h.changed_since(1, s).unwrap().contains("DEVICE_FATAL"));
    }
}
