"""Parity of the CUDA llama path (strata.backend.cuda.LlamaCuda) on the default model against an independent float32
reference: Hugging Face transformers loading the same GGUF (weights dequantized by gguf-py). Checks all-position
logits of a chat prompt and 64 greedy tokens (graph decode and eager decode). Skipped without a GPU."""
import os

import numpy as np
import pytest

from strata.backend import cuda as C

_why = C.unavailable_reason()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"CUDA backend unavailable: {_why}")

# Tolerance: our prefill uses f16 GEMM operands and an f16 KV cache; the reference is float32 throughout.
LOGITS_REL_L2 = 2e-2          # ||ours - ref|| / ||ref|| over all positions
N_GREEDY = 64


@pytest.fixture(scope="module")
def model_path():
    from strata.default_model import default_model_path
    try:
        p = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    if not p.is_file():
        pytest.skip(f"default model not at {p}")
    return p


@pytest.fixture(scope="module")
def hf(model_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    torch.backends.cuda.matmul.allow_tf32 = False
    tok = transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                          torch_dtype=torch.float32)
    m.eval()
    return tok, m


@pytest.fixture(scope="module")
def prompt_ids(hf):
    tok, _ = hf
    msgs = [{"role": "user", "content": "Write a short poem about the sea, then explain what a KV cache is."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def hf_logits(m, ids):
    import torch
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].double().numpy()


def test_prefill_logits_match_reference(model_path, hf, prompt_ids):
    _, m = hf
    ref = hf_logits(m, prompt_ids)
    run = C.LlamaCuda(str(model_path), max_ctx=1024, ubatch=16)     # several ubatches: exercises the KV offsets
    got = run.forward(prompt_ids, all_logits=True).astype(np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"prefill logits rel L2 {err:.2e}, max abs {np.abs(got - ref).max():.3e}")
    assert np.isfinite(got).all()
    assert err < LOGITS_REL_L2
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.95


@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_64_tokens_identical(model_path, hf, prompt_ids, graphs):
    import torch
    _, m = hf
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt_ids]), max_new_tokens=N_GREEDY, do_sample=False)
    ref = [int(t) for t in out[0, len(prompt_ids):]]       # may stop early at <|im_end|>
    run = C.LlamaCuda(str(model_path), max_ctx=1024, use_graphs=graphs)
    first = int(np.argmax(run.forward(prompt_ids)))
    got = [first] + run.decode_greedy(first, N_GREEDY - 1)
    print("ours:", got[:16], "ref:", ref[:16])
    assert got[:len(ref)] == ref
    # the last decode step's logits against the reference's at the same position
    full = prompt_ids + got[:-1]
    ref_last = hf_logits(m, full)[-1]
    ours_last = run.decode_logits().astype(np.float64)
    assert np.linalg.norm(ours_last - ref_last) / np.linalg.norm(ref_last) < LOGITS_REL_L2


def test_llama_py_on_cuda_backend_matches_cpu_backend(model_path, prompt_ids):
    """strata/models/llama.py unchanged on CudaBackend vs CPUBackend: prompt logits and 16 greedy tokens."""
    from strata.backend.cpu import CPUBackend
    from strata.gguf_file import open_gguf
    from strata.models.base import model_class
    f = open_gguf(model_path)
    outs = {}
    for name, be in (("cpu", CPUBackend()), ("cuda", C.CudaBackend())):
        m = model_class(f.arch)(f, be)
        st = m.new_state(m.new_page_pool(1024))
        lg = m.forward(np.asarray(prompt_ids, np.int32), st, all_logits=True)
        toks, t = [], int(np.argmax(lg[-1]))
        for _ in range(16):
            toks.append(t)
            t = int(np.argmax(m.forward(np.asarray([t], np.int32), st)))
        outs[name] = (np.asarray(lg, np.float64), toks)
    (ref, ref_t), (got, got_t) = outs["cpu"], outs["cuda"]
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"llama.py cuda vs cpu: logits rel L2 {err:.2e}; tokens {got_t} vs {ref_t}")
    assert err < LOGITS_REL_L2
    assert got_t == ref_t
