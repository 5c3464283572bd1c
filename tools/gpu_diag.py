"""Device diagnostic: graph vs eager decode of LlamaCuda on a small synthetic model (prints timings, tokens, crashes)."""
import faulthandler
import sys
import time

import numpy as np

faulthandler.enable()
sys.path.insert(0, "bench")
import gpu_throughput as g  # noqa: E402
from strata.backend.cuda import LlamaCuda  # noqa: E402

g.make_synthetic_llama("/tmp/small.gguf", "/tmp/tok.gguf", n_embd=512, n_layer=2, n_head=8, n_kv=4, n_ff=1024)
res = {}
for graphs in (True, False):
    t0 = time.time()
    r = LlamaCuda("/tmp/small.gguf", max_ctx=1024, use_graphs=graphs)
    first = int(np.argmax(r.forward(list(range(100, 140)))))
    print("graphs", graphs, "first", first, flush=True)
    res[graphs] = [first] + r.decode_greedy(first, 63)
    print("graphs", graphs, res[graphs][:10], f"{time.time() - t0:.1f}s", flush=True)
print("identical:", res[True] == res[False])
