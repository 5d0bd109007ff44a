"""Core-service benchmark (``make bench``): not a test, prints figures and ratios.

One server process hosts both gradserve and a bare gRPC echo service (same
thread pool size, same message limits), so the two are compared under the
same conditions; this process is the client. Every comparison is interleaved
(A, B, A, B, ...) and reported as a median with the ratio.

(a) a small TensorArray write+read through the SDK vs bare unary echoes of the
    same bytes (per RPC, and write+read in one Batch vs one echo);
(b) a 256 MiB tensor put+get through the SDK (chunked streams) vs a bare
    single-message echo of it vs memcpy of the same bytes;
(c) 100 writes, one per RPC vs one Batch;
(d) one op's tensor inline vs streamed, by size (where the SDK's default
    stream threshold comes from).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc
import numpy as np

import gradserve
from gradserve import codec, protocol
from gradserve.v1 import tensor_array_pb2 as pb

ECHO_METHOD = "/bench.Echo/Echo"
BIG = 256 * 1024 * 1024
SIZES_KIB = (256, 1024, 2048, 4096, 16384)


def serve() -> None:
    """Child process: gradserve on a free port plus a bare echo server."""
    serve_with_echo(2 * BIG, workers=16)


def serve_with_echo(limit: int, workers: int) -> None:
    """gradserve on a free port plus a bare gRPC echo server (the floor a call cannot
    beat), both taking messages up to ``limit``; prints their ports, serves until
    stdin closes."""
    from gradserve.server import ServerConfig, start

    server = start(ServerConfig(port=0, device="cpu", max_message_bytes=limit))
    echo = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ],
    )
    identity = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
    echo.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": identity}),)
    )
    echo_port = echo.add_insecure_port("127.0.0.1:0")
    echo.start()
    aio_port = _serve_aio_echo(limit)
    print(f"ports {server.port} {echo_port} {aio_port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin


def _serve_aio_echo(limit: int) -> int:
    """The same echo on ``grpc.aio`` (the server kind gradserve runs: no thread per
    call), on its own event loop thread: its port. It shows how much of a small
    call's latency is the asyncio server's own, which no handler can save."""
    import asyncio
    import threading

    started: list[int] = []
    ready = threading.Event()

    async def echo(request: bytes, context) -> bytes:
        return request

    async def main() -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
            ]
        )
        identity = grpc.unary_unary_rpc_method_handler(echo)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": identity}),)
        )
        started.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        await server.wait_for_termination()

    threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
    ready.wait(30)
    return started[0]


def median_time(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls. What a call returns is passed to its
    ``undo`` attribute, if it has one, outside the timing (a put's delete)."""
    times = []
    undo = getattr(fn, "undo", None)
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        if undo is not None:
            undo(result)
    return statistics.median(times)


def interleaved(fns: dict, rounds: int, repeat: int) -> dict[str, float]:
    """Median seconds of each fn, measured in alternating rounds."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(median_time(fn, repeat))
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.serve:
        serve()
        return

    child = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        gs_port, echo_port = map(int, re.match(r"ports (\d+) (\d+)", line).groups())
        run(f"127.0.0.1:{gs_port}", f"127.0.0.1:{echo_port}", args.rounds)
    finally:
        child.stdin.close()
        child.wait(10)


def run(target: str, echo_target: str, rounds: int) -> None:
    print(
        f"# gradserve core benchmark: {os.cpu_count()} CPUs, loopback, medians of {rounds} "
        "interleaved rounds"
    )
    limit = 2 * BIG
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    echo_channel = grpc.insecure_channel(echo_target, options=options)
    echo = echo_channel.unary_unary(ECHO_METHOD)  # bytes in, bytes out: no serialisation at all
    # The wire: same-host shared memory (the SDK's default here) is bench_wire's.
    client = gradserve.Client(
        target, max_message_bytes=limit, stream_threshold=32 << 20, shared_memory=False
    )

    # (a) small write + read
    value = np.arange(64, dtype=np.float32)  # 256 bytes
    # Echo payloads as large as the real messages: the write request, the read reply.
    h0, _ = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    write_req = pb.TensorArrayWriteV3Request(handle=pb.TensorArrayHandle(id=h0.id, name=h0.name))
    codec.encode(np.array(0, np.int32), write_req.index.value)
    codec.encode(value, write_req.value.value)
    read_reply = pb.TensorArrayReadV3Response()
    codec.encode(value, read_reply.value.value)
    write_msg = bytes(write_req.ByteSize())
    read_msg = bytes(read_reply.ByteSize())

    def new_array():  # made ahead of time: not part of what is timed
        return client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)

    handles = [new_array() for _ in range(rounds * 200 + 10)]
    it = iter(handles)

    def sdk_pair():
        h, flow = next(it)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, value, flow)
        client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32)

    batch_handles = iter([new_array() for _ in range(rounds * 200 + 10)])

    def sdk_batch_pair():
        h, flow = next(batch_handles)
        b = client.batch()
        b.raw_ops.TensorArrayWriteV3(h, 0, value, flow)
        b.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32)
        b.run()

    def echo_pair():
        echo(write_msg)
        echo(read_msg)

    def echo_one():
        echo(write_msg)

    for _ in range(50):
        echo_one()
    a = interleaved(
        {
            "sdk write+read (2 RPCs)": sdk_pair,
            "bare echo x2": echo_pair,
            "sdk write+read (1 Batch)": sdk_batch_pair,
            "bare echo x1": echo_one,
        },
        rounds,
        20,
    )
    print("\n(a) small TensorArray write+read vs bare gRPC unary echo (256-byte tensor)")
    for k, v in a.items():
        print(f"    {k:28s} {v * 1e6:8.1f} us")
    print(
        f"    ratio, per RPC:          {a['sdk write+read (2 RPCs)'] / a['bare echo x2']:.2f}x "
        "of the echo (goal <= 1.5x)"
    )
    print(f"    ratio, Batch vs 1 echo:  {a['sdk write+read (1 Batch)'] / a['bare echo x1']:.2f}x")

    # (b) 256 MiB put + get
    big = np.random.default_rng(0).standard_normal(BIG // 8)
    raw = big.tobytes()
    dst = np.empty_like(big)

    def put_get(chunk_bytes: int):
        def run():
            client.chunk_bytes = chunk_bytes
            ref = client.put(big)
            out = client.get(ref)
            client.delete(ref)
            assert out.nbytes == BIG

        return run

    def echo_big():
        assert len(echo(raw)) == BIG

    def memcpy():
        np.copyto(dst, big)  # there ...
        np.copyto(big, dst)  # ... and back: the same bytes moved as put+get

    b = interleaved(
        {
            "sdk put+get (1 MiB chunks)": put_get(1 << 20),
            "sdk put+get (8 MiB chunks)": put_get(8 << 20),
            "bare echo (1 message)": echo_big,
            "memcpy x2": memcpy,
        },
        rounds,
        1,
    )
    client.chunk_bytes = protocol.DEFAULT_CHUNK_BYTES
    b["sdk put+get (streamed)"] = b[
        f"sdk put+get ({protocol.DEFAULT_CHUNK_BYTES >> 20} MiB chunks)"
    ]
    moved = 2 * BIG / 2**30
    print("\n(b) 256 MiB tensor there and back (512 MiB moved)")
    for k, v in b.items():
        if k != "sdk put+get (streamed)":
            print(f"    {k:28s} {v * 1e3:8.1f} ms  {moved / v:6.2f} GiB/s")
    print(
        f"    sdk (default {protocol.DEFAULT_CHUNK_BYTES >> 20} MiB chunks) vs bare echo: "
        f"{b['bare echo (1 message)'] / b['sdk put+get (streamed)']:.2f}x faster (goal >= 2x)"
    )
    print(f"    sdk as fraction of memcpy: {b['memcpy x2'] / b['sdk put+get (streamed)']:.1%}")

    # (c) 100 writes: one per RPC vs one Batch
    step = np.ones(128, np.float32)

    def writes_unary():
        h, flow = client.raw_ops.TensorArrayV3(size=100, dtype=np.float32)
        for t in range(100):
            flow = client.raw_ops.TensorArrayWriteV3(h, t, step, flow)

    def writes_batch():
        h, flow = client.raw_ops.TensorArrayV3(size=100, dtype=np.float32)
        batch = client.batch()
        for t in range(100):
            batch.raw_ops.TensorArrayWriteV3(h, t, step, flow)
        batch.run()

    c = interleaved({"100 unary writes": writes_unary, "1 Batch of 100": writes_batch}, rounds, 3)
    print("\n(c) 100 TensorArray writes (512-byte values; both include one TensorArrayV3 call)")
    for k, v in c.items():
        print(f"    {k:28s} {v * 1e3:8.2f} ms")
    print(
        f"    Batch speed-up:          {c['100 unary writes'] / c['1 Batch of 100']:.1f}x "
        "(goal >= 10x)"
    )
    stream_threshold_section(target, limit, rounds)
    client.close()
    echo_channel.close()


def stream_threshold_section(target: str, limit: int, rounds: int) -> None:
    """(d) where streaming starts to pay: one op's tensor inline vs by stream, by size."""
    wire = {"max_message_bytes": limit, "shared_memory": False}
    inline = gradserve.Client(target, stream_threshold=limit, **wire)
    streamed = gradserve.Client(target, stream_threshold=1, **wire)
    clients = {"inline": inline, "streamed": streamed}
    print(
        "\n(d) StopGradient, one tensor inline in the op's messages vs by PutTensor/GetTensor "
        f"streams (default threshold: {protocol.DEFAULT_STREAM_THRESHOLD_BYTES >> 10} KiB)"
    )
    for kib in SIZES_KIB:
        array = np.ones(kib * 256, np.float32)
        refs = {name: c.put(array) for name, c in clients.items()}
        out = interleaved(
            {
                n: (lambda c=c, r=refs[n]: c.raw_ops.StopGradient(input=r))
                for n, c in clients.items()
            },
            rounds,
            5,
        )
        both = interleaved(
            {n: (lambda c=c, a=array: c.raw_ops.StopGradient(input=a)) for n, c in clients.items()},
            rounds,
            5,
        )
        print(
            f"    {kib:6d} KiB  result only: inline {out['inline'] * 1e3:7.2f} ms, streamed "
            f"{out['streamed'] * 1e3:7.2f} ms ({out['inline'] / out['streamed']:.2f}x) | both "
            f"ways: inline {both['inline'] * 1e3:7.2f} ms, streamed {both['streamed'] * 1e3:7.2f} "
            f"ms ({both['inline'] / both['streamed']:.2f}x)"
        )
    inline.close()
    streamed.close()


if __name__ == "__main__":
    main()
