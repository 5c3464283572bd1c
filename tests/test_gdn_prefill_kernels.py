"""The fused GDN prefill kernels (native/cuda/gdn_prefill.cu via strata/backend/cuda/gdn_prefill.py) against float64
evaluations of strata/backend/gdn.py's formulas in qwen3next._gdn's layouts, and the model's fused device path.

Runs anywhere: the beta / alpha column map (``ba_index``) equals _gdn's reshape-and-slice of ``ssm_ba``; the row-stride
derivation of the launchers (``row_stride``) on numpy arrays and views; the numpy form of ``prep`` / ``gated_norm``
(what the CPU tests of the device control flow run) equals gdn.py's functions bit for bit and the float64 formulas;
bad shapes raise ValueError.

GPU tests (skipped with strata.backend.cuda.unavailable_reason()); tolerances:
  * prep: q, k, g, beta within rtol 1e-5, atol 1e-6 of float64 (fast-math expf / sqrtf are a few ulp); v exact;
    both ba layouts (qwen3next ssm_ba grouped, qwen35 separate), n = 1, 7, 512, contiguous and strided views;
  * gated_norm: rtol 1e-5, atol 1e-6 of float64; z contiguous or a strided view of a wider projection;
  * prep -> cuda_gdn.recurrent -> gated_norm against the numpy float32 layer (gdn.l2_norm, key-head gather,
    gdn.delta_rule_recurrent, gdn.gated_rms_norm), tiled and grouped key heads, n = 1, 7, 512: output and state
    rel L2 < 1e-4 (f32 rounding over up to 512 sequential updates; an indexing error gives O(1));
  * Qwen3NextModel (qwen35: separate beta / alpha, tiled; qwen3next: ssm_ba, grouped), 101-token prompt in ubatches of
    37: the fused path (no gdn.l2_norm call) vs gdn_mode="chunked" on CUDA (same f16 GEMMs): logits and running state
    rel L2 < 1e-3; vs the CPU backend (f32 GEMM operands): rel L2 < 2e-2.
"""
import numpy as np
import pytest

from strata.backend import cuda as C
from strata.backend.cuda import gdn_prefill as P
from strata.backend.cuda import library as KL
from strata.backend import gdn
from strata.models.registry import load_model

_why = C.unavailable_reason()
gpu = pytest.mark.skipif(_why is not None, reason=f"CUDA backend unavailable: {_why}")

RTOL, ATOL = 1e-5, 1e-6
LAYER_REL_L2 = 1e-4
FUSED_VS_CHUNKED_REL_L2 = 1e-3
CUDA_VS_CPU_REL_L2 = 2e-2
PREP_OUT = ("q", "k", "v", "g", "beta")


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _host(a):
    return np.asarray(a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a)


# ------------------------------------------------------------------ float64 references (gdn.py formulas, _gdn layout)
def ref_prep(y, b, a, A, dt, nk, dk, nv, dv, eps=P.L2_EPS):
    """float64 q, k, v, g, beta; a None: b is ssm_ba (n, 2 nv), split like qwen3next._gdn."""
    y = np.asarray(y, np.float64)
    n, kd, r = y.shape[0], nk * dk, nv // nk
    q = y[:, :kd].reshape(n, nk, dk)
    k = y[:, kd:2 * kd].reshape(n, nk, dk)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
    v = y[:, 2 * kd:].reshape(n, nv, dv)
    if a is None:
        ba = np.asarray(b, np.float64).reshape(n, nk, 2 * r)
        b, a = ba[:, :, :r].reshape(n, nv), ba[:, :, r:].reshape(n, nv)
    b, a = np.asarray(b, np.float64), np.asarray(a, np.float64)
    beta = 1.0 / (1.0 + np.exp(-b))
    x = a + np.asarray(dt, np.float64)
    g = np.asarray(A, np.float64) * np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return q, k, v, g, beta


def ref_gated_norm(o, z, w, eps):
    o, z = np.asarray(o, np.float64), np.asarray(z, np.float64).reshape(o.shape)
    return o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64) * (z / (1.0 + np.exp(-z)))


def _inputs(n, nk, nv, dk, dv, grouped, seed):
    """y (n, conv_dim), b, a (a None when grouped), A, dt: float32; a + dt spans the softplus threshold 20."""
    rng = np.random.default_rng(seed)
    y = (rng.standard_normal((n, 2 * nk * dk + nv * dv)) * 2).astype(np.float32)
    a_lo = rng.uniform(-30, 30, (n, nv)).astype(np.float32)
    b_lo = (rng.standard_normal((n, nv)) * 4).astype(np.float32)
    if grouped:                                           # ssm_ba rows per key head [beta x r, alpha x r]
        r = nv // nk
        ba = np.concatenate([b_lo.reshape(n, nk, r), a_lo.reshape(n, nk, r)], axis=2).reshape(n, 2 * nv)
        b, a = np.ascontiguousarray(ba), None
    else:
        b, a = b_lo, a_lo
    A = (-np.exp(rng.standard_normal(nv))).astype(np.float32)
    dt = rng.standard_normal(nv).astype(np.float32)
    dt[0] = 20.0 - float(a_lo[0, 0]) + 0.25                # one input just above the threshold
    return y, b, a, A, dt


def _assert_close(got, ref, what):
    got = _host(got)
    err = np.abs(got - ref) - RTOL * np.abs(ref)
    assert got.shape == ref.shape and got.dtype == np.float32, what
    assert float(err.max()) <= ATOL, f"{what}: worst excess {float(err.max()):.2e} over atol {ATOL}"


# ------------------------------------------------------------------ CPU: pure logic
@pytest.mark.parametrize("nk,nv", [(2, 4), (4, 4), (3, 12), (16, 32)])
def test_ba_index_matches_gdn_split(nk, nv):
    n, r = 5, nv // nk
    ba = np.random.default_rng(nv).standard_normal((n, 2 * nv)).astype(np.float32)
    bi, ai = P.ba_index(nk, nv, True)
    g = ba.reshape(n, nk, 2 * r)                          # qwen3next._gdn's split of ssm_ba
    assert np.array_equal(ba[:, bi], g[:, :, :r].reshape(n, nv))
    assert np.array_equal(ba[:, ai], g[:, :, r:].reshape(n, nv))
    bi, ai = P.ba_index(nk, nv, False)
    assert np.array_equal(bi, np.arange(nv)) and np.array_equal(ai, np.arange(nv))
    for bad in ((3, 4), (0, 4), (2, 0)):
        with pytest.raises(ValueError, match="value heads"):
            P.ba_index(*bad, True)


def test_row_stride_of_arrays_and_views():
    def rs(a):
        return P.row_stride(a.shape, a.strides, a.itemsize)

    big = np.zeros((6, 40), np.float32)
    assert rs(np.zeros((5, 8), np.float32)) == 8
    assert rs(big[:, 3:11]) == 40                         # a slice of a fused projection
    assert rs(big[:, 8:24].reshape(6, 4, 4)) == 40        # (n, heads, d) view of it
    assert rs(big[2:3, 5:9]) == 4                         # one row: its width, whatever the stride
    assert rs(np.zeros((5, 3, 8), np.float32)) == 24
    assert rs(big[::2, :10]) == 80
    assert rs(big[:, ::2]) is None                        # elements apart inside a row
    assert rs(big[:, :8].T) is None
    assert rs(big[::-1]) is None
    assert rs(np.lib.stride_tricks.as_strided(big, (6, 8), (16, 4))) is None   # overlapping rows
    assert rs(np.zeros(5, np.float32)) is None


@pytest.mark.parametrize("grouped", [True, False])
def test_numpy_form_equals_gdn_functions_and_float64(grouped):
    nk, nv, dk, dv, n = 2, 6, 16, 8, 9
    y, b, a, A, dt = _inputs(n, nk, nv, dk, dv, grouped, seed=11)
    q, k, v, g, beta = P.prep(y, b, a, A, dt, nk, dk, dv)
    kd, r = nk * dk, nv // nk
    # bit for bit what qwen3next._gdn's array code computes
    assert np.array_equal(q, gdn.l2_norm(y[:, :kd].reshape(n, nk, dk)))
    assert np.array_equal(k, gdn.l2_norm(y[:, kd:2 * kd].reshape(n, nk, dk)))
    assert np.array_equal(v, y[:, 2 * kd:].reshape(n, nv, dv)) and v.flags.c_contiguous
    if grouped:
        bb, aa = b.reshape(n, nk, 2 * r)[:, :, :r].reshape(n, nv), b.reshape(n, nk, 2 * r)[:, :, r:].reshape(n, nv)
    else:
        bb, aa = b, a
    assert np.array_equal(beta, gdn.sigmoid(bb).astype(np.float32))
    assert np.array_equal(g, (A * gdn.softplus(aa + dt)).astype(np.float32))
    for got, ref, what in zip((q, k, v, g, beta), ref_prep(y, b, a, A, dt, nk, dk, nv, dv), PREP_OUT):
        _assert_close(got, ref, what)
    o = np.random.default_rng(3).standard_normal((n, nv, dv)).astype(np.float32)
    z = np.random.default_rng(4).standard_normal((n, nv * dv)).astype(np.float32)
    w = np.random.default_rng(5).standard_normal(dv).astype(np.float32)
    out = P.gated_norm(o, z, w, 1e-6)
    assert np.array_equal(out, gdn.gated_rms_norm(o, w, z.reshape(n, nv, dv), 1e-6))
    _assert_close(out, ref_gated_norm(o, z, w, 1e-6), "gated_norm")


def test_bad_shapes_raise_value_error():
    nk, nv, dk, dv, n = 2, 4, 16, 8, 3
    y, b, a, A, dt = _inputs(n, nk, nv, dk, dv, False, seed=1)
    yg, ba, _, _, _ = _inputs(n, nk, nv, dk, dv, True, seed=1)
    with pytest.raises(ValueError, match="y: shape"):
        P.prep(y[:, 1:], b, a, A, dt, nk, dk, dv)
    with pytest.raises(ValueError, match="ba: shape"):
        P.prep(yg, ba[:, 1:], None, A, dt, nk, dk, dv)
    with pytest.raises(ValueError, match="alpha projection"):
        P.prep(y, b, a[:2], A, dt, nk, dk, dv)
    with pytest.raises(ValueError, match="dt: shape"):
        P.prep(y, b, a, A, dt[:3], nk, dk, dv)
    with pytest.raises(ValueError, match="A has shape"):
        P.prep(y, b, a, A[None], dt, nk, dk, dv)
    with pytest.raises(ValueError, match="value heads"):
        P.prep(y, b, a, A, dt, 3, dk, dv)
    with pytest.raises(ValueError, match="d_k"):
        P.prep(y, b, a, A, dt, nk, 0, dv)
    o = np.zeros((n, nv, dv), np.float32)
    with pytest.raises(ValueError, match="o has shape"):
        P.gated_norm(o[0], o[0], np.ones(dv, np.float32), 1e-6)
    with pytest.raises(ValueError, match="z has shape"):
        P.gated_norm(o, o[:, :, 1:], np.ones(dv, np.float32), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        P.gated_norm(o, o, np.ones(dv + 1, np.float32), 1e-6)


# ------------------------------------------------------------------ GPU: kernels
@gpu
@pytest.mark.parametrize("n", [1, 7, 512])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("nk,nv,dk,dv", [(2, 4, 16, 16), (16, 32, 128, 128), (3, 6, 40, 24)])
def test_prep_kernel_matches_float64(n, grouped, nk, nv, dk, dv):
    import cupy as cp
    y, b, a, A, dt = _inputs(n, nk, nv, dk, dv, grouped, seed=n + nv + grouped)
    ref = ref_prep(y, b, a, A, dt, nk, dk, nv, dv)
    got = P.prep(cp.asarray(y), cp.asarray(b), None if a is None else cp.asarray(a), cp.asarray(A), cp.asarray(dt),
                 nk, dk, dv)
    assert all(isinstance(x, cp.ndarray) and x.flags.c_contiguous for x in got)
    for g_, r_, what in zip(got, ref, PREP_OUT):
        _assert_close(g_, r_, f"{what} n={n} grouped={grouped}")
    assert np.array_equal(got[2].get(), y[:, 2 * nk * dk:].reshape(n, nv, dv))


@gpu
@pytest.mark.parametrize("n", [1, 7, 512])
@pytest.mark.parametrize("grouped", [True, False])
def test_prep_kernel_on_strided_views(n, grouped):
    """y a column slice of a wider buffer; b, a views into one fused projection (one row stride)."""
    import cupy as cp
    nk, nv, dk, dv = 4, 8, 32, 24
    y, b, a, A, dt = _inputs(n, nk, nv, dk, dv, grouped, seed=40 + n)
    ref = ref_prep(y, b, a, A, dt, nk, dk, nv, dv)
    cd = y.shape[1]
    wide = cp.zeros((n, cd + 13), cp.float32)
    wide[:, 5:5 + cd] = cp.asarray(y)
    bw = b.shape[1] + (0 if a is None else a.shape[1])
    proj = cp.full((n, bw + 7), cp.nan, cp.float32)       # columns the kernel must not read are NaN
    proj[:, 3:3 + b.shape[1]] = cp.asarray(b)
    bv = proj[:, 3:3 + b.shape[1]]
    av = None
    if a is not None:
        proj[:, 3 + nv:3 + 2 * nv] = cp.asarray(a)
        av = proj[:, 3 + nv:3 + 2 * nv]
    got = P.prep(wide[:, 5:5 + cd], bv, av, cp.asarray(A), cp.asarray(dt), nk, dk, dv)
    for g_, r_, what in zip(got, ref, PREP_OUT):
        _assert_close(g_, r_, f"{what} (views) n={n} grouped={grouped}")


@gpu
@pytest.mark.parametrize("n", [1, 7, 512])
@pytest.mark.parametrize("nh,d", [(4, 16), (32, 128), (3, 40)])
@pytest.mark.parametrize("z_view", [False, True])
def test_gated_norm_kernel_matches_float64(n, nh, d, z_view):
    import cupy as cp
    rng = np.random.default_rng(n * nh + d)
    o = (rng.standard_normal((n, nh, d)) * 3).astype(np.float32)
    z = (rng.standard_normal((n, nh * d)) * 4).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    ref = ref_gated_norm(o, z, w, 1e-6)
    if z_view:                                            # z inside a fused projection, NaN around it
        proj = cp.full((n, nh * d + 9), cp.nan, cp.float32)
        proj[:, 4:4 + nh * d] = cp.asarray(z)
        zd = proj[:, 4:4 + nh * d]
    else:
        zd = cp.asarray(z).reshape(n, nh, d)
    out = P.gated_norm(cp.asarray(o), zd, cp.asarray(w), 1e-6)
    assert isinstance(out, cp.ndarray) and out.flags.c_contiguous
    _assert_close(out, ref, f"gated_norm n={n} nh={nh} d={d} view={z_view}")


@gpu
@pytest.mark.parametrize("n", [1, 300])
def test_gated_norm_rows_f16_output(n):
    """strata_gdn_gated_norm_rows' f16 output (the prefill plan's GEMM input) is the f32 output rounded to nearest;
    with both outputs NULL it returns an error and writes nothing."""
    import cupy as cp
    lb = KL.lib()
    nh, d = 4, 64
    rng = np.random.default_rng(n)
    o = cp.asarray(rng.standard_normal((n, nh, d)).astype(np.float32))
    z = cp.asarray(rng.standard_normal((n, nh * d)).astype(np.float32))
    w = cp.asarray(rng.standard_normal(d).astype(np.float32))
    out = cp.zeros((n, nh, d), cp.float32)
    out16 = cp.zeros((n, nh, d), cp.float16)
    s = KL.stream_ptr()
    assert lb.strata_gdn_gated_norm_rows(s, KL.ptr(o), KL.ptr(z), nh * d, nh, KL.ptr(w), KL.ptr(out), KL.ptr(out16), n * nh, d,
                                         1e-6) == 0
    _assert_close(out, ref_gated_norm(o.get(), z.get(), w.get(), 1e-6), "gated_norm f32 beside f16")
    assert cp.array_equal(out16, out.astype(cp.float16))
    before = out16.copy()
    assert lb.strata_gdn_gated_norm_rows(s, KL.ptr(o), KL.ptr(z), nh * d, nh, KL.ptr(w), KL.ffi().NULL, KL.ffi().NULL, n * nh,
                                         d, 1e-6) != 0
    assert cp.array_equal(out16, before)


@gpu
@pytest.mark.parametrize("n", [1, 7, 512])
@pytest.mark.parametrize("tiled,grouped", [(True, False), (False, True), (True, True), (False, False)])
def test_prep_recurrent_gated_norm_match_numpy_layer(n, tiled, grouped):
    """The device GDN layer core (prep -> recurrent kernel -> gated_norm) vs the numpy float32 layer of _gdn."""
    import cupy as cp

    from strata.backend.cuda import gdn as cuda_gdn
    nk, nv, dk, dv = 2, 6, 32, 16
    y, b, a, A, dt = _inputs(n, nk, nv, dk, dv, grouped, seed=90 + n)
    y *= 0.5
    rng = np.random.default_rng(n)
    z = rng.standard_normal((n, nv * dv)).astype(np.float32)
    w = rng.standard_normal(dv).astype(np.float32)
    s0 = (rng.standard_normal((nv, dk, dv)) * 0.1).astype(np.float32)
    kd, r = nk * dk, nv // nk
    if grouped:
        g3 = b.reshape(n, nk, 2 * r)
        bb, aa = g3[:, :, :r].reshape(n, nv), g3[:, :, r:].reshape(n, nv)
    else:
        bb, aa = b, a
    kmap = np.arange(nv) % nk if tiled else np.arange(nv) // r
    q = gdn.l2_norm(y[:, :kd].reshape(n, nk, dk))[:, kmap]
    k = gdn.l2_norm(y[:, kd:2 * kd].reshape(n, nk, dk))[:, kmap]
    s_ref = s0.copy()
    o_ref, _ = gdn.delta_rule_recurrent(q, k, np.ascontiguousarray(y[:, 2 * kd:].reshape(n, nv, dv)),
                                        (A * gdn.softplus(aa + dt)).astype(np.float32),
                                        gdn.sigmoid(bb).astype(np.float32), s_ref)
    out_ref = gdn.gated_rms_norm(o_ref, w, z.reshape(n, nv, dv), 1e-6)
    s_d = cp.asarray(s0)
    qd, kd_, vd, gd, bd = P.prep(cp.asarray(y), cp.asarray(b), None if a is None else cp.asarray(a), cp.asarray(A),
                                 cp.asarray(dt), nk, dk, dv)
    o_d, _ = cuda_gdn.recurrent(qd, kd_, vd, gd, bd, s_d, tiled=tiled)
    out = P.gated_norm(o_d, cp.asarray(z), cp.asarray(w), 1e-6)
    eo, es = rel_l2(out.get(), out_ref), rel_l2(s_d.get(), s_ref)
    print(f"layer n={n} tiled={tiled} grouped={grouped}: out rel L2 {eo:.2e}, state rel L2 {es:.2e}")
    assert eo < LAYER_REL_L2 and es < LAYER_REL_L2


# ------------------------------------------------------------------ GPU: the model's fused path
@pytest.fixture(scope="module", params=["qwen35", "qwen3next"])
def models(request, synthetic):
    if _why is not None:
        pytest.skip(f"CUDA backend unavailable: {_why}")
    from strata.gguf.default_model import default_model_path
    try:
        default_model_path()
    except Exception as e:  # noqa: BLE001  (the synthetic file copies the default model's tokenizer)
        pytest.skip(f"synthetic models need the default model's tokenizer: {e}")
    path = synthetic(request.param, seed=23, n_mtp=0)
    return load_model(path), load_model(path, C.CudaBackend())


@gpu
def test_model_fused_prefill_matches_chunked_and_cpu(models, monkeypatch):
    import cupy as cp
    cpu, cuda = models
    toks = np.random.default_rng(8).integers(0, cpu.config.n_vocab, 101).astype(np.int32)

    def prefill(m, mode):
        m.gdn_mode = mode
        try:
            st = m.new_state(m.new_page_pool(256))
            out = np.concatenate([_host(m.forward(toks[s:s + 37], st, all_logits=True)) for s in range(0, 101, 37)])
        finally:
            m.gdn_mode = "auto"
        return out, st

    calls = {"prep": 0, "l2": 0}
    prep, l2 = P.prep, gdn.l2_norm

    def prep_spy(*a, **k):
        calls["prep"] += 1
        return prep(*a, **k)

    def l2_spy(*a, **k):
        calls["l2"] += 1
        return l2(*a, **k)

    monkeypatch.setattr(P, "prep", prep_spy)
    monkeypatch.setattr(gdn, "l2_norm", l2_spy)
    fused, sf = prefill(cuda, "auto")
    assert calls == {"prep": 3 * sum(cuda.recurrent), "l2": 0}   # 3 ubatches, every GDN layer fused
    chunked, sc = prefill(cuda, "chunked")
    ref, sr = prefill(cpu, "auto")
    e_ch, e_cpu = rel_l2(fused, chunked), rel_l2(fused, ref)
    print(f"{cpu.variant}: fused vs chunked (CUDA) logits rel L2 {e_ch:.2e}, vs CPU {e_cpu:.2e}")
    assert np.isfinite(fused).all()
    assert e_ch < FUSED_VS_CHUNKED_REL_L2 and e_cpu < CUDA_VS_CPU_REL_L2
    for layer in sr.running:
        for name in ("conv", "ssm"):
            a = sf.running[layer][name]
            assert isinstance(a, cp.ndarray) and a.dtype == cp.float32
            e1, e2 = rel_l2(a.get(), _host(sc.running[layer][name])), rel_l2(a.get(), sr.running[layer][name])
            print(f"  layer {layer} {name}: vs chunked {e1:.2e}, vs CPU {e2:.2e}")
            assert e1 < FUSED_VS_CHUNKED_REL_L2 and e2 < CUDA_VS_CPU_REL_L2
    for st in (sf, sc, sr):
        st.release()
