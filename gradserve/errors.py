"""Typed errors, one class per gRPC status code, named like TensorFlow's.

The server raises these at the semantic layer (TensorArray state machine, op
checks, sessions) and maps them to a gRPC status exactly once, at the RPC
boundary. The SDK turns every failed call back into the same class, so code
written against ``tf.errors`` reads the same against gradserve.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "GradserveError",
    "CancelledError",
    "UnknownError",
    "InvalidArgumentError",
    "DeadlineExceededError",
    "NotFoundError",
    "AlreadyExistsError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "FailedPreconditionError",
    "AbortedError",
    "OutOfRangeError",
    "UnimplementedError",
    "InternalError",
    "UnavailableError",
    "DataLossError",
    "UnauthenticatedError",
    "UnsupportedDTypeError",
    "ConversionError",
    "SessionLostError",
    "TapeReleasedError",
    "Code",
    "error_class_for",
    "DRAINING_REASON",
    "NOT_FORWARDED_REASON",
    "NOT_CONNECTED_REASON",
    "UNRUN_REASONS",
]


class Code(enum.IntEnum):
    """The canonical status codes (google.rpc.Code): the numbers and names gRPC uses.

    Errors carry their code as this enum so that the domain, which raises them,
    needs no gRPC; the transport maps it to ``grpc.StatusCode`` by name, once.
    """

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


#: Reasons (``GradserveError.reason``) that say a call did not run, so the SDK repeats it
#: whatever it is: a draining server refused it before doing anything, a proxy
#: passed no byte of it to any replica (deploy/nginx's template), or (the SDK's own
#: reason, from gRPC's status) the channel connected to no address, so gRPC sent
#: nothing: the server is down or restarting.
DRAINING_REASON = "DRAINING"
NOT_FORWARDED_REASON = "NOT_FORWARDED"
NOT_CONNECTED_REASON = "NOT_CONNECTED"
UNRUN_REASONS = frozenset({DRAINING_REASON, NOT_FORWARDED_REASON, NOT_CONNECTED_REASON})


class GradserveError(Exception):
    """Base of every gradserve error.

    Attributes
    ----------
    code:
        The status code this error travels as (``Code``, an ``IntEnum`` with gRPC's
        numbers and names: ``grpc.StatusCode[err.code.name]`` is gRPC's enum).
    message:
        What went wrong, written for a person (names, indices, expected vs got).
    reason:
        A stable machine-readable word (``google.rpc.ErrorInfo.reason``), such as
        ``SESSION_NOT_FOUND``; empty when the code alone says enough.
    field:
        The request field at fault (``google.rpc.BadRequest``), or empty.
    request_id:
        The ``x-request-id`` of the call that failed (SDK side; the server logs it).
    step:
        For a failed ``Batch``: the index of the step that failed (or the first of a
        request the SDK sent apart that failed as a whole), else None.
    results:
        For a failed ``Batch``: the results of the steps before ``step`` (kept
        tensors are yours: delete them when done).
    """

    code: Code = Code.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        reason: str = "",
        field: str = "",
        request_id: str = "",
        step: int | None = None,
        results: list[Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.field = field
        self.request_id = request_id
        self.step = step
        self.results: list[Any] = [] if results is None else results

    def __str__(self) -> str:
        return self.message


class CancelledError(GradserveError):
    code = Code.CANCELLED


class UnknownError(GradserveError):
    code = Code.UNKNOWN


class InvalidArgumentError(GradserveError):
    code = Code.INVALID_ARGUMENT


class DeadlineExceededError(GradserveError):
    code = Code.DEADLINE_EXCEEDED


class NotFoundError(GradserveError):
    code = Code.NOT_FOUND


class AlreadyExistsError(GradserveError):
    code = Code.ALREADY_EXISTS


class PermissionDeniedError(GradserveError):
    code = Code.PERMISSION_DENIED


class ResourceExhaustedError(GradserveError):
    code = Code.RESOURCE_EXHAUSTED


class FailedPreconditionError(GradserveError):
    code = Code.FAILED_PRECONDITION


class AbortedError(GradserveError):
    code = Code.ABORTED


class OutOfRangeError(GradserveError):
    code = Code.OUT_OF_RANGE


class UnimplementedError(GradserveError):
    code = Code.UNIMPLEMENTED


class InternalError(GradserveError):
    code = Code.INTERNAL


class UnavailableError(GradserveError):
    code = Code.UNAVAILABLE


class DataLossError(GradserveError):
    code = Code.DATA_LOSS


class UnauthenticatedError(GradserveError):
    code = Code.UNAUTHENTICATED


class UnsupportedDTypeError(InvalidArgumentError, ValueError):
    """A dtype (or wire dtype number) gradserve does not carry."""


class ConversionError(InvalidArgumentError, ValueError):
    """A Python value TensorFlow does not convert to a tensor (``None``, a ragged list,
    an int past int64): TensorFlow's ``ValueError``, so that a program moved from
    ``tf.raw_ops`` catches it where it did, and an ``InvalidArgumentError`` as the
    service's other refusals of a value."""


class SessionLostError(NotFoundError):
    """The session's state is gone from the server (reason ``SESSION_NOT_FOUND``).

    Its replica restarted without its state (no ``--state-dir``, or a crash since the
    last snapshot), it sat idle past ``--session-ttl``, it was closed, or the call was
    routed to a replica that does not hold it (a stale proxy map). Nothing the client
    repeats brings it back: open a new session and start the step over.
    """

    #: What the SDK says before the server's own message.
    EXPLANATION = (
        "session lost: its state (TensorArrays, gradient arrays, resident tensors) is gone "
        "from the server. This happens when the replica that held it restarted without "
        "its state (no --state-dir) or crashed since its last snapshot, when the session "
        "sat idle past --session-ttl or was closed, or when the call was routed to a "
        "replica that does not hold it (a stale proxy map). Open a new session and redo "
        "the work since its start. Server said: "
    )


class TapeReleasedError(FailedPreconditionError, RuntimeError):
    """A gradient tape asked for gradients (or to watch) after it was released: a
    non-persistent tape by its one ``gradient`` call, any tape by ``release()``
    (reason ``TAPE_RELEASED``). TensorFlow raises ``RuntimeError`` for the first ("A
    non-persistent GradientTape can only be used to compute one set of gradients"), so
    a program moved from ``tf.GradientTape`` catches it where it did."""

    REASON = "TAPE_RELEASED"

    def __init__(self, message: str, **details: Any) -> None:
        details.setdefault("reason", self.REASON)
        super().__init__(message, **details)


_BY_CODE: dict[Code, type[GradserveError]] = {
    cls.code: cls for cls in GradserveError.__subclasses__()
}


def error_class_for(code: Code | int) -> type[GradserveError]:
    """The error class for a status code number (a ``Code``, or any int)."""
    try:
        return _BY_CODE.get(Code(code), UnknownError)
    except ValueError:
        return UnknownError
