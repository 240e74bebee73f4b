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
