"""Replies a client never took: one log line each, never a traceback.

A client may cancel a call, close its connection or refuse a message (over its receive limit)
while the server is still sending. When gRPC notices that first, the call just ends; when the
send fails first, gRPC logs an ExecuteBatchError with a traceback of its own internals on the
"grpc._cython.cygrpc" logger. Neither is anything an operator can act on, so the filter here turns
that record into one line naming the method (DEBUG for GetTokenizer, whose handler says at INFO
how far its stream got; INFO for the others).
"""
from __future__ import annotations

import logging
import re

GRPC_LOGGER = "grpc._cython.cygrpc"


class DroppedReplyFilter(logging.Filter):
    """gRPC's traceback for a reply that could not be sent -> one line: INFO, or DEBUG for
    GetTokenizer, whose handler logs how far its stream got (tokenizer_stream_ended)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ == "ExecuteBatchError":
            method = re.search(r"\[([^\]]*)\]", record.getMessage())
            record.msg = ("a reply of %s was not delivered: the client cancelled, went away or "
                          "refused it")
            record.args = (method.group(1) if method else "a call",)
            level = logging.DEBUG if record.args[0].endswith("/GetTokenizer") else logging.INFO
            record.levelno, record.levelname = level, logging.getLevelName(level)
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(level)   # as if logged at it
        return True


DROPPED_REPLY_FILTER = DroppedReplyFilter()


def quiet_dropped_replies() -> None:
    """Install the filter on gRPC's logger (once, however often called)."""
    logging.getLogger(GRPC_LOGGER).addFilter(DROPPED_REPLY_FILTER)


def tokenizer_stream_ended(caller: str, sent: int, total: int) -> None:
    """Log a GetTokenizer stream that ended before its last chunk was sent (`caller`: its
    identity's key, e.g. device:cam-3 or host:10.0.0.7)."""
    if sent < total:
        logging.getLogger("sled.server").info(
            "GetTokenizer to %s stopped after %d of %d chunks: the client cancelled, went away "
            "or refused a chunk", caller, sent, total)
