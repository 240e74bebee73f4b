//! `rustnet watch`: the NIC's own counters (port counters, `hw_counters`,
//! `ethtool -S` pause frames) as per-second rates while a job runs, and what
//! they mean, named by `rustnet_tools::fabric::classify` ("congestion: CNPs rising
//! on mlx5_2 port 1", "loss: out-of-sequence rising on rxe0 port 1", "PFC:
//! pause frames on eth2 prio 3", "link: ...").
use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustnet_tools::doctor::js;
use rustnet_tools::fabric::classify::{classify, Kind, Severity};
use rustnet_tools::fabric::counters::{self, Delta, Ethtool, PortCounters, Source};
use rustnet_tools::fabric::lossless::DcbTool;

/// `--ethtool PATH|none`.
pub fn ethtool_arg(v: Option<String>) -> Ethtool {
    match v.as_deref() {
        None | Some("none") => Ethtool::Skip("ethtool not run (--ethtool none)".into()),
        Some(p) => Ethtool::Run(p.to_string()),
    }
}

/// `--dcb netlink|PATH|none`.
pub fn dcb_arg(v: Option<String>) -> DcbTool {
    match v.as_deref() {
        None | Some("none") => DcbTool::Skip("DCB not read (--dcb none)".into()),
        Some("netlink") => DcbTool::Netlink,
        Some(p) => DcbTool::Run(p.to_string()),
    }
}

const HELP: &str = "rustnet watch [--interval SECONDS] [--count N] [--dev NAME[,NAME]] [--sysfs ROOT] [--ethtool PATH|none] [--json]\n\
Samples every RDMA port's counters (/sys/class/infiniband/*/ports/*/counters and hw_counters) and, where\n\
the ethtool binary is there, the netdev's pause-frame and PHY error statistics, and prints per-second\n\
rates of what moved with what it means: congestion (ECN marks, CNPs), PFC pause frames per priority,\n\
loss (out-of-sequence, sequence NAKs, ACK timeouts), RNR NAKs, drops, retries exhausted, link errors.\n\
--interval: seconds between samples (default 1); --count: reports before exiting (default 0: until\n\
interrupted); --json: one JSON object per report. Exit status: 0, or 1 when a report named loss,\n\
drops, errors or worse.";

struct Opts {
    interval: f64,
    count: u64,
    devs: Vec<String>,
    sysfs: PathBuf,
    ethtool: Option<Ethtool>,
    json: bool,
}

fn parse(args: Vec<String>) -> Result<Option<Opts>, String> {
    let mut o = Opts { interval: 1.0, count: 0, devs: Vec::new(), sysfs: "/sys".into(), ethtool: None, json: false };
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "--interval" => {
                let v = val("--interval")?;
                o.interval = v
                    .parse()
                    .ok()
                    .filter(|s: &f64| *s >= 0.01 && *s <= 3600.0)
                    .ok_or_else(|| format!("--interval {v:?}: seconds, 0.01..3600"))?;
            }
            "--count" => {
                let v = val("--count")?;
                o.count = v.parse().map_err(|_| format!("--count {v:?}: a whole number"))?;
            }
            "--dev" => o.devs.extend(val("--dev")?.split(',').filter(|s| !s.is_empty()).map(str::to_string)),
            "--sysfs" => o.sysfs = val("--sysfs")?.into(),
            "--ethtool" => o.ethtool = Some(ethtool_arg(Some(val("--ethtool")?))),
            "--json" => o.json = true,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(Some(o))
}

fn src_name(s: Source) -> &'static str {
    match s {
        Source::Port => "counters",
        Source::Hw => "hw_counters",
        Source::Ethtool => "ethtool",
    }
}

pub fn main(args: Vec<String>) -> i32 {
    let o = match parse(args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{HELP}");
            return 0;
        }
        Err(e) => {
            eprintln!("rustnet watch: {e}\n{HELP}");
            return 2;
        }
    };
    let ethtool = o.ethtool.clone().unwrap_or_else(|| {
        if o.sysfs == std::path::Path::new("/sys") {
            Ethtool::detect()
        } else {
            Ethtool::Skip("ethtool not run: the sysfs root is not /sys (pass --ethtool PATH)".into())
        }
    });
    let ports: Vec<(String, u8, Option<String>)> = counters::ports(&o.sysfs)
        .into_iter()
        .filter(|(d, _)| o.devs.is_empty() || o.devs.iter().any(|x| x == d))
        .map(|(d, p)| {
            let nd = counters::netdev_of(&o.sysfs, &d, p);
            (d, p, nd)
        })
        .collect();
    if ports.is_empty() {
        eprintln!(
            "rustnet watch: no RDMA ports under {}{}",
            o.sysfs.join("class/infiniband").display(),
            if o.devs.is_empty() { String::new() } else { format!(" matching {:?}", o.devs) }
        );
        return 2;
    }
    let snap =
        || -> Vec<PortCounters> { ports.iter().map(|(d, p, nd)| counters::read(&o.sysfs, d, *p, nd.as_deref(), &ethtool)).collect() };
    let start = Instant::now();
    let mut prev = snap();
    let mut prev_t = Instant::now();
    let names: Vec<String> =
        prev.iter().map(|pc| format!("{}{}", pc.label(), pc.netdev.as_ref().map(|n| format!(" ({n})")).unwrap_or_default())).collect();
    let notes: std::collections::BTreeSet<&str> = prev.iter().filter_map(|pc| pc.eth_note.as_deref()).collect();
    let mut stdout = std::io::stdout();
    if !o.json {
        let _ = writeln!(
            stdout,
            "rustnet watch: {} every {} s{}",
            names.join(", "),
            o.interval,
            if notes.is_empty() { String::new() } else { format!(" [{}]", notes.into_iter().collect::<Vec<_>>().join("; ")) }
        );
        let _ = stdout.flush();
    }
    let mut worst = Severity::Info;
    let mut n = 0u64;
    loop {
        std::thread::sleep(Duration::from_secs_f64(o.interval));
        let now_t = Instant::now();
        let now = snap();
        let dt = now_t.duration_since(prev_t).as_secs_f64();
        let mut text = String::new();
        let mut jports = Vec::new();
        for (a, b) in prev.iter().zip(&now) {
            let d = Delta::between(a, b, dt);
            let found = classify(&d);
            if let Some(w) = found.iter().map(|f| f.severity).max() {
                worst = worst.max(w);
            }
            if o.json {
                let rates: Vec<String> =
                    d.inc.iter().map(|((s, k), v)| format!("{}:{:.3}", js(&format!("{}/{k}", src_name(*s))), *v as f64 / dt)).collect();
                let fs: Vec<String> = found
                    .iter()
                    .map(|f| format!("{{\"kind\":{},\"severity\":\"{:?}\",\"text\":{}}}", js(f.kind.word()), f.severity, js(&f.text)))
                    .collect();
                jports.push(format!(
                    "{{\"dev\":{},\"port\":{},\"netdev\":{},\"rates\":{{{}}},\"findings\":[{}]}}",
                    js(&d.dev),
                    d.port,
                    d.netdev.as_deref().map(js).unwrap_or_else(|| "null".into()),
                    rates.join(","),
                    fs.join(",")
                ));
            } else {
                let rates: Vec<String> = d.inc.iter().map(|((_, k), v)| format!("{k} {}", d.show(*v))).collect();
                text.push_str(&format!(
                    "{}{}: {}\n",
                    b.label(),
                    b.netdev.as_ref().map(|n| format!(" ({n})")).unwrap_or_default(),
                    if rates.is_empty() { "idle".to_string() } else { rates.join("  ") }
                ));
                for f in found.iter().filter(|f| f.kind != Kind::Traffic) {
                    text.push_str(&format!("  => {}\n", f.text));
                }
            }
        }
        let t = now_t.duration_since(start).as_secs_f64();
        let line = if o.json {
            format!("{{\"t\":{t:.3},\"interval\":{dt:.3},\"ports\":[{}]}}\n", jports.join(","))
        } else {
            format!("--- t={t:.1}s (over {dt:.2}s)\n{text}")
        };
        if stdout.write_all(line.as_bytes()).and_then(|_| stdout.flush()).is_err() {
            break; // reader went away (| head)
        }
        prev = now;
        prev_t = now_t;
        n += 1;
        if o.count > 0 && n >= o.count {
            break;
        }
    }
    if worst >= Severity::Warn {
        1
    } else {
        0
    }
}
