"""ConversationFiles: this engine's conversation files in the session format (strata.cache.session), checked against
its model file and stages: written atomically and read back under its limits (the disk tier's files and session
files alike), and the session directory (--slot-save-path): a session file's path from its name, the directory's use
against its quota."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from strata.cache import session
from strata.cache.conversation import Conversation
from strata.errors import Refused

__all__ = ["ConversationFiles"]


class ConversationFiles:
    """Files of conversations for an engine whose model file is `file` (its fingerprint), its stages `stages`, its
    context `n_ctx` and vocabulary `n_vocab` (what a file must match to be read). directory: the session directory
    (None: session files are refused), its regular files bounded by quota_bytes (None: no quota); a temporary an
    interrupted save left there is removed at once. refusal: () -> why some stage cannot copy its state to the main
    and back (then session files are refused), or None. Raises ValueError for a directory that is not one."""

    def __init__(self, stages: list, file, n_ctx: int, n_vocab: int | None, *,
                 directory: str | os.PathLike | None = None, quota_bytes: int | None = None,
                 refusal: Callable[[], str | None] = lambda: None):
        self.stages, self.file, self.n_ctx, self.n_vocab = stages, file, n_ctx, n_vocab
        self.cut_anywhere = all(st.memory.cuts_anywhere for st in stages)
        self.directory = Path(directory) if directory else None
        if self.directory is not None and not self.directory.is_dir():
            raise ValueError(f"--slot-save-path {self.directory}: not a directory")
        self.quota_bytes = quota_bytes
        self._refusal = refusal
        if self.directory is not None:
            session.remove_stale_temporaries(self.directory)

    def write(self, path: Path, conv: Conversation, quota: int | None = None) -> int:
        """Write `conv` to `path` atomically (strata.cache.session.save_atomic, within `quota` bytes for the
        directory when given) -> the bytes written."""
        return session.save_atomic(path, lambda f: session.write(f, conv, self.file.fingerprint(), self.stages),
                                   quota)

    def read(self, path: Path) -> Conversation:
        """The conversation in the file at `path` (``read_counted``'s)."""
        return self.read_counted(path)[0]

    def read_counted(self, path: Path) -> tuple[Conversation, int]:
        """The conversation in the file at `path`, read under this engine's limits and checked against its model and
        stages, and the bytes read. SessionError / OSError / PartMismatch (one line)."""
        with session.open_session(path) as f:
            conv = session.read(f, self.file.fingerprint(), self.stages, self.n_ctx, self.n_vocab)
            n_read = f.tell()
        conv.cut_anywhere = self.cut_anywhere
        return conv, n_read

    def path(self, filename, *, exists: bool = False) -> Path:
        """The path of session file `filename` (strata.cache.session.check_filename); exists: it must be a file
        there. Refused when session files cannot be kept (a stage whose state cannot reach the main, no
        directory), SessionError (one line) for the name."""
        why = self._refusal()
        if why:
            raise Refused(f"session files: {why}", code="unsupported_value")
        if self.directory is None:
            raise Refused("session files need --slot-save-path DIR (the directory they are kept in)",
                          code="unsupported_value")
        path = session.check_filename(self.directory, filename, new=not exists)
        try:
            there = path.exists() or path.is_symlink()               # what it is, open_session checks
        except OSError:                                              # swapped while looked at: open_session decides
            there = True
        if exists and not there:
            raise session.SessionError(f"session file {filename!r} does not exist in the session directory "
                                       "(--slot-save-path)")
        return path

    def usage(self) -> dict[str, Any] | None:
        """The session directory's use for /status and /metrics: {"bytes", "files" (its regular files), "quota_bytes"
        (None: no quota)}; None without --slot-save-path; "error" when it cannot be listed."""
        if self.directory is None:
            return None
        try:
            used, files = session.directory_usage(self.directory)
        except OSError as e:
            return {"bytes": None, "files": None, "quota_bytes": self.quota_bytes,
                    "error": e.strerror or type(e).__name__}
        return {"bytes": used, "files": files, "quota_bytes": self.quota_bytes}
