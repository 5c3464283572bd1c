"""Unit tests of the CUDA kernels (native/cuda) against numpy references: gguf-py's dequantizers for the GGUF
block formats, float64 numpy for the rest. Skipped with a reason without CuPy, a GPU or the kernel library."""
import numpy as np
import pytest

from strata.backend import cuda as C
from strata.backend.cuda import library as KL
from strata.backend.cuda import settings as S
from strata.backend.cuda import weights as CW

_why = C.unavailable_reason()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"CUDA backend unavailable: {_why}")

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants as gq  # noqa: E402

from tests.helpers import random_blocks, ref_dequant  # noqa: E402

@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def be():
    return C.CudaBackend()


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 3, 8])
def test_matvec_matches_gguf_dequant(be, cp, t, n_tokens):
    rng = np.random.default_rng(int(t) * 100 + n_tokens)
    n_out, n_in = 77, 512
    raw = random_blocks(t, n_out, n_in, rng)
    W = ref_dequant(raw, t, n_out, n_in)
    x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
    w = CW.upload_raw("w", int(t), (n_out, n_in), raw)
    y = cp.full((n_tokens, n_out), cp.nan, cp.float32)
    be.matmul(cp.asarray(x), w, out=y)
    # one token goes through the int8-activation (dp4a) kernel: its exact reference is W times x rounded to q8_1
    xr = q8_1_dequant(x) if n_tokens == 1 and S.DP4A else x.astype(np.float64)
    ref = xr @ W.T
    assert np.isfinite(cp.asnumpy(y)).all()
    assert rel(cp.asnumpy(y), ref) < 1e-5


def q8_1_reference(x):
    """llama.cpp quantize_q8_1 in numpy (f32): per 32 values d = max|x| / 127, q = rint(x / d) (ties to even)."""
    xb = np.asarray(x, np.float32).reshape(-1, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(amax > 0, np.rint(xb / np.where(d > 0, d, 1)), 0).astype(np.int8)
    return q, d[:, 0]


def q8_1_dequant(x):
    q, d = q8_1_reference(x)
    return (q.astype(np.float64) * d[:, None].astype(np.float64)).reshape(np.shape(x))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matvec_dp4a_int8_activations(be, cp, t, monkeypatch):
    """The decode kernel: x quantized to int8 blocks bit-exactly as quantize_q8_1 (values, d, d * sum q); y
    within 1e-5 of W (x rounded to q8_1) and, stating the cost of the rounding, within 2e-2 of W x."""
    rng = np.random.default_rng(50 + int(t))
    n_out, n_in = 203, 2048
    raw = random_blocks(t, n_out, n_in, rng)
    W = ref_dequant(raw, t, n_out, n_in)
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    x[0, :32] = 0.0                                   # an all-zero block: d = 0, q = 0
    xq = cp.asnumpy(be.quantize_q8(cp.asarray(x)))
    q, d = q8_1_reference(x)
    assert np.array_equal(xq[:n_in].view(np.int8), q.reshape(-1))
    ds = xq[n_in:].view(np.float32).reshape(-1, 2)
    assert np.array_equal(ds[:, 0], d)
    np.testing.assert_allclose(ds[:, 1], d * q.astype(np.float32).sum(axis=1), rtol=1e-6)
    w = CW.upload_raw("w", int(t), (n_out, n_in), raw)
    monkeypatch.setattr(S, "DP4A", True)
    y = cp.asnumpy(be.matmul(cp.asarray(x), w))
    assert rel(y, q8_1_dequant(x) @ W.T) < 1e-5
    err = rel(y, x.astype(np.float64) @ W.T)
    print(f"{t.name}: int8 activation rounding costs rel L2 {err:.2e}")
    assert err < 2e-2


@pytest.mark.parametrize("t", TYPES + [Q.F16, Q.F32], ids=lambda t: t.name)
def test_dequant_f32_and_f16(be, cp, t):
    rng = np.random.default_rng(7 + int(t))
    n_out, n_in = 33, 768
    if t == Q.F32:
        raw = rng.standard_normal((n_out, n_in)).astype(np.float32)
        W = raw.astype(np.float64)
    elif t == Q.F16:
        raw = rng.standard_normal((n_out, n_in)).astype(np.float16)
        W = raw.astype(np.float64)
    else:
        raw = random_blocks(t, n_out, n_in, rng)
        W = ref_dequant(raw, t, n_out, n_in)
    w = CW.upload_raw("w", int(t), (n_out, n_in), raw)
    lib = KL.lib()
    for f16 in (0, 1):
        out = cp.full((n_out, n_in), cp.nan, cp.float16 if f16 else cp.float32)
        KL.check(lib.strata_dequant(KL.stream_ptr(), int(t), KL.ptr(w.data), KL.ptr(out), n_out, n_in, f16), "dequant")
        got = cp.asnumpy(out).astype(np.float64)
        if f16:
            np.testing.assert_allclose(got, W.astype(np.float16).astype(np.float64), rtol=0, atol=0)
        else:
            np.testing.assert_allclose(got, W, rtol=1e-6, atol=1e-7)
    ids = np.array([5, 0, 32, 5], np.int32)
    rows = cp.asnumpy(be.embed(w, ids))
    np.testing.assert_allclose(rows, W[ids], rtol=1e-6, atol=1e-7)


def test_gemm_prefill_path(be, cp):
    rng = np.random.default_rng(3)
    n_out, n_in, n = 200, 1024, 40
    raw = random_blocks(Q.Q4_K, n_out, n_in, rng)
    W = ref_dequant(raw, Q.Q4_K, n_out, n_in)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    y = be.matmul(cp.asarray(x), CW.upload_raw("w", int(Q.Q4_K), (n_out, n_in), raw))
    # f16 operands, f32 accumulation: relative error ~1e-3
    assert rel(cp.asnumpy(y), x.astype(np.float64) @ W.T) < 3e-3


@pytest.mark.parametrize("dim", [200, 512, 576, 2048, 4096, 5000, 9000])   # every register width (<= 8192) + the loop
@pytest.mark.parametrize("with_res", [False, True])
def test_rms_norm_residual(be, cp, with_res, dim):
    rng = np.random.default_rng(11)
    n, eps = 5, 1e-5
    x = rng.standard_normal((n, dim)).astype(np.float32)
    r = rng.standard_normal((n, dim)).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    s = x.astype(np.float64) + (r if with_res else 0)
    ref = s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * w
    d_sum = cp.full((n, dim), cp.nan, cp.float32)
    out = be.rms_norm(cp.asarray(x), cp.asarray(w), eps, residual=cp.asarray(r) if with_res else None, sum_out=d_sum)
    assert rel(cp.asnumpy(out), ref) < 1e-6
    assert rel(cp.asnumpy(d_sum), s) < 1e-7


@pytest.mark.parametrize("dim", [576, 2048, 9000])
def test_rms_norm_in_place_residual_stream(be, cp, dim):
    """The model's fused form: residual stream x += o and hn = norm(x), with sum_out aliasing the residual."""
    rng = np.random.default_rng(12)
    n, eps = 3, 1e-5
    o = rng.standard_normal((n, dim)).astype(np.float32)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    s = x.astype(np.float64) + o
    ref = s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * w
    d_x = cp.asarray(x)
    out = be.rms_norm(cp.asarray(o), cp.asarray(w), eps, residual=d_x, sum_out=d_x)
    assert rel(cp.asnumpy(out), ref) < 1e-6
    assert rel(cp.asnumpy(d_x), s) < 1e-7


def rope_ref(x, pos, n_rot, base, neox):
    """llama.cpp ggml_rope (NORM: pairs (2i, 2i+1); NEOX: pairs (i, i + n_rot/2)); dims >= n_rot untouched."""
    x = x.astype(np.float64).copy()
    half = n_rot // 2
    i = np.arange(half)
    ang = pos[:, None].astype(np.float64) * base ** (-2.0 * i / n_rot)      # (n, half)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a = i if neox else 2 * i
    b = i + half if neox else 2 * i + 1
    x0, x1 = x[..., a].copy(), x[..., b].copy()
    x[..., a] = x0 * c - x1 * s
    x[..., b] = x0 * s + x1 * c
    return x


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(be, cp, neox, n_rot):
    rng = np.random.default_rng(5)
    n, h, hd = 6, 3, 64
    x = rng.standard_normal((n, h, hd)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 4095, 16383], np.int32)
    got = cp.asnumpy(be.rope(cp.asarray(x), pos, n_rot, 100000.0, neox))
    ref = rope_ref(x, pos, n_rot, 100000.0, neox)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)


def test_swiglu(be, cp):
    rng = np.random.default_rng(2)
    g = rng.standard_normal(10000).astype(np.float32) * 4
    u = rng.standard_normal(10000).astype(np.float32)
    ref = g / (1 + np.exp(-g.astype(np.float64))) * u
    np.testing.assert_allclose(cp.asnumpy(be.swiglu(cp.asarray(g), cp.asarray(u))), ref, rtol=1e-5, atol=1e-6)


def attn_ref(q, K, V, pos0, scale):
    """Causal GQA attention in float64: q (n, H, hd) at positions pos0.., K/V (L, KV, hd)."""
    n, H, hd = q.shape
    g = H // K.shape[1]
    out = np.zeros((n, H, hd))
    for i in range(n):
        L = pos0 + i + 1
        for h in range(H):
            s = K[:L, h // g] @ q[i, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ V[:L, h // g]
    return out


@pytest.mark.parametrize("ctx", [1, 300, 5000])
@pytest.mark.parametrize("hd", [64, 96, 128])      # 64/128: lane-group decode kernel; 96: one position per warp
def test_paged_attention_decode_and_prefill(ctx, hd):
    import cupy as cp
    be = C.CudaBackend()
    rng = np.random.default_rng(ctx)
    H, KV, ps = 9, 3, 16
    # prefill (n > 1) through the flash kernel rounds Q (scaled) and P to f16 (f32 accumulation): ~1e-3
    tol_prefill = 5e-3 if hd in S.FLASH_HEAD_DIMS else 1e-4
    n_pages = (ctx + 40) // ps + 2
    table = list(rng.permutation(n_pages))             # scattered pages
    K = rng.standard_normal((ctx + 32, KV, hd)).astype(np.float16).astype(np.float64)
    V = rng.standard_normal((ctx + 32, KV, hd)).astype(np.float16).astype(np.float64)
    q_all = rng.standard_normal((ctx + 32, H, hd))
    scale = 1 / np.sqrt(hd)
    # prefill the first ctx-1 positions in one call (prefill path), then one decode step at ctx-1
    n0 = ctx - 1
    if n0 > 0:
        got = be.attention_pages(cp.asarray(q_all[:n0], dtype=cp.float32), cp.asarray(K[:n0], dtype=cp.float32),
                           cp.asarray(V[:n0], dtype=cp.float32), table, 0, ps, n_pages, 0, scale)
        got = cp.asnumpy(got)
        if n0 <= 400:
            assert rel(got, attn_ref(q_all[:n0], K, V, 0, scale)) < tol_prefill
        else:   # long prompt: the first and last 64 rows (first / last key-range splits and query tiles)
            assert rel(got[:64], attn_ref(q_all[:64], K, V, 0, scale)) < tol_prefill
            assert rel(got[-64:], attn_ref(q_all[n0 - 64:n0], K, V, n0 - 64, scale)) < tol_prefill
    got = be.attention_pages(cp.asarray(q_all[n0:ctx], dtype=cp.float32), cp.asarray(K[n0:ctx], dtype=cp.float32),
                       cp.asarray(V[n0:ctx], dtype=cp.float32), table, n0, ps, n_pages, 0, scale)
    ref = attn_ref(q_all[n0:ctx], K, V, n0, scale)
    assert rel(cp.asnumpy(got), ref) < 1e-4
    # a 20-token chunk after the context (prefill path with a non-zero start)
    got = be.attention_pages(cp.asarray(q_all[ctx:ctx + 20], dtype=cp.float32), cp.asarray(K[ctx:ctx + 20], dtype=cp.float32),
                       cp.asarray(V[ctx:ctx + 20], dtype=cp.float32), table, ctx, ps, n_pages, 0, scale)
    ref = attn_ref(q_all[ctx:ctx + 20], K, V, ctx, scale)
    assert rel(cp.asnumpy(got), ref) < tol_prefill


def test_argmax(cp):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 49152)).astype(np.float32)
    x[2, 100] = x[2, 200] = 50.0     # tie: lowest index wins (numpy's rule)
    out = cp.full(4, -1, cp.int32)
    KL.check(KL.lib().strata_argmax(KL.stream_ptr(), KL.ptr(cp.asarray(x)), KL.ptr(out), 4, x.shape[1]), "argmax")
    np.testing.assert_array_equal(cp.asnumpy(out), x.argmax(1))


def test_bad_type_is_rejected():
    with pytest.raises(ValueError, match="not supported"):
        CW.upload_raw("w", 6, (4, 32), np.zeros((4, 22), np.uint8))   # Q5_0: not implemented


@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope_kv_decode_fused(cp, n_rot):
    """strata_rope_kv_decode == RoPE (numpy reference) on q and k, then k and v stored as f16 at the page slot."""
    rng = np.random.default_rng(n_rot)
    H, KV, hd, ps, n_pages, p = 9, 3, 64, 16, 8, 37
    qkv = rng.standard_normal((1, (H + 2 * KV) * hd)).astype(np.float32)
    table = rng.permutation(n_pages).astype(np.int32)
    kc = cp.zeros((n_pages, ps, KV, hd), cp.float16)
    vc = cp.zeros((n_pages, ps, KV, hd), cp.float16)
    d_qkv = cp.asarray(qkv)
    pos = cp.asarray([p, p + 1], dtype=cp.int32)
    KL.check(KL.lib().strata_rope_kv_decode(KL.stream_ptr(), KL.ptr(d_qkv), KL.ptr(pos), KL.ptr(kc), KL.ptr(vc),
                                           KL.ptr(cp.asarray(table)), H, KV, hd, n_rot, 100000.0, 0, ps), "rope_kv")
    qk_ref = rope_ref(qkv[:, :(H + KV) * hd].reshape(1, H + KV, hd), np.array([p]), n_rot, 100000.0, False)
    got = cp.asnumpy(d_qkv)
    np.testing.assert_allclose(got[:, :(H + KV) * hd].reshape(1, H + KV, hd), qk_ref, rtol=1e-4, atol=2e-5)
    slot = cp.asnumpy(kc)[table[p // ps], p % ps].astype(np.float64)
    np.testing.assert_allclose(slot, qk_ref[0, H:].astype(np.float16), rtol=1e-3, atol=1e-3)
    v = qkv[0, (H + KV) * hd:].reshape(KV, hd)
    np.testing.assert_array_equal(cp.asnumpy(vc)[table[p // ps], p % ps], v.astype(np.float16))
    assert float(cp.abs(kc).sum()) == pytest.approx(float(np.abs(slot).sum()), rel=1e-3)   # nothing else written


@pytest.mark.parametrize("t", [Q.Q4_K, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("H,KV,hd,n_rot", [(9, 3, 64, 64), (5, 1, 36, 32)])
@pytest.mark.parametrize("pre", [0, 1], ids=["after-wait", "pre-wait"])
def test_matvec_q8w_rope_equals_matvec_then_rope_kv(cp, t, rows, H, KV, hd, n_rot, pre):
    """strata_matvec_q8w_rope == strata_matvec_q8w followed by strata_rope_kv_decode, bit for bit: qkv, the K and V
    cache (the page of the position, nothing else) — partial rotary and a last block with fewer rows than 4 * rows
    included, the angles and cache slots computed after or before the PDL wait; and the separate path is itself
    checked against numpy in test_rope_kv_decode_fused."""
    rng = np.random.default_rng(int(t) + rows + hd)
    n_in, ps, n_pages, p = 512, 16, 6, 21
    n_out = (H + 2 * KV) * hd
    raw = random_blocks(t, n_out, n_in, rng)
    w = CW.upload_raw("w", int(t), (n_out, n_in), raw)
    xq = _q8(cp, rng.standard_normal(n_in).astype(np.float32))
    table = cp.asarray(rng.permutation(n_pages).astype(np.int32))
    pos = cp.asarray([p], dtype=cp.int32)
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    outs = []
    for fused in (False, True):
        qkv = cp.full(n_out, cp.nan, cp.float32)
        kc, vc = (cp.zeros((n_pages, ps, KV, hd), cp.float16) for _ in range(2))
        if fused:
            KL.check(lb.strata_matvec_q8w_rope(s, int(t), KL.ptr(w.data), KL.ptr(xq), KL.ptr(qkv), H, KV, hd, n_in, rows,
                                               KL.ptr(pos), KL.ptr(kc), KL.ptr(vc), KL.ptr(table), n_rot, 10000.0, ps,
                                               N, N, N, N, 0.0, pre, N), "matvec_rope")
        else:
            KL.check(lb.strata_matvec_q8w(s, int(t), KL.ptr(w.data), KL.ptr(xq), KL.ptr(qkv), n_out, n_in, rows), "mv")
            KL.check(lb.strata_rope_kv_decode(s, KL.ptr(qkv), KL.ptr(pos), KL.ptr(kc), KL.ptr(vc), KL.ptr(table), H, KV, hd,
                                              n_rot, 10000.0, 0, ps), "rope_kv")
        outs.append([cp.asnumpy(a) for a in (qkv, kc, vc)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(outs[1][0]).all()
    assert np.count_nonzero(outs[1][2]) > 0.9 * KV * hd     # the V row was written (random values are rarely 0)


@pytest.mark.parametrize("E", [576, 2048, 4096])
@pytest.mark.parametrize("with_delta", [True, False])
def test_fused_norm_matvecs_match_norm_then_matvec(cp, E, with_delta):
    """strata_matvec_q8w_rope and strata_matvec_q8w_glu_norm with the RMSNorm in their prologue == strata_rms_norm_ex
    (q8_1 output) followed by the plain launchers, within f32 rounding (the sum of squares runs in another order, so
    a q8 value may move by one), and block 0 stores x + delta exactly; the inputs are left as they were."""
    rng = np.random.default_rng(E + with_delta)
    H, KV, hd, F, ps, p = 4, 2, 64, 256, 16, 5
    n_out = (H + 2 * KV) * hd
    t = Q.Q4_K if E % 256 == 0 else Q.Q4_1     # SmolLM2's width (576) with its type
    wq = CW.upload_raw("wqkv", int(t), (n_out, E), random_blocks(t, n_out, E, rng))
    wg = CW.upload_raw("wgu", int(t), (2 * F, E), random_blocks(t, 2 * F, E, rng))
    x, dl, nw = (cp.asarray(rng.standard_normal(E).astype(np.float32)) for _ in range(3))
    delta = dl if with_delta else None
    x0 = cp.asnumpy(x)
    table, pos = cp.arange(4, dtype=cp.int32), cp.asarray([p], dtype=cp.int32)
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    ref_x = x + dl if with_delta else x.copy()
    hq = cp.zeros(E + E // 4, cp.uint8)
    KL.check(lb.strata_rms_norm_ex(s, KL.ptr(x), KL.ptr(delta), KL.ptr(nw), N, N, N, KL.ptr(hq), 1, E, 1e-5), "rms")
    res = {}
    for fused in (False, True):
        qkv, act = cp.zeros(n_out, cp.float32), cp.zeros(F, cp.float32)
        kc, vc = (cp.zeros((4, ps, KV, hd), cp.float16) for _ in range(2))
        x_out = cp.full(E, cp.nan, cp.float32)
        norm = (KL.ptr(x), KL.ptr(delta), KL.ptr(nw), KL.ptr(x_out)) if fused else (N, N, N, N)
        KL.check(lb.strata_matvec_q8w_rope(s, int(t), KL.ptr(wq.data), N if fused else KL.ptr(hq), KL.ptr(qkv), H, KV,
                                           hd, E, 4, KL.ptr(pos), KL.ptr(kc), KL.ptr(vc), KL.ptr(table), hd, 10000.0, ps,
                                           *norm, 1e-5, 0, N), "rope")
        if fused:
            np.testing.assert_array_equal(cp.asnumpy(x_out), cp.asnumpy(ref_x))
            x_out[:] = cp.nan
        g, u = KL.ffi().cast("void *", wg.data.data.ptr), KL.ffi().cast("void *", wg.data.data.ptr + wg.nbytes // 2)
        KL.check(lb.strata_matvec_q8w_glu_norm(s, int(t), g, u, N if fused else KL.ptr(hq), KL.ptr(act), N, F, E, 2,
                                               *norm, 1e-5, N), "glu")
        if fused:
            np.testing.assert_array_equal(cp.asnumpy(x_out), cp.asnumpy(ref_x))
        res[fused] = (cp.asnumpy(qkv), cp.asnumpy(act), cp.asnumpy(kc))
    for a, b in zip(res[False], res[True]):
        a, b = a.astype(np.float64), b.astype(np.float64)
        assert np.linalg.norm(a - b) <= 2e-3 * np.linalg.norm(a)
    np.testing.assert_array_equal(cp.asnumpy(x), x0)


@pytest.mark.parametrize("E,t", [(576, Q.Q4_1), (2048, Q.Q4_K), (4096, Q.Q6_K)], ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("block", [0, 1], ids=["warp", "block"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_norm_handoff(cp, E, t, block, rows):
    """The norm handoff against this test's own numpy account: strata_matvec_q8_resid leaves x + W xq in x (the sum
    of strata_matvec_q8w / _q8b's product and x, bit for bit), q8_1(x * w) in x_q8 (== strata_quantize_q8_1 of x * w
    computed in numpy, bit for bit), each 32-row group's sum of x^2 in x_ss (f64 reference, 1e-5) and its counters
    back at 0; strata_norm_q8 writes the same handoff for a whole vector; the consumers given norm_ss ==
    their plain launch on x_q8 with the output scaled by 1 / sqrt(mean(x^2) + eps) (QKV before RoPE: RoPE'd in
    numpy; gate/up: silu(r g) * (r u))."""
    rng = np.random.default_rng(E + 7 * block + rows)
    n_in, F, H, KV, hd, ps, p, eps = 1024, 256, 4, 2, 64, 16, 5, 1e-5
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    w = CW.upload_raw("w", int(t), (E, n_in), random_blocks(t, E, n_in, rng))
    xq_in = _q8(cp, rng.standard_normal(n_in).astype(np.float32))
    x0 = rng.standard_normal(E).astype(np.float32)
    nw = rng.standard_normal(E).astype(np.float32)
    x, dnw = cp.asarray(x0), cp.asarray(nw)
    hq, ss = cp.zeros(E + E // 4, cp.uint8), cp.full(E // 32, cp.nan, cp.float32)
    cnt = cp.zeros(E // 32, cp.uint32)
    f32 = lambda a: KL.ffi().cast("float *", a.data.ptr)   # noqa: E731
    for _ in range(2):   # twice: the counters were reset by the first run (outputs poisoned again before each)
        x[:] = cp.asarray(x0)
        hq[:] = 0x5a
        ss[:] = cp.nan
        KL.check(lb.strata_matvec_q8_resid(s, int(t), KL.ptr(w.data), KL.ptr(xq_in), E, n_in, rows, block, f32(x),
                                           f32(dnw), KL.ptr(hq), f32(ss), KL.ffi().cast("unsigned *", cnt.data.ptr)),
                 "resid")
    y = cp.zeros(E, cp.float32)
    mv = lb.strata_matvec_q8b if block else lb.strata_matvec_q8w
    KL.check(mv(s, int(t), KL.ptr(w.data), KL.ptr(xq_in), KL.ptr(y), E, n_in, rows), "mv")
    want_x = x0 + cp.asnumpy(y)
    np.testing.assert_array_equal(cp.asnumpy(x), want_x)
    np.testing.assert_array_equal(cp.asnumpy(hq), cp.asnumpy(_q8(cp, want_x * nw)))
    want_ss = (want_x.astype(np.float64) ** 2).reshape(-1, 32).sum(1)
    np.testing.assert_allclose(cp.asnumpy(ss), want_ss, rtol=1e-5)
    assert not cnt.any()
    hq2, ss2 = cp.zeros_like(hq), cp.zeros_like(ss)
    KL.check(lb.strata_norm_q8(s, f32(x), f32(dnw), KL.ptr(hq2), f32(ss2), E), "norm_q8")
    np.testing.assert_array_equal(cp.asnumpy(hq2), cp.asnumpy(hq))
    np.testing.assert_array_equal(cp.asnumpy(ss2), cp.asnumpy(ss))
    if rows == 1 or block:
        return
    # the consumers, on x_q8 / x_ss (2 and 4 QKV rows per warp / gate-up row pairs per warp)
    r = 1.0 / np.sqrt(np.float64(want_ss.sum()) / E + eps)
    n_out = (H + 2 * KV) * hd
    tq = Q.Q4_K if E % 256 == 0 else Q.Q4_1
    wq = CW.upload_raw("wqkv", int(tq), (n_out, E), random_blocks(tq, n_out, E, rng))
    wg = CW.upload_raw("wgu", int(tq), (2 * F, E), random_blocks(tq, 2 * F, E, rng))
    table, pos = cp.arange(4, dtype=cp.int32), cp.asarray([p], dtype=cp.int32)
    kc, vc = (cp.zeros((4, ps, KV, hd), cp.float16) for _ in range(2))
    qkv, plain = cp.zeros(n_out, cp.float32), cp.zeros(n_out, cp.float32)
    KL.check(lb.strata_matvec_q8w_rope(s, int(tq), KL.ptr(wq.data), KL.ptr(hq), KL.ptr(qkv), H, KV, hd, E, rows,
                                       KL.ptr(pos), KL.ptr(kc), KL.ptr(vc), KL.ptr(table), hd, 10000.0, ps, N, N, N, N, eps,
                                       1, f32(ss)), "rope")
    KL.check(lb.strata_matvec_q8w(s, int(tq), KL.ptr(wq.data), KL.ptr(hq), KL.ptr(plain), n_out, E, rows), "mv")
    ref = cp.asnumpy(plain).astype(np.float64) * r
    ang = p * 10000.0 ** (-np.arange(hd // 2) * 2 / hd)
    qk = ref[:(H + KV) * hd].reshape(-1, hd // 2, 2)
    c, sn = np.cos(ang), np.sin(ang)
    ref[:(H + KV) * hd] = np.stack([qk[..., 0] * c - qk[..., 1] * sn, qk[..., 0] * sn + qk[..., 1] * c], -1).ravel()
    np.testing.assert_allclose(cp.asnumpy(qkv), ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    np.testing.assert_allclose(cp.asnumpy(vc)[0, p].ravel(), ref[(H + KV) * hd:], rtol=2e-3,
                               atol=2e-3 * np.abs(ref).max())
    act, gu = cp.zeros(F, cp.float32), cp.zeros(2 * F, cp.float32)
    g, u = KL.ffi().cast("void *", wg.data.data.ptr), KL.ffi().cast("void *", wg.data.data.ptr + wg.nbytes // 2)
    KL.check(lb.strata_matvec_q8w_glu_norm(s, int(tq), g, u, KL.ptr(hq), KL.ptr(act), N, F, E, rows, N, N, N, N, eps,
                                           f32(ss)), "glu")
    KL.check(lb.strata_matvec_q8w(s, int(tq), KL.ptr(wg.data), KL.ptr(hq), KL.ptr(gu), 2 * F, E, 1), "mv")
    gr, ur = (cp.asnumpy(gu).astype(np.float64) * r).reshape(2, F)
    want = gr / (1 + np.exp(-gr)) * ur
    np.testing.assert_allclose(cp.asnumpy(act), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_norm_handoff_refuses_bad_input(cp):
    """strata_matvec_q8_resid without x, or handing off with n_out % 32 != 0, without its buffers or with a misaligned
    x_q8; strata_norm_q8 with a NULL pointer or n % 32 != 0; a consumer given both a fused norm and norm_ss, or
    norm_ss over more than 4096 columns: an error code, and x, the q8_1 buffer, the sums, the counters and the
    consumers' outputs unchanged."""
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    w, xq = cp.zeros(1 << 16, cp.uint8), _q8(cp, np.ones(512, np.float32))
    x = cp.full(64, 3.0, cp.float32)
    hq, ss, cnt = cp.full(96, 7, cp.uint8), cp.full(2, 5.0, cp.float32), cp.zeros(2, cp.uint32)
    f = lambda a, off=0: KL.ffi().cast("float *", a.data.ptr + off)   # noqa: E731
    u = KL.ffi().cast("unsigned *", cnt.data.ptr)
    q, q_odd = KL.ptr(hq), KL.ffi().cast("void *", hq.data.ptr + 4)
    for n_out, xx, nw, qq, sp, c in ((64, N, f(x), q, f(ss), u), (48, f(x), f(x), q, f(ss), u),
                                     (64, f(x), f(x), N, f(ss), u), (64, f(x), f(x), q, N, u),
                                     (64, f(x), f(x), q, f(ss), N), (64, f(x), f(x), q_odd, f(ss), u)):
        rc = lb.strata_matvec_q8_resid(s, int(Q.Q4_K), KL.ptr(w), KL.ptr(xq), n_out, 512, 1, 0, xx, nw, qq, sp, c)
        assert rc != 0, n_out
    for xx, qq, n in ((f(x), q, 48), (N, q, 64), (f(x), N, 64), (f(x), q_odd, 64)):
        assert lb.strata_norm_q8(s, xx, f(x), qq, f(ss), n) != 0, n
    qkv, act, kc = cp.full(512, 9.0, cp.float32), cp.full(256, 9.0, cp.float32), cp.zeros(1 << 12, cp.float16)
    pos, table = cp.zeros(1, cp.int32), cp.zeros(4, cp.int32)
    for n_in, nw in ((512, f(x)), (8192, N)):   # a fused norm and norm_ss together; norm_ss over > 4096 columns
        rc = lb.strata_matvec_q8w_rope(s, int(Q.Q4_K), KL.ptr(w), KL.ptr(xq), KL.ptr(qkv), 4, 2, 32, n_in, 1, KL.ptr(pos),
                                       KL.ptr(kc), KL.ptr(kc), KL.ptr(table), 32, 10000.0, 16, N, N, nw, N, 1e-5, 0, f(ss))
        assert rc != 0, n_in
        rc = lb.strata_matvec_q8w_glu_norm(s, int(Q.Q4_K), KL.ptr(w), KL.ptr(w), KL.ptr(xq), KL.ptr(act), N, 256, n_in, 2, N,
                                           N, nw, N, 1e-5, f(ss))
        assert rc != 0, n_in
    cp.cuda.get_current_stream().synchronize()
    assert (x == 3.0).all() and (hq == 7).all() and (ss == 5.0).all() and not cnt.any()
    assert (qkv == 9.0).all() and (act == 9.0).all() and not kc.any()


def _fused_smem(t, n_in, r, rp):
    """(QKV, gate/up) dynamic shared memory of the fused-norm matvecs, computed here from the GGUF block sizes: 4
    warps x r rows and 32 / rp warps x rp gate + rp up rows, each run in 16-byte chunks plus 16, then x's q8_1."""
    bs, be = gq.GGML_QUANT_SIZES[t][1], gq.GGML_QUANT_SIZES[t][0]
    rb = n_in // be * bs
    staged = lambda n: (n + 15) // 16 * 16 + 16   # noqa: E731
    x = n_in + n_in // 4
    return 4 * staged(r * rb) + x, 2 * (32 // rp) * staged(rp * rb) + x


def test_fused_norm_supported_shapes(cp):
    """strata_fused_norm_supported against this test's own account of the shapes: widths above 4096 or not a multiple
    of 32 and a type without the dp4a kernel never fit; otherwise a shape fits exactly when both kernels' staged rows
    and x's q8_1 blocks fit the device's opt-in shared memory less 1 KB (the 1.7B benchmark model's and SmolLM2's
    layers do on every GPU; Q8_0 gate / up at 4096 with 2 pairs per warp, 279 KB, on none)."""
    f = KL.lib().strata_fused_norm_supported
    optin = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                               cp.cuda.Device().id)
    limit = max(optin - 1024, 47 * 1024)
    assert f(int(Q.Q4_K), int(Q.Q4_K), 2048, 4, 2) == 1
    assert f(int(Q.Q4_1), int(Q.Q4_1), 576, 4, 1) == 1
    assert f(int(Q.Q4_0), int(Q.Q4_0), 4128, 4, 2) == 0          # wider than 4096
    assert f(int(Q.Q4_0), int(Q.Q4_0), 1040, 4, 2) == 0          # not whole q8_1 blocks
    assert f(6, int(Q.Q4_K), 2048, 4, 2) == 0                     # Q5_0: no dp4a kernel
    assert f(int(Q.Q4_K), int(Q.Q8_0), 4096, 4, 2) == 0
    for tq, tg, n_in, r, rp in ((Q.Q4_K, Q.Q4_K, 4096, 4, 2), (Q.Q6_K, Q.Q4_K, 4096, 4, 2),
                                (Q.Q6_K, Q.Q6_K, 4096, 2, 4), (Q.Q8_0, Q.Q8_0, 2688, 4, 1), (Q.Q8_0, Q.Q4_0, 4096, 1, 4)):
        q_smem, _ = _fused_smem(tq, n_in, r, rp)
        _, g_smem = _fused_smem(tg, n_in, r, rp)
        want = int(q_smem <= limit and g_smem <= limit)
        assert f(int(tq), int(tg), n_in, r, rp) == want, (tq.name, tg.name, n_in, r, rp, q_smem, g_smem, limit)


def test_fused_norm_refuses_bad_input(cp):
    """A fused norm whose output aliases its input, a width not a multiple of 32 or too wide, or misaligned
    vectors: an error code, nothing written."""
    E = 1024
    w = cp.zeros(1 << 20, cp.uint8)
    x, nw = cp.ones(E + 4, cp.float32), cp.ones(E, cp.float32)
    qkv, act = cp.full(1024, cp.nan, cp.float32), cp.full(256, cp.nan, cp.float32)
    kc = cp.zeros(1 << 14, cp.float16)
    pos, table = cp.zeros(1, cp.int32), cp.zeros(4, cp.int32)
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    xp = KL.ffi().cast("float *", x.data.ptr)
    for xo, n_in, xx in ((xp, E, xp), (N, E - 16, xp), (N, 16384, xp), (N, E, KL.ffi().cast("float *", x.data.ptr + 4))):
        rc = lb.strata_matvec_q8w_rope(s, int(Q.Q8_0), KL.ptr(w), N, KL.ptr(qkv), 4, 2, 64, n_in, 4, KL.ptr(pos), KL.ptr(kc),
                                       KL.ptr(kc), KL.ptr(table), 64, 10000.0, 16, xx, N, KL.ptr(nw), xo, 1e-5, 0, N)
        assert rc != 0, n_in
        rc = lb.strata_matvec_q8w_glu_norm(s, int(Q.Q8_0), KL.ptr(w), KL.ptr(w), N, KL.ptr(act), N, 256, n_in, 4, xx, N,
                                           KL.ptr(nw), xo, 1e-5, N)
        assert rc != 0, n_in
    assert cp.isnan(qkv).all() and cp.isnan(act).all()


def test_matvec_q8w_rope_refuses_bad_input(cp):
    """Odd head size or rotary count, n_rot > hd, a NULL cache or position: cudaErrorInvalidValue, nothing run."""
    w, xq, qkv = cp.zeros(1 << 16, cp.uint8), cp.zeros(640, cp.uint8), cp.full(1024, cp.nan, cp.float32)
    kc = cp.zeros(1 << 12, cp.float16)
    pos, table = cp.zeros(1, cp.int32), cp.zeros(4, cp.int32)
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    for hd, n_rot, k, p in ((64, 63, kc, pos), (63, 62, kc, pos), (64, 66, kc, pos), (64, 64, None, pos),
                            (64, 64, kc, None)):
        rc = lb.strata_matvec_q8w_rope(s, int(Q.Q4_K), KL.ptr(w), KL.ptr(xq), KL.ptr(qkv), 2, 1, hd, 512, 1,
                                       KL.ptr(p) if p is not None else N, KL.ptr(k) if k is not None else N,
                                       KL.ptr(kc), KL.ptr(table), n_rot, 10000.0, 16, N, N, N, N, 0.0, 0, N)
        assert rc != 0, (hd, n_rot)
    assert cp.isnan(qkv).all()


# ------------------------------------------------------------------ second-generation kernels (decode plan, prefill)
def _q8(cp, x):
    """x f32 (n,) -> the q8_1 buffer strata_quantize_q8_1 writes (n + n // 4 bytes)."""
    xq = cp.zeros(x.size + x.size // 4, cp.uint8)
    dx = cp.asarray(x, dtype=cp.float32)
    KL.check(KL.lib().strata_quantize_q8_1(KL.stream_ptr(), KL.ptr(dx), KL.ptr(xq), x.size), "quantize")
    cp.cuda.get_current_stream().synchronize()
    return xq


def _q8_parts(buf, n):
    b = np.asarray(buf)
    return b[:n].view(np.int8), b[n:n + n // 4].view(np.float32).reshape(-1, 2)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("kind,n_in", [("q8w", 1024), ("q8b", 1024), ("q8b", 8192)])
def test_matvec_q8_decode_kernels(cp, t, rows, kind, n_in):
    """strata_matvec_q8w (a warp per `rows` rows) and strata_matvec_q8b (a block per `rows` rows, short and long
    rows) == W times x rounded to q8_1 (float64 reference), every row written (n_out not a multiple of `rows`)."""
    rng = np.random.default_rng(int(t) + 17 * rows + n_in + (kind == "q8b"))
    n_out = 1029
    raw = random_blocks(t, n_out, n_in, rng)
    W = ref_dequant(raw, t, n_out, n_in)
    x = rng.standard_normal(n_in).astype(np.float32)
    w = CW.upload_raw("w", int(t), (n_out, n_in), raw)
    y = cp.full(n_out, cp.nan, cp.float32)
    fn = getattr(KL.lib(), f"strata_matvec_{kind}")
    KL.check(fn(KL.stream_ptr(), int(t), KL.ptr(w.data), KL.ptr(_q8(cp, x)), KL.ptr(y), n_out, n_in, rows), kind)
    got = cp.asnumpy(y)
    assert np.isfinite(got).all()
    assert rel(got, W @ q8_1_dequant(x[None])[0]) < 1e-5


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rp", [1, 2, 4])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_matvec_q8w_glu(cp, t, rp, fused):
    """strata_matvec_q8w_glu == silu(Wg x) * (Wu x) on x rounded to q8_1 (float64 reference), and bit for bit the
    unfused pair it replaces (strata_matvec_q8w over [gate; up], then strata_swiglu_gu): f32 act and q8_1 blocks."""
    rng = np.random.default_rng(int(t) + 31 * rp)
    F, n_in = 1536, 1024
    raw = random_blocks(t, 2 * F, n_in, rng)
    W = ref_dequant(raw, t, 2 * F, n_in)
    x = rng.standard_normal(n_in).astype(np.float32)
    xq = _q8(cp, x)
    wgu = CW.upload_raw("gu", int(t), (2 * F, n_in), raw)
    if fused:
        gp = wgu.data.data.ptr
        up = gp + F * wgu.data.shape[1]
        keep = ()
    else:
        wg = CW.upload_raw("g", int(t), (F, n_in), raw[:F].copy())
        wu = CW.upload_raw("u", int(t), (F, n_in), raw[F:].copy())
        gp, up, keep = wg.data.data.ptr, wu.data.data.ptr, (wg, wu)
    act = cp.full(F, cp.nan, cp.float32)
    aq = cp.zeros(F + F // 4, cp.uint8)
    vp = lambda a: KL.ffi().cast("void *", a)   # noqa: E731
    KL.check(KL.lib().strata_matvec_q8w_glu(KL.stream_ptr(), int(t), vp(gp), vp(up), KL.ptr(xq), KL.ptr(act), KL.ptr(aq),
                                           F, n_in, rp), "matvec_glu")
    gu = cp.full(2 * F, cp.nan, cp.float32)
    act0, aq0 = cp.full(F, cp.nan, cp.float32), cp.zeros(F + F // 4, cp.uint8)
    KL.check(KL.lib().strata_matvec_q8w(KL.stream_ptr(), int(t), KL.ptr(wgu.data), KL.ptr(xq), KL.ptr(gu), 2 * F, n_in, 1),
             "matvec_q8w")
    KL.check(KL.lib().strata_swiglu_gu(KL.stream_ptr(), KL.ptr(gu), 1, F, KL.ptr(act0), KL.ffi().NULL, KL.ptr(aq0)), "swiglu")
    got = cp.asnumpy(act)
    y = W @ q8_1_dequant(x[None])[0]
    g, u = y[:F], y[F:]
    with np.errstate(over="ignore"):                  # exp(-g) = inf for very negative g: silu -> 0
        assert rel(got, g / (1 + np.exp(-g)) * u) < 1e-5
    np.testing.assert_array_equal(got, cp.asnumpy(act0))
    np.testing.assert_array_equal(cp.asnumpy(aq), cp.asnumpy(aq0))
    del keep


def test_matvec_q8w_glu_rejects_bad_shapes(cp):
    """F not a multiple of 32 (a thread block writes whole q8_1 blocks) or an unsupported type: an error code and
    nothing written."""
    xq = cp.zeros(1024 + 256, cp.uint8)
    act = cp.full(64, cp.nan, cp.float32)
    w = cp.zeros(1 << 16, cp.uint8)
    for t, F in ((2, 48), (1, 64)):                                      # Q4_0 with F = 48; F16 (no dp4a kernel)
        rc = KL.lib().strata_matvec_q8w_glu(KL.stream_ptr(), t, KL.ptr(w), KL.ptr(w), KL.ptr(xq), KL.ptr(act), KL.ffi().NULL,
                                           F, 1024, 2)
        assert rc != 0
    assert cp.isnan(act).all()


@pytest.mark.parametrize("E", [576, 2048, 8192])
def test_rms_norm_ex_f16_and_q8_outputs(cp, E):
    rng = np.random.default_rng(5)
    x, r, w = (rng.standard_normal(E).astype(np.float32) for _ in range(3))
    s = x.astype(np.float64) + r
    ref = s / np.sqrt((s * s).mean() + 1e-5) * w
    out, out16, xq = cp.full(E, cp.nan, cp.float32), cp.zeros(E, cp.float16), cp.zeros(E + E // 4, cp.uint8)
    dx, dr, dw = cp.asarray(x), cp.asarray(r), cp.asarray(w)     # kept alive until the kernel has run
    KL.check(KL.lib().strata_rms_norm_ex(KL.stream_ptr(), KL.ptr(dx), KL.ptr(dr), KL.ptr(dw),
                                        KL.ptr(out), KL.ffi().NULL, KL.ptr(out16), KL.ptr(xq), 1, E, 1e-5), "rms_ex")
    got = cp.asnumpy(out)
    assert rel(got, ref) < 1e-5
    np.testing.assert_allclose(cp.asnumpy(out16).astype(np.float64), ref, rtol=2e-3, atol=2e-3)
    q, d = _q8_parts(cp.asnumpy(xq), E)
    q_ref, d_ref = q8_1_reference(got)
    np.testing.assert_array_equal(q, q_ref.reshape(-1))
    np.testing.assert_array_equal(d[:, 0], d_ref)
    np.testing.assert_allclose(d[:, 1], d_ref * q_ref.reshape(-1, 32).sum(1), rtol=1e-6)


def test_swiglu_gu_outputs(cp):
    rng = np.random.default_rng(6)
    n, F = 3, 1536
    gu = rng.standard_normal((n, 2 * F)).astype(np.float32) * 3
    g, u = gu[:, :F].astype(np.float64), gu[:, F:]
    ref = g / (1 + np.exp(-g)) * u
    out, out16 = cp.full((n, F), cp.nan, cp.float32), cp.zeros((n, F), cp.float16)
    dgu = cp.asarray(gu)
    KL.check(KL.lib().strata_swiglu_gu(KL.stream_ptr(), KL.ptr(dgu), n, F, KL.ptr(out), KL.ptr(out16),
                                      KL.ffi().NULL), "swiglu_gu")
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(out16).astype(np.float64), ref, rtol=2e-3, atol=2e-3)
    xq = cp.zeros(F + F // 4, cp.uint8)
    KL.check(KL.lib().strata_swiglu_gu(KL.stream_ptr(), KL.ptr(dgu), 1, F, KL.ffi().NULL, KL.ffi().NULL,
                                      KL.ptr(xq)), "swiglu_gu q8")
    q, _ = _q8_parts(cp.asnumpy(xq), F)
    q_ref, _ = q8_1_reference(cp.asnumpy(out)[0])
    assert (q != q_ref.reshape(-1)).sum() <= 2      # f32 rounding of silu may move a value across a .5


@pytest.mark.parametrize("neox", [False, True])
def test_rope_kv_prefill(cp, neox):
    rng = np.random.default_rng(7 + neox)
    H, KV, hd, ps, n_pages, n, pos0, n_rot = 8, 2, 64, 16, 12, 37, 21, 64
    stride = (H + 2 * KV) * hd + 8                     # padded rows: the kernel must honour the stride
    qkv = rng.standard_normal((n, stride)).astype(np.float32)
    table = rng.permutation(n_pages).astype(np.int32)
    kc, vc = cp.zeros((n_pages, ps, KV, hd), cp.float16), cp.zeros((n_pages, ps, KV, hd), cp.float16)
    d = cp.asarray(qkv)
    dt = cp.asarray(table)
    KL.check(KL.lib().strata_rope_kv_prefill(KL.stream_ptr(), KL.ptr(d), stride, pos0, KL.ptr(kc), KL.ptr(vc),
                                            KL.ptr(dt), n, H, KV, hd, n_rot, 10000.0, int(neox), ps),
             "rope_kv_prefill")
    pos = np.arange(pos0, pos0 + n)
    qk_ref = rope_ref(qkv[:, :(H + KV) * hd].reshape(n, H + KV, hd), pos, n_rot, 10000.0, neox)
    got = cp.asnumpy(d)
    np.testing.assert_allclose(got[:, :(H + KV) * hd].reshape(n, H + KV, hd), qk_ref, rtol=1e-4, atol=2e-5)
    np.testing.assert_array_equal(got[:, (H + KV) * hd:], qkv[:, (H + KV) * hd:])
    K, V = cp.asnumpy(kc), cp.asnumpy(vc)
    for t, p in enumerate(pos):
        np.testing.assert_allclose(K[table[p // ps], p % ps].astype(np.float64), qk_ref[t, H:].astype(np.float16),
                                   rtol=1e-3, atol=1e-3)
        np.testing.assert_array_equal(V[table[p // ps], p % ps],
                                      qkv[t, (H + KV) * hd:(H + 2 * KV) * hd].reshape(KV, hd).astype(np.float16))


def _paged(cp, rng, L, KV, hd, ps):
    n_pages = L // ps + 2
    table = rng.permutation(n_pages).astype(np.int32)
    K = rng.standard_normal((L, KV, hd)).astype(np.float16)
    V = rng.standard_normal((L, KV, hd)).astype(np.float16)
    kc, vc = np.zeros((n_pages, ps, KV, hd), np.float16), np.zeros((n_pages, ps, KV, hd), np.float16)
    for p in range(L):
        kc[table[p // ps], p % ps] = K[p]
        vc[table[p // ps], p % ps] = V[p]
    return K.astype(np.float64), V.astype(np.float64), cp.asarray(kc), cp.asarray(vc), cp.asarray(table)


def _decode_case(cp, seed, L, H, KV, hd, ps=16):
    """A decode-attention case: paged f16 K/V of L positions, one query (H heads), its float64 reference output of
    the last position. Returns (kc, vc, pt, dq f32 device (H * hd), scale, ref (H * hd))."""
    rng = np.random.default_rng(seed)
    K, V, kc, vc, pt = _paged(cp, rng, L, KV, hd, ps)
    q = rng.standard_normal((1, H, hd))
    scale = 1 / np.sqrt(hd)
    ref = attn_ref(q, K, V, L - 1, scale)[0].reshape(-1)
    return kc, vc, pt, cp.asarray(q.reshape(-1), dtype=cp.float32), scale, ref


@pytest.fixture(params=["1", "0"], ids=["double-buffer", "single-buffer"])
def attn_db(request, monkeypatch):
    """Both builds of the GQA decode attention's main loop (STRATA_CUDA_ATTN_DB, read by the launcher per launch)."""
    monkeypatch.setenv("STRATA_CUDA_ATTN_DB", request.param)
    return request.param


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("H,KV", [(9, 3), (8, 8), (32, 4), (16, 2)])
@pytest.mark.parametrize("L,n_split", [(1, 1), (77, 1), (300, 3), (5000, 40), (5000, 128), (5000, 256), (100, 256)])
def test_attn_decode_gqa(cp, hd, H, KV, L, n_split, attn_db):
    """strata_attn_decode_gqa == float64 attention of the last position; q8_1 output == q8_1 of the f32 output;
    twice in a row (the split counters reset themselves)."""
    ps = 16
    kc, vc, pt, dq, scale, ref = _decode_case(cp, L + hd + H, L, H, KV, hd, ps)
    ws = cp.zeros(H * n_split * (hd + 2), cp.float32)
    ctr = cp.zeros(KV, cp.uint32)
    for _ in range(2):
        out = cp.full(H * hd, cp.nan, cp.float32)
        oq = cp.zeros(H * hd + H * hd // 4, cp.uint8)
        KL.check(KL.lib().strata_attn_decode_gqa(KL.stream_ptr(), KL.ptr(dq), KL.ptr(kc), KL.ptr(vc), KL.ptr(pt), KL.ffi().NULL,
                                                L, KL.ptr(ws), KL.ffi().cast("unsigned *", ctr.data.ptr), KL.ptr(out),
                                                KL.ptr(oq), H, KV, hd, ps, n_split, scale, KL.ffi().NULL,
                                                KL.ffi().NULL), "attn_gqa")
        got = cp.asnumpy(out)
        assert rel(got, ref) < 1e-4
        assert int(cp.asnumpy(ctr).sum()) == 0
        q, _ = _q8_parts(cp.asnumpy(oq), H * hd)
        np.testing.assert_array_equal(q, q8_1_reference(got)[0].reshape(-1))


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("n,length,n_split", [(1, 0, 1), (37, 0, 1), (200, 0, 1), (130, 1000, 1), (130, 1000, 4),
                                              (64, 3000, 16)])
@pytest.mark.parametrize("f16_out", [False, True])
def test_fa2_prefill(cp, hd, n, length, n_split, f16_out):
    """strata_fa2_prefill == float64 causal GQA attention; q read with a row stride (the fused qkv buffer)."""
    rng = np.random.default_rng(n + length + hd + n_split)
    H, KV, ps = 12, 4, 16
    K, V, kc, vc, pt = _paged(cp, rng, length + n, KV, hd, ps)
    q = rng.standard_normal((n, H, hd))
    stride = (H + 2 * KV) * hd
    qbuf = np.zeros((n, stride), np.float32)
    qbuf[:, :H * hd] = q.reshape(n, -1)
    scale = 1 / np.sqrt(hd)
    ws = cp.zeros(n_split * H * n * (hd + 2), cp.float32)
    out = cp.full((n, H, hd), cp.nan, cp.float32)
    out16 = cp.full((n, H, hd), cp.nan, cp.float16)
    dq = cp.asarray(qbuf)
    KL.check(KL.lib().strata_fa2_prefill(KL.stream_ptr(), KL.ptr(dq), stride, KL.ptr(kc), KL.ptr(vc), KL.ptr(pt),
                                        KL.ffi().NULL if f16_out else KL.ptr(out), KL.ptr(out16) if f16_out else KL.ffi().NULL,
                                        KL.ptr(ws), n, H, KV, hd, ps, length, n_split, scale, KL.ffi().NULL,
                                        KL.ffi().NULL), "fa2")
    got = cp.asnumpy(out16 if f16_out else out).astype(np.float64)
    assert np.isfinite(got).all()
    for i0, i1 in ((0, min(n, 40)), (max(0, n - 24), n)):
        assert rel(got[i0:i1], attn_ref(q[i0:i1], K, V, length + i0, scale)) < 5e-3


# ------------------------------------------------------------------ q8_0 KV cache (--kv q8_0)
def q8_0_rows(x):
    """ggml q8_0 of f32 rows (..., hd) per 32 values in numpy: d = max|x| / 127 (f32, stored as f16), q =
    rint(x / d) (ties to even) -> (q int8, d f16)."""
    xb = np.asarray(x, np.float32).reshape(-1, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(amax > 0, np.rint(xb / np.where(d > 0, d, 1)), 0).astype(np.int8)
    return q.reshape(np.shape(x)), d[:, 0].astype(np.float16).reshape(np.shape(x)[:-1] + (np.shape(x)[-1] // 32,))


def _paged_q8(cp, rng, L, KV, hd, ps):
    """Random K/V of L positions written through strata_kv_write_q8 into scattered pages; returns the values the
    cache represents (d * q, float64), the device arrays and the table."""
    n_pages = L // ps + 2
    table = rng.permutation(n_pages).astype(np.int32)
    K = rng.standard_normal((L, KV, hd)).astype(np.float32) * 2
    V = rng.standard_normal((L, KV, hd)).astype(np.float32)
    shape, sshape = (n_pages, ps, KV, hd), (n_pages, ps, KV, hd // 32)
    kq, vq = cp.zeros(shape, cp.int8), cp.zeros(shape, cp.int8)
    ks, vs = cp.zeros(sshape, cp.float16), cp.zeros(sshape, cp.float16)
    pt, dk, dv = cp.asarray(table), cp.asarray(K), cp.asarray(V)
    KL.check(KL.lib().strata_kv_write_q8(KL.stream_ptr(), KL.ptr(dk), KV * hd, KL.ptr(dv), KV * hd, KL.ptr(kq), KL.ptr(vq),
                                        KL.ptr(ks), KL.ptr(vs), KL.ptr(pt), KL.ffi().NULL, 0, L, KV, hd, ps), "kv_write_q8")
    cp.cuda.get_current_stream().synchronize()
    deq = []
    for X in (K, V):
        q, d = q8_0_rows(X)
        deq.append((q.reshape(L, KV, hd // 32, 32) * d.astype(np.float64)[..., None]).reshape(L, KV, hd))
    return deq[0], deq[1], (kq, vq, ks, vs), pt, (q8_0_rows(K), q8_0_rows(V)), table


@pytest.mark.parametrize("hd", [64, 128])
def test_kv_write_q8_and_gather(cp, hd):
    """strata_kv_write_q8 stores ggml q8_0 (int8 bit-exact, f16 scales exact) at the page slots; strata_kv_gather_q8
    and CudaPagePool(kv="q8_0").read give d * q back."""
    rng = np.random.default_rng(hd)
    L, KV, ps = 70, 3, 16
    Kd, Vd, (kq, vq, ks, vs), pt, ((qk, dk), (qv, dv)), table = _paged_q8(cp, rng, L, KV, hd, ps)
    Q, S = cp.asnumpy(kq), cp.asnumpy(ks)
    for p in (0, 17, L - 1):
        np.testing.assert_array_equal(Q[table[p // ps], p % ps], qk[p])
        np.testing.assert_array_equal(S[table[p // ps], p % ps], dk[p])
    ko, vo = cp.empty((KV, L, hd), cp.float32), cp.empty((KV, L, hd), cp.float32)
    KL.check(KL.lib().strata_kv_gather_q8(KL.stream_ptr(), KL.ptr(kq), KL.ptr(vq), KL.ptr(ks), KL.ptr(vs), KL.ptr(pt), KL.ptr(ko),
                                         KL.ptr(vo), L, KV, hd, ps), "kv_gather_q8")
    np.testing.assert_allclose(cp.asnumpy(ko), Kd.transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(vo), Vd.transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
    pool = C.CudaPagePool([0], L // ps + 2, ps, KV, hd, kv="q8_0")
    pages = pool.alloc(-(-L // ps))
    pool.write(0, pages, 0, cp.asarray(Kd.astype(np.float32)), cp.asarray(Vd.astype(np.float32)))
    k2, v2 = pool.read(0, pages, L)
    np.testing.assert_allclose(cp.asnumpy(k2), Kd.transpose(1, 0, 2), rtol=1e-3, atol=1e-3)   # d * q re-quantized
    np.testing.assert_allclose(cp.asnumpy(v2), Vd.transpose(1, 0, 2), rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(cp.asnumpy(vq)[table[5 // ps], 5 % ps], qv[5])
    np.testing.assert_array_equal(cp.asnumpy(vs)[table[5 // ps], 5 % ps], dv[5])
    assert pool.bytes_per_token == 2 * KV * hd + 2 * KV * hd // 16


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("H,KV", [(9, 3), (16, 8)])
@pytest.mark.parametrize("L,n_split", [(1, 1), (1, 4), (77, 2), (300, 5), (300, 40)])
def test_attn_decode_v1_q8_output(cp, hd, H, KV, L, n_split):
    """strata_attn_decode_ex (the first split-K kernel; its splits merged by a second launch, or by the last block of
    each head with counters; the length and pages read after or before the PDL wait) == float64 attention of the
    last position, all four forms bit for bit, the counters left at 0 (the next layer's launch reuses them), and the
    q8_1 output == q8_1 of the f32 output (the plan feeds it to the o-projection matvec directly). (1, 4): splits
    with no position."""
    ps = 16
    kc, vc, pt, dq, scale, ref = _decode_case(cp, L + hd + H + 1, L, H, KV, hd, ps)
    lb = KL.lib()   # loads the library (and KL.ffi())
    outs = []
    ctr = cp.zeros(H, cp.uint32)
    for merged in (False, True):
        for pre in (0, 1):
            ws = cp.zeros(H * n_split * (hd + 2), cp.float32)
            out = cp.full(H * hd, cp.nan, cp.float32)
            oq = cp.zeros(H * hd + H * hd // 4, cp.uint8)
            ctr_p = KL.ffi().cast("unsigned *", ctr.data.ptr) if merged else KL.ffi().NULL
            # the length from device memory when read before the wait (as the decode graph does), else the argument
            dl = cp.asarray([L], dtype=cp.int32)   # kept alive until the kernel has run
            d_len = KL.ffi().cast("int *", dl.data.ptr) if pre else KL.ffi().NULL
            KL.check(lb.strata_attn_decode_ex(KL.stream_ptr(), KL.ptr(dq), KL.ptr(kc), KL.ptr(vc), KL.ptr(pt), d_len,
                                              0 if pre else L, KL.ptr(ws), KL.ptr(out), KL.ptr(oq), ctr_p, pre, H, KV, hd,
                                              ps, n_split, scale), "attn_v1")
            got = cp.asnumpy(out)
            assert rel(got, ref) < 1e-4
            qv, _ = _q8_parts(cp.asnumpy(oq), H * hd)
            np.testing.assert_array_equal(qv, q8_1_reference(got)[0].reshape(-1))
            assert not cp.asnumpy(ctr).any()   # reset by the merging blocks: reused by the next call
            outs.append((got, cp.asnumpy(oq)))
    for got, oq in outs[1:]:
        np.testing.assert_array_equal(got, outs[0][0])
        np.testing.assert_array_equal(oq, outs[0][1])


def test_gqa_resident_blocks(attn_db):
    """strata_attn_decode_gqa_occupancy / gqa_resident: at least one resident block per SM for every head size and
    group the GQA decode kernel takes (f16 and q8_0 caches, both STRATA_CUDA_ATTN_DB variants), 0 for a shape it
    does not take (the split is then not capped), and a one-wave split for the plan's shapes."""
    for hd in (32, 64, 128, 256):
        for g in (1, 2, 3, 4, 8):
            for q8 in (False, True):
                assert 1 <= S.gqa_resident(hd, g, q8) <= 16, (hd, g, q8)
    assert S.gqa_resident(96, 2, False) == 0 and S.gqa_resident(128, 9, False) == 0
    assert KL.lib().strata_attn_decode_gqa_occupancy(96, 2, 0) < 0
    n_sm = C.CudaBackend().n_sm
    for n_kv in (3, 8):
        r = S.gqa_resident(128, 2, False)
        assert n_kv * S.n_split_gqa(1 << 20, n_kv, n_sm, resident=r) <= max(n_kv, r * n_sm)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("L,n_split", [(1, 1), (300, 3), (5000, 40)])
def test_attn_decode_gqa_q8_cache(cp, hd, L, n_split, attn_db):
    """strata_attn_decode_gqa on a q8_0 cache == float64 attention over the values the cache holds (d * q)."""
    rng = np.random.default_rng(L + hd)
    H, KV, ps = 16, 4, 16
    Kd, Vd, (kq, vq, ks, vs), pt, _, _ = _paged_q8(cp, rng, L, KV, hd, ps)
    q = rng.standard_normal((1, H, hd))
    scale = 1 / np.sqrt(hd)
    ref = attn_ref(q, Kd, Vd, L - 1, scale)[0].reshape(-1)
    ws, ctr = cp.zeros(H * n_split * (hd + 2), cp.float32), cp.zeros(KV, cp.uint32)
    dq, out = cp.asarray(q.reshape(-1), dtype=cp.float32), cp.full(H * hd, cp.nan, cp.float32)
    KL.check(KL.lib().strata_attn_decode_gqa(KL.stream_ptr(), KL.ptr(dq), KL.ptr(kq), KL.ptr(vq), KL.ptr(pt), KL.ffi().NULL, L,
                                            KL.ptr(ws), KL.ffi().cast("unsigned *", ctr.data.ptr), KL.ptr(out), KL.ffi().NULL,
                                            H, KV, hd, ps, n_split, scale, KL.ptr(ks), KL.ptr(vs)), "attn_gqa_q8")
    assert rel(cp.asnumpy(out), ref) < 1e-4


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("n,length,n_split", [(37, 0, 1), (130, 1000, 4)])
def test_fa2_prefill_q8_cache(cp, hd, n, length, n_split):
    """strata_fa2_prefill on a q8_0 cache == float64 causal attention over d * q (the tile holds them as f16)."""
    rng = np.random.default_rng(n + length + hd)
    H, KV, ps = 12, 4, 16
    Kd, Vd, (kq, vq, ks, vs), pt, _, _ = _paged_q8(cp, rng, length + n, KV, hd, ps)
    q = rng.standard_normal((n, H, hd))
    scale = 1 / np.sqrt(hd)
    dq = cp.asarray(q.reshape(n, -1), dtype=cp.float32)
    ws, out = cp.zeros(n_split * H * n * (hd + 2), cp.float32), cp.full((n, H, hd), cp.nan, cp.float32)
    KL.check(KL.lib().strata_fa2_prefill(KL.stream_ptr(), KL.ptr(dq), H * hd, KL.ptr(kq), KL.ptr(vq), KL.ptr(pt), KL.ptr(out),
                                        KL.ffi().NULL, KL.ptr(ws), n, H, KV, hd, ps, length, n_split, scale, KL.ptr(ks),
                                        KL.ptr(vs)), "fa2_q8")
    got = cp.asnumpy(out).astype(np.float64)
    for i0, i1 in ((0, min(n, 40)), (max(0, n - 24), n)):
        assert rel(got[i0:i1], attn_ref(q[i0:i1], Kd, Vd, length + i0, scale)) < 5e-3
