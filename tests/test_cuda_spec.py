"""Speculative decoding on CUDA stages (--spec N on cuda:0): the verify is the plan's short read with each row's
running state kept in the sequence's kept slots on the device, and the Commit takes the accepted row's state.

* the keep launchers (strata_q35_conv_rows_keep, strata_q35_gdn_steps_keep): slot t holds, bit for bit, the window
  and the state that t + 1 one-token steps leave; outputs and final state equal the plain row launchers'; a NULL
  kept pointer writes nothing;
* on the synthetic tiny hybrid with an MTP block: a verify's rows are the decode steps' logits bit for bit, and
  after commit(base + p) the K/V and running state hash as p one-token steps leave them, for every p (fails when the
  kept slot index or the Commit's copy is off);
* greedy --spec 1..4 at acceptance 1, 0.6 and 0 (an oracle drafter: the recorded --spec 0 continuation, each
  drafted position kept with that probability) emits --spec 0's tokens and leaves the same K/V and running state,
  on one stage, two stages (each with a GDN layer) and two stages whose second holds only attention;
* lookup drafts on a llama (attention only: a Commit cuts the K/V back) on one and two stages, at full, partial and
  no acceptance: --spec 0's tokens and K/V;
* a greedy verify without penalties or logprobs is judged from each row's greedy pick taken on the device (the rows
  left there are the host rows' bits), any other from host rows, both emitting --spec 0's tokens.
Skips without a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_marks import default_model_missing, gpu
from tests.helpers import generate_all

pytestmark = [gpu, pytest.mark.skipif(default_model_missing() is not None, reason=f"{default_model_missing()}")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A qwen35 with an MTP block that the CUDA plan runs: 6 GDN + 2 attention layers (3 and 7), head_dim 64,
    d_k = d_v = 64, 4 value heads over 2 key heads, Q8_0."""
    from strata.gguf import synth
    spec = synth.preset("qwen35", "tiny", n_embd=128, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                        head_k_dim=64, head_v_dim=64, n_k_heads=2, n_v_heads=4, n_mtp=1, qtype="Q8_0",
                        embd_qtype="Q8_0", seed=11)
    return synth.write_synthetic(tmp_path_factory.mktemp("cuda_spec") / "q35_mtp.gguf", spec)


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n)]


def _engine(path, split=None, **kw):
    from strata.engine.engine import Engine
    dev = "cuda:0" if split is None else "cuda:0,cuda:0"
    return Engine(path, n_ctx=256, device=dev, layer_split=split, **kw)


def _run(engine, prompt, **kw):
    toks, finals = generate_all(engine, prompt, **kw)
    return [e.token_id for e in toks], finals


def _state(seq):
    """The tokens and every layer's K/V and running state (the drafter's K/V left out)."""
    h = seq.hashes()
    return seq.pos, {k: v for k, v in h.items() if k == "tokens" or k.startswith(("kv", "running"))}


class Oracle:
    """Drafts the recorded continuation by absolute position, each kept with probability `rate`, else replaced."""

    def __init__(self, by_pos, rate, n_vocab, seed):
        self.by_pos, self.rate, self.n_vocab = by_pos, rate, n_vocab
        self.rng = np.random.default_rng(seed)

    def __call__(self, pos, token):
        want = self.by_pos.get(pos)
        if want is None:
            return token
        return want if self.rng.random() < self.rate else (want + 1) % self.n_vocab


@pytest.mark.parametrize("nk,nv,dk,dv,K", [(2, 4, 16, 16, 4), (1, 2, 128, 128, 4), (4, 4, 32, 96, 3)])
def test_keep_launchers_keep_every_token(nk, nv, dk, dv, K):
    """conv_rows_keep / gdn_steps_keep over n tokens: outputs, final window and state equal the plain row launchers';
    kept slot t equals the window / state after t + 1 one-token launches, bit for bit; a NULL kept pointer leaves
    the slots untouched."""
    import cupy as cp
    from strata.backend.cuda import library as KL
    lb, s = KL.lib(), KL.stream_ptr()
    rng = np.random.default_rng(nk * 10 + dv)
    conv_dim, vdim = 2 * nk * dk + nv * dv, nv * dv
    P = conv_dim + vdim + 2 * nv
    b_off, a_off = conv_dim + vdim, conv_dim + vdim + nv
    w = cp.asarray(rng.standard_normal((conv_dim, K)).astype(np.float32) * 0.5)
    A = cp.asarray(-rng.uniform(0.1, 1.0, nv).astype(np.float32))
    dt = cp.asarray(rng.standard_normal(nv).astype(np.float32))
    scale = float(1.0 / dk ** 0.5)
    for n in (1, 3, 5, 8):
        proj = cp.asarray(rng.standard_normal((n, P)).astype(np.float32))
        win0 = rng.standard_normal((K - 1, conv_dim)).astype(np.float32)
        st0 = (rng.standard_normal((nv, dk, dv)) * 0.1).astype(np.float32)
        kw_, ks_ = cp.full((n, K - 1, conv_dim), 7.0, cp.float32), cp.full((n, nv, dk, dv), 7.0, cp.float32)
        tab = cp.asarray(np.asarray([kw_.data.ptr, ks_.data.ptr, 0, 0], np.uint64))
        res = {}
        for mode in ("keep", "null", "plain", "steps"):
            win, st = cp.asarray(win0), cp.asarray(st0)
            y, ov = cp.zeros((n, conv_dim), cp.float32), cp.zeros((n, vdim), cp.float32)
            kept = []
            if mode == "steps":
                for t in range(n):
                    KL.check(lb.strata_q35_conv(s, KL.ptr(proj[t]), KL.ptr(w), KL.ptr(win), KL.ptr(y[t]), conv_dim,
                                                K), "conv")
                    KL.check(lb.strata_q35_gdn_step(s, KL.ptr(y[t]), KL.ptr(proj[t]), KL.ptr(A), KL.ptr(dt),
                                                    KL.ptr(st), KL.ptr(ov[t]), nv, nk, dk, dv, 0, b_off, a_off, 0,
                                                    scale, 1e-6), "gdn_step")
                    kept.append((cp.asnumpy(win), cp.asnumpy(st)))
            elif mode == "plain":
                KL.check(lb.strata_q35_conv_rows(s, KL.ptr(proj), P, KL.ptr(w), KL.ptr(win), KL.ptr(y), conv_dim, n,
                                                 conv_dim, K), "conv_rows")
                KL.check(lb.strata_q35_gdn_steps(s, KL.ptr(y), conv_dim, KL.ptr(proj), P, KL.ptr(A), KL.ptr(dt),
                                                 KL.ptr(st), KL.ptr(ov), vdim, n, nv, nk, dk, dv, 0, b_off, a_off, 0,
                                                 scale, 1e-6), "gdn_steps")
            else:
                base = tab.data.ptr + (0 if mode == "keep" else 16)      # 'null': the pointers hold 0
                pc, ps = (KL.ffi().cast("float *const *", base + 8 * i) for i in range(2))
                KL.check(lb.strata_q35_conv_rows_keep(s, KL.ptr(proj), P, KL.ptr(w), KL.ptr(win), KL.ptr(y),
                                                      conv_dim, n, conv_dim, K, pc, (K - 1) * conv_dim),
                         "conv_rows_keep")
                KL.check(lb.strata_q35_gdn_steps_keep(s, KL.ptr(y), conv_dim, KL.ptr(proj), P, KL.ptr(A),
                                                      KL.ptr(dt), KL.ptr(st), KL.ptr(ov), vdim, n, nv, nk, dk, dv, 0,
                                                      b_off, a_off, 0, scale, 1e-6, ps, nv * dk * dv),
                         "gdn_steps_keep")
                kept = [(cp.asnumpy(kw_[t]), cp.asnumpy(ks_[t])) for t in range(n)]
            res[mode] = ([cp.asnumpy(a) for a in (y, ov, win, st)], kept)
        for mode in ("keep", "null", "plain"):
            for name, a, b in zip(("y", "o", "window", "state"), res[mode][0], res["steps"][0]):
                np.testing.assert_array_equal(a, b, err_msg=f"{mode} {name} n={n}")
        for t in range(n):
            np.testing.assert_array_equal(res["keep"][1][t][0], res["steps"][1][t][0], err_msg=f"window {t}/{n}")
            np.testing.assert_array_equal(res["keep"][1][t][1], res["steps"][1][t][1], err_msg=f"state {t}/{n}")
        assert float(cp.abs(kw_ - 7.0).max()) > 0            # the keep run wrote the slots ...
        kw_[...] = 7.0
        ks_[...] = 7.0
        # ... and a run with the table's pointers at 0 writes none of them
        win, st = cp.asarray(win0), cp.asarray(st0)
        y, ov = cp.zeros((n, conv_dim), cp.float32), cp.zeros((n, vdim), cp.float32)
        pc, ps = (KL.ffi().cast("float *const *", tab.data.ptr + 16 + 8 * i) for i in range(2))
        KL.check(lb.strata_q35_conv_rows_keep(s, KL.ptr(proj), P, KL.ptr(w), KL.ptr(win), KL.ptr(y), conv_dim, n,
                                              conv_dim, K, pc, (K - 1) * conv_dim), "conv_rows_keep")
        KL.check(lb.strata_q35_gdn_steps_keep(s, KL.ptr(y), conv_dim, KL.ptr(proj), P, KL.ptr(A), KL.ptr(dt),
                                              KL.ptr(st), KL.ptr(ov), vdim, n, nv, nk, dk, dv, 0, b_off, a_off, 0,
                                              scale, 1e-6, ps, nv * dk * dv), "gdn_steps_keep")
        assert float(cp.abs(kw_ - 7.0).max()) == 0 and float(cp.abs(ks_ - 7.0).max()) == 0


@pytest.mark.parametrize("split", [None, "2"], ids=["1stage", "2stages"])
def test_verify_rows_and_commit_equal_decode_steps(model, split):
    """A verify of 5 tokens: each row's logits equal the one-token decode steps' bit for bit; commit(base + p) leaves
    the K/V and running state of p decode steps (p = 1..5), and the next decode step's logits are those of
    decoding on from there."""
    from strata.backend.cuda.qwen35 import Qwen35GraphModel
    e = _engine(model, split, spec=4)
    assert all(st.speculates is None and isinstance(st.runner, Qwen35GraphModel) for st in e.stages)
    assert e.drafter._graph is not None
    seq = e.seq
    seq.reset()
    seq.forward(np.asarray(_prompt(21, 1), np.int32))
    ck = seq.capture()
    base = seq.pos
    toks = np.asarray(_prompt(6, 2), np.int32)
    ref_logits, ref_state = [], []
    for t in toks:
        ref_logits.append(np.asarray(seq.forward(np.asarray([t], np.int32))))
        ref_state.append(_state(seq))
    for p in range(1, 6):
        seq.restore(ck)
        rows, h = seq.verify(toks[:5])
        assert h.shape[0] == 5
        for i in range(5):
            np.testing.assert_array_equal(np.asarray(rows[i]), ref_logits[i], err_msg=f"row {i}")
        if p == 1:      # the rows left on the device (a greedy verify judged there): the same bits, the same picks
            from strata.sampling.device import DeviceSampler
            from strata.sampling.sampler import SamplingParams
            seq.restore(ck)
            rows_d, h = seq.verify(toks[:5], on_device=True)
            assert not isinstance(rows_d, np.ndarray) and rows_d.shape == (5, e.n_vocab)
            for i in range(5):
                np.testing.assert_array_equal(rows_d[i].get(), ref_logits[i], err_msg=f"device row {i}")
            picks = DeviceSampler(SamplingParams(temperature=0), e.n_vocab).greedy_rows(rows_d)
            assert picks == [int(np.argmax(r)) for r in ref_logits[:5]]
        seq.commit(base + p)
        assert _state(seq) == ref_state[p - 1], f"commit({base} + {p})"
        np.testing.assert_array_equal(np.asarray(seq.forward(toks[p:p + 1])), ref_logits[p],
                                      err_msg=f"the step after commit({base} + {p})")
    ck.release()


@pytest.mark.parametrize("split", [None, "2", "7"], ids=["1stage", "2stages", "2stages_attn_tail"])
def test_greedy_spec_equals_spec0(model, split):
    """--spec N (N = 1..4) at acceptance 1, 0.6 and 0 emits what --spec 0 does and leaves the same K/V and running
    state; a max_tokens inside a verify too."""
    prompt = _prompt(23, 3)
    base = _engine(model, split)
    ref, fin0 = _run(base, prompt)
    ref_state = _state(base.seq)
    short, _ = _run(base, prompt, max_tokens=7, cache_prompt=False)
    short_state = _state(base.seq)
    assert fin0[0].timings["draft_n"] == 0
    by_pos = {len(prompt) + i: t for i, t in enumerate(ref)}
    e = _engine(model, split, spec=4)
    for n in (1, 2, 3, 4):
        e.decoder.spec = n
        for rate in (1.0, 0.6, 0.0):
            e.drafter.oracle = Oracle(by_pos, rate, e.n_vocab, seed=n)
            got, fin = _run(e, prompt, cache_prompt=False)
            assert got == ref, (split, n, rate)
            assert _state(e.seq) == ref_state, (split, n, rate)
            t = fin[0].timings
            assert t["draft_n"] > 0
            if rate == 1.0:
                assert t["draft_n_accepted"] == t["draft_n"]
            if rate == 0.0:
                assert t["draft_n_accepted"] == 0
            got, _ = _run(e, prompt, cache_prompt=False, max_tokens=7)
            assert got == short and _state(e.seq) == short_state, (split, n, rate)


@pytest.mark.parametrize("split", [None, "7"], ids=["1stage", "2stages_attn_tail"])
def test_greedy_verify_judged_on_the_device_or_the_host(model, split, greedy_rows_calls):
    """A greedy request without penalties or logprobs judges its verifies from the rows' greedy picks taken on the
    device (DeviceSampler.greedy_rows, counted here); one with logprobs or a repeat penalty from host rows (no
    picks taken); each emits what --spec 0 emits with the same sampling settings."""
    from strata.sampling.sampler import SamplingParams
    calls = greedy_rows_calls
    prompt = _prompt(17, 5)
    base = _engine(model, split)
    e = _engine(model, split, spec=3)
    for params, on_device in ((SamplingParams(temperature=0), True),
                              (SamplingParams(temperature=0, logprobs=2), False),
                              (SamplingParams(temperature=0, repeat_penalty=1.3, repeat_last_n=-1), False)):
        ref, _ = _run(base, prompt, sampling=params, cache_prompt=False)
        by_pos = {len(prompt) + i: t for i, t in enumerate(ref)}
        e.drafter.oracle = Oracle(by_pos, 0.7, e.n_vocab, seed=3)
        calls.clear()
        got, fin = _run(e, prompt, sampling=params, cache_prompt=False)
        assert got == ref, params
        assert fin[0].timings["draft_verifies"] > 0
        assert (len(calls) == fin[0].timings["draft_verifies"]) if on_device else not calls, (params, calls)


def test_real_drafter_runs_on_the_device(model):
    """The MTP head's own drafts (no oracle) on a CUDA stage: the answer is --spec 0's and drafts were made."""
    prompt = _prompt(19, 4)
    ref, _ = _run(_engine(model), prompt, max_tokens=20)
    e = _engine(model, spec=3)
    got, fin = _run(e, prompt, max_tokens=20)
    assert got == ref and fin[0].timings["draft_n"] > 0


def test_mtp_graph_step_matches_the_model(model):
    """The MTP block's graph step (strata.backend.cuda.mtp) against the model's own mtp_logits on the same hidden
    states and tokens: logits rel L2 < 2e-2 (q8_1 activations in the graph), the argmax is the logits' own, and
    the step appends one position to the drafter's table."""
    from tests.cuda_marks import host, rel_l2
    e = _engine(model, spec=2)
    d, md = e.drafter, e.drafter.model
    assert d._graph is not None
    rng = np.random.default_rng(9)
    E = md.config.n_embd
    hs = rng.standard_normal((3, E)).astype(np.float32)
    toks = np.asarray(_prompt(3, 10), np.int32)
    ref = md.mtp_logits(hs, toks, md.new_mtp_kv(64))
    table = md.new_mtp_kv(64)
    for i in range(3):
        tok, logits = d._graph.step(int(toks[i]), table, hs[i])
        got = host(logits)
        assert rel_l2(got, ref[i]) < 2e-2, i
        assert tok == int(np.argmax(got)) and table.length == i + 1
    # drafting on: the step from its own output equals mtp_logits fed that output as h
    t2 = md.new_mtp_kv(64)
    x = md.mtp_hidden(hs[:1], toks[:1], t2)
    ref2 = md.mtp_logits(x, toks[1:2], t2)[0]
    t3 = md.new_mtp_kv(64)
    d._graph.step(int(toks[0]), t3, hs[0])
    _, logits = d._graph.step(int(toks[1]), t3)
    assert rel_l2(host(logits), ref2) < 2e-2


def test_copy_many_copies_every_pair():
    """CudaBackend.copy_many: every pair copied in one launch (16-byte aligned and odd sizes), nothing else written;
    unequal sizes refused."""
    import cupy as cp
    from strata.backend.cuda import CudaBackend
    be = CudaBackend(0)
    rng = np.random.default_rng(1)
    srcs = [cp.asarray(rng.standard_normal(k).astype(np.float32)) for k in (3, 64, 4096 * 33 + 5, 1)]
    dsts = [cp.zeros(a.size + 2, cp.float32) for a in srcs]
    be.copy_many([(d[1:1 + s.size], s) for d, s in zip(dsts, srcs)])
    for d, s in zip(dsts, srcs):
        got = cp.asnumpy(d)
        np.testing.assert_array_equal(got[1:-1], cp.asnumpy(s))
        assert got[0] == 0 and got[-1] == 0
    big = cp.asarray(rng.standard_normal((5, 16, 64)).astype(np.float32))
    out = cp.zeros_like(big[0])
    be.copy_many([(out, big[3])])
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(big[3]))
    with pytest.raises(ValueError, match="pair 0"):
        be.copy_many([(out, big[:2])])


@pytest.mark.parametrize("split", [None, "15"], ids=["1stage", "2stages"])
def test_lookup_drafts_on_a_llama_equal_spec0(split):
    """--spec 3 --spec-draft lookup on the default model (a llama the CUDA plan runs) on CUDA stages emits --spec 0's
    tokens and leaves its K/V, at the lookup's own acceptance and with its drafts spoiled to partial and no
    acceptance."""
    from strata.gguf.default_model import default_model_path
    from tests.spec_checks import spoil
    path = default_model_path()
    block = _prompt(10, 2)
    prompt = _prompt(9, 1) + block + _prompt(4, 3) + block[:5]
    base = _engine(path, split)
    ref, _ = _run(base, prompt, max_tokens=24)
    ref_state = _state(base.seq)
    e = _engine(path, split, spec=3, spec_draft="lookup")
    for rate in (None, 0.5, 0.0):
        if rate is not None:
            spoil(e, rate, seed=1)
        got, fin = _run(e, prompt, max_tokens=24, cache_prompt=False)
        assert got == ref, (split, rate)
        assert _state(e.seq) == ref_state, (split, rate)
        assert fin[0].timings["draft_n"] > 0, (split, rate)
