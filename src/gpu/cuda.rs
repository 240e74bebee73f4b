//! The CUDA driver, loaded at run time through cudarc (no NEEDED entry on
//! libcuda). Without a driver everything here answers "no GPU" once, with the
//! reason; it never panics (cudarc's loader would, so presence is checked first).

/// What the CUDA driver says about this host.
#[derive(Debug, Clone)]
pub struct CudaInfo {
    /// Driver version (e.g. 12080), or why there is none.
    pub driver: Result<i32, String>,
    /// Visible devices.
    pub devices: i32,
    /// Every visible device supports dma-buf export.
    pub dmabuf_supported: bool,
    /// Every visible device supports GPUDirect RDMA.
    pub gdr_supported: bool,
}

impl CudaInfo {
    /// Why GPU memory cannot be used at all, if so.
    pub fn unusable_reason(&self) -> Option<String> {
        match &self.driver {
            Err(e) => Some(e.clone()),
            Ok(_) if self.devices == 0 => Some("the CUDA driver sees no GPU".into()),
            Ok(_) if !self.gdr_supported => Some("a GPU reports no GPUDirect RDMA support".into()),
            Ok(_) => None,
        }
    }
}

static INFO: crate::unload::Global<CudaInfo> = crate::unload::Global::new();

/// Unload: forget the probe.
///
/// # Safety
/// As [`crate::unload::Global::clear`].
pub(crate) unsafe fn release() {
    // SAFETY: our caller guarantees Global::clear's contract (no reference from get/get_or_init is alive or used again).
    unsafe { INFO.clear() };
}

/// Probe once per process.
pub fn info() -> &'static CudaInfo {
    INFO.get_or_init(|| {
        std::panic::catch_unwind(probe).unwrap_or_else(|_| CudaInfo {
            driver: Err("the CUDA driver could not be queried (loader panicked)".into()),
            devices: 0,
            dmabuf_supported: false,
            gdr_supported: false,
        })
    })
}

fn probe() -> CudaInfo {
    use cudarc::driver::sys;
    let none = |why: String| CudaInfo { driver: Err(why), devices: 0, dmabuf_supported: false, gdr_supported: false };
    // SAFETY: only tries to dlopen libcuda; no state is shared.
    if !unsafe { sys::is_culib_present() } {
        return none("no CUDA driver (libcuda.so.1 not found)".into());
    }
    // SAFETY: the driver library is present; these calls take plain out-pointers.
    unsafe {
        if sys::cuInit(0) != sys::CUresult::CUDA_SUCCESS {
            return none("cuInit failed (driver present but unusable)".into());
        }
        let mut ver = 0;
        let _ = sys::cuDriverGetVersion(&mut ver);
        let mut n = 0;
        if sys::cuDeviceGetCount(&mut n) != sys::CUresult::CUDA_SUCCESS {
            n = 0;
        }
        let (mut dmabuf, mut gdr) = (n > 0, n > 0);
        for i in 0..n {
            let mut dev = 0;
            if sys::cuDeviceGet(&mut dev, i) != sys::CUresult::CUDA_SUCCESS {
                continue;
            }
            let mut v = 0;
            let _ = sys::cuDeviceGetAttribute(&mut v, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev);
            dmabuf &= v != 0;
            let mut g = 0;
            let _ = sys::cuDeviceGetAttribute(&mut g, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, dev);
            gdr &= g != 0;
        }
        CudaInfo { driver: Ok(ver), devices: n, dmabuf_supported: dmabuf, gdr_supported: gdr }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_never_panics_and_explains_absence() {
        let i = super::info();
        if let Err(e) = &i.driver {
            assert!(!e.is_empty());
            assert!(i.unusable_reason().is_some());
            eprintln!("no GPU here: {e}");
        }
    }
}
