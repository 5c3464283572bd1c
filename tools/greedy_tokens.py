"""Greedy tokens of a model as the engine's CUDA runner produces them (CudaBackend.fast_path: the family plan's prefill
and captured decode graph), for comparing two builds of Strata on the same files: prints one JSON line per model,
{"model", "prompt", "tokens", "runner"}. Models: GGUF paths, or 'syn_llama_1_7b' / 'syn_hybrid_1_5b' (the synthetic
models bench/gpu_throughput.py and bench/gpu_hybrid_model.py write, made once into --dir). Runs on both sides of
issue #20's package split (it only uses CudaBackend, load_model and fast_path).

Usage: PYTHONPATH=TREE python tools/greedy_tokens.py [--dir D] [--prompt N] [--n N] MODEL..."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np


def model_path(name: str, directory: Path) -> str:
    """A GGUF path for `name` (the synthetic ones written into directory on first use)."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "bench"))
    from strata.gguf.default_model import default_model_path
    if name == "syn_llama_1_7b":
        p = directory / "syn_llama_1_7b.gguf"
        if not p.exists():
            from gpu_throughput import make_synthetic_llama
            make_synthetic_llama(str(p), str(default_model_path()), d=2e-3, dmin=1.5e-2)
        return str(p)
    if name == "syn_hybrid_1_5b":
        p = directory / "syn_hybrid_1_5b.gguf"
        if not p.exists():
            from gpu_hybrid_model import make_synthetic_hybrid
            make_synthetic_hybrid(p, default_model_path())
        return str(p)
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--dir", default="/tmp/greedy_models")
    ap.add_argument("--prompt", type=int, default=600, help="prompt tokens (random ids, seed 0)")
    ap.add_argument("--n", type=int, default=48, help="greedy tokens decoded")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    from strata.backend.cuda import CudaBackend
    from strata.models.registry import load_model
    be = CudaBackend()
    for name in a.models:
        model = load_model(model_path(name, Path(a.dir)), be)
        fast = be.fast_path(model)
        pool = fast.new_page_pool(a.prompt + a.n + 64)
        st = model.new_state(pool)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, model.config.n_vocab, a.prompt).astype(np.int32)
        logits = None
        for s in range(0, a.prompt, 512):
            logits = fast.forward(prompt[s:s + 512], st)
        toks = [int(np.argmax(logits))]
        for _ in range(a.n - 1):
            toks.append(int(np.argmax(fast.forward(np.asarray(toks[-1:], np.int32), st))))
        print(json.dumps({"model": name, "prompt": a.prompt, "tokens": toks, "runner": type(fast).__name__}),
              flush=True)
        del st, pool, fast, model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
