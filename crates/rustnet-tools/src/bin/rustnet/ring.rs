//! `rustnet bench step` and `rustnet bench ring`: NCCL's traffic pattern on
//! the CPU side. N processes on this host (N = 2 for `step`), rank i sends
//! to rank i+1 and receives from rank i-1 at once, over `--conns`
//! connections per neighbour (one per NCCL channel), messages of one NCCL
//! step, `--inflight` (8 = NCCL_STEPS) requests in flight per connection and
//! direction, one thread per process testing the oldest request of every
//! connection round-robin (NCCL's proxy thread). The same driver runs the
//! plugin (through its vtable) and `nccl-socket`, our re-implementation of
//! NCCL's socket transport (ncclsock.rs); raw TCP (one blocking socket per
//! neighbour, 1 MiB writes, a writer thread) is a further reference.
//!
//! Reported: busbw as nccl-tests defines it for all_reduce on a ring:
//! algbw x 2(N-1)/N, which for a ring all_reduce is exactly the bytes each
//! rank sends divided by the time; here: bytes each rank sent / the slowest
//! rank's time. CPU: user + system seconds of all N processes (getrusage,
//! every thread) per GB sent (each byte counted once; it was both sent and
//! received, so both ends are in).
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::samples::{human, Row, Stat};

use rustnet_tools::driver::{self, hex, unhex, Plugin, Ptr};

use crate::ctl::{parse_size, Ctl};
use crate::ncclsock;

const HELP: &str = "\
rustnet bench step|ring: NCCL's traffic pattern through librustnet, beside
NCCL's socket algorithm and raw TCP, on this host (loopback)

  rustnet bench step [options]   2 processes, both directions at once
  rustnet bench ring [options]   N processes in a ring (each sends to the next
                                 and receives from the previous at once)

options:
  --ranks LIST      ring sizes (ring default 2,4,8; step is 2)
  --sizes LIST      message sizes = NCCL step sizes (default 32K,128K,512K;
                    512K is the Simple protocol's step with NCCL_BUFFSIZE 4M)
  --conns N         connections per neighbour, one per NCCL channel (default 2)
  --inflight N      requests in flight per connection and direction (default 8)
  --bytes N         bytes each rank sends per run (default 128M)
  --reps N          repeats; median [min-max] reported (default 3)
  --nets LIST       of plugin,pluginB,nccl0,ncclN,raw (default all but pluginB,
                    which --plugin-b adds)
  --nccl-threads T  helper threads of nccl-socket(N threads) (default 2)
  --nccl-socks S    sockets per helper thread of it (default 2)
  --csv FILE        every point as CSV
  --svg FILE        busbw and CPU s/GB against size, per ring size
  --plugin PATH     the plugin .so (default: librustnet.so beside this binary)
  --plugin-b PATH   a second plugin .so measured interleaved with the first
                    (e.g. the previous build), net \"pluginB\"
  --abi N           vtable version (default 8)
  --refused-sends N after the runs, every rank makes N sends the plugin must
                    refuse (maxP2pBytes + 1 bytes, on its first plugin connection):
                    a known error count for the statistics (tests/monitoring)
  --chain           a rank's send k waits for its receive k-1 (NCCL's ring
                    all_reduce forwards what it received): a step's latency
                    and the reuse of a send slot (its completion) are on the
                    ring's critical path, as under nccl-tests
  --spin N          N threads per rank spin (yielding) for the whole run, as
                    nccl-tests' main thread polls its GPU stream: the proxy
                    loop then competes for the CPUs
  --hold-until PATH after the runs, keep every rank's comms open until PATH
                    exists (at most 600 s), so a scraper reads the open comms'
                    series (RUSTNET_STATS_DIR); each rank gets RANK=i
The plugin reads its usual variables (NCCL_SOCKET_IFNAME defaults to lo here).";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum NetKind {
    Plugin,
    PluginB,
    Nccl0,
    NcclN,
    Raw,
}

impl NetKind {
    fn key(self) -> &'static str {
        match self {
            NetKind::Plugin => "plugin",
            NetKind::PluginB => "pluginB",
            NetKind::Nccl0 => "nccl0",
            NetKind::NcclN => "ncclN",
            NetKind::Raw => "raw",
        }
    }
    fn from_key(s: &str) -> Option<NetKind> {
        [NetKind::Plugin, NetKind::PluginB, NetKind::Nccl0, NetKind::NcclN, NetKind::Raw]
            .into_iter()
            .find(|k| k.key().eq_ignore_ascii_case(s))
    }
}

#[derive(Clone)]
pub(crate) struct Opts {
    ranks: Vec<usize>,
    sizes: Vec<usize>,
    conns: usize,
    inflight: usize,
    bytes: usize,
    reps: usize,
    nets: Vec<NetKind>,
    nthreads: usize,
    nsocks: usize,
    csv: Option<PathBuf>,
    svg: Option<PathBuf>,
    plugin: PathBuf,
    plugin_b: Option<PathBuf>,
    abi: u32,
    refused: usize,
    hold_until: Option<PathBuf>,
    chain: bool,
    spin: usize,
}

pub(crate) fn parse(ring: bool, args: Vec<String>) -> Result<Opts, String> {
    let mut o = Opts {
        ranks: if ring { vec![2, 4, 8] } else { vec![2] },
        sizes: vec![32 << 10, 128 << 10, 512 << 10],
        conns: 2,
        inflight: 8,
        bytes: 128 << 20,
        reps: 3,
        nets: vec![NetKind::Plugin, NetKind::Nccl0, NetKind::NcclN, NetKind::Raw],
        nthreads: 2,
        nsocks: 2,
        csv: None,
        svg: None,
        plugin: driver::default_plugin_path(),
        plugin_b: None,
        abi: 8,
        refused: 0,
        hold_until: None,
        chain: false,
        spin: 0,
    };
    let mut nets_given = false;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        let num = |s: String, name: &str| s.parse::<usize>().map_err(|_| format!("bad {name} {s:?}"));
        match a.as_str() {
            "-h" | "--help" => {
                println!("{HELP}");
                std::process::exit(0);
            }
            "--ranks" if ring => {
                o.ranks = val("--ranks")?
                    .split(',')
                    .map(|s| s.trim().parse().map_err(|_| format!("bad rank count {s:?}")))
                    .collect::<Result<_, _>>()?
            }
            "--sizes" => {
                o.sizes = val("--sizes")?.split(',').map(|s| parse_size(s).ok_or(format!("bad size {s:?}"))).collect::<Result<_, _>>()?
            }
            "--conns" => o.conns = num(val("--conns")?, "--conns")?,
            "--inflight" => o.inflight = num(val("--inflight")?, "--inflight")?,
            "--bytes" => o.bytes = parse_size(&val("--bytes")?).ok_or("bad --bytes")?,
            "--reps" => o.reps = num(val("--reps")?, "--reps")?,
            "--nets" => {
                nets_given = true;
                o.nets = val("--nets")?
                    .split(',')
                    .map(|s| NetKind::from_key(s.trim()).ok_or(format!("unknown net {s:?} (plugin, nccl0, ncclN, raw)")))
                    .collect::<Result<_, _>>()?
            }
            "--nccl-threads" => o.nthreads = num(val("--nccl-threads")?, "--nccl-threads")?,
            "--nccl-socks" => o.nsocks = num(val("--nccl-socks")?, "--nccl-socks")?,
            "--csv" => o.csv = Some(val("--csv")?.into()),
            "--svg" => o.svg = Some(val("--svg")?.into()),
            "--plugin" => o.plugin = val("--plugin")?.into(),
            "--plugin-b" => o.plugin_b = Some(val("--plugin-b")?.into()),
            "--abi" => o.abi = num(val("--abi")?, "--abi")? as u32,
            "--refused-sends" => o.refused = num(val("--refused-sends")?, "--refused-sends")?,
            "--hold-until" => o.hold_until = Some(val("--hold-until")?.into()),
            "--chain" => o.chain = true,
            "--spin" => o.spin = num(val("--spin")?, "--spin")?,
            other => return Err(format!("unknown option {other:?} (see --help)")),
        }
    }
    if o.plugin_b.is_some() && !nets_given {
        o.nets.insert(1, NetKind::PluginB);
    }
    if o.nets.contains(&NetKind::PluginB) && o.plugin_b.is_none() {
        return Err("net pluginB needs --plugin-b PATH".into());
    }
    if o.ranks.is_empty() || o.ranks.iter().any(|&n| !(2..=64).contains(&n)) {
        return Err("--ranks: ring sizes 2..64".into());
    }
    if o.sizes.is_empty() || o.sizes.iter().any(|&s| s == 0 || s > 64 << 20) {
        return Err("--sizes: 1 byte .. 64M per message".into());
    }
    if !(1..=32).contains(&o.conns) || !(1..=8).contains(&o.inflight) || o.reps == 0 || o.nets.is_empty() {
        return Err("--conns 1..32, --inflight 1..8, --reps >= 1 and a non-empty --nets are required".into());
    }
    if !(1..=16).contains(&o.nthreads) || o.nsocks == 0 || o.nthreads * o.nsocks > ncclsock::MAX_SOCKETS {
        return Err("--nccl-threads 1..16 and --nccl-socks >= 1, product <= 64".into());
    }
    Ok(o)
}

impl Opts {
    fn label(&self, k: NetKind) -> String {
        match k {
            NetKind::Plugin => "plugin".into(),
            NetKind::PluginB => format!(
                "plugin B ({})",
                self.plugin_b.as_ref().and_then(|p| p.file_name()).map(|f| f.to_string_lossy().into_owned()).unwrap_or_default()
            ),
            NetKind::Nccl0 => "nccl-socket(0 threads)".into(),
            NetKind::NcclN => format!("nccl-socket({} threads x {} socks)", self.nthreads, self.nsocks),
            NetKind::Raw => "raw TCP (1M writes)".into(),
        }
    }
    fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(1)
    }
    /// The pattern in words: connections, requests in flight, bytes per run.
    pub(crate) fn summary(&self) -> String {
        format!(
            "{} connection(s) per neighbour, {} in flight per connection, {} sent per rank per run{}{}",
            self.conns,
            self.inflight,
            human(self.bytes),
            if self.chain { ", each send after the receive before it (--chain)" } else { "" },
            if self.spin > 0 { format!(", {} spinning thread(s) per rank", self.spin) } else { String::new() }
        )
    }
    /// Messages per connection and direction in one run.
    fn count(&self, size: usize) -> usize {
        (self.bytes / (size * self.conns)).max(16)
    }
}

/// `rustnet bench step|ring ...`
pub fn main(ring: bool, args: Vec<String>) -> i32 {
    let o = match parse(ring, args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("rustnet bench: {e}");
            return 2;
        }
    };
    match coordinate(&o, ring) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("rustnet bench: {e}");
            1
        }
    }
}

// ------------------------------------------------------------ one rank

/// User + system CPU seconds of this process (every thread).
fn cpu_seconds() -> f64 {
    // SAFETY: rusage is plain data; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// What the step driver needs from a network: post a send or a receive on
/// connection `c`, test a request of it.
trait P2p {
    fn isend(&mut self, c: usize, data: *mut u8, size: usize) -> Result<Option<usize>, String>;
    fn irecv(&mut self, c: usize, data: *mut u8, size: usize) -> Result<Option<usize>, String>;
    fn test(&mut self, c: usize, send: bool, req: usize) -> Result<bool, String>;
}

struct PluginNet<'a> {
    p: &'a Plugin,
    sends: Vec<Ptr>,
    recvs: Vec<Ptr>,
    smh: Vec<Ptr>,
    rmh: Vec<Ptr>,
}

impl P2p for PluginNet<'_> {
    fn isend(&mut self, c: usize, data: *mut u8, size: usize) -> Result<Option<usize>, String> {
        self.p.isend(self.sends[c], data, size, 0, self.smh[c]).map(|r| r.map(|p| p as usize)).map_err(|e| e.to_string())
    }
    fn irecv(&mut self, c: usize, data: *mut u8, size: usize) -> Result<Option<usize>, String> {
        self.p.irecv(self.recvs[c], &[(data, size, 0, self.rmh[c])]).map(|r| r.map(|p| p as usize)).map_err(|e| e.to_string())
    }
    fn test(&mut self, _c: usize, send: bool, req: usize) -> Result<bool, String> {
        let mut sz = [0i32; 8];
        self.p.test(req as Ptr, if send { &mut sz[..1] } else { &mut sz[..] }).map_err(|e| e.to_string())
    }
}

struct NcclNet {
    sends: Vec<ncclsock::Comm>,
    recvs: Vec<ncclsock::Comm>,
}

impl P2p for NcclNet {
    fn isend(&mut self, c: usize, data: *mut u8, size: usize) -> Result<Option<usize>, String> {
        self.sends[c].post(data, size).map(Some)
    }
    fn irecv(&mut self, c: usize, data: *mut u8, size: usize) -> Result<Option<usize>, String> {
        self.recvs[c].post(data, size).map(Some)
    }
    fn test(&mut self, c: usize, send: bool, req: usize) -> Result<bool, String> {
        let comm = if send { &mut self.sends[c] } else { &mut self.recvs[c] };
        comm.test(req).map(|d| d.is_some())
    }
}

/// Per connection: a ring of `inflight` step buffers each way (NCCL's
/// buffer of NCCL_STEPS slots).
struct Bufs {
    send: Vec<Vec<u8>>,
    recv: Vec<Vec<u8>>,
}

/// The proxy loop: `count` messages of `size` each way on every connection,
/// `w` in flight, the oldest request of each connection tested per pass,
/// yield when a pass moved nothing.
fn drive(net: &mut dyn P2p, bufs: &mut Bufs, conns: usize, size: usize, count: usize, w: usize, chain: bool) -> Result<(), String> {
    #[derive(Clone, Copy, Default)]
    struct Side {
        posted: usize,
        done: usize,
        reqs: [usize; 8],
    }
    let mut st = vec![(Side::default(), Side::default()); conns];
    let t0 = Instant::now();
    let mut left = 2 * conns;
    while left > 0 {
        let mut moved = false;
        for (c, (s, r)) in st.iter_mut().enumerate() {
            let received = r.done;
            for (send, side) in [(false, &mut *r), (true, &mut *s)] {
                if side.done == count {
                    continue;
                }
                // --chain: send k forwards receive k-1
                while side.posted < count && side.posted - side.done < w && !(chain && send && side.posted > received) {
                    let slot = side.posted % w;
                    let b = if send { &mut bufs.send[c] } else { &mut bufs.recv[c] };
                    // SAFETY-free: plain offset into our own Vec
                    let ptr = b[slot * size..].as_mut_ptr();
                    let q = if send { net.isend(c, ptr, size)? } else { net.irecv(c, ptr, size)? };
                    match q {
                        Some(q) => {
                            side.reqs[slot] = q;
                            side.posted += 1;
                            moved = true;
                        }
                        None => break,
                    }
                }
                if side.done < side.posted && net.test(c, send, side.reqs[side.done % w])? {
                    side.done += 1;
                    moved = true;
                    if side.done == count {
                        left -= 1;
                    }
                }
            }
        }
        if !moved {
            std::thread::yield_now();
            if t0.elapsed() > Duration::from_secs(300) {
                return Err("a run made no progress for 300 s".into());
            }
        }
    }
    Ok(())
}

/// Raw TCP: `bytes` to the next rank in 1 MiB writes from a thread, the
/// same from the previous rank here.
fn raw_run(to: &TcpStream, from: &TcpStream, bytes: usize) -> Result<(), String> {
    const CHUNK: usize = 1 << 20;
    let mut w = to.try_clone().map_err(|e| e.to_string())?;
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let buf = vec![7u8; CHUNK];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(CHUNK);
            w.write_all(&buf[..n])?;
            left -= n;
        }
        Ok(())
    });
    let mut buf = vec![0u8; CHUNK];
    let mut left = bytes;
    let mut r = from;
    while left > 0 {
        let n = r.read(&mut buf[..left.min(CHUNK)]).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("raw TCP: previous rank closed".into());
        }
        left -= n;
    }
    writer.join().map_err(|_| "raw writer panicked")?.map_err(|e| e.to_string())
}

fn rank_args(args: Vec<String>) -> Result<(Opts, String, usize), String> {
    // rank --coord ADDR --rank I <opts...>
    let mut coord = None;
    let mut rank = None;
    let mut rest = Vec::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--coord" => coord = it.next(),
            "--rank" => rank = it.next().and_then(|v| v.parse().ok()),
            _ => rest.push(a),
        }
    }
    let o = parse(true, rest)?;
    Ok((o, coord.ok_or("--coord missing")?, rank.ok_or("--rank missing")?))
}

/// `rustnet bench ring-rank ...`: one rank, driven by the coordinator.
pub fn rank_main(args: Vec<String>) -> i32 {
    match rank_args(args).and_then(|(o, coord, me)| rank(&o, &coord, me)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("rustnet bench rank: {e}");
            1
        }
    }
}

/// Listen, swap handles through the coordinator, connect `conns` times to
/// the next rank and accept as many from the previous one; register buffers.
fn plugin_setup<'a>(k: NetKind, p: &'a Plugin, ctl: &mut Ctl, bufs: &mut Bufs, conns: usize) -> Result<(PluginNet<'a>, Ptr), String> {
    let (h, l) = p.listen(0).map_err(|e| e.to_string())?;
    ctl.send(&format!("ADDR {} {}", k.key(), hex(&h))).map_err(|e| e.to_string())?;
    let peer = unhex(&ctl.expect(&format!("PEER {}", k.key()))?).ok_or("bad plugin handle")?;
    let mut hs: Vec<[u8; 128]> = (0..conns).map(|_| peer.clone().try_into().unwrap()).collect();
    let (mut sends, mut recvs): (Vec<Option<Ptr>>, Vec<Ptr>) = (vec![None; conns], Vec::new());
    let t0 = Instant::now();
    while sends.iter().any(Option::is_none) || recvs.len() < conns {
        for (s, h) in sends.iter_mut().zip(hs.iter_mut()) {
            if s.is_none() {
                *s = p.connect(0, h).map_err(|e| e.to_string())?;
            }
        }
        if recvs.len() < conns {
            if let Some(r) = p.accept(l).map_err(|e| e.to_string())? {
                recvs.push(r);
            }
        }
        if t0.elapsed() > Duration::from_secs(60) {
            return Err("plugin connect/accept not done after 60 s".into());
        }
        std::thread::yield_now();
    }
    let sends: Vec<Ptr> = sends.into_iter().map(Option::unwrap).collect();
    let mut smh = Vec::new();
    let mut rmh = Vec::new();
    for c in 0..conns {
        smh.push(p.reg_mr(sends[c], bufs.send[c].as_mut_ptr(), bufs.send[c].len()).map_err(|e| e.to_string())?);
        rmh.push(p.reg_mr(recvs[c], bufs.recv[c].as_mut_ptr(), bufs.recv[c].len()).map_err(|e| e.to_string())?);
    }
    Ok((PluginNet { p, sends, recvs, smh, rmh }, l))
}

/// `--spin`: threads that keep a CPU busy until dropped (yielding, as a
/// thread polling a GPU stream does).
struct Spinners {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Spinners {
    fn start(n: usize) -> Spinners {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::thread::yield_now();
                    }
                })
            })
            .collect();
        Spinners { stop, threads }
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn rank(o: &Opts, coord: &str, me: usize) -> Result<(), String> {
    let _spin = Spinners::start(o.spin);
    let mut ctl = Ctl::new(TcpStream::connect(coord).map_err(|e| format!("connect {coord}: {e}"))?).map_err(|e| e.to_string())?;
    ctl.send(&format!("HELLO {me}")).map_err(|e| e.to_string())?;
    let w = o.inflight;
    let ms = o.max_size();
    let mut bufs =
        Bufs { send: (0..o.conns).map(|_| vec![me as u8; w * ms]).collect(), recv: (0..o.conns).map(|_| vec![0u8; w * ms]).collect() };
    // set up every network once: listen, tell the coordinator, connect to the next rank
    let mut plugins: Vec<(NetKind, Plugin)> = Vec::new();
    for (k, path) in [(NetKind::Plugin, Some(&o.plugin)), (NetKind::PluginB, o.plugin_b.as_ref())] {
        if let (true, Some(path)) = (o.nets.contains(&k), path) {
            let p = Plugin::open(path, o.abi)?;
            p.init().map_err(|e| format!("plugin {} init: {e}", path.display()))?;
            plugins.push((k, p));
        }
    }
    let mut pnets: Vec<(NetKind, PluginNet, Ptr)> = Vec::new();
    for (k, p) in &plugins {
        let (net, l) = plugin_setup(*k, p, &mut ctl, &mut bufs, o.conns)?;
        pnets.push((*k, net, l));
    }
    let mut nccl: Vec<(NetKind, NcclNet)> = Vec::new();
    for k in [NetKind::Nccl0, NetKind::NcclN] {
        if !o.nets.contains(&k) {
            continue;
        }
        let (ns, nt) = if k == NetKind::Nccl0 { (0, 0) } else { (o.nthreads * o.nsocks, o.nthreads) };
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        ctl.send(&format!("ADDR {} {}", k.key(), l.local_addr().unwrap())).map_err(|e| e.to_string())?;
        let peer: SocketAddr = ctl.expect(&format!("PEER {}", k.key()))?.parse().map_err(|_| "bad nccl-socket address")?;
        // connects complete through the listen backlog: connect all, then accept
        let sends = (0..o.conns).map(|c| ncclsock::Comm::connect(peer, c as u8, ns, nt)).collect::<Result<Vec<_>, _>>()?;
        let recvs = ncclsock::Comm::accept(&l, o.conns, ns, nt)?;
        nccl.push((k, NcclNet { sends, recvs }));
    }
    let mut raw = None;
    if o.nets.contains(&NetKind::Raw) {
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        ctl.send(&format!("ADDR raw {}", l.local_addr().unwrap())).map_err(|e| e.to_string())?;
        let peer: SocketAddr = ctl.expect("PEER raw")?.parse().map_err(|_| "bad raw address")?;
        let to = TcpStream::connect(peer).map_err(|e| e.to_string())?;
        let (from, _) = l.accept().map_err(|e| e.to_string())?;
        to.set_nodelay(true).map_err(|e| e.to_string())?;
        raw = Some((to, from));
    }
    ctl.send("READY").map_err(|e| e.to_string())?;
    while let Ok(cmd) = ctl.recv() {
        let f: Vec<&str> = cmd.split_whitespace().collect();
        if f.first() == Some(&"BYE") {
            break;
        }
        if f.len() == 2 && f[0] == "REFUSE" {
            let n: usize = f[1].parse().map_err(|_| "bad REFUSE count")?;
            let r = refuse(&mut pnets, &mut bufs, n);
            ctl.send(&match &r {
                Ok(()) => "DONE 0 0".to_string(),
                Err(e) => format!("ERR {e}"),
            })
            .map_err(|e| e.to_string())?;
            r?;
            continue;
        }
        if f.len() != 4 || f[0] != "RUN" {
            return Err(format!("unknown command {cmd:?}"));
        }
        let k = NetKind::from_key(f[1]).ok_or("unknown net")?;
        let size: usize = f[2].parse().map_err(|_| "bad size")?;
        let count: usize = f[3].parse().map_err(|_| "bad count")?;
        let (c0, t0) = (cpu_seconds(), Instant::now());
        let r = match k {
            NetKind::Plugin | NetKind::PluginB => {
                let n = &mut pnets.iter_mut().find(|(kk, _, _)| *kk == k).ok_or("no plugin")?.1;
                drive(n, &mut bufs, o.conns, size, count, w, o.chain)
            }
            NetKind::Nccl0 | NetKind::NcclN => {
                let n = &mut nccl.iter_mut().find(|(kk, _)| *kk == k).ok_or("no nccl-socket")?.1;
                drive(n, &mut bufs, o.conns, size, count, w, o.chain)
            }
            NetKind::Raw => {
                let (to, from) = raw.as_ref().ok_or("no raw")?;
                raw_run(to, from, size * count * o.conns)
            }
        };
        let (dt, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        match r {
            Ok(()) => ctl.send(&format!("DONE {dt} {cpu}")).map_err(|e| e.to_string())?,
            Err(e) => {
                let _ = ctl.send(&format!("ERR {e}"));
                return Err(e);
            }
        }
    }
    drop(nccl);
    for (_, n, l) in pnets {
        for c in 0..o.conns {
            let _ = n.p.dereg_mr(n.sends[c], n.smh[c]);
            let _ = n.p.dereg_mr(n.recvs[c], n.rmh[c]);
            let _ = n.p.close_send(n.sends[c]);
            let _ = n.p.close_recv(n.recvs[c]);
        }
        let _ = n.p.close_listen(l);
    }
    if driver::prof::mode() != driver::prof::Mode::Off {
        // RUSTNET_DRIVER_PROFILER=count|check: say that events flowed (and paired)
        let r = driver::prof::report();
        eprintln!(
            "rank {me}: profiler callback saw {} starts, {} stops{}",
            r.starts,
            r.stops,
            if r.errors.is_empty() { String::new() } else { format!(", errors {:?}", r.errors) }
        );
    }
    Ok(())
}

/// `n` sends of maxP2pBytes + 1 bytes on the first plugin connection, each
/// of which the plugin must refuse (and count as an error). The buffer is
/// never read: the size check comes first.
fn refuse(pnets: &mut [(NetKind, PluginNet, Ptr)], bufs: &mut Bufs, n: usize) -> Result<(), String> {
    let (_, net, _) = pnets.first_mut().ok_or("--refused-sends needs a plugin net")?;
    let too_big = rustnet::for_tools::transport::MAX_P2P_BYTES + 1;
    for i in 0..n {
        if let Ok(r) = net.p.isend(net.sends[0], bufs.send[0].as_mut_ptr(), too_big, 0, net.smh[0]) {
            return Err(format!("refused send {i}: the plugin took a send of {too_big} bytes ({r:?})"));
        }
    }
    Ok(())
}

// ------------------------------------------------------------ coordinator

struct Ring {
    kids: Vec<Child>,
    ctls: Vec<Ctl>,
}

impl Drop for Ring {
    fn drop(&mut self) {
        for c in &mut self.ctls {
            let _ = c.send("BYE");
        }
        for k in &mut self.kids {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = k.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Ok(None) = k.try_wait() {
                let _ = k.kill();
                let _ = k.wait();
            }
        }
    }
}

fn start_ring(o: &Opts, n: usize) -> Result<Ring, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = l.local_addr().unwrap().to_string();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut ring = Ring { kids: Vec::new(), ctls: Vec::new() };
    for i in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(["bench", "ring-rank", "--coord", &addr, "--rank", &i.to_string()]);
        cmd.args(["--sizes", &o.sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",")]);
        cmd.args(["--conns", &o.conns.to_string(), "--inflight", &o.inflight.to_string()]);
        cmd.args(["--nets", &o.nets.iter().map(|k| k.key()).collect::<Vec<_>>().join(",")]);
        cmd.args(["--nccl-threads", &o.nthreads.to_string(), "--nccl-socks", &o.nsocks.to_string()]);
        cmd.arg("--plugin").arg(&o.plugin).args(["--abi", &o.abi.to_string()]);
        if let Some(b) = &o.plugin_b {
            cmd.arg("--plugin-b").arg(b);
        }
        if o.chain {
            cmd.arg("--chain");
        }
        cmd.args(["--spin", &o.spin.to_string()]);
        if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
            cmd.env("NCCL_SOCKET_IFNAME", "lo");
        }
        // the rank label of RUSTNET_STATS_DIR's files, as a launcher sets it
        cmd.env("RANK", i.to_string());
        cmd.stdin(Stdio::null()).stdout(Stdio::null());
        ring.kids.push(cmd.spawn().map_err(|e| format!("spawn rank {i}: {e}"))?);
    }
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut ctls: Vec<Option<Ctl>> = (0..n).map(|_| None).collect();
    let t0 = Instant::now();
    let mut got = 0;
    while got < n {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                let mut c = Ctl::new(s).map_err(|e| e.to_string())?;
                let i: usize = c.expect("HELLO")?.parse().map_err(|_| "bad HELLO")?;
                if i >= n || ctls[i].is_some() {
                    return Err(format!("rank {i} said hello twice or out of range"));
                }
                ctls[i] = Some(c);
                got += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                for (i, k) in ring.kids.iter_mut().enumerate() {
                    if let Ok(Some(st)) = k.try_wait() {
                        return Err(format!("rank {i} exited during start-up ({st})"));
                    }
                }
                if t0.elapsed() > Duration::from_secs(60) {
                    return Err("ranks did not start within 60 s".into());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    ring.ctls = ctls.into_iter().map(Option::unwrap).collect();
    // per net: collect every rank's address, hand rank i the one of rank i+1
    for k in &o.nets {
        let mut addrs = Vec::new();
        for c in ring.ctls.iter_mut() {
            addrs.push(c.expect(&format!("ADDR {}", k.key()))?);
        }
        for (i, c) in ring.ctls.iter_mut().enumerate() {
            c.send(&format!("PEER {} {}", k.key(), addrs[(i + 1) % n])).map_err(|e| e.to_string())?;
        }
    }
    for (i, c) in ring.ctls.iter_mut().enumerate() {
        let l = c.recv().map_err(|e| format!("rank {i}: {e}"))?;
        if l != "READY" {
            return Err(format!("rank {i}: {l}"));
        }
    }
    Ok(ring)
}

/// One run on every rank: (seconds of the slowest rank, CPU seconds of all).
fn run_once(ring: &mut Ring, k: NetKind, size: usize, count: usize) -> Result<(f64, f64), String> {
    for c in ring.ctls.iter_mut() {
        c.send(&format!("RUN {} {size} {count}", k.key())).map_err(|e| e.to_string())?;
    }
    let (mut t, mut cpu) = (0f64, 0f64);
    for (i, c) in ring.ctls.iter_mut().enumerate() {
        let l = c.recv().map_err(|e| format!("rank {i}: {e}"))?;
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() != 3 || f[0] != "DONE" {
            return Err(format!("rank {i}: {l}"));
        }
        t = t.max(f[1].parse().unwrap_or(f64::NAN));
        cpu += f[2].parse::<f64>().unwrap_or(f64::NAN);
    }
    Ok((t, cpu))
}

/// The first three fields of /proc/loadavg.
pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn coordinate(o: &Opts, ring_mode: bool) -> Result<(), String> {
    println!(
        "rustnet bench {}: {} connection(s) per neighbour, {} in flight, {} sent per rank per run{}{}, {} repeats, plugin {} (ABI v{}), {} CPUs, load {}",
        if ring_mode { "ring" } else { "step" },
        o.conns,
        o.inflight,
        human(o.bytes),
        if o.chain { ", each send after the receive before it (--chain)" } else { "" },
        if o.spin > 0 { format!(", {} spinning thread(s) per rank", o.spin) } else { String::new() },
        o.reps,
        o.plugin.display(),
        o.abi,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        loadavg()
    );
    let rows = measure(o)?;
    print!("{}", table(&rows, o.nets.len()));
    if let Some(p) = &o.csv {
        std::fs::write(p, csv(&rows)).map_err(|e| format!("write {}: {e}", p.display()))?;
        println!("CSV written to {}", p.display());
    }
    if let Some(p) = &o.svg {
        let title = format!(
            "rustnet bench {}: {} conns/neighbour, {} in flight ({} CPUs)",
            if ring_mode { "ring" } else { "step" },
            o.conns,
            o.inflight,
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
        );
        std::fs::write(p, crate::plot::svg(&rows, &title)).map_err(|e| format!("write {}: {e}", p.display()))?;
        println!("plot written to {}", p.display());
    }
    Ok(())
}

/// Every ring size, size and net of `o`, `o.reps` times interleaved (every
/// net once per repeat, so sample i of two nets are neighbours in time).
pub(crate) fn measure(o: &Opts) -> Result<Vec<Row>, String> {
    let mut rows: Vec<Row> = Vec::new();
    for &n in &o.ranks {
        let mut ring = start_ring(o, n)?;
        for &size in &o.sizes {
            let count = o.count(size);
            let bytes = (size * count * o.conns) as f64;
            let mut pts: Vec<(Stat, Stat)> = vec![Default::default(); o.nets.len()];
            // interleaved: every net once per repeat
            for _ in 0..o.reps {
                for (j, &k) in o.nets.iter().enumerate() {
                    let (t, cpu) = run_once(&mut ring, k, size, count)?;
                    pts[j].0 .0.push(bytes / t / 1e9);
                    pts[j].1 .0.push(cpu / (bytes * n as f64 / 1e9));
                }
            }
            for (j, &k) in o.nets.iter().enumerate() {
                let (busbw, cpu) = pts[j].clone();
                rows.push(Row { ranks: n, size, net: o.label(k), busbw, cpu });
            }
            eprint!("\r  N={n} {} done   ", human(size));
        }
        if o.refused > 0 {
            for (i, c) in ring.ctls.iter_mut().enumerate() {
                c.send(&format!("REFUSE {}", o.refused)).map_err(|e| e.to_string())?;
                let l = c.recv().map_err(|e| format!("rank {i}: {e}"))?;
                if !l.starts_with("DONE") {
                    return Err(format!("rank {i}: {l}"));
                }
            }
        }
        if let Some(p) = &o.hold_until {
            eprintln!("\nholding every rank's comms open until {} exists (at most 600 s)", p.display());
            let t0 = Instant::now();
            while !p.exists() {
                if t0.elapsed() > Duration::from_secs(600) {
                    return Err(format!("{} did not appear within 600 s", p.display()));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        drop(ring);
    }
    eprintln!();
    Ok(rows)
}

fn table(rows: &[Row], nnets: usize) -> String {
    let f = |s: &Stat, p: usize| format!("{:.p$} [{:.p$}-{:.p$}]", s.med(), s.min(), s.max());
    let mut out = String::from(
        "\nbusbw GB/s (= bytes each rank sent / time; all_reduce busbw on a ring) and CPU s/GB (user+sys of all ranks per GB sent): median [min-max]\n",
    );
    out +=
        &format!("{:>3} {:>6}  {:<40} {:>22} {:>8} {:>24} {:>8}\n", "N", "size", "net", "busbw GB/s", "vs nccl0", "CPU s/GB", "vs nccl0");
    for grp in rows.chunks(nnets.max(1)) {
        let base = grp.iter().find(|r| r.net.starts_with("nccl-socket(0"));
        for r in grp {
            let (rb, rc) = match base {
                Some(b) => (format!("{:.2}x", r.busbw.med() / b.busbw.med()), format!("{:.2}x", r.cpu.med() / b.cpu.med())),
                None => ("-".into(), "-".into()),
            };
            out += &format!(
                "{:>3} {:>6}  {:<40} {:>22} {:>8} {:>24} {:>8}\n",
                r.ranks,
                human(r.size),
                r.net,
                f(&r.busbw, 2),
                rb,
                f(&r.cpu, 3),
                rc
            );
        }
    }
    out
}

fn csv(rows: &[Row]) -> String {
    let mut w = String::from("ranks,size,net,busbw_median,busbw_min,busbw_max,cpu_s_per_gb_median,cpu_s_per_gb_min,cpu_s_per_gb_max\n");
    for r in rows {
        w += &format!(
            "{},{},\"{}\",{:.4},{:.4},{:.4},{:.5},{:.5},{:.5}\n",
            r.ranks,
            r.size,
            r.net,
            r.busbw.med(),
            r.busbw.min(),
            r.busbw.max(),
            r.cpu.med(),
            r.cpu.min(),
            r.cpu.max()
        );
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked() {
        assert!(parse(true, vec!["--ranks".into(), "1".into()]).is_err());
        assert!(parse(false, vec!["--nets".into(), "plugin,bogus".into()]).is_err());
        let o = parse(false, vec!["--nets".into(), "nccl0,raw".into(), "--sizes".into(), "4K".into()]).unwrap();
        assert_eq!(o.nets, vec![NetKind::Nccl0, NetKind::Raw]);
        assert_eq!(o.ranks, vec![2]);
        assert_eq!(o.count(4096), (128 << 20) / (4096 * 2));
    }

    #[test]
    fn stat_median_of_even_count_is_the_mean_of_the_middle_two() {
        let s = Stat(vec![4.0, 1.0, 3.0, 2.0]);
        assert_eq!((s.med(), s.min(), s.max()), (2.5, 1.0, 4.0));
    }
}
