"""Two checkouts of gradserve, each a server and an SDK of its own, timed on the same
LSTM call interleaved call by call: what a change to the server or the SDK gains, in
one run (this machine's speed moves by ±30% within an hour, so figures from two runs
do not compare).

Each checkout needs its own virtual environment with gradserve installed from it
(``python3 -m venv TREE/.venv && TREE/.venv/bin/pip install -e TREE``; ``git worktree
add /tmp/old COMMIT`` makes the old tree)::

    python -m tests.benchmarks.bench_ab_trees --old /tmp/old --new . --op fwd \\
        --size 50 32 256 --threads 2

Prints both medians and old/new (above 1: the new tree is faster). Run with the
environment's ``OPENBLAS_CORETYPE`` unset to time OpenBLAS's own kernel choice
(``bench_lstm.blas_environment``)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(target: str, op: str, steps: int, batch: int, units: int, shm: bool) -> None:
    """In a checkout's own Python, run from its root (this file may not be in it): one
    client, the inputs resident; one timed call per line read, its seconds written
    back."""
    sys.path.insert(0, os.getcwd())  # that checkout's tests package
    import numpy as np

    import gradserve
    from tests.benchmarks.bench_lstm import make_inputs

    client = gradserve.Client(target, shared_memory=shm)
    raw = client.raw_ops
    release = None  # what frees the last call's outputs on the server (else dropping them)
    if op not in ("stop", "put", "get"):
        inputs, cs_grad, h_grad = make_inputs(steps, batch, units)
        length = np.int64(steps)
        refs = [client.put(a) for a in inputs]
    if op == "fwd":

        def call():
            return raw.BlockLSTMV2(length, *refs, use_peephole=True)
    elif op == "stop":  # one output of T * B * H float32, inline below the threshold
        ref = client.put(np.ones(steps * batch * units, np.float32))

        def call():
            return raw.StopGradient(input=ref)
    elif op == "put":  # a tensor of T * B * H float32 kept in the session (deleted after)
        array = np.ones(steps * batch * units, np.float32)

        def call():
            return client.put(array)

        release = client.delete
    elif op == "get":  # the same tensor fetched back
        ref = client.put(np.ones(steps * batch * units, np.float32))

        def call():
            return client.get(ref)
    elif op == "kept":

        def call():
            return raw.BlockLSTMV2(length, *refs, use_peephole=True, keep=True)
    else:
        acts = raw.BlockLSTMV2(length, *refs, use_peephole=True, keep=True)
        grads = [client.put(cs_grad), client.put(h_grad)]

        def call():
            return raw.BlockLSTMGradV2(length, *refs, *acts, *grads, use_peephole=True)

    held = [call()]  # the last call's outputs (a warm-up first), freed before the next
    print("ready", flush=True)
    for _ in sys.stdin:
        if release is not None:
            release(*held)
        held.clear()
        started = time.perf_counter()
        held.append(call())
        print(time.perf_counter() - started, flush=True)
    client.close()


class Tree:
    """A checkout's server and client worker, started from its own ``.venv``."""

    def __init__(self, path: str, args: argparse.Namespace) -> None:
        # Here, not at the top: a worker runs this file in another checkout's Python,
        # where ``tests`` is importable only once ``worker`` has put it on the path.
        from tests.server_process import ServerProcess

        python = os.path.join(path, ".venv", "bin", "python")
        env = {**os.environ, "OPENBLAS_NUM_THREADS": str(args.threads)}
        self.server = ServerProcess(
            "--max-message-bytes", str(1 << 30), python=python, cwd=path, env=env
        )
        try:
            self._start_worker(path, python, env, args)
        except BaseException:
            self.server.proc.kill()  # a worker that did not start leaves no server behind
            self.server.proc.wait()
            raise

    def _start_worker(
        self, path: str, python: str, env: dict[str, str], args: argparse.Namespace
    ) -> None:
        self.worker = subprocess.Popen(
            [python, os.path.abspath(__file__), "--worker", self.server.target,
             "--op", args.op, "--transport", args.transport, "--size", *map(str, args.size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=path,
        )  # fmt: skip
        if self.worker.stdout.readline().strip() != "ready":
            self.worker.kill()
            self.worker.wait()
            raise RuntimeError(f"the client of {path} stopped")

    def call(self) -> float:
        self.worker.stdin.write("go\n")
        self.worker.stdin.flush()
        return float(self.worker.stdout.readline())

    def stop(self) -> None:
        self.worker.kill()
        self.worker.wait()
        self.server.proc.kill()
        self.server.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="the old checkout")
    parser.add_argument("--new", default=".", help="the new checkout")
    parser.add_argument("--op", choices=["fwd", "kept", "bwd", "stop", "put", "get"], default="fwd")
    parser.add_argument("--size", type=int, nargs=3, default=[50, 32, 256], metavar="N")
    parser.add_argument("--threads", type=int, default=2, help="BLAS threads of both servers")
    parser.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--pause", type=float, default=0.1, help="seconds between calls")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.op, *args.size, shm=args.transport == "shm")
        return
    if not args.old:
        parser.error("--old is required")
    trees: dict[str, Tree] = {}
    try:
        for name in ("old", "new"):
            trees[name] = Tree(os.path.abspath(getattr(args, name)), args)
        samples: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                time.sleep(args.pause)
                samples[name].append(tree.call())
    finally:
        for tree in trees.values():
            tree.stop()
    median = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
    steps, batch, units = args.size
    print(
        f"{args.op} over {args.transport} at ({steps}, {batch}, {units}), "
        f"{args.threads} BLAS thread(s), {args.rounds} calls each: old {median['old']:.1f} ms, "
        f"new {median['new']:.1f} ms, old/new {median['old'] / median['new']:.3f}"
    )


if __name__ == "__main__":
    main()
