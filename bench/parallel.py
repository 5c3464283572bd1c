"""Aggregate decode throughput of the batched step (one token of each of N live sequences in one forward per stage,
strata/stages/batch.decode_batch) beside N lone decode steps (each sequence's Sequence.forward of one token: the
reference, measured in the same run on the same sequences), on CUDA or the CPU.

For each model and N in --ns: N sequences over one stage, each first reads a prompt of its own length (--depth +
16 i tokens: every row at its own position; the default depth keeps every row inside one context-size class, 513 ..
1024 positions, for the whole run, so the timed rounds replay graphs and never capture one), then --steps rounds of
a) the batched step of all N (random tokens) and b) the N lone steps, alternating, best of --reps each; aggregate
tok/s = N * steps / seconds, host logits of every row included. "ratio" = batched tok/s over lone tok/s. Compute level: no sampling, no scheduling.

Models: 'default' (the default model), 'syn_smol' (a synthetic llama of the default model's shape, Q4_1: the default
model's compute where its file is not at hand), 'syn_llama_1_7b' and 'syn_hybrid_1_5b' (bench/gpu_throughput.py's
and bench/gpu_hybrid_model.py's synthetic models, written into --dir on first use), or GGUF paths.
Usage: PYTHONPATH=. python bench/parallel.py [--device cuda|cpu] [--models default,syn_llama_1_7b,syn_hybrid_1_5b]
       [--ns 1,2,4,8,16] [--steps 16] [--reps 3] [--depth 600] [--threads N] [--out PATH]
Writes bench/results/parallel_step_<device>_<commit>.json (or --out).
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

NS = (1, 2, 4, 8, 16)
MODELS = ("default", "syn_llama_1_7b", "syn_hybrid_1_5b")


def model_path(name: str, folder: Path) -> str:
    """The GGUF of a model name (written into folder on first use for the synthetic ones)."""
    from strata.gguf.default_model import default_model_path
    folder.mkdir(parents=True, exist_ok=True)
    if name == "default":
        return str(default_model_path())
    out = folder / f"{name}.gguf"
    if out.exists():
        return str(out)
    tok = str(default_model_path())
    if name == "syn_smol":
        from strata.gguf import synth
        return str(synth.write_synthetic(out, synth.preset("llama", "tiny", n_embd=576, n_layer=30, n_head=9,
                                                           n_head_kv=3, head_dim=64, n_ff=1536, qtype="Q4_1",
                                                           embd_qtype="Q8_0", seed=3)))
    if name == "syn_llama_1_7b":
        from gpu_throughput import make_synthetic_llama
        return make_synthetic_llama(str(out), tok)
    if name == "syn_hybrid_1_5b":
        from gpu_hybrid_model import make_synthetic_hybrid
        return str(make_synthetic_hybrid(out, tok, size="1.5b"))
    return name


def bench_model(path: str, device: str, ns, steps: int, reps: int, depth: int) -> dict:
    """{"n_layer", "rows": {N: {"batched_tok_s", "lone_tok_s", "ratio"}}} for one model."""
    from strata.gguf.file import open_gguf
    from strata.stages import build_stages
    from strata.stages.batch import decode_batch
    from strata.stages.sequence import Sequence
    n_max = max(ns)
    ctx = depth + 16 * n_max + 2 * (reps + 1) * steps + 64
    stages = build_stages(open_gguf(path), [device], None, n_ctx=ctx, pool_ctx=n_max * ctx)
    V = stages[-1].model.config.n_vocab
    rng = np.random.default_rng(0)
    sync = (lambda: __import__("cupy").cuda.Device().synchronize()) if device != "cpu" else (lambda: None)
    res = {"n_layer": int(stages[0].model.n_blocks), "runner": type(stages[0].runner).__name__, "rows": {}}
    for n in ns:
        seqs = [Sequence(stages) for _ in range(n)]
        for i, s in enumerate(seqs):
            s.forward(rng.integers(0, V, depth + 16 * i).astype(np.int32))
        toks = rng.integers(0, V, (reps + 1, steps, n)).astype(np.int32)

        def batched(r):
            for t in range(steps):
                decode_batch(seqs, toks[r, t])

        def lone(r):
            for t in range(steps):
                for i, s in enumerate(seqs):
                    s.forward(toks[r, t, i:i + 1])
        best = {"batched": float("inf"), "lone": float("inf")}
        for r in range(reps + 1):                 # round 0 warms up (graph captures); then alternate
            for kind, run in (("batched", batched), ("lone", lone)):
                sync()
                t0 = time.perf_counter()
                run(r)
                sync()
                if r:
                    best[kind] = min(best[kind], time.perf_counter() - t0)
        e = res["rows"][str(n)] = {"batched_tok_s": n * steps / best["batched"], "lone_tok_s": n * steps / best["lone"],
                                   "batched_step_ms": 1e3 * best["batched"] / steps}
        e["ratio"] = e["batched_tok_s"] / e["lone_tok_s"]
        print(f"  N={n}: batched {e['batched_tok_s']:.1f} tok/s, {n} lone steps {e['lone_tok_s']:.1f} tok/s "
              f"(x{e['ratio']:.2f})", flush=True)
        for s in seqs:
            s.drop()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--depth", type=int, default=600)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp") + "/strata-bench")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from gpu_throughput import commit, host_load
    device = "cpu" if a.device == "cpu" else a.device if ":" in a.device else f"{a.device}:0"
    if device == "cpu" and a.threads:
        from strata.backend import quant
        quant.set_threads(a.threads)
    ns = [int(x) for x in a.ns.split(",")]
    out = {"device": device, "commit": commit(), "ns": ns, "steps": a.steps, "reps": a.reps, "depth": a.depth,
           "host_load": host_load(), "models": {}}
    if device != "cpu":
        import cupy
        out["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    else:
        from strata.backend import quant
        out["threads"], out["cpu_path"] = quant.get_threads(), quant.cpu_path()
    tag = "cpu" if device == "cpu" else out["gpu"].replace(" ", "_")
    dest = Path(a.out) if a.out else ROOT / "bench" / "results" / f"parallel_step_{tag}_{out['commit']}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    for name in a.models.split(","):
        path = model_path(name, Path(a.dir))
        print(f"{name} ({path}) on {device}", flush=True)
        out["models"][name] = bench_model(path, device, ns, a.steps, a.reps, a.depth)
        dest.write_text(json.dumps(out, indent=1))          # after each model: a run cut short keeps what it measured
        if device != "cpu":
            import cupy
            cupy.get_default_memory_pool().free_all_blocks()
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
