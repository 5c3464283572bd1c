"""OpenAI-style error objects: ApiError carries an HTTP status and renders {"error": {...}}."""
from __future__ import annotations

from typing import Any

from strata.errors import Refused

# HTTP status -> OpenAI error "type" (https://platform.openai.com/docs/guides/error-codes)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_implemented_error",
    502: "server_error",
    503: "server_error",
    507: "server_error",
}


#: the most characters of an error's message (and of its param) a client gets back: a refusal that quotes a value
#: the client sent (a 100,000-character role or function name) quotes its first characters only
MAX_MESSAGE = 1000
MAX_PARAM = 300


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ApiError(Exception):
    """A request the daemon refuses: status (HTTP), one-line message (at most MAX_MESSAGE characters, the rest cut),
    optional OpenAI param (at most MAX_PARAM) and code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        message = _cut(message, MAX_MESSAGE)
        param = _cut(param, MAX_PARAM) if param else param
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The JSON body of an error: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def renamed(e: ApiError, renames) -> ApiError:
    """e with field names replaced in its message and param: renames is [(compiled regex, replacement)], the chat
    route's names -> those of the API a request came in through (the Responses and Messages routes)."""
    def sub(text: str) -> str:
        for rx, to in renames:
            text = rx.sub(to, text)
        return text
    return ApiError(e.status, sub(e.message), param=sub(e.param) if e.param else None, code=e.code, headers=e.headers)


def refusal(e: Refused) -> ApiError:
    """The ApiError a refused request answers: its status, message, param and code."""
    return ApiError(e.status, str(e), param=e.param, code=e.code)
