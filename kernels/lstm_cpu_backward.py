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

Every factor there except ``dh`` and ``dcs`` depends on the forward's activations
alone, not on the recursion. NumPy pays about as much per call as per pass over a
[B, H] array at the benchmark sizes (50 steps of ~30 passes over 32 KB: 4-5 ms of a
~29 ms backward at (50, 32, 256)), so this module computes those factors for a block
of steps at once (``BLOCK_ELEMENTS`` per array: a few blocks stay in cache) and each
step is then eight passes and the GEMM::

    a_o = o (1 - o) co                       a_i = i (1 - i) ci
    b_h = (1 - co^2) o  [+ a_o wco]          a_f = f (1 - f) cs[t-1]
    a_c = (1 - ci^2) i                       carry = f [+ a_i wci + a_f wcf]

    do = a_o dh;  dcs = b_h dh + dcs_carry + cs_grad[t]
    di = a_i dcs;  df = a_f dcs;  dci = a_c dcs
    dcs_carry = carry dcs

With the forward's ``cell_clip`` (the gradient tape; ``lstm._mask_clipped``) a
clipped cell passes nothing to ``i``, ``f``, ``ci`` or the past: ``a_i``, ``a_f``,
``a_c`` and ``carry`` are multiplied by the unclipped mask when the block is made.

``W_h^T`` is transposed in strips (``lstm_cpu.transpose_into``), 3-4x faster than
one strided copy of the whole matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gradserve.kernels.lstm_cpu import keep_heap_warm, transpose_into

Array = Any  # numpy.ndarray (see lstm_cpu)
Offsets = tuple[int, int, int, int]
Empty = Callable[[tuple[int, ...], Any], Array]

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
) -> None:  # fmt: skip
    """Gate gradients of steps ``length - 1`` down to 0 into ``dgates`` ([length, B, 4H]);
    ``dh`` and ``dcs`` (zeros on entry) end as the gradients of ``h_prev`` and
    ``cs_prev``. ``clip_at``: the forward's cell clip as stored, or None without one.
    ``check`` runs before every step; ``empty`` allocates ``W_h^T``."""
    keep_heap_warm()
    batch, units = dh.shape
    ct = dh.dtype
    w_h_t = empty((w_h.shape[1], w_h.shape[0]), ct)
    transpose_into(w_h, w_h_t)
    block = max(1, min(length, BLOCK_ELEMENTS // max(1, batch * units)))
    factors = _Factors(block, batch, units, ct, offsets)
    tmp = np.empty((batch, units), ct)
    for end in range(length, 0, -block):
        start = max(0, end - block)
        factors.make(
            cs_prev, i, cs, f, o, ci, co, wci, wcf, wco, start, end, use_peephole, clip_at
        )  # fmt: skip
        for t in range(end - 1, start - 1, -1):
            if check is not None:
                check()
            k = t - start
            gates = dgates[t].reshape(batch, 4, units)
            dh += h_grad[t]
            np.multiply(factors.a_o[k], dh, out=gates[:, O_SLOT])
            np.multiply(factors.b_h[k], dh, out=tmp)
            dcs += tmp
            dcs += cs_grad[t]
            for slot, a in zip(factors.slots, (factors.a_i, factors.a_f, factors.a_c)):
                np.multiply(a[k], dcs, out=gates[:, slot])
            dcs *= factors.carry[k]
            np.matmul(dgates[t], w_h_t, out=dh)


class _Factors:
    """The step-independent factors of one block of steps (module docstring)."""

    def __init__(self, block: int, batch: int, units: int, dtype: Any, offsets: Offsets):
        shape = (block, batch, units)
        self.a_o = np.empty(shape, dtype)
        self.b_h = np.empty(shape, dtype)
        self._carry = np.empty(shape, dtype)
        self.carry: Array = self._carry
        self.tmp = np.empty(shape, dtype)
        self.a_i, self.a_f, self.a_c = (np.empty(shape, dtype) for _ in range(3))
        #: The column blocks of i, f, c in ``dgates`` (viewed as [B, 4, H]).
        self.slots = tuple(off // units if units else n for n, off in enumerate(offsets[:3]))

    def make(
        self, cs_prev: Array, i: Array, cs: Array, f: Array, o: Array, ci: Array, co: Array,
        wci: Array, wcf: Array, wco: Array, start: int, end: int, use_peephole: bool,
        clip_at: float | None,
    ) -> None:  # fmt: skip
        """The factors of steps ``start`` .. ``end - 1``, at rows 0 .. end - start - 1."""
        n = end - start
        o, co, i, ci, f = (a[start:end] for a in (o, co, i, ci, f))
        a_o, b_h, tmp = self.a_o[:n], self.b_h[:n], self.tmp[:n]
        a_i, a_f, a_c = self.a_i[:n], self.a_f[:n], self.a_c[:n]
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
        carry = self._carry[:n]
        if use_peephole:
            np.multiply(a_o, wco, out=tmp)
            b_h += tmp
            np.multiply(a_i, wci, out=carry)
            carry += f
            np.multiply(a_f, wcf, out=tmp)
            carry += tmp
        elif clip_at is not None:
            np.copyto(carry, f)
        else:
            carry = f  # read only
        if clip_at is not None:
            unclipped = np.less(np.abs(cs[start:end], out=tmp), clip_at, out=tmp)
            for a in (carry, a_i, a_f, a_c):
                a *= unclipped
        self.carry = carry
