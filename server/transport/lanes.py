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

And one so that a long op does not hold a thread for as long as it runs:

- ``quantum`` (the compute lane's ``--compute-quantum``): a job that has computed that
  long since its turn began, and finds another principal waiting, *pauses* at its
  next check (``gradserve.pauses``): it gives its thread's turn to the next in turn
  and blocks until its own comes again, ahead of its principal's new calls. An LSTM
  of 300,000 steps held the only compute slot for 8.5 s while another tenant's small
  one waited (a review helper). A paused job still occupies its executor thread, so
  the lane's executor has ``max_paused`` threads more than turns, and ``running``
  counts paused jobs too (the jobs computing are never more than ``threads``). At
  most one job per principal is paused, so a principal never starts a new job while
  one of its own is paused, and no job waits for a slot held by a job that waits for
  a lock the paused one holds; with ``max_paused`` paused (the server's: one per
  principal of its token file) a job pauses only if the turn goes to a paused one.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gradserve import pauses
from gradserve.errors import CancelledError, ResourceExhaustedError
from gradserve.server.transport.auth import current_principal

T = TypeVar("T")

QUEUE_FULL_REASON = "COMPUTE_QUEUE_FULL"

#: A paused job looks this often whether it should stop (its deadline, its client).
PAUSED_POLL_SECONDS = 0.02


class _Job:
    """One ``Lane.run`` call's work, as its thread and the loop see it (made for every
    call of a lane: plain slots, and its event only once it asks to pause)."""

    __slots__ = ("lane", "who", "loop", "holds", "since", "thread", "since_paused",
                 "declined", "resumed")  # fmt: skip

    def __init__(self, lane: Lane, who: str, loop: asyncio.AbstractEventLoop) -> None:
        self.lane = lane
        self.who = who
        self.loop = loop
        #: Whether it holds one of the lane's turns (False while paused).
        self.holds = True
        #: When it last began or resumed computing (its thread's monotonic clock).
        self.since = 0.0
        #: The thread computing it (a check on any other thread never pauses it).
        self.thread: int | None = None
        #: The lane's grant count when it last paused.
        self.since_paused = -1
        #: Whether the loop declined its last request to pause (it computed on).
        self.declined = False
        #: Set by the loop when a pause ends (its turn came again, or it did not pause).
        self.resumed: threading.Event | None = None


_current_job: contextvars.ContextVar[_Job | None] = contextvars.ContextVar(
    "gradserve_lane_job", default=None
)


def pause_point(still_wanted: Callable[[], None]) -> bool:
    """Called by a job's check between its steps: pause the job if its lane wants
    its turn for another principal (``Lane`` docstring). ``still_wanted`` raises once
    the job should stop; a paused job calls it while it waits, and the pause then
    ends by raising that. Returns whether the job paused."""
    job = _current_job.get()
    return job is not None and job.lane._maybe_pause(job, still_wanted)


class Lane:
    """A bounded thread pool, fair between principals. Used from the event loop only.

    The work runs in a copy of the caller's context (request id, principal). If the
    calling coroutine is cancelled (its client went away) the work still finishes —
    it checks the call's liveness between steps — and the lane counts it as busy until
    it does, so a lane never computes more jobs than its threads.
    """

    def __init__(
        self,
        name: str,
        threads: int,
        max_waiting: int | None = None,
        *,
        reserve_last_thread: bool = False,
        max_per_principal: int | None = None,
        quantum: float | None = None,
        max_paused: int | None = None,
    ) -> None:
        self.name = name
        self.threads = max(1, threads)
        self.max_waiting = max_waiting
        self._reserve = 1 if reserve_last_thread and self.threads > 1 else 0
        #: Jobs one principal may run at once (None: as many as there are threads).
        self.max_per_principal = max_per_principal
        #: Seconds a job computes before it pauses for another principal (None: never).
        self.quantum = quantum if quantum is None or quantum > 0 else None
        #: Jobs paused at once, beyond which a job pauses only for a paused one (their
        #: threads are the executor's extra ones; default: two per thread).
        if self.quantum is None:
            self.max_paused = 0
        else:
            self.max_paused = 2 * self.threads if max_paused is None else max(0, max_paused)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.threads + self.max_paused, thread_name_prefix=f"gradserve-{name}"
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
        #: Jobs paused now, by principal (one each at most), waiting for their turn.
        self._paused: dict[str, _Job] = {}
        #: Pauses so far (a job that took its turn straight back not counted).
        self.pauses_total = 0
        #: Principals with a job waiting or paused: a snapshot the jobs' threads read.
        self._waiting_principals: frozenset[str] = frozenset()
        self._closing = False

    async def run(self, fn: Callable[[], T], principal: str | None = None) -> T:
        """Run ``fn`` on a thread of the lane once the caller's turn comes."""
        who = current_principal.get() if principal is None else principal
        if self._may_take(who):
            self._take(who)
        else:
            await self._wait_turn(who)
        loop = asyncio.get_running_loop()
        job = _Job(self, who, loop)
        try:
            context = contextvars.copy_context()
            future = loop.run_in_executor(
                self._executor, functools.partial(context.run, _as_job, job, fn)
            )
        except BaseException:
            self._give_back(who)
            raise
        self.running += 1
        future.add_done_callback(functools.partial(self._finished, job))
        return await asyncio.shield(future)

    @property
    def paused(self) -> int:
        """Jobs paused now for another principal's turn."""
        return len(self._paused)

    def holding(self, principal: str) -> int:
        """Threads ``principal``'s jobs hold now."""
        return self._holding.get(principal, 0)

    def waiting_of(self, principal: str) -> int:
        """Jobs of ``principal`` waiting for a thread."""
        return len(self._queues.get(principal, ()))

    def shutdown(self) -> None:
        self._closing = True  # (paused jobs end: CancelledError)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- pauses (a job's thread asks; the loop decides)

    def _maybe_pause(self, job: _Job, still_wanted: Callable[[], None]) -> bool:
        """On ``job``'s thread: pause it if it has had its quantum and another
        principal waits; return when its turn comes again."""
        if (
            self.quantum is None
            or job.thread != threading.get_ident()
            or time.monotonic() - job.since < self.quantum
            or not self._waiting_principals - {job.who}
        ):
            return False
        resumed = job.resumed = threading.Event()
        job.declined = False
        with pauses.paused():  # (what the op lends while it waits: its BLAS share)
            try:
                job.loop.call_soon_threadsafe(self._pause, job)
            except RuntimeError:  # the loop is closed: the server is stopping
                return False
            while not resumed.wait(PAUSED_POLL_SECONDS):
                try:
                    if self._closing:
                        raise CancelledError("the server is stopping")
                    still_wanted()
                except BaseException:
                    # (before the job's end reaches the loop: the loop runs both in order)
                    with contextlib.suppress(RuntimeError):  # (a closed loop)
                        job.loop.call_soon_threadsafe(self._give_up, job)
                    raise
        job.since = time.monotonic()
        return not job.declined

    def _pause(self, job: _Job) -> None:
        """On the loop: give ``job``'s turn to the next in turn, unless nobody else
        waits now, or its principal has a job paused already, or the next in turn is
        nobody or ``job`` itself (then it computes on). With ``max_paused`` jobs paused
        already, the turn goes to the paused job next in turn."""
        others = self._waiting_principals - {job.who}
        if not others or job.who in self._paused:
            self._decline(job)
            return
        # Queued before the turn is given back: the job comes before its principal's
        # new calls, and takes its turn straight back if it is still the next in turn.
        job.holds = False
        job.since_paused = self._grants
        self._paused[job.who] = job
        self._release(job.who)
        # At the limit only paused jobs take turns (each its quantum): a job that could
        # not pause once two were paused ran to its end, over and over, while they had
        # a quantum each (helper-81: 14 ops against 2); calls not begun wait for an end.
        at_limit = len(self._paused) > self.max_paused
        turn = self._next_turn(paused_only=at_limit)
        if turn is None or turn == job.who:  # (nobody else may take it: helper-82, a
            del self._paused[job.who]  # thread left idle; or it would go on: no pause)
            self.free -= 1
            self._holding[job.who] = self.holding(job.who) + 1
            job.holds = True
            self._decline(job)
            return
        self._note_waiting()
        if at_limit:
            self._resume(turn)
        else:
            self._hand_out()

    @staticmethod
    def _decline(job: _Job) -> None:
        job.declined = True
        _wake(job)

    def _give_up(self, job: _Job) -> None:
        """On the loop: a paused job stops waiting (its deadline passed, its client
        went, the server stops). Given its turn meanwhile, it gives it back when it
        ends (``_finished``)."""
        if self._paused.get(job.who) is job:
            del self._paused[job.who]
            self._note_waiting()

    # --- turns

    async def _wait_turn(self, who: str) -> None:
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            self._make_room(who)
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(who, collections.deque()).append(ticket)
        self.waiting += 1
        self._note_waiting()
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
        self._release(who)
        self._hand_out()

    def _release(self, who: str) -> None:
        self.free += 1
        left = self._holding[who] - 1
        if left:
            self._holding[who] = left
        else:
            del self._holding[who]

    def _next_turn(self, paused_only: bool = False) -> str | None:
        """The principal a free thread goes to now (None: none may take it); of those
        with a job paused only, if ``paused_only``."""
        if paused_only:
            waiting = list(self._paused)
        else:
            waiting = [*self._queues, *(p for p in self._paused if p not in self._queues)]
        ready = [p for p in waiting if self._may_take(p)]
        if not ready:
            return None
        return min(ready, key=lambda p: (self.holding(p), self._served_at.get(p, -1)))

    def _hand_out(self) -> None:
        while self.free:
            turn = self._next_turn()
            if turn is None:
                return
            if turn in self._paused:  # before any new call of its principal
                self._resume(turn)
                continue
            ticket = self._queues[turn].popleft()
            self._count_out(turn)
            if ticket.done():  # cancelled; its waiter has not yet run to forget it
                continue
            self._take(turn)
            ticket.set_result(None)

    def _resume(self, who: str) -> None:
        """Give a free thread's turn to ``who``'s paused job."""
        paused = self._paused.pop(who)
        self._note_waiting()
        if paused.since_paused != self._grants:
            self.pauses_total += 1  # (another job ran meanwhile)
        self._take(who)
        paused.holds = True
        _wake(paused)

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
        self._note_waiting()

    def _note_waiting(self) -> None:
        """Renew the snapshot of who waits (read by jobs' threads without a lock)."""
        self._waiting_principals = frozenset(self._queues.keys() | self._paused.keys())

    def _finished(self, job: _Job, future: asyncio.Future[Any]) -> None:
        """Free the thread; read the outcome, which nobody awaits if the caller went
        away."""
        self.running -= 1
        if job.holds:  # (a job that gave up while paused holds no turn)
            self._give_back(job.who)
        if not future.cancelled():
            future.exception()


def _wake(job: _Job) -> None:
    """End ``job``'s pause (or its request to pause)."""
    assert job.resumed is not None  # (made before the request reached the loop)
    job.resumed.set()


def _as_job(job: _Job, fn: Callable[[], T]) -> T:
    """Run ``fn`` on this thread as ``job`` (in the call's context copy)."""
    job.thread = threading.get_ident()
    job.since = time.monotonic()
    _current_job.set(job)
    return fn()
