"""Speculative decoding with the MTP head at known acceptance: decode tokens per second with --spec N against --spec 0
(each run paired with a --spec 0 run just before it; the median ratio), the mean accepted length, the verify of N + 1 tokens against a decode step, the cost of one
rejected draft and of one Commit (against one checkpoint + restore + replaying the accepted tokens), and what a plain
decode step costs with the drafter on (its hidden row observed, the MTP block fed) against one without.

Random weights give meaningless acceptance, so the drafts are an oracle's: the greedy continuation recorded by a
first pass with --spec 0, each drafted position kept with probability `acceptance` and otherwise replaced by a wrong
token, independently per position. The MTP head still runs on every draft (its K/V and its cost are real). Greedy
output is checked equal to the first pass on every run.

Model: a synthetic qwen35 hybrid with an MTP block, Q8_0, written into --dir: synth preset 'small' by default on
the CPU; on a GPU (--device cuda) the ~1.5B hybrid of bench/gpu_hybrid_model.py ('1.5b': 24 layers, n_embd 2048)
with an MTP block. --size picks either family's size ('small' / 'medium' / 'large': synth presets; '1.5b' / 'tiny':
the GPU bench's writer).
Usage: PYTHONPATH=. python bench/spec_decode.py [--device cpu|cuda] [--size small] [--ns 1,2,3,4]
       [--acceptance 0.3,0.5,0.7,0.8,0.9] [--tokens 64] [--prompt 64] [--reps 2] [--threads N] [--out PATH]
Besides N = --ns, an "adaptive" arm: --spec max(ns) --spec-adaptive (each verify takes 0..N drafts as the measured
acceptance and costs make fastest; its acceptance estimate carries over from one rate's runs to the next), and once
an "off" arm: the adaptive policy pinned to plain steps (what a plain step with the drafter on costs). The
--spec arms share one engine (its decoder's N set per arm); --spec 0 is an engine of its own.
--parallel M (M > 1) runs other arms instead: M concurrent requests (distinct prompts, one per slot), aggregate decode
tok/s with --spec N --parallel M against --spec 0 --parallel M at each acceptance (each slot's drafts its own
request's oracle's), every greedy answer checked equal to the request alone; writes
bench/results/spec_decode_parallel<M>_<device>_<commit>.json.
Writes bench/results/spec_decode_<device>_<commit>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import commit as bench_commit  # noqa: E402

from strata.engine.engine import Engine                      # noqa: E402
from strata.engine.spec_policy import AdaptiveN              # noqa: E402
from strata.engine.types import FinalEvent, GenerationRequest  # noqa: E402
from strata.gguf import synth                                # noqa: E402




class Oracle:
    """The recorded continuation by absolute position, each drafted position kept with probability `rate`."""

    def __init__(self, by_pos: dict[int, int], rate: float, n_vocab: int, seed: int):
        self.by_pos, self.rate, self.n_vocab = by_pos, rate, n_vocab
        self.rng = np.random.default_rng(seed)

    def __call__(self, pos: int, token: int) -> int:
        want = self.by_pos.get(pos)
        if want is None:
            return token
        return want if self.rng.random() < self.rate else (want + 1) % self.n_vocab


def device_name(engine, device: str) -> str:
    """'cpu', or the GPU's name (e.g. 'NVIDIA H100 80GB HBM3')."""
    if device == "cpu":
        return "cpu"
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(int(device.split(":")[1]))
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def run(engine, prompt, tokens):
    req = GenerationRequest(prompt_tokens=list(prompt), max_tokens=tokens, ignore_eos=True, cache_prompt=False,
                            checkpoint=False)
    toks, final = [], None
    for ev in engine.generate(req):
        if isinstance(ev, FinalEvent):
            final = ev
        else:
            toks.append(ev.token_id)
    return toks, final.timings


def best(fn, reps):
    out = None
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        out = dt if out is None else min(out, dt)
    return out


def device_sync(engine):
    """A function that waits for the engine's last stage's device (nothing on the CPU)."""
    be = getattr(engine.stages[-1], "backend", None)
    if be is None or getattr(be, "xp", np) is np:
        return lambda: None
    return be.xp.cuda.Device(be.device_id).synchronize


def micro(engine, prompt, ns, reps):
    """Model times on the live sequence after the prompt (`engine` runs --spec): a decode step, drafting n tokens
    with the MTP head, a verify of n + 1 tokens (kept states; on a GPU also judged greedily on the device: its
    rows' picks alone copied to the host), the Commit back to one token, and the alternative: a checkpoint, its
    restore and a forward of the accepted token."""
    seq = engine.seq
    rng = np.random.default_rng(0)
    seq.reset()
    _, h = seq.forward(np.asarray(prompt, np.int32), hidden=True)
    engine.drafter.observe(0, h)                  # the MTP K/V follows the prompt, as in the engine
    engine.drafter.flush()
    ck = seq.capture()
    out = {}
    sync = device_sync(engine)

    def clock(into: list, fn, *args, **kw):
        """fn(*args, **kw) run to the device's end, its seconds appended to `into` -> what fn returned."""
        t0 = time.perf_counter()
        got = fn(*args, **kw)
        sync()
        into.append(time.perf_counter() - t0)
        return got

    def decode():
        seq.restore(ck)
        sync()
        t0 = time.perf_counter()
        seq.forward(np.asarray([5], np.int32))
        sync()
        return time.perf_counter() - t0

    out["decode_ms"] = min(decode() for _ in range(reps * 3)) * 1e3

    on_device = bool(getattr(engine.stages[-1], "device_logits", False))

    def plain(drafter_on: bool, k: int = min(65, engine.n_ctx - len(prompt) - 8)):
        """k plain decode steps as the decoder reads them (with the drafter on: the hidden rows observed, fed to
        the MTP block once FEED_BATCH wait) -> seconds a step."""
        seq.restore(ck)
        engine.drafter.flush()
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            pos = seq.pos
            if drafter_on:
                _, h = seq.forward(np.asarray([5], np.int32), on_device=on_device, hidden=True)
                engine.drafter.observe(pos, h)
            else:
                seq.forward(np.asarray([5], np.int32), on_device=on_device)
        sync()
        return (time.perf_counter() - t0) / k

    off, on = [], []
    for _ in range(reps * 2):                      # interleaved: the machine's drift hits both alike
        off.append(plain(False))
        on.append(plain(True))
    out["plain_step_ms"], out["plain_step_drafter_on_ms"] = min(off) * 1e3, min(on) * 1e3
    out["plain_drafter_on_over_off"] = min(on) / min(off)
    from strata.sampling.device import DeviceSampler
    from strata.sampling.sampler import SamplingParams
    greedy = DeviceSampler(SamplingParams(temperature=0), engine.n_vocab)
    for n in ns:
        toks = rng.integers(0, 1000, n + 1).astype(np.int32)
        v, c, cap, rest, replay, dr, ra, vp = [], [], [], [], [], [], [], []
        for _ in range(reps * 3):
            seq.restore(ck)
            sync()
            clock(dr, engine.drafter.draft, 5, n, 0.0)
            base = seq.pos
            clock(v, seq.verify, toks)
            clock(c, seq.commit, base + 1)          # every draft rejected: the deepest cut-back
            if on_device:         # a greedy verify judged on the device: the rows' picks alone come to the host
                seq.restore(ck)
                sync()
                clock(vp, lambda: greedy.greedy_rows(seq.verify(toks, on_device=True)[0]))
                seq.commit(base + 1)
            # the same read without the kept states (every row's logits): what keeping them costs
            seq.restore(ck)
            sync()
            clock(ra, seq.forward, toks, all_logits=True)
            # the alternative: a checkpoint before the verify, restored after it, the accepted token read again
            seq.restore(ck)
            sync()
            k2 = clock(cap, seq.capture)
            seq.forward(toks)
            sync()
            clock(rest, seq.restore, k2)
            clock(replay, seq.forward, toks[:1])
            k2.release()
        graph, gen = getattr(engine.drafter, "_graph", None), []
        if graph is not None:            # the reference: the model's own MTP block and head on the same device
            engine.drafter._graph = None
            for _ in range(reps * 3):
                seq.restore(ck)
                sync()
                clock(gen, engine.drafter.draft, 5, n, 0.0)
            engine.drafter._graph = graph
        out[f"n{n}"] = {"draft_ms": min(dr) * 1e3, "draft_generic_ms": min(gen) * 1e3 if gen else None, "verify_ms": min(v) * 1e3,
                        "verify_picks_ms": min(vp) * 1e3 if vp else None, "read_all_ms": min(ra) * 1e3,
                        # all n drafts rejected: the round yields one token, as a decode step does
                        "rejected_draft_ms": (min(dr) + min(v)) * 1e3 / n - out["decode_ms"] / n, "verify_over_decode": min(v) * 1e3 / out["decode_ms"],
                        "commit_ms": min(c) * 1e3, "checkpoint_ms": min(cap) * 1e3, "restore_ms": min(rest) * 1e3,
                        "replay_one_ms": min(replay) * 1e3,
                        "checkpoint_replay_over_commit": (min(cap) + min(rest) + min(replay)) / max(min(c), 1e-9)}
    ck.release()
    seq.reset()
    return out


def write_model(d: Path, device: str, size: str | None) -> Path:
    """The bench's synthetic hybrid with an MTP block (Q8_0), written once into d."""
    from bench import gpu_hybrid_model as gh
    size = size or ("small" if device == "cpu" else "1.5b")
    if size in gh.SIZES:
        from strata.gguf.default_model import default_model_path
        path = d / f"syn_qwen35_{size}_mtp_q8_gh.gguf"
        if not path.exists():
            gh.make_synthetic_hybrid(path, default_model_path(), size=size, qtype="Q8_0", seed=1, n_mtp=1)
        return path
    path = d / f"syn_qwen35_{size}_mtp_q8.gguf"
    if not path.exists():
        synth.write_synthetic(path, synth.preset("qwen35", size, seed=1, n_mtp=1, qtype="Q8_0", embd_qtype="Q8_0"))
    return path


class SlotOracle:
    """One slot's drafts in the --parallel arms: the recorded continuation of the request its sequence holds (the
    one of `refs` whose prompt starts it), each drafted position kept with probability `rate`."""

    def __init__(self, seq, refs: list[tuple[list[int], list[int]]], rate: float, n_vocab: int, seed: int):
        self.seq, self.refs, self.rate, self.n_vocab = seq, refs, rate, n_vocab
        self.rng = np.random.default_rng(seed)

    def __call__(self, pos: int, token: int) -> int:
        ids = self.seq.ids
        for prompt, ref in self.refs:
            k = pos - len(prompt)
            if len(ids) >= len(prompt) and np.array_equal(ids[:len(prompt)], prompt) and 0 <= k < len(ref):
                return ref[k] if self.rng.random() < self.rate else (ref[k] + 1) % self.n_vocab
        return token


def run_together(engine, prompts, tokens):
    """The prompts as concurrent requests, one per slot, stepped until all end -> (each one's tokens, aggregate
    decode tok/s: the tokens emitted once every request has its first token, over the time since then)."""
    got = {i: [] for i in range(len(prompts))}
    stamps: list[float] = []
    done: dict = {}

    def on_event(i):
        def f(ev):
            if not isinstance(ev, FinalEvent):
                got[i].append(ev.token_id)
                stamps.append(time.perf_counter()) if len(got[i]) == 1 else None
        return f

    for i, p in enumerate(prompts):
        req = GenerationRequest(prompt_tokens=list(p), max_tokens=tokens, ignore_eos=True, cache_prompt=False,
                                checkpoint=False, id_slot=i)
        assert engine.admit(req, on_event(i), lambda err, i=i: done.__setitem__(i, err)) == i
    while len(stamps) < len(prompts) and engine.step():
        pass
    t0, n0 = time.perf_counter(), sum(len(v) for v in got.values())
    while engine.step():
        pass
    dt = time.perf_counter() - t0
    assert all(err is None for err in done.values()), done
    return [got[i] for i in range(len(prompts))], (sum(len(v) for v in got.values()) - n0) / dt


def parallel_arms(path, kw, m: int, ns: list[int], rates: list[float], args) -> dict:
    """M concurrent requests, one per slot: aggregate decode tok/s with --spec N --parallel M against --spec 0
    --parallel M (each --spec N run paired with a --spec 0 run just before it; the median ratio), and an adaptive
    arm (--spec max(ns) --spec-adaptive: each slot's policy its own, carried from one rate to the next), once an
    "off" arm (every policy pinned to plain steps: what the batched step costs with the drafters on), greedy
    answers checked equal to each request's --spec 0 answer alone."""
    prompts = [[int(t) for t in np.random.default_rng(3 + i).integers(0, 1000, args.prompt)] for i in range(m)]
    alone = Engine(path, **kw)
    refs = [run(alone, p, args.tokens)[0] for p in prompts]
    base = Engine(path, parallel=m, **kw)
    e = Engine(path, parallel=m, spec=max(ns), **kw)
    run_together(base, prompts, args.tokens)           # warm
    res = {"parallel": m, "runs": []}
    policies = {s.id: AdaptiveN(max(ns)) for s in e.slots}    # the adaptive arm's, carried from rate to rate
    for rate in rates:
        for n in ns + ["adaptive"] + (["off"] if rate == rates[0] else []):
            for s in e.slots:
                s.decoder.spec = n if n in ns else max(ns)
                # "off": each slot's policy pinned to plain steps (the drafters fed, the batched step's hidden rows)
                s.decoder.adaptive = policies[s.id] if n == "adaptive" else AdaptiveN(0) if n == "off" else None
            pairs, meta = [], None
            for r in range(args.reps):
                toks0, tps0 = run_together(base, prompts, args.tokens)
                assert toks0 == refs
                for s in e.slots:
                    s.decoder.drafter.oracle = SlotOracle(s.seq, list(zip(prompts, refs)), rate, base.n_vocab,
                                                          seed=100 * r + s.id)
                before = dict(e.scheduler.stats)
                toks, tps = run_together(e, prompts, args.tokens)
                assert toks == refs, f"--spec {n} --parallel {m} at acceptance {rate} changed a greedy answer"
                pairs.append((tps, tps0))
                meta = {k: e.scheduler.stats[k] - before[k] for k in ("steps", "verifies", "verify_tokens",
                                                                      "batched_steps")}
            ratios = sorted(a / b for a, b in pairs)
            row = {"n": n, "acceptance": rate, "tok_s": [a for a, _ in pairs], "spec0_tok_s": [b for _, b in pairs],
                   "ratio_median": ratios[len(ratios) // 2], "ratios": ratios, "last_run": meta}
            if n == "adaptive":
                row["policy"] = {i: p.snapshot() for i, p in policies.items()}
            res["runs"].append(row)
            print(f"--parallel {m} N={n} acceptance {rate}: aggregate {row['tok_s'][-1]:.1f} tok/s vs "
                  f"{row['spec0_tok_s'][-1]:.1f} at --spec 0: {row['ratio_median']:.2f}x (median of {len(ratios)} "
                  f"pairs; {meta})", flush=True)
    for x in (alone, base, e):
        x.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default=None)
    ap.add_argument("--ns", default="1,2,3,4")
    ap.add_argument("--acceptance", default="0.3,0.5,0.7,0.8,0.9")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dir", default="/tmp/spec_models", help="where the synthetic model is written")
    ap.add_argument("--parallel", type=int, default=0,
                    help="M > 1: only the arms of M concurrent requests in M slots (aggregate tok/s)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda:0" if args.device == "cuda" else args.device
    ns = [int(x) for x in args.ns.split(",")]
    rates = [float(x) for x in args.acceptance.split(",")]
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    path = write_model(d, device, args.size)
    kw = dict(n_ctx=args.prompt + args.tokens + 32, device=device, conversation_cache_mib=0, prompt_cache=0)
    if args.threads:
        kw["threads"] = args.threads
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 1000, args.prompt)]
    if args.parallel > 1:
        kw["n_ctx"] = max(256, args.prompt + args.tokens + 32)     # a KV page (256 tokens) per slot at least
        res = {"device": device, "model": path.name, "commit": bench_commit(), "tokens": args.tokens,
               "prompt": args.prompt, "reps": args.reps, **parallel_arms(path, kw, args.parallel, ns, rates, args)}
        res["threads"] = int(kw.get("threads") or 0) or None
        out = Path(args.out) if args.out else (ROOT / "bench" / "results" /
                                               f"spec_decode_parallel{args.parallel}_{device}_{res['commit']}.json")
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {out}")
        return 0

    base = Engine(path, **kw)
    ref, _ = run(base, prompt, args.tokens)
    by_pos = {len(prompt) + i: t for i, t in enumerate(ref)}

    def baseline():
        tps = []
        for _ in range(args.reps):
            toks, t = run(base, prompt, args.tokens)
            assert toks == ref
            tps.append(t["predicted_per_second"])
        return max(tps)

    baseline()                                    # warm: the first runs after a load are slower
    res = {"device": device_name(base, device), "model": path.name, "commit": bench_commit(), "tokens": args.tokens, "prompt": args.prompt,
           "threads": base.threads, "reps": args.reps, "spec0_tok_s": baseline(), "runs": []}
    e = Engine(path, spec=max(ns), **kw)           # one engine for every arm: its decoder's N set per arm
    adaptive = AdaptiveN(max(ns))                  # its estimates carry over from one rate's runs to the next
    for rate in rates:
        for n in ns + ["adaptive"] + (["off"] if rate == rates[0] else []):
            e.decoder.spec = n if n in ns else max(ns)
            # "off": the adaptive policy pinned to plain steps (no drafts, no probes), the drafter fed as always
            e.decoder.adaptive = adaptive if n == "adaptive" else AdaptiveN(0) if n == "off" else None
            pairs, acc = [], None
            for r in range(args.reps):            # --spec 0 and --spec N back to back: the machine is shared
                toks0, t0 = run(base, prompt, args.tokens)
                assert toks0 == ref
                e.drafter.oracle = Oracle(by_pos, rate, base.n_vocab, seed=1000 * ns.index(n) + r if n in ns else r)
                toks, t = run(e, prompt, args.tokens)
                assert toks == ref, f"--spec {n} at acceptance {rate} changed the greedy output"
                pairs.append((t["predicted_per_second"], t0["predicted_per_second"]))
                acc = t
            ratios = sorted(a / b for a, b in pairs)
            row = {"n": n, "acceptance": rate, "tok_s": [a for a, _ in pairs], "spec0_tok_s": [b for _, b in pairs],
                   "ratio_median": ratios[len(ratios) // 2], "ratios": ratios,
                   "measured_acceptance": acc["draft_acceptance_rate"], "mean_accepted": acc["draft_mean_accepted"],
                   "verifies": acc["draft_verifies"]}
            if n == "adaptive":                   # what the policy believes after the arm
                row["policy"] = adaptive.snapshot()
            res["runs"].append(row)
            print(f"N={n} acceptance {rate}: {row['ratio_median']:.2f}x --spec 0 (median of {len(ratios)} pairs; "
                  f"measured {row['measured_acceptance']:.2f}, {row['mean_accepted']:.2f} tokens per verify)"
                  + (f"; policy {row['policy']}" if "policy" in row else ""), flush=True)
    res["spec0_tok_s_end"] = baseline()           # the reference again: how much the machine drifted
    e.decoder.spec, e.decoder.adaptive = max(ns), None
    e.drafter.oracle = None
    res["micro"] = micro(e, prompt, ns, args.reps)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    gpu = re.search(r"\b([A-Z]\d{2,3})\b", res["device"])
    tag = "cpu" if device == "cpu" else gpu.group(1).lower() if gpu else "cuda"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"spec_decode_{tag}_{res['commit']}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
