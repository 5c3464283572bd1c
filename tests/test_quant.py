"""Tests of the C core (strata._native) through strata.backend.quant: dequantization against gguf's numpy
dequantizers (the IQ types bit for bit), quantized matmul against a float64 x @ W.T of that dequantization, every
CPU dispatch path, threads, bad input."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gguf_quants

from strata.backend import quant
from strata.backend.quant import WeightTensor
from tests.helpers import IQ_TYPES, put_iq_scales

pytestmark = pytest.mark.skipif(not quant.native_available(), reason="strata._native is not built")

QUANT_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, *IQ_TYPES]
PATHS = ["portable"]
if quant.native_available():
    PATHS += ["avx2"] if quant._lib.strata_cpu_has_avx2() else []
    PATHS += ["avxvnni"] if quant._lib.strata_cpu_has_avxvnni() else []
    PATHS += ["avx512"] if quant._lib.strata_cpu_has_avx512() else []

# byte offsets of the fp16 scale fields in each block (ggml-common.h)
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


@pytest.fixture(params=PATHS)
def cpu_path(request):
    quant.set_cpu_path(request.param)
    yield request.param
    quant.set_cpu_path("auto")


def random_blocks(t: T, n_rows: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks: random bytes with the fp16 scale fields overwritten by finite values."""
    blck, size = GGML_QUANT_SIZES[t]
    nb = n_in // blck
    raw = rng.integers(0, 256, size=(n_rows, nb, size), dtype=np.uint8)
    if t in IQ_TYPES:
        put_iq_scales(raw, t, rng.standard_normal((n_rows, nb)) * 0.02)
    for off in F16_FIELDS.get(t, []):
        scale = (rng.standard_normal((n_rows, nb)) * 0.02).astype(np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8).reshape(n_rows, nb, 2)
    return raw.reshape(n_rows, nb * size)


def close(got, ref, rel=1e-6):
    """Equal up to float rounding (the C code may contract a*b+c into one FMA)."""
    scale = max(float(np.abs(ref).max()), 1e-30)
    np.testing.assert_allclose(got, ref, rtol=rel, atol=rel * scale)


# ---------------- dequantization ----------------

@pytest.mark.parametrize("t", QUANT_TYPES, ids=lambda t: t.name)
def test_dequantize_random_blocks_matches_gguf(t, cpu_path):
    rng = np.random.default_rng(int(t))
    n_in = 512 if GGML_QUANT_SIZES[t][0] == 256 else 96
    raw = random_blocks(t, 33, n_in, rng)
    w = WeightTensor("w", t, (33, n_in), raw)
    ref = gguf_quants.dequantize(raw, t).astype(np.float32)
    close(w.dequantize(), ref)
    ids = np.array([5, 0, 32, 5])
    close(w.rows(ids), ref[ids])


@pytest.mark.parametrize("t", IQ_TYPES, ids=lambda t: t.name)
def test_dequantize_iq_bit_identical_to_gguf(t, cpu_path):
    """The IQ types' dequantization equals gguf-py's numpy dequantizer bit for bit (every grid index, sign pattern
    and sub-block scale drawn at random; f16 block scales of both signs)."""
    rng = np.random.default_rng(100 + int(t))
    n_in = 1024 if GGML_QUANT_SIZES[t][0] == 256 else 256
    raw = random_blocks(t, 41, n_in, rng)
    ref = gguf_quants.dequantize(raw, t).astype(np.float32)
    w = WeightTensor("w", t, (41, n_in), raw)
    np.testing.assert_array_equal(w.dequantize().view(np.uint32), ref.view(np.uint32))
    ids = np.array([40, 0, 17, 40])
    np.testing.assert_array_equal(w.rows(ids).view(np.uint32), ref[ids].view(np.uint32))


@pytest.mark.parametrize("t", [T.F16, T.BF16, T.F32], ids=lambda t: t.name)
def test_dequantize_float_types(t, cpu_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    if t == T.F16:
        data = x.astype(np.float16)
        ref = data.astype(np.float32)
    elif t == T.BF16:
        data = (x.view(np.uint32) >> 16).astype(np.uint16)
        ref = gguf_quants.dequantize(data.view(np.uint8), T.BF16).astype(np.float32)
    else:
        data, ref = x, x
    w = WeightTensor("w", t, (9, 64), data)
    close(w.dequantize(), ref, rel=0)
    close(w.rows(np.array([8, 1])), ref[[8, 1]], rel=0)


def test_dequantize_q8_K(cpu_path):
    """Q8_K (activation type, not in gguf's numpy dequantizers): d * qs per ggml dequantize_row_q8_K."""
    rng = np.random.default_rng(2)
    n_rows, nb = 3, 2
    d = rng.standard_normal((n_rows, nb)).astype(np.float32)
    qs = rng.integers(-128, 128, size=(n_rows, nb, 256), dtype=np.int8)
    block = np.zeros((n_rows, nb, 292), dtype=np.uint8)
    block[..., 0:4] = d.view(np.uint8).reshape(n_rows, nb, 4)
    block[..., 4:260] = qs.view(np.uint8)
    out = np.empty((n_rows, nb * 256), dtype=np.float32)
    raw = block.reshape(n_rows, -1)
    rc = quant._lib.strata_dequantize(int(T.Q8_K), quant._ffi.from_buffer(raw), raw.shape[1], n_rows, nb * 256,
                                      quant._ffi.from_buffer("float[]", out), 1)
    assert rc == 0
    close(out, (d[..., None] * qs.astype(np.float32)).reshape(n_rows, -1), rel=0)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight",
                                  "blk.0.attn_norm.weight", "output_norm.weight"])
def test_dequantize_real_model_tensors(model_tensors, name):
    w = model_tensors[name]
    ref = gguf_quants.dequantize(np.asarray(w.data), w.ggml_type).astype(np.float32).reshape(w.shape)
    close(w.dequantize(), ref)
    if len(w.shape) == 2:
        ids = np.array([0, w.shape[0] - 1, w.shape[0] // 2])
        close(w.rows(ids), ref[ids])


@pytest.fixture(scope="module")
def model_tensors():
    gguf = pytest.importorskip("gguf")
    from strata.gguf.default_model import DefaultModelMissing, default_model_path
    try:
        path = default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed([int(v) for v in t.shape]))
        out[t.name] = WeightTensor(t.name, T(int(t.tensor_type)), shape, t.data)
    return out


# ---------------- matmul ----------------

def q8_bound(w: np.ndarray, x: np.ndarray, block: int) -> np.ndarray:
    """Worst-case error of x @ w.T from quantizing x to 8 bits per block (scale amax/127).

    Each activation moves by at most d/2 = amax_b/254, so the error vector e has
    |e|_2 <= sqrt(block)/254 * |x|_2 (amax_b <= |x_b|_2), and by Cauchy-Schwarz
    |err[t, i]| <= |w_i|_2 * |e_t|_2 <= sqrt(block)/254 * |w_i| |x_t| (0.022 for blocks of 32, 0.063 for 256).
    """
    return np.sqrt(block) / 254.0 * np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(w, axis=1))


@pytest.mark.parametrize("t", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 3, 7, 64, 65])
def test_matmul_q8_kernels_vs_fp32(t, n_tokens, cpu_path, monkeypatch):
    monkeypatch.setattr(quant, "BLAS_MIN_TOKENS", 1 << 30)  # force the integer kernels at every size
    rng = np.random.default_rng(int(t) * 100 + n_tokens)
    blck = GGML_QUANT_SIZES[t][0]
    n_out, n_in = 37, (768 if blck == 256 else 160)  # odd row count, n_in not a power of two
    raw = random_blocks(t, n_out, n_in, rng)
    w = WeightTensor("w", t, (n_out, n_in), raw)
    wf = gguf_quants.dequantize(raw, t).astype(np.float32)
    x = rng.standard_normal((n_tokens, n_in)).astype(np.float32)
    ref = x.astype(np.float64) @ wf.astype(np.float64).T
    y = w.matmul(x)
    assert y.shape == (n_tokens, n_out) and y.dtype == np.float32
    err = np.abs(y - ref)
    assert np.all(err <= q8_bound(wf, x, blck) * 1.001 + 1e-5)
    # typical error is far below the worst case: ~1e-2 of the norm-scaled result or better
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 2e-2


@pytest.mark.parametrize("t", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_matmul_blas_path_vs_fp32(t, monkeypatch):
    monkeypatch.setattr(quant, "BLAS_MIN_TOKENS", 1)
    monkeypatch.setattr(quant, "_BLAS_TILE_BYTES", 4 * 512 * 10)  # several tiles, last one partial
    rng = np.random.default_rng(5)
    n_in = 512
    raw = random_blocks(t, 45, n_in, rng)
    w = WeightTensor("w", t, (45, n_in), raw)
    wf = gguf_quants.dequantize(raw, t).astype(np.float32)
    x = rng.standard_normal((9, n_in)).astype(np.float32)
    np.testing.assert_allclose(w.matmul(x), x @ wf.T, rtol=1e-4, atol=1e-4 * np.abs(x @ wf.T).max())


FLOAT_TYPES = [T.F32, T.F16, T.BF16]


def float_weight(t: T, n_out: int, n_in: int, rng: np.random.Generator) -> tuple[WeightTensor, np.ndarray]:
    """A random F32 / F16 / BF16 tensor and its stored values as float64 (numpy's own conversions, not the C core's)."""
    f = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if t == T.F32:
        data, ref = f, f.astype(np.float64)
    elif t == T.F16:
        data = f.astype(np.float16)
        ref = data.astype(np.float64)
    else:
        data = (f.view(np.uint32) >> 16).astype(np.uint16)
        ref = (data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return WeightTensor("w", t, (n_out, n_in), data), ref


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_matmul_float_weights_vs_float64(t, cpu_path):
    """The C core's float products (x as it is, no activation quantization) against float64 x @ W.T of the stored
    values, within fp32 accumulation error ((n_in + 4) roundings of at most 2^-24 of sum |x_j w_j|), on odd shapes:
    n_in not a multiple of 8, 16 or 32, 37 rows, 1..40 tokens (one token, one tile, several tiles of unpacked rows).
    Every row of an n-token product is bit-identical to that token's product alone."""
    rng = np.random.default_rng(int(t) + 60)
    for n_in in (1, 5, 13, 77, 259):
        w, wf = float_weight(t, 37, n_in, rng)
        for n in (1, 2, 3, 4, 5, 8, 9, 17, 40):
            x = rng.standard_normal((n, n_in)).astype(np.float32)
            y = w.matmul(x)
            assert y.shape == (n, 37) and y.dtype == np.float32
            x64 = x.astype(np.float64)
            bound = (n_in + 4) * 2.0 ** -24 * (np.abs(x64) @ np.abs(wf).T)
            err = np.abs(y - x64 @ wf.T)
            assert np.all(err <= bound), f"{t.name} n_in={n_in} n={n}: {float((err / (bound + 1e-300)).max())}"
            for i in range(n):
                np.testing.assert_array_equal(y[i], w.matmul(np.ascontiguousarray(x[i:i + 1]))[0],
                                              err_msg=f"{t.name} n_in={n_in} n={n} row {i}")
    np.testing.assert_array_equal(w.matmul(x[0]), y[0])  # a 1-D x is one token


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_matmul_float_weights_route(t, monkeypatch):
    """Below BLAS_MIN_TOKENS float weights go to the C core (never the BLAS tiles); from it on, to BLAS."""
    rng = np.random.default_rng(61)
    w, wf = float_weight(t, 9, 24, rng)
    x = rng.standard_normal((3, 24)).astype(np.float32)
    blas = quant.WeightTensor._matmul_blas
    calls = []
    monkeypatch.setattr(quant.WeightTensor, "_matmul_blas", lambda self, *a: calls.append(a[0].shape[0]) or blas(self, *a))
    w.matmul(x)
    assert calls == []
    monkeypatch.setattr(quant, "BLAS_MIN_TOKENS", 2)
    y = w.matmul(x)
    assert calls == [3]
    np.testing.assert_allclose(y, x @ wf.T.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_matmul_float_refuses_wrong_sizes():
    """strata_matmul refuses a float weight whose row stride is shorter than n_in elements, n_in <= 0 and a negative
    token count (ST_ERR_SHAPE), writing nothing."""
    lib, ffi = quant._lib, quant._ffi
    w = np.zeros((4, 10), np.float16)
    x = np.ones((2, 10), np.float32)
    y = np.full((2, 4), 7.0, np.float32)
    wp, xp, yp = ffi.from_buffer(w), ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y)
    assert lib.strata_can_matmul(int(T.F16)) == lib.strata_can_matmul(int(T.BF16)) == 1
    assert lib.strata_can_matmul(int(T.F32)) == 1
    assert lib.strata_matmul(int(T.F16), wp, 18, 4, 10, xp, 2, yp, 1) == -2   # a row is 20 bytes
    assert lib.strata_matmul(int(T.F32), wp, 20, 4, 10, xp, 2, yp, 1) == -2   # F32 rows need 40
    assert lib.strata_matmul(int(T.BF16), wp, 20, 4, 0, xp, 2, yp, 1) == -2
    assert lib.strata_matmul(int(T.F16), wp, 20, 4, 10, xp, -1, yp, 1) == -2
    assert np.all(y == 7.0)
    assert lib.strata_matmul(int(T.F16), wp, 20, 4, 10, xp, 2, yp, 1) == 0 and np.all(y == 0.0)
    short = WeightTensor("short", T.F16, (4, 10), np.zeros((4, 9), np.float16))
    one_line_value_error(lambda: short.matmul(np.zeros((1, 10), np.float32)), "expected 80")


@pytest.mark.parametrize("t", QUANT_TYPES, ids=lambda t: t.name)
def test_dispatch_paths_agree(t, monkeypatch):
    if len(PATHS) == 1:
        pytest.skip("this CPU has no AVX2+FMA: only the portable path")
    monkeypatch.setattr(quant, "BLAS_MIN_TOKENS", 1 << 30)
    rng = np.random.default_rng(7)
    n_in = 512
    raw = random_blocks(t, 19, n_in, rng)
    w = WeightTensor("w", t, (19, n_in), raw)
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    out = {}
    for p in PATHS:
        quant.set_cpu_path(p)
        try:
            out[p] = (w.matmul(x), w.dequantize())
        finally:
            quant.set_cpu_path("auto")
    scale = np.abs(out["portable"][0]).max()
    # same math; only summation order (and round-half-even vs half-away on exact ties) differ
    for p in PATHS[1:]:
        np.testing.assert_allclose(out[p][0], out["portable"][0], rtol=1e-4, atol=1e-4 * scale, err_msg=p)
        np.testing.assert_array_equal(out[p][1], out["portable"][1], err_msg=p)


def test_matmul_real_model(model_tensors):
    rng = np.random.default_rng(8)
    for name in ["blk.0.ffn_down.weight", "blk.0.attn_k.weight", "token_embd.weight"]:
        w = model_tensors[name]
        wf = w.dequantize()
        for n in (1, 7):
            x = rng.standard_normal((n, w.shape[1])).astype(np.float32)
            ref = x.astype(np.float64) @ wf.astype(np.float64).T
            y = w.matmul(x)
            assert np.all(np.abs(y - ref) <= q8_bound(wf, x, 32) * 1.001 + 1e-5), name
            assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 2e-2, name


@pytest.mark.parametrize("t", [T.Q4_1, T.F16], ids=lambda t: t.name)
def test_threads_give_identical_results(t, monkeypatch):
    monkeypatch.setattr(quant, "BLAS_MIN_TOKENS", 1 << 30)
    rng = np.random.default_rng(9)
    if t == T.F16:
        w = float_weight(t, 301, 1024, rng)[0]
    else:
        w = WeightTensor("w", t, (301, 1024), random_blocks(t, 301, 1024, rng))
    x = rng.standard_normal((6, 1024)).astype(np.float32)
    saved = quant.get_threads()
    try:
        res = []
        for n in (1, 2, 3, 8):
            quant.set_threads(n)
            assert quant.get_threads() == n
            res.append((w.matmul(x), w.dequantize()))
    finally:
        quant.set_threads(saved)
    for y, d in res[1:]:  # each output is computed by one thread in a fixed order: bitwise equal
        np.testing.assert_array_equal(y, res[0][0])
        np.testing.assert_array_equal(d, res[0][1])


def test_env_var_forces_portable_path():
    root = str(Path(quant.__file__).resolve().parents[2])         # the checkout holding strata/
    env = dict(os.environ, STRATA_CPU_PATH="portable",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "from strata.backend import quant; print(quant.cpu_path())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "portable"


def test_auto_path_is_the_best_available():
    assert quant.cpu_path() == PATHS[-1]


def test_numpy_fallback_when_native_missing(monkeypatch):
    rng = np.random.default_rng(10)
    raw = random_blocks(T.Q4_1, 8, 64, rng)
    w_native = WeightTensor("w", T.Q4_1, (8, 64), raw)
    ref = w_native.dequantize()
    monkeypatch.setattr(quant, "_lib", None)
    monkeypatch.setattr(quant, "_warned", False)
    w = WeightTensor("w", T.Q4_1, (8, 64), raw)
    with pytest.warns(RuntimeWarning, match="not built"):
        d = w.dequantize()
    close(d, ref)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        np.testing.assert_allclose(w.matmul(x), x @ ref.T, rtol=1e-5, atol=1e-5)
        close(w.rows(np.array([3])), ref[[3]])
    assert quant.cpu_path() == "numpy"


# ---------------- bad input ----------------

def one_line_value_error(fn, match):
    with pytest.raises(ValueError, match=match) as ei:
        fn()
    assert "\n" not in str(ei.value)


def test_bad_input_raises_value_error():
    rng = np.random.default_rng(11)
    raw = random_blocks(T.Q4_1, 4, 64, rng)
    w = WeightTensor("blk.0.attn_q.weight", T.Q4_1, (4, 64), raw)
    one_line_value_error(lambda: w.matmul(np.zeros((2, 64), np.float64)), "float32")
    one_line_value_error(lambda: w.matmul([[0.0] * 64]), "float32")
    one_line_value_error(lambda: w.matmul(np.zeros((2, 63), np.float32)), r"shape \(n_tokens, 64\)")
    one_line_value_error(lambda: w.matmul(np.zeros((1, 2, 64), np.float32)), "shape")
    one_line_value_error(lambda: w.rows(np.array([4])), "out of range")
    one_line_value_error(lambda: w.rows(np.array([-1])), "out of range")
    one_line_value_error(lambda: w.rows(np.array([0.5])), "integer")
    # n_in not a multiple of the block size
    bad = WeightTensor("bad", T.Q4_1, (4, 40), np.zeros((4, 25), np.uint8))
    one_line_value_error(bad.dequantize, "multiple of the Q4_1 block size 32")
    one_line_value_error(lambda: bad.matmul(np.zeros((1, 40), np.float32)), "block size")
    # data size does not match the shape
    short = WeightTensor("short", T.Q8_0, (4, 64), np.zeros((4, 60), np.uint8))
    one_line_value_error(short.dequantize, "expected 272")
    # unsupported type
    tq = WeightTensor("tq", T.TQ2_0, (1, 256), np.zeros((1, 66), np.uint8))
    one_line_value_error(tq.dequantize, "unsupported GGML type TQ2_0")
    one_line_value_error(lambda: quant.set_threads(0), "threads")
    one_line_value_error(lambda: quant.set_cpu_path("sse9"), "sse9")
    # nothing changed by the failures
    np.testing.assert_array_equal(w.data, raw)


def test_iq_tables_are_generated_from_gguf():
    """native/cpu/iq_tables.c is what tools/gen_iq_tables.py writes from gguf-py's grids (no hand edits)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tools" / "gen_iq_tables.py"), "--check"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
