"""Typed errors, one class per gRPC status code, named like TensorFlow's.

The server raises these at the semantic layer (TensorArray state machine, op
checks, sessions) and maps them to a gRPC status exactly once, at the RPC
boundary. The SDK turns every failed call back into the same class, so code
written against ``tf.errors`` reads the same against gradserve.
"""

from __future__ import annotations

import grpc

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
    "error_class_for",
]


class GradserveError(Exception):
    """Base of every gradserve error.

    Attributes
    ----------
    code:
        The ``grpc.StatusCode`` this error travels as.
    message:
        What went wrong, written for a person (names, indices, expected vs got).
    reason:
        A stable machine-readable word (``google.rpc.ErrorInfo.reason``), such as
        ``SESSION_NOT_FOUND``; empty when the code alone says enough.
    field:
        The request field at fault (``google.rpc.BadRequest``), or empty.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, reason: str = "", field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.field = field

    def __str__(self) -> str:
        return self.message


class CancelledError(GradserveError):
    code = grpc.StatusCode.CANCELLED


class UnknownError(GradserveError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(GradserveError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(GradserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(GradserveError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(GradserveError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(GradserveError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(GradserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(GradserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(GradserveError):
    code = grpc.StatusCode.ABORTED


class OutOfRangeError(GradserveError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(GradserveError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(GradserveError):
    code = grpc.StatusCode.INTERNAL


class UnavailableError(GradserveError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLossError(GradserveError):
    code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(GradserveError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[GradserveError]] = {
    cls.code: cls for cls in GradserveError.__subclasses__()
}


def error_class_for(code: grpc.StatusCode | int) -> type[GradserveError]:
    """The error class for a status code (a ``grpc.StatusCode`` or its number)."""
    if isinstance(code, int):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, UnknownError)
