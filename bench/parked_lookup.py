"""Time to find where a long prompt resumes among many parked conversations: the tree's one walk along the prompt
(strata.cache.lookup) beside the reference of the same run, a scan of every parked conversation (each one's
Conversation.depth against the prompt, as the lookup before the walk did) plus a walk of the checkpoints on the
prompt's path. N one-line chats on one system prompt are parked in host RAM (each with its root and message-end
checkpoints, the tree keeping the root checkpoint), then three prompts of --prompt tokens are looked up: one
continuing a parked chat, a new chat on the system prompt, one sharing nothing. Both answers are checked equal.

Usage: python bench/parked_lookup.py [--n 1000] [--prompt 65536] [--system 1024] [--cut-anywhere]
[--out bench/results/parked_lookup_<commit>.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import commit as bench_commit  # noqa: E402
from strata.cache.checkpoints import CheckpointCache  # noqa: E402
from strata.cache.conversation import Conversation, SavedCheckpoint  # noqa: E402
from strata.cache.lookup import lookup  # noqa: E402
from strata.cache.parked import TIERS, ParkedConversations  # noqa: E402
from strata.stages.sequence import Checkpoint  # noqa: E402

TEMPLATE = [7, 8, 9]          # the tokens every user message starts with (a chat template's)


def scan(tree, prompt):
    """The reference: every parked conversation's depth, ties to the nearest tier then the most recent; the
    deepest checkpoint on the prompt's path shorter than it."""
    best, key = None, (0,)
    for node in tree.nodes("parked"):
        p = node.parked
        d = p.conv.depth(prompt)
        k = (d, -TIERS.index(p.tier), p.conv.last_use, p.saved)
        if d > 0 and k > key:
            best, key = p, k
    cps = tree.path(prompt[:len(prompt) - 1])
    return best, key[0], (cps[-1].pos if cps else 0)


def timed(f, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="parked one-line chats")
    ap.add_argument("--prompt", type=int, default=65536, help="tokens of each looked-up prompt")
    ap.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt")
    ap.add_argument("--cut-anywhere", action="store_true", help="attention-only conversations (cut back anywhere)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    system = rng.integers(100, 30000, a.system).astype(np.int32)
    cache = CheckpointCache(cap=a.n * 4, budget_bytes=1 << 40)
    parked = ParkedConversations(cache.tree, [], park_bytes=1 << 40, resident=0, disk=None)
    cache.save(a.system, "root", Checkpoint(pos=a.system, tokens=system, parts=[]))
    chats = []
    for i in range(a.n):
        msg = np.concatenate([system, TEMPLATE, rng.integers(100, 30000, 12), [5]]).astype(np.int32)
        toks = np.concatenate([msg, rng.integers(100, 30000, 8)]).astype(np.int32)
        conv = Conversation(tokens=toks, parts=[], cut_anywhere=a.cut_anywhere,
                            checkpoints=[SavedCheckpoint(a.system, "root", []),
                                         SavedCheckpoint(len(msg), "turn", [])])
        parked.park(conv)
        chats.append(toks)
    tail = rng.integers(100, 30000, a.prompt).astype(np.int32)
    prompts = {
        "continue": np.concatenate([chats[a.n // 2], tail])[:a.prompt],
        "new_chat": np.concatenate([system, TEMPLATE, tail])[:a.prompt],
        "unrelated": tail,
    }
    rows = {}
    for name, prompt in prompts.items():
        prompt = np.ascontiguousarray(prompt, np.int32)
        want_p, want_d, want_cp = scan(cache.tree, prompt)
        f = lookup(cache.tree, prompt)
        got_cp = f.checkpoint.pos if f.checkpoint is not None else 0
        assert (f.parked, f.depth, got_cp) == (want_p, want_d, want_cp), name
        ref_ms = timed(lambda: scan(cache.tree, prompt), a.reps)
        new_ms = timed(lambda: lookup(cache.tree, prompt), a.reps)
        rows[name] = {"depth": f.depth, "checkpoint": got_cp, "scan_ms": round(ref_ms, 4),
                      "walk_ms": round(new_ms, 4), "walk_over_scan": round(new_ms / ref_ms, 4)}
        print(f"{name:10s} depth {f.depth:6d}  scan (reference) {ref_ms:9.3f} ms  one walk {new_ms:9.3f} ms  "
              f"ratio {new_ms / ref_ms:.4f}")
    commit = bench_commit()
    out = Path(a.out or ROOT / "bench" / "results" /
               f"parked_lookup_{'cut' if a.cut_anywhere else 'nocut'}_{commit}.json")
    out.write_text(json.dumps({"commit": commit, "n_parked": a.n, "prompt_tokens": a.prompt,
                               "system_tokens": a.system, "cut_anywhere": a.cut_anywhere, "reps": a.reps,
                               "cases": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
