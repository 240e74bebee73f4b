//! Listen, connect and accept for TCP connections: all non-blocking, and
//! `connect` never waits for `accept` (NCCL drives both from one thread in
//! some paths).
use std::collections::HashMap;
use std::net::SocketAddr;

use super::p2p::{RecvComm, SendComm};
use super::sys::{Io, Socket};
use super::StreamCfg;
use crate::error::{Error, Result};
use crate::proto::handle::{Handle, HandleKind, PROTO_VERSION};
use crate::proto::wire::{Hello, HELLO_LEN};

/// A random 64-bit id (listener nonces, connection ids). These tell
/// connections apart and are not secrets, so the call never waits for the
/// kernel's entropy pool (a freshly booted VM or container host may not have
/// one yet, and a blocking getrandom stalls connection set-up for seconds).
pub fn random_u64() -> u64 {
    let mut v = [0u8; 8];
    // SAFETY: v is a valid 8-byte buffer. GRND_INSECURE (Linux 5.6+) never
    // blocks; older kernels reject it and GRND_NONBLOCK is tried.
    let mut r = unsafe { libc::getrandom(v.as_mut_ptr() as *mut libc::c_void, 8, libc::GRND_INSECURE) };
    if r != 8 {
        // SAFETY: as above.
        r = unsafe { libc::getrandom(v.as_mut_ptr() as *mut libc::c_void, 8, libc::GRND_NONBLOCK) };
    }
    if r != 8 {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        return t ^ ((std::process::id() as u64) << 32) ^ (&v as *const _ as u64);
    }
    u64::from_ne_bytes(v) | 1
}

/// A socket we accepted, until its hello is complete.
struct Pending {
    sock: Socket,
    peer: SocketAddr,
    buf: [u8; HELLO_LEN],
    got: usize,
}

/// Streams of one incoming connection, gathered by connection id.
struct Group {
    nstreams: usize,
    streams: Vec<Option<Socket>>,
    peer: SocketAddr,
}

/// A listening endpoint.
pub struct TcpListen {
    sock: Socket,
    addr: SocketAddr,
    nonce: u64,
    kind: HandleKind,
    pending: Vec<Pending>,
    groups: HashMap<u64, Group>,
    cfg: StreamCfg,
}

impl TcpListen {
    /// Listen on `local` (port 0); returns the endpoint and its handle.
    pub fn new(local: SocketAddr, kind: HandleKind, cfg: StreamCfg) -> Result<(TcpListen, Handle)> {
        let (sock, addr) = Socket::listen(local)?;
        let nonce = random_u64();
        let h = Handle { kind, addr, nonce, stage: 0 };
        Ok((TcpListen { sock, addr, nonce, kind, pending: Vec::new(), groups: HashMap::new(), cfg }, h))
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Accept whatever has arrived; `Ok(None)` until one connection has all
    /// its streams. Strangers speaking anything else are dropped with a WARN
    /// and the listener keeps serving.
    pub fn accept_streams(&mut self) -> Result<Option<(Vec<Socket>, SocketAddr)>> {
        while let Some((sock, peer)) = self.sock.accept()? {
            self.pending.push(Pending { sock, peer, buf: [0; HELLO_LEN], got: 0 });
        }
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let res = p.sock.read(&mut p.buf[p.got..]);
            let drop_reason = match res {
                Ok(Io::Done(n)) => {
                    p.got += n;
                    if p.got < HELLO_LEN {
                        i += 1;
                        continue;
                    }
                    match Hello::decode(&p.buf, self.nonce) {
                        Ok(h) => {
                            let p = self.pending.swap_remove(i);
                            self.add_stream(h, p)?;
                            continue;
                        }
                        Err(why) => why,
                    }
                }
                Ok(Io::Again) => {
                    i += 1;
                    continue;
                }
                Ok(Io::Eof) => format!("closed after {} of {} hello bytes", p.got, HELLO_LEN),
                Err(e) => format!("read failed: {e}"),
            };
            let p = self.pending.swap_remove(i);
            tracing::warn!("listener {}: rejected connection from {}: {}", self.addr, p.peer, drop_reason);
        }
        let ready = self.groups.iter().find(|(_, g)| g.streams.iter().all(Option::is_some)).map(|(k, _)| *k);
        if let Some(id) = ready {
            let g = self.groups.remove(&id).unwrap();
            let socks: Vec<Socket> = g.streams.into_iter().map(Option::unwrap).collect();
            for s in &socks {
                s.tune_stream(self.cfg.timeout_s, self.cfg.bufsize)?;
            }
            return Ok(Some((socks, g.peer)));
        }
        self.check_groups()?;
        Ok(None)
    }

    /// A connection whose hello carried our nonce is a real peer: if it
    /// closes a stream before its other streams arrived (its connect failed
    /// half-way), nothing more will come and waiting would hang this rank's
    /// accept, so that is an error.
    fn check_groups(&mut self) -> Result<()> {
        let closed = self.groups.iter().find_map(|(id, g)| {
            g.streams.iter().enumerate().find_map(|(k, s)| match s.as_ref()?.peer_closed() {
                Ok(false) => None,
                Ok(true) => Some((*id, k, "closed".to_string())),
                Err(e) => Some((*id, k, format!("failed ({e})"))),
            })
        });
        let Some((id, k, why)) = closed else { return Ok(()) };
        let g = self.groups.remove(&id).expect("found above");
        let missing = g.streams.iter().filter(|s| s.is_none()).count();
        Err(Error::Remote {
            peer: g.peer.to_string(),
            what: format!(
                "{why} stream {k} of its {}-stream connection while {missing} stream(s) had not arrived \
                 (its connect failed part-way; see that rank's log)",
                g.nstreams
            ),
        })
    }

    fn add_stream(&mut self, h: Hello, p: Pending) -> Result<()> {
        let g = self.groups.entry(h.conn_id).or_insert_with(|| Group {
            nstreams: h.nstreams as usize,
            streams: (0..h.nstreams).map(|_| None).collect(),
            peer: p.peer,
        });
        if g.nstreams != h.nstreams as usize || g.streams[h.stream as usize].is_some() {
            tracing::warn!(
                "listener {}: rejected stream {}/{} from {}: inconsistent with its connection",
                self.addr,
                h.stream,
                h.nstreams,
                p.peer
            );
            return Ok(());
        }
        g.streams[h.stream as usize] = Some(p.sock);
        Ok(())
    }

    /// Accept a full TCP data connection.
    pub fn accept(&mut self) -> Result<Option<RecvComm>> {
        debug_assert_eq!(self.kind, HandleKind::Tcp);
        Ok(self.accept_streams()?.map(|(socks, peer)| RecvComm::new(socks, peer, self.cfg)))
    }
}

struct ConnStream {
    sock: Socket,
    connected: bool,
    hello: [u8; HELLO_LEN],
    sent: usize,
}

/// An outgoing connection in progress.
pub struct TcpConnecting {
    peer: SocketAddr,
    streams: Vec<ConnStream>,
    cfg: StreamCfg,
}

impl TcpConnecting {
    /// Open `nstreams` sockets to the listener in `h`.
    pub fn start(h: &Handle, nstreams: usize, cfg: StreamCfg) -> Result<TcpConnecting> {
        let conn_id = random_u64();
        let mut streams = Vec::with_capacity(nstreams);
        for i in 0..nstreams {
            let sock = Socket::connect_start(h.addr)?;
            let hello = Hello { version: PROTO_VERSION, stream: i as u16, nstreams: nstreams as u16, conn_id, nonce: h.nonce }.encode();
            streams.push(ConnStream { sock, connected: false, hello, sent: 0 });
        }
        Ok(TcpConnecting { peer: h.addr, streams, cfg })
    }

    /// Advance; `Ok(true)` once every stream is connected and has sent its hello.
    pub fn progress(&mut self) -> Result<bool> {
        let mut all = true;
        for s in &mut self.streams {
            if !s.connected {
                s.connected = s.sock.connect_done(&self.peer)?;
                if !s.connected {
                    all = false;
                    continue;
                }
                s.sock.tune_stream(self.cfg.timeout_s, self.cfg.bufsize)?;
            }
            while s.sent < HELLO_LEN {
                match s.sock.write(&s.hello[s.sent..]) {
                    Ok(Io::Done(n)) => s.sent += n,
                    Ok(_) => break,
                    Err(e) => return Err(Error::Remote { peer: self.peer.to_string(), what: format!("sending hello: {e}") }),
                }
            }
            all &= s.sent == HELLO_LEN;
        }
        Ok(all)
    }

    /// The connected sockets (after `progress` returned true).
    pub fn into_streams(self) -> (Vec<Socket>, SocketAddr) {
        (self.streams.into_iter().map(|s| s.sock).collect(), self.peer)
    }

    /// Finish as a TCP send comm.
    pub fn into_send_comm(self) -> SendComm {
        let cfg = self.cfg;
        let (socks, peer) = self.into_streams();
        SendComm::new(socks, peer, cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    fn listener() -> (TcpListen, Handle) {
        let cfg = StreamCfg { nstreams: 2, min_chunk: 4096, timeout_s: 30, bufsize: 0, helper: false };
        TcpListen::new("127.0.0.1:0".parse().unwrap(), HandleKind::Tcp, cfg).unwrap()
    }

    fn hello(h: &Handle, conn_id: u64, stream: u16) -> [u8; HELLO_LEN] {
        Hello { version: PROTO_VERSION, stream, nstreams: 2, conn_id, nonce: h.nonce }.encode()
    }

    /// Call accept_streams until it answers something other than "not yet".
    fn settle(l: &mut TcpListen) -> Result<Option<(Vec<Socket>, SocketAddr)>> {
        let t0 = Instant::now();
        loop {
            match l.accept_streams() {
                Ok(None) if t0.elapsed() < Duration::from_millis(500) => std::thread::sleep(Duration::from_millis(5)),
                other => return other,
            }
        }
    }

    #[test]
    fn peer_closing_a_stream_before_the_rest_arrive_fails_accept() {
        let (mut l, h) = listener();
        let mut s0 = TcpStream::connect(h.addr).unwrap();
        s0.write_all(&hello(&h, 7, 0)).unwrap();
        assert!(settle(&mut l).unwrap().is_none(), "one of two streams: not yet");
        drop(s0); // its connect failed before stream 1
        let e = match settle(&mut l) {
            Err(e) => e.to_string(),
            Ok(r) => panic!("accept kept waiting for a connection that cannot complete: {:?}", r.map(|x| x.1)),
        };
        assert!(e.contains("closed stream 0 of its 2-stream connection") && e.contains("1 stream(s) had not arrived"), "{e}");
        // the listener serves the next connection
        let mut a = TcpStream::connect(h.addr).unwrap();
        let mut b = TcpStream::connect(h.addr).unwrap();
        a.write_all(&hello(&h, 8, 0)).unwrap();
        b.write_all(&hello(&h, 8, 1)).unwrap();
        assert_eq!(settle(&mut l).unwrap().unwrap().0.len(), 2);
    }

    #[test]
    fn an_incomplete_connection_that_is_alive_keeps_its_early_data() {
        let (mut l, h) = listener();
        let mut s0 = TcpStream::connect(h.addr).unwrap();
        s0.write_all(&hello(&h, 9, 0)).unwrap();
        // the sender may start sending on stream 0 as soon as its hellos are out
        s0.write_all(b"early bytes").unwrap();
        assert!(settle(&mut l).unwrap().is_none());
        let mut s1 = TcpStream::connect(h.addr).unwrap();
        s1.write_all(&hello(&h, 9, 1)).unwrap();
        let (socks, _) = settle(&mut l).unwrap().expect("both streams arrived");
        let mut got = [0u8; 11];
        let mut n = 0;
        let t0 = Instant::now();
        while n < got.len() && t0.elapsed() < Duration::from_secs(5) {
            if let Ok(Io::Done(k)) = socks[0].read(&mut got[n..]) {
                n += k;
            }
        }
        assert_eq!(&got, b"early bytes", "the liveness look must not take data");
        drop(s1);
    }
}
