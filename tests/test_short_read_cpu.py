"""The short read's exactness contract on the CPU backend: a forward of n <= 16 new tokens gives row i bit-identical
to decoding token i alone after rows 0..i-1 (logits, every layer's K/V, the GDN running state).

The C core's kernels (strata_matmul: integer dots for the quantized types, float32 dots for F32 / F16 / BF16) reduce
each token of a tile as they reduce one, at any token count; the hybrid's GDN layers take the recurrent step token by
token up to quant.ROWWISE_MAX_TOKENS. Checked here for the WeightTensor product of every supported type, for the
default model (SmolLM2, llama) and a synthetic qwen35 hybrid (chains n = 2..16 from depth 0 and from a prompt),
and that 17 tokens still take the batched paths (the chunked delta rule)."""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from strata.backend import quant
from strata.gguf import synth
from strata.backend.quant import SUPPORTED_TYPES, WeightTensor
from tests.helpers import IQ_TYPES, put_iq_scales

# f16 scale fields inside one block, per quantized type (ggml-common.h)
SCALE_OFFS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
              T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def _weight(t, n_out, n_in, rng) -> WeightTensor:
    """A random tensor of type t: every quant bit pattern with finite f16 scales; normal floats for F32 / F16 /
    BF16."""
    shape = (n_out, n_in)
    if t in (T.F32, T.F16, T.BF16):
        f = rng.standard_normal(shape).astype(np.float32)
        data = f if t == T.F32 else f.astype(np.float16) if t == T.F16 else (f.view(np.uint32) >> 16).astype(np.uint16)
        return WeightTensor("w", t, shape, data)
    blck, size = GGML_QUANT_SIZES[t]
    nb = n_in // blck
    raw = rng.integers(0, 256, (n_out, nb, size), dtype=np.uint8)
    if t in IQ_TYPES:
        put_iq_scales(raw, t, rng.uniform(1e-3, 1e-2, (n_out, nb)) * rng.choice([-1, 1], (n_out, nb)))
    for off in SCALE_OFFS.get(t, []):
        d = (rng.uniform(1e-3, 1e-2, (n_out, nb)) * rng.choice([-1, 1], (n_out, nb))).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(n_out, nb, 2)
    return WeightTensor("w", t, shape, raw.reshape(n_out, nb * size))


PATHS = ["portable"]
if quant.native_available():
    PATHS += ["avx2"] if quant._lib.strata_cpu_has_avx2() else []
    PATHS += ["avxvnni"] if quant._lib.strata_cpu_has_avxvnni() else []
    PATHS += ["avx512"] if quant._lib.strata_cpu_has_avx512() else []


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", sorted(SUPPORTED_TYPES, key=int), ids=lambda t: t.name)
def test_matmul_rows_bit_identical_to_one_token(t, path):
    """On every kernel set the CPU has, every row of an n-token product equals the product of that row alone, bit
    for bit: n = 2..17 (the contract's 2..16 and the first past it), odd and even counts around the column kernels'
    tiles of 16 tokens, up to 65; 97 weight rows (an odd tail row)."""
    rng = np.random.default_rng(int(t))
    n_in = 512
    w = _weight(t, 97, n_in, rng)
    quant.set_cpu_path(path)
    try:
        for n in [*range(2, quant.ROWWISE_MAX_TOKENS + 2), 31, 32, 33, 48, 64, 65]:
            x = rng.standard_normal((n, n_in)).astype(np.float32)
            y = w.matmul(x)
            assert y.shape == (n, 97) and np.isfinite(y).all()
            for i in range(n):
                np.testing.assert_array_equal(y[i], w.matmul(np.ascontiguousarray(x[i:i + 1]))[0],
                                              err_msg=f"{t.name} {path} n={n} row {i}")
    finally:
        quant.set_cpu_path("auto")


def _prompt(n, n_vocab, seed):
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def _same_state(a, b, running: bool) -> None:
    assert a.pos == b.pos and a.kv.length == b.kv.length == a.pos
    pool = a.kv.pool
    for slot in range(len(pool.k)):
        ka, va = pool.read(slot, a.kv.pages, a.pos)
        kb, vb = pool.read(slot, b.kv.pages, b.pos)
        np.testing.assert_array_equal(ka, kb, err_msg=f"K slot {slot}")
        np.testing.assert_array_equal(va, vb, err_msg=f"V slot {slot}")
    if running:
        for layer in a.running:
            for name in ("conv", "ssm"):
                np.testing.assert_array_equal(a.running[layer][name], b.running[layer][name],
                                              err_msg=f"running state {layer}/{name}")


def _chain(m, pool, depth: int, ns, seed: int, running: bool) -> None:
    """Two sequences with the same prompt; for each n of ns, n tokens as one forward (all_logits) on the first and
    as n one-token forwards on the second: rows and states bit-identical."""
    V = m.config.n_vocab
    a, b = m.new_state(pool), m.new_state(pool)
    try:
        if depth:
            prompt = _prompt(depth, V, seed)
            m.forward(prompt, a)
            m.forward(prompt, b)
        for k, n in enumerate(ns):
            toks = _prompt(n, V, seed + 1 + k)
            got = m.forward(toks, a, all_logits=True)
            want = np.stack([m.forward(toks[i:i + 1], b) for i in range(n)])
            assert got.shape == (n, V) and np.isfinite(got).all()
            for i in range(n):
                np.testing.assert_array_equal(got[i], want[i], err_msg=f"depth {a.pos - n}, n {n}, row {i}")
            _same_state(a, b, running)
    finally:
        a.release()
        b.release()


NS = tuple(range(2, 17))


@pytest.mark.parametrize("depth", [0, 37])
def test_default_model_short_reads_bit_identical(default_model, depth):
    """SmolLM2 on the CPU backend: chains n = 2..16 (136 tokens from depth 0, past a 128-position page boundary from
    37)."""
    pool = default_model.new_page_pool(256, n_seq=2)
    _chain(default_model, pool, depth, NS, seed=depth + 1, running=False)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from strata.gguf.default_model import DefaultModelMissing
    from strata.models.registry import load_model
    spec = synth.preset("qwen35", "tiny", n_embd=128, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                        head_k_dim=64, head_v_dim=64, n_k_heads=2, n_v_heads=4, n_mtp=0, qtype="Q8_0",
                        embd_qtype="Q8_0", seed=11)
    try:
        path = synth.write_synthetic(tmp_path_factory.mktemp("q35") / "q35.gguf", spec)
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    return load_model(path)


@pytest.mark.parametrize("depth", [0, 29])
def test_hybrid_short_reads_bit_identical(hybrid, depth):
    """A synthetic qwen35 (6 GDN + 2 attention layers): logits, K/V and every GDN layer's conv window and ssm
    state."""
    pool = hybrid.new_page_pool(256, n_seq=2)
    _chain(hybrid, pool, depth, NS, seed=depth + 3, running=True)


def test_hybrid_longer_reads_keep_the_chunked_rule(hybrid, monkeypatch):
    """From ROWWISE_MAX_TOKENS + 1 tokens the CPU's GDN layers take the chunked delta rule (the prefill's), up to it
    the recurrent step."""
    from strata.backend import gdn
    calls = []
    real = gdn.delta_rule_chunked
    monkeypatch.setattr(gdn, "delta_rule_chunked", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    pool = hybrid.new_page_pool(64, n_seq=1)
    st = hybrid.new_state(pool)
    hybrid.forward(_prompt(quant.ROWWISE_MAX_TOKENS, hybrid.config.n_vocab, 1), st)
    assert calls == []
    hybrid.forward(_prompt(quant.ROWWISE_MAX_TOKENS + 1, hybrid.config.n_vocab, 2), st)
    assert calls and set(calls) == {quant.ROWWISE_MAX_TOKENS + 1}
    st.release()


@pytest.mark.skipif(not (quant.native_available() and quant._lib.strata_cpu_has_avx512()),
                    reason="CPU without AVX-512")
def test_default_model_same_bits_on_every_wide_kernel_set(default_model):
    """The avx512 kernel set (column kernels for products of 2+ tokens, 512-bit attention products) gives the
    avxvnni set's bits for a prompt, a 40-token short read (every row's logits) and a decode step."""
    V = default_model.config.n_vocab
    prompt, toks = _prompt(300, V, 5), _prompt(40, V, 6)
    got = {}
    for path in ("avxvnni", "avx512"):
        quant.set_cpu_path(path)
        pool = default_model.new_page_pool(512, n_seq=1)
        st = default_model.new_state(pool)
        try:
            default_model.forward(prompt, st)
            rows = default_model.forward(toks, st, all_logits=True)
            got[path] = (rows, default_model.forward(toks[:1], st))
        finally:
            st.release()
            quant.set_cpu_path("auto")
    np.testing.assert_array_equal(got["avxvnni"][0], got["avx512"][0])
    np.testing.assert_array_equal(got["avxvnni"][1], got["avx512"][1])
