"""Benchmark of the IQ quant types on the CPU: the C core's products beside Q4_K of the same shape, and a 512-token
prompt of a synthetic llama whose matrices are IQ4_XS (and IQ3_S) beside the same model with Q4_K matrices (and llama.cpp's
llama-bench on the same two files when --llama-bench names a CPU build).

Products: a 2048 x 2048 weight (random valid blocks: the time does not depend on the values) times 1 token (decode's
matvec) and 512 tokens (a prompt's product), ms (best of repeated calls) and the ratio to Q4_K in the same run.
Model: llama, n_embd 1024, 4 layers, n_ff 2816, 16 heads of 64, 4 KV heads, F16 embeddings and head; the IQ
files by strata.gguf.iq_quant, the Q4_K file with random valid Q4_K blocks (gguf-py cannot quantize Q4_K); prompt
time of Model.forward on 512 tokens (best of --reps), and llama-bench -p 512 -n 0 -t THREADS on each file.

Usage: PYTHONPATH=. python bench/iq_quant.py [--threads 2] [--types IQ4_XS,IQ3_S,...] [--llama-bench PATH]
Writes bench/results/iq_quant_cpu_<threads>_threads_<commit>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from strata.backend import quant
from strata.gguf import synth

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import best_time as best, commit as bench_commit  # noqa: E402
ALL = ["IQ4_XS", "IQ4_NL", "IQ3_S", "IQ3_XXS", "IQ2_XS", "IQ2_XXS", "IQ2_S", "IQ1_S", "IQ1_M"]


def random_weight(t: T, n_out: int, n_in: int, rng) -> np.ndarray:
    """Random packed blocks with finite, small f16 scales (every quant bit pattern)."""
    blck, size = GGML_QUANT_SIZES[t]
    nb = n_in // blck
    raw = rng.integers(0, 256, size=(n_out, nb, size), dtype=np.uint8)
    d = (rng.uniform(1e-3, 1e-2, (n_out, nb))).astype(np.float16).view(np.uint16)
    if t == T.IQ1_M:
        sc = raw[..., 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for k in range(4):
            sc[..., k] |= ((d >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12)
        raw[..., 48:56] = sc.view(np.uint8)
    else:
        offs = {T.Q4_K: [0, 2]}.get(t, [0])
        for off in offs:
            raw[..., off:off + 2] = d[..., None].view(np.uint8)
    return raw.reshape(n_out, nb * size)


def products(types, threads, rng) -> list[dict]:
    n = 2048
    x1 = rng.standard_normal((1, n)).astype(np.float32)
    x512 = rng.standard_normal((512, n)).astype(np.float32)
    rows = []
    for name in ["Q4_K", *types]:
        t = T[name]
        w = quant.WeightTensor("w", t, (n, n), random_weight(t, n, n, rng))
        r = {"type": name, "shape": [n, n], "bits_per_weight": GGML_QUANT_SIZES[t][1] * 8 / GGML_QUANT_SIZES[t][0],
             "matvec_ms": best(lambda: w.matmul(x1)) * 1e3,
             "prompt512_ms": best(lambda: w.matmul(x512), min_time=1.0) * 1e3}
        rows.append(r)
        print(f"{name:8s} {r['bits_per_weight']:.2f} bpw  matvec {r['matvec_ms']:8.3f} ms   512 tokens "
              f"{r['prompt512_ms']:9.2f} ms", flush=True)
    q4k = rows[0]
    for r in rows:
        r["matvec_vs_q4_k"] = r["matvec_ms"] / q4k["matvec_ms"]
        r["prompt512_vs_q4_k"] = r["prompt512_ms"] / q4k["prompt512_ms"]
    return rows


MODEL = dict(n_embd=1024, n_layer=4, n_ff=2816, n_head=16, n_head_kv=4, head_dim=64, embd_qtype="F16",
             tie_embeddings=False, seed=1)


def write_model(path: Path, qtype: str) -> Path:
    """The synthetic llama with matrices of qtype; Q4_K by random valid blocks (gguf-py has no Q4_K quantizer)."""
    if qtype != "Q4_K":
        return synth.write_synthetic(path, synth.preset("llama", qtype=qtype, **MODEL))
    plain_q, plain_e = synth._qtype_for, synth._encode
    rng = np.random.default_rng(0)
    try:
        synth._qtype_for = lambda s, t: T.Q4_K if t.kind == "mat" else plain_q(s, t)
        synth._encode = lambda x, q: (random_weight(q, int(np.prod(x.shape[:-1])), x.shape[-1], rng)
                                      if q == T.Q4_K else plain_e(x, q))
        return synth.write_synthetic(path, synth.preset("llama", qtype="F16", **MODEL))
    finally:
        synth._qtype_for, synth._encode = plain_q, plain_e


def prompt_time(path: Path, reps: int) -> float:
    from strata.gguf.file import open_gguf
    from strata.models.registry import load_model
    m = load_model(open_gguf(path))
    pool = m.new_page_pool(1024)
    toks = np.random.default_rng(0).integers(0, m.config.n_vocab, 512).astype(np.int32)
    times = []
    for _ in range(reps):
        st = m.new_state(pool)
        t0 = time.perf_counter()
        m.forward(toks, st)
        times.append(time.perf_counter() - t0)
        st.release()
    return float(min(times))


def llama_bench(binary: str, path: Path, threads: int) -> float | None:
    """llama-bench's prompt-processing tokens/s for -p 512 on path (None when it fails)."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).parent / "lib"))
    out = subprocess.run([binary, "-m", str(path), "-p", "512", "-n", "0", "-t", str(threads), "-r", "2", "-o", "json"],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"llama-bench failed on {path.name}: {out.stderr.strip().splitlines()[-1:]}")
        return None
    rows = json.loads(out.stdout[out.stdout.index("["):])
    return float(rows[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(ALL))
    ap.add_argument("--model-types", default="IQ4_XS,IQ3_S", help="the IQ types of the models run beside Q4_K")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, help="a llama.cpp CPU build's llama-bench (its libs in ../lib)")
    ap.add_argument("--no-model", action="store_true")
    a = ap.parse_args()
    quant.set_threads(a.threads)
    rng = np.random.default_rng(0)
    res: dict = {"cpu_path": quant.cpu_path(), "threads": a.threads, "machine": platform.processor() or
                 platform.machine(), "load_average": os.getloadavg()}
    res["products"] = products([t for t in a.types.split(",") if t], a.threads, rng)
    if not a.no_model:
        res["model"] = {"spec": MODEL, "prompt_tokens": 512, "rows": []}
        with tempfile.TemporaryDirectory() as d:
            for q in ("Q4_K", *[t for t in a.model_types.split(",") if t]):
                p = write_model(Path(d) / f"{q}.gguf", q)
                s = prompt_time(p, a.reps)
                row = {"type": q, "file_mib": p.stat().st_size / 2**20, "strata_prompt_s": s,
                       "strata_tok_s": 512 / s}
                if a.llama_bench:
                    row["llama_cpp_tok_s"] = llama_bench(a.llama_bench, p, a.threads)
                res["model"]["rows"].append(row)
                print(f"model {q:7s} strata {row['strata_tok_s']:7.1f} tok/s  llama.cpp "
                      f"{row.get('llama_cpp_tok_s')} tok/s", flush=True)
        base = res["model"]["rows"][0]
        for row in res["model"]["rows"]:
            row["strata_vs_q4_k"] = row["strata_prompt_s"] / base["strata_prompt_s"]
            if row.get("llama_cpp_tok_s"):
                row["strata_time_over_llama_cpp"] = row["llama_cpp_tok_s"] / row["strata_tok_s"]
    res["load_average_end"] = os.getloadavg()
    commit = bench_commit()
    out = ROOT / "bench" / "results" / f"iq_quant_cpu_{a.threads}_threads_{commit}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    main()
