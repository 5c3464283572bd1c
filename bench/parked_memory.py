"""Memory held by N parked conversations on one shared system prompt: this tree's code beside a reference revision's
(default main) measured in the same run, each in a process of its own on the same synthetic model.

Each of N chats on one long system prompt is asked two turns, the next chat parking it (resident on the device up to
--park-resident, the rest in host RAM); then the first chat's third turn is asked and checked against a cold read
(--prompt-cache 0, no parking) of the same messages. Reported per run: the parked conversations by tier, the bytes
the parked conversations keep of their own (running state, checkpoints' copies; device and host), the bytes the
checkpoint tree keeps (device and host), the K/V pages in use, and the whole (conversations + tree) per tier.

Usage: python bench/parked_memory.py [--n 8] [--resident 2] [--arch qwen35] [--baseline main]
[--out bench/results/parked_memory_<arch>_<commit>.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(os.environ.get("PARKED_MEMORY_ROOT") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT))

SYSTEM = "You are a careful assistant who answers in one short line and never repeats itself. " * 12


def _chat(i: int, turn: int, answers: list[str]) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for t in range(turn + 1):
        msgs.append({"role": "user", "content": f"Topic {i}: tell me fact {t + 1}."})
        if t < turn:
            msgs.append({"role": "assistant", "content": answers[t]})
    return msgs


def _ask(e, msgs) -> list[int]:
    """Four greedy tokens of the answer to `msgs` (end of generation ignored: answers of one length)."""
    from strata.engine.types import GenerationRequest, TokenEvent  # noqa: PLC0415
    r = e.render_chat(msgs)
    req = GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, max_tokens=4, ignore_eos=True)
    return [ev.token_id for ev in e.generate(req) if isinstance(ev, TokenEvent)]


def measure(model: str, n: int, resident: int) -> dict:
    """One run on the code at ROOT -> what it holds with N conversations parked."""
    from strata.engine import Engine  # noqa: PLC0415
    kw = dict(n_ctx=2048, ubatch=64)
    e = Engine(model, conversation_cache_mib=1024, park_resident=resident, prompt_cache=6, **kw)
    answers: list[list[str]] = [[] for _ in range(n)]
    for i in range(n):
        for turn in range(2):
            answers[i].append(e.detokenize(_ask(e, _chat(i, turn, answers[i]))))
    _ask(e, [{"role": "user", "content": "Something else entirely."}])      # the last chat parked too
    parked = [p for tier in ("device", "ram") for p in e.store.parking.in_tier(tier)]
    conv = {"device": 0, "ram": 0}
    for p in parked:
        conv[p.tier] += p.conv.nbytes()
    tree = {"device": 0, "ram": 0, "disk": 0}
    for ent in e.cache._entries.values():
        tree[ent.tier] += ent.bytes
    kv = e.status()["kv_pages"]
    out = {"parked": {t: sum(p.tier == t for p in parked) for t in ("device", "ram")},
           "conversations_bytes": conv, "tree_bytes": tree, "checkpoints": len(e.cache._entries),
           "kv_pages_used": kv.get("used"), "kv_pages_held": kv.get("held"),
           "device_bytes": conv["device"] + tree["device"], "host_bytes": conv["ram"] + tree["ram"]}
    # correctness: the first chat's third turn equals a cold read of the same messages
    follow = _chat(0, 2, answers[0])
    got = _ask(e, follow)
    cold = Engine(model, prompt_cache=0, conversation_cache_mib=0, **kw)
    out["third_turn_equal_to_cold_read"] = got == _ask(cold, follow)
    cold.close()
    e.close()
    return out


def _commit(root: Path, rev: str = "HEAD") -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], capture_output=True,
                          text=True).stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--resident", type=int, default=2)
    ap.add_argument("--arch", default="qwen35", help="synthetic model: qwen35 (hybrid) or llama (attention-only)")
    ap.add_argument("--baseline", default="main", help="the reference revision, measured in the same run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)     # internal: one run, JSON to stdout
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure, a.n, a.resident)))
        return
    from bench.common import tree_env  # noqa: PLC0415
    from strata.gguf import synth  # noqa: PLC0415
    with tempfile.TemporaryDirectory() as tmp:
        model = str(synth.write_synthetic(Path(tmp) / f"{a.arch}.gguf", synth.preset(a.arch, "tiny", n_layer=4)))
        base = Path(tmp) / "baseline"
        base.mkdir()
        subprocess.run(f"git -C {ROOT} archive {a.baseline} | tar -x -C {base}", shell=True, check=True)
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=base, check=True,
                       capture_output=True)
        runs = {}
        for name, root in (("baseline", base), ("this", ROOT)):
            env = tree_env(root, PARKED_MEMORY_ROOT=str(root))
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", model, "--n", str(a.n),
                                "--resident", str(a.resident)], env=env, capture_output=True, text=True,
                               check=True)
            runs[name] = json.loads(r.stdout.strip().splitlines()[-1])
    b, t = runs["baseline"], runs["this"]
    ratio = {k: (round(t[k] / b[k], 3) if b[k] else None) for k in ("device_bytes", "host_bytes", "kv_pages_held")}
    res = {"bench": "parked_memory", "arch": a.arch, "n": a.n, "resident": a.resident,
           "baseline": {"rev": a.baseline, "commit": _commit(ROOT, a.baseline), **b},
           "this": {"commit": _commit(ROOT), **t}, "this_over_baseline": ratio}
    print(json.dumps(res, indent=1))
    out = Path(a.out or ROOT / "bench" / "results" / f"parked_memory_{a.arch}_{_commit(ROOT)}.json")
    out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
