"""What the Verifier's gRPC handlers share (verify_server.service): a call's deadline as the
core takes it, requests that did not decode, and a SessionError turned into the call's status."""
from __future__ import annotations

from dataclasses import dataclass

from sled import clock
from sled.v1 import verifier_pb2 as pb
from verify_server import errors
from verify_server.errors import Reason, SessionError


def deadline_of(context) -> float | None:
    """The call's own deadline as a clock.now() time (None: the call has none)."""
    remaining = context.time_remaining() if context is not None else None
    return clock.now() + remaining if remaining is not None else None


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request whose bytes are not a valid message of its type (the bytes are not kept)."""
    message_type: str
    size: int
    why: str

    def refusal(self) -> SessionError:
        return errors.invalid(Reason.REASON_PROTOCOL,
                              f"undecodable message: {self.size} bytes are not a valid "
                              f"sled.v1.{self.message_type} ({self.why[:120]})")


def kind_of(message: pb.DeviceMessage | Undecodable) -> str:
    """Which of open, draft and close the message is; refuses anything else."""
    if isinstance(message, Undecodable):
        raise message.refusal()
    kind = message.WhichOneof("kind")
    if kind is None:
        raise errors.invalid(Reason.REASON_PROTOCOL,
                             "empty DeviceMessage: set one of open, draft, close")
    return kind


def detached(error: SessionError) -> SessionError:
    """The error without its traceback and chained exceptions, whose frames hold the request."""
    error.__traceback__ = error.__context__ = error.__cause__ = None
    return error


def end_call(context, error: SessionError, reply=None):
    """The call ends with the error's status once the handler returns (no exception is raised,
    so none is kept with the call's frames)."""
    context.set_code(error.code)
    context.set_details(error.message)
    return reply
