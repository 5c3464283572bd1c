"""Large fuzz runs of the two readers of state bytes: the state-part reader (strata/memory/codec.py through
Memory.read: mutated and truncated copies of a real part of a synthetic hybrid stage with KV pages, running state
and the drafter's K/V, and random bytes) and the session-file reader (strata/cache/session.py: mutated and truncated
copies of a real two-stage session file with checkpoints). Every input must read back as the original or be refused
with a one-line FormatError / PartMismatch / SessionError; anything else fails the run.

Usage: python tools/fuzz_parts.py [--examples 100000] [--out bench/results/fuzz_parts.json]
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=100_000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz_parts.json"))
    args = ap.parse_args(argv)
    from hypothesis import HealthCheck, given, settings, strategies as hs

    from strata.gguf import synth
    from strata.memory import Carve, FormatError, PartMismatch
    from strata.models.registry import load_model
    from tests.mutation import mutate

    tmp = Path(tempfile.mkdtemp())
    m = load_model(synth.write_synthetic(tmp / "q.gguf", synth.preset("qwen35", "tiny", seed=5, n_mtp=1)))
    first = m.new_memory(64, Carve(0, 1), page_size=8)
    mem = m.new_memory(64, Carve(1, m.n_blocks), page_size=8)
    st = mem.seq(mem.new_seq())
    toks = np.arange(1, 21, dtype=np.int32)
    m.forward_carve(toks, st, 1, m.n_blocks, x_in=m.forward_carve(toks, first.seq(first.new_seq()), 0, 1))
    st.draft.reserve(5)
    st.draft.commit(5)
    buf = io.BytesIO()
    mem.write(st.capture(), buf)
    data = buf.getvalue()
    h = st.hashes()
    counts = {"examples": 0, "refused": 0, "accepted": 0}
    kinds: dict[str, int] = {}

    def check(blob: bytes) -> None:
        counts["examples"] += 1
        try:
            part = mem.read(io.BytesIO(blob))
        except (FormatError, PartMismatch) as e:
            msg = str(e)
            if "\n" in msg:
                raise AssertionError(f"multi-line error: {msg!r}")
            counts["refused"] += 1
            key = type(e).__name__ + ": " + msg.split(":")[0][:60]
            kinds[key] = kinds.get(key, 0) + 1
            return
        fresh = mem.seq(mem.new_seq())
        fresh.restore(part)
        if fresh.hashes() != h:
            raise AssertionError("an accepted part restored to a different state")
        fresh.release()
        counts["accepted"] += 1

    mutation = hs.tuples(hs.lists(hs.tuples(hs.integers(0, 10 ** 7), hs.integers(0, 255)), min_size=0, max_size=6),
                         hs.one_of(hs.none(), hs.integers(0, 10 ** 7)))

    @settings(max_examples=args.examples * 9 // 10, deadline=None, derandomize=False, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutation)
    def mutated(mut):
        check(mutate(data, *mut))

    @settings(max_examples=args.examples // 10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(hs.binary(max_size=4096))
    def random_bytes(blob):
        check(blob)

    t0 = time.time()
    mutated()
    random_bytes()
    res = {"parts": dict(counts, seconds=round(time.time() - t0, 1), part_bytes=len(data),
                         refusals=dict(sorted(kinds.items(), key=lambda kv: -kv[1])))}
    print(json.dumps(res, indent=2), flush=True)

    # ---- session files: a two-stage conversation with its checkpoints
    from strata.cache import session
    from strata.engine import Engine, GenerationRequest
    e = Engine(tmp / "q.gguf", n_ctx=256, ubatch=32, layer_split="2", slot_save_path=tmp, conversation_cache_mib=0)
    r = e.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}])
    list(e.generate(GenerationRequest(prompt_tokens=r.tokens, cut_points=r.cut_points, max_tokens=4)))
    e.slot_save(0, filename="f.bin")
    sdata = (tmp / "f.bin").read_bytes()
    fp = e.file.fingerprint()
    sc = {"examples": 0, "refused": 0, "accepted": 0}
    skinds: dict[str, int] = {}

    def scheck(blob: bytes) -> None:
        sc["examples"] += 1
        try:
            conv = session.read(io.BytesIO(blob), fp, e.stages, e.n_ctx)
        except (session.SessionError, FormatError, PartMismatch) as err:
            msg = str(err)
            if "\n" in msg:
                raise AssertionError(f"multi-line error: {msg!r}")
            sc["refused"] += 1
            key = msg.split(":")[0][:60]
            skinds[key] = skinds.get(key, 0) + 1
            return
        if conv.pos != e.seq.pos:
            raise AssertionError("an accepted session file read back with another length")
        sc["accepted"] += 1

    @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(mutation)
    def session_mutated(mut):
        scheck(mutate(sdata, *mut))

    t0 = time.time()
    session_mutated()
    res["sessions"] = dict(sc, seconds=round(time.time() - t0, 1), file_bytes=len(sdata),
                           refusals=dict(sorted(skinds.items(), key=lambda kv: -kv[1])))
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
