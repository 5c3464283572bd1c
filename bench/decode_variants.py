"""A/B of the CUDA decode plan's settings: decode tokens/s of one model under variants, interleaved rounds.

Each variant is a set of module settings of strata.backend.cuda read when a decode step is captured (GLU, GLU_RP,
ATTN, ATTN_CHUNK, ATTN_BPS, ATTN_MAX_SPLIT, ATTN_ONE_WAVE, ATTN_MERGE, PRE_WAIT, QKV_ROPE, V1_CHUNK, FUSED_NORM,
FUSED_NORM_R, NORM_HANDOFF, HANDOFF_R, MV_BLOCK_FROM, MV_BLOCK_ROWS, PDL on/off) or a STRATA_* environment variable
the kernel launchers read (STRATA_CUDA_ATTN_DB, STRATA_CUDA_NORM_CONTIG, STRATA_CUDA_MV_STAGE); the plan's graphs
are dropped between variants, and the variants run in turn for --rounds rounds on the same contexts, so clock and
thermal drift spread over all of them instead of favouring the first. Greedy tokens of each variant are compared with the first
variant's (the settings must not change them, except those that change an f32 summation order: the attention
split, FUSED_NORM, NORM_HANDOFF (it quantizes x * w before the 1 / rms scale), STRATA_CUDA_NORM_CONTIG).

--shared-layers points every layer at the first layer's weights (same shapes and types, ~35 MB for the 1.7B model,
which stays in the 50 MB L2 from one layer to the next): the decode step then reads almost nothing from DRAM but the
output head, so its time is the dependent chain's own (launch boundaries, L2 latency, compute) — the bound that
faster weight streaming alone cannot pass. Its tokens are another model's.

Usage: python bench/decode_variants.py --model PATH [--depths 0,4096,16384] [--n-gen 128] [--rounds 3]
  [--variant 'name:GLU=0,ATTN_CHUNK=256' ...] [--shared-layers] [--out JSON]
(--variant may repeat; the first variant is the reference; default: the defaults, the separate SwiGLU launch, the
fused SwiGLU with 1 / 2 row pairs per warp, the single-buffered decode attention, its split without the one-wave
cap.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_VARIANTS = ["default:", "no_glu:GLU=0", "glu_rp1:GLU=1,GLU_RP=1", "glu_rp2:GLU=1,GLU_RP=2",
                    "single_buffer:STRATA_CUDA_ATTN_DB=0", "no_one_wave:ATTN_ONE_WAVE=0"]


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """'name:KEY=VAL,KEY=VAL' -> (name, {KEY: VAL}); raises ValueError on a malformed spec."""
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"variant {spec!r}: no name before ':'")
    kv = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"variant {spec!r}: {item!r} is not KEY=VALUE")
        kv[k.strip()] = v.strip()
    return name, kv


_ENV_SET: set[str] = set()
_OFF = ("0", "false", "no", "off")


def _on(v: str) -> bool:
    return v not in _OFF


# settings that are attributes of the plan (read when it captures a step): name -> (attribute, parser); their base
# values are the strata.backend.cuda module globals of the same name, which the plan copies when it is made
PLAN_SETTINGS = {"GLU": ("glu", _on), "ATTN": ("attn", str), "QKV_ROPE": ("qkv_rope", _on),
                 "FUSED_NORM": ("fused_norm", _on), "MV_BLOCK_FROM": ("mv_block_from", int),
                 "ATTN_MERGE": ("attn_merge", _on), "PRE_WAIT": ("pre_wait", _on),
                 "NORM_HANDOFF": ("norm_handoff", _on)}
# settings that are module globals the plan reads at capture: name -> parser
MODULE_SETTINGS = {"ATTN_ONE_WAVE": _on, "GLU_RP": int, "ATTN_CHUNK": int, "ATTN_BPS": int, "ATTN_MAX_SPLIT": int,
                   "V1_CHUNK": int, "FUSED_NORM_R": int, "MV_BLOCK_ROWS": int, "HANDOFF_R": int}


def apply(C, plan, lib, settings: dict[str, str], base: dict) -> None:
    """Restore the base settings, then set these (plan attributes, module globals of strata.backend.cuda, PDL
    through the library, STRATA_* names as environment variables that the kernel launchers read at capture); drop
    the plan's captured graphs so the next step is captured with them."""
    for k in _ENV_SET:
        os.environ.pop(k, None)
    _ENV_SET.clear()
    for k, v in base.items():
        if not k.startswith("_"):
            setattr(C, k, v)
    for k, (attr, _) in PLAN_SETTINGS.items():
        setattr(plan, attr, base[k])
    lib.strata_set_pdl(base["_PDL"])
    for k, v in settings.items():
        if k.startswith("STRATA_"):
            os.environ[k] = v
            _ENV_SET.add(k)
        elif k == "PDL":
            lib.strata_set_pdl(int(v))
        elif k in PLAN_SETTINGS:
            attr, parse = PLAN_SETTINGS[k]
            setattr(plan, attr, parse(v))
        elif k in MODULE_SETTINGS:
            setattr(C, k, MODULE_SETTINGS[k](v))
        else:
            raise ValueError(f"unknown setting {k!r}")
    plan.graphs = {}


def open_plan(path: str, max_ctx: int):
    """(model, a sequence state, its LlamaCuda plan, the backend's fast path) for the GGUF at path on CUDA, over a
    page pool of max_ctx positions."""
    from strata.backend import cuda as C
    from strata.models.base import load_model
    model = load_model(path, C.CudaBackend())
    pool = model.new_page_pool(max_ctx)
    return model, model.new_state(pool), C.LlamaCuda(model, pool), model.backend.fast_path(model)


LAYER_WEIGHTS = ("wqkv", "wq", "wk", "wv", "wo", "w_gate_up", "w_gate", "w_up", "w_down")


def share_first_layer(model) -> None:
    """Point every layer's matrices at the first layer's (the norms stay per layer): the same shapes and types, so
    the same kernels and launches, reading one layer's weights over and over."""
    first = model.layers[0]
    for L in model.layers[1:]:
        for k in LAYER_WEIGHTS:
            if getattr(first, k, None) is not None:
                setattr(L, k, getattr(first, k))


def timed_decode(plan, st, n_gen: int) -> tuple[list[int], float]:
    """16 greedy graph-decode tokens from st.pos (capturing the step's graph), then n_gen more timed; st is put
    back where it was. Returns (the 16 tokens, seconds per timed token)."""
    import cupy as cp
    p0 = st.pos
    tokens = plan.decode_greedy(1, 16, st)
    st.truncate(p0)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    plan.decode_greedy(1, n_gen, st)
    dt = (time.perf_counter() - t0) / n_gen
    st.truncate(p0)
    return tokens, dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depths", default="0,4096,16384")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--shared-layers", action="store_true",
                    help="every layer reads the first layer's weights (the L2-resident bound)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    variants = [parse_variant(v) for v in (a.variant or DEFAULT_VARIANTS)]
    depths = [int(x) for x in a.depths.split(",") if x]
    from strata.backend import cuda as C
    model, st, plan, fast = open_plan(a.model, max(depths) + a.n_gen + 512)
    if a.shared_layers:
        share_first_layer(model)
    lib = C.lib()
    base = {k: getattr(C, k) for k in (*PLAN_SETTINGS, *MODULE_SETTINGS)}
    base["_PDL"] = lib.strata_get_pdl()
    rng = np.random.default_rng(0)
    ctx = {d: rng.integers(0, model.config.n_vocab, d) for d in depths}

    def prefill(d: int) -> None:   # the context again each time (decoded tokens overwrite the cache after it)
        st.reset()
        for s in range(0, d, 512):
            fast.forward(np.asarray(ctx[d][s:s + 512], np.int32), st)
    tps: dict[str, dict[int, list[float]]] = {n: {d: [] for d in depths} for n, _ in variants}
    tokens: dict[str, dict[int, list[int]]] = {n: {} for n, _ in variants}
    for r in range(a.rounds):
        for name, settings in variants:
            apply(C, plan, lib, settings, base)
            for d in depths:
                prefill(d)
                tokens[name][d], dt = timed_decode(plan, st, a.n_gen)   # + the tokens to compare
                tps[name][d].append(1 / dt)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    apply(C, plan, lib, {}, base)
    ref = variants[0][0]
    res = {"model": Path(a.model).name, "n_gen": a.n_gen, "rounds": a.rounds, "shared_layers": a.shared_layers,
           "variants": {}}
    print(f"{'variant':16s} " + " ".join(f"{'d' + str(d):>16s}" for d in depths) + "   (median tok/s, ratio to "
          f"{ref}; tokens == {ref})")
    for name, settings in variants:
        med = {d: statistics.median(tps[name][d]) for d in depths}
        same = {d: tokens[name][d] == tokens[ref][d] for d in depths}
        res["variants"][name] = {"settings": settings, "tok_s": tps[name], "median": med,
                                 "ratio": {d: med[d] / statistics.median(tps[ref][d]) for d in depths},
                                 "tokens_equal": same}
        print(f"{name:16s} " + " ".join(f"{med[d]:8.1f} ({med[d] / statistics.median(tps[ref][d]):.3f})"
                                        for d in depths) + f"   {all(same.values())}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
