//! librustnet: an NCCL network plugin.
//!
//! Rings, from the outside in:
//! - [`abi`]: the only code that sees NCCL's pointers (vtables v6..v12, one
//!   boundary per slot: panics caught, NULLs rejected, errors mapped);
//! - the safe core: [`config`], [`proto`] (handle and wire formats, request
//!   pools, matching; no I/O: the crate `rustnet-proto`, re-exported here),
//!   [`plugin`] (the comm objects and operations), [`context`]
//!   (per-communicator plugin contexts, ABI v11+);
//! - the system ring: [`transport`] (sockets, verbs) and [`gpu`], where most
//!   `unsafe` lives; the rest is in [`abi`] and in the system files of `src/`
//!   (`thread`, `unload`, `log`, `random`, ...: `git grep -l unsafe src`),
//!   each block with a `// SAFETY:` line.
//!
//! The operator tool (`rustnet`: bench, doctor, agent, bisect, watch) and the
//! stand-in for NCCL (`driver`) are the crate `rustnet-tools`: none of it is
//! in `librustnet.so`.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod abi;
pub mod config;
pub mod context;
pub mod error;
pub mod fault;
pub mod gpu;
pub mod intern;
pub mod log;
pub mod plugin;
pub mod profiler;
pub mod random;
pub mod stats;
mod teardown;
pub mod thread;
pub mod transport;
pub mod unload;

pub use rustnet_proto as proto;

pub use error::{Error, Result};
