"""``--lstm-formulation``: a CPU server that computes every LSTM forward in one GEMM
formulation instead of the one it measures fastest per shape. A timed choice may differ
between processes, so replicas, or a server before and after a restart, could return
other last bits for one call; pinned, every one computes the same."""

from __future__ import annotations

import numpy as np
import pytest

import gradserve
from gradserve.kernels import backend_numpy, lstm_cpu
from gradserve.server import run_server
from gradserve.server.transport.app import ConfigError
from gradserve.server.transport.cli import build_parser
from gradserve.server.transport.config import LSTM_FORMULATIONS
from tests.kernels.lstm_cases import INPUTS, LAYOUT, OUTPUTS, forward, random_case

FORMULATIONS = list(lstm_cpu.Formulation)


def _case() -> dict:
    # A shape at which the formulations give different results.
    return random_case(np.random.default_rng(3), 5, 8, 48, 40, np.float32)


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
    served = {form: _served(form.value, case) for form in FORMULATIONS}
    assert not planner.measured  # no server timed anything
    again = _served(FORMULATIONS[0].value, case)  # another server: the same bits
    for k in OUTPUTS:
        np.testing.assert_array_equal(again[k], served[FORMULATIONS[0]][k])
    for form in FORMULATIONS:
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
