"""Parking and session files: park / restore milliseconds and GB/s of a conversation next to the machine's raw copy
bandwidth (memcpy of the same number of bytes on the CPU; pinned host<->device on a GPU), and save / restore of a
session file next to raw file write (with fsync) and read bandwidth, all measured in the same run; and the time a
restored conversation takes to start its answer against re-reading its prompt.

Usage: python bench/park_session.py [--model default] [--synthetic-hybrid small] [--tokens 2048,8192]
       [--device cpu] [--out bench/results/park_session_<device>.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _best(fn, reps: int = 3) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def copy_bandwidth(nbytes: int, device: str) -> float:
    """Bytes/s of one copy of nbytes: memcpy on the CPU; host -> device + device -> host (pinned) on a GPU."""
    if device == "cpu":
        a = np.ones(nbytes // 8, np.float64)
        b = np.empty_like(a)
        return a.nbytes / _best(lambda: np.copyto(b, a))
    import cupy as cp
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(mem, np.uint8, nbytes)
    dev = cp.empty(nbytes, cp.uint8)

    def roundtrip():
        dev.set(host)
        dev.get(out=host)
        cp.cuda.Device().synchronize()
    return 2 * nbytes / _best(roundtrip)


def file_bandwidth(nbytes: int, d: Path) -> tuple[float, float]:
    """(write with fsync, read) bytes/s of a file of nbytes in directory d."""
    data = os.urandom(min(nbytes, 1 << 26)) * max(1, nbytes // (1 << 26))
    p = d / "raw.bin"

    def w():
        with open(p, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def r():
        with open(p, "rb") as f:
            f.read()
    tw = _best(w)
    tr = _best(r)
    return len(data) / tw, len(data) / tr


def bench_model(path, n_tokens: int, device: str, tmp: Path) -> dict:
    from strata.engine import Engine, GenerationRequest
    e = Engine(path, n_ctx=n_tokens + 64, ubatch=512, device=device, slot_save_path=tmp, conversation_cache_mib=8192)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(0, e.n_vocab, n_tokens)]
    cut = [(n_tokens - 32, "turn")]

    def read_all():
        e.clear_checkpoints()
        e.state_reset()
        f = list(e.generate(GenerationRequest(prompt_tokens=ids, cut_points=cut, max_tokens=1, cache_prompt=False)))[-1]
        return f.timings["prompt_ms"] / 1000.0
    t_read = min(read_all() for _ in range(2))
    list(e.generate(GenerationRequest(prompt_tokens=ids, cut_points=cut, max_tokens=1)))
    conv_bytes = 0
    park_s, restore_s = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        conv = e.store.capture(e.seq)
        park_s.append(time.perf_counter() - t0)
        conv_bytes = conv.nbytes()
        t0 = time.perf_counter()
        e.store.restore(e.seq, conv)
        for st in e.stages:
            st.backend.drain()
        restore_s.append(time.perf_counter() - t0)
    save_s, load_s = [], []
    for _ in range(3):
        r = e.slot_save(0, filename="bench.bin")
        save_s.append(r["timings"]["save_ms"] / 1000.0)
        r = e.slot_restore(0, filename="bench.bin")
        load_s.append(r["timings"]["restore_ms"] / 1000.0)
    file_bytes = os.path.getsize(tmp / "bench.bin")
    # time to the first token of a turn that continues the restored conversation vs reading it from 0
    more = [int(t) for t in rng.integers(0, e.n_vocab, 16)]

    def first_token_after_restore():
        e.slot_restore(0, filename="bench.bin")
        f = list(e.generate(GenerationRequest(prompt_tokens=ids + more, max_tokens=1)))[-1]
        return f.timings["prompt_ms"] / 1000.0
    ttft = min(first_token_after_restore() for _ in range(2))
    cbw = copy_bandwidth(conv_bytes, device)
    fw, fr = file_bandwidth(file_bytes, tmp)
    park, rest = min(park_s), min(restore_s)
    out = {"tokens": n_tokens, "conversation_bytes": conv_bytes, "file_bytes": file_bytes,
           "park_ms": park * 1e3, "restore_ms": rest * 1e3, "park_GBps": conv_bytes / park / 1e9,
           "restore_GBps": conv_bytes / rest / 1e9, "copy_GBps": cbw / 1e9,
           "park_vs_copy": conv_bytes / park / cbw, "restore_vs_copy": conv_bytes / rest / cbw,
           "save_ms": min(save_s) * 1e3, "load_ms": min(load_s) * 1e3,
           "save_GBps": file_bytes / min(save_s) / 1e9, "load_GBps": file_bytes / min(load_s) / 1e9,
           "file_write_fsync_GBps": fw / 1e9, "file_read_GBps": fr / 1e9,
           "save_vs_file": file_bytes / min(save_s) / fw, "load_vs_file": file_bytes / min(load_s) / fr,
           "reread_ms": t_read * 1e3, "restored_turn_prompt_ms": ttft * 1e3, "restored_vs_reread": ttft / t_read}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--synthetic-hybrid", default="small", help="a synthetic qwen35 of this preset size ('' = none)")
    ap.add_argument("--hybrid-1_5b", action="store_true",
                    help="instead: the ~1.5B qwen35 hybrid that bench/gpu_throughput.py writes (Q8_0, random)")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from strata.gguf import synth
    tmp = Path(tempfile.mkdtemp())
    models = list(args.model or ["default"])
    if args.hybrid_1_5b:
        from bench.gpu_hybrid_model import make_synthetic_hybrid
        from strata.gguf.default_model import default_model_path
        models.append(make_synthetic_hybrid(tmp / "hybrid_1_5b.gguf", default_model_path()))
    elif args.synthetic_hybrid:
        models.append(str(synth.write_synthetic(tmp / "hybrid.gguf", synth.preset("qwen35", args.synthetic_hybrid))))
    res = {"device": args.device, "rows": []}
    for m in models:
        for n in (int(x) for x in args.tokens.split(",")):
            d = tmp / f"s{n}"
            d.mkdir(exist_ok=True)
            r = dict(bench_model(m, n, args.device, d), model=Path(m).name if m != "default" else "default")
            res["rows"].append(r)
            print(f"{r['model'][:28]:28s} {n:6d} tok  conv {r['conversation_bytes'] / 1e6:8.1f} MB  "
                  f"park {r['park_ms']:7.1f} ms ({r['park_vs_copy']:.2f} of copy)  restore {r['restore_ms']:7.1f} ms "
                  f"({r['restore_vs_copy']:.2f})  save {r['save_ms']:7.1f} ms ({r['save_vs_file']:.2f} of file)  "
                  f"load {r['load_ms']:7.1f} ms ({r['load_vs_file']:.2f})  restored turn {r['restored_turn_prompt_ms']:.1f}"
                  f" ms vs re-read {r['reread_ms']:.1f} ms ({r['restored_vs_reread']:.3f})", flush=True)
    out = Path(args.out or ROOT / "bench" / "results" / f"park_session_{args.device.replace(':', '')}.json")
    out.write_text(json.dumps(res, indent=2))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
