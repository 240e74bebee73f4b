//! The rdma_cm connection path over a real iWARP device: soft-iWARP (`siw`)
//! in the VM rig, booted with `RXE_VM_SIW=1`, which exports
//! `RXE_VM_SIW_DEVICES="siw0 siw1"` and their addresses `RXE_VM_SIW_IP0/1`:
//!
//! ```sh
//! RXE_VM_SIW=1 VERBS_TESTS=iwarp_cm flock /tmp/rxe-vm.lock tests/rxe-vm/verbs-suite.sh
//! ```
//!
//! Device tests are `#[ignore]`d (hosts have no RDMA); included without siw
//! devices they are skipped loudly with the reason, since the default rxe
//! suite boots none.
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use rustnet::transport::ib::ffi::{ibv_wc, IBV_TRANSPORT_IWARP, IBV_WC_SUCCESS};
use rustnet::transport::ib::rdmacm::{CmConn, CmListener, Progress};
use rustnet::transport::ib::verbs::{empty_wc, Access, Context, Cq, HostRegion, Lib, Pd, Qp, QpCaps, Rts, SendWr};

const DEADLINE: Duration = Duration::from_secs(30);
const LEN: usize = 1 << 16;

/// (siw0, siw1, their addresses), or None with the reason printed.
fn siw_pair() -> Option<[(String, IpAddr); 2]> {
    let devs = std::env::var("RXE_VM_SIW_DEVICES").unwrap_or_default();
    let devs: Vec<&str> = devs.split_whitespace().collect();
    let ip = |i: usize| std::env::var(format!("RXE_VM_SIW_IP{i}")).ok()?.parse::<IpAddr>().ok();
    match (devs.as_slice(), ip(0), ip(1)) {
        ([a, b, ..], Some(i0), Some(i1)) => Some([(a.to_string(), i0), (b.to_string(), i1)]),
        _ => {
            eprintln!("SKIPPED: no iWARP devices (RXE_VM_SIW_DEVICES/RXE_VM_SIW_IP0/1 unset): boot the VM with RXE_VM_SIW=1");
            None
        }
    }
}

struct Side {
    name: String,
    ip: IpAddr,
    _ctx: Context,
    pd: Pd,
    cq: Cq,
    buf: HostRegion,
}

fn open(dev: &str, ip: IpAddr) -> Side {
    let lib = Lib::get().expect("libibverbs");
    let ctx = lib
        .open_all()
        .expect("ibv_get_device_list")
        .into_iter()
        .find(|(n, _)| n == dev)
        .unwrap_or_else(|| panic!("{dev} not found"))
        .1
        .expect("open");
    assert_eq!(ctx.transport_type(), IBV_TRANSPORT_IWARP, "{dev} must report IBV_TRANSPORT_IWARP");
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 64).unwrap();
    // siw: REMOTE_WRITE needs LOCAL_WRITE (Access::REMOTE_WRITE carries both)
    let buf = HostRegion::new(&pd, LEN, Access::REMOTE_WRITE.with(Access::REMOTE_READ)).unwrap();
    Side { name: dev.into(), ip, _ctx: ctx, pd, cq, buf }
}

impl Side {
    fn qp(&self) -> Qp<rustnet::transport::ib::verbs::Init> {
        let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_inline: 64 };
        Qp::create(&self.pd, &self.cq, caps, 1, 0, Access::REMOTE_WRITE.with(Access::REMOTE_READ)).unwrap()
    }

    /// (address, rkey) of our buffer, as private data.
    fn key(&self) -> Vec<u8> {
        let mut v = (self.buf.addr() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(&self.buf.rkey().to_le_bytes());
        v
    }

    fn wait_completion(&self, what: &str) {
        let t = Instant::now();
        let mut wc: [ibv_wc; 1] = [empty_wc()];
        loop {
            if self.cq.poll(&mut wc).unwrap() == 1 {
                assert_eq!(wc[0].status, IBV_WC_SUCCESS, "{}: {what} completed with status {}", self.name, wc[0].status);
                return;
            }
            assert!(t.elapsed() < DEADLINE, "{}: no completion for {what}", self.name);
            std::thread::yield_now();
        }
    }

    fn wait_bytes(&self, off: usize, want: &[u8], what: &str) {
        let t = Instant::now();
        let mut got = vec![0u8; want.len()];
        loop {
            self.buf.read(off, &mut got);
            if got == want {
                return;
            }
            assert!(t.elapsed() < DEADLINE, "{}: {what} never arrived", self.name);
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn remote_key(p: &[u8]) -> (u64, u32) {
    assert_eq!(p.len(), 12, "private data {p:?}");
    (u64::from_le_bytes(p[..8].try_into().unwrap()), u32::from_le_bytes(p[8..12].try_into().unwrap()))
}

fn write(qp: &Qp<Rts>, from: &Side, off: usize, len: usize, remote: (u64, u32), roff: usize) {
    let wr = SendWr {
        wr_id: 1,
        local: (from.buf.addr() as u64 + off as u64, len as u32, from.buf.lkey()),
        remote: (remote.0 + roff as u64, remote.1),
        imm: None,
        signaled: true,
        inline: false,
    };
    // SAFETY: the range lies in `from.buf`, registered on the QP's PD, which
    // outlives the completion we wait for.
    unsafe { qp.post_writes(&[wr]) }.expect("post RDMA WRITE");
    from.wait_completion("RDMA WRITE");
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Listener on siw1's address, connect from siw0's: private data carries
/// each side's buffer key both ways; then the passive side writes first
/// (iWARP's MPA lets the responder send only after the initiator's first
/// frame, which siw's RTR exchange provides), the active side writes 64 KiB
/// back and reads it again. Every poll returns at once.
#[test]
#[ignore = "needs iWARP devices: soft-iWARP in tests/rxe-vm with RXE_VM_SIW=1"]
fn rdma_cm_connects_and_both_sides_write() {
    let Some([(d0, ip0), (d1, ip1)]) = siw_pair() else { return };
    let (a, b) = (open(&d0, ip0), open(&d1, ip1));
    let listener = CmListener::new(b.ip).expect("listen");
    let at = listener.addr();
    assert_eq!(at.ip(), b.ip);
    assert_ne!(at.port(), 0, "the listen handle needs a real port");
    eprintln!("listening on {at} ({:?})", listener.device_name());
    let mut conn = CmConn::start(a.ip, at, "test peer siw1").expect("start");
    let (qa, qb) = (a.qp(), b.qp());
    let (qa_num, qb_num) = (qa.qpn(), qb.qpn());
    let (mut qa, mut qb) = (Some(qa), Some(qb));
    let mut passive: Option<CmConn> = None;
    let (mut key_at_a, mut key_at_b) = (None, None);
    let (mut est_a, mut est_b) = (false, false);
    let t = Instant::now();
    let mut slowest = Duration::ZERO;
    while !(est_a && est_b) {
        assert!(t.elapsed() < DEADLINE, "not connected after {DEADLINE:?}: active {est_a}, passive {est_b}");
        let p0 = Instant::now();
        if !est_a {
            match conn.poll().expect("active side") {
                Progress::Pending => {}
                Progress::NeedQp => {
                    assert_eq!(conn.device_name().as_deref(), Some(a.name.as_str()), "rdma_cm chose another device");
                    conn.connect(qa_num, &a.key()).expect("connect");
                }
                Progress::Established(p) => {
                    key_at_a = Some(remote_key(&p));
                    est_a = true;
                }
            }
        }
        match passive.as_mut() {
            None => {
                if let Some(req) = listener.poll().expect("listener") {
                    assert_eq!(req.device_name().as_deref(), Some(b.name.as_str()), "request arrived on another device");
                    key_at_b = Some(remote_key(&req.private));
                    passive = Some(req.accept(qb_num, &b.key(), "test peer siw0").expect("accept"));
                }
            }
            Some(p) if !est_b => match p.poll().expect("passive side") {
                Progress::Established(_) => est_b = true,
                Progress::Pending => {}
                Progress::NeedQp => panic!("the passive side never needs a QP from poll"),
            },
            Some(_) => {}
        }
        slowest = slowest.max(p0.elapsed());
        std::thread::sleep(Duration::from_millis(1));
    }
    eprintln!("connected in {:?}; slowest poll round {slowest:?}", t.elapsed());
    assert!(slowest < Duration::from_secs(2), "a poll round took {slowest:?}: something blocked");
    let (qa, qb) = (qa.take().unwrap().connected_by_cm(), qb.take().unwrap().connected_by_cm());
    // what each side learnt: a holds b's buffer key, b holds a's
    let (b_buf, a_buf) = (key_at_a.unwrap(), key_at_b.unwrap());

    // the passive side first (before the active side sent anything): 4 KiB into a's buffer at offset 0
    let p1 = pattern(7, 4096);
    b.buf.write(LEN - 4096, &p1);
    write(&qb, &b, LEN - 4096, p1.len(), a_buf, 0);
    a.wait_bytes(0, &p1, "passive -> active WRITE");
    // then the active side: 64 KiB into b's buffer
    let p2 = pattern(99, LEN);
    a.buf.write(0, &p2);
    write(&qa, &a, 0, LEN, b_buf, 0);
    b.wait_bytes(0, &p2, "active -> passive WRITE");
    // and a READ back of b's last 4 KiB (p2's tail) into a's second 4 KiB
    a.buf.write(4096, &[0u8; 4096]);
    // SAFETY: a's buffer is registered with local write on qa's PD and
    // outlives the completion we wait for; b's range is readable under its key.
    unsafe { qa.post_read(2, (a.buf.addr() as u64 + 4096, 4096, a.buf.lkey()), (b_buf.0 + (LEN - 4096) as u64, b_buf.1)) }
        .expect("post READ");
    a.wait_completion("RDMA READ");
    a.wait_bytes(4096, &p2[LEN - 4096..], "READ");
    eprintln!("passive->active WRITE 4 KiB, active->passive WRITE 64 KiB, READ 4 KiB: all bytes checked");
    drop(passive);
    drop(conn);
}

/// Connecting to a port nobody listens on fails through poll, naming the
/// peer and its address, without any call blocking.
#[test]
#[ignore = "needs iWARP devices: soft-iWARP in tests/rxe-vm with RXE_VM_SIW=1"]
fn rdma_cm_connect_to_nobody_fails_naming_the_peer() {
    let Some([(d0, ip0), (_, ip1)]) = siw_pair() else { return };
    let a = open(&d0, ip0);
    // a port that was just free: bind a listener, note its port, close it
    let port = CmListener::new(ip1).expect("listen").addr().port();
    let to = SocketAddr::new(ip1, port);
    let mut conn = CmConn::start(a.ip, to, "rank 7").expect("start");
    let qp = a.qp();
    let t = Instant::now();
    let err = loop {
        assert!(t.elapsed() < DEADLINE, "no failure after {DEADLINE:?}");
        let p0 = Instant::now();
        let r = conn.poll();
        assert!(p0.elapsed() < Duration::from_secs(2), "poll blocked for {:?}", p0.elapsed());
        match r {
            // siw connects its TCP stream inside rdma_connect, so a refusal
            // can come from there as well as from a later event
            Ok(Progress::NeedQp) => match conn.connect(qp.qpn(), b"hello") {
                Ok(()) => {}
                Err(e) => break e.to_string(),
            },
            Ok(Progress::Established(_)) => panic!("connected to {to}, where nobody listens"),
            Ok(Progress::Pending) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => break e.to_string(),
        }
    };
    eprintln!("error: {err}");
    assert!(err.contains("rank 7") && err.contains(&to.to_string()), "the error must name the peer: {err}");
}
