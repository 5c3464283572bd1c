"""How many contexts' KV pages the devices of loaded stages hold beside their weights (`--parallel auto`)."""
from __future__ import annotations

from typing import Any

#: what a device keeps free beyond the pages: at least this many bytes, and at least MARGIN_FRAC of its total (a
#: prompt's activations, the logits of a read, CUDA graphs, the host's own work on the CPU)
MARGIN_BYTES = 1 << 30
MARGIN_FRAC = 0.10


def context_bytes(model, carve, n_ctx: int) -> int:
    """Bytes of one context's KV pages of `carve` on `model`'s device: pages of n_ctx tokens times the bytes a
    token takes there (a one-page pool of the model's own kind tells it: f16 or q8_0 on a GPU, float32 on the
    CPU)."""
    pool = model.new_page_pool(1, 1, carve=carve)
    return -(-int(n_ctx) // pool.page_size) * pool.page_size * int(pool.bytes_per_token)


def contexts_that_fit(loaded: list[tuple[Any, Any, Any]], n_ctx: int, want: int) -> int:
    """`want` when every device of `loaded` ((carve, model, backend) per stage, weights in place) has free memory
    for `want` contexts of n_ctx tokens on each of its stages plus its margin (MARGIN_BYTES, MARGIN_FRAC of its
    total), else 1; a device that cannot say what is free counts as too small."""
    need: dict[int, int] = {}
    backends: dict[int, Any] = {}
    for carve, model, be in loaded:
        need[id(be)] = need.get(id(be), 0) + want * context_bytes(model, carve, n_ctx)
        backends[id(be)] = be
    for key, be in backends.items():
        free = be.free_memory()
        margin = max(MARGIN_BYTES, int(MARGIN_FRAC * be.total_memory()))
        if free is None or need[key] + margin > free:
            return 1
    return want
