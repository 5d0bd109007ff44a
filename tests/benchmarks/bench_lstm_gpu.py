"""GPU LSTM benchmark (part of ``make gpu-check``): our CUDA path vs cuDNN.

float32, (T, B, I=H) = (50, 32, 256) and (100, 64, 512), no peepholes, random
data (zeros can run faster than real data).

* ours: ``kernels.lstm`` on the CuPy backend (RawKernel steps + cuBLAS GEMMs),
  timed with CUDA events after warm-up; also the host time to *enqueue* one
  call (when it is close to the event time, the loop is launch-bound);
* cuDNN: ``torch.nn.LSTM`` forward and backward, if torch sees the GPU, in
  full float32 (TF32 off: ours is exact float32, as the goldens require) and,
  for reference, with torch's default TF32 setting;
* ours with ``--cuda-graphs on``: each call copies its inputs into a captured
  plan, replays its CUDA graph (every step in one launch) and copies the
  outputs out;
* served: the same backward through the RPC of a ``--device cuda`` server with
  every input resident (kept forward outputs stay on the GPU), against the
  in-process call, in wall-clock time.

Goal: ours within 2x of cuDNN float32. Medians; interleaved where compared.
``--json`` writes every figure; a section that fails is recorded, not fatal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import numpy as np

SIZES = [(50, 32, 256), (100, 64, 512)]


def cuda_time(fn, cupy, repeat=20, stream=None) -> float:
    """Median milliseconds of ``fn`` measured with CUDA events on ``stream`` (default:
    the current one), after 3 warm-ups."""
    for _ in range(3):
        fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


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


def make_inputs(steps, batch, units):
    rng = np.random.default_rng(0)
    f32 = np.float32

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(f32)

    weights = (
        r(steps, batch, units),
        r(batch, units, scale=0.1),
        r(batch, units, scale=0.1),
        r(2 * units, 4 * units, scale=1 / np.sqrt(2 * units)),
        r(units, scale=0.1),
        r(units, scale=0.1),
        r(units, scale=0.1),
        r(4 * units, scale=0.1),
    )
    return weights, r(steps, batch, units), r(steps, batch, units)


def bench_ours(steps, batch, units, cupy, cuda_graphs: bool) -> dict:
    """Ours in process, eager (keys ``ours_*``) or with ``--cuda-graphs on`` (``graphs_*``:
    each call copies its inputs into a plan, replays its graph, copies the outputs out)."""
    from gradserve.kernels import lstm
    from gradserve.kernels.compute import compute_for

    compute = compute_for("cuda", cuda_graphs=cuda_graphs)
    host_weights, cs_grad, h_grad = make_inputs(steps, batch, units)
    weights = [cupy.asarray(a) for a in host_weights]
    grads = cupy.asarray(cs_grad), cupy.asarray(h_grad)
    acts = lstm.block_lstm_forward(compute.backend, *weights, seq_len_max=steps)

    def fwd():
        compute.lstm_forward(*weights, seq_len_max=steps)

    def bwd():
        compute.lstm_backward(*weights, *acts, *grads, seq_len_max=steps)

    flops = 2.0 * steps * batch * 2 * units * 4 * units
    mode = "graphs" if cuda_graphs else "ours"
    row = {f"{mode}_fwd_ms": cuda_time(fwd, cupy), f"{mode}_bwd_ms": cuda_time(bwd, cupy)}
    row[f"{mode}_fwd_enqueue_ms"] = enqueue_time(fwd, cupy)
    row[f"{mode}_bwd_enqueue_ms"] = enqueue_time(bwd, cupy)
    row[f"{mode}_fwd_gflops"] = flops / row[f"{mode}_fwd_ms"] / 1e6
    row[f"{mode}_bwd_gflops"] = 2 * flops / row[f"{mode}_bwd_ms"] / 1e6
    if cuda_graphs:
        row["graphs_replays"] = compute.graphs.replays
        row["graphs_plan_bytes"] = compute.graphs.nbytes
    return row


def bench_cudnn(steps, batch, units, cupy, torch, tf32: bool) -> dict:
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.manual_seed(0)
    model = torch.nn.LSTM(units, units).cuda()
    tx = torch.randn(steps, batch, units, device="cuda", requires_grad=True)
    tg = torch.randn(steps, batch, units, device="cuda")

    def fwd():
        with torch.no_grad():
            model(tx)

    out, _ = model(tx)

    def bwd():
        torch.autograd.grad(out, [tx, *model.parameters()], tg, retain_graph=True)

    tag = "tf32" if tf32 else "fp32"
    return {
        f"cudnn_{tag}_fwd_ms": cuda_time(fwd, cupy),
        f"cudnn_{tag}_bwd_ms": cuda_time(bwd, cupy),
    }


def bench_served(steps, batch, units, cupy, cuda_graphs: bool) -> dict:
    """Backward through the RPC (all inputs resident) vs in process, wall-clock, on a
    server with ``--cuda-graphs`` off or on (keys ``served_*`` / ``served_graphs_*``)."""
    import gradserve
    from gradserve.kernels import backend_cuda, lstm
    from gradserve.server import run_server

    host_weights, cs_grad, h_grad = make_inputs(steps, batch, units)
    weights = [cupy.asarray(a) for a in host_weights]
    dev_grads = cupy.asarray(cs_grad), cupy.asarray(h_grad)
    acts = lstm.block_lstm_forward(backend_cuda, *weights, seq_len_max=steps)
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
                        backend_cuda, *weights, *acts, *dev_grads, seq_len_max=steps
                    ).w_grad
                ),
            },
            cupy,
        )
    prefix = "served_graphs" if cuda_graphs else "served"
    return {f"{k.replace('served', prefix)}_ms": v for k, v in t.items()}


def section(row: dict, name: str, fn, *args) -> None:
    """``row |= fn(*args)``; a failure is recorded in ``row`` and printed."""
    try:
        row |= fn(*args)
    except Exception:  # noqa: BLE001 - a benchmark section that fails is reported, not fatal
        row[f"{name}_error"] = traceback.format_exc(limit=3)
        print(f"  {name} failed:\n{row[f'{name}_error']}")


def describe(row: dict) -> str:
    g = row.get
    lines = [f"(T, B, I=H) = ({row['T']}, {row['B']}, {row['H']})"]
    if "ours_fwd_ms" in row:
        lines.append(
            f"  ours  fwd {g('ours_fwd_ms'):8.3f} ms ({g('ours_fwd_gflops'):7.0f} GF/s, enqueue "
            f"{g('ours_fwd_enqueue_ms'):.3f} ms) | bwd {g('ours_bwd_ms'):8.3f} ms "
            f"({g('ours_bwd_gflops'):7.0f} GF/s, enqueue {g('ours_bwd_enqueue_ms'):.3f} ms)"
        )
    if "graphs_fwd_ms" in row:
        lines.append(
            f"  ours, --cuda-graphs on: fwd {g('graphs_fwd_ms'):8.3f} ms (enqueue "
            f"{g('graphs_fwd_enqueue_ms'):.3f} ms) | bwd {g('graphs_bwd_ms'):8.3f} ms (enqueue "
            f"{g('graphs_bwd_enqueue_ms'):.3f} ms) | {g('graphs_replays')} replays, plans "
            f"{g('graphs_plan_bytes') / 2**20:.0f} MiB"
        )
    for tag in ("fp32", "tf32"):
        if f"cudnn_{tag}_fwd_ms" in row and "ours_fwd_ms" in row:
            fwd, bwd = row[f"cudnn_{tag}_fwd_ms"], row[f"cudnn_{tag}_bwd_ms"]
            goal = " (goal <= 2x)" if tag == "fp32" else " (reference only)"
            line = f"  cuDNN {tag} fwd {fwd:8.3f} ms | bwd {bwd:8.3f} ms | ours/cuDNN"
            for mode in ("ours", "graphs"):
                if f"{mode}_fwd_ms" in row:
                    row[f"{mode}_fwd_ratio_{tag}"] = row[f"{mode}_fwd_ms"] / fwd
                    row[f"{mode}_bwd_ratio_{tag}"] = row[f"{mode}_bwd_ms"] / bwd
                    line += (
                        f" {'eager' if mode == 'ours' else 'graphs'}: fwd "
                        f"{row[f'{mode}_fwd_ratio_{tag}']:.2f}x, bwd "
                        f"{row[f'{mode}_bwd_ratio_{tag}']:.2f}x;"
                    )
            lines.append(line.rstrip(";") + goal)
    for prefix, label in (("served", "eager"), ("served_graphs", "--cuda-graphs on")):
        if f"{prefix}_bwd_ms" in row:
            lines.append(
                f"  served, {label} (resident inputs, wall): fwd kept (+ delete) "
                f"{g(f'{prefix}_fwd_kept_ms'):.3f} ms, bwd {g(f'{prefix}_bwd_ms'):.3f} ms vs "
                f"in-process eager bwd {g('inproc_bwd_ms'):.3f} ms"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import cupy

    try:
        import torch

        have_torch = torch.cuda.is_available()
    except ImportError:
        torch, have_torch = None, False
    props = cupy.cuda.runtime.getDeviceProperties(0)
    device = props["name"].decode()
    print(
        f"# gradserve LSTM GPU benchmark: {device}, float32, cupy {cupy.__version__}; cuDNN "
        f"reference: {'torch ' + torch.__version__ if have_torch else 'torch not available'}"
    )
    report = {"device": device, "cupy": cupy.__version__, "sizes": []}
    for steps, batch, units in SIZES:
        row: dict = {"T": steps, "B": batch, "H": units}
        size = (steps, batch, units)
        section(row, "ours", bench_ours, *size, cupy, False)
        section(row, "graphs", bench_ours, *size, cupy, True)
        if have_torch:
            for tf32 in (False, True):
                tag = "tf32" if tf32 else "fp32"
                section(row, f"cudnn_{tag}", bench_cudnn, *size, cupy, torch, tf32)
        section(row, "served", bench_served, *size, cupy, False)
        section(row, "served_graphs", bench_served, *size, cupy, True)
        print(describe(row), flush=True)
        report["sizes"].append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
