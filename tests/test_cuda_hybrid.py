"""The hybrid models (qwen35, qwen35moe, qwen3next) on the CUDA backend against the CPU backend, the GDN kernels
(native/cuda/gdn.cu) against strata/backend/gdn.py, and the synthetic hybrid benchmark model.

Runs anywhere (no GPU): the array-module-generic gdn/moe functions are bit-identical to the previous numpy-only
code (kept below as the reference); the model's device-path control flow (in-place conv window, key-head mapping
of the decode kernel) run with numpy stand-ins equals the CPU path; the benchmark's synthetic GGUF loads and runs on
the CPU backend, its Q8_0 blocks dequantize (gguf-py) as written, and llama.cpp (llama-cpp-python, optional) reads it.

GPU tests (skipped with the reason from strata.backend.cuda.unavailable_reason()); tolerances:
  * recurrent kernel vs gdn.delta_rule_recurrent (numpy, f32): output and state rel L2 < 1e-5;
  * conv kernel vs gdn.causal_conv1d: max abs < 1e-5, window exact;
  * chunked delta rule on CuPy vs numpy: rel L2 < 1e-4;
  * model logits, ~100-token prompt in ubatches of 37 (f16 GEMM operands on CUDA prefill, f32 on CPU):
    rel L2 over all positions < 2e-2; running state (conv, ssm) rel L2 < 2e-2;
  * greedy 64 tokens identical to the CPU backend's, or the first difference a near tie (< 0.25 logit on the CPU).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.gguf import synth
from strata.backend import cuda as C
from strata.backend import gdn, moe
from strata.models.registry import load_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import gpu_hybrid_model as bench_h  # noqa: E402
from tests.cuda_marks import CUDA_WHY as _why  # noqa: E402
from tests.cuda_marks import NEAR_TIE_LOGIT, assert_parts_at_near_tie, default_model_missing, gpu, rel_l2
from tests.cuda_marks import host as _host

_no_model = default_model_missing()
pytestmark = pytest.mark.skipif(_no_model is not None, reason=f"synthetic models need the default model's tokenizer: "
                                                              f"{_no_model}")

LOGITS_REL_L2 = 2e-2
STATE_REL_L2 = 2e-2
KERNEL_REL_L2 = 1e-5
N_GREEDY = 64


# ------------------------------------------------------------------ the numpy implementation before it became xp-generic
def _old_silu(x: np.ndarray) -> np.ndarray:
    """x * _old_sigmoid(x), float32."""
    return x / (1.0 + np.exp(-x))


def _old_sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _old_softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), computed stably (torch.nn.functional.softplus with threshold 20 gives the same in fp32)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def _old_l2_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x * rsqrt(sum(x^2, last axis) + eps) (the FLA / transformers ``l2norm``); float32, shape kept."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def _old_causal_conv1d(x: np.ndarray, weight: np.ndarray, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise 1-D convolution with the previous inputs as state, followed by SiLU.

    x: float32 (n_tokens, channels); weight: float32 (channels, kernel) (GGUF ``ssm_conv1d``, HF
    ``conv1d.weight`` squeezed); window: float32 (kernel - 1, channels), the last kernel-1 inputs before x
    (zeros at the start of a sequence). Returns (_old_silu(y) of shape (n_tokens, channels), new window of shape
    (kernel - 1, channels)). y[t, c] = sum_j weight[c, j] * xx[t + j, c] with xx = window ++ x.
    """
    n, c = x.shape
    k = weight.shape[1]
    if weight.shape[0] != c or window.shape != (k - 1, c):
        raise ValueError(f"causal_conv1d: x {x.shape}, weight {weight.shape}, window {window.shape} disagree")
    xx = np.concatenate([window, x], axis=0)
    y = np.zeros((n, c), dtype=np.float32)
    for j in range(k):
        y += xx[j:j + n] * weight[:, j]
    return _old_silu(y), np.ascontiguousarray(xx[n:n + k - 1] if k > 1 else xx[:0])


def _old_delta_rule_recurrent(q, k, v, g, beta, state):
    """Gated delta rule, one token at a time (the decode path).

    q, k: float32 (n_tokens, n_heads, d_k) (L2-normalised; q scaled by 1/sqrt(d_k) here); v: (n_tokens, n_heads, d_v);
    g, beta: (n_tokens, n_heads); state: (n_heads, d_k, d_v), updated in place and returned.
    Returns (o of shape (n_tokens, n_heads, d_v), state).
    """
    n, _, dk = q.shape
    scale = np.float32(1.0 / np.sqrt(dk))
    out = np.empty(v.shape, dtype=np.float32)
    for t in range(n):
        state *= np.exp(g[t])[:, None, None]
        kt = k[t]
        kv_mem = np.einsum("hk,hkv->hv", kt, state)
        u = (v[t] - kv_mem) * beta[t][:, None]
        state += kt[:, :, None] * u[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t] * scale, state)
    return out, state


def _old_delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """Gated delta rule over a prompt in chunks of ``chunk`` tokens (the prefill path).

    Same arguments and results as ``delta_rule_recurrent`` (state updated in place); exact within float
    rounding of the step-by-step recurrence. Cost per chunk: one batched (n_heads, L, L) triangular solve and
    matmuls of size L x d.
    """
    n, h, dk = q.shape
    dv = v.shape[2]
    scale = np.float32(1.0 / np.sqrt(dk))
    out = np.empty((n, h, dv), dtype=np.float32)
    # head-major views: (h, n, d)
    qh = np.ascontiguousarray(q.transpose(1, 0, 2)) * scale
    kh = np.ascontiguousarray(k.transpose(1, 0, 2))
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))
    gh = np.ascontiguousarray(g.T).astype(np.float32)
    bh = np.ascontiguousarray(beta.T).astype(np.float32)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        L = e - s
        qc, kc, vc, bc = qh[:, s:e], kh[:, s:e], vh[:, s:e], bh[:, s:e]
        G = np.cumsum(gh[:, s:e], axis=1)                         # (h, L)
        diff = G[:, :, None] - G[:, None, :]                      # G_t - G_s
        lower = np.tril(np.ones((L, L), dtype=bool))
        D = np.where(lower, np.exp(np.where(lower, diff, 0.0)), 0.0).astype(np.float32)  # e^(G_t-G_s), s<=t
        kk = kc @ kc.transpose(0, 2, 1)                           # (h, L, L) k_t . k_s
        A = np.tril(bc[:, :, None] * D * kk, -1)
        M = A + np.eye(L, dtype=np.float32)
        eG = np.exp(G)                                            # (h, L)
        rhs = np.concatenate([bc[:, :, None] * vc, (bc * eG)[:, :, None] * kc], axis=2)
        sol = np.linalg.solve(M, rhs).astype(np.float32)          # unit lower-triangular system
        U = sol[:, :, :dv] - sol[:, :, dv:] @ state               # (h, L, dv)
        qk = (qc @ kc.transpose(0, 2, 1)) * D                     # (h, L, L), s <= t
        o = eG[:, :, None] * (qc @ state) + qk @ U
        out[s:e] = o.transpose(1, 0, 2)
        w = np.exp(G[:, -1:] - G)                                 # (h, L) e^(G_L - G_s)
        state *= np.exp(G[:, -1])[:, None, None]
        state += (kc * w[:, :, None]).transpose(0, 2, 1) @ U
    return out, state


def _old_gated_rms_norm(x: np.ndarray, weight: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of x over its last axis times weight, times _old_silu(gate) (Qwen3-Next ``RMSNormGated``).

    x, gate: float32 (..., d); weight: float32 (d,) (plain weight, no +1 offset).
    """
    xn = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (xn * weight * _old_silu(gate)).astype(np.float32)


def _old_route(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax top-k routing. logits float32 (n_tokens, n_expert) -> (ids int64 (n, k), weights float32 (n, k)),
    ids in descending probability."""
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=-1).astype(np.float32)
    if renormalize:
        w /= w.sum(axis=-1, keepdims=True)
    return ids, w




def _gdn_inputs(n, h=4, dk=16, dv=24, seed=0, n_qk=None):
    rng = np.random.default_rng(seed)
    n_qk = n_qk or h
    q = gdn.l2_norm(rng.standard_normal((n, n_qk, dk)).astype(np.float32))
    k = gdn.l2_norm(rng.standard_normal((n, n_qk, dk)).astype(np.float32))
    v = rng.standard_normal((n, h, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((n, h))) * 0.5).astype(np.float32)
    b = gdn.sigmoid(rng.standard_normal((n, h))).astype(np.float32)
    s0 = (rng.standard_normal((h, dk, dv)) * 0.1).astype(np.float32)
    return q, k, v, g, b, s0


def test_xp_generic_functions_equal_previous_numpy_code():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 3, 16)).astype(np.float32) * 5
    z = rng.standard_normal((7, 3, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    for new, old in ((gdn.silu, _old_silu), (gdn.sigmoid, _old_sigmoid), (gdn.softplus, _old_softplus),
                     (gdn.l2_norm, _old_l2_norm)):
        assert np.array_equal(new(x), old(x)), new.__name__
    assert np.array_equal(gdn.softplus(x * 10), _old_softplus(x * 10))
    assert np.array_equal(gdn.gated_rms_norm(x, w, z, 1e-6), _old_gated_rms_norm(x, w, z, 1e-6))
    xc = rng.standard_normal((9, 12)).astype(np.float32)
    wc = rng.standard_normal((12, 4)).astype(np.float32)
    win = rng.standard_normal((3, 12)).astype(np.float32)
    for a, b in zip(gdn.causal_conv1d(xc, wc, win), _old_causal_conv1d(xc, wc, win)):
        assert np.array_equal(a, b)
    for n in (1, 5, 150):
        q, k, v, g, b, s0 = _gdn_inputs(n, seed=n)
        for new, old in ((gdn.delta_rule_recurrent, _old_delta_rule_recurrent),
                         (gdn.delta_rule_chunked, _old_delta_rule_chunked)):
            sa, sb = s0.copy(), s0.copy()
            oa, _ = new(q, k, v, g, b, sa)
            ob, _ = old(q, k, v, g, b, sb)
            assert np.array_equal(oa, ob) and np.array_equal(sa, sb), (new.__name__, n)
    lg = rng.standard_normal((20, 8)).astype(np.float32)
    lg[3, 2] = lg[3, 5]                              # a tie: lower id first in both
    for renorm in (True, False):
        for a, b in zip(moe.route(lg, 3, renorm), _old_route(lg, 3, renorm)):
            assert np.array_equal(a, b)
    assert gdn.array_module(x) is np


class _NumpyXP:
    """numpy under another identity: makes qwen3next take its device branches while arrays stay numpy."""

    def __getattr__(self, name):
        return getattr(np, name)


def _emulated_kernels(monkeypatch):
    """cuda_gdn.conv / recurrent as numpy code with the kernels' contracts (window in place; key-head mapping)."""
    from strata.backend.cuda import gdn as cuda_gdn

    def conv(x, weight, window):
        y, win = gdn.causal_conv1d(x, weight, window.copy())
        window[...] = win
        return y, window

    def recurrent(q, k, v, g, beta, state, tiled=True):
        n_qk, n_v = q.shape[1], v.shape[1]
        kmap = np.arange(n_v) % n_qk if tiled else np.arange(n_v) // (n_v // n_qk)
        return gdn.delta_rule_recurrent(q[:, kmap], k[:, kmap], v, g, beta, state)

    monkeypatch.setattr(cuda_gdn, "conv", conv)
    monkeypatch.setattr(cuda_gdn, "recurrent", recurrent)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_device_path_control_flow_with_numpy(arch, tmp_path, monkeypatch):
    """qwen3next's on-device branches (conv window updated in place by the kernel, decode kernel reading key heads
    tiled (qwen35*) or grouped (qwen3next)) run with numpy stand-ins equal the CPU path."""
    _emulated_kernels(monkeypatch)
    path = synth.write_synthetic(tmp_path / f"{arch}.gguf", synth.preset(arch, "tiny", seed=5, n_mtp=0))
    ref = load_model(path)
    dev = load_model(path)
    dev.xp, dev.on_device = _NumpyXP(), True
    toks = np.random.default_rng(2).integers(0, ref.config.n_vocab, 40).astype(np.int32)
    sa, sb = ref.new_state(ref.new_page_pool(128)), dev.new_state(dev.new_page_pool(128))
    la, lb = ref.forward(toks[:30], sa), dev.forward(toks[:30], sb)
    assert rel_l2(lb, la) < 1e-5   # float32 in another summation order: 1.1e-6 on the H200 host's numpy, < 1e-6 here
    for t in toks[30:]:                                   # decode: the recurrent kernel's branch
        la, lb = ref.forward(np.array([t], np.int32), sa), dev.forward(np.array([t], np.int32), sb)
        assert rel_l2(lb, la) < 1e-5
    for layer in sa.running:
        for name in ("conv", "ssm"):
            assert rel_l2(sb.running[layer][name], sa.running[layer][name]) < 1e-5


# ------------------------------------------------------------------ the synthetic benchmark model
@pytest.fixture(scope="module")
def tiny_bench_file(tmp_path_factory):
    from strata.gguf.default_model import default_model_path
    p = tmp_path_factory.mktemp("hyb") / "tiny_q8.gguf"
    return bench_h.make_synthetic_hybrid(p, default_model_path(), size="tiny", qtype="Q8_0", seed=3)


def test_synthetic_hybrid_file_loads_and_runs_on_cpu(tiny_bench_file):
    import gguf
    m = load_model(tiny_bench_file)
    assert m.variant == "qwen35" and not m.moe
    assert m.recurrent == [True, True, True, False]       # 3 GDN : 1 attention
    r = gguf.GGUFReader(tiny_bench_file)
    t = {x.name: x for x in r.tensors}
    assert t["blk.0.attn_qkv.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert t["blk.0.ssm_conv1d.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    w = gguf.quants.dequantize(t["blk.0.ffn_down.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    assert np.isfinite(w).all() and 0.3 < float(w.std()) * np.sqrt(w.shape[1]) < 3   # std ~ 1/sqrt(fan_in)
    toks = np.random.default_rng(0).integers(0, m.config.n_vocab, 40).astype(np.int32)
    st = m.new_state(m.new_page_pool(128))
    lg = m.forward(toks, st, all_logits=True)
    assert lg.shape == (40, m.config.n_vocab) and np.isfinite(lg).all() and lg.std() > 0.1
    st2 = m.new_state(m.new_page_pool(128))
    m.forward(toks[:25], st2)
    for tk in toks[25:]:
        last = m.forward(np.array([tk], np.int32), st2)
    assert rel_l2(last, lg[-1]) < 1e-3                    # decode recurrence continues the prefill


_LLAMA_SCRIPT = r"""
import sys, json, numpy as np, llama_cpp
path, toks = sys.argv[1], json.loads(sys.argv[2])
llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_batch=128, n_ubatch=128, logits_all=True, n_threads=2,
                      n_gpu_layers=0, verbose=False, use_extra_bufts=False)
llm.eval(toks)
np.save(sys.argv[3], np.asarray(llm.scores[:len(toks)], np.float32))
"""


def test_synthetic_hybrid_file_matches_llamacpp(tiny_bench_file, tmp_path):
    """llama.cpp reads the benchmark file and its logits track Strata CPU's (both quantize activations for the
    Q8_0 matmuls: rel L2 < 5e-2, mostly the same argmax). llama.cpp runs in a subprocess: llama-cpp-python 0.3.36
    segfaults on some machines evaluating quantized qwen35 files (strata.gguf.synth's Q8_0 files too); that skips."""
    import json
    import subprocess
    pytest.importorskip("llama_cpp")
    m = load_model(tiny_bench_file)
    toks = np.random.default_rng(4).integers(0, m.config.n_vocab, 40).astype(np.int32)
    ours = m.forward(toks, m.new_state(m.new_page_pool(128)), all_logits=True)
    out = tmp_path / "ref.npy"
    p = subprocess.run([sys.executable, "-c", _LLAMA_SCRIPT, str(tiny_bench_file), json.dumps(toks.tolist()),
                        str(out)], capture_output=True, text=True, timeout=300)
    if p.returncode < 0:
        pytest.skip(f"llama-cpp-python died with signal {-p.returncode} evaluating a quantized qwen35 file")
    assert p.returncode == 0, p.stderr[-2000:]
    ref = np.load(out)
    err = rel_l2(ours, ref)
    print(f"strata CPU vs llama.cpp logits rel L2 {err:.2e}, argmax agreement "
          f"{(ours.argmax(1) == ref.argmax(1)).mean():.2f}")
    assert err < 5e-2
    assert (ours.argmax(1) == ref.argmax(1)).mean() > 0.8


# ------------------------------------------------------------------ GPU: kernels
@gpu
@pytest.mark.parametrize("variant", ["auto", "block", "warp", "warp2", "warp1"])
@pytest.mark.parametrize("n,h,n_qk,dk,dv,tiled", [(1, 4, 4, 16, 24, True), (1, 16, 16, 128, 128, True),
                                                  (1, 8, 2, 64, 64, False), (1, 8, 2, 64, 64, True),
                                                  (6, 4, 2, 16, 24, False), (3, 32, 16, 256, 96, True),
                                                  (37, 16, 16, 128, 128, True), (9, 8, 4, 256, 64, False),
                                                  (512, 16, 16, 128, 128, True), (130, 8, 2, 64, 64, False),
                                                  (67, 4, 2, 32, 32, True), (2, 4, 4, 256, 8, True),
                                                  (21, 4, 2, 128, 6, False)])
def test_recurrent_kernel_matches_numpy(n, h, n_qk, dk, dv, tiled, variant):
    """The delta-rule kernels (the block kernel; the warp kernel with 4 / 2 / 1 columns per warp: dk 32 / 64 / 128 /
    256, dv a multiple of the columns, token groups of 2 to 8 with a partial last group) against
    gdn.delta_rule_recurrent in float32 numpy."""
    import cupy as cp

    from strata.backend.cuda import gdn as cuda_gdn
    q, k, v, g, b, s0 = _gdn_inputs(n, h, dk, dv, seed=h + dk, n_qk=n_qk)
    cols = {"warp": 4, "warp2": 2, "warp1": 1}.get(variant)
    if cols and (dk not in (32, 64, 128, 256) or dv % cols):
        with pytest.raises(RuntimeError, match="strata_gdn_recurrent"):
            cuda_gdn.recurrent(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(g), cp.asarray(b),
                               cp.asarray(s0), tiled=tiled, variant=variant)
        return
    kmap = np.arange(h) % n_qk if tiled else np.arange(h) // (h // n_qk)
    s_ref = s0.copy()
    o_ref, _ = gdn.delta_rule_recurrent(q[:, kmap], k[:, kmap], v, g, b, s_ref)
    s_d = cp.asarray(s0)
    o_d, s_out = cuda_gdn.recurrent(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(g), cp.asarray(b),
                                    s_d, tiled=tiled, variant=variant)
    assert s_out is s_d
    eo, es = rel_l2(o_d.get(), o_ref), rel_l2(s_d.get(), s_ref)
    print(f"recurrent kernel ({variant}) n={n} h={h} dk={dk} dv={dv}: out rel L2 {eo:.2e}, state rel L2 {es:.2e}")
    assert eo < KERNEL_REL_L2 and es < KERNEL_REL_L2


def test_recurrent_unknown_variant_is_value_error():
    from strata.backend.cuda import gdn as cuda_gdn
    q = np.zeros((2, 1, 32), np.float32)
    with pytest.raises(ValueError, match="variant 'fast'"):
        cuda_gdn.recurrent(q, q, q, np.zeros((2, 1), np.float32), np.zeros((2, 1), np.float32),
                           np.zeros((1, 32, 32), np.float32), variant="fast")


@gpu
@pytest.mark.parametrize("n,c,kk", [(1, 96, 4), (7, 6144, 4), (3, 33, 2), (2, 50, 8), (8, 96, 4), (9, 130, 3),
                                     (17, 6144, 4), (512, 200, 4)])    # n > 16: several 16-token tiles
def test_conv_kernel_matches_numpy(n, c, kk):
    import cupy as cp

    from strata.backend.cuda import gdn as cuda_gdn
    rng = np.random.default_rng(c)
    x = rng.standard_normal((n, c)).astype(np.float32)
    w = rng.standard_normal((c, kk)).astype(np.float32)
    win = rng.standard_normal((kk - 1, c)).astype(np.float32)
    y_ref, win_ref = gdn.causal_conv1d(x, w, win)
    win_d = cp.asarray(win)
    y_d, _ = cuda_gdn.conv(cp.asarray(x), cp.asarray(w), win_d)
    err = float(np.abs(y_d.get() - y_ref).max())
    print(f"conv kernel n={n} c={c} k={kk}: max abs {err:.2e}")
    assert err < 1e-5
    assert np.array_equal(win_d.get(), win_ref)


@gpu
@pytest.mark.parametrize("n,kk", [(1, 4), (2, 4), (3, 4), (16, 4), (40, 4), (5, 8)])
def test_conv_kernel_reads_strided_rows_in_place(n, kk):
    """x as a column slice of a wider projection (rows x_stride floats apart): read in place, same result as the
    contiguous copy; n < kernel - 1 keeps part of the old window."""
    import cupy as cp

    from strata.backend.cuda import gdn as cuda_gdn
    rng = np.random.default_rng(n + kk)
    c = 96
    proj = rng.standard_normal((n, c + 37)).astype(np.float32)
    w = rng.standard_normal((c, kk)).astype(np.float32)
    win = rng.standard_normal((kk - 1, c)).astype(np.float32)
    y_ref, win_ref = gdn.causal_conv1d(proj[:, :c], w, win)
    win_d = cp.asarray(win)
    y_d, _ = cuda_gdn.conv(cp.asarray(proj)[:, :c], cp.asarray(w), win_d)
    assert float(np.abs(y_d.get() - y_ref).max()) < 1e-5
    assert np.array_equal(win_d.get(), win_ref)


@gpu
def test_chunked_on_cupy_matches_numpy():
    import cupy as cp
    q, k, v, g, b, s0 = _gdn_inputs(150, 8, 64, 64, seed=9)
    s_ref = s0.copy()
    o_ref, _ = gdn.delta_rule_chunked(q, k, v, g, b, s_ref)
    s_d = cp.asarray(s0)
    o_d, _ = gdn.delta_rule_chunked(*(cp.asarray(a) for a in (q, k, v, g, b)), s_d)
    assert isinstance(o_d, cp.ndarray)
    eo, es = rel_l2(o_d.get(), o_ref), rel_l2(s_d.get(), s_ref)
    print(f"chunked on CuPy: out rel L2 {eo:.2e}, state rel L2 {es:.2e}")
    assert eo < 1e-4 and es < 1e-4


# ------------------------------------------------------------------ GPU: models
class Pair:
    def __init__(self, path):
        self.path = path
        self.cpu = load_model(self.path)
        self.cuda = load_model(self.path, C.CudaBackend())
        self.pool_cpu = self.cpu.new_page_pool(512, n_seq=2)
        self.pool_cuda = self.cuda.new_page_pool(512, n_seq=3)
        self.n_vocab = self.cpu.config.n_vocab


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe", "qwen3next"])
def pair(request, synthetic):
    if _why is not None:
        pytest.skip(f"CUDA backend unavailable: {_why}")
    return Pair(synthetic(request.param, seed=21))


def _prefill(model, st, toks, ubatch, all_logits=False):
    out = [model.forward(np.asarray(toks[s:s + ubatch], np.int32), st, all_logits=all_logits)
           for s in range(0, len(toks), ubatch)]
    return np.concatenate(out) if all_logits else out[-1]


def _prompt(n, n_vocab, seed):
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


@gpu
def test_prefill_logits_and_state_match_cpu(pair):
    import cupy as cp
    toks = _prompt(101, pair.n_vocab, 1)
    sc, sg = pair.cpu.new_state(pair.pool_cpu), pair.cuda.new_state(pair.pool_cuda)
    ref = _prefill(pair.cpu, sc, toks, 37, all_logits=True)
    got = _prefill(pair.cuda, sg, toks, 37, all_logits=True)
    err = rel_l2(got, ref)
    print(f"{pair.cpu.variant}: prefill logits rel L2 {err:.2e}, max abs {np.abs(got - ref).max():.2e}")
    assert np.isfinite(got).all() and err < LOGITS_REL_L2
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.9
    for layer in sc.running:
        for name in ("conv", "ssm"):
            a = sg.running[layer][name]
            assert isinstance(a, cp.ndarray) and a.dtype == cp.float32     # the running state stays on the device
            e = rel_l2(a.get(), sc.running[layer][name])
            print(f"  layer {layer} {name}: state rel L2 {e:.2e}")
            assert e < STATE_REL_L2
    # decode steps (the recurrent and conv kernels) continue from the prefill
    for t in toks[:5]:
        lc = pair.cpu.forward(np.array([t], np.int32), sc)
        lg = pair.cuda.forward(np.array([t], np.int32), sg)
        e = rel_l2(lg, lc)
        print(f"  decode step logits rel L2 {e:.2e}")
        assert e < LOGITS_REL_L2
    sc.release()
    sg.release()


@gpu
def test_greedy_64_tokens_match_cpu(pair):
    toks = _prompt(100, pair.n_vocab, 2)
    sc, sg = pair.cpu.new_state(pair.pool_cpu), pair.cuda.new_state(pair.pool_cuda)
    lc, lg = _prefill(pair.cpu, sc, toks, 32), _prefill(pair.cuda, sg, toks, 32)
    ref, got = [], []
    for _ in range(N_GREEDY):
        ref.append(int(np.argmax(lc)))
        lc = pair.cpu.forward(np.array([ref[-1]], np.int32), sc)
    for _ in range(N_GREEDY):
        got.append(int(np.argmax(lg)))
        lg = pair.cuda.forward(np.array([got[-1]], np.int32), sg)
    print(f"{pair.cpu.variant}: cuda {got[:12]} cpu {ref[:12]}")

    def cpu_logits_after(prefix):
        s2 = pair.cpu.new_state(pair.pool_cpu)
        lr = _prefill(pair.cpu, s2, np.concatenate([toks, np.asarray(prefix, np.int32)]), 64)
        s2.release()
        return lr
    assert_parts_at_near_tie(got, ref, cpu_logits_after, NEAR_TIE_LOGIT)
    sc.release()
    sg.release()


@gpu
def test_cuda_state_capture_restore_round_trip(pair):
    m = pair.cuda
    toks = _prompt(90, pair.n_vocab, 3)
    st = m.new_state(pair.pool_cuda)
    m.forward(toks[:60], st)
    snap, h60 = st.capture(), st.hashes()
    assert snap.nbytes() >= m.running_state_nbytes() > 0
    want = m.forward(toks[60:], st)
    m.forward(np.array([5], np.int32), st)
    assert st.hashes()["running"] != h60["running"]
    st.restore(snap)
    assert st.hashes() == h60 and st.pos == 60
    got = m.forward(toks[60:], st)
    assert rel_l2(got, want) < 1e-6
    st.reset()
    assert all(float(abs(a).max()) == 0.0 for parts in st.running.values() for a in parts.values())
    st.release()


@gpu
def test_cuda_chunked_equals_recurrent_mode(pair):
    m = pair.cuda
    toks = _prompt(70, pair.n_vocab, 4)
    try:
        m.gdn_mode = "chunked"
        a = m.new_state(pair.pool_cuda)
        la = m.forward(toks, a, all_logits=True)
        m.gdn_mode = "recurrent"                          # the recurrent kernel over 70 tokens
        b = m.new_state(pair.pool_cuda)
        lb = m.forward(toks, b, all_logits=True)
    finally:
        m.gdn_mode = "auto"
    err = rel_l2(la, lb)
    print(f"{m.variant} CUDA chunked vs recurrent: logits rel L2 {err:.2e}")
    assert err < 1e-3
    for layer in a.running:
        assert rel_l2(_host(a.running[layer]["ssm"]), _host(b.running[layer]["ssm"])) < 1e-3
    a.release()
    b.release()


@gpu
def test_cuda_mtp_head_matches_cpu(pair):
    if pair.cpu.mtp is None:
        pytest.skip("no MTP layer")
    toks = _prompt(30, pair.n_vocab, 6)
    nxt = np.append(toks[1:], np.int32(7))
    out = []
    for m, pool in ((pair.cpu, pair.pool_cpu), (pair.cuda, pair.pool_cuda)):
        st = m.new_state(pool)
        hid = m.forward_hidden(toks, st)
        out.append(_host(m.mtp_logits(hid, nxt, m.new_mtp_kv(64))))
        st.release()
    err = rel_l2(out[1], out[0])
    print(f"{pair.cpu.variant} MTP logits CUDA vs CPU rel L2 {err:.2e}")
    assert err < LOGITS_REL_L2


@gpu
def test_bench_hybrid_runs_tiny(tiny_bench_file):
    r = bench_h.bench_hybrid(tiny_bench_file, prompts=(64,), depths=(0, 40), n_gen=4, ubatch=32)
    assert set(r) == {"prompt", "prompt_generic", "prompt_chunked", "decode", "decode_generic", "plan", "moe_path"}
    assert set(r["prompt_generic"]) == ({64} if r["plan"] else set())
    assert set(r["prompt"]) == {64} and set(r["prompt_chunked"]) == {64} and set(r["decode"]) == {0, 40}
    assert set(r["decode_generic"]) == ({0} if r["plan"] else set())
    assert all(v > 0 for k, d in r.items() if k not in ("plan", "moe_path") for v in d.values())


# ------------------------------------------------------------------ CPU: numpy mirrors of the warp delta-rule kernel
def _mirror_reduce_scatter(p):
    """native/cuda/gdn.cu warp_reduce_scatter<N>, lane by lane: p (32 lanes, N values) -> (32,) the value each lane
    returns (lane l: the warp sum of value l >> (5 - log2 N))."""
    p = p.copy()
    n = p.shape[1]
    log = int(np.log2(n))
    lanes = np.arange(32)
    for lv in range(log):
        half, m = n >> (lv + 1), 16 >> lv
        hi = (lanes & m) != 0
        send = np.where(hi[:, None], p[:, :half], p[:, half:2 * half])
        keep = np.where(hi[:, None], p[:, half:2 * half], p[:, :half])
        p[:, :half] = keep + send[lanes ^ m]                   # __shfl_xor_sync(send, m)
    out = p[:, 0].copy()
    m = 16 >> log
    while m >= 1:
        out = out + out[lanes ^ m]
        m >>= 1
    return out


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_warp_reduce_scatter_mirror_gives_each_lane_its_sum(n):
    p = np.random.default_rng(n).standard_normal((32, n))
    got = _mirror_reduce_scatter(p)
    want = p.sum(axis=0)[np.arange(32) >> (5 - int(np.log2(n)))]
    assert np.allclose(got, want)


@pytest.mark.parametrize("u,cols,n", [(4, 4, 9), (4, 2, 5), (8, 1, 3), (2, 4, 7)])
def test_warp_kernel_order_of_operations_mirror(u, cols, n):
    """The warp kernel's per-token arithmetic (kv from the state before the decay, times exp(g); S = exp(g) S + k u^T;
    outputs of a token group summed by the reduce-scatter and written by lane % (32 / (U C)) == 0), in float64 numpy
    for one value head, against gdn.delta_rule_recurrent."""
    dk, dv = 64, 2 * cols
    R = dk // 32
    q, k, v, g, b, s0 = _gdn_inputs(n, 1, dk, dv, seed=u + cols)
    s_ref = s0.copy()
    o_ref, _ = gdn.delta_rule_recurrent(q, k, v, g, b, s_ref)
    scale = 1.0 / np.sqrt(dk)
    out = np.zeros((n, dv))
    state = s0[0].astype(np.float64)
    for c0 in range(0, dv, cols):                              # one warp per column tile
        s = state[:, c0:c0 + cols].reshape(32, R, cols).copy()   # lane l: rows R l .. R l + R - 1
        for t0 in range(0, n, u):
            op = np.zeros((32, u * cols))
            for j in range(u):
                t = t0 + j
                if t >= n:
                    continue
                kk = k[t, 0].reshape(32, R)
                qq = q[t, 0].reshape(32, R)
                eg = np.exp(g[t, 0])
                kv = (s * kk[:, :, None]).sum(axis=1).sum(axis=0)    # butterfly: every lane has the sums
                uu = (v[t, 0, c0:c0 + cols] - eg * kv) * b[t, 0]
                s = kk[:, :, None] * uu[None, None, :] + eg * s
                op[:, j * cols:(j + 1) * cols] = (s * qq[:, :, None]).sum(axis=1)
            o = _mirror_reduce_scatter(op)
            sh = 32 // (u * cols)
            for lane in range(0, 32, sh):
                idx = lane // sh
                j, c = idx // cols, idx % cols
                if t0 + j < n:
                    out[t0 + j, c0 + c] = o[lane] * scale
        state[:, c0:c0 + cols] = s.reshape(dk, cols)
    assert rel_l2(out, o_ref[:, 0]) < 1e-5 and rel_l2(state, s_ref[0]) < 1e-5
