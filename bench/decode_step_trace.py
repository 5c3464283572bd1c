"""Where a token of the persistent decode step (native/cuda/decode_step.cu, STRATA_CUDA_STEP) goes, from block 0's
%globaltimer trace, against the launch-per-op graph's tokens/s in the same run.

Per depth: the step's tokens/s and the graph's (timed_decode, the same context), then one traced step: per phase
A-E, block 0's mean work (from leaving one grid barrier to arriving at the next) and wait (at the barrier), the
head. With a kernel library built with -DST_TILE_TRACE (e.g. nvcc ... -DST_TILE_TRACE -c decode_step.cu), also
block 0's tiles (median wait for the slot's data, median dots, median gap between tiles, their sums per token)
and layer 1's points (after its norms, tiles and barriers). Usage: python bench/decode_step_trace.py --model PATH
[--depths 0,4096] [--n-gen 64] [--out JSON]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The ST_TILE_TRACE layout after the barrier trace (decode_step.cu): 3 entries per tile for up to TRACE_TILES tiles,
# then 3 clocks (clock64 at the start and end, %globaltimer at the end) and one unused entry, then the 10 points.
TRACE_TILES = 4096
CLOCKS = 3 * TRACE_TILES
MARKS_AT = CLOCKS + 4
TILE_ENTRIES = MARKS_AT + 10
MARKS = ["A start", "A norm done", "A tiles done", "B start", "C start", "C tiles done", "D start",
         "D norm done", "E start", "E tiles done"]


def traced_step(C, plan, st, n_layer: int) -> np.ndarray:
    """One decode step through the persistent step with the trace buffer set (st put back); the trace, ns from the
    step's start."""
    import cupy as cp
    base = 10 * n_layer + 3
    buf = cp.zeros(base + TILE_ENTRIES, cp.uint64)
    a = plan._step[0]
    a.trace = C._ffi.cast("unsigned long long *", buf.data.ptr)
    plan.graphs = {}
    p0 = st.pos
    try:
        plan.decode_greedy(1, 1, st)
        cp.cuda.Device().synchronize()
    finally:
        a.trace = C._ffi.NULL
        plan.graphs = {}
        st.truncate(p0)
    return cp.asnumpy(buf).astype(np.int64)


def summarize(t: np.ndarray, n_layer: int) -> dict:
    """Phase work / wait means (us) and, when the tiles were traced, tile statistics and layer 1's points."""
    base = 10 * n_layer + 3
    t0 = t[0]
    bar = t[1:base] - t0
    arrive, leave = bar[0::2], bar[1::2]                 # barrier k = 1 .. 5 n_layer + 1
    prev = np.concatenate([[0], leave[:-1]])
    work, wait = (arrive - prev) / 1e3, (leave - arrive) / 1e3
    out = {"total_us": float(leave[-1] / 1e3), "phases": {}}
    for j, name in enumerate("ABCDE"):
        out["phases"][name] = {"work_us": float(work[j:5 * n_layer:5].mean()),
                               "wait_us": float(wait[j:5 * n_layer:5].mean())}
    out["head"] = {"work_us": float(work[-1]), "wait_us": float(wait[-1])}
    tt = t[base:base + CLOCKS].reshape(-1, 3)
    n = int((tt[:, 0] > 0).sum())
    if n:
        tt = tt[:n] - t0
        w, d = (tt[:, 1] - tt[:, 0]) / 1e3, (tt[:, 2] - tt[:, 1]) / 1e3
        gap = (tt[1:, 0] - tt[:-1, 2]) / 1e3
        ck = t[base + CLOCKS: base + CLOCKS + 3]
        marks = (t[base + MARKS_AT: base + MARKS_AT + len(MARKS)] - t0) / 1e3
        out["tiles"] = {"n": n, "median_wait_us": float(np.median(w)), "median_dots_us": float(np.median(d)),
                        "median_gap_us": float(np.median(gap)), "sum_wait_us": float(w.sum()),
                        "sum_dots_us": float(d.sum()), "sum_gap_us": float(gap.sum()),
                        "sm_clock_ghz": float((ck[1] - ck[0]) / max(1, ck[2] - t0))}
        out["layer1_us"] = {m: float(v - marks[0]) for m, v in zip(MARKS, marks)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depths", default="0,4096")
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    depths = [int(x) for x in a.depths.split(",") if x]
    from bench.decode_variants import open_plan, timed_decode
    from strata.backend import cuda as C
    model, st, plan, fast = open_plan(a.model, max(depths) + a.n_gen + 512)
    if not plan.prepare_step():
        print(f"the persistent step cannot run {a.model}: {plan.step_why}", file=sys.stderr)
        return 2
    n_layer = model.config.n_layer
    res = {"model": Path(a.model).name, "blocks": plan.step_blocks, "slot_bytes": plan._step[0].slot_bytes,
           "n_slot": plan._step[0].n_slot, "n_gen": a.n_gen, "depths": {}}
    rng = np.random.default_rng(0)
    for d in depths:
        st.reset()
        ctx = rng.integers(0, model.config.n_vocab, d)
        for s0 in range(0, d, 512):
            fast.forward(np.asarray(ctx[s0:s0 + 512], np.int32), st)
        row = {}
        for name, on in (("step", True), ("graph", False)):
            plan.step, plan.graphs = on, {}
            row[f"{name}_tok_s"] = 1.0 / timed_decode(plan, st, a.n_gen)[1]
        plan.step = True
        row.update(summarize(traced_step(C, plan, st, n_layer), n_layer))
        res["depths"][d] = row
        ph = " ".join(f"{k} {v['work_us']:.1f}/{v['wait_us']:.1f}" for k, v in row["phases"].items())
        print(f"depth {d}: step {row['step_tok_s']:.0f} tok/s, graph {row['graph_tok_s']:.0f} tok/s "
              f"({row['step_tok_s'] / row['graph_tok_s']:.2f}x); traced step {row['total_us']:.0f} us; per layer, "
              f"block 0's work/wait us: {ph}; head {row['head']['work_us']:.1f}", flush=True)
        if "tiles" in row:
            tl = row["tiles"]
            print(f"  tiles of block 0: {tl['n']}, median wait {tl['median_wait_us']:.2f} us, dots "
                  f"{tl['median_dots_us']:.2f}, gap {tl['median_gap_us']:.2f}; sums {tl['sum_wait_us']:.0f} / "
                  f"{tl['sum_dots_us']:.0f} / {tl['sum_gap_us']:.0f} us; SM clock {tl['sm_clock_ghz']:.2f} GHz",
                  flush=True)
            print("  layer 1: " + ", ".join(f"{k} {v:.1f}" for k, v in row["layer1_us"].items()), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
