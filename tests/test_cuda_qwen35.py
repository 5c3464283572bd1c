"""The qwen35 CUDA decode plan (strata/backend/cuda/qwen35.py, native/cuda/qwen35.cu) against the generic model path.

Runs anywhere (no GPU): ``unsupported`` on real synthetic models loaded on the CPU backend (MoE, a d_v the q8_1
blocks cannot take, weights not on the device), the weight fusion's grouping and row offsets (F32 stand-in weights,
numpy matvecs), the resident running-state swapping with numpy SequenceStates (including the memory's restore /
reset writing through the resident buffers), the cffi declarations against native/cuda/strata_cuda.h, and numpy
mirrors of the qwen35.cu kernels' index arithmetic (fused projection layout, tiled / grouped key-head mapping,
ssm_ba split) against the model's own _gdn for qwen35 and qwen3next (rel L2 < 1e-4 on the layer output).

GPU tests (skipped with the reason from strata.backend.cuda.unavailable_reason()) on a small synthetic qwen35
(n_embd 128, 8 layers = 6 GDN + 2 gated attention, head_dim 64 with n_rot 16, GDN 2 key / 4 value heads of 64
(tiled key-head mapping), FFN 256; Q8_0 or F16 matrices):
  * (a) 16 plan decode steps after a prompt vs the generic model.forward on the same backend: logits rel L2 < 2e-2
    (STEP_REL_L2: both take int8 q8_1 activations in the one-token matvecs, but quantize at slightly different
    points and the plan fuses the norms, so an int8 value can round the other way), then a 5-token prefill (the
    wrapper sends <= 8 tokens to the generic forward) on the resident state and 8 more plan steps (the prefill must
    update the plan's buffers in place); running state rel L2 < 1e-2;
  * (b) 64 greedy tokens by decode_greedy identical to the CPU backend's, or the first difference a near tie
    (< 0.25 logit on the CPU, the rule of tests/test_cuda_hybrid.py);
  * (c) two sequences interleaved token by token give the logits each gives alone (resident swapping), and a
    snapshot / restore through state.py round-trips (hashes, then the same logits again);
  * (d) a bad token id raises ValueError and advances nothing (pos, KV length, running state);
  * (e) graphs on vs STRATA_CUDA_GRAPHS=0 (eager launches): identical greedy tokens and logits;
  * (f) a q8_0 KV cache (--kv q8_0): plan vs the generic path on the same pool, logits rel L2 < 1e-2;
  * (g) the plan's prefill (Qwen35Cuda.prefill: f16 GEMMs on fused weights, the warp delta-rule kernel, fused
    norms) vs the generic model.forward on the same backend, for a fresh prompt, a continuation after decode steps,
    all_logits, ubatch chunks, head_dim 32 (the non-flash attention fallback) and q8_0 caches at head_dim 32 and 64:
    logits, running state and KV pages rel L2 < 1e-2, identical bookkeeping; bad input and a full cache raise and
    change nothing.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.gguf import synth
from strata.backend import cuda as C
from strata.backend.cuda import settings as S
from strata.backend.cuda import weights as W
from strata.backend.cuda import qwen35 as Q
from strata.memory.kv import PagePool
from strata.models.registry import load_model
from strata.memory import Carve, HybridMemory, KVMemory, RecurrentMemory

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cuda_marks import CUDA_WHY as _why  # noqa: E402
from tests.cuda_marks import NEAR_TIE_LOGIT, assert_parts_at_near_tie, default_model_missing, gpu, rel_l2
from tests.cuda_marks import host as _host

_no_model = default_model_missing()
needs_model = pytest.mark.skipif(_no_model is not None,
                                 reason=f"synthetic models need the default model's tokenizer: {_no_model}")

PLAN_REL_L2 = 1e-2
# One decode step, plan vs generic, Q8_0 weights: both quantize the activations to int8 (q8_1), at points that differ
# by float rounding; the logits agree to ~1e-7 until one int8 value rounds the other way, then jump to ~1e-2
# (measured on the H200, session 5: 1.7e-07 for 7 steps, then 0.84-1.4e-2; F16 weights stay below 7e-7).
STEP_REL_L2 = 2e-2
N_GREEDY = 64


def _spec(qtype: str = "Q8_0", **kw):
    """A qwen35 (dense) the plan supports: 6 GDN + 2 attention layers, head_dim 64, d_k = d_v = 64, 4 value heads
    over 2 key heads (tiled mapping), partial RoPE (n_rot 16)."""
    base = {"n_embd": 128, "n_layer": 8, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 256, "head_k_dim": 64,
            "head_v_dim": 64, "n_k_heads": 2, "n_v_heads": 4, "n_mtp": 0, "qtype": qtype, "embd_qtype": "Q8_0",
            "seed": 11}
    base.update(kw)
    return synth.preset("qwen35", "tiny", **base)


# ------------------------------------------------------------------ CPU: pure logic
@needs_model
def test_unsupported_reasons_on_real_models(tmp_path):
    ok = load_model(synth.write_synthetic(tmp_path / "ok.gguf", _spec()))
    assert Q.unsupported(ok) == "weights are not on the CUDA backend"          # shapes pass; CPU weights do not
    small = load_model(synth.write_synthetic(tmp_path / "dv16.gguf", synth.preset("qwen35", "tiny", n_mtp=0)))
    assert "d_v 16" in Q.unsupported(small)
    moe = load_model(synth.write_synthetic(tmp_path / "moe.gguf", synth.preset("qwen35moe", "tiny", n_mtp=0)))
    assert "MoE" in Q.unsupported(moe)
    llama = load_model(synth.write_synthetic(tmp_path / "llama.gguf", synth.preset("llama", "tiny")))
    assert "not a qwen3next / qwen35 hybrid" in Q.unsupported(llama)
    with pytest.raises(ValueError, match="cannot run this model: weights are not on the CUDA backend"):
        Q.Qwen35Cuda(ok, None)


def _w(name, t, rows, cols, rng):
    return W.DeviceWeight(name, t, (rows, cols), rng.standard_normal((rows, cols)).astype(np.float32))


def _np_concat(name, ws):
    return W.DeviceWeight(name, ws[0].ggml_type, (sum(w.shape[0] for w in ws), ws[0].shape[1]),
                          np.concatenate([w.data for w in ws], axis=0))


def test_fuse_groups_offsets_give_the_separate_products():
    rng = np.random.default_rng(0)
    E = 64
    # GDN-like [qkv | z | beta | alpha] with beta/alpha of another type: two groups, offsets back to back
    parts = [_w("qkv", 8, 96, E, rng), _w("z", 8, 32, E, rng), _w("beta", 0, 4, E, rng), _w("alpha", 0, 4, E, rng)]
    groups = W.fuse_groups("gdn", parts, concat=_np_concat)
    assert [(off, n) for _, off, n in groups] == [(0, 128), (128, 8)]
    assert [w.ggml_type for w, _, _ in groups] == [8, 0]
    x = rng.standard_normal(E).astype(np.float32)
    y = np.zeros(sum(p.shape[0] for p in parts), np.float32)
    for w, off, n in groups:
        y[off:off + n] = w.data @ x
    np.testing.assert_array_equal(y, np.concatenate([p.data @ x for p in parts]))
    # one weight alone is used as is (no copy); alternating types are not fused
    one = _w("wo", 8, 16, E, rng)
    assert W.fuse_groups("wo", [one], concat=_np_concat)[0][0] is one
    alt = [_w("a", 8, 8, E, rng), _w("b", 2, 8, E, rng), _w("c", 8, 8, E, rng)]
    assert [(off, n) for _, off, n in W.fuse_groups("alt", alt, concat=_np_concat)] == [(0, 8), (8, 8), (16, 8)]
    # different widths are not fused either
    wide = [_w("a", 8, 8, E, rng), _w("b", 8, 8, 2 * E, rng)]
    assert len(W.fuse_groups("wide", wide, concat=_np_concat)) == 2


def _np_state(layers, seed):
    rng = np.random.default_rng(seed)
    pool = PagePool([3], 4, 16, 1, 8, [np.zeros((1, 4, 16, 8), np.float32)], [np.zeros((1, 4, 16, 8), np.float32)])
    running = {layer: {"conv": rng.standard_normal((3, 40)).astype(np.float32),
                       "ssm": rng.standard_normal((4, 8, 8)).astype(np.float32)} for layer in layers}
    carve = Carve(0, 4)
    mem = HybridMemory(carve, [KVMemory(carve, pool), RecurrentMemory(carve, running)])
    return mem.seq(mem.new_seq())          # starts from (and resets to) these running-state values


def test_resident_state_swaps_and_state_py_writes_through():
    layers = (0, 1, 2)
    res = Q.ResidentState({layer: {"conv": np.zeros((3, 40), np.float32), "ssm": np.zeros((4, 8, 8), np.float32)}
                           for layer in layers})
    a, b = _np_state(layers, 1), _np_state(layers, 2)
    a0 = {layer: {k: v.copy() for k, v in p.items()} for layer, p in a.running.items()}
    b0 = {layer: {k: v.copy() for k, v in p.items()} for layer, p in b.running.items()}
    assert res.attach(a) is True and res.is_resident(a) and res.owner() is a
    assert res.attach(a) is False                                   # already resident: nothing copied
    for layer in layers:
        assert a.running[layer]["ssm"] is res.buf[layer]["ssm"]
        np.testing.assert_array_equal(res.buf[layer]["conv"], a0[layer]["conv"])
        res.buf[layer]["ssm"] += 1.0                                 # a decode step of a
    assert res.attach(b) is True and res.is_resident(b) and not res.is_resident(a)
    for layer in layers:
        assert a.running[layer]["ssm"] is not res.buf[layer]["ssm"]   # a got its own copy back ...
        np.testing.assert_array_equal(a.running[layer]["ssm"], a0[layer]["ssm"] + 1.0)   # ... with the step
        np.testing.assert_array_equal(res.buf[layer]["ssm"], b0[layer]["ssm"])
    # the memory's capture / restore / reset act on the resident buffers in place
    snap = b.capture()
    for layer in layers:
        res.buf[layer]["conv"][...] = 7.0
    b.restore(snap)
    for layer in layers:
        assert b.running[layer]["conv"] is res.buf[layer]["conv"]
        np.testing.assert_array_equal(res.buf[layer]["conv"], b0[layer]["conv"])
    b.reset()                                                        # back to b's state at construction
    for layer in layers:
        for k in ("conv", "ssm"):
            assert b.running[layer][k] is res.buf[layer][k]
            np.testing.assert_array_equal(res.buf[layer][k], b0[layer][k])
    # a layout mismatch is refused before anything changes
    bad = _np_state(layers, 3)
    bad.running[1]["ssm"] = np.zeros((4, 8, 9), np.float32)
    before = {layer: res.buf[layer]["conv"].copy() for layer in layers}
    with pytest.raises(ValueError, match="running state 1/ssm"):
        res.attach(bad)
    assert res.is_resident(b)
    for layer in layers:
        np.testing.assert_array_equal(res.buf[layer]["conv"], before[layer])
    res.detach()
    assert res.owner() is None and not res.is_resident(b)


def test_graphs_env_switch(monkeypatch):
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")
    assert S.graphs_enabled() is False
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "1")
    assert S.graphs_enabled() is True


# numpy mirrors of the qwen35.cu kernels' index arithmetic (line by line), checked against the model's own _gdn
def _mirror_conv(x, w, window):
    K = w.shape[1]
    xx = np.concatenate([window, x[None, :]], axis=0)             # (K, C)
    acc = np.zeros(x.shape[0], np.float32)
    for j in range(K):
        acc += xx[j] * w[:, j]
    window[...] = xx[1:]
    return acc / (1.0 + np.exp(-acc))


def _mirror_gdn_step(y, proj, A, dt, state, nv, nk, dk, dv, tiled, b_off, a_off, grouped, scale, l2_eps):
    out = np.zeros(nv * dv, np.float32)
    r = nv // nk
    for h in range(nv):
        hk = h % nk if tiled else h // r
        qv = y[hk * dk:(hk + 1) * dk]
        kv = y[nk * dk + hk * dk:nk * dk + (hk + 1) * dk]
        q = qv / np.sqrt(np.sum(qv * qv) + l2_eps) * scale
        k = kv / np.sqrt(np.sum(kv * kv) + l2_eps)
        if grouped:
            bi = b_off + (h // r) * 2 * r + h % r
            ai = bi + r
        else:
            bi, ai = b_off + h, a_off + h
        b = 1.0 / (1.0 + np.exp(-proj[bi]))
        sp_in = proj[ai] + dt[h]
        sp = sp_in if sp_in > 20.0 else np.log1p(np.exp(sp_in))
        S = state[h]
        S *= np.exp(A[h] * sp)
        v = y[2 * nk * dk + h * dv:2 * nk * dk + (h + 1) * dv]
        u = (v - k @ S) * b
        S += np.outer(k, u)
        out[h * dv:(h + 1) * dv] = q @ S
    return out


def _mirror_gated_norm(o, z, w, nv, dv, eps):
    o, z = o.reshape(nv, dv), z.reshape(nv, dv)
    rn = 1.0 / np.sqrt(np.mean(o * o, axis=1, keepdims=True) + eps)
    return (o * rn * w * (z / (1.0 + np.exp(-z)))).reshape(-1)


@needs_model
@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_kernel_index_arithmetic_matches_model_gdn(arch, tmp_path):
    """The plan's fused projection layout ([qkv | z | beta | alpha] or [qkv | z | ba]) and the kernels' index
    arithmetic (key-head mapping tiled / grouped, the ssm_ba split, b_off / a_off), mirrored in numpy, give the
    model's own _gdn output and running state (CPU backend)."""
    kw = {"n_k_heads": 2, "n_v_heads": 6, "head_k_dim": 32, "head_v_dim": 32}
    spec = _spec(**kw) if arch == "qwen35" else synth.preset("qwen3next", "tiny", n_mtp=0, n_embd=128, **kw)
    m = load_model(synth.write_synthetic(tmp_path / f"{arch}.gguf", spec))
    be = m.backend
    rng = np.random.default_rng(5)
    li = next(i for i, L in enumerate(m.layers) if L.recurrent)
    L = m.layers[li]
    run = {"conv": rng.standard_normal((m.d_conv - 1, m.conv_dim)).astype(np.float32),
           "ssm": (0.1 * rng.standard_normal((m.nv, m.dk, m.dv))).astype(np.float32)}
    mine = {k: v.copy() for k, v in run.items()}
    for _ in range(3):                                  # three decode steps, the state carried
        h = rng.standard_normal((1, m.config.n_embd)).astype(np.float32)
        want = be.to_host(m._gdn(L, h, run))[0]
        tail = [L.w_ba] if L.w_ba is not None else [L.w_beta, L.w_alpha]
        proj = np.concatenate([be.to_host(be.matmul(h, w))[0] for w in [L.wqkv, L.wz] + tail])
        y = _mirror_conv(proj[:m.conv_dim], np.asarray(L.conv), mine["conv"])
        b_off = m.conv_dim + m.value_dim
        o = _mirror_gdn_step(y, proj, np.asarray(L.a), np.asarray(L.dt), mine["ssm"], m.nv, m.nk, m.dk, m.dv,
                             m.tiled, b_off, b_off + m.nv, L.w_ba is not None, 1.0 / np.sqrt(m.dk), Q.L2_EPS)
        vn = _mirror_gated_norm(o, proj[m.conv_dim:m.conv_dim + m.value_dim], np.asarray(L.ssm_norm), m.nv, m.dv,
                                m.eps)
        got = be.to_host(be.matmul(vn[None, :].astype(np.float32), L.ssm_out))[0]
        assert rel_l2(got, want) < 1e-4
        assert rel_l2(mine["ssm"], run["ssm"]) < 1e-5 and rel_l2(mine["conv"], run["conv"]) < 1e-6


# ------------------------------------------------------------------ GPU
class Setup:
    def __init__(self, qtype, tmp):
        self.qtype = qtype
        self.path = synth.write_synthetic(tmp / f"q35_{qtype}.gguf", _spec(qtype))
        self.cpu = load_model(self.path)
        self.cuda = load_model(self.path, C.CudaBackend())
        assert Q.unsupported(self.cuda) is None
        self.graph = Q.Qwen35GraphModel(self.cuda)
        self.pool = self.cuda.new_page_pool(1024, n_seq=4)
        assert isinstance(self.pool, C.CudaPagePool)
        self.pool_cpu = self.cpu.new_page_pool(512, n_seq=2)
        self.n_vocab = self.cpu.config.n_vocab

    def plan(self):
        return self.graph.plan(self.pool)


@pytest.fixture(scope="module", params=["Q8_0", "F16"])
def setup(request, tmp_path_factory):
    if _why is not None:
        pytest.skip(f"CUDA backend unavailable: {_why}")
    if _no_model is not None:
        pytest.skip(_no_model)
    return Setup(request.param, tmp_path_factory.mktemp(request.param))


def _prompt(n, n_vocab, seed):
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


@gpu
def test_plan_logits_match_generic_forward(setup):
    m, plan = setup.cuda, setup.plan()
    toks = _prompt(40, setup.n_vocab, 1)
    ref, st = m.new_state(setup.pool), m.new_state(setup.pool)
    lr = m.forward(toks, ref)
    lp = setup.graph.forward(toks, st)                       # n > 8: the plan's prefill (same kernels and GEMMs)
    assert rel_l2(lp, lr) < 1e-5
    worst = 0.0

    def steps(n, lr, bound=STEP_REL_L2):
        nonlocal worst
        for i in range(n):
            t = int(np.argmax(lr))
            lr = m.forward(np.array([t], np.int32), ref)
            if i % 3 == 0:
                lp = plan.decode(t, st)
            elif i % 3 == 1:                                 # the wrapper: one token goes through the plan
                lp = setup.graph.forward(np.array([t], np.int32), st)
            else:
                lp = _host(setup.graph.forward_device(np.array([t], np.int32), st))
            e = rel_l2(lp, lr)
            worst = max(worst, e)
            assert np.isfinite(lp).all() and e < bound, f"plan vs generic logits rel L2 {e:.2e}"
        return lr
    lr = steps(16, lr)
    assert plan.resident.is_resident(st)
    more = _prompt(5, setup.n_vocab, 9)
    lr = m.forward(more, ref)
    lp = setup.graph.forward(more, st)                       # 5 tokens: the plan's short read on the resident state
    # its rows are decode steps (int8 activations, the recurrent delta rule per token: test_cuda_short_read checks
    # them bit for bit) against the generic forward's chunked read of the 5: 4.1e-2 on the H200 with these weights
    assert rel_l2(lp, lr) < 3 * STEP_REL_L2
    assert plan.resident.is_resident(st)
    # the steps after the read carry its rounding too (2.4e-2 and 3.0e-2 in two H200 runs when short parts went
    # through the plan's f16-GEMM prefill; the random weights' activations differ from run to run)
    lr = steps(8, lr, 3 * STEP_REL_L2)
    print(f"plan vs generic: worst logits rel L2 {worst:.2e}")
    assert st.pos == ref.pos == 40 + 16 + 5 + 8 and st.kv.length == st.pos
    # the running state integrates the same int8 rounding flips the logits above show (an H100 run: logits 5.0e-2,
    # layer 1's GDN state 1.5e-2 with Q8_0 weights); F16 weights keep the plan's own bound
    state_bound = PLAN_REL_L2 if setup.qtype == "F16" else 3 * STEP_REL_L2
    for layer in ref.running:
        for name in ("conv", "ssm"):
            e = rel_l2(_host(st.running[layer][name]), _host(ref.running[layer][name]))
            assert e < state_bound, f"running state {layer}/{name} rel L2 {e:.2e}"
    ref.release()
    st.release()


@gpu
def test_decode_greedy_matches_cpu(setup):
    toks = _prompt(30, setup.n_vocab, 2)
    sc, sg = setup.cpu.new_state(setup.pool_cpu), setup.cuda.new_state(setup.pool)
    lc = setup.cpu.forward(toks, sc)
    lg = setup.cuda.forward(toks, sg)
    ref = []
    for _ in range(N_GREEDY):
        ref.append(int(np.argmax(lc)))
        lc = setup.cpu.forward(np.array([ref[-1]], np.int32), sc)
    first = int(np.argmax(lg))
    got = [first] + setup.plan().decode_greedy(first, N_GREEDY - 1, sg)
    assert sg.pos == 30 + N_GREEDY - 1
    print(f"{setup.cuda.file.path}: plan {got[:12]} cpu {ref[:12]}")

    def cpu_logits_after(prefix):
        s2 = setup.cpu.new_state(setup.pool_cpu)
        lr = setup.cpu.forward(np.concatenate([toks, np.asarray(prefix, np.int32)]), s2)
        s2.release()
        return lr
    assert_parts_at_near_tie(got, ref, cpu_logits_after, NEAR_TIE_LOGIT)
    sc.release()
    sg.release()


@gpu
def test_interleaved_sequences_and_snapshot_round_trip(setup):
    m, plan = setup.cuda, setup.plan()
    a, b = m.new_state(setup.pool), m.new_state(setup.pool)
    m.forward(_prompt(33, setup.n_vocab, 3), a)
    m.forward(_prompt(21, setup.n_vocab, 4), b)
    ta, tb = _prompt(10, setup.n_vocab, 5), _prompt(10, setup.n_vocab, 6)
    plan.decode(int(ta[0]), a)                        # a resident, one plan step in
    snap_a, snap_b = a.capture(), b.capture()
    h_a = a.hashes()
    alone_a = [plan.decode(int(t), a) for t in ta[1:]]
    alone_b = [plan.decode(int(t), b) for t in tb]    # swaps b in, a out
    a.restore(snap_a)
    b.restore(snap_b)                                 # b is resident: restore writes the plan's buffers
    assert a.hashes() == h_a and a.pos == 34
    for i in range(9):
        la = plan.decode(int(ta[i + 1]), a)
        assert rel_l2(la, alone_a[i]) < 1e-6, f"interleaved step {i} of a differs"
        lb = plan.decode(int(tb[i]), b)
        assert rel_l2(lb, alone_b[i]) < 1e-6, f"interleaved step {i} of b differs"
    assert a.pos == 34 + 9 and b.pos == 21 + 9
    # snapshot of the resident sequence, restore, the same logits again
    snap = b.capture()
    h = b.hashes()
    want = [plan.decode(int(t), b) for t in ta[:4]]
    assert b.hashes() != h
    b.restore(snap)
    assert b.hashes() == h
    got = [plan.decode(int(t), b) for t in ta[:4]]
    assert all(rel_l2(g, w) < 1e-6 for g, w in zip(got, want))
    a.release()
    b.release()


@gpu
def test_bad_token_changes_nothing(setup):
    m, plan = setup.cuda, setup.plan()
    st = m.new_state(setup.pool)
    m.forward(_prompt(12, setup.n_vocab, 7), st)
    plan.decode(3, st)
    h, pos, length = st.hashes(), st.pos, st.kv.length
    for bad in (setup.n_vocab, -1):
        with pytest.raises(ValueError, match="token id out of range"):
            plan.decode(bad, st)
        with pytest.raises(ValueError, match="token id out of range"):
            setup.graph.forward(np.array([bad]), st)
        with pytest.raises(ValueError, match="token id out of range"):
            plan.decode_greedy(bad, 4, st)
    assert st.hashes() == h and st.pos == pos and st.kv.length == length
    other = m.new_state(setup.cuda.new_page_pool(64))
    with pytest.raises(ValueError, match="not in this plan's pool"):
        plan.decode(1, other)
    st.release()


@gpu
def test_graphs_vs_eager_identical(setup, monkeypatch):
    m = setup.cuda
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")
    eager = Q.Qwen35Cuda(m, setup.pool)
    assert eager.use_graphs is False
    graph = Q.Qwen35Cuda(m, setup.pool, use_graphs=True)
    st = m.new_state(setup.pool)
    lg = m.forward(_prompt(25, setup.n_vocab, 8), st)
    snap = st.capture()
    first = int(np.argmax(lg))
    t_graph = graph.decode_greedy(first, 24, st)
    l_graph = graph.logits()
    st.restore(snap)
    t_eager = eager.decode_greedy(first, 24, st)
    l_eager = eager.logits()
    assert t_graph == t_eager
    assert rel_l2(l_eager, l_graph) < 1e-6
    assert len(graph.graphs) >= 1 and not eager.graphs
    st.release()


@gpu
def test_q8_0_kv_cache_plan_matches_generic(setup):
    """--kv q8_0: the plan's RoPE-only decode kernel + strata_kv_write_q8 + the q8_0 attention against the generic
    path on the same q8_0 pool (rel L2 < 2e-2 over 12 steps: twice the f16-cache bound, because the K/V rows the two
    paths write already differ by the plan's int8 activations and are then rounded to int8 again, independently;
    measured 1.02e-2 on the H200)."""
    m = load_model(setup.path, C.CudaBackend(kv_dtype="q8_0"))
    pool = m.new_page_pool(256, n_seq=2)
    assert pool.kv == "q8_0"
    plan = Q.Qwen35Cuda(m, pool)
    ref, st = m.new_state(pool), m.new_state(pool)
    toks = _prompt(20, setup.n_vocab, 12)
    lr = m.forward(toks, ref)
    m.forward(toks, st)
    for _ in range(12):
        t = int(np.argmax(lr))
        lr = m.forward(np.array([t], np.int32), ref)
        lp = plan.decode(t, st)
        e = rel_l2(lp, lr)
        assert np.isfinite(lp).all() and e < 2 * PLAN_REL_L2, f"q8_0 KV: plan vs generic logits rel L2 {e:.2e}"
    ref.release()
    st.release()


def _assert_same_sequences(a, b, tol=PLAN_REL_L2):
    """Same bookkeeping, and running state and KV pages of two sequences (one pool or two) within tol rel L2."""
    assert a.pos == b.pos and a.kv.length == b.kv.length == a.pos
    for layer in a.running:
        for name in ("conv", "ssm"):
            e = rel_l2(_host(a.running[layer][name]), _host(b.running[layer][name]))
            assert e < tol, f"running state {layer}/{name} rel L2 {e:.2e}"
    for slot in range(len(a.kv.pool.k)):
        ka, va = (np.asarray(_host(t), np.float32) for t in a.kv.pool.read(slot, a.kv.pages, a.pos))
        kb, vb = (np.asarray(_host(t), np.float32) for t in b.kv.pool.read(slot, b.kv.pages, b.pos))
        assert rel_l2(ka, kb) < tol and rel_l2(va, vb) < tol, f"KV slot {slot}"


def _prefill_vs_generic(m, pool, plan, n_vocab, seed):
    """Prompt, decode steps, a continuation, all_logits and ubatch chunks: plan.prefill vs m.forward."""
    ref, st = m.new_state(pool), m.new_state(pool)
    toks = _prompt(70, n_vocab, seed)
    lr, lp = m.forward(toks, ref), plan.prefill(toks, st)
    worst = rel_l2(lp, lr)
    _assert_same_sequences(ref, st)
    for _ in range(3):                                       # decode on the plan, then prefill on the resident state
        t = int(np.argmax(lr))
        lr, lp = m.forward(np.array([t], np.int32), ref), plan.decode(t, st)
    more = _prompt(33, n_vocab, seed + 1)
    lr, lp = m.forward(more, ref, all_logits=True), plan.prefill(more, st, all_logits=True)
    assert lp.shape == lr.shape == (33, n_vocab)
    worst = max(worst, rel_l2(lp, lr))
    assert plan.resident.is_resident(st)
    for lo in range(0, 40, 16):                              # ubatch chunks (one of 8 tokens: the chunk boundary)
        chunk = _prompt(min(16, 40 - lo), n_vocab, seed + 2 + lo)
        lr, lp = m.forward(chunk, ref), plan.prefill(chunk, st)
        worst = max(worst, rel_l2(lp, lr))
    for k in (2, 3, 5):                                      # the short parts a chat's later turn is read in
        chunk = _prompt(k, n_vocab, seed + 50 + k)
        lr, lp = m.forward(chunk, ref), plan.prefill(chunk, st)
        worst = max(worst, rel_l2(lp, lr))
    _assert_same_sequences(ref, st)
    print(f"plan prefill vs generic forward: worst logits rel L2 {worst:.2e}")
    assert worst < PLAN_REL_L2
    ref.release()
    st.release()


@gpu
def test_plan_prefill_matches_generic_forward(setup):
    _prefill_vs_generic(setup.cuda, setup.pool, setup.plan(), setup.n_vocab, 21)


@gpu
def test_plan_prefill_keeps_running_states_at_marks(setup):
    """A read armed by Memory.mark (a live continuation's checkpoints inside one forward call) goes through the plan's
    prefill, whose conv and delta-rule launches run in segments ending at the marks: the running state kept at each
    mark (Memory.capture_at), the read's end state and its logits are those of the plan's prefill split into calls
    there (whose GEMMs run over other row counts: accumulation order only), and the generic forward's with the same
    marks (Qwen3Next._gdn_cut) agrees too."""
    m, plan, pool = setup.cuda, setup.plan(), setup.pool
    head, toks = _prompt(20, setup.n_vocab, 9), _prompt(40, setup.n_vocab, 10)
    a, b, g = m.new_state(pool), m.new_state(pool), m.new_state(pool)
    for st in (a, b, g):
        plan.prefill(head, st)
    marks = [20 + 7, 20 + 25]
    a.memory.mark(a.sid, marks)
    la = setup.graph.forward(toks, a)                    # marked: the plan's prefill
    kept = [a.memory.capture_at(a.sid, p) for p in marks]
    a.memory.mark(a.sid, ())
    g.memory.mark(g.sid, marks)
    lg = m.forward(toks, g)                                # the model's own forward with the same marks
    kept_g = [g.memory.capture_at(g.sid, p) for p in marks]
    g.memory.mark(g.sid, ())
    ref = []
    for lo, hi in [(0, 7), (7, 25), (25, 40)]:
        lb = plan.prefill(toks[lo:hi], b)
        ref.append({li: {k: _host(v).copy() for k, v in d.items()} for li, d in b.running.items()})
    assert rel_l2(_host(la), _host(lb)) < 1e-4 and rel_l2(_host(lg), _host(lb)) < PLAN_REL_L2
    for got, got_g, want in zip(kept + [None], kept_g + [None], ref):
        for li, d in want.items():
            for k, v in d.items():
                mine = _host(got.running[li][k] if got is not None else a.running[li][k])
                theirs = _host(got_g.running[li][k] if got_g is not None else g.running[li][k])
                assert rel_l2(mine, v) < 1e-4, (li, k)
                assert rel_l2(theirs, v) < PLAN_REL_L2, (li, k)
    for part in kept + kept_g:
        assert part.kv["kv"].length in marks
        part.release()
    for st in (a, b, g):
        st.release()


@gpu
@pytest.mark.parametrize("hd,kv", [(32, "f16"), (32, "q8_0"), (64, "q8_0")])
def test_plan_prefill_head_dims_and_kv_types(setup, hd, kv, tmp_path):
    """head_dim 32 (not a flash head size: cuda.prefill_attention) with d_k = d_v = 32 (the warp kernel's R = 1), and
    head_dim 64 on a q8_0 cache (RoPE only, strata_kv_write_q8, FA2 on the q8_0 pages)."""
    path = synth.write_synthetic(tmp_path / f"q35_hd{hd}.gguf",
                                 _spec("Q8_0", head_dim=hd, head_k_dim=hd, head_v_dim=hd))
    m = load_model(path, C.CudaBackend(kv_dtype=kv))
    assert Q.unsupported(m) is None
    pool = m.new_page_pool(512, n_seq=2)
    assert pool.kv == kv
    _prefill_vs_generic(m, pool, Q.Qwen35Cuda(m, pool), m.config.n_vocab, 31)


@gpu
def test_plan_prefill_bad_input_changes_nothing(setup):
    """Bad token ids, an empty batch, a foreign pool and a full KV cache raise before anything is written (12-token
    batches: the wrapper sends them to the plan)."""
    from strata.memory.kv import KVCacheFull
    m, plan = setup.cuda, setup.plan()
    st = m.new_state(setup.pool)
    plan.prefill(_prompt(12, setup.n_vocab, 7), st)
    h, pos, length = st.hashes(), st.pos, st.kv.length
    good = list(_prompt(11, setup.n_vocab, 8))
    for bad in (good + [setup.n_vocab], [-1] + good, []):
        with pytest.raises(ValueError):
            plan.prefill(np.array(bad, np.int64), st)
        with pytest.raises(ValueError):
            setup.graph.forward(np.array(bad, np.int64), st)
    other = m.new_state(setup.cuda.new_page_pool(64))
    with pytest.raises(ValueError, match="not in this plan's pool"):
        plan.prefill(np.array(good, np.int32), other)
    assert st.hashes() == h and st.pos == pos and st.kv.length == length
    small = m.new_page_pool(32)
    cap = small.n_pages * small.page_size                # whole pages: at least 32 tokens
    sp = Q.Qwen35Cuda(m, small)
    s2 = m.new_state(small)
    sp.prefill(_prompt(cap - 12, setup.n_vocab, 9), s2)
    h2 = s2.hashes()
    with pytest.raises(KVCacheFull):
        sp.prefill(_prompt(20, setup.n_vocab, 10), s2)
    assert s2.hashes() == h2 and s2.pos == cap - 12 and s2.kv.length == cap - 12
    st.release()
    s2.release()


@gpu
def test_prefill_switch_routes_to_generic(setup, monkeypatch):
    """STRATA_CUDA_HYBRID_PREFILL=0: the wrapper sends n > 1 tokens to the model's own forward (the bench's
    reference); both routes give the same logits within the plan tolerance."""
    monkeypatch.setenv("STRATA_CUDA_HYBRID_PREFILL", "0")
    off = Q.Qwen35GraphModel(setup.cuda)
    assert off.prefill is False
    monkeypatch.setenv("STRATA_CUDA_HYBRID_PREFILL", "1")
    on = Q.Qwen35GraphModel(setup.cuda)
    assert on.prefill is True
    toks = _prompt(24, setup.n_vocab, 5)
    a, b = setup.cuda.new_state(setup.pool), setup.cuda.new_state(setup.pool)
    calls = []
    real = Q.Qwen35Cuda.prefill

    def spy(self, *args, **kw):
        calls.append(len(args[0]))
        return real(self, *args, **kw)
    monkeypatch.setattr(Q.Qwen35Cuda, "prefill", spy)
    la = off.forward(toks, a)
    assert calls == []
    lb = on.forward(toks, b)
    assert calls == [24]
    assert rel_l2(la, lb) < PLAN_REL_L2
    a.release()
    b.release()
