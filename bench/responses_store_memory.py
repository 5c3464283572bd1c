"""Memory a /v1/responses chain holds in the response store: a 200-turn previous_response_id chain (every response
kept) driven through the route's parse and answer code with a fixed answer in place of the engine, in a fresh
process per case; the process's RSS growth beside the bytes the store reports (what its --responses-store-mib budget
counts), for this tree's store and for the reference store of another commit (default main) in the same run.

Cases: `chat` (each turn a 200-character question, a 200-character answer) and `long_first` (a first input of 2,000
empty messages, then one-line turns: the shape that made each kept response repeat the conversation's list).

Usage: python bench/responses_store_memory.py [--turns 200] [--ref main] [--out
bench/results/responses_store_memory_<commit>.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import commit as bench_commit, rss  # noqa: E402


def load(ref: str | None):
    """strata.serve.responses_api of this tree, or the file as it is at commit `ref`."""
    if ref is None:
        from strata.serve import responses_api
        return responses_api
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:strata/serve/responses_api.py"],
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "responses_api_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("responses_api_ref", path)
    mod = sys.modules["responses_api_ref"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def one(case: str, turns: int, ref: str | None) -> dict:
    """Run one case in this process; returns its numbers."""
    import gc
    ra = load(ref)
    answer = "a" * 200 if case == "chat" else "ok"
    final = SimpleNamespace(finish_reason="stop", usage={"prompt_tokens": 1, "completion_tokens": 1,
                                                         "total_tokens": 2}, timings={}, strata={})
    ab = SimpleNamespace(final=final, blocks=[], reasoning_tokens=0, text=lambda: answer)
    store = ra.ResponseStore(1 << 30, budget=1 << 40)
    gc.collect()
    before = rss()
    first = [{"role": "user", "content": ""} for _ in range(2000)] if case == "long_first" else "q" * 200
    rid = None
    for i in range(turns):
        body = {"input": first if i == 0 else (f"{i:03d}" + "q" * 197 if case == "chat" else f"{i}")}
        if rid is not None:
            body["previous_response_id"] = rid
        rid = ra._Response(ra.parse(body, store), SimpleNamespace(model_name="m"), ab, store).done()["id"]
    gc.collect()
    grown = rss() - before
    return {"case": case, "store": ref or "this tree", "turns": turns, "entries": len(store),
            "rss_growth_bytes": grown, "reported_bytes": store.nbytes,
            "rss_over_reported": round(grown / max(store.nbytes, 1), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--ref", default="main", help="the commit whose store is the reference")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=2, metavar=("CASE", "STORE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.turns, None if a.one[1] == "-" else a.one[1])))
        return
    rows = []
    for case in ("chat", "long_first"):
        for store in (a.ref, "-"):
            out = subprocess.run([sys.executable, __file__, "--turns", str(a.turns), "--one", case, store],
                                 capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out))
            r = rows[-1]
            print(f"{case:10s} {r['store']:10s} entries {r['entries']:4d}  RSS +{r['rss_growth_bytes'] / 1e6:7.2f} MB"
                  f"  reported {r['reported_bytes'] / 1e6:7.2f} MB  RSS/reported {r['rss_over_reported']}")
        ref_r, new_r = rows[-2], rows[-1]
        ratio = new_r["rss_growth_bytes"] / max(ref_r["rss_growth_bytes"], 1)
        print(f"{case:10s} RSS this tree / reference: {ratio:.3f}")
    commit = bench_commit()
    dest = Path(a.out) if a.out else ROOT / "bench" / "results" / f"responses_store_memory_{commit}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"commit": commit, "reference": a.ref, "turns": a.turns, "rows": rows}, indent=1) + "\n")
    print("wrote", dest)


if __name__ == "__main__":
    main()
