//! Memory registration (NCCL's net_ib reg.cc): one cache per device,
//! keyed on the exact page-aligned range (and access rights covering the
//! request), reference counted, so NCCL registering the same buffer for
//! many comms pins it once. Remote
//! write access only where a peer writes (receive buffers).
//!
//! Three kinds of memory go through it: host memory and CUDA memory by
//! virtual address (`ibv_reg_mr`; CUDA needs a peer-memory client), and
//! dma-buf registrations (`ibv_reg_dmabuf_mr`, iova = the buffer's address).
//! A dma-buf entry is keyed by its address range too, never by its fd (NCCL
//! closes the fd right after regMrDmaBuf, and the number is reused): it is
//! reused only for a dma-buf registration of the exact same range, never for
//! a VA registration or a different range.
//!
//! The cache lock is taken on regMr/deregMr only, never on the data path.
use std::sync::Arc;

use parking_lot::Mutex;

use super::verbs::{Access, Mr, Pd};
use crate::error::{Error, Result};

const PAGE: usize = 4096;

struct Entry {
    start: usize,
    end: usize,
    /// Registered through a dma-buf (else by virtual address).
    dmabuf: bool,
    mr: Arc<Mr>,
    refs: usize,
}

/// A device's registrations.
pub struct MrCache {
    pd: Pd,
    entries: Mutex<Vec<Entry>>,
}

/// A registration NCCL holds (through its memory handle); releasing it
/// drops one reference on the cached MR.
pub struct IbMr {
    cache: Arc<MrCache>,
    mr: Option<Arc<Mr>>,
    /// Device index the registration belongs to.
    pub dev: usize,
}

impl std::fmt::Debug for IbMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.mr {
            Some(m) => write!(f, "IbMr(dev {}, {:p}+{}, lkey {:#x})", self.dev, m.addr(), m.len(), m.lkey()),
            None => write!(f, "IbMr(dev {}, empty)", self.dev),
        }
    }
}

/// Page-aligned `[start, end)` around `[addr, addr+len)`.
pub fn page_range(addr: usize, len: usize) -> (usize, usize) {
    let start = addr & !(PAGE - 1);
    let end = (addr + len).div_ceil(PAGE) * PAGE;
    (start, end.max(start + PAGE))
}

impl MrCache {
    /// An empty cache on `pd`.
    pub fn new(pd: Pd) -> MrCache {
        MrCache { pd, entries: Mutex::new(Vec::new()) }
    }

    /// Register (or reuse a registration covering) `[ptr, ptr+len)` with at
    /// least `access`.
    ///
    /// # Safety
    /// The range must stay mapped until the returned handle is dropped
    /// (NCCL's regMr contract: the buffer outlives deregMr).
    pub unsafe fn register(self: &Arc<Self>, dev: usize, ptr: *mut u8, len: usize, access: Access) -> Result<IbMr> {
        if len == 0 {
            return Ok(IbMr { cache: self.clone(), mr: None, dev });
        }
        if ptr.is_null() {
            return Err(Error::InvalidArg(format!("regMr of {len} bytes at NULL")));
        }
        let (start, end) = page_range(ptr as usize, len);
        let mut g = self.entries.lock();
        // Exact page range only (as NCCL's cache): reusing a larger live
        // registration for a sub-range is unsound, because the rest of its
        // range may have been unmapped and mapped again (glibc trims and
        // regrows the heap) since it was registered, so the NIC would reach
        // the old pages: seen as corrupted receives over rxe.
        if let Some(e) = g.iter_mut().find(|e| !e.dmabuf && e.start == start && end == e.end && e.mr.access().covers(access)) {
            e.refs += 1;
            return Ok(IbMr { cache: self.clone(), mr: Some(e.mr.clone()), dev });
        }
        // SAFETY: the caller keeps [ptr, ptr+len) mapped while registered; the
        // page-rounded range around it lies in the same mappings (pages are
        // the unit of mapping).
        let mr = Arc::new(unsafe { self.pd.reg_mr(start as *mut u8, end - start, access)? });
        g.push(Entry { start, end, dmabuf: false, mr: mr.clone(), refs: 1 });
        Ok(IbMr { cache: self.clone(), mr: Some(mr), dev })
    }

    /// Register (or reuse the dma-buf registration of the exact same range)
    /// `[ptr, ptr+len)` backed by the dma-buf `fd` from `offset`, as net_ib
    /// does: the page-rounded range, iova = its start, `offset` as given (NCCL's
    /// fd covers the page-rounded range and it passes offset 0). `fd` may be
    /// closed as soon as this returns.
    ///
    /// # Safety
    /// The memory behind the dma-buf must stay allocated until the returned
    /// handle is dropped (NCCL's contract: the buffer outlives deregMr).
    pub unsafe fn register_dmabuf(
        self: &Arc<Self>,
        dev: usize,
        ptr: *mut u8,
        len: usize,
        fd: i32,
        offset: u64,
        access: Access,
    ) -> Result<IbMr> {
        if len == 0 {
            return Ok(IbMr { cache: self.clone(), mr: None, dev });
        }
        if ptr.is_null() {
            return Err(Error::InvalidArg(format!("regMrDmaBuf of {len} bytes at NULL (fd {fd})")));
        }
        if fd < 0 {
            return Err(Error::InvalidArg(format!("regMrDmaBuf({ptr:p}, {len} bytes): fd {fd} is not a dma-buf file descriptor")));
        }
        let (start, end) = page_range(ptr as usize, len);
        let mut g = self.entries.lock();
        if let Some(e) = g.iter_mut().find(|e| e.dmabuf && e.start == start && end == e.end && e.mr.access().covers(access)) {
            e.refs += 1;
            return Ok(IbMr { cache: self.clone(), mr: Some(e.mr.clone()), dev });
        }
        // SAFETY: the memory behind the dma-buf stays allocated until the handle
        // is dropped (this fn's contract), which outlives the MR; the kernel takes
        // its own reference on the dma-buf, so closing fd later is fine.
        let mr = Arc::new(unsafe { self.pd.reg_dmabuf_mr(offset, end - start, start as u64, fd, access)? });
        g.push(Entry { start, end, dmabuf: true, mr: mr.clone(), refs: 1 });
        Ok(IbMr { cache: self.clone(), mr: Some(mr), dev })
    }

    fn release(&self, mr: &Arc<Mr>) {
        let mut g = self.entries.lock();
        if let Some(i) = g.iter().position(|e| Arc::ptr_eq(&e.mr, mr)) {
            g[i].refs -= 1;
            if g[i].refs == 0 {
                g.swap_remove(i);
            }
        }
    }

    /// The rkey of a registration covering `[ptr, ptr+len)` with `access`.
    pub fn find_rkey(&self, ptr: *const u8, len: usize, access: Access) -> Option<u32> {
        let g = self.entries.lock();
        g.iter().find(|e| e.mr.covers(ptr, len.max(1)) && e.mr.access().covers(access)).map(|e| e.mr.rkey())
    }

    /// Live registrations (for tests and logs).
    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl IbMr {
    /// Local key (0 for an empty registration).
    pub fn lkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, |m| m.lkey())
    }

    /// Remote key (0 for an empty registration).
    pub fn rkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, |m| m.rkey())
    }

    /// Does it cover `[p, p+len)` (anything covers an empty range)?
    pub fn covers(&self, p: *const u8, len: usize) -> bool {
        len == 0 || self.mr.as_ref().is_some_and(|m| m.covers(p, len))
    }

    /// Its access rights.
    pub fn access(&self) -> Access {
        self.mr.as_ref().map_or(Access(u32::MAX), |m| m.access())
    }
}

impl Drop for IbMr {
    fn drop(&mut self) {
        if let Some(m) = self.mr.take() {
            self.cache.release(&m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_ranges() {
        assert_eq!(page_range(0x1000, 1), (0x1000, 0x2000));
        assert_eq!(page_range(0x1fff, 2), (0x1000, 0x3000));
        assert_eq!(page_range(0x1000, 0x1000), (0x1000, 0x2000));
        assert_eq!(page_range(0x1234, 0), (0x1000, 0x2000));
    }
}
