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
import time

import numpy as np
import pytest

from gradserve.kernels import lstm, lstm_cpu, native
from gradserve.kernels.compute import compute_for
from gradserve.lstm_signature import LSTMInputs
from tests.kernels.lstm_cases import (
    INPUTS,
    pinned_forward,
    random_case,
    require_native,
    scaled_error,
)

#: The rational tanh's largest error over every float32 (measured over all of [0, 16),
#: past the clamp, the function being odd), as the elementwise step computes it: 7 ulps,
#: at 5.8566; with fused multiply-adds, as FUSED's cells compute it where GCC contracts
#: them: 5, at 3.5905 (Clang does not contract it: 7). NumPy's float32 tanh: 1.
MAX_TANH_ULPS = {native.TANH: 7, native.TANH_FMA: 7}
TANHS = pytest.mark.parametrize("variant", list(MAX_TANH_ULPS))


def _tanh(lib: ctypes.CDLL, z: np.ndarray, variant: str = native.TANH) -> np.ndarray:
    z = np.ascontiguousarray(z, np.float32)
    out = np.empty_like(z)
    getattr(lib, variant)(z.ctypes.data, out.ctypes.data, z.size)
    return out


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 steps (both of one sign: tanh keeps its argument's)."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


@TANHS
def test_the_rational_tanh_is_within_a_few_ulps_and_keeps_the_specials(variant):
    require_native()
    lib = native.NATIVE.library()
    # every 997th float32 from 0 to 10 (past the clamp at 9), both signs: 2.2 million
    bits = np.arange(0, np.float32(10).view(np.int32), 997, dtype=np.int32)
    z = np.concatenate([bits.view(np.float32), -bits.view(np.float32)])
    got = _tanh(lib, z, variant)
    want = np.tanh(z.astype(np.float64)).astype(np.float32)
    assert _ulps(got, want).max() <= MAX_TANH_ULPS[variant]
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-38, -1e-45, 100.0], np.float32)
    out = _tanh(lib, special, variant)
    assert np.isnan(out[0])
    np.testing.assert_array_equal(out[[1, 2, 3, 4, 7]], [1.0, -1.0, 0.0, -0.0, 1.0])
    assert np.signbit(out[4]) and np.signbit(out[6])  # -0 and a tiny negative keep the sign
    assert _ulps(out[5:7], special[5:7]).max() <= MAX_TANH_ULPS[variant]  # tanh(z) = z, tiny z


@TANHS
def test_the_rational_tanh_never_passes_one(variant):
    """Clamped at 9, the rational function rose past 1 by up to 2 ulps from 8.1 on: a
    gate of 1.0000001 (a review helper). Every float32 from 7 to 10, both signs."""
    require_native()
    bits = np.arange(np.float32(7).view(np.int32), np.float32(10).view(np.int32), dtype=np.int32)
    z = bits.view(np.float32)
    assert _tanh(native.NATIVE.library(), z, variant).max() == 1.0
    assert _tanh(native.NATIVE.library(), -z, variant).min() == -1.0


@pytest.fixture
def counted(monkeypatch):
    """The number of compiled steps run so far (the steps wrapped in a counter: the
    elementwise one and FUSED's)."""
    require_native()
    calls = []
    real = lstm_cpu._native_step

    def counting(x, outs, units):
        step = real(x, outs, units)
        if step is None:
            return None
        return lambda *args: calls.append(1) or step(*args)

    monkeypatch.setattr(lstm_cpu, "_native_step", counting)
    real_fused = native.fused_steps

    def counting_steps(team, steps, *args):  # FUSED's calls: their steps each
        calls.extend([1] * steps)
        return real_fused()(team, steps, *args)

    monkeypatch.setattr(native, "fused_steps", lambda: counting_steps)
    return calls


@pytest.mark.parametrize("form", list(lstm_cpu.Formulation), ids=lambda f: f.value)
def test_the_compiled_step_runs_when_asked_and_agrees_with_numpys_pass(counted, form):
    case = random_case(np.random.default_rng(5), 9, 7, 11, 33, np.float32, scale=1.5)
    attrs = dict(seq_len_max=8, use_peephole=True, cell_clip=0.8, forget_bias=1.0)
    fused = pinned_forward(case, native.Mode.AUTO, form, **attrs)
    assert len(counted) == 8  # one call per step up to seq_len_max
    ufuncs = pinned_forward(case, native.Mode.NUMPY, form, **attrs)
    assert len(counted) == 8  # NumPy's pass asked for: no compiled step
    for name, a, b in zip(lstm.LSTMActivations._fields, fused, ufuncs):
        assert scaled_error(a, b) < 1e-5, name  # a few ulps per step, carried on
        assert not a[8:].any(), name
    # the passes differ in the last bits (which shows the compiled one computed)
    assert not np.array_equal(fused.ci, ufuncs.ci)


def test_float64_and_views_keep_numpys_pass(counted):
    case = random_case(np.random.default_rng(6), 4, 3, 5, 4, np.float64)
    pinned_forward(case, native.Mode.AUTO, seq_len_max=4)
    assert not counted  # float64: the rational tanh is not accurate enough
    outs = [np.empty((4, 3, 8), np.float32)[:, :, :4] for _ in range(7)]  # not contiguous
    assert lstm_cpu._native_step(np.zeros((4, 3, 5), np.float32), outs, 4) is None
    case16 = random_case(np.random.default_rng(6), 4, 3, 5, 4, np.float16)
    pinned_forward(case16, native.Mode.AUTO, seq_len_max=4)
    assert len(counted) == 4  # float16 computes in float32


def test_nans_and_infinities_pass_through_the_step_as_through_numpys():
    require_native()
    case = random_case(np.random.default_rng(7), 3, 4, 5, 6, np.float32)
    case["x"][1, 0, 0] = np.nan
    case["x"][1, 2, :] = np.inf
    case["cs_prev"][3, 1] = -np.inf
    for clip in (0.0, 2.0):
        attrs = dict(seq_len_max=3, use_peephole=True, cell_clip=clip)
        fused = pinned_forward(case, native.Mode.NATIVE, **attrs)
        ufuncs = pinned_forward(case, native.Mode.NUMPY, **attrs)
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


def _assert_auto_is_numpys_pass() -> None:
    """A forward in ``auto`` computes NumPy's pass's bits (no library was built)."""
    case = random_case(np.random.default_rng(9), 4, 3, 5, 4, np.float32)
    got = pinned_forward(case, native.Mode.AUTO, seq_len_max=4)
    want = pinned_forward(case, native.Mode.NUMPY, seq_len_max=4)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


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
    _assert_auto_is_numpys_pass()
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


@pytest.fixture
def compilations(monkeypatch):
    """The compilations run (``native._run`` calls that write a library)."""
    runs = []
    real = native._run

    def counting(command, timeout):
        if "-o" in command:
            runs.append(command)
        return real(command, timeout)

    monkeypatch.setattr(native, "_run", counting)
    return runs


def test_the_library_is_cached_privately_and_built_once(cache, compilations):
    require_native()
    step = native.NativeStep()
    got = []
    threads = [threading.Thread(target=lambda: got.append(step.library())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compilations) == 1 and len(set(map(id, got))) == 1 and got[0] is not None
    (library,) = cache.iterdir()
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(library).st_mode) & 0o077 == 0
    before = os.stat(library)
    native.build_and_load()  # another process: finds it, compiles nothing
    assert len(compilations) == 1 and list(cache.iterdir()) == [library]
    assert (os.stat(library).st_ino, os.stat(library).st_mtime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
    )


def test_a_linked_cache_is_its_target_and_a_temporary_one_is_removed(
    tmp_path, monkeypatch, compilations
):
    """A link to a private directory of this user was taken for a directory that is not
    private: every process compiled again, into a temporary directory left behind."""
    require_native()
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    monkeypatch.setenv("GRADSERVE_CACHE_DIR", str(tmp_path / "link"))
    native.build_and_load()
    native.build_and_load()
    assert len(compilations) == 1 and len(list(target.iterdir())) == 1
    # a cache that cannot be trusted: a temporary one, removed once loaded
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(native.tempfile, "tempdir", str(scratch))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("GRADSERVE_CACHE_DIR", str(shared))
    lib = native.build_and_load()
    assert getattr(lib, native.STEP) is not None
    assert not list(scratch.iterdir()) and not list(shared.iterdir())


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


def test_any_failure_of_the_build_falls_back_to_numpys_pass(tmp_path, monkeypatch, cache):
    """Only NativeBuildError was caught: an OSError of the cache (a read-only file
    system), or an undecodable ``--version``, escaped from every float32 forward and
    from a server's start in ``auto`` (a review helper)."""

    def refused(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(native.tempfile, "mkstemp", refused)
    with pytest.raises(native.NativeBuildError, match="Read-only file system"):
        native.build_and_load()
    step = native.NativeStep()
    monkeypatch.setattr(native, "NATIVE", step)
    monkeypatch.setattr(native, "build_and_load", lambda: 1 / 0)
    assert step.library() is None and "ZeroDivisionError" in step.failure
    _assert_auto_is_numpys_pass()
    compute_for("cpu", cpu_step_kernel="auto")  # a server in auto starts


def test_cc_is_split_as_a_shell_would_and_an_unusable_one_is_said(
    tmp_path, monkeypatch, cache, caplog
):
    require_native()
    monkeypatch.setenv("CC", "gcc -DGRADSERVE_TEST_FLAG=1")
    assert native._compiler()[1:] == ["-DGRADSERVE_TEST_FLAG=1"]
    native.build_and_load()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level("WARNING", logger="gradserve.kernels"):
        assert native._compiler() != ["no-such-compiler-here"]
    assert "names no executable" in caplog.text
    native.build_and_load()
    assert len(list(cache.iterdir())) == 2  # another command, another key


def test_a_compiler_that_hangs_is_killed_with_what_it_started(tmp_path, monkeypatch, cache):
    child = tmp_path / "child.pid"
    fake = tmp_path / "hangcc"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && { echo hangcc 1; exit 0; }\n'
        f"sleep 60 >/dev/null 2>&1 & echo $! > {child}\n"  # holds no pipe of ours
        "sleep 60 >/dev/null 2>&1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(native, "COMPILE_TIMEOUT_SECONDS", 1)
    with pytest.raises(native.NativeBuildError, match="ran past 1 s"):
        native.build_and_load()
    pid = int(child.read_text())
    for _ in range(100):  # killed: gone once its parent (init, or a subreaper) reaps it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        pytest.fail("the compiler's child still runs")
    assert not list(cache.iterdir())


def test_the_cache_key_tells_cpus_apart_or_the_step_is_built_for_the_baseline():
    """aarch64's /proc/cpuinfo has no "model name" or "flags": every ARM host had the
    same key, and a shared cache could hand an SVE build to a CPU without SVE."""
    n1 = "processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n"
    v1 = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    assert native.cpu_identity(n1) and native.cpu_identity(n1) != native.cpu_identity(v1)
    assert native.cpu_identity("processor\t: 0\nBogoMIPS\t: 50.00\n") == ""
    assert "-march=native" in native.flags(native.cpu_identity(n1))
    assert "-march=native" not in native.flags("")


def test_a_broadcast_cell_state_is_spread_before_the_compiled_steps_read_it():
    """NumPy's passes broadcast a [1, H] ``cs_prev``; the C steps read [B, H] from it,
    past its end (a review helper)."""
    require_native()
    case = random_case(np.random.default_rng(12), 5, 64, 7, 16, np.float32)
    case["cs_prev"] = case["cs_prev"][:1].copy()
    fused = pinned_forward(case, native.Mode.NATIVE, seq_len_max=5, use_peephole=True)
    ufuncs = pinned_forward(case, native.Mode.NUMPY, seq_len_max=5, use_peephole=True)
    for name, a, b in zip(lstm.LSTMActivations._fields, fused, ufuncs):
        assert scaled_error(a, b) < 1e-5, name
    # the backward's recurrence: such a call stays on NumPy's passes
    from gradserve.kernels import lstm_cpu_backward

    units, batch = 16, 64
    results = []
    for mode in (native.Mode.NATIVE, native.Mode.NUMPY):
        dgates = np.empty((5, batch, 4 * units), np.float32)
        dh, dcs = np.zeros((batch, units), np.float32), np.zeros((batch, units), np.float32)
        token = lstm_cpu.STEP_KERNEL.set(mode)
        try:
            lstm_cpu_backward.backward_sequence(
                case["cs_prev"], *fused[:2], fused.f, fused.o, fused.ci, fused.co,
                case["cs_grad"], case["h_grad"], case["wci"], case["wcf"], case["wco"],
                case["w"][7:], dgates, dh, dcs, length=5, offsets=(0, 16, 32, 48),
                use_peephole=True, clip_at=None, check=None, empty=np.empty,
            )  # fmt: skip
        finally:
            lstm_cpu.STEP_KERNEL.reset(token)
        results.append((dgates, dh, dcs))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_a_saturated_gate_is_its_sigmoid_not_zero():
    """0.5 * tanh(z / 2) + 0.5 is exactly 0 once the rational tanh reaches -1 (z below
    -15.8), where sigmoid(z) is not: a forget gate of 0 meeting an infinite cell gave
    NaN where NumPy's pass gives an infinity (a review helper). Those gates are
    exp(z) / (1 + exp(z)) now: each gate here is its bias alone (no weights)."""
    require_native()
    units = 8
    z = np.array([-15.0, -15.9, -17.0, -20.0, -30.0, -60.0, -87.0, -100.0], np.float32)
    case = random_case(np.random.default_rng(13), 1, 3, 4, units, np.float32)
    case["w"][:] = 0
    case["b"][:] = 0
    case["b"][units : 2 * units] = z  # the forget gate (IFCO)
    case["cs_prev"][:] = [[1.0] * units, [np.inf] * units, [1e30] * units]
    f = pinned_forward(case, native.Mode.NATIVE, seq_len_max=1, use_peephole=False)
    want = 1 / (1 + np.exp(-z.astype(np.float64)))
    np.testing.assert_allclose(f.f[0, 0], want, atol=1.5e-7)  # as NumPy's pass
    np.testing.assert_allclose(f.f[0, 0, 1:7], want[1:7], rtol=1e-5)  # the saturated, normal
    assert (f.f[0] > 0).all()
    assert np.isposinf(f.cs[0, 1]).all()  # f * inf: inf, as NumPy's pass gives
    ufuncs = pinned_forward(case, native.Mode.NUMPY, seq_len_max=1, use_peephole=False)
    np.testing.assert_allclose(f.f[0, 0, :2], ufuncs.f[0, 0, :2], atol=1.5e-7)


def test_a_cached_library_cut_short_is_built_again(cache, compilations):
    """A cached file that fails to load (cut short) was refused at every start."""
    require_native()
    native.build_and_load()  # names the cache's file for this compiler and CPU
    (library,) = cache.iterdir()
    cut = cache / "cut"
    cut.mkdir(mode=0o700)
    cut_short = cut / library.name  # a path this process has not loaded yet
    cut_short.write_bytes(b"")
    cut_short.chmod(0o700)
    built = len(compilations)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRADSERVE_CACHE_DIR", str(cut))
        lib = native.build_and_load()
    assert getattr(lib, native.STEP) is not None
    assert len(compilations) == built + 1 and cut_short.stat().st_size > 0
