"""Keep the process's malloc heap warm: large buffers reuse memory touched before.

On this project's machine a page touched for the first time costs about 0.85 ms per
MiB (a fault and a zeroed page per 4 KiB), more than copying the same MiB several
times over. glibc, by default, gives every allocation above its mmap threshold fresh
``mmap`` pages and gives freed heap tops above its trim threshold back to the kernel;
both thresholds adapt, but not to a pattern of a few large buffers per call. So a
process that moves tensors paid those faults on every call:

- a gRPC message: gRPC's receive buffer, the ``bytes`` Python makes of it, protobuf's
  parse and its ``bytes`` field;
- an LSTM's seven outputs (4 ms of a 10-16 ms forward at (50, 32, 256)).

A unary put and delete of 1 MiB over loopback, in a loop, took 5.3 ms with 950 page
faults in the server and 480 in the client per call, and 1.3-1.7 ms with about one
after these settings in both (``tests/benchmarks/bench_wire.py`` times the wire).

``keep_warm`` sets both thresholds once per process: allocations under 32 MiB (glibc's
own ceiling for its dynamic threshold) come from the heap, and up to 128 MiB of free
heap top per arena stay mapped. This is process-wide and bounded; nothing else changes.
The server's entry point calls it, as do the LSTM kernels (for a server embedded in
another process) and ``gradserve.Client`` (unless ``keep_heap_warm=False``).
"""

from __future__ import annotations

import ctypes
import threading

#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Allocations below this come from the heap (glibc refuses more than 32 MiB on 64-bit).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory at the top of a heap kept mapped, per arena.
TRIM_THRESHOLD_BYTES = 128 << 20

_warm: bool | None = None  # None: not tried; else whether glibc took the settings
_lock = threading.Lock()


def keep_warm() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring), once per process;
    False where the C library is not glibc (nothing changed then). Cheap after the
    first call: the kernels call it on every forward and backward."""
    global _warm
    if _warm is not None:  # every call after the first: no lock
        return _warm
    with _lock:
        if _warm is None:
            _warm = _set_thresholds()
        return _warm


def _set_thresholds() -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
