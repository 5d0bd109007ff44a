"""Resource limits: memory budgets and the compute gate.

``MemoryBudget`` counts bytes held (resident tensors, TensorArray values)
against a limit, nested: a session's budget reserves in the server's too, so
one check covers "bytes per session" and "bytes for the whole server". A
reservation that would pass either limit raises RESOURCE_EXHAUSTED naming the
limit and changes nothing.

``ComputeGate`` bounds how many heavy ops (LSTM) compute at once and how many
may wait; past that a call is refused with RESOURCE_EXHAUSTED instead of
queueing without bound.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from gradserve.errors import ResourceExhaustedError


class MemoryBudget:
    """Bytes held against ``limit`` (None: unlimited), inside an optional parent."""

    def __init__(self, limit: int | None, what: str, parent: MemoryBudget | None = None):
        self.limit = limit
        self.what = what
        self.parent = parent
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` more, or raise (changing nothing) if a limit would pass."""
        if nbytes <= 0:
            self.release(-nbytes)
            return
        with self._lock:
            if self.limit is not None and self._used + nbytes > self.limit:
                raise ResourceExhaustedError(
                    f"{self.what}: holding {nbytes} more bytes would pass the limit of "
                    f"{self.limit} bytes ({self._used} held)",
                    reason="MEMORY_LIMIT",
                )
            if self.parent is not None:
                self.parent.reserve(nbytes)
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            nbytes = min(nbytes, self._used)
            self._used -= nbytes
        if self.parent is not None:
            self.parent.release(nbytes)

    def adjust(self, delta: int) -> None:
        """Reserve a positive delta, release a negative one."""
        if delta > 0:
            self.reserve(delta)
        else:
            self.release(-delta)


class ComputeGate:
    """At most ``slots`` heavy ops at once and ``max_waiting`` queued behind them."""

    def __init__(self, slots: int, max_waiting: int) -> None:
        self.slots = max(1, slots)
        self.max_waiting = max(0, max_waiting)
        self._cond = threading.Condition()
        self._running = 0
        self._waiting = 0

    @contextlib.contextmanager
    def slot(self, is_alive: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Hold a compute slot for the body; ``is_alive`` may raise while waiting."""
        with self._cond:
            if self._running >= self.slots:
                if self._waiting >= self.max_waiting:
                    raise ResourceExhaustedError(
                        f"compute queue full: {self._running} ops computing and "
                        f"{self._waiting} waiting (limit {self.max_waiting} waiting); "
                        "retry later",
                        reason="COMPUTE_QUEUE_FULL",
                    )
                self._waiting += 1
                try:
                    while self._running >= self.slots:
                        self._cond.wait(0.05)
                        is_alive()
                finally:
                    self._waiting -= 1
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify()
