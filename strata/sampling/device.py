"""Sampling on the device: DeviceSampler (strata.sampling.sampler.Sampler's chain on CuPy or numpy logits) and its counter-based RNG."""
from __future__ import annotations

import math
import os
from collections import deque
from typing import Any

import numpy as np

from strata.sampling.sampler import NonFiniteLogits, SampleResult, SamplingParams, bias_arrays

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(z: int) -> int:
    """SplitMix64's output function of a 64-bit integer (Steele, Lea, Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014; Vigna's reference splitmix64.c) -> int in [0, 2**64)."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, step: int) -> float:
    """The counter-based draw: a float64 in [0, 1) that depends only on (seed, step), both ints in [0, 2**64).

    u = (splitmix64(splitmix64(seed) + step * 0x9E3779B97F4A7C15) >> 11) * 2**-53: 53 random bits, so every
    value is exactly representable and the same on every machine. Computed on the host (Python integers), so
    numpy and CuPy runs of one seed use the same u at every step.
    """
    key = splitmix64(int(seed) & _MASK64)
    return (splitmix64((key + int(step) * _GOLDEN) & _MASK64) >> 11) * (1.0 / (1 << 53))


_kernel_lib: Any = None          # (ffi, lib) once loaded, False when unavailable


def sample_kernel():
    """(ffi, lib) of strata_sample (native/cuda/sampling.cu) in strata/_cuda_kernels.so (the backend's cffi handle), or
    None: library or symbol missing, or turned off (STRATA_SAMPLE_KERNEL=0: every draw takes the CuPy array path)."""
    global _kernel_lib
    if os.environ.get("STRATA_SAMPLE_KERNEL", "1") in ("0", "false", "no"):
        return None
    if _kernel_lib is None:
        try:
            from strata.backend.cuda import library
            ffi, lib = library.ffi(), library.lib()
            _ = lib.strata_sample                               # AttributeError: an older library
            _kernel_lib = (ffi, lib)
        except Exception:  # noqa: BLE001 -- no kernel: the array path does the same sampling
            _kernel_lib = False
    return _kernel_lib or None


def array_module(a) -> Any:
    """numpy, or cupy for a CuPy array (found from the array's type; CuPy is imported only then)."""
    if type(a).__module__.split(".", 1)[0] == "cupy":
        import cupy
        return cupy
    return np


def _argsort_desc(xp, v):
    """Indices sorting v (1-D float32) by value descending, ties by index ascending (stable sort of -v; CuPy's
    1-D argsort is CUB's radix sort, which is stable). A radix sort orders by bits, so -0.0 and +0.0 would not tie
    as they do in comparisons (numpy, the kernel): v + 0.0 turns every -0.0 into +0.0 first."""
    if xp is np:
        return np.argsort(-v, kind="stable")
    return xp.argsort(-(v + v.dtype.type(0)))


class DeviceSampler:
    """strata.sampling.sampler.Sampler's sampling on the device the logits live on (CuPy array on a GPU, or numpy).

    Same chain and formulas as Sampler (llama.cpp src/llama-sampling.cpp order): logit_bias (each listed token's bias
    added to its float32 logit, on the logits' device), penalties (repeat_penalty divides
    positive / multiplies non-positive logits of tokens seen in the last repeat_last_n accepted tokens, then
    logit -= count * frequency_penalty + presence_penalty; float32) -> top-k -> top-p (smallest best-first prefix
    whose softmax mass, over the top-k set or the whole vocabulary when top-k is off, reaches top_p; float64) ->
    min-p (keep logit >= max + log(min_p), float32) -> temperature (logit / T, float32) -> draw from the softmax
    of what is left (float64 cumulative sum, u * total, first index whose cumulative sum exceeds it).
    temperature == 0 is greedy: argmax of the penalized logits, ties -> lowest id. Ties in the sort order are
    broken by lower id, as Sampler does.

    Differences from Sampler: the draw is the counter-based uniform(seed, step) of this module (step = the number
    of temperature > 0 draws this sampler has made before), not numpy's PCG64 stream, so a seed gives one token
    sequence per sampler kind, the same for numpy and CuPy logits, but not Sampler's sequence. seed None or -1:
    a fresh 64-bit seed from os.urandom. SampleResult.logprob is NaN unless params.logprobs is set (it costs a
    full-vocabulary reduction); with logprobs, logprob and top_logprobs are Sampler's (natural log-softmax of the
    unmodified logits, best first, ties by lower id).

    A request with logit_bias is sampled by the array path (the strata_sample kernel knows no bias) and its greedy
    verify rows are judged on the host (``greedy_rows_ok`` is False).

    Only a few bytes cross to the host per call: the token id (and its logprob / top-n when asked). Work runs on
    CuPy's current stream of the calling thread, on the logits' device. The array module follows the logits
    passed to each sample() (numpy for the prompt's host logits, CuPy afterwards); the penalty counts (float32
    (n_vocab,)) live in that module and are rebuilt from the host-side history once when it changes.

    Raises ValueError for bad params / n_vocab or logits of the wrong shape, NonFiniteLogits for NaN logits
    (nothing changes then).
    """

    def __init__(self, params: SamplingParams, n_vocab: int):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(n_vocab, bool) or not isinstance(n_vocab, (int, np.integer)) or n_vocab <= 0:
            raise ValueError(f"n_vocab must be an integer > 0, got {n_vocab!r}")
        self.params = params
        self.n_vocab = int(n_vocab)
        seed = params.seed
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None or seed == -1 else int(seed)
        self.step = 0
        p = params
        self.penalize = p.penalties
        self._history: deque[int] = deque(maxlen=None if p.repeat_last_n == -1 else p.repeat_last_n)
        self._counts = None          # float32 (n_vocab,) in self._xp: occurrences in the history window
        self._xp = None
        self._bias = bias_arrays(p.logit_bias, self.n_vocab) if p.logit_bias else None   # (ids, biases) on the host
        self._bias_dev = None        # (xp, ids, biases) in the module of the last logits biased
        self._out = None             # int32 (2,) on the device: strata_sample's {token, status}
        self.kernel_calls = 0        # samples drawn by the strata_sample kernel
        self.fallbacks = 0           # kernel calls whose candidates did not fit (the array path sampled)

    # ---- penalty history
    def accept(self, token_id: int) -> None:
        """Record a token in the penalty history (a device update only when penalties are on)."""
        if self.params.repeat_last_n == 0:
            return
        t = int(token_id)
        h = self._history
        old = h[0] if h.maxlen is not None and len(h) == h.maxlen else None
        h.append(t)
        if self._counts is not None:
            if old is not None and 0 <= old < self.n_vocab:
                self._counts[old] -= 1
            if 0 <= t < self.n_vocab:
                self._counts[t] += 1

    def reset(self) -> None:
        """Clear the penalty history (the RNG step keeps counting)."""
        self._history.clear()
        if self._counts is not None:
            self._counts[...] = 0

    def _counts_in(self, xp):
        if self._xp is not xp or self._counts is None:
            h = np.fromiter((t for t in self._history if 0 <= t < self.n_vocab), dtype=np.int64)
            self._counts = xp.asarray(np.bincount(h, minlength=self.n_vocab).astype(np.float32))
            self._xp = xp
        return self._counts

    def _biased(self, xp, x):
        """x (float32, in xp) with logit_bias added: a new array; x itself when there is no bias."""
        if self._bias is None:
            return x
        if self._bias_dev is None or self._bias_dev[0] is not xp:
            self._bias_dev = (xp, xp.asarray(self._bias[0]), xp.asarray(self._bias[1]))
        _, ids, b = self._bias_dev
        x = x.copy()
        x[ids] += b          # ids distinct (SamplingParams): one add each
        return x

    def apply_penalties(self, logits):
        """Biased (logit_bias), then penalized float32 copy of logits (same module as the input); the input is
        unchanged."""
        xp = array_module(logits)
        x = self._biased(xp, xp.asarray(logits, dtype=xp.float32))
        if not self.penalize or not self._history:
            return x.copy()
        p = self.params
        c = self._counts_in(xp)
        rp = np.float32(p.repeat_penalty)
        v = xp.where(x <= 0, x * rp, x / rp)
        v = v - (c * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
        return xp.where(c > 0, v, x).astype(xp.float32)

    # ---- sampling
    def sample(self, logits) -> SampleResult:
        """Pick the next token from logits float32 (n_vocab,) (numpy or CuPy). Does not call accept()."""
        xp = array_module(logits)
        if getattr(logits, "ndim", None) != 1 or logits.shape[0] != self.n_vocab:
            raise ValueError(f"logits must have shape ({self.n_vocab},), got {getattr(logits, 'shape', None)}")
        if xp is np:
            return self._sample(np, logits)
        with xp.cuda.Device(logits.device.id):
            return self._sample(xp, logits)

    def _kernel_sample(self, xp, x0) -> int | None:
        """One strata_sample launch on the current stream -> token id, or None when the kernel is unavailable or
        its candidate buffer cannot hold the chain (the array path then samples). Raises NonFiniteLogits for NaN."""
        k = sample_kernel()
        if k is None:
            return None
        ffi, lib = k
        p = self.params
        if self._out is None or self._out.device.id != x0.device.id:
            self._out = xp.zeros(2, dtype=xp.int32)
        x0 = xp.ascontiguousarray(x0)
        counts = self._counts_in(xp) if self.penalize and self._history else None
        rc = lib.strata_sample(ffi.cast("void *", xp.cuda.get_current_stream().ptr), ffi.cast("float *", x0.data.ptr),
                               ffi.NULL if counts is None else ffi.cast("float *", counts.data.ptr), self.n_vocab,
                               p.repeat_penalty, p.frequency_penalty, p.presence_penalty, p.temperature,
                               min(p.top_k, self.n_vocab),
                               p.top_p, p.min_p, math.log(p.min_p) if p.min_p > 0 else 0.0,
                               uniform(self.seed, self.step), ffi.cast("int *", self._out.data.ptr))
        if rc != 0:
            raise RuntimeError(f"strata_sample failed: CUDA error {rc}")
        tok, status = self._out.get().tolist()                     # the one device -> host copy (8 bytes)
        if status == 1:
            raise NonFiniteLogits()
        if status != 0:
            self.fallbacks += 1
            return None
        self.kernel_calls += 1
        return int(tok)

    def _sample(self, xp, logits) -> SampleResult:
        p = self.params
        x0 = xp.asarray(logits, dtype=xp.float32)
        if xp is not np and p.logprobs is None and self._bias is None:
            tok = self._kernel_sample(xp, x0)
            if tok is not None:
                if p.temperature != 0:
                    self.step += 1
                return SampleResult(tok, float("nan"), None)
        x = self.apply_penalties(x0)
        n = self.n_vocab
        if p.temperature == 0:
            tok_d = _greedy_pick(xp, x)
            bad_d = xp.isnan(x0).any()
        else:
            tok_d, bad_d = self._draw(xp, x, n)
        vals = [tok_d.astype(xp.float64), bad_d.astype(xp.float64)]
        want = p.logprobs
        if want is not None:
            x64 = x0.astype(xp.float64)
            m = x64.max()
            lse = m + xp.log(xp.exp(x64 - m).sum())
            vals.append(xp.take(x64, tok_d) - lse)
            if want > 0:
                top = _argsort_desc(xp, x0)[:want]
                vals.extend([top.astype(xp.float64), x64[top] - lse])
        host = xp.concatenate([xp.reshape(v, (-1,)) for v in vals]).tolist()      # the one device -> host copy
        if host[1] != 0:
            raise NonFiniteLogits()
        if p.temperature != 0:
            self.step += 1
        tok = int(host[0])
        if want is None:
            return SampleResult(tok, float("nan"), None)
        k = (len(host) - 3) // 2
        top = [(int(i), float(v)) for i, v in zip(host[3:3 + k], host[3 + k:])] if want > 0 else []
        return SampleResult(tok, float(host[2]), top)

    @property
    def greedy_rows_ok(self) -> bool:
        """Whether ``greedy_rows`` picks what ``sample`` would for each row on its own: greedy, no penalties (a
        row's penalties would depend on the tokens picked before it), no logprobs, no logit_bias."""
        return self.params.greedy and not self.penalize and self.params.logprobs is None and self._bias is None

    def greedy_rows(self, rows) -> list[int]:
        """The greedy pick of every row of rows float32 (n, n_vocab) (numpy or CuPy): sample()'s argmax (ties ->
        lowest id), taken on the rows' device (``greedy_picks``). For a sampler with
        ``greedy_rows_ok`` (ValueError otherwise, or for rows of the wrong shape); NonFiniteLogits when any row
        holds a NaN. Does not call accept()."""
        if not self.greedy_rows_ok:
            raise ValueError("greedy_rows needs a greedy sampler without penalties or logprobs")
        if getattr(rows, "ndim", None) != 2 or rows.shape[1] != self.n_vocab or rows.shape[0] < 1:
            raise ValueError(f"rows must have shape (n, {self.n_vocab}), got {getattr(rows, 'shape', None)}")
        picks = greedy_picks(rows)
        if None in picks:
            raise NonFiniteLogits()
        return picks

    def candidates(self, logits):
        """The candidate set after the chain, on the host: (ids int64 best first, probabilities float64 summing
        to 1) -- what sample() draws from (temperature 0: the argmax with probability 1). For tests and tracing."""
        xp = array_module(logits)
        x = self.apply_penalties(logits)
        if self.params.temperature == 0:
            return np.array([int(xp.argmax(x))], dtype=np.int64), np.ones(1)
        ids, w, _, _ = self._chain(xp, x, self.n_vocab)
        ids, w = _host(ids), _host(w)
        keep = w > 0
        return ids[keep].astype(np.int64), w[keep] / w[keep].sum()

    def _draw(self, xp, x, n):
        """temperature > 0: (token id, any-NaN flag) as 0-d device arrays."""
        ids, w, n_keep, bad = self._chain(xp, x, n)
        cum = xp.cumsum(w)
        u = uniform(self.seed, self.step)
        j = xp.minimum((cum <= cum[-1] * u).sum(), n_keep - 1)          # searchsorted(cum, u * total, "right")
        return ids[j], bad

    def _chain(self, xp, x, n):
        """top-k -> top-p -> min-p -> temperature on penalized x -> (ids best first, float64 weights
        exp(logit/T - max) with 0 for dropped ids, number kept (a prefix), any-NaN flag), all on the device."""
        p = self.params
        k = p.top_k if 0 < p.top_k < n else n
        mx = x.max()
        bad = xp.isnan(mx)
        thr = ids = total = None
        if p.min_p > 0.0:
            thr = (mx + np.float32(math.log(p.min_p))).astype(xp.float32)
            # only tokens >= thr survive min-p: sort just those, when they also decide top-p's normalization
            # (top-k off: the whole-vocabulary mass is a reduction; top-k on: they hold the whole top-k set)
            cand = xp.nonzero(x >= thr)[0]                                       # ids ascending
            c = int(cand.shape[0])
            if c > 0 and (p.top_p >= 1.0 or k == n or c >= k):
                ids = cand[_argsort_desc(xp, x[cand])][:k]
                lg = x[ids]
                if p.top_p < 1.0 and k == n:
                    total = xp.exp((x - mx).astype(xp.float64)).sum()
        if ids is None and xp is np and k < n:
            # numpy: the top-k set by partition (the k-th largest value v; ties at v by lower id), then sort it
            v = np.partition(x, n - k)[n - k]
            gt = np.nonzero(x > v)[0]
            cand = np.sort(np.concatenate([gt, np.nonzero(x == v)[0][:k - gt.shape[0]]]))
            if cand.shape[0] == k:                                          # else NaN: the full sort below
                ids = cand[_argsort_desc(np, x[cand])]
                lg = x[ids]
        if ids is None:
            ids = _argsort_desc(xp, x)[:k]
            lg = x[ids]
        s = int(ids.shape[0])
        idx = xp.arange(s)
        keep = xp.ones(s, dtype=bool)
        if p.top_p < 1.0:
            e = xp.exp((lg - lg[0]).astype(xp.float64))
            cum = xp.cumsum(e / (e.sum() if total is None else total))
            last = (cum < p.top_p).sum() + 1                      # searchsorted(cum, top_p, "left") + 1
            keep &= idx < last
        if thr is not None:
            keep &= (lg >= thr) | (idx == 0)
        lt = (lg / np.float32(p.temperature)).astype(xp.float32)
        return ids, xp.where(keep, xp.exp((lt - lt[0]).astype(xp.float64)), 0.0), keep.sum(), bad


def greedy_picks(rows) -> list[int | None]:
    """The greedy pick of each row of rows float32 (n, n_vocab) (numpy or CuPy): its argmax (ties -> lowest id), None
    for a row holding a NaN; taken on the rows' device, the n picks and NaN flags copied to the host at once."""
    xp = array_module(rows)
    if xp is not np:
        with xp.cuda.Device(rows.device.id):
            return _picks(xp, rows)
    return _picks(np, rows)


def _picks(xp, rows) -> list[int | None]:
    x = xp.asarray(rows, dtype=xp.float32)
    if xp is np:        # numpy's argmax stops at a row's first NaN, so a NaN anywhere is that row's pick
        picks = _greedy_pick(np, x)
        bad = np.isnan(x[np.arange(x.shape[0]), picks])
        return [None if b else int(t) for t, b in zip(picks.tolist(), bad.tolist())]
    both = xp.stack([_greedy_pick(xp, x).astype(xp.int64), xp.isnan(x).any(axis=-1).astype(xp.int64)])
    picks, bad = both.tolist()                                              # the one device -> host copy
    return [None if b else int(t) for t, b in zip(picks, bad)]


def _greedy_pick(xp, x):
    """The greedy pick of the last axis of x (a row, or rows): argmax, ties -> the lowest id (numpy's and CuPy's
    argmax both return the first maximum), as device arrays."""
    return xp.argmax(x, axis=-1)


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()
