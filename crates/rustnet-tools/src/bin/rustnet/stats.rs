//! `rustnet stats DIR`: summarise a job's statistics files (RUSTNET_STATS_DIR).
use std::path::Path;

pub fn main(args: Vec<String>) -> i32 {
    let mut dir = None;
    for a in args {
        match a.as_str() {
            "-h" | "--help" => {
                println!(
                    "rustnet stats DIR\n\
                     Summarises the statistics files librustnet writes with RUSTNET_STATS_DIR=DIR (one\n\
                     <host>-<pid>.prom per process, Prometheus text format): per rank, slowest first (fewest\n\
                     bytes per second since its first comm), then per device. Files that cannot be used\n\
                     (unreadable, cut short, not librustnet's) are listed with the reason.\n\
                     Exit status: 0 all files used, 1 some skipped, 2 nothing to summarise."
                );
                return 0;
            }
            s if s.starts_with('-') => {
                eprintln!("rustnet stats: unknown option {s:?} (rustnet stats --help)");
                return 2;
            }
            s => {
                if dir.replace(s.to_string()).is_some() {
                    eprintln!("rustnet stats: one directory, please");
                    return 2;
                }
            }
        }
    }
    let Some(dir) = dir else {
        eprintln!("usage: rustnet stats DIR (the RUSTNET_STATS_DIR of the job)");
        return 2;
    };
    let dir = Path::new(&dir);
    match rustnet_tools::stats_summary::scan(dir) {
        Ok(r) => {
            let (text, code) = rustnet_tools::stats_summary::render(dir, &r);
            print!("{text}");
            code
        }
        Err(e) => {
            eprintln!("rustnet stats: {e}");
            2
        }
    }
}
