"""Paged KV cache: page tables across page boundaries, truncate/trim/release, exhaustion, and paged attention
against a dense numpy reference (causal GQA softmax written out here)."""
from __future__ import annotations

import numpy as np
import pytest

from strata.backend import cpu as cpu_backend
from strata.backend.cpu import CPUBackend
from strata.memory.kv import KVCacheFull, PagedKV, PagePool

NKV, HD = 2, 8


def make_pool(n_pages=8, page_size=4, layers=(0, 1)):
    return CPUBackend().new_page_pool(list(layers), n_pages, NKV, HD, page_size=page_size)


def test_page_size_must_be_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        PagePool([0], 4, 6, NKV, HD, [], [])


def test_page_table_grows_across_page_boundaries():
    pool = make_pool()
    kv = PagedKV(pool)
    expected_pages = []
    for n in [1, 2, 1, 5, 3, 4]:
        kv.reserve(n)
        kv.commit(n)
        expected_pages = -(-kv.length // 4)
        assert len(kv.pages) == expected_pages
        assert kv.capacity >= kv.length
    assert kv.length == 16 and kv.pages == [0, 1, 2, 3] and kv.contiguous
    assert pool.n_free == 4


def test_write_read_round_trip_contiguous_and_interleaved():
    rng = np.random.default_rng(1)
    pool = make_pool(n_pages=16)
    a, b = PagedKV(pool), PagedKV(pool)
    data = {}
    for kv in (a, b):
        data[id(kv)] = ([], [])
    # interleave two sequences so each one's pages are not one run
    for step, n in enumerate([3, 6, 1, 7, 4]):
        for kv in (a, b):
            k = rng.standard_normal((n, NKV, HD)).astype(np.float32)
            v = rng.standard_normal((n, NKV, HD)).astype(np.float32)
            kv.reserve(n)
            pool.write(pool.slot(1), kv.pages, kv.length, k, v)
            kv.commit(n)
            data[id(kv)][0].append(k)
            data[id(kv)][1].append(v)
    assert not a.contiguous and not b.contiguous
    for kv in (a, b):
        K, V = kv.read(pool.slot(1))
        np.testing.assert_array_equal(K, np.concatenate(data[id(kv)][0]).transpose(1, 0, 2))
        np.testing.assert_array_equal(V, np.concatenate(data[id(kv)][1]).transpose(1, 0, 2))
        # a prefix read
        K5, _ = kv.read(pool.slot(1), 5)
        np.testing.assert_array_equal(K5, K[:, :5])


def test_truncate_keeps_pages_trim_and_release_return_them():
    pool = make_pool()
    kv = PagedKV(pool)
    kv.reserve(13)
    kv.commit(13)
    assert len(kv.pages) == 4
    kv.truncate(5)
    assert kv.length == 5 and len(kv.pages) == 4
    with pytest.raises(ValueError):
        kv.truncate(6)
    kv.trim()
    assert len(kv.pages) == 2 and pool.n_free == 6
    kv.release()
    assert kv.pages == [] and kv.length == 0 and pool.n_free == 8


def test_pool_exhaustion_is_a_clear_error_and_takes_nothing():
    pool = make_pool(n_pages=3)
    kv = PagedKV(pool)
    kv.reserve(8)
    kv.commit(8)
    with pytest.raises(KVCacheFull, match=r"KV cache full: need 2 more pages of 4 tokens, 1 of 3 free"):
        kv.reserve(8)
    assert len(kv.pages) == 2 and pool.n_free == 1


def reference_attention(q, K, V, start, scale):
    """Dense causal GQA: q (n, H, d) at positions start.., K/V (L, Hkv, d) for all positions."""
    n, H, d = q.shape
    g = H // K.shape[1]
    out = np.zeros((n, H, V.shape[2]), dtype=np.float64)
    for i in range(n):
        for h in range(H):
            kk = K[:start + i + 1, h // g].astype(np.float64)
            s = kk @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = p @ V[:start + i + 1, h // g]
    return out


# one query chunk / many small chunks; decode through BLAS / through einsum
@pytest.mark.parametrize("score_bytes,decode_blas_keys", [(1 << 25, 4096), (512, 4096), (1 << 25, 0)])
def test_paged_attention_matches_dense_reference(monkeypatch, score_bytes, decode_blas_keys):
    monkeypatch.setattr(cpu_backend, "ATTN_SCORE_BYTES", score_bytes)
    monkeypatch.setattr(cpu_backend, "DECODE_BLAS_MAX_KEYS", decode_blas_keys)
    rng = np.random.default_rng(2)
    be = CPUBackend()
    H = 6
    pool = be.new_page_pool([0], 32, NKV, HD, page_size=4)
    other = PagedKV(pool)
    kv = PagedKV(pool)
    allK, allV = [], []
    for n in [5, 1, 9, 1, 2]:  # prefill parts and single-token decode; pages shared with another sequence
        other.reserve(3)
        other.commit(3)
        q = rng.standard_normal((n, H, HD)).astype(np.float32)
        k = rng.standard_normal((n, NKV, HD)).astype(np.float32)
        v = rng.standard_normal((n, NKV, HD)).astype(np.float32)
        allK.append(k)
        allV.append(v)
        start = kv.length
        kv.reserve(n)
        out = be.attention(q, k, v, kv, 0, 0.3)
        kv.commit(n)
        ref = reference_attention(q, np.concatenate(allK), np.concatenate(allV), start, 0.3)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert not kv.contiguous
