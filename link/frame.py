"""Stage-link frames (protocol 5): the checked 32-byte header, payload and trailer, and their socket readers/writers."""
from __future__ import annotations

import asyncio
import operator
import struct
import zlib
from dataclasses import dataclass

from .errors import ErrorCode, FrameError, LinkError, VersionMismatch
from .messages import TENSOR_TYPES, MsgType, decode_message, encode_payload, msg_type
from .secure import TAG_SIZE

__all__ = [
    "MAGIC", "VERSION", "HEADER_SIZE", "TRAILER_SIZE", "DEFAULT_MAX_PAYLOAD", "MAX_CONTROL_PAYLOAD", "FLAG_ASYNC",
    "KNOWN_FLAGS", "LinkError", "FrameError", "VersionMismatch", "ErrorCode", "Header", "payload_limit",
    "parse_header", "encode_frame", "frame_bytes", "decode_frame", "decode_payload", "send_frame", "recv_frame",
    "read_frame", "write_frame",
]

MAGIC = b"STLK"
VERSION = 5
HEADER_SIZE = 32
TRAILER_SIZE = 4
DEFAULT_MAX_PAYLOAD = 256 * 1024 * 1024
MAX_CONTROL_PAYLOAD = 1 << 20        # the limit for every message without tensors (all but the tensor messages)
FLAG_ASYNC = 0x1                     # the sender does not wait for this request's reply now; it settles later
KNOWN_FLAGS = FLAG_ASYNC
RECV_CHUNK = 1 << 20                 # the asyncio reader copies a payload in pieces of at most this many bytes

_HEAD = struct.Struct("<4sHHHHQQ")   # magic, version, type, flags, reserved, request_id, payload_len (28 bytes)
_CRC = struct.Struct("<I")
_U64 = 1 << 64
_SENDMSG_MAX_BUFFERS = 512           # well under any IOV_MAX
assert _HEAD.size + _CRC.size == HEADER_SIZE


@dataclass(frozen=True)
class Header:
    """A parsed, checked frame header."""
    version: int
    type: int
    flags: int
    request_id: int
    payload_len: int


def payload_limit(type: int, max_payload: int = DEFAULT_MAX_PAYLOAD) -> int:
    """The largest payload a frame of message type `type` may declare: max_payload for the messages that carry
    tensors (TENSOR_TYPES), min(max_payload, MAX_CONTROL_PAYLOAD) for the others."""
    return max_payload if type in TENSOR_TYPES else min(max_payload, MAX_CONTROL_PAYLOAD)


def _name(type: int) -> str:
    try:
        return MsgType(type).name
    except ValueError:
        return f"type-{type}"


def parse_header(b, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Header:
    """Check and parse the 32 bytes of a frame header: length, magic, checksum, then version (VersionMismatch), then
    reserved, flags, type and the payload length against its limit (FrameError code LIMIT), before any payload is
    read or allocated."""
    mv = memoryview(b)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if len(mv) != HEADER_SIZE:
        raise FrameError(f"a frame header is {HEADER_SIZE} bytes, got {len(mv)}")
    magic, version, type, flags, reserved, request_id, payload_len = _HEAD.unpack_from(mv)
    if magic != MAGIC:
        raise FrameError(f"not a stage-link frame (magic {magic!r}, expected {MAGIC!r})")
    (crc,) = _CRC.unpack_from(mv, _HEAD.size)
    if zlib.crc32(mv[:_HEAD.size]) != crc:
        raise FrameError("frame header checksum mismatch (the header is corrupt)")
    if version != VERSION:
        raise VersionMismatch(version, VERSION)
    if reserved:
        raise FrameError(f"frame header reserved field is {reserved:#06x}, must be 0")
    if flags & ~KNOWN_FLAGS:
        raise FrameError(f"frame header has unknown flag bits {flags & ~KNOWN_FLAGS:#06x}")
    if type not in MsgType._value2member_map_:
        raise FrameError(f"unknown message type {type}")
    limit = payload_limit(type, max_payload)
    if payload_len > limit:
        raise FrameError(f"a {_name(type)} frame declares a payload of {payload_len} bytes, the limit is {limit}",
                         ErrorCode.LIMIT)
    return Header(version, MsgType(type), flags, request_id, payload_len)


def encode_frame(msg, request_id: int, flags: int = 0, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> list:
    """The frame of `msg` as a list of bytes-like buffers: header, payload pieces (tensors as memoryviews of their
    arrays, not copied: keep the arrays unchanged until the frame is sent), trailer. For sendmsg / writelines."""
    t = msg_type(msg)
    try:
        flags, request_id = operator.index(flags), operator.index(request_id)
    except TypeError:
        raise FrameError(f"flags {flags!r} and request id {request_id!r} must be integers") from None
    if flags < 0 or flags & ~KNOWN_FLAGS:
        raise FrameError(f"unknown frame flag bits in {flags:#x}")
    if not 0 <= request_id < _U64:
        raise FrameError(f"request id {request_id} is outside 0..2^64-1")
    parts = encode_payload(msg)
    size, crc = 0, 0
    for p in parts:
        size += memoryview(p).nbytes
        crc = zlib.crc32(p, crc)
    limit = payload_limit(t, max_payload)
    if size > limit:
        raise FrameError(f"a {t.name} payload of {size} bytes is over the limit of {limit}", ErrorCode.LIMIT)
    head = _HEAD.pack(MAGIC, VERSION, t, flags, 0, request_id, size)
    return [head + _CRC.pack(zlib.crc32(head)), *parts, _CRC.pack(crc)]


def frame_bytes(msg, request_id: int, flags: int = 0, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    """The whole frame of `msg` as one bytes object (a copy: for tests and golden files)."""
    return b"".join(encode_frame(msg, request_id, flags, max_payload=max_payload))


def decode_payload(header: Header, payload, crc: int):
    """The message in `payload` after checking its length against the header and its CRC-32 against `crc`. Tensors
    in the result are views of `payload` (writable when it is a bytearray)."""
    mv = memoryview(payload)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if len(mv) != header.payload_len:
        raise FrameError(f"a {_name(header.type)} payload of {len(mv)} bytes, the header says {header.payload_len}")
    if zlib.crc32(mv) != crc:
        raise FrameError(f"{_name(header.type)} payload checksum mismatch (the payload is corrupt)")
    return decode_message(header.type, mv)


def decode_frame(data, max_payload: int = DEFAULT_MAX_PAYLOAD):
    """(Header, message) of exactly one whole frame in `data`; a short frame or bytes after it are a FrameError."""
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if len(mv) < HEADER_SIZE:
        raise FrameError(f"short frame: {len(mv)} bytes, a frame header alone is {HEADER_SIZE}")
    header = parse_header(mv[:HEADER_SIZE], max_payload)
    end = HEADER_SIZE + header.payload_len + TRAILER_SIZE
    if len(mv) < end:
        raise FrameError(f"short frame: {len(mv)} of {end} bytes")
    if len(mv) > end:
        raise FrameError(f"{len(mv) - end} trailing bytes after the frame")
    (crc,) = _CRC.unpack_from(mv, end - TRAILER_SIZE)
    return header, decode_payload(header, mv[HEADER_SIZE:end - TRAILER_SIZE], crc)


# ---------------------------------------------------------------- blocking sockets

def _sealed(parts: list, channel) -> list:
    return parts if channel is None else channel.seal(parts)


def send_frame(sock, msg, request_id: int, flags: int = 0, *, max_payload: int = DEFAULT_MAX_PAYLOAD,
               channel=None) -> int:
    """Send one frame on a blocking socket with sendmsg (no copy of the tensors unless `channel`, a
    link.secure.Channel, seals it), looping on partial sends. Returns the bytes sent."""
    parts = _sealed(encode_frame(msg, request_id, flags, max_payload=max_payload), channel)
    bufs = [memoryview(b).cast("B") for b in parts]
    bufs = [b for b in bufs if b.nbytes]
    total = sum(b.nbytes for b in bufs)
    if not hasattr(sock, "sendmsg"):
        for b in bufs:
            sock.sendall(b)
        return total
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i:i + _SENDMSG_MAX_BUFFERS])
        while sent:
            if sent >= bufs[i].nbytes:
                sent -= bufs[i].nbytes
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0
    return total


def _recv_into(sock, buf: memoryview, what: str, at_boundary: bool) -> None:
    got, n = 0, len(buf)
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if not k:
            if got == 0 and at_boundary:
                raise ConnectionError("peer closed the link")
            raise FrameError(f"the link closed inside a frame's {what} ({got} of {n} bytes)")
        got += k


def _opened(header: Header, frame: bytearray, channel):
    payload, crc = channel.open(frame)
    return header, decode_payload(header, payload, _CRC.unpack(crc)[0])


def recv_frame(sock, max_payload: int = DEFAULT_MAX_PAYLOAD, channel=None):
    """(Header, message) of the next frame on a blocking socket, read with recv_into into preallocated buffers (the
    payload is a bytearray: tensors are writable views of it). With `channel` (link.secure.Channel) the frame's tag
    is verified (FrameAuthError) before its checksum or any field is looked at. ConnectionError when the peer
    closed at a frame boundary, FrameError when inside one; a socket timeout propagates as TimeoutError (the link
    is then out of step and must be closed)."""
    head = bytearray(HEADER_SIZE)
    _recv_into(sock, memoryview(head), "header", True)
    header = parse_header(head, max_payload)
    if channel is not None:
        frame = bytearray(HEADER_SIZE + header.payload_len + TRAILER_SIZE + TAG_SIZE)
        frame[:HEADER_SIZE] = head
        _recv_into(sock, memoryview(frame)[HEADER_SIZE:], "payload, checksum and tag", False)
        return _opened(header, frame, channel)
    payload = bytearray(header.payload_len)
    if header.payload_len:
        _recv_into(sock, memoryview(payload), "payload", False)
    trailer = bytearray(TRAILER_SIZE)
    _recv_into(sock, memoryview(trailer), "payload checksum", False)
    return header, decode_payload(header, payload, _CRC.unpack(trailer)[0])


# ---------------------------------------------------------------- asyncio streams

async def _read_exactly(reader: asyncio.StreamReader, n: int, what: str, at_boundary: bool, done: int = 0,
                        total: int | None = None) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        got = done + len(e.partial)
        if got == 0 and at_boundary:
            raise ConnectionError("peer closed the link") from None
        raise FrameError(f"the link closed inside a frame's {what} ({got} of {total or n} bytes)") from None


async def read_frame(reader: asyncio.StreamReader, max_payload: int = DEFAULT_MAX_PAYLOAD, channel=None):
    """(Header, message) of the next frame on an asyncio stream; the same checks and errors as recv_frame. The
    payload is copied into one bytearray in pieces (RECV_CHUNK), so the stream never buffers a whole large payload."""
    head = await _read_exactly(reader, HEADER_SIZE, "header", True)
    header = parse_header(head, max_payload)
    if channel is not None:
        n = header.payload_len + TRAILER_SIZE + TAG_SIZE
        frame = bytearray(HEADER_SIZE + n)
        frame[:HEADER_SIZE] = head
        got = 0
        while got < n:
            k = min(n - got, RECV_CHUNK)
            frame[HEADER_SIZE + got:HEADER_SIZE + got + k] = await _read_exactly(
                reader, k, "payload, checksum and tag", False, got, n)
            got += k
        return _opened(header, frame, channel)
    n = header.payload_len
    payload = bytearray(n)
    got = 0
    while got < n:
        k = min(n - got, RECV_CHUNK)
        payload[got:got + k] = await _read_exactly(reader, k, "payload", False, got, n)
        got += k
    trailer = await _read_exactly(reader, TRAILER_SIZE, "payload checksum", False)
    return header, decode_payload(header, payload, _CRC.unpack(trailer)[0])


def write_frame(writer: asyncio.StreamWriter, msg, request_id: int, flags: int = 0, *,
                max_payload: int = DEFAULT_MAX_PAYLOAD, channel=None) -> None:
    """Queue one frame on an asyncio stream with writelines, sealed by `channel` when given (frames are sealed in
    the order of these calls); the caller awaits writer.drain() (and keeps the arrays unchanged until then)."""
    writer.writelines(_sealed(encode_frame(msg, request_id, flags, max_payload=max_payload), channel))
