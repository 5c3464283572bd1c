"""The stage link's handshake authentication: the HMAC-SHA256 tags of Hello and HelloAck (whose labels carry the frame
protection the two sides agreed), the capabilities a worker announces in its Challenge, and the shared key file."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import stat

from .errors import ErrorCode, LinkError
from .messages import MAX_STR, NONCE_SIZE, Hello, HelloAck, encode_payload
from .secure import FRAMES, FRAMES_AEAD, FRAMES_MAC, FRAMES_PLAIN

__all__ = ["KEY_SIZE", "MAX_KEY_FILE", "HELLO_LABEL", "ACK_LABEL", "CAP_MAC", "CAP_AEAD", "CAP_ENCRYPT",
           "hello_label", "ack_label", "hello_mac", "ack_mac", "hello_frames", "verify", "new_nonce",
           "CAP_SPEC", "CAP_PARK", "CAP_DROPS", "CAP_SLOTS", "CAP_ROWIDS", "challenge_name", "split_challenge_name",
           "main_frames", "worker_accepts", "read_key_file", "write_key_file"]

KEY_SIZE = 32                   # write_key_file writes this many random bytes; read_key_file wants at least this
MAX_KEY_FILE = 4096             # a key file longer than this is not a key file
HELLO_LABEL = b"strata-link-5 hello\0"     # plain frames after the hello (no frame protection)
ACK_LABEL = b"strata-link-5 ack\0"
CAP_MAC = "+mac"            # Challenge capability: this worker authenticates every frame after the hello
CAP_AEAD = "+aead"          # ... and can encrypt them
CAP_ENCRYPT = "+encrypt"    # ... and requires encryption (strata worker --link-encrypt)
CAP_SPEC = "+spec"          # a Forward with want_all keeps each token's state; a Commit inside it rolls back to it
CAP_PARK = "+park"          # PartGet / PartPut: a kept part's bytes streamed to the main and back (parking, session files)
CAP_DROPS = "+drops"        # a Result names the kept parts the worker dropped to make room for its Forward
CAP_SLOTS = "+slots"        # one sequence per request slot (seq fields, Hello.slots) and BatchForward / BatchResult
# asked in the Hello (row_ids): a BatchForward is answered with BatchRows (each row's ids), a Forward with SeqResult
CAP_ROWIDS = "+rowids"
_CAPS = (CAP_MAC, CAP_AEAD, CAP_ENCRYPT, CAP_SPEC, CAP_PARK, CAP_DROPS, CAP_SLOTS, CAP_ROWIDS)


def hello_label(frames: str = FRAMES_PLAIN) -> bytes:
    """The Hello MAC's label for the frame protection the main chose: HELLO_LABEL for plain frames, else
    b"strata-link-5 hello +mac\0" or b"... +aead\0"."""
    return HELLO_LABEL if frames == FRAMES_PLAIN else b"strata-link-5 hello +" + _frames(frames).encode() + b"\0"


def ack_label(frames: str = FRAMES_PLAIN) -> bytes:
    """The HelloAck MAC's label, as hello_label."""
    return ACK_LABEL if frames == FRAMES_PLAIN else b"strata-link-5 ack +" + _frames(frames).encode() + b"\0"


def _frames(frames: str) -> str:
    if frames not in FRAMES:
        raise LinkError(f"unknown frame protection {frames!r} (one of {', '.join(FRAMES)})", ErrorCode.AUTH)
    return frames


def _mac(key: bytes, label: bytes, nonce: bytes, msg) -> bytes:
    if len(nonce) != NONCE_SIZE:
        raise LinkError(f"a handshake nonce is {NONCE_SIZE} bytes, got {len(nonce)}", ErrorCode.AUTH)
    h = hmac.new(key, label + bytes(nonce), hashlib.sha256)
    for piece in encode_payload(dataclasses.replace(msg, mac=b"")):
        h.update(piece)
    return h.digest()


def hello_mac(key: bytes, challenge_nonce: bytes, hello: Hello, frames: str = FRAMES_PLAIN) -> bytes:
    """HMAC-SHA256(key, hello_label(frames) + the Challenge's nonce + the Hello's payload with an empty mac)."""
    return _mac(key, hello_label(frames), challenge_nonce, hello)


def ack_mac(key: bytes, hello_nonce: bytes, ack: HelloAck, frames: str = FRAMES_PLAIN) -> bytes:
    """HMAC-SHA256(key, ack_label(frames) + the Hello's nonce + the HelloAck's payload with an empty mac)."""
    return _mac(key, ack_label(frames), hello_nonce, ack)


def hello_frames(key: bytes, challenge_nonce: bytes, hello: Hello) -> str | None:
    """The frame protection whose label the Hello's mac verifies under (the main's choice), or None when it
    verifies under none (no key or another key)."""
    for frames in (FRAMES_AEAD, FRAMES_MAC, FRAMES_PLAIN):
        if verify(hello_mac(key, challenge_nonce, hello, frames), hello.mac):
            return frames
    return None


def challenge_name(name: str, caps) -> str:
    """The Challenge's `worker` field: the worker's name, then each capability after a space (`gpu-1 +mac +aead`);
    a main that predates the capabilities shows the whole string in its logs and ignores it."""
    caps = list(caps)
    for c in caps:
        if c not in _CAPS:
            raise ValueError(f"unknown link capability {c!r}")
    text = " ".join([name.replace(" +", " "), *caps])
    return text.encode("utf-8")[:MAX_STR].decode("utf-8", "ignore")


def split_challenge_name(text: str) -> tuple[str, set]:
    """(name, capabilities) of a Challenge's `worker` field: the trailing words that start with '+' are the
    capabilities (unknown ones kept, and ignored by main_frames)."""
    words = text.split(" ")
    i = len(words)
    while i > 1 and words[i - 1].startswith("+"):
        i -= 1
    return " ".join(words[:i]), set(words[i:])


def main_frames(caps, *, encrypt: bool, insecure: bool) -> str:
    """The frame protection a keyed main chooses for a worker that announced `caps`: aead when either side asks
    for encryption, else mac; plain only for a worker without capabilities and with `insecure` (--insecure-link).
    LinkError (AUTH, one line, without the worker's name) when no choice is acceptable."""
    caps = set(caps)
    if CAP_MAC not in caps:
        if encrypt:
            raise LinkError("cannot encrypt the link (--link-encrypt): it does not protect frames after the hello "
                            "(an older strata worker?)", ErrorCode.AUTH)
        if not insecure:
            raise LinkError("does not authenticate frames after the hello (an older strata worker?): upgrade it, "
                            "or give --insecure-link to accept unauthenticated frames", ErrorCode.AUTH)
        return FRAMES_PLAIN
    if encrypt or CAP_ENCRYPT in caps:
        if CAP_AEAD not in caps:
            raise LinkError("cannot encrypt the link (--link-encrypt): it authenticates frames but does not "
                            "encrypt them", ErrorCode.AUTH)
        return FRAMES_AEAD
    return FRAMES_MAC


def worker_accepts(frames: str, *, encrypt: bool, insecure: bool) -> None:
    """Whether a keyed worker takes the frame protection a main's Hello chose; LinkError (AUTH, one line) if not."""
    if frames == FRAMES_PLAIN and not insecure:
        raise LinkError("the main does not authenticate frames after the hello (an older strata?): upgrade it, "
                        "or start this worker with --insecure-link", ErrorCode.AUTH)
    if encrypt and frames != FRAMES_AEAD:
        raise LinkError("this worker requires an encrypted link (--link-encrypt); the main's hello asked for "
                        f"{frames} frames", ErrorCode.AUTH)


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two tags."""
    return hmac.compare_digest(bytes(expected), bytes(got))


def new_nonce() -> bytes:
    """A fresh 32-byte nonce for a Challenge or a Hello."""
    return secrets.token_bytes(NONCE_SIZE)


def read_key_file(path) -> bytes:
    """The shared key: the file's raw bytes (all of them). Refused (LinkError, code AUTH) when the file cannot be
    read, is not a regular file, is shorter than 32 or longer than 4096 bytes, or is open to group or others."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise LinkError(f"cannot read the link key file {path}: {e.strerror or e}", ErrorCode.AUTH) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LinkError(f"the link key file {path} is not a regular file", ErrorCode.AUTH)
        if os.name == "posix" and st.st_mode & 0o077:
            mode = stat.S_IMODE(st.st_mode)
            raise LinkError(f"the link key file {path} is open to group or others (mode {mode:04o}); chmod 600 it",
                            ErrorCode.AUTH)
        if st.st_size > MAX_KEY_FILE:
            raise LinkError(f"the link key file {path} is {st.st_size} bytes, more than {MAX_KEY_FILE}",
                            ErrorCode.AUTH)
        key = b""
        while len(key) <= MAX_KEY_FILE:
            more = os.read(fd, MAX_KEY_FILE + 1 - len(key))
            if not more:
                break
            key += more
    except OSError as e:
        raise LinkError(f"cannot read the link key file {path}: {e.strerror or e}", ErrorCode.AUTH) from None
    finally:
        os.close(fd)
    if len(key) < KEY_SIZE:
        raise LinkError(f"the link key file {path} holds {len(key)} bytes, at least {KEY_SIZE} are needed",
                        ErrorCode.AUTH)
    if len(key) > MAX_KEY_FILE:
        raise LinkError(f"the link key file {path} is more than {MAX_KEY_FILE} bytes", ErrorCode.AUTH)
    return key


def write_key_file(path) -> bytes:
    """Create `path` with 32 random raw bytes (the key, returned), mode 0600; never overwrites (LinkError, AUTH)."""
    path = os.fspath(path)
    key = secrets.token_bytes(KEY_SIZE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
    except FileExistsError:
        raise LinkError(f"the link key file {path} already exists; refusing to overwrite it", ErrorCode.AUTH) from None
    except OSError as e:
        raise LinkError(f"cannot create the link key file {path}: {e.strerror or e}", ErrorCode.AUTH) from None
    try:
        if os.name == "posix":
            os.fchmod(fd, 0o600)
        view = memoryview(key)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise LinkError(f"cannot write the link key file {path}: {e.strerror or e}", ErrorCode.AUTH) from None
    os.close(fd)
    return key
