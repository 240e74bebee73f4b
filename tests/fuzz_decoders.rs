//! Stable, coverage-less fuzz driver for the decoder targets in
//! `rustnet::proto::fuzz` (the same targets cargo-fuzz runs from `fuzz/`).
//!
//! Per target: every committed corpus input (`fuzz/corpus/<target>/`) runs
//! once, then stacked random mutations of the corpus run for a bounded time,
//! first from a fixed seed (the same inputs on every run), then from a fresh
//! random seed that is printed. A failing input is written to
//! `target/fuzz-failures/` and printed in hex with the seed that found it.
//!
//!   RUSTNET_FUZZ_SECS=N    seconds per target (default 1; CI runs 20)
//!   RUSTNET_FUZZ_SEED=S    replace the random seed (reproduce a run)
//!   RUSTNET_FUZZ_WRITE_SEEDS=1  rewrite the seed corpus from the generators below
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustnet::proto::eager;
use rustnet::proto::fifo::{Cts, FailCode, Imm, ImmKind};
use rustnet::proto::fuzz::{Target, TARGETS};
use rustnet::proto::handle::{Handle, HandleKind, HANDLE_SIZE, PROTO_VERSION};
use rustnet::proto::ib_meta::Meta;
use rustnet::proto::wire::{Hello, MsgHeader, Reply, Verdict, REPLY_QUEUED_OFFSETS};

const FIXED_SEED: u64 = 0x005e_ed0f_f022;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const INTERESTING: [u64; 14] =
    [0, 1, 2, 0x7f, 0x80, 0xff, 0x7fff, 0xffff, 0x7fff_ffff, 0xffff_ffff, 1 << 32, i64::MAX as u64, u64::MAX, u64::MAX - 1];

/// Stack 1..=8 mutations onto `d`; `other` is another corpus input to splice from.
fn mutate(rng: &mut Rng, d: &mut Vec<u8>, other: &[u8]) {
    for _ in 0..1 + rng.below(8) {
        let len = d.len();
        match rng.below(10) {
            0 if len > 0 => {
                let i = rng.below(len);
                d[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                d[i] = rng.next() as u8;
            }
            2 | 3 if len > 0 => {
                // an interesting integer (or +-1 of the current one) at a field offset
                let w = [1usize, 2, 4, 8][rng.below(4)];
                let i = rng.below(len) & !(w - 1);
                let mut v = [0u8; 8];
                let n = w.min(len - i);
                v[..n].copy_from_slice(&d[i..i + n]);
                let cur = u64::from_le_bytes(v);
                let x = match rng.below(3) {
                    0 => INTERESTING[rng.below(INTERESTING.len())],
                    1 => cur.wrapping_add(1),
                    _ => cur.wrapping_sub(1),
                };
                d[i..i + n].copy_from_slice(&x.to_le_bytes()[..n]);
            }
            4 => {
                let i = rng.below(len + 1);
                let k = 1 + rng.below(16);
                for _ in 0..k {
                    d.insert(i, rng.next() as u8);
                }
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let k = (1 + rng.below(16)).min(len - i);
                d.drain(i..i + k);
            }
            6 => d.truncate(rng.below(len + 1)),
            7 if !other.is_empty() => {
                // splice: a piece of another input over ours
                let a = rng.below(other.len());
                let k = 1 + rng.below(other.len() - a);
                let at = rng.below(len + 1);
                if at + k > d.len() {
                    d.resize(at + k, 0);
                }
                d[at..at + k].copy_from_slice(&other[a..a + k]);
            }
            8 if len > 1 => {
                // copy a block within
                let a = rng.below(len);
                let b = rng.below(len);
                let k = (1 + rng.below(32)).min(len - a).min(len - b);
                let tmp = d[a..a + k].to_vec();
                d[b..b + k].copy_from_slice(&tmp);
            }
            _ => d.push(rng.next() as u8),
        }
    }
}

fn corpus_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(name)
}

fn load_corpus(name: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(name);
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (RUSTNET_FUZZ_WRITE_SEEDS=1 writes the seed corpus)", dir.display()))
        .map(|e| {
            let p = e.unwrap().path();
            (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "{} is empty", dir.display());
    v
}

fn hexs(b: &[u8]) -> String {
    b.iter().map(|c| format!("{c:02x}")).collect()
}

/// Run `t` on `input`; on a panic save the input and fail with how to reproduce.
fn run_one(name: &str, t: Target, input: &[u8], origin: &str) {
    if std::panic::catch_unwind(|| t(input)).is_err() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-failures");
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join(format!(
            "{name}-{:016x}",
            input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &c| (h ^ c as u64).wrapping_mul(0x100_0000_01b3))
        ));
        std::fs::write(&f, input).unwrap();
        panic!(
            "fuzz target {name} failed ({origin}) on {} bytes, saved to {}:\n{}\n\
             re-run: cargo test --release --test fuzz_decoders {name} (or with cargo-fuzz: cargo +nightly fuzz run {name} {})",
            input.len(),
            f.display(),
            hexs(input),
            f.display()
        );
    }
}

fn secs() -> f64 {
    std::env::var("RUSTNET_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0)
}

fn fuzz(name: &str) {
    let t = TARGETS.iter().find(|(n, _)| *n == name).expect("target").1;
    if std::env::var("RUSTNET_FUZZ_WRITE_SEEDS").as_deref() == Ok("1") {
        write_seeds(name);
    }
    let corpus = load_corpus(name);
    for (f, d) in &corpus {
        run_one(name, t, d, &format!("corpus file {f}"));
    }
    let budget = Duration::from_secs_f64(secs());
    let random = std::env::var("RUSTNET_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        t.as_nanos() as u64 ^ ((std::process::id() as u64) << 32)
    });
    let t0 = Instant::now();
    let mut runs = 0u64;
    // first half of the budget from the fixed seed, the rest from the random one
    for (phase, seed) in [("fixed", FIXED_SEED), ("random", random)] {
        let mut rng = Rng(seed ^ name.len() as u64);
        let until = if phase == "fixed" { budget / 2 } else { budget };
        let mut n = 0u64;
        let mut d = Vec::new();
        while t0.elapsed() < until || n < 200 {
            let (_, base) = &corpus[rng.below(corpus.len())];
            let (_, other) = &corpus[rng.below(corpus.len())];
            d.clear();
            d.extend_from_slice(base);
            mutate(&mut rng, &mut d, other);
            run_one(name, t, &d, &format!("{phase} seed RUSTNET_FUZZ_SEED={seed}, run {n}"));
            n += 1;
        }
        runs += n;
        println!("fuzz {name}: {phase} seed {seed}: {n} inputs");
    }
    println!("fuzz {name}: {} corpus inputs, {runs} mutated inputs in {:.1}s, no failure", corpus.len(), t0.elapsed().as_secs_f64());
}

#[test]
fn fuzz_handle() {
    fuzz("handle");
}
#[test]
fn fuzz_hello() {
    fuzz("hello");
}
#[test]
fn fuzz_reply() {
    fuzz("reply");
}
#[test]
fn fuzz_resume() {
    fuzz("resume");
}
#[test]
fn fuzz_wire_header() {
    fuzz("wire_header");
}
#[test]
fn fuzz_ib_meta() {
    fuzz("ib_meta");
}
#[test]
fn fuzz_eager() {
    fuzz("eager");
}
#[test]
fn fuzz_fifo() {
    fuzz("fifo");
}
#[test]
fn fuzz_recover() {
    fuzz("recover");
}

/// The committed corpus holds at least the generated seeds, byte for byte
/// (a format change must come with a regenerated corpus).
#[test]
fn seed_corpus_is_committed() {
    for (name, _) in TARGETS {
        let have = load_corpus(name);
        for (f, d) in seeds(name) {
            let got = have.iter().find(|(n, _)| *n == f).map(|x| &x.1);
            assert_eq!(
                got,
                Some(&d),
                "fuzz/corpus/{name}/{f} missing or stale: RUSTNET_FUZZ_WRITE_SEEDS=1 cargo test --release --test fuzz_decoders"
            );
        }
    }
}

// ------------------------------------------------------------------ seed corpus

fn write_seeds(name: &str) {
    let dir = corpus_dir(name);
    std::fs::create_dir_all(&dir).unwrap();
    for (f, d) in seeds(name) {
        std::fs::write(dir.join(f), d).unwrap();
    }
}

/// Program builder for the stateful targets (fields in the order the target reads them).
#[derive(Default)]
struct Prog(Vec<u8>);

impl Prog {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn raw(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
    /// A tag in the target's encoding: 0..=2 in one byte, else 0xff + i32.
    fn tag(self, t: i32) -> Self {
        if (0..3).contains(&t) {
            self.u8(t as u8)
        } else {
            self.u8(0xff).raw(&t.to_le_bytes())
        }
    }
    // eager ops
    fn e_msg(self, k: u8, j: u64, size: u32, tag: i32, trailer: bool) -> Self {
        self.u8(0).u8(k).u64(j).u32(size).tag(tag).u64(0).u8(trailer as u8)
    }
    fn e_poll(self) -> Self {
        self.u8(2)
    }
    fn e_recv(self, bufs: &[(i32, u16)]) -> Self {
        let mut p = self.u8(3).u8(bufs.len() as u8 - 1);
        for &(t, c) in bufs {
            p = p.tag(t).u16(c);
        }
        p
    }
    fn e_credits(self) -> Self {
        self.u8(4).u8(1)
    }
    fn e_send(self, tag: i32, size: u32, freed: u64) -> Self {
        self.u8(5).tag(tag).tag(tag).u8(0).u8(0).tag(tag).u32(size).u64(freed).u64(0)
    }
}

fn seeds(name: &str) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |n: &str, d: Vec<u8>| v.push((n.to_string(), d));
    match name {
        "handle" => {
            let mk = |kind, addr: &str, nonce, stage| {
                let mut b = [0u8; HANDLE_SIZE];
                Handle { kind, addr: addr.parse().unwrap(), nonce, stage, resume_port: 0 }.encode(&mut b);
                b.to_vec()
            };
            let v4 = mk(HandleKind::Tcp, "10.1.2.3:40123", 0x1234_5678_9abc_def0, 0);
            add("valid-tcp-v4", v4.clone());
            add("valid-ib-v6-scoped", mk(HandleKind::Ib, "[fe80::1:2%7]:5000", u64::MAX, 3));
            add("valid-v4-stage", mk(HandleKind::Tcp, "127.0.0.1:1", 1, 0xfeed));
            for (n, off, val) in
                [("bad-magic", 0, 0x00), ("bad-version", 8, 9), ("bad-kind", 10, 3), ("bad-family", 11, 5), ("port-zero", 12, 0)]
            {
                let mut b = v4.clone();
                b[off] = val;
                if off == 12 {
                    b[13] = 0;
                }
                add(&format!("near-{n}"), b);
            }
            add("short", v4[..40].to_vec());
            add("zeros", vec![0; HANDLE_SIZE]);
        }
        "hello" => {
            let h = Hello { version: PROTO_VERSION, stream: 1, nstreams: 2, conn_id: 99, nonce: 0xabcdef };
            add("valid-own-nonce", h.encode().to_vec());
            let mut wrong = h.encode().to_vec();
            wrong.extend_from_slice(&7u64.to_le_bytes());
            add("near-wrong-nonce", wrong);
            add("valid-64-streams", Hello { stream: 63, nstreams: 64, ..h }.encode().to_vec());
            add("near-stream-eq-n", Hello { stream: 2, ..h }.encode().to_vec());
            add("near-65-streams", Hello { stream: 0, nstreams: 65, ..h }.encode().to_vec());
            add("near-0-streams", Hello { stream: 0, nstreams: 0, ..h }.encode().to_vec());
            add("near-old-version", Hello { version: PROTO_VERSION - 1, ..h }.encode().to_vec());
            add("http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n12345".to_vec());
            add("short", h.encode()[..20].to_vec());
        }
        "resume" => {
            use rustnet::proto::resume::{Ack, HelloExt, ResumeHello, ResumeReply, SenderQuery, Token};
            let tagged = |t: u8, b: &[u8]| [&[t][..], b].concat();
            add(
                "ext-v4",
                tagged(
                    0,
                    &HelloExt { token: Token([7; 16]), probe: Some("10.0.0.2:4000".parse().unwrap()), answers: true, kernel_acks: true }
                        .encode(),
                ),
            );
            add(
                "ext-v6",
                tagged(
                    0,
                    &HelloExt {
                        token: Token([9; 16]),
                        probe: Some("[fe80::2%3]:4001".parse().unwrap()),
                        answers: false,
                        kernel_acks: false,
                    }
                    .encode(),
                ),
            );
            add("ext-none", tagged(0, &HelloExt { token: Token::NONE, probe: None, answers: false, kernel_acks: false }.encode()));
            let h = ResumeHello {
                version: PROTO_VERSION,
                stream: 1,
                nstreams: 2,
                conn_id: 0xabc,
                epoch: 3,
                sent: 1 << 33,
                elapsed_ms: 1500,
                token: Token([5; 16]),
            };
            add("hello-valid", tagged(1, &h.encode()));
            add("hello-near-epoch-0", tagged(1, &ResumeHello { epoch: 0, ..h }.encode()));
            add("hello-near-stream-eq-n", tagged(1, &ResumeHello { stream: 2, ..h }.encode()));
            let q = SenderQuery { version: PROTO_VERSION, conn_id: 0xabc, token: Token([5; 16]) };
            add("query-valid", tagged(1, &q.encode()));
            add("query-near-old-version", tagged(1, &SenderQuery { version: PROTO_VERSION - 1, ..q }.encode()));
            add(
                "reply-accepted",
                tagged(2, &ResumeReply { verdict: Verdict::Accepted, version: PROTO_VERSION, offset: 12345, flags: 1 }.encode()),
            );
            add(
                "reply-bad-token",
                tagged(2, &ResumeReply { verdict: Verdict::BadToken, version: PROTO_VERSION, offset: 0, flags: 0 }.encode()),
            );
            let mut ack = tagged(3, &Ack { stream: 1, offset: 500 }.encode());
            ack.push(1); // 2 streams
            ack.extend_from_slice(&10u64.to_le_bytes());
            ack.extend_from_slice(&600u64.to_le_bytes());
            add("ack-valid", ack);
        }
        "reply" => {
            add("valid-accepted", Reply { verdict: Verdict::Accepted, version: PROTO_VERSION, resume_port: 0, flags: 0 }.encode().to_vec());
            let queued = Reply { verdict: Verdict::Accepted, version: PROTO_VERSION, resume_port: 4242, flags: REPLY_QUEUED_OFFSETS };
            add("valid-accepted-queued-offsets", queued.encode().to_vec());
            add(
                "valid-wrong-nonce",
                Reply { verdict: Verdict::WrongNonce, version: PROTO_VERSION, resume_port: 0, flags: 0 }.encode().to_vec(),
            );
            add("valid-too-many-old-version", Reply { verdict: Verdict::TooMany, version: 1, resume_port: 0, flags: 0 }.encode().to_vec());
            let mut b = Reply { verdict: Verdict::Inconsistent, version: PROTO_VERSION, resume_port: 0, flags: 0 }.encode();
            b[8] = 7;
            add("near-unknown-verdict", b.to_vec());
            add("http", b"HTTP/1.1 400 Bad".to_vec());
            add("short", b"RNREPLY1".to_vec());
        }
        "wire_header" => {
            let grouped = |h: MsgHeader, specs: &[(u64, i32, bool)], ns: u8, minc: u32| {
                let mut p = Prog(h.encode().to_vec()).u8(specs.len() as u8 - 1);
                for &(cap, tag, m) in specs {
                    p = p.u64(cap).tag(tag).u8(m as u8);
                }
                p.u8(ns - 1).u32(minc).0
            };
            add("valid-single", grouped(MsgHeader { tag: 1, size: 5000 }, &[(8192, 1, false)], 4, 4096));
            add(
                "valid-grouped",
                grouped(MsgHeader { tag: 2, size: 1 << 20 }, &[(64, 1, false), (1 << 21, 2, true), (1 << 21, 2, false)], 8, 65536),
            );
            add("valid-zero-size", grouped(MsgHeader { tag: 0, size: 0 }, &[(0, 0, false)], 1, 1));
            add("near-too-large", grouped(MsgHeader { tag: 1, size: 8193 }, &[(8192, 1, false)], 2, 1));
            add("near-wrong-tag", grouped(MsgHeader { tag: -5, size: 1 }, &[(8, 1, false)], 2, 1));
            add("huge-cap", grouped(MsgHeader { tag: 1, size: u64::MAX - 7 }, &[(u64::MAX, 1, false)], 64, 1));
            let mut bad = MsgHeader { tag: 1, size: 1 }.encode().to_vec();
            bad[0] ^= 0x20;
            add("near-bad-magic", bad);
        }
        "ib_meta" => {
            let m = Meta {
                qpns: vec![0x11, 0x22, 0x33],
                mtu: 3,
                link: 2,
                port: 1,
                gid_index: 3,
                lid: 0,
                tc: 106,
                sl: 0,
                split: true,
                gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1],
                family: 4,
                roce_version: 2,
                addr: 0x7f00_dead_0000,
                rkey: 0x4321,
                name: "mlx5_0".into(),
                eager: 8192,
                ring: (0x7f00_beef_0000, 0x99),
                flags: 3,
                secret: 0,
            };
            add("valid-roce", m.encode().to_vec());
            let ib = Meta { qpns: (1..=128).collect(), link: 1, family: 0, roce_version: 0, lid: 7, eager: 0, ..m.clone() };
            add("valid-ib-128-qps", ib.encode().to_vec());
            let mut long = m.encode();
            long[56..88].copy_from_slice(b"an-hca-name-of-exactly-32-bytes!");
            add("near-name-unterminated", long.to_vec());
            let mut utf = m.encode();
            utf[56..88].fill(b'a');
            utf[86..88].copy_from_slice("\u{e9}".as_bytes());
            add("near-name-utf8-cut", utf.to_vec());
            for (n, off, val) in [("nqps-0", 10, 0u8), ("nqps-129", 10, 129), ("mtu-6", 12, 6), ("family-5", 21, 5), ("rocever-3", 22, 3)] {
                let mut b = m.encode();
                b[off] = val;
                add(&format!("near-{n}"), b.to_vec());
            }
            let mut b = m.encode();
            b[600..604].copy_from_slice(&((eager::MAX_EAGER as u32) + 1).to_le_bytes());
            add("near-eager-too-big", b.to_vec());
        }
        "eager" => {
            // max 8 bytes: receive posted, then the message, then the poll
            add("posted-then-arrived", Prog::default().u8(0).e_recv(&[(0, 8)]).e_msg(0, 0, 5, 0, true).e_poll().e_credits().0);
            // early: message first, then the receive
            add(
                "early-then-posted",
                Prog::default()
                    .u8(0)
                    .e_recv(&[(1, 8)])
                    .e_msg(0, 0, 8, 1, true)
                    .e_msg(1, 1, 0, 1, true)
                    .e_poll()
                    .e_recv(&[(1, 8)])
                    .e_poll()
                    .0,
            );
            // payload landing: no trailer yet
            add("no-trailer", Prog::default().u8(2).e_recv(&[(0, 100)]).e_msg(0, 0, 100, 0, false).e_poll().0);
            // limit 1..4096 (selector 1), grouped receive
            add("grouped", Prog::default().u8(1).u16(999).e_recv(&[(2, 1000), (0, 10), (2, 1000)]).e_msg(0, 1, 1000, 2, true).e_poll().0);
            add("near-size-over-limit", Prog::default().u8(0).e_recv(&[(0, 8)]).e_msg(0, 0, 9, 0, true).e_poll().0);
            add("near-wrong-tag", Prog::default().u8(0).e_recv(&[(0, 8)]).e_msg(0, 0, 1, 7, true).e_poll().0);
            add("sender", Prog::default().u8(3).e_send(0, 100, 0).e_send(0, 1 << 16, 0).e_send(0, 10, 40).0);
            let mut full = Prog::default().u8(0).e_recv(&[(0, 8)]);
            for i in 0..40u64 {
                full = full.e_msg(0, i, (i % 9) as u32, 0, true).e_poll().e_recv(&[(0, 8)]).e_credits();
            }
            add("ring-laps", full.0);
        }
        "fifo" => {
            let elem = |seq: u64, c: Cts| c.encode(seq);
            let one = Cts { addr: 0x1000, rkey: 5, cap: 4096, tag: 1, n: 1, i: 0 };
            // element part: seq, i, bytes; then nqps, split, groups; the groups; then the immediate part
            let head = |seq: u64, i: u8, b: [u8; 32]| Prog::default().u64(seq).u8(i).raw(&b);
            let imm_part = |p: Prog, v: u32, caps: &[u32], sizes: &[u32]| {
                let mut p = p.u32(v).u8(caps.len() as u8 - 1);
                for &c in caps {
                    p = p.u32(c);
                }
                let mut s = [0u8; 32];
                for (k, x) in sizes.iter().enumerate() {
                    s[4 * k..4 * k + 4].copy_from_slice(&x.to_le_bytes());
                }
                p.raw(&s)
            };
            let group = |p: Prog, elems: &[(u32, i32)], eager: u8, sends: &[(i32, u32)]| {
                let mut p = p.u8(elems.len() as u8 - 1);
                for &(cap, tag) in elems {
                    p = p.u64(0x2000).u32(9).u32(cap).tag(tag).u8(7);
                }
                p = p.u8(eager);
                for &(t, s) in sends {
                    p = p.tag(t).u32(s);
                }
                p
            };
            add("elem-valid", head(3, 0, elem(3, one)).0);
            add("elem-near-stale-marker", head(3, 0, elem(2, one)).0);
            add("elem-near-n-0", head(0, 0, elem(0, Cts { n: 0, ..one })).0);
            add("elem-near-i-ge-n", head(0, 1, elem(0, Cts { i: 1, ..one })).0);
            let p = group(group(head(0, 0, elem(0, one)).u8(1).u8(1).u8(2), &[(4096, 1)], 0, &[(1, 4000)]), &[(64, 0)], 0, &[(0, 64)]);
            add("single-send-2-lanes-split", imm_part(p, Imm::new(0, ImmKind::Size(4000)).encode(), &[4096], &[]).0);
            let p = group(head(0, 0, elem(0, one)).u8(3).u8(1).u8(1), &[(1000, 1), (5000, 2), (300, 1)], 0b100, &[(2, 4999), (1, 1000)]);
            add(
                "grouped-eager-4-lanes",
                imm_part(p, Imm::new(0, ImmKind::Sizes(3)).encode(), &[1000, 5000, 300], &[1000, 4999, u32::MAX]).0,
            );
            let p = group(head(0, 0, elem(0, one)).u8(0).u8(0).u8(1), &[(100, 1)], 0, &[(1, 101)]).u8(0);
            add("near-too-large", imm_part(p, Imm::new(0, ImmKind::Fail(FailCode::TooLarge)).encode(), &[100], &[]).0);
            let p = group(head(0, 0, elem(0, one)).u8(0).u8(0).u8(1), &[(100, 1), (100, 1)], 0, &[(2, 1)]).u8(0);
            add("near-wrong-tag", imm_part(p, Imm::new(0, ImmKind::Fail(FailCode::NoTag)).encode(), &[100, 100], &[]).0);
            add(
                "imm-sizes-too-big",
                imm_part(head(0, 0, [0; 32]).u8(0).u8(0).u8(0), Imm::new(5, ImmKind::Sizes(2)).encode(), &[10, 10], &[11, 3]).0,
            );
        }
        "recover" => {
            use rustnet::proto::recover::{InflightRecv, Point, QpAddr, RcMsg, RxPoint, TxPoint};
            let enc = |m: RcMsg| {
                let mut b = Vec::new();
                m.encode(&mut b);
                b
            };
            let mut addr = QpAddr { nqps: 2, gid: [0xfe; 16], gid_index: 3, lid: 7, mtu: 3, ..QpAddr::default() };
            addr.qpns[..2].copy_from_slice(&[0x11, 0x12]);
            let mut rx = RxPoint { cts_written: 70, next_seq: 72, eager_next: 40, credit: 33, n: 2, ..RxPoint::default() };
            rx.inflight[0] = InflightRecv { seq: 69, got: 0b01 };
            rx.inflight[1] = InflightRecv { seq: 71, got: 0 };
            let tx = TxPoint { fifo_head: 69, eager_posted: 44, mailbox: 70 };
            add("halt", enc(RcMsg::Halt { epoch: 1 }));
            add("go", enc(RcMsg::Go { epoch: 2 }));
            add("give-up", enc(RcMsg::GiveUp { epoch: 3 }));
            add("state-tx", enc(RcMsg::State { epoch: 1, addr: Box::new(addr), point: Box::new(Point::Tx(tx)) }));
            let st = enc(RcMsg::State { epoch: 1, addr: Box::new(addr), point: Box::new(Point::Rx(rx)) });
            add("state-rx", st.clone());
            let mut two = enc(RcMsg::Halt { epoch: 4 });
            two.extend_from_slice(&st);
            add("halt-then-state", two);
            let mut bad = st.clone();
            bad[12 + 24 + 8 + 1 + 32] = 40; // more waiting receives than FIFO slots
            add("state-near-n", bad);
            add("near-magic", b"RNRX".to_vec());
        }
        other => panic!("no seeds for {other}"),
    }
    v
}
