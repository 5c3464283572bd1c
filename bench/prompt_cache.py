#!/usr/bin/env python3
"""Benchmark: time to first token per chat turn with conversation checkpoints vs --prompt-cache 0 (same run).

For each system-prompt size (default ~2K and ~8K tokens) and each arm (--prompt-cache 6, --prompt-cache 0) on
a fresh engine, the client plays:
  turns 1-4   chat A, four turns; the client resends the whole conversation every turn
  resend      chat A turn 4 sent again (a client retry / regenerate: resumes through its turn_at checkpoint)
  new chat    chat B turn 1: a new conversation with the same system prompt (resumes from the pinned root)
  switch back chat A turn 5 after chat B (the single KV arena holds B now: resumes from the root, or its parked copy)
With --baseline cold the --prompt-cache 0 arm plays turns 1-4 only (its other steps are cold reads like turn 1).

Two modes:
  engine (default)  in process: TTFT = wall time from generate() to the first token event (rendering and
                    tokenizing the chat are timed apart, render_s);
  --e2e             through the daemon (`strata serve` on a local port, started per arm) with the `openai` client,
                    streaming: TTFT = from sending the request to the first content chunk, at the client (HTTP,
                    JSON, rendering, tokenizing, planning, checkpoints, the model and sampling all included).
Both time the model's forward calls (bench/model_clock.py): model_s is the forward time inside the TTFT window, and
nonmodel = 1 - model_s / (TTFT [+ render_s in engine mode]) is the share of the turn spent outside the model.
Printed: TTFT per step and arm, the ratio step / cold (turn 1 of the same arm), the non-model share, and
checkpoints / prompt-cache-0 per step. JSON goes to bench/results/prompt_cache.json (engine) or
prompt_cache_e2e.json (--e2e) unless --out says otherwise. Issue #23's CPU target: a later turn's TTFT <= 5 % of a
cold read at 8K.

--synthetic ARCH runs a tiny synthetic model (strata.gguf.synth, the default model's tokenizer and chat template) so
the model costs little and what is not the model shows.

Usage: PYTHONPATH=. python bench/prompt_cache.py [--sizes 2048 8192] [--threads N] [--e2e] [--synthetic llama]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import commit as bench_commit, tree_env  # noqa: E402
import model_clock  # noqa: E402  (bench/model_clock.py)
from daemons import stop, wait_healthy  # noqa: E402

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
ROOT = Path(__file__).resolve().parent.parent


def system_prompt(tok, n_tokens: int) -> str:
    """Archive-like text of about n_tokens tokens for the model's tokenizer."""
    parts, i = [], 0
    while True:
        parts.append(SENTENCES[i % len(SENTENCES)].format(i=i))
        i += 1
        if i % 20 == 0 and len(tok.encode(" ".join(parts))) >= n_tokens:
            return " ".join(parts)


class EngineClient:
    """In process: render, then generate() on an Engine; its Sequence.forward timed into a clock file."""

    def __init__(self, model: str, n_ctx: int, ubatch: int, threads, device: str, prompt_cache: int, clock: str,
                 park_resident: int | None = None):
        from strata.engine import Engine
        model_clock.install(clock)
        self.clock = clock
        self.engine = Engine(model, n_ctx=n_ctx, ubatch=ubatch, threads=threads, device=device,
                             prompt_cache=prompt_cache,
                             **({} if park_resident is None else {"park_resident": park_resident}))
        self.tokenizer = self.engine.tokenizer

    def step(self, msgs, max_tokens: int) -> tuple[str, dict]:
        from strata.engine import GenerationRequest
        from strata.sampling.sampler import SamplingParams
        t_render = time.monotonic()
        r = self.engine.render_chat(msgs)
        t0 = time.monotonic()
        req = GenerationRequest(r.tokens, r.cut_points, SamplingParams(temperature=0.0), max_tokens=max_tokens)
        first, text, final = None, [], None
        for ev in self.engine.generate(req):
            if first is None:
                first = time.monotonic()
            if hasattr(ev, "token_id"):
                text.append(ev.text)
            else:
                final = ev
        model_s, _ = model_clock.model_seconds(self.clock, t_render, first)
        row = dict(ttft_s=first - t0, render_s=t0 - t_render, model_s=model_s, n_prompt=len(r.tokens),
                   prompt_ms=final.timings["prompt_ms"], **final.strata)
        return "".join(text) + final.text, row

    def close(self) -> None:
        self.engine.close()
        del self.engine


class DaemonClient:
    """End to end: `strata serve` (through bench/model_clock.py) on a free local port, the `openai` client streaming."""

    def __init__(self, model: str, n_ctx: int, ubatch: int, threads, device: str, prompt_cache: int, clock: str,
                 park_resident: int | None = None):
        import openai
        from strata.gguf.file import open_gguf
        from strata.text.tokenizer import Tokenizer
        from strata.gguf.default_model import resolve_model
        self.clock = clock
        self.tokenizer = Tokenizer.from_gguf(open_gguf(resolve_model(model)).metadata)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, str(ROOT / "bench" / "model_clock.py"), "--no-socket", "--host", "127.0.0.1",
               "--port", str(port), "--model", model, "--n-ctx", str(n_ctx), "--ubatch", str(ubatch),
               "--device", device, "--prompt-cache", str(prompt_cache), "--log-level", "warning"]
        if threads:
            cmd += ["--threads", str(threads)]
        if park_resident is not None:
            cmd += ["--park-resident", str(park_resident)]
        env = tree_env(STRATA_BENCH_CLOCK=clock)
        self.proc = subprocess.Popen(cmd, env=env)
        base = f"http://127.0.0.1:{port}"
        self.wait_healthy(base, cmd, "the daemon")
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def wait_healthy(self, base: str, cmd: list, what: str) -> None:
        """Wait (up to 600 s) until the server started as self.proc answers /health with 200."""
        wait_healthy(self.proc, base, cmd, what, self.close)

    def step(self, msgs, max_tokens: int) -> tuple[str, dict]:
        t0 = time.monotonic()
        stream = self.client.chat.completions.create(model=self.model, messages=msgs, stream=True, temperature=0.0,
                                                     max_tokens=max_tokens)
        first, text, extra = None, [], {}
        for chunk in stream:
            ch = chunk.choices[0] if chunk.choices else None
            if first is None and ch is not None and ch.delta is not None and ch.delta.content:
                first = time.monotonic()
            if ch is not None and ch.delta is not None and ch.delta.content:
                text.append(ch.delta.content)
            if chunk.model_extra and "strata" in chunk.model_extra:
                extra = chunk.model_extra
        if first is None:           # no content at all (an end-of-generation token first): the stream's end
            first = time.monotonic()
        model_s, _ = model_clock.model_seconds(self.clock, t0, first)
        st = dict(extra.get("strata") or {})
        row = dict(ttft_s=first - t0, render_s=0.0, model_s=model_s,
                   n_prompt=(extra.get("timings") or {}).get("prompt_n", 0) + (extra.get("timings") or {}).get(
                       "cache_n", 0), prompt_ms=(extra.get("timings") or {}).get("prompt_ms"), **st)
        return "".join(text), row

    def close(self) -> None:
        stop(self.proc)


class LlamaServerClient(DaemonClient):
    """The reference arm: llama.cpp's `llama-server` on the same GGUF (its prompt cache and context checkpoints on,
    one slot, all layers on the GPU, flash attention), the same `openai` streaming client. resume_pos is its
    timings' cache_n (the prompt tokens it reused); model time is not measured (nonmodel is 0)."""

    def __init__(self, binary: str, model: str, n_ctx: int, ubatch: int, device: str):
        import openai
        from strata.gguf.default_model import resolve_model
        from strata.gguf.file import open_gguf
        from strata.text.tokenizer import Tokenizer
        path = str(resolve_model(model))
        self.clock = None
        self.tokenizer = Tokenizer.from_gguf(open_gguf(path).metadata)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        help_text = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
        cmd = [binary, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx), "-ub", str(ubatch),
               "-b", str(max(ubatch, 2048)), "-np", "1", "--jinja", "-ngl", "99" if device.startswith("cuda") else "0"]
        if "--flash-attn" in help_text:
            cmd += ["-fa", "on"]
        if "--ctx-checkpoints" in help_text:
            cmd += ["--ctx-checkpoints", "8"]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        self.wait_healthy(base, cmd, "llama-server")
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600, max_retries=0)
        self.model = "model"

    def step(self, msgs, max_tokens: int) -> tuple[str, dict]:
        t0 = time.monotonic()
        stream = self.client.chat.completions.create(model=self.model, messages=msgs, stream=True, temperature=0.0,
                                                     max_tokens=max_tokens)
        first, text, timings = None, [], {}
        for chunk in stream:
            ch = chunk.choices[0] if chunk.choices else None
            if ch is not None and ch.delta is not None and ch.delta.content:
                first = first or time.monotonic()
                text.append(ch.delta.content)
            if chunk.model_extra and chunk.model_extra.get("timings"):
                timings = chunk.model_extra["timings"]
        first = first or time.monotonic()
        cache_n, prompt_n = int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0))
        row = dict(ttft_s=first - t0, render_s=0.0, model_s=0.0, n_prompt=cache_n + prompt_n,
                   prompt_ms=timings.get("prompt_ms"), resume_from="llama" if cache_n else "none", resume_pos=cache_n)
        return "".join(text), row


def play(client, system: str, max_tokens: int, full: bool = True) -> list[dict]:
    """The steps above on a fresh client -> one row per step."""
    a = [{"role": "system", "content": system}]
    rows = []

    def step(name, msgs):
        text, row = client.step(msgs, max_tokens)
        total = row["ttft_s"] + row["render_s"]
        row = dict(step=name, **row, nonmodel=max(0.0, 1.0 - row["model_s"] / total) if total > 0 else 0.0)
        for k in ("stop", "stopped_by"):
            row.pop(k, None)
        rows.append(row)
        return text

    for t in range(4):
        a.append({"role": "user", "content": USERS_A[t]})
        a.append({"role": "assistant", "content": step(f"turn {t + 1}", a)})
    if full:
        step("resend turn 4", a[:-1])
        step("new chat", [{"role": "system", "content": system}, {"role": "user", "content": USER_B}])
        a.append({"role": "user", "content": USERS_A[4]})
        step("switch back (turn 5)", a)
    return rows


def synthetic_model(arch: str, n_ctx: int, directory: Path) -> str:
    """A tiny synthetic model (strata.gguf.synth preset 'tiny') with a context of n_ctx, or the synthetic 1.5B hybrid of
    bench/gpu_hybrid_model.py (arch 'hybrid_1_5b'); returns its path."""
    if arch == "hybrid_1_5b":
        from gpu_hybrid_model import make_synthetic_hybrid      # bench/ is on sys.path
        from strata.gguf.default_model import default_model_path
        return make_synthetic_hybrid(directory / "hybrid_1_5b.gguf", default_model_path())
    from strata.gguf import synth
    path = directory / f"synthetic-{arch}-tiny.gguf"
    synth.write_synthetic(path, synth.preset(arch, "tiny", ctx=n_ctx))
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192], help="system prompt sizes (tokens)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--synthetic", choices=["llama", "qwen3next", "hybrid_1_5b"], default=None,
                    help="a tiny synthetic model of this architecture instead of --model")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--e2e", action="store_true", help="through the daemon with the openai client (streaming)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--baseline", choices=["full", "cold"], default="full",
                    help="cold: the --prompt-cache 0 arm plays turns 1-4 only (saves its cold re-reads)")
    ap.add_argument("--arms", nargs="+", default=["checkpoints", "prompt_cache_0"],
                    choices=["checkpoints", "prompt_cache_0"], help="which arms to run (both by default)")
    ap.add_argument("--llama-server", default=None, metavar="BIN",
                    help="llama.cpp's llama-server: adds the llama_server arm (--e2e) on the same GGUF")
    ap.add_argument("--park-resident", type=int, default=None, metavar="N",
                    help="Strata's --park-resident (default: its own; 0 = park in host RAM only, the reference)")
    ap.add_argument("--label", default=None, help="a name for this run, kept in the JSON (e.g. before / after)")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/prompt_cache[_e2e].json)")
    args = ap.parse_args(argv)
    if args.llama_server and not args.e2e:
        ap.error("--llama-server runs end to end: add --e2e")
    out = Path(args.out or ROOT / "bench" / "results" / ("prompt_cache_e2e.json" if args.e2e else "prompt_cache.json"))
    tmp = Path(tempfile.mkdtemp(prefix="strata-prompt-cache-"))
    model = synthetic_model(args.synthetic, max(args.sizes) + 2048, tmp) if args.synthetic else args.model
    commit = bench_commit()
    results = dict(bench="prompt_cache", mode="e2e" if args.e2e else "engine", label=args.label, commit=commit,
                   model=(f"synthetic {args.synthetic}" + ("" if args.synthetic == "hybrid_1_5b" else " tiny"))
                   if args.synthetic else args.model, device=args.device,
                   machine=platform.machine(), cpus=os.cpu_count(), threads=args.threads,
                   max_tokens=args.max_tokens, ubatch=args.ubatch, park_resident=args.park_resident, sizes={})
    Client = DaemonClient if args.e2e else EngineClient
    for size in args.sizes:
        n_ctx = size + 1024
        arms = {}
        for arm, pc in (("checkpoints", 6), ("prompt_cache_0", 0)):
            if arm not in args.arms:
                continue
            clock = str(tmp / f"clock-{size}-{arm}")
            c = Client(model, n_ctx, args.ubatch, args.threads, args.device, pc, clock, args.park_resident)
            try:
                system = system_prompt(c.tokenizer, size)
                arms[arm] = play(c, system, args.max_tokens, full=(pc > 0 or args.baseline == "full"))
            finally:
                c.close()
        if args.llama_server and args.e2e:
            import openai
            c = LlamaServerClient(args.llama_server, model, n_ctx, args.ubatch, args.device)
            try:
                arms["llama_server"] = play(c, system_prompt(c.tokenizer, size), args.max_tokens)
                results["llama_server_cmd"] = " ".join(c.cmd)
            except openai.BadRequestError as e:     # e.g. a context past the model's training context, which it caps
                print(f"llama-server refused a request at {size} tokens, its arm is left out there: {e}", flush=True)
                results.setdefault("llama_server_refused", {})[str(size)] = str(e)
            finally:
                c.close()
        if arms.get("llama_server"):
            cold_l = arms["llama_server"][0]["ttft_s"]
            ck = {r["step"]: r for r in arms.get("checkpoints", [])}
            print(f"llama-server (cold {cold_l:.3f} s):", flush=True)
            for r in arms["llama_server"]:
                r["ratio_to_cold"] = r["ttft_s"] / cold_l
                mine = ck.get(r["step"])
                if mine is not None:
                    mine["ratio_to_llama_server"] = (mine["ttft_s"] + mine["render_s"]) / r["ttft_s"]
                print(f"  {r['step']:22} {r['ttft_s']:9.4f}s  cache_n {r['resume_pos']:>6} {r['ratio_to_cold']:7.2%}"
                      + (f"  strata/llama-server {mine['ratio_to_llama_server']:.3f}" if mine else ""), flush=True)
        arms.setdefault("prompt_cache_0", [])
        arms.setdefault("checkpoints", [])
        cold = {k: v[0]["ttft_s"] + v[0]["render_s"] if v else float("nan") for k, v in arms.items()}
        first = (arms["checkpoints"] or arms["prompt_cache_0"])[0]
        print(f"\nsystem prompt ~{size} tokens (first prompt {first['n_prompt']} tokens), cold TTFT: checkpoints "
              f"{cold['checkpoints']:.3f} s, prompt-cache 0 {cold['prompt_cache_0']:.3f} s", flush=True)
        print(f"{'step':22} {'ckpt TTFT':>10} {'resume':>18} {'/cold':>7} {'!model':>7} | {'pc0 TTFT':>9} "
              f"{'resume':>12} {'/cold':>7} {'!model':>7} | {'ckpt/pc0':>8}")
        base = {r["step"]: r for r in arms["prompt_cache_0"]}
        for r in arms["prompt_cache_0"]:
            r["ratio_to_cold"] = (r["ttft_s"] + r["render_s"]) / cold["prompt_cache_0"]
        for a in arms["checkpoints"] or arms["prompt_cache_0"]:
            t = a["ttft_s"] + a["render_s"]
            a["ratio_to_cold"] = t / cold["checkpoints"] if arms["checkpoints"] else a["ratio_to_cold"]
            line = (f"{a['step']:22} {t:9.4f}s {a['resume_from'] + ' ' + str(a['resume_pos']):>18} "
                    f"{a['ratio_to_cold']:7.2%} {a['nonmodel']:7.1%} | ")
            b = base.get(a["step"]) if arms["checkpoints"] else None
            if b is None:
                line += f"{'-':>39} |"
            else:
                tb = b["ttft_s"] + b["render_s"]
                a["ratio_to_prompt_cache_0"] = t / tb
                line += (f"{tb:8.4f}s {b['resume_from'] + ' ' + str(b['resume_pos']):>12} {b['ratio_to_cold']:7.2%} "
                         f"{b['nonmodel']:7.1%} | {a['ratio_to_prompt_cache_0']:8.3f}")
            print(line, flush=True)
        prev = {}
        if out.exists():
            try:
                old = json.loads(out.read_text())
                if old.get("label") == args.label and old.get("model") == results["model"]:
                    prev = old.get("sizes", {})
            except ValueError:
                prev = {}
        results["sizes"] = {**prev, **results["sizes"], str(size): arms}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))      # after each size: partial results survive
        print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
