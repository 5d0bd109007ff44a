"""Memory budgets: bytes held per session and per server.

``MemoryBudget`` counts bytes held (resident tensors, TensorArray values,
tensors still arriving) against a limit, nested: session -> principal ->
server. A session's reservation is also one of its principal's and of the
server's, so one check covers "bytes per session", "bytes per principal" (one
tenant cannot starve the others) and "bytes for the whole server". A
reservation that would pass any limit raises RESOURCE_EXHAUSTED naming the
limit and changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gradserve.errors import ResourceExhaustedError


class MemoryBudget:
    """Bytes held against ``limit`` (None: unlimited), inside an optional parent."""

    def __init__(
        self,
        limit: int | None,
        what: str,
        parent: MemoryBudget | None = None,
        *,
        on_release: Callable[[int], None] | None = None,
    ):
        self.limit = limit
        self.what = what
        self.parent = parent
        #: Told of every release (the server's budget: to return memory to the OS).
        self.on_release = on_release
        #: Asked, once, when a reservation is refused here or above, to free what it
        #: can of ``nbytes`` that nobody needs any more (a session's outputs its client
        #: has read out already); returns whether it freed anything, and the
        #: reservation is tried again. It must never wait for a lock: reservations
        #: are made under the caller's locks.
        self.reclaim: Callable[[int], bool] | None = None
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` more, or raise (changing nothing) if a limit would pass
        once ``reclaim`` freed what it could."""
        if nbytes < 0:
            raise ValueError(f"reserve({nbytes}): a negative reservation (use adjust)")
        if nbytes == 0:
            return
        try:
            self._reserve(nbytes)
        except ResourceExhaustedError:
            if self.reclaim is None or not self.reclaim(nbytes):
                raise
            self._reserve(nbytes)

    def _reserve(self, nbytes: int) -> None:
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
        if self.on_release is not None:
            self.on_release(nbytes)

    def adjust(self, delta: int) -> None:
        """Reserve a positive delta, release a negative one."""
        if delta > 0:
            self.reserve(delta)
        else:
            self.release(-delta)
