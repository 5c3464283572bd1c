"""Attention over the paged KV cache as backend ops: the K/V write then split-K decode attention (one query) or
FlashAttention-2 / materialized-score prefill attention (many), for the model's generic forward on a CudaPagePool."""
from __future__ import annotations

from strata.backend.cuda.library import check, ffi, lib, ptr, stream_ptr
from strata.backend.cuda.settings import (ATTN, ATTN_HEAD_DIMS, AUTO_V2_FROM, FLASH_HEAD_DIMS, MAX_SPLIT, fa2_splits,
                                          gqa_resident, n_split_for, n_split_gqa)


def paged_attention(be, q, k, v, kc, vc, pt, length: int, ps: int, scale: float, ks=None, vs=None):
    """Write k/v f32 (n, n_kv, hd) at positions [length, length + n) of the pages kc/vc (n_pages, ps, n_kv, hd)
    through page table pt (device int32), then attend: split-K decode kernel for n == 1, prefill_attention above.
    The pages are f16, or q8_0 when the scale arrays ks/vs (n_pages, ps, n_kv, hd / 32) f16 are given.
    q f32 (n, n_head, hd) -> f32 (n, n_head, hd)."""
    cp = be.cp
    n, n_head, hd = q.shape
    n_kv = k.shape[1]
    s = stream_ptr()
    q8 = ks is not None
    if q8 and n_head // n_kv > 8:     # before anything is written: the q8_0 decode kernel takes groups of <= 8
        raise ValueError(f"--kv q8_0 needs at most 8 query heads per KV head (this model: {n_head // n_kv})")
    if q8:
        check(lib().strata_kv_write_q8(s, ptr(k), n_kv * hd, ptr(v), n_kv * hd, ptr(kc), ptr(vc), ptr(ks), ptr(vs),
                                       ptr(pt), ffi().NULL, int(length), n, n_kv, hd, ps), "strata_kv_write_q8")
    else:
        check(lib().strata_kv_write(s, ptr(k), ptr(v), ptr(kc), ptr(vc), ptr(pt), ffi().NULL, int(length), n, n_kv, hd,
                                    ps), "strata_kv_write")
    total = length + n
    v2_ok = hd in ATTN_HEAD_DIMS and n_head // n_kv <= 8
    use_v2 = q8 or ATTN == "v2" or (ATTN == "auto" and total >= AUTO_V2_FROM)
    if n == 1 and use_v2 and v2_ok:
        n_split = n_split_gqa(total, n_kv, be.n_sm, resident=gqa_resident(hd, n_head // n_kv, q8))
        need = n_head * n_split * (hd + 2)
        if be._partial is None or be._partial.size < need:
            be._partial = cp.empty(max(need, n_head * MAX_SPLIT * (hd + 2)), cp.float32)
        if be._counters is None or be._counters.size < n_kv:
            be._counters = cp.zeros(max(64, n_kv), cp.uint32)
        out = cp.empty((1, n_head, hd), cp.float32)
        check(lib().strata_attn_decode_gqa(s, ptr(q), ptr(kc), ptr(vc), ptr(pt), ffi().NULL, total, ptr(be._partial),
                                           ffi().cast("unsigned *", be._counters.data.ptr), ptr(out), ffi().NULL,
                                           n_head, n_kv, hd, ps, n_split, float(scale), ptr(ks), ptr(vs)),
              "strata_attn_decode_gqa")
        return out
    if n == 1:
        n_split = n_split_for(total)
        need = n_head * n_split * (hd + 2)
        if be._partial is None or be._partial.size < need:
            be._partial = cp.empty(max(need, n_head * MAX_SPLIT * (hd + 2)), cp.float32)
        out = cp.empty((1, n_head, hd), cp.float32)
        check(lib().strata_attn_decode(s, ptr(q), ptr(kc), ptr(vc), ptr(pt), ffi().NULL, total, ptr(be._partial),
                                       ptr(out), n_head, n_kv, hd, ps, n_split, float(scale)), "strata_attn_decode")
        return out
    return prefill_attention(be, q, kc, vc, pt, length, n_kv, ps, scale, ks, vs)


def prefill_attention(be, q, kc, vc, pt, length: int, n_kv: int, ps: int, scale: float, ks=None, vs=None):
    """Causal GQA attention of n new queries (positions length..length+n-1) over the paged f16 cache
    (their K/V already written); q f32 (n, n_head, hd) contiguous -> f32 (n, n_head, hd).

    head_dim 64 / 128: strata_fa2_prefill (FlashAttention-2 on mma.sync), the key range split so that two waves of
    blocks run, the splits merged by a combine kernel. Otherwise: K/V gathered to f32,
    S = Q K^T per KV head (cuBLAS batched, f32), masked softmax (strata_causal_softmax), O = P V, queries in
    chunks so S (n_head * chunk * (length + n) * 4 bytes) stays under 1 GiB.
    """
    cp = be.cp
    n, n_head, hd = q.shape
    g = n_head // n_kv
    total = length + n
    s = stream_ptr()
    q8 = ks is not None
    if hd in FLASH_HEAD_DIMS:
        out = cp.empty((n, n_head, hd), cp.float32)
        n_split = fa2_splits(n, n_head, total, be.n_sm)
        ws = cp.empty(n_split * n_head * n * (hd + 2), cp.float32) if n_split > 1 else None
        check(lib().strata_fa2_prefill(s, ptr(q), n_head * hd, ptr(kc), ptr(vc), ptr(pt), ptr(out), ffi().NULL,
                                       ptr(ws), n, n_head, n_kv, hd, ps, int(length), n_split, float(scale), ptr(ks),
              ptr(vs)), "strata_fa2_prefill")
        return out
    kf = cp.empty((n_kv, total, hd), cp.float32)
    vf = cp.empty((n_kv, total, hd), cp.float32)
    if q8:
        check(lib().strata_kv_gather_q8(s, ptr(kc), ptr(vc), ptr(ks), ptr(vs), ptr(pt), ptr(kf), ptr(vf), total, n_kv,
                                        hd, ps), "strata_kv_gather_q8")
    else:
        check(lib().strata_kv_gather(s, ptr(kc), ptr(vc), ptr(pt), ptr(kf), ptr(vf), total, n_kv, hd, ps),
              "strata_kv_gather")
    out = cp.empty((n, n_head, hd), cp.float32)
    chunk = max(1, min(n, (1 << 30) // max(1, n_head * total * 4)))
    for i0 in range(0, n, chunk):
        i1 = min(n, i0 + chunk)
        c, lk = i1 - i0, length + i1
        qh = cp.ascontiguousarray(q[i0:i1].transpose(1, 0, 2)).reshape(n_kv, g * c, hd)   # row = gi * c + i
        S = cp.ascontiguousarray(cp.matmul(qh, kf[:, :lk].transpose(0, 2, 1)))          # (n_kv, g*c, lk)
        check(lib().strata_causal_softmax(s, ptr(S), n_kv * g * c, c, lk, length + i0, float(scale)),
              "strata_causal_softmax")
        O = cp.matmul(S, vf[:, :lk])                                                      # (n_kv, g*c, hd)
        out[i0:i1] = O.reshape(n_head, c, hd).transpose(1, 0, 2)
    return out
