"""The gate layout, pinned by indexing gates: with w = 0, each gate sees only its bias block."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve.kernels import backend_numpy, lstm
from tests.kernels import lstm_cases


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize(
    "layout, order", [(lstm.GateLayout.IFCO, "ifco"), (lstm.GateLayout.ICFO, "icfo")]
)
def test_bias_blocks_reach_their_gates(layout, order):
    units = 2
    values = {"i": 0.3, "f": -0.7, "c": 1.1, "o": 0.5}
    b = np.concatenate([np.full(units, values[g]) for g in order])
    zeros = np.zeros((1, units))
    out = lstm_cases.forward(
        backend_numpy,
        np.zeros((1, 1, 1)),
        zeros,
        zeros,
        np.zeros((1 + units, 4 * units)),
        np.zeros(units),
        np.zeros(units),
        np.zeros(units),
        b,
        seq_len_max=1,
        layout=layout,
    )
    np.testing.assert_allclose(out.i[0], sigmoid(values["i"]))
    np.testing.assert_allclose(out.f[0], sigmoid(values["f"]))
    np.testing.assert_allclose(out.ci[0], np.tanh(values["c"]))
    np.testing.assert_allclose(out.o[0], sigmoid(values["o"]))
    assert layout.offsets(units) == tuple(order.index(g) * units for g in "ifco")


def test_sigmoid_does_not_overflow():
    units = 1
    b = np.array([1e4, -1e4, 0.0, -1e4], np.float32)  # IFCO
    z = np.zeros((1, units), np.float32)
    with np.errstate(over="raise", invalid="raise"):
        out = lstm_cases.forward(
            backend_numpy,
            np.zeros((1, 1, 1), np.float32),
            z,
            z,
            np.zeros((1 + units, 4), np.float32),
            *(np.zeros(1, np.float32),) * 3,
            b,
            seq_len_max=1,
        )
    assert out.i[0, 0, 0] == 1.0 and out.f[0, 0, 0] == 0.0 and out.o[0, 0, 0] == 0.0
