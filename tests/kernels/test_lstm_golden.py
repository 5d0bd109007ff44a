"""Every TensorFlow 2.21 golden case, on the NumPy path and on the CUDA path (gpu twin)."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve.kernels import lstm
from gradserve.kernels.backends import get_backend
from gradserve.kernels.device import cuda_available
from tests.kernels.lstm_cases import (
    GRADS,
    INDEX,
    INPUTS,
    OUTPUTS,
    TOLERANCE,
    UNINITIALISED_PAST_END,
    golden,
    scaled_error,
)

CASES = [c["name"] for c in INDEX]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    if request.param == "cuda" and not cuda_available():
        pytest.skip("no CUDA device")
    return get_backend(request.param)


def run_case(backend, d):
    length = int(d["seq_len_max"])
    out = lstm.block_lstm_forward(
        backend,
        *(d[k] for k in INPUTS),
        seq_len_max=length,
        cell_clip=float(d["cell_clip"]),
        use_peephole=bool(d["use_peephole"]),
    )
    grads = lstm.block_lstm_backward(
        backend,
        *(d[k] for k in INPUTS + OUTPUTS + ("cs_grad", "h_grad")),
        seq_len_max=length,
        use_peephole=bool(d["use_peephole"]),
    )
    host = lambda a: np.asarray(backend.to_host(a))  # noqa: E731
    return (
        {k: host(v) for k, v in out._asdict().items()},
        {k: host(v) for k, v in grads._asdict().items()},
    )


@pytest.mark.parametrize("name", CASES)
def test_matches_tensorflow(backend, name):
    d = golden(name)
    tol = TOLERANCE[str(d["x"].dtype)]
    length = int(d["seq_len_max"])
    out, grads = run_case(backend, d)
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
