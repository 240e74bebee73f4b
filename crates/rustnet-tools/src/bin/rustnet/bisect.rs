//! `rustnet bisect`: find the slow host(s) among N hosts running `rustnet
//! agent`, measuring pair bandwidth through the plugin, many disjoint pairs
//! at once per round. The decisions (which pairs next, who is slow) are
//! `rustnet_tools::bisect`; this file does the talking, the table, the CSV and the
//! SVG heat map.
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustnet_tools::bisect::{default_max_rounds, Bisect, PairResult, Report, Verdict};

use crate::ctl::{parse_size, Ctl};

const HELP: &str = "\
rustnet bisect: find the slow host(s) among hosts running `rustnet agent`

  rustnet bisect --hosts HOST:PORT,HOST:PORT,... [options]
  rustnet bisect --hostfile FILE [options]        (one HOST:PORT a line, # comments)

Round 1 pairs the first half of the list with the second half, all pairs at
once; later rounds pair every suspect with a host already measured fast, so
each slow host is isolated. The rule: a host's score is the best pair
bandwidth it reached (the slower direction of that pair); it is SLOW when the
score is below THRESHOLD% of the median score over the hosts that answered,
and it was slow with CONFIRM distinct partners already measured fast.

options:
  --threshold PCT   the rule's percentage (default 50)
  --confirm N       slow pairs with distinct known-fast partners needed to name
                    a host (default 2: one unlucky sample names nobody)
  --window MS       timed window of each pair measurement (default 1000)
  --size BYTES      message size, e.g. 64K, 1M (default 1M)
  --inflight N      messages in flight per direction (default 4)
  --timeout S       bound on an agent answering, on a pair finding each other,
                    and on a transfer making no progress (default 10); a round
                    lasts at most window + 5 x timeout + 5 s
  --max-rounds N    round limit (default 1 + CONFIRM + ceil(log2 hosts))
  --csv FILE        write the pair matrix (GB/s, row sends, column receives)
  --svg FILE        draw the pair matrix as a heat map
  --shutdown        tell the agents to exit at the end (mpirun, ssh launchers)
Exit status: 0 nothing found, 3 a host named SLOW, UNREACHABLE or UNDETERMINED,
1 error, 2 usage.";

struct Opts {
    hosts: Vec<String>,
    frac: f64,
    confirm: usize,
    window: Duration,
    size: usize,
    inflight: usize,
    timeout: Duration,
    max_rounds: Option<usize>,
    csv: Option<PathBuf>,
    svg: Option<PathBuf>,
    shutdown: bool,
}

fn parse(args: Vec<String>) -> Result<Opts, String> {
    let mut o = Opts {
        hosts: Vec::new(),
        frac: 0.5,
        confirm: 2,
        window: Duration::from_millis(1000),
        size: 1 << 20,
        inflight: 4,
        timeout: Duration::from_secs(10),
        max_rounds: None,
        csv: None,
        svg: None,
        shutdown: false,
    };
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "-h" | "--help" => {
                println!("{HELP}");
                std::process::exit(0);
            }
            "--hosts" => o.hosts.extend(val("--hosts")?.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from)),
            "--hostfile" => {
                let f = val("--hostfile")?;
                let text = std::fs::read_to_string(&f).map_err(|e| format!("{f}: {e}"))?;
                o.hosts.extend(text.lines().map(|l| l.split('#').next().unwrap_or("").trim()).filter(|l| !l.is_empty()).map(String::from));
            }
            "--threshold" => {
                let p: f64 = val("--threshold")?.trim_end_matches('%').parse().map_err(|_| "bad --threshold")?;
                if !(p > 0.0 && p < 100.0) {
                    return Err("--threshold is a percentage between 0 and 100".into());
                }
                o.frac = p / 100.0;
            }
            "--confirm" => o.confirm = val("--confirm")?.parse().ok().filter(|&k| k >= 1).ok_or("bad --confirm (1 or more)")?,
            "--window" => o.window = Duration::from_millis(val("--window")?.parse().map_err(|_| "bad --window")?),
            "--size" => o.size = parse_size(&val("--size")?).ok_or("bad --size")?,
            "--inflight" => o.inflight = val("--inflight")?.parse().map_err(|_| "bad --inflight")?,
            "--timeout" => o.timeout = Duration::from_secs_f64(val("--timeout")?.parse().map_err(|_| "bad --timeout")?),
            "--max-rounds" => o.max_rounds = Some(val("--max-rounds")?.parse().map_err(|_| "bad --max-rounds")?),
            "--csv" => o.csv = Some(val("--csv")?.into()),
            "--svg" => o.svg = Some(val("--svg")?.into()),
            "--shutdown" => o.shutdown = true,
            other => return Err(format!("unknown option {other:?} (see --help)")),
        }
    }
    if o.hosts.len() < 2 {
        return Err("at least two hosts are needed (--hosts a:port,b:port,...; four or more to tell who is slow)".into());
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(d) = o.hosts.iter().find(|h| !seen.insert(h.as_str())) {
        return Err(format!("host {d} is listed twice"));
    }
    if o.size == 0 || o.size > 1 << 30 || o.inflight == 0 || o.inflight > 32 || o.window.is_zero() || o.timeout.is_zero() {
        return Err("--size 1..1G, --inflight 1..32, and non-zero --window and --timeout are required".into());
    }
    Ok(o)
}

pub fn main(args: Vec<String>) -> i32 {
    let o = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("rustnet bisect: {e}");
            return 2;
        }
    };
    match run(&o) {
        Ok(found) => {
            if found {
                3
            } else {
                0
            }
        }
        Err(e) => {
            eprintln!("rustnet bisect: {e}");
            1
        }
    }
}

// ------------------------------------------------------------ agents

/// A control connection to one agent.
struct Agent {
    ctl: Ctl,
    sock: TcpStream,
}

impl Agent {
    fn connect(host: &str, timeout: Duration) -> Result<(Agent, String), String> {
        let addrs: Vec<SocketAddr> = host.to_socket_addrs().map_err(|e| format!("resolve: {e}"))?.collect();
        let mut last = "no address".to_string();
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => {
                    let sock = s.try_clone().map_err(|e| e.to_string())?;
                    let mut a = Agent { ctl: Ctl::new(s).map_err(|e| e.to_string())?, sock };
                    a.send("HELLO 1")?;
                    let l = a.recv(Instant::now() + timeout)?;
                    return match l.strip_prefix("AGENT ") {
                        Some(rest) => Ok((a, rest.to_string())),
                        None if l.starts_with("BUSY") => Err("busy: another coordinator is using this agent".into()),
                        None => Err(format!("not a rustnet agent (said {l:?})")),
                    };
                }
                Err(e) => last = format!("connect {addr}: {e}"),
            }
        }
        Err(last)
    }

    fn send(&mut self, l: &str) -> Result<(), String> {
        self.ctl.send(l).map_err(|e| format!("control connection: {e}"))
    }

    /// One line, or an error once `deadline` passes.
    fn recv(&mut self, deadline: Instant) -> Result<String, String> {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let _ = self.sock.set_read_timeout(Some(left));
        self.ctl.recv().map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "no answer in time".to_string(),
            _ => format!("control connection: {e}"),
        })
    }
}

/// One agent's answer to RUN: (rx GB/s) or the error.
fn parse_result(l: &str) -> Result<f64, String> {
    if let Some(e) = l.strip_prefix("ERR ") {
        return Err(e.to_string());
    }
    let f: Vec<&str> = l.strip_prefix("RESULT ").ok_or_else(|| format!("unexpected answer {l:?}"))?.split_whitespace().collect();
    let rx_bytes: f64 = f.first().and_then(|v| v.parse().ok()).ok_or("bad RESULT")?;
    let rx_secs: f64 = f.get(1).and_then(|v| v.parse().ok()).ok_or("bad RESULT")?;
    Ok(if rx_secs > 0.0 { rx_bytes / rx_secs / 1e9 } else { 0.0 })
}

// ------------------------------------------------------------ the run

fn run(o: &Opts) -> Result<bool, String> {
    let n = o.hosts.len();
    let max_rounds = o.max_rounds.unwrap_or_else(|| default_max_rounds(n, o.confirm));
    println!(
        "rustnet bisect: {n} hosts; rule: SLOW when a host's best pair bandwidth is below {:.0}% of the median over hosts, \
         confirmed with {} known-fast partner(s); windows of {} ms, {} x {} B in flight; at most {max_rounds} rounds",
        o.frac * 100.0,
        o.confirm,
        o.window.as_millis(),
        o.inflight,
        o.size
    );
    // Connect to every agent at once, each bounded by the timeout.
    let t0 = Instant::now();
    let hellos: Vec<Result<(Agent, String), String>> = std::thread::scope(|sc| {
        o.hosts
            .iter()
            .map(|h| sc.spawn(|| Agent::connect(h, o.timeout)))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|j| j.join().unwrap_or_else(|_| Err("panicked".into())))
            .collect()
    });
    let mut b = Bisect::new(n, o.frac).confirm(o.confirm);
    let mut agents: Vec<Option<Agent>> = Vec::with_capacity(n);
    let mut why: Vec<Option<String>> = vec![None; n];
    for (i, h) in hellos.into_iter().enumerate() {
        match h {
            Ok((a, hello)) => {
                let f: Vec<&str> = hello.split_whitespace().collect();
                println!(
                    "  [{i}] {:24} agent on {}, device {} ({} Mbps), ABI v{}",
                    o.hosts[i],
                    f.get(1).unwrap_or(&"?"),
                    f.get(2).unwrap_or(&"?"),
                    f.get(3).unwrap_or(&"?"),
                    f.get(4).unwrap_or(&"?")
                );
                agents.push(Some(a));
            }
            Err(e) => {
                println!("  [{i}] {:24} UNREACHABLE: {e}", o.hosts[i]);
                why[i] = Some(e);
                b.mark_unreachable(i);
                agents.push(None);
            }
        }
    }
    if agents.iter().filter(|a| a.is_some()).count() < 2 {
        finish(o, &b, &why, 0, max_rounds, t0)?;
        return Err(format!("fewer than two agents answered within {:?}", o.timeout));
    }

    let mut rounds = 0;
    for round in 1..=max_rounds {
        let plan = b.plan();
        if plan.is_empty() {
            break;
        }
        rounds = round;
        let list: Vec<String> = plan.iter().map(|(x, y)| format!("[{x}]-[{y}]")).collect();
        println!("round {round}: {} pair(s) at once: {}", plan.len(), list.join(" "));
        let results = measure_round(o, &mut agents, &mut b, &mut why, &plan, round);
        for r in results {
            match &r.error {
                None => println!("  [{}] -> [{}] {:>9} GB/s   [{}] -> [{}] {:>9} GB/s", r.a, r.b, sig3(r.ab), r.b, r.a, sig3(r.ba)),
                Some(e) => println!("  [{}] <-> [{}] failed: {e}", r.a, r.b),
            }
            b.record(r);
        }
    }
    let leftover = !b.plan().is_empty();
    if leftover {
        println!("round limit ({max_rounds}) reached with hosts still unresolved");
    }
    for a in agents.iter_mut().flatten() {
        let _ = a.send(if o.shutdown { "SHUTDOWN" } else { "QUIT" });
    }
    let report = finish(o, &b, &why, rounds, max_rounds, t0)?;
    Ok(report.hosts.iter().any(|h| h.verdict != Verdict::Ok))
}

/// One round: LISTEN on every host in it, then RUN on both ends of every
/// pair at once, then collect; all bounded by absolute deadlines.
fn measure_round(
    o: &Opts,
    agents: &mut [Option<Agent>],
    b: &mut Bisect,
    why: &mut [Option<String>],
    plan: &[(usize, usize)],
    round: usize,
) -> Vec<PairResult> {
    let mut lost = |i: usize, e: String, agents: &mut [Option<Agent>], b: &mut Bisect| {
        println!("  [{i}] {} UNREACHABLE: {e}", o.hosts[i]);
        why[i] = Some(e);
        agents[i] = None;
        b.mark_unreachable(i);
    };
    let hosts: Vec<usize> = plan.iter().flat_map(|&(x, y)| [x, y]).collect();
    let mut handles: Vec<Option<String>> = vec![None; agents.len()];
    for &i in &hosts {
        if let Some(a) = agents[i].as_mut() {
            if let Err(e) = a.send("LISTEN") {
                lost(i, e, agents, b);
            }
        }
    }
    let deadline = Instant::now() + o.timeout;
    for &i in &hosts {
        if let Some(a) = agents[i].as_mut() {
            match a.recv(deadline) {
                Ok(l) => match l.strip_prefix("HANDLE ") {
                    Some(h) => handles[i] = Some(h.to_string()),
                    None => println!("  [{i}] listen failed: {l}"),
                },
                Err(e) => lost(i, e, agents, b),
            }
        }
    }
    let ms = |d: Duration| d.as_millis();
    let mut running = Vec::new();
    for &(x, y) in plan {
        let (Some(hx), Some(hy)) = (handles[x].clone(), handles[y].clone()) else { continue };
        let mut ok = true;
        for (i, peer) in [(x, &hy), (y, &hx)] {
            let cmd = format!("RUN {peer} {} {} {} {}", ms(o.window), o.size, o.inflight, ms(o.timeout));
            if let Some(a) = agents[i].as_mut() {
                if let Err(e) = a.send(&cmd) {
                    lost(i, e, agents, b);
                    ok = false;
                }
            }
        }
        if ok {
            running.push((x, y));
        }
    }
    // Each agent gives up on its own after timeout (connect) + window + at
    // most 4 timeouts of draining; allow that and a margin before calling it dead.
    let deadline = Instant::now() + o.window + 5 * o.timeout + Duration::from_secs(5);
    let mut answers: Vec<Option<Result<f64, String>>> = vec![None; agents.len()];
    for &(x, y) in &running {
        for i in [x, y] {
            if let Some(a) = agents[i].as_mut() {
                match a.recv(deadline) {
                    Ok(l) => answers[i] = Some(parse_result(&l)),
                    Err(e) => lost(i, e, agents, b),
                }
            }
        }
    }
    let mut out = Vec::new();
    for &(x, y) in &running {
        match (answers[x].take(), answers[y].take()) {
            (Some(Ok(ba)), Some(Ok(ab))) => out.push(PairResult { a: x, b: y, round, ab, ba, error: None }),
            (ax, ay) => {
                let mut errs = Vec::new();
                for (i, ans) in [(x, ax), (y, ay)] {
                    match ans {
                        Some(Err(e)) => errs.push(format!("[{i}]: {e}")),
                        None => errs.push(format!("[{i}]: no answer")),
                        Some(Ok(_)) => {}
                    }
                }
                out.push(PairResult { a: x, b: y, round, ab: 0.0, ba: 0.0, error: Some(errs.join("; ")) });
            }
        }
    }
    out
}

// ------------------------------------------------------------ output

/// Best value seen per directed pair: Some(Ok(GB/s)) or Some(Err) when every
/// measurement of it failed.
pub type Matrix = Vec<Vec<Option<Result<f64, String>>>>;

pub fn matrix(n: usize, results: &[PairResult]) -> Matrix {
    let mut m: Matrix = vec![vec![None; n]; n];
    for r in results {
        for (from, to, v) in [(r.a, r.b, r.ab), (r.b, r.a, r.ba)] {
            let new = match &r.error {
                None => Ok(v),
                Some(e) => Err(e.clone()),
            };
            let cell = &mut m[from][to];
            *cell = match (cell.take(), new) {
                (Some(Ok(old)), Ok(v)) => Some(Ok(old.max(v))),
                (Some(Ok(old)), Err(_)) => Some(Ok(old)),
                (_, new) => Some(new),
            };
        }
    }
    m
}

fn finish(o: &Opts, b: &Bisect, why: &[Option<String>], rounds: usize, max_rounds: usize, t0: Instant) -> Result<Report, String> {
    let n = b.len();
    let rep = b.report();
    let strikes = b.strikes();
    let m = matrix(n, b.results());
    println!();
    print!("{}", table(&o.hosts, &m));
    println!();
    println!(
        "rule: SLOW when a host's best pair bandwidth (slower direction) < {:.0}% of the median over hosts = {} GB/s (median {} GB/s), \
         seen with {} known-fast partner(s)",
        b.frac() * 100.0,
        sig3(rep.threshold),
        sig3(rep.median),
        b.confirmations()
    );
    println!("{:>5} {:28} {:>16} {:>10}  verdict", "host", "", "best pair GB/s", "of median");
    for (i, h) in rep.hosts.iter().enumerate() {
        let (score, pct) = match h.score {
            Some(s) if rep.median > 0.0 => (sig3(s), format!("{:.0}%", 100.0 * s / rep.median)),
            Some(s) => (sig3(s), "-".into()),
            None => ("-".into(), "-".into()),
        };
        let note = match (h.verdict, &why[i]) {
            (Verdict::Unreachable, Some(w)) => format!(" ({w})"),
            (Verdict::Undetermined, _) => {
                format!(" (slow with {} of the {} known-fast partners needed to confirm)", strikes[i], b.confirmations())
            }
            _ => String::new(),
        };
        println!("{:>5} {:28} {:>16} {:>10}  {}{note}", format!("[{i}]"), o.hosts[i], score, pct, h.verdict.word());
    }
    println!("rounds used: {rounds} of at most {max_rounds}; {} pair measurements; {:.1} s", b.results().len(), t0.elapsed().as_secs_f64());
    let names = |v: Verdict| rep.with(v).iter().map(|&i| o.hosts[i].clone()).collect::<Vec<_>>().join(",");
    for v in [Verdict::Slow, Verdict::Unreachable, Verdict::Undetermined] {
        let l = names(v);
        if !l.is_empty() {
            println!("{}: {l}", v.word());
        }
    }
    if rep.hosts.iter().all(|h| h.verdict == Verdict::Ok) {
        println!("no slow host: every host is within {:.0}% of the median", b.frac() * 100.0);
    }
    println!(
        "RESULT slow={} unreachable={} undetermined={} rounds={rounds}",
        names(Verdict::Slow),
        names(Verdict::Unreachable),
        names(Verdict::Undetermined)
    );
    if let Some(p) = &o.csv {
        std::fs::write(p, csv(&o.hosts, &m)).map_err(|e| format!("write {}: {e}", p.display()))?;
        println!("pair matrix CSV written to {}", p.display());
    }
    if let Some(p) = &o.svg {
        let title = format!("rustnet bisect: {n} hosts, {rounds} round(s), rule < {:.0}% of median", b.frac() * 100.0);
        std::fs::write(p, svg(&o.hosts, &m, &rep, b.frac(), &title)).map_err(|e| format!("write {}: {e}", p.display()))?;
        println!("heat map written to {}", p.display());
    }
    Ok(rep)
}

/// The matrix as text: rows send, columns receive. Large runs list the
/// measured pairs instead of an N x N grid.
#[allow(clippy::needless_range_loop)] // a matrix printed by row and column index reads best with indices
pub fn table(hosts: &[String], m: &Matrix) -> String {
    let n = hosts.len();
    let cell = |c: &Option<Result<f64, String>>| match c {
        None => ".".to_string(),
        Some(Ok(v)) => sig3(*v),
        Some(Err(_)) => "x".to_string(),
    };
    let mut s = String::new();
    if n > 24 {
        s += "measured pairs, GB/s (x = failed):\n";
        for a in 0..n {
            for b in a + 1..n {
                if m[a][b].is_some() || m[b][a].is_some() {
                    s += &format!("  [{a}] -> [{b}] {:>9}   [{b}] -> [{a}] {:>9}\n", cell(&m[a][b]), cell(&m[b][a]));
                }
            }
        }
        return s;
    }
    s += "pair matrix, GB/s (row sends, column receives; . not measured, x failed):\n";
    s += &format!("{:>6}", "");
    for j in 0..n {
        s += &format!("{:>9}", format!("[{j}]"));
    }
    s += "\n";
    for i in 0..n {
        s += &format!("{:>6}", format!("[{i}]"));
        for j in 0..n {
            s += &format!("{:>9}", if i == j { "-".to_string() } else { cell(&m[i][j]) });
        }
        s += &format!("   {}\n", hosts[i]);
    }
    s
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The matrix as CSV: header `from\to,<hosts>`, one row per sender, GB/s
/// (empty: not measured, `failed`: every measurement of it failed).
pub fn csv(hosts: &[String], m: &Matrix) -> String {
    let mut s = String::from("from\\to");
    for h in hosts {
        s += ",";
        s += &csv_field(h);
    }
    s += "\n";
    for (i, row) in m.iter().enumerate() {
        s += &csv_field(&hosts[i]);
        for c in row {
            s += ",";
            match c {
                None => {}
                Some(Ok(v)) => s += &format!("{v:.9}"),
                Some(Err(_)) => s += "failed",
            }
        }
        s += "\n";
    }
    s
}

// GB/s with three significant digits, and XML escaping: shared with the
// soak's plot (rustnet_tools::svg)
pub use rustnet_tools::svg::sig3;
use rustnet_tools::svg::xml;

/// Fill colour for a value at `ratio` of the median: red (0) through yellow
/// (half) to green (at or above the median).
pub fn color(ratio: f64) -> String {
    let t = ratio.clamp(0.0, 1.0);
    format!("hsl({:.0},75%,{:.0}%)", 120.0 * t, 62.0 - 10.0 * t)
}

/// The heat map: one square per directed pair (row sends, column receives),
/// coloured by its bandwidth against the median; grey = not measured,
/// black = failed; hosts named SLOW / UNREACHABLE marked in the labels.
#[allow(clippy::needless_range_loop)] // cells placed by row and column index
pub fn svg(hosts: &[String], m: &Matrix, rep: &Report, frac: f64, title: &str) -> String {
    let n = hosts.len();
    let cs = (720 / n.max(1)).clamp(6, 56) as f64;
    let label_chars = hosts.iter().enumerate().map(|(i, h)| format!("[{i}] {h} UNREACHABLE").len()).max().unwrap_or(8);
    let left = 10.0 + 6.6 * label_chars as f64;
    let top = 70.0;
    let grid = cs * n as f64;
    let w = left + grid + 30.0;
    let h = top + grid + 110.0;
    let text_in_cells = cs >= 40.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w:.0}\" height=\"{h:.0}\" viewBox=\"0 0 {w:.0} {h:.0}\" font-family=\"monospace\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">{}</text>\n\
         <text x=\"10\" y=\"38\">row = sender, column = receiver, GB/s; colour = against the median host score ({} GB/s)</text>\n",
        xml(title),
        sig3(rep.median)
    );
    let med = if rep.median > 0.0 { rep.median } else { 1.0 };
    for j in 0..n {
        let slow = rep.hosts.get(j).map(|h| h.verdict) == Some(Verdict::Slow);
        if cs >= 14.0 || j % ((14.0 / cs).ceil() as usize) == 0 || slow {
            let style = if slow { " fill=\"#c00000\" font-weight=\"bold\"" } else { "" };
            s += &format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\"{style}>{j}</text>\n",
                left + cs * (j as f64 + 0.5),
                top - 6.0
            );
        }
    }
    for i in 0..n {
        let y = top + cs * i as f64;
        let v = rep.hosts.get(i).map(|h| h.verdict).unwrap_or(Verdict::Ok);
        let (fill, weight, tag) = match v {
            Verdict::Slow => ("#c00000", "bold", " SLOW"),
            Verdict::Unreachable => ("#888888", "normal", " UNREACHABLE"),
            Verdict::Undetermined => ("#b06000", "normal", " ?"),
            Verdict::Ok => ("black", "normal", ""),
        };
        if cs >= 10.0 || v != Verdict::Ok {
            s += &format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"{fill}\" font-weight=\"{weight}\">[{i}] {}{tag}</text>\n",
                left - 6.0,
                y + cs / 2.0 + 4.0,
                xml(&hosts[i])
            );
        }
        for j in 0..n {
            let x = left + cs * j as f64;
            let (fill, label) = if i == j {
                ("white".to_string(), String::new())
            } else {
                match &m[i][j] {
                    None => ("#e6e6e6".to_string(), String::new()),
                    Some(Ok(v)) => (color(v / med), sig3(*v)),
                    Some(Err(_)) => ("black".to_string(), "x".to_string()),
                }
            };
            s += &format!("<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{cs:.1}\" height=\"{cs:.1}\" fill=\"{fill}\" stroke=\"white\" stroke-width=\"1\"/>\n");
            if text_in_cells && !label.is_empty() {
                let c = if label == "x" { "white" } else { "black" };
                s += &format!(
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\" fill=\"{c}\">{label}</text>\n",
                    x + cs / 2.0,
                    y + cs / 2.0 + 3.5
                );
            }
        }
    }
    // Legend: the colour ramp with the threshold and the median marked.
    let ly = top + grid + 30.0;
    let lw = (grid.max(240.0)).min(w - left - 10.0).max(200.0);
    let lx = left.min(w - lw - 10.0);
    let steps = 40;
    for k in 0..steps {
        let r = k as f64 / (steps - 1) as f64;
        s += &format!(
            "<rect x=\"{:.1}\" y=\"{ly:.1}\" width=\"{:.1}\" height=\"14\" fill=\"{}\"/>\n",
            lx + lw * k as f64 / steps as f64,
            lw / steps as f64 + 0.5,
            color(r)
        );
    }
    for (r, name) in [(0.0, "0".to_string()), (frac, format!("{:.0}% (threshold)", frac * 100.0)), (1.0, "median".to_string())] {
        let x = lx + lw * r;
        s += &format!("<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\n", ly - 3.0, ly + 18.0);
        s += &format!("<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n", ly + 30.0, xml(&name));
    }
    s += &format!(
        "<rect x=\"{lx:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"#e6e6e6\"/><text x=\"{:.1}\" y=\"{:.1}\">not measured</text>\n",
        ly + 42.0,
        lx + 16.0,
        ly + 52.0
    );
    s += &format!(
        "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"black\"/><text x=\"{:.1}\" y=\"{:.1}\">transfer failed</text>\n",
        lx + 130.0,
        ly + 42.0,
        lx + 146.0,
        ly + 52.0
    );
    s += "</svg>\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Vec<String>, Vec<PairResult>) {
        let hosts: Vec<String> = (0..4).map(|i| format!("10.0.0.{i}:7700")).collect();
        let results = vec![
            PairResult { a: 0, b: 2, round: 1, ab: 1.0, ba: 1.1, error: None },
            PairResult { a: 1, b: 3, round: 1, ab: 0.1, ba: 0.1, error: None },
            PairResult { a: 1, b: 0, round: 2, ab: 1.0, ba: 1.0, error: None },
            PairResult { a: 3, b: 2, round: 2, ab: 0.0, ba: 0.0, error: Some("[3]: peer did not connect".into()) },
        ];
        (hosts, results)
    }

    #[test]
    fn matrix_keeps_best_and_failures() {
        let (_, r) = sample();
        let m = matrix(4, &r);
        assert_eq!(m[0][2], Some(Ok(1.0)));
        assert_eq!(m[2][0], Some(Ok(1.1)));
        assert!(matches!(m[3][2], Some(Err(_))));
        assert_eq!(m[0][3], None);
    }

    #[test]
    fn csv_is_a_square_matrix() {
        let (h, r) = sample();
        let c = csv(&h, &matrix(4, &r));
        let lines: Vec<&str> = c.lines().collect();
        assert_eq!(lines.len(), 5);
        assert!(lines.iter().all(|l| l.split(',').count() == 5), "{c}");
        assert_eq!(lines[1], "10.0.0.0:7700,,1.000000000,1.000000000,");
        assert!(lines[4].ends_with(",failed,"), "{c}");
    }

    #[test]
    fn svg_is_well_formed_and_marks_the_slow_host() {
        let (h, r) = sample();
        let mut b = Bisect::new(4, 0.5);
        for x in r {
            b.record(x);
        }
        let rep = b.report();
        let s = svg(&h, &matrix(4, b.results()), &rep, 0.5, "t <&>");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert_eq!(s.matches("<rect").count(), s.matches("/>").count() - s.matches("<line").count());
        assert!(s.contains("t &lt;&amp;&gt;"));
        assert!(s.contains("10.0.0.1:7700 SLOW") || rep.hosts[1].verdict != Verdict::Slow);
        assert_eq!(s.matches("<text").count(), s.matches("</text>").count());
    }

    #[test]
    fn three_significant_digits() {
        assert_eq!(sig3(0.000236), "0.000236");
        assert_eq!(sig3(0.0044123), "0.00441");
        assert_eq!(sig3(11.34), "11.3");
        assert_eq!(sig3(123.4), "123");
        assert_eq!(sig3(0.0), "0");
    }

    #[test]
    fn colour_ramp_ends() {
        assert_eq!(color(0.0), "hsl(0,75%,62%)");
        assert_eq!(color(5.0), "hsl(120,75%,52%)");
    }

    #[test]
    fn table_shapes() {
        let (h, r) = sample();
        let t = table(&h, &matrix(4, &r));
        assert!(t.contains("1.000") && t.contains(" x ") || t.contains("x"));
        let big: Vec<String> = (0..30).map(|i| format!("h{i}:1")).collect();
        let t = table(&big, &matrix(30, &r));
        assert!(t.starts_with("measured pairs"));
    }

    #[test]
    fn result_lines() {
        assert!((parse_result("RESULT 2000000000 2.0 5 1.0").unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(parse_result("ERR boom"), Err("boom".into()));
        assert!(parse_result("HANDLE 00").is_err());
    }
}
