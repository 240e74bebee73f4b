//! The socket system calls the TCP transport (and the verbs out-of-band
//! exchange) need, wrapped once, and the non-blocking partial read/write
//! steps both build their exchanges from. Every `unsafe` block of the
//! socket side lives here.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::error::{Errno, Error, Result};
use crate::proto::wire::{Reply, Verdict, REPLY_LEN};

/// Most pieces one gather write takes.
pub const MAX_IOV: usize = 64;

/// Outcome of a non-blocking transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Io {
    /// This many bytes moved (> 0).
    Done(usize),
    /// Would block.
    Again,
    /// The peer closed its end (read returned 0).
    Eof,
}

pub(crate) fn to_sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large enough and suitably aligned for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr = libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is large enough and suitably aligned for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr = libc::in6_addr { s6_addr: a.ip().octets() };
            sin6.sin6_scope_id = a.scope_id();
            sin6.sin6_flowinfo = a.flowinfo();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Convert a kernel socket address; `None` for families other than IPv4/IPv6.
///
/// # Safety
/// `sa` must point to a valid socket address of at least its family's size.
pub unsafe fn from_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    // SAFETY: caller guarantees `sa` is valid for its family.
    unsafe {
        match (*sa).sa_family as i32 {
            libc::AF_INET => {
                let sin = &*(sa as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
            }
            libc::AF_INET6 => {
                let sin6 = &*(sa as *const libc::sockaddr_in6);
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::V6(SocketAddrV6::new(ip, u16::from_be(sin6.sin6_port), sin6.sin6_flowinfo, sin6.sin6_scope_id)))
            }
            _ => None,
        }
    }
}

fn cvt(r: libc::c_int, op: impl FnOnce() -> String) -> Result<libc::c_int> {
    if r < 0 {
        Err(Error::sys(op(), Errno::last()))
    } else {
        Ok(r)
    }
}

/// A TCP socket (listening or connected), non-blocking, close-on-exec.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Socket {
    fn new(addr: &SocketAddr) -> Result<Socket> {
        let fam = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
        // SAFETY: plain socket(2) call; the returned fd is owned below.
        let fd = cvt(unsafe { libc::socket(fam, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) }, || {
            "socket(AF_INET/6, SOCK_STREAM)".into()
        })?;
        // SAFETY: fd is a fresh descriptor that nothing else owns.
        Ok(Socket { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    fn setopt<T>(&self, level: i32, name: i32, val: T, what: &str) -> Result<()> {
        // SAFETY: `val` lives for the call and its size is passed.
        let r = unsafe {
            libc::setsockopt(
                self.as_raw_fd(),
                level,
                name,
                &val as *const T as *const libc::c_void,
                std::mem::size_of::<T>() as libc::socklen_t,
            )
        };
        cvt(r, || format!("setsockopt({what})")).map(|_| ())
    }

    /// Listen on `addr` (port 0 picks one); returns the socket and bound address.
    pub fn listen(addr: SocketAddr) -> Result<(Socket, SocketAddr)> {
        // Port 0: our own pick first. The kernel's search for a free port
        // probes from a random offset through the ports in use, which with
        // thousands of listeners per host cost ~0.5 ms per bind (measured
        // at 2 x 4096 listeners); a process-wide cursor through the local
        // port range finds a free one at the first or second try. Our pick
        // is bound before SO_REUSEADDR is set, so a port another socket
        // holds (bound and not yet listening included: two sockets with
        // SO_REUSEADDR may both bind one, and the later listen(2) fails) is
        // refused at bind; should listen(2) still say EADDRINUSE, a fresh
        // socket tries another port, and after a few the kernel picks.
        for attempt in 0..=LISTEN_PICKS {
            let s = Socket::new(&addr)?;
            let reuse = |s: &Socket| s.setopt(libc::SOL_SOCKET, libc::SO_REUSEADDR, 1 as libc::c_int, "SO_REUSEADDR");
            let bind = |a: &SocketAddr| {
                let (ss, len) = to_sockaddr(a);
                // SAFETY: ss/len describe a valid address for this socket's family.
                unsafe { libc::bind(s.as_raw_fd(), &ss as *const _ as *const libc::sockaddr, len) }
            };
            let ours = addr.port() == 0
                && attempt < LISTEN_PICKS
                && ports::candidates().any(|p| {
                    let mut a = addr;
                    a.set_port(p);
                    bind(&a) == 0 || Errno::last().0 != libc::EADDRINUSE
                })
                && s.local_addr().is_ok_and(|a| a.port() != 0);
            reuse(&s)?;
            if !ours {
                cvt(bind(&addr), || format!("bind({addr})"))?;
            }
            // SAFETY: plain listen(2) on our socket.
            if unsafe { libc::listen(s.as_raw_fd(), 4096) } < 0 {
                let e = Errno::last();
                if ours && e.0 == libc::EADDRINUSE {
                    continue;
                }
                return Err(Error::sys(format!("listen({addr})"), e));
            }
            let local = s.local_addr()?;
            return Ok((s, local));
        }
        unreachable!("the last attempt lets the kernel pick, and returns")
    }

    /// Start a non-blocking connect; completion is seen with [`Socket::connect_done`].
    pub fn connect_start(addr: SocketAddr) -> Result<Socket> {
        Socket::connect_start_tos(addr, None)
    }

    /// [`Socket::connect_start`] with the IP TOS / IPv6 traffic class byte
    /// set before the SYN leaves, so every packet of the stream carries it.
    pub fn connect_start_tos(addr: SocketAddr, tos: Option<u8>) -> Result<Socket> {
        let s = Socket::new(&addr)?;
        if let Some(t) = tos {
            s.set_tos(addr.is_ipv6(), t)?;
        }
        let (ss, len) = to_sockaddr(&addr);
        // SAFETY: ss/len describe a valid address for this socket's family.
        let r = unsafe { libc::connect(s.as_raw_fd(), &ss as *const _ as *const libc::sockaddr, len) };
        if r < 0 {
            let e = Errno::last();
            if e.0 != libc::EINPROGRESS && e.0 != libc::EINTR {
                return Err(Error::sys(format!("connect to {addr}"), e));
            }
        }
        Ok(s)
    }

    /// `Ok(true)` once connected, `Ok(false)` while in progress.
    pub fn connect_done(&self, addr: &SocketAddr) -> Result<bool> {
        let mut p = libc::pollfd { fd: self.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        if r < 0 {
            return Err(Error::last_os("poll"));
        }
        if r == 0 {
            return Ok(false);
        }
        let mut err: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        cvt(
            // SAFETY: err/len are valid out-pointers of the right size.
            unsafe {
                libc::getsockopt(self.as_raw_fd(), libc::SOL_SOCKET, libc::SO_ERROR, &mut err as *mut _ as *mut libc::c_void, &mut len)
            },
            || "getsockopt(SO_ERROR)".into(),
        )?;
        if err != 0 {
            return Err(Error::sys(format!("connect to {addr}"), Errno(err)));
        }
        Ok(true)
    }

    /// Accept one pending connection; `None` when none is waiting.
    pub fn accept(&self) -> Result<Option<(Socket, SocketAddr)>> {
        // SAFETY: zeroed sockaddr_storage is valid; len is its size.
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: ss/len are valid out-pointers.
        let fd = unsafe {
            libc::accept4(self.as_raw_fd(), &mut ss as *mut _ as *mut libc::sockaddr, &mut len, libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC)
        };
        if fd < 0 {
            let e = Errno::last();
            return match e.0 {
                libc::EAGAIN | libc::EINTR | libc::ECONNABORTED => Ok(None),
                _ => Err(Error::sys("accept", e)),
            };
        }
        // SAFETY: fd is a fresh descriptor; ss was filled by the kernel.
        let s = Socket { fd: unsafe { OwnedFd::from_raw_fd(fd) } };
        // SAFETY: the kernel wrote a valid address of `len` bytes.
        let peer = unsafe { from_sockaddr(&ss as *const _ as *const libc::sockaddr) }
            .unwrap_or(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)));
        Ok(Some((s, peer)))
    }

    /// Local address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        // SAFETY: sockaddr_storage is plain data; zeroed is a valid (empty) value.
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: valid out-pointers.
        cvt(unsafe { libc::getsockname(self.as_raw_fd(), &mut ss as *mut _ as *mut libc::sockaddr, &mut len) }, || "getsockname".into())?;
        // SAFETY: the kernel filled a valid address.
        unsafe { from_sockaddr(&ss as *const _ as *const libc::sockaddr) }
            .ok_or_else(|| Error::Internal("getsockname: unknown family".into()))
    }

    /// Options for a data stream: no Nagle, keepalive that finds a dead
    /// peer of an idle connection after `timeout_s`, and optional fixed
    /// buffer sizes. No TCP_USER_TIMEOUT: since Linux 5.x it also aborts a
    /// connection whose receiver is alive but has not read for that long
    /// (zero window), which is a rank busy elsewhere, not a failure; a send
    /// side with data in flight and no acknowledgement is watched by
    /// TCP's [`SendComm`](super::tcp::SendComm) instead.
    pub fn tune_stream(&self, timeout_s: i64, bufsize: u64) -> Result<()> {
        self.setopt(libc::IPPROTO_TCP, libc::TCP_NODELAY, 1 as libc::c_int, "TCP_NODELAY")?;
        self.setopt(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1 as libc::c_int, "SO_KEEPALIVE")?;
        self.keepalive_within(timeout_s)?;
        if bufsize > 0 {
            let b = bufsize.min(i32::MAX as u64) as libc::c_int;
            self.setopt(libc::SOL_SOCKET, libc::SO_SNDBUF, b, "SO_SNDBUF")?;
            self.setopt(libc::SOL_SOCKET, libc::SO_RCVBUF, b, "SO_RCVBUF")?;
        }
        Ok(())
    }

    /// Send a FIN now (no more data from us), whatever is left unread in
    /// our receive queue: a close alone would send a reset then, which
    /// the peer could not tell from a network fault.
    pub fn shutdown_write(&self) {
        // SAFETY: plain shutdown(2) on our descriptor; an error (not
        // connected) leaves nothing to do.
        unsafe { libc::shutdown(self.as_raw_fd(), libc::SHUT_WR) };
    }

    /// Make the coming close send a reset and drop what is queued
    /// (SO_LINGER 0): a stream given up for a fresh one must not go on
    /// delivering, nor look like a deliberate close to the peer.
    pub fn set_abortive_close(&self) {
        let l = libc::linger { l_onoff: 1, l_linger: 0 };
        let _ = self.setopt(libc::SOL_SOCKET, libc::SO_LINGER, l, "SO_LINGER");
    }

    /// Testing (RUSTNET_FAULT_TCP_RESET): reset the connection now and keep
    /// the descriptor (connect(2) with AF_UNSPEC dissolves the association:
    /// the peer gets a reset, our next read or write an error), as a
    /// middlebox's reset or `ss -K` would.
    pub fn reset_now(&self) {
        // SAFETY: an all-zero sockaddr with family AF_UNSPEC is valid; its size is passed.
        unsafe {
            let mut sa: libc::sockaddr = std::mem::zeroed();
            sa.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
            libc::connect(self.as_raw_fd(), &sa, std::mem::size_of::<libc::sockaddr>() as libc::socklen_t);
        }
    }

    /// The errno of a failed non-blocking connect, once the connect is over
    /// (`Ok(None)` while in progress, `Ok(Some(0))` when connected).
    pub fn connect_status(&self) -> std::result::Result<Option<i32>, Errno> {
        let mut p = libc::pollfd { fd: self.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        if r < 0 {
            return Err(Errno::last());
        }
        if r == 0 {
            return Ok(None);
        }
        let mut err: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: err/len are valid out-pointers of the right size.
        let r = unsafe {
            libc::getsockopt(self.as_raw_fd(), libc::SOL_SOCKET, libc::SO_ERROR, &mut err as *mut _ as *mut libc::c_void, &mut len)
        };
        if r < 0 {
            return Err(Errno::last());
        }
        Ok(Some(err))
    }

    /// Keepalive probes that declare an idle connection's peer dead after
    /// about `secs` of silence (a third of it idle, then two probes a third
    /// apart). A verbs comm that recovers widens its out-of-band
    /// connection's to its recovery window: a link cut on a shared path
    /// must not end the connection the recovery itself needs.
    pub fn keepalive_within(&self, secs: i64) -> Result<()> {
        let idle = (secs / 3).clamp(1, 32767) as libc::c_int; // Linux caps TCP_KEEPIDLE at 32767 s
        self.setopt(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle, "TCP_KEEPIDLE")?;
        self.setopt(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, idle, "TCP_KEEPINTVL")?;
        self.setopt(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 2 as libc::c_int, "TCP_KEEPCNT")
    }

    /// Linear retransmission timeouts while little data is in flight
    /// (TCP_THIN_LINEAR_TIMEOUTS): a message sent while the link is down is
    /// sent again at the base timeout a few times before backing off, so it
    /// goes soon after the link comes back.
    pub fn set_thin_linear_timeouts(&self) -> Result<()> {
        self.setopt(libc::IPPROTO_TCP, libc::TCP_THIN_LINEAR_TIMEOUTS, 1 as libc::c_int, "TCP_THIN_LINEAR_TIMEOUTS")
    }

    /// Set the IP TOS / IPv6 traffic class byte.
    pub fn set_tos(&self, v6: bool, tos: u8) -> Result<()> {
        if v6 {
            self.setopt(libc::IPPROTO_IPV6, libc::IPV6_TCLASS, tos as libc::c_int, "IPV6_TCLASS")
        } else {
            self.setopt(libc::IPPROTO_IP, libc::IP_TOS, tos as libc::c_int, "IP_TOS")
        }
    }

    /// Non-blocking read into raw memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be writable memory that stays valid for the call.
    pub unsafe fn read_raw(&self, ptr: *mut u8, len: usize) -> std::result::Result<Io, Errno> {
        loop {
            // SAFETY: the caller guarantees the buffer.
            let r = unsafe { libc::recv(self.as_raw_fd(), ptr as *mut libc::c_void, len, libc::MSG_DONTWAIT) };
            if r > 0 {
                return Ok(Io::Done(r as usize));
            }
            if r == 0 {
                return if len == 0 { Ok(Io::Done(0)) } else { Ok(Io::Eof) };
            }
            let e = Errno::last();
            match e.0 {
                libc::EINTR => continue,
                libc::EAGAIN => return Ok(Io::Again),
                _ => return Err(e),
            }
        }
    }

    /// Non-blocking scatter read into two raw pieces: the first filled
    /// before the second (one system call for a payload's end and the next
    /// header).
    ///
    /// # Safety
    /// Each `(ptr, len)` must be writable memory valid for the call, and the
    /// two must not overlap.
    pub unsafe fn read_raw2(&self, a: (*mut u8, usize), b: (*mut u8, usize)) -> std::result::Result<Io, Errno> {
        let mut iov = [
            libc::iovec { iov_base: a.0 as *mut libc::c_void, iov_len: a.1 },
            libc::iovec { iov_base: b.0 as *mut libc::c_void, iov_len: b.1 },
        ];
        // SAFETY: zeroed msghdr is valid; we point it at our iovecs.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = 2;
        loop {
            // SAFETY: msg and iov are valid; the caller guarantees the buffers.
            let r = unsafe { libc::recvmsg(self.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
            if r > 0 {
                return Ok(Io::Done(r as usize));
            }
            if r == 0 {
                return if a.1 + b.1 == 0 { Ok(Io::Done(0)) } else { Ok(Io::Eof) };
            }
            let e = Errno::last();
            match e.0 {
                libc::EINTR => continue,
                libc::EAGAIN => return Ok(Io::Again),
                _ => return Err(e),
            }
        }
    }

    /// Non-blocking gather write of up to two raw pieces (MSG_NOSIGNAL: a dead
    /// peer is an EPIPE error, never a signal).
    ///
    /// # Safety
    /// Each `(ptr, len)` must be readable memory valid for the call.
    pub unsafe fn write_raw2(&self, a: (*const u8, usize), b: (*const u8, usize)) -> std::result::Result<Io, Errno> {
        let mut iov = [
            libc::iovec { iov_base: a.0 as *mut libc::c_void, iov_len: a.1 },
            libc::iovec { iov_base: b.0 as *mut libc::c_void, iov_len: b.1 },
        ];
        let n = if b.1 == 0 { 1 } else { 2 };
        // SAFETY: zeroed msghdr is valid; we point it at our iovecs.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n;
        loop {
            // SAFETY: msg and iov are valid; the caller guarantees the buffers.
            let r = unsafe { libc::sendmsg(self.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if r >= 0 {
                return Ok(if r == 0 && a.1 + b.1 > 0 { Io::Again } else { Io::Done(r as usize) });
            }
            let e = Errno::last();
            match e.0 {
                libc::EINTR => continue,
                libc::EAGAIN => return Ok(Io::Again),
                _ => return Err(e),
            }
        }
    }

    /// Non-blocking gather write of raw pieces (at most [`MAX_IOV`]).
    ///
    /// # Safety
    /// Every `(ptr, len)` must be readable memory valid for the call.
    pub unsafe fn writev_raw(&self, pieces: &[(*const u8, usize)]) -> std::result::Result<Io, Errno> {
        let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_IOV];
        let n = pieces.len().min(MAX_IOV);
        for (v, p) in iov.iter_mut().zip(&pieces[..n]) {
            *v = libc::iovec { iov_base: p.0 as *mut libc::c_void, iov_len: p.1 };
        }
        // SAFETY: zeroed msghdr is valid; we point it at our iovecs.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n;
        loop {
            // SAFETY: msg and iov are valid; the caller guarantees the buffers.
            let r = unsafe { libc::sendmsg(self.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if r > 0 {
                return Ok(Io::Done(r as usize));
            }
            if r == 0 {
                return Ok(Io::Again);
            }
            let e = Errno::last();
            match e.0 {
                libc::EINTR => continue,
                libc::EAGAIN => return Ok(Io::Again),
                _ => return Err(e),
            }
        }
    }

    /// From the kernel's TCP_INFO: whether the peer owes us an answer
    /// (segments unacknowledged, or window probes unanswered) and the time
    /// since its last acknowledgement, in ms.
    pub fn ack_state(&self) -> std::result::Result<(bool, u32), Errno> {
        // SAFETY: tcp_info is plain data; the kernel fills at most `len` bytes.
        let mut ti: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: ti and len are valid for the call.
        let r = unsafe {
            libc::getsockopt(self.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_INFO, (&mut ti as *mut libc::tcp_info).cast(), &mut len)
        };
        if r != 0 {
            return Err(Errno::last());
        }
        // a connection dissolved on this host (`ss -K`, a local reset) whose
        // owner has nothing to write learns it here: it delivers nothing more
        if ti.tcpi_state == TCP_STATE_CLOSE {
            return Err(Errno(libc::ECONNRESET));
        }
        Ok((ti.tcpi_unacked > 0 || ti.tcpi_probes > 0, ti.tcpi_last_ack_recv))
    }

    /// Have this socket's kernel acknowledge what arrives at once for now
    /// (`TCP_QUICKACK`; it leaves the delayed-acknowledgement "ping-pong"
    /// mode a write soon after a read puts it in). Best effort.
    pub fn quickack(&self) {
        let _ = self.setopt(libc::IPPROTO_TCP, libc::TCP_QUICKACK, 1 as libc::c_int, "TCP_QUICKACK");
    }

    /// Bytes the peer's kernel has not acknowledged yet, of those written
    /// into this TCP socket (`SIOCOUTQ`: sent or still queued).
    pub fn unacked(&self) -> std::result::Result<u64, Errno> {
        self.queue_ioctl(libc::TIOCOUTQ)
    }

    /// Bytes this TCP socket holds that were not read yet (`SIOCINQ`; its
    /// kernel acknowledged them). Still answers after a reset or a cut: the
    /// queue stays readable until it is read or the socket closes.
    pub fn unread(&self) -> std::result::Result<u64, Errno> {
        self.queue_ioctl(libc::FIONREAD)
    }

    fn queue_ioctl(&self, req: libc::c_ulong) -> std::result::Result<u64, Errno> {
        queue_ioctl(self.as_raw_fd(), req)
    }

    /// Has the peer closed (or reset) this connection? Looks without taking
    /// any byte: data waiting to be read is left where it is.
    pub fn peer_closed(&self) -> std::result::Result<bool, Errno> {
        let mut b = 0u8;
        loop {
            // SAFETY: one writable byte; MSG_PEEK leaves the queue as it is.
            let r = unsafe { libc::recv(self.as_raw_fd(), (&mut b as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
            if r >= 0 {
                return Ok(r == 0);
            }
            let e = Errno::last();
            match e.0 {
                libc::EINTR => continue,
                libc::EAGAIN => return Ok(false),
                _ => return Err(e),
            }
        }
    }

    /// Safe read into a byte slice.
    pub fn read(&self, buf: &mut [u8]) -> std::result::Result<Io, Errno> {
        // SAFETY: a &mut slice is valid writable memory.
        unsafe { self.read_raw(buf.as_mut_ptr(), buf.len()) }
    }

    /// Safe write of a byte slice.
    pub fn write(&self, buf: &[u8]) -> std::result::Result<Io, Errno> {
        // SAFETY: a slice is valid readable memory.
        unsafe { self.write_raw2((buf.as_ptr(), buf.len()), (std::ptr::null(), 0)) }
    }

    /// Non-blocking: write `buf[*done..]` as far as the socket takes it,
    /// advancing `*done`; true once all of `buf` is out.
    pub fn write_on(&self, buf: &[u8], done: &mut usize) -> std::result::Result<bool, Errno> {
        while *done < buf.len() {
            match self.write(&buf[*done..])? {
                Io::Done(n) => *done += n,
                Io::Again | Io::Eof => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Non-blocking: read into `buf[*done..]` as far as the socket has
    /// bytes, advancing `*done`: [`Io::Done`] (with `buf.len()`) once `buf`
    /// is full, else [`Io::Again`] or [`Io::Eof`].
    pub fn read_on(&self, buf: &mut [u8], done: &mut usize) -> std::result::Result<Io, Errno> {
        while *done < buf.len() {
            match self.read(&mut buf[*done..])? {
                Io::Done(n) => *done += n,
                other => return Ok(other),
            }
        }
        Ok(Io::Done(buf.len()))
    }
}

/// Non-blocking: write `buf[*done..]` to `peer`; true when complete; an
/// error names the peer and `what` was being sent.
pub fn write_some(sock: &Socket, buf: &[u8], done: &mut usize, peer: &SocketAddr, what: &str) -> Result<bool> {
    sock.write_on(buf, done).map_err(|e| Error::Remote { peer: peer.to_string(), what: format!("sending {what}: {e}") })
}

/// Non-blocking: fill `buf[*done..]` from `peer`; true when complete. A
/// close says why when the bytes so far are a listener's refusal.
pub fn read_some(sock: &Socket, buf: &mut [u8], done: &mut usize, peer: &SocketAddr, what: &str) -> Result<bool> {
    match sock.read_on(buf, done) {
        Ok(Io::Done(_)) => Ok(true),
        Ok(Io::Again) => Ok(false),
        Ok(Io::Eof) => {
            // A listener that refuses a hello says why before it closes.
            let refused = buf.get(..REPLY_LEN).and_then(|b| Reply::decode(b.try_into().ok()?).ok()).filter(|_| *done >= REPLY_LEN);
            let what = match refused {
                Some(r) if r.verdict != Verdict::Accepted => format!("the listener refused the connection: {}", r.verdict.explain()),
                _ => format!("closed the connection while we waited for {what} (peer process exited or gave up)"),
            };
            Err(Error::Remote { peer: peer.to_string(), what })
        }
        Err(e) => Err(Error::Remote { peer: peer.to_string(), what: format!("receiving {what}: {e}") }),
    }
}

/// Ports of our own pick a listener on port 0 tries to listen on before the
/// kernel picks one (each found free by bind(2) but refused by listen(2)).
const LISTEN_PICKS: usize = 8;

/// The ports a listener on port 0 tries before it leaves the choice to the
/// kernel: the local port range (`ip_local_port_range`) minus the reserved
/// ports (`ip_local_reserved_ports`), odd offsets first as the kernel's own
/// search (connect(2) takes even ones first), from a cursor shared by the
/// process that starts at a random place. No heap: plain statics.
mod ports {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::OnceLock;

    /// Tries before the kernel picks (a host whose range is nearly full).
    const TRIES: usize = 64;
    /// Reserved ranges kept; more: the kernel picks every port.
    const MAX_RESERVED: usize = 16;

    struct Plan {
        lo: u32,
        span: u32,
        reserved: [(u32, u32); MAX_RESERVED],
        nres: usize,
    }

    static PLAN: OnceLock<Option<Plan>> = OnceLock::new();
    static CURSOR: AtomicU32 = AtomicU32::new(0);

    fn plan() -> Option<&'static Plan> {
        PLAN.get_or_init(|| {
            let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
            let mut it = range.split_whitespace().map(|v| v.parse::<u32>().ok());
            let (lo, hi) = (it.next()??, it.next()??);
            if lo == 0 || hi <= lo || hi > 65535 {
                return None;
            }
            let mut p = Plan { lo, span: hi - lo + 1, reserved: [(0, 0); MAX_RESERVED], nres: 0 };
            let res = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_reserved_ports").unwrap_or_default();
            for r in res.trim().split(',').filter(|r| !r.is_empty()) {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                let (a, b) = (a.trim().parse::<u32>().ok()?, b.trim().parse::<u32>().ok()?);
                if p.nres == MAX_RESERVED {
                    return None;
                }
                p.reserved[p.nres] = (a, b);
                p.nres += 1;
            }
            CURSOR.store(crate::random::random_u64() as u32, Ordering::Relaxed);
            Some(p)
        })
        .as_ref()
    }

    /// The ports to try, in order (none where the range is unknown).
    pub fn candidates() -> impl Iterator<Item = u16> {
        let p = plan();
        (0..p.map_or(0, |_| TRIES)).filter_map(move |i| {
            let p = p?;
            // after a port in use the walk goes on from a random place: two
            // processes whose walks met would otherwise race for the same
            // ports one after the other
            let step = if i == 0 { 1 } else { 1 + crate::random::random_u64() as u32 % p.span };
            let k = CURSOR.fetch_add(step, Ordering::Relaxed).wrapping_add(step - 1) % p.span;
            let half = p.span / 2;
            let off = if k < half { 2 * k + 1 } else { 2 * (k - half) };
            let port = p.lo + off % p.span;
            let reserved = p.reserved[..p.nres].iter().any(|&(a, b)| (a..=b).contains(&port));
            (!reserved).then_some(port as u16)
        })
    }
}

/// An eventfd: how a thread posting work wakes a helper thread asleep in poll.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A non-blocking, close-on-exec eventfd.
    pub fn new() -> Result<EventFd> {
        // SAFETY: plain eventfd(2); the descriptor is owned below.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) }, || "eventfd".into())?;
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Wake the waiter (its next poll sees POLLIN).
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: 8 readable bytes; a full counter (EAGAIN) already wakes the waiter.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reset the counter after a wake-up.
    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: 8 writable bytes; EAGAIN (already zero) is fine.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Wait until one of `fds` is readable (or has an error or hang-up), or
/// `timeout_ms` passed; how many are ready (0: timeout or EINTR).
pub fn wait_readable(fds: &[RawFd], timeout_ms: i32) -> usize {
    let mut p: Vec<libc::pollfd> = fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: `p` holds p.len() valid pollfd entries for the call.
    let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
    r.max(0) as usize
}

/// An IP interface as `getifaddrs` reports it.
#[derive(Debug, Clone)]
pub struct IfAddr {
    /// Interface name.
    pub name: String,
    /// One address of it.
    pub addr: IpAddr,
    /// IFF_UP and IFF_RUNNING.
    pub running: bool,
    /// IFF_LOOPBACK.
    pub loopback: bool,
}

/// All IPv4/IPv6 addresses of all interfaces, in the kernel's order.
pub fn interfaces() -> Result<Vec<IfAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head`, freed below with freeifaddrs.
    cvt(unsafe { libc::getifaddrs(&mut head) }, || "getifaddrs".into())?;
    let mut out = Vec::new();
    let mut p = head;
    while !p.is_null() {
        // SAFETY: p walks the list getifaddrs returned; entries are valid until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr is a valid socket address per getifaddrs.
        let Some(sa) = (unsafe { from_sockaddr(ifa.ifa_addr) }) else { continue };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        let flags = ifa.ifa_flags;
        out.push(IfAddr {
            name,
            addr: sa.ip(),
            running: flags & (libc::IFF_UP as u32) != 0 && flags & (libc::IFF_RUNNING as u32) != 0,
            loopback: flags & (libc::IFF_LOOPBACK as u32) != 0,
        });
    }
    // SAFETY: head came from getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// Interface index of `name` (for IPv6 link-local scope ids); 0 if unknown.
pub fn if_index(name: &str) -> u32 {
    let Ok(c) = std::ffi::CString::new(name) else { return 0 };
    // SAFETY: c is a valid NUL-terminated string.
    unsafe { libc::if_nametoindex(c.as_ptr()) }
}

// ------------------------------------------------ listener bookkeeping (connection set-up)

/// Most readiness events one [`Poller::ready`] call returns.
pub const POLL_BATCH: usize = 64;

/// An epoll set over a listener's not-yet-identified connections, so that a
/// call to `accept` costs what is ready, not what is attached (level
/// triggered; each socket is known by a caller's token).
#[derive(Debug)]
pub struct Poller {
    fd: OwnedFd,
}

impl Poller {
    /// A new, empty set.
    pub fn new() -> Result<Poller> {
        // SAFETY: plain epoll_create1(2); the returned fd is owned below.
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }, || "epoll_create1".into())?;
        // SAFETY: fd is a fresh descriptor that nothing else owns.
        Ok(Poller { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Watch `s` for input or hang-up, reported as `token`.
    pub fn add(&self, s: &Socket, token: u64) -> Result<()> {
        let mut ev = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32, u64: token };
        // SAFETY: both fds are open; ev is valid for the call.
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, s.as_raw_fd(), &mut ev) }, || "epoll_ctl(ADD)".into())
            .map(|_| ())
    }

    /// Stop watching `s` (before it is handed on; closing it also does).
    pub fn remove(&self, s: &Socket) {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: both fds are open; ev is valid (kernels before 2.6.9 want non-NULL).
        // A failure leaves nothing to undo: the socket was not in the set.
        let _ = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_DEL, s.as_raw_fd(), &mut ev) };
    }

    /// Watch descriptor `fd` (owned by the caller, who removes it before
    /// closing it) for input or hang-up, reported as `token`; `once`: only
    /// until it is reported, then again after [`Poller::rearm_fd`].
    pub fn add_fd(&self, fd: RawFd, token: u64, once: bool) -> Result<()> {
        self.ctl_fd(libc::EPOLL_CTL_ADD, fd, token, once, "epoll_ctl(ADD)")
    }

    /// Watch a descriptor added with `once` again.
    pub fn rearm_fd(&self, fd: RawFd, token: u64) -> Result<()> {
        self.ctl_fd(libc::EPOLL_CTL_MOD, fd, token, true, "epoll_ctl(MOD)")
    }

    fn ctl_fd(&self, op: libc::c_int, fd: RawFd, token: u64, once: bool, what: &str) -> Result<()> {
        let flags = libc::EPOLLIN | libc::EPOLLRDHUP | if once { libc::EPOLLONESHOT } else { 0 };
        let mut ev = libc::epoll_event { events: flags as u32, u64: token };
        // SAFETY: ev is valid for the call; a descriptor that is not open is
        // answered with EBADF, not undefined behaviour.
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) }, || what.to_string()).map(|_| ())
    }

    /// Stop watching descriptor `fd`.
    pub fn remove_fd(&self, fd: RawFd) {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: ev is valid (kernels before 2.6.9 want non-NULL); a failure
        // leaves nothing to undo: the descriptor was not in the set.
        let _ = unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut ev) };
    }

    /// Tokens of the sockets with something to read (or closed), without waiting.
    pub fn ready(&self, out: &mut [u64; POLL_BATCH]) -> Result<usize> {
        self.wait(out, 0)
    }

    /// [`Poller::ready`], waiting up to `timeout_ms` (-1: until one is).
    /// 0 on a timeout or a signal.
    pub fn wait(&self, out: &mut [u64; POLL_BATCH], timeout_ms: i32) -> Result<usize> {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; POLL_BATCH];
        loop {
            // SAFETY: evs has room for POLL_BATCH events.
            let r = unsafe { libc::epoll_wait(self.fd.as_raw_fd(), evs.as_mut_ptr(), POLL_BATCH as libc::c_int, timeout_ms) };
            if r < 0 && Errno::last().0 == libc::EINTR && timeout_ms != 0 {
                return Ok(0);
            }
            if r < 0 && Errno::last().0 == libc::EINTR {
                continue;
            }
            let n = cvt(r, || "epoll_wait".into())? as usize;
            for (o, e) in out.iter_mut().zip(&evs[..n]) {
                *o = e.u64;
            }
            return Ok(n);
        }
    }
}

/// The soft `RLIMIT_NOFILE` of this process, for messages (None: unlimited or unknown).
pub fn nofile_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: r is a valid out-pointer for the call.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// `TCP_CLOSE` of `tcpi_state` (include/net/tcp_states.h).
const TCP_STATE_CLOSE: u8 = 7;

/// [`Socket::unread`] on a descriptor another thread owns (the resume port
/// answering for a comm): the caller makes sure it is still that socket
/// (the comm's gate keeps it from being closed meanwhile).
pub fn unread_fd(fd: RawFd) -> std::result::Result<u64, Errno> {
    queue_ioctl(fd, libc::FIONREAD)
}

fn queue_ioctl(fd: RawFd, req: libc::c_ulong) -> std::result::Result<u64, Errno> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCINQ/SIOCOUTQ write one int through the pointer, which is
    // valid for the call; on a descriptor that is no socket the kernel
    // answers with an error.
    let r = unsafe { libc::ioctl(fd, req as _, &mut n) };
    if r != 0 {
        return Err(Errno::last());
    }
    Ok(n.max(0) as u64)
}

#[cfg(test)]
mod listen_tests {
    use super::*;

    #[test]
    fn listeners_on_port_0_get_distinct_ports_that_take_connections() {
        let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
        let ls: Vec<(Socket, SocketAddr)> = (0..300).map(|_| Socket::listen(any).unwrap()).collect();
        let mut ports: Vec<u16> = ls.iter().map(|(_, a)| a.port()).collect();
        assert!(ports.iter().all(|&p| p != 0));
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), ls.len(), "two listeners on one port");
        for (_, a) in ls.iter().step_by(50) {
            std::net::TcpStream::connect(a).unwrap_or_else(|e| panic!("connect to {a}: {e}"));
        }
        // an explicit port is bound as given (here: one in use is refused)
        let taken = ls[0].1;
        assert!(Socket::listen(taken).is_err(), "a second listener on {taken}");
    }
}
