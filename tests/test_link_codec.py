"""The stage-link codec (link/, protocol 5): golden bytes, round trips, refusals, socket and asyncio readers, fuzz."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

import link
from link import (DEFAULT_MAX_PAYLOAD, FLAG_ASYNC, HEADER_SIZE, MAGIC, MAX_CONTROL_PAYLOAD, VERSION, Ack, BatchForward,
                  BatchResult, BatchRows, Bye, Challenge, CkptRestore, CkptSave, Commit, Error, ErrorCode, Forward,
                  FrameError, Header, Hello, HelloAck, Hop, LinkError, MsgType, PartPut, Ping, Pong, Reset, Result,
                  SeqResult, VersionMismatch, decode_frame, decode_message, encode_frame, encode_payload, frame_bytes,
                  parse_header, read_frame, recv_frame, send_frame, write_frame)
from tests.link_cases import (CHALLENGE_NONCE, GOLDEN, GOLDEN_FRAMES, HELLO_NONCE, KEY, TrickleSocket,
                               golden_cases)
from tests.mutation import mutate

ROOT = Path(__file__).resolve().parents[1]
_HEAD = struct.Struct("<4sHHHHQQ")


def raw_frame(type: int, payload: bytes, *, version: int = VERSION, flags: int = 0, reserved: int = 0,
              request_id: int = 1, payload_len: int | None = None, magic: bytes = MAGIC) -> bytes:
    """A frame with any header fields and correct checksums (to reach the check after them)."""
    head = _HEAD.pack(magic, version, type, flags, reserved, request_id,
                      len(payload) if payload_len is None else payload_len)
    return head + struct.pack("<I", zlib.crc32(head)) + payload + struct.pack("<I", zlib.crc32(payload))


def payload_of(frame: bytes) -> bytes:
    return frame[HEADER_SIZE:-4]


def refused(data, match: str, cls=FrameError, **kw) -> LinkError:
    with pytest.raises(cls, match=match) as ei:
        decode_frame(data, **kw)
    assert "\n" not in str(ei.value)
    return ei.value


@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_golden_encode(name):
    msg, rid, flags = golden_cases()[name]
    assert frame_bytes(msg, rid, flags) == GOLDEN_FRAMES[name]


@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_golden_decode(name):
    msg, rid, flags = golden_cases()[name]
    data = GOLDEN_FRAMES[name]
    header, got = decode_frame(data)
    assert header == Header(VERSION, link.msg_type(msg), flags, rid, len(data) - 36)
    assert type(got) is type(msg) and got == msg
    assert decode_message(header.type, payload_of(data)) == msg


def test_golden_covers_every_type():
    assert {link.msg_type(m) for m, _, _ in golden_cases().values()} == set(MsgType)
    assert set(GOLDEN) == set(golden_cases())


def test_golden_commit_bytes_spelled_out():
    """The byte-by-byte example in link/PROTOCOL.md."""
    b = GOLDEN_FRAMES["commit"]
    assert b[:4] == b"STLK" and b[4:6] == b"\x05\x00" and b[6:8] == b"\x05\x00" and b[8:10] == b"\x01\x00"
    assert b[10:12] == b"\0\0" and b[12:20] == (3).to_bytes(8, "little") and b[20:28] == (4).to_bytes(8, "little")
    assert b[28:32] == zlib.crc32(b[:28]).to_bytes(4, "little") and b[32:36] == (19).to_bytes(4, "little")
    assert b[36:] == zlib.crc32(b[32:36]).to_bytes(4, "little") and len(b) == 40


def test_tensor_layout_aligned():
    """Forward: pos, want_all, then each tensor's data at a 16-byte boundary of the payload."""
    p = payload_of(GOLDEN_FRAMES["forward"])
    assert p[4] == 1 and p[5:9] == bytes([2, 1, 0, 0]) and p[9:17] == (3).to_bytes(8, "little")
    assert p[17:32] == bytes(15) and np.frombuffer(p[32:44], "<i4").tolist() == [1, 2, 3]
    assert p[44:48] == bytes([0, 2, 0, 0]) and p[48:64] == struct.pack("<QQ", 3, 4) and len(p) == 64 + 48


# ---------------------------------------------------------------- round trips and zero copy

def test_round_trip_every_type_with_flags_and_ids():
    for name, (msg, _, _) in golden_cases().items():
        for rid, flags in ((0, 0), (2 ** 64 - 1, FLAG_ASYNC)):
            h, got = decode_frame(frame_bytes(msg, rid, flags))
            assert (h.request_id, h.flags, got) == (rid, flags, msg), name


def test_empty_fields_round_trip():
    for msg in (Forward(0, False, np.zeros(0, np.int32), np.zeros((0, 576), np.float16)), Reset([]),
                Result(0, 0, np.zeros((0, 0), np.float32)), Bye(""), Error(99, ""),
                Hello(5, "", 0, 0, 0, 0, "", 0, 0, 0, [], bytes(32)), HelloAck(5, "", 0, 0, 0, 0, "", "")):
        assert decode_frame(frame_bytes(msg, 1))[1] == msg
    assert decode_frame(frame_bytes(Error(99, "x"), 1))[1].code == 99          # codes unknown here stay ints


def test_a_result_names_dropped_parts_in_an_optional_last_field():
    """+drops: the ids follow the hidden rows only when there are any, so a Result that drops nothing is the bytes
    it always was; a present but empty list is refused (one encoding per message)."""
    plain = Result(3, 7, np.ones((1, 4), np.float32))
    dropped = Result(3, 7, np.ones((1, 4), np.float32), [5, 9])
    assert frame_bytes(Result(3, 7, np.ones((1, 4), np.float32), []), 1) == frame_bytes(plain, 1)
    assert decode_frame(frame_bytes(plain, 1))[1].dropped == []
    assert decode_frame(frame_bytes(dropped, 1))[1] == dropped
    body = b"".join(bytes(b) for b in encode_payload(plain))
    with pytest.raises(FrameError, match="present but empty"):
        decode_message(MsgType.RESULT, body + struct.pack("<I", 0))
    with pytest.raises(FrameError, match="dropped count 2 needs 16 bytes"):
        decode_message(MsgType.RESULT, body + struct.pack("<I", 2) + bytes(8))


def test_sequence_ids_are_optional_last_fields():
    """+slots: a state verb names its sequence in an optional last u32, absent for sequence 0 (so a main of one slot
    sends the bytes it always sent), present never 0; Hello.slots likewise, absent for 1."""
    cases = [(Forward(3, False, np.ones(1, np.int32), np.ones((1, 4), np.float32)), MsgType.FORWARD),
             (Commit(19), MsgType.COMMIT), (Reset([1, 3]), MsgType.RESET), (CkptSave(9, 17, [1]), MsgType.CKPT_SAVE),
             (CkptRestore(3, 12, [3]), MsgType.CKPT_RESTORE),
             (PartPut(11, 12, 10, 4, np.frombuffer(b"STRP", np.uint8), [11]), MsgType.PART_PUT)]
    for msg, t in cases:
        body = b"".join(bytes(b) for b in encode_payload(msg))
        msg.seq = 0
        assert b"".join(bytes(b) for b in encode_payload(msg)) == body
        msg.seq = 7
        with_seq = b"".join(bytes(b) for b in encode_payload(msg))
        assert with_seq == body + struct.pack("<I", 7) and decode_message(t, with_seq).seq == 7
        assert decode_message(t, body).seq == 0
        with pytest.raises(FrameError, match="seq is present with its default 0"):
            decode_message(t, body + struct.pack("<I", 0))
        with pytest.raises(FrameError, match="ends inside its seq"):
            decode_message(t, body + b"\x07\x00")
    hello = golden_cases()["hello"][0]
    body = b"".join(bytes(b) for b in encode_payload(hello))
    with pytest.raises(FrameError, match="slots is present with its default 1"):
        decode_message(MsgType.HELLO, body + struct.pack("<I", 1))
    assert decode_message(MsgType.HELLO, body + struct.pack("<I", 4)).slots == 4


def test_row_ids_are_asked_for_in_an_optional_flag_after_slots():
    """+rowids: Hello.row_ids is one byte 1 after a present slots field, absent when false (a Hello that does not ask
    is the bytes it always was); one slot cannot ask (there is no slots field to follow), a present 0 is refused."""
    hello = golden_cases()["hello_row_ids"][0]
    body = b"".join(bytes(b) for b in encode_payload(hello))
    assert body[-5:] == struct.pack("<IB", 4, 1)
    assert decode_message(MsgType.HELLO, body[:-1]) == dataclasses.replace(hello, row_ids=False)
    for tail, match in [(b"\x00", "row_ids is present as 0"), (b"\x02", "row_ids is present as 2"),
                        (b"\x01\x01", "1 trailing bytes")]:
        with pytest.raises(FrameError, match=match):
            decode_message(MsgType.HELLO, body[:-1] + tail)
    with pytest.raises(FrameError, match="asks for row ids with one slot"):
        encode_payload(dataclasses.replace(hello, slots=1))
    with pytest.raises(FrameError, match="ends inside its slots"):          # a flag without slots before it
        decode_message(MsgType.HELLO, body[:-5] + b"\x01")


def test_batch_rows_name_each_row_before_the_hidden_rows():
    """A BatchRows is a BatchResult with the rows (u32 count, then seq and pos per row) after compute_us; the count is
    checked (1..256, within what is left) before anything is read, and its encoder refuses what the decoder would."""
    msg = golden_cases()["batch_rows"][0]
    p = payload_of(GOLDEN_FRAMES["batch_rows"])
    assert p[8:12] == struct.pack("<I", 3) and np.frombuffer(p[12:36], "<u4").tolist() == [2, 17, 0, 5, 1, 9]
    got = decode_message(MsgType.BATCH_ROWS, p)
    assert isinstance(got, BatchResult) and (got.seqs, got.positions) == ([2, 0, 1], [17, 5, 9])
    for count, match in [(0, "seqs count 0 is outside 1..256"), (257, "count 257 is outside"),
                         (4, "seqs count 4 needs 32 bytes")]:
        with pytest.raises(FrameError, match=match):
            decode_message(MsgType.BATCH_ROWS, p[:8] + struct.pack("<I", count) + (p[12:36] if count == 4 else b""))
    for bad, match in [(dataclasses.replace(msg, seqs=[], positions=[]), "names 0 rows"),
                       (dataclasses.replace(msg, positions=[1]), "3 sequence ids but 1 positions"),
                       (dataclasses.replace(msg, seqs=[0, -1, 2]), r"seqs\[1\].seq = -1 is outside")]:
        with pytest.raises(FrameError, match=match):
            encode_payload(bad)
    assert BatchRows(1, msg.hidden, [], [0], [0]) != BatchResult(1, msg.hidden, [])      # another message


def test_seq_result_names_its_sequence_after_pos():
    """A SeqResult (+rowids, the answer to a Forward) is a Result with its sequence id, a plain u32 always present
    (sequence 0 too), right after pos; the rest is a Result's (an optional dropped list last). A Result's bytes read
    as a SeqResult are another message (or none), never the same one."""
    msg = golden_cases()["seq_result"][0]
    p = payload_of(GOLDEN_FRAMES["seq_result"])
    assert len(p) == 108 and p[:16] == struct.pack("<IIQ", 20, 2, 1500)
    assert p[96:] == struct.pack("<IQ", 1, 4)                 # dropped = [4], after the hidden rows (16..96)
    got = decode_message(MsgType.SEQ_RESULT, p)
    assert isinstance(got, Result) and got.seq == 2 and got == msg and got.dropped == [4]
    zero = dataclasses.replace(msg, seq=0, dropped=[])
    body = b"".join(bytes(b) for b in encode_payload(zero))
    assert body[4:8] == b"\0\0\0\0" and decode_message(MsgType.SEQ_RESULT, body) == zero
    with pytest.raises(FrameError, match="ends inside its compute_us"):
        decode_message(MsgType.SEQ_RESULT, p[:8])
    with pytest.raises(FrameError, match=r"seq = 4294967296 is outside"):
        encode_payload(dataclasses.replace(msg, seq=2 ** 32))
    assert SeqResult(1, 2, msg.hidden, [], 0) != Result(1, 2, msg.hidden, [])        # another message
    plain = payload_of(frame_bytes(Result(20, 1500, msg.hidden, [4]), 1))
    with pytest.raises(FrameError):
        decode_message(MsgType.SEQ_RESULT, plain)


def test_batch_forward_rows_are_checked_before_anything_is_read():
    tok, hid = np.array([1, 2], np.int32), np.ones((2, 4), np.float32)
    ok = BatchForward([0, 3], [5, 9], tok, hid)
    assert decode_frame(frame_bytes(ok, 1))[1] == ok
    body = b"".join(bytes(b) for b in encode_payload(ok))
    for count, match in [(0, "seqs count 0 is outside 1..256"), (257, "count 257 is outside"),
                         (1 << 30, "outside 1..256"), (3, "seqs count 3 needs 24 bytes")]:
        with pytest.raises(FrameError, match=match):
            decode_message(MsgType.BATCH_FORWARD, struct.pack("<I", count) + (body[4:20] if count == 3 else b""))
    for bad, match in [(BatchForward([1, 1], [5, 9], tok, hid), "names a sequence twice"),
                       (BatchForward([0], [5], tok, hid), "1 rows but 2 tokens"),
                       (BatchForward([0, 1], [5], tok, hid), "2 sequence ids but 1 positions"),
                       (BatchForward([0, 1], [5, 2 ** 32], tok, hid), "pos = 4294967296 is outside")]:
        with pytest.raises(FrameError, match=match):
            encode_payload(bad)
    twice = body[:4] + body[4:12] + body[4:12] + body[20:]      # both rows name sequence 0: refused on decode too
    with pytest.raises(FrameError, match="names a sequence twice"):
        decode_message(MsgType.BATCH_FORWARD, twice)


def test_tensors_not_copied_on_encode():
    hidden = np.ones((5, 8), np.float32)
    tokens = np.arange(5, dtype=np.int32)
    bufs = encode_frame(Forward(0, True, tokens, hidden), 1)
    views = [b for b in bufs if isinstance(b, memoryview)]
    assert len(views) == 2 and views[0].obj is tokens and views[1].obj is hidden


def test_non_contiguous_and_big_endian_arrays_encode_as_contiguous_little_endian():
    base = np.arange(40, dtype=np.float32).reshape(5, 8)
    msg = Result(1, 2, base[:, ::2])
    assert decode_frame(frame_bytes(msg, 1))[1] == Result(1, 2, np.ascontiguousarray(base[:, ::2]))
    big = Forward(0, False, np.arange(3, dtype=">i4"), np.arange(6, dtype=">f4").reshape(3, 2))
    got = decode_frame(frame_bytes(big, 1))[1]
    assert got.tokens.tolist() == [0, 1, 2] and got.hidden.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert got.hidden.dtype == np.dtype("<f4")


def test_decoded_tensors_are_views_of_the_payload():
    data = bytearray(GOLDEN_FRAMES["forward"])
    _, msg = decode_frame(data)
    assert np.shares_memory(msg.hidden, np.frombuffer(data, np.uint8)) and msg.hidden.flags.writeable
    assert msg.hidden.ctypes.data % 16 == np.frombuffer(data, np.uint8).ctypes.data % 16


def test_message_equality_compares_arrays_by_dtype_shape_and_bytes():
    t = np.array([1, 2], np.int32)
    h = np.zeros((2, 3), np.float32)
    assert Forward(0, False, t, h) == Forward(0, False, t.copy(), h.copy())
    assert Forward(0, False, t, h) != Forward(0, False, t, h.astype(np.float16))
    assert Forward(0, False, t, h) != Forward(0, False, t, h.reshape(2, 3, 1)[:, :, 0].reshape(3, 2))
    assert Forward(0, False, t, h) != Forward(0, False, t, h + 1)
    nan = np.full((1, 1), np.nan, np.float32)
    assert Result(0, 0, nan) == Result(0, 0, nan.copy())
    assert Commit(1) != Ack(1, 0, 0) and Commit(1) == Commit(1)
    with pytest.raises(TypeError):
        hash(Commit(1))


# ---------------------------------------------------------------- refusals: the header

def test_refuses_wrong_magic():
    e = refused(b"STLX" + GOLDEN_FRAMES["ping"][4:], r"not a stage-link frame \(magic b'STLX', expected b'STLK'\)")
    assert e.code == ErrorCode.BAD_FRAME


def test_refuses_header_checksum():
    b = bytearray(GOLDEN_FRAMES["ping"])
    b[12] ^= 1                                    # the request id
    refused(bytes(b), "frame header checksum mismatch")
    b = bytearray(GOLDEN_FRAMES["ping"])
    b[30] ^= 0x80                                 # the checksum itself
    refused(bytes(b), "frame header checksum mismatch")


def test_refuses_payload_checksum():
    b = bytearray(GOLDEN_FRAMES["forward"])
    b[HEADER_SIZE + 40] ^= 4
    refused(bytes(b), "FORWARD payload checksum mismatch")
    b = bytearray(GOLDEN_FRAMES["forward"])
    b[-1] ^= 4
    refused(bytes(b), "FORWARD payload checksum mismatch")


def test_refuses_unknown_type():
    for t in (0, 22, 99, 0xFFFF):
        refused(raw_frame(t, b""), f"unknown message type {t}$")
    with pytest.raises(FrameError, match="unknown message type 22"):
        decode_message(22, b"")


def test_refuses_unknown_flag_bits():
    for flags in (0x2, 0x3, 0x8000):
        refused(raw_frame(MsgType.PING, bytes(8), flags=flags), "unknown flag bits")
    with pytest.raises(FrameError, match="unknown frame flag bits"):
        encode_frame(Ping(1), 1, 0x4)


def test_refuses_nonzero_reserved():
    refused(raw_frame(MsgType.PING, bytes(8), reserved=1), "reserved field is 0x0001, must be 0")


@pytest.mark.parametrize("theirs", [4, 6])
def test_refuses_other_versions_naming_both(theirs):
    e = refused(raw_frame(MsgType.HELLO, b"whatever a v%d hello holds" % theirs, version=theirs),
                f"^peer speaks stage-link protocol {theirs}, this side speaks 5$", VersionMismatch)
    assert (e.theirs, e.ours, e.code) == (theirs, 5, ErrorCode.VERSION)
    assert isinstance(e, LinkError) and isinstance(e, ValueError)


def test_version_checked_after_magic_and_checksum():
    b = bytearray(raw_frame(MsgType.PING, bytes(8), version=4))
    b[0] = ord("X")
    refused(bytes(b), "not a stage-link frame")
    b = bytearray(raw_frame(MsgType.PING, bytes(8), version=4))
    b[28] ^= 1
    refused(bytes(b), "header checksum")


def test_refuses_over_limit_payload_before_reading_it():
    e = refused(raw_frame(MsgType.FORWARD, b"", payload_len=DEFAULT_MAX_PAYLOAD + 1)[:HEADER_SIZE],
                f"FORWARD frame declares a payload of {DEFAULT_MAX_PAYLOAD + 1} bytes, the limit is")
    assert e.code == ErrorCode.LIMIT
    with pytest.raises(FrameError, match="limit is 1048576") as ei:
        parse_header(raw_frame(MsgType.PING, b"", payload_len=MAX_CONTROL_PAYLOAD + 1)[:HEADER_SIZE])
    assert ei.value.code == ErrorCode.LIMIT
    frame = frame_bytes(golden_cases()["forward"][0], 1)
    refused(frame, "the limit is 100", max_payload=100)
    assert decode_frame(frame, max_payload=len(frame) - 36)[1] == golden_cases()["forward"][0]
    with pytest.raises(FrameError, match="over the limit of 100") as ei:
        encode_frame(golden_cases()["forward"][0], 1, max_payload=100)
    assert ei.value.code == ErrorCode.LIMIT


def test_over_limit_header_alone_on_a_socket_is_refused_without_waiting_for_the_payload():
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(raw_frame(MsgType.RESULT, b"", payload_len=2 ** 62)[:HEADER_SIZE])
        with pytest.raises(FrameError, match="the limit is") as ei:
            recv_frame(b)
        assert ei.value.code == ErrorCode.LIMIT


@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_refuses_truncation_at_every_byte(name):
    data = GOLDEN_FRAMES[name]
    for cut in range(len(data)):
        with pytest.raises(FrameError, match="short frame"):
            decode_frame(data[:cut])


def test_refuses_bytes_after_the_frame():
    refused(GOLDEN_FRAMES["ping"] + b"\0", "1 trailing bytes after the frame")
    refused(GOLDEN_FRAMES["ping"] * 2, "44 trailing bytes after the frame")


def test_parse_header_wants_exactly_32_bytes():
    with pytest.raises(FrameError, match="a frame header is 32 bytes, got 31"):
        parse_header(GOLDEN_FRAMES["ping"][:31])
    with pytest.raises(FrameError, match="got 33"):
        parse_header(GOLDEN_FRAMES["ping"][:33])
    assert parse_header(GOLDEN_FRAMES["ping"][:32]) == Header(5, MsgType.PING, 0, 7, 8)


# ---------------------------------------------------------------- refusals: payloads

@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_refuses_trailing_bytes_inside_a_payload(name):
    msg, _, _ = golden_cases()[name]
    p = payload_of(GOLDEN_FRAMES[name])
    # an optional last field (a Result's dropped ids, +drops; a sequence id or Hello.slots, +slots) reads what
    # follows the fields before it: one byte is that field cut short
    seq = getattr(msg, "seq", 0) == 0 and hasattr(msg, "seq")
    why = ("ends inside its dropped count" if name == "result" else "ends inside its seq" if seq
           else "ends inside its slots" if name == "hello" else "payload has 1 trailing bytes after its last field")
    refused(raw_frame(link.msg_type(msg), p + b"\0"), why)


@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_refuses_payload_cut_short_at_every_byte(name):
    """A payload that ends early, with checksums that agree: the field it ends in is named (a list or tensor that
    does not fit is refused from its count or shape, before anything is read)."""
    msg, _, _ = golden_cases()[name]
    p = payload_of(GOLDEN_FRAMES[name])
    # cut just before an optional last field that is present: the message without it (a message of its own; a
    # Hello's row_ids follows its optional slots, so it has two such cuts)
    bare, bares = copy.copy(msg), {}
    for f, default in (("row_ids", False), ("slots", 1), ("seq", 0), ("dropped", [])):
        if hasattr(bare, f) and not (f == "seq" and isinstance(bare, SeqResult)):   # a SeqResult's is not optional
            setattr(bare, f, default)
            bares[len(b"".join(bytes(b) for b in encode_payload(bare)))] = copy.copy(bare)
    for cut in range(len(p)):
        if cut in bares:
            assert decode_message(link.msg_type(msg), p[:cut]) == bares[cut]
            continue
        refused(raw_frame(link.msg_type(msg), p[:cut]), r"payload ends inside its |payload's .* needs .* \d+ are left")


def _str_payload(raw: bytes, length: int | None = None) -> bytes:
    return struct.pack("<H", len(raw) if length is None else length) + raw


def test_refuses_strings_not_utf8_or_too_long():
    refused(raw_frame(MsgType.BYE, _str_payload(b"\xff\xfe")), "Bye payload's reason is not valid UTF-8")
    refused(raw_frame(MsgType.BYE, _str_payload(b"\xed\xa0\x80")), "not valid UTF-8")       # a surrogate
    refused(raw_frame(MsgType.BYE, _str_payload(b"a" * 4097)), "reason is 4097 bytes long, the limit is 4096")
    assert decode_frame(raw_frame(MsgType.BYE, _str_payload("é".encode() * 2048)))[1] == Bye("é" * 2048)
    with pytest.raises(FrameError, match="Bye.reason is 4098 bytes of UTF-8, the limit is 4096"):
        frame_bytes(Bye("é" * 2049), 1)
    with pytest.raises(FrameError, match="lone surrogate"):
        frame_bytes(Bye("\ud800"), 1)


def test_refuses_list_counts_beyond_the_payload_before_allocating():
    refused(raw_frame(MsgType.RESET, struct.pack("<I", 0xFFFFFFFF)),
            "keep count 4294967295 needs 34359738360 bytes, 0 are left")
    refused(raw_frame(MsgType.CKPT_SAVE, struct.pack("<QII", 1, 2, 2) + bytes(15)), "keep count 2 needs 16 bytes, 15")
    hello = payload_of(GOLDEN_FRAMES["hello"])
    at = hello.index(struct.pack("<I", 2) + _str_payload(b"10.0.0.3"))
    refused(raw_frame(MsgType.HELLO, hello[:at] + struct.pack("<I", 0xFFFFFFFF) + hello[at + 4:]),
            "next_hops count 4294967295 needs at least")


def _tensor(code: int, dims, pad: int = 0, at: int = 5, fill: bytes = b"") -> bytes:
    head = struct.pack("<BBH", code, len(dims), pad) + struct.pack(f"<{len(dims)}Q", *dims)
    return head + bytes((-(at + len(head))) % 16) + fill


def test_refuses_bad_tensors():
    def fwd(tokens: bytes, hidden: bytes = b"") -> bytes:
        return raw_frame(MsgType.FORWARD, struct.pack("<IB", 0, 0) + tokens + hidden)
    refused(fwd(_tensor(7, [1])), "tokens has unknown dtype code 7")
    refused(fwd(_tensor(5, [1])), r"tokens has dtype code 5 \(bfloat16, reserved\)")
    refused(fwd(_tensor(2, [1, 1, 1, 1, 1])), "tokens has 5 dimensions, the limit is 4")
    refused(fwd(_tensor(2, [1], pad=1)), "tokens header has nonzero pad bytes")
    good = _tensor(2, [1], fill=b"\1\0\0\0")
    bad = bytearray(good)
    bad[14] = 1
    refused(fwd(bytes(bad)), "tokens padding is not zero")
    refused(fwd(_tensor(0, [1], fill=bytes(4))), "tokens has dtype float32, expected int32")
    refused(fwd(_tensor(2, [1, 1], fill=bytes(4))), "tokens has 2 dimensions, expected 1")
    refused(fwd(_tensor(2, [2 ** 40], fill=bytes(8))),
            f"tokens \\({2 ** 40},\\) int32 needs {2 ** 42} bytes, 8 are left")
    refused(fwd(_tensor(2, [2 ** 64 - 1])), "over the limit of 281474976710656 elements")
    refused(fwd(_tensor(2, [0]), _tensor(0, [1, 1, 0], at=32)), "hidden has 3 dimensions, expected 2")
    refused(fwd(_tensor(2, [0]), _tensor(0, [2 ** 49, 0], at=32)), "over the limit of 281474976710656 elements")
    refused(fwd(_tensor(2, [0]), _tensor(0, [1, 2], at=32, fill=bytes(8))), "carries 0 tokens but 1 hidden rows")
    refused(fwd(_tensor(2, [0]), _tensor(2, [0, 2], at=32)), "hidden has dtype int32, expected float32 or float16")
    assert decode_frame(fwd(_tensor(2, [0]), _tensor(1, [0, 2 ** 32], at=32)))[1].hidden.shape == (0, 2 ** 32)


def test_refuses_bad_scalars():
    refused(raw_frame(MsgType.FORWARD, struct.pack("<IB", 0, 2)), r"want_all is 2, not a bool \(0 or 1\)")
    refused(raw_frame(MsgType.CHALLENGE, bytes(32) + b"\x07" + _str_payload(b"w")), "keyed is 7, not a bool")
    ack = payload_of(GOLDEN_FRAMES["hello_ack"])
    refused(raw_frame(MsgType.HELLO_ACK, ack[:-34] + _str_payload(b"12345")), "mac is 5 bytes, expected 0 or 32")
    refused(raw_frame(MsgType.COMMIT, b"\1\0\0"), r"Commit payload ends inside its pos \(3 of 4 bytes left\)")


def test_encoder_refuses_what_the_decoder_would():
    cases = [
        (Commit(-1), r"Commit.pos = -1 is outside 0..4294967295"),
        (Commit(2 ** 32), "outside"),
        (Commit(1.5), "Commit.pos must be an integer, not float"),
        (Error(70000, "x"), "Error.code = 70000"),
        (Ping(2 ** 64), "outside 0..18446744073709551615"),
        (Reset([1, -2]), r"Reset.keep\[1\] = -2"),
        (Reset(None), "Reset.keep must be a list"),
        (Challenge(bytes(31), False, "w"), "Challenge.nonce must be 32 bytes"),
        (Challenge(bytes(32), 2, "w"), "Challenge.keyed must be a bool"),
        (Bye(b"bytes"), "Bye.reason must be a str"),
        (HelloAck(5, "f", 0, 1, 0, 0, "w", "d", b"short"), "HelloAck.mac must be empty or 32 bytes"),
        (Hello(5, "f", 0, 1, 1, 1, "f", 1, 1, 1, [("h", 1, 0, 1)], bytes(32)), r"Hello.next_hops\[0\] must be a Hop"),
        (Hello(5, "f", 0, 1, 1, 1, "f", 1, 1, 1, [Hop("h", 70000, 0, 1)], bytes(32)), r"next_hops\[0\].port"),
        (Forward(0, False, np.zeros(2, np.int64), np.zeros((2, 1), np.float32)), "Forward.tokens has dtype int64"),
        (Forward(0, False, np.zeros(2, np.int32), np.zeros(2, np.float32)), "Forward.hidden has 1 dimensions"),
        (Forward(0, False, np.zeros(2, np.int32), np.zeros((2, 1), np.float64)), "expected float32 or float16"),
        (Forward(0, False, np.zeros(2, np.int32), np.zeros((3, 1), np.float32)), "carries 2 tokens but 3 hidden"),
        (Forward(0, False, [1, 2], np.zeros((2, 1), np.float32)), "Forward.tokens must be a numpy array, not list"),
    ]
    for msg, match in cases:
        with pytest.raises(FrameError, match=match):
            frame_bytes(msg, 1)
    with pytest.raises(TypeError, match="str is not a stage-link message"):
        frame_bytes("hello", 1)
    with pytest.raises(FrameError, match="request id -1"):
        frame_bytes(Ping(1), -1)


def test_errors_are_value_errors_with_codes_and_pickle():
    import pickle
    for e in (LinkError("x", ErrorCode.AUTH), FrameError("y"), FrameError("z", ErrorCode.LIMIT), VersionMismatch(4, 5)):
        back = pickle.loads(pickle.dumps(e))
        assert isinstance(e, ValueError) and type(back) is type(e) and str(back) == str(e) and back.code == e.code
    assert FrameError("y").code == ErrorCode.BAD_FRAME and LinkError("x").code == ErrorCode.INTERNAL
    assert [c.value for c in ErrorCode] == list(range(1, 11))
    assert [t.value for t in MsgType] == list(range(1, 22))


def test_error_of_an_exception_is_one_clipped_line():
    e = Error.of(VersionMismatch(4, 5))
    assert e == Error(ErrorCode.VERSION, "peer speaks stage-link protocol 4, this side speaks 5")
    long = Error.of(RuntimeError("é" * 5000 + "\nsecond line"))
    assert long.code == ErrorCode.INTERNAL and len(long.message.encode()) <= 4096 and "\n" not in long.message
    assert decode_frame(frame_bytes(long, 1))[1] == long
    assert Error.of(KeyError()).message == "KeyError"


def test_codec_does_not_import_strata():
    code = "import sys, link; assert not [m for m in sys.modules if m.split('.')[0] == 'strata'], sys.modules"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(ROOT))


# ---------------------------------------------------------------- blocking sockets

def test_send_frame_loops_on_partial_sends():
    for name, (msg, rid, flags) in golden_cases().items():
        for step in (1, 7, 33):
            s = TrickleSocket(step=step)
            assert send_frame(s, msg, rid, flags) == len(GOLDEN_FRAMES[name])
            assert bytes(s.sent) == GOLDEN_FRAMES[name]


def test_recv_frame_over_short_reads():
    data = b"".join(GOLDEN_FRAMES[n] for n in sorted(GOLDEN_FRAMES))
    s = TrickleSocket(data, step=5)
    for name in sorted(GOLDEN_FRAMES):
        assert recv_frame(s)[1] == golden_cases()[name][0]
    with pytest.raises(ConnectionError, match="^peer closed the link$"):
        recv_frame(s)


def test_socketpair_round_trip_every_type_in_order():
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(10)
        cases = list(golden_cases().values())
        for msg, rid, flags in cases:
            send_frame(a, msg, rid, flags)
        for msg, rid, flags in cases:
            h, got = recv_frame(b)
            assert (h.request_id, h.flags, got) == (rid, flags, msg)


def test_socketpair_large_forward_with_partial_sends():
    rng = np.random.default_rng(0)
    msg = Forward(100, True, rng.integers(0, 50000, 700, dtype=np.int32),
                  rng.standard_normal((700, 576)).astype(np.float32))           # 1.6 MB: many partial sends
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(30)
        b.settimeout(30)
        sent = []
        t = threading.Thread(target=lambda: sent.append(send_frame(a, msg, 9)))
        t.start()
        h, got = recv_frame(b)
        t.join()
    assert got == msg and h.request_id == 9 and sent == [HEADER_SIZE + h.payload_len + 4]
    assert got.hidden.flags.writeable and got.tokens.flags.writeable
    got.hidden[0, 0] = 1.0                                                      # writable views of the payload


def test_socketpair_eof_at_boundary_inside_a_frame_and_timeout():
    data = GOLDEN_FRAMES["ckpt_save"]
    for cut in range(len(data)):
        a, b = socket.socketpair()
        with a, b:
            b.settimeout(10)
            a.sendall(data[:cut])
            a.shutdown(socket.SHUT_WR)
            if cut == 0:
                with pytest.raises(ConnectionError, match="^peer closed the link$"):
                    recv_frame(b)
            else:
                with pytest.raises(FrameError, match="the link closed inside a frame's") as ei:
                    recv_frame(b)
                assert not isinstance(ei.value, ConnectionError)
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.05)
        with pytest.raises(TimeoutError):
            recv_frame(b)


def test_pipelined_commit_settles_before_the_next_request():
    """The ordering rules: a Commit sent ahead with ASYNC, its Ack read later, replies in request order."""
    main, worker = socket.socketpair()
    with main, worker:
        main.settimeout(10)
        worker.settimeout(10)
        send_frame(main, Commit(19), 3, FLAG_ASYNC)                 # not waited for now
        send_frame(main, Reset([1]), 4)                             # the next prompt: settle first
        for _ in range(2):                                          # the worker answers in order
            h, req = recv_frame(worker)
            send_frame(worker, Ack(getattr(req, "pos", 0), 1, 100), h.request_id)
        h, ack = recv_frame(main)
        assert h.request_id == 3 and ack == Ack(19, 1, 100)         # the settle: the Commit's Ack comes first
        h, ack = recv_frame(main)
        assert h.request_id == 4 and ack == Ack(0, 1, 100)


# ---------------------------------------------------------------- asyncio streams

async def _pair():
    a, b = socket.socketpair()
    ra, wa = await asyncio.open_connection(sock=a)
    rb, wb = await asyncio.open_connection(sock=b)
    return (ra, wa), (rb, wb)


async def _close(*writers):
    for w in writers:
        w.close()
        try:
            await w.wait_closed()
        except OSError:
            pass


async def test_asyncio_round_trip_every_type():
    (ra, wa), (rb, wb) = await _pair()
    try:
        for msg, rid, flags in golden_cases().values():
            write_frame(wa, msg, rid, flags)
        await wa.drain()
        for msg, rid, flags in golden_cases().values():
            h, got = await asyncio.wait_for(read_frame(rb), 10)
            assert (h.request_id, h.flags, got) == (rid, flags, msg)
    finally:
        await _close(wa, wb)


async def test_asyncio_large_payload_in_pieces_and_writable():
    rng = np.random.default_rng(1)
    msg = Result(3, 7, rng.standard_normal((1000, 576)).astype(np.float32))     # 2.3 MB > RECV_CHUNK
    (ra, wa), (rb, wb) = await _pair()
    try:
        async def send():
            write_frame(wa, msg, 5)
            await wa.drain()
        _, (h, got) = await asyncio.wait_for(asyncio.gather(send(), read_frame(rb)), 30)
        assert got == msg and h.request_id == 5 and got.hidden.flags.writeable
    finally:
        await _close(wa, wb)


async def test_asyncio_eof_and_limits():
    data = GOLDEN_FRAMES["hello_ack"]
    plen = len(data) - HEADER_SIZE - 4
    for cut in (0, 1, 31, 32, 40, len(data) - 1):
        got = cut if cut < HEADER_SIZE else cut - HEADER_SIZE if cut - HEADER_SIZE < plen else cut - HEADER_SIZE - plen
        (ra, wa), (rb, wb) = await _pair()
        try:
            wa.write(data[:cut])
            await wa.drain()
            wa.write_eof()
            if cut == 0:
                with pytest.raises(ConnectionError, match="^peer closed the link$"):
                    await asyncio.wait_for(read_frame(rb), 10)
            else:
                with pytest.raises(FrameError, match=f"closed inside a frame's .* \\({got} of "):
                    await asyncio.wait_for(read_frame(rb), 10)
        finally:
            await _close(wa, wb)
    (ra, wa), (rb, wb) = await _pair()
    try:
        wa.write(raw_frame(MsgType.FORWARD, b"", payload_len=2 ** 40)[:HEADER_SIZE])   # the payload never comes
        await wa.drain()
        with pytest.raises(FrameError, match="the limit is") as ei:
            await asyncio.wait_for(read_frame(rb), 10)
        assert ei.value.code == ErrorCode.LIMIT
        wa.write(raw_frame(MsgType.PING, bytes(8), version=4))
        await wa.drain()
        with pytest.raises(VersionMismatch, match="protocol 4, this side speaks 5"):
            await asyncio.wait_for(read_frame(rb), 10)
    finally:
        await _close(wa, wb)


# ---------------------------------------------------------------- handshake authentication

def test_hello_and_ack_macs():
    hello = golden_cases()["hello"][0]
    ack = golden_cases()["hello_ack"][0]
    assert len(hello.mac) == 32 and link.verify(link.hello_mac(KEY, CHALLENGE_NONCE, hello), hello.mac)
    assert link.verify(link.ack_mac(KEY, HELLO_NONCE, ack), ack.mac)
    import hashlib
    import hmac as hm
    body = b"".join(encode_payload(Hello(**{**hello.__dict__, "mac": b""})))
    assert hello.mac == hm.new(KEY, b"strata-link-5 hello\0" + CHALLENGE_NONCE + body, hashlib.sha256).digest()
    assert not link.verify(link.hello_mac(KEY, HELLO_NONCE, hello), hello.mac)          # another challenge
    assert not link.verify(link.hello_mac(KEY[::-1], CHALLENGE_NONCE, hello), hello.mac)  # another key
    for field, value in (("lo", 1), ("fingerprint", "other"), ("next_hops", []), ("nonce", bytes(32)),
                         ("ckpt_max", 64)):
        changed = Hello(**{**hello.__dict__, field: value})
        assert not link.verify(link.hello_mac(KEY, CHALLENGE_NONCE, changed), hello.mac), field
    assert link.hello_mac(KEY, CHALLENGE_NONCE, Hello(**{**hello.__dict__, "mac": bytes(32)})) == hello.mac
    assert link.ack_mac(KEY, CHALLENGE_NONCE, ack) != link.ack_mac(KEY, HELLO_NONCE, ack)
    assert not link.verify(hello.mac, b"")
    assert len(link.new_nonce()) == 32 and link.new_nonce() != link.new_nonce()


def test_key_files(tmp_path):
    p = tmp_path / "link.key"
    key = link.write_key_file(p)
    assert len(key) == 32 and p.read_bytes() == key and stat.S_IMODE(p.stat().st_mode) == 0o600
    assert link.read_key_file(p) == key
    with pytest.raises(LinkError, match=f"the link key file {p} already exists; refusing to overwrite it") as ei:
        link.write_key_file(p)
    assert ei.value.code == ErrorCode.AUTH and p.read_bytes() == key
    os.chmod(p, 0o640)
    with pytest.raises(LinkError, match=r"is open to group or others \(mode 0640\); chmod 600 it") as ei:
        link.read_key_file(p)
    assert ei.value.code == ErrorCode.AUTH
    os.chmod(p, 0o604)
    with pytest.raises(LinkError, match="open to group or others"):
        link.read_key_file(p)
    short = tmp_path / "short.key"
    fd = os.open(short, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"x" * 31)
    os.close(fd)
    with pytest.raises(LinkError, match=f"the link key file {short} holds 31 bytes, at least 32 are needed"):
        link.read_key_file(short)
    with pytest.raises(LinkError, match="cannot read the link key file .*missing.key: No such file"):
        link.read_key_file(tmp_path / "missing.key")
    with pytest.raises(LinkError, match="is not a regular file"):
        link.read_key_file(tmp_path)
    big = tmp_path / "big.key"
    fd = os.open(big, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"x" * 5000)
    os.close(fd)
    with pytest.raises(LinkError, match="5000 bytes, more than 4096"):
        link.read_key_file(big)


# ---------------------------------------------------------------- fuzz (shared with tools/fuzz_link.py)

def fuzz_decode(blob) -> str:
    """decode_frame(blob) returns a message that re-encodes to the same bytes ("accepted") or raises a one-line
    LinkError ("refused"); anything else is a crash (the exception propagates)."""
    try:
        header, msg = decode_frame(blob)
    except LinkError as e:
        if "\n" in str(e):
            raise AssertionError(f"multi-line error: {str(e)!r}")
        return "refused"
    again = frame_bytes(msg, header.request_id, header.flags)
    if again != bytes(blob):
        raise AssertionError("an accepted frame encodes back to other bytes")
    return "accepted"


def fuzz_stream(blob: bytes, step: int) -> str:
    """recv_frame over a stream of `blob` delivered `step` bytes at a time: frames until a clean end
    ("accepted": ConnectionError at a frame boundary) or a one-line LinkError ("refused")."""
    s = TrickleSocket(blob, step)
    for _ in range(len(blob) + 1):
        try:
            recv_frame(s)
        except ConnectionError as e:
            if s.at != len(blob) or str(e) != "peer closed the link":
                raise AssertionError(f"ConnectionError before the end of the stream: {e}")
            return "accepted"
        except LinkError as e:
            if "\n" in str(e):
                raise AssertionError(f"multi-line error: {str(e)!r}")
            return "refused"
    raise AssertionError("the stream reader did not end")


def fuzz_strategies():
    """name -> (hypothesis strategy of one case, check(case) -> "accepted" | "refused")."""
    from hypothesis import strategies as hs
    names = sorted(GOLDEN_FRAMES)
    changes = hs.lists(hs.tuples(hs.integers(0, 10 ** 6), hs.integers(0, 255)), min_size=0, max_size=6)
    trunc = hs.one_of(hs.none(), hs.integers(0, 10 ** 6))

    def payload_mutated(case):
        name, ch, tr, extra = case
        frame = GOLDEN_FRAMES[name]
        p = mutate(payload_of(frame), ch, tr) if ch or tr is not None else payload_of(frame)
        return fuzz_decode(raw_frame(frame[6] | frame[7] << 8, p + extra, flags=frame[8],
                                     request_id=int.from_bytes(frame[12:20], "little")))

    def header_fields(case):
        t, version, flags, reserved, length, name, payload = case
        frame = GOLDEN_FRAMES[name]                 # None: the golden frame's type / payload
        t = frame[6] | frame[7] << 8 if t is None else t
        payload = payload_of(frame) if payload is None else payload
        return fuzz_decode(raw_frame(t, payload, version=version, flags=flags, reserved=reserved,
                                     payload_len=length))

    def stream(case):
        picks, ch, tr, step = case
        blob = b"".join(GOLDEN_FRAMES[n] for n in picks)
        return fuzz_stream(mutate(blob, ch, tr) if blob and (ch or tr is not None) else blob, step)

    @hs.composite
    def batch_payload(draw):
        """A BatchForward or BatchResult payload built field by field from drawn values (row counts near and past
        the limits, repeated sequences, tensors of other shapes and dtypes, an optional tail), then mutated."""
        n = draw(hs.sampled_from([0, 1, 2, 3, 255, 256, 257, 2 ** 32 - 1]) | hs.integers(0, 6))
        rows = draw(hs.lists(hs.tuples(hs.integers(0, 4), hs.integers(0, 2 ** 32 - 1)), max_size=6))
        k, e = draw(hs.integers(0, 4)), draw(hs.integers(0, 4))
        dt = draw(hs.sampled_from(["<f4", "<f2", "<i4"]))
        if draw(hs.booleans()):                    # a well-formed one, to be mutated (or not)
            rows = draw(hs.lists(hs.tuples(hs.integers(0, 9), hs.integers(0, 2 ** 32 - 1)), min_size=1, max_size=5,
                                 unique_by=lambda r: r[0]))
            n = k = len(rows)

        tok = np.arange(k, dtype="<i4") if draw(hs.booleans()) else np.zeros((k, 1), "<i4")
        hid = np.ones((k, e), dt)
        if draw(hs.booleans()):
            payload = struct.pack("<I", n) + b"".join(struct.pack("<II", q, p) for q, p in rows)
            payload += _tensor_at(len(payload), tok)
            t, payload = MsgType.BATCH_FORWARD, payload + _tensor_at(len(payload), hid)
        elif draw(hs.booleans()):
            payload = struct.pack("<Q", draw(hs.integers(0, 2 ** 64 - 1)))
            t, payload = MsgType.BATCH_RESULT, payload + _tensor_at(len(payload), hid)
        elif draw(hs.booleans()):                  # BatchRows: the rows between compute_us and the hidden rows
            payload = struct.pack("<QI", draw(hs.integers(0, 2 ** 64 - 1)), n)
            payload += b"".join(struct.pack("<II", q, p) for q, p in rows)
            t, payload = MsgType.BATCH_ROWS, payload + _tensor_at(len(payload), hid)
        else:                                      # SeqResult: pos, the sequence id, compute_us, the hidden rows
            payload = struct.pack("<IIQ", draw(hs.integers(0, 2 ** 32 - 1)), draw(hs.integers(0, 2 ** 32 - 1)),
                                  draw(hs.integers(0, 2 ** 64 - 1)))
            t, payload = MsgType.SEQ_RESULT, payload + _tensor_at(len(payload), hid)
        payload += draw(hs.sampled_from([b"", b"", b"", struct.pack("<I", 0), struct.pack("<IQ", 1, 9), b"\x01"]))
        ch, tr = draw(changes), draw(trunc)
        return t, (mutate(payload, ch, tr) if payload and (ch or tr is not None) else payload)

    return {
        "batch_payload": (batch_payload(), lambda c: fuzz_decode(raw_frame(c[0], c[1]))),
        "random_bytes": (hs.binary(max_size=512), fuzz_decode),
        "golden_mutated": (hs.tuples(hs.sampled_from(names), changes, trunc),
                           lambda c: fuzz_decode(mutate(GOLDEN_FRAMES[c[0]], c[1], c[2]))),
        "payload_mutated": (hs.tuples(hs.sampled_from(names), changes, trunc, hs.binary(max_size=8)),
                            payload_mutated),
        "random_payload": (hs.tuples(hs.sampled_from(list(MsgType)), hs.binary(max_size=400)),
                           lambda c: fuzz_decode(raw_frame(c[0], c[1]))),
        "header_fields": (hs.tuples(hs.one_of(hs.none(), hs.integers(0, 16)), hs.sampled_from([4, 5, 5, 5, 6, 0xFFFF]),
                                    hs.sampled_from([0, 0, 1, 2, 0x8000]), hs.sampled_from([0, 0, 0, 1]),
                                    hs.one_of(hs.none(), hs.integers(0, 2 ** 64 - 1)),
                                    hs.sampled_from(names), hs.one_of(hs.none(), hs.binary(max_size=64))),
                           header_fields),
        "stream": (hs.tuples(hs.lists(hs.sampled_from(names), max_size=4), changes, trunc, hs.integers(1, 64)),
                   stream),
    }


def _tensor_at(at: int, a: np.ndarray) -> bytes:
    """A tensor field as PROTOCOL.md section 2 spells it, starting at payload offset `at` (written here, apart
    from the codec)."""
    code = {"<f4": 0, "<f2": 1, "<i4": 2}[a.dtype.str]
    head = struct.pack("<BBH", code, a.ndim, 0) + b"".join(struct.pack("<Q", d) for d in a.shape)
    return head + bytes((-(at + len(head))) % 16) + a.tobytes()


CI_FUZZ = {"batch_payload": 1000, "random_bytes": 600, "golden_mutated": 1000, "payload_mutated": 1200,
           "random_payload": 800, "header_fields": 400, "stream": 400}


@pytest.mark.parametrize("name", sorted(CI_FUZZ))
def test_fuzz(name):
    """Every input decodes to a message that encodes back to the same bytes, or a one-line LinkError; nothing else."""
    from hypothesis import HealthCheck, given, settings
    strategy, check = fuzz_strategies()[name]

    @settings(max_examples=CI_FUZZ[name], deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        check(case)
    run()


def _message_strategy():
    from hypothesis import strategies as hs
    u16, u32, u64 = (hs.integers(0, 2 ** b - 1) for b in (16, 32, 64))
    text = hs.text(max_size=24)
    ids = hs.lists(u64, max_size=6)
    mac = hs.one_of(hs.just(b""), hs.binary(min_size=32, max_size=32))
    nonce = hs.binary(min_size=32, max_size=32)
    hop = hs.builds(Hop, text, u16, u32, u32)

    @hs.composite
    def forward(draw):
        n, e = draw(hs.integers(0, 5)), draw(hs.integers(0, 6))
        dt = draw(hs.sampled_from(["<f4", "<f2"]))
        tok = np.frombuffer(draw(hs.binary(min_size=4 * n, max_size=4 * n)), "<i4")
        hid = np.frombuffer(draw(hs.binary(min_size=n * e * np.dtype(dt).itemsize,
                                           max_size=n * e * np.dtype(dt).itemsize)), dt).reshape(n, e)
        return Forward(draw(u32), draw(hs.booleans()), tok, hid, draw(u32))

    @hs.composite
    def batch(draw):
        n, e = draw(hs.integers(1, 5)), draw(hs.integers(0, 6))
        seqs = draw(hs.lists(u32, min_size=n, max_size=n, unique=True))
        tok = np.frombuffer(draw(hs.binary(min_size=4 * n, max_size=4 * n)), "<i4")
        hid = np.frombuffer(draw(hs.binary(min_size=4 * n * e, max_size=4 * n * e)), "<f4").reshape(n, e)
        kind = draw(hs.sampled_from(["forward", "result", "rows"]))
        if kind == "forward":
            return BatchForward(seqs, draw(hs.lists(u32, min_size=n, max_size=n)), tok, hid)
        if kind == "rows":          # ids as a worker might send them: any sequences (repeats too), any positions
            ids = draw(hs.lists(u32, min_size=1, max_size=6))
            return BatchRows(draw(u64), hid, draw(hs.lists(u64, max_size=3)), ids,
                             draw(hs.lists(u32, min_size=len(ids), max_size=len(ids))))
        return BatchResult(draw(u64), hid, draw(hs.lists(u64, max_size=3)))

    @hs.composite
    def hello(draw):
        slots = draw(hs.integers(1, 2 ** 32 - 1))
        return Hello(draw(u16), draw(text), draw(u32), draw(u32), draw(u32), draw(u32), draw(text), draw(u32),
                     draw(u32), draw(u32), draw(hs.lists(hop, max_size=3)), draw(nonce), draw(mac), slots,
                     slots > 1 and draw(hs.booleans()))

    @hs.composite
    def result(draw):
        r, e = draw(hs.integers(0, 5)), draw(hs.integers(0, 6))
        dt = draw(hs.sampled_from(["<f4", "<f2"]))
        size = r * e * np.dtype(dt).itemsize
        args = (draw(u32), draw(u64), np.frombuffer(draw(hs.binary(min_size=size, max_size=size)), dt).reshape(r, e),
                draw(hs.lists(u64, max_size=3)))
        return SeqResult(*args, seq=draw(u32)) if draw(hs.booleans()) else Result(*args)

    return hs.one_of(
        hs.builds(Challenge, nonce, hs.booleans(), text),
        hello(),
        hs.builds(HelloAck, u16, text, u32, u32, u32, u64, text, text, mac),
        forward(), result(), batch(), hs.builds(Commit, u32, u32), hs.builds(Reset, ids, u32),
        hs.builds(CkptSave, u64, u32, ids, u32), hs.builds(CkptRestore, u64, u32, ids, u32),
        hs.builds(Ack, u32, u32, u64),
        hs.builds(Error, hs.sampled_from(list(ErrorCode)) | u16, text), hs.builds(Ping, u64),
        hs.builds(Pong, u64), hs.builds(Bye, text))


def test_round_trip_property():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as hs

    @settings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(_message_strategy(), hs.integers(0, 2 ** 64 - 1), hs.sampled_from([0, FLAG_ASYNC]))
    def run(msg, rid, flags):
        data = frame_bytes(msg, rid, flags)
        h, got = decode_frame(data)
        assert got == msg and (h.request_id, h.flags, h.type) == (rid, flags, link.msg_type(msg))
        assert len(data) == HEADER_SIZE + h.payload_len + 4
    run()
