//! Verbs connection set-up toward a wrong listener (issue 11): the
//! out-of-band exchange has the same set-up timeout as TCP streams.
//!
//! `#[ignore]`d with the reason (needs an RDMA device); the soft-RoCE VM runs
//! it with `--include-ignored` and `RUSTNET_TEST_DEVICE=rxe0`
//! (`VERBS_TESTS=verbs_hostile tests/rxe-vm/verbs-suite.sh`).
#[path = "common/ib.rs"]
mod ib;

use std::io::Read;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use ib::{device, net, reg, until, Buf};
use rustnet::for_tools::ib::Access;
use rustnet::proto::handle::{Handle, HandleKind};

/// A program that takes the out-of-band connection but is not a librustnet
/// receiver (it reads and never answers): no send completes, and the send
/// side fails after `RUSTNET_CONNECT_TIMEOUT` naming the peer and the knob.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn a_silent_oob_server_fails_the_sender_after_the_connect_timeout() {
    let d = device();
    let (n, idx) = net(&[&d], &[("RUSTNET_CONNECT_TIMEOUT", "2")]);
    let srv = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = srv.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in srv.incoming() {
            let Ok(mut c) = c else { return };
            std::thread::spawn(move || {
                let mut sink = [0u8; 4096];
                while matches!(c.read(&mut sink), Ok(k) if k > 0) {}
            });
        }
    });
    let h = Handle { kind: HandleKind::Ib, addr, nonce: 0x5eed, stage: 0, resume_port: 0 };
    let t0 = Instant::now();
    let mut c = n.connect(idx[0], &h, None).unwrap();
    // the verbs connect completes once its hello and metadata are out
    until("connect", || c.progress().unwrap().then_some(()));
    let mut s = c.into_send_comm().unwrap();
    let mut b = Buf::new(64 << 10);
    let mr = reg(&n, idx[0], &mut b, Access::LOCAL_READ);
    let err = until("the send side to fail", || {
        // SAFETY: b outlives the request (the comm fails it).
        match unsafe { s.isend(b.raw(), 0, Some(&mr)) } {
            Ok(None) => None,
            Err(e) => Some(e),
            Ok(Some(id)) => loop {
                match s.test(id) {
                    Ok(None) => assert!(t0.elapsed() < Duration::from_secs(30), "send neither completed nor failed"),
                    Ok(Some(_)) => panic!("a 64 KiB send completed toward a program that never accepted the connection"),
                    Err(e) => break Some(e),
                }
            },
        }
    });
    let took = t0.elapsed();
    let m = err.to_string();
    eprintln!("silent out-of-band server: send side failed after {took:?}: {m}");
    assert!(m.contains(&addr.to_string()) && m.contains("RUSTNET_CONNECT_TIMEOUT=2"), "{m}");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(10), "{took:?}");
}
