"""Returning freed memory to the operating system.

glibc's allocator keeps the pages of freed arrays for reuse, so a server whose
sessions came and went shows the high-water mark in its RSS long after the bytes
were released — an orchestrator sees a leak. ``Trimmer`` counts released bytes
(``SessionStore``'s server budget tells it of every release, and the request
deserializer of every request message: a refused put's bytes pass no budget) and,
once at least
``threshold`` bytes were freed and then none for ``quiet_seconds``, asks glibc
to hand free pages back (``malloc_trim(0)``), on a thread of its own so no call
waits for it. Where libc is not glibc nothing is done.

Why wait for a quiet spell: a busy server frees and allocates the same sizes every
call (a training loop's kept LSTM outputs, deleted each step). Trimming between
those calls gave the pages back only for the next call to fault them in afresh:
2-3 ms of a 20 ms kept forward at (50, 32, 256). Once calls stop, the trim runs
and the RSS falls back.
"""

from __future__ import annotations

import logging
import threading
import time

from gradserve import heap

log = logging.getLogger(__name__)

#: Freed bytes that make a trim worth its few milliseconds.
DEFAULT_THRESHOLD = 16 * 1024 * 1024
#: Seconds without a release before the trim runs, and the longest a trim waits
#: for such a spell (a server never quiet still trims, this often at most).
DEFAULT_QUIET_SECONDS = 5.0
DEFAULT_MAX_WAIT_SECONDS = 60.0


class Trimmer:
    def __init__(
        self,
        threshold: int = DEFAULT_THRESHOLD,
        quiet_seconds: float = DEFAULT_QUIET_SECONDS,
        max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS,
    ) -> None:
        self.threshold = threshold
        self.quiet_seconds = quiet_seconds
        self.max_wait_seconds = max_wait_seconds
        self.trims = 0
        self._trim = heap.trim if heap.can_trim() else None
        self._lock = threading.Lock()
        self._freed = 0
        self._last_release = 0.0
        self._running = False

    def released(self, nbytes: int) -> None:
        """Count ``nbytes`` released; past the threshold, trims (in the background)
        once releases stop for ``quiet_seconds``, or after ``max_wait_seconds``."""
        if self._trim is None:
            return
        with self._lock:
            self._freed += nbytes
            self._last_release = time.monotonic()
            if self._freed < self.threshold or self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="gradserve-trim", daemon=True).start()

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_wait_seconds
        again = False
        try:
            while True:
                with self._lock:
                    due = min(self._last_release + self.quiet_seconds, deadline)
                    wait = due - time.monotonic()
                    if wait <= 0:
                        self._freed = 0
                        break
                time.sleep(wait)
            assert self._trim is not None
            self._trim()
            self.trims += 1
        finally:
            with self._lock:
                # Bytes released during the trim: their own trim, when they count.
                again = self._freed >= self.threshold
                self._running = again
        if again:
            threading.Thread(target=self._run, name="gradserve-trim", daemon=True).start()
