"""Float weights (F16, BF16, F32) on the CPU: the C core's float32 products (strata_matmul) against the BLAS route
they took before (F16/BF16: tiles dequantized by the C core, then numpy/OpenBLAS; F32: numpy/OpenBLAS directly),
measured in the same run, at 1 thread (quant.set_threads(1), OPENBLAS_NUM_THREADS=1) and at the default threads
(quant's default, OpenBLAS's own).

Two parts, each best-of-repeats:
  * products: GB/s of weight bytes at n_tokens=1 (decode) and GFLOP/s at 4, 16 and 64 tokens, for a square 2048x2048
    matrix and a 49152x512 output head; ratio = C core / BLAS route;
  * model: decode tok/s of a synthetic nemotron_h (synth.preset("nemotron_h", --size), Q8_0 matrices, F16 token
    embedding and output head) after a 16-token prompt, C core against the BLAS route for its float tensors.
The BLAS route is the old routing reproduced in this process: strata_can_matmul answers 0 for the float types, so
WeightTensor.matmul takes _matmul_blas for them (the quantized types are untouched).

Each thread setting runs in its own subprocess (OpenBLAS reads OPENBLAS_NUM_THREADS at load).
Usage: PYTHONPATH=. python bench/float_matmul_cpu.py [--size small] [--decode 32] [--repeats 3] [--quick]
Writes bench/results/float_matmul_cpu_<commit>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import best_time as best, commit as bench_commit, host_load, write_result  # noqa: E402

from strata.backend import quant  # noqa: E402
from strata.backend.quant import T, WeightTensor  # noqa: E402

FLOAT = (int(T.F32), int(T.F16), int(T.BF16))


class _BlasRoute:
    """The C core's cffi lib, except that strata_can_matmul refuses the float types (their old route: BLAS)."""

    def __init__(self, lib):
        self._lib = lib

    def strata_can_matmul(self, t):
        return 0 if int(t) in FLOAT else self._lib.strata_can_matmul(t)

    def __getattr__(self, name):
        return getattr(self._lib, name)


@contextlib.contextmanager
def route(kind: str):
    """kind "c": the code as it is; "blas": the float types' old BLAS route."""
    saved = quant._lib
    if kind == "blas":
        quant._lib = _BlasRoute(saved)
    try:
        yield
    finally:
        quant._lib = saved


def weight(t: T, n_out: int, n_in: int, rng) -> WeightTensor:
    f = (rng.standard_normal((n_out, n_in)) * 0.02).astype(np.float32)
    data = f if t == T.F32 else f.astype(np.float16) if t == T.F16 else (f.view(np.uint32) >> 16).astype(np.uint16)
    return WeightTensor(f"w{n_out}x{n_in}", t, (n_out, n_in), data)


def products(quick: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    shapes = [(2048, 2048), (49152, 512)]
    for t in (T.F16, T.BF16, T.F32):
        for n_out, n_in in shapes:
            w = weight(t, n_out, n_in, rng)
            for n in ((1, 16) if quick else (1, 4, 16, 64)):
                x = rng.standard_normal((n, n_in)).astype(np.float32)
                r = {"type": t.name, "shape": f"{n_out}x{n_in}", "n_tokens": n}
                for kind in ("c", "blas"):
                    w._fast_cache = None
                    with route(kind):
                        s = best(lambda: w.matmul(x), 0.2 if quick else 0.5)
                    r[kind] = {"ms": s * 1e3, "GB_s": w.nbytes / s / 1e9, "GFLOP_s": 2 * n_out * n_in * n / s / 1e9}
                r["c_vs_blas"] = r["blas"]["ms"] / r["c"]["ms"]
                unit = "GB_s" if n == 1 else "GFLOP_s"
                print(f"  {t.name:4s} {r['shape']:>10s} n={n:<3d} C {r['c'][unit]:7.2f} {unit}, BLAS route "
                      f"{r['blas'][unit]:7.2f}: x{r['c_vs_blas']:.2f}", flush=True)
                rows.append(r)
    return rows


def model_decode(size: str, n_decode: int, repeats: int) -> dict:
    from strata.gguf import synth
    from strata.models.registry import load_model
    spec = synth.preset("nemotron_h", size, qtype="Q8_0", embd_qtype="F16", seed=5)
    out = {"size": size, "qtype": "Q8_0", "embd_and_output": "F16", "n_embd": spec.n_embd, "n_layer": spec.n_layer,
           "prompt": 16, "decode": n_decode}
    with tempfile.TemporaryDirectory() as td:
        path = synth.write_synthetic(Path(td) / "nh.gguf", spec)
        m = load_model(path)
        pool = m.new_page_pool(16 + n_decode + 64, n_seq=1)
        toks = np.random.default_rng(0).integers(0, m.config.n_vocab, 16).astype(np.int32)
        for kind in ("c", "blas"):
            for w in _tensors(m):
                w._fast_cache = None
            with route(kind):
                best_t, gen = float("inf"), None
                for _ in range(repeats):
                    st = m.new_state(pool)
                    logits = m.forward(toks, st)
                    ids = []
                    t0 = time.perf_counter()
                    for _ in range(n_decode):
                        ids.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
                        logits = m.forward(np.array([ids[-1]], np.int32), st)
                    best_t = min(best_t, time.perf_counter() - t0)
                    st.release()
                    gen = ids
            out[kind] = {"tok_s": n_decode / best_t, "tokens": gen[:8]}
        out["c_vs_blas"] = out["c"]["tok_s"] / out["blas"]["tok_s"]
        out["same_tokens"] = out["c"]["tokens"] == out["blas"]["tokens"]
    print(f"  nemotron_h {size} (Q8_0, F16 head) decode: C {out['c']['tok_s']:.1f} tok/s, BLAS route "
          f"{out['blas']['tok_s']:.1f} tok/s: x{out['c_vs_blas']:.2f} (same first tokens: {out['same_tokens']})",
          flush=True)
    return out


def _tensors(m):
    seen = set()
    stack = [m]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, WeightTensor):
            yield o
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and type(o).__module__.startswith("strata"):
            stack.extend(vars(o).values())


def child(a) -> dict:
    if a.threads:
        quant.set_threads(a.threads)
    print(f"threads: C core {quant.get_threads()}, OpenBLAS {os.environ.get('OPENBLAS_NUM_THREADS', 'default')}, "
          f"kernel set {quant.cpu_path()}", flush=True)
    res = {"c_threads": quant.get_threads(), "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
           "cpu_path": quant.cpu_path(), "products": products(a.quick)}
    res["model"] = model_decode(a.size, a.decode, a.repeats)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small", "medium"))
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        Path(a.child).write_text(json.dumps(child(a)))
        return 0
    out = {"commit": bench_commit(), "host": host_load(), "runs": []}
    for threads in (1, 0):
        env = dict(os.environ)
        env.pop("OPENBLAS_NUM_THREADS", None)
        if threads:
            env["OPENBLAS_NUM_THREADS"] = str(threads)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--child", f.name, "--threads", str(threads), "--size", a.size,
                   "--decode", str(a.decode), "--repeats", str(a.repeats)] + (["--quick"] if a.quick else [])
            subprocess.run(cmd, env=env, check=True)
            out["runs"].append(json.loads(Path(f.name).read_text()))
    write_result(out, f"float_matmul_cpu_{a.size}_{out['commit']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
