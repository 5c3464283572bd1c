"""The expert tier's policy replayed on recorded routings: which placement the decode steps of bench/moe_tier.py's
workload would hit, per arm and prefill_weight, without a GPU.

record: runs bench/moe_tier.py's workload (the same file, SPEC, prompts and greedy decoding) on the CPU backend and
keeps every MoE layer's routed expert ids per token, with the phase of each forward call (warm-up prompt, warm-up
decode, prompt, decode); written as .npz (the routings on the GPU equal these except at near ties of the router).
replay: drives the real ExpertStore (strata/moe/store.py) with a host SlotDevice whose copies complete
--copy-steps decode steps after they start (0: at once), calling it as strata/backend/cuda/moe_tier.Tier does:
begin_prefill / before_layer / after_layer / end_prefill around each prompt, step(1) after each decoded token,
place_hottest / place for the static and whole-layers arms after the warm-up. A decoded token's routing is a hit
when its expert is resident at that step. Reported per arm and budget: the decode hit rate over the measured part
(as the bench counts it), per layer, and the swaps; plus two references: the best single static placement for the
measured decode routings (hindsight), and per topic the best placement for that topic's decode routings.
Usage: python bench/moe_policy_sim.py [--gguf /tmp/moe_tier.gguf] [--trace T.npz] [--weights 1,0.3,0.1,0.03,0]
       [--out JSON]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from moe_tier import GEN, PROMPT, SPEC, TOPICS, WARM, topic_prompt  # noqa: E402


def record(gguf: str) -> dict:
    """The workload's routings on the CPU backend: a list of (phase, topic, ids int16 (n, n_moe_layers, k))."""
    import strata.backend.moe as M
    from strata.models.registry import load_model
    m = load_model(gguf)
    pool = m.new_page_pool(WARM * TOPICS + (PROMPT + GEN) * TOPICS + 64, n_seq=1)
    st = m.new_state(pool)
    route0 = M.route
    calls: list = []

    def route(logits, k, renorm):
        ids, w = route0(logits, k, renorm)
        calls.append(np.asarray(ids, dtype=np.int16))
        return ids, w
    M.route = route
    try:
        out: list = []

        def fwd(tokens, phase, topic):
            calls.clear()
            logits = m.forward(np.asarray(tokens, np.int32), st)
            out.append((phase, topic, np.stack(calls, axis=1)))      # (n, layers, k)
            return int(np.argmax(np.asarray(logits).reshape(-1, m.config.n_vocab)[-1]))
        toks = []
        for topic in range(TOPICS):
            t = fwd(topic_prompt(topic, WARM, 1), "warm_prompt", topic)
            for _ in range(8):
                t = fwd([t], "warm_decode", topic)
        for topic in range(TOPICS):
            t = fwd(topic_prompt(topic, PROMPT, 2), "prompt", topic)
            for _ in range(GEN):
                toks.append(t)
                t = fwd([t], "decode", topic)
    finally:
        M.route = route0
    return {"calls": out, "tokens": toks}


class HostSlots:
    """A SlotDevice over nothing but bookkeeping: a copy completes `delay` decode steps after it starts."""

    def __init__(self, n: int, delay: int = 0):
        self.n, self.delay, self.now = n, int(delay), 0
        self.counts = np.zeros(n, np.int64)

    def compute_mark(self):
        return None

    def copy_in(self, slot, key, after):
        return self.now + self.delay

    def done(self, ev) -> bool:
        return self.now >= ev

    def wait(self, ev) -> None:
        pass

    def compute_after(self, ev) -> None:
        pass

    def point(self, keys, slots) -> None:
        pass

    def read_counts(self) -> np.ndarray:
        c, self.counts = self.counts, np.zeros(self.n, np.int64)
        return c


def _count(ids: np.ndarray, ne: int) -> np.ndarray:
    """Flat counts (layers * ne) of ids (n, layers, k)."""
    n, L, k = ids.shape
    flat = (np.arange(L)[None, :, None] * ne + ids.astype(np.int64)).reshape(-1)
    return np.bincount(flat, minlength=L * ne)


def replay(trace: list, n_layers: int, ne: int, n_slots: int, how: str, pw: float, every: int, swaps: int,
           delay: int = 0, expert_bytes: int = 1) -> dict:
    """One arm over the recorded calls (see the module doc); how: adaptive, static, layers."""
    from strata.moe.policy import Policy
    from strata.moe.store import ExpertStore
    dev = HostSlots(n_layers * ne, delay)
    s = ExpertStore(list(range(n_layers)), ne, n_slots, expert_bytes, dev,
                    Policy(every=every, swaps=swaps, prefill_weight=pw), rate=None, lend_rows=64)
    s.static = how != "adaptive"
    hits = np.zeros(n_layers)
    seen = np.zeros(n_layers)
    measured = False
    for i, (phase, topic, ids) in enumerate(trace):
        if phase == "prompt" and not measured:
            if how == "static":
                s.place_hottest()
            elif how == "layers":
                s.place(list(range((n_slots // ne) * ne)))
            s.settle()
            s.observe(dev.read_counts())
            measured = True
        n = ids.shape[0]
        if n > 1:
            s.begin_prefill(n)
            for li in range(n_layers):
                s.before_layer(li)
                s.after_layer(li)
            dev.counts += _count(ids, ne)
            s.end_prefill()
        else:
            if measured:
                res = s.resident().reshape(n_layers, ne)
                for li in range(n_layers):
                    hits[li] += res[li, ids[0, li]].sum()
                    seen[li] += ids.shape[2]
            dev.counts += _count(ids, ne)
            dev.now += 1
            s.step(1)
    st = s.status()
    return {"hit_rate": round(float(hits.sum() / seen.sum()), 4),
            "per_layer": [round(float(h / max(1, n)), 3) for h, n in zip(hits, seen)],
            "swaps": st["swaps"], "staged": st["staged"], "rounds": st["rounds"]}


def hindsight(trace: list, n_layers: int, ne: int, n_slots: int) -> dict:
    """Hit rates of the best fixed placements chosen knowing the measured decode routings: one for the whole measured
    part, and one per topic (each topic's own decode routings)."""
    dec = [(t, ids) for ph, t, ids in trace if ph == "decode"]
    allc = sum(_count(ids, ne) for _, ids in dec)
    top = np.sort(allc)[::-1][:n_slots].sum()
    per_topic = 0
    for t in range(TOPICS):
        c = sum(_count(ids, ne) for tt, ids in dec if tt == t)
        per_topic += np.sort(c)[::-1][:n_slots].sum()
    total = allc.sum()
    return {"best_static": round(float(top / total), 4), "best_per_topic": round(float(per_topic / total), 4)}


def topic_overlap(trace: list, n_layers: int, ne: int, hot: int) -> dict:
    """How much of a topic's decode hot set its prompt predicts: per topic the share of the `hot` hottest experts
    (over all layers) of its decode routings that are also among the `hot` hottest of its prompt, against the same
    for the global warm-up set."""
    out = {}
    warm = sum(_count(ids, ne) for ph, _, ids in trace if ph.startswith("warm"))
    wset = set(np.argsort(-warm, kind="stable")[:hot].tolist())
    for t in range(TOPICS):
        p = sum(_count(ids, ne) for ph, tt, ids in trace if ph == "prompt" and tt == t)
        d = sum(_count(ids, ne) for ph, tt, ids in trace if ph == "decode" and tt == t)
        dset = set(np.argsort(-d, kind="stable")[:hot].tolist())
        pset = set(np.argsort(-p, kind="stable")[:hot].tolist())
        out[str(t)] = {"decode_hot_in_prompt_hot": round(len(dset & pset) / hot, 3),
                       "decode_hot_in_warmup_hot": round(len(dset & wset) / hot, 3)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default="/tmp/moe_tier.gguf", help="the bench's synthetic file (written when missing)")
    ap.add_argument("--trace", default=None, help=".npz of recorded routings (read when present, else written)")
    ap.add_argument("--fracs", default="0.25,0.5")
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--swaps", type=int, default=16)
    ap.add_argument("--weights", default="1,0.3,0.1,0.03,0", help="prefill_weight values of the adaptive arm")
    ap.add_argument("--copy-steps", type=int, default=0, help="decode steps a swap's copy takes to land")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from strata.gguf import synth
    if a.trace and os.path.exists(a.trace):
        z = np.load(a.trace, allow_pickle=False)
        trace = [(str(z[f"phase_{i}"]), int(z[f"topic_{i}"]), z[f"ids_{i}"]) for i in range(int(z["n"]))]
        tokens = z["tokens"].tolist()
    else:
        if not os.path.exists(a.gguf):
            synth.write_synthetic(a.gguf + ".tmp", synth.preset("qwen35moe", "tiny", **SPEC),
                                  workers=max(1, (os.cpu_count() or 2) // 2))
            os.replace(a.gguf + ".tmp", a.gguf)
        t0 = time.perf_counter()
        r = record(a.gguf)
        print(f"recorded {len(r['calls'])} forward calls in {time.perf_counter() - t0:.0f} s", flush=True)
        trace, tokens = r["calls"], r["tokens"]
        if a.trace:
            arrs = {"n": np.int64(len(trace)), "tokens": np.asarray(tokens, np.int64)}
            for i, (ph, t, ids) in enumerate(trace):
                arrs[f"phase_{i}"], arrs[f"topic_{i}"], arrs[f"ids_{i}"] = np.str_(ph), np.int64(t), ids
            np.savez_compressed(a.trace, **arrs)
    n_layers, ne = trace[0][2].shape[1], SPEC["n_expert"]
    res = {"what": "bench/moe_policy_sim.py", "spec": SPEC, "every": a.every, "swaps": a.swaps,
           "copy_steps": a.copy_steps, "decode_token_topics": np.bincount(np.asarray(tokens) % TOPICS,
                                                                          minlength=TOPICS).tolist(),
           "topic_overlap_top256": topic_overlap(trace, n_layers, ne, 256), "budgets": {}}
    for f in (float(x) for x in a.fracs.split(",")):
        n_slots = int(f * n_layers * ne)
        b = res["budgets"][f"{f:g}"] = {"slots": n_slots, **hindsight(trace, n_layers, ne, n_slots)}
        b["static"] = replay(trace, n_layers, ne, n_slots, "static", 1.0, a.every, a.swaps, a.copy_steps)
        b["layers"] = replay(trace, n_layers, ne, n_slots, "layers", 1.0, a.every, a.swaps, a.copy_steps)
        for w in (float(x) for x in a.weights.split(",")):
            b[f"adaptive_pw{w:g}"] = replay(trace, n_layers, ne, n_slots, "adaptive", w, a.every, a.swaps,
                                            a.copy_steps)
        print(f"budget {f:g} ({n_slots} slots): " + ", ".join(
            f"{k} {v['hit_rate'] if isinstance(v, dict) else v}" for k, v in b.items() if k != "slots"), flush=True)
    print("topic overlap:", json.dumps(res["topic_overlap_top256"]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
