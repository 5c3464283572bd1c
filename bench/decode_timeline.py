"""Timeline of the llama decode graph's kernels on the GPU: when each launch's blocks became resident, were released
by the PDL wait, had their staged weights and ended, relative to the previous launch's end.

Needs a kernel library built with -DST_KTRACE (native/cuda/launch.cuh, "kernel timeline trace"), e.g.
  nvcc -O3 -std=c++17 -Xcompiler -fPIC --use_fast_math -I native/cuda -DST_KTRACE -gencode=arch=compute_90,code=sm_90 \
    --shared -o /tmp/kt.so native/cuda/*.cu
and STRATA_CUDA_LIB pointing at it. Per depth: the untraced graph's us per token (timed_decode) and the traced
one's, then per kernel role (QKV, attention, its merge, O, gate/up, down, head) the medians over the middle layers of
the last traced token, in us from the end of the previous traced launch (its last block's end): first / last block
resident, first / last block released by griddep_wait, the last block's weights staged (warp 0's), its fused norm
done, its dots done (warp 0's), the last block ended (`span`: the launch's share of the dependent chain; the spans
add up to the token). --variant takes bench/decode_variants.py's 'name:KEY=VAL,...' settings (repeatable; default:
the defaults). Usage:
python bench/decode_timeline.py --model PATH [--depths 0,4096] [--tokens 3] [--variant SPEC ...] [--shared-layers]
  [--out JSON]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# launch.cuh's KT_* tags and events
TAGS = {1: "matvec", 2: "matvec_block", 3: "glu", 4: "attn", 5: "attn_merge", 6: "norm", 7: "argmax"}
START, WAITED, STAGED, END, NORMED, DOTTED = range(6)
CAP = 1 << 22   # records (3 uint64 each; launch.cuh cuts them into 256 regions, one per SM)
GAP_NS = 100_000   # one launch's records lie closer together than this; a graph node's replays are further apart


def launches(rec: np.ndarray) -> list[dict]:
    """Group trace records (n, 3) uint64 by launch: %gridid, split where the same graph node's replays are more than
    GAP_NS apart; per launch its tag, block count and the first / last time of each event (ns; None where no block
    recorded it), ordered by the first block's start. Unused (zero) records are dropped."""
    rec = rec[rec[:, 1] != 0]
    out = []
    grid, t, info = rec[:, 0], rec[:, 1].astype(np.int64), rec[:, 2]
    tag, ev = (info & 0xff).astype(int), ((info >> 8) & 0xff).astype(int)
    for g in np.unique(grid):
        idx = np.nonzero(grid == g)[0]
        idx = idx[np.argsort(t[idx], kind="stable")]
        cuts = np.nonzero(np.diff(t[idx]) > GAP_NS)[0] + 1
        for part in np.split(idx, cuts):
            e = ev[part]
            d = {"tag": TAGS.get(int(tag[part[0]]), "?"), "blocks": int((e == START).sum())}
            for name, k in (("start", START), ("waited", WAITED), ("staged", STAGED), ("end", END),
                            ("normed", NORMED), ("dotted", DOTTED)):
                ts = t[part][e == k]
                d[name] = (int(ts.min()), int(ts.max())) if ts.size else None
            if d["start"] is not None:
                out.append(d)
    out.sort(key=lambda d: d["start"][0])
    return out


def roles(ls: list[dict]) -> list[str]:
    """Name each launch of a decode step by its place: a matvec after the down projection (or first) is QKV, after
    attention O, before argmax the head."""
    names = []
    for i, d in enumerate(ls):
        tag = d["tag"]
        if tag == "matvec":
            prev = ls[i - 1]["tag"] if i else None
            nxt = ls[i + 1]["tag"] if i + 1 < len(ls) else None
            name = "head" if nxt == "argmax" else "o" if prev in ("attn", "attn_merge") else "qkv"
        else:
            name = {"matvec_block": "down", "glu": "gate_up"}.get(tag, tag)
        names.append(name)
    return names


def relative(ls: list[dict]) -> list[dict]:
    """Per launch, its events in us from the previous launch's last block's end (the first launch: its own start)."""
    rows = []
    for i, d in enumerate(ls):
        ref = ls[i - 1]["end"][1] if i and ls[i - 1]["end"] else d["start"][0]

        def us(v, ref=ref):
            return None if v is None else (v - ref) / 1e3
        rows.append({"first_start": us(d["start"][0]), "last_start": us(d["start"][1]),
                     "first_waited": us(d["waited"][0]) if d["waited"] else None,
                     "last_waited": us(d["waited"][1]) if d["waited"] else None,
                     "last_staged": us(d["staged"][1]) if d["staged"] else None,
                     "last_normed": us(d["normed"][1]) if d["normed"] else None,
                     "last_dotted": us(d["dotted"][1]) if d["dotted"] else None,
                     "span": us(d["end"][1]) if d["end"] else None, "blocks": d["blocks"]})
    return rows


def summarize(ls: list[dict], n_layer: int) -> dict:
    """Medians per role over the launches of the middle layers (the first and last two layers left out)."""
    names, rel = roles(ls), relative(ls)
    per_layer = max(1, (len(ls) - 1) // n_layer)
    lo, hi = 2 * per_layer, len(ls) - 2 * per_layer
    out: dict[str, dict] = {}
    for i, (n, r) in enumerate(zip(names, rel)):
        if n != "head" and not lo <= i < hi:
            continue
        for k, v in r.items():
            if v is not None:
                out.setdefault(n, {}).setdefault(k, []).append(v)
    return {n: {k: statistics.median(v) for k, v in kv.items()} for n, kv in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depths", default="0,4096")
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--shared-layers", action="store_true",
                    help="every layer reads the first layer's weights (bench/decode_variants.py's L2-resident bound)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import cupy as cp
    from bench.decode_variants import (MODULE_SETTINGS, PLAN_SETTINGS, apply, open_plan, parse_variant,
                                       share_first_layer, timed_decode)
    from strata.backend import cuda as C
    so = ctypes.CDLL(str(C._lib_path()))
    if not hasattr(so, "strata_ktrace_set"):
        print(f"{C._lib_path()} was not built with -DST_KTRACE (see this script's docstring)", file=sys.stderr)
        return 2
    so.strata_ktrace_set.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    so.strata_ktrace_count.restype = ctypes.c_uint
    depths = [int(x) for x in a.depths.split(",") if x]
    model, st, plan, fast = open_plan(a.model, max(depths) + a.n_gen + 512)
    if a.shared_layers:
        share_first_layer(model)
    n_layer = model.config.n_layer
    variants = [parse_variant(v) for v in (a.variant or ["default:"])]
    lib = C.lib()
    base = {k: getattr(C, k) for k in (*PLAN_SETTINGS, *MODULE_SETTINGS)}
    base["_PDL"] = lib.strata_get_pdl()
    buf = cp.zeros((CAP, 3), cp.uint64)
    rng = np.random.default_rng(0)
    res = {"model": Path(a.model).name, "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "shared_layers": a.shared_layers, "variants": dict(variants), "depths": {}}
    for d, (vname, settings) in ((d, v) for d in depths for v in variants):
        if vname == variants[0][0]:
            st.reset()
            ctx = rng.integers(0, model.config.n_vocab, d)
            for s0 in range(0, d, 512):
                fast.forward(np.asarray(ctx[s0:s0 + 512], np.int32), st)
        apply(C, plan, lib, settings, base)
        _, dt = timed_decode(plan, st, a.n_gen)            # captures the graph, untraced timing
        p0 = st.pos
        buf.fill(0)
        so.strata_ktrace_set(ctypes.c_void_p(buf.data.ptr), CAP)
        cp.cuda.Device().synchronize()
        plan.decode_greedy(1, a.tokens, st)
        cp.cuda.Device().synchronize()
        dropped = so.strata_ktrace_count()
        so.strata_ktrace_set(None, 0)
        st.truncate(p0)
        rec = cp.asnumpy(buf)
        n = int((rec[:, 1] != 0).sum())
        ls = launches(rec)
        # the last traced token: the launches after the second-to-last argmax
        ends = [i for i, x in enumerate(ls) if x["tag"] == "argmax"]
        tok = ls[ends[-2] + 1:ends[-1] + 1] if len(ends) >= 2 else ls
        tok_us = (tok[-1]["start"][1] - tok[0]["start"][0]) / 1e3
        summ = summarize(tok, n_layer)
        res["depths"].setdefault(d, {})[vname] = {
            "us_per_token": dt * 1e6, "traced_us_per_token": tok_us, "records": n, "dropped": dropped,
            "roles": summ, "launches": [dict(r, role=nm) for r, nm in zip(relative(tok), roles(tok))]}
        print(f"depth {d}, {vname}: {dt * 1e6:.1f} us/token untraced, {tok_us:.1f} traced ({n} records, "
              f"{dropped} dropped); us from the previous launch's end, medians over the middle layers")
        cols = ["blocks", "first_start", "last_start", "first_waited", "last_waited", "last_staged", "last_normed",
                "last_dotted", "span"]
        print(f"{'role':10s} " + " ".join(f"{c:>12s}" for c in cols))
        for nm, r in summ.items():
            print(f"{nm:10s} " + " ".join(f"{r[c]:12.2f}" if c in r else f"{'-':>12s}" for c in cols), flush=True)
    apply(C, plan, lib, {}, base)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
