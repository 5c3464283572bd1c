"""Engine-level A/B: prompt and decode tokens/s of Strata source trees (or engine settings), measured alternately
in separate processes in one run, with medians and ratios against the first arm. Round r runs the arms rotated
by r, so every arm takes every place in the order equally often (a place in the order was seen to bias a run on
a 2-core machine).

Each arm is a source tree plus optional engine flags (e.g. the same tree with --layer-split): it runs the request
path users run (Engine.generate: prompt read in ubatch calls, greedy decode with EOG ignored, --prompt-cache 0), so
it measures everything between the request and the kernels.

Usage: python bench/engine_ab.py --arm before=/tmp/main --arm after=. [--arm 'split2=.?layer_split=15&device=cpu']
       [--device cuda] [--rounds 3] [--prompts 512,4096] [--depths 0,4096] [--n-gen 128] [--out FILE]
Writes bench/results/engine_ab_<device>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# one measurement in a fresh process of one tree: what the arm's Engine does for each prompt / depth
PROBE = r"""
import json, sys, time
import numpy as np
from strata.engine import Engine, GenerationRequest
from strata.sampling.sampler import SamplingParams
cfg = json.loads(sys.argv[1])
kw = dict(n_ctx=cfg["n_ctx"], ubatch=cfg["ubatch"], device=cfg["device"], prompt_cache=0)
kw.update(cfg["engine"])
if cfg.get("threads"):
    kw["threads"] = cfg["threads"]
e = Engine(cfg["model"], **kw)
rng = np.random.default_rng(0)
V = e.n_vocab
def run(ids, n_gen):
    e.state_reset()
    req = GenerationRequest(prompt_tokens=[int(t) for t in ids], max_tokens=n_gen, cache_prompt=False,
                            ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    return list(e.generate(req))[-1].timings
run(rng.integers(0, V, 256), 8)                                  # warm-up: graphs, handles
out = {"prompt": {}, "decode": {}, "stages": len(getattr(e, "stages", [None]))}
for n in cfg["prompts"]:
    ids = rng.integers(0, V, n)
    out["prompt"][str(n)] = max(n / (run(ids, 0)["prompt_ms"] / 1000.0) for _ in range(2))
for d in cfg["depths"]:
    ids = rng.integers(0, V, max(1, d))
    t = run(ids, cfg["n_gen"])
    out["decode"][str(d)] = t["predicted_n"] / (t["predicted_ms"] / 1000.0)
print("RESULT " + json.dumps(out))
"""


def parse_arm(spec: str) -> tuple[str, str, dict]:
    """'name=TREE[?key=value&...]' -> (name, tree, Engine keyword arguments as strings)."""
    name, _, rest = spec.partition("=")
    tree, _, opts = rest.partition("?")
    kw = {}
    for kv in filter(None, opts.split("&")):
        k, _, v = kv.partition("=")
        kw[k] = v
    if not name or not tree:
        raise SystemExit(f"--arm {spec!r}: use NAME=TREE[?key=value&...]")
    return name, str(Path(tree).resolve()), kw


def measure(tree: str, cfg: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and Path(p).resolve() != ROOT]))
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cfg)], capture_output=True, text=True, env=env,
                       cwd=tree, timeout=1800)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"arm in {tree} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(line[7:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True,
                    help="NAME=TREE[?layer_split=15&device=cuda:0,cuda:0] (repeatable; the first is the base)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-ctx", type=int, default=0, help="default: enough for the largest prompt / depth")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--prompts", default="512,4096")
    ap.add_argument("--depths", default="0,4096")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    arms = [parse_arm(a) for a in args.arm]
    prompts = [int(x) for x in args.prompts.split(",") if x]
    depths = [int(x) for x in args.depths.split(",") if x]
    n_ctx = args.n_ctx or max(prompts + [d + args.n_gen for d in depths]) + 64
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
    t0 = time.time()
    for r in range(args.rounds):
        for name, tree, kw in arms[r % len(arms):] + arms[:r % len(arms)]:
            cfg = dict(model=args.model, device=args.device, threads=args.threads, n_ctx=n_ctx, ubatch=args.ubatch,
                       prompts=prompts, depths=depths, n_gen=args.n_gen, engine=kw)
            res = measure(tree, cfg)
            runs[name].append(res)
            print(f"round {r + 1} {name}: " + ", ".join(
                [f"pp{k} {v:.1f}" for k, v in res["prompt"].items()] +
                [f"tg@{k} {v:.1f}" for k, v in res["decode"].items()]) + " tok/s", flush=True)
    base = arms[0][0]
    med = {name: {kind: {k: statistics.median(x[kind][k] for x in rs) for k in rs[0][kind]}
                  for kind in ("prompt", "decode")} for name, rs in runs.items()}
    print(f"\nmedians of {args.rounds} rounds (tok/s) and ratio to {base}:")
    rows = [("prompt", k) for k in map(str, prompts)] + [("decode", k) for k in map(str, depths)]
    print(f"{'row':>14} " + " ".join(f"{n:>18}" for n in med))
    for kind, k in rows:
        cells = []
        for n in med:
            v = med[n][kind][k]
            cells.append(f"{v:9.1f} ({v / med[base][kind][k]:.3f})")
        print(f"{kind + ' ' + k:>14} " + " ".join(f"{c:>18}" for c in cells))
    out = Path(args.out or ROOT / "bench" / "results" / f"engine_ab_{args.device.replace(':', '')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "arms": [{"name": n, "tree": t, "engine": kw} for n, t, kw in arms], "device": args.device,
        "model": args.model, "rounds": args.rounds, "n_gen": args.n_gen, "ubatch": args.ubatch, "runs": runs,
        "median": med, "ratio": {n: {kind: {k: med[n][kind][k] / med[base][kind][k] for k in med[n][kind]}
                                        for kind in med[n]} for n in med},
        "seconds": round(time.time() - t0, 1)}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
