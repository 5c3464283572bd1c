"""RemoteStage (a Stage whose layers run on a worker chain while the main keeps the output head; its checkpoint parts
are ids in the worker's store) and RemoteMemory (its state verbs spoken over the link, strata.stages.link_client)."""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

import link
from link import Ack, CkptRestore, CkptSave, Commit, ErrorCode, Forward, Hello, Hop, Reset, Result
from strata.memory import Carve, PartMismatch
from strata.stages.link_client import (BACKOFF, PING_EVERY, SILENT_AFTER, LinkClient, LinkDown, WorkerBadResult,
                                       WorkerError, parse_address, result_fault)
from strata.stages.stage import StageBase

log = structlog.get_logger("strata.stages.remote")

class CheckpointGone(PartMismatch):
    """The worker does not hold the checkpoint part (it restarted or the link reconnected since): the request
    reads from token 0."""


def parse_remote(spec: str | None) -> list[str]:
    """--remote-stage 'HOST:PORT[,HOST:PORT...]' -> the addresses in chain order (checked); [] for None / ''."""
    if not spec:
        return []
    out = [a.strip() for a in str(spec).split(",")]
    for a in out:
        parse_address(a)
    return out


def unsupported_with_remote(*, conversation_cache_mib=None, conversation_cache_dir=None, slot_save_path=None,
                            prompt_cache_every: int = 0, prompt_cache_tail: int = 0) -> str | None:
    """What a remote stage does not support yet, as one line (the CLI's usage error, the Engine's
    ValueError), or None."""
    if conversation_cache_mib or conversation_cache_dir:
        return ("parking (--conversation-cache-mib / --conversation-cache-dir) is not supported with a remote stage "
                "(--remote-stage) yet")
    if slot_save_path:
        return "session files (--slot-save-path) are not supported with a remote stage (--remote-stage) yet"
    if prompt_cache_every or prompt_cache_tail:
        what = "--prompt-cache-every" if prompt_cache_every else "the near-tail cut point, prompt_cache_tail"
        return f"mid-prompt checkpoints ({what}) are not supported with a remote stage (--remote-stage)"
    return None


# ---------------------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class RemotePart:
    """A remote stage's part of a checkpoint: the id the worker chain keeps it under (in that link's `epoch`),
    its position and carve. The main holds no bytes of it (nbytes 0; the worker's store has its own limits).
    ``release``: the main no longer keeps it (the next checkpoint message's keep list leaves it out, and the worker
    gives its pages back)."""

    carve: Carve
    pos: int
    ckpt_id: int
    epoch: int
    is_prefix: bool = False
    released: bool = False

    def nbytes(self) -> int:
        return 0

    def release(self) -> None:
        self.released = True


class RemoteMemory:
    """A remote stage's memory: the state verbs spoken over the link (the worker chain keeps the sequence's K/V and
    running state; a checkpoint part is a RemotePart, an id in the worker's store kept alive by the main's
    references: the ids of the parts the main still holds travel as the keep list of every checkpoint message, and
    the worker prunes to them when an operation succeeds).

    Capabilities (strata.memory.Memory's): no part's pages can be held on a device here and no part copied to the
    host (``holds_pages`` / ``host_parts`` False: the engine neither parks nor saves with a remote stage);
    ``cuts_anywhere`` unless the carve has recurrent layers (a Commit cuts the worker's K/V back)."""

    holds_pages = False
    host_parts = False

    def __init__(self, link: "RemoteStage", recurrent: bool):
        self.link, self.carve, self.recurrent = link, link.carve, bool(recurrent)
        self.at = 0                          # the live sequence's position on the worker
        self.kept_from: int | None = None    # where the verify awaiting its Commit started (keep), else None
        self.seq_epoch = 0                   # the link epoch the live sequence's worker state belongs to
        self._ids = itertools.count(1)
        self._parts: dict[int, weakref.ref] = {}
        self.held, self.store_bytes = 0, 0   # what the worker's store reported at the last Ack

    @property
    def cuts_anywhere(self) -> bool:
        return not self.recurrent

    def _keep(self, also: int | None = None) -> list[int]:
        """The ids of the RemoteParts the main still holds (and `also`): the worker keeps exactly these."""
        for i in [i for i, r in self._parts.items() if r() is None or r().released]:
            del self._parts[i]
        ids = sorted(self._parts)
        return ids + [also] if also is not None and also not in self._parts else ids

    def _acked(self, ack) -> None:
        if isinstance(ack, Ack):
            self.held, self.store_bytes = int(ack.held), int(ack.store_bytes)

    def new_seq(self) -> int:
        return 0

    def drop_seq(self, sid: int) -> None:
        """Nothing on the main; the worker drops its state at a Reset or when the link closes."""

    def pos(self, sid: int) -> int:
        return self.at

    def reserve(self, sid: int, n: int) -> None:
        """Nothing here: the worker reserves its pages for the tokens a Forward carries (its pool holds n_ctx
        tokens of its carve, as the main's does)."""

    def capture(self, sid: int) -> RemotePart:
        """CkptSave: the worker chain keeps its part of the sequence at the current position under a new id."""
        cid = next(self._ids)
        ack = self.link.call(CkptSave(ckpt_id=cid, pos=self.at, keep=self._keep(also=cid)))
        self._acked(ack)
        part = RemotePart(carve=self.carve, pos=self.at, ckpt_id=cid, epoch=self.link.epoch)
        self._parts[cid] = weakref.ref(part)
        return part

    def validate(self, part, sid: int | None = None) -> None:
        if not isinstance(part, RemotePart):
            raise PartMismatch(f"a {type(part).__name__} is not a part of a remote stage")
        if part.carve != self.carve:
            raise PartMismatch(f"the part is of layers {part.carve}, this remote stage runs {self.carve}")
        if part.released or part.epoch != self.link.epoch:
            raise CheckpointGone(f"the worker no longer holds checkpoint {part.ckpt_id} (the link reconnected)")

    def restore(self, sid: int, part: RemotePart) -> None:
        """CkptRestore (settling first). CheckpointGone when the worker does not hold the part."""
        self.validate(part)
        self.link.settle()
        try:
            ack = self.link.call(CkptRestore(ckpt_id=part.ckpt_id, pos=part.pos, keep=self._keep(also=part.ckpt_id)))
        except WorkerError as e:
            if e.link_code == ErrorCode.CKPT_MISSING:
                raise CheckpointGone(str(e)) from None
            raise
        self._acked(ack)
        self.at, self.kept_from = part.pos, None

    def check_truncate(self, sid: int, p: int) -> None:
        if not 0 <= p <= self.at:
            raise ValueError(f"truncate({p}) outside [0, {self.at}]")
        if self.recurrent and 0 < p < self.at:
            raise ValueError(f"cannot cut a recurrent running state back from {self.at} to {p}; "
                             "restore a checkpoint instead")

    def keep(self, sid: int, n: int) -> None:
        """The next Forward is a verify (want_all): the worker keeps each token's state (+spec) for the Commit."""
        self.kept_from = self.at

    def check_commit(self, sid: int, p: int) -> None:
        if self.kept_from is not None and p != self.at:
            if not self.kept_from < p <= self.at:
                raise ValueError(f"commit({p}) outside the kept positions ({self.kept_from}, {self.at}]")
            return
        if p != self.at:
            self.check_truncate(sid, p)

    def commit(self, sid: int, p: int) -> None:
        """Commit(p) after a verify, sent ahead: the worker keeps [0, p), its running state taken from the state
        it kept after token p - 1 (always sent: it also ends the worker's keep)."""
        self.check_commit(sid, p)
        self.link.post(Commit(pos=int(p)))
        self.at, self.kept_from = int(p), None

    def truncate(self, sid: int, p: int) -> None:
        """Commit(p), sent ahead: the worker keeps [0, p); the next prompt settles before it is read."""
        self.check_truncate(sid, p)
        self.link.post(Commit(pos=int(p)))
        self.at = int(p)

    def reset(self, sid: int) -> None:
        """Reset (a settle point). With the link down there is nothing to reset: the worker dropped the state."""
        self.at, self.kept_from = 0, None
        if self.link.client is None:
            return
        self.link.settle()
        self._acked(self.link.call(Reset(keep=self._keep())))
        self.seq_epoch = self.link.epoch

    def trim(self, sid: int) -> None:
        """Nothing to give back on the main; a Reset gives the worker's pages back."""

    def hashes(self, sid: int) -> dict[str, str]:
        """No per-layer hashes: the worker's state is not read back over the link."""
        return {}

    def nbytes(self, sid: int) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {"carve": [self.carve.lo, self.carve.hi], "checkpoints_held": self.held,
                "store_bytes": self.store_bytes}


class RemoteStage(StageBase):
    """Stage of the layers `hops` run on a worker chain (--remote-stage A,B: A runs the first carve and relays to
    B). The main keeps the embeddings (on its local stages) and the output head: this stage sends the hidden
    states on, takes the last carve's back, and runs the final norm and the head on `model`'s backend. Its
    ``memory`` is a RemoteMemory: the state verbs spoken over this stage's link.

    The main decides positions and which checkpoints exist. A link failure fails the request in flight
    (LinkDown); a background thread then reconnects with backoff, and the fresh worker state makes the engine
    start its live sequence and its checkpoints over (``lost``).
    """

    runner_name = "LinkClient"

    def __init__(self, index: int, hops: list[tuple[str, Carve]], model, *, fingerprint: str, n_ctx: int,
                 max_batch: int, ckpt_max: int, key: bytes | None = None, silent_after: float = SILENT_AFTER,
                 encrypt: bool = False, insecure: bool = False):
        self.index = index
        self.hops = [(a, Carve(c.lo, c.hi)) for a, c in hops]
        self.carve = Carve(self.hops[0][1].lo, self.hops[-1][1].hi)
        self.device = "remote:" + ",".join(a for a, _ in self.hops)
        self.model, self.backend = model, model.backend
        self.first, self.last = False, True
        self.fingerprint, self.n_ctx, self.max_batch, self.ckpt_max = fingerprint, int(n_ctx), int(max_batch), \
            int(ckpt_max)
        self.key, self.silent_after = key, silent_after
        self.encrypt, self.insecure = bool(encrypt), bool(insecure)
        self.client: LinkClient | None = None
        self.epoch = 0                       # connections made; a RemotePart of another epoch is gone
        self.memory = RemoteMemory(self, recurrent=bool(model.new_running_state(self.carve)))
        self._io = threading.RLock()         # the engine thread and the heartbeat / reconnect thread
        self.down_reason: str | None = None
        self.rtt_s = None
        self.commits = 0                     # Commits sent ahead (settled before the next prompt is read)
        self.worker_us = 0                   # the worker chain's own compute time over all Forwards (Result)
        self._stop = threading.Event()
        self._connect()                      # WorkerRefused at start: `strata serve` exits naming the worker
        self.memory.seq_epoch = self.epoch
        self._thread = threading.Thread(target=self._keepalive, name="strata-link", daemon=True)
        self._thread.start()

    # ---- the link -------------------------------------------------------------------------------------------
    def _hello(self) -> Hello:
        c = self.hops[0][1]
        return Hello(protocol=link.VERSION, fingerprint=self.fingerprint, lo=c.lo, hi=c.hi,
                     n_blocks=int(self.model.n_blocks), n_embd=int(self.model.config.n_embd), act_dtype="f32",
                     n_ctx=self.n_ctx, max_batch=self.max_batch, ckpt_max=self.ckpt_max,
                     next_hops=[Hop(host=host, port=port, lo=cc.lo, hi=cc.hi)
                                for (host, port), cc in ((parse_address(a), cc) for a, cc in self.hops[1:])],
                     nonce=b"", mac=b"")

    def _connect(self) -> None:
        client = LinkClient(self.hops[0][0], self.key, silent_after=self.silent_after, encrypt=self.encrypt,
                            insecure=self.insecure)
        ack = client.connect(self._hello())
        n_embd = int(self.model.config.n_embd)
        client.max_payload = max(1 << 20, self.max_batch * (n_embd * 4 + 8) + 4096)
        with self._io:
            self.client, self.epoch, self.memory.at = client, self.epoch + 1, 0
            self.memory.kept_from = None
            self.down_reason, self.memory.held, self.memory.store_bytes = None, 0, 0
        log.info("stage link up", stage=self.index, workers=[a for a, _ in self.hops], epoch=self.epoch,
                 ckpt_max=ack.ckpt_max, part_bytes=ack.part_bytes, worker=ack.worker, device=ack.device,
                 frames=client.frames)

    def _mark_down(self, why: str) -> None:
        with self._io:
            if self.client is not None:
                self.client.close()
            self.client = None
            if self.down_reason is None:
                log.warning("stage link down", stage=self.index, error=why)
            self.down_reason = why

    def _keepalive(self) -> None:
        """Ping an idle link every PING_EVERY s (a dead worker is noticed between requests, so they get 503 at
        once); reconnect a down one with backoff."""
        tries = 0
        while not self._stop.wait(PING_EVERY if self.down_reason is None else BACKOFF[min(tries, len(BACKOFF) - 1)]):
            if self.down_reason is not None:
                try:
                    self._connect()
                    tries = 0
                except LinkDown as e:
                    tries += 1
                    with self._io:
                        self.down_reason = str(e)
                continue
            if not self._io.acquire(blocking=False):
                continue                          # the engine is using the link: its own waits ping
            try:
                if self.client is not None and self.client.unsettled == 0 and \
                        time.monotonic() - self.client.heard > PING_EVERY:
                    self.rtt_s = self.client.ping()
            except (LinkDown, WorkerError) as e:
                self._mark_down(str(e))
            finally:
                self._io.release()

    def close(self) -> None:
        self._stop.set()
        with self._io:
            if self.client is not None:
                self.client.close()
                self.client = None

    def _live(self) -> LinkClient:
        if self.client is None:
            raise LinkDown(f"stage {self.index} ({self.device}) is unreachable: {self.down_reason}; reconnecting")
        return self.client

    def call(self, msg):
        """Send `msg` and wait for the worker's answer (LinkDown marks the link down)."""
        with self._io:
            try:
                return self._live().call(msg)
            except LinkDown as e:
                self._mark_down(str(e))
                raise

    def post(self, msg) -> None:
        """Send `msg` ahead (a Commit): its answer is settled before the next prompt is read."""
        with self._io:
            try:
                self._live().post(msg)
                self.commits += 1
            except LinkDown as e:
                self._mark_down(str(e))
                raise

    # ---- what the engine asks of every stage ------------------------------------------------------------------
    @property
    def device_logits(self) -> bool:
        return getattr(self.backend, "xp", np) is not np

    def unavailable(self) -> str | None:
        """Why requests cannot run now (the link is down), or None."""
        r = self.down_reason
        return None if r is None else f"stage {self.index} ({self.device}) is unreachable: {r}; reconnecting"

    def lost(self) -> bool:
        """Whether the worker's part of the live sequence is gone (the link reconnected since)."""
        return self.memory.seq_epoch != self.epoch

    def settle(self) -> None:
        """Wait for the worker's replies to every Commit sent ahead (before a prompt is read)."""
        with self._io:
            try:
                if self.client is not None:
                    self.client.settle()
            except LinkDown as e:
                self._mark_down(str(e))
                raise

    @property
    def speculates(self) -> str | None:
        """None when the worker announced ``+spec`` (it keeps a verify's per-token states and Commits into them);
        the reason otherwise."""
        c = self.client
        if c is None:
            return f"stage {self.index} is remote and its link is down"
        if link.CAP_SPEC not in c.caps:
            return (f"stage {self.index}'s worker {c.address} does not announce +spec (an older strata worker): "
                    f"upgrade it")
        return None

    def forward(self, tokens: np.ndarray, sid: int, x_in=None, all_logits: bool = False, on_device: bool = False,
                hidden: bool = False):
        """Send the previous stage's hidden states through the worker chain; run the head on what comes back ->
        logits as Stage.forward gives them (with hidden, and the final-normed hidden rows: see StageBase.forward)."""
        toks = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(-1))
        be = self.backend
        x = np.ascontiguousarray(x_in if isinstance(x_in, np.ndarray) else be.to_host(x_in), dtype=np.float32)
        n = int(toks.shape[0])
        at = self.memory.at
        if self.client is not None and self.client.unsettled:
            # a verify's Commit is in flight: a worker may apply it late (while expert swaps finish), so it lands
            # before the next Forward is sent
            self.settle()
        res = self.call(Forward(pos=at, want_all=bool(all_logits), tokens=toks, hidden=x))
        if not isinstance(res, Result) or res.pos != at + n:
            self._mark_down(f"answered a Forward at {at} of {n} tokens with "
                            f"{type(res).__name__} at {getattr(res, 'pos', '?')}")
            raise LinkDown(f"stage {self.index} ({self.device}): the worker lost step with the main")
        h = res.hidden
        fault = result_fault(h, n if all_logits else 1, int(self.model.config.n_embd))
        if fault is not None:        # the worker's state is not to be trusted: a fresh link, the sequence read again
            self._mark_down(f"returned {fault}")
            raise WorkerBadResult(f"stage {self.index} ({self.device}): the worker returned {fault} for a Forward "
                                  f"of {n} tokens at {at}; the link is reset")
        self.memory.at = int(res.pos)
        self.worker_us += int(res.compute_us)
        if getattr(be, "xp", np) is not np:
            with be.device:
                hd = be.xp.asarray(h)
                out = self.model.head(hd, all_logits, on_device=on_device)
                return (out, be.rms_norm(hd, self.model.out_norm, self.model.config.rms_eps)) if hidden else out
        if hidden:           # the drafter's: the final-normed rows, beside the logits the head gives as always
            return self.model.head(h, all_logits), be.rms_norm(h, self.model.out_norm, self.model.config.rms_eps)
        return self.model.head(h, all_logits)

    def memory_info(self) -> dict[str, int]:
        return {}

    def status(self) -> dict[str, Any]:
        c = self.client
        return {"index": self.index, "layer_lo": self.carve.lo, "layer_hi": self.carve.hi, "device": self.device,
                "runner": self.runner_name, "memory": {},
                "link": {"up": c is not None, "epoch": self.epoch, "down_reason": self.down_reason,
                         "frames": c.frames if c else None,
                         "workers": [{"address": a, "layer_lo": cc.lo, "layer_hi": cc.hi} for a, cc in self.hops],
                         "rtt_ms": None if self.rtt_s is None else round(self.rtt_s * 1e3, 3),
                         "checkpoints_held": self.memory.held, "store_bytes": self.memory.store_bytes,
                         "bytes_sent": c.sent_bytes if c else 0, "bytes_received": c.received_bytes if c else 0}}
