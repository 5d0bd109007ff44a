"""LSTM test inputs: the TensorFlow golden cases and random cases, and how to compare.

Golden cases come from two folders: ``golden/lstm`` (the shared BlockLSTMV2 recordings)
and ``golden/lstm_v1`` (BlockLSTM / BlockLSTMGrad, recorded by
``golden/record_lstm_v1.py``). Each index entry names its ``op``; ``forward_attrs`` and
``backward_attrs`` turn a case into the keyword arguments of ``kernels.lstm``.
"""

from __future__ import annotations

import json
import pathlib
import types

import numpy as np
import pytest

from gradserve.kernels import backend_numpy, lstm, lstm_cpu, native
from gradserve.lstm_signature import LSTMActivations, LSTMGrads, LSTMInputs, LSTMOutputGrads

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
_V2_INDEX = json.loads((GOLDEN / "lstm" / "lstm_index.json").read_text())
_V1_INDEX = json.loads((GOLDEN / "lstm_v1" / "lstm_v1_index.json").read_text())["cases"]
#: Every golden case: name, op, sizes, attributes, dtype.
INDEX = [{"op": "BlockLSTMV2", "forget_bias": 0.0, **c} for c in _V2_INDEX] + _V1_INDEX
_FOLDER = {"BlockLSTMV2": GOLDEN / "lstm", "BlockLSTM": GOLDEN / "lstm_v1"}
_OPS = {c["name"]: c["op"] for c in INDEX}
LAYOUT = {"BlockLSTMV2": lstm.GateLayout.IFCO, "BlockLSTM": lstm.GateLayout.ICFO}
GRAD_OP = {"BlockLSTMV2": "BlockLSTMGradV2", "BlockLSTM": "BlockLSTMGrad"}
INPUTS = LSTMInputs._fields
OUTPUTS = LSTMActivations._fields
OUTPUT_GRADS = LSTMOutputGrads._fields  # the backward's inputs after the activations
GRADS = LSTMGrads._fields
# Past seq_len_max TensorFlow leaves these uninitialised: compare only before it.
UNINITIALISED_PAST_END = ("i", "f", "o", "ci", "co")
TOLERANCE = {"float16": 2e-2, "float32": 5e-5, "float64": 1e-12}

#: The NumPy backend without its whole-sequence forward and backward (``lstm_cpu``,
#: ``lstm_cpu_backward``): ``kernels.lstm``'s generic per-step loops, which the CUDA
#: backend runs.
GENERIC = types.SimpleNamespace(
    **{
        k: getattr(backend_numpy, k)
        for k in ("name", "xp", "asarray", "cast", "to_host", "to_device", "fwd_step", "bwd_step")
    }
)


def golden(name: str) -> dict:
    """A case's arrays and attributes, plus its ``op`` (and ``forget_bias`` 0 for V2)."""
    op = _OPS[name]
    with np.load(_FOLDER[op] / f"{name}.npz") as data:
        case = {k: data[k] for k in data.files}
    case.setdefault("forget_bias", np.float32(0.0))
    case["op"] = op
    return case


def backward_attrs(case: dict) -> dict:
    """The keyword arguments of ``lstm.block_lstm_backward`` for a golden case."""
    return {
        "seq_len_max": int(case["seq_len_max"]),
        "use_peephole": bool(case["use_peephole"]),
        "layout": LAYOUT[case["op"]],
    }


def forward_attrs(case: dict) -> dict:
    """The keyword arguments of ``lstm.block_lstm_forward`` for a golden case."""
    return {
        **backward_attrs(case),
        "cell_clip": float(case["cell_clip"]),
        "forget_bias": float(case["forget_bias"]),
    }


def scaled_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max(1, max |want|): the issue's measure."""
    if want.size == 0:
        return 0.0
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max()
    return float(diff / max(1.0, float(np.abs(want.astype(np.float64)).max())))


def input_shapes(steps: int, batch: int, inputs: int, units: int) -> dict[str, tuple]:
    """The shapes of the eight array inputs (``INPUTS``) of a [T, B, I] -> [T, B, H] LSTM."""
    return {
        "x": (steps, batch, inputs),
        "cs_prev": (batch, units),
        "h_prev": (batch, units),
        "w": (inputs + units, 4 * units),
        "wci": (units,),
        "wcf": (units,),
        "wco": (units,),
        "b": (4 * units,),
    }


def random_case(
    rng: np.random.Generator,
    steps=4,
    batch=2,
    inputs=3,
    units=3,
    dtype=np.float64,
    seq_len_max=None,
    scale=0.5,
) -> dict:
    """Normal(0, scale) inputs and output gradients (``OUTPUT_GRADS``), as one dict."""
    shapes = input_shapes(steps, batch, inputs, units)
    shapes.update(dict.fromkeys(OUTPUT_GRADS, (steps, batch, units)))
    case = {k: (rng.standard_normal(shape) * scale).astype(dtype) for k, shape in shapes.items()}
    case["seq_len_max"] = np.int64(steps if seq_len_max is None else seq_len_max)
    return case


def forward(backend, *arrays, **attrs) -> LSTMActivations:
    """``lstm.block_lstm_forward`` on the eight inputs as positional arguments."""
    return lstm.block_lstm_forward(backend, LSTMInputs(*arrays), **attrs)


def backward(backend, *arrays, **attrs) -> LSTMGrads:
    """``lstm.block_lstm_backward`` on its 17 tensors as positional arguments (inputs,
    activations, output gradients: TensorFlow's argument order)."""
    inputs, activations, output_grads = arrays[:8], arrays[8:15], arrays[15:]
    return lstm.block_lstm_backward(
        backend,
        LSTMInputs(*inputs),
        LSTMActivations(*activations),
        LSTMOutputGrads(*output_grads),
        **attrs,
    )


#: The CPU forward's and backward's elementwise passes (``--cpu-step-kernel``), for
#: tests parametrized over both with the ``step_kernel`` fixture (conftest.py).
STEP_KERNELS = [native.Mode.NATIVE, native.Mode.NUMPY]


def pinned_forward(
    case: dict,
    mode: native.Mode = native.Mode.AUTO,
    form: lstm_cpu.Formulation = lstm_cpu.Formulation.HOISTED,
    **attrs,
) -> LSTMActivations:
    """The NumPy backend's forward of ``case`` with that elementwise pass and formulation
    (pinned: no measuring runs)."""
    token = lstm_cpu.STEP_KERNEL.set(mode)
    pinned = lstm_cpu.PINNED.set(form)
    try:
        return lstm.block_lstm_forward(
            backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)), **attrs
        )
    finally:
        lstm_cpu.PINNED.reset(pinned)
        lstm_cpu.STEP_KERNEL.reset(token)


def require_native() -> None:
    """Skip where the host has no C compiler at all; fail where it has one and the
    compiled step does not build (a broken build must not pass as a skip)."""
    if native.NATIVE.library() is None:
        if "no C compiler" in (native.NATIVE.failure or ""):
            pytest.skip("no C compiler: the compiled step cannot be built here")
        pytest.fail(f"the compiled step did not build: {native.NATIVE.failure}")
