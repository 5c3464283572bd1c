"""Gated DeltaNet ops (strata/backend/gdn.py) against transformers' reference torch functions, and chunked == recurrent.

Tolerances (fp32): outputs and states within 1e-4 absolute (values are O(1); measured ~1e-6).
"""
import numpy as np
import pytest

from strata.backend import gdn

torch = pytest.importorskip("torch")
qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

TOL = 1e-4


def _inputs(n, h=4, dk=16, dv=24, seed=0):
    rng = np.random.default_rng(seed)
    q = gdn.l2_norm(rng.standard_normal((n, h, dk)).astype(np.float32))
    k = gdn.l2_norm(rng.standard_normal((n, h, dk)).astype(np.float32))
    v = rng.standard_normal((n, h, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((n, h))) * 0.5).astype(np.float32)
    b = gdn.sigmoid(rng.standard_normal((n, h))).astype(np.float32)
    s0 = (rng.standard_normal((h, dk, dv)) * 0.1).astype(np.float32)
    return q, k, v, g, b, s0


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))[None]


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_chunked_and_recurrent_match_transformers(n):
    q, k, v, g, b, s0 = _inputs(n)
    o_c, s_c = gdn.delta_rule_chunked(q, k, v, g, b, s0.copy())
    o_r, s_r = gdn.delta_rule_recurrent(q, k, v, g, b, s0.copy())
    ro, rs = qn.torch_chunk_gated_delta_rule(_t(q), _t(k), _t(v), _t(g), _t(b), chunk_size=64,
                                             initial_state=torch.from_numpy(s0)[None], output_final_state=True)
    ro2, rs2 = qn.torch_recurrent_gated_delta_rule(_t(q), _t(k), _t(v), _t(g), _t(b),
                                                   initial_state=torch.from_numpy(s0)[None], output_final_state=True)
    for o, s in ((o_c, s_c), (o_r, s_r)):
        assert np.abs(o - ro[0].numpy()).max() < TOL
        assert np.abs(s - rs[0].numpy()).max() < TOL
        assert np.abs(o - ro2[0].numpy()).max() < TOL
        assert np.abs(s - rs2[0].numpy()).max() < TOL


def test_chunked_state_at_a_cut_point_equals_recurrent():
    q, k, v, g, b, s0 = _inputs(150, seed=3)
    s_a = s0.copy()
    o1, _ = gdn.delta_rule_chunked(q[:97], k[:97], v[:97], g[:97], b[:97], s_a)
    o2, _ = gdn.delta_rule_chunked(q[97:], k[97:], v[97:], g[97:], b[97:], s_a)
    s_b = s0.copy()
    o, _ = gdn.delta_rule_recurrent(q, k, v, g, b, s_b)
    assert np.abs(np.concatenate([o1, o2]) - o).max() < TOL
    assert np.abs(s_a - s_b).max() < TOL


def test_causal_conv_window_matches_torch_conv1d():
    rng = np.random.default_rng(5)
    n, c, kk = 40, 12, 4
    x = rng.standard_normal((n, c)).astype(np.float32)
    w = rng.standard_normal((c, kk)).astype(np.float32)
    ref = qn.causal_conv1d_fn(torch.from_numpy(x.T.copy())[None], torch.from_numpy(w), None, activation="silu")
    ref = ref[0].numpy().T
    win = np.zeros((kk - 1, c), np.float32)
    y1, win = gdn.causal_conv1d(x[:17], w, win)
    ys = []
    for t in range(17, n):              # the rest one token at a time, as decode does
        y, win = gdn.causal_conv1d(x[t:t + 1], w, win)
        ys.append(y)
    y = np.concatenate([y1] + ys)
    assert np.abs(y - ref).max() < 1e-5
    assert np.array_equal(win, x[-(kk - 1):])


def test_l2_norm_and_gated_norm():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    assert np.abs(gdn.l2_norm(x) - qn.l2norm(torch.from_numpy(x)).numpy()).max() < 1e-6
    z = rng.standard_normal((5, 3, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    m = qn.Qwen3NextRMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(w))
        ref = m(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    assert np.abs(gdn.gated_rms_norm(x, w, z, 1e-6) - ref).max() < 1e-5
