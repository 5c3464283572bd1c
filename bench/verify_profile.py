"""Where a speculative verify's time goes on a GPU: a decode step against a verify of n + 1 tokens (the short read
with every row's state kept), per kernel, on the hybrid's CUDA plan.

For each read (a decode step, a verify of n + 1 tokens for each n of --ns, and the same n + 1 tokens read without
kept states) it measures, each the best of --reps:
- ``wall_us``: the read as the engine calls it (Sequence.forward / Sequence.verify), host-timed with a device sync;
- ``graph_us``: the plan's captured graph alone (CUDA events on the plan's stream around its replay);
- ``kernels``: every launcher of the kernel library run eagerly (graphs off) with CUDA events around each launch,
  summed by launcher (count, microseconds); the stream is held by a spin kernel while the launches are enqueued,
  so each pair of events brackets its kernel's execution only, not the host's launch latency.
Also ``feed_us``: the MTP drafter fed k held rows at once (the catch-up a draft starts with after k plain steps or
k accepted tokens). ``wall_us - graph_us`` is the host's share (argument checks, the page-table and input uploads, the logits' copy to
the host); ``graph_us`` minus the kernels' sum is what the graph spends between kernels. The report ranks the
launchers by what a verify adds over a decode step.

Model: bench/spec_decode.py's (the ~1.5B hybrid of bench/gpu_hybrid_model.py with an MTP block, Q8_0), written
into --dir. Usage: PYTHONPATH=. python bench/verify_profile.py [--size 1.5b] [--ns 1,2,3,4] [--prompt 64]
[--reps 20] [--out PATH]. Writes bench/results/verify_profile_<gpu>_<commit>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import commit as bench_commit  # noqa: E402
from bench.spec_decode import device_name, write_model   # noqa: E402
from strata.engine.engine import Engine                              # noqa: E402

#: launcher names that are queries, not launches
NOT_LAUNCHES = ("_supported", "_bytes", "_version")

SPIN_SRC = r'''
__device__ static unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
extern "C" __global__ void strata_bench_spin(unsigned long long ns) {
  const unsigned long long t0 = now_ns();
  while (now_ns() - t0 < ns) { }
}
'''


class TimedLib:
    """The kernel library with CUDA events recorded on the current stream around every launcher call."""

    def __init__(self, real, cp):
        self._real, self._cp = real, cp
        self.on = False
        self.rec: list[tuple[str, object, object]] = []

    def __getattr__(self, name):
        f = getattr(self._real, name)
        if not name.startswith("strata_") or any(name.endswith(k) for k in NOT_LAUNCHES) or not callable(f):
            return f
        cp = self._cp

        def timed(*args):
            if not self.on:
                return f(*args)
            s = cp.cuda.get_current_stream()
            e0 = cp.cuda.Event()
            e0.record(s)
            r = f(*args)
            e1 = cp.cuda.Event()
            e1.record(s)
            self.rec.append((name, e0, e1))
            return r
        return timed

    def take(self) -> dict[str, list]:
        """{launcher: [count, microseconds]} of the calls recorded since the last take (after a device sync)."""
        out: dict[str, list] = {}
        for name, e0, e1 in self.rec:
            us = self._cp.cuda.get_elapsed_time(e0, e1) * 1e3
            c = out.setdefault(name, [0, 0.0])
            c[0] += 1
            c[1] += us
        self.rec = []
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1.5b")
    ap.add_argument("--ns", default="1,2,3,4")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dir", default="/tmp/spec_models")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    path = write_model(d, "cuda:0", args.size)
    e = Engine(path, spec=max(ns), n_ctx=args.prompt + 64, device="cuda:0", conversation_cache_mib=0,
               prompt_cache=0)
    import cupy as cp
    from strata.backend.cuda import library

    seq, stage = e.seq, e.stages[-1]
    prompt = np.random.default_rng(3).integers(0, 1000, args.prompt).astype(np.int32)
    seq.reset()
    _, hs = seq.forward(prompt, hidden=True)
    ck = seq.capture()
    state = stage.memory.seq(seq.sids[-1])
    pm = stage.runner if hasattr(stage.runner, "plan") else stage.runner.model
    plan = pm.plan(state.kv.pool)
    dev = cp.cuda.Device(0)
    rng = np.random.default_rng(0)

    # graph time: events on the launches' stream around each replay (or eager enqueue)
    gtimes: list[tuple[object, object]] = []
    spin_k = cp.RawKernel(SPIN_SRC, "strata_bench_spin")
    spin = {"on": False}

    def wrap(fn):
        def launch(*a, **k):
            s = cp.cuda.get_current_stream()          # the stream the launches go to (the plan's)
            if spin["on"]:            # hold the stream while the eager launches are enqueued
                spin_k((1,), (1,), (np.uint64(200_000_000),), stream=s)   # 0.2 s
            e0 = cp.cuda.Event()
            e0.record(s)
            r = fn(*a, **k)
            e1 = cp.cuda.Event()
            e1.record(s)
            gtimes.append((e0, e1))
            return r
        return launch
    plan._launch = wrap(plan._launch)
    plan._launch_short = wrap(plan._launch_short)

    def decode():
        seq.forward(np.asarray([5], np.int32))

    def reads(n):
        toks = rng.integers(0, 1000, n + 1).astype(np.int32)
        return (lambda: seq.verify(toks)), (lambda: seq.forward(toks, all_logits=True))

    def measure(fn):
        """(best wall µs, best graph µs) over reps, each from the checkpoint."""
        walls, graphs = [], []
        for _ in range(args.reps):
            seq.restore(ck)
            dev.synchronize()
            gtimes.clear()
            t0 = time.perf_counter()
            fn()
            dev.synchronize()
            walls.append((time.perf_counter() - t0) * 1e6)
            graphs.append(sum(cp.cuda.get_elapsed_time(a, b) for a, b in gtimes) * 1e3)
        return min(walls), min(graphs)

    timed = TimedLib(library.lib(), cp)

    def kernels(fn):
        """{launcher: [count, µs]} of one eager run (the best of 3 by total), and the eager span on the stream."""
        best = None
        plan.use_graphs = False
        library._lib = timed
        try:
            for _ in range(3):
                seq.restore(ck)
                dev.synchronize()
                gtimes.clear()
                spin["on"] = timed.on = True
                try:
                    fn()
                finally:
                    spin["on"] = timed.on = False
                dev.synchronize()
                k = timed.take()
                tot = sum(v[1] for v in k.values())
                if best is None or tot < best[0]:
                    best = (tot, k)
        finally:
            library._lib = timed._real
            plan.use_graphs = True
        return best[1]

    reads_by = {"decode": decode}
    for n in ns:
        v, a = reads(n)
        reads_by[f"verify{n + 1}"] = v
        reads_by[f"all_logits{n + 1}"] = a
    for fn in reads_by.values():                      # capture every graph once before timing
        seq.restore(ck)
        fn()
    res = {"device": device_name(e, "cuda:0"), "model": path.name, "commit": bench_commit(), "prompt": args.prompt,
           "reps": args.reps, "reads": {}}
    for name, fn in reads_by.items():
        wall, graph = measure(fn)
        k = kernels(fn)
        res["reads"][name] = {"wall_us": wall, "graph_us": graph, "host_us": wall - graph,
                              "kernels_us": sum(v[1] for v in k.values()),
                              "launches": sum(v[0] for v in k.values()), "kernels": k}
        print(f"{name}: wall {wall:.0f} us, graph {graph:.0f} us, kernels {res['reads'][name]['kernels_us']:.0f} us "
              f"in {res['reads'][name]['launches']} launches", flush=True)
    gpu = re.search(r"\b([A-Z]\d{2,3})\b", res["device"])
    tag = gpu.group(1).lower() if gpu else "cuda"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"verify_profile_{tag}_{res['commit']}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")       # the reads kept even if what follows fails
    # the drafter fed k held rows at once (what a draft after k plain steps or k accepted tokens first does)
    dr, P = e.drafter, int(ck.pos)
    res["feed_us"] = {}
    for k in (1, 4, 16, 64):
        if k > P - 1:
            continue
        best_us = None
        for _ in range(args.reps):
            seq.restore(ck)                   # the MTP K/V empty (the checkpoint was taken before any feed)
            dr.observe(0, hs[:P - 1 - k])
            dr._feed(P - 1 - k, None)         # untimed: the MTP K/V up to the k rows timed
            dev.synchronize()
            t0 = time.perf_counter()
            dr.observe(P - 1 - k, hs[P - 1 - k:P - 1])
            dr.flush()
            dev.synchronize()
            us = (time.perf_counter() - t0) * 1e6
            best_us = us if best_us is None else min(best_us, us)
        res["feed_us"][k] = best_us
    print("drafter fed k rows (us): " + ", ".join(f"{k}: {v:.0f}" for k, v in res["feed_us"].items()), flush=True)
    dec = res["reads"]["decode"]
    for n in ns:
        r = res["reads"][f"verify{n + 1}"]
        r["over_decode"] = {"wall": r["wall_us"] / dec["wall_us"], "graph": r["graph_us"] / dec["graph_us"],
                            "kernels": r["kernels_us"] / dec["kernels_us"]}
        add = {name: r["kernels"][name][1] - dec["kernels"].get(name, [0, 0.0])[1] for name in r["kernels"]}
        r["added_us"] = dict(sorted(add.items(), key=lambda kv: -kv[1]))
        top = ", ".join(f"{k} +{v:.0f}" for k, v in list(r["added_us"].items())[:6])
        print(f"verify of {n + 1}: {r['over_decode']['wall']:.2f}x a decode step (graph {r['over_decode']['graph']:.2f}x,"
              f" kernels {r['over_decode']['kernels']:.2f}x, host {r['host_us']:.0f} us vs {dec['host_us']:.0f}); "
              f"added: {top}", flush=True)
    ck.release()
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
