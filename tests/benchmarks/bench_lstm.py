"""LSTM benchmark (``make bench``): not a test, prints figures and ratios.

float32, (T, B, I=H) = (50, 32, 256) and (100, 64, 512), forward and backward:

* ours: ``gradserve.kernels.lstm`` on the NumPy backend (the forward in the
  formulation ``kernels/lstm_cpu.py`` measured fastest for the shape: hoisted
  input projection + per-step h GEMM, or per-step [x, h] GEMM; backward with
  batched x/w GEMMs);
* baseline: TensorFlow's structure, written here: per step concatenate [x, h],
  one xh @ W GEMM, elementwise; backward per step dgates @ W^T and an
  xh^T @ dgates accumulation into w_grad;
* the limit: one large ``numpy.matmul`` of the same total shape.

Each is reported in GFLOP/s of its GEMM work (2 * flops of the forward GEMMs
for the backward), measured interleaved (ours, baseline, matmul, ...) and
reported as medians. Then the same backward through the RPC with the
activations resident, as overhead over in-process. BLAS threads are printed
and both 1 and all BLAS threads are measured (threadpoolctl).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from gradserve import protocol
from gradserve.kernels import backend_numpy, lstm

SIZES = [(50, 32, 256), (100, 64, 512)]


def make_inputs(steps, batch, units):
    """The LSTM benchmarks' inputs, I = H, float32, seeded: the eight array inputs of
    ``BlockLSTMV2`` (x, cs_prev, h_prev, w, wci, wcf, wco, b) and the output gradients
    (cs_grad, h_grad)."""
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


def sigmoid(x):
    return 0.5 * np.tanh(0.5 * x) + 0.5


def baseline_forward(x, cs_prev, h_prev, w, b):
    """TensorFlow's per-step structure (no peephole, IFCO, no clip)."""
    steps, batch, _ = x.shape
    units = cs_prev.shape[1]
    outs = {
        k: np.empty((steps, batch, units), x.dtype) for k in ("i", "cs", "f", "o", "ci", "co", "h")
    }
    c, h = cs_prev, h_prev
    for t in range(steps):
        xh = np.concatenate([x[t], h], axis=1)
        gates = xh @ w + b
        i = sigmoid(gates[:, :units])
        f = sigmoid(gates[:, units : 2 * units])
        ci = np.tanh(gates[:, 2 * units : 3 * units])
        o = sigmoid(gates[:, 3 * units :])
        c = i * ci + f * c
        co = np.tanh(c)
        h = o * co
        for k, v in zip(("i", "cs", "f", "o", "ci", "co", "h"), (i, c, f, o, ci, co, h)):
            outs[k][t] = v
    return outs


def baseline_backward(x, cs_prev, h_prev, w, acts, cs_grad, h_grad):
    steps, batch, inputs = x.shape
    units = cs_prev.shape[1]
    w_grad = np.zeros_like(w)
    b_grad = np.zeros(4 * units, x.dtype)
    x_grad = np.empty_like(x)
    dcs = np.zeros((batch, units), x.dtype)
    dh = np.zeros((batch, units), x.dtype)
    i, cs, f, o, ci, co, h = (acts[k] for k in ("i", "cs", "f", "o", "ci", "co", "h"))
    for t in reversed(range(steps)):
        c_prev = cs_prev if t == 0 else cs[t - 1]
        h_last = h_prev if t == 0 else h[t - 1]
        dh_t = dh + h_grad[t]
        do = o[t] * (1 - o[t]) * dh_t * co[t]
        dcs_t = (1 - co[t] ** 2) * dh_t * o[t] + dcs + cs_grad[t]
        dci = (1 - ci[t] ** 2) * dcs_t * i[t]
        df = f[t] * (1 - f[t]) * dcs_t * c_prev
        di = i[t] * (1 - i[t]) * dcs_t * ci[t]
        dgates = np.concatenate([di, df, dci, do], axis=1)
        xh_grad = dgates @ w.T
        x_grad[t], dh = xh_grad[:, :inputs], xh_grad[:, inputs:]
        xh = np.concatenate([x[t], h_last], axis=1)
        w_grad += xh.T @ dgates
        b_grad += dgates.sum(0)
        dcs = dcs_t * f[t]
    return x_grad, dcs, dh, w_grad, b_grad


def seconds(fn) -> float:
    """Wall time of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: dict, rounds: int) -> dict[str, float]:
    """Medians of ``rounds`` alternating calls of each fn, after one untimed call of
    each: the CPU forward measures its formulations on the first call of a shape and
    thread count (``lstm_cpu.Planner``), which a training loop pays once, not per
    step; with few rounds that call moved the median (``--rounds 2``: 81 ms for a
    20 ms forward)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(seconds(fn))
    return {k: statistics.median(v) for k, v in samples.items()}


@contextlib.contextmanager
def blas_threads(n: int | None):
    with threadpool_limits(limits=n, user_api="blas"):
        yield


def blas_info() -> str:
    infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return ", ".join(
        f"{i['internal_api']} {i.get('version')} ({i.get('architecture')}), "
        f"{i['num_threads']} threads"
        for i in infos
    )


def blas_environment() -> str:
    """The variables that choose OpenBLAS's kernels. The project's machines set
    ``OPENBLAS_CORETYPE=Haswell`` (older OpenBLAS builds went wrong on their CPU), which
    holds a current NumPy to its AVX2 kernels on an AVX-512 CPU: a figure meant for a
    deployment runs with both unset (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE``)."""
    names = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    return ", ".join(f"{n}={os.environ.get(n)}" for n in names)


def bench_size(steps, batch, units, rounds, rpc_target):
    inputs = units
    weights, cs_grad, h_grad = make_inputs(steps, batch, units)
    x, cs_prev, h_prev, w, *_, b = weights
    rng = np.random.default_rng(1)
    f32 = np.float32
    acts = lstm.block_lstm_forward(backend_numpy, lstm.LSTMInputs(*weights), seq_len_max=steps)
    base_acts = baseline_forward(x, cs_prev, h_prev, w, b)

    fwd_flops = 2.0 * steps * batch * (inputs + units) * 4 * units
    bwd_flops = 2 * fwd_flops
    big_a = rng.standard_normal((steps * batch, inputs + units)).astype(f32)
    out = np.empty((steps * batch, 4 * units), f32)

    fns = {
        "ours fwd": lambda: lstm.block_lstm_forward(
            backend_numpy, lstm.LSTMInputs(*weights), seq_len_max=steps
        ),
        "base fwd": lambda: baseline_forward(x, cs_prev, h_prev, w, b),
        "ours bwd": lambda: lstm.block_lstm_backward(
            backend_numpy,
            lstm.LSTMInputs(*weights),
            acts,
            lstm.LSTMOutputGrads(cs_grad, h_grad),
            seq_len_max=steps,
        ),
        "base bwd": lambda: baseline_backward(x, cs_prev, h_prev, w, base_acts, cs_grad, h_grad),
        "matmul": lambda: np.matmul(big_a, w, out=out),
    }
    results = {}
    for threads in [1, None]:
        with blas_threads(threads):
            t = interleaved(fns, rounds)
        label = "1 thread" if threads == 1 else f"{os.cpu_count()} threads (all)"
        results[label] = t
        gf = lambda flops, s: flops / s / 1e9  # noqa: E731
        mm = gf(fwd_flops, t["matmul"])
        print(f"  BLAS {label}:")
        print(
            f"    forward : ours {t['ours fwd'] * 1e3:8.1f} ms {gf(fwd_flops, t['ours fwd']):6.1f} GF/s"
            f" | baseline {t['base fwd'] * 1e3:8.1f} ms {gf(fwd_flops, t['base fwd']):6.1f} GF/s"
            f" | speed-up {t['base fwd'] / t['ours fwd']:.2f}x"
        )
        print(
            f"    backward: ours {t['ours bwd'] * 1e3:8.1f} ms {gf(bwd_flops, t['ours bwd']):6.1f} GF/s"
            f" | baseline {t['base bwd'] * 1e3:8.1f} ms {gf(bwd_flops, t['base bwd']):6.1f} GF/s"
            f" | speed-up {t['base bwd'] / t['ours bwd']:.2f}x (goal >= 1.5x)"
        )
        print(
            f"    one large matmul: {mm:6.1f} GF/s; ours backward at "
            f"{gf(bwd_flops, t['ours bwd']) / mm:.0%} of it (goal >= 50%), forward at "
            f"{gf(fwd_flops, t['ours fwd']) / mm:.0%}"
        )

    if rpc_target:
        import gradserve

        with gradserve.Client(rpc_target) as client:
            raw = client.raw_ops
            refs = raw.BlockLSTMV2(np.int64(steps), *weights, keep=True)
            weight_refs = [client.put(a) for a in weights]
            grad_refs = [client.put(cs_grad), client.put(h_grad)]

            def rpc_bwd():
                raw.BlockLSTMGradV2(
                    np.int64(steps), *weight_refs, *refs, *grad_refs, use_peephole=False
                )

            t = interleaved({"rpc": rpc_bwd, "inproc": fns["ours bwd"]}, rounds)
        print(
            f"  backward through RPC, all inputs resident: {t['rpc'] * 1e3:.1f} ms vs "
            f"{t['inproc'] * 1e3:.1f} ms in process ({t['rpc'] / t['inproc'] - 1:+.1%} overhead,"
            f" results sent back inline below {protocol.DEFAULT_STREAM_THRESHOLD_BYTES >> 20} MiB,"
            " streamed above)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-rpc", action="store_true")
    args = parser.parse_args()
    print(f"# gradserve LSTM benchmark (CPU, float32): {os.cpu_count()} CPUs; {blas_info()}")
    print(f"# {blas_environment()}; medians of {args.rounds} interleaved rounds")
    server = None
    target = None
    if not args.no_rpc:
        from gradserve.server import run_server

        server = run_server(device="cpu", max_message_bytes=1 << 30)
        target = f"127.0.0.1:{server.__enter__().port}"
    try:
        for steps, batch, units in SIZES:
            print(f"\n(T, B, I=H) = ({steps}, {batch}, {units})")
            bench_size(steps, batch, units, args.rounds, target)
    finally:
        if server is not None:
            server.__exit__(None, None, None)


if __name__ == "__main__":
    main()
