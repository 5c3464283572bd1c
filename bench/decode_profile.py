"""Where a decode token's time goes on CUDA: per-kernel GPU time from Nsight Compute against the graph step time.

The decode plan (CudaBackend.fast_path's plan: LlamaCuda, or the hybrid plan) is run eagerly for a few tokens
inside a cudaProfilerStart/Stop window under ``ncu --metrics gpu__time_duration.sum`` (no cache flush, so kernels
see the warm L2 of a real run; clocks locked to base), and the same plan's CUDA-graph decode step is timed in a
separate run without the profiler. Per step it reports the sum of the kernels' durations, the graph step time and
their difference, and the kernels grouped by name with their calls, time and share of the kernel time. On the H200
the difference came out negative: at base clock, and with ncu's ~2 µs floor per kernel, small kernels last longer
than in a real run, so read the shares (which kernels dominate), not the difference, as the result.

With --prefill N the step is one forward of N new tokens at each depth (the engine's prefill path; any model).
Usage: python bench/decode_profile.py --model PATH [--depths 0,4096,16384] [--tokens 2] [--prefill N] [--out JSON]
(needs `ncu` on PATH or in /usr/local/cuda/bin; the script runs itself under ncu with --child).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _plan(path: str, max_ctx: int, need_plan: bool = True):
    from strata.backend.cuda import CudaBackend
    from strata.models.registry import load_model
    model = load_model(path, CudaBackend())
    fast = model.backend.fast_path(model)
    if need_plan and not hasattr(fast, "plan"):
        raise SystemExit(f"{path}: no CUDA decode plan for this model (fast_path returned the model itself)")
    pool = model.new_page_pool(max_ctx)
    st = model.new_state(pool)
    return model, fast, (fast.plan(pool) if hasattr(fast, "plan") else None), st


def child(a) -> int:
    """Per depth: prefill, then either time the graph step (--time-only, run without ncu: ncu intercepts every
    launch and slows graph replays ~20x) or run `tokens` eager steps inside the profiler window (under ncu)."""
    import cupy as cp
    depths = [int(x) for x in a.depths.split(",") if x]
    model, fast, plan, st = _plan(a.model, max(depths) + 64 * a.tokens + 512 + a.prefill, need_plan=not a.prefill)
    rng = np.random.default_rng(0)
    vocab = model.config.n_vocab
    out = {}
    for d in depths:
        st.reset()
        toks = rng.integers(0, vocab, d)
        for s in range(0, d, 512):
            fast.forward(np.asarray(toks[s:s + 512], np.int32), st)
        snap = st.capture()
        if a.prefill:                      # one forward of `prefill` new tokens at depth d (the engine's path)
            new = np.asarray(rng.integers(0, vocab, a.prefill), np.int32)
            best = float("inf")
            for _ in range(3 if a.time_only else 1):                  # warm-up / best of 3
                st.restore(snap)
                cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                fast.forward(new, st)
                cp.cuda.Device().synchronize()
                best = min(best, (time.perf_counter() - t0) * 1e6)
            if a.time_only:
                out[d] = best
                continue
            st.restore(snap)
            cp.cuda.Device().synchronize()
            cp.cuda.profiler.start()
            fast.forward(new, st)
            cp.cuda.Device().synchronize()
            cp.cuda.profiler.stop()
            continue
        if a.time_only:                    # no profiler attached: the graph step as a real run sees it
            plan.use_graphs = True
            plan.decode_greedy(1, 4, st)                              # capture the graph of this size class
            st.restore(snap)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            plan.decode_greedy(1, 64, st)
            cp.cuda.Device().synchronize()
            out[d] = (time.perf_counter() - t0) / 64 * 1e6
            continue
        plan.use_graphs = False
        plan.decode_greedy(1, 1, st)                                  # eager warm-up outside the window
        st.restore(snap)
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.start()
        plan.decode_greedy(1, a.tokens, st)
        cp.cuda.Device().synchronize()
        cp.cuda.profiler.stop()
    print("STEP_US " + json.dumps(out), flush=True)
    return 0


def _short(name: str) -> str:
    name = re.sub(r"\(.*$", "", name)                 # drop the argument list
    name = re.sub(r"^(void )?", "", name)
    return name.strip()


def parent(a) -> int:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu):
        print("ncu not found", file=sys.stderr)
        return 2
    depths = [int(x) for x in a.depths.split(",") if x]
    res = {"model": os.path.basename(a.model), "tokens": a.tokens, "prefill": a.prefill, "depths": {}}
    me = [sys.executable, __file__, "--child", "--model", a.model, "--tokens", str(a.tokens), "--prefill",
          str(a.prefill)]
    per = 1 if a.prefill else a.tokens              # steps profiled per depth
    p = subprocess.run(me + ["--time-only", "--depths", a.depths], capture_output=True, text=True,
                       timeout=a.timeout)
    m = re.search(r"^STEP_US (.*)$", p.stdout, re.M)
    if p.returncode or not m:
        print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
        return 1
    steps = json.loads(m.group(1))
    for d in depths:                                  # one ncu process per depth: kernel lists stay separate
        cmd = [ncu, "--csv", "--metrics", "gpu__time_duration.sum", "--profile-from-start", "off",
               "--cache-control", "none", "--clock-control", "base", "--target-processes", "all",
               *me, "--depths", str(d)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        text = p.stdout
        if p.returncode or "STEP_US" not in text:
            print(text[-3000:], p.stderr[-3000:], file=sys.stderr)
            return 1
        step_us = float(steps[str(d)])
        rows = [ln for ln in text.splitlines() if ln.startswith('"')]
        kernels: dict[str, dict] = {}
        for r in csv.DictReader(io.StringIO("\n".join(rows))):
            if r.get("Metric Name") != "gpu__time_duration.sum":
                continue
            v = float(r["Metric Value"].replace(",", ""))
            unit = r.get("Metric Unit", "ns")
            us = v / 1e3 if unit in ("ns", "nsecond") else v * 1e3 if unit in ("ms", "msecond") else v
            k = kernels.setdefault(_short(r["Kernel Name"]), {"calls": 0, "us": 0.0})
            k["calls"] += 1
            k["us"] += us
        for k in kernels.values():
            k["calls"] /= per
            k["us"] /= per
        total = sum(k["us"] for k in kernels.values())
        launches = sum(k["calls"] for k in kernels.values())
        res["depths"][d] = {"graph_step_us": step_us, "kernel_us": total, "launches": launches,
                            "gap_us": step_us - total, "kernels": kernels}
        what = f"prefill of {a.prefill} tokens" if a.prefill else "graph step"
        print(f"\ndepth {d}: {what} {step_us:.1f} us; kernels {total:.1f} us in {launches:.0f} launches; "
              f"the rest (gaps, ramp, tails) {step_us - total:.1f} us ({100 * (step_us - total) / step_us:.0f}%)")
        for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["us"]):
            print(f"  {name[:60]:60s} {k['calls']:6.0f} x  {k['us']:8.1f} us  {100 * k['us'] / total:5.1f}%")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        print("wrote", a.out)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="GGUF path (a model the CUDA decode plan supports)")
    ap.add_argument("--depths", default="0,4096,16384")
    ap.add_argument("--tokens", type=int, default=2, help="decode tokens profiled per depth")
    ap.add_argument("--prefill", type=int, default=0,
                    help="profile one forward of this many new tokens (prefill, the engine's path) instead of decode")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per ncu run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--time-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    return child(a) if a.child else parent(a)


if __name__ == "__main__":
    sys.exit(main())
