"""Every log line of sled's commands is one line, whatever a peer put into the message."""
from __future__ import annotations

import logging

from sled_cli.logs import LOGGED_CHARS, OneLineFormatter, FORMAT


def record(msg: str, *args, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("sled.test", logging.INFO, __file__, 1, msg, args, exc_info)


def test_a_peers_newline_cannot_forge_a_log_line():
    line = OneLineFormatter(FORMAT).format(
        record("server %s announced", "evil\n2026-01-01 sled.server INFO forged\x1b[2J"))
    assert "\n" not in line and "\x1b" not in line
    assert "evil\\n2026-01-01 sled.server INFO forged\\x1b[2J" in line


def test_a_huge_message_is_cut_with_its_length_said():
    line = OneLineFormatter(FORMAT).format(record("drafter %s", "x" * 100_000))
    assert len(line) < LOGGED_CHARS + 200
    assert "(100008 characters)" in line


def test_a_traceback_still_prints_after_the_message():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys
        text = OneLineFormatter(FORMAT).format(record("failed %s", "a\nb", exc_info=sys.exc_info()))
    first, *rest = text.splitlines()
    assert first.endswith("failed a\\nb")
    assert rest[0].startswith("Traceback") and rest[-1] == "RuntimeError: boom"
