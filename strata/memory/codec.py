"""The byte format of a state part: a self-describing checked header, then the arrays and their checksum.

Layout (little-endian):

    offset  size  field
    0       4     magic b"STRP"
    4       2     format version (1)
    6       2     flags (0; any other value is refused)
    8       4     header length H (1 .. MAX_HEADER)
    12      4     CRC-32 of the header bytes
    16      H     header: UTF-8 JSON object (carve, pos, geometry, kv_lengths, arrays = [[name, dtype, shape], ...],
                  payload_bytes)
    16+H    P     the arrays, each C-contiguous in header order, no padding (P = payload_bytes)
    16+H+P  4     CRC-32 of the P payload bytes

``read`` parses and checks the header, asks the caller which arrays it expects for it (names, shapes, dtypes: the
stage's geometry decides, so a file from another model, carve or position is refused before anything is
allocated), requires the declared arrays to be exactly those, then reads each array straight into its own buffer
(``readinto``: no intermediate copy) and checks the payload checksum. Writing hands numpy's buffers to the stream
without copying them. Every refusal is a FormatError or the caller's PartMismatch (ValueError subclasses) with a
one-line message.
"""
from __future__ import annotations

import concurrent.futures
import json
import struct
import zlib
from typing import Any, BinaryIO, Callable

import numpy as np

MAGIC = b"STRP"
VERSION = 1
MAX_HEADER = 1 << 20                 # a header is geometry and names: 1 MiB is far beyond any real one
_FIXED = struct.Struct("<4sHHII")    # magic, version, flags, header length, header CRC-32
_CRC = struct.Struct("<I")
DTYPES = ("<f4", "<f2", "|i1", "<i4", "|u1")   # what state arrays are made of


class FormatError(ValueError):
    """Bytes that are not a state part of this format (one-line message naming what is wrong)."""


def write(io: BinaryIO, header: dict[str, Any], arrays: list[tuple[str, np.ndarray]]) -> int:
    """Write one part: `header` (JSON-ready) with the array table added, then the arrays. Returns bytes written."""
    table, total = [], 0
    for name, a in arrays:
        dt = np.dtype(a.dtype).newbyteorder("<") if np.dtype(a.dtype).byteorder == ">" else np.dtype(a.dtype)
        if dt.str not in DTYPES:
            raise FormatError(f"array {name} has dtype {dt}, which the part format does not carry")
        table.append([name, dt.str, [int(x) for x in a.shape]])
        total += int(a.nbytes)
    head = json.dumps(dict(header, arrays=table, payload_bytes=total), separators=(",", ":"),
                      sort_keys=True).encode()
    io.write(_FIXED.pack(MAGIC, VERSION, 0, len(head), zlib.crc32(head)))
    io.write(head)
    with _PayloadCrc(total) as crc:
        for _, a in arrays:
            if a.nbytes == 0:
                continue
            buf = memoryview(np.ascontiguousarray(a)).cast("B")
            crc.add(buf)
            io.write(buf)
        value = crc.value()
    io.write(_CRC.pack(value))
    return _FIXED.size + len(head) + total + _CRC.size


class _PayloadCrc:
    """The payload's running CRC-32, computed beside the file I/O: for a payload over OVERLAP_BYTES a helper thread
    takes the buffers in order (zlib.crc32 and file writes / reads both release the GIL), so writing or reading a
    part costs about what the I/O alone costs instead of I/O + checksum."""

    OVERLAP_BYTES = 8 << 20

    def __init__(self, total: int):
        self.crc = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "strata-crc") if total > self.OVERLAP_BYTES else None
        self.pending: list = []

    def _step(self, buf) -> None:
        self.crc = zlib.crc32(buf, self.crc)

    def add(self, buf) -> None:
        """Fold `buf` in (after the buffers added before it); it must not change until value() returns."""
        if self.pool is None:
            self._step(buf)
        else:
            self.pending.append(self.pool.submit(self._step, buf))

    def value(self) -> int:
        for f in self.pending:
            f.result()
        return self.crc

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def read_exact(io: BinaryIO, n: int, what: str, error: type[ValueError] = FormatError,
               thing: str = "part") -> bytes:
    """Exactly n bytes of `io`; `error` ("the {thing} ends inside its {what} (k of n bytes)") when it ends first."""
    b = io.read(n)
    if b is None or len(b) != n:
        raise error(f"the {thing} ends inside its {what} ({0 if not b else len(b)} of {n} bytes)")
    return b


def read_json_header(io: BinaryIO, hlen: int, hcrc: int, *, max_header: int = MAX_HEADER, name: str = "state part",
                     thing: str = "part", error: type[ValueError] = FormatError, why: bool = True) -> dict[str, Any]:
    """The JSON header that follows a fixed header declaring its length `hlen` and CRC-32 `hcrc`: the length checked
    (1 .. max_header) before it is read, the bytes read and checked against the CRC, parsed as a JSON object.
    Every refusal is `error` with a one-line message naming the `name` ("{name} header ..."; the reading's, "the
    {thing} ends inside its header"); why: add the JSON parser's reason to "is not JSON"."""
    if not 0 < hlen <= max_header:
        raise error(f"{name} header length {hlen} is outside 1..{max_header}")
    head = read_exact(io, hlen, "header", error, thing)
    if zlib.crc32(head) != hcrc:
        raise error(f"{name} header checksum mismatch (the header is corrupt)")
    try:
        header = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{name} header is not JSON" + (f": {str(e).splitlines()[0][:120]}" if why else "")) from None
    if not isinstance(header, dict):
        raise error(f"{name} header is not a JSON object")
    return header


def read(io: BinaryIO, expect: Callable[[dict], list[tuple[str, tuple[int, ...], np.dtype]]]
         ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read one part -> (header, {name: array}). `expect(header)` returns the arrays the reader's stage expects
    for that header (or raises); nothing is allocated before the declared arrays match them exactly."""
    magic, version, flags, hlen, hcrc = _FIXED.unpack(read_exact(io, _FIXED.size, "fixed header"))
    if magic != MAGIC:
        raise FormatError(f"not a Strata state part (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise FormatError(f"state part format version {version} is not supported (this build reads {VERSION})")
    if flags != 0:
        raise FormatError(f"unknown state part flags {flags:#06x}")
    header = read_json_header(io, hlen, hcrc)
    table = header.get("arrays")
    if not isinstance(table, list) or not all(
            isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and isinstance(r[1], str)
            and isinstance(r[2], list) and all(type(x) is int and x >= 0 for x in r[2]) for r in table):
        raise FormatError("state part header has a malformed array table")
    want = expect(header)
    declared = [(r[0], tuple(r[2]), r[1]) for r in table]
    wanted = [(n, tuple(s), np.dtype(d).str) for n, s, d in want]
    if declared != wanted:
        diff = next(((a, b) for a, b in zip(declared, wanted) if a != b), None)
        if diff is None:
            raise FormatError(f"the part holds {len(declared)} arrays, this stage expects {len(wanted)}")
        raise FormatError(f"the part's array {diff[0][0]} {diff[0][1]} {diff[0][2]} is not what this stage expects "
                          f"({diff[1][0]} {diff[1][1]} {diff[1][2]})")
    total = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, s, d in wanted)
    if header.get("payload_bytes") != total:
        raise FormatError(f"the part declares {header.get('payload_bytes')!r} payload bytes, its arrays take {total}")
    out: dict[str, np.ndarray] = {}
    with _PayloadCrc(total) as running:
        for name, shape, dt in wanted:
            a = np.empty(shape, dtype=dt)
            out[name] = a
            if a.nbytes == 0:
                continue
            buf = memoryview(a).cast("B")
            got = io.readinto(buf) if hasattr(io, "readinto") else None
            if got is None:
                b = read_exact(io, buf.nbytes, f"array {name}")
                buf[:] = b
            elif got != buf.nbytes:
                while got < buf.nbytes:          # a stream may return less than asked before its end
                    more = io.readinto(buf[got:])
                    if not more:
                        raise FormatError(f"the part ends inside its array {name} ({got} of {buf.nbytes} bytes)")
                    got += more
            running.add(buf)
        crc = running.value()
    (pcrc,) = _CRC.unpack(read_exact(io, _CRC.size, "payload checksum"))
    if pcrc != crc:
        raise FormatError("state part payload checksum mismatch (the arrays are corrupt)")
    return header, out
