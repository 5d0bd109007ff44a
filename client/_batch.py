"""``client.batch()``: many ops, one round trip (the ``Batch`` RPC).

Ops recorded on ``batch.raw_ops`` run in order on the server when ``run()`` is
called; the server stops at the first failing step. Steps before it stay
applied (each step is atomic); the raised error carries ``.step`` (its
index) and ``.results`` (the results of the steps that ran).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from gradserve.client._raw_ops import RawOps
from gradserve.errors import error_class_for
from gradserve.protocol import BATCH_FIELDS
from gradserve.v1 import service_pb2


class Batch:
    """A list of ops to run in one ``Batch`` RPC."""

    def __init__(self, client) -> None:
        self._client = client
        self._steps: list[tuple[str, Message, Callable[[Any], Any]]] = []
        self._temps = client._staging()  # one request: one inline budget for every step
        self.raw_ops = RawOps(client, self._record, lambda: self._temps)

    def _record(self, rpc: str, request: Message, parse, temps: list[str]) -> int:
        self._steps.append((rpc, request, parse))
        return len(self._steps) - 1

    def __len__(self) -> int:
        return len(self._steps)

    def run(self) -> list[Any]:
        """Run every recorded op; returns their results in order (like the typed calls)."""
        request = service_pb2.BatchRequest()
        for rpc, op_request, _ in self._steps:
            getattr(request.steps.add(), BATCH_FIELDS[rpc]).CopyFrom(op_request)
        try:
            reply = self._client._call("Batch", request)
        finally:
            temps, self._temps = self._temps, self._client._staging()
            if temps:
                self._client._delete_ids(temps)
        results = []
        for (_, _, parse), result in zip(self._steps, reply.results):
            results.append(parse(getattr(result, result.WhichOneof("op"))))
        self._steps = []
        if reply.HasField("failed_step"):
            raise error_class_for(reply.error.code)(
                reply.error.message,
                reason=reply.error.reason,
                step=reply.failed_step,
                results=results,
            )
        return results
