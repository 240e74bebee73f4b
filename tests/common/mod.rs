//! Shared pieces of the two-process tests: deterministic traffic plans and
//! byte patterns, the traffic loop (`traffic`), the process harness (`proc`).
#![allow(dead_code)]

pub mod proc;
pub mod traffic;

/// xorshift64*: deterministic, seedable, good enough for test data.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One buffer of a grouped receive and the message meant for it.
#[derive(Debug, Clone, Copy)]
pub struct Msg {
    pub tag: i32,
    pub size: usize,
    pub cap: usize,
}

/// One grouped receive: its buffers and the order the sender sends them in.
#[derive(Debug, Clone)]
pub struct Round {
    pub msgs: Vec<Msg>,
    pub send_order: Vec<usize>,
}

fn pick_size(r: &mut Rng, max_big: usize) -> usize {
    match r.below(10) {
        0 => 0,
        1..=3 => r.below(65) as usize,
        4..=6 => r.below(64 << 10) as usize,
        7 | 8 => r.below(1 << 20) as usize,
        _ => r.below(max_big as u64 + 1) as usize,
    }
}

/// The plan both processes derive from the sender's seed.
pub fn plan(seed: u64, rounds: usize, max_recvs: usize, max_big: usize) -> Vec<Round> {
    let mut r = Rng::new(seed);
    (0..rounds)
        .map(|_| {
            let n = 1 + r.below(max_recvs as u64) as usize;
            let msgs: Vec<Msg> = (0..n)
                .map(|_| {
                    let size = pick_size(&mut r, max_big);
                    let extra = match r.below(3) {
                        0 => 0,
                        1 => r.below(100) as usize,
                        _ => r.below(1 << 16) as usize,
                    };
                    Msg { tag: r.below(3) as i32 + 100, size, cap: size + extra }
                })
                .collect();
            // random order, but messages with equal tags keep their buffer
            // order (a send lands in the first unmatched buffer of its tag)
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, r.below(i as u64 + 1) as usize);
            }
            for t in 100..103 {
                let pos: Vec<usize> = (0..n).filter(|&k| msgs[order[k]].tag == t).collect();
                let mut idx: Vec<usize> = pos.iter().map(|&k| order[k]).collect();
                idx.sort();
                for (k, i) in pos.into_iter().zip(idx) {
                    order[k] = i;
                }
            }
            Round { msgs, send_order: order }
        })
        .collect()
}

/// Fill `buf` with the pattern of (seed, round, idx).
pub fn fill(buf: &mut [u8], seed: u64, round: usize, idx: usize) {
    let mut r = Rng::new(seed ^ ((round as u64) << 20) ^ ((idx as u64) << 8) ^ 0x5a5a);
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&r.next().to_le_bytes());
    }
    let rem = chunks.into_remainder();
    let last = r.next().to_le_bytes();
    rem.copy_from_slice(&last[..rem.len()]);
}

/// First offset where `buf` differs from the pattern, if any.
pub fn check(buf: &[u8], seed: u64, round: usize, idx: usize) -> Option<usize> {
    let mut want = vec![0u8; buf.len()];
    fill(&mut want, seed, round, idx);
    buf.iter().zip(&want).position(|(a, b)| a != b)
}

pub const CANARY: u8 = 0xEE;
pub const CANARY_LEN: usize = 64;

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Threads of this process.
pub fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

/// The thread count once it is at most `limit`, or what it still is after a
/// second. A joined thread can stay listed in `/proc/self/task` for a moment
/// after `pthread_join` returns (the kernel wakes the joiner when the thread
/// lets go of its memory, and unlists it later, on its way out): a thread
/// the plugin leaks is there for good, one that is on its way out is not.
pub fn thread_count_settled(limit: usize) -> usize {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        let n = thread_count();
        if n <= limit || std::time::Instant::now() >= until {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Resident set size in KiB.
pub fn rss_kib() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}
