"""Token sampling (SamplingParams; Sampler: logit bias, greedy, penalties, top-k/p, min-p, temperature, seed), StopMatcher."""
from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from strata.errors import EngineFault


class NonFiniteLogits(EngineFault):
    """The model's logits hold NaN: a numerical fault of the engine (HTTP 500, code engine_error), not of the
    request."""

    def __init__(self):
        super().__init__("the model's logits contain NaN (a numerical fault of the model or its weights, not of "
                         "the request)")


def _real(name, v):
    if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(float(v)):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _int(name, v):
    if isinstance(v, bool) or not isinstance(v, Integral):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


#: the largest |bias| of logit_bias (OpenAI's range, [-100, 100]); -inf (llama-server's `false`) bans a token
MAX_BIAS = 100.0
#: the most entries one logit_bias may hold
MAX_BIAS_ENTRIES = 1024


class BiasRefused(ValueError):
    """A logit_bias rule broken. entry: the index of the pair it concerns (None: the bias as a whole); part: 0 (the
    token id) or 1 (the bias) of that pair; problem: what is wrong, the words that follow the field's name. str()
    names the field by the pairs' positions (logit_bias[entry][part]); a reader of another form names it its way."""

    def __init__(self, problem: str, entry: int | None = None, part: int | None = None):
        self.problem, self.entry, self.part = problem, entry, part
        at = "" if entry is None else f"[{entry}]" + ("" if part is None else f"[{part}]")
        super().__init__(f"logit_bias{at} {problem}")


def _shown(v) -> str:
    """A value as a refusal quotes it: a number written short (an integer past 64 bits by its size), else its type."""
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, Integral):
        return str(int(v)) if abs(int(v)).bit_length() <= 64 else f"an integer of {abs(int(v)).bit_length()} bits"
    if isinstance(v, Real):
        return f"{float(v):g}"
    return {str: "a string", list: "an array", tuple: "an array", dict: "an object", type(None): "null"}.get(
        type(v), type(v).__name__)


def check_logit_bias(pairs) -> tuple[tuple[int, float], ...]:
    """pairs (an iterable of (token id, bias)) as SamplingParams keeps them: a tuple sorted by id; BiasRefused
    naming the first broken rule (more than MAX_BIAS_ENTRIES entries, an id that is not an integer >= 0, a bias
    that is not a number in [-MAX_BIAS, MAX_BIAS] or -inf, an id given twice). The one copy of these rules: a
    request reader turns its form into pairs and names the field from the refusal's entry and part."""
    items = pairs if isinstance(pairs, (list, tuple)) else list(pairs)
    if len(items) > MAX_BIAS_ENTRIES:
        raise BiasRefused(f"has {len(items)} entries, at most {MAX_BIAS_ENTRIES} are allowed")
    out = []
    for j, pair in enumerate(items):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise BiasRefused("must be a (token id, bias) pair", j)
        tok, b = pair
        if isinstance(tok, bool) or not isinstance(tok, Integral) or tok < 0:
            raise BiasRefused(f"must be an integer >= 0 (a token id), got {_shown(tok)}", j, 0)
        if isinstance(b, bool) or not isinstance(b, Real) or b != b:       # b != b: NaN (float() overflows a huge int)
            raise BiasRefused(f"must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}] (or -inf, false in JSON, to ban "
                              f"the token), got {_shown(b)}", j, 1)
        if not (-MAX_BIAS <= b <= MAX_BIAS or b == -math.inf):       # compared before float(): a huge int overflows it
            raise BiasRefused(f"must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}] (or -inf, false in JSON, to ban the token), "
                              f"got {_shown(b)}", j, 1)
        out.append((int(tok), float(b)))
    out.sort()
    for (a, _), (b, _) in zip(out, out[1:]):
        if a == b:
            raise BiasRefused(f"names token {a} twice")
    return tuple(out)


def bias_arrays(pairs: tuple[tuple[int, float], ...], n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """logit_bias pairs as (ids int64, biases float32), ids past n_vocab left out."""
    keep = [(t, b) for t, b in pairs if t < n_vocab]
    return (np.array([t for t, _ in keep], dtype=np.int64), np.array([b for _, b in keep], dtype=np.float32))


#: the smallest temperature that is not greedy: logits (|x| < 1e8) divided by it stay finite in float32
MIN_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (llama.cpp's names and defaults; OpenAI's presence/frequency penalties).

    temperature: >= 0; 0 = greedy (argmax after penalties), and so is one below MIN_TEMPERATURE, its limit (logit / T
    would overflow float32 to inf and the softmax to NaN).    top_k: >= 0; 0 = off.
    top_p: in (0, 1]; 1 = off.                                     min_p: in [0, 1]; 0 = off.
    repeat_penalty: > 0; 1 = off.  presence_penalty, frequency_penalty: in [-2, 2]; 0 = off.
    repeat_last_n: tokens of history the penalties look at; 0 = none, -1 = all.
    seed: None or -1 = fresh entropy, otherwise an int >= 0 (same seed, same logits -> same tokens).
    logprobs: None, or how many top log-probabilities to return per token (0..20).
    logit_bias: (token id, bias) pairs, ids ascending and distinct, each bias in [-MAX_BIAS, MAX_BIAS] or -inf (the
    token never chosen); added to the logits before everything else (llama.cpp's chain puts its logit-bias sampler
    first). The ids are checked against the vocabulary where the vocabulary is known (the engine's request check;
    Sampler ignores an id past its n_vocab).
    Raises ValueError (one line naming the field) for a bad value.
    """
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        t = _real("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if 0 < t < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if _int("top_k", self.top_k) < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        p = _real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        m = _real("min_p", self.min_p)
        if not 0 <= m <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if _real("repeat_penalty", self.repeat_penalty) <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _real(name, getattr(self, name))
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if _int("repeat_last_n", self.repeat_last_n) < -1:
            raise ValueError(f"repeat_last_n must be >= -1, got {self.repeat_last_n!r}")
        if self.seed is not None:
            s = _int("seed", self.seed)
            if s < -1 or s >= 2**64:
                raise ValueError(f"seed must be -1 or in [0, 2**64), got {self.seed!r}")
        if self.logprobs is not None:
            n = _int("logprobs", self.logprobs)
            if not 0 <= n <= 20:
                raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties(self) -> bool:
        """Whether a repeat, frequency or presence penalty is set (each at its 'off' value: False)."""
        return not (self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0)


@dataclass
class SampleResult:
    """One sampled token: its id, its log-probability (NaN unless the sampler's params.logprobs is set) and (if
    asked) the top log-probabilities.

    Log-probabilities are natural logs of the softmax of the model's unmodified logits (before penalties,
    truncation and temperature), as OpenAI reports them. top_logprobs: [(token_id, logprob)], best first.
    """
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax of a 1-D array."""
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + math.log(np.exp(x - m).sum()))


class Sampler:
    """Samples token ids from float32 logits (n_vocab,) with llama.cpp's chain order:
    penalties -> top-k -> top-p -> min-p -> temperature -> draw (llama.cpp src/llama-sampling.cpp;
    common/sampling.cpp's default order without DRY/typical/XTC). temperature == 0 is greedy: argmax of the
    penalized logits (ties -> lowest id).

    logit_bias (llama_sampler_logit_bias_apply) first: each listed token's bias added to its logit (-inf: never
    chosen). Penalties (llama_sampler_penalties_apply), for each token seen c > 0 times in the last repeat_last_n
    accepted tokens: logit = logit * repeat_penalty if logit <= 0 else logit / repeat_penalty; then
    logit -= c * frequency_penalty + presence_penalty.
    The draw uses numpy's PCG64 Generator seeded with params.seed, so one seed gives one token sequence.
    Call accept(token) for every token that should count for the penalties (generated ones; the engine
    decides whether prompt tokens count).
    """

    def __init__(self, params: SamplingParams, n_vocab: int):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if _int("n_vocab", n_vocab) <= 0:
            raise ValueError(f"n_vocab must be > 0, got {n_vocab!r}")
        self.params = params
        self.n_vocab = int(n_vocab)
        seed = params.seed
        self._rng = np.random.Generator(np.random.PCG64(None if seed is None or seed == -1 else seed))
        maxlen = None if params.repeat_last_n == -1 else params.repeat_last_n
        self._history: deque[int] = deque(maxlen=maxlen)
        self._bias = bias_arrays(params.logit_bias, self.n_vocab) if params.logit_bias else None

    def accept(self, token_id: int) -> None:
        """Record a token in the penalty history."""
        if self.params.repeat_last_n != 0:
            self._history.append(int(token_id))

    def reset(self) -> None:
        """Clear the penalty history (the RNG keeps its state)."""
        self._history.clear()

    def apply_penalties(self, logits: np.ndarray) -> np.ndarray:
        """Biased (logit_bias), then penalized copy of logits (float32); the input is unchanged."""
        p = self.params
        out = np.array(logits, dtype=np.float32, copy=True)
        if self._bias is not None:
            ids, b = self._bias
            out[ids] += b
        if not self.penalizing:
            return out
        counts = Counter(self._history)
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        c = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        ids_ok = (ids >= 0) & (ids < out.shape[0])
        ids, c = ids[ids_ok], c[ids_ok]
        v = out[ids]
        v = np.where(v <= 0, v * np.float32(p.repeat_penalty), v / np.float32(p.repeat_penalty))
        v = v - (c * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
        out[ids] = v.astype(np.float32)
        return out

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The penalized, truncated candidate set: (ids int64, logits float32 after temperature), best first.

        For temperature 0 this is the single argmax token.
        """
        p = self.params
        x = self.apply_penalties(logits)
        if p.temperature == 0:
            i = int(np.argmax(x))
            return np.array([i], dtype=np.int64), x[[i]]
        n = x.shape[0]
        k = p.top_k if 0 < p.top_k < n else n
        total = None  # sum of exp(logit - max) over the top-k set, when ids below is a subset of it
        if k < n:
            ids = np.argpartition(-x, k - 1)[:k]
        elif (p.top_p < 1.0 or p.min_p > 0.0) and n > 2048:
            # shortcut (same result): when the best 1024 already decide top-p / min-p, skip sorting the rest
            part = np.argpartition(-x, 1023)[:1024]
            mx = float(x[part].max())
            total = float(np.exp((x - mx).astype(np.float64)).sum())
            mass = float(np.exp((x[part] - mx).astype(np.float64)).sum()) / total
            if (p.top_p < 1.0 and mass >= p.top_p) or (
                    p.min_p > 0.0 and float(x[part].min()) < mx + math.log(p.min_p)):
                ids = part
            else:
                ids, total = np.arange(n), None
        else:
            ids = np.arange(n)
        # stable order: logit descending, then id ascending
        order = np.lexsort((ids, -x[ids]))
        ids = ids[order]
        lg = x[ids]
        if p.top_p < 1.0:
            e = np.exp((lg - lg[0]).astype(np.float64))
            cum = np.cumsum(e / (e.sum() if total is None else total))
            last = int(np.searchsorted(cum, p.top_p, side="left")) + 1
            ids, lg = ids[:last], lg[:last]
        if p.min_p > 0.0:
            keep = lg >= lg[0] + np.float32(math.log(p.min_p))
            keep[0] = True
            ids, lg = ids[keep], lg[keep]
        return ids, (lg / np.float32(p.temperature)).astype(np.float32)

    def sample(self, logits: np.ndarray) -> SampleResult:
        """Pick the next token from logits float32 (n_vocab,). Does not call accept().

        Raises ValueError for logits of the wrong shape, NonFiniteLogits for logits with NaN.
        """
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.shape[0] != self.n_vocab:
            raise ValueError(f"logits must have shape ({self.n_vocab},), got {logits.shape}")
        if self.plain_greedy and logits.dtype == np.float32:
            # the argmax of the logits as they are (what candidates' copy would hold): one pass, no copies; argmax
            # stops at the first NaN, so a NaN anywhere is the pick's
            tok = int(np.argmax(logits))
            if math.isnan(logits[tok]):
                raise NonFiniteLogits()
            return self.result(logits, tok)
        if np.isnan(logits).any():
            raise NonFiniteLogits()
        ids, lg = self.candidates(logits)
        if ids.shape[0] == 1:
            tok = int(ids[0])
        else:
            e = np.exp((lg - lg.max()).astype(np.float64))
            tok = self.draw(ids, e)
        return self.result(logits, tok)

    def draw(self, ids: np.ndarray, weights: np.ndarray) -> int:
        """One id of `ids` drawn in proportion to `weights` (float64, not all 0) from this sampler's RNG stream."""
        cum = np.cumsum(weights)
        u = self._rng.random() * cum[-1]
        j = min(int(np.searchsorted(cum, u, side="right")), ids.shape[0] - 1)
        return int(ids[j])

    def uniform(self) -> float:
        """A uniform draw in [0, 1) from this sampler's RNG stream."""
        return float(self._rng.random())

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What sample() draws from: (candidate ids, their float64 probabilities), best first."""
        ids, lg = self.candidates(logits)
        e = np.exp((lg - lg.max()).astype(np.float64))
        return ids, e / e.sum()

    @property
    def penalizing(self) -> bool:
        """Whether a penalty is in effect: a history to penalize and a penalty set (SamplingParams.penalties)."""
        return bool(self._history) and self.params.penalties

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first: no logit_bias, no penalty in effect."""
        return self.params.temperature == 0 and self._bias is None and not self.penalizing

    @property
    def greedy_rows_ok(self) -> bool:
        """Whether ``sample`` picks the argmax of a row holding no NaN, with no log-probabilities to report (plain
        greedy, no logprobs): a batched step's rows may then be picked together (``device.greedy_picks``)."""
        return self.plain_greedy and self.params.logprobs is None

    def result(self, logits: np.ndarray, tok: int) -> SampleResult:
        """The SampleResult of choosing `tok` at logits: with params.logprobs set, its log-probability and the asked
        top log-probabilities; without, logprob NaN (a full-vocabulary float64 softmax per token, which nothing
        reads: DeviceSampler's contract too)."""
        if self.params.logprobs is None:
            return SampleResult(tok, float("nan"), None)
        ls = log_softmax(logits)
        n = self.params.logprobs
        top = []
        if n > 0:
            cand = np.argpartition(-ls, n - 1)[:n] if n < ls.shape[0] else np.arange(ls.shape[0])
            cand = cand[np.lexsort((cand, -ls[cand]))]
            top = [(int(i), float(ls[i])) for i in cand]
        return SampleResult(tok, float(ls[tok]), top)


class StopMatcher:
    """Finds stop strings in streamed text, also when one spans several pieces.

    feed(piece) -> (text safe to emit now, stopped). Text that could be the start of a stop string is held
    back until it is resolved; the output is the whole text up to its earliest stop string, so a match is only
    taken when no unfinished stop string starts before it (stops "<" and "><<" on "><" then "<": "" and "><<",
    not ">" and "<"). On a match stopped=True and the stop string itself is never emitted. flush() returns what
    is held back at the end, cut at a stop string it holds (setting ``stopped``).
    Raises ValueError if a stop is not a string.
    """

    def __init__(self, stops: list[str] | tuple[str, ...] | None):
        stops = list(stops or [])
        for s in stops:
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be str, got {type(s).__name__}")
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._buf = ""
        self.stopped = False
        self.matched: str | None = None

    def _earliest(self, buf: str) -> tuple[int, str | None]:
        """(index, stop) of the earliest full stop string in buf (first listed on a tie), or (-1, None)."""
        best, match = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, match = i, s
        return best, match

    def _pending(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string (it may still become one)."""
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _stop(self, text: str, match: str | None) -> str:
        self.stopped, self.matched, self._buf = True, match, ""
        return text

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._buf + piece
        best, match = self._earliest(buf)
        pending = len(buf) - self._pending(buf)      # where the earliest still-possible stop starts
        if best >= 0 and best <= pending:            # no unfinished stop starts before this match
            return self._stop(buf[:best], match), True
        # hold from the earliest unfinished stop (a full match after it is decided once that one is)
        self._buf = buf[pending:]
        return buf[:pending], False

    def flush(self) -> str:
        """The held-back text, cut at the earliest stop string it holds (then ``stopped`` is set), when generation
        ends."""
        if self.stopped:
            return ""
        buf, self._buf = self._buf, ""
        best, match = self._earliest(buf)
        return self._stop(buf[:best], match) if best >= 0 else buf
