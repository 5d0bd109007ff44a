"""The GradServe servicer (asyncio): sessions, resident tensors, op RPCs and Batch.

Every method is a coroutine wrapped by ``boundary.guarded`` (admission,
authentication, observation, the one place errors become statuses). It finds its
session from the ``x-gradserve-session`` metadata and translates; work that
computes runs on a lane (``lanes.Lane``): light ops on ``light``, LSTM ops on
``compute``, so the event loop only waits. The op RPCs come from the
``handlers.OPS`` table: each is served by the handler function of its name
(``tensor_array_handlers``, ``lstm_handlers``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterable, Callable
from typing import Any

from google.protobuf.message import Message

from gradserve import codec, pauses, protocol
from gradserve.errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from gradserve.kernels.compute import Compute
from gradserve.server.core.sessions import ANONYMOUS, Session, SessionStore, TensorReservation
from gradserve.server.core.tape import MAX_TAPES_PER_SESSION, Tape
from gradserve.server.transport import boundary, lanes, shm_wire, tape_handlers
from gradserve.server.transport.admission import Admission
from gradserve.server.transport.auth import REFUSAL, TokenTable, current_principal, principal_of
from gradserve.server.transport.handlers import OPS, OPS_BY_BATCH_FIELD, Op
from gradserve.server.transport.lanes import Lane
from gradserve.server.transport.observability import Observer, current_call
from gradserve.server.transport.servicer_part import (
    ForgottenUnlessReplied,
    ReadOut,
    check_reply_in_time,
    int_metadata,
    text_metadata,
)
from gradserve.server.transport.shm_handlers import SharedMemoryRPCs
from gradserve.server.transport.streams import (
    END,
    Pace,
    StreamLimits,
    next_item,
    settle_short_stream,
)
from gradserve.server.transport.tensor_handlers import InlineTensorRPCs
from gradserve.server.transport.wire import CallIO, host_array
from gradserve.v1 import service_pb2, service_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

#: Streamed chunks are at least this large (the last one aside): a client asking for
#: one-byte chunks would make the server send a message per byte.
MIN_CHUNK_BYTES = 64 * 1024
#: The largest GetTensor chunk, whatever the reader asks: what gRPC holds for a reader
#: that stops reading (the stream limits bound how many), outside every budget.
MAX_CHUNK_BYTES = 4 * 1024 * 1024
#: A Batch runs its next step only with this much room left in the response: the
#: most a step's result takes when every output of it goes transient (8 refs), with
#: room to spare; what the step's outputs cannot fit inline goes transient.
RESPONSE_RESERVE_BYTES = 4096


class GradServeServicer(SharedMemoryRPCs, InlineTensorRPCs, service_pb2_grpc.GradServeServicer):
    def __init__(
        self,
        store: SessionStore,
        *,
        compute: Compute,
        light: Lane,
        heavy: Lane,
        admission: Admission | None = None,
        tokens: TokenTable | None = None,
        observer: Observer | None = None,
        stream_limits: StreamLimits | None = None,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        max_inline_reply_bytes: int | None = None,
        chunk_bytes: int = protocol.DEFAULT_CHUNK_BYTES,
        request_freed: Callable[[int], None] = lambda nbytes: None,
    ) -> None:
        self.store = store
        self.compute = compute
        self.light = light
        self.heavy = heavy
        self.admission = admission or Admission(None)
        self.tokens = tokens
        self.observer = observer or Observer()
        self.stream_limits = stream_limits or StreamLimits()
        self.max_message_bytes = max_message_bytes
        self.max_inline_reply_bytes = max_inline_reply_bytes
        self.chunk_bytes = chunk_bytes
        #: Told the size of every request message as it is parsed (``app``, through
        #: ``boundary.lenient``): the server's trimmer, so that memory a request held
        #: but no session budget saw (a refused put, an op's inline inputs) is handed
        #: back once calls stop, as the trimmer waits for them to.
        self.request_freed = request_freed
        #: Serializes Batch replies off the event loop (``_batch_reply``): threads of
        #: their own, since the loop's default executor also runs undo work that may
        #: wait for a TensorArray's lock (helper-78).
        self.replies = concurrent.futures.ThreadPoolExecutor(
            REPLY_THREADS, thread_name_prefix="gradserve-replies"
        )

    # ---------------------------------------------------------------- helpers
    def principal(self, context: Any) -> str:
        """The caller (``ANONYMOUS`` without a token file); UNAUTHENTICATED without a
        valid bearer token."""
        if self.tokens is None:
            return ANONYMOUS
        principal = principal_of(self.tokens, context.invocation_metadata() or ())
        if principal is None:
            raise UnauthenticatedError(REFUSAL, reason="UNAUTHENTICATED")
        return principal

    def _session(self, context: Any, metadata: dict[str, str] | None = None) -> Session:
        """The call's session; first deletes the transient tensors the client says it
        has read in full (``x-gradserve-fetched``). ``metadata``: the call's, if read."""
        metadata = text_metadata(context) if metadata is None else metadata
        session_id = metadata.get(protocol.SESSION_METADATA_KEY)
        if not session_id:
            raise InvalidArgumentError(
                f"no session: pass the id CreateSession returned in "
                f"'{protocol.SESSION_METADATA_KEY}' request metadata",
                reason="SESSION_REQUIRED",
            )
        session = self.store.get(session_id, current_principal.get())
        # Not idle until the handler ends, however long it runs (``boundary.guarded``
        # ends the hold then; the call's end, should the handler not get there).
        ended = session.call_started()
        context.add_done_callback(lambda _: ended())
        boundary.SESSION_CALL.set(ended)
        fetched = metadata.get(protocol.FETCHED_METADATA_KEY)
        if fetched:
            limit = protocol.MAX_FETCHED_IDS
            session.delete([i for i in fetched.split(",", limit)[:limit] if i])
        return session

    def _io(self, context: Any) -> CallIO:
        """The call's inputs and outputs: the whole response grows by at most
        ``response_budget`` (``--max-message-bytes``, less room for its other fields;
        the client's channel), of which inline tensors at most ``reply_budget``
        (``--max-inline-reply-bytes``)."""
        metadata = text_metadata(context)
        client_budget = int_metadata(metadata, protocol.RESPONSE_BUDGET_METADATA_KEY)
        session = self._session(context, metadata)
        io = CallIO(
            session,
            self.compute,
            inline_budget=self.response_budget(client_budget),
            inline_tensor_budget=self.reply_budget(client_budget),
            inline_limit=int_metadata(metadata, protocol.INLINE_LIMIT_METADATA_KEY),
            check_alive=Liveness(context, session),
            tapes=_tapes(session, metadata),
        )
        io.shared_out = shm_wire.output_arena(session, metadata)
        # Outputs stored for a response that never arrives (the deadline passed or the
        # client cancelled after the op's last check) would hold bytes under ids
        # nobody knows: the call's end deletes them.
        context.add_done_callback(functools.partial(_call_over, io))
        return io

    async def _run(self, op: Op, io: CallIO, request: Message) -> Message:
        """Run one op on its lane (heavy ones wait for a compute slot, or are refused
        when the queue is full)."""
        lane = self.heavy if op.heavy else self.light
        # Light ops (TensorArrays) record in the order they run; the heavy ones (LSTM,
        # Gradients) touch no TensorArray and need not wait for one another.
        return await lane.run(functools.partial(io.run, op.handler, request, not op.heavy))

    def _chunk_bytes(self, asked: int) -> int:
        """A chunk size within [64 KiB, 4 MiB], and what one message carries."""
        ceiling = max(1, min(MAX_CHUNK_BYTES, self.max_message_bytes - protocol.CHUNK_HEADER_BYTES))
        return min(max(asked or self.chunk_bytes, MIN_CHUNK_BYTES), ceiling)

    # ---------------------------------------------------------------- sessions
    @boundary.guarded
    async def CreateSession(self, request: Any, context: Any) -> Message:
        principal = current_principal.get()
        session = self.store.create(principal)
        # Its reply lost, the session held a --max-sessions place (and its principal's)
        # until its TTL (a review helper).
        forgotten = ForgottenUnlessReplied(session, context)
        forgotten.undone_by(functools.partial(self.store.close, session.id, principal))
        forgotten.replied()
        return service_pb2.CreateSessionResponse(
            session_id=session.id, idle_timeout_seconds=self.store.idle_timeout
        )

    @boundary.guarded
    async def CloseSession(self, request: Any, context: Any) -> Message:
        session = self._session(context)
        await self.light.run(functools.partial(self.store.close, session.id, session.principal))
        return service_pb2.CloseSessionResponse()

    @boundary.guarded
    async def KeepAlive(self, request: Any, context: Any) -> Message:
        self._session(context)  # finding it refreshes its idle timer
        return service_pb2.KeepAliveResponse(
            idle_timeout_seconds=self.store.idle_timeout,
            max_message_bytes=self.max_message_bytes,
            deletes_fetched=True,
            max_inline_reply_bytes=self.max_inline_reply_bytes,
        )

    # ---------------------------------------------------------------- resident tensors
    @boundary.guarded
    async def PutTensor(
        self, request_iterator: AsyncIterable[Any], context: Any
    ) -> tensor_pb2.ResidentTensor:
        """Stream chunks into one array. Its bytes are reserved in the session's budget
        from the first chunk, before the buffer exists, and released if the stream
        fails, stalls (``--stream-idle-timeout``), trickles (``--stream-min-rate``) or
        its session closes."""
        session = self._session(context)
        call = current_call.get()
        pace = Pace(self.stream_limits, session, "PutTensor", self._draining)
        forgotten = ForgottenUnlessReplied(session, context)
        with contextlib.ExitStack() as held:
            reservations: list[TensorReservation] = []

            def reserve(nbytes: int) -> None:
                reservations.append(held.enter_context(session.reserve_tensor(nbytes)))

            assembler = codec.ChunkAssembler(
                before_allocating=reserve, allocate=self.store.buffers.empty, field="PutTensor"
            )
            chunks = request_iterator.__aiter__()
            while (chunk := await pace.wait(next_item(chunks))) is not END:
                boundary.check_parsed(chunk)
                assembler.add(chunk)
                pace.moved_bytes(len(chunk.data))
                if call is not None:
                    call.bytes_in += len(chunk.data)
            if not assembler.whole:  # a half-close, or a cancel on its way
                await settle_short_stream(context)
            # Building the array is a pass over every string: off the event loop.
            array = await self.light.run(assembler.finish)
            tensor_id = forgotten.kept(reservations[0].keep(array))
        forgotten.replied()
        return tensor_pb2.ResidentTensor(
            id=tensor_id, dtype=codec.dtype_to_enum(array.dtype), shape=array.shape
        )

    @boundary.guarded
    async def GetTensor(self, request: service_pb2.GetTensorRequest, context: Any) -> None:
        """The tensor in chunks. Its bytes stay charged until the stream ends, even if
        it is deleted meanwhile; with ``delete_after`` it is deleted once the last
        chunk is handed to gRPC, so a stream that breaks off before leaves it to be
        fetched again, but one that breaks off after (chunks buffered, not yet read:
        the server cannot know) loses it. The SDK does not use it for that reason
        (``KeepAlive``'s ``deletes_fetched``: it names what it holds in its next call). A
        reader that stalls or trickles is ended as an uploader is."""
        session = self._session(context)
        read_out = ReadOut(session, request, context)
        call = current_call.get()
        pace = Pace(self.stream_limits, session, "GetTensor", self._draining)
        with session.reading(request.id) as kept:
            content = await self.light.run(functools.partial(self._wire_content, kept))
            # Serialized here, one copy per chunk (the handler's serializer passes bytes).
            for chunk in content.encoded_chunks(self._chunk_bytes(request.chunk_bytes)):
                await pace.wait(context.write(chunk), sending=True)
                pace.moved_bytes(len(chunk))
                if call is not None:
                    call.bytes_out += len(chunk)
        # Past the deadline the client gets DEADLINE_EXCEEDED, not the end of the
        # stream: the tensor stays, to be fetched again.
        read_out.replied()
        return None

    def _wire_content(self, kept: Any) -> codec.WireContent:
        return codec.WireContent(host_array(self.compute, kept))

    def _draining(self) -> bool:
        return self.admission.draining

    @boundary.guarded
    async def DeleteTensor(self, request: Any, context: Any) -> Message:
        session = self._session(context)
        deleted = await self.light.run(functools.partial(session.delete, request.ids))
        return service_pb2.DeleteTensorResponse(deleted=deleted)

    # ---------------------------------------------------------------- gradient tapes
    @boundary.guarded
    async def StartTape(self, request: Any, context: Any) -> Message:
        session = self._session(context)
        return await self.light.run(functools.partial(tape_handlers.start_tape, session, request))

    @boundary.guarded
    async def ReleaseTape(self, request: Any, context: Any) -> Message:
        session = self._session(context)
        # A proposed tape is not started to be released (at the session's limit of
        # tapes that failed): the session marks an id it never had released.
        proposed = request.tape_id in _proposed_ids(text_metadata(context))
        release = functools.partial(tape_handlers.release_tape, proposed=proposed)
        return await self.light.run(functools.partial(release, session, request))

    # ---------------------------------------------------------------- Batch
    @boundary.guarded
    async def Batch(
        self, request: service_pb2.BatchRequest, context: Any
    ) -> service_pb2.BatchResponse:
        """Run the steps in order in one call; stop at the first failure, which is
        reported in the response with the results of the steps before it. The budget
        is the whole response's: outputs that do not fit go transient, and once the
        response is full the next step is not run (RESOURCE_EXHAUSTED, reason
        ``RESPONSE_FULL``; the SDK sends the rest in another Batch), so no result of a
        step that ran is lost to the message limit."""
        io = self._io(context)
        io.first_step = max(0, request.first_step)
        response = service_pb2.BatchResponse()  # the failure; the results go in by bytes
        results: list[tuple[str, Message]] = []
        for index, step in enumerate(request.steps):
            which = step.WhichOneof("op")
            io.step = index
            try:
                io.check_alive()
                if which is None:
                    raise InvalidArgumentError(f"Batch step {io.step_shown(index)} names no op")
                if index and io.response_left < RESPONSE_RESERVE_BYTES:
                    raise ResourceExhaustedError(
                        "not run: the response holds all it may (--max-message-bytes); "
                        "send the steps from here in another Batch",
                        reason="RESPONSE_FULL",
                    )
                op = OPS_BY_BATCH_FIELD[which]
                before = io.response_left
                result = await self._run(op, io, getattr(step, which))
                results.append((which, result))
                io.settle(before, result.ByteSize())
            except Exception as exc:  # noqa: BLE001 - reported in the response
                err = boundary.as_gradserve_error(exc)
                name = OPS_BY_BATCH_FIELD[which].rpc if which else "no op"
                response.failed_step = index
                response.error.code = int(err.code)
                response.error.message = boundary.bounded(
                    f"Batch step {io.step_shown(index)} ({name}): {err.message}"
                )
                response.error.reason = err.reason
                break
        # Serialized off the event loop: copying the results into one message and
        # serializing it there held every call of the server (helper-77: a session's
        # 128 MiB Batch replies held another's KeepAlive 0.7 s a call).
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(self.replies, _batch_reply, results, response)
        # A step stopped by the deadline (``check_alive``, or the op's own checks) ends
        # the call: its reply would reach no one (``check_reply_in_time``).
        check_reply_in_time(context)
        io.end()  # the steps' region copies: released before the client hears back
        io.reply_made()
        return reply  # type: ignore[return-value]


#: Threads that serialize Batch replies: the work is a copy of bytes (each holding
#: the GIL), so more would not make it faster.
REPLY_THREADS = 2
#: The field numbers ``_batch_reply`` writes.
_RESULTS_FIELD = service_pb2.BatchResponse.DESCRIPTOR.fields_by_name["results"].number
_STEP_FIELDS = {f.name: f.number for f in service_pb2.BatchResult.DESCRIPTOR.fields}


def _batch_reply(
    results: list[tuple[str, Message]], failure: service_pb2.BatchResponse
) -> codec.Serialized:
    """The ``BatchResponse`` of ``results`` (each step's op field and result) and
    ``failure`` (its ``failed_step`` and ``error``, if any), serialized: each result
    once, joined, without the copy of every result into one message first."""
    parts: list[bytes] = []
    for which, result in results:
        body = result.SerializeToString()
        step = codec.length_delimited(_STEP_FIELDS[which], len(body))
        parts += [codec.length_delimited(_RESULTS_FIELD, len(step) + len(body)), step, body]
    parts.append(failure.SerializeToString())
    return codec.Serialized(b"".join(parts))


def _op_rpc(op: Op) -> Any:
    async def method(self: GradServeServicer, request: Message, context: Any) -> Any:
        io = self._io(context)
        io.inline_values = []  # the response is the call's own: see CallIO.inline_values
        response = await self._run(op, io, request)
        check_reply_in_time(context)
        io.reply_made()
        return response

    method.__name__ = method.__qualname__ = op.rpc
    method.__doc__ = f"Serves {op.rpc} with ``{op.handler.__module__}.{op.rpc}``."
    return boundary.guarded(method)


for _op in OPS:
    setattr(GradServeServicer, _op.rpc, _op_rpc(_op))


class Liveness:
    """A long op's ``check_alive``, callable from a lane's thread: raises once the
    call's deadline has passed or the call has ended (its client cancelled). Called
    by the op between its steps on a lane that shares its turns (the compute lane's
    ``--compute-quantum``), it may pause the op there for another principal's
    (``lanes.pause_point``), unless the op holds what it must not pause with
    (``gradserve.pauses``)."""

    def __init__(self, context: Any, session: Session) -> None:
        remaining = context.time_remaining()
        self.deadline = None if remaining is None else time.monotonic() + remaining
        self.session = session
        self.ended = threading.Event()
        context.add_done_callback(lambda _: self.ended.set())

    def __call__(self) -> None:
        self._stop_if_over()
        if pauses.may_pause() and lanes.pause_point(self._stop_if_over):
            self._stop_if_over()

    def _stop_if_over(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise DeadlineExceededError("deadline exceeded")
        if self.ended.is_set():
            raise CancelledError("the call was cancelled")
        if self.session.closed:
            raise NotFoundError("the session was closed", reason="SESSION_NOT_FOUND")


def _call_over(io: CallIO, context: Any) -> None:
    """The call ended (its response sent, or cancelled, or past its deadline): its
    region copies go (``CallIO.end``), and so do its outputs if no response took them:
    the call was cancelled, or it ended before the handler replied (gRPC's aio server
    ends a call past its deadline with ``cancelled()`` False while the op still runs
    on its lane, which then stored outputs nobody would learn of). The undoing runs
    on a thread of the loop's default executor (``CallIO.forget_outputs``), not on a
    lane, where a full queue could refuse it."""
    if context.cancelled() or not io.replied:
        work = io.forget_outputs()
    else:  # (the large tapes its gradients spent: CallIO.reply_made)
        remaining = context.time_remaining()
        work = io.after_reply(reply_in_time=remaining is None or remaining > 0)
        if io.handed_out is not None:  # their client's patience counts from now
            io.session.replied(io.handed_out)
    io.end()
    if work is not None:
        future = asyncio.get_running_loop().run_in_executor(None, work)
        future.add_done_callback(_log_failed_undo)


def _log_failed_undo(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error(
            "undoing a call whose response was lost (or freeing the tapes it spent) failed",
            exc_info=future.exception(),
        )


def _tapes(session: Session, metadata: dict[str, str]) -> list[Tape]:
    """The live tapes the call records on (``x-gradserve-tape``): ids of started
    tapes, or ``+ID.PW`` to start tape ID if it does not exist yet (P, W: 1 or 0 for
    persistent and watch_accessed_variables), so a tape costs no round trip."""
    raw = metadata.get(protocol.TAPE_METADATA_KEY)
    if not raw:
        return []
    entries = list(dict.fromkeys(t for t in raw.split(",") if t))
    if len(entries) > MAX_TAPES_PER_SESSION:
        raise InvalidArgumentError(
            f"'{protocol.TAPE_METADATA_KEY}' names {len(entries)} tapes; a session has at "
            f"most {MAX_TAPES_PER_SESSION}",
            field=protocol.TAPE_METADATA_KEY,
        )
    tapes = []
    for entry in entries:
        if not entry.startswith("+"):
            tapes.append(session.tape(entry))
            continue
        tape_id, _, flags = entry[1:].partition(".")
        if len(flags) != 2 or set(flags) - {"0", "1"}:
            raise InvalidArgumentError(
                f"'{protocol.TAPE_METADATA_KEY}' entry {entry[:80]!r}: expected +ID.PW with "
                "P and W each 0 or 1",
                field=protocol.TAPE_METADATA_KEY,
            )
        tapes.append(
            session.start_tape(
                tape_id=tape_id,
                persistent=flags[0] == "1",
                watch_accessed_variables=flags[1] == "1",
            )
        )
    return tapes


def _proposed_ids(metadata: dict[str, str]) -> set[str]:
    """The ids the call's tape header proposes ("+ID.PW" entries)."""
    raw = metadata.get(protocol.TAPE_METADATA_KEY) or ""
    return {t[1:].partition(".")[0] for t in raw.split(",") if t.startswith("+")}
