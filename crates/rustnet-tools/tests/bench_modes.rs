//! `rustnet bench step|ring|compare` run end to end at tiny sizes: every network
//! (the plugin, the NCCL-socket baseline with and without helper threads,
//! raw TCP) moves its bytes and shows up in the table, CSV and plot. Not a
//! benchmark: sizes are far too small to mean anything.
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn run(args: &[&str], out: &std::path::Path) -> String {
    let plugin = rustnet_tools::driver::default_plugin_path();
    assert!(plugin.exists(), "built plugin not found at {} (cargo build --release first)", plugin.display());
    let csv = out.with_extension("csv");
    let svg = out.with_extension("svg");
    let o = Command::new(env!("CARGO_BIN_EXE_rustnet"))
        .arg("bench")
        .args(args)
        .args(["--sizes", "4K,64K", "--bytes", "1M", "--reps", "1", "--conns", "2"])
        .arg("--plugin")
        .arg(&plugin)
        .arg("--csv")
        .arg(&csv)
        .arg("--svg")
        .arg(&svg)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "rustnet bench {args:?} failed: {}\n{text}", String::from_utf8_lossy(&o.stderr));
    let c = std::fs::read_to_string(&csv).unwrap();
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
    for net in ["plugin", "nccl-socket(0 threads)", "nccl-socket(2 threads x 2 socks)", "raw TCP"] {
        assert!(text.contains(net), "{net} missing from the table:\n{text}");
        assert!(c.contains(net), "{net} missing from the CSV:\n{c}");
    }
    c
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("rustnet-bench-modes-{}-{name}", std::process::id()))
}

#[test]
fn step_mode_runs_every_network() {
    let c = run(&["step"], &tmp("step"));
    // header + 2 sizes x 4 networks, all at N=2, each with a positive busbw
    let rows: Vec<&str> = c.lines().skip(1).collect();
    assert_eq!(rows.len(), 8, "{c}");
    for r in rows {
        assert!(r.starts_with("2,"), "{r}");
        let bw: f64 = r.split(',').nth(3).unwrap().parse().unwrap();
        assert!(bw > 0.0, "{r}");
    }
}

#[test]
fn ring_mode_runs_three_ranks() {
    let c = run(&["ring", "--ranks", "3"], &tmp("ring"));
    assert!(c.lines().skip(1).all(|r| r.starts_with("3,")), "{c}");
}

/// The default of scripts/bench.sh: its three parts, their baselines, the
/// ranges line, the CSV and the plot.
#[test]
fn compare_mode_prints_every_part_beside_its_baseline() {
    let plugin = rustnet_tools::driver::default_plugin_path();
    let base = tmp("compare");
    let (csv, svg) = (base.with_extension("csv"), base.with_extension("svg"));
    let o = Command::new(env!("CARGO_BIN_EXE_rustnet"))
        .args(["bench", "compare", "--step-sizes", "4K", "--bw-sizes", "64K", "--bytes", "1M", "--reps", "1", "--plugin"])
        .arg(&plugin)
        .arg("--csv")
        .arg(&csv)
        .arg("--svg")
        .arg(&svg)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "rustnet bench compare failed: {}\n{text}", String::from_utf8_lossy(&o.stderr));
    for want in [
        "1. NCCL's pattern",
        "nccl-socket(0 threads)",
        "2. bandwidth",
        "1 MiB writes",
        "3. 8-byte half round trip",
        "polling ping-pong",
        "ranges: ",
    ] {
        assert!(text.contains(want), "{want:?} missing:\n{text}");
    }
    let c = std::fs::read_to_string(&csv).unwrap();
    for row in [
        "step_busbw,4096,plugin,",
        "step_busbw_ratio,4096,",
        "oneway,65536,rawtcp_1m_writes,",
        "bidir,65536,plugin,",
        "latency_typical,8,polling_pingpong,",
    ] {
        assert!(c.contains(row), "{row} missing from the CSV:\n{c}");
    }
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.contains("NCCL's pattern: busbw") && s.contains("polling_pingpong"), "{s}");
    let _ = std::fs::remove_file(&csv);
    let _ = std::fs::remove_file(&svg);
}
