//! iWARP (Chelsio T6/T7, Intel E810 in iWARP mode, soft-iWARP `siw`): what
//! sets it apart from InfiniBand and RoCE, and how discovery treats it.
//!
//! iWARP is RDMA over TCP. A device says so in `ibv_device::transport_type`
//! (`IBV_TRANSPORT_IWARP`; sysfs `node_type` "4: RNIC") while its port's link
//! layer reads Ethernet, so link layer alone would take it for RoCE. What
//! the RoCE/IB path relies on and iWARP lacks:
//! - QPs are connected by the kernel's iw_cm through rdma_cm (librdmacm): a QP
//!   brought up by hand reaches RTR, and RTR -> RTS fails with EINVAL;
//! - no immediate data: SEND_WITH_IMM and RDMA_WRITE_WITH_IMM are refused at
//!   post time, and the RoCE/IB data path signals completions with WRITE WITH
//!   IMM (p2p.rs).
//!
//! iWARP ports are discovered and selected by the same `NCCL_IB_HCA` rules
//! as any other port; their connections go through rdma_cm
//! ([`super::rdmacm`]) and their completions travel as notices
//! ([`super::notice_path`], rules in [`crate::proto::notice`]). IB and RoCE
//! ports are judged exactly as before. [`IWARP_DATA_PATH`] is the switch
//! (tests drive both settings through [`verdict_with`]).
use std::path::Path;

use super::ffi::{IBV_PORT_ACTIVE, IBV_TRANSPORT_IWARP};
use super::port::{port_state_name, LINK_ETH, LINK_IB};
use crate::config::NameList;

/// Whether this build carries traffic over iWARP ports (rdma_cm connection
/// set-up and the immediate-free notice data path are in).
pub const IWARP_DATA_PATH: bool = true;

/// Why iWARP ports would be left out were [`IWARP_DATA_PATH`] false.
pub const IWARP_WHY: &str = "iWARP needs the rdma_cm connection path and a data path without immediates, not in this build";

/// What the plugin does differently on iWARP, for the init log and doctor.
pub const IWARP_HOW: &str =
    "rdma_cm connection set-up, completion notices by SEND (no immediates), a send done once the receiver has it (a one-byte RDMA READ behind each notice), eager path off, host memory only, recovery in place after a link fault (new QPs over new rdma_cm connections)";

/// The RDMA network a port belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// InfiniBand (link layer InfiniBand, or unspecified as old drivers report).
    Ib,
    /// RoCE: IB transport over an Ethernet link layer.
    Roce,
    /// iWARP: RDMA over TCP, whatever the link layer says.
    Iwarp,
    /// A link layer we do not drive.
    Other,
}

impl Kind {
    /// From the device's `transport_type` and the port's `link_layer`.
    /// Non-iWARP transports are judged by link layer alone, as before.
    pub fn of(transport_type: i32, link_layer: u8) -> Kind {
        if transport_type == IBV_TRANSPORT_IWARP {
            return Kind::Iwarp;
        }
        match link_layer {
            LINK_IB | 0 => Kind::Ib,
            LINK_ETH => Kind::Roce,
            _ => Kind::Other,
        }
    }

    /// For logs and doctor: `IB`, `RoCE`, `iWARP`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Ib => "IB",
            Kind::Roce => "RoCE",
            Kind::Iwarp => "iWARP",
            Kind::Other => "other link layer",
        }
    }
}

/// Whether sysfs says `dev` is an iWARP device (`node_type` "4: RNIC"; what
/// libibverbs turns into `IBV_TRANSPORT_IWARP`). For `rustnet doctor`, which
/// reads sysfs rather than opening devices.
pub fn sysfs_is_iwarp(sysfs: &Path, dev: &str) -> bool {
    std::fs::read_to_string(sysfs.join("class/infiniband").join(dev).join("node_type"))
        .map(|s| s.trim_start().starts_with("4:") || s.contains("RNIC"))
        .unwrap_or(false)
}

/// What discovery knows about one port before deciding on it.
#[derive(Debug, Clone)]
pub struct PortFacts<'a> {
    /// Device name.
    pub dev: &'a str,
    /// Port number.
    pub port: u8,
    /// `ibv_device::transport_type`.
    pub transport_type: i32,
    /// `ibv_port_attr::link_layer`.
    pub link_layer: u8,
    /// `ibv_port_attr::state`.
    pub state: u32,
}

/// Discovery's decision on one port: `Some(kind)` to use it, and the text
/// listed among the ports seen (init log; the error when nothing is usable).
/// `iwarp` says whether iWARP ports can be connected here, or why not: the
/// caller passes [`super::rdmacm::iwarp_usable`] (the data path is built in
/// and librdmacm loads), so an iWARP port whose connections could only fail
/// is never offered to NCCL (tests drive both answers).
pub fn verdict_with(f: &PortFacts<'_>, hca: &NameList, iwarp: Result<(), &str>) -> (Option<Kind>, String) {
    let kind = Kind::of(f.transport_type, f.link_layer);
    let (name, port, ll) = (f.dev, f.port, kind.name());
    let state = port_state_name(f.state);
    if f.state != IBV_PORT_ACTIVE {
        return (None, format!("{name}:{port} {ll} {state}"));
    }
    if kind == Kind::Other {
        return (None, format!("{name}:{port} {ll}"));
    }
    if !hca.accepts(name, Some(port as u32)) {
        return (None, format!("{name}:{port} {ll} {state} (excluded by NCCL_IB_HCA)"));
    }
    if let (Kind::Iwarp, Err(why)) = (kind, iwarp) {
        return (None, format!("{name}:{port} {ll} {state} (left out: {why})"));
    }
    (Some(kind), format!("{name}:{port} {ll} {state}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KnobValue;
    use crate::transport::ib::ffi::{IBV_PORT_DOWN, IBV_TRANSPORT_IB};

    fn facts(dev: &str, transport_type: i32, link_layer: u8, state: u32) -> PortFacts<'_> {
        PortFacts { dev, port: 1, transport_type, link_layer, state }
    }

    /// The device list of a host with one of each network, plus a down port.
    fn fake_list() -> Vec<PortFacts<'static>> {
        vec![
            facts("mlx5_0", IBV_TRANSPORT_IB, LINK_IB, IBV_PORT_ACTIVE),
            facts("rxe0", IBV_TRANSPORT_IB, LINK_ETH, IBV_PORT_ACTIVE),
            facts("siw0", IBV_TRANSPORT_IWARP, LINK_ETH, IBV_PORT_ACTIVE),
            facts("iwp1s0", IBV_TRANSPORT_IWARP, LINK_ETH, IBV_PORT_DOWN),
            facts("old0", IBV_TRANSPORT_IB, 0, IBV_PORT_ACTIVE),
        ]
    }

    fn run(hca: &str, iwarp_ok: bool) -> (Vec<(String, Kind)>, Vec<String>) {
        run_why(hca, if iwarp_ok { Ok(()) } else { Err(IWARP_WHY) })
    }

    fn run_why(hca: &str, iwarp: Result<(), &str>) -> (Vec<(String, Kind)>, Vec<String>) {
        let hca = NameList::parse_knob(hca).unwrap();
        let mut used = Vec::new();
        let mut seen = Vec::new();
        for f in fake_list() {
            let (k, s) = verdict_with(&f, &hca, iwarp);
            if let Some(k) = k {
                used.push((f.dev.to_string(), k));
            }
            seen.push(s);
        }
        (used, seen)
    }

    #[test]
    fn iwarp_is_told_apart_from_roce_by_transport_not_link_layer() {
        assert_eq!(Kind::of(IBV_TRANSPORT_IWARP, LINK_ETH), Kind::Iwarp);
        assert_eq!(Kind::of(IBV_TRANSPORT_IB, LINK_ETH), Kind::Roce);
        assert_eq!(Kind::of(IBV_TRANSPORT_IB, LINK_IB), Kind::Ib);
        assert_eq!(Kind::of(IBV_TRANSPORT_IB, 0), Kind::Ib);
        assert_eq!(Kind::of(IBV_TRANSPORT_IB, 7), Kind::Other);
    }

    #[test]
    fn iwarp_ports_are_used_in_this_build_beside_ib_and_roce() {
        let (used, seen) = run("", IWARP_DATA_PATH);
        let names: Vec<&str> = used.iter().map(|u| u.0.as_str()).collect();
        assert_eq!(names, ["mlx5_0", "rxe0", "siw0", "old0"], "IB and RoCE as before, and the active iWARP port");
        assert!(seen.contains(&"siw0:1 iWARP ACTIVE".to_string()), "{seen:?}");
        assert!(seen.contains(&"iwp1s0:1 iWARP DOWN".to_string()), "{seen:?}");
        assert!(seen.contains(&"rxe0:1 RoCE ACTIVE".to_string()), "{seen:?}");
    }

    #[test]
    fn without_the_data_path_iwarp_ports_are_left_out_with_the_reason() {
        let (used, seen) = run("", false);
        let names: Vec<&str> = used.iter().map(|u| u.0.as_str()).collect();
        assert_eq!(names, ["mlx5_0", "rxe0", "old0"], "IB and RoCE as before, no iWARP");
        assert!(seen.contains(&format!("siw0:1 iWARP ACTIVE (left out: {IWARP_WHY})")), "{seen:?}");
        assert!(seen.contains(&"iwp1s0:1 iWARP DOWN".to_string()), "{seen:?}");
        assert!(seen.contains(&"rxe0:1 RoCE ACTIVE".to_string()), "{seen:?}");
    }

    #[test]
    fn without_librdmacm_iwarp_ports_are_not_offered_and_the_seen_line_says_why() {
        // RUSTNET_TRANSPORT=auto on an iWARP-only host: offering the port
        // would pick verbs and every connect would fail; left out, auto
        // falls back to TCP and the init log names the missing library.
        let why = "librdmacm not loadable: cannot load librdmacm.so.1: not found (install librdmacm1)";
        let (used, seen) = run_why("", Err(why));
        assert!(!used.iter().any(|u| u.1 == Kind::Iwarp), "{used:?}");
        assert!(seen.contains(&format!("siw0:1 iWARP ACTIVE (left out: {why})")), "{seen:?}");
        assert!(used.iter().any(|u| u.0 == "rxe0"), "RoCE is unaffected");
    }

    #[test]
    fn iwarp_ports_follow_the_nccl_ib_hca_rules() {
        // with the data path on, iWARP is selected like any other port
        let (used, _) = run("", true);
        assert!(used.contains(&("siw0".into(), Kind::Iwarp)));
        let (used, _) = run("=siw0", true);
        assert_eq!(used, [("siw0".to_string(), Kind::Iwarp)]);
        let (used, _) = run("siw", true);
        assert_eq!(used, [("siw0".to_string(), Kind::Iwarp)], "prefix match");
        let (used, seen) = run("^siw0", true);
        assert!(!used.iter().any(|u| u.0 == "siw0"));
        assert!(seen.contains(&"siw0:1 iWARP ACTIVE (excluded by NCCL_IB_HCA)".to_string()), "{seen:?}");
        let (used, _) = run("siw0:2", true);
        assert!(used.is_empty(), "port 2 only: {used:?}");
        // the exclusion is reported before the data-path reason
        let (_, seen) = run("^siw", false);
        assert!(seen.contains(&"siw0:1 iWARP ACTIVE (excluded by NCCL_IB_HCA)".to_string()), "{seen:?}");
    }

    #[test]
    fn sysfs_node_type_rnic_is_iwarp() {
        let d = std::env::temp_dir().join(format!("rustnet-iwarp-{}", std::process::id()));
        for (dev, nt) in [("siw0", "4: RNIC\n"), ("rxe0", "1: CA\n")] {
            let p = d.join("class/infiniband").join(dev);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("node_type"), nt).unwrap();
        }
        assert!(sysfs_is_iwarp(&d, "siw0"));
        assert!(!sysfs_is_iwarp(&d, "rxe0"));
        assert!(!sysfs_is_iwarp(&d, "absent0"));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
