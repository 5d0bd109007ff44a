"""The FUSED formulation of the CPU forward (``kernels/lstm_cpu.py``): W_h packed once
per call, each step's GEMM and elementwise work in one compiled loop
(``kernels/lstm_cpu_step.c``). Its values against an independent float64 reference
and against the elementwise step, at shapes that leave partial panels and row
blocks; its packing; and that it runs only where the compiled step serves the call,
computing as HOISTED elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve.kernels import backend_numpy, lstm, lstm_cpu, native
from gradserve.lstm_signature import LSTMInputs
from tests.kernels.lstm_cases import (
    GENERIC,
    INPUTS,
    TOLERANCE,
    random_case,
    require_native,
    scaled_error,
)

FUSED, HOISTED = lstm_cpu.Formulation.FUSED, lstm_cpu.Formulation.HOISTED


def _forward(
    form: lstm_cpu.Formulation,
    case: dict,
    mode: native.Mode = native.Mode.AUTO,
    **attrs,
) -> lstm.LSTMActivations:
    token = lstm_cpu.STEP_KERNEL.set(mode)
    pinned = lstm_cpu.PINNED.set(form)
    try:
        return lstm.block_lstm_forward(
            backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)), **attrs
        )
    finally:
        lstm_cpu.PINNED.reset(pinned)
        lstm_cpu.STEP_KERNEL.reset(token)


def _float64_reference(case: dict, **attrs) -> lstm.LSTMActivations:
    """The generic per-step loop (``lstm.py``, no formulation) in float64."""
    wide = {k: v.astype(np.float64) if k != "seq_len_max" else v for k, v in case.items()}
    return lstm.block_lstm_forward(GENERIC, LSTMInputs(*(wide[k] for k in INPUTS)), **attrs)


@pytest.mark.parametrize(
    ("batch", "units", "peephole", "clip", "layout"),
    [
        (1, 1, True, 0.0, lstm.GateLayout.IFCO),
        (6, 16, True, 0.0, lstm.GateLayout.ICFO),  # one full panel, one full row block
        (7, 17, False, 0.5, lstm.GateLayout.IFCO),  # a unit past a panel, a row past a block
        (13, 40, True, 0.3, lstm.GateLayout.ICFO),
        (33, 3, True, 0.0, lstm.GateLayout.IFCO),
        (20, 300, True, 0.0, lstm.GateLayout.ICFO),  # K = 300 sums: the GEMM's accuracy
    ],
)
def test_fused_computes_the_lstm_at_shapes_with_partial_panels_and_blocks(
    batch, units, peephole, clip, layout
):
    require_native()
    rng = np.random.default_rng(batch * 1000 + units)
    case = random_case(rng, 5, batch, 9, units, np.float32, scale=0.8 if units < 100 else 0.5)
    attrs = dict(seq_len_max=4, use_peephole=peephole, cell_clip=clip, layout=layout,
                 forget_bias=1.0)  # fmt: skip
    fused = _forward(FUSED, case, **attrs)
    want = _float64_reference(case, **attrs)
    hoisted = _forward(HOISTED, case, **attrs)
    for name, a, b, c in zip(lstm.LSTMActivations._fields, fused, want, hoisted):
        assert a.dtype == np.float32 and a.shape == b.shape
        assert scaled_error(a, b.astype(np.float32)) < TOLERANCE["float32"], name
        assert scaled_error(a, c) < TOLERANCE["float32"], name  # and the elementwise step's
        assert not a[4:].any(), name  # past seq_len_max: zero
    # another summation than BLAS's: other last bits (which shows FUSED computed)
    if units >= 16:
        assert not np.array_equal(fused.h, hoisted.h)


def test_fused_takes_a_broadcast_state_and_exact_saturated_gates():
    """A [1, H] h_prev and cs_prev (library callers: the server checks shapes) are
    spread before the step reads [B, H] of them; a gate whose sigmoid the rational tanh
    would round to 0 is its sigmoid, as the elementwise step's (the float64 generic
    loop's half-tanh rounds it to 0 there)."""
    require_native()
    case = random_case(np.random.default_rng(9), 3, 5, 4, 18, np.float32)
    for k in ("cs_prev", "h_prev"):
        case[k] = case[k][:1]
    attrs = dict(seq_len_max=3, use_peephole=True)
    fused = _forward(FUSED, case, **attrs)
    spread = dict(case, cs_prev=np.repeat(case["cs_prev"], 5, 0),
                  h_prev=np.repeat(case["h_prev"], 5, 0))  # fmt: skip
    for a, b in zip(fused, _forward(FUSED, spread, **attrs)):
        np.testing.assert_array_equal(a, b)
    spread["b"][:] = -40.0  # every gate deep in saturation: sigmoid(-40 + ...) ~ 4e-18
    fused = _forward(FUSED, spread, **attrs)
    hoisted = _forward(HOISTED, spread, **attrs)
    for gate in ("i", "f", "o"):
        got = getattr(fused, gate)
        assert (got > 0).all() and (got < 1e-16).all(), gate
        np.testing.assert_allclose(got, getattr(hoisted, gate), rtol=1e-4, err_msg=gate)


@pytest.mark.parametrize("why", ["float64", "numpy pass"])
def test_fused_computes_as_hoisted_where_the_compiled_step_does_not_serve(why):
    dtype, mode = (np.float64, native.Mode.AUTO) if why == "float64" else (
        np.float32, native.Mode.NUMPY)  # fmt: skip
    case = random_case(np.random.default_rng(4), 4, 6, 5, 20, dtype)
    attrs = dict(seq_len_max=4, use_peephole=True)
    for a, b in zip(_forward(FUSED, case, mode, **attrs), _forward(HOISTED, case, mode, **attrs)):
        np.testing.assert_array_equal(a, b)


def test_the_planner_measures_fused_only_where_it_can_run(monkeypatch):
    require_native()
    planner = lstm_cpu.Planner()
    monkeypatch.setattr(lstm_cpu, "PLANNER", planner)
    for dtype in (np.float32, np.float64):
        case = random_case(np.random.default_rng(2), 4, 3, 5, 6, dtype)
        lstm.block_lstm_forward(backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)),
                                seq_len_max=4)  # fmt: skip
    measured = {key[3]: set(timings) for key, timings in planner.measured.items()}
    assert measured["<f4"] == set(lstm_cpu.Formulation)
    assert measured["<f8"] == set(lstm_cpu.Formulation) - {FUSED}


def test_the_packed_weights_are_aligned_and_hold_w_h_by_panel():
    require_native()
    units = 17
    ws = lstm_cpu._new_workspace((FUSED, 2, 3, 5, units, "<f4"))
    assert ws.packed.ctypes.data % lstm_cpu.PACK_ALIGNMENT == 0
    assert ws.gates.size == 0 and ws.tmp.size == 0  # FUSED needs neither
    w_h = np.random.default_rng(1).standard_normal((units, 4 * units)).astype(np.float32)
    offsets = (2 * units, 0, 3 * units, units)  # i, f, c, o: the columns of each gate
    native.pack_recurrent(w_h, offsets, ws.packed)
    # packed[p][k][g][u]: panels of VL units by the four gates, zero past the last unit
    (width,) = [vl for vl in (4, 8, 16) if ws.packed.size == -(-units // vl) * units * 4 * vl]
    panels = ws.packed.reshape(-1, units, 4, width)
    for g, off in enumerate(offsets):
        unpacked = panels[:, :, g, :].transpose(1, 0, 2).reshape(units, -1)
        np.testing.assert_array_equal(unpacked[:, :units], w_h[:, off : off + units])
        assert not unpacked[:, units:].any()
    with pytest.raises(ValueError, match="pack_recurrent"):
        native.pack_recurrent(w_h[:, :-1], offsets, ws.packed)
    with pytest.raises(ValueError, match="pack_recurrent"):
        native.pack_recurrent(w_h, offsets, ws.packed[:-1])
    with pytest.raises(ValueError, match="pack_recurrent"):
        native.pack_recurrent(w_h.astype(np.float64), offsets, ws.packed)
