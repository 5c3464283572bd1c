"""Lookup drafts (--spec N --spec-draft lookup) on the default model: decode tokens per second against --spec 0 on a
prompt the answer copies from (code to repeat or rename in) and on a chat whose answer copies nothing.

Each arm's run is paired with a --spec 0 run of the same prompt just before it (this machine's speed moves while it
is shared); the ratio of each pair, and the median over --reps pairs, is reported with the drafted / accepted counts
and verifies. Every greedy answer is checked equal to --spec 0's. Arms: --spec N for each N in --ns (drafts whenever
the lookup finds a match), and --spec max(ns) --spec-adaptive (each verify 0..N drafts as the measured acceptance and
costs make fastest; its policy carries over from one rep to the next, as the daemon's does from one request to the
next). Prompts are read once per run and not timed (decode tok/s: timings' predicted_per_second).
Usage: PYTHONPATH=. python bench/spec_lookup.py [--threads 2] [--tokens 200] [--reps 3] [--ns 3,6]
       [--ngram-min 2] [--ngram-max 4] [--workloads code_repeat,code_rename,chat] [--out PATH]
Writes bench/results/spec_lookup_cpu_<commit>.json (spec_lookup_<workloads>_cpu_<commit>.json for a subset; or --out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import commit as bench_commit  # noqa: E402
from strata.engine.engine import Engine                      # noqa: E402
from strata.engine.types import FinalEvent, GenerationRequest  # noqa: E402

CODE = '''import os


def parse_config(path):
    """Read a key=value config file into a dict."""
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            result[key.strip()] = value.strip()
    return result


def save_config(path, config):
    """Write a dict as a key=value config file, keys sorted."""
    with open(path, "w") as f:
        for key, value in sorted(config.items()):
            f.write(f"{key}={value}\\n")


def merge_configs(base, override):
    """A new dict: base's keys, then override's on top."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged


def config_path(name):
    return os.path.join(os.path.expanduser("~"), ".config", name + ".conf")
'''

WORKLOADS = {
    "code_repeat": "Repeat the following code exactly:\n\n```python\n" + CODE + "```",
    "code_rename": ("Rename the function parse_config to load_config in the following code and output the whole "
                    "file:\n\n```python\n" + CODE + "```"),
    "chat": "Write a short story about a dragon who learns to bake bread.",
}




def run(engine, prompt, tokens):
    req = GenerationRequest(prompt_tokens=list(prompt), max_tokens=tokens, cache_prompt=False, checkpoint=False)
    toks, final = [], None
    for ev in engine.generate(req):
        if isinstance(ev, FinalEvent):
            final = ev
        else:
            toks.append(ev.token_id)
    return toks, final.timings


def micro(engine, prompt, ns, ngram: tuple[int, int], reps: int = 5) -> dict:
    """Model times on the live sequence after `prompt` (min of `reps`): a decode step, and a verify of n + 1 tokens
    with its Commit back to one token (every draft rejected) for each n; then the lookup index itself: linking a
    64K-token conversation (code-like: a 10K-token span repeated) and one draft at its end."""
    import numpy as np
    from strata.sampling.lookup import NgramIndex
    seq = engine.seq
    seq.reset()
    seq.forward(np.asarray(prompt, np.int32))
    ck = seq.capture()
    out: dict = {}

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def decode():
        seq.restore(ck)
        return timed(lambda: seq.forward(np.asarray([5], np.int32)))
    out["decode_ms"] = round(min(decode() for _ in range(reps)) * 1e3, 2)
    for n in ns:
        toks = np.arange(100, 101 + n, dtype=np.int32)

        def verify():
            seq.restore(ck)
            base = seq.pos
            return timed(lambda: (seq.verify(toks), seq.commit(base + 1)))
        ms = min(verify() for _ in range(reps)) * 1e3
        out[f"verify{n + 1}_commit_ms"] = round(ms, 2)
        out[f"verify{n + 1}_over_decode"] = round(ms / out["decode_ms"], 3)
    ck.release()
    rng = np.random.default_rng(0)
    big = rng.integers(0, 2000, 65536)
    big[40000:50000] = big[5000:15000]
    idx = NgramIndex(*ngram)
    out["index_link_64k_ms"] = round(timed(lambda: idx.extend(big)) * 1e3, 1)
    draws = []
    for t in big[15000:15200].tolist():
        draws.append(timed(lambda: (idx.extend([t]), idx.propose(8))))
    out["index_draft_at_64k_us"] = round(statistics.median(draws) * 1e6, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ns", default="3,6")
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",") if x]
    common = dict(model=args.model, n_ctx=2048, threads=args.threads, device="cpu")
    base = Engine(**common)
    arms = {f"N={n}": Engine(**common, spec=n, spec_draft="lookup", spec_ngram_min=args.ngram_min,
                             spec_ngram_max=args.ngram_max) for n in ns}
    arms[f"adaptive N<={max(ns)}"] = Engine(**common, spec=max(ns), spec_draft="lookup", spec_adaptive=True,
                                           spec_ngram_min=args.ngram_min, spec_ngram_max=args.ngram_max)
    results: dict = {}
    t_start, commit = time.time(), bench_commit()          # the code measured (a commit made while it runs is not)
    code_prompt = base.render_chat([{"role": "user", "content": WORKLOADS["code_repeat"]}]).tokens
    first = next(iter(arms.values()))
    costs = micro(first, code_prompt, sorted(set(ns) | {1, 3}), (args.ngram_min, args.ngram_max))
    print("costs:", costs, flush=True)
    for w in args.workloads.split(","):
        prompt = base.render_chat([{"role": "user", "content": WORKLOADS[w]}]).tokens
        want, _ = run(base, prompt, args.tokens)          # warm, and the answer every arm must give
        row = {"prompt_tokens": len(prompt), "answer_tokens": len(want), "arms": {}}
        for name, eng in arms.items():
            pairs = []
            for _ in range(args.reps):
                _, t0 = run(base, prompt, args.tokens)
                got, t1 = run(eng, prompt, args.tokens)
                if got != want:
                    raise SystemExit(f"{w} {name}: the answer differs from --spec 0's")
                pairs.append({"spec0_tok_s": round(t0["predicted_per_second"], 2),
                              "tok_s": round(t1["predicted_per_second"], 2),
                              "ratio": round(t1["predicted_per_second"] / t0["predicted_per_second"], 3),
                              "drafted": t1["draft_n"], "accepted": t1["draft_n_accepted"],
                              "verifies": t1["draft_verifies"]})
            med = statistics.median(p["ratio"] for p in pairs)
            row["arms"][name] = {"median_ratio": med, "pairs": pairs}
            last = pairs[-1]
            print(f"{w:12s} {name:14s} {med:.3f}x --spec 0  (last pair: {last['tok_s']:.1f} vs "
                  f"{last['spec0_tok_s']:.1f} tok/s; drafted {last['drafted']}, accepted {last['accepted']}, "
                  f"verifies {last['verifies']})", flush=True)
        results[w] = row
    for e in [base, *arms.values()]:
        e.close()
    out = {"bench": "spec_lookup", "device": "cpu", "threads": args.threads, "model": args.model,
           "tokens": args.tokens, "reps": args.reps, "ngram_min": args.ngram_min, "ngram_max": args.ngram_max,
           "commit": commit, "seconds": round(time.time() - t_start, 1), "costs": costs, "workloads": results}
    what = "" if args.workloads == ",".join(WORKLOADS) else "_" + args.workloads.replace(",", "_")
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"spec_lookup{what}_cpu_{commit}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
