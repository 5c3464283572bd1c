#!/usr/bin/env python3
"""Where a chat step's time goes: play bench/prompt_cache.py's chats on an engine (the synthetic 1.5B hybrid by
default) and profile one step with cProfile (a later turn, the new chat, or the switch back to the first chat), the
GPU synchronized around it; prints each step's time to the first token, its parts and the functions that took the
most time in the profiled one (own and cumulative).

Usage: PYTHONPATH=. python tools/profile_turn.py [--device cuda] [--size 16384] [--prompt-cache 6] [--turn 4]
       [--step turn|new|switch]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--prompt-cache", type=int, default=6)
    ap.add_argument("--turn", type=int, default=4, help="the turn profiled (2-4) with --step turn")
    ap.add_argument("--step", choices=["turn", "new", "switch"], default="turn",
                    help="profile a later turn, the new chat after turn 4, or the switch back to chat A after it")
    ap.add_argument("--synthetic", default="hybrid_1_5b")
    ap.add_argument("--model", default=None, help="a GGUF path or 'default' instead of the synthetic model")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import prompt_cache as pc                                  # bench/prompt_cache.py
    from strata.engine import Engine, GenerationRequest
    from strata.sampling.sampler import SamplingParams
    d = Path(tempfile.mkdtemp())
    model = args.model or pc.synthetic_model(args.synthetic, args.size + 2048, d)
    e = Engine(model, n_ctx=args.size + 2048, device=args.device, prompt_cache=args.prompt_cache)
    sync = (lambda: __import__("cupy").cuda.Device().synchronize()) if args.device.startswith("cuda") else (lambda: None)
    system = pc.system_prompt(e.tokenizer, args.size)
    a = [{"role": "system", "content": system}]

    def ask(msgs, name, profile=None):
        """One request on `msgs`; its answer appended to them; prints its time to the first token."""
        r = e.render_chat(msgs)
        req = GenerationRequest(r.tokens, r.cut_points, SamplingParams(temperature=0.0), max_tokens=8)
        sync()
        t0 = time.perf_counter()
        if profile:
            profile.enable()
        first, text, final = None, [], None
        for ev in e.generate(req):
            if first is None:
                sync()
                first = time.perf_counter()
                if profile:
                    profile.disable()
            if hasattr(ev, "token_id"):
                text.append(ev.text)
            else:
                final = ev
        msgs.append({"role": "assistant", "content": "".join(text) + final.text})
        print(f"{name}{' (profiled)' if profile else ''}: {(first - t0) * 1e3:.1f} ms to the first token, resume "
              f"{final.strata['resume_from']} {final.strata['resume_pos']}, parts {final.strata.get('parts')}")

    prof = cProfile.Profile()
    turns = args.turn if args.step == "turn" else 4
    for i in range(turns):
        a.append({"role": "user", "content": pc.USERS_A[i]})
        ask(a, f"turn {i + 1}", prof if args.step == "turn" and i == turns - 1 else None)
    if args.step in ("new", "switch"):
        b = [{"role": "system", "content": system}, {"role": "user", "content": pc.USER_B}]
        ask(b, "new chat", prof if args.step == "new" else None)
    if args.step == "switch":
        a.append({"role": "user", "content": pc.USERS_A[4]})
        ask(a, "switch back", prof)
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(f"---- by {key}\n" + "\n".join(s.getvalue().splitlines()[6:]))
    e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
