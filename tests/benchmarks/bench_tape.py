"""The example worker's training step before and after the gradient tape (``make bench``).

"Before" is the step as ``examples/train_lstm_worker.py`` wrote it until the tape
existed (kept here as ``hand_driven_step``): the worker drives every gradient op
itself. "After" is the example's ``train_step``. Both run against one server
process on loopback, interleaved, same inputs; printed: lines of code per step
(non-blank, non-comment lines of the function body), round trips per step
(every RPC the SDK makes, streams included), median step time and the ratio,
the BLAS thread count, and that both give the same gradients.

``python -m tests.benchmarks.bench_tape [--rounds N]``
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import numpy as np

import gradserve
from tests.benchmarks.bench_lstm import blas_info
from tests.examples.test_train_lstm_worker import load_example
from tests.server_process import ServerProcess

EX = load_example()
STEPS, BATCH, UNITS = EX.STEPS, EX.BATCH, EX.UNITS


def hand_driven_step(client: gradserve.Client, params: dict, x: np.ndarray, y: np.ndarray):
    """The example's step before the tape: every gradient op driven by the worker."""
    raw = client.raw_ops
    zeros = client.put(np.zeros((BATCH, UNITS), np.float32))
    peep = client.put(np.zeros(UNITS, np.float32))
    x_ref, w, b = client.put(x), client.put(params["w"]), client.put(params["b"])
    lstm_args = [np.int64(STEPS), x_ref, zeros, zeros, w, peep, peep, peep, b]
    acts = raw.BlockLSTMV2(*lstm_args, keep=True)
    ta = client.tensor_array(
        np.float32, size=STEPS, clear_after_read=False, element_shape=[BATCH, UNITS]
    ).unstack(acts.h)
    h = ta.stack()
    pred = h @ params["w_out"] + params["b_out"]
    err = pred - y
    loss = float(np.mean(err**2))
    d_pred = 2 * err / err.size
    grads = {"w_out": np.einsum("tb,tbh->h", d_pred, h), "b_out": d_pred.sum()}
    grad_ta = ta.grad("gradients")
    batch = client.batch()
    for t in range(STEPS):
        d_h = (d_pred[t][:, None] * params["w_out"][None, :]).astype(np.float32)
        batch.raw_ops.TensorArrayWriteV3(grad_ta.handle, t, d_h, grad_ta.flow)
    batch.run()
    h_grad = raw.TensorArrayGatherV3(
        grad_ta.handle, np.arange(STEPS, dtype=np.int32), grad_ta.flow, np.float32, keep=True
    )
    lstm_grads = raw.BlockLSTMGradV2(
        *lstm_args, *acts, np.zeros_like(h), h_grad, use_peephole=False
    )
    grads["w"], grads["b"] = lstm_grads.w_grad, lstm_grads.b_grad
    client.delete(*acts, h_grad, zeros, peep, x_ref, w, b)
    ta.close()
    grad_ta.close()
    return loss, grads


def code_lines(fn) -> int:
    """Non-blank, non-comment, non-docstring lines of ``fn``'s body."""
    source = inspect.getsource(fn).splitlines()[1:]
    doc = inspect.getdoc(fn)
    lines = [s.strip() for s in source if s.strip() and not s.strip().startswith("#")]
    if doc:
        lines = lines[len(doc.splitlines()) + (0 if len(doc.splitlines()) == 1 else 1) :]
    return len(lines)


class Counting:
    """Counts the RPCs a client makes (unary, streams, and KeepAlive alike)."""

    def __init__(self, client: gradserve.Client) -> None:
        self.count = 0
        stub = client._stub
        for name in dir(stub):
            method = getattr(stub, name)
            if name.startswith("_") or not callable(method):
                continue
            setattr(stub, name, self._wrap(method))

    def _wrap(self, method):
        def call(*args, **kwargs):
            self.count += 1
            return method(*args, **kwargs)

        return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    server = ServerProcess()
    try:
        rng = np.random.default_rng(0)
        params = EX.init_params(rng)
        x, y = EX.make_batch(rng)
        steps = {"before (hand-driven)": hand_driven_step, "after (tape)": EX.train_step}
        times: dict[str, list[float]] = {k: [] for k in steps}
        trips: dict[str, int] = {}
        grads = {}
        with gradserve.Client(server.target, keepalive=False) as client:
            counter = Counting(client)
            for name, step in steps.items():  # warm up, count round trips, check
                step(client, params, x, y)
                counter.count = 0
                _, grads[name] = step(client, params, x, y)
                trips[name] = counter.count
            for _ in range(args.rounds):
                for name, step in steps.items():
                    start = time.perf_counter()
                    step(client, params, x, y)
                    times[name].append(time.perf_counter() - start)
        before, after = grads.values()
        worst = max(float(np.max(np.abs(before[k] - after[k]))) for k in ("w", "b"))
        print(f"# tape vs hand-driven gradients: example step (T={STEPS}, B={BATCH}, H={UNITS})")
        print(f"BLAS: {blas_info()}")
        print(f"same gradients: max |before - after| over w, b = {worst:.2e}")
        print(f"{'step':<22}{'lines':>7}{'round trips':>13}{'median ms':>11}")
        medians = {}
        for name, step in steps.items():
            medians[name] = statistics.median(times[name]) * 1e3
            print(f"{name:<22}{code_lines(step):>7}{trips[name]:>13}{medians[name]:>11.2f}")
        ratio = medians["before (hand-driven)"] / medians["after (tape)"]
        print(f"after is {ratio:.2f}x the speed of before ({args.rounds} interleaved rounds)")
    finally:
        server.proc.terminate()
        server.proc.wait(10)


if __name__ == "__main__":
    main()
