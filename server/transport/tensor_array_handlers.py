"""The TensorArray op RPCs: request message -> ``core.ops.tensor_array_ops`` -> response.

Each handler is named after its op (``grep "def TensorArrayWriteV3"`` finds where
it is served), decodes its request, calls the op, records it on the call's
gradient tapes (``core.ops.recording``, only when the call names a tape) and
encodes the result.
"""

from __future__ import annotations

from google.protobuf.message import Message

from gradserve import codec, shapes
from gradserve.server.core.ops import recording
from gradserve.server.core.ops import tensor_array_ops as ta_ops
from gradserve.server.transport.wire import CallIO, dtype_of
from gradserve.v1 import tensor_array_pb2 as pb


def _handle(handle: str, name: str) -> pb.TensorArrayHandle:
    return pb.TensorArrayHandle(id=handle, name=name)


def _shape(req: Message, field: str) -> shapes.PartialShape:
    return codec.decode_shape(getattr(req, field), req.HasField(field))


def TensorArrayV3(io: CallIO, req: pb.TensorArrayV3Request) -> pb.TensorArrayV3Response:
    io.prepay_record()
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
    io.made_array(handle)
    if io.recorder:
        recording.tensor_array(io.recorder, handle)
    io.produce("handle", handle)
    return pb.TensorArrayV3Response(handle=_handle(handle, ta.name), flow=0.0)


def TensorArrayWriteV3(
    io: CallIO, req: pb.TensorArrayWriteV3Request
) -> pb.TensorArrayWriteV3Response:
    handle = io.handle(req.handle)
    index = io.input(req.index, "index")
    value = io.tensor(req.value, "value")
    host_value = io.host(value)
    io.prepay_record(index)
    key = recording.stored_input(io.recorder, value) if io.recorder else None
    io.hand_over(value)  # stored and charged by the array
    ta_ops.write(io.session, handle, index, host_value)
    if io.recorder:
        recording.write(io.recorder, handle, index, key, host_value.dtype)
    return pb.TensorArrayWriteV3Response(flow_out=req.flow_in)


def TensorArrayReadV3(io: CallIO, req: pb.TensorArrayReadV3Request) -> pb.TensorArrayReadV3Response:
    handle, index, dtype = io.handle(req.handle), io.input(req.index, "index"), dtype_of(req.dtype)
    io.prepay_record(index)
    value = ta_ops.read(
        io.session, handle, index, dtype, io.hand_out_for(req.keep_outputs), io.cleared_by_op
    )
    tape_id = recording.read(io.recorder, handle, index, dtype, value) if io.recorder else None
    resp = pb.TensorArrayReadV3Response()
    io.output(value, resp, "value", req.keep_outputs, tape_id)
    return resp


def TensorArrayGatherV3(
    io: CallIO, req: pb.TensorArrayGatherV3Request
) -> pb.TensorArrayGatherV3Response:
    handle, indices = io.handle(req.handle), io.input(req.indices, "indices")
    io.prepay_record(indices)
    value = ta_ops.gather(
        io.session,
        handle,
        indices,
        dtype_of(req.dtype),
        _shape(req, "element_shape"),
        io.check_alive,
        io.hand_out_for(req.keep_outputs),
        io.cleared_by_op,
    )
    tape_id = recording.gather(io.recorder, handle, indices, value) if io.recorder else None
    resp = pb.TensorArrayGatherV3Response()
    io.output(value, resp, "value", req.keep_outputs, tape_id)
    return resp


def TensorArrayScatterV3(
    io: CallIO, req: pb.TensorArrayScatterV3Request
) -> pb.TensorArrayScatterV3Response:
    handle, indices = io.handle(req.handle), io.input(req.indices, "indices")
    value = io.tensor(req.value, "value")
    host_value = io.host(value)
    io.prepay_record(indices)
    key = recording.stored_input(io.recorder, value) if io.recorder else None
    io.hand_over(value)  # stored and charged by the array
    ta_ops.scatter(io.session, handle, indices, host_value)
    if io.recorder:
        recording.scatter(io.recorder, handle, indices, key, host_value)
    return pb.TensorArrayScatterV3Response(flow_out=req.flow_in)


def TensorArrayConcatV3(
    io: CallIO, req: pb.TensorArrayConcatV3Request
) -> pb.TensorArrayConcatV3Response:
    handle = io.handle(req.handle)
    value, lengths = ta_ops.concat(
        io.session,
        handle,
        dtype_of(req.dtype),
        _shape(req, "element_shape_except0"),
        io.check_alive,
        # (its record, paid there, keeps a copy of the lengths: ``recording.concat``)
        io.hand_out_for((req.keep_outputs, False), record_copies=lambda outputs: outputs[1:]),
        io.cleared_by_op,
    )
    ids = recording.concat(io.recorder, handle, value, lengths) if io.recorder else (None, None)
    resp = pb.TensorArrayConcatV3Response()
    io.output(value, resp, "value", req.keep_outputs, ids[0])
    io.output(lengths, resp, "lengths", False, ids[1])
    return resp


def TensorArraySplitV3(
    io: CallIO, req: pb.TensorArraySplitV3Request
) -> pb.TensorArraySplitV3Response:
    handle = io.handle(req.handle)
    value = io.tensor(req.value, "value")
    host_value, lengths = io.host(value), io.input(req.lengths, "lengths")
    io.prepay_record()
    key = recording.stored_input(io.recorder, value) if io.recorder else None
    io.hand_over(value)  # stored and charged by the array
    ta_ops.split(io.session, handle, host_value, lengths)
    if io.recorder:
        recording.split(io.recorder, handle, key, host_value)
    return pb.TensorArraySplitV3Response(flow_out=req.flow_in)


def TensorArraySizeV3(io: CallIO, req: pb.TensorArraySizeV3Request) -> pb.TensorArraySizeV3Response:
    resp = pb.TensorArraySizeV3Response()
    io.output(ta_ops.size(io.session, io.handle(req.handle)), resp, "size", False)
    return resp


def TensorArrayCloseV3(
    io: CallIO, req: pb.TensorArrayCloseV3Request
) -> pb.TensorArrayCloseV3Response:
    ta_ops.close(io.session, io.handle(req.handle))
    return pb.TensorArrayCloseV3Response()


def TensorArrayGradV3(io: CallIO, req: pb.TensorArrayGradV3Request) -> pb.TensorArrayGradV3Response:
    handle, ta = ta_ops.grad(io.session, io.handle(req.handle), req.source)
    io.produce("grad_handle", handle)
    return pb.TensorArrayGradV3Response(grad_handle=_handle(handle, ta.name), flow_out=0.0)


def TensorArrayGradWithShape(
    io: CallIO, req: pb.TensorArrayGradWithShapeRequest
) -> pb.TensorArrayGradWithShapeResponse:
    handle, ta = ta_ops.grad(
        io.session,
        io.handle(req.handle),
        req.source,
        io.input(req.shape_to_prepend, "shape_to_prepend"),
    )
    io.produce("grad_handle", handle)
    return pb.TensorArrayGradWithShapeResponse(grad_handle=_handle(handle, ta.name), flow_out=0.0)
