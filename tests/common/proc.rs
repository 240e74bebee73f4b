//! The process harness the two-process tests and the soak rig share: knobs
//! from the environment, shell one-liners, the peer's line protocol on
//! stdout, and spawning a peer (optionally in a network namespace) with its
//! stdout lines handed to a callback and its stderr kept.
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An integer knob, `d` when unset or unparsable.
pub fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

/// A string knob, `d` when unset (set and empty stays empty: e.g. no faults).
pub fn env_str(k: &str, d: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| d.to_string())
}

/// Run `cmd` with `sh -c`, output discarded: did it succeed?
pub fn sh(cmd: &str) -> bool {
    Command::new("sh").arg("-c").arg(cmd).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Run `cmd` with `sh -c`: its stdout (empty if it could not run).
pub fn sh_out(cmd: &str) -> String {
    Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// A peer's line to its coordinator (stdout, flushed at once).
pub fn say(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{s}");
    let _ = o.flush();
}

/// This executable again, run as a peer: directly, or in network namespace `netns`.
pub fn peer_command(netns: Option<&str>) -> Command {
    let exe = std::env::current_exe().unwrap();
    match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(exe);
            c
        }
        None => Command::new(exe),
    }
}

/// A peer's stderr, line by line: the recent past only (20 000 lines at
/// most; the index of the first kept line moves, which `since` tolerates).
#[derive(Clone, Default)]
pub struct StderrLog(Arc<Mutex<VecDeque<String>>>, Arc<AtomicBool>);

impl StderrLog {
    /// Wait (up to `t`) until the peer closed its stderr (it exited): then
    /// every line it wrote is here. Whether it did.
    pub fn wait_eof(&self, t: Duration) -> bool {
        let t0 = Instant::now();
        while !self.1.load(Ordering::Acquire) {
            if t0.elapsed() > t {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }
    /// Everything kept.
    pub fn text(&self) -> String {
        self.0.lock().unwrap().iter().map(|l| format!("{l}\n")).collect()
    }
    /// The last `n` characters or so (whole lines).
    pub fn tail_chars(&self, n: usize) -> String {
        let t = self.text();
        let mut i = t.len().saturating_sub(n);
        while !t.is_char_boundary(i) {
            i += 1;
        }
        t[i..].to_string()
    }
    /// The last `n` lines (`RUSTNET_CONF_TAIL`, when set, overrides `n`:
    /// a failing case's whole log when tracing one).
    pub fn tail(&self, n: usize) -> String {
        let n = std::env::var("RUSTNET_CONF_TAIL").ok().and_then(|v| v.parse().ok()).unwrap_or(n);
        let g = self.0.lock().unwrap();
        g.iter().skip(g.len().saturating_sub(n)).cloned().collect::<Vec<_>>().join("\n")
    }
    /// Lines kept so far (a mark for `since`).
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    /// Lines after `mark` (a mark past the end: none).
    pub fn since(&self, mark: usize) -> String {
        let g = self.0.lock().unwrap();
        g.iter().skip(mark.min(g.len())).cloned().collect::<Vec<_>>().join("\n")
    }
}

/// Spawn `cmd` with piped stdio; every stdout line goes to `on_line` (until
/// it returns false), stderr into the returned log.
pub fn spawn_piped(mut cmd: Command, mut on_line: impl FnMut(String) -> bool + Send + 'static) -> (Child, ChildStdin, StderrLog) {
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn peer");
    let stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if !on_line(l) {
                break;
            }
        }
    });
    let log = StderrLog::default();
    let l2 = log.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines() {
            let Ok(l) = l else { break };
            let mut g = l2.0.lock().unwrap();
            g.push_back(l);
            if g.len() > 20_000 {
                g.drain(..10_000);
            }
        }
        l2.1.store(true, Ordering::Release);
    });
    (child, stdin, log)
}
