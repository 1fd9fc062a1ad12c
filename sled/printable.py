r"""Text from the other side of a connection, made safe to put into a log line or an error message.

A peer chooses every character of what it sends: a newline in a name forges a log line, an escape
sequence rewrites a terminal, and a megabyte name turns an error status into one gRPC cannot send.
Everything a peer chose goes through `printable` before it enters a log line or a message:

    printable("ngram\nINFO forged")  ->  ngram\nINFO forged        (one line: the newline shown as \n)
    printable("x" * 1000, 8)        ->  xxxxxxxx... (1000 characters)
"""
from __future__ import annotations

# The longest peer text shown in one place, unless the caller says otherwise.
SHOWN_CHARS = 80


def printable(text: str | bytes, limit: int = SHOWN_CHARS) -> str:
    r"""`text` on one line: control and other unprintable characters escaped as repr() writes them
    (\n, \x1b, \u2028), cut after `limit` characters with the full length said."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "backslashreplace")
    shown = "".join(c if c.isprintable() else _escaped(c) for c in text[:limit])
    if len(text) > limit:
        shown += f"... ({len(text)} characters)"
    return shown


def _escaped(char: str) -> str:
    return repr(char)[1:-1]


def counted(n: int, noun: str) -> str:
    """ "1 token", "8 tokens"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
