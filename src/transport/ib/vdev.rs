//! Several RDMA ports or NICs as one NCCL device ("a+b").
//!
//! Two ways in, one data path:
//! - ABI v6..v8 (NCCL 2.20..2.23 did this inside net_ib): with
//!   `RUSTNET_IB_MERGE_NICS=1` the plugin merges the ports and PCI functions
//!   of one adapter (same PCI path up to the function digit, same system
//!   GUID, same link layer) itself; `RUSTNET_IB_MERGE_NICS="a,b;c,d"` merges
//!   exactly those groups. Merged devices replace their members in the list.
//! - ABI v9/v10: NCCL fuses devices itself and calls `makeVDevice`; the new
//!   device is appended after the others (NCCL's rule). The knob is then not
//!   used for self-merging.
//!
//! A connection on a merged device is one connection per member, rail-aligned
//! (member i of the sender talks to member i of the receiver, each with its
//! own QPs: NCCL_IB_QPS_PER_CONNECTION per member). Every message is cut over
//! the members in 128-byte-aligned chunks of the *receive buffer* (the
//! receiver does not know the send size; the sender learns each member's
//! chunk capacity from that member's CTS before posting, and fills the chunks
//! in order). The handle carries the member listeners' ports (bytes 64..).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::device::IbDev;
use super::p2p::{QpStat, RecvComm, SendComm};
use super::reg::IbMr;
use super::topo::nic_key;
use crate::error::{Error, Result};
use crate::intern::intern;
use crate::profiler::Parent;
use crate::proto::fifo;
use crate::proto::handle::{Handle, HANDLE_SIZE};
use crate::proto::pool::{Pool, ReqId};
use crate::transport::{Completion, DeviceProps, RawBuf, RecvBuf, MAX_RECVS};

/// Most members of one merged device (NCCL_NET_MAX_DEVS_PER_NIC in v9..v11).
pub const MAX_MEMBERS: usize = 4;

static NCCL_FUSES: AtomicBool = AtomicBool::new(false);

/// Called by the v9/v10 `init`: NCCL fuses devices itself (makeVDevice), so
/// the plugin never self-merges.
pub fn set_nccl_fuses(on: bool) {
    NCCL_FUSES.store(on, Ordering::Relaxed);
}

/// Whether NCCL does the fusing (ABI v9+).
pub fn nccl_fuses() -> bool {
    NCCL_FUSES.load(Ordering::Relaxed)
}

/// One device as NCCL sees it.
#[derive(Debug, Clone)]
pub struct Slot {
    /// Physical device indices (one for a plain device).
    pub members: Vec<usize>,
    /// What getProperties reports.
    pub props: DeviceProps,
}

/// `RUSTNET_IB_MERGE_NICS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MergeSpec {
    /// No self-merging.
    Off,
    /// Ports/functions of one adapter.
    ByNic,
    /// Explicit groups of device names.
    Groups(Vec<Vec<String>>),
}

impl MergeSpec {
    /// Parse `0`, `1` or `a,b;c,d`.
    pub fn parse(s: &str) -> std::result::Result<MergeSpec, String> {
        match s.trim() {
            "" | "0" => Ok(MergeSpec::Off),
            "1" => Ok(MergeSpec::ByNic),
            g => {
                let groups: Vec<Vec<String>> = g
                    .split(';')
                    .filter(|x| !x.trim().is_empty())
                    .map(|x| x.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect())
                    .collect();
                if groups.is_empty() || groups.iter().any(|x| x.len() < 2 || x.len() > MAX_MEMBERS) {
                    return Err(format!("RUSTNET_IB_MERGE_NICS={s:?}: groups need 2..{MAX_MEMBERS} device names (\"a,b;c,d\")"));
                }
                Ok(MergeSpec::Groups(groups))
            }
        }
    }
}

/// Members must be 2..=MAX_MEMBERS distinct existing devices with one link layer.
pub fn check_members(devs: &[Arc<IbDev>], members: &[usize]) -> Result<()> {
    if members.len() < 2 || members.len() > MAX_MEMBERS {
        return Err(Error::InvalidArg(format!("a merged device needs 2..{MAX_MEMBERS} members, got {}", members.len())));
    }
    for (i, &m) in members.iter().enumerate() {
        if m >= devs.len() {
            return Err(Error::InvalidArg(format!("member {m} is not a physical device (have {})", devs.len())));
        }
        if members[..i].contains(&m) {
            return Err(Error::InvalidArg(format!("device {m} listed twice in a merged device")));
        }
        let (a, b) = (&devs[members[0]], &devs[m]);
        may_fuse((&a.describe(), a.link_layer, a.iwarp), (&b.describe(), b.link_layer, b.iwarp))?;
    }
    Ok(())
}

/// May a member (name, link layer, iWARP?) fuse with the first one? iWARP
/// ports never fuse: their link layer reads Ethernet like RoCE's, but their
/// QPs connect through rdma_cm and complete through notices per member,
/// which the merged comms do not drive (untested; a member that is not yet
/// cm-ready would fail the merged receive).
fn may_fuse(first: (&str, u8, bool), m: (&str, u8, bool)) -> Result<()> {
    for (name, _, iwarp) in [first, m] {
        if iwarp {
            return Err(Error::Usage(format!(
                "cannot merge {name}: iWARP ports are not fused (rdma_cm connections and notices per member are \
                 not supported in merged devices); use it as a plain device"
            )));
        }
    }
    if first.1 != m.1 {
        return Err(Error::Usage(format!("cannot merge {} and {}: link layers differ", first.0, m.0)));
    }
    Ok(())
}

/// Properties of a merged device: name `a+b`, speed summed, what every
/// member supports, members listed in order (vProps).
pub fn merged_props(devs: &[Arc<IbDev>], members: &[usize]) -> DeviceProps {
    let ps: Vec<DeviceProps> = members.iter().map(|&m| devs[m].props()).collect();
    let name: Vec<String> = members.iter().map(|&m| devs[m].name.clone()).collect();
    DeviceProps {
        name: intern(&name.join("+")),
        speed_mbps: ps.iter().map(|p| p.speed_mbps).sum(),
        ptr_support: ps.iter().fold(!0, |a, p| a & p.ptr_support),
        force_flush: ps.iter().any(|p| p.force_flush),
        max_comms: ps.iter().map(|p| p.max_comms).min().unwrap_or(1),
        ..ps[0]
    }
}

/// The v8 self-merge: groups of physical indices (in device order).
pub fn plan(devs: &[Arc<IbDev>], spec: &MergeSpec) -> Result<Vec<Vec<usize>>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    match spec {
        MergeSpec::Off => {}
        MergeSpec::ByNic => {
            // iWARP ports are never fused (see may_fuse): they stay plain
            for (i, d) in devs.iter().enumerate().filter(|(_, d)| !d.iwarp) {
                let Some(pci) = &d.pci_path else { continue };
                let key = (nic_key(pci), d.guid, d.link_layer);
                match groups.iter_mut().find(|g| {
                    let o = &devs[g[0]];
                    o.pci_path.as_deref().map(nic_key) == Some(key.0.clone()) && o.guid == key.1 && o.link_layer == key.2
                }) {
                    Some(g) if g.len() < MAX_MEMBERS => g.push(i),
                    Some(_) => {}
                    None => groups.push(vec![i]),
                }
            }
            groups.retain(|g| g.len() > 1);
        }
        MergeSpec::Groups(names) => {
            for g in names {
                let mut idx = Vec::new();
                for n in g {
                    let i = devs.iter().position(|d| &d.name == n || &d.dev_name == n).ok_or_else(|| {
                        Error::Usage(format!(
                            "RUSTNET_IB_MERGE_NICS names {n}, which is not a usable device ({})",
                            devs.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ")
                        ))
                    })?;
                    idx.push(i);
                }
                check_members(devs, &idx)?;
                if groups.iter().flatten().any(|x| idx.contains(x)) {
                    return Err(Error::Usage(format!("RUSTNET_IB_MERGE_NICS puts a device in two groups: {g:?}")));
                }
                groups.push(idx);
            }
        }
    }
    Ok(groups)
}

/// The device table NCCL sees: plain devices, with `groups` replacing their members.
pub fn slots(devs: &[Arc<IbDev>], groups: &[Vec<usize>]) -> Vec<Slot> {
    let mut out = Vec::new();
    for (i, d) in devs.iter().enumerate() {
        if let Some(g) = groups.iter().find(|g| g[0] == i) {
            out.push(Slot { members: g.clone(), props: merged_props(devs, g) });
        } else if !groups.iter().flatten().any(|&x| x == i) {
            out.push(Slot { members: vec![i], props: d.props() });
        }
    }
    out
}

// ---------------------------------------------------------------- handle

const EXT: usize = 64;
const EXT_MAGIC: u8 = b'V';

/// Write the member handles into NCCL's handle: member 0's as usual, the
/// others' ports and nonces from byte 64 (all listen on one address).
pub fn encode_handles(hs: &[Handle], out: &mut [u8; HANDLE_SIZE]) {
    hs[0].encode(out);
    if hs.len() > 1 {
        out[EXT] = EXT_MAGIC;
        out[EXT + 1] = hs.len() as u8;
        for (i, h) in hs[1..].iter().enumerate() {
            let o = EXT + 2 + 10 * i;
            out[o..o + 2].copy_from_slice(&h.addr.port().to_le_bytes());
            out[o + 2..o + 10].copy_from_slice(&h.nonce.to_le_bytes());
        }
    }
}

/// The member handles in NCCL's handle (one for a plain device).
pub fn decode_handles(h0: &Handle, b: &[u8; HANDLE_SIZE]) -> Vec<Handle> {
    let mut out = vec![*h0];
    if b[EXT] == EXT_MAGIC && (2..=MAX_MEMBERS).contains(&(b[EXT + 1] as usize)) {
        for i in 0..b[EXT + 1] as usize - 1 {
            let o = EXT + 2 + 10 * i;
            let mut h = Handle { stage: 0, ..*h0 };
            h.addr.set_port(u16::from_le_bytes([b[o], b[o + 1]]));
            h.nonce = u64::from_le_bytes(b[o + 2..o + 10].try_into().unwrap());
            out.push(h);
        }
    }
    out
}

/// Handles of a listener, encoded by [`encode_handles`].
pub struct Handles(pub Vec<Handle>);

impl Handles {
    /// Into NCCL's buffer.
    pub fn encode(&self, out: &mut [u8; HANDLE_SIZE]) {
        encode_handles(&self.0, out)
    }
}

// ---------------------------------------------------------------- set-up

// ---------------------------------------------------------------- data path

/// A merged device's name from its members' ("rxe0+rxe2").
fn merged_name<'a>(members: impl Iterator<Item = &'a str>) -> Arc<str> {
    members.collect::<Vec<_>>().join("+").into()
}

struct MReq {
    ids: [Option<ReqId>; MAX_MEMBERS],
    sizes: [[usize; MAX_RECVS]; MAX_MEMBERS],
    n: usize,
    flush: bool,
}

/// A member refused a request after every member said it would take it:
/// part of the message is posted, so the merged comm cannot go on.
fn out_of_step(what: &str, member: usize) -> Error {
    Error::Internal(format!(
        "{what}: member {member} of a merged device refused its part after every member said it would take it; \
         the other parts are posted, so this comm is failed"
    ))
}

/// The sending end on a merged device.
pub struct MultiSend {
    rails: Vec<SendComm>,
    vdev: usize,
    reqs: Pool<MReq>,
}

impl MultiSend {
    /// Over the member comms `rails` (rail order) of NCCL's device `vdev`.
    pub(super) fn new(mut rails: Vec<SendComm>, vdev: usize) -> MultiSend {
        let name = merged_name(rails.iter().map(|r| r.io.link.dev.name.as_str()));
        for (i, r) in rails.iter_mut().enumerate() {
            r.io.link.member_of = Some((name.clone(), i));
        }
        MultiSend { rails, vdev, reqs: Pool::new(super::p2p::SEND_SLOTS) }
    }

    /// NCCL's device index (the merged device).
    pub fn vdev(&self) -> usize {
        self.vdev
    }

    /// Physical member indices, rail order.
    pub fn members(&self) -> Vec<usize> {
        self.rails.iter().map(|r| r.dev()).collect()
    }

    /// The member comms.
    pub fn rails(&self) -> &[SendComm] {
        &self.rails
    }

    /// The member comms, to change (the recovery keeper).
    pub(super) fn rails_mut(&mut self) -> &mut [SendComm] {
        &mut self.rails
    }

    /// Per member: its name and QP counters.
    pub fn member_stats(&self) -> Vec<(usize, Vec<QpStat>)> {
        self.rails.iter().map(|r| (r.dev(), r.qp_stats())).collect()
    }

    /// Post a send; `mrs[i]` is the registration on member i.
    #[allow(clippy::needless_range_loop)]
    ///
    /// # Safety
    /// As [`SendComm::isend`].
    pub unsafe fn isend(&mut self, buf: RawBuf, tag: i32, mrs: &[Option<&IbMr>]) -> Result<Option<ReqId>> {
        // SAFETY: isend_p's contract is this fn's (`buf` readable and the
        // rails' registrations alive until test reports the request), which
        // our caller promised.
        unsafe { self.isend_p(buf, tag, mrs, None) }
    }

    /// [`Self::isend`] with NCCL's profiler parent handle (every member's
    /// events link to it).
    ///
    /// # Safety
    /// As [`SendComm::isend`].
    #[allow(clippy::needless_range_loop)]
    pub unsafe fn isend_p(&mut self, buf: RawBuf, tag: i32, mrs: &[Option<&IbMr>], parent: Option<Parent>) -> Result<Option<ReqId>> {
        let k = self.rails.len();
        let mut caps = [0usize; MAX_MEMBERS];
        // ask every member, not only up to the first that is not ready: each
        // call drives that member's handshake and reports its failure now
        let mut all = true;
        for (i, r) in self.rails.iter_mut().enumerate() {
            match r.peek_cap(tag)? {
                Some(c) => caps[i] = c,
                None => all = false,
            }
        }
        if !all {
            return Ok(None);
        }
        let Some(id) = self.reqs.alloc(MReq { ids: [None; MAX_MEMBERS], sizes: [[0; MAX_RECVS]; MAX_MEMBERS], n: 1, flush: false }) else {
            return Ok(None);
        };
        let mut off = 0usize;
        for i in 0..k {
            // chunks fill in order; the last member takes the rest (too much
            // for its chunk: it reports the receiver's size error)
            let len = if i + 1 == k { buf.len - off } else { (buf.len - off).min(caps[i]) };
            let sub = RawBuf { ptr: if len > 0 { buf.ptr.wrapping_add(off) } else { buf.ptr }, len };
            let mr = mrs.get(i).copied().flatten();
            let r = &mut self.rails[i];
            // SAFETY: a sub-range of the caller's buffer, same contract.
            let sid = match unsafe { r.isend_p(sub, tag, mr, parent) } {
                Ok(Some(s)) => s,
                // member 0 busy after all: nothing posted yet, NCCL retries
                Ok(None) if i == 0 => {
                    let _ = self.reqs.release(id);
                    return Ok(None);
                }
                Ok(None) => {
                    let _ = self.reqs.release(id);
                    return Err(out_of_step("isend", i));
                }
                Err(e) => {
                    let _ = self.reqs.release(id);
                    return Err(e);
                }
            };
            self.reqs.get_mut(id).unwrap().ids[i] = Some(sid);
            self.reqs.get_mut(id).unwrap().sizes[i][0] = len;
            off += len;
        }
        Ok(Some(id))
    }

    /// Done when every member's part is.
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        let q = self.reqs.get_mut(id).map_err(|s| Error::Usage(format!("test on send request: {s}")))?;
        let mut all = true;
        for (i, r) in self.rails.iter_mut().enumerate() {
            if let Some(sid) = q.ids[i] {
                match r.test(sid) {
                    Ok(Some(_)) => q.ids[i] = None,
                    Ok(None) => all = false,
                    Err(e) => {
                        let _ = self.reqs.release(id);
                        return Err(e);
                    }
                }
            }
        }
        if !all {
            return Ok(None);
        }
        let q = self.reqs.release(id).unwrap();
        Ok(Some(Completion::one(q.sizes.iter().map(|s| s[0]).sum())))
    }
}

/// The receiving end on a merged device.
pub struct MultiRecv {
    rails: Vec<RecvComm>,
    vdev: usize,
    reqs: Pool<MReq>,
}

impl MultiRecv {
    /// Over the member comms `rails` (rail order) of NCCL's device `vdev`.
    pub(super) fn new(mut rails: Vec<RecvComm>, vdev: usize) -> MultiRecv {
        let name = merged_name(rails.iter().map(|r| r.io.link.dev.name.as_str()));
        for (i, r) in rails.iter_mut().enumerate() {
            r.io.link.member_of = Some((name.clone(), i));
        }
        MultiRecv { rails, vdev, reqs: Pool::new(super::p2p::RECV_POOL) }
    }

    /// NCCL's device index (the merged device).
    pub fn vdev(&self) -> usize {
        self.vdev
    }

    /// Physical member indices, rail order.
    pub fn members(&self) -> Vec<usize> {
        self.rails.iter().map(|r| r.dev()).collect()
    }

    /// The member comms.
    pub fn rails(&self) -> &[RecvComm] {
        &self.rails
    }

    /// The member comms, to change (the recovery keeper).
    pub(super) fn rails_mut(&mut self) -> &mut [RecvComm] {
        &mut self.rails
    }

    /// Per member: its device index and QP counters.
    pub fn member_stats(&self) -> Vec<(usize, Vec<QpStat>)> {
        self.rails.iter().map(|r| (r.dev(), r.qp_stats())).collect()
    }

    /// Post a (grouped) receive; `mrs[j][i]` is buffer j's registration on member i.
    ///
    /// # Safety
    /// As [`RecvComm::irecv`].
    pub unsafe fn irecv(&mut self, bufs: &[RecvBuf], mrs: &[&[Option<&IbMr>]]) -> Result<Option<ReqId>> {
        // SAFETY: irecv_p's contract is this fn's (every buffer writable and
        // its rails' registrations alive until test reports the request),
        // which our caller promised.
        unsafe { self.irecv_p(bufs, mrs, &[]) }
    }

    /// [`Self::irecv`] with NCCL's profiler parent handle of each buffer.
    ///
    /// # Safety
    /// As [`RecvComm::irecv`].
    pub unsafe fn irecv_p(&mut self, bufs: &[RecvBuf], mrs: &[&[Option<&IbMr>]], parents: &[Option<Parent>]) -> Result<Option<ReqId>> {
        let k = self.rails.len();
        let n = bufs.len().min(MAX_RECVS);
        // post on no member unless every member takes it now (and ask them
        // all: each answer reaps that member's completions and failure)
        let mut all = true;
        for r in self.rails.iter_mut() {
            all &= r.can_take_recv()?;
        }
        if !all {
            return Ok(None);
        }
        let Some(id) = self.reqs.alloc(MReq { ids: [None; MAX_MEMBERS], sizes: [[0; MAX_RECVS]; MAX_MEMBERS], n, flush: false }) else {
            return Ok(None);
        };
        for i in 0..k {
            let mut sub = [RecvBuf { buf: RawBuf::EMPTY, tag: 0 }; MAX_RECVS];
            let mut smr: [Option<&IbMr>; MAX_RECVS] = [None; MAX_RECVS];
            for j in 0..n {
                let (off, len) = fifo::chunk(bufs[j].buf.len, i, k);
                sub[j] = RecvBuf { buf: RawBuf { ptr: bufs[j].buf.ptr.wrapping_add(off), len }, tag: bufs[j].tag };
                smr[j] = mrs.get(j).and_then(|m| m.get(i)).copied().flatten();
            }
            let r = &mut self.rails[i];
            // SAFETY: sub-ranges of the caller's buffers, same contract.
            let rid = match unsafe { r.irecv_p(&sub[..n], &smr[..n], parents) } {
                Ok(Some(x)) => Ok(x),
                // member 0 busy after all: nothing posted yet, NCCL retries
                Ok(None) if i == 0 => {
                    let _ = self.reqs.release(id);
                    return Ok(None);
                }
                Ok(None) => Err(out_of_step("irecv", i)),
                Err(e) => Err(e),
            };
            match rid {
                Ok(x) => self.reqs.get_mut(id).unwrap().ids[i] = Some(x),
                Err(e) => {
                    let _ = self.reqs.release(id);
                    return Err(e);
                }
            }
        }
        Ok(Some(id))
    }

    /// Done when every member's part is; sizes are the sums.
    #[allow(clippy::needless_range_loop)]
    pub fn test(&mut self, id: ReqId) -> Result<Option<Completion>> {
        let q = self.reqs.get_mut(id).map_err(|s| Error::Usage(format!("test on receive request: {s}")))?;
        let mut all = true;
        for (i, r) in self.rails.iter_mut().enumerate() {
            if let Some(sid) = q.ids[i] {
                match r.test(sid) {
                    Ok(Some(c)) => {
                        q.ids[i] = None;
                        q.sizes[i][..c.n].copy_from_slice(&c.sizes[..c.n]);
                    }
                    Ok(None) => all = false,
                    Err(e) => {
                        let _ = self.reqs.release(id);
                        return Err(e);
                    }
                }
            }
        }
        if !all {
            return Ok(None);
        }
        let q = self.reqs.release(id).unwrap();
        let mut c = Completion { n: if q.flush { 0 } else { q.n }, sizes: [0; MAX_RECVS] };
        for s in &q.sizes {
            for j in 0..q.n {
                c.sizes[j] += s[j];
            }
        }
        Ok(Some(c))
    }

    /// Flush on every member that needs it; `Ok(None)` when none does.
    pub fn iflush(&mut self, bufs: &[RawBuf], mrs: &[&[Option<&IbMr>]]) -> Result<Option<ReqId>> {
        let mut ids = [None; MAX_MEMBERS];
        for (i, r) in self.rails.iter_mut().enumerate() {
            // member i's registration of each buffer
            let mut m: [Option<&IbMr>; MAX_RECVS] = [None; MAX_RECVS];
            for (o, per) in m.iter_mut().zip(mrs) {
                *o = per.get(i).copied().flatten();
            }
            ids[i] = r.iflush(bufs, &m[..bufs.len().min(MAX_RECVS)])?;
        }
        if ids.iter().all(Option::is_none) {
            return Ok(None);
        }
        // never Ok(None) once members flush: to NCCL that would mean "nothing to flush"
        self.reqs
            .alloc(MReq { ids, sizes: [[0; MAX_RECVS]; MAX_MEMBERS], n: 0, flush: true })
            .map(Some)
            .ok_or_else(|| Error::Internal("iflush: every request slot of the merged receive comm is in use".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iwarp_ports_are_never_fused() {
        use crate::transport::ib::device::{LINK_ETH, LINK_IB};
        let (roce, iw) = (("rxe0:1/RoCE", LINK_ETH, false), ("siw0:1/iWARP", LINK_ETH, true));
        let e = may_fuse(roce, iw).unwrap_err().to_string();
        assert!(e.contains("siw0:1/iWARP") && e.contains("iWARP ports are not fused"), "{e}");
        assert!(may_fuse(iw, roce).is_err(), "either order");
        assert!(may_fuse(iw, ("siw1:1/iWARP", LINK_ETH, true)).is_err(), "two iWARP ports neither");
        assert!(may_fuse(roce, ("rxe1:1/RoCE", LINK_ETH, false)).is_ok());
        let e = may_fuse(roce, ("mlx5_0:1/IB", LINK_IB, false)).unwrap_err().to_string();
        assert!(e.contains("link layers differ"), "{e}");
    }
    use crate::proto::handle::HandleKind;

    #[test]
    fn merge_spec_parses_off_bynic_and_groups() {
        assert_eq!(MergeSpec::parse("0").unwrap(), MergeSpec::Off);
        assert_eq!(MergeSpec::parse(" ").unwrap(), MergeSpec::Off);
        assert_eq!(MergeSpec::parse("1").unwrap(), MergeSpec::ByNic);
        assert_eq!(
            MergeSpec::parse("rxe0,rxe2;rxe1, rxe3").unwrap(),
            MergeSpec::Groups(vec![vec!["rxe0".into(), "rxe2".into()], vec!["rxe1".into(), "rxe3".into()]])
        );
        assert!(MergeSpec::parse("rxe0").unwrap_err().contains("2..4"));
        assert!(MergeSpec::parse("a,b,c,d,e").is_err());
    }

    #[test]
    fn member_handles_ride_in_one_nccl_handle() {
        let h = |port: u16, nonce: u64| Handle {
            kind: HandleKind::Ib,
            addr: format!("10.199.0.1:{port}").parse().unwrap(),
            nonce,
            stage: 0,
            resume_port: 0,
        };
        let hs = vec![h(4000, 1), h(4001, 0xdead_beef_0000_0001), h(4002, 3), h(4003, u64::MAX)];
        let mut b = [0u8; HANDLE_SIZE];
        Handles(hs.clone()).encode(&mut b);
        let h0 = Handle::decode(&b).unwrap();
        assert_eq!(h0, hs[0], "member 0 is a plain handle");
        assert_eq!(decode_handles(&h0, &b), hs);
        // the progress token NCCL's retries carry does not touch the members
        Handle::set_stage(&mut b, 77);
        assert_eq!(decode_handles(&Handle::decode(&b).unwrap(), &b)[1..], hs[1..]);
        // a plain handle decodes to one member
        let mut p = [0u8; HANDLE_SIZE];
        hs[0].encode(&mut p);
        assert_eq!(decode_handles(&hs[0], &p), vec![hs[0]]);
    }
}
