"""Session files: a conversation on disk (--slot-save-path, POST /slots/N?action=save|restore), format versions 1
(one stage) and 3 (per-stage blocks; version 2 is reserved), read under limits taken from the live engine before
anything is allocated, written atomically.

Layout (little-endian):

    offset  size  field
    0       8     magic b"STRATASF"
    8       4     format version (1 or 3)
    12      4     header length H (1 .. MAX_HEADER)
    16      4     CRC-32 of the header
    20      H     header: UTF-8 JSON {fingerprint (the model's, GGUFModelFile.fingerprint), n_tokens, live_ok,
                  checkpoints: [[pos, kind], ...], carves: [[lo, hi], ...] (one per stage)}
    20+H    4*N   the token ids, int32 (N = n_tokens)
    ..      4     CRC-32 of the token ids
    ..            stage 0's block
    version 3 only:
    ..      4     the number of later stages S
    ..            S blocks, one per later stage in layer order
    stage block: u32 number of parts (1 + len(checkpoints)), then the parts in the state-part format
    (strata/memory/codec.py, each with its own checked header and checksum): the conversation's part, then one
    per checkpoint in header order (their K/V a prefix of the conversation's: running state only).

Nothing may follow the last block. Every refusal is a SessionError (a Refused naming the request's `filename`) with
a one-line message.

Files are opened relative to their directory without following a symbolic link and without blocking (a FIFO),
and read only when they are regular files; a save writes an unpredictable temporary beside the file, created
exclusively, then renames it over the file. A directory quota (--slot-quota-mib) bounds the bytes of the regular files
directly in the directory: a save that would pass it is refused (QuotaExceeded) once its temporary would, and the
temporary removed.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import stat
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from strata.cache.conversation import Conversation, SavedCheckpoint
from strata.cache.cut_points import KINDS
from strata.errors import Refused
from strata.memory import FormatError, PartMismatch, codec

MAGIC = b"STRATASF"
VERSION_ONE_STAGE = 1
VERSION_STAGES = 3
RESERVED = {2: "version 2 is reserved (a BF16 state codec) and not read by this build"}
MAX_HEADER = 1 << 20
MAX_CHECKPOINTS = 64
_FIXED = struct.Struct("<8sIII")
_U32 = struct.Struct("<I")
_NAME_MAX = 200          # the temporary file beside it adds a dot and a suffix (file names: 255 bytes)


class SessionError(Refused):
    """A session file that cannot be saved or restored here (one-line message naming why): a 400 whose field at
    fault is the request's `filename`."""

    param = "filename"


class QuotaExceeded(SessionError):
    """A save that would take the session directory past its quota (--slot-quota-mib): nothing was written. A 400
    (not 507: no request field is at fault and a retry cannot succeed until files are removed), code
    slot_quota_exceeded, its message naming the quota and the directory's use."""

    param = None
    code = "slot_quota_exceeded"


class StorageFailed(SessionError):
    """A save the file system refused (the disk or a disk quota full, a read-only or unwritable directory, an I/O
    error): the server's fault, not the request's, and nothing was written (a file it would replace is intact):
    507 Insufficient Storage (code insufficient_storage) when space ran out, else 500 (code storage_error)."""

    param = None

    def __init__(self, message: str, full: bool):
        super().__init__(message, code="insufficient_storage" if full else "storage_error")
        self.status = 507 if full else 500


# new session files: llama.cpp's fs_validate_filename intent, the portable subset (no '~', '$', spaces, look-alike
# separators, bidirectional or format characters; Windows device names refused too)
_SAVE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")
_DEVICE_NAME = re.compile(r"^(con|prn|aux|nul|com[0-9]|lpt[0-9])(\..*)?$", re.IGNORECASE)
_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


_JSON_TYPES = {dict: "an object", list: "an array", bool: "a boolean", int: "an integer", float: "a number",
               type(None): "null"}


def _shown(name: str) -> str:
    """`name` quoted for a one-line message: at most 60 characters of its repr, then its length when longer."""
    r = repr(name[:61])
    return r if len(name) <= 60 and len(r) <= 62 else f"{r[:59]}...' ({len(name)} characters)"


def check_filename(directory: str | os.PathLike, name, *, new: bool = False) -> Path:
    """The path of session file `name` inside `directory`: a plain file name (no separators, no '..', no control
    characters, valid UTF-8, at most 200 bytes, not starting with '.') that is not a symbolic link or a directory
    and resolves inside the directory. new (a save): the name also keeps to ASCII letters, digits, '.', '_' and '-'
    and is not a device name; an existing file of another name is still restored by its exact name. SessionError
    otherwise (its message names the name, never the path). The opens (open_session, save_atomic) hold the same
    rules against a file swapped after this check."""
    if not isinstance(name, str) or not name:
        got = repr(name) if isinstance(name, str) else _JSON_TYPES.get(type(name), type(name).__name__)
        raise SessionError(f"'filename' must be a non-empty string, got {got}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or "/" in name or "\\" in name or ".." in name \
            or name.startswith("."):
        raise SessionError(f"invalid session file name {_shown(name)}: a plain file name is needed (no path "
                           "separators, no '..', no control characters, not starting with '.')")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise SessionError(f"invalid session file name {_shown(name)}: not valid UTF-8 text") from None
    if size > _NAME_MAX:
        raise SessionError(f"session file name is {size} bytes long (at most {_NAME_MAX})")
    if new and (not _SAVE_NAME.match(name) or _DEVICE_NAME.match(name)):
        raise SessionError(f"invalid session file name {name!r} for a save: use ASCII letters, digits, '.', '_' "
                           "and '-' (not starting with '.', not a device name such as CON)")
    root = Path(directory).resolve()
    p = root / name
    try:                        # a file swapped while it is looked at can fail a lookup (readlink: EINVAL)
        if p.is_symlink():
            raise SessionError(f"session file {name!r} is a symbolic link: refused (it could point outside the "
                               "session directory)")
        if p.exists() and not p.is_file():
            raise SessionError(f"session file {name!r} is not a regular file (a directory?)")
        if p.resolve().parent != root:
            raise SessionError(f"session file {name!r} resolves outside the session directory")
    except OSError as e:
        raise SessionError(f"cannot check session file {name!r}: {e.strerror or type(e).__name__} (it changed "
                           "while it was looked at)") from None
    return p


def open_session(path: Path) -> BinaryIO:
    """`path` opened for reading relative to its directory: never through a symbolic link (O_NOFOLLOW), never
    blocking (O_NONBLOCK: a FIFO), and only when fstat says it is a regular file, before a byte is read.
    SessionError naming the file's name otherwise."""
    name = path.name
    try:
        dfd = os.open(path.parent, _OPEN_DIR)
    except OSError as e:
        raise SessionError(f"cannot open session file {name!r}: its directory: {e.strerror or type(e).__name__}") \
            from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=dfd)
    except FileNotFoundError:
        raise SessionError(f"session file {name!r} does not exist") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SessionError(f"session file {name!r} is a symbolic link: refused (it could point outside the "
                               "session directory)") from None
        raise SessionError(f"cannot open session file {name!r}: {e.strerror or type(e).__name__}") from None
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SessionError(f"session file {name!r} is not a regular file (a directory, a FIFO, a device?)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def write(io: BinaryIO, conv: Conversation, fingerprint: str, stages: list) -> int:
    """Write `conv` (its parts materialized, its checkpoints' K/V as prefixes) for `stages` (strata Stage objects:
    their write does the parts); version 1 for one stage, 3 for several. Returns bytes written."""
    if len(conv.parts) != len(stages) or any(len(c.parts) != len(stages) for c in conv.checkpoints):
        raise SessionError("incomplete state: a part per stage is missing; nothing saved")
    for i, p in enumerate(conv.parts):       # what read() refuses is never written
        if p.pos != conv.pos:
            raise SessionError(f"incomplete state: stage {i}'s part is at position {p.pos}, the conversation at "
                               f"{conv.pos}; nothing saved")
    version = VERSION_ONE_STAGE if len(stages) == 1 else VERSION_STAGES
    header = {"fingerprint": fingerprint, "n_tokens": conv.pos, "live_ok": bool(conv.live_ok),
              "checkpoints": [[c.pos, c.kind] for c in conv.checkpoints],
              "carves": [[st.carve.lo, st.carve.hi] for st in stages]}
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    toks = np.asarray(conv.tokens, dtype="<i4").tobytes()
    n = io.write(_FIXED.pack(MAGIC, version, len(head), zlib.crc32(head)))
    n += io.write(head) + io.write(toks) + io.write(_U32.pack(zlib.crc32(toks)))
    for i, st in enumerate(stages):
        if i == 1:
            n += io.write(_U32.pack(len(stages) - 1))
        n += io.write(_U32.pack(1 + len(conv.checkpoints)))
        n += st.memory.write(conv.parts[i], io)
        for c in conv.checkpoints:
            n += st.memory.write(c.parts[i], io)
    return n


def _exact(io: BinaryIO, n: int, what: str) -> bytes:
    return codec.read_exact(io, n, what, SessionError, "session file")


def read(io: BinaryIO, fingerprint: str, stages: list, n_ctx: int, n_vocab: int | None = None) -> Conversation:
    """Read a session file for the live engine: its model `fingerprint`, its `stages`, its context `n_ctx` and its
    vocabulary `n_vocab` (the token ids) are the limits, checked before anything is allocated; every header field
    has its type. SessionError (one line) for anything else; no byte of a file that is not a session file is
    quoted."""
    magic, version, hlen, hcrc = _FIXED.unpack(_exact(io, _FIXED.size, "fixed header"))
    if magic != MAGIC:
        raise SessionError("not a Strata session file (it does not start with the session file magic)")
    if version in RESERVED:
        raise SessionError(f"session file format {RESERVED[version]}")
    if version not in (VERSION_ONE_STAGE, VERSION_STAGES):
        raise SessionError(f"session file format version {version} is not supported (this build reads 1 and 3)")
    h = codec.read_json_header(io, hlen, hcrc, max_header=MAX_HEADER, name="session file", thing="session file",
                               error=SessionError, why=False)
    live_ok = h.get("live_ok", True)
    if type(live_ok) is not bool:
        raise SessionError(f"bad live_ok {live_ok!r} in the session file header (a boolean is needed)")
    if h.get("fingerprint") != fingerprint:
        raise SessionError("the session file is from another model (its fingerprint differs from the loaded "
                           "model's)")
    n, cps, carves = h.get("n_tokens"), h.get("checkpoints"), h.get("carves")
    if type(n) is not int or not 0 < n:
        raise SessionError(f"bad token count {n!r} in the session file")
    if n >= n_ctx:
        raise SessionError(f"the session holds {n} tokens, more than this engine's context allows "
                           f"(n_ctx {n_ctx})")
    if not isinstance(carves, list) or not all(isinstance(c, list) and len(c) == 2 and all(type(x) is int for x in c)
                                               for c in carves):
        raise SessionError("bad stage carves in the session file header")
    mine = [[st.carve.lo, st.carve.hi] for st in stages]
    if carves != mine or (version == VERSION_ONE_STAGE) != (len(stages) == 1):
        raise SessionError(f"the session was saved with stages {_carves(carves)}, this engine runs {_carves(mine)} "
                           f"(another --layer-split)")
    if not isinstance(cps, list) or len(cps) > MAX_CHECKPOINTS or not all(
            isinstance(c, list) and len(c) == 2 and type(c[0]) is int and 0 < c[0] <= n and c[1] in KINDS
            for c in cps):
        raise SessionError("bad checkpoint list in the session file header")
    raw = _exact(io, 4 * n, "token ids")
    (tcrc,) = _U32.unpack(_exact(io, 4, "token checksum"))
    if zlib.crc32(raw) != tcrc:
        raise SessionError("session file token checksum mismatch (the token ids are corrupt)")
    tokens = np.frombuffer(raw, dtype="<i4")
    if n_vocab is not None and (int(tokens.min()) < 0 or int(tokens.max()) >= n_vocab):
        bad = int(tokens[(tokens < 0) | (tokens >= n_vocab)][0])
        raise SessionError(f"the session file holds token id {bad}, outside this model's vocabulary [0, {n_vocab})")
    parts: list = []
    cparts: list[list] = [[] for _ in cps]
    for i, st in enumerate(stages):
        if i == 1:
            (count,) = _U32.unpack(_exact(io, 4, "stage count"))
            if count != len(stages) - 1:
                raise SessionError(f"the session file has {count + 1} stages, the header {len(stages)}")
        (k,) = _U32.unpack(_exact(io, 4, f"stage {i} block"))
        if k != 1 + len(cps):
            raise SessionError(f"stage {i}'s block holds {k} parts, the header names {1 + len(cps)}")
        try:
            part = st.memory.read(io)
            if part.pos != n or part.is_prefix:
                raise SessionError(f"stage {i}'s part is at position {part.pos}, the session at {n}")
            parts.append(part)
            for j, (pos, _) in enumerate(cps):
                cp = st.memory.read(io)
                if cp.pos != pos or not cp.is_prefix and cp.kv:
                    raise SessionError(f"stage {i}'s checkpoint part {j} is at position {cp.pos}, expected {pos}")
                cparts[j].append(cp)
        except (FormatError, PartMismatch) as e:
            raise SessionError(f"stage {i} (layers {st.carve}): {e}") from None
    if io.read(1):
        raise SessionError("the session file has bytes after its last stage block")
    return Conversation(tokens=tokens, parts=parts, live_ok=live_ok,
                        checkpoints=[SavedCheckpoint(pos, str(kind), cp) for (pos, kind), cp in zip(cps, cparts)])


def _carves(cs) -> str:
    return ", ".join(f"{lo}..{hi}" for lo, hi in cs) or "none"


def directory_usage(directory: str | os.PathLike) -> tuple[int, int]:
    """(bytes, files) of the regular files directly in `directory` -- what --slot-quota-mib bounds (apparent sizes;
    symbolic links and subdirectories are neither followed nor counted; a file gone while listed is skipped)."""
    total = files = 0
    with os.scandir(directory) as it:
        for e in it:
            try:
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
                    files += 1
            except OSError:
                continue
    return total, files


_TEMPORARY = re.compile(r"^\..+\.tmp-[0-9a-f]{16}$")


def remove_stale_temporaries(directory: str | os.PathLike) -> int:
    """Remove the temporaries an interrupted save left in `directory` (save_atomic's names, regular files only) ->
    how many; called before the daemon saves there. A temporary a save is still writing (another daemon sharing
    the directory: save_atomic holds an flock on it until it is renamed) is left alone."""
    n = 0
    try:
        dfd = os.open(directory, _OPEN_DIR)
    except OSError:
        return 0
    try:
        for name in os.listdir(dfd):
            if not _TEMPORARY.match(name):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                             dir_fd=dfd)
            except OSError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)     # BlockingIOError: a save in flight
                    os.unlink(name, dir_fd=dfd)
                    n += 1
            except OSError:
                continue
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    return n


class _Bounded:
    """A binary file's write side that refuses (QuotaExceeded from `refuse()`) a write that would take it past
    `limit` bytes, before any of that write reaches the file."""

    def __init__(self, f: BinaryIO, limit: int, refuse):
        self.f, self.limit, self.refuse, self.n = f, limit, refuse, 0

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if self.n + n > self.limit:
            raise self.refuse()
        self.n += n
        return self.f.write(b)


def save_atomic(path: Path, writer, quota: int | None = None) -> int:
    """Write a file through `writer(io) -> bytes` into a temporary beside `path` (an unpredictable name, created
    with O_EXCL | O_NOFOLLOW relative to the directory, mode 0600), fsync it, rename it over `path` (a symbolic link
    there is replaced, not followed) and fsync the directory: a crash leaves the old file or the new one, never a
    torn one. quota: the bytes the directory's regular files may hold (directory_usage) once the file replaces the
    one at `path`; a write past it raises QuotaExceeded and the temporary is removed. Any failure leaves no
    temporary behind."""
    try:
        dfd = os.open(path.parent, _OPEN_DIR)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise SessionError(f"cannot write session file {path.name!r}: its directory: {why}") from None
    tmp = f".{path.name}.tmp-{secrets.token_hex(8)}"
    made = False
    try:
        try:
            limit = None if quota is None else _room(path, dfd, quota)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         0o600, dir_fd=dfd)
            made = True
            with os.fdopen(fd, "wb") as f:
                fcntl.flock(fd, fcntl.LOCK_EX)      # in flight: another process's start leaves it (remove_stale_...)
                n = writer(f if limit is None else _Bounded(f, limit[0], limit[1]))
                f.flush()
                os.fsync(f.fileno())
                os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
                made = False
        except OSError as e:
            raise StorageFailed(f"cannot write session file {path.name!r}: {e.strerror or type(e).__name__}",
                                full=e.errno in (errno.ENOSPC, errno.EDQUOT)) from None
        finally:
            if made:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return n


def _room(path: Path, dfd: int, quota: int) -> tuple[int, Any]:
    """(the bytes a new file at `path` may take under `quota`, the QuotaExceeded it raises past them): the quota less
    the directory's use, the file it replaces not counted."""
    used, _ = directory_usage(path.parent)
    try:
        st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            used -= st.st_size
    except OSError:
        pass
    room = max(0, quota - used)

    def refuse() -> QuotaExceeded:
        return QuotaExceeded(f"saving session file {path.name!r} would pass the session directory's quota of "
                             f"{_mib(quota)} (--slot-quota-mib): its files hold {_mib(used)}, {_mib(room)} is left; "
                             "nothing was written (remove session files from --slot-save-path, or raise the quota)")
    return room, refuse


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
