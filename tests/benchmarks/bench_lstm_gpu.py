"""GPU LSTM benchmark (part of ``make gpu-check``): our CUDA path vs cuDNN.

float32, (T, B, I=H) = (50, 32, 256) and (100, 64, 512), no peepholes.
Ours: ``kernels.lstm`` on the CuPy backend (RawKernel steps + cuBLAS GEMMs).
Reference: ``torch.nn.LSTM`` (cuDNN) forward and backward, if torch is
installed. Timed with CUDA events after warm-up, interleaved, medians.
Goal: within 2x of cuDNN. Writes a JSON of every figure with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

SIZES = [(50, 32, 256), (100, 64, 512)]


def cuda_time(fn, cupy, repeat=10) -> float:
    """Median milliseconds of ``fn`` measured with CUDA events."""
    for _ in range(3):
        fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def bench_one(steps, batch, units, cupy, torch):
    """Figures for one size: ours, and cuDNN when ``torch`` is given."""
    from gradserve.kernels import backend_cuda, lstm

    rng = np.random.default_rng(0)
    f32 = np.float32
    x = cupy.asarray(rng.standard_normal((steps, batch, units)), f32)
    cs0 = cupy.zeros((batch, units), f32)
    w = cupy.asarray(rng.standard_normal((2 * units, 4 * units)) / np.sqrt(2 * units), f32)
    b = cupy.zeros(4 * units, f32)
    p = cupy.zeros(units, f32)
    g = cupy.asarray(rng.standard_normal((steps, batch, units)), f32)
    weights = (x, cs0, cs0, w, p, p, p, b)
    acts = lstm.block_lstm_forward(backend_cuda, *weights, seq_len_max=steps)
    ours_fwd = cuda_time(
        lambda: lstm.block_lstm_forward(backend_cuda, *weights, seq_len_max=steps), cupy
    )
    ours_bwd = cuda_time(
        lambda: lstm.block_lstm_backward(backend_cuda, *weights, *acts, g, g, seq_len_max=steps),
        cupy,
    )
    flops = 2.0 * steps * batch * 2 * units * 4 * units
    row = {
        "T": steps,
        "B": batch,
        "H": units,
        "ours_fwd_ms": ours_fwd,
        "ours_bwd_ms": ours_bwd,
        "ours_fwd_gflops": flops / ours_fwd / 1e6,
        "ours_bwd_gflops": 2 * flops / ours_bwd / 1e6,
    }
    line = (
        f"(T, B, I=H) = ({steps}, {batch}, {units}): ours fwd {ours_fwd:.2f} ms, "
        f"bwd {ours_bwd:.2f} ms"
    )
    if torch is not None:
        torch.backends.cudnn.benchmark = True
        model = torch.nn.LSTM(units, units).cuda()
        tx = torch.randn(steps, batch, units, device="cuda", requires_grad=True)
        tg = torch.randn(steps, batch, units, device="cuda")

        def torch_fwd():
            with torch.no_grad():
                model(tx)

        out, _ = model(tx)

        def torch_bwd():
            torch.autograd.grad(out, [tx, *model.parameters()], tg, retain_graph=True)

        cudnn_fwd = cuda_time(torch_fwd, cupy)
        cudnn_bwd = cuda_time(torch_bwd, cupy)
        row |= {
            "cudnn_fwd_ms": cudnn_fwd,
            "cudnn_bwd_ms": cudnn_bwd,
            "fwd_ratio": ours_fwd / cudnn_fwd,
            "bwd_ratio": ours_bwd / cudnn_bwd,
        }
        line += (
            f" | cuDNN fwd {cudnn_fwd:.2f} ms, bwd {cudnn_bwd:.2f} ms | ours/cuDNN: "
            f"fwd {ours_fwd / cudnn_fwd:.2f}x, bwd {ours_bwd / cudnn_bwd:.2f}x (goal <= 2x)"
        )
    return row, line


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
    print(
        f"# gradserve LSTM GPU benchmark: {props['name'].decode()}, float32; "
        f"cuDNN reference: {'torch ' + torch.__version__ if have_torch else 'torch not installed'}"
    )
    report = {"device": props["name"].decode(), "sizes": []}
    for steps, batch, units in SIZES:
        row, line = bench_one(steps, batch, units, cupy, torch if have_torch else None)
        print(line)
        report["sizes"].append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
