"""The batched decode step on a GPU (strata/backend/cuda/batch.py through Stage.forward_batch and
strata/stages/batch.decode_batch): one token of each of N live sequences, each at its own position with its own
pages and running state, as the decode step over N columns; every row's logits and every sequence's K/V and running
state after it bit-identical to that sequence's lone decode step (the plan's decode graph, itself checked against
numpy, transformers and the CPU backend by test_cuda_kernels.py, test_cuda_parity.py and test_cuda_qwen35.py),
whatever the other rows are and whichever row it sits in. The default model (llama: the handoff form, the separate
form, a q8_0 KV cache) and a synthetic qwen35 hybrid (Q8_0 and F16 weights, f16 and q8_0 caches), 1 and 2 stages,
N = 1, 2, 3, 4, 8, 16, over three steps that change the rows' order and membership, with sequences on both sides of
the 256-token page and the 2048-position attention classes. Skipped without a GPU."""
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.gguf import synth

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cuda_marks import CUDA_WHY as _why  # noqa: E402
from tests.cuda_marks import default_model_missing  # noqa: E402

pytestmark = pytest.mark.skipif(_why is not None, reason=f"CUDA backend unavailable: {_why}")
_no_model = default_model_missing()

LENGTHS = [37, 0, 255, 2000, 130, 256, 1, 300, 3, 17, 64, 511, 2, 90, 1000, 7]


def _stages(path, split, kv="f16"):
    from strata.gguf.file import open_gguf
    from strata.stages import build_stages
    return build_stages(open_gguf(path), ["cuda:0"], split, n_ctx=2304, kv=kv, pool_ctx=2 * 16 * 2304)


def _check(stages, n, seed, setup=None, hidden=False):
    from strata.stages.batch import decode_batch
    from strata.stages.sequence import Sequence
    V = stages[-1].model.config.n_vocab
    rng = np.random.default_rng(seed)
    pairs = []
    try:
        for i in range(n):
            a, b = Sequence(stages), Sequence(stages)
            pairs.append((a, b))
            if setup is not None and i == 0:
                setup(a)
            prompt = rng.integers(0, V, LENGTHS[i]).astype(np.int32)
            if len(prompt):
                a.forward(prompt)
                b.forward(prompt)
        odd = list(range(0, n, 2))
        orders = [list(range(n)), list(range(n))[::-1], odd[1:] + odd[:1]]
        for step, order in enumerate(orders):
            toks = rng.integers(0, V, len(order)).astype(np.int32)
            on_device = step == 1         # the logits left on the device (a step whose rows sample there)
            got = decode_batch([pairs[i][0] for i in order], toks, hidden=hidden, on_device=on_device)
            if hidden:       # the final-normed rows the MTP drafters read: each as the lone step's
                got, hs = got
            if on_device:     # one row is the lone forward itself, whose logits come back on the host
                assert n == 1 or not isinstance(got, np.ndarray)
                got = got if isinstance(got, np.ndarray) else got.get()
                if hidden:
                    assert hs.shape == (len(order), stages[-1].model.config.n_embd)
            assert got.shape == (len(order), V) and np.isfinite(got).all()
            for r, i in enumerate(order):
                want = pairs[i][1].forward(toks[r:r + 1], hidden=hidden)
                if hidden:
                    want, h = want
                    np.testing.assert_array_equal(np.asarray(hs[r].get()), np.asarray(h.get()).reshape(-1),
                                                  err_msg=f"n {n}, step {step}, row {r}: final-normed row")
                np.testing.assert_array_equal(got[r], np.asarray(want).reshape(-1),
                                              err_msg=f"n {n}, step {step}, row {r} (sequence {i} "
                                                      f"at {pairs[i][1].pos - 1})")
        for i, (a, b) in enumerate(pairs):
            assert a.pos == b.pos and a.positions() == b.positions()
            assert a.hashes() == b.hashes(), f"sequence {i}: state differs from the lone steps'"
    finally:
        for a, b in pairs:
            a.drop()
            b.drop()


@pytest.fixture(scope="module")
def smol_path():
    if _no_model is not None:
        pytest.skip(_no_model)
    from strata.gguf.default_model import default_model_path
    return default_model_path()


@pytest.mark.parametrize("split", [None, [13]], ids=["1stage", "2stages"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_llama_batch_rows_bit_identical(smol_path, split, n):
    stages = _stages(smol_path, split)
    assert stages[0].runner.plan(stages[0].memory.pool)._form() == "handoff"
    _check(stages, n, seed=n)


def _separate(seq):
    for st, sid in zip(seq.stages, seq.sids):
        plan = st.runner.plan(st.memory.seq(sid).kv.pool)
        plan.norm_handoff, plan.fused_norm = False, False
        plan.__dict__.pop("_short_form", None)
        assert plan._form() == "separate"


@pytest.mark.parametrize("n", [3, 8])
def test_llama_separate_form_and_q8_0_cache(smol_path, n):
    _check(_stages(smol_path, None), n, seed=20 + n, setup=_separate)
    stages = _stages(smol_path, [9], kv="q8_0")
    assert stages[0].runner.plan(stages[0].memory.pool)._form() == "separate"
    _check(stages, n, seed=30 + n)


def _hybrid(tmp_path_factory, qtype):
    spec = synth.preset("qwen35", "tiny", n_embd=128, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                        head_k_dim=64, head_v_dim=64, n_k_heads=2, n_v_heads=4, n_mtp=0, qtype=qtype,
                        embd_qtype="Q8_0", seed=11)
    return synth.write_synthetic(tmp_path_factory.mktemp(f"q35{qtype}") / "q35.gguf", spec)


@pytest.fixture(scope="module")
def hybrid_paths(tmp_path_factory):
    if _no_model is not None:
        pytest.skip(_no_model)
    return {q: _hybrid(tmp_path_factory, q) for q in ("Q8_0", "F16")}


@pytest.mark.parametrize("split", [None, [3]], ids=["1stage", "2stages"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_hybrid_batch_rows_bit_identical(hybrid_paths, split, n):
    stages = _stages(hybrid_paths["Q8_0"], split)
    _check(stages, n, seed=50 + n)


@pytest.mark.parametrize("split", [None, [3]], ids=["1stage", "2stages"])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_hybrid_batch_gives_the_final_normed_rows_of_the_lone_steps(hybrid_paths, split, n):
    """hidden=True (MTP drafters on, --parallel): the batched step gives each row's final-normed hidden state as its
    lone step does, so drafters keep the batch instead of falling back to one lone step per slot."""
    _check(_stages(hybrid_paths["Q8_0"], split), n, seed=90 + n, hidden=True)


@pytest.mark.parametrize("qtype,kv", [("F16", "f16"), ("Q8_0", "q8_0")])
def test_hybrid_other_weights_and_cache(hybrid_paths, qtype, kv):
    _check(_stages(hybrid_paths[qtype], None, kv=kv), 8, seed=70)


def test_batch_graphs_reused_and_state_sets_stay(hybrid_paths):
    """The same rows in the same classes replay one captured graph; a sequence keeps its running-state set from step
    to step, and a lone decode step between batched ones moves it home (set 0) and back, its bits unchanged."""
    from strata.backend.cuda.batch import BatchStep
    from strata.stages.batch import decode_batch
    from strata.stages.sequence import Sequence
    stages = _stages(hybrid_paths["Q8_0"], None)
    seqs = [Sequence(stages) for _ in range(3)]
    ref = [Sequence(stages) for _ in range(3)]
    for s, r in zip(seqs, ref):
        s.forward([5, 6, 7])
        r.forward([5, 6, 7])
    plan = stages[0].runner.plan(stages[0].memory.seq(seqs[0].sids[0]).kv.pool)
    for k in range(4):
        got = decode_batch(seqs, [k, k + 1, k + 2])
        for i, r in enumerate(ref):
            np.testing.assert_array_equal(got[i], r.forward([k + i]))
        if k == 1:
            np.testing.assert_array_equal(seqs[1].forward([9]), ref[1].forward([9]))
    step = BatchStep.of(plan)
    assert len(step.graphs) <= 2 and len(step.sets) <= 4
    for s, r in zip(seqs, ref):
        assert s.hashes() == r.hashes()
