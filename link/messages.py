"""The stage link's messages (protocol 5): their dataclasses and their payload encodings, field by field."""
from __future__ import annotations

import operator
import struct
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Union

import numpy as np

from .errors import ErrorCode, FrameError, LinkError

__all__ = [
    "MsgType", "ErrorCode", "Hop", "Challenge", "Hello", "HelloAck", "Forward", "Result", "Commit", "Reset",
    "CkptSave", "CkptRestore", "PartGet", "PartData", "PartPut", "Ack", "Error", "Ping", "Pong", "Bye", "BatchForward",
    "BatchResult", "BatchRows", "SeqResult", "Message", "REPLY", "TENSOR_TYPES", "MAX_ROWS",
    "MAX_STR", "NONCE_SIZE", "MAC_SIZE", "MAX_NDIM", "MAX_ELEMENTS", "TENSOR_ALIGN", "DTYPE_CODES",
    "encode_payload", "decode_message", "msg_type", "same",
]


class MsgType(IntEnum):
    """The u16 `type` field of a frame header."""
    HELLO = 1
    HELLO_ACK = 2
    FORWARD = 3
    RESULT = 4
    COMMIT = 5
    RESET = 6
    CKPT_SAVE = 7
    CKPT_RESTORE = 8
    ERROR = 9
    PING = 10
    PONG = 11
    BYE = 12
    CHALLENGE = 13
    ACK = 14
    PART_GET = 15
    PART_DATA = 16
    PART_PUT = 17
    BATCH_FORWARD = 18
    BATCH_RESULT = 19
    BATCH_ROWS = 20
    SEQ_RESULT = 21


# The reply each request gets (or an Error instead), in the order the requests were sent (when the Hello asked for
# row ids, +rowids, a BatchForward's is a BATCH_ROWS instead and a Forward's a SEQ_RESULT).
REPLY = {MsgType.HELLO: MsgType.HELLO_ACK, MsgType.FORWARD: MsgType.RESULT, MsgType.COMMIT: MsgType.ACK,
         MsgType.RESET: MsgType.ACK, MsgType.CKPT_SAVE: MsgType.ACK, MsgType.CKPT_RESTORE: MsgType.ACK,
         MsgType.PING: MsgType.PONG, MsgType.PART_GET: MsgType.PART_DATA, MsgType.PART_PUT: MsgType.ACK,
         MsgType.BATCH_FORWARD: MsgType.BATCH_RESULT}
# The only messages that carry tensors: their payloads may use the whole frame limit, the others a small one.
TENSOR_TYPES = frozenset({MsgType.FORWARD, MsgType.RESULT, MsgType.PART_DATA, MsgType.PART_PUT, MsgType.BATCH_FORWARD,
                          MsgType.BATCH_RESULT, MsgType.BATCH_ROWS, MsgType.SEQ_RESULT})

MAX_STR = 4096               # bytes of UTF-8 in one string field
NONCE_SIZE = 32              # a nonce is 32 raw bytes, no length prefix
MAC_SIZE = 32                # an HMAC-SHA256; a mac field is empty (no key) or this long
MAX_NDIM = 4
MAX_ELEMENTS = 1 << 48       # a tensor's element count with each zero dimension counted as 1
TENSOR_ALIGN = 16            # tensor data starts at a multiple of this from the payload's start
DTYPE_CODES = {0: np.dtype("<f4"), 1: np.dtype("<f2"), 2: np.dtype("<i4"), 3: np.dtype("<i8"), 4: np.dtype("|u1")}
_CODE_OF = {dt.str: code for code, dt in DTYPE_CODES.items()}
_RESERVED_DTYPES = {5: "bfloat16"}
MAX_ROWS = 256               # rows (sequences) one BatchForward carries at most


def same(a, b) -> bool:
    """Field equality for messages: numpy arrays are equal when dtype, shape and bytes are; lists item by item."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class _Message:
    """Base of the message dataclasses: equality through `same`, unhashable (the fields are mutable)."""
    __slots__ = ()

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return all(same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    __hash__ = None  # type: ignore[assignment]


@dataclass
class Hop:
    """One worker of the relay chain after the addressed worker: where it listens and the layers it runs."""
    host: str
    port: int
    lo: int
    hi: int


@dataclass(eq=False)
class Challenge(_Message):
    """Worker -> main, first frame after accept: a fresh nonce, whether a key is required, the worker's name."""
    nonce: bytes
    keyed: bool
    worker: str


@dataclass(eq=False)
class Hello(_Message):
    """Main -> worker: protocol, model fingerprint, carve [lo, hi), geometry, limits, the relay chain after this
    worker, the main's nonce and the HMAC over the challenge nonce and this payload (empty without a key)."""
    protocol: int
    fingerprint: str
    lo: int
    hi: int
    n_blocks: int
    n_embd: int
    act_dtype: str
    n_ctx: int
    max_batch: int
    ckpt_max: int
    next_hops: list
    nonce: bytes
    mac: bytes = b""
    slots: int = 1          # (+slots) sequences the worker holds for this main, ids 0..slots-1; an optional last field
    row_ids: bool = False   # (+rowids) answer each BatchForward with BatchRows; optional, after slots (so slots > 1)


@dataclass(eq=False)
class HelloAck(_Message):
    """Worker -> main: what the worker (and its chain) accepted, and the HMAC over the hello's nonce and this."""
    protocol: int
    fingerprint: str
    lo: int
    hi: int
    ckpt_max: int
    part_bytes: int
    worker: str
    device: str
    mac: bytes = b""


@dataclass(eq=False)
class Forward(_Message):
    """Main -> worker: run n tokens of sequence `seq` at `pos` through the worker's layers; want_all asks for every
    row, else the last one."""
    pos: int
    want_all: bool
    tokens: np.ndarray
    hidden: np.ndarray
    seq: int = 0            # (+slots) the sequence addressed; an optional last field, absent for sequence 0


@dataclass(eq=False)
class Result(_Message):
    """Worker -> main: the hidden rows out of the chain's last layer, the position after the forward, compute time;
    dropped (``+drops``): the ids of kept parts the chain dropped to make room for this Forward (an optional last
    field, present only when not empty: a Result that drops nothing is the same bytes as before)."""
    pos: int
    compute_us: int
    hidden: np.ndarray
    dropped: list = field(default_factory=list)


@dataclass(eq=False)
class Commit(_Message):
    """Main -> worker: keep positions [0, pos) of sequence `seq`, drop the rest. Usually ASYNC."""
    pos: int
    seq: int = 0


@dataclass(eq=False)
class Reset(_Message):
    """Main -> worker: start sequence `seq` again at position 0; keep only the checkpoint ids listed."""
    keep: list = field(default_factory=list)
    seq: int = 0


@dataclass(eq=False)
class CkptSave(_Message):
    """Main -> worker: save the worker's part of sequence `seq` as checkpoint `ckpt_id` at `pos`, then keep only
    the ids listed."""
    ckpt_id: int
    pos: int
    keep: list = field(default_factory=list)
    seq: int = 0


@dataclass(eq=False)
class CkptRestore(_Message):
    """Main -> worker: restore checkpoint `ckpt_id` (taken at `pos`) into sequence `seq`, then keep only the ids
    listed."""
    ckpt_id: int
    pos: int
    keep: list = field(default_factory=list)
    seq: int = 0


@dataclass(eq=False)
class PartGet(_Message):
    """Main -> worker (``+park``): the bytes of checkpoint part `ckpt_id` from `offset` on (the worker chain's
    state-part blocks in layer order, each in the state-part byte format); prefix: its K/V as a prefix of the
    conversation it travels with (running state only)."""
    ckpt_id: int
    offset: int
    prefix: bool = False


@dataclass(eq=False)
class PartData(_Message):
    """Worker -> main, the reply to PartGet: `total` bytes in the part, `offset` of this chunk, the chunk."""
    total: int
    offset: int
    data: np.ndarray


@dataclass(eq=False)
class PartPut(_Message):
    """Main -> worker (``+park``): a chunk of a part's bytes (as PartData gives them) for checkpoint `ckpt_id` at
    `pos`; the chunk that reaches `total` makes the worker read and keep it under that id, then keep only the ids
    listed (Ack); the earlier chunks are acknowledged as they arrive. A prefix part takes the first pages of
    sequence `seq`."""
    ckpt_id: int
    pos: int
    total: int
    offset: int
    data: np.ndarray
    keep: list = field(default_factory=list)
    seq: int = 0


@dataclass(eq=False)
class Ack(_Message):
    """Worker -> main, the reply to Commit / Reset / CkptSave / CkptRestore: position now, parts held, their bytes."""
    pos: int
    held: int
    store_bytes: int


@dataclass(eq=False)
class Error(_Message):
    """Either way: the request (or the link) failed; `code` is an ErrorCode, `message` one line."""
    code: int
    message: str

    @classmethod
    def of(cls, e: BaseException) -> "Error":
        """The Error to send for an exception: its LinkError code (else INTERNAL), its first line clipped to MAX_STR
        bytes of UTF-8."""
        code = e.code if isinstance(e, LinkError) and 0 <= int(e.code) < 1 << 16 else ErrorCode.INTERNAL
        text = (str(e).splitlines() or [type(e).__name__])[0]
        raw = text.encode("utf-8", "replace")[:MAX_STR]
        return cls(code, raw.decode("utf-8", "ignore"))


@dataclass(eq=False)
class Ping(_Message):
    """Main -> worker: are you there; the Pong echoes the nonce."""
    nonce: int


@dataclass(eq=False)
class Pong(_Message):
    """Worker -> main, the reply to Ping with its nonce."""
    nonce: int


@dataclass(eq=False)
class Bye(_Message):
    """Either way, no reply: the sender closes the link after this frame."""
    reason: str = ""


@dataclass(eq=False)
class BatchForward(_Message):
    """Main -> worker (``+slots``): one decode step of several sequences: row i is token ``tokens[i]`` of sequence
    ``seqs[i]`` at position ``positions[i]`` with its hidden row ``hidden[i]`` (distinct sequences)."""
    seqs: list
    positions: list
    tokens: np.ndarray
    hidden: np.ndarray


@dataclass(eq=False)
class BatchResult(_Message):
    """Worker -> main, the reply to BatchForward: each row's hidden state out of the chain's last layer (row i
    bit-identical to that sequence's lone one-token Forward), compute time, and (``+drops``) the kept parts
    dropped to make room."""
    compute_us: int
    hidden: np.ndarray
    dropped: list = field(default_factory=list)


@dataclass(eq=False)
class BatchRows(BatchResult):
    """Worker -> main (``+rowids``), the reply to BatchForward when the Hello asked for row ids: a BatchResult that
    names, for each hidden row, the sequence it was read for and the position its token was read at (the request's
    rows, as the worker chain's last step produced them); the main checks them against what it asked."""
    seqs: list = field(default_factory=list)
    positions: list = field(default_factory=list)


@dataclass(eq=False)
class SeqResult(Result):
    """Worker -> main (``+rowids``), the reply to Forward when the Hello asked for row ids: a Result that names the
    sequence its rows were read for (as the worker chain's last step read them); the main checks it against the
    Forward's ``seq``, beside ``pos``."""
    seq: int = 0


Message = Union[Challenge, Hello, HelloAck, Forward, Result, Commit, Reset, CkptSave, CkptRestore, PartGet, PartData,
                PartPut, Ack, Error, Ping, Pong, Bye, BatchForward, BatchResult, BatchRows, SeqResult]

# Field kinds: bool (u8 0/1), u16, u32, u64, str (u16 length + UTF-8), nonce (32 raw bytes), mac (u16 length + 0 or
# 32 raw bytes), ids (u32 count + u64 each; more_ids: the same as an optional last field, absent when empty), hops
# (u32 count + Hop each), tokens / hidden (a tensor; see PROTOCOL.md); seq / slots (an optional last u32, absent
# when it is its default, 0 / 1); flag (an optional last bool, absent when false, present as 1); rows (u32 count +
# (u32 seq, u32 pos) each, read into two lists).
_LAYOUT: dict[type, tuple[MsgType, tuple[tuple[str, str], ...]]] = {
    Hello: (MsgType.HELLO, (("protocol", "u16"), ("fingerprint", "str"), ("lo", "u32"), ("hi", "u32"),
                            ("n_blocks", "u32"), ("n_embd", "u32"), ("act_dtype", "str"), ("n_ctx", "u32"),
                            ("max_batch", "u32"), ("ckpt_max", "u32"), ("next_hops", "hops"), ("nonce", "nonce"),
                            ("mac", "mac"), ("slots", "slots"), ("row_ids", "flag"))),
    HelloAck: (MsgType.HELLO_ACK, (("protocol", "u16"), ("fingerprint", "str"), ("lo", "u32"), ("hi", "u32"),
                                   ("ckpt_max", "u32"), ("part_bytes", "u64"), ("worker", "str"), ("device", "str"),
                                   ("mac", "mac"))),
    Forward: (MsgType.FORWARD, (("pos", "u32"), ("want_all", "bool"), ("tokens", "tokens"), ("hidden", "hidden"),
                                ("seq", "seq"))),
    Result: (MsgType.RESULT, (("pos", "u32"), ("compute_us", "u64"), ("hidden", "hidden"), ("dropped", "more_ids"))),
    Commit: (MsgType.COMMIT, (("pos", "u32"), ("seq", "seq"))),
    Reset: (MsgType.RESET, (("keep", "ids"), ("seq", "seq"))),
    CkptSave: (MsgType.CKPT_SAVE, (("ckpt_id", "u64"), ("pos", "u32"), ("keep", "ids"), ("seq", "seq"))),
    CkptRestore: (MsgType.CKPT_RESTORE, (("ckpt_id", "u64"), ("pos", "u32"), ("keep", "ids"), ("seq", "seq"))),
    Error: (MsgType.ERROR, (("code", "u16"), ("message", "str"))),
    Ping: (MsgType.PING, (("nonce", "u64"),)),
    Pong: (MsgType.PONG, (("nonce", "u64"),)),
    Bye: (MsgType.BYE, (("reason", "str"),)),
    Challenge: (MsgType.CHALLENGE, (("nonce", "nonce"), ("keyed", "bool"), ("worker", "str"))),
    Ack: (MsgType.ACK, (("pos", "u32"), ("held", "u32"), ("store_bytes", "u64"))),
    PartGet: (MsgType.PART_GET, (("ckpt_id", "u64"), ("offset", "u64"), ("prefix", "bool"))),
    PartData: (MsgType.PART_DATA, (("total", "u64"), ("offset", "u64"), ("data", "bytes"))),
    PartPut: (MsgType.PART_PUT, (("ckpt_id", "u64"), ("pos", "u32"), ("total", "u64"), ("offset", "u64"),
                                 ("data", "bytes"), ("keep", "ids"), ("seq", "seq"))),
    BatchForward: (MsgType.BATCH_FORWARD, (("seqs", "rows"), ("tokens", "tokens"), ("hidden", "hidden"))),
    BatchResult: (MsgType.BATCH_RESULT, (("compute_us", "u64"), ("hidden", "hidden"), ("dropped", "more_ids"))),
    BatchRows: (MsgType.BATCH_ROWS, (("compute_us", "u64"), ("seqs", "rows"), ("hidden", "hidden"),
                                     ("dropped", "more_ids"))),
    SeqResult: (MsgType.SEQ_RESULT, (("pos", "u32"), ("seq", "u32"), ("compute_us", "u64"), ("hidden", "hidden"),
                                     ("dropped", "more_ids"))),
}
# optional last u32 fields: absent when the value is the default (then the message is the bytes it was before the
# field existed); present, never the default
_OPTIONAL_U32 = {"seq": 0, "slots": 1}
_CLASS_OF = {t: cls for cls, (t, _) in _LAYOUT.items()}
_INTS = {"u16": struct.Struct("<H"), "u32": struct.Struct("<I"), "u64": struct.Struct("<Q")}
_U8 = struct.Struct("<B")
_LEN = struct.Struct("<H")
_COUNT = struct.Struct("<I")
_TENSOR_HEAD = struct.Struct("<BBH")     # dtype code, ndim, pad (0)
_CARVE = struct.Struct("<II")            # a hop's lo, hi
_HOP_MIN = 2 + 2 + 4 + 4                 # an empty host, port, lo, hi
_ROW = struct.Struct("<II")              # a BatchForward row: seq, pos
# tensor kinds: (allowed dtypes, ndim)
_TENSOR_RULES = {"tokens": ((np.dtype("<i4"),), 1), "hidden": ((np.dtype("<f4"), np.dtype("<f2")), 2),
                 "bytes": ((np.dtype("|u1"),), 1)}
_ZEROS = bytes(TENSOR_ALIGN)


def msg_type(msg) -> MsgType:
    """The MsgType of a message object."""
    try:
        return _LAYOUT[type(msg)][0]
    except KeyError:
        raise TypeError(f"{type(msg).__name__} is not a stage-link message") from None


# ---------------------------------------------------------------- encoding

class _Out:
    """Payload pieces under construction: small fields gather in a bytearray, tensors go in as memoryviews."""

    def __init__(self):
        self.parts: list = []
        self.buf = bytearray()
        self.flushed = 0

    @property
    def size(self) -> int:
        return self.flushed + len(self.buf)

    def view(self, mv: memoryview) -> None:
        if self.buf:
            self.parts.append(self.buf)
            self.flushed += len(self.buf)
            self.buf = bytearray()
        self.parts.append(mv)
        self.flushed += mv.nbytes

    def done(self) -> list:
        if self.buf:
            self.parts.append(self.buf)
        return self.parts


def _int(what: str, v, bits: int) -> int:
    try:
        v = operator.index(v)
    except TypeError:
        raise FrameError(f"{what} must be an integer, not {type(v).__name__}") from None
    if not 0 <= v < 1 << bits:
        raise FrameError(f"{what} = {v} is outside 0..{(1 << bits) - 1}")
    return v


def _put_str(out: _Out, what: str, v) -> None:
    if not isinstance(v, str):
        raise FrameError(f"{what} must be a str, not {type(v).__name__}")
    try:
        raw = v.encode("utf-8")
    except UnicodeEncodeError:
        raise FrameError(f"{what} cannot be encoded as UTF-8 (a lone surrogate)") from None
    if len(raw) > MAX_STR:
        raise FrameError(f"{what} is {len(raw)} bytes of UTF-8, the limit is {MAX_STR}")
    out.buf += _LEN.pack(len(raw)) + raw


def _put_tensor(out: _Out, what: str, a, kind: str) -> None:
    if not isinstance(a, np.ndarray):
        raise FrameError(f"{what} must be a numpy array, not {type(a).__name__}")
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder in ("=", ">") else a.dtype
    code = _CODE_OF.get(dt.str)
    allowed, ndim = _TENSOR_RULES[kind]
    if code is None or dt not in allowed:
        raise FrameError(f"{what} has dtype {a.dtype}, expected {' or '.join(str(d) for d in allowed)}")
    if a.ndim != ndim:
        raise FrameError(f"{what} has {a.ndim} dimensions {a.shape}, expected {ndim}")
    if a.dtype != dt or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=dt)     # a copy only when not C-contiguous little-endian already
    out.buf += _TENSOR_HEAD.pack(code, a.ndim, 0)
    for d in a.shape:
        out.buf += _INTS["u64"].pack(d)
    out.buf += _ZEROS[:(-out.size) % TENSOR_ALIGN]
    if a.nbytes:
        out.view(memoryview(a).cast("B"))


def _put(out: _Out, what: str, kind: str, v) -> None:
    if kind in _OPTIONAL_U32:
        v = _int(what, v, 32)
        if v != _OPTIONAL_U32[kind]:
            out.buf += _INTS["u32"].pack(v)
        return
    if kind == "flag":
        if not isinstance(v, (bool, np.bool_)) and not (isinstance(v, (int, np.integer)) and v in (0, 1)):
            raise FrameError(f"{what} must be a bool, not {v!r}")
        if v:
            out.buf += _U8.pack(1)
        return
    if kind == "rows":
        seqs, positions = v
        if not isinstance(seqs, (list, tuple)) or not isinstance(positions, (list, tuple)):
            raise FrameError(f"{what} must be lists of sequence ids and positions")
        if len(seqs) != len(positions):
            raise FrameError(f"{what}: {len(seqs)} sequence ids but {len(positions)} positions")
        out.buf += _COUNT.pack(_int(f"{what} count", len(seqs), 32))
        flat = [x for row in zip(seqs, positions) for x in row]
        if all(type(x) is int and 0 <= x <= 0xFFFFFFFF for x in flat):      # the usual case, checked at once
            out.buf += struct.pack(f"<{len(flat)}I", *flat)
            return
        for i, (q, p) in enumerate(zip(seqs, positions)):                 # else the row at fault is named
            out.buf += _ROW.pack(_int(f"{what}[{i}].seq", q, 32), _int(f"{what}[{i}].pos", p, 32))
        return
    if kind in _INTS:
        out.buf += _INTS[kind].pack(_int(what, v, 8 * _INTS[kind].size))
    elif kind == "bool":
        if not isinstance(v, (bool, np.bool_)) and not (isinstance(v, (int, np.integer)) and v in (0, 1)):
            raise FrameError(f"{what} must be a bool, not {v!r}")
        out.buf += _U8.pack(1 if v else 0)
    elif kind == "str":
        _put_str(out, what, v)
    elif kind == "nonce":
        if not isinstance(v, (bytes, bytearray, memoryview)) or len(bytes(v)) != NONCE_SIZE:
            raise FrameError(f"{what} must be {NONCE_SIZE} bytes")
        out.buf += bytes(v)
    elif kind == "mac":
        if not isinstance(v, (bytes, bytearray, memoryview)) or len(bytes(v)) not in (0, MAC_SIZE):
            raise FrameError(f"{what} must be empty or {MAC_SIZE} bytes")
        out.buf += _LEN.pack(len(bytes(v))) + bytes(v)
    elif kind == "more_ids" and isinstance(v, (list, tuple)) and not v:
        return                                   # an optional last field: absent when empty
    elif kind in ("ids", "more_ids"):
        if not isinstance(v, (list, tuple)):
            raise FrameError(f"{what} must be a list of ids, not {type(v).__name__}")
        out.buf += _COUNT.pack(_int(f"{what} count", len(v), 32))
        for i, x in enumerate(v):
            out.buf += _INTS["u64"].pack(_int(f"{what}[{i}]", x, 64))
    elif kind == "hops":
        if not isinstance(v, (list, tuple)):
            raise FrameError(f"{what} must be a list of Hop, not {type(v).__name__}")
        out.buf += _COUNT.pack(_int(f"{what} count", len(v), 32))
        for i, h in enumerate(v):
            if not isinstance(h, Hop):
                raise FrameError(f"{what}[{i}] must be a Hop, not {type(h).__name__}")
            _put_str(out, f"{what}[{i}].host", h.host)
            out.buf += _LEN.pack(_int(f"{what}[{i}].port", h.port, 16))
            out.buf += _INTS["u32"].pack(_int(f"{what}[{i}].lo", h.lo, 32))
            out.buf += _INTS["u32"].pack(_int(f"{what}[{i}].hi", h.hi, 32))
    else:
        _put_tensor(out, what, v, kind)


def _check(msg, name: str) -> None:
    """Rules across fields (the same on both sides)."""
    if isinstance(msg, (Forward, BatchForward)) and msg.tokens.shape[0] != msg.hidden.shape[0]:
        raise FrameError(f"{name} carries {msg.tokens.shape[0]} tokens but {msg.hidden.shape[0]} hidden rows")
    if isinstance(msg, Hello) and msg.row_ids and msg.slots == 1:
        raise FrameError(f"{name} asks for row ids with one slot (row ids follow slots, which one slot leaves out)")
    if isinstance(msg, BatchRows) and not 1 <= len(msg.seqs) <= MAX_ROWS:
        raise FrameError(f"{name} names {len(msg.seqs)} rows, outside 1..{MAX_ROWS}")
    if isinstance(msg, BatchForward):
        n = len(msg.seqs)
        if not 1 <= n <= MAX_ROWS:
            raise FrameError(f"{name} carries {n} rows, outside 1..{MAX_ROWS}")
        if msg.tokens.shape[0] != n:
            raise FrameError(f"{name} carries {n} rows but {msg.tokens.shape[0]} tokens")
        if len(set(msg.seqs)) != n:
            raise FrameError(f"{name} names a sequence twice (a batched step reads each sequence once)")


def encode_payload(msg) -> list:
    """The payload of `msg` as a list of bytes-like pieces (tensors as memoryviews of their arrays, not copied)."""
    name = type(msg).__name__
    _, layout = _LAYOUT.get(type(msg), (None, None))
    if layout is None:
        raise TypeError(f"{name} is not a stage-link message")
    out = _Out()
    for fname, kind in layout:
        v = (msg.seqs, msg.positions) if kind == "rows" else getattr(msg, fname)
        _put(out, f"{name}.{fname}", kind, v)
    _check(msg, name)
    return out.done()


# ---------------------------------------------------------------- decoding

class _In:
    """A cursor over one payload; every read checks what is left first."""

    def __init__(self, mv: memoryview, name: str):
        self.mv = mv
        self.at = 0
        self.name = name

    @property
    def left(self) -> int:
        return len(self.mv) - self.at

    def take(self, n: int, what: str) -> memoryview:
        if n > self.left:
            raise FrameError(f"the {self.name} payload ends inside its {what} ({self.left} of {n} bytes left)")
        b = self.mv[self.at:self.at + n]
        self.at += n
        return b

    def unpack(self, s: struct.Struct, what: str) -> tuple:
        return s.unpack(self.take(s.size, what))

    def refuse(self, text: str):
        raise FrameError(f"the {self.name} payload's {text}")


def _get_str(inp: _In, what: str) -> str:
    (n,) = inp.unpack(_LEN, f"{what} length")
    if n > MAX_STR:
        inp.refuse(f"{what} is {n} bytes long, the limit is {MAX_STR}")
    try:
        return str(inp.take(n, what), "utf-8")
    except UnicodeDecodeError:
        inp.refuse(f"{what} is not valid UTF-8")


def _get_tensor(inp: _In, what: str, kind: str) -> np.ndarray:
    code, ndim, pad = inp.unpack(_TENSOR_HEAD, f"{what} header")
    if code not in DTYPE_CODES:
        reserved = _RESERVED_DTYPES.get(code)
        inp.refuse(f"{what} has dtype code {code} ({reserved}, reserved)" if reserved
                   else f"{what} has unknown dtype code {code}")
    if ndim > MAX_NDIM:
        inp.refuse(f"{what} has {ndim} dimensions, the limit is {MAX_NDIM}")
    if pad:
        inp.refuse(f"{what} header has nonzero pad bytes")
    dims = struct.unpack(f"<{ndim}Q", inp.take(8 * ndim, f"{what} dims"))
    if any(inp.take((-inp.at) % TENSOR_ALIGN, f"{what} padding")):
        inp.refuse(f"{what} padding is not zero")
    dt = DTYPE_CODES[code]
    allowed, want_ndim = _TENSOR_RULES[kind]
    if dt not in allowed:
        inp.refuse(f"{what} has dtype {dt}, expected {' or '.join(str(d) for d in allowed)}")
    if ndim != want_ndim:
        inp.refuse(f"{what} has {ndim} dimensions, expected {want_ndim}")
    count = 1
    for d in dims:
        count *= max(d, 1)
    if count > MAX_ELEMENTS:
        inp.refuse(f"{what} shape {dims} is over the limit of {MAX_ELEMENTS} elements")
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    if nbytes > inp.left:
        inp.refuse(f"{what} {dims} {dt} needs {nbytes} bytes, {inp.left} are left")
    return np.frombuffer(inp.take(nbytes, what), dtype=dt).reshape(dims)


def _get(inp: _In, what: str, kind: str):
    if kind in _INTS:
        return inp.unpack(_INTS[kind], what)[0]
    if kind == "bool":
        (v,) = inp.unpack(_U8, what)
        if v > 1:
            inp.refuse(f"{what} is {v}, not a bool (0 or 1)")
        return bool(v)
    if kind == "str":
        return _get_str(inp, what)
    if kind == "nonce":
        return bytes(inp.take(NONCE_SIZE, what))
    if kind == "mac":
        (n,) = inp.unpack(_LEN, f"{what} length")
        if n not in (0, MAC_SIZE):
            inp.refuse(f"{what} is {n} bytes, expected 0 or {MAC_SIZE}")
        return bytes(inp.take(n, what))
    if kind in _OPTIONAL_U32:
        if not inp.left:
            return _OPTIONAL_U32[kind]           # an optional last field, absent
        (v,) = inp.unpack(_INTS["u32"], what)
        if v == _OPTIONAL_U32[kind]:
            inp.refuse(f"{what} is present with its default {v} (a default is sent as no field)")
        return v
    if kind == "flag":
        if not inp.left:
            return False                         # an optional last field, absent
        (v,) = inp.unpack(_U8, what)
        if v != 1:
            inp.refuse(f"{what} is present as {v} (a flag is sent as 1, or as no field)")
        return True
    if kind == "rows":
        (n,) = inp.unpack(_COUNT, f"{what} count")
        if not 1 <= n <= MAX_ROWS:
            inp.refuse(f"{what} count {n} is outside 1..{MAX_ROWS}")
        if _ROW.size * n > inp.left:
            inp.refuse(f"{what} count {n} needs {_ROW.size * n} bytes, {inp.left} are left")
        flat = struct.unpack(f"<{2 * n}I", inp.take(_ROW.size * n, what))
        return list(flat[0::2]), list(flat[1::2])
    if kind == "more_ids" and not inp.left:
        return []                                # an optional last field, absent
    if kind in ("ids", "more_ids"):
        (n,) = inp.unpack(_COUNT, f"{what} count")
        if n == 0 and kind == "more_ids":
            inp.refuse(f"{what} is present but empty (an empty list is sent as no field)")
        if 8 * n > inp.left:
            inp.refuse(f"{what} count {n} needs {8 * n} bytes, {inp.left} are left")
        return np.frombuffer(inp.take(8 * n, what), dtype="<u8").tolist()
    if kind == "hops":
        (n,) = inp.unpack(_COUNT, f"{what} count")
        if _HOP_MIN * n > inp.left:
            inp.refuse(f"{what} count {n} needs at least {_HOP_MIN * n} bytes, {inp.left} are left")
        hops = []
        for i in range(n):
            host = _get_str(inp, f"{what}[{i}].host")
            (port,) = inp.unpack(_LEN, f"{what}[{i}].port")
            lo, hi = inp.unpack(_CARVE, f"{what}[{i}] carve")
            hops.append(Hop(host, port, lo, hi))
        return hops
    return _get_tensor(inp, what, kind)


def decode_message(type: int, payload):
    """The message of MsgType `type` in `payload` (bytes-like); tensors are views of `payload`. FrameError when the
    type is unknown or the payload is not exactly one well-formed message of that type."""
    cls = _CLASS_OF.get(type)
    if cls is None:
        raise FrameError(f"unknown message type {type}")
    name = cls.__name__
    mv = memoryview(payload)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    inp = _In(mv, name)
    values = {}
    for fname, kind in _LAYOUT[cls][1]:
        v = _get(inp, fname, kind)
        if kind == "rows":
            values["seqs"], values["positions"] = v
        else:
            values[fname] = v
    if inp.left:
        raise FrameError(f"the {name} payload has {inp.left} trailing bytes after its last field")
    msg = cls(**values)
    if isinstance(msg, Error) and msg.code in ErrorCode._value2member_map_:
        msg.code = ErrorCode(msg.code)
    _check(msg, f"the {name} payload")
    return msg
