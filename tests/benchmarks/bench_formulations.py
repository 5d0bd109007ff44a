"""What ``--lstm-formulation`` and ``--cpu-step-kernel`` cost (``make bench``): not a
test, prints figures.

The CPU forward computes a shape in the GEMM formulation it measured fastest on the
first call (``kernels/lstm_cpu.py``'s planner); a server started with
``--lstm-formulation`` computes every shape in one, so that replicas return the same
bits. Each step's elementwise pass is the compiled step where it builds
(``kernels/native.py``), else NumPy's (``--cpu-step-kernel``). This times the
in-process forward (``Compute.lstm_forward``, float32, peepholes) in each formulation
with each pass ("hoisted/native", "hoisted/numpy", ...) and as the planner chooses
("auto", the default pass, with its choice), and the backward in FUSED's recurrence
and the BLAS's (a BLAS formulation pinned) with each pass, interleaved call by call,
at the LSTM benchmark's sizes and at 1 and all BLAS threads; medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from gradserve.kernels import backend_numpy, lstm_cpu, native
from gradserve.kernels.compute import Compute
from gradserve.lstm_signature import LSTMInputs, LSTMOutputGrads
from tests.benchmarks.bench_lstm import (
    SIZES,
    blas_environment,
    blas_info,
    blas_threads,
    make_inputs,
)


def bench_size(steps: int, batch: int, units: int, calls: int) -> None:
    weights, _, _ = make_inputs(steps, batch, units)
    inputs = LSTMInputs(*weights)
    kernels = [native.Mode.NUMPY]
    if native.NATIVE.library() is not None:
        kernels.insert(0, native.Mode.NATIVE)
    computes = {
        f"{form.value}/{kernel.value}": Compute(backend_numpy, formulation=form, step_kernel=kernel)
        for form in lstm_cpu.Formulation
        for kernel in kernels
        # (FUSED runs in the compiled step: with NumPy's pass it computes as HOISTED)
        if not (form is lstm_cpu.Formulation.FUSED and kernel is native.Mode.NUMPY)
    }
    computes["auto"] = Compute(backend_numpy)
    for compute in computes.values():  # warm: workspaces, the planner's measurement
        compute.lstm_forward(inputs, seq_len_max=steps, use_peephole=True)
    samples: dict[str, list[float]] = {name: [] for name in computes}
    for _ in range(calls):
        for name, compute in computes.items():
            start = time.perf_counter()
            compute.lstm_forward(inputs, seq_len_max=steps, use_peephole=True)
            samples[name].append(time.perf_counter() - start)
    fused = kernels[0] is native.Mode.NATIVE  # what "auto" ran
    key = (batch, units, units, "<f4", lstm_cpu.blas_threads(), True, fused)
    chosen = lstm_cpu.PLANNER.lookup(key)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    best = min(medians.values())
    cells = ", ".join(f"{name} {1e3 * m:.1f} ms ({m / best:.2f}x)" for name, m in medians.items())
    print(f"  ({steps}, {batch}, {units}): {cells}; auto chose {chosen and chosen.value}")
    bench_backward(inputs, steps, kernels, calls)


def bench_backward(inputs: LSTMInputs, steps: int, kernels: list, calls: int) -> None:
    """The backward in FUSED's recurrence (where the compiled step builds: the
    default's) and in the BLAS's with each elementwise pass (the same bits either
    way), interleaved."""
    attrs = dict(seq_len_max=steps, use_peephole=True)
    acts = Compute(backend_numpy).lstm_forward(inputs, **attrs)
    grads = LSTMOutputGrads(acts.cs, acts.h)
    hoisted, fused = lstm_cpu.Formulation.HOISTED, lstm_cpu.Formulation.FUSED
    computes = {
        f"hoisted/{k.value}": Compute(backend_numpy, formulation=hoisted, step_kernel=k)
        for k in kernels
    }
    if native.Mode.NATIVE in kernels:
        computes["fused/native"] = Compute(
            backend_numpy, formulation=fused, step_kernel=native.Mode.NATIVE
        )
    samples: dict[str, list[float]] = {name: [] for name in computes}
    for _ in range(calls + 1):  # the first round warms
        for name, compute in computes.items():
            start = time.perf_counter()
            compute.lstm_backward(inputs, acts, grads, **attrs)
            samples[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(s[1:]) for name, s in samples.items()}
    best = min(medians.values())
    cells = ", ".join(f"{name} {1e3 * m:.1f} ms ({m / best:.2f}x)" for name, m in medians.items())
    print(f"    backward: {cells}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=0, help="per formulation (0: 15, 5 large)")
    args = parser.parse_args()
    print(f"# LSTM forward per formulation (CPU, float32): {os.cpu_count()} CPUs; {blas_info()}")
    if native.NATIVE.library() is None:
        print(f"# no compiled step here ({native.NATIVE.failure}): NumPy's pass only")
    print(f"# {blas_environment()}; medians of interleaved calls; (x) = / the fastest")
    for threads in (1, None):
        with blas_threads(threads):
            print(f"\nBLAS threads: {lstm_cpu.blas_threads()}")
            for steps, batch, units in SIZES:
                calls = args.calls or (15 if steps * batch * units < 1 << 20 else 5)
                bench_size(steps, batch, units, calls)


if __name__ == "__main__":
    main()
