//! Which GID a RoCE connection uses, and why.
//!
//! Starts from NCCL's auto-selection (prefer `NCCL_IB_ADDR_FAMILY`, IPv4 by
//! default, and RoCE version `NCCL_IB_ROCE_VERSION_NUM`, 2 by default; skip
//! unset and link-local entries; only GIDs inside `NCCL_IB_ADDR_RANGE` when
//! set; `NCCL_IB_GID_INDEX` forces an index), and fixes what hurts users:
//!
//! - chosen per connection from a fresh read (addresses come and go, GID
//!   indices move on live nodes): the next connection uses the new table;
//! - entries whose sysfs files fail with EINVAL (empty slots, GIDs not mapped
//!   into a container) are skipped, never fatal;
//! - the table is read cheaply: up to the length from the port attributes
//!   (and never past 255, the most an address handle can name), all-zero
//!   GIDs are skipped before their type is read, and the scan stops at the
//!   first entry nothing later could beat;
//! - GIDs whose netdev (`gid_attrs/ndevs/N`) is up and visible in this
//!   process's network namespace (`/sys/class/net/<netdev>`) win over the
//!   others (the macvlan / SR-IOV container case);
//! - with nothing of the wanted family or version, the best other one is
//!   used and the reason says so (NCCL would fall back to entry 0, often
//!   link-local); a forced index that is empty or unreadable is an error
//!   naming the index and listing the usable ones.
//!
//! The choice carries a one-line reason ("rxe0:1 GID 1 ::ffff:10.199.0.1
//! RoCE v2 on veth0: IPv4 v2 preferred; skipped 1 link-local"), logged at
//! INFO once per device (again only when the choice changes) and kept in a
//! per-port record ([`last_choice`]); `rustnet doctor` runs the same
//! [`choose`] over sysfs. The IO is behind [`GidTable`], so the rules are
//! tested over fixture trees and injected failures.
use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::config::{AddrRange, Family};
use crate::error::{Errno, Error, Result};

/// State of a GID's netdev as seen from this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetdevState {
    /// Visible here and up (operstate `up`, or `unknown` as virtual links report).
    Up,
    /// Visible here, but its operstate is this (`down`, `lowerlayerdown`, ...).
    Down(String),
    /// Not in this process's network namespace.
    Invisible,
    /// The entry names no netdev we could read.
    Unknown,
}

/// A GID table we can read (sysfs in production, a map in tests).
pub trait GidTable {
    /// Entries in the table (the port attributes' `gid_tbl_len`).
    fn len(&self) -> u32;
    /// True for an empty table.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// GID `i`; `None` when the slot cannot be read (EINVAL).
    fn gid(&self, i: u32) -> Result<Option<[u8; 16]>>;
    /// RoCE version of entry `i` (1 or 2); `None` when unknown (EINVAL).
    fn roce_version(&self, i: u32) -> Result<Option<u8>>;
    /// Netdev of entry `i`; `None` when unknown (EINVAL).
    fn ndev(&self, _i: u32) -> Result<Option<String>> {
        Ok(None)
    }
    /// Is netdev `name` up and visible in this network namespace?
    fn netdev_state(&self, _name: &str) -> NetdevState {
        NetdevState::Unknown
    }
}

/// Is `g` an IPv4-mapped GID (`::ffff:a.b.c.d`, or the multicast form)?
pub fn is_v4(g: &[u8; 16]) -> bool {
    let mapped = g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    let mcast = g[0] == 0xff && g[1] == 0x0e && g[2..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    mapped || mcast
}

/// Address family of a GID: V4 for IPv4-mapped ones, else V6.
pub fn family_of(g: &[u8; 16]) -> Family {
    if is_v4(g) {
        Family::V4
    } else {
        Family::V6
    }
}

/// The family as it travels in the connection metadata: 4 or 6.
pub fn family_code(g: &[u8; 16]) -> u8 {
    if is_v4(g) {
        4
    } else {
        6
    }
}

fn is_zero(g: &[u8; 16]) -> bool {
    g.iter().all(|&b| b == 0)
}

/// Link-local (`fe80::/64`).
pub fn is_link_local(g: &[u8; 16]) -> bool {
    g[0] == 0xfe && g[1] == 0x80 && g[2..8].iter().all(|&b| b == 0)
}

/// Configured and not link-local.
#[cfg(test)]
pub fn is_valid(g: &[u8; 16]) -> bool {
    !is_zero(g) && !is_link_local(g)
}

/// The IP address of a GID (IPv4-mapped ones as IPv4).
pub fn ip_of(g: &[u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(*g);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// What the selection is asked for.
#[derive(Debug, Clone, Default)]
pub struct Prefs {
    /// NCCL_IB_ADDR_FAMILY (`Any` counts as IPv4 first).
    pub family: Option<Family>,
    /// NCCL_IB_ROCE_VERSION_NUM (0 counts as 2).
    pub version: u8,
    /// NCCL_IB_ADDR_RANGE.
    pub range: AddrRange,
    /// NCCL_IB_GID_INDEX, when set (>= 0).
    pub forced: Option<u32>,
}

impl Prefs {
    fn want_family(&self) -> Family {
        match (self.range.family(), self.family) {
            (Some(f), _) => f,
            (None, Some(Family::V6)) => Family::V6,
            _ => Family::V4,
        }
    }
    fn want_version(&self) -> u8 {
        if self.version == 0 {
            2
        } else {
            self.version
        }
    }
}

/// The GID a connection uses, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidChoice {
    /// `dev:port`.
    pub label: String,
    /// Table index.
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// RoCE version (1, 2), `None` when unknown.
    pub version: Option<u8>,
    /// Netdev of the entry, when known.
    pub ndev: Option<String>,
    /// Why this one (after the colon of [`GidChoice::reason`]).
    pub why: String,
    /// Set when the choice works but is worth fixing: the fix, in one line.
    pub concern: Option<String>,
}

fn family_name(f: Family) -> &'static str {
    if f == Family::V6 {
        "IPv6"
    } else {
        "IPv4"
    }
}

fn type_text(v: Option<u8>) -> String {
    match v {
        Some(v) => format!("RoCE v{v}"),
        None => "RoCE v?".into(),
    }
}

impl GidChoice {
    /// `::ffff:10.199.0.1 RoCE v2 on veth0: IPv4 v2 preferred; skipped 1 link-local`.
    pub fn detail(&self) -> String {
        let on = self.ndev.as_ref().map(|n| format!(" on {n}")).unwrap_or_default();
        format!("{} {}{on}: {}", show(&self.gid), type_text(self.version), self.why)
    }

    /// `rxe0:1 GID 1 ::ffff:10.199.0.1 RoCE v2 on veth0: IPv4 v2 preferred; skipped 1 link-local`.
    pub fn reason(&self) -> String {
        format!("{} GID {} {}", self.label, self.index, self.detail())
    }

    /// The address family code for the connection metadata (4 or 6).
    pub fn family_code(&self) -> u8 {
        family_code(&self.gid)
    }
}

/// One non-empty entry, for "usable" lists in errors.
fn usable_list(t: &dyn GidTable, limit: u32) -> String {
    let mut v = Vec::new();
    for i in 0..limit {
        let Ok(Some(g)) = t.gid(i) else { continue };
        if is_zero(&g) {
            continue;
        }
        let ver = t.roce_version(i).ok().flatten();
        let nd = t.ndev(i).ok().flatten().map(|n| format!(" {n}")).unwrap_or_default();
        let ll = if is_link_local(&g) { " link-local" } else { "" };
        v.push(format!("{i} {} {}{nd}{ll}", show(&g), type_text(ver)));
        if v.len() == 12 {
            v.push("...".into());
            break;
        }
    }
    if v.is_empty() {
        "none (no address on the port's netdev?)".into()
    } else {
        v.join(", ")
    }
}

/// Choose the GID of `label` (`dev:port`) from `t` (RoCE ports).
pub fn choose(t: &dyn GidTable, label: &str, p: &Prefs) -> Result<GidChoice> {
    if let Some(ix) = p.forced {
        return forced(t, label, p, ix);
    }
    let want_fam = p.want_family();
    let want_ver = p.want_version();
    // An address handle's sgid_index is a u8: entries past 255 cannot be used.
    let n = t.len().min(256);
    #[derive(Default)]
    struct Skips {
        link_local: u32,
        unreadable: u32,
        out_of_range: u32,
        other_family: u32,
        other_version: u32,
        netdev: u32,
    }
    let mut sk = Skips::default();
    // (score: lower is better, index, gid, version, ndev, netdev state)
    type Cand = ((bool, bool, bool), u32, [u8; 16], Option<u8>, Option<String>, NetdevState);
    let mut best: Option<Cand> = None;
    let mut first_ll: Option<(u32, [u8; 16])> = None;
    for i in 0..n {
        let Some(g) = t.gid(i)? else {
            sk.unreadable += 1;
            continue;
        };
        if is_zero(&g) {
            continue;
        }
        if is_link_local(&g) {
            sk.link_local += 1;
            first_ll.get_or_insert((i, g));
            continue;
        }
        if !p.range.contains(ip_of(&g)) {
            sk.out_of_range += 1;
            continue;
        }
        let ver = t.roce_version(i)?;
        let ndev = t.ndev(i)?;
        let st = match &ndev {
            Some(nd) => t.netdev_state(nd),
            None => NetdevState::Unknown,
        };
        let bad_netdev = matches!(st, NetdevState::Down(_) | NetdevState::Invisible);
        let score = (bad_netdev, family_of(&g) != want_fam, ver != Some(want_ver));
        // count what loses to the final choice as we go: the reasons below
        // use the counts of entries seen before the scan stopped
        if best.as_ref().is_none_or(|b| score < b.0) {
            if let Some(b) = best.take() {
                count_loser(&mut sk.netdev, &mut sk.other_family, &mut sk.other_version, b.0);
            }
            best = Some((score, i, g, ver, ndev, st));
        } else {
            count_loser(&mut sk.netdev, &mut sk.other_family, &mut sk.other_version, score);
        }
        if score == (false, false, false) {
            break;
        }
    }
    fn count_loser(nd: &mut u32, fam: &mut u32, ver: &mut u32, s: (bool, bool, bool)) {
        if s.0 {
            *nd += 1;
        } else if s.1 {
            *fam += 1;
        } else if s.2 {
            *ver += 1;
        }
    }
    let mut skipped = vec![format!("{} link-local", sk.link_local)];
    for (n, what) in [
        (sk.unreadable, "unreadable (EINVAL)"),
        (sk.out_of_range, "out of range"),
        (sk.netdev, "on a down or foreign netdev"),
        (sk.other_family, "of the other family"),
        (sk.other_version, "of the other RoCE version"),
    ] {
        if n > 0 {
            skipped.push(format!("{n} {what}"));
        }
    }
    let skipped = skipped.join(", ");
    let Some((score, index, gid, version, ndev, st)) = best else {
        if p.range.is_set() {
            return Err(Error::Usage(format!(
                "{label}: no GID inside NCCL_IB_ADDR_RANGE={} (skipped {skipped}); usable: {}",
                p.range,
                usable_list(t, n)
            )));
        }
        if let Some((index, gid)) = first_ll {
            let version = t.roce_version(index)?;
            let ndev = t.ndev(index)?;
            return Ok(GidChoice {
                label: label.into(),
                index,
                gid,
                version,
                ndev: ndev.clone(),
                why: format!("only link-local GIDs, which do not route; skipped {skipped}"),
                concern: Some(format!(
                    "assign an IP address to {} so a routable RoCE v2 GID appears",
                    ndev.as_deref().unwrap_or("the port's netdev")
                )),
            });
        }
        return Err(Error::Usage(format!(
            "{label}: no usable GID in the {} entries read (skipped {skipped}); does the port's netdev have an IP address?",
            n
        )));
    };
    let fam = family_of(&gid);
    let mut why = format!(
        "{} {}{}",
        family_name(fam),
        version.map(|v| format!("v{v}")).unwrap_or_else(|| "v? (type unreadable)".into()),
        if p.range.is_set() { format!(" in range {}", p.range) } else { " preferred".into() }
    );
    let mut concern = None;
    if score.1 {
        why += &format!(" (no usable {} GID)", family_name(want_fam));
        concern = Some(format!(
            "add an {} address to the port's netdev, or set NCCL_IB_ADDR_FAMILY={} on every rank",
            family_name(want_fam),
            if fam == Family::V6 { "AF_INET6" } else { "AF_INET" }
        ));
    } else if score.2 {
        why += &format!(" (no RoCE v{want_ver} GID)");
        concern.get_or_insert_with(|| {
            format!("set NCCL_IB_ROCE_VERSION_NUM the same on every rank; v{want_ver} GIDs need a configured address")
        });
    }
    if score.0 {
        let nd = ndev.as_deref().unwrap_or("?");
        let what = match &st {
            NetdevState::Down(s) => format!("netdev {nd} is {s}"),
            _ => format!("netdev {nd} is not in this network namespace"),
        };
        why += &format!("; {what}, and no GID is on an up netdev visible here");
        concern = Some(format!("{what}: bring it up, or run in the namespace that owns it (macvlan/SR-IOV: pass the netdev into the pod)"));
    }
    why += &format!("; skipped {skipped}");
    Ok(GidChoice { label: label.into(), index, gid, version, ndev, why, concern })
}

fn forced(t: &dyn GidTable, label: &str, p: &Prefs, ix: u32) -> Result<GidChoice> {
    let limit = t.len().min(256);
    let bad =
        |what: String| Error::Usage(format!("NCCL_IB_GID_INDEX={ix}: GID index {ix} on {label} {what}; usable: {}", usable_list(t, limit)));
    if ix >= t.len() {
        return Err(bad(format!("is beyond the table ({} entries)", t.len())));
    }
    if ix > 255 {
        return Err(bad("does not fit an address handle (indices 0..255)".into()));
    }
    let gid = match t.gid(ix) {
        Ok(Some(g)) if !is_zero(&g) => g,
        Ok(Some(_)) => return Err(bad("is empty".into())),
        Ok(None) => return Err(bad("is unreadable (EINVAL: not mapped into this container?)".into())),
        Err(e) => return Err(bad(format!("is unreadable ({e})"))),
    };
    let version = t.roce_version(ix).ok().flatten();
    let ndev = t.ndev(ix).ok().flatten();
    let mut why = "forced by NCCL_IB_GID_INDEX".to_string();
    let mut concern = None;
    if is_link_local(&gid) {
        why += "; link-local: does not route";
        concern = Some("unset NCCL_IB_GID_INDEX (automatic choice) or pick a routable GID".to_string());
    }
    if !p.range.contains(ip_of(&gid)) {
        why += &format!("; outside NCCL_IB_ADDR_RANGE={} (the forced index wins)", p.range);
    }
    if let Some(nd) = &ndev {
        match t.netdev_state(nd) {
            NetdevState::Down(s) => {
                why += &format!("; netdev {nd} is {s}");
                concern = Some(format!("bring {nd} up or unset NCCL_IB_GID_INDEX"));
            }
            NetdevState::Invisible => {
                why += &format!("; netdev {nd} is not in this network namespace");
                concern = Some("run in the namespace that owns the netdev or unset NCCL_IB_GID_INDEX".into());
            }
            _ => {}
        }
    }
    Ok(GidChoice { label: label.into(), index: ix, gid, version, ndev, why, concern })
}

// ---------------------------------------------------------------- the per-port record

static LAST: Mutex<BTreeMap<String, GidChoice>> = Mutex::new(BTreeMap::new());

/// Unload: forget the per-port records.
pub(crate) fn release() {
    drop(std::mem::take(&mut *LAST.lock().unwrap_or_else(|p| p.into_inner())));
}

/// Keep `c` as the latest choice of its port; log it at INFO the first time
/// and whenever it changes (not once per connection).
pub fn remember(c: &GidChoice) {
    let mut m = LAST.lock().unwrap_or_else(|p| p.into_inner());
    match m.get(&c.label) {
        Some(old) if old.index == c.index && old.gid == c.gid => {}
        Some(old) => tracing::info!("GID choice changed: {} (was GID {} {})", c.reason(), old.index, show(&old.gid)),
        None => tracing::info!("GID choice: {}", c.reason()),
    }
    // the latest reason is kept even when the GID stays (a netdev went down, a range changed)
    m.insert(c.label.clone(), c.clone());
}

/// The latest choice this process made for `dev`:`port`, if any.
pub fn last_choice(dev: &str, port: u8) -> Option<GidChoice> {
    LAST.lock().unwrap_or_else(|p| p.into_inner()).get(&format!("{dev}:{port}")).cloned()
}

// ---------------------------------------------------------------- sysfs

/// `/sys/class/infiniband/<dev>/ports/<port>/` (and `/sys/class/net` for netdevs).
pub struct SysfsGids {
    base: PathBuf,
    net: PathBuf,
    len: u32,
}

impl SysfsGids {
    /// The table of `dev`:`port` under `sysfs` (normally `/sys`), `len` entries.
    pub fn new(sysfs: &Path, dev: &str, port: u8, len: u32) -> SysfsGids {
        SysfsGids { base: sysfs.join("class/infiniband").join(dev).join("ports").join(port.to_string()), net: sysfs.join("class/net"), len }
    }

    /// Number of slots sysfs lists for `dev`:`port` (for tools without the port attributes).
    pub fn sysfs_len(sysfs: &Path, dev: &str, port: u8) -> u32 {
        let dir = sysfs.join("class/infiniband").join(dev).join("ports").join(port.to_string()).join("gids");
        std::fs::read_dir(dir)
            .map(|rd| rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()).map(|i| i + 1).max().unwrap_or(0))
            .unwrap_or(0)
    }

    fn read(&self, rel: &str) -> Result<Option<String>> {
        let p = self.base.join(rel);
        match std::fs::read_to_string(&p) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            // a slot or attribute that does not exist (fixtures, older kernels without ndevs)
            Err(e) if e.kind() == ErrorKind::NotFound && (rel.starts_with("gids/") || rel.starts_with("gid_attrs/")) => Ok(None),
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
    fn ndev(&self, i: u32) -> Result<Option<String>> {
        Ok(self.read(&format!("gid_attrs/ndevs/{i}"))?.map(|s| s.trim().to_string()).filter(|s| !s.is_empty()))
    }
    fn netdev_state(&self, name: &str) -> NetdevState {
        if name.contains('/') || name.starts_with('.') {
            return NetdevState::Unknown;
        }
        let d = self.net.join(name);
        if !d.exists() {
            return NetdevState::Invisible;
        }
        match std::fs::read_to_string(d.join("operstate")).map(|s| s.trim().to_string()) {
            Ok(s) if s == "up" || s == "unknown" => NetdevState::Up,
            Ok(s) if !s.is_empty() => NetdevState::Down(s),
            _ => NetdevState::Up,
        }
    }
}

/// Text form of a GID (IPv4-mapped ones as `::ffff:a.b.c.d`).
pub fn show(g: &[u8; 16]) -> String {
    Ipv6Addr::from(*g).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::collections::{HashMap, HashSet};

    fn g(s: &str) -> [u8; 16] {
        s.parse::<Ipv6Addr>().unwrap().octets()
    }

    fn prefs() -> Prefs {
        Prefs { family: Some(Family::V4), version: 2, ..Default::default() }
    }

    fn gid_text(s: &str) -> String {
        s.parse::<Ipv6Addr>().unwrap().segments().iter().map(|x| format!("{x:04x}")).collect::<Vec<_>>().join(":")
    }

    /// A sysfs tree written by the test: `rows` are (index, gid, type, ndev);
    /// `nets` are (netdev, operstate) present under class/net; every other
    /// slot up to `slots` is written as zeros.
    struct Tree(PathBuf);
    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn tree(tag: &str, slots: u32, rows: &[(u32, &str, &str, &str)], nets: &[(&str, &str)]) -> Tree {
        let root = std::env::temp_dir().join(format!("rustnet-gid-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let base = root.join("class/infiniband/dev0/ports/1");
        for d in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        let used: HashSet<u32> = rows.iter().map(|r| r.0).collect();
        for i in (0..slots).filter(|i| !used.contains(i)) {
            std::fs::write(base.join(format!("gids/{i}")), "0000:0000:0000:0000:0000:0000:0000:0000\n").unwrap();
        }
        for (i, gid, ty, nd) in rows {
            std::fs::write(base.join(format!("gids/{i}")), format!("{}\n", gid_text(gid))).unwrap();
            std::fs::write(base.join(format!("gid_attrs/types/{i}")), format!("{ty}\n")).unwrap();
            std::fs::write(base.join(format!("gid_attrs/ndevs/{i}")), format!("{nd}\n")).unwrap();
        }
        for (n, st) in nets {
            std::fs::create_dir_all(root.join("class/net").join(n)).unwrap();
            std::fs::write(root.join("class/net").join(n).join("operstate"), format!("{st}\n")).unwrap();
        }
        Tree(root)
    }

    /// The sysfs table, with EINVAL injected for some slots (whole entry or
    /// only its type/ndev) and reads counted.
    struct Inject {
        inner: SysfsGids,
        einval_gid: HashSet<u32>,
        einval_attrs: HashSet<u32>,
        reads: Cell<u32>,
        attr_reads: Cell<u32>,
    }
    impl Inject {
        fn new(t: &Tree, len: u32) -> Inject {
            Inject {
                inner: SysfsGids::new(&t.0, "dev0", 1, len),
                einval_gid: HashSet::new(),
                einval_attrs: HashSet::new(),
                reads: Cell::new(0),
                attr_reads: Cell::new(0),
            }
        }
    }
    impl GidTable for Inject {
        fn len(&self) -> u32 {
            self.inner.len()
        }
        fn gid(&self, i: u32) -> Result<Option<[u8; 16]>> {
            self.reads.set(self.reads.get() + 1);
            if self.einval_gid.contains(&i) {
                return Ok(None);
            }
            self.inner.gid(i)
        }
        fn roce_version(&self, i: u32) -> Result<Option<u8>> {
            self.attr_reads.set(self.attr_reads.get() + 1);
            if self.einval_attrs.contains(&i) || self.einval_gid.contains(&i) {
                return Ok(None);
            }
            self.inner.roce_version(i)
        }
        fn ndev(&self, i: u32) -> Result<Option<String>> {
            self.attr_reads.set(self.attr_reads.get() + 1);
            if self.einval_attrs.contains(&i) || self.einval_gid.contains(&i) {
                return Ok(None);
            }
            self.inner.ndev(i)
        }
        fn netdev_state(&self, name: &str) -> NetdevState {
            self.inner.netdev_state(name)
        }
    }

    const V1: &str = "IB/RoCE v1";
    const V2: &str = "RoCE v2";

    #[test]
    fn connectx_table_with_v1_v2_pairs() {
        let t = tree(
            "cx",
            16,
            &[
                (0, "fe80::1", V1, "eth2"),
                (1, "fe80::1", V2, "eth2"),
                (2, "::ffff:10.0.0.1", V1, "eth2"),
                (3, "::ffff:10.0.0.1", V2, "eth2"),
            ],
            &[("eth2", "up")],
        );
        let s = Inject::new(&t, 16);
        let c = choose(&s, "mlx5_0:1", &prefs()).unwrap();
        assert_eq!(c.index, 3);
        assert_eq!(
            c.reason(),
            "mlx5_0:1 GID 3 ::ffff:10.0.0.1 RoCE v2 on eth2: IPv4 v2 preferred; skipped 2 link-local, 1 of the other RoCE version"
        );
        assert!(c.concern.is_none());
        // stops at the first entry nothing can beat
        assert_eq!(s.reads.get(), 4);
        let c = choose(&s, "mlx5_0:1", &Prefs { version: 1, ..prefs() }).unwrap();
        assert_eq!((c.index, c.version), (2, Some(1)));
    }

    #[test]
    fn einval_holes_are_skipped_and_zero_slots_cost_one_read() {
        // rxe: 1024 slots, entry 0 link-local, a hole, IPv4 at 2, zeros after
        let t = tree(
            "holes",
            1024,
            &[(0, "fe80::5054:ff:fe12:3456", V2, "veth0"), (1, "::ffff:10.1.0.1", V2, "veth0"), (2, "::ffff:10.199.0.1", V2, "veth0")],
            &[("veth0", "up")],
        );
        let mut s = Inject::new(&t, 1024);
        s.einval_gid.insert(1);
        let c = choose(&s, "rxe0:1", &prefs()).unwrap();
        assert_eq!(c.index, 2);
        assert!(c.why.contains("skipped 1 link-local, 1 unreadable (EINVAL)"), "{}", c.why);
        // an entry whose type and netdev fail with EINVAL (not mapped into this
        // container) loses to any readable one but is not fatal
        let mut s = Inject::new(&t, 1024);
        s.einval_attrs.insert(1);
        let c = choose(&s, "rxe0:1", &prefs()).unwrap();
        assert_eq!(c.index, 2, "{}", c.reason());
        // a table where nothing matches is scanned to its length, but empty
        // slots never have their attributes read
        let t6 = tree("holes6", 1024, &[(0, "fe80::1", V2, "veth0"), (5, "fd00::5", V2, "veth0")], &[("veth0", "up")]);
        let s = Inject::new(&t6, 1024);
        let c = choose(&s, "rxe0:1", &prefs()).unwrap();
        assert_eq!(c.index, 5);
        assert_eq!(s.reads.get(), 256, "stops at 255, the last index an address handle can name");
        assert_eq!(s.attr_reads.get(), 2, "attributes of the one candidate only");
        // and the table length from the port attributes bounds the scan
        let s = Inject::new(&t6, 8);
        choose(&s, "rxe0:1", &prefs()).unwrap();
        assert_eq!(s.reads.get(), 8);
    }

    #[test]
    fn several_ips_and_addr_range() {
        let t = tree(
            "ips",
            32,
            &[
                (0, "fe80::1", V2, "veth0"),
                (1, "::ffff:10.199.0.1", V2, "veth0"),
                (2, "::ffff:10.199.5.1", V2, "veth0"),
                (3, "fd99::1", V2, "veth0"),
            ],
            &[("veth0", "up")],
        );
        let s = Inject::new(&t, 32);
        assert_eq!(choose(&s, "rxe0:1", &prefs()).unwrap().index, 1, "lowest index of the preferred kind");
        let r = |c: &str| crate::config::KnobValue::parse_knob(c).unwrap();
        let c = choose(&s, "rxe0:1", &Prefs { range: r("10.199.5.0/24"), ..prefs() }).unwrap();
        assert_eq!(c.index, 2);
        assert_eq!(
            c.reason(),
            "rxe0:1 GID 2 ::ffff:10.199.5.1 RoCE v2 on veth0: IPv4 v2 in range 10.199.5.0/24; skipped 1 link-local, 1 out of range"
        );
        // an IPv6 range wins over the (default) IPv4 family
        let c = choose(&s, "rxe0:1", &Prefs { range: r("fd99::/16"), ..prefs() }).unwrap();
        assert_eq!(c.index, 3);
        assert!(c.concern.is_none(), "{:?}", c.concern);
        // NCCL_IB_ADDR_FAMILY=AF_INET6 without a range
        assert_eq!(choose(&s, "rxe0:1", &Prefs { family: Some(Family::V6), ..prefs() }).unwrap().index, 3);
        // a range nothing is in: a clear error listing what exists
        let e = choose(&s, "rxe0:1", &Prefs { range: r("192.168.0.0/16"), ..prefs() }).unwrap_err().to_string();
        assert!(
            e.contains("NCCL_IB_ADDR_RANGE=192.168.0.0/16") && e.contains("usable: ") && e.contains("1 ::ffff:10.199.0.1 RoCE v2 veth0"),
            "{e}"
        );
    }

    #[test]
    fn vlan_uppers() {
        // ConnectX with a VLAN upper: the upper's addresses come after the base's
        let t = tree(
            "vlan",
            16,
            &[
                (0, "fe80::1", V1, "eth2"),
                (1, "fe80::1", V2, "eth2"),
                (2, "::ffff:10.0.0.1", V1, "eth2"),
                (3, "::ffff:10.0.0.1", V2, "eth2"),
                (4, "fe80::1", V1, "eth2.7"),
                (5, "fe80::1", V2, "eth2.7"),
                (6, "::ffff:10.7.0.1", V1, "eth2.7"),
                (7, "::ffff:10.7.0.1", V2, "eth2.7"),
            ],
            &[("eth2", "up"), ("eth2.7", "up")],
        );
        let s = Inject::new(&t, 16);
        assert_eq!(choose(&s, "mlx5_0:1", &prefs()).unwrap().index, 3);
        let r = crate::config::KnobValue::parse_knob("10.7.0.0/16").unwrap();
        let c = choose(&s, "mlx5_0:1", &Prefs { range: r, ..prefs() }).unwrap();
        assert_eq!((c.index, c.ndev.as_deref()), (7, Some("eth2.7")));
        assert!(c.reason().contains("on eth2.7: IPv4 v2 in range 10.7.0.0/16"), "{}", c.reason());
        // the base netdev down: the VLAN upper on an up netdev wins (its
        // operstate would follow in life; here it stands for any up netdev)
        let t2 = tree(
            "vlan-down",
            16,
            &[(3, "::ffff:10.0.0.1", V2, "eth2"), (7, "::ffff:10.7.0.1", V2, "eth2.7")],
            &[("eth2", "down"), ("eth2.7", "up")],
        );
        let c = choose(&Inject::new(&t2, 16), "mlx5_0:1", &prefs()).unwrap();
        assert_eq!(c.index, 7);
        assert!(c.why.contains("1 on a down or foreign netdev"), "{}", c.why);
    }

    #[test]
    fn ipv6_only() {
        let t =
            tree("v6", 16, &[(0, "fe80::2", V2, "eth0"), (1, "fd00:1::2", V2, "eth0"), (2, "2001:db8::2", V2, "eth0")], &[("eth0", "up")]);
        let s = Inject::new(&t, 16);
        // the default IPv4 preference falls back to IPv6 (NCCL would take the
        // link-local entry 0) and says so
        let c = choose(&s, "mlx5_0:1", &prefs()).unwrap();
        assert_eq!(c.index, 1);
        assert!(c.why.starts_with("IPv6 v2 preferred (no usable IPv4 GID)"), "{}", c.why);
        assert!(c.concern.as_deref().unwrap().contains("AF_INET6"));
        assert_eq!(c.family_code(), 6);
        let c = choose(&s, "mlx5_0:1", &Prefs { family: Some(Family::V6), ..prefs() }).unwrap();
        assert_eq!(c.index, 1);
        assert!(c.concern.is_none());
    }

    #[test]
    fn container_subset_prefers_visible_netdevs() {
        // the host's table has GIDs of several netdevs; only eth1 (a macvlan or
        // VF passed into the pod) is in this namespace; the others' attributes
        // fail with EINVAL (not mapped) or name netdevs we cannot see
        let t = tree(
            "ctr",
            16,
            &[
                (0, "fe80::1", V2, "eth0"),
                (1, "::ffff:10.0.0.1", V2, "eth0"),
                (2, "::ffff:10.0.0.2", V2, "ens1f0v3"),
                (3, "::ffff:10.0.0.3", V2, "eth1"),
            ],
            &[("eth1", "up")],
        );
        let mut s = Inject::new(&t, 16);
        s.einval_attrs.insert(2);
        let c = choose(&s, "mlx5_0:1", &prefs()).unwrap();
        assert_eq!((c.index, c.ndev.as_deref()), (3, Some("eth1")), "{}", c.reason());
        assert!(c.why.contains("1 on a down or foreign netdev"), "{}", c.why);
        // nothing visible at all: still a choice, with the reason and a fix
        let t2 = tree("ctr2", 16, &[(1, "::ffff:10.0.0.1", V2, "eth0")], &[]);
        let c = choose(&Inject::new(&t2, 16), "mlx5_0:1", &prefs()).unwrap();
        assert_eq!(c.index, 1);
        assert!(c.why.contains("netdev eth0 is not in this network namespace"), "{}", c.why);
        assert!(c.concern.is_some());
    }

    #[test]
    fn netdev_down() {
        let t = tree(
            "down",
            16,
            &[(1, "::ffff:10.0.0.1", V2, "eth0"), (2, "::ffff:10.0.1.1", V2, "eth1")],
            &[("eth0", "down"), ("eth1", "up")],
        );
        let c = choose(&Inject::new(&t, 16), "mlx5_0:1", &prefs()).unwrap();
        assert_eq!(c.index, 2);
        let t = tree("down2", 16, &[(1, "::ffff:10.0.0.1", V2, "eth0")], &[("eth0", "lowerlayerdown")]);
        let c = choose(&Inject::new(&t, 16), "mlx5_0:1", &prefs()).unwrap();
        assert!(c.why.contains("netdev eth0 is lowerlayerdown"), "{}", c.why);
    }

    #[test]
    fn forced_index_is_validated() {
        let t = tree(
            "forced",
            16,
            &[(0, "fe80::1", V2, "veth0"), (1, "::ffff:10.199.0.1", V2, "veth0"), (3, "::ffff:10.199.0.9", V2, "veth0")],
            &[("veth0", "up")],
        );
        let mut s = Inject::new(&t, 16);
        s.einval_gid.insert(3);
        let c = choose(&s, "rxe0:1", &Prefs { forced: Some(1), ..prefs() }).unwrap();
        assert_eq!(c.index, 1);
        assert_eq!(c.why, "forced by NCCL_IB_GID_INDEX");
        let e = choose(&s, "rxe0:1", &Prefs { forced: Some(7), ..prefs() }).unwrap_err().to_string();
        assert!(e.contains("NCCL_IB_GID_INDEX=7: GID index 7 on rxe0:1 is empty; usable: 0 fe80::1 RoCE v2 veth0 link-local, 1 ::ffff:10.199.0.1 RoCE v2 veth0"), "{e}");
        let e = choose(&s, "rxe0:1", &Prefs { forced: Some(3), ..prefs() }).unwrap_err().to_string();
        assert!(e.contains("GID index 3") && e.contains("unreadable (EINVAL"), "{e}");
        let e = choose(&s, "rxe0:1", &Prefs { forced: Some(16), ..prefs() }).unwrap_err().to_string();
        assert!(e.contains("GID index 16") && e.contains("beyond the table"), "{e}");
        let c = choose(&s, "rxe0:1", &Prefs { forced: Some(0), ..prefs() }).unwrap();
        assert!(c.concern.is_some() && c.why.contains("link-local"));
    }

    #[test]
    fn only_link_local_or_nothing() {
        let t = tree("ll", 8, &[(0, "fe80::1", V2, "veth0")], &[("veth0", "up")]);
        let c = choose(&Inject::new(&t, 8), "rxe0:1", &prefs()).unwrap();
        assert_eq!(c.index, 0);
        assert!(c.why.starts_with("only link-local") && c.concern.as_deref().unwrap().contains("veth0"), "{}", c.why);
        let t = tree("none", 8, &[], &[]);
        let e = choose(&Inject::new(&t, 8), "rxe0:1", &prefs()).unwrap_err().to_string();
        assert!(e.contains("no usable GID"), "{e}");
    }

    #[test]
    fn a_map_table_works_too() {
        // the trait without sysfs: a GID table in memory
        struct Map(Vec<Option<[u8; 16]>>, HashMap<u32, u8>);
        impl GidTable for Map {
            fn len(&self) -> u32 {
                self.0.len() as u32
            }
            fn gid(&self, i: u32) -> Result<Option<[u8; 16]>> {
                Ok(self.0[i as usize])
            }
            fn roce_version(&self, i: u32) -> Result<Option<u8>> {
                Ok(self.1.get(&i).copied())
            }
        }
        let m = Map(vec![Some(g("fe80::1")), None, Some(g("::ffff:10.0.0.1"))], HashMap::from([(2, 2)]));
        let c = choose(&m, "x:1", &prefs()).unwrap();
        assert_eq!(c.reason(), "x:1 GID 2 ::ffff:10.0.0.1 RoCE v2: IPv4 v2 preferred; skipped 1 link-local, 1 unreadable (EINVAL)");
    }

    #[test]
    fn remembered_per_port() {
        let c = GidChoice {
            label: "unit-test-dev:1".into(),
            index: 1,
            gid: g("::ffff:10.0.0.1"),
            version: Some(2),
            ndev: None,
            why: "x".into(),
            concern: None,
        };
        remember(&c);
        assert_eq!(last_choice("unit-test-dev", 1).unwrap().index, 1);
        let c2 = GidChoice { index: 2, ..c };
        remember(&c2);
        assert_eq!(last_choice("unit-test-dev", 1).unwrap().index, 2);
        remember(&GidChoice { why: "y".into(), ..c2 });
        assert_eq!(last_choice("unit-test-dev", 1).unwrap().why, "y");
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
        assert_eq!(ip_of(&g("::ffff:10.199.0.1")), "10.199.0.1".parse::<IpAddr>().unwrap());
    }
}
