"""Hybrid models (qwen3next, qwen35, qwen35moe) on the CPU backend against independent references.

References: Hugging Face transformers (Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM; torch CPU
float32, eager attention) loaded with the same weights through ``strata.gguf.synth.export_hf`` (the gguf library's
reader + the inverse of llama.cpp's converter transforms), and llama.cpp logits stored in
tests/data/hybrid_<arch>_llamacpp.json by tools/hybrid_llamacpp_reference.py.

Tolerances (F32 weights; logits have magnitude ~20-40):
  * transformers, last-position logits: max abs diff < 5e-3 (measured ~1e-4), same argmax;
  * llama.cpp, sampled logits at 5 positions: max abs diff < 2e-2 (measured < 3e-3), same argmax;
  * chunked prefill vs step-by-step recurrence, all positions: logits < 3e-3 (measured < 8e-4), running state
    < 1e-4 (measured < 6e-6);
  * MTP drafter vs the same head built from transformers modules: < 5e-3.
"""
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from strata.gguf import synth  # noqa: E402
from strata.gguf.file import ModelLoadError, open_gguf  # noqa: E402
from strata.models.registry import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import hybrid_llamacpp_reference as ref_tool  # noqa: E402

ARCHS = ("qwen3next", "qwen35", "qwen35moe")
HF_TOL = 5e-3
LLAMACPP_TOL = 2e-2
DATA = ROOT / "tests" / "data"


class Loaded:
    def __init__(self, arch, tmp):
        self.arch = arch
        self.path = synth.write_synthetic(tmp / f"{arch}.gguf", ref_tool.spec_for(arch))
        self.file = open_gguf(self.path)
        self.model = load_model(self.file)
        self.pool = self.model.new_page_pool(1024, n_seq=3)
        self.hf, self.mtp_sd = synth.hf_model(self.file.reader)
        self.n_vocab = self.model.config.n_vocab

    def hf_logits(self, toks):
        with torch.no_grad():
            return self.hf(torch.from_numpy(np.asarray(toks, np.int64)[None])).logits[0].numpy()


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request, tmp_path_factory):
    return Loaded(request.param, tmp_path_factory.mktemp(request.param))


def _prompt(n, n_vocab, seed=0):
    return np.random.default_rng(seed + n).integers(0, n_vocab, n).astype(np.int32)


def test_last_logits_match_transformers(loaded):
    m = loaded.model
    for n in (1, 63, 64, 65, 300):
        toks = _prompt(n, loaded.n_vocab)
        st = m.new_state(loaded.pool)
        got = m.forward(toks, st)
        want = loaded.hf_logits(toks)[-1]
        diff = float(np.abs(got - want).max())
        assert diff < HF_TOL, f"{loaded.arch} n={n}: max abs logit diff {diff}"
        assert int(got.argmax()) == int(want.argmax())
        st.release()


def test_greedy_continuation_matches_transformers(loaded):
    m = loaded.model
    toks = _prompt(65, loaded.n_vocab, seed=9)
    st = m.new_state(loaded.pool)
    out, logits = [], m.forward(toks, st)
    for _ in range(8):
        t = int(logits.argmax())
        out.append(t)
        logits = m.forward(np.array([t], np.int32), st)
    with torch.no_grad():
        gen = loaded.hf.generate(torch.from_numpy(toks[None].astype(np.int64)), max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)
    assert out == gen[0, len(toks):].tolist()
    st.release()


def test_matches_llamacpp_reference(loaded):
    rec = json.loads((DATA / f"hybrid_{loaded.arch}_llamacpp.json").read_text())
    sha = hashlib.sha256(Path(loaded.path).read_bytes()).hexdigest()
    assert sha == rec["gguf_sha256"], "synthetic GGUF differs from the one llama.cpp read: rerun the tool"
    st = loaded.model.new_state(loaded.pool)
    lg = loaded.model.forward(np.array(rec["prompt"], np.int32), st, all_logits=True)
    for i, p in enumerate(rec["positions"]):
        diff = float(np.abs(lg[p, rec["sample_ids"]] - np.array(rec["logits"][i])).max())
        assert diff < LLAMACPP_TOL, f"{loaded.arch} position {p}: max abs diff {diff} vs llama.cpp"
        assert int(lg[p].argmax()) == rec["argmax"][i]
    st.release()


def test_chunked_prefill_equals_recurrence(loaded):
    m = loaded.model
    toks = _prompt(130, loaded.n_vocab, seed=4)
    try:
        m.gdn_mode = "chunked"
        a = m.new_state(loaded.pool)
        la = m.forward(toks, a, all_logits=True)
        m.gdn_mode = "recurrent"
        b = m.new_state(loaded.pool)
        lb = m.forward(toks, b, all_logits=True)
    finally:
        m.gdn_mode = "auto"
    assert np.abs(la - lb).max() < 3e-3
    assert a.running.keys() == b.running.keys() and a.running
    for layer in a.running:
        for k in ("conv", "ssm"):
            assert a.running[layer][k].dtype == np.float32
            assert np.abs(a.running[layer][k] - b.running[layer][k]).max() < 1e-4
    a.release()
    b.release()


def test_prefill_split_by_checkpoint_restore(loaded):
    m = loaded.model
    toks = _prompt(150, loaded.n_vocab, seed=5)
    a, b = toks[:70], toks[70:]
    full = m.new_state(loaded.pool)
    want = m.forward(toks, full)
    s = m.new_state(loaded.pool)
    m.forward(a, s)
    snap = s.capture()
    assert snap.nbytes() >= m.running_state_nbytes() > 0
    h_snap = s.hashes()["running"]
    m.forward(_prompt(20, loaded.n_vocab, seed=6), s)       # diverge, then come back
    assert s.hashes()["running"] != h_snap
    s.restore(snap)
    assert s.hashes()["running"] == h_snap
    got = m.forward(b, s)
    assert np.abs(got - want).max() < 1e-3
    for layer in full.running:
        assert np.abs(full.running[layer]["ssm"] - s.running[layer]["ssm"]).max() < 1e-4
    full.release()
    s.release()


def test_mtp_drafter_matches_transformers_modules(loaded):
    """The MTP head (vLLM Qwen3NextMultiTokenPredictor / llama.cpp graph_mtp wiring) rebuilt from transformers'
    own decoder-layer and RMSNorm modules with the exported mtp.* weights."""
    import copy
    hf, m = loaded.hf, loaded.model
    mod = sys.modules[type(hf).__module__]
    prefix = {"Qwen3NextForCausalLM": "Qwen3Next", "Qwen3_5ForCausalLM": "Qwen3_5",
              "Qwen3_5MoeForCausalLM": "Qwen3_5Moe"}[type(hf).__name__]
    cfg = copy.deepcopy(hf.config)
    n_layer = cfg.num_hidden_layers
    cfg.layer_types = list(cfg.layer_types) + ["full_attention"]
    cfg.num_hidden_layers = n_layer + 1
    layer = getattr(mod, f"{prefix}DecoderLayer")(cfg, n_layer).float().eval()
    Norm = getattr(mod, f"{prefix}RMSNorm")
    enorm, hnorm, fnorm = (Norm(cfg.hidden_size, eps=cfg.rms_norm_eps) for _ in range(3))
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    sd = loaded.mtp_sd
    with torch.no_grad():
        layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in sd.items() if k.startswith("mtp.layers.0.")})
        enorm.weight.copy_(sd["mtp.pre_fc_norm_embedding.weight"])
        hnorm.weight.copy_(sd["mtp.pre_fc_norm_hidden.weight"])
        fnorm.weight.copy_(sd["mtp.norm.weight"])
        fc.weight.copy_(sd["mtp.fc.weight"])
    toks = _prompt(40, loaded.n_vocab, seed=8)
    nxt = np.append(toks[1:], np.int32(7))                  # token p+1 for each position p
    with torch.no_grad():
        ids = torch.from_numpy(toks[None].astype(np.int64))
        h = hf.model(ids).last_hidden_state                  # final-normed hidden states
        e = hf.model.embed_tokens(torch.from_numpy(nxt[None].astype(np.int64)))
        x = fc(torch.cat([enorm(e), hnorm(h)], dim=-1))
        pos = torch.arange(len(toks))[None]
        pe = hf.model.rotary_emb(x, pos)
        mask = torch.full((len(toks), len(toks)), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=pe, attention_mask=mask, position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
        want = hf.lm_head(fnorm(x))[0].numpy()
    st = m.new_state(loaded.pool)
    hid = m.forward_hidden(toks, st)
    kv = m.new_mtp_kv(256)
    got = np.concatenate([m.mtp_logits(hid[:25], nxt[:25], kv), m.mtp_logits(hid[25:], nxt[25:], kv)])
    diff = float(np.abs(got - want).max())
    assert diff < HF_TOL, f"{loaded.arch}: MTP max abs logit diff {diff}"
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # a drafter's catch-up: the positions before the last fed as K/V alone (mtp_kv), then the last row's logits
    kv2 = m.new_mtp_kv(256)
    m.mtp_kv(hid[:17], nxt[:17], kv2)
    m.mtp_kv(hid[17:39], nxt[17:39], kv2)
    last = m.mtp_logits(hid[39:], nxt[39:], kv2)[0]
    assert float(np.abs(last - want[39]).max()) < HF_TOL and last.argmax() == want[39].argmax()
    kv3 = m.new_mtp_kv(256)                              # mtp_hidden over the same batches: the same K/V bits
    for a, b in ((0, 17), (17, 39), (39, 40)):
        m.mtp_hidden(hid[a:b], nxt[a:b], kv3)
    slot = kv.pool.slot(m.n_layer)
    for a, b in zip(kv3.read(slot), kv2.read(slot)):
        assert a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
    st.release()


def test_shape_disagreeing_with_metadata_names_tensor(tmp_path):
    # ssm.state_size says 8 but every GDN tensor was written for d_k = 16
    spec = synth.preset("qwen35", "tiny", seed=3)
    path = synth.write_synthetic(tmp_path / "bad.gguf", spec, overrides={"qwen35.ssm.state_size": 8})
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_qkv\.weight .*expects \(96, 64\)"):
        load_model(path)


def test_quantized_tiny_file_runs():
    """A tiny file (< 5 MB, F16 matrices, Q4_0 embeddings) loads and tracks transformers within 0.5 (Q8
    activation rounding of the quantized output head); same argmax."""
    import tempfile
    with tempfile.TemporaryDirectory() as td:
        path = synth.write_synthetic(Path(td) / "t.gguf", synth.preset("qwen3next", "tiny", seed=11))
        assert path.stat().st_size < 5 * 1024 * 1024
        f = open_gguf(path)
        m = load_model(f)
        hf, _ = synth.hf_model(f.reader)
        toks = _prompt(33, m.config.n_vocab)
        got = m.forward(toks, m.new_state(m.new_page_pool(64)))
        with torch.no_grad():
            want = hf(torch.from_numpy(toks[None].astype(np.int64))).logits[0, -1].numpy()
        assert np.abs(got - want).max() < 0.5
        assert int(got.argmax()) == int(want.argmax())
