"""Large fuzz run of the stage-link decoder (link/, protocol 5): the fuzz of tests/test_link_codec.py (random bytes,
mutated and truncated golden frames, mutated payloads and header fields behind correct checksums, concatenated frames
read through recv_frame in small pieces, BatchForward / BatchResult / BatchRows / SeqResult payloads built field by
field and mutated) and of tests/test_link_secure.py (streams of sealed frames, mac and aead, mutated and cut: a frame read must
be the one sealed there) for N cases. Every input must decode to a message that encodes back to the same bytes, or be
refused with a one-line LinkError; anything else is counted as a crash.

Usage: python tools/fuzz_link.py [--cases 100000] [--out bench/results/fuzz_link.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the share of the cases each kind gets (the same kinds as the CI fuzz)
SHARES = {"batch_payload": 0.1, "random_bytes": 0.1, "golden_mutated": 0.2, "payload_mutated": 0.2,
          "random_payload": 0.1, "header_fields": 0.1, "stream": 0.1, "sealed_mac": 0.05, "sealed_aead": 0.05}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz_link.json"),
                    help="where to write the JSON summary ('' for nowhere)")
    args = ap.parse_args(argv)
    from hypothesis import HealthCheck, given, settings

    from tests.test_link_codec import fuzz_strategies
    from tests.test_link_secure import sealed_fuzz_strategies

    strategies = {**fuzz_strategies(), **sealed_fuzz_strategies()}
    res: dict = {"cases": 0, "crashes": 0, "kinds": {}, "first_crashes": []}
    t_all = time.time()
    for kind, share in SHARES.items():
        strategy, check = strategies[kind]
        k = {"cases": 0, "accepted": 0, "refused": 0, "crashes": 0, "slowest_ms": 0.0}
        res["kinds"][kind] = k

        @settings(max_examples=max(1, round(args.cases * share)), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def run(case):
            t0 = time.perf_counter()
            k["cases"] += 1
            try:
                k[check(case)] += 1
            except Exception as e:      # a crash: counted, the run goes on
                k["crashes"] += 1
                if len(res["first_crashes"]) < 5:
                    res["first_crashes"].append({"kind": kind, "case": repr(case)[:400],
                                                 "error": "".join(traceback.format_exception_only(e)).strip()})
            k["slowest_ms"] = max(k["slowest_ms"], round((time.perf_counter() - t0) * 1000, 3))

        t0 = time.time()
        run()
        k["seconds"] = round(time.time() - t0, 1)
        res["cases"] += k["cases"]
        res["crashes"] += k["crashes"]
        print(f"{kind}: {k['cases']} cases, {k['accepted']} accepted, {k['refused']} refused, "
              f"{k['crashes']} crashes, slowest {k['slowest_ms']} ms, {k['seconds']} s", flush=True)
    res["seconds"] = round(time.time() - t_all, 1)
    print(f"cases run: {res['cases']}  crashes: {res['crashes']}  ({res['seconds']} s)")
    for c in res["first_crashes"]:
        print("crash:", c["kind"], c["error"], c["case"])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 1 if res["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
