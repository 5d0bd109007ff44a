"""Unary put and get of a resident tensor (``PutTensorInline``, ``GetTensorInline``).

For a tensor that fits one message the SDK uses these instead of the PutTensor /
GetTensor streams: gRPC Python spends more on a stream (a thread to feed the
request iterator, a rendezvous per response message) than on the bytes of a small
tensor (``make bench``, ``bench_wire``). A mixin of the servicer, as
``shm_handlers``: it uses its ``_session``, ``light`` lane, ``compute`` and message
limit.

A numeric tensor of at most ``ON_LOOP_BYTES`` is put or got on the event loop
itself: what that costs (one copy of its bytes, a dict entry under the session's
lock, as PutTensor's chunks are copied there) is less than the hand-over to a
lane thread and back (two thread wake-ups, measured at ~150 us of a ~650 us put
of 64 KiB on loopback). Strings (a pass over every element), device arrays (a
device-to-host copy) and larger tensors go to the ``light`` lane as before.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from gradserve import codec, dtypes, protocol
from gradserve.errors import GradserveError, ResourceExhaustedError
from gradserve.server.transport import boundary
from gradserve.server.transport.servicer_part import (
    ForgottenUnlessReplied,
    ReadOut,
    ServicerPart,
    int_metadata,
    text_metadata,
)
from gradserve.server.transport.wire import host_array
from gradserve.v1 import service_pb2, tensor_pb2

#: Numeric tensors up to this size are put and got on the event loop (see above).
ON_LOOP_BYTES = 1 << 20
_STRING_ENUM = codec.dtype_to_enum(dtypes.STRING)
_UNBOUNDED = 1 << 62


class InlineTensorRPCs(ServicerPart):
    """PutTensorInline, GetTensorInline."""

    @boundary.guarded
    async def PutTensorInline(
        self, request: codec.WireTensor | tensor_pb2.Tensor, context: Any
    ) -> tensor_pb2.ResidentTensor:
        """The request's tensor kept in the session (its bytes charged as ``put``'s): a
        view of the bytes gRPC received (``app.VIEW_PARSERS``), no copy."""
        session = self._session(context)
        forgotten = ForgottenUnlessReplied(session, context)

        def put() -> str:
            array = codec.decode(request, field="tensor")  # a view of the request's bytes
            return forgotten.kept(session.put(array))

        if _declared_bytes(request) <= ON_LOOP_BYTES:
            tensor_id = put()
        else:
            tensor_id = await self.light.run(put)
        dtype = cast(tensor_pb2.DType, request.dtype)  # a WireTensor's is an int
        forgotten.replied()
        return tensor_pb2.ResidentTensor(id=tensor_id, dtype=dtype, shape=request.shape)

    @boundary.guarded
    async def GetTensorInline(self, request: service_pb2.GetTensorRequest, context: Any) -> Any:
        """The resident tensor in one message (a ``tensor_pb2.Tensor``, serialized
        here); RESOURCE_EXHAUSTED (reason ``USE_GET_TENSOR``) if it would not fit the
        response (``reply_budget``)."""
        session = self._session(context)
        metadata = text_metadata(context)
        budget = self.reply_budget(int_metadata(metadata, protocol.RESPONSE_BUDGET_METADATA_KEY))
        read_out = ReadOut(session, request, context)

        def get() -> codec.Serialized:
            with session.reading(request.id) as kept:
                size = protocol.encoded_size(dtypes.nbytes(kept), kept.ndim)
                if size > budget:
                    raise ResourceExhaustedError(
                        f"tensor {request.id!r} of {size} bytes does not fit one response "
                        f"({budget} bytes): fetch it with GetTensor",
                        reason="USE_GET_TENSOR",
                    )
                return codec.Serialized(codec.serialize_tensor(host_array(self.compute, kept)))

        kept = session.get(request.id)  # NOT_FOUND here as in ``get``
        message = get() if on_loop(kept) else await self.light.run(get)
        read_out.replied()
        return message


def _declared_bytes(request: codec.WireTensor | tensor_pb2.Tensor) -> int:
    """The bytes a numeric ``Tensor`` declares (dtype and shape: no pass over its
    content, which ``ByteSize`` would serialize); a string or malformed one counts as
    unbounded (``decode`` reports what is wrong, on the lane)."""
    if request.dtype == _STRING_ENUM:
        return _UNBOUNDED
    try:
        itemsize = codec.dtype_from_enum(request.dtype).itemsize
        return codec.element_count(request.shape, itemsize=itemsize) * itemsize
    except GradserveError:
        return _UNBOUNDED


def on_loop(array: Any) -> bool:
    """Whether ``array`` is put or got on the event loop (a small numeric host array)."""
    return (
        isinstance(array, np.ndarray)
        and array.dtype != dtypes.STRING
        and array.nbytes <= ON_LOOP_BYTES
    )
