//! A baseline for `rustnet bench step|ring`: NCCL's own socket transport
//! (`src/transport/net_socket.cc`, NCCL 2.2x) re-implemented from what its
//! source does, so the plugin can be compared with it under the same driver.
//! Our code, written from the facts in docs/tcp-performance.md:
//!
//! - a comm is one control socket plus `nsocks` data sockets;
//! - `isend`/`irecv` only take one of 32 request slots (no I/O);
//! - `test` on a request first moves its 4-byte size header on the control
//!   socket (the sender sends header + payloads <= 128 bytes in one `send`;
//!   the receiver reads exactly 4 bytes, then the inline bytes with a second
//!   `recv`), and returns "not done" if nothing of the header moved;
//! - with no helper threads, every later `test` does at most one `send`/`recv`
//!   of the payload, straight from/into the caller's buffer, on the control
//!   socket;
//! - with helper threads, the payload is cut into tasks of
//!   `max(64 KiB, ceil(rest / nsocks))`, handed out round-robin over the
//!   data sockets (socket k belongs to thread k % nthreads); each thread
//!   sweeps its queue in groups of `nsocks / nthreads` tasks, spinning on a
//!   group until it is done, and sleeps on a condition variable when it
//!   finds nothing to do. `test` only looks at the tasks' offsets.
//!
//! Every transfer is one `send(MSG_DONTWAIT|MSG_NOSIGNAL)` or
//! `recv(MSG_DONTWAIT)`: NCCL's sockets are asynchronous, so
//! `ncclSocketProgress` makes one call per invocation.
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// NCCL_NET_MAX_REQUESTS.
const MAX_REQUESTS: usize = 32;
/// NCCL_SOCKET_INLINE default.
const INLINE: usize = 128;
/// NCCL_SOCKET_MIN_TASKSIZE default.
const MIN_TASK: usize = 64 << 10;
/// SOCKET_CTRL_SIZE: the size header is an int.
const CTRL: usize = 4;
/// MAX_SOCKETS.
pub const MAX_SOCKETS: usize = 64;

/// One non-blocking transfer as ncclSocketProgress does it: a single
/// system call; `Ok(n)` bytes moved (0 when it would block).
fn progress_once(send: bool, fd: i32, ptr: *mut u8, len: usize) -> Result<usize, String> {
    // SAFETY: ptr..ptr+len is a live buffer of the caller (a request's data
    // or header area, valid until its request completes).
    let r = unsafe {
        if send {
            libc::send(fd, ptr as *const libc::c_void, len, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        } else {
            libc::recv(fd, ptr as *mut libc::c_void, len, libc::MSG_DONTWAIT)
        }
    };
    if r > 0 {
        return Ok(r as usize);
    }
    if r == 0 && !send && len > 0 {
        return Err("nccl-socket: connection closed by the peer".into());
    }
    if r == 0 {
        return Ok(0);
    }
    // EINTR and EAGAIN move nothing, as in NCCL
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINTR) | Some(libc::EAGAIN) => Ok(0),
        _ => Err(format!("nccl-socket: {} failed: {e}", if send { "send" } else { "recv" })),
    }
}

struct Task {
    used: AtomicBool,
    send: AtomicBool,
    data: AtomicUsize,
    size: AtomicUsize,
    offset: AtomicUsize,
    fd: AtomicUsize,
    failed: AtomicBool,
}

struct ThreadRes {
    tasks: Box<[Task]>,
    next: AtomicUsize,
    stop: AtomicBool,
    mutex: Mutex<()>,
    cond: Condvar,
    per_thread: usize,
}

fn helper(res: Arc<ThreadRes>) {
    let len = res.tasks.len();
    loop {
        let mut idle = true;
        let mark = res.next.load(Ordering::Acquire);
        let mut i = 0;
        while i < len {
            loop {
                let mut repeat = false;
                for j in 0..res.per_thread {
                    let t = &res.tasks[i + j];
                    if !t.used.load(Ordering::Acquire) {
                        continue;
                    }
                    let (off, size) = (t.offset.load(Ordering::Relaxed), t.size.load(Ordering::Relaxed));
                    if off >= size {
                        continue;
                    }
                    let ptr = t.data.load(Ordering::Relaxed) as *mut u8;
                    // SAFETY: off < size: inside the task's piece of the request buffer.
                    let p = unsafe { ptr.add(off) };
                    match progress_once(t.send.load(Ordering::Relaxed), t.fd.load(Ordering::Relaxed) as i32, p, size - off) {
                        Ok(n) => {
                            t.offset.store(off + n, Ordering::Release);
                            if off + n < size {
                                repeat = true;
                            }
                        }
                        Err(_) => {
                            t.failed.store(true, Ordering::Release);
                            return;
                        }
                    }
                    idle = false;
                }
                if !repeat {
                    break;
                }
            }
            i += res.per_thread;
        }
        if idle {
            let mut g = res.mutex.lock().unwrap();
            while mark == res.next.load(Ordering::Acquire) && !res.stop.load(Ordering::Acquire) {
                g = res.cond.wait(g).unwrap();
            }
        }
        if res.stop.load(Ordering::Acquire) {
            return;
        }
    }
}

#[derive(Clone, Copy)]
struct Request {
    /// 0 free, 1 size not yet exchanged, 2 payload phase.
    used: u8,
    data: *mut u8,
    size: usize,
    offset: usize,
    nsubs: usize,
    /// (thread, slot) of each task.
    subs: [(u8, u16); MAX_SOCKETS],
}

/// One send or receive comm of the NCCL socket algorithm.
pub struct Comm {
    send: bool,
    ctrl: TcpStream,
    socks: Vec<TcpStream>,
    nthreads: usize,
    next_sock: usize,
    reqs: [Request; MAX_REQUESTS],
    inline: [[u8; CTRL + INLINE]; MAX_REQUESTS],
    threads: Vec<(Arc<ThreadRes>, Option<JoinHandle<()>>)>,
}

// SAFETY: raw pointers are caller buffers valid until their request
// completes; the comm is used from one thread at a time.
unsafe impl Send for Comm {}

fn inline_size(n: usize) -> usize {
    if n <= INLINE {
        n
    } else {
        0
    }
}

impl Comm {
    fn new(send: bool, ctrl: TcpStream, socks: Vec<TcpStream>, nthreads: usize) -> Comm {
        let nsocks = socks.len();
        let nthreads = if nsocks == 0 { 0 } else { nthreads.max(1) };
        let threads = (0..nthreads)
            .map(|_| {
                let per = nsocks / nthreads;
                let len = MAX_REQUESTS * nsocks.div_ceil(nthreads);
                let tasks = (0..len)
                    .map(|_| Task {
                        used: AtomicBool::new(false),
                        send: AtomicBool::new(send),
                        data: AtomicUsize::new(0),
                        size: AtomicUsize::new(0),
                        offset: AtomicUsize::new(0),
                        fd: AtomicUsize::new(0),
                        failed: AtomicBool::new(false),
                    })
                    .collect();
                let res = Arc::new(ThreadRes {
                    tasks,
                    next: AtomicUsize::new(0),
                    stop: AtomicBool::new(false),
                    mutex: Mutex::new(()),
                    cond: Condvar::new(),
                    per_thread: per.max(1),
                });
                (res, None)
            })
            .collect();
        let empty = Request { used: 0, data: std::ptr::null_mut(), size: 0, offset: 0, nsubs: 0, subs: [(0, 0); MAX_SOCKETS] };
        Comm { send, ctrl, socks, nthreads, next_sock: 0, reqs: [empty; MAX_REQUESTS], inline: [[0; CTRL + INLINE]; MAX_REQUESTS], threads }
    }

    /// Connect one send comm (`nsocks` data sockets + control) to `addr`;
    /// each socket says (comm index, socket index) in its first two bytes.
    pub fn connect(addr: SocketAddr, comm_idx: u8, nsocks: usize, nthreads: usize) -> Result<Comm, String> {
        let mut all = Vec::new();
        for i in 0..=nsocks {
            let mut s = TcpStream::connect(addr).map_err(|e| format!("nccl-socket connect {addr}: {e}"))?;
            s.set_nodelay(true).map_err(|e| e.to_string())?;
            s.write_all(&[comm_idx, i as u8]).map_err(|e| e.to_string())?;
            all.push(s);
        }
        let ctrl = all.pop().unwrap();
        Ok(Comm::new(true, ctrl, all, nthreads))
    }

    /// Accept `ncomms` receive comms from one listener.
    pub fn accept(l: &TcpListener, ncomms: usize, nsocks: usize, nthreads: usize) -> Result<Vec<Comm>, String> {
        let mut slots: Vec<Vec<Option<TcpStream>>> = (0..ncomms).map(|_| (0..=nsocks).map(|_| None).collect()).collect();
        for _ in 0..ncomms * (nsocks + 1) {
            let (mut s, _) = l.accept().map_err(|e| format!("nccl-socket accept: {e}"))?;
            s.set_nodelay(true).map_err(|e| e.to_string())?;
            let mut id = [0u8; 2];
            s.read_exact(&mut id).map_err(|e| e.to_string())?;
            let (c, i) = (id[0] as usize, id[1] as usize);
            if c >= ncomms || i > nsocks || slots[c][i].is_some() {
                return Err(format!("nccl-socket accept: unexpected socket id {c}/{i}"));
            }
            slots[c][i] = Some(s);
        }
        Ok(slots
            .into_iter()
            .map(|mut v| {
                let ctrl = v.pop().unwrap().unwrap();
                Comm::new(false, ctrl, v.into_iter().map(Option::unwrap).collect(), nthreads)
            })
            .collect())
    }

    fn get_request(&mut self, data: *mut u8, size: usize) -> Result<usize, String> {
        let i = self.reqs.iter().position(|r| r.used == 0).ok_or("nccl-socket: unable to allocate requests")?;
        self.reqs[i] = Request { used: 1, data, size, offset: 0, nsubs: 0, subs: [(0, 0); MAX_SOCKETS] };
        Ok(i)
    }

    /// isend / irecv: take a request slot, no I/O.
    pub fn post(&mut self, data: *mut u8, size: usize) -> Result<usize, String> {
        self.get_request(data, size)
    }

    fn get_task(&mut self, data: *mut u8, size: usize) -> Result<(u8, u16), String> {
        let tid = self.next_sock % self.nthreads;
        if self.threads[tid].1.is_none() {
            let res = self.threads[tid].0.clone();
            let h = std::thread::Builder::new()
                .name(format!("ncclsock-{}{tid}", if self.send { 'S' } else { 'R' }))
                .spawn(move || helper(res))
                .map_err(|e| e.to_string())?;
            self.threads[tid].1 = Some(h);
        }
        let fd = self.socks[self.next_sock].as_raw_fd();
        let res = &self.threads[tid].0;
        let slot = res.next.load(Ordering::Relaxed);
        let t = &res.tasks[slot];
        if t.used.load(Ordering::Acquire) {
            return Err("nccl-socket: unable to allocate subtasks".into());
        }
        t.data.store(data as usize, Ordering::Relaxed);
        t.size.store(size, Ordering::Relaxed);
        t.offset.store(0, Ordering::Relaxed);
        t.fd.store(fd as usize, Ordering::Relaxed);
        t.failed.store(false, Ordering::Relaxed);
        self.next_sock = (self.next_sock + 1) % self.socks.len();
        t.used.store(true, Ordering::Release);
        let _g = res.mutex.lock().unwrap();
        res.next.store((slot + 1) % res.tasks.len(), Ordering::Release);
        res.cond.notify_one();
        Ok((tid as u8, slot as u16))
    }

    /// ncclNetSocketTest: `Ok(Some(size))` when done.
    pub fn test(&mut self, i: usize) -> Result<Option<usize>, String> {
        let fd = self.ctrl.as_raw_fd();
        if self.reqs[i].used == 1 {
            let r = self.reqs[i];
            let (msg, msg_size): (*mut u8, usize);
            if self.send {
                let inl = inline_size(r.size);
                let m = &mut self.inline[i];
                m[..CTRL].copy_from_slice(&(r.size as i32).to_ne_bytes());
                if inl > 0 {
                    // SAFETY: r.data holds r.size >= inl readable bytes (isend contract).
                    m[CTRL..CTRL + inl].copy_from_slice(unsafe { std::slice::from_raw_parts(r.data, inl) });
                }
                msg = m.as_mut_ptr();
                msg_size = CTRL + inl;
            } else {
                let m = self.inline[i].as_mut_ptr();
                let mut got = 0;
                while got < CTRL {
                    // SAFETY: m has CTRL + INLINE bytes.
                    got += progress_once(false, fd, unsafe { m.add(got) }, CTRL - got)?;
                    if got == 0 {
                        return Ok(None);
                    }
                }
                let sender = i32::from_ne_bytes(self.inline[i][..CTRL].try_into().unwrap()) as usize;
                if sender > r.size {
                    return Err(format!("nccl-socket: message truncated: receiving {sender} bytes instead of {}", r.size));
                }
                self.reqs[i].size = sender;
                msg = r.data;
                msg_size = inline_size(sender);
            }
            let mut off = 0;
            while off < msg_size {
                // SAFETY: msg has msg_size bytes (header area or request buffer).
                off += progress_once(self.send, fd, unsafe { msg.add(off) }, msg_size - off)?;
                if off == 0 {
                    return Ok(None);
                }
            }
            let r = &mut self.reqs[i];
            r.used = 2;
            r.offset = inline_size(r.size);
            let (size, data, mut chunk_off) = (r.size, r.data, r.offset);
            let mut n = 0;
            if !self.socks.is_empty() {
                let task = MIN_TASK.max((size - chunk_off).div_ceil(self.socks.len()));
                while chunk_off < size {
                    let len = task.min(size - chunk_off);
                    // SAFETY: chunk_off < size: inside the request buffer.
                    let sub = self.get_task(unsafe { data.add(chunk_off) }, len)?;
                    self.reqs[i].subs[n] = sub;
                    n += 1;
                    chunk_off += len;
                }
            }
            self.reqs[i].nsubs = n;
        }
        if self.reqs[i].used == 2 {
            let r = self.reqs[i];
            if r.nsubs > 0 {
                let mut complete = 0;
                for &(tid, slot) in &r.subs[..r.nsubs] {
                    let t = &self.threads[tid as usize].0.tasks[slot as usize];
                    if t.failed.load(Ordering::Acquire) {
                        return Err("nccl-socket: socket progress error (helper thread)".into());
                    }
                    if t.offset.load(Ordering::Acquire) == t.size.load(Ordering::Relaxed) {
                        complete += 1;
                    }
                }
                if complete == r.nsubs {
                    for &(tid, slot) in &r.subs[..r.nsubs] {
                        self.threads[tid as usize].0.tasks[slot as usize].used.store(false, Ordering::Release);
                    }
                    self.reqs[i].used = 0;
                    return Ok(Some(r.size));
                }
            } else {
                if r.offset < r.size {
                    // SAFETY: offset < size: inside the request buffer.
                    let n = progress_once(self.send, fd, unsafe { r.data.add(r.offset) }, r.size - r.offset)?;
                    self.reqs[i].offset += n;
                }
                if self.reqs[i].offset == r.size {
                    self.reqs[i].used = 0;
                    return Ok(Some(r.size));
                }
            }
        }
        Ok(None)
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        for (res, h) in &mut self.threads {
            if let Some(h) = h.take() {
                {
                    let _g = res.mutex.lock().unwrap();
                    res.stop.store(true, Ordering::Release);
                    res.cond.notify_one();
                }
                // a thread spinning on a group of a dead peer stops at its
                // next failed call; sockets close after the join
                let _ = self.ctrl.shutdown(std::net::Shutdown::Both);
                for s in &self.socks {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
                let _ = h.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(nsocks: usize, nthreads: usize) -> (Comm, Comm) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let s = Comm::connect(a, 0, nsocks, nthreads).unwrap();
        let r = Comm::accept(&l, 1, nsocks, nthreads).unwrap().pop().unwrap();
        (s, r)
    }

    fn exchange(nsocks: usize, nthreads: usize) {
        let (mut s, mut r) = pair(nsocks, nthreads);
        for &size in &[0usize, 1, 128, 129, 4096, 200_000, 1 << 20] {
            let mut src: Vec<u8> = (0..size).map(|i| (i * 7 + size) as u8).collect();
            let mut dst = vec![0u8; size + 16];
            let rs = s.post(src.as_mut_ptr(), size).unwrap();
            let rr = r.post(dst.as_mut_ptr(), size + 16).unwrap();
            let (mut ds, mut dr) = (None, None);
            let t0 = std::time::Instant::now();
            while ds.is_none() || dr.is_none() {
                if ds.is_none() {
                    ds = s.test(rs).unwrap();
                }
                if dr.is_none() {
                    dr = r.test(rr).unwrap();
                }
                assert!(t0.elapsed().as_secs() < 20, "stuck at size {size}");
            }
            assert_eq!((ds, dr), (Some(size), Some(size)));
            assert_eq!(&dst[..size], &src[..], "size {size}");
        }
    }

    #[test]
    fn moves_exact_bytes_without_threads() {
        exchange(0, 0);
    }

    #[test]
    fn moves_exact_bytes_with_helper_threads_and_joins_them() {
        exchange(4, 2);
    }

    #[test]
    fn a_larger_message_than_posted_is_refused() {
        let (mut s, mut r) = pair(0, 0);
        let mut src = vec![1u8; 300];
        let mut dst = vec![0u8; 100];
        let rs = s.post(src.as_mut_ptr(), 300).unwrap();
        let rr = r.post(dst.as_mut_ptr(), 100).unwrap();
        let t0 = std::time::Instant::now();
        loop {
            let _ = s.test(rs);
            match r.test(rr) {
                Err(e) => return assert!(e.contains("truncated"), "{e}"),
                Ok(Some(_)) => panic!("accepted a truncated message"),
                Ok(None) => assert!(t0.elapsed().as_secs() < 20),
            }
        }
    }
}
