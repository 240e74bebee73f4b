//! A receiving rank that is alive but busy (posts no receive for longer than
//! `RUSTNET_SOCKET_TIMEOUT`) is not a dead peer: the sender's data waits in
//! a full TCP window and moves once the receive is posted. (With
//! TCP_USER_TIMEOUT on the streams, Linux 5.x+ aborted such a connection
//! with ETIMEDOUT after the timeout.) The link-cut case, where the peer
//! really is gone, is `tcp_link_cut_silent_peer` in the conformance suite.
use std::time::{Duration, Instant};

use rustnet_tools::driver::{default_plugin_path, Plugin};

#[test]
fn a_busy_receiver_past_the_socket_timeout_is_not_a_dead_peer() {
    std::env::set_var("RUSTNET_TRANSPORT", "tcp");
    std::env::set_var("RUSTNET_SOCKET_TIMEOUT", "2");
    std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    let so = default_plugin_path();
    assert!(so.exists(), "plugin not built at {}", so.display());
    let p = Plugin::open(&so, 8).unwrap();
    p.init().unwrap();
    let (mut h, l) = p.listen(0).unwrap();
    let (s, r) = p.connect_accept(0, &mut h, l, Duration::from_secs(30)).unwrap();
    // far more than loopback's socket buffers hold: the window closes
    let len = 64 << 20;
    let mut src: Vec<u8> = (0..len).map(|i| (i * 7 + (i >> 13)) as u8).collect();
    let mut dst = vec![0u8; len];
    let smh = p.reg_mr(s, src.as_mut_ptr(), len).unwrap();
    let rmh = p.reg_mr(r, dst.as_mut_ptr(), len).unwrap();
    let sreq = p.isend(s, src.as_mut_ptr(), len, 5, smh).unwrap().expect("isend taken");
    // the receiver is busy for 3x the timeout; the sender keeps testing
    let t0 = Instant::now();
    let mut sz = [0i32; 1];
    while t0.elapsed() < Duration::from_secs(6) {
        match p.test(sreq, &mut sz) {
            Ok(false) => std::thread::sleep(Duration::from_millis(20)),
            Ok(true) => panic!("a 64 MiB send completed with no receive posted"),
            Err(e) => panic!("the sender failed after {:?} while the receiver was only busy: {e}", t0.elapsed()),
        }
    }
    let rreq = p.irecv(r, &[(dst.as_mut_ptr(), len, 5, rmh)]).unwrap().expect("irecv taken");
    let (mut sdone, mut rdone) = (false, false);
    let t1 = Instant::now();
    while !(sdone && rdone) {
        assert!(t1.elapsed() < Duration::from_secs(60), "transfer did not finish (send {sdone}, recv {rdone})");
        if !sdone {
            sdone = p.test(sreq, &mut sz).unwrap();
        }
        if !rdone {
            let mut rs = [-1i32; 8];
            rdone = p.test(rreq, &mut rs).unwrap();
            if rdone {
                assert_eq!(rs[0], len as i32);
            }
        }
    }
    assert!(src == dst, "data differs after the wait");
    p.dereg_mr(s, smh).unwrap();
    p.dereg_mr(r, rmh).unwrap();
    p.close_send(s).unwrap();
    p.close_recv(r).unwrap();
    p.close_listen(l).unwrap();
}
