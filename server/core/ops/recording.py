"""What each op records on a gradient tape (``core.tape``) for ``core.gradients``.

One function per op that has a gradient or whose outputs may be differentiated:
it holds what the op's registered gradient needs and appends the record. Each
returns the tape ids of the op's tensor outputs, which the response carries
(``TensorOutput.tape_id``). Handlers call these only when the call names a tape,
so recording costs nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gradserve.lstm_signature import LSTMActivations, LSTMInputs
from gradserve.server.core.ops.lstm_ops import LSTMVariant
from gradserve.server.core.sessions import TensorArg
from gradserve.server.core.tape import FLOW_IN, FLOW_OUT, Recorder, small


def tensor_array(rec: Recorder, handle: str) -> None:
    """TensorArrayV3: version 1 of the array's contents starts here."""
    rec.record("TensorArrayV3", (), (FLOW_OUT,), {"handle": handle})


def stored_input(rec: Recorder, value: TensorArg) -> str | None:
    """The key of the input an op stores in a TensorArray (write, scatter, split),
    held on the tapes: taken before the op changes the array, so that an input deleted
    meanwhile (NOT_FOUND) fails the op with the array as it was, not after the write."""
    key, _ = rec.arg(value)
    return key


def write(rec: Recorder, handle: str, index: np.ndarray, key: str | None, dtype: Any) -> None:
    """TensorArrayWriteV3 of the input ``key`` (``stored_input``)."""
    saved = {"handle": handle, "index": small(index), "dtype": dtype}
    rec.record("TensorArrayWriteV3", (key, FLOW_IN), (FLOW_OUT,), saved)


def read(rec: Recorder, handle: str, index: np.ndarray, dtype: Any, value: Any) -> str | None:
    out = rec.output(value)
    saved = {"handle": handle, "index": small(index), "dtype": dtype}
    rec.record("TensorArrayReadV3", (FLOW_IN,), (out,), saved)
    return out


def gather(rec: Recorder, handle: str, indices: np.ndarray, value: Any) -> str | None:
    out = rec.output(value)
    rec.record(
        "TensorArrayGatherV3", (FLOW_IN,), (out,), {"handle": handle, "indices": small(indices)}
    )
    return out


def scatter(
    rec: Recorder, handle: str, indices: np.ndarray, key: str | None, value: np.ndarray
) -> None:
    """TensorArrayScatterV3 of the input ``key`` (``stored_input``), ``value``."""
    saved = {
        "handle": handle,
        "indices": small(indices),
        "dtype": value.dtype,
        "value_shape": tuple(value.shape),
    }
    rec.record("TensorArrayScatterV3", (key, FLOW_IN), (FLOW_OUT,), saved)


def concat(
    rec: Recorder, handle: str, value: Any, lengths: np.ndarray
) -> tuple[str | None, str | None]:
    out, out_lengths = rec.output(value), rec.output(lengths)
    saved = {"handle": handle, "lengths": small(lengths)}
    rec.record("TensorArrayConcatV3", (FLOW_IN,), (out, out_lengths), saved)
    return out, out_lengths


def split(rec: Recorder, handle: str, key: str | None, value: np.ndarray) -> None:
    """TensorArraySplitV3 of the input ``key`` (``stored_input``), ``value``: its
    gradient is a concat, which needs no lengths."""
    saved = {"handle": handle, "dtype": value.dtype, "value_shape": tuple(value.shape)}
    rec.record("TensorArraySplitV3", (key, FLOW_IN), (FLOW_OUT,), saved)


def stop_gradient(rec: Recorder, value_arg: TensorArg, value: Any) -> str | None:
    """StopGradient: an output with no differentiable input (it blocks)."""
    key, _ = rec.arg(value_arg)  # watched if resident, as any input read under the tape
    out = rec.output(value)
    # No differentiable input (it blocks); recorded if its input is on the tape.
    rec.record("StopGradient", (), (out,), {"input": key})
    return out


def lstm(
    rec: Recorder,
    variant: LSTMVariant,
    inputs: LSTMInputs[TensorArg],
    seq_len_max: np.ndarray,
    outputs: LSTMActivations[Any],
    *,
    use_peephole: bool,
    cell_clip: float | None,
) -> LSTMActivations[str | None]:
    """BlockLSTM(V2): every input and output is held, for the backward."""
    keys, held = zip(*(rec.arg(a, hold=True) for a in inputs))
    out = LSTMActivations(*(rec.output(v) for v in outputs))
    saved = {
        "variant": variant,
        "held": held,
        "activations": tuple(out),
        "seq_len_max": small(seq_len_max),
        "use_peephole": use_peephole,
        "cell_clip": variant.cell_clip if cell_clip is None else cell_clip,
    }
    rec.record(variant.op, tuple(keys), tuple(out), saved)
    return out


def no_gradient(
    rec: Recorder,
    op: str,
    inputs: Sequence[TensorArg] | tuple[str | None, ...],
    outputs: list[Any],
) -> list[str | None]:
    """An op whose gradient is out of scope (a gradient op: second order). It is
    recorded with its inputs and outputs, so a gradient that reaches it raises
    UNIMPLEMENTED saying so rather than giving None. ``inputs``: the op's inputs, or
    their keys from ``rec.arg`` (taken before the op, when it may let go of them)."""
    keys = tuple(a if a is None or isinstance(a, str) else rec.arg(a)[0] for a in inputs)
    outs = [rec.output(v) for v in outputs]
    rec.record(op, keys, tuple(outs), {})
    return outs
