"""Every failed call becomes a ``gradserve.errors`` exception, here and only here."""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from gradserve.errors import (
    NOT_CONNECTED_REASON,
    Code,
    FailedPreconditionError,
    GradserveError,
    NotFoundError,
    SessionLostError,
    TapeReleasedError,
    UnavailableError,
    error_class_for,
)
from gradserve.protocol import ERROR_DOMAIN, REQUEST_ID_KEY

#: Statuses after which the server may still be working on the call (no reply).
_NO_REPLY = {Code.DEADLINE_EXCEEDED, Code.CANCELLED, Code.UNAVAILABLE, Code.UNKNOWN}


def answered(exc: BaseException) -> bool:
    """Whether a call that raised ``exc`` was answered by the server (an op's own
    error): the server is up, and done with the call."""
    return isinstance(exc, GradserveError) and exc.code not in _NO_REPLY


def server_done(exc: BaseException | None) -> bool:
    """Whether the server is done with everything a call named (its shared-memory
    regions may be used again): it succeeded (``exc`` None), was answered, or was
    never sent (``never_sent``)."""
    return exc is None or answered(exc) or getattr(exc, _NEVER_SENT, False)


#: The attribute that marks the error of a call none of whose attempts gRPC sent.
_NEVER_SENT = "_gradserve_never_sent"


def never_sent(error: GradserveError) -> GradserveError:
    """``error``, marked as that of a call that no server saw (every attempt failed
    unsent, ``not_sent``): ``server_done`` then says the server is done with it."""
    setattr(error, _NEVER_SENT, True)
    return error


#: The details of the CANCELLED that gRPC Python gives the calls in flight on a
#: channel that is closed (or deallocated, or inherited by a fork child).
CHANNEL_GONE = frozenset(
    {"Channel closed!", "Channel deallocated!", "Call cancelled in fork child"}
)


#: How gRPC's status starts for a call it failed before sending it: the channel's
#: pick_first policy connected to none of the target's addresses (its transient
#: failure picker; grpc/src/core/load_balancing/pick_first), or its resolver found
#: none (the native resolver's words, then c-ares'). Such a call never reached a
#: server, so it counts as unrun (``NOT_CONNECTED_REASON``).
NOT_CONNECTED_DETAILS = (
    "failed to connect to all addresses",
    "errors resolving ",
    "DNS resolution failed for ",
)


def not_sent(error: grpc.RpcError) -> bool:
    """Whether gRPC says it failed the call before sending it (``NOT_CONNECTED_DETAILS``;
    to be trusted on a channel the SDK made: see ``from_rpc_error``)."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    return code == grpc.StatusCode.UNAVAILABLE and (details or "").startswith(NOT_CONNECTED_DETAILS)


def certificate_rejected(error: GradserveError) -> bool:
    """Whether a call failed unsent because a TLS handshake rejected a certificate (the
    server's, against this client's roots, or its name): a setting to fix, which no
    repeat mends. Other handshake failures (a server stopping mid-handshake) may."""
    text = error.message.lower()
    return error.reason == NOT_CONNECTED_REASON and ("certificate" in text or "peer name" in text)


#: How the message of a ``dropped`` call starts.
DROPPED = "the server or a proxy ended the call with CANCELLED"


def dropped(error: GradserveError) -> UnavailableError:
    """A call that ended CANCELLED although this client cancelled nothing, as what it
    is: the server or a proxy dropped it (UNAVAILABLE).

    The SDK's calls block until they end; the only way it cancels one is by closing
    its channel (``CHANNEL_GONE``, which the caller checks first). Any other
    CANCELLED came from the far end: gRPC core ends with CANCELLED every call that a
    server shutting down had received but not yet handed to its handlers
    (grpc/grpc#41785), and a proxy may cancel a call whose backend went away. Whether
    the server ran it is unknown, as for any UNAVAILABLE in flight."""
    return UnavailableError(
        f"{DROPPED} ({error.message}), which this client did not cancel",
        reason=error.reason,
        field=error.field,
        request_id=error.request_id,
    )


#: The reason of a NOT_FOUND for the session itself (not an array or tensor in it).
SESSION_LOST_REASON = "SESSION_NOT_FOUND"


def from_rpc_error(error: grpc.RpcError, *, unsent_is_known: bool = False) -> GradserveError:
    """The typed exception for a failed call, with reason, field and request id.

    ``unsent_is_known``: the call went through a channel the SDK made, so gRPC's
    not-connected status means it was never sent (``NOT_CONNECTED_REASON``). Not on a
    caller's channel: a retry policy in its service config may have sent the call,
    and then failed the repeat that found the server gone."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    reason = field = ""
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # details that contradict the code/message: ignore them
        status = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == ERROR_DOMAIN:  # another service's reasons mean nothing here
                reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                field = bad.field_violations[0].field
    if unsent_is_known and not reason and not_sent(error):
        reason = NOT_CONNECTED_REASON
    trailing: Any = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return typed_error(
        Code[code.name],
        message or str(code),
        reason=reason,
        field=field,
        request_id=next((v for k, v in trailing or () if k == REQUEST_ID_KEY), ""),
    )


def typed_error(code: Code | int, message: str, *, reason: str, **details: Any) -> GradserveError:
    """The error for a status the server sent (a call's, or a Batch step's): the
    class of its code, and ``SessionLostError``, with what it means, for a NOT_FOUND
    of the session itself, ``TapeReleasedError`` (also TensorFlow's ``RuntimeError``)
    for a released tape."""
    cls = error_class_for(code)
    if cls is NotFoundError and reason == SESSION_LOST_REASON:
        cls, message = SessionLostError, SessionLostError.EXPLANATION + message
    elif cls is FailedPreconditionError and reason == TapeReleasedError.REASON:
        cls = TapeReleasedError
    return cls(message, reason=reason, **details)
