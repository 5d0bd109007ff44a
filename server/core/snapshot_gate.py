"""Ops that change a session in steps, against the snapshot of that session.

A TensorArray read that clears its element changes the array under the array's lock,
then keeps its output in the session under the session's lock. A snapshot
(``Session.export_state``) copies the id table under the session's lock and each
array under its own, so one taken between the two steps held neither the element
nor the output: restored after a crash, the value was gone from both, a state that
never existed (found by a review helper, with ``--snapshot-interval 0.02``).

The gate lets any number of such ops through at once, or one snapshot: a snapshot
waits until the ops inside are done, and ops wait only while a snapshot is being taken
(a copy of references), so it sees each op whole or not at all. Ops do not wait for a
snapshot that is itself waiting: each waits on a lane thread, and with every thread of
the lane held back behind one session's slow op, light ops of every session stalled
for seconds (found by a review helper: 5.3 s against 24 ms). Nothing else waits on it, and an op waiting here
holds no lock yet (``CallIO.run`` passes it first). A snapshot waits at most
``timeout`` seconds (an op that hangs must not stop the final snapshot of a drain),
and then takes the session as it is.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

#: How long a snapshot waits for the ops inside the gate (seconds).
SNAPSHOT_WAIT_SECONDS = 10.0


class SnapshotGate:
    """Ops (shared) against a snapshot (exclusive)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ops = 0
        self._snapshotting = False

    @contextlib.contextmanager
    def op(self) -> Iterator[None]:
        """An op that may change the session in several steps."""
        with self._cond:
            while self._snapshotting:
                self._cond.wait()
            self._ops += 1
        try:
            yield
        finally:
            with self._cond:
                self._ops -= 1
                if not self._ops:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def snapshot(self, timeout: float | None = None) -> Iterator[bool]:
        """A snapshot of the session; yields False if ops were still inside after
        ``timeout`` seconds (default ``SNAPSHOT_WAIT_SECONDS``; it goes on, and the
        snapshot's report says so)."""
        deadline = time.monotonic() + (SNAPSHOT_WAIT_SECONDS if timeout is None else timeout)
        with self._cond:
            while self._snapshotting or self._ops:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            whole = not self._ops
            self._snapshotting = True
        try:
            yield whole
        finally:
            with self._cond:
                self._snapshotting = False
                self._cond.notify_all()
