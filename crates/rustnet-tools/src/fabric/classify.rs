//! Names what a port's counter increases show: congestion (ECN marks and
//! DCQCN CNPs), PFC pause frames, loss (out-of-sequence packets, sequence
//! NAKs, retransmit timeouts, duplicates), receiver-not-ready NAKs, drops,
//! retries exhausted, completion errors, link errors, or plain traffic.
//! Pure: a [`Delta`] in, findings out; `rustnet watch` feeds it rates,
//! `rustnet doctor` totals since the driver loaded.
use super::counters::{Delta, Source};

/// How much a finding matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Traffic, idle.
    Info,
    /// Flow control doing its job (CNPs, pauses): fine in moderation.
    Notice,
    /// Loss, drops, RNR, completion errors: costs time.
    Warn,
    /// Link errors, retries exhausted: connections fail.
    Alert,
}

/// What kind of event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Counters moved, nothing wrong.
    Traffic,
    /// ECN marks / CNPs / credit waits.
    Congestion,
    /// Pause frames.
    Pfc,
    /// Packets lost and retransmitted.
    Loss,
    /// Receiver-not-ready NAKs.
    Rnr,
    /// Packets dropped for lack of buffers.
    Drops,
    /// Transport retries exhausted (QPs in error).
    Retries,
    /// Completion errors.
    Errors,
    /// Physical link errors or link down.
    Link,
}

impl Kind {
    /// Word used in the text.
    pub fn word(self) -> &'static str {
        match self {
            Kind::Traffic => "traffic",
            Kind::Congestion => "congestion",
            Kind::Pfc => "PFC",
            Kind::Loss => "loss",
            Kind::Rnr => "receiver not ready",
            Kind::Drops => "drops",
            Kind::Retries => "failure",
            Kind::Errors => "errors",
            Kind::Link => "link",
        }
    }
}

/// One named observation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Kind.
    pub kind: Kind,
    /// Severity.
    pub severity: Severity,
    /// One line: "congestion: CNPs rising on mlx5_2 port 1 (np_cnp_sent +1200/s)".
    pub text: String,
}

struct Rule {
    kind: Kind,
    severity: Severity,
    /// (counter, what it means in a few words); the first present names the finding.
    counters: &'static [(&'static str, &'static str)],
    /// Appended when it fires: what it means / what to look at.
    hint: &'static str,
}

const RULES: &[Rule] = &[
    Rule {
        kind: Kind::Link,
        severity: Severity::Alert,
        counters: &[
            ("link_downed", "link_downed"),
            ("link_down_events_phy", "link down events"),
            ("link_error_recovery", "link error recovery"),
            ("symbol_error", "symbol errors"),
            ("rx_symbol_err_phy", "symbol errors"),
            ("rx_crc_errors_phy", "CRC errors"),
            ("port_rcv_errors", "receive errors"),
            ("local_link_integrity_errors", "link integrity errors"),
            ("port_rcv_remote_physical_errors", "remote physical errors"),
            ("rx_icrc_encapsulated", "ICRC errors"),
        ],
        hint: "check the cable, transceiver and switch port",
    },
    Rule {
        kind: Kind::Retries,
        severity: Severity::Alert,
        counters: &[
            ("retry_exceeded_err", "retries exhausted"),
            ("req_transport_retries_exceeded", "retries exhausted"),
            ("retry_rnr_exceeded_err", "RNR retries exhausted"),
            ("req_rnr_retries_exceeded", "RNR retries exhausted"),
        ],
        hint: "QPs went to error: connections fail (NCCL_IB_TIMEOUT / NCCL_IB_RETRY_CNT bound the wait)",
    },
    Rule {
        kind: Kind::Loss,
        severity: Severity::Warn,
        counters: &[
            ("out_of_sequence", "out-of-sequence"),
            ("out_of_seq_request", "out-of-sequence"),
            ("packet_seq_err", "sequence-error NAKs"),
            ("rcvd_seq_err", "sequence-error NAKs"),
            ("implied_nak_seq_err", "implied sequence NAKs"),
            ("local_ack_timeout_err", "ACK timeouts"),
            ("completer_retry_err", "retransmissions"),
            ("roce_adp_retrans", "retransmissions"),
            ("roce_adp_retrans_to", "retransmit timeouts"),
            ("duplicate_request", "duplicate requests"),
            ("roce_slow_restart", "slow restarts"),
        ],
        hint: "packets are dropped on the path and retransmitted (go-back-N): check PFC and the switch drop counters",
    },
    Rule {
        kind: Kind::Drops,
        severity: Severity::Warn,
        counters: &[
            ("out_of_buffer", "out_of_buffer"),
            ("rx_out_of_buffer", "out_of_buffer"),
            ("rx_discards_phy", "receive discards"),
            ("tx_discards_phy", "transmit discards"),
            ("port_xmit_discards", "transmit discards"),
            ("excessive_buffer_overrun_errors", "buffer overruns"),
            ("port_rcv_constraint_errors", "receive constraint errors"),
            ("port_xmit_constraint_errors", "transmit constraint errors"),
        ],
        hint: "the NIC dropped packets for lack of buffers",
    },
    Rule {
        kind: Kind::Rnr,
        severity: Severity::Warn,
        counters: &[("rnr_nak_retry_err", "RNR NAKs"), ("rcvd_rnr_err", "RNR NAKs received"), ("send_rnr_err", "RNR NAKs sent")],
        hint: "a receive queue was empty when a send arrived",
    },
    Rule {
        kind: Kind::Errors,
        severity: Severity::Warn,
        counters: &[
            ("send_err", "send errors"),
            ("req_cqe_error", "requester completion errors"),
            ("resp_cqe_error", "responder completion errors"),
            ("req_remote_access_errors", "remote access errors"),
            ("resp_remote_access_errors", "remote access errors"),
            ("req_remote_invalid_request", "invalid requests"),
            ("resp_local_length_error", "length errors"),
        ],
        hint: "work requests completed with errors",
    },
    Rule {
        kind: Kind::Congestion,
        severity: Severity::Notice,
        counters: &[
            ("np_cnp_sent", "CNPs"),
            ("rp_cnp_handled", "CNPs"),
            ("cc_tx_cnp_pkts", "CNPs"),
            ("cc_rx_cnp_pkts", "CNPs"),
            ("rp_cnp_ignored", "CNPs"),
            ("roce_slow_restart_cnps", "CNPs"),
            ("np_ecn_marked_roce_packets", "ECN-marked packets"),
            ("cc_rx_ce_pkts", "ECN-marked packets"),
            ("port_xmit_wait", "transmit waits"),
        ],
        hint: "np_*: packets reaching this port were ECN-marked; rp_*: this port's senders were slowed by DCQCN",
    },
];

/// Traffic counters (bytes as 4-byte words in `port_*_data`).
const TRAFFIC: &[&str] = &[
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "sent_pkts",
    "rcvd_pkts",
    "rdma_sends",
    "rdma_recvs",
    "rx_write_requests",
    "rx_read_requests",
];

/// `rx_prio3_pause` -> Some((rx, 3)); durations and transitions are not frames.
fn prio_pause(name: &str) -> Option<(&str, u8)> {
    let (dir, rest) = name.split_once("_prio")?;
    let p = rest.strip_suffix("_pause")?;
    Some((dir, p.parse().ok().filter(|&p: &u8| p < 8)?))
}

fn global_pause(name: &str) -> bool {
    matches!(name, "rx_pause_ctrl_phy" | "tx_pause_ctrl_phy" | "rx_global_pause" | "tx_global_pause")
}

/// Name what `d` shows, most severe first. Empty only when nothing moved
/// and `d` is a rate (an idle port gives one Info finding saying so).
pub fn classify(d: &Delta) -> Vec<Finding> {
    let rising = if d.secs.is_some() { " rising" } else { "" };
    let on = format!("{} port {}", d.dev, d.port);
    let mut out = Vec::new();
    let list = |names: &[&str]| -> String {
        names.iter().filter(|n| d.get(n) > 0).map(|n| format!("{n} {}", d.show(d.get(n)))).collect::<Vec<_>>().join(", ")
    };
    for r in RULES {
        let hit: Vec<&(&str, &str)> = r.counters.iter().filter(|(n, _)| d.get(n) > 0).collect();
        let Some((_, what)) = hit.first() else { continue };
        let names: Vec<&str> = hit.iter().map(|(n, _)| *n).collect();
        out.push(Finding {
            kind: r.kind,
            severity: r.severity,
            text: format!("{}: {what}{rising} on {on} ({}): {}", r.kind.word(), list(&names), r.hint),
        });
    }
    // PFC: per priority, then global pause frames when no per-priority ones.
    let nd = d.netdev.clone().unwrap_or_else(|| on.clone());
    let mut prios: Vec<(u8, Vec<String>)> = Vec::new();
    for (_, k) in d.inc.keys().filter(|(s, _)| *s == Source::Ethtool) {
        if let Some((_, p)) = prio_pause(k) {
            match prios.iter_mut().find(|(q, _)| *q == p) {
                Some((_, v)) => v.push(k.clone()),
                None => prios.push((p, vec![k.clone()])),
            }
        }
    }
    prios.sort();
    for (p, names) in &prios {
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let who = match (names.iter().any(|n| n.starts_with("rx")), names.iter().any(|n| n.starts_with("tx"))) {
            (true, false) => "the switch is pausing this NIC",
            (false, true) => "this NIC is pausing the switch (the host does not drain fast enough)",
            _ => "both directions pause",
        };
        out.push(Finding {
            kind: Kind::Pfc,
            severity: Severity::Notice,
            text: format!("PFC: pause frames on {nd} prio {p} ({}): {who}", list(&names)),
        });
    }
    if prios.is_empty() {
        let g: Vec<String> = d.inc.keys().filter(|(s, k)| *s == Source::Ethtool && global_pause(k)).map(|(_, k)| k.clone()).collect();
        if !g.is_empty() {
            let names: Vec<&str> = g.iter().map(String::as_str).collect();
            out.push(Finding {
                kind: Kind::Pfc,
                severity: Severity::Notice,
                text: format!("PFC: pause frames on {nd} ({})", list(&names)),
            });
        }
    }
    let storm: Vec<&str> = ["tx_pause_storm_warning_events", "tx_pause_storm_error_events"].into_iter().filter(|n| d.get(n) > 0).collect();
    if !storm.is_empty() {
        out.push(Finding {
            kind: Kind::Pfc,
            severity: Severity::Alert,
            text: format!(
                "PFC: pause storm on {nd} ({}): the NIC kept pausing the switch and its watchdog stepped in; the host is stuck",
                list(&storm)
            ),
        });
    }
    // Traffic: always said, so "nothing wrong" is visible as such.
    let moving: Vec<&str> = TRAFFIC.iter().copied().filter(|n| d.get(n) > 0).collect();
    if !moving.is_empty() {
        let mut t = list(&moving);
        let words = d.get("port_xmit_data") + d.get("port_rcv_data");
        if words > 0 {
            t.push_str(&format!("; {} in+out", bytes(words.saturating_mul(4), d.secs)));
        }
        out.push(Finding { kind: Kind::Traffic, severity: Severity::Info, text: format!("traffic: {on}: {t}") });
    } else if out.is_empty() && d.secs.is_some() {
        out.push(Finding { kind: Kind::Traffic, severity: Severity::Info, text: format!("idle: no counter moved on {on}") });
    }
    out.sort_by_key(|f| std::cmp::Reverse(f.severity));
    out
}

fn bytes(b: u64, secs: Option<f64>) -> String {
    let (v, unit) = match secs {
        Some(s) => (b as f64 / s, "/s"),
        None => (b as f64, ""),
    };
    let (v, p) = if v >= 1e9 {
        (v / 1e9, "GB")
    } else if v >= 1e6 {
        (v / 1e6, "MB")
    } else if v >= 1e3 {
        (v / 1e3, "kB")
    } else {
        (v, "B")
    };
    format!("{v:.1} {p}{unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(dev: &str, netdev: Option<&str>, secs: Option<f64>, inc: &[(Source, &str, u64)]) -> Delta {
        Delta {
            dev: dev.into(),
            port: 1,
            netdev: netdev.map(Into::into),
            secs,
            inc: inc.iter().map(|(s, k, v)| ((*s, k.to_string()), *v)).collect(),
        }
    }

    #[test]
    fn cnps_are_congestion() {
        let d = delta("mlx5_2", Some("eth2"), Some(1.0), &[(Source::Hw, "np_cnp_sent", 1200), (Source::Hw, "rp_cnp_handled", 300)]);
        let f = classify(&d);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].kind, Kind::Congestion);
        assert!(
            f[0].text.starts_with("congestion: CNPs rising on mlx5_2 port 1 (np_cnp_sent +1200/s, rp_cnp_handled +300/s)"),
            "{}",
            f[0].text
        );
        // ECN marks alone
        let d = delta("mlx5_2", None, Some(2.0), &[(Source::Hw, "np_ecn_marked_roce_packets", 10)]);
        assert!(classify(&d)[0]
            .text
            .starts_with("congestion: ECN-marked packets rising on mlx5_2 port 1 (np_ecn_marked_roce_packets +5/s)"));
    }

    #[test]
    fn rxe_out_of_sequence_is_loss_and_outranks_traffic() {
        let d = delta(
            "rxe0",
            Some("veth0"),
            Some(1.0),
            &[(Source::Hw, "sent_pkts", 1500), (Source::Hw, "out_of_seq_request", 12), (Source::Hw, "duplicate_request", 3)],
        );
        let f = classify(&d);
        assert_eq!(f[0].kind, Kind::Loss);
        assert!(
            f[0].text.starts_with("loss: out-of-sequence rising on rxe0 port 1 (out_of_seq_request +12/s, duplicate_request +3/s)"),
            "{}",
            f[0].text
        );
        assert_eq!(f[1].kind, Kind::Traffic);
        assert_eq!(f[1].text, "traffic: rxe0 port 1: sent_pkts +1500/s");
        // mlx5 names for the same
        let d = delta("mlx5_0", None, Some(1.0), &[(Source::Hw, "local_ack_timeout_err", 2), (Source::Hw, "packet_seq_err", 4)]);
        assert!(classify(&d)[0]
            .text
            .starts_with("loss: sequence-error NAKs rising on mlx5_0 port 1 (packet_seq_err +4/s, local_ack_timeout_err +2/s)"));
    }

    #[test]
    fn pfc_per_priority_and_direction() {
        let d = delta(
            "mlx5_2",
            Some("eth2"),
            Some(1.0),
            &[(Source::Ethtool, "rx_prio3_pause", 500), (Source::Ethtool, "rx_prio3_pause_duration", 900)],
        );
        let f = classify(&d);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].text, "PFC: pause frames on eth2 prio 3 (rx_prio3_pause +500/s): the switch is pausing this NIC");
        let d =
            delta("mlx5_2", Some("eth2"), Some(1.0), &[(Source::Ethtool, "tx_prio5_pause", 1), (Source::Ethtool, "rx_pause_ctrl_phy", 1)]);
        let f = classify(&d);
        assert_eq!(f.len(), 1, "per-priority frames hide the global count: {f:?}");
        assert!(f[0].text.contains("prio 5") && f[0].text.contains("this NIC is pausing the switch"));
        let d = delta("mlx5_2", Some("eth2"), Some(1.0), &[(Source::Ethtool, "rx_pause_ctrl_phy", 7)]);
        assert_eq!(classify(&d)[0].text, "PFC: pause frames on eth2 (rx_pause_ctrl_phy +7/s)");
        let d = delta("mlx5_2", Some("eth2"), Some(1.0), &[(Source::Ethtool, "tx_pause_storm_error_events", 1)]);
        let f = classify(&d);
        assert_eq!(f[0].severity, Severity::Alert);
        assert!(f[0].text.starts_with("PFC: pause storm on eth2"));
    }

    #[test]
    fn link_retries_drops_rnr_errors() {
        let d = delta(
            "mlx5_0",
            None,
            Some(1.0),
            &[
                (Source::Port, "link_downed", 1),
                (Source::Hw, "req_transport_retries_exceeded", 1),
                (Source::Hw, "out_of_buffer", 4),
                (Source::Hw, "rnr_nak_retry_err", 2),
                (Source::Hw, "req_remote_access_errors", 1),
            ],
        );
        let f = classify(&d);
        let kinds: Vec<Kind> = f.iter().map(|x| x.kind).collect();
        assert_eq!(kinds, [Kind::Link, Kind::Retries, Kind::Drops, Kind::Rnr, Kind::Errors]);
        assert!(f[0].text.starts_with("link: link_downed rising on mlx5_0 port 1 (link_downed +1/s)"), "{}", f[0].text);
        assert!(f[1].text.starts_with("failure: retries exhausted"));
        assert!(f[2].text.starts_with("drops: out_of_buffer"));
    }

    #[test]
    fn idle_and_totals() {
        let d = delta("rxe0", Some("veth0"), Some(1.0), &[]);
        assert_eq!(
            classify(&d),
            vec![Finding { kind: Kind::Traffic, severity: Severity::Info, text: "idle: no counter moved on rxe0 port 1".into() }]
        );
        // totals (doctor): no "rising", no "idle"
        assert!(classify(&delta("rxe0", None, None, &[])).is_empty());
        let f = classify(&delta("mlx5_0", None, None, &[(Source::Hw, "np_cnp_sent", 1200), (Source::Port, "port_xmit_data", 250)]));
        assert!(f[0].text.starts_with("congestion: CNPs on mlx5_0 port 1 (np_cnp_sent 1200)"), "{}", f[0].text);
        assert_eq!(f[1].text, "traffic: mlx5_0 port 1: port_xmit_data 250; 1.0 kB in+out");
    }
}
