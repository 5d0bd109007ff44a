"""Admission and scheduling: which calls run, where, and when the server drains.

The server is asyncio (``grpc.aio``): a call that waits — for a slow client's next
chunk, a compute slot, the network — is a suspended coroutine, not a thread. Work
that computes runs off the event loop on one of two bounded lanes:

- ``light``: small ops (TensorArray ops, StopGradient, tensor copies), ``--workers``
  threads;
- ``compute``: heavy ops (LSTM), ``--compute-slots`` threads, at most
  ``--max-queued-compute`` calls waiting; past that RESOURCE_EXHAUSTED at once.

Health and reflection never pass through either lane, so they answer while every
lane is busy. ``Admission`` counts the calls in flight (``--max-concurrent-rpcs``,
health excluded) and refuses every new call with UNAVAILABLE once the server
drains, before it does anything: a call the SDK may safely repeat goes elsewhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gradserve.errors import DRAINING_REASON, ResourceExhaustedError, UnavailableError

T = TypeVar("T")


class Lane:
    """A bounded thread pool that coroutines hand blocking work to.

    The work runs in a copy of the caller's context (request id, principal). If the
    calling coroutine is cancelled (its client went away) the work still finishes —
    it checks the call's liveness between steps — and the lane counts it as busy until
    it does, so a lane never runs more than its threads.
    """

    def __init__(self, name: str, threads: int, max_waiting: int | None = None) -> None:
        self.name = name
        self.threads = max(1, threads)
        self.max_waiting = max_waiting
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.threads, thread_name_prefix=f"gradserve-{name}"
        )
        self._slots: asyncio.Semaphore | None = None
        self.waiting = 0
        #: Work running on the lane's threads now (a call its client left included).
        self.running = 0

    async def run(self, fn: Callable[[], T]) -> T:
        slots = self._semaphore()
        if slots.locked() and self.max_waiting is not None and self.waiting >= self.max_waiting:
            raise ResourceExhaustedError(
                f"compute queue full: {self.threads} ops computing and {self.waiting} "
                f"waiting (limit {self.max_waiting} waiting, --max-queued-compute); retry later",
                reason="COMPUTE_QUEUE_FULL",
            )
        self.waiting += 1
        try:
            await slots.acquire()
        finally:
            self.waiting -= 1
        context = contextvars.copy_context()
        future = asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(context.run, fn)
        )
        self.running += 1
        future.add_done_callback(self._finished)
        return await asyncio.shield(future)

    def _finished(self, future: asyncio.Future[Any]) -> None:
        """Free the slot; read the outcome, which nobody awaits if the caller went
        away."""
        self.running -= 1
        self._semaphore().release()
        if not future.cancelled():
            future.exception()

    def _semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:  # made on first use, inside the server's loop
            self._slots = asyncio.Semaphore(self.threads)
        return self._slots

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class Admission:
    """Calls in flight, their limits, and draining. Used from the event loop only.

    Unary calls count against ``max_calls`` (``--max-concurrent-rpcs``). Streams
    (PutTensor, GetTensor) count apart, against ``max_streams`` and
    ``max_streams_per_principal``: a stalled stream costs no thread but holds a call,
    so streams — however many stall — never take the slots of small calls, and one
    principal's streams never take all of another's.
    """

    #: A drain waits for this long after the last call it admitted before it stops the
    #: server: calls gRPC has received but not yet handed over are refused, not
    #: cancelled. Clients that keep calling (a worker repeating DRAINING refusals
    #: through a proxy) can still land a call in gRPC core's queue as it stops, which
    #: core ends CANCELLED (grpc/grpc#41785); the SDK counts that as UNAVAILABLE.
    QUIET_SECONDS = 0.25

    def __init__(
        self,
        max_calls: int | None,
        max_streams: int | None = None,
        max_streams_per_principal: int | None = None,
    ) -> None:
        self.max_calls = max_calls
        self.max_streams = max_streams
        self.max_streams_per_principal = max_streams_per_principal
        self.in_flight = 0
        self.streams = 0
        self._streams_of: dict[str, int] = {}
        self.draining = False
        self._last_arrival = 0.0
        self._idle: asyncio.Event | None = None

    def enter(self, principal: str, *, stream: bool = False) -> None:
        """Admit a call, or refuse it (changing nothing)."""
        if self.draining:
            raise UnavailableError(
                "the server is shutting down: call another replica (or retry)",
                reason=DRAINING_REASON,
            )
        if stream:
            owned = self._streams_of.get(principal, 0)
            if self.max_streams is not None and self.streams >= self.max_streams:
                raise ResourceExhaustedError(
                    f"{self.streams} streams open, the server's limit (--max-streams); retry later",
                    reason="TOO_MANY_STREAMS",
                )
            limit = self.max_streams_per_principal
            if limit is not None and owned >= limit:
                raise ResourceExhaustedError(
                    f"principal {principal!r} has {owned} streams open, its limit "
                    "(--max-streams-per-principal); retry later",
                    reason="TOO_MANY_STREAMS_FOR_PRINCIPAL",
                )
            self.streams += 1
            self._streams_of[principal] = owned + 1
        else:
            if self.max_calls is not None and self.in_flight - self.streams >= self.max_calls:
                raise ResourceExhaustedError(
                    f"{self.in_flight - self.streams} calls in flight, the server's limit "
                    "(--max-concurrent-rpcs); retry later",
                    reason="TOO_MANY_CALLS",
                )
        self.in_flight += 1
        self._last_arrival = time.monotonic()
        self._event().clear()

    def exit(self, principal: str, *, stream: bool = False) -> None:
        if stream:
            self.streams -= 1
            left = self._streams_of[principal] - 1
            if left:
                self._streams_of[principal] = left
            else:
                del self._streams_of[principal]
        self.in_flight -= 1
        if self.in_flight == 0:
            self._event().set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new calls; wait up to ``timeout`` s for those in flight to finish and
        for ``QUIET_SECONDS`` without a new arrival. Returns True when none is left."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self.in_flight == 0
            if self.in_flight:
                try:
                    await asyncio.wait_for(self._event().wait(), left)
                except TimeoutError:
                    return False
                continue
            quiet = time.monotonic() - self._last_arrival
            if quiet >= self.QUIET_SECONDS:
                return True
            await asyncio.sleep(min(self.QUIET_SECONDS - quiet, left))

    def _event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            self._idle.set()
        return self._idle
