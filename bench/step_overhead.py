"""The host's work per batched decode step (--parallel N): each engine step's wall time split into the forward call(s)
(strata.stages.batch.decode_batch, or a lone slot's Decoder.read) and everything else the engine thread does (the
plan, sampling each row, the request generators, detokenizing and stop strings, events, turn clocks, stats), per step
and per token, in microseconds, at N = 1, 2, 4, 8 concurrent requests through the real engine (Engine(parallel=N),
admit + step); a cProfile of the host part (the forward calls not profiled) at one N; and, with --e2e, the daemon end
to end (bench/parallel.py's streaming clients) with each daemon thread's CPU time per token.

Before / after in the same run: --baseline REV runs every arm on a copy of git revision REV too (extracted into a
temporary folder, the C core's built modules copied in: refused when native/ or setup.py differ from this tree's),
the two trees alternating round by round (each round a fresh process per tree); the medians over --reps rounds.

Model: 'default' (the default model) or a GGUF path; --threads C-core threads (1 by default: the host work is what is
measured, and the machine may be shared). Greedy answers of every N are checked equal to each request alone.
Usage: PYTHONPATH=. python bench/step_overhead.py [--ns 1,2,4,8] [--tokens 48] [--prompt 32] [--reps 3]
       [--baseline REV] [--profile-n 4] [--device cpu|cuda] [--e2e 1,4] [--e2e-tokens 48] [--e2e-reps 1]
       [--e2e-slots 4] [--out PATH]
With --e2e, K = 1 runs against --parallel 1 and --parallel --e2e-slots (one client through the slots' loop).
Writes bench/results/step_overhead_<device>_<commit>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


# ---- one tree's engine arm (run in a child process: `--child`, PYTHONPATH = that tree) ----------------------------

def _engine_arm(model: str, ns: list[int], tokens: int, prompt_len: int, threads: int, profile_n: int,
                device: str = "cpu") -> dict:
    """For each N: N requests (distinct prompts of prompt_len tokens, tokens each, greedy) admitted together and
    stepped until all end -> {N: {"steps", "tokens", "step_us", "forward_us", "host_us_per_step",
    "host_us_per_token"}} over the steps where all N decode (medians of per-step values; the per-token host time
    is the steps' host time over their tokens), and "alone": the same numbers per token of each request run alone
    (Engine.generate, what --parallel 1 serves; the reference's tokens after each first, the first request's
    left out as a warm-up); greedy answers checked equal to each request alone. With profile_n in
    ns, a cProfile of that N's host part (the forward calls disabled in the profiler): the top functions. On a GPU the
    forward's time runs until the device has finished it (a synchronize in the timed call), so the host part is the
    host's own work and the waits it adds."""
    import cProfile
    import pstats

    import strata.engine.scheduler as sched
    from strata.engine.decode import Decoder
    from strata.engine.engine import Engine
    from strata.engine.types import FinalEvent, GenerationRequest

    fwd = [0.0]
    prof: list = [None]           # the profiler while it runs (a step being profiled)
    real_batch, real_read = sched.decode_batch, Decoder.read
    sync = (lambda: __import__("cupy").cuda.Device().synchronize()) if device != "cpu" else (lambda: None)

    def timed(fn):
        def f(*a, **k):
            p = prof[0]
            if p is not None:
                p.disable()
            t0 = time.perf_counter()
            try:
                out = fn(*a, **k)
                sync()
                return out
            finally:
                fwd[0] += time.perf_counter() - t0
                if p is not None:
                    p.enable()
        return f
    sched.decode_batch = timed(real_batch)
    Decoder.read = timed(real_read)

    rng = np.random.default_rng(7)
    kw = dict(n_ctx=max(256, prompt_len + tokens + 16), device=device, threads=threads, conversation_cache_mib=0,
              prompt_cache=0)
    prompts = [[int(t) for t in rng.integers(100, 20000, prompt_len)] for _ in range(max(ns))]
    alone = Engine(model, **kw)
    refs, lone = [], []
    for p in prompts:
        req = GenerationRequest(prompt_tokens=list(p), max_tokens=tokens, ignore_eos=True, cache_prompt=False,
                                checkpoint=False)
        ids, marks = [], []
        fwd[0] = 0.0
        for ev in alone.generate(req):
            if not isinstance(ev, FinalEvent):
                ids.append(ev.token_id)
                marks.append((time.perf_counter(), fwd[0]))
        refs.append(ids)
        # the lone path (what --parallel 1 runs): each token after the first, its wall time less its forward's
        lone += [((t1 - t0), (f1 - f0)) for (t0, f0), (t1, f1) in zip(marks, marks[1:])]
    alone.close()
    lone = lone[len(lone) // max(1, len(prompts)):]        # the first prompt's tokens warm up
    out = {"alone": {"steps": len(lone), "tokens": len(lone), "step_us": float(np.median([x[0] for x in lone]) * 1e6),
                     "forward_us": float(np.median([x[1] for x in lone]) * 1e6),
                     "host_us_per_step": float(np.median([x[0] - x[1] for x in lone]) * 1e6),
                     "host_us_per_token": float(np.median([x[0] - x[1] for x in lone]) * 1e6)}} if lone else {}
    for n in ns:
        eng = Engine(model, parallel=n, **kw)
        profiled, rows = 0, []
        for rnd in range(3 if n == profile_n else 2):     # round 0 warms up, round 1 is measured, round 2 profiled
            got = {i: [] for i in range(n)}
            done: dict = {}
            for i in range(n):
                req = GenerationRequest(prompt_tokens=list(prompts[i]), max_tokens=tokens, ignore_eos=True,
                                        cache_prompt=False, checkpoint=False, id_slot=i)
                eng.admit(req, (lambda i: lambda ev: None if isinstance(ev, FinalEvent)
                                else got[i].append(ev.token_id))(i), lambda err, i=i: done.__setitem__(i, err))
            measured: list = []
            profiler = cProfile.Profile() if rnd == 2 else None
            while True:
                before = sum(len(v) for v in got.values())
                all_decoding = all(len(v) > 0 for v in got.values()) and len(done) == 0
                fwd[0] = 0.0
                p = profiler if all_decoding else None      # the profile: steps where every request decodes
                prof[0] = p
                if p is not None:
                    profiled += 1
                    p.enable()
                t0 = time.perf_counter()
                ran = eng.step()
                dt = time.perf_counter() - t0
                if p is not None:
                    p.disable()
                prof[0] = None
                if not ran:
                    break
                emitted = sum(len(v) for v in got.values()) - before
                if rnd == 1 and all_decoding and len(done) == 0 and emitted == n:
                    measured.append((dt, fwd[0], emitted))
            assert all(e is None for e in done.values()), done
            if rnd == 1:
                rows = measured
            assert [got[i] for i in range(n)] == refs[:n], f"--parallel {n} changed a greedy answer"
        eng.close()
        dt = np.array([r[0] for r in rows])
        fw = np.array([r[1] for r in rows])
        host = dt - fw
        e = out[str(n)] = {"steps": len(rows), "tokens": int(sum(r[2] for r in rows)),
                           "step_us": float(np.median(dt) * 1e6), "forward_us": float(np.median(fw) * 1e6),
                           "host_us_per_step": float(np.median(host) * 1e6),
                           "host_us_per_token": float(np.median(host) * 1e6 / n)}
        if profiled:
            st = pstats.Stats(profiler)
            total = st.total_tt
            top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:25]     # by own time
            e["profile"] = {"host_us_per_step_profiled": total * 1e6 / profiled,
                            "top_own_time": [{"fn": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "calls": v[1],
                                              "own_us_per_step": v[2] * 1e6 / profiled,
                                              "cum_us_per_step": v[3] * 1e6 / profiled}
                                             for k, v in top]}
    return out


# ---- trees, rounds, the e2e arm ------------------------------------------------------------------------------------

def _baseline_tree(rev: str) -> Path:
    """A copy of git revision `rev` in a temporary folder with this tree's built C core (its native/ and setup.py
    the same as this tree's: SystemExit otherwise)."""
    diff = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", rev, "--", "native", "setup.py"])
    if diff.returncode != 0:
        raise SystemExit(f"--baseline {rev}: its native/ or setup.py differ from this tree's (build it apart)")
    dest = Path(tempfile.mkdtemp(prefix="strata-stepcost-base-"))
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    for so in (ROOT / "strata").rglob("*.so"):
        target = dest / so.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target)
    return dest


def _child(tree: Path, args) -> dict:
    from bench.common import tree_env
    env = tree_env(tree)
    cmd = [sys.executable, str(ROOT / "bench" / "step_overhead.py"), "--child", "--model", args.model_path,
           "--ns", args.ns, "--tokens", str(args.tokens), "--prompt", str(args.prompt), "--threads", str(args.threads),
           "--profile-n", str(args.profile_n), "--device", args.device]
    r = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the engine arm failed in {tree}:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _thread_cpu(pid: int) -> dict[int, float]:
    """Seconds of CPU each thread of process `pid` has run (schedstat's run time), by thread id."""
    out: dict[int, float] = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(t.name)] = int((t / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError):
            continue
    return out


def _e2e_arm(tree: Path, model: str, k: int, parallel: int, n_predict: int, threads: int, device: str = "cpu") -> dict:
    """K streaming clients against `strata serve --parallel P` from `tree` -> bench/parallel.py's burst numbers and
    each daemon thread's CPU seconds per token over the burst (the engine thread, the event loop's, the rest)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import parallel as par
    from daemons import free_port
    words = ("river stone garden lamp winter orange music paper engine cloud silver forest window market "
             "letter bridge candle harbor meadow tower").split()
    rng = np.random.default_rng(1)
    prompts = [f"Story {i}: " + " ".join(rng.choice(words, 48)) for i in range(k)]
    tmp = Path(tempfile.mkdtemp(prefix="strata-stepcost-e2e-"))
    port = free_port()
    cmd = [sys.executable, "-m", "strata.cli.main", "serve", "--model", model, "--socket", str(tmp / "s.sock"),
           "--port", str(port), "--n-ctx", "1024", "--threads", str(threads), "--parallel", str(parallel),
           "--queue-max", "64", "--log-level", "warning", "--device", device]
    from bench.common import tree_env
    env = tree_env(tree, STRATA_DEVICE=device)
    with open(tmp / "serve.log", "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(tree))
    try:
        par._wait_port(port, proc)
        par._burst(port, prompts[:1], 4)
        c0 = _thread_cpu(proc.pid)
        row = par._burst(port, prompts, n_predict)
        c1 = _thread_cpu(proc.pid)
    finally:
        proc.terminate()
        proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)
    cpu = {tid: c1[tid] - c0.get(tid, 0.0) for tid in c1}
    main = cpu.pop(proc.pid, 0.0)                     # the main thread runs the event loop
    busiest = max(cpu, key=cpu.get) if cpu else None  # the engine thread (the C core's threads: --threads 1 has none)
    engine = cpu.pop(busiest, 0.0) if busiest is not None else 0.0
    row["cpu_us_per_token"] = {"event_loop": main * 1e6 / row["tokens"], "engine_thread": engine * 1e6 / row["tokens"],
                               "other_threads": sum(cpu.values()) * 1e6 / row["tokens"]}
    return row


def _median_rows(runs: list[dict]) -> dict:
    """Per N, the median of each number over the rounds (the first round's profile kept)."""
    out = {}
    for n in runs[0]:
        keys = [k for k in runs[0][n] if isinstance(runs[0][n][k], (int, float))]
        out[n] = {k: float(np.median([r[n][k] for r in runs])) for k in keys}
        out[n]["rounds"] = {k: [r[n][k] for r in runs] for k in ("host_us_per_step", "host_us_per_token")}
        if "profile" in runs[0][n]:
            out[n]["profile"] = runs[0][n]["profile"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--ns", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile-n", type=int, default=4)
    ap.add_argument("--baseline", default=None, metavar="REV")
    ap.add_argument("--e2e", default=None, metavar="K1,K2")
    ap.add_argument("--e2e-tokens", type=int, default=48)
    ap.add_argument("--e2e-reps", type=int, default=1)
    ap.add_argument("--e2e-slots", type=int, default=4, help="K = 1 also against --parallel this (the slot loop alone)")
    ap.add_argument("--device", default="cpu", help="the engine's device (cpu, cuda, cuda:N)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.ns.split(",")]
    if a.child:
        print(json.dumps(_engine_arm(a.model, ns, a.tokens, a.prompt, a.threads, a.profile_n, a.device)))
        return 0
    sys.path.insert(0, str(ROOT))
    from bench.common import commit as bench_commit, host_load, write_result
    from strata.gguf.default_model import default_model_path
    a.model_path = str(default_model_path()) if a.model == "default" else a.model
    trees = {"this": ROOT}
    if a.baseline:
        trees = {"baseline": _baseline_tree(a.baseline), "this": ROOT}
    res = {"what": "bench/step_overhead.py", "device": a.device, "commit": bench_commit(), "baseline": a.baseline,
           "model": os.path.basename(a.model_path), "ns": ns, "tokens": a.tokens, "prompt": a.prompt, "reps": a.reps,
           "threads": a.threads, "host_load": host_load(), "engine": {}, "e2e": {}}
    runs: dict[str, list] = {t: [] for t in trees}
    for r in range(a.reps):
        for name, tree in trees.items():          # the trees alternate round by round
            runs[name].append(_child(tree, a))
            last = runs[name][-1]
            print(f"round {r} {name}: " + ", ".join(f"N={n} host {v['host_us_per_step']:.0f} us/step "
                                                   f"{v['host_us_per_token']:.0f} us/token (forward "
                                                   f"{v['forward_us']:.0f} us)" for n, v in last.items()), flush=True)
    for name in trees:
        res["engine"][name] = _median_rows(runs[name])
    if a.baseline:
        res["engine"]["host_per_token_ratio"] = {n: res["engine"]["this"][n]["host_us_per_token"] /
                                                 res["engine"]["baseline"][n]["host_us_per_token"]
                                                 for n in res["engine"]["this"] if n in res["engine"]["baseline"]}
    if a.e2e:
        for k in [int(x) for x in a.e2e.split(",")]:
            arms = [(p, name) for p in sorted({1, k} | ({a.e2e_slots} if k == 1 else set()), reverse=True)
                    for name in trees]
            rows: dict = {arm: [] for arm in arms}
            for _ in range(a.e2e_reps):             # the arms alternate rep by rep (a fresh daemon each)
                for p, name in arms:
                    rows[(p, name)].append(_e2e_arm(trees[name], a.model_path, k, p, a.e2e_tokens, a.threads,
                                                    a.device))
            for (p, name), got in rows.items():
                best = dict(sorted(got, key=lambda x: x["aggregate_tok_s"])[len(got) // 2])     # the median rep
                best["reps_tok_s"] = [x["aggregate_tok_s"] for x in got]
                res["e2e"].setdefault(f"K{k}", {})[f"{name}_parallel_{p}"] = best
                print(f"e2e K={k} --parallel {p} {name}: {best['aggregate_tok_s']:.1f} tok/s (reps "
                      f"{', '.join(f'{x:.0f}' for x in best['reps_tok_s'])}), cpu us/token "
                      f"{ {x: round(y) for x, y in best['cpu_us_per_token'].items()} }", flush=True)
    res["host_load_after"] = host_load()
    for name in trees:
        if name != "this":
            shutil.rmtree(trees[name], ignore_errors=True)
    write_result(res, f"step_overhead_{a.device.split(':')[0]}_{res['commit']}", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
