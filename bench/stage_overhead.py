"""What the stage path costs per forward call: the engine's Sequence.forward (reserve on every stage, Stage.forward,
the runner) against the model's own forward on the same memory, interleaved call by call in one process (so machine
drift falls on both), for a one-token decode step and a prompt ubatch; and 1 vs 3 stages on the CPU.

Usage: python bench/stage_overhead.py [--model default] [--reps 200] [--out bench/results/stage_overhead.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--ubatch", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stage_overhead.json"))
    args = ap.parse_args(argv)
    from strata.engine import Engine
    one = Engine(args.model, n_ctx=4096, prompt_cache=0)
    three = Engine(args.model, n_ctx=4096, prompt_cache=0, layer_split="10,20")
    model = one.stages[0].model
    direct = model.new_state(model.new_page_pool(4096))
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, one.n_vocab, 512).astype(np.int32)
    for st in (one.seq, three.seq):
        st.forward(ctx)
    model.forward(ctx, direct)
    res = {}
    for kind, n in (("decode", 1), ("ubatch", args.ubatch)):
        times = {"model.forward": [], "Sequence.forward 1 stage": [], "Sequence.forward 3 stages": []}
        reps = args.reps if n == 1 else max(10, args.reps // 20)
        for _ in range(reps):
            toks = rng.integers(0, one.n_vocab, n).astype(np.int32)
            for name, call, back in (
                    ("model.forward", lambda: model.forward(toks, direct), lambda: direct.truncate(512)),
                    ("Sequence.forward 1 stage", lambda: one.seq.forward(toks), lambda: one.seq.truncate(512)),
                    ("Sequence.forward 3 stages", lambda: three.seq.forward(toks), lambda: three.seq.truncate(512))):
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
                back()
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        base = med["model.forward"]
        res[kind] = {"tokens": n, "reps": reps, "median_ms": med, "ratio_to_model_forward": {k: v / base
                                                                                            for k, v in med.items()}}
        print(f"{kind} ({n} tokens, {reps} interleaved reps, median ms): " +
              ", ".join(f"{k} {v:.3f} ({v / base:.3f})" for k, v in med.items()), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
