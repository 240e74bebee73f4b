//! `rustnet bench scale`: what N comm pairs per process cost, and whether one
//! active comm among N-1 idle ones is as fast as alone. Two processes (this
//! one and a spawned server end, or two hosts), each holding N send and N
//! receive comms (and their N listen comms), one 1 MiB buffer registered on
//! every comm; then one comm pair active and the rest idle. Over verbs it
//! also counts the RDMA objects (QPs, CQs, memory registrations) each comm
//! holds, from the kernel's resource table (`rdma res show`).
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::time::{Duration, Instant};

use rustnet_tools::driver::{self, hex, unhex, Plugin, Ptr};
use rustnet_tools::svg::{panels, Panel, Series};

use crate::bench::{pingpong, pump, Net};
use crate::ctl::{parse_size, Ctl};
use crate::samples::{human, Stat};

const HELP: &str = "\
rustnet bench scale: set-up, memory, fds, threads and idle CPU per comm, and one
active comm's latency and bandwidth, for N comm pairs per process

  rustnet bench scale [options]            both ends on this host (spawns the server end)
  rustnet bench scale --listen ADDR:PORT   server end, waits for one client
  rustnet bench scale --peer ADDR:PORT     client end, connects to a server end

Each process holds N send and N receive comms (and N listen comms), one 1 MiB
buffer registered on each (--warm: and one 8-byte message each way on every
pair, as a job's first collective, which ends each connection's handshake);
over verbs the QPs, CQs and memory registrations per comm are counted from
the kernel's table (`rdma res show`, iproute2: '-' where it cannot be read);
the idle window measures CPU and wake-ups (context
switches) with nothing posted; then comm 0 runs an 8-byte ping-pong and a
one-way bandwidth run while the N-1 others stay idle; then everything is
closed and RSS is compared with the start of the run.

options:
  --comms LIST     comm pairs per process, e.g. 1,16,256,1024,4096 (default 1,16,256,1024)
  --reps N         latency and bandwidth repeats (default 3)
  --lat-iters N    ping-pong round trips per repeat (default 2000)
  --bw-size SIZE   bandwidth message size (default 512K)
  --bytes SIZE     bytes per bandwidth repeat (default 256M)
  --inflight N     bandwidth requests in flight (default 4)
  --idle-s S       idle window, seconds (default 2)
  --warm           one 8-byte message each way on every comm pair before measuring
  --label TEXT     the run's name in the CSV and plot (default: RUSTNET_SOCKET_HELPER=...)
  --csv FILE       also write every row as CSV
  --svg FILE       also draw the rows as an SVG chart
  --plugin PATH    the plugin .so (default: librustnet.so beside this binary)
  --dev N          plugin device index (default 0)
Per-comm figures divide by 2N (the N send and N receive comms of a process).
The plugin reads its usual variables (RUSTNET_TRANSPORT, RUSTNET_SOCKET_HELPER,
...); in loopback mode NCCL_SOCKET_IFNAME defaults to lo.";

#[derive(Clone)]
struct Opts {
    listen: Option<String>,
    peer: Option<String>,
    comms: Vec<usize>,
    reps: usize,
    lat_iters: usize,
    bw_size: usize,
    bytes: usize,
    inflight: usize,
    idle_s: f64,
    label: String,
    csv: Option<PathBuf>,
    svg: Option<PathBuf>,
    plugin: PathBuf,
    dev: i32,
    warm: bool,
}

fn parse(args: Vec<String>) -> Result<(Opts, bool), String> {
    let mut o = Opts {
        listen: None,
        peer: None,
        comms: vec![1, 16, 256, 1024],
        reps: 3,
        lat_iters: 2000,
        bw_size: 512 << 10,
        bytes: 256 << 20,
        inflight: 4,
        idle_s: 2.0,
        label: format!("RUSTNET_SOCKET_HELPER={}", std::env::var("RUSTNET_SOCKET_HELPER").unwrap_or_else(|_| "-1".into())),
        csv: None,
        svg: None,
        plugin: driver::default_plugin_path(),
        dev: 0,
        warm: false,
    };
    let mut serve = false;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "-h" | "--help" => {
                println!("{HELP}");
                std::process::exit(0);
            }
            "--listen" => o.listen = Some(val("--listen")?),
            "--peer" => o.peer = Some(val("--peer")?),
            "--serve" => serve = true,
            "--comms" => {
                o.comms = val("--comms")?
                    .split(',')
                    .map(|s| s.trim().parse::<usize>().ok().filter(|&n| n > 0).ok_or(format!("bad comm count {s:?} (a positive integer)")))
                    .collect::<Result<_, _>>()?
            }
            "--reps" => o.reps = val("--reps")?.parse().map_err(|_| "bad --reps (an integer)")?,
            "--lat-iters" => o.lat_iters = val("--lat-iters")?.parse().map_err(|_| "bad --lat-iters (an integer)")?,
            "--bw-size" => o.bw_size = parse_size(&val("--bw-size")?).ok_or("bad --bw-size (a byte count such as 512K)")?,
            "--bytes" => o.bytes = parse_size(&val("--bytes")?).ok_or("bad --bytes (a byte count such as 256M)")?,
            "--inflight" => o.inflight = val("--inflight")?.parse().map_err(|_| "bad --inflight (an integer)")?,
            "--idle-s" => o.idle_s = val("--idle-s")?.parse().map_err(|_| "bad --idle-s (seconds)")?,
            "--label" => o.label = val("--label")?,
            "--csv" => o.csv = Some(val("--csv")?.into()),
            "--svg" => o.svg = Some(val("--svg")?.into()),
            "--plugin" => o.plugin = val("--plugin")?.into(),
            "--dev" => o.dev = val("--dev")?.parse().map_err(|_| "bad --dev (an integer)")?,
            "--warm" => o.warm = true,
            other => return Err(format!("unknown option {other:?} (see --help)")),
        }
    }
    if o.comms.is_empty() || o.reps == 0 || o.inflight == 0 || o.inflight > 32 || o.bw_size == 0 || o.bw_size > 1 << 30 {
        return Err("a non-empty --comms, --reps >= 1, --inflight 1..32 and --bw-size 1..1G are required".into());
    }
    if !(o.idle_s > 0.0 && o.idle_s <= 600.0) {
        return Err("--idle-s must be in (0, 600]".into());
    }
    let serve = serve || o.listen.is_some() && o.peer.is_none();
    Ok((o, serve))
}

pub fn main(args: Vec<String>) -> i32 {
    let (o, serve) = match parse(args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("rustnet bench scale: {e}");
            return 2;
        }
    };
    raise_nofile();
    let r = if serve { server(&o) } else { client(&o) };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("rustnet bench scale: {e}");
            1
        }
    }
}

// ------------------------------------------------------------ the process

/// Thousands of comms need thousands of descriptors: the soft limit up to the hard one.
fn raise_nofile() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: r is a valid out-pointer; setrlimit reads it.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// What the process holds now.
#[derive(Clone, Copy, Default, Debug)]
struct Snap {
    rss_kib: f64,
    fds: usize,
    threads: usize,
    cpu_s: f64,
    /// Context switches (voluntary + involuntary) of every thread so far.
    switches: u64,
}

fn snap() -> Snap {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as f64;
    let rss_pages: f64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count().saturating_sub(1)).unwrap_or(0);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let threads = status.lines().find_map(|l| l.strip_prefix("Threads:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    let (cpu_s, switches) = usage();
    Snap { rss_kib: rss_pages * page / 1024.0, fds, threads, cpu_s, switches }
}

/// A snapshot after every comm closed: the threads the plugin joined may
/// stay listed for a moment after their join returns (the kernel unlists an
/// exiting thread after it wakes the joiner), so this waits up to a second
/// for the count to come down to the calling thread alone.
fn snap_closed() -> Snap {
    let until = Instant::now() + Duration::from_secs(1);
    loop {
        let s = snap();
        if s.threads <= 1 || Instant::now() >= until {
            return s;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One process's figures for one N.
#[derive(Clone, Default, Debug)]
struct Side {
    listen_us: f64,
    setup_us: f64,
    rss_kib_per_comm: f64,
    fds_per_comm: f64,
    threads: usize,
    idle_cpu_pct: f64,
    wakeups_s: f64,
    rss_closed_mb: f64,
    threads_closed: usize,
    /// RDMA objects per comm (NaN: not counted): QPs, CQs, registrations.
    qps_per_comm: f64,
    cqs_per_comm: f64,
    mrs_per_comm: f64,
}

impl Side {
    fn line(&self) -> String {
        format!(
            "{} {} {} {} {} {} {} {} {} {} {} {}",
            self.listen_us,
            self.setup_us,
            self.rss_kib_per_comm,
            self.fds_per_comm,
            self.threads,
            self.idle_cpu_pct,
            self.wakeups_s,
            self.rss_closed_mb,
            self.threads_closed,
            self.qps_per_comm,
            self.cqs_per_comm,
            self.mrs_per_comm
        )
    }
    fn from_line(s: &str) -> Result<Side, String> {
        let v: Vec<f64> = s
            .split_whitespace()
            .map(|x| x.parse::<f64>().map_err(|_| format!("bad figures from the peer: {s:?}")))
            .collect::<Result<_, _>>()?;
        if v.len() != 12 {
            return Err(format!("bad figures from the peer: {s:?}"));
        }
        Ok(Side {
            listen_us: v[0],
            setup_us: v[1],
            rss_kib_per_comm: v[2],
            fds_per_comm: v[3],
            threads: v[4] as usize,
            idle_cpu_pct: v[5],
            wakeups_s: v[6],
            rss_closed_mb: v[7],
            threads_closed: v[8] as usize,
            qps_per_comm: v[9],
            cqs_per_comm: v[10],
            mrs_per_comm: v[11],
        })
    }
}

/// N comm pairs of this process.
struct Comms {
    listens: Vec<Ptr>,
    sends: Vec<Ptr>,
    recvs: Vec<Ptr>,
    /// (comm, mhandle) of every registration.
    regs: Vec<(Ptr, Ptr)>,
}

/// The shared 1 MiB buffer every comm registers.
const REG_LEN: usize = 1 << 20;

/// This process's RDMA objects in the kernel's resource table: (QPs, CQs,
/// memory registrations), from iproute2's `rdma res show`; `None` when it
/// cannot be read (no tool, no RDMA, no permission).
fn rdma_objects() -> Option<[usize; 3]> {
    let me = format!(" pid {} ", std::process::id());
    let mut out = [0usize; 3];
    for (o, kind) in out.iter_mut().zip(["qp", "cq", "mr"]) {
        let r = Command::new("rdma").args(["res", "show", kind]).stdin(Stdio::null()).stderr(Stdio::null()).output().ok()?;
        if !r.status.success() {
            return None;
        }
        *o = String::from_utf8_lossy(&r.stdout).lines().filter(|l| format!("{l} ").contains(&me)).count();
    }
    Some(out)
}

/// One 8-byte message each way on every comm pair (both ends run this in
/// the same order): each connection's handshake ends, as a job's first
/// collective would end it. `regs` holds each send comm's registration,
/// then each receive comm's, of `buf`.
fn warm(p: &Plugin, c: &Comms, buf: &mut [u8]) -> Result<(), String> {
    let e = |x: driver::NcclErr| x.to_string();
    let n = c.sends.len();
    let (sbuf, rbuf) = buf.split_at_mut(64);
    let t0 = Instant::now();
    for i in 0..n {
        let (s, smh) = c.regs[i];
        let (r, rmh) = c.regs[n + i];
        let rq = loop {
            if let Some(q) = p.irecv(r, &[(rbuf.as_mut_ptr(), 8, 0, rmh)]).map_err(e)? {
                break q;
            }
        };
        let (mut sq, mut sdone, mut rdone) = (None, false, false);
        while !(sdone && rdone) {
            if t0.elapsed() > Duration::from_secs(600) {
                return Err(format!("--warm: comm pair {i} of {n} still not done after 600 s"));
            }
            if sq.is_none() {
                sq = p.isend(s, sbuf.as_mut_ptr(), 8, 0, smh).map_err(e)?;
            }
            if let (Some(q), false) = (sq, sdone) {
                sdone = p.test(q, &mut [0]).map_err(e)?;
            }
            if !rdone {
                rdone = p.test(rq, &mut [0]).map_err(e)?;
            }
        }
    }
    Ok(())
}

/// Listen N times, swap handles (the client's first), connect and accept
/// every pair, register `buf` on each comm; fills the set-up figures of `side`.
fn open_all(p: &Plugin, o: &Opts, ctl: &mut Ctl, n: usize, first: bool, buf: &mut [u8], side: &mut Side) -> Result<Comms, String> {
    let objs_before = rdma_objects();
    let before = snap();
    let e = |x: driver::NcclErr| x.to_string();
    let t0 = Instant::now();
    let mut handles = Vec::with_capacity(n);
    let mut listens = Vec::with_capacity(n);
    for _ in 0..n {
        let (h, l) = p.listen(o.dev).map_err(e)?;
        handles.push(h);
        listens.push(l);
    }
    let t_listen = t0.elapsed();
    let send_handles = |ctl: &mut Ctl| -> Result<(), String> {
        for h in &handles {
            ctl.send(&format!("H {}", hex(h))).map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    let mut peer = Vec::with_capacity(n);
    let mut recv_handles = |ctl: &mut Ctl| -> Result<(), String> {
        for _ in 0..n {
            let b = unhex(&ctl.expect("H")?).filter(|b| b.len() == 128).ok_or("bad handle from the peer")?;
            let mut h = [0u8; 128];
            h.copy_from_slice(&b);
            peer.push(h);
        }
        Ok(())
    };
    if first {
        send_handles(ctl)?;
        recv_handles(ctl)?;
    } else {
        recv_handles(ctl)?;
        send_handles(ctl)?;
    }
    let t1 = Instant::now();
    let (mut sends, mut recvs) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (h, &l) in peer.iter_mut().zip(&listens) {
        let (s, r) = p.connect_accept(o.dev, h, l, Duration::from_secs(120))?;
        sends.push(s);
        recvs.push(r);
    }
    let t_conn = t1.elapsed();
    let mut regs = Vec::with_capacity(2 * n);
    for &c in sends.iter().chain(&recvs) {
        regs.push((c, p.reg_mr(c, buf.as_mut_ptr(), buf.len()).map_err(e)?));
    }
    let comms = Comms { listens, sends, recvs, regs };
    if o.warm {
        warm(p, &comms, buf)?;
    }
    let after = snap();
    let per = |a: usize, b: usize| (a as f64 - b as f64) / (2 * n) as f64;
    [side.qps_per_comm, side.cqs_per_comm, side.mrs_per_comm] = match (objs_before, rdma_objects()) {
        (Some(b), Some(a)) => [per(a[0], b[0]), per(a[1], b[1]), per(a[2], b[2])],
        _ => [f64::NAN; 3],
    };
    side.listen_us = t_listen.as_secs_f64() * 1e6 / n as f64;
    side.setup_us = (t_listen + t_conn).as_secs_f64() * 1e6 / n as f64;
    side.rss_kib_per_comm = (after.rss_kib - before.rss_kib) / (2 * n) as f64;
    side.fds_per_comm = (after.fds as f64 - before.fds as f64) / (2 * n) as f64;
    side.threads = after.threads;
    Ok(comms)
}

/// CPU seconds and context switches of the whole process so far (cheap:
/// no /proc walk, which at thousands of fds would be the idle CPU itself).
fn usage() -> (f64, u64) {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: ru is a valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    (tv(ru.ru_utime) + tv(ru.ru_stime), (ru.ru_nvcsw + ru.ru_nivcsw) as u64)
}

/// Sleep through the idle window; CPU % of one core and wake-ups per second.
fn idle(secs: f64) -> (f64, f64) {
    let a = usage();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let b = usage();
    let dt = t.elapsed().as_secs_f64();
    let (a, b) = (Snap { cpu_s: a.0, switches: a.1, ..Snap::default() }, Snap { cpu_s: b.0, switches: b.1, ..Snap::default() });
    // this thread's own sleep: one switch
    (100.0 * (b.cpu_s - a.cpu_s) / dt, (b.switches - a.switches).saturating_sub(1) as f64 / dt)
}

/// Close comm pairs 1.. (pair 0 belongs to the `Net` of the active phase).
fn close_idle(p: &Plugin, c: &mut Comms) {
    for (comm, m) in c.regs.drain(..) {
        let _ = p.dereg_mr(comm, m);
    }
    for &s in c.sends.iter().skip(1) {
        let _ = p.close_send(s);
    }
    for &r in c.recvs.iter().skip(1) {
        let _ = p.close_recv(r);
    }
    for &l in c.listens.iter().skip(1) {
        let _ = p.close_listen(l);
    }
}

fn open_plugin(o: &Opts) -> Result<Rc<Plugin>, String> {
    let p = Plugin::open(&o.plugin, 8)?;
    p.init().map_err(|e| format!("{e} (see the WARN above)"))?;
    let n = p.devices().map_err(|e| e.to_string())?;
    if o.dev >= n {
        return Err(format!("--dev {} but the plugin has {n} device(s)", o.dev));
    }
    Ok(Rc::new(p))
}

fn server(o: &Opts) -> Result<(), String> {
    let addr = o.listen.clone().unwrap_or_else(|| "127.0.0.1:0".into());
    let lst = TcpListener::bind(&addr).map_err(|e| format!("bind {addr}: {e}"))?;
    println!("LISTENING {}", lst.local_addr().map_err(|e| e.to_string())?);
    std::io::stdout().flush().ok();
    let (c, _) = lst.accept().map_err(|e| e.to_string())?;
    let mut ctl = Ctl::new(c).map_err(|e| e.to_string())?;
    let p = open_plugin(o)?;
    let start = snap();
    let mut buf = vec![1u8; REG_LEN];
    loop {
        let cmd = match ctl.recv() {
            Ok(c) => c,
            Err(_) => return Ok(()),
        };
        let f: Vec<&str> = cmd.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
        match f.first().copied() {
            Some("ROUND") => {
                let n = num(1);
                let mut side = Side::default();
                let mut c = open_all(&p, o, &mut ctl, n, false, &mut buf, &mut side)?;
                ctl.expect("IDLE")?;
                (side.idle_cpu_pct, side.wakeups_s) = idle(o.idle_s);
                let net = Net::from_parts(p.clone(), c.sends[0], c.recvs[0], c.listens[0]);
                ctl.send("OK").map_err(|e| e.to_string())?;
                // the active phase: as bench's server end
                loop {
                    let cmd = ctl.recv().map_err(|e| e.to_string())?;
                    let f: Vec<&str> = cmd.split_whitespace().collect();
                    let num = |i: usize| f.get(i).and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
                    let r = match f.first().copied() {
                        Some("PREP") => net.prepare(num(1), num(2)),
                        Some("PP") => pingpong(&net, 8, num(1), false, &mut Vec::new()).map(|_| ()),
                        Some("OW") => pump(&net, 0, num(2), num(1), num(3), 0).and_then(|_| pump(&net, 1, 0, 1, 1, 0)),
                        Some("CLOSE") => break,
                        _ => Err(format!("unknown command {cmd:?}")),
                    };
                    match r {
                        Ok(()) => ctl.send("OK").map_err(|e| e.to_string())?,
                        Err(e) => {
                            let _ = ctl.send(&format!("ERR {e}"));
                            return Err(e);
                        }
                    }
                }
                close_idle(&p, &mut c);
                drop(net);
                let closed = snap_closed();
                side.rss_closed_mb = (closed.rss_kib - start.rss_kib) / 1024.0;
                side.threads_closed = closed.threads;
                ctl.send(&format!("SIDE {}", side.line())).map_err(|e| e.to_string())?;
            }
            Some("BYE") => return Ok(()),
            _ => return Err(format!("unknown command {cmd:?}")),
        }
    }
}

fn wait_ok(ctl: &mut Ctl) -> Result<(), String> {
    let l = ctl.recv().map_err(|e| e.to_string())?;
    if l == "OK" {
        Ok(())
    } else {
        Err(format!("server end: {l}"))
    }
}

/// One N's results.
struct Row {
    n: usize,
    me: Side,
    peer: Side,
    lat: Stat,
    bw: Stat,
}

fn client(o: &Opts) -> Result<(), String> {
    let mut child = None;
    let peer = match &o.peer {
        Some(p) => p.clone(),
        None => {
            let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
            cmd.args(["bench", "scale", "--serve", "--plugin"]).arg(&o.plugin).args(["--dev", &o.dev.to_string()]);
            if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
                std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
            }
            cmd.args(["--idle-s", &o.idle_s.to_string()]);
            if o.warm {
                cmd.arg("--warm");
            }
            cmd.stdout(Stdio::piped()).stdin(Stdio::null());
            let mut c = cmd.spawn().map_err(|e| format!("spawn server end: {e}"))?;
            let mut out = std::io::BufReader::new(c.stdout.take().unwrap());
            let mut line = String::new();
            std::io::BufRead::read_line(&mut out, &mut line).map_err(|e| e.to_string())?;
            child = Some(c);
            line.strip_prefix("LISTENING").ok_or(format!("server end said {line:?}"))?.trim().to_string()
        }
    };
    let c = TcpStream::connect(&peer).map_err(|e| format!("connect to {peer}: {e}"))?;
    let mut ctl = Ctl::new(c).map_err(|e| e.to_string())?;
    let p = open_plugin(o)?;
    let start = snap();
    let mut buf = vec![1u8; REG_LEN];
    println!(
        "rustnet bench scale: plugin {} (ABI v8), device {}, peer {}, {} ({} CPU(s))",
        o.plugin.display(),
        o.dev,
        peer,
        o.label,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let mut rows = Vec::new();
    for &n in &o.comms {
        eprint!("  N = {n}: set-up ");
        ctl.send(&format!("ROUND {n}")).map_err(|e| e.to_string())?;
        let mut me = Side::default();
        let mut c = open_all(&p, o, &mut ctl, n, true, &mut buf, &mut me)?;
        eprint!("{:.1} s, idle ", me.setup_us * n as f64 / 1e6);
        ctl.send("IDLE").map_err(|e| e.to_string())?;
        (me.idle_cpu_pct, me.wakeups_s) = idle(o.idle_s);
        wait_ok(&mut ctl)?;
        eprint!("{:.1}% CPU, active ", me.idle_cpu_pct);
        let net = Net::from_parts(p.clone(), c.sends[0], c.recvs[0], c.listens[0]);
        let (mut lat, mut bw) = (Stat::default(), Stat::default());
        let mut rtts = Vec::new();
        for (size, w) in [(8, 2), (o.bw_size, o.inflight)] {
            ctl.send(&format!("PREP {size} {w}")).map_err(|e| e.to_string())?;
            net.prepare(size, w)?;
            wait_ok(&mut ctl)?;
        }
        let count = (o.bytes / o.bw_size).clamp(8, 200_000);
        for _ in 0..o.reps {
            if o.lat_iters > 0 {
                ctl.send(&format!("PP {}", o.lat_iters)).map_err(|e| e.to_string())?;
                pingpong(&net, 8, o.lat_iters, true, &mut rtts)?;
                wait_ok(&mut ctl)?;
                rtts.sort_by(f64::total_cmp);
                lat.0.push(rtts[rtts.len() / 2] / 2.0);
            }
            let t = Instant::now();
            ctl.send(&format!("OW {} {count} {}", o.bw_size, o.inflight)).map_err(|e| e.to_string())?;
            pump(&net, count, 0, o.bw_size, o.inflight, 0)?;
            pump(&net, 0, 1, 1, 1, 0)?;
            let dt = t.elapsed().as_secs_f64();
            wait_ok(&mut ctl)?;
            bw.0.push((o.bw_size * count) as f64 / dt / 1e9);
        }
        ctl.send("CLOSE").map_err(|e| e.to_string())?;
        close_idle(&p, &mut c);
        drop(net);
        let closed = snap_closed();
        me.rss_closed_mb = (closed.rss_kib - start.rss_kib) / 1024.0;
        me.threads_closed = closed.threads;
        let peer_side = Side::from_line(&ctl.expect("SIDE")?)?;
        eprintln!("done");
        rows.push(Row { n, me, peer: peer_side, lat, bw });
    }
    let _ = ctl.send("BYE");
    drop(p);
    if let Some(mut c) = child {
        let _ = c.wait();
    }
    report(o, &rows)
}

fn report(o: &Opts, rows: &[Row]) -> Result<(), String> {
    let f =
        |s: &Stat, d: usize| if s.0.is_empty() { "-".to_string() } else { format!("{:.d$} [{:.d$}-{:.d$}]", s.med(), s.min(), s.max()) };
    println!("\nper process (a = this end, b = the server end); per comm = / 2N; latency and bandwidth of comm 0 with N-1 idle,");
    println!("median [min-max] over {} repeats; 'closed' = RSS after closing everything minus RSS at the start of the run", o.reps);
    let obj = |v: f64| if v.is_finite() { format!("{v:.2}") } else { "-".to_string() };
    println!(
        "{:>5} {:>2} {:>10} {:>10} {:>9} {:>8} {:>5} {:>5} {:>5} {:>7} {:>8} {:>9} {:>22} {:>22} {:>9} {:>8}",
        "N",
        "",
        "setup us",
        "listen us",
        "RSS KiB",
        "fds",
        "QPs",
        "CQs",
        "MRs",
        "threads",
        "idle %",
        "wakeup/s",
        "8 B half-RTT us",
        &format!("{} GB/s", human(o.bw_size)),
        "closed MB",
        "thr. end"
    );
    for r in rows {
        for (who, s) in [("a", &r.me), ("b", &r.peer)] {
            let (l, b) = if who == "a" { (f(&r.lat, 2), f(&r.bw, 3)) } else { (String::new(), String::new()) };
            println!(
                "{:>5} {:>2} {:>10.1} {:>10.1} {:>9.1} {:>8.2} {:>5} {:>5} {:>5} {:>7} {:>8.2} {:>9.1} {:>22} {:>22} {:>9.1} {:>8}",
                r.n,
                who,
                s.setup_us,
                s.listen_us,
                s.rss_kib_per_comm,
                s.fds_per_comm,
                obj(s.qps_per_comm),
                obj(s.cqs_per_comm),
                obj(s.mrs_per_comm),
                s.threads,
                s.idle_cpu_pct,
                s.wakeups_s,
                l,
                b,
                s.rss_closed_mb,
                s.threads_closed
            );
        }
    }
    if let Some(path) = &o.csv {
        let mut w = String::from("label,n,proc,setup_us_per_comm,listen_us_per_call,rss_kib_per_comm,fds_per_comm,threads,idle_cpu_pct,wakeups_per_s,rss_after_close_mb,threads_after_close,lat8_us_med,lat8_us_min,lat8_us_max,bw_gbs_med,bw_gbs_min,bw_gbs_max,bw_size,qps_per_comm,cqs_per_comm,mrs_per_comm,warm\n");
        for r in rows {
            for (who, s) in [("a", &r.me), ("b", &r.peer)] {
                w += &format!(
                    "{},{},{who},{:.2},{:.2},{:.2},{:.3},{},{:.3},{:.2},{:.2},{},{:.3},{:.3},{:.3},{:.4},{:.4},{:.4},{},{:.3},{:.3},{:.3},{}\n",
                    o.label.replace([',', '\n'], ";"),
                    r.n,
                    s.setup_us,
                    s.listen_us,
                    s.rss_kib_per_comm,
                    s.fds_per_comm,
                    s.threads,
                    s.idle_cpu_pct,
                    s.wakeups_s,
                    s.rss_closed_mb,
                    s.threads_closed,
                    r.lat.med(),
                    r.lat.min(),
                    r.lat.max(),
                    r.bw.med(),
                    r.bw.min(),
                    r.bw.max(),
                    o.bw_size,
                    s.qps_per_comm,
                    s.cqs_per_comm,
                    s.mrs_per_comm,
                    o.warm as u8
                );
            }
        }
        std::fs::write(path, w).map_err(|e| format!("write {}: {e}", path.display()))?;
        println!("\nCSV written to {}", path.display());
    }
    if let Some(path) = &o.svg {
        let x = |n: usize| (n as f64).log2();
        let line = |name: &str, color: &str, get: &dyn Fn(&Row) -> f64| Series {
            name: name.into(),
            color: color.into(),
            points: rows.iter().map(|r| (x(r.n), get(r))).filter(|p| p.1.is_finite()).collect(),
        };
        let both = |title: &str, get: &dyn Fn(&Side) -> f64| Panel {
            title: title.into(),
            series: vec![line("a (this end)", "#d62728", &|r| get(&r.me)), line("b (server end)", "#1f77b4", &|r| get(&r.peer))],
        };
        let ps = [
            both("set-up per comm pair, us", &|s| s.setup_us),
            both("RSS per comm, KiB", &|s| s.rss_kib_per_comm),
            both("threads", &|s| s.threads as f64),
            both("idle CPU, % of a core", &|s| s.idle_cpu_pct),
            Panel { title: "comm 0: 8 B half round trip, us (median)".into(), series: vec![line("a", "#2ca02c", &|r| r.lat.med())] },
            Panel {
                title: format!("comm 0: {} one-way, GB/s (median)", human(o.bw_size)),
                series: vec![line("a", "#9467bd", &|r| r.bw.med())],
            },
            both("RSS after closing everything minus start, MB", &|s| s.rss_closed_mb),
        ];
        let svg = panels(&format!("rustnet bench scale: {}", o.label), "log2 N (comm pairs per process)", &ps, &[], f64::INFINITY);
        std::fs::write(path, svg).map_err(|e| format!("write {}: {e}", path.display()))?;
        println!("plot written to {}", path.display());
    }
    Ok(())
}
