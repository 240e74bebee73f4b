//! librustnet: an NCCL network plugin.
//!
//! Rings, from the outside in:
//! - [`abi`]: the only code that sees NCCL's pointers (vtables v6..v12, one
//!   boundary per slot: panics caught, NULLs rejected, errors mapped);
//! - the safe core: [`config`], [`proto`] (handle and wire formats, request
//!   pools, matching; no I/O), [`plugin`] (the comm objects and operations),
//!   [`context`] (per-communicator plugin contexts, ABI v11+);
//! - the system ring: [`transport`] (sockets, verbs), where `unsafe` lives
//!   with a `// SAFETY:` line on each block.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod abi;
pub mod bisect;
pub mod config;
pub mod context;
pub mod doctor;
pub mod driver;
pub mod error;
pub mod fabric;
pub mod fault;
pub mod gpu;
pub mod log;
pub mod plugin;
pub mod profiler;
pub mod proto;
pub mod registry;
pub mod stats;
pub mod svg;
pub mod thread;
pub mod transport;
pub mod unload;

pub use error::{Error, Result};
