//! The operator tool's library: what `rustnet` (src/bin/rustnet) runs and
//! the tests drive. None of it is in `librustnet.so`: NCCL ranks load only the
//! plugin crate (`rustnet`), which this crate links as an rlib.
//! - [`driver`]: a stand-in for NCCL that dlopens the built plugin and calls
//!   its vtable (bench, agent, and the conformance and fuzz tests);
//! - [`doctor`]: `rustnet doctor`, the host checks;
//! - [`fabric`]: NIC counters and lossless-Ethernet rules (`watch`, `doctor`);
//! - [`bisect`]: the slow-node search logic; [`svg`]: plots without a dependency;
//! - [`stats_summary`]: `rustnet stats DIR`, a job's statistics files (the
//!   plugin's `RUSTNET_STATS_DIR`) summarised per rank and device.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod bisect;
pub mod doctor;
pub mod driver;
pub mod fabric;
pub mod stats_summary;
pub mod status;
pub mod svg;
