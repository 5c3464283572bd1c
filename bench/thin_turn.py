#!/usr/bin/env python3
"""Benchmark: what a later turn of a long chat costs outside the model, this tree against a reference commit (main)
in the same run, and a live continuation with checkpoints against --prompt-cache 0.

Each arm is `strata serve` (started through bench/model_clock.py, which times the model's forward calls) on a tiny
synthetic model (so the model costs little and the rest shows; the phases are the same code on a GPU), driven by the
`openai` client, streaming. Per conversation size (tokens) and shape:
  system  a long system prompt and short turns (bench/prompt_cache.py's chat)
  chat    many messages of ~230 tokens each (a long chat)
the client sends the conversation (a cold read), then --turns later turns, each adding a fixed assistant answer and a
short question (max_tokens 1: the live sequence holds exactly the prompt, so every later turn is a live continuation
in every arm). The arms' daemons run side by side and each turn goes to every arm in turn (the machine's load drifts
alike over them). Measured per later turn:
  client_outside_ms  TTFT at the client minus the model's forward calls (model_clock), every arm alike
  server_ms / server_outside_ms / phases_ms  the daemon's own clock (the response's strata.turn: from the request's
                     arrival to its first token leaving; arms that have it)
Arms: after (this tree, --prompt-cache 6), after_pc0 (this tree, --prompt-cache 0), before (--before REF, built
from `git archive` in a temporary directory, --prompt-cache 6) and with --before-pc0 before_pc0 (REF,
--prompt-cache 0). Printed: the medians per arm and size, before/after, and checkpoints / --prompt-cache 0 (TTFT at
the client and the server's time to first token: the median of the ratios of turns sent one after the other). JSON
goes to bench/results/thin_turn_<model>_<commit>.json.

Usage: PYTHONPATH=. python bench/thin_turn.py [--sizes 4096 16384 65536] [--shapes system chat] [--before main]
       [--synthetic qwen3next] [--chat-template FILE] [--device cpu] [--turns 4] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench.common import commit as bench_commit, tree_env  # noqa: E402
import model_clock  # noqa: E402  (bench/model_clock.py)
from daemons import free_port, stop, wait_healthy  # noqa: E402
from prompt_cache import SENTENCES, system_prompt  # noqa: E402  (the same archive text)

ANSWER = "The Severn passes Shrewsbury, as record 12 says; the Tyne passes Newcastle."
QUESTIONS = ["Which river passes Shrewsbury?", "How many sides has a nonagon?", "What does rule 3 say?",
             "Summarise the archive in one sentence.", "Thanks. Anything else?", "And the Lune?", "Why?", "Sure?"]


def conversation(tok, shape: str, n_tokens: int) -> list[dict]:
    """Messages of about n_tokens tokens (the model's tokenizer, contents only) ending in a user question."""
    if shape == "system":
        return [{"role": "system", "content": system_prompt(tok, n_tokens)}, {"role": "user", "content": QUESTIONS[0]}]
    msgs, total, i = [{"role": "system", "content": "You are a careful archivist."}], 0, 0
    while total < n_tokens:
        u = " ".join(SENTENCES[(i + k) % len(SENTENCES)].format(i=i * 7 + k) for k in range(5))
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": ANSWER + f" ({i})"}]
        total += len(tok.encode(u)) + len(tok.encode(ANSWER)) + 12
        i += 1
    msgs.append({"role": "user", "content": QUESTIONS[0]})
    return msgs


class Arm:
    """One `strata serve` of `tree` (through bench/model_clock.py) on a local port, and the openai client."""

    def __init__(self, tree: Path, model: str, n_ctx: int, prompt_cache: int, clock: str, device: str, threads):
        import openai
        self.clock = clock
        port = free_port()
        cmd = [sys.executable, str(ROOT / "bench" / "model_clock.py"), "--no-socket", "--host", "127.0.0.1",
               "--port", str(port), "--model", model, "--n-ctx", str(n_ctx), "--device", device,
               "--prompt-cache", str(prompt_cache), "--log-level", "warning"]
        if threads:
            cmd += ["--threads", str(threads)]
        env = tree_env(tree, STRATA_BENCH_CLOCK=clock)
        if device == "cpu":      # one BLAS thread: the arms' daemons share the machine (spinning BLAS threads of idle
            env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")   # daemons cost the others)
        self.proc = subprocess.Popen(cmd, env=env, cwd=str(tree))
        base = f"http://127.0.0.1:{port}"
        wait_healthy(self.proc, base, cmd, "the daemon", self.close, poll=0.3)
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def turn(self, msgs) -> dict:
        t0 = time.monotonic()
        first, extra = None, {}
        for chunk in self.client.chat.completions.create(model=self.model, messages=msgs, stream=True,
                                                         temperature=0.0, max_tokens=1):
            if first is None and chunk.choices and chunk.choices[0].delta is not None \
                    and chunk.choices[0].delta.content:
                first = time.monotonic()
            if chunk.model_extra and chunk.model_extra.get("strata"):
                extra = chunk.model_extra
        first = first or time.monotonic()
        model_s, _ = model_clock.model_seconds(self.clock, t0, first)
        st, tm = extra.get("strata") or {}, extra.get("timings") or {}
        row = dict(ttft_ms=(first - t0) * 1e3, model_ms=model_s * 1e3, client_outside_ms=(first - t0 - model_s) * 1e3,
                   resume_from=st.get("resume_from"), prompt_n=tm.get("prompt_n"), cache_n=tm.get("cache_n"))
        turn = st.get("turn")
        if turn:
            row.update(server_ms=turn["ms"], server_outside_ms=turn["outside_model_ms"], phases_ms=turn["phases_ms"],
                       other_ms=turn["other_ms"], gc_ms=turn.get("gc_ms"))
        return row

    def close(self) -> None:
        stop(self.proc)


def play(arms: dict[str, Arm], msgs: list[dict], turns: int) -> dict:
    """The cold read on every arm, then `turns` later turns, each sent to every arm in turn (so the machine's load
    drifts alike over the arms) -> {arm: {"cold": row, "later": [rows]}}."""
    msgs = [dict(m) for m in msgs]
    out = {name: {"cold": arm.turn(msgs), "later": []} for name, arm in arms.items()}
    for t in range(turns):
        msgs += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": QUESTIONS[(t + 1) % len(QUESTIONS)]}]
        for name, arm in arms.items():
            out[name]["later"].append(arm.turn(msgs))
    return out


def before_tree(ref: str, tmp: Path) -> Path:
    """`ref` of this repository as files in tmp/before, its C core built (the built one of this tree copied when
    native/ is the same)."""
    out = tmp / "before"
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    same = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", ref, "HEAD", "--", "native/cpu",
                           "native/build_cpu.py"]).returncode == 0
    built = sorted((ROOT / "strata").glob("_native*.so"))
    if same and built:
        for f in built:
            shutil.copy2(f, out / "strata" / f.name)
    else:
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=str(out), check=True,
                       capture_output=True)
    return out


def med(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--shapes", nargs="+", default=["system", "chat"], choices=["system", "chat"])
    ap.add_argument("--synthetic", default="qwen3next", choices=["qwen3next", "llama"])
    ap.add_argument("--model", default=None, help="a GGUF instead of the synthetic model")
    ap.add_argument("--chat-template", default=None, help="a jinja file written into the synthetic model as its "
                    "tokenizer.chat_template (default: the default model's), e.g. tests/data/templates/Qwen3.5-4B.jinja")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="the daemons' --threads (default: 1 on the CPU, where "
                    "the arms run side by side)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--before", default="main", help="the reference commit ('' : none)")
    ap.add_argument("--before-tree", default=None, help="a checkout of the reference (its C core built) instead of "
                    "--before (a machine without the repository's history)")
    ap.add_argument("--before-pc0", action="store_true", help="the reference tree with --prompt-cache 0 too (its "
                    "checkpoints / --prompt-cache 0 ratio in the same run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    tmp = Path(tempfile.mkdtemp(prefix="strata-thin-turn-"))
    commit = bench_commit()
    if args.model:
        model, model_name = args.model, Path(args.model).stem
    else:
        from strata.gguf import synth
        model = str(tmp / f"synthetic-{args.synthetic}-tiny.gguf")
        overrides = None
        model_name = f"synthetic_{args.synthetic}_tiny"
        if args.chat_template:
            overrides = {"tokenizer.chat_template": Path(args.chat_template).read_text()}
            model_name += "_" + Path(args.chat_template).stem.replace(".", "")
        synth.write_synthetic(model, synth.preset(args.synthetic, "tiny", ctx=max(args.sizes) + 4096),
                              overrides=overrides)
    from strata.gguf.file import open_gguf
    from strata.text.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(open_gguf(model).metadata)
    trees = {"after": ROOT, "after_pc0": ROOT}
    before_commit = None
    if args.before_tree:
        before_commit = args.before
        trees["before"] = Path(args.before_tree).resolve()
    elif args.before:
        before_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.before],
                                       capture_output=True, text=True, check=True).stdout.strip()
        trees["before"] = before_tree(args.before, tmp)
    if "before" in trees and args.before_pc0:
        trees["before_pc0"] = trees["before"]
    out = Path(args.out or ROOT / "bench" / "results" / f"thin_turn_{model_name}_{commit}.json")
    results = dict(bench="thin_turn", commit=commit, before=before_commit, model=model_name, device=args.device,
                   machine=platform.machine(), cpus=os.cpu_count(), threads=args.threads, turns=args.turns, runs={})
    for shape in args.shapes:
        for size in args.sizes:
            msgs = conversation(tok, shape, size)
            n_ctx = size + 4096
            arms = {}
            try:
                for name, tree in trees.items():
                    clock = str(tmp / f"clock-{shape}-{size}-{name}")
                    arms[name] = Arm(tree, model, n_ctx, 0 if name.endswith("_pc0") else 6, clock, args.device,
                                     args.threads)
                row = play(arms, msgs, args.turns)
            finally:
                for arm in arms.values():
                    arm.close()
            summary = {}
            for name, r in row.items():
                later = r["later"]
                summary[name] = {k: med(later, k) for k in ("ttft_ms", "model_ms", "client_outside_ms", "server_ms",
                                                             "server_outside_ms", "other_ms", "gc_ms")}
                summary[name]["resume_from"] = sorted({x["resume_from"] for x in later if x.get("resume_from")})
                summary[name]["prompt_tokens"] = (r["cold"].get("prompt_n") or 0) + (r["cold"].get("cache_n") or 0)
                ph = [x["phases_ms"] for x in later if x.get("phases_ms")]
                if ph:
                    summary[name]["phases_ms"] = {k: statistics.median(p[k] for p in ph) for k in ph[0]}
            a, p0, b = summary["after"], summary["after_pc0"], summary.get("before")

            def paired(x: str, y: str, key: str):
                """The median over later turns of arm x's / arm y's `key` (each pair sent one after the other: the
                machine's load drifts less within a pair than over the run)."""
                rs = [u[key] / v[key] for u, v in zip(row[x]["later"], row[y]["later"]) if u.get(key) and v.get(key)]
                return statistics.median(rs) if rs else None

            summary["ckpt_over_pc0_ttft"] = paired("after", "after_pc0", "ttft_ms")
            summary["ckpt_over_pc0_server"] = paired("after", "after_pc0", "server_ms")
            if "before_pc0" in row:
                summary["before_ckpt_over_pc0_ttft"] = paired("before", "before_pc0", "ttft_ms")
            if b:
                summary["after_over_before_client_outside"] = a["client_outside_ms"] / b["client_outside_ms"]
            results["runs"][f"{shape}_{size}"] = dict(shape=shape, size=size, arms=row, summary=summary)
            print(f"\n{shape} ~{size} tokens ({a['prompt_tokens']} in the first prompt), later turns, medians of "
                  f"{args.turns} (ms):", flush=True)
            print(f"  {'arm':10} {'TTFT':>8} {'model':>8} {'outside (client)':>17} {'server':>8} "
                  f"{'outside (server)':>17}  resume")
            for name in row:
                s = summary[name]
                f = (lambda v: f"{v:8.2f}" if v is not None else f"{'-':>8}")
                print(f"  {name:10} {f(s['ttft_ms'])} {f(s['model_ms'])} {f(s['client_outside_ms']):>17} "
                      f"{f(s['server_ms'])} {f(s['server_outside_ms']):>17}  {','.join(s['resume_from'])}")
            for name in ("after", "before"):
                s = summary.get(name) or {}
                if s.get("phases_ms"):
                    print(f"  {name}'s phases: " + " ".join(f"{k} {v:.2f}" for k, v in s["phases_ms"].items())
                          + f" other {s['other_ms']:.2f}" + (f" (gc {s['gc_ms']:.2f})" if s.get("gc_ms") is not None
                                                             else ""))
            print(f"  checkpoints / --prompt-cache 0: TTFT x{summary['ckpt_over_pc0_ttft']:.3f}"
                  + (f", server x{summary['ckpt_over_pc0_server']:.3f}" if summary.get("ckpt_over_pc0_server") else "")
                  + (f" (before: TTFT x{summary['before_ckpt_over_pc0_ttft']:.3f})"
                     if "before_ckpt_over_pc0_ttft" in summary else "")
                  + (f"; outside the model, after / before x{summary['after_over_before_client_outside']:.3f}"
                     if b else ""), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
