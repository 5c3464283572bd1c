"""The MTP drafter of speculative decoding (the live sequence's drafts from the model's own MTP head, the drafter's
K/V kept in step with the main model), which drafter --spec-draft gives and why --spec may not run, and the
per-choice counts of what was drafted and accepted (the lookup drafter: strata/engine/lookup.py).

The drafter's K/V (the last stage's "draft" field) holds, at MTP position p, the MTP block's K/V over the main
model's final-normed hidden state h_p and the token at p + 1. Between two reads of the live sequence at position
P it holds positions [0, P - 1) once fed: position P - 1 needs the token at P, which is only known once it is sampled.
Every read of the live sequence with the drafter on hands the drafter its rows' hidden states (``observe``), which
it feeds to the MTP block in batches: at the next draft, once FEED_BATCH rows wait, and at ``flush`` (the end of a
prompt part and of a choice, so that a checkpoint, a parked conversation or a session file carries them). ``draft``
then runs the MTP block at P - 1 with the token just sampled (that position is certain: the token will be read),
and past it on its own output, drafting until n tokens or a draft probability below ``min_p``; the positions past
P - 1 are cut back before the verify.

A position whose hidden state was never observed (the tail of a checkpoint restored, a sequence cut back) enters
the MTP block with a zero hidden state, and with a remote last stage (the drafter's K/V then a table of the
drafter's own, which checkpoints do not carry) a restored conversation's earlier MTP positions may be another's:
either can lower what the drafts agree with, never what is emitted (a verify decides that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata.backend.quant import ROWWISE_MAX_TOKENS
from strata.memory import Memory
from strata.sampling.speculative import Draft

#: drafts per verify at most: a verify reads the sampled token and its drafts in one short read
MAX_DRAFTS = ROWWISE_MAX_TOKENS - 1
#: hidden rows the drafter holds before it feeds them to the MTP block without waiting for a draft (plain steps
#: between drafts, --spec-adaptive's, are then fed in one batch)
FEED_BATCH = 64


@dataclass
class SpecCounts:
    """What one choice's speculative decoding did: verifies run, tokens drafted and drafts accepted."""
    verifies: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, other: "SpecCounts") -> None:
        """Count `other`'s verifies, drafts and accepted drafts in this one too."""
        self.verifies += other.verifies
        self.drafted += other.drafted
        self.accepted += other.accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verify (the accepted drafts and the token each verify adds)."""
        return (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0


NO_MTP = ("--spec needs a model with an MTP head (nextn_predict_layers > 0) for --spec-draft mtp; this model has none: "
          "use --spec-draft lookup (or auto) or --spec 0")


def drafter_kind(draft: str, model) -> str:
    """The drafter --spec-draft `draft` ('auto', 'mtp', 'lookup') gives on `model` (the last stage's, its MTP block
    loaded where it has one): 'auto' is 'mtp' where the model has an MTP head, else 'lookup'."""
    if draft == "auto":
        return "mtp" if getattr(model, "mtp", None) is not None else "lookup"
    return draft


def spec_refusal(stages, model, kind: str = "mtp") -> str | None:
    """Why --spec > 0 with the `kind` drafter cannot run on these stages and this model (one line), or None."""
    for st in stages:
        why = st.speculates
        if why:
            return f"--spec: {why}; use --spec 0"
    if kind == "mtp" and getattr(model, "mtp", None) is None:
        return NO_MTP
    return None


def file_refusal(model: str, draft: str = "mtp") -> str | None:
    """Why --spec > 0 with --spec-draft `draft` cannot run on the GGUF `model` (a path or 'default'), read from its
    metadata alone (no weights loaded: the daemon asks before it listens), or None; only 'mtp' needs anything of
    the file, and a file that does not open is left to the engine's own error."""
    if draft != "mtp":
        return None
    from strata.gguf.default_model import resolve_model
    from strata.gguf.file import ModelLoadError, open_gguf
    try:
        f = open_gguf(resolve_model(model))
    except (ModelLoadError, OSError, ValueError):
        return None
    n = f.config.extra.get("nextn_predict_layers", f.metadata.get(f"{f.arch}.nextn_predict_layers", 0))
    return None if int(n or 0) > 0 else NO_MTP


class MTPDrafter:
    """Drafts for the live sequence `seq` with the MTP head of `model` (the last stage's, whose memory holds the
    drafter's K/V: `seq`'s own "draft" field there, so drafters of several sequences over one model keep apart).
    ``oracle``: None, or a function (position of the drafted token, the MTP head's token) -> the token to draft
    instead (tests and benchmarks: the MTP head still runs on the drafts it is given). graph: the graph step to use
    (another drafter's ``graph``, shared: it holds no sequence's state from one draft to the next), else one made
    here."""

    wants_hidden = True      # every read of the live sequence hands it the last stage's final-normed rows
    kind = "mtp"

    def __init__(self, seq, stage, model, n_ctx: int, graph=False):
        self.seq, self.stage, self.model = seq, stage, model
        self.oracle: Callable[[int, int], int] | None = None
        # the drafter's K/V: the last stage's "draft" field, or (the last stage remote: the main runs the head and
        # the drafter) a page table of its own, which checkpoints do not carry
        self._own = None if isinstance(stage.memory, Memory) else model.new_mtp_kv(n_ctx)
        self._held: dict[int, object] = {}              # position -> the main model's hidden state there
        self._epoch = seq.epoch
        self.xp = getattr(model, "xp", np)               # the model's array module: CuPy on a GPU (rows stay there)
        self._zero = self.xp.zeros(model.config.n_embd, np.float32)
        # the one-row MTP step in a CUDA graph, or None
        self._graph = graph_step(model) if graph is False else graph

    @property
    def graph(self):
        """The one-row MTP step this drafter runs (a CUDA graph step), or None."""
        return self._graph

    def _table(self):
        if self._own is not None:
            return self._own
        return self.stage.memory.seq(self.seq.sids[-1]).draft

    def _sync(self) -> None:
        if self.seq.epoch != self._epoch:              # restored, cut back or reset: the rows held are of another
            self._held.clear()
            self._epoch = self.seq.epoch

    def observe(self, start: int, hidden) -> None:
        """The hidden states of the rows the live sequence read at positions start.. (its position now at or past
        their end); the MTP block is fed every position whose next token is known once more than FEED_BATCH
        rows wait (or at the next draft)."""
        self._sync()
        h = self.xp.asarray(hidden, dtype=np.float32)
        for i in range(h.shape[0]):
            self._held[start + i] = h[i]
        if len(self._held) > FEED_BATCH:      # else they wait for the next draft, which feeds them in one batch
            self._feed(self.seq.pos - 1, None)

    def flush(self) -> None:
        """Feed the MTP block every position whose hidden state and next token are known."""
        self._sync()
        if self._held:
            self._feed(self.seq.pos - 1, None)

    def _feed(self, upto: int, last_token: int | None, ahead: int = 0):
        """Feed MTP positions [length, upto) with their known next tokens (their K/V alone: ``mtp_kv``), and
        position `upto` too when `last_token` is given (the token at upto + 1) -> the MTP block's output of that
        row (``mtp_hidden``), or None. The pages of those rows and of `ahead` more (the drafts' own rows) are
        reserved first, the sequence's make_room freeing pages (checkpoints, parked conversations hold the drafter's
        K/V too) when the pool is short, as for the model's own K/V."""
        table = self._table()
        ids = self.seq.ids
        lo = table.length
        if lo > upto:
            table.truncate(upto)
            lo = upto
        hi = upto + (last_token is not None)
        if hi - lo + ahead > 0:
            self.seq.with_room(lambda: table.reserve(hi - lo + ahead))
        if hi <= lo:
            return None
        toks = np.empty(hi - lo, np.int32)
        toks[:upto - lo] = ids[lo + 1:upto + 1]
        if last_token is not None:
            toks[-1] = last_token
        rows = self.xp.stack([self._held.get(p, self._zero) for p in range(lo, hi)])
        # only the row drafted from needs the block's output: the rows before it need their K/V alone
        k = hi - lo - (last_token is not None)
        if k:
            self.model.mtp_kv(rows[:k], toks[:k], table)
        out = self.model.mtp_hidden(rows[k:], toks[k:], table) if last_token is not None else None
        for p in [p for p in self._held if p < hi]:
            del self._held[p]
        return out

    def draft(self, token: int, n: int, min_p: float) -> list[Draft]:
        """Up to n drafts following `token` (sampled, about to be read at the sequence's position P), stopping at
        the first whose draft probability is below min_p. The MTP K/V ends at P (position P - 1 certain)."""
        self._sync()
        if self._graph is not None:
            return self._draft_graph(token, n, min_p)
        P = self.seq.pos
        x = self._feed(P - 1, token, ahead=max(0, n - 1))
        out: list[Draft] = []
        table = self._table()
        xp = self.xp
        for k in range(n):
            logits = self.model.mtp_head(x, on_device=True)[0]    # the argmax and its probability on the device
            t = int(xp.argmax(logits))
            if min_p > 0:
                z = logits - logits[t]
                p = 1.0 / float(xp.exp(z.astype(np.float64)).sum())
                if p < min_p:
                    break
            if self.oracle is not None:
                t = int(self.oracle(P + 1 + k, t))
            out.append(Draft(t))
            if k + 1 < n:       # the MTP block past the main model's hidden states: its own output as h
                x = self.model.mtp_hidden(x, np.asarray([t], np.int32), table)
        table.truncate(P)
        return out


    def _draft_graph(self, token: int, n: int, min_p: float) -> list[Draft]:
        """draft() with the one-row MTP steps in the graph step (the held rows before P - 1 fed in one batch by
        the model's own MTP block first)."""
        P = self.seq.pos
        self._feed(P - 1, None, ahead=n)
        table = self._table()
        h = self._held.pop(P - 1, self._zero)
        t, logits = self._graph.step(token, table, h)
        out: list[Draft] = []
        for k in range(n):
            if min_p > 0:
                z = logits - logits[t]
                p = 1.0 / float(self.xp.exp(z.astype(np.float64)).sum())
                if p < min_p:
                    break
            if self.oracle is not None:
                t = int(self.oracle(P + 1 + k, t))
            out.append(Draft(t))
            if k + 1 < n:            # the block's own output as h (kept in the step's buffer)
                t, logits = self._graph.step(t, table)
        table.truncate(P)
        return out


def graph_step(model):
    """The MTP block's graph step (strata.backend.cuda.mtp.MTPStep) for a model with its MTP block on a CUDA
    backend that the hybrid's decode plan runs; None elsewhere (the model's own mtp_hidden / mtp_head draft)."""
    if getattr(model, "mtp", None) is None or getattr(model, "xp", np) is np or not getattr(model, "on_device", False):
        return None
    from strata.backend.cuda import mtp, settings
    if not settings.mtp_graph_enabled() or mtp.unsupported(model) is not None:
        return None
    return mtp.MTPStep(model)
