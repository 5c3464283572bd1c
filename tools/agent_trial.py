#!/usr/bin/env python3
"""Coding agents' trial: real agent loops (the `openai` and `anthropic` SDKs) against a real `strata serve`, every
answer checked against the same conversation replayed alone on a fresh `--parallel 1` daemon with `cache_prompt:
false`.

Agents, all greedy, all on one long shared system prompt, run concurrently (threads):
  responses  Responses API, streamed, function tools, `previous_response_id` chains, `function_call_output` fed back;
             one turn's stream closed mid-way and retried with the same `previous_response_id`
  messages   Messages API (anthropic), streamed, system as blocks, tool_use / tool_result blocks, long multi-turn
  chat       chat completions, streamed, tools with `tool_choice` required / named / auto, parallel tool calls
  sub-K      sub-agents of an orchestrator (Responses API chains), each with a secret, one cancelled mid-stream and
             retried, one regenerating its last turn, one editing an earlier turn (a chat-route sub-agent)
Tool results are long (a few hundred tokens each), so each conversation grows to a few thousand tokens.

Checked per turn: the answer (text, tool calls' JSON, finish reason, prompt / completion token counts) equals the
reference's; the tokens read beyond the new ones (the prompt minus what the previous turn's prompt and answer
hold, against what the daemon says it read); no 5xx; no other agent's secret in an answer; stream event order as
each API documents it; no SDK warning.

Usage: PYTHONPATH=. python tools/agent_trial.py [--arms p1,p4,p4w] [--turns 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import anthropic  # noqa: E402
import openai  # noqa: E402

from tests.daemon import Daemon, WorkerProc, free_port  # noqa: E402

FACTS = ("The repository is a small Python web service. Source lives in src/app, tests in tests/, the build is "
         "driven by a Makefile. Style: four-space indents, type hints, docstrings on public functions. Never push "
         "to main; open a branch per change. Run the tests before every commit. Prefer small diffs. ")
SYSTEM = ("You are a careful coding agent working in a git repository. Use the tools to inspect files and run "
          "commands, then answer briefly. " + FACTS * 6)
SECRETS = {"responses": "TANGO", "messages": "WALRUS", "chat": "QUARTZ", "sub-0": "PLUM", "sub-1": "OSLO",
           "sub-2": "KIWI", "sub-3": "JADE"}
TOOLS_FN = [
    ("read_file", "Read a file of the repository.", {"path": {"type": "string"}}, ["path"]),
    ("run_shell", "Run a shell command in the repository.", {"cmd": {"type": "string"}}, ["cmd"]),
    ("search", "Search the repository for a string.", {"query": {"type": "string"}}, ["query"]),
]
ASKS = ["Look at src/app/main.py and tell me what it does.", "Now run the tests.", "Search for TODO comments.",
        "Read the Makefile.", "What would you change first?", "Check git status.", "Read tests/test_main.py.",
        "Summarise what you found in two lines.", "Read src/app/db.py.", "List the files under src/app."]


def tool_output(agent: str, name: str, args: str, turn: int) -> str:
    """A deterministic, long tool result (a few hundred tokens) carrying the agent's secret."""
    lines = [f"# {name} {args[:60]} (turn {turn}) project code {SECRETS[agent]}"]
    for k in range(16 if agent == "messages" else 12):
        lines.append(f"def handler_{turn}_{k}(request):  # line {k}: returns the {k}th route's answer")
    return "\n".join(lines)


def _oa_tools_chat():
    return [{"type": "function", "function": {"name": n, "description": d, "parameters": {
        "type": "object", "properties": p, "required": r}}} for n, d, p, r in TOOLS_FN]


def _oa_tools_resp():
    return [{"type": "function", "name": n, "description": d, "parameters": {
        "type": "object", "properties": p, "required": r}} for n, d, p, r in TOOLS_FN]


def _an_tools():
    return [{"name": n, "description": d, "input_schema": {"type": "object", "properties": p, "required": r}}
            for n, d, p, r in TOOLS_FN]


class Record:
    """One agent's turns: what was sent (the fully expanded conversation, for the replay) and what came back."""

    def __init__(self, agent: str, route: str):
        self.agent, self.route = agent, route
        self.turns: list[dict] = []
        self.problems: list[str] = []


# ---------------------------------------------------------------- stream checks (the APIs' documented order)

def check_responses_events(events, problems, tag):
    types = [e.type for e in events]
    if not types or types[0] != "response.created" or types[1:2] != ["response.in_progress"]:
        problems.append(f"{tag}: stream starts {types[:2]}")
    if types and types[-1] not in ("response.completed", "response.incomplete"):
        problems.append(f"{tag}: stream ends {types[-1:]}")
    seq = [e.sequence_number for e in events]
    if seq != sorted(seq) or len(set(seq)) != len(seq):
        problems.append(f"{tag}: sequence numbers not increasing")
    open_items = set()
    for e in events:
        if e.type == "response.output_item.added":
            open_items.add(e.output_index)
        elif e.type == "response.output_item.done":
            if e.output_index not in open_items:
                problems.append(f"{tag}: item {e.output_index} done before added")
            open_items.discard(e.output_index)
        elif e.type.endswith(".delta") and getattr(e, "output_index", None) not in open_items:
            problems.append(f"{tag}: {e.type} outside its item")
    if open_items:
        problems.append(f"{tag}: items never done {open_items}")


def check_messages_events(events, problems, tag):
    types = [e.type for e in events]
    if not types or types[0] != "message_start" or types[-1] != "message_stop":
        problems.append(f"{tag}: stream {types[:1]}..{types[-1:]}")
    if "message_delta" not in types or types.index("message_delta") != len(types) - 2:
        problems.append(f"{tag}: message_delta not just before message_stop")
    opened = None
    for e in events:
        if e.type == "content_block_start":
            if opened is not None:
                problems.append(f"{tag}: block {e.index} started inside {opened}")
            opened = e.index
        elif e.type == "content_block_delta" and e.index != opened:
            problems.append(f"{tag}: delta for block {e.index} while {opened} open")
        elif e.type == "content_block_stop":
            if e.index != opened:
                problems.append(f"{tag}: stop of {e.index} while {opened} open")
            opened = None


def check_chat_chunks(chunks, problems, tag):
    with_choice = [c for c in chunks if c.choices]
    if not with_choice or with_choice[0].choices[0].delta.role != "assistant":
        problems.append(f"{tag}: first chunk without the role")
    fins = [i for i, c in enumerate(with_choice) if c.choices[0].finish_reason]
    if fins != [len(with_choice) - 1]:
        problems.append(f"{tag}: finish_reason on chunks {fins} of {len(with_choice)}")
    if chunks[-1].choices or chunks[-1].usage is None:
        problems.append(f"{tag}: no usage chunk last")


# ---------------------------------------------------------------- the agents

def _resp_expand(items_so_far, resp_output):
    """The Responses output items as input items (what previous_response_id stands for)."""
    out = []
    for it in resp_output:
        if it.type == "message":
            out.append({"role": "assistant", "content": "".join(c.text for c in it.content if c.type == "output_text")})
        elif it.type == "function_call":
            out.append({"type": "function_call", "call_id": it.call_id, "name": it.name, "arguments": it.arguments})
    return items_so_far + out


def _resp_result(r):
    calls = [(it.name, it.arguments) for it in r.output if it.type == "function_call"]
    text = "".join(c.text for it in r.output if it.type == "message" for c in it.content if c.type == "output_text")
    u = r.usage
    return {"text": text, "calls": calls, "finish": r.status, "prompt": u.input_tokens,
            "cached": u.input_tokens_details.cached_tokens, "completion": u.output_tokens,
            "read": (r.model_extra or {}).get("timings", {}).get("prompt_n"), "id_slot": (r.model_extra or {}).get(
                "strata", {}).get("id_slot"), "resume_from": (r.model_extra or {}).get("strata", {}).get("resume_from")}


def responses_agent(base, rec: Record, turns: int, cancel_turn: int | None = None, regenerate: bool = False):
    """A Responses-API agent loop: each turn previous_response_id + new input items; streamed."""
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
    prev = None
    full: list = []          # every input item so far, expanded (the replay's input)
    pending = [{"role": "user", "content": f"Secret project code: {SECRETS[rec.agent]}. " + ASKS[0]}]
    for t in range(turns):
        body = dict(model="default", instructions=SYSTEM, input=pending, tools=_oa_tools_resp(),
                    max_output_tokens=40, temperature=0, previous_response_id=prev)
        if t == cancel_turn:     # close the stream after a few events, then retry the same request
            with c.responses.create(stream=True, **body) as s:
                for k, _ in enumerate(s):
                    if k >= 4:
                        break
        events = []
        with c.responses.create(stream=True, **body) as s:
            for e in s:
                events.append(e)
        check_responses_events(events, rec.problems, f"{rec.agent} turn {t}")
        r = events[-1].response
        full = full + pending
        res = _resp_result(r)
        rec.turns.append({"send": {"instructions": SYSTEM, "input": list(full)}, "got": res})
        if regenerate and t == turns - 1:
            with c.responses.create(stream=True, **body) as s:
                again = _resp_result([e for e in s][-1].response)
            if (again["text"], again["calls"]) != (res["text"], res["calls"]):
                rec.problems.append(f"{rec.agent}: the regenerated last turn differs: {again} vs {res}")
            rec.turns[-1]["regen"] = again
        full = _resp_expand(full, r.output)
        prev = r.id
        calls = [it for it in r.output if it.type == "function_call"]
        if calls:
            pending = [{"type": "function_call_output", "call_id": it.call_id,
                        "output": tool_output(rec.agent, it.name, it.arguments, t)} for it in calls]
        else:
            pending = [{"role": "user", "content": ASKS[(t + 1) % len(ASKS)] + " Use a tool."}]


def messages_agent(base, rec: Record, turns: int):
    c = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=600)
    system = [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Keep answers short."}]
    msgs = [{"role": "user", "content": [{"type": "text", "text":
                                          f"Secret project code: {SECRETS[rec.agent]}. " + ASKS[0]}]}]
    for t in range(turns):
        events = []
        with c.messages.stream(model="default", max_tokens=40, system=system, messages=msgs, tools=_an_tools(),
                               extra_body={"temperature": 0}) as s:
            for e in s:      # the helper parses every raw event
                events.append(e)
            m = s.get_final_message()
        raw = [e for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                               "content_block_stop", "message_delta", "message_stop")]
        check_messages_events(raw, rec.problems, f"{rec.agent} turn {t}")
        text = "".join(b.text for b in m.content if b.type == "text")
        calls = [(b.name, json.dumps(b.input, sort_keys=True)) for b in m.content if b.type == "tool_use"]
        u = m.usage
        rec.turns.append({"send": {"system": system, "messages": json.loads(json.dumps(msgs))},
                          "got": {"text": text, "calls": calls, "finish": m.stop_reason,
                                  "prompt": u.input_tokens + (u.cache_read_input_tokens or 0),
                                  "cached": u.cache_read_input_tokens, "completion": u.output_tokens,
                                  "read": u.input_tokens, "id_slot": (m.model_extra or {}).get("strata", {}).get(
                                      "id_slot"), "resume_from": (m.model_extra or {}).get("strata", {}).get(
                                      "resume_from")}})
        msgs = msgs + [{"role": "assistant", "content": [b.model_dump(exclude_none=True, include={
            "type", "text", "id", "name", "input"}) for b in m.content]}]
        uses = [b for b in m.content if b.type == "tool_use"]
        if uses:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": [
                {"type": "text", "text": tool_output(rec.agent, b.name, json.dumps(b.input), t)}]} for b in uses]})
        else:
            msgs.append({"role": "user", "content": ASKS[(t + 1) % len(ASKS)] + " Use a tool."})


def _chat_stream(c, msgs, tool_choice, rec, tag, max_tokens=40):
    chunks = []
    with c.chat.completions.create(model="default", messages=msgs, tools=_oa_tools_chat(), tool_choice=tool_choice,
                                   max_tokens=max_tokens, temperature=0, stream=True,
                                   stream_options={"include_usage": True}) as s:
        for ch in s:
            chunks.append(ch)
    check_chat_chunks(chunks, rec.problems, tag)
    text, calls = "", {}
    finish = extra = None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            e["id"] = tc.id or e["id"]
            e["name"] += (tc.function.name or "") if tc.function else ""
            e["arguments"] += (tc.function.arguments or "") if tc.function else ""
        if ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
            extra = ch.model_extra or {}
    u = chunks[-1].usage
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
    got = {"text": text, "calls": [(e["name"], e["arguments"]) for _, e in sorted(calls.items())], "finish": finish,
           "prompt": u.prompt_tokens, "cached": cached, "completion": u.completion_tokens,
           "read": extra.get("timings", {}).get("prompt_n"), "id_slot": extra.get("strata", {}).get("id_slot"),
           "resume_from": extra.get("strata", {}).get("resume_from")}
    return got, [e for _, e in sorted(calls.items())]


def chat_agent(base, rec: Record, turns: int, edit_turn: int | None = None):
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Secret project code: {SECRETS[rec.agent]}. " + ASKS[0]}]
    choices = ["required", {"type": "function", "function": {"name": "read_file"}}, "auto"]
    for t in range(turns):
        if edit_turn is not None and t == edit_turn:      # edit an earlier turn: the first question, reworded
            msgs = msgs[:2]
            msgs[1] = {"role": "user", "content": f"Secret project code: {SECRETS[rec.agent]}. " + ASKS[3]}
        tc = choices[t % 3]
        got, calls = _chat_stream(c, msgs, tc, rec, f"{rec.agent} turn {t}")
        rec.turns.append({"send": {"messages": json.loads(json.dumps(msgs)), "tool_choice": tc}, "got": got})
        if calls:
            msgs = msgs + [{"role": "assistant", "content": got["text"] or None, "tool_calls": [
                {"id": e["id"], "type": "function", "function": {"name": e["name"], "arguments": e["arguments"]}}
                for e in calls]}]
            msgs += [{"role": "tool", "tool_call_id": e["id"],
                      "content": tool_output(rec.agent, e["name"], e["arguments"], t)} for e in calls]
        else:
            msgs = msgs + [{"role": "assistant", "content": got["text"]},
                           {"role": "user", "content": ASKS[(t + 1) % len(ASKS)]}]


# ---------------------------------------------------------------- the reference replay

_REPLAYED: dict = {}


def _key(route, send):
    """A turn's replay key: call ids numbered in order of appearance (they differ between arms, never the tokens
    the generic format renders)."""
    text, ids = json.dumps([route, send], sort_keys=True), {}
    return re.sub(r'"(call_|toolu_|fc_)[A-Za-z0-9_]+"', lambda m: ids.setdefault(m.group(0), f'"id{len(ids)}"'), text)


def replay(base, rec: Record):
    """Each recorded turn sent alone, whole, not streamed, with cache_prompt false -> problems."""
    bad = []
    oc = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
    ac = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=600)
    for t, turn in enumerate(rec.turns):
        s = turn["send"]
        key = _key(rec.route, s)
        if key in _REPLAYED:
            want = _REPLAYED[key]
        elif rec.route == "responses":
            r = oc.responses.create(model="default", instructions=s["instructions"], input=s["input"],
                                    tools=_oa_tools_resp(), max_output_tokens=40, temperature=0, store=False,
                                    extra_body={"cache_prompt": False})
            want = _resp_result(r)
        elif rec.route == "messages":
            m = ac.messages.create(model="default", max_tokens=40, system=s["system"], messages=s["messages"],
                                   tools=_an_tools(), extra_body={"temperature": 0, "cache_prompt": False})
            want = {"text": "".join(b.text for b in m.content if b.type == "text"),
                    "calls": [(b.name, json.dumps(b.input, sort_keys=True)) for b in m.content if b.type == "tool_use"],
                    "finish": m.stop_reason, "prompt": m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0),
                    "completion": m.usage.output_tokens}
        else:
            r = oc.chat.completions.create(model="default", messages=s["messages"], tools=_oa_tools_chat(),
                                           tool_choice=s["tool_choice"], max_tokens=40, temperature=0,
                                           extra_body={"cache_prompt": False})
            msg = r.choices[0].message
            want = {"text": msg.content or "", "calls": [(x.function.name, x.function.arguments)
                                                         for x in msg.tool_calls or []],
                    "finish": r.choices[0].finish_reason, "prompt": r.usage.prompt_tokens,
                    "completion": r.usage.completion_tokens}
        _REPLAYED[key] = want
        got = turn["got"]
        turn["want"] = want
        for k in ("text", "calls", "finish", "prompt", "completion"):
            if got[k] != want[k]:
                bad.append(f"{rec.agent} turn {t}: {k} {got[k]!r} != alone {want[k]!r}")
    return bad


def rereads(rec: Record):
    """Per turn: tokens read beyond the new ones (prompt - what the previous turn's prompt + answer held)."""
    out = []
    for t, turn in enumerate(rec.turns):
        g = turn["got"]
        if t == 0 or g["read"] is None:
            out.append(None)
            continue
        p = rec.turns[t - 1]["got"]
        new = g["prompt"] - (p["prompt"] + p["completion"])
        out.append(g["read"] - max(new, 0))
    return out


def run_arm(name, args, turns, tmp: Path):
    flags = {"p1": ["--parallel", "1"], "p4": ["--parallel", "4"], "p4w": ["--parallel", "4"]}[name]
    worker = None
    if name == "p4w":
        worker = WorkerProc().start()
        flags += ["--remote-stage", worker.address, "--layer-split", "15"]
    d = Daemon(tmp / name, *flags, port=free_port(), n_ctx=args.n_ctx).start()
    base = f"http://127.0.0.1:{d.port}"
    recs = [Record("responses", "responses"), Record("messages", "messages"), Record("chat", "chat")]
    subs = [Record(f"sub-{k}", "responses") for k in range(3)] + [Record("sub-3", "chat")]
    jobs = [(responses_agent, recs[0], dict(cancel_turn=2)), (messages_agent, recs[1], {}),
            (chat_agent, recs[2], {}), (responses_agent, subs[0], dict(cancel_turn=3)),
            (responses_agent, subs[1], dict(regenerate=True)), (responses_agent, subs[2], {}),
            (chat_agent, subs[3], dict(edit_turn=4))]
    errors = []
    t0 = time.monotonic()

    def go(fn, rec, kw):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                fn(base, rec, turns, **kw)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{rec.agent}: {type(e).__name__}: {e}")
            for x in w:
                rec.problems.append(f"warning {x.category.__name__}: {x.message}")
    threads = [threading.Thread(target=go, args=j) for j in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    metrics = {k: d.metric(k) for k in ("strata_batched_rows_max", "strata_batched_steps_total",
                                         "strata_prompt_tokens_total")}
    fivexx = sum(d.metric("strata_requests_total", {"status": s}) for s in ("500", "502", "503", "504")) - d.metric(
        "strata_requests_total", {"route": "/health", "status": "503"})
    log_errors = [ln for ln in d.log_lines() if ln.get("level") in ("error", "critical")]
    d.stop()
    if worker:
        worker.stop()
    return {"recs": recs + subs, "errors": errors, "wall_s": wall, "metrics": metrics, "fivexx": fivexx,
            "log_errors": log_errors[:5]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default="p1,p4,p4w")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="agent-trial-"))
    for a in args.arms.split(","):
        (tmp / a).mkdir()
    (tmp / "ref").mkdir()
    summary = {}
    ref = None
    for arm in args.arms.split(","):
        res = run_arm(arm, args, args.turns, tmp)
        ref = ref or Daemon(tmp / "ref", "--parallel", "1", port=free_port(), n_ctx=args.n_ctx).start()
        base = f"http://127.0.0.1:{ref.port}"
        arm_out = {"wall_s": round(res["wall_s"], 1), "errors": res["errors"], "fivexx": res["fivexx"],
                   "metrics": res["metrics"], "log_errors": res["log_errors"], "agents": {}}
        for rec in res["recs"]:
            try:
                diffs = replay(base, rec)
            except Exception as e:  # noqa: BLE001
                diffs = [f"replay failed: {type(e).__name__}: {e}"]
            leaks = [f"{rec.agent} turn {t}: {other}'s secret" for t, turn in enumerate(rec.turns)
                     for other, sec in SECRETS.items() if other != rec.agent and sec in turn["got"]["text"] +
                     json.dumps(turn["got"]["calls"])]
            arm_out["agents"][rec.agent] = {
                "turns": len(rec.turns), "ctx_last": rec.turns[-1]["got"]["prompt"] if rec.turns else 0,
                "diffs": diffs, "problems": rec.problems, "leaks": leaks, "rereads": rereads(rec),
                "resume_from": [t["got"]["resume_from"] for t in rec.turns],
                "got": [t["got"] for t in rec.turns]}
        summary[arm] = arm_out
        print(f"== {arm}: wall {arm_out['wall_s']} s, errors {res['errors']}, 5xx {res['fivexx']}, "
              f"metrics {res['metrics']}")
        for a, v in arm_out["agents"].items():
            print(f"  {a}: turns {v['turns']} ctx {v['ctx_last']} diffs {len(v['diffs'])} problems "
                  f"{len(v['problems'])} leaks {len(v['leaks'])} rereads {v['rereads']} from {v['resume_from']}")
            for x in (v["diffs"] + v["problems"] + v["leaks"])[:6]:
                print("     ", x[:300])
        sys.stdout.flush()
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    ref.stop()


if __name__ == "__main__":
    main()
