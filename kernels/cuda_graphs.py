"""Whole LSTM calls replayed as CUDA graphs (``--cuda-graphs on``).

Why: every time step of the eager loop of ``kernels.lstm`` is a cuBLAS call and
a kernel launch issued from Python, and at (B, H) = (64, 512) the GPU work of a
step is small, so the loop is expected to be bound by the host (not yet
measured: ``make gpu-check`` times both, with the host's enqueue time). A graph
captured once per shape issues all steps of a call in one launch.

How: one *plan* per (direction, input shapes and dtypes, attributes). Building
a plan allocates static input buffers, runs the algorithm on them once eagerly
(that run answers the call that built the plan, and loads kernels and cuBLAS
handles outside the capture), then captures a second run. Everything the plan
allocates comes from a memory pool private to it, so no other allocation can
take an address the graph has baked in. A later call copies its inputs into
the static buffers, launches the graph on the caller's stream and returns
copies of the outputs. Plans live in an LRU bounded by their bytes; a plan
serves one call at a time; a shape whose capture fails runs eagerly from then
on (a capture that runs out of memory is retried on a later call), so graphs
never fail a call that the eager path would serve.

``GraphCache`` needs only ``capture(fn) -> (replay, outputs)``, where
``replay()`` recomputes ``fn`` into the ``outputs`` the capture returned:
``StreamCapture`` is the CUDA one; CI drives the plan logic with a capture that
replays by calling ``fn`` again and copying its results into those outputs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gradserve import pauses
from gradserve.kernels import lstm

log = logging.getLogger(__name__)

#: GPU bytes all plans together may hold unless configured otherwise.
DEFAULT_CACHE_BYTES = 1 << 30  # the --cuda-graph-cache-bytes default (server config)
#: Most plans kept (each also holds driver resources its bytes do not show), and most
#: shapes remembered as eager-only: both bounded, whatever shapes clients send.
MAX_PLANS = 256
MAX_EAGER_KEYS = 4096

Capture = Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]]
#: A plan's key: (algorithm, the inputs' shapes and dtypes, the attributes).
Key = tuple[Any, ...]
#: ``_forward`` or ``_backward``: (backend, *arrays, **attrs) -> result tuple.
Algorithm = Callable[..., Any]


class StreamCapture:
    """CUDA stream capture of ``fn`` on a side stream. The outputs are the arrays ``fn``
    returned while captured (allocated, not computed); the replay is the graph's
    ``launch``, which computes into them on the stream current when it is called."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def __call__(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        cuda = self.cupy.cuda
        stream = cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                outputs = fn()
            except BaseException:
                with contextlib.suppress(Exception):
                    stream.end_capture()
                raise
            graph = stream.end_capture()
        return graph.launch, outputs  # launch() uses the stream current at the call


@dataclasses.dataclass
class _Plan:
    inputs: list[Any]  # static input buffers, in the algorithm's argument order
    outputs: tuple[Any, ...]  # LSTMActivations / LSTMGrads: the graph's result buffers
    replay: Callable[[], None]
    nbytes: int
    pool: Any  # keeps the private memory alive as long as the plan
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def _forward(backend: lstm.Backend, *arrays: Any, **attrs: Any) -> lstm.LSTMActivations[Any]:
    """``lstm.block_lstm_forward`` on the flat argument list a plan keeps."""
    return lstm.block_lstm_forward(backend, lstm.LSTMInputs(*arrays), **attrs)


def _backward(backend: lstm.Backend, *arrays: Any, **attrs: Any) -> lstm.LSTMGrads[Any]:
    """``lstm.block_lstm_backward`` on the flat argument list a plan keeps."""
    inputs, activations, grads = arrays[:8], arrays[8:15], arrays[15:]
    return lstm.block_lstm_backward(
        backend,
        lstm.LSTMInputs(*inputs),
        lstm.LSTMActivations(*activations),
        lstm.LSTMOutputGrads(*grads),
        **attrs,
    )


class GraphCache:
    """``forward`` / ``backward`` with ``kernels.lstm``'s signatures (minus the backend),
    served from captured graphs."""

    def __init__(
        self, backend: lstm.Backend, capture: Capture, max_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        self.backend = backend
        self.xp = backend.xp
        self.capture = capture
        self.max_bytes = max_bytes
        self._plans: collections.OrderedDict[Key, _Plan] = collections.OrderedDict()
        # Shapes that run eagerly (too big to cache, or capture failed), least recent first.
        self._eager: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self._lock = threading.Lock()  # the tables above
        self._build_lock = threading.Lock()  # one capture at a time
        self.captures = 0
        self.replays = 0

    # ------------------------------------------------------------------ API
    def forward(
        self,
        inputs: lstm.LSTMInputs[Any],
        *,
        check: Callable[[], None] | None = None,
        **attrs: Any,
    ) -> lstm.LSTMActivations[Any]:
        result: lstm.LSTMActivations[Any] = self._call(_forward, tuple(inputs), attrs, check)
        return result

    def backward(
        self,
        inputs: lstm.LSTMInputs[Any],
        activations: lstm.LSTMActivations[Any],
        output_grads: lstm.LSTMOutputGrads[Any],
        *,
        check: Callable[[], None] | None = None,
        **attrs: Any,
    ) -> lstm.LSTMGrads[Any]:
        arrays = (*inputs, *activations, *output_grads)
        result: lstm.LSTMGrads[Any] = self._call(_backward, arrays, attrs, check)
        return result

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for p in self._plans.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)

    # ------------------------------------------------------------------ internals
    def _call(
        self,
        algorithm: Algorithm,
        arrays: tuple[Any, ...],
        attrs: dict[str, Any],
        check: Callable[[], None] | None,
    ) -> Any:
        key = (
            algorithm.__name__,
            tuple((tuple(a.shape), np.dtype(a.dtype).str) for a in arrays),
            tuple(sorted(attrs.items())),
        )
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            eager = key in self._eager
            if eager:
                self._eager.move_to_end(key)
        if eager:
            return algorithm(self.backend, *arrays, check=check, **attrs)
        if plan is None:
            return self._build(key, algorithm, arrays, attrs, check)
        # A replay runs every step in one launch: the deadline is checked once, before.
        if check is not None:
            check()
        with plan.lock:
            self._copy_in(plan.inputs, arrays)
            plan.replay()
            with self._lock:
                self.replays += 1
            return type(plan.outputs)(*(out.copy() for out in plan.outputs))

    def _build(
        self,
        key: Key,
        algorithm: Algorithm,
        arrays: tuple[Any, ...],
        attrs: dict[str, Any],
        check: Callable[[], None] | None,
    ) -> Any:
        """Build and keep the plan for ``key``; returns this call's result (its eager run)."""
        xp = self.xp
        # (a pause here would hold the lock another principal's op then waits for while
        # it holds the slot the paused op waits for: helper-81)
        with self._build_lock, pauses.unpaused():
            with self._lock:
                built_meanwhile = key in self._plans or key in self._eager
            if built_meanwhile:  # by a concurrent call of the same shape
                return self._call(algorithm, arrays, attrs, check)
            pool = xp.cuda.MemoryPool()
            with xp.cuda.using_allocator(pool.malloc):
                inputs = [xp.empty(a.shape, a.dtype) for a in arrays]
                self._copy_in(inputs, arrays)
                first = algorithm(self.backend, *inputs, check=check, **attrs)
            result = type(first)(*(out.copy() for out in first))  # from the shared pool
            del first
            try:
                with xp.cuda.using_allocator(pool.malloc):
                    replay, outputs = self.capture(
                        lambda: algorithm(self.backend, *inputs, **attrs)
                    )
            except MemoryError as exc:  # no room for a plan now: try again on a later call
                log.warning("no GPU memory to capture an LSTM graph: %s", exc)
                return result
            except Exception as exc:  # noqa: BLE001 - the eager path serves this shape
                log.warning("LSTM call not capturable as a CUDA graph, runs eagerly: %s", exc)
                with self._lock:
                    self._remember_eager(key)
                return result
            nbytes = pool.total_bytes()  # inputs, outputs and every temporary of the graph
            with self._lock:
                self.captures += 1
                if nbytes > self.max_bytes:
                    log.info("LSTM graph of %d bytes is over the cache: runs eagerly", nbytes)
                    self._remember_eager(key)
                else:
                    self._plans[key] = _Plan(inputs, outputs, replay, nbytes, pool)
                    self._evict()
        return result

    def _evict(self) -> None:
        """Drop least recently used plans until the rest fit (caller holds ``_lock``)."""
        total = sum(p.nbytes for p in self._plans.values())
        while self._plans and (total > self.max_bytes or len(self._plans) > MAX_PLANS):
            _, plan = self._plans.popitem(last=False)
            total -= plan.nbytes

    def _remember_eager(self, key: Key) -> None:
        """(caller holds ``_lock``)"""
        self._eager[key] = None
        while len(self._eager) > MAX_EAGER_KEYS:
            self._eager.popitem(last=False)

    def _copy_in(self, statics: Sequence[Any], arrays: Sequence[Any]) -> None:
        for dst, src in zip(statics, arrays):
            if hasattr(src, "__cuda_array_interface__"):
                self.xp.copyto(dst, src)
            else:
                dst.set(np.ascontiguousarray(src))
