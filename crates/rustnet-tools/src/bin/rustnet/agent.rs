//! `rustnet agent`: the per-host end of `rustnet bisect`. It serves one
//! coordinator at a time over a TCP control connection (one text line per
//! command, as in `ctl.rs`) and measures through the plugin's vtable:
//!
//! ```text
//! coordinator            agent
//! HELLO 1            ->  AGENT 1 <host> <dev name> <Mbps> <abi>
//! LISTEN             ->  HANDLE <hex of the 128-byte plugin handle>
//! RUN <peer handle hex> <window ms> <msg bytes> <inflight> <timeout ms>
//!                    ->  RESULT <rx bytes> <rx seconds> <tx bytes> <tx seconds>
//!                    |   ERR <why>
//! QUIT               ->  BYE   (session ends; the agent waits for the next)
//! SHUTDOWN           ->  BYE   (the agent exits)
//! ```
//!
//! `RUN` connects to the peer's handle and accepts the peer on the listen
//! comm of the last `LISTEN` (both at once, as NCCL does), then sends and
//! receives at the same time for the window; after it each side sends
//! `inflight` zero-byte end markers. The receive rate is measured where the
//! bytes land. A peer that never connects, or a transfer that does not end
//! where nothing completes for the timeout (or that is still draining 4
//! timeouts after the window), is an `ERR`, never a hang.
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustnet_tools::driver::{self, hex, unhex, Plugin, Ptr};

use crate::ctl::Ctl;

const HELP: &str = "\
rustnet agent: the per-host end of `rustnet bisect`

  rustnet agent --listen ADDR:PORT [options]

options:
  --listen ADDR:PORT   control address the coordinator connects to (required;
                       0.0.0.0:PORT for every interface)
  --plugin PATH        the plugin .so (default: $RUSTNET_PLUGIN, else librustnet.so
                       beside this binary, else ../lib/librustnet.so as installed)
  --abi N              vtable version to drive: 6..12 (default 8)
  --dev N              plugin device index (default 0)
  --once               exit after the first coordinator session
  --idle-timeout S     end a session whose coordinator says nothing for S seconds (default 300)
The plugin reads its usual variables (NCCL_SOCKET_IFNAME, RUSTNET_TRANSPORT, ...):
set them as for the NCCL job, so the agent measures the path NCCL will use.
One coordinator at a time; a second one is answered BUSY.
Prints `LISTENING <addr>` on stdout once ready.";

struct Opts {
    listen: String,
    plugin: PathBuf,
    abi: u32,
    dev: i32,
    once: bool,
    idle: Duration,
}

/// `librustnet.so` beside the binary (or `$RUSTNET_PLUGIN`), else the
/// `make install` layout: PREFIX/bin/rustnet with PREFIX/lib/librustnet.so.
fn default_plugin() -> PathBuf {
    let p = driver::default_plugin_path();
    if p.exists() || std::env::var_os("RUSTNET_PLUGIN").is_some() {
        return p;
    }
    let lib = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.parent()?.join("lib").join("librustnet.so")));
    lib.filter(|l| l.exists()).unwrap_or(p)
}

fn parse(args: Vec<String>) -> Result<Opts, String> {
    let mut o = Opts { listen: String::new(), plugin: default_plugin(), abi: 8, dev: 0, once: false, idle: Duration::from_secs(300) };
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "-h" | "--help" => {
                println!("{HELP}");
                std::process::exit(0);
            }
            "--listen" => o.listen = val("--listen")?,
            "--plugin" => o.plugin = val("--plugin")?.into(),
            "--abi" => o.abi = val("--abi")?.parse().map_err(|_| "bad --abi")?,
            "--dev" => o.dev = val("--dev")?.parse().map_err(|_| "bad --dev")?,
            "--once" => o.once = true,
            "--idle-timeout" => o.idle = Duration::from_secs(val("--idle-timeout")?.parse().map_err(|_| "bad --idle-timeout")?),
            other => return Err(format!("unknown option {other:?} (see --help)")),
        }
    }
    if o.listen.is_empty() {
        return Err("--listen ADDR:PORT is required".into());
    }
    Ok(o)
}

pub fn main(args: Vec<String>) -> i32 {
    let o = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("rustnet agent: {e}");
            return 2;
        }
    };
    match serve(o) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("rustnet agent: {e}");
            1
        }
    }
}

/// The loaded plugin and what the coordinator is told about it.
struct Agent {
    p: Plugin,
    dev: i32,
    hello: String,
}

fn serve(o: Opts) -> Result<(), String> {
    let p = Plugin::open(&o.plugin, o.abi)?;
    p.init().map_err(|e| format!("plugin init: {e} (see the WARN above)"))?;
    let n = p.devices().map_err(|e| e.to_string())?;
    if o.dev >= n {
        return Err(format!("--dev {} but the plugin has {n} device(s)", o.dev));
    }
    let props = p.properties(o.dev).map_err(|e| e.to_string())?;
    let hello = format!("AGENT 1 {} {} {} {}", rustnet::for_tools::stats::hostname(), props.name.replace(' ', "_"), props.speed, o.abi);
    let agent = Arc::new(Agent { p, dev: o.dev, hello });
    let lst = TcpListener::bind(&o.listen).map_err(|e| format!("bind {}: {e}", o.listen))?;
    let addr = lst.local_addr().map_err(|e| e.to_string())?;
    eprintln!(
        "rustnet agent: plugin {} (ABI v{}), device {} = {} ({} Mbps); control on {addr}",
        o.plugin.display(),
        o.abi,
        o.dev,
        props.name,
        props.speed
    );
    println!("LISTENING {addr}");
    std::io::stdout().flush().ok();
    let busy = Arc::new(AtomicBool::new(false));
    for conn in lst.incoming() {
        let c = match conn {
            Ok(c) => c,
            Err(e) => {
                eprintln!("rustnet agent: accept: {e}");
                continue;
            }
        };
        let peer = c.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        if busy.swap(true, Ordering::SeqCst) {
            // One measurement at a time: a second coordinator would skew both.
            let _ = writeln!(&c, "BUSY another coordinator is connected");
            continue;
        }
        let (agent, busy2) = (agent.clone(), busy.clone());
        let idle = o.idle;
        let h = std::thread::spawn(move || {
            let shutdown = session(&agent, c, &peer, idle);
            busy2.store(false, Ordering::SeqCst);
            shutdown
        });
        if o.once {
            let shutdown = h.join().unwrap_or(true);
            let _ = shutdown;
            return Ok(());
        }
        // Not joined otherwise: the accept loop keeps answering BUSY meanwhile.
        std::thread::spawn(move || {
            if h.join().unwrap_or(false) {
                std::process::exit(0);
            }
        });
    }
    Ok(())
}

/// Serve one coordinator; true when it asked the agent to exit.
fn session(a: &Agent, c: TcpStream, peer: &str, idle: Duration) -> bool {
    eprintln!("rustnet agent: coordinator {peer} connected");
    let _ = c.set_read_timeout(Some(idle));
    let mut ctl = match Ctl::new(c) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rustnet agent: {peer}: {e}");
            return false;
        }
    };
    let mut listen: Option<Ptr> = None;
    let close_listen = |l: &mut Option<Ptr>| {
        if let Some(l) = l.take() {
            let _ = a.p.close_listen(l);
        }
    };
    let shutdown = loop {
        let cmd = match ctl.recv() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("rustnet agent: coordinator {peer}: {e}; session over");
                break false;
            }
        };
        let f: Vec<&str> = cmd.split_whitespace().collect();
        let reply = match f.first().copied() {
            Some("HELLO") => a.hello.clone(),
            Some("LISTEN") => {
                close_listen(&mut listen);
                match a.p.listen(a.dev) {
                    Ok((h, l)) => {
                        listen = Some(l);
                        format!("HANDLE {}", hex(&h))
                    }
                    Err(e) => format!("ERR listen: {e}"),
                }
            }
            Some("RUN") => match (listen.take(), parse_run(&f)) {
                (None, _) => "ERR RUN without LISTEN".into(),
                (Some(l), Err(e)) => {
                    let _ = a.p.close_listen(l);
                    format!("ERR {e}")
                }
                (Some(l), Ok(run)) => match measure(a, l, run) {
                    Ok(m) => {
                        eprintln!(
                            "rustnet agent: received {} B, first after {:.3} s, last after {:.3} s; sent {} B, last done after {:.3} s",
                            m.rx_bytes, m.rx_first, m.rx_secs, m.tx_bytes, m.tx_secs
                        );
                        format!("RESULT {} {:.6} {} {:.6}", m.rx_bytes, m.rx_secs, m.tx_bytes, m.tx_secs)
                    }
                    Err(e) => {
                        eprintln!("rustnet agent: measurement failed: {e}");
                        format!("ERR {e}")
                    }
                },
            },
            Some("QUIT") => {
                let _ = ctl.send("BYE");
                break false;
            }
            Some("SHUTDOWN") => {
                let _ = ctl.send("BYE");
                break true;
            }
            _ => format!("ERR unknown command {cmd:?}"),
        };
        if let Err(e) = ctl.send(&reply) {
            eprintln!("rustnet agent: coordinator {peer}: {e}; session over");
            break false;
        }
    };
    close_listen(&mut listen);
    eprintln!("rustnet agent: coordinator {peer} done");
    shutdown
}

/// Parameters of one `RUN`.
struct Run {
    peer: [u8; 128],
    window: Duration,
    size: usize,
    inflight: usize,
    timeout: Duration,
}

fn parse_run(f: &[&str]) -> Result<Run, String> {
    if f.len() != 6 {
        return Err(format!("RUN needs 5 arguments, got {}", f.len() - 1));
    }
    let h = unhex(f[1]).filter(|h| h.len() == 128).ok_or("bad peer handle")?;
    let mut peer = [0u8; 128];
    peer.copy_from_slice(&h);
    let num = |i: usize| f[i].parse::<u64>().map_err(|_| format!("bad number {:?}", f[i]));
    let run = Run {
        peer,
        window: Duration::from_millis(num(2)?),
        size: num(3)? as usize,
        inflight: num(4)? as usize,
        timeout: Duration::from_millis(num(5)?),
    };
    if run.size == 0 || run.size > 1 << 30 || run.inflight == 0 || run.inflight > 32 {
        return Err("message size 1..1G and inflight 1..32 required".into());
    }
    Ok(run)
}

/// What one side saw.
pub struct Measured {
    pub rx_bytes: u64,
    pub rx_first: f64,
    pub rx_secs: f64,
    pub tx_bytes: u64,
    pub tx_secs: f64,
}

/// Comms of one measurement, closed on every path (before the buffers they
/// may still point into are freed: declare buffers first).
struct Comms<'a> {
    p: &'a Plugin,
    s: Option<Ptr>,
    r: Option<Ptr>,
    l: Ptr,
}

impl Drop for Comms<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.s {
            let _ = self.p.close_send(s);
        }
        if let Some(r) = self.r {
            let _ = self.p.close_recv(r);
        }
        let _ = self.p.close_listen(self.l);
    }
}

/// Back off when nothing completes for a while, so that idle or slow pairs
/// leave the CPU to the others; fast transfers complete often and never sleep.
struct Idle {
    since: Instant,
}

impl Idle {
    fn progressed(&mut self) {
        self.since = Instant::now();
    }
    fn pause(&self) {
        if self.since.elapsed() > Duration::from_micros(500) {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

struct Slot {
    buf: Vec<u8>,
    mh: Option<Ptr>,
    req: Option<(Ptr, usize)>,
}

fn measure(a: &Agent, l: Ptr, mut run: Run) -> Result<Measured, String> {
    let p = &a.p;
    let e = |x: driver::NcclErr| x.to_string();
    let mut sslots: Vec<Slot> = (0..run.inflight).map(|i| Slot { buf: vec![i as u8; run.size], mh: None, req: None }).collect();
    let mut rslots: Vec<Slot> = (0..run.inflight).map(|_| Slot { buf: vec![0u8; run.size], mh: None, req: None }).collect();
    let mut c = Comms { p, s: None, r: None, l };

    // Connect and accept together until both are up or the timeout passes.
    let t0 = Instant::now();
    let idle = Idle { since: t0 };
    while c.s.is_none() || c.r.is_none() {
        if c.s.is_none() {
            c.s = p.connect(a.dev, &mut run.peer).map_err(|x| format!("connect to the peer: {x}"))?;
        }
        if c.r.is_none() {
            c.r = p.accept(l).map_err(|x| format!("accept from the peer: {x}"))?;
        }
        if t0.elapsed() > run.timeout {
            return Err(format!(
                "the peer did not {} within {:?}",
                match (c.s.is_some(), c.r.is_some()) {
                    (false, false) => "accept our connection nor connect to us",
                    (true, false) => "connect to us",
                    _ => "accept our connection",
                },
                run.timeout
            ));
        }
        idle.pause();
    }
    let (s, r) = (c.s.unwrap(), c.r.unwrap());
    for b in &mut sslots {
        b.mh = Some(p.reg_mr(s, b.buf.as_mut_ptr(), b.buf.len()).map_err(e)?);
    }
    for b in &mut rslots {
        b.mh = Some(p.reg_mr(r, b.buf.as_mut_ptr(), b.buf.len()).map_err(e)?);
    }
    let res = pump(p, s, r, &mut sslots, &mut rslots, &run);
    for b in &sslots {
        let _ = p.dereg_mr(s, b.mh.unwrap());
    }
    for b in &rslots {
        let _ = p.dereg_mr(r, b.mh.unwrap());
    }
    res
}

/// Send for the window while receiving, then `inflight` zero-byte end
/// markers; receive until the peer's markers are all in.
fn pump(p: &Plugin, s: Ptr, r: Ptr, sslots: &mut [Slot], rslots: &mut [Slot], run: &Run) -> Result<Measured, String> {
    let e = |x: driver::NcclErr| x.to_string();
    let n = run.inflight;
    let t0 = Instant::now();
    let stop_sending = t0 + run.window;
    // Dead peer: nothing completes for `timeout`. A slow one may take long to
    // drain what sits in socket buffers after the window, but not forever.
    let cap = stop_sending + 4 * run.timeout;
    let mut idle = Idle { since: t0 };
    let (mut rx_bytes, mut rx_first, mut rx_last, mut zeros, mut outstanding) = (0u64, None, t0, 0usize, 0usize);
    let (mut tx_bytes, mut tx_last, mut ends) = (0u64, t0, 0usize);
    loop {
        let now = Instant::now();
        for b in rslots.iter_mut() {
            if b.req.is_none() && zeros + outstanding < n {
                if let Some(q) = p.irecv(r, &[(b.buf.as_mut_ptr(), run.size, 0, b.mh.unwrap())]).map_err(e)? {
                    b.req = Some((q, run.size));
                    outstanding += 1;
                }
            }
            if let Some((q, _)) = b.req {
                let mut sz = [0i32; 8];
                if p.test(q, &mut sz).map_err(e)? {
                    b.req = None;
                    outstanding -= 1;
                    idle.progressed();
                    if sz[0] == 0 {
                        zeros += 1;
                    } else {
                        rx_bytes += sz[0] as u64;
                        rx_last = Instant::now();
                        rx_first.get_or_insert(rx_last);
                    }
                }
            }
        }
        for b in sslots.iter_mut() {
            if b.req.is_none() {
                let len = if now < stop_sending {
                    run.size
                } else if ends < n {
                    0
                } else {
                    continue;
                };
                if let Some(q) = p.isend(s, b.buf.as_mut_ptr(), len, 0, b.mh.unwrap()).map_err(e)? {
                    b.req = Some((q, len));
                    if len == 0 {
                        ends += 1;
                    }
                }
            }
            if let Some((q, len)) = b.req {
                if p.test(q, &mut [0]).map_err(e)? {
                    b.req = None;
                    idle.progressed();
                    if len > 0 {
                        tx_bytes += len as u64;
                        tx_last = Instant::now();
                    }
                }
            }
        }
        let sent_all = ends == n && sslots.iter().all(|b| b.req.is_none());
        if sent_all && zeros == n {
            break;
        }
        if now.duration_since(idle.since) > run.timeout || now > cap {
            return Err(format!(
                "transfer stalled {:.1} s after the {:?} window ({}): received {rx_bytes} bytes and {zeros}/{n} end markers, sent {tx_bytes} bytes and {ends}/{n} markers",
                now.saturating_duration_since(stop_sending).as_secs_f64(),
                run.window,
                if now > cap { "drain limit of 4 timeouts" } else { "nothing completed for a timeout" }
            ));
        }
        idle.pause();
    }
    let secs = |t: Instant| t.duration_since(t0).as_secs_f64().max(1e-9);
    Ok(Measured { rx_bytes, rx_first: rx_first.map_or(0.0, secs), rx_secs: secs(rx_last), tx_bytes, tx_secs: secs(tx_last) })
}
