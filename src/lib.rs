//! librustnet: an NCCL network plugin. NCCL sees only the
//! `ncclNetPlugin_v6`..`v12` symbols of `librustnet.so`; the modules are
//! `pub(crate)`, and what the tools crate and the tests may use of them is
//! listed in [`for_tools`].
//!
//! Rings, from the outside in (docs/architecture.md draws them):
//! - `abi`: the only code that sees NCCL's pointers (vtables v6..v12, one
//!   boundary per slot: panics caught, NULLs rejected, errors mapped);
//! - the safe core: `config`, [`proto`] (handle and wire formats, request
//!   pools, matching; no I/O: the crate `rustnet-proto`, re-exported here),
//!   `plugin` (the comm objects and operations), `context`
//!   (per-communicator plugin contexts, ABI v11+);
//! - the system ring: `transport` (sockets, verbs) and `gpu`, where most
//!   `unsafe` lives; the rest is in `abi` and in the system files of `src/`
//!   (`thread`, `unload`, `log`, `random`, ...: `git grep -l unsafe src`),
//!   each block with a `// SAFETY:` line.
//!
//! The operator tool (`rustnet`: bench, doctor, agent, bisect, watch) and the
//! stand-in for NCCL (`driver`) are the crate `rustnet-tools`: none of it is
//! in `librustnet.so`.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub(crate) mod abi;
pub(crate) mod config;
pub(crate) mod context;
pub(crate) mod error;
pub(crate) mod fault;
pub mod for_tools;
pub(crate) mod gpu;
pub(crate) mod intern;
pub(crate) mod log;
pub(crate) mod plugin;
pub(crate) mod profiler;
pub(crate) mod random;
pub(crate) mod stats;
mod teardown;
pub(crate) mod thread;
pub(crate) mod transport;
pub(crate) mod unload;

pub use rustnet_proto as proto;

pub use error::{Error, Result};
