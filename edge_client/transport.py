"""The device's transport: one Generate call seen as messages, a DeviceMessage out and a
ServerMessage in, with every way the call can fail turned into a VerifyError.

A session opens its streams through a Transport, `Stream.open` unless it is given another: an
emulated network (lab) wraps the same stream with its delays, and nothing here knows about it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from grpc._cython import cygrpc     # ExecuteBatchError: what a half-close of an ended call raises

from sled.printable import printable
from sled.v1 import verifier_pb2 as pb


class VerifyError(Exception):
    """The server ended the session with an error status."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason


class Stream:
    """One Generate call: send DeviceMessages, receive ServerMessages, then close or cancel."""

    def __init__(self, call) -> None:
        self.call = call
        self.opened = pb.Opened()     # what the server said at the open (open_stream)

    @classmethod
    def open(cls, stub, *, timeout: float | None = None, wait_for_ready: bool = False) -> "Stream":
        """A new Generate call on stub; wait_for_ready waits for a server that is not up yet."""
        return cls(stub.Generate(timeout=timeout, wait_for_ready=wait_for_ready))

    async def send(self, msg: pb.DeviceMessage) -> None:
        """Write one message; a stream the server already ended becomes a VerifyError with the
        status it ended with (as a failed read does)."""
        try:
            await self.call.write(msg)
        except asyncio.InvalidStateError:
            raise VerifyError(await self.call.code(),
                              await self.call.details() or "stream already ended") from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INTERNAL:
                raise
            # The transport broke under the write (grpc core's failed send batch): the server is
            # gone or going, and it never saw this message.
            raise VerifyError(grpc.StatusCode.UNAVAILABLE,
                              f"the stream broke while sending: {exc.details()}") from None

    async def accepted(self) -> None:
        """Until the server has taken the call (its initial metadata came; sled's server sends
        it at once). A call that failed first returns at once: its receive() says how."""
        await self.call.initial_metadata()

    async def receive(self) -> pb.ServerMessage:
        """The next server message; an error message or a broken stream becomes a VerifyError."""
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            raise VerifyError(exc.code(), exc.details() or "") from None
        if msg is grpc.aio.EOF:
            raise VerifyError(await self.call.code(),
                              await self.call.details() or "stream ended before the session finished")
        if msg.WhichOneof("kind") == "error":
            # A refused session sends nothing more, and says so at once: the server ends the
            # call once the device's side is closed, so the refusal passes a proxy whole
            # (docs/protocol.md, "Refusals").
            await half_close(self.call)
            reason = pb.ErrorDetail.Reason.Name(msg.error.reason)
            raise VerifyError(refusal_code(await self.call.code(), msg.error.reason),
                              msg.error.message, reason)
        return msg

    async def done_writing(self) -> None:
        """Nothing more will be sent (the session is over, or it is a server mode's)."""
        await half_close(self.call)

    def cancel(self) -> None:
        """Drop the call (the server frees the session)."""
        self.call.cancel()


R = pb.ErrorDetail
# The status each ErrorDetail reason comes with (verifier.proto).
REASON_CODES = {
    R.REASON_TOKEN_OUT_OF_RANGE: grpc.StatusCode.INVALID_ARGUMENT,
    R.REASON_EMPTY_DRAFT: grpc.StatusCode.INVALID_ARGUMENT,
    R.REASON_DRAFT_TOO_LONG: grpc.StatusCode.INVALID_ARGUMENT,
    R.REASON_WRONG_ROUND: grpc.StatusCode.FAILED_PRECONDITION,
    R.REASON_NO_SESSION: grpc.StatusCode.FAILED_PRECONDITION,
    R.REASON_SESSION_FINISHED: grpc.StatusCode.FAILED_PRECONDITION,
    R.REASON_CONTEXT_OVERFLOW: grpc.StatusCode.INVALID_ARGUMENT,
    R.REASON_TOKENIZER_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    R.REASON_BAD_SAMPLING: grpc.StatusCode.INVALID_ARGUMENT,
    R.REASON_BAD_DRAFT_DISTRIBUTION: grpc.StatusCode.INVALID_ARGUMENT,
    R.REASON_TOO_MANY_SESSIONS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    R.REASON_PROTOCOL: grpc.StatusCode.INVALID_ARGUMENT,
    R.REASON_SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    R.REASON_KV_BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    R.REASON_EVICTED: grpc.StatusCode.ABORTED,
    R.REASON_DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    R.REASON_NO_SAT: grpc.StatusCode.FAILED_PRECONDITION,
    R.REASON_UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    R.REASON_PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    R.REASON_QUOTA: grpc.StatusCode.RESOURCE_EXHAUSTED,
    R.REASON_BAD_TREE: grpc.StatusCode.INVALID_ARGUMENT,
    R.REASON_BAD_LOOSE: grpc.StatusCode.INVALID_ARGUMENT,
    R.REASON_INTERNAL: grpc.StatusCode.INTERNAL,
}


def refusal_code(code: grpc.StatusCode, reason: int) -> grpc.StatusCode:
    """The status of a call the server ended with an ErrorDetail. An HTTP/2 proxy between
    (HAProxy 2.6) resets a stream whose answer ended while the device was still sending with
    RST_STREAM(CANCEL), so the server's trailers never arrive and the call reads CANCELLED,
    which would pass for a lost server: the reason, sent before, says what the server meant."""
    if code == grpc.StatusCode.CANCELLED:
        return REASON_CODES.get(reason, code)
    return code


async def receive_within(stream: "Stream", seconds: float, what: str) -> pb.ServerMessage:
    """stream.receive(), which must come within `seconds`: a server silent longer is treated as a
    lost one (Silence, which a session resumes or fails over)."""
    try:
        return await asyncio.wait_for(stream.receive(), seconds)
    except asyncio.TimeoutError:
        raise Silence(what, seconds) from None


class Silence(VerifyError):
    """The server sent no `what` (Opened, a verdict) within `seconds`. It counts as a lost server
    (UNAVAILABLE): the session resumes, on it or another, a bounded number of times
    (edge_client.strikes)."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"the server sent no {what} within "
                         f"{seconds:g} s: it went silent, so it is treated as lost")
        self.what, self.seconds = what, seconds


class ServerGivenUp(VerifyError):
    """A server failed a session once more after its retries (edge_client.strikes): `times`
    strikes, `silences` of them silences (each of the rest ended the session with no verdict
    since it opened), the last `last`. The session ends: ABORTED, not a lost server, so nothing
    waits for it again. The committed tokens are the target's own and stay valid."""
    CODE = grpc.StatusCode.ABORTED

    def __init__(self, times: int, last: VerifyError, silences: int = 0) -> None:
        self.times, self.last, self.silences = times, last, silences
        super().__init__(self.CODE, f"it {self.how} {times} times (the last: {self.last_said})")

    @property
    def how(self) -> str:
        """What the server did, each time."""
        if self.silences == self.times:
            return "went silent"
        dropped = "dropped the session without a verdict"
        return f"went silent or {dropped}" if self.silences else dropped

    @property
    def last_said(self) -> str:
        """How the last strike went, in a few words."""
        if isinstance(self.last, Silence):
            return f"no {self.last.what} within {self.last.seconds:g} s"
        return f"{self.last.code.name}: {printable(self.last.message, 200)}"

    def naming(self, server: str) -> str:
        """The one line that ends a request: which server, how often and how it failed it."""
        return (f"the verify server {printable(server, 200)} {self.how} {self.times} times (the "
                f"last: {self.last_said}), so the request ends")


class ServerSilent(ServerGivenUp):
    """A server given up whose last strike was a silence: DEADLINE_EXCEEDED."""
    CODE = grpc.StatusCode.DEADLINE_EXCEEDED


# transport(stub, timeout=..., wait_for_ready=...) -> a Stream (or anything with its methods)
Transport = Callable[..., Stream]


async def half_close(call) -> None:
    """Say that nothing more will be sent on a Generate call. A call that ended meanwhile makes
    grpc raise its own internal ExecuteBatchError (or an AioRpcError); its status then says how
    it ended, so neither is raised here."""
    try:
        await call.done_writing()
    except (grpc.aio.AioRpcError, cygrpc.ExecuteBatchError):
        pass


def lost_server(error: Exception) -> bool:
    """The server is gone or going (as opposed to refusing this session). CANCELLED counts: a
    device drops the calls it cancels itself, so one it still uses was cancelled by a server
    shutting down (a call that reached it as it stopped gets that, not UNAVAILABLE)."""
    code = error.code if isinstance(error, VerifyError) else error.code()
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class ServerLost(VerifyError):
    """The server went away mid-session and none came back in time. The committed tokens are
    the target's own and stay valid: a caller keeps them as partial output."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


# What grpc core says when the peer answered the connection but not with HTTP/2 (an HTTP/1.1
# service such as the server's metrics port, a web server): "Failed parsing HTTP/2 (Expected
# SETTINGS frame as the first frame, got frame type 79)" and its kin.
NOT_GRPC_MARKS = ("Failed parsing HTTP/2", "Expected SETTINGS frame", "Trying to connect an http1.x server")


def not_a_grpc_server(error: Exception) -> bool:
    """The address answers, but not as a gRPC server."""
    details = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
    return any(mark in (details or "") for mark in NOT_GRPC_MARKS)


# What grpc core says when TLS itself failed, and what to do about it.
TLS_FAILURES = {
    "WRONG_VERSION_NUMBER": "does not speak TLS: dial it without a server CA (server_ca, "
                            "--server-ca), or start it with --tls-cert and --tls-key",
    "certificate has expired": "presented a certificate that has expired: renew it (sled certs "
                               "DIR --force)",
    "certificate is not yet valid": "presented a certificate that is not yet valid: check this "
                                    "device's clock (a board without a real-time clock starts "
                                    "in the past until network time is set)",
    "unsupported certificate purpose": "presented a certificate that is not for a server (its "
                                       "extended key usage): give it its server certificate",
    "CERTIFICATE_VERIFY_FAILED": "presented a certificate the server CA (server_ca, --server-ca) "
                                 "did not sign: it is not the server it claims to be, or the CA "
                                 "is the wrong one",
    "Hostname Verification Check failed": "presented a certificate that is not for the name "
                                          "dialed: dial a name it carries, or name it in "
                                          "server_names (--server-name)",
}
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def connect_error(address: str, error: Exception, tls: bool = False,
                  speaks_tls: bool = False) -> str:
    """Why a call to the server at ADDRESS failed, as one line a person can act on: the one home
    of this wording (sled generate, the daemon's probes). tls: the call was made over TLS;
    speaks_tls: a plaintext call failed and the address answers a TLS handshake."""
    address = printable(address, 200)
    if not_a_grpc_server(error):
        return (f"{address} answers, but it is not a sled gRPC server (an HTTP/1 service, e.g. the "
                "metrics port? the gRPC port is the one `sled serve` prints)")
    transport = _transport_failure(error, tls, speaks_tls)
    if transport:
        return f"the server at {address} {transport}"
    if isinstance(error, grpc.aio.AioRpcError):
        detail = f"{error.code().name}: {printable(error.details() or '', 200)}"
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:   # up, but at a limit (its load)
            return f"the server at {address} is busy ({detail}); try again"
        if error.code() in REFUSED:
            return f"the server at {address} refused this device ({detail})"
    else:
        detail = "timed out" if isinstance(error, asyncio.TimeoutError) else printable(str(error), 200)
    return f"cannot reach a sled server at {address}: {detail}"


def _transport_failure(error: Exception, tls: bool, speaks_tls: bool) -> str:
    """What went wrong below gRPC, when TLS did ("" otherwise)."""
    details = error.details() if isinstance(error, grpc.aio.AioRpcError) else ""
    for mark, why in TLS_FAILURES.items():
        if mark in (details or ""):
            return why
    if "Socket closed" not in (details or ""):
        return ""
    if tls:
        return ("closed the TLS connection in the handshake: it asks for a client certificate "
                "its CA signed and valid now (client_cert and client_key, --client-cert and "
                "--client-key)")
    if speaks_tls:
        return "speaks TLS: give the CA that signed its certificate (server_ca, --server-ca)"
    return ""
