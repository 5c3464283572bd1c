"""RemoteStage (a Stage whose layers run on a worker chain while the main keeps the output head; its memory is a
RemoteMemory, strata.stages.remote_memory: the state verbs spoken over the link) and parse_remote."""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import structlog

import link
from link import BatchForward, Forward, Hello, Hop, Result
from strata.memory import Carve
from strata.stages.link_client import (BACKOFF, PING_EVERY, SILENT_AFTER, LinkClient, LinkDown, WorkerBadResult,
                                       WorkerError, parse_address, result_fault, rows_fault,
                                       seq_fault)
from strata.stages.remote_memory import CheckpointGone, RemoteMemory
from strata.stages.stage import StageBase

__all__ = ["RemoteStage", "RemoteMemory", "CheckpointGone", "parse_remote"]

#: round trips the link's median (/status rtt_median_ms) is taken over: a single one reads the scheduler's wake-ups
RTT_WINDOW = 16

log = structlog.get_logger("strata.stages.remote")

def parse_remote(spec: str | None) -> list[str]:
    """--remote-stage 'HOST:PORT[,HOST:PORT...]' -> the addresses in chain order (checked); [] for None / ''."""
    if not spec:
        return []
    out = [a.strip() for a in str(spec).split(",")]
    for a in out:
        parse_address(a)
    return out


class RemoteStage(StageBase):
    """Stage of the layers `hops` run on a worker chain (--remote-stage A,B: A runs the first carve and relays to
    B). The main keeps the embeddings (on its local stages) and the output head: this stage sends the hidden
    states on, takes the last carve's back, and runs the final norm and the head on `model`'s backend. Its
    ``memory`` is a RemoteMemory: the state verbs spoken over this stage's link.

    The main decides positions and which checkpoints exist. With ``slots`` > 1 (--parallel) the worker holds one
    sequence per request slot (``+slots``), each addressed by its id, and a batched decode step of several slots is
    one BatchForward round trip (``forward_batch``), whose answer names each row's sequence and position where the
    worker announces ``+rowids`` (required with ``require_row_ids``), checked before a row is used; there, a lone
    Forward's answer (a verify, a prefill chunk) names its sequence too (a SeqResult), checked beside its position.
    A link failure fails the requests in flight (LinkDown); a background thread then reconnects with backoff, and
    the fresh worker state makes the engine start every live sequence and its checkpoints over (``lost``).
    """

    runner_name = "LinkClient"

    def __init__(self, index: int, hops: list[tuple[str, Carve]], model, *, fingerprint: str, n_ctx: int,
                 max_batch: int, ckpt_max: int, key: bytes | None = None, silent_after: float = SILENT_AFTER,
                 encrypt: bool = False, insecure: bool = False, slots: int = 1, require_row_ids: bool = False,
                 summary=None):
        self.index = index
        self.hops = [(a, Carve(c.lo, c.hi)) for a, c in hops]
        self.carve = Carve(self.hops[0][1].lo, self.hops[-1][1].hi)
        self.device = "remote:" + ",".join(a for a, _ in self.hops)
        self.model, self.backend = model, model.backend
        self.first, self.last = False, True
        self.fingerprint, self.n_ctx, self.max_batch, self.ckpt_max = fingerprint, int(n_ctx), int(max_batch), \
            int(ckpt_max)
        self.key, self.silent_after = key, silent_after
        self.slots = max(1, int(slots))
        self.encrypt, self.insecure = bool(encrypt), bool(insecure)
        self.require_row_ids = bool(require_row_ids)
        self.summary = summary               # the main's model file (an identity.ModelSummary) for a worker's refusal
        self.client: LinkClient | None = None
        self.epoch = 0                       # connections made; a RemotePart of another epoch is gone
        self.memory = RemoteMemory(self, recurrent=bool(model.new_running_state(self.carve)),
                                   n_embd=int(model.config.n_embd))
        self._io = threading.RLock()         # the engine thread and the heartbeat / reconnect thread
        self.down_reason: str | None = None
        self.rtt: tuple[float, str] | None = None      # the link's last round trip (s) and what measured it
        self.rtts: deque[float] = deque(maxlen=RTT_WINDOW)   # the recent round trips (s), pings and forwards
        self.last_forward: tuple[float, float] | None = None   # the last Forward / Result pair: (wall, compute) s
        self.commits = 0                     # Commits sent ahead (settled before the next prompt is read)
        self.worker_us = 0                   # the worker chain's own compute time over all Forwards (Result)
        self.batched_steps = self.batched_rows = 0   # BatchForward round trips, and the rows they carried
        self._stop = threading.Event()
        self._wake = threading.Event()       # set by close() and by the link going down: the keepalive acts at once
        self._connect()                      # WorkerRefused at start: `strata serve` exits naming the worker
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
                     nonce=b"", mac=b"", slots=self.slots, row_ids=self.slots > 1)

    def _connect(self) -> None:
        client = LinkClient(self.hops[0][0], self.key, silent_after=self.silent_after, encrypt=self.encrypt,
                            insecure=self.insecure, require_row_ids=self.require_row_ids, model=self.summary)
        ack = client.connect(self._hello())
        n_embd = int(self.model.config.n_embd)
        client.max_payload = max(1 << 20, max(self.max_batch, self.slots) * (n_embd * 4 + 16) + 4096)
        with self._io:
            self.client, self.epoch = client, self.epoch + 1
            self.memory.lost_all()
            self.down_reason, self.memory.held, self.memory.store_bytes = None, 0, 0
            self.memory.granted = int(ack.ckpt_max)
            self.rtts.clear()                # a new connection (perhaps another worker): its own round trips
        log.info("stage link up", stage=self.index, workers=[a for a, _ in self.hops], epoch=self.epoch,
                 ckpt_max=ack.ckpt_max, part_bytes=ack.part_bytes, worker=ack.worker, device=ack.device,
                 frames=client.frames)

    def _mark_down(self, why: str) -> None:
        with self._io:
            if self.client is None and self.down_reason is not None:
                return                      # already down: `why` is _live's refusal, which quotes the reason
            if self.client is not None:
                self.client.close()
            self.client = None
            if self.down_reason is None:
                log.warning("stage link down", stage=self.index, error=why)
            self.down_reason = why
            self._wake.set()

    def _keepalive(self) -> None:
        """Ping an idle link every PING_EVERY s (a dead worker is noticed between requests, so they get 503 at
        once); reconnect a down one with backoff, the first try BACKOFF[0] after it went down."""
        tries, up = 0, self.down_reason is None
        while True:
            self._wake.wait(PING_EVERY if up else BACKOFF[min(tries, len(BACKOFF) - 1)])
            self._wake.clear()
            if self._stop.is_set():
                return
            if self.down_reason is not None:
                if up:            # it went down since the last look (a request's fault, or this thread's ping)
                    up, tries = False, 0
                    if self._stop.wait(BACKOFF[0]):
                        return
                try:
                    self._connect()
                    tries, up = 0, True
                except LinkDown as e:
                    tries += 1
                    with self._io:
                        self.down_reason = str(e)
                continue
            up = True
            if not self._io.acquire(blocking=False):
                continue                          # the engine is using the link: its own waits ping
            try:
                if self.client is not None and self.client.unsettled == 0 and \
                        time.monotonic() - self.client.heard > PING_EVERY:
                    self._round_trip(self.client.ping(), "ping")
            except (LinkDown, WorkerError) as e:
                self._mark_down(str(e))
            finally:
                self._io.release()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
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

    def _timed_call(self, msg):
        """call(msg) -> (the answer, the pair's wall time in s), timed inside the link's lock (a ping of the
        keepalive thread is never counted)."""
        with self._io:
            t0 = time.perf_counter()
            res = self.call(msg)
            return res, time.perf_counter() - t0

    def _forwarded(self, wall_s: float, compute_us: int) -> None:
        """Record a Forward / Result (or batched) pair: its wall time, the compute the worker chain reports in the
        answer, and the link's round trip from traffic, the one less the other (the idle pings measure it between
        requests; this while they flow)."""
        compute_s = int(compute_us) / 1e6
        self.last_forward = (wall_s, compute_s)
        self._round_trip(max(0.0, wall_s - compute_s), "forward")

    def _round_trip(self, s: float, source: str) -> None:
        self.rtt = (s, source)
        self.rtts.append(s)

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

    def lost(self, sid: int = 0) -> bool:
        """Whether the worker's part of live sequence `sid` is gone (the link reconnected since)."""
        return self.memory.seqs[sid].epoch != self.epoch

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
        at = self.memory.seqs[sid].at
        if self.client is not None and self.client.unsettled:
            # a verify's Commit is in flight: a worker may apply it late (while expert swaps finish), so it lands
            # before the next Forward is sent
            self.settle()
        c = self.client          # the link this Forward goes over (call raises LinkDown when there is none)
        res, wall = self._timed_call(Forward(pos=at, want_all=bool(all_logits), tokens=toks, hidden=x, seq=sid))
        if not isinstance(res, Result) or res.pos != at + n:
            self._mark_down(f"answered a Forward at {at} of {n} tokens with "
                            f"{type(res).__name__} at {getattr(res, 'pos', '?')}")
            raise LinkDown(f"stage {self.index} ({self.device}): the worker lost step with the main")
        h = res.hidden
        # the sequence id (+rowids) first: a worker (or relay) that answered with another sequence's rows at the
        # same position is named as such
        fault = seq_fault(res, sid, c is not None and c.row_ids) or result_fault(h, n if all_logits else 1,
                                                                               int(self.model.config.n_embd))
        if fault is not None:        # the worker's state is not to be trusted: a fresh link, the sequence read again
            self._mark_down(f"returned {fault}")
            raise WorkerBadResult(f"stage {self.index} ({self.device}): the worker returned {fault} for a Forward "
                                  f"of {n} tokens of sequence {sid} at {at}; the link is reset")
        self.memory.seqs[sid].at = int(res.pos)
        self.worker_us += int(res.compute_us)
        self._forwarded(wall, res.compute_us)
        if res.dropped:                   # parts the worker dropped to fit this Forward: forgotten at once
            self.memory.dropped(res.dropped)
        if getattr(be, "xp", np) is not np:
            with be.device:
                hd = be.xp.asarray(h)
                out = self.model.head(hd, all_logits, on_device=on_device)
                return (out, be.rms_norm(hd, self.model.out_norm, self.model.config.rms_eps)) if hidden else out
        if hidden:           # the drafter's: the final-normed rows, beside the logits the head gives as always
            return self.model.head(h, all_logits), be.rms_norm(h, self.model.out_norm, self.model.config.rms_eps)
        return self.model.head(h, all_logits)

    def forward_batch(self, tokens: np.ndarray, sids: list[int], x_in=None, hidden: bool = False,
                      on_device: bool = False):
        """One decode step of several sequences in one round trip (``+slots``): a BatchForward of every row (its
        sequence id, position, token and hidden row), the worker chain's rows back in one BatchResult, then the head
        over them -> host float32 logits (N, n_vocab) (on_device too), row i bit-identical to ``forward([tokens[i]],
        sids[i])`` (the worker's batched step keeps that per row, and so does the head). One row, or a worker
        without ``+slots``: StageBase's lone forwards. hidden: (those logits, the final-normed rows), as ``forward``
        gives them."""
        toks = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(-1))
        sids = [int(q) for q in sids]
        c = self.client
        if len(sids) == 1 or c is None or link.CAP_SLOTS not in c.caps:
            return super().forward_batch(toks, sids, x_in, hidden)
        n = len(sids)
        if toks.shape[0] != n or len(set(sids)) != n:
            raise ValueError(f"a batched step takes one token per distinct sequence (got {toks.shape[0]} tokens for "
                             f"sequences {sids})")
        be = self.backend
        x = np.ascontiguousarray(x_in if isinstance(x_in, np.ndarray) else be.to_host(x_in), dtype=np.float32)
        at = [self.memory.seqs[q].at for q in sids]
        if c.unsettled:
            self.settle()
        res, wall = self._timed_call(BatchForward(seqs=sids, positions=at, tokens=toks, hidden=x))
        n_embd = int(self.model.config.n_embd)
        # the rows' ids (+rowids) first: a worker that swapped, dropped or repeated a row is named as such
        fault = rows_fault(res, sids, at, c.row_ids) or result_fault(res.hidden, n, n_embd)
        if fault is not None:
            self._mark_down(f"returned {fault}")
            raise WorkerBadResult(f"stage {self.index} ({self.device}): the worker returned {fault} (a batched "
                                  f"step of {n} sequences); the link is reset")
        for q, p in zip(sids, at):
            self.memory.seqs[q].at = p + 1
        self.worker_us += int(res.compute_us)
        self._forwarded(wall, res.compute_us)
        self.batched_steps += 1
        self.batched_rows += n
        if res.dropped:
            self.memory.dropped(res.dropped)
        h = res.hidden
        eps = self.model.config.rms_eps
        if getattr(be, "xp", np) is not np:
            with be.device:
                hd = be.xp.asarray(h)
                out = self.model.head(hd, True)     # host logits of every row
                return (out, be.rms_norm(hd, self.model.out_norm, eps)) if hidden else out
        if hidden:           # the drafters': the final-normed rows, beside the logits the head gives as always
            return self.model.head(h, True), be.rms_norm(h, self.model.out_norm, eps)
        return self.model.head(h, True)

    def memory_info(self) -> dict[str, int]:
        return {}

    def status(self) -> dict[str, Any]:
        """The stage's report (/status): its carve and the link's. rtt_ms: the link's last round trip (rtt_median_ms:
        the median of this connection's last rtt_samples, at most RTT_WINDOW, of either kind), rtt_from what
        measured it: "ping" (an idle link's ping) or "forward" (a Forward's wall time less the compute the
        worker reported for it: the frames' transfer and coding to and from the first worker, measured while
        requests flow; a relay's time on its next hop is inside the compute it reports); None before either. last_forward_ms / last_forward_compute_ms: the last Forward / Result pair's wall time and the
        worker chain's compute in it."""
        c = self.client
        rtt, fwd, recent = self.rtt, self.last_forward, list(self.rtts)
        ms = lambda s: round(s * 1e3, 3)  # noqa: E731
        return {"index": self.index, "layer_lo": self.carve.lo, "layer_hi": self.carve.hi, "device": self.device,
                "runner": self.runner_name, "memory": {},
                "link": {"up": c is not None, "epoch": self.epoch, "down_reason": self.down_reason,
                         "frames": c.frames if c else None,
                         "workers": [{"address": a, "layer_lo": cc.lo, "layer_hi": cc.hi} for a, cc in self.hops],
                         "rtt_ms": None if rtt is None else ms(rtt[0]), "rtt_from": None if rtt is None else rtt[1],
                         "rtt_median_ms": ms(statistics.median(recent)) if recent else None,
                         "rtt_samples": len(recent),
                         "last_forward_ms": None if fwd is None else ms(fwd[0]),
                         "last_forward_compute_ms": None if fwd is None else ms(fwd[1]),
                         "checkpoints_held": self.memory.held, "store_bytes": self.memory.store_bytes,
                         "slots": self.slots, "row_ids": bool(c.row_ids) if c else None,
                         "batched_steps": self.batched_steps,
                         "batched_rows": self.batched_rows,
                         "bytes_sent": c.sent_bytes if c else 0, "bytes_received": c.received_bytes if c else 0}}
