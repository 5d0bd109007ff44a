"""The NumPy (CPU) backend of ``kernels.lstm``: the fused steps as in-place NumPy passes.

Function names and argument order are those of the CUDA kernels in
``lstm.cu`` (and of ``backend_cuda``), so the two read side by side.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The whole-sequence forward and backward recurrences, and the peepholes' gradients
# (``lstm.block_lstm_forward`` and ``block_lstm_backward`` hand them over).
from gradserve.kernels.lstm_cpu import forward_sequence as forward_sequence
from gradserve.kernels.lstm_cpu import without_subnormals as without_subnormals
from gradserve.kernels.lstm_cpu_backward import backward_sequence as backward_sequence
from gradserve.kernels.lstm_cpu_backward import peephole_grads as peephole_grads

#: The arrays of this backend (NumPy's); ``Any`` because NumPy's own annotations of
#: in-place ufuncs are looser than this code's use of them.
Array = Any
Offsets = tuple[int, int, int, int]

xp = np
name = "cpu"


def asarray(a: Array, dtype: np.dtype[Any]) -> Array:
    return np.asarray(a, dtype=dtype)


def cast(a: Array, dtype: np.dtype[Any]) -> Array:
    return a.astype(dtype, copy=False)


def to_host(a: Array) -> Array:
    return a


def to_device(a: Array) -> Array:
    """The CPU's arrays are host arrays: nothing to move."""
    return a


def _sigmoid(x: Array, out: Array) -> Array:
    """0.5 * tanh(0.5 x) + 0.5: no exp, so no overflow for any x."""
    np.multiply(x, 0.5, out=out)
    np.tanh(out, out=out)
    out *= 0.5
    out += 0.5
    return out


def fwd_step(gates_h: Array, b: Array, cs_prev: Array, wci: Array, wcf: Array, wco: Array,
             i: Array, cs: Array, f: Array, o: Array, ci: Array, co: Array, h: Array,
             offsets: Offsets, forget_bias: float, cell_clip: float,
             use_peephole: bool) -> None:  # fmt: skip
    """One forward step, in place: ``i``, ``f``, ``ci``, ``o`` hold this step's input
    projection ``x[t] @ W_x`` of their gate on entry and the activations on return;
    ``gates_h`` (``h[t-1] @ W_h``, this step's scratch) is overwritten."""
    units = cs_prev.shape[1]
    off_i, off_f, off_c, off_o = offsets
    gates_h += b
    i += gates_h[:, off_i : off_i + units]
    f += gates_h[:, off_f : off_f + units]
    ci += gates_h[:, off_c : off_c + units]
    o += gates_h[:, off_o : off_o + units]
    if forget_bias:
        f += forget_bias
    if use_peephole:
        i += cs_prev * wci
        f += cs_prev * wcf
    _sigmoid(i, i)
    _sigmoid(f, f)
    np.tanh(ci, out=ci)
    np.multiply(i, ci, out=cs)
    cs += f * cs_prev
    if cell_clip > 0:
        np.clip(cs, -cell_clip, cell_clip, out=cs)
    np.tanh(cs, out=co)
    if use_peephole:
        o += cs * wco
    _sigmoid(o, o)
    np.multiply(o, co, out=h)


def bwd_step(cs_prev: Array, i: Array, f: Array, o: Array, ci: Array, co: Array,
             cs_grad: Array, h_grad: Array, dh_carry: Array, dcs_carry: Array, wci: Array,
             wcf: Array, wco: Array, dgates: Array, offsets: Offsets,
             use_peephole: bool) -> None:  # fmt: skip
    """One backward step: gate gradients into ``dgates``; ``dcs_carry`` updated in place."""
    units = i.shape[1]
    off_i, off_f, off_c, off_o = offsets
    dh = dh_carry + h_grad
    d_o = dgates[:, off_o : off_o + units]
    np.multiply(o, 1 - o, out=d_o)
    d_o *= dh
    d_o *= co
    dcs = (1 - co * co) * dh * o
    dcs += dcs_carry
    dcs += cs_grad
    if use_peephole:
        dcs += d_o * wco
    dci = dgates[:, off_c : off_c + units]
    np.multiply(1 - ci * ci, dcs, out=dci)
    dci *= i
    df = dgates[:, off_f : off_f + units]
    np.multiply(f * (1 - f), dcs, out=df)
    df *= cs_prev
    di = dgates[:, off_i : off_i + units]
    np.multiply(i * (1 - i), dcs, out=di)
    di *= ci
    np.multiply(dcs, f, out=dcs_carry)
    if use_peephole:
        dcs_carry += di * wci
        dcs_carry += df * wcf
