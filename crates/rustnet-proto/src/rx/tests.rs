//! Unit tests of the receiver machine (`rx.rs`; kept apart: the machine reads better alone).
use super::*;
use crate::eager::{Header, MAILBOX_BYTES};
use crate::fifo::{FailCode, SIZES_SLOT_BYTES};

fn cfg(nqps: usize, split: bool, eager: usize) -> Config {
    Config { nqps, split, eager, sq_depth: 128, late_ring: false }
}

fn elems(tags: &[i32], cap: u32, addr: u64) -> Vec<Cts> {
    let n = tags.len() as u8;
    tags.iter().enumerate().map(|(i, &tag)| Cts { addr: addr + 0x1000 * i as u64, rkey: 9, cap, tag, n, i: i as u8 }).collect()
}

fn take(rx: &mut Receiver, tags: &[i32], cap: u32) -> Taken {
    rx.take_recv(&elems(tags, cap, 0x10_0000), &mut |d| panic!("unexpected delivery {d:?}")).unwrap().unwrap()
}

/// Every chain planned now: (qp, writes).
fn chains(rx: &mut Receiver, stage: &mut [u8]) -> Vec<Vec<CtlWr>> {
    let mut out = Vec::new();
    let mut c = CtlChain::default();
    while rx.poll_ctl(stage, &mut c) {
        assert_eq!(c.qp, 0);
        out.push(c.wrs().to_vec());
    }
    out
}

fn stage() -> Vec<u8> {
    vec![0; FIFO_BYTES + 64]
}

fn no_sizes(_: u64) -> [u32; MAX_RECVS] {
    panic!("sizes slot read for a single receive")
}

#[test]
fn cts_waits_for_ready_then_consecutive_receives_are_one_write() {
    let mut rx = Receiver::new(cfg(1, false, 0));
    let mut st = stage();
    for seq in 0..3 {
        assert_eq!(take(&mut rx, &[7], 100).seq, seq);
    }
    assert!(chains(&mut rx, &mut st).is_empty(), "nothing before READY");
    rx.on_ready();
    assert!(rx.has_ctl());
    let c = chains(&mut rx, &mut st);
    assert!(!rx.has_ctl());
    assert_eq!(c.len(), 1);
    assert_eq!((c[0][0].off, c[0][0].len), (fifo::slot_offset(0), 3 * ELEM_BYTES));
    for q in 0..3 {
        let mut b = [0u8; ELEM_BYTES];
        st.as_slice().read(fifo::elem_offset(q, 0), &mut b);
        assert!(matches!(Cts::decode(&b, q, 0), fifo::Slot::Ready(c) if c.tag == 7 && c.cap == 100));
    }
    assert_eq!(rx.cts_written(), 3);
    assert!(chains(&mut rx, &mut st).is_empty());
}

#[test]
fn grouped_receives_write_further_elements_and_chains_are_cut() {
    let mut rx = Receiver::new(cfg(1, false, 0));
    rx.on_ready();
    let mut st = stage();
    assert_eq!(rx.next_lanes(), (0, 0, 1));
    take(&mut rx, &[1, 2, 3], 10);
    assert_eq!(rx.in_flight(), 1);
    let c = chains(&mut rx, &mut st);
    let offs: Vec<usize> = c[0].iter().map(|w| w.off).collect();
    assert_eq!(offs, [fifo::elem_offset(0, 0), fifo::elem_offset(0, 1), fifo::elem_offset(0, 2)]);
    // three receives of 8 buffers together: 1 + 3 x 7 writes, cut at CHAIN
    rx.force_cts();
    let mut rx = Receiver::new(cfg(1, false, 0));
    for _ in 0..3 {
        take(&mut rx, &[1; 8], 10);
    }
    rx.on_ready();
    let c = chains(&mut rx, &mut st);
    assert_eq!(c.iter().map(Vec::len).collect::<Vec<_>>(), [CHAIN, 22 - CHAIN]);
    assert_eq!(rx.cts_written(), 3);
}

#[test]
fn an_immediate_completes_its_receive_with_the_exact_size() {
    let mut rx = Receiver::new(cfg(1, false, 0));
    rx.on_ready();
    let t = take(&mut rx, &[1], 100);
    let ev = rx.on_imm(Imm::new(0, ImmKind::Size(37)).encode(), None, no_sizes).unwrap();
    assert_eq!((ev.id, ev.seq, ev.n), (t.id, 0, 1));
    assert_eq!(ev.sizes.unwrap()[0], 37);
    assert_eq!(rx.is_done(t.id), Ok(true));
    assert_eq!(rx.finish(t.id).unwrap().unwrap().sizes[0], 37);
    assert_eq!(rx.live(), 0);
    // the slot holds no receive any more
    assert!(matches!(rx.on_imm(Imm::new(0, ImmKind::Size(1)).encode(), None, no_sizes), Err(ProtoError::ImmNoReceive { slot: 0, .. })));
}

#[test]
fn split_lanes_and_grouped_sizes() {
    let mut rx = Receiver::new(cfg(2, true, 0));
    rx.on_ready();
    let t = take(&mut rx, &[1, 2], 100);
    assert_eq!(t.nlanes, 2);
    let w = Imm::new(0, ImmKind::Sizes(2)).encode();
    assert_eq!(rx.on_imm(w, None, no_sizes).unwrap().sizes, None, "one lane of two");
    let sizes = |seq: u64| {
        assert_eq!(seq, 0);
        let mut s = [0; MAX_RECVS];
        s[..2].copy_from_slice(&[100, 0]);
        s
    };
    assert_eq!(&rx.on_imm(w, None, sizes).unwrap().sizes.unwrap()[..2], &[100, 0]);
    assert_eq!(rx.is_done(t.id), Ok(true));
    let _ = SIZES_SLOT_BYTES;
}

#[test]
fn bad_words_are_typed() {
    let mut rx = Receiver::new(cfg(1, false, 0));
    rx.on_ready();
    take(&mut rx, &[1], 10);
    assert!(matches!(
        rx.on_imm(Imm::new(0, ImmKind::Size(11)).encode(), None, no_sizes),
        Err(ProtoError::ImmOverflow { size: 11, cap: 10 })
    ));
    let mut rx = Receiver::new(cfg(1, false, 0));
    take(&mut rx, &[1], 10);
    let e = rx.on_imm(Imm::new(0, ImmKind::Fail(FailCode::TooLarge)).encode(), None, no_sizes).unwrap_err();
    assert_eq!(e, ProtoError::SenderTooLarge);
    assert!(e.is_size_mismatch());
    assert!(matches!(rx.on_imm(0x8000_0000, None, no_sizes), Err(ProtoError::Imm(_))));
}

#[test]
fn a_slot_is_reused_only_after_its_receive_completed() {
    let mut rx = Receiver::new(cfg(1, false, 0));
    rx.on_ready();
    let mut st = stage();
    for _ in 0..FIFO_DEPTH {
        take(&mut rx, &[1], 10);
    }
    chains(&mut rx, &mut st);
    assert!(!rx.slot_free() && !rx.can_take());
    assert_eq!(rx.take_recv(&elems(&[1], 10, 0), &mut |_| ()).unwrap(), None);
    rx.on_imm(Imm::new(0, ImmKind::Size(1)).encode(), None, no_sizes).unwrap();
    assert!(rx.can_take());
    // its CTS waits until the sender moved past slot 0 (the completion said so)
    assert_eq!(take(&mut rx, &[1], 10).seq, FIFO_DEPTH as u64);
    assert_eq!(chains(&mut rx, &mut st).len(), 1);
}

/// Write ring message `idx` as the sender would.
fn ring_msg(ring: &mut [u8], max: usize, idx: u64, h: Header, payload: &[u8]) {
    let off = eager::slot_offset(idx, max);
    ring[off..off + HDR_BYTES].copy_from_slice(&h.encode(idx));
    ring[off + HDR_BYTES..off + HDR_BYTES + payload.len()].copy_from_slice(payload);
    let end = off + eager::wire_len(payload.len()) - 8;
    ring[end..end + 8].copy_from_slice(&eager::marker(idx).to_le_bytes());
}

#[test]
fn eager_messages_are_delivered_posted_or_early() {
    let max = 64;
    let mut rx = Receiver::new(cfg(1, false, max));
    rx.on_ready();
    let mut ring = vec![0u8; eager::ring_bytes(max)];
    let t = take(&mut rx, &[5], 64);
    ring_msg(&mut ring, max, 0, Header { j: 0, size: 3, tag: 5, head: 0 }, b"abc");
    let mut got = Vec::new();
    assert_eq!(rx.poll_ring(&ring[..], &mut |d| got.push(*d)), Ok((1, false)));
    assert_eq!(got, [Deliver { idx: 0, src: MAILBOX_BYTES + HDR_BYTES, dst: 0x10_0000, len: 3, id: t.id, i: 0 }]);
    assert_eq!(rx.finish(t.id).unwrap().unwrap().sizes[0], 3);
    // a message before its buffer: kept in the ring, copied when the buffer is posted
    ring_msg(&mut ring, max, 1, Header { j: 1, size: 2, tag: 5, head: 1 }, b"xy");
    assert_eq!(rx.poll_ring(&ring[..], &mut |d| panic!("{d:?}")), Ok((1, false)));
    let mut got = Vec::new();
    let t = rx.take_recv(&elems(&[5], 8, 0x20_0000), &mut |d| got.push(*d)).unwrap().unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].len, got[0].dst), (2, 0x20_0000));
    assert_eq!(rx.is_done(t.id), Ok(true));
    assert_eq!(rx.eager_stats(), (2, 5));
}

#[test]
fn the_mailbox_flushes_deferred_cts_and_credits_go_with_them() {
    let max = 64;
    let mut rx = Receiver::new(cfg(1, false, max));
    rx.on_ready();
    let mut st = stage();
    let mut ring = vec![0u8; eager::ring_bytes(max)];
    take(&mut rx, &[5], 100); // may need a rendezvous: written at once
    assert_eq!(chains(&mut rx, &mut st).len(), 1);
    let t1 = take(&mut rx, &[5], 64); // eager-only: deferred
    assert!(chains(&mut rx, &mut st).is_empty());
    // an eager message for it, and the sender says it waits at slot 1
    ring_msg(&mut ring, max, 0, Header { j: 1, size: 1, tag: 5, head: 1 }, b"z");
    ring[0..8].copy_from_slice(&2u64.to_le_bytes());
    // (the mailbox is news: a quiet test() call would otherwise skip the writes)
    assert_eq!(rx.poll_ring(&ring[..], &mut |_| ()), Ok((1, true)));
    assert!(rx.credit_due());
    assert_eq!(rx.is_done(t1.id), Ok(true));
    let c = chains(&mut rx, &mut st);
    // CTS 1 and the credit word (1 slot freed) in one chain
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].iter().map(|w| (w.off, w.len)).collect::<Vec<_>>(), [(fifo::slot_offset(1), ELEM_BYTES), (CREDIT_OFF, 8)]);
    assert_eq!(st.as_slice().read_u64(CREDIT_OFF), 1);
    // the same mailbox value again is not news
    assert_eq!(rx.poll_ring(&ring[..], &mut |_| ()), Ok((0, false)));
    assert!(chains(&mut rx, &mut st).is_empty());
}

#[test]
fn eager_violations_are_typed() {
    let max = 64;
    let mk = || {
        let mut rx = Receiver::new(cfg(1, false, max));
        rx.on_ready();
        take(&mut rx, &[5], 4);
        rx
    };
    let mut ring = vec![0u8; eager::ring_bytes(max)];
    ring_msg(&mut ring, max, 0, Header { j: 0, size: 1, tag: 6, head: 0 }, b"a");
    assert!(matches!(mk().poll_ring(&ring[..], &mut |_| ()), Err(ProtoError::EagerTag { tag: 6, .. })));
    let mut ring = vec![0u8; eager::ring_bytes(max)];
    let off = eager::slot_offset(0, max);
    ring[off..off + HDR_BYTES].copy_from_slice(&Header { j: 0, size: 65, tag: 5, head: 0 }.encode(0));
    assert!(matches!(mk().poll_ring(&ring[..], &mut |_| ()), Err(ProtoError::EagerSize { size: 65, .. })));
    let mut ring = vec![0u8; eager::ring_bytes(max)];
    ring_msg(&mut ring, max, 0, Header { j: 0, size: 5, tag: 5, head: 0 }, b"abcde");
    let e = mk().poll_ring(&ring[..], &mut |_| ()).unwrap_err();
    assert!(matches!(e, ProtoError::EagerOverflow { size: 5, cap: 4, .. }) && e.is_size_mismatch());
    // a message whose payload has not fully landed waits
    let mut ring = vec![0u8; eager::ring_bytes(max)];
    ring_msg(&mut ring, max, 0, Header { j: 0, size: 3, tag: 5, head: 0 }, b"abc");
    let end = off + eager::wire_len(3) - 8;
    ring[end..end + 8].fill(0);
    assert_eq!(mk().poll_ring(&ring[..], &mut |_| ()), Ok((0, false)));
}

#[test]
fn a_late_ring_defers_nothing_until_made_and_its_address_goes_first() {
    let max = 64;
    let mut rx = Receiver::new(Config { late_ring: true, ..cfg(1, false, max) });
    rx.on_ready();
    let mut st = stage();
    assert!(rx.ring_missing());
    take(&mut rx, &[5], 100);
    assert!(!rx.ring_wanted(), "a receive a rendezvous may fill wants no ring");
    // eager-only, but without a ring nothing can fill it eagerly: written
    // at once; it wants the ring made (the receives after it may then wait)
    take(&mut rx, &[5], 64);
    assert!(rx.ring_wanted());
    let c = chains(&mut rx, &mut st);
    assert_eq!(c.concat().iter().map(|w| (w.off, w.len)).collect::<Vec<_>>(), [(fifo::slot_offset(0), 2 * ELEM_BYTES)]);
    // the sender asked: the ring is made, its address staged and written before anything else
    rx.ring_made(&mut st[..], 0x7000, 0x42);
    assert!(!rx.ring_missing() && !rx.ring_wanted() && rx.has_ctl());
    take(&mut rx, &[5], 100);
    let c = chains(&mut rx, &mut st);
    assert_eq!(
        c.concat().iter().map(|w| (w.off, w.len)).collect::<Vec<_>>(),
        [(RING_ANN_OFF, RING_ANN_BYTES), (fifo::slot_offset(2), ELEM_BYTES)]
    );
    let mut b = [0u8; RING_ANN_BYTES];
    st.as_slice().read(RING_ANN_OFF, &mut b);
    assert_eq!(RingAnn::decode(&b), Some(RingAnn { addr: 0x7000, rkey: 0x42, max: max as u32 }));
    assert!(!rx.has_ctl(), "the address goes once");
    // from now on eager-only receives wait for a batch, as with a ring made at connect
    take(&mut rx, &[5], 64);
    assert!(chains(&mut rx, &mut st).is_empty());
    // made once: a second request changes nothing
    rx.ring_made(&mut st[..], 0x9000, 1);
    assert!(!rx.has_ctl());
    // with no room in the send queue the address waits, and is not lost
    let mut rx = Receiver::new(Config { late_ring: true, sq_depth: 32, ..cfg(1, false, max) });
    rx.on_ready();
    for _ in 0..32 {
        take(&mut rx, &[5, 5], 100);
        rx.force_cts();
        chains(&mut rx, &mut st);
    }
    assert_eq!(rx.ctl_room(), 0);
    rx.ring_made(&mut st[..], 0x7000, 0x42);
    assert!(chains(&mut rx, &mut st).is_empty() && rx.has_ctl());
    rx.on_ctl_done(32);
    assert_eq!(chains(&mut rx, &mut st).concat()[0].off, RING_ANN_OFF);
}

#[test]
fn flushes_and_abandoned_requests() {
    let mut rx = Receiver::new(cfg(1, false, 0));
    let f = rx.add_flush().unwrap();
    assert_eq!(rx.is_done(f), Ok(false));
    rx.on_flush_done(f);
    assert_eq!(rx.finish(f).unwrap().unwrap().n, 0);
    let t = take(&mut rx, &[1], 1);
    rx.abandon(t.id);
    assert!(rx.is_done(t.id).is_err());
    assert!(rx.slot_free() || rx.next_seq() == 1);
}
