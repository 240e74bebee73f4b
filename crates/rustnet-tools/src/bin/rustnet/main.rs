//! `rustnet`: the operator's tool shipped with librustnet.
//!
//! - `rustnet bench`: ib_write_bw-style bandwidth and latency through the
//!   whole plugin (its exported vtable, as NCCL drives it), side by side with a
//!   raw TCP baseline measured in the same run. Loopback two-process by
//!   default; `--listen`/`--peer` for two hosts.
//! - `rustnet agent` / `rustnet bisect`: slow-node bisection over many hosts
//!   (docs/bisect.md).
//! - `rustnet doctor`: the fabric explained layer by layer, PASS/WARN/FAIL with fixes.
//! - `rustnet watch`: the NIC's own counters as rates, named (congestion, PFC, loss, link).
//! - `rustnet stats DIR`: a job's per-process statistics files (RUSTNET_STATS_DIR), slowest rank first.
//! - `rustnet knobs`: every variable the plugin reads, its default and meaning.
// The fabric's health: the NIC's counters as rates (`rustnet watch`).
mod watch;

mod agent;
mod bench;
mod bisect;
// `rustnet bench compare`: scripts/bench.sh's default table.
mod compare;
mod ctl;
mod ncclsock;
mod plot;
mod ring;
mod scale;
// Bench's sample sets and order statistics (shared by bench, ring, plot).
mod samples;
// `rustnet stats DIR`: a job's statistics files.
mod stats;

fn doctor(args: Vec<String>) -> i32 {
    let mut o = rustnet_tools::doctor::Opts::default();
    let (mut json, mut export) = (false, false);
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => json = true,
            "--export-env" => export = true,
            "--sysfs" => o.sysfs = it.next().unwrap_or_default().into(),
            "--devroot" => o.dev = it.next().unwrap_or_default().into(),
            "--no-plugin" => o.probe_plugin = false,
            "--peer-mtu" => match it.next().and_then(|v| v.parse().ok()) {
                Some(m) => o.peer_mtu = Some(m),
                None => {
                    eprintln!("rustnet doctor: --peer-mtu needs the peer's netdev MTU in bytes (e.g. 9000)");
                    return 2;
                }
            },
            "--ethtool" => o.ethtool = Some(watch::ethtool_arg(it.next())),
            "--dcb" => o.dcb = Some(watch::dcb_arg(it.next())),
            "-h" | "--help" => {
                println!(
                    "rustnet doctor [--json] [--export-env] [--sysfs ROOT] [--peer-mtu BYTES] [--ethtool PATH|none] [--dcb netlink|PATH|none]\n\
                     Checks RDMA devices and ports, GIDs and the one the plugin will use, the lossless-Ethernet\n\
                     setup (MTU, PFC, DSCP map, ECN for NCCL_IB_TC), the NIC's counters, PCI/NUMA placement,\n\
                     GPUDirect readiness, locked memory, /dev/infiniband, IP interfaces and the NCCL/RUSTNET\n\
                     variables in effect. Exit status: 0 pass, 1 warnings, 2 failures.\n\
                     --export-env prints the export lines an init container can inject.\n\
                     --peer-mtu: the peer's netdev MTU, to check the path MTU both ends agree on.\n\
                     --ethtool: what reads the pause counters (default: ethtool on PATH); --dcb: where PFC and\n\
                     the DSCP map come from (default: DCB netlink; a PATH runs iproute2's dcb). Both default\n\
                     to none when --sysfs points at another tree."
                );
                return 0;
            }
            other => {
                eprintln!("rustnet doctor: unknown option {other:?}");
                return 2;
            }
        }
    }
    let r = rustnet_tools::doctor::run(&o);
    if export {
        for l in &r.export_env {
            println!("{l}");
        }
    } else if json {
        print!("{}", rustnet_tools::doctor::render_json(&r));
    } else {
        print!("{}", rustnet_tools::doctor::render(&r));
    }
    match r.worst() {
        rustnet_tools::doctor::Status::Pass => 0,
        rustnet_tools::doctor::Status::Warn => 1,
        rustnet_tools::doctor::Status::Fail => 2,
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: rustnet <command> [options]\n\
         commands:\n  \
         bench   bandwidth/latency through the plugin vs raw TCP (rustnet bench --help)\n  \
         agent   serve `rustnet bisect` on this host (rustnet agent --help)\n  \
         bisect  find the slow host(s) among hosts running an agent (rustnet bisect --help)\n  \
         doctor  explain the fabric: devices, GIDs, lossless Ethernet, counters, topology, GPUDirect, limits, knobs\n  \
         watch   the NIC's counters as rates while a job runs, with what they mean (rustnet watch --help)\n  \
         stats   summarise a job's RUSTNET_STATS_DIR files: per rank (slowest first) and per device\n  \
         knobs   list every environment variable the plugin reads"
    );
    std::process::exit(2);
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        usage();
    }
    let cmd = args.remove(0);
    let code = match cmd.as_str() {
        // compare drives bench and ring (bench does not import it)
        "bench" if args.first().map(String::as_str) == Some("compare") => compare::main(args[1..].to_vec()),
        "bench" if args.first().map(String::as_str) == Some("scale") => scale::main(args[1..].to_vec()),
        "bench" => bench::main(args),
        "agent" => agent::main(args),
        "bisect" => bisect::main(args),
        "doctor" => doctor(args),
        "watch" => watch::main(args),
        "stats" => stats::main(args),
        "knobs" if args.first().map(String::as_str) == Some("--markdown") => {
            print!("{}", rustnet::for_tools::config::knobs_markdown());
            0
        }
        "knobs" => {
            for k in rustnet::for_tools::config::KNOBS {
                println!("{:28} default {:8} {}\n{:28} accepts: {}", k.name, format!("{:?}", k.default), k.doc.trim(), "", k.accepts);
            }
            0
        }
        "-h" | "--help" | "help" => usage(),
        other => {
            eprintln!("rustnet: unknown command {other:?}");
            usage()
        }
    };
    std::process::exit(code);
}
