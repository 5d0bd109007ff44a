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
from collections.abc import Callable
from typing import TypeVar

from gradserve.errors import ResourceExhaustedError, UnavailableError

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
        future.add_done_callback(lambda _: slots.release())
        return await asyncio.shield(future)

    def _semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:  # made on first use, inside the server's loop
            self._slots = asyncio.Semaphore(self.threads)
        return self._slots

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class Admission:
    """Calls in flight, their limit, and draining. Used from the event loop only."""

    def __init__(self, max_calls: int | None) -> None:
        self.max_calls = max_calls
        self.in_flight = 0
        self.draining = False
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        """Admit a call, or refuse it (changing nothing)."""
        if self.draining:
            raise UnavailableError(
                "the server is shutting down: call another replica (or retry)",
                reason="DRAINING",
            )
        if self.max_calls is not None and self.in_flight >= self.max_calls:
            raise ResourceExhaustedError(
                f"{self.in_flight} calls in flight, the server's limit "
                "(--max-concurrent-rpcs); retry later",
                reason="TOO_MANY_CALLS",
            )
        self.in_flight += 1
        self._event().clear()

    def exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._event().set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new calls; wait up to ``timeout`` s for those in flight to finish.
        Returns True when none is left."""
        self.draining = True
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._event().wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            self._idle.set()
        return self._idle
