#!/usr/bin/env python3
"""Where a later chat turn's time goes: play bench/prompt_cache.py's chat on an engine (the synthetic 1.5B hybrid by
default) and profile one later turn with cProfile, with the GPU synchronized around it; prints the turn's wall time,
its parts and the functions that took the most time (own and cumulative, strata's only).

Usage: PYTHONPATH=. python tools/profile_turn.py [--device cuda] [--size 16384] [--prompt-cache 6] [--turn 4]
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
    ap.add_argument("--turn", type=int, default=4, help="the turn profiled (2-4)")
    ap.add_argument("--synthetic", default="hybrid_1_5b")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import prompt_cache as pc                                  # bench/prompt_cache.py
    from strata.engine import Engine, GenerationRequest
    from strata.sampling import SamplingParams
    d = Path(tempfile.mkdtemp())
    model = pc.synthetic_model(args.synthetic, args.size + 2048, d)
    e = Engine(model, n_ctx=args.size + 2048, device=args.device, prompt_cache=args.prompt_cache)
    sync = (lambda: __import__("cupy").cuda.Device().synchronize()) if args.device.startswith("cuda") else (lambda: None)
    system = pc.system_prompt(e.tokenizer, args.size)
    msgs = [{"role": "system", "content": system}]

    def turn(i, profile=None):
        msgs.append({"role": "user", "content": pc.USERS_A[i]})
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
        return (first - t0) * 1e3, final

    for i in range(args.turn - 1):
        ms, final = turn(i)
        print(f"turn {i + 1}: {ms:.1f} ms, resume {final.strata['resume_from']} {final.strata['resume_pos']}")
    prof = cProfile.Profile()
    ms, final = turn(args.turn - 1, prof)
    print(f"turn {args.turn} (profiled): {ms:.1f} ms to the first token, resume {final.strata['resume_from']} "
          f"{final.strata['resume_pos']}, parts {final.strata.get('parts')}")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
        print(f"---- by {key}\n" + "\n".join(s.getvalue().splitlines()[6:]))
    e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
