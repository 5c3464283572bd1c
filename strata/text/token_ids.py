"""Token id sequences as int32 numpy arrays: conversion, prefix tests and common prefixes without per-token Python loops."""
from __future__ import annotations

import numpy as np

__all__ = ["as_ids", "frozen_ids", "common_prefix", "is_prefix", "same_ids"]

_LO, _HI = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def as_ids(tokens) -> np.ndarray:
    """Token ids as a 1-D int32 array (an int32 array is returned as it is, not copied).

    Python ints are read in C (numpy's list conversion), not one by one. Anything that is not integers (floats,
    numpy scalars of other kinds) goes through int() per token as before. Raises ValueError (one line) for an id
    outside int32, which no vocabulary reaches.
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1:
        return tokens
    try:
        a = np.asarray(tokens)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iub"):
            a = np.array([int(t) for t in tokens], dtype=np.int64)     # floats, objects: int() as before
    except OverflowError:
        a = None
    if a is None or (a.size and (a.min() < _LO or a.max() > _HI)):
        bad = next(int(t) for t in tokens if not _LO <= int(t) <= _HI)
        raise ValueError(f"token id {bad} is outside int32")
    return a.astype(np.int32, copy=False)


def frozen_ids(tokens) -> np.ndarray:
    """Token ids as a read-only int32 array of their own: one already read-only and owning its data is kept, anything
    else (a list, a view of a buffer that will change) is copied first."""
    a = as_ids(tokens)
    if a.flags.writeable or not a.flags.owndata:
        a = a.copy()
        a.flags.writeable = False
    return a


def common_prefix(a, b) -> int:
    """The length of the longest common prefix of two token id sequences."""
    a, b = as_ids(a), as_ids(b)
    m = min(a.shape[0], b.shape[0])
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def is_prefix(prefix, seq) -> bool:
    """Whether `prefix` is a prefix of `seq` (both token id sequences; the empty one is a prefix of any)."""
    p, s = as_ids(prefix), as_ids(seq)
    n = p.shape[0]
    return n <= s.shape[0] and bool(np.array_equal(s[:n], p))


def same_ids(a, b) -> bool:
    """Whether two token id sequences are equal."""
    a, b = as_ids(a), as_ids(b)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def outside_vocab(tokens, n_vocab: int | None) -> int | None:
    """The first token id below 0 or (when n_vocab is known) not below n_vocab, or None. A list or an integer array;
    min / max run in C, so only a prompt that holds such an id is looked through token by token."""
    if len(tokens) == 0:
        return None
    if isinstance(tokens, np.ndarray):
        lo, hi = int(tokens.min()), int(tokens.max())
    else:
        lo, hi = min(tokens), max(tokens)
    if lo >= 0 and (n_vocab is None or hi < n_vocab):
        return None
    return int(next(t for t in tokens if t < 0 or (n_vocab is not None and t >= n_vocab)))
