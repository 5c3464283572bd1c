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
and bench/gpu_hybrid_model.py's synthetic models, written into --dir on first use; the llama with its weights
centred, as its long-prompt tests have them: the throughput bench's file overflows float16 in a GPU prompt read of
32+ tokens, which a daemon's warm-up refuses as NaN logits), or GGUF paths.
Usage: PYTHONPATH=. python bench/parallel.py [--device cuda|cpu] [--models default,syn_llama_1_7b,syn_hybrid_1_5b]
       [--ns 1,2,4,8,16] [--steps 16] [--reps 3] [--depth 600] [--threads N] [--out PATH]
       PYTHONPATH=. python bench/parallel.py --e2e 1,2,4 [--models default] [--llama-server PATH] [--e2e-tokens 48]
           [--e2e-remote SPLIT]
Writes bench/results/parallel_step_<device>_<commit>.json (or --out).

--e2e K1,K2,...: the end-to-end arm instead, on --device (the CPU unless it names a GPU): for each K, K concurrent clients stream a completion each
(llama-server's POST /completion, a distinct prompt of about --e2e-prompt tokens, --e2e-tokens tokens) from
`strata serve --parallel K` and, the reference measured in the same run, from `strata serve --parallel 1` (the same K
clients, queued) and from `llama-server --parallel K` on the same GGUF where --llama-server names its binary:
aggregate tok/s (every token of every answer over the burst's wall time), per-request latency, time to first token
and inter-token latency (p50 / p99); at K = 1 also the one client against `strata serve`'s default (--parallel
auto: request slots where they fit), what the default costs a lone user. Writes bench/results/parallel_e2e_<cpu|cuda>_<commit>.json (or --out).
--e2e-remote SPLIT: the remote-stage arms too: the same K clients through `strata serve --parallel K --remote-stage`
and `--parallel 1 --remote-stage` over a `strata worker` on loopback that runs layers SPLIT.. (the main keeps
0..SPLIT and the head; a fresh worker per arm on --device, --threads as the daemon's), beside the local arms of the
same run. Writes bench/results/parallel_e2e_remote_<cpu|cuda>_<commit>.json (or --out).
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
from bench.common import tree_env  # noqa: E402

NS = (1, 2, 4, 8, 16)
MODELS = ("default", "syn_llama_1_7b", "syn_hybrid_1_5b")


def model_path(name: str, folder: Path) -> str:
    """The GGUF of a model name (written into folder on first use for the synthetic ones)."""
    from strata.gguf.default_model import default_model_path
    folder.mkdir(parents=True, exist_ok=True)
    if name == "default":
        return str(default_model_path())
    out = folder / (f"{name}_centred.gguf" if name == "syn_llama_1_7b" else f"{name}.gguf")
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
        return make_synthetic_llama(str(out), tok, dmin=7.5 * 2e-3)
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


# ---- the end-to-end arm: K concurrent clients through a daemon -----------------------------------------------------

def _stream_completion(port: int, prompt: str, n_predict: int) -> dict:
    """One streamed POST /completion (llama-server's route, both servers speak it) -> {"start", "times" (each
    token chunk's arrival, time.perf_counter), "end", "n"}."""
    import http.client
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "stream": True, "temperature": 0,
                       "cache_prompt": False})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/completion", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    times, n = [], 0
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        d = json.loads(line[6:])
        if d.get("stop"):
            n = int(d.get("tokens_predicted", len(times)))
            break
        times.append(time.perf_counter())
    c.close()
    return {"start": t0, "times": times, "end": time.perf_counter(), "n": n or len(times)}


def _pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else None


def _burst(port: int, prompts: list[str], n_predict: int) -> dict:
    """The K prompts sent at once (one thread each) -> the arm's numbers."""
    import threading
    res: list = [None] * len(prompts)

    def run(i):
        res[i] = _stream_completion(port, prompts[i], n_predict)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["times"][0] - r["start"] for r in res if r["times"]]
    itl = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
    lat = [r["end"] - r["start"] for r in res]
    tokens = sum(r["n"] for r in res)
    return {"tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall, "latency_ms_p50": _pct(lat, 50),
            "latency_ms_max": max(lat) * 1e3, "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
            "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99)}


def _wait_port(port: int, proc, timeout: float = 300.0) -> None:
    import http.client
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it answered /health")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not answer /health in time")


def _server(cmd: list[str], port: int, log: Path):
    import subprocess
    env = tree_env(STRATA_DEVICE="cpu")
    f = open(log, "wb")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        _wait_port(port, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def _worker(model: str, threads: int, log: Path, device: str = "cpu"):
    """A `strata worker` on `device` and a free loopback port -> (process, "127.0.0.1:PORT"), once it listens."""
    import subprocess
    env = tree_env(STRATA_DEVICE="cpu")
    f = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli.main", "worker", "--listen", "127.0.0.1:0", "--model",
                             model, "--threads", str(threads), "--device", device, "--log-level", "warning"],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    for line in proc.stderr:
        f.write(line)
        if line.startswith("strata worker listening on"):
            addr = line.strip().rpartition(" ")[2]
            import threading
            threading.Thread(target=lambda: [f.write(x) for x in proc.stderr], daemon=True).start()
            return proc, addr
    proc.wait()
    raise RuntimeError(f"strata worker exited ({proc.returncode}) before it listened; see {log}")


def e2e(model: str, ks: list[int], n_predict: int, prompt_tokens: int, threads: int, llama: str | None,
        folder: Path, device: str = "cpu", remote_split: int | None = None) -> dict:
    """The end-to-end arms for each K -> {K: {"strata_parallel_K", "strata_parallel_1", "llama_server"?, ratios}}
    (K = 1: "strata_parallel_auto" too, the one client against serve's default --parallel auto, and its ratio);
    with remote_split, also "strata_parallel_K_remote" and "strata_parallel_1_remote" (over a worker running layers
    remote_split..) and their ratios."""
    import tempfile

    from daemons import free_port
    words = ("river stone garden lamp winter orange music paper engine cloud silver forest window market "
             "letter bridge candle harbor meadow tower").split()
    rng = np.random.default_rng(1)
    n_ctx = 1024

    out = {}
    tmp = Path(tempfile.mkdtemp(prefix="strata-e2e-"))
    for k in ks:
        prompts = [f"Story {i}: " + " ".join(rng.choice(words, prompt_tokens)) for i in range(k)]
        row = {}
        arms = [(f"strata_parallel_{k}", k), ("strata_parallel_1", 1)] if k > 1 else \
            [("strata_parallel_1", 1), ("strata_parallel_auto", "auto")]      # one client beside serve's default
        if remote_split:
            arms += [(f"{name}_remote", n) for name, n in arms]
        for name, n in arms:
            port = free_port()
            cmd = [sys.executable, "-m", "strata.cli.main", "serve", "--model", model, "--socket", str(tmp / "s.sock"),
                   "--port", str(port), "--n-ctx", str(n_ctx), "--threads", str(threads), "--parallel", str(n),
                   "--queue-max", "64", "--log-level", "warning", "--device", device]
            worker = None
            if name.endswith("_remote"):
                worker, addr = _worker(model, threads, tmp / f"{name}.worker.log", device)
                cmd += ["--remote-stage", addr, "--layer-split", str(remote_split)]
            try:
                proc = _server(cmd, port, tmp / f"{name}.log")
                try:
                    _burst(port, prompts[:1], 4)                 # one request first: what a first request costs
                    row[name] = _burst(port, prompts, n_predict)
                finally:
                    proc.terminate()
                    proc.wait()
            finally:
                if worker is not None:
                    worker.terminate()
                    worker.wait()
            print(f"  K={k} {name}: {row[name]['aggregate_tok_s']:.1f} tok/s, latency p50 "
                  f"{row[name]['latency_ms_p50']:.0f} ms, itl p50 {row[name]['itl_ms_p50'] or 0:.1f} ms", flush=True)
        if llama:
            port = free_port()
            cmd = [llama, "-m", model, "-c", str(n_ctx * k), "-np", str(k), "-t", str(threads), "--port", str(port),
                   "--host", "127.0.0.1", "--log-disable", "-ngl", "0" if device == "cpu" else "99"]
            proc = _server(cmd, port, tmp / "llama.log")
            try:
                _burst(port, prompts[:1], 4)
                row["llama_server"] = _burst(port, prompts, n_predict)
            finally:
                proc.terminate()
                proc.wait()
            print(f"  K={k} llama-server -np {k}: {row['llama_server']['aggregate_tok_s']:.1f} tok/s, latency p50 "
                  f"{row['llama_server']['latency_ms_p50']:.0f} ms", flush=True)
        mine = row.get(f"strata_parallel_{k}", row["strata_parallel_1"])
        row["ratio_vs_parallel_1"] = mine["aggregate_tok_s"] / row["strata_parallel_1"]["aggregate_tok_s"]
        if "strata_parallel_auto" in row:
            row["auto_ratio_vs_parallel_1"] = (row["strata_parallel_auto"]["aggregate_tok_s"]
                                               / row["strata_parallel_1"]["aggregate_tok_s"])
        if "llama_server" in row:
            row["ratio_vs_llama_server"] = mine["aggregate_tok_s"] / row["llama_server"]["aggregate_tok_s"]
        if remote_split:
            rk = row.get(f"strata_parallel_{k}_remote", row["strata_parallel_1_remote"])["aggregate_tok_s"]
            row["remote_ratio_vs_remote_parallel_1"] = rk / row["strata_parallel_1_remote"]["aggregate_tok_s"]
            row["remote_ratio_vs_local_parallel_k"] = rk / mine["aggregate_tok_s"]
        out[str(k)] = row
    return out


def main_e2e(a) -> int:
    from bench.common import commit as bench_commit, host_load
    ks = [int(x) for x in a.e2e.split(",")]
    model = model_path(a.models.split(",")[0], Path(a.dir))
    llama = a.llama_server if a.llama_server and os.path.exists(a.llama_server) else None
    device = a.device or "cpu"
    out = {"what": "bench/parallel.py --e2e", "device": device, "commit": bench_commit(), "model": os.path.basename(model),
           "ks": ks, "n_predict": a.e2e_tokens, "prompt_words": a.e2e_prompt, "threads": a.threads or 2,
           "llama_server": llama, "remote_split": a.e2e_remote, "host_load": host_load()}
    what = "parallel_e2e_remote" if a.e2e_remote else "parallel_e2e"
    dest = Path(a.out) if a.out else ROOT / "bench" / "results" / \
        f"{what}_{'cpu' if device == 'cpu' else 'cuda'}_{out['commit']}.json"
    out["rows"] = e2e(model, ks, a.e2e_tokens, a.e2e_prompt, a.threads or 2, llama, Path(a.dir), device,
                      a.e2e_remote)
    out["host_load_after"] = host_load()
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print(f"wrote {dest}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default) or cpu; with --e2e the CPU unless it names a GPU")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--depth", type=int, default=600)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp") + "/strata-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--e2e", default=None, metavar="K1,K2,...",
                    help="the end-to-end arm: K concurrent clients through the daemon (on --device)")
    ap.add_argument("--e2e-tokens", type=int, default=48)
    ap.add_argument("--e2e-prompt", type=int, default=48, help="words per prompt")
    ap.add_argument("--e2e-remote", type=int, default=None, metavar="SPLIT",
                    help="also the arms over a local strata worker running layers SPLIT.. (--remote-stage)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    help="llama-server's binary: its --parallel K arm beside Strata's (-ngl 99 on a GPU)")
    a = ap.parse_args(argv)
    if a.e2e:
        return main_e2e(a)
    from bench.common import commit as bench_commit, host_load
    a.device = a.device or "cuda:0"
    device = "cpu" if a.device == "cpu" else a.device if ":" in a.device else f"{a.device}:0"
    if device == "cpu" and a.threads:
        from strata.backend import quant
        quant.set_threads(a.threads)
    ns = [int(x) for x in a.ns.split(",")]
    out = {"device": device, "commit": bench_commit(), "ns": ns, "steps": a.steps, "reps": a.reps, "depth": a.depth,
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
