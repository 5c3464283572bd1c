"""One line typed into an interactive chat (`strata chat`, `stratactl chat`): a command, or a message to send."""
from __future__ import annotations


def parse_chat_line(line: str) -> tuple[str, str]:
    """(kind, payload) of an input line without its newline.

    kind: "empty" (blank line), "quit" (/quit, /exit), "reset", "help", "unknown" (payload: the command word, e.g.
    "/foo"; not to be sent), or "message" (payload: the line as typed, except that a leading "//" sends one "/").
    Commands are matched on the stripped line; "/ text" (a slash and a space) is a message.
    """
    text = line.strip()
    if not text:
        return "empty", ""
    if text in ("/quit", "/exit"):
        return "quit", ""
    if text in ("/reset", "/help"):
        return text[1:], ""
    if text.startswith("//"):                  # an escaped slash: the message itself starts with '/'
        return "message", line.replace("//", "/", 1)
    if text.startswith("/") and len(text) > 1 and not text[1].isspace():
        return "unknown", text.split()[0]
    return "message", line
