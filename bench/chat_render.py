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

Cases (--cases): "agent" as above; "ws", "think", "parts" the same chat with contents the templates rewrite
(whitespace at their ends, reasoning inline, lists of text parts): see CASES. Each non-default case list writes
bench/results/chat_render_<cases>_<commit>.json. --fallbacks N also plays N requests of tools/agent_trial.py's
chat agent per template, as the trial writes it and as a thinking model's client sends it back, and counts the
renders that fell back to the whole render (run it on another checkout to compare: --fallbacks with PYTHONPATH
and the script's ROOT both that checkout).

Usage: PYTHONPATH=. python bench/chat_render.py [--sizes 4096 16384 65536] [--templates qwen3 qwen3.5 qwq]
       [--turns 8] [--cases agent ws think parts] [--fallbacks 24]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import commit as bench_commit  # noqa: E402
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


#: the chats' shapes: "agent" (reasoning as a field, contents as written), "ws" (contents with whitespace at their
#: ends as agents send them: shell output ending in a newline, answers starting with blank lines, questions ending
#: in one), "think" (reasoning inline in the assistant content, <think>...</think>), "parts" (questions as lists of
#: text parts; Qwen3.5 only, the others print a content as a string)
CASES = ("agent", "ws", "think", "parts")


def _answer(case: str, i: int, text: str) -> dict:
    if case == "think":
        return {"role": "assistant", "content": f"<think>\n{THOUGHT.format(i=i)}\n</think>\n\n{text}"}
    m = {"role": "assistant", "content": ("\n\n" + text) if case == "ws" and text else text,
         "reasoning_content": THOUGHT.format(i=i)}
    return m


def _question(case: str, i: int) -> dict:
    q = QUESTION.format(i=i)
    if case == "ws":
        return {"role": "user", "content": q + "\n"}
    if case == "parts":
        cut = q.index("?") + 1
        return {"role": "user", "content": [{"type": "text", "text": q[:cut]}, {"type": "text", "text": q[cut:]}]}
    return {"role": "user", "content": q}


def turn(i: int, case: str = "agent") -> list[dict]:
    """One turn of the agent chat: five messages."""
    call = {"type": "function", "function": {"name": "search_archive",
                                             "arguments": {"query": f"record {i} bridges", "limit": 3}}}
    end = "\n" if case == "ws" else ""
    return [_question(case, i),
            dict(_answer(case, i, ""), tool_calls=[call]),
            {"role": "tool", "content": RESULT.format(i=i % 100) + end},
            {"role": "tool", "content": RESULT.format(i=(i + 1) % 100) + end},
            _answer(case, i, ANSWER.format(i=i))]


def later(case: str, i: int) -> list[dict]:
    """The two messages a later turn adds: an answer and a question."""
    return [_answer(case, 1000 + i, ANSWER.format(i=1000 + i)), _question(case, 1000 + i)]


def conversation(template, n_tokens: int, case: str = "agent") -> list[dict]:
    """The agent chat of about n_tokens prompt tokens (as `template` renders and tokenizes it), ending in a
    question."""
    def chat(turns: int) -> list[dict]:
        msgs = [{"role": "system", "content": "You are a careful archivist."}]
        for i in range(turns):
            msgs += turn(i, case)
        return msgs + [{"role": "user", "content": "And the Lune?"}]
    per_turn = len(template.render(chat(11), tools=TOOLS).ids) - len(template.render(chat(1), tools=TOOLS).ids)
    return chat(max(1, round(n_tokens * 10 / per_turn)))


def trial_chat(case: str, turns: int, objects: bool) -> list[list[dict]]:
    """The requests of one chat-route agent of tools/agent_trial.py (its system prompt, asks, tools and tool
    results; the Messages and Responses routes hand the template the same message shapes): per turn an answer that
    calls a tool (arguments a JSON string, or an object where `objects`: Qwen3.5's template reads them as one),
    its result, an answer and the next ask (a null content as the chat route reads it: ""). case "trial": the contents as the trial writes them; "agent": as a
    thinking model's client sends them back: shell output ending in a newline, every third answer starting with
    blank lines and every third with its reasoning inline (<think>...</think>), every fourth ask ending in a
    newline."""
    from tools.agent_trial import ASKS, SECRETS, SYSTEM, tool_output
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Secret project code: {SECRETS['chat']}. " + ASKS[0]}]
    out = []
    for t in range(turns):
        out.append([dict(m) for m in msgs])
        args = json.dumps({"path": f"src/app/f{t}.py"})
        text = f"The file defines {t + 2} handlers; the tests cover them."
        if case == "agent" and t % 3 == 0:
            text = "\n\n" + text
        elif case == "agent" and t % 3 == 1:
            text = f"<think>\nThe user wants turn {t} read.\n</think>\n\n" + text
        result = tool_output("chat", "read_file", args, t) + ("\n" if case == "agent" else "")
        ask = ASKS[(t + 1) % len(ASKS)] + ("\n" if case == "agent" and t % 4 == 0 else "")
        msgs += [{"role": "assistant", "content": "", "tool_calls": [
                     {"id": f"call_{t}", "type": "function",
                      "function": {"name": "read_file", "arguments": json.loads(args) if objects else args}}]},
                 {"role": "tool", "tool_call_id": f"call_{t}", "content": result},
                 {"role": "assistant", "content": text}, {"role": "user", "content": ask}]
    return out


def fallbacks(names: list[str], turns: int) -> dict:
    """Per template and case of trial_chat: the requests whose render fell back to the whole render (the kept
    path's own count, and whether it was turned off)."""
    from strata.text.chat_template import ChatTemplate
    from tools.agent_trial import _oa_tools_chat
    tok = _tokenizer()
    out = {}
    for name in names:
        source = (ROOT / "tests" / "data" / "templates" / TEMPLATES[name]).read_text()
        for case in ("trial", "agent"):
            t = ChatTemplate(source, tok)
            for msgs in trial_chat(case, turns, objects=name == "qwen3.5"):
                t.render(msgs, tools=_oa_tools_chat())
            stats = dict(t.chunks.stats) if t.chunks is not None else None
            out[f"{name}_{case}"] = dict(requests=turns, fallbacks=stats["fallbacks"] if stats else turns,
                                         turned_off=stats is None, stats=stats)
            print(f"{name:8} {case:6} {turns} requests: {out[f'{name}_{case}']['fallbacks']} rendered whole"
                  f"{' (kept path turned off)' if stats is None else ''}", flush=True)
    return out


def _tokenizer():
    import gguf

    from strata.gguf.default_model import default_model_path
    from strata.text.tokenizer import Tokenizer
    r = gguf.GGUFReader(str(default_model_path()))
    return Tokenizer.from_gguf({k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[4096, 16384, 65536])
    ap.add_argument("--templates", nargs="+", default=list(TEMPLATES), choices=list(TEMPLATES))
    ap.add_argument("--cases", nargs="+", default=["agent"], choices=CASES)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--fallbacks", type=int, default=0, metavar="TURNS",
                    help="also play TURNS requests of tools/agent_trial.py's chat agent per template and count "
                         "the renders that fell back")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from strata.text.chat_template import ChatTemplate
    tok = _tokenizer()
    commit = bench_commit()
    what = "chat_render" if args.cases == ["agent"] else "chat_render_" + "_".join(args.cases)
    out = Path(args.out or ROOT / "bench" / "results" / f"{what}_{commit}.json")
    results = dict(bench="chat_render", commit=commit, machine=platform.machine(), cpus=os.cpu_count(),
                   python=platform.python_version(), turns=args.turns, runs={})
    if args.fallbacks:
        results["fallbacks"] = fallbacks(args.templates, args.fallbacks)
    for name in args.templates:
        source = (ROOT / "tests" / "data" / "templates" / TEMPLATES[name]).read_text()
        for case in args.cases:
            if case == "parts" and name != "qwen3.5":
                continue
            for size in args.sizes:
                results["runs"][name + ("" if case == "agent" else f"_{case}") + f"_{size}"] = \
                    run(ChatTemplate, source, tok, name, case, size, args.turns)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(results, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


def run(ChatTemplate, source: str, tok, name: str, case: str, size: int, turns: int) -> dict:
    """One template, case and size: the first request and `turns` later turns, whole against kept."""
    arms = {"whole": ChatTemplate(source, tok), "kept": ChatTemplate(source, tok)}
    arms["whole"].chunks = None
    msgs = conversation(ChatTemplate(source, tok), size, case)
    first, later_ms = {}, {a: [] for a in arms}
    for a, t in arms.items():
        t0 = time.perf_counter()
        got = t.render(msgs, tools=TOOLS)
        first[a] = (time.perf_counter() - t0) * 1e3
    n_tokens = len(got.ids)
    for i in range(turns):
        msgs = msgs + later(case, i)
        got = {}
        for a, t in (arms.items() if i % 2 == 0 else reversed(arms.items())):
            t0 = time.perf_counter()
            got[a] = t.render(msgs, tools=TOOLS)
            later_ms[a].append((time.perf_counter() - t0) * 1e3)
        w, k = got["whole"], got["kept"]
        if (w.text, w.tokens, w.cut_points, w.content_safe) != (k.text, k.tokens, k.cut_points, k.content_safe):
            raise SystemExit(f"{name} {case} {size}: the kept render differs from the whole render at turn {i}")
    chunks = arms["kept"].chunks
    row = dict(template=name, case=case, size=size, messages=len(msgs), prompt_tokens=n_tokens,
               content_safe=got["whole"].content_safe, first_ms=first, later_ms=later_ms,
               median_ms={a: statistics.median(v) for a, v in later_ms.items()},
               kept_stats=dict(chunks.stats) if chunks is not None else None)
    row["whole_over_kept"] = row["median_ms"]["whole"] / row["median_ms"]["kept"]
    print(f"{name:8} {case:6} ~{size:6} tokens ({n_tokens} ids, {len(msgs)} messages): first request whole "
          f"{first['whole']:8.1f} kept {first['kept']:8.1f} ms; later turn (median of {turns}) whole "
          f"{row['median_ms']['whole']:8.2f} kept {row['median_ms']['kept']:7.2f} ms  "
          f"x{row['whole_over_kept']:.1f}  fallbacks {row['kept_stats']['fallbacks'] if chunks else 'off'}",
          flush=True)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
