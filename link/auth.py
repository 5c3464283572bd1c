"""The stage link's handshake authentication: the HMAC-SHA256 tags of Hello and HelloAck, and the shared key file."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import secrets
import stat

from .errors import ErrorCode, LinkError
from .messages import NONCE_SIZE, Hello, HelloAck, encode_payload

__all__ = ["KEY_SIZE", "MAX_KEY_FILE", "HELLO_LABEL", "ACK_LABEL", "hello_mac", "ack_mac", "verify", "new_nonce",
           "read_key_file", "write_key_file"]

KEY_SIZE = 32                   # write_key_file writes this many random bytes; read_key_file wants at least this
MAX_KEY_FILE = 4096             # a key file longer than this is not a key file
HELLO_LABEL = b"strata-link-5 hello\0"
ACK_LABEL = b"strata-link-5 ack\0"


def _mac(key: bytes, label: bytes, nonce: bytes, msg) -> bytes:
    if len(nonce) != NONCE_SIZE:
        raise LinkError(f"a handshake nonce is {NONCE_SIZE} bytes, got {len(nonce)}", ErrorCode.AUTH)
    h = hmac.new(key, label + bytes(nonce), hashlib.sha256)
    for piece in encode_payload(dataclasses.replace(msg, mac=b"")):
        h.update(piece)
    return h.digest()


def hello_mac(key: bytes, challenge_nonce: bytes, hello: Hello) -> bytes:
    """HMAC-SHA256(key, HELLO_LABEL + the Challenge's nonce + the Hello's payload with an empty mac)."""
    return _mac(key, HELLO_LABEL, challenge_nonce, hello)


def ack_mac(key: bytes, hello_nonce: bytes, ack: HelloAck) -> bytes:
    """HMAC-SHA256(key, ACK_LABEL + the Hello's nonce + the HelloAck's payload with an empty mac)."""
    return _mac(key, ACK_LABEL, hello_nonce, ack)


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
