"""The process's BLAS threads, divided among the LSTM ops computing at once.

A BLAS library has one thread count per process. An op computing alone should get all
of it; ops computing together should split it, or every GEMM of each runs with every
thread and the cores are oversubscribed. Measured on 2 cores (a server at 2 BLAS
threads, clients calling the (50, 32, 256) forward, outputs kept): one client 56-59
ops/s, two clients 40-47 ops/s, and two clients against a server at one BLAS thread
65-66 ops/s. So ``share`` re-divides the count as each op starts and ends: ``total //
running`` threads (at least one), where ``total`` is the count the process had when
the first of them started, and the last one to end puts it back.

threadpoolctl finds and sets the count of whichever BLAS NumPy loaded. With NumPy's
own OpenBLAS (one pool of threads for the process) a change applies from the next BLAS
call of every thread, so an op that was computing alone drops to its share at its next
GEMM. Where the count is per calling thread (OpenBLAS built on OpenMP) each set
reaches only the thread of the op that starts or ends, so an op already computing
keeps the count it started with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy  # noqa: F401 - its BLAS loaded before threadpoolctl looks for it
import threadpoolctl


def _blas_libraries() -> list[Any]:
    """threadpoolctl's controllers of the process's BLAS libraries (none if it fails).
    threadpoolctl finds the libraries loaded so far: NumPy's, imported above."""
    try:
        controller = threadpoolctl.ThreadpoolController()
    except Exception:  # noqa: BLE001 - an unknown library: leave the threads alone
        return []
    return [lib for lib in controller.lib_controllers if lib.user_api == "blas"]


class BlasThreads:
    """The BLAS thread count of the process, and its division among computing ops."""

    def __init__(self, find: Callable[[], list[Any]] = _blas_libraries) -> None:
        self._find = find
        self._libraries: list[Any] | None = None
        self._lock = threading.Lock()
        self._running = 0
        self._total: int | None = None  # the count before the first running op

    def _libs(self) -> list[Any]:
        if self._libraries is None:
            self._libraries = self._find()
        return self._libraries

    def count(self) -> int | None:
        """The thread count now (None where no BLAS library was found)."""
        with self._lock:
            return self._count()

    def _count(self) -> int | None:
        libs = self._libs()
        return max(int(lib.get_num_threads()) for lib in libs) if libs else None

    def _set(self, threads: int) -> None:
        for lib in self._libs():
            lib.set_num_threads(threads)
            # threadpoolctl lets only the thread that first set OpenBLAS's (shared)
            # count set it again, until that thread lets go. Ops compute on several
            # threads, so each lets go at once; a thread inside ``threadpool_limits``
            # keeps its hold, and then its limit stands and these sets do nothing.
            let_go = getattr(lib, "clear_controlling_thread", None)
            if let_go is not None:
                let_go()

    @contextmanager
    def share(self) -> Iterator[None]:
        """Compute in the block with this op's share of the threads."""
        with self._lock:
            if self._running == 0:
                self._total = self._count()
            self._running += 1
            self._divide()
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._divide()

    def _divide(self) -> None:
        if self._total is None:
            return
        if self._running == 0:
            self._set(self._total)
        else:
            self._set(max(1, self._total // self._running))


#: The process's one count (a BLAS library has one).
BLAS = BlasThreads()
