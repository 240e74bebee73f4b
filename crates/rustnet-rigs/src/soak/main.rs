//! Soak: two peer processes drive the built `librustnet.so` through its
//! vtable (the `rustnet_tools::driver` stand-in for NCCL) for a given time, cycle
//! after cycle: listen, swap handles, connect+accept, both directions at once
//! with grouped receives of 0 B to several MiB, every byte checked against a
//! pattern derived from (cycle, round, buffer), close. Between cycles the
//! coordinator injects faults: peer B killed (SIGKILL) and restarted, the
//! link cut for longer than RUSTNET_SOCKET_TIMEOUT or flapped for 0.5 s.
//! Over TCP both ends must survive both, every byte intact: a cut shorter
//! than RUSTNET_RECOVERY_TIMEOUT (default 120 s) is a recovery (the send
//! comm reconnects through the receiver's resume port and resends what was
//! not taken); with RUSTNET_RECOVERY_TIMEOUT=0, or a window shorter than
//! the cut, a cut must fail both ends, naming the peer. Over verbs the port
//! goes down with the link (PORT_ERR, then PORT_ACTIVE): the comms recover
//! in place (new QPs, what the peer lacks resent) and must survive a flap
//! and a cut shorter than RUSTNET_RECOVERY_TIMEOUT the same way. fds, threads,
//! RSS (and, on verbs, the kernel's MR/QP counts from `rdma res`) of both
//! peers are sampled every few seconds into a CSV and an SVG plot.
//!
//! Run through `scripts/soak.sh` (which builds and sets the network up); by
//! hand: `cargo build --release && target/release/rustnet-soak`.
//!
//! Outcome of a cycle, per peer: `ok`; an error (expected when a fault hit
//! that cycle and a WARN names the peer, else unexpected); `aborted` (the
//! coordinator gave up on it after a fault: expected; in a clean cycle that
//! is a hang); `corrupt` (wrong bytes, wrong size, overwritten canary: always
//! fatal). The run fails on any corruption, unexpected error, hang (no answer
//! from a peer within the watchdog), or growth of peer A's fds/threads/RSS at
//! the quiet point between cycles beyond a small bound after warm-up (A is
//! never killed; B is restarted on every kill).
//!
//! Knobs (environment): SOAK_SECONDS (1800), SOAK_OUT (soak-out), SOAK_NET
//! (auto: netns as root with `ip`, else loopback; or vm for the soft-RoCE VM),
//! SOAK_MAX_ROUNDS (24), SOAK_MAX_BIG (4 MiB), SOAK_SEED (1), SOAK_VERSION (8),
//! SOAK_SAMPLE_S (3), SOAK_WARMUP_S (20% of the run, 30..300), SOAK_LOSS
//! (netem loss on the link, e.g. 1%), SOAK_FAULTS ("kill,cut,flap"),
//! SOAK_FAULT_EVERY_S (20, +-50%), SOAK_FAULT_AT_MS (20-220: when in the
//! cycle the fault hits, after the handles are swapped; 0 lands in connect),
//! SOAK_CYCLE_TIMEOUT_S (120), SOAK_SLACK_FDS (2), SOAK_SLACK_THREADS (1),
//! SOAK_SLACK_RSS_MIB (8), SOAK_SLACK_MRS (4).
#[path = "../../../../tests/common/mod.rs"]
mod common;

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::proc::*;
use common::traffic::{Counters, InFlight, Stop, Traffic};
use common::*;
use rustnet_tools::driver::{self, hex, unhex, Plugin, Ptr};

mod net;
mod peer;
mod procs;

use net::*;
use peer::*;
use procs::*;

// ------------------------------------------------------------- coordinator

#[derive(Default)]
struct Tally {
    cycles: u64,
    clean_cycles: u64,
    bytes_checked: u64,
    msgs_checked: u64,
    faults: [u64; 4],
    expected_errors: u64,
    expected_aborts: u64,
    unexpected: Vec<String>,
    /// Per unexpected error: the outcome and its side's first WARNs (kept in the summary).
    first_warns: Vec<String>,
    corrupt: Vec<String>,
    hangs: Vec<String>,
    named_peer: u64,
    /// faults that hit while both peers were still moving data
    in_flight: u64,
    /// how long each flap really kept the link down (s)
    flap_down: Vec<f64>,
    /// flaps that lasted past a third of the timeout (judged as cuts)
    long_flaps: u64,
}

struct Coordinator {
    net: Net,
    t0: Instant,
    tx: Sender<Line>,
    rx: Receiver<Line>,
    pending: VecDeque<Line>,
    a: Proc,
    b: Proc,
    peer_extra: Vec<(String, String)>,
    pids: Arc<Mutex<[u32; 2]>>,
    markers: Vec<(f64, Fault)>,
    tally: Tally,
    /// (t, cycle, fds, threads, rss) of A between cycles
    quiet: Vec<(f64, u64, usize, usize, usize)>,
    /// (t, kernel MRs, kernel QPs) between cycles, verbs only
    quiet_rdma: Vec<(f64, usize, usize)>,
    cycle_log: String,
    socket_timeout: u64,
    /// Comms ride out a cut or flap (RUSTNET_RECOVERY_TIMEOUT longer than
    /// the cut): over TCP by reconnecting, over verbs by new QPs.
    recovers: bool,
    /// When in a cycle a fault hits, ms after both peers have the other's
    /// handle (SOAK_FAULT_AT_MS, "20-220"): 0 lands in connect/accept.
    fault_at_ms: (u64, u64),
}

#[derive(Default, Clone)]
struct PeerResult {
    kind: String,
    detail: String,
    bytes: u64,
    msgs: u64,
}

fn parse_result(rest: &str) -> PeerResult {
    // "<c> ok|err|corrupt|aborted bytes=N msgs=M sent=S [detail]"
    let mut it = rest.splitn(6, ' ');
    let _c = it.next();
    let kind = it.next().unwrap_or("").to_string();
    let num = |s: Option<&str>| s.and_then(|x| x.split('=').nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0);
    let bytes = num(it.next());
    let msgs = num(it.next());
    let _sent = it.next();
    PeerResult { kind, detail: it.next().unwrap_or("").to_string(), bytes, msgs }
}

impl Coordinator {
    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }
    fn peer(&mut self, role: char) -> &mut Proc {
        if role == 'A' {
            &mut self.a
        } else {
            &mut self.b
        }
    }
    /// Next line from `role` (current generation) starting with `prefix`.
    /// The next line of either peer: kept-back ones first.
    fn next_line(&mut self, timeout: Duration) -> Option<Line> {
        if let Some(l) = self.pending.pop_front() {
            return Some(l);
        }
        self.rx.recv_timeout(timeout).ok()
    }

    /// Next line from `role` (current generation) starting with `prefix`;
    /// the other peer's lines meanwhile are kept for later.
    fn expect(&mut self, role: char, prefix: &str, timeout: Duration) -> Result<String, String> {
        let t = Instant::now();
        let mut other = Vec::new();
        let r = loop {
            let Some(left) = timeout.checked_sub(t.elapsed()) else {
                break Err(format!("peer {role}: no {prefix:?} within {timeout:?}"));
            };
            match self.next_line(left) {
                Some((r, g, l)) if r == role && g == self.peer(role).gen => {
                    if let Some(rest) = l.strip_prefix(prefix) {
                        break Ok(rest.to_string());
                    }
                }
                Some((r, g, l)) if g == self.peer(r).gen => other.push((r, g, l)),
                Some(_) => {}
                None => break Err(format!("peer {role}: no {prefix:?} within {timeout:?}")),
            }
        };
        for l in other.into_iter().rev() {
            self.pending.push_front(l);
        }
        r
    }

    fn restart_b(&mut self) -> Result<(), String> {
        let _ = self.b.child.kill();
        let _ = self.b.child.wait();
        let gen = self.b.gen + 1;
        self.b = spawn_peer(&self.net, 'B', gen, self.tx.clone(), &self.peer_extra);
        self.pids.lock().unwrap()[1] = self.b.pid;
        self.expect('B', "READY", Duration::from_secs(60)).map(|_| ())
    }

    fn fail_hang(&mut self, what: String) {
        let mut s = what;
        for role in ['A', 'B'] {
            let pid = self.peer(role).pid;
            let stacks =
                sh_out(&format!("for t in /proc/{pid}/task/*; do echo \"== $t: $(cat $t/comm) $(cat $t/wchan 2>/dev/null)\"; done"));
            let _ = write!(s, "\n  peer {role} (pid {pid}) threads:\n{stacks}  its stderr (tail):\n{}", self.peer(role).stderr_tail(20));
        }
        self.tally.hangs.push(s);
    }

    /// One cycle; Err = stop the run (a hang or a broken harness).
    fn cycle(&mut self, c: u64, fault: Fault, rounds: usize, max_big: usize, rng: &mut Rng) -> Result<(), String> {
        let setup_t = Duration::from_secs(60);
        let cycle_t = Duration::from_secs(env_u64("SOAK_CYCLE_TIMEOUT_S", 120));
        let marks = [self.a.stderr_len(), self.b.stderr_len()];
        for role in ['A', 'B'] {
            self.peer(role).send(&format!("CYCLE {c} {rounds} {max_big}"));
        }
        let ha = self.expect('A', &format!("HANDLE {c} "), setup_t)?;
        let hb = self.expect('B', &format!("HANDLE {c} "), setup_t)?;
        self.a.send(&format!("PEER {hb}"));
        self.b.send(&format!("PEER {ha}"));
        let start = Instant::now();
        let mut results: [Option<PeerResult>; 2] = [None, None];
        // when each RESULT came (which side failed first tells cause from consequence)
        let mut result_at: [Option<Instant>; 2] = [None, None];
        let mut closed_early = [false, false];
        let mut aborted = [false, false];
        let mut fault_at: Option<Instant> = None;
        let mut link_up_at: Option<Instant> = None;
        let mut b_dead = false;
        // when the fault hits: a random moment early in the cycle
        let (lo, hi) = self.fault_at_ms;
        let hit_after = Duration::from_millis(lo + rng.below(hi - lo + 1));
        let grace = Duration::from_secs(3 * self.socket_timeout + 20);
        // a cut the comms recover from is no excuse to fail (nor to be told to give up)
        let recovers = self.recovers;
        let survivable = move |fault: Fault, long_flap: bool| match fault {
            Fault::Flap => !long_flap || recovers,
            Fault::Cut => recovers,
            _ => false,
        };
        let mut kept = Vec::new();
        let mut first_fail: Option<Instant> = None;
        let (mut down_at, mut down_for): (Option<Instant>, Option<Duration>) = (None, None);
        while results.iter().any(Option::is_none) {
            if fault != Fault::None && fault_at.is_none() && start.elapsed() >= hit_after {
                fault_at = Some(Instant::now());
                if results.iter().all(Option::is_none) {
                    self.tally.in_flight += 1;
                }
                self.markers.push((self.now(), fault));
                match fault {
                    Fault::Kill => {
                        let _ = self.b.child.kill();
                        let _ = self.b.child.wait();
                        b_dead = true;
                        results[1] = Some(PeerResult { kind: "killed".into(), ..Default::default() });
                    }
                    Fault::Cut | Fault::Flap => {
                        if !self.net.link(false) {
                            return Err("could not take the link down".into());
                        }
                        down_at = Some(Instant::now());
                        let down = if fault == Fault::Cut { Duration::from_secs(2 * self.socket_timeout + 2) } else { FLAP };
                        link_up_at = Some(Instant::now() + down);
                    }
                    Fault::None => {}
                }
            }
            if link_up_at.is_some_and(|t| Instant::now() >= t) {
                if !self.net.link(true) {
                    return Err("could not bring the link up".into());
                }
                down_for = down_at.map(|t| t.elapsed());
                link_up_at = None;
            }
            match self.next_line(Duration::from_millis(20)) {
                Some((role, g, l)) if g == self.peer(role).gen => {
                    let i = if role == 'A' { 0 } else { 1 };
                    if let Some(rest) = l.strip_prefix("RESULT ") {
                        let r = parse_result(rest);
                        // a failed side closes at once (as NCCL aborts its
                        // communicator): its peer then sees the close
                        if r.kind != "ok" && !aborted[i] {
                            self.peer(role).send("CLOSE");
                            closed_early[i] = true;
                        }
                        results[i] = Some(r);
                        result_at[i] = Some(Instant::now());
                    } else {
                        // a side closed early says CLOSED now: keep it for later
                        kept.push((role, g, l));
                    }
                }
                _ => {}
            }
            let fault_hit = fault_at.is_some() && !survivable(fault, false);
            // past the grace after a fault, a peer still waiting is told to
            // give up: expected (its peer failed or vanished)
            if let Some(fa) = fault_at {
                if fault_hit && fa.elapsed() > grace {
                    for (i, role) in ['A', 'B'].into_iter().enumerate() {
                        if results[i].is_none() && !aborted[i] {
                            self.peer(role).send("ABORT");
                            aborted[i] = true;
                        }
                    }
                }
                if fa.elapsed() > grace + Duration::from_secs(60) {
                    self.fail_hang(format!("cycle {c} ({}): a peer did not answer ABORT within 60 s", fault.name()));
                    return Err("hang".into());
                }
            }
            // one side failed without a fault (already a failure of the
            // run): the other gets the same grace, then is told to give up
            if !fault_hit && first_fail.is_none() && results.iter().any(|r| r.as_ref().is_some_and(|r| r.kind != "ok")) {
                first_fail = Some(Instant::now());
            }
            if let Some(ff) = first_fail {
                if ff.elapsed() > grace {
                    for (i, role) in ['A', 'B'].into_iter().enumerate() {
                        if results[i].is_none() && !aborted[i] {
                            self.peer(role).send("ABORT");
                            aborted[i] = true;
                        }
                    }
                }
                if ff.elapsed() > grace + Duration::from_secs(60) {
                    self.fail_hang(format!("cycle {c}: after a failure, a peer did not answer ABORT within 60 s"));
                    return Err("hang".into());
                }
            } else if !fault_hit && start.elapsed() > cycle_t {
                self.fail_hang(format!("cycle {c} ({}, {rounds} rounds): no result within {cycle_t:?} (watchdog)", fault.name()));
                return Err("hang".into());
            }
        }
        self.pending.extend(kept);
        if let Some(t) = link_up_at.take() {
            // results came before the link came back: restore it on time
            std::thread::sleep(t.saturating_duration_since(Instant::now()));
            if !self.net.link(true) {
                return Err("could not bring the link up".into());
            }
            down_for = down_at.map(|t| t.elapsed());
        }
        // A flap is meant to be short against RUSTNET_SOCKET_TIMEOUT; on a
        // loaded machine the link commands themselves can stretch it. One
        // that lasted longer than a third of the timeout (the keepalive idle
        // time) is judged as a cut: failing then is allowed.
        // On verbs a flap takes the port down with its netdev: it counts as
        // long (a cut), which the comms survive when they recover.
        let long_flap =
            fault == Fault::Flap && (self.net == Net::Vm || down_for.is_some_and(|d| d.as_secs_f64() > self.socket_timeout as f64 / 3.0));
        if let Some(d) = down_for {
            if fault == Fault::Flap {
                self.tally.flap_down.push(d.as_secs_f64());
            }
        }
        if fault == Fault::Cut || fault == Fault::Flap {
            self.net.wait_up()?;
        }
        // close: both sides that did not close early
        for (i, role) in ['A', 'B'].into_iter().enumerate() {
            let gone = i == 1 && b_dead;
            if !(gone || closed_early[i] || aborted[i]) {
                self.peer(role).send("CLOSE");
            }
        }
        let closed = self.expect('A', &format!("CLOSED {c} "), Duration::from_secs(60));
        let closed = match closed {
            Ok(x) => x,
            Err(e) => {
                self.fail_hang(format!("cycle {c}: peer A did not close: {e}"));
                return Err("hang".into());
            }
        };
        let kv = |k: &str| closed.split_whitespace().find_map(|w| w.strip_prefix(k)).unwrap_or("").to_string();
        let n = |k: &str| kv(k).parse::<usize>().unwrap_or(0);
        self.quiet.push((self.now(), c, n("fds="), n("threads="), n("rss_kib=")));
        let mut close_errors = vec![("A", kv("close_errors="))];
        if !b_dead {
            match self.expect('B', &format!("CLOSED {c} "), Duration::from_secs(60)) {
                Ok(x) => {
                    close_errors.push(("B", x.split_whitespace().find_map(|w| w.strip_prefix("close_errors=")).unwrap_or("").to_string()))
                }
                Err(e) => {
                    self.fail_hang(format!("cycle {c}: peer B did not close: {e}"));
                    return Err("hang".into());
                }
            }
        }
        // both quiet: every comm of this cycle closed, B restarted or not.
        // The kernel's verbs objects now are what the plugin keeps between
        // comms (sampled here, not by the sampler, so the count is exact)
        if self.net == Net::Vm {
            if let Some((mr, qp)) = rdma_counts() {
                self.quiet_rdma.push((self.now(), mr, qp));
            }
        }
        // classify
        let fault_hit = fault_at.is_some() && !survivable(fault, long_flap);
        if long_flap {
            self.tally.long_flaps += 1;
        }
        self.tally.cycles += 1;
        if fault_at.is_some() {
            self.tally.faults[fault as usize] += 1;
        }
        let mut line = format!("{c},{:.1},{},{rounds}", self.now(), fault.name());
        let mut all_ok = true;
        for (i, role) in ['A', 'B'].into_iter().enumerate() {
            let r = results[i].clone().unwrap();
            self.tally.bytes_checked += r.bytes;
            self.tally.msgs_checked += r.msgs;
            let _ = write!(line, ",{},{}", r.kind, r.bytes);
            all_ok &= r.kind == "ok";
            let when = match (result_at[i], fault_at) {
                (Some(t), Some(f)) => format!(" [{:+.1} s after the fault]", signed_secs(t, f)),
                (Some(t), None) => format!(" [{:.1} s into the cycle]", t.duration_since(start).as_secs_f64()),
                _ => String::new(),
            };
            let what = format!("cycle {c} ({}) peer {role}: {} {}{when}", fault.name(), r.kind, r.detail);
            match r.kind.as_str() {
                "ok" | "killed" => {}
                "corrupt" => self.tally.corrupt.push(what),
                "aborted" if fault_hit => self.tally.expected_aborts += 1,
                "aborted" => self.tally.hangs.push(format!("{what} (no result until the watchdog, no fault this cycle)")),
                "err" if fault_hit => {
                    // the failure must be reported with the peer named
                    let err = self.peer(role).stderr_since(marks[i]);
                    // "peer <addr>: ..." (a failed comm), or the address itself (a refused connect)
                    let other = self.net.ip(if role == 'A' { 'B' } else { 'A' });
                    if err.lines().any(|l| l.contains("WARN") && (l.contains("peer ") || l.contains(other))) {
                        self.tally.named_peer += 1;
                    }
                    self.tally.expected_errors += 1;
                }
                _ => {
                    let err = self.peer(role).stderr_since(marks[i]);
                    let tail: Vec<&str> = err.lines().rev().take(8).collect();
                    // the first WARNs carry the cause; the summary keeps them
                    let first: Vec<String> = err.lines().filter(|l| l.contains("WARN")).take(3).map(|l| clip(l, 400)).collect();
                    self.tally.first_warns.push(format!("{what}\n    first WARNs: {}", first.join("\n    ")));
                    self.tally
                        .unexpected
                        .push(format!("{what}\n    stderr: {}", tail.into_iter().rev().collect::<Vec<_>>().join("\n    ")));
                }
            }
        }
        if all_ok {
            self.tally.clean_cycles += 1;
        }
        // closing a comm must succeed even after it failed
        for (role, e) in close_errors {
            if e != "none" && !e.is_empty() {
                self.tally.unexpected.push(format!("cycle {c} peer {role}: close/deregMr failed: {e}"));
            }
        }
        if fault_at.is_some() || !all_ok {
            let r = |i: usize| results[i].as_ref().map_or("-".to_string(), |r| r.kind.clone());
            let d = down_for.map_or(String::new(), |d| format!(" (link down {:.2} s)", d.as_secs_f64()));
            println!("soak: {:>6.1} s  cycle {c}: fault {}{d}, A {}, B {}", self.now(), fault.name(), r(0), r(1));
        }
        self.cycle_log += &line;
        self.cycle_log.push('\n');
        if b_dead {
            self.restart_b()?;
        }
        Ok(())
    }
}

fn pct(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    s[((s.len() - 1) as f64 * q).round() as usize]
}

fn coordinator_main() -> i32 {
    let secs = env_u64("SOAK_SECONDS", 1800);
    let out_dir = std::path::PathBuf::from(env_str("SOAK_OUT", "soak-out"));
    let _ = std::fs::create_dir_all(&out_dir);
    let max_rounds = env_u64("SOAK_MAX_ROUNDS", 24).max(1);
    let max_big = env_u64("SOAK_MAX_BIG", 4 << 20) as usize;
    let sample_s = env_u64("SOAK_SAMPLE_S", 3).max(1);
    let warmup = env_u64("SOAK_WARMUP_S", (secs / 5).clamp(30, 300)) as f64;
    let faults_on = env_str("SOAK_FAULTS", "kill,cut,flap");
    let socket_timeout = env_u64("RUSTNET_SOCKET_TIMEOUT", 3);
    // the plugin's default window; a cut lasts 2 x the socket timeout + 2 s
    let recovery_timeout = env_u64("RUSTNET_RECOVERY_TIMEOUT", 120);
    let net = match Net::setup(&env_str("SOAK_NET", "auto")) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("soak: {e}");
            return 2;
        }
    };
    let net_name = match &net {
        Net::Loopback => "loopback (lo)".to_string(),
        Net::Netns { a, b, .. } => format!("netns {a} <-> {b} (veth, 10.79.0.1/2)"),
        Net::Vm => "soft-RoCE VM: rxe0/veth0 <-> rxe1/veth1".to_string(),
    };
    if let Some(loss) = std::env::var("SOAK_LOSS").ok().filter(|l| !matches!(l.trim(), "" | "0" | "0%" | "none")) {
        if let Err(e) = net.set_loss(&loss) {
            eprintln!("soak: cannot set loss: {e}");
            net.teardown();
            return 2;
        }
    }
    let mut kinds: Vec<Fault> = Vec::new();
    for f in faults_on.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        match f {
            "kill" => kinds.push(Fault::Kill),
            "cut" | "flap" if !net.can_cut() => {
                eprintln!("soak: !! SKIPPED fault {f:?}: no link to cut on loopback (run as root with iproute2 for namespaces)")
            }
            "cut" => kinds.push(Fault::Cut),
            "flap" => kinds.push(Fault::Flap),
            "none" => {}
            other => {
                eprintln!("soak: SOAK_FAULTS: unknown fault {other:?} (kill, cut, flap)");
                return 2;
            }
        }
    }
    let peer_extra: Vec<(String, String)> = vec![
        ("RUSTNET_SOCKET_TIMEOUT".into(), socket_timeout.to_string()),
        // the harness's own message buffers always come from mmap and go back
        // on free (glibc otherwise raises its mmap threshold and keeps freed
        // multi-MiB buffers resident): RSS between cycles then shows what
        // the plugin keeps, not the allocator's caching of ours
        ("MALLOC_MMAP_THRESHOLD_".into(), "131072".into()),
        ("SOAK_SEED".into(), env_u64("SOAK_SEED", 1).to_string()),
        ("SOAK_VERSION".into(), env_u64("SOAK_VERSION", 8).to_string()),
    ];
    println!(
        "soak: {secs} s over {net_name}, transport {}, plugin {}, faults {:?}, loss {}, RUSTNET_SOCKET_TIMEOUT={socket_timeout}, \
         RUSTNET_RECOVERY_TIMEOUT={recovery_timeout}, warm-up {warmup:.0} s",
        env_str("RUSTNET_TRANSPORT", "auto"),
        driver::default_plugin_path().display(),
        kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
        env_str("SOAK_LOSS", "none")
    );
    let fault_at_ms = match parse_range(&env_str("SOAK_FAULT_AT_MS", "20-220")) {
        Some(r) => r,
        None => {
            eprintln!("soak: SOAK_FAULT_AT_MS must be LO-HI in ms (as 20-220), LO <= HI");
            net.teardown();
            return 2;
        }
    };
    let (tx, rx) = mpsc::channel();
    let a = spawn_peer(&net, 'A', 0, tx.clone(), &peer_extra);
    let b = spawn_peer(&net, 'B', 0, tx.clone(), &peer_extra);
    let pids = Arc::new(Mutex::new([a.pid, b.pid]));
    let mut co = Coordinator {
        net: net.clone(),
        t0: Instant::now(),
        tx,
        rx,
        pending: VecDeque::new(),
        a,
        b,
        peer_extra,
        pids: pids.clone(),
        markers: Vec::new(),
        tally: Tally::default(),
        quiet: Vec::new(),
        quiet_rdma: Vec::new(),
        cycle_log: "cycle,t_s,fault,rounds,a_result,a_bytes_checked,b_result,b_bytes_checked\n".into(),
        socket_timeout,
        recovers: recovery_timeout > 2 * socket_timeout + 2 + 10,
        fault_at_ms,
    };
    for role in ['A', 'B'] {
        if let Err(e) = co.expect(role, "READY", Duration::from_secs(60)) {
            eprintln!("soak: peer {role} did not start: {e}; stderr:\n{}", co.peer(role).stderr_tail(30));
            net.teardown();
            return 2;
        }
    }
    // sampler: /proc of both peers, and the kernel's verbs objects in the VM
    let stop = Arc::new(AtomicBool::new(false));
    let samples: Arc<Mutex<Vec<SampleRow>>> = Arc::default();
    let sampler = {
        let (stop, samples, pids, t0) = (stop.clone(), samples.clone(), pids.clone(), co.t0);
        let verbs = net == Net::Vm;
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let rdma = if verbs { rdma_counts() } else { None };
                let t = t0.elapsed().as_secs_f64();
                let ps = *pids.lock().unwrap();
                for (i, pid) in ps.into_iter().enumerate() {
                    if let Some((fds, threads, rss_kib)) = proc_sample(pid) {
                        let role = if i == 0 { 'A' } else { 'B' };
                        samples.lock().unwrap().push((Sample { t, role, pid, fds, threads, rss_kib }, if i == 0 { rdma } else { None }));
                    }
                }
                for _ in 0..sample_s * 10 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        })
    };
    let mut rng = Rng::new(env_u64("SOAK_SEED", 1) ^ 0x50a4);
    let fault_every = env_u64("SOAK_FAULT_EVERY_S", 20).max(1) as f64;
    let mut next_fault = fault_every / 2.0;
    let mut nfaults = 0u64;
    let mut c = 0u64;
    let mut stopped: Option<String> = None;
    let deadline = Duration::from_secs(secs);
    let mut last_report = Instant::now();
    while co.t0.elapsed() < deadline {
        // a fault every SOAK_FAULT_EVERY_S (+-50%), the kinds in turn; a
        // fault cycle is a long one, so the fault lands mid-transfer
        let due = !kinds.is_empty() && co.now() >= next_fault;
        let fault = if due { kinds[(nfaults % kinds.len() as u64) as usize] } else { Fault::None };
        if due {
            nfaults += 1;
            next_fault = co.now() + fault_every * (0.5 + rng.below(1000) as f64 / 1000.0);
        }
        let rounds = if due { 4 * max_rounds as usize } else { 1 + rng.below(max_rounds) as usize };
        if let Err(e) = co.cycle(c, fault, rounds, max_big, &mut rng) {
            stopped = Some(e);
            break;
        }
        c += 1;
        if !co.tally.corrupt.is_empty() || !co.tally.unexpected.is_empty() || !co.tally.hangs.is_empty() {
            stopped = Some("failure (see below)".into());
            break;
        }
        if last_report.elapsed() > Duration::from_secs(60) {
            last_report = Instant::now();
            let q = co.quiet.last().copied().unwrap_or_default();
            println!(
                "soak: {:>5.0} s  {} cycles  {:.2} GiB checked  faults kill/cut/flap {}/{}/{}  A quiet: {} fds {} threads {} MiB",
                co.now(),
                co.tally.cycles,
                co.tally.bytes_checked as f64 / (1u64 << 30) as f64,
                co.tally.faults[1],
                co.tally.faults[2],
                co.tally.faults[3],
                q.2,
                q.3,
                q.4 / 1024
            );
        }
    }
    let elapsed = co.now();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    for role in ['A', 'B'] {
        co.peer(role).send("QUIT");
    }
    std::thread::sleep(Duration::from_millis(300));
    for role in ['A', 'B'] {
        let _ = co.peer(role).child.kill();
        let _ = co.peer(role).child.wait();
    }
    net.teardown();

    // ---- growth of A at the quiet point between cycles, after warm-up
    let slack_fds = env_u64("SOAK_SLACK_FDS", 2) as usize;
    let slack_th = env_u64("SOAK_SLACK_THREADS", 1) as usize;
    let slack_rss = env_u64("SOAK_SLACK_RSS_MIB", 8) as usize * 1024;
    let slack_mrs = env_u64("SOAK_SLACK_MRS", 4) as usize;
    let warm: Vec<_> = co.quiet.iter().filter(|q| q.0 <= warmup).collect();
    let late: Vec<_> = co.quiet.iter().filter(|q| q.0 > warmup).collect();
    let mut growth = Vec::new();
    if !warm.is_empty() && !late.is_empty() {
        let wmax = |f: fn(&&(f64, u64, usize, usize, usize)) -> usize| warm.iter().map(f).max().unwrap();
        let lmax = |f: fn(&&(f64, u64, usize, usize, usize)) -> usize| late.iter().map(f).max().unwrap();
        let (wf, wt, wr) = (wmax(|q| q.2), wmax(|q| q.3), wmax(|q| q.4));
        let (lf, lt, lr) = (lmax(|q| q.2), lmax(|q| q.3), lmax(|q| q.4));
        if lf > wf + slack_fds {
            growth.push(format!("A's fds between cycles grew from at most {wf} in warm-up to {lf} (bound +{slack_fds})"));
        }
        if lt > wt + slack_th {
            growth.push(format!("A's threads between cycles grew from at most {wt} in warm-up to {lt} (bound +{slack_th})"));
        }
        if lr > wr + slack_rss {
            growth.push(format!(
                "A's RSS between cycles grew from at most {} KiB in warm-up to {lr} KiB (bound +{} MiB)",
                wr,
                slack_rss / 1024
            ));
        }
    } else if stopped.is_none() {
        growth.push(format!("too few cycles to judge growth ({} in warm-up, {} after)", warm.len(), late.len()));
    }
    let samples = samples.lock().unwrap().clone();
    let mrs: Vec<(f64, usize, usize)> = samples.iter().filter_map(|(s, r)| r.map(|(m, q)| (s.t, m, q))).collect();
    if !co.quiet_rdma.is_empty() {
        let q = &co.quiet_rdma;
        for (k, name) in [(1usize, "MRs"), (2, "QPs")] {
            let get = |x: &(f64, usize, usize)| if k == 1 { x.1 } else { x.2 };
            let w = q.iter().filter(|m| m.0 <= warmup).map(get).max().unwrap_or(0);
            let l = q.iter().filter(|m| m.0 > warmup).map(get).max().unwrap_or(0);
            if l > w + slack_mrs {
                growth.push(format!("kernel {name} between cycles grew from at most {w} in warm-up to {l} (bound +{slack_mrs})"));
            }
        }
    }

    // ---- outputs: CSVs, SVG, summary
    let mut csv = String::from("t_s,role,pid,fds,threads,rss_kib,kernel_mrs,kernel_qps\n");
    for (s, r) in &samples {
        let (m, q) = r.map(|(m, q)| (m.to_string(), q.to_string())).unwrap_or_default();
        let _ = writeln!(csv, "{:.1},{},{},{},{},{},{m},{q}", s.t, s.role, s.pid, s.fds, s.threads, s.rss_kib);
    }
    let _ = std::fs::write(out_dir.join("soak-samples.csv"), csv);
    let _ = std::fs::write(out_dir.join("soak-cycles.csv"), &co.cycle_log);
    let mut quiet_csv = String::from("t_s,cycle,a_fds,a_threads,a_rss_kib\n");
    for q in &co.quiet {
        let _ = writeln!(quiet_csv, "{:.1},{},{},{},{}", q.0, q.1, q.2, q.3, q.4);
    }
    let _ = std::fs::write(out_dir.join("soak-quiet.csv"), quiet_csv);
    let series = |role: char, f: fn(&Sample) -> f64, color: &str| rustnet_tools::svg::Series {
        name: format!("peer {role}"),
        color: color.into(),
        points: samples.iter().filter(|(s, _)| s.role == role).map(|(s, _)| (s.t, f(s))).collect(),
    };
    let quiet_series = |f: fn(&(f64, u64, usize, usize, usize)) -> f64| rustnet_tools::svg::Series {
        name: "A between cycles".into(),
        color: "#2a7".into(),
        points: co.quiet.iter().map(|q| (q.0, f(q))).collect(),
    };
    let gap = (sample_s as f64) * 3.0;
    let mut panels = vec![
        rustnet_tools::svg::Panel {
            title: "open fds".into(),
            series: vec![series('A', |s| s.fds as f64, "#1f5fbf"), series('B', |s| s.fds as f64, "#d08000"), quiet_series(|q| q.2 as f64)],
        },
        rustnet_tools::svg::Panel {
            title: "threads".into(),
            series: vec![
                series('A', |s| s.threads as f64, "#1f5fbf"),
                series('B', |s| s.threads as f64, "#d08000"),
                quiet_series(|q| q.3 as f64),
            ],
        },
        rustnet_tools::svg::Panel {
            title: "RSS (MiB)".into(),
            series: vec![
                series('A', |s| s.rss_kib as f64 / 1024.0, "#1f5fbf"),
                series('B', |s| s.rss_kib as f64 / 1024.0, "#d08000"),
                quiet_series(|q| q.4 as f64 / 1024.0),
            ],
        },
    ];
    if !mrs.is_empty() {
        panels.push(rustnet_tools::svg::Panel {
            title: "kernel verbs objects, both peers (rdma res)".into(),
            series: vec![
                rustnet_tools::svg::Series {
                    name: "MRs".into(),
                    color: "#7030a0".into(),
                    points: mrs.iter().map(|m| (m.0, m.1 as f64)).collect(),
                },
                rustnet_tools::svg::Series {
                    name: "QPs".into(),
                    color: "#a03030".into(),
                    points: mrs.iter().map(|m| (m.0, m.2 as f64)).collect(),
                },
            ],
        });
    }
    let markers: Vec<rustnet_tools::svg::Marker> = co
        .markers
        .iter()
        .map(|(t, f)| rustnet_tools::svg::Marker {
            x: *t,
            color: match f {
                Fault::Kill => "#d00000",
                Fault::Cut => "#000000",
                _ => "#909090",
            }
            .into(),
            label: f.name().into(),
        })
        .collect();
    let title = format!("rustnet soak: {:.0} s, {} cycles over {net_name}", elapsed, co.tally.cycles);
    let _ = std::fs::write(out_dir.join("soak.svg"), rustnet_tools::svg::panels(&title, "seconds", &panels, &markers, gap));

    let t = &co.tally;
    let stat = |role: char, f: fn(&Sample) -> usize| -> String {
        let v: Vec<usize> = samples.iter().filter(|(s, _)| s.role == role).map(|(s, _)| f(s)).collect();
        match (v.first(), v.last(), v.iter().max()) {
            (Some(a), Some(b), Some(m)) => format!("{a} / {b} / {m}"),
            _ => "-".into(),
        }
    };
    let quiet_stat = |f: fn(&(f64, u64, usize, usize, usize)) -> usize| -> String {
        let v: Vec<usize> = co.quiet.iter().map(f).collect();
        match (v.first(), v.last(), v.iter().max()) {
            (Some(a), Some(b), Some(m)) => format!("{a} / {b} / {m}"),
            _ => "-".into(),
        }
    };
    let cyc_secs: Vec<f64> = {
        let ts: Vec<f64> = co.quiet.iter().map(|q| q.0).collect();
        ts.windows(2).map(|w| w[1] - w[0]).collect()
    };
    let failed = stopped.is_some() || !t.corrupt.is_empty() || !t.unexpected.is_empty() || !t.hangs.is_empty() || !growth.is_empty();
    let mut md = String::new();
    let _ = writeln!(md, "| soak | |\n|---|---|");
    let _ =
        writeln!(md, "| network | {net_name}, transport {}, loss {} |", env_str("RUSTNET_TRANSPORT", "auto"), env_str("SOAK_LOSS", "none"));
    let _ = writeln!(md, "| duration | {elapsed:.0} s (asked {secs} s) |");
    let _ = writeln!(
        md,
        "| cycles (connect, traffic, close) | {} ({} with every side ok); cycle time median {:.2} s, range {:.2}-{:.2} s |",
        t.cycles,
        t.clean_cycles,
        pct(&cyc_secs, 0.5),
        pct(&cyc_secs, 0.0),
        pct(&cyc_secs, 1.0)
    );
    let _ = writeln!(
        md,
        "| bytes checked | {} ({:.2} GiB) in {} messages of 0 B..{} KiB, grouped receives of 1..8 |",
        t.bytes_checked,
        t.bytes_checked as f64 / (1u64 << 30) as f64,
        t.msgs_checked,
        max_big >> 10
    );
    let flaps = if t.flap_down.is_empty() {
        "none happened".to_string()
    } else {
        format!(
            "{} ms asked, down {:.2}-{:.2} s, median {:.2}; {} judged as cuts: longer than timeout/3, or on verbs, \
             where the port goes down with the link (survived, as a cut, by comms that recover)",
            FLAP.as_millis(),
            pct(&t.flap_down, 0.0),
            pct(&t.flap_down, 1.0),
            pct(&t.flap_down, 0.5),
            t.long_flaps
        )
    };
    let _ = writeln!(
        md,
        "| faults injected | {} kill+restart of B, {} link cut ({} s down; {}), {} link flap ({flaps}); {} of them mid-transfer |",
        t.faults[1],
        t.faults[2],
        2 * socket_timeout + 2,
        if co.recovers { "to be survived: RUSTNET_RECOVERY_TIMEOUT outlasts it" } else { "both ends must fail" },
        t.faults[3],
        t.in_flight
    );
    let _ = writeln!(
        md,
        "| errors expected | {} (a WARN named the peer in {}), {} peers told to give up after a fault |",
        t.expected_errors, t.named_peer, t.expected_aborts
    );
    let _ = writeln!(md, "| errors unexpected | {} |", t.unexpected.len());
    let _ = writeln!(md, "| corrupted or lost bytes | {} |", t.corrupt.len());
    let _ = writeln!(md, "| hangs (watchdog) | {} |", t.hangs.len());
    let _ = writeln!(md, "| A fds start / end / max (sampled) | {} |", stat('A', |s| s.fds));
    let _ = writeln!(md, "| A threads start / end / max (sampled) | {} |", stat('A', |s| s.threads));
    let _ = writeln!(md, "| A RSS KiB start / end / max (sampled) | {} |", stat('A', |s| s.rss_kib));
    let _ = writeln!(
        md,
        "| A between cycles: fds / threads / RSS KiB (start / end / max) | {} ; {} ; {} |",
        quiet_stat(|q| q.2),
        quiet_stat(|q| q.3),
        quiet_stat(|q| q.4)
    );
    let _ = writeln!(
        md,
        "| B (restarted on kills) fds / threads / RSS KiB (start / end / max) | {} ; {} ; {} |",
        stat('B', |s| s.fds),
        stat('B', |s| s.threads),
        stat('B', |s| s.rss_kib)
    );
    if !co.quiet_rdma.is_empty() {
        let q = &co.quiet_rdma;
        let _ = writeln!(
            md,
            "| kernel MRs / QPs between cycles, both peers (start / end / max) | {} / {} / {} ; {} / {} / {} |",
            q[0].1,
            q[q.len() - 1].1,
            q.iter().map(|x| x.1).max().unwrap(),
            q[0].2,
            q[q.len() - 1].2,
            q.iter().map(|x| x.2).max().unwrap()
        );
    }
    if mrs.is_empty() {
        let _ = writeln!(md, "| registrations | not sampled: TCP registers nothing with the kernel, and the plugin exposes no count |");
    } else {
        let v: Vec<usize> = mrs.iter().map(|m| m.1).collect();
        let q: Vec<usize> = mrs.iter().map(|m| m.2).collect();
        let _ = writeln!(
            md,
            "| kernel MRs / QPs, both peers (rdma res, sampled) start / end / max | {} / {} / {} ; {} / {} / {} |",
            v[0],
            v[v.len() - 1],
            v.iter().max().unwrap(),
            q[0],
            q[q.len() - 1],
            q.iter().max().unwrap()
        );
    }
    let _ = writeln!(
        md,
        "| growth after warm-up ({warmup:.0} s) | {} |",
        if growth.is_empty() { "none beyond the bound".to_string() } else { growth.join("; ") }
    );
    if net == Net::Vm {
        // what the soft-RoCE devices counted: retransmissions, sequence
        // errors, NAKs (non-zero counters only)
        for d in ["rxe0", "rxe1"] {
            let dir = format!("/sys/class/infiniband/{d}/ports/1/hw_counters");
            let mut v: Vec<String> = std::fs::read_dir(&dir)
                .map(|rd| {
                    rd.filter_map(|e| {
                        let e = e.ok()?;
                        let n: u64 = std::fs::read_to_string(e.path()).ok()?.trim().parse().ok()?;
                        (n > 0).then(|| format!("{} {n}", e.file_name().to_string_lossy()))
                    })
                    .collect()
                })
                .unwrap_or_default();
            v.sort();
            let _ = writeln!(md, "| {d} hw_counters (non-zero) | {} |", v.join(", "));
        }
    }
    let _ = writeln!(md, "| verdict | {} |", if failed { "FAIL" } else { "PASS" });
    // a CI log keeps only its tail: the causes go into the summary, which
    // scripts/soak.sh prints last
    if !t.first_warns.is_empty() {
        let _ = writeln!(md, "\nUnexpected errors (up to 4), each with its side's first WARNs:\n```");
        for e in t.first_warns.iter().take(4) {
            let _ = writeln!(md, "{e}");
        }
        let _ = writeln!(md, "```");
    }
    let _ = std::fs::write(out_dir.join("soak-summary.md"), &md);
    println!("\n{md}");
    for (what, v) in [("UNEXPECTED", &t.unexpected), ("CORRUPT", &t.corrupt), ("HANG", &t.hangs), ("GROWTH", &growth)] {
        for e in v.iter().take(5) {
            println!("{what}: {e}");
        }
    }
    if let Some(s) = &stopped {
        println!("soak: stopped early: {s}");
    }
    println!("soak: outputs in {}: soak-summary.md soak-samples.csv soak-cycles.csv soak-quiet.csv soak.svg", out_dir.display());
    println!("soak: {}", if failed { "FAIL" } else { "PASS" });
    i32::from(failed)
}

/// "LO-HI" (or one number) with LO <= HI.
fn parse_range(v: &str) -> Option<(u64, u64)> {
    let (lo, hi) = v.split_once('-').unwrap_or((v, v));
    let (lo, hi) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
    (lo <= hi).then_some((lo, hi))
}

/// `t - f` in seconds, negative when `t` came first.
fn signed_secs(t: Instant, f: Instant) -> f64 {
    if t >= f {
        t.duration_since(f).as_secs_f64()
    } else {
        -f.duration_since(t).as_secs_f64()
    }
}

/// At most `n` bytes of `l` (cut on a character boundary).
fn clip(l: &str, n: usize) -> String {
    if l.len() <= n {
        return l.to_string();
    }
    let mut k = n;
    while !l.is_char_boundary(k) {
        k -= 1;
    }
    format!("{}...", &l[..k])
}

fn main() {
    if let Ok(role) = std::env::var("SOAK_ROLE") {
        peer_main(role);
        return;
    }
    std::process::exit(coordinator_main());
}
