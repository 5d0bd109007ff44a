"""``--lstm-formulation``: a CPU server that computes every LSTM forward in one GEMM
formulation instead of the one it measures fastest per shape; ``--cpu-step-kernel``:
its elementwise pass. A timed choice may differ between processes, so replicas, or a
server before and after a restart, could return other last bits for one call; pinned,
every one computes the same."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

import gradserve
from gradserve.kernels import backend_numpy, lstm_cpu, native
from gradserve.server import run_server
from gradserve.server.transport.app import ConfigError
from gradserve.server.transport.cli import build_parser
from gradserve.server.transport.config import LSTM_FORMULATIONS
from tests.kernels.lstm_cases import (
    INPUTS,
    LAYOUT,
    OUTPUTS,
    forward,
    pinned_forward,
    random_case,
    require_native,
)

FORMULATIONS = list(lstm_cpu.Formulation)


def _case() -> dict:
    # A shape at which the formulations give different results.
    return random_case(np.random.default_rng(3), 5, 8, 48, 40, np.float32)


def _startable(forms: list[lstm_cpu.Formulation]) -> list[lstm_cpu.Formulation]:
    """The formulations a server starts with here: ``fused`` needs the compiled step."""
    built = native.NATIVE.library() is not None
    return [form for form in forms if built or form is not lstm_cpu.Formulation.FUSED]


def _served(form: str, case: dict) -> dict:
    with run_server(lstm_formulation=form) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            got = client.raw_ops.BlockLSTMV2(
                np.int64(5), *(case[k] for k in INPUTS), use_peephole=True
            )
    return dict(zip(OUTPUTS, got))


def test_pinned_servers_return_their_formulations_bits_and_measure_nothing(monkeypatch):
    planner = lstm_cpu.Planner()
    monkeypatch.setattr(lstm_cpu, "PLANNER", planner)
    case = _case()
    served = {form: _served(form.value, case) for form in _startable(FORMULATIONS)}
    assert not planner.measured  # no server timed anything
    again = _served(FORMULATIONS[0].value, case)  # another server: the same bits
    for k in OUTPUTS:
        np.testing.assert_array_equal(again[k], served[FORMULATIONS[0]][k])
    for form in served:
        monkeypatch.setattr(lstm_cpu, "PLANNER", lstm_cpu.Planner((form,)))
        own = forward(
            backend_numpy, *(case[k] for k in INPUTS), seq_len_max=5, use_peephole=True,
            layout=LAYOUT["BlockLSTMV2"],
        )  # fmt: skip
        for k, want in zip(OUTPUTS, own):
            np.testing.assert_array_equal(served[form][k], want, err_msg=f"{form} {k}")
    # The pin shows: two formulations at least give other bits (which ones depends on
    # the BLAS kernels: OpenBLAS's SkylakeX kernels sum both hoisted forms alike).
    h = [served[form]["h"] for form in FORMULATIONS]
    assert not all(np.array_equal(h[i], h[j]) for i, j in ((0, 1), (0, 2), (1, 2)))


def test_an_unpinned_server_measures_the_shape(monkeypatch):
    planner = lstm_cpu.Planner()
    monkeypatch.setattr(lstm_cpu, "PLANNER", planner)
    with run_server() as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            case = _case()
            client.raw_ops.BlockLSTMV2(np.int64(5), *(case[k] for k in INPUTS))
    assert len(planner.measured) == 1


def test_the_flag_and_its_values():
    parse = build_parser().parse_args
    assert parse(["serve"]).lstm_formulation is None
    assert parse(["serve", "--lstm-formulation", "auto"]).lstm_formulation is None
    for value in LSTM_FORMULATIONS:
        assert parse(["serve", "--lstm-formulation", value]).lstm_formulation == value
    with pytest.raises(SystemExit):
        parse(["serve", "--lstm-formulation", "fastest"])
    with pytest.raises(ConfigError, match="--lstm-formulation 'fastest'"):
        with run_server(lstm_formulation="fastest"):
            pass


# --- --cpu-step-kernel: the forward's elementwise pass ---------------------------------


def _served_with(kernel: str, case: dict) -> dict:
    with run_server(lstm_formulation="hoisted", cpu_step_kernel=kernel) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            got = client.raw_ops.BlockLSTMV2(
                np.int64(5), *(case[k] for k in INPUTS), use_peephole=True
            )
    return dict(zip(OUTPUTS, got))


def _own_forward(case: dict, kernel: native.Mode, form: lstm_cpu.Formulation):
    """``_served_with``'s call computed here, that pass and formulation pinned."""
    return pinned_forward(
        case, kernel, form, seq_len_max=5, use_peephole=True, layout=LAYOUT["BlockLSTMV2"]
    )


def test_a_server_computes_with_the_step_kernel_it_names(monkeypatch):
    require_native()
    case = _case()
    served = {kernel: _served_with(kernel, case) for kernel in ("native", "numpy", "auto")}
    for kernel in (native.Mode.NATIVE, native.Mode.NUMPY):
        own = _own_forward(case, kernel, lstm_cpu.Formulation.HOISTED)
        for k, want in zip(OUTPUTS, own):
            np.testing.assert_array_equal(served[kernel.value][k], want, err_msg=f"{kernel} {k}")
    for k in OUTPUTS:  # auto: the compiled step, where it builds
        np.testing.assert_array_equal(served["auto"][k], served["native"][k])
    assert not np.array_equal(served["native"]["h"], served["numpy"]["h"])


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """A process with no C compiler on its PATH and no compiled step built yet."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native, "NATIVE", native.NativeStep())


def test_a_server_asked_for_the_compiled_step_refuses_to_start_without_it(no_compiler):
    with pytest.raises(ConfigError, match="--cpu-step-kernel native: no C compiler"):
        with run_server(cpu_step_kernel="native"):
            pass
    with run_server(cpu_step_kernel="auto") as server:  # auto: NumPy's pass, and serves
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            case = _case()
            got = client.raw_ops.BlockLSTMV2(np.int64(5), *(case[k] for k in INPUTS))
    assert np.isfinite(got[6]).all()


def test_a_fused_server_needs_the_compiled_step():
    """``--lstm-formulation fused`` runs its float32 forwards in the compiled step: a
    server refuses to start where NumPy's pass is asked for or no compiler builds it
    (as ``--cpu-step-kernel native``), rather than compute another formulation."""
    with pytest.raises(ConfigError, match="--lstm-formulation fused: not with --cpu-step-ker"):
        with run_server(lstm_formulation="fused", cpu_step_kernel="numpy"):
            pass


def test_a_fused_server_refuses_to_start_without_a_compiler(no_compiler):
    with pytest.raises(ConfigError, match="--lstm-formulation fused: no C compiler"):
        with run_server(lstm_formulation="fused"):
            pass


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """The compiled steps built ahead of time (as the Docker image's build stage)."""
    require_native()
    directory = tmp_path_factory.mktemp("prebuilt") / "native"
    native.prebuild(directory)
    return directory


def test_a_server_without_a_compiler_serves_fused_from_steps_built_ahead_of_time(
    prebuilt, no_compiler, monkeypatch
):
    """The Docker image's case: no compiler, ``$GRADSERVE_NATIVE_DIR`` set, and the
    deploy's flags: the server starts, loads the best level, and computes FUSED."""
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt))
    case = _case()
    with run_server(lstm_formulation="fused", cpu_step_kernel="native") as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            got = client.raw_ops.BlockLSTMV2(
                np.int64(5), *(case[k] for k in INPUTS), use_peephole=True
            )
    lib = native.NATIVE.library()
    assert lib is not None and pathlib.Path(os.path.realpath(lib._name)).parent == prebuilt
    own = _own_forward(case, native.Mode.NATIVE, lstm_cpu.Formulation.FUSED)
    for k, a, b in zip(OUTPUTS, got, own, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=k)


def test_the_step_kernel_flag_and_its_values():
    parse = build_parser().parse_args
    assert parse(["serve"]).cpu_step_kernel == "auto"
    for value in ("auto", "native", "numpy", "NumPy"):
        assert parse(["serve", "--cpu-step-kernel", value]).cpu_step_kernel == value.lower()
    with pytest.raises(SystemExit):
        parse(["serve", "--cpu-step-kernel", "fast"])
    with pytest.raises(ConfigError, match="--cpu-step-kernel 'fast'"):
        with run_server(cpu_step_kernel="fast"):
            pass
