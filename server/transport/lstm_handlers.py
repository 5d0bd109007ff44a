"""The LSTM op RPCs: request -> ``core.ops.lstm_ops`` -> response.

Each handler is named after its op. The request's tensor fields are those of
``gradserve.lstm_signature`` (a test checks the proto against it), so arguments
and results are read and written by field name: no list of names here.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

from google.protobuf.message import Message

from gradserve.lstm_signature import LSTMActivations, LSTMInputs, LSTMOutputGrads
from gradserve.server.core.ops import lstm_ops, recording
from gradserve.server.core.sessions import TensorArg
from gradserve.server.transport.wire import CallIO
from gradserve.v1 import lstm_pb2

Part = TypeVar("Part", bound=NamedTuple)


def _args(io: CallIO, req: Any, part: type[Part]) -> Part:
    """The request's tensors of one part of the signature, as op arguments."""
    values: list[TensorArg] = [io.tensor(getattr(req, f), f) for f in part._fields]
    return part(*values)  # type: ignore[call-overload]


def _respond(
    io: CallIO, result: NamedTuple, resp: Message, keep: bool, tape_ids: Any = None
) -> Message:
    for n, (field, value) in enumerate(result._asdict().items()):
        io.output(value, resp, field, keep, tape_ids[n] if tape_ids else None)
    return resp


def _optional(req: Message, field: str) -> Any:
    """An optional attribute's value, or None (the op's default) when unset."""
    return getattr(req, field) if req.HasField(field) else None


def _forward(io: CallIO, variant: lstm_ops.LSTMVariant, req: Any, **attrs: Any) -> Message:
    inputs = _args(io, req, LSTMInputs)
    seq_len_max = io.input(req.seq_len_max, "seq_len_max")
    outputs = lstm_ops.forward(
        io.session,
        io.compute,
        variant,
        inputs,
        seq_len_max,
        use_peephole=req.use_peephole,
        check=io.check_alive,
        **attrs,
    )
    tape_ids = None
    if io.recorder:
        tape_ids = recording.lstm(
            io.recorder,
            variant,
            inputs,
            seq_len_max,
            outputs,
            use_peephole=req.use_peephole,
            cell_clip=attrs.get("cell_clip"),
        )
    return _respond(io, outputs, lstm_pb2.BlockLSTMResponse(), req.keep_outputs, tape_ids)


def _backward(io: CallIO, variant: lstm_ops.LSTMVariant, req: Any) -> Message:
    parts = (
        _args(io, req, LSTMInputs),
        _args(io, req, LSTMActivations),
        _args(io, req, LSTMOutputGrads),
    )
    grads = lstm_ops.backward(
        io.session,
        io.compute,
        variant,
        *parts,
        io.input(req.seq_len_max, "seq_len_max"),
        use_peephole=req.use_peephole,
        check=io.check_alive,
    )
    tape_ids = None
    if io.recorder:
        inputs = [arg for part in parts for arg in part]
        tape_ids = recording.no_gradient(io.recorder, variant.grad_op, inputs, list(grads))
    return _respond(io, grads, lstm_pb2.BlockLSTMGradResponse(), req.keep_outputs, tape_ids)


def BlockLSTMV2(io: CallIO, req: lstm_pb2.BlockLSTMV2Request) -> Message:
    return _forward(io, lstm_ops.V2, req, cell_clip=req.cell_clip)


def BlockLSTM(io: CallIO, req: lstm_pb2.BlockLSTMRequest) -> Message:
    return _forward(
        io,
        lstm_ops.V1,
        req,
        cell_clip=_optional(req, "cell_clip"),
        forget_bias=_optional(req, "forget_bias"),
    )


def BlockLSTMGradV2(io: CallIO, req: lstm_pb2.BlockLSTMGradRequest) -> Message:
    return _backward(io, lstm_ops.V2, req)


def BlockLSTMGrad(io: CallIO, req: lstm_pb2.BlockLSTMGradRequest) -> Message:
    return _backward(io, lstm_ops.V1, req)
