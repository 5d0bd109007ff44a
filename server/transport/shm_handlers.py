"""The shared-memory RPCs (``shared_memory.proto``): regions of a session, and
resident tensors copied in from and out to them.

``SharedMemoryRPCs`` is a mixin of the servicer (it uses its ``_session``,
``light`` lane and ``compute``): each RPC finds the session, runs the copy on the
light lane (a copy of a large tensor takes milliseconds) and translates. The
domain is ``core.regions``; op calls read and write regions through
``shm_wire``.
"""

from __future__ import annotations

import functools
from typing import Any

from gradserve import codec
from gradserve.server.transport import boundary, shm_wire
from gradserve.server.transport.servicer_part import (
    ForgottenUnlessReplied,
    ReadOut,
    ServicerPart,
)
from gradserve.server.transport.wire import host_array
from gradserve.v1 import shared_memory_pb2 as pb
from gradserve.v1 import tensor_pb2


class SharedMemoryRPCs(ServicerPart):
    """RegisterSharedMemory, UnregisterSharedMemory, PutSharedTensor, GetSharedTensor."""

    @boundary.guarded
    async def RegisterSharedMemory(
        self, request: pb.RegisterSharedMemoryRequest, context: Any
    ) -> pb.RegisterSharedMemoryResponse:
        session = self._session(context)
        forgotten = ForgottenUnlessReplied(session, context)

        def register() -> None:
            regions = session.regions
            regions.register(request.name, request.key, request.byte_size, request.nonce)
            # Its reply lost, the client unlinks the object: the server held a
            # descriptor of it, memory no budget counts, and a region slot, until the
            # session ended (a review helper).
            forgotten.undone_by(functools.partial(regions.unregister, request.name))

        await self.light.run(register)
        forgotten.replied()
        return pb.RegisterSharedMemoryResponse()

    @boundary.guarded
    async def UnregisterSharedMemory(
        self, request: pb.UnregisterSharedMemoryRequest, context: Any
    ) -> pb.UnregisterSharedMemoryResponse:
        session = self._session(context)
        count = await self.light.run(functools.partial(session.regions.unregister, request.name))
        return pb.UnregisterSharedMemoryResponse(unregistered=count)

    @boundary.guarded
    async def PutSharedTensor(
        self, request: pb.PutSharedTensorRequest, context: Any
    ) -> tensor_pb2.ResidentTensor:
        """A copy of the region's bytes kept in the session: its bytes are reserved in
        the session's budget before the copy is allocated."""
        session = self._session(context)
        msg = request.tensor
        forgotten = ForgottenUnlessReplied(session, context)

        def put() -> str:
            dtype = codec.dtype_from_enum(msg.dtype, field="tensor.dtype")
            nbytes = session.regions.nbytes(dtype, msg.shape, "tensor")
            with session.reserve_tensor(nbytes) as reservation:
                array = shm_wire.read_tensor(session, msg, "tensor")
                return forgotten.kept(reservation.keep(array))

        tensor_id = await self.light.run(put)
        forgotten.replied()
        return tensor_pb2.ResidentTensor(id=tensor_id, dtype=msg.dtype, shape=msg.shape)

    @boundary.guarded
    async def GetSharedTensor(
        self, request: pb.GetSharedTensorRequest, context: Any
    ) -> pb.GetSharedTensorResponse:
        """The resident tensor copied into the region; with ``delete_after`` deleted
        once copied (a copy that fails, or a reply past the deadline, leaves it, to be
        fetched again: ``ReadOut``)."""
        session = self._session(context)
        read_out = ReadOut(session, request, context)
        response = pb.GetSharedTensorResponse()

        def get() -> None:
            with session.reading(request.id) as kept:
                array = host_array(self.compute, kept)
                session.regions.write(request.region, request.offset, array, "tensor")
                shm_wire.fill(response.tensor, request.region, request.offset, array)

        await self.light.run(get)
        read_out.replied()
        return response
