"""A bounded mixed-op load on a gradserve server, checking every result exactly.

Each of ``clients`` threads opens its own session and, until ``seconds`` pass,
runs a random mix: TensorArray write+read, gradient-array aggregation,
StopGradient, and a small BlockLSTMV2 forward whose result is compared with an
in-process NumPy reference. Used by tests/server/test_load.py (short) and
tests/benchmarks/bench_load.py (longer, server in its own process).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

import gradserve
from gradserve.kernels import backend_numpy
from tests.kernels import lstm_cases


@dataclasses.dataclass
class LoadReport:
    clients: int
    seconds: float
    ops: int
    latencies: list[float]
    errors: list[str]

    @property
    def ops_per_second(self) -> float:
        return self.ops / self.seconds

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else float("nan")

    def summary(self) -> str:
        return (
            f"{self.clients} clients, {self.seconds:.1f} s: {self.ops} ops, "
            f"{self.ops_per_second:.0f} ops/s, latency p50 {self.percentile(50) * 1e3:.2f} ms, "
            f"p99 {self.percentile(99) * 1e3:.2f} ms, {len(self.errors)} unexpected errors"
        )


def _lstm_case():
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    args = [np.int64(5), r(5, 2, 3), r(2, 4), r(2, 4), r(7, 16), r(4), r(4), r(4), r(16)]
    want = lstm_cases.forward(backend_numpy, *args[1:], seq_len_max=5).h
    return args, want


def run_load(target: str, clients: int = 32, seconds: float = 5.0, **client_kw) -> LoadReport:
    lstm_args, lstm_want = _lstm_case()
    deadline = time.monotonic() + seconds
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    ops = [0]

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        mine: list[float] = []
        try:
            with gradserve.Client(target, timeout=60, **client_kw) as c:
                n = 0
                while time.monotonic() < deadline:
                    t0 = time.perf_counter()
                    kind = rng.integers(4)
                    value = rng.standard_normal(16).astype(np.float32)
                    if kind == 0:
                        ta = c.tensor_array(np.float32, size=1).write(0, value)
                        assert ta.read(0).tobytes() == value.tobytes()
                        ta.close()
                    elif kind == 1:
                        ta = c.tensor_array(np.float32, size=1).write(0, value)
                        g = ta.grad("gradients").write(0, value).write(0, value)
                        assert g.read(0).tobytes() == (value + value).tobytes()
                        ta.close()
                        g.close()
                    elif kind == 2:
                        assert c.stop_gradient(value).tobytes() == value.tobytes()
                    else:
                        h = c.raw_ops.BlockLSTMV2(*lstm_args).h
                        assert np.array_equal(h, lstm_want)
                    mine.append(time.perf_counter() - t0)
                    n += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported
            with lock:
                errors.append(f"client {k}: {type(e).__name__}: {e}")
        with lock:
            latencies.extend(mine)
            ops[0] += len(mine)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    return LoadReport(clients, time.monotonic() - started, ops[0], latencies, errors)
