"""Parallel fetches of a reply's transient outputs.

An op whose outputs did not fit its response (the LSTM's seven activations at large
sizes) returns them as transient tensors that the SDK streams back with GetTensor.
One after another, each waits for the last; with two streams at once one tensor's
chunks are decoded while the next one's arrive (bench_wire and the LSTM forward:
7 x 13 MB in ~70 ms instead of ~100 ms on 2 cores; four streams were no faster).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
from google.protobuf.message import Message

from gradserve import codec
from gradserve.errors import GradserveError
from gradserve.v1 import tensor_pb2

#: Streams at once.
STREAMS = 2
#: Prefetch only when the transient outputs hold at least this much together.
MIN_TOTAL_BYTES = 8 << 20


class Prefetcher:
    """Fetches (``fetch(tensor_id)``) started ahead while a reply is parsed."""

    def __init__(self, fetch: Callable[[str], np.ndarray]) -> None:
        self._fetch = fetch
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._started: dict[str, Future[np.ndarray]] = {}

    @contextmanager
    def prefetching(self, reply: Any) -> Iterator[None]:
        """Start fetching ``reply``'s transient outputs; what parsing does not take
        (``take``) is dropped at the end (its fetch finishes, its result is unused)."""
        outputs = _transient_outputs(reply)
        if len(outputs) < 2 or sum(n for _, n in outputs) < MIN_TOTAL_BYTES:
            yield
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(STREAMS, thread_name_prefix="gradserve-fetch")
            pool = self._pool
            for tensor_id, _ in outputs:
                self._started[tensor_id] = pool.submit(self._fetch, tensor_id)
        try:
            yield
        finally:
            with self._lock:
                for tensor_id, _ in outputs:
                    self._started.pop(tensor_id, None)

    def take(self, tensor_id: str) -> np.ndarray | None:
        """The prefetched value of ``tensor_id`` (waiting for it), or None."""
        with self._lock:
            future = self._started.pop(tensor_id, None)
        return None if future is None else future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _transient_outputs(message: Any) -> list[tuple[str, int]]:
    """(id, bytes) of every transient output in a reply (a Batch's included)."""
    found = []
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        for item in [value] if isinstance(value, Message) else value:
            if isinstance(item, tensor_pb2.TensorOutput):
                ref = item.ref
                if item.WhichOneof("result") == "ref" and ref.transient:
                    try:
                        itemsize = codec.dtype_from_enum(ref.dtype).itemsize
                    except GradserveError:  # the fetch reports it
                        itemsize = 0
                    found.append((ref.id, int(np.prod(tuple(ref.shape))) * itemsize))
            elif isinstance(item, Message):
                found += _transient_outputs(item)
    return found
