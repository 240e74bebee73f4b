//! RUSTNET_STATS_DIR through the built library, driven as NCCL drives it:
//! the file appears while comms are open and is rewritten every interval,
//! its counters equal the bytes and messages this test moved, the writer
//! thread exists only while comms are open (joined by the last close), and
//! the last close writes the final totals. TCP on loopback by default; the
//! same test runs over verbs where `RUSTNET_TRANSPORT=ib` and a device are
//! set (the soft-RoCE VM: `VERBS_TESTS=stats`), and then also checks the
//! per-QP counters.
//!
//! One test per binary: it sets the plugin's environment before loading it.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Threads of this process named as the statistics writer.
fn writers() -> usize {
    let name = rustnet::for_tools::stats::WRITER_NAME.to_str().unwrap();
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter(|t| {
            let comm = t.as_ref().map(|t| std::fs::read_to_string(t.path().join("comm")).unwrap_or_default()).unwrap_or_default();
            comm.trim() == name
        })
        .count()
}
use rustnet::for_tools::stats::prom;
use rustnet_tools::driver::{default_plugin_path, Plugin, Ptr};

fn ck<T>(r: Result<T, impl std::fmt::Display>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Move one message of `len` bytes from `s` to `r` (a loopback pair) and check it.
fn one(p: &Plugin, s: Ptr, r: Ptr, len: usize, tag: i32) {
    let mut sb: Vec<u8> = (0..len.max(1)).map(|i| (i * 7 + len) as u8).collect();
    let mut rb = vec![0u8; len.max(1)];
    let smh = ck(p.reg_mr(s, sb.as_mut_ptr(), sb.len()), "regMr send");
    let rmh = ck(p.reg_mr(r, rb.as_mut_ptr(), rb.len()), "regMr recv");
    let t0 = Instant::now();
    let late = || assert!(t0.elapsed() < Duration::from_secs(60), "message of {len} bytes not done after 60 s");
    let rq = loop {
        if let Some(q) = ck(p.irecv(r, &[(rb.as_mut_ptr(), len, tag, rmh)]), "irecv") {
            break q;
        }
        late();
    };
    let (mut sq, mut rdone, mut sizes) = (None, false, [0i32; 8]);
    while sq.is_none() {
        sq = ck(p.isend(s, sb.as_mut_ptr(), len, tag, smh), "isend");
        rdone = rdone || ck(p.test(rq, &mut sizes), "test recv");
        late();
    }
    let mut sdone = false;
    while !(sdone && rdone) {
        sdone = sdone || ck(p.test(sq.unwrap(), &mut [0]), "test send");
        rdone = rdone || ck(p.test(rq, &mut sizes), "test recv");
        late();
    }
    assert_eq!(sizes[0] as usize, len);
    assert_eq!(rb[..len], sb[..len], "payload of {len} bytes");
    ck(p.dereg_mr(s, smh), "deregMr");
    ck(p.dereg_mr(r, rmh), "deregMr");
}

fn read(path: &Path) -> prom::Exposition {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let e = prom::parse(&text).unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()));
    assert!(e.complete, "no end marker:\n{text}");
    e
}

/// Wait until the file satisfies `ok` (the writer rewrites it every second).
fn wait_for(path: &Path, what: &str, ok: impl Fn(&prom::Exposition) -> bool) -> prom::Exposition {
    let t0 = Instant::now();
    loop {
        if path.exists() {
            let e = read(path);
            if ok(&e) {
                return e;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{what}: not in {} after 30 s", path.display());
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_stats_file_counts_what_moved_and_its_thread_ends_with_the_last_comm() {
    let dir: PathBuf = std::env::temp_dir().join(format!("rustnet-stats-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // SAFETY (of set_var): the only test of this binary; nothing else runs yet.
    std::env::set_var("RUSTNET_STATS_DIR", &dir);
    std::env::set_var("RUSTNET_STATS_INTERVAL", "1");
    std::env::set_var("RANK", "5");
    std::env::set_var("RUSTNET_SOCKET_HELPER", "0");
    std::env::set_var("RUSTNET_IB_EAGER", "0"); // every verbs byte then rides a counted data write
    if std::env::var_os("RUSTNET_TRANSPORT").is_none() {
        std::env::set_var("RUSTNET_TRANSPORT", "socket");
    }
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
        std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    }
    let ib = std::env::var("RUSTNET_TRANSPORT").as_deref() == Ok("ib");
    // the newest ABI: its init names NCCL's communicator, which labels the comm series
    let p = ck(Plugin::open(&default_plugin_path(), 12), "open the plugin");
    ck(p.init(), "init");
    let host = rustnet::for_tools::stats::hostname();
    let path = dir.join(format!("{host}-{}.prom", std::process::id()));
    let threads0 = writers();
    assert_eq!(threads0, 0, "no writer before the first comm");

    let (mut h, l) = ck(p.listen(0), "listen");
    let (s, r) = ck(p.connect_accept(0, &mut h, l, Duration::from_secs(60)), "connect/accept");
    let sizes = [0usize, 1, 100, 4096, 65536, 1 << 20, (3 << 20) + 5];
    let mut total = 0u64;
    let mut n = 0u64;
    for round in 0..3 {
        for (i, &len) in sizes.iter().enumerate() {
            one(&p, s, r, len, (round * 10 + i) as i32);
            total += len as u64;
            n += 1;
        }
    }
    // the writer runs (one thread more than before the first comm) ...
    assert_eq!(writers(), threads0 + 1, "one writer thread while comms are open");
    // ... and its next write shows every message on both open comms
    let e = wait_for(&path, "the counters of the open comms", |e| e.sum("rustnet_comm_completions_total", &[("dir", "recv")]) == n as f64);
    let t1 = e.first("rustnet_write_time_seconds").unwrap();
    for dir in ["send", "recv"] {
        let want = [("dir", dir)];
        assert_eq!(e.sum("rustnet_comm_bytes_total", &want), total as f64, "{dir} bytes");
        assert_eq!(e.sum("rustnet_comm_messages_total", &want), n as f64, "{dir} messages");
        assert_eq!(e.sum("rustnet_comm_completions_total", &want), n as f64, "{dir} completions");
        assert_eq!(e.sum("rustnet_comm_errors_total", &want), 0.0, "{dir} errors");
        assert_eq!(e.sum("rustnet_device_bytes_total", &want), total as f64, "{dir} device bytes");
        assert_eq!(e.sum("rustnet_device_comms_open", &want), 1.0);
        if ib {
            assert_eq!(e.sum("rustnet_qp_bytes_total", &want), total as f64, "{dir} QP bytes");
            assert!(e.get("rustnet_qp_bytes_total").all(|s| s.label("qp").is_some_and(|q| q.starts_with("0x"))));
        }
    }
    assert!(e.samples.iter().all(|s| s.label("rank") == Some("5") && s.label("host") == Some(host.as_str())));
    let comm_id = format!("{:#018x}", rustnet_tools::driver::DRIVER_COMM_ID);
    assert!(
        e.get("rustnet_comm_bytes_total").all(|s| s.label("nccl_comm") == Some(comm_id.as_str())),
        "v12 init's commId labels each comm"
    );
    let info = e.get("rustnet_info").next().expect("rustnet_info");
    assert_eq!(info.label("transport"), Some(if ib { "ib" } else { "socket" }));
    // rewritten every interval while open
    wait_for(&path, "a later write", |e| e.first("rustnet_write_time_seconds").unwrap() > t1);
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "only the .prom file in the directory: {leftovers:?}");

    // closing the last comm writes the totals and joins the thread
    ck(p.close_send(s), "closeSend");
    assert_eq!(writers(), threads0 + 1, "the writer stays while the receive comm is open");
    ck(p.close_recv(r), "closeRecv");
    ck(p.close_listen(l), "closeListen");
    // joined: gone at once, or after the kernel reaps the exited task (the
    // join returns when the thread's tid word is cleared, a moment before
    // /proc stops listing it; seen under emulation)
    let t0 = Instant::now();
    while writers() != threads0 && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(writers(), threads0, "the writer thread outlived the last comm");
    let e = read(&path);
    for dir in ["send", "recv"] {
        let want = [("dir", dir)];
        assert_eq!(e.sum("rustnet_device_bytes_total", &want), total as f64, "final {dir} bytes");
        assert_eq!(e.sum("rustnet_device_messages_total", &want), n as f64, "final {dir} messages");
        assert_eq!(e.sum("rustnet_device_completions_total", &want), n as f64, "final {dir} completions");
        assert_eq!(e.sum("rustnet_device_comms_total", &want), 1.0);
        assert_eq!(e.sum("rustnet_device_comms_open", &want), 0.0);
    }
    assert_eq!(e.get("rustnet_comm_bytes_total").count(), 0, "closed comms have no per-comm series");

    // what `rustnet stats` makes of it
    let rep = rustnet_tools::stats_summary::scan(&dir).unwrap();
    assert!(rep.skipped.is_empty(), "{:?}", rep.skipped);
    assert_eq!(rep.procs.len(), 1);
    let pr = &rep.procs[0];
    assert_eq!((pr.rank.as_deref(), pr.bytes(), pr.errors(), pr.open), (Some("5"), 2 * total, 0, 0));
    let (text, code) = rustnet_tools::stats_summary::render(&dir, &rep);
    assert_eq!(code, 0, "{text}");
    println!("{text}");
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}
