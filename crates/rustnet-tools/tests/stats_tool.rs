//! `rustnet stats DIR` over fixture files (../../tests/fixtures/stats-job: a
//! 5-process job on two hosts with one slow rank, one with errors, one that
//! finished, one cut short, and files that are not ours), plus an
//! unreadable entry, a binary file, an empty and a missing directory.
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/stats-job")
}

fn run(dir: &Path) -> (String, String, i32) {
    let o = Command::new(env!("CARGO_BIN_EXE_rustnet")).arg("stats").arg(dir).output().expect("run rustnet stats");
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned(), o.status.code().unwrap_or(-1))
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rustnet-stats-tool-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn ranks_come_slowest_first_and_bad_files_are_named() {
    let d = tmpdir("job");
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    // a .prom that cannot be read as a file, and one that is not text
    std::fs::create_dir(d.join("adir.prom")).unwrap();
    std::fs::write(d.join("binary.prom"), [0xff, 0xfe, 0x00, 0x80]).unwrap();
    let (out, err, code) = run(&d);
    assert_eq!(code, 1, "some files skipped: exit 1\n{out}{err}");
    let rank_lines: Vec<&str> = out.lines().filter(|l| l.contains(" ib ") && l.contains("comm")).collect();
    assert_eq!(rank_lines.len(), 4, "{out}");
    // slowest first: rank 1 (160 MB/s), rank 2 (785, with errors), then ranks 0 and 3 (800)
    let ranks: Vec<&str> = rank_lines.iter().map(|l| l.split_whitespace().next().unwrap()).collect();
    assert_eq!(&ranks[..2], ["1", "2"], "{out}");
    assert!(rank_lines[0].contains("160.0"), "{out}");
    assert!(rank_lines[1].contains("ERRORS"), "{out}");
    let r3 = rank_lines.iter().find(|l| l.trim_start().starts_with("3 ")).unwrap();
    assert!(r3.contains("all comms closed"), "{out}");
    assert!(out.contains("per device"), "{out}");
    assert!(out.contains("node1            mlx5_1"), "{out}");
    for (file, why) in [
        ("half.prom", "incomplete"),
        ("garbage.prom", "not Prometheus text format: line 1"),
        ("other-exporter.prom", "not a librustnet statistics file"),
        ("adir.prom", "unreadable"),
        ("binary.prom", "not UTF-8"),
    ] {
        assert!(out.lines().any(|l| l.contains(file) && l.contains(why)), "{file}: {why}\n{out}");
    }
    assert!(!out.contains("README"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_empty_or_missing_directory_says_what_to_do() {
    let d = tmpdir("empty");
    std::fs::write(d.join("notes.txt"), "not a .prom file").unwrap();
    let (out, _, code) = run(&d);
    assert_eq!(code, 2);
    assert!(out.contains("no *.prom files") && out.contains("RUSTNET_STATS_DIR="), "{out}");
    let (_, err, code) = run(&d.join("missing"));
    assert_eq!(code, 2);
    assert!(err.contains("cannot read") && err.contains("missing"), "{err}");
    // only unusable files: nothing to summarise
    std::fs::write(d.join("x.prom"), "garbage here\n").unwrap();
    let (out, _, code) = run(&d);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("no usable statistics file") && out.contains("x.prom"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn recoveries_are_listed_per_rank_and_device() {
    let d = tmpdir("recover");
    let file = |pid: u32, rank: u32, recoveries: u64, replayed: u64, last: f64| {
        format!(
            "rustnet_info{{host=\"n1\",pid=\"{pid}\",rank=\"{rank}\",transport=\"socket\",version=\"0\"}} 1\n\
             rustnet_start_time_seconds{{host=\"n1\",pid=\"{pid}\",rank=\"{rank}\"}} 100\n\
             rustnet_write_time_seconds{{host=\"n1\",pid=\"{pid}\",rank=\"{rank}\"}} 110\n\
             rustnet_device_bytes_total{{host=\"n1\",pid=\"{pid}\",rank=\"{rank}\",device=\"eth0\",transport=\"socket\",dir=\"send\"}} 1000\n\
             rustnet_device_recoveries_total{{host=\"n1\",pid=\"{pid}\",rank=\"{rank}\",device=\"eth0\",transport=\"socket\",dir=\"send\"}} {recoveries}\n\
             rustnet_device_replayed_bytes_total{{host=\"n1\",pid=\"{pid}\",rank=\"{rank}\",device=\"eth0\",transport=\"socket\",dir=\"send\"}} {replayed}\n\
             rustnet_device_comms_open{{host=\"n1\",pid=\"{pid}\",rank=\"{rank}\",device=\"eth0\",transport=\"socket\",dir=\"send\"}} 1\n\
             rustnet_comm_last_recovery_seconds{{host=\"n1\",pid=\"{pid}\",rank=\"{rank}\",comm=\"0\",dir=\"send\",peer=\"10.0.0.2:1\",device=\"eth0\",transport=\"socket\"}} {last}\n\
             # EOF\n"
        )
    };
    std::fs::write(d.join("n1-11.prom"), file(11, 0, 3, 2_097_152, 1.25)).unwrap();
    std::fs::write(d.join("n1-12.prom"), file(12, 1, 0, 0, 0.0)).unwrap();
    let (out, err, code) = run(&d);
    assert_eq!(code, 0, "{out}{err}");
    let lines: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("recoveries")).collect();
    assert!(lines.len() >= 3, "no recoveries section:\n{out}");
    let row: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(row, ["0", "n1", "11", "eth0", "3", "2.0", "MiB", "1.25"], "{out}");
    assert_eq!(lines.iter().filter(|l| l.contains(" eth0 ")).count(), 1, "a rank without recoveries is not listed:\n{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn verbs_work_is_shown_per_message_and_direction() {
    let d = tmpdir("work");
    let mut text = String::from(
        "rustnet_info{host=\"n1\",pid=\"7\",transport=\"ib\",version=\"0\"} 1\n\
         rustnet_start_time_seconds{host=\"n1\",pid=\"7\"} 100\n\
         rustnet_write_time_seconds{host=\"n1\",pid=\"7\"} 110\n\
         rustnet_device_messages_total{host=\"n1\",pid=\"7\",device=\"rxe0\",transport=\"ib\",dir=\"send\"} 100\n\
         rustnet_device_messages_total{host=\"n1\",pid=\"7\",device=\"rxe0\",transport=\"ib\",dir=\"recv\"} 50\n\
         rustnet_device_comms_open{host=\"n1\",pid=\"7\",device=\"rxe0\",transport=\"ib\",dir=\"send\"} 0\n",
    );
    // send: 1 doorbell, 2 WRs, 1 signaled, 0 receives, 4 polls (3 empty), 1 CQE per message
    // recv: 1 receive, 0.5 CTS writes, 2 CQEs per message
    for (dir, vals) in [("send", [100, 200, 100, 0, 400, 300, 100, 0]), ("recv", [25, 25, 25, 50, 200, 100, 100, 25])] {
        for (op, v) in rustnet::for_tools::stats::WORK_OPS.iter().zip(vals) {
            text += &format!(
                "rustnet_device_verbs_work_total{{host=\"n1\",pid=\"7\",device=\"rxe0\",transport=\"ib\",dir=\"{dir}\",op=\"{op}\"}} {v}\n"
            );
        }
    }
    text += "# EOF\n";
    std::fs::write(d.join("n1-7.prom"), text).unwrap();
    let (out, err, code) = run(&d);
    assert_eq!(code, 0, "{out}{err}");
    let lines: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("verbs work per message")).collect();
    assert!(lines.len() >= 4, "no verbs work section:\n{out}");
    let row = |i: usize| lines[i].split_whitespace().collect::<Vec<_>>();
    assert_eq!(row(2), ["n1", "rxe0", "send", "100", "1.00", "2.00", "1.00", "0.00", "4.00", "3.00", "1.00", "0.00"], "{out}");
    assert_eq!(row(3), ["n1", "rxe0", "recv", "50", "0.50", "0.50", "0.50", "1.00", "4.00", "2.00", "2.00", "0.50"], "{out}");
    let _ = std::fs::remove_dir_all(&d);
}
