#!/usr/bin/env python3
"""/health latency while large requests arrive: is the daemon's event loop free while it prepares them?

For each arm (a source tree: by default this one, "after", and a temporary worktree of --before REF, "before", which
borrows this tree's built C core), `strata serve` on the default model (or --model) is started on TCP; a prober
thread sends GET /health every --every ms over one keep-alive connection and times each answer, while a sender
thread posts the large requests one after the other (--reps of each kind, each waiting for its answer):

  responses       /v1/responses, --items input items (user and assistant messages, ~8.6 MB at 60,000)
  chat            /v1/chat/completions, --items / 3 messages (~1.6 MB at 60,000)
  detokenize      /detokenize of --ids token ids (a JSON array of integers, ~1 MB at 200,000)

A request too long for the context is still parsed, validated and rendered before its 400: the loop's work is the
same. The idle probes (nothing else sent) are the floor. Per arm and kind: /health p50 / p99 / max (ms) while that
kind's requests were in flight, the requests' own mean time, and the ratio of each to the first arm's from the same
run. The arms alternate over --rounds rounds (a fresh daemon each time) so that a machine's load swings touch both.

Usage: PYTHONPATH=. python bench/loop_latency.py [--before main] [--arm NAME=TREE ...] [--rounds 2] [--reps 3]
       [--items 60000] [--ids 200000] [--every 5] [--model PATH] [--out PATH]
Writes bench/results/loop_latency_<commit>.json (or --out).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench.common import commit as bench_commit, tree_env  # noqa: E402

from daemons import free_port, stop, wait_healthy  # noqa: E402


def bodies(items: int, ids: int) -> dict[str, tuple[str, bytes]]:
    """kind -> (path, the body's bytes)."""
    inp = [{"type": "message", "role": "user" if i % 2 == 0 else "assistant",
            "content": [{"type": "input_text" if i % 2 == 0 else "output_text",
                         "text": f"item {i}: a short line about rivers and their deltas"}]} for i in range(items)]
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}: rivers carry silt to the sea"}
            for i in range(items // 3)]
    return {"responses": ("/v1/responses", json.dumps({"model": "m", "input": inp,
                                                           "max_output_tokens": 1}).encode()),
            "chat": ("/v1/chat/completions", json.dumps({"model": "m", "messages": msgs,
                                                             "max_tokens": 1}).encode()),
            "detokenize": ("/detokenize", json.dumps({"tokens": [i % 1000 for i in range(ids)]}).encode())}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else float("nan")


class Prober(threading.Thread):
    """GET /health every `every` seconds on one connection: (start time, latency s, status) per probe."""

    def __init__(self, port: int, every: float):
        super().__init__(daemon=True)
        self.port, self.every = port, every
        self.samples: list[tuple[float, float, int]] = []
        self.halt = threading.Event()

    def run(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.halt.is_set():
            t0 = time.perf_counter()
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            t1 = time.perf_counter()
            self.samples.append((t0, t1 - t0, r.status))
            time.sleep(max(0.0, self.every - (t1 - t0)))
        c.close()

    def window(self, a: float, b: float) -> list[float]:
        """Latencies (ms) of the probes sent in [a, b)."""
        return [lat * 1e3 for t0, lat, _ in self.samples if a <= t0 < b]


def run_arm(tree: Path, model: str | None, kinds: dict, reps: int, every: float, n_ctx: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "strata.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--n-ctx", str(n_ctx), "--log-level", "warning", "--max-body", str(16 << 20)]
    if model:
        cmd += ["--model", model]
    env = tree_env(tree, STRATA_DEVICE="cpu")
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", cmd, "strata serve", poll=0.2)
        prober = Prober(port, every)
        prober.start()
        time.sleep(1.0)
        out: dict = {}
        t_idle = time.perf_counter()
        time.sleep(2.0)
        out["idle"] = summary(prober.window(t_idle, time.perf_counter()))
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        for kind, (path, body) in kinds.items():
            c.request("POST", path, body=body, headers={"Content-Type": "application/json"})  # warm-up
            c.getresponse().read()
            t_a = time.perf_counter()
            times, statuses = [], set()
            for _ in range(reps):
                t0 = time.perf_counter()
                c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                r.read()
                times.append(time.perf_counter() - t0)
                statuses.add(r.status)
            t_b = time.perf_counter()
            time.sleep(0.05)
            out[kind] = dict(summary(prober.window(t_a, t_b)), request_ms=round(1e3 * sum(times) / len(times), 1),
                             statuses=sorted(statuses), body_bytes=len(body))
        c.close()
        prober.halt.set()
        prober.join(10)
        return out
    finally:
        stop(proc)


def summary(lat_ms: list[float]) -> dict:
    return {"probes": len(lat_ms), "p50_ms": round(pct(lat_ms, 50), 2), "p99_ms": round(pct(lat_ms, 99), 2),
            "max_ms": round(max(lat_ms), 2) if lat_ms else None}


def worktree_of(ref: str) -> Path:
    """A detached worktree of `ref` in a temporary folder, with this tree's built C core linked in."""
    where = Path(tempfile.mkdtemp(prefix="strata-before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(where), ref], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for so in (ROOT / "strata").glob("_native*.so"):
        (where / "strata" / so.name).symlink_to(so)
    return where


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="main", help="git ref of the 'before' arm (a temporary worktree); '' for none")
    ap.add_argument("--arm", action="append", default=[], help="NAME=TREE: more arms (source trees)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--items", type=int, default=60000)
    ap.add_argument("--ids", type=int, default=200000)
    ap.add_argument("--every", type=float, default=5.0, help="ms between /health probes")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    made: list[Path] = []
    arms: list[tuple[str, Path]] = []
    if a.before:
        made.append(worktree_of(a.before))
        arms.append((f"before ({a.before})", made[-1]))
    arms.append(("after", ROOT))
    for spec in a.arm:
        name, _, tree = spec.partition("=")
        arms.append((name, Path(tree).resolve()))
    kinds = bodies(a.items, a.ids)
    try:
        runs: dict[str, list[dict]] = {name: [] for name, _ in arms}
        for rnd in range(a.rounds):
            order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            for name, tree in order:
                got = run_arm(tree, a.model, kinds, a.reps, a.every / 1e3, a.n_ctx)
                runs[name].append(got)
                print(json.dumps({"round": rnd, "arm": name, **got}), flush=True)
    finally:
        for m in made:
            subprocess.run(["git", "worktree", "remove", "--force", str(m)], cwd=ROOT, check=False)
            shutil.rmtree(m.parent, ignore_errors=True)
    ref = arms[0][0]
    table: dict = {}
    for name, _ in arms:
        table[name] = {}
        for kind in ["idle", *kinds]:
            per = [r[kind] for r in runs[name]]
            cell = {k: max(p[k] for p in per) if k == "max_ms" else round(sum(p[k] for p in per) / len(per), 2)
                    for k in ("p50_ms", "p99_ms", "max_ms")}
            cell["probes"] = sum(p["probes"] for p in per)
            if kind != "idle":
                cell["request_ms"] = round(sum(p["request_ms"] for p in per) / len(per), 1)
                cell["statuses"] = sorted({s for p in per for s in p["statuses"]})
                cell["body_bytes"] = per[0]["body_bytes"]
            table[name][kind] = cell
    for name in table:
        for kind, cell in table[name].items():
            base = table[ref][kind]
            cell["vs_" + ref.split()[0]] = {k: round(cell[k] / base[k], 3) if base.get(k) else None
                                           for k in ("p50_ms", "p99_ms", "max_ms", "request_ms") if k in cell}
    commit = bench_commit()
    result = {"bench": "loop_latency", "commit": commit, "rounds": a.rounds, "reps": a.reps, "items": a.items,
              "ids": a.ids, "every_ms": a.every, "n_ctx": a.n_ctx, "model": a.model or "default",
              "cpus": os.cpu_count(), "arms": [n for n, _ in arms], "table": table, "runs": runs,
              "note": "max_ms: the worst probe of all rounds; p50/p99: the mean over rounds"}
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"loop_latency_{commit}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(table, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
