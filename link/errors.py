"""The stage link's error codes and exceptions: every refusal is a LinkError (a ValueError) with a code and one line."""
from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """What went wrong, as carried in an Error message (u16) and in LinkError.code."""
    BAD_FRAME = 1        # a malformed frame or payload
    VERSION = 2          # the peer speaks another protocol version
    AUTH = 3             # missing or wrong HMAC, unusable key file
    MODEL = 4            # model fingerprint or carve mismatch
    LIMIT = 5            # a frame, a request or a store over a limit
    CKPT_MISSING = 6     # the worker does not hold the checkpoint asked for
    DESYNC = 7           # position mismatch between main and worker
    INTERNAL = 8         # anything else on the worker
    BUSY = 9             # another main process is connected to the worker
    NEXT_HOP = 10        # a relay's next worker failed


class LinkError(ValueError):
    """A refusal on the stage link; `code` is the ErrorCode to report to the peer."""

    def __init__(self, message: str, code: int = ErrorCode.INTERNAL):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return (type(self), (str(self), self.code))


class FrameError(LinkError):
    """Bytes that are not a well-formed protocol-5 frame or payload (code BAD_FRAME, LIMIT for an over-limit size)."""

    def __init__(self, message: str, code: int = ErrorCode.BAD_FRAME):
        super().__init__(message, code)


class VersionMismatch(LinkError):
    """A valid frame header from a peer that speaks another protocol version (code VERSION)."""

    def __init__(self, theirs: int, ours: int):
        super().__init__(f"peer speaks stage-link protocol {theirs}, this side speaks {ours}", ErrorCode.VERSION)
        self.theirs = theirs
        self.ours = ours

    def __reduce__(self):
        return (type(self), (self.theirs, self.ours))
