//! GPU memory for the verbs transport (NCCL's `gdr` part): is GPUDirect RDMA
//! usable here, through peer memory (nvidia-peermem) or dma-buf, and why not.
//! Every decision is logged once at INFO with its reason, so "GPUDirect
//! silently off" cannot happen.
pub mod cuda;

use std::path::Path;

/// Unload: forget the CUDA probe.
///
/// # Safety
/// As [`crate::unload::Global::clear`].
pub(crate) unsafe fn release() {
    // SAFETY: our caller guarantees Global::clear's contract for the CUDA
    // probe (no reference into it is alive or used again), cuda::release's.
    unsafe { cuda::release() };
}

use crate::config::{Config, GdrChoice};
use crate::transport::{PTR_CUDA, PTR_DMABUF, PTR_HOST};

/// Is a GPU peer-memory client loaded (what `ibv_reg_mr` on CUDA pointers needs)?
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerMem {
    /// Found, with the sysfs file that proves it.
    Loaded(String),
    /// Not found: every place NCCL looks was checked.
    Absent,
}

/// The files NCCL checks for a peer-memory client, relative to sysfs.
pub const PEERMEM_FILES: [&str; 3] =
    ["kernel/mm/memory_peers/nv_mem/version", "kernel/mm/memory_peers/nv_mem_nc/version", "module/nvidia_peermem/version"];

/// Look for nvidia-peermem / nv_peer_mem under `sysfs` (normally `/sys`).
pub fn detect_peermem(sysfs: &Path) -> PeerMem {
    for f in PEERMEM_FILES {
        let p = sysfs.join(f);
        if p.exists() {
            return PeerMem::Loaded(format!("/sys/{f}"));
        }
    }
    PeerMem::Absent
}

/// Outcome of the dma-buf registration probe on one device
/// (`ibv_reg_dmabuf_mr(pd, 0, 0, 0, fd=-1, 0)`: EBADF means "supported").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DmabufProbe {
    /// The library lacks `ibv_reg_dmabuf_mr` (rdma-core older than v34).
    NoSymbol,
    /// The device refused with this errno (EOPNOTSUPP, EPROTONOSUPPORT...).
    Refused(i32),
    /// The device accepts dma-buf registrations.
    Supported,
}

/// `EOPNOTSUPP (errno 95)`: the symbolic name for the errnos the dma-buf
/// probe and registration give, else the system's text.
pub fn errno_name(e: i32) -> String {
    let name = match e {
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EPROTONOSUPPORT => "EPROTONOSUPPORT",
        libc::EBADF => "EBADF",
        libc::EINVAL => "EINVAL",
        libc::EPERM => "EPERM",
        libc::ENOMEM => "ENOMEM",
        libc::EFAULT => "EFAULT",
        _ => return crate::error::Errno(e).to_string(),
    };
    format!("{name} (errno {e})")
}

/// What we offer NCCL for one device, and the reasons.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GdrDecision {
    /// NCCL_PTR_* bits.
    pub ptr_support: i32,
    /// Flush after GPUDirect receives is possible and enabled.
    pub flush: bool,
    /// One line for the log and for `rustnet doctor`.
    pub reason: String,
}

/// Decide `ptrSupport` for a verbs device from what the system shows.
pub fn decide(cfg: &Config, peermem: &PeerMem, dmabuf: &DmabufProbe, cuda: &cuda::CudaInfo) -> GdrDecision {
    let mut bits = PTR_HOST;
    let mut why = Vec::new();
    if cfg.gdr == GdrChoice::Off {
        return GdrDecision { ptr_support: bits, flush: false, reason: "GDR off: RUSTNET_GDR=off".into() };
    }
    if let Some(no) = cuda.unusable_reason() {
        return GdrDecision { ptr_support: bits, flush: false, reason: format!("GDR off: {no}") };
    }
    match peermem {
        PeerMem::Loaded(f) => {
            bits |= PTR_CUDA;
            why.push(format!("peer memory on ({f})"));
        }
        PeerMem::Absent => why.push("no nvidia-peermem (modprobe nvidia-peermem)".into()),
    }
    match (dmabuf, cfg.dmabuf_enable.get(), cuda.dmabuf_supported) {
        (_, 0, _) => why.push("dma-buf off: NCCL_DMABUF_ENABLE=0".into()),
        (DmabufProbe::NoSymbol, _, _) => why.push("dma-buf off: libibverbs lacks ibv_reg_dmabuf_mr (rdma-core < 34)".into()),
        (DmabufProbe::Refused(e), _, _) => why.push(format!("dma-buf off: registration probe returned {}", errno_name(*e))),
        (DmabufProbe::Supported, _, false) => why.push("dma-buf off: the CUDA driver reports no dma-buf support".into()),
        (DmabufProbe::Supported, _, true) => {
            bits |= PTR_DMABUF;
            why.push("dma-buf on".into());
        }
    }
    let on = bits & (PTR_CUDA | PTR_DMABUF) != 0;
    let flush = on && cfg.gdr_flush_disable.get() == 0;
    let head = if on { "GDR on" } else { "GDR off" };
    GdrDecision { ptr_support: bits, flush, reason: format!("{head}: {}", why.join("; ")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Config {
        let m: std::collections::HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(&|k| m.get(k).cloned()).unwrap()
    }

    fn gpu(dmabuf: bool) -> cuda::CudaInfo {
        cuda::CudaInfo { driver: Ok(12080), devices: 1, dmabuf_supported: dmabuf, gdr_supported: true }
    }

    fn fixture(files: &[&str]) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("rustnet-gdr-{}-{}", std::process::id(), files.join("_").replace('/', "-")));
        let _ = std::fs::remove_dir_all(&d);
        for f in files {
            let p = d.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, "1.0\n").unwrap();
        }
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn peermem_found_in_each_place_nccl_looks() {
        for f in PEERMEM_FILES {
            let d = fixture(&[f]);
            assert_eq!(detect_peermem(&d), PeerMem::Loaded(format!("/sys/{f}")));
        }
        assert_eq!(detect_peermem(&fixture(&[])), PeerMem::Absent);
    }

    #[test]
    fn reasons_name_the_cause() {
        let c = cfg(&[]);
        let d = decide(&c, &PeerMem::Absent, &DmabufProbe::Refused(libc::EOPNOTSUPP), &gpu(true));
        assert_eq!(d.ptr_support, PTR_HOST);
        assert!(d.reason.starts_with("GDR off") && d.reason.contains("nvidia-peermem") && d.reason.contains("errno 95"), "{}", d.reason);
        let d = decide(&c, &PeerMem::Loaded("/sys/module/nvidia_peermem/version".into()), &DmabufProbe::Supported, &gpu(true));
        assert_eq!(d.ptr_support, PTR_HOST | PTR_CUDA | PTR_DMABUF);
        assert!(d.flush);
        let d = decide(&c, &PeerMem::Absent, &DmabufProbe::Supported, &gpu(false));
        assert!(d.reason.contains("CUDA driver reports no dma-buf"), "{}", d.reason);
        let d = decide(&cfg(&[("NCCL_DMABUF_ENABLE", "0")]), &PeerMem::Absent, &DmabufProbe::Supported, &gpu(true));
        assert_eq!(d.ptr_support, PTR_HOST);
        assert!(d.reason.contains("NCCL_DMABUF_ENABLE=0"));
        let d = decide(&cfg(&[("NCCL_GDR_FLUSH_DISABLE", "1")]), &PeerMem::Absent, &DmabufProbe::Supported, &gpu(true));
        assert!(!d.flush && d.ptr_support & PTR_DMABUF != 0);
        let d = decide(&cfg(&[("RUSTNET_GDR", "off")]), &PeerMem::Absent, &DmabufProbe::Supported, &gpu(true));
        assert_eq!((d.ptr_support, d.reason.as_str()), (PTR_HOST, "GDR off: RUSTNET_GDR=off"));
    }

    /// Peer memory present or absent (a sysfs tree written here) x dma-buf
    /// probe accepted or refused: the four outcomes and their reasons.
    #[test]
    fn fixture_trees_times_probe_outcomes() {
        let present = fixture(&["module/nvidia_peermem/version", "probe-table"]); // a name no other test uses (they run in parallel)
        let absent = fixture(&["module/other/version"]);
        let refused = DmabufProbe::Refused(libc::EOPNOTSUPP);
        let table = [
            (&present, &DmabufProbe::Supported, PTR_HOST | PTR_CUDA | PTR_DMABUF, "GDR on: peer memory on (/sys/module/nvidia_peermem/version); dma-buf on"),
            (&present, &refused, PTR_HOST | PTR_CUDA, "GDR on: peer memory on (/sys/module/nvidia_peermem/version); dma-buf off: registration probe returned EOPNOTSUPP (errno 95)"),
            (&absent, &DmabufProbe::Supported, PTR_HOST | PTR_DMABUF, "GDR on: no nvidia-peermem (modprobe nvidia-peermem); dma-buf on"),
            (&absent, &refused, PTR_HOST, "GDR off: no nvidia-peermem (modprobe nvidia-peermem); dma-buf off: registration probe returned EOPNOTSUPP (errno 95)"),
        ];
        for (tree, probe, bits, reason) in table {
            let d = decide(&cfg(&[]), &detect_peermem(tree), probe, &gpu(true));
            assert_eq!((d.ptr_support, d.reason.as_str()), (bits, reason));
            assert_eq!(d.flush, bits != PTR_HOST);
        }
        let d = decide(&cfg(&[]), &detect_peermem(&absent), &DmabufProbe::Refused(libc::EPROTONOSUPPORT), &gpu(true));
        assert!(d.reason.ends_with("EPROTONOSUPPORT (errno 93)"), "{}", d.reason);
    }

    #[test]
    fn no_gpu_means_host_only_with_reason() {
        let none = cuda::CudaInfo {
            driver: Err("no CUDA driver (libcuda.so.1 not found)".into()),
            devices: 0,
            dmabuf_supported: false,
            gdr_supported: false,
        };
        let d = decide(&cfg(&[]), &PeerMem::Loaded("x".into()), &DmabufProbe::Supported, &none);
        assert_eq!(d.ptr_support, PTR_HOST);
        assert!(d.reason.contains("libcuda.so.1 not found"), "{}", d.reason);
    }
}
