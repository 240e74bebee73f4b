//! A C program built against our own `nccl-headers/` loads the plugin: the
//! C view of the tables and properties matches what the plugin reports, and
//! log lines reach the logger handed to `init` (not stderr).
use std::path::PathBuf;
use std::process::Command;

fn build(tag: &str) -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join(format!("rustnet-consumer-{tag}-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(root.join("tests/c/consumer.c"))
        .arg(format!("-I{}", root.join("nccl-headers").display()))
        .arg("-ldl")
        .status();
    match st {
        Ok(s) if s.success() => Some(out),
        Ok(s) => panic!("compiling tests/c/consumer.c against nccl-headers failed: {s}"),
        Err(e) => {
            eprintln!("SKIPPED: no C compiler ({cc}: {e})");
            None
        }
    }
}

fn run(bin: &PathBuf, mode: &str, env: &[(&str, &str)]) -> String {
    let so = rustnet_tools::driver::default_plugin_path();
    assert!(so.exists(), "plugin not built at {}", so.display());
    let mut c = Command::new(bin);
    c.arg(&so).arg(mode).env("NCCL_SOCKET_IFNAME", "lo");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    let s = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "consumer {mode} failed: {s}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        o.stderr.is_empty() || !String::from_utf8_lossy(&o.stderr).contains("[rustnet"),
        "logged to stderr despite a logger: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    s
}

#[test]
fn c_view_of_tables_and_logger() {
    let Some(bin) = build("props") else { return };
    let out = run(&bin, "props", &[("NCCL_DEBUG", "INFO")]);
    assert!(out.contains("V8 name=lo ptr=1 regIsGlobal=1"), "{out}");
    assert!(out.contains("maxRecvs=8 type=0 ver=0"), "{out}");
    assert!(out.contains("V9 name=lo forceFlush=0 maxRecvs=8 vndevs=1 vdev0=0 maxP2p=1073741824 maxColl=536870912"), "{out}");
    assert!(out.contains("V6 name=lo maxRecvs=8"), "{out}");
    assert!(out.contains("V11 name=lo vndevs=1 maxP2p=1073741824 maxColl=536870912 maxMultiRequestSize=1"), "{out}");
    assert!(out.contains("V12 name=lo vndevs=1 vdev0=0 maxP2p=1073741824 maxMultiRequestSize=1 railId=-1 planeId=-1"), "{out}");
    assert!(out.contains("FINALIZE 0"), "{out}");
    // INFO lines about the transport choice went to NCCL's logger
    assert!(out.contains("LOG level=3") && out.contains("using TCP on"), "{out}");
    let _ = std::fs::remove_file(bin);
}

#[test]
fn bad_env_warns_through_logger() {
    let Some(bin) = build("badenv") else { return };
    let out = run(&bin, "badenv", &[("NCCL_SOCKET_FAMILY", "AF_IPX")]);
    assert!(out.contains("INIT 5"), "{out}");
    assert!(out.contains("LASTWARN") && out.contains("NCCL_SOCKET_FAMILY") && out.contains("AF_IPX"), "{out}");
    let _ = std::fs::remove_file(bin);
}
