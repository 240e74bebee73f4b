//! What the TCP transport reports for each interface it uses (the choice of
//! interfaces is [`crate::transport::netif`]'s, shared with the verbs
//! out-of-band exchange).
use std::path::Path;

use crate::intern::intern;
use crate::transport::netif::NetIf;
use crate::transport::{DeviceProps, MAX_P2P_BYTES, MAX_RECVS, PTR_HOST};

/// Speed reported when sysfs has none (virtual or loopback interfaces), Mbps.
pub const DEFAULT_SPEED_MBPS: i32 = 10_000;

/// Properties of interface number `index`, reading `sysfs` (normally `/sys`).
pub fn properties(ifc: &NetIf, index: usize, sysfs: &Path) -> DeviceProps {
    let base = sysfs.join("class/net").join(&ifc.name);
    let pci_path = std::fs::canonicalize(base.join("device"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
        .filter(|p| p.contains("/pci"))
        .map(|p| intern(&p));
    let speed = std::fs::read_to_string(base.join("speed"))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .filter(|&s| s > 0 && s < i32::MAX as i64)
        .map(|s| s as i32)
        .unwrap_or(DEFAULT_SPEED_MBPS);
    DeviceProps {
        name: intern(&ifc.name),
        pci_path,
        guid: index as u64,
        ptr_support: PTR_HOST,
        reg_is_global: true,
        force_flush: false,
        speed_mbps: speed,
        port: 0,
        latency_us: 0.0,
        max_comms: 65536,
        max_recvs: MAX_RECVS as i32,
        max_p2p_bytes: MAX_P2P_BYTES,
        max_coll_bytes: 512 << 20,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_from_fixture_sysfs() {
        let dir = std::env::temp_dir().join(format!("rustnet-sysfs-{}", std::process::id()));
        let pci = dir.join("devices/pci0000:00/0000:00:03.0");
        std::fs::create_dir_all(&pci).unwrap();
        std::fs::create_dir_all(dir.join("class/net/eth0")).unwrap();
        std::fs::write(dir.join("class/net/eth0/speed"), "25000\n").unwrap();
        std::os::unix::fs::symlink(&pci, dir.join("class/net/eth0/device")).unwrap();
        let p = properties(&NetIf { name: "eth0".into(), addr: "192.0.2.2:0".parse().unwrap() }, 0, &dir);
        assert_eq!(p.speed_mbps, 25000);
        assert!(p.pci_path.unwrap().to_str().unwrap().ends_with("0000:00:03.0"));
        let p = properties(&NetIf { name: "lo".into(), addr: "127.0.0.1:0".parse().unwrap() }, 1, &dir);
        assert_eq!(p.speed_mbps, DEFAULT_SPEED_MBPS);
        assert!(p.pci_path.is_none());
        assert_eq!(p.max_recvs, 8);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
