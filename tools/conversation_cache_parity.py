#!/usr/bin/env python3
"""Conversation-cache parity: the same chat requests through an engine with checkpoints and one without, compared.

Scenarios (each a list of chat requests; the client resends the whole conversation every turn):
  reuse   A/B/A switching: chat A turn 1, chat B turn 1, A turn 2, B turn 2, A turn 3 (each switch resumes from the
          shared system-prompt root, or on an attention-only model the longer common prefix; the other chat's
          checkpoints are erased)
  repeat  every request sent twice; the repeat resumes through its turn_at checkpoint, or on an attention-only
          model live at the prompt's length - 1 (the K/V cut back)
  replay  two chats of four turns on one shared system prompt, played one after the other

Both runs get the same prompts (each chat's history holds the cached run's answers). For every request the
generated token ids and the state hashes (SequenceState.hashes(): tokens, kv, running) are compared between the
cached run (--prompt-cache N) and the uncached run (--prompt-cache 0), greedy unless --temperature. Exit status
1 when:
  * the generated tokens differ between the runs and the first difference is not a near tie (each run's choice
    beats the other's token by less than --max-gap nats: a flip by rounding), or any difference with --exact, or
  * a repeated request (scenario repeat) differs from its first send in tokens or state hashes within the
    cached run (the exactness property: the same parts are read in the same order), or
  * with --strict-state, the state hashes differ between the runs.
State hashes between the two runs are only expected to be equal when both read the prompt in the same parts:
the cached run splits the read at cut points, the uncached run reads each prompt in one part, and the CPU
kernels' rounding depends on the batch size, so by default those differences are reported, not fatal.

It takes the engine flags `strata serve` takes (--model, --n-ctx, --device, --layer-split, --remote-stage,
--conversation-cache-mib, --park-resident, --kv, ...; --prompt-cache is the cached run's, default 6), so the A/B/A
check runs over a layer split, parking, or a worker (the two runs use the engine one after the other).

Usage: PYTHONPATH=. python tools/conversation_cache_parity.py --scenario all [--json out.json] [engine flags]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

SYSTEM = ("You are Strata's parity assistant. Answer briefly. Facts: the river Lune flows past Lancaster; "
          "the capital of Peru is Lima; a heptagon has seven sides; water boils at 100 degrees Celsius at sea "
          "level; the Andes run along the west of South America. ")
CHAT_A = ["What is the capital of Peru?", "How many sides has a heptagon?", "Which river flows past Lancaster?",
          "Summarise our chat in one line."]
CHAT_B = ["Name a prime number.", "Is 9 prime?", "What about 11?", "Say goodbye."]


def scenario_requests(name: str) -> list[tuple[str, int, bool]]:
    """(chat, turn index, is_repeat) in the order sent."""
    if name == "reuse":
        return [("A", 0, False), ("B", 0, False), ("A", 1, False), ("B", 1, False), ("A", 2, False)]
    if name == "repeat":
        out = []
        for t in range(3):
            out += [("A", t, False), ("A", t, True)]
        return out
    if name == "replay":
        return [("A", t, False) for t in range(4)] + [("B", t, False) for t in range(4)]
    raise ValueError(f"unknown scenario {name!r} (reuse, repeat, replay)")


def _request(engine, msgs, max_tokens: int, sampling, top: int) -> dict:
    from strata.engine import GenerationRequest
    r = engine.render_chat(msgs)
    req = GenerationRequest(r.tokens, r.cut_points, sampling, max_tokens=max_tokens, logprobs=top)
    t0 = time.perf_counter()
    evs = list(engine.generate(req))
    wall = time.perf_counter() - t0
    final = evs[-1]
    return dict(n_prompt=len(r.tokens), tokens=[e.token_id for e in evs[:-1]],
                text="".join(e.text for e in evs[:-1]) + final.text,
                top=[{int(i): lp for i, _, lp in (e.top_logprobs or [])} for e in evs[:-1]],
                resume_from=final.strata["resume_from"], resume_pos=final.strata["resume_pos"],
                parts=[list(p) for p in final.strata.get("parts", [])],
                prompt_ms=round(final.timings["prompt_ms"], 1), wall_s=round(wall, 3),
                hashes=engine.state_hashes())


def play(make_engine, requests, system: str, max_tokens: int, sampling, top: int = 5):
    """Send the requests to the cached engine, then the same prompts to the uncached one (one engine at a time: a
    worker serves one main). Each chat's history holds the cached run's answers, so both runs see the same prompts
    even after their answers diverge. make_engine(name) -> an Engine ("cached" or "uncached").
    -> (cached records, uncached records)."""
    history = {"A": [], "B": []}
    users = {"A": CHAT_A, "B": CHAT_B}
    prompts, out_c, out_u = [], [], []
    engine = make_engine("cached")
    try:
        for chat, turn, repeat in requests:
            h = history[chat]
            if repeat:
                h.pop()                       # resend the same request: drop the answer it got
            else:
                assert len(h) == 2 * turn, f"scenario sends {chat} turn {turn} out of order"
                h.append({"role": "user", "content": users[chat][turn]})
            msgs = [{"role": "system", "content": system}] + h
            a = _request(engine, msgs, max_tokens, sampling, top)
            a.update(chat=chat, turn=turn, repeat=repeat)
            h.append({"role": "assistant", "content": a["text"]})
            prompts.append(msgs)
            out_c.append(a)
    finally:
        engine.close()
    engine = make_engine("uncached")
    try:
        for (chat, turn, repeat), msgs in zip(requests, prompts):
            b = _request(engine, msgs, max_tokens, sampling, top)
            b.update(chat=chat, turn=turn, repeat=repeat)
            out_u.append(b)
    finally:
        engine.close()
    return out_c, out_u


def explain(a: dict, b: dict, max_gap: float) -> tuple[bool, str]:
    """Why two answers to the same prompt differ: at the first differing token, is it a near tie (each run's
    choice beats the other run's token by less than max_gap nats), i.e. a flip by rounding?"""
    i = next(i for i, (x, y) in enumerate(zip(a["tokens"] + [None], b["tokens"] + [None])) if x != y)
    if i >= len(a["tokens"]) or i >= len(b["tokens"]):
        return False, f"one answer stops at token {i}"
    ta, tb = a["tokens"][i], b["tokens"][i]
    ga = a["top"][i].get(ta, 0.0) - a["top"][i].get(tb, float("-inf"))
    gb = b["top"][i].get(tb, 0.0) - b["top"][i].get(ta, float("-inf"))
    ok = 0 <= ga < max_gap and 0 <= gb < max_gap
    return ok, (f"first difference at token {i}: cached picks {ta} by {ga:.3f} nats over {tb}, uncached picks "
                f"{tb} by {gb:.3f} nats over {ta} ({'a near tie flipped by rounding' if ok else 'NOT a near tie'})")


def compare(name: str, cached: list[dict], plain: list[dict], exact: bool, strict_state: bool,
            max_gap: float) -> tuple[bool, list[str]]:
    ok, lines = True, []
    for i, (a, b) in enumerate(zip(cached, plain)):
        tok_eq = a["tokens"] == b["tokens"]
        st_eq = a["hashes"] == b["hashes"]
        diff = ",".join(k for k in a["hashes"] if a["hashes"][k] != b["hashes"][k])
        lines.append(f"  {name} #{i} {a['chat']}{a['turn'] + 1}{' (repeat)' if a['repeat'] else ''}: "
                     f"{a['n_prompt']} tokens, cached resumes {a['resume_pos']} ({a['resume_from']}, parts "
                     f"{a['parts']}), uncached {b['resume_pos']} ({b['resume_from']}, parts {b['parts']}); "
                     f"tokens {'equal' if tok_eq else 'DIFFER'}, state {'equal' if st_eq else 'differs: ' + diff}")
        if not tok_eq:
            why_ok, why = explain(a, b, max_gap)
            lines.append(f"    {why}\n    cached   {a['tokens']}\n    uncached {b['tokens']}")
            ok &= why_ok and not exact
        ok &= st_eq or not strict_state
    for i, a in enumerate(cached):                   # exactness: a repeat equals its first send, state included
        if a["repeat"]:
            first = cached[i - 1]
            same = a["tokens"] == first["tokens"] and a["hashes"] == first["hashes"]
            # a checkpoint, or (attention-only) the live sequence cut back to all but the prompt's last token
            through = a["resume_from"] == "checkpoint" or (a["resume_from"] == "live"
                                                           and a["resume_pos"] == a["n_prompt"] - 1)
            lines.append(f"  {name} #{i} repeat of #{i - 1}: resumes {a['resume_pos']} ({a['resume_from']}), "
                         f"{'byte-identical tokens and state' if same else 'DIFFERS from the first send'}")
            ok &= same and through
    return ok, lines


def main(argv=None) -> int:
    from strata.cli.engine_flags import CliError, add_engine_args, engine_config
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="all", choices=["reuse", "repeat", "replay", "all"])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system-repeat", type=int, default=4, help="copies of the system prompt text")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--strict-state", action="store_true", help="state hashes must match between the runs too")
    ap.add_argument("--exact", action="store_true", help="any token difference fails, even a near tie")
    ap.add_argument("--max-gap", type=float, default=1.0,
                    help="a token difference is a rounding flip when both runs' choices win by less (nats)")
    ap.add_argument("--json", help="write every request's record here")
    add_engine_args(ap)        # the engine flags `strata serve` takes; --prompt-cache is the cached run's (default 6)
    args = ap.parse_args(argv)
    keep = 6 if args.prompt_cache is None else args.prompt_cache
    if keep < 1:
        ap.error("--prompt-cache must be >= 1 (the uncached run is --prompt-cache 0)")
    try:
        configs = {"cached": engine_config(args, prompt_cache=keep),     # uncached: no cut points either
                   "uncached": engine_config(args, prompt_cache=0, prompt_cache_every=0, prompt_cache_tail=0)}
    except CliError as e:
        ap.error(str(e))

    from strata.engine import Engine
    from strata.sampling.sampler import SamplingParams
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    system = SYSTEM * args.system_repeat
    names = ["reuse", "repeat", "replay"] if args.scenario == "all" else [args.scenario]
    all_ok, report = True, {}
    for name in names:
        reqs = scenario_requests(name)
        c, u = play(lambda run: Engine(configs[run]), reqs, system, args.max_tokens, sampling)
        runs = {"cached": c, "uncached": u}
        ok, lines = compare(name, c, u, args.exact, args.strict_state, args.max_gap)
        print(f"{name}: {'PASS' if ok else 'FAIL'}")
        print("\n".join(lines))
        report[name] = dict(ok=ok, **runs)
        all_ok &= ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
