//! The NIC's own per-port counters: `/sys/class/infiniband/<dev>/ports/<p>/counters/*`
//! (the IB PMA set: `port_xmit_data`, `symbol_error`, `link_downed`, ...),
//! `.../hw_counters/*` (driver-specific: mlx5's `np_cnp_sent`,
//! `rp_cnp_handled`, `np_ecn_marked_roce_packets`, `out_of_sequence`,
//! `packet_seq_err`, `local_ack_timeout_err`, ...; rxe's `sent_pkts`,
//! `out_of_seq_request`, `rcvd_seq_err`, `completer_retry_err`, ...) and,
//! where the `ethtool` binary is there, the Ethernet netdev's `ethtool -S`
//! statistics that matter to RoCE (per-priority pause frames
//! `rx_prio<N>_pause` / `tx_prio<N>_pause` on mlx5, PHY errors, discards).
//!
//! Reads are cheap and side-effect free (one small file each); files that
//! do not parse as a number (`hw_counters/lifespan` is a setting, not a
//! counter) are left out. [`Delta`] turns two snapshots into increases,
//! which [`super::classify`] names.
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Counters of one RDMA port (and its netdev) at one moment.
#[derive(Debug, Clone, Default)]
pub struct PortCounters {
    /// RDMA device (`mlx5_0`, `rxe0`).
    pub dev: String,
    /// Port number.
    pub port: u8,
    /// Ethernet netdev of the port (RoCE), if known.
    pub netdev: Option<String>,
    /// `ports/<p>/counters/*`.
    pub counters: BTreeMap<String, u64>,
    /// `ports/<p>/hw_counters/*`.
    pub hw: BTreeMap<String, u64>,
    /// `ethtool -S <netdev>`, the RoCE-relevant subset ([`ethtool_relevant`]).
    pub eth: BTreeMap<String, u64>,
    /// Why there are no ethtool statistics (no netdev, no binary, it failed).
    pub eth_note: Option<String>,
}

/// Where a counter comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source {
    /// `counters/` (IB port counters).
    Port,
    /// `hw_counters/` (driver counters).
    Hw,
    /// `ethtool -S`.
    Ethtool,
}

impl PortCounters {
    /// Every counter with its source.
    pub fn iter(&self) -> impl Iterator<Item = (Source, &str, u64)> {
        self.counters
            .iter()
            .map(|(k, v)| (Source::Port, k.as_str(), *v))
            .chain(self.hw.iter().map(|(k, v)| (Source::Hw, k.as_str(), *v)))
            .chain(self.eth.iter().map(|(k, v)| (Source::Ethtool, k.as_str(), *v)))
    }

    /// `mlx5_0:1`.
    pub fn label(&self) -> String {
        format!("{}:{}", self.dev, self.port)
    }
}

fn read_dir_numbers(dir: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(rd) = std::fs::read_dir(dir) else { return out };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        // `lifespan` is hw_counters' cache setting in ms, not a counter.
        if name == "lifespan" {
            continue;
        }
        if let Some(v) = std::fs::read_to_string(e.path()).ok().and_then(|s| s.trim().parse::<u64>().ok()) {
            out.insert(name, v);
        }
    }
    out
}

/// The netdev of a port: from its GID table (`gid_attrs/ndevs/*`), else the
/// PCI device's `net/` folder, else the device's `parent` (rxe, siw).
pub fn netdev_of(sysfs: &Path, dev: &str, port: u8) -> Option<String> {
    let d = sysfs.join("class/infiniband").join(dev);
    let nd = d.join("ports").join(port.to_string()).join("gid_attrs/ndevs");
    if let Ok(rd) = std::fs::read_dir(&nd) {
        let mut idx: Vec<u32> = rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect();
        idx.sort();
        for i in idx {
            if let Some(s) = std::fs::read_to_string(nd.join(i.to_string())).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()) {
                return Some(s);
            }
        }
    }
    if let Some(n) =
        std::fs::read_dir(d.join("device/net")).ok().and_then(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).min())
    {
        return Some(n);
    }
    std::fs::read_to_string(d.join("parent")).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// Every (device, port) under `sysfs`, sorted.
pub fn ports(sysfs: &Path) -> Vec<(String, u8)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(sysfs.join("class/infiniband")) else { return out };
    let mut devs: Vec<String> = rd.filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned())).collect();
    devs.sort();
    for d in devs {
        let Ok(pr) = std::fs::read_dir(sysfs.join("class/infiniband").join(&d).join("ports")) else { continue };
        let mut ps: Vec<u8> = pr.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect();
        ps.sort();
        out.extend(ps.into_iter().map(|p| (d.clone(), p)));
    }
    out
}

/// How to get `ethtool -S`.
#[derive(Debug, Clone)]
pub enum Ethtool {
    /// Run this binary (`ethtool` looked up on PATH, or a path).
    Run(String),
    /// Do not (with the reason shown).
    Skip(String),
}

impl Ethtool {
    /// `ethtool` when it is on PATH, else Skip naming why.
    pub fn detect() -> Ethtool {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).chain(["/usr/sbin".into(), "/sbin".into()]).any(|d| d.join("ethtool").is_file()))
            .unwrap_or(false);
        if found {
            Ethtool::Run("ethtool".into())
        } else {
            Ethtool::Skip("no ethtool binary on PATH: per-priority pause frames not read (install ethtool)".into())
        }
    }
}

/// Parse `ethtool -S` output (`NIC statistics:` then `     name: value` lines).
pub fn parse_ethtool_s(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.trim().rsplit_once(':')?;
            Some((k.trim().to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// The `ethtool -S` names kept: pause frames (per priority and global),
/// PHY-level errors and discards, pause storms. Per-queue and per-priority
/// byte/packet counters are left out (hundreds of them on mlx5).
pub fn ethtool_relevant(name: &str) -> bool {
    let n = name;
    n.contains("pause")
        || n.contains("discard")
        || n.contains("crc_err")
        || n.contains("symbol_err")
        || n.contains("link_down")
        || n.contains("out_of_buffer")
        || n.ends_with("_errors_phy")
        || n.contains("storm")
}

/// `ethtool -S <netdev>`, the relevant subset.
pub fn ethtool_stats(tool: &Ethtool, netdev: &str) -> Result<BTreeMap<String, u64>, String> {
    let bin = match tool {
        Ethtool::Run(b) => b,
        Ethtool::Skip(why) => return Err(why.clone()),
    };
    let out = Command::new(bin).arg("-S").arg(netdev).output().map_err(|e| format!("cannot run {bin}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        return Err(format!("{bin} -S {netdev} failed: {}", if err.is_empty() { out.status.to_string() } else { err }));
    }
    Ok(parse_ethtool_s(&String::from_utf8_lossy(&out.stdout)).into_iter().filter(|(k, _)| ethtool_relevant(k)).collect())
}

/// Read one port's counters now.
pub fn read(sysfs: &Path, dev: &str, port: u8, netdev: Option<&str>, tool: &Ethtool) -> PortCounters {
    let base = sysfs.join("class/infiniband").join(dev).join("ports").join(port.to_string());
    let mut pc = PortCounters {
        dev: dev.to_string(),
        port,
        netdev: netdev.map(str::to_string),
        counters: read_dir_numbers(&base.join("counters")),
        hw: read_dir_numbers(&base.join("hw_counters")),
        ..Default::default()
    };
    match netdev {
        None => pc.eth_note = Some("no netdev (InfiniBand port): no ethtool statistics".into()),
        Some(nd) => match ethtool_stats(tool, nd) {
            Ok(m) => pc.eth = m,
            Err(e) => pc.eth_note = Some(e),
        },
    }
    pc
}

/// Increases between two snapshots of one port over `secs` seconds.
#[derive(Debug, Clone, Default)]
pub struct Delta {
    /// `mlx5_0`.
    pub dev: String,
    /// Port.
    pub port: u8,
    /// Netdev, if any.
    pub netdev: Option<String>,
    /// Seconds between the snapshots; `None` for totals since the driver
    /// loaded (doctor's one-shot view: the "increase" is the value).
    pub secs: Option<f64>,
    /// Non-zero increases, by source and name.
    pub inc: BTreeMap<(Source, String), u64>,
}

impl Delta {
    /// Totals of one snapshot, as `rustnet doctor` shows them.
    pub fn totals(pc: &PortCounters) -> Delta {
        Delta {
            dev: pc.dev.clone(),
            port: pc.port,
            netdev: pc.netdev.clone(),
            secs: None,
            inc: pc.iter().filter(|(_, _, v)| *v > 0).map(|(s, k, v)| ((s, k.to_string()), v)).collect(),
        }
    }

    /// What rose from `a` to `b`. A counter that went down (driver reload,
    /// reset, 32-bit wrap) counts as rising from 0 to its new value.
    pub fn between(a: &PortCounters, b: &PortCounters, secs: f64) -> Delta {
        let mut inc = BTreeMap::new();
        for (s, k, v) in b.iter() {
            let old = match s {
                Source::Port => a.counters.get(k),
                Source::Hw => a.hw.get(k),
                Source::Ethtool => a.eth.get(k),
            };
            let d = match old {
                Some(&o) if v >= o => v - o,
                Some(_) => v,
                None => 0, // appeared meanwhile: no baseline
            };
            if d > 0 {
                inc.insert((s, k.to_string()), d);
            }
        }
        Delta { dev: b.dev.clone(), port: b.port, netdev: b.netdev.clone(), secs: Some(secs.max(1e-3)), inc }
    }

    /// Increase of `name` from any source (0 when absent).
    pub fn get(&self, name: &str) -> u64 {
        self.inc.iter().filter(|((_, k), _)| k == name).map(|(_, v)| *v).sum()
    }

    /// `+1200/s` (or `+1200` for totals).
    pub fn show(&self, v: u64) -> String {
        match self.secs {
            Some(s) => {
                let r = v as f64 / s;
                if r >= 100.0 || r == r.trunc() {
                    format!("+{r:.0}/s")
                } else {
                    format!("+{r:.1}/s")
                }
            }
            None => v.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ethtool_text_parses_and_filters() {
        let t = "NIC statistics:\n     rx_packets: 10\n     rx_prio3_pause: 7\n     tx_prio3_pause_duration: 9\n     \
                 rx_discards_phy: 2\n     tx_pause_storm_warning_events: 1\n     garbage line\n     rx_bytes: x\n";
        let m = parse_ethtool_s(t);
        assert_eq!(m.get("rx_packets"), Some(&10));
        assert_eq!(m.get("rx_prio3_pause"), Some(&7));
        assert!(!m.contains_key("rx_bytes"));
        let kept: Vec<&String> = m.keys().filter(|k| ethtool_relevant(k)).collect();
        assert_eq!(kept, ["rx_discards_phy", "rx_prio3_pause", "tx_pause_storm_warning_events", "tx_prio3_pause_duration"]);
    }

    #[test]
    fn delta_handles_reset_and_new_counters() {
        let mut a = PortCounters { dev: "mlx5_0".into(), port: 1, ..Default::default() };
        a.hw.insert("np_cnp_sent".into(), 100);
        a.hw.insert("out_of_sequence".into(), 50);
        let mut b = a.clone();
        b.hw.insert("np_cnp_sent".into(), 1300);
        b.hw.insert("out_of_sequence".into(), 5); // reset: counts as 5 new
        b.hw.insert("new_one".into(), 9); // no baseline: ignored
        let d = Delta::between(&a, &b, 2.0);
        assert_eq!(d.get("np_cnp_sent"), 1200);
        assert_eq!(d.get("out_of_sequence"), 5);
        assert_eq!(d.get("new_one"), 0);
        assert_eq!(d.show(1200), "+600/s");
        assert_eq!(d.show(3), "+1.5/s");
        let t = Delta::totals(&b);
        assert_eq!(t.get("new_one"), 9);
        assert_eq!(t.show(9), "9");
    }

    #[test]
    fn skip_reason_is_reported() {
        let e = ethtool_stats(&Ethtool::Skip("no ethtool".into()), "eth0").unwrap_err();
        assert_eq!(e, "no ethtool");
        let e = ethtool_stats(&Ethtool::Run("/nonexistent/ethtool".into()), "eth0").unwrap_err();
        assert!(e.contains("cannot run /nonexistent/ethtool"), "{e}");
    }
}
