"""Choosing the next token: the host sampler (sampler), the same chain on device logits (device), grammar masks (grammar)."""
