"""The nemotron_h hybrid (Mamba2 + attention + squared-ReLU MLP blocks) on the CPU backend: against llama.cpp's logits
and greedy tokens stored in tests/data/hybrid_nemotron_h_llamacpp.json by tools/hybrid_llamacpp_reference.py; a
prefill equals its decode steps (logits and running state); the chunked scan equals the step-by-step one; a
checkpoint restored at a cut point (captured between reads, and kept inside one read by Memory.mark) answers as a
cold read; two stages equal one; the refusals name what they refuse.

Tolerances (F32 weights, logits of magnitude ~25-45): llama.cpp, sampled logits at 5 prompt positions and after 15
decode steps < 2e-2 (the qwen hybrids' bound; measured < 3.6e-3), same argmax, the same 16 greedy tokens; chunked vs
step scan and prefill vs decode steps: logits < 3e-3 (measured < 7e-5), running state < 1e-4 (measured < 2e-6).
"""
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata.gguf import synth
from strata.gguf.file import ModelLoadError
from strata.memory import Carve
from strata.models.registry import load_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import hybrid_llamacpp_reference as ref_tool  # noqa: E402

DATA = ROOT / "tests" / "data"
LLAMACPP_TOL = 2e-2


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The synthetic model llama.cpp read (F32), loaded once, and its stored record."""
    path = synth.write_synthetic(tmp_path_factory.mktemp("nemotron_h") / "nh.gguf", ref_tool.spec_for("nemotron_h"))
    m = load_model(path)
    rec = json.loads((DATA / "hybrid_nemotron_h_llamacpp.json").read_text())
    return SimpleNamespace(path=path, model=m, pool=m.new_page_pool(1024, n_seq=4), rec=rec)


def _prompt(n, n_vocab, seed=0):
    return np.random.default_rng(seed + n).integers(0, n_vocab, n).astype(np.int32)


def test_blocks_follow_the_per_layer_metadata(ref):
    m = ref.model
    assert m.kinds == list("M-M*M-") and m.attn_layers == [3]
    assert sorted(m.new_running_state()) == [0, 2, 4]
    # conv (d_conv - 1, d_inner + 2 n_group d_state) + ssm (n_head, head_dim, d_state), float32, per Mamba2 layer
    per = 4 * (3 * (128 + 2 * 2 * 16) + 8 * 16 * 16)
    assert m.running_state_nbytes() == 3 * per
    st = m.new_state(ref.pool)
    assert {k: v.shape for k, v in st.running[0].items()} == {"conv": (3, 192), "ssm": (8, 16, 16)}
    st.release()


def test_matches_llamacpp_reference(ref):
    m, rec = ref.model, ref.rec
    assert hashlib.sha256(Path(ref.path).read_bytes()).hexdigest() == rec["gguf_sha256"], \
        "synthetic GGUF differs from the one llama.cpp read: rerun the tool"
    st = m.new_state(ref.pool)
    lg = m.forward(np.array(rec["prompt"], np.int32), st, all_logits=True)
    for i, p in enumerate(rec["positions"]):
        diff = float(np.abs(lg[p, rec["sample_ids"]] - np.array(rec["logits"][i])).max())
        assert diff < LLAMACPP_TOL, f"position {p}: max abs diff {diff} vs llama.cpp"
        assert int(lg[p].argmax()) == rec["argmax"][i]
    out, logits = [], lg[-1]
    while True:                                  # greedy decode, one token per step, as llama.cpp was run
        out.append(int(logits.argmax()))
        if len(out) == len(rec["greedy"]):
            break
        logits = m.forward(np.array(out[-1:], np.int32), st)
    assert out == rec["greedy"]
    assert float(np.abs(logits[rec["sample_ids"]] - np.array(rec["greedy_logits"])).max()) < LLAMACPP_TOL
    st.release()


def test_chunked_scan_equals_recurrence(ref):
    m = ref.model
    toks = _prompt(130, m.config.n_vocab, seed=4)
    try:
        m.scan_mode = "chunked"
        a = m.new_state(ref.pool)
        la = m.forward(toks, a, all_logits=True)
        m.scan_mode = "recurrent"
        b = m.new_state(ref.pool)
        lb = m.forward(toks, b, all_logits=True)
    finally:
        m.scan_mode = "auto"
    assert np.abs(la - lb).max() < 3e-3
    for layer in (0, 2, 4):
        for k in ("conv", "ssm"):
            assert np.abs(a.running[layer][k] - b.running[layer][k]).max() < 1e-4
    a.release()
    b.release()


@pytest.mark.parametrize("n", [12, 70])
def test_prefill_equals_decode_steps(ref, n):
    """n tokens in one read vs n one-token reads: a short read (<= 16 tokens, the step scan) gives the same bits,
    a longer one (the chunked scan) the same within rounding."""
    m = ref.model
    toks = _prompt(n, m.config.n_vocab, seed=2)
    a = m.new_state(ref.pool)
    la = m.forward(toks, a, all_logits=True)
    b = m.new_state(ref.pool)
    lb = np.stack([m.forward(toks[i:i + 1], b) for i in range(n)])
    if n <= 16:
        assert np.array_equal(la, lb) and a.hashes() == b.hashes()
    else:
        assert np.abs(la - lb).max() < 3e-3
        for layer in a.running:
            for k in ("conv", "ssm"):
                assert np.abs(a.running[layer][k] - b.running[layer][k]).max() < 1e-4
    a.release()
    b.release()


def test_checkpoint_restore_equals_cold_read(ref):
    m = ref.model
    toks = _prompt(150, m.config.n_vocab, seed=5)
    cold = m.new_state(ref.pool)
    want = m.forward(toks, cold)
    s = m.new_state(ref.pool)
    m.forward(toks[:70], s)
    snap = s.capture()
    assert snap.nbytes() >= m.running_state_nbytes() > 0
    h = s.hashes()
    m.forward(_prompt(20, m.config.n_vocab, seed=6), s)        # diverge, then come back
    assert s.hashes()["running"] != h["running"]
    s.restore(snap)
    assert s.hashes() == h
    got = m.forward(toks[70:], s)
    assert np.abs(got - want).max() < 1e-3
    for layer in cold.running:
        assert np.abs(cold.running[layer]["ssm"] - s.running[layer]["ssm"]).max() < 1e-4
    # a cut kept inside one read (Memory.mark) holds the state a read split there leaves
    t = m.new_state(ref.pool)
    t.memory.mark(t.sid, [40])
    m.forward(toks[:100], t)
    part = t.memory.capture_at(t.sid, 40)
    split = m.new_state(ref.pool)
    m.forward(toks[:40], split)
    for layer in split.running:          # equal up to rounding: the layers' products ran over 100 rows, not 40
        for k in ("conv", "ssm"):
            assert np.abs(part.running[layer][k] - split.running[layer][k]).max() < 1e-4
    snap.release()
    part.release()
    for st in (cold, s, t, split):
        st.release()


def test_two_stages_equal_one(ref):
    m = ref.model
    toks = _prompt(90, m.config.n_vocab, seed=8)
    one = m.new_state(ref.pool)
    want = m.forward(toks, one, all_logits=True)
    mems = [m.new_memory(256, Carve(0, 3)), m.new_memory(256, Carve(3, 6))]
    seqs = [mem.seq(mem.new_seq()) for mem in mems]
    x = m.forward_carve(toks[:50], seqs[0], 0, 3)
    la = m.forward_carve(toks[:50], seqs[1], 3, 6, x_in=x, all_logits=True)
    x = m.forward_carve(toks[50:], seqs[0], 0, 3)
    lb = m.forward_carve(toks[50:], seqs[1], 3, 6, x_in=x, all_logits=True)
    got = np.concatenate([la, lb])
    assert np.abs(got - want).max() < 3e-3
    assert sorted(seqs[0].running) == [0, 2] and sorted(seqs[1].running) == [4] and seqs[0].kv is None
    one.release()


def test_refusals_name_the_field(tmp_path):
    spec = synth.preset("nemotron_h", "tiny", seed=3)
    bad = synth.write_synthetic(tmp_path / "bad.gguf", spec, overrides={"nemotron_h.ssm.state_size": 8})
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.ssm_in\.weight .*expects \(296, 64\)"):
        load_model(bad)
    moe = synth.write_synthetic(tmp_path / "moe.gguf", spec)
    from strata.gguf.file import open_gguf
    f = open_gguf(moe)
    f.config.extra["expert_count"] = 4
    with pytest.raises(ModelLoadError, match="with experts .* not supported"):
        load_model(f)
    gpu = SimpleNamespace(xp=object(), name="cuda")
    with pytest.raises(ModelLoadError, match="runs on the CPU backend only"):
        load_model(moe, backend=gpu)
