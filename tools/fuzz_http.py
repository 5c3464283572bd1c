#!/usr/bin/env python3
"""Large HTTP fuzz of a real `strata serve` (Unix socket only): every route and method the application's router
registers, with the requests of tests/http_fuzz.py (paths, query strings, headers with odd encodings and huge values,
bodies shaped by each route's schema, valid-looking and broken), N cases. Every answer must be below 500 (but
Ollama's documented 501s), an error body in its API's JSON shape, and a refused request must leave the engine's state
unchanged; the daemon must stay alive, and a reference conversation must answer as it did before, checked every
--reference-every cases and at the end. Problems are counted and the run goes on.

Usage: python tools/fuzz_http.py [--cases 100000] [--seed 0] [--out bench/results/fuzz_http_<commit>.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference-every", type=int, default=5000, help="cases between checks of the reference "
                                                                      "conversation")
    ap.add_argument("--out", default=None, help="where to write the JSON summary (default: "
                                                 "bench/results/fuzz_http_<commit>.json; '' for nowhere)")
    args = ap.parse_args(argv)
    from hypothesis import HealthCheck, given, seed, settings

    from tests import http_fuzz
    from tests.daemon import Daemon

    table = http_fuzz.route_table()
    with tempfile.TemporaryDirectory(prefix="strata-fuzz-http-") as tmp:
        slots = Path(tmp) / "slots"
        slots.mkdir()
        d = Daemon(Path(tmp), "--queue-max", "4", "--max-body", "3000000", "--n-predict", "4", "--embeddings",
                   "--slot-save-path", str(slots), "--log-level", "info", n_ctx=256).start()
        run = http_fuzz.FuzzRun(d).start()
        res: dict = {"cases": 0, "routes": [f"{m} {t}" for m, t in table], "statuses": run.counts,
                     "problems": 0, "first_problems": run.problems, "reference_checks": 0}
        t0 = time.time()

        @seed(args.seed)
        @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=["generate"])
        @given(http_fuzz.cases(table))
        def one(case):
            res["cases"] += 1
            run.check(case)
            if res["cases"] % args.reference_every == 0:
                res["reference_checks"] += 1
                why = run.reference_problem()
                if why:
                    run.problems.append({"problem": why, "case": f"after case {res['cases']}"})
                print(json.dumps({"cases": res["cases"], "s": round(time.time() - t0), "statuses": run.counts,
                                  "problems": len(run.problems)}), flush=True)
                if run.problems:
                    print(json.dumps(run.problems[-3:], default=str), flush=True)
            if d.proc.poll() is not None:
                raise SystemExit(f"the daemon exited with {d.proc.returncode} after {res['cases']} cases")

        try:
            one()
        finally:
            res["reference_checks"] += 1
            if d.proc.poll() is None:
                why = run.reference_problem()
                if why:
                    run.problems.append({"problem": why, "case": "at the end"})
            res["problems"] = len(run.problems)
            res["first_problems"] = run.problems[:50]
            res["slowest"] = run.slowest
            res["seconds"] = round(time.time() - t0, 1)
            res["daemon_alive"] = d.proc.poll() is None
            d.stop()
            lines, raw = [], []
            for ln in (d.log_path.read_text(errors="replace").splitlines() if d.log_path.exists() else []):
                try:
                    lines.append(json.loads(ln))
                except ValueError:              # not the daemon's JSON: a Python warning or a traceback on stderr
                    if ln.strip():
                        raw.append(ln)
            bad = [ln for ln in lines if ln.get("level") in ("error", "critical") or "exception" in ln]
            res["log_errors"] = len(bad) + len(raw)
            res["first_log_errors"] = bad[:5] + raw[:10]
            try:
                res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                               text=True).stdout.strip()
            except OSError:
                res["commit"] = "unknown"
            if args.out is None:
                args.out = str(ROOT / "bench" / "results" / f"fuzz_http_{res['commit'] or 'unknown'}.json")
            print(json.dumps({k: v for k, v in res.items() if k not in ("routes", "first_problems",
                                                                        "first_log_errors")}))
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 1 if res["problems"] or res["log_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
