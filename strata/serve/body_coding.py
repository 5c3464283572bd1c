"""A request body's codings: Content-Encoding gzip and deflate decoded here (aiohttp's own decoding is off), the
decoded body bounded by --max-body, a coding that does not decode a one-line 400 and an unknown one a 415 naming it;
a Transfer-Encoding coding other than chunked a 400 naming it."""
from __future__ import annotations

import zlib

from strata.serve.errors import ApiError

#: the codings a request body may carry (RFC 9110 section 8.4.1); "identity" means none
SUPPORTED = ("gzip", "x-gzip", "deflate", "identity")
#: the most compressed bytes fed to zlib at once
_PIECE = 1 << 16
#: the first bytes of a gzip member (RFC 1952)
GZIP_MAGIC = b"\x1f\x8b"
#: gzip members a body may be made of (clients send one; thousands of empty ones would only cost the daemon time)
GZIP_MEMBERS = 64


def _items(header_values: list[str]):
    """(as sent, lower-cased) for each item of the comma lists of every header value, spaces stripped."""
    for value in header_values:
        for item in value.split(","):
            yield item.strip(), item.strip().lower()


def codings(header_values: list[str]) -> list[str]:
    """The codings that were applied, in the order they were (all Content-Encoding headers, comma lists, case and
    spaces ignored), identity and empty items left out; 415 (unsupported_content_encoding) for one not in
    SUPPORTED."""
    out = []
    for item, c in _items(header_values):
        if c in ("", "identity"):
            continue
        if c not in SUPPORTED:
            raise ApiError(415, f"the request's Content-Encoding {item[:40]!r} is not supported: send the body as "
                                f"it is, or with gzip or deflate", param="Content-Encoding",
                           code="unsupported_content_encoding")
        out.append(c)
    return out


def check_transfer_codings(header_values: list[str]) -> None:
    """400 (unsupported_transfer_encoding) naming a Transfer-Encoding coding other than chunked: the HTTP parser takes
    chunked framing off and would pass any other coding through undecoded (a Transfer-Encoding without chunked last
    is the parser's own 400)."""
    for item, c in _items(header_values):
        if c not in ("", "chunked", "identity"):
            raise ApiError(400, f"the request's Transfer-Encoding {item[:40]!r} is not supported: send the body "
                                f"chunked or with a Content-Length (compressed with Content-Encoding gzip or deflate "
                                f"if you like)", param="Transfer-Encoding", code="unsupported_transfer_encoding")


def decode(raw: bytes, applied: list[str], max_body: int) -> bytes:
    """raw with the codings of codings() undone, last applied first. 413 (request_too_large) when a step's output
    passes max_body bytes (a small body that inflates without bound goes no further than that); 400 for bytes that
    are not what the coding says (a bad header or checksum, a stream cut short, bytes after its end, more than
    GZIP_MEMBERS gzip members)."""
    for c in reversed(applied):
        if raw:
            raw = _inflate(raw, c, max_body)
    return raw


def _inflate(raw: bytes, coding: str, max_body: int) -> bytes:
    # gzip may be several members one after another (zeros after the last ignored); deflate is a zlib stream
    # (RFC 1950), or raw deflate (RFC 1951) as some clients send it: a zlib stream's first byte names method 8
    def unreadable(why: str) -> ApiError:
        return ApiError(400, f"the request body could not be read (Content-Encoding {coding}): {why}",
                        param="Content-Encoding")

    gzip = coding in ("gzip", "x-gzip")
    wbits = 16 + zlib.MAX_WBITS if gzip else zlib.MAX_WBITS if raw[0] & 0x0F == 8 else -zlib.MAX_WBITS
    out = bytearray()
    view = memoryview(raw)
    pos = members = 0
    try:
        while pos < len(raw):
            members += 1
            if members > GZIP_MEMBERS:
                raise unreadable(f"more than {GZIP_MEMBERS} gzip members")
            # each member is fed in pieces of at most _PIECE bytes from pos: its unused_data (the bytes after its end,
            # which zlib copies) stays that small, so many tiny members cost linear time, not quadratic
            d = zlib.decompressobj(wbits)
            while not d.eof and pos < len(raw):
                piece = view[pos:pos + _PIECE]
                out += d.decompress(piece, max_body + 1 - len(out))
                if len(out) > max_body:
                    raise ApiError(413, f"the request body decodes (Content-Encoding {coding}) to more than "
                                        f"--max-body ({max_body} bytes)", code="request_too_large")
                pos += len(piece) - len(d.unused_data)
            if not d.eof:
                raise unreadable("the compressed stream is cut short")
            if pos < len(raw) and (not gzip or raw[pos:pos + 2] != GZIP_MAGIC[:len(raw) - pos]):
                if gzip and not raw[pos:].strip(b"\0"):
                    break                   # zeros padding the last member, as gzip's own readers allow
                raise unreadable(f"{len(raw) - pos} bytes follow the compressed stream")
    except zlib.error as e:
        raise unreadable(str(e)) from None
    return bytes(out)
