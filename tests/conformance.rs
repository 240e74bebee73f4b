//! Conformance suite: the built `librustnet.so`, opened by the file names NCCL
//! uses, driven from two processes the way NCCL's proxy drives a plugin, for
//! every exported ABI version. Plus the failure cases: a peer killed
//! mid-transfer, garbage on the listen port, invalid knobs, an injected panic,
//! NULL and stale arguments, and dlclose/dlopen cycles.
//!
//! The transport under test follows the environment (`RUSTNET_TRANSPORT`,
//! `NCCL_SOCKET_IFNAME`, ...). Extra per-peer variables: `RUSTNET_CONF_A_ENV`
//! and `RUSTNET_CONF_B_ENV` ("K=V K=V"), e.g. `NCCL_IB_HCA=rxe0` and `=rxe1`.
//! `harness = false`: this file has its own main, so it can re-run itself as
//! a peer process (`RUSTNET_CONF_ROLE`).
mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::proc::{env_u64, peer_command, sh, spawn_piped, StderrLog};
use common::traffic::{Counters, InFlight, Traffic};
use common::*;
use rustnet_tools::driver::{self, hex, unhex, Plugin, Ptr};

const VERSIONS: [u32; 7] = [6, 7, 8, 9, 10, 11, 12];

// ------------------------------------------------------------------ peer side

struct Peer {
    p: Plugin,
    dev: i32,
    out: std::io::Stdout,
    input: std::io::Lines<std::io::StdinLock<'static>>,
}

impl Peer {
    fn say(&mut self, s: &str) {
        writeln!(self.out, "{s}").unwrap();
        self.out.flush().unwrap();
    }
    fn hear(&mut self, prefix: &str) -> String {
        loop {
            let l = self.input.next().expect("coordinator closed stdin").unwrap();
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }
    /// listen, swap handles with the other peer, connect+accept together.
    fn connect_pair(&mut self) -> (Ptr, Ptr, Ptr) {
        let (h, l) = self.p.listen(self.dev).expect("listen");
        self.say(&format!("HANDLE {}", hex(&h)));
        let peer = unhex(&self.hear("PEER ")).expect("peer handle hex");
        let mut ph = [0u8; 128];
        ph.copy_from_slice(&peer);
        let (s, r) = self.p.connect_accept(self.dev, &mut ph, l, Duration::from_secs(60)).expect("connect/accept");
        (s, r, l)
    }
}

/// With the driver's profiler checks on (RUSTNET_DRIVER_PROFILER=check):
/// " prof=ok ..." when every start had its stop, nothing is open and the
/// checks found nothing, else " prof=BAD ..." with what they found.
fn prof_summary() -> String {
    if driver::prof::mode() == driver::prof::Mode::Off {
        return String::new();
    }
    let r = driver::prof::report();
    let ok = r.errors.is_empty() && r.starts == r.stops && r.open == 0 && r.starts > 0;
    format!(
        " prof={} starts={} stops={} open={} ib={} sock={} ev_bytes={} parents_with_events={}/{}{}",
        if ok { "ok" } else { "BAD" },
        r.starts,
        r.stops,
        r.open,
        r.ib,
        r.sock,
        r.bytes,
        r.parents_with_events,
        r.parents,
        if r.errors.is_empty() { String::new() } else { format!(" errors={:?}", r.errors) }
    )
}

/// Both directions at once (the shared loop, tests/common/traffic.rs): the
/// bytes received and checked, or what went wrong. After a failure the
/// buffers still posted are leaked, not freed: the comm may still write
/// into them until it is closed (the peer process ends soon after).
#[allow(clippy::too_many_arguments)] // the test's knobs, named at each call site
fn traffic(
    p: &Plugin,
    s: Ptr,
    r: Ptr,
    my_seed: u64,
    peer_seed: u64,
    rounds: usize,
    max_recvs: usize,
    max_big: usize,
) -> Result<u64, String> {
    let t = Traffic { p, s, r, my_seed, peer_seed, rounds, max_recvs, max_big, deadline: Some(Duration::from_secs(180)) };
    let (mut fl, mut c) = (InFlight::default(), Counters::default());
    match t.run(&mut fl, &mut c, &|| false) {
        Ok(()) => Ok(c.bytes_checked),
        Err(e) => {
            std::mem::forget(fl);
            Err(e.to_string())
        }
    }
}

fn open_plugin(version: u32) -> Plugin {
    // Bare NCCL-style file name: found through LD_LIBRARY_PATH, as NCCL does.
    let name = std::env::var("RUSTNET_CONF_LIBNAME").unwrap_or_else(|_| "libnccl-net-rustnet.so".into());
    Plugin::open(Path::new(&name), version).unwrap_or_else(|e| panic!("{e}"))
}

/// One 8-byte message from `s` to `r` (a loopback pair), checked.
fn one_message(p: &Plugin, s: Ptr, r: Ptr, fill: u8) -> Result<(), String> {
    let mut sb = [fill; 8];
    let mut rb = [0u8; 8];
    let smh = p.reg_mr(s, sb.as_mut_ptr(), 8).map_err(|e| e.to_string())?;
    let rmh = p.reg_mr(r, rb.as_mut_ptr(), 8).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let late = |what: &str| if t0.elapsed() > Duration::from_secs(30) { Err(format!("{what} not done after 30 s")) } else { Ok(()) };
    let rq = loop {
        if let Some(q) = p.irecv(r, &[(rb.as_mut_ptr(), 8, 3, rmh)]).map_err(|e| e.to_string())? {
            break q;
        }
        late("irecv")?;
    };
    let (mut sq, mut rdone, mut sizes) = (None, false, [0i32; 8]);
    while sq.is_none() {
        sq = p.isend(s, sb.as_mut_ptr(), 8, 3, smh).map_err(|e| e.to_string())?;
        rdone = rdone || p.test(rq, &mut sizes).map_err(|e| e.to_string())?;
        late("isend")?;
    }
    let mut sdone = false;
    while !(sdone && rdone) {
        sdone = sdone || p.test(sq.unwrap(), &mut [0]).map_err(|e| e.to_string())?;
        rdone = rdone || p.test(rq, &mut sizes).map_err(|e| e.to_string())?;
        late("test")?;
    }
    if sizes[0] != 8 || rb != [fill; 8] {
        return Err(format!("received {} bytes {rb:?}, want 8 x {fill}", sizes[0]));
    }
    p.dereg_mr(s, smh).map_err(|e| e.to_string())?;
    p.dereg_mr(r, rmh).map_err(|e| e.to_string())?;
    Ok(())
}

/// Is a copy of the plugin (the file behind the NCCL name in
/// LD_LIBRARY_PATH) mapped into this process?
fn plugin_mapped() -> bool {
    let name = std::env::var("RUSTNET_CONF_LIBNAME").unwrap_or_else(|_| "libnccl-net-rustnet.so".into());
    let dir = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let real = dir.split(':').map(|d| Path::new(d).join(&name)).find_map(|p| std::fs::canonicalize(p).ok());
    let real = real.expect("the plugin file behind LD_LIBRARY_PATH");
    std::fs::read_to_string("/proc/self/maps").map(|m| m.contains(&*real.to_string_lossy())).unwrap_or(false)
}

/// The RSS growth (KiB) a flat-memory case allows over `rss0` KiB: `pct`
/// percent, and never less than 128 KiB. A leak grows with the cycles; one
/// step of glibc's heap top (it pads it by 128 KiB) or a new malloc arena
/// does not, and on the 4-6 MiB processes these cases run 1% is less than
/// one such step.
fn rss_slack_kib(rss0: usize, pct: f64) -> usize {
    ((rss0 as f64 * pct / 100.0) as usize).max(128)
}

/// N dlopen/init/listen/connect/one message/close/dlclose cycles in this
/// process: after each dlclose the plugin is really gone from the address
/// space, and fds, threads and RSS stay flat after a warm-up.
fn reload_many(version: u32) {
    let n = (env_u64("RUSTNET_CONF_RELOADS", 500) as usize).max(2);
    let warm = (n / 10).clamp(5, 50).min(n - 1);
    let say = |s: String| {
        println!("{s}");
        std::io::stdout().flush().unwrap();
    };
    let mut base = None;
    let t0 = Instant::now();
    let th_start = thread_count();
    let mut pinned = None;
    // RUSTNET_CONF_RELOAD_CONNECT=0: dlopen/init/dlclose only
    let connect = env_u64("RUSTNET_CONF_RELOAD_CONNECT", 1) != 0;
    for c in 0..n {
        let p = open_plugin(version);
        let run = || -> Result<(), String> {
            p.init().map_err(|e| e.to_string())?;
            if !connect {
                return Ok(());
            }
            let (mut h, l) = p.listen(0).map_err(|e| e.to_string())?;
            let (s, r) = p.connect_accept(0, &mut h, l, Duration::from_secs(30))?;
            one_message(&p, s, r, c as u8)?;
            p.close_send(s).map_err(|e| e.to_string())?;
            p.close_recv(r).map_err(|e| e.to_string())?;
            p.close_listen(l).map_err(|e| e.to_string())
        };
        if let Err(e) = run() {
            say(format!("FAIL cycle {c}: {e}"));
            std::process::exit(1);
        }
        drop(p);
        if plugin_mapped() {
            // Threads the plugin started (the verbs async-event watchers)
            // carry thread-local destructors that keep the library loaded
            // while they live; the next dlopen then reuses that copy. Any
            // other reason to stay mapped is a failure.
            let th = thread_count();
            if th <= th_start {
                say(format!("FAIL cycle {c}: librustnet.so is still mapped after dlclose with no plugin thread alive"));
                std::process::exit(1);
            }
            pinned.get_or_insert(th - th_start);
        }
        if c + 1 == warm {
            base = Some((fd_count(), thread_count(), rss_kib()));
        }
    }
    let (fd0, th0, rss0) = base.unwrap();
    let (fd1, th1, rss1) = (fd_count(), thread_count_settled(th0), rss_kib());
    let line = format!(
        "{n} cycles in {:.1}s: fds {fd0}->{fd1}, threads {th0}->{th1}, rss {rss0}->{rss1} KiB ({:+.2}%, {:+.0} B/cycle) after {warm} warm-up cycles, {}",
        t0.elapsed().as_secs_f64(),
        (rss1 as f64 - rss0 as f64) * 100.0 / rss0 as f64,
        (rss1 as f64 - rss0 as f64) * 1024.0 / (n - warm) as f64,
        match pinned {
            None => "unmapped after every dlclose".to_string(),
            Some(k) => format!("kept mapped by {k} plugin thread(s) (verbs async events) and reused by the next dlopen"),
        }
    );
    // RUSTNET_CONF_RSS_PCT: the RSS growth allowed after warm-up (1%)
    let rss_pct = std::env::var("RUSTNET_CONF_RSS_PCT").ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(1.0);
    let slack = rss_slack_kib(rss0, rss_pct);
    if fd1 > fd0 || th1 > th0 || rss1 > rss0 + slack {
        say(format!("FAIL growth: {line} (allowed: +{slack} KiB)"));
        std::process::exit(1);
    }
    say(format!("DONE {line}"));
}

/// `tcpdump -v` lines of a TCP capture: (src port, dst port, tos, payload
/// length) per packet.
fn parse_tcp_capture(text: &str) -> Vec<(u16, u16, u8, usize)> {
    let mut out = Vec::new();
    let mut tos = None;
    for l in text.lines() {
        if let Some(p) = l.find("(tos 0x") {
            let h: String = l[p + 7..].chars().take_while(|c| c.is_ascii_hexdigit()).collect();
            tos = u8::from_str_radix(&h, 16).ok();
            continue;
        }
        let (Some(t), Some((a, rest))) = (tos, l.trim().split_once(" > ")) else { continue };
        let Some((b, rest)) = rest.split_once(": ") else { continue };
        let port = |s: &str| s.rsplit_once('.').and_then(|x| x.1.parse::<u16>().ok());
        let len = rest.rsplit_once("length ").and_then(|x| x.1.trim().parse().ok());
        if let (Some(pa), Some(pb), Some(n)) = (port(a), port(b), len) {
            out.push((pa, pb, t, n));
        }
        tos = None;
    }
    out
}

/// Why a wire capture cannot run here (None: it can).
fn no_capture() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root".into());
    }
    if !Command::new("tcpdump").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Some("no tcpdump".into());
    }
    None
}

/// tcpdump on `ifname` with `filter`, until [`stop_capture`].
fn start_capture(ifname: &str, filter: &str) -> (Child, PathBuf) {
    let out = std::env::temp_dir().join(format!("rustnet-conf-cap-{}.txt", std::process::id()));
    let f = std::fs::File::create(&out).unwrap();
    let mut args = vec!["-i", ifname, "-nn", "-v", "-l", "--immediate-mode"];
    args.extend(filter.split_whitespace());
    let mut child = Command::new("tcpdump").args(&args).stdout(f).stderr(Stdio::piped()).spawn().expect("tcpdump");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("listening on"), "tcpdump: {line}");
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    (child, out)
}

fn stop_capture((mut child, out): (Child, PathBuf)) -> String {
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
    let t = std::fs::read_to_string(&out).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    t
}

/// ABI v11+: two communicators' contexts in one process, with traffic
/// classes 96 and 184. Each one's comms belong to it: on TCP every data
/// packet of a context's connections carries its class as the IP TOS byte
/// (tcpdump on lo, when root); finalize is refused while comms are open and
/// those comms then fail every call but close; the other context carries
/// on; stale, foreign and finalized context handles are refused by name.
fn two_contexts(p: &Plugin, dev: i32, version: u32) {
    let say = |s: String| {
        println!("{s}");
        std::io::stdout().flush().unwrap();
    };
    let code = |r: Result<(), driver::NcclErr>| r.map(|_| 0).unwrap_or_else(|e| e.code);
    let mut out = Vec::new();
    let (c1, c2) = (p.init_context(0x1111, Some(96)).unwrap(), p.init_context(0x2222, Some(184)).unwrap());
    let c0 = p.init_context(0x3333, None).unwrap();
    out.push(format!("tc300={}", p.init_context(0x4444, Some(300)).map(|_| 0).unwrap_or_else(|e| e.code)));
    let tcp = std::env::var("RUSTNET_TRANSPORT").as_deref() != Ok("ib");
    let (h1, l1) = p.listen_in(c1, dev).unwrap();
    let (h2, l2) = p.listen_in(c2, dev).unwrap();
    let port = |h: &[u8; 128]| rustnet::proto::handle::Handle::decode(h).unwrap().addr.port();
    let (p1, p2) = (port(&h1), port(&h2));
    let why_not = if tcp { no_capture() } else { Some("verbs: the wire proof is verbs_roce::tos_two_v11/v12_contexts_on_the_wire".into()) };
    let cap = why_not.is_none().then(|| start_capture("lo", &format!("tcp and (port {p1} or port {p2})")));
    let (mut h1, mut h2) = (h1, h2);
    let (s1, r1) = p.connect_accept_in(c1, dev, &mut h1, l1, Duration::from_secs(60)).unwrap();
    let (s2, r2) = p.connect_accept_in(c2, dev, &mut h2, l2, Duration::from_secs(60)).unwrap();
    traffic(p, s1, r1, 5, 5, 4, 4, 1 << 20).unwrap();
    traffic(p, s2, r2, 6, 6, 4, 4, 1 << 20).unwrap();
    match cap {
        Some(c) => {
            let pk = parse_tcp_capture(&stop_capture(c));
            let tos_of = |port: u16| {
                pk.iter().filter(|x| x.3 > 0 && (x.0 == port || x.1 == port)).map(|x| x.2).collect::<std::collections::BTreeSet<_>>()
            };
            let n = |port: u16| pk.iter().filter(|x| x.3 > 0 && (x.0 == port || x.1 == port)).count();
            let (t1, t2) = (tos_of(p1), tos_of(p2));
            eprintln!(
                "wire: port {p1} (ctx tc 96): {} data packets, tos {t1:x?}; port {p2} (ctx tc 184): {} data packets, tos {t2:x?}",
                n(p1),
                n(p2)
            );
            assert!(n(p1) > 0 && n(p2) > 0, "no data packets captured: {pk:?}");
            assert_eq!(t1, [0x60u8].into(), "context 1's packets");
            assert_eq!(t2, [0xb8u8].into(), "context 2's packets");
            out.push(format!("wire_tos={:#04x}/{:#04x}", 0x60, 0xb8));
        }
        None => out.push(format!("wire=skipped({})", why_not.unwrap().replace(' ', "_"))),
    }
    // finalize with comms open: refused, and they are dead but closable
    out.push(format!("finalize_open={}", code(p.finalize(c1))));
    let mut b = [0u8; 8];
    out.push(format!("regMr_after_finalize={}", p.reg_mr(s1, b.as_mut_ptr(), 8).map(|_| 0).unwrap_or_else(|e| e.code)));
    out.push(format!(
        "isend_after_finalize={}",
        p.isend(s1, b.as_mut_ptr(), 8, 1, std::ptr::null_mut()).map(|_| 0).unwrap_or_else(|e| e.code)
    ));
    out.push(format!("listen_finalized_ctx={}", p.listen_in(c1, dev).map(|_| 0).unwrap_or_else(|e| e.code)));
    out.push(format!("finalize_twice={}", code(p.finalize(c1))));
    // the other context is untouched
    one_message(p, s2, r2, 0x42).unwrap();
    out.push("other_ctx_traffic=0".into());
    out.push(format!("listen_garbage_ctx={}", p.listen_in(0xdead_0000usize as Ptr, dev).map(|_| 0).unwrap_or_else(|e| e.code)));
    out.push(format!("listen_comm_as_ctx={}", p.listen_in(s2, dev).map(|_| 0).unwrap_or_else(|e| e.code)));
    out.push(format!("listen_null_ctx={}", p.listen_in(std::ptr::null_mut(), dev).map(|_| 0).unwrap_or_else(|e| e.code)));
    // a handle whose connect started under c2, continued under c0: refused
    let (mut h3, l3) = p.listen_in(c2, dev).unwrap();
    let first = p.connect_in(c2, dev, &mut h3).unwrap();
    let cross = if first.is_none() { p.connect_in(c0, dev, &mut h3).map(|_| 0).unwrap_or_else(|e| e.code) } else { -1 };
    out.push(format!("connect_resumed_in_other_ctx={cross}"));
    if let Some(s) = first {
        p.close_send(s).unwrap();
    }
    p.close_listen(l3).unwrap();
    // SAFETY: ncclNetAttr_v11_t is a C struct of integers (bindgen), for
    // which all-zero bytes are a valid value.
    let mut attr: rustnet::for_tools::sys::ncclNetAttr_v11_t = unsafe { std::mem::zeroed() };
    attr.sendCommAttr.maxConcurrentPeers = 8;
    attr.op = 1 << 2;
    out.push(format!("setNetAttr={}", code(p.set_net_attr(c0, &attr))));
    out.push(format!("setNetAttr_finalized={}", code(p.set_net_attr(c1, &attr))));
    for (s, r) in [(s1, r1), (s2, r2)] {
        p.close_send(s).unwrap();
        p.close_recv(r).unwrap();
    }
    p.close_listen(l1).unwrap();
    p.close_listen(l2).unwrap();
    out.push(format!("finalize_closed={}", code(p.finalize(c2))));
    out.push(format!("finalize_unused={}", code(p.finalize(c0))));
    say(format!("DONE v{version} {}", out.join(" ")));
}

/// What a peer process knows besides its half: its role, ABI version and seeds.
struct PeerEnv {
    role: String,
    version: u32,
    my_seed: u64,
    peer_seed: u64,
}

/// How a peer half runs: on its own (it opens the plugin itself), or on a
/// peer whose plugin is open and initialised.
enum PeerRun {
    Bare(fn(&PeerEnv)),
    Plugin(fn(&mut Peer, &PeerEnv)),
}

/// One peer half of a case: what a peer process does. The coordinator half
/// names it as a value (`spawn(.., &TRAFFIC, ..)`); `name` only carries it to
/// the child (RUSTNET_CONF_SCENARIO), which finds it in [`PEER_HALVES`].
struct PeerHalf {
    name: &'static str,
    run: PeerRun,
}

const RELOAD_MANY: PeerHalf = PeerHalf { name: "reload_many", run: PeerRun::Bare(|e| reload_many(e.version)) };
const INIT: PeerHalf = PeerHalf { name: "init", run: PeerRun::Plugin(peer_init) };
const TRAFFIC: PeerHalf = PeerHalf { name: "traffic", run: PeerRun::Plugin(peer_traffic) };
const KILLED_SENDER: PeerHalf = PeerHalf { name: "killed_sender", run: PeerRun::Plugin(peer_killed_sender) };
const VDEVICE: PeerHalf = PeerHalf { name: "vdevice", run: PeerRun::Plugin(peer_vdevice) };
const CROSS_ROUND_TAGS: PeerHalf = PeerHalf { name: "cross_round_tags", run: PeerRun::Plugin(peer_cross_round_tags) };
const CUT_SENDER: PeerHalf = PeerHalf { name: "cut_sender", run: PeerRun::Plugin(peer_cut_sender) };
const KILLED_RECEIVER_SIDE: PeerHalf = PeerHalf { name: "killed_receiver_side", run: PeerRun::Plugin(peer_killed_receiver_side) };
const PANIC: PeerHalf = PeerHalf { name: "panic", run: PeerRun::Plugin(peer_panic) };
const TWO_CONTEXTS: PeerHalf = PeerHalf { name: "two_contexts", run: PeerRun::Plugin(peer_two_contexts) };
const MISUSE: PeerHalf = PeerHalf { name: "misuse", run: PeerRun::Plugin(peer_misuse) };
const CONNECT_CHURN: PeerHalf = PeerHalf { name: "connect_churn", run: PeerRun::Plugin(peer_connect_churn) };
const HANDLE_MISUSE: PeerHalf = PeerHalf { name: "handle_misuse", run: PeerRun::Plugin(peer_handle_misuse) };
const PANIC_MID: PeerHalf = PeerHalf { name: "panic_mid", run: PeerRun::Plugin(peer_panic_mid) };
const RECOVERING_TRAFFIC: PeerHalf = PeerHalf { name: "recovering_traffic", run: PeerRun::Plugin(peer_recovering_traffic) };
const LATE_RECEIVER: PeerHalf = PeerHalf { name: "late_receiver", run: PeerRun::Plugin(peer_late_receiver) };
const LATE_SENDER: PeerHalf = PeerHalf { name: "late_sender", run: PeerRun::Plugin(peer_late_sender) };
const AWAY_RECEIVER: PeerHalf = PeerHalf { name: "away_receiver", run: PeerRun::Plugin(peer_away_receiver) };
const FLAP_SENDER: PeerHalf = PeerHalf { name: "flap_sender", run: PeerRun::Plugin(peer_flap_sender) };

/// Every peer half, for the child to find its own by name.
const PEER_HALVES: &[&PeerHalf] = &[
    &RELOAD_MANY,
    &INIT,
    &TRAFFIC,
    &KILLED_SENDER,
    &VDEVICE,
    &CROSS_ROUND_TAGS,
    &CUT_SENDER,
    &KILLED_RECEIVER_SIDE,
    &PANIC,
    &TWO_CONTEXTS,
    &MISUSE,
    &CONNECT_CHURN,
    &HANDLE_MISUSE,
    &PANIC_MID,
    &RECOVERING_TRAFFIC,
    &LATE_RECEIVER,
    &LATE_SENDER,
    &AWAY_RECEIVER,
    &FLAP_SENDER,
];

fn peer_main(role: String) {
    let version = env_u64("RUSTNET_CONF_VERSION", 8) as u32;
    let scenario = std::env::var("RUSTNET_CONF_SCENARIO").unwrap_or_default();
    let seed = env_u64("RUSTNET_CONF_SEED", 1);
    let (my_seed, peer_seed) = if role == "A" { (seed, seed + 1) } else { (seed + 1, seed) };
    let e = PeerEnv { role, version, my_seed, peer_seed };
    let half = PEER_HALVES.iter().find(|h| h.name == scenario).unwrap_or_else(|| panic!("unknown peer half {scenario:?}"));
    let run = match half.run {
        PeerRun::Bare(f) => return f(&e),
        PeerRun::Plugin(f) => f,
    };
    let p = open_plugin(version);
    // (Stdin::lock is 'static: the line iterator lives in Peer without a leak)
    let mut peer = Peer { p, dev: env_u64("RUSTNET_CONF_DEV", 0) as i32, out: std::io::stdout(), input: std::io::stdin().lock().lines() };
    let p = &peer.p;
    assert_eq!(p.name(), "rustnet");
    assert!(p.missing_slots().is_empty(), "NULL slots: {:?}", p.missing_slots());
    if let Err(e) = p.init() {
        peer.say(&format!("INITFAIL {}", e.code));
        return;
    }
    run(&mut peer, &e);
}

fn peer_init(peer: &mut Peer, _e: &PeerEnv) {
    let n = peer.p.devices().unwrap();
    peer.say(&format!("DONE devices={n}"));
}

fn peer_traffic(peer: &mut Peer, e: &PeerEnv) {
    let version = e.version;
    let my_seed = e.my_seed;
    let peer_seed = e.peer_seed;
    let n = peer.p.devices().unwrap();
    assert!(n >= 1, "no devices");
    let props = peer.p.properties(peer.dev).unwrap();
    assert!(!props.name.is_empty());
    assert_eq!(props.max_recvs, 8, "maxRecvs");
    assert!(props.ptr_support & 1 != 0, "ptrSupport lacks HOST");
    assert_eq!(props.net_device_type, 0, "netDeviceType must be HOST");
    if version >= 9 {
        assert!(props.max_p2p_bytes > 0 && props.max_p2p_bytes <= 1 << 40);
    }
    assert_eq!(props.max_multi_request_size, 1, "maxMultiRequestSize (v11+; 1 = no multi-requests)");
    if version >= 12 {
        let verbs = std::env::var("RUSTNET_TRANSPORT").as_deref() == Ok("ib");
        // a physical verbs port is its own rail (a self-merged one spans
        // rails: undefined); planes and TCP interfaces: undefined
        let plain = verbs && std::env::var_os("RUSTNET_IB_MERGE_NICS").is_none();
        let want = (if plain { peer.dev as i16 } else { -1 }, -1);
        assert_eq!(props.rail_plane, want, "railId/planeId of device {}", peer.dev);
    }
    let cycles = env_u64("RUSTNET_CONF_CYCLES", 3) as usize;
    let rounds = env_u64("RUSTNET_CONF_ROUNDS", 40) as usize;
    let max_big = env_u64("RUSTNET_CONF_MAX_BIG", 6 << 20) as usize;
    let mut base = None;
    let mut total = 0;
    for c in 0..cycles {
        let (s, r, l) = peer.connect_pair();
        let res = traffic(&peer.p, s, r, my_seed + 10 * c as u64, peer_seed + 10 * c as u64, rounds, 8, max_big);
        let bytes = match res {
            Ok(b) => b,
            Err(e) => {
                peer.say(&format!("FAIL cycle {c}: {e}"));
                std::process::exit(1);
            }
        };
        total += bytes;
        peer.p.close_send(s).unwrap();
        peer.p.close_recv(r).unwrap();
        peer.p.close_listen(l).unwrap();
        // both sides finished receiving before anyone closes for good
        peer.say("CYCLE");
        peer.hear("GO");
        if c == 0 {
            base = Some((fd_count(), thread_count(), rss_kib()));
        }
    }
    let (fd0, th0, rss0) = base.unwrap();
    let (fd1, th1, rss1) = (fd_count(), thread_count_settled(th0), rss_kib());
    if fd1 > fd0 || th1 > th0 || rss1 > rss0 + 64 * 1024 {
        peer.say(&format!("FAIL growth after {cycles} cycles: fds {fd0}->{fd1}, threads {th0}->{th1}, rss {rss0}->{rss1} KiB"));
        std::process::exit(1);
    }
    peer.say(&format!("DONE bytes={total} fds={fd0}->{fd1} threads={th0}->{th1} rss_kib={rss0}->{rss1}{}", prof_summary()));
}

/// Both directions on one pair of comms for RUSTNET_CONF_RUNS runs of the
/// shared traffic loop (every byte, size and canary checked), "RUN k" after
/// each, so the coordinator can cut or reset the link in the middle. The
/// listen comm is closed right after accept, as NCCL's proxy does: the
/// receive comm must take its sender's reconnection without it.
fn peer_recovering_traffic(peer: &mut Peer, e: &PeerEnv) {
    let runs = env_u64("RUSTNET_CONF_RUNS", 20);
    let rounds = env_u64("RUSTNET_CONF_ROUNDS", 20) as usize;
    let max_big = env_u64("RUSTNET_CONF_MAX_BIG", 1 << 20) as usize;
    let (s, r, l) = if e.role == "B" && env_u64("RUSTNET_CONF_LATE_ACCEPT", 0) == 1 {
        // B's listener answers A's hellos only once told to: A's connect
        // waits for that acceptance meanwhile (the coordinator cuts the link then)
        let (h, l) = peer.p.listen(peer.dev).expect("listen");
        peer.say(&format!("HANDLE {}", hex(&h)));
        let mut ph = [0u8; 128];
        ph.copy_from_slice(&unhex(&peer.hear("PEER ")).expect("peer handle hex"));
        let t0 = Instant::now();
        let s = loop {
            if let Some(s) = peer.p.connect(peer.dev, &mut ph).expect("connect") {
                break s;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "B's connect not done");
            std::thread::sleep(Duration::from_millis(1));
        };
        peer.say("CONNECTED");
        peer.hear("ACCEPT");
        let t0 = Instant::now();
        let r = loop {
            if let Some(r) = peer.p.accept(l).expect("accept") {
                break r;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "B's accept not done");
            std::thread::sleep(Duration::from_millis(1));
        };
        (s, r, l)
    } else {
        peer.connect_pair()
    };
    peer.p.close_listen(l).unwrap();
    let t0 = Instant::now();
    let mut total = 0;
    for k in 0..runs {
        match traffic(&peer.p, s, r, e.my_seed + 100 * k, e.peer_seed + 100 * k, rounds, 8, max_big) {
            Ok(b) => total += b,
            Err(err) => {
                peer.say(&format!("FAIL run {k} after {:.1} s: {err}", t0.elapsed().as_secs_f64()));
                std::process::exit(1);
            }
        }
        peer.say(&format!("RUN {k}"));
    }
    // both sides received everything before anyone closes
    peer.say("CYCLE");
    peer.hear("GO");
    peer.p.close_send(s).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.say(&format!("DONE bytes={total} runs={runs} secs={:.1}", t0.elapsed().as_secs_f64()));
}

fn peer_killed_sender(peer: &mut Peer, _e: &PeerEnv) {
    // B sends big messages forever and gets SIGKILLed by the coordinator.
    let (s, _r, _l) = peer.connect_pair();
    let mut buf = vec![7u8; 8 << 20];
    let mh = peer.p.reg_mr(s, buf.as_mut_ptr(), buf.len()).unwrap();
    let mut told = false;
    let mut inflight = Vec::new();
    loop {
        if let Some(req) = peer.p.isend(s, buf.as_mut_ptr(), buf.len(), 100, mh).unwrap() {
            inflight.push(req);
        }
        inflight.retain(|&q| !peer.p.test(q, &mut [0]).unwrap());
        if !told {
            peer.say("STARTED");
            told = true;
        }
    }
}

fn peer_vdevice(peer: &mut Peer, e: &PeerEnv) {
    let my_seed = e.my_seed;
    let peer_seed = e.peer_seed;
    // ABI v9+: NCCL fuses devices through makeVDevice. Two or more
    // devices: fuse the first two and move traffic over the result;
    // one: fuse it alone (verbs) or see the refusal (TCP stripes over
    // streams instead of fusing).
    let n = peer.p.devices().unwrap();
    let members: Vec<i32> = if n >= 2 { vec![0, 1] } else { vec![0] };
    match peer.p.make_vdevice(&members) {
        Err(e) => {
            peer.say(&format!("REFUSED {} n={n}", e.code));
            return;
        }
        Ok(v) => {
            assert_eq!(v, n, "the fused device comes after the {n} physical ones");
            assert_eq!(peer.p.devices().unwrap(), n + 1, "devices() counts the fused one");
            let fused = peer.p.properties(v).unwrap();
            let parts: Vec<_> = members.iter().map(|&m| peer.p.properties(m).unwrap()).collect();
            let speed: i32 = parts.iter().map(|p| p.speed).sum();
            assert_eq!(fused.speed, speed, "a fused device's speed is its members' sum");
            for p in &parts {
                assert!(fused.name.contains(&p.name), "{} names member {}", fused.name, p.name);
            }
            peer.say(&format!("FUSED {} ({} Mbps) from {n} device(s)", fused.name, fused.speed));
            peer.dev = v;
        }
    }
    let (s, r, l) = peer.connect_pair();
    if let Err(e) = traffic(&peer.p, s, r, my_seed, peer_seed, 20, 8, 2 << 20) {
        peer.say(&format!("FAIL {e}"));
        std::process::exit(1);
    }
    peer.p.close_send(s).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.p.close_listen(l).unwrap();
    peer.say("CYCLE");
    peer.hear("GO");
    peer.say(&format!("DONE traffic over the fused device{}", prof_summary()));
}

fn peer_cross_round_tags(peer: &mut Peer, e: &PeerEnv) {
    let role = e.role.as_str();
    // Shared-comm pattern (PXN): two grouped receives of tags [1, 2];
    // the sender's tag-1 message of round 1 comes before round 0's
    // tag-2 message. Per tag, messages land in posting order.
    let (s, r, l) = peer.connect_pair();
    let mut out = String::new();
    if role == "A" {
        let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 64]).collect();
        let mhs: Vec<Ptr> = bufs.iter_mut().map(|b| peer.p.reg_mr(r, b.as_mut_ptr(), 64).unwrap()).collect();
        let mut reqs = Vec::new();
        for round in 0..2 {
            let (b0, b1) = bufs.split_at_mut(2 * round + 1);
            let spec = [(b0[2 * round].as_mut_ptr(), 64, 1, mhs[2 * round]), (b1[0].as_mut_ptr(), 64, 2, mhs[2 * round + 1])];
            reqs.push(loop {
                if let Some(q) = peer.p.irecv(r, &spec).unwrap() {
                    break q;
                }
            });
        }
        for q in reqs {
            let mut sz = [0i32; 8];
            let t0 = Instant::now();
            while !peer.p.test(q, &mut sz).unwrap() {
                assert!(t0.elapsed() < Duration::from_secs(30), "cross-round receive never completed");
            }
            out += &format!("[{},{}]", sz[0], sz[1]);
        }
        for (i, b) in bufs.iter().enumerate() {
            out += &format!(" b{i}={}", b[0]);
        }
        for mh in mhs {
            peer.p.dereg_mr(r, mh).unwrap();
        }
    } else {
        // (round, tag, size, fill byte) in the order the sender tries them
        let plan = [(1usize, 1i32, 11usize, 0x11u8), (1, 1, 12, 0x12), (0, 2, 21, 0x21), (1, 2, 22, 0x22)];
        let mut bufs: Vec<Vec<u8>> = plan.iter().map(|p| vec![p.3; p.2]).collect();
        let mhs: Vec<Ptr> = bufs.iter_mut().map(|b| peer.p.reg_mr(s, b.as_mut_ptr(), b.len()).unwrap()).collect();
        let mut pending: Vec<usize> = (0..plan.len()).collect();
        let mut reqs = Vec::new();
        let t0 = Instant::now();
        while !pending.is_empty() {
            // like NCCL's proxy: each tag (rank) posts its steps in
            // order, and the tags are tried on their own; "not yet"
            // moves on to the next tag
            let mut blocked: Vec<i32> = Vec::new();
            pending.retain(|&k| {
                if blocked.contains(&plan[k].1) {
                    return true; // an earlier step of this tag is not posted yet
                }
                match peer.p.isend(s, bufs[k].as_mut_ptr(), plan[k].2, plan[k].1, mhs[k]).unwrap() {
                    Some(q) => {
                        reqs.push(q);
                        false
                    }
                    None => {
                        blocked.push(plan[k].1);
                        true
                    }
                }
            });
            reqs.retain(|&q| !peer.p.test(q, &mut [0]).unwrap());
            assert!(t0.elapsed() < Duration::from_secs(30), "sends never started: {pending:?}");
        }
        while !reqs.is_empty() {
            reqs.retain(|&q| !peer.p.test(q, &mut [0]).unwrap());
        }
        for mh in mhs {
            peer.p.dereg_mr(s, mh).unwrap();
        }
    }
    peer.say("CYCLE");
    peer.hear("GO");
    peer.p.close_send(s).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.p.close_listen(l).unwrap();
    peer.say(&format!("DONE {out}"));
}

fn peer_cut_sender(peer: &mut Peer, _e: &PeerEnv) {
    // B sends until the link is cut under it; reports the error.
    let (s, r, l) = peer.connect_pair();
    let mut buf = vec![7u8; 1 << 20];
    let mh = peer.p.reg_mr(s, buf.as_mut_ptr(), buf.len()).unwrap();
    let mut inflight: Vec<Ptr> = Vec::new();
    let mut told = false;
    let code = 'outer: loop {
        match peer.p.isend(s, buf.as_mut_ptr(), buf.len(), 100, mh) {
            Ok(Some(q)) => inflight.push(q),
            Ok(None) => {}
            Err(e) => break e.code,
        }
        let mut i = 0;
        while i < inflight.len() {
            match peer.p.test(inflight[i], &mut [0]) {
                Ok(true) => {
                    inflight.swap_remove(i);
                }
                Ok(false) => i += 1,
                Err(e) => break 'outer e.code,
            }
        }
        if !told {
            peer.say("STARTED");
            told = true;
        }
    };
    // close what it opened, as NCCL does after an error: a failed comm
    // (with sends in flight) must still give everything back (LeakSanitizer
    // checks it under scripts/sanitize.sh)
    peer.p.dereg_mr(s, mh).unwrap();
    peer.p.close_send(s).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.p.close_listen(l).unwrap();
    peer.say(&format!("DONE send_error={code}"));
}

/// The byte a late sender puts at `i` (its receiver checks every one).
fn late_byte(i: usize) -> u8 {
    (i * 7 + 3) as u8
}

fn peer_late_receiver(peer: &mut Peer, _e: &PeerEnv) {
    // A: two 1 MiB receives from B. The first completes with both ends
    // active (on verbs the handshake ends with B's first call); then B's
    // rank is away for a while, and the case faults the connection while
    // the second receive waits and B calls nothing
    two_receives(peer, false);
}

/// The late-rank receivers: two 1 MiB receives of `late_byte`s, the first
/// with both ends active; the second is posted (its CTS goes out in that
/// call), "POSTED", then waited for at once, or (`away`) only after the
/// harness's GO, the rank calling nothing meanwhile.
fn two_receives(peer: &mut Peer, away: bool) {
    let (s, r, l) = peer.connect_pair();
    let mut buf = vec![0u8; 1 << 20];
    let mh = peer.p.reg_mr(r, buf.as_mut_ptr(), buf.len()).unwrap();
    let post = |p: &Plugin, buf: &mut Vec<u8>| loop {
        if let Some(q) = p.irecv(r, &[(buf.as_mut_ptr(), buf.len(), 100, mh)]).unwrap() {
            break q;
        }
    };
    let first = post(&peer.p, &mut buf);
    while !peer.p.test(first, &mut [0; 8]).unwrap() {}
    buf.fill(0);
    let q = post(&peer.p, &mut buf);
    peer.say("POSTED");
    if away {
        peer.hear("GO");
    }
    let t0 = Instant::now();
    let mut sizes = [0i32; 8];
    let res = loop {
        match peer.p.test(q, &mut sizes) {
            Ok(true) => break Ok(()),
            Ok(false) if t0.elapsed() > Duration::from_secs(60) => break Err("no data 60 s after waiting began".to_string()),
            Ok(false) => std::thread::sleep(Duration::from_micros(200)),
            Err(e) => break Err(format!("error {}", e.code)),
        }
    };
    let waited = t0.elapsed().as_millis();
    let bad = buf.iter().enumerate().filter(|&(i, &b)| b != late_byte(i)).count();
    peer.p.dereg_mr(r, mh).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.p.close_send(s).unwrap();
    peer.p.close_listen(l).unwrap();
    match res {
        Ok(()) => peer.say(&format!("DONE ok size={} bad_bytes={bad} waited_ms={waited}", sizes[0])),
        Err(e) => peer.say(&format!("DONE failed after {waited} ms: {e}")),
    }
}

fn peer_late_sender(peer: &mut Peer, _e: &PeerEnv) {
    // B: connects, sends one 1 MiB message, then its rank is away (calls
    // nothing on its comms) until the harness says GO; then one more
    let (s, r, l) = peer.connect_pair();
    let mut buf: Vec<u8> = (0..1 << 20).map(late_byte).collect();
    let mh = peer.p.reg_mr(s, buf.as_mut_ptr(), buf.len()).unwrap();
    let first = loop {
        if let Some(q) = peer.p.isend(s, buf.as_mut_ptr(), buf.len(), 100, mh).unwrap() {
            break q;
        }
    };
    while !peer.p.test(first, &mut [0]).unwrap() {}
    peer.say("READY");
    // GO: send again; CLOSE: this rank's NCCL gives up on the send comm and
    // carries on with its others (its receive comm keeps the resume port)
    if peer.hear("") == "CLOSE" {
        peer.p.dereg_mr(s, mh).unwrap();
        peer.p.close_send(s).unwrap();
        peer.say("CLOSED");
        peer.hear("EXIT");
        peer.p.close_recv(r).unwrap();
        peer.p.close_listen(l).unwrap();
        return peer.say("DONE closed");
    }
    let t0 = Instant::now();
    let res = 'send: loop {
        match peer.p.isend(s, buf.as_mut_ptr(), buf.len(), 100, mh) {
            Ok(Some(q)) => loop {
                match peer.p.test(q, &mut [0]) {
                    Ok(true) => break 'send Ok(()),
                    Ok(false) if t0.elapsed() > Duration::from_secs(60) => break 'send Err("not done after 60 s".to_string()),
                    Ok(false) => {}
                    Err(e) => break 'send Err(format!("error {}", e.code)),
                }
            },
            Ok(None) if t0.elapsed() > Duration::from_secs(60) => break Err("no CTS after 60 s".to_string()),
            Ok(None) => {}
            Err(e) => break Err(format!("error {}", e.code)),
        }
    };
    peer.p.dereg_mr(s, mh).unwrap();
    peer.p.close_send(s).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.p.close_listen(l).unwrap();
    match res {
        Ok(()) => peer.say(&format!("DONE ok send_ms={}", t0.elapsed().as_millis())),
        Err(e) => peer.say(&format!("DONE failed: {e}")),
    }
}

fn peer_away_receiver(peer: &mut Peer, _e: &PeerEnv) {
    // B: its rank is away after posting the second receive, until GO
    two_receives(peer, true);
}

fn peer_flap_sender(peer: &mut Peer, _e: &PeerEnv) {
    // A: sends one 1 MiB message with both ends active, then on SEND (the
    // link is down by then) a second one, and waits for it
    let (s, r, l) = peer.connect_pair();
    let mut buf: Vec<u8> = (0..1 << 20).map(late_byte).collect();
    let mh = peer.p.reg_mr(s, buf.as_mut_ptr(), buf.len()).unwrap();
    let send = |p: &Plugin, buf: &mut Vec<u8>| loop {
        if let Some(q) = p.isend(s, buf.as_mut_ptr(), buf.len(), 100, mh).unwrap() {
            break q;
        }
    };
    let first = send(&peer.p, &mut buf);
    while !peer.p.test(first, &mut [0]).unwrap() {}
    peer.say("READY");
    peer.hear("SEND");
    let t0 = Instant::now();
    // (the comm may fail before it takes the send: a link down for good)
    let q = loop {
        match peer.p.isend(s, buf.as_mut_ptr(), buf.len(), 100, mh) {
            Ok(Some(q)) => break Ok(q),
            Ok(None) if t0.elapsed() > Duration::from_secs(60) => break Err("isend not taken after 60 s".to_string()),
            Ok(None) => {}
            Err(e) => break Err(format!("isend error {}", e.code)),
        }
    };
    let res = q.and_then(|q| loop {
        match peer.p.test(q, &mut [0]) {
            Ok(true) => break Ok(()),
            Ok(false) if t0.elapsed() > Duration::from_secs(60) => break Err("not done after 60 s".to_string()),
            Ok(false) => std::thread::sleep(Duration::from_micros(200)),
            Err(e) => break Err(format!("error {}", e.code)),
        }
    });
    let took = t0.elapsed().as_millis();
    peer.say(&format!("SENT {}", if res.is_ok() { "ok" } else { "failed" }));
    peer.hear("EXIT");
    peer.p.dereg_mr(s, mh).unwrap();
    peer.p.close_send(s).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.p.close_listen(l).unwrap();
    match res {
        Ok(()) => peer.say(&format!("DONE ok send_ms={took}")),
        Err(e) => peer.say(&format!("DONE failed after {took} ms: {e}")),
    }
}

fn peer_killed_receiver_side(peer: &mut Peer, _e: &PeerEnv) {
    // A: receives from B (which gets killed); must fail, not hang.
    let (s, r, l) = peer.connect_pair();
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 8 << 20]).collect();
    let mhs: Vec<Ptr> = bufs.iter_mut().map(|b| peer.p.reg_mr(r, b.as_mut_ptr(), b.len()).unwrap()).collect();
    let post = |p: &Plugin, b: &mut Vec<u8>, mh: Ptr| loop {
        if let Some(q) = p.irecv(r, &[(b.as_mut_ptr(), b.len(), 100, mh)]).unwrap() {
            break q;
        }
    };
    let mut reqs: Vec<Ptr> = (0..4).map(|i| post(&peer.p, &mut bufs[i], mhs[i])).collect();
    peer.say("POSTED");
    let t0 = Instant::now();
    let mut err = None;
    'outer: while t0.elapsed() < Duration::from_secs(60) {
        for i in 0..reqs.len() {
            match peer.p.test(reqs[i], &mut [0; 8]) {
                // a completed 8 MiB receive: post its buffer again
                Ok(true) => reqs[i] = post(&peer.p, &mut bufs[i], mhs[i]),
                Ok(false) => {}
                Err(e) => {
                    err = Some(e);
                    break 'outer;
                }
            }
        }
    }
    let Some(e) = err else {
        peer.say("FAIL no error 60 s after the peer was killed");
        std::process::exit(1);
    };
    // the failed comm ended its events before test reported the failure
    let open_at_fail = driver::prof::report().open;
    // the send side towards the dead peer fails too (maybe after a few sends)
    let mut sbuf = vec![1u8; 1 << 20];
    let smh = peer.p.reg_mr(s, sbuf.as_mut_ptr(), sbuf.len()).unwrap();
    let t1 = Instant::now();
    let mut send_err = None;
    while t1.elapsed() < Duration::from_secs(30) && send_err.is_none() {
        match peer.p.isend(s, sbuf.as_mut_ptr(), sbuf.len(), 1, smh) {
            Err(e) => send_err = Some(e),
            Ok(Some(q)) => loop {
                match peer.p.test(q, &mut [0]) {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(e) => {
                        send_err = Some(e);
                        break;
                    }
                }
            },
            Ok(None) => {}
        }
    }
    for mh in mhs {
        peer.p.dereg_mr(r, mh).unwrap();
    }
    peer.p.dereg_mr(s, smh).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.p.close_send(s).unwrap();
    peer.p.close_listen(l).unwrap();
    peer.say(&format!(
        "DONE recv_error={} after_ms={} send_error={} open_at_fail={open_at_fail}{}",
        e.code,
        t0.elapsed().as_millis(),
        send_err.map_or(-1, |e| e.code),
        prof_summary()
    ));
}

fn peer_panic(peer: &mut Peer, _e: &PeerEnv) {
    let (s, r, l) = peer.connect_pair();
    let mut buf = vec![0u8; 64];
    let mh = peer.p.reg_mr(s, buf.as_mut_ptr(), 64).unwrap();
    let e = peer.p.isend(s, buf.as_mut_ptr(), 64, 1, mh).unwrap_err();
    // still alive: other slots keep working
    let n = peer.p.devices().unwrap();
    peer.p.dereg_mr(s, mh).unwrap();
    peer.p.close_send(s).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.p.close_listen(l).unwrap();
    peer.say(&format!("DONE isend_code={} devices_after={n}", e.code));
}

fn peer_two_contexts(peer: &mut Peer, e: &PeerEnv) {
    let version = e.version;
    two_contexts(&peer.p, peer.dev, version);
}

fn peer_misuse(peer: &mut Peer, _e: &PeerEnv) {
    let mut out = Vec::new();
    out.push(format!("devices_null={}", peer.p.devices_null().unwrap_err().code));
    let mut junk = [0x5au8; 128];
    out.push(format!("connect_garbage={}", peer.p.connect(0, &mut junk).unwrap_err().code));
    out.push(format!("props_bad_dev={}", peer.p.properties(999).unwrap_err().code));
    let (s, r, l) = peer.connect_pair();
    let mut b = [0u8; 16];
    let mh = peer.p.reg_mr(s, b.as_mut_ptr(), 16).unwrap();
    // Post the receive first: a receiver-driven transport (verbs)
    // only lets a send start once the peer's receive is posted.
    let mut rb = [0u8; 16];
    let rmh = peer.p.reg_mr(r, rb.as_mut_ptr(), 16).unwrap();
    let rq = loop {
        if let Some(q) = peer.p.irecv(r, &[(rb.as_mut_ptr(), 16, 1, rmh)]).unwrap() {
            break q;
        }
    };
    let (mut q, mut rdone) = (None, false);
    while q.is_none() {
        q = peer.p.isend(s, b.as_mut_ptr(), 16, 1, mh).unwrap();
        if !rdone {
            rdone = peer.p.test(rq, &mut [0; 8]).unwrap();
        }
    }
    let q = q.unwrap();
    while !peer.p.test(q, &mut [0]).unwrap() {}
    while !rdone {
        rdone = peer.p.test(rq, &mut [0; 8]).unwrap();
    }
    out.push(format!("stale_test={}", peer.p.test(q, &mut [0]).unwrap_err().code));
    let many: Vec<_> = (0..9).map(|_| (rb.as_mut_ptr(), 16usize, 1, rmh)).collect();
    out.push(format!("irecv_n9={}", peer.p.irecv(r, &many).unwrap_err().code));
    out.push(format!("regmr_cuda={}", peer.p.reg_mr_typed(s, b.as_mut_ptr(), 16, 2).map(|_| 0).unwrap_or_else(|e| e.code)));
    peer.p.dereg_mr(s, mh).unwrap();
    peer.p.dereg_mr(r, rmh).unwrap();
    peer.p.close_send(s).unwrap();
    peer.p.close_recv(r).unwrap();
    peer.p.close_listen(l).unwrap();
    peer.say(&format!("DONE {}", out.join(" ")));
}

fn peer_connect_churn(peer: &mut Peer, _e: &PeerEnv) {
    // One process, one plugin: N listen/connect/accept/one message/close
    // cycles over loopback; fds, threads and RSS flat after a warm-up.
    let n = (env_u64("RUSTNET_CONF_CONNECTS", 10000) as usize).max(2);
    let warm = (n / 10).clamp(10, 500).min(n - 1);
    let mut base = None;
    let t0 = Instant::now();
    for c in 0..n {
        let (mut h, l) = peer.p.listen(peer.dev).expect("listen");
        let (s, r) = peer.p.connect_accept(peer.dev, &mut h, l, Duration::from_secs(30)).expect("connect/accept");
        if let Err(e) = one_message(&peer.p, s, r, c as u8) {
            peer.say(&format!("FAIL cycle {c}: {e}"));
            std::process::exit(1);
        }
        peer.p.close_send(s).unwrap();
        peer.p.close_recv(r).unwrap();
        peer.p.close_listen(l).unwrap();
        if c + 1 == warm {
            base = Some((fd_count(), thread_count(), rss_kib()));
        }
    }
    let (fd0, th0, rss0) = base.unwrap();
    let (fd1, th1, rss1) = (fd_count(), thread_count_settled(th0), rss_kib());
    let line = format!(
        "{n} cycles in {:.1}s: fds {fd0}->{fd1}, threads {th0}->{th1}, rss {rss0}->{rss1} KiB ({:+.2}%) after {warm} warm-up cycles",
        t0.elapsed().as_secs_f64(),
        (rss1 as f64 - rss0 as f64) * 100.0 / rss0 as f64
    );
    // (44 bytes a cycle over these 3000 cycles already passes 128 KiB)
    let slack = rss_slack_kib(rss0, 1.0);
    if fd1 > fd0 || th1 > th0 || rss1 > rss0 + slack {
        peer.say(&format!("FAIL growth: {line} (allowed: +{slack} KiB)"));
        std::process::exit(1);
    }
    peer.say(&format!("DONE {line}"));
}

fn peer_handle_misuse(peer: &mut Peer, _e: &PeerEnv) {
    // Every handle kind used the wrong way: each call must return an
    // error (and the process must live), the right call still works.
    let code = |r: Result<(), driver::NcclErr>| r.map_or_else(|e| e.code, |_| 0);
    let mut out = Vec::new();
    let (s, r, l) = peer.connect_pair();
    let mut b = [0u8; 16];
    let mh = peer.p.reg_mr(s, b.as_mut_ptr(), 16).unwrap();
    let mut rb = [0u8; 16];
    let rmh = peer.p.reg_mr(r, rb.as_mut_ptr(), 16).unwrap();
    out.push(format!("closeSend_on_recv={}", code(peer.p.close_send(r))));
    out.push(format!("closeRecv_on_send={}", code(peer.p.close_recv(s))));
    out.push(format!("closeListen_on_send={}", code(peer.p.close_listen(s))));
    out.push(format!("closeSend_on_listen={}", code(peer.p.close_send(l))));
    out.push(format!("closeSend_on_mhandle={}", code(peer.p.close_send(mh))));
    out.push(format!("regMr_on_listen={}", code(peer.p.reg_mr(l, b.as_mut_ptr(), 16).map(|_| ()))));
    out.push(format!("regMr_on_mhandle={}", code(peer.p.reg_mr(mh, b.as_mut_ptr(), 16).map(|_| ()))));
    out.push(format!("deregMr_of_comm={}", code(peer.p.dereg_mr(s, s))));
    out.push(format!("isend_on_recv={}", code(peer.p.isend(r, b.as_mut_ptr(), 16, 1, mh).map(|_| ()))));
    let mut local = 0u64;
    out.push(format!("test_foreign={}", code(peer.p.test(&mut local as *mut u64 as Ptr, &mut [0]).map(|_| ()))));
    out.push(format!("test_on_comm={}", code(peer.p.test(s, &mut [0]).map(|_| ()))));
    // the same comms still work after all that: one message each way
    if let Err(e) = one_message(&peer.p, s, r, 9) {
        peer.say(&format!("FAIL after misuse the comms no longer work: {e}"));
        std::process::exit(1);
    }
    // after close / deregistration
    let mh2 = peer.p.reg_mr(s, b.as_mut_ptr(), 16).unwrap();
    peer.p.dereg_mr(s, mh2).unwrap();
    out.push(format!("deregMr_twice={}", code(peer.p.dereg_mr(s, mh2))));
    out.push(format!("isend_stale_mhandle={}", code(peer.p.isend(s, b.as_mut_ptr(), 16, 1, mh2).map(|_| ()))));
    let q = loop {
        if let Some(q) = peer.p.irecv(r, &[(rb.as_mut_ptr(), 16, 1, rmh)]).unwrap() {
            break q;
        }
    };
    peer.p.dereg_mr(s, mh).unwrap();
    peer.p.dereg_mr(r, rmh).unwrap();
    peer.p.close_recv(r).unwrap();
    out.push(format!("test_after_close={}", code(peer.p.test(q, &mut [0; 8]).map(|_| ()))));
    out.push(format!("closeRecv_twice={}", code(peer.p.close_recv(r))));
    out.push(format!("irecv_after_close={}", code(peer.p.irecv(r, &[(rb.as_mut_ptr(), 16, 1, std::ptr::null_mut())]).map(|_| ()))));
    peer.p.close_send(s).unwrap();
    out.push(format!("isend_after_close={}", code(peer.p.isend(s, b.as_mut_ptr(), 16, 1, std::ptr::null_mut()).map(|_| ()))));
    out.push(format!("closeSend_twice={}", code(peer.p.close_send(s))));
    peer.p.close_listen(l).unwrap();
    out.push(format!("accept_after_close={}", code(peer.p.accept(l).map(|_| ()))));
    out.push(format!("closeListen_twice={}", code(peer.p.close_listen(l))));
    peer.say(&format!("DONE {}", out.join(" ")));
}

fn peer_panic_mid(peer: &mut Peer, e: &PeerEnv) {
    let role = e.role.as_str();
    // RUSTNET_FAULT_PANIC names a point inside isend or test, after
    // the transport changed its state. A sends and checks: the call
    // fails with ncclInternalError, every later call on that comm
    // fails too (naming the panic), its other comm carries on, close
    // frees it all. B only receives (driving its receive with test,
    // as NCCL does: a receiver-driven transport needs it to move).
    let code = |r: Result<(), driver::NcclErr>| r.map_or_else(|e| e.code, |_| 0);
    let (s, r, l) = peer.connect_pair();
    let mut b = vec![5u8; 64 << 10];
    let mh = peer.p.reg_mr(s, b.as_mut_ptr(), b.len()).unwrap();
    let mut rb = vec![0u8; 64 << 10];
    let rmh = peer.p.reg_mr(r, rb.as_mut_ptr(), rb.len()).unwrap();
    let mut out = Vec::new();
    if role == "A" {
        // the failing call: isend itself, or the test of a started send
        let t0 = Instant::now();
        let first = 'outer: loop {
            match peer.p.isend(s, b.as_mut_ptr(), b.len(), 1, mh) {
                Ok(None) => {}
                Ok(Some(q)) => loop {
                    match peer.p.test(q, &mut [0]) {
                        Ok(true) => break 'outer ("none", 0),
                        Ok(false) => {}
                        Err(e) => break 'outer ("test", e.code),
                    }
                    assert!(t0.elapsed() < Duration::from_secs(60), "send never completed");
                },
                Err(e) => break ("isend", e.code),
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "isend never started");
        };
        out.push(format!("{}={}", first.0, first.1));
        out.push(format!("later_isend={}", code(peer.p.isend(s, b.as_mut_ptr(), 16, 1, mh).map(|_| ()))));
        out.push(format!("later_regMr={}", code(peer.p.reg_mr(s, b.as_mut_ptr(), 16).map(|_| ()))));
        // the receive comm is another comm: the sender's panic does not fail it
        out.push(format!("recv_comm_irecv={}", code(peer.p.irecv(r, &[(rb.as_mut_ptr(), 16, 2, rmh)]).map(|_| ()))));
    } else {
        let rq = loop {
            if let Some(q) = peer.p.irecv(r, &[(rb.as_mut_ptr(), rb.len(), 1, rmh)]).unwrap() {
                break q;
            }
        };
        // until it completes (or fails: an armed test:progressed panics here too)
        let t0 = Instant::now();
        let end = loop {
            match peer.p.test(rq, &mut [0; 8]) {
                Ok(true) => break 0,
                Ok(false) if t0.elapsed() < Duration::from_secs(15) => {}
                Ok(false) => break -1,
                Err(e) => break e.code,
            }
        };
        out.push(format!("recv={end}"));
    }
    peer.say("CYCLE");
    peer.hear("GO");
    out.push(format!("deregMr={}", code(peer.p.dereg_mr(s, mh))));
    out.push(format!("closeSend={}", code(peer.p.close_send(s))));
    peer.p.dereg_mr(r, rmh).unwrap();
    out.push(format!("closeRecv={}", code(peer.p.close_recv(r))));
    peer.p.close_listen(l).unwrap();
    peer.say(&format!("DONE {} fds={}", out.join(" "), fd_count()));
}

// ------------------------------------------------------------- coordinator

struct Proc {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    stderr: StderrLog,
}

impl Proc {
    fn expect(&self, prefix: &str, timeout: Duration) -> Result<String, String> {
        let t0 = Instant::now();
        loop {
            let left = timeout.checked_sub(t0.elapsed()).ok_or_else(|| format!("timeout waiting for {prefix}"))?;
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Some(rest) = l.strip_prefix(prefix) {
                        return Ok(rest.trim().to_string());
                    }
                    if l.starts_with("FAIL") {
                        std::thread::sleep(Duration::from_millis(200));
                        let tail = self.stderr.tail_chars(3000);
                        return Err(format!("{l}\n    its stderr (tail):\n{tail}"));
                    }
                    if l.starts_with("INITFAIL") {
                        return Err(l);
                    }
                }
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(200));
                    return Err(format!("peer ended or timed out waiting for {prefix:?}; its stderr:\n{}", self.stderr.text()));
                }
            }
        }
    }
    fn send(&mut self, line: &str) {
        let _ = writeln!(self.stdin, "{line}");
        let _ = self.stdin.flush();
    }
}

fn libdir() -> PathBuf {
    // A directory holding the plugin under the file names NCCL tries. Made once
    // per run: re-creating the links while an earlier peer is still in dlopen
    // made that peer fail with "cannot open shared object file".
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let so = driver::default_plugin_path();
        assert!(so.exists(), "built plugin not found at {} (cargo build first, or set RUSTNET_PLUGIN)", so.display());
        let dir = std::env::temp_dir().join(format!("rustnet-conf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["libnccl-net-rustnet.so", "libnccl-net-librustnet.so", "librustnet.so"] {
            let l = dir.join(name);
            let _ = std::fs::remove_file(&l);
            std::os::unix::fs::symlink(&so, &l).unwrap();
        }
        dir
    })
    .clone()
}

fn spawn(role: &str, version: u32, half: &PeerHalf, extra: &[(&str, &str)]) -> Proc {
    spawn_in(None, role, version, half, extra)
}

fn spawn_in(netns: Option<&str>, role: &str, version: u32, half: &PeerHalf, extra: &[(&str, &str)]) -> Proc {
    let mut cmd = peer_command(netns);
    cmd.env("RUSTNET_CONF_ROLE", role)
        .env("RUSTNET_CONF_VERSION", version.to_string())
        .env("RUSTNET_CONF_SCENARIO", half.name)
        .env("LD_LIBRARY_PATH", libdir());
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
        cmd.env("NCCL_SOCKET_IFNAME", "lo");
    }
    let per = std::env::var(format!("RUSTNET_CONF_{role}_ENV")).unwrap_or_default();
    for kv in per.split_whitespace() {
        if let Some((k, v)) = kv.split_once('=') {
            cmd.env(k, v);
        }
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let (tx, rx) = mpsc::channel();
    let (child, stdin, stderr) = spawn_piped(cmd, move |l| tx.send(l).is_ok());
    Proc { child, stdin, lines: rx, stderr }
}

fn swap_handles(a: &mut Proc, b: &mut Proc, t: Duration) -> Result<(), String> {
    let ha = a.expect("HANDLE ", t)?;
    let hb = b.expect("HANDLE ", t)?;
    a.send(&format!("PEER {hb}"));
    b.send(&format!("PEER {ha}"));
    Ok(())
}

fn finish(mut a: Proc) -> Result<String, String> {
    let r = a.expect("DONE", Duration::from_secs(60));
    let _ = a.child.kill();
    let _ = a.child.wait();
    r
}

fn traffic_case(version: u32, env: &[(&str, &str)]) -> Result<String, String> {
    let t = Duration::from_secs(240);
    let mut a = spawn("A", version, &TRAFFIC, env);
    let mut b = spawn("B", version, &TRAFFIC, env);
    let cycles = env
        .iter()
        .find(|(k, _)| *k == "RUSTNET_CONF_CYCLES")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(env_u64("RUSTNET_CONF_CYCLES", 3));
    // A's failure is read first, but it is often B's that caused it (A then
    // sees its peer close): the other peer's stderr goes with the error
    let with_peer = |e: String, peer: &StderrLog, name: &str| {
        std::thread::sleep(Duration::from_millis(200));
        format!("{e}\n    and {name}'s stderr (tail):\n{}", peer.tail_chars(3000))
    };
    for _ in 0..cycles {
        swap_handles(&mut a, &mut b, t)?;
        a.expect("CYCLE", t).map_err(|e| with_peer(e, &b.stderr, "B"))?;
        b.expect("CYCLE", t).map_err(|e| with_peer(e, &a.stderr, "A"))?;
        a.send("GO");
        b.send("GO");
    }
    let (la, lb) = (a.stderr.clone(), b.stderr.clone());
    let ra = finish(a).map_err(|e| with_peer(e, &lb, "B"))?;
    let rb = finish(b).map_err(|e| with_peer(e, &la, "A"))?;
    // comms that recovered after a fault (the VM suite injects QP errors
    // with RUSTNET_FAULT_QP_ERROR and says RUSTNET_CONF_WANT_RECOVERY=1)
    let recovered = |l: &StderrLog| {
        l.wait_eof(Duration::from_secs(5));
        l.text().lines().filter(|x| x.contains(" recovered in ")).count()
    };
    let n = recovered(&la) + recovered(&lb);
    if n == 0 && std::env::var("RUSTNET_CONF_WANT_RECOVERY").as_deref() == Ok("1") {
        return Err(format!("no comm recovered, though faults were injected (RUSTNET_FAULT_QP_ERROR): A: {ra}; B: {rb}"));
    }
    let rec = if n > 0 { format!(" recoveries={n}") } else { String::new() };
    // connects whose move to RTR the link cut short, tried again (verbs;
    // RUSTNET_FAULT_RTR drives it)
    let cut = |l: &StderrLog| l.text().lines().filter(|x| x.contains("the link went away inside the call")).count();
    let (ca, cb) = (cut(&la), cut(&lb));
    let rtr = if ca + cb > 0 { format!(" rtr_retries={ca}+{cb}") } else { String::new() };
    Ok(format!("A: {ra}; B: {rb}{rec}{rtr}"))
}

/// Verbs, issue 20 (a flap during connect): the link goes away inside the
/// move of a new connection's QPs to RTR (RoCE resolves the peer's address
/// in that call, which then times out; seen once in the VM suite, where it
/// failed the connect). RUSTNET_FAULT_RTR=3 fails each process's first
/// three such moves with ETIMEDOUT: the connecting end must move the same
/// QPs again (the receiver has their numbers), the accepting end start over
/// with new ones, and the traffic then pass with every byte right.
fn verbs_connect_rtr_cut_short_case() -> Result<String, String> {
    let out = traffic_case(8, &[("RUSTNET_FAULT_RTR", "3"), ("RUSTNET_CONF_CYCLES", "1")])?;
    let per: Vec<usize> = out
        .split(" rtr_retries=")
        .nth(1)
        .and_then(|x| x.split_whitespace().next())
        .map(|x| x.split('+').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_default();
    if per.len() != 2 || per.iter().any(|&n| n < 3) {
        return Err(format!("expected each peer to try at least 3 moves to RTR again (RUSTNET_FAULT_RTR=3), saw {per:?}: {out}"));
    }
    Ok(out)
}

fn killed_peer_case() -> Result<String, String> {
    killed_peer_case_with(8, &[])
}

fn killed_peer_case_with(version: u32, env: &[(&str, &str)]) -> Result<String, String> {
    let t = Duration::from_secs(60);
    let mut a = spawn("A", version, &KILLED_RECEIVER_SIDE, env);
    let mut b = spawn("B", version, &KILLED_SENDER, env);
    swap_handles(&mut a, &mut b, t)?;
    a.expect("POSTED", t)?;
    b.expect("STARTED", t)?;
    std::thread::sleep(Duration::from_millis(200));
    let _ = b.child.kill(); // SIGKILL mid-transfer
    let _ = b.child.wait();
    let r = finish(a)?;
    if !r.contains("recv_error=6") {
        return Err(format!("expected ncclRemoteError (6) on the receive side: {r}"));
    }
    if !r.contains("send_error=6") && !r.contains("send_error=2") {
        return Err(format!("expected an error on the send side too: {r}"));
    }
    Ok(r)
}

/// The transport the peers use ("ib" when RUSTNET_TRANSPORT says so).
fn on_verbs() -> bool {
    std::env::var("RUSTNET_TRANSPORT").as_deref() == Ok("ib")
}

/// Pull `key=N` out of a peer's DONE line.
fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok()).unwrap_or(0)
}

/// ABI v10 traffic with the driver's profiler callback checking every call:
/// both peers report exact pairing (as many stops as starts, none open after
/// close, no stop without a start, none open when test reports its request
/// done), parent handles as handed out, and events of the transport in use
/// (QP events on verbs, socket events on TCP) covering the bytes moved.
fn profiler_case(env: &[(&str, &str)]) -> Result<String, String> {
    profiler_case_with(10, env, true)
}

/// `all_bytes`: the events must cover every byte moved (not so beyond 8
/// streams or QPs: pieces past the eighth of a message carry no event).
fn profiler_case_with(version: u32, env: &[(&str, &str)], all_bytes: bool) -> Result<String, String> {
    let mut e: Vec<(&str, &str)> = vec![("RUSTNET_DRIVER_PROFILER", "check"), ("RUSTNET_CONF_CYCLES", "2")];
    e.extend_from_slice(env);
    let r = traffic_case(version, &e)?;
    for side in r.split("; ") {
        if !side.contains("prof=ok") {
            return Err(format!("profiler events not paired or malformed: {side}"));
        }
        let (ib, sock) = (field(side, "ib"), field(side, "sock"));
        if on_verbs() && (ib == 0 || sock > 0) || !on_verbs() && (sock == 0 || ib > 0) {
            return Err(format!("events of the wrong transport (ib={ib} sock={sock}): {side}"));
        }
        // every byte moved lies in some event (sends and receives; verbs
        // receive events carry the most a QP can land, so >=)
        if all_bytes && field(side, "ev_bytes") < field(side, "bytes") {
            return Err(format!("events cover fewer bytes than moved: {side}"));
        }
    }
    Ok(r)
}

/// RUSTNET_PROFILER=0: the plugin ignores NCCL's callback (not one call).
fn profiler_off_case() -> Result<String, String> {
    let e = [("RUSTNET_DRIVER_PROFILER", "check"), ("RUSTNET_CONF_CYCLES", "1"), ("RUSTNET_PROFILER", "0")];
    let r = traffic_case(10, &e)?;
    if r.matches("starts=0 stops=0 open=0").count() != 2 || r.contains("errors=") {
        return Err(format!("events with RUSTNET_PROFILER=0: {r}"));
    }
    Ok(r)
}

/// A peer killed mid-transfer with the profiler on: the failed comm stops
/// its open events before test reports the failure, and pairing holds.
fn profiler_killed_case() -> Result<String, String> {
    let r = killed_peer_case_with(10, &[("RUSTNET_DRIVER_PROFILER", "check")])?;
    if !r.contains("prof=ok") || !r.contains("open_at_fail=0") {
        return Err(format!("events open after the failure, or unpaired: {r}"));
    }
    Ok(r)
}

fn garbage_case() -> Result<String, String> {
    let t = Duration::from_secs(60);
    let mut a = spawn("A", 8, &TRAFFIC, &[("RUSTNET_CONF_CYCLES", "1"), ("RUSTNET_CONF_ROUNDS", "5")]);
    let mut b = spawn("B", 8, &TRAFFIC, &[("RUSTNET_CONF_CYCLES", "1"), ("RUSTNET_CONF_ROUNDS", "5")]);
    let ha = a.expect("HANDLE ", t)?;
    let hb = b.expect("HANDLE ", t)?;
    // Speak garbage at A's listener before B connects, and drop a half hello.
    let raw = unhex(&ha).unwrap();
    let port = u16::from_le_bytes([raw[12], raw[13]]);
    let ip = std::net::Ipv4Addr::new(raw[16], raw[17], raw[18], raw[19]);
    if raw[11] == 4 {
        let mut g = std::net::TcpStream::connect((ip, port)).map_err(|e| e.to_string())?;
        g.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\ngarbage garbage garbage").unwrap();
        let mut h = std::net::TcpStream::connect((ip, port)).map_err(|e| e.to_string())?;
        h.write_all(&raw[..10]).unwrap();
        drop(h);
        std::thread::sleep(Duration::from_millis(100));
        a.send(&format!("PEER {hb}"));
        b.send(&format!("PEER {ha}"));
        a.expect("CYCLE", t)?;
        b.expect("CYCLE", t)?;
        a.send("GO");
        b.send("GO");
        drop(g);
    } else {
        return Err("garbage test needs an IPv4 listener".into());
    }
    let ea = a.stderr.clone();
    let ra = finish(a)?;
    finish(b)?;
    if !garbage_warned(&ea.text()) {
        return Err(format!("no WARN naming the rejected connection; A's stderr: {}", ea.text()));
    }
    Ok(ra)
}

/// Two network namespaces joined by a veth pair; removed on drop.
struct NetnsPair {
    a: String,
    b: String,
    /// A's end of the veth is `rnA{id}`.
    id: u32,
}

impl NetnsPair {
    fn new() -> Result<NetnsPair, String> {
        let id = std::process::id() % 100000;
        let (a, b) = (format!("rncutA{id}"), format!("rncutB{id}"));
        let p = NetnsPair { a: a.clone(), b: b.clone(), id };
        let ok = sh(&format!("ip netns add {a}"))
            && sh(&format!("ip netns add {b}"))
            && sh(&format!("ip link add rnA{id} netns {a} type veth peer name rnB{id} netns {b}"))
            && sh(&format!("ip -n {a} addr add 10.78.0.1/24 dev rnA{id} && ip -n {a} link set rnA{id} up && ip -n {a} link set lo up"))
            && sh(&format!("ip -n {b} addr add 10.78.0.2/24 dev rnB{id} && ip -n {b} link set rnB{id} up && ip -n {b} link set lo up"))
            && sh(&format!("ip -n {a} addr add fd78::1/64 dev rnA{id} nodad && ip -n {b} addr add fd78::2/64 dev rnB{id} nodad"));
        // carrier comes up asynchronously (linkwatch): wait for it on both ends
        let up = |ns: &str, dev: &str| sh(&format!("ip -n {ns} link show dev {dev} | grep -q LOWER_UP"));
        let t0 = Instant::now();
        while ok && !(up(&a, &format!("rnA{id}")) && up(&b, &format!("rnB{id}"))) && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(50));
        }
        if ok {
            Ok(p)
        } else {
            Err("could not build the namespace pair".into())
        }
    }
}

impl NetnsPair {
    /// Take A's end of the link down (a cut) or up again.
    fn link(&self, up: bool) -> Result<(), String> {
        let (st, what) = if up { ("up", "restore") } else { ("down", "cut") };
        sh(&format!("ip -n {} link set rnA{} {st}", self.a, self.id)).then_some(()).ok_or_else(|| format!("could not {what} the link"))
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        sh(&format!("ip netns del {}", self.a));
        sh(&format!("ip netns del {}", self.b));
    }
}

/// A silent dead peer (the link cut, no FIN, no RST) with recovery off
/// (RUSTNET_RECOVERY_TIMEOUT=0): both ends must fail within
/// RUSTNET_SOCKET_TIMEOUT (keepalive; the sender's acknowledgement watch), not hang.
fn link_cut_case() -> Result<String, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !sh("ip netns list") {
        return Err("SKIPPED: needs root and iproute2 (ip netns) to cut a link".into());
    }
    let ns = NetnsPair::new()?;
    let t = Duration::from_secs(30);
    let env_a = [("RUSTNET_SOCKET_TIMEOUT", "3"), ("RUSTNET_RECOVERY_TIMEOUT", "0"), ("NCCL_SOCKET_IFNAME", "rnA")];
    let env_b = [("RUSTNET_SOCKET_TIMEOUT", "3"), ("RUSTNET_RECOVERY_TIMEOUT", "0"), ("NCCL_SOCKET_IFNAME", "rnB")];
    let mut a = spawn_in(Some(&ns.a), "A", 8, &KILLED_RECEIVER_SIDE, &env_a);
    let mut b = spawn_in(Some(&ns.b), "B", 8, &CUT_SENDER, &env_b);
    swap_handles(&mut a, &mut b, t).map_err(|e| format!("{e}; A: {}; B: {}", a.stderr.text(), b.stderr.text()))?;
    a.expect("POSTED", t)?;
    b.expect("STARTED", t)?;
    std::thread::sleep(Duration::from_millis(300));
    let cut = Instant::now();
    ns.link(false)?;
    let rb = b.expect("DONE", Duration::from_secs(20)).map_err(|e| format!("sender did not fail within 20 s of the cut: {e}"))?;
    let tb = cut.elapsed();
    let ra = a.expect("DONE", Duration::from_secs(40)).map_err(|e| format!("receiver did not fail: {e}"))?;
    let ta = cut.elapsed();
    let _ = a.child.kill();
    let _ = b.child.kill();
    let _ = a.child.wait();
    let _ = b.child.wait();
    if !rb.contains("send_error=6") || !ra.contains("recv_error=6") {
        return Err(format!("expected ncclRemoteError on both ends: sender {rb}; receiver {ra}"));
    }
    if tb > Duration::from_secs(15) || ta > Duration::from_secs(15) {
        return Err(format!("too slow: sender {tb:?}, receiver {ta:?} after the cut (timeout 3 s)"));
    }
    Ok(format!(
        "sender failed {:.1}s, receiver {:.1}s after the cut (RUSTNET_SOCKET_TIMEOUT=3): {rb}; {ra}",
        tb.as_secs_f64(),
        ta.as_secs_f64()
    ))
}

/// Root and iproute2, or why the case is skipped.
fn need_netns(what: &str) -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !sh("ip netns list") {
        return Err(format!("SKIPPED: needs root and iproute2 (ip netns) {what}"));
    }
    Ok(())
}

/// What the peers' logs say about their recoveries: (comms recovered, bytes sent again).
fn recoveries_in(logs: &[&StderrLog]) -> (usize, u64) {
    let mut n = 0;
    let mut bytes = 0;
    for l in logs {
        for line in l.text().lines().filter(|x| x.contains("TCP send comm to") && x.contains("recovered after")) {
            n += 1;
            bytes += line.split("; ").last().and_then(|t| t.split_whitespace().next()).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    (n, bytes)
}

/// How long each send comm's recovery took, per the logs ("recovered after X s"), s.
fn recovery_secs(logs: &[&StderrLog]) -> Vec<f64> {
    let mut v = Vec::new();
    for l in logs {
        for line in l.text().lines().filter(|x| x.contains("TCP send comm to")) {
            if let Some(t) = line.split("recovered after ").nth(1).and_then(|t| t.split_whitespace().next()).and_then(|t| t.parse().ok()) {
                v.push(t);
            }
        }
    }
    v
}

/// After the link came back at `up`: both peers finish their traffic
/// (CYCLE within `limit`), then close. How long after `up` both had
/// finished, their DONE lines and their stderr.
fn finish_after_link_up(
    mut a: Proc,
    mut b: Proc,
    up: Instant,
    limit: Duration,
) -> Result<(Duration, String, String, StderrLog, StderrLog), String> {
    let done = |p: &Proc, who: &str| {
        p.expect("CYCLE", limit)
            .map_err(|e| format!("{who} did not finish after the link came back: {e}; its stderr:\n{}", p.stderr.tail(30)))
    };
    done(&a, "A")?;
    done(&b, "B")?;
    let after = up.elapsed();
    a.send("GO");
    b.send("GO");
    let (ea, eb) = (a.stderr.clone(), b.stderr.clone());
    let ra = finish(a)?;
    let rb = finish(b)?;
    Ok((after, ra, rb, ea, eb))
}

/// Traffic both ways between two namespaces while the link goes down for
/// `down`, longer than RUSTNET_SOCKET_TIMEOUT=3 (issue 20's goal: a 20 s
/// cut, 0 failures): the send comms notice the silence, reconnect through
/// the receivers' resume ports once the link is back and resend what was
/// not taken; every byte arrives once (the traffic loop checks each).
fn link_cut_recovers_case(down: Duration) -> Result<String, String> {
    need_netns("to cut a link")?;
    let ns = NetnsPair::new()?;
    let t = Duration::from_secs(60);
    let common = [("RUSTNET_SOCKET_TIMEOUT", "3"), ("RUSTNET_CONF_RUNS", "30"), ("RUSTNET_CONF_ROUNDS", "20")];
    let env = |ifn| [common[0], common[1], common[2], ("NCCL_SOCKET_IFNAME", ifn)];
    let mut a = spawn_in(Some(&ns.a), "A", 8, &RECOVERING_TRAFFIC, &env("rnA"));
    let mut b = spawn_in(Some(&ns.b), "B", 8, &RECOVERING_TRAFFIC, &env("rnB"));
    swap_handles(&mut a, &mut b, t).map_err(|e| format!("{e}; A: {}; B: {}", a.stderr.text(), b.stderr.text()))?;
    a.expect("RUN 1", t)?;
    let cut = Instant::now();
    ns.link(false)?;
    std::thread::sleep(down);
    ns.link(true)?;
    let up = Instant::now();
    // traffic flowing again: every send comm that set out to reconnect says it recovered
    let count = |pat: &str| a.stderr.text().matches(pat).count() + b.stderr.text().matches(pat).count();
    let flowing = loop {
        let (going, back) = (count("reconnecting to its resume port"), count("TCP send comm to"));
        let recovered = back - going;
        if going > 0 && recovered >= going {
            break Some(up.elapsed());
        }
        if up.elapsed() > Duration::from_secs(60) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (after, ra, rb, ea, eb) = finish_after_link_up(a, b, up, Duration::from_secs(120))?;
    let (n, bytes) = recoveries_in(&[&ea, &eb]);
    if n == 0 {
        return Err(format!("the traffic went on but no send comm says it recovered; A: {}; B: {}", ea.tail(20), eb.tail(20)));
    }
    let took: Vec<String> = recovery_secs(&[&ea, &eb]).iter().map(|s| format!("{s:.1}")).collect();
    let flowing = flowing.ok_or("no send comm said it recovered within 60 s of the link coming back")?;
    Ok(format!(
        "link down {:.1} s (RUSTNET_SOCKET_TIMEOUT=3); traffic flowing again {:.2} s after it came back (every \
         reconnecting send comm recovered), both finished {:.1} s after; {n} send comm(s) recovered (after {} s, counted \
         from noticing the silence), {bytes} bytes sent again; 0 failures; A: {ra}; B: {rb}",
        (up - cut).as_secs_f64(),
        flowing.as_secs_f64(),
        after.as_secs_f64(),
        took.join(", ")
    ))
}

/// The link down while both ends connect (issue 20: "a flap during
/// connect"; NCCL's own PR #1311 asks the same after an IPoIB flap): the
/// handles are swapped with the link already down, it comes back after
/// `down`. Each connect dials again until RUSTNET_CONNECT_TIMEOUT instead
/// of failing on "no route" or "host unreachable"; then the traffic runs
/// both ways, every byte checked.
fn link_cut_during_connect_case(down: Duration) -> Result<String, String> {
    need_netns("to cut a link")?;
    let ns = NetnsPair::new()?;
    let t = Duration::from_secs(60);
    let env =
        |ifn| [("RUSTNET_SOCKET_TIMEOUT", "3"), ("RUSTNET_CONF_RUNS", "3"), ("RUSTNET_CONF_ROUNDS", "10"), ("NCCL_SOCKET_IFNAME", ifn)];
    let mut a = spawn_in(Some(&ns.a), "A", 8, &RECOVERING_TRAFFIC, &env("rnA"));
    let mut b = spawn_in(Some(&ns.b), "B", 8, &RECOVERING_TRAFFIC, &env("rnB"));
    let ha = a.expect("HANDLE ", t)?;
    let hb = b.expect("HANDLE ", t)?;
    ns.link(false)?;
    a.send(&format!("PEER {hb}"));
    b.send(&format!("PEER {ha}"));
    std::thread::sleep(down);
    ns.link(true)?;
    let up = Instant::now();
    let (after, ra, rb, ea, eb) = finish_after_link_up(a, b, up, Duration::from_secs(90))?;
    let redials = ea.text().matches("dialling again").count() + eb.text().matches("dialling again").count();
    if redials == 0 {
        return Err(format!("no connect says it dialled again: the cut missed the set-up; A: {}; B: {}", ea.tail(20), eb.tail(20)));
    }
    Ok(format!(
        "link down {:.1} s from before either connect; {redials} connect(s) dialled again, both finished {:.1} s after it \
         came back; 0 failures; A: {ra}; B: {rb}",
        down.as_secs_f64(),
        after.as_secs_f64()
    ))
}

/// The link cut while A's connect waits for B's acceptance, its hellos
/// delivered (CI's soak failure of stop 31): B's listener holds them and
/// answers only later, during the cut, so A's stream ends (keepalive)
/// before the acceptance arrives, while B's NCCL already has the comm.
/// A's connect finishes as a comm that reconnects through B's resume port
/// (named in the handle) once the link is back; every byte arrives once.
fn link_cut_before_acceptance_case() -> Result<String, String> {
    need_netns("to cut a link")?;
    let ns = NetnsPair::new()?;
    let t = Duration::from_secs(60);
    let env = |ifn| {
        [
            ("RUSTNET_SOCKET_TIMEOUT", "2"),
            ("RUSTNET_CONF_RUNS", "3"),
            ("RUSTNET_CONF_ROUNDS", "10"),
            ("RUSTNET_CONF_LATE_ACCEPT", "1"),
            ("NCCL_SOCKET_IFNAME", ifn),
        ]
    };
    let mut a = spawn_in(Some(&ns.a), "A", 8, &RECOVERING_TRAFFIC, &env("rnA"));
    let mut b = spawn_in(Some(&ns.b), "B", 8, &RECOVERING_TRAFFIC, &env("rnB"));
    swap_handles(&mut a, &mut b, t)?;
    b.expect("CONNECTED", t)?;
    // A's hellos are in B's socket buffers by now; B has not answered them
    std::thread::sleep(Duration::from_millis(300));
    ns.link(false)?;
    // A's keepalive (RUSTNET_SOCKET_TIMEOUT=2) ends its streams meanwhile
    let cut_warn = "after every hello was sent";
    let t0 = Instant::now();
    while !a.stderr.text().contains(cut_warn) {
        if a.stderr.text().contains("panicked") {
            let _ = ns.link(true);
            return Err(format!("A's connect failed during the cut instead of finishing as a recovering comm: {}", a.stderr.tail(8)));
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = ns.link(true);
            return Err(format!("A's connect never gave up its streams during the cut; A: {}", a.stderr.tail(20)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // B's NCCL accepts now: its acceptance goes nowhere, its comm is handed out
    b.send("ACCEPT");
    std::thread::sleep(Duration::from_secs(1));
    ns.link(true)?;
    let down = t0.elapsed() + Duration::from_millis(300);
    let up = Instant::now();
    let (after, ra, rb, ea, eb) = finish_after_link_up(a, b, up, Duration::from_secs(90))?;
    let (n, bytes) = recoveries_in(&[&ea, &eb]);
    if n == 0 {
        return Err(format!("the traffic went on but no send comm says it recovered; A: {}; B: {}", ea.tail(20), eb.tail(20)));
    }
    Ok(format!(
        "link down {:.1} s from A waiting for B's acceptance; A's connect finished as a recovering comm, {n} recovery(ies), \
         {bytes} bytes sent again, both finished {:.1} s after the link came back; 0 failures; A: {ra}; B: {rb}",
        down.as_secs_f64(),
        after.as_secs_f64()
    ))
}

/// A cut that outlasts the recovery window (RUSTNET_RECOVERY_TIMEOUT=4):
/// both ends fail, each naming its peer, the time waited and the knob.
fn link_cut_past_window_case() -> Result<String, String> {
    need_netns("to cut a link")?;
    let ns = NetnsPair::new()?;
    let t = Duration::from_secs(30);
    let env = |ifn| [("RUSTNET_SOCKET_TIMEOUT", "3"), ("RUSTNET_RECOVERY_TIMEOUT", "4"), ("NCCL_SOCKET_IFNAME", ifn)];
    let mut a = spawn_in(Some(&ns.a), "A", 8, &KILLED_RECEIVER_SIDE, &env("rnA"));
    let mut b = spawn_in(Some(&ns.b), "B", 8, &CUT_SENDER, &env("rnB"));
    swap_handles(&mut a, &mut b, t)?;
    a.expect("POSTED", t)?;
    b.expect("STARTED", t)?;
    std::thread::sleep(Duration::from_millis(300));
    let cut = Instant::now();
    ns.link(false)?;
    let rb = b.expect("DONE", Duration::from_secs(30)).map_err(|e| format!("sender did not fail within 30 s of the cut: {e}"))?;
    let tb = cut.elapsed();
    let ra = a.expect("DONE", Duration::from_secs(60)).map_err(|e| format!("receiver did not fail: {e}"))?;
    a.stderr.wait_eof(Duration::from_secs(10));
    b.stderr.wait_eof(Duration::from_secs(10));
    let (ea, eb) = (a.stderr.text(), b.stderr.text());
    for p in [&mut a, &mut b] {
        let _ = p.child.kill();
        let _ = p.child.wait();
    }
    if !rb.contains("send_error=6") || !ra.contains("recv_error=6") {
        return Err(format!("expected ncclRemoteError on both ends: sender {rb}; receiver {ra}"));
    }
    let named =
        |log: &str, peer: &str| log.lines().any(|l| l.contains("RUSTNET_RECOVERY_TIMEOUT=4") && l.contains(peer) && l.contains("gave up"));
    if !named(&eb, "10.78.0.1") || !named(&ea, "10.78.0.2") {
        return Err(format!("an error does not name the peer, the time and RUSTNET_RECOVERY_TIMEOUT=4; A: {ea}; B: {eb}"));
    }
    if tb < Duration::from_secs(4) || tb > Duration::from_secs(20) {
        return Err(format!("the sender failed {tb:?} after the cut (window 4 s after 3 s of silence)"));
    }
    let line =
        |log: &str| log.lines().find(|l| l.contains("RUSTNET_RECOVERY_TIMEOUT=4") && l.contains("gave up")).unwrap_or("").to_string();
    Ok(format!("sender failed {:.1} s after the cut: {}; receiver: {}", tb.as_secs_f64(), line(&eb), line(&ea)))
}

/// The late-sender cases' start: receiver A and sender B between two
/// namespaces (`RUSTNET_SOCKET_TIMEOUT=3`, the given recovery window), A's
/// second receive posted and B away after its first send; then the link is
/// cut. Returns the namespaces and both peers.
fn late_pair_cut(window_s: &str) -> Result<(NetnsPair, Proc, Proc), String> {
    need_netns("to cut a link")?;
    let ns = NetnsPair::new()?;
    let t = Duration::from_secs(30);
    let env = |ifn| [("RUSTNET_SOCKET_TIMEOUT", "3"), ("RUSTNET_RECOVERY_TIMEOUT", window_s), ("NCCL_SOCKET_IFNAME", ifn)];
    let mut a = spawn_in(Some(&ns.a), "A", 8, &LATE_RECEIVER, &env("rnA"));
    let mut b = spawn_in(Some(&ns.b), "B", 8, &LATE_SENDER, &env("rnB"));
    swap_handles(&mut a, &mut b, t)?;
    a.expect("POSTED", t)?;
    b.expect("READY", t)?;
    ns.link(false)?;
    Ok((ns, a, b))
}

/// TCP, issue 20 ("a link flap ends a week-long job"): a link cut of 6 s
/// (past RUSTNET_SOCKET_TIMEOUT=3) while a receive waits and its sender's
/// rank is away; the link comes back and the sender stays away 10 s more,
/// longer than RUSTNET_RECOVERY_TIMEOUT=6 counted from the fault. The
/// receiver's window runs in full only while the sender's process does not
/// answer its probes (the cut), so it waits; the sender reconnects at its
/// next send and all 1 MiB arrives. (Until stop 33 the receiver failed about
/// 9.5 s after the cut: "the sender did not reconnect within ...".)
fn tcp_late_sender_case() -> Result<String, String> {
    let (ns, a, mut b) = late_pair_cut("6")?;
    std::thread::sleep(Duration::from_secs(6));
    ns.link(true)?;
    std::thread::sleep(Duration::from_secs(10));
    b.send("GO");
    let (ea, eb) = (a.stderr.clone(), b.stderr.clone());
    let ra = finish(a).map_err(|e| format!("A: {e}; its stderr:\n{}", ea.tail(20)))?;
    let rb = finish(b).map_err(|e| format!("B: {e}; its stderr:\n{}", eb.tail(20)))?;
    let ok = |l: &str| l.trim_start().starts_with("ok ");
    if !ok(&ra) || !ok(&rb) || field(&ra, "bad_bytes") != 0 || field(&ra, "size") != 1 << 20 {
        return Err(format!("A: {ra}; B: {rb}; A's stderr:\n{}\nB's stderr:\n{}", ea.tail(20), eb.tail(20)));
    }
    let waited = ea.tail(200).lines().any(|l| l.contains("waiting for the sender to reconnect"));
    if !waited {
        return Err(format!("the receiver never noticed the cut (the case tests nothing): {}", ea.tail(20)));
    }
    Ok(format!(
        "receiver noticed the 6 s cut, waited {:.1} s in all (RUSTNET_RECOVERY_TIMEOUT=6) for its late sender and got all 1 MiB, every byte right",
        field(&ra, "waited_ms") as f64 / 1e3
    ))
}

/// A sender whose rank closes its send comm while the link is cut, its
/// process and its other comms alive (NCCL gave up on that comm): once the
/// link is back, the waiting receiver asks the sender's resume port about
/// the comm, hears "closed" and fails within about a second, instead of
/// waiting for it as for a late rank (up to ten windows).
fn tcp_sender_comm_closed_case() -> Result<String, String> {
    let t = Duration::from_secs(30);
    // a window long enough that only the sender's answer can end the wait in time
    let (ns, mut a, mut b) = late_pair_cut("60")?;
    // past RUSTNET_SOCKET_TIMEOUT: the receiver waits for its sender
    std::thread::sleep(Duration::from_secs(6));
    b.send("CLOSE");
    b.expect("CLOSED", t)?;
    ns.link(true)?;
    let up = Instant::now();
    let (ea, eb) = (a.stderr.clone(), b.stderr.clone());
    let ra = a.expect("DONE", Duration::from_secs(60)).map_err(|e| format!("A: {e}; its stderr:\n{}", ea.tail(20)))?;
    let took = up.elapsed();
    b.send("EXIT");
    let rb = finish(b).map_err(|e| format!("B: {e}; its stderr:\n{}", eb.tail(20)))?;
    // A exits after DONE: its stderr (read by another thread) is then complete
    a.stderr.wait_eof(Duration::from_secs(20));
    let log = a.stderr.text();
    let _ = a.child.kill();
    let _ = a.child.wait();
    let said = log.lines().find(|l| l.contains("its end of this comm failed or was closed")).unwrap_or("").to_string();
    if !ra.contains("failed") || said.is_empty() || !rb.contains("closed") {
        return Err(format!("expected A to fail saying its sender's comm was closed: A: {ra}; B: {rb}; A's stderr:\n{}", ea.tail(20)));
    }
    if !log.contains("waiting for the sender to reconnect") {
        return Err(format!("the receiver never noticed the cut (the case tests nothing): {}", ea.tail(20)));
    }
    if took > Duration::from_secs(10) {
        return Err(format!("the receiver took {took:?} after the link came back: {said}"));
    }
    Ok(format!("the receiver failed {:.1} s after link-up (RUSTNET_RECOVERY_TIMEOUT=60): {said}", took.as_secs_f64()))
}

/// The killed-during-recovery cases' common part: kill the sender `b`
/// (`kill_sender`) or the receiver `a`, bring the link back (`link_up`),
/// wait for the survivor's DONE line, which must report the remote error on
/// its side. Returns the survivor's whole stderr and how long after link-up
/// it failed.
fn kill_then_link_up(
    a: &mut Proc,
    b: &mut Proc,
    kill_sender: bool,
    link_up: impl FnOnce() -> Result<(), String>,
) -> Result<(String, Duration), String> {
    let (victim, survivor, what) = if kill_sender { (b, a, "recv_error=6") } else { (a, b, "send_error=6") };
    let _ = victim.child.kill();
    let _ = victim.child.wait();
    link_up()?;
    let up = Instant::now();
    let r = survivor
        .expect("DONE", Duration::from_secs(60))
        .map_err(|e| format!("the survivor did not fail: {e}; {}", survivor.stderr.tail(20)))?;
    let took = up.elapsed();
    // the peer exits after DONE: its stderr (read by another thread) is then complete
    survivor.stderr.wait_eof(Duration::from_secs(40));
    let log = survivor.stderr.text();
    let _ = survivor.child.kill();
    let _ = survivor.child.wait();
    // (the receiver also tries its send side afterwards: its line comes later)
    if !r.contains(what) {
        return Err(format!("expected {what}: {r}"));
    }
    Ok((log, took))
}

/// A peer killed while the other end recovers (the link cut, so the
/// survivor is already waiting or reconnecting): the survivor fails soon
/// after the link is back (its reconnection or probe is refused), naming
/// the peer, instead of waiting out RUSTNET_RECOVERY_TIMEOUT (120 s here).
fn killed_during_recovery_case(kill_sender: bool) -> Result<String, String> {
    need_netns("to cut a link")?;
    let ns = NetnsPair::new()?;
    let t = Duration::from_secs(30);
    let env = |ifn| [("RUSTNET_SOCKET_TIMEOUT", "3"), ("NCCL_SOCKET_IFNAME", ifn)];
    let mut a = spawn_in(Some(&ns.a), "A", 8, &KILLED_RECEIVER_SIDE, &env("rnA"));
    let mut b = spawn_in(Some(&ns.b), "B", 8, &CUT_SENDER, &env("rnB"));
    swap_handles(&mut a, &mut b, t)?;
    a.expect("POSTED", t)?;
    b.expect("STARTED", t)?;
    std::thread::sleep(Duration::from_millis(300));
    ns.link(false)?;
    // past RUSTNET_SOCKET_TIMEOUT: the ends have noticed and recover
    std::thread::sleep(Duration::from_secs(6));
    let (log, took) = kill_then_link_up(&mut a, &mut b, kill_sender, || ns.link(true))?;
    let recovering = log.contains("reconnecting to its resume port") || log.contains("waiting for the sender to reconnect");
    let gone = log.lines().find(|l| l.contains("process is gone") || l.contains("receiving process is gone")).unwrap_or("").to_string();
    if !recovering || gone.is_empty() {
        return Err(format!("expected a recovery, then an error saying the peer's process is gone: {log}"));
    }
    if took > Duration::from_secs(if kill_sender { 40 } else { 15 }) {
        return Err(format!("the survivor took {took:?} after the link came back"));
    }
    Ok(format!(
        "{} killed during the recovery; the survivor failed {:.1} s after link-up: {gone}",
        if kill_sender { "sender" } else { "receiver" },
        took.as_secs_f64()
    ))
}

/// Verbs: a peer killed while both ends recover from a link that went down
/// under them (`RUSTNET_CONF_FLAP_IF`, the soft-RoCE VM's veth1: both rxe
/// ports go down with it). The survivor started its recovery at PORT_ERR
/// (requests were outstanding) and must fail soon after the link is back,
/// naming the peer and the recovery it was in, not wait out
/// RUSTNET_RECOVERY_TIMEOUT (120 s by default).
fn verbs_killed_during_recovery_case(kill_sender: bool) -> Result<String, String> {
    let dev = flap_if()?;
    let t = Duration::from_secs(60);
    let mut a = spawn("A", 8, &KILLED_RECEIVER_SIDE, &[]);
    let mut b = spawn("B", 8, &CUT_SENDER, &[]);
    swap_handles(&mut a, &mut b, t)?;
    a.expect("POSTED", t)?;
    b.expect("STARTED", t)?;
    std::thread::sleep(Duration::from_millis(300));
    // the interface's routes (the VM's policy routes are not put back by the
    // kernel when it comes up), then down
    let (routes, _) = link_down(&dev)?;
    // both ends see PORT_ERR with requests outstanding and stop their QPs
    std::thread::sleep(Duration::from_secs(2));
    let (log, took) = kill_then_link_up(&mut a, &mut b, kill_sender, || link_up_with(&dev, &routes).map(|_| ()))?;
    let recovering = log.lines().find(|l| l.contains("recovering in place")).unwrap_or("").to_string();
    let mut failed = log.lines().find(|l| l.contains("while recovering")).unwrap_or("").to_string();
    // Soft-iWARP reports no port event on the survivor's side (its netdev
    // only lost its carrier), and it learns of the link only at link-up,
    // when the killed peer's stack resets its streams: the error names the
    // peer's exit without a recovery before it.
    let iwarp = std::env::var("RUSTNET_CONF_A_ENV").is_ok_and(|v| v.contains("==siw"));
    if iwarp && failed.is_empty() {
        failed = log.lines().find(|l| l.contains("comm failed") && l.contains("closed its connection")).unwrap_or("").to_string();
    }
    if (recovering.is_empty() && !iwarp) || failed.is_empty() {
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        return Err(format!("expected a recovery, then an error naming the peer that closed while recovering: {tail}"));
    }
    if took > Duration::from_secs(20) {
        return Err(format!("the survivor took {took:?} after the link came back"));
    }
    Ok(format!(
        "{} killed during the recovery; the survivor failed {:.1} s after link-up: {}",
        if kill_sender { "sender" } else { "receiver" },
        took.as_secs_f64(),
        failed.trim()
    ))
}

/// Unix time now, in seconds (the recovery's INFO step lines carry the same clock).
fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// With `RUSTNET_CONF_SHOW_STEPS=1` (and `NCCL_DEBUG=INFO` in the peers'
/// environment): the flap's times and both ends' recovery steps, appended
/// to a case's report, to see where a recovery's time after link-up goes.
fn show_steps(marks: &[(&str, f64)], logs: &[(&str, &StderrLog)]) -> String {
    if std::env::var("RUSTNET_CONF_SHOW_STEPS").as_deref() != Ok("1") {
        return String::new();
    }
    let mut out = String::new();
    for (what, t) in marks {
        out += &format!("\n  [case] {what} at unix {t:.3}");
    }
    for (who, log) in logs {
        for l in log.text().lines().filter(|l| l.contains("recovery epoch") || l.contains("keeper") || l.contains("recovered in")) {
            out += &format!("\n  [{who}] {}", l.trim());
        }
    }
    out
}

/// The interface a verbs flap case takes down (`RUSTNET_CONF_FLAP_IF`,
/// which the VM suite sets); a loud skip without it.
fn flap_if() -> Result<String, String> {
    std::env::var("RUSTNET_CONF_FLAP_IF")
        .map_err(|_| "SKIPPED: needs RUSTNET_CONF_FLAP_IF, an interface under the verbs devices to take down (the VM suite sets it)".into())
}

/// Take `dev` down; its routes (for [`link_up_with`]) and when (unix seconds).
fn link_down(dev: &str) -> Result<(String, f64), String> {
    let routes = routes_of(dev);
    if !sh(&format!("ip link set {dev} down")) {
        return Err(format!("could not take {dev} down"));
    }
    Ok((routes, unix_now()))
}

/// The routes through interface `dev` (the VM's policy routes are not put
/// back by the kernel when it comes up).
fn routes_of(dev: &str) -> String {
    std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("ip -o route show table all | grep ' dev {dev}' || true"))
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Bring `dev` up and put its `routes` back, in one `ip -batch` (the
/// kernel drops a device's routes when it goes down; a real link's carrier
/// loss does not, so the rig puts them back at once: one `ip` command per
/// route took most of a second under the VM's emulation, and a recovery
/// message written in that second met no route and waited out TCP's
/// backoff, up to a minute, seen with soft-iWARP, whose port is ACTIVE
/// again the moment the link is up). Returns when the batch started (unix
/// seconds): times "after link-up" count the rig's own work too.
fn link_up_with(dev: &str, routes: &str) -> Result<f64, String> {
    use std::io::Write as _;
    let mut batch = format!("link set dev {dev} up\n");
    for r in routes.lines().filter(|r| !r.trim().is_empty()) {
        batch += &format!("route replace {}\n", r.trim());
    }
    let up_at = unix_now();
    let ok = std::process::Command::new("ip")
        .args(["-force", "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().map(|mut i| i.write_all(batch.as_bytes())).transpose()?;
            c.wait()
        })
        .is_ok_and(|s| s.success());
    // (a route the batch could not put back is not the link's failure)
    // (IFF_UP, set when `ip link set up` returns; operstate follows later)
    let up = std::fs::read_to_string(format!("/sys/class/net/{dev}/flags"))
        .ok()
        .and_then(|s| u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok())
        .map_or(ok, |f| f & 1 != 0);
    up.then_some(up_at).ok_or_else(|| format!("could not bring {dev} back up (ip -batch: {batch:?})"))
}

/// Verbs, issue 20 (a flap while a rank writes a checkpoint): receiver A
/// waits on a 1 MiB receive whose CTS is out; sender B's rank is away (its
/// NCCL calls nothing on any comm) for 14 s; the link goes down for 2 s
/// meanwhile. A's comm sees the flap with its receive pending, stops its
/// QPs and sends Halt. B's comm is not called, so the process's recovery
/// keeper thread must answer for it (new QPs, State, Go) within about a
/// second of link-up; A's window (RUSTNET_RECOVERY_TIMEOUT=4, charged in
/// full since A's NCCL waits) would otherwise end A's comm 4 s after the
/// flap, long before B is back. When B returns it sends, on the recovered
/// QPs, and A gets all 1 MiB, every byte right.
/// `RUSTNET_CONF_FLAP_S` (2) sets the flap's length; the window is 2 s more
/// and B is away for 12 s more (at least 14).
fn verbs_late_rank_flap_case() -> Result<String, String> {
    let dev = flap_if()?;
    let t = Duration::from_secs(60);
    let flap_s = env_u64("RUSTNET_CONF_FLAP_S", 2).clamp(1, 40);
    let window = (flap_s + 2).to_string();
    let away_s = (flap_s + 12).max(14);
    let env = [("RUSTNET_RECOVERY_TIMEOUT", window.as_str())];
    let mut a = spawn("A", 8, &LATE_RECEIVER, &env);
    let mut b = spawn("B", 8, &LATE_SENDER, &env);
    swap_handles(&mut a, &mut b, t)?;
    a.expect("POSTED", t)?;
    b.expect("READY", t)?;
    let away = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    let (routes, down_at) = link_down(&dev)?;
    std::thread::sleep(Duration::from_secs(flap_s));
    let up_at = link_up_with(&dev, &routes)?;
    std::thread::sleep(Duration::from_secs(away_s).saturating_sub(away.elapsed()));
    b.send("GO");
    let (ea, eb) = (a.stderr.clone(), b.stderr.clone());
    let ra = finish(a).map_err(|e| format!("A: {e}; its stderr:\n{}", ea.tail(20)))?;
    let rb = finish(b).map_err(|e| format!("B: {e}; its stderr:\n{}", eb.tail(20)))?;
    let ok = |l: &str| l.trim_start().starts_with("ok ");
    if !ok(&ra) || !ok(&rb) || field(&ra, "bad_bytes") != 0 || field(&ra, "size") != 1 << 20 {
        return Err(format!("A: {ra}; B: {rb}; A's stderr:\n{}\nB's stderr:\n{}", ea.tail(20), eb.tail(20)));
    }
    eb.wait_eof(Duration::from_secs(5));
    let kept = eb.text().lines().filter(|l| l.contains(" recovered in ") && l.contains("by the keeper thread")).count();
    if kept == 0 {
        return Err(format!("B's comm did not recover by the keeper (the case tests nothing without it): {}", eb.tail(20)));
    }
    // a merged device (the VM suite's second pass): the member whose port
    // went down says at once that its share waits for it (no failover yet)
    let merged = std::env::var("RUSTNET_CONF_A_ENV").is_ok_and(|v| v.contains("RUSTNET_IB_MERGE_NICS="));
    if merged && !ea.text().contains("of merged device") {
        return Err(format!("A's member comm did not say that its merged device waits for the port: {}", ea.tail(20)));
    }
    let secs: Vec<f64> =
        ea.text().lines().filter_map(|l| l.split(" recovered in ").nth(1)?.split_whitespace().next()?.parse().ok()).collect();
    Ok(format!(
        "B away {away_s} s, a {flap_s} s flap meanwhile: A's comm recovered in {secs:.2?} s with B's answered by the keeper ({kept} comm(s)); A got all 1 MiB, every byte right, {:.1} s after posting{}",
        field(&ra, "waited_ms") as f64 / 1e3,
        show_steps(&[("link down", down_at), ("link up", up_at)], &[("A", &ea), ("B", &eb)])
    ))
}

/// The same with the roles the other way: receiver B posts a 1 MiB receive
/// (its CTS goes out) and its rank is away for 14 s; the link goes down,
/// sender A posts the message into the dead link and waits. A's comm sees
/// the flap with its send outstanding and sends Halt; B's receive comm is
/// moved by B's keeper (drain to the flush of its receive queues, new QPs,
/// its restart point, the CTS written again). A's send completes on the
/// new QPs while B is still away (RUSTNET_RECOVERY_TIMEOUT=6 would end it
/// otherwise, about 6.6 s after B left), and B finds all 1 MiB in its
/// buffer when it comes back. (Until stop 37 this direction resumed a
/// second later than the other: A's post into the dead link left the
/// kernel retrying ARP for B once a second, and the recovery messages on
/// the same netdev waited for it; now A stops before posting. What is left
/// after link-up in the VM is the rig putting its routes back.)
fn verbs_away_receiver_flap_case() -> Result<String, String> {
    let dev = flap_if()?;
    let t = Duration::from_secs(60);
    let env = [("RUSTNET_RECOVERY_TIMEOUT", "6")];
    let mut a = spawn("A", 8, &FLAP_SENDER, &env);
    let mut b = spawn("B", 8, &AWAY_RECEIVER, &env);
    swap_handles(&mut a, &mut b, t)?;
    a.expect("READY", t)?;
    b.expect("POSTED", t)?;
    let away = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    let (routes, down_at) = link_down(&dev)?;
    std::thread::sleep(Duration::from_millis(300));
    a.send("SEND");
    std::thread::sleep(Duration::from_secs(2));
    let up_at = link_up_with(&dev, &routes)?;
    let sent = a.expect("SENT", t).map_err(|e| format!("A: {e}; its stderr:\n{}", a.stderr.tail(20)))?;
    let sent_at = away.elapsed();
    let sent_unix = unix_now();
    std::thread::sleep(Duration::from_secs(14).saturating_sub(away.elapsed()));
    b.send("GO");
    a.send("EXIT");
    let (ea, eb) = (a.stderr.clone(), b.stderr.clone());
    let ra = finish(a).map_err(|e| format!("A: {e}; its stderr:\n{}", ea.tail(20)))?;
    let rb = finish(b).map_err(|e| format!("B: {e}; its stderr:\n{}", eb.tail(20)))?;
    let ok = |l: &str| l.trim_start().starts_with("ok ");
    if !sent.contains("ok") || !ok(&ra) || !ok(&rb) || field(&rb, "bad_bytes") != 0 || field(&rb, "size") != 1 << 20 {
        return Err(format!("A: {ra}; B: {rb}; A's stderr:\n{}\nB's stderr:\n{}", ea.tail(20), eb.tail(20)));
    }
    if sent_at >= Duration::from_secs(14) {
        return Err(format!("A's send completed only {sent_at:?} after B went away, when B was back: the case tests nothing"));
    }
    eb.wait_eof(Duration::from_secs(5));
    let kept = eb.text().lines().filter(|l| l.contains(" recovered in ") && l.contains("by the keeper thread")).count();
    if kept == 0 {
        return Err(format!("B's comm did not recover by the keeper (the case tests nothing without it): {}", eb.tail(20)));
    }
    Ok(format!(
        "B away 14 s, a 2 s flap meanwhile: A's send ({}) done {:.1} s after B left, {:.2} s after link-up, B's receive comm recovered by the keeper; B got all 1 MiB, every byte right{}",
        field(&ra, "send_ms"),
        sent_at.as_secs_f64(),
        sent_unix - up_at,
        show_steps(&[("link down", down_at), ("link up", up_at), ("A's send done", sent_unix)], &[("A", &ea), ("B", &eb)])
    ))
}

/// Verbs, issue 20 (one member of a merged device down for good): member
/// 0's link (veth1 under rxe1, so rxe0 loses its carrier too) goes down
/// while sender A's 1 MiB send and receiver B's receive wait, and stays
/// down. librustnet has no failover between members yet, so the comm
/// cannot go on; what the user must get is a clear error at the end of
/// the recovery window, never a hang: both ends fail about
/// RUSTNET_RECOVERY_TIMEOUT (4 s) after the fault, each having said at once
/// that its share waits for that port; the end whose window ends first
/// names the port, the merged device, that the other members cannot take
/// its share, and the knob (the other fails on its GiveUp at once; A's
/// isend meanwhile is answered "not yet", then with the error). Only on a
/// merged device (the VM suite's merged pass).
fn verbs_merged_member_down_case() -> Result<String, String> {
    if !std::env::var("RUSTNET_CONF_A_ENV").is_ok_and(|v| v.contains("RUSTNET_IB_MERGE_NICS=")) {
        return Err("SKIPPED: needs a merged device (RUSTNET_IB_MERGE_NICS in RUSTNET_CONF_A_ENV: the VM suite's merged pass)".into());
    }
    let dev = flap_if()?;
    let t = Duration::from_secs(60);
    let env = [("RUSTNET_RECOVERY_TIMEOUT", "4")];
    let mut a = spawn("A", 8, &FLAP_SENDER, &env);
    let mut b = spawn("B", 8, &LATE_RECEIVER, &env);
    swap_handles(&mut a, &mut b, t)?;
    a.expect("READY", t)?;
    b.expect("POSTED", t)?;
    let (routes, _) = link_down(&dev)?;
    let down = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    a.send("SEND");
    let sent = a.expect("SENT", t);
    let took = down.elapsed();
    let up = link_up_with(&dev, &routes);
    a.send("EXIT");
    let (ea, eb) = (a.stderr.clone(), b.stderr.clone());
    let ra = finish(a);
    let rb = finish(b);
    up?;
    let sent = sent.map_err(|e| format!("A: {e}; its stderr:\n{}", ea.tail(20)))?;
    let (ra, rb) = (ra?, rb?);
    if !sent.contains("failed") || !ra.contains("failed") || !rb.contains("failed") {
        return Err(format!("expected both ends to fail with member 0 down for good: A: {sent} / {ra}; B: {rb}"));
    }
    // (the end whose window ends first gives up naming the port; the
    // other fails at once on its GiveUp)
    if took < Duration::from_secs(3) || took > Duration::from_secs(15) {
        return Err(format!("A's send failed {took:?} after the fault, not at the end of the 4 s window"));
    }
    eb.wait_eof(Duration::from_secs(5));
    let said = ea.text().contains("member 0 of merged device") && eb.text().contains("member 0 of merged device");
    let failed: Vec<String> = [&ea, &eb]
        .iter()
        .flat_map(|l| l.text().lines().filter(|x| x.contains("comm failed")).map(str::to_string).collect::<Vec<_>>())
        .collect();
    let named = failed.iter().find(|f| f.contains("merged device") && f.contains("RUSTNET_RECOVERY_TIMEOUT=4"));
    let Some(named) = named.filter(|_| said) else {
        return Err(format!(
            "the logs do not say what held the comm (both WARNed at once: {said}); the errors: {failed:?}\nA: {}\nB: {}",
            ea.tail(10),
            eb.tail(10)
        ));
    };
    Ok(format!("both ends failed, A {:.1} s after member 0's link went down for good: {}", took.as_secs_f64(), named.trim()))
}

/// Streams reset in the middle of transfers (RUSTNET_FAULT_TCP_RESET: A's
/// send comms reset a stream after write 40 and every 150, B's receive
/// comms after read 60 and every 200), traffic both ways, every byte
/// checked: the comms reconnect and resend; nothing fails, nothing is lost
/// or delivered twice.
///
/// `kernel_acks`: B's *send* comms reset instead (after write 60 and every
/// 200), so no receiver dissolves its own socket and every connection
/// completes its sends on the receiving kernel's acknowledgement
/// (`RUSTNET_SOCKET_KERNEL_ACK`, the default): a reset then finds bytes the
/// receiver's kernel acknowledged but its process has not read, which the
/// receiver reads from the old stream. (A receive-side reset purges that
/// queue, so a receiver with that injection does not offer kernel
/// acknowledgements, and the first variant runs on the receiving
/// process's acknowledgements.)
fn reset_mid_transfer_case(kernel_acks: bool) -> Result<String, String> {
    let t = Duration::from_secs(240);
    let common = [("RUSTNET_CONF_CYCLES", "2"), ("RUSTNET_CONF_ROUNDS", "40")];
    let b_plan = if kernel_acks { "send:60:200" } else { "recv:60:200" };
    let mut a = spawn("A", 8, &TRAFFIC, &[common[0], common[1], ("RUSTNET_FAULT_TCP_RESET", "send:40:150")]);
    let mut b = spawn("B", 8, &TRAFFIC, &[common[0], common[1], ("RUSTNET_FAULT_TCP_RESET", b_plan)]);
    for _ in 0..2 {
        swap_handles(&mut a, &mut b, t)?;
        a.expect("CYCLE", t).map_err(|e| format!("{e}; A: {}", a.stderr.tail(20)))?;
        b.expect("CYCLE", t).map_err(|e| format!("{e}; B: {}", b.stderr.tail(20)))?;
        a.send("GO");
        b.send("GO");
    }
    let (ea, eb) = (a.stderr.clone(), b.stderr.clone());
    let ra = finish(a)?;
    let rb = finish(b)?;
    let resets = |l: &StderrLog| l.text().matches("RUSTNET_FAULT_TCP_RESET: resetting").count();
    let (n, bytes) = recoveries_in(&[&ea, &eb]);
    let injected = resets(&ea) + resets(&eb);
    if injected == 0 || n == 0 {
        return Err(format!("{injected} resets injected, {n} recoveries: the case tested nothing; A: {}", ea.tail(10)));
    }
    let on_kernel = |l: &StderrLog| l.text().matches("completing sends on the receiving kernel's acknowledgement").count();
    let kernel = on_kernel(&ea) + on_kernel(&eb);
    if kernel_acks != (kernel == n) {
        return Err(format!(
            "{kernel} of {n} recovered send comms completed on kernel acknowledgements (expected {})",
            if kernel_acks { "all" } else { "none" }
        ));
    }
    let held: u64 = [&ea, &eb]
        .iter()
        .flat_map(|l| l.text().lines().map(str::to_string).collect::<Vec<_>>())
        .filter_map(|x| {
            x.split(" byte(s) this host held unread")
                .next()
                .filter(|p| p.len() < x.len())
                .and_then(|p| p.rsplit('(').next())
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum();
    Ok(format!(
        "{injected} resets injected, {n} send comm recoveries ({kernel} on kernel acknowledgements), {bytes} bytes sent again, \
         {held} read from old streams, 0 failures; A: {ra}; B: {rb}"
    ))
}

/// Traffic over IPv6 only (NCCL_SOCKET_FAMILY=AF_INET6) between two namespaces.
fn ipv6_case() -> Result<String, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !sh("ip netns list") {
        return Err("SKIPPED: needs root and iproute2 (ip netns) for an IPv6 pair".into());
    }
    let ns = NetnsPair::new()?;
    let t = Duration::from_secs(60);
    let common = [("NCCL_SOCKET_FAMILY", "AF_INET6"), ("RUSTNET_CONF_CYCLES", "1"), ("RUSTNET_CONF_ROUNDS", "20")];
    let mut a = spawn_in(Some(&ns.a), "A", 10, &TRAFFIC, &[common[0], common[1], common[2], ("NCCL_SOCKET_IFNAME", "rnA")]);
    let mut b = spawn_in(Some(&ns.b), "B", 10, &TRAFFIC, &[common[0], common[1], common[2], ("NCCL_SOCKET_IFNAME", "rnB")]);
    let ha = a.expect("HANDLE ", t)?;
    let hb = b.expect("HANDLE ", t)?;
    if unhex(&ha).map(|h| h[11]) != Some(6) {
        return Err("the listen handle is not IPv6".into());
    }
    a.send(&format!("PEER {hb}"));
    b.send(&format!("PEER {ha}"));
    a.expect("CYCLE", t)?;
    b.expect("CYCLE", t)?;
    a.send("GO");
    b.send("GO");
    let ra = finish(a)?;
    finish(b)?;
    Ok(format!("IPv6 handle, {ra}"))
}

/// Grouped receives with tags, sends arriving across rounds (PXN shared comms).
/// makeVDevice through the .so (ABI v9 through v12), then traffic over the
/// fused device; where the transport cannot fuse, both ends see a clean refusal.
fn vdevice_case(version: u32) -> Result<String, String> {
    vdevice_case_with(version, &[])
}

fn vdevice_case_with(version: u32, env: &[(&str, &str)]) -> Result<String, String> {
    let t = Duration::from_secs(240);
    let mut a = spawn("A", version, &VDEVICE, env);
    let mut b = spawn("B", version, &VDEVICE, env);
    let (fa, fb) = (a.expect("", t)?, b.expect("", t)?);
    if fa.starts_with("REFUSED") || fb.starts_with("REFUSED") {
        // only TCP refuses, with ncclInvalidUsage, and both ends alike
        let _ = (a.child.kill(), b.child.kill(), a.child.wait(), b.child.wait());
        if !(fa.starts_with("REFUSED 5") && fb.starts_with("REFUSED 5")) {
            return Err(format!("makeVDevice: A said {fa:?}, B said {fb:?}"));
        }
        let tcp = std::env::var("RUSTNET_TRANSPORT").map_or(true, |t| t != "ib");
        if !tcp {
            return Err(format!("makeVDevice refused over verbs: {fa}"));
        }
        return Ok(format!("TCP refuses to fuse (code 5): {fa}"));
    }
    swap_handles(&mut a, &mut b, t)?;
    a.expect("CYCLE", t)?;
    b.expect("CYCLE", t)?;
    a.send("GO");
    b.send("GO");
    let (ra, rb) = (finish(a)?, finish(b)?);
    Ok(format!("A {fa}; B {fb}; traffic ok;{ra};{rb}"))
}

/// Verbs over a device NCCL fused (makeVDevice): every member's events
/// link to NCCL's parent and pair exactly.
fn profiler_fused_case() -> Result<String, String> {
    let r = vdevice_case_with(10, &[("RUSTNET_DRIVER_PROFILER", "check")])?;
    if r.matches("prof=ok").count() != 2 {
        return Err(format!("profiler events not paired or malformed on the fused device: {r}"));
    }
    Ok(r)
}

fn cross_round_case() -> Result<String, String> {
    let t = Duration::from_secs(60);
    // v8: the version whose merged devices (RUSTNET_IB_MERGE_NICS) the VM suite also runs this through
    let mut a = spawn("A", 8, &CROSS_ROUND_TAGS, &[]);
    let mut b = spawn("B", 8, &CROSS_ROUND_TAGS, &[]);
    swap_handles(&mut a, &mut b, t)?;
    a.expect("CYCLE", t)?;
    b.expect("CYCLE", t)?;
    a.send("GO");
    b.send("GO");
    let r = finish(a)?;
    finish(b)?;
    // round 0 = first tag-1 message (11 bytes, 0x11) + the tag-2 message of round 0 (21, 0x21)
    let want = "[11,21][12,22] b0=17 b1=33 b2=18 b3=34";
    if r.trim() != want {
        return Err(format!("expected {want:?}, got {r:?}"));
    }
    Ok(r)
}

/// Two plugin contexts with different traffic classes in one process (v11, v12).
fn two_contexts_case(version: u32) -> Result<String, String> {
    let a = spawn("A", version, &TWO_CONTEXTS, &[]);
    let ea = a.stderr.clone();
    let r = finish_within(a, Duration::from_secs(120)).map_err(|e| format!("{e}\n    stderr: {}", ea.text()))?;
    for want in [
        "tc300=4",
        "finalize_open=5",
        "regMr_after_finalize=5",
        "isend_after_finalize=5",
        "listen_finalized_ctx=4",
        "finalize_twice=4",
        "other_ctx_traffic=0",
        "listen_garbage_ctx=4",
        "listen_comm_as_ctx=4",
        "listen_null_ctx=4",
        "setNetAttr=0",
        "setNetAttr_finalized=4",
        "finalize_closed=0",
        "finalize_unused=0",
    ] {
        if !r.split_whitespace().any(|x| x == want) {
            return Err(format!("expected {want}: {r}\n    stderr: {}", ea.text()));
        }
    }
    // -1: the connect finished in one call (nothing to resume)
    if !(r.contains("connect_resumed_in_other_ctx=4") || r.contains("connect_resumed_in_other_ctx=-1")) {
        return Err(format!("a connect resumed under another context was not refused: {r}"));
    }
    std::thread::sleep(Duration::from_millis(100));
    let err = ea.text().clone();
    for want in [
        "still has 3 listen/send/receive comm(s) open",
        "which was already finalized: only close works now",
        "was already finalized",
        "is a send comm, not a plugin context",
    ] {
        if !err.contains(want) {
            return Err(format!("no WARN saying {want:?}; stderr: {err}"));
        }
    }
    let tcp = std::env::var("RUSTNET_TRANSPORT").map_or(true, |t| t != "ib");
    if tcp && r.contains("wire=skipped") && std::env::var("RUSTNET_CONF_REQUIRE_WIRE").as_deref() == Ok("1") {
        return Err(format!("RUSTNET_CONF_REQUIRE_WIRE=1 but the wire check was skipped: {r}"));
    }
    let wire = err.lines().find(|l| l.starts_with("wire: ")).unwrap_or("").to_string();
    Ok(format!("{r} {wire}"))
}

fn garbage_warned(stderr: &str) -> bool {
    stderr.contains("rejected connection from")
}

fn bad_env_case() -> Result<String, String> {
    let mut out = Vec::new();
    for (k, v, must) in [
        ("RUSTNET_TRANSPORT", "carrier-pigeon", "RUSTNET_TRANSPORT"),
        ("NCCL_NSOCKS_PERTHREAD", "0", "NCCL_NSOCKS_PERTHREAD"),
        ("NCCL_SOCKET_IFNAME", "=nosuchif0", "matches no running interface"),
        ("NCCL_SOCKET_FAMILY", "AF_UNIX", "NCCL_SOCKET_FAMILY"),
    ] {
        let a = spawn("A", 8, &INIT, &[(k, v)]);
        let code = a.expect("INITFAIL", Duration::from_secs(30)).unwrap_or_else(|e| e);
        // the peer exits after INITFAIL: its stderr is complete once closed
        // (a fixed sleep lost the WARN under load)
        a.stderr.wait_eof(Duration::from_secs(30));
        let err = a.stderr.text();
        if code != "5" {
            return Err(format!("{k}={v}: expected init to fail with ncclInvalidUsage (5), got {code:?}; stderr: {err}"));
        }
        if !err.contains(must) || !err.contains("WARN") {
            return Err(format!("{k}={v}: the WARN does not name the cause ({must}): {err}"));
        }
        out.push(format!("{k}={v}->5"));
    }
    Ok(out.join(" "))
}

fn panic_case() -> Result<String, String> {
    let t = Duration::from_secs(60);
    let mut a = spawn("A", 8, &PANIC, &[("RUSTNET_FAULT_PANIC", "isend")]);
    let mut b = spawn("B", 8, &PANIC, &[("RUSTNET_FAULT_PANIC", "isend")]);
    swap_handles(&mut a, &mut b, t)?;
    let ea = a.stderr.clone();
    let r = finish(a)?;
    finish(b)?;
    if !r.contains("isend_code=3") {
        return Err(format!("expected ncclInternalError (3) from a panicking isend: {r}"));
    }
    std::thread::sleep(Duration::from_millis(100));
    if !ea.text().contains("panic caught at the NCCL boundary") {
        return Err("the panic was not reported through the logger".into());
    }
    Ok(r)
}

fn misuse_case() -> Result<String, String> {
    let t = Duration::from_secs(60);
    let mut a = spawn("A", 8, &MISUSE, &[]);
    let mut b = spawn("B", 8, &MISUSE, &[]);
    swap_handles(&mut a, &mut b, t)?;
    let r = finish(a)?;
    finish(b)?;
    for want in ["devices_null=4", "connect_garbage=4", "props_bad_dev=4", "stale_test=5", "irecv_n9=4"] {
        if !r.contains(want) {
            return Err(format!("expected {want}: {r}"));
        }
    }
    Ok(r)
}

fn reload_case() -> Result<String, String> {
    // In this process: dlopen, init, a loopback connection with traffic,
    // close, dlclose; several times. No thread or fd growth.
    let dir = libdir();
    let so = dir.join("libnccl-net-rustnet.so");
    let mut base = None;
    for cycle in 0..4 {
        let p = Plugin::open(&so, 8)?;
        p.init().map_err(|e| e.to_string())?;
        let (mut h, l) = p.listen(0).map_err(|e| e.to_string())?;
        let (s, r) = p.connect_accept(0, &mut h, l, Duration::from_secs(30))?;
        traffic(&p, s, r, 77 + cycle, 77 + cycle, 6, 4, 1 << 20)?;
        p.close_send(s).map_err(|e| e.to_string())?;
        p.close_recv(r).map_err(|e| e.to_string())?;
        p.close_listen(l).map_err(|e| e.to_string())?;
        drop(p);
        let now = (fd_count(), base.map_or_else(thread_count, |b: (usize, usize)| thread_count_settled(b.1)));
        if cycle == 0 {
            base = Some(now);
        } else if now.0 > base.unwrap().0 || now.1 > base.unwrap().1 {
            return Err(format!("growth after reload {cycle}: fds/threads {:?} -> {now:?}", base.unwrap()));
        }
    }
    Ok(format!("fds/threads stable at {:?} over 4 dlopen/dlclose cycles", base.unwrap()))
}

/// Each handle kind checked as itself: wrong kind, stale, double close,
/// foreign pointers all fail with ncclInvalidArgument (4) and the process
/// lives (a double closeListen used to abort it; closeSend of a receive
/// comm used to close it and succeed).
fn handle_misuse_case() -> Result<String, String> {
    let t = Duration::from_secs(60);
    let mut a = spawn("A", 8, &HANDLE_MISUSE, &[]);
    let mut b = spawn("B", 8, &HANDLE_MISUSE, &[]);
    swap_handles(&mut a, &mut b, t)?;
    let ea = a.stderr.clone();
    let r = finish(a).map_err(|e| format!("{e}\n    A's stderr: {}", ea.text()))?;
    finish(b)?;
    for kv in r.split_whitespace() {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        if v != "4" {
            return Err(format!("{k}: expected ncclInvalidArgument (4), got {v}: {r}"));
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    let err = ea.text().clone();
    for want in ["is a receive comm", "already closed", "not a librustnet request", "already deregistered"] {
        if !err.contains(want) {
            return Err(format!("no WARN saying {want:?}; A's stderr: {err}"));
        }
    }
    Ok(r)
}

/// A panic injected inside isend or test after the transport changed its
/// state fails that comm: later calls on it return ncclInternalError naming
/// the panic, the other comm carries on, close frees everything.
fn panic_mid_case(site: &str) -> Result<String, String> {
    let t = Duration::from_secs(60);
    let env = [("RUSTNET_FAULT_PANIC", site)];
    let mut a = spawn("A", 8, &PANIC_MID, &env);
    let mut b = spawn("B", 8, &PANIC_MID, &env);
    swap_handles(&mut a, &mut b, t)?;
    a.expect("CYCLE", t)?;
    b.expect("CYCLE", t)?;
    a.send("GO");
    b.send("GO");
    let ea = a.stderr.clone();
    let r = finish(a)?;
    finish(b)?;
    let slot = site.split(':').next().unwrap_or(site);
    for want in
        [&format!("{slot}=3") as &str, "later_isend=3", "later_regMr=3", "recv_comm_irecv=0", "deregMr=0", "closeSend=0", "closeRecv=0"]
    {
        if !r.contains(want) {
            return Err(format!("expected {want}: {r}"));
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    let err = ea.text().clone();
    if !err.contains(&format!("failed by an earlier panic in {slot}")) {
        return Err(format!("later calls do not name the earlier panic; A's stderr: {err}"));
    }
    Ok(r)
}

/// 500 (RUSTNET_CONF_RELOADS) dlopen/init/connect/close/dlclose cycles in
/// one process: unmapped each time, fds/threads flat, RSS within 1%.
fn reload_many_case() -> Result<String, String> {
    let a = spawn("A", 8, &RELOAD_MANY, &[]);
    finish_within(a, Duration::from_secs(600))
}

/// The load/unload cycles with RUSTNET_STATS_DIR set: the writer thread
/// starts with each cycle's first comm and is joined by its last close, so
/// threads stay flat and (on TCP) every dlclose still unmaps the library;
/// the file holds the last cycle's final write. As many cycles as
/// load_unload_500_flat: over verbs the pinned copy's RSS grows for the
/// first few dozen cycles whatever the knobs (50 warm-up cycles cover it,
/// 6 did not).
/// The load/unload cycles with the TCP helper thread forced on (the default
/// on hosts with 4 or more CPUs per rank, so on most GPU nodes): each comm's
/// helper is joined at close, and nothing it did may keep the library
/// mapped after dlclose (a std::thread spawned from NCCL's thread, or a
/// parking_lot lock that parked it, would: both leave a thread-local
/// destructor of ours in a thread that outlives the cycle).
fn reload_tcp_helper_case() -> Result<String, String> {
    if std::env::var("RUSTNET_TRANSPORT").as_deref() == Ok("ib") {
        return Ok("SKIPPED: the TCP helper thread is a TCP transport feature".into());
    }
    // One malloc arena: each cycle starts and joins the helper pool's and the
    // resume port's threads, and a new thread that finds the arenas busy
    // (a loaded host) gets a new one from glibc, which keeps it: up to
    // 8 per CPU, a few pages each, read once as +1.2% over 180 cycles.
    // Bounded, and glibc's; what this case looks for is per-cycle growth
    // (600 cycles: with the 128 KiB floor a leak of 220 bytes a cycle fails).
    let a = spawn("A", 8, &RELOAD_MANY, &[("RUSTNET_CONF_RELOADS", "600"), ("RUSTNET_SOCKET_HELPER", "1"), ("MALLOC_ARENA_MAX", "1")]);
    let line = finish_within(a, Duration::from_secs(300))?;
    if !line.contains("unmapped after every dlclose") {
        return Err(format!("with the TCP helper thread the library stayed mapped: {line}"));
    }
    Ok(line)
}

fn reload_stats_case() -> Result<String, String> {
    let dir = std::env::temp_dir().join(format!("rustnet-conf-stats-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    // Over verbs the library stays mapped (the async-event threads pin it)
    // and each cycle's writer start/stop left ~130 B behind (0.93% of RSS
    // over 450 cycles in the VM, against 0 without the knob): one thread per
    // job, not per message, so the bound there is 3%; TCP keeps 1%.
    let ib = std::env::var("RUSTNET_TRANSPORT").as_deref() == Ok("ib");
    let a = spawn(
        "A",
        8,
        &RELOAD_MANY,
        &[
            ("RUSTNET_CONF_RELOADS", "500"),
            ("RUSTNET_STATS_DIR", &d),
            ("RUSTNET_STATS_INTERVAL", "1"),
            ("RUSTNET_CONF_RSS_PCT", if ib { "3" } else { "1" }),
        ],
    );
    let pid = a.child.id();
    let line = finish_within(a, Duration::from_secs(300))?;
    let path = std::fs::read_dir(&dir)
        .map_err(|e| format!("{d}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.to_string_lossy().ends_with(&format!("-{pid}.prom")))
        .ok_or_else(|| format!("no <host>-{pid}.prom in {d}"))?;
    let text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    let e = rustnet::for_tools::stats::prom::parse(&text)?;
    let sent = e.sum("rustnet_device_bytes_total", &[("dir", "send")]);
    if !e.complete || e.sum("rustnet_device_comms_open", &[]) != 0.0 || sent < 8.0 {
        return Err(format!("the last cycle's final write is not in the file:\n{text}"));
    }
    let tcp = std::env::var("RUSTNET_TRANSPORT").map(|t| t != "ib").unwrap_or(true);
    if tcp && !line.contains("unmapped after every dlclose") {
        return Err(format!("with a statistics file the library stayed mapped: {line}"));
    }
    Ok(format!("{line}; {} bytes sent in the file", sent))
}

/// 10,000 (RUSTNET_CONF_CONNECTS) listen/connect/accept/message/close
/// cycles over loopback through the .so: fds/threads flat, RSS within 1%
/// (about 2 s here, so CI runs the full count).
fn connect_churn_case() -> Result<String, String> {
    let a = spawn("A", 8, &CONNECT_CHURN, &[]);
    finish_within(a, Duration::from_secs(900))
}

fn finish_within(mut a: Proc, t: Duration) -> Result<String, String> {
    let r = a.expect("DONE", t);
    let _ = a.child.kill();
    let _ = a.child.wait();
    r
}

/// One case of the suite: its name and its coordinator half, which spawns
/// the peers it needs by naming their halves (`&TRAFFIC`, `&KILLED_SENDER`,
/// ... above), so nothing joins the two by a string the compiler cannot check.
struct Case {
    name: String,
    run: Box<dyn Fn() -> Result<String, String>>,
}

impl Case {
    fn new(name: impl Into<String>, run: impl Fn() -> Result<String, String> + 'static) -> Case {
        Case { name: name.into(), run: Box::new(run) }
    }
}

fn main() {
    if let Ok(role) = std::env::var("RUSTNET_CONF_ROLE") {
        peer_main(role);
        return;
    }
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
        std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    }
    // name filters (substrings), and `--skip SUBSTRING` as libtest has it
    let (mut filters, mut skips) = (Vec::new(), Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--skip" {
            skips.extend(args.next());
        } else if !a.starts_with('-') {
            filters.push(a);
        }
    }
    let mut cases: Vec<Case> = Vec::new();
    for v in VERSIONS {
        cases.push(Case::new(format!("traffic_v{v}"), move || traffic_case(v, &[])));
    }
    // TCP striping: 4 streams, small chunks, so every split path runs.
    cases.push(Case::new("traffic_v8_tcp_4_streams", || {
        traffic_case(8, &[("NCCL_NSOCKS_PERTHREAD", "4"), ("RUSTNET_SOCKET_MIN_CHUNK", "4K"), ("RUSTNET_CONF_CYCLES", "2")])
    }));
    cases.push(Case::new("grouped_tags_across_rounds", cross_round_case));
    for v in [10u32, 11, 12] {
        cases.push(Case::new(format!("profiler_events_v{v}"), move || profiler_case_with(v, &[], true)));
    }
    if !on_verbs() {
        // several pieces per message, moved by helper threads
        cases.push(Case::new("profiler_events_v10_tcp_4_streams_helper", || {
            profiler_case(&[("NCCL_NSOCKS_PERTHREAD", "4"), ("RUSTNET_SOCKET_MIN_CHUNK", "4K"), ("RUSTNET_SOCKET_HELPER", "1")])
        }));
        // 12 pieces per large message: at most 8 events under one parent
        cases.push(Case::new("profiler_events_v10_tcp_12_streams_capped", || {
            profiler_case_with(10, &[("NCCL_NSOCKS_PERTHREAD", "12"), ("RUSTNET_SOCKET_MIN_CHUNK", "4K")], false)
        }));
    }
    cases.push(Case::new("profiler_events_peer_killed", profiler_killed_case));
    cases.push(Case::new("profiler_knob_off_no_events", profiler_off_case));
    if on_verbs() {
        cases.push(Case::new("profiler_events_fused_device", profiler_fused_case));
    }
    for v in [9u32, 10, 11, 12] {
        cases.push(Case::new(format!("vdevice_v{v}"), move || vdevice_case(v)));
    }
    for v in [11u32, 12] {
        cases.push(Case::new(format!("two_contexts_traffic_classes_v{v}"), move || two_contexts_case(v)));
    }
    cases.push(Case::new("peer_killed_mid_transfer", killed_peer_case));
    if on_verbs() {
        cases.push(Case::new("verbs_receiver_killed_during_recovery", || verbs_killed_during_recovery_case(false)));
        cases.push(Case::new("verbs_sender_killed_during_recovery", || verbs_killed_during_recovery_case(true)));
        cases.push(Case::new("verbs_late_rank_flap_recovers", verbs_late_rank_flap_case));
        cases.push(Case::new("verbs_late_rank_receiver_flap_recovers", verbs_away_receiver_flap_case));
        cases.push(Case::new("verbs_connect_rtr_cut_short_retried", verbs_connect_rtr_cut_short_case));
        cases.push(Case::new("verbs_merged_member_down_fails_clearly", verbs_merged_member_down_case));
    }
    cases.push(Case::new("garbage_on_listen_port", garbage_case));
    cases.push(Case::new("invalid_env_values", bad_env_case));
    cases.push(Case::new("injected_panic", panic_case));
    cases.push(Case::new("null_stale_and_bad_arguments", misuse_case));
    cases.push(Case::new("dlclose_dlopen_cycles", reload_case));
    cases.push(Case::new("handle_kinds_checked", handle_misuse_case));
    cases.push(Case::new("panic_mid_isend_fails_comm", || panic_mid_case("isend:queued")));
    cases.push(Case::new("panic_mid_test_fails_comm", || panic_mid_case("test:progressed")));
    cases.push(Case::new("load_unload_500_flat", reload_many_case));
    cases.push(Case::new("load_unload_stats_dir", reload_stats_case));
    cases.push(Case::new("load_unload_tcp_helper", reload_tcp_helper_case));
    cases.push(Case::new("connect_close_churn_flat", connect_churn_case));
    if std::env::var("RUSTNET_TRANSPORT").map(|t| t != "ib").unwrap_or(true) {
        cases.push(Case::new("tcp_link_cut_silent_peer", link_cut_case));
        cases.push(Case::new("tcp_reset_mid_transfer_recovers", || reset_mid_transfer_case(false)));
        cases.push(Case::new("tcp_reset_mid_transfer_kernel_acks_recovers", || reset_mid_transfer_case(true)));
        cases.push(Case::new("tcp_link_cut_20s_recovers", || link_cut_recovers_case(Duration::from_secs(20))));
        cases.push(Case::new("tcp_link_cut_past_recovery_window_fails", link_cut_past_window_case));
        cases.push(Case::new("tcp_link_cut_during_connect_recovers", || link_cut_during_connect_case(Duration::from_secs(6))));
        cases.push(Case::new("tcp_link_cut_before_acceptance_recovers", link_cut_before_acceptance_case));
        cases.push(Case::new("tcp_receiver_killed_during_recovery", || killed_during_recovery_case(false)));
        cases.push(Case::new("tcp_sender_killed_during_recovery", || killed_during_recovery_case(true)));
        cases.push(Case::new("tcp_late_sender_after_a_cut_recovers", tcp_late_sender_case));
        cases.push(Case::new("tcp_sender_comm_closed_during_a_cut_fails_promptly", tcp_sender_comm_closed_case));
        cases.push(Case::new("tcp_ipv6_between_namespaces", ipv6_case));
    }
    let t0 = Instant::now();
    let (mut pass, mut fail, mut filtered, mut skipped, mut flaky) = (0, 0, 0, 0, 0);
    println!("\nrunning conformance over {}", driver::default_plugin_path().display());
    for Case { name, run: f } in &cases {
        if (!filters.is_empty() && !filters.iter().any(|x| name.contains(x.as_str()))) || skips.iter().any(|x| name.contains(x.as_str())) {
            filtered += 1;
            continue;
        }
        let t = Instant::now();
        // Under emulation (the soft-RoCE VM sets RUSTNET_CONF_RETRY=1) a failed
        // case runs once more; a pass on retry is reported as FLAKY with the
        // first error, never silently.
        let first = f();
        let res = match first {
            Err(e) if !e.starts_with("SKIPPED") && std::env::var("RUSTNET_CONF_RETRY").as_deref() == Ok("1") => {
                println!("test {name} ... first attempt failed, retrying once: {}", e.lines().next().unwrap_or(""));
                match f() {
                    Ok(d) => {
                        flaky += 1;
                        Ok(format!("FLAKY (passed on retry; first attempt: {e}) {d}"))
                    }
                    Err(e2) => Err(format!("{e2}\n    (first attempt: {e})")),
                }
            }
            other => other,
        };
        match res {
            Ok(detail) => {
                pass += 1;
                println!("test {name} ... ok ({:.1}s) {detail}", t.elapsed().as_secs_f64());
            }
            Err(e) if e.starts_with("SKIPPED") => {
                skipped += 1;
                println!("test {name} ... ignored, {e}");
                eprintln!("{name}: {e}");
            }
            Err(e) => {
                fail += 1;
                println!("test {name} ... FAILED ({:.1}s)\n    {e}", t.elapsed().as_secs_f64());
            }
        }
    }
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("rustnet-conf-{}", std::process::id())));
    if flaky > 0 {
        println!("\n!! {flaky} case(s) passed only on retry (FLAKY above)");
    }
    println!(
        "\ntest result: {}. {pass} passed; {fail} failed; {skipped} ignored; 0 measured; {filtered} filtered out; finished in {:.2}s\n",
        if fail == 0 { "ok" } else { "FAILED" },
        t0.elapsed().as_secs_f64()
    );
    std::process::exit(if fail == 0 { 0 } else { 1 });
}
