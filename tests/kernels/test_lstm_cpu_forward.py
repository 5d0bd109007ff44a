"""The CPU forward's formulations (``kernels/lstm_cpu.py``): each one alone, with
either elementwise pass (the compiled step, NumPy's), gives TensorFlow's golden
outputs and the generic per-step loop's (the CUDA path's algorithm); the planner
measures once per shape and caches its choice; the workspace cache is bounded and
hands a workspace to one caller at a time."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gradserve import pauses
from gradserve.kernels import backend_numpy, lstm, lstm_cpu, native
from gradserve.kernels.compute import Compute, compute_for
from gradserve.lstm_signature import LSTMInputs
from tests.kernels.lstm_cases import (
    GENERIC,
    INDEX,
    INPUTS,
    OUTPUTS,
    STEP_KERNELS,
    TOLERANCE,
    UNINITIALISED_PAST_END,
    forward_attrs,
    golden,
    random_case,
    scaled_error,
)

FORMULATIONS = list(lstm_cpu.Formulation)


@pytest.fixture
def only(monkeypatch):
    """Force one formulation: a planner whose only candidate it is."""

    def force(form: lstm_cpu.Formulation) -> None:
        monkeypatch.setattr(lstm_cpu, "PLANNER", lstm_cpu.Planner((form,)))

    return force


@pytest.mark.golden
@pytest.mark.parametrize("step_kernel", STEP_KERNELS, ids=lambda m: m.value, indirect=True)
@pytest.mark.parametrize("form", FORMULATIONS, ids=lambda f: f.value)
@pytest.mark.parametrize("name", [c["name"] for c in INDEX])
def test_each_formulation_matches_tensorflow(only, step_kernel, form, name):
    only(form)
    d = golden(name)
    tol = TOLERANCE[str(d["x"].dtype)]
    length = int(d["seq_len_max"])
    out = (
        compute_for("cpu", cpu_step_kernel=step_kernel.value)
        .lstm_forward(LSTMInputs(*(d[k] for k in INPUTS)), **forward_attrs(d))
        ._asdict()
    )
    for k in OUTPUTS:
        assert out[k].dtype == d[k].dtype and out[k].shape == d[k].shape
        end = length if k in UNINITIALISED_PAST_END else None
        assert scaled_error(out[k][:end], d[k][:end]) < tol, k
        assert not out[k][length:].any(), f"{k} past seq_len_max must be zero"


@pytest.mark.parametrize("step_kernel", STEP_KERNELS, ids=lambda m: m.value, indirect=True)
@pytest.mark.parametrize("form", FORMULATIONS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    ("steps", "batch", "units", "length", "layout", "peephole", "clip", "forget_bias"),
    [
        (7, 5, 6, 7, lstm.GateLayout.IFCO, True, 0.0, 0.0),
        (7, 5, 6, 4, lstm.GateLayout.ICFO, True, 0.3, 1.0),
        (40, 3, 4, 37, lstm.GateLayout.IFCO, False, 0.0, 0.5),  # several projection chunks
        (3, 1, 2, 1, lstm.GateLayout.ICFO, False, 0.1, 0.0),
        (2, 0, 3, 2, lstm.GateLayout.IFCO, True, 0.0, 0.0),  # batch 0
        (5, 3, 37, 5, lstm.GateLayout.ICFO, True, 0.0, 1.0),  # W_h^T in several strips
    ],
)
def test_each_formulation_matches_the_generic_loop(
    only, step_kernel, form, dtype, steps, batch, units, length, layout, peephole, clip, forget_bias
):
    only(form)
    case = random_case(
        np.random.default_rng(steps * 100 + batch), steps, batch, 5, units, dtype, length, 1.0
    )
    inputs = LSTMInputs(*(case[k] for k in INPUTS))
    attrs = dict(
        seq_len_max=length, layout=layout, use_peephole=peephole, cell_clip=clip,
        forget_bias=forget_bias,
    )  # fmt: skip
    got = lstm.block_lstm_forward(backend_numpy, inputs, **attrs)
    want = lstm.block_lstm_forward(GENERIC, inputs, **attrs)
    tol = TOLERANCE[np.dtype(dtype).name]
    for k, a, b in zip(OUTPUTS, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert scaled_error(a, b) < tol, k


def test_the_planner_measures_once_per_shape_and_keeps_its_choice(monkeypatch):
    planner = lstm_cpu.Planner()
    monkeypatch.setattr(lstm_cpu, "PLANNER", planner)
    measured = []
    measure = lstm_cpu._measure
    monkeypatch.setattr(
        lstm_cpu, "_measure", lambda *a: measured.append(1) or measure(*a)
    )  # fmt: skip
    case = random_case(np.random.default_rng(0), 6, 4, 5, 3, np.float32)
    inputs = LSTMInputs(*(case[k] for k in INPUTS))
    first = lstm.block_lstm_forward(backend_numpy, inputs, seq_len_max=6)
    again = lstm.block_lstm_forward(backend_numpy, inputs, seq_len_max=6)
    assert len(measured) == 1
    ((key, timings),) = planner.measured.items()
    assert set(timings) == set(FORMULATIONS)
    assert planner.lookup(key) == min(timings, key=lambda f: timings[f])
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    other = random_case(np.random.default_rng(1), 6, 2, 5, 3, np.float32)  # another batch
    lstm.block_lstm_forward(backend_numpy, LSTMInputs(*(other[k] for k in INPUTS)), seq_len_max=6)
    assert len(measured) == 2


def test_a_measurement_may_pause_between_its_timed_runs_never_inside_one(monkeypatch):
    """A pause (``--compute-quantum``) inside a timed run would be timed; none at all
    held the compute slot for the whole measurement, about ten calls' worth of steps
    (helper-81). The checks of a timed run never pause: the BLAS formulations check
    before every step, FUSED before each of its calls of several (here 16 a call)."""
    monkeypatch.setattr(lstm_cpu, "PLANNER", lstm_cpu.Planner())
    case = random_case(np.random.default_rng(0), 30, 2, 5, 3, np.float32)
    seen = []
    lstm.block_lstm_forward(
        backend_numpy,
        LSTMInputs(*(case[k] for k in INPUTS)),
        seq_len_max=30,
        check=lambda: seen.append(pauses.may_pause()),
    )
    candidates = lstm_cpu._candidates(compiled=native.NATIVE.library() is not None)
    per_call = lstm_cpu.steps_per_call(2, 3)
    assert per_call == 16

    def checks(form: lstm_cpu.Formulation, steps: int) -> int:
        return -(-steps // per_call) if form is lstm_cpu.Formulation.FUSED else steps

    runs = lstm_cpu.PROBE_ROUNDS * len(candidates)
    timed = lstm_cpu.PROBE_ROUNDS * sum(checks(f, lstm_cpu.PROBE_STEPS) for f in candidates)
    assert seen.count(False) == timed  # every check of a timed run
    # between the timed runs, and the checks of the warm-up run and of the call itself
    warm_up = checks(candidates[0], lstm_cpu.PROBE_STEPS)
    chosen = lstm_cpu.PLANNER.lookup(next(iter(lstm_cpu.PLANNER.measured)))
    assert seen.count(True) == runs + warm_up + checks(chosen, 30)


def test_a_cancelled_measurement_raises_and_records_nothing(monkeypatch):
    planner = lstm_cpu.Planner()
    monkeypatch.setattr(lstm_cpu, "PLANNER", planner)
    case = random_case(np.random.default_rng(0), 4, 2, 5, 3, np.float32)

    def cancelled() -> None:
        raise TimeoutError("deadline")

    with pytest.raises(TimeoutError):
        lstm.block_lstm_forward(
            backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)), seq_len_max=4, check=cancelled
        )
    assert not planner.measured


def test_workspaces_are_reused_one_caller_at_a_time_and_bounded():
    cache = lstm_cpu.Workspaces(limit_bytes=1 << 20)
    key = (lstm_cpu.Formulation.HOISTED, 2, 4, 8, 8, "<f4")
    a = cache.take(key)
    b = cache.take(key)  # a is taken: a second caller gets its own
    assert a is not b
    cache.give(key, a)
    assert cache.take(key) is a  # warm: the same buffers again
    big = (lstm_cpu.Formulation.HOISTED, 64, 64, 256, 256, "<f4")  # over the limit
    cache.give(big, cache.take(big))
    assert cache.cached_bytes == 0
    for units in range(1, 40):  # many shapes: the oldest are dropped
        k = (lstm_cpu.Formulation.CONCAT, 1, 8, 8, units, "<f4")
        cache.give(k, cache.take(k))
        assert cache.cached_bytes <= 1 << 20


def test_concurrent_calls_of_one_shape_do_not_share_buffers():
    case = random_case(np.random.default_rng(0), 12, 6, 5, 4, np.float32)
    inputs = [
        LSTMInputs(*((case[k] * s if k == "x" else case[k]) for k in INPUTS)) for s in (1, 2, 3)
    ]
    want = [lstm.block_lstm_forward(GENERIC, i, seq_len_max=12) for i in inputs]
    errors = []

    def run(n: int) -> None:
        for _ in range(20):
            got = lstm.block_lstm_forward(backend_numpy, inputs[n], seq_len_max=12)
            errors.append(max(scaled_error(a, b) for a, b in zip(got, want[n])))

    threads = [threading.Thread(target=run, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 60 and max(errors) < 1e-5


def test_steps_past_seq_len_max_are_zero_in_reused_memory():
    """Outputs and x_grad are allocated uninitialised and only their tails zeroed: a
    full-length call first leaves nonzero values in the memory the allocator hands the
    shorter call next."""
    steps, length = 9, 4
    case = random_case(np.random.default_rng(3), steps, 6, 5, 4, np.float32)
    inputs = LSTMInputs(*(case[k] for k in INPUTS))
    for _ in range(3):
        full = lstm.block_lstm_forward(backend_numpy, inputs, seq_len_max=steps)
        grads = lstm.block_lstm_backward(
            backend_numpy, inputs, full, lstm.LSTMOutputGrads(full.cs, full.h),
            seq_len_max=steps,
        )  # fmt: skip
        assert grads.x_grad[length:].any() and all(o[length:].any() for o in full)
        del full, grads
        short = lstm.block_lstm_forward(backend_numpy, inputs, seq_len_max=length)
        short_grads = lstm.block_lstm_backward(
            backend_numpy, inputs, short, lstm.LSTMOutputGrads(short.cs, short.h),
            seq_len_max=length,
        )  # fmt: skip
        for name, out in (*short._asdict().items(), ("x_grad", short_grads.x_grad)):
            assert not out[length:].any(), name


def test_a_pinned_formulation_is_computed_without_measuring(monkeypatch):
    """``Compute(formulation=...)`` (``--lstm-formulation``): every forward in that
    formulation, with no timed choice, so any process computes the same bits. At this
    shape the formulations give different results: each pinned result is its
    formulation's, bit for bit."""
    planner = lstm_cpu.Planner()
    monkeypatch.setattr(lstm_cpu, "PLANNER", planner)
    case = random_case(np.random.default_rng(3), 5, 8, 48, 40, np.float32)
    inputs = LSTMInputs(*(case[k] for k in INPUTS))
    attrs = dict(seq_len_max=5, use_peephole=True)
    pinned = {
        form: Compute(backend_numpy, formulation=form).lstm_forward(inputs, **attrs)
        for form in FORMULATIONS
    }
    assert not planner.measured  # nothing timed
    assert lstm_cpu.PINNED.get() is None  # the pin ends with the op
    for form in FORMULATIONS:
        monkeypatch.setattr(lstm_cpu, "PLANNER", lstm_cpu.Planner((form,)))
        own = lstm.block_lstm_forward(backend_numpy, inputs, **attrs)
        for a, b in zip(pinned[form], own):
            np.testing.assert_array_equal(a, b)
    hoisted, hoisted_t, concat, fused = (pinned[f].h for f in FORMULATIONS)
    assert not np.array_equal(hoisted, concat) and not np.array_equal(hoisted_t, concat)
    if native.NATIVE.library() is not None:  # (else FUSED computes as HOISTED)
        assert not np.array_equal(fused, hoisted) and not np.array_equal(fused, concat)
    # The two hoisted forms differ too on OpenBLAS's Haswell kernels; its SkylakeX
    # kernels (an AVX-512 CPU's default) sum both GEMM orientations alike.
    monkeypatch.setattr(lstm_cpu, "PLANNER", planner)
    Compute(backend_numpy).lstm_forward(inputs, **attrs)  # unpinned: measured
    assert len(planner.measured) == 1
