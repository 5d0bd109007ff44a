"""float64 gradients against central finite differences of the forward.

The loss is ``sum(h * h_grad) + sum(cs * cs_grad)``, so the backward fed
``h_grad`` and ``cs_grad`` must return exactly its derivatives. Covers IFCO
(BlockLSTMV2) and ICFO with forget bias (BlockLSTM), with and without
peepholes, with seq_len_max < T. TensorFlow's registered gradient of
BlockLSTMV2 runs the ICFO kernel: the last test shows, on TensorFlow's own recorded
numbers, that this is what it computes and that it disagrees with finite
differences, which ours does not.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from gradserve.kernels import backend_numpy, lstm
from tests.kernels import lstm_cases
from tests.kernels.lstm_cases import GOLDEN, GRADS, INPUTS, random_case

EPS = 1e-6


def loss(case, layout, forget_bias, use_peephole, cell_clip=0.0) -> float:
    out = lstm_cases.forward(
        backend_numpy,
        *(case[k] for k in INPUTS),
        seq_len_max=int(case["seq_len_max"]),
        forget_bias=forget_bias,
        cell_clip=cell_clip,
        use_peephole=use_peephole,
        layout=layout,
    )
    return float((out.h * case["h_grad"]).sum() + (out.cs * case["cs_grad"]).sum())


def numeric_grads(case, layout, forget_bias, use_peephole) -> dict[str, np.ndarray]:
    grads = {}
    for name in INPUTS:
        value = case[name]
        g = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            keep = value[idx]
            value[idx] = keep + EPS
            up = loss(case, layout, forget_bias, use_peephole)
            value[idx] = keep - EPS
            down = loss(case, layout, forget_bias, use_peephole)
            value[idx] = keep
            g[idx] = (up - down) / (2 * EPS)
        grads[name + "_grad"] = g
    grads["cs_prev_grad"] = grads.pop("cs_prev_grad")
    return grads


def analytic_grads(case, layout, forget_bias, use_peephole, grad_layout=None):
    out = lstm_cases.forward(
        backend_numpy,
        *(case[k] for k in INPUTS),
        seq_len_max=int(case["seq_len_max"]),
        forget_bias=forget_bias,
        use_peephole=use_peephole,
        layout=layout,
    )
    grads = lstm_cases.backward(
        backend_numpy,
        *(case[k] for k in INPUTS),
        *out,
        case["cs_grad"],
        case["h_grad"],
        seq_len_max=int(case["seq_len_max"]),
        use_peephole=use_peephole,
        layout=grad_layout or layout,
    )
    return grads._asdict()


def max_scaled_diff(a: dict, b: dict) -> dict[str, float]:
    return {k: float(np.abs(a[k] - b[k]).max() / max(1.0, np.abs(b[k]).max())) for k in GRADS}


@pytest.mark.parametrize(
    "layout, forget_bias",
    [(lstm.GateLayout.IFCO, 0.0), (lstm.GateLayout.ICFO, 1.0)],
    ids=["V2-IFCO", "V1-ICFO"],
)
@pytest.mark.parametrize("use_peephole", [False, True], ids=["plain", "peephole"])
@pytest.mark.parametrize("seq_len_max", [4, 2], ids=["full", "short"])
def test_gradients_match_finite_differences(layout, forget_bias, use_peephole, seq_len_max):
    # A seed of the parameters that is the same in every process (hash() of a str is not).
    rng = np.random.default_rng(zlib.crc32(repr((layout.name, use_peephole, seq_len_max)).encode()))
    case = random_case(rng, steps=4, batch=2, inputs=3, units=3, seq_len_max=seq_len_max)
    numeric = numeric_grads(case, layout, forget_bias, use_peephole)
    analytic = analytic_grads(case, layout, forget_bias, use_peephole)
    diffs = max_scaled_diff(analytic, numeric)
    assert max(diffs.values()) < 1e-6, diffs
    if seq_len_max < 4:
        assert not analytic["x_grad"][seq_len_max:].any()


@pytest.mark.golden
def test_tensorflows_registered_gradient_is_the_icfo_kernel_and_wrong():
    """TensorFlow 2.21's registered BlockLSTMV2 gradient, recorded through
    tf.GradientTape (golden/record_tf_registered_gradient.py): it is the V1 (ICFO)
    backward run on V2's (IFCO) activations, to float32 rounding, and it disagrees with
    finite differences; ours (IFCO) agrees with them."""
    with np.load(GOLDEN / "tf_registered_gradient.npz") as data:
        recorded = {k: data[k] for k in data.files}
    tf_grads = {k: recorded[f"tf_{k}"] for k in GRADS}
    case = {k: v.astype(np.float64) for k, v in recorded.items() if not k.startswith("tf_")}
    ifco, icfo = lstm.GateLayout.IFCO, lstm.GateLayout.ICFO
    numeric = numeric_grads(case, ifco, 0.0, True)
    as_icfo = analytic_grads(case, ifco, 0.0, True, grad_layout=icfo)
    assert max(max_scaled_diff(tf_grads, as_icfo).values()) < 1e-5  # TF = ICFO kernel
    assert max(max_scaled_diff(tf_grads, numeric).values()) > 1e-1  # ... which is wrong
    ours = analytic_grads(case, ifco, 0.0, True)
    assert max(max_scaled_diff(ours, numeric).values()) < 1e-6
