"""Device check: strata/models/llama.py on CudaBackend vs CPUBackend, and LlamaCuda vs CPUBackend, on a synthetic
llama from strata.synth (Q4_1 weights, Q8_0 embeddings). Needs STRATA_DEFAULT_MODEL pointing at a GGUF with the
tokenizer metadata. Prints relative L2 of logits and greedy tokens."""
import sys

import numpy as np

from strata import synth
from strata.backend import cuda as C
from strata.backend.cpu import CPUBackend
from strata.gguf_file import open_gguf
from strata.models.base import model_class

path = synth.write_synthetic("/tmp/synth_llama.gguf", synth.preset("llama", "small", qtype="Q4_1", embd_qtype="Q8_0"))
f = open_gguf(path)
prompt = np.random.default_rng(0).integers(0, f.config.n_vocab, 40).astype(np.int32)
outs = {}
for name, be in (("cpu", CPUBackend()), ("cuda", C.CudaBackend())):
    m = model_class(f.arch)(f, be)
    st = m.new_state(m.new_page_pool(512))
    lg = np.asarray(m.forward(prompt, st, all_logits=True), np.float64)
    toks, t = [], int(np.argmax(lg[-1]))
    for _ in range(16):
        toks.append(t)
        t = int(np.argmax(m.forward(np.asarray([t], np.int32), st)))
    outs[name] = (lg, toks)
    print(name, toks, flush=True)
ref, got = outs["cpu"][0], outs["cuda"][0]
print("llama.py cuda vs cpu rel L2", np.linalg.norm(got - ref) / np.linalg.norm(ref), "tokens equal",
      outs["cpu"][1] == outs["cuda"][1])
r = C.LlamaCuda(str(path), max_ctx=512, ubatch=16)
lg2 = r.forward(prompt, all_logits=True).astype(np.float64)
print("LlamaCuda vs cpu rel L2", np.linalg.norm(lg2 - ref) / np.linalg.norm(ref))
first = int(np.argmax(lg2[-1]))
print("LlamaCuda greedy", [first] + r.decode_greedy(first, 15), "cpu", outs["cpu"][1])
sys.exit(0)
