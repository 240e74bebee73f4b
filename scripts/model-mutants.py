#!/usr/bin/env python3
"""Break one rule of the verbs protocol machines at a time and check that
the model test (crates/rustnet-proto/tests/verbs_model.rs) catches it.

Each mutation is one textual edit of the shipping code in rustnet-proto;
the script applies it, runs the model test, restores the file, and prints
a table: the mutation, caught or not, and the first line of the failure.
Exit status 1 if any mutation survives. Run from anywhere:

    scripts/model-mutants.py            # all (about 30 s each: a rebuild and 1000 seeds)
    scripts/model-mutants.py mailbox    # those whose name contains "mailbox"

It mutates a copy of the checkout (under target/mutants/src), never the
checkout itself, and builds in target/mutants/target.
"""
import os
import re
import shutil
import subprocess
import sys

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(CHECKOUT, "target", "mutants")
ROOT = os.path.join(WORK, "src")
SRC = os.path.join(ROOT, "crates", "rustnet-proto", "src")

# (name, file under crates/rustnet-proto/src, text, replacement)
MUTANTS = [
    ("FIFO slot reported free while busy", "rx.rs",
     "self.by_slot[slot].is_none() && self.cts.can_post()", "self.cts.can_post()"),
    ("sender reuses a head slot before its writes completed", "tx.rs",
     "self.inflight[(self.fifo.head() % FIFO_DEPTH as u64) as usize].active", "false"),
    ("sends reported done at post time", "tx.rs", "self.reqs.alloc(SendReq { size, done: false })",
     "self.reqs.alloc(SendReq { size, done: true })"),
    ("eager size not checked against the buffer", "rx.rs", "if size > r.caps[i] {", "if false {"),
    ("CTS batch ignores the sender's head", "eager.rs",
     "let to = want.min(self.head + FIFO_DEPTH as u64);", "let to = want;"),
    ("receiver ignores the mailbox", "rx.rs", "self.cts.sender_waiting(mb - 1);", ""),
    ("a quiet test() skips the writes the ring look made due", "rx.rs", "Ok((taken, due))", "Ok((taken, false))"),
    ("a quiet test() skips the address of a late ring it made", "rx/drive.rs",
     "return self.late_ring(nic).map(|()| !self.ring_missing());", "return self.late_ring(nic).map(|()| false);"),
    ("irecv skips iWARP's notice gate", "rx/drive.rs",
     "if !nic.may_advertise(first, nlanes, self.in_flight() + 1) {", "if false {"),
    ("control-write completions not counted back", "rx/drive.rs",
     "(WrId::Ctl { count, .. }, _) => self.on_ctl_done(count),", "(WrId::Ctl { .. }, _) => {}"),
    ("flush completions ignored", "rx/drive.rs", "(WrId::Flush(id), _) => self.on_flush_done(id),", "(WrId::Flush(_), _) => {}"),
    ("a full slot's previous lap not forced out", "rx/drive.rs", "                self.force_cts();\n", ""),
    ("control writes due after a ring poll not written", "rx/drive.rs",
     "        // mailbox that said the sender waits makes its CTS due now too\n        if let Err(e) = self.flush_ctl(nic) {",
     "        if let Err(e) = R::<(), N>::Ok(()) {"),
    ("a mismatched send does not tell the receiver", "tx/drive.rs",
     "let _ = self.post_group(nic, &group, Some(code));", ""),
    ("a done send's profiler events left open", "tx/drive.rs",
     "            nic.ev_stop_req(id);\n            return Ok(Some(self.release(id).unwrap_or(0)));",
     "            return Ok(Some(self.release(id).unwrap_or(0)));"),
    ("eager credits read after the FIFO head", "tx/drive.rs",
     "let freed = self.read_credits(nic.fifo());\n        if self.head_ready(nic)? {",
     "let ready = self.head_ready(nic)?;\n        let freed = self.read_credits(nic.fifo());\n        if ready {"),
    ("the eager fence at close not posted", "tx/drive.rs",
     "        if let Some(count) = self.close_eager() {", "        if let Some(count) = None::<u64> {"),
    # recovery after a link fault: what the restart points say, and what is resent
    ("resume resends lanes the receiver already has", "tx/drive.rs",
     "let got = peer.got(seq).unwrap_or(all) & all;", "let got = peer.got(seq).map_or(all, |_| 0) & all;"),
    ("resume takes a receive no longer waiting for unfinished", "tx/drive.rs",
     "let got = peer.got(seq).unwrap_or(all) & all;", "let got = peer.got(seq).unwrap_or(0) & all;"),
    ("the receiver reports lanes it never got", "rx.rs",
     "p.inflight[p.n] = InflightRecv { seq: *seq, got };", "p.inflight[p.n] = InflightRecv { seq: *seq, got: got | 1 };"),
    ("a lane's word is not recorded", "rx.rs", "        r.got |= bit;\n", ""),
    ("CTS not written again from the sender's head", "rx/drive.rs", "        self.cts.rewind(peer.fifo_head);\n", ""),
    ("CTS written again only from where the receiver stopped", "eager.rs",
     "self.written = self.written.min(head.max(self.written.saturating_sub(FIFO_DEPTH as u64)));", ""),
    ("eager messages not resent", "tx/drive.rs",
     "            for (i, idx) in (peer.eager_next..posted).enumerate() {",
     "            for (i, idx) in (posted..posted).enumerate() {"),
    ("eager resend starts one past the receiver's next", "tx/drive.rs",
     "            for (i, idx) in (peer.eager_next..posted).enumerate() {",
     "            for (i, idx) in (peer.eager_next + 1..posted).enumerate() {"),
    ("the credit word not written again", "rx/drive.rs", "            self.credit = Some(e.st.freed());\n", ""),
    ("flush reads in flight not posted again", "rx/drive.rs", "            flush(nic, id).map_err(Fail::Nic)?;\n", ""),
    ("the control writes' send queue not emptied", "rx/drive.rs", "        self.budget.reset();\n", ""),
    ("the eager send-queue count kept", "tx/drive.rs", "            e.pending = 0;\n", ""),
    # (a fifth field: seeds for that one; a receiver two laps ahead needs a
    # caller with twice NCCL's receives open, a third of the runs, and a
    # fault at that moment: 1000 seeds do not reach it)
    ("CTS elements kept for one lap only", "rx.rs", "pub const CTS_KEEP: usize = 2 * FIFO_DEPTH;", "pub const CTS_KEEP: usize = FIFO_DEPTH;", 6000),
    ("a late ring's address never written", "rx.rs",
     "            self.push(out, RING_ANN_OFF, RING_ANN_BYTES);\n", ""),
    ("a late ring never made", "rx/drive.rs",
     "        let (addr, rkey) = nic.make_ring(self.eager_limit()).map_err(Fail::Nic)?;\n        self.ring_made(nic.stage(), addr, rkey);\n",
     "        let _ = nic.ring_requested();\n"),
]

# Mutations the model cannot catch because they change nothing it can see,
# with the reason; the table says "equivalent" and does not count them as
# survivors. Each reason is held by a const assert or stated limit in the code.
EQUIVALENT = {
    "a full slot's previous lap not forced out":
        "CTS_BATCH (24) < FIFO_DEPTH (32): the batch rule already makes that CTS due (const assert in eager.rs)",
    "irecv skips iWARP's notice gate":
        "notices in flight <= FIFO slots in flight <= RECV_DEPTH receives, reposted as each is read (const assert in notice.rs); the gate guards a late-reposting executor",
}
# Mutations known to survive, and why (still counted as not caught).
KNOWN_SURVIVORS = {
    "eager credits read after the FIFO head":
        "a read-order race inside one isend: the model lands the receiver's writes between calls, never between two reads of one call",
}


def run_model(seeds=None):
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(WORK, "target"))
    if seeds:
        env["VERBS_MODEL_SEEDS"] = str(seeds)
    p = subprocess.run(
        ["cargo", "test", "--release", "-q", "-p", "rustnet-proto", "--test", "verbs_model"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    if "error[" in out or "error:" in out and "test result" not in out:
        return None, next((l for l in out.splitlines() if l.startswith("error")), "build failed")
    why = next((l.strip() for l in out.splitlines() if "model run failed" in l or "panicked" in l or "the transport calls" in l), "")
    m = re.search(r"model run failed \(rerun with VERBS_MODEL_SEED=\d+, fault [^)]*\): (.*)", out)
    return p.returncode != 0, (m.group(1) if m else why)[:110]


def copy_checkout():
    """The checkout as it is now (edits included), without build outputs."""
    shutil.rmtree(ROOT, ignore_errors=True)
    skip = shutil.ignore_patterns("target", "out", ".git", "fuzz", "__pycache__")
    shutil.copytree(CHECKOUT, ROOT, ignore=skip, symlinks=True)


def main():
    want = sys.argv[1:]
    copy_checkout()
    rows, survived = [], 0
    for name, rel, old, new, *seeds in MUTANTS:
        if want and not any(w in name for w in want):
            continue
        path = os.path.join(SRC, rel)
        text = open(path).read()
        if text.count(old) != 1:
            rows.append((name, "STALE", f"the text to mutate is not in {rel} exactly once: update this table"))
            survived += 1
            continue
        open(path, "w").write(text.replace(old, new))
        try:
            caught, why = run_model(seeds[0] if seeds else None)
        finally:
            open(path, "w").write(text)
        if caught is None:
            rows.append((name, "NO BUILD", why))
            survived += 1
        else:
            if not caught and name in EQUIVALENT:
                rows.append((name, "equivalent", EQUIVALENT[name]))
            else:
                rows.append((name, "caught" if caught else "SURVIVED", why if caught else KNOWN_SURVIVORS.get(name, why)))
                survived += not caught
        print(f"{rows[-1][1]:>8}  {name}: {rows[-1][2]}", flush=True)
    print("\n| mutation | result | how |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2].replace('|', '/')} |")
    eq = sum(r[1] == "equivalent" for r in rows)
    print(f"\n{len(rows) - survived - eq} of {len(rows)} caught, {eq} equivalent (reasons above), {survived} not caught")
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
