"""Lanes: the bounded thread pools that coroutines hand blocking work to, shared
fairly between principals.

A lane runs at most ``threads`` jobs at once. Work that finds no free thread waits
in a queue of its principal's (the caller's ``current_principal``), and a thread that
frees goes to the waiting principal with the fewest jobs running on the lane, ties to
the one served longest ago: a tenant that floods a lane delays another tenant's next
call by one job, not by its whole backlog (a single FIFO queue made a 4-float
TensorArray write wait 590 ms behind another principal's 64 MiB gathers).

Two more rules keep one principal from taking a lane whole:

- ``max_waiting`` (the compute lane's ``--max-queued-compute``): when the queue is
  full, a call of a principal with fewer waiting calls than the principal with the
  most takes the latter's newest place, whose call is refused with
  RESOURCE_EXHAUSTED before its op computed anything (earlier steps of a Batch stay
  done, as with any failed step). Otherwise the new call is refused. One principal
  alone may still fill the whole queue.
- ``reserve_last_thread`` (the light lane, with several principals): the last free thread
  goes only to a principal with nothing running on the lane, so a flood of slow light
  ops never makes another principal's small op wait for one of them to end.
- ``max_per_principal`` (the light lane, with several principals): the jobs one
  principal runs at once. A thread given is not all a small op needs: it contends
  for the cores and the GIL with every job running. On 2 cores, a's 32 client threads
  of 64 MiB gathers took b's 4-float write from 1.1 ms to 143 ms at a median with 15
  of a's gathers running, 29 ms with 8 and 7 ms with 4, while a's own rate moved
  from 77 to 74 gathers/s (``tests/benchmarks/bench_hostile.py``, section fairness).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from gradserve.errors import ResourceExhaustedError
from gradserve.server.transport.auth import current_principal

T = TypeVar("T")

QUEUE_FULL_REASON = "COMPUTE_QUEUE_FULL"


class Lane:
    """A bounded thread pool, fair between principals. Used from the event loop only.

    The work runs in a copy of the caller's context (request id, principal). If the
    calling coroutine is cancelled (its client went away) the work still finishes —
    it checks the call's liveness between steps — and the lane counts it as busy until
    it does, so a lane never runs more than its threads.
    """

    def __init__(
        self,
        name: str,
        threads: int,
        max_waiting: int | None = None,
        *,
        reserve_last_thread: bool = False,
        max_per_principal: int | None = None,
    ) -> None:
        self.name = name
        self.threads = max(1, threads)
        self.max_waiting = max_waiting
        self._reserve = 1 if reserve_last_thread and self.threads > 1 else 0
        #: Jobs one principal may run at once (None: as many as there are threads).
        self.max_per_principal = max_per_principal
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.threads, thread_name_prefix=f"gradserve-{name}"
        )
        #: Threads not given to a job (a job given one and not yet started holds it).
        self.free = self.threads
        #: Jobs waiting for a thread, all principals.
        self.waiting = 0
        #: Work running on the lane's threads now (a call its client left included).
        self.running = 0
        self._holding: dict[str, int] = {}
        self._queues: dict[str, collections.deque[asyncio.Future[None]]] = {}
        #: When each principal was last given a thread (principals are the token
        #: file's, so this stays small).
        self._served_at: dict[str, int] = {}
        self._grants = 0

    async def run(self, fn: Callable[[], T], principal: str | None = None) -> T:
        """Run ``fn`` on a thread of the lane once the caller's turn comes."""
        who = current_principal.get() if principal is None else principal
        if self._may_take(who):
            self._take(who)
        else:
            await self._wait_turn(who)
        try:
            context = contextvars.copy_context()
            future = asyncio.get_running_loop().run_in_executor(
                self._executor, functools.partial(context.run, fn)
            )
        except BaseException:
            self._give_back(who)
            raise
        self.running += 1
        future.add_done_callback(functools.partial(self._finished, who))
        return await asyncio.shield(future)

    def holding(self, principal: str) -> int:
        """Threads ``principal``'s jobs hold now."""
        return self._holding.get(principal, 0)

    def waiting_of(self, principal: str) -> int:
        """Jobs of ``principal`` waiting for a thread."""
        return len(self._queues.get(principal, ()))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- turns

    async def _wait_turn(self, who: str) -> None:
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            self._make_room(who)
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(who, collections.deque()).append(ticket)
        self.waiting += 1
        try:
            await ticket
        except BaseException:
            if ticket.cancelled() or not ticket.done():
                self._forget(who, ticket)  # cancelled while waiting
            elif ticket.exception() is None:
                self._give_back(who)  # given a thread, then cancelled before it ran
            raise

    def _make_room(self, who: str) -> None:
        """Free a place in a full queue for ``who``, or refuse it."""
        mine = self.waiting_of(who)
        fullest = max(self._queues, key=self.waiting_of, default=None)
        if fullest is None or fullest == who or mine + 1 >= self.waiting_of(fullest):
            raise ResourceExhaustedError(
                f"compute queue full: {self.threads - self.free} ops computing and "
                f"{self.waiting} waiting (limit {self.max_waiting} waiting, "
                "--max-queued-compute); retry later",
                reason=QUEUE_FULL_REASON,
            )
        queue = self._queues[fullest]
        evicted = queue.pop()
        self._count_out(fullest)
        if not evicted.done():
            evicted.set_exception(
                ResourceExhaustedError(
                    f"compute queue full: this call's place went to another principal's "
                    f"(principal {fullest!r} had {len(queue) + 1} of the "
                    f"{self.max_waiting} places, --max-queued-compute); retry later",
                    reason=QUEUE_FULL_REASON,
                )
            )

    def _may_take(self, who: str) -> bool:
        held = self.holding(who)
        if self.max_per_principal is not None and held >= self.max_per_principal:
            return False
        return self.free > self._reserve or (self.free > 0 and held == 0)

    def _take(self, who: str) -> None:
        self.free -= 1
        self._holding[who] = self.holding(who) + 1
        self._served_at[who] = self._grants
        self._grants += 1

    def _give_back(self, who: str) -> None:
        """Free ``who``'s thread and hand the free threads to the next in turn."""
        self.free += 1
        left = self._holding[who] - 1
        if left:
            self._holding[who] = left
        else:
            del self._holding[who]
        self._hand_out()

    def _hand_out(self) -> None:
        while self.free:
            ready = [p for p in self._queues if self._may_take(p)]
            if not ready:
                return
            turn = min(ready, key=lambda p: (self.holding(p), self._served_at.get(p, -1)))
            ticket = self._queues[turn].popleft()
            self._count_out(turn)
            if ticket.done():  # cancelled; its waiter has not yet run to forget it
                continue
            self._take(turn)
            ticket.set_result(None)

    def _forget(self, who: str, ticket: asyncio.Future[None]) -> None:
        queue = self._queues.get(who)
        if queue is not None and ticket in queue:
            queue.remove(ticket)
            self._count_out(who)

    def _count_out(self, who: str) -> None:
        """One ticket of ``who`` left its queue."""
        self.waiting -= 1
        if not self._queues[who]:
            del self._queues[who]

    def _finished(self, who: str, future: asyncio.Future[Any]) -> None:
        """Free the thread; read the outcome, which nobody awaits if the caller went
        away."""
        self.running -= 1
        self._give_back(who)
        if not future.cancelled():
            future.exception()
