"""What the scale-out tests' workers do: TensorArray writes, reads and gradients whose
every result is known in advance, so a wrong or lost result is seen."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import numpy as np

import gradserve
from gradserve.errors import InvalidArgumentError, SessionLostError, UnavailableError

SHAPE = (4,)


def value(seed: int, index: int) -> np.ndarray:
    """The element a worker writes at ``index`` of session ``seed``'s array."""
    return np.arange(SHAPE[0], dtype=np.float32) + np.float32(seed * 1000 + index)


def client(target: str, channel: grpc.Channel | None = None, **kw) -> gradserve.Client:
    kw.setdefault("timeout", 30)
    kw.setdefault("retries", 8)
    # Remote workers: the wire. (Same-host shared-memory regions are registered per
    # replica process and are not part of a snapshot: after a restart or an adoption
    # a region-using client must register its regions again.)
    kw.setdefault("shared_memory", False)
    return gradserve.Client(target, channel=channel, keepalive=False, **kw)


def one_session(target: str, channel: grpc.Channel, seed: int) -> gradserve.Client:
    """A new session through ``target`` that writes, reads and takes a gradient array,
    checking every result; returned open."""
    c = client(target, channel)
    h, flow = c.raw_ops.TensorArrayV3(
        size=2, dtype=np.float32, element_shape=SHAPE, clear_after_read=False
    )
    flow = c.raw_ops.TensorArrayWriteV3(h, 0, value(seed, 0), flow)
    g, gflow = c.raw_ops.TensorArrayGradV3(h, flow, source="gradients")
    c.raw_ops.TensorArrayWriteV3(g, 0, value(seed, 1), gflow)
    c.raw_ops.TensorArrayWriteV3(g, 0, value(seed, 2), gflow)
    assert np.array_equal(c.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32), value(seed, 0))
    got = c.raw_ops.TensorArrayReadV3(g, 0, gflow, np.float32)
    assert np.array_equal(got, value(seed, 1) + value(seed, 2))
    return c


@dataclasses.dataclass
class Stream:
    """One session written element after element (a dynamic, non-clearing array)."""

    client: gradserve.Client
    seed: int
    handle: object = None
    flow: float = 0.0
    written: int = 0

    @classmethod
    def open(cls, target: str, channel: grpc.Channel, seed: int) -> Stream:
        c = client(target, channel)
        h, flow = c.raw_ops.TensorArrayV3(
            size=0,
            dtype=np.float32,
            element_shape=SHAPE,
            dynamic_size=True,
            clear_after_read=False,
        )
        return cls(c, seed, h, flow)


@dataclasses.dataclass
class Tally:
    calls: int = 0
    lost: int = 0
    wrong: int = 0
    unknown_outcome: int = 0
    longest_stall: float = 0.0
    errors: list[str] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def note(self, seconds: float) -> None:
        with self.lock:
            self.calls += 1
            self.longest_stall = max(self.longest_stall, seconds)


def _patiently(fn, tally: Tally, give_up: float = 60.0):
    """``fn()``, repeated while the replica is unreachable (a restart window): how a
    worker rides out an UNAVAILABLE that the SDK would not repeat on its own."""
    end = time.monotonic() + give_up
    while True:
        try:
            return fn()
        except UnavailableError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def step(stream: Stream, tally: Tally) -> None:
    """Write the next element and read it and its predecessor back, checking both.

    A write whose outcome is unknown (the SDK raised UNAVAILABLE 'outcome unknown') is
    resolved as the SDK's message says: write again; 'already been written' means the
    first one landed, and the read-back checks that it holds the right value."""
    c, k = stream.client, stream.written
    started = time.monotonic()
    try:
        try:
            stream.flow = c.raw_ops.TensorArrayWriteV3(
                stream.handle, k, value(stream.seed, k), stream.flow
            )
        except UnavailableError as e:
            if "outcome unknown" not in str(e):
                raise
            with tally.lock:
                tally.unknown_outcome += 1
            try:
                stream.flow = _patiently(
                    lambda: c.raw_ops.TensorArrayWriteV3(
                        stream.handle, k, value(stream.seed, k), stream.flow
                    ),
                    tally,
                )
            except InvalidArgumentError as again:
                if "already been written" not in str(again):
                    raise
        stream.written = k + 1
        for index in {k, max(0, k - 1)}:
            got = _patiently(
                lambda i=index: c.raw_ops.TensorArrayReadV3(
                    stream.handle, i, stream.flow, np.float32
                ),
                tally,
            )
            if not np.array_equal(got, value(stream.seed, index)):
                with tally.lock:
                    tally.wrong += 1
                    tally.errors.append(f"session {stream.seed} index {index}: {got}")
    except SessionLostError as e:
        with tally.lock:
            tally.lost += 1
            tally.errors.append(f"session {stream.seed}: {e}")
        raise
    finally:
        tally.note(time.monotonic() - started)


def verify(stream: Stream) -> None:
    """Every element written so far reads back right (one Gather)."""
    if stream.written == 0:
        return
    got = stream.client.raw_ops.TensorArrayGatherV3(
        stream.handle, list(range(stream.written)), stream.flow, np.float32, element_shape=SHAPE
    )
    want = np.stack([value(stream.seed, i) for i in range(stream.written)])
    assert np.array_equal(got, want), f"session {stream.seed}"


class Load:
    """``threads`` workers, each stepping its own sessions round-robin until stopped."""

    def __init__(self, target: str, threads: int, sessions_each: int, seed0: int = 0) -> None:
        self.tally = Tally()
        self.stop = threading.Event()
        self.channels = [grpc.insecure_channel(target) for _ in range(threads)]
        self.streams = [
            [Stream.open(target, ch, seed0 + t * sessions_each + j) for j in range(sessions_each)]
            for t, ch in enumerate(self.channels)
        ]
        self.threads = [
            threading.Thread(target=self._work, args=(mine,), daemon=True) for mine in self.streams
        ]

    def _work(self, mine: list[Stream]) -> None:
        while not self.stop.is_set():
            for stream in mine:
                try:
                    step(stream, self.tally)
                except SessionLostError:
                    mine.remove(stream)
                    break
                except Exception as e:  # noqa: BLE001 - counted, reported by the test
                    with self.tally.lock:
                        self.tally.errors.append(f"{type(e).__name__}: {e}")
                    time.sleep(0.05)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def all_streams(self) -> list[Stream]:
        return [s for mine in self.streams for s in mine]

    def close(self) -> None:
        for s in self.all_streams():
            s.client.close()
        for ch in self.channels:
            ch.close()


def write_through_a_restart(target: str, replica, reason: str) -> None:
    """A write to ``target`` while ``replica`` (which holds the write's session) restarts
    with its --state-dir: while nothing listens it fails unrun with ``reason``, never
    "outcome unknown"; with retries it is repeated through the window and lands once
    the replica is back (``replica``: ``tests.scaleout.cluster.Replica``)."""
    from gradserve.client._client import OUTCOME_UNKNOWN

    c = gradserve.Client(target, keepalive=False, retries=0, shared_memory=False)
    try:
        ta = c.tensor_array(np.float32, size=2, element_shape=(3,))
        ta = ta.write(0, np.arange(3, dtype=np.float32))
        assert replica.stop() == 0, replica.log()  # drained, its session saved
        try:
            ta.write(1, np.ones(3, np.float32))
            raise AssertionError("a write with nothing listening succeeded")
        except UnavailableError as refused:
            assert refused.reason == reason, refused
            assert not str(refused).startswith(OUTCOME_UNKNOWN), refused
        failed: list[BaseException] = []

        def restart() -> None:  # its failure is the test's, not a lost thread's
            time.sleep(1.0)
            try:
                replica.start()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                failed.append(e)

        restarter = threading.Thread(target=restart)
        restarter.start()
        c.retries = 10
        try:
            ta = ta.write(1, np.ones(3, np.float32))
        finally:
            restarter.join()
            if failed:
                raise failed[0]
        assert np.array_equal(ta.stack(), [[0, 1, 2], [1, 1, 1]])
    finally:
        c.close()
