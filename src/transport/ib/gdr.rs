//! GPUDirect RDMA on one verbs device (NCCL's net_ib `gdr` part): what the
//! system offers ([`crate::gpu`]: peer memory, CUDA driver) plus what this
//! device answers to the dma-buf probe, turned into `ptrSupport`, the flush
//! setting, and one INFO line per device with the reason.
//!
//! The probe runs once per device, on the PD discovery already opened (never
//! a second open). Decisions are kept per device name for the life of the
//! process, so `rustnet doctor` (and later `IbNet`s in tests) show the same
//! answer without probing again, and the INFO line appears once per device.
use std::path::Path;

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::verbs::Pd;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::gpu::{self, DmabufProbe, GdrDecision};
use crate::transport::{MemKind, PTR_CUDA, PTR_DMABUF};

/// GPUDirect facts and decision of one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gdr {
    /// Device name (`mlx5_0`, `rxe0`).
    pub dev: String,
    /// The dma-buf probe's answer on this device.
    pub probe: DmabufProbe,
    /// What we report and why.
    pub decision: GdrDecision,
    /// RUSTNET_FORCE_FLUSH=1 (and flushes not disabled): `forceFlush` is
    /// reported and iflush reads even host memory.
    pub forced: bool,
}

impl Gdr {
    /// Does `iflush` post the loopback read on this device? When GPUDirect
    /// is on and flushes are enabled (NCCL_GDR_FLUSH_DISABLE=0), or forced.
    pub fn flush(&self) -> bool {
        self.decision.flush || self.forced
    }

    /// May NCCL register `kind` memory by address (regMr) here? The error
    /// names the reason from the decision.
    pub fn check_reg(&self, kind: MemKind, ptr: *const u8, len: usize) -> Result<()> {
        match kind {
            MemKind::Host => Ok(()),
            MemKind::Cuda if self.decision.ptr_support & PTR_CUDA != 0 => Ok(()),
            MemKind::Cuda => Err(Error::Usage(format!(
                "regMr of CUDA memory ({ptr:p}, {len} bytes) on {}: ptrSupport lacks NCCL_PTR_CUDA ({})",
                self.dev, self.decision.reason
            ))),
        }
    }

    /// May NCCL register a dma-buf here? The error names the reason.
    pub fn check_dmabuf(&self, ptr: *const u8, len: usize, fd: i32) -> Result<()> {
        if self.decision.ptr_support & PTR_DMABUF != 0 {
            return Ok(());
        }
        Err(Error::Usage(format!(
            "regMrDmaBuf({ptr:p}, {len} bytes, fd {fd}) on {}: ptrSupport lacks NCCL_PTR_DMABUF ({})",
            self.dev, self.decision.reason
        )))
    }

    /// One line for logs and `rustnet doctor`.
    pub fn describe(&self) -> String {
        let probe = match &self.probe {
            DmabufProbe::NoSymbol => "no ibv_reg_dmabuf_mr".to_string(),
            DmabufProbe::Refused(e) => format!("refused with {}", gpu::errno_name(*e)),
            DmabufProbe::Supported => "accepted".to_string(),
        };
        format!(
            "{}: ptrSupport={} flush={}{} (dma-buf probe: {probe}); {}",
            self.dev,
            ptr_names(self.decision.ptr_support),
            if self.flush() { "on" } else { "off" },
            if self.forced { " (forced)" } else { "" },
            self.decision.reason
        )
    }
}

/// `HOST|CUDA|DMABUF`.
pub fn ptr_names(bits: i32) -> String {
    let mut v = Vec::new();
    for (b, n) in [(crate::transport::PTR_HOST, "HOST"), (PTR_CUDA, "CUDA"), (PTR_DMABUF, "DMABUF")] {
        if bits & b != 0 {
            v.push(n);
        }
    }
    v.join("|")
}

static DECISIONS: Lazy<Mutex<Vec<Gdr>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// Unload: forget the per-device decisions.
pub(crate) fn release() {
    if let Some(m) = Lazy::get(&DECISIONS) {
        drop(std::mem::take(&mut *m.lock()));
    }
}

/// Decide for device `dev` whose PD is `pd`: probe dma-buf (first time for
/// this device and these knobs only), read peer memory under `/sys` and the
/// CUDA driver, log the outcome at INFO the first time.
pub fn decide(cfg: &Config, dev: &str, pd: &Pd) -> Gdr {
    decide_with(cfg, dev, || pd.probe_dmabuf(), Path::new("/sys"), gpu::cuda::info())
}

/// [`decide`] with every input given (tests).
pub fn decide_with(cfg: &Config, dev: &str, probe: impl FnOnce() -> DmabufProbe, sysfs: &Path, cuda: &gpu::cuda::CudaInfo) -> Gdr {
    let forced = cfg.force_flush.get() == 1 && cfg.gdr_flush_disable.get() == 0;
    let mut g = DECISIONS.lock();
    // The probe's answer is a property of the device; reuse it. The decision
    // is remade (knobs may differ between IbNets in one test process).
    let known = g.iter().position(|x| x.dev == dev);
    let probe = known.map(|i| g[i].probe.clone()).unwrap_or_else(probe);
    let decision = gpu::decide(cfg, &gpu::detect_peermem(sysfs), &probe, cuda);
    let out = Gdr { dev: dev.to_string(), probe, decision, forced };
    match known {
        Some(i) if g[i] == out => {}
        Some(i) => {
            tracing::info!("GPUDirect {}", out.describe());
            g[i] = out.clone();
        }
        None => {
            tracing::info!("GPUDirect {}", out.describe());
            g.push(out.clone());
        }
    }
    out
}

/// GPUDirect on an iWARP device: host memory only (ptrSupport HOST, no
/// flush, not forced). The notice data path (`notice_path.rs`) is verified
/// on host buffers; GPU memory over iWARP would need peer memory on the
/// iWARP NIC and a flush without the loopback QP, which iWARP cannot bring
/// up by hand. Recorded for `rustnet doctor` like any decision.
pub fn host_only(g: &mut Gdr) {
    g.decision = GdrDecision {
        ptr_support: crate::transport::PTR_HOST,
        flush: false,
        reason: "iWARP device: host memory only (GPUDirect and flush are not supported on the notice data path)".into(),
    };
    g.forced = false;
    let mut d = DECISIONS.lock();
    if let Some(x) = d.iter_mut().find(|x| x.dev == g.dev) {
        *x = g.clone();
    }
}

/// Every device's latest decision in this process (for `rustnet doctor`).
pub fn decisions() -> Vec<Gdr> {
    DECISIONS.lock().clone()
}

/// Does `iflush` on a receive comm of a device with decision `gdr` post the
/// flush read, `forced` being RUSTNET_FORCE_FLUSH? (`IbNet` hands each
/// device's comms a `ConnCfg` whose `flush` is this.)
pub fn flush_needed(gdr: &Gdr, forced: bool) -> bool {
    forced || gdr.flush()
}

// The CUDA driver's cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
// ..._TO_OWNER) is the alternative on a GPU host (NCCL uses it for its GDRCopy
// flush path, and only when the driver reports
// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS): it needs the
// right CUDA context current on the proxy thread, which a network plugin does
// not own. The RDMA READ through the loopback QP works from any thread and is
// what net_ib does, so that is the path here.

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::cuda::CudaInfo;
    use crate::transport::PTR_HOST;

    fn cfg(pairs: &[(&str, &str)]) -> Config {
        let m: std::collections::HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(&|k| m.get(k).cloned()).unwrap()
    }

    fn sysfs(peermem: bool, tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("rustnet-ibgdr-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        if peermem {
            let f = d.join("module/nvidia_peermem/version");
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(f, "535.0\n").unwrap();
        }
        d
    }

    const GPU: CudaInfo = CudaInfo { driver: Ok(12080), devices: 1, dmabuf_supported: true, gdr_supported: true };

    #[test]
    fn probe_runs_once_per_device_and_decisions_follow_the_fixture() {
        let on = sysfs(true, "on");
        let off = sysfs(false, "off");
        let mut calls = 0;
        let g = decide_with(
            &cfg(&[]),
            "fake_dmabuf0",
            || {
                calls += 1;
                DmabufProbe::Supported
            },
            &off,
            &GPU,
        );
        assert_eq!(g.decision.ptr_support, PTR_HOST | PTR_DMABUF);
        assert!(g.flush() && !g.forced);
        assert!(g.check_dmabuf(std::ptr::null(), 1, 3).is_ok());
        let e = g.check_reg(MemKind::Cuda, std::ptr::null(), 1).unwrap_err().to_string();
        assert!(e.contains("NCCL_PTR_CUDA") && e.contains("nvidia-peermem"), "{e}");
        // second IbNet in the process: no second probe, peermem now loaded
        let g = decide_with(
            &cfg(&[]),
            "fake_dmabuf0",
            || {
                calls += 1;
                DmabufProbe::Refused(libc::EOPNOTSUPP)
            },
            &on,
            &GPU,
        );
        assert_eq!(calls, 1);
        assert_eq!(g.decision.ptr_support, PTR_HOST | PTR_CUDA | PTR_DMABUF);
        assert!(g.check_reg(MemKind::Cuda, std::ptr::null(), 1).is_ok());
        assert!(decisions().iter().any(|d| d.dev == "fake_dmabuf0" && d.describe().contains("ptrSupport=HOST|CUDA|DMABUF")));
    }

    #[test]
    fn refused_probe_and_no_peermem_is_host_only_with_both_reasons() {
        let off = sysfs(false, "refused");
        let g = decide_with(&cfg(&[]), "fake_rxe0", || DmabufProbe::Refused(libc::EOPNOTSUPP), &off, &GPU);
        assert_eq!(g.decision.ptr_support, PTR_HOST);
        assert!(!g.flush());
        let d = g.describe();
        assert!(d.contains("ptrSupport=HOST ") && d.contains("GDR off") && d.contains("nvidia-peermem") && d.contains("errno 95"), "{d}");
        let e = g.check_dmabuf(std::ptr::null(), 4096, 7).unwrap_err().to_string();
        assert!(e.contains("NCCL_PTR_DMABUF") && e.contains("errno 95") && e.contains("fd 7"), "{e}");
        assert!(g.check_reg(MemKind::Host, std::ptr::null(), 1).is_ok());
    }

    #[test]
    fn no_cuda_driver_says_so_and_force_flush_still_flushes() {
        let on = sysfs(true, "nocuda");
        let none = CudaInfo {
            driver: Err("no CUDA driver (libcuda.so.1 not found)".into()),
            devices: 0,
            dmabuf_supported: false,
            gdr_supported: false,
        };
        let g = decide_with(&cfg(&[("RUSTNET_FORCE_FLUSH", "1")]), "fake_nocuda0", || DmabufProbe::Supported, &on, &none);
        assert_eq!(g.decision.ptr_support, PTR_HOST);
        assert_eq!(g.decision.reason, "GDR off: no CUDA driver (libcuda.so.1 not found)");
        assert!(g.forced && g.flush() && !g.decision.flush);
        let g = decide_with(
            &cfg(&[("RUSTNET_FORCE_FLUSH", "1"), ("NCCL_GDR_FLUSH_DISABLE", "1")]),
            "fake_nocuda0",
            || unreachable!(),
            &on,
            &none,
        );
        assert!(!g.flush());
    }

    #[test]
    fn gdr_on_with_flush_disabled_does_not_flush() {
        let on = sysfs(true, "flushoff");
        let g = decide_with(&cfg(&[("NCCL_GDR_FLUSH_DISABLE", "1")]), "fake_mlx0", || DmabufProbe::NoSymbol, &on, &GPU);
        assert_eq!(g.decision.ptr_support, PTR_HOST | PTR_CUDA);
        assert!(g.decision.reason.contains("rdma-core < 34"), "{}", g.decision.reason);
        assert!(!g.flush());
    }
}
