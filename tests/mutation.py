"""The byte mutation the fuzz tests and tools/fuzz_parts.py apply to a good file: bytes overwritten, then a cut."""
from __future__ import annotations


def mutate(data: bytes, changes, trunc: int | None) -> bytes:
    """`data` with byte (offset mod length) set to value for each (offset, value) in `changes`, then cut to
    (trunc mod (length + 1)) bytes when trunc is given."""
    b = bytearray(data)
    for off, val in changes:
        b[off % len(b)] = val
    if trunc is not None:
        b = b[:trunc % (len(b) + 1)]
    return bytes(b)
