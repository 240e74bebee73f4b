//! `rustnet bench`: bandwidth and latency through the plugin's vtable, with a
//! raw TCP baseline measured in the same run, printed as a table and CSV.
//! The measurement is shared with `rustnet bench compare` (compare.rs), which
//! puts a raw TCP stream with 1 MiB writes and a polling ping-pong beside it
//! ([`Baseline::Competitor`]) instead of this table's blocking socket.
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rustnet_tools::driver::{self, hex, unhex, Plugin, Ptr};

use crate::ctl::{parse_size, Ctl};
use crate::samples::{human, Stat};

const HELP: &str = "\
rustnet bench: bandwidth and latency through librustnet, beside raw TCP

  rustnet bench compare [...]        what scripts/bench.sh runs: NCCL's pattern beside
                                     NCCL's socket algorithm, bandwidth beside a raw TCP
                                     stream, latency beside a polling ping-pong
                                     (rustnet bench compare --help)
  rustnet bench                      both ends on this host (spawns the server end)
  rustnet bench --listen ADDR:PORT   server end, waits for one client
  rustnet bench --peer ADDR:PORT     client end, connects to a server end
  rustnet bench step|ring [...]      NCCL's pattern: step-sized messages, 8 in flight,
                                     several connections, N ranks in a ring, beside
                                     NCCL's socket algorithm (rustnet bench step --help)
  rustnet bench scale [...]          N idle comm pairs per process and one active:
                                     set-up, memory, fds, threads, idle CPU, latency
                                     and bandwidth per N (rustnet bench scale --help)

options:
  --sizes LIST      message sizes, e.g. 1K,64K,1M,4M (default 1K..64M, x4 steps)
  --reps N          repeats per point; min/median/max are reported (default 5)
  --inflight N      requests in flight per direction (default 4)
  --bytes N         bytes moved per bandwidth point (default 256M)
  --lat-iters N     ping-pong round trips per latency repeat (default 2000; 0 skips latency)
  --lat-size N      ping-pong message size (default 8; e.g. 64K for a message above
                    the eager limit: CTS, then the RDMA write)
  --csv FILE        also write every point as CSV
  --plugin PATH     the plugin .so (default: librustnet.so beside this binary)
  --abi N           vtable version to drive: 6..12 (default 8)
  --no-raw          skip the raw TCP baseline
  --one-way         bandwidth one way only (no bidirectional runs): with
                    RUSTNET_STATS_DIR on both ends, `rustnet stats DIR` then
                    shows what each message cost the sender and the receiver
                    (verbs: doorbells, WRs, CQEs, polls, CTS writes)
  --idle-nap-us N   bandwidth runs: after 8 passes that moved nothing, sleep N us
                    (doubling up to 8N while nothing moves) instead of yielding (default 0). For soft-RoCE, whose NIC is
                    kernel work on the same CPUs: a harness that spins takes them
                    from it (perftest's passive server takes none). Set it on
                    both ends.
  --dev N           plugin device index (default 0)
The plugin reads its usual variables (NCCL_SOCKET_IFNAME, RUSTNET_TRANSPORT, ...).
In loopback mode NCCL_SOCKET_IFNAME defaults to lo.";

/// What the raw TCP columns measure.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Baseline {
    /// This table's: writes of the message size through one blocking socket,
    /// a blocking ping-pong (its latency includes the wake-up from read()).
    Classic,
    /// What a competitor would run: iperf3-like 1 MiB writes with
    /// TCP_NODELAY, a thread per direction; a ping-pong that polls a
    /// non-blocking socket (spin, then yield) as NCCL's proxy polls.
    Competitor,
}

/// The raw stream's write size with [`Baseline::Competitor`].
pub(crate) const RAW_CHUNK: usize = 1 << 20;

#[derive(Clone)]
pub(crate) struct Opts {
    listen: Option<String>,
    peer: Option<String>,
    sizes: Vec<usize>,
    reps: usize,
    inflight: usize,
    bytes: usize,
    pub(crate) lat_iters: usize,
    pub(crate) lat_size: usize,
    csv: Option<PathBuf>,
    plugin: PathBuf,
    abi: u32,
    raw: bool,
    one_way: bool,
    nap_us: u64,
    dev: i32,
    pub(crate) baseline: Baseline,
}

pub(crate) fn parse(args: Vec<String>) -> Result<(Opts, bool), String> {
    let mut o = Opts {
        listen: None,
        peer: None,
        sizes: (0..9).map(|i| 1024usize << (2 * i)).collect(),
        reps: 5,
        inflight: 4,
        bytes: 256 << 20,
        lat_iters: 2000,
        lat_size: 8,
        csv: None,
        plugin: driver::default_plugin_path(),
        abi: 8,
        raw: true,
        one_way: false,
        nap_us: 0,
        dev: 0,
        baseline: Baseline::Classic,
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
            "--sizes" => {
                o.sizes = val("--sizes")?.split(',').map(|s| parse_size(s).ok_or(format!("bad size {s:?}"))).collect::<Result<_, _>>()?
            }
            "--reps" => o.reps = val("--reps")?.parse().map_err(|_| "bad --reps")?,
            "--inflight" => o.inflight = val("--inflight")?.parse().map_err(|_| "bad --inflight")?,
            "--bytes" => o.bytes = parse_size(&val("--bytes")?).ok_or("bad --bytes")?,
            "--lat-iters" => o.lat_iters = val("--lat-iters")?.parse().map_err(|_| "bad --lat-iters")?,
            "--lat-size" => o.lat_size = parse_size(&val("--lat-size")?).filter(|&n| n > 0).ok_or("bad --lat-size")?,
            "--csv" => o.csv = Some(val("--csv")?.into()),
            "--plugin" => o.plugin = val("--plugin")?.into(),
            "--abi" => o.abi = val("--abi")?.parse().map_err(|_| "bad --abi")?,
            "--dev" => o.dev = val("--dev")?.parse().map_err(|_| "bad --dev")?,
            "--no-raw" => o.raw = false,
            "--one-way" => o.one_way = true,
            "--idle-nap-us" => o.nap_us = val("--idle-nap-us")?.parse().map_err(|_| "bad --idle-nap-us")?,
            other => return Err(format!("unknown option {other:?} (see --help)")),
        }
    }
    if o.reps == 0 || o.inflight == 0 || o.inflight > 32 || o.sizes.is_empty() {
        return Err("--reps >= 1, --inflight 1..32 and a non-empty --sizes are required".into());
    }
    if o.sizes.iter().any(|&s| s > 1 << 30) {
        return Err("sizes above 1G exceed the plugin's maxP2pBytes".into());
    }
    let serve = serve || o.listen.is_some() && o.peer.is_none();
    Ok((o, serve))
}

pub fn main(args: Vec<String>) -> i32 {
    match args.first().map(String::as_str) {
        Some("step") => return crate::ring::main(false, args[1..].to_vec()),
        Some("ring") => return crate::ring::main(true, args[1..].to_vec()),
        Some("ring-rank") => return crate::ring::rank_main(args[1..].to_vec()),
        _ => {}
    }
    let (o, serve) = match parse(args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("rustnet bench: {e}");
            return 2;
        }
    };
    let r = if serve { server(&o) } else { measure(&o).and_then(|m| print_classic(&o, &m)) };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("rustnet bench: {e}");
            1
        }
    }
}

// ------------------------------------------------------------ plugin side

/// One plugin connection pair, plus buffers.
pub(crate) struct Net {
    pub(crate) p: std::rc::Rc<Plugin>,
    s: Ptr,
    r: Ptr,
    l: Ptr,
    /// Registered buffers kept across measurements (ib_write_bw registers once,
    /// before timing; so do we), keyed by (comm, count, size).
    cache: std::cell::RefCell<Vec<Bufs>>,
}

impl Net {
    /// A pair opened elsewhere (`rustnet bench scale`): closed when dropped.
    pub(crate) fn from_parts(p: std::rc::Rc<Plugin>, s: Ptr, r: Ptr, l: Ptr) -> Net {
        Net { p, s, r, l, cache: std::cell::RefCell::new(Vec::new()) }
    }

    /// Registered buffers for `comm`: from the cache, or allocated and registered now.
    fn take_bufs(&self, comm: Ptr, n: usize, size: usize) -> Result<Bufs, String> {
        let mut c = self.cache.borrow_mut();
        if let Some(i) = c.iter().position(|b| b.comm == comm && b.bufs.len() == n && b.size == size) {
            return Ok(c.swap_remove(i));
        }
        drop(c);
        Bufs::new(self, comm, n, size)
    }

    /// Give buffers back for the next measurement.
    fn put_bufs(&self, b: Bufs) {
        self.cache.borrow_mut().push(b);
    }

    /// Register what the next measurements of `size` need (outside timing),
    /// and drop registrations of other sizes.
    pub(crate) fn prepare(&self, size: usize, w: usize) -> Result<(), String> {
        let old: Vec<Bufs> = {
            let mut c = self.cache.borrow_mut();
            let (keep, old): (Vec<Bufs>, Vec<Bufs>) = c.drain(..).partition(|b| b.size == size || b.size == 1);
            *c = keep;
            old
        };
        for b in old {
            b.deregister(self);
        }
        for (comm, n, sz) in [(self.s, w, size), (self.r, w, size), (self.s, 1, 1), (self.r, 1, 1), (self.s, 1, size), (self.r, 1, size)] {
            let b = self.take_bufs(comm, n, sz)?;
            self.put_bufs(b);
        }
        Ok(())
    }

    fn open(o: &Opts, ctl: &mut Ctl) -> Result<Net, String> {
        let p = Plugin::open(&o.plugin, o.abi)?;
        p.init().map_err(|e| format!("{e} (see the WARN above)"))?;
        let n = p.devices().map_err(|e| e.to_string())?;
        if o.dev >= n {
            return Err(format!("--dev {} but the plugin has {n} device(s)", o.dev));
        }
        let (h, l) = p.listen(o.dev).map_err(|e| e.to_string())?;
        ctl.send(&format!("HANDLE {}", hex(&h))).map_err(|e| e.to_string())?;
        let peer = unhex(&ctl.expect("HANDLE")?).ok_or("bad handle from peer")?;
        let mut ph = [0u8; 128];
        ph.copy_from_slice(&peer);
        let (s, r) = p.connect_accept(o.dev, &mut ph, l, Duration::from_secs(60))?;
        Ok(Net::from_parts(std::rc::Rc::new(p), s, r, l))
    }

    fn props_line(&self, dev: i32) -> String {
        match self.p.properties(dev) {
            Ok(pr) => format!("{} ({} Mbps)", pr.name, pr.speed),
            Err(e) => e.to_string(),
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for b in std::mem::take(&mut *self.cache.borrow_mut()) {
            b.deregister(self);
        }
        let _ = self.p.close_send(self.s);
        let _ = self.p.close_recv(self.r);
        let _ = self.p.close_listen(self.l);
    }
}

struct Bufs {
    bufs: Vec<Vec<u8>>,
    mhs: Vec<Ptr>,
    comm: Ptr,
    size: usize,
}

impl Bufs {
    fn new(net: &Net, comm: Ptr, n: usize, size: usize) -> Result<Bufs, String> {
        let mut bufs: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; size.max(1)]).collect();
        let mut mhs = Vec::new();
        for b in &mut bufs {
            mhs.push(net.p.reg_mr(comm, b.as_mut_ptr(), b.len()).map_err(|e| e.to_string())?);
        }
        Ok(Bufs { bufs, mhs, comm, size })
    }
    /// Back to the connection's cache (still registered).
    fn release(self, net: &Net) {
        net.put_bufs(self);
    }
    fn deregister(self, net: &Net) {
        for m in self.mhs {
            let _ = net.p.dereg_mr(self.comm, m);
        }
    }
}

/// Ping-pongs (the plugin's and the polling raw one) spin this many empty
/// polls before giving the CPU away: a round trip is a few microseconds on
/// real NICs, and a yield is a system call.
const YIELD_AFTER: u32 = 64;

/// Idle passes after which `--idle-nap-us` sleeps instead of yielding.
const NAP_AFTER: u32 = 8;

/// Move `count` messages of `size` each way that `send`/`recv` say, with
/// `w` requests in flight per direction. Single thread, like NCCL's proxy;
/// after NAP_AFTER passes that moved nothing it sleeps `nap_us` (0: yields).
pub(crate) fn pump(net: &Net, send: usize, recv: usize, size: usize, w: usize, nap_us: u64) -> Result<(), String> {
    let mut sb = net.take_bufs(net.s, w.min(send.max(1)), size)?;
    let mut rb = net.take_bufs(net.r, w.min(recv.max(1)), size)?;
    let e = |x: driver::NcclErr| x.to_string();
    let (mut posted_s, mut done_s, mut posted_r, mut done_r) = (0, 0, 0, 0);
    let mut sq: Vec<Option<Ptr>> = vec![None; sb.bufs.len()];
    let mut rq: Vec<Option<Ptr>> = vec![None; rb.bufs.len()];
    let t0 = Instant::now();
    let mut idle = 0u32;
    while done_s < send || done_r < recv {
        let before = (posted_s, done_s, posted_r, done_r);
        for (i, q) in rq.iter_mut().enumerate() {
            if q.is_none() && posted_r < recv {
                let b = &mut rb.bufs[i];
                if let Some(r) = net.p.irecv(net.r, &[(b.as_mut_ptr(), size, 0, rb.mhs[i])]).map_err(e)? {
                    *q = Some(r);
                    posted_r += 1;
                }
            }
            if let Some(r) = *q {
                let mut sz = [0i32; 8];
                if net.p.test(r, &mut sz).map_err(e)? {
                    *q = None;
                    done_r += 1;
                }
            }
        }
        for (i, q) in sq.iter_mut().enumerate() {
            if q.is_none() && posted_s < send {
                let b = &mut sb.bufs[i];
                if let Some(r) = net.p.isend(net.s, b.as_mut_ptr(), size, 0, sb.mhs[i]).map_err(e)? {
                    *q = Some(r);
                    posted_s += 1;
                }
            }
            if let Some(r) = *q {
                if net.p.test(r, &mut [0]).map_err(e)? {
                    *q = None;
                    done_s += 1;
                }
            }
        }
        // Like NCCL's proxy thread: give the CPU away when a pass moved
        // nothing (matters where the NIC is software, e.g. soft-RoCE).
        if before == (posted_s, done_s, posted_r, done_r) {
            idle += 1;
            if nap_us > 0 && idle > NAP_AFTER {
                // back off while nothing moves: nap_us, doubling up to 8x
                let k = (idle - NAP_AFTER - 1).min(3);
                std::thread::sleep(Duration::from_micros(nap_us << k));
            } else {
                std::thread::yield_now();
            }
        } else {
            idle = 0;
        }
        if t0.elapsed() > Duration::from_secs(600) {
            return Err(format!("stuck: sent {done_s}/{send}, received {done_r}/{recv}"));
        }
    }
    sb.release(net);
    rb.release(net);
    Ok(())
}

/// Ping-pong of `size` bytes, `iters` round trips; the initiator returns the
/// seconds of the whole run and each round trip's microseconds in `rtts`.
/// Receives are posted ahead (two deep) and send completions are reaped in
/// passing, the way NCCL's proxy drives a connection; exactly `iters`
/// receives are posted, so none is left behind for the next measurement.
pub(crate) fn pingpong(net: &Net, size: usize, iters: usize, initiator: bool, rtts: &mut Vec<f64>) -> Result<f64, String> {
    const AHEAD: usize = 2;
    let mut sb = net.take_bufs(net.s, 1, size)?;
    let mut rb = net.take_bufs(net.r, AHEAD, size)?;
    let e = |x: driver::NcclErr| x.to_string();
    let mut posted = 0usize;
    let mut rq: std::collections::VecDeque<(Ptr, usize)> = std::collections::VecDeque::new();
    let mut sq: std::collections::VecDeque<Ptr> = std::collections::VecDeque::new();
    let post = |k: usize, rb: &mut Bufs| -> Result<Ptr, String> {
        let b = rb.bufs[k].as_mut_ptr();
        loop {
            if let Some(r) = net.p.irecv(net.r, &[(b, size, 0, rb.mhs[k])]).map_err(e)? {
                return Ok(r);
            }
        }
    };
    while posted < iters.min(AHEAD) {
        rq.push_back((post(posted, &mut rb)?, posted));
        posted += 1;
    }
    let reap = |sq: &mut std::collections::VecDeque<Ptr>| -> Result<(), String> {
        while let Some(&s) = sq.front() {
            if net.p.test(s, &mut [0]).map_err(e)? {
                sq.pop_front();
            } else {
                break;
            }
        }
        Ok(())
    };
    rtts.clear();
    rtts.reserve(iters);
    let t0 = Instant::now();
    let mut ti = t0;
    let send = |sq: &mut std::collections::VecDeque<Ptr>, sb: &mut Bufs| -> Result<(), String> {
        loop {
            if let Some(s) = net.p.isend(net.s, sb.bufs[0].as_mut_ptr(), size, 0, sb.mhs[0]).map_err(e)? {
                sq.push_back(s);
                return Ok(());
            }
            reap(sq)?;
        }
    };
    if initiator && iters > 0 {
        send(&mut sq, &mut sb)?;
    }
    for i in 0..iters {
        let (r, k) = rq.pop_front().ok_or("no receive posted")?;
        let mut idle = 0u32;
        while !net.p.test(r, &mut [0; 8]).map_err(e)? {
            reap(&mut sq)?;
            idle += 1;
            if idle > YIELD_AFTER {
                std::thread::yield_now();
            }
        }
        if initiator {
            let now = Instant::now();
            rtts.push((now - ti).as_secs_f64() * 1e6);
            ti = now;
        }
        // Both ends answer first, then re-post the freed receive: with
        // receives posted two deep the re-post is off the round trip, as in
        // NCCL's steady state.
        if !initiator || i + 1 < iters {
            send(&mut sq, &mut sb)?;
        }
        if posted < iters {
            rq.push_back((post(k, &mut rb)?, k));
            posted += 1;
        }
        reap(&mut sq)?;
    }
    let dt = t0.elapsed().as_secs_f64();
    while !sq.is_empty() {
        reap(&mut sq)?;
    }
    sb.release(net);
    rb.release(net);
    Ok(dt)
}

// ---------------------------------------------------------- raw TCP side

fn raw_pair_server(lst: &TcpListener) -> Result<TcpStream, String> {
    let (s, _) = lst.accept().map_err(|e| e.to_string())?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    Ok(s)
}

/// Write `send` bytes in `msg`-sized writes while reading `recv` bytes: one
/// direction per thread, like a plain blocking socket pair. Both sides cycle
/// through `nbuf` buffers, the same memory footprint the plugin run has with
/// `nbuf` requests in flight, so cache effects match.
fn raw_stream(mut s: &TcpStream, send: usize, recv: usize, msg: usize, nbuf: usize) -> Result<(), String> {
    let total_w = send;
    let total_r = recv;
    let s2 = s.try_clone().map_err(|e| e.to_string())?;
    let msg = msg.clamp(1, 64 << 20);
    let nbuf = nbuf.max(1);
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let bufs: Vec<Vec<u8>> = (0..nbuf).map(|i| vec![i as u8; msg]).collect();
        let mut left = total_w;
        let mut w = &s2;
        let mut k = 0;
        while left > 0 {
            let n = left.min(msg);
            w.write_all(&bufs[k % nbuf][..n])?;
            k += 1;
            left -= n;
        }
        Ok(())
    });
    let mut bufs: Vec<Vec<u8>> = (0..nbuf).map(|_| vec![0u8; msg]).collect();
    let mut left = total_r;
    let (mut k, mut off) = (0, 0);
    while left > 0 {
        let want = left.min(msg - off);
        let n = s.read(&mut bufs[k % nbuf][off..off + want]).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("raw peer closed".into());
        }
        left -= n;
        off += n;
        if off == msg {
            off = 0;
            k += 1;
        }
    }
    writer.join().map_err(|_| "writer panicked")?.map_err(|e| e.to_string())?;
    Ok(())
}

fn raw_pingpong(mut s: &TcpStream, size: usize, iters: usize, initiator: bool, rtts: &mut Vec<f64>) -> Result<f64, String> {
    let mut b = vec![0u8; size];
    rtts.clear();
    rtts.reserve(iters);
    let t0 = Instant::now();
    let mut ti = t0;
    for _ in 0..iters {
        if initiator {
            s.write_all(&b).map_err(|e| e.to_string())?;
            s.read_exact(&mut b).map_err(|e| e.to_string())?;
            let now = Instant::now();
            rtts.push((now - ti).as_secs_f64() * 1e6);
            ti = now;
        } else {
            s.read_exact(&mut b).map_err(|e| e.to_string())?;
            s.write_all(&b).map_err(|e| e.to_string())?;
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// The polling ping-pong: the socket non-blocking, every read and write
/// retried at once on EAGAIN, yielding after [`YIELD_AFTER`] empty polls
/// (the plugin's ping-pong's policy), so neither side sleeps in the kernel.
fn raw_poll_pingpong(s: &TcpStream, size: usize, iters: usize, initiator: bool, rtts: &mut Vec<f64>) -> Result<f64, String> {
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let r = poll_pingpong_inner(s, size, iters, initiator, rtts);
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    r.map_err(|e| format!("polling ping-pong: {e}"))
}

fn poll_pingpong_inner(mut s: &TcpStream, size: usize, iters: usize, initiator: bool, rtts: &mut Vec<f64>) -> std::io::Result<f64> {
    use std::io::ErrorKind::WouldBlock;
    fn spin(idle: &mut u32) {
        *idle += 1;
        if *idle > YIELD_AFTER {
            std::thread::yield_now();
        }
    }
    let mut b = vec![0u8; size];
    let send = |s: &mut &TcpStream, b: &[u8]| -> std::io::Result<()> {
        let (mut off, mut idle) = (0, 0u32);
        while off < b.len() {
            match s.write(&b[off..]) {
                Ok(n) => off += n,
                Err(e) if e.kind() == WouldBlock => spin(&mut idle),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    };
    let recv = |s: &mut &TcpStream, b: &mut [u8]| -> std::io::Result<()> {
        let (mut off, mut idle) = (0, 0u32);
        while off < b.len() {
            match s.read(&mut b[off..]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => off += n,
                Err(e) if e.kind() == WouldBlock => spin(&mut idle),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    };
    rtts.clear();
    rtts.reserve(iters);
    let t0 = Instant::now();
    let mut ti = t0;
    for _ in 0..iters {
        if initiator {
            send(&mut s, &b)?;
            recv(&mut s, &mut b)?;
            let now = Instant::now();
            rtts.push((now - ti).as_secs_f64() * 1e6);
            ti = now;
        } else {
            recv(&mut s, &mut b)?;
            send(&mut s, &b)?;
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

// ------------------------------------------------------------ the roles

fn server(o: &Opts) -> Result<(), String> {
    let addr = o.listen.clone().unwrap_or_else(|| "127.0.0.1:0".into());
    let lst = TcpListener::bind(&addr).map_err(|e| format!("bind {addr}: {e}"))?;
    println!("LISTENING {}", lst.local_addr().map_err(|e| e.to_string())?);
    std::io::stdout().flush().ok();
    let (c, peer) = lst.accept().map_err(|e| e.to_string())?;
    eprintln!("rustnet bench: client {peer} connected");
    let mut ctl = Ctl::new(c).map_err(|e| e.to_string())?;
    let net = Net::open(o, &mut ctl)?;
    let raw_lst = TcpListener::bind(SocketAddr::new(lst.local_addr().unwrap().ip(), 0)).map_err(|e| e.to_string())?;
    ctl.send(&format!("RAWPORT {}", raw_lst.local_addr().unwrap().port())).map_err(|e| e.to_string())?;
    let mut raw: Option<TcpStream> = None;
    loop {
        let cmd = match ctl.recv() {
            Ok(c) => c,
            Err(_) => return Ok(()), // client finished
        };
        let f: Vec<&str> = cmd.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
        let res = match f.first().copied() {
            Some("PREP") => net.prepare(num(1), num(2)),
            Some("OW") => pump(&net, 0, num(2), num(1), num(3), o.nap_us).and_then(|_| pump(&net, 1, 0, 1, 1, 0)),
            Some("BI") => pump(&net, num(2), num(2), num(1), num(3), o.nap_us).and_then(|_| pump(&net, 1, 1, 1, 1, 0)),
            Some("PP") => pingpong(&net, num(1), num(2), false, &mut Vec::new()).map(|_| ()),
            Some("RAWCONN") => raw_pair_server(&raw_lst).map(|s| raw = Some(s)),
            // RAWOW/RAWBI size count nbuf [chunk]: writes of chunk bytes (default: size)
            Some("RAWOW") => raw.as_ref().ok_or("no raw".to_string()).and_then(|s| {
                raw_stream(s, 0, num(1) * num(2), if num(4) > 0 { num(4) } else { num(1) }, num(3))?;
                raw_stream(s, 1, 0, 1, 1)
            }),
            Some("RAWBI") => raw.as_ref().ok_or("no raw".to_string()).and_then(|s| {
                raw_stream(s, num(1) * num(2), num(1) * num(2), if num(4) > 0 { num(4) } else { num(1) }, num(3))?;
                raw_stream(s, 1, 1, 1, 1)
            }),
            Some("RAWPOLL") => raw
                .as_ref()
                .ok_or("no raw".to_string())
                .and_then(|s| raw_poll_pingpong(s, num(1), num(2), false, &mut Vec::new()).map(|_| ())),
            Some("RAWPP") => {
                raw.as_ref().ok_or("no raw".to_string()).and_then(|s| raw_pingpong(s, num(1), num(2), false, &mut Vec::new()).map(|_| ()))
            }
            Some("BYE") => return Ok(()),
            _ => Err(format!("unknown command {cmd:?}")),
        };
        match res {
            Ok(()) => ctl.send("OK").map_err(|e| e.to_string())?,
            Err(e) => {
                let _ = ctl.send(&format!("ERR {e}"));
                return Err(e);
            }
        }
    }
}

fn run_cmd(ctl: &mut Ctl, cmd: &str) -> Result<(), String> {
    ctl.send(cmd).map_err(|e| e.to_string())
}

fn wait_ok(ctl: &mut Ctl) -> Result<(), String> {
    let l = ctl.recv().map_err(|e| e.to_string())?;
    if l == "OK" {
        Ok(())
    } else {
        Err(format!("server end: {l}"))
    }
}

/// What one run of the client measured: per size (one-way, bidirectional,
/// raw one-way, raw bidirectional) in GB/s, and the 8-byte half round trip
/// in microseconds (average and typical, plugin and raw). Samples are in
/// repeat order, plugin and raw interleaved.
pub(crate) struct Measured {
    pub header: String,
    pub rows: Vec<(usize, Stat, Stat, Stat, Stat)>,
    pub lat: Stat,
    pub lat_typ: Stat,
    pub rlat: Stat,
    pub rlat_typ: Stat,
}

/// Both ends' measurement (the client's half); `o.baseline` picks the raw side.
pub(crate) fn measure(o: &Opts) -> Result<Measured, String> {
    let mut child = None;
    let peer = match &o.peer {
        Some(p) => p.clone(),
        None => {
            // Loopback: start the server end as a second process.
            let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
            cmd.args(["bench", "--serve", "--plugin"]).arg(&o.plugin).args(["--abi", &o.abi.to_string(), "--dev", &o.dev.to_string()]);
            if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
                std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
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
    let net = Net::open(o, &mut ctl)?;
    let rawport: u16 = ctl.expect("RAWPORT")?.parse().map_err(|_| "bad RAWPORT")?;
    let peer_ip = peer.parse::<SocketAddr>().map(|a| a.ip()).map_err(|_| format!("--peer must be ADDR:PORT, got {peer}"))?;
    let raw = if o.raw {
        run_cmd(&mut ctl, "RAWCONN")?;
        let s = TcpStream::connect((peer_ip, rawport)).map_err(|e| e.to_string())?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        wait_ok(&mut ctl)?;
        Some(s)
    } else {
        None
    };

    let header = format!(
        "rustnet bench: plugin {} (ABI v{}), device {} = {}, peer {}, {} in flight, {} repeats",
        o.plugin.display(),
        o.abi,
        o.dev,
        net.props_line(o.dev),
        peer,
        o.inflight,
        o.reps
    );
    if o.baseline == Baseline::Classic {
        println!("{header}");
    }
    // the raw stream's write size: the message size, or 1 MiB as iperf3-like tools write
    let chunk = if o.baseline == Baseline::Competitor { RAW_CHUNK } else { 0 };
    let mut rows: Vec<(usize, Stat, Stat, Stat, Stat)> = Vec::new();
    let progress = o.sizes.len() > 3;
    for (k, &size) in o.sizes.iter().enumerate() {
        let count = (o.bytes / size).clamp(8, 200_000);
        let (mut ow, mut bi, mut row, mut rbi) = (Stat::default(), Stat::default(), Stat::default(), Stat::default());
        // register both ends' buffers before any timing starts
        run_cmd(&mut ctl, &format!("PREP {size} {}", o.inflight))?;
        net.prepare(size, o.inflight)?;
        wait_ok(&mut ctl)?;
        for _ in 0..o.reps {
            // plugin one-way: we send, the server receives then acks
            let t = Instant::now();
            run_cmd(&mut ctl, &format!("OW {size} {count} {}", o.inflight))?;
            pump(&net, count, 0, size, o.inflight, o.nap_us)?;
            pump(&net, 0, 1, 1, 1, 0)?;
            let dt = t.elapsed().as_secs_f64();
            wait_ok(&mut ctl)?;
            ow.0.push((size * count) as f64 / dt / 1e9);
            // plugin bidirectional: both send and receive at once
            if !o.one_way {
                let t = Instant::now();
                run_cmd(&mut ctl, &format!("BI {size} {count} {}", o.inflight))?;
                pump(&net, count, count, size, o.inflight, o.nap_us)?;
                pump(&net, 1, 1, 1, 1, 0)?;
                let dt = t.elapsed().as_secs_f64();
                wait_ok(&mut ctl)?;
                bi.0.push((2 * size * count) as f64 / dt / 1e9);
            }
            if let Some(s) = &raw {
                let t = Instant::now();
                run_cmd(&mut ctl, &format!("RAWOW {size} {count} {} {chunk}", o.inflight))?;
                raw_stream(s, size * count, 0, if chunk > 0 { chunk } else { size }, o.inflight)?;
                raw_stream(s, 0, 1, 1, 1)?;
                let dt = t.elapsed().as_secs_f64();
                wait_ok(&mut ctl)?;
                row.0.push((size * count) as f64 / dt / 1e9);
                let t = Instant::now();
                run_cmd(&mut ctl, &format!("RAWBI {size} {count} {} {chunk}", o.inflight))?;
                raw_stream(s, size * count, size * count, if chunk > 0 { chunk } else { size }, o.inflight)?;
                raw_stream(s, 1, 1, 1, 1)?;
                let dt = t.elapsed().as_secs_f64();
                wait_ok(&mut ctl)?;
                rbi.0.push((2 * size * count) as f64 / dt / 1e9);
            }
        }
        if progress {
            eprint!("\r  [{}/{}] {} done   ", k + 1, o.sizes.len(), human(size));
        }
        rows.push((size, ow, bi, row, rbi));
    }
    if progress {
        eprintln!();
    }
    // latency
    // average (run time / round trips) and typical (median round trip), both halved
    let (mut lat, mut lat_typ) = (Stat::default(), Stat::default());
    let (mut rlat, mut rlat_typ) = (Stat::default(), Stat::default());
    let mut rtts = Vec::new();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let ls = o.lat_size;
    if o.lat_iters > 0 {
        run_cmd(&mut ctl, &format!("PREP {ls} 2"))?;
        net.prepare(ls, 2)?;
        wait_ok(&mut ctl)?;
    }
    for _ in 0..if o.lat_iters > 0 { o.reps } else { 0 } {
        run_cmd(&mut ctl, &format!("PP {ls} {}", o.lat_iters))?;
        let dt = pingpong(&net, ls, o.lat_iters, true, &mut rtts)?;
        wait_ok(&mut ctl)?;
        lat.0.push(dt / (2.0 * o.lat_iters as f64) * 1e6);
        lat_typ.0.push(median(&mut rtts) / 2.0);
        if let Some(s) = &raw {
            let dt = if o.baseline == Baseline::Competitor {
                run_cmd(&mut ctl, &format!("RAWPOLL {ls} {}", o.lat_iters))?;
                raw_poll_pingpong(s, ls, o.lat_iters, true, &mut rtts)?
            } else {
                run_cmd(&mut ctl, &format!("RAWPP {ls} {}", o.lat_iters))?;
                raw_pingpong(s, ls, o.lat_iters, true, &mut rtts)?
            };
            wait_ok(&mut ctl)?;
            rlat.0.push(dt / (2.0 * o.lat_iters as f64) * 1e6);
            rlat_typ.0.push(median(&mut rtts) / 2.0);
        }
    }
    let _ = ctl.send("BYE");
    drop(net);
    if let Some(mut c) = child {
        let _ = c.wait();
    }
    Ok(Measured { header, rows, lat, lat_typ, rlat, rlat_typ })
}

/// The classic table (plugin beside a blocking socket) and its CSV.
fn print_classic(o: &Opts, m: &Measured) -> Result<(), String> {
    let Measured { rows, lat, lat_typ, rlat, rlat_typ, .. } = m;
    let (lat, lat_typ, rlat, rlat_typ) = (lat, lat_typ, rlat, rlat_typ);
    // table
    let f = |s: &Stat| if s.0.is_empty() { "-".to_string() } else { format!("{:.2} [{:.2}-{:.2}]", s.med(), s.min(), s.max()) };
    let ratio = |a: &Stat, b: &Stat| if b.0.is_empty() { "-".to_string() } else { format!("{:.0}%", 100.0 * a.med() / b.med()) };
    println!("\nbandwidth, GB/s: median [min-max] over {} repeats", o.reps);
    println!(
        "{:>6}  {:>20} {:>20} {:>6}   {:>20} {:>20} {:>6}",
        "size", "plugin one-way", "raw TCP one-way", "ratio", "plugin bidir", "raw TCP bidir", "ratio"
    );
    for (size, ow, bi, row, rbi) in rows {
        println!(
            "{:>6}  {:>20} {:>20} {:>6}   {:>20} {:>20} {:>6}",
            human(*size),
            f(ow),
            f(row),
            ratio(ow, row),
            f(bi),
            f(rbi),
            ratio(bi, rbi)
        );
    }
    println!("\n{}-byte half round trip, us: median [min-max] over {} x {} round trips", o.lat_size, o.reps, o.lat_iters);
    println!("  (average = run time / round trips / 2; typical = median round trip / 2, as perftest's t_typical)");
    for (what, a, b) in [("average", lat, rlat), ("typical", lat_typ, rlat_typ)] {
        println!(
            "  {what}  plugin {:>22}   raw TCP {:>22}   ratio {}",
            f(a),
            f(b),
            if b.0.is_empty() { "-".into() } else { format!("{:.2}x", a.med() / b.med()) }
        );
    }
    if let Some(path) = &o.csv {
        let mut w = String::from("test,size,transport,median,min,max,unit\n");
        for (size, ow, bi, row, rbi) in rows {
            for (t, tr, s) in [("oneway", "plugin", ow), ("oneway", "rawtcp", row), ("bidir", "plugin", bi), ("bidir", "rawtcp", rbi)] {
                if !s.0.is_empty() {
                    w += &format!("{t},{size},{tr},{:.4},{:.4},{:.4},GB/s\n", s.med(), s.min(), s.max());
                }
            }
        }
        for (t, tr, s) in [
            ("latency", "plugin", lat),
            ("latency", "rawtcp", rlat),
            ("latency_typical", "plugin", lat_typ),
            ("latency_typical", "rawtcp", rlat_typ),
        ] {
            if !s.0.is_empty() {
                w += &format!("{t},{},{tr},{:.3},{:.3},{:.3},us\n", o.lat_size, s.med(), s.min(), s.max());
            }
        }
        std::fs::write(path, w).map_err(|e| format!("write {}: {e}", path.display()))?;
        println!("\nCSV written to {}", path.display());
    }
    Ok(())
}
