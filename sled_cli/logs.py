"""How sled's commands log: one record, one line, whatever text a peer put into it.

A log line often quotes what the other side sent (a drafter name, a server id, an MQTT request
id). Every record's message goes through sled.printable here, so a newline or an escape sequence
from a peer can neither forge a line nor rewrite a terminal, whichever module logged it. A
traceback (exc_info) still prints on its own lines after the message.
"""
from __future__ import annotations

import logging

from sled.printable import printable

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
LOGGED_CHARS = 4000        # the longest message one record shows


class OneLineFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message, LOGGED_CHARS)
        return super().formatMessage(record)


def configure_logging(level: int) -> None:
    """Log to stderr at `level`, every message escaped onto one line."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
