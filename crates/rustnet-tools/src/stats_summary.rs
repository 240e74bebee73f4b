//! `rustnet stats DIR`: a whole job's statistics files, summarised per rank
//! (slowest first: fewest bytes per second) and per device. Files that
//! cannot be used (unreadable, cut short, not ours, malformed) are listed
//! with the reason instead of stopping the summary.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use rustnet::for_tools::stats::{prom, WORK_OPS};

/// One device of one process.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dev {
    /// Device name.
    pub device: String,
    /// `socket` or `ib`.
    pub transport: String,
    /// Bytes sent (completed sends).
    pub sent: u64,
    /// Bytes received (completed receives).
    pub recv: u64,
    /// Messages posted, both directions.
    pub msgs: u64,
    /// Calls that returned an error, both directions.
    pub errors: u64,
    /// Recoveries from a fabric fault (a reset or cut connection), both directions.
    pub recoveries: u64,
    /// Bytes those recoveries sent again, both directions.
    pub replayed: u64,
    /// Messages posted per direction (send, receive).
    pub msgs_dir: [u64; 2],
    /// Verbs: what the comms asked of the NIC per direction (send,
    /// receive), by op in [`WORK_OPS`] order (`rustnet_device_verbs_work_total`).
    pub work: [[u64; 8]; 2],
}

impl Dev {
    /// Did its comms count any verbs work?
    pub fn has_work(&self) -> bool {
        self.work.iter().flatten().any(|&v| v > 0)
    }
}

/// One process (one file).
#[derive(Debug, Clone, PartialEq)]
pub struct Proc {
    /// The file's name.
    pub file: String,
    /// Host label.
    pub host: String,
    /// Pid label.
    pub pid: String,
    /// Rank label, when the launcher told.
    pub rank: Option<String>,
    /// Transport in use.
    pub transport: String,
    /// When its first comm opened (Unix seconds).
    pub start: f64,
    /// When the file was written (its own timestamp, else the file's mtime).
    pub written: f64,
    /// Comms open at that write (0: the process closed them all, its last write).
    pub open: u64,
    /// Per device.
    pub devs: Vec<Dev>,
    /// The longest "last recovery" of its open comms, seconds (0: none).
    pub last_recovery_s: f64,
}

impl Proc {
    /// Bytes both ways.
    pub fn bytes(&self) -> u64 {
        self.devs.iter().map(|d| d.sent + d.recv).sum()
    }
    /// Errors, all devices.
    pub fn errors(&self) -> u64 {
        self.devs.iter().map(|d| d.errors).sum()
    }
    /// Recoveries, all devices.
    pub fn recoveries(&self) -> u64 {
        self.devs.iter().map(|d| d.recoveries).sum()
    }
    /// Seconds the counters cover.
    pub fn seconds(&self) -> f64 {
        self.written - self.start
    }
    /// Bytes per second over that time; `None` when it covers no time.
    pub fn rate(&self) -> Option<f64> {
        (self.seconds() > 0.0).then(|| self.bytes() as f64 / self.seconds())
    }
}

/// 0 for a send series, 1 for a receive one (the index of [`Dev::msgs_dir`] and [`Dev::work`]).
fn dir_index(s: &prom::Sample) -> usize {
    usize::from(s.label("dir") != Some("send"))
}

/// Read one file's text. `mtime`: the file's modification time, used when
/// the file lacks its own write timestamp.
pub fn from_text(file: &str, text: &str, mtime: Option<f64>) -> Result<Proc, String> {
    let parsed = prom::parse(text);
    if !text.trim_end().ends_with(prom::END_MARKER) {
        let first_line = text.lines().next().unwrap_or("");
        if first_line.starts_with("# HELP rustnet_") {
            return Err(format!(
                "incomplete: no '{}' line at the end (cut short while being written or copied?){}",
                prom::END_MARKER,
                parsed.err().map_or_else(String::new, |e| format!("; {e}"))
            ));
        }
    }
    let e = parsed.map_err(|e| format!("not Prometheus text format: {e}"))?;
    let info = e.get("rustnet_info").next().ok_or("not a librustnet statistics file (no rustnet_info line)")?;
    if !e.complete {
        return Err(format!("incomplete: no '{}' line at the end (cut short while being written or copied?)", prom::END_MARKER));
    }
    let lab = |k: &str| info.label(k).map(str::to_string);
    let written = e.first("rustnet_write_time_seconds").or(mtime).ok_or("no rustnet_write_time_seconds and no file time")?;
    let start = e.first("rustnet_start_time_seconds").unwrap_or(written);
    let mut devs: BTreeMap<(String, String), Dev> = BTreeMap::new();
    for (metric, what) in [
        ("rustnet_device_bytes_total", 0),
        ("rustnet_device_messages_total", 1),
        ("rustnet_device_errors_total", 2),
        ("rustnet_device_recoveries_total", 3),
        ("rustnet_device_replayed_bytes_total", 4),
    ] {
        for s in e.get(metric) {
            if !s.value.is_finite() || s.value < 0.0 {
                return Err(format!("{metric} is {} (a counter cannot be)", s.value));
            }
            let d = s.label("device").unwrap_or("?").to_string();
            let t = s.label("transport").unwrap_or("?").to_string();
            let row = devs.entry((d.clone(), t.clone())).or_insert_with(|| Dev { device: d, transport: t, ..Dev::default() });
            let v = s.value as u64;
            let di = dir_index(s);
            match (what, s.label("dir")) {
                (0, Some("send")) => row.sent += v,
                (0, _) => row.recv += v,
                (1, _) => {
                    row.msgs += v;
                    row.msgs_dir[di] += v;
                }
                (2, _) => row.errors += v,
                (3, _) => row.recoveries += v,
                _ => row.replayed += v,
            }
        }
    }
    for s in e.get("rustnet_device_verbs_work_total") {
        let Some(k) = WORK_OPS.iter().position(|o| s.label("op") == Some(o)) else { continue };
        if !s.value.is_finite() || s.value < 0.0 {
            return Err(format!("rustnet_device_verbs_work_total is {} (a counter cannot be)", s.value));
        }
        let d = s.label("device").unwrap_or("?").to_string();
        let t = s.label("transport").unwrap_or("?").to_string();
        let row = devs.entry((d.clone(), t.clone())).or_insert_with(|| Dev { device: d, transport: t, ..Dev::default() });
        row.work[dir_index(s)][k] += s.value as u64;
    }
    Ok(Proc {
        file: file.to_string(),
        host: lab("host").unwrap_or_else(|| "?".into()),
        pid: lab("pid").unwrap_or_else(|| "?".into()),
        rank: lab("rank"),
        transport: lab("transport").unwrap_or_else(|| "?".into()),
        start,
        written,
        open: e.sum("rustnet_device_comms_open", &[]) as u64,
        devs: devs.into_values().collect(),
        last_recovery_s: e.get("rustnet_comm_last_recovery_seconds").map(|s| s.value).filter(|v| v.is_finite()).fold(0.0, f64::max),
    })
}

/// What a directory holds.
#[derive(Debug, Default)]
pub struct Report {
    /// Usable files.
    pub procs: Vec<Proc>,
    /// Files left out, with the reason.
    pub skipped: Vec<(String, String)>,
}

/// Read every `*.prom` file of `dir`. Err only when the directory itself
/// cannot be read.
pub fn scan(dir: &Path) -> Result<Report, String> {
    let rd = std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    let mut names: Vec<_> = rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "prom")).collect();
    names.sort();
    let mut r = Report::default();
    for p in names {
        let name = p.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let mtime = std::fs::metadata(&p)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs_f64());
        let text = match std::fs::read(&p) {
            Ok(b) => match String::from_utf8(b) {
                Ok(t) => t,
                Err(_) => {
                    r.skipped.push((name, "not UTF-8 text".into()));
                    continue;
                }
            },
            Err(e) => {
                r.skipped.push((name, format!("unreadable: {e}")));
                continue;
            }
        };
        match from_text(&name, &text, mtime) {
            Ok(pr) => r.procs.push(pr),
            Err(e) => r.skipped.push((name, e)),
        }
    }
    Ok(r)
}

/// `1.5 GiB`
pub fn human_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn rate_str(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{:.1}", r / 1e6))
}

/// The summary text and the exit status: 0 all files used, 1 some skipped,
/// 2 nothing to summarise.
pub fn render(dir: &Path, r: &Report) -> (String, i32) {
    let mut o = String::new();
    if r.procs.is_empty() && r.skipped.is_empty() {
        let _ = writeln!(
            o,
            "{}: no *.prom files. Set RUSTNET_STATS_DIR={} on every rank (each process writes <host>-<pid>.prom there while it has comms open), or point at the directory node_exporter's textfile collector reads.",
            dir.display(),
            dir.display()
        );
        return (o, 2);
    }
    let newest = r.procs.iter().map(|p| p.written).fold(f64::MIN, f64::max);
    let mut procs: Vec<&Proc> = r.procs.iter().collect();
    // slowest first; processes whose counters cover no time yet go last
    procs.sort_by(|a, b| match (a.rate(), b.rate()) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => a.file.cmp(&b.file),
    });
    if !procs.is_empty() {
        let _ = writeln!(
            o,
            "{}: {} process(es); per rank, slowest first (MB/s = bytes sent+received / seconds since its first comm)",
            dir.display(),
            procs.len()
        );
        let _ = writeln!(
            o,
            "{:>5} {:<16} {:>8} {:<6} {:>11} {:>11} {:>9} {:>6} {:>6} {:>8} {:>9} {:>7}  state",
            "rank", "host", "pid", "trans", "sent", "received", "msgs", "errors", "recov", "seconds", "MB/s", "age s"
        );
        for p in &procs {
            let (sent, recv, msgs): (u64, u64, u64) = p.devs.iter().fold((0, 0, 0), |(s, r, m), d| (s + d.sent, r + d.recv, m + d.msgs));
            let state = if p.open > 0 { format!("{} comm(s) open", p.open) } else { "all comms closed (final write)".into() };
            let _ = writeln!(
                o,
                "{:>5} {:<16} {:>8} {:<6} {:>11} {:>11} {:>9} {:>6} {:>6} {:>8.1} {:>9} {:>7.0}  {state}{}",
                p.rank.as_deref().unwrap_or("?"),
                p.host,
                p.pid,
                p.transport,
                human_bytes(sent),
                human_bytes(recv),
                msgs,
                p.errors(),
                p.recoveries(),
                p.seconds(),
                rate_str(p.rate()),
                newest - p.written,
                if p.errors() > 0 { "  ERRORS" } else { "" }
            );
        }
        // per device, over the processes using it
        let mut devs: BTreeMap<(String, String, String), (usize, Dev, f64)> = BTreeMap::new();
        for p in &procs {
            for d in &p.devs {
                let e = devs.entry((p.host.clone(), d.device.clone(), d.transport.clone())).or_insert_with(|| (0, Dev::default(), 0.0));
                e.0 += 1;
                e.1.sent += d.sent;
                e.1.recv += d.recv;
                e.1.msgs += d.msgs;
                e.1.errors += d.errors;
                e.1.recoveries += d.recoveries;
                if p.seconds() > 0.0 {
                    e.2 += (d.sent + d.recv) as f64 / p.seconds();
                }
            }
        }
        let _ = writeln!(o, "\nper device (MB/s: the sum over its processes)");
        let _ = writeln!(
            o,
            "{:<16} {:<12} {:<6} {:>5} {:>11} {:>11} {:>9} {:>6} {:>6} {:>9}",
            "host", "device", "trans", "procs", "sent", "received", "msgs", "errors", "recov", "MB/s"
        );
        let mut rows: Vec<_> = devs.into_iter().collect();
        rows.sort_by(|a, b| a.1 .2.total_cmp(&b.1 .2));
        for ((host, dev, tr), (n, d, rate)) in rows {
            let _ = writeln!(
                o,
                "{host:<16} {dev:<12} {tr:<6} {n:>5} {:>11} {:>11} {:>9} {:>6} {:>6} {:>9.1}",
                human_bytes(d.sent),
                human_bytes(d.recv),
                d.msgs,
                d.errors,
                d.recoveries,
                rate / 1e6
            );
        }
        // recoveries: the job went on, but a link or NIC is failing
        let recovered: Vec<&&Proc> = procs.iter().filter(|p| p.recoveries() > 0).collect();
        if !recovered.is_empty() {
            let _ = writeln!(
                o,
                "\nrecoveries (a reset or cut connection the comms rode out; bytes sent again; the longest last recovery of an open comm)"
            );
            let _ = writeln!(
                o,
                "{:>5} {:<16} {:>8} {:<12} {:>10} {:>11} {:>10}",
                "rank", "host", "pid", "device", "recoveries", "replayed", "last s"
            );
            for p in recovered {
                for d in p.devs.iter().filter(|d| d.recoveries > 0) {
                    let _ = writeln!(
                        o,
                        "{:>5} {:<16} {:>8} {:<12} {:>10} {:>11} {:>10}",
                        p.rank.as_deref().unwrap_or("?"),
                        p.host,
                        p.pid,
                        d.device,
                        d.recoveries,
                        human_bytes(d.replayed),
                        if p.last_recovery_s > 0.0 { format!("{:.2}", p.last_recovery_s) } else { "-".into() }
                    );
                }
            }
        }
        // verbs: what each message cost in NIC calls, per device and direction
        let mut work: BTreeMap<(String, String, usize), ([u64; 8], u64)> = BTreeMap::new();
        for p in &procs {
            for d in p.devs.iter().filter(|d| d.has_work()) {
                for di in 0..2 {
                    let e = work.entry((p.host.clone(), d.device.clone(), di)).or_insert(([0; 8], 0));
                    for k in 0..8 {
                        e.0[k] += d.work[di][k];
                    }
                    e.1 += d.msgs_dir[di];
                }
            }
        }
        if !work.is_empty() {
            let _ = writeln!(
                o,
                "\nverbs work per message (per device and direction; doorbells = ibv_post_send calls, polls = ibv_poll_cq calls)"
            );
            let cols: String =
                ["doorbell", "send_wr", "signaled", "recv_wr", "poll", "empty", "cqe", "cts"].iter().map(|c| format!(" {c:>9}")).collect();
            let _ = writeln!(o, "{:<16} {:<12} {:<4} {:>9}{cols}", "host", "device", "dir", "msgs");
            for ((host, dev, di), (w, msgs)) in work.into_iter().filter(|(_, (_, m))| *m > 0) {
                let per: String = w.iter().map(|&v| format!(" {:>9.2}", v as f64 / msgs as f64)).collect();
                let _ = writeln!(o, "{host:<16} {dev:<12} {:<4} {msgs:>9}{per}", ["send", "recv"][di]);
            }
        }
        let norank = procs.iter().filter(|p| p.rank.is_none()).count();
        if norank > 0 {
            let _ = writeln!(
                o,
                "\n{norank} process(es) without a rank: no RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK or SLURM_PROCID in their environment"
            );
        }
    } else {
        let _ = writeln!(o, "{}: no usable statistics file", dir.display());
    }
    if !r.skipped.is_empty() {
        let _ = writeln!(o, "\nskipped {} file(s):", r.skipped.len());
        for (f, why) in &r.skipped {
            let _ = writeln!(o, "  {f}: {why}");
        }
    }
    let code = if r.procs.is_empty() {
        2
    } else if r.skipped.is_empty() {
        0
    } else {
        1
    };
    (o, code)
}
