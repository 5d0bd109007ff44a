"""The one place where domain errors become gRPC statuses.

``rpc_status_for`` builds a ``google.rpc.Status`` with details (``ErrorInfo``
carrying the reason, ``BadRequest`` naming the field at fault); ``grpc_code``
maps the domain's ``errors.Code`` to ``grpc.StatusCode``; ``guarded`` wraps
every servicer coroutine — unary or streamed request or response — so that every
call is admitted, authenticated and observed the same way and every exception
leaves through it: typed errors with their own code, a request that does not
parse as INVALID_ARGUMENT (one of too many fields, not parsed at all, as
RESOURCE_EXHAUSTED), anything unexpected as INTERNAL (logged with its
traceback). No handler picks a status code itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from gradserve import wire_fields
from gradserve.errors import (
    Code,
    GradserveError,
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from gradserve.protocol import ERROR_DOMAIN, REQUEST_ID_KEY
from gradserve.server.transport import streams
from gradserve.server.transport.auth import current_principal, principal_of
from gradserve.v1 import service_pb2

SERVICE = service_pb2.DESCRIPTOR.services_by_name["GradServe"]

log = logging.getLogger(__name__)


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


#: Most bytes an error message takes in ``grpc-message``: messages echo names and
#: inputs, and a status travels in trailing metadata, which gRPC bounds far below the
#: message limit (8 KiB, past which it may drop the trailers, 16 KiB at most); the
#: message is there once percent-encoded and twice more in ``grpc-status-details-bin``
#: (``Status.message``, ``BadRequest``'s description; base64), about 7.5 KiB at most.
MAX_MESSAGE_BYTES = 2048


def bounded(message: str) -> str:
    """``message``, cut where it would take over ``MAX_MESSAGE_BYTES`` as gRPC sends it:
    a printable ASCII character one byte, any other (and ``%``) three per UTF-8 byte
    (percent-encoded). Counted in characters, 2048 of ``é`` sent 12 KiB, and the
    status with its details passed gRPC's hard limit: the client got gRPC's
    RESOURCE_EXHAUSTED instead of the error."""
    budget = MAX_MESSAGE_BYTES - 40  # room for the note on what was cut
    sent = 0
    for n, ch in enumerate(message):
        sent += 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8", "replace"))
        if sent > budget:
            return message[:n] + f"… ({len(message)} chars)"
    return message


def rpc_status_for(err: GradserveError) -> status_pb2.Status:
    message = bounded(err.message)
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
                        field=bounded(err.field), description=message
                    )
                ]
            )
        )
        details.append(bad)
    return status_pb2.Status(code=int(err.code), message=message, details=details)


class Unparsed:
    """A request (or stream message) that did not parse: the handler's call ends with
    INVALID_ARGUMENT naming why, where gRPC would log a traceback and answer INTERNAL.
    One holding more fields than it may (``protocol.MAX_REQUEST_FIELDS``, or
    ``LOOP_FIELDS`` for a streamed message) is not parsed at all (``wire_fields``) and
    ends with RESOURCE_EXHAUSTED."""

    def __init__(self, what: str, error: Exception) -> None:
        self.too_many_fields = isinstance(error, wire_fields.TooManyFieldsError)
        if self.too_many_fields:
            self.message = f"{what}: {error}"
        else:
            self.message = f"the request does not parse as {what}: {type(error).__name__}: {error}"


#: Fields a request may hold and be parsed on the event loop as it arrives (counting
#: stops there, in ~0.1 ms). A unary request with more (a Batch, a gradient of many
#: sources, a hostile message) is counted to ``protocol.MAX_REQUEST_FIELDS`` and
#: parsed after its call is admitted, on the light lane (``Deferred``): counting a
#: Batch of 4,300 TensorArray writes (64,500 fields) takes ~27 ms, and protobuf's
#: parse 1 ms, that every call of the server waited for on the loop. A streamed
#: message (a PutTensor chunk, ~5 fields) may hold no more than this.
LOOP_FIELDS = 256


class Deferred:
    """A unary request of more than ``LOOP_FIELDS`` fields, as received: ``parse``
    (on a lane, once the call is admitted: ``guarded``) counts its fields and parses
    it, giving the message or ``Unparsed``."""

    def __init__(self, data: bytes, parse: Callable[[bytes], Any], descriptor: Any) -> None:
        self._data = data
        self._parse = parse
        self._descriptor = descriptor

    def parse(self) -> Any:
        try:
            wire_fields.check_field_count(self._data, self._descriptor)
            return self._parse(self._data)
        except Exception as error:  # noqa: BLE001 - any parse failure is the client's
            return Unparsed(self._descriptor.full_name, error)


def lenient(
    parse: Callable[[bytes], Any],
    descriptor: Any,
    received: Callable[[int], None] = lambda n: None,
    *,
    stream: bool = False,
) -> Callable[[bytes], Any]:
    """A request deserializer for messages of ``descriptor``'s type, which gRPC runs
    on the event loop before any admission: it parses a message of at most
    ``LOOP_FIELDS`` fields, defers a larger unary request to ``Deferred`` and refuses
    a larger streamed message (``stream``), never parsing one unseen, and returns
    ``Unparsed`` instead of raising. Tells ``received`` the size of every message (the
    server's trimmer: see ``GradServeServicer.request_freed``)."""
    what = descriptor.full_name

    def deserialize(data: bytes) -> Any:
        received(len(data))
        try:
            wire_fields.check_field_count(data, descriptor, LOOP_FIELDS)
            return parse(data)
        except wire_fields.TooManyFieldsError as error:
            return Unparsed(what, error) if stream else Deferred(data, parse, descriptor)
        except Exception as error:  # noqa: BLE001 - any parse failure is the client's
            return Unparsed(what, error)

    return deserialize


def check_parsed(message: Any) -> None:
    """Raise INVALID_ARGUMENT for a message that did not parse, RESOURCE_EXHAUSTED for
    one of too many fields."""
    if isinstance(message, Unparsed):
        if message.too_many_fields:
            raise ResourceExhaustedError(message.message, reason="TOO_MANY_FIELDS")
        raise InvalidArgumentError(message.message, reason="MALFORMED_REQUEST")


def guarded(handler: H) -> H:
    """Wrap a servicer coroutine of any RPC kind: the one door every GradServe call
    goes through.

    In order: observe the call (metrics, logs, request id); authenticate its bearer
    token (when the server has a token file); admit it (refused with UNAVAILABLE
    while draining, RESOURCE_EXHAUSTED past the call or stream limits); set
    ``current_principal``; parse a request of many fields (``Deferred``) on the light
    lane; refuse a request that did not parse; run the handler; map
    every exception to its status, once. A call its client cancelled is recorded as
    CANCELLED and not reported as an error.

    The servicer provides ``observer``, ``admission``, ``light`` and
    ``principal(context)``.
    A message request's size is counted here; streamed chunks by the handler.
    """
    name = handler.__name__
    method = SERVICE.methods_by_name[name]
    stream = method.client_streaming or method.server_streaming

    @functools.wraps(handler)
    async def call(self: Any, request: Any, context: Any) -> Any:
        error: GradserveError | None = None
        response = None
        reply_bytes = 0  # a unary reply's size, measured once (ByteSize walks it)
        with self.observer.call(name, context) as record:
            try:
                principal = self.principal(context)
                self.admission.enter(principal, stream=stream, method=name)
            except GradserveError as exc:
                error = exc
            else:
                if stream:  # in the stream limits until gRPC is done with it
                    context.add_done_callback(
                        functools.partial(_exit, self.admission, principal, stream)
                    )
                else:  # registered first: a handler's own callback that raises skips it
                    reply = _Reply(self.admission, principal)
                    context.add_done_callback(reply.gone)
                try:
                    token = current_principal.set(principal)
                    try:
                        if isinstance(request, Deferred):
                            request = await self.light.run(request.parse)
                        check_parsed(request)
                        response = await handler(self, request, context)
                    finally:
                        current_principal.reset(token)
                        _let_go_of_session()  # the handler is done with it
                        if not stream:
                            self.admission.exit(principal)
                    if not stream and response is not None:
                        reply_bytes = response.ByteSize()
                        reply.made(reply_bytes)
                except asyncio.CancelledError:
                    record.code, record.message = Code.CANCELLED, "cancelled by the client"
                    raise
                except Exception as exc:  # noqa: BLE001 - the boundary: nothing escapes
                    if _client_went(exc, context):
                        record.code, record.message = Code.CANCELLED, "the client went"
                        raise asyncio.CancelledError from None
                    error = as_gradserve_error(exc)
                    if streams.status_stuck(error):  # in the stream limits until it ends
                        try:
                            await streams.until_taken_or_gone(
                                error, lambda: self.admission.draining
                            )
                        except asyncio.CancelledError:  # the client went: as ended
                            record.code, record.message = error.code, error.message
                            raise
            if error is not None:
                record.code, record.message = error.code, error.message
            elif self.observer.counts_bytes:
                record.bytes_in += _size(request)
                if response is not None:
                    record.bytes_out = reply_bytes or response.ByteSize()
        if error is not None:  # counted and logged above, before the client can see it
            if streams.status_stuck(error):
                raise asyncio.CancelledError  # (no status can pass its unread message)
            await abort(context, error, record.request_id)
        return response

    return call  # type: ignore[return-value]


#: Ends the running call's hold on its session (``Session.call_started``), set by the
#: servicer as the handler finds the session: the boundary calls it once the handler
#: has returned, so that a session is idle from then, not only once gRPC has sent the
#: reply (a client that reads nothing kept its session from expiring for good, a
#: review helper).
SESSION_CALL: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "gradserve_session_call", default=None
)


def _let_go_of_session() -> None:
    ended = SESSION_CALL.get()
    if ended is not None:
        ended()


def _client_went(exc: BaseException, context: Any) -> bool:
    """gRPC's own error for a message written to a call that has ended, its client
    gone or its deadline passed: the client left, not an internal failure to log with
    its traceback (a review helper saw one in ~190 streams ended so). On a call still
    live it is a fault of ours, and stays INTERNAL."""
    if not (type(exc).__name__ == "ExecuteBatchError" and type(exc).__module__.startswith("grpc")):
        return False
    remaining = context.time_remaining()
    return bool(context.cancelled()) or (remaining is not None and remaining <= 0)


def _exit(admission: Any, principal: str, stream: bool, _context: Any) -> None:
    admission.exit(principal, stream=stream)


#: Unary replies at least this large count as waiting (``Admission.reply_waiting``)
#: once gRPC has held them ``REPLY_GRACE_SECONDS`` and until it is done with their
#: call: smaller ones cost less than their counting.
REPLY_COUNTED_MIN_BYTES = 64 * 1024
#: A reply its client is reading is not unread: counted from the reply's hand-over,
#: eight workers reading 3 MiB replies from a server near its budget were refused
#: 23 calls in 970 (a review helper).
REPLY_GRACE_SECONDS = 1.0


class _Reply:
    """A unary call's reply, counted as waiting while gRPC holds it past the grace:
    a client that never reads it leaves it in gRPC as long as its connection lives."""

    def __init__(self, admission: Any, principal: str) -> None:
        self._admission = admission
        self._principal = principal
        self._nbytes = 0
        self._counted = False
        self._done = False
        self._timer: asyncio.TimerHandle | None = None

    def made(self, nbytes: int) -> None:
        """The handler returned a reply of ``nbytes`` (on the event loop)."""
        if self._done:
            return
        if nbytes >= REPLY_COUNTED_MIN_BYTES:
            self._nbytes = nbytes
            self._timer = asyncio.get_running_loop().call_later(REPLY_GRACE_SECONDS, self._wait)

    def _wait(self) -> None:
        if not self._done:
            self._counted = True
            self._admission.reply_waiting(self._principal, self._nbytes)

    def gone(self, _context: Any = None) -> None:
        """gRPC is done with the call (its done callback)."""
        self._done = True
        self._admission.call_done()
        if self._timer is not None:
            self._timer.cancel()
        if self._counted:
            self._counted = False
            self._admission.reply_taken(self._principal, self._nbytes)


def _size(request: Any) -> int:
    """A message request's size; 0 for a request stream (counted as it is read)."""
    return request.ByteSize() if hasattr(request, "ByteSize") else 0


class TokenGate(grpc.GenericRpcHandler):
    """The GradServe handlers behind a token check made before any message is read.

    gRPC hands a unary call's handler its request only once the whole message has
    arrived, so a refusal made in the handler (``guarded``) came after the server had
    buffered up to ``--max-message-bytes`` for anyone who could open a connection: a
    message declared large and never finished held that memory for as long as the
    connection lived. Here, where gRPC picks a call's handler from its metadata, a
    call without a valid bearer token gets instead a handler of the same method that
    takes its request as a stream it never reads: the refusal (UNAUTHENTICATED,
    counted and logged by ``guarded`` as any refusal) ends the call at once, and what
    the client sent past HTTP/2's flow-control window is never accepted. A valid
    token gets the method's own handler, which checks it again (``guarded``)."""

    def __init__(self, servicer: Any, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._tokens = servicer.tokens
        self._handlers = handlers
        self._refusals = {name: _refusal(servicer, SERVICE.methods_by_name[name])
                          for name in handlers}  # fmt: skip
        self._prefix = f"/{SERVICE.full_name}/"

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        path = handler_call_details.method
        if not path.startswith(self._prefix):
            return None
        name = path[len(self._prefix) :]
        handler = self._handlers.get(name)
        if handler is None:
            return None
        if principal_of(self._tokens, handler_call_details.invocation_metadata or ()) is None:
            return self._refusals[name]
        return handler


def _refusal(servicer: Any, method: Any) -> grpc.RpcMethodHandler:
    """A handler of ``method`` for a call ``guarded`` refuses (it authenticates first),
    taking the request as a stream so that gRPC reads none of it."""

    async def refuse(self: Any, request: Any, context: Any) -> Any:
        raise AssertionError("unreachable: guarded refuses a call without a valid token")

    refuse.__name__ = method.name
    behavior = guarded(refuse).__get__(servicer)
    if method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior)
    return grpc.stream_unary_rpc_method_handler(behavior)


async def abort(context: Any, err: GradserveError, request_id: str) -> NoReturn:
    """End the RPC with ``err``'s status and details (raises, as ``context.abort`` does)."""
    status = rpc_status.to_status(rpc_status_for(err))
    trailing = (*status.trailing_metadata, (REQUEST_ID_KEY, request_id))
    try:
        await context.abort(status.code, status.details, trailing)
    except Exception as exc:
        # The client went (its deadline passed, it cancelled) before its status could
        # be sent: gRPC's error here was logged with its traceback, one per call (a
        # client of 1 ms deadlines wrote 104 in 20 s: helper-77).
        if _client_went(exc, context):
            raise asyncio.CancelledError from None
        raise
    raise AssertionError("context.abort returned")  # pragma: no cover
