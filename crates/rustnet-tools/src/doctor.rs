//! `rustnet doctor`: explains the fabric layer by layer, using the plugin's
//! own code (knob parsing, interface choice, device order, GID choice, GDR
//! decision), so what it reports is what NCCL will get. Every check is
//! PASS/WARN/FAIL with the fix in one line. Reads sysfs under a root that
//! tests point at fixture trees.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use rustnet::for_tools::config::{Config, KnobValue, NameList};
use rustnet::for_tools::ib::gid::GidTable as _;
use rustnet::for_tools::ib::{device, gid, iwarp, rdmacm};

pub use crate::status::Status;

/// One line of the report.
#[derive(Debug, Clone)]
pub struct Check {
    /// Layer: env, rdma, gid, fabric, counters, link, topo, gpu, host, plugin.
    pub layer: &'static str,
    /// What was checked.
    pub what: String,
    /// Outcome.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// The fix, in one line (empty when nothing to fix).
    pub fix: String,
}

/// One GID table entry as sysfs shows it.
#[derive(Debug, Clone)]
pub struct GidRow {
    /// Index.
    pub index: u32,
    /// Text form.
    pub gid: String,
    /// "RoCE v2", "IB/RoCE v1", or "?" when unreadable (EINVAL).
    pub kind: String,
    /// Netdev the entry belongs to.
    pub ndev: Option<String>,
}

/// One RDMA port.
#[derive(Debug, Clone)]
pub struct PortInfo {
    /// Device.
    pub dev: String,
    /// Port number.
    pub port: u8,
    /// `ACTIVE`, `DOWN`, ...
    pub state: String,
    /// `LinkUp`, `Disabled`, ...
    pub phys_state: String,
    /// `InfiniBand` or `Ethernet`.
    pub link_layer: String,
    /// e.g. `100 Gb/sec (4X EDR)`.
    pub rate: String,
    /// Netdev of the port (RoCE).
    pub netdev: Option<String>,
    /// Non-empty GID entries.
    pub gids: Vec<GidRow>,
    /// Chosen GID index (RoCE) and why.
    pub choice: Option<(u32, String)>,
    /// PCI path of the device.
    pub pci: Option<String>,
    /// NUMA node of the device.
    pub numa: Option<i32>,
    /// Passes NCCL_IB_HCA.
    pub selected: bool,
    /// An iWARP device (sysfs `node_type` RNIC): link layer Ethernet, but no RoCE GIDs or lossless needs.
    pub iwarp: bool,
}

/// A GPU on the PCI bus.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    /// PCI path.
    pub pci: String,
    /// NUMA node.
    pub numa: Option<i32>,
    /// Nearest RDMA device by PCI distance.
    pub nearest_nic: Option<String>,
}

/// The whole report.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Every check, in order.
    pub checks: Vec<Check>,
    /// RDMA ports.
    pub ports: Vec<PortInfo>,
    /// GPUs.
    pub gpus: Vec<GpuInfo>,
    /// Interfaces the TCP transport / out-of-band exchange would use.
    pub tcp_ifs: Vec<String>,
    /// `export` lines for an init container.
    pub export_env: Vec<String>,
}

impl Report {
    fn add(&mut self, layer: &'static str, what: impl Into<String>, status: Status, detail: impl Into<String>, fix: impl Into<String>) {
        self.checks.push(Check { layer, what: what.into(), status, detail: detail.into(), fix: fix.into() });
    }

    /// Worst status.
    pub fn worst(&self) -> Status {
        self.checks.iter().map(|c| c.status).max().unwrap_or(Status::Pass)
    }
}

/// Where to look.
#[derive(Debug, Clone)]
pub struct Opts {
    /// sysfs root (`/sys`).
    pub sysfs: PathBuf,
    /// /dev root (`/dev`).
    pub dev: PathBuf,
    /// Environment (normally the process's).
    pub env: BTreeMap<String, String>,
    /// Also initialise the plugin in this process and report its devices
    /// (and ask verbs for each port's active MTU).
    pub probe_plugin: bool,
    /// How to read `ethtool -S`; `None`: `ethtool` on PATH when `sysfs` is
    /// `/sys`, else skipped (a fixture tree has no live netdevs).
    pub ethtool: Option<crate::fabric::counters::Ethtool>,
    /// How to read the DCB state (PFC, DSCP map); `None`: as for `ethtool`.
    pub dcb: Option<crate::fabric::lossless::DcbTool>,
    /// The peer's netdev MTU, when known (`--peer-mtu`).
    pub peer_mtu: Option<u32>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            sysfs: "/sys".into(),
            dev: "/dev".into(),
            env: std::env::vars().collect(),
            probe_plugin: true,
            ethtool: None,
            dcb: None,
            peer_mtu: None,
        }
    }
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn strip_num(s: &str) -> String {
    // sysfs shows "4: ACTIVE", "5: LinkUp"
    s.split_once(": ").map(|(_, b)| b.to_string()).unwrap_or_else(|| s.to_string())
}

/// Read one port's facts from sysfs.
pub fn read_port(sysfs: &Path, dev: &str, port: u8) -> PortInfo {
    let base = sysfs.join("class/infiniband").join(dev).join("ports").join(port.to_string());
    let mut gids = Vec::new();
    if let Ok(rd) = std::fs::read_dir(base.join("gids")) {
        let mut idx: Vec<u32> = rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect();
        idx.sort();
        for i in idx {
            let Some(g) = read(&base.join(format!("gids/{i}"))).and_then(|s| gid::parse_gid(&s)) else { continue };
            if g.iter().all(|&b| b == 0) {
                continue;
            }
            let kind = read(&base.join(format!("gid_attrs/types/{i}"))).unwrap_or_else(|| "?".into());
            let ndev = read(&base.join(format!("gid_attrs/ndevs/{i}")));
            gids.push(GidRow { index: i, gid: gid::show(&g), kind, ndev });
        }
    }
    let netdev = gids.iter().find_map(|g| g.ndev.clone()).or_else(|| {
        std::fs::read_dir(sysfs.join("class/infiniband").join(dev).join("device/net"))
            .ok()?
            .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
            .next()
    });
    let devdir = sysfs.join("class/infiniband").join(dev).join("device");
    PortInfo {
        dev: dev.to_string(),
        port,
        state: strip_num(&read(&base.join("state")).unwrap_or_else(|| "?".into())),
        phys_state: strip_num(&read(&base.join("phys_state")).unwrap_or_else(|| "?".into())),
        link_layer: read(&base.join("link_layer")).unwrap_or_else(|| "?".into()),
        rate: read(&base.join("rate")).unwrap_or_else(|| "?".into()),
        netdev,
        gids,
        choice: None,
        pci: device::pci_path(sysfs, dev).filter(|p| p.contains("/pci")),
        numa: read(&devdir.join("numa_node")).and_then(|s| s.parse().ok()).filter(|&n: &i32| n >= 0),
        selected: true,
        iwarp: iwarp::sysfs_is_iwarp(sysfs, dev),
    }
}

/// Every RDMA port under `sysfs`, sorted by device and port.
pub fn rdma_ports(sysfs: &Path) -> Vec<PortInfo> {
    crate::fabric::counters::ports(sysfs).into_iter().map(|(d, p)| read_port(sysfs, &d, p)).collect()
}

/// GPUs (NVIDIA display/3D controllers) on the PCI bus (shared with the verbs transport: `topo`).
/// The detail for an ACTIVE iWARP port: the port's facts, that iWARP
/// connects through rdma_cm, and whether librdmacm loads here.
fn iwarp_line(port_detail: &str) -> String {
    let cm = match rdmacm::CmLib::get() {
        Ok(_) => format!("{} loads (RDMACM_1.0)", rdmacm::LIBRDMACM),
        Err(e) => format!("librdmacm NOT usable: {e}"),
    };
    let plugin = if !iwarp::IWARP_DATA_PATH {
        format!("the plugin leaves it out ({})", iwarp::IWARP_WHY)
    } else if rdmacm::CmLib::get().is_ok() {
        format!("the plugin uses it: {}", iwarp::IWARP_HOW)
    } else {
        "the plugin cannot connect it without librdmacm".to_string()
    };
    format!("{port_detail}: iWARP connects only through rdma_cm; {cm}; {plugin}")
}

/// The fix for an ACTIVE iWARP port the plugin cannot use (empty when it can).
fn iwarp_fix() -> String {
    if rdmacm::CmLib::get().is_err() {
        "install librdmacm1 (rdma-core); meanwhile NCCL uses the other ports or TCP".into()
    } else if !iwarp::IWARP_DATA_PATH {
        "nothing to do: NCCL uses the other ports or TCP (exclude it explicitly with NCCL_IB_HCA=^dev to silence this)".into()
    } else {
        String::new()
    }
}

pub use rustnet::for_tools::ib::topo::{gpus, nearest_nic};

fn env_get(o: &Opts) -> impl Fn(&str) -> Option<String> + '_ {
    move |k| o.env.get(k).cloned()
}

/// The knob table against `o.env`: one PASS line with what is set, or one FAIL
/// line per bad value with its fix (after a summary line naming them all).
/// Returns the configuration the plugin would have with the bad values unset.
fn env_checks(o: &Opts, r: &mut Report) -> Config {
    let get = env_get(o);
    let bad = Config::problems(&get);
    if bad.is_empty() {
        let set: Vec<String> =
            o.env.iter().filter(|(k, _)| k.starts_with("NCCL_") || k.starts_with("RUSTNET_")).map(|(k, v)| format!("{k}={v}")).collect();
        r.add(
            "env",
            "knob values",
            Status::Pass,
            if set.is_empty() { "no NCCL_*/RUSTNET_* variables set: defaults".into() } else { set.join(" ") },
            "",
        );
        return Config::from_lookup(&get).unwrap_or_else(|_| Config::from_lookup(&|_| None).expect("defaults parse"));
    }
    let names: Vec<&str> = bad
        .iter()
        .map(|e| match e {
            rustnet::Error::Config { name, .. } => *name,
            _ => "?",
        })
        .collect();
    r.add(
        "env",
        "knob values",
        Status::Fail,
        format!("{} bad value(s): {} (the plugin's init refuses the first and stops there)", bad.len(), names.join(", ")),
        "each one below says how (rustnet knobs lists what every variable accepts)",
    );
    for e in &bad {
        match e {
            rustnet::Error::Config { name, value, accepts } => {
                let default = rustnet::for_tools::config::KNOBS.iter().find(|k| k.name == *name).map(|k| k.default).unwrap_or("");
                let default = if default.is_empty() { "(empty)".to_string() } else { default.to_string() };
                r.add(
                    "env",
                    *name,
                    Status::Fail,
                    format!("{value:?} is not accepted: expected {accepts}"),
                    format!("set {name} to {accepts}, or unset it for the default {default}"),
                );
            }
            other => r.add("env", "knob", Status::Fail, other.to_string(), "rustnet knobs lists what each variable accepts"),
        }
    }
    // the rest of the report as the plugin would run with the bad values unset
    Config::from_lookup(&|k| if names.contains(&k) { None } else { get(k) })
        .unwrap_or_else(|_| Config::from_lookup(&|_| None).expect("defaults parse"))
}

/// Run every check.
pub fn run(o: &Opts) -> Report {
    let mut r = Report::default();
    // ---- environment: every knob, every bad value (the plugin's init stops at the first)
    let cfg = env_checks(o, &mut r);
    match o.env.get("NCCL_NET_PLUGIN") {
        Some(v) if v.contains("rustnet") => r.add("env", "NCCL_NET_PLUGIN", Status::Pass, v.clone(), ""),
        Some(v) => {
            r.add("env", "NCCL_NET_PLUGIN", Status::Warn, format!("{v}: NCCL will not load librustnet"), "export NCCL_NET_PLUGIN=rustnet")
        }
        None => r.add(
            "env",
            "NCCL_NET_PLUGIN",
            Status::Warn,
            "unset: NCCL only tries libnccl-net.so",
            "export NCCL_NET_PLUGIN=rustnet (and put the lib dir on LD_LIBRARY_PATH)",
        ),
    }
    // testing-only knobs left set: the job would break itself on purpose
    let armed: Vec<String> = [
        ("RUSTNET_FAULT_PANIC", &*cfg.fault_panic, "panics in that vtable slot, failing the comm"),
        ("RUSTNET_FAULT_QP_ERROR", &*cfg.fault_qp_error, "moves QPs to the error state, forcing recoveries"),
        ("RUSTNET_FAULT_TCP_RESET", &*cfg.fault_tcp_reset, "resets TCP streams, forcing reconnections"),
    ]
    .into_iter()
    .filter(|(_, v, _)| !v.trim().is_empty())
    .map(|(k, v, what)| format!("{k}={v} {what}"))
    .collect();
    if armed.is_empty() {
        r.add("env", "fault injection", Status::Pass, "off (no RUSTNET_FAULT_* set)", "");
    } else {
        r.add(
            "env",
            "fault injection",
            Status::Warn,
            format!("armed, testing only: {}", armed.join("; ")),
            "unset every RUSTNET_FAULT_* variable for a real job",
        );
    }
    if o.env.get("NCCL_IB_DISABLE").map(String::as_str) == Some("1") {
        r.add(
            "env",
            "NCCL_IB_DISABLE",
            Status::Warn,
            "1: turns off NCCL's built-in IB (librustnet ignores it)",
            "use RUSTNET_TRANSPORT=socket to force TCP in librustnet",
        );
    }

    // ---- RDMA devices and ports
    let mut ports = rdma_ports(&o.sysfs);
    let names: Vec<String> = ports.iter().map(|p| p.dev.clone()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    for amb in cfg.ib_hca.ambiguous_prefixes(&names) {
        let matched: Vec<&String> = names.iter().filter(|n| n.starts_with(amb)).collect();
        r.add(
            "env",
            "NCCL_IB_HCA prefix",
            Status::Warn,
            format!("entry {amb:?} is a prefix of {matched:?}"),
            format!("use exact names: NCCL_IB_HCA=={amb}"),
        );
    }
    if ports.is_empty() {
        let why = if !o.sysfs.join("class/infiniband").exists() {
            "no /sys/class/infiniband (kernel without RDMA, or devices not passed into this container)"
        } else {
            "no devices under /sys/class/infiniband"
        };
        r.add(
            "rdma",
            "RDMA devices",
            Status::Warn,
            format!("none: {why}; the plugin will use TCP"),
            "for RDMA: load the driver (e.g. mlx5_ib) and pass /dev/infiniband into the container",
        );
    }
    let active_sel: Vec<usize> = (0..ports.len()).collect();
    for &i in &active_sel {
        let p = &mut ports[i];
        p.selected = cfg.ib_hca.accepts(&p.dev, Some(p.port as u32));
        let label = format!("{}:{}", p.dev, p.port);
        let detail = format!(
            "{} / {} / {}{} / {}{}",
            p.state,
            p.phys_state,
            p.link_layer,
            if p.iwarp { " (iWARP)" } else { "" },
            p.rate,
            p.netdev.as_ref().map(|n| format!(" / netdev {n}")).unwrap_or_default()
        );
        if !p.selected {
            r.add("rdma", label, Status::Pass, format!("{detail} (excluded by NCCL_IB_HCA)"), "");
        } else if p.state == "ACTIVE" && p.iwarp {
            r.add(
                "rdma",
                label,
                if rdmacm::iwarp_usable().is_ok() { Status::Pass } else { Status::Warn },
                iwarp_line(&detail),
                iwarp_fix(),
            );
        } else if p.state == "ACTIVE" {
            r.add("rdma", label, Status::Pass, detail, "");
        } else {
            r.add(
                "rdma",
                label,
                Status::Warn,
                format!("{detail}: not ACTIVE, the plugin skips it"),
                "check the cable/switch port (ibstat, ip link) or exclude it with NCCL_IB_HCA",
            );
        }
    }
    // ---- GIDs (RoCE): the plugin's own choice (gid::choose), with its reason
    for p in ports.iter_mut().filter(|p| p.selected && p.link_layer == "Ethernet" && !p.iwarp) {
        let label = format!("{}:{}", p.dev, p.port);
        let len = gid::SysfsGids::sysfs_len(&o.sysfs, &p.dev, p.port);
        let table = gid::SysfsGids::new(&o.sysfs, &p.dev, p.port, len);
        let forced = cfg.ib_gid_index.get();
        let prefs = gid::Prefs {
            family: Some(cfg.ib_addr_family),
            version: cfg.ib_roce_version.get() as u8,
            range: cfg.ib_addr_range,
            forced: (forced >= 0).then_some(forced as u32),
        };
        match gid::choose(&table, &label, &prefs) {
            Ok(c) => {
                if let Some(nd) = &c.ndev {
                    if table.netdev_state(nd) == gid::NetdevState::Invisible {
                        r.add(
                            "gid",
                            format!("{label} GID {} netdev", c.index),
                            Status::Warn,
                            format!("{nd} is not in this network namespace"),
                            "run in the namespace that owns the RoCE netdev (macvlan/SR-IOV: pass the VF/netdev into the pod)",
                        );
                    }
                }
                let (status, fix) = match &c.concern {
                    Some(f) => (Status::Warn, f.clone()),
                    None => (Status::Pass, String::new()),
                };
                r.add("gid", format!("{label} GID {}", c.index), status, c.detail(), fix);
                p.choice = Some((c.index, c.reason()));
            }
            Err(e) => r.add(
                "gid",
                format!("{label} GID"),
                Status::Fail,
                match e {
                    rustnet::Error::Usage(m) => m,
                    e => e.to_string(),
                },
                "check the GID table (show_gids), NCCL_IB_GID_INDEX and NCCL_IB_ADDR_RANGE",
            ),
        }
        if forced >= 0 {
            r.add(
                "env",
                "NCCL_IB_GID_INDEX",
                Status::Warn,
                format!("set to {forced}: GID indices differ between nodes and move when addresses change"),
                "unset it: librustnet picks the IPv4 RoCE v2 GID per connection",
            );
        }
    }
    // ---- lossless Ethernet and the NIC's own counters
    fabric_checks(o, &cfg, &ports, &mut r);
    // ---- topology
    // nearest-NIC answers consider the ports the plugin would use
    let nics: Vec<(String, String)> =
        ports.iter().filter(|p| p.selected && p.state == "ACTIVE").filter_map(|p| Some((p.dev.clone(), p.pci.clone()?))).collect();
    for p in &ports {
        let (s, d) = match (&p.pci, p.numa) {
            (Some(pci), numa) => (Status::Pass, format!("{pci}{}", numa.map(|n| format!(", NUMA {n}")).unwrap_or_default())),
            (None, _) => (Status::Pass, "no PCI device (virtual NIC such as rxe): NCCL attaches it to the first CPU".into()),
        };
        r.add("topo", format!("{}:{} PCI", p.dev, p.port), s, d, "");
    }
    for (pci, numa) in gpus(&o.sysfs) {
        let near = nearest_nic(&pci, &nics);
        r.add(
            "topo",
            "GPU",
            Status::Pass,
            format!(
                "{pci}{}; nearest NIC {}",
                numa.map(|n| format!(", NUMA {n}")).unwrap_or_default(),
                near.clone().unwrap_or_else(|| "none".into())
            ),
            "",
        );
        r.gpus.push(GpuInfo { pci, numa, nearest_nic: near });
    }
    // ---- GPUDirect
    let pm = rustnet::for_tools::gpu::detect_peermem(&o.sysfs);
    match (&pm, r.gpus.is_empty()) {
        (_, true) => r.add("gpu", "GPUDirect RDMA", Status::Pass, "no NVIDIA GPU on the PCI bus: host memory only", ""),
        (rustnet::for_tools::gpu::PeerMem::Loaded(f), false) => r.add("gpu", "peer memory", Status::Pass, format!("loaded ({f})"), ""),
        (rustnet::for_tools::gpu::PeerMem::Absent, false) => r.add(
            "gpu",
            "peer memory",
            Status::Warn,
            "nvidia-peermem not loaded: GPUDirect needs dma-buf instead",
            "modprobe nvidia-peermem (or rely on dma-buf with a recent driver and rdma-core)",
        ),
    }
    if !r.gpus.is_empty() {
        let ci = rustnet::for_tools::gpu::cuda::info();
        match ci.unusable_reason() {
            None => r.add(
                "gpu",
                "CUDA driver",
                Status::Pass,
                format!(
                    "version {:?}, {} GPU(s), dma-buf {}",
                    ci.driver,
                    ci.devices,
                    if ci.dmabuf_supported { "supported" } else { "not supported" }
                ),
                "",
            ),
            Some(w) => r.add("gpu", "CUDA driver", Status::Warn, w, "install the NVIDIA driver in the container image (libcuda.so.1)"),
        }
    }
    // ---- host limits and devices
    host_checks(o, &mut r, !ports.is_empty());
    // ---- TCP path / out-of-band interfaces
    match rustnet::for_tools::transport::netif::select(
        &rustnet::for_tools::transport::netif::candidates(
            &rustnet::for_tools::transport::sock::interfaces().unwrap_or_default(),
            cfg.socket_family,
        ),
        &cfg.socket_ifname,
    ) {
        Ok(ifs) => {
            r.tcp_ifs = ifs.iter().map(|f| format!("{} {}", f.name, f.addr.ip())).collect();
            r.add("link", "TCP / out-of-band interfaces", Status::Pass, r.tcp_ifs.join(", "), "");
            if ifs.iter().any(|f| f.name.starts_with("lo")) && ifs.len() == 1 {
                r.add(
                    "link",
                    "TCP interface",
                    Status::Warn,
                    "only loopback: other nodes cannot reach this one",
                    "set NCCL_SOCKET_IFNAME to the cluster interface",
                );
            }
        }
        Err(e) => r.add(
            "link",
            "TCP / out-of-band interfaces",
            Status::Fail,
            e.to_string(),
            "set NCCL_SOCKET_IFNAME to an interface that exists on every node",
        ),
    }
    // ---- what the plugin itself selects (the code NCCL runs)
    if o.probe_plugin {
        match rustnet::for_tools::plugin::init() {
            Ok(p) => {
                let devs: Vec<String> = (0..p.devices() as i32)
                    .filter_map(|d| p.properties(d).ok())
                    .map(|d| {
                        format!(
                            "{} ({} Mbps{})",
                            d.name.to_string_lossy(),
                            d.speed_mbps,
                            d.pci_path.map(|x| format!(", {}", x.to_string_lossy())).unwrap_or_default()
                        )
                    })
                    .collect();
                r.add("plugin", "transport", Status::Pass, format!("{}: {}", p.transport_name(), devs.join(", ")), "");
                // Per-device GPUDirect decisions, made (and the dma-buf probe run)
                // by the init above on the devices it opened: no second open.
                for g in rustnet::for_tools::ib::gdr::decisions() {
                    let on = g.decision.ptr_support != rustnet::for_tools::transport::PTR_HOST;
                    let status = if on || r.gpus.is_empty() { Status::Pass } else { Status::Warn };
                    r.add(
                        "plugin",
                        format!("{} GPUDirect", g.dev),
                        status,
                        g.describe(),
                        "see the GPUDirect RDMA section (nvidia-peermem, CUDA driver, rdma-core >= 34 for dma-buf)",
                    );
                }
            }
            Err(e) => r.add(
                "plugin",
                "transport",
                Status::Fail,
                format!("init fails: {e}"),
                "fix the cause above; NCCL would fall back to its own network",
            ),
        }
    }
    // ---- export lines
    let sel: Vec<&PortInfo> = ports.iter().filter(|p| p.selected && p.state == "ACTIVE").collect();
    if !sel.is_empty() {
        let hca: Vec<String> = sel.iter().map(|p| format!("{}:{}", p.dev, p.port)).collect();
        r.export_env.push(format!("export NCCL_IB_HCA=={}", hca.join(",")));
        let idx: std::collections::BTreeSet<u32> = sel.iter().filter_map(|p| p.choice.as_ref().map(|c| c.0)).collect();
        if idx.len() == 1 && sel.iter().all(|p| p.choice.is_some()) {
            r.export_env.push(format!("export NCCL_IB_GID_INDEX={}", idx.iter().next().unwrap()));
        }
    }
    if !r.tcp_ifs.is_empty() {
        let names: Vec<&str> = r.tcp_ifs.iter().map(|s| s.split(' ').next().unwrap_or("")).collect();
        r.export_env.push(format!("export NCCL_SOCKET_IFNAME=={}", names.join(",")));
    }
    r.export_env.push("export NCCL_NET_PLUGIN=rustnet".into());
    r.ports = ports;
    r
}

/// The ethtool / dcb tools to use: the caller's, else the ones on PATH for
/// the live `/sys`, else none (a fixture tree has no live netdevs to ask).
pub fn tools(o: &Opts) -> (crate::fabric::counters::Ethtool, crate::fabric::lossless::DcbTool) {
    use crate::fabric::{counters::Ethtool, lossless::DcbTool};
    let live = o.sysfs == Path::new("/sys");
    let why = "the sysfs root is not /sys, so the live netdevs do not match it";
    let e = o.ethtool.clone().unwrap_or_else(|| if live { Ethtool::detect() } else { Ethtool::Skip(format!("ethtool not run: {why}")) });
    let d = o.dcb.clone().unwrap_or_else(|| if live { DcbTool::detect() } else { DcbTool::Skip(format!("DCB not read: {why}")) });
    (e, d)
}

/// Active MTU in bytes of every (device, port) verbs can open.
fn verbs_active_mtus() -> BTreeMap<(String, u8), u32> {
    let mut m = BTreeMap::new();
    let Ok(lib) = rustnet::for_tools::ib::verbs::Lib::get() else { return m };
    let Ok(devs) = lib.open_all() else { return m };
    for (name, ctx) in devs {
        let Ok(ctx) = ctx else { continue };
        let n = ctx.query_device().map(|a| a.phys_port_cnt).unwrap_or(1);
        for port in 1..=n {
            if let Ok(a) = ctx.query_port(port) {
                m.insert((name.clone(), port), rustnet::proto::ib_meta::mtu_bytes(a.active_mtu.clamp(1, 5) as u8));
            }
        }
    }
    m
}

fn fabric_checks(o: &Opts, cfg: &Config, ports: &[PortInfo], r: &mut Report) {
    use crate::fabric::{classify, counters, lossless};
    let (ethtool, dcb) = tools(o);
    // iWARP runs over TCP: no PFC/ECN tuning to check
    let roce: Vec<&PortInfo> =
        ports.iter().filter(|p| p.selected && p.link_layer == "Ethernet" && !p.iwarp && p.netdev.is_some()).collect();
    let mtus = if o.probe_plugin && !roce.is_empty() { verbs_active_mtus() } else { BTreeMap::new() };
    let qos: Vec<lossless::PortQos> = roce
        .iter()
        .map(|p| {
            let label = format!("{}:{}", p.dev, p.port);
            let nd = p.netdev.as_deref().unwrap_or_default();
            lossless::gather(&o.sysfs, &label, nd, p.pci.is_none(), mtus.get(&(p.dev.clone(), p.port)).copied(), &dcb)
        })
        .collect();
    let traffic = lossless::Traffic::from_knobs(cfg.ib_tc.get(), cfg.ib_sl.get());
    let mut outs = lossless::mtu_checks(&qos, o.peer_mtu);
    for q in &qos {
        outs.extend(lossless::qos_checks(q, &traffic));
    }
    for c in outs {
        r.add("fabric", c.what, c.status, c.detail, c.fix);
    }
    // The NIC's counters once: totals since the driver loaded, named.
    for p in ports.iter().filter(|p| p.selected) {
        let pc = counters::read(&o.sysfs, &p.dev, p.port, p.netdev.as_deref(), &ethtool);
        let label = format!("{}:{} counters", p.dev, p.port);
        let n = pc.counters.len() + pc.hw.len() + pc.eth.len();
        let found = classify::classify(&counters::Delta::totals(&pc));
        let worst = found.iter().map(|f| f.severity).max();
        let status = if worst >= Some(classify::Severity::Warn) { Status::Warn } else { Status::Pass };
        let mut detail = if n == 0 {
            "the driver exposes no counters/ or hw_counters/".to_string()
        } else if found.is_empty() {
            format!("{n} counters, all zero")
        } else {
            format!("{n} counters; {}", found.iter().map(|f| f.text.as_str()).collect::<Vec<_>>().join("; "))
        };
        if let Some(note) = &pc.eth_note {
            detail.push_str(&format!(" [{note}]"));
        }
        let fix = if status == Status::Warn {
            format!("totals since the driver loaded: see whether they still rise under load with `rustnet watch` (here: {})", p.dev)
        } else {
            String::new()
        };
        r.add("counters", label, status, detail, fix);
    }
}

fn host_checks(o: &Opts, r: &mut Report, have_rdma: bool) {
    let ib = o.dev.join("infiniband");
    if have_rdma {
        match std::fs::read_dir(&ib) {
            Ok(rd) => {
                let names: Vec<String> = rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
                let uverbs: Vec<&String> = names.iter().filter(|n| n.starts_with("uverbs")).collect();
                if uverbs.is_empty() {
                    r.add(
                        "host",
                        "/dev/infiniband",
                        Status::Fail,
                        format!("present but no uverbs* device ({names:?})"),
                        "load ib_uverbs / pass /dev/infiniband/uverbs* into the container",
                    );
                } else {
                    let denied: Vec<String> = uverbs.iter().filter(|n| !access_rw(&ib.join(n))).map(|n| n.to_string()).collect();
                    if denied.is_empty() {
                        r.add("host", "/dev/infiniband", Status::Pass, format!("{} uverbs device(s), read/write", uverbs.len()), "");
                    } else {
                        r.add(
                            "host",
                            "/dev/infiniband",
                            Status::Fail,
                            format!("no read/write access to {denied:?}"),
                            "run with access to /dev/infiniband (group rdma, or --device /dev/infiniband)",
                        );
                    }
                }
            }
            Err(_) => r.add(
                "host",
                "/dev/infiniband",
                Status::Fail,
                "missing although RDMA devices exist in sysfs",
                "docker run --device /dev/infiniband (Kubernetes: an RDMA device plugin)",
            ),
        }
    }
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    let root = unsafe_is_root();
    let ipc_lock = cap_ipc_lock();
    if lim.rlim_cur == libc::RLIM_INFINITY {
        r.add("host", "locked memory", Status::Pass, "unlimited", "");
    } else if root || ipc_lock {
        r.add("host", "locked memory", Status::Pass, format!("{} KiB, but CAP_IPC_LOCK lifts it", lim.rlim_cur / 1024), "");
    } else {
        let s = if have_rdma { Status::Warn } else { Status::Pass };
        r.add(
            "host",
            "locked memory",
            s,
            format!("{} KiB: memory registrations beyond it fail", lim.rlim_cur / 1024),
            "ulimit -l unlimited (docker --ulimit memlock=-1, or grant IPC_LOCK)",
        );
    }
    r.add("host", "CAP_IPC_LOCK", Status::Pass, if ipc_lock { "present" } else { "absent" }, "");
    let ns_self = std::fs::read_link("/proc/self/ns/net").ok();
    let ns_init = std::fs::read_link("/proc/1/ns/net").ok();
    if ns_self.is_some() && ns_init.is_some() && ns_self != ns_init {
        r.add(
            "host",
            "network namespace",
            Status::Pass,
            "not the init process's namespace: RoCE GIDs must belong to netdevs visible here",
            "",
        );
    }
}

fn access_rw(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().to_string_lossy().as_bytes()) else { return false };
    // SAFETY: valid path string.
    unsafe { libc::access(c.as_ptr(), libc::R_OK | libc::W_OK) == 0 }
}

fn unsafe_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("CapEff:")).and_then(|l| u64::from_str_radix(l.split_whitespace().nth(1)?, 16).ok()))
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// Human-readable report.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let mut layer = "";
    for c in &r.checks {
        if c.layer != layer {
            layer = c.layer;
            let _ = writeln!(
                s,
                "\n== {}",
                match layer {
                    "env" => "environment",
                    "rdma" => "RDMA devices and ports",
                    "gid" => "RoCE GID choice (what the plugin will use)",
                    "fabric" => "lossless Ethernet: MTU, PFC, DSCP map, ECN for the plugin's traffic class",
                    "counters" => "the NIC's own counters (totals since the driver loaded)",
                    "topo" => "PCI / NUMA topology",
                    "gpu" => "GPUDirect RDMA",
                    "host" => "host limits and device files",
                    "link" => "IP interfaces (TCP transport, out-of-band exchange)",
                    "plugin" => "what librustnet selects (its own init, as NCCL would run it)",
                    other => other,
                }
            );
        }
        let tag = match c.status {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        };
        let _ = writeln!(s, "[{tag}] {}: {}", c.what, c.detail);
        if !c.fix.is_empty() && c.status != Status::Pass {
            let _ = writeln!(s, "       fix: {}", c.fix);
        }
    }
    for p in r.ports.iter().filter(|p| !p.gids.is_empty()) {
        let _ = writeln!(s, "\nGID table {}:{}", p.dev, p.port);
        for g in &p.gids {
            let mark = if p.choice.as_ref().map(|c| c.0) == Some(g.index) { "  <- chosen" } else { "" };
            let _ = writeln!(s, "  {:>4}  {:<40} {:<12} {}{mark}", g.index, g.gid, g.kind, g.ndev.clone().unwrap_or_default());
        }
    }
    let w = r.worst();
    let _ = writeln!(
        s,
        "\nverdict: {}",
        match w {
            Status::Pass => "PASS",
            Status::Warn => "WARN (works; see the fixes above)",
            Status::Fail => "FAIL (see the fixes above)",
        }
    );
    s
}

/// `s` as a JSON string literal (also for `rustnet watch --json`).
pub fn js(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// Machine-readable report.
pub fn render_json(r: &Report) -> String {
    let checks: Vec<String> = r
        .checks
        .iter()
        .map(|c| {
            format!(
                "{{\"layer\":{},\"what\":{},\"status\":\"{:?}\",\"detail\":{},\"fix\":{}}}",
                js(c.layer),
                js(&c.what),
                c.status,
                js(&c.detail),
                js(&c.fix)
            )
        })
        .collect();
    let ports: Vec<String> = r
        .ports
        .iter()
        .map(|p| {
            let gids: Vec<String> = p.gids.iter().map(|g| format!("{{\"index\":{},\"gid\":{},\"type\":{},\"ndev\":{}}}", g.index, js(&g.gid), js(&g.kind), g.ndev.as_deref().map(js).unwrap_or("null".into()))).collect();
            format!(
                "{{\"dev\":{},\"port\":{},\"state\":{},\"link_layer\":{},\"rate\":{},\"netdev\":{},\"selected\":{},\"iwarp\":{},\"pci\":{},\"numa\":{},\"gid_index\":{},\"gid_reason\":{},\"gids\":[{}]}}",
                js(&p.dev),
                p.port,
                js(&p.state),
                js(&p.link_layer),
                js(&p.rate),
                p.netdev.as_deref().map(js).unwrap_or("null".into()),
                p.selected,
                p.iwarp,
                p.pci.as_deref().map(js).unwrap_or("null".into()),
                p.numa.map(|n| n.to_string()).unwrap_or("null".into()),
                p.choice.as_ref().map(|c| c.0.to_string()).unwrap_or("null".into()),
                p.choice.as_ref().map(|c| js(&c.1)).unwrap_or("null".into()),
                gids.join(",")
            )
        })
        .collect();
    let gpus: Vec<String> = r
        .gpus
        .iter()
        .map(|g| {
            format!(
                "{{\"pci\":{},\"numa\":{},\"nearest_nic\":{}}}",
                js(&g.pci),
                g.numa.map(|n| n.to_string()).unwrap_or("null".into()),
                g.nearest_nic.as_deref().map(js).unwrap_or("null".into())
            )
        })
        .collect();
    format!(
        "{{\"verdict\":\"{:?}\",\"checks\":[{}],\"ports\":[{}],\"gpus\":[{}],\"tcp_interfaces\":[{}],\"export_env\":[{}]}}\n",
        r.worst(),
        checks.join(","),
        ports.join(","),
        gpus.join(","),
        r.tcp_ifs.iter().map(|s| js(s)).collect::<Vec<_>>().join(","),
        r.export_env.iter().map(|s| js(s)).collect::<Vec<_>>().join(",")
    )
}

/// Parse helper for tests: an `NCCL_IB_HCA`-style list.
pub fn namelist(s: &str) -> Option<NameList> {
    NameList::parse_knob(s)
}
