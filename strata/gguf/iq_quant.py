"""Small quantizers for the IQ types (IQ1_S/M, IQ2_XXS/XS/S, IQ3_XXS/S, IQ4_NL/XS), for synthetic models.

gguf-py (0.19) dequantizes the IQ types but cannot write them. ``quantize(x, t)`` writes valid blocks of type t in
the byte layout gguf-py's dequantizers (and llama.cpp) read: per block the f16 scale from the largest magnitude,
integer sub-block scales rounded to the nearest step, and each group of values mapped to the nearest grid row (or
non-linear value) after the scale, with its sign bits (the IQ2_XXS / IQ2_XS / IQ3_XXS sign tables carry 7 bits of 8:
a group with an odd count of negatives flips its smallest value). No importance matrix, no search over scales:
this is not llama.cpp's quality, only blocks whose dequantization follows the values, which is what a parity test
of the kernels and a benchmark need. A model's logits are then compared on the dequantized weights.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf import quants as gq

IQ_QUANTIZABLE = (QT.IQ1_S, QT.IQ1_M, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ4_NL,
                  QT.IQ4_XS)
_KV = np.array(gq.IQ4_NL.kvalues, dtype=np.float32)


def _grid(cls) -> np.ndarray:
    """gguf-py's expanded grid of an IQ class: (rows, 4 or 8) float32."""
    cls.init_grid()
    return np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)


def _nearest_rows(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid row (squared distance) for each row of v (n, k) -> (n,) int64."""
    g2 = (grid * grid).sum(axis=1)
    out = np.empty(len(v), dtype=np.int64)
    for i in range(0, len(v), 4096):
        c = v[i:i + 4096]
        out[i:i + 4096] = np.argmax(2.0 * (c @ grid.T) - g2, axis=1)
    return out


def _nearest_kv(v: np.ndarray) -> np.ndarray:
    return np.abs(v[..., None] - _KV).argmin(axis=-1).astype(np.uint8)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b with 0 where b is 0."""
    b = np.asarray(b, dtype=np.float32)
    return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _even_signs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of 8 (..., 8) -> (magnitudes, 7 sign bits): an odd count of negatives flips the smallest magnitude's
    sign (its value moves to the other side of zero), as the 7-bit sign table requires."""
    neg = x < 0
    odd = neg.sum(axis=-1) % 2 == 1
    j = np.abs(x).argmin(axis=-1)
    flip = np.zeros_like(neg)
    np.put_along_axis(flip, j[..., None], odd[..., None], axis=-1)
    neg ^= flip
    bits = (neg[..., :7].astype(np.uint32) << np.arange(7, dtype=np.uint32)).sum(axis=-1)
    return np.abs(x), bits.astype(np.uint32)


def _sign_bytes(x: np.ndarray) -> np.ndarray:
    """Groups of 8 (..., 8) -> one byte, bit j set when value j is negative."""
    return ((x < 0).astype(np.uint16) << np.arange(8, dtype=np.uint16)).sum(axis=-1).astype(np.uint8)


def _scales(amax: np.ndarray, gmax: float, steps: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Block scale d (f16, per block) and integer sub-block scales (index into steps, the multipliers of d) so that
    d * steps[s] is near amax / gmax for each sub-block; amax (n, n_sub)."""
    want = amax / gmax
    d = _f16(want.max(axis=axis) / steps[-1])
    df = d.astype(np.float32)[:, None]
    s = np.abs(_div(want, df)[..., None] - steps).argmin(axis=-1)
    return d, s


def _q_iq4_nl(x):
    b = x.reshape(-1, 32)
    d = _f16(np.abs(b).max(axis=1) / 127.0)
    q = _nearest_kv(_div(b, d.astype(np.float32)[:, None]))
    qs = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1)


def _q_iq4_xs(x):
    b = x.reshape(-1, 8, 32)
    d, s = _scales(np.abs(b).max(axis=2), 127.0, np.arange(0, 32, dtype=np.float32))
    dl = d.astype(np.float32)[:, None] * s.astype(np.float32)
    q = _nearest_kv(_div(b, dl[..., None]))
    st = (s + 32).astype(np.uint16)                                  # stored 6-bit scale, value st - 32
    sh = ((st >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype(np.uint16)
    sl = ((st[:, 0::2] & 0xF) | ((st[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), sh.view(np.uint8).reshape(-1, 2), sl, qs], axis=1)


def _q_iq2(x, t):
    """IQ2_XXS (per-32 scale, 7-bit signs in the scale word), IQ2_XS (per-16 scales, signs in the index) and IQ2_S
    (per-16 scales, a sign byte per 8 values): d * (0.5 + s) / 4 scales with s in 0..15, grid values up to 43."""
    cls = {QT.IQ2_XXS: gq.IQ2_XXS, QT.IQ2_XS: gq.IQ2_XS, QT.IQ2_S: gq.IQ2_S}[t]
    grid = _grid(cls)
    n = x.size // 256
    per = 32 if t == QT.IQ2_XXS else 16
    sub = x.reshape(n, 256 // per, per)
    d, s = _scales(np.abs(sub).max(axis=2), 43.0, (0.5 + np.arange(16, dtype=np.float32)) / 4)
    db = d.astype(np.float32)[:, None] * (0.5 + s.astype(np.float32)) / 4
    g8 = (sub / np.where(db == 0, 1, db)[..., None] * (db != 0)[..., None]).reshape(n, 32, 8)
    if t == QT.IQ2_S:
        mag, signs = np.abs(g8), _sign_bytes(g8)
    else:
        mag, signs = _even_signs(g8)
    idx = _nearest_rows(mag.reshape(-1, 8), grid).reshape(n, 32)
    dd = d.view(np.uint8).reshape(n, 2)
    if t == QT.IQ2_XXS:
        words = np.zeros((n, 8, 2), dtype=np.uint32)
        i4 = idx.reshape(n, 8, 4).astype(np.uint32)
        words[..., 0] = (i4 << (8 * np.arange(4, dtype=np.uint32))).sum(axis=2)
        words[..., 1] = (signs.reshape(n, 8, 4) << (7 * np.arange(4, dtype=np.uint32))).sum(axis=2) | \
            (s.astype(np.uint32) << 28)
        return np.concatenate([dd, words.reshape(n, 16).view(np.uint8)], axis=1)
    sc = (s[:, 0::2] | (s[:, 1::2] << 4)).astype(np.uint8)
    if t == QT.IQ2_XS:
        qs = (idx.astype(np.uint16) | (signs.astype(np.uint16) << 9)).astype(np.uint16)
        return np.concatenate([dd, qs.view(np.uint8), sc], axis=1)
    qh = (((idx >> 8) & 3).reshape(n, 8, 4) << (2 * np.arange(4))).sum(axis=2).astype(np.uint8)
    return np.concatenate([dd, (idx & 255).astype(np.uint8), signs, qh, sc], axis=1)


def _q_iq3(x, t):
    """IQ3_XXS (per-32 scale d * (0.5 + s) / 2, 7-bit signs, grid up to 62) and IQ3_S (per-32 scale d * (1 + 2 s),
    a sign byte per 8 values, 9-bit grid indices, grid up to 15)."""
    xxs = t == QT.IQ3_XXS
    grid = _grid(gq.IQ3_XXS if xxs else gq.IQ3_S)
    n = x.size // 256
    sub = x.reshape(n, 8, 32)
    steps = (0.5 + np.arange(16, dtype=np.float32)) / 2 if xxs else 1 + 2 * np.arange(16, dtype=np.float32)
    d, s = _scales(np.abs(sub).max(axis=2), 62.0 if xxs else 15.0, steps)
    db = d.astype(np.float32)[:, None] * steps[s]
    g8 = (sub / np.where(db == 0, 1, db)[..., None] * (db != 0)[..., None]).reshape(n, 32, 8)
    if xxs:
        mag, signs = _even_signs(g8)
    else:
        mag, signs = np.abs(g8), _sign_bytes(g8)
    idx = _nearest_rows(mag.reshape(-1, 4), grid).reshape(n, 64)
    dd = d.view(np.uint8).reshape(n, 2)
    if xxs:
        words = (signs.reshape(n, 8, 4) << (7 * np.arange(4, dtype=np.uint32))).sum(axis=2) | \
            (s.astype(np.uint32) << 28)
        return np.concatenate([dd, idx.astype(np.uint8), words.astype(np.uint32).view(np.uint8)], axis=1)
    qh = (((idx >> 8) & 1).reshape(n, 8, 8) << np.arange(8)).sum(axis=2).astype(np.uint8)
    sc = (s[:, 0::2] | (s[:, 1::2] << 4)).astype(np.uint8)
    return np.concatenate([dd, (idx & 255).astype(np.uint8), qh, signs, sc], axis=1)


def _q_iq1(x, t):
    """IQ1_S (per 32: scale d * (2 s + 1), one +-1/8 offset) and IQ1_M (per 16: scale; per 8: offset; the f16 d in
    the scale words' top nibbles): values dl * (grid + offset), grid rows of -1, 0, 1."""
    grid = _grid(gq.IQ1_S)
    n = x.size // 256
    per = 32 if t == QT.IQ1_S else 16
    sub = x.reshape(n, 256 // per, per)
    steps = 1 + 2 * np.arange(8, dtype=np.float32)
    d, s = _scales(np.abs(sub).max(axis=2), 1.125, steps)
    dl = d.astype(np.float32)[:, None] * steps[s]
    v = (sub / np.where(dl == 0, 1, dl)[..., None] * (dl != 0)[..., None]).reshape(n, 32, 8)
    if t == QT.IQ1_S:
        neg = np.repeat(sub.mean(axis=2) < 0, 4, axis=1)             # one offset per 32 values
    else:
        neg = v.mean(axis=2) < 0                                     # one per 8
    idx = _nearest_rows((v - np.where(neg, -0.125, 0.125)[..., None]).reshape(-1, 8), grid).reshape(n, 32)
    qs = (idx & 255).astype(np.uint8)
    hi = ((idx >> 8) & 7).astype(np.uint16)
    if t == QT.IQ1_S:
        qh = (hi.reshape(n, 8, 4) << (3 * np.arange(4, dtype=np.uint16))).sum(axis=2).astype(np.uint16)
        qh |= (s.astype(np.uint16) << 12) | (neg[:, 0::4].astype(np.uint16) << 15)
        return np.concatenate([d.view(np.uint8).reshape(n, 2), qs, qh.view(np.uint8)], axis=1)
    nib = (hi | (neg.astype(np.uint16) << 3)).reshape(n, 16, 2)
    qh = (nib[..., 0] | (nib[..., 1] << 4)).astype(np.uint8)
    sw = (s.astype(np.uint16).reshape(n, 4, 4) << (3 * np.arange(4, dtype=np.uint16))).sum(axis=2).astype(np.uint16)
    bits = d.view(np.uint16)[:, None]
    sw |= ((bits >> (4 * np.arange(4, dtype=np.uint16))) & 0xF) << 12
    return np.concatenate([qs, qh, sw.astype(np.uint16).view(np.uint8)], axis=1)


def quantize(x: np.ndarray, t: QT) -> np.ndarray:
    """x float (..., n_in) with n_in a multiple of t's block size -> uint8 (..., n_in / block * bytes), the packed
    blocks of IQ type t. ValueError for another type or a row length that is not whole blocks."""
    if t not in IQ_QUANTIZABLE:
        raise ValueError(f"iq_quant writes only the IQ types, not {getattr(t, 'name', t)}")
    blck, size = GGML_QUANT_SIZES[t]
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % blck:
        raise ValueError(f"row length {x.shape[-1] if x.ndim else 0} is not a multiple of the {t.name} block "
                         f"size {blck}")
    flat = x.reshape(-1, blck)
    if t == QT.IQ4_NL:
        out = _q_iq4_nl(flat)
    elif t == QT.IQ4_XS:
        out = _q_iq4_xs(flat)
    elif t in (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S):
        out = _q_iq2(flat, t)
    elif t in (QT.IQ3_XXS, QT.IQ3_S):
        out = _q_iq3(flat, t)
    else:
        out = _q_iq1(flat, t)
    assert out.shape == (flat.shape[0], size), (t.name, out.shape)
    return np.ascontiguousarray(out, dtype=np.uint8).reshape(*x.shape[:-1], x.shape[-1] // blck * size)
