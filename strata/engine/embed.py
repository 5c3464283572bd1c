"""Embeddings: token ids read beside the live conversation in a scratch sequence of every stage, their final-normed
hidden states pooled and normalised as llama.cpp's server does (`/embedding`, `/v1/embeddings`).

The read never touches the live sequence, its checkpoints or parked conversations: each stage gives the read a
sequence of its own (``Memory.new_seq``) whose K/V pages come from the stage's free pages, and drops it after
(``drop_seq``), whatever happens. A stage whose pool has not the free pages for the read (the live conversation and
its checkpoints hold them) reads it in a memory of its own made for this read (the same carve and geometry), so no
page anyone holds is ever freed for it. A remote stage (``--remote-stage``) carries one sequence over its link:
embeddings are refused there (``scratch_refusal``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.errors import EngineFault, Refused, Unavailable
from strata.memory import KVCacheFull, Memory

#: the poolings a request may ask for (llama.cpp's --pooling, less rank): none = every token's vector
POOLINGS = ("none", "mean", "cls", "last")
#: llama.cpp's enum llama_pooling_type, as GGUF's {arch}.pooling_type stores it
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last"}
#: a causal LM whose file names no pooling: the last token's hidden state (the one position that has read the whole
#: input; what decoder embedding models such as Qwen3-Embedding are trained to give, and what Ollama returns)
CAUSAL_DEFAULT = "last"


class EmbedRefused(Refused):
    """An embedding request this engine cannot serve as asked (400 unless status says otherwise)."""


class NotServed(EmbedRefused):
    """Embeddings this engine does not serve at all (a remote stage): 501."""

    status = 501
    code = "not_implemented"


#: inputs one request may embed (OpenAI's limit per request)
MAX_INPUTS = 2048


class EmbedCancelled(RuntimeError):
    """The request's client went away: the read stopped after its current forward call, nothing kept."""


class NoRoom(Unavailable):
    """The read's K/V finds no memory now (the stage's pool is held by the live conversation and the device or host
    has no room for a memory of its own): 503."""

    code = "no_memory"


@dataclass
class Embedding:
    """One input's result: ``vectors`` float32 (1, n_embd) pooled and normalised, or (n_tokens, n_embd) with pooling
    none (every token's final-normed hidden state, unnormalised, as llama.cpp gives them); ``n_tokens`` read."""

    vectors: np.ndarray
    n_tokens: int


def default_pooling(metadata: dict, arch: str) -> str:
    """The pooling a request that names none gets: the file's ``{arch}.pooling_type`` (an embedding model's), else
    CAUSAL_DEFAULT."""
    return GGUF_POOLING.get(metadata.get(f"{arch}.pooling_type"), CAUSAL_DEFAULT)


def normalize(v: np.ndarray, p: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize over the last axis: -1 none, 0 max absolute scaled to the int16 range,
    2 Euclidean, any other p the p-norm (1: taxicab); a zero vector stays zero."""
    v = np.asarray(v, dtype=np.float64)
    if p == -1:
        s = np.ones(v.shape[:-1] + (1,))
    elif p == 0:
        s = np.abs(v).max(axis=-1, keepdims=True) / 32760.0
    elif p == 2:
        s = np.sqrt((v * v).sum(axis=-1, keepdims=True))
    else:
        s = (np.abs(v) ** p).sum(axis=-1, keepdims=True) ** (1.0 / p)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s > 0, v / np.where(s > 0, s, 1.0), 0.0).astype(np.float32)


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """hidden float32 (n, n_embd) -> (1, n_embd) pooled (mean over the tokens, the first one, the last one), or the
    rows themselves for none."""
    if pooling == "none":
        return hidden
    if pooling == "mean":
        return hidden.astype(np.float64).mean(axis=0, keepdims=True).astype(np.float32)
    if pooling == "cls":
        return hidden[:1]
    if pooling == "last":
        return hidden[-1:]
    raise EmbedRefused(f"'pooling' must be one of {', '.join(POOLINGS)}, got {pooling!r}", param="pooling")


def scratch_refusal(stages) -> str | None:
    """Why the stages cannot give a read a sequence beside the live one, or None when every stage can."""
    for st in stages:
        if not isinstance(st.memory, Memory):
            return (f"embeddings are not served with a remote stage: stage {st.index} runs on a worker "
                    f"({st.device}), whose stage link carries only the live conversation's sequence")
    return None


def check_inputs(inputs: list, n_ctx: int, n_vocab: int) -> None:
    """EmbedRefused (naming input[i]) unless every input is a non-empty list of token ids in the vocabulary that fits
    the context."""
    if not inputs:
        raise EmbedRefused("'input' must not be empty", param="input")
    if len(inputs) > MAX_INPUTS:
        raise EmbedRefused(f"'input' has {len(inputs)} inputs, more than the {MAX_INPUTS} one request may embed",
                           param="input")
    for i, ids in enumerate(inputs):
        at = "input" if len(inputs) == 1 else f"input[{i}]"
        if len(ids) == 0:
            raise EmbedRefused(f"'{at}' is empty: there is nothing to embed", param=at)
        if len(ids) > n_ctx:
            raise EmbedRefused(f"'{at}' has {len(ids)} tokens, more than the context of {n_ctx} (--n-ctx)",
                               param=at, code="context_length_exceeded")
        a = np.asarray(ids)
        if a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) >= n_vocab:
            raise EmbedRefused(f"'{at}' holds a token id outside the vocabulary [0, {n_vocab})", param=at)


def _memory_for(st, n: int):
    """(memory, sid, own): a scratch sequence on the stage's memory with its pages for n tokens reserved, or, when
    the pool is short, one in a memory of the same carve made for this read (own=True)."""
    mem = st.memory
    sid = mem.new_seq()
    try:
        mem.reserve(sid, n)
        return mem, sid, False
    except KVCacheFull:
        mem.drop_seq(sid)
    try:
        mem = st.model.new_memory(n, st.carve)
    except MemoryError as e:         # numpy's and CuPy's out-of-memory errors alike
        raise NoRoom(f"no memory for a read of {n} tokens beside the live conversation on stage {st.index} "
                     f"({st.device}): {str(e).splitlines()[0][:200]}") from None
    sid = mem.new_seq()
    mem.reserve(sid, n)
    return mem, sid, True


def _forward(st, mem, sid: int, toks: np.ndarray, x):
    """Read toks through the stage's carve with the model's own forward (on the stage's device) -> the hidden states
    for the next stage, or on the last stage the final-normed hidden states, host float32 (n, n_embd)."""
    be = st.backend
    with mem.scope(drain=False):
        if x is not None:
            x = be.to_host(x) if be.xp is np and not isinstance(x, np.ndarray) else be.xp.asarray(x)
        state = mem.seq(sid)
        if st.last:
            _, h = st.model.forward_carve(toks, state, st.carve.lo, st.carve.hi, x_in=x, hidden=True)
            return np.asarray(be.to_host(h), dtype=np.float32)
        return st.model.forward_carve(toks, state, st.carve.lo, st.carve.hi, x_in=x)


def read_hidden(stages, ids, ubatch: int, progress=None) -> np.ndarray:
    """The final-normed hidden states float32 (n, n_embd) of token ids read from position 0 in scratch sequences
    (module docstring), in ubatch-sized forward calls; progress(): called after each (the engine's stall clock).
    Every scratch sequence is dropped before this returns or raises."""
    toks = np.ascontiguousarray(np.asarray(ids, dtype=np.int32).reshape(-1))
    n = int(toks.shape[0])
    held: list = []
    try:
        for st in stages:
            held.append(_memory_for(st, n))
        rows = []
        for a in range(0, n, max(1, int(ubatch))):
            x = None
            for st, (mem, sid, _) in zip(stages, held):
                x = _forward(st, mem, sid, toks[a:a + ubatch], x)
            rows.append(x)
            if progress is not None:
                progress()
        h = np.concatenate(rows) if len(rows) > 1 else rows[0]
    finally:
        for mem, sid, _ in held:
            mem.drop_seq(sid)
    if not np.isfinite(h).all():
        raise EngineFault("the model's hidden states are not finite (NaN or infinity) for this input")
    return h


def embed(stages, inputs: list, *, pooling: str, norm: int, ubatch: int, progress=None) -> list[Embedding]:
    """Each input (token ids, checked by check_inputs) read (read_hidden), pooled and, unless pooling is none,
    normalised (normalize(v, norm))."""
    if pooling not in POOLINGS:
        raise EmbedRefused(f"'pooling' must be one of {', '.join(POOLINGS)}, got {pooling!r}", param="pooling")
    why = scratch_refusal(stages)
    if why:
        raise NotServed(why)
    out = []
    for ids in inputs:
        h = read_hidden(stages, ids, ubatch, progress)
        v = pool(h, pooling)
        out.append(Embedding(v if pooling == "none" else normalize(v, norm), int(h.shape[0])))
    return out
