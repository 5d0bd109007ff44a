"""Served LSTM calls with random inputs: each one inline or by id, sometimes of the wrong
dtype or shape, ``seq_len_max`` sometimes out of range.

Pass: a valid call returns what ``kernels.lstm`` on NumPy computes from the same
host arrays; an invalid one is INVALID_ARGUMENT; either way the session holds
nothing once the test's own tensors are deleted. Runs against the test server
(``GRADSERVE_TEST_DEVICE``: the CPU in CI, the GPU in ``make gpu-check``) and, in
CI, a CUDA server on the stand-in cupy, where inputs by id move to the "GPU".
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradserve
from gradserve.errors import InvalidArgumentError
from gradserve.kernels import backend_numpy
from gradserve.server import run_server
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
from tests.conftest import DEVICE
from tests.kernels import fake_cupy, lstm_cases, shim_backend
from tests.kernels.lstm_cases import (
    GRADS,
    INPUTS,
    OUTPUT_GRADS,
    OUTPUTS,
    input_shapes,
    scaled_error,
)

FLOATS = (np.float16, np.float32, np.float64)
TOLERANCE = {np.float16: 1e-2, np.float32: 1e-5, np.float64: 1e-12}


@pytest.fixture(scope="module", params=["test-server", "cuda-stand-in"])
def served(request, tmp_path_factory):
    if request.param == "test-server":
        yield request.getfixturevalue("server")
        return
    if DEVICE != "cpu":
        pytest.skip("the stand-in cupy runs only where the real one is not under test")
    lib = shim_backend.build(tmp_path_factory.mktemp("shim"))
    with fake_cupy.installed(lib), run_server(device="cuda") as server:
        yield server


@st.composite
def calls(draw):
    """(op, inputs, attrs, what is wrong or None, the fault drawn)."""
    backward = draw(st.booleans())
    steps, batch, size, units = (draw(st.integers(1, 4)) for _ in range(4))
    dtype = draw(st.sampled_from(FLOATS))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shapes = input_shapes(steps, batch, size, units)
    if backward:
        shapes.update({k: (steps, batch, units) for k in OUTPUTS + OUTPUT_GRADS})
    dtypes = dict.fromkeys(shapes, dtype)
    wrong = None
    fault = draw(st.sampled_from(["none"] * 6 + ["dtype", "shape", "length"]))
    if fault == "dtype":
        name = draw(st.sampled_from(sorted(shapes)))
        dtypes[name] = draw(st.sampled_from([np.int32, *(d for d in FLOATS if d is not dtype)]))
        wrong = name
    elif fault == "shape":
        name = draw(st.sampled_from(sorted(shapes)))
        axis = draw(st.integers(0, len(shapes[name]) - 1))
        shapes[name] = tuple(d + 1 if a == axis else d for a, d in enumerate(shapes[name]))
        # x's length defines T: a longer x is wrong only against [T, B, H] inputs.
        wrong = None if (name, axis, backward) == ("x", 0, False) else name
    length = draw(st.integers(0, steps))
    if fault == "length":
        length = draw(st.sampled_from([-1, steps + 1]))
        wrong = "seq_len_max"
    inputs = {
        k: (rng.standard_normal(shape) * 0.5).astype(dtypes[k]) for k, shape in shapes.items()
    }
    if backward:  # activations in their ranges, so the reference is well-conditioned
        for k in ("i", "f", "o"):
            inputs[k] = (0.5 + 0.5 * np.tanh(inputs[k])).astype(dtypes[k])
        for k in ("ci", "co"):
            inputs[k] = np.tanh(inputs[k]).astype(dtypes[k])
    attrs = {"use_peephole": draw(st.booleans())}
    if not backward:
        attrs["cell_clip"] = draw(st.sampled_from([0.0, 0.25, 3.0]))  # exact in float32
    by_id = {k: draw(st.booleans()) for k in inputs}
    return backward, np.int64(length), inputs, by_id, attrs, wrong, fault


def reference(backward, length, inputs, attrs):
    host = [inputs[k] for k in INPUTS]
    if backward:
        extra = [inputs[k] for k in OUTPUTS + OUTPUT_GRADS]
        return lstm_cases.backward(backend_numpy, *host, *extra, seq_len_max=int(length), **attrs)
    return lstm_cases.forward(backend_numpy, *host, seq_len_max=int(length), **attrs)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=calls())
def test_valid_calls_match_numpy_and_invalid_ones_are_refused(served, call):
    backward, length, inputs, by_id, attrs, wrong, fault = call
    names = INPUTS + (OUTPUTS + OUTPUT_GRADS if backward else ())
    # Eager TensorFlow's T: the first tensor's dtype (here: an input by id), else the
    # first input's; every array converts to it, and only a tensor of another dtype
    # (or a T that is no float) makes the call wrong.
    tensors = [k for k in names if by_id[k]]
    dtype = inputs[tensors[0] if tensors else names[0]].dtype
    if fault == "dtype" and dtype.kind == "f" and all(inputs[k].dtype == dtype for k in tensors):
        wrong = None  # the input of another dtype converts: a valid call in T
    with gradserve.Client(f"127.0.0.1:{served.port}", timeout=60) as client:
        refs = {k: client.put(v) for k, v in inputs.items() if by_id[k]}
        args = {k: refs.get(k, v) for k, v in inputs.items()}
        op = client.raw_ops.BlockLSTMGradV2 if backward else client.raw_ops.BlockLSTMV2
        session = served.store.get(client.session_id)
        if wrong is not None:
            with pytest.raises(InvalidArgumentError):
                op(length, *(args[k] for k in names), **attrs)
        else:
            got = op(length, *(args[k] for k in names), **attrs)
            converted = {k: v.astype(dtype) for k, v in inputs.items()}
            want = reference(backward, length, converted, attrs)
            dtype = dtype.type
            for k in GRADS if backward else OUTPUTS:
                value = getattr(got, k)
                assert value.dtype == dtype, k
                assert scaled_error(value, getattr(want, k)) <= TOLERANCE[dtype], k
        # The call's inputs by id are still there, readable, and all the session holds.
        for k, ref in refs.items():
            np.testing.assert_array_equal(ref.numpy(), inputs[k])
        assert session.budget.used == sum(inputs[k].nbytes + TENSOR_RECORD_BYTES for k in refs)
        client.delete(*refs.values())
        assert session.budget.used == 0
