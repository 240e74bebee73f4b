//! Has the kernel resolved a RoCE peer's address (its neighbour entry)?
//! One netlink `RTM_GETNEIGH` (what `ip neigh get DST dev DEV` asks), and a
//! way to make the kernel start resolving it without privileges.
//!
//! Why: on RoCE, `ibv_modify_qp` to RTR resolves the peer's MAC inside the
//! kernel (`rdma_resolve_ip`, drivers/infiniband/core/addr.c). When the
//! neighbour entry is not valid, that call sends the ARP or neighbour
//! solicitation itself and only then puts its request on the list that a
//! neighbour update wakes. An answer that comes back in between (a fast
//! peer, a veth, a container's bridge: the reply is handled before the send
//! returns) wakes nobody, and the request sleeps until its timeout: 1000 ms.
//! After a link flap the entry is gone (the kernel flushes it with the
//! carrier), so the first connect of every recovering comm paid that second
//! in the VM ("moving the new QPs to RTS took 1035 ms", with the ARP answer
//! captured 0.5 ms after the request).
//!
//! So a recovery asks here first: when the entry is not valid it sends one
//! empty UDP datagram from the GID's address out of the GID's netdev (the
//! kernel resolves the neighbour to send it, as it would for the QP), waits
//! until the entry is valid, and only then moves the new QPs to RTR, which
//! then finds the address at once. The question is advice, never a reason
//! to fail: an answer that cannot be had means "go on as before".
//!
//! The system ring: the socket calls are here, each `unsafe` block with its
//! `// SAFETY:` line; building the request and reading the answer are plain
//! functions, tested on bytes.
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// What the neighbour table answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Neigh {
    /// A valid entry (reachable, stale, delay, probe, permanent, no-ARP):
    /// `ibv_modify_qp` takes its MAC at once.
    Valid,
    /// No entry, or one being resolved or failed: the state's name.
    NotYet(&'static str),
    /// The question could not be asked or its answer not read (an old
    /// kernel without single-entry gets, no netlink here): go on as before.
    Unknown(String),
}

const NLMSG_HDR: usize = 16;
const NDMSG: usize = 12;
const RTM_NEWNEIGH: u16 = 28;
const RTM_GETNEIGH: u16 = 30;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NDA_DST: u16 = 1;
/// `NUD_VALID`: permanent, no-ARP, reachable, probe, stale, delay.
const NUD_VALID: u16 = 0x80 | 0x40 | 0x02 | 0x10 | 0x04 | 0x08;

/// The state of an entry whose resolution is under way.
pub(super) const INCOMPLETE: &str = "incomplete";

fn state_name(s: u16) -> &'static str {
    match s {
        0 => "none",
        0x01 => INCOMPLETE,
        0x20 => "failed",
        _ => "other",
    }
}

/// The `RTM_GETNEIGH` message for `dst` on interface `ifindex`.
fn request(dst: IpAddr, ifindex: u32, seq: u32) -> Vec<u8> {
    let (family, addr) = match dst {
        IpAddr::V4(v) => (libc::AF_INET as u8, v.octets().to_vec()),
        IpAddr::V6(v) => (libc::AF_INET6 as u8, v.octets().to_vec()),
    };
    let mut m = vec![0u8; NLMSG_HDR];
    // ndmsg: family, pad1, pad2 (u16), ifindex (i32), state (u16), flags, type
    m.extend_from_slice(&[family, 0, 0, 0]);
    m.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    m.extend_from_slice(&[0, 0, 0, 0]);
    let alen = 4 + addr.len();
    m.extend_from_slice(&(alen as u16).to_ne_bytes());
    m.extend_from_slice(&NDA_DST.to_ne_bytes());
    m.extend_from_slice(&addr);
    m.resize(m.len().next_multiple_of(4), 0);
    let len = m.len() as u32;
    m[0..4].copy_from_slice(&len.to_ne_bytes());
    m[4..6].copy_from_slice(&RTM_GETNEIGH.to_ne_bytes());
    m[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    m
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(o..o + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(o..o + 4)?.try_into().ok()?))
}

/// Read the kernel's answer to [`request`].
fn parse_reply(b: &[u8]) -> Neigh {
    let bad = || Neigh::Unknown(format!("a netlink answer of {} bytes that is not a neighbour", b.len()));
    let (Some(len), Some(kind)) = (u32_at(b, 0), u16_at(b, 4)) else { return bad() };
    let len = (len as usize).min(b.len());
    match kind {
        NLMSG_ERROR => match u32_at(b, NLMSG_HDR).map(|e| e as i32) {
            // no entry at all (flushed with the link): resolve it
            Some(e) if e == -libc::ENOENT => Neigh::NotYet(state_name(0)),
            Some(0) | None => bad(),
            Some(e) => Neigh::Unknown(format!("netlink: {}", std::io::Error::from_raw_os_error(-e))),
        },
        RTM_NEWNEIGH if len >= NLMSG_HDR + NDMSG => match u16_at(b, NLMSG_HDR + 8) {
            Some(s) if s & NUD_VALID != 0 => Neigh::Valid,
            Some(s) => Neigh::NotYet(state_name(s)),
            None => bad(),
        },
        _ => bad(),
    }
}

/// Ask the kernel for the neighbour entry of `dst` on interface `ifindex`.
pub(super) fn lookup(dst: IpAddr, ifindex: u32) -> Neigh {
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let req = request(dst, ifindex, seq);
    // SAFETY: a plain socket(2) call; its result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Neigh::Unknown(format!("netlink socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a socket we just opened and own alone; OwnedFd closes it once.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `req` is a live buffer of req.len() bytes for the call's duration.
    let n = unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
    if n != req.len() as isize {
        return Neigh::Unknown(format!("netlink send: {}", std::io::Error::last_os_error()));
    }
    // the kernel answers inside send(): the reply is queued already
    let mut buf = [0u8; 512];
    // SAFETY: `buf` is writable for its whole length for the call's duration.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n <= 0 {
        return Neigh::Unknown(format!("netlink recv: {}", std::io::Error::last_os_error()));
    }
    parse_reply(&buf[..n as usize])
}

/// The discard port: the empty datagram that starts the resolution is
/// dropped there (or answered by an ICMP port unreachable, which is all).
const DISCARD: u16 = 9;

/// Make the kernel resolve `dst` out of interface `ifindex`: one empty UDP
/// datagram from `src`, its output interface given per message
/// (`IP_PKTINFO`/`IPV6_PKTINFO`, no privilege needed), so the route is the
/// one the kernel's RoCE resolution takes (bound to the GID's netdev).
pub(super) fn kick(src: IpAddr, dst: IpAddr, ifindex: u32) -> std::io::Result<()> {
    let s = UdpSocket::bind(SocketAddr::new(src, 0))?;
    let fd = s.as_raw_fd();
    match (src, dst) {
        (IpAddr::V4(a), IpAddr::V4(d)) => {
            let mut to = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: DISCARD.to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(d.octets()) },
                sin_zero: [0; 8],
            };
            let info = libc::in_pktinfo {
                ipi_ifindex: ifindex as libc::c_int,
                ipi_spec_dst: libc::in_addr { s_addr: u32::from_ne_bytes(a.octets()) },
                ipi_addr: libc::in_addr { s_addr: 0 },
            };
            send_with(
                fd,
                (&mut to as *mut libc::sockaddr_in).cast(),
                size_of::<libc::sockaddr_in>(),
                libc::IPPROTO_IP,
                libc::IP_PKTINFO,
                &info,
            )
        }
        (IpAddr::V6(_), IpAddr::V6(d)) => {
            let mut to = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: DISCARD.to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr { s6_addr: d.octets() },
                sin6_scope_id: 0,
            };
            let info = libc::in6_pktinfo { ipi6_addr: libc::in6_addr { s6_addr: [0; 16] }, ipi6_ifindex: ifindex };
            send_with(
                fd,
                (&mut to as *mut libc::sockaddr_in6).cast(),
                size_of::<libc::sockaddr_in6>(),
                libc::IPPROTO_IPV6,
                libc::IPV6_PKTINFO,
                &info,
            )
        }
        _ => Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{src} and {dst} are of different families"))),
    }
}

/// `sendmsg` of an empty datagram to `to` with one control message
/// (`level`, `kind`, `info`).
fn send_with<T>(
    fd: libc::c_int,
    to: *mut libc::c_void,
    to_len: usize,
    level: libc::c_int,
    kind: libc::c_int,
    info: &T,
) -> std::io::Result<()> {
    // room for one control message of any pktinfo (8-byte aligned)
    let mut ctl = [0u64; 8];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(size_of::<T>() as u32) } as usize;
    if space > size_of_val(&ctl) {
        return Err(std::io::Error::other("control message too large"));
    }
    let mut iov = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
    // SAFETY: msghdr is plain data; every field the call reads is set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = to;
    msg.msg_namelen = to_len as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points at `ctl`, which holds `space` bytes, enough
    // for one header and `info` (checked above); CMSG_FIRSTHDR is then
    // non-null and CMSG_DATA inside `ctl`; `info` is read by value.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = level;
        (*c).cmsg_type = kind;
        (*c).cmsg_len = libc::CMSG_LEN(size_of::<T>() as u32) as _;
        std::ptr::copy_nonoverlapping((info as *const T).cast::<u8>(), libc::CMSG_DATA(c), size_of::<T>());
    }
    // SAFETY: `msg` and everything it points at (`to`, `iov`, `ctl`) live
    // for the call; the datagram is empty.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// What [`settle`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Settled {
    /// Valid when first asked, or the question could not be asked: nothing done.
    Already,
    /// Not valid at first (the state's name); valid after the time given.
    Resolved(&'static str, std::time::Duration),
    /// Still being resolved when the wait ended (the first state's name).
    NotYet(&'static str),
    /// The datagram started no resolution (the state stayed as named): the
    /// kernel reaches this peer without a neighbour entry here (its own
    /// address, a loopback), so there is nothing to wait for.
    NoResolution(&'static str),
}

/// Make sure `dst`'s entry on `ifindex` is valid before a QP goes to RTR:
/// ask; when it is not, [`kick`] and ask every millisecond while the kernel
/// is resolving it (`incomplete`), up to `max` (blocking: for a first
/// connect, which `ibv_modify_qp` would block for anyway; a recovery asks
/// without blocking, in `reconnect`). A kick that leaves the entry missing
/// or failed started nothing (sending it needed no neighbour, or could not
/// be routed): that returns at once.
pub(super) fn settle(src: IpAddr, dst: IpAddr, ifindex: u32, max: std::time::Duration) -> Settled {
    let t = std::time::Instant::now();
    let first = match lookup(dst, ifindex) {
        Neigh::Valid | Neigh::Unknown(_) => return Settled::Already,
        Neigh::NotYet(s) => s,
    };
    if let Err(e) = kick(src, dst, ifindex) {
        tracing::debug!("could not make the kernel resolve {dst}: {e}");
        return Settled::NoResolution(first);
    }
    loop {
        match lookup(dst, ifindex) {
            Neigh::Valid => return Settled::Resolved(first, t.elapsed()),
            Neigh::Unknown(_) => return Settled::Already,
            Neigh::NotYet(INCOMPLETE) if t.elapsed() < max => std::thread::sleep(std::time::Duration::from_millis(1)),
            Neigh::NotYet(INCOMPLETE) => return Settled::NotYet(first),
            Neigh::NotYet(s) => return Settled::NoResolution(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::sock::if_index as ifindex;

    fn reply(state: u16) -> Vec<u8> {
        let mut m = vec![0u8; NLMSG_HDR];
        m.extend_from_slice(&[libc::AF_INET as u8, 0, 0, 0]);
        m.extend_from_slice(&3i32.to_ne_bytes());
        m.extend_from_slice(&state.to_ne_bytes());
        m.extend_from_slice(&[0, 1]);
        m.extend_from_slice(&8u16.to_ne_bytes());
        m.extend_from_slice(&NDA_DST.to_ne_bytes());
        m.extend_from_slice(&[10, 0, 0, 2]);
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&RTM_NEWNEIGH.to_ne_bytes());
        m
    }

    fn error(e: i32) -> Vec<u8> {
        let mut m = vec![0u8; NLMSG_HDR + 4];
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        m[NLMSG_HDR..].copy_from_slice(&e.to_ne_bytes());
        m
    }

    #[test]
    fn the_request_is_a_getneigh_with_the_interface_and_dst() {
        let m = request("10.0.0.2".parse().unwrap(), 7, 9);
        assert_eq!(u32_at(&m, 0), Some(m.len() as u32));
        assert_eq!(u16_at(&m, 4), Some(RTM_GETNEIGH));
        assert_eq!(u16_at(&m, 6), Some(NLM_F_REQUEST));
        assert_eq!(u32_at(&m, 8), Some(9));
        assert_eq!(m[NLMSG_HDR], libc::AF_INET as u8);
        assert_eq!(u32_at(&m, NLMSG_HDR + 4), Some(7));
        // state, flags and type zero (the kernel refuses a get with them set)
        assert_eq!(&m[NLMSG_HDR + 8..NLMSG_HDR + 12], &[0, 0, 0, 0]);
        assert_eq!(m.len(), NLMSG_HDR + NDMSG + 8);
        assert_eq!(u16_at(&m, NLMSG_HDR + NDMSG + 2), Some(NDA_DST));
        assert_eq!(&m[NLMSG_HDR + NDMSG + 4..], &[10, 0, 0, 2]);
        let v6 = request("fd00::2".parse().unwrap(), 3, 1);
        assert_eq!(v6[NLMSG_HDR], libc::AF_INET6 as u8);
        assert_eq!(v6.len(), NLMSG_HDR + NDMSG + 20);
    }

    #[test]
    fn valid_states_are_valid_and_the_rest_are_not_yet() {
        for s in [0x02, 0x04, 0x08, 0x10, 0x40, 0x80] {
            assert_eq!(parse_reply(&reply(s)), Neigh::Valid, "state {s:#x}");
        }
        assert_eq!(parse_reply(&reply(0x01)), Neigh::NotYet("incomplete"));
        assert_eq!(parse_reply(&reply(0x20)), Neigh::NotYet("failed"));
        assert_eq!(parse_reply(&reply(0)), Neigh::NotYet("none"));
    }

    #[test]
    fn no_entry_is_not_yet_other_errors_and_garbage_are_unknown() {
        assert_eq!(parse_reply(&error(-libc::ENOENT)), Neigh::NotYet("none"));
        let Neigh::Unknown(w) = parse_reply(&error(-libc::EINVAL)) else { panic!() };
        assert!(w.contains("Invalid argument"), "{w}");
        assert!(matches!(parse_reply(&error(0)), Neigh::Unknown(_)));
        assert!(matches!(parse_reply(&[1, 2, 3]), Neigh::Unknown(_)));
        let mut short = reply(0x02);
        short.truncate(NLMSG_HDR + 6);
        assert!(matches!(parse_reply(&short), Neigh::Unknown(_)));
    }

    #[test]
    fn the_kernel_answers_for_loopback() {
        // a real kernel: lo has no neighbour entries (NOARP): "none", or an
        // old kernel / a sandbox without netlink: unknown; never a panic
        match lookup("127.0.0.1".parse().unwrap(), ifindex("lo")) {
            Neigh::NotYet(s) => assert_eq!(s, "none"),
            Neigh::Unknown(w) => eprintln!("!! netlink neighbour get not usable here: {w}"),
            Neigh::Valid => {}
        }
    }

    #[test]
    fn settling_loopback_asks_and_returns_at_once() {
        // lo is NOARP: the kick starts no resolution (or netlink is not
        // usable here); either way settle returns at once, not after its bound
        let t = std::time::Instant::now();
        let r = settle("127.0.0.1".parse().unwrap(), "127.0.0.1".parse().unwrap(), ifindex("lo"), std::time::Duration::from_millis(30));
        assert!(t.elapsed() < std::time::Duration::from_millis(25), "{r:?} took {:?}", t.elapsed());
        assert!(matches!(r, Settled::Already | Settled::NoResolution(_)), "{r:?}");
    }

    #[test]
    fn a_kick_sends_one_empty_datagram_out_of_the_given_interface() {
        // to ourselves over lo: the datagram is sent (nobody listens on 9)
        let lo = ifindex("lo");
        if lo == 0 {
            eprintln!("!! SKIPPED: this network namespace has no `lo` interface to send through");
            return;
        }
        kick("127.0.0.1".parse().unwrap(), "127.0.0.1".parse().unwrap(), lo).expect("kick over lo");
        assert!(kick("127.0.0.1".parse().unwrap(), "::1".parse().unwrap(), lo).is_err());
    }
}
