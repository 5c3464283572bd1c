"""Marginal cost of each kernel class in the llama CUDA decode graph: the graph timed with one class swapped out.

Each variant captures the decode step with the launches of one kernel class (the RMSNorms, RoPE + K/V write, decode
attention, the warp-per-row matvecs, the down projection's block-per-row matvec, the fused SwiGLU matvec, the QKV
matvec with the norm and RoPE inside, the SwiGLU matvec with the norm inside, the output / down matvecs adding to the
residual stream (the norm handoff), the SwiGLU launch, every matvec,
everything) replaced by a trivial one-thread launch (``triv``: the graph keeps its node count,
so the saving is that class's own cost beyond a node's), or left out (``skip``, for the all-classes variant: the
floor of the embedding row, argmax and graph launch). The logits of a swapped-out step are garbage and not looked
at; the variants run in turn for --rounds rounds on the same context (median), so drift spreads over all of them.
Unlike Nsight Compute's per-kernel durations (base clock, ~2 us floor per kernel), this is what each class costs in
the real graph with PDL. Usage: python bench/decode_ablation.py --model PATH [--depths 0,4096] [--rounds 3]
[--n-gen 128] [--out JSON]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MATVECS = ["strata_matvec_q8w", "strata_matvec_q8b", "strata_matvec_q8w_glu", "strata_matvec_q8w_rope",
           "strata_matvec_q8w_glu_norm", "strata_matvec_q8_resid"]
OTHERS = ["strata_rms_norm_ex", "strata_norm_q8", "strata_rope_kv_decode", "strata_attn_decode_ex",
          "strata_attn_decode_gqa", "strata_swiglu_gu"]
VARIANTS = {   # name: (launchers swapped out, replaced by a trivial launch (True) or left out)
    "full": ([], True),
    "rms": (["strata_rms_norm_ex"], True),
    "rope_kv": (["strata_rope_kv_decode"], True),
    "attention": (["strata_attn_decode_ex", "strata_attn_decode_gqa"], True),
    "matvec_q8w": (["strata_matvec_q8w"], True),
    "matvec_q8b": (["strata_matvec_q8b"], True),
    "matvec_glu": (["strata_matvec_q8w_glu"], True),
    "qkv_norm_rope": (["strata_matvec_q8w_rope"], True),
    "glu_norm": (["strata_matvec_q8w_glu_norm"], True),
    "matvec_resid": (["strata_matvec_q8_resid"], True),
    "swiglu": (["strata_swiglu_gu"], True),
    "all_matvecs": (MATVECS, True),
    "all_triv": (MATVECS + OTHERS, True),
    "all_skip": (MATVECS + OTHERS, False),
}


class _SwappedLib:
    """The kernel library with some launchers swapped out (a one-thread strata_add_scalar on a scratch int, or
    nothing); every other name is the real launcher."""

    def __init__(self, real, names, trivial: bool, scratch_ptr):
        self._real, self._names, self._trivial, self._scratch = real, set(names), trivial, scratch_ptr

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name not in self._names:
            return fn
        if self._trivial:
            return lambda stream, *args: self._real.strata_add_scalar(stream, self._scratch, 1, 1)
        return lambda *args: 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depths", default="0,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    depths = [int(x) for x in a.depths.split(",") if x]
    import cupy as cp
    from bench.decode_variants import open_plan, timed_decode
    from strata.backend import cuda as C
    model, st, plan, fast = open_plan(a.model, max(depths) + a.n_gen + 512)
    real_lib = C.lib
    scratch = cp.zeros(4, cp.int32)
    scratch_ptr = C._ffi.cast("int *", scratch.data.ptr)
    us: dict[int, dict[str, list[float]]] = {d: {n: [] for n in VARIANTS} for d in depths}
    rng = np.random.default_rng(0)
    try:
        for d in depths:
            C.lib = real_lib                                   # the prefill runs every kernel
            st.reset()
            ctx = rng.integers(0, model.config.n_vocab, d)
            for s0 in range(0, d, 512):
                fast.forward(np.asarray(ctx[s0:s0 + 512], np.int32), st)
            for _ in range(a.rounds):
                for name, (names, trivial) in VARIANTS.items():
                    swapped = _SwappedLib(real_lib(), names, trivial, scratch_ptr)
                    C.lib = lambda swapped=swapped: swapped    # read by the plan when it captures the step
                    plan.graphs = {}
                    us[d][name].append(timed_decode(plan, st, a.n_gen)[1] * 1e6)
    finally:
        C.lib = real_lib
        plan.graphs = {}
    res = {"model": Path(a.model).name, "n_gen": a.n_gen, "rounds": a.rounds, "us_per_token": us, "saves_us": {}}
    print(f"{'class swapped out':18s} " + " ".join(f"{'d' + str(d) + ' us/token (saves)':>26s}" for d in depths))
    for name in VARIANTS:
        row = []
        for d in depths:
            m, full = statistics.median(us[d][name]), statistics.median(us[d]["full"])
            res["saves_us"].setdefault(name, {})[d] = full - m
            row.append(f"{m:10.1f} ({full - m:8.1f})")
        print(f"{name:18s} " + " ".join(f"{r:>26s}" for r in row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
