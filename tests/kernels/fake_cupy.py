"""A stand-in ``cupy`` module: "device" arrays in host memory, and a ``RawModule`` whose
kernels are the host-shim build of ``kernels/lstm.cu``.

Importing ``gradserve.kernels.backend_cuda`` against it runs that module's real
Python code — RawModule set-up, name expressions, argument order and scalar
types of every launch — on the CPU, so a marshalling mistake fails in CI rather
than on the first GPU run.

Device arrays (``DeviceArray``) *wrap* a host NumPy buffer; they are not NumPy
arrays, and they refuse what CuPy's arrays refuse, so the host/device boundary
is checked here as a GPU would check it:

* no implicit conversion to NumPy: ``np.asarray(device)`` raises CuPy's
  TypeError (``__array__``), and there is no ``__array_interface__``, buffer or
  ``ctypes``; the way to the host is ``.get()`` / ``cupy.asnumpy``;
* no host array as an operand of a device operation (``+``, ``*``, a NumPy ufunc
  called on a device array, a kernel argument): CuPy's ``TypeError: Unsupported
  type <class 'numpy.ndarray'>`` (``matmul``, ``ascontiguousarray``: its Cython
  "Argument 'a' has incorrect type"); ``device[...] = host`` is CuPy's ValueError
  (it takes only scalars there), ``.set(host)`` is the copy in;
* ``cupy.empty`` memory is not zeros but all-ones bytes (NaN for floats), as
  reused pool memory on a GPU is garbage: code that reads before it writes fails;
* stream capture as CUDA's: while this thread's current stream captures, device
  work is recorded, not run (new arrays hold garbage until a replay), host copies
  and synchronisation raise, and the graph's ``launch`` replays the work into the
  same arrays.

``tests/kernels/test_fake_cupy_conformance.py`` holds the stand-in to CuPy's
signatures and refusals (recorded in ``cupy_signatures.json``).

Every host-to-device and device-to-host copy is counted in ``cupy.transfers``,
so tests can show which tensors a served op moved between host and GPU; every
allocation goes to the allocator in use (``cupy.cuda.using_allocator``) or to
the default pool, as CuPy's do. Only what gradserve's CUDA code (and its tests
and GPU benchmark) calls is modelled; the rest is absent rather than loose.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib
import re
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator

import numpy as np

#: CuPy's message for ``numpy.asarray(cupy_array)`` (``cupy.ndarray.__array__``).
IMPLICIT_CONVERSION = (
    "Implicit conversion to a NumPy array is not allowed. "
    "Please use `.get()` to construct a NumPy array explicitly."
)
#: Scalars CuPy takes as operands of its elementwise operations (NumPy arrays it does not).
_SCALARS = (bool, int, float, complex, np.generic)
#: NumPy ufuncs a device array answers (``__array_ufunc__``), as CuPy's ufuncs of those names.
_UFUNCS = frozenset(
    {
        np.add,
        np.subtract,
        np.multiply,
        np.true_divide,
        np.negative,
        np.matmul,
        np.equal,
        np.not_equal,
        np.less,
        np.less_equal,
        np.greater,
        np.greater_equal,
    }
)


def _unsupported(arg) -> TypeError:
    """CuPy's error for an operand it cannot take (a NumPy array, a list...)."""
    return TypeError(f"Unsupported type {type(arg)}")


def _incorrect_type(parameter: str, arg) -> TypeError:
    """CuPy's error for a non-device argument where its Cython signature wants one."""
    kind = type(arg)
    got = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    return TypeError(
        f"Argument '{parameter}' has incorrect type "
        f"(expected cupy._core.core._ndarray_base, got {got})"
    )


def _operand(arg):
    if isinstance(arg, DeviceArray):
        return arg._host
    if isinstance(arg, np.ndarray) or not isinstance(arg, _SCALARS):
        raise _unsupported(arg)
    return arg


def _garbage(buffer: np.ndarray) -> None:
    """Device memory nothing has written yet: all-ones bytes (NaN for floats, -1 for ints)."""
    if buffer.nbytes:
        ctypes.memset(buffer.ctypes.data, 0xFF, buffer.nbytes)


def _apply(ufunc, *inputs, out=None):
    """``ufunc`` on device operands (and scalars) as CuPy runs it: into ``out``, or into
    a new device array."""
    hosts = [_operand(a) for a in inputs]
    if out is not None:
        if not isinstance(out, DeviceArray):
            raise TypeError("`out` must be a tuple or `cupy.ndarray`")
        out._rt.launch(lambda: ufunc(*hosts, out=out._host))
        return out
    runtime = next(a._rt for a in inputs if isinstance(a, DeviceArray))
    return runtime.compute(lambda: np.asarray(ufunc(*hosts)))


def _matmul(x1, x2, out=None):
    """cupy.matmul: device arrays only (CuPy types its arguments)."""
    for parameter, operand in (("a", x1), ("b", x2)):
        if not isinstance(operand, DeviceArray):
            raise _incorrect_type(parameter, operand)
    return _apply(np.matmul, x1, x2, out=out)


def _basic_index(key) -> tuple:
    """``key`` as a tuple of basic indices ending in ``...`` (so that integers give 0-d
    views, as CuPy's do, not NumPy scalars)."""
    parts = key if isinstance(key, tuple) else (key,)
    for part in parts:
        if part is None or part is Ellipsis or isinstance(part, slice):
            continue
        if isinstance(part, (int, np.integer)) and not isinstance(part, (bool, np.bool_)):
            continue
        raise NotImplementedError(
            f"the stand-in cupy models basic indexing only, not {type(part).__name__} indices"
        )
    return parts if any(p is Ellipsis for p in parts) else (*parts, Ellipsis)


class _Flags:
    """cupy.ndarray.flags (a snapshot)."""

    def __init__(self, host: np.ndarray) -> None:
        self.c_contiguous = bool(host.flags.c_contiguous)
        self.f_contiguous = bool(host.flags.f_contiguous)
        self.owndata = host.base is None

    def __getitem__(self, name: str) -> bool:
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous}[name]


class DeviceArray:
    """An array "on the GPU": cupy.ndarray's interface around a host buffer it never
    hands out implicitly. Views (basic indexing, ``reshape``, ``.T``) share the buffer,
    as CuPy's views share device memory."""

    __slots__ = ("_host", "_rt", "__weakref__")

    def __init__(self, *args, **kwargs) -> None:
        raise TypeError("stand-in device arrays come from cupy.zeros, cupy.empty or cupy.asarray")

    @classmethod
    def _wrap(cls, runtime: _Runtime, host: np.ndarray) -> DeviceArray:
        self = object.__new__(cls)
        self._host = host
        self._rt = runtime
        return self

    def _view(self, host: np.ndarray) -> DeviceArray:
        return DeviceArray._wrap(self._rt, host)

    # ------------------------------------------------------------------ attributes
    @property
    def shape(self) -> tuple[int, ...]:
        return self._host.shape

    @property
    def dtype(self) -> np.dtype:
        return self._host.dtype

    @property
    def size(self) -> int:
        return self._host.size

    @property
    def ndim(self) -> int:
        return self._host.ndim

    @property
    def itemsize(self) -> int:
        return self._host.itemsize

    @property
    def nbytes(self) -> int:
        return self._host.nbytes

    @property
    def strides(self) -> tuple[int, ...]:
        return self._host.strides

    @property
    def flags(self) -> _Flags:
        return _Flags(self._host)

    @property
    def T(self) -> DeviceArray:
        return self._view(self._host.T)

    @property
    def __cuda_array_interface__(self) -> dict:
        host = self._host
        return {
            "shape": host.shape,
            "typestr": host.dtype.str,
            "descr": host.dtype.descr,
            "data": (host.ctypes.data if host.size else 0, False),
            "strides": None if host.flags.c_contiguous else host.strides,
            "version": 3,
        }

    # ------------------------------------------------------------------ host <-> device
    def __array__(self, dtype=None):
        raise TypeError(IMPLICIT_CONVERSION)

    def get(self, stream=None, order="C") -> np.ndarray:
        """cupy.ndarray.get: a host copy (counted as a device-to-host transfer)."""
        self._rt.refuse_in_capture("a device-to-host copy")
        self._rt.transfers["to_host"].append((self.shape, self.nbytes))
        return np.array(self._host, order=order, copy=True)

    def set(self, arr, stream=None) -> None:
        """cupy.ndarray.set: copy a host array of the same shape and dtype in."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not self._host.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        self._rt.refuse_in_capture("a host-to-device copy")
        self._rt.transfers["to_device"].append((arr.shape, arr.nbytes))
        self._host[...] = arr

    def _read(self) -> np.ndarray:
        """The value, for Python's bool/int/float (CuPy copies it to the host)."""
        return self.get()

    def __bool__(self) -> bool:
        return bool(self._read())

    def __int__(self) -> int:
        return int(self._read())

    def __float__(self) -> float:
        return float(self._read())

    def __repr__(self) -> str:
        return f"stand-in device {self._host!r}"

    # ------------------------------------------------------------------ copies and views
    def astype(self, dtype, order="K", *, copy=True) -> DeviceArray:
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return self._rt.compute(lambda: self._host.astype(dtype, order=order, copy=True))

    def copy(self, order="C") -> DeviceArray:
        return self._rt.compute(lambda: np.array(self._host, order=order, copy=True))

    def reshape(self, *shape, order="C") -> DeviceArray:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        try:  # a view where the layout allows one, as CuPy's reshape
            return self._view(np.reshape(self._host, shape, order=order, copy=False))
        except ValueError:
            return self._rt.compute(lambda: np.reshape(self._host, shape, order=order, copy=True))

    def __getitem__(self, slices) -> DeviceArray:
        return self._view(self._host[_basic_index(slices)])

    def __setitem__(self, slices, value) -> None:
        target = self._host[_basic_index(slices)]
        if isinstance(value, DeviceArray):
            value = value._host
        elif isinstance(value, np.ndarray):
            if value.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = value.item()
        elif not isinstance(value, _SCALARS):
            raise _unsupported(value)
        self._rt.launch(lambda: target.__setitem__(Ellipsis, value))

    def fill(self, value) -> None:
        self[...] = value

    def __len__(self) -> int:
        return len(self._host)

    def __iter__(self) -> Iterator[DeviceArray]:
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self)))

    # ------------------------------------------------------------------ arithmetic
    def sum(self, axis=None, dtype=None, out=None, keepdims=False) -> DeviceArray:
        def total() -> np.ndarray:
            return np.asarray(self._host.sum(axis=axis, dtype=dtype, keepdims=keepdims))

        if out is None:
            return self._rt.compute(total)
        if not isinstance(out, DeviceArray):
            raise TypeError("`out` must be a cupy.ndarray")
        out._rt.launch(lambda: out._host.__setitem__(Ellipsis, total()))
        return out

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        out = kwargs.pop("out", None)
        if method != "__call__" or ufunc not in _UFUNCS or kwargs:
            return NotImplemented
        if out is not None:
            (out,) = out
        if ufunc is np.matmul:
            return _matmul(*inputs, out=out)
        return _apply(ufunc, *inputs, out=out)

    def __array_function__(self, func, types, args, kwargs):
        if func.__name__ not in self._rt.dispatched:
            return NotImplemented
        return getattr(self._rt.module, func.__name__)(*args, **kwargs)

    def __add__(self, other):
        return _apply(np.add, self, other)

    def __radd__(self, other):
        return _apply(np.add, other, self)

    def __iadd__(self, other):
        return _apply(np.add, self, other, out=self)

    def __sub__(self, other):
        return _apply(np.subtract, self, other)

    def __rsub__(self, other):
        return _apply(np.subtract, other, self)

    def __isub__(self, other):
        return _apply(np.subtract, self, other, out=self)

    def __mul__(self, other):
        return _apply(np.multiply, self, other)

    def __rmul__(self, other):
        return _apply(np.multiply, other, self)

    def __imul__(self, other):
        return _apply(np.multiply, self, other, out=self)

    def __truediv__(self, other):
        return _apply(np.true_divide, self, other)

    def __rtruediv__(self, other):
        return _apply(np.true_divide, other, self)

    def __itruediv__(self, other):
        return _apply(np.true_divide, self, other, out=self)

    def __matmul__(self, other):
        return _matmul(self, other)

    def __rmatmul__(self, other):
        return _matmul(other, self)

    def __neg__(self):
        return _apply(np.negative, self)

    def __eq__(self, other):
        return _apply(np.equal, self, other)

    def __ne__(self, other):
        return _apply(np.not_equal, self, other)

    def __lt__(self, other):
        return _apply(np.less, self, other)

    def __le__(self, other):
        return _apply(np.less_equal, self, other)

    def __gt__(self, other):
        return _apply(np.greater, self, other)

    def __ge__(self, other):
        return _apply(np.greater_equal, self, other)

    __hash__ = None  # unhashable, as cupy.ndarray


class DefaultPool:
    """cupy.get_default_memory_pool(): "used" counts the bytes of live device buffers
    allocated outside a private allocator (a buffer lives as long as any view of it);
    "held" is the most ever used (a pool keeps freed blocks).

    A buffer's finalizer only appends its size to a deque: a garbage collection may run
    it on a thread that holds ``_lock`` (inside ``_add``), where taking the lock again
    deadlocked (a hang in ``make test``, in ``test_cuda_graphs``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._freed: collections.deque[int] = collections.deque()
        self._used = self.peak = 0

    def _track(self, buffer: np.ndarray) -> None:
        self._add(buffer.nbytes)
        weakref.finalize(buffer, self._freed.append, buffer.nbytes)

    def _add(self, nbytes: int) -> None:
        with self._lock:
            self._used += nbytes - self._drain()
            self.peak = max(self.peak, self._used)

    def _drain(self) -> int:
        """(holding ``_lock``) The bytes freed since the last call."""
        freed = 0
        while self._freed:
            freed += self._freed.popleft()
        return freed

    def used_bytes(self) -> int:
        with self._lock:
            self._used -= self._drain()
            return self._used

    def total_bytes(self) -> int:
        return self.peak


class _Runtime:
    """One stand-in's state: its copy log, default pool and per-thread allocator."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.transfers: dict[str, list] = {"to_device": [], "to_host": []}
        self.default_pool = DefaultPool()
        self.current = threading.local()  # the malloc of ``using_allocator``, per thread
        #: NumPy functions a device array hands to the stand-in (``__array_function__``):
        #: CuPy takes every one it implements, the stand-in only these.
        self.dispatched = frozenset({"copyto"})

    def allocate(self, buffer: np.ndarray) -> DeviceArray:
        """``buffer`` (new, referenced nowhere else) as device memory from the allocator
        in use on this thread."""
        malloc = getattr(self.current, "malloc", None)
        if malloc is None:
            self.default_pool._track(buffer)
        else:
            malloc(buffer.nbytes)
        return DeviceArray._wrap(self, buffer)

    def launch(self, work: Callable[[], object], done: DeviceArray | None = None) -> None:
        """Device work, on the current stream: run now; or, while this thread's current
        stream is capturing, recorded into its graph and not run. ``done``: the new array
        ``work`` fills, computed already (for its shape): under a capture it goes back to
        garbage, as a captured computation has not happened."""
        capturing = getattr(self.current, "capturing", None)
        if capturing is None:
            if done is None:
                work()
            return
        if getattr(self.current, "stream", None) is not capturing:
            raise RuntimeError(
                "cudaErrorStreamCaptureImplicit: work on another stream than the capturing one"
            )
        capturing.recorded.append(work)
        if done is not None:
            _garbage(done._host)

    def compute(self, make: Callable[[], np.ndarray]) -> DeviceArray:
        """A new device array of ``make()`` (which returns a new host buffer): device
        work, so a capture records it, and a replay recomputes into the same array."""
        with np.errstate(all="ignore"):  # under a capture the operands are garbage
            result = self.allocate(make())
        self.launch(lambda: result._host.__setitem__(Ellipsis, make()), done=result)
        return result

    def refuse_in_capture(self, what: str) -> None:
        """CUDA refuses synchronous host work (copies, synchronisation) in a capture."""
        if getattr(self.current, "capturing", None) is not None:
            raise RuntimeError(
                f"cudaErrorStreamCaptureUnsupported: {what} while a stream is capturing"
            )


def make_fake_cupy(shim_lib: ctypes.CDLL | None) -> types.ModuleType:
    """The stand-in module; ``shim_lib`` (the host-shim build) runs its kernels, and may
    be None where no kernel is launched (the conformance test only reads names)."""
    cupy = types.ModuleType("cupy")
    runtime = _Runtime(cupy)
    cupy.ndarray = DeviceArray
    transfers = runtime.transfers  # (shape, nbytes) of each copy

    def asarray(a, dtype=None):
        if isinstance(a, DeviceArray):
            return a if dtype is None else a.astype(dtype, copy=False)
        host = np.asarray(a, dtype=dtype)
        runtime.refuse_in_capture("a host-to-device copy")
        transfers["to_device"].append((host.shape, host.nbytes))
        return runtime.allocate(np.array(host, copy=True))

    def asnumpy(a, stream=None):
        if isinstance(a, DeviceArray):
            return a.get(stream)
        return np.asarray(a)

    def ascontiguousarray(a, dtype=None):
        if not isinstance(a, DeviceArray):
            raise _incorrect_type("a", a)
        if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return runtime.compute(lambda: np.array(a._host, dtype=dtype, order="C", copy=True))

    def copyto(dst, src, casting="same_kind"):
        if not isinstance(dst, DeviceArray):
            raise _unsupported(dst)
        if isinstance(src, np.ndarray):  # CuPy takes a one-element host array as a scalar
            if src.size != 1:
                raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
            src = src.reshape(())[()]
        src = _operand(src)
        dst._rt.launch(lambda: np.copyto(dst._host, src, casting=casting))

    def zeros(shape, dtype=float, order="C"):
        array = runtime.allocate(np.zeros(shape, dtype, order))
        runtime.launch(lambda: array._host.fill(0), done=array)  # a memset
        return array

    def empty(shape, dtype=float, order="C"):
        buffer = np.empty(shape, dtype, order)
        _garbage(buffer)  # reused device memory is not zeros
        return runtime.allocate(buffer)

    def matmul(x1, x2, /, *, out=None):
        return _matmul(x1, x2, out=out)

    cupy.asarray, cupy.asnumpy, cupy.ascontiguousarray = asarray, asnumpy, ascontiguousarray
    cupy.copyto, cupy.zeros, cupy.empty, cupy.matmul = copyto, zeros, empty, matmul
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
                if isinstance(a, DeviceArray):
                    assert a.flags.c_contiguous, "the LSTM kernels take contiguous arrays"
                    converted.append(ctypes.c_void_p(a._host.ctypes.data))
                elif isinstance(a, np.int32):
                    converted.append(int(a))
                elif isinstance(a, (np.float32, np.float64)):
                    expected = np.float32 if self.scalar is ctypes.c_float else np.float64
                    assert type(a) is expected, f"scalar {type(a)} for a {self.scalar} kernel"
                    converted.append(self.scalar(a))
                else:  # a host array among them included, as CuPy refuses one
                    raise _unsupported(a)
            self.launches += 1
            # The arrays stay referenced as long as a graph may replay the launch.
            runtime.launch(lambda arrays=args: self.function(*converted))

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
            runtime.refuse_in_capture("a device synchronisation")

    class Event:
        """Host-clock events: everything here runs synchronously."""

        def record(self, stream=None) -> None:
            self.at = time.perf_counter()

        def synchronize(self) -> None:
            runtime.refuse_in_capture("an event synchronisation")

    class Graph:
        """A captured graph: ``launch`` runs the recorded work again, in order, into the
        arrays the capture allocated."""

        def __init__(self, recorded: list) -> None:
            self._recorded = recorded

        def launch(self, stream=None) -> None:
            for work in self._recorded:
                runtime.launch(work)

    class Stream:
        """Work runs at once on every stream (the host is synchronous), except while this
        thread's current stream captures: then device work is recorded, not run, and host
        copies and synchronisation fail, as CUDA's stream capture has them."""

        def __init__(self, *, non_blocking: bool = False) -> None:
            self.capturing = False
            self.recorded: list = []
            self._outer: list = []

        def __enter__(self) -> Stream:
            self._outer.append(getattr(runtime.current, "stream", None))
            runtime.current.stream = self
            return self

        def __exit__(self, *exc) -> None:
            runtime.current.stream = self._outer.pop()

        def synchronize(self) -> None:
            runtime.refuse_in_capture("a stream synchronisation")

        def begin_capture(self) -> None:
            assert getattr(runtime.current, "capturing", None) is None, "nested capture"
            self.capturing, self.recorded = True, []
            runtime.current.capturing = self

        def end_capture(self) -> Graph:
            assert self.capturing, "end_capture without begin_capture"
            self.capturing = False
            runtime.current.capturing = None
            return Graph(self.recorded)

    class MemoryPool:
        """A private pool: counts the bytes of every device buffer allocated while it is
        the allocator (``using_allocator(pool.malloc)``), temporaries included (a capture's
        too: the graph keeps them)."""

        def __init__(self) -> None:
            self.allocated = 0

        def malloc(self, size: int) -> None:
            self.allocated += size

        def total_bytes(self) -> int:
            return self.allocated

    @contextlib.contextmanager
    def using_allocator(allocator=None):
        previous = getattr(runtime.current, "malloc", None)
        runtime.current.malloc = allocator
        try:
            yield
        finally:
            runtime.current.malloc = previous

    cupy.__version__ = "0.0-fake"
    cupy.RawModule = RawModule
    cupy.get_default_memory_pool = lambda: runtime.default_pool
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
    sys.modules.pop("gradserve.kernels.backend_cuda", None)
    package.__dict__.pop("backend_cuda", None)
    try:
        importlib.import_module("gradserve.kernels.backend_cuda")
        yield fake
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        if saved_attr is None:
            package.__dict__.pop("backend_cuda", None)
        else:
            package.backend_cuda = saved_attr
