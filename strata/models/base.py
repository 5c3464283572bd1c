"""The Model base class: one architecture's forward pass over a stage's layers, written against Backend ops."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

import numpy as np

from strata.gguf.config import ModelConfig
from strata.gguf.file import GGUFModelFile, progress_bar
from strata.memory import (Carve, DEFAULT_PAGE_SIZE, HybridMemory, KVMemory, Memory, PagePool, RecurrentMemory,
                           SequenceState)

class Model(ABC):
    """One architecture's forward pass, written against Backend ops only (runs on CPU or CUDA).

    Subclasses set ``arch``, load and upload their weights in __init__ (through ``self.weight``), and implement
    ``forward_carve``: layers [lo, hi) of one stage, the embedding when lo == 0 and the output head when hi ==
    ``n_blocks``. ``attn_layers`` lists the layer indices with attention K/V (the PagePool's layers). ``layers``
    (optional): the blocks to load (the carves of the stages on this backend); the others are not uploaded and
    stay None.
    """

    arch: ClassVar[str] = ""

    def __init__(self, f: GGUFModelFile, backend, progress: Callable[[int, int], None] | bool | None = None,
                 layers: range | None = None):
        self.file = f
        self.config: ModelConfig = f.config
        self.backend = backend
        self.attn_layers: list[int] = list(range(self.config.n_layer))
        self.loaded_layers = layers
        self.head_here = True        # False on a worker: its last carve returns hidden states, the main runs the head
        self._progress = progress
        self._bar = None
        self._loaded = 0

    # --- loading -----------------------------------------------------------------------------------
    def weight(self, name: str, shape: tuple | None = None, optional: bool = False) -> Any:
        """Check tensor `name` against `shape` (numpy order) and upload it to the backend.

        Returns None for a missing optional tensor; raises ModelLoadError naming the tensor and the expected
        shape otherwise.
        """
        if optional and not self.file.has(name):
            return None
        return self.upload_tensor(self.file.tensor(name, shape))

    def upload_tensor(self, t) -> Any:
        """Upload a WeightTensor (from the file, or built from file tensors) and advance the progress bar."""
        if self._bar is None:
            self._bar = progress_bar(self.file.nbytes, f"loading {os.path.basename(self.file.path)} "
                                     f"to {self.backend.name}", self._progress)
        out = self.backend.upload(t)
        n = min(t.nbytes, self.file.nbytes - self._loaded)
        self._loaded += n
        self._bar[0](n)
        return out

    def _done_loading(self) -> None:
        if self._bar is not None:
            self._bar[0](self.file.nbytes - self._loaded)  # tensors this architecture does not use
            self._loaded = self.file.nbytes
            self._bar[1]()
            self._bar = None

    # --- stages and sequences -----------------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        """The main model's blocks (an MTP drafter block, if any, is not one of them)."""
        return self.config.n_layer

    def ends_with_head(self, hi: int) -> bool:
        """Whether a carve ending at block `hi` ends with the final norm and the output head (the last block, unless
        this model runs on a worker: the main keeps the head)."""
        return hi == self.n_blocks and self.head_here

    def head(self, x, all_logits: bool = False, on_device: bool = False):
        """The final norm and the output head over hidden states x (n, n_embd) -> float32 logits of the last row
        (n_vocab,), or of every row with all_logits; host numpy, or a backend array with on_device."""
        be = self.backend
        if not all_logits:
            x = x[-1:]
        logits = be.matmul(be.rms_norm(x, self.out_norm, self.config.rms_eps), self.output)
        if not on_device:
            logits = be.to_host(logits)
        return logits if all_logits else logits[0]

    def head_hidden(self, x, all_logits: bool = False):
        """``head(x, all_logits)`` (host logits) and the final-normed rows of every row of x (the backend's array): the
        MTP drafter's hidden states beside the logits."""
        be = self.backend
        h = be.rms_norm(x, self.out_norm, self.config.rms_eps)
        logits = be.to_host(be.matmul(h if all_logits else h[-1:], self.output))
        return (logits if all_logits else logits[0]), h

    def loads(self, i: int) -> bool:
        """Whether block i is uploaded on this backend (see ``layers``)."""
        return self.loaded_layers is None or i in self.loaded_layers

    def _carve(self, carve: Carve | None) -> Carve:
        return Carve(0, self.n_blocks) if carve is None else carve

    def new_page_pool(self, n_ctx: int, n_seq: int = 1, page_size: int = DEFAULT_PAGE_SIZE,
                      carve: Carve | None = None) -> PagePool:
        """A PagePool of the carve's attention layers (all by default) with room for n_seq sequences of n_ctx
        tokens each (rounded up to whole pages)."""
        c = self.config
        carve = self._carve(carve)
        n_pages = n_seq * max(1, -(-int(n_ctx) // page_size))
        return self.backend.new_page_pool([li for li in self.attn_layers if li in carve], n_pages, c.n_head_kv,
                                          c.head_dim, page_size=page_size, head_dim_v=c.extra.get("head_dim_v"))

    def new_running_state(self, carve: Carve | None = None) -> dict[int, dict[str, Any]]:
        """Zeroed running state of the carve's recurrent layers (none for attention-only models)."""
        return {}

    def identity(self) -> dict[str, Any]:
        """What a state part of this model must agree on besides its arrays (part of Memory.geometry)."""
        c = self.config
        return {"arch": self.file.arch, "n_embd": int(c.n_embd), "n_blocks": int(self.n_blocks)}

    def new_memory(self, n_ctx: int, carve: Carve | None = None, n_seq: int = 1,
                   page_size: int = DEFAULT_PAGE_SIZE, pool: PagePool | None = None) -> Memory:
        """The Memory of a stage running `carve` (all blocks by default): KVMemory for attention layers,
        RecurrentMemory for recurrent ones, HybridMemory when the carve has both (or carries the drafter).
        `pool`: the KV pool to use (default: a new one for n_seq sequences of n_ctx tokens)."""
        carve = self._carve(carve)
        if pool is None:
            pool = self.new_page_pool(n_ctx, n_seq, page_size, carve)
        fields: list[Memory] = []
        ident = self.identity()
        running = self.new_running_state(carve)
        if pool.layers or not running:
            fields.append(KVMemory(carve, pool, identity=ident, backend=self.backend))
        if running:
            fields.append(RecurrentMemory(carve, running, xp=getattr(self.backend, "xp", np), identity=ident,
                                          backend=self.backend))
        fields += self._drafter_memory(n_ctx, carve, n_seq, page_size)
        return fields[0] if len(fields) == 1 else HybridMemory(carve, fields, identity=ident, backend=self.backend)

    def _drafter_memory(self, n_ctx: int, carve: Carve, n_seq: int, page_size: int) -> list[Memory]:
        """The drafter's K/V field on the last stage of a model with an MTP head (none here)."""
        return []

    def new_state(self, pool: PagePool) -> SequenceState:
        """A new sequence over `pool` in a one-stage memory of all blocks (tests and tools; the engine builds its
        stages' memories itself). The memory is kept per pool, so several sequences share its pages."""
        mems = self.__dict__.setdefault("_pool_memories", {})
        entry = mems.get(id(pool))
        if entry is None or entry[0] is not pool:
            entry = mems[id(pool)] = (pool, self.new_memory(0, pool=pool))
        mem = entry[1]
        return mem.seq(mem.new_seq())

    def forward(self, tokens: np.ndarray, state: SequenceState, all_logits: bool = False) -> np.ndarray:
        """Read `tokens` (int32 (n_tokens,)) at state.pos through every block. Returns float32 logits (n_vocab,)
        of the last token, or (n_tokens, n_vocab) with all_logits. Advances state.pos and the KV length."""
        return self.forward_carve(tokens, state, 0, self.n_blocks, all_logits=all_logits)

    @abstractmethod
    def forward_carve(self, tokens: np.ndarray, state: SequenceState, lo: int, hi: int, x_in: Any = None,
                      all_logits: bool = False) -> Any:
        """Read `tokens` at state.pos through blocks [lo, hi) of one stage. lo == 0: the input is the tokens'
        embeddings, else `x_in` (the previous stage's hidden states, float32 (n_tokens, n_embd) on this backend).
        hi == n_blocks: returns host float32 logits as ``forward`` does; else the hidden states after block hi - 1
        (the residual stream, before the final norm; a backend array). Reserves, commits and advances `state`
        (this stage's sequence); ValueError / KVCacheFull change nothing."""

    def forward_batch(self, tokens, states: list[SequenceState], lo: int, hi: int, x_in: Any = None,
                      hidden: bool = False) -> Any:
        """One decode step of several sequences: token i read by ``states[i]`` (distinct sequences of this stage's
        memory, each at its own position) through blocks [lo, hi) -> host float32 logits (N, n_vocab) when hi ends
        with the head, else the hidden states (N, n_embd) (a backend array). Row i is bit-identical to
        ``forward_carve([tokens[i]], states[i], lo, hi, x_in[i:i + 1])`` whatever the other rows are and whichever
        row it sits in (batch-invariant). x_in: the previous stage's hidden states (N, n_embd) when lo > 0.
        hidden (a carve ending with the head): (those logits, the final-normed rows (N, n_embd)), each row as
        ``forward_carve(..., hidden=True)`` gives it (the MTP drafter's ``h``).

        This default runs those lone steps one after the other; a family whose ops are exact per row (the CPU
        backend's C core) overrides it to read every weight once for all rows. ValueError (changing nothing) for
        what ``forward_carve`` refuses, a repeated sequence or a count mismatch; KVCacheFull from a reserve (pages
        reserved for other rows stay reserved, which is harmless)."""
        tokens = self._check_batch(tokens, states, lo, hi, x_in)
        head = self.ends_with_head(hi)
        kw = {"hidden": True} if hidden and head else {}
        outs = [self.forward_carve(tokens[i:i + 1], st, lo, hi, None if x_in is None else x_in[i:i + 1], **kw)
                for i, st in enumerate(states)]
        if kw:
            return np.stack([o[0] for o in outs]), self.backend.xp.concatenate([o[1] for o in outs], axis=0)
        if head:
            return np.stack(outs)
        return self.backend.xp.concatenate(outs, axis=0)

    def verify_batch(self, token_lists, states: list[SequenceState], lo: int, hi: int, x_in: Any = None) -> Any:
        """Speculative verifies of several sequences in one call: token_lists[i] read by ``states[i]`` (distinct
        sequences, each armed to keep its per-token states) through blocks [lo, hi) -> (host float32 logits of every
        row, the final-normed rows) when hi ends with the head, else the hidden states; rows in order, sequence by
        sequence, each bit-identical to ``forward_carve(token_lists[i], states[i], lo, hi, x_in rows,
        all_logits=True, hidden=True)``. x_in: the previous stage's rows (sum of the lengths, n_embd) when lo > 0.
        This default runs those verifies one after the other; the CPU hybrid reads each weight once for all rows."""
        head = self.ends_with_head(hi)
        outs, at = [], 0
        for toks, st in zip(token_lists, states):
            n = len(toks)
            xi = None if x_in is None else x_in[at:at + n]
            at += n
            if head:
                outs.append(self.forward_carve(np.asarray(toks, np.int32), st, lo, hi, xi, all_logits=True,
                                               hidden=True))
            else:
                outs.append(self.forward_carve(np.asarray(toks, np.int32), st, lo, hi, xi))
        if head:
            xp = self.backend.xp
            return np.concatenate([o[0] for o in outs], axis=0), xp.concatenate([o[1] for o in outs], axis=0)
        return self.backend.xp.concatenate(outs, axis=0)

    def head_rows(self, x, hidden: bool = False):
        """The final norm and the output head over every row of x (N, n_embd) -> host float32 logits (N, n_vocab);
        hidden: (those logits, the final-normed rows), the very ops ``forward_carve(..., hidden=True)`` runs."""
        return self.head_hidden(x, all_logits=True) if hidden else self.head(x, all_logits=True)

    def _attend_rows(self, states: list[SequenceState], scale: float):
        """attend(q, k, v, layer) for a batched step: row i's K/V written to and attended over ``states[i]``'s own
        pages (each row as its lone step attends, softmax scale ``scale``) -> the rows' attention, stacked."""
        be = self.backend

        def attend(q, k, v, il):
            return np.concatenate([be.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], st.kv, il, scale)
                                   for i, st in enumerate(states)], axis=0)
        return attend

    def _check_batch(self, tokens, states, lo: int, hi: int, x_in) -> np.ndarray:
        """The checks of a batched step before anything is touched -> the token ids (int32 (N,)): one token per
        sequence, distinct sequences, each as ``_check_carve`` checks it, none with kept states armed (a verify)."""
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = int(tokens.shape[0])
        if n == 0 or n != len(states):
            raise ValueError(f"a batched step takes one token per sequence (got {n} tokens for {len(states)} "
                             "sequences)")
        if len({id(st) for st in states}) != n:
            raise ValueError("a batched step reads each sequence at most once")
        if lo > 0 and (x_in is None or tuple(x_in.shape) != (n, self.config.n_embd)):
            raise ValueError(f"blocks {lo}..{hi} need the previous stage's hidden states ({n}, "
                             f"{self.config.n_embd}), got {None if x_in is None else tuple(x_in.shape)}")
        for i, st in enumerate(states):
            if getattr(st, "steps", None) is not None:
                raise ValueError("a batched step cannot read a sequence armed to keep per-token states (a verify)")
            self._check_carve(tokens[i:i + 1], st, lo, hi, None if x_in is None else x_in[i:i + 1])
        return tokens

    def _check_carve(self, tokens, state: SequenceState, lo: int, hi: int, x_in) -> np.ndarray:
        """The checks every forward_carve makes before touching anything -> the token ids (int32 (n,))."""
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = int(tokens.shape[0])
        if n == 0:
            raise ValueError("forward() needs at least one token")
        if not 0 <= lo < hi <= self.n_blocks:
            raise ValueError(f"blocks {lo}..{hi} are not a carve of this model's {self.n_blocks}")
        if lo == 0 and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.n_vocab):
            raise ValueError(f"token id out of range [0, {self.config.n_vocab})")
        if lo > 0 and (x_in is None or tuple(x_in.shape) != (n, self.config.n_embd)):
            raise ValueError(f"blocks {lo}..{hi} need the previous stage's hidden states ({n}, "
                             f"{self.config.n_embd}), got {None if x_in is None else tuple(x_in.shape)}")
        missing = next((i for i in range(lo, hi) if not self.loads(i)), None)
        if missing is not None:
            raise ValueError(f"block {missing} is not loaded on this backend")
        kv = state.kv
        if kv is not None and kv.length != state.pos:
            raise ValueError(f"KV length {kv.length} != sequence position {state.pos}")
        return tokens
