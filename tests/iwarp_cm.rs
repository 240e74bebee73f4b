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

use rustnet::for_tools::ib::ffi::{ibv_wc, IBV_TRANSPORT_IWARP, IBV_WC_RECV, IBV_WC_SUCCESS};
use rustnet::for_tools::ib::rdmacm::{CmConn, CmListener, Progress};
use rustnet::for_tools::ib::verbs::{empty_wc, Access, Context, Cq, HostRegion, Lib, Pd, Qp, QpCaps, Rts, SendWr};
use rustnet::proto::fifo::{sizes_from_imm, ImmKind, FIFO_DEPTH};
use rustnet::proto::notice::{self, Assembler, Notice, RecvRing, NOTICE_BYTES, RECV_DEPTH};

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
    let cq = Cq::new(&ctx, 256).unwrap();
    // siw: REMOTE_WRITE needs LOCAL_WRITE (Access::REMOTE_WRITE carries both)
    let buf = HostRegion::new(&pd, LEN, Access::REMOTE_WRITE.with(Access::REMOTE_READ)).unwrap();
    Side { name: dev.into(), ip, _ctx: ctx, pd, cq, buf }
}

impl Side {
    fn qp(&self) -> Qp<rustnet::for_tools::ib::verbs::Init> {
        let caps = QpCaps { max_send_wr: 128, max_recv_wr: RECV_DEPTH as u32 + 8, max_inline: 64 };
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

/// An established rdma_cm connection a -> b and what each side learnt.
struct Link {
    /// a's QP (active side) and b's (passive side).
    qa: Qp<Rts>,
    qb: Qp<Rts>,
    /// b's buffer key as a learnt it, and a's as b learnt it.
    b_buf: (u64, u32),
    a_buf: (u64, u32),
    _conns: (CmConn, CmConn, CmListener),
}

/// Listener on b's address, connect from a's, polling both sides until
/// established; asserts no poll round blocks.
fn connect_pair(a: &Side, b: &Side) -> Link {
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
                    assert!(conn.connect(qa_num, &a.key()).expect("connect"), "rdma_connect: the local port was taken (EADDRINUSE)");
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
    Link { qa, qb, b_buf, a_buf, _conns: (conn, passive.unwrap(), listener) }
}

/// Listener on siw1's address, connect from siw0's: private data carries
/// each side's buffer key both ways; then the passive side writes first
/// (before the active side sent anything), the active side writes 64 KiB
/// back and reads it again. Every poll returns at once.
#[test]
#[ignore = "needs iWARP devices: soft-iWARP in tests/rxe-vm with RXE_VM_SIW=1"]
fn rdma_cm_connects_and_both_sides_write() {
    let Some([(d0, ip0), (d1, ip1)]) = siw_pair() else { return };
    let (a, b) = (open(&d0, ip0), open(&d1, ip1));
    let Link { qa, qb, b_buf, a_buf, _conns } = connect_pair(&a, &b);

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
                Ok(true) => {}
                Ok(false) => panic!("rdma_connect: the local port was taken (EADDRINUSE)"),
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

/// The iWARP data path's notice rules (crates/rustnet-proto/src/notice.rs) over siw, driven by
/// hand: b keeps RECV_DEPTH receives posted (RecvRing), advertises 32
/// receives at a time, a sends all 32 back to back -- per message its RDMA
/// WRITEs, then an inline SEND notice, no immediates anywhere -- and b
/// completes each receive from its notice alone: exact sizes (zero bytes
/// and grouped receives included) and the bytes in place when the notice
/// lands. Four rounds, so every FIFO slot and ring slot is reused.
#[test]
#[ignore = "needs iWARP devices: soft-iWARP in tests/rxe-vm with RXE_VM_SIW=1"]
fn notices_complete_receives_without_immediates() {
    let Some([(d0, ip0), (d1, ip1)]) = siw_pair() else { return };
    let (a, b) = (open(&d0, ip0), open(&d1, ip1));
    let Link { qa, qb, b_buf, _conns, .. } = connect_pair(&a, &b);
    let area = HostRegion::new(&b.pd, RECV_DEPTH * NOTICE_BYTES, Access::LOCAL_WRITE).unwrap();
    let mut ring = RecvRing::new();
    let repost = |ring: &mut RecvRing| {
        let ids = ring.to_post();
        for id in ids.clone() {
            let local = (area.addr() as u64 + RecvRing::slot(id) as u64, NOTICE_BYTES as u32, area.lkey());
            // SAFETY: the slot lies in `area`, registered with local write on
            // qb's PD; `area` outlives the QP's use in this test.
            unsafe { qb.post_recv(id, local) }.expect("post receive");
        }
        ring.posted(ids.end);
    };
    repost(&mut ring);
    let mut asm = Assembler::new();
    let per = LEN / FIFO_DEPTH; // bytes of b's buffer per FIFO slot
    let sizes_of = |seq: u64| -> Vec<usize> {
        // every 5th receive is a group of 2 (halves of its slot's region)
        let pick = [0usize, 1, 7, 128, 1000, per / 2][(seq * 7 % 6) as usize];
        if seq % 5 == 4 {
            vec![pick.min(per / 2), (per / 2).saturating_sub(pick)]
        } else {
            vec![[pick, per][(seq % 2) as usize]]
        }
    };
    let caps_of = |seq: u64| -> Vec<usize> {
        if seq % 5 == 4 {
            vec![per / 2, per / 2]
        } else {
            vec![per]
        }
    };
    let data_of = |seq: u64, i: usize, len: usize| -> Vec<u8> { (0..len).map(|k| (k as u64 * 13 + seq * 7 + i as u64) as u8).collect() };
    let (mut zero, mut groups) = (0, 0);
    let t = Instant::now();
    for round in 0..4u64 {
        let base = round * FIFO_DEPTH as u64;
        // receiver: 32 receives advertised (the CTS an IB receiver would write)
        for k in 0..FIFO_DEPTH {
            assert!(ring.may_advertise(k + 1), "receive {} advertised with too few receives posted", base + k as u64);
            asm.expect(base + k as u64, 1).unwrap();
        }
        // sender: 32 messages back to back
        let mut signaled = 0;
        for seq in base..base + FIFO_DEPTH as u64 {
            let slot_off = (seq % FIFO_DEPTH as u64) as usize * per;
            let sizes = sizes_of(seq);
            let mut off = slot_off;
            for (i, &len) in sizes.iter().enumerate() {
                let d = data_of(seq, i, len);
                if len > 0 {
                    a.buf.write(off, &d);
                    write_nowait(&qa, &a, off, len, b_buf, off);
                    signaled += 1;
                }
                zero += (len == 0) as usize;
                off += caps_of(seq)[i];
            }
            let kind = if sizes.len() == 1 { ImmKind::Size(sizes[0] as u32) } else { ImmKind::Sizes(sizes.len() as u8) };
            groups += (sizes.len() > 1) as usize;
            let s32: Vec<u32> = sizes.iter().map(|&x| x as u32).collect();
            for (_, n) in notice::plan(seq, 0, 1, kind, &s32) {
                let (bytes, len) = n.encode();
                qa.post_send_inline(1000 + seq, &bytes[..len], true).expect("post notice SEND");
                signaled += 1;
            }
        }
        // receiver: each notice completes its receive
        let mut got = 0;
        let mut wc: [ibv_wc; 8] = [empty_wc(); 8];
        while got < FIFO_DEPTH {
            assert!(t.elapsed() < DEADLINE, "round {round}: {got} of {FIFO_DEPTH} notices after {DEADLINE:?}");
            let n = b.cq.poll(&mut wc).unwrap();
            for w in &wc[..n] {
                assert_eq!(w.status, IBV_WC_SUCCESS, "receive completion status {}", w.status);
                assert_eq!(w.opcode, IBV_WC_RECV);
                let off = ring.take(w.wr_id).unwrap();
                let mut bytes = vec![0u8; w.byte_len as usize];
                area.read(off, &mut bytes);
                repost(&mut ring);
                let first = asm.on_notice(Notice::decode(&bytes).unwrap()).unwrap().expect("one lane: complete at once");
                let seq = base + first.imm.slot as u64;
                let caps = caps_of(seq);
                let got_sizes = sizes_from_imm(first.imm.kind, &caps, || first.sizes).unwrap();
                let mut boff = (seq % FIFO_DEPTH as u64) as usize * per;
                for (i, &want) in sizes_of(seq).iter().enumerate() {
                    assert_eq!(got_sizes[i], Some(want), "receive {seq} buffer {i}: exact size");
                    let have = read_any(&b.buf, boff, want);
                    assert!(have == data_of(seq, i, want), "receive {seq} buffer {i}: bytes not in place when its notice landed");
                    boff += caps[i];
                }
                got += 1;
            }
        }
        // sender: drain its completions (writes and notices, all signaled)
        let mut done = 0;
        while done < signaled {
            assert!(t.elapsed() < DEADLINE, "sender completions: {done} of {signaled}");
            let n = a.cq.poll(&mut wc).unwrap();
            for w in &wc[..n] {
                assert_eq!(w.status, IBV_WC_SUCCESS, "sender completion status {}", w.status);
            }
            done += n;
        }
    }
    eprintln!("128 receives completed by SEND notices ({zero} zero-byte buffers, {groups} groups of 2) in {:?}", t.elapsed());
    assert!(zero > 0 && groups > 0);
}

/// One signaled RDMA WRITE, not waited for.
fn write_nowait(qp: &Qp<Rts>, from: &Side, off: usize, len: usize, remote: (u64, u32), roff: usize) {
    let wr = SendWr {
        wr_id: 1,
        local: (from.buf.addr() as u64 + off as u64, len as u32, from.buf.lkey()),
        remote: (remote.0 + roff as u64, remote.1),
        imm: None,
        signaled: true,
        inline: false,
    };
    // SAFETY: the range lies in `from.buf`, registered on the QP's PD; the
    // test drains the completions before the buffer is touched again.
    unsafe { qp.post_writes(&[wr]) }.expect("post RDMA WRITE");
}

/// `len` bytes at `off` of a region (HostRegion::read takes 8-byte units).
fn read_any(r: &HostRegion, off: usize, len: usize) -> Vec<u8> {
    let start = off / 8 * 8;
    let end = ((off + len).div_ceil(8) * 8).min(r.len());
    let mut w = vec![0u8; end - start];
    r.read(start, &mut w);
    w[off - start..off - start + len].to_vec()
}
