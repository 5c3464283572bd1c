"""Models whose matrices are IQ types, on the CPU backend: a synthetic llama whose matrices hold all nine (blocks
written by strata.gguf.iq_quant) generates the same greedy tokens as a float64 numpy forward on gguf-py's
dequantization of the same file's tensors, with close logits; the CUDA upload's host conversion of IQ weights to
F16 equals gguf-py's dequantization rounded to f16, and on a GPU the same file's greedy answer (prefill GEMMs and the
decode plan on those F16 copies) matches the CPU's up to a near tie."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from strata.backend import quant
from strata.gguf import synth
from strata.gguf.file import open_gguf
from strata.models.registry import load_model
from tests.helpers import IQ_TYPES, random_blocks

pytestmark = pytest.mark.skipif(not quant.native_available(), reason="strata._native is not built")

# two layers, every matrix row 256 values (whole blocks of every IQ type); F16 embeddings and head (untied)
SPEC = dict(n_embd=256, n_ff=256, n_head=4, n_head_kv=2, head_dim=64, n_layer=2, embd_qtype="F16",
            tie_embeddings=False, seed=3)
N_NEW = 8


def _ref_weights(f) -> dict[str, np.ndarray]:
    """Every tensor of the file as float64, dequantized by gguf-py (the reference), in numpy order."""
    out = {}
    for name, w in f.tensors.items():
        if w.ggml_type in (T.F32, T.F16):
            out[name] = np.asarray(w.data, dtype=np.float64).reshape(w.shape)
        else:
            out[name] = np.asarray(gq.dequantize(np.asarray(w.data), w.ggml_type), dtype=np.float64).reshape(w.shape)
    return out


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope(x, theta):
    """llama.cpp's normal RoPE on (n, heads, hd): pairs (2i, 2i + 1) (the GGUF's Q/K rows are permuted for it)."""
    n, _, hd = x.shape
    ang = np.arange(n)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def _forward64(W, toks, spec, last: int) -> np.ndarray:
    """float64 llama forward of the whole sequence; the logits of its last `last` positions."""
    H, KV, hd, eps = spec.n_head, spec.n_head_kv, spec.head_dim, spec.rms_eps
    h = W["token_embd.weight"][toks]
    n = len(toks)
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        x = _rms(h, W[p + "attn_norm.weight"], eps)
        q = _rope((x @ W[p + "attn_q.weight"].T).reshape(n, H, hd), spec.rope_theta)
        k = _rope((x @ W[p + "attn_k.weight"].T).reshape(n, KV, hd), spec.rope_theta)
        v = (x @ W[p + "attn_v.weight"].T).reshape(n, KV, hd)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        a = np.exp(s - s.max(axis=-1, keepdims=True))
        a /= a.sum(axis=-1, keepdims=True)
        h = h + np.einsum("hqk,khd->qhd", a, v).reshape(n, H * hd) @ W[p + "attn_output.weight"].T
        x = _rms(h, W[p + "ffn_norm.weight"], eps)
        g = x @ W[p + "ffn_gate.weight"].T
        h = h + (g / (1 + np.exp(-g)) * (x @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    return _rms(h[-last:], W["output_norm.weight"], eps) @ W["output.weight"].T


def _write_mixed(path, monkeypatch, **over):
    """A synthetic llama whose 14 matrices take the nine IQ types in turn (as real IQ files mix types): (spec, file)."""
    plain = synth._qtype_for
    names = []

    def mixed(s, t):
        if t.kind != "mat":
            return plain(s, t)
        names.append(t.name)
        return IQ_TYPES[(len(names) - 1) % len(IQ_TYPES)]

    monkeypatch.setattr(synth, "_qtype_for", mixed)
    spec = synth.preset("llama", qtype="F16", **{**SPEC, **over})
    f = open_gguf(synth.write_synthetic(path, spec))
    assert {f.tensors[n].ggml_type for n in names} == set(IQ_TYPES)
    return spec, f


def test_iq_model_greedy_tokens_match_float64_reference(tmp_path, monkeypatch):
    """One file holds every IQ type."""
    spec, f = _write_mixed(tmp_path / "iq.gguf", monkeypatch)
    m = load_model(f)
    W = _ref_weights(f)
    toks = np.random.default_rng(1).integers(0, m.config.n_vocab, 24).astype(np.int32)
    st = m.new_state(m.new_page_pool(64))
    got, lgs, lg = [], [], m.forward(toks, st)
    for _ in range(N_NEW):
        lgs.append(lg)
        got.append(int(lg.argmax()))
        lg = m.forward(np.array([got[-1]], np.int32), st)
    st.release()
    # a causal model: the reference's logits at the positions of Strata's greedy tokens, in one forward; where every
    # argmax agrees, the reference's own greedy run gives the same tokens
    ref = _forward64(W, np.concatenate([toks, got[:-1]]), spec, N_NEW)
    for i in range(N_NEW):
        # the products' error is the Q8_K / Q8_0 rounding of the activations (tests/test_quant.py bounds it)
        err = float(np.abs(lgs[i] - ref[i]).max())
        assert err < 0.05 * np.abs(ref[i]).max(), f"step {i}: max abs logit diff {err}"
    assert got == [int(r.argmax()) for r in ref]


@pytest.mark.parametrize("t", IQ_TYPES, ids=lambda t: t.name)
def test_cuda_upload_converts_iq_to_f16_on_the_host(t):
    from strata.backend.cuda.weights import host_storage
    rng = np.random.default_rng(int(t))
    n_in = 512
    raw = random_blocks(t, 9, n_in, rng)
    gt, data = host_storage("blk.0.ffn_up.weight", int(t), (9, n_in), raw)
    assert gt == int(T.F16) and data.dtype == np.float16 and data.shape == (9, n_in)
    want = np.asarray(gq.dequantize(raw, t), dtype=np.float32).reshape(9, n_in).astype(np.float16)
    np.testing.assert_array_equal(data.view(np.uint16), want.view(np.uint16))
    # the other types pass through as stored
    q = random_blocks(T.Q4_K, 2, 256, rng)
    assert host_storage("w", int(T.Q4_K), (2, 256), q)[1] is q


# worst relative RMS error of the blocks iq_quant writes for N(0, 1) rows (measured 0.09 IQ4 .. 0.61 IQ1_S, bound
# with room): the quantizer follows the values, it is no llama.cpp
_RT_ERR = {T.IQ4_XS: 0.15, T.IQ4_NL: 0.15, T.IQ3_S: 0.25, T.IQ3_XXS: 0.3, T.IQ2_S: 0.4, T.IQ2_XS: 0.45,
           T.IQ2_XXS: 0.5, T.IQ1_M: 0.7, T.IQ1_S: 0.75}


@pytest.mark.parametrize("t", IQ_TYPES, ids=lambda t: t.name)
def test_iq_quantizer_writes_blocks_that_follow_the_values(t):
    from strata.gguf.iq_quant import quantize
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 512)).astype(np.float32) * 0.03
    x[5] = 0.0
    q = quantize(x, t)
    y = np.asarray(gq.dequantize(q, t), dtype=np.float32).reshape(x.shape)
    assert np.isfinite(y).all() and not np.any(y[5])
    live = np.delete(np.arange(16), 5)
    assert np.linalg.norm(y[live] - x[live]) / np.linalg.norm(x[live]) < _RT_ERR[t]
    with pytest.raises(ValueError, match=f"not a multiple of the {t.name} block size"):
        quantize(x[:, :48], t)
    with pytest.raises(ValueError, match="only the IQ types, not Q4_K"):
        quantize(x, T.Q4_K)


def test_cuda_iq_model_answers_as_the_cpu(tmp_path, monkeypatch):
    """The mixed IQ file on a GPU (weights converted to F16 at upload) gives the CPU engine's greedy answer, or parts
    from it only at a near tie of the CPU's logits."""
    from tests.cuda_marks import CUDA_WHY, NEAR_TIE_LOGIT, assert_parts_at_near_tie
    if CUDA_WHY is not None:
        pytest.skip(f"CUDA backend unavailable: {CUDA_WHY}")
    from strata.engine.engine import Engine
    from tests.helpers import ask
    _, f = _write_mixed(tmp_path / "iq.gguf", monkeypatch, n_layer=4, seed=5)
    path = str(tmp_path / "iq.gguf")
    prompt = [{"role": "user", "content": "Tell me about rivers and the sea in three sentences."}]
    got, _ = ask(Engine(path, n_ctx=256, device="cuda"), prompt, n=24)
    cpu = Engine(path, n_ctx=256, device="cpu")
    ref, _ = ask(cpu, prompt, n=24)
    assert len(got) == len(ref) > 0

    def cpu_logits_after(prefix):
        m = load_model(open_gguf(path))
        st = m.new_state(m.new_page_pool(256))
        ids = np.asarray(list(cpu.render_chat(prompt).tokens) + list(prefix), np.int32)
        lg = m.forward(ids, st)
        st.release()
        return np.asarray(lg)

    assert_parts_at_near_tie(got, ref, cpu_logits_after, NEAR_TIE_LOGIT)
