#!/usr/bin/env python3
"""The hand-off between two stages on two GPUs against the hardware: the latency of a peer-to-peer copy of one
token's hidden state (and of a ubatch's), measured in this run, beside the per-token cost the layer split adds to
decode (from an engine_ab run of one GPU against two: 1/tok_s(two) - 1/tok_s(one)).

The copy: cudaMemcpyPeer of n bytes from cuda:SRC to cuda:DST, then a synchronize of DST, the median of --reps;
the same with a synchronize alone is printed as the floor. With one GPU, SRC = DST = 0 (a device-to-device copy).

Usage: python bench/p2p_copy.py [--bytes 2304,8192,1179648] [--engine-ab FILE] [--out bench/results/p2p_copy.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _median_us(fn, reps: int) -> float:
    for _ in range(20):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="2304,8192,1179648",
                    help="sizes: SmolLM2's hidden state of one token (576 f32), a 2048-wide one, a 512-token ubatch")
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--engine-ab", default=None, help="an engine_ab.py JSON with a one-GPU arm first, two GPUs second")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "p2p_copy.json"))
    args = ap.parse_args(argv)
    import cupy as cp
    rt = cp.cuda.runtime
    n_dev = rt.getDeviceCount()
    src, dst = (0, 1) if n_dev >= 2 else (0, 0)
    peer = bool(rt.deviceCanAccessPeer(dst, src)) if src != dst else True
    if src != dst and peer:
        with cp.cuda.Device(dst):
            try:
                rt.deviceEnablePeerAccess(src)
            except rt.CUDARuntimeError:              # already enabled in this process
                pass
    res = {"devices": n_dev, "src": src, "dst": dst, "peer_access": peer,
           "gpu": rt.getDeviceProperties(0)["name"].decode(), "copy_us": {}, "sync_us": None}
    dev = cp.cuda.Device(dst)
    res["sync_us"] = _median_us(dev.synchronize, args.reps)
    for n in (int(x) for x in args.bytes.split(",")):
        with cp.cuda.Device(src):
            a = cp.zeros(n, cp.uint8)
        with cp.cuda.Device(dst):
            b = cp.empty(n, cp.uint8)

        def copy():
            rt.memcpyPeer(b.data.ptr, dst, a.data.ptr, src, n)
            dev.synchronize()
        res["copy_us"][str(n)] = _median_us(copy, args.reps)
        print(f"cuda:{src} -> cuda:{dst} {n:>9} B: {res['copy_us'][str(n)]:8.1f} us "
              f"(a synchronize alone {res['sync_us']:.1f} us)", flush=True)
    if args.engine_ab:
        ab = json.loads(Path(args.engine_ab).read_text())
        one, two = (a["name"] for a in ab["arms"][:2])
        med = ab["median"]
        res["handoff_us_per_token"] = {}
        for depth, tps_one in med[one]["decode"].items():
            extra = (1.0 / med[two]["decode"][depth] - 1.0 / tps_one) * 1e6
            res["handoff_us_per_token"][depth] = extra
            ratio = extra / res["copy_us"][min(res["copy_us"], key=int)]
            print(f"decode at depth {depth}: two GPUs add {extra:.1f} us a token, {ratio:.2f}x the copy of one "
                  f"token's hidden state", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
