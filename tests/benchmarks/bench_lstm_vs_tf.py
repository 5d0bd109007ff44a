"""Our CPU LSTM against TensorFlow's own C++ kernels (``make bench-tf``, by hand: TensorFlow
is never a dependency).

What a team gives up or gains by calling gradserve's LSTM math instead of running
``BlockLSTMV2`` / ``BlockLSTMGradV2`` in process: float32, no peepholes, the sizes of
``make bench``, on the same inputs. TensorFlow runs in a worker process of a Python that
has it (``--tf-python``), timing each call itself (no IPC in its figure); ours runs here
on the NumPy backend. The two are interleaved call by call (ours fwd, TF fwd, ours bwd,
TF bwd, ...) and reported as medians, with both limited to the same number of threads
(TF's intra-op pool; our BLAS, by threadpoolctl). Before timing, the outputs of both are
compared (max abs error over max(1, max abs value)), so the figures are of the same
computation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SIZES = [(50, 32, 256), (100, 64, 512)]
# Spelled out here: the worker runs in TensorFlow's Python, which has no gradserve.
INPUTS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")
OUTPUTS = ("i", "cs", "f", "o", "ci", "co", "h")
GRADS = ("x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad",
         "wco_grad", "b_grad")  # fmt: skip


# ------------------------------------------------------------- the TensorFlow worker
def tf_calls(tf, path: str) -> dict:
    """TensorFlow's forward and backward on the inputs saved at ``path``; their outputs
    and gradients are saved next to it, at ``path + ".tf.npz"``."""
    with np.load(path) as data:
        case = {k: tf.constant(data[k]) for k in data.files}
    inputs = {k: case[k] for k in INPUTS}
    length = tf.constant(case["x"].shape[0], tf.int64)

    def fwd():
        return tf.raw_ops.BlockLSTMV2(
            seq_len_max=length, **inputs, cell_clip=0.0, use_peephole=False
        )

    outs = dict(zip(OUTPUTS, fwd()))

    def bwd():
        return tf.raw_ops.BlockLSTMGradV2(
            seq_len_max=length, **inputs, **outs, cs_grad=case["cs_grad"],
            h_grad=case["h_grad"], use_peephole=False,
        )  # fmt: skip

    results = outs | dict(zip(GRADS, bwd()))
    np.savez(path + ".tf.npz", **{k: v.numpy() for k, v in results.items()})
    return {"fwd": fwd, "bwd": bwd}


def worker(threads: int) -> None:
    """Reads one JSON request per line: ``{"load": npz}`` (inputs; answers the npz of
    TensorFlow's results), ``{"time": "fwd" | "bwd"}`` (answers seconds of one call)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    print(json.dumps({"ready": tf.__version__}), flush=True)
    calls = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "load" in request:
            calls = tf_calls(tf, request["load"])
            print(json.dumps({"outputs": request["load"] + ".tf.npz"}), flush=True)
        else:
            fn = calls[request["time"]]
            t0 = time.perf_counter()
            fn()
            print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


class TensorFlowWorker:
    """TensorFlow in its own Python, driven a request per line."""

    def __init__(self, python: str, threads: int) -> None:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [python, __file__, "--worker", "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
        )  # fmt: skip
        self.version = self._answer()["ready"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"the TensorFlow worker stopped:\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ------------------------------------------------------------------ the comparison
def compare(threads: int, tf_python: str, rounds: int) -> None:
    """Every size at ``threads`` threads, against a fresh TensorFlow worker."""
    tf = TensorFlowWorker(tf_python, threads)
    try:
        print(f"\n## {threads} thread(s): TensorFlow {tf.version} intra-op pool, our BLAS")
        for size in SIZES:
            compare_size(tf, threads, rounds, *size)
    finally:
        tf.close()


def compare_size(tf: TensorFlowWorker, threads: int, rounds: int, steps, batch, units) -> None:
    from gradserve.kernels import backend_numpy, lstm
    from tests.benchmarks.bench_lstm import blas_threads, make_inputs
    from tests.kernels.lstm_cases import scaled_error

    weights, cs_grad, h_grad = make_inputs(steps, batch, units)
    case = dict(zip(INPUTS, weights), cs_grad=cs_grad, h_grad=h_grad)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.npz")
        np.savez(path, **case)
        with np.load(tf.ask({"load": path})["outputs"]) as data:
            want = {k: data[k] for k in data.files}
    with blas_threads(threads):
        outs = lstm.block_lstm_forward(backend_numpy, lstm.LSTMInputs(*weights), seq_len_max=steps)
        ours = {
            "fwd": lambda: lstm.block_lstm_forward(
                backend_numpy, lstm.LSTMInputs(*weights), seq_len_max=steps
            ),
            "bwd": lambda: lstm.block_lstm_backward(
                backend_numpy,
                lstm.LSTMInputs(*weights),
                outs,
                lstm.LSTMOutputGrads(cs_grad, h_grad),
                seq_len_max=steps,
            ),
        }
        grads = ours["bwd"]()
        samples: dict[str, list[float]] = {
            f"{who} {d}": [] for d in ("fwd", "bwd") for who in ("ours", "tf")
        }
        for _ in range(rounds + 1):  # the first round warms up, not counted
            for direction, fn in ours.items():
                t0 = time.perf_counter()
                fn()
                samples[f"ours {direction}"].append(time.perf_counter() - t0)
                samples[f"tf {direction}"].append(tf.ask({"time": direction})["seconds"])
    got = dict(zip(OUTPUTS, outs)) | dict(zip(GRADS, grads))
    error = max(scaled_error(got[k], want[k]) for k in (*OUTPUTS, *GRADS))
    t = {k: statistics.median(v[1:]) * 1e3 for k, v in samples.items()}
    print(
        f"(T, B, I=H) = ({steps}, {batch}, {units}): "
        f"forward ours {t['ours fwd']:7.1f} ms, TF {t['tf fwd']:7.1f} ms "
        f"({t['tf fwd'] / t['ours fwd']:.2f}x) | backward ours {t['ours bwd']:7.1f} ms, "
        f"TF {t['tf bwd']:7.1f} ms ({t['tf bwd'] / t['ours bwd']:.2f}x) | "
        f"outputs and gradients agree to {error:.1e}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf-python", help="a Python that has tensorflow-cpu")
    parser.add_argument("--threads", type=int, action="append",
                        help="threads for both (repeatable; default 1 and all)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.threads[0])
        return
    if not args.tf_python:
        parser.error("--tf-python is required (a Python with tensorflow-cpu installed)")
    print(
        f"# ours (NumPy {np.__version__}) vs TensorFlow's BlockLSTMV2 / BlockLSTMGradV2 C++ "
        f"kernels, CPU, float32, no peepholes; {os.cpu_count()} CPUs; medians of "
        f"{args.rounds} interleaved rounds; 'Nx' = TF time / ours"
    )
    for threads in args.threads or [1, os.cpu_count()]:
        compare(threads, args.tf_python, args.rounds)


if __name__ == "__main__":
    main()
