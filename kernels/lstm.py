"""TensorFlow's block LSTM (BlockLSTM / BlockLSTMV2) forward and backward over a sequence.

One implementation for every device: array math goes through ``backend.xp``
(NumPy or CuPy) and the two fused per-step elementwise passes through
``backend.fwd_step`` / ``backend.bwd_step`` (NumPy code, or the CUDA kernels
of ``lstm.cu``). The spec is tensorflow/core/kernels/rnn/lstm_ops.{h,cc}.

Gates, per time step t (``x`` is [T, B, I], states [B, H], ``w`` is
[I + H, 4H] with rows [x; h], ``b`` is [4H])::

    gates = x[t] @ w[:I] + h[t-1] @ w[I:] + b          # columns by `layout`
    i  = sigmoid(gates_i + cs[t-1] * wci)               # peephole terms only
    f  = sigmoid(gates_f + forget_bias + cs[t-1] * wcf) #   with use_peephole
    ci = tanh(gates_c)
    cs = clip(i * ci + f * cs[t-1], ±cell_clip)         # no clip if cell_clip <= 0
    co = tanh(cs)
    o  = sigmoid(gates_o + cs * wco)                    # the new, clipped cs
    h  = o * co

Gate column blocks (``GateLayout``): IFCO = i|f|c|o (BlockLSTMV2, no forget
bias), ICFO = i|c|f|o (BlockLSTM, forget_bias default 1.0).

Steps from ``seq_len_max`` on produce zeros (TensorFlow leaves five of the
seven outputs uninitialised there) and get no gradient. float16 runs in
float32 (every GEMM accumulates in float32) and is returned as float16.

Cost: the input projection of all steps is one GEMM per gate block, written
into the gate outputs; each step is one ``h @ W_h`` GEMM plus one fused pass
that adds it (and the bias) and overwrites the outputs with the activations (the
CPU runs its own forward recurrence, ``lstm_cpu``: the GEMM formulation measured per
shape, warm workspaces). The backward is, per step, one fused
pass and one ``dgates @ W_h^T`` GEMM (the CPU runs its own recurrence,
``lstm_cpu_backward``: the step-independent factors a block of steps at a time); then
x_grad is one GEMM, w_grad two, and b_grad and the peephole gradients are reductions.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from gradserve.lstm_signature import LSTMActivations, LSTMGrads, LSTMInputs, LSTMOutputGrads

Array = Any  # numpy.ndarray or cupy.ndarray
#: Allocates an uninitialised array of (shape, dtype) for a call's outputs and
#: scratch: the backend's ``xp.empty`` unless the caller keeps warm buffers.
Empty = Callable[[tuple[int, ...], Any], Array]

__all__ = [
    "Backend",
    "GateLayout",
    "LSTMActivations",
    "LSTMGrads",
    "LSTMInputs",
    "LSTMOutputGrads",
    "block_lstm_backward",
    "block_lstm_forward",
    "compute_dtype",
]


class Backend(Protocol):
    """What the algorithm needs of a device: ``backend_numpy`` and ``backend_cuda``."""

    name: str
    xp: Any  # the array module: numpy or cupy

    def asarray(self, a: Array, dtype: np.dtype) -> Array: ...
    def cast(self, a: Array, dtype: np.dtype) -> Array: ...
    def to_host(self, a: Array) -> np.ndarray: ...
    def to_device(self, a: Array) -> Array: ...
    def fwd_step(self, *args: Any) -> None: ...
    def bwd_step(self, *args: Any) -> None: ...


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype the math runs in: float16 in float32 (every GEMM accumulates in
    float32 and the result is rounded once); float32 and float64 as they are."""
    return np.dtype(np.float32) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


class GateLayout(enum.Enum):
    """Order of the four gate column blocks in ``w``, ``b`` and the gate buffers."""

    IFCO = "ifco"  # BlockLSTMV2
    ICFO = "icfo"  # BlockLSTM

    def offsets(self, units: int) -> tuple[int, int, int, int]:
        """Column offsets (i, f, c, o) of the gate blocks, each ``units`` wide."""
        if self is GateLayout.IFCO:
            return 0, units, 2 * units, 3 * units
        return 0, 2 * units, units, 3 * units


def clip_in_effect(cell_clip: float) -> float:
    """``cell_clip`` as the ops apply it: 0 (no clip) where, as a float32, it is below
    float32's smallest normal number, in every dtype.
    TensorFlow's ``cell_clip`` is a float32 attribute, compared ``cell_clip > 0.0f``
    in kernels that run with subnormals read as zero: such a clip clips nothing there,
    as in FUSED (which reads subnormals as zero too), while the other formulations
    clipped every cell to it and the gradient tape's backward took every cell for
    clipped (a gradient 0.35 off its finite differences: a review helper); a float64
    call clipped to 1e-40 (another). One rule for every formulation, dtype and both
    directions: TensorFlow's."""
    tiny = np.finfo(np.float32).tiny
    with np.errstate(over="ignore"):
        as_attribute = np.float32(cell_clip)
    return float(cell_clip) if as_attribute >= tiny else 0.0


def block_lstm_forward(
    backend: Backend,
    inputs: LSTMInputs[Array],
    *,
    seq_len_max: int,
    forget_bias: float = 0.0,
    cell_clip: float = 0.0,
    use_peephole: bool = False,
    layout: GateLayout = GateLayout.IFCO,
    check: Callable[[], None] | None = None,
    empty: Empty | None = None,
) -> LSTMActivations[Array]:
    """The seven [T, B, H] outputs. Inputs must already be validated.

    ``check`` runs before every time step (deadline and cancellation): it may
    raise to abandon the call; nothing outside this function has changed then.
    ``empty`` allocates the outputs (default ``xp.empty``).
    """
    xp = backend.xp
    empty = empty or xp.empty
    out_dtype = inputs.x.dtype
    ct = compute_dtype(out_dtype)
    cell_clip = clip_in_effect(cell_clip)
    x, cs_prev, h_prev, w, wci, wcf, wco, b = (backend.asarray(a, ct) for a in inputs)
    steps, batch, input_size = x.shape
    units = cs_prev.shape[1]
    # No batch or no units: every output is empty, and no step has anything to do. A
    # loop over the steps anyway let a request of a few bytes (``seq_len_max`` 2**31-1)
    # hold a compute slot for hours.
    length = seq_len_max if batch * units else 0
    # Every step before ``length`` is written below, so only the steps past it are
    # zeroed: a zeroing pass over all seven outputs cost ~1 ms of an 8-15 ms forward.
    outs = LSTMActivations(*(empty((steps, batch, units), ct) for _ in range(7)))
    for out in outs:
        out[length:] = 0
    # A backend may run the whole recurrence its own way (the CPU: ``lstm_cpu``, which
    # picks its GEMM formulation per shape by measuring); the loop below is the rest's.
    sequence = getattr(backend, "forward_sequence", None)
    if length > 0 and sequence is not None:
        sequence(
            x, cs_prev, h_prev, w, wci, wcf, wco, b, outs, length=length,
            offsets=layout.offsets(units), forget_bias=forget_bias, cell_clip=cell_clip,
            use_peephole=use_peephole, check=check,
        )  # fmt: skip
    elif length > 0:
        w_x, w_h = w[:input_size], w[input_size:]
        offsets = layout.offsets(units)
        x_flat = x[:length].reshape(length * batch, input_size)
        # The input projection of all steps goes straight into the i, f, ci, o
        # outputs (one GEMM per gate block), which the step then overwrites with the
        # activations: no [T, B, 4H] scratch, whose first-touch page faults cost
        # more than the projection saved at (100, 64, 512) on NumPy.
        for gate, off in zip((outs.i, outs.f, outs.ci, outs.o), offsets):
            xp.matmul(
                x_flat, w_x[:, off : off + units], out=gate[:length].reshape(length * batch, units)
            )
        gates_h = xp.empty((batch, 4 * units), ct)
        for t in range(length):
            if check is not None:
                check()
            c_prev = cs_prev if t == 0 else outs.cs[t - 1]
            h_last = h_prev if t == 0 else outs.h[t - 1]
            xp.matmul(h_last, w_h, out=gates_h)
            backend.fwd_step(
                gates_h, b, c_prev, wci, wcf, wco,
                outs.i[t], outs.cs[t], outs.f[t], outs.o[t], outs.ci[t], outs.co[t], outs.h[t],
                offsets, forget_bias, cell_clip, use_peephole,
            )  # fmt: skip
    return LSTMActivations(*(backend.cast(a, out_dtype) for a in outs))


def block_lstm_backward(
    backend: Backend,
    inputs: LSTMInputs[Array],
    activations: LSTMActivations[Array],
    output_grads: LSTMOutputGrads[Array],
    *,
    seq_len_max: int,
    use_peephole: bool = False,
    layout: GateLayout = GateLayout.IFCO,
    cell_clip: float = 0.0,
    check: Callable[[], None] | None = None,
    empty: Empty | None = None,
) -> LSTMGrads[Array]:
    """Gradients of the whole sequence (TensorFlow's BlockLSTMGrad recursion).

    ``output_grads.h_grad[t]`` and ``.cs_grad[t]`` add to the recurrent carries at
    step t. With ``cell_clip`` 0 (the raw ``BlockLSTMGrad*`` ops, which have no such
    attribute) the forward's clip is ignored, exactly as TensorFlow's kernels ignore
    it. With the forward's ``cell_clip`` > 0 (the gradient tape) a cell whose state
    was clipped passes no gradient to its gates or its past (``_mask_clipped``):
    the true derivative, which TensorFlow's registered gradient gets wrong.
    ``empty`` allocates the large gradients and scratch (default ``xp.empty``).
    """
    xp = backend.xp
    empty = empty or xp.empty
    out_dtype = inputs.x.dtype
    ct = compute_dtype(out_dtype)
    cell_clip = clip_in_effect(cell_clip)
    x, cs_prev, h_prev, w, wci, wcf, wco, _ = (backend.asarray(a, ct) for a in inputs)
    i, cs, f, o, ci, co, h = (backend.asarray(a, ct) for a in activations)
    cs_grad, h_grad = (backend.asarray(a, ct) for a in output_grads)
    steps, batch, input_size = x.shape
    units = cs_prev.shape[1]
    # No batch or no units: no gate has an element, so every gradient is zero (and
    # looping over the steps would only cost time: see the forward).
    length = seq_len_max if batch * units else 0
    # The GEMMs below write every element before ``length`` (and all of w_grad):
    # only what they do not write is zeroed.
    x_grad = empty((steps, batch, input_size), ct)
    x_grad[length:] = 0
    w_grad = empty(w.shape, ct) if length > 0 else xp.zeros(w.shape, ct)
    peephole_grads = [xp.zeros(units, ct) for _ in range(3)]
    b_grad = xp.zeros(4 * units, ct)
    dcs = xp.zeros((batch, units), ct)  # carry: d loss / d cs[t-1]
    dh = xp.zeros((batch, units), ct)  # carry: d loss / d h[t-1] from step t
    if length > 0:
        w_x, w_h = w[:input_size], w[input_size:]
        dgates = empty((length, batch, 4 * units), ct)
        offsets = layout.offsets(units)
        # A clipped cell holds exactly the clip value as stored in the output dtype.
        clip_at = float(np.asarray(cell_clip, out_dtype))
        # A backend may run the recurrence its own way (the CPU: ``lstm_cpu_backward``,
        # the step-independent factors a block of steps at a time).
        sequence = getattr(backend, "backward_sequence", None)
        flushed = False  # whether the recurrence read subnormal floats as zero
        if sequence is not None:
            flushed = sequence(
                cs_prev, i, cs, f, o, ci, co, cs_grad, h_grad, wci, wcf, wco, w_h,
                dgates, dh, dcs, length=length, offsets=offsets, use_peephole=use_peephole,
                clip_at=clip_at if cell_clip > 0 else None, check=check, empty=empty,
            )  # fmt: skip
        else:
            # One contiguous copy of W_h^T: the per-step GEMM with a plain (not
            # transposed-view) operand ran 30% faster in OpenBLAS on small batches.
            w_h_t = xp.ascontiguousarray(w_h.T)
            for t in reversed(range(length)):
                if check is not None:
                    check()
                c_prev = cs_prev if t == 0 else cs[t - 1]
                backend.bwd_step(
                    c_prev, i[t], f[t], o[t], ci[t], co[t], cs_grad[t], h_grad[t],
                    dh, dcs, wci, wcf, wco, dgates[t], offsets, use_peephole,
                )  # fmt: skip
                if cell_clip > 0:
                    _mask_clipped(xp, cs[t], clip_at, dgates[t], dcs, offsets, units)
                xp.matmul(dgates[t], w_h_t, out=dh)
        flat = dgates.reshape(length * batch, 4 * units)
        x_rows = x[:length].reshape(length * batch, input_size)
        h_rows = _shifted(xp, h_prev, h, length).reshape(length * batch, units)
        # Then the GEMMs read them as zero too, as the BLAS's threads would not (the
        # CPU's ``lstm_cpu.without_subnormals``; dgates came out of the recurrence so).
        without_subnormals = getattr(backend, "without_subnormals", None)
        if flushed and without_subnormals is not None:
            w_x, x_rows, h_rows = (without_subnormals(a) for a in (w_x, x_rows, h_rows))
        # GEMMs write straight into (contiguous views of) the outputs: no temporaries.
        xp.matmul(flat, w_x.T, out=x_grad[:length].reshape(length * batch, input_size))
        xp.matmul(x_rows.T, flat, out=w_grad[:input_size])
        xp.matmul(h_rows.T, flat, out=w_grad[input_size:])
        b_grad = flat.sum(axis=0)
        grads_of = getattr(backend, "peephole_grads", None)  # the CPU's: no products
        if use_peephole and grads_of is not None:
            peephole_grads = grads_of(dgates, cs_prev, cs, length, offsets, flushing=flushed)
        elif use_peephole:
            off_i, off_f, _, off_o = offsets
            cs_seq = _shifted(xp, cs_prev, cs, length)
            peephole_grads = [
                (dgates[:, :, off_i : off_i + units] * cs_seq).sum(axis=(0, 1)),
                (dgates[:, :, off_f : off_f + units] * cs_seq).sum(axis=(0, 1)),
                (dgates[:, :, off_o : off_o + units] * cs[:length]).sum(axis=(0, 1)),
            ]
    wci_grad, wcf_grad, wco_grad = peephole_grads
    grads = LSTMGrads(x_grad, dcs, dh, w_grad, wci_grad, wcf_grad, wco_grad, b_grad)
    return LSTMGrads(*(backend.cast(a, out_dtype) for a in grads))


def _mask_clipped(
    xp: Any,
    cs: Array,
    clip_at: float,
    dgates: Array,
    dcs_carry: Array,
    offsets: tuple[int, int, int, int],
    units: int,
) -> None:
    """Zero the gradient through cells clipped at this step.

    ``cs = clip(i * ci + f * cs_prev)`` has derivative 0 where it clipped, so
    there the gradients of ``i``, ``f``, ``ci`` and of ``cs_prev`` (the carry) —
    each a multiple of d loss / d cs — are 0. The ``o`` gate's is not: it reaches
    ``o`` through ``h = o * tanh(cs)``, after the clip.
    """
    unclipped = ((cs < clip_at) & (cs > -clip_at)).astype(dgates.dtype)
    off_i, off_f, off_c, _ = offsets
    for off in (off_i, off_f, off_c):
        dgates[:, off : off + units] *= unclipped
    dcs_carry *= unclipped


def _shifted(xp: Any, first: Array, seq: Array, length: int) -> Array:
    """[first, seq[0], ..., seq[length-2]]: each step's previous state."""
    out = xp.empty((length, *first.shape), first.dtype)
    out[0] = first
    out[1:] = seq[: length - 1]
    return out
