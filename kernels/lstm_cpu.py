"""The CPU forward of the block LSTM: ``backend_numpy.forward_sequence``.

``lstm.block_lstm_forward`` hands the recurrence of a whole sequence to this module
on the NumPy backend (the CUDA backend runs the generic per-step loop). It computes
the same function (``lstm``'s docstring states the gates) in one of several
*formulations*, chosen per shape by measuring them, as cuDNN picks its algorithms:

* ``HOISTED``: the input projection ``x @ W_x`` of a chunk of steps is one GEMM into a
  warm workspace; each step adds one ``h @ W_h`` GEMM to its rows of it.
* ``HOISTED_T``: the same, but the per-step GEMM in transposed form, ``W_h^T @ h^T``
  into a [4H, B] buffer, transposed back while adding the projection. OpenBLAS packs
  these operands differently: on the project's machine this GEMM alone ran 7-11%
  (OpenBLAS's Haswell kernels) and 27-46% (its SkylakeX kernels) faster at the two
  benchmark sizes; whether that pays for the transposition is the planner's call.
* ``CONCAT``: TensorFlow's; per step one ``[x_t, h] @ W`` GEMM, twice as deep.
* ``FUSED``: the weights packed once per call into panels of a few units by the four
  gates, and each step one call of the compiled step (``lstm_cpu_step.c``) that
  computes ``h @ W_h`` tile by tile in registers and turns each tile into its outputs
  while it is in cache. BLAS packs W_h again on every step's GEMM (a megabyte at 256
  units, for 32 rows) and the step then reads the gates back from memory; on the
  project's machine a step at (32, 256) took 129-138 against 179-183 us. The input
  projection is hoisted as in ``HOISTED`` (the BLAS's, with its threads), and where
  the BLAS's threads sleep soon after a call a team of threads shares each step
  (``fused_team``). Subnormal floats are read and written as zero
  (``native.flushing_subnormals``), as TensorFlow's CPU kernels compute. float32
  with the compiled step only: elsewhere
  (float64, NumPy's pass) it computes as ``HOISTED``, and the planner measures it only
  where it can run.

Each step then runs one elementwise pass on the gate pre-activations. The ``i``, ``f``
and ``o`` columns of the weights, bias and peepholes are halved once per call, so that
``sigmoid(z) = 0.5 * tanh(z / 2) + 0.5`` needs no per-step halving (halving is exact
in binary floating point: the results equal the unscaled formula's).

The choice is measured once per (batch, input size, units, dtype, BLAS threads,
peepholes) on the first call and cached (``Planner``). Buffers that do not outlive a
call (prepared weights, the projection chunk, gate scratch) come from a small bounded
cache of warm workspaces (``Workspaces``): the first touch of fresh pages cost more
than the hoisted GEMM saved at (100, 64, 512). Both caches are thread-safe; a
workspace serves one call at a time.

The seven outputs outlive the call (they are returned or kept in a session), so they
cannot come from a cache; but their pages can be warm: every forward and backward
calls ``gradserve.heap.keep_warm`` (once per process), so freed outputs are reused
warm instead of page-faulting afresh (4 ms of a 10-16 ms forward at (50, 32, 256)).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import enum
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradserve import heap, pauses
from gradserve.kernels import blas_threads as blas
from gradserve.kernels import native
from gradserve.kernels.lstm import Empty

Array = Any  # numpy.ndarray; ``Any`` as in backend_numpy (in-place ufunc annotations)
Offsets = tuple[int, int, int, int]

#: Bytes of one input-projection GEMM's output in the hoisted formulations and FUSED (a
#: chunk of whole steps; one step where a step is more). Few GEMMs: each wakes the
#: BLAS's threads, which then spin beside FUSED's team. FUSED with two threads, all
#: steps' projection at once against 512 rows a GEMM: 7.0 against 7.5 ms at (50, 32,
#: 256), 7.9 against 8.8 after 0.2 s idle; at (100, 64, 512) 1,024-6,400 rows were
#: within noise (88-94 ms), the whole sequence 52 MB of warm workspace. HOISTED and
#: HOISTED_T: neutral (0.99-1.10, a review helper). The chunk follows the input's steps,
#: not ``seq_len_max``: so calls of one shape share one workspace key.
CHUNK_BYTES = 8 << 20
#: FUSED's steps of one compiled call (``native.fused_steps``): as many as make about
#: ``CALL_FLOPS`` of the recurrent GEMM's (a millisecond on the project's machine's
#: core) and read ``CALL_BYTES`` of packed W_h (where a small batch makes the steps
#: memory-bound: 8-22 ms between checks at batch 1 and 1,024-1,536 units without it, a
#: review helper), at most ``MAX_STEPS_PER_CALL``. A call per step cost about 5 us a
#: step from Python (a quarter of a step at (500, 8, 128)); ``check`` (the call's
#: liveness, and where the server's ops may pause for others: ``--compute-quantum``,
#: 50 ms) runs between calls, so a call must stay short.
CALL_FLOPS = 200_000_000
CALL_BYTES = 8 << 20
MAX_STEPS_PER_CALL = 16
#: Bytes of warm workspaces kept between calls, all shapes together (LRU beyond).
WORKSPACE_CACHE_BYTES = 64 << 20
#: Shapes whose formulation choice is remembered (LRU beyond).
PLAN_CACHE_ENTRIES = 256
#: Rows of W_h transposed at a time when preparing ``HOISTED_T``'s W_h^T.
TRANSPOSE_STRIP_ROWS = 16
#: Steps and rounds of a measurement: each candidate runs a prefix of the sequence.
PROBE_STEPS = 24
PROBE_ROUNDS = 3
#: A call waiting for another's measurement of its shape checks this often.
PLAN_WAIT_CHECK_SECONDS = 0.01
#: Bytes to which FUSED's packed weights are aligned: a cache line.
PACK_ALIGNMENT = 64


class Formulation(enum.Enum):
    """How the gate pre-activations of a step are computed (module docstring)."""

    HOISTED = "hoisted"
    HOISTED_T = "hoisted-t"
    CONCAT = "concat"
    FUSED = "fused"


@dataclass
class Workspace:
    """The buffers of one call of one shape and formulation (contents not kept)."""

    w: Array  # prepared weights: [I + H, 4H]
    w_h_t: Array  # HOISTED_T: prepared W_h^T, [4H, H] (else empty)
    b: Array  # prepared bias: [4H]
    peep: Array  # prepared peepholes wci, wcf, wco: [3, H]
    proj: Array  # HOISTED*, FUSED: a chunk of steps' projection; CONCAT: [B, I + H] of [x, h]
    gates: Array  # one step's pre-activations: [B, 4H]
    gates_t: Array  # HOISTED_T: h @ W_h transposed, [4H, B] (else empty)
    tmp: Array  # [B, H] scratch
    packed: Array  # FUSED: W_h packed for its step, 64-byte aligned (else empty)

    def arrays(self) -> tuple[Array, ...]:
        return (self.w, self.w_h_t, self.b, self.peep, self.proj, self.gates, self.gates_t,
                self.tmp, self.packed)  # fmt: skip

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


WorkspaceKey = tuple[Formulation, int, int, int, int, str]


class Workspaces:
    """A bounded, thread-safe cache of warm workspaces, keyed by shape and formulation.

    ``take`` hands a workspace to one caller (a cached one, else a new one);
    ``give`` returns it for reuse. At most ``limit_bytes`` are kept, least recently
    returned dropped first; a workspace larger than the limit is never kept.
    """

    def __init__(self, limit_bytes: int = WORKSPACE_CACHE_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._free: collections.OrderedDict[WorkspaceKey, list[Workspace]] = (
            collections.OrderedDict()
        )
        self._bytes = 0  # bytes of the workspaces in _free

    def take(self, key: WorkspaceKey) -> Workspace:
        with self._lock:
            free = self._free.get(key)
            if free:
                ws = free.pop()
                self._bytes -= ws.nbytes
                if not free:
                    del self._free[key]
                return ws
        return _new_workspace(key)

    def give(self, key: WorkspaceKey, ws: Workspace) -> None:
        if ws.nbytes > self.limit_bytes:
            return
        with self._lock:
            self._free.setdefault(key, []).append(ws)
            self._free.move_to_end(key)
            self._bytes += ws.nbytes
            while self._bytes > self.limit_bytes:
                old_key, old = next(iter(self._free.items()))
                self._bytes -= old.pop(0).nbytes
                if not old:
                    del self._free[old_key]

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return self._bytes


def _new_workspace(key: WorkspaceKey) -> Workspace:
    form, chunk, batch, inputs, units, dtype_str = key
    dt = np.dtype(dtype_str)
    transposed = form is Formulation.HOISTED_T
    fused = form is Formulation.FUSED
    gates = 4 * units
    if form is Formulation.CONCAT:
        proj = np.empty((batch, inputs + units), dt)
    else:
        proj = np.empty((chunk * batch, gates), dt)
    return Workspace(
        w=np.empty((inputs + units, gates), dt),
        w_h_t=np.empty((gates, units) if transposed else (0,), dt),
        b=np.empty((gates,), dt),
        peep=np.empty((3, units), dt),
        proj=proj,
        gates=np.empty((0, gates) if fused else (batch, gates), dt),
        gates_t=np.empty((gates, batch) if transposed else (0,), dt),
        tmp=np.empty((0,) if fused else (batch, units), dt),
        packed=aligned_empty(native.packed_floats(units, units) if fused else 0, dt),
    )


def aligned_empty(count: int, dtype: np.dtype[Any], empty: Empty = np.empty) -> Array:
    """``count`` elements starting at a multiple of ``PACK_ALIGNMENT`` bytes (from
    ``empty``): the compiled step's vector loads of a panel then never straddle two
    cache lines (with NumPy's 16-byte alignment they did, and its GEMM ran at 142
    against 154 GFLOP/s)."""
    pad = PACK_ALIGNMENT // dtype.itemsize
    raw = empty((count + pad,), dtype)
    start = (-raw.ctypes.data % PACK_ALIGNMENT) // dtype.itemsize
    return raw[start : start + count]


PlanKey = tuple[int, int, int, str, int | None, bool, bool]
#: ``_run`` with its arrays and attributes bound: (formulation, steps, check).
Run = Callable[[Formulation, int, Callable[[], None] | None], None]


class Planner:
    """The formulation per shape, measured once (thread-safe; bounded, LRU)."""

    def __init__(self, candidates: Sequence[Formulation] = tuple(Formulation)) -> None:
        self.candidates = tuple(candidates)
        self._lock = threading.Lock()
        self._plans: collections.OrderedDict[PlanKey, Formulation] = collections.OrderedDict()
        #: Per key, the seconds each candidate took on its probe (for the benchmark).
        self.measured: dict[PlanKey, dict[Formulation, float]] = {}
        self._measuring: dict[PlanKey, threading.Event] = {}

    def plan(
        self,
        key: PlanKey,
        measure: Callable[[], dict[Formulation, float]],
        check: Callable[[], None] | None = None,
    ) -> Formulation:
        """The formulation of ``key``, measured (``measure``) by the first call of the
        key. Calls that come while it measures wait for its choice: each choosing for
        itself, two calls of one shape computed other bits (the formulations sum in
        different orders). If the measuring call fails, the next one measures. A call
        that waits runs its ``check`` every ``PLAN_WAIT_CHECK_SECONDS``: its deadline
        holds there, and it may pause there (``gradserve.pauses``) for the measuring
        call, which may itself be paused between its timed runs (helper-82: a waiter
        given the paused one's slot waited for it, holding the slot, for ever)."""
        while True:
            with self._lock:
                form = self._plans.get(key)
                if form is not None:
                    self._plans.move_to_end(key)
                    return form
                pending = self._measuring.get(key)
                if pending is None:
                    pending = self._measuring[key] = threading.Event()
                    break
            while not pending.wait(PLAN_WAIT_CHECK_SECONDS):
                if check is not None:
                    check()
        try:
            return self.record(key, measure())
        finally:
            with self._lock:
                del self._measuring[key]
            pending.set()

    def lookup(self, key: PlanKey) -> Formulation | None:
        with self._lock:
            form = self._plans.get(key)
            if form is not None:
                self._plans.move_to_end(key)
            return form

    def record(self, key: PlanKey, timings: dict[Formulation, float]) -> Formulation:
        best = min(timings, key=lambda f: timings[f])
        with self._lock:
            self._plans[key] = best
            self._plans.move_to_end(key)
            self.measured[key] = timings
            while len(self._plans) > PLAN_CACHE_ENTRIES:
                old, _ = self._plans.popitem(last=False)
                self.measured.pop(old, None)
        return best

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.measured.clear()


WORKSPACES = Workspaces()
PLANNER = Planner()

#: The formulation of the forwards run in this context, instead of the planner's timed
#: choice: a server started with ``--lstm-formulation`` sets it around each op
#: (``compute.Compute``). The formulations sum in different orders, and a timed choice
#: may differ between processes (a noisy probe, another machine's load), so replicas,
#: or one server before and after a restart, could return other last bits for the
#: same call; pinned, they all compute the same (given the BLAS library, its thread
#: count and the CPU). None: the planner's choice.
PINNED: contextvars.ContextVar[Formulation | None] = contextvars.ContextVar(
    "gradserve_lstm_formulation", default=None
)


#: The elementwise pass of the forwards run in this context (``native.Mode``): a
#: server sets its ``--cpu-step-kernel`` around each op (``compute.Compute``), as
#: ``PINNED``. The compiled step and NumPy's pass give other last bits.
STEP_KERNEL: contextvars.ContextVar[native.Mode] = contextvars.ContextVar(
    "gradserve_cpu_step_kernel", default=native.Mode.AUTO
)


def blas_threads() -> int | None:
    """The BLAS thread count of the plan key, since the best formulation differs
    between 1 and 2 threads: the process's count, not an op's share of it while others
    compute beside it (``blas.BLAS.share``). The formulations sum in different
    orders, so a key that followed the share gave an op other bits under load."""
    return blas.BLAS.plan_count()


def forward_sequence(
    x: Array, cs_prev: Array, h_prev: Array, w: Array, wci: Array, wcf: Array, wco: Array,
    b: Array, outs: Sequence[Array], *, length: int, offsets: Offsets, forget_bias: float,
    cell_clip: float, use_peephole: bool, check: Callable[[], None] | None = None,
    formulation: Formulation | None = None,
) -> None:  # fmt: skip
    """Steps 0 .. ``length - 1`` of the forward into ``outs`` (i, cs, f, o, ci, co, h,
    each [T, B, H], in the compute dtype; ``length`` >= 1). ``check`` runs before every
    step. ``formulation`` None: the one ``PINNED`` in this context, else the planner's
    choice for this shape (measured now on a first call)."""
    heap.keep_warm()
    steps, batch, inputs = x.shape
    units = cs_prev.shape[1]
    run: Run = functools.partial(
        _run, x, cs_prev, h_prev, w, wci, wcf, wco, b, outs, offsets=offsets,
        forget_bias=forget_bias, cell_clip=cell_clip, use_peephole=use_peephole,
    )  # fmt: skip
    if formulation is None:
        formulation = PINNED.get()
    if formulation is None:
        compiled = _native_step(x, outs, units) is not None
        key: PlanKey = (batch, inputs, units, x.dtype.str, blas_threads(), use_peephole, compiled)
        candidates = _candidates(compiled)
        measure = functools.partial(_measure, run, candidates, length, check)
        formulation = PLANNER.plan(key, measure, check)
    run(formulation, length, check)


def _candidates(compiled: bool) -> tuple[Formulation, ...]:
    """The planner's candidates for a call, FUSED as HOISTED where the compiled step
    does not serve it (``compiled`` false: ``_run`` computes it so)."""

    def served(form: Formulation) -> Formulation:
        return Formulation.HOISTED if form is Formulation.FUSED and not compiled else form

    return tuple(dict.fromkeys(served(form) for form in PLANNER.candidates))


def _measure(
    run: Run, candidates: Sequence[Formulation], length: int, check: Callable[[], None] | None
) -> dict[Formulation, float]:
    """Seconds per candidate: the best of ``PROBE_ROUNDS`` interleaved runs of a prefix
    of the sequence (the real call then overwrites the outputs)."""
    probe = min(length, PROBE_STEPS)
    best = {f: float("inf") for f in candidates}
    run(candidates[0], probe, check)  # warms the workspaces and caches
    for _ in range(PROBE_ROUNDS):
        for form in candidates:
            # A pause inside a timed run would be timed; between runs the op may
            # pause (a call of a new shape measures for ~10 calls of ``probe`` steps:
            # unpaused throughout, a tenant changing its batch size every call held
            # the compute slot for whole seconds, helper-81).
            if check is not None:
                check()
            with pauses.unpaused():
                t0 = time.perf_counter()
                run(form, probe, check)
                best[form] = min(best[form], time.perf_counter() - t0)
    return best


def _native_step(x: Array, outs: Sequence[Array], units: int) -> Any | None:
    """The compiled elementwise step if it serves this call (float32, outputs
    contiguous and of [T, B, H] with x's T and B, ``STEP_KERNEL`` not NumPy's, a
    library built here), else None: NumPy's pass. (A server with ``native`` refused
    to start without the library.)"""
    if STEP_KERNEL.get() is native.Mode.NUMPY or x.dtype != np.float32:
        return None
    shape = (*x.shape[:2], units)
    if not all(o.dtype == np.float32 and o.flags.c_contiguous and o.shape == shape for o in outs):
        return None
    lib = native.NATIVE.library()
    return None if lib is None else getattr(lib, native.STEP)


def _chunk_steps(batch: int, units: int, itemsize: int, steps: int) -> int:
    return max(1, min(steps, CHUNK_BYTES // max(1, batch * 4 * units * itemsize)))


def _run(
    x: Array, cs_prev: Array, h_prev: Array, w: Array, wci: Array, wcf: Array, wco: Array,
    b: Array, outs: Sequence[Array], form: Formulation, length: int,
    check: Callable[[], None] | None, *, offsets: Offsets, forget_bias: float,
    cell_clip: float, use_peephole: bool,
) -> None:  # fmt: skip
    """Steps 0 .. ``length - 1`` in formulation ``form``, in a workspace of the cache
    (FUSED as HOISTED where the compiled step does not serve the call)."""
    steps, batch, inputs = x.shape
    units = cs_prev.shape[1]
    if form is Formulation.FUSED and _native_step(x, outs, units) is None:
        form = Formulation.HOISTED
    chunk = 1 if form is Formulation.CONCAT else _chunk_steps(batch, units, x.itemsize, steps)
    key: WorkspaceKey = (form, chunk, batch, inputs, units, x.dtype.str)
    ws = WORKSPACES.take(key)
    try:
        fused = form is Formulation.FUSED
        flushing = native.flushing_subnormals() if fused else contextlib.nullcontext()
        teamed = fused_team(batch, units) if fused else contextlib.nullcontext()
        # x without subnormals where BLAS threads other than this (flushing) one may
        # compute the projection: the process has more than one, or its count is unknown
        # (``zero_subnormals``; W_x comes out of ``_prepare``'s pass so).
        flush = fused and (blas_threads() or 2) > 1
        with flushing, teamed as team:
            _prepare(ws, form, w, b, wci, wcf, wco, offsets, units, forget_bias)
            _recur(ws, form, chunk, x, cs_prev, h_prev, outs, length, offsets, cell_clip,
                   use_peephole, check, team, flush)  # fmt: skip
    finally:
        WORKSPACES.give(key, ws)


def fused_team(
    batch: int, units: int, backward: bool = False
) -> contextlib.AbstractContextManager[int | None]:
    """FUSED's team of threads for a call (a forward or a ``backward``): as many as the
    op's BLAS threads now (its share of them with ``--share-blas-threads``), but no
    more than a step has claims (each member wakes every step), where the BLAS threads
    sleep soon after a call
    (``BlasThreads.sleep_soon``: the server's setting). Where they spin on (OpenBLAS's
    default: 0.1 s after each call), a team computed on the cores they spun on: 10-15
    against 7 ms a call at (50, 32, 256), two threads. None: the caller computes alone."""
    if not blas.BLAS.sleep_soon():
        return contextlib.nullcontext()
    claims = native.step_claims(batch, units, backward)
    return native.TEAMS.team(min(blas.BLAS.count() or 1, claims))


def _prepare(
    ws: Workspace, form: Formulation, w: Array, b: Array, wci: Array, wcf: Array, wco: Array,
    offsets: Offsets, units: int, forget_bias: float,
) -> None:  # fmt: skip
    """Weights, bias (with the forget bias) and peepholes, sigmoid gates halved; FUSED's
    packed W_h. Weights and bias in one pass by a column's factor (0.5, the c gate's
    1): by arithmetic, so that in FUSED's flushing thread every subnormal of them is
    written as a zero of its sign, and the BLAS's threads, which do not flush, get no
    subnormal W_x (``zero_subnormals``; a copy of the c gate's kept them, and a forward
    with two BLAS threads took 146.5 ms against 8.3)."""
    off_c, off_f = offsets[2], offsets[1]
    factors = np.full(4 * units, 0.5, ws.w.dtype)
    factors[off_c : off_c + units] = 1.0
    np.multiply(w, factors, out=ws.w)
    np.multiply(b, factors, out=ws.b)
    if forget_bias:
        ws.b[off_f : off_f + units] += 0.5 * forget_bias
    for row, p in enumerate((wci, wcf, wco)):
        np.multiply(p, 0.5, out=ws.peep[row])
    if form is Formulation.HOISTED_T:
        transpose_into(ws.w[w.shape[0] - units :], ws.w_h_t)
    elif form is Formulation.FUSED:
        native.pack(ws.w[w.shape[0] - units :], offsets, ws.packed)


def steps_per_call(batch: int, units: int) -> int:
    """FUSED's steps of one compiled call, forward or backward (their recurrent GEMMs
    have the same size): ``CALL_FLOPS`` of it, ``CALL_BYTES`` of packed W_h read, at
    most ``MAX_STEPS_PER_CALL``."""
    flops, w_h_bytes = 2 * batch * units * 4 * units, 4 * units * units * 4
    by_flops, by_bytes = CALL_FLOPS // max(1, flops), CALL_BYTES // max(1, w_h_bytes)
    return max(1, min(MAX_STEPS_PER_CALL, by_flops, by_bytes))


def _project(out: Array, x: Array, t: int, n: int, w_x: Array, flush: bool) -> Array:
    """Steps t .. t + n - 1's input projection x @ W_x into ``out``'s first rows (those
    rows returned); ``flush``: x read as ``without_subnormals``."""
    batch, inputs = x.shape[1:]
    proj = out[: n * batch]
    x_rows = x[t : t + n].reshape(n * batch, inputs)
    np.matmul(without_subnormals(x_rows) if flush else x_rows, w_x, out=proj)
    return proj


def without_subnormals(a: Array) -> Array:
    """``a`` as TensorFlow's CPU kernels read it, for a BLAS GEMM of FUSED (float32, the
    library built): ``a`` itself where it holds no subnormal float
    (``native.any_subnormal``, one scan), else a copy with each as a zero of its sign
    (``zero_subnormals``)."""
    contiguous = np.ascontiguousarray(a)
    if not native.any_subnormal(contiguous):
        return a
    flushed = contiguous.copy()
    zero_subnormals(flushed)
    return flushed


def zero_subnormals(a: Array) -> None:
    """``a``'s subnormal floats as zeros of their sign, in place: FUSED's steps read them
    so (flush-to-zero and denormals-are-zero, as TensorFlow's CPU kernels), but the
    BLAS's threads that compute its input projection (x) and the backward's GEMMs
    after the recurrence (W_x, x, h) do not, and each multiply-add with one takes a
    microcode assist there: at (50, 32, 256) a backward of subnormal weights took 120
    ms against 11, a forward with two BLAS threads of subnormal inputs 557.6 against
    8.2 (a review helper). The callers scan first (``native.any_subnormal``): most
    arrays hold none; the forward only where the process has more than one BLAS thread
    (with one, the projection is computed in the flushing thread itself). float32, by
    its bits: in a flushing thread (FUSED's calls) NumPy's comparisons read a
    subnormal as zero too, and a test of ``a != 0`` found none."""
    bits = a.view(np.uint32)
    subnormal = ((bits & 0x7F800000) == 0) & ((bits & 0x007FFFFF) != 0)
    bits[subnormal] &= np.uint32(0x80000000)


def transpose_into(matrix: Array, out: Array) -> None:
    """``matrix.T`` into ``out``, in strips of ``TRANSPOSE_STRIP_ROWS`` rows: one
    transposed copy of the whole matrix strides through all of it per output row, and
    ran 3-4x slower (0.59 against 0.16 ms for [256, 1024] float32 here)."""
    for k in range(0, matrix.shape[0], TRANSPOSE_STRIP_ROWS):
        np.copyto(out[:, k : k + TRANSPOSE_STRIP_ROWS], matrix[k : k + TRANSPOSE_STRIP_ROWS].T)


def _recur(
    ws: Workspace, form: Formulation, chunk: int, x: Array, cs_prev: Array, h_prev: Array,
    outs: Sequence[Array], length: int, offsets: Offsets, cell_clip: float,
    use_peephole: bool, check: Callable[[], None] | None, team: int | None, flush: bool,
) -> None:  # fmt: skip
    steps, batch, inputs = x.shape
    units = cs_prev.shape[1]
    out_i, out_cs, out_f, out_o, out_ci, out_co, out_h = outs
    w_x, w_h = ws.w[:inputs], ws.w[inputs:]
    g = ws.gates
    gi, gf, gc, go = (g[:, off : off + units] for off in offsets)
    wci, wcf, wco = ws.peep
    tmp = ws.tmp
    step = _native_step(x, outs, units)
    if step is not None:
        # (the C step reads [B, H]: one NumPy broadcasts, a row of [1, H] say, is spread)
        cs_prev = np.ascontiguousarray(np.broadcast_to(cs_prev, (batch, units)), np.float32)
        bases = [o.ctypes.data for o in outs]  # i, cs, f, o, ci, co, h
        row_bytes = batch * units * x.dtype.itemsize
        peep_ptr = ws.peep.ctypes.data if use_peephole else None
        gates_ptr, gates_stride = g.ctypes.data, g.shape[1]
        bias_ptr = ws.b.ctypes.data
        clip = float(cell_clip) if cell_clip > 0 else 0.0
        if form is Formulation.FUSED:
            fused_steps = native.fused_steps()
            h_prev = np.ascontiguousarray(np.broadcast_to(h_prev, (batch, units)), np.float32)
            packed_ptr = ws.packed.ctypes.data
            proj_row = ws.proj.strides[0]

            # A chunk's projection, then its steps several a call (``steps_per_call``),
            # ``check`` before each.
            per_call = steps_per_call(batch, units)
            for t in range(0, length, chunk):
                n = min(chunk, length - t)
                if check is not None:
                    check()
                proj = _project(ws.proj, x, t, n, w_x, flush)
                for s in range(0, n, per_call):
                    if s and check is not None:
                        check()
                    at = (t + s) * row_bytes
                    c_ptr = cs_prev.ctypes.data if t + s == 0 else bases[1] + at - row_bytes
                    h_ptr = h_prev.ctypes.data if t + s == 0 else bases[6] + at - row_bytes
                    fused_steps(
                        team, min(per_call, n - s), h_ptr, c_ptr, packed_ptr,
                        proj.ctypes.data + s * batch * proj_row, proj.shape[1], bias_ptr,
                        peep_ptr, batch, units, *offsets, clip, *(base + at for base in bases),
                    )  # fmt: skip
            return

    for t in range(length):
        if check is not None:
            check()
        c_last = cs_prev if t == 0 else out_cs[t - 1]
        h_last = h_prev if t == 0 else out_h[t - 1]
        if form is Formulation.CONCAT:
            xh = ws.proj
            xh[:, :inputs] = x[t]
            xh[:, inputs:] = h_last
            np.matmul(xh, ws.w, out=g)
            add_ptr, add_stride = None, 0
            if step is None:
                g += ws.b
        else:
            k = t % chunk
            if k == 0:  # the input projection of the next chunk of steps, bias added
                proj = _project(ws.proj, x, t, min(chunk, length - t), w_x, flush)
                if step is None:  # (the compiled step adds the bias itself)
                    proj += ws.b
            proj_t = ws.proj[k * batch : (k + 1) * batch]
            if form is Formulation.HOISTED_T:
                np.matmul(ws.w_h_t, h_last.T, out=ws.gates_t)
                np.add(ws.gates_t.T, proj_t, out=g)
                add_ptr, add_stride = None, 0
            else:
                np.matmul(h_last, w_h, out=g)
                if step is not None:  # the projection added by the step
                    add_ptr, add_stride = proj_t.ctypes.data, proj_t.shape[1]
                else:
                    g += proj_t
        if step is not None:
            at = t * row_bytes
            c_ptr = cs_prev.ctypes.data if t == 0 else bases[1] + at - row_bytes
            step(
                gates_ptr, gates_stride, add_ptr, add_stride, bias_ptr, c_ptr, peep_ptr, batch,
                units, *offsets, clip, *(base + at for base in bases),
            )  # fmt: skip
            continue
        i, f, o, ci = out_i[t], out_f[t], out_o[t], out_ci[t]
        cs, co, h = out_cs[t], out_co[t], out_h[t]
        if use_peephole:
            np.multiply(c_last, wci, out=tmp)
            gi += tmp
            np.multiply(c_last, wcf, out=tmp)
            gf += tmp
        _half_tanh_sigmoid(gi, i)
        _half_tanh_sigmoid(gf, f)
        np.tanh(gc, out=ci)
        np.multiply(i, ci, out=cs)
        np.multiply(f, c_last, out=tmp)
        cs += tmp
        if cell_clip > 0:
            np.clip(cs, -cell_clip, cell_clip, out=cs)
        np.tanh(cs, out=co)
        if use_peephole:
            np.multiply(cs, wco, out=tmp)
            go += tmp
        _half_tanh_sigmoid(go, o)
        np.multiply(o, co, out=h)


def _half_tanh_sigmoid(z_half: Array, out: Array) -> None:
    """sigmoid(z) into ``out`` from ``z / 2``: 0.5 * tanh(z / 2) + 0.5 (no exp, no
    overflow for any z)."""
    np.tanh(z_half, out=out)
    out *= 0.5
    out += 0.5
