//! What bench's modes share: a sample set and its order statistics, one
//! measured point of the step/ring sweeps, and the size formatter. A leaf:
//! bench, ring and plot import it, it imports none of them.

/// The samples of one measurement (medians, min and max over repeats).
#[derive(Default, Clone)]
pub struct Stat(pub Vec<f64>);

impl Stat {
    fn sorted(&self) -> Vec<f64> {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v
    }
    /// The median of the finite samples (bisect's); NaN when none was measured.
    pub fn med(&self) -> f64 {
        if self.0.iter().any(|x| x.is_finite()) {
            rustnet_tools::bisect::median(&self.0)
        } else {
            f64::NAN
        }
    }
    pub fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }
    pub fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }
    /// Without its one lowest and one highest sample when there are at
    /// least 5 (the median stays; the range becomes that of the middle n-2).
    pub fn trimmed(&self) -> Stat {
        let v = self.sorted();
        if v.len() < 5 {
            return Stat(v);
        }
        Stat(v[1..v.len() - 1].to_vec())
    }
}

/// One measured point.
pub struct Row {
    pub ranks: usize,
    pub size: usize,
    pub net: String,
    pub busbw: Stat,
    pub cpu: Stat,
}

/// A size as the tables print it: 4K, 1M, 2G, or bytes.
pub(crate) fn human(n: usize) -> String {
    if n >= 1 << 30 && n.is_multiple_of(1 << 30) {
        format!("{}G", n >> 30)
    } else if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}
