"""Errors a session can end with: a gRPC status code, a message a person can act on, and a
machine-readable reason (sent to the device as the stream's last message).

A message goes into the stream's status, an ErrorDetail and the server's log, and may quote what
a client sent: it is kept to one printable line of at most MESSAGE_CHARS characters, so no client
text can forge a log line or make the status too large for gRPC to send."""
from __future__ import annotations

import grpc

from sled.printable import printable
from sled.v1 import verifier_pb2 as pb

Reason = pb.ErrorDetail.Reason
MESSAGE_CHARS = 1000


class SessionError(Exception):
    """A request the server refuses; the stream ends with `code`, other sessions carry on."""

    def __init__(self, code: grpc.StatusCode, reason: int, message: str, round: int = 0) -> None:
        message = printable(message, MESSAGE_CHARS)
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.round = round

    def detail(self) -> pb.ErrorDetail:
        return pb.ErrorDetail(reason=self.reason, message=self.message, round=self.round)

    @property
    def reason_name(self) -> str:
        return Reason.Name(self.reason).removeprefix("REASON_").lower()


def invalid(reason: int, message: str, round: int = 0) -> SessionError:
    return SessionError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, round)


def precondition(reason: int, message: str, round: int = 0) -> SessionError:
    return SessionError(grpc.StatusCode.FAILED_PRECONDITION, reason, message, round)


def exhausted(reason: int, message: str) -> SessionError:
    return SessionError(grpc.StatusCode.RESOURCE_EXHAUSTED, reason, message)


def unavailable(reason: int, message: str) -> SessionError:
    return SessionError(grpc.StatusCode.UNAVAILABLE, reason, message)


def aborted(reason: int, message: str) -> SessionError:
    return SessionError(grpc.StatusCode.ABORTED, reason, message)


def deadline(reason: int, message: str, round: int = 0) -> SessionError:
    return SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, reason, message, round)


def internal(message: str, round: int = 0) -> SessionError:
    """A fault in the server, not in the request: this session ends, the others carry on."""
    return SessionError(grpc.StatusCode.INTERNAL, Reason.REASON_INTERNAL, message, round)


def unauthenticated(message: str) -> SessionError:
    return SessionError(grpc.StatusCode.UNAUTHENTICATED, Reason.REASON_UNAUTHENTICATED, message)


def denied(message: str) -> SessionError:
    return SessionError(grpc.StatusCode.PERMISSION_DENIED, Reason.REASON_PERMISSION_DENIED, message)
