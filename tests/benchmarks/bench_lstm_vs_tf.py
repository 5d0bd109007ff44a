"""Our CPU LSTM against TensorFlow's own C++ kernels (``make bench-tf``, by hand: TensorFlow
is never a dependency).

What a team gives up or gains by calling gradserve instead of running ``BlockLSTMV2`` /
``BlockLSTMGradV2`` in process: float32, peepholes (``--no-peephole``: without), the sizes
of ``make bench``, on the same inputs. TensorFlow runs in a worker process of a Python
that has it (``--tf-python``), timing each call itself (no IPC in its figure). Ours is
timed two ways: the math in this process (NumPy backend, BLAS limited by threadpoolctl),
and through the SDK against a real server process (``python -m gradserve.server``,
``OPENBLAS_NUM_THREADS`` set to the same count), with the weights and the forward's
inputs resident in the session:

* forward, outputs kept: ``BlockLSTMV2(..., keep=True)`` (the outputs stay on the server;
  deleted between rounds, untimed);
* forward, outputs to the worker: the seven outputs returned, over TCP loopback
  (``shared_memory=False``) and through same-host shared memory (``shared_memory=True``,
  where the SDK has it);
* backward, inputs resident: ``BlockLSTMGradV2`` on resident inputs, activations and
  output gradients, the eight gradients returned.

Two more rows time only the matrix products each direction cannot do without, in the
fastest arrangement this BLAS offers (``gemm_floor_calls``): a floor that no
implementation calling this BLAS goes under, however its elementwise work and its
wire are done, so it bounds every ratio above it.

All are interleaved call by call and reported as medians, with TensorFlow's intra-op
pool at the same thread count. Before timing, the outputs of both are compared (max abs
error over max(1, max abs value)), so the figures are of the same computation. The last
lines are a Markdown table of ratios ("x TF" = TensorFlow's time / ours).
"""

from __future__ import annotations

import argparse
import contextlib
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
def tf_calls(tf, path: str, peephole: bool) -> dict:
    """TensorFlow's forward and backward on the inputs saved at ``path``; their outputs
    and gradients are saved next to it, at ``path + ".tf.npz"``."""
    with np.load(path) as data:
        case = {k: tf.constant(data[k]) for k in data.files}
    inputs = {k: case[k] for k in INPUTS}
    length = tf.constant(case["x"].shape[0], tf.int64)

    def fwd():
        return tf.raw_ops.BlockLSTMV2(
            seq_len_max=length, **inputs, cell_clip=0.0, use_peephole=peephole
        )

    outs = dict(zip(OUTPUTS, fwd()))

    def bwd():
        return tf.raw_ops.BlockLSTMGradV2(
            seq_len_max=length, **inputs, **outs, cs_grad=case["cs_grad"],
            h_grad=case["h_grad"], use_peephole=peephole,
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
            calls = tf_calls(tf, request["load"], request["peephole"])
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
#: The table's columns: (label, our sample, TensorFlow's sample).
ROWS = [
    ("forward, in process", "ours fwd", "tf fwd"),
    ("forward, outputs kept", "rpc fwd kept", "tf fwd"),
    ("forward, outputs to the worker (TCP)", "rpc fwd tcp", "tf fwd"),
    ("forward, outputs to the worker (shared memory)", "rpc fwd shm", "tf fwd"),
    ("backward, in process", "ours bwd", "tf bwd"),
    ("backward, inputs resident, gradients over TCP", "rpc bwd tcp", "tf bwd"),
    ("backward, inputs resident, gradients by shared memory", "rpc bwd shm", "tf bwd"),
    ("forward, its matrix products alone (a floor)", "floor fwd", "tf fwd"),
    ("backward, its matrix products alone (a floor)", "floor bwd", "tf bwd"),
]


def gemm_floor_calls(steps: int, batch: int, inputs: int, units: int) -> dict:
    """The GEMMs of a forward and of a backward, nothing else, as fast as this BLAS
    does them: their FLOPs are TensorFlow's (``[x, h] @ W`` per step forward; ``dgates @
    W^T`` and ``[x, h]^T @ dgates`` backward), arranged as fast as the dependencies
    allow: everything that does not wait on the recurrence as one large GEMM (the
    input projection; the input gradient and the weight gradient after the
    recurrence), the recurrent products one per step, in whichever orientation (``h @
    W_h`` or ``W_h^T @ h^T``) ran faster (both are timed; ``floor_times`` keeps the
    faster). Outputs go to buffers written before (warm memory), as ours do."""
    rng = np.random.default_rng(1)
    f32 = np.float32
    gates = 4 * units

    def r(*shape):
        return rng.standard_normal(shape).astype(f32)

    # Forward: x rows, W_x, W_h (and W_h^T), one step's h; its outputs.
    x_rows, w_x, w_h, w_h_t = (
        r(steps * batch, inputs),
        r(inputs, gates),
        r(units, gates),
        r(gates, units),
    )
    h, proj, step, step_t = (
        r(batch, units),
        r(steps * batch, gates),
        r(batch, gates),
        r(gates, batch),
    )
    # Backward: one step's dgates, all steps' dgates, [x, h] rows transposed, W_x^T;
    # its outputs dh (or dh^T), dx, dW.
    dgates, dgates_rows = r(batch, gates), r(steps * batch, gates)
    xh_rows_t, w_x_t = r(inputs + units, steps * batch), r(gates, inputs)
    dh, dh_t, dx, dw = (
        r(batch, units),
        r(units, batch),
        r(steps * batch, inputs),
        r(inputs + units, gates),
    )

    def fwd(transposed: bool):
        def run():
            np.matmul(x_rows, w_x, out=proj)
            for _ in range(steps):
                if transposed:
                    np.matmul(w_h_t, h.T, out=step_t)
                else:
                    np.matmul(h, w_h, out=step)

        return run

    def bwd(transposed: bool):
        def run():
            for _ in range(steps):
                if transposed:
                    np.matmul(w_h, dgates.T, out=dh_t)
                else:
                    np.matmul(dgates, w_h_t, out=dh)
            np.matmul(dgates_rows, w_x_t, out=dx)
            np.matmul(xh_rows_t, dgates_rows, out=dw)

        return run

    return {
        "floor fwd a": fwd(False), "floor fwd b": fwd(True),
        "floor bwd a": bwd(False), "floor bwd b": bwd(True),
    }  # fmt: skip


def floor_times(t: dict) -> None:
    """Each floor: the faster of its two orientations (medians, ms), in place."""
    for name in ("floor fwd", "floor bwd"):
        if f"{name} a" in t:
            t[name] = min(t.pop(f"{name} a"), t.pop(f"{name} b"))


@contextlib.contextmanager
def server_process(threads: int, step_kernel: str = "auto"):
    """A gradserve server in its own process, its BLAS at ``threads`` threads."""
    from tests.server_process import ServerProcess

    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    try:
        server = ServerProcess(
            "--max-message-bytes", str(1 << 30), "--cpu-step-kernel", step_kernel
        )
    finally:
        if saved is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = saved
    try:
        yield server.target
    finally:
        server.stop()


def clients(target: str) -> dict:
    """An SDK client on TCP, and one through shared memory where the SDK can (else the
    reason it cannot, as a string)."""
    import gradserve

    out = {}
    try:
        out["tcp"] = gradserve.Client(target, shared_memory=False)
    except TypeError:  # an SDK without shared memory
        out["tcp"] = gradserve.Client(target)
    try:
        out["shm"] = gradserve.Client(target, shared_memory=True)
    except TypeError:
        out["shm"] = "pending: this SDK has no shared_memory option"
    except Exception as exc:  # noqa: BLE001 - reported in the table
        out["shm"] = f"n/a: {type(exc).__name__}: {str(exc)[:120]}"
    return out


def compare(
    threads: int, tf_python: str, rounds: int, peephole: bool, rpc: bool, pause: float,
    step_kernel: str = "auto",
) -> list:  # fmt: skip
    """Every size at ``threads`` threads, against a fresh TensorFlow worker and server."""
    tf = TensorFlowWorker(tf_python, threads)
    results = []
    try:
        with contextlib.ExitStack() as stack:
            sdk = {}
            if rpc:
                target = stack.enter_context(server_process(threads, step_kernel))
                sdk = clients(target)
                for c in sdk.values():
                    if not isinstance(c, str):
                        stack.callback(c.close)
            print(f"\n## {threads} thread(s): TensorFlow {tf.version} intra-op pool, our BLAS")
            for size in SIZES:
                results.append(compare_size(tf, sdk, threads, rounds, peephole, pause, *size))
    finally:
        tf.close()
    return results


def rpc_calls(client, weights, cs_grad, h_grad, steps: int, peephole: bool) -> dict:
    """The timed RPCs of one client, on resident inputs (put here, untimed)."""
    raw = client.raw_ops
    length = np.int64(steps)
    w_refs = [client.put(a) for a in weights]
    acts = raw.BlockLSTMV2(length, *w_refs, use_peephole=peephole, keep=True)
    grad_refs = [client.put(cs_grad), client.put(h_grad)]

    def fwd_kept():
        refs = raw.BlockLSTMV2(length, *w_refs, use_peephole=peephole, keep=True)
        return lambda: client.delete(*refs)  # untimed clean-up

    return {
        "fwd kept": fwd_kept,
        "fwd": lambda: raw.BlockLSTMV2(length, *w_refs, use_peephole=peephole),
        "bwd": lambda: raw.BlockLSTMGradV2(
            length, *w_refs, *acts, *grad_refs, use_peephole=peephole
        ),
    }


def compare_size(tf, sdk, threads, rounds, peephole, pause, steps, batch, units) -> dict:
    from gradserve.kernels import backend_numpy, lstm
    from tests.benchmarks.bench_lstm import blas_threads, make_inputs
    from tests.kernels.lstm_cases import scaled_error

    weights, cs_grad, h_grad = make_inputs(steps, batch, units)
    case = dict(zip(INPUTS, weights), cs_grad=cs_grad, h_grad=h_grad)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.npz")
        np.savez(path, **case)
        with np.load(tf.ask({"load": path, "peephole": peephole})["outputs"]) as data:
            want = {k: data[k] for k in data.files}
    attrs = {"seq_len_max": steps, "use_peephole": peephole}
    with blas_threads(threads):
        outs = lstm.block_lstm_forward(backend_numpy, lstm.LSTMInputs(*weights), **attrs)
        fns = {
            "ours fwd": lambda: lstm.block_lstm_forward(
                backend_numpy, lstm.LSTMInputs(*weights), **attrs
            ),
            "tf fwd": lambda: tf.ask({"time": "fwd"})["seconds"],
            "ours bwd": lambda: lstm.block_lstm_backward(
                backend_numpy,
                lstm.LSTMInputs(*weights),
                outs,
                lstm.LSTMOutputGrads(cs_grad, h_grad),
                **attrs,
            ),
            "tf bwd": lambda: tf.ask({"time": "bwd"})["seconds"],
            **gemm_floor_calls(steps, batch, units, units),
        }
        grads = fns["ours bwd"]()
        got = dict(zip(OUTPUTS, outs)) | dict(zip(GRADS, grads))
        errors = {"in process": max(scaled_error(got[k], want[k]) for k in (*OUTPUTS, *GRADS))}
        skipped = {}
        for name, client in sdk.items():
            if isinstance(client, str):
                skipped[f"rpc fwd {name}"] = skipped[f"rpc bwd {name}"] = client
                continue
            calls = rpc_calls(client, weights, cs_grad, h_grad, steps, peephole)
            rpc_outs, rpc_grads = calls["fwd"](), calls["bwd"]()
            rpc_got = dict(zip(OUTPUTS, rpc_outs)) | dict(zip(GRADS, rpc_grads))
            errors[name] = max(scaled_error(rpc_got[k], want[k]) for k in (*OUTPUTS, *GRADS))
            fns[f"rpc fwd {name}"], fns[f"rpc bwd {name}"] = calls["fwd"], calls["bwd"]
            if name == "tcp":
                fns["rpc fwd kept"] = calls["fwd kept"]
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds + 1):  # the first round warms up, not counted
            for name, fn in fns.items():
                t0 = time.perf_counter()
                result = fn()
                elapsed = time.perf_counter() - t0
                samples[name].append(result if name.startswith("tf ") else elapsed)
                if name == "rpc fwd kept":
                    result()  # delete the kept outputs
                # Untimed: the BLAS and intra-op threads of the process that just ran
                # spin for up to ~0.1 s after a call (OpenBLAS's default timeout); on
                # 2 cores they would steal the next call's cores in another process.
                time.sleep(pause)
    t = {k: statistics.median(v[1:]) * 1e3 for k, v in samples.items()}
    floor_times(t)
    print(f"(T, B, I=H) = ({steps}, {batch}, {units}):", flush=True)
    for label, ours, theirs in ROWS:
        if ours in t:
            print(
                f"  {label:54s} ours {t[ours]:7.1f} ms, TF {t[theirs]:7.1f} ms "
                f"({t[theirs] / t[ours]:.2f}x TF)",
                flush=True,
            )
        elif ours in skipped:
            print(f"  {label:54s} {skipped[ours]}", flush=True)
    print(
        "  outputs and gradients agree with TensorFlow's to "
        + ", ".join(f"{e:.1e} ({k})" for k, e in errors.items()),
        flush=True,
    )
    return {"size": (steps, batch, units), "threads": threads, "t": t, "skipped": skipped}


def plan_summary() -> str:
    """The formulations this process's planner chose (the server's choose alike)."""
    try:
        from gradserve.kernels import lstm_cpu
    except ImportError:  # a tree from before the planner
        return "#   (one formulation: this tree has no planner)"
    lines = []
    for key, timings in lstm_cpu.PLANNER.measured.items():
        batch, inputs, units, _, threads, *_, fused = key
        chosen = min(timings, key=lambda f: timings[f])
        probe = ", ".join(f"{f.value} {s * 1e3:.2f} ms" for f, s in timings.items())
        lines.append(
            f"#   B={batch} I={inputs} H={units}, {threads} BLAS thread(s), "
            f"{'compiled' if fused else 'NumPy'} step: {chosen.value} (probe: {probe})"
        )
    return "\n".join(lines)


def table(results: list) -> str:
    """The Markdown table of ratios: one row per case, one column per (size, threads)."""
    cols = [(r["size"], r["threads"]) for r in results]
    head = "| | " + " | ".join(f"{s} {n} thr" for s, n in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for label, ours, theirs in ROWS:
        cells = []
        for r in results:
            t = r["t"]
            if ours in t:
                cells.append(f"{t[theirs] / t[ours]:.2f}× ({t[ours]:.1f} ms)")
            else:
                cells.append("pending" if "pending" in r["skipped"].get(ours, "") else "n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    dirty = (
        " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    )
    return f"{git('rev-parse', '--short', 'HEAD') or '(not a git checkout)'}{dirty}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf-python", help="a Python that has tensorflow-cpu")
    parser.add_argument("--threads", type=int, action="append",
                        help="threads for both (repeatable; default 1 and all)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-peephole", action="store_true")
    parser.add_argument("--no-rpc", action="store_true", help="only the in-process rows")
    parser.add_argument("--pause", type=float, default=0.2,
                        help="seconds between timed calls (spinning threads settle)")  # fmt: skip
    parser.add_argument("--cpu-step-kernel", default="auto", choices=("auto", "native", "numpy"),
                        help="the forward's elementwise pass, here and in the server")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.threads[0])
        return
    if not args.tf_python:
        parser.error("--tf-python is required (a Python with tensorflow-cpu installed)")
    from gradserve.kernels import lstm_cpu, native
    from tests.benchmarks.bench_lstm import blas_environment, blas_info

    peephole = not args.no_peephole
    step_kernel = native.Mode(args.cpu_step_kernel)
    lstm_cpu.STEP_KERNEL.set(step_kernel)  # this process's forwards (the server: its flag)
    fused = step_kernel is not native.Mode.NUMPY and native.NATIVE.library() is not None
    print(
        f"# ours (NumPy {np.__version__}) vs TensorFlow's BlockLSTMV2 / BlockLSTMGradV2 C++ "
        f"kernels, CPU, float32, {'with' if peephole else 'no'} peepholes; {os.cpu_count()} "
        f"CPUs; medians of {args.rounds} interleaved rounds, {args.pause} s between calls; "
        f"'Nx TF' = TF time / ours\n"
        f"# commit {commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
        f"# BLAS here: {blas_info()}; {blas_environment()} (the server inherits them)\n"
        f"# the forward's elementwise pass: --cpu-step-kernel {step_kernel.value} ("
        f"{'the compiled step' if fused else 'NumPy'})"
    )
    results = []
    for threads in args.threads or [1, os.cpu_count()]:
        results += compare(
            threads, args.tf_python, args.rounds, peephole, not args.no_rpc, args.pause,
            step_kernel.value,
        )  # fmt: skip
    print("\n# the CPU forward's formulation per shape (measured on the first call):")
    print(plan_summary())
    print("\n" + table(results))


if __name__ == "__main__":
    main()
