"""Benchmark of the C core's quantized matmul (strata.backend.quant.WeightTensor.matmul) against numpy fp32 BLAS.

For the default model's tensor shapes (Q4_1 576x576, 1536x576, 576x1536 and the Q8_0 49152x576 output
head) it times decode (n_tokens=1) and prefill (n_tokens=64, 512) and reports GFLOP/s (2*n_out*n_in*n_tokens
per second), GB/s (packed weight bytes per second) and the ratio to ``x @ W.T`` with numpy's BLAS on the
weight dequantized to fp32 (measured in the same run, same thread count for the C core; BLAS uses its
own thread pool). It also sweeps n_tokens to find where the BLAS path (dequantize a tile of rows to fp32,
then np.matmul) beats the Q8 integer kernels; strata.backend.quant.BLAS_MIN_TOKENS is set from that crossover.
Timings are the minimum over repeated calls (the reproducible figure on a shared machine); BLAS timings
are very sensitive to other load on the cores.

Usage: PYTHONPATH=. python bench/matmul.py [--threads N] [--quick]
Writes bench/results/matmul.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from strata.backend import quant
from strata.gguf.default_model import default_model_path


def timeit(fn, min_time=0.3, min_reps=3):
    """Best time of repeated calls (this machine is shared, so the minimum is the reproducible figure)."""
    fn()  # warm-up
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) > 2000:
            break
    return float(np.min(times))


def load_tensors():
    import gguf
    r = gguf.GGUFReader(default_model_path())
    want = {"blk.0.attn_q.weight": "576x576 Q4_1 (attn_q)", "blk.0.ffn_up.weight": "1536x576 Q4_1 (ffn_up)",
            "blk.0.ffn_down.weight": "576x1536 Q4_1 (ffn_down)", "token_embd.weight": "49152x576 Q8_0 (output)"}
    out = []
    for t in r.tensors:
        if t.name in want:
            shape = tuple(int(x) for x in reversed([int(v) for v in t.shape]))
            out.append((want[t.name], quant.WeightTensor(t.name, quant.GGMLQuantizationType(int(t.tensor_type)),
                                                          shape, t.data)))
    order = list(want.values())
    return sorted(out, key=lambda p: order.index(p[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=quant.get_threads())
    ap.add_argument("--quick", action="store_true", help="shorter timings")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "matmul.json"))
    args = ap.parse_args()
    quant.set_threads(args.threads)
    min_time = 0.1 if args.quick else 0.3
    rng = np.random.default_rng(0)
    results = {"cpu_path": quant.cpu_path(), "threads": args.threads, "machine": platform.processor() or platform.machine(),
               "cpu_count": os.cpu_count(), "cases": [], "crossover": []}
    print(f"cpu path {quant.cpu_path()}, {args.threads} threads")
    print(f"{'tensor':28s} {'n_tok':>5s} {'strata ms':>10s} {'GFLOP/s':>8s} {'GB/s':>7s} {'blas ms':>9s} {'blas GFLOP/s':>12s} {'speedup':>8s}")
    tensors = load_tensors()
    for label, w in tensors:
        n_out, n_in = w.shape
        wf = w.dequantize().copy()
        for n_tok in (1, 64, 512):
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            t_s = timeit(lambda: w.matmul(x), min_time)
            t_b = timeit(lambda: x @ wf.T, min_time)
            flop = 2.0 * n_out * n_in * n_tok
            case = {"tensor": label, "n_tokens": n_tok, "strata_s": t_s, "blas_s": t_b,
                    "strata_gflops": flop / t_s / 1e9, "blas_gflops": flop / t_b / 1e9,
                    "strata_weight_gbps": w.nbytes / t_s / 1e9, "blas_weight_gbps": wf.nbytes / t_b / 1e9,
                    "speedup_vs_blas": t_b / t_s}
            results["cases"].append(case)
            print(f"{label:28s} {n_tok:5d} {t_s*1e3:10.3f} {case['strata_gflops']:8.1f} {case['strata_weight_gbps']:7.2f} "
                  f"{t_b*1e3:9.3f} {case['blas_gflops']:12.1f} {case['speedup_vs_blas']:8.2f}")

    # a whole decode step's matmuls: every 2-D weight of the model once with n_tokens = 1
    import gguf
    r = gguf.GGUFReader(default_model_path())
    ws = []
    for t in r.tensors:
        if len(t.shape) == 2:
            shape = tuple(int(x) for x in reversed([int(v) for v in t.shape]))
            ws.append(quant.WeightTensor(t.name, quant.GGMLQuantizationType(int(t.tensor_type)), shape, t.data))
    xs = {w.shape[1]: rng.standard_normal((1, w.shape[1])).astype(np.float32) for w in ws}
    t_tok = timeit(lambda: [w.matmul(xs[w.shape[1]]) for w in ws], min_time)
    nbytes = sum(w.nbytes for w in ws)
    results["decode_all_weights"] = {"n_matmuls": len(ws), "weight_bytes": nbytes, "seconds": t_tok,
                                     "tokens_per_s_matmul_only": 1.0 / t_tok, "weight_gbps": nbytes / t_tok / 1e9}
    print(f"\ndecode step, all {len(ws)} weight matrices (n_tokens=1): {t_tok*1e3:.2f} ms = "
          f"{1/t_tok:.0f} tokens/s from matmuls alone, {nbytes/t_tok/1e9:.1f} GB/s of packed weights")

    # crossover: Q8 integer kernels vs tile-dequantize + BLAS, by n_tokens
    print("\ncrossover (ms): n_tok, Q8 kernels, dequant-tile+BLAS, per tensor")
    saved = quant.BLAS_MIN_TOKENS
    for label, w in tensors:
        n_out, n_in = w.shape
        for n_tok in (4, 8, 16, 32, 48, 64, 96, 128, 256, 512):
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            quant.BLAS_MIN_TOKENS = 1 << 30
            t_q = timeit(lambda: w.matmul(x), min_time / 2)
            quant.BLAS_MIN_TOKENS = 1
            t_b = timeit(lambda: w.matmul(x), min_time / 2)
            results["crossover"].append({"tensor": label, "n_tokens": n_tok, "q8_s": t_q, "blas_tile_s": t_b})
            print(f"{label:28s} {n_tok:5d} {t_q*1e3:9.3f} {t_b*1e3:9.3f} {'BLAS' if t_b < t_q else 'Q8'}")
    quant.BLAS_MIN_TOKENS = saved
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
