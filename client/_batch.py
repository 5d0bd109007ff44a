"""``client.batch()``: many ops, one round trip (the ``Batch`` RPC).

Ops recorded on ``batch.raw_ops`` run in order on the server when ``run()`` is
called; the server stops at the first failing step. Steps before it stay
applied (each step is atomic); the raised error carries ``.step`` (its
index) and ``.results`` (the results of the steps that ran). A batch too large
for one message goes in several, in order, with the same semantics.
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
    """A list of ops to run with as few ``Batch`` RPCs as the message limits allow.

    Steps go in one request while they fit both ends' message limits, in more
    otherwise, in order; a server whose response fills up stops before a step
    (reason ``RESPONSE_FULL``) and the rest goes in the next request. Either way the
    steps run in order and stop at the first failure, as in one RPC.
    """

    def __init__(self, client) -> None:
        self._client = client
        self._steps: list[tuple[str, Message, Callable[[Any], Any]]] = []
        self._temps: list[str] = []
        self.raw_ops = RawOps(client, self._record, client._staging)

    def _record(self, rpc: str, request: Message, parse, temps: list[str]) -> int:
        self._steps.append((rpc, request, parse))
        self._temps.extend(temps)
        return len(self._steps) - 1

    def __len__(self) -> int:
        return len(self._steps)

    def run(self) -> list[Any]:
        """Run every recorded op; returns their results in order (like the typed calls)."""
        steps, self._steps = self._steps, []
        temps, self._temps = self._temps, []
        results: list[Any] = []
        try:
            start = 0
            while start < len(steps):
                request = self._request(steps, start)
                reply = self._client._call("Batch", request)
                parsers = [parse for _, _, parse in steps[start:]]
                results += self._client._parse(
                    reply, lambda r, ps=parsers: [self._one(p, x) for p, x in zip(ps, r.results)]
                )
                if not reply.HasField("failed_step"):
                    start += len(request.steps)
                    continue
                if reply.error.reason == "RESPONSE_FULL" and reply.failed_step > 0:
                    start += reply.failed_step  # not run: goes in the next request
                    continue
                raise error_class_for(reply.error.code)(
                    reply.error.message,
                    reason=reply.error.reason,
                    step=start + reply.failed_step,
                    results=results,
                )
        finally:
            self._client._clean_up(temps)
        return results

    def _request(self, steps: list, start: int) -> service_pb2.BatchRequest:
        """The steps from ``start`` that fit in one request (at least one)."""
        request = service_pb2.BatchRequest()
        left = self._client.request_budget
        for rpc, op_request, _ in steps[start:]:
            size = op_request.ByteSize() + 16
            if request.steps and size > left:
                break
            getattr(request.steps.add(), BATCH_FIELDS[rpc]).CopyFrom(op_request)
            left -= size
        return request

    @staticmethod
    def _one(parse: Callable[[Any], Any], result: Any) -> Any:
        """``parse`` of a step's result (the oneof inside ``BatchResult``)."""
        return parse(getattr(result, result.WhichOneof("op")))
