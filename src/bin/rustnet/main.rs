//! `rustnet`: the operator's tool shipped with librustnet.
//!
//! - `rustnet bench`: ib_write_bw-style bandwidth and latency through the
//!   whole plugin (its exported vtable, as NCCL drives it), side by side with a
//!   raw TCP baseline measured in the same run. Loopback two-process by
//!   default; `--listen`/`--peer` for two hosts.
//! - `rustnet agent` / `rustnet bisect`: slow-node bisection over many hosts
//!   (docs/bisect.md).
//! - `rustnet knobs`: every variable the plugin reads, its default and meaning.
mod agent;
mod bench;
mod bisect;
mod ctl;

fn usage() -> ! {
    eprintln!(
        "usage: rustnet <command> [options]\n\
         commands:\n  \
         bench   bandwidth/latency through the plugin vs raw TCP (rustnet bench --help)\n  \
         agent   serve `rustnet bisect` on this host (rustnet agent --help)\n  \
         bisect  find the slow host(s) among hosts running an agent (rustnet bisect --help)\n  \
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
        "bench" => bench::main(args),
        "agent" => agent::main(args),
        "bisect" => bisect::main(args),
        "knobs" if args.first().map(String::as_str) == Some("--markdown") => {
            print!("{}", rustnet::config::knobs_markdown());
            0
        }
        "knobs" => {
            for k in rustnet::config::KNOBS {
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
