"""The stage link's frame protection (link/secure.py, link/auth.py): the key derivation against RFC 5869 written out
here, the tag and ciphertext layout of PROTOCOL.md section 4.1, round trips, every refusal (a changed byte, a replay,
a drop, a reordering, a reflection, another connection's frame), the negotiation, and a fuzz of the sealed reader."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
import struct
import zlib

import numpy as np
import pytest

import link
from link import (FRAMES_AEAD, FRAMES_MAC, FRAMES_PLAIN, TAG_SIZE, Forward, FrameAuthError, FrameError, LinkError,
                  Ping, Result, channel_for, derive_keys, frame_bytes, read_frame, recv_frame, send_frame,
                  write_frame)
from tests.mutation import mutate
from tests.link_cases import GOLDEN_FRAMES, TrickleSocket, golden_cases

KEY = bytes(range(100, 132))
CH_NONCE = bytes(range(32, 64))
HELLO_NONCE = bytes(range(0, 32))
MODES = (FRAMES_MAC, FRAMES_AEAD)


def pair(frames: str, key: bytes = KEY, ch: bytes = CH_NONCE, hn: bytes = HELLO_NONCE):
    return channel_for("main", key, ch, hn, frames), channel_for("worker", key, ch, hn, frames)


def hkdf_rfc5869(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, t, i = b"", b"", 1
    while len(out) < length:
        t = hmac.new(prk, t + info + bytes([i]), hashlib.sha256).digest()
        out += t
        i += 1
    return out[:length]


def test_keys_are_hkdf_sha256_of_the_key_and_both_nonces():
    for frames in MODES:
        okm = hkdf_rfc5869(KEY, CH_NONCE + HELLO_NONCE, b"strata-link-5 frames " + frames.encode() + b"\0", 64)
        assert derive_keys(KEY, CH_NONCE, HELLO_NONCE, frames) == (okm[:32], okm[32:])
    a = derive_keys(KEY, CH_NONCE, HELLO_NONCE, FRAMES_MAC)
    assert len(set(a)) == 2                                              # one key per direction
    assert a != derive_keys(KEY, CH_NONCE, HELLO_NONCE, FRAMES_AEAD)      # and per protection
    assert a != derive_keys(KEY, CH_NONCE, bytes(32), FRAMES_MAC)        # and per connection
    with pytest.raises(LinkError):
        derive_keys(KEY, CH_NONCE, HELLO_NONCE, FRAMES_PLAIN)


def test_sealed_layout_is_the_documented_one():
    """mac: the section-1 frame, then AES-256-GCM's tag with no plaintext and the frame as associated data; aead:
    the header, then payload + checksum encrypted with the header as associated data, then the tag. The nonce is the
    sequence number (u64 little-endian, 4 zero bytes)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    msg, rid, flags = golden_cases()["ckpt_save"]
    plain = frame_bytes(msg, rid, flags)
    for frames in MODES:
        to_worker, _ = derive_keys(KEY, CH_NONCE, HELLO_NONCE, frames)
        main, _ = pair(frames)
        for seq in range(3):
            s = TrickleSocket(step=1 << 20)
            send_frame(s, msg, rid, flags, channel=main)
            nonce = struct.pack("<Q", seq) + bytes(4)
            if frames == FRAMES_MAC:
                want = plain + AESGCM(to_worker).encrypt(nonce, b"", plain)
            else:
                want = plain[:32] + AESGCM(to_worker).encrypt(nonce, plain[32:], plain[:32])
            assert bytes(s.sent) == want and len(want) == len(plain) + TAG_SIZE


@pytest.mark.parametrize("frames", MODES)
def test_round_trip_every_type_both_ways(frames):
    main, worker = pair(frames)
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(10)
        a.settimeout(10)
        cases = list(golden_cases().values())
        for msg, rid, flags in cases:
            send_frame(a, msg, rid, flags, channel=main)
            send_frame(b, msg, rid, flags, channel=worker)
        for msg, rid, flags in cases:
            for sock, ch in ((b, worker), (a, main)):
                h, got = recv_frame(sock, channel=ch)
                assert (h.request_id, h.flags, got) == (rid, flags, msg)
    assert main.send_seq == main.recv_seq == worker.send_seq == worker.recv_seq == len(cases)


@pytest.mark.parametrize("frames", MODES)
def test_large_forward_tensors_writable_and_aligned(frames):
    rng = np.random.default_rng(1)
    msg = Forward(7, True, rng.integers(0, 50000, 300, dtype=np.int32),
                  rng.standard_normal((300, 576)).astype(np.float32))
    main, worker = pair(frames)
    s = TrickleSocket(step=1 << 30)
    send_frame(s, msg, 3, channel=main)
    if frames == FRAMES_AEAD:              # the hidden rows do not travel in the clear
        assert msg.hidden.tobytes()[:4096] not in bytes(s.sent)
    r = TrickleSocket(bytes(s.sent), step=65536)
    _, got = recv_frame(r, channel=worker)
    assert got == msg and got.hidden.flags.writeable and got.hidden.ctypes.data % 16 == 0
    got.hidden[0, 0] = 1.0


def _sealed(frames, msgs, channel):
    out = []
    for m in msgs:
        s = TrickleSocket(step=1 << 30)
        send_frame(s, m, 1, channel=channel)
        out.append(bytes(s.sent))
    return out


def _reads(blob: bytes, channel, n: int) -> list:
    s = TrickleSocket(blob, step=1 << 20)
    return [recv_frame(s, channel=channel)[1] for _ in range(n)]


@pytest.mark.parametrize("frames", MODES)
def test_every_changed_byte_is_refused(frames):
    msg = Result(5, 10, np.arange(8, dtype=np.float32).reshape(2, 4))
    main, _ = pair(frames)
    (frame,) = _sealed(frames, [msg], main)
    for i in range(len(frame)):
        bad = bytearray(frame)
        bad[i] ^= 0x01
        if i < 28:                                   # so that the header checksum does not catch it first
            bad[28:32] = struct.pack("<I", zlib.crc32(bytes(bad[:28])))
        if frames == FRAMES_MAC and 32 <= i < len(frame) - 20:
            end = len(frame) - 20                    # nor the payload checksum
            bad[end:end + 4] = struct.pack("<I", zlib.crc32(bytes(bad[32:end])))
        _, worker = pair(frames)
        with pytest.raises(LinkError) as ei:
            _reads(bytes(bad), worker, 1)
        assert "\n" not in str(ei.value)
        if 12 <= i < 20 or i >= 32:                  # the request id, the payload, the tag: only the tag can tell
            assert isinstance(ei.value, FrameAuthError), (i, ei.value)


@pytest.mark.parametrize("frames", MODES)
def test_replay_drop_reorder_reflection_and_another_connection_are_refused(frames):
    msgs = [Ping(1), Ping(2), Ping(3)]
    main, worker = pair(frames)
    f = _sealed(frames, msgs, main)
    assert _reads(b"".join(f), pair(frames)[1], 3) == msgs                       # in order: accepted
    for blob, ok in ((f[0] + f[0], 1),              # replayed
                     (f[0] + f[2], 1),              # f[1] dropped
                     (f[1] + f[0], 0),              # reordered
                     (f[0][:32] + f[1][32:], 0)):   # spliced: one frame's header, another's payload and tag
        rx = pair(frames)[1]
        s = TrickleSocket(blob, step=1 << 20)
        for _ in range(ok):
            recv_frame(s, channel=rx)
        with pytest.raises(FrameAuthError, match="failed authentication"):
            recv_frame(s, channel=rx)
        with pytest.raises(FrameAuthError, match="already refused"):
            recv_frame(TrickleSocket(f[ok]), channel=rx)                        # the channel stays refused
        sent = TrickleSocket(step=1 << 20)                                      # but can still say why
        send_frame(sent, link.Error(link.ErrorCode.AUTH, "refused"), 0, channel=rx)
        _, err = recv_frame(TrickleSocket(bytes(sent.sent)), channel=pair(frames)[0])
        assert isinstance(err, link.Error)
    # reflected back to its sender: the directions have their own keys
    with pytest.raises(FrameAuthError):
        _reads(f[0], pair(frames)[0], 1)
    # the same frame position from another connection (another hello nonce), or under another key
    for other in (pair(frames, hn=bytes(32))[1], pair(frames, key=bytes(32))[1]):
        with pytest.raises(FrameAuthError):
            _reads(f[0], other, 1)
    # a plain frame where a sealed one is due
    with pytest.raises(LinkError):
        _reads(frame_bytes(Ping(1), 1), pair(frames)[1], 1)


async def test_asyncio_sealed_round_trip_and_large_payload_in_pieces():
    for frames in MODES:
        main, worker = pair(frames)
        a, b = socket.socketpair()
        ra, wa = await asyncio.open_connection(sock=a)
        rb, wb = await asyncio.open_connection(sock=b)
        try:
            big = Result(1, 2, np.random.default_rng(0).standard_normal((1200, 576)).astype(np.float32))  # 2.7 MB
            msgs = [m for m, _, _ in golden_cases().values()] + [big]

            async def send():
                for m in msgs:
                    write_frame(wa, m, 1, channel=main)
                    await wa.drain()
            t = asyncio.ensure_future(send())
            for m in msgs:
                _, got = await asyncio.wait_for(read_frame(rb, channel=worker), 20)
                assert got == m
            await t
        finally:
            for w in (wa, wb):
                w.close()


def test_labels_and_hello_frames():
    from link import Hello
    hello = Hello(5, "fp", 1, 2, 3, 4, "f32", 5, 6, 0, [], HELLO_NONCE)
    assert link.hello_label() == b"strata-link-5 hello\0" and link.ack_label() == b"strata-link-5 ack\0"
    assert link.hello_label(FRAMES_MAC) == b"strata-link-5 hello +mac\0"
    assert link.ack_label(FRAMES_AEAD) == b"strata-link-5 ack +aead\0"
    for frames in (FRAMES_PLAIN, FRAMES_MAC, FRAMES_AEAD):
        hello.mac = link.hello_mac(KEY, CH_NONCE, hello, frames)
        assert link.hello_frames(KEY, CH_NONCE, hello) == frames
        assert link.hello_frames(bytes(32), CH_NONCE, hello) is None
        assert link.hello_frames(KEY, bytes(32), hello) is None
    hello.mac = b""
    assert link.hello_frames(KEY, CH_NONCE, hello) is None
    # the plain label is protocol 5's own: the golden Hello still verifies under it
    h = golden_cases()["hello"][0]
    assert link.hello_frames(KEY, CH_NONCE, h) == FRAMES_PLAIN


def test_challenge_name_carries_the_capabilities():
    assert link.challenge_name("gpu-1", []) == "gpu-1"
    assert link.challenge_name("gpu-1", [link.CAP_MAC, link.CAP_AEAD]) == "gpu-1 +mac +aead"
    assert link.split_challenge_name("gpu-1 +mac +aead +encrypt") == ("gpu-1", {"+mac", "+aead", "+encrypt"})
    assert link.split_challenge_name("old worker") == ("old worker", set())
    assert link.split_challenge_name("+odd") == ("+odd", set())
    assert link.split_challenge_name(link.challenge_name("a +mac", [])) == ("a mac", set())
    with pytest.raises(ValueError):
        link.challenge_name("x", ["+nope"])


def test_negotiation():
    mac, aead, enc = link.CAP_MAC, link.CAP_AEAD, link.CAP_ENCRYPT
    new = {mac, aead}
    assert link.main_frames(new, encrypt=False, insecure=False) == FRAMES_MAC
    assert link.main_frames(new, encrypt=True, insecure=False) == FRAMES_AEAD
    assert link.main_frames(new | {enc}, encrypt=False, insecure=False) == FRAMES_AEAD   # the worker asks for it
    assert link.main_frames(new | {"+future"}, encrypt=False, insecure=True) == FRAMES_MAC
    assert link.main_frames(set(), encrypt=False, insecure=True) == FRAMES_PLAIN
    for caps, kw, match in ((set(), {}, "does not authenticate frames .* --insecure-link"),
                            (set(), {"encrypt": True}, "cannot encrypt"),
                            ({mac}, {"encrypt": True}, "does not encrypt"),
                            ({mac, enc}, {}, "does not encrypt")):
        with pytest.raises(LinkError, match=match) as ei:
            link.main_frames(caps, encrypt=kw.get("encrypt", False), insecure=False)
        assert ei.value.code == link.ErrorCode.AUTH and "\n" not in str(ei.value)
    link.worker_accepts(FRAMES_MAC, encrypt=False, insecure=False)
    link.worker_accepts(FRAMES_AEAD, encrypt=True, insecure=False)
    link.worker_accepts(FRAMES_PLAIN, encrypt=False, insecure=True)
    with pytest.raises(LinkError, match="does not authenticate frames .* --insecure-link"):
        link.worker_accepts(FRAMES_PLAIN, encrypt=False, insecure=False)
    with pytest.raises(LinkError, match="requires an encrypted link"):
        link.worker_accepts(FRAMES_MAC, encrypt=True, insecure=False)


# ---------------------------------------------------------------- fuzz of the sealed reader

def fuzz_sealed(frames: str, picks: list, changes, trunc, step: int) -> str:
    """A stream of sealed golden frames, mutated, read with recv_frame through a fresh channel `step` bytes at a
    time: every frame read is the one sealed at that place, and the stream ends clean ("accepted") or with a
    one-line LinkError ("refused"); anything else propagates."""
    msgs = [golden_cases()[n] for n in picks]
    main, worker = pair(frames)
    blob = b"".join(_sealed_one(main, m, rid, fl) for m, rid, fl in msgs)
    if blob and (changes or trunc is not None):
        blob = mutate(blob, changes, trunc)
    s = TrickleSocket(blob, step)
    for i in range(len(msgs) + 1):
        try:
            h, got = recv_frame(s, channel=worker)
        except ConnectionError as e:
            if s.at != len(blob) or str(e) != "peer closed the link":
                raise AssertionError(f"ConnectionError before the end of the stream: {e}")
            return "accepted"
        except LinkError as e:
            if "\n" in str(e):
                raise AssertionError(f"multi-line error: {str(e)!r}")
            return "refused"
        m, rid, fl = msgs[i]
        assert got == m and (h.request_id, h.flags) == (rid, fl), "a changed frame was accepted"
    raise AssertionError("more frames read than were sealed")


def _sealed_one(channel, msg, rid, flags) -> bytes:
    s = TrickleSocket(step=1 << 30)
    send_frame(s, msg, rid, flags, channel=channel)
    return bytes(s.sent)


def sealed_fuzz_strategies() -> dict:
    """name -> (hypothesis strategy of one case, check(case) -> "accepted" | "refused") for tools/fuzz_link.py and
    the CI fuzz: streams of sealed golden frames, mutated and cut, read in small pieces."""
    from hypothesis import strategies as hs
    names = sorted(GOLDEN_FRAMES)
    changes = hs.lists(hs.tuples(hs.integers(0, 10 ** 6), hs.integers(0, 255)), min_size=0, max_size=4)
    trunc = hs.one_of(hs.none(), hs.integers(0, 10 ** 6))
    case = hs.tuples(hs.lists(hs.sampled_from(names), max_size=4), changes, trunc, hs.integers(1, 64))
    return {f"sealed_{frames}": (case, lambda c, frames=frames: fuzz_sealed(frames, *c)) for frames in MODES}


@pytest.mark.parametrize("frames", MODES)
def test_fuzz_sealed_reader(frames):
    from hypothesis import HealthCheck, given, settings
    strategy, check = sealed_fuzz_strategies()[f"sealed_{frames}"]

    @settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        check(case)
    run()


def test_sealed_frame_refused_when_a_header_limit_is_met_first():
    """The header is checked (parse_header) before anything after it is read: an over-limit length is refused
    without waiting for the payload, sealed or not."""
    head = bytearray(frame_bytes(Ping(1), 1)[:32])
    head[20:28] = struct.pack("<Q", 1 << 40)
    head[28:32] = struct.pack("<I", zlib.crc32(bytes(head[:28])))
    with pytest.raises(FrameError, match="limit"):
        recv_frame(TrickleSocket(bytes(head)), channel=pair(FRAMES_MAC)[1])
