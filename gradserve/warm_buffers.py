"""Warm host buffers for large tensors: a bounded cache of freed buffers, reused.

Why: the first write to a fresh buffer costs the kernel a page fault and a zeroed
page for every page of it. glibc hands allocations above its mmap threshold (32 MiB
at most, even kept warm: ``gradserve.heap``) back to the kernel when they are freed,
so every large tensor received paid that again: on the project's machine a 256 MiB
shared-memory read into a fresh buffer took 50 ms (79 ms split over 4 threads, whose
page faults contend) against 28 ms into a reused one. This cache keeps the buffers of
freed large tensors, as CuPy's memory pool keeps device memory, for the next tensor of
the same byte size: the common case of a training loop, which sends the same shapes
every step. The server keeps one for what it receives and computes
(``SessionStore.buffers``); the SDK one per client, for the streams it fetches.

Bounded: at most ``limit_bytes`` of free buffers are kept (least recently freed
dropped first), and ``expire_idle`` (the server's session reaper, the SDK's keep-alive
thread) drops those unused for ``idle_seconds``, so an idle process gives the memory
back (``memory.Trimmer``'s concern on the server: a high-water RSS looks like a leak to
an orchestrator).

How a buffer comes back: every array handed out is a view of an owner array (a
subclass, so NumPy does not collapse views past it onto the buffer), whose
finalizer queues the buffer once the last view is gone. The queue is a deque, so
a finalizer that runs while this cache holds its lock (a garbage collection in
there) appends without taking the lock: no deadlock.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

#: Buffers below this size are not cached: glibc's heap keeps those warm already.
MIN_BYTES = 4 << 20
DEFAULT_LIMIT_BYTES = 1 << 30
DEFAULT_IDLE_SECONDS = 60.0
#: Sizes are rounded up to whole pages, so that a shape of a few bytes more or less
#: still finds its buffer.
PAGE = 4096


class _Owner(np.ndarray):
    """The array every view of one lease of a buffer is based on (see the module
    docstring); it dies with the last of them."""


class WarmBuffers:
    """Host buffers for large tensors, reused (thread-safe). ``limit_bytes`` 0 turns
    the cache off: ``empty`` is then ``np.empty``."""

    def __init__(
        self,
        limit_bytes: int = DEFAULT_LIMIT_BYTES,
        *,
        min_bytes: int = MIN_BYTES,
        idle_seconds: float = DEFAULT_IDLE_SECONDS,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self.limit_bytes = limit_bytes
        self.min_bytes = min_bytes
        self.idle_seconds = idle_seconds
        #: Told the bytes of every buffer the cache drops (the server's trimmer, so
        #: that glibc hands them back to the OS).
        self.on_drop = on_drop
        self._lock = threading.Lock()
        #: Free buffers by size, each with when it was freed; the least recently
        #: freed size first.
        self._free: collections.OrderedDict[int, list[tuple[np.ndarray, float]]] = (
            collections.OrderedDict()
        )
        self._bytes = 0  # bytes in _free
        #: Buffers whose last view went, with when, not yet in _free (appended by
        #: finalizers).
        self._returned: collections.deque[tuple[np.ndarray, float]] = collections.deque()
        self.hits = 0  # ``empty`` calls served from the cache, for tests and metrics
        self.misses = 0

    def empty(self, nbytes: int) -> np.ndarray:
        """A new 1-D uint8 array of ``nbytes`` (contents undefined): a cached buffer
        of the same page-rounded size when there is one."""
        size = -(-nbytes // PAGE) * PAGE
        if nbytes < self.min_bytes or size > self.limit_bytes:  # never kept
            return np.empty(nbytes, np.uint8)
        buffer = self._take(size)
        if buffer is None:
            buffer = np.empty(size, np.uint8)
        owner = np.ndarray.__new__(_Owner, (size,), np.uint8, buffer=buffer)
        # Not at exit: Python's exit handler would return buffers still in use.
        weakref.finalize(owner, self._give, buffer).atexit = False
        return owner[:nbytes].view(np.ndarray)

    def array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A new uninitialised array of ``shape`` and ``dtype`` (as ``np.empty``), in
        a warm buffer when it is large enough (``kernels.lstm.Empty``)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        out: np.ndarray = self.empty(nbytes).view(dtype).reshape(shape)
        return out

    @property
    def cached_bytes(self) -> int:
        """Bytes of free buffers kept now."""
        with self._lock:
            dropped = self._collect()
            kept = self._bytes
        self._dropped(dropped)
        return kept

    def expire_idle(self, now: float | None = None) -> int:
        """Drop the free buffers unused for ``idle_seconds``; returns their bytes."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dropped = self._collect()
            for size in list(self._free):
                kept = [(b, t) for b, t in self._free[size] if now - t <= self.idle_seconds]
                dropped += size * (len(self._free[size]) - len(kept))
                if kept:
                    self._free[size] = kept
                else:
                    del self._free[size]
            self._bytes = sum(size * len(b) for size, b in self._free.items())
        self._dropped(dropped)
        return dropped

    def clear(self) -> None:
        with self._lock:
            dropped = self._collect() + self._bytes
            self._free.clear()
            self._bytes = 0
        self._dropped(dropped)

    def _give(self, buffer: np.ndarray) -> None:
        """The finalizer: queue the buffer, then file it now (so the limit holds at
        once) unless the lock is held: by another thread, or by this one in a garbage
        collection inside the lock, where waiting would deadlock; the next call that
        takes the lock files it then."""
        self._returned.append((buffer, time.monotonic()))
        if self._lock.acquire(blocking=False):
            try:
                dropped = self._collect()
            finally:
                self._lock.release()
            self._dropped(dropped)

    def _dropped(self, nbytes: int) -> None:
        if nbytes and self.on_drop is not None:
            self.on_drop(nbytes)

    def _take(self, size: int) -> np.ndarray | None:
        with self._lock:
            dropped = self._collect()
            free = self._free.get(size)
            buffer = None
            if free:
                buffer, _ = free.pop()
                if not free:
                    del self._free[size]
                self._bytes -= size
                self.hits += 1
            else:
                self.misses += 1
        self._dropped(dropped)
        return buffer

    def _collect(self) -> int:
        """Move returned buffers into ``_free``, then drop the least recently freed
        past the limit (the caller holds the lock); returns the bytes dropped."""
        dropped = 0
        while self._returned:
            buffer, freed_at = self._returned.popleft()
            size = buffer.nbytes
            if size > self.limit_bytes:  # the limit was lowered meanwhile
                dropped += size
                continue
            self._free.setdefault(size, []).append((buffer, freed_at))
            self._free.move_to_end(size)
            self._bytes += size
        while self._bytes > self.limit_bytes:
            size, buffers = next(iter(self._free.items()))
            buffers.pop(0)
            self._bytes -= size
            dropped += size
            if not buffers:
                del self._free[size]
        return dropped
