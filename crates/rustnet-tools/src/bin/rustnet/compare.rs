//! `rustnet bench compare`, what `scripts/bench.sh` runs first: librustnet
//! beside what NCCL would use instead, on this host over loopback.
//!
//! 1. NCCL's pattern as `bench step` replays it (2 ranks, step-sized
//!    messages, 8 in flight per connection, both directions at once) beside
//!    `nccl-socket(0 threads)`, our re-implementation of NCCL's socket
//!    transport (ncclsock.rs), at NCCL's step sizes 32K-512K.
//! 2. One-way and bidirectional bandwidth at 1M-64M beside a raw TCP stream
//!    as a competitor runs it (iperf3-like: 1 MiB writes, TCP_NODELAY, a
//!    thread per direction).
//! 3. The 8-byte half round trip beside a ping-pong that polls a
//!    non-blocking socket, as NCCL's proxy polls.
//!
//! Every pair is interleaved (plugin, then its baseline, once per repeat), so
//! each ratio is taken per repeat. The table prints median [range of the
//! middle n-2 repeats] (the fastest and the slowest dropped: on a shared
//! host one stray repeat otherwise sets the range); the CSV has both ranges.
//! A printed range wider than [`WIDE`] of its median is named in a closing line.
use std::path::PathBuf;
use std::time::Instant;

use crate::bench::{self, Baseline};
use crate::plot::{grid, Panel};
use crate::ring;
use crate::samples::{human, Row, Stat};

const HELP: &str = "\
rustnet bench compare: librustnet beside what NCCL would use, on this host (loopback)

  1. NCCL's pattern (rustnet bench step) beside nccl-socket(0 threads), 32K-512K
  2. one-way and bidirectional bandwidth, 1M-64M, beside a raw TCP stream
     (1 MiB writes, TCP_NODELAY, a thread per direction: iperf3-like)
  3. the 8-byte half round trip beside a polling ping-pong (non-blocking
     socket, spin then yield: how NCCL's proxy polls)

options:
  --reps N       repeats of every point, interleaved with its baseline (default 7)
  --step-sizes LIST  sizes of part 1 (default 32K,128K,512K: NCCL's step sizes)
  --bw-sizes LIST    sizes of part 2 (default 1M,4M,16M,64M)
  --bytes N      bytes per bandwidth point and per rank per step run (default 128M)
  --csv FILE     every point and ratio as CSV
  --svg FILE     the plot
  --plugin PATH  the plugin .so (default: librustnet.so beside this binary)
  --abi N        vtable version (default 8)
The old table (plugin beside a blocking socket, 1K-64M) is `rustnet bench`
(scripts/bench.sh --classic). The plugin reads its usual variables.";

/// A range (max - min) wider than this share of its median is called out.
pub const WIDE: f64 = 0.25;

struct Opts {
    reps: usize,
    step_sizes: String,
    bw_sizes: String,
    bytes: String,
    csv: Option<PathBuf>,
    svg: Option<PathBuf>,
    pass: Vec<String>,
}

fn parse(args: Vec<String>) -> Result<Opts, String> {
    let mut o = Opts {
        reps: 7,
        step_sizes: "32K,128K,512K".into(),
        bw_sizes: "1M,4M,16M,64M".into(),
        bytes: "128M".into(),
        csv: None,
        svg: None,
        pass: Vec::new(),
    };
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "-h" | "--help" => {
                println!("{HELP}");
                std::process::exit(0);
            }
            "--reps" => o.reps = val("--reps")?.parse().ok().filter(|&n| n >= 1).ok_or("--reps needs a number >= 1")?,
            "--step-sizes" => o.step_sizes = val("--step-sizes")?,
            "--bw-sizes" => o.bw_sizes = val("--bw-sizes")?,
            "--bytes" => o.bytes = val("--bytes")?,
            "--csv" => o.csv = Some(val("--csv")?.into()),
            "--svg" => o.svg = Some(val("--svg")?.into()),
            "--plugin" | "--abi" => {
                let v = val(&a)?;
                o.pass.extend([a, v]);
            }
            other => return Err(format!("unknown option {other:?} (see --help)")),
        }
    }
    Ok(o)
}

pub fn main(args: Vec<String>) -> i32 {
    let o = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("rustnet bench compare: {e}");
            return 2;
        }
    };
    match run(&o) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("rustnet bench compare: {e}");
            1
        }
    }
}

/// Sample i of `a` over sample i of `b` (the two were measured back to back).
fn paired(a: &Stat, b: &Stat) -> Stat {
    Stat(a.0.iter().zip(&b.0).map(|(x, y)| x / y).collect())
}

/// (max - min) / median of the printed (middle) range.
fn spread(s: &Stat) -> f64 {
    let t = s.trimmed();
    (t.max() - t.min()) / s.med()
}

/// median [middle range]
fn f(s: &Stat, p: usize) -> String {
    let t = s.trimmed();
    if s.0.is_empty() {
        "-".into()
    } else {
        format!("{:.p$} [{:.p$}-{:.p$}]", s.med(), t.min(), t.max())
    }
}

/// A ratio: median x [middle range]
fn x(s: &Stat) -> String {
    let t = s.trimmed();
    if s.0.is_empty() {
        "-".into()
    } else {
        format!("{:.2}x [{:.2}-{:.2}]", s.med(), t.min(), t.max())
    }
}

/// Every measured series of the report, for the CSV, the plot and the
/// wide-range line: (test, size, net, samples, unit).
type Series = (String, usize, String, Stat, &'static str);

fn run(o: &Opts) -> Result<(), String> {
    let t0 = Instant::now();
    let load0 = ring::loadavg();
    let reps = o.reps.to_string();
    let mut sargs: Vec<String> =
        ["--nets", "plugin,nccl0", "--sizes", &o.step_sizes, "--bytes", &o.bytes, "--reps", &reps].map(String::from).to_vec();
    sargs.extend(o.pass.iter().cloned());
    let so = ring::parse(false, sargs)?;
    let mut bargs: Vec<String> = ["--sizes", &o.bw_sizes, "--bytes", &o.bytes, "--reps", &reps].map(String::from).to_vec();
    bargs.extend(o.pass.iter().cloned());
    let (mut bo, _) = bench::parse(bargs)?;
    bo.baseline = Baseline::Competitor;

    eprintln!("[1/2] NCCL's pattern: plugin and nccl-socket(0 threads), {}, {} repeats", o.step_sizes, o.reps);
    let srows: Vec<Row> = ring::measure(&so)?;
    eprintln!("[2/2] bandwidth {} and 8-byte latency: plugin, raw TCP stream, polling ping-pong, {} repeats", o.bw_sizes, o.reps);
    let m = bench::measure(&bo)?;
    let load1 = ring::loadavg();

    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mut out = String::new();
    out += &format!(
        "rustnet bench compare: loopback, both ends on this host ({cpus} CPUs; load {load0} at start, {load1} at end), {} repeats, each point interleaved with its baseline\n",
        o.reps
    );
    out += &format!("{}\n", m.header);
    out += &format!(
        "every cell: median [{}]; ratios are per repeat (plugin / its baseline, measured back to back)\n",
        if o.reps >= 5 {
            format!("range of the middle {} of {} repeats: the fastest and the slowest dropped; the CSV has both", o.reps - 2, o.reps)
        } else {
            "min-max".into()
        }
    );
    let mut series: Vec<Series> = Vec::new();

    // 1. NCCL's pattern
    out += &format!("\n1. NCCL's pattern (rustnet bench step: 2 ranks, both directions at once, {})\n", so.summary());
    out += "   busbw GB/s = bytes each rank sent / time; CPU s/GB = user+sys of both ranks per GB sent\n";
    out += &format!(
        "{:>6}  {:>20} {:>24} {:>22}   {:>20} {:>20}\n",
        "size", "plugin", "nccl-socket(0 threads)", "plugin/nccl-socket", "CPU s/GB plugin", "CPU s/GB nccl-socket"
    );
    let mut sizes: Vec<usize> = srows.iter().map(|r| r.size).collect();
    sizes.dedup();
    for &size in &sizes {
        let p = srows.iter().find(|r| r.size == size && r.net == "plugin").ok_or("no plugin row")?;
        let n = srows.iter().find(|r| r.size == size && r.net.starts_with("nccl-socket(0")).ok_or("no nccl-socket row")?;
        let ratio = paired(&p.busbw, &n.busbw);
        out += &format!(
            "{:>6}  {:>20} {:>24} {:>22}   {:>20} {:>20}\n",
            human(size),
            f(&p.busbw, 2),
            f(&n.busbw, 2),
            x(&ratio),
            f(&p.cpu, 3),
            f(&n.cpu, 3)
        );
        series.push(("step_busbw".into(), size, "plugin".into(), p.busbw.clone(), "GB/s"));
        series.push(("step_busbw".into(), size, "nccl-socket(0 threads)".into(), n.busbw.clone(), "GB/s"));
        series.push(("step_busbw_ratio".into(), size, "plugin/nccl-socket(0 threads)".into(), ratio, "x"));
        series.push(("step_cpu".into(), size, "plugin".into(), p.cpu.clone(), "s/GB"));
        series.push(("step_cpu".into(), size, "nccl-socket(0 threads)".into(), n.cpu.clone(), "s/GB"));
    }

    // 2. bandwidth
    out +=
        "\n2. bandwidth GB/s: plugin (4 requests in flight) beside a raw TCP stream (1 MiB writes, TCP_NODELAY, a thread per direction)\n";
    out += &format!(
        "{:>6}  {:>20} {:>20} {:>22}   {:>20} {:>20} {:>22}\n",
        "size", "one-way plugin", "one-way raw TCP", "plugin/raw", "bidir plugin", "bidir raw TCP", "plugin/raw"
    );
    for (size, ow, bi, row, rbi) in &m.rows {
        let (r1, r2) = (paired(ow, row), paired(bi, rbi));
        out += &format!(
            "{:>6}  {:>20} {:>20} {:>22}   {:>20} {:>20} {:>22}\n",
            human(*size),
            f(ow, 2),
            f(row, 2),
            x(&r1),
            f(bi, 2),
            f(rbi, 2),
            x(&r2)
        );
        series.push(("oneway".into(), *size, "plugin".into(), ow.clone(), "GB/s"));
        series.push(("oneway".into(), *size, "rawtcp_1m_writes".into(), row.clone(), "GB/s"));
        series.push(("oneway_ratio".into(), *size, "plugin/rawtcp_1m_writes".into(), r1, "x"));
        series.push(("bidir".into(), *size, "plugin".into(), bi.clone(), "GB/s"));
        series.push(("bidir".into(), *size, "rawtcp_1m_writes".into(), rbi.clone(), "GB/s"));
        series.push(("bidir_ratio".into(), *size, "plugin/rawtcp_1m_writes".into(), r2, "x"));
    }

    // 3. latency
    out += &format!(
        "\n3. 8-byte half round trip, us, over {} x {} round trips: plugin beside a polling ping-pong (lower is better)\n",
        o.reps, bo.lat_iters
    );
    out += "   typical = median round trip / 2 (perftest's t_typical); average = run time / round trips / 2\n";
    out += &format!("{:>9}  {:>22} {:>22} {:>22}\n", "", "plugin", "polling ping-pong", "plugin/ping-pong");
    for (what, a, b) in [("typical", &m.lat_typ, &m.rlat_typ), ("average", &m.lat, &m.rlat)] {
        let r = paired(a, b);
        out += &format!("{what:>9}  {:>22} {:>22} {:>22}\n", f(a, 2), f(b, 2), x(&r));
        let t = if what == "typical" { "latency_typical" } else { "latency" };
        series.push((t.into(), 8, "plugin".into(), a.clone(), "us"));
        series.push((t.into(), 8, "polling_pingpong".into(), b.clone(), "us"));
        series.push((format!("{t}_ratio"), 8, "plugin/polling_pingpong".into(), r, "x"));
    }

    // ranges
    let mut wide: Vec<(f64, String)> = series
        .iter()
        .filter(|s| !s.0.ends_with("_ratio") && !s.3 .0.is_empty() && spread(&s.3) > WIDE)
        .map(|s| (spread(&s.3), format!("{} {} {} {:.0}%", s.0, human(s.1), s.2, 100.0 * spread(&s.3))))
        .collect();
    wide.sort_by(|a, b| b.0.total_cmp(&a.0));
    if wide.is_empty() {
        out += &format!("\nranges: every printed range is within {:.0}% of its median.\n", 100.0 * WIDE);
    } else {
        let shown: Vec<&str> = wide.iter().take(4).map(|w| w.1.as_str()).collect();
        out += &format!(
            "\nranges: {} of {} printed ranges are wider than {:.0}% of their median (widest: {}{}).\n  \
             The host was busy (load {load0} -> {load1} on {cpus} CPUs): read the medians and the paired ratios, or rerun on a quiet host / with --reps {}.\n",
            wide.len(),
            series.iter().filter(|s| !s.0.ends_with("_ratio")).count(),
            100.0 * WIDE,
            shown.join(", "),
            if wide.len() > shown.len() { ", ..." } else { "" },
            2 * o.reps + 1
        );
    }
    out += "not measured here: a second host and a real NIC (loopback is memory copies on one host); the verbs numbers come from tests/rxe-vm/bench-verbs.sh\n";
    print!("{out}");

    if let Some(p) = &o.csv {
        let mut w = String::from("test,size,transport,median,min,max,unit,middle_min,middle_max,repeats\n");
        for (t, size, net, s, unit) in &series {
            let m = s.trimmed();
            w += &format!(
                "{t},{size},{net},{:.4},{:.4},{:.4},{unit},{:.4},{:.4},{}\n",
                s.med(),
                s.min(),
                s.max(),
                m.min(),
                m.max(),
                s.0.len()
            );
        }
        std::fs::write(p, w).map_err(|e| format!("write {}: {e}", p.display()))?;
        println!("CSV written to {}", p.display());
    }
    if let Some(p) = &o.svg {
        let pick = |test: &str, nets: &[&str]| -> Vec<(String, Vec<(usize, Stat)>)> {
            nets.iter()
                .map(|n| (n.to_string(), series.iter().filter(|s| s.0 == test && s.2 == *n).map(|s| (s.1, s.3.trimmed())).collect()))
                .collect()
        };
        let nccl = ["plugin", "nccl-socket(0 threads)"];
        let raw = ["plugin", "rawtcp_1m_writes"];
        let panels = [
            Panel { title: "1. NCCL's pattern: busbw GB/s".into(), lines: pick("step_busbw", &nccl) },
            Panel { title: "1. NCCL's pattern: CPU s/GB".into(), lines: pick("step_cpu", &nccl) },
            Panel { title: "2. one-way GB/s".into(), lines: pick("oneway", &raw) },
            Panel { title: "2. bidirectional GB/s".into(), lines: pick("bidir", &raw) },
            Panel {
                title: "3. 8-byte half round trip, us (typical)".into(),
                lines: pick("latency_typical", &["plugin", "polling_pingpong"]),
            },
        ];
        let title = format!("rustnet bench compare: loopback, {cpus} CPUs, {} repeats: median, bars the middle range", o.reps);
        std::fs::write(p, grid(&title, &panels)).map_err(|e| format!("write {}: {e}", p.display()))?;
        println!("plot written to {}", p.display());
    }
    println!("took {:.0} s", t0.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_paired_and_spread_is_relative_to_the_median() {
        let r = paired(&Stat(vec![2.0, 3.0, 4.0]), &Stat(vec![1.0, 3.0, 2.0]));
        assert_eq!(r.0, vec![2.0, 1.0, 2.0]);
        assert_eq!((r.med(), r.min(), r.max()), (2.0, 1.0, 2.0));
        assert!((spread(&Stat(vec![9.0, 10.0, 11.0])) - 0.2).abs() < 1e-12);
        // five or more: the printed range drops the fastest and the slowest
        let s = Stat(vec![1.0, 9.0, 10.0, 11.0, 30.0]);
        assert!((spread(&s) - 0.2).abs() < 1e-12);
        assert_eq!(f(&s, 1), "10.0 [9.0-11.0]");
    }

    #[test]
    fn options() {
        assert!(parse(vec!["--reps".into(), "0".into()]).is_err());
        assert!(parse(vec!["--bogus".into()]).is_err());
        let o = parse(vec!["--abi".into(), "10".into(), "--reps".into(), "3".into()]).unwrap();
        assert_eq!((o.reps, o.pass.clone()), (3, vec!["--abi".to_string(), "10".to_string()]));
    }
}
