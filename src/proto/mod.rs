//! The sans-IO core: handle and wire formats, request pools, matching rules.
//! Nothing here makes a system call or reads a clock.
pub mod eager;
pub mod fifo;
pub mod fuzz;
pub mod handle;
pub mod ib_meta;
pub mod notice;
pub mod pool;
pub mod wire;
