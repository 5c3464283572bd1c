"""The stage link's frame protection after the hello: per-connection keys (HKDF), per-direction sequence numbers,
and the AES-256-GCM tag (authentication alone, or with the payload encrypted) on every frame."""
from __future__ import annotations

import struct

from .errors import ErrorCode, LinkError

__all__ = ["FRAMES_PLAIN", "FRAMES_MAC", "FRAMES_AEAD", "FRAMES", "TAG_SIZE", "FRAME_KEY_LABEL", "FrameAuthError",
           "Channel", "derive_keys", "channel_for"]

FRAMES_PLAIN = "plain"      # frames as section 1 of PROTOCOL.md: checksums only (no key, or --insecure-link)
FRAMES_MAC = "mac"          # every frame followed by a 16-byte tag over all its bytes (GMAC)
FRAMES_AEAD = "aead"        # the payload and its checksum encrypted, the header authenticated (AES-256-GCM)
FRAMES = (FRAMES_PLAIN, FRAMES_MAC, FRAMES_AEAD)
TAG_SIZE = 16
FRAME_KEY_LABEL = b"strata-link-5 frames "
_SEQ_END = 1 << 64
_NONCE = struct.Struct("<Q4x")      # the 12-byte GCM nonce: the frame's sequence number, then 4 zero bytes


class FrameAuthError(LinkError):
    """A frame whose tag does not verify: tampered, replayed, reordered, dropped before it, or from another
    connection (code AUTH). The link must be closed."""

    def __init__(self, message: str):
        super().__init__(message, ErrorCode.AUTH)


def derive_keys(key: bytes, challenge_nonce: bytes, hello_nonce: bytes, frames: str) -> tuple[bytes, bytes]:
    """(main -> worker key, worker -> main key), 32 bytes each: HKDF-SHA256 of the shared key with salt
    challenge_nonce + hello_nonce and info FRAME_KEY_LABEL + frames + NUL."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    if frames not in (FRAMES_MAC, FRAMES_AEAD):
        raise LinkError(f"no frame keys for frames {frames!r}", ErrorCode.AUTH)
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=bytes(challenge_nonce) + bytes(hello_nonce),
               info=FRAME_KEY_LABEL + frames.encode() + b"\0").derive(bytes(key))
    return okm[:32], okm[32:]


class Channel:
    """One side's protection of one connection: the sending and receiving keys, each with its sequence number
    (the count of frames sealed / opened so far in that direction, never sent). Frames are sealed and opened in
    the order they go on the wire; after a refused frame the channel refuses every later received one (it can still
    seal the Error that tells the peer why, then the link is closed)."""

    def __init__(self, frames: str, send_key: bytes, recv_key: bytes):
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        self._invalid = InvalidTag
        if frames not in (FRAMES_MAC, FRAMES_AEAD):
            raise LinkError(f"a channel protects frames 'mac' or 'aead', not {frames!r}", ErrorCode.AUTH)
        self.frames = frames
        self.encrypt = frames == FRAMES_AEAD
        self._send, self._recv = AESGCM(bytes(send_key)), AESGCM(bytes(recv_key))
        self.send_seq = self.recv_seq = 0
        self.broken: str | None = None

    def seal(self, parts: list) -> list:
        """The buffers to send for a protocol-5 frame given as `parts` (its 32 header bytes first, then the payload
        pieces and the 4-byte payload checksum, as encode_frame makes them): with a tag, or encrypted."""
        if self.send_seq >= _SEQ_END:
            raise LinkError("2^64 frames sent on one connection: reconnect", ErrorCode.LIMIT)
        nonce = _NONCE.pack(self.send_seq)
        if self.encrypt:
            head = parts[0]
            plain = parts[1] if len(parts) == 2 else b"".join(parts[1:])
            if hasattr(self._send, "encrypt_into"):         # cryptography >= 45: no second copy
                out = bytearray(len(plain) + TAG_SIZE)
                self._send.encrypt_into(nonce, plain, head, out)
            else:
                out = self._send.encrypt(nonce, bytes(plain), bytes(head))
            sealed = [head, out]
        else:
            data = b"".join(parts)
            sealed = [data, self._send.encrypt(nonce, b"", data)]
        self.send_seq += 1
        return sealed

    def open(self, frame: bytearray) -> tuple[memoryview, bytes]:
        """(payload, its 4 checksum bytes) of one received frame: `frame` holds the 32 header bytes (already
        checked by parse_header), then the P + 4 + TAG_SIZE bytes after them. FrameAuthError when the tag does not
        verify under this direction's key and sequence number. The payload is a writable view (of `frame`, or of
        the decrypted copy)."""
        if self.broken is not None:
            raise FrameAuthError(f"the link already refused a frame ({self.broken}); it must be closed")
        mv = memoryview(frame)
        end = len(mv) - TAG_SIZE
        nonce = _NONCE.pack(self.recv_seq)
        try:
            if self.encrypt:
                if hasattr(self._recv, "decrypt_into"):
                    plain = bytearray(end - 32)
                    self._recv.decrypt_into(nonce, mv[32:], mv[:32], plain)
                else:
                    plain = bytearray(self._recv.decrypt(nonce, bytes(mv[32:]), bytes(mv[:32])))
                pv = memoryview(plain)
                payload, crc = pv[:-4], bytes(pv[-4:])
            else:
                self._recv.decrypt(nonce, mv[end:], mv[:end])
                payload, crc = mv[32:end - 4], bytes(mv[end - 4:end])
        except self._invalid:
            self.broken = f"frame {self.recv_seq} of this direction"
            raise FrameAuthError(f"frame {self.recv_seq} failed authentication (tampered, replayed, reordered, "
                                 "after a dropped frame, or from another connection)") from None
        self.recv_seq += 1
        return payload, crc


def channel_for(side: str, key: bytes, challenge_nonce: bytes, hello_nonce: bytes, frames: str) -> Channel | None:
    """The Channel of `side` ('main' or 'worker') for the negotiated `frames`; None for plain frames."""
    if frames == FRAMES_PLAIN:
        return None
    to_worker, to_main = derive_keys(key, challenge_nonce, hello_nonce, frames)
    if side == "main":
        return Channel(frames, to_worker, to_main)
    if side == "worker":
        return Channel(frames, to_main, to_worker)
    raise ValueError(f"side {side!r} is neither 'main' nor 'worker'")
