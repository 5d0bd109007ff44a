"""Limits on streams, so that a slow or stalled client holds nothing for long.

A stream (PutTensor's chunks in, GetTensor's chunks out) ends when

- no chunk moves for ``idle_timeout`` seconds: DEADLINE_EXCEEDED;
- after ``rate_grace`` seconds it has moved fewer than ``min_rate`` bytes per second
  on average: RESOURCE_EXHAUSTED (a trickle that never stalls is as costly);
- its session is closed or expires: NOT_FOUND;
- the server drains while it is idle: UNAVAILABLE (a stream that moves finishes).

In each case what the stream reserved is released (the session's reservation, or
the read it holds open).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from gradserve.errors import (
    DRAINING_REASON,
    DeadlineExceededError,
    GradserveError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from gradserve.server.core.sessions import Session

T = TypeVar("T")

#: How often a waiting stream looks whether its session is still open.
_POLL_SECONDS = 0.5
#: Once the server drains, a stream that waited this long for its next chunk is
#: stalled and ends (UNAVAILABLE, reason DRAINING), so that a stalled client does not
#: hold the drain for all of ``--grace``; one that moves finishes. (It was one poll:
#: a put sending a chunk every 0.7 s, well above ``--stream-min-rate``, was cut off.)
DRAIN_IDLE_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class StreamLimits:
    #: Seconds without a chunk before the stream ends (None: never).
    idle_timeout: float | None = 30.0
    #: Bytes per second a stream must average once ``rate_grace`` has passed (None: any).
    min_rate: float | None = 256 * 1024
    rate_grace: float = 10.0


class Pace:
    """One stream's progress against its limits."""

    def __init__(
        self,
        limits: StreamLimits,
        session: Session,
        what: str,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.limits = limits
        self.session = session
        self.what = what
        self.draining = draining
        self.started = time.monotonic()
        self.moved = 0

    async def wait(self, step: Awaitable[T], *, sending: bool = False) -> T:
        """``step`` (the next chunk read or written), within the idle timeout, while
        the session stays open and, once the server drains, while the stream moves;
        raises otherwise. ``step`` is never cancelled: a write cancelled half-way
        leaves the call unable to send its status; the call's end completes it.
        ``sending``: ``step`` sends a message; if it is still pending when this
        raises, the error says so (``status_stuck``)."""
        task = asyncio.ensure_future(step)
        task.add_done_callback(_discard)  # its outcome is read below, or moot
        try:
            return await self._wait(task)
        except GradserveError as error:
            if sending and not task.done():
                setattr(error, _STUCK, task)
            raise

    async def _wait(self, task: asyncio.Future[T]) -> T:
        self._check_session()
        idle = self.limits.idle_timeout
        waiting_since = time.monotonic()
        deadline = None if idle is None else waiting_since + idle
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlineExceededError(
                    f"{self.what}: no data for {idle:g} s (--stream-idle-timeout)",
                    reason="STREAM_IDLE",
                )
            timeout = _POLL_SECONDS if left is None else min(_POLL_SECONDS, left)
            done, _ = await asyncio.wait((task,), timeout=timeout)
            if done:
                return task.result()
            self._check_session()
            stalled = time.monotonic() - waiting_since >= DRAIN_IDLE_SECONDS
            if stalled and self.draining():
                raise UnavailableError(
                    f"{self.what}: the server is shutting down and this stream has moved "
                    f"nothing for {DRAIN_IDLE_SECONDS:g} s",
                    reason=DRAINING_REASON,
                )

    def _check_session(self) -> None:
        if self.session.closed:
            raise NotFoundError(f"{self.what}: the session was closed", reason="SESSION_NOT_FOUND")

    def moved_bytes(self, nbytes: int) -> None:
        """Count ``nbytes`` more; raises once the average rate is below the minimum."""
        self.moved += nbytes
        rate, grace = self.limits.min_rate, self.limits.rate_grace
        elapsed = time.monotonic() - self.started
        if rate is not None and elapsed > grace and self.moved < rate * elapsed:
            raise ResourceExhaustedError(
                f"{self.what}: {self.moved} bytes in {elapsed:.1f} s is under the minimum "
                f"rate of {rate:g} bytes/s (--stream-min-rate)",
                reason="STREAM_TOO_SLOW",
            )


_STUCK = "_gradserve_status_stuck"


def status_stuck(error: GradserveError) -> bool:
    """``error`` ended a stream whose client reads nothing: a message is still being
    sent to it, behind which gRPC cannot send a status (``context.abort`` then failed
    inside gRPC, GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, logged with a traceback per
    reader: a frozen worker, a network black hole). The boundary cancels such a call
    instead: the client would not read a status either."""
    return getattr(error, _STUCK, None) is not None


async def until_taken_or_gone(error: GradserveError, draining: Callable[[], bool]) -> None:
    """Wait while the message ``error`` left stuck (``status_stuck``) is still being
    sent: until the client takes it (then its status can follow: no longer stuck),
    or goes (gRPC cancels the call: ``CancelledError`` here), or the server drains.
    gRPC's server cannot reset the stream, and keeps the message (a chunk, up to
    1 MiB) and the call until then; returning at once, the stream left the stream
    limits while it still held that memory, and a client stalling ``--max-streams``
    readers per idle timeout grew the server without bound (a review helper: 746 MiB
    after eight rounds of 40)."""
    task = getattr(error, _STUCK, None)
    if task is None:
        return
    while not task.done() and not draining():
        await asyncio.wait((task,), timeout=_POLL_SECONDS)
    if task.done() and not task.cancelled() and task.exception() is None:
        setattr(error, _STUCK, None)


def _discard(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


#: How long a request stream that ended short of what it declared waits for its
#: cancellation. gRPC ends the handler's request stream alike when the client
#: half-closes early and when it cancels (its ``_receive_message`` merges the two),
#: and the cancellation reaches the handler a moment later, as ``CancelledError``: a
#: handler that refused the short stream at once counted a cancelled upload as the
#: client's INVALID_ARGUMENT (one clean-clone CI run in many). A client that really
#: half-closed early gets its refusal this much later.
CANCEL_SETTLE_SECONDS = 0.5


async def settle_short_stream(context: Any) -> None:
    """Before refusing a request stream that ended short: let a cancellation on its
    way arrive (``CancelledError`` here, the boundary counts it CANCELLED)."""
    if context.cancelled():
        raise asyncio.CancelledError
    await asyncio.sleep(CANCEL_SETTLE_SECONDS)
    if context.cancelled():
        raise asyncio.CancelledError


async def next_item(iterator: AsyncIterator[T]) -> T:
    """``anext`` that returns a sentinel at the end instead of raising."""
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return END


END: Any = object()
