#!/usr/bin/env python3
"""Benchmark: what rendering a later turn of a long chat costs (ChatTemplate.render: the template, the token ids and
the cut points) with Qwen chat templates, the whole render (what a template that is not split gets: every turn
renders the chat and its new prefixes whole) against kept message outputs (strata.text.chat_window), in the same run.

Per template (the real ones under tests/data/templates) and conversation size (tokens of the default model's
tokenizer): an agent chat (a system prompt, tools; per turn a question, an answer that thinks and calls a tool, two
tool results, an answer with its reasoning), rendered once (the first request), then --turns later turns, each adding
an answer and a question, rendered by both arms one after the other (the machine's load drifts alike over them);
each later turn's result is checked equal across the arms (text, ids, cut points). Printed: the medians per arm and
the whole / kept ratio. JSON goes to bench/results/chat_render_<commit>.json.

Usage: PYTHONPATH=. python bench/chat_render.py [--sizes 4096 16384 65536] [--templates qwen3 qwen3.5 qwq]
       [--turns 8]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TEMPLATES = {"qwen3": "Qwen-Qwen3-0.6B.jinja", "qwen3.5": "Qwen3.5-4B.jinja", "qwq": "Qwen-QwQ-32B.jinja"}
TOOLS = [{"type": "function", "function": {"name": "search_archive", "description": "Search the archive's records.",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}, "limit": {"type": "integer"}}}}}]
QUESTION = ("Which river passes record {i}'s town, and what does the archive say of its bridges? Check the ledger "
            "entries before answering.")
THOUGHT = "The user asks about record {i}. I should search the archive for the town and its bridges first."
RESULT = ("Record {i}: the town stands on the river; the ledger lists {i} bridges, the oldest of stone, rebuilt after "
          "the flood of 17{i:02d}.")
ANSWER = "Record {i}'s town stands on the river; the ledger lists {i} bridges, the oldest of stone."


def turn(i: int) -> list[dict]:
    """One turn of the agent chat: five messages."""
    call = {"type": "function", "function": {"name": "search_archive",
                                             "arguments": {"query": f"record {i} bridges", "limit": 3}}}
    return [{"role": "user", "content": QUESTION.format(i=i)},
            {"role": "assistant", "content": "", "reasoning_content": THOUGHT.format(i=i), "tool_calls": [call]},
            {"role": "tool", "content": RESULT.format(i=i % 100)},
            {"role": "tool", "content": RESULT.format(i=(i + 1) % 100)},
            {"role": "assistant", "content": ANSWER.format(i=i), "reasoning_content": THOUGHT.format(i=i)}]


def conversation(template, n_tokens: int) -> list[dict]:
    """The agent chat of about n_tokens prompt tokens (as `template` renders and tokenizes it), ending in a
    question."""
    def chat(turns: int) -> list[dict]:
        msgs = [{"role": "system", "content": "You are a careful archivist."}]
        for i in range(turns):
            msgs += turn(i)
        return msgs + [{"role": "user", "content": "And the Lune?"}]
    per_turn = len(template.render(chat(11), tools=TOOLS).ids) - len(template.render(chat(1), tools=TOOLS).ids)
    return chat(max(1, round(n_tokens * 10 / per_turn)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--templates", nargs="+", default=list(TEMPLATES), choices=list(TEMPLATES))
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import gguf

    from strata.gguf.default_model import default_model_path
    from strata.text.chat_template import ChatTemplate
    from strata.text.tokenizer import Tokenizer
    r = gguf.GGUFReader(str(default_model_path()))
    tok = Tokenizer.from_gguf({k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")})
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = Path(args.out or ROOT / "bench" / "results" / f"chat_render_{commit}.json")
    results = dict(bench="chat_render", commit=commit, machine=platform.machine(), cpus=os.cpu_count(),
                   python=platform.python_version(), turns=args.turns, runs={})
    for name in args.templates:
        source = (ROOT / "tests" / "data" / "templates" / TEMPLATES[name]).read_text()
        for size in args.sizes:
            arms = {"whole": ChatTemplate(source, tok), "kept": ChatTemplate(source, tok)}
            arms["whole"].chunks = None
            msgs = conversation(ChatTemplate(source, tok), size)
            first, later = {}, {a: [] for a in arms}
            for a, t in arms.items():
                t0 = time.perf_counter()
                got = t.render(msgs, tools=TOOLS)
                first[a] = (time.perf_counter() - t0) * 1e3
            n_tokens = len(got.ids)
            for i in range(args.turns):
                msgs = msgs + [{"role": "assistant", "content": ANSWER.format(i=1000 + i),
                                "reasoning_content": THOUGHT.format(i=1000 + i)},
                               {"role": "user", "content": QUESTION.format(i=1000 + i)}]
                got = {}
                for a, t in (arms.items() if i % 2 == 0 else reversed(arms.items())):
                    t0 = time.perf_counter()
                    got[a] = t.render(msgs, tools=TOOLS)
                    later[a].append((time.perf_counter() - t0) * 1e3)
                w, k = got["whole"], got["kept"]
                if (w.text, w.tokens, w.cut_points) != (k.text, k.tokens, k.cut_points):
                    raise SystemExit(f"{name} {size}: the kept render differs from the whole render at turn {i}")
            chunks = arms["kept"].chunks
            row = dict(template=name, size=size, messages=len(msgs), prompt_tokens=n_tokens, first_ms=first,
                       later_ms=later, median_ms={a: statistics.median(v) for a, v in later.items()},
                       kept_stats=dict(chunks.stats) if chunks is not None else None)
            row["whole_over_kept"] = row["median_ms"]["whole"] / row["median_ms"]["kept"]
            results["runs"][f"{name}_{size}"] = row
            print(f"{name:8} ~{size:6} tokens ({n_tokens} ids, {len(msgs)} messages): first request whole "
                  f"{first['whole']:8.1f} kept {first['kept']:8.1f} ms; later turn (median of {args.turns}) whole "
                  f"{row['median_ms']['whole']:8.2f} kept {row['median_ms']['kept']:7.2f} ms  "
                  f"x{row['whole_over_kept']:.1f}", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
