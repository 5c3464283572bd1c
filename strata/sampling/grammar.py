"""Constrained decoding: JSON schemas, Lark and GBNF grammars compiled with llguidance into token masks on the logits."""
from __future__ import annotations

import json
import re
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from strata.errors import Refused
from strata.text.tokenizer import Tokenizer

# JSON the grammar writes: no free whitespace (a model with random weights would fill max_tokens with it), the
# separators json.dumps uses
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 1 << 20


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot use (the one-line message names the problem)."""


def _llg():
    try:
        import llguidance
    except ImportError:                              # pragma: no cover -- llguidance is an install requirement
        raise GrammarError("constrained decoding needs the llguidance package (pip install llguidance)") from None
    return llguidance


# ---- grammar texts -----------------------------------------------------------------------------------------------

def lark_json(schema) -> str:
    """An inline `%json {...}` rule of llguidance's Lark for a JSON schema (a list: any of them), written with
    JSON_OPTIONS; keywords llguidance does not implement are ignored unless the schema's x-guidance says
    lenient: false."""
    if isinstance(schema, list):
        schema = {"anyOf": schema} if len(schema) != 1 else schema[0]
    s = dict(schema)
    s["x-guidance"] = {**JSON_OPTIONS, "lenient": True, **(s.get("x-guidance") or {})}
    return "%json " + json.dumps(s, ensure_ascii=False)


def json_schema_grammar(schema: Any, *, strict: bool = True) -> str:
    """The llguidance grammar of a JSON schema (an object; True / {} mean any JSON value). strict: keywords
    llguidance does not implement are an error; otherwise they are ignored (OpenAI's non-strict mode)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    s = dict(schema)
    s["x-guidance"] = {**(s.get("x-guidance") or {}), "lenient": not strict}
    return lark_grammar("start: " + lark_json(s))


def lark_grammar(text: str) -> str:
    """The llguidance grammar of a Lark grammar (llguidance's dialect, which may inline `%json {...}` schemas)."""
    return _llg().LLMatcher.grammar_from_lark(_text(text))


def gbnf_grammar(text: str) -> str:
    """The llguidance grammar of a llama.cpp GBNF grammar (or of a Lark one: llama-server's `grammar` field takes
    both, a Lark one starting with %llguidance)."""
    try:
        return _llg().grammar_from("grammar", _text(text))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid grammar: {_one_line(e)}") from None


def _text(text) -> str:
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("a grammar must be a non-empty string")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar has {len(text)} characters, at most {MAX_GRAMMAR_CHARS} are allowed")
    return text


def _grammar_message(err: str) -> str:
    """llguidance's compile error in one line, without the grammar text it quotes: "invalid JSON schema: Invalid
    type: foo", "invalid grammar: ..."."""
    msg = " ".join(str(err).split())
    msg = re.split(r" \d+ \| ", msg, maxsplit=1)[0]
    msg = re.sub(r"^at \d+\(\d+\): ", "", msg)
    m = re.match(r"failed to compile JSON schema: (.*)", msg)
    return f"invalid JSON schema: {m.group(1)}" if m else f"invalid grammar: {msg}"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ---- the vocabulary as llguidance sees it ------------------------------------------------------------------------

class _Wrapper:
    """What llguidance.TokenizerWrapper reads off a tokenizer: each token's bytes, the special ids, an encoder."""

    def __init__(self, tk: Tokenizer):
        self.eos_token_id = tk.eos_id
        self.bos_token_id = tk.bos_id
        self.tokens = [tk.token_bytes(i) for i in range(tk.n_vocab)]
        # control tokens (<|im_end|>, <|python_tag|>) never match grammar text; a grammar names them as <[id]>
        self.special_token_ids = [i for i in range(tk.n_vocab) if tk.is_control(i)]
        self._tk = tk

    def __call__(self, s) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self._tk.encode(s, add_bos=False)


_VOCABS: "weakref.WeakKeyDictionary[Tokenizer, dict[int, Any]]" = weakref.WeakKeyDictionary()
_VOCAB_LOCK = threading.Lock()


def vocabulary(tk: Tokenizer, n_vocab: int | None = None):
    """llguidance's LLTokenizer for a Strata tokenizer (built once per tokenizer and size, ~0.1 s at 49K tokens),
    padded to the model's n_vocab (logit rows past the tokenizer are never allowed); the end-of-generation tokens
    are its EOS set."""
    n = int(n_vocab or tk.n_vocab)
    with _VOCAB_LOCK:
        per = _VOCABS.setdefault(tk, {})
        if n not in per:
            llg = _llg()
            per[n] = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapper(tk)), n_vocab=n, eos_token=sorted(tk.eog_ids))
        return per[n]


# ---- a compiled constraint and one generation's walk through it ---------------------------------------------------

class Constraint:
    """A grammar compiled against a vocabulary: check it once (GrammarError naming the problem), then start() the
    generation's TokenGuide. grammar: the llguidance grammar text (json_schema_grammar, lark_grammar, gbnf_grammar).
    Compiling runs the grammar's lexer over the token trie (milliseconds; llguidance releases the GIL)."""

    def __init__(self, grammar: str, tk: Tokenizer, n_vocab: int | None = None):
        llg = _llg()
        self.vocab = vocabulary(tk, n_vocab)
        self.n_vocab = int(n_vocab or tk.n_vocab)
        self.grammar = grammar
        m = llg.LLMatcher(self.vocab, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(_grammar_message(m.get_error()))
        if not m.is_accepting():      # a grammar nothing can start (a schema that only refers to itself) stops here
            first = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
            m.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
            if m.is_error():
                raise GrammarError("invalid grammar: no text matches it (nothing can start it: a JSON schema that "
                                   "only refers to itself, say)")
        self._matcher = m
        self._started = False
        self.last: TokenGuide | None = None          # the latest start()'s guide (its timings, for benchmarks)
        self.overlap: bool | None = None             # None: as start() is asked; True / False: always (benchmarks)

    def start(self, overlap: bool = True, banned=()) -> "TokenGuide":
        """A fresh walk from the grammar's start (the first one takes the compiled matcher, later ones a copy).
        overlap: compute each next mask during the forward (the engine: on the CPU backend, not with device logits);
        self.overlap, when set, decides instead. banned: the token ids the request's logit_bias bans (-inf)."""
        m = self._matcher if not self._started else self._matcher_copy()
        self._started = True
        self.last = TokenGuide(m, self.n_vocab, self.vocab.eos_tokens,
                               overlap=overlap if self.overlap is None else self.overlap, banned=banned)
        return self.last

    def _matcher_copy(self):
        m = self._matcher.deep_copy()
        m.reset()
        return m


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-grammar")
    return _POOL


class TokenGuide:
    """One generation under a constraint: apply(logits) masks the tokens the grammar does not allow next (-inf),
    accept(token) moves on. With overlap, accept() starts the next mask on a helper thread (llguidance releases
    the GIL) so that it is computed while the model runs its next forward; apply() waits for it.

    When the grammar is complete only the end-of-generation tokens are allowed, so the answer ends there. A matcher
    that fails (a token it did not allow; cannot happen through apply) allows only those tokens too.

    banned: token ids the request bans (logit_bias -inf). A next-token mask that allows only banned tokens leaves
    nothing to sample: mask() raises Refused naming logit_bias (not a token outside the grammar, nor a false stop).
    """

    def __init__(self, matcher, n_vocab: int, eos: list[int], *, overlap: bool = True, banned=()):
        self.m = matcher
        self.n_vocab = int(n_vocab)
        self.eos = [int(t) for t in eos if 0 <= int(t) < n_vocab]
        self.words = (self.n_vocab + 31) // 32
        self.overlap = overlap
        self._next: Future | None = None
        self.mask_s = 0.0          # seconds spent computing masks (on whichever thread)
        self.wait_s = 0.0          # seconds the generation waited for a mask (all of mask_s without overlap)
        self.apply_s = 0.0         # seconds spent putting masks on the logits
        self.steps = 0
        self._open = None          # packed mask of the tokens not banned (None: none is)
        banned = [int(t) for t in banned if 0 <= int(t) < self.n_vocab]
        if banned:
            bits = np.unpackbits(np.full(self.words, -1, dtype=np.int32).view(np.uint8), bitorder="little")
            bits[banned] = 0
            self._open = np.packbits(bits, bitorder="little").view(np.int32)

    # -- masks
    def _compute(self) -> np.ndarray:
        t0 = time.perf_counter()
        mask = np.zeros(self.words, dtype=np.int32)
        if self.m.is_error():
            words = mask.view(np.uint32)
            for t in self.eos:
                words[t >> 5] |= np.uint32(1 << (t & 31))
        else:
            self.m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        self.mask_s += time.perf_counter() - t0
        return mask

    def mask(self) -> np.ndarray:
        """The packed mask of the next token (int32 words, bit i of word w = token 32w+i allowed)."""
        t0 = time.perf_counter()
        f, self._next = self._next, None
        m = f.result() if f is not None else self._compute()
        self.wait_s += time.perf_counter() - t0
        if self._bans_all(m):
            raise Refused("'logit_bias' bans every token the request's constraint (response_format, json_schema, "
                          "grammar or tool_choice) allows next", param="logit_bias")
        return m

    def _bans_all(self, mask: np.ndarray) -> bool:
        return self._open is not None and not (mask & self._open).any()

    def allowed(self) -> np.ndarray:
        """Boolean (n_vocab,) of the tokens allowed next (for tests and the benchmark)."""
        return np.unpackbits(self.mask().view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)

    def apply(self, logits):
        """A copy of logits (numpy, or CuPy on the logits' device) with the disallowed tokens at -inf."""
        return self.apply_mask(logits, self.mask())

    def apply_mask(self, logits, mask: np.ndarray):
        """apply() with a given packed mask (one of ``draft_masks``)."""
        t0 = time.perf_counter()
        self.steps += 1
        if isinstance(logits, np.ndarray):
            ok = np.unpackbits(mask.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)
            out = np.where(ok, logits, np.float32(-np.inf)).astype(np.float32, copy=False)
        else:
            out = _apply_device(self, logits, mask)
        self.apply_s += time.perf_counter() - t0
        return out

    # -- moving on
    def accept(self, token_id: int) -> None:
        """Record the sampled token; start computing the next mask (overlap) unless the grammar is finished."""
        self.m.consume_token(int(token_id))
        if self.overlap and not self.m.is_stopped():
            self._next = _pool().submit(self._compute)

    def draft_masks(self, drafts) -> list[np.ndarray]:
        """The masks of a speculative verify's rows: the next token's (the state now), then for each draft in
        turn that the grammar allows, the mask after it (the draft consumed); stops at the first draft it does
        not allow (or once it is complete). Returns the masks: one more than the drafts consumed, which
        ``rollback`` undoes (the drafts a verify rejects)."""
        masks = [self.mask()]
        for d in drafts:
            d = int(d)
            words = masks[-1].view(np.uint32)
            if self.m.is_stopped() or self.m.is_error() or not 0 <= d < self.n_vocab \
                    or not (int(words[d >> 5]) >> (d & 31)) & 1:
                break
            self.m.consume_token(d)
            nxt = self._compute()
            if self._bans_all(nxt):         # nothing to sample after d: left to mask() once d is the token read
                self.m.rollback(1)
                break
            masks.append(nxt)
        return masks

    def rollback(self, n: int) -> None:
        """Undo the last n tokens consumed (rejected drafts)."""
        if n > 0:
            self.m.rollback(int(n))

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more."""
        return self.m.is_stopped()

    def error(self) -> str:
        return self.m.get_error() if self.m.is_error() else ""

    def close(self) -> None:
        f, self._next = self._next, None
        if f is not None:
            f.result()


_BITS: dict = {}       # (array module, device id, n_vocab) -> (word index, bit index) of every token id, in that module


def apply_words(xp, logits, words: np.ndarray, n_vocab: int):
    """logits (xp array, (n_vocab,)) with -inf where the packed mask `words` (int32, bit i of word w = token 32w+i
    allowed) has a 0, by array operations of the logits' own module: on a GPU (CuPy) the words go up (n_vocab/8
    bytes) and each token reads its bit there; no custom kernel."""
    dev = getattr(getattr(logits, "device", None), "id", None)
    key = (xp.__name__, dev, int(n_vocab))
    if key not in _BITS:
        ids = xp.arange(n_vocab, dtype=xp.int32)
        _BITS[key] = (ids >> 5, ids & 31)
    widx, bidx = _BITS[key]
    w = xp.asarray(words)
    ok = ((w[widx] >> bidx) & 1).astype(bool)
    return xp.where(ok, logits.astype(xp.float32, copy=False), xp.float32(-np.inf))


_MASK_KERNEL: Any = None       # (ffi, lib) of strata_apply_mask once loaded, False when the library lacks it


def _mask_kernel():
    """(ffi, lib) of strata_apply_mask (native/cuda/sampling.cu), or None (no kernel library, or an older one)."""
    global _MASK_KERNEL
    if _MASK_KERNEL is None:
        try:
            from strata.backend.cuda import library
            ffi, lib = library.ffi(), library.lib()
            _ = lib.strata_apply_mask
            _MASK_KERNEL = (ffi, lib)
        except Exception:  # noqa: BLE001 -- no kernel: apply_words' array operations do the same
            _MASK_KERNEL = False
    return _MASK_KERNEL or None


def _apply_device(guide: TokenGuide, logits, mask: np.ndarray):
    """The mask on device logits: the words go up from a pinned buffer on the current stream, then one kernel
    (strata_apply_mask) writes the masked logits; apply_words' array operations where the kernel is missing."""
    import cupy as cp
    with cp.cuda.Device(logits.device.id):
        k = _mask_kernel()
        if k is None:
            return apply_words(cp, logits, mask, guide.n_vocab)
        ffi, lib = k
        words = mask.view(np.uint32)
        st = guide.__dict__.get("_staging")
        if st is None or st[0].shape != words.shape or st[1].device.id != logits.device.id:
            host = np.frombuffer(cp.cuda.alloc_pinned_memory(words.nbytes), np.uint32, words.size)
            st = guide._staging = (host, cp.empty(words.size, cp.uint32))
        host, dev = st
        host[:] = words
        stream = cp.cuda.get_current_stream()
        dev.set(host, stream=stream)
        x = cp.ascontiguousarray(logits, dtype=cp.float32)
        out = cp.empty(guide.n_vocab, cp.float32)
        rc = lib.strata_apply_mask(ffi.cast("void *", stream.ptr), ffi.cast("const float *", x.data.ptr),
                                   ffi.cast("const unsigned int *", dev.data.ptr), int(guide.n_vocab),
                                   ffi.cast("float *", out.data.ptr))
        if rc != 0:
            raise RuntimeError(f"strata_apply_mask failed (CUDA error {rc})")
        return out
