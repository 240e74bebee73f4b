//! Every knob librustnet reads, in one typed table.
//!
//! NCCL's own names are used where the meaning is NCCL's (`NCCL_SOCKET_*`,
//! `NCCL_IB_*`); `RUSTNET_*` names are ours. The table is parsed once, at the
//! first `init`; an invalid value fails `init` with an error naming the
//! variable, the value and what is accepted. `docs/knobs.md` is checked against
//! [`KNOBS`] by a test, and `rustnet-bench --knobs` prints it.
use crate::error::{Error, Result};

/// One row of the knob table.
#[derive(Debug, Clone, Copy)]
pub struct Knob {
    /// Environment variable name.
    pub name: &'static str,
    /// Default value (as it would be written in the environment).
    pub default: &'static str,
    /// What values are accepted.
    pub accepts: &'static str,
    /// One-line meaning.
    pub doc: &'static str,
}

/// A value type that a knob can hold.
pub trait KnobValue: Sized {
    /// Parse a trimmed, non-empty string; `None` when not acceptable.
    fn parse_knob(s: &str) -> Option<Self>;
}

fn parse_knob<T: KnobValue>(name: &'static str, raw: Option<String>, default: &'static str, accepts: &'static str) -> Result<T> {
    let (value, from_env) = match raw {
        Some(v) if !v.trim().is_empty() => (v, true),
        _ => (default.to_string(), false),
    };
    T::parse_knob(value.trim()).ok_or_else(|| {
        if from_env {
            Error::Config { name, value, accepts: accepts.to_string() }
        } else {
            Error::Internal(format!("default {default:?} of {name} does not parse"))
        }
    })
}

macro_rules! knobs {
    ($( $(#[doc = $doc:literal])+ $field:ident : $ty:ty = $env:literal, default $def:literal, accepts $acc:literal; )*) => {
        /// The parsed configuration: one field per row of [`KNOBS`].
        #[derive(Debug, Clone)]
        pub struct Config {
            $( $(#[doc = $doc])+ pub $field: $ty, )*
        }

        /// The knob table: name, default, accepted values and meaning of every variable we read.
        pub const KNOBS: &[Knob] = &[
            $( Knob { name: $env, default: $def, accepts: $acc, doc: concat!($($doc),+) }, )*
        ];

        impl Config {
            /// Build from any lookup (the process environment, or a test's map).
            pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
                Ok(Config { $( $field: parse_knob::<$ty>($env, get($env), $def, $acc)?, )* })
            }

            /// Every value `from_lookup` would refuse, in table order (it stops at the
            /// first; `rustnet doctor` lists them all in one run).
            pub fn problems(get: &dyn Fn(&str) -> Option<String>) -> Vec<Error> {
                let mut bad = Vec::new();
                $( if let Err(e) = parse_knob::<$ty>($env, get($env), $def, $acc) { bad.push(e); } )*
                bad
            }
        }
    };
}

/// Which transport serves NCCL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// Verbs when a usable RDMA device exists, else TCP (with one INFO line saying why).
    Auto,
    /// Verbs only: no usable device is an error.
    Ib,
    /// TCP only.
    Socket,
}

impl KnobValue for TransportChoice {
    fn parse_knob(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Some(Self::Auto),
            "ib" | "verbs" | "rdma" => Some(Self::Ib),
            "socket" | "tcp" => Some(Self::Socket),
            _ => None,
        }
    }
}

/// Address family restriction (`NCCL_SOCKET_FAMILY`, `NCCL_IB_ADDR_FAMILY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Either; IPv4 preferred where both exist.
    Any,
    /// IPv4 only.
    V4,
    /// IPv6 only.
    V6,
}

impl KnobValue for Family {
    fn parse_knob(s: &str) -> Option<Self> {
        match s {
            "any" => Some(Self::Any),
            "AF_INET" | "4" | "ipv4" => Some(Self::V4),
            "AF_INET6" | "6" | "ipv6" => Some(Self::V6),
            _ => None,
        }
    }
}

/// An integer knob limited to `LO..=HI`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int<const LO: i64, const HI: i64>(pub i64);

impl<const LO: i64, const HI: i64> KnobValue for Int<LO, HI> {
    fn parse_knob(s: &str) -> Option<Self> {
        let v = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            i64::from_str_radix(h, 16).ok()?
        } else {
            s.parse::<i64>().ok()?
        };
        (LO..=HI).contains(&v).then_some(Int(v))
    }
}

impl<const LO: i64, const HI: i64> Int<LO, HI> {
    /// The value as usize (the range is checked at parse time).
    pub fn get(self) -> i64 {
        self.0
    }
}

/// A byte size: plain number or with K/M/G suffix (powers of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl KnobValue for Bytes {
    fn parse_knob(s: &str) -> Option<Self> {
        let (num, mul) = match s.as_bytes().last()? {
            b'k' | b'K' => (&s[..s.len() - 1], 1u64 << 10),
            b'm' | b'M' => (&s[..s.len() - 1], 1 << 20),
            b'g' | b'G' => (&s[..s.len() - 1], 1 << 30),
            _ => (s, 1),
        };
        num.trim().parse::<u64>().ok()?.checked_mul(mul).map(Bytes)
    }
}

/// A free string (may be empty).
impl KnobValue for String {
    fn parse_knob(s: &str) -> Option<Self> {
        Some(s.to_string())
    }
}

/// A testing-only fault knob's value, kept as given once the fault
/// module's own parser accepts it (so a typo is a knob error, which the
/// doctor reports, not a surprise at init).
macro_rules! fault_knob {
    ($(#[doc = $doc:literal])+ $name:ident, $ok:expr) => {
        $(#[doc = $doc])+
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct $name(pub String);
        impl KnobValue for $name {
            fn parse_knob(s: &str) -> Option<Self> {
                let ok: fn(&str) -> bool = $ok;
                ok(s).then(|| $name(s.to_string()))
            }
        }
        impl std::ops::Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }
    };
}
fault_knob!(
    /// `RUSTNET_FAULT_PANIC`.
    FaultPanic,
    crate::fault::panic_spec_ok
);
fault_knob!(
    /// `RUSTNET_FAULT_QP_ERROR`.
    FaultQp,
    crate::fault::qp_spec_ok
);
fault_knob!(
    /// `RUSTNET_FAULT_TCP_RESET`.
    FaultTcpReset,
    |s| crate::fault::parse_tcp_reset(s).is_ok()
);

/// NCCL's interface/HCA list syntax: `[^][=]name[:port][,name[:port]...]`.
/// `^` excludes the listed names, `=` asks for exact names (else each entry is
/// a prefix: `mlx5_1` also matches `mlx5_10`), a port of `:N` restricts an
/// RDMA port. Empty means "no filter".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NameList {
    /// `^`: the list names what to leave out.
    pub exclude: bool,
    /// `=`: names must match exactly.
    pub exact: bool,
    /// The entries with their optional port.
    pub entries: Vec<(String, Option<u32>)>,
}

impl NameList {
    /// True when no filter was given.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Does `name` (on `port`, for RDMA ports) pass the filter?
    pub fn accepts(&self, name: &str, port: Option<u32>) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        let listed = self.entries.iter().any(|(n, p)| {
            let name_ok = if self.exact { name == n } else { name.starts_with(n.as_str()) };
            let port_ok = match (p, port) {
                (Some(p), Some(q)) => *p == q,
                _ => true,
            };
            name_ok && port_ok
        });
        listed != self.exclude
    }

    /// Entries that are a prefix of more than one of `names` (the `mlx5_1` vs
    /// `mlx5_10` pitfall), for a warning.
    pub fn ambiguous_prefixes<'a>(&'a self, names: &'a [String]) -> Vec<&'a str> {
        if self.exact {
            return vec![];
        }
        self.entries
            .iter()
            .filter(|(n, _)| names.iter().filter(|x| x.starts_with(n.as_str())).count() > 1)
            .map(|(n, _)| n.as_str())
            .collect()
    }
}

impl KnobValue for NameList {
    fn parse_knob(s: &str) -> Option<Self> {
        let mut rest = s;
        let mut list = NameList::default();
        if let Some(r) = rest.strip_prefix('^') {
            list.exclude = true;
            rest = r;
        }
        if let Some(r) = rest.strip_prefix('=') {
            list.exact = true;
            rest = r;
        }
        for item in rest.split(',') {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let mut parts = item.splitn(2, ':');
            let name = parts.next()?.trim();
            if name.is_empty() || name.contains(char::is_whitespace) {
                return None;
            }
            let port = match parts.next().map(str::trim) {
                None | Some("") => None,
                Some(p) => Some(p.split(':').next()?.parse::<u32>().ok()?),
            };
            list.entries.push((name.to_string(), port));
        }
        if list.entries.is_empty() && (list.exclude || list.exact) {
            return None;
        }
        Some(list)
    }
}

/// An address range in CIDR form (`NCCL_IB_ADDR_RANGE`): `10.1.0.0/16`,
/// `fd00::/8`; empty means no restriction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AddrRange(pub Option<(std::net::IpAddr, u8)>);

impl AddrRange {
    /// True when a range was given.
    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// The family of the range, when set.
    pub fn family(&self) -> Option<Family> {
        self.0.map(|(a, _)| if a.is_ipv4() { Family::V4 } else { Family::V6 })
    }

    /// Is `ip` inside (always true when no range is set)? An IPv4-mapped
    /// IPv6 address (`::ffff:a.b.c.d`) counts as its IPv4 address.
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        let Some((net, len)) = self.0 else { return true };
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
            v4 => v4,
        };
        match (net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = if len == 0 { 0 } else { u32::MAX << (32 - len as u32) };
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = if len == 0 { 0 } else { u128::MAX << (128 - len as u32) };
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for AddrRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some((a, l)) => write!(f, "{a}/{l}"),
            None => f.write_str("(any)"),
        }
    }
}

impl KnobValue for AddrRange {
    fn parse_knob(s: &str) -> Option<Self> {
        if s.is_empty() {
            return Some(AddrRange(None));
        }
        let (a, l) = s.split_once('/')?;
        let a: std::net::IpAddr = a.trim().parse().ok()?;
        let l: u8 = l.trim().parse().ok()?;
        (l <= if a.is_ipv4() { 32 } else { 128 }).then_some(AddrRange(Some((a, l))))
    }
}

/// Whether GPU memory is offered over verbs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdrChoice {
    /// Where the system supports it.
    Auto,
    /// Never.
    Off,
}

impl KnobValue for GdrChoice {
    fn parse_knob(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "1" | "on" => Some(Self::Auto),
            "off" | "0" => Some(Self::Off),
            _ => None,
        }
    }
}

/// Log verbosity for our own filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// Warnings only.
    Warn,
    /// Warnings and INFO lines.
    Info,
    /// Everything, including per-request TRACE lines.
    Trace,
}

impl KnobValue for LogLevel {
    fn parse_knob(s: &str) -> Option<Self> {
        match s.to_ascii_uppercase().as_str() {
            "VERSION" | "WARN" | "NONE" | "ABORT" => Some(Self::Warn),
            "INFO" => Some(Self::Info),
            "TRACE" => Some(Self::Trace),
            _ => None,
        }
    }
}

knobs! {
    /// Which transport serves NCCL: verbs where an active RDMA port exists, else TCP (`auto`); only verbs (`ib`, an error when none is usable); only TCP (`socket`).
    transport: TransportChoice = "RUSTNET_TRANSPORT", default "auto", accepts "auto, ib or socket";
    /// Interfaces for TCP data and for the verbs out-of-band exchange, in NCCL's syntax (`^` excludes, `=` exact, else prefixes). Empty: NCCL's automatic order (ib*, then anything but docker*/lo/virbr*, then docker*, lo, virbr*).
    socket_ifname: NameList = "NCCL_SOCKET_IFNAME", default "", accepts "a comma list of interface names or prefixes, optionally starting with ^ and/or =";
    /// Address family of the TCP/out-of-band interfaces.
    socket_family: Family = "NCCL_SOCKET_FAMILY", default "any", accepts "AF_INET or AF_INET6";
    /// TCP streams per helper thread; with NCCL_SOCKET_NTHREADS=0 the total number of streams per connection.
    nsocks_per_thread: Int<1, 64> = "NCCL_NSOCKS_PERTHREAD", default "1", accepts "an integer 1..64";
    /// Accepted for compatibility with NCCL's socket transport: librustnet opens max(1, NCCL_SOCKET_NTHREADS) x NCCL_NSOCKS_PERTHREAD streams per connection, all driven by the caller of test() or by the one pool thread that serves the comm (RUSTNET_SOCKET_HELPER), never by several threads at once.
    socket_nthreads: Int<0, 16> = "NCCL_SOCKET_NTHREADS", default "0", accepts "an integer 0..16";
    /// Smallest piece a TCP message is split into when striped over several streams.
    socket_min_chunk: Bytes = "RUSTNET_SOCKET_MIN_CHUNK", default "64K", accepts "a byte count, optionally with K, M or G";
    /// SO_SNDBUF/SO_RCVBUF for TCP streams; 0 leaves the kernel's autotuning in charge.
    socket_bufsize: Bytes = "RUSTNET_SOCKET_BUFSIZE", default "0", accepts "a byte count, optionally with K, M or G";
    /// 1: a pool of helper threads per process (RUSTNET_SOCKET_HELPER_THREADS) moves what the caller of every TCP comm could not (a full socket, data still to come), asleep in epoll_wait(2) while nothing can move (an idle comm costs no wake-up); small messages still go out from the caller without a hand-off. The pool's threads start on demand and are joined when the last comm closes. 0: the caller of isend/irecv/test moves every byte, as NCCL's socket transport does with zero helper threads. -1: 1 when this process has at least 4 CPUs per rank on its host (CPUs it may run on / ranks from the launcher's LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, PMI_LOCAL_SIZE or SLURM_NTASKS_PER_NODE, else 1), else 0; the INFO log says which and why. See docs/tcp-performance.md.
    socket_helper: Int<-1, 1> = "RUSTNET_SOCKET_HELPER", default "-1", accepts "-1 (auto), 0 or 1";
    /// Most threads of the TCP helper pool (RUSTNET_SOCKET_HELPER=1), shared by every comm of the process. 0: one per CPU of the rank (CPUs this process may run on / ranks on the host, as for RUSTNET_SOCKET_HELPER=-1), at least 4 and at most 8.
    socket_helper_threads: Int<0, 64> = "RUSTNET_SOCKET_HELPER_THREADS", default "0", accepts "0 (auto) or an integer 1..64";
    /// Seconds after which a silent TCP peer is declared dead: keepalive on idle streams, and on a sender no acknowledgement while one is owed. A receiver that is alive but not reading is not silent (it answers window probes) and is waited for. Also how long a listener keeps an accepted connection whose hello has not arrived.
    socket_timeout: Int<1, 86400> = "RUSTNET_SOCKET_TIMEOUT", default "30", accepts "seconds, 1..86400";
    /// Seconds one connection set-up may take, on TCP data streams and on the verbs out-of-band socket: the TCP handshake (SYNs that vanish), then on TCP the listener's confirmation that its accept took the connection. With RUSTNET_RECOVERY_TIMEOUT > 0 a TCP connect rides out a link fault within it: a dial cut before its hellos went out (no route, host unreachable, a reset) is dialled again, one cut after them finishes as a comm that reconnects through the peer's resume port. The default is NCCL's own socket connect budget: NCCL_SOCKET_RETRY_CNT=34 retries sleeping 100, 200, ... 3400 ms (NCCL_SOCKET_RETRY_SLEEP_MSEC=100), about 60 s.
    connect_timeout: Int<1, 86400> = "RUSTNET_CONNECT_TIMEOUT", default "60", accepts "seconds, 1..86400";
    /// Seconds a comm may spend recovering from a fabric fault before it fails: on verbs a recoverable completion error (retry exceeded, flushed) or a port that went down and came back, on TCP a reset or silent stream while the peer process is alive. Both ends agree on a restart point over the comm's out-of-band connection, wait for the port (verbs) or reconnect (TCP), and resend only what the receiver has not completed; NCCL's requests stay pending meanwhile, never completed twice. When the window is spent the comm fails with an error naming the port, the time waited and this knob (on verbs the window counts in full while NCCL calls the comm and at a tenth across silences between its calls; on TCP a receiver waiting for a sender whose process answers again, a late rank, counts at a tenth, so such a sender is waited for up to ten windows; one whose resume port says its end of the comm failed or was closed is not waited for). 0: no recovery (the first such fault fails the comm, as NCCL's net_ib does without its resiliency knobs). On TCP a send then completes once the receiving host's kernel has acknowledged its bytes (RUSTNET_SOCKET_KERNEL_ACK; until 2026-12-04 once the receiving process had, which under NCCL's ring on crowded hosts cost 10-40% of busbw at small steps, docs/tcp-performance.md §6.2). See docs/resilience.md.
    recovery_timeout: Int<0, 86400> = "RUSTNET_RECOVERY_TIMEOUT", default "120", accepts "seconds, 0..86400 (0 = off)";
    /// With TCP recovery on (RUSTNET_RECOVERY_TIMEOUT > 0), 1: a send completes once the receiving host's kernel has acknowledged its bytes (the sender reads its socket's unacknowledged count, SIOCOUTQ), and the receiver's acknowledgement records then only keep the connection's liveness (one per 50 ms of traffic instead of about one per message); the receiver counts the bytes its kernel holds unread on a failed stream in where the sender resumes, and reads them from there first, so a reset or a cut still loses nothing and repeats nothing. Used on a connection when both ends' builds and settings say so (older builds: 0). Set 0 where a terminating TCP proxy (a service-mesh sidecar) sits between the ranks: it acknowledges in the receiver's place, and a reset behind it would then fail the comm (with an error saying so) where it otherwise recovers. 0: a send completes once the receiving process has acknowledged its bytes with a record (before 2026-12-04); under NCCL's ring on a crowded host those records cost 10-20% of busbw at small steps (docs/tcp-performance.md §6.3), but their side effect on delayed acknowledgements made an 8-byte round trip about 1 us faster on loopback (5.2 against 6.5 us; 6.2 with recovery off): a job that lives on tiny round trips may prefer 0.
    socket_kernel_ack: Int<0, 1> = "RUSTNET_SOCKET_KERNEL_ACK", default "1", accepts "0 or 1";
    /// Verbs, with recovery on (RUSTNET_RECOVERY_TIMEOUT > 0), 1: one thread per process (rustnet-keeper, asleep in epoll on the comms' out-of-band sockets) moves a comm's recovery on while NCCL calls nothing on that comm (its rank away: a checkpoint, an evaluation), so the peer whose NCCL waits recovers at link-up instead of spending its window on a rank that is not looking, and failing. It acts only on a comm whose calls have stopped for 100 ms, takes the comm's lock only without waiting, and never fails a comm itself. 0: a comm recovers only inside NCCL's calls on it (before 2026-12-04). See docs/resilience.md.
    ib_recovery_keeper: Int<0, 1> = "RUSTNET_IB_RECOVERY_KEEPER", default "1", accepts "0 or 1";
    /// iWARP, 1: a send completes only once the receiver has it. An iWARP NIC may complete a SEND once its TCP took it (soft-iWARP does), so a connection lost in a fault could lose a message NCCL had already seen complete, and the comm would then fail instead of recovering; with 1 each lane's notice is followed by a one-byte RDMA READ of the receiver's memory (the delivery fence), and the lane counts as done when it returns. Used where the receiver's build answers it (older builds: as 0). The price, measured on soft-iWARP in the project's VM: about 30 us more per 8-byte half round trip and up to 15% of 64 KiB bandwidth (docs/iwarp.md). 0: a send completes at its SEND's completion (before 2026-12-05); a fault with a message in flight may then fail the comm, naming the message. No effect on IB and RoCE, where a write's completion already means the receiver has it.
    iwarp_fence: Int<0, 1> = "RUSTNET_IWARP_FENCE", default "1", accepts "0 or 1";
    /// Connections one listen port holds that have not yet sent a valid hello (strangers, or peers whose hello is still on its way); beyond it the oldest is closed with a WARN. Such a connection is also closed when its hello is not complete RUSTNET_SOCKET_TIMEOUT seconds after it was accepted. Neither limit touches connections whose hello carried the listener's nonce.
    listen_max_strangers: Int<1, 65536> = "RUSTNET_LISTEN_MAX_STRANGERS", default "256", accepts "an integer 1..65536";
    /// RDMA devices and ports to use, in NCCL's syntax (`mlx5_0:1,mlx5_1`, `^mlx5_2`, `=mlx5_1`).
    ib_hca: NameList = "NCCL_IB_HCA", default "", accepts "a comma list of device[:port] names or prefixes, optionally starting with ^ and/or =";
    /// RoCE GID index; -1 selects automatically (IPv4 RoCE v2 preferred).
    ib_gid_index: Int<-1, 1023> = "NCCL_IB_GID_INDEX", default "-1", accepts "-1 or a GID index 0..1023";
    /// RoCE version the GID auto-selection prefers.
    ib_roce_version: Int<1, 2> = "NCCL_IB_ROCE_VERSION_NUM", default "2", accepts "1 or 2";
    /// Address family the GID auto-selection prefers.
    ib_addr_family: Family = "NCCL_IB_ADDR_FAMILY", default "AF_INET", accepts "AF_INET or AF_INET6";
    /// RoCE GID auto-selection uses only GIDs inside this CIDR range (IPv4 `10.1.0.0/16` or IPv6 `fd00::/8`; its family then wins over NCCL_IB_ADDR_FAMILY). Empty: no restriction.
    ib_addr_range: AddrRange = "NCCL_IB_ADDR_RANGE", default "", accepts "empty, or a CIDR range a.b.c.d/n or ipv6/n";
    /// Verbs ACK timeout exponent: 4.096 us * 2^value.
    ib_timeout: Int<1, 31> = "NCCL_IB_TIMEOUT", default "20", accepts "an integer 1..31";
    /// Verbs transport retry count.
    ib_retry_cnt: Int<0, 7> = "NCCL_IB_RETRY_CNT", default "7", accepts "an integer 0..7";
    /// InfiniBand partition key index.
    ib_pkey: Int<0, 65535> = "NCCL_IB_PKEY", default "0", accepts "an integer 0..65535";
    /// Traffic class of the data QPs (RoCE: the GRH traffic class, i.e. DSCP << 2, the IPv4 TOS byte). When set it wins over the communicator's traffic class (ABI v10 `connect`, v11+ the plugin context's; as NCCL's net_ib, whose documentation says the variables take precedence); -1: the communicator's, else 0. The sender chooses; the receiver follows it. The TCP transport does not read it: there the communicator's class alone sets IP_TOS / IPV6_TCLASS.
    ib_tc: Int<-1, 255> = "NCCL_IB_TC", default "-1", accepts "-1 or 0..255";
    /// Traffic class of the receiver's QPs, which carry its CTS (clear-to-send) writes, so control messages can ride a higher-priority class (RoCE only); -1: the data traffic class.
    ib_fifo_tc: Int<-1, 255> = "NCCL_IB_FIFO_TC", default "-1", accepts "-1 or 0..255";
    /// Service level; -1: 0.
    ib_sl: Int<-1, 15> = "NCCL_IB_SL", default "-1", accepts "-1 or 0..15";
    /// Queue pairs per connection.
    ib_qps_per_connection: Int<1, 128> = "NCCL_IB_QPS_PER_CONNECTION", default "1", accepts "an integer 1..128";
    /// 0: whole messages rotate over the QPs; 1: each message is split across all QPs.
    ib_split_data_on_qps: Int<0, 1> = "NCCL_IB_SPLIT_DATA_ON_QPS", default "0", accepts "0 or 1";
    /// Several RDMA ports/NICs as one NCCL device, for ABI v6..v8 (NCCL 2.20..2.23 merged inside net_ib; with v9+ NCCL fuses through makeVDevice instead and this is not used): 0 off; 1 merges the ports and PCI functions of one adapter (same PCI device, system GUID and link layer); or explicit groups `a,b;c,d`. A merged device is named `a+b`, its speed is the sum, each connection opens NCCL_IB_QPS_PER_CONNECTION QPs per member, member i talks to the peer's member i, and each message is cut over the members in 128-byte-aligned chunks.
    ib_merge_nics: String = "RUSTNET_IB_MERGE_NICS", default "0", accepts "0, 1, or groups of device names a,b;c,d";
    /// As NCCL's net_ib: the pciPath reported to NCCL has the PCI function digit set to 0 (the ports of one adapter are one PCI device to NCCL's topology) and, with 1, the device digits too, so SR-IOV virtual functions are placed where their physical function is.
    ib_merge_vfs: Int<0, 1> = "NCCL_IB_MERGE_VFS", default "1", accepts "0 or 1";
    /// Inline sends where the device allows: the receiver's one-element CTS and credit writes (up to 32 bytes), the sender's data and eager writes up to 48 bytes (an 8-byte message's eager write). iWARP notices go inline either way.
    ib_use_inline: Int<0, 1> = "NCCL_IB_USE_INLINE", default "1", accepts "0 or 1";
    /// Verbs messages up to this many bytes skip the receiver's clear-to-send: the sender writes them into a ring of 32 slots the receiver registered (one RDMA write on the critical path instead of two), and the receiver copies them out. 0 turns it off. Both ends must enable it (the smaller limit is used); it is off on devices that offer GPUDirect (a CPU copy cannot reach GPU memory) and on merged devices. Ring memory per connection that uses it: about 32 x (the limit + 64 bytes) on each end (133 KiB at the default); when it is registered: RUSTNET_IB_EAGER_LAZY.
    ib_eager: Int<0, 65536> = "RUSTNET_IB_EAGER", default "4096", accepts "bytes 0..65536 (0 = off)";
    /// 1: the receiver registers its eager ring, and the sender its staging, only the first time the sender has a small message ready before the receiver's clear-to-send, so a connection that never sends one ahead costs no ring memory (the messages before the ring is up go by clear-to-send). Needs both ends at a build that knows it; with an older peer the ring is registered at connect, as with 0.
    ib_eager_lazy: Int<0, 1> = "RUSTNET_IB_EAGER_LAZY", default "1", accepts "0 or 1";
    /// GPU memory over verbs: `auto` offers it when peer memory or dma-buf works (and says why not otherwise); `off` reports host memory only.
    gdr: GdrChoice = "RUSTNET_GDR", default "auto", accepts "auto or off";
    /// NCCL's switch for dma-buf registration; 0 keeps NCCL_PTR_DMABUF off.
    dmabuf_enable: Int<0, 1> = "NCCL_DMABUF_ENABLE", default "1", accepts "0 or 1";
    /// 1 disables the flush after GPUDirect receives (NCCL's meaning).
    gdr_flush_disable: Int<0, 1> = "NCCL_GDR_FLUSH_DISABLE", default "0", accepts "0 or 1";
    /// 1 asks NCCL to flush after every GPUDirect receive (reported as forceFlush, ABI v9+).
    force_flush: Int<0, 1> = "RUSTNET_FORCE_FLUSH", default "0", accepts "0 or 1";
    /// 1: every verbs comm prints one INFO line on close with what each of its QPs carried (messages, bytes); the same line is logged at TRACE (NCCL_DEBUG=TRACE) without it.
    stats: Int<0, 1> = "RUSTNET_STATS", default "0", accepts "0 or 1";
    /// NCCL profiler events (ABI v10+): with 1, when NCCL passes its profiler callback to init, the plugin reports a start and a stop event per posted verbs work request per QP and per TCP stream piece, linked to NCCL's per-request parent handle, in the formats of NCCL's own IB and socket transports (docs/profiler.md); 0 ignores the callback (no events, no cost).
    profiler: Int<0, 1> = "RUSTNET_PROFILER", default "1", accepts "0 or 1";
    /// Directory where each process keeps `<host>-<pid>.prom`, its statistics in the Prometheus text format (node_exporter's textfile collector reads such a directory): bytes, messages, completions and errors per device, per open comm and per verbs QP, and the transport in use, with host, pid and rank labels (the rank from RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK or SLURM_PROCID). A background thread rewrites it (temp file + rename) every RUSTNET_STATS_INTERVAL seconds while comms are open, and once more when the last comm closes; the data path only bumps counters. Created if missing. `rustnet stats DIR` summarises a job's files. Empty: off.
    stats_dir: String = "RUSTNET_STATS_DIR", default "", accepts "empty or a directory path";
    /// Seconds between two rewrites of the RUSTNET_STATS_DIR file.
    stats_interval: Int<1, 3600> = "RUSTNET_STATS_INTERVAL", default "5", accepts "seconds, 1..3600";
    /// Testing only: panic on entry to the named vtable slot (e.g. `isend`), or inside isend/test after the transport changed its state (`isend:queued`, `test:progressed`), to prove the boundary catches it and fails that comm (see src/fault.rs).
    fault_panic: FaultPanic = "RUSTNET_FAULT_PANIC", default "", accepts "a vtable slot name, isend:queued or test:progressed";
    /// Testing only: move one of a comm's verbs QPs to the error state at a chosen point, so any device (soft-RoCE included) can be driven through recovery: `send:N` / `recv:N` after the N-th data post of each send / receive comm of the process, `send:N:K` and `recv:N:K` every K posts after that, `random:P` on each post with probability P per mille (seeded by RUSTNET_FAULT_SEED). Empty: off.
    fault_qp_error: FaultQp = "RUSTNET_FAULT_QP_ERROR", default "", accepts "send:N[:K], recv:N[:K] or random:P";
    /// Testing only: seed of RUSTNET_FAULT_QP_ERROR=random:P (0: from the clock, logged).
    fault_seed: Int<0, 4294967295> = "RUSTNET_FAULT_SEED", default "0", accepts "an integer 0..4294967295";
    /// Testing only: reset one TCP stream of each comm (as a middlebox's reset or `ss -K` would: the peer gets a reset, the local end an error) after the N-th data write of each send comm (`send:N`) or the N-th data read of each receive comm (`recv:N`), then every K after that (`send:N:K`, `recv:N:K`), so the recovery (RUSTNET_RECOVERY_TIMEOUT) can be driven on any host. A send comm resets the stream it just wrote, a receive comm stream (count modulo its streams). Empty: off.
    fault_tcp_reset: FaultTcpReset = "RUSTNET_FAULT_TCP_RESET", default "", accepts "send:N[:K] or recv:N[:K]";
    /// Testing only: the first N moves of a new connection's QPs to RTR in this process fail with ETIMEDOUT before reaching the kernel, as when the link goes down inside `ibv_modify_qp` (RoCE: the kernel's resolution of the peer's address times out), so the connect's retry can be driven on any device. 0: off.
    fault_rtr: Int<0, 1000> = "RUSTNET_FAULT_RTR", default "0", accepts "a count 0..1000";
    /// NCCL's own log level; we read it only to decide whether TRACE lines are formatted at all.
    nccl_debug: LogLevel = "NCCL_DEBUG", default "WARN", accepts "WARN, INFO or TRACE";
}

impl Config {
    /// From the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(&|k| std::env::var(k).ok())
    }
}

/// The knob table as the Markdown of `docs/knobs.md`.
pub fn knobs_markdown() -> String {
    let mut s = String::from(
        "# librustnet knobs\n\n\
         Every environment variable the plugin reads, generated from the table in `src/config.rs`\n\
         (`rustnet knobs --markdown > docs/knobs.md`; a test keeps the two in step).\n\
         `NCCL_*` names mean what they mean for NCCL's own transports; `RUSTNET_*` names are ours.\n\
         An invalid value makes `init` fail with a WARN naming the variable, the value and what is accepted.\n\n\
         | variable | default | accepts | meaning |\n|---|---|---|---|\n",
    );
    for k in KNOBS {
        s += &format!(
            "| `{}` | `{}` | {} | {} |\n",
            k.name,
            if k.default.is_empty() { "(empty)" } else { k.default },
            k.accepts,
            k.doc.trim()
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(&|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_parse() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.transport, TransportChoice::Auto);
        assert!(c.socket_ifname.is_empty());
        assert_eq!(c.nsocks_per_thread.get(), 1);
        assert_eq!(c.socket_min_chunk, Bytes(64 << 10));
        assert_eq!(c.ib_gid_index.get(), -1);
    }

    #[test]
    fn invalid_values_name_variable_value_and_accepted() {
        let e = cfg(&[("RUSTNET_TRANSPORT", "carrier-pigeon")]).unwrap_err().to_string();
        assert!(e.contains("RUSTNET_TRANSPORT") && e.contains("carrier-pigeon") && e.contains("auto, ib or socket"), "{e}");
        let e = cfg(&[("NCCL_NSOCKS_PERTHREAD", "65")]).unwrap_err().to_string();
        assert!(e.contains("NCCL_NSOCKS_PERTHREAD") && e.contains("1..64"), "{e}");
        let e = cfg(&[("NCCL_SOCKET_FAMILY", "AF_UNIX")]).unwrap_err().to_string();
        assert!(e.contains("AF_INET6"), "{e}");
        assert!(cfg(&[("NCCL_IB_TIMEOUT", "0x10")]).unwrap().ib_timeout.get() == 16);
        assert!(cfg(&[("RUSTNET_SOCKET_MIN_CHUNK", "12Q")]).is_err());
        assert!(cfg(&[("NCCL_SOCKET_IFNAME", "^")]).is_err());
        assert!(cfg(&[("NCCL_IB_HCA", "mlx5_0:x")]).is_err());
    }

    #[test]
    fn problems_lists_every_bad_value_in_table_order() {
        let m: HashMap<String, String> = [("RUSTNET_TRANSPORT", "bogus"), ("NCCL_IB_TIMEOUT", "99"), ("RUSTNET_SOCKET_TIMEOUT", "-3")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let names: Vec<&str> = Config::problems(&|k| m.get(k).cloned())
            .iter()
            .map(|e| match e {
                Error::Config { name, .. } => *name,
                other => panic!("{other}"),
            })
            .collect();
        assert_eq!(names, ["RUSTNET_TRANSPORT", "RUSTNET_SOCKET_TIMEOUT", "NCCL_IB_TIMEOUT"]);
        assert!(Config::problems(&|_| None).is_empty());
    }

    #[test]
    fn empty_value_means_default() {
        assert_eq!(cfg(&[("RUSTNET_TRANSPORT", "  ")]).unwrap().transport, TransportChoice::Auto);
    }

    #[test]
    fn namelist_syntax() {
        let l = NameList::parse_knob("eth,ib").unwrap();
        assert!(l.accepts("eth0", None) && l.accepts("ib1", None) && !l.accepts("lo", None));
        let l = NameList::parse_knob("^docker,lo").unwrap();
        assert!(!l.accepts("docker0", None) && !l.accepts("lo", None) && l.accepts("eth0", None));
        let l = NameList::parse_knob("=eth0").unwrap();
        assert!(l.accepts("eth0", None) && !l.accepts("eth01", None));
        let l = NameList::parse_knob("^=eth0").unwrap();
        assert!(!l.accepts("eth0", None) && l.accepts("eth01", None));
        let l = NameList::parse_knob("mlx5_0:1,mlx5_1").unwrap();
        assert!(l.accepts("mlx5_0", Some(1)) && !l.accepts("mlx5_0", Some(2)));
        assert!(l.accepts("mlx5_1", Some(2)) && l.accepts("mlx5_10", Some(1)));
        let names = vec!["mlx5_1".to_string(), "mlx5_10".to_string(), "mlx5_0".to_string()];
        assert_eq!(l.ambiguous_prefixes(&names), vec!["mlx5_1"]);
        assert!(NameList::parse_knob("").unwrap().accepts("anything", Some(3)));
    }

    #[test]
    fn addr_range_cidr() {
        let r = AddrRange::parse_knob("10.199.5.0/24").unwrap();
        assert!(r.contains("10.199.5.7".parse().unwrap()) && !r.contains("10.199.0.1".parse().unwrap()));
        assert!(r.contains("::ffff:10.199.5.1".parse().unwrap()) && !r.contains("fd99::1".parse().unwrap()));
        assert_eq!(r.family(), Some(Family::V4));
        assert_eq!(r.to_string(), "10.199.5.0/24");
        let r = AddrRange::parse_knob("fd99::/16").unwrap();
        assert!(r.contains("fd99:1::5".parse().unwrap()) && !r.contains("fd98::1".parse().unwrap()));
        assert!(!r.contains("10.0.0.1".parse().unwrap()));
        assert!(AddrRange::parse_knob("0.0.0.0/0").unwrap().contains("1.2.3.4".parse().unwrap()));
        assert!(!AddrRange::parse_knob("").unwrap().is_set());
        for bad in ["10.0.0.0", "10.0.0.0/33", "fd00::/129", "x/8"] {
            assert!(AddrRange::parse_knob(bad).is_none(), "{bad}");
        }
        let e = cfg(&[("NCCL_IB_ADDR_RANGE", "10.0.0.0")]).unwrap_err().to_string();
        assert!(e.contains("NCCL_IB_ADDR_RANGE") && e.contains("CIDR"), "{e}");
    }

    #[test]
    fn bytes_suffixes() {
        assert_eq!(Bytes::parse_knob("4M"), Some(Bytes(4 << 20)));
        assert_eq!(Bytes::parse_knob("512"), Some(Bytes(512)));
        assert_eq!(Bytes::parse_knob("1g"), Some(Bytes(1 << 30)));
        assert_eq!(Bytes::parse_knob("M"), None);
    }

    #[test]
    fn docs_knobs_md_is_current() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/knobs.md")).expect("docs/knobs.md");
        assert_eq!(doc, knobs_markdown(), "docs/knobs.md is stale: run `rustnet knobs --markdown > docs/knobs.md`");
    }

    #[test]
    fn table_has_unique_names_and_docs() {
        let mut names: Vec<_> = KNOBS.iter().map(|k| k.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), KNOBS.len());
        assert!(KNOBS.iter().all(|k| !k.doc.is_empty() && !k.accepts.is_empty()));
    }
}
