"""The process's BLAS threads, divided among the LSTM ops computing at once.

A BLAS library has one thread count per process. An op computing alone should get all
of it; ops computing together should split it, or every GEMM of each runs with every
thread and the cores are oversubscribed (``make bench``'s ``bench_concurrent_lstm``
measures both). With ``--share-blas-threads on`` the server's ``Compute`` wraps each
CPU LSTM op in ``share``, which re-divides the count as each op starts and ends:
``total // running`` threads (at least one), where ``total`` is the count when the
server started (``OPENBLAS_NUM_THREADS``, else one per core), put back when the last op
ends. The server owns the count from then on: in a process that embeds it, a count
other code sets is replaced at the next op.

The price is determinism: OpenBLAS sums a large GEMM in another order at 1 thread than
at 2, so an op's last bits depend on how many ops computed beside it. That is why it is
off by default. (The formulation the CPU forward uses is keyed by ``total`` either way,
``plan_count``, so at least that does not change with the load.)

threadpoolctl finds the library and sets its count; only NumPy's own is touched where
NumPy bundles one (its wheels), so another library in the process (SciPy's, torch's)
keeps its count. With NumPy's OpenBLAS (one pool of threads for the process) a change
applies from the next BLAS call of every thread, so an op that was computing alone
drops to its share at its next GEMM. Where the count is per calling thread (OpenBLAS
built on OpenMP) a set would reach only the thread of the op that starts or ends and
leave that thread's count behind for its next op, so there the count is left alone.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy
import threadpoolctl

from gradserve import pauses

#: ``OPENBLAS_THREAD_TIMEOUT`` values (2**N cycles of spinning after a call) at which
#: ``sleep_soon``: 20 is about 0.35-0.5 ms.
QUICK_SLEEP_TIMEOUT = 20


def _blas_libraries() -> list[Any]:
    """threadpoolctl's controllers of NumPy's BLAS: the one in NumPy's wheel
    (``numpy.libs``) where there is one, else every BLAS library loaded (threadpoolctl
    finds the libraries loaded so far: NumPy's, imported above). None if it fails."""
    try:
        controller = threadpoolctl.ThreadpoolController()
    except Exception:  # noqa: BLE001 - an unknown library: leave the threads alone
        return []
    libs = [lib for lib in controller.lib_controllers if lib.user_api == "blas"]
    site = os.path.dirname(os.path.dirname(os.path.realpath(numpy.__file__)))
    bundled = os.path.join(site, "numpy.libs") + os.sep
    own = [lib for lib in libs if os.path.realpath(lib.filepath).startswith(bundled)]
    return own or libs


class BlasThreads:
    """The BLAS thread count of the process, and its division among computing ops."""

    def __init__(self, find: Callable[[], list[Any]] = _blas_libraries) -> None:
        self._find = find
        self._libraries: list[Any] | None = None
        self._lock = threading.Lock()
        self._running = 0
        self._total: int | None = None  # the count to divide: at ``start``, else the first op

    def start(self) -> None:
        """Take the count to divide now (a server starting), not at the first op, when
        other code in the process may hold a limit of its own."""
        with self._lock:
            if self._total is None:
                self._total = self._count()

    def _libs(self) -> list[Any]:
        if self._libraries is None:
            self._libraries = self._find()
        return self._libraries

    def count(self) -> int | None:
        """The thread count now (None where no BLAS library was found)."""
        with self._lock:
            return self._count()

    def plan_count(self) -> int | None:
        """The count an op's plan is keyed by: while ops divide the threads, the
        process's own (``total``), so an op plans, and computes its bits, the same way
        however many compute beside it; else the count now."""
        with self._lock:
            if self._running and self._total is not None:
                return self._total
            return self._count()

    def sleep_soon(self) -> bool:
        """Whether the BLAS threads sleep soon after a call: OpenBLAS's on its own
        threads (not OpenMP's, which ignore it) with ``OPENBLAS_THREAD_TIMEOUT`` from 1
        to ``QUICK_SLEEP_TIMEOUT``, as the server process sets it
        (``server/transport/entry.py``; OpenBLAS reads it when it loads, so this reads
        the environment as it is now, which is what it read unless someone changed it
        since; 0 or less OpenBLAS ignores). With OpenBLAS's default its threads spin
        0.1 s after each call, on the cores other threads of the process compute on."""
        libs = self._libs()
        if not libs or any(
            getattr(lib, "internal_api", "") != "openblas"
            or getattr(lib, "threading_layer", "") != "pthreads"
            for lib in libs
        ):
            return False
        try:
            return 0 < int(os.environ.get("OPENBLAS_THREAD_TIMEOUT", "")) <= QUICK_SLEEP_TIMEOUT
        except ValueError:
            return False

    def _count(self) -> int | None:
        libs = self._libs()
        return max(int(lib.get_num_threads()) for lib in libs) if libs else None

    def _divisible(self) -> bool:
        """One count for the whole process (not per thread, as on OpenMP)."""
        libs = self._libs()
        return bool(libs) and all(getattr(lib, "threading_layer", "") != "openmp" for lib in libs)

    @contextmanager
    def share(self) -> Iterator[None]:
        """Compute in the block with this op's share of the threads."""
        with self._lock:
            self._running += 1
            try:
                self._divide()
            except BaseException:
                self._running -= 1
                raise
        try:
            with pauses.lent(self._leave, self._join):  # (a paused op computes nothing)
                yield
        finally:
            self._leave()

    def _leave(self) -> None:
        with self._lock:
            self._running -= 1
            self._divide()

    def _join(self) -> None:
        with self._lock:
            self._running += 1
            self._divide()

    def _divide(self) -> None:
        if not self._divisible():
            return
        if self._total is None:
            self._total = self._count()
        if self._total is None:
            return
        share = self._total if self._running == 0 else max(1, self._total // self._running)
        if share == self._count():
            return
        for lib in self._libs():
            lib.set_num_threads(share)
            # threadpoolctl (3.8) heeds only the thread that set OpenBLAS's shared
            # count first, until that thread lets go or ends. Ops compute on several
            # long-lived threads, so each lets go at once. Another thread that holds it
            # (inside ``threadpool_limits``) keeps it: these sets then do nothing.
            let_go = getattr(lib, "clear_controlling_thread", None)
            if let_go is not None:
                let_go()


#: The process's one count (a BLAS library has one).
BLAS = BlasThreads()
