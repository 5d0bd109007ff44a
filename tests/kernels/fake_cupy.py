"""A stand-in ``cupy`` module: "device" arrays in host memory, and a ``RawModule`` whose
kernels are the host-shim build of ``kernels/lstm.cu``.

Importing ``gradserve.kernels.backend_cuda`` against it runs that module's real
Python code — RawModule set-up, name expressions, argument order and scalar
types of every launch — on the CPU, so a marshalling mistake fails in CI rather
than on the first GPU run.

Device arrays are a NumPy subclass carrying ``__cuda_array_interface__`` (the
attribute the server uses to tell device from host arrays), and every
host-to-device and device-to-host copy is counted in ``cupy.transfers``, so tests
can show which tensors a served op moved between host and GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import re
import sys
import threading
import time
import types
import weakref
from collections.abc import Iterator

import numpy as np


class DeviceArray(np.ndarray):
    """An array "on the GPU": NumPy memory, marked as device memory."""

    #: Where ``set`` records its host-to-device copies (the installing fake's log).
    transfers: dict | None = None

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (0, False), "version": 3}

    def set(self, arr: np.ndarray, stream=None) -> None:
        """cupy.ndarray.set: copy a host array of the same shape in."""
        assert not isinstance(arr, DeviceArray) and arr.shape == self.shape
        if DeviceArray.transfers is not None:
            DeviceArray.transfers["to_device"].append((arr.shape, arr.nbytes))
        self.view(np.ndarray)[...] = arr


def _device(a: np.ndarray) -> DeviceArray:
    return a.view(DeviceArray)


def make_fake_cupy(shim_lib: ctypes.CDLL | None) -> types.ModuleType:
    """The stand-in module; ``shim_lib`` (the host-shim build) runs its kernels, and may
    be None where no kernel is launched (the conformance test only reads names)."""
    cupy = types.ModuleType("cupy")
    cupy.ndarray = DeviceArray
    transfers = {"to_device": [], "to_host": []}  # (shape, nbytes) of each copy

    def asarray(a, dtype=None):
        if isinstance(a, DeviceArray):
            return a if dtype is None else a.astype(dtype, copy=False)
        host = np.asarray(a, dtype=dtype)
        transfers["to_device"].append((host.shape, host.nbytes))
        return default_pool._track(_device(np.array(host, copy=True)))

    def asnumpy(a):
        if isinstance(a, DeviceArray):
            transfers["to_host"].append((a.shape, a.nbytes))
            return np.array(a.view(np.ndarray), copy=True)
        return np.asarray(a)

    def ascontiguousarray(a):
        assert isinstance(a, DeviceArray), "cupy.ascontiguousarray of a host array"
        return _device(np.ascontiguousarray(a))

    def copyto(dst, src):
        assert isinstance(dst, DeviceArray) and isinstance(src, DeviceArray)
        np.copyto(dst, src)

    cupy.copyto = copyto
    cupy.asarray = asarray
    cupy.asnumpy = asnumpy
    cupy.ascontiguousarray = ascontiguousarray
    current = threading.local()  # the malloc of ``using_allocator``, per thread

    class DefaultPool:
        """cupy.get_default_memory_pool(): "used" counts the live arrays made by
        ``zeros``, ``empty`` and host-to-device ``asarray`` outside a private
        allocator; "held" is the most ever used (a pool keeps freed blocks)."""

        def __init__(self) -> None:
            self._lock = threading.Lock()
            self.used = self.peak = 0

        def _track(self, a: DeviceArray) -> DeviceArray:
            self._add(a.nbytes)
            weakref.finalize(a, self._add, -a.nbytes)
            return a

        def _add(self, nbytes: int) -> None:
            with self._lock:
                self.used += nbytes
                self.peak = max(self.peak, self.used)

        def used_bytes(self) -> int:
            return self.used

        def total_bytes(self) -> int:
            return self.peak

    default_pool = DefaultPool()
    cupy.get_default_memory_pool = lambda: default_pool

    def allocated(a: np.ndarray) -> DeviceArray:
        malloc = getattr(current, "malloc", None)
        if malloc is None:
            return default_pool._track(_device(a))
        malloc(a.nbytes)
        return _device(a)

    def zeros(shape, dtype=float, order="C"):
        return allocated(np.zeros(shape, dtype, order))

    def empty(shape, dtype=float, order="C"):
        return allocated(np.empty(shape, dtype, order))

    def matmul(x1, x2, /, *, out=None):
        return np.matmul(x1, x2, out=out)

    cupy.zeros, cupy.empty, cupy.matmul = zeros, empty, matmul
    compiled: list[dict] = []
    lookups: list[str] = []

    class RawKernel:
        def __init__(self, expression: str) -> None:
            kernel, ctype = re.fullmatch(r"(\w+)<(\w+)>", expression).groups()
            short = kernel.removeprefix("lstm_")
            self.function = getattr(shim_lib, f"{short}_{ctype}")
            self.scalar = ctypes.c_float if ctype == "float" else ctypes.c_double
            self.launches = 0

        def __call__(self, grid, block, args):
            assert len(grid) == 1 and len(block) == 1 and grid[0] >= 1 and block[0] >= 1
            converted = []
            for a in args:
                if isinstance(a, np.ndarray):
                    assert isinstance(a, DeviceArray), "a host array passed to a kernel"
                    assert a.flags.c_contiguous
                    converted.append(ctypes.c_void_p(a.ctypes.data))
                elif isinstance(a, np.int32):
                    converted.append(int(a))
                elif isinstance(a, (np.float32, np.float64)):
                    expected = np.float32 if self.scalar is ctypes.c_float else np.float64
                    assert type(a) is expected, f"scalar {type(a)} for a {self.scalar} kernel"
                    converted.append(self.scalar(a))
                else:
                    raise TypeError(f"unexpected kernel argument {type(a)}")
            self.launches += 1
            self.function(*converted)

    class RawModule:
        def __init__(self, code=None, *, options=(), name_expressions=None):
            assert "lstm_fwd_step" in code
            self.names = list(name_expressions or ())
            compiled.append({"options": options, "names": self.names})

        def compile(self):
            return None

        def get_function(self, name):
            assert name in self.names, name
            lookups.append(name)
            return RawKernel(name)

    class Device:
        id = 0

        def synchronize(self) -> None:
            return None

    class Event:
        """Host-clock events: everything here runs synchronously."""

        def record(self, stream=None) -> None:
            self.at = time.perf_counter()

        def synchronize(self) -> None:
            return None

    class Graph:
        def launch(self, stream=None) -> None:
            return None  # nothing was recorded: the work ran when it was "captured"

    class Stream:
        """Work runs at once; a capture yields an empty graph."""

        def __init__(self, *, non_blocking: bool = False) -> None:
            self.capturing = False

        def __enter__(self) -> Stream:
            return self

        def __exit__(self, *exc) -> None:
            return None

        def synchronize(self) -> None:
            return None

        def begin_capture(self) -> None:
            self.capturing = True

        def end_capture(self) -> Graph:
            assert self.capturing, "end_capture without begin_capture"
            self.capturing = False
            return Graph()

    class MemoryPool:
        """Memory is NumPy's; the pool counts the bytes of the ``cupy.zeros`` and
        ``cupy.empty`` made while it is the allocator (results of array operations
        are not counted)."""

        def __init__(self) -> None:
            self.allocated = 0

        def malloc(self, size: int) -> None:
            self.allocated += size

        def total_bytes(self) -> int:
            return self.allocated

    @contextlib.contextmanager
    def using_allocator(allocator=None):
        previous = getattr(current, "malloc", None)
        current.malloc = allocator
        try:
            yield
        finally:
            current.malloc = previous

    cupy.__version__ = "0.0-fake"
    cupy.RawModule = RawModule
    cupy.cuda = types.SimpleNamespace(
        Device=Device,
        Event=Event,
        Stream=Stream,
        MemoryPool=MemoryPool,
        using_allocator=using_allocator,
        get_elapsed_time=lambda start_event, end_event: (end_event.at - start_event.at) * 1e3,
        runtime=types.SimpleNamespace(
            getDeviceCount=lambda: 1,
            getDeviceProperties=lambda device: {"name": b"fake GPU (host shim)"},
        ),
    )
    cupy.compiled = compiled
    cupy.lookups = lookups
    cupy.transfers = transfers
    # Stand-ins that code gets from calls, not by name, with the CuPy class each
    # stands for (the conformance test checks them against it).
    cupy.returned_stand_ins = [("RawKernel", RawKernel), ("cuda.MemoryPool", DefaultPool)]
    return cupy


@contextlib.contextmanager
def installed(shim_lib: ctypes.CDLL) -> Iterator[types.ModuleType]:
    """``cupy`` is the fake (and ``backend_cuda`` freshly imported against it) inside.

    Afterwards both the module table and the ``gradserve.kernels.backend_cuda``
    attribute are as before, so a later real-GPU test never gets the fake.
    """
    import gradserve.kernels as package

    names = ("cupy", "gradserve.kernels.backend_cuda")
    saved = {k: sys.modules.get(k) for k in names}
    saved_attr = package.__dict__.get("backend_cuda")
    sys.modules["cupy"] = fake = make_fake_cupy(shim_lib)
    DeviceArray.transfers = fake.transfers
    sys.modules.pop("gradserve.kernels.backend_cuda", None)
    package.__dict__.pop("backend_cuda", None)
    try:
        importlib.import_module("gradserve.kernels.backend_cuda")
        yield fake
    finally:
        DeviceArray.transfers = None
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        if saved_attr is None:
            package.__dict__.pop("backend_cuda", None)
        else:
            package.backend_cuda = saved_attr
