//! How the soak's two peers are wired (loopback, namespaces + veth, the VM), and how the link is cut.
use super::*;

/// How the two peers are wired, and how the link is cut.
#[derive(Clone, PartialEq)]
pub(crate) enum Net {
    /// Both on `lo`: no link to cut (said loudly).
    Loopback,
    /// Two namespaces and a veth pair (root and iproute2).
    Netns { a: String, b: String, ia: String, ib: String },
    /// Inside tests/rxe-vm: rxe0 on veth0, rxe1 on veth1, one namespace.
    Vm,
}

impl Net {
    pub(crate) fn setup(kind: &str) -> Result<Net, String> {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let kind = match kind {
            "auto" if std::env::var_os("RXE_VM_DEVICES").is_some() => "vm",
            "auto" if root && sh("ip netns list") => "netns",
            "auto" => "loopback",
            k => k,
        };
        match kind {
            "loopback" => Ok(Net::Loopback),
            "vm" => Ok(Net::Vm),
            "netns" => {
                let id = std::process::id() % 100000;
                let (a, b) = (format!("rnsoakA{id}"), format!("rnsoakB{id}"));
                let (ia, ib) = (format!("rsA{id}"), format!("rsB{id}"));
                let n = Net::Netns { a: a.clone(), b: b.clone(), ia: ia.clone(), ib: ib.clone() };
                let ok = sh(&format!("ip netns add {a}"))
                    && sh(&format!("ip netns add {b}"))
                    && sh(&format!("ip link add {ia} netns {a} type veth peer name {ib} netns {b}"))
                    && sh(&format!("ip -n {a} addr add 10.79.0.1/24 dev {ia} && ip -n {a} link set {ia} up && ip -n {a} link set lo up"))
                    && sh(&format!("ip -n {b} addr add 10.79.0.2/24 dev {ib} && ip -n {b} link set {ib} up && ip -n {b} link set lo up"));
                if !ok {
                    n.teardown();
                    return Err("could not build the namespace pair (ip netns/veth)".into());
                }
                n.wait_up()?;
                Ok(n)
            }
            k => Err(format!("SOAK_NET={k}: expected auto, loopback, netns or vm")),
        }
    }
    pub(crate) fn teardown(&self) {
        if let Net::Netns { a, b, .. } = self {
            sh(&format!("ip netns del {a}"));
            sh(&format!("ip netns del {b}"));
        }
        if *self == Net::Vm {
            sh("tc qdisc del dev veth0 root; tc qdisc del dev veth1 root");
        }
    }
    /// The out-of-band address of a peer (what its errors name).
    pub(crate) fn ip(&self, role: char) -> &'static str {
        match (self, role) {
            (Net::Loopback, _) => "127.0.0.1",
            (Net::Netns { .. }, 'A') => "10.79.0.1",
            (Net::Netns { .. }, _) => "10.79.0.2",
            (Net::Vm, 'A') => "10.199.0.1",
            (Net::Vm, _) => "10.199.0.2",
        }
    }
    pub(crate) fn can_cut(&self) -> bool {
        *self != Net::Loopback
    }
    /// The link command for A's end (the one cut).
    pub(crate) fn link(&self, up: bool) -> bool {
        let st = if up { "up" } else { "down" };
        match self {
            Net::Loopback => false,
            // ip itself, no shell: on a loaded machine every exec counts
            // against the length of a short flap
            Net::Netns { a, ia, .. } => Command::new("ip").args(["-n", a, "link", "set", ia, st]).status().is_ok_and(|s| s.success()),
            // taking veth1 down flushes its routes, among them the policy
            // route tests/rxe-vm/guest.sh added (table 101): put it back in
            // the same ip batch as the link, as a host's connected routes
            // come back with it (not one process later)
            Net::Vm if up => {
                sh("printf 'link set veth1 up\\nroute replace 10.199.0.1 dev veth1 src 10.199.0.2 table 101\\n' | ip -force -batch -")
            }
            Net::Vm => sh("ip link set veth1 down"),
        }
    }
    pub(crate) fn wait_up(&self) -> Result<(), String> {
        let t0 = Instant::now();
        let ready = || match self {
            Net::Loopback => true,
            Net::Netns { a, b, ia, ib } => {
                sh(&format!("ip -n {a} link show dev {ia} | grep -q LOWER_UP"))
                    && sh(&format!("ip -n {b} link show dev {ib} | grep -q LOWER_UP"))
            }
            // the rxe ports follow their netdevs: ACTIVE again, IPv4 GID back
            Net::Vm => (0..2).all(|d| {
                let p = format!("/sys/class/infiniband/rxe{d}/ports/1");
                std::fs::read_to_string(format!("{p}/state")).is_ok_and(|s| s.contains("ACTIVE"))
                    && (0..8).any(|i| {
                        std::fs::read_to_string(format!("{p}/gids/{i}")).is_ok_and(|g| g.starts_with("0000:0000:0000:0000:0000:ffff:"))
                    })
            }),
        };
        while !ready() {
            if t0.elapsed() > Duration::from_secs(30) {
                return Err("the link did not come back within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
    pub(crate) fn set_loss(&self, loss: &str) -> Result<(), String> {
        let devs: Vec<String> = match self {
            Net::Loopback => return Err("SOAK_LOSS needs a link (netns or vm), not loopback".into()),
            Net::Netns { a, b, ia, ib } => vec![format!("-n {a} qdisc replace dev {ia}"), format!("-n {b} qdisc replace dev {ib}")],
            Net::Vm => vec!["qdisc replace dev veth0".into(), "qdisc replace dev veth1".into()],
        };
        for d in devs {
            let cmd = format!("tc {d} root netem loss {loss}");
            let out = Command::new("sh").arg("-c").arg(&cmd).output().map_err(|e| e.to_string())?;
            if !out.status.success() {
                return Err(format!("{cmd}: {}", String::from_utf8_lossy(&out.stderr).trim()));
            }
        }
        Ok(())
    }
    /// Peer environment and the netns to run in.
    pub(crate) fn peer_env(&self, role: &str) -> (Option<String>, Vec<(String, String)>) {
        let kv = |k: &str, v: &str| (k.to_string(), v.to_string());
        match self {
            Net::Loopback => (None, vec![kv("NCCL_SOCKET_IFNAME", "lo")]),
            Net::Netns { a, b, ia, ib } => {
                if role == "A" {
                    (Some(a.clone()), vec![kv("NCCL_SOCKET_IFNAME", ia)])
                } else {
                    (Some(b.clone()), vec![kv("NCCL_SOCKET_IFNAME", ib)])
                }
            }
            Net::Vm => {
                let (hca, ifn) = if role == "A" { ("=rxe0", "veth0") } else { ("=rxe1", "veth1") };
                (None, vec![kv("NCCL_IB_HCA", hca), kv("NCCL_SOCKET_IFNAME", ifn)])
            }
        }
    }
}
