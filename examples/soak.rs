//! Soak: two peer processes drive the built `librustnet.so` through its
//! vtable (the `rustnet_tools::driver` stand-in for NCCL) for a given time, cycle
//! after cycle: listen, swap handles, connect+accept, both directions at once
//! with grouped receives of 0 B to several MiB, every byte checked against a
//! pattern derived from (cycle, round, buffer), close. Between cycles the
//! coordinator injects faults: peer B killed (SIGKILL) and restarted, the
//! link cut for longer than RUSTNET_SOCKET_TIMEOUT (both ends must fail) or
//! flapped for 0.5 s (over TCP both ends must survive, every byte intact;
//! over verbs the port goes down with the link and the plugin fails the
//! comms on IBV_EVENT_PORT_ERR by design -- NCCL's net_ib only warns --
//! so there the errors count as expected). fds, threads,
//! RSS (and, on verbs, the kernel's MR/QP counts from `rdma res`) of both
//! peers are sampled every few seconds into a CSV and an SVG plot.
//!
//! Run through `scripts/soak.sh` (which builds and sets the network up); by
//! hand: `cargo build --release --examples && target/release/examples/soak`.
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
//! SOAK_FAULT_EVERY_S (20, +-50%),
//! SOAK_CYCLE_TIMEOUT_S (120), SOAK_SLACK_FDS (2), SOAK_SLACK_THREADS (1),
//! SOAK_SLACK_RSS_MIB (8), SOAK_SLACK_MRS (4).
#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rustnet_tools::driver::{self, hex, unhex, Plugin, Ptr};

fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn env_str(k: &str, d: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| d.to_string())
}

// ------------------------------------------------------------------ peer side

/// Per-cycle seed of a sender: the pattern of every byte follows from it and
/// the (round, buffer) sequence numbers.
fn cycle_seed(base: u64, cycle: u64, role: &str) -> u64 {
    base.wrapping_mul(1_000_003) ^ (cycle << 24) ^ if role == "A" { 0xA } else { 0xB }
}

struct SendSlot {
    req: Ptr,
    _buf: Vec<u8>,
    mh: Ptr,
    round: usize,
}

struct RecvSlot {
    round: usize,
    req: Ptr,
    bufs: Vec<Vec<u8>>,
    mhs: Vec<Ptr>,
}

/// What a cycle leaves to clean up, whatever its outcome.
#[derive(Default)]
struct Live {
    s: Option<Ptr>,
    r: Option<Ptr>,
    l: Option<Ptr>,
    sends: Vec<SendSlot>,
    recvs: Vec<RecvSlot>,
}

enum Outcome {
    Ok,
    Err(String),
    Corrupt(String),
    Aborted(&'static str),
}

struct Counters {
    bytes_checked: u64,
    msgs_checked: u64,
    bytes_sent: u64,
}

struct PeerCtx {
    p: Plugin,
    dev: i32,
    max_recvs: usize,
    rx: Receiver<String>,
}

impl PeerCtx {
    /// A line from the coordinator arrived (only ABORT is ever sent mid-cycle).
    fn aborted(&self) -> bool {
        self.rx.try_recv().is_ok()
    }
}

fn say(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{s}");
    let _ = o.flush();
}

#[allow(clippy::too_many_arguments)]
fn traffic(ctx: &PeerCtx, live: &mut Live, my_seed: u64, peer_seed: u64, rounds: usize, max_big: usize, c: &mut Counters) -> Outcome {
    let (p, s, r) = (&ctx.p, live.s.unwrap(), live.r.unwrap());
    let send_plan = plan(my_seed, rounds, ctx.max_recvs, max_big);
    let recv_plan = plan(peer_seed, rounds, ctx.max_recvs, max_big);
    let window = 4usize;
    let mut next_send = (0usize, 0usize);
    let mut next_recv = 0usize;
    let mut recv_done = 0usize;
    let mut sent_rounds_done = 0usize;
    let mut sends_done_per_round = vec![0usize; rounds];
    let mut spin = 0u32;
    while recv_done < rounds || sent_rounds_done < rounds {
        spin = spin.wrapping_add(1);
        if spin.is_multiple_of(64) && ctx.aborted() {
            return Outcome::Aborted("traffic");
        }
        while next_recv < rounds && live.recvs.len() < window {
            let rd = &recv_plan[next_recv];
            let mut bufs: Vec<Vec<u8>> = rd.msgs.iter().map(|m| vec![CANARY; m.cap + CANARY_LEN]).collect();
            let mut mhs = Vec::new();
            for b in &mut bufs {
                match p.reg_mr(r, b.as_mut_ptr(), b.len()) {
                    Ok(m) => mhs.push(m),
                    Err(e) => {
                        for m in mhs {
                            let _ = p.dereg_mr(r, m);
                        }
                        return Outcome::Err(e.to_string());
                    }
                }
            }
            let spec: Vec<_> =
                rd.msgs.iter().zip(bufs.iter_mut()).zip(&mhs).map(|((m, b), mh)| (b.as_mut_ptr(), m.cap, m.tag, *mh)).collect();
            match p.irecv(r, &spec) {
                Ok(Some(req)) => {
                    live.recvs.push(RecvSlot { round: next_recv, req, bufs, mhs });
                    next_recv += 1;
                }
                Ok(None) => {
                    for mh in mhs {
                        let _ = p.dereg_mr(r, mh);
                    }
                    break;
                }
                Err(e) => {
                    for mh in mhs {
                        let _ = p.dereg_mr(r, mh);
                    }
                    return Outcome::Err(e.to_string());
                }
            }
        }
        while next_send.0 < rounds && next_send.0 < sent_rounds_done + window {
            let (ri, k) = next_send;
            let rd = &send_plan[ri];
            let idx = rd.send_order[k];
            let m = rd.msgs[idx];
            let mut buf = vec![0u8; m.size.max(1)];
            fill(&mut buf[..m.size], my_seed, ri, idx);
            let mh = match p.reg_mr(s, buf.as_mut_ptr(), buf.len()) {
                Ok(m) => m,
                Err(e) => return Outcome::Err(e.to_string()),
            };
            match p.isend(s, buf.as_mut_ptr(), m.size, m.tag, mh) {
                Ok(Some(req)) => {
                    live.sends.push(SendSlot { req, _buf: buf, mh, round: ri });
                    c.bytes_sent += m.size as u64;
                    next_send = if k + 1 == rd.send_order.len() { (ri + 1, 0) } else { (ri, k + 1) };
                }
                Ok(None) => {
                    let _ = p.dereg_mr(s, mh);
                    break;
                }
                Err(e) => {
                    let _ = p.dereg_mr(s, mh);
                    return Outcome::Err(e.to_string());
                }
            }
        }
        let mut i = 0;
        while i < live.sends.len() {
            match p.test(live.sends[i].req, &mut [0i32; 1]) {
                Ok(true) => {
                    let ss = live.sends.swap_remove(i);
                    if let Err(e) = p.dereg_mr(s, ss.mh) {
                        return Outcome::Err(e.to_string());
                    }
                    sends_done_per_round[ss.round] += 1;
                    while sent_rounds_done < rounds && sends_done_per_round[sent_rounds_done] == send_plan[sent_rounds_done].msgs.len() {
                        sent_rounds_done += 1;
                    }
                }
                Ok(false) => i += 1,
                Err(e) => return Outcome::Err(e.to_string()),
            }
        }
        // receives complete in posting order; test the oldest first
        let mut i = 0;
        while i < live.recvs.len() {
            let mut sizes = [-1i32; 8];
            match p.test(live.recvs[i].req, &mut sizes) {
                Ok(true) => {
                    let rs = live.recvs.remove(i);
                    let rd = &recv_plan[rs.round];
                    for (j, m) in rd.msgs.iter().enumerate() {
                        if sizes[j] != m.size as i32 {
                            return Outcome::Corrupt(format!(
                                "round {} buffer {j}: test reported {} bytes, peer sent {}",
                                rs.round, sizes[j], m.size
                            ));
                        }
                        if let Some(off) = check(&rs.bufs[j][..m.size], peer_seed, rs.round, j) {
                            return Outcome::Corrupt(format!(
                                "round {} buffer {j} (tag {}, {} bytes): data differs at offset {off}",
                                rs.round, m.tag, m.size
                            ));
                        }
                        if let Some(off) = rs.bufs[j][m.size..].iter().position(|&b| b != CANARY) {
                            return Outcome::Corrupt(format!(
                                "round {} buffer {j}: canary overwritten {off} bytes past the {}-byte message",
                                rs.round, m.size
                            ));
                        }
                        c.bytes_checked += m.size as u64;
                        c.msgs_checked += 1;
                    }
                    for mh in rs.mhs {
                        if let Err(e) = p.dereg_mr(r, mh) {
                            return Outcome::Err(e.to_string());
                        }
                    }
                    recv_done += 1;
                }
                Ok(false) => i += 1,
                Err(e) => return Outcome::Err(e.to_string()),
            }
        }
    }
    Outcome::Ok
}

/// Deregister, close, and only then free the buffers (a failed comm may
/// still have requests in flight on them until it is closed).
fn cleanup(ctx: &PeerCtx, live: &mut Live) -> Vec<String> {
    let p = &ctx.p;
    let mut errs = Vec::new();
    if let Some(s) = live.s {
        for ss in &live.sends {
            if let Err(e) = p.dereg_mr(s, ss.mh) {
                errs.push(e.to_string());
            }
        }
    }
    if let Some(r) = live.r {
        for rs in &live.recvs {
            for &mh in &rs.mhs {
                if let Err(e) = p.dereg_mr(r, mh) {
                    errs.push(e.to_string());
                }
            }
        }
    }
    if let Some(s) = live.s.take() {
        if let Err(e) = p.close_send(s) {
            errs.push(e.to_string());
        }
    }
    if let Some(r) = live.r.take() {
        if let Err(e) = p.close_recv(r) {
            errs.push(e.to_string());
        }
    }
    if let Some(l) = live.l.take() {
        if let Err(e) = p.close_listen(l) {
            errs.push(e.to_string());
        }
    }
    live.sends.clear();
    live.recvs.clear();
    errs
}

fn peer_main(role: String) {
    let version = env_u64("SOAK_VERSION", 8) as u32;
    let base_seed = env_u64("SOAK_SEED", 1);
    let so = driver::default_plugin_path();
    let p = Plugin::open(&so, version).unwrap_or_else(|e| panic!("{e}"));
    if let Err(e) = p.init() {
        say(&format!("INITFAIL {e}"));
        std::process::exit(1);
    }
    let dev = env_u64("SOAK_DEV", 0) as i32;
    let max_recvs = p.properties(dev).map(|x| x.max_recvs.clamp(1, 8) as usize).unwrap_or(1);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
        // coordinator gone: nothing left to do
        std::process::exit(0);
    });
    let ctx = PeerCtx { p, dev, max_recvs, rx };
    say(&format!("READY {}", std::process::id()));
    let wait = |want: &str| -> Option<String> {
        loop {
            let l = ctx.rx.recv().ok()?;
            if l == "QUIT" {
                std::process::exit(0);
            }
            if let Some(rest) = l.strip_prefix(want) {
                return Some(rest.trim().to_string());
            }
            if l == "ABORT" {
                return None;
            }
        }
    };
    loop {
        // CYCLE <c> <rounds> <max_big>
        let Some(args) = wait("CYCLE ") else { continue };
        let v: Vec<u64> = args.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        let (cycle, rounds, max_big) = (v[0], v[1] as usize, v[2] as usize);
        let mut live = Live::default();
        let mut c = Counters { bytes_checked: 0, msgs_checked: 0, bytes_sent: 0 };
        let outcome = 'cycle: {
            let (h, l) = match ctx.p.listen(ctx.dev) {
                Ok(x) => x,
                Err(e) => break 'cycle Outcome::Err(e.to_string()),
            };
            live.l = Some(l);
            say(&format!("HANDLE {cycle} {}", hex(&h)));
            let Some(peer) = wait("PEER ") else { break 'cycle Outcome::Aborted("handles") };
            let mut ph = [0u8; 128];
            ph.copy_from_slice(&unhex(&peer).expect("peer handle hex"));
            let mut spin = 0u32;
            while live.s.is_none() || live.r.is_none() {
                if live.s.is_none() {
                    match ctx.p.connect(ctx.dev, &mut ph) {
                        Ok(x) => live.s = x,
                        Err(e) => break 'cycle Outcome::Err(e.to_string()),
                    }
                }
                if live.r.is_none() {
                    match ctx.p.accept(l) {
                        Ok(x) => live.r = x,
                        Err(e) => break 'cycle Outcome::Err(e.to_string()),
                    }
                }
                spin = spin.wrapping_add(1);
                if spin.is_multiple_of(64) && ctx.aborted() {
                    break 'cycle Outcome::Aborted("setup");
                }
                if live.s.is_none() || live.r.is_none() {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            let (mine, theirs) = (cycle_seed(base_seed, cycle, &role), cycle_seed(base_seed, cycle, if role == "A" { "B" } else { "A" }));
            traffic(&ctx, &mut live, mine, theirs, rounds, max_big, &mut c)
        };
        let counts = format!("bytes={} msgs={} sent={}", c.bytes_checked, c.msgs_checked, c.bytes_sent);
        let aborted_by_coordinator = matches!(outcome, Outcome::Aborted(_));
        match outcome {
            Outcome::Ok => say(&format!("RESULT {cycle} ok {counts}")),
            Outcome::Err(e) => say(&format!("RESULT {cycle} err {counts} {e}")),
            Outcome::Corrupt(e) => say(&format!("RESULT {cycle} corrupt {counts} {e}")),
            Outcome::Aborted(stage) => say(&format!("RESULT {cycle} aborted {counts} stage={stage}")),
        }
        // both sides done (or given up) before anyone closes; an ABORT
        // already consumed counts as the CLOSE
        if !aborted_by_coordinator {
            let _ = wait("CLOSE");
        }
        let errs = cleanup(&ctx, &mut live);
        say(&format!(
            "CLOSED {cycle} fds={} threads={} rss_kib={} close_errors={}",
            fd_count(),
            thread_count(),
            rss_kib(),
            if errs.is_empty() { "none".to_string() } else { errs.join("; ").replace(' ', "_") }
        ));
    }
}

// ------------------------------------------------------------- coordinator

/// How the two peers are wired, and how the link is cut.
#[derive(Clone, PartialEq)]
enum Net {
    /// Both on `lo`: no link to cut (said loudly).
    Loopback,
    /// Two namespaces and a veth pair (root and iproute2).
    Netns { a: String, b: String, ia: String, ib: String },
    /// Inside tests/rxe-vm: rxe0 on veth0, rxe1 on veth1, one namespace.
    Vm,
}

fn sh(cmd: &str) -> bool {
    Command::new("sh").arg("-c").arg(cmd).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

fn sh_out(cmd: &str) -> String {
    Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

impl Net {
    fn setup(kind: &str) -> Result<Net, String> {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let kind = match kind {
            "auto" if std::env::var_os("RXE_VM_DEVICES").is_some() => "vm",
            "auto" if root && sh("ip netns list") => "netns",
            "auto" => "loopback",
            k => k,
        };
        match kind {
            "loopback" => Ok(Net::Loopback),
            "vm" => Ok(Net::Vm),
            "netns" => {
                let id = std::process::id() % 100000;
                let (a, b) = (format!("rnsoakA{id}"), format!("rnsoakB{id}"));
                let (ia, ib) = (format!("rsA{id}"), format!("rsB{id}"));
                let n = Net::Netns { a: a.clone(), b: b.clone(), ia: ia.clone(), ib: ib.clone() };
                let ok = sh(&format!("ip netns add {a}"))
                    && sh(&format!("ip netns add {b}"))
                    && sh(&format!("ip link add {ia} netns {a} type veth peer name {ib} netns {b}"))
                    && sh(&format!("ip -n {a} addr add 10.79.0.1/24 dev {ia} && ip -n {a} link set {ia} up && ip -n {a} link set lo up"))
                    && sh(&format!("ip -n {b} addr add 10.79.0.2/24 dev {ib} && ip -n {b} link set {ib} up && ip -n {b} link set lo up"));
                if !ok {
                    n.teardown();
                    return Err("could not build the namespace pair (ip netns/veth)".into());
                }
                n.wait_up()?;
                Ok(n)
            }
            k => Err(format!("SOAK_NET={k}: expected auto, loopback, netns or vm")),
        }
    }
    fn teardown(&self) {
        if let Net::Netns { a, b, .. } = self {
            sh(&format!("ip netns del {a}"));
            sh(&format!("ip netns del {b}"));
        }
        if *self == Net::Vm {
            sh("tc qdisc del dev veth0 root; tc qdisc del dev veth1 root");
        }
    }
    /// The out-of-band address of a peer (what its errors name).
    fn ip(&self, role: char) -> &'static str {
        match (self, role) {
            (Net::Loopback, _) => "127.0.0.1",
            (Net::Netns { .. }, 'A') => "10.79.0.1",
            (Net::Netns { .. }, _) => "10.79.0.2",
            (Net::Vm, 'A') => "10.199.0.1",
            (Net::Vm, _) => "10.199.0.2",
        }
    }
    fn can_cut(&self) -> bool {
        *self != Net::Loopback
    }
    /// The link command for A's end (the one cut).
    fn link(&self, up: bool) -> bool {
        let st = if up { "up" } else { "down" };
        match self {
            Net::Loopback => false,
            // ip itself, no shell: on a loaded machine every exec counts
            // against the length of a short flap
            Net::Netns { a, ia, .. } => Command::new("ip").args(["-n", a, "link", "set", ia, st]).status().is_ok_and(|s| s.success()),
            // taking veth1 down flushes its routes, among them the policy
            // route tests/rxe-vm/guest.sh added (table 101): put it back
            Net::Vm if up => sh("ip link set veth1 up && ip route replace 10.199.0.1 dev veth1 src 10.199.0.2 table 101"),
            Net::Vm => sh("ip link set veth1 down"),
        }
    }
    fn wait_up(&self) -> Result<(), String> {
        let t0 = Instant::now();
        let ready = || match self {
            Net::Loopback => true,
            Net::Netns { a, b, ia, ib } => {
                sh(&format!("ip -n {a} link show dev {ia} | grep -q LOWER_UP"))
                    && sh(&format!("ip -n {b} link show dev {ib} | grep -q LOWER_UP"))
            }
            // the rxe ports follow their netdevs: ACTIVE again, IPv4 GID back
            Net::Vm => (0..2).all(|d| {
                let p = format!("/sys/class/infiniband/rxe{d}/ports/1");
                std::fs::read_to_string(format!("{p}/state")).is_ok_and(|s| s.contains("ACTIVE"))
                    && (0..8).any(|i| {
                        std::fs::read_to_string(format!("{p}/gids/{i}")).is_ok_and(|g| g.starts_with("0000:0000:0000:0000:0000:ffff:"))
                    })
            }),
        };
        while !ready() {
            if t0.elapsed() > Duration::from_secs(30) {
                return Err("the link did not come back within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
    fn set_loss(&self, loss: &str) -> Result<(), String> {
        let devs: Vec<String> = match self {
            Net::Loopback => return Err("SOAK_LOSS needs a link (netns or vm), not loopback".into()),
            Net::Netns { a, b, ia, ib } => vec![format!("-n {a} qdisc replace dev {ia}"), format!("-n {b} qdisc replace dev {ib}")],
            Net::Vm => vec!["qdisc replace dev veth0".into(), "qdisc replace dev veth1".into()],
        };
        for d in devs {
            let cmd = format!("tc {d} root netem loss {loss}");
            let out = Command::new("sh").arg("-c").arg(&cmd).output().map_err(|e| e.to_string())?;
            if !out.status.success() {
                return Err(format!("{cmd}: {}", String::from_utf8_lossy(&out.stderr).trim()));
            }
        }
        Ok(())
    }
    /// Peer environment and the netns to run in.
    fn peer_env(&self, role: &str) -> (Option<String>, Vec<(String, String)>) {
        let kv = |k: &str, v: &str| (k.to_string(), v.to_string());
        match self {
            Net::Loopback => (None, vec![kv("NCCL_SOCKET_IFNAME", "lo")]),
            Net::Netns { a, b, ia, ib } => {
                if role == "A" {
                    (Some(a.clone()), vec![kv("NCCL_SOCKET_IFNAME", ia)])
                } else {
                    (Some(b.clone()), vec![kv("NCCL_SOCKET_IFNAME", ib)])
                }
            }
            Net::Vm => {
                let (hca, ifn) = if role == "A" { ("=rxe0", "veth0") } else { ("=rxe1", "veth1") };
                (None, vec![kv("NCCL_IB_HCA", hca), kv("NCCL_SOCKET_IFNAME", ifn)])
            }
        }
    }
}

/// A peer process; its stdout lines arrive on the coordinator's one channel
/// tagged with (role, generation), so lines of a killed B are told apart.
struct Proc {
    child: Child,
    stdin: ChildStdin,
    pid: u32,
    gen: u32,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl Proc {
    fn send(&mut self, line: &str) {
        let _ = writeln!(self.stdin, "{line}");
        let _ = self.stdin.flush();
    }
    fn stderr_since(&self, mark: usize) -> String {
        let g = self.stderr.lock().unwrap();
        g.iter().skip(mark.min(g.len())).cloned().collect::<Vec<_>>().join("\n")
    }
    fn stderr_len(&self) -> usize {
        self.stderr.lock().unwrap().len()
    }
    fn stderr_tail(&self, n: usize) -> String {
        let g = self.stderr.lock().unwrap();
        g.iter().skip(g.len().saturating_sub(n)).cloned().collect::<Vec<_>>().join("\n")
    }
}

type Line = (char, u32, String);

fn spawn_peer(net: &Net, role: char, gen: u32, tx: Sender<Line>, extra: &[(String, String)]) -> Proc {
    let (ns, env) = net.peer_env(&role.to_string());
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match &ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.env("SOAK_ROLE", role.to_string()).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env.iter().chain(extra) {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn peer");
    let pid = child.id();
    let stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if tx.send((role, gen, l)).is_err() {
                break;
            }
        }
    });
    let err = Arc::new(Mutex::new(VecDeque::new()));
    let e2 = err.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines() {
            let Ok(l) = l else { break };
            let mut g = e2.lock().unwrap();
            g.push_back(l);
            // keep the recent past only; the index of the first kept line
            // moves, which stderr_since tolerates (a mark past the end = new lines only)
            if g.len() > 20_000 {
                g.drain(..10_000);
            }
        }
    });
    Proc { child, stdin, pid, gen, stderr: err }
}

/// How long a flap takes the link down: well under RUSTNET_SOCKET_TIMEOUT.
const FLAP: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, PartialEq, Debug)]
enum Fault {
    None,
    Kill,
    Cut,
    Flap,
}

impl Fault {
    fn name(self) -> &'static str {
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
struct Sample {
    t: f64,
    role: char,
    pid: u32,
    fds: usize,
    threads: usize,
    rss_kib: usize,
}

/// A sample and, for A's row on verbs, the kernel's (MRs, QPs) at that time.
type SampleRow = (Sample, Option<(usize, usize)>);

fn proc_sample(pid: u32) -> Option<(usize, usize, usize)> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    let th = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.count();
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = st.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())?;
    Some((fds, th, rss))
}

/// Kernel verbs objects in use (summed over devices): (MRs, QPs), from
/// `rdma res show` -- the plugin itself exposes no registration count.
fn rdma_counts() -> Option<(usize, usize)> {
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
        let mut closed_early = [false, false];
        let mut aborted = [false, false];
        let mut fault_at: Option<Instant> = None;
        let mut link_up_at: Option<Instant> = None;
        let mut b_dead = false;
        // when the fault hits: a random moment early in the cycle
        let hit_after = Duration::from_millis(20 + rng.below(200));
        let grace = Duration::from_secs(3 * self.socket_timeout + 20);
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
                    } else {
                        // a side closed early says CLOSED now: keep it for later
                        kept.push((role, g, l));
                    }
                }
                _ => {}
            }
            let fault_hit = fault_at.is_some() && fault != Fault::Flap;
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
        // On verbs any flap is a cut: the port goes down with its netdev,
        // and the plugin fails every comm on that port on IBV_EVENT_PORT_ERR
        // (src/transport/ib/device.rs). NCCL's net_ib only WARNs on that
        // event and lets the QPs retry; the difference is the plugin's
        // choice, not this harness's, so it is counted as expected.
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
        let fault_hit = fault_at.is_some() && (fault != Fault::Flap || long_flap);
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
            let what = format!("cycle {c} ({}) peer {role}: {} {}", fault.name(), r.kind, r.detail);
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
        "soak: {secs} s over {net_name}, transport {}, plugin {}, faults {:?}, loss {}, RUSTNET_SOCKET_TIMEOUT={socket_timeout}, warm-up {warmup:.0} s",
        env_str("RUSTNET_TRANSPORT", "auto"),
        driver::default_plugin_path().display(),
        kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
        env_str("SOAK_LOSS", "none")
    );
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
             where the plugin fails the comms of a port that went down",
            FLAP.as_millis(),
            pct(&t.flap_down, 0.0),
            pct(&t.flap_down, 1.0),
            pct(&t.flap_down, 0.5),
            t.long_flaps
        )
    };
    let _ = writeln!(
        md,
        "| faults injected | {} kill+restart of B, {} link cut ({} s down), {} link flap ({flaps}); {} of them mid-transfer |",
        t.faults[1],
        t.faults[2],
        2 * socket_timeout + 2,
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

fn main() {
    if let Ok(role) = std::env::var("SOAK_ROLE") {
        peer_main(role);
        return;
    }
    std::process::exit(coordinator_main());
}
