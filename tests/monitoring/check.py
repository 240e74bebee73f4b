#!/usr/bin/env python3
"""PromQL checks for tests/monitoring/run.sh, against a real Prometheus.

  check.py counts URL --ranks N --bytes B --msgs M --errors E --conns C --phase open|closed
      waits (bounded) until every rank's device counters hold exactly the
      given values, then asserts them per rank, per device and per direction,
      and per comm while the comms are open
  check.py dashboard URL FILE
      runs every query of the Grafana dashboard FILE (variables set to match
      everything) and asserts each one is valid PromQL, and returns series
      unless it reads only the resilience counters the plugin does not write yet
Standard library only. Exit 0 pass, 1 fail; every failure says what it got.
"""
import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request

# the plugin does not write this yet (no merged-device failover); panels and
# rules over it are valid PromQL that returns nothing
NOT_YET = ("rustnet_failovers_total",)


def query(url, expr):
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def by(result, *labels):
    """{(label values...): float value} of an instant vector."""
    return {tuple(s["metric"].get(l, "") for l in labels): float(s["value"][1]) for s in result}


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def counts(a):
    ranks = [str(r) for r in range(a.ranks)]
    want = {
        "rustnet_device_bytes_total": {"send": a.bytes, "recv": a.bytes},
        "rustnet_device_messages_total": {"send": a.msgs, "recv": a.msgs},
        "rustnet_device_completions_total": {"send": a.msgs, "recv": a.msgs},
        "rustnet_device_errors_total": {"send": a.errors, "recv": 0},
        "rustnet_device_comms_total": {"send": a.conns, "recv": a.conns},
        "rustnet_device_comms_open": {"send": a.conns if a.phase == "open" else 0, "recv": a.conns if a.phase == "open" else 0},
    }
    expect = {(m, r, d): v for m, per in want.items() for r in ranks for d, v in per.items()}

    def got_all():
        g = {}
        for m in want:
            for (r, d), v in by(query(a.url, f"sum by (rank, dir) ({m})"), "rank", "dir").items():
                g[(m, r, d)] = v
        return g

    deadline = time.monotonic() + a.timeout
    while True:
        got = got_all()
        if all(got.get(k) == v for k, v in expect.items()):
            break
        if time.monotonic() > deadline:
            bad = {k: (got.get(k), v) for k, v in expect.items() if got.get(k) != v}
            fail(f"after {a.timeout} s, (metric, rank, dir): (got, want) = {bad}")
        time.sleep(0.5)
    print(f"ok: per rank and direction, {len(expect)} device counters exact ({a.phase} comms): "
          f"{a.bytes} bytes, {a.msgs} messages and completions each way, {a.errors} send errors, 0 receive errors")
    # per device: one device per rank, the same exact values on it
    for m in ("rustnet_device_bytes_total", "rustnet_device_messages_total", "rustnet_device_errors_total"):
        per_dev = by(query(a.url, f"sum by (rank, device, dir) ({m})"), "rank", "device", "dir")
        for r in ranks:
            devs = sorted({dev for (rr, dev, _) in per_dev if rr == r})
            if len(devs) != 1 or devs[0] == "":
                fail(f"{m}: rank {r} has devices {devs}, want exactly one named device")
            for d, v in want[m].items():
                if per_dev.get((r, devs[0], d)) != v:
                    fail(f"{m}{{rank={r}, device={devs[0]}, dir={d}}} = {per_dev.get((r, devs[0], d))}, want {v}")
    devices = sorted({k[1] for k in by(query(a.url, "sum by (rank, device) (rustnet_device_bytes_total)"), "rank", "device")})
    print(f"ok: per device ({', '.join(devices)}): the same exact counts")
    # per comm (only while open): conns comms each way per rank, summing to the device's
    comm_m = ("rustnet_comm_bytes_total", "rustnet_comm_messages_total", "rustnet_comm_errors_total")
    for m in comm_m:
        n = by(query(a.url, f"count by (rank, dir) ({m})"), "rank", "dir")
        s = by(query(a.url, f"sum by (rank, dir) ({m})"), "rank", "dir")
        base = m.replace("comm_", "device_")
        for r in ranks:
            for d in ("send", "recv"):
                if a.phase == "open":
                    if n.get((r, d)) != a.conns or s.get((r, d)) != want[base][d]:
                        fail(f"{m} rank {r} {d}: {n.get((r, d))} comm(s) summing to {s.get((r, d))}, want {a.conns} summing to {want[base][d]}")
                elif (r, d) in n:
                    fail(f"{m} rank {r} {d}: {n[(r, d)]} series after every comm closed, want none")
    print(f"ok: per comm: {'%d comm(s) per rank and direction summing to the device counts' % a.conns if a.phase == 'open' else 'no series once the comms closed'}")
    info = by(query(a.url, "count by (transport) (rustnet_info)"), "transport")
    if info != {("socket",): float(a.ranks)}:
        fail(f"rustnet_info by transport = {info}, want {a.ranks} x socket")
    errs = query(a.url, "node_textfile_scrape_error")
    if not errs or any(float(s["value"][1]) != 0 for s in errs):
        fail(f"node_textfile_scrape_error = {errs}, want 0 (node_exporter could not read a file)")
    print("ok: rustnet_info says socket for every rank; node_textfile_scrape_error 0")


def dashboard(a):
    d = json.load(open(a.file))
    exprs = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            exprs.append((p["title"], t["expr"]))
    subst = {"$__rate_interval": "15s", "$host": ".*", "$rank": ".*"}
    n_data = 0
    for title, e in exprs:
        q = e
        for k, v in subst.items():
            q = q.replace(k, v)
        if "$" in re.sub(r"\{\{[^}]*\}\}", "", q):
            fail(f"panel {title!r}: unresolved variable in {q}")
        only_not_yet = all(m in NOT_YET for m in re.findall(r"rustnet_[a-z_]+_total", q)) and any(m in q for m in NOT_YET)
        deadline = time.monotonic() + 20  # a rate needs two scrapes inside its window
        while True:
            try:
                res = query(a.url, q)
            except Exception as ex:  # noqa: BLE001 - report any failure with the query
                fail(f"panel {title!r}: {q}: {ex}")
            if res or only_not_yet:
                break
            if time.monotonic() > deadline:
                raw = query(a.url, "rustnet_device_bytes_total[15s]")
                fail(f"panel {title!r}: {q} returned no series for 20 s; rustnet_device_bytes_total[15s] = {raw}")
            time.sleep(0.5)
        n_data += bool(res)
    for v in d["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", v.get("query", "") if isinstance(v.get("query"), str) else "")
        if not m:
            continue
        sel = m.group(1).replace("$host", ".*")
        q = urllib.parse.urlencode({"match[]": sel})
        with urllib.request.urlopen(f"{a.url}/api/v1/label/{m.group(2)}/values?{q}", timeout=10) as r:
            vals = json.load(r)["data"]
        if not vals:
            fail(f"variable {v['name']}: label_values({sel}, {m.group(2)}) is empty")
    print(f"ok: dashboard: {len(exprs)} queries valid on this Prometheus, {n_data} with series "
          f"(the rest read only {', '.join(NOT_YET)}); its variables resolve")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("counts")
    c.add_argument("url")
    for k in ("ranks", "bytes", "msgs", "errors", "conns"):
        c.add_argument(f"--{k}", type=int, required=True)
    c.add_argument("--phase", choices=("open", "closed"), required=True)
    c.add_argument("--timeout", type=float, default=60)
    d = sub.add_parser("dashboard")
    d.add_argument("url")
    d.add_argument("file")
    a = ap.parse_args()
    counts(a) if a.cmd == "counts" else dashboard(a)


if __name__ == "__main__":
    main()
