"""Where a MoE model's prefill time goes on the GPU: CUDA events around each launch of one MoE layer, and around each
part (norms, GDN, attention, MoE FFN) of a whole prompt read in ubatches.

layer: strata/backend/cuda/moe.prefill over n random rows of the model's first MoE layer, an event after every launch
(the launchers' ``check`` calls and the plan's cuBLAS GEMMs mark them), the median of reps per launch, named by its
role (router GEMM, route, quantize, group, gate|up grouped matvec, SwiGLU + quantize, down, shared expert, combine);
the grouped matvecs' int8 tera-operations per second (2 n k n_in n_out / time) beside the H100 / H200 peaks; and the
layer's time with no event inside. With --lanes, the layer again at each STRATA_CUDA_MOE_LANES value (the grouped
matvec's lanes per row group; a kernel library without that setting ignores it).
prompt: a prompt of --prompt tokens through the plan's prefill in --ubatch calls (as bench/gpu_throughput.py runs
it) with events around each part of every layer: the wall time, the GPU time between the first and last event, the
sum per part, and the rest (embedding, logits, gaps between launches and calls).
Usage: python bench/moe_prefill_profile.py MODEL.gguf [--n 512,4096] [--prompt 4096] [--lanes 32,16,8] [--out J]
A diagnostic, no reference: llama.cpp's own MUL_MAT_ID time comes from nsys (docs/moe.md).
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

PEAK_INT8_DENSE_TOPS = {"H100": 1979.0, "H200": 1979.0}     # SXM, tensor cores, dense (NVIDIA data sheets)


def _roles(names: list[str]) -> list[str]:
    """The role of each marked launch of moe.prefill, in launch order."""
    out, n_mm, n_q8, n_gemm = [], 0, 0, 0
    for nm in names:
        if nm == "gemm":
            n_gemm += 1
            out.append("router_gemm" if n_gemm == 1 else "shared_down_gemm" if "shared_swiglu" in out
                       else "shared_gate_up_gemm")
        elif nm == "strata_moe_mm":
            n_mm += 1
            out.append("gate_up_grouped" if n_mm == 1 else "down_grouped")
        elif nm == "strata_moe_q8_rows":
            n_q8 += 1
            out.append("quantize_x" if n_q8 == 1 else "swiglu_quantize")
        elif nm == "swiglu_gu":
            out.append("shared_swiglu")
        else:
            out.append(nm.replace("strata_", ""))
    return out


def layer_profile(plan, n: int, reps: int = 7) -> dict:
    """Per-launch microseconds of moe.prefill over n random rows of the plan's first MoE layer (see the module doc)."""
    import cupy as cp
    from strata.backend.cuda import moe
    from strata.backend.cuda.library import stream_ptr
    li = min(plan.moe)
    m = plan.moe[li]
    E = plan.n_embd
    norm = plan.model.layers[li].post_norm
    rng = np.random.default_rng(0)
    x0 = cp.asarray(rng.standard_normal((n, E)).astype(np.float32))
    x, h16 = cp.empty_like(x0), cp.empty((n, E), cp.float16)
    marks: list = []
    check0, gemm0 = moe.check, plan.pf.gemm

    def check(rc, what):
        check0(rc, what)
        ev = cp.cuda.Event()
        ev.record()
        marks.append((what, ev))

    def gemm(*a, **kw):
        r = gemm0(*a, **kw)
        ev = cp.cuda.Event()
        ev.record()
        marks.append(("gemm", ev))
        return r

    per: list[list[float]] = []
    names: list[str] = []
    totals = []
    for instrumented in (True, False):
        for _ in range(reps):
            x[...] = x0
            marks.clear()
            a = cp.cuda.Event()
            a.record()
            if instrumented:
                moe.check, plan.pf.gemm = check, gemm
            try:
                moe.prefill(plan, stream_ptr(), m, x, norm, h16)
            finally:
                moe.check, plan.pf.gemm = check0, gemm0
            b = cp.cuda.Event()
            b.record()
            b.synchronize()
            if instrumented:
                prev, row = a, []
                for _, ev in marks:
                    row.append(cp.cuda.get_elapsed_time(prev, ev) * 1e3)
                    prev = ev
                per.append(row)
                names = [w for w, _ in marks]
            else:
                totals.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    med = np.median(np.asarray(per), axis=0)
    roles = _roles(names)
    launches = [{"role": r, "us": float(t)} for r, t in zip(roles, med)]
    k, F = m.k, m.n_ff
    ops = {"gate_up_grouped": 2.0 * n * k * E * 2 * F, "down_grouped": 2.0 * n * k * F * E}
    for row in launches:
        if row["role"] in ops:
            row["tops"] = ops[row["role"]] / (row["us"] * 1e-6) / 1e12
    out = {"layer": li, "n": n, "experts": m.n_expert, "k": k, "n_ff_exp": F, "n_embd": E,
           "lanes": os.environ.get("STRATA_CUDA_MOE_LANES", "default"), "launches": launches,
           "sum_us": float(med.sum()), "layer_us_no_events": float(np.median(totals))}
    grouped = sum(r["us"] for r in launches if r["role"].endswith("_grouped"))
    out["grouped_share"] = grouped / out["sum_us"]
    out["grouped_tops"] = (ops["gate_up_grouped"] + ops["down_grouped"]) / (grouped * 1e-6) / 1e12
    return out


def prompt_profile(fast, plan, state, n_prompt: int, ubatch: int, vocab: int) -> dict:
    """Per-part GPU time of a prompt read through the plan's prefill in ubatch calls (see the module doc)."""
    import cupy as cp
    from strata.backend.cuda import qwen35
    rng = np.random.default_rng(1)
    toks = rng.integers(0, vocab, n_prompt).astype(np.int32)
    spans: dict[str, list] = {}
    first_last: list = []

    def wrap(name, fn):
        def w(*a, **kw):
            e0 = cp.cuda.Event()
            e0.record()
            r = fn(*a, **kw)
            e1 = cp.cuda.Event()
            e1.record()
            spans.setdefault(name, []).append((e0, e1))
            return r
        return w

    def run():
        state.reset()
        for s in range(0, n_prompt, ubatch):
            fast.forward(toks[s:s + ubatch], state)

    run()                                                        # warm-up (scratch buffers of this size)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    run()
    cp.cuda.Device().synchronize()
    wall_plain = time.perf_counter() - t0
    moe_prefill = qwen35.moe.prefill
    plan._gdn_prefill = wrap("gdn", plan._gdn_prefill)
    plan._attn_prefill = wrap("attention", plan._attn_prefill)
    plan._prefill_norm = wrap("attn_norm", plan._prefill_norm)
    qwen35.moe.prefill = wrap("moe_ffn", moe_prefill)
    try:
        a = cp.cuda.Event()
        a.record()
        first_last.append(a)
        t0 = time.perf_counter()
        run()
        b = cp.cuda.Event()
        b.record()
        b.synchronize()
        wall = time.perf_counter() - t0
    finally:
        qwen35.moe.prefill = moe_prefill
        for k in ("_gdn_prefill", "_attn_prefill", "_prefill_norm"):
            plan.__dict__.pop(k, None)
    gpu_ms = cp.cuda.get_elapsed_time(a, b)
    parts = {k: float(sum(cp.cuda.get_elapsed_time(e0, e1) for e0, e1 in v)) for k, v in spans.items()}
    return {"prompt": n_prompt, "ubatch": ubatch, "wall_ms_no_events": wall_plain * 1e3, "wall_ms": wall * 1e3,
            "gpu_ms": gpu_ms, "parts_ms": parts, "rest_ms": gpu_ms - sum(parts.values()),
            "tok_per_s_no_events": n_prompt / wall_plain}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--n", default="512,4096", help="rows of the one-layer profile")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--lanes", default="", help="STRATA_CUDA_MOE_LANES values to profile the layer at (comma list)")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. the kernel library's)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import cupy as cp
    from strata.backend.cuda import CudaBackend
    from strata.backend.cuda.library import lib_path
    from strata.models.registry import load_model
    model = load_model(a.model, CudaBackend())
    fast = model.backend.fast_path(model)
    pool = model.new_page_pool(a.prompt + 512)
    st = model.new_state(pool)
    plan = fast.plan(pool)
    if not getattr(plan, "moe", None):
        print(f"{a.model}: no MoE layers on the plan", file=sys.stderr)
        return 2
    props = cp.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    peak = next((v for k, v in PEAK_INT8_DENSE_TOPS.items() if k in gpu), None)
    from bench.common import commit as bench_commit
    res = {"what": "bench/moe_prefill_profile.py", "label": a.label, "model": os.path.basename(a.model), "gpu": gpu,
           "commit": bench_commit(), "kernel_library": str(lib_path()), "peak_int8_dense_tops": peak, "layer": [],
           "prompt": None}
    layer_profile(plan, 512, reps=2)                                 # warm-up
    lanes = [x for x in a.lanes.split(",") if x] or [None]
    for lv in lanes:
        if lv:
            os.environ["STRATA_CUDA_MOE_LANES"] = lv
        for n in (int(x) for x in a.n.split(",")):
            r = layer_profile(plan, n)
            res["layer"].append(r)
            print(f"layer {r['layer']} n={n} lanes={r['lanes']}: {r['layer_us_no_events']:.0f} us "
                  f"(grouped {100 * r['grouped_share']:.0f} %, {r['grouped_tops']:.1f} TOPS)", flush=True)
            for row in r["launches"]:
                print(f"    {row['role']:22s} {row['us']:8.1f} us" +
                      (f"  {row['tops']:.1f} TOPS" if "tops" in row else ""), flush=True)
        os.environ.pop("STRATA_CUDA_MOE_LANES", None)
    res["prompt"] = prompt_profile(fast, plan, st, a.prompt, a.ubatch, model.config.n_vocab)
    p = res["prompt"]
    print(f"prompt {a.prompt} in {a.ubatch}-token calls: wall {p['wall_ms_no_events']:.1f} ms "
          f"({p['tok_per_s_no_events']:.0f} tok/s); with events wall {p['wall_ms']:.1f} ms, GPU {p['gpu_ms']:.1f} ms: "
          + ", ".join(f"{k} {v:.1f}" for k, v in p["parts_ms"].items()) + f", rest {p['rest_ms']:.1f}", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
