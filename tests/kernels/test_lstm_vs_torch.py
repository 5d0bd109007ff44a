"""BlockLSTMV2 against PyTorch's ``torch.nn.LSTM``: an independent implementation of the
same cell, where torch is installed (never a dependency: skipped in CI; it runs in
``make gpu-check``, whose machine has torch, and by hand).

Without peepholes, cell clip and forget bias, BlockLSTMV2 is torch's LSTM: both order
the gates i|f|c|o, and ``w = [W_ih^T; W_hh^T]``, ``b = b_ih + b_hh``. The cuDNN
comparison of the GPU benchmark rests on this. torch returns only the last cell state,
so its loss has a cell-state gradient at the last step alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradserve.kernels import backend_numpy
from tests.kernels import lstm_cases
from tests.kernels.lstm_cases import INPUTS, random_case

torch = pytest.importorskip("torch")

SIZES = [(1, 1, 1, 1), (5, 3, 4, 6), (7, 2, 6, 3)]  # (T, B, I, H)


def torch_lstm(case: dict):
    """torch's LSTM on ``case``'s inputs (float64): (h, c_T) and the gradients of
    sum(h * h_grad) + sum(c_T * cs_grad[-1]), with ``w`` and ``b`` split torch's way."""
    x = torch.tensor(case["x"], requires_grad=True)
    steps, batch, inputs = x.shape
    units = case["h_prev"].shape[1]
    model = torch.nn.LSTM(inputs, units).double()
    w = torch.tensor(case["w"])
    with torch.no_grad():
        model.weight_ih_l0.copy_(w[:inputs].T)
        model.weight_hh_l0.copy_(w[inputs:].T)
        model.bias_ih_l0.copy_(torch.tensor(case["b"]))
        model.bias_hh_l0.zero_()
    h0 = torch.tensor(case["h_prev"][None], requires_grad=True)
    c0 = torch.tensor(case["cs_prev"][None], requires_grad=True)
    h, (_, c_last) = model(x, (h0, c0))
    loss = (h * torch.tensor(case["h_grad"])).sum() + (
        c_last[0] * torch.tensor(case["cs_grad"][-1])
    ).sum()
    loss.backward()
    grads = {
        "x_grad": x.grad,
        "cs_prev_grad": c0.grad[0],
        "h_prev_grad": h0.grad[0],
        "w_grad": torch.cat([model.weight_ih_l0.grad.T, model.weight_hh_l0.grad.T]),
        "b_grad": model.bias_ih_l0.grad,
    }
    as_numpy = {k: v.detach().numpy() for k, v in grads.items()}
    return h.detach().numpy(), c_last[0].detach().numpy(), as_numpy


@pytest.mark.parametrize("steps,batch,inputs,units", SIZES)
def test_block_lstm_v2_is_torch_lstm_without_peepholes(steps, batch, inputs, units):
    case = random_case(np.random.default_rng(steps * 100 + units), steps, batch, inputs, units)
    case["cs_grad"][:-1] = 0.0  # torch's loss reaches the cell state at the last step only
    arrays = [case[k] for k in INPUTS]
    outs = lstm_cases.forward(backend_numpy, *arrays, seq_len_max=steps)
    grads = lstm_cases.backward(
        backend_numpy, *arrays, *outs, case["cs_grad"], case["h_grad"], seq_len_max=steps
    )
    want_h, want_c, want_grads = torch_lstm(case)
    np.testing.assert_allclose(outs.h, want_h, rtol=0, atol=1e-12)
    np.testing.assert_allclose(outs.cs[-1], want_c, rtol=0, atol=1e-12)
    for name, want in want_grads.items():
        np.testing.assert_allclose(getattr(grads, name), want, rtol=0, atol=1e-12, err_msg=name)
