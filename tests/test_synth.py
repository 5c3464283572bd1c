"""strata.gguf.synth: synthetic GGUF files in llama.cpp's layout (names and keys from the gguf library's constants),
reproducible from a seed, with the default model's tokenizer; the llama export checked against transformers."""
import hashlib

import gguf
import numpy as np
import pytest

from strata.gguf import synth
from strata.gguf.default_model import default_model_path


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def default_reader():
    return gguf.GGUFReader(default_model_path())


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35", "qwen35moe"])
def test_tiny_file_layout(arch, tmp_path, default_reader):
    path = synth.write_synthetic(tmp_path / "a.gguf", synth.preset(arch))
    assert path.stat().st_size < 5 * 1024 * 1024
    r = gguf.GGUFReader(path)
    A = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[A]}
    nextn = {gguf.TENSOR_NAMES[t] for t in (gguf.MODEL_TENSOR.NEXTN_EH_PROJ, gguf.MODEL_TENSOR.NEXTN_ENORM,
                                            gguf.MODEL_TENSOR.NEXTN_HNORM, gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM)}
    for t in r.tensors:
        base = t.name.rsplit(".", 1)[0] if t.name.endswith((".weight", ".bias")) else t.name
        fmt = base.replace(base.split(".")[1], "{bid}", 1) if base.startswith("blk.") else base
        assert fmt in allowed or fmt in nextn, f"{t.name} is not a {arch} tensor name in gguf.constants"
    f = r.fields
    K = gguf.Keys
    n_layer, n_mtp = 4, 1
    assert f[K.General.ARCHITECTURE].contents() == arch
    assert f[K.LLM.BLOCK_COUNT.format(arch=arch)].contents() == n_layer + n_mtp
    assert f[K.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch)].contents() == n_mtp
    for key in (K.SSM.CONV_KERNEL, K.SSM.STATE_SIZE, K.SSM.GROUP_COUNT, K.SSM.TIME_STEP_RANK, K.SSM.INNER_SIZE,
                K.LLM.FULL_ATTENTION_INTERVAL, K.Rope.DIMENSION_COUNT):
        assert key.format(arch=arch) in f
    names = {t.name: t for t in r.tensors}
    assert "blk.3.attn_q.weight" in names and "blk.0.ssm_a" in names and "blk.3.ssm_a" not in names
    a = np.asarray(names["blk.0.ssm_a"].data)
    assert (a < 0).all()                                    # -exp(A_log)
    assert list(names["blk.0.ssm_conv1d.weight"].shape) == [4, 128]    # ne = (kernel, 2*n_k*d_k + n_v*d_v)
    if arch != "qwen35":
        assert (K.LLM.EXPERT_COUNT.format(arch=arch)) in f
    # tokenizer and chat template copied from the default model
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"):
        assert f[key].contents() == default_reader.fields[key].contents()
    assert f["tokenizer.ggml.tokens"].contents()[:100] == default_reader.fields["tokenizer.ggml.tokens"].contents()[:100]


def test_reproducible_from_seed(tmp_path):
    a = synth.write_synthetic(tmp_path / "a.gguf", synth.preset("qwen35moe", seed=5))
    b = synth.write_synthetic(tmp_path / "b.gguf", synth.preset("qwen35moe", seed=5))
    c = synth.write_synthetic(tmp_path / "c.gguf", synth.preset("qwen35moe", seed=6))
    assert _sha(a) == _sha(b) != _sha(c)


def test_workers_write_the_same_bytes(tmp_path):
    """write_synthetic(workers=2) (tensors computed in a process pool, written in order) == the serial file, byte for
    byte, for a Q4_0 MoE file (quantized expert stacks, F32 norms, the router)."""
    spec = synth.preset("qwen35moe", "tiny", qtype="Q4_0", seed=4)
    a = synth.write_synthetic(tmp_path / "serial.gguf", spec)
    b = synth.write_synthetic(tmp_path / "pool.gguf", spec, workers=2)
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()


def test_quant_types(tmp_path):
    path = synth.write_synthetic(tmp_path / "q.gguf", synth.preset("qwen35", qtype="Q8_0", embd_qtype="Q8_0"))
    r = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_qkv.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.ssm_conv1d.weight"] == gguf.GGMLQuantizationType.F32
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    with pytest.raises(ValueError, match="Q4_K"):
        synth.preset("qwen35", qtype="Q4_K")
    with pytest.raises(ValueError, match="unknown arch"):
        synth.preset("mamba")


def test_llama_export_matches_strata_llama(tmp_path):
    """The llama synthetic file read by Strata's llama model and by transformers (after the inverse Q/K
    permutation) gives the same logits (F32 weights; max abs diff < 5e-3)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from strata.gguf.file import open_gguf
    from strata.models.registry import load_model
    path = synth.write_synthetic(tmp_path / "l.gguf", synth.preset("llama", qtype="F32", embd_qtype="F32", seed=2))
    f = open_gguf(path)
    m = load_model(f)
    hf, _ = synth.hf_model(f.reader)
    toks = np.random.default_rng(0).integers(0, m.config.n_vocab, 40).astype(np.int32)
    got = m.forward(toks, m.new_state(m.new_page_pool(64)))
    with torch.no_grad():
        want = hf(torch.from_numpy(toks[None].astype(np.int64))).logits[0, -1].numpy()
    assert np.abs(got - want).max() < 5e-3


def test_skewed_routers_concentrate_and_follow_the_topic(tmp_path, monkeypatch):
    """router_zipf: on the CPU model, the 16 most used of 64 experts take far more of a topic prompt's routings than
    with plain routers (a uniform router gives them about 25-35 %), and two topics' hot sets differ."""
    from strata.backend import moe as M
    from strata.models.registry import load_model
    seen = []
    real_route = M.route

    def route(logits, k, renorm):
        ids, w = real_route(logits, k, renorm)
        seen.append(np.asarray(ids))
        return ids, w
    monkeypatch.setattr(M, "route", route)
    share, hot = {}, {}
    for z in ("", "1.2"):
        spec = synth.preset("qwen35moe", "tiny", n_expert=64, n_expert_used=8, n_layer=2, n_embd=128, n_ff_exp=32,
                            router_zipf=z, n_mtp=0, qtype="Q8_0", seed=2)
        m = load_model(synth.write_synthetic(tmp_path / f"z{z or 0}.gguf", spec))
        pool = m.new_page_pool(256, n_seq=1)
        for topic in (0, 1):
            toks = (np.random.default_rng(topic).integers(0, 49152 // 4, 120) * 4 + topic).astype(np.int32)
            st = m.new_state(pool)
            seen.clear()
            m.forward(toks, st)
            st.release()
            c = np.bincount(seen[0].ravel(), minlength=64)          # layer 0
            share[z, topic] = np.sort(c)[::-1][:16].sum() / c.sum()
            hot[z, topic] = set(np.argsort(-c, kind="stable")[:16].tolist())
    assert max(share["", 0], share["", 1]) < 0.45
    assert min(share["1.2", 0], share["1.2", 1]) > 0.6
    assert len(hot["1.2", 0] & hot["1.2", 1]) <= 10


def test_synth_tool_writes_a_chat_template_and_refuses_bad_input_in_one_line(tmp_path):
    """tools/synth_gguf.py --chat-template FILE puts the file's text in tokenizer.chat_template; a missing file and
    a --set value of the wrong type are one line each, with no file written."""
    import subprocess
    import sys
    from pathlib import Path

    from strata.gguf.file import open_gguf
    root = Path(__file__).resolve().parents[1]
    tpl = root / "tests/data/templates/Qwen3.5-4B.jinja"
    tool = [sys.executable, str(root / "tools/synth_gguf.py"), "llama"]
    out = tmp_path / "t.gguf"
    p = subprocess.run([*tool, str(out), "--chat-template", str(tpl)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert open_gguf(str(out)).metadata["tokenizer.chat_template"] == tpl.read_text()
    for extra, needle in ((["--chat-template", str(tmp_path / "nope.jinja")], "--chat-template"),
                          (["--set", "n_layer=abc"], "--set n_layer")):
        bad = tmp_path / "bad.gguf"
        p = subprocess.run([*tool, str(bad), *extra], capture_output=True, text=True, timeout=120)
        err = p.stderr.strip()
        assert p.returncode != 0 and len(err.splitlines()) == 1 and needle in err and not bad.exists(), err
