"""Per-stage memory (strata/memory/): page ids and refcounts with copy-on-write, KV / recurrent / hybrid memories on
the real default model and on synthetic hybrids, capture / restore exactness, the byte format's round trip
(hypothesis over architectures, lengths and carves) and its refusals (carve, geometry, dtype, checksum), which
change nothing."""
from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as hs

from strata.gguf import synth
from strata.backend.cpu import CPUBackend
from strata.memory import (Carve, FormatError, KVCacheFull, PagedKV, PartMismatch, RecurrentMemory, StatePart)
from strata.memory.pages import PageAllocator
from strata.models.registry import load_model
from tests.mutation import mutate

rng = np.random.default_rng(7)
A = rng.integers(0, 49152, 40).astype(np.int32)
B = rng.integers(0, 49152, 25).astype(np.int32)
C = rng.integers(0, 49152, 30).astype(np.int32)
NKV, HD = 2, 8


# ---- page ids, refcounts, copy-on-write ----------------------------------------------------------------

def test_allocator_refcounts():
    a = PageAllocator(4, 16)
    p = a.alloc(2)
    assert p == [0, 1] and a.n_free == 2
    a.ref([0])
    a.unref([0, 1])
    assert a.refcount(0) == 1 and a.n_free == 3
    with pytest.raises(ValueError, match="not allocated"):
        a.ref([1])
    with pytest.raises(KVCacheFull, match="need 4 more pages"):
        a.alloc(4)
    assert a.n_free == 3
    a.unref([0])
    with pytest.raises(ValueError, match="already free"):
        a.unref([0])


def test_shared_pages_are_copied_before_a_write():
    be = CPUBackend()
    pool = be.new_page_pool([0], 8, NKV, HD, page_size=4)
    a, b = PagedKV(pool), PagedKV(pool)
    k = rng.standard_normal((6, NKV, HD)).astype(np.float32)
    a.reserve(6)
    pool.write(0, a.pages, 0, k, k)
    a.commit(6)
    b.share(a, 6)                                   # pages [0, 1] referenced, not copied
    assert b.pages == a.pages and pool.allocator.refcount(a.pages[1]) == 2 and pool.n_free == 6
    b.truncate(5)
    b.reserve(3)                                    # writes into shared page 1: copied first
    assert b.pages[0] == a.pages[0] and b.pages[1] != a.pages[1]
    k2 = rng.standard_normal((3, NKV, HD)).astype(np.float32)
    pool.write(0, b.pages, 5, k2, k2)
    b.commit(3)
    ka, _ = a.read(0)
    np.testing.assert_array_equal(ka, k.transpose(1, 0, 2))          # a's K/V untouched by b's write
    kb, _ = b.read(0)
    np.testing.assert_array_equal(kb[:, :5], k[:5].transpose(1, 0, 2))
    np.testing.assert_array_equal(kb[:, 5:], k2.transpose(1, 0, 2))
    a.release()
    b.release()
    assert pool.n_free == 8


def test_copy_on_write_needs_a_free_page_and_changes_nothing_without_one():
    pool = CPUBackend().new_page_pool([0], 2, NKV, HD, page_size=4)
    a, b = PagedKV(pool), PagedKV(pool)
    a.reserve(6)
    a.commit(6)
    b.share(a, 6)
    b.truncate(5)
    with pytest.raises(KVCacheFull):
        b.reserve(1)
    assert b.pages == a.pages and b.length == 5


# ---- the default model's KV memory ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def memory(default_model):
    # small pages so every sequence here crosses page boundaries
    return default_model.new_memory(256, n_seq=4, page_size=16)


@pytest.fixture(scope="module")
def reference(default_model, memory):
    """forward(A) then forward(B) in one sequence: B's logits and the final hashes."""
    st = memory.seq(memory.new_seq())
    default_model.forward(A, st)
    lb = default_model.forward(B, st, all_logits=True)
    h = st.hashes()
    st.release()
    return lb, h


def test_capture_restore_continue_is_exact(default_model, memory, reference):
    lb_ref, h_ref = reference
    st = memory.seq(memory.new_seq())
    default_model.forward(A, st)
    other = memory.seq(memory.new_seq())
    default_model.forward(C[:20], other)  # takes the next pages, so st's page table is no longer one run
    part = st.capture()
    h_a = st.hashes()
    default_model.forward(C, st)  # read on past the capture
    assert st.hashes() != h_a
    st.restore(part)
    assert st.pos == len(A) and st.kv.length == len(A)
    assert st.hashes() == h_a
    lb = default_model.forward(B, st, all_logits=True)
    np.testing.assert_array_equal(lb, lb_ref)
    assert st.hashes() == h_ref  # hashes do not depend on which pages hold the K/V
    assert not st.kv.contiguous
    part.release()
    other.release()
    st.release()


def test_truncate_then_continue_is_exact(default_model, memory, reference):
    lb_ref, h_ref = reference
    st = memory.seq(memory.new_seq())
    default_model.forward(A, st)
    default_model.forward(C[:7], st)
    st.truncate(len(A))
    assert st.pos == len(A)
    np.testing.assert_array_equal(default_model.forward(B, st, all_logits=True), lb_ref)
    assert st.hashes() == h_ref
    with pytest.raises(ValueError):
        st.truncate(st.pos + 1)
    st.release()


def test_captured_part_holds_its_pages_whatever_the_sequence_does(default_model, memory, reference):
    lb_ref, h_ref = reference
    free = memory.pool.n_free
    st = memory.seq(memory.new_seq())
    default_model.forward(A, st)
    h_a = st.hashes()
    part = st.capture()
    st.reset()
    default_model.forward(C[:40], st)                # overwrites the pages the part shares with it: they are copied
    st.restore(part)
    assert st.hashes() == h_a
    np.testing.assert_array_equal(default_model.forward(B, st, all_logits=True), lb_ref)
    assert st.hashes() == h_ref
    part.release()
    part.release()                                   # idempotent
    before = st.hashes(), st.pos
    with pytest.raises(PartMismatch, match="given back"):
        st.restore(part)
    assert (st.hashes(), st.pos) == before
    st.release()
    assert memory.pool.n_free == free


def test_materialized_part_restores_into_any_sequence(default_model, memory, reference):
    lb_ref, h_ref = reference
    st = memory.seq(memory.new_seq())
    default_model.forward(A, st)
    h_a = st.hashes()
    host = memory.materialize(st.capture())
    assert not host.is_held and host.nbytes() >= len(A) * default_model.config.n_layer * 2 * NKV
    st.release()
    fresh = memory.seq(memory.new_seq())
    default_model.forward(C[:30], fresh)
    fresh.restore(host)
    assert fresh.hashes() == h_a
    np.testing.assert_array_equal(default_model.forward(B, fresh, all_logits=True), lb_ref)
    fresh.release()


def test_nbytes_counts_kv_of_valid_positions(default_model, memory):
    c = default_model.config
    st = memory.seq(memory.new_seq())
    default_model.forward(A, st)
    assert st.nbytes() == len(A) * c.n_layer * 2 * c.n_head_kv * c.head_dim * 4
    part = st.capture()
    assert part.nbytes() == 0          # attention-only: a held part's pages are the pool's, not its own bytes
    part.release()
    st.release()


def test_forward_rejects_bad_tokens_and_changes_nothing(default_model, memory):
    st = memory.seq(memory.new_seq())
    default_model.forward(A[:5], st)
    h = st.hashes()
    with pytest.raises(ValueError, match="out of range"):
        default_model.forward(np.array([1, 49152]), st)
    with pytest.raises(ValueError, match="at least one token"):
        default_model.forward(np.array([], dtype=np.int32), st)
    with pytest.raises(ValueError, match="hidden states"):
        default_model.forward_carve(A[:2], st, 5, 30)
    assert st.hashes() == h and st.pos == 5
    st.release()


# ---- the running-state half, independent of any model ---------------------------------------------------

def _recurrent():
    init = {0: {"conv": np.zeros((3, 8), np.float32), "ssm": np.zeros((2, 4, 4), np.float32)},
            2: {"conv": np.zeros((3, 8), np.float32), "ssm": np.zeros((2, 4, 4), np.float32)}}
    return RecurrentMemory(Carve(0, 3), init)


def test_recurrent_memory_capture_restore_and_refusals():
    mem = _recurrent()
    st = mem.seq(mem.new_seq())
    st.running[0]["ssm"][...] = 1.5
    st.pos = 7
    part = st.capture()
    st.running[0]["ssm"][...] = 9.0
    st.pos = 9
    with pytest.raises(ValueError, match="cannot cut a recurrent running state back from 9 to 4"):
        st.truncate(4)
    st.restore(part)
    assert st.pos == 7 and float(st.running[0]["ssm"][0, 0, 0]) == 1.5
    bad = StatePart(carve=part.carve, geometry=part.geometry, pos=7,
                    running={0: part.running[0], 2: {"conv": part.running[2]["conv"],
                                                     "ssm": np.zeros((2, 4, 5), np.float32)}})
    with pytest.raises(PartMismatch, match=r"running state 2/ssm is \(2, 4, 5\)"):
        st.restore(bad)
    other = StatePart(carve=Carve(0, 4), geometry=part.geometry, pos=7, running=part.running)
    with pytest.raises(PartMismatch, match="layers 0..4, this stage runs 0..3"):
        st.restore(other)
    assert st.pos == 7
    st.truncate(0)
    assert st.pos == 0 and not st.running[0]["ssm"].any()


# ---- byte round trip over architectures, lengths and carves (hypothesis) ---------------------------------

@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Synthetic tiny models (llama; qwen35 with an MTP drafter; qwen3next MoE) on the CPU backend."""
    out = {}
    d = tmp_path_factory.mktemp("mem")
    for arch, kw in (("llama", {}), ("qwen35", {"n_mtp": 1}), ("qwen3next", {})):
        p = synth.write_synthetic(d / f"{arch}.gguf", synth.preset(arch, "tiny", seed=5, **kw))
        out[arch] = load_model(p)
    return out


def _split_points(n_blocks: int):
    return hs.lists(hs.integers(1, n_blocks - 1), max_size=2, unique=True).map(sorted)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hs.data())
def test_byte_round_trip_restores_equal_hashes(tiny_models, data):
    arch = data.draw(hs.sampled_from(sorted(tiny_models)), label="arch")
    m = tiny_models[arch]
    firsts = data.draw(_split_points(m.n_blocks), label="split")
    bounds = [0, *firsts, m.n_blocks]
    n = data.draw(hs.integers(1, 70), label="tokens")
    page = data.draw(hs.sampled_from([8, 16, 256]), label="page_size")
    toks = np.random.default_rng(n).integers(0, m.config.n_vocab, n).astype(np.int32)
    mems = [m.new_memory(128, Carve(a, b), n_seq=2, page_size=page) for a, b in zip(bounds, bounds[1:])]
    sts = [mm.seq(mm.new_seq()) for mm in mems]
    x = None
    for mm, st in zip(mems, sts):
        x = m.forward_carve(toks, st, mm.carve.lo, mm.carve.hi, x_in=x)
    for mm, st in zip(mems, sts):
        if st.draft is not None:             # the drafter's K/V travels with the last stage's part
            st.draft.reserve(min(3, n))
            st.draft.commit(min(3, n))
        h = st.hashes()
        buf = io.BytesIO()
        n_bytes = mm.write(st.capture(), buf)
        assert n_bytes == len(buf.getvalue())
        buf.seek(0)
        part = mm.read(buf)
        fresh = mm.seq(mm.new_seq())
        fresh.restore(part)
        assert fresh.hashes() == h and fresh.pos == n
        fresh.release()
        st.release()


def _written(mem, st) -> bytes:
    buf = io.BytesIO()
    mem.write(st.capture(), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def hybrid_stage(tiny_models):
    m = tiny_models["qwen35"]
    mem = m.new_memory(64, Carve(1, m.n_blocks), page_size=8)
    st = mem.seq(mem.new_seq())
    first = m.new_memory(64, Carve(0, 1), page_size=8)
    x = m.forward_carve(np.arange(1, 21, dtype=np.int32), first.seq(first.new_seq()), 0, 1)
    m.forward_carve(np.arange(1, 21, dtype=np.int32), st, 1, m.n_blocks, x_in=x)
    return m, mem, st, _written(mem, st)


def _refused(mem, data: bytes, exc, match: str):
    target = mem.seq(mem.new_seq())
    before = target.hashes(), target.pos
    with pytest.raises(exc, match=match) as e:
        target.restore(mem.read(io.BytesIO(data)))
    assert "\n" not in str(e.value)
    assert (target.hashes(), target.pos) == before
    target.release()


def test_part_from_another_carve_is_refused(tiny_models, hybrid_stage):
    m, mem, st, data = hybrid_stage
    other = m.new_memory(64, Carve(2, m.n_blocks), page_size=8)
    _refused(other, data, PartMismatch, "the part is of layers 1..4, this stage runs 2..4")


def test_part_with_another_geometry_is_refused(tiny_models, hybrid_stage):
    m, mem, st, data = hybrid_stage
    other = m.new_memory(64, Carve(1, m.n_blocks), page_size=16)
    _refused(other, data, PartMismatch, "geometry differs .*page_size: part 8, stage 16")
    ll = tiny_models["llama"]
    _refused(ll.new_memory(64, Carve(1, ll.n_blocks), page_size=8), data, PartMismatch,
             "identity.arch: part 'qwen35', stage 'llama'")


def test_corrupt_or_truncated_part_is_refused(hybrid_stage):
    m, mem, st, data = hybrid_stage
    flipped = bytearray(data)
    flipped[-40] ^= 0x10
    _refused(mem, bytes(flipped), FormatError, "payload checksum mismatch")
    head = bytearray(data)
    head[20] ^= 0x01
    _refused(mem, bytes(head), FormatError, "header checksum mismatch")
    _refused(mem, data[:-100], FormatError, "ends inside its")
    _refused(mem, b"GGUF" + data[4:], FormatError, "not a Strata state part")
    v2 = bytearray(data)
    v2[4] = 2
    _refused(mem, bytes(v2), FormatError, "format version 2 is not supported")


def test_part_with_another_dtype_is_refused(hybrid_stage):
    m, mem, st, data = hybrid_stage
    part = mem.read(io.BytesIO(data))
    part.running[1]["ssm"] = part.running[1]["ssm"].astype(np.float64)
    target = mem.seq(mem.new_seq())
    with pytest.raises(PartMismatch, match="running state 1/ssm is .* float64, expected .* float32"):
        target.restore(part)
    assert target.pos == 0
    target.release()


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=hs.lists(hs.tuples(hs.integers(0, 10 ** 6), hs.integers(0, 255)), min_size=1, max_size=4),
       trunc=hs.one_of(hs.none(), hs.integers(0, 10 ** 6)))
def test_reader_fuzz_mutated_parts(hybrid_stage, cuts, trunc):
    """Any byte changed or any cut: a one-line FormatError / PartMismatch, or (a change the checksums cannot see,
    e.g. none) the same part; never another exception."""
    m, mem, st, data = hybrid_stage
    try:
        part = mem.read(io.BytesIO(mutate(data, cuts, trunc)))
    except (FormatError, PartMismatch) as e:
        assert "\n" not in str(e)
        return
    assert part.pos == st.pos


@settings(max_examples=500, deadline=None)
@given(blob=hs.binary(max_size=300))
def test_reader_fuzz_random_bytes(blob):
    mem = _recurrent()
    try:
        mem.read(io.BytesIO(blob))
    except (FormatError, PartMismatch) as e:
        assert "\n" not in str(e)
