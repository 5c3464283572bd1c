"""nemotron_h (Mamba2 hybrid) on the CPU: prompt and decode tokens/s of a synthetic model, the chunked scan against the
step-by-step scan (the reference, same run), the scan's share of the time, and llama.cpp on the same file when
llama-cpp-python is importable.

The model is ``synth.preset("nemotron_h", --size)`` (default small: n_embd 512, 8 blocks M-M*M-M*, 16 SSM heads of
64, d_state 128, 8 groups; --qtype matrices). Each figure is the best of --repeats runs. Writes JSON to
bench/results/mamba2_cpu_<size>[_blas<OPENBLAS_NUM_THREADS>]_<commit>.json. The chunked scan's batched
products go through OpenBLAS, whose threads stall on oversubscribed cores: compare OPENBLAS_NUM_THREADS=1.

Usage: PYTHONPATH=. python bench/mamba2_cpu.py [--size small] [--qtype Q8_0] [--sizes 128,512] [--decode 32]
       [--repeats 3] [--no-llama]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import commit as bench_commit  # noqa: E402

from strata.backend import mamba2  # noqa: E402
from strata.gguf import synth  # noqa: E402
from strata.models.registry import load_model  # noqa: E402


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


class _ScanClock:
    """Adds up the time spent inside the scan functions while installed."""

    def __init__(self):
        self.s = 0.0
        self._orig = (mamba2.ssm_scan_recurrent, mamba2.ssm_scan_chunked)

    def __enter__(self):
        def wrap(f):
            def run(*a, **k):
                t = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    self.s += time.perf_counter() - t
            return run
        mamba2.ssm_scan_recurrent, mamba2.ssm_scan_chunked = map(wrap, self._orig)
        return self

    def __exit__(self, *exc):
        mamba2.ssm_scan_recurrent, mamba2.ssm_scan_chunked = self._orig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small", "medium"))
    ap.add_argument("--qtype", default="Q8_0")
    ap.add_argument("--sizes", default="128,512")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true")
    a = ap.parse_args()
    spec = synth.preset("nemotron_h", a.size, qtype=a.qtype, embd_qtype=a.qtype, seed=5)
    sizes = [int(s) for s in a.sizes.split(",")]
    commit = bench_commit()
    out: dict = {"model": {"size": a.size, "qtype": a.qtype, "n_embd": spec.n_embd, "pattern": spec.hybrid_pattern,
                           "ssm_heads": spec.n_v_heads, "ssm_head_dim": spec.head_v_dim, "d_state": spec.head_k_dim,
                           "groups": spec.n_k_heads},
                 "commit": commit, "repeats": a.repeats, "prompt": {}, "decode": {},
                 "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as td:
        path = synth.write_synthetic(Path(td) / "nh.gguf", spec)
        m = load_model(path)
        rng = np.random.default_rng(0)
        pool = m.new_page_pool(max(sizes) + a.decode + 64, n_seq=2)
        for n in sizes:
            toks = rng.integers(0, m.config.n_vocab, n).astype(np.int32)
            row = {}
            for mode in ("auto", "recurrent"):
                m.scan_mode = mode

                def read():
                    st = m.new_state(pool)
                    m.forward(toks, st)
                    st.release()
                with _ScanClock() as clk:
                    t = _best(read, a.repeats)
                row[mode] = {"tok_s": n / t, "scan_share": clk.s / a.repeats / t}
            m.scan_mode = "auto"
            row["chunked_vs_recurrent"] = row["auto"]["tok_s"] / row["recurrent"]["tok_s"]
            out["prompt"][n] = row
            print(f"prompt {n}: chunked {row['auto']['tok_s']:.0f} tok/s (scan {row['auto']['scan_share']:.0%}), "
                  f"step-by-step {row['recurrent']['tok_s']:.0f} tok/s (scan {row['recurrent']['scan_share']:.0%}), "
                  f"ratio {row['chunked_vs_recurrent']:.2f}", flush=True)
        toks = rng.integers(0, m.config.n_vocab, 128).astype(np.int32)

        def decode():
            st = m.new_state(pool)
            logits = m.forward(toks, st)
            clk.s = 0.0
            t = time.perf_counter()
            for _ in range(a.decode):
                logits = m.forward(np.array([int(logits.argmax())], np.int32), st)
            decode.t = min(getattr(decode, "t", 1e9), time.perf_counter() - t)
            decode.scan = clk.s
            st.release()
        with _ScanClock() as clk:
            for _ in range(a.repeats):
                decode()
        out["decode"] = {"tok_s": a.decode / decode.t, "scan_share": decode.scan / decode.t}
        print(f"decode after 128: {out['decode']['tok_s']:.1f} tok/s (scan {out['decode']['scan_share']:.0%})")
        if not a.no_llama:
            try:
                import llama_cpp
            except ImportError:
                out["llama_cpp"] = "not importable"
                print("llama.cpp: llama-cpp-python not importable, skipped")
            else:
                llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(sizes) + a.decode + 64, n_batch=512,
                                      n_ubatch=512, n_threads=2, n_gpu_layers=0, verbose=False)
                out["llama_cpp"] = {"version": llama_cpp.__version__, "prompt": {}}
                for n in sizes:
                    toks = rng.integers(0, m.config.n_vocab, n).astype(np.int32).tolist()

                    def lread():
                        llm.reset()
                        llm.eval(toks)
                    t = _best(lread, a.repeats)
                    s = out["prompt"][n]["auto"]["tok_s"]
                    out["llama_cpp"]["prompt"][n] = {"tok_s": n / t, "strata_vs_llama": s / (n / t)}
                    print(f"llama.cpp prompt {n}: {n / t:.0f} tok/s, Strata / llama.cpp {s / (n / t):.2f}")
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    res = ROOT / "bench" / "results" / f"mamba2_cpu_{a.size}{'_blas' + blas if blas else ''}_{commit}.json"
    res.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {res}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
