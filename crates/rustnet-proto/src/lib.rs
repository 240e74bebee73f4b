//! The sans-IO core: handle and wire formats, request pools, matching rules.
//! Nothing here makes a system call or reads a clock, and nothing is `unsafe`
//! (the compiler holds us to both: `forbid(unsafe_code)` below, and this crate
//! depends on no I/O crate). The plugin (`rustnet`) re-exports it as
//! `rustnet::proto`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
pub mod eager;
pub mod error;
pub mod fifo;
pub mod fuzz;
pub mod handle;
pub mod ib_meta;
pub mod mem;
pub mod nic;
pub mod notice;
pub mod pool;
pub mod recover;
pub mod resume;
pub mod rx;
pub mod tx;
pub mod wire;

pub use error::ProtoError;

/// Largest grouped receive we accept (`maxRecvs`).
pub const MAX_RECVS: usize = 8;
/// Requests in flight per receive comm (NCCL_NET_MAX_REQUESTS).
pub const MAX_REQUESTS: usize = 32;
