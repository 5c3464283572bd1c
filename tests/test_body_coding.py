"""A request body's Content-Encoding (strata.serve.body_coding): decoded as zlib/gzip write it, bounded by --max-body,
anything else a 4xx ApiError, never another exception."""
from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from strata.serve import body_coding
from strata.serve.errors import ApiError
from tests.helpers import full_sweeps


def test_codings_reads_every_header_and_comma_list():
    assert body_coding.codings(["gzip, Deflate", " identity ,", "X-GZIP"]) == ["gzip", "deflate", "x-gzip"]
    assert body_coding.codings([]) == [] and body_coding.codings([""]) == []


@pytest.mark.parametrize("value", ["br", "zstd", "gzip, compress", "gzip;q=1"])
def test_an_unknown_coding_is_415_naming_it(value):
    with pytest.raises(ApiError) as e:
        body_coding.codings([value])
    assert e.value.status == 415 and e.value.param == "Content-Encoding" and "'" in e.value.message


def test_decode_undoes_the_codings_last_first():
    raw = b'{"prompt": "hi"}' * 50
    assert body_coding.decode(zlib.compress(gzip.compress(raw)), ["gzip", "deflate"], 1 << 20) == raw
    assert body_coding.decode(gzip.compress(raw[:9]) + gzip.compress(raw[9:]), ["gzip"], 1 << 20) == raw
    raw_deflate = zlib.compressobj(wbits=-15)
    assert body_coding.decode(raw_deflate.compress(raw) + raw_deflate.flush(), ["deflate"], 1 << 20) == raw
    assert body_coding.decode(b"", ["gzip"], 10) == b""
    assert body_coding.decode(gzip.compress(raw) + b"\0" * 7, ["gzip"], 1 << 20) == raw   # zeros after the last
    many = gzip.compress(b"", mtime=0) * (body_coding.GZIP_MEMBERS - 1) + gzip.compress(raw)
    assert body_coding.decode(many, ["gzip"], 1 << 20) == raw


def test_decoded_past_the_bound_is_413_and_stops_there():
    with pytest.raises(ApiError) as e:
        body_coding.decode(gzip.compress(b"x" * 1001), ["gzip"], 1000)
    assert e.value.status == 413
    assert body_coding.decode(gzip.compress(b"x" * 1000), ["gzip"], 1000) == b"x" * 1000


@pytest.mark.parametrize("raw,coding,why", [
    (gzip.compress(b"abc")[:-3], "gzip", "cut short"),
    (zlib.compress(b"abc") + b"!", "deflate", "1 bytes follow"),
    (b"not gzip", "gzip", "Error"),
    (gzip.compress(b"abc") + b"junk", "gzip", "4 bytes follow"),
    (gzip.compress(b"abc") + b"\0\0x", "gzip", "3 bytes follow"),
    (gzip.compress(b"abc") + b"\x1f\x8b", "gzip", "cut short"),
    (gzip.compress(b"", mtime=0) * (body_coding.GZIP_MEMBERS + 1), "gzip", f"more than {body_coding.GZIP_MEMBERS}"),
])
def test_bytes_that_are_not_the_coding_are_400(raw, coding, why):
    with pytest.raises(ApiError) as e:
        body_coding.decode(raw, [coding], 1 << 20)
    assert e.value.status == 400 and why in e.value.message and f"(Content-Encoding {coding})" in e.value.message


def _mangled(data: st.DataObject, raw: bytes) -> bytes:
    how = data.draw(st.sampled_from(["as is", "cut", "flip", "append", "bytes"]))
    if how == "cut":
        return raw[:data.draw(st.integers(0, len(raw)))]
    if how == "flip" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1:]
    if how == "append":
        return raw + data.draw(st.binary(min_size=1, max_size=20))
    if how == "bytes":
        return data.draw(st.binary(max_size=300))
    return raw


# CI: 2,000 cases; make test-sweeps: 100,000
@settings(max_examples=100_000 if full_sweeps() else 2_000, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(body=st.binary(max_size=400), coding=st.sampled_from(["gzip", "deflate", "x-gzip"]), data=st.data(),
       bound=st.integers(1, 800))
def test_any_bytes_decode_or_are_a_4xx(body, coding, data, bound):
    packed = {"deflate": zlib.compress}.get(coding, gzip.compress)(body)
    raw = _mangled(data, packed)
    try:
        out = body_coding.decode(raw, [coding], bound)
    except ApiError as e:
        assert e.status in (400, 413) and "\n" not in e.message
        if raw == packed:
            assert e.status == 413 and len(body) > bound
    else:
        assert len(out) <= bound
        if raw == packed:
            assert out == body
