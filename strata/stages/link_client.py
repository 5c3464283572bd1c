"""The main side of one stage link: LinkClient (one TCP connection to a worker: the hello, calls answered in order,
Commits sent ahead and settled later, pings while waiting), a kept part's bytes streamed in chunks (get_part /
put_part, ``+park``), the link's errors (a worker's bad result: result_fault, rows_fault) and the worker's
address."""
from __future__ import annotations

import itertools
import secrets
import select
import socket
import time
from typing import Any

import numpy as np
import structlog

import link
from link import (Challenge, Error, ErrorCode, Hello, HelloAck, LinkError, PartData, PartGet, PartPut, Ping, Pong,
                  FLAG_ASYNC)
from strata.errors import EngineFault, Unavailable, quoted
from strata.gguf import identity

log = structlog.get_logger("strata.stages.remote")

PING_EVERY = 1.0          # seconds without a frame before the waiting side pings
SILENT_AFTER = 10.0       # seconds without any frame (a Pong included) before the link counts as down
CONNECT_TIMEOUT = 5.0     # connecting and the hello
HANDSHAKE_MAX = 64 * 1024  # payload bytes a Challenge / Hello / HelloAck may have
BACKOFF = (0.1, 0.2, 0.5, 1.0, 2.0)   # seconds between reconnection attempts (the last one repeats)
PART_CHUNK = 512 * 1024   # bytes of a part in one PartData / PartPut frame (under every side's 1 MiB payload floor)


class LinkDown(Unavailable):
    """The link to a worker failed (closed, silent, a bad frame, a refused hello); one line naming the worker."""

    code = "worker_unavailable"


class WorkerRefused(LinkDown):
    """The worker refused the link at the hello (another model or carve, its limits, the link key, the protocol
    version), or did not answer it."""


class WorkerError(Unavailable):
    """The worker answered a request with an Error (its link error code, a one-line message)."""

    code = "worker_error"

    def __init__(self, link_code: int, message: str):
        super().__init__(message)
        self.link_code = int(link_code)


class WorkerBadResult(EngineFault):
    """A worker's Result broke what the hello agreed (float32 rows of n_embd, one per token asked for, finite values):
    the link is reset and the request fails with HTTP 502 (code worker_bad_result), an engine error, not the
    client's."""

    status = 502
    code = "worker_bad_result"


def result_fault(h, rows: int, n_embd: int) -> str | None:
    """What is wrong with a Result's hidden states for `rows` rows of width n_embd, or None."""
    if not isinstance(h, np.ndarray):
        return f"a {type(h).__name__} in place of hidden states"
    if h.dtype != np.float32:
        return f"hidden states of dtype {h.dtype} (the hello agreed on f32)"
    if h.shape != (rows, n_embd):
        return f"hidden states of shape {tuple(h.shape)} where ({rows}, {n_embd}) were asked for"
    finite = np.isfinite(h)
    if not finite.all():
        n_nan = int(np.isnan(h).sum())
        return f"non-finite hidden states ({n_nan} NaN, {int(h.size - finite.sum()) - n_nan} infinite values)"
    return None



def rows_fault(res, seqs: list[int], positions: list[int], row_ids: bool) -> str | None:
    """What is wrong with the ids of a BatchForward's answer `res` (the hidden rows checked apart, result_fault), for
    the rows of sequences `seqs` at `positions`, or None: with ``row_ids`` agreed at the hello it must be a BatchRows
    naming exactly those rows in that order; without, a plain BatchResult."""
    if not isinstance(res, link.BatchResult):
        return f"a {type(res).__name__} to a BatchForward"
    if not row_ids:
        return None if type(res) is link.BatchResult else \
            f"a {type(res).__name__} to a BatchForward (row ids were not asked for at the hello)"
    if not isinstance(res, link.BatchRows):
        return "a BatchResult without row ids (they were agreed at the hello)"
    want = list(zip(seqs, positions))
    got = list(zip(res.seqs, res.positions))
    if got == want:
        return None
    if len(got) != len(want):
        return f"ids of {len(got)} rows for a batched step of {len(want)}"
    i = next(k for k, (g, w) in enumerate(zip(got, want)) if g != w)
    return (f"row {i} named as sequence {got[i][0]} at position {got[i][1]}, where sequence {want[i][0]} at "
            f"{want[i][1]} was asked")


def seq_fault(res, seq: int, row_ids: bool) -> str | None:
    """What is wrong with the sequence id of a Forward's answer `res` (a Result; its pos and hidden rows checked
    apart) for sequence `seq`, or None: with ``row_ids`` agreed at the hello it must be a SeqResult naming `seq`;
    without, a plain Result."""
    if not row_ids:
        return None if type(res) is link.Result else \
            f"a {type(res).__name__} to a Forward (row ids were not asked for at the hello)"
    if not isinstance(res, link.SeqResult):
        return "a Result without its sequence id (row ids were agreed at the hello)"
    if res.seq != seq:
        return f"the rows of sequence {res.seq} where sequence {seq}'s were asked"
    return None


def parse_address(addr: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPv6]:PORT' -> (host, port); ValueError (one line) otherwise."""
    s = str(addr).strip()
    host, sep, port = s.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"'{quoted(str(addr), 100)}' is not HOST:PORT (a port in 1..65535)")
    return host, int(port)




class LinkClient:
    """One connection to one worker, used by one thread at a time (the engine thread; on a relay, its executor).

    ``call`` sends a request and returns its reply (an Error reply raises WorkerError); ``post`` sends one with the
    ASYNC flag and returns at once; ``settle`` waits for every posted reply. While waiting the client pings a quiet
    worker every PING_EVERY seconds and gives up (LinkDown) after SILENT_AFTER seconds without a frame: a worker
    that computes answers Pings from its event loop, a dead or frozen one does not.

    With a key every frame after the hello is authenticated (encrypted with ``encrypt``, or when the worker
    requires it); ``insecure`` accepts a worker that does not protect frames (plain frames, as without a key).

    A Hello that asks for row ids (``row_ids``) keeps asking only a worker that announces ``+rowids`` (``row_ids``
    tells what was agreed); ``require_row_ids`` refuses one that does not, where the Hello asked. ``model``: this
    side's model summary; a worker that refuses it for another model is refused naming what differs.
    """

    def __init__(self, address: str, key: bytes | None = None, *, silent_after: float = SILENT_AFTER,
                 connect_timeout: float = CONNECT_TIMEOUT, encrypt: bool = False, insecure: bool = False,
                 require_row_ids: bool = False, model: identity.ModelSummary | None = None):
        self.address = quoted(str(address), 300)  # as messages name it (a relay's comes from its main's Hello)
        self.host, self.port = parse_address(address)
        if encrypt and key is None:
            raise ValueError("--link-encrypt needs the link key (--link-key-file): the frame keys derive from it")
        self.key = key
        self.encrypt, self.insecure = bool(encrypt), bool(insecure)
        self.frames = link.FRAMES_PLAIN           # the protection negotiated at the hello
        self.channel: link.Channel | None = None
        self.silent_after, self.connect_timeout = float(silent_after), float(connect_timeout)
        self.sock: socket.socket | None = None
        self.max_payload = link.DEFAULT_MAX_PAYLOAD
        self._rid = itertools.count(2)            # the Hello is request 1
        self._posted: dict[int, Any] = {}       # rid -> None (awaited) or its reply
        self.heard = time.monotonic()
        self.sent_bytes = self.received_bytes = 0
        self.ack: HelloAck | None = None
        self.caps: set[str] = set()              # the capabilities the worker's Challenge announced
        self.require_row_ids = bool(require_row_ids)
        self.model = model                       # this side's model: a worker's refusal of it names what differs
        self.row_ids = False      # the worker answers BatchForward / Forward with BatchRows / SeqResult (hello)

    # ---- the hello -----------------------------------------------------------------------------------------
    def connect(self, hello: Hello) -> HelloAck:
        """Connect, answer the worker's Challenge with `hello` (its nonce and mac filled in here) and check the
        HelloAck. WorkerRefused (one line naming the worker and the reason) for anything but a good ack."""
        who = f"worker {self.address}"
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except (OSError, UnicodeError) as e:      # UnicodeError: a host name IDNA cannot encode
            raise WorkerRefused(f"{who}: cannot connect: {quoted(str(getattr(e, 'strerror', None) or e))}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _, ch = link.recv_frame(sock, HANDSHAKE_MAX)
            if isinstance(ch, Error):
                raise WorkerRefused(f"{who} refused the link: {quoted(ch.message)}")
            if not isinstance(ch, Challenge):
                raise WorkerRefused(f"{who} opened with {type(ch).__name__}, not a Challenge")
            if ch.keyed and self.key is None:
                raise WorkerRefused(f"{who} requires the link key: give --link-key-file")
            if self.key is not None and not ch.keyed:
                raise WorkerRefused(f"{who} has no link key while this side has one: start it with --link-key-file")
            frames = link.FRAMES_PLAIN
            if self.key is not None:
                try:
                    frames = link.main_frames(link.split_challenge_name(ch.worker)[1], encrypt=self.encrypt,
                                              insecure=self.insecure)
                except LinkError as e:
                    raise WorkerRefused(f"{who} {e}") from None
            caps = link.split_challenge_name(ch.worker)[1]
            if int(getattr(hello, "slots", 1)) > 1 and link.CAP_SLOTS not in caps:
                raise WorkerRefused(f"{who} does not announce +slots (an older strata worker holds one sequence): "
                                    f"--parallel {hello.slots} needs a worker that holds one per slot; upgrade it or "
                                    f"use --parallel 1")
            if hello.row_ids and link.CAP_ROWIDS not in caps:
                if self.require_row_ids:
                    raise WorkerRefused(f"{who} does not announce +rowids (an older strata worker): it cannot name "
                                        f"the rows of a batched step, which --require-row-ids asks for; upgrade it")
                hello.row_ids = False
            hello.nonce, hello.mac = secrets.token_bytes(32), b""
            if self.key is not None:
                hello.mac = link.hello_mac(self.key, ch.nonce, hello, frames)
            link.send_frame(sock, hello, 1)
            _, ack = link.recv_frame(sock, HANDSHAKE_MAX)
            if isinstance(ack, Error):
                theirs = identity.parse_refusal(ack.message) if ack.code == ErrorCode.MODEL else None
                if theirs is not None and self.model is not None:
                    raise WorkerRefused(f"{who} {identity.mismatch(theirs, self.model)}")
                raise WorkerRefused(f"{who} refused the hello: {quoted(ack.message)}")
            if not isinstance(ack, HelloAck):
                raise WorkerRefused(f"{who} answered the hello with {type(ack).__name__}")
            if self.key is not None and not link.verify(link.ack_mac(self.key, hello.nonce, ack, frames), ack.mac):
                raise WorkerRefused(f"{who} could not prove it holds the link key")
            if (ack.lo, ack.hi) != (hello.lo, hello.hi) or ack.fingerprint != hello.fingerprint:
                raise WorkerRefused(f"{who} acknowledged layers [{ack.lo}, {ack.hi}) of model {ack.fingerprint[:12]}, "
                                    f"not [{hello.lo}, {hello.hi}) of {hello.fingerprint[:12]}")
        except WorkerRefused:
            sock.close()
            raise
        except link.VersionMismatch as e:
            sock.close()
            raise WorkerRefused(f"{who}: {e}") from None
        except (TimeoutError, socket.timeout):
            sock.close()
            raise WorkerRefused(f"{who} stayed silent for {self.connect_timeout:g} s at the hello") from None
        except LinkError as e:
            sock.close()
            raise WorkerRefused(f"{who} sent a bad frame at the hello: {e}") from None
        except OSError as e:            # ConnectionError included: it closed the link
            sock.close()
            raise WorkerRefused(f"{who} closed the link at the hello ({e.strerror or e or type(e).__name__})") \
                from None
        sock.settimeout(self.silent_after)      # inside a frame: silence past this is a failure
        self.frames = frames
        self.channel = None if self.key is None else link.channel_for("main", self.key, ch.nonce, hello.nonce, frames)
        if self.key is not None and frames == link.FRAMES_PLAIN:
            log.warning("stage link frames are not authenticated (--insecure-link)", worker=self.address)
        self.sock, self.ack, self.heard = sock, ack, time.monotonic()
        self.caps = link.split_challenge_name(ch.worker)[1]
        self.row_ids = bool(hello.row_ids)
        return ack

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
        self._posted.clear()

    # ---- requests -------------------------------------------------------------------------------------------
    def call(self, msg) -> Any:
        """Send `msg` and return its reply (Error -> WorkerError; link failures -> LinkDown)."""
        return self._wait(self._send(msg, 0))

    def post(self, msg) -> None:
        """Send `msg` with the ASYNC flag; its reply is taken by ``settle`` (or any later wait)."""
        self._posted[self._send(msg, FLAG_ASYNC)] = None

    @property
    def unsettled(self) -> int:
        return len(self._posted)

    def settle(self) -> None:
        """Wait for the replies of every posted request; the first Error among them raises WorkerError."""
        first_error = None
        for rid in list(self._posted):
            try:
                self._wait(rid)
            except WorkerError as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def ping(self) -> float:
        """A Ping answered -> the round trip in seconds."""
        t0 = time.perf_counter()
        self.call(Ping(nonce=secrets.randbits(63)))
        return time.perf_counter() - t0

    def _down(self, why: str):
        self.close()
        raise LinkDown(f"worker {self.address}: {why}")

    def _send(self, msg, flags: int) -> int:
        if self.sock is None:
            raise LinkDown(f"worker {self.address}: the link is down")
        rid = next(self._rid)
        try:
            self.sent_bytes += link.send_frame(self.sock, msg, rid, flags, channel=self.channel)
        except OSError as e:
            self._down(f"sending failed ({e.strerror or e or type(e).__name__})")
        return rid

    def _wait(self, rid: int) -> Any:
        if rid in self._posted and self._posted[rid] is not None:
            return self._checked(self._posted.pop(rid))
        while True:
            if self.sock is None:
                raise LinkDown(f"worker {self.address}: the link is down")
            ready, _, _ = select.select([self.sock], [], [], PING_EVERY)
            if not ready:
                quiet = time.monotonic() - self.heard
                if quiet > self.silent_after:
                    self._down(f"sent nothing for {quiet:.1f} s")
                try:
                    link.send_frame(self.sock, Ping(nonce=0), 0, channel=self.channel)
                except OSError as e:
                    self._down(f"sending failed ({e.strerror or e or type(e).__name__})")
                continue
            try:
                hdr, msg = link.recv_frame(self.sock, self.max_payload, self.channel)
            except (TimeoutError, socket.timeout):
                self._down(f"went silent inside a frame for {self.silent_after:g} s")
            except LinkError as e:
                self._down(f"sent a bad frame: {e}")
            except OSError as e:        # ConnectionError: it closed the link
                self._down(f"closed the link ({e.strerror or e or type(e).__name__})")
            self.heard = time.monotonic()
            self.received_bytes += link.HEADER_SIZE + hdr.payload_len + link.TRAILER_SIZE + \
                (0 if self.channel is None else link.TAG_SIZE)
            if hdr.request_id == rid:
                self._posted.pop(rid, None)
                return self._checked(msg)
            if isinstance(msg, Pong):
                continue
            if isinstance(msg, Ping):
                link.send_frame(self.sock, Pong(nonce=msg.nonce), hdr.request_id, channel=self.channel)
                continue
            if hdr.request_id in self._posted:
                self._posted[hdr.request_id] = msg
                continue
            if isinstance(msg, link.Bye):
                self._down(f"closed the link: {quoted(msg.reason)}")
            if isinstance(msg, Error):
                self._down(f"failed: {quoted(msg.message)}")
            self._down(f"sent a {type(msg).__name__} that answers no request")

    def _checked(self, msg):
        if isinstance(msg, Error):
            raise WorkerError(msg.code, f"worker {self.address}: {quoted(msg.message)}")
        return msg




def get_part(call, ckpt_id: int, limit: int, prefix: bool = False) -> bytes:
    """The bytes of the kept part `ckpt_id` (PartGet chunk by chunk through `call`, a LinkClient's or a stage's;
    prefix: its K/V as a prefix, running state only):
    LinkDown-like errors propagate; a worker answer that is not the next chunk, or a part over `limit` bytes, is a
    WorkerBadResult."""
    buf = bytearray()
    total = None
    while total is None or len(buf) < total:
        res = call(PartGet(ckpt_id=int(ckpt_id), offset=len(buf), prefix=bool(prefix)))
        if not isinstance(res, PartData) or res.offset != len(buf) or (total is not None and res.total != total) \
                or res.total > limit or len(buf) + int(res.data.shape[0]) > res.total \
                or (res.data.shape[0] == 0 and len(buf) < res.total):
            raise WorkerBadResult(f"the worker answered PartGet({ckpt_id}) at {len(buf)} with "
                                  f"{type(res).__name__} {getattr(res, 'offset', '?')}/{getattr(res, 'total', '?')}")
        total = int(res.total)
        buf += res.data.tobytes()
    return bytes(buf)


def put_part(call, ckpt_id: int, pos: int, blob: bytes, keep: list[int], seq: int = 0):
    """Send `blob` (a part's bytes as get_part gives them) to be kept under `ckpt_id` at `pos` (PartPut chunk by
    chunk through `call`; a prefix part takes the first pages of sequence `seq`) -> the last chunk's Ack (the worker
    read and kept the part)."""
    data = np.frombuffer(blob, np.uint8)
    total, off, ack = len(blob), 0, None
    while True:
        chunk = data[off:off + PART_CHUNK]
        ack = call(PartPut(ckpt_id=int(ckpt_id), pos=int(pos), total=total, offset=off, data=chunk, keep=list(keep),
                           seq=int(seq)))
        off += int(chunk.shape[0])
        if off >= total:
            return ack
