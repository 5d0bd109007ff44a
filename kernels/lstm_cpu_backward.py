"""The CPU backward's recurrence: ``backend_numpy.backward_sequence``.

``lstm.block_lstm_backward`` hands the per-step part of the backward (the gate
gradients of every step and the two carries) to this module on the NumPy backend;
the CUDA backend runs the generic loop of ``bwd_step`` kernels. Same math, arranged
for NumPy's costs.

Per step, TensorFlow's recursion (``lstm_ops.cc``, ``BlockLSTMGradOp``) is::

    dh  = dh_carry + h_grad[t]
    do  = o (1 - o) co dh
    dcs = (1 - co^2) o dh + dcs_carry + cs_grad[t] + do wco
    dci = (1 - ci^2) i dcs;  df = f (1 - f) cs[t-1] dcs;  di = i (1 - i) ci dcs
    dcs_carry = f dcs + di wci + df wcf
    dh_carry  = dgates[t] @ W_h^T

Every product there of the forward's activations alone (``o (1 - o) co``,
``(1 - co^2) o``, ``(1 - ci^2) i``, ``f (1 - f) cs[t-1]``, ``i (1 - i) ci``) does not
depend on the recursion. NumPy pays about as much per call as per pass over a [B, H]
array at the benchmark sizes (50 steps of ~30 passes over 32 KB: 4-5 ms of a ~29 ms
backward at (50, 32, 256)), so this module computes those factors for a block of steps
at once (``BLOCK_ELEMENTS`` per array: a few blocks stay in cache) and each step is
then about half the passes and the GEMM::

    do = a_o dh;  dcs = b_h dh + dcs_carry + cs_grad[t]  [+ do wco]
    di = a_i dcs;  df = a_f dcs;  dci = a_c dcs
    dcs_carry = f dcs  [+ di wci + df wcf]

Only products are regrouped, never sums: the peephole terms are added per step as
TensorFlow adds them, so an infinite gradient meets a zero weight in the same sum and
gives the same NaN as the generic loop (and the CUDA kernel), where folding
``a_o wco`` into ``b_h`` gave an infinity. NaN and infinities in the inputs land where
the generic loop puts them; a product of activations that underflows to zero before
it meets an infinite gradient (``f = 1e-20``, ``cs[t-1] = 1e-30``) can still give NaN
where the loop's other grouping gives an infinity. With the forward's ``cell_clip`` (the
gradient tape; ``lstm._mask_clipped``) a clipped cell passes nothing to ``i``, ``f``,
``ci`` or the past: the carry and those three gradients are multiplied by the
unclipped mask after the carry is formed, in the generic loop's order.

``W_h^T`` is transposed in strips (``lstm_cpu.transpose_into``), 3-4x faster than
one strided copy of the whole matrix.

Where the forward's compiled step is built (``native``; ``lstm_cpu.STEP_KERNEL`` not
NumPy's), in float32, and the forward's formulation is FUSED or the planner's, the
recurrence is FUSED's (``_recur_fused``): each step's GEMM and elementwise part in one
compiled call, a tile at a time. Elsewhere with the compiled step (a formulation of
the BLAS pinned; float64), each step's elementwise part is one call of its backward
step instead of the NumPy passes: the same products and sums in the same order, compiled without
fused multiply-adds, so the same bits as the NumPy passes but for a NaN's sign (the
tests compare them bit for bit), in one pass over the step's arrays instead of about
fifteen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from gradserve import heap
from gradserve.kernels import blas_threads as blas
from gradserve.kernels import lstm_cpu, native
from gradserve.kernels.lstm import Empty
from gradserve.kernels.lstm_cpu import Array, Offsets, transpose_into

#: Elements of one per-block factor array (4 bytes each in float32): five of them and
#: a block of the forward's activations fit in a core's L2 cache together.
BLOCK_ELEMENTS = 1 << 15
#: The ``o`` gate's column block: last in both gate layouts (``lstm.GateLayout``).
O_SLOT = 3


def backward_sequence(
    cs_prev: Array, i: Array, cs: Array, f: Array, o: Array, ci: Array, co: Array,
    cs_grad: Array, h_grad: Array, wci: Array, wcf: Array, wco: Array, w_h: Array,
    dgates: Array, dh: Array, dcs: Array, *, length: int, offsets: Offsets,
    use_peephole: bool, clip_at: float | None, check: Callable[[], None] | None,
    empty: Empty,
) -> bool:  # fmt: skip
    """Gate gradients of steps ``length - 1`` down to 0 into ``dgates`` ([length, B, 4H]);
    ``dh`` and ``dcs`` (zeros on entry) end as the gradients of ``h_prev`` and
    ``cs_prev``. ``clip_at``: the forward's cell clip as stored, or None without one.
    ``check`` runs before every step; ``empty`` allocates ``W_h^T`` and the factors.
    Returns whether subnormal floats were read and written as zero (FUSED's steps):
    the caller's GEMMs after it then read their operands through
    ``lstm_cpu.without_subnormals``."""
    if length == 0:  # no step: the carries stay zero (and dgates[0] is not there)
        return False
    heap.keep_warm()
    batch, units = dh.shape
    ct = dh.dtype
    per_step = (i, cs, f, o, ci, co, cs_grad, h_grad)
    step = _native_step(cs_prev, per_step, dgates, dh, dcs, length)
    compiled = step is not None and use_peephole  # (NumPy's passes read wci.. as they are)
    peep = np.stack([wci, wcf, wco]).astype(ct, copy=False) if compiled else None
    if step is not None and _fuses(ct):
        _recur_fused(
            step, cs_prev, per_step, peep, w_h, dgates, dh, dcs, length, offsets, clip_at,
            check, empty,
        )  # fmt: skip
        return True
    w_h_t = empty((w_h.shape[1], w_h.shape[0]), ct)
    transpose_into(w_h, w_h_t)
    if step is not None:
        _recur_native(
            step, cs_prev, per_step, peep, w_h_t, dgates, dh, dcs, length, offsets,
            clip_at, check,
        )  # fmt: skip
        return False
    block = max(1, min(length, BLOCK_ELEMENTS // max(1, batch * units)))
    factors = _Factors(block, batch, units, ct, offsets, clip_at is not None, empty)
    slot_i, slot_f, slot_c = factors.slots
    tmp = np.empty((batch, units), ct)
    for end in range(length, 0, -block):
        start = max(0, end - block)
        factors.make(cs_prev, i, cs, f, o, ci, co, start, end, clip_at)
        for t in range(end - 1, start - 1, -1):
            if check is not None:
                check()
            k = t - start
            gates = dgates[t].reshape(batch, 4, units)
            d_o, d_i, d_f, d_c = (
                gates[:, O_SLOT],
                gates[:, slot_i],
                gates[:, slot_f],
                gates[:, slot_c],
            )
            dh += h_grad[t]
            np.multiply(factors.a_o[k], dh, out=d_o)
            np.multiply(factors.b_h[k], dh, out=tmp)
            dcs += tmp  # dcs: the carry, becoming this step's d loss / d cs
            dcs += cs_grad[t]
            if use_peephole:
                np.multiply(d_o, wco, out=tmp)
                dcs += tmp
            np.multiply(factors.a_i[k], dcs, out=d_i)
            np.multiply(factors.a_f[k], dcs, out=d_f)
            np.multiply(factors.a_c[k], dcs, out=d_c)
            dcs *= f[t]  # the carry to step t - 1
            if use_peephole:
                np.multiply(d_i, wci, out=tmp)
                dcs += tmp
                np.multiply(d_f, wcf, out=tmp)
                dcs += tmp
            if clip_at is not None:
                unclipped = factors.unclipped[k]
                for d in (dcs, d_i, d_f, d_c):
                    d *= unclipped
            np.matmul(dgates[t], w_h_t, out=dh)
    return False


#: The compiled backward step of each dtype (``lstm_cpu_step.c``).
_NATIVE_STEPS = {
    np.dtype(np.float32): native.BACKWARD_F32,
    np.dtype(np.float64): native.BACKWARD_F64,
}


def _native_step(
    cs_prev: Array, per_step: tuple[Array, ...], dgates: Array, dh: Array, dcs: Array,
    length: int,
) -> Any | None:  # fmt: skip
    """The compiled backward step if it serves this call, else None: the NumPy passes.
    It serves float32 and float64 where ``STEP_KERNEL`` is not NumPy's and a library
    was built here, and reads [B, H] rows of each array: every one contiguous in the
    compute dtype, of its full shape (NumPy's passes broadcast a [1, H] ``cs_prev``)."""
    ct = dh.dtype
    name = _NATIVE_STEPS.get(np.dtype(ct))
    if name is None or lstm_cpu.STEP_KERNEL.get() is native.Mode.NUMPY:
        return None
    batch, units = dh.shape
    shapes = (
        all(a.ndim == 3 and a.shape[0] >= length and a.shape[1:] == dh.shape for a in per_step)
        and cs_prev.shape == dcs.shape == dh.shape
        and dgates.shape == (length, batch, 4 * units)
    )
    arrays = (cs_prev, *per_step, dgates, dh, dcs)
    if not shapes or not all(a.dtype == ct and a.flags.c_contiguous for a in arrays):
        return None
    lib = native.NATIVE.library()
    return None if lib is None else getattr(lib, name)


def _recur_native(
    step: Any, cs_prev: Array, per_step: tuple[Array, ...], peep: Array | None,
    w_h_t: Array, dgates: Array, dh: Array, dcs: Array, length: int, offsets: Offsets,
    clip_at: float | None, check: Callable[[], None] | None,
) -> None:  # fmt: skip
    """``backward_sequence``'s loop with the compiled step (its arguments' order)."""
    batch, units = dh.shape
    row = batch * units * dh.dtype.itemsize  # bytes of one step of a [T, B, H] array
    i, cs, f, o, ci, co, cs_grad, h_grad = (a.ctypes.data for a in per_step)
    gates_row = dgates.strides[0]
    peep_ptr = None if peep is None else peep.ctypes.data
    # a flag of its own: a float16 clip of 1e-8 is stored as 0, and clips every cell
    clip, clip_value = (0, 0.0) if clip_at is None else (1, clip_at)
    dh_ptr, dcs_ptr, gates, first = dh.ctypes.data, dcs.ctypes.data, dgates.ctypes.data, cs_prev
    for t in range(length - 1, -1, -1):
        if check is not None:
            check()
        at = t * row
        cs_last = first.ctypes.data if t == 0 else cs + at - row
        step(
            dh_ptr, dcs_ptr, i + at, f + at, o + at, ci + at, co + at, cs + at, cs_last,
            h_grad + at, cs_grad + at, peep_ptr, clip, clip_value, batch, units, *offsets,
            gates + t * gates_row,
        )  # fmt: skip
        np.matmul(dgates[t], w_h_t, out=dh)


def _fuses(ct: np.dtype[Any]) -> bool:
    """Whether the backward runs in FUSED's steps: float32 (the compiled step serving
    the call: the caller's check), where the forward's formulation is FUSED, or the
    planner's (``lstm_cpu.PINNED`` None) where FUSED's steps use the BLAS's threads
    (one, or a team: ``BlasThreads.sleep_soon``). Elsewhere in ``auto`` the caller would
    compute FUSED's steps alone beside the BLAS's idle threads (1.27-1.36x the BLAS's
    backward at batch 256-512 with two threads: a review helper). A formulation of
    the BLAS pinned keeps the backward on the BLAS too: the compiled backward step then
    gives the NumPy passes' bits, and replicas pinned so keep the bits they computed
    before."""
    if ct != np.float32:
        return False
    pinned = lstm_cpu.PINNED.get()
    if pinned is None:
        return (lstm_cpu.blas_threads() or 1) == 1 or blas.BLAS.sleep_soon()
    return pinned is lstm_cpu.Formulation.FUSED


def _recur_fused(
    step: Any, cs_prev: Array, per_step: tuple[Array, ...], peep: Array | None,
    w_h: Array, dgates: Array, dh: Array, dcs: Array, length: int, offsets: Offsets,
    clip_at: float | None, check: Callable[[], None] | None, empty: Empty,
) -> None:  # fmt: skip
    """``backward_sequence``'s loop in FUSED's steps (``lstm_cpu_step.c``): the last
    step by the compiled backward step (its dh: the zero carry), each earlier one by
    a fused step, which computes its dh = dgates[t + 1] @ W_h^T tile by tile and turns
    each tile into step t's gate gradients while it is in cache (W_h^T packed once,
    a team of threads where the process has more than one BLAS thread: the same bits
    with any team or none), then dh = dgates[0] @ W_h^T the same way. Subnormal floats
    are read and written as zero (as the forward's FUSED: the team's workers compute
    so), in all of it; the caller's GEMMs after it read their operands through
    ``lstm_cpu.without_subnormals``. ``empty`` allocates the packed W_h^T (the server's warm
    buffers), as the other paths' W_h^T."""
    batch, units = dh.shape
    packed = lstm_cpu.aligned_empty(native.packed_transposed_floats(units), dh.dtype, empty)
    native.pack_transposed(np.ascontiguousarray(w_h), packed)
    fused = native.backward_fused_step()
    fused_steps = native.backward_fused_steps()
    per_call = lstm_cpu.steps_per_call(batch, units)
    row = batch * units * dh.dtype.itemsize  # bytes of one step of a [T, B, H] array
    i, cs, f, o, ci, co, cs_grad, h_grad = (a.ctypes.data for a in per_step)
    gates_row, gates = dgates.strides[0], dgates.ctypes.data
    peep_ptr = None if peep is None else peep.ctypes.data
    clip, clip_value = (0, 0.0) if clip_at is None else (1, clip_at)
    dh_ptr, dcs_ptr, packed_ptr = dh.ctypes.data, dcs.ctypes.data, packed.ctypes.data
    with native.flushing_subnormals(), lstm_cpu.fused_team(batch, units, True) as team:
        t = length - 1
        if check is not None:
            check()
        at = t * row
        step(
            dh_ptr, dcs_ptr, i + at, f + at, o + at, ci + at, co + at, cs + at,
            cs_prev.ctypes.data if t == 0 else cs + at - row, h_grad + at, cs_grad + at,
            peep_ptr, clip, clip_value, batch, units, *offsets, gates + t * gates_row,
        )  # fmt: skip
        t -= 1
        while t >= 0:  # several steps a call, ``check`` before each (as the forward)
            if check is not None:
                check()
            n = min(per_call, t + 1)
            fused_steps(
                team, t, n, packed_ptr, i, f, o, ci, co, cs, cs_prev.ctypes.data, h_grad,
                cs_grad, peep_ptr, clip, clip_value, batch, units, *offsets, dcs_ptr, gates,
            )  # fmt: skip
            t -= n
        product_only = (None,) * 10
        fused(team, gates, packed_ptr, *product_only, 0, 0.0, batch, units, *offsets, None,
              None, dh_ptr)  # fmt: skip


def peephole_grads(
    dgates: Array, cs_prev: Array, cs: Array, length: int, offsets: Offsets,
    flushing: bool = False,
) -> list[Array]:  # fmt: skip
    """The peepholes' gradients (wci, wcf, wco): each gate's gradient times the cell it
    read (c[t - 1] for i and f, cs_prev at step 0; c[t] for o), summed over the steps
    and the batch, as contractions over ``dgates``' column blocks where they lie: no
    product array and no shifted copy of ``cs`` (0.35 against 0.95 ms at (50, 32, 256),
    the generic ``(dgates[..] * cs_seq).sum``, whose sums they regroup). ``flushing``
    (after FUSED's recurrence): with subnormals read and written as zero, as the
    recurrence (this thread computes them: a subnormal cs made them other bits than a
    zero cs, and took 10.3 against 0.33 ms, a review helper)."""
    units = cs.shape[2]
    off_i, off_f, _, off_o = offsets
    grads = []
    with native.flushing_subnormals() if flushing else contextlib.nullcontext():
        for off in (off_i, off_f):
            gate = dgates[:length, :, off : off + units]
            grad = np.einsum("bu,bu->u", gate[0], cs_prev)
            if length > 1:
                grad += np.einsum("tbu,tbu->u", gate[1:], cs[: length - 1])
            grads.append(grad)
        o_gate = dgates[:length, :, off_o : off_o + units]
        grads.append(np.einsum("tbu,tbu->u", o_gate, cs[:length]))
    return grads


class _Factors:
    """The step-independent factors of one block of steps (module docstring)."""

    def __init__(
        self, block: int, batch: int, units: int, dtype: Any, offsets: Offsets, clip: bool,
        empty: Empty,
    ) -> None:  # fmt: skip
        shape = (block, batch, units)
        self.a_o, self.b_h, self.a_i, self.a_f, self.a_c = (empty(shape, dtype) for _ in range(5))
        #: With a cell clip: 1 where the cell was not clipped, else 0.
        self.unclipped = empty(shape if clip else (0,), dtype)
        #: The column blocks of i, f, c in ``dgates`` (viewed as [B, 4, H]).
        self.slots = tuple(off // units if units else n for n, off in enumerate(offsets[:3]))

    def make(
        self, cs_prev: Array, i: Array, cs: Array, f: Array, o: Array, ci: Array, co: Array,
        start: int, end: int, clip_at: float | None,
    ) -> None:  # fmt: skip
        """The factors of steps ``start`` .. ``end - 1``, at rows 0 .. end - start - 1."""
        n = end - start
        o, co, i, ci, f = (a[start:end] for a in (o, co, i, ci, f))
        a_o, b_h, a_i, a_f, a_c = (
            a[:n] for a in (self.a_o, self.b_h, self.a_i, self.a_f, self.a_c)
        )
        np.subtract(1, o, out=a_o)
        a_o *= o
        a_o *= co
        np.multiply(co, co, out=b_h)
        np.subtract(1, b_h, out=b_h)
        b_h *= o
        np.subtract(1, i, out=a_i)
        a_i *= i
        a_i *= ci
        np.subtract(1, f, out=a_f)
        a_f *= f
        if start == 0:  # cs[t - 1] is cs_prev at step 0
            a_f[0] *= cs_prev
            a_f[1:] *= cs[: end - 1]
        else:
            a_f *= cs[start - 1 : end - 1]
        np.multiply(ci, ci, out=a_c)
        np.subtract(1, a_c, out=a_c)
        a_c *= i
        if clip_at is not None:
            unclipped = self.unclipped[:n]
            np.abs(cs[start:end], out=unclipped)
            np.less(unclipped, clip_at, out=unclipped)
