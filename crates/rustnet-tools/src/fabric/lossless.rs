//! The lossless-Ethernet (RoCE) checks of `rustnet doctor`: MTU (netdev vs
//! the port's active RoCE MTU vs the peer's), the PFC-enabled priorities and
//! the DSCP-to-priority map (from the kernel's DCB netlink, as iproute2's
//! `dcb` reads them, or from `dcb`'s output), ECN for RoCE per priority (mlx5's
//! `/sys/class/net/<dev>/ecn/roce_np|roce_rp/enable/<prio>`), and whether the
//! traffic class the plugin puts on the wire (`NCCL_IB_TC`; DSCP = TC >> 2)
//! lands on a priority that is PFC- and ECN-enabled.
//!
//! [`gather`] does the IO (sysfs under a root, the `dcb` tool by a path the
//! caller picks); [`mtu_checks`] and [`qos_checks`] are pure, so every
//! PASS/WARN/FAIL branch is tested on constructed inputs.
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use crate::status::Status;

/// One check result (the doctor turns it into a report line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Out {
    /// What was checked (`mlx5_0:1 MTU`).
    pub what: String,
    /// Outcome.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// The fix, one line (empty on PASS).
    pub fix: String,
}

fn out(what: impl Into<String>, status: Status, detail: impl Into<String>, fix: impl Into<String>) -> Out {
    Out { what: what.into(), status, detail: detail.into(), fix: fix.into() }
}

pub use super::dcbnl::Dcb;

/// ECN (DCQCN) enable per priority, `None` where unreadable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ecn {
    /// Notification point (`roce_np`: sends CNPs for marked packets).
    pub np: [Option<bool>; 8],
    /// Reaction point (`roce_rp`: slows down on CNPs).
    pub rp: [Option<bool>; 8],
}

/// What the checks need about one RoCE port.
#[derive(Debug, Clone)]
pub struct PortQos {
    /// `mlx5_0:1`.
    pub label: String,
    /// Its netdev.
    pub netdev: String,
    /// Software RoCE (rxe, siw: no PCI device): PFC/ECN do not apply.
    pub software: bool,
    /// `/sys/class/net/<netdev>/mtu`.
    pub netdev_mtu: Option<u32>,
    /// The port's active MTU in bytes, when verbs could be asked.
    pub active_mtu: Option<u32>,
    /// DCB state, or why it could not be read.
    pub dcb: Result<Dcb, String>,
    /// ECN sysfs, `None` when the driver does not expose it.
    pub ecn: Option<Ecn>,
}

/// The traffic class and service level the plugin will use.
#[derive(Debug, Clone)]
pub struct Traffic {
    /// GRH traffic class (the IPv4 TOS byte).
    pub tc: u8,
    /// True when NCCL_IB_TC set it (else 0, or the communicator's class).
    pub tc_set: bool,
    /// Service level (the 802.1p priority without a DSCP map).
    pub sl: u8,
}

impl Traffic {
    /// From the knob values (-1 = unset).
    pub fn from_knobs(ib_tc: i64, ib_sl: i64) -> Traffic {
        Traffic { tc: ib_tc.clamp(0, 255) as u8, tc_set: ib_tc >= 0, sl: ib_sl.clamp(0, 15) as u8 }
    }

    /// DSCP of the traffic class.
    pub fn dscp(&self) -> u8 {
        self.tc >> 2
    }

    fn describe(&self) -> String {
        if self.tc_set {
            format!("NCCL_IB_TC={} (DSCP {}, ECN bits {})", self.tc, self.dscp(), self.tc & 3)
        } else {
            "NCCL_IB_TC unset: traffic class 0 (DSCP 0) unless NCCL passes the communicator's class".to_string()
        }
    }
}

/// The RoCE MTU a netdev MTU allows (the kernel's `iboe_get_mtu`: 96 bytes
/// of GRH/UDP/BTH/extension/ICRC headroom, then the largest IB MTU that
/// fits), 0 when not even 256 fits.
pub fn roce_mtu_for(netdev_mtu: u32) -> u32 {
    let room = netdev_mtu.saturating_sub(96);
    [4096, 2048, 1024, 512, 256].into_iter().find(|&m| room >= m).unwrap_or(0)
}

/// MTU checks over every RoCE port of the host; `peer_mtu` is the peer's
/// netdev MTU when the operator gives it (`--peer-mtu`).
pub fn mtu_checks(ports: &[PortQos], peer_mtu: Option<u32>) -> Vec<Out> {
    let mut v = Vec::new();
    for p in ports {
        let what = format!("{} MTU", p.label);
        let nd = &p.netdev;
        let Some(m) = p.netdev_mtu else {
            v.push(out(
                what,
                Status::Warn,
                format!("cannot read /sys/class/net/{nd}/mtu"),
                "check that the netdev is in this network namespace",
            ));
            continue;
        };
        let allowed = roce_mtu_for(m);
        let (active, src) = match p.active_mtu {
            Some(a) => (a, "active"),
            None => (allowed, "expected (verbs not queried)"),
        };
        if active < allowed {
            v.push(out(
                &what,
                Status::Warn,
                format!("{nd} MTU {m} but the RoCE active MTU is {active} (the netdev allows {allowed})"),
                format!(
                    "the RoCE MTU follows the netdev MTU: set it again (ip link set dev {nd} mtu {m}) and check max_mtu (ibv_devinfo -v)"
                ),
            ));
        } else if active >= 4096 {
            v.push(out(&what, Status::Pass, format!("{nd} MTU {m}, RoCE MTU {active} ({src})"), ""));
        } else {
            v.push(out(
                &what,
                Status::Warn,
                format!(
                    "{nd} MTU {m}: RoCE MTU {active} ({src}), {}x the packets of 4096 (RoCE 4096 needs a netdev MTU of 4192 or more)",
                    4096 / active.max(256)
                ),
                format!("if the fabric carries jumbo frames: ip link set dev {nd} mtu 9000 (the same on the peers and switch ports)"),
            ));
        }
        if let Some(pm) = peer_mtu {
            let peer = roce_mtu_for(pm);
            if peer < active {
                v.push(out(
                    format!("{} path MTU", p.label),
                    Status::Warn,
                    format!("the peer's MTU {pm} caps the path at RoCE MTU {peer} (the plugin uses the smaller of both ends' active MTU)"),
                    format!("give the peer's netdev the same MTU as {nd} ({m})"),
                ));
            } else {
                v.push(out(format!("{} path MTU", p.label), Status::Pass, format!("RoCE MTU {active} with the peer's MTU {pm}"), ""));
            }
        }
    }
    let mtus: BTreeMap<u32, Vec<&str>> =
        ports.iter().filter_map(|p| Some((p.netdev_mtu?, p.netdev.as_str()))).fold(BTreeMap::new(), |mut m, (k, n)| {
            m.entry(k).or_insert_with(Vec::new).push(n);
            m
        });
    if mtus.len() > 1 {
        let list: Vec<String> = mtus.iter().map(|(k, n)| format!("{k} on {}", n.join(","))).collect();
        let max = *mtus.keys().last().unwrap_or(&0);
        v.push(out(
            "RoCE netdev MTUs",
            Status::Warn,
            format!("differ between rails: {}", list.join("; ")),
            format!("use one MTU on every RoCE netdev (e.g. {max}): a connection runs at the smaller of both ends"),
        ));
    }
    v
}

fn prio_list(b: &[bool; 8]) -> String {
    let v: Vec<String> = (0..8).filter(|&i| b[i]).map(|i| i.to_string()).collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(",")
    }
}

/// PFC / DSCP map / ECN checks of one RoCE port for the plugin's traffic.
pub fn qos_checks(p: &PortQos, t: &Traffic) -> Vec<Out> {
    let nd = &p.netdev;
    let l = &p.label;
    let mut v = Vec::new();
    if p.software {
        v.push(out(
            format!("{l} PFC/ECN"),
            Status::Pass,
            format!("not applicable: software RoCE on {nd} (no NIC queues; the host's IP stack carries the packets)"),
            "",
        ));
        return v;
    }
    v.push(out(format!("{l} traffic class"), Status::Pass, format!("{}; NCCL_IB_SL={}", t.describe(), t.sl), ""));
    // Which priority the traffic lands on.
    let prio: Option<u8> = match &p.dcb {
        Err(e) => {
            v.push(out(
                format!("{l} PFC / DSCP map"),
                Status::Warn,
                format!("cannot read {nd}'s DCB state: {e}"),
                "check the driver has DCB support (mlx5: CONFIG_MLX5_CORE_EN_DCB) and that this runs in the netdev's namespace",
            ));
            None
        }
        Ok(d) if d.dscp_prio.is_empty() => {
            let prio = t.sl & 7;
            v.push(out(
                format!("{l} DSCP map"),
                Status::Warn,
                format!("{nd} has no DSCP-to-priority map (trust pcp): the priority is the VLAN PCP, which RoCE takes from NCCL_IB_SL={} (priority {prio}); untagged frames carry none", t.sl),
                format!("on a routed RoCE fabric classify by DSCP: dcb app add dev {nd} dscp-prio {}:3 (mlnx_qos -i {nd} --trust dscp)", t.dscp()),
            ));
            Some(prio)
        }
        Ok(d) => match d.dscp_prio.get(&t.dscp()) {
            Some(&prio) => {
                v.push(out(format!("{l} DSCP map"), Status::Pass, format!("trust dscp: DSCP {} -> priority {prio}", t.dscp()), ""));
                Some(prio)
            }
            None => {
                let target = (0..8u8).find(|&q| d.pfc[q as usize]).unwrap_or(3);
                v.push(out(
                    format!("{l} DSCP map"),
                    Status::Warn,
                    format!(
                        "DSCP {} is not in {nd}'s DSCP map ({} entries): the NIC's default (priority 0) applies",
                        t.dscp(),
                        d.dscp_prio.len()
                    ),
                    format!("dcb app add dev {nd} dscp-prio {}:{target}", t.dscp()),
                ));
                Some(0)
            }
        },
    };
    if let Ok(d) = &p.dcb {
        let prio = prio.unwrap_or(0);
        let enabled = prio_list(&d.pfc);
        if !d.pfc.iter().any(|&b| b) {
            v.push(out(
                format!("{l} PFC"),
                Status::Warn,
                format!("PFC off on every priority of {nd}: lossy RoCE, every drop costs a go-back-N retransmission (fine only where the fabric is built for lossy RoCE)"),
                format!("dcb pfc set dev {nd} prio-pfc {prio}:on (matching the switches)"),
            ));
        } else if d.pfc[prio as usize] {
            v.push(out(
                format!("{l} PFC"),
                Status::Pass,
                format!("PFC on priorities {enabled}: the plugin's priority {prio} is lossless"),
                "",
            ));
        } else {
            let good = (0..8u8).find(|&q| d.pfc[q as usize]).unwrap_or(3);
            let fix = if d.dscp_prio.is_empty() {
                format!("export NCCL_IB_SL={good}")
            } else {
                match d.dscp_prio.iter().find(|(_, &q)| q == good) {
                    Some((&dscp, _)) => format!("export NCCL_IB_TC={} (DSCP {dscp} -> priority {good})", (dscp << 2) | (t.tc & 3)),
                    None => format!("dcb app add dev {nd} dscp-prio {}:{good}", t.dscp()),
                }
            };
            v.push(out(
                format!("{l} PFC"),
                Status::Fail,
                format!("PFC on priorities {enabled} of {nd}, but the plugin's traffic lands on priority {prio}: no flow control for it, drops under load"),
                fix,
            ));
        }
    }
    // ECN per priority.
    match &p.ecn {
        None => v.push(out(
            format!("{l} ECN"),
            Status::Pass,
            format!("/sys/class/net/{nd}/ecn not exposed by this driver (MLNX_OFED's mlx5 has it; firmware defaults apply)"),
            "",
        )),
        Some(e) => {
            let on = |a: &[Option<bool>; 8]| -> [bool; 8] { std::array::from_fn(|i| a[i] == Some(true)) };
            match prio {
                Some(q) => {
                    let (np, rp) = (e.np[q as usize], e.rp[q as usize]);
                    if np == Some(true) && rp == Some(true) {
                        v.push(out(format!("{l} ECN"), Status::Pass, format!("DCQCN on priority {q}: roce_np and roce_rp enabled"), ""));
                    } else {
                        let show = |x: Option<bool>| match x {
                            Some(true) => "on",
                            Some(false) => "off",
                            None => "unreadable",
                        };
                        v.push(out(
                            format!("{l} ECN"),
                            Status::Warn,
                            format!("DCQCN on the plugin's priority {q}: roce_np {}, roce_rp {}: congestion becomes pauses or drops instead of rate cuts", show(np), show(rp)),
                            format!("echo 1 > /sys/class/net/{nd}/ecn/roce_np/enable/{q}; echo 1 > /sys/class/net/{nd}/ecn/roce_rp/enable/{q}"),
                        ));
                    }
                }
                None => {
                    let (np, rp) = (on(&e.np), on(&e.rp));
                    let s = if np.iter().any(|&b| b) && rp.iter().any(|&b| b) { Status::Pass } else { Status::Warn };
                    v.push(out(
                        format!("{l} ECN"),
                        s,
                        format!(
                            "roce_np on priorities {}, roce_rp on {} (the plugin's priority is unknown)",
                            prio_list(&np),
                            prio_list(&rp)
                        ),
                        format!("enable both on the RoCE priority: /sys/class/net/{nd}/ecn/roce_{{np,rp}}/enable/<prio>"),
                    ));
                }
            }
        }
    }
    v
}

/// How to read DCB state.
#[derive(Debug, Clone)]
pub enum DcbTool {
    /// Ask the kernel over DCB netlink ([`super::dcbnl`]), as `dcb` does.
    Netlink,
    /// Run iproute2's `dcb` (this path or name) and parse its output.
    Run(String),
    /// Do not, for this reason.
    Skip(String),
}

impl DcbTool {
    /// The live default: netlink.
    pub fn detect() -> DcbTool {
        DcbTool::Netlink
    }
}

/// `prio-pfc 0:off 1:off 2:off 3:on ...` (from `dcb pfc show`).
pub fn parse_prio_pfc(text: &str) -> Option<[bool; 8]> {
    let mut it = text.split_whitespace().skip_while(|t| *t != "prio-pfc");
    it.next()?;
    let mut pfc = [false; 8];
    let mut seen = 0;
    for t in it {
        let Some((p, s)) = t.split_once(':') else { break };
        let Ok(p) = p.parse::<usize>() else { break };
        if p < 8 {
            pfc[p] = s == "on";
            seen += 1;
        }
    }
    (seen > 0).then_some(pfc)
}

/// `dscp-prio 0:0 ... 26:3` (from `dcb -N app show dev X dscp-prio`).
pub fn parse_dscp_prio(text: &str) -> BTreeMap<u8, u8> {
    let mut it = text.split_whitespace().skip_while(|t| *t != "dscp-prio");
    let mut m = BTreeMap::new();
    if it.next().is_none() {
        return m;
    }
    for t in it {
        let Some((d, p)) = t.split_once(':') else { break };
        let (Ok(d), Ok(p)) = (d.parse::<u8>(), p.parse::<u8>()) else { break };
        if d < 64 && p < 8 {
            m.insert(d, p);
        }
    }
    m
}

fn run_dcb(bin: &str, args: &[&str]) -> Result<String, String> {
    let o = Command::new(bin).args(args).output().map_err(|e| format!("cannot run {bin}: {e}"))?;
    if !o.status.success() {
        let e = String::from_utf8_lossy(&o.stderr).trim().to_string();
        return Err(format!("`{bin} {}`: {}", args.join(" "), if e.is_empty() { o.status.to_string() } else { e }));
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// DCB state of `netdev`: over netlink, or through the `dcb` tool.
pub fn read_dcb(tool: &DcbTool, netdev: &str) -> Result<Dcb, String> {
    let bin = match tool {
        DcbTool::Netlink => return super::dcbnl::query(netdev),
        DcbTool::Run(b) => b.as_str(),
        DcbTool::Skip(why) => return Err(why.clone()),
    };
    let pfc_text = run_dcb(bin, &["pfc", "show", "dev", netdev, "prio-pfc"])?;
    let pfc = parse_prio_pfc(&pfc_text).ok_or_else(|| format!("no prio-pfc in `{bin} pfc show dev {netdev}`: {}", pfc_text.trim()))?;
    let app = run_dcb(bin, &["-N", "app", "show", "dev", netdev, "dscp-prio"])?;
    Ok(Dcb { pfc, dscp_prio: parse_dscp_prio(&app) })
}

/// ECN sysfs of `netdev` (`None` when the folder does not exist).
pub fn read_ecn(sysfs: &Path, netdev: &str) -> Option<Ecn> {
    let base = sysfs.join("class/net").join(netdev).join("ecn");
    if !base.is_dir() {
        return None;
    }
    let rd = |proto: &str, i: usize| -> Option<bool> {
        let s = std::fs::read_to_string(base.join(proto).join("enable").join(i.to_string())).ok()?;
        match s.trim() {
            "1" => Some(true),
            "0" => Some(false),
            _ => None,
        }
    };
    Some(Ecn { np: std::array::from_fn(|i| rd("roce_np", i)), rp: std::array::from_fn(|i| rd("roce_rp", i)) })
}

/// Gather one port's facts. `active_mtu` comes from the caller (verbs).
pub fn gather(sysfs: &Path, label: &str, netdev: &str, software: bool, active_mtu: Option<u32>, tool: &DcbTool) -> PortQos {
    let netdev_mtu = std::fs::read_to_string(sysfs.join("class/net").join(netdev).join("mtu")).ok().and_then(|s| s.trim().parse().ok());
    PortQos {
        label: label.to_string(),
        netdev: netdev.to_string(),
        software,
        netdev_mtu,
        active_mtu,
        dcb: if software { Err("software RoCE".into()) } else { read_dcb(tool, netdev) },
        ecn: if software { None } else { read_ecn(sysfs, netdev) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(mtu: Option<u32>, active: Option<u32>) -> PortQos {
        PortQos {
            label: "mlx5_0:1".into(),
            netdev: "eth2".into(),
            software: false,
            netdev_mtu: mtu,
            active_mtu: active,
            dcb: Ok(Dcb::default()),
            ecn: None,
        }
    }

    fn dcb(pfc: &[usize], map: &[(u8, u8)]) -> Dcb {
        let mut d = Dcb::default();
        for &p in pfc {
            d.pfc[p] = true;
        }
        d.dscp_prio = map.iter().copied().collect();
        d
    }

    fn ecn(np: &[usize], rp: &[usize]) -> Ecn {
        Ecn { np: std::array::from_fn(|i| Some(np.contains(&i))), rp: std::array::from_fn(|i| Some(rp.contains(&i))) }
    }

    fn default_map() -> Vec<(u8, u8)> {
        (0..64u8).map(|d| (d, d >> 3)).collect()
    }

    #[test]
    fn roce_mtu_rule_matches_the_kernel() {
        assert_eq!(roce_mtu_for(1500), 1024);
        assert_eq!(roce_mtu_for(4200), 4096);
        assert_eq!(roce_mtu_for(4192), 4096);
        assert_eq!(roce_mtu_for(4191), 2048);
        assert_eq!(roce_mtu_for(9000), 4096);
        assert_eq!(roce_mtu_for(300), 0);
    }

    #[test]
    fn mtu_branches() {
        // jumbo, active 4096: PASS
        let c = mtu_checks(&[port(Some(9000), Some(4096))], None);
        assert_eq!(c[0].status, Status::Pass, "{c:?}");
        assert_eq!(c[0].detail, "eth2 MTU 9000, RoCE MTU 4096 (active)");
        // 9000-byte netdev with a 1024 RoCE MTU: WARN naming both
        let c = mtu_checks(&[port(Some(9000), Some(1024))], None);
        assert_eq!(c[0].status, Status::Warn);
        assert!(c[0].detail.contains("eth2 MTU 9000 but the RoCE active MTU is 1024 (the netdev allows 4096)"), "{c:?}");
        // 1500 where jumbo may have been meant
        let c = mtu_checks(&[port(Some(1500), None)], None);
        assert_eq!(c[0].status, Status::Warn);
        assert!(c[0].detail.starts_with("eth2 MTU 1500: RoCE MTU 1024 (expected (verbs not queried)), 4x the packets"), "{c:?}");
        assert!(c[0].fix.contains("ip link set dev eth2 mtu 9000"));
        // unreadable
        assert_eq!(mtu_checks(&[port(None, None)], None)[0].status, Status::Warn);
        // the peer caps it / matches
        let c = mtu_checks(&[port(Some(9000), Some(4096))], Some(1500));
        assert_eq!((c[1].what.as_str(), c[1].status), ("mlx5_0:1 path MTU", Status::Warn));
        assert!(c[1].detail.contains("caps the path at RoCE MTU 1024"), "{c:?}");
        let c = mtu_checks(&[port(Some(9000), Some(4096))], Some(9000));
        assert_eq!(c[1].status, Status::Pass);
        // rails differ
        let mut b = port(Some(1500), Some(1024));
        b.netdev = "eth3".into();
        let c = mtu_checks(&[port(Some(9000), Some(4096)), b], None);
        let last = c.last().unwrap();
        assert_eq!((last.what.as_str(), last.status), ("RoCE netdev MTUs", Status::Warn));
        assert_eq!(last.detail, "differ between rails: 1500 on eth3; 9000 on eth2");
    }

    #[test]
    fn tc_106_on_pfc_and_ecn_priority_3_passes() {
        let mut p = port(Some(9000), Some(4096));
        p.dcb = Ok(dcb(&[3], &default_map()));
        p.ecn = Some(ecn(&[3], &[3]));
        let c = qos_checks(&p, &Traffic::from_knobs(106, -1));
        let st: Vec<(&str, Status)> = c.iter().map(|o| (o.what.as_str(), o.status)).collect();
        assert_eq!(
            st,
            [
                ("mlx5_0:1 traffic class", Status::Pass),
                ("mlx5_0:1 DSCP map", Status::Pass),
                ("mlx5_0:1 PFC", Status::Pass),
                ("mlx5_0:1 ECN", Status::Pass)
            ]
        );
        assert_eq!(c[0].detail, "NCCL_IB_TC=106 (DSCP 26, ECN bits 2); NCCL_IB_SL=0");
        assert_eq!(c[1].detail, "trust dscp: DSCP 26 -> priority 3");
    }

    #[test]
    fn default_tc_lands_on_priority_0_without_pfc_fails_with_the_tc_fix() {
        let mut p = port(Some(9000), Some(4096));
        p.dcb = Ok(dcb(&[3], &default_map()));
        p.ecn = Some(ecn(&[3], &[3]));
        let c = qos_checks(&p, &Traffic::from_knobs(-1, -1));
        let pfc = c.iter().find(|o| o.what.ends_with("PFC")).unwrap();
        assert_eq!(pfc.status, Status::Fail);
        assert!(pfc.detail.contains("PFC on priorities 3 of eth2, but the plugin's traffic lands on priority 0"), "{pfc:?}");
        assert_eq!(pfc.fix, "export NCCL_IB_TC=96 (DSCP 24 -> priority 3)");
        let e = c.iter().find(|o| o.what.ends_with("ECN")).unwrap();
        assert_eq!(e.status, Status::Warn);
        assert!(e.detail.contains("priority 0: roce_np off, roce_rp off"), "{e:?}");
        assert_eq!(e.fix, "echo 1 > /sys/class/net/eth2/ecn/roce_np/enable/0; echo 1 > /sys/class/net/eth2/ecn/roce_rp/enable/0");
    }

    #[test]
    fn pfc_off_everywhere_is_lossy_warn() {
        let mut p = port(Some(9000), Some(4096));
        p.dcb = Ok(dcb(&[], &default_map()));
        let c = qos_checks(&p, &Traffic::from_knobs(106, -1));
        let pfc = c.iter().find(|o| o.what.ends_with("PFC")).unwrap();
        assert_eq!(pfc.status, Status::Warn);
        assert!(pfc.detail.starts_with("PFC off on every priority of eth2: lossy RoCE"));
        assert_eq!(pfc.fix, "dcb pfc set dev eth2 prio-pfc 3:on (matching the switches)");
        // ECN not exposed (upstream driver): PASS saying so
        let e = c.iter().find(|o| o.what.ends_with("ECN")).unwrap();
        assert_eq!(e.status, Status::Pass);
        assert!(e.detail.contains("not exposed"));
    }

    #[test]
    fn trust_pcp_uses_sl_and_says_so() {
        let mut p = port(Some(9000), Some(4096));
        p.dcb = Ok(dcb(&[3], &[]));
        let c = qos_checks(&p, &Traffic::from_knobs(106, 3));
        let m = c.iter().find(|o| o.what.ends_with("DSCP map")).unwrap();
        assert_eq!(m.status, Status::Warn);
        assert!(m.detail.contains("trust pcp") && m.detail.contains("NCCL_IB_SL=3 (priority 3)"), "{m:?}");
        assert_eq!(c.iter().find(|o| o.what.ends_with("PFC")).unwrap().status, Status::Pass);
        // SL 0 with PFC on 3: the fix is the SL
        let c = qos_checks(&p, &Traffic::from_knobs(106, -1));
        let pfc = c.iter().find(|o| o.what.ends_with("PFC")).unwrap();
        assert_eq!((pfc.status, pfc.fix.as_str()), (Status::Fail, "export NCCL_IB_SL=3"));
    }

    #[test]
    fn dscp_missing_from_a_partial_map_and_unreadable_dcb() {
        let mut p = port(Some(9000), Some(4096));
        p.dcb = Ok(dcb(&[3], &[(26, 3)]));
        let c = qos_checks(&p, &Traffic::from_knobs(184, -1)); // DSCP 46
        let m = c.iter().find(|o| o.what.ends_with("DSCP map")).unwrap();
        assert_eq!(m.status, Status::Warn);
        assert_eq!(m.fix, "dcb app add dev eth2 dscp-prio 46:3");
        let pfc = c.iter().find(|o| o.what.ends_with("PFC")).unwrap();
        assert_eq!((pfc.status, pfc.fix.as_str()), (Status::Fail, "export NCCL_IB_TC=104 (DSCP 26 -> priority 3)"));
        // no DCB at all: one WARN, ECN with unknown priority lists the sets
        p.dcb = Err("Attribute read: Operation not supported".into());
        p.ecn = Some(ecn(&[3], &[3]));
        let c = qos_checks(&p, &Traffic::from_knobs(106, -1));
        let d = c.iter().find(|o| o.what.ends_with("PFC / DSCP map")).unwrap();
        assert_eq!(d.status, Status::Warn);
        assert!(d.detail.contains("Operation not supported"));
        assert!(!c.iter().any(|o| o.what.ends_with(" PFC")));
        let e = c.iter().find(|o| o.what.ends_with("ECN")).unwrap();
        assert_eq!(
            (e.status, e.detail.as_str()),
            (Status::Pass, "roce_np on priorities 3, roce_rp on 3 (the plugin's priority is unknown)")
        );
        p.ecn = Some(ecn(&[], &[]));
        assert_eq!(qos_checks(&p, &Traffic::from_knobs(106, -1)).iter().find(|o| o.what.ends_with("ECN")).unwrap().status, Status::Warn);
    }

    #[test]
    fn software_roce_is_not_applicable() {
        let mut p = port(Some(1500), Some(1024));
        p.software = true;
        let c = qos_checks(&p, &Traffic::from_knobs(-1, -1));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].status, Status::Pass);
        assert!(c[0].detail.starts_with("not applicable: software RoCE on eth2"));
    }

    #[test]
    fn dcb_tool_output_parses() {
        let pfc = parse_prio_pfc("prio-pfc 0:off 1:off 2:off 3:on 4:off 5:off 6:off 7:off \n").unwrap();
        assert_eq!(pfc, [false, false, false, true, false, false, false, false]);
        let pfc =
            parse_prio_pfc("pfc-cap 8 macsec-bypass off delay 0 \nprio-pfc 0:off 1:on 2:off 3:on 4:off 5:off 6:off 7:off \n").unwrap();
        assert!(pfc[1] && pfc[3] && !pfc[0]);
        assert!(parse_prio_pfc("pfc-cap 8\n").is_none());
        let m = parse_dscp_prio("dscp-prio 0:0 8:1 26:3 46:5 \n");
        assert_eq!(m.get(&26), Some(&3));
        assert_eq!(m.len(), 4);
        assert!(parse_dscp_prio("dscp-prio \n").is_empty());
        assert!(parse_dscp_prio("").is_empty());
    }
}
