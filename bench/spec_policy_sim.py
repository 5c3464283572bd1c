"""--spec-adaptive's policy (strata.engine.spec_policy.AdaptiveN) replayed against measured costs, without a GPU:
tokens per second of the policy beside every fixed N and N = 0 (plain decode steps), per acceptance.

Costs come from a bench/spec_decode.py result (an H100's by default): a plain decode step (1 / --spec 0's tok/s,
the drafter's own cost on a plain step from the "off" micro ratio), drafting k tokens and a verify of k + 1 tokens
(its `micro` times, sizes not measured interpolated linearly), the Commit, and the rest of a verify round on the
host (judging, handing the drafter its rows, the emission): fitted so that the fixed-N arms' simulated ratios
match the measured ones (printed beside them; --round-ms sets it instead). Every time is jittered (lognormal,
--jitter), and the first time of each size the policy is handed is cold (--cold-ms more: a CUDA graph captured,
which a process does once: not counted in the tokens per second).

Acceptance: each position's draft is kept with its rate, independently (the bench's oracle: a draft after a
rejected one is never tried); one sequence per seed, shared by every arm. Scenarios: every rate of --rates for
--tokens tokens, and rates that change mid-answer ("0.9>0.3": the first half at 0.9, the second at 0.3). The policy
starts fresh for each answer (as after a start), or with --carry goes on from one answer to the next (as in the
daemon, from one request to the next).

Usage: PYTHONPATH=. python bench/spec_policy_sim.py [--costs bench/results/spec_decode_h100_3f52f2b.json]
       [--rates 0.2,0.3,...] [--tokens 512] [--seeds 16] [--nmax 4] [--picks] [--carry] [--out PATH]
Writes bench/results/spec_policy_sim_<costs' device>_<commit>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import commit as bench_commit  # noqa: E402

from strata.engine.spec_policy import AdaptiveN  # noqa: E402

DEFAULT_COSTS = ROOT / "bench" / "results" / "spec_decode_h100_3f52f2b.json"
RATES = "0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,0.95"
CHANGES = "0.9>0.3,0.3>0.9,0.95>0.5>0.95"




@dataclass
class Costs:
    """Seconds: a plain step (with the drafter off / on), drafting k tokens, a verify of k + 1 tokens, the Commit,
    the rest of a round on the host."""
    step: float
    step_drafter_on: float
    draft: dict[int, float]
    verify: dict[int, float]
    commit: float
    round: float = 0.0
    source: dict = field(default_factory=dict)

    def round_time(self, k: int) -> float:
        return self.draft[k] + self.verify[k] + self.commit + self.round


def _fill(d: dict[int, float], nmax: int) -> dict[int, float]:
    """Sizes 1..nmax from the measured ones: linear between them, the nearest two's line beyond."""
    ks = sorted(d)
    out = {}
    for k in range(1, nmax + 1):
        if k in d:
            out[k] = d[k]
            continue
        lo = [x for x in ks if x < k]
        hi = [x for x in ks if x > k]
        a, b = (lo[-1], hi[0]) if lo and hi else (ks[-2], ks[-1]) if lo else (ks[0], ks[1])
        out[k] = d[a] + (d[b] - d[a]) * (k - a) / (b - a)
    return out


def load_costs(path: Path, nmax: int, picks: bool = False) -> Costs:
    """The costs of a bench/spec_decode.py result; picks: the verify judged on the device (verify_picks_ms, where
    the result has it)."""
    res = json.loads(path.read_text())
    m = res["micro"]
    step = 1.0 / res["spec0_tok_s"]
    on = step * m.get("plain_drafter_on_over_off", 1.0)
    draft = {int(k[1:]): v["draft_ms"] * 1e-3 for k, v in m.items() if k.startswith("n") and k[1:].isdigit()}
    key = "verify_picks_ms" if picks else "verify_ms"
    verify = {int(k[1:]): (v.get(key) or v["verify_ms"]) * 1e-3 for k, v in m.items()
              if k.startswith("n") and k[1:].isdigit()}
    commit = float(np.median([v["commit_ms"] for k, v in m.items() if k.startswith("n") and k[1:].isdigit()])) * 1e-3
    return Costs(step, on, _fill(draft, nmax), _fill(verify, nmax), commit,
                 source={"file": path.name, "device": res.get("device"), "commit": res.get("commit")})


def fit_round(costs: Costs, path: Path) -> tuple[float, list[dict]]:
    """The host's rest of a round (seconds) that makes the fixed-N arms' ratios in `path` come out as measured: the
    median over the arms of (measured seconds a round - drafting - verify - Commit), a round's seconds from the
    arm's tok/s and its tokens per verify."""
    res = json.loads(path.read_text())
    rest, rows = [], []
    for r in res["runs"]:
        if not isinstance(r["n"], int) or not r.get("verifies"):
            continue
        ratio, mal = r["ratio_median"], r["mean_accepted"]
        per_round = mal * costs.step / ratio
        rest.append(per_round - costs.draft[r["n"]] - costs.verify[r["n"]] - costs.commit)
        rows.append({"n": r["n"], "acceptance": r["acceptance"], "measured_ratio": ratio, "mean_accepted": mal})
    fit = max(float(np.median(rest)), 0.0) if rest else 0.0
    for row in rows:
        row["fitted_ratio"] = row["mean_accepted"] * costs.step / (costs.round_time(row["n"]) - costs.round + fit)
    return fit, rows


def rate_of(scenario: str, tokens: int):
    """'0.8' -> 0.8 throughout; '0.9>0.3' -> 0.9 then 0.3 (equal parts) -> function position -> rate."""
    parts = [float(x) for x in scenario.split(">")]
    return lambda p: parts[min(len(parts) - 1, p * len(parts) // tokens)]


class Jitter:
    """The times of one answer: the model's with lognormal jitter -> (the time spent, the time the policy is
    handed: the first of each size cold as well). A graph is captured once per process, so its cost is not
    counted in the time spent; but the policy starts fresh and sees it."""

    def __init__(self, rng, sd: float, cold_s: float):
        self.rng, self.sd, self.cold_s, self.seen = rng, sd, cold_s, set()

    def __call__(self, size, t: float, cold: bool = True) -> tuple[float, float]:
        out = t * float(np.exp(self.rng.normal(0.0, self.sd))) if self.sd else t
        if cold and size not in self.seen:
            self.seen.add(size)
            return out, out + self.cold_s
        return out, out


def simulate(arm, costs: Costs, ok: np.ndarray, rng, jitter: float, cold_s: float) -> dict:
    """One answer of len(ok) tokens (ok[p]: the draft of position p would be kept) -> seconds, verifies, drafted,
    accepted. arm: an int N (fixed: N drafts every step, 0 = --spec 0) or an AdaptiveN."""
    n_tok = len(ok)
    pos, t, verifies, drafted, accepted, plain = 0, 0.0, 0, 0, 0, 0
    clock = Jitter(rng, jitter, cold_s)
    policy = arm if isinstance(arm, AdaptiveN) else None
    while pos < n_tok:
        n = policy.choose() if policy is not None else int(arm)
        n = min(n, n_tok - pos - 1)
        if n <= 0:
            step = costs.step_drafter_on if (policy is not None or arm) else costs.step
            dt, seen = clock(0, step)
            t += dt
            pos += 1
            plain += 1
            if policy is not None:
                policy.plain_step(seen)
            continue
        k = 0
        while k < n and ok[pos + 1 + k]:
            k += 1
        (d, _), (v, v_seen) = clock(n, costs.draft[n], cold=False), clock(n, costs.verify[n])
        r, _ = clock(n, costs.commit + costs.round, cold=False)
        t += d + v + r
        if policy is not None:
            policy.verified(n, k, d, v_seen, r)
        pos += k + 1
        verifies, drafted, accepted = verifies + 1, drafted + n, accepted + k
    return {"seconds": t, "tokens": n_tok, "verifies": verifies, "drafted": drafted, "accepted": accepted,
            "plain": plain}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--costs", default=str(DEFAULT_COSTS))
    ap.add_argument("--rates", default=RATES)
    ap.add_argument("--changes", default=CHANGES)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--nmax", type=int, default=4)
    ap.add_argument("--round-ms", type=float, default=None, help="the host's rest of a round (default: fitted)")
    ap.add_argument("--jitter", type=float, default=0.05)
    ap.add_argument("--cold-ms", type=float, default=5.0)
    ap.add_argument("--policy", default="{}", help="AdaptiveN keyword arguments, JSON")
    ap.add_argument("--picks", action="store_true", help="verifies judged on the device (verify_picks_ms)")
    ap.add_argument("--carry", action="store_true",
                    help="one policy for a scenario's answers, one after the other (as in the daemon)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = Path(args.costs)
    costs = load_costs(path, args.nmax, args.picks)
    fit, check = fit_round(load_costs(path, args.nmax), path)      # the arms measured: host rows
    costs.round = fit if args.round_ms is None else args.round_ms * 1e-3
    kw = json.loads(args.policy)
    print(f"costs from {path.name} ({costs.source['device']}): step {costs.step * 1e3:.3f} ms "
          f"(drafter on {costs.step_drafter_on * 1e3:.3f}), rounds "
          + ", ".join(f"{k}: {costs.round_time(k) * 1e3:.2f}" for k in range(1, args.nmax + 1))
          + f" ms (Commit {costs.commit * 1e3:.2f}, rest {costs.round * 1e3:.2f}"
          + (" fitted)" if args.round_ms is None else ")"))
    if check:
        print("fixed arms measured vs with the fitted rest: " + "; ".join(
            f"N={r['n']}@{r['acceptance']}: {r['measured_ratio']:.2f}/{r['fitted_ratio']:.2f}" for r in check))
    arms = list(range(args.nmax + 1))
    scen = [str(r) for r in args.rates.split(",")] + ([c for c in args.changes.split(",") if c] if args.changes else [])
    rows = []
    print(f"{'acceptance':>14} " + " ".join(f"{'N=' + str(a):>6}" for a in arms) + f" {'policy':>7} {'best':>5}"
          f" {'pol/best':>8} {'pol/N0':>7} {'verif':>6} {'plain':>6}")
    for sc in scen:
        rate = rate_of(sc, args.tokens)
        tps = {a: [] for a in arms + ["policy"]}
        pol_stats = []
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            ok = np.array([rng.random() < rate(p) for p in range(args.tokens)])
            for a in arms:
                r = simulate(a, costs, ok, np.random.default_rng(10_000 + seed), args.jitter, args.cold_ms * 1e-3)
                tps[a].append(r["tokens"] / r["seconds"])
            if not args.carry or seed == 0:
                policy = AdaptiveN(args.nmax, **kw)
            r = simulate(policy, costs, ok, np.random.default_rng(10_000 + seed), args.jitter, args.cold_ms * 1e-3)
            tps["policy"].append(r["tokens"] / r["seconds"])
            pol_stats.append(r)
        mean = {a: float(np.mean(v)) for a, v in tps.items()}
        best = max(arms, key=lambda a: mean[a])
        row = {"scenario": sc, "tok_s": mean, "best_fixed": best, "policy_over_best": mean["policy"] / mean[best],
               "policy_over_n0": mean["policy"] / mean[0],
               "fixed_over_n0": {a: mean[a] / mean[0] for a in arms},
               "policy_verifies": float(np.mean([s["verifies"] for s in pol_stats])),
               "policy_plain": float(np.mean([s["plain"] for s in pol_stats])),
               "policy_drafted": float(np.mean([s["drafted"] for s in pol_stats]))}
        rows.append(row)
        print(f"{sc:>14} " + " ".join(f"{mean[a] / mean[0]:6.2f}" for a in arms)
              + f" {row['policy_over_n0']:7.2f} {'N=' + str(best):>5} {row['policy_over_best']:8.3f}"
              f" {row['policy_over_n0']:7.3f} {row['policy_verifies']:6.1f} {row['policy_plain']:6.1f}")
    worst = min(r["policy_over_best"] for r in rows if ">" not in r["scenario"])
    low = [r["policy_over_n0"] for r in rows if ">" not in r["scenario"] and r["best_fixed"] == 0]
    print(f"worst policy/best over constant rates: {worst:.3f}; policy/N=0 where N=0 is best: "
          f"{min(low) if low else float('nan'):.3f}")
    out_doc = {"commit": bench_commit(), "costs": {"source": costs.source, "step_ms": costs.step * 1e3,
                                               "step_drafter_on_ms": costs.step_drafter_on * 1e3,
                                               "draft_ms": {k: v * 1e3 for k, v in costs.draft.items()},
                                               "verify_ms": {k: v * 1e3 for k, v in costs.verify.items()},
                                               "commit_ms": costs.commit * 1e3, "rest_ms": costs.round * 1e3,
                                               "rest_fitted": args.round_ms is None, "fit_check": check},
               "tokens": args.tokens, "seeds": args.seeds, "nmax": args.nmax, "jitter": args.jitter,
               "cold_ms": args.cold_ms, "picks": args.picks, "carry": args.carry, "policy_kwargs": kw, "rows": rows, "worst_policy_over_best": worst,
               "min_policy_over_n0_where_n0_best": min(low) if low else None}
    dev = "cuda" if not costs.source.get("device") else costs.source["device"].split()[1].lower() \
        if costs.source["device"].startswith("NVIDIA") else costs.source["device"]
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"spec_policy_sim_{dev}_{out_doc['commit']}.json"
    out.write_text(json.dumps(out_doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
