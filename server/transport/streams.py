"""Limits on streams, so that a slow or stalled client holds nothing for long.

A stream (PutTensor's chunks in, GetTensor's chunks out) ends when

- no chunk moves for ``idle_timeout`` seconds: DEADLINE_EXCEEDED;
- after ``rate_grace`` seconds it has moved fewer than ``min_rate`` bytes per second
  on average: RESOURCE_EXHAUSTED (a trickle that never stalls is as costly);
- its session is closed or expires: NOT_FOUND.

In each case what the stream reserved is released (the session's reservation, or
the read it holds open).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from gradserve.errors import DeadlineExceededError, NotFoundError, ResourceExhaustedError
from gradserve.server.core.sessions import Session

T = TypeVar("T")

#: How often a waiting stream looks whether its session is still open.
_POLL_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class StreamLimits:
    #: Seconds without a chunk before the stream ends (None: never).
    idle_timeout: float | None = 30.0
    #: Bytes per second a stream must average once ``rate_grace`` has passed (None: any).
    min_rate: float | None = 256 * 1024
    rate_grace: float = 10.0


class Pace:
    """One stream's progress against its limits."""

    def __init__(self, limits: StreamLimits, session: Session, what: str) -> None:
        self.limits = limits
        self.session = session
        self.what = what
        self.started = time.monotonic()
        self.moved = 0

    async def wait(self, step: Awaitable[T]) -> T:
        """``step`` (the next chunk read or written), within the idle timeout, while
        the session stays open; raises otherwise (``step`` is left to end with the
        call)."""
        task = asyncio.ensure_future(step)
        idle = self.limits.idle_timeout
        deadline = None if idle is None else time.monotonic() + idle
        try:
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
                if self.session.closed:
                    raise NotFoundError(
                        f"{self.what}: the session was closed", reason="SESSION_NOT_FOUND"
                    )
        finally:
            if not task.done():
                # Not cancelled: a write cancelled half-way leaves the call unable to
                # send its status. The call's end completes it; its outcome is moot.
                task.add_done_callback(_discard)

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


def _discard(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def next_item(iterator: AsyncIterator[T]) -> T:
    """``anext`` that returns a sentinel at the end instead of raising."""
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return END


END: Any = object()
