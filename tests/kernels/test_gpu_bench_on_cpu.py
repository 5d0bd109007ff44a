"""The GPU benchmark of ``make gpu-check`` runs end to end on the stand-in cupy.

It only ever runs for real on a lent GPU machine, once; this keeps every section
of it (our kernels, the cuDNN reference, the served path on ``--device cuda``, the
report) runnable in CI, so that run is not spent on a typo. No timing is asserted;
what is: each contender computes the right thing (its last outputs against the NumPy
kernel on the benchmark's inputs), the timed calls really take turns, the report holds
every figure, finite, with throughputs and ratios that follow from its medians, and
the log prints what the report holds.
"""

from __future__ import annotations

import collections
import json
import math
import sys

import pytest

from gradserve.kernels import backend_numpy
from tests.benchmarks import bench_lstm_gpu
from tests.benchmarks.bench_lstm import make_inputs
from tests.kernels import fake_cupy, lstm_cases, shim_backend
from tests.kernels.lstm_cases import TOLERANCE, scaled_error

SIZES = [(4, 3, 5), (3, 2, 4)]
IN_PROCESS = ["ours_fwd", "ours_bwd", "graphs_fwd", "graphs_bwd"]
CUDNN = ["cudnn_fp32_fwd", "cudnn_fp32_bwd", "cudnn_tf32_fwd", "cudnn_tf32_bwd"]
SERVED = ["served_fwd_kept", "served_bwd", "inproc_bwd"]
EVENT_ROUNDS, WALL_ROUNDS = 20, 10  # the module's "medians of 20 rounds" (wall: 10)


class Recorder:
    """Wraps the benchmark's timers: for each call of ``event_times`` / ``wall_time``,
    the order in which it made its calls and each call's last result (on the host);
    and, per size, how many times ``enqueue_time`` issued each call."""

    def __init__(self, monkeypatch) -> None:
        self.event: list[tuple[list[str], dict]] = []
        self.wall: list[tuple[list[str], dict]] = []
        self.enqueued: list[collections.Counter] = []  # one per event_times call
        self._names: dict[int, str] = {}
        event_times, wall_time = bench_lstm_gpu.event_times, bench_lstm_gpu.wall_time
        enqueue_time = bench_lstm_gpu.enqueue_time

        def recorded_event_times(fns, cupy, row, rounds=EVENT_ROUNDS):
            self.enqueued.append(collections.Counter())
            return event_times(self._wrap(fns, cupy, self.event), cupy, row, rounds)

        def recorded_wall_time(fns, cupy, rounds=WALL_ROUNDS):
            return wall_time(self._wrap(fns, cupy, self.wall), cupy, rounds)

        def recorded_enqueue_time(fn, cupy, repeat=20):
            self.enqueued[-1][self._names[id(fn)]] += repeat
            return enqueue_time(fn, cupy, repeat)

        monkeypatch.setattr(bench_lstm_gpu, "event_times", recorded_event_times)
        monkeypatch.setattr(bench_lstm_gpu, "wall_time", recorded_wall_time)
        monkeypatch.setattr(bench_lstm_gpu, "enqueue_time", recorded_enqueue_time)

    def _wrap(self, fns: dict, cupy, into: list) -> dict:
        order: list[str] = []
        last: dict = {}
        into.append((order, last))

        def host(value):
            if isinstance(value, tuple):
                items = [host(v) for v in value]
                return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
            return cupy.asnumpy(value) if isinstance(value, fake_cupy.DeviceArray) else value

        def wrapped(name, fn):
            self._names[id(fn)] = name

            def call():
                order.append(name)
                result = fn()
                last[name] = host(result)
                return result

            return call

        return {name: wrapped(name, fn) for name, fn in fns.items()}


def run_benchmark(tmp_path, monkeypatch) -> tuple[list[dict], Recorder]:
    """``bench_lstm_gpu.main`` at small sizes on the stand-in cupy: the report's rows,
    and what its timers were given to call."""
    lib = shim_backend.build(tmp_path)
    monkeypatch.setattr(bench_lstm_gpu, "SIZES", SIZES)
    recorder = Recorder(monkeypatch)
    report = tmp_path / "bench.json"
    monkeypatch.setattr("sys.argv", ["bench_lstm_gpu", "--json", str(report)])
    with fake_cupy.installed(lib):
        bench_lstm_gpu.main()
    rows = json.loads(report.read_text())["sizes"]
    assert [(r["T"], r["B"], r["H"]) for r in rows] == SIZES
    for row in rows:
        assert not [k for k in row if k.endswith("_error")], row
    return rows, recorder


def expected_keys(contenders: list[str]) -> set[str]:
    """Every figure of a row with no section failing, for these in-process contenders."""
    keys = {"T", "B", "H", "graphs_replays", "graphs_plan_bytes", "inproc_bwd_ms"}
    keys |= {f"{c}_ms" for c in contenders}
    keys |= {f"{m}_{d}_{k}" for m in ("ours", "graphs") for d in ("fwd", "bwd")
             for k in ("gflops", "enqueue_ms")}  # fmt: skip
    keys |= {f"{p}_{k}_ms" for p in ("served", "served_graphs") for k in ("fwd_kept", "bwd")}
    if any(c.startswith("cudnn") for c in contenders):
        keys |= {f"{m}_{d}_ratio_{t}" for m in ("ours", "graphs") for d in ("fwd", "bwd")
                 for t in ("fp32", "tf32")}  # fmt: skip
    return keys


def take_turns(names: list[str], warm_ups: int, rounds: int) -> list[str]:
    """The calls a timer makes if it warms each up in turn, then times each once a round."""
    return [n for n in names for _ in range(warm_ups)] + names * rounds


def check_report(rows: list[dict], recorder: Recorder, printed: str, contenders: list[str]):
    assert len(recorder.event) == len(SIZES) and len(recorder.wall) == 2 * len(SIZES)
    for k, row in enumerate(rows):
        steps, batch, units = row["T"], row["B"], row["H"]
        # Every figure, finite and positive; throughputs and ratios from the medians.
        assert set(row) == expected_keys(contenders)
        for key, value in row.items():
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, key
        flops = {"fwd": 2.0 * steps * batch * 2 * units * 4 * units}
        flops["bwd"] = 2 * flops["fwd"]
        for mode in ("ours", "graphs"):
            for d in ("fwd", "bwd"):
                gflops = flops[d] / row[f"{mode}_{d}_ms"] / 1e6
                assert row[f"{mode}_{d}_gflops"] == pytest.approx(gflops, rel=1e-12)
                for tag in ("fp32", "tf32") if "cudnn_fp32_fwd" in contenders else ():
                    ratio = row[f"{mode}_{d}_ms"] / row[f"cudnn_{tag}_{d}_ms"]
                    assert row[f"{mode}_{d}_ratio_{tag}"] == pytest.approx(ratio, rel=1e-12)
        assert bench_lstm_gpu.describe(row) in printed  # the log is the report

        # The in-process contenders took turns: 3 warm-ups each, then one call each a round.
        order, last = recorder.event[k]
        assert order == take_turns(contenders, 3, EVENT_ROUNDS)
        # Every graphs call but each plan's first (its capture) is a replay.
        enqueued = recorder.enqueued[k]
        assert enqueued == dict.fromkeys(IN_PROCESS, 20)  # ours only, 20 calls each
        graph_calls = sum(order.count(n) + enqueued[n] for n in ("graphs_fwd", "graphs_bwd"))
        assert graph_calls - 2 <= row["graphs_replays"] <= graph_calls, graph_calls

        # What was timed computed the right thing: ours eager and with graphs, served and
        # in process, against the NumPy kernel on the same inputs.
        weights, cs_grad, h_grad = make_inputs(steps, batch, units)
        fwd = lstm_cases.forward(backend_numpy, *weights, seq_len_max=steps)
        bwd = lstm_cases.backward(backend_numpy, *weights, *fwd, cs_grad, h_grad, seq_len_max=steps)
        tol = TOLERANCE["float32"]
        for name, want in (("fwd", fwd), ("bwd", bwd)):
            for mode in ("ours", "graphs"):
                got = last[f"{mode}_{name}"]
                assert type(got) is type(want), (mode, name)
                for field, w in want._asdict().items():
                    assert scaled_error(getattr(got, field), w) < tol, (mode, field)
        for order, last in recorder.wall[2 * k : 2 * k + 2]:  # served eagerly, then graphs
            assert order == take_turns(SERVED, 1, WALL_ROUNDS)
            assert last["served_fwd_kept"] == 7  # the seven kept outputs, deleted
            for field, w in bwd._asdict().items():
                assert scaled_error(getattr(last["served_bwd"], field), w) < tol, field
            assert scaled_error(last["inproc_bwd"], bwd.w_grad) < tol


def test_every_section_runs_and_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # no cuDNN section, even where torch is
    rows, recorder = run_benchmark(tmp_path, monkeypatch)
    printed = capsys.readouterr().out
    check_report(rows, recorder, printed, IN_PROCESS)
    assert not [k for row in rows for k in row if k.startswith("cudnn")]
    assert "ours, eager: fwd" in printed and "ours, --cuda-graphs on: fwd" in printed
    assert "served, eager (resident" in printed and "served, --cuda-graphs on (resident" in printed
    assert "torch not available" in printed and "n/a" not in printed


def test_cudnn_reference_section_runs_where_torch_is_installed(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    monkeypatch.setattr(bench_lstm_gpu, "TORCH_DEVICE", "cpu")  # torch's LSTM on the CPU
    rows, recorder = run_benchmark(tmp_path, monkeypatch)
    printed = capsys.readouterr().out
    # Every contender set against each cuDNN setting, as the medians say.
    check_report(rows, recorder, printed, IN_PROCESS + CUDNN)
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
