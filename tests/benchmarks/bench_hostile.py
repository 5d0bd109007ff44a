"""Hostile-client benchmark (``make bench``): figures, with targets marked PASS/MISS.

Each section runs a server in its own process (``tests.server_process``) with clients
on loopback, every loop bounded in count and time:

1. stalls: stalled uploads and stalled readers at once (a ``grpc.aio`` client on an
   asyncio loop in one background thread, not a thread per stream); while they stall
   a well-behaved client times health checks and small ops (StopGradient of 3 floats);
   then how the stalled streams end (DEADLINE_EXCEEDED by ``--stream-idle-timeout``)
   and the bytes held afterwards;
2. lstm: clients looping ~0.1 s BlockLSTMV2 calls; a separate client times small
   ops and health checks;
3. principals: Alice's stalled 1 GiB upload under a 1 GiB server budget: does Bob's
   1 KiB put succeed, and what does Alice hold against her quota;
4. readers: stalled ``delete_after`` readers of 48 MiB tensors under a 64 MiB
   budget: puts refused past the budget, server RSS against the budget;
5. sigterm: SIGTERM under 32 clients (SDK, retries=0): calls cancelled, wrong,
   refused, ok; exit code and time to exit;
6. churn: sessions opened and closed (a put and a TensorArray write each): server
   RSS baseline, peak, after;
7. fairness: with a token file of three principals, b's small TensorArray writes
   alone and while a floods the light lane (32 threads of 64 MiB gathers), and b's
   refusals while a and c flood LSTM calls past ``--max-concurrent-rpcs``;
8. replies: another session's KeepAlive while a client pulls large gathers with
   its inline limit raised, on a server with the default ``--max-inline-reply-bytes``
   (the outputs come as transient tensors, streamed) and one with ``none`` (one
   reply each), in alternating windows.

``python -m tests.benchmarks.bench_hostile [--quick] [--only stalls,sigterm,...]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import re
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

import gradserve
from gradserve import protocol
from gradserve.client._errors import DROPPED
from gradserve.errors import GradserveError
from gradserve.v1 import service_pb2, service_pb2_grpc, tensor_pb2
from tests.server_process import ServerProcess

MIB = 1 << 20
GIB = 1 << 30
SUMMARY: list[str] = []


# ------------------------------------------------------------------ helpers
def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def ms(values: list[float]) -> str:
    return f"p50 {pct(values, 50) * 1e3:.2f} ms, p99 {pct(values, 99) * 1e3:.2f} ms"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def summarize(section: str, text: str, ok: bool) -> None:
    line = f"{section}: {text} -> {verdict(ok)}"
    SUMMARY.append(line)
    print(f"  => {line}", flush=True)


def rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (VmRSS), 0 once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class RssSampler:
    """The peak RSS of a process, sampled every ``period`` seconds in a thread."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        self.pid = pid
        self.peak = rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, rss(self.pid))
        return self.peak


def labelled(server: ServerProcess, name: str, **labels: str) -> float:
    """A labelled sample of the server's metrics (0 when absent)."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
        text = r.read().decode()
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    return 0.0


def rpc_codes(server: ServerProcess, method: str) -> dict[str, int]:
    """The server's count of ``method`` calls by status code (gradserve_rpcs_total)."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
        text = r.read().decode()
    codes: dict[str, int] = {}
    for match in re.finditer(r"^gradserve_rpcs_total\{([^}]*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if labels.get("method") == method and float(match.group(2)):
            codes[labels.get("code", "?")] = int(float(match.group(2)))
    return codes


def wait_until(predicate: Callable[[], bool], timeout: float, period: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


def session_md(session_id: str, token: str | None = None) -> tuple[tuple[str, str], ...]:
    md: tuple[tuple[str, str], ...] = ((protocol.SESSION_METADATA_KEY, session_id),)
    if token:
        md += (("authorization", f"Bearer {token}"),)
    return md


def baseline_rss(server: ServerProcess) -> int:
    """RSS of the idle server after one session has done a little of everything."""
    with gradserve.Client(server.target, timeout=30) as c:
        c.health()
        c.stop_gradient(np.ones(3, np.float32))
        c.tensor_array(np.float32, size=1).write(0, np.ones(3, np.float32)).close()
        c.delete(c.put(np.ones(1024, np.float32)))
    time.sleep(0.5)
    return rss(server.proc.pid)


@contextlib.contextmanager
def server_process(*flags: str) -> Iterator[ServerProcess]:
    server = ServerProcess(*flags)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(30)
            except Exception:  # noqa: BLE001 - a benchmark never leaves a server behind
                server.proc.kill()
                server.proc.wait(10)


# ------------------------------------------------------------------ stalled streams (aio)
@dataclasses.dataclass
class Stalled:
    kind: str
    stalled_at: float | None = None  # when the stall began (first chunk sent / read)
    ended_at: float | None = None
    code: str | None = None  # as the client saw it (readers: only once cancelled)


class StallClient:
    """Stalled streams on ``grpc.aio`` channels, all on one asyncio loop in one
    background thread: a stalled stream costs the bench a coroutine, not a thread."""

    def __init__(self, target: str, channels: int = 4, deadline: float = 120.0) -> None:
        self.deadline = deadline
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._release: asyncio.Event | None = None
        self._calls: list[Any] = []
        self._tasks: list[asyncio.Future[Any]] = []

        async def start() -> list[Any]:
            self._release = asyncio.Event()
            options = protocol.channel_options()
            return [grpc.aio.insecure_channel(target, options=options) for _ in range(channels)]

        self.channels = self.run(start())
        self.stubs = [service_pb2_grpc.GradServeStub(ch) for ch in self.channels]

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def upload(self, md: Any, nbytes: int, n: int = 1) -> list[Stalled]:
        """``n`` PutTensor streams that send one chunk declaring ``nbytes``, then stall."""
        records = [Stalled("upload") for _ in range(n)]
        for k, rec in enumerate(records):
            self._spawn(self._upload(self.stubs[k % len(self.stubs)], md, nbytes, rec))
        return records

    def read(
        self, md: Any, tensor_id: str, n: int = 1, delete_after: bool = False
    ) -> list[Stalled]:
        """``n`` GetTensor streams that read one 1 MiB chunk, then stop reading."""
        records = [Stalled("reader") for _ in range(n)]
        for k, rec in enumerate(records):
            stub = self.stubs[k % len(self.stubs)]
            self._spawn(self._read(stub, md, tensor_id, delete_after, rec))
        return records

    async def _upload(self, stub: Any, md: Any, nbytes: int, rec: Stalled) -> None:
        release = self._release

        async def chunks():
            yield tensor_pb2.TensorChunk(
                dtype=tensor_pb2.DT_UINT8, shape=[nbytes], data=bytes(1024)
            )
            rec.stalled_at = time.monotonic()  # asked for the next chunk: the first is out
            await release.wait()

        try:
            await stub.PutTensor(chunks(), metadata=md, timeout=self.deadline)
            rec.code = "OK"
        except grpc.aio.AioRpcError as e:
            rec.code = e.code().name
        rec.ended_at = time.monotonic()

    async def _read(self, stub: Any, md: Any, tensor_id: str, delete_after: bool, rec) -> None:
        request = service_pb2.GetTensorRequest(
            id=tensor_id, chunk_bytes=MIB, delete_after=delete_after
        )
        call = stub.GetTensor(request, metadata=md, timeout=self.deadline)
        self._calls.append(call)
        try:
            await call.read()
            rec.stalled_at = time.monotonic()
            # Read no more, and do not await the status either: grpc.aio then keeps
            # receiving (and buffering) the whole stream. A reader that stalls does not
            # see the server end its stream: the server's metrics say when.
            await self._release.wait()
        except grpc.aio.AioRpcError as e:
            rec.code = e.code().name
        except asyncio.CancelledError:
            rec.code = "CANCELLED"
        rec.ended_at = time.monotonic()

    def close(self) -> None:
        async def stop() -> None:
            self._release.set()
            for call in self._calls:
                call.cancel()
            await asyncio.sleep(0.2)
            for ch in self.channels:
                await ch.close(grace=None)

        with contextlib.suppress(Exception):
            self.run(stop(), timeout=30)
        for task in self._tasks:
            with contextlib.suppress(Exception):
                task.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


# ------------------------------------------------------------------ 1. stalls
def timed_calls(
    client: gradserve.Client, n: int, max_seconds: float = 30.0
) -> tuple[list[float], list[float], int]:
    """``n`` health checks and ``n`` StopGradient calls, interleaved (for at most
    ``max_seconds``): their latencies and how many calls failed or were wrong."""
    health, small, bad = [], [], 0
    x = np.array([1.0, 2.0, 3.0], np.float32)
    end = time.monotonic() + max_seconds
    for _ in range(n):
        if time.monotonic() > end:
            break
        t0 = time.perf_counter()
        try:
            ok = client.health() == "SERVING"
        except GradserveError:
            ok = False
        health.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        try:
            ok = ok and client.stop_gradient(x).tobytes() == x.tobytes()
        except GradserveError:
            ok = False
        small.append(time.perf_counter() - t0)
        bad += not ok
    return health, small, bad


def bench_stalls(args: argparse.Namespace) -> None:
    idle = args.idle_timeout
    n_up, n_rd, n_calls = args.stalled_uploads, args.stalled_readers, args.calls
    print(
        f"\n[1] {n_up} stalled uploads + {n_rd} stalled readers, server "
        f"--stream-idle-timeout {idle:g} --max-concurrent-rpcs {args.max_calls}"
    )
    flags = ["--stream-idle-timeout", str(idle), "--max-concurrent-rpcs", str(args.max_calls)]
    with server_process(*flags) as server, gradserve.Client(server.target, timeout=30) as good:
        base = baseline_rss(server)
        big = good.put(np.zeros(64 * MIB, np.uint8))  # more than the HTTP/2 windows buffer
        md = session_md(good.session_id)
        stalls = StallClient(server.target, deadline=idle + 60)
        try:
            before = {m: rpc_codes(server, m) for m in ("PutTensor", "GetTensor")}
            t_start = time.monotonic()
            uploads = stalls.upload(md, 4 * MIB, n_up)
            readers = stalls.read(md, big.id, n_rd)
            want_held = 64 * MIB + 4 * MIB * n_up
            started = wait_until(
                lambda: (
                    all(r.stalled_at for r in uploads + readers)
                    and server.metric("gradserve_bytes_held") >= want_held
                ),
                idle / 2,
            )
            setup = time.monotonic() - t_start
            n_stalled = sum(r.stalled_at is not None for r in uploads + readers)
            held_stalled = server.metric("gradserve_bytes_held")
            rss_stalled = rss(server.proc.pid)
            print(
                f"  {n_stalled}/{n_up + n_rd} streams stalled after {setup:.2f} s "
                f"({'all' if started else 'NOT all'}); bytes held {held_stalled / MIB:.0f} MiB "
                f"(64 MiB tensor + {n_up} x 4 MiB reserved); server RSS "
                f"{rss_stalled / MIB:.0f} MiB (idle: {base / MIB:.0f} MiB)"
            )
            t0 = time.monotonic()
            health, small, bad = timed_calls(good, n_calls)
            during = time.monotonic() - t0
            still = sum(r.ended_at is None for r in uploads)
            print(
                f"  while stalled ({during:.2f} s, {still}/{n_up} uploads still stalled at "
                f"the end): health {ms(health)}; StopGradient(3 floats) {ms(small)}; "
                f"{bad} failed or wrong"
            )
            # How the stalls end: uploads as the client sees them; readers by the
            # server's count (a reader that reads no more does not see its status).
            first_stall = min(r.stalled_at for r in uploads + readers if r.stalled_at)
            rd_done_at = None

            def readers_ended() -> bool:
                nonlocal rd_done_at
                ended = sum(rpc_codes(server, "GetTensor").values())
                if rd_done_at is None and ended >= n_rd + sum(before["GetTensor"].values()):
                    rd_done_at = time.monotonic()
                return rd_done_at is not None and all(r.ended_at for r in uploads)

            wait_until(readers_ended, idle + 20, period=0.1)
            up_codes = collections.Counter(r.code for r in uploads)
            late = [
                r.ended_at - r.stalled_at - idle
                for r in uploads
                if r.code == "DEADLINE_EXCEEDED" and r.stalled_at and r.ended_at
            ]
            server_up, server_rd = (
                {
                    k: v - before[m].get(k, 0)
                    for k, v in rpc_codes(server, m).items()
                    if v > before[m].get(k, 0)
                }
                for m in ("PutTensor", "GetTensor")
            )
            print(
                f"  uploads ended (client side): {dict(up_codes)}; DEADLINE_EXCEEDED "
                f"{late and f'{min(late):+.2f}..{max(late):+.2f} s' or 'n/a'} after "
                f"stall + {idle:g} s (p50 {pct(late, 50):+.2f} s)"
            )
            last_stall = max((r.stalled_at for r in readers if r.stalled_at), default=first_stall)
            last_rd = (rd_done_at - last_stall - idle) if rd_done_at else float("nan")
            print(
                f"  server's counts: PutTensor {server_up}, GetTensor {server_rd} (the last "
                f"reader ended {last_rd:+.2f} s after the last reader's stall + {idle:g} s; "
                f"polled every 0.1 s)"
            )
            held_after = server.wait_for("gradserve_bytes_held", 64 * MIB, 10)
            good.delete(big)
            held_zero = server.wait_for("gradserve_bytes_held", 0, 10)
            print(
                f"  bytes held after the stalls ended: {held_after / MIB:.2f} MiB (the put "
                f"tensor); after deleting it: {held_zero:.0f}"
            )
        finally:
            stalls.close()
    ended = up_codes.get("DEADLINE_EXCEEDED", 0) + server_rd.get("DEADLINE_EXCEEDED", 0)
    late_max = max(late + [last_rd]) if late else float("nan")
    summarize(
        "stalls",
        f"{n_up}+{n_rd} stalled: health p99 {pct(health, 99) * 1e3:.1f} ms (<50), small op "
        f"p99 {pct(small, 99) * 1e3:.1f} ms (<20), {bad} bad calls, {ended}/{n_up + n_rd} "
        f"ended DEADLINE_EXCEEDED at most {late_max:+.2f} s past the idle timeout, held "
        f"after {held_after / MIB:.0f} MiB then {held_zero:.0f}",
        pct(health, 99) < 0.050
        and pct(small, 99) < 0.020
        and bad == 0
        and ended == n_up + n_rd
        and held_after == 64 * MIB
        and held_zero == 0,
    )


# ------------------------------------------------------------------ 2. LSTM load
def lstm_inputs(steps: int, batch: int = 4, units: int = 8) -> list[Any]:
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    u = units
    return [np.int64(steps), r(steps, batch, u), r(batch, u), r(batch, u), r(2 * u, 4 * u)] + [
        r(u),
        r(u),
        r(u),
        r(4 * u),
    ]


def bench_lstm(args: argparse.Namespace) -> None:
    n_clients, n_calls = args.lstm_clients, args.calls
    print(f"\n[2] {n_clients} clients looping BlockLSTMV2 (default --compute-slots)")
    with server_process() as server:
        with gradserve.Client(server.target, timeout=60) as c:

            def median_call(inputs: list[Any]) -> float:
                c.raw_ops.BlockLSTMV2(*inputs)
                took = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    c.raw_ops.BlockLSTMV2(*inputs)
                    took.append(time.perf_counter() - t0)
                return float(np.median(took))

            steps = args.lstm_steps
            if steps is None:  # calibrate: T for a call of --lstm-seconds on this machine
                probe = median_call(lstm_inputs(1000))
                steps = int(min(20_000, max(100, round(1000 * args.lstm_seconds / probe))))
            inputs = lstm_inputs(steps)
            alone = median_call(inputs)
        print(f"  one call alone: {alone * 1e3:.0f} ms (T={steps}, B=4, units=8)")
        stop = threading.Event()
        deadline = time.monotonic() + 120
        done, errors = [0], collections.Counter()
        lock = threading.Lock()
        ready = threading.Barrier(n_clients + 1, timeout=60)

        def loop() -> None:
            with gradserve.Client(server.target, timeout=120) as c:
                with contextlib.suppress(threading.BrokenBarrierError):
                    ready.wait()
                while not stop.is_set() and time.monotonic() < deadline:
                    try:
                        c.raw_ops.BlockLSTMV2(*inputs)
                        with lock:
                            done[0] += 1
                    except GradserveError as e:
                        with lock:
                            errors[e.code.name] += 1

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(n_clients)]
        for t in threads:
            t.start()
        try:
            ready.wait()
            time.sleep(1.0)  # the compute queue fills
            with gradserve.Client(server.target, timeout=30) as c:
                t0 = time.monotonic()
                done0 = done[0]
                health, small, bad = timed_calls(c, n_calls)
                during = time.monotonic() - t0
                lstm_rate = (done[0] - done0) / during
        finally:
            stop.set()
            for t in threads:
                t.join(60)
    print(
        f"  during {during:.2f} s: {lstm_rate:.1f} LSTM calls/s; health {ms(health)}; "
        f"StopGradient {ms(small)}; {bad} bad calls; LSTM errors {dict(errors)}"
    )
    summarize(
        "lstm",
        f"{n_clients} LSTM loops: small op p99 {pct(small, 99) * 1e3:.1f} ms (<50), health "
        f"p99 {pct(health, 99) * 1e3:.1f} ms (<50)",
        pct(small, 99) < 0.050 and pct(health, 99) < 0.050 and bad == 0,
    )


# ------------------------------------------------------------------ 3. principals
def bench_principals(args: argparse.Namespace) -> None:
    budget = GIB
    quota = budget // 2  # --max-principal-bytes default: half of --max-server-bytes
    print(f"\n[3] Alice's stalled 1 GiB upload, --max-server-bytes {budget} (quota {quota})")
    with tempfile.TemporaryDirectory() as tmp:
        tokens = os.path.join(tmp, "tokens")
        with open(tokens, "w") as fh:
            fh.write("alice:token-alice\nbob:token-bob\n")
        flags = ["--token-file", tokens, "--max-server-bytes", str(budget)]
        with (
            server_process(*flags) as server,
            gradserve.Client(server.target, token="token-alice", timeout=30) as alice,
            gradserve.Client(server.target, token="token-bob", timeout=30) as bob,
        ):
            md = session_md(alice.session_id, "token-alice")
            stalls = StallClient(server.target, channels=1, deadline=60)
            try:
                (greedy,) = stalls.upload(md, GIB)
                wait_until(lambda: greedy.ended_at is not None or greedy.stalled_at, 5)
                time.sleep(0.3)
                held_greedy = server.metric("gradserve_bytes_held")
                wait_until(lambda: greedy.ended_at is not None, 3)
                print(
                    f"  1 GiB upload: {greedy.code or 'still stalled'}; Alice holds "
                    f"{held_greedy / MIB:.0f} MiB"
                )
                within = quota - MIB  # what she may reserve: stalls within her quota
                (stalled,) = stalls.upload(md, within)
                wait_until(lambda: server.metric("gradserve_bytes_held") >= within, 5)
                held_alice = server.metric("gradserve_bytes_held")
                print(
                    f"  then a {within / MIB:.0f} MiB upload that stalls: "
                    f"{stalled.code or 'stalled'}; Alice holds {held_alice / MIB:.0f} MiB "
                    f"of her {quota / MIB:.0f} MiB quota"
                )
                outcomes = {}
                for who, client, nbytes in (
                    ("Bob 1 KiB", bob, 1024),
                    ("Bob 64 MiB", bob, 64 * MIB),
                    ("Alice 4 MiB more", alice, 4 * MIB),
                ):
                    t0 = time.perf_counter()
                    try:
                        client.put(np.ones(nbytes, np.uint8))
                        outcomes[who] = "OK"
                    except GradserveError as e:
                        outcomes[who] = f"{e.code.name} ({e.message[:70]})"
                    print(f"  put {who}: {outcomes[who]} in {time.perf_counter() - t0:.3f} s")
                alice.close()  # closing her session ends her stream and frees its bytes
                wait_until(lambda: stalled.ended_at is not None, 5)
                held_end = server.wait_for("gradserve_bytes_held", 1024 + 64 * MIB, 5)
                print(
                    f"  Alice closes her session: her stalled upload {stalled.code}; bytes "
                    f"held {held_end / MIB:.2f} MiB (Bob's)"
                )
            finally:
                stalls.close()
    summarize(
        "principals",
        f"Alice (quota {quota / MIB:.0f} MiB): 1 GiB upload {greedy.code}, holds "
        f"{held_alice / MIB:.0f} MiB <= quota; Bob's 1 KiB put {outcomes['Bob 1 KiB']}",
        outcomes["Bob 1 KiB"] == "OK" and held_alice <= quota and greedy.code != "OK",
    )


# ------------------------------------------------------------------ 4. delete_after readers
def bench_readers(args: argparse.Namespace) -> None:
    budget, size, n = 64 * MIB, 48 * MIB, args.readers
    print(
        f"\n[4] {n} stalled delete_after readers of 48 MiB tensors, --max-server-bytes "
        f"{budget} --max-principal-bytes none --stream-idle-timeout {args.reader_idle:g}"
    )
    flags = ["--max-server-bytes", str(budget), "--max-principal-bytes", "none"]
    flags += ["--stream-idle-timeout", str(args.reader_idle)]
    with server_process(*flags) as server:
        base = baseline_rss(server)
        sampler = RssSampler(server.proc.pid)
        stalls = StallClient(server.target, channels=2, deadline=60)
        clients = [gradserve.Client(server.target, timeout=30) for _ in range(n)]
        readers: list[Stalled] = []
        refused, accepted, other = 0, 0, collections.Counter()
        first = 0
        try:
            for c in clients:
                try:
                    ref = c.put(np.full(size, 7, np.uint8))
                except GradserveError as e:
                    if e.code.name == "RESOURCE_EXHAUSTED":
                        refused += 1
                    else:
                        other[e.code.name] += 1
                    continue
                accepted += 1
                (reader,) = stalls.read(session_md(c.session_id), ref.id, delete_after=True)
                readers.append(reader)
                wait_until(lambda r=reader: r.stalled_at is not None, 10)
                if accepted == 1:
                    time.sleep(0.3)
                    first = rss(server.proc.pid)
            held = server.metric("gradserve_bytes_held")
            time.sleep(0.3)
            refused_rss = rss(server.proc.pid)
            peak = sampler.stop()
            print(
                f"  puts: {accepted} accepted (each then read by a stalled delete_after "
                f"reader), {refused} refused RESOURCE_EXHAUSTED, other {dict(other)}; bytes "
                f"held {held / MIB:.0f} MiB"
            )
            ended = wait_until(
                lambda: (
                    labelled(
                        server, "gradserve_rpcs_total", method="GetTensor", code="DEADLINE_EXCEEDED"
                    )
                    >= accepted
                ),
                args.reader_idle + 10,
            )
            held_idle = server.metric("gradserve_bytes_held")
        finally:
            for c in clients:
                c.close()
            stalls.close()
        held_closed = server.wait_for("gradserve_bytes_held", 0, 10)
        time.sleep(1.0)
        after = rss(server.proc.pid)
    limit = base + 1.1 * budget
    print(
        f"  readers {'ended' if ended else 'did NOT all end'} DEADLINE_EXCEEDED by the idle "
        f"timeout (the tensors stay: not all sent): bytes held {held_idle / MIB:.0f} MiB; "
        f"once the sessions closed: {held_closed:.0f}"
    )
    print(
        f"  server RSS: baseline {base / MIB:.1f} MiB, peak {peak / MIB:.1f} MiB (+"
        f"{(peak - base) / MIB:.1f} MiB); with the first reader stalled {first / MIB:.1f} MiB, "
        f"after the refused puts {refused_rss / MIB:.1f} MiB, after the sessions closed "
        f"{after / MIB:.1f} MiB; target peak <= "
        f"baseline + 1.1 x budget = {limit / MIB:.1f} MiB"
    )
    summarize(
        "readers",
        f"{n} delete_after readers of 48 MiB, 64 MiB budget: {refused} puts refused, RSS "
        f"baseline {base / MIB:.0f} MiB peak {peak / MIB:.0f} MiB (<= {limit / MIB:.0f})",
        peak <= limit and refused == n - accepted and accepted >= 1 and held <= budget,
    )


# ------------------------------------------------------------------ 5. SIGTERM
def sigterm_run(n_clients: int, warm: float) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    server = ServerProcess("--grace", "10")
    ready = threading.Barrier(n_clients + 1, timeout=60)
    stop_at = [time.monotonic() + 60.0]  # bounded even if the server never exits
    sigterm_at = [float("inf")]

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        mine: collections.Counter[str] = collections.Counter()

        def call(fn: Callable[[], bool]) -> bool:
            began = time.monotonic()
            try:
                mine["ok" if fn() else "wrong"] += 1
                return True
            except GradserveError as e:
                name = e.code.name
                if e.message.startswith(DROPPED):
                    name = "CANCELLED"  # the SDK reports it as UNAVAILABLE; count it apart
                elif name == "UNAVAILABLE":
                    draining = "shutting down" in e.message
                    name += " (draining)" if draining else " (connection)"
                mine[name] += 1
                if name == "CANCELLED":  # was it in flight at SIGTERM, or sent after it?
                    mine[f"CANCELLED details '{e.message[:60]}'"] += 1
                    mine[
                        "CANCELLED sent before SIGTERM"
                        if began < sigterm_at[0]
                        else "CANCELLED sent after SIGTERM"
                    ] += 1
                return False

        try:
            c = gradserve.Client(server.target, timeout=30, retries=0, keepalive=False)
        except GradserveError as e:
            mine[f"create {e.code.name}"] += 1
            c = None
        try:
            with contextlib.suppress(threading.BrokenBarrierError):
                ready.wait()
            if c is not None:
                ta = c.tensor_array(np.float32, size=0, dynamic_size=True, clear_after_read=False)
                i = 0
                while time.monotonic() < stop_at[0]:
                    v = rng.standard_normal(16).astype(np.float32)
                    if i % 2 == 0:
                        alive = call(lambda v=v: c.stop_gradient(v).tobytes() == v.tobytes())
                    else:
                        alive = call(lambda v=v, i=i: ta.write(i, v) is ta) and call(
                            lambda v=v, i=i: ta.read(i).tobytes() == v.tobytes()
                        )
                    i += 1
                    if not alive:
                        break  # the server is going away: no call after a refusal
        except GradserveError as e:  # the TensorArray itself
            mine[f"setup {e.code.name}"] += 1
        finally:
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()
            with lock:
                counts.update(mine)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(n_clients)]
    for t in threads:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass
    time.sleep(warm)
    t0 = sigterm_at[0] = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(30)
    except Exception:  # noqa: BLE001
        server.proc.kill()
        code = server.proc.wait(10)
    took = time.monotonic() - t0
    stop_at[0] = time.monotonic() + 2.0  # clients that have not seen the end stop
    for t in threads:
        t.join(30)
    return {"counts": counts, "code": code, "took": took}


def bench_sigterm(args: argparse.Namespace) -> None:
    print(f"\n[5] SIGTERM under {args.sigterm_clients} clients, --grace 10, {args.runs} runs")
    total: collections.Counter[str] = collections.Counter()
    codes, took = [], []
    for run in range(args.runs):
        r = sigterm_run(args.sigterm_clients, args.sigterm_warm)
        total.update(r["counts"])
        codes.append(r["code"])
        took.append(r["took"])
        if args.verbose:
            print(f"  run {run}: exit {r['code']} in {r['took']:.2f} s: {dict(r['counts'])}")
    cancelled = total.get("CANCELLED", 0)
    wrong = total.get("wrong", 0)
    unavailable = sum(v for k, v in total.items() if k.startswith("UNAVAILABLE"))
    other = {
        k: v
        for k, v in total.items()
        if k not in ("ok", "wrong") and not k.startswith(("UNAVAILABLE", "CANCELLED"))
    }
    split = {k[10:]: v for k, v in total.items() if k.startswith("CANCELLED ")}
    print(
        f"  calls over {args.runs} runs: ok {total.get('ok', 0)}, CANCELLED {cancelled} "
        f"{split or ''}, "
        f"wrong {wrong}, UNAVAILABLE {unavailable} "
        f"({ {k: v for k, v in total.items() if k.startswith('UNAVAILABLE')} }), other {other}"
    )
    print(
        f"  exit codes {dict(collections.Counter(codes))}; time to exit after SIGTERM "
        f"median {np.median(took):.2f} s, max {max(took):.2f} s"
    )
    summarize(
        "sigterm",
        f"{args.runs} runs x {args.sigterm_clients} clients: {cancelled} CANCELLED (0), "
        f"{wrong} wrong (0), {unavailable} refused UNAVAILABLE, {total.get('ok', 0)} ok, "
        f"exit codes {sorted(set(codes))} (0), exit in <= {max(took):.2f} s",
        cancelled == 0 and wrong == 0 and not other and set(codes) == {0},
    )


# ------------------------------------------------------------------ 6. session churn
def bench_churn(args: argparse.Namespace) -> None:
    n, n_threads = args.sessions, 4
    print(f"\n[6] {n} sessions opened and closed ({n_threads} threads), each a 100 KiB put")
    with server_process() as server:
        base = baseline_rss(server)
        sampler = RssSampler(server.proc.pid, period=0.05)
        errors: collections.Counter[str] = collections.Counter()
        done = [0]
        lock = threading.Lock()
        deadline = time.monotonic() + 300
        tensor = np.random.default_rng(0).standard_normal(25_600).astype(np.float32)  # 100 KiB
        value = np.arange(16, dtype=np.float32)

        def worker(count: int) -> None:
            options = protocol.channel_options()
            with grpc.insecure_channel(server.target, options=options) as channel:
                for _ in range(count):
                    if time.monotonic() > deadline:
                        return
                    try:
                        with gradserve.Client(
                            server.target, channel=channel, timeout=30, keepalive=False
                        ) as c:
                            c.put(tensor)
                            c.tensor_array(np.float32, size=1).write(0, value)
                        with lock:
                            done[0] += 1
                    except GradserveError as e:
                        with lock:
                            errors[e.code.name] += 1

        t0 = time.monotonic()
        shares = [n // n_threads + (k < n % n_threads) for k in range(n_threads)]
        threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in shares]
        for t in threads:
            t.start()
        for t in threads:
            t.join(320)
        took = time.monotonic() - t0
        peak = sampler.stop()
        sessions = server.wait_for("gradserve_sessions_open", 0, 10)
        held = server.wait_for("gradserve_bytes_held", 0, 10)
        time.sleep(2.0)
        after = rss(server.proc.pid)
    print(
        f"  {done[0]} sessions in {took:.1f} s ({done[0] / took:.0f}/s), errors "
        f"{dict(errors)}; then {sessions:.0f} sessions open, {held:.0f} bytes held"
    )
    print(
        f"  server RSS: baseline {base / MIB:.1f} MiB, peak {peak / MIB:.1f} MiB, after "
        f"{after / MIB:.1f} MiB ({(after / base - 1) * 100:+.1f}% of baseline)"
    )
    summarize(
        "churn",
        f"{done[0]} sessions: RSS baseline {base / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB, "
        f"after {after / MIB:.0f} MiB ({(after / base - 1) * 100:+.0f}%, target <= +20%)",
        after <= 1.2 * base and done[0] == n and sessions == 0 and held == 0,
    )


# ------------------------------------------------------------------ 7. fairness
def _small_ops(target: str, token: str, seconds: float) -> tuple[list[float], collections.Counter]:
    """A tenant's 4-float TensorArray writes, one at a time for ``seconds``: their
    latencies and refusals (a session of its own, made once the server lets it)."""
    latencies: list[float] = []
    refused: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + seconds
    client = ta = None
    n = 0
    while time.monotonic() < end:
        try:
            if client is None:
                client = gradserve.Client(
                    target, token=token, retries=0, keepalive=False, shared_memory=False
                )
                ta = client.tensor_array(np.float32, size=1 << 20, dynamic_size=True)
            t0 = time.perf_counter()
            ta.write(n, np.ones(4, np.float32))
            latencies.append(time.perf_counter() - t0)
            n += 1
        except GradserveError as e:
            refused[e.reason or e.code.name] += 1
            time.sleep(0.01)
    if client is not None:
        client.close()
    return latencies, refused


def _flood(target: str, token: str, threads: int, op: Callable[[Any], Any]) -> Callable[[], None]:
    """``threads`` clients of one tenant calling ``op(client)()`` in a loop (refusals
    ignored) until the returned stop function is called. Returns once each has made
    its call (or after a minute): the setup's uploads are not what is measured."""
    stop = threading.Event()
    ready = threading.Semaphore(0)

    def loop() -> None:
        client = call = None
        while not stop.is_set():
            try:
                if client is None:
                    client = gradserve.Client(
                        target, token=token, retries=0, keepalive=False, shared_memory=False
                    )
                if call is None:
                    call = op(client)
                    ready.release()
                call()
            except GradserveError:
                time.sleep(0.001)
        if client is not None:
            with contextlib.suppress(GradserveError):
                client.close()

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 60
    for _ in workers:
        ready.acquire(timeout=max(0.0, deadline - time.monotonic()))

    def stop_all() -> None:
        stop.set()
        for w in workers:
            w.join(60)

    return stop_all


def bench_fairness(args: argparse.Namespace) -> None:
    seconds = 3.0 if args.quick else 6.0
    print(f"\n[7] fairness between principals (token file: a, b, c), {seconds:g} s windows")
    with tempfile.TemporaryDirectory() as tmp:
        tokens = os.path.join(tmp, "tokens")
        with open(tokens, "w") as fh:
            fh.write("a:token-a\nb:token-b\nc:token-c\n")

        def gathers(client: Any) -> Callable[[], None]:  # 64 MiB gathered per call
            big = client.tensor_array(np.float32, size=64, clear_after_read=False)
            big.unstack(np.ones((64, 1 << 18), np.float32))
            indices = np.arange(64)
            return lambda: client.delete(
                client.raw_ops.TensorArrayGatherV3(big.handle, indices, 0.0, np.float32, keep=True)
            )

        with server_process("--token-file", tokens) as server:
            alone, _ = _small_ops(server.target, "token-b", seconds)
            stop = _flood(server.target, "token-a", 32, gathers)
            time.sleep(1.0)
            flooded, refused_light = _small_ops(server.target, "token-b", seconds)
            stop()
        light_ratio = float(np.median(flooded) / np.median(alone))
        print(
            f"  b's 4-float TensorArray write: {ms(alone)} alone, {ms(flooded)} while "
            f"a runs 32 threads of 64 MiB gathers ({light_ratio:.1f}x); refused "
            f"{dict(refused_light)}"
        )

        def lstm_calls(client: Any) -> Callable[[], None]:
            inputs = lstm_inputs(400, batch=8, units=64)
            return lambda: client.raw_ops.BlockLSTMV2(*inputs)

        flags = ["--token-file", tokens, "--max-concurrent-rpcs", "16", "--compute-slots", "1"]
        with server_process(*flags) as server:
            stops = [_flood(server.target, f"token-{p}", 12, lstm_calls) for p in "ac"]
            time.sleep(1.0)
            served, refused_slots = _small_ops(server.target, "token-b", seconds)
            for stop in stops:
                stop()
        print(
            f"  b's small calls while a and c flood LSTM calls (12 threads each, "
            f"--max-concurrent-rpcs 16): {len(served)} served, refused {dict(refused_slots)}"
        )
        short_waits, pauses = _short_lstm_beside_long(tokens, args)
    summarize(
        "fairness",
        f"b's small op {light_ratio:.1f}x slower under a's light flood (target <= 10x); "
        f"{sum(refused_slots.values())} refusals of b under a's and c's LSTM flood (target 0); "
        f"b's short LSTM beside a's long ones {np.median(short_waits) * 1e3:.0f} ms median "
        f"(target <= 100 ms, --compute-quantum 0.05)",
        light_ratio <= 10
        and not refused_slots
        and not refused_light
        and bool(served)
        and float(np.median(short_waits)) <= 0.100
        and pauses > 0,
    )


def _short_lstm_beside_long(tokens: str, args: argparse.Namespace) -> tuple[list[float], float]:
    """b's short LSTM call while a loops long ones on the only compute slot, on two
    servers at once, b's calls alternating between them: one with ``--compute-quantum
    off`` (an op keeps the slot until it ends) and one with the default (the long op
    pauses for b's). Returns the latter's latencies and its pauses."""
    long_steps, rounds = (20_000, 8) if args.quick else (60_000, 16)
    short = lstm_inputs(10)

    def long_lstms(client: Any) -> Callable[[], None]:
        inputs = lstm_inputs(long_steps)
        return lambda: client.raw_ops.BlockLSTMV2(*inputs)

    flags = ["--token-file", tokens, "--compute-slots", "1"]
    with (
        server_process(*flags, "--compute-quantum", "off") as keeps,
        server_process(*flags) as lends,
    ):
        stops = [_flood(server.target, "token-a", 1, long_lstms) for server in (keeps, lends)]
        waits: dict[str, list[float]] = {"off": [], "0.05": []}
        try:
            clients = {
                key: gradserve.Client(server.target, token="token-b", timeout=120)
                for key, server in (("off", keeps), ("0.05", lends))
            }
            for _ in range(rounds):
                for key, client in clients.items():
                    t0 = time.perf_counter()
                    client.raw_ops.BlockLSTMV2(*short)
                    waits[key].append(time.perf_counter() - t0)
                    time.sleep(0.05)
            for client in clients.values():
                client.close()
            pauses = lends.metric("gradserve_compute_pauses_total")
        finally:
            for stop in stops:
                stop()
    before, after = waits["off"], waits["0.05"]
    print(
        f"  b's LSTM (T=10) while a loops LSTMs of T={long_steps} on the one compute slot, "
        f"{rounds} calls to each server, alternating: --compute-quantum off {ms(before)}; "
        f"0.05 (default) {ms(after)}: median {np.median(before) / np.median(after):.0f}x "
        f"shorter; {pauses:.0f} pauses of a's ops"
    )
    return after, pauses


# ------------------------------------------------------------------ 8. large replies
def _pull(target: str, nbytes: int, threads: int) -> tuple[Callable[[], int], Callable[[], None]]:
    """``threads`` SDK clients gathering ``nbytes`` each call, with the inline limit
    raised past it (``stream_threshold``): what they want inline, the server decides.
    Returns a function counting the calls made so far, and one that stops them."""
    stop = threading.Event()
    calls = [0] * threads

    def loop(n: int) -> None:
        with gradserve.Client(
            target, shared_memory=False, keepalive=False, stream_threshold=2 * nbytes
        ) as client:
            ta = client.tensor_array(np.float32, size=1, clear_after_read=False)
            ta.write(0, np.ones(MIB // 4, np.float32))
            indices = np.zeros(nbytes // MIB, np.int32)
            while not stop.is_set():
                client.raw_ops.TensorArrayGatherV3(ta.handle, indices, ta.flow, np.float32)
                calls[n] += 1

    workers = [threading.Thread(target=loop, args=(n,), daemon=True) for n in range(threads)]
    for w in workers:
        w.start()

    def stop_all() -> None:
        stop.set()
        for w in workers:
            w.join(120)

    return (lambda: sum(calls)), stop_all


def bench_replies(args: argparse.Namespace) -> None:
    nbytes = (64 if args.quick else 128) * MIB
    window, rounds = (2.0, 2) if args.quick else (4.0, 3)
    print(
        f"\n[8] another session's KeepAlive while 2 clients pull {nbytes // MIB} MiB gathers "
        f"(inline limit raised), {rounds} alternating rounds of {window:g} s"
    )
    flags = {"default": (), "none": ("--max-inline-reply-bytes", "none")}
    waits: dict[str, list[float]] = {key: [] for key in flags}
    pulled: dict[str, float] = {key: 0.0 for key in flags}
    with contextlib.ExitStack() as stack:
        servers = {key: stack.enter_context(server_process(*f)) for key, f in flags.items()}
        for _ in range(rounds):
            for key, server in servers.items():
                count, stop = _pull(server.target, nbytes, 2)
                time.sleep(1.0)  # (their setup is not what is measured)
                start, t_start = count(), time.monotonic()
                with gradserve.Client(server.target, keepalive=False) as probe:
                    end = time.monotonic() + window
                    while time.monotonic() < end:
                        t0 = time.perf_counter()
                        probe.keep_alive()
                        waits[key].append(time.perf_counter() - t0)
                        time.sleep(0.01)
                pulled[key] += (count() - start) * nbytes / (time.monotonic() - t_start) / rounds
                stop()
    for key in flags:
        print(
            f"  --max-inline-reply-bytes {key}: KeepAlive {ms(waits[key])}, "
            f"p90 {pct(waits[key], 90) * 1e3:.1f} ms, max {max(waits[key]) * 1e3:.1f} ms; "
            f"pulled {pulled[key] / 1e9:.2f} GB/s"
        )
    p90 = pct(waits["default"], 90)
    summarize(
        "replies",
        f"another session's KeepAlive p90 {p90 * 1e3:.1f} ms while {nbytes // MIB} MiB "
        f"replies are pulled (target <= 50 ms; {pct(waits['none'], 90) * 1e3:.1f} ms "
        "with --max-inline-reply-bytes none)",
        p90 <= 0.050,
    )


# ------------------------------------------------------------------ main
SECTIONS = {
    "stalls": bench_stalls,
    "lstm": bench_lstm,
    "principals": bench_principals,
    "readers": bench_readers,
    "sigterm": bench_sigterm,
    "churn": bench_churn,
    "fairness": bench_fairness,
    "replies": bench_replies,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts (about a minute)")
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated")
    parser.add_argument("--verbose", action="store_true", help="per-run SIGTERM figures")
    parser.add_argument("--stalled-uploads", type=int)
    parser.add_argument("--stalled-readers", type=int)
    parser.add_argument("--idle-timeout", type=float, help="section 1 --stream-idle-timeout")
    parser.add_argument("--max-calls", type=int, default=1024, help="--max-concurrent-rpcs (1)")
    parser.add_argument("--calls", type=int, help="timed health checks and small ops")
    parser.add_argument("--lstm-clients", type=int, default=24)
    parser.add_argument("--lstm-seconds", type=float, default=0.1, help="one LSTM call's time")
    parser.add_argument("--lstm-steps", type=int, help="T of the LSTM call (default: calibrated)")
    parser.add_argument("--readers", type=int, default=12)
    parser.add_argument("--reader-idle", type=float, default=3.0)
    parser.add_argument("--runs", type=int, help="SIGTERM runs")
    parser.add_argument("--sigterm-clients", type=int, default=32)
    parser.add_argument("--sigterm-warm", type=float, default=0.5, help="load before SIGTERM")
    parser.add_argument("--sessions", type=int, help="sessions opened and closed")
    args = parser.parse_args()
    quick = args.quick
    for name, full, small in (
        ("stalled_uploads", 200, 200),
        ("stalled_readers", 200, 200),
        ("idle_timeout", 10.0, 6.0),
        ("calls", 200, 200),
        ("runs", 20, 3),
        ("sessions", 5000, 1000),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    logging.getLogger("gradserve").setLevel(logging.ERROR)  # SIGTERM: unclosed sessions
    print(
        f"# gradserve hostile-client benchmark: {os.cpu_count()} CPUs, server in its own "
        f"process, clients on loopback{' (--quick)' if quick else ''}; load average "
        f"{os.getloadavg()[0]:.2f} at the start",
        flush=True,
    )
    started = time.monotonic()
    for name in args.only.split(","):
        t0 = time.monotonic()
        try:
            SECTIONS[name](args)
        except Exception as e:  # noqa: BLE001 - one broken section does not hide the rest
            summarize(name, f"did not complete: {type(e).__name__}: {e}", False)
        print(f"  ({name}: {time.monotonic() - t0:.1f} s)", flush=True)
    print(f"\n# summary ({time.monotonic() - started:.0f} s)")
    for line in SUMMARY:
        print(line)


if __name__ == "__main__":
    main()
