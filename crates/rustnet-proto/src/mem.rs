//! Registered memory as the protocol machines see it: byte areas they read
//! (what the peer RDMA-wrote: CTS slots, the eager ring, the credit word)
//! and staging they write (what our NIC then sends). The transport
//! implements these over its registered regions (volatile reads with an
//! acquire fence after a marker word); tests implement them over byte
//! arrays. The machines never touch memory any other way.

/// An area the peer writes into and we read.
pub trait Mem {
    /// The little-endian 8-byte word at `off` (8-aligned); every read
    /// after it sees what the peer wrote before that word.
    fn read_u64(&self, off: usize) -> u64;
    /// `out.len()` bytes from `off` (8-aligned, a multiple of 8 long).
    fn read(&self, off: usize, out: &mut [u8]);
}

/// Staging we write and our NIC reads when a planned write is posted.
pub trait MemMut {
    /// Copy `data` to `off`.
    fn write(&mut self, off: usize, data: &[u8]);
}

/// A byte array as peer-written memory (tests, the model).
impl Mem for [u8] {
    fn read_u64(&self, off: usize) -> u64 {
        u64::from_le_bytes(self[off..off + 8].try_into().unwrap())
    }
    fn read(&self, off: usize, out: &mut [u8]) {
        out.copy_from_slice(&self[off..off + out.len()]);
    }
}

/// A byte array as staging (tests, the model).
impl MemMut for [u8] {
    fn write(&mut self, off: usize, data: &[u8]) {
        self[off..off + data.len()].copy_from_slice(data);
    }
}
