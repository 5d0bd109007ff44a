"""The one place where domain errors become gRPC statuses.

``rpc_status_for`` builds a ``google.rpc.Status`` with details (``ErrorInfo``
carrying the reason, ``BadRequest`` naming the field at fault); ``grpc_code``
maps the domain's ``errors.Code`` to ``grpc.StatusCode``; ``guarded`` wraps
every servicer method — unary or server-streaming response, unary or streamed
request — so that every exception leaves through it: typed errors with their
own code, anything unexpected as INTERNAL (logged with its traceback). No
handler picks a status code itself.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from gradserve.errors import Code, GradserveError, InternalError, ResourceExhaustedError
from gradserve.protocol import REQUEST_ID_KEY
from gradserve.server.transport.observability import CallRecord

log = logging.getLogger(__name__)

ERROR_DOMAIN = "gradserve"

H = TypeVar("H", bound=Callable[..., Any])

_GRPC_CODES = {Code(c.value[0]): c for c in grpc.StatusCode}


def grpc_code(code: Code) -> grpc.StatusCode:
    """gRPC's enum for a domain status code (same number and name)."""
    return _GRPC_CODES[code]


def as_gradserve_error(exc: BaseException) -> GradserveError:
    """``exc`` itself if typed; running out of host or GPU memory (NumPy's and CuPy's
    allocation failures are MemoryErrors) as RESOURCE_EXHAUSTED, a load condition the
    caller can retry later; anything else an INTERNAL error that says what broke."""
    if isinstance(exc, GradserveError):
        return exc
    if isinstance(exc, MemoryError):
        log.warning("out of memory in handler: %s", exc)
        return ResourceExhaustedError(
            f"out of memory: {type(exc).__name__}: {exc}", reason="OUT_OF_MEMORY"
        )
    log.exception("unexpected error in handler")
    return InternalError(f"internal error: {type(exc).__name__}: {exc}", reason="INTERNAL")


def rpc_status_for(err: GradserveError) -> status_pb2.Status:
    details = []
    if err.reason:
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN))
        details.append(info)
    if err.field:
        bad = any_pb2.Any()
        bad.Pack(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=err.field, description=err.message
                    )
                ]
            )
        )
        details.append(bad)
    return status_pb2.Status(code=int(err.code), message=err.message, details=details)


def abort(context: grpc.ServicerContext, err: GradserveError, request_id: str = "") -> None:
    """End the RPC with ``err``'s status and details (raises, as context.abort does)."""
    status = rpc_status.to_status(rpc_status_for(err))
    if request_id:
        status = status._replace(
            trailing_metadata=(*status.trailing_metadata, (REQUEST_ID_KEY, request_id))
        )
    context.abort_with_status(status)


def guarded(handler: H) -> H:
    """Wrap a servicer method of any RPC kind: observe it, map every error once.

    Generator methods (server streaming) are wrapped as generators; the others
    return one response. A message request's size is counted here; a streamed
    request's chunks are counted by the handler (``observability.current_call``).
    The servicer provides ``observer`` (``observability.Observer``).
    """
    name = handler.__name__

    if inspect.isgeneratorfunction(handler):

        @functools.wraps(handler)
        def streaming(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with self.observer.call(name, context) as call:
                call.bytes_in = _size(request)
                try:
                    for message in handler(self, request, context):
                        call.bytes_out += message.ByteSize()
                        yield message
                except Exception as exc:  # noqa: BLE001 - the boundary: nothing escapes
                    fail(call, exc, context)

        return streaming  # type: ignore[return-value]

    @functools.wraps(handler)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        observer = self.observer
        with observer.call(name, context) as call:
            try:
                response = handler(self, request, context)
            except Exception as exc:  # noqa: BLE001 - the boundary: nothing escapes
                fail(call, exc, context)
            if observer.counts_bytes:
                call.bytes_in += _size(request)
                call.bytes_out = response.ByteSize()
            return response

    return unary  # type: ignore[return-value]


def _size(request: Any) -> int:
    """A message request's size; 0 for a request stream (counted as it is read)."""
    return request.ByteSize() if hasattr(request, "ByteSize") else 0


def fail(call: CallRecord, exc: Exception, context: Any) -> None:
    """Record ``exc`` on the call and end the RPC with its status (always raises)."""
    if _is_abort(exc, context):
        call.code = Code[context.code().name]
        call.message = str(context.details() or "")
        raise exc
    err = as_gradserve_error(exc)
    call.code, call.message = err.code, err.message
    abort(context, err, call.request_id)


def _is_abort(exc: Exception, context: Any) -> bool:
    # context.abort raises a bare Exception after setting the code.
    return type(exc) is Exception and context.code() not in (None, grpc.StatusCode.OK)
