"""The CUDA short read (DecodePlan.short_read, native/cuda/matvec_cols.cu): n = 2..16 new tokens of one sequence as the
decode step over n columns, row i bit-identical to decoding token i alone after rows 0..i-1. The reference is the
decode step itself (plan.decode, one token at a time), an independent path: its kernels were checked against numpy,
transformers and the CPU backend by tests/test_cuda_kernels.py, test_cuda_parity.py and test_cuda_qwen35.py. Kernel
level: every column launcher against the decode launcher it mirrors, column by column, for every dp4a weight type
(bit for bit: y, residual stream, handed-off q8_1 blocks and sums, K/V cache, SwiGLU output and its q8_1 blocks),
and every rows launcher (attention, RMSNorm, SwiGLU, RoPE + K/V write, the norm handoff, the hybrid's conv, GDN
step, gated norm and output gate) against the one-row decode launcher row by row, token by token where the rows run
in order. Model level: the default model (SmolLM2, llama: the handoff form, the separate-launch form, the fused-norm
form's stepping fallback, a q8_0 KV cache) and a synthetic qwen35 hybrid (Q8_0 and F16 weights, f16 and q8_0
caches), chains of short reads n = 2..16 from depths 0, 200 and 2000 (crossing the 256 and 2048 context-size classes
inside a read, where the rows' attention splits and kernels differ): every row's logits, every layer's K/V pages and
the GDN running state equal. Skipped without a GPU."""
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.gguf import synth
from strata.backend import cuda as C
from strata.backend.cuda import library as KL
from strata.backend.cuda import settings as S

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cuda_marks import CUDA_WHY as _why  # noqa: E402
from tests.cuda_marks import default_model_missing, gpu  # noqa: E402
from tests.cuda_marks import host as _host  # noqa: E402

pytestmark = pytest.mark.skipif(_why is not None, reason=f"CUDA backend unavailable: {_why}")
_no_model = default_model_missing()

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
COLS = (1, 2, 3, 7, 8, 9, 16)   # every compiled column count of the register tiles (2, 4, 8, 16) and past it


# ------------------------------------------------------------------ kernels
def _setup_kernels():
    import cupy
    from gguf import GGMLQuantizationType as Q
    from strata.backend.cuda import weights as CW
    from tests.helpers import random_blocks
    return cupy, Q, CW, random_blocks


def _q8_one(cp, x):
    """x f32 (n,) -> a q8_1 buffer as strata_quantize_q8_1 writes it (n + n // 4 bytes)."""
    xq = cp.zeros(x.size + x.size // 4, cp.uint8)
    dx = cp.asarray(x, dtype=cp.float32)
    KL.check(KL.lib().strata_quantize_q8_1(KL.stream_ptr(), KL.ptr(dx), KL.ptr(xq), x.size), "quantize")
    return xq


def _q8_cols(cp, X):
    """X f32 (n, k) -> the column layout of matvec_cols.cu: (n, strata_q8_col_bytes(k)) uint8, each row quantized by
    strata_quantize_q8_1."""
    n, k = X.shape
    nb = int(KL.lib().strata_q8_col_bytes(k))
    buf = cp.zeros((n, nb), cp.uint8)
    for i in range(n):
        buf[i, :k + k // 4] = _q8_one(cp, X[i])
    return buf


def _vp(a, byte_off=0):
    return KL.addr(a.data.ptr + byte_off)


@gpu
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("kind", ["q8w", "q8b"])
def test_cols_matvec_equals_decode_matvec(t, kind):
    """strata_mvc_q8w / _q8b column c == strata_matvec_q8w / _q8b on column c (rows per warp / block 1 and 2),
    into a wider output (y_stride > n_out, an offset): bit for bit."""
    cp, Q, CW, random_blocks = _setup_kernels()
    qt = getattr(Q, t)
    rng = np.random.default_rng(7 + int(qt))
    n_out, n_in = 1029, 1024
    w = CW.upload_raw("w", int(qt), (n_out, n_in), random_blocks(qt, n_out, n_in, rng))
    lb, s = KL.lib(), KL.stream_ptr()
    for n in COLS:
        X = rng.standard_normal((n, n_in)).astype(np.float32)
        ys = n_out + 40
        y = cp.full((n, ys), cp.nan, cp.float32)
        KL.check(getattr(lb, f"strata_mvc_{kind}")(s, int(qt), KL.ptr(w.data), _vp(_q8_cols(cp, X)), _vp(y, 4 * 8),
                                                   ys, n_out, n_in, n), kind)
        got = cp.asnumpy(y)
        assert np.isnan(got[:, :8]).all() and np.isnan(got[:, 8 + n_out:]).all()    # nothing outside written
        for rows in (1, 2):
            for c in range(n):
                ref = cp.full(n_out, cp.nan, cp.float32)
                KL.check(getattr(lb, f"strata_matvec_{kind}")(s, int(qt), KL.ptr(w.data), KL.ptr(_q8_one(cp, X[c])),
                                                              KL.ptr(ref), n_out, n_in, rows), kind)
                np.testing.assert_array_equal(got[c, 8:8 + n_out], cp.asnumpy(ref), err_msg=f"{t} n={n} col {c}")


@gpu
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("block", [0, 1])
@pytest.mark.parametrize("handoff", [True, False])
def test_cols_resid_equals_decode_resid(t, block, handoff):
    """strata_mvc_q8_resid == strata_matvec_q8_resid per column: the residual stream, and with the norm handoff each
    column's q8_1(x * w) blocks and group sums of x^2; the shared counters are left zero."""
    cp, Q, CW, random_blocks = _setup_kernels()
    qt = getattr(Q, t)
    rng = np.random.default_rng(11 + int(qt) + 2 * block)
    n_out, n_in = 1024, 2048
    w = CW.upload_raw("w", int(qt), (n_out, n_in), random_blocks(qt, n_out, n_in, rng))
    nw = cp.asarray(rng.uniform(0.5, 1.5, n_out).astype(np.float32))
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    nb = int(lb.strata_q8_col_bytes(n_out))
    for n in COLS:
        X = rng.standard_normal((n, n_in)).astype(np.float32)
        x0 = rng.standard_normal((n, n_out)).astype(np.float32)
        x = cp.asarray(x0)
        xq, ss = cp.zeros((n, nb), cp.uint8), cp.zeros((n, n_out // 32), cp.float32)
        cnt = cp.zeros(n_out // 32, cp.uint32)
        KL.check(lb.strata_mvc_q8_resid(s, int(qt), KL.ptr(w.data), _vp(_q8_cols(cp, X)), n_out, n_in, n, block,
                                        KL.ptr(x), KL.ptr(nw) if handoff else N, _vp(xq), KL.ptr(ss),
                                        KL.ffi().cast("unsigned *", cnt.data.ptr)), "mvc_resid")
        assert int(cnt.sum()) == 0
        for c in range(n):
            xr = cp.asarray(x0[c])
            xq1, ss1 = cp.zeros(n_out + n_out // 4, cp.uint8), cp.zeros(n_out // 32, cp.float32)
            cnt1 = cp.zeros(n_out // 32, cp.uint32)
            KL.check(lb.strata_matvec_q8_resid(s, int(qt), KL.ptr(w.data), KL.ptr(_q8_one(cp, X[c])), n_out, n_in, 1,
                                               block, KL.ptr(xr), KL.ptr(nw) if handoff else N, KL.ptr(xq1),
                                               KL.ptr(ss1), KL.ffi().cast("unsigned *", cnt1.data.ptr)), "resid")
            np.testing.assert_array_equal(cp.asnumpy(x[c]), cp.asnumpy(xr))
            if handoff:
                np.testing.assert_array_equal(cp.asnumpy(xq[c, :n_out + n_out // 4]), cp.asnumpy(xq1))
                np.testing.assert_array_equal(cp.asnumpy(ss[c]), cp.asnumpy(ss1))


@gpu
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("handoff", [True, False])
@pytest.mark.parametrize("n_rot", [64, 16])
def test_cols_rope_equals_decode_rope(t, handoff, n_rot):
    """strata_mvc_q8w_rope == strata_matvec_q8w_rope per column at positions p0 + c (across a page boundary):
    q|k|v rows and the K / V cache (every column's position written, nothing else), with and without a handed-off
    input norm."""
    cp, Q, CW, random_blocks = _setup_kernels()
    qt = getattr(Q, t)
    rng = np.random.default_rng(13 + int(qt) + n_rot)
    H, KV, hd, n_in, ps, n_pages, p0, eps = 9, 3, 64, 1024, 16, 6, 9, 1e-5
    n_out = (H + 2 * KV) * hd
    w = CW.upload_raw("w", int(qt), (n_out, n_in), random_blocks(qt, n_out, n_in, rng))
    table = cp.asarray(rng.permutation(n_pages).astype(np.int32))
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    for n in COLS:
        X = rng.standard_normal((n, n_in)).astype(np.float32)
        ssv = cp.asarray(rng.uniform(0.5, 2.0, (n, n_in // 32)).astype(np.float32))
        pos = cp.asarray((p0 + np.arange(n)).astype(np.int32))
        qkv = cp.full((n, n_out), cp.nan, cp.float32)
        kc, vc = (cp.zeros((n_pages, ps, KV, hd), cp.float16) for _ in range(2))
        KL.check(lb.strata_mvc_q8w_rope(s, int(qt), KL.ptr(w.data), _vp(_q8_cols(cp, X)), KL.ptr(qkv), H, KV, hd,
                                        n_in, n, KL.ptr(pos), KL.ptr(kc), KL.ptr(vc), KL.ptr(table), 0, n_rot, 10000.0,
                                        ps, eps, KL.ptr(ssv) if handoff else N), "mvc_rope")
        kr, vr = (cp.zeros((n_pages, ps, KV, hd), cp.float16) for _ in range(2))
        for c in range(n):
            q1 = cp.full(n_out, cp.nan, cp.float32)
            KL.check(lb.strata_matvec_q8w_rope(s, int(qt), KL.ptr(w.data), KL.ptr(_q8_one(cp, X[c])), KL.ptr(q1), H,
                                               KV, hd, n_in, 4, KL.ptr(pos[c:c + 1]), KL.ptr(kr), KL.ptr(vr),
                                               KL.ptr(table), n_rot, 10000.0, ps, N, N, N, N, eps, 0,
                                               KL.ptr(ssv[c]) if handoff else N), "rope")
            np.testing.assert_array_equal(cp.asnumpy(qkv[c]), cp.asnumpy(q1), err_msg=f"{t} n={n} col {c}")
        np.testing.assert_array_equal(cp.asnumpy(kc), cp.asnumpy(kr))
        np.testing.assert_array_equal(cp.asnumpy(vc), cp.asnumpy(vr))


@gpu
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("handoff", [True, False])
def test_cols_glu_equals_decode_glu(t, handoff):
    """strata_mvc_q8w_glu == strata_matvec_q8w_glu_norm per column (pairs per warp 1 and 4): f32 activations and
    their q8_1 blocks, with and without a handed-off input norm."""
    cp, Q, CW, random_blocks = _setup_kernels()
    qt = getattr(Q, t)
    rng = np.random.default_rng(17 + int(qt))
    F, n_in, eps = 1536, 1024, 1e-5
    wgu = CW.upload_raw("gu", int(qt), (2 * F, n_in), random_blocks(qt, 2 * F, n_in, rng))
    gp = wgu.data.data.ptr
    up = gp + F * wgu.data.shape[1]
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    nb = int(lb.strata_q8_col_bytes(F))
    for n in COLS:
        X = rng.standard_normal((n, n_in)).astype(np.float32)
        ssv = cp.asarray(rng.uniform(0.5, 2.0, (n, n_in // 32)).astype(np.float32))
        act, aq = cp.full((n, F), cp.nan, cp.float32), cp.zeros((n, nb), cp.uint8)
        KL.check(lb.strata_mvc_q8w_glu(s, int(qt), KL.addr(gp), KL.addr(up), _vp(_q8_cols(cp, X)), KL.ptr(act),
                                       _vp(aq), F, n_in, n, eps, KL.ptr(ssv) if handoff else N), "mvc_glu")
        for rp in (1, 4):
            for c in range(n):
                a1, q1 = cp.full(F, cp.nan, cp.float32), cp.zeros(F + F // 4, cp.uint8)
                KL.check(lb.strata_matvec_q8w_glu_norm(s, int(qt), KL.addr(gp), KL.addr(up), KL.ptr(_q8_one(cp, X[c])),
                                                       KL.ptr(a1), KL.ptr(q1), F, n_in, rp, N, N, N, N, eps,
                                                       KL.ptr(ssv[c]) if handoff else N), "glu")
                np.testing.assert_array_equal(cp.asnumpy(act[c]), cp.asnumpy(a1), err_msg=f"{t} n={n} col {c}")
                np.testing.assert_array_equal(cp.asnumpy(aq[c, :F + F // 4]), cp.asnumpy(q1))


@gpu
@pytest.mark.parametrize("kind,kv", [("v1", "f16"), ("v2", "f16"), ("v2", "q8_0")])
@pytest.mark.parametrize("hd,H,KV", [(64, 9, 3), (128, 16, 2)])
def test_attn_rows_equal_decode_attention(kind, kv, hd, H, KV):
    """strata_attn_rows / _rows_gqa row r == strata_attn_decode_ex (with counters) / strata_attn_decode_gqa on row r
    alone with the same split: f32 output and q8_1 blocks, lengths p0 + r + 1 across a page boundary, 1 to 16 rows,
    one and several splits; the counters are left zero."""
    cp = _setup_kernels()[0]
    rng = np.random.default_rng(hd + H + (kind == "v2") + (kv == "q8_0"))
    ps, n_pages = 16, 40
    q8 = kv == "q8_0"
    if q8:
        kc, vc = (cp.asarray(rng.integers(-127, 128, (n_pages, ps, KV, hd)).astype(np.int8)) for _ in range(2))
        ks, vs = (cp.asarray(rng.uniform(1e-3, 2e-2, n_pages * ps * KV * hd // 32).astype(np.float16))
                  for _ in range(2))
    else:
        kc, vc = (cp.asarray(rng.standard_normal((n_pages, ps, KV, hd)).astype(np.float16)) for _ in range(2))
        ks = vs = None
    table = cp.asarray(rng.permutation(n_pages).astype(np.int32))
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    nq = H * hd
    W = nq + 2 * KV * hd
    nb = int(lb.strata_q8_col_bytes(nq))
    ws = H * 64 * (hd + 2)
    cs = max(64, H)
    u32 = lambda a, off=0: KL.ffi().cast("unsigned *", a.data.ptr + 4 * off)  # noqa: E731
    for n, p0, n_split in ((1, 40, 1), (5, 200, 4), (16, 500, 17), (16, 0, 1)):
        qkv = cp.asarray(rng.standard_normal((n, W)).astype(np.float32))
        lens = cp.asarray((p0 + 1 + np.arange(n)).astype(np.int32))
        part, ctr = cp.zeros((n, ws), cp.float32), cp.zeros((n, cs), cp.uint32)
        out, oq = cp.full((n, nq), cp.nan, cp.float32), cp.zeros((n, nb), cp.uint8)
        if kind == "v1":
            KL.check(lb.strata_attn_rows(s, KL.ptr(qkv), W, KL.ptr(kc), KL.ptr(vc), KL.ptr(table), 0, KL.ptr(lens),
                                         KL.ptr(part), ws, KL.ptr(out), nq, _vp(oq), nb, u32(ctr), cs, n, H, KV, hd,
                                         ps, n_split, 0.125), "attn_rows")
        else:
            KL.check(lb.strata_attn_rows_gqa(s, KL.ptr(qkv), W, KL.ptr(kc), KL.ptr(vc), KL.ptr(table), 0, KL.ptr(lens),
                                             KL.ptr(part), ws, u32(ctr), cs, KL.ptr(out), nq, _vp(oq), nb, n, H, KV,
                                             hd, ps, n_split, 0.125, KL.ptr(ks) if q8 else N,
                                             KL.ptr(vs) if q8 else N), "attn_rows_gqa")
        assert int(ctr.sum()) == 0
        for r in range(n):
            p1, c1 = cp.zeros(ws, cp.float32), cp.zeros(cs, cp.uint32)
            o1, q1 = cp.full(nq, cp.nan, cp.float32), cp.zeros(nq + nq // 4, cp.uint8)
            if kind == "v1":
                KL.check(lb.strata_attn_decode_ex(s, KL.ptr(qkv[r]), KL.ptr(kc), KL.ptr(vc), KL.ptr(table),
                                                  KL.ptr(lens[r:r + 1]), 0, KL.ptr(p1), KL.ptr(o1), KL.ptr(q1), u32(c1),
                                                  0, H, KV, hd, ps, n_split, 0.125), "attn")
            else:
                KL.check(lb.strata_attn_decode_gqa(s, KL.ptr(qkv[r]), KL.ptr(kc), KL.ptr(vc), KL.ptr(table),
                                                   KL.ptr(lens[r:r + 1]), 0, KL.ptr(p1), u32(c1), KL.ptr(o1),
                                                   KL.ptr(q1), H, KV, hd, ps, n_split, 0.125,
                                                   KL.ptr(ks) if q8 else N, KL.ptr(vs) if q8 else N), "attn")
            np.testing.assert_array_equal(cp.asnumpy(out[r]), cp.asnumpy(o1), err_msg=f"n={n} row {r}")
            np.testing.assert_array_equal(cp.asnumpy(oq[r, :nq + nq // 4]), cp.asnumpy(q1))
            assert np.isfinite(cp.asnumpy(o1)).all()


@gpu
@pytest.mark.parametrize("dim", [576, 2048, 5120])
def test_rows_norm_and_swiglu_equal_one_row(dim):
    """strata_rms_norm_rows (with a residual and sum_out, and without) and strata_swiglu_gu_rows == the one-row
    launchers on each row: f32 outputs, sums and q8_1 blocks, bit for bit."""
    cp = _setup_kernels()[0]
    rng = np.random.default_rng(dim)
    lb, s, N = KL.lib(), KL.stream_ptr(), KL.ffi().NULL
    nb = int(lb.strata_q8_col_bytes(dim))
    w = cp.asarray(rng.uniform(0.5, 1.5, dim).astype(np.float32))
    for n in (1, 3, 16):
        X, R = (rng.standard_normal((n, dim)).astype(np.float32) for _ in range(2))
        for with_res in (True, False):
            x, res = cp.asarray(X), cp.asarray(R)
            out, q = cp.full((n, dim), cp.nan, cp.float32), cp.zeros((n, nb), cp.uint8)
            KL.check(lb.strata_rms_norm_rows(s, KL.ptr(x), KL.ptr(res) if with_res else N, KL.ptr(w), KL.ptr(out),
                                             KL.ptr(res) if with_res else N, _vp(q), nb, n, dim, 1e-5), "norm_rows")
            for r in range(n):
                x1, r1 = cp.asarray(X[r]), cp.asarray(R[r])
                o1, q1 = cp.full(dim, cp.nan, cp.float32), cp.zeros(dim + dim // 4, cp.uint8)
                KL.check(lb.strata_rms_norm_ex(s, KL.ptr(x1), KL.ptr(r1) if with_res else N, KL.ptr(w), KL.ptr(o1),
                                               KL.ptr(r1) if with_res else N, N, KL.ptr(q1), 1, dim, 1e-5), "norm")
                np.testing.assert_array_equal(cp.asnumpy(out[r]), cp.asnumpy(o1))
                np.testing.assert_array_equal(cp.asnumpy(q[r, :dim + dim // 4]), cp.asnumpy(q1))
                np.testing.assert_array_equal(cp.asnumpy(res[r]), cp.asnumpy(r1))
        G = rng.standard_normal((n, 2 * dim)).astype(np.float32)
        gu = cp.asarray(G)
        act, aq = cp.full((n, dim), cp.nan, cp.float32), cp.zeros((n, nb), cp.uint8)
        KL.check(lb.strata_swiglu_gu_rows(s, KL.ptr(gu), n, dim, KL.ptr(act), _vp(aq), nb), "swiglu_rows")
        for r in range(n):
            a1, q1 = cp.full(dim, cp.nan, cp.float32), cp.zeros(dim + dim // 4, cp.uint8)
            KL.check(lb.strata_swiglu_gu(s, KL.ptr(cp.asarray(G[r])), 1, dim, KL.ptr(a1), N, KL.ptr(q1)), "swiglu")
            np.testing.assert_array_equal(cp.asnumpy(act[r]), cp.asnumpy(a1))
            np.testing.assert_array_equal(cp.asnumpy(aq[r, :dim + dim // 4]), cp.asnumpy(q1))
    bad = cp.zeros((2, nb), cp.uint8)
    assert lb.strata_rms_norm_rows(s, KL.ptr(w), N, KL.ptr(w), N, N, _vp(bad), dim, 2, dim, 1e-5) != 0   # stride
    assert lb.strata_rms_norm_ex(s, KL.ptr(w), N, KL.ptr(w), N, N, N, _vp(bad), 2, dim, 1e-5) != 0       # one row


@gpu
@pytest.mark.parametrize("nk,nv,dk,dv,tiled,grouped", [(2, 4, 64, 64, 1, 0), (1, 2, 128, 128, 0, 1),
                                                       (4, 4, 32, 96, 0, 0)])
def test_gdn_rows_equal_token_by_token(nk, nv, dk, dv, tiled, grouped):
    """strata_q35_conv_rows, strata_q35_gdn_steps and strata_q35_gated_norm_rows over n tokens == strata_q35_conv /
    _gdn_step / _gated_norm one token at a time: outputs, q8_1 blocks, the conv window and the ssm state after every
    token count, bit for bit."""
    cp = _setup_kernels()[0]
    rng = np.random.default_rng(nk * 100 + dv)
    lb, s = KL.lib(), KL.stream_ptr()
    conv_dim, vdim, K = 2 * nk * dk + nv * dv, nv * dv, 4
    P = conv_dim + vdim + 2 * nv
    b_off, a_off = conv_dim + vdim, conv_dim + vdim + nv
    w = cp.asarray(rng.standard_normal((conv_dim, K)).astype(np.float32) * 0.5)
    A = cp.asarray(-rng.uniform(0.1, 1.0, nv).astype(np.float32))
    dt = cp.asarray(rng.standard_normal(nv).astype(np.float32))
    nw = cp.asarray(rng.uniform(0.5, 1.5, dv).astype(np.float32))
    scale = float(1.0 / dk ** 0.5)
    nb = int(lb.strata_q8_col_bytes(vdim))
    for n in (1, 2, 7, 16):
        proj = cp.asarray(rng.standard_normal((n, P)).astype(np.float32))
        win0 = rng.standard_normal((K - 1, conv_dim)).astype(np.float32)
        st0 = (rng.standard_normal((nv, dk, dv)) * 0.1).astype(np.float32)
        outs = []
        for rows in (True, False):
            win, st = cp.asarray(win0), cp.asarray(st0)
            y, ov = cp.zeros((n, conv_dim), cp.float32), cp.zeros((n, vdim), cp.float32)
            vn, vq = cp.zeros((n, vdim), cp.float32), cp.zeros((n, nb), cp.uint8)
            zp = KL.addr(proj.data.ptr + 4 * conv_dim)
            if rows:
                KL.check(lb.strata_q35_conv_rows(s, KL.ptr(proj), P, KL.ptr(w), KL.ptr(win), KL.ptr(y), conv_dim, n,
                                                 conv_dim, K), "conv_rows")
                KL.check(lb.strata_q35_gdn_steps(s, KL.ptr(y), conv_dim, KL.ptr(proj), P, KL.ptr(A), KL.ptr(dt),
                                                 KL.ptr(st), KL.ptr(ov), vdim, n, nv, nk, dk, dv, tiled, b_off,
                                                 a_off, grouped, scale, 1e-6), "gdn_steps")
                KL.check(lb.strata_q35_gated_norm_rows(s, KL.ptr(ov), vdim, zp, P, KL.ptr(nw), KL.ptr(vn), vdim,
                                                       _vp(vq), nb, n, nv, dv, 1e-5), "gated_norm_rows")
            else:
                for t in range(n):
                    KL.check(lb.strata_q35_conv(s, KL.ptr(proj[t]), KL.ptr(w), KL.ptr(win), KL.ptr(y[t]), conv_dim,
                                                K), "conv")
                    KL.check(lb.strata_q35_gdn_step(s, KL.ptr(y[t]), KL.ptr(proj[t]), KL.ptr(A), KL.ptr(dt),
                                                    KL.ptr(st), KL.ptr(ov[t]), nv, nk, dk, dv, tiled, b_off, a_off,
                                                    grouped, scale, 1e-6), "gdn_step")
                    KL.check(lb.strata_q35_gated_norm(s, KL.ptr(ov[t]), KL.addr(proj.data.ptr + 4 * (t * P + conv_dim)),
                                                      KL.ptr(nw), KL.ptr(vn[t]), _vp(vq, t * nb), nv, dv, 1e-5),
                             "gated_norm")
            outs.append([cp.asnumpy(a) for a in (y, ov, vn, vq, win, st)])
        for name, a, b in zip(("y", "o", "vn", "vq", "window", "state"), *outs):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} n={n}")
        assert np.isfinite(outs[0][1]).all()


@gpu
@pytest.mark.parametrize("neox,n_rot", [(0, 64), (1, 16)])
def test_rope_rows_out_gate_rows_and_norm_handoff_cols(neox, n_rot):
    """strata_rope_kv_rows == strata_rope_kv_decode row by row (q|k|v and the f16 cache, positions across a page
    boundary); strata_q35_out_gate_rows == strata_q35_out_gate per row (f32 and q8_1); strata_mvc_norm_q8 ==
    strata_norm_q8 per column (q8_1 blocks and group sums)."""
    cp = _setup_kernels()[0]
    rng = np.random.default_rng(41 + neox)
    lb, s = KL.lib(), KL.stream_ptr()
    H, KV, hd, ps, n_pages = 4, 2, 64, 16, 8
    W = (H + 2 * KV) * hd
    table = cp.asarray(rng.permutation(n_pages).astype(np.int32))
    for n in (1, 5, 16):
        Q = rng.standard_normal((n, W)).astype(np.float32)
        pos = cp.asarray((9 + np.arange(n)).astype(np.int32))
        outs = []
        for rows in (True, False):
            qkv = cp.asarray(Q)
            kc, vc = (cp.zeros((n_pages, ps, KV, hd), cp.float16) for _ in range(2))
            if rows:
                KL.check(lb.strata_rope_kv_rows(s, KL.ptr(qkv), W, KL.ptr(pos), KL.ptr(kc), KL.ptr(vc), KL.ptr(table),
                                                n, H, KV, hd, n_rot, 1e4, neox, ps), "rope_rows")
            else:
                for r in range(n):
                    KL.check(lb.strata_rope_kv_decode(s, KL.ptr(qkv[r]), KL.ptr(pos[r:r + 1]), KL.ptr(kc), KL.ptr(vc),
                                                      KL.ptr(table), H, KV, hd, n_rot, 1e4, neox, ps), "rope")
            outs.append([cp.asnumpy(a) for a in (qkv, kc, vc)])
        for a, b in zip(*outs):
            np.testing.assert_array_equal(a, b)
        nq = H * hd
        nb = int(lb.strata_q8_col_bytes(nq))
        att, gate = (cp.asarray(rng.standard_normal((n, nq)).astype(np.float32)) for _ in range(2))
        an, aq = cp.full((n, nq), cp.nan, cp.float32), cp.zeros((n, nb), cp.uint8)
        KL.check(lb.strata_q35_out_gate_rows(s, KL.ptr(att), KL.ptr(gate), KL.ptr(an), _vp(aq), nb, n, nq), "gate")
        E = 576
        X = cp.asarray(rng.standard_normal((n, E)).astype(np.float32))
        nw = cp.asarray(rng.uniform(0.5, 1.5, E).astype(np.float32))
        eb = int(lb.strata_q8_col_bytes(E))
        xq, ss = cp.zeros((n, eb), cp.uint8), cp.zeros((n, E // 32), cp.float32)
        KL.check(lb.strata_mvc_norm_q8(s, KL.ptr(X), KL.ptr(nw), _vp(xq), KL.ptr(ss), E, n), "norm_q8 cols")
        for r in range(n):
            a1, q1 = cp.full(nq, cp.nan, cp.float32), cp.zeros(nq + nq // 4, cp.uint8)
            KL.check(lb.strata_q35_out_gate(s, KL.ptr(att[r]), KL.ptr(gate[r]), KL.ptr(a1), KL.ffi().NULL, KL.ptr(q1),
                                            nq), "gate")
            np.testing.assert_array_equal(cp.asnumpy(an[r]), cp.asnumpy(a1))
            np.testing.assert_array_equal(cp.asnumpy(aq[r, :nq + nq // 4]), cp.asnumpy(q1))
            x1, s1 = cp.zeros(E + E // 4, cp.uint8), cp.zeros(E // 32, cp.float32)
            KL.check(lb.strata_norm_q8(s, KL.ptr(X[r]), KL.ptr(nw), KL.ptr(x1), KL.ptr(s1), E), "norm_q8")
            np.testing.assert_array_equal(cp.asnumpy(xq[r, :E + E // 4]), cp.asnumpy(x1))
            np.testing.assert_array_equal(cp.asnumpy(ss[r]), cp.asnumpy(s1))


@gpu
def test_cols_launchers_refuse_bad_input():
    """Column counts outside 1..16, a type without a dp4a kernel, a y stride below n_out, misaligned columns: an
    error code and nothing written."""
    cp, Q, CW, random_blocks = _setup_kernels()
    rng = np.random.default_rng(3)
    n_out, n_in = 64, 256
    w = CW.upload_raw("w", int(Q.Q8_0), (n_out, n_in), random_blocks(Q.Q8_0, n_out, n_in, rng))
    lb, s = KL.lib(), KL.stream_ptr()
    xq = _q8_cols(cp, rng.standard_normal((16, n_in)).astype(np.float32))
    y = cp.full((17, n_out), cp.nan, cp.float32)
    for n in (0, 17, -1):
        assert lb.strata_mvc_q8w(s, int(Q.Q8_0), KL.ptr(w.data), _vp(xq), KL.ptr(y), n_out, n_out, n_in, n) != 0
    assert lb.strata_mvc_q8w(s, int(Q.F16), KL.ptr(w.data), _vp(xq), KL.ptr(y), n_out, n_out, n_in, 2) != 0
    assert lb.strata_mvc_q8w(s, int(Q.Q8_0), KL.ptr(w.data), _vp(xq), KL.ptr(y), n_out - 1, n_out, n_in, 2) != 0
    assert lb.strata_mvc_q8w(s, int(Q.Q8_0), KL.ptr(w.data), _vp(xq, 8), KL.ptr(y), n_out, n_out, n_in, 2) != 0
    assert lb.strata_q8_col_bytes(100) == -1 and lb.strata_q8_col_bytes(576) % 16 == 0
    assert cp.isnan(y).all()


# ------------------------------------------------------------------ models
def _prompt(n, n_vocab, seed):
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def _same_state(a, b, running: bool) -> None:
    """Bit-identical bookkeeping, K/V pages of every attention layer and (hybrid) running state."""
    assert a.pos == b.pos and a.kv.length == b.kv.length == a.pos
    pool = a.kv.pool
    for slot in range(len(pool.k)):
        ka, va = (np.asarray(_host(t), np.float32) for t in pool.read(slot, a.kv.pages, a.pos))
        kb, vb = (np.asarray(_host(t), np.float32) for t in pool.read(slot, b.kv.pages, b.pos))
        np.testing.assert_array_equal(ka, kb, err_msg=f"K slot {slot}")
        np.testing.assert_array_equal(va, vb, err_msg=f"V slot {slot}")
    if running:
        for layer in a.running:
            for name in ("conv", "ssm"):
                np.testing.assert_array_equal(_host(a.running[layer][name]), _host(b.running[layer][name]),
                                              err_msg=f"running state {layer}/{name}")


def _chain(pm, plan, pool, depth: int, ns, seed: int, running: bool = False) -> None:
    """Two sequences with the same `depth`-token prompt; then for each n of ns: n tokens as one short read on the
    first, as n decode steps on the second: every row's logits and the states bit-identical."""
    m = pm.model
    V = m.config.n_vocab
    a, b = m.new_state(pool), m.new_state(pool)
    try:
        if depth:
            prompt = _prompt(depth, V, seed)
            pm.forward(prompt, a)
            pm.forward(prompt, b)
            _same_state(a, b, running)
        for k, n in enumerate(ns):
            toks = _prompt(n, V, seed + 1 + k)
            got = plan.short_read(toks, a, all_logits=True)
            want = np.stack([plan.decode(int(t), b) for t in toks])
            assert got.shape == (n, V) and np.isfinite(got).all()
            for i in range(n):
                np.testing.assert_array_equal(got[i], want[i], err_msg=f"depth {a.pos - n}, n {n}, row {i}")
            _same_state(a, b, running)
    finally:
        a.release()
        b.release()


NS = tuple(range(2, 17))


@pytest.fixture(scope="module")
def smol():
    if _no_model is not None:
        pytest.skip(_no_model)
    from strata.backend.cuda import llama as LL
    from strata.gguf.default_model import default_model_path
    from strata.models.registry import load_model
    m = load_model(default_model_path(), C.CudaBackend())
    pm = LL.LlamaPlanModel(m)
    pool = pm.new_page_pool(2400, n_seq=2)
    return pm, pool


@gpu
@pytest.mark.parametrize("depth", [0, 200, 2000])
def test_llama_short_read_bit_identical_to_decode(smol, depth):
    """The default model (the handoff form): chains n = 2..16 from depth 0 (short reads into an empty sequence), 200
    (rows on both sides of the 256-position class) and 2000 (the first attention kernel's rows and the GQA kernel's
    in one read)."""
    pm, pool = smol
    plan = pm.plan(pool)
    assert plan.short_form() == "handoff"
    _chain(pm, plan, pool, depth, NS if depth < 2000 else (2, 9, 16, 16, 16, 16), seed=depth + 1)


@gpu
@pytest.mark.parametrize("form", ["separate", "fused"])
def test_llama_other_forms_bit_identical(smol, form):
    """The separate-launch form (norms, RoPE, SwiGLU as their own launches: what q8_0 caches and separate weights
    take) mirrored over columns; the fused-norm form, which has no column mirror, stepping token by token."""
    pm, pool = smol
    from strata.backend.cuda import llama as LL
    plan = LL.LlamaCuda(pm.model, pool)
    plan.norm_handoff = False
    plan.fused_norm = form == "fused"
    want = None if form == "fused" and plan.fused_norm_rows() else "separate"
    assert plan.short_form() == want
    _chain(pm, plan, pool, 40, (2, 5, 8, 16), seed=5)


@gpu
def test_llama_q8_0_kv_cache_bit_identical():
    """--kv q8_0: the RoPE-only launch and strata_kv_write_q8 per row, the GQA attention on int8 pages."""
    if _no_model is not None:
        pytest.skip(_no_model)
    from strata.backend.cuda import llama as LL
    from strata.gguf.default_model import default_model_path
    from strata.models.registry import load_model
    pm = LL.LlamaPlanModel(load_model(default_model_path(), C.CudaBackend(kv_dtype="q8_0")))
    pool = pm.new_page_pool(512, n_seq=2)
    assert pool.kv == "q8_0"
    plan = pm.plan(pool)
    assert plan.short_form() == "separate"
    _chain(pm, plan, pool, 30, (2, 3, 16, 7), seed=9)


@gpu
def test_llama_graphs_vs_eager_and_routing(smol, monkeypatch):
    """The captured graphs and eager launches give the same bits; PlanModel.forward routes 2 tokens up to the
    plan's limit through the short read (DecodePlan.takes_short_read, settings.short_read) and more through the
    prefill; the last row's logits without all_logits."""
    pm, pool = smol
    m = pm.model
    plan = pm.plan(pool)
    lim = S.short_read_limit(plan.short_crossover)
    assert [n for n in range(0, 18) if plan.takes_short_read(n)] == list(range(2, lim + 1))
    from strata.backend.cuda import llama as LL
    eager = LL.LlamaCuda(m, pool, use_graphs=False)
    monkeypatch.setattr(plan, "short_crossover", 6)
    monkeypatch.setattr(S, "SHORT_READ_ENV", None)
    a, b, c = m.new_state(pool), m.new_state(pool), m.new_state(pool)
    try:
        prompt = _prompt(50, m.config.n_vocab, 21)
        for st in (a, b, c):
            pm.forward(prompt, st)
        toks = _prompt(6, m.config.n_vocab, 22)
        la = plan.short_read(toks, a, all_logits=True)
        lb = eager.short_read(toks, b, all_logits=True)
        lc = pm.forward(toks, c)
        np.testing.assert_array_equal(la, lb)
        np.testing.assert_array_equal(la[-1], lc)
        _same_state(a, b, False)
        _same_state(a, c, False)
    finally:
        for st in (a, b, c):
            st.release()


@gpu
@pytest.mark.parametrize("hybrid", [False, True])
def test_measured_crossover_routes_and_leaves_the_state(smol, hybrid, tmp_path, monkeypatch):
    """DecodePlan.measure_short_read (what the warm-up runs) keeps a crossover in 1..16 on the plan, which then
    routes PlanModel.forward (takes_short_read); the measured sequence is left as it was: the next token's logits
    and every layer's state equal those of an unmeasured twin."""
    monkeypatch.setattr(S, "SHORT_READ_ENV", None)
    if hybrid:
        if _no_model is not None:
            pytest.skip(_no_model)
        from strata.backend.cuda import qwen35 as Q
        from strata.models.registry import load_model
        m = load_model(synth.write_synthetic(tmp_path / "q35.gguf", _hybrid_spec("Q8_0")), C.CudaBackend())
        pm = Q.Qwen35GraphModel(m)
        pool = pm.new_page_pool(512, n_seq=2)
    else:
        pm, pool = smol
        m = pm.model
    plan = pm.plan(pool)
    monkeypatch.setattr(plan, "short_crossover", plan.short_crossover)   # the module's plan as it was after
    a, b = m.new_state(pool), m.new_state(pool)
    try:
        prompt = _prompt(40, m.config.n_vocab, 41)
        for st in (a, b):
            pm.forward(prompt, st)
        n = pm.measure_short_read(a)
        assert n == plan.short_crossover and 1 <= n <= S.SHORT_READ_COLS
        assert [k for k in range(0, 18) if plan.takes_short_read(k)] == list(range(2, n + 1))
        assert a.pos == b.pos == 40
        tok = _prompt(1, m.config.n_vocab, 42)
        np.testing.assert_array_equal(pm.forward(tok, a), pm.forward(tok, b))
        _same_state(a, b, hybrid)
    finally:
        for st in (a, b):
            st.release()


@gpu
def test_short_read_graphs_bounded(smol, monkeypatch):
    """At most settings.SHORT_READ_GRAPHS short-read graphs stay captured (the least recently used dropped); a read
    whose graph was dropped captures it again, with the same bits as decoding."""
    pm, pool = smol
    from strata.backend.cuda import llama as LL
    plan = LL.LlamaCuda(pm.model, pool)
    monkeypatch.setattr(S, "SHORT_READ_GRAPHS", 2)
    _chain(pm, plan, pool, 20, (2, 3, 4, 2, 3), seed=31)
    assert sum(1 for k in plan.graphs if isinstance(k, tuple) and k[0] == "short") == 2


@gpu
def test_short_read_bad_input_changes_nothing(smol):
    """A bad token id, 17 tokens, an empty batch and a full cache raise and change nothing."""
    pm, pool = smol
    m, plan = pm.model, pm.plan(pool)
    st = m.new_state(pool)
    try:
        pm.forward(_prompt(20, m.config.n_vocab, 2), st)
        pos, length = st.pos, st.kv.length
        for bad in ([1, m.config.n_vocab], [-1, 2], list(range(17)), []):
            with pytest.raises(ValueError):
                plan.short_read(np.asarray(bad, np.int64), st)
            assert st.pos == pos and st.kv.length == length
        small = pm.new_page_pool(32)
        s2 = m.new_state(small)
        cap = small.capacity_tokens                          # whole pages: room for more than the 32 asked
        pm.forward(_prompt(cap - 4, m.config.n_vocab, 3), s2)
        from strata.memory.pages import KVCacheFull
        with pytest.raises(KVCacheFull):
            plan2 = pm.plan(small)
            plan2.short_read(_prompt(8, m.config.n_vocab, 4), s2)
        assert s2.pos == cap - 4 and s2.kv.length == cap - 4
        s2.release()
    finally:
        st.release()


def _hybrid_spec(qtype):
    """The qwen35 test model of tests/test_cuda_qwen35.py: 6 GDN + 2 attention layers, head_dim 64, tiled heads."""
    return synth.preset("qwen35", "tiny", n_embd=128, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                        head_k_dim=64, head_v_dim=64, n_k_heads=2, n_v_heads=4, n_mtp=0, qtype=qtype,
                        embd_qtype="Q8_0", seed=11)


@gpu
@pytest.mark.parametrize("qtype,kv", [("Q8_0", "f16"), ("F16", "f16"), ("Q8_0", "q8_0")])
@pytest.mark.parametrize("depth", [0, 200])
def test_hybrid_short_read_bit_identical_to_decode(qtype, kv, depth, tmp_path):
    """A synthetic qwen35 hybrid: logits, K/V pages and every GDN layer's conv window and ssm state (F16 weights
    take the f32-activation matvec per column, the stated fallback of types without a dp4a kernel)."""
    if _no_model is not None:
        pytest.skip(_no_model)
    from strata.backend.cuda import qwen35 as Q
    from strata.models.registry import load_model
    path = synth.write_synthetic(tmp_path / f"q35_{qtype}.gguf", _hybrid_spec(qtype))
    m = load_model(path, C.CudaBackend(kv_dtype=kv))
    pm = Q.Qwen35GraphModel(m)
    pool = pm.new_page_pool(512, n_seq=2)
    plan = pm.plan(pool)
    assert plan.short_form() == "decode"
    _chain(pm, plan, pool, depth, NS, seed=depth + 3, running=True)
