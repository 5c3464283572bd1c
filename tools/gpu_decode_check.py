"""Device check: one decode step of strata/models/llama.py computed five ways on the CUDA backend (llama.py eager
one-token forward with and without int8 activations, the LlamaCuda plan as a graph with and without int8
activations, the plan without a graph) against the same position's row of an all-logits prefill of the whole
sequence. Prints the relative L2 errors. Usage: python tools/gpu_decode_check.py MODEL.gguf [N_STEPS]"""
import sys

import numpy as np

sys.path.insert(0, ".")
from strata.backend import cuda as C  # noqa: E402
from strata.backend.cuda import llama as LL  # noqa: E402
from strata.backend.cuda import settings as S  # noqa: E402
from strata.models.registry import load_model  # noqa: E402

path = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
model = load_model(path, C.CudaBackend())
pool = model.new_page_pool(4096)
rng = np.random.default_rng(0)
prompt = [int(t) for t in rng.integers(0, model.config.n_vocab, 40)]
ref_state = model.new_state(pool)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


ways = {}
for name in ("llama_py_dp4a", "llama_py_f32act", "graph_dp4a", "graph_f32act", "plan_eager_dp4a"):
    st = model.new_state(pool)
    lg = model.forward(np.asarray(prompt, np.int32), st)
    ways[name] = (st, lg)
plans = {}
toks = [int(np.argmax(ways["llama_py_dp4a"][1]))]
for step in range(steps):
    seq = prompt + toks
    ref_state.reset()
    ref = model.forward(np.asarray(seq, np.int32), ref_state, all_logits=True)[-1]
    t = toks[-1]
    out = {}
    for name, (st, _) in ways.items():
        if name.startswith("llama_py"):
            S.DP4A = name.endswith("dp4a")
            lg = model.forward(np.asarray([t], np.int32), st)
            S.DP4A = True
        else:
            p = plans.get(name)
            if p is None:
                p = plans[name] = LL.LlamaCuda(model, pool, use_graphs=name.startswith("graph"))
                p.dp4a = name.endswith("dp4a")
            lg = p.decode(t, st)
        out[name] = lg
    print(f"step {step} pos {len(seq) - 1}: " + "  ".join(f"{k} {rel(v, ref):.2e}" for k, v in out.items()) +
          f"  | llama_py vs graph {rel(out['graph_dp4a'], out['llama_py_dp4a']):.2e}", flush=True)
    toks.append(int(np.argmax(ref)))
