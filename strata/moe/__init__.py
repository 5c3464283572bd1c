"""The adaptive MoE expert tier, device-independent: the swap policy (policy.py) and the expert store's bookkeeping
of slots, swaps in flight, loans to a prefill and the settle (store.py). The CUDA side of the store lives in
strata/backend/cuda/moe_tier.py."""
