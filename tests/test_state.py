"""SequenceState on the real default model: capture/restore exactness and hashes, divergence checks, truncate,
nbytes; and the running-state half of the interface (recurrent layers) on plain arrays."""
from __future__ import annotations

import numpy as np
import pytest

from strata.backend.cpu import CPUBackend
from strata.kv_cache import PagedKV
from strata.state import SequenceState, StateMismatch

rng = np.random.default_rng(7)
A = rng.integers(0, 49152, 40).astype(np.int32)
B = rng.integers(0, 49152, 25).astype(np.int32)
C = rng.integers(0, 49152, 30).astype(np.int32)


@pytest.fixture(scope="module")
def pool(default_model):
    # small pages so every sequence here crosses page boundaries
    return default_model.new_page_pool(256, n_seq=4, page_size=16)


@pytest.fixture(scope="module")
def reference(default_model, pool):
    """forward(A) then forward(B) in one sequence: B's logits and the final hashes."""
    st = default_model.new_state(pool)
    default_model.forward(A, st)
    lb = default_model.forward(B, st, all_logits=True)
    h = st.hashes()
    st.release()
    return lb, h


def test_capture_restore_continue_is_exact(default_model, pool, reference):
    lb_ref, h_ref = reference
    st = default_model.new_state(pool)
    default_model.forward(A, st)
    other = default_model.new_state(pool)
    default_model.forward(C[:20], other)  # takes the next pages, so st's page table is no longer one run
    snap = st.capture()
    h_a = st.hashes()
    default_model.forward(C, st)  # diverge past the snapshot
    assert st.hashes()["kv"] != h_a["kv"]
    st.restore(snap)
    assert st.pos == len(A) and st.kv.length == len(A) and st.tokens == A.tolist()
    assert st.hashes() == h_a
    lb = default_model.forward(B, st, all_logits=True)
    np.testing.assert_array_equal(lb, lb_ref)
    assert st.hashes() == h_ref  # hashes do not depend on which pages hold the K/V
    assert not st.kv.contiguous
    other.release()
    st.release()


def test_one_batch_equals_split_batches(default_model, pool, reference):
    """forward(A+B) == forward(A), forward(B) up to the matmul path's precision (different ubatch splits take
    different summation orders / activation quantization, so not bit-equal; same limits as the parity test)."""
    lb_ref, _ = reference
    st = default_model.new_state(pool)
    lab = default_model.forward(np.concatenate([A, B]), st, all_logits=True)[len(A):]
    d = np.abs(lab - lb_ref)
    assert d.max() < 2.5 and d.mean() < 0.25
    top2 = np.sort(lb_ref, axis=1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 0.25
    assert (lab.argmax(1) == lb_ref.argmax(1))[decisive].all()
    st.release()


def test_truncate_then_continue_is_exact(default_model, pool, reference):
    lb_ref, h_ref = reference
    st = default_model.new_state(pool)
    default_model.forward(A, st)
    default_model.forward(C[:7], st)
    st.truncate(len(A))
    assert st.pos == len(A) and len(st.tokens) == len(A)
    np.testing.assert_array_equal(default_model.forward(B, st, all_logits=True), lb_ref)
    assert st.hashes() == h_ref
    with pytest.raises(ValueError):
        st.truncate(st.pos + 1)
    st.release()


def test_restore_into_diverged_arena_raises_and_changes_nothing(default_model, pool):
    st = default_model.new_state(pool)
    default_model.forward(A, st)
    snap = st.capture()
    st.truncate(len(A) - 5)
    default_model.forward(C[:10], st)  # overwrites positions 35.. with other tokens
    before = st.hashes(), st.pos
    with pytest.raises(StateMismatch, match="diverged from the snapshot at position 35"):
        st.restore(snap)
    assert (st.hashes(), st.pos) == before
    fresh = default_model.new_state(pool)
    default_model.forward(A[:10], fresh)
    with pytest.raises(StateMismatch, match="holds only 10 tokens"):
        fresh.restore(snap)
    st.release()
    fresh.release()


def test_nbytes_counts_kv_of_valid_positions(default_model, pool):
    c = default_model.config
    st = default_model.new_state(pool)
    default_model.forward(A, st)
    per_token = c.n_layer * 2 * c.n_head_kv * c.head_dim * 4
    assert st.nbytes() == len(A) * per_token + 4 * len(A)
    assert st.capture().nbytes() == 4 * len(A)  # attention-only: a snapshot is position + tokens
    st.release()


def test_forward_rejects_bad_tokens_and_changes_nothing(default_model, pool):
    st = default_model.new_state(pool)
    default_model.forward(A[:5], st)
    h = st.hashes()
    with pytest.raises(ValueError, match="out of range"):
        default_model.forward(np.array([1, 49152]), st)
    with pytest.raises(ValueError, match="at least one token"):
        default_model.forward(np.array([], dtype=np.int32), st)
    assert st.hashes() == h and st.pos == 5
    st.release()


# --- running state (recurrent layers), independent of any model ---------------------------------------------

def make_recurrent_state():
    pool = CPUBackend().new_page_pool([1], 4, 2, 4, page_size=4)
    running = {0: {"conv": np.zeros((3, 8), np.float32), "ssm": np.zeros((2, 4, 4), np.float32)},
               2: {"conv": np.zeros((3, 8), np.float32), "ssm": np.zeros((2, 4, 4), np.float32)}}
    return SequenceState(PagedKV(pool), running)


def step(st, tok, r):
    """What a recurrent model's forward does to the state: update running arrays in place, advance."""
    for parts in st.running.values():
        for a in parts.values():
            a[...] = a * 0.5 + r.standard_normal(a.shape).astype(np.float32)
    st.kv.reserve(1)
    st.kv.commit(1)
    st.advance([tok])


def test_running_state_capture_restore_hash():
    r = np.random.default_rng(0)
    st = make_recurrent_state()
    for t in [5, 6, 7]:
        step(st, t, r)
    snap = st.capture()
    h = st.hashes()
    assert snap.nbytes() == 2 * (3 * 8 + 2 * 4 * 4) * 4 + 3 * 4
    step(st, 8, r)
    step(st, 9, r)
    assert st.hashes()["running"] != h["running"]
    assert snap.running[0]["ssm"] is not st.running[0]["ssm"]
    with pytest.raises(ValueError, match="running state"):
        st.truncate(3)  # a running state cannot be cut back; only restored
    st.restore(snap)
    assert st.hashes() == h and st.pos == 3
    step(st, 1, r)  # the snapshot is a copy: stepping the restored state leaves it intact
    st.restore(snap)
    assert st.hashes() == h
    st.truncate(0)
    assert st.pos == 0 and all((a == 0).all() for p in st.running.values() for a in p.values())
    assert st.nbytes() == 2 * (3 * 8 + 2 * 4 * 4) * 4
