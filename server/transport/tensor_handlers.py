"""Unary put and get of a resident tensor (``PutTensorInline``, ``GetTensorInline``).

For a tensor that fits one message the SDK uses these instead of the PutTensor /
GetTensor streams: gRPC Python spends more on a stream (a thread to feed the
request iterator, a rendezvous per response message) than on the bytes of a small
tensor (``make bench``, ``bench_wire``). A mixin of the servicer, as
``shm_handlers``: it uses its ``_session``, ``light`` lane, ``compute`` and message
limit.
"""

from __future__ import annotations

from typing import Any

from gradserve import codec, dtypes, protocol
from gradserve.errors import ResourceExhaustedError
from gradserve.server.transport import boundary
from gradserve.server.transport.servicer_part import ServicerPart
from gradserve.server.transport.wire import host_array
from gradserve.v1 import service_pb2, tensor_pb2


class InlineTensorRPCs(ServicerPart):
    """PutTensorInline, GetTensorInline."""

    @boundary.guarded
    async def PutTensorInline(
        self, request: tensor_pb2.Tensor, context: Any
    ) -> tensor_pb2.ResidentTensor:
        """The request's tensor kept in the session (its bytes charged as ``put``'s)."""
        session = self._session(context)

        def put() -> str:
            array = codec.decode(request, field="tensor")  # a view of the request's bytes
            return session.put(array)

        tensor_id = await self.light.run(put)
        return tensor_pb2.ResidentTensor(id=tensor_id, dtype=request.dtype, shape=request.shape)

    @boundary.guarded
    async def GetTensorInline(
        self, request: service_pb2.GetTensorRequest, context: Any
    ) -> tensor_pb2.Tensor:
        """The resident tensor in one message; RESOURCE_EXHAUSTED (reason
        ``USE_GET_TENSOR``) if it would not fit the response (the server's message
        limit, or the client's ``x-gradserve-response-budget``)."""
        session = self._session(context)
        budget = self.max_message_bytes - protocol.MESSAGE_OVERHEAD_BYTES
        for key, value in context.invocation_metadata() or ():
            if key == protocol.RESPONSE_BUDGET_METADATA_KEY and str(value).isdigit():
                budget = min(budget, int(value))

        def get() -> tensor_pb2.Tensor:
            with session.reading(request.id) as kept:
                size = protocol.encoded_size(dtypes.nbytes(kept), kept.ndim)
                if size > budget:
                    raise ResourceExhaustedError(
                        f"tensor {request.id!r} of {size} bytes does not fit one response "
                        f"({budget} bytes): fetch it with GetTensor",
                        reason="USE_GET_TENSOR",
                    )
                message = codec.encode(host_array(self.compute, kept))
            if request.delete_after:
                session.delete([request.id])
            return message

        return await self.light.run(get)
