"""Admission control: ``ComputeGate`` bounds how many heavy ops (LSTM) compute at
once and how many may wait; past that a call is refused with RESOURCE_EXHAUSTED
instead of queueing without bound."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from gradserve.errors import ResourceExhaustedError


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
