//! Connection set-up under hostile peers and exhausted resources, through
//! the built `librustnet.so` (ABI v8, TCP on loopback), as in issue 11:
//!
//! - accept when the process has run out of descriptors is "not yet" with a
//!   WARN naming the limit, and the listener serves a real peer once
//!   descriptors free up (strangers holding them, or anything else);
//! - connections without a valid hello are bounded in number and age, and a
//!   listener with 1000 strangers attached still serves a real peer at once;
//! - connect to an address whose SYNs vanish fails after
//!   `RUSTNET_CONNECT_TIMEOUT`, naming the address and the knob;
//! - no send completes toward a listener that never accepted the
//!   connection (a stale handle, a program that is not a librustnet listener).
//!
//! Each case runs in a child process of this test binary (its own knobs,
//! its own descriptor limit, its own stderr to read the WARNs from).
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use rustnet::proto::handle::{Handle, HandleKind, HANDLE_SIZE};
use rustnet_tools::driver::{default_plugin_path, Plugin, Ptr};

const CHILD: &str = "RUSTNET_HOSTILE_CHILD";

/// Run the ignored test `name` in a child process with `env`; its stdout and stderr.
fn child(name: &str, env: &[(&str, &str)]) -> (String, String) {
    let so = default_plugin_path();
    assert!(so.exists(), "plugin not built at {}", so.display());
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("RUSTNET_PLUGIN", &so)
        .env("RUSTNET_TRANSPORT", "socket")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .envs(env.iter().copied())
        .output()
        .expect("run child");
    let (o, e) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    for l in o.lines().filter_map(|l| l.find("MEASURE").map(|i| &l[i..])) {
        eprintln!("{name}: {l}");
    }
    assert!(out.status.success(), "{name} failed ({}):\n--- stdout\n{o}\n--- stderr\n{e}", out.status);
    (o, e)
}

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

fn plugin() -> Plugin {
    let p = Plugin::open(&default_plugin_path(), 8).unwrap();
    p.init().unwrap();
    p
}

fn addr_of(h: &[u8; HANDLE_SIZE]) -> SocketAddr {
    Handle::decode(h).unwrap().addr
}

/// A handle that leads to `addr` (any program listening there).
fn handle_to(addr: SocketAddr) -> [u8; HANDLE_SIZE] {
    let mut b = [0u8; HANDLE_SIZE];
    Handle { kind: HandleKind::Tcp, addr, nonce: 0x5eed, stage: 0, resume_port: 0 }.encode(&mut b);
    b
}

/// Soft RLIMIT_NOFILE.
fn set_nofile(n: u64) {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer; then the same struct back in.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = n.min(r.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
}

fn nofile_hard() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    r.rlim_max
}

/// Highest open descriptor + 1.
fn fd_top() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok()).max().unwrap_or(0) + 1
}

/// connect and accept interleaved (as NCCL's one-thread paths do) until both
/// are done; accept must never fail. The time it took.
fn serve(p: &Plugin, h: &mut [u8; HANDLE_SIZE], l: Ptr, limit: Duration) -> (Ptr, Ptr, Duration) {
    serve_from(p, h, l, None, limit)
}

/// [`serve`] with a connect that may already have completed.
fn serve_from(p: &Plugin, h: &mut [u8; HANDLE_SIZE], l: Ptr, mut s: Option<Ptr>, limit: Duration) -> (Ptr, Ptr, Duration) {
    let t0 = Instant::now();
    let mut r = None;
    while s.is_none() || r.is_none() {
        if s.is_none() {
            s = p.connect(0, h).unwrap_or_else(|e| panic!("connect failed after {:?}: {e}", t0.elapsed()));
        }
        if r.is_none() {
            r = p.accept(l).unwrap_or_else(|e| panic!("accept failed after {:?}: {e}", t0.elapsed()));
        }
        assert!(t0.elapsed() < limit, "the real peer was not served within {limit:?} (send {}, recv {})", s.is_some(), r.is_some());
    }
    (s.unwrap(), r.unwrap(), t0.elapsed())
}

/// 64 KiB over the pair, every byte checked.
fn transfer(p: &Plugin, s: Ptr, r: Ptr) {
    let len = 64 << 10;
    let mut src: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
    let mut dst = vec![0u8; len];
    let smh = p.reg_mr(s, src.as_mut_ptr(), len).unwrap();
    let rmh = p.reg_mr(r, dst.as_mut_ptr(), len).unwrap();
    let sreq = p.isend(s, src.as_mut_ptr(), len, 1, smh).unwrap().unwrap();
    let rreq = p.irecv(r, &[(dst.as_mut_ptr(), len, 1, rmh)]).unwrap().unwrap();
    let (mut sd, mut rd) = (false, false);
    let t0 = Instant::now();
    while !(sd && rd) {
        assert!(t0.elapsed() < Duration::from_secs(20), "transfer stuck");
        let mut sz = [0i32; 8];
        if !sd {
            sd = p.test(sreq, &mut sz).unwrap();
        }
        if !rd {
            rd = p.test(rreq, &mut sz).unwrap();
        }
    }
    assert!(src == dst);
    p.dereg_mr(s, smh).unwrap();
    p.dereg_mr(r, rmh).unwrap();
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

// ------------------------------------------------------------ fd exhaustion

#[test]
fn fd_exhaustion_is_back_pressure_and_the_listener_recovers() {
    let (_, err) = child("child_fd_exhaustion", &[]);
    assert!(err.contains("cannot accept") && err.contains("RLIMIT_NOFILE"), "no WARN naming the limit; stderr:\n{err}");
    let warns = err.matches("cannot accept").count();
    assert!(warns <= 4, "the descriptor WARN is not rate-limited ({warns} lines)");
}

#[test]
#[ignore = "child process of fd_exhaustion_is_back_pressure_and_the_listener_recovers"]
fn child_fd_exhaustion() {
    if !is_child() {
        return;
    }
    let hard = nofile_hard();
    let p = plugin();
    // 1. The case: 400 idle strangers, the limit 200 above the
    //    descriptors in use, the real peer queued behind the strangers.
    let (mut h, l) = p.listen(0).unwrap();
    let strangers: Vec<TcpStream> = (0..400).map(|_| TcpStream::connect(addr_of(&h)).unwrap()).collect();
    let s0 = p.connect(0, &mut h).unwrap();
    set_nofile(fd_top() + 200);
    let (s, r, took) = serve_from(&p, &mut h, l, s0, Duration::from_secs(10));
    println!("MEASURE strangers_hold_fds served_after_ms={:.1}", took.as_secs_f64() * 1e3);
    transfer(&p, s, r);
    p.close_send(s).unwrap();
    p.close_recv(r).unwrap();
    p.close_listen(l).unwrap();
    drop(strangers);
    set_nofile(hard);

    // 2. Something else holds every descriptor: accept is "not yet" (never
    //    an error) while it lasts, and serves the peer once they are free.
    for round in 0..3 {
        let (mut h, l) = p.listen(0).unwrap();
        let mut s0 = p.connect(0, &mut h).unwrap();
        set_nofile(fd_top() + 50);
        let mut filler = Vec::new();
        while let Ok(f) = std::fs::File::open("/dev/null") {
            filler.push(f);
        }
        let t0 = Instant::now();
        let mut calls = 0;
        while t0.elapsed() < Duration::from_millis(700) {
            match p.accept(l) {
                Ok(None) => calls += 1,
                Ok(Some(_)) => panic!("accepted with no descriptor free"),
                Err(e) => panic!("accept failed while descriptors were exhausted (must be back-pressure): {e}"),
            }
            if s0.is_none() {
                s0 = p.connect(0, &mut h).unwrap();
            }
        }
        // (connect waits for the acceptance: no_send_completes_toward_a_listener_that_never_accepted)
        assert!(s0.is_none(), "connect completed before the listener accepted");
        drop(filler);
        let (s, r, took) = serve_from(&p, &mut h, l, s0, Duration::from_secs(10));
        println!("MEASURE round={round} not_yet_calls={calls} recovered_after_ms={:.2}", took.as_secs_f64() * 1e3);
        transfer(&p, s, r);
        p.close_send(s).unwrap();
        p.close_recv(r).unwrap();
        p.close_listen(l).unwrap();
        set_nofile(hard);
    }
}

// ------------------------------------------------------------ strangers

#[test]
fn strangers_are_bounded_in_number_and_age() {
    let (_, err) = child("child_strangers_bounded", &[("RUSTNET_SOCKET_TIMEOUT", "2")]);
    assert!(err.contains("RUSTNET_LISTEN_MAX_STRANGERS=256") && err.contains("127.0.0.1:"), "no WARN naming the dropped; stderr:\n{err}");
    assert!(err.contains("RUSTNET_SOCKET_TIMEOUT=2"), "no WARN naming the overdue; stderr:\n{err}");
    let lines = err.lines().filter(|l| l.contains("rejected")).count();
    assert!(lines <= 6, "rejections are not rate-limited ({lines} lines)");
}

#[test]
#[ignore = "child process of strangers_are_bounded_in_number_and_age"]
fn child_strangers_bounded() {
    if !is_child() {
        return;
    }
    let p = plugin();
    let (mut h, l) = p.listen(0).unwrap();
    let base = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let mut strangers: Vec<TcpStream> = (0..1000).map(|_| TcpStream::connect(addr_of(&h)).unwrap()).collect();
    for _ in 0..20 {
        assert!(p.accept(l).unwrap().is_none());
    }
    let held = std::fs::read_dir("/proc/self/fd").unwrap().count() - base - strangers.len();
    println!("MEASURE strangers=1000 held_by_listener={held}");
    assert!(held <= 256 + 8, "the listener holds {held} connections without a hello (limit 256)");
    // the real peer still gets in
    let (s, r, took) = serve(&p, &mut h, l, Duration::from_secs(5));
    println!("MEASURE served_with_strangers_ms={:.2}", took.as_secs_f64() * 1e3);
    // past RUSTNET_SOCKET_TIMEOUT every stranger has been closed
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(2300) {
        assert!(p.accept(l).unwrap().is_none());
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut open = 0;
    for st in &mut strangers {
        st.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
        let mut b = [0u8; 64];
        let closed = loop {
            match st.read(&mut b) {
                Ok(0) => break true,
                Ok(_) => continue, // the refusal
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => break false,
                Err(_) => break true,
            }
        };
        open += usize::from(!closed);
    }
    println!("MEASURE still_open_after_timeout={open}");
    assert_eq!(open, 0, "{open} strangers still connected after RUSTNET_SOCKET_TIMEOUT");
    p.close_send(s).unwrap();
    p.close_recv(r).unwrap();
    p.close_listen(l).unwrap();
}

#[test]
fn a_listener_with_1000_strangers_serves_a_real_peer_fast() {
    child("child_accept_cost", &[("RUSTNET_LISTEN_MAX_STRANGERS", "4000")]);
}

#[test]
#[ignore = "child process of a_listener_with_1000_strangers_serves_a_real_peer_fast"]
fn child_accept_cost() {
    if !is_child() {
        return;
    }
    let p = plugin();
    let (mut h, l) = p.listen(0).unwrap();
    let cost = |n: usize| {
        let mut v: Vec<f64> = (0..n)
            .map(|_| {
                let t = Instant::now();
                assert!(p.accept(l).unwrap().is_none());
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        let m = median(&mut v);
        (m, v[0], v[v.len() - 1])
    };
    let (idle, lo0, hi0) = cost(500);
    let strangers: Vec<TcpStream> = (0..1000).map(|_| TcpStream::connect(addr_of(&h)).unwrap()).collect();
    for _ in 0..50 {
        assert!(p.accept(l).unwrap().is_none());
    }
    let (busy, lo1, hi1) = cost(500);
    println!("MEASURE accept_us strangers=0 median={idle:.1} min={lo0:.1} max={hi0:.1}");
    println!("MEASURE accept_us strangers=1000 median={busy:.1} min={lo1:.1} max={hi1:.1}");
    let mut served = Vec::new();
    for _ in 0..5 {
        let (s, r, took) = serve(&p, &mut h, l, Duration::from_secs(5));
        served.push(took.as_secs_f64() * 1e3);
        p.close_send(s).unwrap();
        p.close_recv(r).unwrap();
    }
    let (lo, hi) = (served.iter().cloned().fold(f64::MAX, f64::min), served.iter().cloned().fold(0.0, f64::max));
    let m = median(&mut served);
    println!("MEASURE served_ms strangers=1000 n=5 median={m:.2} min={lo:.2} max={hi:.2}");
    assert!(m < 100.0, "a real peer took {m:.1} ms (median) with 1000 strangers attached");
    // the cost of a call does not follow the strangers (generous for a loaded machine)
    assert!(busy < idle * 10.0 + 100.0, "accept costs {busy:.1} us with 1000 strangers vs {idle:.1} us without");
    drop(strangers);
    p.close_listen(l).unwrap();
}

// ------------------------------------------------------------ set-up timeout

#[test]
fn connect_to_vanishing_syns_fails_after_the_timeout() {
    let (out, err) = child("child_vanishing_syns", &[("RUSTNET_CONNECT_TIMEOUT", "2")]);
    let addr = out.lines().find_map(|l| Some(&l[l.find("ADDR ")? + 5..])).expect("child printed the address").trim().to_string();
    assert!(
        err.contains(&addr) && err.contains("RUSTNET_CONNECT_TIMEOUT=2") && err.contains("SYN"),
        "the error does not name the peer {addr} and the knob; stderr:\n{err}"
    );
}

#[test]
#[ignore = "child process of connect_to_vanishing_syns_fails_after_the_timeout"]
fn child_vanishing_syns() {
    if !is_child() {
        return;
    }
    // A listen socket with a full backlog drops every SYN, as a host that
    // is gone or a firewall does.
    let full = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = full.local_addr().unwrap();
    // SAFETY: full's fd is open; listen(2) only changes its backlog.
    assert_eq!(unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&full), 0) }, 0);
    let mut held = Vec::new();
    while held.len() < 8 {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
            Ok(s) => held.push(s),
            Err(_) => break,
        }
    }
    assert!(held.len() < 8, "the backlog never filled: cannot make SYNs vanish here");
    println!("ADDR {addr}");
    let p = plugin();
    let mut h = handle_to(addr);
    let t0 = Instant::now();
    let e = loop {
        match p.connect(0, &mut h) {
            Ok(None) => assert!(t0.elapsed() < Duration::from_secs(30), "connect still pending after 30 s"),
            Ok(Some(_)) => panic!("connected to a listener whose backlog drops every SYN"),
            Err(e) => break e,
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = t0.elapsed();
    println!("MEASURE connect_failed_after_s={:.3} knob=2 error={e}", took.as_secs_f64());
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(6), "{took:?}");
}

// ------------------------------------------------------------ wrong listener

#[test]
fn no_send_completes_toward_a_listener_that_never_accepted() {
    let (_, err) = child("child_wrong_listener", &[("RUSTNET_CONNECT_TIMEOUT", "2")]);
    assert!(err.contains("refused the connection") && err.contains("stale handle"), "stale nonce: no reason given; stderr:\n{err}");
    assert!(
        err.contains("did not accept the connection within RUSTNET_CONNECT_TIMEOUT=2"),
        "silent server: no reason given; stderr:\n{err}"
    );
}

/// Connect with `h` and, if that completes, try a 64 KiB send: it must not
/// complete. Returns how long until connect failed.
fn must_not_deliver(p: &Plugin, h: &mut [u8; HANDLE_SIZE], l: Option<Ptr>, what: &str) -> Duration {
    let t0 = Instant::now();
    loop {
        if let Some(l) = l {
            let _ = p.accept(l);
        }
        match p.connect(0, h) {
            Ok(None) => {}
            Err(_) => return t0.elapsed(),
            Ok(Some(s)) => {
                let len = 64 << 10;
                let mut buf = vec![7u8; len];
                let mh = p.reg_mr(s, buf.as_mut_ptr(), len).unwrap();
                let req = p.isend(s, buf.as_mut_ptr(), len, 0, mh).unwrap().unwrap();
                let t1 = Instant::now();
                while t1.elapsed() < Duration::from_secs(2) {
                    let mut sz = [0i32; 1];
                    match p.test(req, &mut sz) {
                        Ok(true) => panic!("{what}: a 64 KiB send completed although no listener accepted the connection"),
                        Ok(false) => {}
                        Err(_) => return t0.elapsed(),
                    }
                }
                panic!("{what}: connect completed although no listener accepted the connection");
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{what}: connect neither completed nor failed");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
#[ignore = "child process of no_send_completes_toward_a_listener_that_never_accepted"]
fn child_wrong_listener() {
    if !is_child() {
        return;
    }
    let p = plugin();
    // a stale handle: the port is a librustnet listener, the nonce another's
    let (mut h, l) = p.listen(0).unwrap();
    let good = h;
    h[40] ^= 0x5a;
    let took = must_not_deliver(&p, &mut h, Some(l), "stale nonce");
    println!("MEASURE stale_nonce_connect_failed_after_ms={:.1}", took.as_secs_f64() * 1e3);
    assert!(took < Duration::from_secs(2), "a refused connect should fail at once, took {took:?}");
    // that listener still serves the right handle
    let mut h = good;
    let (s, r, _) = serve(&p, &mut h, l, Duration::from_secs(5));
    transfer(&p, s, r);
    p.close_send(s).unwrap();
    p.close_recv(r).unwrap();
    p.close_listen(l).unwrap();

    // a program that is not a librustnet listener: it accepts and reads all
    let srv = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = srv.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in srv.incoming() {
            let Ok(mut c) = c else { return };
            std::thread::spawn(move || {
                let mut sink = [0u8; 65536];
                while matches!(c.read(&mut sink), Ok(n) if n > 0) {}
                let _ = c.write_all(b"");
            });
        }
    });
    let mut h = handle_to(addr);
    let took = must_not_deliver(&p, &mut h, None, "silent server");
    println!("MEASURE silent_server_connect_failed_after_s={:.3} knob=2", took.as_secs_f64());
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(6), "{took:?}");
}

/// Listening TCP sockets of this process: their local ports.
fn own_listen_ports() -> Vec<u16> {
    let mut inodes = std::collections::HashSet::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if let Ok(t) = std::fs::read_link(e.path()) {
            if let Some(i) = t.to_str().and_then(|s| s.strip_prefix("socket:[")).and_then(|s| s.strip_suffix(']')) {
                inodes.insert(i.to_string());
            }
        }
    }
    let mut ports = Vec::new();
    for f in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        for l in std::fs::read_to_string(f).unwrap_or_default().lines().skip(1) {
            let w: Vec<&str> = l.split_whitespace().collect();
            if w.len() > 9 && w[3] == "0A" && inodes.contains(w[9]) {
                ports.push(u16::from_str_radix(w[1].rsplit(':').next().unwrap(), 16).unwrap());
            }
        }
    }
    ports
}

#[test]
fn strangers_at_the_resume_port_cannot_take_over_a_comm() {
    // every send comm of the child resets a stream after its 3rd write and every 4th after
    let (out, err) = child("child_resume_strangers", &[("RUSTNET_FAULT_TCP_RESET", "send:3:4")]);
    assert!(out.contains("STRANGERS REFUSED"), "{out}");
    assert!(
        err.contains("refused a reconnection from 127.0.0.1:") && err.contains("not a librustnet resume hello"),
        "no WARN naming the stranger; stderr:\n{err}"
    );
    assert!(err.contains("recovered after"), "the real comm did not recover while strangers were at its port; stderr:\n{err}");
}

#[test]
#[ignore = "child process of strangers_at_the_resume_port_cannot_take_over_a_comm"]
fn child_resume_strangers() {
    use rustnet::proto::handle::PROTO_VERSION;
    use rustnet::proto::resume::{ResumeHello, ResumeReply, SenderQuery, Token, RESUME_REPLY_LEN};
    use rustnet::proto::wire::{Hello, Reply, Verdict, REPLY_LEN, TCP_HELLO_LEN};
    if !is_child() {
        return;
    }
    let p = plugin();
    let before = own_listen_ports();
    let (mut h, l) = p.listen(0).unwrap();
    let listen_port = addr_of(&h).port();
    let resume: Vec<u16> = own_listen_ports().into_iter().filter(|x| *x != listen_port && !before.contains(x)).collect();
    assert_eq!(resume.len(), 1, "expected one resume port besides the listen port: {resume:?}");
    let rp = SocketAddr::new(addr_of(&h).ip(), resume[0]);
    // a stranger without the listener's nonce does not learn the resume port from it
    let mut st = TcpStream::connect(addr_of(&h)).unwrap();
    let mut hello = [0u8; TCP_HELLO_LEN];
    hello[..32].copy_from_slice(&Hello { version: PROTO_VERSION, stream: 0, nstreams: 1, conn_id: 9, nonce: 0xbad }.encode());
    st.write_all(&hello).unwrap();
    let _ = p.accept(l).unwrap();
    let mut b = [0u8; REPLY_LEN];
    st.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let _ = p.accept(l);
        if st.read_exact(&mut b).is_ok() {
            break;
        }
    }
    let r = Reply::decode(&b).unwrap();
    assert_eq!((r.verdict, r.resume_port), (Verdict::WrongNonce, 0), "a refusal must not name the resume port");
    let (s, r, _) = serve(&p, &mut h, l, Duration::from_secs(10));
    // NCCL closes the listen comm after accept; the resume port stays
    p.close_listen(l).unwrap();
    // strangers at the resume port: garbage, and a well-formed resume for a connection this process does not have
    let answer = |bytes: &[u8]| -> Option<Verdict> {
        let mut c = TcpStream::connect(rp).unwrap();
        c.write_all(bytes).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; RESUME_REPLY_LEN];
        c.read_exact(&mut b).ok()?;
        Some(ResumeReply::decode(&b).unwrap().verdict)
    };
    let mut garbage = b"GET / HTTP/1.0\r\n\r\n".to_vec();
    garbage.resize(64, b'x');
    assert_eq!(answer(&garbage), Some(Verdict::Malformed));
    let forged = ResumeHello {
        version: PROTO_VERSION,
        stream: 0,
        nstreams: 1,
        conn_id: 0x1234,
        epoch: 1,
        sent: 0,
        elapsed_ms: 0,
        token: Token([7; 16]),
    };
    assert_eq!(answer(&forged.encode()), Some(Verdict::UnknownComm));
    // a stranger's question about a send comm: as for one that never was (it has no token)
    let q = SenderQuery { version: PROTO_VERSION, conn_id: 0x1234, token: Token([7; 16]) };
    assert_eq!(answer(&q.encode()), Some(Verdict::UnknownComm));
    assert_eq!(answer(&SenderQuery { version: PROTO_VERSION + 1, ..q }.encode()), Some(Verdict::Version));
    // the real comm goes on, through resets and reconnections
    for _ in 0..10 {
        transfer(&p, s, r);
    }
    println!("STRANGERS REFUSED");
    p.close_send(s).unwrap();
    p.close_recv(r).unwrap();
}
