"""What a group of RPCs defined apart from ``servicer.py`` may use of the servicer.

``GradServeServicer`` is assembled from such groups (``shm_handlers``,
``tensor_handlers``); each inherits this, so the attributes and the session lookup
it relies on are declared once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from gradserve import protocol
from gradserve.errors import DeadlineExceededError, GradserveError, InvalidArgumentError
from gradserve.server.core.sessions import Session


class ServicerPart:
    """Provided by ``GradServeServicer``."""

    light: Any
    compute: Any
    max_message_bytes: int
    #: ``--max-inline-reply-bytes`` (None: the message limit alone).
    max_inline_reply_bytes: int | None

    def _session(self, context: Any) -> Session:  # pragma: no cover - the servicer's
        raise NotImplementedError

    def response_budget(self, client_budget: int | None) -> int:
        """The bytes one reply may grow by: what the message limit leaves, within the
        client's ``x-gradserve-response-budget``."""
        budget = self.max_message_bytes - protocol.MESSAGE_OVERHEAD_BYTES
        if client_budget is not None:
            budget = min(budget, client_budget)
        return max(0, budget)

    def reply_budget(self, client_budget: int | None) -> int:
        """The tensor bytes one reply may carry inline: ``response_budget`` within the
        server's ``--max-inline-reply-bytes``. Outputs beyond go as transient tensors,
        which the SDK streams: a reply's bytes are copied into gRPC holding Python's
        lock, and a client pulling 128 MiB replies held every other call of the server
        (another session's KeepAlive: p90 150-380 ms, 3 ms with the same bytes
        streamed; ``make bench``, bench_hostile section 8, replies)."""
        budget = self.response_budget(client_budget)
        if self.max_inline_reply_bytes is not None:
            budget = min(budget, self.max_inline_reply_bytes)
        return max(0, budget)


def text_metadata(context: Any) -> dict[str, str]:
    """The call's text metadata."""
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


def int_metadata(metadata: dict[str, str], key: str) -> int | None:
    """An integer header (None where absent); INVALID_ARGUMENT where malformed, in
    every RPC alike (GetTensorInline ignored a malformed response budget that an op's
    call refused)."""
    raw = metadata.get(key)
    try:
        return int(raw) if raw else None
    except ValueError:
        raise InvalidArgumentError(f"'{key}' must be an integer, got {raw!r}") from None


def check_reply_in_time(context: Any) -> None:
    """Raise ``DeadlineExceededError`` if the call's deadline has passed: a response
    returned now reaches no client, whose own deadline (earlier than the server's by
    the request's transit) passed first. The handler fails instead of replying, so
    the call's end deletes what it stored for that response. A reply counted as
    delivered after the deadline kept, charged until the session closed, the
    outputs of every step a Batch ran before its deadline check stopped it (it
    became a failed step of a normal reply; gRPC's aio server does not count a call
    past its deadline as cancelled), and a put's tensor (found by a review helper).
    One sent just before the deadline may still arrive after the client's: the
    server cannot know, and keeps it rather than lose a result the client got."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceededError("deadline exceeded")


class ReadOut:
    """A get of the tensor ``request.id`` (GetTensor, GetTensorInline, GetSharedTensor),
    made when the call begins; the getter's side of ``ForgottenUnlessReplied``.

    While the call lasts, the outputs of the reply that handed the tensor out do not
    age (``Session.being_read``: the call, not the handler's reading, since a slow
    client takes the last chunks from gRPC's buffers long after they were written).
    Once the handler has replied (``replied``) and the call has ended in time, not
    cancelled, the tensor counts as fetched (a drain waits no more for it:
    ``Session.fetched``) and, with ``delete_after``, is deleted. Past the deadline
    (``replied`` raises, or the sending took until then) the client got
    DEADLINE_EXCEEDED and can fetch the tensor again: deleted as the value was read,
    a reply that missed the client's deadline lost the tensor (a review helper: 71
    of 120 gets of 128 MiB, a 0.5 s deadline)."""

    def __init__(self, session: Session, request: Any, context: Any) -> None:
        self._session = session
        self._request = request
        self._context = context
        self._replied = False
        self._reading = session.being_read(request.id)
        context.add_done_callback(self._call_over)

    def replied(self) -> None:
        """The handler returns its reply; raises instead past the deadline
        (``check_reply_in_time``)."""
        check_reply_in_time(self._context)
        self._replied = True

    def _call_over(self, context: Any) -> None:
        self._reading()
        remaining = context.time_remaining()
        if not self._replied or context.cancelled() or (remaining is not None and remaining <= 0):
            return
        self._session.fetched(self._request.id)
        if self._request.delete_after:
            with contextlib.suppress(GradserveError):  # (its session closed meanwhile)
                self._session.delete([self._request.id])


class ForgottenUnlessReplied:
    """The id a unary put keeps, deleted if its response never reaches the client.

    The put runs on a lane, which finishes what it started when the call is cancelled
    or passes its deadline (``lanes.Lane.run`` shields it); the tensor it then kept
    had an id nobody would learn, its bytes charged until the session closed. As an
    op's outputs (``servicer._call_over``), it is deleted when the call ends before
    the handler replied (gRPC's aio server ends a call past its deadline with
    ``cancelled()`` False, the handler still waiting on its lane) or cancelled; or as
    the lane keeps it, if the call ended first. A handler that would reply past the
    deadline fails instead (``replied``, ``check_reply_in_time``). Used by the puts:
    PutTensorInline, PutSharedTensor and the PutTensor stream; and, with ``undone_by``,
    by the calls that make other state only their reply names (CreateSession,
    RegisterSharedMemory)."""

    def __init__(self, session: Session, context: Any) -> None:
        self._session = session
        self._context = context
        self._lock = threading.Lock()
        self._over = False
        self._replied = False
        self._ids: list[str] = []
        self._undos: list[Callable[[], object]] = []
        context.add_done_callback(self._call_over)

    def kept(self, tensor_id: str) -> str:
        """``tensor_id`` was kept (on the lane): deleted now if the call is over."""
        with self._lock:
            if not self._over:
                self._ids.append(tensor_id)
                return tensor_id
        self._session.delete([tensor_id])
        return tensor_id

    def undone_by(self, undo: Callable[[], object]) -> None:
        """The call made state its reply names: ``undo`` undoes it if the reply never
        reaches the client (now, if the call is over)."""
        with self._lock:
            if not self._over:
                self._undos.append(undo)
                return
        _quietly(undo)

    def replied(self) -> None:
        """The handler returns the response, with the id; raises instead if the
        deadline has passed (``check_reply_in_time``)."""
        check_reply_in_time(self._context)
        self._replied = True

    def _call_over(self, context: Any) -> None:
        if self._replied and not context.cancelled():
            return
        with self._lock:
            self._over = True
            ids, self._ids = self._ids, []
            undos, self._undos = self._undos, []
        self._session.delete(ids)
        for undo in undos:
            _quietly(undo)


def _quietly(undo: Callable[[], object]) -> None:
    """``undo``, where a failure has no caller to go to (the state's session may have
    closed meanwhile, which undid it anyway)."""
    with contextlib.suppress(GradserveError):
        undo()
