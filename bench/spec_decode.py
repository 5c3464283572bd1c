"""Speculative decoding with the MTP head at known acceptance: decode tokens per second with --spec N against --spec 0
(each run paired with a --spec 0 run just before it; the median ratio), the mean accepted length, the verify of N + 1 tokens against a decode step, the cost of one
rejected draft and of one Commit (against one checkpoint + restore + replaying the accepted tokens).

Random weights give meaningless acceptance, so the drafts are an oracle's: the greedy continuation recorded by a
first pass with --spec 0, each drafted position kept with probability `acceptance` and otherwise replaced by a wrong
token, independently per position. The MTP head still runs on every draft (its K/V and its cost are real). Greedy
output is checked equal to the first pass on every run.

Model: a synthetic qwen35 hybrid with an MTP block (synth preset 'small' by default, Q8_0), written into --dir.
Usage: PYTHONPATH=. python bench/spec_decode.py [--device cpu] [--size small] [--ns 1,2,3,4]
       [--acceptance 0.3,0.5,0.7,0.8,0.9] [--tokens 64] [--prompt 64] [--reps 2] [--threads N] [--out PATH]
Besides N = --ns, an "adaptive" arm: --spec max(ns) --spec-adaptive (each verify takes 0..N drafts as the measured
acceptance and costs make fastest; its acceptance estimate carries over from one rate's runs to the next).
Writes bench/results/spec_decode_<device>_<commit>.json (or --out). --device cuda is refused until the device
verify lands (the engine refuses --spec on a CUDA stage).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata.engine.engine import Engine                      # noqa: E402
from strata.engine.types import FinalEvent, GenerationRequest  # noqa: E402
from strata.gguf import synth                                # noqa: E402


def commit_id() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Oracle:
    """The recorded continuation by absolute position, each drafted position kept with probability `rate`."""

    def __init__(self, by_pos: dict[int, int], rate: float, n_vocab: int, seed: int):
        self.by_pos, self.rate, self.n_vocab = by_pos, rate, n_vocab
        self.rng = np.random.default_rng(seed)

    def __call__(self, pos: int, token: int) -> int:
        want = self.by_pos.get(pos)
        if want is None:
            return token
        return want if self.rng.random() < self.rate else (want + 1) % self.n_vocab


def run(engine, prompt, tokens):
    req = GenerationRequest(prompt_tokens=list(prompt), max_tokens=tokens, ignore_eos=True, cache_prompt=False,
                            checkpoint=False)
    toks, final = [], None
    for ev in engine.generate(req):
        if isinstance(ev, FinalEvent):
            final = ev
        else:
            toks.append(ev.token_id)
    return toks, final.timings


def best(fn, reps):
    out = None
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        out = dt if out is None else min(out, dt)
    return out


def micro(engine, prompt, ns, reps):
    """Model times on the live sequence after the prompt (`engine` runs --spec): a decode step, drafting n tokens
    with the MTP head, a verify of n + 1 tokens (kept states), the Commit back to one token, and the alternative:
    a checkpoint, its restore and a forward of the accepted token."""
    seq = engine.seq
    rng = np.random.default_rng(0)
    seq.reset()
    _, h = seq.forward(np.asarray(prompt, np.int32), hidden=True)
    engine.drafter.observe(0, h)                  # the MTP K/V follows the prompt, as in the engine
    engine.drafter.flush()
    ck = seq.capture()
    out = {}

    def decode():
        seq.restore(ck)
        t0 = time.perf_counter()
        seq.forward(np.asarray([5], np.int32))
        return time.perf_counter() - t0

    out["decode_ms"] = min(decode() for _ in range(reps * 3)) * 1e3
    for n in ns:
        toks = rng.integers(0, 1000, n + 1).astype(np.int32)
        v, c, cap, rest, replay, dr = [], [], [], [], [], []
        for _ in range(reps * 3):
            seq.restore(ck)
            t0 = time.perf_counter()
            engine.drafter.draft(5, n, 0.0)
            dr.append(time.perf_counter() - t0)
            base = seq.pos
            t0 = time.perf_counter()
            seq.verify(toks)
            v.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            seq.commit(base + 1)                    # every draft rejected: the deepest cut-back
            c.append(time.perf_counter() - t0)
            # the alternative: a checkpoint before the verify, restored after it, the accepted token read again
            seq.restore(ck)
            t0 = time.perf_counter()
            k2 = seq.capture()
            cap.append(time.perf_counter() - t0)
            seq.forward(toks)
            t0 = time.perf_counter()
            seq.restore(k2)
            rest.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            seq.forward(toks[:1])
            replay.append(time.perf_counter() - t0)
        out[f"n{n}"] = {"draft_ms": min(dr) * 1e3, "verify_ms": min(v) * 1e3,
                        # all n drafts rejected: the round yields one token, as a decode step does
                        "rejected_draft_ms": (min(dr) + min(v)) * 1e3 / n - out["decode_ms"] / n, "verify_over_decode": min(v) * 1e3 / out["decode_ms"],
                        "commit_ms": min(c) * 1e3, "checkpoint_ms": min(cap) * 1e3, "restore_ms": min(rest) * 1e3,
                        "replay_one_ms": min(replay) * 1e3,
                        "checkpoint_replay_over_commit": (min(cap) + min(rest) + min(replay)) / max(min(c), 1e-9)}
    seq.reset()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="small")
    ap.add_argument("--ns", default="1,2,3,4")
    ap.add_argument("--acceptance", default="0.3,0.5,0.7,0.8,0.9")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dir", default="/tmp/spec_models", help="where the synthetic model is written")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device != "cpu":
        print("bench/spec_decode.py: --spec runs on CPU stages only for now (the device verify is a later step)",
              file=sys.stderr)
        return 2
    ns = [int(x) for x in args.ns.split(",")]
    rates = [float(x) for x in args.acceptance.split(",")]
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    spec = synth.preset("qwen35", args.size, seed=1, n_mtp=1, qtype="Q8_0", embd_qtype="Q8_0")
    path = d / f"syn_qwen35_{args.size}_mtp_q8.gguf"
    if not path.exists():
        synth.write_synthetic(path, spec)
    kw = dict(n_ctx=args.prompt + args.tokens + 32, device="cpu", conversation_cache_mib=0, prompt_cache=0)
    if args.threads:
        kw["threads"] = args.threads
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 1000, args.prompt)]

    base = Engine(path, **kw)
    ref, _ = run(base, prompt, args.tokens)
    by_pos = {len(prompt) + i: t for i, t in enumerate(ref)}

    def baseline():
        tps = []
        for _ in range(args.reps):
            toks, t = run(base, prompt, args.tokens)
            assert toks == ref
            tps.append(t["predicted_per_second"])
        return max(tps)

    baseline()                                    # warm: the first runs after a load are slower
    res = {"device": "cpu", "model": path.name, "commit": commit_id(), "tokens": args.tokens, "prompt": args.prompt,
           "threads": base.threads, "reps": args.reps, "spec0_tok_s": baseline(), "runs": []}
    engines = {n: Engine(path, spec=n, **kw) for n in ns}
    engines["adaptive"] = Engine(path, spec=max(ns), spec_adaptive=True, **kw)
    for rate in rates:
        for n in ns + ["adaptive"]:
            e = engines[n]
            pairs, acc = [], None
            for r in range(args.reps):            # --spec 0 and --spec N back to back: the machine is shared
                toks0, t0 = run(base, prompt, args.tokens)
                assert toks0 == ref
                e.drafter.oracle = Oracle(by_pos, rate, base.n_vocab, seed=1000 * ns.index(n) + r if n in ns else r)
                toks, t = run(e, prompt, args.tokens)
                assert toks == ref, f"--spec {n} at acceptance {rate} changed the greedy output"
                pairs.append((t["predicted_per_second"], t0["predicted_per_second"]))
                acc = t
            ratios = sorted(a / b for a, b in pairs)
            row = {"n": n, "acceptance": rate, "tok_s": [a for a, _ in pairs], "spec0_tok_s": [b for _, b in pairs],
                   "ratio_median": ratios[len(ratios) // 2], "ratios": ratios,
                   "measured_acceptance": acc["draft_acceptance_rate"], "mean_accepted": acc["draft_mean_accepted"],
                   "verifies": acc["draft_verifies"]}
            res["runs"].append(row)
            print(f"N={n} acceptance {rate}: {row['ratio_median']:.2f}x --spec 0 (median of {len(ratios)} pairs; "
                  f"measured {row['measured_acceptance']:.2f}, {row['mean_accepted']:.2f} tokens per verify)",
                  flush=True)
    res["spec0_tok_s_end"] = baseline()           # the reference again: how much the machine drifted
    e = engines[max(ns)]
    e.drafter.oracle = None
    res["micro"] = micro(e, prompt, ns, args.reps)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"spec_decode_cpu_{res['commit']}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
