//! Can the kernel resolve a RoCE peer's address yet? One netlink
//! `RTM_GETROUTE` (what `ip route get DST from SRC oif DEV` asks).
//!
//! On RoCE, `ibv_modify_qp` to RTR resolves the peer's MAC inside the
//! kernel (route lookup, then ARP/ND) and blocks until it has it. Right
//! after a link comes back, the route out of the GID's netdev may still be
//! missing: a host whose per-NIC policy routes are put back by a network
//! daemon (or a test rig) after the link. A resolution that starts in that
//! gap fails once, and the kernel tries again only a second later: the
//! recovery then waits a second for nothing ("moving the new QPs to RTS took
//! 1012 ms", seen in every slow 3 s and 20 s flap in the VM). A recovery
//! asks this module first, and connects its new QPs once the route leaves
//! through the GID's own netdev (or after a bound: the question is advice,
//! never a reason to fail).
//!
//! The system ring: the netlink socket's calls are here, each `unsafe`
//! block with its `// SAFETY:` line; building the request and reading the
//! answer are plain functions, tested on bytes.
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// What the routing table answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Route {
    /// A unicast route out of the GID's netdev: the resolution can run.
    Ready,
    /// Not yet: what the kernel answered instead (for the log).
    NotYet(String),
    /// The question could not be asked or its answer not read: go on as
    /// before this check existed.
    Unknown(String),
}

const NLMSG_HDR: usize = 16;
const RTMSG: usize = 12;
const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const RTA_DST: u16 = 1;
const RTA_SRC: u16 = 2;
const RTA_OIF: u16 = 4;
const RTN_UNICAST: u8 = 1;

fn rta(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(out.len().next_multiple_of(4), 0);
}

fn octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(v) => v.octets().to_vec(),
        IpAddr::V6(v) => v.octets().to_vec(),
    }
}

/// The `RTM_GETROUTE` message for `src -> dst` leaving through `oif`
/// (`None` when the two families differ).
fn request(src: IpAddr, dst: IpAddr, oif: u32, seq: u32) -> Option<Vec<u8>> {
    let (family, bits) = match (src, dst) {
        (IpAddr::V4(_), IpAddr::V4(_)) => (libc::AF_INET as u8, 32u8),
        (IpAddr::V6(_), IpAddr::V6(_)) => (libc::AF_INET6 as u8, 128u8),
        _ => return None,
    };
    let mut m = vec![0u8; NLMSG_HDR];
    // rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags
    m.extend_from_slice(&[family, bits, bits, 0, 0, 0, 0, 0]);
    m.extend_from_slice(&0u32.to_ne_bytes());
    rta(&mut m, RTA_DST, &octets(dst));
    rta(&mut m, RTA_SRC, &octets(src));
    rta(&mut m, RTA_OIF, &oif.to_ne_bytes());
    let len = m.len() as u32;
    m[0..4].copy_from_slice(&len.to_ne_bytes());
    m[4..6].copy_from_slice(&RTM_GETROUTE.to_ne_bytes());
    m[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    Some(m)
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(o..o + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(o..o + 4)?.try_into().ok()?))
}

/// Read the kernel's answer to [`request`]: ready when it is a unicast
/// route whose output interface is `oif`.
fn parse_reply(b: &[u8], oif: u32) -> Route {
    let bad = || Route::Unknown(format!("a netlink answer of {} bytes that is not a route", b.len()));
    let (Some(len), Some(kind)) = (u32_at(b, 0), u16_at(b, 4)) else { return bad() };
    let len = (len as usize).min(b.len());
    match kind {
        NLMSG_ERROR => match u32_at(b, NLMSG_HDR).map(|e| e as i32) {
            Some(0) | None => bad(),
            Some(e) => Route::NotYet(format!("no route: {}", std::io::Error::from_raw_os_error(-e))),
        },
        RTM_NEWROUTE if len >= NLMSG_HDR + RTMSG => {
            let rtype = b[NLMSG_HDR + 7];
            let mut out_if = None;
            let mut o = NLMSG_HDR + RTMSG;
            while o + 4 <= len {
                let (Some(alen), Some(akind)) = (u16_at(b, o), u16_at(b, o + 2)) else { break };
                let alen = alen as usize;
                if alen < 4 || o + alen > len {
                    break;
                }
                if akind == RTA_OIF && alen >= 8 {
                    out_if = u32_at(b, o + 4);
                }
                o += alen.next_multiple_of(4);
            }
            match (rtype, out_if) {
                (RTN_UNICAST, Some(i)) if i == oif => Route::Ready,
                (RTN_UNICAST, Some(i)) => Route::NotYet(format!("the route leaves through interface {i}, not the GID's ({oif})")),
                (t, i) => Route::NotYet(format!(
                    "a {} route{}",
                    match t {
                        2 => "local (the address is this host's own: delivered without the fabric)".to_string(),
                        t => format!("type-{t}"),
                    },
                    i.map(|i| format!(" through interface {i}")).unwrap_or_default()
                )),
            }
        }
        _ => bad(),
    }
}

/// Ask the kernel how `src -> dst` leaves through interface `oif` now.
pub(super) fn lookup(src: IpAddr, dst: IpAddr, oif: u32) -> Route {
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let Some(req) = request(src, dst, oif, seq) else {
        return Route::Unknown(format!("{src} and {dst} are of different families"));
    };
    // SAFETY: a plain socket(2) call; its result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Route::Unknown(format!("netlink socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a socket we just opened and own alone; OwnedFd closes it once.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `req` is a live buffer of req.len() bytes for the call's duration.
    let n = unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
    if n != req.len() as isize {
        return Route::Unknown(format!("netlink send: {}", std::io::Error::last_os_error()));
    }
    // the kernel answers inside send(): the reply is queued already
    let mut buf = [0u8; 1024];
    // SAFETY: `buf` is writable for its whole length for the call's duration.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n <= 0 {
        return Route::Unknown(format!("netlink recv: {}", std::io::Error::last_os_error()));
    }
    parse_reply(&buf[..n as usize], oif)
}

/// A network interface's index (0 when there is none of that name).
pub(super) fn ifindex(name: &str) -> u32 {
    let Ok(c) = std::ffi::CString::new(name) else { return 0 };
    // SAFETY: `c` is a NUL-terminated string alive for the call.
    unsafe { libc::if_nametoindex(c.as_ptr()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(rtype: u8, oif: Option<u32>) -> Vec<u8> {
        let mut m = vec![0u8; NLMSG_HDR];
        m.extend_from_slice(&[libc::AF_INET as u8, 32, 0, 0, 254, 0, 0, rtype]);
        m.extend_from_slice(&0u32.to_ne_bytes());
        rta(&mut m, RTA_DST, &[10, 0, 0, 2]);
        if let Some(i) = oif {
            rta(&mut m, RTA_OIF, &i.to_ne_bytes());
        }
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&RTM_NEWROUTE.to_ne_bytes());
        m
    }

    #[test]
    fn the_request_is_a_getroute_with_dst_src_and_oif() {
        let m = request("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap(), 7, 9).unwrap();
        assert_eq!(u32_at(&m, 0), Some(m.len() as u32));
        assert_eq!(u16_at(&m, 4), Some(RTM_GETROUTE));
        assert_eq!(u32_at(&m, 8), Some(9));
        assert_eq!(&m[NLMSG_HDR..NLMSG_HDR + 3], &[libc::AF_INET as u8, 32, 32]);
        // three attributes of 8 bytes each
        assert_eq!(m.len(), NLMSG_HDR + RTMSG + 24);
        assert_eq!(&m[NLMSG_HDR + RTMSG + 4..NLMSG_HDR + RTMSG + 8], &[10, 0, 0, 2]);
        assert_eq!(u32_at(&m, NLMSG_HDR + RTMSG + 20), Some(7));
        let v6 = request("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap(), 3, 1).unwrap();
        assert_eq!(v6[NLMSG_HDR + 1], 128);
        assert_eq!(v6.len(), NLMSG_HDR + RTMSG + 20 + 20 + 8);
        assert!(request("10.0.0.1".parse().unwrap(), "fd00::2".parse().unwrap(), 3, 1).is_none());
    }

    #[test]
    fn only_a_unicast_route_out_of_the_gids_netdev_is_ready() {
        assert_eq!(parse_reply(&reply(RTN_UNICAST, Some(5)), 5), Route::Ready);
        let Route::NotYet(w) = parse_reply(&reply(RTN_UNICAST, Some(2)), 5) else { panic!() };
        assert!(w.contains("interface 2, not the GID's (5)"), "{w}");
        // the rig's case: its policy route not back yet, the peer's address is local
        let Route::NotYet(w) = parse_reply(&reply(2, Some(1)), 5) else { panic!() };
        assert!(w.contains("local") && w.contains("interface 1"), "{w}");
        assert!(matches!(parse_reply(&reply(RTN_UNICAST, None), 5), Route::NotYet(_)));
    }

    #[test]
    fn an_error_answer_is_not_yet_and_garbage_is_unknown() {
        let mut e = vec![0u8; NLMSG_HDR + 4];
        let len = e.len() as u32;
        e[0..4].copy_from_slice(&len.to_ne_bytes());
        e[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        e[NLMSG_HDR..].copy_from_slice(&(-libc::ENETUNREACH).to_ne_bytes());
        let Route::NotYet(w) = parse_reply(&e, 5) else { panic!() };
        assert!(w.contains("unreachable"), "{w}");
        assert!(matches!(parse_reply(&[1, 2, 3], 5), Route::Unknown(_)));
        let mut r = reply(RTN_UNICAST, Some(5));
        r[NLMSG_HDR + RTMSG] = 200; // an attribute longer than the message
        assert!(matches!(parse_reply(&r, 5), Route::NotYet(_)));
    }

    #[test]
    fn the_loopback_route_to_ourselves_answers() {
        // a real kernel: 127.0.0.1 -> 127.0.0.1 is local, never "ready" for lo's own index
        match lookup("127.0.0.1".parse().unwrap(), "127.0.0.1".parse().unwrap(), ifindex("lo")) {
            Route::NotYet(w) => assert!(w.contains("local"), "{w}"),
            Route::Unknown(w) => eprintln!("!! netlink not usable here: {w}"),
            Route::Ready => panic!("a local route is not a unicast one"),
        }
    }
}
