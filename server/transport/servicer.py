"""The GradServe servicer: sessions, resident tensors, op RPCs and Batch.

Every method finds its session from the ``x-gradserve-session`` metadata,
translates, and delegates to the core; every method, whatever its kind, is
wrapped by ``boundary.guarded``, the one place errors become statuses. The op
RPCs come from the ``handlers.OPS`` table: each is served by the handler
function of its name (``tensor_array_handlers``, ``lstm_handlers``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message

from gradserve import codec, protocol
from gradserve.errors import CancelledError, DeadlineExceededError, InvalidArgumentError
from gradserve.kernels.compute import Compute
from gradserve.server.core.sessions import Session, SessionStore, TensorReservation
from gradserve.server.transport import boundary
from gradserve.server.transport.admission import ComputeGate
from gradserve.server.transport.auth import current_principal
from gradserve.server.transport.handlers import OPS, OPS_BY_BATCH_FIELD, Op
from gradserve.server.transport.observability import Observer, current_call
from gradserve.server.transport.wire import CallIO, host_array
from gradserve.v1 import service_pb2, service_pb2_grpc, tensor_pb2


class GradServeServicer(service_pb2_grpc.GradServeServicer):
    def __init__(
        self,
        store: SessionStore,
        *,
        compute: Compute,
        compute_gate: ComputeGate,
        observer: Observer | None = None,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        chunk_bytes: int = protocol.DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.store = store
        self.compute = compute
        self.compute_gate = compute_gate
        self.observer = observer or Observer()
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = chunk_bytes

    # ---------------------------------------------------------------- helpers
    def _session(self, context: grpc.ServicerContext) -> Session:
        session_id = _metadata(context).get(protocol.SESSION_METADATA_KEY)
        if not session_id:
            raise InvalidArgumentError(
                f"no session: pass the id CreateSession returned in "
                f"'{protocol.SESSION_METADATA_KEY}' request metadata",
                reason="SESSION_REQUIRED",
            )
        return self.store.get(session_id, current_principal.get())

    def _io(self, context: grpc.ServicerContext) -> CallIO:
        """The call's inputs and outputs: the whole response carries at most
        ``--max-message-bytes`` (less room for its other fields) of inline tensors, or
        less where the client's channel takes less."""
        metadata = _metadata(context)
        budget = self.max_message_bytes - protocol.MESSAGE_OVERHEAD_BYTES
        client_budget = _int_metadata(metadata, protocol.RESPONSE_BUDGET_METADATA_KEY)
        if client_budget is not None:
            budget = min(budget, client_budget)
        return CallIO(
            self._session(context),
            self.compute,
            inline_budget=max(0, budget),
            inline_limit=_int_metadata(metadata, protocol.INLINE_LIMIT_METADATA_KEY),
            check_alive=lambda: _check_call_alive(context),
        )

    def _run(self, op: Op, io: CallIO, request: Message) -> Message:
        """Run one op; heavy ones wait for a compute slot (or are refused when the queue is full)."""
        if not op.heavy:
            return op.handler(io, request)
        with self.compute_gate.slot(io.check_alive):
            return op.handler(io, request)

    # ---------------------------------------------------------------- sessions
    @boundary.guarded
    def CreateSession(self, request: Any, context: grpc.ServicerContext) -> Message:
        session = self.store.create(current_principal.get())
        return service_pb2.CreateSessionResponse(
            session_id=session.id, idle_timeout_seconds=self.store.idle_timeout
        )

    @boundary.guarded
    def CloseSession(self, request: Any, context: grpc.ServicerContext) -> Message:
        self.store.close(self._session(context).id, current_principal.get())
        return service_pb2.CloseSessionResponse()

    @boundary.guarded
    def KeepAlive(self, request: Any, context: grpc.ServicerContext) -> Message:
        self._session(context)  # finding it refreshes its idle timer
        return service_pb2.KeepAliveResponse(
            idle_timeout_seconds=self.store.idle_timeout, max_message_bytes=self.max_message_bytes
        )

    # ---------------------------------------------------------------- resident tensors
    @boundary.guarded
    def PutTensor(
        self, request_iterator: Iterable[tensor_pb2.TensorChunk], context: grpc.ServicerContext
    ) -> tensor_pb2.ResidentTensor:
        """Stream chunks into one array, its bytes reserved in the session's budget
        before the buffer is allocated (and released if the stream fails)."""
        session = self._session(context)
        call = current_call.get()

        def count(nbytes: int) -> None:
            if call is not None:
                call.bytes_in += nbytes

        with contextlib.ExitStack() as held:
            reservations: list[TensorReservation] = []

            def reserve(nbytes: int) -> None:
                reservations.append(held.enter_context(session.reserve_tensor(nbytes)))

            array = codec.decode_chunks(
                request_iterator, before_allocating=reserve, on_data=count, field="PutTensor"
            )
            tensor_id = reservations[0].keep(array)
        return tensor_pb2.ResidentTensor(
            id=tensor_id, dtype=codec.dtype_to_enum(array.dtype), shape=array.shape
        )

    @boundary.guarded
    def GetTensor(
        self, request: service_pb2.GetTensorRequest, context: grpc.ServicerContext
    ) -> Iterator[tensor_pb2.TensorChunk]:
        """The tensor in chunks; with ``delete_after``, deleted once the last chunk is
        sent, so a stream that breaks off leaves it to be fetched again."""
        session = self._session(context)
        array = host_array(self.compute, session.get(request.id))
        chunk = request.chunk_bytes if request.chunk_bytes > 0 else self.chunk_bytes
        chunk = min(chunk, self.max_message_bytes - 1024)
        yield from codec.encode_chunks(array, chunk)
        if request.delete_after:
            session.delete([request.id])

    @boundary.guarded
    def DeleteTensor(self, request: Any, context: grpc.ServicerContext) -> Message:
        deleted = self._session(context).delete(request.ids)
        return service_pb2.DeleteTensorResponse(deleted=deleted)

    # ---------------------------------------------------------------- Batch
    @boundary.guarded
    def Batch(
        self, request: service_pb2.BatchRequest, context: grpc.ServicerContext
    ) -> service_pb2.BatchResponse:
        """Run the steps in order in one call; stop at the first failure, which is
        reported in the response with the results of the steps before it. The
        inline budget is the whole response's: no result of a step that ran is lost
        to the message limit."""
        io = self._io(context)
        response = service_pb2.BatchResponse()
        for index, step in enumerate(request.steps):
            which = step.WhichOneof("op")
            try:
                _check_call_alive(context)
                if which is None:
                    raise InvalidArgumentError(f"Batch step {index} names no op")
                op = OPS_BY_BATCH_FIELD[which]
                result = self._run(op, io, getattr(step, which))
                getattr(response.results.add(), which).CopyFrom(result)
            except Exception as exc:  # noqa: BLE001 - reported in the response
                err = boundary.as_gradserve_error(exc)
                name = OPS_BY_BATCH_FIELD[which].rpc if which else "no op"
                response.failed_step = index
                response.error.code = int(err.code)
                response.error.message = f"Batch step {index} ({name}): {err.message}"
                response.error.reason = err.reason
                break
        return response


def _op_rpc(op: Op) -> Any:
    def method(self: GradServeServicer, request: Message, context: grpc.ServicerContext) -> Any:
        return self._run(op, self._io(context), request)

    method.__name__ = method.__qualname__ = op.rpc
    method.__doc__ = f"Serves {op.rpc} with ``{op.handler.__module__}.{op.rpc}``."
    return boundary.guarded(method)


for _op in OPS:
    setattr(GradServeServicer, _op.rpc, _op_rpc(_op))


def _metadata(context: grpc.ServicerContext) -> dict[str, str]:
    """The call's text metadata."""
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


def _int_metadata(metadata: dict[str, str], key: str) -> int | None:
    raw = metadata.get(key)
    try:
        return int(raw) if raw else None
    except ValueError:
        raise InvalidArgumentError(f"'{key}' must be an integer, got {raw!r}") from None


def _check_call_alive(context: grpc.ServicerContext) -> None:
    """Between steps of long work: stop if the client cancelled or the deadline passed."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceededError("deadline exceeded")
    if not context.is_active():
        raise CancelledError("the call was cancelled")
