"""``client.raw_ops`` against TensorFlow 2.21's own ``tf.raw_ops`` signatures.

The file was recorded from TensorFlow (``golden/record_raw_ops_signatures.py``): every
op the SDK mirrors must take TensorFlow's arguments in TensorFlow's order with its
defaults, and return several outputs as a named tuple in TensorFlow's output order.
The SDK's own additions are keyword-only (``keep``), so a call written for
``tf.raw_ops`` runs unchanged. The output order is checked on real results from a
running server: each position holds the value TensorFlow's output of that name holds.
"""

from __future__ import annotations

import inspect
import json
import pathlib

import numpy as np
import pytest

from gradserve.client import TensorArrayHandle, _raw_ops
from tests.kernels.lstm_cases import (
    GRAD_OP,
    GRADS,
    INPUTS,
    OUTPUTS,
    TOLERANCE,
    golden,
    scaled_error,
)

pytestmark = pytest.mark.golden

SIGNATURES = json.loads(
    (pathlib.Path(__file__).parents[1] / "golden" / "raw_ops_signatures.json").read_text()
)["ops"]


@pytest.mark.parametrize("op", sorted(SIGNATURES))
def test_arguments_and_defaults_are_tensorflows(op):
    method = getattr(_raw_ops.RawOps, op)
    params = list(inspect.signature(method).parameters.values())[1:]  # without self
    positional = [p for p in params if p.kind is not p.KEYWORD_ONLY]
    assert [p.name for p in positional] == [p[0] for p in SIGNATURES[op]["params"]]
    for p, want in zip(positional, SIGNATURES[op]["params"]):
        if len(want) == 1:
            assert p.default is p.empty, f"{p.name} is required in TensorFlow"
        else:
            assert p.default == want[1] and type(p.default) in (type(want[1]), float), p.name


# ---------------------------------------------------------------- outputs, at run time
# Each call below runs one op on the server and says, by TensorFlow's output name, what
# that output must be: an array (same dtype and values) or a check of it. The values
# tell the outputs apart, so a swapped or misnamed output fails.

F32 = np.float32


def _flow(want: float):
    def check(got):
        assert type(got) is np.float32 and got == want, got  # TensorFlow's ``.numpy()``

    return check


def _handle_of(client, element: np.ndarray, index: int = 0):
    """A check that a value is a TensorArray handle whose element ``index`` is ``element``."""

    def check(got):
        assert isinstance(got, TensorArrayHandle), got
        np.testing.assert_array_equal(
            client.raw_ops.TensorArrayReadV3(got, index, 0.0, element.dtype), element
        )

    return check


def _array(client, size=3, **kwargs):
    return client.raw_ops.TensorArrayV3(size=size, dtype=F32, **kwargs)


def _written(client, *values):
    """An array holding ``values`` (float32, any shapes), and its flow."""
    handle, flow = _array(client, size=len(values), clear_after_read=False)
    for k, v in enumerate(values):
        flow = client.raw_ops.TensorArrayWriteV3(handle, k, np.asarray(v, F32), flow)
    return handle, flow


def call_TensorArrayV3(client):
    result = _array(client, size=2, clear_after_read=False)
    client.raw_ops.TensorArrayWriteV3(result[0], 1, np.array([7.0], F32), 0.0)
    return result, {"handle": _handle_of(client, np.array([7.0], F32), 1), "flow": _flow(0.0)}


def call_TensorArrayWriteV3(client):
    handle, _ = _array(client)
    return client.raw_ops.TensorArrayWriteV3(handle, 0, np.ones(2, F32), 0.25), {
        "flow_out": _flow(0.25)
    }


def call_TensorArrayReadV3(client):
    handle, flow = _written(client, [1.0, 2.0], [3.0, 4.0])
    return client.raw_ops.TensorArrayReadV3(handle, 1, flow, F32), {
        "value": np.array([3.0, 4.0], F32)
    }


def call_TensorArrayGatherV3(client):
    handle, flow = _written(client, [1.0, 2.0], [3.0, 4.0])
    return client.raw_ops.TensorArrayGatherV3(handle, [1, 0], flow, F32), {
        "value": np.array([[3.0, 4.0], [1.0, 2.0]], F32)
    }


def call_TensorArrayScatterV3(client):
    handle, _ = _array(client)
    return client.raw_ops.TensorArrayScatterV3(handle, [2, 0], np.ones((2, 1), F32), 0.5), {
        "flow_out": _flow(0.5)
    }


def call_TensorArrayConcatV3(client):
    # Lengths 2 and 1: value and lengths differ in size, dtype and content.
    handle, flow = _written(client, [1.0, 2.0], [3.0])
    return client.raw_ops.TensorArrayConcatV3(handle, flow, F32), {
        "value": np.array([1.0, 2.0, 3.0], F32),
        "lengths": np.array([2, 1], np.int64),
    }


def call_TensorArraySplitV3(client):
    handle, _ = _array(client, size=2)
    return client.raw_ops.TensorArraySplitV3(handle, np.arange(3, dtype=F32), [1, 2], 0.75), {
        "flow_out": _flow(0.75)
    }


def call_TensorArraySizeV3(client):
    handle, flow = _array(client, size=5)
    return client.raw_ops.TensorArraySizeV3(handle, flow), {"size": np.int32(5)}


def call_TensorArrayCloseV3(client):
    handle, _ = _array(client)
    return client.raw_ops.TensorArrayCloseV3(handle), {}


def call_TensorArrayGradV3(client):
    # The grad array is a new one: written here, it reads back its own value, and
    # TensorFlow's grad creation sets its flow to 0 whatever flow_in is.
    handle, flow = _written(client, [1.0, 2.0])
    result = client.raw_ops.TensorArrayGradV3(handle, 0.5, "gradients")
    client.raw_ops.TensorArrayWriteV3(result[0], 0, np.array([5.0, 6.0], F32), result[1])
    return result, {
        "grad_handle": _handle_of(client, np.array([5.0, 6.0], F32)),
        "flow_out": _flow(0.0),
    }


def call_TensorArrayGradWithShape(client):
    # Unwritten grad elements read as zeros of [shape_to_prepend] + the element's shape.
    handle, flow = _written(client, [1.0, 2.0])
    return client.raw_ops.TensorArrayGradWithShape(handle, 0.5, [3], "gradients"), {
        "grad_handle": _handle_of(client, np.zeros((3, 2), F32)),
        "flow_out": _flow(0.0),
    }


def call_StopGradient(client):
    x = np.array([[1.5, -2.0]], np.float64)
    return client.raw_ops.StopGradient(x), {"output": x}


def _recorded(op: str) -> dict:
    """A float32 case with peepholes over the whole sequence, recorded from TensorFlow
    (``golden/lstm*``), with the op's default attributes (those the SDK must default to)."""
    name = {"BlockLSTMV2": "lstm_01", "BlockLSTM": "lstm_v1_00"}[op]
    case = golden(name)
    assert case["op"] == op and int(case["seq_len_max"]) == case["x"].shape[0]
    assert case["use_peephole"] and case["x"].dtype == F32
    return case


def _close_to(want: np.ndarray, name: str):
    def check(got):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert scaled_error(got, want) < TOLERANCE["float32"], name

    return check


def _lstm_forward(op):
    def call(client):
        case = _recorded(op)
        result = getattr(client.raw_ops, op)(
            case["seq_len_max"], *(case[k] for k in INPUTS), use_peephole=True
        )
        return result, {k: _close_to(case[k], k) for k in OUTPUTS}

    return call


def _lstm_backward(forward_op):
    def call(client):
        case = _recorded(forward_op)
        result = getattr(client.raw_ops, GRAD_OP[forward_op])(
            case["seq_len_max"],
            *(case[k] for k in INPUTS + OUTPUTS),
            case["cs_grad"],
            case["h_grad"],
            use_peephole=True,
        )
        return result, {k: _close_to(case[k], k) for k in GRADS}

    return call


CALLS = {name[len("call_") :]: f for name, f in globals().items() if name.startswith("call_")}
CALLS.update({op: _lstm_forward(op) for op in ("BlockLSTMV2", "BlockLSTM")})
CALLS.update({GRAD_OP[op]: _lstm_backward(op) for op in ("BlockLSTMV2", "BlockLSTM")})


def _check(want, got) -> None:
    if callable(want):
        want(got)
    else:
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
        np.testing.assert_array_equal(got, want)


def test_every_recorded_op_is_called():
    assert sorted(CALLS) == sorted(SIGNATURES)


@pytest.mark.parametrize("op", sorted(SIGNATURES))
def test_outputs_in_tensorflows_order(client, op):
    names = SIGNATURES[op]["outputs"]
    result, want = CALLS[op](client)
    assert sorted(want) == sorted(names), "each of TensorFlow's outputs is checked"
    if not names:
        assert result is None
    elif len(names) == 1:
        assert not isinstance(result, tuple)  # one output: the value itself
        _check(want[names[0]], result)
    else:
        assert isinstance(result, tuple) and list(result._fields) == names
        for position, name in enumerate(names):
            _check(want[name], result[position])
