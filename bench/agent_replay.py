"""An agent replayed against the engine: a main conversation with a long system prompt spawns four sub-agents that
share it, each running several tool-call turns, all interleaved; then both processes restart and the same agent goes
on from session files (each conversation saved after its last step, loaded before its first step after the
restart). Run in one process and over a remote stage (a `strata worker` process on loopback running the layers after
the split). Per step: prompt tokens, the tokens the engine had not seen (the prompt past the longest common prefix
with every prompt + answer it read before, an answer's last token never being read back: the reference), the tokens it read, the re-read beyond the new ones (target
zero unless a budget forced an eviction) and time to first token (from generate() to the first token event, a
session load included where there is one). Greedy answers of both arms are compared with each other. With
--llama-server BIN the same agent runs against llama.cpp's llama-server on the same GGUF and token ids (one slot, its
RAM prompt cache with --cache-ram, its slot files across the restart; TTFT at its streaming client).

With --concurrent N the sub-agents run at once instead: each round's four sub-agent steps are sent together to
`strata serve --parallel N`, to `strata serve --parallel 1` (queued behind each other: the reference) and to
`llama-server -np N` (--llama-server), through each server's chat route as an agent calls it (the same messages; the
GGUF's template); re-reads, TTFT per step and each round's wall time.

Usage: python bench/agent_replay.py [--model default] [--system-tokens 1200] [--rounds 3] [--threads 2]
       [--split 15] [--arms local,remote] [--device cpu|cuda] [--llama-server BIN]
       [--out bench/results/agent_replay_<cpu|cuda>_<commit>.json]
       python bench/agent_replay.py --concurrent 4 [--device cpu|cuda] [--llama-server BIN] ...
       [--out bench/results/agent_replay_concurrent_<cpu|cuda>_<commit>.json]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench.common import commit as bench_commit, tree_env  # noqa: E402

from strata.engine import Engine                                  # noqa: E402
from strata.engine.types import GenerationRequest, TokenEvent    # noqa: E402
from strata.text.token_ids import as_ids, common_prefix           # noqa: E402
from daemons import free_port, wait_healthy                       # noqa: E402

TOOLS = ["grep", "read_file", "run_tests", "list_dir"]
N_ANSWER = 12


def system_prompt(engine: Engine, tokens: int) -> str:
    """A coding agent's instructions, repeated up to about `tokens` tokens."""
    base = ("You are the lead agent of a coding team. Split the task, hand each part to a sub-agent, read their "
            "reports and decide. Tools: grep(pattern), read_file(path), run_tests(target), list_dir(path). Answer "
            "with one tool call per turn, as JSON, until the part is done. ")
    text = base
    while len(engine.tokenize_prompt(text + base, add_bos=False)) < tokens:
        text += base
    return text


def start_worker(model: str, threads: int | None, pool_ctx: int, device: str = "cpu"):
    cmd = [sys.executable, "-m", "strata.cli.main", "worker", "--listen", "127.0.0.1:0", "--model", model,
           "--log-level", "warning", "--kv-pool-ctx", str(pool_ctx), "--device", device] + \
        (["--threads", str(threads)] if threads else [])
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=tree_env())
    for line in p.stderr:
        if line.startswith("strata worker listening on"):
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, line.strip().rpartition(" ")[2]
    raise RuntimeError(f"the worker did not start (exit {p.wait()}): {p.stderr.read()[-2000:]}")


class Agent:
    """The conversations (name -> messages) and what the engine has been sent (every prompt + answer)."""

    def __init__(self, system: str):
        self.chats: dict[str, list[dict]] = {}
        self.system = system
        self.sent: list[np.ndarray] = []

    def new_tokens(self, prompt: np.ndarray) -> int:
        """The prompt's tokens past its longest common prefix with everything sent before."""
        seen = max((common_prefix(prompt, s) for s in self.sent), default=0)
        return len(prompt) - seen

    def schedule(self, rounds: int, phase: int) -> list[tuple[str, str]]:
        """(conversation, the message its step appends) in interleaved order: the main's task, then per round each
        sub-agent's tool turn and the main reading their reports."""
        steps = []
        if phase == 0:
            steps.append(("main", "Task: the login page times out under load. Plan the work."))
            for i in range(4):
                steps.append((f"sub{i}", f"Sub-task {i}: investigate part {i} of the timeout with "
                                         f"{TOOLS[i]}. Start."))
        for r in range(rounds):
            for i in range(4):
                steps.append((f"sub{i}", f"Tool {TOOLS[(i + r) % 4]} returned: {'line %d ok; ' % (r * 7 + i) * 6}"
                                         f"(phase {phase}, round {r}). Next call?"))
            steps.append(("main", f"Reports of round {r} (phase {phase}) are in. Decide the next step."))
        return steps


def run_arm(name: str, make_engine, system_tokens: int, rounds: int, session_dir: Path) -> dict:
    """The agent's two phases on engines from make_engine() (a restart between them) -> the arm's steps."""
    steps_out = []
    engine = make_engine()
    try:
        agent = Agent(system_prompt(engine, system_tokens))
        for phase in (0, 1):
            if phase == 1:
                engine.close()
                engine = make_engine()                 # a restart: nothing kept but the session files
                loaded: set[str] = set()
            for chat, text in agent.schedule(rounds, phase):
                msgs = agent.chats.setdefault(chat, [{"role": "system", "content": agent.system}])
                msgs.append({"role": "user", "content": text})
                t0 = time.perf_counter()
                load_ms = 0.0
                if phase == 1 and chat not in loaded:
                    loaded.add(chat)
                    r = engine.slot_restore(0, f"{chat}.bin")
                    load_ms = float(r["timings"]["restore_ms"])
                rendered = engine.render_chat(msgs)
                prompt = as_ids(rendered.tokens)
                new = agent.new_tokens(prompt)
                req = GenerationRequest(prompt_tokens=prompt, cut_points=rendered.cut_points, max_tokens=N_ANSWER)
                ttft, toks, final = None, [], None
                for ev in engine.generate(req):
                    if isinstance(ev, TokenEvent):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        toks.append(int(ev.token_id))
                    else:
                        final = ev
                read = int(final.timings["prompt_n"])
                steps_out.append(dict(phase=phase, chat=chat, prompt=len(prompt), new=new, read=read,
                                      reread=read - new, resume_from=final.strata["resume_from"],
                                      resume_pos=final.strata["resume_pos"], load_ms=round(load_ms, 2),
                                      ttft_ms=round(1e3 * (ttft if ttft is not None else
                                                           time.perf_counter() - t0), 2),
                                      answer=toks))
                # what the engine read: the prompt and the answer but its last token (sampled, never read back)
                agent.sent.append(np.concatenate([prompt, np.asarray(toks[:-1], np.int32)]))
                msgs.append({"role": "assistant", "content": engine.detokenize(toks)})
                engine.slot_save(0, f"{chat}.bin")      # its latest state, for the restart
                s = steps_out[-1]
                print(f"  {name} phase {phase} {chat:5s} prompt {s['prompt']:5d} new {s['new']:4d} read "
                      f"{s['read']:4d} re-read {s['reread']:4d} from {s['resume_from']:10s} ttft {s['ttft_ms']:8.1f}"
                      f" ms" + (f" (load {load_ms:.1f} ms)" if load_ms else ""), flush=True)
    finally:
        engine.close()
    return {"steps": steps_out,
            "reread_total": sum(max(0, s["reread"]) for s in steps_out),
            "new_total": sum(s["new"] for s in steps_out),
            "read_total": sum(s["read"] for s in steps_out),
            "ttft_ms_median": float(np.median([s["ttft_ms"] for s in steps_out])),
            "ttft_ms_after_restart_median": float(np.median([s["ttft_ms"] for s in steps_out if s["phase"] == 1]))}


class CompletionServer:
    """A server process speaking llama-server's /completion on 127.0.0.1:port (llama-server, or `strata serve`),
    driven with token ids, streaming: started by the constructor (cmd), healthy before it returns."""

    def __init__(self, cmd: list[str], port: int, env: dict | None = None):
        self.cmd, self.port = cmd, port
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        wait_healthy(self.proc, f"http://127.0.0.1:{port}", cmd, cmd[0], self.close)

    def _get(self, path: str) -> dict:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return json.loads(r.read())

    def _post(self, path: str, body: dict):
        import urllib.request
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=3600)

    def generate(self, prompt: np.ndarray, n: int, slot: int = 0) -> tuple[float, list[int], dict]:
        """(TTFT s at the client, answer token ids, the server's timings); slot: id_slot (-1: the server picks)."""
        t0 = time.perf_counter()
        ttft, toks, timings = None, [], {}
        with self._post("/completion", {"prompt": [int(x) for x in prompt], "n_predict": n, "cache_prompt": True,
                                        "temperature": 0.0, "stream": True, "id_slot": slot,
                                        "return_tokens": True}) as r:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("tokens") or ev.get("content"):
                    ttft = ttft or time.perf_counter() - t0
                toks += [int(t) for t in ev.get("tokens") or []]
                timings = ev.get("timings") or timings
        return (ttft or time.perf_counter() - t0), toks, timings

    def chat(self, messages: list[dict], n: int) -> tuple[float, str, dict]:
        """(TTFT s at the client, the answer's text, {"prompt_tokens", "read"}) of a streamed greedy chat completion
        (/v1/chat/completions, the server's own chat template); read: the prompt tokens it read (llama-server's
        timings.prompt_n, else prompt_tokens less usage's cached_tokens)."""
        t0 = time.perf_counter()
        ttft, text, usage, timings = None, [], {}, {}
        with self._post("/v1/chat/completions", {"messages": messages, "max_tokens": n, "temperature": 0.0,
                                                 "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                for c in ev.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft or time.perf_counter() - t0
                        text.append(piece)
                usage = ev.get("usage") or usage
                timings = ev.get("timings") or timings
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        read = int(timings["prompt_n"]) if "prompt_n" in timings else int(usage.get("prompt_tokens", 0)) - cached
        return (ttft or time.perf_counter() - t0), "".join(text), {"prompt_tokens": usage.get("prompt_tokens"),
                                                                    "read": read}

    def save(self, name: str) -> None:
        self._post("/slots/0?action=save", {"filename": name}).read()

    def restore(self, name: str) -> float:
        t0 = time.perf_counter()
        self._post("/slots/0?action=restore", {"filename": name}).read()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class LlamaServer(CompletionServer):
    """llama.cpp's llama-server on the same GGUF (`slots` slots, its prompt cache in RAM with --cache-ram, session
    files with --slot-save-path), each slot n_ctx tokens."""

    def __init__(self, binary: str, model_path: str, n_ctx: int, threads: int, save_dir: Path, slots: int = 1,
                 extra: list[str] | None = None):
        port = free_port()
        help_text = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
        cmd = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx * slots),
               "-np", str(slots), "-t", str(threads), "--slot-save-path", str(save_dir)] + (extra or [])
        if "--cache-ram" in help_text:
            cmd += ["--cache-ram", "1024"]
        super().__init__(cmd, port)


class StrataServer(CompletionServer):
    """`strata serve` on the same GGUF with `slots` request slots (its defaults otherwise: checkpoints, parking)."""

    def __init__(self, model: str, n_ctx: int, threads: int, folder: Path, slots: int, extra: list[str] | None = None):
        port = free_port()
        cmd = [sys.executable, "-m", "strata.cli.main", "serve", "--model", model, "--socket", str(folder / "s.sock"),
               "--port", str(port), "--n-ctx", str(n_ctx), "--threads", str(threads), "--parallel", str(slots),
               "--queue-max", "64", "--log-level", "warning"] + (extra or [])
        env = tree_env()
        super().__init__(cmd, port, env)


def run_llama_server(binary: str, model: str, args, session_dir: Path, render: Engine) -> dict:
    """The same agent against llama-server (prompts rendered by Strata's template: the same token ids)."""
    from strata.gguf.default_model import resolve_model
    path = str(resolve_model(model))
    steps_out = []
    ngl = ["-ngl", "0" if args.device == "cpu" else "99"]
    srv = LlamaServer(binary, path, args.n_ctx, args.threads, session_dir, extra=ngl)
    cmd = " ".join(srv.cmd)
    try:
        agent = Agent(system_prompt(render, args.system_tokens))
        for phase in (0, 1):
            if phase == 1:
                srv.close()
                srv = LlamaServer(binary, path, args.n_ctx, args.threads, session_dir, extra=ngl)
                loaded: set[str] = set()
            for chat, text in agent.schedule(args.rounds, phase):
                msgs = agent.chats.setdefault(chat, [{"role": "system", "content": agent.system}])
                msgs.append({"role": "user", "content": text})
                load_ms = 0.0
                if phase == 1 and chat not in loaded:
                    loaded.add(chat)
                    load_ms = 1e3 * srv.restore(f"{chat}.bin")
                prompt = as_ids(render.render_chat(msgs).tokens)
                new = agent.new_tokens(prompt)
                ttft, toks, tm = srv.generate(prompt, N_ANSWER)
                read = int(tm.get("prompt_n", 0))
                steps_out.append(dict(phase=phase, chat=chat, prompt=len(prompt), new=new, read=read,
                                      reread=read - new, cache_n=int(tm.get("cache_n", 0)), load_ms=round(load_ms, 2),
                                      ttft_ms=round(1e3 * ttft + load_ms, 2), answer=toks))
                agent.sent.append(np.concatenate([prompt, np.asarray(toks[:-1], np.int32)]))
                msgs.append({"role": "assistant", "content": render.detokenize(toks)})
                srv.save(f"{chat}.bin")
                st = steps_out[-1]
                print(f"  llama-server phase {phase} {chat:5s} prompt {st['prompt']:5d} new {st['new']:4d} read "
                      f"{st['read']:4d} re-read {st['reread']:4d} ttft {st['ttft_ms']:8.1f} ms", flush=True)
    finally:
        srv.close()
    return {"cmd": cmd, "steps": steps_out, "reread_total": sum(max(0, x["reread"]) for x in steps_out),
            "new_total": sum(x["new"] for x in steps_out), "read_total": sum(x["read"] for x in steps_out),
            "ttft_ms_median": float(np.median([x["ttft_ms"] for x in steps_out])),
            "ttft_ms_after_restart_median": float(np.median([x["ttft_ms"] for x in steps_out if x["phase"] == 1]))}


def run_concurrent(name: str, srv: CompletionServer, render: Engine, args) -> dict:
    """The agent's first phase against a server with slots through its chat route (as an agent calls it: its own
    template, so its checkpoints at the template's cut points), the four sub-agents' steps of each round sent at
    once (one thread each; the server picks the slot) and the main's steps alone between them -> the arm's steps
    (as run_arm's, plus each group's wall time). `render` counts the new tokens of each prompt (the same template)."""
    agent = Agent(system_prompt(render, args.system_tokens))
    lock = threading.Lock()
    steps_out: list[dict] = []

    def step(chat: str, text: str) -> None:
        with lock:                                   # the renderer and the agent's records are not shared safely
            msgs = agent.chats.setdefault(chat, [{"role": "system", "content": agent.system}])
            msgs.append({"role": "user", "content": text})
            sent_msgs = [dict(m) for m in msgs]
            prompt = as_ids(render.render_chat(msgs).tokens)
            new = agent.new_tokens(prompt)
        ttft, answer, u = srv.chat(sent_msgs, N_ANSWER)
        with lock:
            read = u["read"]
            steps_out.append(dict(phase=0, chat=chat, prompt=len(prompt), server_prompt=u["prompt_tokens"], new=new,
                                  read=read, reread=read - new, ttft_ms=round(1e3 * ttft, 2), answer=answer))
            msgs.append({"role": "assistant", "content": answer})
            done = as_ids(render.render_chat(msgs).tokens)
            agent.sent.append(done[:-1])             # what the server read: the prompt and the answer
            print(f"  {name} {chat:5s} prompt {len(prompt):5d} new {new:4d} read {read:4d} re-read {read - new:4d} "
                  f"ttft {1e3 * ttft:8.1f} ms", flush=True)

    groups: list[list[tuple[str, str]]] = []
    for chat, text in agent.schedule(args.rounds, 0):       # consecutive steps of distinct sub-agents run at once
        if chat != "main" and groups and groups[-1][0][0] != "main" and chat not in {c for c, _ in groups[-1]}:
            groups[-1].append((chat, text))
        else:
            groups.append([(chat, text)])
    walls = []
    for g in groups:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=step, args=st) for st in g]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        walls.append(dict(chats=[c for c, _ in g], wall_ms=round(1e3 * (time.perf_counter() - t0), 2)))
    sub = [x["ttft_ms"] for x in steps_out if x["chat"] != "main"]
    return {"cmd": " ".join(srv.cmd), "steps": steps_out, "groups": walls,
            "reread_total": sum(max(0, x["reread"]) for x in steps_out),
            "new_total": sum(x["new"] for x in steps_out), "read_total": sum(x["read"] for x in steps_out),
            "ttft_ms_median": float(np.median([x["ttft_ms"] for x in steps_out])),
            "subagent_ttft_ms_median": float(np.median(sub)), "subagent_ttft_ms_max": float(max(sub)),
            "wall_ms_total": round(sum(w["wall_ms"] for w in walls), 2)}


def cold_ttft(make_engine, system_tokens: int) -> float:
    """TTFT (ms) of the main's first prompt read cold, the reference a resumed step is measured against."""
    e = make_engine()
    try:
        msgs = [{"role": "system", "content": system_prompt(e, system_tokens)},
                {"role": "user", "content": "Task: the login page times out under load. Plan the work."}]
        r = e.render_chat(msgs)
        t0 = time.perf_counter()
        for ev in e.generate(GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, max_tokens=1,
                                               cache_prompt=False)):
            return 1e3 * (time.perf_counter() - t0)
    finally:
        e.close()
    return float("nan")


def main_concurrent(args, commit: str) -> int:
    """--concurrent N: the concurrent arms, each server in turn on the same GGUF and token ids."""
    from strata.gguf.default_model import resolve_model
    tag = "cpu" if args.device == "cpu" else "cuda"
    out = Path(args.out or ROOT / "bench" / "results" / f"agent_replay_concurrent_{tag}_{commit}.json")
    results = dict(bench="agent_replay --concurrent", commit=commit, model=args.model, device=args.device,
                   system_tokens=args.system_tokens, rounds=args.rounds, threads=args.threads, n_ctx=args.n_ctx,
                   slots=args.concurrent, answer_tokens=N_ANSWER, arms={})
    render = Engine(args.model, n_ctx=args.n_ctx, prompt_cache=0, conversation_cache_mib=0)
    path = str(resolve_model(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="agent_replay_"))
    dev = ["--device", args.device]
    arms = [(f"strata_parallel_{args.concurrent}",
             lambda: StrataServer(path, args.n_ctx, args.threads, tmp, args.concurrent, dev)),
            ("strata_parallel_1", lambda: StrataServer(path, args.n_ctx, args.threads, tmp, 1, dev))]
    if args.llama_server:
        ngl = ["-ngl", "0" if args.device == "cpu" else "99"]
        arms.append((f"llama_server_np_{args.concurrent}",
                     lambda: LlamaServer(args.llama_server, path, args.n_ctx, args.threads, tmp, args.concurrent, ngl)))
    try:
        for name, start in arms:
            srv = start()
            try:
                res = run_concurrent(name, srv, render, args)
            finally:
                srv.close()
            results["arms"][name] = res
            print(f"{name}: re-read beyond the new tokens {res['reread_total']} of {res['read_total']} read "
                  f"({res['new_total']} new); sub-agent TTFT median {res['subagent_ttft_ms_median']:.1f} ms, max "
                  f"{res['subagent_ttft_ms_max']:.1f} ms; wall {res['wall_ms_total'] / 1e3:.2f} s", flush=True)
        names = list(results["arms"])
        ref = results["arms"][names[0]]
        for other in names[1:]:
            o = results["arms"][other]
            results[f"wall_{names[0]}_over_{other}"] = round(ref["wall_ms_total"] / o["wall_ms_total"], 4)
            results[f"subagent_ttft_{names[0]}_over_{other}"] = round(
                ref["subagent_ttft_ms_median"] / o["subagent_ttft_ms_median"], 4)
            print(f"{names[0]} / {other}: wall {results[f'wall_{names[0]}_over_{other}']:.3f}x, sub-agent TTFT "
                  f"median {results[f'subagent_ttft_{names[0]}_over_{other}']:.3f}x", flush=True)
    finally:
        render.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--system-tokens", type=int, default=1200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--kv-pool-ctx", type=int, default=8192, help="each stage's KV pool, the main's and the worker's")
    ap.add_argument("--split", default="15", help="--layer-split of the remote arm (the worker runs what follows)")
    ap.add_argument("--arms", default="local,remote")
    ap.add_argument("--llama-server", default=None, metavar="BIN", help="adds llama.cpp's llama-server as an arm")
    ap.add_argument("--concurrent", type=int, default=0, metavar="N",
                    help="instead of the arms above: the four sub-agents' steps sent at once to `strata serve "
                         "--parallel N`, to `strata serve --parallel 1` (queued: the reference) and, with "
                         "--llama-server, to `llama-server -np N`, through the chat route (first phase only)")
    ap.add_argument("--device", default="cpu", help="the engines', workers' and daemons' --device (llama-server: "
                                                    "-ngl 99 unless cpu)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    commit = bench_commit()
    if args.concurrent:
        return main_concurrent(args, commit)
    tag = "cpu" if args.device == "cpu" else "cuda"
    out = Path(args.out or ROOT / "bench" / "results" / f"agent_replay_{tag}_{commit}.json")
    results = dict(bench="agent_replay", commit=commit, model=args.model, device=args.device,
                   system_tokens=args.system_tokens,
                   rounds=args.rounds, threads=args.threads, n_ctx=args.n_ctx, kv_pool_ctx=args.kv_pool_ctx,
                   answer_tokens=N_ANSWER, arms={})
    tmp = Path(tempfile.mkdtemp(prefix="agent_replay_"))
    try:
        for arm in [a for a in args.arms.split(",") if a]:
            d = tmp / arm
            d.mkdir()
            kw = dict(n_ctx=args.n_ctx, threads=args.threads, slot_save_path=str(d), prompt_cache=8,
                      conversation_cache_mib=1024, kv_pool_ctx=args.kv_pool_ctx, device=args.device)
            if arm == "local":
                def make(kw=kw):
                    return Engine(args.model, **kw)
            else:
                state = {}

                def make(kw=kw, state=state):
                    if state.get("w") is not None:            # a restart restarts the worker too
                        state["w"].terminate()
                        state["w"].wait(30)
                    state["w"], addr = start_worker(args.model, args.threads, args.kv_pool_ctx, args.device)
                    return Engine(args.model, remote_stage=addr, layer_split=args.split, **kw)
            print(f"arm {arm}: cold read of the main's first prompt", flush=True)
            cold = cold_ttft(make, args.system_tokens)
            res = run_arm(arm, make, args.system_tokens, args.rounds, d)
            res["cold_ttft_ms"] = round(cold, 2)
            res["ttft_median_over_cold"] = round(res["ttft_ms_median"] / cold, 4)
            if arm != "local":
                state["w"].terminate()
                state["w"].wait(30)
            results["arms"][arm] = res
            print(f"arm {arm}: re-read beyond the new tokens {res['reread_total']} of {res['read_total']} read "
                  f"({res['new_total']} new); TTFT median {res['ttft_ms_median']:.1f} ms, "
                  f"{res['ttft_median_over_cold']:.3f} of a cold read ({cold:.0f} ms)", flush=True)
        if args.llama_server:
            d = tmp / "llama_server"
            d.mkdir()
            render = Engine(args.model, n_ctx=args.n_ctx, prompt_cache=0, conversation_cache_mib=0)
            res = run_llama_server(args.llama_server, args.model, args, d, render)
            results["llama_server"] = res
            print(f"llama-server: re-read beyond the new tokens {res['reread_total']} of {res['read_total']} read "
                  f"({res['new_total']} new); TTFT median {res['ttft_ms_median']:.1f} ms", flush=True)
        arms = list(results["arms"].values())
        if len(arms) == 2:
            same = [a["answer"] == b["answer"] for a, b in zip(arms[0]["steps"], arms[1]["steps"])]
            results["answers_equal_across_arms"] = f"{sum(same)}/{len(same)}"
            print(f"greedy answers equal across arms: {sum(same)}/{len(same)} steps")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
