//! Small control regions of many comms, carved from shared blocks per
//! device: a comm's CTS FIFO, sizes area, staging areas and flush scratch
//! are 64 bytes to 8 KiB each, and one page-rounded allocation and one
//! registration apiece cost ~16 KiB of pinned memory and two memory
//! registrations (kernel memory, and a VMA split each) per comm on either
//! end (docs/scale.md).
//!
//! - Regions only the local NIC touches (staging, the flush scratch, iWARP
//!   notice buffers) come from blocks registered once, with local write:
//!   a piece costs its bytes and no registration.
//! - Regions the peer writes (the sender's FIFO, the receiver's sizes area)
//!   come from unregistered blocks and get a registration of their own,
//!   exactly over their bytes: a peer's rkey reaches its comm's region and
//!   nothing beside it, as with a region of its own (docs/security.md).
//!
//! Pieces are cache-line sized and aligned (no two comms share a line),
//! zeroed when handed out, and go back to their block when the region
//! drops (after its QPs: field order of the comms); an empty block is freed
//! at once, so closing every comm leaves nothing behind. Larger regions
//! (the eager ring and its staging) get their own allocation. Only comm
//! set-up and close take the lock, never the data path.
use std::any::Any;
use std::sync::Arc;

use parking_lot::Mutex;

use super::verbs::{Access, HostRegion, Mr, Pd};
use crate::error::{Errno, Error, Result};

/// Bytes of one block.
const BLOCK: usize = 64 << 10;
/// Regions up to this size come from blocks; larger ones get their own
/// allocation and registration.
pub const MAX_PIECE: usize = 16 << 10;
/// Pieces are cache-line aligned and sized.
const ALIGN: usize = 64;

/// A device's shared blocks (one per PD: every comm on the device).
pub struct CtlSlab {
    pd: Pd,
    /// Registered blocks for pieces only the local NIC touches.
    local: Arc<Mutex<Pool>>,
    /// Unregistered blocks for pieces with a registration of their own.
    remote: Arc<Mutex<Pool>>,
}

struct Pool {
    next_id: u64,
    blocks: Vec<Block>,
}

struct Block {
    id: u64,
    mem: Arc<BlockMem>,
    /// Bytes handed out from the start so far.
    bump: usize,
    /// Pieces out.
    live: usize,
    /// Pieces returned: (offset, size).
    free: Vec<(usize, usize)>,
}

/// A block's bytes: registered as a whole (local pieces) or not (remote
/// pieces, each registered on its own).
struct BlockMem {
    ptr: *mut u8,
    /// Local key of the block's registration (local blocks).
    lkey: u32,
    // Fields drop in order: the registration before the memory.
    _mr: Option<Mr>,
    _map: Mapped,
}

// SAFETY: the block's bytes are plain memory owned by it (or its region);
// pieces are handed to one comm each and touched only through raw pointers.
unsafe impl Send for BlockMem {}
// SAFETY: &BlockMem exposes only the base address and a key; no reference
// to the bytes is ever made.
unsafe impl Sync for BlockMem {}

/// A block's zeroed pages, mapped on their own (not from the heap: a
/// block comes and goes with its comms, and heap blocks of this size left
/// the heap fragmented over thousands of connect/close cycles); unmapped,
/// back to the system, when the block goes.
struct Mapped {
    ptr: *mut u8,
    len: usize,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: mapped by Mapped::new with this length and unmapped once,
        // after every piece of it was returned and every registration over
        // it dropped (field order of BlockMem and HostRegion).
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

impl BlockMem {
    /// An unregistered block.
    fn plain() -> Result<BlockMem> {
        let m = Mapped::new(BLOCK)?;
        Ok(BlockMem { ptr: m.ptr, lkey: 0, _mr: None, _map: m })
    }

    /// A block registered as a whole with `access` on `pd`.
    fn registered(pd: &Pd, access: Access) -> Result<BlockMem> {
        let m = Mapped::new(BLOCK)?;
        // SAFETY: the mapping lives until the block drops, after this
        // registration (field order).
        let mr = unsafe { pd.reg_mr(m.ptr, BLOCK, access)? };
        Ok(BlockMem { ptr: m.ptr, lkey: mr.lkey(), _mr: Some(mr), _map: m })
    }
}

impl Mapped {
    fn new(len: usize) -> Result<Mapped> {
        // SAFETY: a fresh private anonymous mapping; no address hint.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(Error::sys(format!("mmap of a {len}-byte control block"), Errno::last()));
        }
        Ok(Mapped { ptr: p as *mut u8, len })
    }
}

/// A piece out of a block: returned to it when dropped.
struct Piece {
    pool: Arc<Mutex<Pool>>,
    block: u64,
    off: usize,
    size: usize,
    /// Keeps the block's bytes until the piece is back.
    _mem: Arc<BlockMem>,
}

impl Drop for Piece {
    fn drop(&mut self) {
        self.pool.lock().give_back(self.block, self.off, self.size);
    }
}

impl Pool {
    /// A piece of `size` bytes from a block held now: (its bytes, block, offset).
    fn take(&mut self, size: usize) -> Option<(Arc<BlockMem>, u64, usize)> {
        for b in self.blocks.iter_mut() {
            if let Some(k) = b.free.iter().position(|&(_, s)| s == size) {
                let (off, _) = b.free.swap_remove(k);
                b.live += 1;
                return Some((b.mem.clone(), b.id, off));
            }
        }
        let b = self.blocks.iter_mut().find(|b| b.bump + size <= BLOCK)?;
        let off = b.bump;
        b.bump += size;
        b.live += 1;
        Some((b.mem.clone(), b.id, off))
    }

    /// A new block, its first piece of `size` bytes taken: (block, offset 0).
    fn add(&mut self, mem: Arc<BlockMem>, size: usize) -> (u64, usize) {
        let id = self.next_id;
        self.next_id += 1;
        self.blocks.push(Block { id, mem, bump: size, live: 1, free: Vec::new() });
        (id, 0)
    }

    /// A piece came back; the block goes with its last one (its bytes when
    /// the last piece's reference does).
    fn give_back(&mut self, block: u64, off: usize, size: usize) {
        let Some(i) = self.blocks.iter().position(|b| b.id == block) else { return };
        let b = &mut self.blocks[i];
        b.live -= 1;
        if b.live == 0 {
            self.blocks.swap_remove(i);
        } else {
            b.free.push((off, size));
        }
    }
}

/// Does `access` let the peer at the region?
fn is_remote(access: Access) -> bool {
    access.0 & (Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0) & !Access::LOCAL_WRITE.0 != 0
}

impl CtlSlab {
    /// The blocks of `pd`'s comms (none allocated yet).
    pub fn new(pd: Pd) -> CtlSlab {
        let pool = || Arc::new(Mutex::new(Pool { next_id: 0, blocks: Vec::new() }));
        CtlSlab { pd, local: pool(), remote: pool() }
    }

    /// A zeroed region of `len` bytes with `access`: a piece of a shared
    /// block when small (its own registration if the peer may reach it),
    /// else its own allocation and registration.
    pub fn region(&self, len: usize, access: Access) -> Result<HostRegion> {
        let size = len.max(1).div_ceil(ALIGN) * ALIGN;
        if size > MAX_PIECE {
            return HostRegion::new(&self.pd, len, access);
        }
        let remote = is_remote(access);
        let pool = if remote { &self.remote } else { &self.local };
        let (mem, block, off) = self.take(pool, size, remote)?;
        // SAFETY: off..off+size lies inside the block (take), and is ours alone until the piece returns.
        let ptr = unsafe { mem.ptr.add(off) };
        // SAFETY: ptr..ptr+size is inside the block and ours alone (take); zeroed because a reused piece may hold its last user's bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, size) };
        let lkey = mem.lkey;
        let piece: Box<dyn Any + Send + Sync> = Box::new(Piece { pool: pool.clone(), block, off, size, _mem: mem });
        if remote {
            // SAFETY: the piece's bytes stay allocated until `piece` drops,
            // which the region does after this registration (field order).
            let mr = unsafe { self.pd.reg_mr(ptr, size, access)? };
            // SAFETY: zeroed, 64-byte aligned, ours until `piece` drops.
            Ok(unsafe { HostRegion::lent(ptr, size, 0, Some(mr), piece) })
        } else {
            // SAFETY: zeroed, 64-byte aligned, ours until `piece` drops; the
            // block's registration (lkey) lives as long as its bytes, which
            // the piece keeps.
            Ok(unsafe { HostRegion::lent(ptr, size, lkey, None, piece) })
        }
    }

    /// A piece of `size` bytes from `pool`: (its block's bytes, the block, offset).
    fn take(&self, pool: &Arc<Mutex<Pool>>, size: usize, remote: bool) -> Result<(Arc<BlockMem>, u64, usize)> {
        let mut p = pool.lock();
        if let Some(t) = p.take(size) {
            return Ok(t);
        }
        // local blocks with local write: the flush reads land in pieces too
        let mem = Arc::new(if remote { BlockMem::plain()? } else { BlockMem::registered(&self.pd, Access::LOCAL_WRITE)? });
        let (id, off) = p.add(mem.clone(), size);
        Ok((mem, id, off))
    }

    /// Blocks held now: (local, remote). For tests and the statistics.
    pub fn blocks(&self) -> (usize, usize) {
        (self.local.lock().blocks.len(), self.remote.lock().blocks.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> Pool {
        Pool { next_id: 0, blocks: Vec::new() }
    }

    /// A piece as `CtlSlab::take` gets it: from a held block, else a new one.
    fn take(p: &mut Pool, size: usize) -> (u64, usize) {
        match p.take(size) {
            Some((_, b, off)) => (b, off),
            None => p.add(Arc::new(BlockMem::plain().unwrap()), size),
        }
    }

    #[test]
    fn pieces_fill_a_block_then_the_next_and_empty_blocks_go() {
        let mut p = pool();
        let fifo = 8256usize.div_ceil(ALIGN) * ALIGN;
        let per = BLOCK / fifo;
        let got: Vec<(u64, usize)> = (0..per + 1).map(|_| take(&mut p, fifo)).collect();
        assert!(got[..per].iter().enumerate().all(|(i, &(b, off))| b == 0 && off == i * fifo), "one block, back to back: {got:?}");
        assert_eq!(got[per], (1, 0), "a full block: the next piece opens another");
        // a small piece still fits in the first block's tail
        assert_eq!(take(&mut p, 64), (0, per * fifo));
        // returned pieces are reused by size; a block goes with its last piece
        p.give_back(0, fifo, fifo);
        assert_eq!(take(&mut p, fifo), (0, fifo));
        p.give_back(1, 0, fifo);
        assert_eq!(p.blocks.len(), 1, "the empty block is freed at once");
        for (i, _) in got[..per].iter().enumerate() {
            p.give_back(0, i * fifo, fifo);
        }
        p.give_back(0, per * fifo, 64);
        assert!(p.blocks.is_empty(), "every piece back: nothing held");
    }

    #[test]
    fn only_regions_the_peer_reaches_count_as_remote() {
        assert!(is_remote(Access::REMOTE_WRITE) && is_remote(Access::REMOTE_READ));
        assert!(!is_remote(Access::LOCAL_READ) && !is_remote(Access::LOCAL_WRITE));
    }
}
