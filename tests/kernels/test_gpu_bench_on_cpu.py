"""The GPU benchmark of ``make gpu-check`` runs end to end on the stand-in cupy.

It only ever runs for real on a lent GPU machine, once; this keeps every section
of it (our kernels, the cuDNN reference, the served path on ``--device cuda``, the
report) runnable in CI, so that run is not spent on a typo. No timing is asserted.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.benchmarks import bench_lstm_gpu
from tests.kernels import fake_cupy, shim_backend

SIZES = [(4, 3, 5), (3, 2, 4)]


def run_benchmark(tmp_path, monkeypatch) -> list[dict]:
    """``bench_lstm_gpu.main`` at small sizes on the stand-in cupy: the report's rows."""
    lib = shim_backend.build(tmp_path)
    monkeypatch.setattr(bench_lstm_gpu, "SIZES", SIZES)
    report = tmp_path / "bench.json"
    monkeypatch.setattr("sys.argv", ["bench_lstm_gpu", "--json", str(report)])
    with fake_cupy.installed(lib):
        bench_lstm_gpu.main()
    rows = json.loads(report.read_text())["sizes"]
    assert [(r["T"], r["B"], r["H"]) for r in rows] == SIZES
    for row in rows:
        assert not [k for k in row if k.endswith("_error")], row
    return rows


def test_every_section_runs_and_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # no cuDNN section, even where torch is
    for row in run_benchmark(tmp_path, monkeypatch):
        for key in (
            "ours_fwd_ms",
            "ours_bwd_enqueue_ms",
            "graphs_bwd_ms",
            "served_bwd_ms",
            "served_graphs_bwd_ms",
            "inproc_bwd_ms",
        ):
            assert row[key] > 0, key
        assert row["graphs_replays"] > 0
        assert not [k for k in row if k.startswith("cudnn")]
    printed = capsys.readouterr().out
    assert "ours, eager: fwd" in printed and "ours, --cuda-graphs on: fwd" in printed
    assert "served, eager (resident" in printed and "served, --cuda-graphs on (resident" in printed
    assert "torch not available" in printed and "n/a" not in printed


def test_cudnn_reference_section_runs_where_torch_is_installed(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    monkeypatch.setattr(bench_lstm_gpu, "TORCH_DEVICE", "cpu")  # torch's LSTM on the CPU
    for row in run_benchmark(tmp_path, monkeypatch):
        for tag in ("fp32", "tf32"):
            for key in (f"cudnn_{tag}_fwd_ms", f"cudnn_{tag}_bwd_ms"):
                assert row[key] > 0, key
            for key in (f"{m}_{d}_ratio_{tag}" for m in ("ours", "graphs") for d in ("fwd", "bwd")):
                assert row[key] > 0, key  # every contender set against each cuDNN setting
    printed = capsys.readouterr().out
    assert "on cpu" in printed and "cuDNN fp32: fwd" in printed and "(goal <= 2x)" in printed


def test_timed_calls_take_turns_and_a_failing_one_is_dropped():
    calls = []

    def call(name, fail_on=None):
        def fn():
            calls.append(name)
            if len(calls) == fail_on:
                raise RuntimeError("boom")

        return fn

    row: dict = {}
    fns = {"a": call("a"), "b": call("b", fail_on=9 + 2), "c": call("c")}
    times = bench_lstm_gpu.event_times(fns, fake_cupy.make_fake_cupy(None), row, rounds=3)
    warm_ups = ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert calls == warm_ups + ["a", "b", "c", "a", "c", "a", "c"]  # b raised in round 1
    assert sorted(times) == ["a", "c"] and "boom" in row["b_error"]
