"""One handler per op: request message -> op semantics -> response message.

Each handler only decodes, calls ``server.ops``, and encodes. The ``OPS``
table drives both the typed RPCs and ``Batch``, so an op is defined once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from google.protobuf.message import Message

from gradserve import codec
from gradserve.protocol import BATCH_FIELDS
from gradserve.server.core.ops import lstm_ops
from gradserve.server.core.ops import stop_gradient as sg_ops
from gradserve.server.core.ops import tensor_array_ops as ta_ops
from gradserve.server.transport.wire import CallIO, dtype_of, handle_id
from gradserve.v1 import lstm_pb2
from gradserve.v1 import tensor_array_pb2 as pb


def _handle(handle: str, name: str) -> pb.TensorArrayHandle:
    return pb.TensorArrayHandle(id=handle, name=name)


def _shape(req: Message, field: str):
    return codec.decode_shape(getattr(req, field), req.HasField(field))


def tensor_array_v3(io: CallIO, req: pb.TensorArrayV3Request) -> pb.TensorArrayV3Response:
    handle, ta = ta_ops.create(
        io.session,
        size=io.input(req.size, "size"),
        dtype=dtype_of(req.dtype),
        element_shape=_shape(req, "element_shape"),
        dynamic_size=req.dynamic_size,
        clear_after_read=req.clear_after_read if req.HasField("clear_after_read") else True,
        identical_element_shapes=req.identical_element_shapes,
        tensor_array_name=req.tensor_array_name,
    )
    return pb.TensorArrayV3Response(handle=_handle(handle, ta.name), flow=0.0)


def write(io: CallIO, req: pb.TensorArrayWriteV3Request) -> pb.TensorArrayWriteV3Response:
    ta_ops.write(
        io.session,
        handle_id(req.handle),
        io.input(req.index, "index"),
        io.input(req.value, "value"),
    )
    return pb.TensorArrayWriteV3Response(flow_out=req.flow_in)


def read(io: CallIO, req: pb.TensorArrayReadV3Request) -> pb.TensorArrayReadV3Response:
    value = ta_ops.read(
        io.session, handle_id(req.handle), io.input(req.index, "index"), dtype_of(req.dtype)
    )
    resp = pb.TensorArrayReadV3Response()
    io.output(value, resp.value, req.keep_outputs)
    return resp


def gather(io: CallIO, req: pb.TensorArrayGatherV3Request) -> pb.TensorArrayGatherV3Response:
    value = ta_ops.gather(
        io.session,
        handle_id(req.handle),
        io.input(req.indices, "indices"),
        dtype_of(req.dtype),
        _shape(req, "element_shape"),
        io.check_alive,
    )
    resp = pb.TensorArrayGatherV3Response()
    io.output(value, resp.value, req.keep_outputs)
    return resp


def scatter(io: CallIO, req: pb.TensorArrayScatterV3Request) -> pb.TensorArrayScatterV3Response:
    ta_ops.scatter(
        io.session,
        handle_id(req.handle),
        io.input(req.indices, "indices"),
        io.input(req.value, "value"),
    )
    return pb.TensorArrayScatterV3Response(flow_out=req.flow_in)


def concat(io: CallIO, req: pb.TensorArrayConcatV3Request) -> pb.TensorArrayConcatV3Response:
    value, lengths = ta_ops.concat(
        io.session,
        handle_id(req.handle),
        dtype_of(req.dtype),
        _shape(req, "element_shape_except0"),
        io.check_alive,
    )
    resp = pb.TensorArrayConcatV3Response()
    io.output(value, resp.value, req.keep_outputs)
    io.output(lengths, resp.lengths, False)
    return resp


def split(io: CallIO, req: pb.TensorArraySplitV3Request) -> pb.TensorArraySplitV3Response:
    ta_ops.split(
        io.session,
        handle_id(req.handle),
        io.input(req.value, "value"),
        io.input(req.lengths, "lengths"),
    )
    return pb.TensorArraySplitV3Response(flow_out=req.flow_in)


def size(io: CallIO, req: pb.TensorArraySizeV3Request) -> pb.TensorArraySizeV3Response:
    resp = pb.TensorArraySizeV3Response()
    io.output(ta_ops.size(io.session, handle_id(req.handle)), resp.size, False)
    return resp


def close(io: CallIO, req: pb.TensorArrayCloseV3Request) -> pb.TensorArrayCloseV3Response:
    ta_ops.close(io.session, handle_id(req.handle))
    return pb.TensorArrayCloseV3Response()


def grad(io: CallIO, req: pb.TensorArrayGradV3Request) -> pb.TensorArrayGradV3Response:
    handle, ta = ta_ops.grad(io.session, handle_id(req.handle), req.source)
    return pb.TensorArrayGradV3Response(grad_handle=_handle(handle, ta.name), flow_out=0.0)


def grad_with_shape(
    io: CallIO, req: pb.TensorArrayGradWithShapeRequest
) -> pb.TensorArrayGradWithShapeResponse:
    handle, ta = ta_ops.grad(
        io.session,
        handle_id(req.handle),
        req.source,
        io.input(req.shape_to_prepend, "shape_to_prepend"),
    )
    return pb.TensorArrayGradWithShapeResponse(grad_handle=_handle(handle, ta.name), flow_out=0.0)


def stop_gradient(io: CallIO, req: pb.StopGradientRequest) -> pb.StopGradientResponse:
    resp = pb.StopGradientResponse()
    io.output(sg_ops.stop_gradient(io.input(req.input, "input")), resp.output, req.keep_outputs)
    return resp


def _attr(req: Message, field: str):
    """An attribute's value; None (the op's default) when absent or unset-optional."""
    desc = req.DESCRIPTOR.fields_by_name.get(field)
    if desc is None or (desc.has_presence and not req.HasField(field)):
        return None
    return getattr(req, field)


def _lstm_op(
    variant: lstm_ops.LSTMVariant,
    name: str,
    names: tuple[str, ...],
    run: Callable,
    response: type,
    attrs: Callable[[Message], dict],
):
    """The handler of one LSTM op: its float ``names`` read as kept (on the GPU of a
    CUDA server) and moved to the device only once ``run`` (``lstm_ops.forward`` or
    ``backward``) has validated them; ``attrs(req)`` adds the op's own attributes;
    every result becomes a field of ``response``."""

    def handler(io: CallIO, req: Message) -> Message:
        msgs = {field: getattr(req, field) for field in names}
        result = run(
            io.compute,
            variant,
            {field: io.input(msg, field, as_kept=True) for field, msg in msgs.items()},
            io.input(req.seq_len_max, "seq_len_max"),
            place=functools.partial(io.place, msgs),
            use_peephole=req.use_peephole,
            check=io.check_alive,
            check_bytes=io.session.check_tensor_bytes,
            **attrs(req),
        )
        resp = response()
        for field, value in result._asdict().items():
            io.output(value, getattr(resp, field), req.keep_outputs)
        return resp

    handler.__name__ = name
    return handler


def _lstm_forward(variant: lstm_ops.LSTMVariant):
    return _lstm_op(
        variant,
        variant.op,
        lstm_ops.WEIGHTS,
        lstm_ops.forward,
        lstm_pb2.BlockLSTMResponse,
        lambda req: {
            "cell_clip": _attr(req, "cell_clip"),
            "forget_bias": _attr(req, "forget_bias"),
        },
    )


def _lstm_backward(variant: lstm_ops.LSTMVariant):
    return _lstm_op(
        variant,
        variant.grad_op,
        lstm_ops.WEIGHTS + lstm_ops.ACTIVATIONS + lstm_ops.OUTPUT_GRADS,
        lstm_ops.backward,
        lstm_pb2.BlockLSTMGradResponse,
        lambda req: {},
    )


@dataclasses.dataclass(frozen=True)
class Op:
    """An op as served: its RPC name, Batch oneof field and handler."""

    rpc: str
    handler: Callable[[CallIO, Message], Message]
    #: Compute-bound: runs only with a slot of the server's compute gate.
    heavy: bool = False

    @property
    def batch_field(self) -> str:
        return BATCH_FIELDS[self.rpc]


OPS: tuple[Op, ...] = (
    Op("TensorArrayV3", tensor_array_v3),
    Op("TensorArrayWriteV3", write),
    Op("TensorArrayReadV3", read),
    Op("TensorArrayGatherV3", gather),
    Op("TensorArrayScatterV3", scatter),
    Op("TensorArrayConcatV3", concat),
    Op("TensorArraySplitV3", split),
    Op("TensorArraySizeV3", size),
    Op("TensorArrayCloseV3", close),
    Op("TensorArrayGradV3", grad),
    Op("TensorArrayGradWithShape", grad_with_shape),
    Op("StopGradient", stop_gradient),
    Op("BlockLSTMV2", _lstm_forward(lstm_ops.V2), heavy=True),
    Op("BlockLSTMGradV2", _lstm_backward(lstm_ops.V2), heavy=True),
    Op("BlockLSTM", _lstm_forward(lstm_ops.V1), heavy=True),
    Op("BlockLSTMGrad", _lstm_backward(lstm_ops.V1), heavy=True),
)

OPS_BY_BATCH_FIELD = {op.batch_field: op for op in OPS}
