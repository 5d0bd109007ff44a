"""GPU LSTM benchmark (part of ``make gpu-check``): our CUDA path vs cuDNN.

float32, (T, B, I=H) = (50, 32, 256) and (100, 64, 512), no peepholes, random
data (zeros can run faster than real data).

* ours: ``kernels.lstm`` on the CuPy backend (RawKernel steps + cuBLAS GEMMs),
  timed with CUDA events after warm-up; also the host time to *enqueue* one
  call (when it is close to the event time, the loop is launch-bound);
* cuDNN: ``torch.nn.LSTM`` forward and backward, if torch sees the GPU, in
  full float32 (TF32 off: ours is exact float32, as the goldens require) and,
  for reference, with TF32 allowed (cuDNN's and torch's matmul switches on). The
  same cell as ours: ``tests/kernels/test_lstm_vs_torch.py``;
* ours with ``--cuda-graphs on``: each call copies its inputs into a captured
  plan, replays its CUDA graph (every step in one launch) and copies the
  outputs out;
* served: the same backward through the RPC of a ``--device cuda`` server with
  every input resident (kept forward outputs stay on the GPU), against the
  in-process call, in wall-clock time.

Goal: ours within 2x of cuDNN float32. Medians of 20 rounds; in process, every
round times each contender's forward and backward once, in turn (interleaved).
``--json`` writes every figure; a section that fails is recorded, not fatal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import traceback
from collections.abc import Callable

import numpy as np

SIZES = [(50, 32, 256), (100, 64, 512)]
#: Where torch runs the reference: "cuda" (cuDNN); the CPU test of this file sets "cpu".
TORCH_DEVICE = "cuda"


def event_times(fns: dict[str, Callable[[], object]], cupy, row: dict, rounds=20) -> dict:
    """Median milliseconds of each call by CUDA events, after 3 warm-ups each; interleaved:
    every round times each call once, in turn, so that clocks, temperature and other load
    drift alike for all. A call that raises is dropped, its error recorded in ``row``."""
    samples: dict[str, list[float]] = {}
    for name, fn in fns.items():
        try:
            for _ in range(3):
                fn()
        except Exception:  # noqa: BLE001 - recorded, the others go on
            record_failure(row, name)
        else:
            samples[name] = []
    cupy.cuda.Device().synchronize()
    for _ in range(rounds):
        for name in list(samples):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            try:
                fns[name]()
            except Exception:  # noqa: BLE001 - recorded, the others go on
                record_failure(row, name)
                del samples[name]
                continue
            end.record()
            end.synchronize()
            samples[name].append(cupy.cuda.get_elapsed_time(start, end))
    return {name: statistics.median(times) for name, times in samples.items()}


def enqueue_time(fn, cupy, repeat=20) -> float:
    """Median host milliseconds to issue ``fn`` (the device drained before each)."""
    times = []
    for _ in range(repeat):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    cupy.cuda.Device().synchronize()
    return statistics.median(times)


def wall_time(fns: dict, cupy, rounds=10) -> dict[str, float]:
    """Interleaved median wall milliseconds, device synchronised after each call."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            cupy.cuda.Device().synchronize()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


@dataclasses.dataclass
class Contender:
    """One implementation's forward and backward call at one size, ready to time."""

    fwd: Callable[[], object]
    bwd: Callable[[], object]
    #: Figures to read once timing is done (graph replays, plan bytes).
    stats: Callable[[], dict] = dict


def prepare_ours(steps, batch, units, cupy, cuda_graphs: bool) -> Contender:
    """Ours in process, eager or with ``--cuda-graphs on`` (each call copies its inputs
    into a plan, replays its graph, copies the outputs out)."""
    from gradserve.kernels import lstm
    from gradserve.kernels.compute import compute_for
    from tests.benchmarks.bench_lstm import make_inputs

    compute = compute_for("cuda", cuda_graphs=cuda_graphs)
    host_weights, cs_grad, h_grad = make_inputs(steps, batch, units)
    weights = [cupy.asarray(a) for a in host_weights]
    grads = cupy.asarray(cs_grad), cupy.asarray(h_grad)
    acts = lstm.block_lstm_forward(compute.backend, lstm.LSTMInputs(*weights), seq_len_max=steps)

    def stats() -> dict:
        if not cuda_graphs:
            return {}
        return {
            "graphs_replays": compute.graphs.replays,
            "graphs_plan_bytes": compute.graphs.nbytes,
        }

    return Contender(
        fwd=lambda: compute.lstm_forward(lstm.LSTMInputs(*weights), seq_len_max=steps),
        bwd=lambda: compute.lstm_backward(
            lstm.LSTMInputs(*weights), acts, lstm.LSTMOutputGrads(*grads), seq_len_max=steps
        ),
        stats=stats,
    )


def prepare_cudnn(steps, batch, units, torch, tf32: bool) -> Contender:
    """``torch.nn.LSTM`` (cuDNN on a GPU) forward, and backward to the input and the
    weights. The forward is a training one (autograd on, so cuDNN keeps what its backward
    needs), as ours keeps its seven outputs. torch's TF32 switches are global, so each
    call sets its own first."""
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torch.nn.LSTM(units, units).to(TORCH_DEVICE)
    tx = torch.randn(steps, batch, units, device=TORCH_DEVICE, requires_grad=True)
    tg = torch.randn(steps, batch, units, device=TORCH_DEVICE)
    out, _ = model(tx)

    def tf32_switches():
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32

    def fwd():
        tf32_switches()
        model(tx)

    def bwd():
        tf32_switches()
        torch.autograd.grad(out, [tx, *model.parameters()], tg, retain_graph=True)

    return Contender(fwd, bwd)


def bench_in_process(steps, batch, units, cupy, torch) -> dict:
    """Ours (eager and graphs) and cuDNN (fp32 and TF32, with torch), timed interleaved."""
    size = (steps, batch, units)
    row: dict = {}
    makers = {
        "ours": (prepare_ours, *size, cupy, False),
        "graphs": (prepare_ours, *size, cupy, True),
    }
    if torch is not None:
        makers["cudnn_fp32"] = (prepare_cudnn, *size, torch, False)
        makers["cudnn_tf32"] = (prepare_cudnn, *size, torch, True)
    contenders = {}
    for name, (make, *args) in makers.items():
        contender = attempt(row, name, make, *args)
        if contender is not None:
            contenders[name] = contender
    calls = {f"{n}_{d}": getattr(c, d) for n, c in contenders.items() for d in ("fwd", "bwd")}
    row |= {f"{call}_ms": ms for call, ms in event_times(calls, cupy, row).items()}
    flops = {"fwd": 2.0 * steps * batch * 2 * units * 4 * units}
    flops["bwd"] = 2 * flops["fwd"]
    for name in ("ours", "graphs"):
        if name not in contenders:
            continue
        for d in ("fwd", "bwd"):
            if f"{name}_{d}_ms" in row:
                row[f"{name}_{d}_gflops"] = flops[d] / row[f"{name}_{d}_ms"] / 1e6
                fn = getattr(contenders[name], d)
                enqueue = attempt(row, f"{name}_{d}_enqueue", enqueue_time, fn, cupy)
                if enqueue is not None:
                    row[f"{name}_{d}_enqueue_ms"] = enqueue
        row |= contenders[name].stats()
        for tag in ("fp32", "tf32"):
            for d in ("fwd", "bwd"):
                ours, theirs = row.get(f"{name}_{d}_ms"), row.get(f"cudnn_{tag}_{d}_ms")
                if ours is not None and theirs is not None:
                    row[f"{name}_{d}_ratio_{tag}"] = ours / theirs
    return row


def bench_served(steps, batch, units, cupy, cuda_graphs: bool) -> dict:
    """Backward through the RPC (all inputs resident) vs in process, wall-clock, on a
    server with ``--cuda-graphs`` off or on (keys ``served_*`` / ``served_graphs_*``)."""
    import gradserve
    from gradserve.kernels import backend_cuda, lstm
    from gradserve.server import run_server
    from tests.benchmarks.bench_lstm import make_inputs

    host_weights, cs_grad, h_grad = make_inputs(steps, batch, units)
    weights = [cupy.asarray(a) for a in host_weights]
    dev_grads = cupy.asarray(cs_grad), cupy.asarray(h_grad)
    acts = lstm.block_lstm_forward(backend_cuda, lstm.LSTMInputs(*weights), seq_len_max=steps)
    with (
        run_server(device="cuda", cuda_graphs=cuda_graphs, max_message_bytes=1 << 30) as server,
        gradserve.Client(f"127.0.0.1:{server.port}") as client,
    ):
        raw = client.raw_ops
        length = np.int64(steps)
        weight_refs = [client.put(a) for a in host_weights]
        grad_refs = [client.put(cs_grad), client.put(h_grad)]
        kept = raw.BlockLSTMV2(length, *weight_refs, keep=True)

        t = wall_time(
            {
                "served_fwd_kept": lambda: client.delete(
                    *raw.BlockLSTMV2(length, *weight_refs, keep=True)
                ),
                "served_bwd": lambda: raw.BlockLSTMGradV2(
                    length, *weight_refs, *kept, *grad_refs, use_peephole=False
                ),
                "inproc_bwd": lambda: backend_cuda.to_host(
                    lstm.block_lstm_backward(
                        backend_cuda,
                        lstm.LSTMInputs(*weights),
                        acts,
                        lstm.LSTMOutputGrads(*dev_grads),
                        seq_len_max=steps,
                    ).w_grad
                ),
            },
            cupy,
        )
    prefix = "served_graphs" if cuda_graphs else "served"
    return {f"{k.replace('served', prefix)}_ms": v for k, v in t.items()}


def record_failure(row: dict, name: str) -> None:
    """The exception being handled, into ``row[name + "_error"]`` and printed: a benchmark
    section that fails is reported, not fatal."""
    row[f"{name}_error"] = traceback.format_exc(limit=3)
    print(f"  {name} failed:\n{row[f'{name}_error']}")


def attempt(row: dict, name: str, fn, *args):
    """``fn(*args)``, or None if it raised (recorded by ``record_failure``)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - recorded, the benchmark goes on
        record_failure(row, name)
        return None


def describe(row: dict) -> str:
    """The row as the lines ``bench.log`` shows; a figure a failed section left out
    prints as n/a."""

    def f(key: str, spec: str = "8.3f") -> str:
        value = row.get(key)
        return "n/a" if value is None else format(value, spec)

    lines = [f"(T, B, I=H) = ({row['T']}, {row['B']}, {row['H']})"]
    for mode, label in (("ours", "ours, eager"), ("graphs", "ours, --cuda-graphs on")):
        if f"{mode}_fwd_ms" in row or f"{mode}_bwd_ms" in row:
            lines.append(
                f"  {label}: fwd {f(f'{mode}_fwd_ms')} ms ({f(f'{mode}_fwd_gflops', '.0f')} "
                f"GF/s, enqueue {f(f'{mode}_fwd_enqueue_ms', '.3f')} ms) | bwd "
                f"{f(f'{mode}_bwd_ms')} ms ({f(f'{mode}_bwd_gflops', '.0f')} GF/s, enqueue "
                f"{f(f'{mode}_bwd_enqueue_ms', '.3f')} ms)"
            )
    if "graphs_replays" in row:
        lines.append(
            f"    graphs: {row['graphs_replays']} replays, plans "
            f"{row['graphs_plan_bytes'] / 2**20:.0f} MiB"
        )
    for tag in ("fp32", "tf32"):
        if f"cudnn_{tag}_fwd_ms" not in row and f"cudnn_{tag}_bwd_ms" not in row:
            continue
        goal = " (goal <= 2x)" if tag == "fp32" else " (reference only)"
        line = (
            f"  cuDNN {tag}: fwd {f(f'cudnn_{tag}_fwd_ms')} ms | bwd {f(f'cudnn_{tag}_bwd_ms')} ms"
        )
        ratios = []
        for mode in ("ours", "graphs"):
            if f"{mode}_fwd_ratio_{tag}" in row or f"{mode}_bwd_ratio_{tag}" in row:
                ratios.append(
                    f"{'eager' if mode == 'ours' else 'graphs'} fwd "
                    f"{f(f'{mode}_fwd_ratio_{tag}', '.2f')}x, bwd "
                    f"{f(f'{mode}_bwd_ratio_{tag}', '.2f')}x"
                )
        if ratios:
            line += " | ours/cuDNN: " + "; ".join(ratios) + goal
        lines.append(line)
    for prefix, label in (("served", "eager"), ("served_graphs", "--cuda-graphs on")):
        if f"{prefix}_bwd_ms" in row:
            lines.append(
                f"  served, {label} (resident inputs, wall): fwd kept (+ delete) "
                f"{f(f'{prefix}_fwd_kept_ms', '.3f')} ms, bwd {f(f'{prefix}_bwd_ms', '.3f')} ms "
                f"vs in-process eager bwd {f('inproc_bwd_ms', '.3f')} ms"
            )
    return "\n".join(lines)


def torch_for_reference():
    """torch, where it can run the reference on ``TORCH_DEVICE``; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if TORCH_DEVICE == "cpu" or torch.cuda.is_available() else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import cupy

    torch = torch_for_reference()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    device = props["name"].decode()
    reference = f"torch {torch.__version__} on {TORCH_DEVICE}" if torch else "torch not available"
    print(
        f"# gradserve LSTM GPU benchmark: {device}, float32, cupy {cupy.__version__}; "
        f"cuDNN reference: {reference}; medians of interleaved rounds"
    )
    report = {"device": device, "cupy": cupy.__version__, "sizes": []}
    for steps, batch, units in SIZES:
        row: dict = {"T": steps, "B": batch, "H": units}
        size = (steps, batch, units)
        row |= attempt(row, "in_process", bench_in_process, *size, cupy, torch) or {}
        row |= attempt(row, "served", bench_served, *size, cupy, False) or {}
        row |= attempt(row, "served_graphs", bench_served, *size, cupy, True) or {}
        print(describe(row), flush=True)
        report["sizes"].append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
