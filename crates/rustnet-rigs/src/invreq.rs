//! A plain-verbs reproducer for soft-RoCE's "invalid request"
//! (`IBV_WC_REM_INV_REQ_ERR`, status 9), which twice ended a librustnet
//! bandwidth run in the VM with no loss configured (docs/resilience.md).
//! No plugin, no NCCL, no protocol: the traffic pattern alone, so that if
//! it fails here, the cause is not librustnet's.
//!
//! Two RC connections between two devices (default rxe0 and rxe1), one each
//! way, both at once. On each, the sender keeps INVREQ_DEPTH (8)
//! `RDMA_WRITE_WITH_IMM`s of INVREQ_MSG (64 KiB) in flight, each signaled,
//! into a ring of receive buffers; the receiver keeps receives posted and,
//! for every message, writes 8 bytes back on the same QP (NCCL's CTS, one
//! in 16 signaled; INVREQ_CTS=0 leaves them out). Sender and receiver of a
//! connection run on threads of their own, so rxe's requester runs on
//! whichever vCPU posts or takes an acknowledgement, as under the plugin.
//!
//! Runs INVREQ_SECONDS (600), then prints `INVREQ ok messages=N secs=S`;
//! the first completion that is not a success ends it with `INVREQ failed`,
//! the status, which end, which message and the rxe counters (exit 1).
//! In the VM: `tests/rxe-vm/run.sh target/release/rustnet-invreq`.
//! Knobs: INVREQ_DEVS ("rxe0,rxe1"), NCCL_IB_TIMEOUT (14), NCCL_IB_RETRY_CNT (7).
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustnet::for_tools::ib::ffi::ibv_wc;
use rustnet::for_tools::ib::verbs::{
    empty_wc, Access, Context, Cq, HostRegion, Init, Lib, Pd, Qp, QpCaps, RtrParams, Rts, RtsParams, SendWr,
};

fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(d)
}

/// The first RoCE v2 GID with an IPv4-mapped address on port 1.
fn v2_gid(ctx: &Context) -> (u8, [u8; 16]) {
    for i in 0..16u32 {
        let Ok(g) = ctx.query_gid(1, i) else { continue };
        let ty = std::fs::read_to_string(format!("/sys/class/infiniband/{}/ports/1/gid_attrs/types/{i}", ctx.name())).unwrap_or_default();
        if g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff && ty.contains("v2") {
            return (i as u8, g);
        }
    }
    panic!("{}: no RoCE v2 IPv4 GID on port 1", ctx.name());
}

struct End {
    pd: Pd,
    cq: Cq,
    qp: Qp<Init>,
    gid: (u8, [u8; 16]),
    mtu: u32,
}

fn end(ctx: &Context) -> End {
    let pd = Pd::new(ctx).expect("pd");
    let cq = Cq::new(ctx, 1024).expect("cq");
    let caps = QpCaps { max_send_wr: 128, max_recv_wr: 512, max_inline: 0 };
    let qp = Qp::<Init>::create(&pd, &cq, caps, 1, 0, Access::REMOTE_WRITE).expect("qp");
    let mtu = ctx.query_port(1).expect("port").active_mtu;
    End { gid: v2_gid(ctx), pd, cq, qp, mtu }
}

/// `me`'s QP to RTS toward the QP `qpn` at `gid` (path MTU the smaller).
fn rts(me: Qp<Init>, my_gid: u8, my_mtu: u32, qpn: u32, gid: [u8; 16], mtu: u32) -> Qp<Rts> {
    let rtr =
        RtrParams { dest_qpn: qpn, mtu: my_mtu.min(mtu), port: 1, global: true, dgid: gid, sgid_index: my_gid, dlid: 0, tc: 0, sl: 0 };
    let rts = RtsParams { timeout: env_u64("NCCL_IB_TIMEOUT", 14) as u8, retry_cnt: env_u64("NCCL_IB_RETRY_CNT", 7) as u8 };
    me.to_rtr(&rtr).expect("rtr").to_rts(&rts).expect("rts")
}

/// The traffic's shape, the same for both connections.
#[derive(Clone, Copy)]
struct Shape {
    msg: usize,
    depth: usize,
    cts: bool,
    until: Instant,
}

static STOP: AtomicBool = AtomicBool::new(false);

fn fail(who: &str, msg: u64, wc: &ibv_wc) -> ! {
    STOP.store(true, Ordering::SeqCst);
    let why = Lib::get().map(|l| l.wc_status_str(wc.status)).unwrap_or_default();
    println!(
        "INVREQ failed: {who}: message #{msg}: status {} ({why}), opcode {}, vendor_err {:#x}, qp {:#x}",
        wc.status, wc.opcode, wc.vendor_err, wc.qp_num
    );
    for d in std::env::var("INVREQ_DEVS").unwrap_or_else(|_| "rxe0,rxe1".into()).split(',') {
        let dir = format!("/sys/class/infiniband/{d}/ports/1/hw_counters");
        let mut line = String::new();
        for k in ["out_of_seq_request", "duplicate_request", "completer_retry_err", "rcvd_seq_err", "rcvd_rnr_err", "send_rnr_err"] {
            if let Ok(v) = std::fs::read_to_string(format!("{dir}/{k}")) {
                line += &format!(" {k}={}", v.trim());
            }
        }
        println!("  {d}:{line}");
    }
    std::process::exit(1);
}

/// The writing end of one connection.
fn sender(name: String, qp: Qp<Rts>, cq: Cq, src: HostRegion, dst: (u64, u32), sh: Shape, done: Arc<AtomicU64>) {
    let (msg, depth, until) = (sh.msg, sh.depth, sh.until);
    let mut wcs = [empty_wc(); 16];
    let (mut posted, mut completed) = (0u64, 0u64);
    while !STOP.load(Ordering::Relaxed) {
        let more = Instant::now() < until;
        while more && posted - completed < depth as u64 {
            let slot = (posted % depth as u64) as usize;
            let wr = SendWr {
                wr_id: posted,
                local: (src.addr() as u64 + (slot * msg) as u64, msg as u32, src.lkey()),
                remote: (dst.0 + (slot * msg) as u64, dst.1),
                imm: Some(posted as u32),
                signaled: true,
                inline: false,
            };
            // SAFETY: the source slot lies in `src` (registered on this QP's
            // PD, alive for the whole run) and is not written while in
            // flight; the remote slot is the peer's receive ring under its rkey.
            unsafe { qp.post_writes(&[wr]) }.expect("post write");
            posted += 1;
        }
        if !more && completed == posted {
            break;
        }
        let n = cq.poll(&mut wcs).expect("poll");
        for wc in &wcs[..n] {
            if wc.status != 0 {
                fail(&format!("{name} sender"), wc.wr_id, wc);
            }
            // (the receiver's small writes back complete on the receiver's CQ)
            completed += 1;
        }
    }
    done.fetch_add(completed, Ordering::Relaxed);
}

/// The receiving end: receives kept posted, an 8-byte write back per message.
fn receiver(name: String, qp: Qp<Rts>, cq: Cq, stage: HostRegion, back: (u64, u32), sh: Shape) {
    let (cts, depth, until) = (sh.cts, sh.depth, sh.until);
    const RQ: u64 = 256;
    for i in 0..RQ {
        qp.post_recv_empty(i).expect("post recv");
    }
    let mut wcs = [empty_wc(); 16];
    let (mut got, mut ctl) = (0u64, 0u64);
    let quiet = until + Duration::from_secs(5);
    while !STOP.load(Ordering::Relaxed) && Instant::now() < quiet {
        let n = cq.poll(&mut wcs).expect("poll");
        for wc in &wcs[..n] {
            if wc.status != 0 {
                fail(&format!("{name} receiver"), if wc.wr_id >> 63 == 1 { wc.wr_id & !(1 << 63) } else { got }, wc);
            }
            if wc.wr_id >> 63 == 1 {
                continue; // a write back completed
            }
            got += 1;
            qp.post_recv_empty(got + RQ).expect("post recv");
            if cts {
                let slot = (got % depth as u64) as usize;
                let wr = SendWr {
                    wr_id: 1 << 63 | got,
                    local: (stage.addr() as u64 + (slot * 8) as u64, 8, stage.lkey()),
                    remote: (back.0 + (slot * 8) as u64, back.1),
                    imm: None,
                    signaled: ctl % 16 == 15,
                    inline: false,
                };
                // SAFETY: the 8 source bytes lie in `stage`, registered on
                // this QP's PD for the whole run; the target is the peer's
                // registered CTS area under its rkey.
                unsafe { qp.post_writes(&[wr]) }.expect("post write back");
                ctl += 1;
            }
        }
    }
}

fn main() {
    let lib = Lib::get().unwrap_or_else(|e| panic!("libibverbs: {e}"));
    let names: Vec<String> = std::env::var("INVREQ_DEVS").unwrap_or_else(|_| "rxe0,rxe1".into()).split(',').map(str::to_string).collect();
    let all = lib.open_all().expect("devices");
    let ctx = |n: &str| {
        all.iter().find(|(name, _)| name == n).and_then(|(_, c)| c.as_ref().ok()).cloned().unwrap_or_else(|| panic!("no device {n}"))
    };
    let (c0, c1) = (ctx(&names[0]), ctx(&names[1]));
    let msg = env_u64("INVREQ_MSG", 65536) as usize;
    let depth = env_u64("INVREQ_DEPTH", 8) as usize;
    let cts = env_u64("INVREQ_CTS", 1) == 1;
    let secs = env_u64("INVREQ_SECONDS", 600);
    let until = Instant::now() + Duration::from_secs(secs);
    let sh = Shape { msg, depth, cts, until };
    let done = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut threads = Vec::new();
    for (from, to) in [(&c0, &c1), (&c1, &c0)] {
        let name = format!("{}->{}", from.name(), to.name());
        let (a, b) = (end(from), end(to));
        let src = HostRegion::new(&a.pd, depth * msg, Access::LOCAL_WRITE).expect("source");
        let ring = HostRegion::new(&b.pd, depth * msg, Access::REMOTE_WRITE).expect("receive ring");
        let cts_area = HostRegion::new(&a.pd, depth * 8, Access::REMOTE_WRITE).expect("cts area");
        let stage = HostRegion::new(&b.pd, depth * 8, Access::LOCAL_WRITE).expect("cts staging");
        let (ring_at, cts_at) = ((ring.addr() as u64, ring.rkey()), (cts_area.addr() as u64, cts_area.rkey()));
        let (aq, bq) = (a.qp.qpn(), b.qp.qpn());
        let sq = rts(a.qp, a.gid.0, a.mtu, bq, b.gid.1, b.mtu);
        let rq = rts(b.qp, b.gid.0, b.mtu, aq, a.gid.1, a.mtu);
        let (scq, rcq, d, n1, n2) = (a.cq, b.cq, done.clone(), name.clone(), name);
        threads.push(std::thread::spawn(move || {
            let _keep = cts_area;
            sender(n1, sq, scq, src, ring_at, sh, d)
        }));
        threads.push(std::thread::spawn(move || {
            let _keep = ring;
            receiver(n2, rq, rcq, stage, cts_at, sh)
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    println!(
        "INVREQ ok messages={} secs={:.1} msg={msg} depth={depth} cts={cts}",
        done.load(Ordering::Relaxed),
        t0.elapsed().as_secs_f64()
    );
}
