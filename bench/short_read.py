"""Model time of a short read: n new tokens of one sequence at a depth, beside a decode step, llama-bench and the
weight-pass bound, on CUDA or the CPU.

For each model, depth d (a random d-token context, captured once and restored before every read) and n in --ns: the
best of --reps times of one forward of n random tokens as the engine calls it (CudaBackend.fast_path's PlanModel on
CUDA: the short read up to the plan's crossover, measured first as the engine's warm-up measures it
(DecodePlan.measure_short_read, "crossover"), the cuBLAS prefill above; the model on the CPU), the host logits of
the last token included; n = 1 is a decode step. On CUDA, for n = 2..16, the other side of the crossover is timed
too: the plan's cuBLAS prefill ("gemm_ms") where the short read was taken, the short read ("short_ms") where
not. Beside them:
llama-bench -p n -d d on the same file (--llama-bench; n / its tokens per second) and the weight-pass bound (the
bytes of every weight matrix a token's forward reads, the head and one embedding row / the copy bandwidth measured
in the same run: a 2 GiB device-to-device copy, or a 1 GiB host copy on the CPU).

Models: 'default' (the default model), 'syn_llama_1_7b' and 'syn_hybrid_1_5b' (bench/gpu_throughput.py's and
bench/gpu_hybrid_model.py's synthetic models, written into --dir on first use), or GGUF paths.

--arm NAME=TREE (twice or more): an A/B of source trees instead (e.g. before=/tmp/main after=.), for a shared machine
whose load swings between minutes: --rounds rounds, each running every arm's own bench/short_read.py once in a fresh
process (the order rotated by the round, so each arm takes each place equally often), and in the first and the last
round llama-bench (--llama-bench) on each model; per cell the best of all rounds ("ms"), every round's best ("rounds_ms") for the
spread, the ratio to the first arm and, per arm, to its own decode step.
Usage: PYTHONPATH=. python bench/short_read.py [--device cuda|cpu] [--models default,syn_llama_1_7b,syn_hybrid_1_5b]
       [--ns 1,2,4,...,512] [--depths 0,4096,16384] [--llama-bench BIN] [--reps 3] [--threads N] [--out PATH]
       [--arm NAME=TREE --arm NAME=TREE [--rounds 3]]
Writes bench/results/short_read_<device>_<commit>.json (or --out); with arms short_read_ab_<device>_<commit>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

NS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEPTHS = (0, 4096, 16384)
MODELS = ("default", "syn_llama_1_7b", "syn_hybrid_1_5b")


def weight_bytes(model) -> int:
    """Bytes of the weight matrices one token's forward reads: every layer's 2-D tensors (the MoE-free families the
    bench runs), the output head, one embedding row."""
    seen: set[int] = set()

    def tensors(obj, depth=0):
        if depth > 3 or obj is None:
            return
        if hasattr(obj, "nbytes") and getattr(obj, "ggml_type", None) is not None:
            if id(obj) not in seen and len(getattr(obj, "shape", ())) == 2:
                seen.add(id(obj))
                yield int(obj.nbytes)
            return
        if isinstance(obj, (list, tuple)):
            for o in obj:
                yield from tensors(o, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, np.ndarray):
            for o in vars(obj).values():
                yield from tensors(o, depth + 1)

    total = sum(b for L in model.layers[:model.config.n_layer] for b in tensors(L))
    total += int(model.output.nbytes) + int(model.tok_embd.nbytes) // max(1, model.config.n_vocab)
    return total


def host_bandwidth() -> float:
    """Host memory copy bandwidth in bytes/s (read + write), best of 5 copies of 1 GiB."""
    a = np.ones(1 << 28, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


def bench_model(path: str, device: str, ns, depths, reps: int, bw: float, threads: int) -> dict:
    """{"weight_bytes", "weight_pass_ms", "crossover"?, "rows": {depth: {n: {"ms", "gemm_ms"?, "short_ms"?}}}} for
    one model (see the module docstring); on the CPU, a hybrid's reads of 2..16 tokens are timed with the chunked
    delta rule too ("chunked_ms": what the exactness contract's token-by-token step replaces)."""
    from strata.backend import quant
    from strata.models.registry import load_model
    if device == "cuda":
        import cupy as cp
        from strata.backend.cuda import CudaBackend
        from strata.backend.cuda import settings as S
        model = load_model(path, CudaBackend())
        fast = model.backend.fast_path(model)
        sync = cp.cuda.Device().synchronize
    else:
        from strata.backend.cpu import CPUBackend
        quant.set_threads(threads)
        model = load_model(path, CPUBackend())
        fast, S = model, None
        sync = lambda: None  # noqa: E731
    rng = np.random.default_rng(0)
    vocab = model.config.n_vocab
    pool = fast.new_page_pool(max(depths) + max(ns) + 512)
    st = model.new_state(pool)
    plan = fast.plan(pool) if hasattr(fast, "plan") else None
    wb = weight_bytes(model)
    res = {"weight_bytes": wb, "weight_pass_ms": 1e3 * wb / bw, "runner": type(fast).__name__, "rows": {}}

    def read(toks):
        for s in range(0, len(toks), 512):
            fast.forward(np.asarray(toks[s:s + 512], np.int32), st)

    def timed(run, snap) -> float:
        best = float("inf")
        for _ in range(reps + 1):                        # the first run captures graphs / warms cuBLAS
            st.restore(snap)
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    read(rng.integers(0, vocab, 600))                    # warm-up
    if plan is not None:                                 # the crossover as the engine's warm-up measures it
        st.reset()
        res["crossover"] = fast.measure_short_read(st)
        print(f"  crossover (measured at position 0): {res['crossover']}", flush=True)
    for d in depths:
        st.reset()
        if d:
            read(rng.integers(0, vocab, d))
        snap = st.capture()
        row = res["rows"][str(d)] = {}
        for n in ns:
            toks = rng.integers(0, vocab, n).astype(np.int32)
            e = row[str(n)] = {"ms": 1e3 * timed(lambda: fast.forward(toks, st), snap)}
            if plan is not None and 1 < n <= S.SHORT_READ_COLS and plan.short_form() is not None:
                if not plan.takes_short_read(n):
                    e["short_ms"] = 1e3 * timed(lambda: plan.short_read(toks, st), snap)
                elif plan.takes_prefill(n):
                    e["gemm_ms"] = 1e3 * timed(lambda: plan.prefill(toks, st), snap)
            if device == "cpu" and hasattr(model, "gdn_mode") and 1 < n <= quant.ROWWISE_MAX_TOKENS:
                mode0, model.gdn_mode = model.gdn_mode, "chunked"     # the contract's cost: the batched rule
                e["chunked_ms"] = 1e3 * timed(lambda: fast.forward(toks, st), snap)
                model.gdn_mode = mode0
            print(f"  d{d} n{n}: {e['ms']:.3f} ms" + (f" (cuBLAS prefill {e['gemm_ms']:.3f} ms)" if "gemm_ms" in e
                                                      else "") +
                  (f" (short read {e['short_ms']:.3f} ms)" if "short_ms" in e else ""), flush=True)
    return res                 # the model's device memory goes with this frame (main frees CuPy's pool after)


def rowwise_cost(ns, threads: int, shapes=((49152, 576), (4096, 4096))) -> dict:
    """The CPU contract's cost on F16 weights (BLAS products one row at a time up to quant.ROWWISE_MAX_TOKENS):
    {shape: {n: {"rowwise_ms", "batched_ms"}}}, best of 3 each."""
    from strata.backend import quant
    from strata.backend.quant import WeightTensor
    from gguf import GGMLQuantizationType as T
    quant.set_threads(threads)
    rng = np.random.default_rng(1)
    out = {}
    for n_out, n_in in shapes:
        w = WeightTensor("w", T.F16, (n_out, n_in), rng.standard_normal((n_out, n_in)).astype(np.float16))
        row = out[f"{n_out}x{n_in}"] = {}
        for n in (n for n in ns if 1 < n <= quant.ROWWISE_MAX_TOKENS):
            x = rng.standard_normal((n, n_in)).astype(np.float32)
            r = {}
            for kind, lim in (("rowwise_ms", quant.ROWWISE_MAX_TOKENS), ("batched_ms", 0)):
                lim0, quant.ROWWISE_MAX_TOKENS = quant.ROWWISE_MAX_TOKENS, lim
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    w.matmul(x)
                    best = min(best, time.perf_counter() - t0)
                quant.ROWWISE_MAX_TOKENS = lim0
                r[kind] = 1e3 * best
            row[str(n)] = r
            print(f"  F16 {n_out}x{n_in} n{n}: row by row {r['rowwise_ms']:.2f} ms, batched {r['batched_ms']:.2f} ms",
                  flush=True)
    return out


def bench_llama(bin_path: str, path: str, device: str, ns, depths, threads: int) -> dict:
    """llama-bench -p n -d depth on the same file: {depth: {n: ms}} (n / avg tokens per second), n = 1 as -n 1."""
    out: dict = {"cmd": [], "rows": {}}
    dev = ["-ngl", "99", "-fa", "1"] if device == "cuda" else ["-ngl", "0", "-t", str(threads)]
    pp = [n for n in ns if n > 1]
    for d in depths:
        runs = ([["-p", ",".join(map(str, pp)), "-n", "0"]] if pp else []) + \
            ([["-p", "0", "-n", "16"]] if 1 in ns else [])
        for extra in runs:
            cmd = [bin_path, "-m", path, *dev, "-d", str(d), "-ub", "512", "-b", "2048", "-r", "3", "-o", "json",
                   *extra]
            out["cmd"].append(" ".join(cmd))
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                out.setdefault("errors", []).append(p.stderr[-1500:])
                print("  llama-bench failed:", p.stderr[-600:], flush=True)
                continue
            for r in json.loads(p.stdout):
                n = r["n_prompt"] or 1
                out["rows"].setdefault(str(d), {})[str(n)] = 1e3 * (n if r["n_prompt"] else 1) / r["avg_ts"]
    return out


def run_arms(a, paths: dict, dev_name: str) -> int:
    """The --arm A/B (module docstring): every arm's bench in a fresh process per round, llama-bench per round."""
    import tempfile
    from bench.common import commit as bench_commit, host_load, tree_env
    arms = []
    for spec in a.arm:
        name, _, tree = spec.partition("=")
        if not name or not tree or not (Path(tree) / "bench" / "short_read.py").exists():
            raise SystemExit(f"--arm {spec!r}: expected NAME=TREE with TREE/bench/short_read.py")
        arms.append((name, str(Path(tree).resolve())))
    ns = [int(x) for x in a.ns.split(",") if x]
    depths = [int(x) for x in a.depths.split(",") if x]
    out = {"commit": bench_commit(), "device": dev_name, "arms": dict(arms), "ns": ns, "depths": depths, "reps": a.reps,
           "rounds": a.rounds, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "host_at_start": host_load(), "runs": {n: [] for n, _ in arms}, "llama.cpp": {}}
    tmp = Path(tempfile.mkdtemp(prefix="short_read_ab_"))
    for r in range(a.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for name, tree in order:
            dest = tmp / f"{name}_{r}.json"
            cmd = [sys.executable, str(Path(tree) / "bench" / "short_read.py"), "--device", a.device,
                   "--models", ",".join(paths.values()), "--ns", a.ns, "--depths", a.depths, "--reps", str(a.reps),
                   "--threads", str(a.threads), "--out", str(dest)]
            print(f"round {r + 1}/{a.rounds}: {name} ({tree})", flush=True)
            p = subprocess.run(cmd, cwd=tree, env=tree_env(tree), capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"arm {name} failed:\n{p.stderr[-2000:]}")
            out["runs"][name].append(json.loads(dest.read_text()))
        if a.llama_bench and os.path.exists(a.llama_bench) and r in (0, a.rounds - 1):   # first and last round
            for m, path in paths.items():
                out["llama.cpp"].setdefault(m, []).append(bench_llama(a.llama_bench, path, a.device, ns, depths,
                                                                      a.threads))
    out["host_at_end"] = host_load()
    # per cell: best over rounds, each round's best, ratio to the first arm
    table: dict = {}
    for m, path in paths.items():
        for name, _ in arms:
            for d in map(str, depths):
                for n in map(str, ns):
                    vals = [run["models"][path]["strata"]["rows"][d][n]["ms"] for run in out["runs"][name]]
                    table.setdefault(m, {}).setdefault(d, {}).setdefault(n, {})[name] = {
                        "ms": min(vals), "rounds_ms": vals}
        for d in map(str, depths):
            for n in map(str, ns):
                lc = [e["rows"].get(d, {}).get(n) for e in out["llama.cpp"].get(m, [])]
                lc = [v for v in lc if v]
                if lc:
                    table[m][d][n]["llama.cpp"] = {"ms": min(lc), "rounds_ms": lc}
    out["table"] = table
    dest = Path(a.out) if a.out else \
        ROOT / "bench" / "results" / f"short_read_ab_{dev_name.replace(' ', '_')}_{out['commit']}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    first = arms[0][0]
    print(f"\nsummary: ms per read, best of {a.rounds} rounds [range of the rounds' bests]; x step = over the arm's "
          f"own decode step (n = 1) at that depth; x {first} = over the first arm; llama = llama-bench")
    for m, rows in table.items():
        print(m)
        for d, row in rows.items():
            for n, cell in row.items():
                parts = []
                for name, _ in arms:
                    c, step = cell[name], row["1"][name]["ms"]
                    parts.append(f"{name} {c['ms']:8.2f} [{min(c['rounds_ms']):.1f}-{max(c['rounds_ms']):.1f}] "
                                 f"x step {c['ms'] / step:5.2f} x {first} {c['ms'] / cell[first]['ms']:4.2f}")
                lc = cell.get("llama.cpp", {}).get("ms")
                print(f"  d{d:>6} n{n:>4}: " + " | ".join(parts) +
                      (f" | llama {lc:8.2f} x llama {cell[arms[-1][0]]['ms'] / lc:5.2f}" if lc else ""))
    print("wrote", dest)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dir", default="/tmp/greedy_models", help="where the synthetic models are written")
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu; llama-bench -t)")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (a CUDA build for --device cuda)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=TREE",
                    help="a source tree to A/B (twice or more; module docstring)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the --arm A/B")
    a = ap.parse_args(argv)
    if a.arm and len(a.arm) < 2:
        ap.error("--arm: name two trees or more")
    from bench.common import commit as bench_commit, host_load  # noqa: E402
    from bench.gpu_throughput import copy_bandwidth
    from strata.gguf.default_model import default_model_path
    from tools.greedy_tokens import model_path
    ns = [int(x) for x in a.ns.split(",") if x]
    depths = [int(x) for x in a.depths.split(",") if x]
    os.makedirs(a.dir, exist_ok=True)
    paths = {m: str(default_model_path()) if m == "default" else model_path(m, Path(a.dir))
             for m in a.models.split(",") if m}
    if a.device == "cuda":
        import cupy as cp
        props = cp.cuda.runtime.getDeviceProperties(0)
        dev_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        bw = copy_bandwidth(cp)
    else:
        dev_name = f"cpu_{a.threads}_threads"
        if a.arm:                                        # each arm's process measures its own bandwidth
            return run_arms(a, paths, dev_name)
        bw = host_bandwidth()
    if a.arm:
        return run_arms(a, paths, dev_name)
    print(f"{dev_name}: copy bandwidth {bw / 1e9:.1f} GB/s", flush=True)
    out = {"commit": bench_commit(), "device": dev_name, "copy_bandwidth_Bps": bw, "ns": ns, "depths": depths,
           "reps": a.reps, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host_at_start": host_load(),
           "models": {}}
    for name, path in paths.items():
        print(f"model {name} ({path})", flush=True)
        e = out["models"][name] = {"path": path, "strata": bench_model(path, a.device, ns, depths, a.reps, bw,
                                                                       a.threads)}
        if a.device == "cuda":
            cp.get_default_memory_pool().free_all_blocks()
        if a.llama_bench and os.path.exists(a.llama_bench):
            e["llama.cpp"] = bench_llama(a.llama_bench, path, a.device, ns, depths, a.threads)
    if a.device == "cpu":
        print("the CPU contract's cost on F16 weights", flush=True)
        out["f16_rowwise_cost"] = rowwise_cost(ns, a.threads)
    out["host_at_end"] = host_load()
    dest = Path(a.out) if a.out else \
        ROOT / "bench" / "results" / f"short_read_{dev_name.replace(' ', '_')}_{out['commit']}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print("\nsummary: ms per read; x step = over the decode step (n = 1) at that depth; x bound = over the "
          "weight-pass bound; x llama = Strata / llama-bench")
    for name, e in out["models"].items():
        s = e["strata"]
        bound = s["weight_pass_ms"]
        ref = e.get("llama.cpp", {}).get("rows", {})
        print(f"{name}: weight pass {bound:.3f} ms ({s['weight_bytes'] / 1e6:.0f} MB), crossover "
              f"{s.get('crossover')}")
        for d, row in s["rows"].items():
            step = row.get("1", {}).get("ms")
            for n, r in row.items():
                lc = ref.get(d, {}).get(n)
                g = f"  cuBLAS {r['gemm_ms']:8.3f}" if "gemm_ms" in r else \
                    f"  short read {r['short_ms']:8.3f}" if "short_ms" in r else \
                    f"  chunked GDN {r['chunked_ms']:8.3f}" if "chunked_ms" in r else ""
                print(f"  d{d:>6} n{n:>4}: {r['ms']:8.3f} ms  x step {r['ms'] / step if step else float('nan'):6.2f}"
                      f"  x bound {r['ms'] / bound:6.2f}  llama {lc or float('nan'):8.3f}"
                      f"  x llama {r['ms'] / lc if lc else float('nan'):5.2f}{g}")
    print("wrote", dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
