"""The CPU backward's recurrence (``kernels/lstm_cpu_backward.py``) against the generic
per-step loop of ``bwd_step`` (the CUDA path's algorithm, itself checked against
TensorFlow's recordings and finite differences in ``test_lstm_golden`` and
``test_lstm_gradcheck``, which run this module on the NumPy backend): every dtype,
both gate layouts, with and without peepholes, clipped cells, steps past
``seq_len_max``, and blocks that do not divide the sequence; with either elementwise
pass (the compiled step gives the NumPy passes' bits)."""

from __future__ import annotations

import contextvars

import numpy as np
import pytest

from gradserve.kernels import backend_numpy, lstm, lstm_cpu, lstm_cpu_backward, native
from gradserve.lstm_signature import LSTMInputs, LSTMOutputGrads
from tests.kernels.lstm_cases import (
    GENERIC,
    GRADS,
    INPUTS,
    OUTPUT_GRADS,
    STEP_KERNELS,
    TOLERANCE,
    random_case,
    require_native,
    scaled_error,
)

HOISTED = lstm_cpu.Formulation.HOISTED
BY_STEP_KERNEL = pytest.mark.parametrize(
    "step_kernel", STEP_KERNELS, ids=lambda m: m.value, indirect=True
)


def _grads(backend, case, activations, **attrs):
    return lstm.block_lstm_backward(
        backend,
        LSTMInputs(*(case[k] for k in INPUTS)),
        activations,
        LSTMOutputGrads(*(case[k] for k in OUTPUT_GRADS)),
        **attrs,
    )


@BY_STEP_KERNEL
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("block_steps", [1, 3, 1000])  # 3: blocks of 3, 3, ..., and a rest
@pytest.mark.parametrize(
    ("steps", "batch", "units", "length", "layout", "peephole", "clip"),
    [
        (7, 5, 6, 7, lstm.GateLayout.IFCO, True, 0.0),
        (7, 5, 6, 5, lstm.GateLayout.ICFO, True, 0.3),
        (8, 3, 4, 8, lstm.GateLayout.IFCO, False, 0.2),
        (9, 4, 5, 7, lstm.GateLayout.ICFO, False, 0.0),
        (3, 1, 2, 1, lstm.GateLayout.IFCO, True, 0.1),
        (2, 0, 3, 2, lstm.GateLayout.ICFO, True, 0.0),  # batch 0
        (4, 3, 37, 4, lstm.GateLayout.IFCO, True, 0.0),  # W_h^T in several strips
    ],
)
def test_matches_the_generic_loop(
    monkeypatch,
    step_kernel,
    dtype,
    block_steps,
    steps,
    batch,
    units,
    length,
    layout,
    peephole,
    clip,
):
    monkeypatch.setattr(lstm_cpu_backward, "BLOCK_ELEMENTS", block_steps * max(1, batch * units))
    case = random_case(
        np.random.default_rng(steps * 10 + units), steps, batch, 5, units, dtype, length, 1.0
    )
    attrs = dict(seq_len_max=length, layout=layout, use_peephole=peephole, cell_clip=clip)
    activations = lstm.block_lstm_forward(
        GENERIC, LSTMInputs(*(case[k] for k in INPUTS)), **attrs
    )  # fmt: skip
    if clip and batch:  # the case must clip some cells, and leave others unclipped
        stored = np.abs(activations.cs[:length].astype(np.float64))
        clipped = stored == float(np.asarray(clip, dtype))
        assert clipped.any() and not clipped.all()
    got = _grads(backend_numpy, case, activations, **attrs)
    want = _grads(GENERIC, case, activations, **attrs)
    tol = TOLERANCE[np.dtype(dtype).name]
    for k, a, b in zip(GRADS, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert scaled_error(a, b) < tol, k


def test_check_runs_before_every_step_and_can_abandon_the_call(monkeypatch):
    """The BLAS formulations' backward (FUSED's checks between its calls of several
    steps: ``test_lstm_cpu_fused``), pinned: ``auto`` fuses where the process has one
    BLAS thread."""
    hoisted = contextvars.ContextVar("p", default=lstm_cpu.Formulation.HOISTED)
    monkeypatch.setattr(lstm_cpu, "PINNED", hoisted)
    monkeypatch.setattr(lstm_cpu_backward, "BLOCK_ELEMENTS", 2 * 3 * 4)  # blocks of 2 steps
    case = random_case(np.random.default_rng(0), 7, 3, 5, 4, np.float32)
    activations = lstm.block_lstm_forward(GENERIC, LSTMInputs(*(case[k] for k in INPUTS)),
                                          seq_len_max=7)  # fmt: skip
    calls = []
    _grads(backend_numpy, case, activations, seq_len_max=7, check=lambda: calls.append(1))
    assert len(calls) == 7

    def deadline() -> None:
        if len(calls) == 10:
            raise TimeoutError("deadline")
        calls.append(1)

    with pytest.raises(TimeoutError):
        _grads(backend_numpy, case, activations, seq_len_max=7, check=deadline)


@BY_STEP_KERNEL
@pytest.mark.parametrize("layout", list(lstm.GateLayout), ids=lambda g: g.value)
@pytest.mark.parametrize("peephole", [False, True])
@pytest.mark.parametrize("clip", [0.0, 0.3])
@pytest.mark.parametrize(
    "poison",
    [
        {"h_grad": np.inf, "wco": 0.0, "wci": 0.0},  # inf meets a zero peephole weight
        {"cs_grad": -np.inf},
        {"h_grad": np.nan},
        {"cs_grad": 3e38, "h_grad": 3e38},  # finite, overflows on the way back
    ],
    ids=["inf-and-zero-weights", "minus-inf", "nan", "overflow"],
)
def test_non_finite_gradients_match_the_generic_loop_exactly(
    step_kernel, poison, peephole, clip, layout
):
    """Only products are regrouped, never sums: NaN and infinity land where the generic
    loop (and the CUDA kernel) put them."""
    case = random_case(np.random.default_rng(5), 6, 3, 4, 5, np.float32, 6, 1.0)
    for name, value in poison.items():
        if name in OUTPUT_GRADS:
            case[name][3] = value
        else:
            case[name][:] = value
    attrs = dict(seq_len_max=6, use_peephole=peephole, cell_clip=clip, layout=layout)
    activations = lstm.block_lstm_forward(GENERIC, LSTMInputs(*(case[k] for k in INPUTS)), **attrs)
    with np.errstate(all="ignore"):
        got = _grads(backend_numpy, case, activations, **attrs)
        want = _grads(GENERIC, case, activations, **attrs)
    assert any(not np.isfinite(a).all() for a in want)  # the case reaches the outputs
    for k, a, b in zip(GRADS, got, want):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=k)
        np.testing.assert_array_equal(np.isposinf(a), np.isposinf(b), err_msg=k)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=k)
        finite = np.isfinite(b)
        assert scaled_error(a[finite], b[finite]) < TOLERANCE["float32"], k


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    ("layout", "peephole", "clip", "length", "poison"),
    [
        (lstm.GateLayout.IFCO, True, 0.0, 9, None),
        (lstm.GateLayout.ICFO, True, 0.3, 7, None),
        (lstm.GateLayout.IFCO, False, 0.2, 9, None),
        (lstm.GateLayout.ICFO, False, 0.0, 1, None),
        (lstm.GateLayout.IFCO, True, 0.3, 9, "h_grad"),  # NaN and inf on the way back
        (lstm.GateLayout.ICFO, True, 0.0, 9, "cs_grad"),
        # a clip stored as 0 (float16: 1e-8 rounds to 0) clips every cell: the compiled
        # step took clip_at > 0 for "no clip" and masked nothing (a review helper)
        (lstm.GateLayout.IFCO, True, 1e-8, 9, None),
    ],
)
def test_the_compiled_backward_step_gives_the_numpy_passes_bits(
    monkeypatch, dtype, layout, peephole, clip, length, poison
):
    """With a formulation of the BLAS pinned (FUSED's backward, the default in float32,
    sums its own GEMM: ``test_lstm_cpu_fused.py``)."""
    require_native()
    monkeypatch.setattr(lstm_cpu, "PINNED", contextvars.ContextVar("pinned", default=HOISTED))
    calls = []
    real = lstm_cpu_backward._native_step

    def counting(*args):
        step = real(*args)
        return None if step is None else (lambda *a: calls.append(1) or step(*a))

    monkeypatch.setattr(lstm_cpu_backward, "_native_step", counting)
    case = random_case(np.random.default_rng(11), 9, 6, 5, 19, dtype, length, 1.0)
    if poison:
        case[poison][4, 1, :3] = (np.nan, np.inf, -np.inf)
    attrs = dict(seq_len_max=length, layout=layout, use_peephole=peephole, cell_clip=clip)
    activations = lstm.block_lstm_forward(GENERIC, LSTMInputs(*(case[k] for k in INPUTS)), **attrs)
    grads = {}
    for mode in (native.Mode.NATIVE, native.Mode.NUMPY):
        token = lstm_cpu.STEP_KERNEL.set(mode)
        try:
            with np.errstate(all="ignore"):
                grads[mode] = _grads(backend_numpy, case, activations, **attrs)
        finally:
            lstm_cpu.STEP_KERNEL.reset(token)
    assert len(calls) == length  # one compiled step per step, none for NumPy's passes
    # the same values; a NaN may carry the other sign (which of two NaNs a sum or a
    # product keeps depends on its operands' order, which the compiler may swap)
    for k, a, b in zip(GRADS, grads[native.Mode.NATIVE], grads[native.Mode.NUMPY]):
        np.testing.assert_array_equal(a, b, err_msg=k)
        same_bits = a.view(f"u{a.itemsize}") == b.view(f"u{b.itemsize}")
        assert (same_bits | (np.isnan(a) & np.isnan(b))).all(), k
