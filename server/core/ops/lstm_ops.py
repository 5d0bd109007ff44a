"""BlockLSTMV2 / BlockLSTMGradV2 (and the V1 pair): validation, then ``kernels.lstm``.

Validation uses TensorFlow's messages where TensorFlow has them (ranks and
every shape against T, B, I, H). Where TensorFlow has no check and aborts the
process or reads out of bounds (``seq_len_max`` > T, mismatched gradient
shapes, mixed dtypes), this returns INVALID_ARGUMENT instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gradserve import dtypes, shapes
from gradserve.errors import InvalidArgumentError
from gradserve.kernels import lstm
from gradserve.kernels.compute import Compute
from gradserve.lstm_signature import LSTMActivations, LSTMGrads, LSTMInputs, LSTMOutputGrads
from gradserve.server.core.ops import args
from gradserve.server.core.sessions import Session, TensorArg

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
ACTIVATIONS = LSTMActivations._fields
OUTPUT_GRADS = LSTMOutputGrads._fields
Named = Mapping[str, Any]  # input name -> host or device array (only dtype and shape are read)


@dataclasses.dataclass(frozen=True)
class LSTMVariant:
    """What differs between BlockLSTM (V1) and BlockLSTMV2: layout and attribute defaults."""

    op: str
    grad_op: str
    layout: lstm.GateLayout
    forget_bias: float
    cell_clip: float


V2 = LSTMVariant(
    "BlockLSTMV2", "BlockLSTMGradV2", lstm.GateLayout.IFCO, forget_bias=0.0, cell_clip=0.0
)
V1 = LSTMVariant("BlockLSTM", "BlockLSTMGrad", lstm.GateLayout.ICFO, forget_bias=1.0, cell_clip=3.0)


def _invalid(message: str, field: str = "") -> InvalidArgumentError:
    """The error of a failed check. Each check formats its message only when it fails:
    formatting every message up front cost 70-150 us of each LSTM call."""
    return InvalidArgumentError(message, field=field)


def _check_dtypes(op: str, inputs: Named) -> None:
    """One float dtype for every input: TensorFlow's type attribute ``T``, in its words
    (TensorFlow allows half and float; gradserve adds double, for gradient checks)."""
    x = inputs["x"]
    if x.dtype not in FLOAT_DTYPES:
        raise _invalid(
            f"Value for attr 'T' of {dtypes.tf_name(x.dtype)} is not in the list of allowed "
            "values: half, float, double",
            "x",
        )
    for name, value in inputs.items():
        if value.dtype != x.dtype:
            raise _invalid(
                f"Input '{name}' of '{op}' Op has type {value.dtype} that does not match type "
                f"{x.dtype} of argument 'x'.",
                name,
            )


def _check_grad_op(inputs: Named) -> None:
    """BlockLSTMGradOp's own checks, in its order and words (rnn/lstm_ops.cc). It takes
    the cell size from ``w``'s columns; the forward takes it from ``cs_prev``."""
    for name, rank in (("x", 3), ("cs_prev", 2), ("h_prev", 2), ("w", 2)):
        got = inputs[name].ndim
        if got != rank:
            raise _invalid(f"{name} must be rank {rank} but is rank {got}", name)
    w = inputs["w"]
    if w.shape[1] % 4 != 0:
        raise _invalid(f"w matrix columns must be a multiple of 4, but got {w.shape[1]}", "w")
    rows = inputs["x"].shape[2] + w.shape[1] // 4
    if rows != w.shape[0]:
        raise _invalid(f"w matrix rows don't match: {rows} vs. {w.shape[0]}", "w")
    for name in ("wci", "wcf", "wco", "b"):
        got = inputs[name].ndim
        if got != 1:
            raise _invalid(f"{name} must be rank 1 but is rank {got}", name)
    b = inputs["b"]
    if b.shape[0] != w.shape[1]:
        raise _invalid(f"w and b cell_size don't match: {w.shape[1] // 4} vs. {b.shape[0]}", "b")
    for name in ACTIVATIONS:
        got = inputs[name].ndim
        if got != 3:
            raise _invalid(f"{name} must be rank 3. Received: {got}", name)


def _check_forward_op(inputs: Named, units: int) -> None:
    """BlockLSTMOp's checks, in its order and words (rnn/lstm_ops.cc); the backward runs
    them too, after its own, for what TensorFlow's backward leaves unchecked."""
    x, cs_prev, h_prev, w, b = (inputs[k] for k in ("x", "cs_prev", "h_prev", "w", "b"))
    if x.ndim != 3:
        raise _invalid("x must be 3D", "x")
    steps, batch, input_size = x.shape
    for name, v in (("cs_prev", cs_prev), ("h_prev", h_prev)):
        if v.ndim != 2:
            raise _invalid(f"{name} must be 2D", name)
        if v.shape[0] != batch:
            raise _invalid(f"{name}.dims(0) != batch_size: {v.shape[0]} vs. {batch}", name)
        if v.shape[1] != units:
            raise _invalid(f"{name}.dims(1) != cell_size: {v.shape[1]} vs. {units}", name)
    if w.ndim != 2:
        raise _invalid("w must be 2D", "w")
    if w.shape[0] != input_size + units:
        raise _invalid(
            f"w.dim_size(0) != input_size + cell_size: {w.shape[0]} vs. {input_size + units}", "w"
        )
    if w.shape[1] != 4 * units:
        raise _invalid(f"w.dim_size(1) != cell_size * 4: {w.shape[1]} vs. {4 * units}", "w")
    for name in ("wci", "wcf", "wco"):
        v = inputs[name]
        if v.ndim != 1:
            raise _invalid(f"{name} must be 1D", name)
        if v.shape[0] != units:
            raise _invalid(f"{name}.dim_size(0) != cell_size: {v.shape[0]} vs. {units}", name)
    if b.ndim != 1:
        raise _invalid("b must be 1D", "b")
    if b.shape[0] != 4 * units:
        raise _invalid(f"b.dim_size(0) != cell_size * 4: {b.shape[0]} vs. {4 * units}", "b")
    for name in ACTIVATIONS + OUTPUT_GRADS:
        if name in inputs:
            v = inputs[name]
            if v.shape != (steps, batch, units):
                raise _invalid(
                    f"{name} must be [T, B, H] = {shapes.debug_string((steps, batch, units))}, "
                    f"got {shapes.debug_string(v.shape)}",
                    name,
                )


def validate(op: str, inputs: Named, seq_len_max: np.ndarray) -> int:
    """Check every input of the forward (and, if activations are given, the backward);
    returns seq_len_max. Inputs are host or device arrays: only dtype and shape are read.

    TensorFlow's messages throughout; the checks it lacks (it aborts the process, or
    reads out of bounds) come after its own.
    """
    grad = "i" in inputs
    _check_dtypes(op, inputs)
    if np.ndim(seq_len_max) != 0:
        raise _invalid(
            f"`seq_len_max_tensor` must be rank 0 but is rank {np.ndim(seq_len_max)}", "seq_len_max"
        )
    if grad:
        _check_grad_op(inputs)
    cs_prev = inputs["cs_prev"]
    # Where the cell size comes from, as in TensorFlow (a cs_prev of the wrong rank
    # fails the checks before this number is used).
    units = inputs["w"].shape[1] // 4 if grad else (cs_prev.shape[1] if cs_prev.ndim == 2 else 0)
    _check_forward_op(inputs, units)
    steps = inputs["x"].shape[0]
    length = args.int32_scalar(seq_len_max, "seq_len_max", "")  # rank checked above
    if not 0 <= length <= steps:
        raise _invalid(
            f"seq_len_max must be between 0 and {steps} but is {length} (TensorFlow 2.21 "
            "does not check this: it reads out of bounds, and may abort)",
            "seq_len_max",
        )
    return length


def forward(
    session: Session,
    compute: Compute,
    variant: LSTMVariant,
    inputs: LSTMInputs[TensorArg],
    seq_len_max: np.ndarray,
    *,
    use_peephole: bool,
    cell_clip: float | None = None,
    forget_bias: float | None = None,
    check: Callable[[], None] | None = None,
) -> LSTMActivations[Any]:
    """BlockLSTMV2 / BlockLSTM: validate, place, compute.

    The seven outputs are backend arrays (GPU arrays on CUDA: the caller keeps them
    there or copies them to the host). Resident inputs move to the device only once
    every input is valid and no output is over the server's max tensor size.
    ``check`` (deadline, cancellation) runs between time steps and may raise.
    """
    values = LSTMInputs(*(session.resolve(a) for a in inputs))
    length = validate(variant.op, values._asdict(), seq_len_max)
    session.check_tensor_bytes(values.h_prev.itemsize * values.x.shape[0] * values.h_prev.size)
    # The seven outputs, in the compute dtype, held in the session's budget while they
    # are made (kept or returned, they are charged or gone after): 7x --max-tensor-bytes
    # that no budget counted.
    outputs = (
        7 * lstm.compute_dtype(values.x.dtype).itemsize * values.x.shape[0] * values.h_prev.size
    )
    with session.holding(outputs):
        return compute.lstm_forward(
            LSTMInputs(*(session.place(a, compute.to_device) for a in inputs)),
            seq_len_max=length,
            forget_bias=variant.forget_bias if forget_bias is None else forget_bias,
            cell_clip=variant.cell_clip if cell_clip is None else cell_clip,
            use_peephole=use_peephole,
            layout=variant.layout,
            check=check,
        )


def backward(
    session: Session,
    compute: Compute,
    variant: LSTMVariant,
    inputs: LSTMInputs[TensorArg],
    activations: LSTMActivations[TensorArg],
    output_grads: LSTMOutputGrads[TensorArg],
    seq_len_max: np.ndarray,
    *,
    use_peephole: bool,
    cell_clip: float = 0.0,
    check: Callable[[], None] | None = None,
) -> LSTMGrads[Any]:
    """BlockLSTMGradV2 / BlockLSTMGrad: validate, place, compute (as ``forward``).

    ``cell_clip`` is 0 for the raw ops (TensorFlow's kernels, which ignore the
    forward's clip); the gradient tape passes the forward's, so that clipped cells
    get the true derivative (``kernels.lstm.block_lstm_backward``).
    """
    named = {
        name: session.resolve(arg)
        for part in (inputs, activations, output_grads)
        for name, arg in part._asdict().items()
    }
    length = validate(variant.grad_op, named, seq_len_max)
    x, w = named["x"], named["w"]
    session.check_tensor_bytes(x.itemsize * x.shape[0] * x.shape[1] * w.shape[1])  # gate buffer

    def placed(part: Any) -> Any:
        return type(part)(*(session.place(a, compute.to_device) for a in part))

    # Held while they are made, as the forward's outputs: the gate gradients of every
    # step, x_grad and w_grad (the rest are a batch row or a gate row).
    itemsize = lstm.compute_dtype(x.dtype).itemsize
    scratch = itemsize * (x.shape[0] * x.shape[1] * (w.shape[1] + x.shape[2]) + w.size)
    with session.holding(scratch):
        return compute.lstm_backward(
            placed(inputs),
            placed(activations),
            placed(output_grads),
            seq_len_max=length,
            use_peephole=use_peephole,
            layout=variant.layout,
            cell_clip=cell_clip,
            check=check,
        )
