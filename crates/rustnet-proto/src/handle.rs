//! The listen handle: the <=128 bytes NCCL ships from the listener to the
//! connector. Byte layout is explicit (little endian), so a handle made on one
//! host decodes on any other.
//!
//! ```text
//!  0  magic   u64  "RUSTNETH"
//!  8  version u16  PROTO_VERSION
//! 10  kind    u8   1 = TCP, 2 = verbs (listener's transport)
//! 11  family  u8   4 or 6
//! 12  port    u16
//! 14  resume  u16  TCP: the listener's resume port (0: none); lets a
//!                  connector whose acceptance was cut off resume
//! 16  addr    [u8; 16]  (IPv4 in the first 4 bytes)
//! 32  scope   u32  IPv6 scope id
//! 36  -       u32
//! 40  nonce   u64  identifies this listener; the connector echoes it
//! 48  stage   u64  connector-local progress token (0 until connect starts)
//! 56..128     reserved, zero
//! ```
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

use crate::error::ProtoError;

/// NCCL_NET_HANDLE_MAXSIZE.
pub const HANDLE_SIZE: usize = 128;
/// Handle magic: "RUSTNETH".
pub const HANDLE_MAGIC: u64 = u64::from_le_bytes(*b"RUSTNETH");
/// Wire protocol version; both sides must agree exactly. 3: the TCP
/// listener answers every hello (accepted, or why not) and `connect`
/// completes only on an acceptance. 4: TCP hellos carry a resume token and
/// replies a resume port; a recovering TCP connection acknowledges what it
/// received ([`crate::resume`]).
pub const PROTO_VERSION: u16 = 4;

/// Which transport a listener speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandleKind {
    /// TCP data streams.
    Tcp = 1,
    /// Verbs, with the exchange over TCP.
    Ib = 2,
}

/// A decoded handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handle {
    /// Listener's transport.
    pub kind: HandleKind,
    /// Listener's TCP address.
    pub addr: SocketAddr,
    /// Listener identity.
    pub nonce: u64,
    /// Connector-local progress token.
    pub stage: u64,
    /// TCP with recovery on: the listening process's resume port (0: none).
    /// A connector whose streams are cut after its hellos, before it read
    /// the acceptance, reconnects there (the comm may already be accepted).
    pub resume_port: u16,
}

impl Handle {
    /// Write into NCCL's handle buffer.
    pub fn encode(&self, out: &mut [u8; HANDLE_SIZE]) {
        out.fill(0);
        out[0..8].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
        out[8..10].copy_from_slice(&PROTO_VERSION.to_le_bytes());
        out[10] = self.kind as u8;
        out[12..14].copy_from_slice(&self.addr.port().to_le_bytes());
        out[14..16].copy_from_slice(&self.resume_port.to_le_bytes());
        match self.addr {
            SocketAddr::V4(a) => {
                out[11] = 4;
                out[16..20].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                out[11] = 6;
                out[16..32].copy_from_slice(&a.ip().octets());
                out[32..36].copy_from_slice(&a.scope_id().to_le_bytes());
            }
        }
        out[40..48].copy_from_slice(&self.nonce.to_le_bytes());
        out[48..56].copy_from_slice(&self.stage.to_le_bytes());
    }

    /// Read and validate NCCL's handle buffer.
    pub fn decode(b: &[u8; HANDLE_SIZE]) -> Result<Handle, ProtoError> {
        let u64at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let magic = u64at(0);
        if magic != HANDLE_MAGIC {
            return Err(ProtoError::HandleMagic { magic });
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != PROTO_VERSION {
            return Err(ProtoError::HandleVersion { version, ours: PROTO_VERSION });
        }
        let kind = match b[10] {
            1 => HandleKind::Tcp,
            2 => HandleKind::Ib,
            k => return Err(ProtoError::HandleTransport(k)),
        };
        let port = u16::from_le_bytes([b[12], b[13]]);
        let addr = match b[11] {
            4 => SocketAddr::new(IpAddr::V4(Ipv4Addr::new(b[16], b[17], b[18], b[19])), port),
            6 => {
                let ip: [u8; 16] = b[16..32].try_into().unwrap();
                let scope = u32::from_le_bytes(b[32..36].try_into().unwrap());
                SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, scope))
            }
            f => return Err(ProtoError::HandleFamily(f)),
        };
        if port == 0 {
            return Err(ProtoError::HandlePortZero);
        }
        Ok(Handle { kind, addr, nonce: u64at(40), stage: u64at(48), resume_port: u16::from_le_bytes([b[14], b[15]]) })
    }

    /// Update only the stage token in an existing buffer.
    pub fn set_stage(b: &mut [u8; HANDLE_SIZE], stage: u64) {
        b[48..56].copy_from_slice(&stage.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_v4_v6() {
        for addr in ["127.0.0.1:4242".parse().unwrap(), "[fe80::1%3]:999".parse::<SocketAddr>().unwrap()] {
            let h = Handle { kind: HandleKind::Tcp, addr, nonce: 0xdead_beef, stage: 0, resume_port: 4711 };
            let mut b = [0u8; HANDLE_SIZE];
            h.encode(&mut b);
            assert_eq!(Handle::decode(&b).unwrap(), h);
            Handle::set_stage(&mut b, 77);
            assert_eq!(Handle::decode(&b).unwrap().stage, 77);
        }
    }

    #[test]
    fn garbage_rejected_with_reason() {
        let mut b = [0xabu8; HANDLE_SIZE];
        assert!(Handle::decode(&b).unwrap_err().to_string().contains("not a librustnet handle"));
        let h = Handle { kind: HandleKind::Ib, addr: "10.0.0.1:5".parse().unwrap(), nonce: 1, stage: 0, resume_port: 0 };
        h.encode(&mut b);
        b[8] = 9;
        assert!(Handle::decode(&b).unwrap_err().to_string().contains("protocol 9"));
        h.encode(&mut b);
        b[11] = 5;
        assert!(Handle::decode(&b).is_err());
    }

    #[test]
    fn fits_nccl_handle() {
        const { assert!(HANDLE_SIZE <= 128) };
    }
}
