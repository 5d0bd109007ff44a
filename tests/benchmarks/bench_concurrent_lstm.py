"""LSTM ops from several clients at once (``make bench``): forwards with their outputs
kept, from 1, 2 and 4 clients, against servers in their own processes at ``--threads``
BLAS threads; ops per second, measured interleaved. Two servers of this checkout: one as
it starts by default (every op computes with all the BLAS threads, ``cores // threads``
of them at once) and one with ``--share-blas-threads on`` (a slot per core, the ops
computing at once dividing the threads, ``kernels/blas_threads.py``).

``--old TREE`` adds another checkout's server (started from ``TREE/.venv``, as
``bench_ab_trees`` does), the clients from this checkout's SDK::

    python -m tests.benchmarks.bench_concurrent_lstm --old /tmp/old --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

import gradserve
from tests.benchmarks.bench_lstm import make_inputs
from tests.server_process import ServerProcess


def start_server(tree: str, threads: int, *flags: str) -> ServerProcess:
    """The server of checkout ``tree`` (its ``.venv``; this interpreter for this one)."""
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    python = sys.executable if tree == here else os.path.join(tree, ".venv", "bin", "python")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads)}
    return ServerProcess(*flags, python=python, cwd=tree, env=env)


def ops_per_second(target: str, clients: int, seconds: float, size: tuple[int, int, int]) -> float:
    """Forwards with kept outputs (deleted after each) from ``clients`` threads, each
    its own client and session, for ``seconds``."""
    inputs, _, _ = make_inputs(*size)
    length = np.int64(size[0])
    sdks = [gradserve.Client(target, shared_memory=False) for _ in range(clients)]
    refs = [[sdk.put(a) for a in inputs] for sdk in sdks]
    for sdk, r in zip(sdks, refs):  # warm-up: the plan and the buffers of this shape
        sdk.delete(*sdk.raw_ops.BlockLSTMV2(length, *r, use_peephole=True, keep=True))
    done = [0] * clients
    stop = time.monotonic() + seconds

    def loop(i: int) -> None:
        sdk, r = sdks[i], refs[i]
        while time.monotonic() < stop:
            sdk.delete(*sdk.raw_ops.BlockLSTMV2(length, *r, use_peephole=True, keep=True))
            done[i] += 1

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    started = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - started
    for sdk in sdks:
        sdk.close()
    return sum(done) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="another checkout to compare, interleaved")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--size", type=int, nargs=3, default=[50, 32, 256], metavar="N")
    parser.add_argument("--seconds", type=float, default=3.0, help="per client count")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    trees = {"all": (here,), "shared": (here, "--share-blas-threads", "on")}
    if args.old:
        trees["old"] = (os.path.abspath(args.old),)
    servers = {}
    try:
        for name, (tree, *flags) in trees.items():
            servers[name] = start_server(tree, args.threads, *flags)
        print(
            f"# LSTM forwards (outputs kept) at {tuple(args.size)} from concurrent clients; "
            f"servers at {args.threads} BLAS thread(s), {os.cpu_count()} CPUs; ops/s"
        )
        for _ in range(args.rounds):
            for clients in (1, 2, 4):
                row = []
                for name, server in servers.items():
                    time.sleep(0.3)  # the last server's BLAS threads go to sleep
                    rate = ops_per_second(server.target, clients, args.seconds, tuple(args.size))
                    row.append(f"{name} {rate:6.1f}")
                print(f"{clients} client(s): " + "  ".join(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
