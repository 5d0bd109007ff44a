"""The table of op RPCs: name, handler, Batch field, whether it is compute-bound.

It drives both the typed RPCs of the servicer and ``Batch``, so an op is served
by exactly one handler function, named after the op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from gradserve.protocol import BATCH_FIELDS
from gradserve.server.core.ops import recording
from gradserve.server.core.ops.stop_gradient import stop_gradient
from gradserve.server.transport import lstm_handlers as lstm
from gradserve.server.transport import tape_handlers as tape
from gradserve.server.transport import tensor_array_handlers as ta
from gradserve.server.transport.wire import CallIO
from gradserve.v1 import tensor_array_pb2

Handler = Callable[[CallIO, Any], Message]


def StopGradient(
    io: CallIO, req: tensor_array_pb2.StopGradientRequest
) -> tensor_array_pb2.StopGradientResponse:
    resp = tensor_array_pb2.StopGradientResponse()
    value = io.tensor(req.input, "input")
    output = stop_gradient(io.session, value)
    tape_id = recording.stop_gradient(io.recorder, value, output) if io.recorder else None
    io.output(output, resp, "output", req.keep_outputs, tape_id)
    return resp


@dataclasses.dataclass(frozen=True)
class Op:
    """An op as served: its handler (named as the RPC) and how it is scheduled."""

    handler: Handler
    #: Compute-bound: runs on the compute lane (lanes.Lane), not the light one, and
    #: outside the snapshot gate (``CallIO.run``).
    heavy: bool = False

    @property
    def rpc(self) -> str:
        return self.handler.__name__

    @property
    def batch_field(self) -> str:
        return BATCH_FIELDS[self.rpc]


OPS: tuple[Op, ...] = (
    Op(ta.TensorArrayV3),
    Op(ta.TensorArrayWriteV3),
    Op(ta.TensorArrayReadV3),
    Op(ta.TensorArrayGatherV3),
    Op(ta.TensorArrayScatterV3),
    Op(ta.TensorArrayConcatV3),
    Op(ta.TensorArraySplitV3),
    Op(ta.TensorArraySizeV3),
    Op(ta.TensorArrayCloseV3),
    Op(ta.TensorArrayGradV3),
    Op(ta.TensorArrayGradWithShape),
    Op(StopGradient),
    Op(lstm.BlockLSTMV2, heavy=True),
    Op(lstm.BlockLSTMGradV2, heavy=True),
    Op(lstm.BlockLSTM, heavy=True),
    Op(lstm.BlockLSTMGrad, heavy=True),
    Op(tape.Gradients, heavy=True),
    Op(tape.WatchTensors),
)

OPS_BY_BATCH_FIELD = {op.batch_field: op for op in OPS}
