"""Kernel-level timings of the CUDA backend against the hardware limit and against the previous kernels.

Decode matvec: achieved weight bandwidth of each variant (f32-activation kernel, 8-lanes-per-row int8 kernel,
warp-per-row int8 kernel with 1/2/4 rows per warp) over the measured device copy bandwidth, on the matrix shapes of the
default model and of the synthetic 1.7B llama of bench/gpu_throughput.py. Decode attention: v1 (per-head split-K +
combine) vs v2 (GQA-shared, self-merging) in microseconds and KV bandwidth, v2 with and without the one-wave cap on
its split, and v2 over a sweep of n_split. Prefill attention: FlashAttention-2 (mma.sync) in TFLOP/s (causal flops
2 * 2 * n * (length + n/2) * hd * n_head). Gated DeltaNet prefill (ubatch of 512 tokens): the delta rule's block kernel vs the warp kernel, and the causal conv (``--only-gdn``
runs just this section; ``--only-attn-decode`` the decode attention, with its n_split sweep).
Every time is per launch inside a CUDA graph of 20 launches (median of 20 replays, CUDA events), rotating over enough
weight copies to spill the L2. Usage: python bench/cuda_kernels.py [--out PATH]. Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timeit(cp, fn, reps: int = 20, per_graph: int = 20) -> float:
    """Median seconds of one fn() (launches on the current stream): per_graph calls captured in one CUDA graph, the
    graph replayed reps times between CUDA events (so Python launch cost stays out, as in the decode graph)."""
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        fn()
        st.synchronize()
        st.begin_capture()
        for _ in range(per_graph):
            fn()
        g = st.end_capture()
        g.launch(st)
        st.synchronize()
        ts = []
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(st)
            g.launch(st)
            b.record(st)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3 / per_graph)
    return float(np.median(ts))


def bench_gdn(cp, res: dict, rng) -> None:
    """res["gdn"]: microseconds per launch of strata_gdn_recurrent_ex (block and warp variants) and strata_gdn_conv on
    one ubatch, for the GDN shapes of the synthetic 1.5B hybrid (16 value heads of 128) and others."""
    from strata.backend.cuda import library as K
    lib = K.lib()
    res["gdn"] = []
    print(f"\n{'gdn delta rule':34s} {'block us':>9s} {'auto us':>9s} {'speedup':>8s}  (warp: 4 / 2 / 1 columns)")
    for n, nv, nk, dk, dv in ((512, 16, 16, 128, 128), (512, 32, 16, 128, 128), (512, 16, 16, 64, 64),
                              (512, 8, 4, 256, 256), (128, 16, 16, 128, 128)):
        q = cp.asarray(rng.standard_normal((n, nk, dk)).astype(np.float32))
        q /= cp.linalg.norm(q, axis=-1, keepdims=True)
        k = cp.asarray(rng.standard_normal((n, nk, dk)).astype(np.float32))
        k /= cp.linalg.norm(k, axis=-1, keepdims=True)
        v = cp.asarray(rng.standard_normal((n, nv, dv)).astype(np.float32))
        g = cp.asarray(-rng.uniform(0.01, 0.5, (n, nv)).astype(np.float32))
        beta = cp.asarray(rng.uniform(0.1, 0.9, (n, nv)).astype(np.float32))
        state = cp.zeros((nv, dk, dv), cp.float32)
        out = cp.empty((n, nv, dv), cp.float32)
        p = K.ptr
        us = {}
        for name, var in (("block", 1), ("auto", 0), ("warp", 2), ("warp2", 3), ("warp1", 4)):
            us[name] = 1e6 * timeit(cp, lambda var=var: lib.strata_gdn_recurrent_ex(
                K.stream_ptr(), p(q), p(k), p(v), p(g), p(beta), p(state), p(out), n, nv, nk, dk, dv, 1,
                float(dk ** -0.5), var), per_graph=4)
        res["gdn"].append({"op": "delta_rule", "n": n, "n_v": nv, "n_k": nk, "dk": dk, "dv": dv, "us": us})
        print(f"n{n} v{nv} k{nk} dk{dk} dv{dv}{'':14s} {us['block']:9.1f} {us['auto']:9.1f} "
              f"{us['block'] / us['auto']:7.2f}x  ({us['warp']:.1f} / {us['warp2']:.1f} / {us['warp1']:.1f})",
              flush=True)
    for n, c, kk in ((512, 6144, 4), (512, 12288, 4)):
        x = cp.asarray(rng.standard_normal((n, c + 64)).astype(np.float32))
        w = cp.asarray(rng.standard_normal((c, kk)).astype(np.float32))
        win = cp.zeros((kk - 1, c), cp.float32)
        y = cp.empty((n, c), cp.float32)
        t = 1e6 * timeit(cp, lambda: lib.strata_gdn_conv(K.stream_ptr(), K.ptr(x), c + 64, K.ptr(w), K.ptr(win), K.ptr(y), n,
                                                         c, kk), per_graph=4)
        res["gdn"].append({"op": "conv", "n": n, "channels": c, "kernel": kk, "us": t,
                           "bytes": 4 * n * c * 2})
        print(f"conv n{n} c{c} k{kk}: {t:.1f} us ({4 * n * c * 2 / t / 1e6:.2f} TB/s in + out)", flush=True)


def bench_attn_decode(cp, res, rng, be) -> None:
    """Decode attention: v1 vs v2 at the plan's split (with and without the one-wave cap), and v2 over a sweep of
    n_split (the only thing ATTN_CHUNK / ATTN_BPS / the cap change), per shape and context length."""
    from strata.backend.cuda import library as K
    from strata.backend.cuda import settings as S
    lib, ffi, s = K.lib(), K.ffi(), K.stream_ptr
    splits = (8, 16, 24, 32, 40, 48, 56, 64, 88, 128, 256)
    print(f"\n{'attn decode':28s} {'v1 us':>8s} {'v2 us':>8s} {'v2 KV TB/s':>10s}   v2 without the one-wave cap; "
          f"v2 by n_split {splits}")
    ps = 16
    for H, KV, hd in ((9, 3, 64), (16, 8, 128), (32, 8, 128)):
        for L in (512, 4096, 16384):
            n_pages = L // ps + 1
            nc = max(1, min(8, int(np.ceil(150e6 / (4 * L * KV * hd)))))    # K/V copies rotated past the L2
            kcs = [cp.asarray(rng.standard_normal((n_pages, ps, KV, hd)).astype(np.float16)) for _ in range(nc)]
            vcs = [cp.asarray(rng.standard_normal((n_pages, ps, KV, hd)).astype(np.float16)) for _ in range(nc)]
            ring = iter(range(10 ** 9))

            def kv(kcs=kcs, vcs=vcs, ring=ring, nc=nc):
                i = next(ring) % nc
                return K.ptr(kcs[i]), K.ptr(vcs[i])
            pt = cp.asarray(rng.permutation(n_pages).astype(np.int32))
            q = cp.asarray(rng.standard_normal(H * hd).astype(np.float32))
            out = cp.empty(H * hd, cp.float32)
            ws = cp.empty(H * max(S.MAX_SPLIT, S.GQA_MAX_SPLIT) * (hd + 2), cp.float32)
            ctr = cp.zeros(KV, cp.uint32)
            oq = cp.empty(H * hd * 5 // 4, cp.uint8)
            n1 = S.n_split_for(L)
            resident = S.gqa_resident(hd, H // KV, False)
            n2 = S.n_split_gqa(L, KV, be.n_sm, resident=resident)
            n2_nocap = S.n_split_gqa(L, KV, be.n_sm)
            sc = 1 / np.sqrt(hd)

            def v2(ns):
                return timeit(cp, lambda: lib.strata_attn_decode_gqa(
                    s(), K.ptr(q), *kv(), K.ptr(pt), ffi.NULL, L, K.ptr(ws), ffi.cast("unsigned *", ctr.data.ptr),
                    K.ptr(out), K.ptr(oq), H, KV, hd, ps, ns, sc, ffi.NULL, ffi.NULL))
            t1 = timeit(cp, lambda: lib.strata_attn_decode(s(), K.ptr(q), *kv(), K.ptr(pt), ffi.NULL, L,
                                                           K.ptr(ws), K.ptr(out), H, KV, hd, ps, n1, sc))
            t2 = v2(n2)
            t2n = t2 if n2_nocap == n2 else v2(n2_nocap)
            sweep = {ns: 1e6 * v2(ns) for ns in splits}
            best = min(sweep, key=sweep.get)
            kvb = 2 * L * KV * hd * 2
            res["attn_decode"].append({"H": H, "KV": KV, "hd": hd, "L": L, "v1_us": t1 * 1e6, "v2_us": t2 * 1e6,
                                       "n_split_v2": n2, "resident_blocks_per_sm": resident,
                                       "v2_no_cap_us": t2n * 1e6, "n_split_v2_no_cap": n2_nocap,
                                       "kv_bytes": kvb, "v2_us_by_split": sweep, "best_split": best})
            print(f"H{H} KV{KV} hd{hd} L{L:6d} split{n2:4d}  {t1 * 1e6:8.1f} {t2 * 1e6:8.1f} {kvb / t2 / 1e12:10.2f}   "
                  f"(no cap: split {n2_nocap} {t2n * 1e6:.1f}, {t2n / t2:.2f}x; {resident} blocks/SM)  best "
                  f"{sweep[best]:6.1f} at {best}  (" + " ".join(f"{k}:{v:.1f}" for k, v in sweep.items()) + ")",
                  flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only-gdn", action="store_true", help="time the Gated DeltaNet kernels only")
    ap.add_argument("--only-attn-decode", action="store_true", help="time the decode attention kernels only")
    a = ap.parse_args(argv)
    import cupy as cp
    from bench.common import commit as bench_commit
    from bench.gpu_throughput import copy_bandwidth
    from strata.backend import cuda as C
    from strata.backend.cuda import library as K
    from strata.backend.cuda import settings as S
    from strata.backend.cuda import weights as W
    be = C.CudaBackend()
    lib, ffi, s = K.lib(), K.ffi(), K.stream_ptr
    bw = copy_bandwidth(cp)
    props = cp.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"GPU {gpu}, copy bandwidth {bw / 1e12:.2f} TB/s, {be.n_sm} SMs", flush=True)
    res = {"gpu": gpu, "commit": bench_commit(), "copy_bandwidth_Bps": bw, "matvec": [], "attn_decode": [],
           "attn_prefill": [], "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rng = np.random.default_rng(0)
    if a.only_attn_decode:
        bench_attn_decode(cp, res, rng, be)
        dest = Path(a.out) if a.out else ROOT / "bench" / "results" / f"attn_split_sweep_{gpu.replace(' ', '_')}.json"
        dest.write_text(json.dumps(res, indent=1))
        print("wrote", dest)
        return 0
    bench_gdn(cp, res, rng)
    if a.only_gdn:
        dest = Path(a.out) if a.out else ROOT / "bench" / "results" / f"cuda_kernels_gdn_{gpu.replace(' ', '_')}.json"
        dest.write_text(json.dumps(res, indent=1))
        print("wrote", dest)
        return 0
    # (name, ggml type, n_out, n_in)
    shapes = [("smol qkv Q4_1", 3, 960, 576), ("smol o Q4_1", 3, 576, 576), ("smol gate_up Q4_1", 3, 3072, 576),
              ("smol down Q4_1", 3, 576, 1536), ("smol head Q8_0", 8, 49152, 576),
              ("1.7B qkv Q4_K", 12, 4096, 2048), ("1.7B o Q4_K", 12, 2048, 2048),
              ("1.7B gate_up Q4_K", 12, 16384, 2048), ("1.7B down Q4_K", 12, 2048, 8192),
              ("1.7B head Q4_K", 12, 49152, 2048), ("Q6_K 4096x4096", 14, 4096, 4096),
              ("Q8_0 4096x4096", 8, 4096, 4096), ("Q4_0 4096x4096", 2, 4096, 4096)]
    print(f"{'matvec':22s} {'MB':>7s} " + " ".join(f"{v:>14s}" for v in
                                                    ("f32", "q8 8-lane", "q8w R1", "q8w R2", "q8w R4")))
    for name, t, n_out, n_in in shapes:
        qk, bsz = W.BLOCK[t]
        rb = n_in // qk * bsz
        nbytes = n_out * rb
        copies = max(1, min(20, int(np.ceil(200e6 / nbytes))))   # rotate over > 3x the L2
        ws = []
        for _ in range(copies):
            raw = rng.integers(0, 256, size=(n_out, rb), dtype=np.uint8)
            ws.append(W.upload_raw("w", t, (n_out, n_in), raw))
            # finite scales: overwrite the f16 scale fields with small values
        for w in ws:
            d = w.data.reshape(n_out, n_in // qk, bsz)
            if t in (2, 3, 8):
                d[:, :, 0:2] = cp.asarray(np.full((1, 1), 1e-3, np.float16).view(np.uint8).reshape(1, 1, 2))
            elif t in (12, 13):
                d[:, :, 0:4] = cp.asarray(np.full((1, 1, 2), 1e-3, np.float16).view(np.uint8).reshape(1, 1, 4))
            elif t == 14:
                d[:, :, 208:210] = cp.asarray(np.full((1, 1), 1e-3, np.float16).view(np.uint8).reshape(1, 1, 2))
        x = cp.asarray(rng.standard_normal(n_in).astype(np.float32))
        xq = be.quantize_q8(x[None])
        y = cp.empty(n_out, cp.float32)
        it = iter(range(10 ** 9))

        def pick():
            return ws[next(it) % copies]

        variants = {
            "f32": lambda: lib.strata_matvec(s(), t, K.ptr(pick().data), K.ptr(x), K.ptr(y), n_out, n_in, 1),
            "q8 8-lane": lambda: lib.strata_matvec_q8(s(), t, K.ptr(pick().data), K.ptr(xq), K.ptr(y), n_out, n_in),
        }
        for r in (1, 2, 4):
            variants[f"q8w R{r}"] = (lambda r=r: lib.strata_matvec_q8w(s(), t, K.ptr(pick().data), K.ptr(xq), K.ptr(y),
                                                                       n_out, n_in, r))
        if "gate_up" in name:   # SwiGLU fused into the matvec vs the decode plan's matvec + strata_swiglu_gu
            F = n_out // 2
            act, aq = cp.empty(F, cp.float32), cp.empty(F + F // 4, cp.uint8)

            def unfused():
                lib.strata_matvec_q8w(s(), t, K.ptr(pick().data), K.ptr(xq), K.ptr(y), n_out, n_in,
                                      S.rows_per_warp(n_out))
                lib.strata_swiglu_gu(s(), K.ptr(y), 1, F, K.ptr(act), ffi.NULL, K.ptr(aq))
            variants["mv+swiglu"] = unfused
            for rp in (1, 2, 4):
                def fused(rp=rp):
                    w = pick().data
                    lib.strata_matvec_q8w_glu(s(), t, K.ptr(w), ffi.cast("void *", w.data.ptr + F * rb), K.ptr(xq),
                                              K.ptr(act), K.ptr(aq), F, n_in, rp)
                variants[f"glu RP{rp}"] = fused
        row = {"name": name, "type": t, "n_out": n_out, "n_in": n_in, "bytes": nbytes, "us": {}, "bw_fraction": {}}
        for k, fn in variants.items():
            dt = timeit(cp, fn)
            row["us"][k] = dt * 1e6
            row["bw_fraction"][k] = nbytes / dt / bw
        res["matvec"].append(row)
        print(f"{name:22s} {nbytes / 1e6:7.2f} " + " ".join(
            f"{row['us'][k]:6.1f}us {100 * row['bw_fraction'][k]:4.0f}%" for k in variants)
              + ("  (" + ", ".join(variants) + ")" if len(variants) > 5 else ""), flush=True)
        ws = None   # the copies go before the next shape's

    bench_attn_decode(cp, res, rng, be)

    # prefill attention (n = 512 queries after `length` cached positions)
    ps = 16
    print(f"\n{'attn prefill':30s} {'v2 ms':>8s} {'v2 TFLOP/s':>10s}")
    for H, KV, hd in ((9, 3, 64), (16, 8, 128)):
        for length in (0, 3584, 15872):
            n = 512
            L = length + n
            n_pages = L // ps + 1
            kc = cp.asarray(rng.standard_normal((n_pages, ps, KV, hd)).astype(np.float16))
            vc = cp.asarray(rng.standard_normal((n_pages, ps, KV, hd)).astype(np.float16))
            pt = cp.asarray(np.arange(n_pages, dtype=np.int32))
            q = cp.asarray(rng.standard_normal((n, H, hd)).astype(np.float32))
            out = cp.empty((n, H, hd), cp.float32)
            sc = 1 / np.sqrt(hd)
            s2 = S.fa2_splits(n, H, L, be.n_sm)
            ws2 = cp.empty(s2 * H * n * (hd + 2), cp.float32)
            t2 = timeit(cp, lambda: lib.strata_fa2_prefill(s(), K.ptr(q), H * hd, K.ptr(kc), K.ptr(vc), K.ptr(pt),
                                                           K.ptr(out), ffi.NULL, K.ptr(ws2), n, H, KV, hd, ps, length,
                                                           s2, sc, ffi.NULL, ffi.NULL), per_graph=4)
            flops = 4.0 * n * (length + n / 2) * hd * H
            res["attn_prefill"].append({"H": H, "KV": KV, "hd": hd, "n": n, "length": length,
                                        "v2_ms": t2 * 1e3, "v2_tflops": flops / t2 / 1e12, "n_split_v2": s2})
            print(f"H{H} KV{KV} hd{hd} n{n} len{length:6d} split{s2:3d} {t2 * 1e3:8.3f} "
                  f"{flops / t2 / 1e12:10.1f}", flush=True)
    dest = Path(a.out) if a.out else ROOT / "bench" / "results" / f"cuda_kernels_{gpu.replace(' ', '_')}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=1))
    print("wrote", dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
