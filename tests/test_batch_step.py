"""The batched decode step (strata/stages/batch.py, StageBase.forward_batch, Model.forward_batch) on CPU stages: one
token of each of N live sequences, each at its own position, through every stage at once; every row's logits, and
every sequence's K/V and running state after it, bit-identical to the same sequence's lone decode step, whatever the
other rows are and whichever row it sits in. Checked for the default model (SmolLM2, llama) and a synthetic qwen35
hybrid, on 1 and 2 stages, N = 1, 2, 3, 4, 8, over three steps that change the rows' order and membership."""
import numpy as np
import pytest

from strata.gguf import synth
from strata.gguf.file import open_gguf
from strata.stages import build_stages
from strata.stages.batch import decode_batch
from strata.stages.sequence import Sequence

# prompt lengths of the sequences: position 0, short ones, both sides of the 256-token page boundary
LENGTHS = [37, 0, 255, 5, 130, 256, 1, 300]
NS = (1, 2, 3, 4, 8)


def _stages(path, split):
    return build_stages(open_gguf(path), ["cpu"], split, n_ctx=512, pool_ctx=2 * 8 * 512)


def _twins(stages, n, seed):
    """n pairs of sequences (batched, lone) over `stages`, each pair read the same prompt of LENGTHS[i] tokens."""
    V = stages[0].model.config.n_vocab
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        a, b = Sequence(stages), Sequence(stages)
        prompt = rng.integers(0, V, LENGTHS[i]).astype(np.int32)
        if len(prompt):
            a.forward(prompt)
            b.forward(prompt)
        pairs.append((a, b))
    return pairs


def _check(stages, n, seed, hidden=False):
    V = stages[0].model.config.n_vocab
    pairs = _twins(stages, n, seed)
    rng = np.random.default_rng(seed + 100)
    try:
        # step 1: rows in order; step 2: reversed; step 3: every other sequence (the rest wait), rotated
        orders = [list(range(n)), list(range(n))[::-1], (list(range(0, n, 2)) * 2)[1:1 + len(range(0, n, 2))]]
        for step, order in enumerate(orders):
            toks = rng.integers(0, V, len(order)).astype(np.int32)
            got = decode_batch([pairs[i][0] for i in order], toks, **({"hidden": True} if hidden else {}))
            if hidden:
                got, h = got
                assert h.shape == (len(order), stages[-1].model.config.n_embd)
            assert got.shape == (len(order), V) and got.dtype == np.float32 and np.isfinite(got).all()
            for r, i in enumerate(order):
                want = pairs[i][1].forward(toks[r:r + 1], hidden=hidden)
                if hidden:      # the drafter's row: as the lone read's final-normed row
                    want, want_h = want
                    np.testing.assert_array_equal(h[r:r + 1], want_h, err_msg=f"hidden row {r}, step {step}")
                np.testing.assert_array_equal(got[r], want, err_msg=f"n {n}, step {step}, row {r} (sequence {i}, "
                                                                    f"position {pairs[i][1].pos - 1})")
        for i, (a, b) in enumerate(pairs):
            assert a.pos == b.pos and a.positions() == b.positions()
            assert a.hashes() == b.hashes(), f"sequence {i}: state differs from the lone steps'"
    finally:
        for a, b in pairs:
            a.drop()
            b.drop()


@pytest.mark.parametrize("split", [None, [13]], ids=["1stage", "2stages"])
@pytest.mark.parametrize("n", NS)
def test_default_model_batch_rows_bit_identical(default_model_path, split, n):
    _check(_stages(default_model_path, split), n, seed=n)


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory):
    spec = synth.preset("qwen35", "tiny", n_embd=128, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                        head_k_dim=64, head_v_dim=64, n_k_heads=2, n_v_heads=4, n_mtp=0, qtype="Q8_0",
                        embd_qtype="Q8_0", seed=11)
    return synth.write_synthetic(tmp_path_factory.mktemp("q35b") / "q35.gguf", spec)


@pytest.mark.parametrize("split", [None, [3]], ids=["1stage", "2stages"])
@pytest.mark.parametrize("n", NS)
def test_hybrid_batch_rows_bit_identical(hybrid_path, split, n):
    _check(_stages(hybrid_path, split), n, seed=50 + n)


@pytest.mark.parametrize("split", [None, [3]], ids=["1stage", "2stages"])
def test_batch_hidden_rows_bit_identical(hybrid_path, default_model_path, split):
    """hidden=True (the MTP drafters' rows with --spec and several slots): each row's logits and final-normed hidden
    state equal its lone read's with hidden=True, on the hybrid (1 and 2 stages) and the llama model."""
    _check(_stages(hybrid_path, split), 4, seed=70, hidden=True)
    if split is None:
        _check(_stages(default_model_path, None), 3, seed=71, hidden=True)


def test_batch_refusals_change_nothing(default_model_path):
    stages = _stages(default_model_path, None)
    a, b = Sequence(stages), Sequence(stages)
    a.forward([1, 2, 3])
    h = a.hashes()
    for seqs, toks, what in (([a, a], [1, 2], "at most once"), ([a, b], [1], "one token per sequence"),
                             ([a], [10 ** 9], "out of range")):
        with pytest.raises(ValueError, match=what):
            decode_batch(seqs, toks)
    assert a.pos == 3 and a.positions() == [3] and a.hashes() == h


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_moe_hybrid_batch_rows_bit_identical(synthetic, arch):
    """MoE FFN layers (routed experts, shared expert): the FFN row by row, the rest batched."""
    _check(_stages(synthetic(arch, seed=21), None), 4, seed=90)
    _check(_stages(synthetic(arch, seed=21), None), 3, seed=91, hidden=True)


def test_batch_pool_full_changes_nothing(default_model_path):
    """A pool that cannot hold one more token for every sequence: KVCacheFull, every position and state as before."""
    from strata.memory import KVCacheFull
    stages = build_stages(open_gguf(default_model_path), ["cpu"], None, n_ctx=256, pool_ctx=512)
    a, b = Sequence(stages), Sequence(stages)
    a.forward(np.arange(256, dtype=np.int32))
    b.forward(np.arange(200, dtype=np.int32))
    h = (a.hashes(), b.hashes())
    with pytest.raises(KVCacheFull):
        decode_batch([b, a], [1, 2])
    assert (a.pos, b.pos) == (256, 200) and (a.positions(), b.positions()) == ([256], [200])
    assert (a.hashes(), b.hashes()) == h


def _check_verify(stages, seed):
    """Two rounds of verifies of 3 sequences (lengths summing to at most 16 rows) through verify_batch against
    each twin's own Sequence.verify: every row's logits and final-normed hidden state bit for bit, then each
    sequence committed at its own position and its state (K/V, running state) equal to its twin's."""
    from strata.stages.batch import verify_batch
    V = stages[0].model.config.n_vocab
    pairs = _twins(stages, 3, seed)
    rng = np.random.default_rng(seed + 7)
    try:
        for lens, keep in (([4, 2, 5], [1, 2, 5]), ([6, 1, 3], [3, 1, 1])):
            lists = [rng.integers(0, V, n).astype(np.int32) for n in lens]
            base = [a.pos for a, _ in pairs]
            got = verify_batch([a for a, _ in pairs], lists)
            for i, ((a, b), t) in enumerate(zip(pairs, lists)):
                rows, h = b.verify(t)
                np.testing.assert_array_equal(got[i][0], rows, err_msg=f"sequence {i}'s rows")
                np.testing.assert_array_equal(got[i][1], h, err_msg=f"sequence {i}'s hidden rows")
                a.commit(base[i] + keep[i])
                b.commit(base[i] + keep[i])
                assert a.hashes() == b.hashes(), f"sequence {i}: state after the Commit differs"
    finally:
        for a, b in pairs:
            a.drop()
            b.drop()


@pytest.mark.parametrize("split", [None, [3]], ids=["1stage", "2stages"])
def test_batched_verify_rows_and_commits_bit_identical(hybrid_path, split):
    """strata.stages.batch.verify_batch (several slots' speculative verifies, every weight read once for all rows on
    the CPU): rows, hidden rows and the states Commits leave equal each sequence's own verify."""
    _check_verify(_stages(hybrid_path, split), seed=80)


def test_batched_verify_moe_hybrid(synthetic):
    _check_verify(_stages(synthetic("qwen35moe", seed=21), None), seed=81)
