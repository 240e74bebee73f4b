//! Verbs traffic under packet loss, for tests/rxe-vm/loss.sh (runs inside
//! the soft-RoCE VM): one process drives the built plugin through its vtable
//! on two devices (dev 0 = rxe0/veth0, dev 1 = rxe1/veth1), one connection
//! each way, both directions at once, every byte of every message checked
//! against a pattern. After both connections are up it runs LOSS_APPLY (a
//! shell command, e.g. `tc qdisc replace dev veth1 root netem loss 1%`), so
//! the out-of-band TCP set-up is never what is lost, then moves the data.
//!
//! LOSS_MODE=ok   the traffic must finish with every byte right; prints
//!                `LOSS ok bytes=N secs=S MBps=R` (exit 1 on any error or corruption)
//! LOSS_MODE=fail an error is expected (100% loss): prints
//!                `LOSS failed secs=S first=<call> pair=<a->b> code=<ncclResult>`,
//!                S from LOSS_APPLY to the first failing call (exit 1 if
//!                nothing failed within LOSS_DEADLINE_S, or bytes were wrong)
//!
//! LOSS_BEFORE, a shell command run before the connections are set up
//! (a link flap during connect), is LOSS_APPLY's twin.
//!
//! Knobs: LOSS_BYTES per direction (32 MiB), LOSS_SECONDS (instead of a
//! byte count: send until this many seconds have passed, then finish what
//! is in flight), LOSS_MSG (1 MiB), LOSS_WINDOW
//! (4 in flight per connection), LOSS_DEADLINE_S (120), LOSS_TIMELINE (a
//! file: one line `<unix time> <pair> <message>` per message received, for
//! the flap scenarios' "traffic again after link-up"). The plugin's own
//! knobs come from the environment (RUSTNET_TRANSPORT=ib, NCCL_IB_HCA,
//! NCCL_IB_TIMEOUT, NCCL_IB_RETRY_CNT, RUSTNET_STATS_DIR, ...).
#[path = "../../../tests/common/mod.rs"]
mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use common::proc::env_u64;
use rustnet_tools::driver::{default_plugin_path, Plugin, Ptr};

fn pattern(pair: usize, idx: u64, len: usize) -> Vec<u8> {
    let mut x = (pair as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ idx.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

struct Flight {
    idx: u64,
    req: Ptr,
    buf: Vec<u8>,
    mh: Ptr,
}

/// One connection's traffic: sends on `s`, receives on `r`.
struct Pair {
    name: String,
    s: Ptr,
    r: Ptr,
    sends: VecDeque<Flight>,
    recvs: VecDeque<Flight>,
    next_send: u64,
    next_recv: u64,
    sent: u64,
    got: u64,
}

/// Where each received message is logged with its wall-clock time.
static TIMELINE: std::sync::Mutex<Option<std::fs::File>> = std::sync::Mutex::new(None);

fn log_arrival(pair: usize, idx: u64) {
    use std::io::Write;
    if let Some(f) = TIMELINE.lock().unwrap().as_mut() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let _ = writeln!(f, "{:.6} {pair} {idx}", t.as_secs_f64());
    }
}

enum Fail {
    Call(String, i32),
    Corrupt(String),
}

impl Pair {
    fn step(&mut self, p: &Plugin, idx: usize, n: u64, msg: usize, window: usize) -> Result<(), Fail> {
        let call = |what: &str, e: rustnet_tools::driver::NcclErr| Fail::Call(what.to_string(), e.code);
        while self.next_recv < n && self.recvs.len() < window {
            let mut buf = vec![0u8; msg];
            let mh = p.reg_mr(self.r, buf.as_mut_ptr(), msg).map_err(|e| call("regMr", e))?;
            match p.irecv(self.r, &[(buf.as_mut_ptr(), msg, 1, mh)]).map_err(|e| call("irecv", e))? {
                Some(req) => {
                    self.recvs.push_back(Flight { idx: self.next_recv, req, buf, mh });
                    self.next_recv += 1;
                }
                None => {
                    p.dereg_mr(self.r, mh).map_err(|e| call("deregMr", e))?;
                    break;
                }
            }
        }
        while self.next_send < n && self.sends.len() < window {
            let mut buf = pattern(idx, self.next_send, msg);
            let mh = p.reg_mr(self.s, buf.as_mut_ptr(), msg).map_err(|e| call("regMr", e))?;
            match p.isend(self.s, buf.as_mut_ptr(), msg, 1, mh).map_err(|e| call("isend", e))? {
                Some(req) => {
                    self.sends.push_back(Flight { idx: self.next_send, req, buf, mh });
                    self.next_send += 1;
                }
                None => {
                    p.dereg_mr(self.s, mh).map_err(|e| call("deregMr", e))?;
                    break;
                }
            }
        }
        if let Some(f) = self.sends.front() {
            if p.test(f.req, &mut [0]).map_err(|e| call("test(send)", e))? {
                let f = self.sends.pop_front().unwrap();
                p.dereg_mr(self.s, f.mh).map_err(|e| call("deregMr", e))?;
                self.sent += msg as u64;
            }
        }
        if let Some(f) = self.recvs.front() {
            let mut sizes = [0i32; 8];
            if p.test(f.req, &mut sizes).map_err(|e| call("test(recv)", e))? {
                let f = self.recvs.pop_front().unwrap();
                if sizes[0] as usize != msg || f.buf != pattern(idx, f.idx, msg) {
                    return Err(Fail::Corrupt(format!("{}: message {} arrived wrong (size {})", self.name, f.idx, sizes[0])));
                }
                p.dereg_mr(self.r, f.mh).map_err(|e| call("deregMr", e))?;
                self.got += msg as u64;
                log_arrival(idx, f.idx);
            }
        }
        Ok(())
    }
}

fn main() {
    let fail_mode = std::env::var("LOSS_MODE").as_deref() == Ok("fail");
    let msg = env_u64("LOSS_MSG", 1 << 20) as usize;
    let by_time = std::env::var("LOSS_SECONDS").ok().and_then(|v| v.parse::<f64>().ok());
    let mut n = if by_time.is_some() { u64::MAX } else { env_u64("LOSS_BYTES", 32 << 20).div_ceil(msg as u64) };
    let window = env_u64("LOSS_WINDOW", 4) as usize;
    let deadline = Duration::from_secs(env_u64("LOSS_DEADLINE_S", 120));
    if let Ok(path) = std::env::var("LOSS_TIMELINE") {
        *TIMELINE.lock().unwrap() = Some(std::fs::File::create(&path).unwrap_or_else(|e| panic!("LOSS_TIMELINE {path}: {e}")));
    }
    let p = Plugin::open(&default_plugin_path(), 8).unwrap_or_else(|e| panic!("{e}"));
    p.init().unwrap_or_else(|e| panic!("init: {e}"));
    let ndev = p.devices().unwrap();
    assert!(ndev >= 2, "need two devices (NCCL_IB_HCA=rxe0,rxe1), have {ndev}");
    let names: Vec<String> = (0..2).map(|d| p.properties(d).unwrap().name).collect();
    println!("LOSS devices {} {}", names[0], names[1]);
    if let Ok(cmd) = std::env::var("LOSS_BEFORE") {
        let st = std::process::Command::new("sh").arg("-c").arg(&cmd).status().expect("run LOSS_BEFORE");
        assert!(st.success(), "LOSS_BEFORE failed: {cmd}");
    }
    // pair 0: dev 0 sends to dev 1; pair 1: dev 1 sends to dev 0
    let mut pairs = Vec::new();
    let mut listens = Vec::new();
    for (from, to) in [(0, 1), (1, 0)] {
        let (mut h, l) = p.listen(to).unwrap_or_else(|e| panic!("listen: {e}"));
        let (s, r) = p.connect_accept(from, &mut h, l, Duration::from_secs(60)).unwrap_or_else(|e| panic!("connect: {e}"));
        listens.push(l);
        pairs.push(Pair {
            name: format!("{}->{}", names[from as usize], names[to as usize]),
            s,
            r,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            next_send: 0,
            next_recv: 0,
            sent: 0,
            got: 0,
        });
    }
    println!("LOSS connected");
    if let Ok(cmd) = std::env::var("LOSS_APPLY") {
        let st = std::process::Command::new("sh").arg("-c").arg(&cmd).status().expect("run LOSS_APPLY");
        assert!(st.success(), "LOSS_APPLY failed: {cmd}");
    }
    let t0 = Instant::now();
    let mut failure: Option<(f64, String, String, i32)> = None;
    // messages each pair moves (by time: until time is up, then what it started)
    let mut ns = vec![n; pairs.len()];
    'run: while pairs.iter().zip(&ns).any(|(x, &n)| x.got < n.saturating_mul(msg as u64) || x.sent < n.saturating_mul(msg as u64)) {
        if by_time.is_some_and(|s| n == u64::MAX && t0.elapsed().as_secs_f64() >= s) {
            // time is up: each pair finishes the messages either of its ends
            // started (not the faster pair's count: the directions need not
            // move at one speed, and the slower one would run on for minutes)
            n = 0;
            for (k, x) in pairs.iter().enumerate() {
                ns[k] = x.next_send.max(x.next_recv);
            }
        }
        for (i, x) in pairs.iter_mut().enumerate() {
            match x.step(&p, i, ns[i], msg, window) {
                Ok(()) => {}
                Err(Fail::Corrupt(w)) => {
                    println!("LOSS CORRUPT {w}");
                    std::process::exit(1);
                }
                Err(Fail::Call(what, code)) => {
                    failure = Some((t0.elapsed().as_secs_f64(), what, x.name.clone(), code));
                    break 'run;
                }
            }
        }
        if t0.elapsed() > deadline {
            let st: Vec<String> = pairs.iter().map(|x| format!("{}: sent {} got {}", x.name, x.sent, x.got)).collect();
            println!("LOSS STUCK after {:.1} s ({})", deadline.as_secs_f64(), st.join(", "));
            std::process::exit(1);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let bytes: u64 = pairs.iter().map(|x| x.got).sum();
    // close (a failed comm closes too)
    for x in &pairs {
        let _ = p.close_send(x.s);
        let _ = p.close_recv(x.r);
    }
    for l in listens {
        let _ = p.close_listen(l);
    }
    match (fail_mode, failure) {
        (false, None) => println!("LOSS ok bytes={bytes} secs={secs:.2} MBps={:.1}", bytes as f64 / secs / 1e6),
        (true, Some((t, what, pair, code))) => println!("LOSS failed secs={t:.3} first={what} pair={pair} code={code}"),
        (false, Some((t, what, pair, code))) => {
            println!("LOSS UNEXPECTED failure after {t:.3} s: {what} on {pair} returned {code}");
            std::process::exit(1);
        }
        (true, None) => {
            println!("LOSS UNEXPECTED: all {bytes} bytes arrived although every RoCE packet should be lost");
            std::process::exit(1);
        }
    }
}
