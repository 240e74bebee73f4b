//! DCB state (PFC-enabled priorities, the DSCP-to-priority APP entries)
//! straight from the kernel's DCB netlink (`RTM_GETDCB` / `DCB_CMD_IEEE_GET`,
//! what iproute2's `dcb` sends), so doctor does not need the `dcb` binary.
//! Message building and parsing are pure ([`request`], [`parse_reply`]) and
//! tested on constructed kernel replies; [`query`] is the socket round trip.
//! Reading needs no privilege (the kernel checks CAP_NET_ADMIN on SET only).
use std::collections::BTreeMap;

/// DCB state of a netdev.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dcb {
    /// PFC enabled per priority.
    pub pfc: [bool; 8],
    /// DSCP -> priority entries of the APP table (empty: the NIC trusts PCP).
    pub dscp_prio: BTreeMap<u8, u8>,
}

const RTM_GETDCB: u16 = 78;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const DCB_CMD_IEEE_GET: u8 = 21;
const DCB_ATTR_IFNAME: u16 = 1;
const DCB_ATTR_IEEE: u16 = 13;
const DCB_ATTR_IEEE_PFC: u16 = 2;
const DCB_ATTR_IEEE_APP_TABLE: u16 = 3;
const DCB_ATTR_IEEE_APP: u16 = 1;
/// IEEE_8021QAZ_APP_SEL_DSCP.
const APP_SEL_DSCP: u8 = 5;
const NLA_TYPE_MASK: u16 = 0x3fff;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// The `DCB_CMD_IEEE_GET` request for `ifname` (native byte order, as netlink is).
pub fn request(ifname: &str, seq: u32) -> Vec<u8> {
    let name_len = ifname.len() + 1;
    let attr_len = 4 + name_len;
    let total = 16 + 4 + align4(attr_len);
    let mut b = Vec::with_capacity(total);
    b.extend_from_slice(&(total as u32).to_ne_bytes());
    b.extend_from_slice(&RTM_GETDCB.to_ne_bytes());
    b.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    b.extend_from_slice(&seq.to_ne_bytes());
    b.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel
    b.extend_from_slice(&[0, DCB_CMD_IEEE_GET, 0, 0]); // dcbmsg: AF_UNSPEC, cmd, pad
    b.extend_from_slice(&(attr_len as u16).to_ne_bytes());
    b.extend_from_slice(&DCB_ATTR_IFNAME.to_ne_bytes());
    b.extend_from_slice(ifname.as_bytes());
    b.resize(total, 0);
    b
}

/// Netlink attributes in `b`: (type without flags, payload).
fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut v = Vec::new();
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > b.len() {
            break;
        }
        v.push((ty, &b[4..len]));
        b = &b[align4(len).min(b.len())..];
    }
    v
}

/// Parse the kernel's answer to [`request`] (the messages of one `recv`).
/// `Ok(None)`: no message for `seq` in `buf` (read again).
pub fn parse_reply(buf: &[u8], seq: u32) -> Result<Option<Dcb>, String> {
    let mut b = buf;
    while b.len() >= 16 {
        let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let ty = u16::from_ne_bytes([b[4], b[5]]);
        let mseq = u32::from_ne_bytes([b[8], b[9], b[10], b[11]]);
        if len < 16 || len > b.len() {
            return Err(format!("malformed netlink message (length {len} of {} bytes)", b.len()));
        }
        let body = &b[16..len];
        b = &b[align4(len).min(b.len())..];
        if mseq != seq {
            continue;
        }
        if ty == NLMSG_ERROR {
            let err = body.get(..4).map(|e| i32::from_ne_bytes([e[0], e[1], e[2], e[3]])).unwrap_or(0);
            if err == 0 {
                continue; // an ACK
            }
            return Err(format!("DCB netlink: {}", std::io::Error::from_raw_os_error(-err)));
        }
        if ty != RTM_GETDCB || body.len() < 4 {
            continue;
        }
        let mut pfc = None;
        let mut dscp_prio = BTreeMap::new();
        for (t, ieee) in attrs(&body[4..]) {
            if t != DCB_ATTR_IEEE {
                continue;
            }
            for (t, p) in attrs(ieee) {
                match t {
                    // struct ieee_pfc { u8 pfc_cap; u8 pfc_en; ... }
                    DCB_ATTR_IEEE_PFC if p.len() >= 2 => pfc = Some(std::array::from_fn(|i| p[1] & (1 << i) != 0)),
                    DCB_ATTR_IEEE_APP_TABLE => {
                        // struct dcb_app { u8 selector; u8 priority; u16 protocol; }
                        for (t, a) in attrs(p) {
                            if t == DCB_ATTR_IEEE_APP && a.len() >= 4 && a[0] == APP_SEL_DSCP {
                                let dscp = u16::from_ne_bytes([a[2], a[3]]);
                                if dscp < 64 && a[1] < 8 {
                                    dscp_prio.insert(dscp as u8, a[1]);
                                }
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        let Some(pfc) = pfc else {
            return Err("the driver reports no IEEE PFC configuration (DCB_ATTR_IEEE_PFC)".into());
        };
        return Ok(Some(Dcb { pfc, dscp_prio }));
    }
    Ok(None)
}

/// Ask the kernel for `ifname`'s DCB state (2 s timeout).
pub fn query(ifname: &str) -> Result<Dcb, String> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    if ifname.is_empty() || ifname.len() >= 16 || ifname.contains('\0') {
        return Err(format!("bad interface name {ifname:?}"));
    }
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Err(format!("netlink socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns; OwnedFd closes it once.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval { tv_sec: 2, tv_usec: 0 };
    // SAFETY: valid descriptor; tv is a live timeval of the size passed.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    let seq = std::process::id() ^ 0x5dcb_0000;
    let req = request(ifname, seq);
    // SAFETY: zeroed sockaddr_nl is valid; family set below.
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: valid descriptor; req and sa are live for the call with the lengths passed.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            req.as_ptr().cast(),
            req.len(),
            0,
            (&sa as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(format!("netlink send: {}", std::io::Error::last_os_error()));
    }
    let mut buf = vec![0u8; 32 * 1024];
    for _ in 0..8 {
        // SAFETY: valid descriptor; buf is writable for its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(format!("netlink receive: {}", std::io::Error::last_os_error()));
        }
        if let Some(d) = parse_reply(&buf[..n as usize], seq)? {
            return Ok(d);
        }
    }
    Err("no DCB netlink reply".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nla(ty: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        v.extend_from_slice(&ty.to_ne_bytes());
        v.extend_from_slice(payload);
        v.resize(align4(v.len()), 0);
        v
    }

    fn msg(ty: u16, seq: u32, body: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
        v.extend_from_slice(&ty.to_ne_bytes());
        v.extend_from_slice(&0u16.to_ne_bytes());
        v.extend_from_slice(&seq.to_ne_bytes());
        v.extend_from_slice(&0u32.to_ne_bytes());
        v.extend_from_slice(body);
        v
    }

    /// A reply laid out as dcbnl_ieee_fill writes it: IFNAME, then the
    /// nested IEEE block (ETS, PFC, APP table with a non-DSCP entry too).
    fn reply(seq: u32, pfc_en: u8, apps: &[(u8, u8, u16)]) -> Vec<u8> {
        let mut ieee = nla(1, &[0u8; 59]); // ETS, content ignored
        let mut pfc = vec![8u8, pfc_en, 0, 0, 0, 0, 0, 0];
        pfc.resize(136, 0);
        ieee.extend(nla(DCB_ATTR_IEEE_PFC, &pfc));
        let mut table = Vec::new();
        for &(sel, prio, proto) in apps {
            let mut a = vec![sel, prio];
            a.extend_from_slice(&proto.to_ne_bytes());
            table.extend(nla(DCB_ATTR_IEEE_APP, &a));
        }
        ieee.extend(nla(DCB_ATTR_IEEE_APP_TABLE | 0x8000, &table));
        let mut body = vec![0u8, DCB_CMD_IEEE_GET, 0, 0];
        body.extend(nla(DCB_ATTR_IFNAME, b"eth2\0"));
        body.extend(nla(DCB_ATTR_IEEE | 0x8000, &ieee));
        body.extend(nla(14, &[2])); // DCB_ATTR_DCBX
        msg(RTM_GETDCB, seq, &body)
    }

    #[test]
    fn request_layout() {
        let r = request("eth2", 7);
        assert_eq!(r.len(), 16 + 4 + 12);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 32);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), 78);
        assert_eq!(r[17], 21);
        assert_eq!(u16::from_ne_bytes([r[20], r[21]]), 9); // 4 + "eth2\0"
        assert_eq!(&r[24..29], b"eth2\0");
    }

    #[test]
    fn parses_pfc_and_dscp_entries() {
        let r = reply(7, 0b0000_1000, &[(APP_SEL_DSCP, 3, 26), (APP_SEL_DSCP, 0, 0), (1, 5, 0x8906), (APP_SEL_DSCP, 6, 48)]);
        let d = parse_reply(&r, 7).unwrap().unwrap();
        assert_eq!(d.pfc, [false, false, false, true, false, false, false, false]);
        assert_eq!(d.dscp_prio.into_iter().collect::<Vec<_>>(), [(0, 0), (26, 3), (48, 6)]);
        // other sequence numbers are skipped
        assert_eq!(parse_reply(&r, 8).unwrap(), None);
    }

    #[test]
    fn errors_name_the_cause() {
        let mut body = (-libc::EOPNOTSUPP).to_ne_bytes().to_vec();
        body.extend_from_slice(&request("lo", 3)[..16]);
        let e = parse_reply(&msg(NLMSG_ERROR, 3, &body), 3).unwrap_err();
        assert!(e.contains("DCB netlink") && e.contains("not supported"), "{e}");
        // a driver without ieee_getpfc
        let mut body = vec![0u8, DCB_CMD_IEEE_GET, 0, 0];
        body.extend(nla(DCB_ATTR_IEEE | 0x8000, &nla(1, &[0u8; 59])));
        assert!(parse_reply(&msg(RTM_GETDCB, 1, &body), 1).unwrap_err().contains("no IEEE PFC"));
        assert!(parse_reply(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 1).unwrap_err().contains("malformed"));
    }

    #[test]
    fn live_loopback_has_no_dcb() {
        // Every kernel answers this: lo has no DCB operations (and a kernel
        // without CONFIG_DCB has no RTM_GETDCB handler): EOPNOTSUPP either way.
        match query("lo") {
            Err(e) => assert!(e.starts_with("DCB netlink: Operation not supported"), "{e}"),
            Ok(d) => panic!("lo reported DCB state {d:?}"),
        }
        assert!(query("").unwrap_err().contains("bad interface name"));
    }
}
