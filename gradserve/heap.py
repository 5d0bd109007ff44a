"""glibc's heap, tuned for a process that moves tensors: large buffers reuse memory
touched before, and freed memory goes back to the OS on request.

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
The server calls it as it starts, as do the LSTM kernels and ``gradserve.Client``
(unless ``keep_heap_warm=False``). ``trim`` hands free pages back (the server's
``memory.Trimmer``, once calls stop). Where the C library is not glibc both do
nothing.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Any

#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Allocations below this come from the heap (glibc refuses more than 32 MiB on 64-bit).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory at the top of a heap kept mapped, per arena.
TRIM_THRESHOLD_BYTES = 128 << 20


@functools.cache
def _glibc() -> Any | None:
    """The C library when it is glibc (its ``mallopt`` and ``malloc_trim`` typed);
    None elsewhere (musl, macOS, Windows)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (AttributeError, OSError, TypeError):
        return None
    return libc


def keep_warm() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring), once per process;
    False where the C library is not glibc (nothing changed then). Cheap after the
    first call: the kernels call it on every forward and backward."""
    return _set_thresholds()


@functools.cache
def _set_thresholds() -> bool:
    libc = _glibc()
    return libc is not None and bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def is_warm() -> bool:
    """Whether ``keep_warm`` has set the thresholds in this process (without setting
    them)."""
    return _set_thresholds.cache_info().currsize > 0 and _set_thresholds()


def can_trim() -> bool:
    """Whether ``trim`` can hand pages back (glibc's ``malloc_trim``)."""
    return _glibc() is not None


def trim() -> None:
    """Hand free heap pages back to the OS (``malloc_trim(0)``; nothing without glibc)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
