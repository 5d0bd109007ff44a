"""The compiled elementwise step of the CPU forward (``kernels/native.py``,
``kernels/lstm_cpu_step.c``): its tanh's accuracy against float64, the step's values
against NumPy's pass (specials included), that it runs when asked for and only then,
and how the build behaves without a compiler, with a failing one, or with a cache
another user could write."""

from __future__ import annotations

import ctypes
import os
import pathlib
import stat
import threading

import numpy as np
import pytest

from gradserve.kernels import backend_numpy, lstm, lstm_cpu, native
from gradserve.kernels.compute import compute_for
from gradserve.lstm_signature import LSTMInputs
from tests.kernels.lstm_cases import INPUTS, random_case, require_native, scaled_error

#: The rational tanh's largest error measured over every 7th float32 in [-10, 10]
#: (312 million values): 6 ulps, at 3.9; NumPy's float32 tanh: 1.
MAX_TANH_ULPS = 6


def _tanh(lib: ctypes.CDLL, z: np.ndarray) -> np.ndarray:
    z = np.ascontiguousarray(z, np.float32)
    out = np.empty_like(z)
    getattr(lib, native.TANH)(z.ctypes.data, out.ctypes.data, z.size)
    return out


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 steps (both of one sign: tanh keeps its argument's)."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_the_rational_tanh_is_within_a_few_ulps_and_keeps_the_specials():
    require_native()
    lib = native.NATIVE.library()
    # every 997th float32 from 0 to 10 (past the clamp at 9), both signs: 2.2 million
    bits = np.arange(0, np.float32(10).view(np.int32), 997, dtype=np.int32)
    z = np.concatenate([bits.view(np.float32), -bits.view(np.float32)])
    got = _tanh(lib, z)
    want = np.tanh(z.astype(np.float64)).astype(np.float32)
    assert _ulps(got, want).max() <= MAX_TANH_ULPS
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-38, -1e-45, 100.0], np.float32)
    out = _tanh(lib, special)
    assert np.isnan(out[0])
    np.testing.assert_array_equal(out[[1, 2, 3, 4, 7]], [1.0, -1.0, 0.0, -0.0, 1.0])
    assert np.signbit(out[4]) and np.signbit(out[6])  # -0 and a tiny negative keep the sign
    assert _ulps(out[5:7], special[5:7]).max() <= MAX_TANH_ULPS  # tanh(z) = z for tiny z


def _forward(
    mode: native.Mode,
    case: dict,
    form: lstm_cpu.Formulation = lstm_cpu.Formulation.HOISTED,
    **attrs,
) -> lstm.LSTMActivations:
    """The forward with that pass and formulation (pinned: no measuring runs)."""
    token = lstm_cpu.STEP_KERNEL.set(mode)
    pinned = lstm_cpu.PINNED.set(form)
    try:
        return lstm.block_lstm_forward(
            backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)), **attrs
        )
    finally:
        lstm_cpu.PINNED.reset(pinned)
        lstm_cpu.STEP_KERNEL.reset(token)


@pytest.fixture
def counted(monkeypatch):
    """The number of compiled steps run so far (the step wrapped in a counter)."""
    require_native()
    calls = []
    real = lstm_cpu._native_step

    def counting(x, outs):
        step = real(x, outs)
        if step is None:
            return None
        return lambda *args: calls.append(1) or step(*args)

    monkeypatch.setattr(lstm_cpu, "_native_step", counting)
    return calls


@pytest.mark.parametrize("form", list(lstm_cpu.Formulation), ids=lambda f: f.value)
def test_the_compiled_step_runs_when_asked_and_agrees_with_numpys_pass(counted, form):
    case = random_case(np.random.default_rng(5), 9, 7, 11, 33, np.float32, scale=1.5)
    attrs = dict(seq_len_max=8, use_peephole=True, cell_clip=0.8, forget_bias=1.0)
    fused = _forward(native.Mode.AUTO, case, form, **attrs)
    assert len(counted) == 8  # one call per step up to seq_len_max
    ufuncs = _forward(native.Mode.NUMPY, case, form, **attrs)
    assert len(counted) == 8  # NumPy's pass asked for: no compiled step
    for name, a, b in zip(lstm.LSTMActivations._fields, fused, ufuncs):
        assert scaled_error(a, b) < 1e-5, name  # a few ulps per step, carried on
        assert not a[8:].any(), name
    # the passes differ in the last bits (which shows the compiled one computed)
    assert not np.array_equal(fused.ci, ufuncs.ci)


def test_float64_and_views_keep_numpys_pass(counted):
    case = random_case(np.random.default_rng(6), 4, 3, 5, 4, np.float64)
    _forward(native.Mode.AUTO, case, seq_len_max=4)
    assert not counted  # float64: the rational tanh is not accurate enough
    outs = [np.empty((4, 3, 8), np.float32)[:, :, :4] for _ in range(7)]  # not contiguous
    assert lstm_cpu._native_step(np.zeros((4, 3, 5), np.float32), outs) is None
    case16 = random_case(np.random.default_rng(6), 4, 3, 5, 4, np.float16)
    _forward(native.Mode.AUTO, case16, seq_len_max=4)
    assert len(counted) == 4  # float16 computes in float32


def test_nans_and_infinities_pass_through_the_step_as_through_numpys():
    require_native()
    case = random_case(np.random.default_rng(7), 3, 4, 5, 6, np.float32)
    case["x"][1, 0, 0] = np.nan
    case["x"][1, 2, :] = np.inf
    case["cs_prev"][3, 1] = -np.inf
    for clip in (0.0, 2.0):
        attrs = dict(seq_len_max=3, use_peephole=True, cell_clip=clip)
        fused = _forward(native.Mode.NATIVE, case, **attrs)
        ufuncs = _forward(native.Mode.NUMPY, case, **attrs)
        for name, a, b in zip(lstm.LSTMActivations._fields, fused, ufuncs):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
            np.testing.assert_array_equal(np.isinf(a), np.isinf(b), err_msg=name)
            finite = np.isfinite(b)
            np.testing.assert_allclose(a[finite], b[finite], atol=2e-6, err_msg=name)


def test_a_compute_asked_for_numpys_pass_runs_no_compiled_step(counted):
    case = random_case(np.random.default_rng(8), 5, 3, 4, 6, np.float32)
    inputs = LSTMInputs(*(case[k] for k in INPUTS))
    for kernel in ("numpy", "native"):  # pinned formulations: no measuring runs
        compute = compute_for("cpu", cpu_step_kernel=kernel, lstm_formulation="hoisted")
        compute.lstm_forward(inputs, seq_len_max=5)
        assert len(counted) == (0 if kernel == "numpy" else 5)
    assert lstm_cpu.STEP_KERNEL.get() is native.Mode.AUTO  # the mode ends with the op


# --- the build -------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv("GRADSERVE_CACHE_DIR", str(directory))
    return directory


def _no_compiler(monkeypatch, tmp_path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)


def test_without_a_compiler_the_forward_runs_numpys_pass_and_native_refuses(
    tmp_path, monkeypatch, cache
):
    _no_compiler(monkeypatch, tmp_path)
    step = native.NativeStep()
    monkeypatch.setattr(native, "NATIVE", step)
    assert step.library() is None and "no C compiler" in step.failure
    case = random_case(np.random.default_rng(9), 4, 3, 5, 4, np.float32)
    got = _forward(native.Mode.AUTO, case, seq_len_max=4)
    want = _forward(native.Mode.NUMPY, case, seq_len_max=4)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(native.NativeBuildError, match="no C compiler"):
        compute_for("cpu", cpu_step_kernel="native")
    compute_for("cpu", cpu_step_kernel="auto")  # starts, on NumPy's pass


def test_a_failing_compiler_is_reported_and_leaves_no_partial_file(tmp_path, monkeypatch, cache):
    fake = tmp_path / "fakecc"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && { echo fakecc 1; exit 0; }\necho boom >&2\nexit 1\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    step = native.NativeStep()
    assert step.library() is None
    assert "failed" in step.failure and "boom" in step.failure
    assert step.library() is None  # not tried again on every call
    assert not list(cache.iterdir())  # no temporary file left behind


def test_the_library_is_cached_privately_and_built_once(monkeypatch, cache):
    require_native()
    built = []
    real_build = native._build
    monkeypatch.setattr(native, "_build", lambda *a: built.append(1) or real_build(*a))
    step = native.NativeStep()
    got = []
    threads = [threading.Thread(target=lambda: got.append(step.library())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(set(map(id, got))) == 1 and got[0] is not None
    (library,) = cache.iterdir()
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(library).st_mode) & 0o077 == 0
    native.build_and_load()  # a second process would find it: no new file
    assert list(cache.iterdir()) == [library]


def test_a_cache_others_can_write_is_never_loaded_from(tmp_path, monkeypatch, cache):
    require_native()
    cache.mkdir()
    cache.chmod(0o777)  # anyone could plant a library here
    lib = native.build_and_load()
    assert not list(cache.iterdir())  # built in a private temporary directory instead
    assert pathlib.Path(lib._name).parent != cache
    # a library in the private cache that became writable by others is refused
    monkeypatch.setenv("GRADSERVE_CACHE_DIR", str(tmp_path / "private"))
    native.build_and_load()
    (library,) = (tmp_path / "private").iterdir()
    library.chmod(0o777)
    with pytest.raises(native.NativeBuildError, match="not a private file"):
        native.build_and_load()
