"""Bytes a parked short conversation holds in host RAM: N one-line chats played in turn on one engine (each new chat
parks the one before in RAM, --park-resident 0), then the parked conversations' bytes (what ``stratactl cache``
reports) and the process's RSS growth, beside the reference of the same run: the bytes of the state each one
actually holds (its tokens' K/V, tokens x the pools' bytes per token, plus its running state).

Usage: python bench/park_bytes.py [--model default] [--synthetic-hybrid] [--n 64] [--out
bench/results/park_bytes_<model>_<commit>.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import commit as bench_commit, rss  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--synthetic-hybrid", action="store_true", help="a synthetic qwen35 hybrid instead of --model")
    ap.add_argument("--n", type=int, default=64, help="one-line chats played (all but the last end up parked)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from strata.engine import Engine, GenerationRequest
    path, name = a.model, "default"
    if a.synthetic_hybrid:
        import tempfile
        from strata.gguf import synth
        path = str(synth.write_synthetic(Path(tempfile.mkdtemp()) / "h.gguf", synth.preset("qwen35", "tiny", n_layer=4,
                                                                                           seed=21)))
        name = "hybrid"
    e = Engine(path, n_ctx=2048, ubatch=64, conversation_cache_mib=8192, park_resident=0)
    running = sum(int(st.memory.stats().get("running", {}).get("bytes_per_sequence", 0)) for st in e.stages)
    per_token = 0
    for st in e.stages:
        for f in getattr(st.memory, "fields", [st.memory]):
            pool = getattr(f, "pool", None)
            if pool is not None and getattr(f, "name", "") == "kv":
                per_token += pool.bytes_per_token
    base = rss()
    for i in range(a.n):
        r = e.render_chat([{"role": "user", "content": f"Say hi to number {i}."}])
        list(e.generate(GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, max_tokens=4,
                                          ignore_eos=True)))
    grown = rss() - base
    parked = [p for p in e.parked() if p["tier"] == "ram"]
    held = sum(p["bytes"] for p in parked)
    needed = sum(p["tokens"] * per_token + running * (1 + p["checkpoints"]) for p in parked)
    commit = bench_commit()
    out = {"model": name, "commit": commit, "conversations": a.n, "parked_in_ram": len(parked),
           "mean_tokens": sum(p["tokens"] for p in parked) / max(1, len(parked)),
           "bytes_per_parked": held / max(1, len(parked)), "needed_per_parked": needed / max(1, len(parked)),
           "held_over_needed": held / max(1, needed), "rss_growth_per_parked": grown / max(1, len(parked))}
    print(json.dumps(out, indent=1))
    dest = Path(a.out) if a.out else ROOT / "bench" / "results" / f"park_bytes_{name}_{commit}.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
