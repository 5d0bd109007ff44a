"""Every TensorFlow 2.21 golden case (BlockLSTMV2 and BlockLSTM), on the NumPy path and on
the CUDA path (gpu twin)."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve.kernels.compute import compute_for
from gradserve.kernels.device import cuda_unavailable_reason
from gradserve.lstm_signature import LSTMActivations, LSTMInputs, LSTMOutputGrads
from tests.kernels.lstm_cases import (
    GRADS,
    INDEX,
    INPUTS,
    OUTPUT_GRADS,
    OUTPUTS,
    TOLERANCE,
    UNINITIALISED_PAST_END,
    backward_attrs,
    forward_attrs,
    golden,
    require_native,
    scaled_error,
)

pytestmark = pytest.mark.golden

CASES = [c["name"] for c in INDEX]


@pytest.fixture(
    params=[
        "cpu",
        "cpu-fused",  # FUSED's forward and backward (``--lstm-formulation fused``)
        pytest.param("cuda", marks=pytest.mark.gpu),
        pytest.param("cuda-graphs", marks=pytest.mark.gpu),
    ]
)
def compute(request):
    if request.param.startswith("cuda") and cuda_unavailable_reason() is not None:
        pytest.skip("no CUDA device")
    if request.param == "cpu-fused":
        require_native()
        return compute_for("cpu", lstm_formulation="fused")
    return compute_for(request.param.removesuffix("-graphs"), cuda_graphs="graphs" in request.param)


def run_case(compute, d):
    """Forward and backward; with CUDA graphs each runs twice, the second a replay."""
    for _ in range(2 if compute.graphs is not None else 1):
        inputs = LSTMInputs(*(d[k] for k in INPUTS))
        out = compute.lstm_forward(inputs, **forward_attrs(d))
        grads = compute.lstm_backward(
            inputs,
            LSTMActivations(*(d[k] for k in OUTPUTS)),
            LSTMOutputGrads(*(d[k] for k in OUTPUT_GRADS)),
            **backward_attrs(d),
        )
    if compute.graphs is not None:
        assert compute.graphs.replays >= 2, "the second forward and backward were replays"
    host = lambda a: np.asarray(compute.to_host(a))  # noqa: E731
    return (
        {k: host(v) for k, v in out._asdict().items()},
        {k: host(v) for k, v in grads._asdict().items()},
    )


@pytest.mark.parametrize("name", CASES)
def test_matches_tensorflow(compute, name):
    d = golden(name)
    tol = TOLERANCE[str(d["x"].dtype)]
    length = int(d["seq_len_max"])
    out, grads = run_case(compute, d)
    for k in OUTPUTS:
        assert out[k].dtype == d[k].dtype and out[k].shape == d[k].shape
        if k in UNINITIALISED_PAST_END:
            assert scaled_error(out[k][:length], d[k][:length]) < tol, k
        else:
            assert scaled_error(out[k], d[k]) < tol, k
        assert not out[k][length:].any(), f"{k} past seq_len_max must be zero"
    for k in GRADS:
        assert grads[k].dtype == d[k].dtype and grads[k].shape == d[k].shape
        assert scaled_error(grads[k], d[k]) < tol, k
