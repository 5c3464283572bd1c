#!/usr/bin/env python3
"""Benchmark: time to first token per chat turn with conversation checkpoints vs --prompt-cache 0 (same run).

For each system-prompt size (default ~2K and ~8K tokens) and each arm (--prompt-cache 6, --prompt-cache 0) on
a fresh engine with the default model, the client plays:
  turns 1-4   chat A, four turns; the client resends the whole conversation every turn
  resend      chat A turn 4 sent again (a client retry / regenerate: resumes through its turn_at checkpoint)
  new chat    chat B turn 1: a new conversation with the same system prompt (resumes from the pinned root)
  switch back chat A turn 5 after chat B (the single KV arena holds B now: resumes from the root)
With --baseline cold the --prompt-cache 0 arm plays turns 1-4 only (its other steps are cold reads like turn 1).
Time to first token (TTFT) = wall time from generate() to the first token event. Printed: TTFT per step and
arm, the ratio step TTFT / cold TTFT (turn 1 of the same arm), and checkpoints / prompt-cache-0 per step.
JSON goes to bench/results/prompt_cache.json. Issue target: a later turn's TTFT <= 5% of a cold read at 8K.

Usage: PYTHONPATH=. python bench/prompt_cache.py [--sizes 2048 8192] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

SENTENCES = [
    "Section {i}: the archive keeps records of rivers, mountains and the towns that grew beside them.",
    "Rule {i}: answer in plain words, cite the record number, and say so when a record is missing.",
    "Note {i}: the Lune passes Lancaster, the Severn passes Shrewsbury and the Tyne passes Newcastle.",
    "Entry {i}: a heptagon has seven sides, a nonagon nine, and a dodecagon twelve equal edges.",
    "Policy {i}: never invent a date; if two records disagree, list both and name their sources.",
]
USERS_A = ["Which river passes Shrewsbury?", "How many sides has a nonagon?", "What does rule 3 say?",
           "Summarise the archive in one sentence.", "Thanks. Anything else?"]
USER_B = "Which river passes Newcastle?"


def system_prompt(tok, n_tokens: int) -> str:
    """Archive-like text of about n_tokens tokens for the model's tokenizer."""
    parts, i = [], 0
    while True:
        parts.append(SENTENCES[i % len(SENTENCES)].format(i=i))
        i += 1
        if i % 20 == 0 and len(tok.encode(" ".join(parts))) >= n_tokens:
            return " ".join(parts)


def ttft(engine, msgs, max_tokens: int) -> tuple[float, str, dict]:
    """(seconds to the first token, answer text, final strata dict)."""
    from strata.engine import GenerationRequest
    from strata.sampling import SamplingParams
    r = engine.render_chat(msgs)
    req = GenerationRequest(r.tokens, r.cut_points, SamplingParams(temperature=0.0), max_tokens=max_tokens)
    t0 = time.perf_counter()
    first = None
    text = []
    final = None
    for ev in engine.generate(req):
        if first is None:
            first = time.perf_counter() - t0
        if hasattr(ev, "token_id"):
            text.append(ev.text)
        else:
            final = ev
    return first, "".join(text) + final.text, dict(final.strata, n_prompt=len(r.tokens),
                                                   prompt_ms=final.timings["prompt_ms"])


def play(engine, system: str, max_tokens: int, full: bool = True) -> list[dict]:
    engine.clear_checkpoints()
    engine.state_reset()
    a = [{"role": "system", "content": system}]
    rows = []
    for t in range(4):
        a.append({"role": "user", "content": USERS_A[t]})
        s, text, st = ttft(engine, a, max_tokens)
        rows.append(dict(step=f"turn {t + 1}", ttft_s=s, **st))
        a.append({"role": "assistant", "content": text})
    if full:
        s, _, st = ttft(engine, a[:-1], max_tokens)
        rows.append(dict(step="resend turn 4", ttft_s=s, **st))
        b = [{"role": "system", "content": system}, {"role": "user", "content": USER_B}]
        s, _, st = ttft(engine, b, max_tokens)
        rows.append(dict(step="new chat", ttft_s=s, **st))
        a.append({"role": "user", "content": USERS_A[4]})
        s, _, st = ttft(engine, a, max_tokens)
        rows.append(dict(step="switch back (turn 5)", ttft_s=s, **st))
    for r in rows:
        r.pop("stop", None)
        r.pop("stopped_by", None)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192], help="system prompt sizes (tokens)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--baseline", choices=["full", "cold"], default="full",
                    help="cold: the --prompt-cache 0 arm plays turns 1-4 only (saves its cold re-reads)")
    ap.add_argument("--arms", nargs="+", default=["checkpoints", "prompt_cache_0"],
                    choices=["checkpoints", "prompt_cache_0"], help="which arms to run (both by default)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "prompt_cache.json"))
    args = ap.parse_args(argv)

    from strata.engine import Engine
    results = dict(bench="prompt_cache", model=args.model, machine=platform.machine(), cpus=os.cpu_count(),
                   max_tokens=args.max_tokens, ubatch=args.ubatch, sizes={})
    for size in args.sizes:
        n_ctx = size + 1024
        arms = {}
        for arm, pc in (("checkpoints", 6), ("prompt_cache_0", 0)):
            if arm not in args.arms:
                continue
            e = Engine(args.model, n_ctx=n_ctx, ubatch=args.ubatch, threads=args.threads, prompt_cache=pc)
            system = system_prompt(e.tokenizer, size)
            arms[arm] = play(e, system, args.max_tokens, full=(pc > 0 or args.baseline == "full"))
            del e
        arms.setdefault("prompt_cache_0", [])
        cold = {k: v[0]["ttft_s"] if v else float("nan") for k, v in arms.items()}
        print(f"\nsystem prompt ~{size} tokens (first prompt {arms['checkpoints'][0]['n_prompt']} tokens), "
              f"cold TTFT: checkpoints {cold['checkpoints']:.2f} s, prompt-cache 0 {cold['prompt_cache_0']:.2f} s", flush=True)
        print(f"{'step':22} {'ckpt TTFT':>10} {'resume':>18} {'/cold':>7} | {'pc0 TTFT':>9} {'resume':>12} "
              f"{'/cold':>7} | {'ckpt/pc0':>8}")
        base = {r["step"]: r for r in arms["prompt_cache_0"]}
        for a in arms["checkpoints"]:
            a["ratio_to_cold"] = a["ttft_s"] / cold["checkpoints"]
            b = base.get(a["step"])
            line = (f"{a['step']:22} {a['ttft_s']:9.3f}s {a['resume_from'] + ' ' + str(a['resume_pos']):>18} "
                    f"{a['ratio_to_cold']:7.1%} | ")
            if b is None:
                line += f"{'(not run: a cold read, like turn 1)':>31} | {a['ttft_s'] / cold['prompt_cache_0']:8.3f}"
            else:
                b["ratio_to_cold"] = b["ttft_s"] / cold["prompt_cache_0"]
                a["ratio_to_prompt_cache_0"] = a["ttft_s"] / b["ttft_s"]
                line += (f"{b['ttft_s']:8.3f}s {b['resume_from'] + ' ' + str(b['resume_pos']):>12} "
                         f"{b['ratio_to_cold']:7.1%} | {a['ratio_to_prompt_cache_0']:8.3f}")
            print(line, flush=True)
        prev = {}
        out = Path(args.out)
        if out.exists():
            try:
                prev = json.loads(out.read_text()).get("sizes", {})
            except ValueError:
                prev = {}
        results["sizes"] = {**prev, **results["sizes"], str(size): arms}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))      # after each size: partial results survive
        print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
