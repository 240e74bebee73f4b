//! Which IP interfaces the TCP transport and the verbs out-of-band exchange
//! use, chosen the way NCCL chooses them (`NCCL_SOCKET_IFNAME`,
//! `NCCL_SOCKET_FAMILY`). Shared by both transports, so it imports neither.
use std::net::{IpAddr, SocketAddr, SocketAddrV6};

use crate::config::{Config, Family, NameList};
use crate::error::{Error, Result};
use crate::transport::sock::{self as sys, IfAddr};

/// Most interfaces we use (NCCL's MAX_IFS).
pub const MAX_IFS: usize = 16;

/// One usable interface.
#[derive(Debug, Clone)]
pub struct NetIf {
    /// Interface name.
    pub name: String,
    /// The address we bind to (port 0).
    pub addr: SocketAddr,
}

fn family_ok(fam: Family, ip: &IpAddr) -> bool {
    match fam {
        Family::Any => true,
        Family::V4 => ip.is_ipv4(),
        Family::V6 => ip.is_ipv6(),
    }
}

fn is_v6_link_local(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80)
}

/// Reduce the kernel's address list to one address per running interface,
/// in kernel order: IPv4 first when the family is open, global IPv6 before
/// link-local, IPv6 loopback never.
pub fn candidates(all: &[IfAddr], fam: Family) -> Vec<NetIf> {
    let mut names: Vec<&str> = Vec::new();
    for a in all {
        if !names.contains(&a.name.as_str()) {
            names.push(&a.name);
        }
    }
    let mut out = Vec::new();
    for n in names {
        let addrs: Vec<&IfAddr> = all
            .iter()
            .filter(|a| a.name == n && a.running && family_ok(fam, &a.addr))
            .filter(|a| !(a.addr.is_ipv6() && a.addr.is_loopback()))
            .collect();
        let rank = |a: &IfAddr| match a.addr {
            IpAddr::V4(_) => 0,
            ref ip if !is_v6_link_local(ip) => 1,
            _ => 2,
        };
        if let Some(best) = addrs.iter().min_by_key(|a| rank(a)) {
            let addr = match best.addr {
                IpAddr::V6(v6) if is_v6_link_local(&best.addr) => SocketAddr::V6(SocketAddrV6::new(v6, 0, 0, sys::if_index(n))),
                ip => SocketAddr::new(ip, 0),
            };
            out.push(NetIf { name: n.to_string(), addr });
        }
    }
    out
}

/// NCCL's selection: an explicit `NCCL_SOCKET_IFNAME` list ("find or fail"),
/// else the first non-empty class of ib*, anything but docker*/lo/virbr*,
/// docker*, lo, virbr*.
pub fn select(cands: &[NetIf], filter: &NameList) -> Result<Vec<NetIf>> {
    let pick = |f: &dyn Fn(&str) -> bool| -> Vec<NetIf> { cands.iter().filter(|c| f(&c.name)).take(MAX_IFS).cloned().collect() };
    if !filter.is_empty() {
        let got = pick(&|n| filter.accepts(n, None));
        if got.is_empty() {
            let seen: Vec<String> = cands.iter().map(|c| format!("{} ({})", c.name, c.addr.ip())).collect();
            return Err(Error::Usage(format!(
                "NCCL_SOCKET_IFNAME={} matches no running interface; interfaces with an address here: {}",
                show_list(filter),
                if seen.is_empty() { "none".to_string() } else { seen.join(", ") }
            )));
        }
        return Ok(got);
    }
    let other = |n: &str| !(n.starts_with("docker") || n.starts_with("lo") || n.starts_with("virbr") || n.starts_with("ib"));
    let classes: [&dyn Fn(&str) -> bool; 5] =
        [&|n| n.starts_with("ib"), &other, &|n| n.starts_with("docker"), &|n| n.starts_with("lo"), &|n| n.starts_with("virbr")];
    for class in classes {
        let got = pick(class);
        if !got.is_empty() {
            return Ok(got);
        }
    }
    Err(Error::Usage("no running IP interface found for the TCP transport".into()))
}

fn show_list(l: &NameList) -> String {
    let mut s = String::new();
    if l.exclude {
        s.push('^');
    }
    if l.exact {
        s.push('=');
    }
    s + &l.entries.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(",")
}

/// The interfaces to use, from the live system.
pub fn discover(cfg: &Config) -> Result<Vec<NetIf>> {
    let all = sys::interfaces()?;
    select(&candidates(&all, cfg.socket_family), &cfg.socket_ifname)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KnobValue;

    fn ifa(name: &str, ip: &str, running: bool) -> IfAddr {
        let addr: IpAddr = ip.parse().unwrap();
        IfAddr { name: name.into(), addr, running, loopback: addr.is_loopback() }
    }

    fn sample() -> Vec<IfAddr> {
        vec![
            ifa("lo", "127.0.0.1", true),
            ifa("docker0", "172.17.0.1", true),
            ifa("eth0", "192.0.2.2", true),
            ifa("eth1", "198.51.100.1", false),
            ifa("lo", "::1", true),
            ifa("eth0", "fe80::1", true),
            ifa("eth0", "fd00::2", true),
            ifa("v6only", "fe80::9", true),
            ifa("v6only", "2001:db8::9", true),
        ]
    }

    fn names(v: &[NetIf]) -> Vec<&str> {
        v.iter().map(|n| n.name.as_str()).collect()
    }

    #[test]
    fn auto_order_skips_docker_lo_and_down_interfaces() {
        let c = candidates(&sample(), Family::Any);
        let got = select(&c, &NameList::default()).unwrap();
        assert_eq!(names(&got), ["eth0", "v6only"]);
        assert_eq!(got[0].addr.ip().to_string(), "192.0.2.2");
        assert_eq!(got[1].addr.ip().to_string(), "2001:db8::9");
    }

    #[test]
    fn ib_interfaces_come_first_and_alone() {
        let mut s = sample();
        s.push(ifa("ib0", "10.0.0.1", true));
        let got = select(&candidates(&s, Family::Any), &NameList::default()).unwrap();
        assert_eq!(names(&got), ["ib0"]);
    }

    #[test]
    fn fallbacks_docker_then_lo() {
        let s = vec![ifa("lo", "127.0.0.1", true), ifa("docker0", "172.17.0.1", true)];
        assert_eq!(names(&select(&candidates(&s, Family::Any), &NameList::default()).unwrap()), ["docker0"]);
        let s = vec![ifa("lo", "127.0.0.1", true)];
        assert_eq!(names(&select(&candidates(&s, Family::Any), &NameList::default()).unwrap()), ["lo"]);
    }

    #[test]
    fn family_filter() {
        let c = candidates(&sample(), Family::V6);
        let got = select(&c, &NameList::default()).unwrap();
        assert_eq!(got[0].addr.ip().to_string(), "fd00::2");
        // IPv6 loopback is never used
        let lo = select(&c, &NameList::parse_knob("lo").unwrap());
        assert!(lo.is_err());
    }

    #[test]
    fn explicit_list_finds_or_fails_with_what_exists() {
        let c = candidates(&sample(), Family::Any);
        assert_eq!(names(&select(&c, &NameList::parse_knob("lo").unwrap()).unwrap()), ["lo"]);
        assert_eq!(names(&select(&c, &NameList::parse_knob("^eth,v6").unwrap()).unwrap()), ["lo", "docker0"]);
        let e = select(&c, &NameList::parse_knob("enp").unwrap()).unwrap_err().to_string();
        assert!(e.contains("NCCL_SOCKET_IFNAME=enp") && e.contains("eth0 (192.0.2.2)"), "{e}");
    }
}
