//! The soak's peer processes, faults, and the samples taken of them.
use super::*;

/// A peer process; its stdout lines arrive on the coordinator's one channel
/// tagged with (role, generation), so lines of a killed B are told apart.
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) stdin: ChildStdin,
    pub(crate) pid: u32,
    pub(crate) gen: u32,
    pub(crate) stderr: StderrLog,
}

impl Proc {
    pub(crate) fn send(&mut self, line: &str) {
        let _ = writeln!(self.stdin, "{line}");
        let _ = self.stdin.flush();
    }
    pub(crate) fn stderr_since(&self, mark: usize) -> String {
        self.stderr.since(mark)
    }
    pub(crate) fn stderr_len(&self) -> usize {
        self.stderr.len()
    }
    pub(crate) fn stderr_tail(&self, n: usize) -> String {
        self.stderr.tail(n)
    }
}

pub(crate) type Line = (char, u32, String);

pub(crate) fn spawn_peer(net: &Net, role: char, gen: u32, tx: Sender<Line>, extra: &[(String, String)]) -> Proc {
    let (ns, env) = net.peer_env(&role.to_string());
    let mut cmd = peer_command(ns.as_deref());
    cmd.env("SOAK_ROLE", role.to_string());
    for (k, v) in env.iter().chain(extra) {
        cmd.env(k, v);
    }
    let (child, stdin, stderr) = spawn_piped(cmd, move |l| tx.send((role, gen, l)).is_ok());
    let pid = child.id();
    Proc { child, stdin, pid, gen, stderr }
}

/// How long a flap takes the link down: well under RUSTNET_SOCKET_TIMEOUT.
pub(crate) const FLAP: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Fault {
    None,
    Kill,
    Cut,
    Flap,
}

impl Fault {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::Kill => "kill B",
            Fault::Cut => "link cut",
            Fault::Flap => "link flap",
        }
    }
}

/// One /proc sample of a peer.
#[derive(Clone)]
pub(crate) struct Sample {
    pub(crate) t: f64,
    pub(crate) role: char,
    pub(crate) pid: u32,
    pub(crate) fds: usize,
    pub(crate) threads: usize,
    pub(crate) rss_kib: usize,
}

/// A sample and, for A's row on verbs, the kernel's (MRs, QPs) at that time.
pub(crate) type SampleRow = (Sample, Option<(usize, usize)>);

pub(crate) fn proc_sample(pid: u32) -> Option<(usize, usize, usize)> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    let th = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.count();
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = st.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())?;
    Some((fds, th, rss))
}

/// Kernel verbs objects in use (summed over devices): (MRs, QPs), from
/// `rdma res show` -- the plugin itself exposes no registration count.
pub(crate) fn rdma_counts() -> Option<(usize, usize)> {
    let out = sh_out("rdma res show 2>/dev/null");
    if out.trim().is_empty() {
        return None;
    }
    let (mut mr, mut qp) = (0, 0);
    for l in out.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        for i in 0..w.len().saturating_sub(1) {
            match w[i] {
                "mr" => mr += w[i + 1].parse::<usize>().unwrap_or(0),
                "qp" => qp += w[i + 1].parse::<usize>().unwrap_or(0),
                _ => {}
            }
        }
    }
    Some((mr, qp))
}
