//! GPU memory on the verbs transport, against a real RDMA device (soft-RoCE
//! in `tests/rxe-vm/`): the dma-buf probe and the ptrSupport it leads to
//! (with the reason logged once per device), regMr of CUDA pointers and
//! regMrDmaBuf refused with that reason, and iflush over the device.
//!
//! Device tests are `#[ignore]`d with the reason, so a host run counts them as
//! ignored; the VM suite always runs them (`--include-ignored`):
//!
//! ```sh
//! VERBS_TESTS=verbs_gdr VERBS_TEST_ARGS=--nocapture tests/rxe-vm/verbs-suite.sh
//! ```
//!
//! They read `RUSTNET_TEST_DEVICE` (and `RUSTNET_TEST_DEVICE2` when set) like
//! tests/verbs.rs; under `--include-ignored` a missing device is a failure.
//! The TCP test at the end runs everywhere.
#[path = "common/ib.rs"]
mod ib;

use ib::{config, device, device2_or_first, net, pair, until};
use rustnet::for_tools::gpu::DmabufProbe;
use rustnet::for_tools::ib::{Access, IbMr, IbNet, RecvComm, SendComm};
use rustnet::for_tools::transport::{MemKind, RawBuf, RecvBuf, PTR_DMABUF, PTR_HOST};

/// Page-aligned host memory (mmap), so registrations cover exactly it.
struct Pages {
    p: *mut u8,
    len: usize,
}

impl Pages {
    fn new(len: usize) -> Pages {
        let len = len.div_ceil(4096) * 4096;
        // SAFETY: anonymous private mapping, checked below.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap {len}");
        Pages { p: p as *mut u8, len }
    }
    fn raw(&self, len: usize) -> RawBuf {
        assert!(len <= self.len);
        RawBuf { ptr: self.p, len }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: our mapping; no NIC writes it while the slice is used (checked after completions).
        unsafe { std::slice::from_raw_parts(self.p, self.len) }
    }
    fn fill(&mut self, seed: u8) {
        // SAFETY: our mapping.
        let b = unsafe { std::slice::from_raw_parts_mut(self.p, self.len) };
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8;
        }
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once, after every registration over it was dropped (tests drop MRs first).
        unsafe { libc::munmap(self.p as *mut libc::c_void, self.len) };
    }
}

fn reg(n: &IbNet, dev: usize, b: &Pages, len: usize, access: Access) -> IbMr {
    // SAFETY: the pages outlive the registration in every test.
    unsafe { n.reg_mr(dev, b.raw(len), MemKind::Host, access).expect("reg_mr") }
}

// ---------------------------------------------------------------- probe and ptrSupport

/// The dma-buf probe on the device and the ptrSupport it leads to. On rxe:
/// rdma-core's rxe provider has no reg_dmabuf_mr, so the probe is refused
/// with EOPNOTSUPP; without a CUDA driver ptrSupport is HOST with that reason.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn dmabuf_probe_and_ptr_support_on_device() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let dev = &n.devices()[idx[0]];
    let g = &dev.gdr;
    eprintln!("{}", g.describe());
    // the probe again, directly: the same answer
    assert_eq!(dev.pd.probe_dmabuf(), g.probe, "a second probe on {d} disagrees");
    let props = n.props(idx[0]).unwrap();
    assert_eq!(props.ptr_support, g.decision.ptr_support);
    assert!(!props.force_flush);
    let cuda = rustnet::for_tools::gpu::cuda::info();
    if let Some(why) = cuda.unusable_reason() {
        assert_eq!(props.ptr_support, PTR_HOST, "{}", g.describe());
        assert_eq!(g.decision.reason, format!("GDR off: {why}"));
        assert!(!g.flush(), "no GPU: no flush unless forced");
    }
    if d.starts_with("rxe") {
        match g.probe {
            DmabufProbe::Refused(e) => assert!(e == libc::EOPNOTSUPP || e == libc::EPROTONOSUPPORT, "{}", g.describe()),
            DmabufProbe::NoSymbol => panic!("libibverbs without ibv_reg_dmabuf_mr: rdma-core < 34 in the VM? {}", g.describe()),
            DmabufProbe::Supported => eprintln!("NOTE: {d} accepts dma-buf registrations (newer rxe?)"),
        }
        assert_eq!(props.ptr_support & PTR_DMABUF, 0);
    }
    assert!(rustnet::for_tools::ib::gdr::decisions().iter().any(|x| x.dev == d && x == g));
}

/// The child half of `decision_logged_at_info_once_per_device`: two IbNets
/// over the device in one process.
#[test]
#[ignore = "helper process for decision_logged_at_info_once_per_device"]
fn gdr_log_child() {
    if std::env::var("RUSTNET_GDR_LOG_CHILD").is_err() {
        return;
    }
    rustnet::for_tools::log::install();
    let d = device();
    let a = net(&[&d], &[]);
    let b = net(&[&d], &[]);
    drop((a, b));
}

#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn decision_logged_at_info_once_per_device() {
    let d = device();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "gdr_log_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("RUSTNET_GDR_LOG_CHILD", "1")
        .env("NCCL_DEBUG", "INFO")
        .output()
        .expect("spawn child");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("[rustnet INFO] GPUDirect ") && l.contains(&format!("{d}: "))).collect();
    eprintln!("{}", lines.join("\n"));
    assert_eq!(lines.len(), 1, "one INFO line for {d} from two IbNets; stderr:\n{err}");
    let l = lines[0];
    assert!(l.contains("ptrSupport=") && l.contains("dma-buf probe: ") && (l.contains("GDR off: ") || l.contains("GDR on: ")), "{l}");
}

// ---------------------------------------------------------------- registration

/// regMr of a CUDA pointer without peer memory: refused, naming the reason.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn cuda_reg_mr_refused_with_the_decision_reason() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let g = n.devices()[idx[0]].gdr.clone();
    if g.decision.ptr_support & rustnet::for_tools::transport::PTR_CUDA != 0 {
        eprintln!("NOTE: {d} supports CUDA pointers here ({}); nothing to refuse", g.describe());
        return;
    }
    let p = Pages::new(4096);
    // SAFETY: never registered (refused before ibv_reg_mr).
    let e = unsafe { n.reg_mr(idx[0], p.raw(4096), MemKind::Cuda, Access::REMOTE_WRITE) }.unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("NCCL_PTR_CUDA") && e.contains(&g.decision.reason) && e.contains(&d), "{e}");
}

/// A dma-buf file descriptor for `len` bytes of `memfd`, through
/// /dev/udmabuf when the kernel has it (the Debian 6.1 kernel of the rxe VM
/// does not: CONFIG_UDMABUF is not set).
fn udmabuf(memfd: i32, len: usize) -> Result<i32, String> {
    #[repr(C)]
    struct UdmabufCreate {
        memfd: u32,
        flags: u32,
        offset: u64,
        size: u64,
    }
    const UDMABUF_CREATE: libc::c_ulong = 0x4018_7542; // _IOW('u', 0x42, struct udmabuf_create)
    const UDMABUF_FLAGS_CLOEXEC: u32 = 1;
    // SAFETY: valid C string.
    let dev = unsafe { libc::open(c"/dev/udmabuf".as_ptr(), libc::O_RDWR) };
    if dev < 0 {
        return Err(format!("/dev/udmabuf: {}", std::io::Error::last_os_error()));
    }
    let c = UdmabufCreate { memfd: memfd as u32, flags: UDMABUF_FLAGS_CLOEXEC, offset: 0, size: len as u64 };
    // SAFETY: the ioctl reads the struct.
    let fd = unsafe { libc::ioctl(dev, UDMABUF_CREATE, &c) };
    let err = std::io::Error::last_os_error();
    // SAFETY: our descriptor.
    unsafe { libc::close(dev) };
    if fd < 0 {
        return Err(format!("UDMABUF_CREATE: {err}"));
    }
    Ok(fd)
}

/// memfd of `len` bytes, sealed against shrinking (udmabuf needs that), mapped shared.
fn memfd(len: usize) -> (i32, *mut u8) {
    // SAFETY: valid name; checked.
    let fd = unsafe { libc::memfd_create(c"rustnet-gdr".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: our descriptor.
    unsafe {
        assert_eq!(libc::ftruncate(fd, len as i64), 0);
        libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK);
    }
    // SAFETY: shared mapping of our memfd, checked.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    assert_ne!(p, libc::MAP_FAILED);
    (fd, p as *mut u8)
}

/// regMrDmaBuf: through the plugin path it is refused with the device's
/// reason when ptrSupport lacks DMABUF; the registration itself
/// (ibv_reg_dmabuf_mr, what NCCL's calls reach on a DMABUF device) agrees with
/// the probe: refused with the same errno on rxe, or, where the device and a
/// real dma-buf allow it, registered and cached by address range.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn reg_mr_dmabuf_follows_the_probe() {
    let d = device();
    let (n, idx) = net(&[&d], &[]);
    let dev = n.devices()[idx[0]].clone();
    let len = 64 << 10;
    let (mfd, va) = memfd(len);
    let (fd, real) = match udmabuf(mfd, len) {
        Ok(fd) => (fd, true),
        Err(e) => {
            eprintln!("no real dma-buf here ({e}); passing the memfd itself as the fd");
            // SAFETY: dup of our descriptor.
            (unsafe { libc::dup(mfd) }, false)
        }
    };
    let buf = RawBuf { ptr: va, len };
    // the plugin path: NCCL only calls it when ptrSupport has DMABUF
    // SAFETY: the memfd mapping outlives every registration below.
    match unsafe { n.reg_mr_dmabuf(idx[0], buf, fd, 0, Access::REMOTE_WRITE) } {
        Err(e) => {
            let e = e.to_string();
            eprintln!("regMrDmaBuf on {d}: {e}");
            assert_eq!(dev.gdr.decision.ptr_support & PTR_DMABUF, 0, "{e}");
            assert!(e.contains("NCCL_PTR_DMABUF") && e.contains(&dev.gdr.decision.reason), "{e}");
        }
        Ok(m) => {
            assert_ne!(dev.gdr.decision.ptr_support & PTR_DMABUF, 0);
            drop(m);
        }
    }
    // the registration itself
    // SAFETY: the memfd mapping behind the dma-buf outlives every registration in this test.
    let r = unsafe { dev.mrs.register_dmabuf(idx[0], va, len, fd, 0, Access::REMOTE_WRITE) };
    match (&dev.gdr.probe, r) {
        (DmabufProbe::Refused(want), Err(e)) => {
            eprintln!("ibv_reg_dmabuf_mr on {d}: {e}");
            match &e {
                rustnet::Error::Sys { op, errno } => {
                    assert_eq!(errno.0, *want, "{e}");
                    assert!(op.contains("ibv_reg_dmabuf_mr") && op.contains(&d), "{e}");
                }
                other => panic!("expected the verbs error, got {other}"),
            }
        }
        (DmabufProbe::NoSymbol, Err(e)) => assert!(e.to_string().contains("rdma-core < 34"), "{e}"),
        (DmabufProbe::Supported, Ok(m)) if real => {
            // NCCL closes the fd right after: the MR keeps the dma-buf.
            // SAFETY: our descriptor.
            unsafe { libc::close(fd) };
            let fd2 = udmabuf(mfd, len).unwrap();
            // SAFETY: the memfd mapping behind the dma-buf outlives every registration in this test.
            let again = unsafe { dev.mrs.register_dmabuf(idx[0], va, len, fd2, 0, Access::REMOTE_WRITE) }.unwrap();
            assert_eq!(again.lkey(), m.lkey(), "same range: the cached dma-buf MR is reused");
            // SAFETY: the memfd mapping behind the dma-buf outlives every registration in this test.
            let half = unsafe { dev.mrs.register_dmabuf(idx[0], va, len / 2, fd2, 0, Access::REMOTE_WRITE) }.unwrap();
            assert_ne!(half.lkey(), m.lkey(), "another range: a new registration");
            // SAFETY: our mapping, registered by address.
            let va_mr = unsafe { dev.mrs.register(idx[0], va, len, Access::REMOTE_WRITE) }.unwrap();
            assert_ne!(va_mr.lkey(), m.lkey(), "a VA registration never reuses a dma-buf one");
            // SAFETY: our descriptor.
            unsafe { libc::close(fd2) };
            eprintln!("dma-buf registration on {d}: lkey {:#x}", m.lkey());
            return finish(mfd, va, len);
        }
        (DmabufProbe::Supported, r) => eprintln!("NOTE: {d} accepts dma-buf, no real dma-buf fd here: {:?}", r.map(|m| m.lkey())),
        (p, r) => panic!("probe said {p:?} but the registration gave {:?}", r.map(|m| m.lkey())),
    }
    // SAFETY: our descriptor.
    unsafe { libc::close(fd) };
    finish(mfd, va, len);

    fn finish(mfd: i32, va: *mut u8, len: usize) {
        // SAFETY: our mapping and descriptor; no registration is left.
        unsafe {
            libc::munmap(va as *mut libc::c_void, len);
            libc::close(mfd);
        }
    }
}

// ---------------------------------------------------------------- iflush

/// Send `size` bytes and receive them into `dst`; the registrations, still
/// live (NCCL flushes before it deregisters).
fn transfer(n: &IbNet, s: &mut SendComm, r: &mut RecvComm, src: &Pages, dst: &Pages, size: usize) -> (IbMr, IbMr) {
    let smr = reg(n, s.dev(), src, size, Access::LOCAL_READ);
    let rmr = reg(n, r.dev(), dst, dst.len, n.recv_access_on(r.dev()));
    let rb = [RecvBuf { buf: dst.raw(dst.len), tag: 3 }];
    // SAFETY: buffers and registrations live until both requests complete below.
    let rid = unsafe { r.irecv(&rb, &[Some(&rmr)]) }.expect("irecv").expect("irecv slot");
    let mut rdone = None;
    let sid = until("isend accepted", || {
        if rdone.is_none() {
            rdone = r.test(rid).expect("recv test");
        }
        // SAFETY: the source buffer and its registration outlive the request: the test waits for it to finish before dropping them.
        unsafe { s.isend(src.raw(size), 3, Some(&smr)) }.expect("isend")
    });
    until("send completion", || s.test(sid).expect("send test"));
    let rc = match rdone {
        Some(c) => c,
        None => until("receive completion", || r.test(rid).expect("recv test")),
    };
    assert_eq!(rc.sizes[0], size);
    (smr, rmr)
}

/// RUSTNET_FORCE_FLUSH=1: forceFlush reported, receive registrations readable
/// by the flush QP, iflush posts the 1-byte READ of the last non-empty buffer
/// and completes, and the received data is intact. Without the knob (and no
/// GPU) iflush answers NULL; with NCCL_GDR_FLUSH_DISABLE=1 too.
#[test]
#[ignore = "needs an RDMA device: run in tests/rxe-vm (RUSTNET_TEST_DEVICE)"]
fn iflush_forced_over_device_completes_and_keeps_data() {
    let (d1, d2) = (device(), device2_or_first());
    let (n, idx) = net(&[&d1, &d2], &[("RUSTNET_FORCE_FLUSH", "1")]);
    let p = n.props(idx[1]).unwrap();
    assert!(p.force_flush, "forceFlush reported under RUSTNET_FORCE_FLUSH=1");
    assert!(n.recv_access_on(idx[1]).covers(Access::REMOTE_READ));
    eprintln!("{}", n.devices()[idx[1]].gdr.describe());
    let (mut s, mut r) = pair(&n, idx[0], idx[1]);
    for (k, size) in [1usize, 4096, (1 << 20) + 5].into_iter().enumerate() {
        let mut src = Pages::new(size);
        src.fill(k as u8);
        let dst = Pages::new(size);
        {
            let _mrs = transfer(&n, &mut s, &mut r, &src, &dst, size);
            let bufs = [RawBuf::EMPTY, dst.raw(size), RawBuf { ptr: dst.p, len: 0 }];
            // without mhandles: the registration is looked up
            let id = r.iflush(&bufs, &[]).expect("iflush").expect("a flush request when forced");
            let c = until("flush completion", || r.test(id).expect("flush test"));
            assert_eq!(c.n, 0, "a flush reports no sizes");
            assert!(r.iflush(&[RawBuf::EMPTY], &[]).unwrap().is_none(), "nothing received: nothing to flush");
        }
        assert!(dst.bytes()[..size] == src.bytes()[..size], "payload of {size} bytes differs after the flush");
    }
    drop((s, r));

    for extra in [&[][..], &[("RUSTNET_FORCE_FLUSH", "1"), ("NCCL_GDR_FLUSH_DISABLE", "1")][..]] {
        let (n, idx) = net(&[&d1, &d2], extra);
        if n.devices()[idx[1]].gdr.decision.flush {
            eprintln!("NOTE: GPUDirect on here: iflush flushes without forcing");
            continue;
        }
        assert!(!n.props(idx[1]).unwrap().force_flush);
        let (mut s, mut r) = pair(&n, idx[0], idx[1]);
        let mut src = Pages::new(4096);
        src.fill(9);
        let dst = Pages::new(4096);
        let _mrs = transfer(&n, &mut s, &mut r, &src, &dst, 4096);
        assert!(r.iflush(&[dst.raw(4096)], &[]).unwrap().is_none(), "{extra:?}: iflush must answer NULL (nothing to flush)");
        assert!(dst.bytes() == src.bytes());
    }
}

// ---------------------------------------------------------------- TCP stays host-only

/// The TCP transport reports HOST only and refuses CUDA pointers and dma-bufs
/// with errors that say so (runs on every host: loopback only).
#[test]
fn tcp_rejects_cuda_memory_with_a_clear_error() {
    use rustnet::for_tools::plugin::{select_net, Plugin};
    let cfg = config(&[("RUSTNET_TRANSPORT", "socket"), ("NCCL_SOCKET_IFNAME", "lo")]);
    let p = Plugin { net: select_net(&cfg).expect("TCP over lo"), cfg };
    assert_eq!(p.properties(0).unwrap().ptr_support, PTR_HOST);
    let mut h = [0u8; 128];
    let ctx = rustnet::for_tools::context::implicit();
    let l = p.listen(ctx, 0, &mut h).expect("listen");
    let (mut s, mut r) = (None, None);
    until("TCP connect/accept", || {
        if s.is_none() {
            s = p.connect(ctx, 0, &mut h, None).expect("connect");
        }
        if r.is_none() {
            r = p.accept(&l).expect("accept");
        }
        (s.is_some() && r.is_some()).then_some(())
    });
    let (s, r) = (s.unwrap(), r.unwrap());
    let mut b = vec![0u8; 4096];
    let buf = RawBuf { ptr: b.as_mut_ptr(), len: b.len() };
    for c in [&s, &r] {
        let e = p.reg_mr(c, buf, MemKind::Cuda).err().expect("CUDA regMr on TCP must fail").to_string();
        assert!(e.contains("host memory only") && e.contains("verbs transport"), "{e}");
        let e = p.reg_mr_dmabuf(c, buf, 0, 0).err().expect("regMrDmaBuf on TCP must fail").to_string();
        assert!(e.contains("NCCL_PTR_DMABUF") && e.contains("socket"), "{e}");
        assert!(p.reg_mr(c, buf, MemKind::Host).is_ok());
    }
}
