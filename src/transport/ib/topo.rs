//! PCI and NUMA topology of RDMA devices and GPUs, read from sysfs (a
//! fixture tree in tests). One place for what the verbs transport reports
//! to NCCL (`pciPath`), where it puts a device's helper thread and control
//! memory (the NIC's NUMA node), and what `rustnet doctor` explains
//! (nearest NIC per GPU).
//!
//! - `pciPath` is the realpath of `/sys/class/infiniband/<dev>/device`, as
//!   NCCL's topology code wants it: it takes the last component as the PCI
//!   bus id and walks the path up to place the NIC under its switches and
//!   CPU. Devices not on a PCI bus (rxe, siw) report NULL: NCCL then attaches
//!   them to the first CPU.
//! - NUMA: `numa_node` of the PCI device (-1 or absent: unknown). The
//!   device's async-event thread runs on that node's CPUs (`cpulist`,
//!   intersected with the CPUs this process may use), and its comms'
//!   control memory (CTS FIFO, sizes area, CQ and QP rings) is allocated
//!   while the connecting thread prefers that node ([`NumaScope`],
//!   `set_mempolicy(MPOL_PREFERRED)`): pages faulted in then, which is when
//!   `ibv_reg_mr` pins them, come from the NIC's node. Pages the allocator
//!   recycles keep the node they already have (documented best effort).
use std::path::Path;

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// PCI path of RDMA device `dev` (realpath of its `device` link), or None
/// when it is not a PCI device (rxe and other virtual devices).
pub fn pci_path(sysfs: &Path, dev: &str) -> Option<String> {
    let p = std::fs::canonicalize(sysfs.join("class/infiniband").join(dev).join("device")).ok()?;
    let s = p.to_string_lossy().into_owned();
    let last = p.file_name()?.to_string_lossy().into_owned();
    (s.contains("/pci") && is_bus_id(&last)).then_some(s)
}

/// The pciPath NCCL's net_ib reports for `raw` (a realpath ending in a bus
/// id): the function digit set to 0, so the ports and functions of one
/// adapter are one PCI device to NCCL's topology, and with `merge_vfs` the
/// device digits too, so virtual functions sit where their physical function
/// is (NCCL_IB_MERGE_VFS=1, NCCL's default). Other paths are returned as they are.
pub fn nccl_pci_path(raw: &str, merge_vfs: bool) -> String {
    let last = raw.rsplit('/').next().unwrap_or("");
    if !is_bus_id(last) {
        return raw.to_string();
    }
    let mut b = raw.as_bytes().to_vec();
    let n = b.len();
    b[n - 1] = b'0';
    if merge_vfs {
        b[n - 3] = b'0';
        b[n - 4] = b'0';
    }
    String::from_utf8(b).unwrap_or_else(|_| raw.to_string())
}

/// `0000:3b:00.1`: domain:bus:device.function.
pub fn is_bus_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars().enumerate().all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// The PCI path with the function digit set to 0: the ports and PCI
/// functions of one adapter share it (NCCL's net_ib merges NICs on it).
pub fn nic_key(pci: &str) -> String {
    nccl_pci_path(pci, false)
}

/// NUMA node of a PCI device directory (None: unknown, -1 or absent).
pub fn numa_of_pci(pci: &Path) -> Option<i32> {
    read(&pci.join("numa_node")).and_then(|s| s.parse().ok()).filter(|&n: &i32| n >= 0)
}

/// NUMA node of RDMA device `dev` (None for virtual devices and unknown nodes).
pub fn numa_node(sysfs: &Path, dev: &str) -> Option<i32> {
    numa_of_pci(Path::new(&pci_path(sysfs, dev)?))
}

/// Parse a kernel cpulist (`0-3,8,10-11`).
pub fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if b < a || b - a > 65536 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.trim().parse().ok()?),
        }
    }
    Some(out)
}

/// CPUs of NUMA node `node`.
pub fn node_cpus(sysfs: &Path, node: i32) -> Option<Vec<usize>> {
    parse_cpulist(&read(&sysfs.join(format!("devices/system/node/node{node}/cpulist")))?)
}

/// Pin the calling thread to `cpus` (those of them this process may use).
/// Returns the CPUs it now runs on, or why not.
pub fn bind_current_thread(cpus: &[usize]) -> Result<Vec<usize>, String> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut allowed: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer of the right size; 0 = this thread.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut allowed) } != 0 {
        return Err(format!("sched_getaffinity: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let mut used = Vec::new();
    for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: c < CPU_SETSIZE.
        if unsafe { libc::CPU_ISSET(c, &allowed) } {
            // SAFETY: c < CPU_SETSIZE, so the bit is inside `set`.
            unsafe { libc::CPU_SET(c, &mut set) };
            used.push(c);
        }
    }
    if used.is_empty() {
        return Err(format!("none of CPUs {cpus:?} is allowed for this process"));
    }
    // SAFETY: a valid set of the right size; 0 = this thread.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(format!("sched_setaffinity: {}", std::io::Error::last_os_error()));
    }
    Ok(used)
}

/// Pin the calling thread to NUMA node `node`'s CPUs; logs what happened.
pub fn bind_current_thread_to_node(sysfs: &Path, node: Option<i32>, who: &str) {
    let Some(node) = node else { return };
    let Some(cpus) = node_cpus(sysfs, node) else {
        tracing::debug!("{who}: NUMA node {node} has no readable cpulist; not pinned");
        return;
    };
    match bind_current_thread(&cpus) {
        Ok(used) => tracing::debug!("{who}: pinned to NUMA node {node} (CPUs {})", show_cpus(&used)),
        Err(e) => tracing::debug!("{who}: not pinned to NUMA node {node}: {e}"),
    }
}

fn show_cpus(c: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let mut j = i;
        while j + 1 < c.len() && c[j + 1] == c[j] + 1 {
            j += 1;
        }
        out.push(if i == j { c[i].to_string() } else { format!("{}-{}", c[i], c[j]) });
        i = j + 1;
    }
    out.join(",")
}

const MPOL_DEFAULT: libc::c_int = 0;
const MPOL_PREFERRED: libc::c_int = 1;

/// While alive, the calling thread's new pages prefer NUMA node `node`
/// (`set_mempolicy(MPOL_PREFERRED)`); dropping it restores the default
/// policy. No-op for an unknown node.
pub struct NumaScope {
    active: bool,
}

impl NumaScope {
    /// Prefer `node` (None: do nothing).
    pub fn enter(node: Option<i32>) -> NumaScope {
        let Some(node) = node.filter(|&n| (0..1024).contains(&n)) else { return NumaScope { active: false } };
        let mut mask = [0u64; 16];
        mask[node as usize / 64] |= 1 << (node % 64);
        // SAFETY: set_mempolicy reads `maxnode` bits of `mask`, which holds 1024.
        let r = unsafe { libc::syscall(libc::SYS_set_mempolicy, MPOL_PREFERRED, mask.as_ptr(), 1024usize) };
        NumaScope { active: r == 0 }
    }
}

impl Drop for NumaScope {
    fn drop(&mut self) {
        if self.active {
            // SAFETY: MPOL_DEFAULT takes no node mask.
            unsafe { libc::syscall(libc::SYS_set_mempolicy, MPOL_DEFAULT, std::ptr::null::<u64>(), 0usize) };
        }
    }
}

/// Path components two PCI paths share (the depth of their deepest common ancestor).
pub fn pci_common(a: &str, b: &str) -> usize {
    a.split('/').zip(b.split('/')).take_while(|(x, y)| x == y).count()
}

/// Nearest NIC to `gpu_pci` among `nics` (name, pci): the deepest common PCI
/// ancestor wins, ties go to the earlier NIC (device order).
pub fn nearest_nic(gpu_pci: &str, nics: &[(String, String)]) -> Option<String> {
    let mut best: Option<(&String, usize)> = None;
    for (n, p) in nics {
        let d = pci_common(gpu_pci, p);
        if best.is_none_or(|(_, b)| d > b) {
            best = Some((n, d));
        }
    }
    best.map(|(n, _)| n.clone())
}

/// GPUs (NVIDIA display/3D controllers) on the PCI bus: (realpath, NUMA node).
pub fn gpus(sysfs: &Path) -> Vec<(String, Option<i32>)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(sysfs.join("bus/pci/devices")) else { return out };
    for e in rd.flatten() {
        let p = e.path();
        let class = read(&p.join("class")).unwrap_or_default();
        let vendor = read(&p.join("vendor")).unwrap_or_default();
        if vendor == "0x10de" && (class.starts_with("0x0302") || class.starts_with("0x0300")) {
            let real = std::fs::canonicalize(&p).unwrap_or(p.clone()).to_string_lossy().into_owned();
            out.push((real, numa_of_pci(&p)));
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reported_pci_path_zeroes_function_and_vf_digits_as_nccl() {
        let p = "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:01.3";
        assert_eq!(nccl_pci_path(p, true), "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0");
        assert_eq!(nccl_pci_path(p, false), "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:01.0");
        assert_eq!(nccl_pci_path("/sys/devices/pci0000:00/0000:00:03.1", false), "/sys/devices/pci0000:00/0000:00:03.0");
        assert_eq!(nccl_pci_path("/sys/devices/virtual/net/x", true), "/sys/devices/virtual/net/x");
    }

    #[test]
    fn cpulists_and_bus_ids() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n").unwrap(), [0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist("").unwrap(), Vec::<usize>::new());
        assert!(parse_cpulist("3-1").is_none() && parse_cpulist("x").is_none());
        assert_eq!(show_cpus(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert!(is_bus_id("0000:3b:00.1") && !is_bus_id("rxe0") && !is_bus_id("0000:3b:00"));
        assert_eq!(nic_key("/sys/devices/pci0000:00/0000:00:01.0/0000:3b:00.1"), "/sys/devices/pci0000:00/0000:00:01.0/0000:3b:00.0");
    }

    #[test]
    fn numa_scope_is_harmless_without_a_node() {
        drop(NumaScope::enter(None));
        // node 0 exists everywhere; the policy is restored on drop
        let s = NumaScope::enter(Some(0));
        let v = vec![1u8; 1 << 16];
        drop(s);
        assert_eq!(v.iter().map(|&b| b as usize).sum::<usize>(), 1 << 16);
    }
}
