"""The C core's paged GQA attention (native/cpu/attention.c): against a float64 dense reference, and bit-identical
results for a query whatever the call's size, the thread count, the decode split or the vector width (the avx512
kernel set's 512-bit products against the 256-bit ones)."""
import numpy as np
import pytest

from strata.backend import quant
from strata.backend import cpu as cpu_backend
from strata.backend.cpu import CPUBackend
from strata.memory.kv import PagedKV

pytestmark = pytest.mark.skipif(not cpu_backend._NATIVE_ATTENTION,
                                reason="C core not built or CPU without AVX2+FMA (numpy attention is used)")


def reference(q, K, V, start, scale):
    """Dense causal GQA in float64: q (n, H, d) at positions start.., K/V (L, Hkv, d)."""
    n, H, _ = q.shape
    g = H // K.shape[1]
    out = np.zeros((n, H, V.shape[2]))
    for i in range(n):
        for h in range(H):
            s = K[:start + i + 1, h // g].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ V[:start + i + 1, h // g]
    return out


def run(parts, H=9, NKV=3, HD=64, page_size=16, threads=2, seed=0, interleave=True):
    """Feed random q/k/v in parts of the given sizes; returns (outputs concatenated, q, K, V)."""
    rng = np.random.default_rng(seed)
    total = sum(parts)
    q = rng.standard_normal((total, H, HD)).astype(np.float32)
    k = rng.standard_normal((total, NKV, HD)).astype(np.float32)
    v = rng.standard_normal((total, NKV, HD)).astype(np.float32)
    quant.set_threads(threads)
    be = CPUBackend()
    pool = be.new_page_pool([0], total // page_size + 2 * len(parts) + 8, NKV, HD, page_size=page_size)
    other, kv = PagedKV(pool), PagedKV(pool)
    outs, pos = [], 0
    for n in parts:
        if interleave:  # another sequence takes pages in between: a scattered page table
            other.reserve(page_size)
            other.commit(page_size)
        kv.reserve(n)
        outs.append(be.attention(q[pos:pos + n], k[pos:pos + n], v[pos:pos + n], kv, 0, 0.125))
        kv.commit(n)
        pos += n
    return np.concatenate(outs), q, k, v


@pytest.fixture(autouse=True)
def _threads():
    t = quant.get_threads()
    yield
    quant.set_threads(t)


@pytest.mark.parametrize("parts,page_size,H,NKV", [([37, 1, 1, 20, 1], 16, 9, 3), ([300, 1, 2], 256, 9, 3),
                                                   ([5, 70, 1], 8, 8, 1), ([3, 1], 4, 4, 4)])
def test_matches_float64_reference(parts, page_size, H, NKV):
    out, q, k, v = run(parts, H=H, NKV=NKV, page_size=page_size)
    np.testing.assert_allclose(out, reference(q, k, v, 0, 0.125), rtol=2e-5, atol=2e-5)


def test_decode_at_long_context_uses_split_and_matches():
    out, q, k, v = run([600, 1, 1], page_size=64)  # 10 pages: decode splits over KV heads x pages
    ref = reference(q[600:], k, v, 600, 0.125)
    np.testing.assert_allclose(out[600:], ref, rtol=2e-5, atol=2e-5)


def test_bit_identical_across_parts_and_threads():
    """A query's output depends only on its position and the K/V it sees: one prefill call, the same tokens in
    parts, single-token decode steps and 1 or 2 threads all give the same bits."""
    whole, *_ = run([700], threads=2, interleave=False)
    parts, *_ = run([333, 1, 200, 1, 1, 164], threads=1)
    steps, *_ = run([690] + [1] * 10, threads=2)  # decode: pages computed in parallel, merged in order
    assert np.array_equal(whole, parts)
    assert np.array_equal(whole, steps)


def test_numpy_path_agrees(monkeypatch):
    out, *_ = run([40, 1, 9])
    monkeypatch.setattr(cpu_backend, "_NATIVE_ATTENTION", False)
    ref, *_ = run([40, 1, 9])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (quant.native_available() and quant._lib.strata_cpu_has_avx512()),
                    reason="CPU without AVX-512: only the 256-bit products")
@pytest.mark.parametrize("HD", [64, 128, 40])
def test_wide_products_bit_identical_to_256_bit(HD):
    """The avx512 kernel set's QK / PV products (16 keys or value columns per vector) give the 256-bit kernels'
    bits: prefill rows, a short read and decode steps past several pages; head size 40 keeps the 256-bit PV."""
    got = {}
    for path in ("avxvnni", "avx512"):
        quant.set_cpu_path(path)
        try:
            got[path], *_ = run([300, 1, 17, 1, 33, 1], HD=HD, page_size=32)
        finally:
            quant.set_cpu_path("auto")
    assert np.array_equal(got["avxvnni"], got["avx512"])
