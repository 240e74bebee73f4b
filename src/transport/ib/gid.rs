//! Which GID a RoCE connection uses: NCCL's auto-selection (prefer the
//! address family of `NCCL_IB_ADDR_FAMILY`, then RoCE version
//! `NCCL_IB_ROCE_VERSION_NUM`), or `NCCL_IB_GID_INDEX` when set. Read fresh
//! from sysfs for every connection (addresses come and go). Entries whose
//! sysfs attributes fail with EINVAL (unpopulated slots, GIDs not mapped
//! into a container) are skipped, never fatal.
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use crate::config::Family;
use crate::error::{Errno, Error, Result};

/// A GID table we can read (sysfs in production, a map in tests).
pub trait GidTable {
    /// Entries in the table.
    fn len(&self) -> u32;
    /// True for an empty table.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// GID `i`; `None` when the slot cannot be read (EINVAL).
    fn gid(&self, i: u32) -> Result<Option<[u8; 16]>>;
    /// RoCE version of entry `i` (1 or 2); `None` when unknown (EINVAL).
    fn roce_version(&self, i: u32) -> Result<Option<u8>>;
}

/// Is `g` an IPv4-mapped GID (`::ffff:a.b.c.d`, or the multicast form)?
pub fn is_v4(g: &[u8; 16]) -> bool {
    let mapped = g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    let mcast = g[0] == 0xff && g[1] == 0x0e && g[2..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    mapped || mcast
}

fn family_of(g: &[u8; 16]) -> Family {
    if is_v4(g) {
        Family::V4
    } else {
        Family::V6
    }
}

/// Configured and not link-local.
pub fn is_valid(g: &[u8; 16]) -> bool {
    let zero = g.iter().all(|&b| b == 0);
    let link_local = g[0] == 0xfe && g[1] == 0x80 && g[2..8].iter().all(|&b| b == 0);
    !zero && !link_local
}

/// NCCL's RoCE choice: start at entry 0 and move to a candidate of the
/// wanted family when the current one is of the other family, or to one of
/// the wanted RoCE version when versions differ (or the current one is not
/// valid). Stops as soon as nothing can beat the current choice.
pub fn select_roce(t: &dyn GidTable, family: Family, version: u8) -> Result<u32> {
    let want = if family == Family::V6 { Family::V6 } else { Family::V4 };
    let mut best = 0u32;
    let mut best_gid = t.gid(0)?.unwrap_or([0; 16]);
    let mut best_ver = if is_valid(&best_gid) { t.roce_version(0)? } else { None };
    for cand in 1..t.len() {
        if family_of(&best_gid) == want && is_valid(&best_gid) && best_ver == Some(version) {
            break;
        }
        let Some(g) = t.gid(cand)? else { continue };
        if family_of(&g) != family_of(&best_gid) && family_of(&g) == want {
            best = cand;
            best_gid = g;
            best_ver = if is_valid(&g) { t.roce_version(cand)? } else { None };
            continue;
        }
        if family_of(&g) != want || !is_valid(&g) {
            continue;
        }
        let v = t.roce_version(cand)?;
        if (v != best_ver || !is_valid(&best_gid)) && v == Some(version) {
            best = cand;
            best_gid = g;
            best_ver = v;
        }
    }
    Ok(best)
}

/// `/sys/class/infiniband/<dev>/ports/<port>/`.
pub struct SysfsGids {
    base: PathBuf,
    len: u32,
}

impl SysfsGids {
    /// The table of `dev`:`port` under `sysfs` (normally `/sys`), `len` entries.
    pub fn new(sysfs: &Path, dev: &str, port: u8, len: u32) -> SysfsGids {
        SysfsGids { base: sysfs.join("class/infiniband").join(dev).join("ports").join(port.to_string()), len }
    }

    fn read(&self, rel: &str) -> Result<Option<String>> {
        let p = self.base.join(rel);
        match std::fs::read_to_string(&p) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            Err(e) if e.kind() == ErrorKind::NotFound && rel.starts_with("gids/") => Ok(None),
            Err(e) => Err(Error::sys(format!("reading {}", p.display()), Errno::from(e))),
        }
    }
}

/// Parse sysfs GID text (`fe80:0000:...:3456`).
pub fn parse_gid(s: &str) -> Option<[u8; 16]> {
    let mut g = [0u8; 16];
    let parts: Vec<&str> = s.trim().split(':').collect();
    if parts.len() != 8 {
        return None;
    }
    for (i, p) in parts.iter().enumerate() {
        let v = u16::from_str_radix(p, 16).ok()?;
        g[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(g)
}

/// Parse a sysfs RoCE type (`RoCE v2`, `IB/RoCE v1`).
pub fn parse_roce_type(s: &str) -> Option<u8> {
    let s = s.trim();
    if s.ends_with("v2") {
        Some(2)
    } else if s.ends_with("v1") {
        Some(1)
    } else {
        None
    }
}

impl GidTable for SysfsGids {
    fn len(&self) -> u32 {
        self.len
    }
    fn gid(&self, i: u32) -> Result<Option<[u8; 16]>> {
        Ok(self.read(&format!("gids/{i}"))?.and_then(|s| parse_gid(&s)))
    }
    fn roce_version(&self, i: u32) -> Result<Option<u8>> {
        Ok(self.read(&format!("gid_attrs/types/{i}"))?.and_then(|s| parse_roce_type(&s)))
    }
}

/// Text form of a GID (IPv4-mapped ones as `::ffff:a.b.c.d`).
pub fn show(g: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*g).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Fake {
        gids: Vec<Option<[u8; 16]>>,
        types: HashMap<u32, u8>,
        reads: std::cell::Cell<u32>,
    }

    impl GidTable for Fake {
        fn len(&self) -> u32 {
            self.gids.len() as u32
        }
        fn gid(&self, i: u32) -> Result<Option<[u8; 16]>> {
            self.reads.set(self.reads.get() + 1);
            Ok(self.gids[i as usize])
        }
        fn roce_version(&self, i: u32) -> Result<Option<u8>> {
            Ok(self.types.get(&i).copied())
        }
    }

    fn g(s: &str) -> [u8; 16] {
        s.parse::<std::net::Ipv6Addr>().unwrap().octets()
    }

    #[test]
    fn connectx_table_picks_ipv4_roce_v2() {
        let t = Fake {
            gids: vec![Some(g("fe80::1")), Some(g("fe80::1")), Some(g("::ffff:10.0.0.1")), Some(g("::ffff:10.0.0.1")), Some([0; 16])],
            types: HashMap::from([(0, 1), (1, 2), (2, 1), (3, 2)]),
            reads: Default::default(),
        };
        assert_eq!(select_roce(&t, Family::V4, 2).unwrap(), 3);
        assert_eq!(select_roce(&t, Family::V4, 1).unwrap(), 2);
    }

    #[test]
    fn rxe_table_stops_early_and_skips_unreadable() {
        let mut gids = vec![Some(g("fe80::5054:ff:fe12:3456")), None, Some(g("::ffff:10.199.0.1"))];
        gids.extend(std::iter::repeat_n(Some([0u8; 16]), 1021));
        let t = Fake { gids, types: HashMap::from([(0, 2), (2, 2)]), reads: Default::default() };
        assert_eq!(select_roce(&t, Family::V4, 2).unwrap(), 2);
        assert!(t.reads.get() < 10, "read {} entries", t.reads.get());
    }

    #[test]
    fn ipv6_preference_and_fallback_to_zero() {
        let t = Fake {
            gids: vec![Some(g("fe80::1")), Some(g("::ffff:10.0.0.1")), Some(g("fd00::1"))],
            types: HashMap::from([(0, 2), (1, 2), (2, 2)]),
            reads: Default::default(),
        };
        assert_eq!(select_roce(&t, Family::V6, 2).unwrap(), 2);
        let t = Fake { gids: vec![Some(g("fe80::1")), Some([0; 16])], types: HashMap::from([(0, 2)]), reads: Default::default() };
        assert_eq!(select_roce(&t, Family::V4, 2).unwrap(), 0);
    }

    #[test]
    fn parsing() {
        assert_eq!(parse_gid("0000:0000:0000:0000:0000:ffff:0ac7:0001\n").unwrap(), g("::ffff:10.199.0.1"));
        assert!(parse_gid("zz").is_none());
        assert_eq!(parse_roce_type("RoCE v2\n"), Some(2));
        assert_eq!(parse_roce_type("IB/RoCE v1"), Some(1));
        assert!(is_v4(&g("::ffff:1.2.3.4")) && !is_v4(&g("fe80::1")));
        assert!(!is_valid(&g("fe80::1")) && is_valid(&g("::ffff:1.2.3.4")) && !is_valid(&[0; 16]));
        assert_eq!(show(&g("::ffff:10.199.0.1")), "::ffff:10.199.0.1");
    }

    #[test]
    fn sysfs_fixture_with_einval_free_layout() {
        let dir = std::env::temp_dir().join(format!("rustnet-gid-{}", std::process::id()));
        let base = dir.join("class/infiniband/rxe0/ports/1");
        std::fs::create_dir_all(base.join("gids")).unwrap();
        std::fs::create_dir_all(base.join("gid_attrs/types")).unwrap();
        std::fs::write(base.join("gids/0"), "fe80:0000:0000:0000:5054:00ff:fe12:3456\n").unwrap();
        std::fs::write(base.join("gids/1"), "0000:0000:0000:0000:0000:ffff:0ac7:0001\n").unwrap();
        std::fs::write(base.join("gid_attrs/types/0"), "RoCE v2\n").unwrap();
        std::fs::write(base.join("gid_attrs/types/1"), "RoCE v2\n").unwrap();
        let t = SysfsGids::new(&dir, "rxe0", 1, 1024);
        assert_eq!(select_roce(&t, Family::V4, 2).unwrap(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
