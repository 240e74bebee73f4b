//! Transports: the verbs one and the TCP one, behind one set of types, and
//! what both use, which imports neither: [`sock`] (socket system calls),
//! [`oob`] (listen/connect with hellos: TCP's data streams, the verbs
//! transport's out-of-band socket) and [`netif`] (which interfaces).
pub mod ib;
pub mod netif;
pub mod oob;
pub mod sock;
pub mod tcp;

use std::ffi::CStr;

pub use rustnet_proto::{MAX_RECVS, MAX_REQUESTS};
/// Largest single isend/irecv we accept: `test` reports sizes as C `int`.
pub const MAX_P2P_BYTES: usize = 1 << 30;

/// Give the freed heap back to the system (called when the last comm
/// closes): glibc keeps freed memory in its arenas, and after thousands of
/// comms that is hundreds of MB of RSS the application never asked to keep.
pub fn give_back_heap() {
    // SAFETY: malloc_trim(3) only releases free memory of the allocator's
    // arenas; it touches no live allocation and is thread-safe.
    unsafe { libc::malloc_trim(0) };
}

/// Pointer kinds (NCCL_PTR_*).
pub const PTR_HOST: i32 = 1;
/// GPU memory through peer memory.
pub const PTR_CUDA: i32 = 2;
/// GPU memory through dma-buf.
pub const PTR_DMABUF: i32 = 4;

/// What `getProperties` reports, in version-neutral form.
#[derive(Debug, Clone, Copy)]
pub struct DeviceProps {
    /// Unique device name.
    pub name: &'static CStr,
    /// sysfs PCI directory, or None for virtual devices.
    pub pci_path: Option<&'static CStr>,
    /// NIC identity.
    pub guid: u64,
    /// PTR_* bits.
    pub ptr_support: i32,
    /// Registrations are not tied to a comm.
    pub reg_is_global: bool,
    /// Ask NCCL to always flush.
    pub force_flush: bool,
    /// Mbps.
    pub speed_mbps: i32,
    /// Port number.
    pub port: i32,
    /// Microseconds.
    pub latency_us: f32,
    /// Connections this device can carry.
    pub max_comms: i32,
    /// Largest grouped receive.
    pub max_recvs: i32,
    /// Largest isend/irecv.
    pub max_p2p_bytes: usize,
    /// Largest collnet op.
    pub max_coll_bytes: usize,
}

/// A buffer NCCL handed us. We never make a Rust reference to its bytes:
/// it may be device memory, or written by the NIC while we hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawBuf {
    /// Start address.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

// SAFETY: RawBuf is an address and a length; the obligations of using it are
// on the unsafe functions that read or write through it.
unsafe impl Send for RawBuf {}
// SAFETY: &RawBuf only reads the address and length (Copy values); reading
// or writing the bytes is the business of the unsafe fns that take one.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// An empty buffer.
    pub const EMPTY: RawBuf = RawBuf { ptr: std::ptr::null_mut(), len: 0 };
}

/// One buffer of a (grouped) receive.
#[derive(Debug, Clone, Copy)]
pub struct RecvBuf {
    /// Where to land the message; `len` is its capacity.
    pub buf: RawBuf,
    /// Tag of the send it takes.
    pub tag: i32,
}

/// Where a memory region lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    /// Host memory.
    Host,
    /// CUDA device memory.
    Cuda,
}

/// What `test` reports once a request is done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Completion {
    /// Sizes reported (1 for a send, n for a grouped receive).
    pub n: usize,
    /// Bytes per buffer.
    pub sizes: [usize; MAX_RECVS],
}

impl Completion {
    /// A single-size completion.
    pub fn one(size: usize) -> Completion {
        let mut c = Completion { n: 1, sizes: [0; MAX_RECVS] };
        c.sizes[0] = size;
        c
    }
}
