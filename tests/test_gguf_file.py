"""GGUF loading: the real default model's metadata and config, and a one-line ModelLoadError for each bad input."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from strata.gguf.file import ModelLoadError, open_gguf
from strata.models.registry import load_model, supported_archs

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
        open_gguf(p, archs=supported_archs())
    one_line_error(e)


def test_unsupported_quant_type(tmp_path):
    tq2 = np.zeros((1, 66), dtype=np.uint8)  # one TQ2_0 block: 256 values in 66 bytes
    p = write_tiny(tmp_path / "q.gguf", extra_tensors=[("blk.0.odd.weight", tq2, GGMLQuantizationType.TQ2_0)])
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.odd\.weight has unsupported quant type TQ2_0") as e:
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


# ------------------------------------------------------------------------------------ the header reader vs gguf-py
def _gguf_py_view(path):
    """gguf-py's own reading of a file: {key: contents() or None where it cannot decode}, and its tensors."""
    import gguf

    r = gguf.GGUFReader(str(path))
    md = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            md[k] = f.contents()
        except Exception:  # noqa: BLE001 - e.g. a string that is not UTF-8
            md[k] = None
    return md, r.tensors


def test_header_reader_gives_gguf_py_values_for_every_value_type(tmp_path):
    from gguf import GGUFValueType

    from strata.gguf.file import read_header
    p = tmp_path / "all.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_uint8("a.u8", 200)
    w.add_int8("a.i8", -5)
    w.add_uint16("a.u16", 60000)
    w.add_int16("a.i16", -30000)
    w.add_uint32("a.u32", 4_000_000_000)
    w.add_int32("a.i32", -2_000_000_000)
    w.add_float32("a.f32", 0.1)
    w.add_uint64("a.u64", 2 ** 63 + 5)
    w.add_int64("a.i64", -2 ** 62)
    w.add_float64("a.f64", 0.1)
    w.add_bool("a.b", True)
    w.add_string("a.s", "héllo ✓")
    w.add_key_value("a.not_utf8", b"\xff\xfe", GGUFValueType.STRING)
    w.add_array("a.ints", [1, 2, 3])
    w.add_array("a.floats", [0.5, 0.1])
    w.add_array("a.strs", ["x", "ÿ", "", "<|im_start|>"])
    w.add_array("a.strs_not_utf8", ["ok", b"\xc3("])
    w.add_array("a.bools", [True, False])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_tensor("t.f32", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("t.f16", np.arange(8, dtype=np.float16).reshape(2, 4))
    q8 = np.arange(2 * 34, dtype=np.uint8).reshape(2, 34)      # two Q8_0 blocks: one row of 32 values each
    w.add_tensor("t.q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    md_ref, tensors_ref = _gguf_py_view(p)
    data = np.memmap(p, mode="r")
    md, table, _ = read_header(memoryview(data))
    assert list(md) == list(md_ref)
    assert {k: repr(v) for k, v in md.items()} == {k: repr(v) for k, v in md_ref.items()}   # types too
    assert md["a.not_utf8"] is None and md["a.strs_not_utf8"] is None and md["a.nested"] == [1, 2, 3]

    from strata.gguf.file import tensor_view
    assert [t.name for t in table] == [t.name for t in tensors_ref]
    for t, ref in zip(table, tensors_ref):
        v = tensor_view(data, t, GGMLQuantizationType(t.raw_type))
        assert v.dtype == ref.data.dtype and v.shape == ref.data.shape and np.array_equal(v, ref.data), t.name


def test_default_model_reads_as_gguf_py_reads_it(default_model_path):
    """Same metadata values (what GGUFModelFile.fingerprint hashes, so session files stay valid) and the same tensor
    views as gguf-py's GGUFReader; `reader` still gives the library's own view."""
    f = open_gguf(default_model_path)
    md_ref, tensors_ref = _gguf_py_view(default_model_path)
    assert list(f.metadata) == list(md_ref) and f.metadata == md_ref
    assert list(f.tensors) == [t.name for t in tensors_ref]
    for ref in tensors_ref:
        t = f.tensors[ref.name]
        assert t.data.dtype == ref.data.dtype and t.data.shape == ref.data.shape
        assert np.array_equal(t.data.reshape(-1)[:64], ref.data.reshape(-1)[:64])
        assert t.data.ctypes.data - f.tensors[tensors_ref[0].name].data.ctypes.data == \
            ref.data_offset - tensors_ref[0].data_offset
    assert f.reader.fields["tokenizer.ggml.pre"].contents() == "smollm"


def _raw_gguf(kvs: list[bytes], tensors: list[bytes] = (), *, version: bytes = None, tail: bytes = b"") -> bytes:
    import struct
    head = b"GGUF" + (version if version is not None else struct.pack("<I", 3))
    return head + struct.pack("<QQ", len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors) + tail


def _s(text: str | bytes) -> bytes:
    import struct
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def _kv_str(key: str, val: str) -> bytes:
    import struct
    return _s(key) + struct.pack("<I", 8) + _s(val)


def _kv_u32(key: str, val: int) -> bytes:
    import struct
    return _s(key) + struct.pack("<II", 4, val)


def _corrupt_cases():
    import struct
    arch = _kv_str("general.architecture", "llama")
    return {
        "big-endian": (_raw_gguf([arch], version=struct.pack(">I", 3)), "big-endian"),
        "version 1": (_raw_gguf([arch], version=struct.pack("<I", 1)), "version 1 is not supported"),
        "string past the end": (_raw_gguf([arch, _s("a.s") + struct.pack("<IQ", 8, 1 << 40)]),
                                "a.s at byte .* runs past the end of the file"),
        "string array past the end": (_raw_gguf([arch, _s("a.v") + struct.pack("<IIQ", 9, 8, 1000) + _s("x")]),
                                      "a.v at byte .* runs past the end"),
        "numeric array past the end": (_raw_gguf([arch, _s("a.v") + struct.pack("<IIQ", 9, 6, 1 << 50)]),
                                       "a.v at byte .* runs past the end"),
        "duplicate key": (_raw_gguf([arch, _kv_u32("a.x", 1), _kv_u32("a.x", 2)]), "duplicate metadata key 'a.x'"),
        "unknown value type": (_raw_gguf([arch, _s("a.x") + struct.pack("<II", 77, 0)]), "unknown value type 77"),
        "alignment": (_raw_gguf([arch, _kv_u32("general.alignment", 24)]), "alignment 24 is not a power of two"),
        "duplicate tensor": (_raw_gguf([arch], [_s("w") + struct.pack("<IQIQ", 1, 4, 0, 0)] * 2, tail=b"\0" * 64),
                             "duplicate tensor 'w'"),
        "tensor data past the end": (_raw_gguf([arch], [_s("w") + struct.pack("<IQIQ", 1, 1 << 20, 0, 0)]),
                                     "tensor w's data .* runs past the end"),
    }


@pytest.mark.parametrize("case", list(_corrupt_cases()))
def test_corrupt_header_is_one_line_error(tmp_path, case):
    raw, why = _corrupt_cases()[case]
    p = tmp_path / "c.gguf"
    p.write_bytes(raw)
    with pytest.raises(ModelLoadError, match=f"c.gguf is not a valid GGUF file: truncated or corrupt .*{why}") as e:
        open_gguf(p)
    one_line_error(e)
