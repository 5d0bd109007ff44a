"""Wire benchmark (``make bench``): how fast a tensor of each size moves, in GB/s.

Not a test: prints figures and checks them against the goals of issue 17. One
server process (``gradserve`` on a free loopback port, plus a bare gRPC echo
service with the same message limits) and this process as the client. For each
size from 64 KiB to 256 MiB:

- ``put``: ``client.put(array)`` (PutTensor stream, or a unary call below the
  stream threshold where the SDK picks one);
- ``get``: ``client.get(ref)``;
- ``op``: ``StopGradient`` on a resident tensor, its output coming back to the worker
  (inline in the response below the stream threshold, fetched by stream above it);
- ``echo``: a bare gRPC unary echo of a message of that size (bytes in, bytes out,
  no serialisation): the floor of what gRPC Python does with one message;
- with ``--shm`` (and an SDK that has it): ``put``/``get`` through same-host shared
  memory, and for comparison ``memcpy`` (``np.copy``: into a fresh array, page
  faults included) and ``warm`` (``np.copyto`` into an array written before).

Each figure is the median of ``--rounds`` interleaved rounds (every variant of a
size in turn, then again), on a machine that is likely shared: read ratios, not
absolute numbers. GB/s are 10^9 bytes per second of tensor bytes moved.

Goals (issue 17): put and get >= 1 GB/s from 4 MiB to 256 MiB; below 4 MiB a put or
get within the bare echo's small-message latency plus its bytes at 1 GB/s; put+get of
256 MiB through shared memory >= 50% of memcpy (the ``memcpy`` column). Since the
server keeps freed buffers warm (``gradserve/warm_buffers.py``) its side of a put
pays no page faults while ``memcpy`` does, so the row also gives the ratio to
``warm``: the honest ceiling.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys

import grpc
import numpy as np

import gradserve
from tests.benchmarks.bench_core import interleaved, serve_with_echo

ECHO_METHOD = "/bench.Echo/Echo"
KIB, MIB = 1 << 10, 1 << 20
SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
LIMIT = 512 * MIB  # message limit of both ends: a 256 MiB echo must fit
GOAL_GBPS = 1.0


def serve() -> None:
    """Child process: gradserve on a free port plus a bare echo server."""

    serve_with_echo(LIMIT, workers=4)


def putting(client, array):
    """``client.put(array)``, timed without the delete that follows it."""

    def put():
        return client.put(array)

    put.undo = client.delete
    return put


def repeats(size: int) -> int:
    """Calls per timing: about 16 MiB moved, at least three calls (one large call now
    and then takes several times the others here: a median of one would be noise)."""
    return max(3, min(50, (16 * MIB) // size))


def has_shared_memory() -> bool:
    return "shared_memory" in inspect.signature(gradserve.Client).parameters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-mib", type=int, default=256, help="largest size (MiB)")
    parser.add_argument("--no-shm", action="store_true", help="skip the shared-memory rows")
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.benchmarks.bench_wire", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        ports = [int(p) for p in re.match(r"ports (\d+) (\d+) (\d+)", line).groups()]
        gs, echo, aio_echo = (f"127.0.0.1:{p}" for p in ports)
        sizes = [s for s in SIZES if s <= args.max_mib * MIB]
        run(gs, echo, aio_echo, sizes, args.rounds, not args.no_shm)
    finally:
        child.stdin.close()
        child.wait(30)


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def run(
    target: str, echo_target: str, aio_target: str, sizes: list[int], rounds: int, shm: bool
) -> None:
    shm = shm and has_shared_memory()
    options = [("grpc.max_send_message_length", LIMIT), ("grpc.max_receive_message_length", LIMIT)]
    echo_channel = grpc.insecure_channel(echo_target, options=options)
    echo = echo_channel.unary_unary(ECHO_METHOD)
    aio_channel = grpc.insecure_channel(aio_target, options=options)
    aio_echo = aio_channel.unary_unary(ECHO_METHOD)
    extra = {"shared_memory": False} if has_shared_memory() else {}
    client = gradserve.Client(target, max_message_bytes=LIMIT, **extra)
    shm_client = gradserve.Client(target, shared_memory=True) if shm else None
    print(
        f"# gradserve wire benchmark: {os.cpu_count()} CPUs, TCP loopback, medians of "
        f"{rounds} interleaved rounds; GB/s = 1e9 tensor bytes/s; commit {_commit()}"
    )
    tiny = b"x" * 64
    for _ in range(200):
        echo(tiny)
    for _ in range(200):
        aio_echo(tiny)
    floors = interleaved({"echo": lambda: echo(tiny), "aio": lambda: aio_echo(tiny)}, rounds, 200)
    latency = floors["echo"]
    print(
        f"# bare gRPC unary echo of 64 bytes: {latency * 1e6:.0f} us (threaded server; the "
        f"same echo on a grpc.aio server, gradserve's kind: {floors['aio'] * 1e6:.0f} us)"
    )
    head = f"{'size':>8} | {'put':>6} {'get':>6} {'op':>6} {'echo':>6} (GB/s)"
    if shm:
        head += f" | {'shm put':>7} {'shm get':>7} {'memcpy':>6} {'warm':>6} (GB/s)"
    print(head + " | goal")
    rng = np.random.default_rng(0)
    for size in sizes:
        array = rng.integers(0, 255, size, dtype=np.uint8).view(np.float32)
        raw = array.tobytes()
        ref = client.put(array)
        fns = {
            "put": putting(client, array),
            "get": lambda r=ref: client.get(r),
            "op": lambda r=ref: client.raw_ops.StopGradient(input=r),
            "echo": lambda m=raw: echo(m),
        }
        if shm_client is not None:
            shm_ref = shm_client.put(array)
            fns["shm put"] = putting(shm_client, array)
            fns["shm get"] = lambda r=shm_ref: shm_client.get(r)
            fns["memcpy"] = lambda a=array: np.copy(a)  # into fresh memory
            warm = np.empty_like(array)
            warm[...] = array
            fns["warm"] = lambda a=array, w=warm: np.copyto(w, a)  # into reused memory
        t = interleaved(fns, rounds, repeats(size))
        client.delete(ref)
        if shm_client is not None:
            shm_client.delete(shm_ref)
        gbps = {k: size / v / 1e9 for k, v in t.items()}
        row = f"{_size(size):>8} | " + " ".join(f"{gbps[k]:6.2f}" for k in ("put", "get", "op"))
        row += f" {gbps['echo']:6.2f}"
        if shm_client is not None:
            row += (
                f" | {gbps['shm put']:7.2f} {gbps['shm get']:7.2f} {gbps['memcpy']:6.2f}"
                f" {gbps['warm']:6.2f}"
            )
        if size >= 4 * MIB:
            met = min(gbps["put"], gbps["get"]) >= GOAL_GBPS
            row += f" | put,get >= {GOAL_GBPS:g} GB/s: {'met' if met else 'NOT met'}"
        else:
            bound = latency + size / (GOAL_GBPS * 1e9)
            worst = max(t["put"], t["get"])
            row += (
                f" | {worst * 1e3:.2f} ms vs bound {bound * 1e3:.2f} ms: "
                f"{'met' if worst <= bound else 'NOT met'}"
            )
        if shm_client is not None and size == 256 * MIB:
            both = size * 2 / (t["shm put"] + t["shm get"]) / 1e9
            frac, frac_warm = both / gbps["memcpy"], both / gbps["warm"]
            row += (
                f"; shm put+get {both:.2f} GB/s = {frac:.0%} of memcpy into fresh memory "
                f"(goal >= 50%), {frac_warm:.0%} of memcpy into reused memory"
            )
        print(row, flush=True)
    client.close()
    if shm_client is not None:
        shm_client.close()
    echo_channel.close()
    aio_channel.close()


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
        return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
