"""Where a short read's time goes on CUDA: per-kernel device times of one forward of n new tokens (n = 1: the decode
step) through the engine's PlanModel, captured graphs replayed as the engine replays them.

For each model, depth and n: the best of --reps host times of the forward (restore, forward, logits on the host, as
bench/short_read.py times it), then one profiled forward per rep under torch.profiler (CUPTI kernel records, the
graph's own kernels with PDL on), keeping the rep with the shortest device span: the span from the first kernel's
start to the last one's end, the sum of kernel durations (busy) and the kernels grouped by name (count, total us).
The host time minus the span is what the forward spends outside the device's kernels (Python, copies, sync).
Without torch's profiler (no torch, or no kernel records) the launches run eagerly, each between two CUDA events
on a stream held busy beforehand (so the launches queue and run back to back): the kernel times without the graph's
overlap.

With --host, the host side of n = 1 and 2 at the first depth is profiled too (cProfile, the top functions by own
time): where a forward spends its time outside the device.
Usage: PYTHONPATH=. python bench/short_read_profile.py [--models default,syn_hybrid_1_5b] [--ns 1,2,4,8,16]
       [--depths 0] [--reps 3] [--dir DIR] [--host] [--out PATH]
Writes bench/results/short_read_profile_<device>_<commit>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cupti_trace import short_name, trace_events  # noqa: E402


def torch_kernels(run) -> list[tuple[str, float, float]] | None:
    """[(name, start us, duration us)] of the kernels run() launched, from torch.profiler's CUPTI records; None
    without torch or without kernel records."""
    ev = trace_events(run)
    if ev is None:
        return None
    ks = [(e["name"], float(e["ts"]), float(e.get("dur", 0))) for e in ev
          if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return ks or None


def event_kernels(plan, run) -> list[tuple[str, float, float]]:
    """The fallback: plan's launches run eagerly (graphs off), each between two CUDA events on its stream, after a
    spin kernel that keeps the device busy until they are all queued."""
    import cupy as cp
    from strata.backend.cuda import library as KL
    f = KL.ffi()
    recs: list = []
    real = KL.lib()

    class Proxy:
        def __getattr__(self, name):
            fn = getattr(real, name)
            if not name.startswith("strata_") or not callable(fn):
                return fn

            def wrapped(*args):
                if args and isinstance(args[0], f.CData) and f.typeof(args[0]).cname == "void *":
                    s = int(f.cast("uintptr_t", args[0]))
                    a, b = cp.cuda.Event(), cp.cuda.Event()
                    cp.cuda.runtime.eventRecord(a.ptr, s)
                    rc = fn(*args)
                    cp.cuda.runtime.eventRecord(b.ptr, s)
                    recs.append((name, a, b))
                    return rc
                return fn(*args)
            return wrapped
    proxy = Proxy()
    mods = [m for n, m in sys.modules.items() if n.startswith("strata.backend.cuda") and hasattr(m, "lib")]
    saved = {m: m.lib for m in mods}
    spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long ns) {
        long long t0 = clock64(); while (clock64() - t0 < ns) {} }''', "spin")
    use0 = plan.use_graphs
    try:
        for m in mods:
            m.lib = lambda: proxy
        plan.use_graphs = False
        with plan.stream:
            spin((1,), (1,), (np.int64(200_000_000),))
        run()
        cp.cuda.Device().synchronize()
    finally:
        plan.use_graphs = use0
        for m, v in saved.items():
            m.lib = v
    out, t = [], 0.0
    for name, a, b in recs:
        d = cp.cuda.get_elapsed_time(a, b) * 1e3
        out.append((name, t, d))
        t += d
    return out


def summary(ks: list[tuple[str, float, float]]) -> dict:
    t0 = min(s for _, s, _ in ks)
    t1 = max(s + d for _, s, d in ks)
    by: dict[str, list] = {}
    for name, _, d in ks:
        e = by.setdefault(short_name(name), [0, 0.0])
        e[0] += 1
        e[1] += d
    order = sorted(by.items(), key=lambda kv: -kv[1][1])
    return {"span_us": t1 - t0, "busy_us": sum(d for _, _, d in ks), "launches": len(ks),
            "kernels": {k: {"count": c, "us": round(u, 2)} for k, (c, u) in order}}


def host_profile(run, restore, count: int = 40, top: int = 14) -> list[str]:
    """cProfile of `count` runs (each after restore()): the `top` functions by own time, as text lines."""
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    for _ in range(count):
        restore()
        pr.enable()
        run()
        pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()][-top - 1:]


def profile_model(path: str, ns, depths, reps: int, host: bool = False) -> dict:
    import cupy as cp
    from strata.backend.cuda import CudaBackend
    from strata.models.registry import load_model
    model = load_model(path, CudaBackend())
    fast = model.backend.fast_path(model)
    sync = cp.cuda.Device().synchronize
    rng = np.random.default_rng(0)
    vocab = model.config.n_vocab
    pool = fast.new_page_pool(max(depths) + max(ns) + 512)
    st = model.new_state(pool)
    plan = fast.plan(pool)
    res: dict = {"runner": type(fast).__name__, "rows": {}}
    fast.forward(rng.integers(0, vocab, 600).astype(np.int32)[:512], st)
    for d in depths:
        st.reset()
        for s0 in range(0, d, 512):
            fast.forward(rng.integers(0, vocab, min(512, d - s0)).astype(np.int32), st)
        snap = st.capture()
        row = res["rows"][str(d)] = {}
        for n in ns:
            toks = rng.integers(0, vocab, n).astype(np.int32)

            def run():
                fast.forward(toks, st)
            best = float("inf")
            for _ in range(reps + 1):
                st.restore(snap)
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                best = min(best, time.perf_counter() - t0)
            e = row[str(n)] = {"host_ms": 1e3 * best}
            prof = None
            for _ in range(reps):
                st.restore(snap)
                sync()
                ks = torch_kernels(run)
                if ks is None:
                    st.restore(snap)
                    sync()
                    ks = event_kernels(plan, run)
                    e["method"] = "eager launches between CUDA events"
                else:
                    e["method"] = "torch.profiler (CUPTI), graph replay"
                s = summary(ks)
                if prof is None or s["span_us"] < prof["span_us"]:
                    prof = s
            e.update(prof)
            if host and d == depths[0] and n <= 2:
                e["host_profile"] = host_profile(run, lambda: (st.restore(snap), sync()))
                print("\n".join(e["host_profile"]), flush=True)
            top = ", ".join(f"{k} {v['us']:.0f}us/{v['count']}" for k, v in list(prof["kernels"].items())[:8])
            print(f"  d{d} n{n}: host {e['host_ms']:.3f} ms, span {prof['span_us']:.0f} us, busy "
                  f"{prof['busy_us']:.0f} us, {prof['launches']} launches: {top}", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,syn_hybrid_1_5b")
    ap.add_argument("--dir", default="/tmp/greedy_models")
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--depths", default="0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host", action="store_true", help="cProfile the host side of n = 1 and 2 (the first depth)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import cupy as cp
    from bench.common import commit as bench_commit
    from strata.gguf.default_model import default_model_path
    from tools.greedy_tokens import model_path
    ns = [int(x) for x in a.ns.split(",") if x]
    depths = [int(x) for x in a.depths.split(",") if x]
    os.makedirs(a.dir, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    dev = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    out = {"commit": bench_commit(), "device": dev, "ns": ns, "depths": depths, "models": {}}
    for m in (x for x in a.models.split(",") if x):
        path = str(default_model_path()) if m == "default" else model_path(m, Path(a.dir))
        print(f"model {m} ({path})", flush=True)
        out["models"][m] = profile_model(path, ns, depths, a.reps, a.host)
        cp.get_default_memory_pool().free_all_blocks()
    dest = Path(a.out) if a.out else \
        ROOT / "bench" / "results" / f"short_read_profile_{dev.replace(' ', '_')}_{out['commit']}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print("wrote", dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
