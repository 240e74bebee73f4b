//! The verdict of one check, shared by `rustnet doctor` and the fabric rules
//! it runs (a leaf: both import it).

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    /// Fine.
    Pass,
    /// Works, but worth fixing.
    Warn,
    /// Will not work.
    Fail,
}
