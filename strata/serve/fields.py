"""Request fields as the Responses and Messages routes read them: 400s that name the field, arrays of objects (messages,
items, tools, content parts), arrays of text parts read as one text."""
from __future__ import annotations

from typing import Callable, Iterator

from strata.serve import schema
from strata.serve.errors import ApiError


def bad_field(param: str, msg: str, code: str = "invalid_value") -> ApiError:
    """400 naming the field: "'param' msg"."""
    return ApiError(400, f"'{param}' {msg}", param=param, code=code)


def unsupported_field(param: str, msg: str) -> ApiError:
    """bad_field with the code unsupported_value (a value the API has that Strata does not take)."""
    return bad_field(param, msg, "unsupported_value")


def each_object(items: list, where: str) -> Iterator[tuple[str, dict]]:
    """(where[j], item) for each item of an array (messages, input items, tools, content parts); 400 at the first
    one that is not an object."""
    for j, item in enumerate(items):
        at = f"{where}[{j}]"
        if not isinstance(item, dict):
            raise bad_field(at, f"must be an object, got {schema._tname(item)}")
        yield at, item


def part_text(part: dict, at: str) -> str:
    """A text part's text; 400 at at.text when it is not a string."""
    if not isinstance(part.get("text"), str):
        raise bad_field(f"{at}.text", "must be a string")
    return part["text"]


def text_of(content, where: str, *, types: tuple[str, ...], array_of: str, type_at: str,
            refused: Callable[[object], str]) -> str:
    """A string, or an array of text parts (their type one of `types`), as one text. The API's own names: array_of,
    what the array holds ("must be a string or an array of {array_of}"); a part of another type is refused at
    where[j] + type_at, with the message refused(its type)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, f"must be a string or an array of {array_of}, got {schema._tname(content)}")
    out = []
    for at, part in each_object(content, where):
        if part.get("type") not in types:
            raise unsupported_field(at + type_at, refused(part.get("type")))
        out.append(part_text(part, at))
    return "".join(out)
