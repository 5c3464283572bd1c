"""Request slots on a GPU (--parallel N with device cuda:0): the mixed requests of tests/test_parallel_engine.py
through an engine with several slots (decodes in the batched step's column kernels, per-column page tables and
running states) give each request the very tokens it gives alone on a one-slot CUDA engine; the engine's step
counters show the rows were batched."""
import pytest

from tests.cuda_marks import gpu
from tests.parallel_checks import alone as _alone, together as _together

pytestmark = [gpu]


def _no_grammar(spec) -> bool:
    return "grammar" not in spec


@pytest.mark.parametrize("arch,split", [("qwen35", None), ("qwen35", "2"), ("llama", None)],
                         ids=["hybrid-1stage", "hybrid-2stages", "llama-1stage"])
def test_cuda_slots_answer_as_alone(synthetic, arch, split):
    path = synthetic(arch, seed=1)
    pick = _no_grammar                  # a grammar's masks are applied on the host: test_parallel_engine covers them
    want = _alone(path, pick, device="cuda:0", layer_split=split)
    got, stats = _together(path, 4, pick, device="cuda:0", layer_split=split)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}: its answer beside others on the GPU differs from its answer alone"
    assert stats["batched_steps"] > 0 and stats["max_rows"] >= 2, stats
