"""Chi-square check that speculative sampling draws from the model's distribution: after a fixed prompt, the second
generated token (the first one a verify decides) is drawn DRAWS times with --spec 1 (an oracle drafting one fixed
token there, accepted often) and with --spec 0, each request with its own seed; both histograms are compared with
the exact distribution computed from the model's logits (sum over the first token's choices of p(t1) p(t2 | t1)),
and with each other (two-sample test).

Usage: python tools/spec_chisquare.py [--draws 3000] [--json OUT]. Prints the statistics and p-values; exits 1 if a
p-value is below 0.001.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.engine.engine import Engine                      # noqa: E402
from strata.engine.types import FinalEvent, GenerationRequest  # noqa: E402
from strata.gguf import synth                                # noqa: E402
from strata.sampling.sampler import Sampler, SamplingParams  # noqa: E402

PARAMS = dict(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0, repeat_penalty=1.0)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with df degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(x / 2.0, dtype=torch.float64)))


def exact_second(engine, prompt) -> dict[int, float]:
    """p(t2) = sum over t1 of p(t1) p(t2 | t1), under the sampler's distribution (top-k, temperature)."""
    params = SamplingParams(**PARAMS)
    seq = engine.seq
    seq.reset()
    ids1, p1 = Sampler(params, engine.n_vocab).distribution(seq.forward(np.asarray(prompt, np.int32)))
    out: dict[int, float] = {}
    for t1, w in zip(ids1.tolist(), p1.tolist()):
        if w <= 0:
            continue
        seq.reset()
        ids2, p2 = Sampler(params, engine.n_vocab).distribution(seq.forward(np.asarray(prompt + [t1], np.int32)))
        for t2, v in zip(ids2.tolist(), p2.tolist()):
            out[t2] = out.get(t2, 0.0) + w * v
    seq.reset()
    return out


def draw(engine, prompt, draws: int) -> list[int]:
    got = []
    for s in range(draws):
        req = GenerationRequest(prompt_tokens=list(prompt), sampling=SamplingParams(**PARAMS, seed=1000 + s),
                                max_tokens=3, ignore_eos=True)   # room for a verify of one draft
        toks = [ev.token_id for ev in engine.generate(req) if not isinstance(ev, FinalEvent)]
        got.append(toks[1])
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=3000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = synth.write_synthetic(Path(tmp) / "hybrid.gguf", synth.preset("qwen35", "tiny", seed=3, n_mtp=1))
        prompt = [int(t) for t in np.random.default_rng(5).integers(0, 1000, 12)]
        base = Engine(path, n_ctx=64, conversation_cache_mib=0)
        exact = exact_second(base, prompt)
        fixed = max(exact, key=exact.get)               # the draft: the likeliest second token
        spec = Engine(path, n_ctx=64, spec=1, conversation_cache_mib=0)
        spec.drafter.oracle = lambda pos, tok: fixed if pos == len(prompt) + 1 else tok
        a = draw(base, prompt, args.draws)
        b = draw(spec, prompt, args.draws)
        accepted = spec.spec_totals.accepted / max(1, spec.spec_totals.drafted)
    cats = sorted(exact, key=exact.get, reverse=True)
    # categories with an expected count >= 5, the rest pooled
    keep = [c for c in cats if exact[c] * args.draws >= 5]
    def hist(xs):
        h = {c: 0 for c in keep}
        rest = 0
        for x in xs:
            if x in h:
                h[x] += 1
            else:
                rest += 1
        return np.array([h[c] for c in keep] + [rest], np.float64)
    pe = np.array([exact[c] for c in keep] + [max(0.0, 1.0 - sum(exact[c] for c in keep))])
    if pe[-1] * args.draws < 5:           # nothing worth a category left: fold it into the last one
        pe = np.concatenate([pe[:-2], [pe[-2] + pe[-1]]])
    res = {"draws": args.draws, "categories": int(len(pe)), "spec_acceptance": round(accepted, 4)}
    for name, xs in (("spec0", a), ("spec1", b)):
        h = hist(xs)
        if len(h) > len(pe):
            h = np.concatenate([h[:-2], [h[-2] + h[-1]]])
        e = pe * args.draws
        x2 = float(((h - e) ** 2 / e).sum())
        res[name] = {"chi2": round(x2, 3), "df": len(pe) - 1, "p": chi2_sf(x2, len(pe) - 1)}
    ha, hb = hist(a), hist(b)
    tot = ha + hb
    m = tot > 0
    ea, eb = tot[m] / 2, tot[m] / 2
    x2 = float((((ha[m] - ea) ** 2) / ea + ((hb[m] - eb) ** 2) / eb).sum())
    res["two_sample"] = {"chi2": round(x2, 3), "df": int(m.sum()) - 1, "p": chi2_sf(x2, int(m.sum()) - 1)}
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    worst = min(res["spec0"]["p"], res["spec1"]["p"], res["two_sample"]["p"])
    return 1 if worst < 1e-3 else 0


if __name__ == "__main__":
    sys.exit(main())
