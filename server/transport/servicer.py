"""The GradServe servicer: sessions, resident tensors, op RPCs and Batch.

Every method finds its session from the ``x-gradserve-session`` metadata,
translates, and delegates; errors leave through ``boundary``.
"""

from __future__ import annotations

from gradserve import codec, dtypes, protocol
from gradserve.errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
)
from gradserve.server.transport import boundary
from gradserve.server.transport.auth import current_principal
from gradserve.server.transport.admission import ComputeGate
from gradserve.server.transport.observability import Observer
from gradserve.server.transport.handlers import OPS, OPS_BY_BATCH_FIELD, Op
from gradserve.server.core.sessions import Session, SessionStore
from gradserve.server.transport.wire import CallIO, host_array
from gradserve.v1 import service_pb2, service_pb2_grpc, tensor_pb2


class GradServeServicer(service_pb2_grpc.GradServeServicer):
    def __init__(
        self,
        store: SessionStore,
        *,
        compute=None,
        observer: Observer | None = None,
        compute_gate: ComputeGate | None = None,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        chunk_bytes: int = protocol.DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.store = store
        self.compute = compute
        self.observer = observer or Observer()
        self.compute_gate = compute_gate or ComputeGate(slots=2, max_waiting=64)
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = chunk_bytes

    # ---------------------------------------------------------------- helpers
    def _session(self, context, metadata: dict[str, str] | None = None) -> Session:
        metadata = _metadata(context) if metadata is None else metadata
        session_id = metadata.get(protocol.SESSION_METADATA_KEY)
        if not session_id:
            raise InvalidArgumentError(
                f"no session: pass the id CreateSession returned in "
                f"'{protocol.SESSION_METADATA_KEY}' request metadata",
                reason="SESSION_REQUIRED",
            )
        return self.store.get(session_id, current_principal.get())

    def _io(self, context) -> CallIO:
        # Room for the rest of the response next to the largest inline tensor.
        ceiling = self.max_message_bytes - 64 * 1024
        metadata = _metadata(context)
        raw = metadata.get(protocol.INLINE_LIMIT_METADATA_KEY)
        try:
            limit = min(int(raw), ceiling) if raw else ceiling
        except ValueError:
            raise InvalidArgumentError(
                f"'{protocol.INLINE_LIMIT_METADATA_KEY}' must be an integer, got {raw!r}"
            ) from None
        return CallIO(
            self._session(context, metadata),
            limit,
            self.compute,
            lambda: _check_call_alive(context),
        )

    # ---------------------------------------------------------------- sessions
    @boundary.guarded
    def CreateSession(self, request, context):
        session = self.store.create(current_principal.get())
        return service_pb2.CreateSessionResponse(
            session_id=session.id, idle_timeout_seconds=self.store.idle_timeout
        )

    @boundary.guarded
    def CloseSession(self, request, context):
        self.store.close(self._session(context).id, current_principal.get())
        return service_pb2.CloseSessionResponse()

    @boundary.guarded
    def KeepAlive(self, request, context):
        self._session(context)  # finding it refreshes its idle timer
        return service_pb2.KeepAliveResponse(idle_timeout_seconds=self.store.idle_timeout)

    # ---------------------------------------------------------------- resident tensors
    def PutTensor(self, request_iterator, context):
        with self.observer.call("PutTensor", context) as call:
            try:
                session = self._session(context)
                return self._receive(session, request_iterator, call)
            except Exception as exc:  # noqa: BLE001 - the boundary
                boundary.fail(call, exc, context)

    @staticmethod
    def _receive(session: Session, chunks, call) -> tensor_pb2.ResidentTensor:
        """Stream chunks into one array, its bytes reserved in the session's budget
        before the buffer is allocated (and released again if anything fails)."""
        reserved = 0

        def reserve(nbytes: int) -> None:
            nonlocal reserved
            session.check_tensor_bytes(nbytes)
            session.budget.reserve(nbytes)
            reserved = nbytes

        def count(nbytes: int) -> None:
            call.bytes_in += nbytes

        try:
            array = codec.decode_chunks(
                chunks, before_allocating=reserve, on_data=count, field="PutTensor"
            )
            tensor_id = session.put(array, reserved=True)
        except BaseException:
            session.budget.release(reserved)
            raise
        return tensor_pb2.ResidentTensor(
            id=tensor_id, dtype=dtypes.to_enum(array.dtype), shape=array.shape
        )

    @boundary.guarded_stream
    def GetTensor(self, request, context):
        session = self._session(context)
        array = host_array(self.compute, session.get(request.id))
        chunk = request.chunk_bytes if request.chunk_bytes > 0 else self.chunk_bytes
        chunk = min(chunk, self.max_message_bytes - 1024)
        if request.delete_after:
            session.delete([request.id])
        yield from codec.encode_chunks(array, chunk)

    @boundary.guarded
    def DeleteTensor(self, request, context):
        deleted = self._session(context).delete(request.ids)
        return service_pb2.DeleteTensorResponse(deleted=deleted)

    def _run(self, op: Op, io: CallIO, request):
        """Run one op; heavy ones wait for a compute slot (or are refused when the queue is full)."""
        if not op.heavy:
            return op.handler(io, request)
        with self.compute_gate.slot(io.check_alive):
            return op.handler(io, request)

    # ---------------------------------------------------------------- Batch
    @boundary.guarded
    def Batch(self, request, context):
        io = self._io(context)
        response = service_pb2.BatchResponse()
        for index, step in enumerate(request.steps):
            try:
                _check_call_alive(context)
                which = step.WhichOneof("op")
                if which is None:
                    raise InvalidArgumentError(f"Batch step {index} names no op")
                op = OPS_BY_BATCH_FIELD[which]
                result = self._run(op, io, getattr(step, which))
                getattr(response.results.add(), which).CopyFrom(result)
            except Exception as exc:  # noqa: BLE001 - reported in the response
                err = boundary.as_gradserve_error(exc)
                response.failed_step = index
                response.error.code = err.code.value[0]
                response.error.message = f"Batch step {index} ({_op_name(step)}): {err.message}"
                response.error.reason = err.reason
                break
        return response


def _op_rpc(op: Op):
    def method(self, request, context):
        return self._run(op, self._io(context), request)

    method.__name__ = op.rpc
    method.__doc__ = f"The {op.rpc} op (see tf.raw_ops.{op.rpc})."
    return boundary.guarded(method)


for _op in OPS:
    setattr(GradServeServicer, _op.rpc, _op_rpc(_op))


def _op_name(step) -> str:
    which = step.WhichOneof("op")
    return OPS_BY_BATCH_FIELD[which].rpc if which else "no op"


def _metadata(context) -> dict[str, str]:
    """The call's text metadata, read once."""
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


def _check_call_alive(context) -> None:
    """Between steps of long work: stop if the client cancelled or the deadline passed."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceededError("deadline exceeded")
    if not context.is_active():
        raise CancelledError("the call was cancelled")
