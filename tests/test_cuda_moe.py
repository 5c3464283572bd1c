"""MoE layers on the GPU (native/cuda/moe.cu, strata/backend/cuda/moe.py) against the CPU path (strata/backend/moe.py).

Runs anywhere (no GPU): numpy mirrors of the kernels' index arithmetic against strata.backend.moe.moe_ffn on f32
stand-in weights: the routing kernel's top-k rounds (ties to the lower id, renormalisation, the shared slot), the
decode slot layout (k routed slots through the expert table, the shared expert's gate in slot k), and the grouped
prefill (strata_moe_group's counts, tiles and sorted assignments in an arbitrary order within an expert,
strata_moe_mm's input / output row maps, strata_moe_combine), the tile bound, the q8_1 row layout, the plan's
reasons to refuse a MoE model, and the `moe` path a stage reports in /status.

GPU tests (skipped with the reason without CuPy, a GPU or the kernel library) on small synthetic qwen35moe and MoE
qwen3next models (n_embd 128, 8 layers = 6 GDN + 2 gated attention, 16 experts of which 4 per token, expert FFN 64,
shared expert 96; Q8_0 / Q4_0 matrices):
  * one MoE layer, decode launches and the grouped prefill (1, 3 and 37 rows) against moe_ffn on the CPU backend
    (LAYER_REL_L2), the device routing ids equal to the CPU's wherever the CPU's k-th and (k+1)-th probabilities
    are apart;
  * 32 greedy tokens by decode_greedy identical to the CPU backend's, or the first difference a near tie (< 0.25
    logit on the CPU: the rule of tests/test_cuda_qwen35.py);
  * plan decode steps and the plan's prefill against the generic model.forward on the same backend;
  * graphs vs eager launches: identical tokens;
  * the engine on cuda:0 with 1 and 2 stages: the same greedy tokens, and each stage reports the graph MoE path.
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata.gguf import synth
from strata.backend import cuda as C
from strata.backend import moe as M
from strata.backend.cuda import moe as CM
from strata.backend.cuda import qwen35 as Q
from strata.models.registry import load_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cuda_marks import CUDA_WHY as _why  # noqa: E402
from tests.cuda_marks import assert_parts_at_near_tie, default_model_missing, gpu, rel_l2  # noqa: E402
from tests.cuda_marks import host as _host  # noqa: E402

_no_model = default_model_missing()
needs_model = pytest.mark.skipif(_no_model is not None,
                                 reason=f"synthetic models need the default model's tokenizer: {_no_model}")

TILE = 8                 # strata_cuda.h STRATA_MOE_TILE
# One MoE layer, device vs the CPU backend's moe_ffn: int8 (q8_1) activations into the expert matvecs on the device
# (and the f16 GEMMs of the router and the shared expert in the prefill) against the CPU's products.
LAYER_REL_L2 = 3e-2
# A token whose k-th and (k+1)-th routing probabilities (CPU) are closer than this may take the other expert on the
# device (the logits' rounding differs): its layer output is not compared.
TIE_GAP = 3e-3
# Plan vs the generic forward on the same backend: both on q8_1 activations, quantized at different points; a
# router's near tie may swap an expert for one token in one layer of one of them, which moves the logits by more
# than the rounding (a wrong layout or index moves them by ~1).
STEP_REL_L2 = 1e-1
ROUTED_REL_L2 = 0.25       # plan vs the generic forward over many tokens, where routing near ties flip experts
N_GREEDY = 32
NEAR_TIE_LOGIT = 0.25


def _spec(arch="qwen35moe", qtype="Q8_0", **kw):
    base = {"n_embd": 128, "n_layer": 8, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 256, "head_k_dim": 64,
            "head_v_dim": 64, "n_k_heads": 2, "n_v_heads": 4, "n_mtp": 0, "qtype": qtype, "embd_qtype": "Q8_0",
            "n_expert": 16, "n_expert_used": 4, "n_ff_exp": 64, "n_ff_shexp": 96, "seed": 5}
    base.update(kw)
    return synth.preset(arch, "tiny", **base)


# ------------------------------------------------------------------ CPU: numpy mirrors of the kernels
class _NpBackend:
    """The three ops moe_ffn uses, on f32 numpy weights (n_out, n_in)."""

    def matmul(self, x, w):
        return (x @ w.T).astype(np.float32)

    def swiglu(self, g, u):
        return (g / (1.0 + np.exp(-g)) * u).astype(np.float32)

    def to_host(self, x):
        return x


def _silu_mul(g, u):
    return g / (1.0 + np.exp(-g)) * u


def _mirror_route(logits, k, renorm, x=None, sg=None, shared=False):
    """k_moe_route: softmax, k rounds of argmax (largest p, lower id on ties; the chosen p set to -1), the sum of
    the chosen in round order, slot k = (n_expert, sigmoid(x . sg))."""
    n, ne = logits.shape
    ks = k + int(shared)
    ids, wts = np.zeros((n, ks), np.int32), np.zeros((n, ks), np.float32)
    for t in range(n):
        p = np.exp(logits[t] - logits[t].max()).astype(np.float32)
        p = (p / p.sum()).astype(np.float32)
        ci, cw = [], []
        for _ in range(k):
            best, bv = -1, np.float32(-1)
            for e in range(ne):              # the threads' strided scan and the reductions pick the same element
                if p[e] > bv or (p[e] == bv and e < best):
                    best, bv = e, p[e]
            ci.append(best)
            cw.append(bv)
            p[best] = -1
        s = np.float32(0)
        for w in cw:
            s = np.float32(s + w)
        ids[t, :k] = ci
        wts[t, :k] = [w / s if renorm else w for w in cw]
        if shared:
            ids[t, k] = ne
            wts[t, k] = 1.0 if sg is None else 1.0 / (1.0 + np.exp(-np.float32(x[t] @ sg)))
    return ids, wts


def _mirror_group(ids, k, ne, rng):
    """k_moe_group: per-expert counts, exclusive prefixes, tiles of <= TILE in expert order, the rest count 0, the
    assignments a = t * k + j scattered to their expert's run in an arbitrary order (the atomics)."""
    n = ids.shape[0]
    na = n * k
    a_e = np.array([ids[a // k, a % k] for a in range(na)], np.int64)
    cnt = np.bincount(a_e, minlength=ne)
    off = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.int64)
    nt = (cnt + TILE - 1) // TILE
    toff = np.concatenate([[0], np.cumsum(nt)[:-1]]).astype(np.int64)
    max_tiles = na // TILE + ne                       # strata_moe_max_tiles
    assert nt.sum() <= max_tiles
    tiles = np.zeros((max_tiles, 3), np.int64)
    for e in range(ne):
        for i in range(nt[e]):
            tiles[toff[e] + i] = (e, off[e] + i * TILE, min(TILE, cnt[e] - i * TILE))
    order = np.full(na, -1, np.int64)
    cur = off.copy()
    for a in rng.permutation(na):
        order[cur[a_e[a]]] = a
        cur[a_e[a]] += 1
    return order, tiles


def _mirror_mm(tab0, tab1, tiles, order, k, in_by_token, X, out_by_assign, n_rows_out):
    """k_moe_mm: per tile (e, p0, c) the TILE positions p0 + min(i, c - 1), stored for i < c; W_e = tab0[e] stacked
    over tab1[e]; input row order[p] // k (in_by_token) or p, output row order[p] (out_by_assign) or p."""
    n_out = tab0[0].shape[0] + (tab1[0].shape[0] if tab1 is not None else 0)
    Y = np.full((n_rows_out, n_out), np.nan, np.float32)
    for e, p0, c in tiles:
        if c <= 0:
            continue
        W = tab0[e] if tab1 is None else np.concatenate([tab0[e], tab1[e]])
        for i in range(TILE):
            p = p0 + min(i, c - 1)
            a = order[p]
            xr = X[a // k] if in_by_token else X[p]
            if i < c:
                Y[a if out_by_assign else p] = W @ xr
    return Y


def _random_moe(rng, E=64, ne=12, F=32, Fs=48, shared=True):
    s = 1.0 / np.sqrt(E)
    f = SimpleNamespace(router=rng.standard_normal((ne, E)).astype(np.float32) * s,
                        gate=[rng.standard_normal((F, E)).astype(np.float32) * s for _ in range(ne)],
                        up=[rng.standard_normal((F, E)).astype(np.float32) * s for _ in range(ne)],
                        down=[rng.standard_normal((E, F)).astype(np.float32) / np.sqrt(F) for _ in range(ne)],
                        shared=None, shared_gate=None)
    if shared:
        f.shared = (rng.standard_normal((Fs, E)).astype(np.float32) * s,
                    rng.standard_normal((Fs, E)).astype(np.float32) * s,
                    rng.standard_normal((E, Fs)).astype(np.float32) / np.sqrt(Fs))
        f.shared_gate = rng.standard_normal(E).astype(np.float32) * s
    return f


def _shared_out(f, x):
    sg, su, sd = f.shared
    return (_silu_mul(x @ sg.T, x @ su.T) @ sd.T).astype(np.float32)


@pytest.mark.parametrize("renorm", [True, False])
def test_route_mirror_matches_route_with_ties(renorm):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((40, 16)).astype(np.float32)
    logits[3, [2, 9, 11]] = logits[3].max() + 1.0          # a three-way tie at the top: lower ids first
    logits[5] = 0.25                                       # all equal
    x, sg = rng.standard_normal((40, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    ids, wts = _mirror_route(logits, 4, renorm, x, sg, shared=True)
    ref_ids, ref_w = M.route(logits, 4, renorm)
    assert (ids[:, :4] == ref_ids).all()
    assert np.abs(wts[:, :4] - ref_w).max() < 1e-6
    assert list(ids[3, :3]) == [2, 9, 11] and list(ids[5]) == [0, 1, 2, 3, 16]
    assert (ids[:, 4] == 16).all()
    np.testing.assert_allclose(wts[:, 4], 1.0 / (1.0 + np.exp(-(x @ sg))), rtol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_decode_slot_layout_mirror_matches_moe_ffn(shared):
    """strata_moe_gate_up / strata_moe_down for one token: slot j < k through the table entry ids[j], the weighted
    sum over the slots, plus the shared expert scaled by wts[k]."""
    rng = np.random.default_rng(2)
    f = _random_moe(rng, shared=shared)
    k, renorm = 3, True
    x = rng.standard_normal((1, 64)).astype(np.float32)
    ids, wts = _mirror_route(x @ f.router.T, k, renorm, x, f.shared_gate, shared)
    act = np.stack([_silu_mul(f.gate[ids[0, j]] @ x[0], f.up[ids[0, j]] @ x[0]) for j in range(k)])
    y = sum(wts[0, j] * (f.down[ids[0, j]] @ act[j]) for j in range(k))
    if shared:
        y = y + wts[0, k] * _shared_out(f, x)[0]
    ref = M.moe_ffn(_NpBackend(), x, f.router, f.gate, f.up, f.down, k, renorm, f.shared, f.shared_gate)
    assert rel_l2(y, ref[0]) < 1e-5


@pytest.mark.parametrize("n", [1, 2, 7, 64, 301])
def test_grouped_prefill_mirror_matches_moe_ffn(n):
    """strata_moe_group + the gate|up strata_moe_mm (rows by token, output in sorted order) + SwiGLU + the down
    strata_moe_mm (input in sorted order, output by assignment) + strata_moe_combine == moe_ffn; every sorted
    position is written exactly once, whatever the order within an expert."""
    rng = np.random.default_rng(n)
    ne, k, F = 12, 4, 32
    f = _random_moe(rng, ne=ne, F=F)
    x = rng.standard_normal((n, 64)).astype(np.float32)
    if n == 301:
        x[:200] = x[0]              # many tokens on the same experts: runs of several tiles
    ids, wts = _mirror_route(x @ f.router.T, k, True, x, f.shared_gate, True)
    order, tiles = _mirror_group(ids, k, ne, rng)
    assert sorted(order.tolist()) == list(range(n * k))
    live = tiles[tiles[:, 2] > 0]
    assert live[:, 2].sum() == n * k and (live[:, 2] <= TILE).all()
    for e, p0, c in live:                                  # each tile lies inside its expert's run
        assert all(ids[order[p] // k, order[p] % k] == e for p in range(p0, p0 + c))
    gu = _mirror_mm(f.gate, f.up, tiles, order, k, True, x, False, n * k)
    assert not np.isnan(gu).any()
    act = _silu_mul(gu[:, :F], gu[:, F:])                  # strata_moe_q8_rows with glu (without the rounding)
    yd = _mirror_mm(f.down, None, tiles, order, k, False, act, True, n * k)
    assert not np.isnan(yd).any()
    out = np.zeros_like(x)
    for t in range(n):                                     # strata_moe_combine
        out[t] = sum(wts[t, j] * yd[t * k + j] for j in range(k)) + wts[t, k] * _shared_out(f, x[t:t + 1])[0]
    ref = M.moe_ffn(_NpBackend(), x, f.router, f.gate, f.up, f.down, k, True, f.shared, f.shared_gate)
    assert rel_l2(out, ref) < 1e-5


@pytest.mark.parametrize("F,F_last,n_slots", [(64, 64, 4), (64, 96, 5), (512, 1024, 9), (96, 32, 3), (32, 32, 1)])
def test_decode_slot_offsets_cover_every_sub_block_once(F, F_last, n_slots):
    """k_moe_down's flattened index t -> (slot j, sub-block b) over (n_slots - 1) * F / 32 + F_last / 32 values
    covers each slot's sub-blocks exactly once; k_moe_gate_up's blocks (bx, slot) with 32 bx < F_j write disjoint
    act / q8_1 ranges (slot j at j * F and j * q8_row_bytes(F), F_j long) inside the buffers decode_buffers makes
    (k * F + max(F, F_last) floats, k * q8_row_bytes(F) + q8_row_bytes(max(F, F_last)) bytes)."""
    nu, last = F // 32, n_slots - 1
    n_routed = last * nu
    seen = set()
    for t in range(n_routed + F_last // 32):
        j = t // nu if t < n_routed else last
        b = t - j * nu
        assert 0 <= b < (F_last if j == last else F) // 32
        seen.add((j, b))
    assert len(seen) == n_routed + F_last // 32
    k = n_slots - 1
    acts, q8s = set(), []
    for j in range(n_slots):
        Fj = F_last if j == last else F
        for bx in range(max(F, F_last) // 32):
            if 32 * bx >= Fj:
                continue
            idx = {j * F + 32 * bx + lane for lane in range(32)}
            assert not idx & acts
            acts |= idx
        q8s.append((j * CM.q8_row_bytes(F), j * CM.q8_row_bytes(F) + Fj + Fj // 4))
    assert max(acts) < k * F + max(F, F_last)
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(q8s, q8s[1:]))
    assert q8s[-1][1] <= k * CM.q8_row_bytes(F) + CM.q8_row_bytes(max(F, F_last))


def test_shared_expert_rides_along_only_with_the_experts_types():
    def dw(t, shape):
        return CM.DeviceWeight("w", t, shape, None)
    ffn = SimpleNamespace(gate=[dw(8, (64, 128))], up=[dw(8, (64, 128))], down=[dw(8, (128, 64))],
                          shared=(dw(8, (96, 128)), dw(8, (96, 128)), dw(8, (128, 96))))
    assert CM.shared_rides_along(ffn)
    ffn.shared = (dw(8, (96, 128)), dw(8, (96, 128)), dw(14, (128, 96)))      # Q6_K down, Q8_0 experts
    assert not CM.shared_rides_along(ffn)
    ffn.down, ffn.shared = [dw(12, (128, 256))], (dw(8, (96, 128)), dw(8, (96, 128)), dw(12, (128, 96)))
    assert not CM.shared_rides_along(ffn)                                       # 96 is not whole Q4_K blocks
    ffn.shared = None
    assert not CM.shared_rides_along(ffn)


def test_tile_bound_holds_for_skewed_counts():
    """strata_moe_max_tiles = n k / TILE + n_expert bounds the tiles of any assignment."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n, k, ne = int(rng.integers(1, 90)), int(rng.integers(1, 9)), int(rng.integers(9, 70))
        cnt = np.bincount(rng.choice(min(ne, int(rng.integers(1, ne + 1))), n * k), minlength=ne)
        assert ((cnt + TILE - 1) // TILE).sum() <= n * k // TILE + ne


def test_q8_row_layout():
    """q8_row_bytes: n int8 then n / 32 float2, padded to 16 bytes (load_xq's loads; the float2 8-byte aligned)."""
    for n in (32, 64, 96, 512, 768, 1536):
        b = CM.q8_row_bytes(n)
        assert b % 16 == 0 and n + n // 4 <= b < n + n // 4 + 16 and n % 8 == 0


def test_python_limits_match_the_kernels():
    """moe.py's limits and int8 types are the header's enum and matvec.cuh's DISPATCH_Q8_TYPE."""
    import re
    h = (ROOT / "native" / "cuda" / "strata_cuda.h").read_text()
    enum = dict((k, int(v)) for k, v in re.findall(r"(STRATA_MOE_\w+) = (\d+)", h))
    assert enum == {"STRATA_MOE_MAX_SLOTS": CM.MAX_SLOTS, "STRATA_MOE_MAX_EXPERTS": CM.MAX_EXPERTS,
                    "STRATA_MOE_TILE": TILE}
    cuh = (ROOT / "native" / "cuda" / "matvec.cuh").read_text()
    q8 = cuh[cuh.index("#define DISPATCH_Q8_TYPE"):].split("default:")[0]
    names = {"T_Q4_0": 2, "T_Q4_1": 3, "T_Q8_0": 8, "T_Q4_K": 12, "T_Q5_K": 13, "T_Q6_K": 14}
    assert sorted({names[n] for n in re.findall(r"case (T_\w+):", q8)}) == sorted(CM.Q8_TYPES)


def _fake_moe_model(**kw):
    w = SimpleNamespace(ggml_type=8, shape=(64, 128))
    dev = CM.DeviceWeight("w", 8, (64, 128), None)
    ffn = SimpleNamespace(gate=[dev], up=[dev], down=[CM.DeviceWeight("d", 8, (128, 64), None)],
                          shared=(w, w, w))
    base = dict(n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff_shexp=96, config=SimpleNamespace(n_embd=128),
                layers=[SimpleNamespace(ffn=ffn)])
    base.update(kw)
    return SimpleNamespace(**base)


def test_moe_unsupported_reasons():
    assert CM.unsupported(_fake_moe_model()) is None
    assert "int8" in CM.unsupported(_fake_moe_model(), dp4a=False)
    assert "at most 2048" in CM.unsupported(_fake_moe_model(n_expert=4096))
    assert "at most 31" in CM.unsupported(_fake_moe_model(n_expert_used=32))
    assert "multiple of 32" in CM.unsupported(_fake_moe_model(n_ff_exp=48))
    f16 = _fake_moe_model()
    f16.layers[0].ffn.down = [CM.DeviceWeight("d", 1, (128, 64), None)]
    assert "ffn_down_exps of GGML type 1" in CM.unsupported(f16)
    cpu = _fake_moe_model()
    cpu.layers[0].ffn.gate = [SimpleNamespace(ggml_type=8)]
    assert CM.unsupported(cpu) == "weights are not on the CUDA backend"


@needs_model
def test_cpu_moe_model_reports_the_generic_path(tmp_path):
    """The plan refuses a CPU-loaded MoE model only for its weights, and a stage running the model itself reports
    the generic MoE path in its status (dense models report none)."""
    from strata.engine import Engine
    path = synth.write_synthetic(tmp_path / "moe.gguf", _spec())
    m = load_model(path)
    assert Q.unsupported(m).endswith("weights are not on the CUDA backend")
    e = Engine(path, n_ctx=256)
    assert e.stages[0].status()["moe"] == {"decode": "generic", "prefill": "generic"}
    assert e.device_info()["moe"] == {"decode": "generic", "prefill": "generic"}
    dense = Engine(synth.write_synthetic(tmp_path / "dense.gguf", synth.preset("qwen35", "tiny", n_mtp=0)), n_ctx=256)
    assert "moe" not in dense.stages[0].status() and "moe" not in dense.device_info()


# ------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("ne,k,shared", [(16, 4, True), (64, 8, True), (512, 10, False), (7, 7, True)])
def test_route_kernel_matches_route(ne, k, shared):
    """strata_moe_route on random logits (with exact ties) == strata.backend.moe.route: the same ids in the same
    order, weights within 1e-5 (fast-math expf); the shared slot's id and gate."""
    import cupy as cp
    from strata.backend.cuda.library import lib, ptr, stream_ptr
    rng = np.random.default_rng(ne)
    n, E = 50, 96
    logits = rng.standard_normal((n, ne)).astype(np.float32) * 2
    logits[1, : min(ne, 5)] = 3.0                                # ties at the top
    logits[2] = -1.5                                             # all equal
    x, sg = rng.standard_normal((n, E)).astype(np.float32), rng.standard_normal(E).astype(np.float32) * 0.1
    # device copies held in names: a temporary's memory could be reused by the pool before the kernel reads it
    logits_d, x_d, sg_d = cp.asarray(logits), cp.asarray(x), cp.asarray(sg)
    for renorm in (True, False):
        ks = k + int(shared)
        ids, wts = cp.full((n, ks), -7, cp.int32), cp.zeros((n, ks), cp.float32)
        rc = lib().strata_moe_route(stream_ptr(), ptr(logits_d), n, ne, k, int(renorm), ptr(x_d),
                                    ptr(sg_d) if shared else ptr(None), E, int(shared), ptr(ids), ptr(wts))
        assert rc == 0
        ref_ids, ref_w = M.route(logits, k, renorm)
        assert (_host(ids)[:, :k] == ref_ids).all()
        assert np.abs(_host(wts)[:, :k] - ref_w).max() < 1e-5
        if shared:
            assert (_host(ids)[:, k] == ne).all()
            np.testing.assert_allclose(_host(wts)[:, k], 1 / (1 + np.exp(-(x @ sg))), rtol=1e-5)
    assert lib().strata_moe_route(stream_ptr(), ptr(logits_d), n, ne, ne + 1, 1, ptr(None), ptr(None), E,
                                  0, ptr(ids), ptr(wts)) != 0               # k > n_expert: refused


def _q8_rows_host(raw, n_rows, n_cols):
    """The f32 values q * d of q8_1 rows in moe.cu's row layout (uint8 buffer)."""
    rb = CM.q8_row_bytes(n_cols)
    rows = raw[:n_rows * rb].reshape(n_rows, rb)
    q = rows[:, :n_cols].view(np.int8).astype(np.float64)
    ds = rows[:, n_cols:n_cols + n_cols // 4].copy().view(np.float32).reshape(n_rows, n_cols // 32, 2)
    return (q.reshape(n_rows, n_cols // 32, 32) * ds[:, :, :1]).reshape(n_rows, n_cols), ds


@gpu
@pytest.mark.parametrize("glu", [False, True])
def test_q8_rows_kernel_matches_numpy(glu):
    """strata_moe_q8_rows: llama.cpp's quantize_q8_1 per 32 values (d = amax / 127, round half to even, the sum of
    q), of x or of silu(gate) * up."""
    import cupy as cp
    from strata.backend.cuda.library import lib, ptr, stream_ptr
    rng = np.random.default_rng(4)
    n, F = 9, 96
    x = rng.standard_normal((n, 2 * F if glu else F)).astype(np.float32)
    x[3, :32] = 0.0                                              # an all-zero block: d = 0, q = 0
    out = cp.zeros(n * CM.q8_row_bytes(F), cp.uint8)
    x_d = cp.asarray(x)
    assert lib().strata_moe_q8_rows(stream_ptr(), ptr(x_d), x.shape[1], int(glu), n, F, ptr(out)) == 0
    v = (x[:, :F] / (np.float32(1) + np.exp(-x[:, :F])) * x[:, F:]).astype(np.float32) if glu else x
    vb = v.reshape(n, F // 32, 32)
    d = (np.abs(vb).max(-1) / np.float32(127)).astype(np.float32)
    q = np.where(d[..., None] == 0, 0, np.rint(vb / np.where(d == 0, 1, d)[..., None])).astype(np.int64)
    got, ds = _q8_rows_host(_host(out), n, F)
    rb = CM.q8_row_bytes(F)
    gq8 = _host(out).reshape(n, rb)[:, :F].view(np.int8).reshape(n, F // 32, 32)
    assert np.abs(gq8 - q).max() <= (1 if glu else 0)            # glu: expf vs numpy exp may flip a rounding
    np.testing.assert_allclose(ds[:, :, 0], d, rtol=1e-6 if glu else 0)
    np.testing.assert_allclose(ds[:, :, 1], d * gq8.sum(-1), rtol=1e-6)


@gpu
@pytest.mark.parametrize("lanes", ["", "16", "32"])
@pytest.mark.parametrize("ggml_type", [2, 3, 8, 12, 13, 14])
def test_grouped_matvec_matches_dequantized_weights(ggml_type, lanes, monkeypatch):
    """strata_moe_mm on random blocks of every int8 type (3 experts, 2 per token, 11 tokens, 44 rows: a partial row
    block; gate | up stacked from two tables) == float64 numpy of gguf-py's dequantized weights times the q8_1 rows,
    rel < 1e-5, for both row maps (by token -> sorted, sorted -> by assignment), with the kernel's lanes per row
    group at its default and at 16 and 32 (STRATA_CUDA_MOE_LANES, read per launch)."""
    import cupy as cp
    monkeypatch.setenv("STRATA_CUDA_MOE_LANES", lanes)
    from strata.backend.cuda import weights as CW
    from strata.backend.cuda.library import lib, ptr, stream_ptr
    from tests.helpers import random_blocks, ref_dequant
    rng = np.random.default_rng(ggml_type)
    ne, k, n, n_in, half = 3, 2, 11, 512, 22
    raw0 = [random_blocks(ggml_type, half, n_in, rng) for _ in range(ne)]
    raw1 = [random_blocks(ggml_type, half, n_in, rng) for _ in range(ne)]
    w0 = [CW.DeviceWeight("g", ggml_type, (half, n_in), cp.asarray(r)) for r in raw0]
    w1 = [CW.DeviceWeight("u", ggml_type, (half, n_in), cp.asarray(r)) for r in raw1]
    t0, t1 = CM.ExpertTable("g", w0), CM.ExpertTable("u", w1)
    W = [np.concatenate([ref_dequant(raw0[e], ggml_type, half, n_in), ref_dequant(raw1[e], ggml_type, half, n_in)])
         for e in range(ne)]
    ids = np.stack([rng.choice(ne, k, replace=False) for _ in range(n)]).astype(np.int32)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    s = stream_ptr()
    xq = cp.zeros(n * CM.q8_row_bytes(n_in), cp.uint8)
    x_d, ids_d = cp.asarray(x), cp.asarray(ids)
    assert lib().strata_moe_q8_rows(s, ptr(x_d), n_in, 0, n, n_in, ptr(xq)) == 0
    xh, _ = _q8_rows_host(_host(xq), n, n_in)
    mt = int(lib().strata_moe_max_tiles(n, k, ne))
    order, tiles = cp.zeros(n * k, cp.int32), cp.zeros((mt, 3), cp.int32)
    assert lib().strata_moe_group(s, ptr(ids_d), n, k, k, ne, ptr(order), ptr(tiles), mt) == 0
    for by_token in (1, 0):
        # by token: input row = the assignment's token, output in sorted order; else input row p (a sorted copy of
        # the token rows), output by assignment
        o = _host(order)
        xin = xq if by_token else cp.asarray(_host(xq).reshape(n, -1)[o // k].reshape(-1))
        y = cp.full((n * k, 2 * half), np.nan, cp.float32)
        assert lib().strata_moe_mm(s, ggml_type, ptr(t0.table), ptr(t1.table), half, ne, ptr(tiles), mt, ptr(order),
                                   k, by_token, ptr(xin), n_in, ptr(y), 2 * half, 1 - by_token) == 0
        got = _host(y)
        want = np.zeros_like(got, dtype=np.float64)
        for p, a in enumerate(o):
            row = p if by_token else a
            want[row] = W[ids[a // k, a % k]] @ xh[a // k]
        e = np.abs(got - want).max() / np.abs(want).max()
        assert e < 1e-5, f"type {ggml_type} by_token {by_token}: rel {e:.2e}"


@gpu
@pytest.mark.parametrize("n,k,ne", [(1, 4, 16), (37, 4, 16), (300, 8, 64), (513, 2, 3)])
def test_group_kernel_matches_mirror(n, k, ne):
    """strata_moe_group == the numpy mirror: the same tiles (expert, first position, count; unused rows count 0)
    and, in each tile's range of `sorted`, the same set of assignments."""
    import cupy as cp
    from strata.backend.cuda.library import lib, ptr, stream_ptr
    rng = np.random.default_rng(n)
    ks = k + 1
    ids = np.stack([rng.choice(ne, k, replace=False) for _ in range(n)]).astype(np.int32)
    if n >= 300:
        ids[: n // 2] = ids[0]                                    # skew: long runs of one expert
    ids_dev = cp.asarray(np.concatenate([ids, np.full((n, 1), ne, np.int32)], axis=1))   # the shared slot is skipped
    mt = int(lib().strata_moe_max_tiles(n, k, ne))
    order, tiles = cp.full(n * k, -1, cp.int32), cp.full((mt, 3), -1, cp.int32)
    assert lib().strata_moe_group(stream_ptr(), ptr(ids_dev), n, k, ks, ne, ptr(order), ptr(tiles), mt) == 0
    want_order, want_tiles = _mirror_group(ids, k, ne, rng)
    got_tiles, got_order = _host(tiles), _host(order)
    assert (got_tiles == want_tiles).all()
    live = want_tiles[want_tiles[:, 2] > 0]
    for e in np.unique(live[:, 0]):                              # an expert's run: the same assignments, any order
        p0, p1 = live[live[:, 0] == e, 1].min(), (live[live[:, 0] == e, 1] + live[live[:, 0] == e, 2]).max()
        assert sorted(got_order[p0:p1]) == sorted(want_order[p0:p1])
    assert sorted(got_order.tolist()) == list(range(n * k))
    assert lib().strata_moe_group(stream_ptr(), ptr(ids_dev), n, k, ks, ne, ptr(order), ptr(tiles), mt - 1) != 0


class Setup:
    def __init__(self, arch, qtype, tmp, **kw):
        self.path = synth.write_synthetic(tmp / f"{arch}_{qtype}.gguf", _spec(arch, qtype, **kw))
        self.cpu = load_model(self.path)
        self.cuda = load_model(self.path, C.CudaBackend())
        assert Q.unsupported(self.cuda) is None, Q.unsupported(self.cuda)
        self.graph = Q.Qwen35GraphModel(self.cuda)
        self.pool = self.cuda.new_page_pool(1024, n_seq=4)
        self.pool_cpu = self.cpu.new_page_pool(512, n_seq=2)
        self.n_vocab = self.cpu.config.n_vocab

    def plan(self):
        return self.graph.plan(self.pool)


SETUPS = [("qwen35moe", "Q8_0", {}), ("qwen35moe", "Q4_0", {"norm_topk": False}), ("qwen3next", "Q8_0", {})]


@pytest.fixture(scope="module", params=SETUPS, ids=lambda p: f"{p[0]}-{p[1]}")
def setup(request, tmp_path_factory):
    if _why is not None:
        pytest.skip(f"CUDA backend unavailable: {_why}")
    if _no_model is not None:
        pytest.skip(_no_model)
    arch, qtype, kw = request.param
    return Setup(arch, qtype, tmp_path_factory.mktemp(f"{arch}{qtype}"), **kw)


def _prompt(n, n_vocab, seed):
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def _route_gap(setup, li, hn):
    """Per row of the normed hn: the CPU's k-th minus (k+1)-th routing probability."""
    be, k = setup.cpu.backend, setup.cpu.n_expert_used
    logits = be.to_host(be.matmul(hn, setup.cpu.layers[li].ffn.router))
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    srt = np.sort(p, 1)[:, ::-1]
    return srt[:, k - 1] - srt[:, k]


def _cpu_ffn(setup, li, x):
    m = setup.cpu
    f = m.layers[li].ffn
    return M.moe_ffn(m.backend, x, f.router, f.gate, f.up, f.down, m.n_expert_used, m.norm_topk, f.shared,
                     f.shared_gate)


@gpu
def test_moe_layer_matches_cpu_reference(setup):
    """One MoE layer: the decode launches on one row (the shared expert as the last slot, and on its own) and the
    grouped prefill on 1 / 3 / 37 rows vs moe_ffn on the CPU backend; the device's routing ids equal the CPU's where its k-th and (k+1)-th probabilities are apart."""
    import cupy as cp
    from strata.backend.cuda.library import stream_ptr
    plan = setup.plan()
    m, E, k = setup.cuda, setup.cuda.config.n_embd, setup.cuda.n_expert_used
    rng = np.random.default_rng(7)
    for li in (0, 3):                                      # a GDN layer's and an attention layer's FFN
        lm = plan.moe[li]
        assert lm.ride                                     # one type throughout: the shared expert rides along
        x = rng.standard_normal((1, E)).astype(np.float32)
        want = _cpu_ffn(setup, li, x)[0]
        plan.d["hn"][...] = cp.asarray(x)
        m.backend.quantize_q8(plan.d["hn"], out=plan.d["hq"])
        alone = CM.MoeLayer(li, m.layers[li].ffn, m)
        alone.ride = False                                 # the shared expert's own launches (other types)
        tie = _route_gap(setup, li, x)[0] < TIE_GAP
        for layer in (lm, alone):
            CM.decode(plan, stream_ptr(), layer)
            got = _host(plan.d["o"])[0]
            e = rel_l2(got, want)
            print(f"layer {li} decode (shared riding along: {layer.ride}) vs CPU rel L2 {e:.2e}"
                  f"{' (routing near tie: not compared)' if tie else ''}")
            assert np.isfinite(got).all() and (tie or e < LAYER_REL_L2)
        for n in (1, 3, 37):
            xr = (rng.standard_normal((n, E)) * 3).astype(np.float32)
            xd = cp.asarray(xr)
            h16 = cp.empty((n, E), cp.float16)
            CM.prefill(plan, stream_ptr(), lm, xd, m.layers[li].post_norm, h16)
            got = _host(xd) - xr
            hn = setup.cpu.backend.rms_norm(xr, setup.cpu.layers[li].post_norm, setup.cpu.eps)
            want = _cpu_ffn(setup, li, hn)
            keep = _route_gap(setup, li, hn) >= TIE_GAP
            assert np.isfinite(got).all() and (n < 37 or keep.sum() >= n // 2)
            e = rel_l2(got[keep], want[keep]) if keep.any() else 0.0
            print(f"layer {li} grouped prefill n={n} vs CPU rel L2 {e:.2e} ({n - keep.sum()} rows at a routing tie)")
            assert e < LAYER_REL_L2
            ids = _host(plan.pf.buf("moe_ids", (n, lm.slots), cp.int32))
            logits = setup.cpu.backend.to_host(setup.cpu.backend.matmul(hn, setup.cpu.layers[li].ffn.router))
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            srt = np.sort(p, 1)[:, ::-1]
            ref_ids, _ = M.route(logits, k, True)
            clear = keep & np.all(np.abs(np.diff(srt[:, :k + 1], axis=1)) > 2e-3, axis=1)
            # the same experts where the routing is clear (their order within the k is the kernel's own)
            assert (np.sort(ids[clear, :k], 1) == np.sort(ref_ids[clear], 1)).all()
            if lm.shared:
                assert (ids[:, k] == lm.n_expert).all()


@gpu
def test_decode_greedy_matches_cpu(setup):
    toks = _prompt(30, setup.n_vocab, 2)
    sc, sg = setup.cpu.new_state(setup.pool_cpu), setup.cuda.new_state(setup.pool)
    lc = setup.cpu.forward(toks, sc)
    lg = setup.graph.forward(toks, sg)                     # the plan's grouped prefill
    ref = []
    for _ in range(N_GREEDY):
        ref.append(int(np.argmax(lc)))
        lc = setup.cpu.forward(np.array([ref[-1]], np.int32), sc)
    first = int(np.argmax(lg))
    got = [first] + setup.plan().decode_greedy(first, N_GREEDY - 1, sg)
    print(f"{setup.path.name}: plan {got[:12]} cpu {ref[:12]}")

    def cpu_logits_after(prefix):
        s2 = setup.cpu.new_state(setup.pool_cpu)
        lr = setup.cpu.forward(np.concatenate([toks, np.asarray(prefix, np.int32)]), s2)
        s2.release()
        return lr
    assert_parts_at_near_tie(got, ref, cpu_logits_after, NEAR_TIE_LOGIT)
    sc.release()
    sg.release()


@gpu
def test_plan_matches_generic_forward(setup):
    """Plan decode steps and plan prefills (40 tokens, then 5 on the resident state) vs model.forward on the CUDA
    backend (the per-expert loop)."""
    m, plan = setup.cuda, setup.plan()
    toks = _prompt(40, setup.n_vocab, 1)
    ref, st = m.new_state(setup.pool), m.new_state(setup.pool)
    lr = m.forward(toks, ref)
    lp = setup.graph.forward(toks, st)
    e0 = rel_l2(lp, lr)
    worst = 0.0
    for i in range(12):
        t = int(np.argmax(lr))
        lr = m.forward(np.array([t], np.int32), ref)
        lp = plan.decode(t, st)
        worst = max(worst, rel_l2(lp, lr))
    more = _prompt(5, setup.n_vocab, 9)
    e1 = rel_l2(setup.graph.forward(more, st), m.forward(more, ref))
    print(f"plan vs generic: prefill {e0:.2e}, decode worst {worst:.2e}, 5-token prefill {e1:.2e}")
    # a routing near tie flips one expert of some token between the plan (int8 activations) and the generic forward
    # (f32), and the random weights carry it to the logits: 0.176 / 0.123 on the H200 for qwen35moe Q8_0, 1e-2..9e-2
    # for the other files; the layer test above holds the kernels to 1e-7 (decode) and 1e-2 (grouped prefill)
    assert e0 < ROUTED_REL_L2 and worst < ROUTED_REL_L2 and e1 < ROUTED_REL_L2
    assert st.pos == ref.pos == 57
    ref.release()
    st.release()


@gpu
def test_graphs_and_eager_give_the_same_tokens(setup):
    toks = _prompt(20, setup.n_vocab, 4)
    out = []
    for graphs in (True, False):
        plan = Q.Qwen35Cuda(setup.cuda, setup.pool, use_graphs=graphs)
        st = setup.cuda.new_state(setup.pool)
        first = int(np.argmax(setup.graph.forward(toks, st)))
        out.append(plan.decode_greedy(first, 16, st))
        st.release()
    assert out[0] == out[1]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    if _why is not None:
        pytest.skip(f"CUDA backend unavailable: {_why}")
    if _no_model is not None:
        pytest.skip(_no_model)
    return synth.write_synthetic(tmp_path_factory.mktemp("moe_stages") / "qwen35moe.gguf", _spec(seed=3))


@gpu
def test_one_and_two_stages_on_one_gpu_same_tokens(moe_path):
    from strata.engine import Engine, GenerationRequest, TokenEvent
    toks = [int(t) for t in _prompt(50, 49152, 6)]
    got = {}
    for split in (None, "4"):
        dev = "cuda:0" if split is None else "cuda:0,cuda:0"
        e = Engine(moe_path, n_ctx=1024, ubatch=128, device=dev, layer_split=split)
        for st in e.stages:
            assert st.status()["moe"] == {"decode": "graph", "prefill": "grouped"}, st.status()
        assert e.device_info()["moe"] == {"decode": "graph", "prefill": "grouped"}
        evs = list(e.generate(GenerationRequest(prompt_tokens=toks, max_tokens=24, ignore_eos=True)))
        got[split] = [ev.token_id for ev in evs if isinstance(ev, TokenEvent)]
    print(f"1 stage {got[None][:10]} 2 stages {got['4'][:10]}")
    assert got[None] == got["4"]
