//! The fabric's own health, as the NIC and the driver report it (not what
//! the plugin counts): per-port counters and their rates ([`counters`]), a
//! pure classifier that names what they show ([`classify`]), and the
//! lossless-Ethernet configuration checks of `rustnet doctor` ([`lossless`]).
//!
//! Everything reads under a sysfs root (fixture trees in tests), asks DCB
//! netlink ([`dcbnl`]) or runs the `ethtool` / `dcb` tools by a path the
//! caller chooses, so each rule is tested without a NIC.
pub mod classify;
pub mod counters;
pub mod dcbnl;
pub mod lossless;
