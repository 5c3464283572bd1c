"""GGUF loading: the real default model's metadata and config, and a one-line ModelLoadError for each bad input."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from strata.gguf_file import ModelLoadError, open_gguf
from strata.models import load_model

E, NH, NKV, HD, FF, V, NL = 8, 2, 1, 4, 16, 32, 2


def write_tiny(path, *, arch="llama", skip=(), override=None, extra_tensors=(), n_embd_meta=E):
    """A tiny valid llama GGUF with random F32 weights (numpy-order shapes); knobs to break it."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(NL)
    w.add_embedding_length(n_embd_meta)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_context_length(128)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    for i in range(NL):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (E,), p + "attn_q.weight": (NH * HD, E),
                       p + "attn_k.weight": (NKV * HD, E), p + "attn_v.weight": (NKV * HD, E),
                       p + "attn_output.weight": (E, NH * HD), p + "ffn_norm.weight": (E,),
                       p + "ffn_gate.weight": (FF, E), p + "ffn_up.weight": (FF, E), p + "ffn_down.weight": (E, FF)})
    shapes.update(override or {})
    for name, shape in shapes.items():
        if name not in skip:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.1)
    for name, arr, qtype in extra_tensors:
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


def test_default_model_metadata_and_config(default_model_path):
    f = open_gguf(default_model_path)
    c = f.config
    assert f.arch == "llama" and c.arch == "llama"
    assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff, c.n_vocab) == (30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == 100000.0 and c.rope_dim == 64 and c.rope_neox is False
    assert c.tie_embeddings is True and c.n_ctx_train == 8192
    assert abs(c.rms_eps - 1e-5) < 1e-9
    assert f.metadata["tokenizer.ggml.pre"] == "smollm"
    assert isinstance(f.metadata["tokenizer.ggml.tokens"], list) and len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    emb = f.tensor("token_embd.weight", (49152, 576))
    assert emb.ggml_type == GGMLQuantizationType.Q8_0 and emb.data.dtype == np.uint8
    q = f.tensor("blk.0.attn_q.weight", (576, 576))
    assert q.ggml_type == GGMLQuantizationType.Q4_1
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_k\.weight.*\(576, 576\)") as e:
        f.tensor("blk.0.attn_k.weight", (576, 576))
    one_line_error(e)


def test_tiny_model_loads_and_runs(tmp_path):
    m = load_model(write_tiny(tmp_path / "tiny.gguf"))
    st = m.new_state(m.new_page_pool(64, page_size=16))
    lg = m.forward(np.array([1, 2, 3], dtype=np.int32), st)
    assert lg.shape == (V,) and np.isfinite(lg).all() and st.pos == 3


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found") as e:
        open_gguf(tmp_path / "nope.gguf")
    assert "nope.gguf" in one_line_error(e)


def test_not_a_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is a text file, not a model\n")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as e:
        open_gguf(p)
    assert "model.gguf" in one_line_error(e)


@pytest.mark.parametrize("keep", [0.5, 0.97, 24])
def test_truncated_file(tmp_path, keep):
    p = write_tiny(tmp_path / "t.gguf")
    data = p.read_bytes()
    n = int(len(data) * keep) if keep < 1 else int(keep)
    p.write_bytes(data[:n])
    with pytest.raises(ModelLoadError, match="not a valid GGUF file") as e:
        load_model(p)
    assert "t.gguf" in one_line_error(e)


def test_unknown_architecture(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", arch="gpt9000")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt9000' \(supported: .*llama") as e:
        open_gguf(p)
    one_line_error(e)


def test_unsupported_quant_type(tmp_path):
    iq2 = np.zeros((1, 66), dtype=np.uint8)  # one IQ2_XXS block: 256 values in 66 bytes
    p = write_tiny(tmp_path / "q.gguf", extra_tensors=[("blk.0.odd.weight", iq2, GGMLQuantizationType.IQ2_XXS)])
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.odd\.weight has unsupported quant type IQ2_XXS") as e:
        open_gguf(p)
    one_line_error(e)


def test_tensor_shape_disagrees_with_metadata(tmp_path):
    p = write_tiny(tmp_path / "s.gguf", override={"blk.1.attn_k.weight": (2 * NKV * HD, E)})
    with pytest.raises(ModelLoadError, match=r"blk\.1\.attn_k\.weight has shape \(8, 8\) but the metadata "
                                             r"expects \(4, 8\)") as e:
        load_model(p)
    one_line_error(e)


def test_missing_tensor(tmp_path):
    p = write_tiny(tmp_path / "m.gguf", skip={"blk.1.ffn_down.weight"})
    with pytest.raises(ModelLoadError, match=r"tensor blk\.1\.ffn_down\.weight is missing \(expected shape "
                                             r"\(8, 16\)\)") as e:
        load_model(p)
    one_line_error(e)


def test_missing_metadata_key(tmp_path):
    p = tmp_path / "k.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_tensor("token_embd.weight", np.zeros((V, E), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"llama\.block_count is missing") as e:
        open_gguf(p)
    one_line_error(e)


def test_progress_callback(tmp_path):
    seen = []
    load_model(write_tiny(tmp_path / "p.gguf"), progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] and all(a <= b for (a, _), (b, _) in zip(seen, seen[1:]))
