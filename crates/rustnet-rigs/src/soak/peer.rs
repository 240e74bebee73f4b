//! The soak's peer side: one cycle after another on the coordinator's word.
use super::*;

// ------------------------------------------------------------------ peer side

/// Per-cycle seed of a sender: the pattern of every byte follows from it and
/// the (round, buffer) sequence numbers.
pub(crate) fn cycle_seed(base: u64, cycle: u64, role: &str) -> u64 {
    base.wrapping_mul(1_000_003) ^ (cycle << 24) ^ if role == "A" { 0xA } else { 0xB }
}

/// What a cycle leaves to clean up, whatever its outcome.
#[derive(Default)]
pub(crate) struct Live {
    pub(crate) s: Option<Ptr>,
    pub(crate) r: Option<Ptr>,
    pub(crate) l: Option<Ptr>,
    pub(crate) fl: InFlight,
}

pub(crate) enum Outcome {
    Ok,
    Err(String),
    Corrupt(String),
    Aborted(&'static str),
}

pub(crate) struct PeerCtx {
    pub(crate) p: Plugin,
    pub(crate) dev: i32,
    pub(crate) max_recvs: usize,
    pub(crate) rx: Receiver<String>,
}

impl PeerCtx {
    /// A line from the coordinator arrived (only ABORT is ever sent mid-cycle).
    pub(crate) fn aborted(&self) -> bool {
        self.rx.try_recv().is_ok()
    }
}

/// Deregister, close, and only then free the buffers (a failed comm may
/// still have requests in flight on them until it is closed).
pub(crate) fn cleanup(ctx: &PeerCtx, live: &mut Live) -> Vec<String> {
    let p = &ctx.p;
    let mut errs = Vec::new();
    if let Some(s) = live.s {
        for ss in &live.fl.sends {
            if let Err(e) = p.dereg_mr(s, ss.mh) {
                errs.push(e.to_string());
            }
        }
    }
    if let Some(r) = live.r {
        for rs in &live.fl.recvs {
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
    live.fl.sends.clear();
    live.fl.recvs.clear();
    errs
}

pub(crate) fn peer_main(role: String) {
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
        let mut c = Counters::default();
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
            let (s, r) = (live.s.unwrap(), live.r.unwrap());
            let t =
                Traffic { p: &ctx.p, s, r, my_seed: mine, peer_seed: theirs, rounds, max_recvs: ctx.max_recvs, max_big, deadline: None };
            match t.run(&mut live.fl, &mut c, &|| ctx.aborted()) {
                Ok(()) => Outcome::Ok,
                Err(Stop::Err(e)) => Outcome::Err(e),
                Err(Stop::Corrupt(e)) => Outcome::Corrupt(e),
                Err(Stop::Aborted(stage)) => Outcome::Aborted(stage),
            }
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
