"""The FUSED formulation of the CPU forward (``kernels/lstm_cpu.py``): W_h packed once
per call, each step's GEMM and elementwise work in one compiled loop
(``kernels/lstm_cpu_step.c``). Its values against an independent float64 reference
and against the elementwise step, at shapes that leave partial panels and row
blocks; its packing; and that it runs only where the compiled step serves the call,
computing as HOISTED elsewhere."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import signal
import time
import types

import numpy as np
import pytest
import threadpoolctl

from gradserve.kernels import backend_numpy, blas_threads, lstm, lstm_cpu, lstm_cpu_backward, native
from gradserve.lstm_signature import LSTMGrads, LSTMInputs, LSTMOutputGrads
from tests.kernels.lstm_cases import (
    GENERIC,
    INPUTS,
    OUTPUT_GRADS,
    TOLERANCE,
    pinned_forward,
    random_case,
    require_native,
    scaled_error,
)

FUSED, HOISTED = lstm_cpu.Formulation.FUSED, lstm_cpu.Formulation.HOISTED


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
    fused = pinned_forward(case, form=FUSED, **attrs)
    want = _float64_reference(case, **attrs)
    hoisted = pinned_forward(case, form=HOISTED, **attrs)
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
    fused = pinned_forward(case, form=FUSED, **attrs)
    spread = dict(case, cs_prev=np.repeat(case["cs_prev"], 5, 0),
                  h_prev=np.repeat(case["h_prev"], 5, 0))  # fmt: skip
    for a, b in zip(fused, pinned_forward(spread, form=FUSED, **attrs)):
        np.testing.assert_array_equal(a, b)
    spread["b"][:] = -40.0  # every gate deep in saturation: sigmoid(-40 + ...) ~ 4e-18
    fused = pinned_forward(spread, form=FUSED, **attrs)
    hoisted = pinned_forward(spread, form=HOISTED, **attrs)
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
    for a, b in zip(
        pinned_forward(case, mode, FUSED, **attrs), pinned_forward(case, mode, HOISTED, **attrs)
    ):
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


def test_the_packed_weights_are_aligned_and_hold_w_by_panel():
    require_native()
    inputs, units = 5, 17
    ws = lstm_cpu._new_workspace((FUSED, 2, 3, inputs, units, "<f4"))
    assert ws.packed.ctypes.data % lstm_cpu.PACK_ALIGNMENT == 0
    assert ws.gates.size == 0 and ws.tmp.size == 0  # FUSED needs neither
    assert ws.packed.size == native.packed_floats(units, units)  # W_h
    rng = np.random.default_rng(1)
    offsets = (2 * units, 0, 3 * units, units)  # i, f, c, o: the columns of each gate
    for rows in (units, inputs + units):  # W_h, and any rows
        w = rng.standard_normal((rows, 4 * units)).astype(np.float32)
        packed = lstm_cpu.aligned_empty(native.packed_floats(rows, units), np.dtype("f4"))
        native.pack(w, offsets, packed)
        # packed[p][k][g][u]: panels of VL units by the four gates, 0 past the last unit
        (width,) = [vl for vl in (4, 8, 16) if packed.size == -(-units // vl) * rows * 4 * vl]
        panels = packed.reshape(-1, rows, 4, width)
        for g, off in enumerate(offsets):
            unpacked = panels[:, :, g, :].transpose(1, 0, 2).reshape(rows, -1)
            np.testing.assert_array_equal(unpacked[:, :units], w[:, off : off + units])
            assert not unpacked[:, units:].any()
    for bad_w, bad_out in (
        (w[:, :-1], packed),  # not 4 units wide
        (w, packed[:-1]),  # not its size
        (w.astype(np.float64), packed),
        (np.asfortranarray(w), packed),
    ):
        with pytest.raises(ValueError, match="pack: weights"):
            native.pack(bad_w, offsets, bad_out)


# --- teams: FUSED at more than one thread ---------------------------------------------


@pytest.fixture
def team_of(monkeypatch):
    """FUSED's calls as in a process of two BLAS threads, in teams of n where the BLAS
    threads sleep soon (0 or 1: the caller alone)."""
    require_native()
    monkeypatch.setattr(blas_threads.BLAS, "plan_count", lambda: 2)

    def size(n: int) -> None:
        monkeypatch.setattr(blas_threads.BLAS, "count", lambda: max(n, 1))
        monkeypatch.setattr(blas_threads.BLAS, "sleep_soon", lambda: n > 0)

    return size


@pytest.mark.parametrize("units", [70, 200])  # 200: 13 panels, cache groups of 8 and 5
def test_a_team_computes_the_same_bits_at_any_size_and_the_lstm(team_of, units):
    """A team shares each step's tiles; each tile is one member's, so the caller alone
    (no team: BLAS threads that spin, a failed thread start) and 2, 3 or 8 members (8
    on this machine's 2 cores: members the scheduler leaves waiting) give the same
    bits; and the LSTM's values. The projection is the BLAS's GEMM, whose threads
    split its output, not its sums: the bits are the same with one BLAS thread or
    two (with the steps projecting the input themselves where there were two, they
    were not), at this depth (9 inputs: OpenBLAS's one-thread driver blocks sums of
    more than 448 otherwise than its threaded one, a review helper)."""
    scale = 0.8 if units < 100 else 0.5
    case = random_case(np.random.default_rng(12), 20, 13, 9, units, np.float32, scale=scale)
    attrs = dict(seq_len_max=18, use_peephole=True, cell_clip=0.7, forget_bias=1.0)
    results = {}
    for n in (0, 2, 3, 8, 2, 3, 8, 0):  # each size again: a race would show as other bits
        team_of(n)
        got = pinned_forward(case, form=FUSED, **attrs)
        for a, b in zip(results.setdefault(0, got), got):
            np.testing.assert_array_equal(a, b, err_msg=f"{n} members")
    want = _float64_reference(case, **attrs)
    for name, a, b in zip(lstm.LSTMActivations._fields, results[0], want):
        # (float32's rounding grows with the steps: the first five, as above)
        assert scaled_error(a[:5], b[:5].astype(np.float32)) < TOLERANCE["float32"], name
    for threads in (1, 2):
        with threadpoolctl.threadpool_limits(threads, user_api="blas"):
            for a, b in zip(pinned_forward(case, form=FUSED, **attrs), results[0]):
                np.testing.assert_array_equal(a, b, err_msg=f"{threads} BLAS threads")


@pytest.mark.parametrize("members", [1, 2])  # one BLAS thread (its projection), a team
def test_fused_computes_subnormals_as_zero_as_tensorflow_and_restores_the_mode(
    team_of, monkeypatch, members
):
    """FUSED reads and writes subnormal floats as zero (flush-to-zero, denormals-are-zero,
    as TensorFlow's CPU kernels): weights of 1e-39 give the bits of zero weights (a
    forward of them took 4.4 s against 42 ms: a review helper). The calling thread's
    mode is as it was after the call: NumPy there still makes subnormals."""
    team_of(members)
    if members == 1:
        monkeypatch.setattr(blas_threads.BLAS, "plan_count", lambda: 1)
    case = random_case(np.random.default_rng(18), 6, 7, 5, 40, np.float32)
    # no bias and no state: the gates' pre-activations are the subnormal products alone
    case.update(b=np.zeros_like(case["b"]), cs_prev=np.zeros_like(case["cs_prev"]))
    tiny = dict(case, w=(case["w"] * np.float32(1e-39)).astype(np.float32))
    assert np.count_nonzero(tiny["w"]) == tiny["w"].size  # subnormal, not zero
    zero = dict(case, w=np.zeros_like(case["w"]))
    attrs = dict(seq_len_max=6, use_peephole=True)
    got = pinned_forward(tiny, form=FUSED, **attrs)
    for a, b in zip(got, pinned_forward(zero, form=FUSED, **attrs)):
        np.testing.assert_array_equal(a, b)
    assert not got.ci.any()
    unflushed = pinned_forward(tiny, native.Mode.NUMPY, HOISTED, **attrs)
    assert unflushed.ci.any()  # (where subnormals are kept, ci = tanh(z) is one)
    assert np.float32(1e-38) * np.float32(0.01) > 0  # this thread's mode restored


@pytest.mark.parametrize("operand", ["w", "x"])
def test_fused_reads_subnormals_as_zero_in_the_blas_projection_with_two_threads(operand):
    """The input projection is the BLAS's GEMM, whose threads compute without
    flush-to-zero: FUSED hands it W_x and x with their subnormals as zeros. All of W
    subnormal sums 256 products into normal numbers there, and x subnormal beside a
    large W makes normal products: the first step's pre-activations are that GEMM alone
    (no bias, zero states), and the outputs are the bits of zeros in their place (with
    two BLAS threads the helper thread's share gave nonzero cells, and the forward took
    146.5 and 557.6 ms against 8.3: a review helper). At a size OpenBLAS threads."""
    require_native()
    rng = np.random.default_rng(37)
    case = random_case(rng, 6, 32, 256, 64, np.float32)
    case.update(b=np.zeros_like(case["b"]), cs_prev=np.zeros_like(case["cs_prev"]),
                h_prev=np.zeros_like(case["h_prev"]))  # fmt: skip
    if operand == "x":
        case["w"] = case["w"] * np.float32(1e3)
    tiny = dict(case, **{operand: case[operand] * np.float32(1e-39)})
    assert np.count_nonzero(tiny[operand]) == tiny[operand].size  # subnormal, not zero
    zero = dict(case, **{operand: np.zeros_like(case[operand])})
    attrs = dict(seq_len_max=6, use_peephole=True)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        got, want = (pinned_forward(c, form=FUSED, **attrs) for c in (tiny, zero))
    for name, a, b in zip(lstm.LSTMActivations._fields, got, want, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert not got.ci[0].any()


def _step_inputs(rng: np.random.Generator, batch: int, inputs: int, units: int) -> dict:
    """One FUSED step's operands (W_h packed; the projection of ``inputs`` inputs)."""
    w_h = rng.standard_normal((units, 4 * units)).astype(np.float32) * 0.3
    packed = lstm_cpu.aligned_empty(native.packed_floats(units, units), np.dtype("f4"))
    offsets = (0, units, 2 * units, 3 * units)
    native.pack(w_h, offsets, packed)
    x, w_x = (rng.standard_normal(shape).astype(np.float32) for shape in
              ((batch, inputs), (inputs, 4 * units)))  # fmt: skip
    arrays = {
        "proj": x @ w_x,
        "h": rng.standard_normal((batch, units)).astype(np.float32),
        "c": rng.standard_normal((batch, units)).astype(np.float32),
        "bias": rng.standard_normal(4 * units).astype(np.float32),
        "packed": packed,
    }
    return dict(arrays, batch=batch, inputs=inputs, units=units, offsets=offsets)


def _run_step(team: int | None, op: dict, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """The step's seven outputs, written into NaNs (so a tile left unwritten shows)."""
    outs = np.full((7, op["batch"], op["units"]), np.nan, np.float32)
    steps = native.fused_steps() if lib is None else getattr(lib, native.FUSED_STEPS)
    steps(
        team, 1, op["h"].ctypes.data, op["c"].ctypes.data, op["packed"].ctypes.data,
        op["proj"].ctypes.data, 4 * op["units"], op["bias"].ctypes.data, None, op["batch"],
        op["units"], *op["offsets"], 0.0, *(o.ctypes.data for o in outs),
    )  # fmt: skip
    return outs


@pytest.fixture
def delayed_build(tmp_path):
    """The compiled step built again with ``-DGRADSERVE_TEAM_DELAYS``: sleeps where a
    team's members may be late or slow (``lstm_cpu_step.c``), the code otherwise the
    same."""
    require_native()
    target = tmp_path / "delayed.so"
    flags = native.flags(native.cpu_identity())
    command = [*native._compiler(), *flags, "-DGRADSERVE_TEAM_DELAYS", str(native.SOURCE)]
    done = native._run([*command, "-lm", "-o", str(target)], native.COMPILE_TIMEOUT_SECONDS)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(target))
    native._declare(lib)
    return lib


def test_a_member_late_for_a_step_takes_nothing_of_the_next(delayed_build):
    """A kept team serves steps of other shapes one after another: a member that gets a
    core only after a small step ended must take no claim of the next, larger one (it
    did: the larger step's claim count was stored before its generation, and the
    caller returned with a tile still being written, reading a half-written ``h`` on
    the next step: a review helper, 1 step in about 9,000 with 8 members on 2 cores).
    Every large step's outputs, written into NaNs, are the caller's alone."""
    lib = delayed_build
    rng = np.random.default_rng(14)
    small = _step_inputs(rng, 2, 4, 16)  # one claim
    large = _step_inputs(rng, 2, 4, 256)  # 4 groups of panels (AVX-512): 4 claims
    want = _run_step(None, large, lib)
    team = getattr(lib, native.TEAM_START)(8)
    assert team is not None
    try:
        for _ in range(400):
            _run_step(team, small, lib)
            got = _run_step(team, large, lib)
            assert not np.isnan(got).any()
            np.testing.assert_array_equal(got, want)
    finally:
        getattr(lib, native.TEAM_STOP)(team)


def _backward_step_inputs(rng: np.random.Generator, batch: int, units: int) -> dict:
    """One step of FUSED's backward: dgates[t + 1], W_h^T packed, the activations."""
    w_h = rng.standard_normal((units, 4 * units)).astype(np.float32) * 0.3
    packed = lstm_cpu.aligned_empty(native.packed_transposed_floats(units), np.dtype("f4"))
    native.pack_transposed(w_h, packed)
    acts = rng.uniform(0.1, 0.9, (9, batch, units)).astype(np.float32)
    next_gates = rng.standard_normal((batch, 4 * units)).astype(np.float32)
    dcs = rng.standard_normal((batch, units)).astype(np.float32)
    return dict(packed=packed, acts=acts, next=next_gates, dcs=dcs, batch=batch, units=units)


def _run_backward_step(team: int | None, op: dict, lib: ctypes.CDLL) -> np.ndarray:
    """The step's gate gradients and carry, written into NaNs and a copy of dcs."""
    gates = np.full((op["batch"], 4 * op["units"]), np.nan, np.float32)
    dcs = op["dcs"].copy()
    units = op["units"]
    getattr(lib, native.BACKWARD_FUSED_STEP)(
        team, op["next"].ctypes.data, op["packed"].ctypes.data,
        *(a.ctypes.data for a in op["acts"]), None, 0, 0.0, op["batch"], units,
        0, units, 2 * units, 3 * units, dcs.ctypes.data, gates.ctypes.data, None,
    )  # fmt: skip
    return np.concatenate([gates.ravel(), dcs.ravel()])


def test_forward_and_backward_steps_take_turns_on_a_kept_team(delayed_build):
    """A kept team serves a call's forward, then its backward, then the next forward
    (the server's order): each step, whatever the kind of the one before it and late
    members of it, computes the caller alone's bits (a forward that ran the backward's
    claims wrote NaNs: a review helper's mutation, which no test caught)."""
    lib = delayed_build
    rng = np.random.default_rng(15)
    forward = {"small": _step_inputs(rng, 2, 4, 16), "large": _step_inputs(rng, 7, 4, 256)}
    backward = {
        "small": _backward_step_inputs(rng, 2, 16),
        "large": _backward_step_inputs(rng, 7, 300),
    }
    want = {
        **{("f", k): _run_step(None, op, lib) for k, op in forward.items()},
        **{("b", k): _run_backward_step(None, op, lib) for k, op in backward.items()},
    }
    team = getattr(lib, native.TEAM_START)(8)
    assert team is not None
    try:
        for n in range(120):
            for kind, size in (("f", "small"), ("b", "large"), ("b", "small"), ("f", "large")):
                if kind == "f":
                    got = _run_step(team, forward[size], lib)
                else:
                    got = _run_backward_step(team, backward[size], lib)
                np.testing.assert_array_equal(got, want[kind, size], err_msg=f"{n}: {kind} {size}")
    finally:
        getattr(lib, native.TEAM_STOP)(team)


def test_teams_are_kept_stopped_past_a_few_and_survive_an_abandoned_call(team_of, monkeypatch):
    teams = native.FusedTeams()
    with contextlib.ExitStack() as stack:
        taken = [stack.enter_context(teams.team(3)) for _ in range(teams.KEEP + 2)]
        assert None not in taken and len(set(taken)) == len(taken)
    kept = teams._idle[3]
    assert len(kept) == teams.KEEP and set(kept) < set(taken)  # the rest stopped, joined
    # A call that ends mid-sequence (its deadline, say) returns the team between two
    # calls of steps; the next call, of another shape, computes as the caller alone would.
    team_of(2)
    monkeypatch.setattr(lstm_cpu, "MAX_STEPS_PER_CALL", 2)  # a check every 2 steps
    case = random_case(np.random.default_rng(15), 8, 7, 5, 40, np.float32)
    calls = []

    def deadline() -> None:
        calls.append(1)
        if len(calls) == 3:  # after 4 of the 8 steps
            raise TimeoutError("deadline")

    inputs = LSTMInputs(*(case[k] for k in INPUTS))
    token = lstm_cpu.PINNED.set(FUSED)
    try:
        with pytest.raises(TimeoutError):
            lstm.block_lstm_forward(backend_numpy, inputs, seq_len_max=8, check=deadline)
    finally:
        lstm_cpu.PINNED.reset(token)
    other = random_case(np.random.default_rng(16), 5, 13, 9, 200, np.float32, scale=0.5)
    got = pinned_forward(other, form=FUSED, seq_len_max=5)
    team_of(0)
    alone = pinned_forward(other, form=FUSED, seq_len_max=5)
    for a, b in zip(got, alone):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("call_flops", "chunk_bytes", "checks"), [
    (10**12, 1 << 23, 3),  # 16 steps a call (the most): calls of 16, 16 and 8
    (2 * 2 * 3 * 12 * 3, 1 << 23, 14),  # 3 steps a call, one chunk of 40: 14 calls
    (2 * 2 * 3 * 12 * 3, 10 * 2 * 12 * 4, 16),  # chunks of 10 steps: 4 calls each
    (1, 1 << 23, 40),  # a step a call
])  # fmt: skip
def test_fused_checks_between_its_calls_of_several_steps_with_the_same_bits(
    monkeypatch, call_flops, chunk_bytes, checks
):
    """FUSED's steps run several a compiled call (``steps_per_call``: about a
    millisecond of work, at most 16), and ``check`` (the call's liveness; where the
    server's ops may pause for others) runs before each call: the bits do not depend on
    how the steps are grouped, nor on the chunks of the projection."""
    require_native()
    case = random_case(np.random.default_rng(39), 40, 2, 5, 3, np.float32)
    attrs = dict(seq_len_max=40, use_peephole=True, cell_clip=0.4)
    monkeypatch.setattr(lstm_cpu, "CALL_FLOPS", 1)  # a step a call: the reference
    want = pinned_forward(case, form=FUSED, **attrs)
    monkeypatch.setattr(lstm_cpu, "CALL_FLOPS", call_flops)
    monkeypatch.setattr(lstm_cpu, "CHUNK_BYTES", chunk_bytes)
    seen: list[int] = []
    token, pinned = lstm_cpu.STEP_KERNEL.set(native.Mode.AUTO), lstm_cpu.PINNED.set(FUSED)
    try:
        got = lstm.block_lstm_forward(
            backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)), check=lambda: seen.append(1),
            **attrs,
        )  # fmt: skip
    finally:
        lstm_cpu.PINNED.reset(pinned)
        lstm_cpu.STEP_KERNEL.reset(token)
    assert len(seen) == checks
    for name, a, b in zip(lstm.LSTMActivations._fields, got, want, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_team_has_no_more_members_than_a_step_has_claims(team_of, monkeypatch):
    """Each member wakes every step: 8 BLAS threads and a step of one claim (one row
    block, one group of panels) is the caller alone; of 3 claims (with AVX-512's
    blocks of 6 rows), a team of 3."""
    asked = []
    real = native.TEAMS.team
    monkeypatch.setattr(native.TEAMS, "team", lambda n: asked.append(n) or real(n))
    team_of(8)
    for batch, units in ((1, 16), (13, 16), (64, 512)):
        case = random_case(np.random.default_rng(17), 2, batch, 3, units, np.float32)
        pinned_forward(case, form=FUSED, seq_len_max=2)
    claims = [native.step_claims(b, u) for b, u in ((1, 16), (13, 16), (64, 512))]
    assert claims[0] == 1 and 1 < claims[1] < 8 < claims[2]
    assert asked == [1, claims[1], 8]
    asked.clear()  # the backward's claims: its own count
    for batch, units in ((1, 16), (13, 16), (64, 512)):
        case = random_case(np.random.default_rng(17), 2, batch, 3, units, np.float32)
        _backward(case, pinned_forward(case, form=HOISTED, seq_len_max=2), FUSED, seq_len_max=2)
    claims = [native.step_claims(b, u, backward=True) for b, u in ((1, 16), (13, 16), (64, 512))]
    assert claims[0] == 1 and 1 < claims[1] < 8 < claims[2]
    assert asked == [1, claims[1], 8]


def test_teams_are_kept_between_calls_and_a_forked_child_starts_its_own(team_of):
    team_of(2)
    case = random_case(np.random.default_rng(13), 4, 5, 6, 20, np.float32)
    attrs = dict(seq_len_max=4, use_peephole=True)
    want = pinned_forward(case, form=FUSED, **attrs)
    teams = native.TEAMS
    (kept,) = teams._idle[2]
    pinned_forward(case, form=FUSED, **attrs)
    assert teams._idle[2] == [kept]  # the same team again
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its parent's workers are not here
        try:
            assert native.TEAMS._idle == {}
            got = pinned_forward(case, form=FUSED, **attrs)
            ok = all(np.array_equal(a, b) for a, b in zip(got, want))
            os.write(write, b"ok" if ok else b"differ")
        finally:
            os._exit(0)
    os.close(write)
    deadline, exited = time.monotonic() + 60, False
    while not exited and time.monotonic() < deadline:
        exited = os.waitpid(pid, os.WNOHANG) != (0, 0)
        time.sleep(0 if exited else 0.05)
    if not exited:  # a hang: killed (and the pipe then says nothing)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read()
    assert said == b"ok"


def test_the_blas_threads_sleep_soon_only_as_the_server_sets_them(monkeypatch):
    def lib(api: str, layer: str = "pthreads") -> types.SimpleNamespace:
        return types.SimpleNamespace(internal_api=api, threading_layer=layer,
                                     get_num_threads=lambda: 2)  # fmt: skip

    openblas = lib("openblas")
    for libs, timeout, expected in (
        ([openblas], "20", True),
        ([openblas], "4", True),
        ([openblas], "21", False),
        ([openblas], None, False),  # OpenBLAS's default: 0.1 s
        ([openblas], "0", False),  # OpenBLAS ignores 0 and less: its default
        ([openblas], "-1", False),
        ([openblas], "soon", False),
        ([lib("openblas", "openmp")], "20", False),  # OpenMP's threads ignore it
        ([lib("mkl")], "20", False),  # not OpenBLAS: unknown
        ([], "20", False),
    ):
        if timeout is None:
            monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
        else:
            monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", timeout)
        assert blas_threads.BlasThreads(lambda libs=libs: libs).sleep_soon() is expected


# --- the backward: FUSED's recurrence ---------------------------------------------------


def _backward(
    case: dict, activations, form: lstm_cpu.Formulation | None,
    mode: native.Mode = native.Mode.NATIVE, **attrs,
):  # fmt: skip
    """``block_lstm_backward`` on the NumPy backend, the formulation pinned (None: the
    planner's, as a server with ``--lstm-formulation auto``), the compiled steps on
    (``mode``)."""
    token = lstm_cpu.STEP_KERNEL.set(mode)
    pinned = lstm_cpu.PINNED.set(form)
    try:
        return lstm.block_lstm_backward(
            backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)), activations,
            LSTMOutputGrads(*(case[k] for k in OUTPUT_GRADS)), **attrs,
        )  # fmt: skip
    finally:
        lstm_cpu.PINNED.reset(pinned)
        lstm_cpu.STEP_KERNEL.reset(token)


@pytest.fixture
def fused_backward_steps(monkeypatch):
    """The fused backward steps each call runs: those of ``native.backward_fused_steps``
    (several a call) and the ``backward_fused_step`` of dgates[0] @ W_h^T."""
    require_native()
    calls: list[int] = []
    real, real_steps = native.backward_fused_step, native.backward_fused_steps

    def counting():
        step = real()
        return lambda *a: calls.append(1) or step(*a)

    def counting_steps():
        steps = real_steps()
        return lambda team, t, n, *a: calls.extend([1] * n) or steps(team, t, n, *a)

    monkeypatch.setattr(native, "backward_fused_step", counting)
    monkeypatch.setattr(native, "backward_fused_steps", counting_steps)
    return calls


@pytest.mark.parametrize(
    ("batch", "units", "peephole", "clip", "layout"),
    [
        (1, 1, True, 0.0, lstm.GateLayout.IFCO),
        (6, 64, True, 0.0, lstm.GateLayout.ICFO),  # one full panel (AVX-512), one row block
        (7, 65, False, 0.5, lstm.GateLayout.IFCO),  # a unit past a panel, a row past a block
        (13, 40, True, 0.3, lstm.GateLayout.ICFO),
        (33, 3, True, 0.0, lstm.GateLayout.IFCO),
        (20, 300, True, 0.0, lstm.GateLayout.ICFO),  # 5 panels in cache groups of one
    ],
)
def test_the_fused_backward_computes_the_gradients(
    fused_backward_steps, batch, units, peephole, clip, layout
):
    """Against the generic per-step loop in float64 (``lstm.py``), at shapes that leave
    partial panels and row blocks; a fused call per step but the last, and one for the
    gradient of h_prev."""
    case = random_case(np.random.default_rng(31), 9, batch, 11, units, np.float32, scale=0.5)
    attrs = dict(seq_len_max=8, use_peephole=peephole, cell_clip=clip, layout=layout)
    wide = {k: v.astype(np.float64) for k, v in case.items()}
    activations = lstm.block_lstm_forward(GENERIC, LSTMInputs(*(wide[k] for k in INPUTS)), **attrs)
    want = lstm.block_lstm_backward(
        GENERIC, LSTMInputs(*(wide[k] for k in INPUTS)), activations,
        LSTMOutputGrads(*(wide[k] for k in OUTPUT_GRADS)), **attrs,
    )  # fmt: skip
    narrow = lstm.LSTMActivations(*(a.astype(np.float32) for a in activations))
    got = _backward(case, narrow, FUSED, **attrs)
    assert len(fused_backward_steps) == 8  # 7 steps and dgates[0] @ W_h^T
    for name, a, b in zip(LSTMGrads._fields, got, want, strict=True):
        assert a.dtype == np.float32
        assert scaled_error(a, b.astype(np.float32)) < TOLERANCE["float32"], name


@pytest.mark.parametrize(
    ("form", "dtype", "mode", "threads", "sleep_soon", "fused"),
    [
        (None, np.float32, native.Mode.NATIVE, 1, False, True),  # auto, one BLAS thread
        (None, np.float32, native.Mode.NATIVE, 2, True, True),  # auto, a team
        # auto where FUSED would run on one core beside the BLAS's idle threads: the BLAS
        (None, np.float32, native.Mode.NATIVE, 2, False, False),
        (FUSED, np.float16, native.Mode.NATIVE, 2, False, True),  # pinned (in float32)
        (HOISTED, np.float32, native.Mode.NATIVE, 1, True, False),  # a BLAS formulation
        (None, np.float64, native.Mode.NATIVE, 1, True, False),  # float64: no fused step
        (FUSED, np.float32, native.Mode.NUMPY, 1, True, False),  # NumPy's passes
    ],
)
def test_the_backward_fuses_in_float32_where_the_formulation_is_fused_or_auto_with_threads(
    fused_backward_steps, monkeypatch, form, dtype, mode, threads, sleep_soon, fused
):
    monkeypatch.setattr(blas_threads.BLAS, "plan_count", lambda: threads)
    monkeypatch.setattr(blas_threads.BLAS, "count", lambda: threads)
    monkeypatch.setattr(blas_threads.BLAS, "sleep_soon", lambda: sleep_soon)
    case = random_case(np.random.default_rng(32), 4, 3, 5, 6, dtype)
    attrs = dict(seq_len_max=4, use_peephole=True)
    activations = lstm.block_lstm_forward(GENERIC, LSTMInputs(*(case[k] for k in INPUTS)), **attrs)
    monkeypatch.setattr(lstm_cpu, "STEP_KERNEL", contextvars.ContextVar("k", default=mode))
    token = lstm_cpu.PINNED.set(form)
    try:
        lstm.block_lstm_backward(
            backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)), activations,
            LSTMOutputGrads(*(case[k] for k in OUTPUT_GRADS)), **attrs,
        )  # fmt: skip
    finally:
        lstm_cpu.PINNED.reset(token)
    assert len(fused_backward_steps) == (4 if fused else 0)


@pytest.mark.parametrize(("call_flops", "checks"), [
    (10**12, 1 + 3),  # the last step, then calls of 16, 16 and 7
    (2 * 3 * 16 * 4 * 16 * 3, 1 + 13),  # 3 steps a call
    (1, 1 + 39),  # a step a call
])  # fmt: skip
def test_the_fused_backward_checks_between_its_calls_of_several_steps_with_the_same_bits(
    team_of, monkeypatch, call_flops, checks
):
    """As the forward: the backward's fused steps run several a call, ``check`` before
    each (and before the last step, the compiled step's), the bits the same however the
    steps are grouped."""
    team_of(2)
    case = random_case(np.random.default_rng(40), 40, 3, 5, 16, np.float32)
    attrs = dict(seq_len_max=40, use_peephole=True, cell_clip=0.6)
    activations = pinned_forward(case, form=HOISTED, **attrs)
    monkeypatch.setattr(lstm_cpu, "CALL_FLOPS", 1)
    want = _backward(case, activations, FUSED, **attrs)
    monkeypatch.setattr(lstm_cpu, "CALL_FLOPS", call_flops)
    seen: list[int] = []
    token, pinned = lstm_cpu.STEP_KERNEL.set(native.Mode.NATIVE), lstm_cpu.PINNED.set(FUSED)
    try:
        got = lstm.block_lstm_backward(
            backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)), activations,
            LSTMOutputGrads(*(case[k] for k in OUTPUT_GRADS)), check=lambda: seen.append(1),
            **attrs,
        )  # fmt: skip
    finally:
        lstm_cpu.PINNED.reset(pinned)
        lstm_cpu.STEP_KERNEL.reset(token)
    assert len(seen) == checks
    for name, a, b in zip(LSTMGrads._fields, got, want, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("units", [70, 300])  # 300: 5 panels, a cache group each
def test_a_team_computes_the_fused_backwards_bits_at_any_size(team_of, units):
    """Each tile is one member's, in one order: the caller alone and 2, 3 or 8 members
    give the same bits (and none differs with the BLAS thread count: no projection)."""
    case = random_case(np.random.default_rng(33), 12, 13, 9, units, np.float32, scale=0.5)
    attrs = dict(seq_len_max=11, use_peephole=True, cell_clip=0.7)
    activations = pinned_forward(case, form=HOISTED, **attrs)
    first = None
    for n in (0, 2, 3, 8, 2, 3, 8, 0):
        team_of(n)
        got = _backward(case, activations, FUSED, **attrs)
        first = first or got
        for name, a, b in zip(LSTMGrads._fields, first, got, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{n} members: {name}")


@pytest.mark.parametrize("members", [1, 2])
def test_the_fused_backward_computes_subnormals_as_zero_and_restores_the_mode(team_of, members):
    """As the forward's FUSED: W_h of 1e-39 gives the gate gradients of a zero W_h (the
    carry through W_h^T is zero), and the calling thread's mode is restored."""
    team_of(members)
    case = random_case(np.random.default_rng(34), 6, 7, 5, 40, np.float32)
    attrs = dict(seq_len_max=6, use_peephole=True)
    activations = pinned_forward(case, form=HOISTED, **attrs)
    w_h = case["w"][5:]
    tiny = dict(case, w=np.concatenate([case["w"][:5], (w_h * np.float32(1e-39))]))
    assert np.count_nonzero(tiny["w"][5:]) == w_h.size  # subnormal, not zero
    zero = dict(case, w=np.concatenate([case["w"][:5], np.zeros_like(w_h)]))
    got, want = (_backward(c, activations, FUSED, **attrs) for c in (tiny, zero))
    for name in ("cs_prev_grad", "h_prev_grad", "x_grad", "wci_grad", "b_grad"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert not got.h_prev_grad.any()  # dgates[0] @ W_h^T in the fused steps too
    kept = _backward(tiny, activations, HOISTED, **attrs)  # the BLAS's: subnormals kept
    assert kept.h_prev_grad.any()
    assert np.float32(1e-38) * np.float32(0.01) > 0  # this thread's mode restored


@pytest.mark.parametrize("members", [1, 2])
def test_the_fused_backwards_gemms_read_their_subnormals_as_zero_too(team_of, members):
    """The GEMMs after the recurrence are the BLAS's, whose threads compute without
    flush-to-zero (120 ms against 11 at (50, 32, 256) with subnormal weights): they read
    W_x, x and h with their subnormals as zero, and the peepholes' gradients are
    computed flushing too (a subnormal cell made other bits). So W, x, h and the cells
    with subnormal entries give the gradients of zeros there, every one bit for bit,
    and the caller's arrays are left as they were."""
    team_of(members)
    rng = np.random.default_rng(36)
    case = random_case(rng, 6, 7, 5, 40, np.float32)
    attrs = dict(seq_len_max=6, use_peephole=True)
    activations = pinned_forward(case, form=HOISTED, **attrs)
    # some entries of W_x and W_h, of both signs; all of two inputs' rows, whose x_grad
    # then sums subnormal products alone (elsewhere they round away beside normal ones);
    # all of x's input 2 and h's unit 3 (w_grad's rows of them: subnormal sums alone)
    picked = rng.random(case["w"].shape) < 0.3
    picked[[1, 3]] = True
    tiny_w = np.where(picked, case["w"] * np.float32(1e-39), case["w"])
    assert np.count_nonzero(tiny_w[picked]) == picked.sum()  # subnormal, not zero
    x, h, h_prev = case["x"].copy(), activations.h.copy(), case["h_prev"].copy()
    cs, cs_prev = activations.cs.copy(), case["cs_prev"].copy()
    x[..., 2] *= np.float32(1e-39)
    h[..., 3] *= np.float32(1e-39)
    h_prev[..., 3] *= np.float32(1e-39)  # (the first step's previous h)
    # the cells of unit 4: the recurrence's and the peepholes' gradients read them
    cs[..., 4] *= np.float32(1e-39)
    cs_prev[..., 4] *= np.float32(1e-39)
    tiny = dict(case, w=tiny_w, x=x, h_prev=h_prev, cs_prev=cs_prev)
    before = [a.copy() for a in (tiny_w, x, h, h_prev, cs, cs_prev)]
    zeros = [a.copy() for a in (x, h, h_prev, cs, cs_prev)]
    zero_x, zero_h, zero_h_prev, zero_cs, zero_cs_prev = zeros
    zero_x[..., 2] = zero_h[..., 3] = zero_h_prev[..., 3] = 0
    zero_cs[..., 4] = zero_cs_prev[..., 4] = 0
    zero = dict(case, w=np.where(picked, np.float32(0), case["w"]), x=zero_x,
                h_prev=zero_h_prev, cs_prev=zero_cs_prev)  # fmt: skip
    got = _backward(tiny, activations._replace(h=h, cs=cs), FUSED, **attrs)
    want = _backward(zero, activations._replace(h=zero_h, cs=zero_cs), FUSED, **attrs)
    for name, a, b in zip(LSTMGrads._fields, got, want, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert got.x_grad.any() and not got.x_grad[..., [1, 3]].any()
    assert not got.w_grad[[2, 5 + 3]].any()  # x's input 2, h's unit 3: their rows
    for a, b in zip((tiny_w, x, h, h_prev, cs, cs_prev), before):
        np.testing.assert_array_equal(a, b)


def test_calls_of_one_shape_share_one_workspace_whatever_their_length():
    """The projection's chunk follows the input's steps, not ``seq_len_max``: lengths
    20 to 50 of one shape used a workspace each (up to 8 MB apiece, 62 MiB of the 64
    MiB cache for one shape: a review helper)."""
    require_native()
    case = random_case(np.random.default_rng(38), 60, 4, 8, 16, np.float32)
    cache = lstm_cpu.Workspaces()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lstm_cpu, "WORKSPACES", cache)
        for length in (20, 33, 50, 60):
            pinned_forward(case, form=FUSED, seq_len_max=length, use_peephole=True)
    assert len(cache._free) == 1


def test_without_subnormals_copies_only_an_array_that_holds_one():
    require_native()
    tiny = np.finfo(np.float32).tiny
    special = np.array([0.0, -0.0, tiny, -tiny, np.inf, -np.inf, np.nan, 1.0], np.float32)
    assert lstm_cpu.without_subnormals(special) is special
    for n in (1, 15, 16, 17, 33, 100):  # a subnormal at every position of vectors and tails
        for at in range(n):
            a = np.ones(n, np.float32)
            a[at] = -tiny / 2 if at % 2 else tiny * np.float32(2**-23)  # the largest, the least
            assert native.any_subnormal(a), (n, at)
            flushed = lstm_cpu.without_subnormals(a)
            assert flushed is not a and a[at] != 0  # a copy; the array itself unchanged
            assert flushed[at] == 0 and np.signbit(flushed[at]) == bool(at % 2)
            np.testing.assert_array_equal(np.delete(flushed, at), np.ones(n - 1, np.float32))
    view = np.tile(np.append(special, np.float32(1e-40)), (3, 1))[:, 1:]  # not contiguous
    flushed = lstm_cpu.without_subnormals(view)
    np.testing.assert_array_equal(flushed, np.tile(np.append(special[1:], 0), (3, 1)))
    for wrong in (np.ones(4), np.ones((4, 4), np.float32).T):
        with pytest.raises(ValueError):
            native.any_subnormal(wrong)


def test_the_transposed_packing_holds_w_h_by_panels_of_units():
    require_native()
    units = 70
    w_h = np.random.default_rng(35).standard_normal((units, 4 * units)).astype(np.float32)
    packed = lstm_cpu.aligned_empty(native.packed_transposed_floats(units), np.dtype("f4"))
    native.pack_transposed(w_h, packed)
    # a panel is 4 vectors of units: 64 (AVX-512), 32 (AVX) or 16 (else) of them
    (width,) = [w for w in (16, 32, 64) if -(-units // w) * w * 4 * units == packed.size]
    panels = packed.reshape(-1, 4 * units, width)  # [panel][k][unit of the panel]
    want = np.zeros((panels.shape[0] * width, 4 * units), np.float32)
    want[:units] = w_h  # zero past the last unit
    np.testing.assert_array_equal(panels.transpose(0, 2, 1).reshape(-1, 4 * units), want)
    with pytest.raises(ValueError):
        native.pack_transposed(np.asfortranarray(w_h), packed)


def test_the_fused_backward_of_no_step_or_no_unit_computes_nothing(fused_backward_steps):
    """``backward_sequence`` of length 0 leaves the carries zero (it read ``dgates[0]``,
    which is not there, into dh: a review helper); a step or claim count of no unit is
    nothing (a division by zero killed the process)."""
    batch, units = 3, 8
    zeros = np.zeros((0, batch, units), np.float32)
    dh, dcs = np.zeros((batch, units), np.float32), np.zeros((batch, units), np.float32)
    token = lstm_cpu.PINNED.set(FUSED)
    try:
        lstm_cpu_backward.backward_sequence(
            np.ones((batch, units), np.float32), *[zeros] * 8, *[np.ones(units, np.float32)] * 3,
            np.ones((units, 4 * units), np.float32), np.zeros((0, batch, 4 * units), np.float32),
            dh, dcs, length=0, offsets=(0, units, 2 * units, 3 * units), use_peephole=True,
            clip_at=None, check=None, empty=np.empty,
        )  # fmt: skip
    finally:
        lstm_cpu.PINNED.reset(token)
    assert not dh.any() and not dcs.any() and not fused_backward_steps
    assert native.step_claims(4, 0, backward=True) == native.step_claims(0, 4, backward=True) == 0
    native.backward_fused_step()(None, *[None] * 12, 0, 0.0, 4, 0, 0, 0, 0, 0, None, None, None)


@pytest.mark.parametrize(
    ("form", "dtype", "mode"),
    [
        (FUSED, np.float32, native.Mode.NATIVE),
        (HOISTED, np.float32, native.Mode.NATIVE),
        (HOISTED, np.float64, native.Mode.NUMPY),
    ],
)
def test_a_float32_subnormal_cell_clip_clips_nothing_in_any_formulation_or_dtype(form, dtype, mode):
    """As TensorFlow's kernels: ``cell_clip`` is a float32 attribute they compare with
    subnormals read as zero, so 1e-39 is no clip in every dtype. The forward and the
    tape's backward of it are those of no clip (FUSED clipped nothing and HOISTED
    every cell, the backward took every cell for clipped, and float64 clipped to 1e-40:
    review helpers); a normal float32 clip still clips."""
    if mode is native.Mode.NATIVE:
        require_native()
    case = random_case(np.random.default_rng(36), 5, 4, 3, 20, dtype)
    attrs = dict(seq_len_max=5, use_peephole=True)
    tiny, none, smallest = (
        pinned_forward(case, mode, form, cell_clip=c, **attrs) for c in (1e-39, 0.0, 1.2e-38)
    )
    for a, b in zip(tiny, none, strict=True):
        np.testing.assert_array_equal(a, b)
    grads = [_backward(case, none, form, mode, cell_clip=c, **attrs) for c in (1e-39, 0.0)]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.abs(none.cs).max() > 1e-3 and np.abs(smallest.cs).max() <= 1.2e-38


def test_the_fused_backward_takes_its_packed_weights_from_the_callers_allocator(
    fused_backward_steps,
):
    """As the other paths' W_h^T: from ``empty`` (a server's warm buffers), not NumPy's."""
    case = random_case(np.random.default_rng(38), 3, 4, 5, 24, np.float32)
    activations = pinned_forward(case, form=HOISTED, seq_len_max=3)
    asked: list[int] = []

    def empty(shape, dtype):
        asked.append(int(np.prod(shape)))
        return np.empty(shape, dtype)

    _backward(case, activations, FUSED, seq_len_max=3, empty=empty)
    assert fused_backward_steps  # (the fused path ran)
    padded = native.packed_transposed_floats(24) + lstm_cpu.PACK_ALIGNMENT // 4
    assert padded in asked
