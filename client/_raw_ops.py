"""``client.raw_ops``: the ops under ``tf.raw_ops`` names, arguments and output order.

Each method builds the op's typed request and hands it to a ``submit``
function: the client's (one RPC) or a batch's (recorded, run later). The
``name`` argument of ``tf.raw_ops`` is accepted and ignored; ``keep=True``
keeps tensor outputs in the session and returns ``TensorRef``s instead.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import Message

from gradserve import codec, dtypes, shapes
from gradserve.client import _attrs as attrs
from gradserve.client._convert import cannot_convert, is_plain_python, to_array, unsupported_type
from gradserve.client._types import StepOutput, TapedArray, TensorArrayHandle, TensorRef
from gradserve.errors import ConversionError
from gradserve.lstm_signature import GRAD_ARGUMENTS, LSTMActivations, LSTMGrads, LSTMInputs
from gradserve.v1 import lstm_pb2
from gradserve.v1 import tensor_array_pb2 as pb

Submit = Callable[[str, Message, Callable[[Any], Any], "Staging"], Any]


class Staging(list):
    """The temporary uploads of one request (a list of tensor ids to delete after
    it) and the inline bytes its message may still carry: an input that does not
    fit is uploaded first (``PutTensor``) and passed by reference, so no request
    grows past the message limit. Each op has its own (a Batch then sends its steps
    in as many requests as they need)."""

    def __init__(self, inline_bytes: int) -> None:
        super().__init__()
        self.inline_left = inline_bytes
        #: The bytes of each of the op's outputs, where known before the call (the
        #: LSTM ops): the client leases an output region that large up front.
        self.output_sizes: tuple[int, ...] = ()
        #: The dtype of the op's tensor outputs where known before the call: a
        #: batch's placeholders carry it (``StepOutput.dtype``).
        self.output_dtype: np.dtype | None = None
        #: The tapes that hold the inputs named by their tape ids: alive until the
        #: request has been sent (a batch's: until ``run()``), so that none of them is
        #: dropped and released in between (``GradientTape``'s finalizer).
        self.tapes_named: list[Any] = []
        #: The outputs named by their tape ids, each with the recordings that held it
        #: then: a batch sends by value one that all of them released before it ran.
        self.outputs_named: list[tuple[Any, tuple[Any, ...]]] = []
        #: The batch placeholders the request names: a batch refuses another's
        #: (``StepOutput.batch``), a direct call any.
        self.placeholders: list[StepOutput] = []


class TensorArrayV3Output(NamedTuple):
    handle: TensorArrayHandle
    flow: np.float32


class TensorArrayGradV3Output(NamedTuple):
    grad_handle: TensorArrayHandle
    flow_out: np.float32


def _flow(value: float) -> np.float32:
    """A flow as TensorFlow gives it: a float32 scalar (``.numpy()`` of its tensor);
    it was a Python float."""
    return np.float32(value)


# The LSTM ops return ``LSTMActivations`` (i, cs, f, o, ci, co, h) and ``LSTMGrads``
# (x_grad, ..., b_grad) of ``gradserve.lstm_signature``.
_LSTM_INPUTS = LSTMInputs._fields
_LSTM_GRAD_INPUTS = GRAD_ARGUMENTS


class TensorArrayConcatV3Output(NamedTuple):
    value: Any
    lengths: np.ndarray


def _flow_in(value: Any) -> float:
    """A ``flow_in`` input, converted as TensorFlow converts a float tensor (None and
    strings refused as it refuses them; an array or a list taken). Its value only
    orders ops (``dummy``, as in TensorFlow): its first element goes, or 0.0 where it
    has none, and the flow returned is a float32 scalar where TensorFlow passes a
    flow of another shape through."""
    if type(value) is np.float32 or isinstance(value, float):
        return float(value)  # the hot path: a flow this SDK returned (or 0.0)
    array = to_array(value, np.float32)
    if array.size and array.dtype.kind in "USc":
        raise TypeError(cannot_convert(value, "float"))
    return float(np.asarray(array, np.float32).flat[0]) if array.size else 0.0


def _handle_msg(handle: Any, temps: Staging) -> pb.TensorArrayHandle:
    handle = getattr(handle, "handle", handle)  # a gradserve.TensorArray
    if isinstance(handle, StepOutput):  # made by an earlier step of a batch
        temps.placeholders.append(handle)
        msg = pb.TensorArrayHandle()
        msg.from_step.step, msg.from_step.field = handle.step, handle.field
        return msg
    if not isinstance(handle, TensorArrayHandle):  # as TensorFlow converts a resource
        if handle is None:
            raise ConversionError(unsupported_type(handle))
        if isinstance(handle, (np.ndarray, np.generic)):  # a flow passed as the handle
            raise ConversionError(
                "Failed to convert a NumPy array to a Tensor (Unexpected numpy data type)."
            )
        raise TypeError(cannot_convert(handle, "resource"))
    return pb.TensorArrayHandle(id=handle.id, name=handle.name)


def _handle(msg: pb.TensorArrayHandle) -> TensorArrayHandle:
    return TensorArrayHandle(msg.id, msg.name)


def _set_shape(msg: Message, field: str, shape) -> None:
    """Set a PartialShape field from a ``shape`` attribute (``attrs.make_shape``);
    ``None`` leaves it unset (unknown rank)."""
    dims = attrs.make_shape(shape, field)
    if dims is not None:
        codec.encode_shape(shapes.make(dims), getattr(msg, field))


def _dtype(value: Any, arg_name: str = "dtype") -> np.dtype:
    """A ``type`` attribute (``attrs.make_type``) as a supported NumPy dtype."""
    return attrs.make_type(value, arg_name)


class RawOps:
    """The ops, called the way ``tf.raw_ops`` calls them."""

    def __init__(self, client, submit: Submit, staging: Callable[[], Staging]) -> None:
        """``submit(rpc, request, parse, temps)`` runs (or records) an op; ``staging()``
        gives each op's request its temporary uploads and inline budget."""
        self._client = client
        self._submit = submit
        self._make_staging = staging
        self._local = threading.local()

    def _unsent(self) -> list[Staging]:
        """This thread's stagings of ops being built, not yet handed to ``submit``."""
        unsent = getattr(self._local, "unsent", None)
        if unsent is None:
            unsent = self._local.unsent = []
        return unsent

    def _staging(self) -> Staging:
        staging = self._make_staging()
        self._unsent().append(staging)
        return staging

    def _op(self, rpc: str, request: Message, parse, temps: Staging) -> Any:
        unsent = self._unsent()  # ``submit`` owns them from here
        unsent[:] = [s for s in unsent if s is not temps]
        return self._submit(rpc, request, parse, temps)

    def _in(self, value, msg, temps: Staging, dtype=None) -> None:
        self._client.encode_input(value, msg, temps, dtype)

    def _out(self, msg):
        return self._client.decode_output(msg)

    # ------------------------------------------------------------------ TensorArray
    def TensorArrayV3(
        self,
        size,
        dtype,
        element_shape=None,
        dynamic_size=False,
        clear_after_read=True,
        identical_element_shapes=False,
        tensor_array_name="",
        name=None,
    ) -> TensorArrayV3Output:
        temps = self._staging()
        req = pb.TensorArrayV3Request(
            dtype=codec.dtype_to_enum(_dtype(dtype)),
            dynamic_size=attrs.make_bool(dynamic_size, "dynamic_size", False),
            clear_after_read=attrs.make_bool(clear_after_read, "clear_after_read", True),
            identical_element_shapes=attrs.make_bool(
                identical_element_shapes, "identical_element_shapes", False
            ),
            tensor_array_name=attrs.make_str(tensor_array_name, "tensor_array_name", ""),
        )
        self._in(size, req.size, temps, np.int32)
        _set_shape(req, "element_shape", element_shape)
        return self._op(
            "TensorArrayV3",
            req,
            lambda r: TensorArrayV3Output(_handle(r.handle), _flow(r.flow)),
            temps,
        )

    def TensorArrayWriteV3(self, handle, index, value, flow_in, name=None) -> np.float32:
        temps = self._staging()
        req = pb.TensorArrayWriteV3Request(
            handle=_handle_msg(handle, temps), flow_in=_flow_in(flow_in)
        )
        self._in(index, req.index, temps, np.int32)
        self._in(value, req.value, temps)
        return self._op("TensorArrayWriteV3", req, lambda r: _flow(r.flow_out), temps)

    def TensorArrayReadV3(self, handle, index, flow_in, dtype, name=None, *, keep=False):
        temps = self._staging()
        dtype = _dtype(dtype)
        req = pb.TensorArrayReadV3Request(
            handle=_handle_msg(handle, temps),
            flow_in=_flow_in(flow_in),
            dtype=codec.dtype_to_enum(dtype),
            keep_outputs=keep,
        )
        self._in(index, req.index, temps, np.int32)
        temps.output_dtype = dtype
        return self._op("TensorArrayReadV3", req, lambda r: self._out(r.value), temps)

    def TensorArrayGatherV3(
        self, handle, indices, flow_in, dtype, element_shape=None, name=None, *, keep=False
    ):
        temps = self._staging()
        dtype = _dtype(dtype)
        req = pb.TensorArrayGatherV3Request(
            handle=_handle_msg(handle, temps),
            flow_in=_flow_in(flow_in),
            dtype=codec.dtype_to_enum(dtype),
            keep_outputs=keep,
        )
        self._in(indices, req.indices, temps, np.int32)
        _set_shape(req, "element_shape", element_shape)
        temps.output_dtype = dtype
        return self._op("TensorArrayGatherV3", req, lambda r: self._out(r.value), temps)

    def TensorArrayScatterV3(self, handle, indices, value, flow_in, name=None) -> np.float32:
        temps = self._staging()
        req = pb.TensorArrayScatterV3Request(
            handle=_handle_msg(handle, temps), flow_in=_flow_in(flow_in)
        )
        self._in(indices, req.indices, temps, np.int32)
        self._in(value, req.value, temps)
        return self._op("TensorArrayScatterV3", req, lambda r: _flow(r.flow_out), temps)

    def TensorArrayConcatV3(
        self, handle, flow_in, dtype, element_shape_except0=None, name=None, *, keep=False
    ) -> TensorArrayConcatV3Output:
        dtype = _dtype(dtype)
        temps = self._staging()  # no inputs to stage: its placeholder, if any
        req = pb.TensorArrayConcatV3Request(
            handle=_handle_msg(handle, temps),
            flow_in=_flow_in(flow_in),
            dtype=codec.dtype_to_enum(dtype),
            keep_outputs=keep,
        )
        _set_shape(req, "element_shape_except0", element_shape_except0)
        temps.output_dtype = dtype
        return self._op(
            "TensorArrayConcatV3",
            req,
            lambda r: TensorArrayConcatV3Output(self._out(r.value), self._out(r.lengths)),
            temps,
        )

    def TensorArraySplitV3(self, handle, value, lengths, flow_in, name=None) -> np.float32:
        temps = self._staging()
        req = pb.TensorArraySplitV3Request(
            handle=_handle_msg(handle, temps), flow_in=_flow_in(flow_in)
        )
        self._in(value, req.value, temps)
        self._in(lengths, req.lengths, temps, np.int64)
        return self._op("TensorArraySplitV3", req, lambda r: _flow(r.flow_out), temps)

    def TensorArraySizeV3(self, handle, flow_in, name=None) -> np.int32:
        temps = self._staging()  # no inputs to stage: its placeholder, if any
        req = pb.TensorArraySizeV3Request(
            handle=_handle_msg(handle, temps), flow_in=_flow_in(flow_in)
        )
        return self._op("TensorArraySizeV3", req, lambda r: self._out(r.size)[()], temps)

    def TensorArrayCloseV3(self, handle, name=None) -> None:
        temps = self._staging()  # no inputs to stage: its placeholder, if any
        req = pb.TensorArrayCloseV3Request(handle=_handle_msg(handle, temps))
        return self._op("TensorArrayCloseV3", req, lambda r: None, temps)

    def TensorArrayGradV3(self, handle, flow_in, source, name=None) -> TensorArrayGradV3Output:
        temps = self._staging()  # no inputs to stage: its placeholder, if any
        req = pb.TensorArrayGradV3Request(
            handle=_handle_msg(handle, temps),
            flow_in=_flow_in(flow_in),
            source=attrs.make_str(source, "source"),
        )
        return self._op(
            "TensorArrayGradV3",
            req,
            lambda r: TensorArrayGradV3Output(_handle(r.grad_handle), _flow(r.flow_out)),
            temps,
        )

    def TensorArrayGradWithShape(
        self, handle, flow_in, shape_to_prepend, source, name=None
    ) -> TensorArrayGradV3Output:
        temps = self._staging()
        req = pb.TensorArrayGradWithShapeRequest(
            handle=_handle_msg(handle, temps),
            flow_in=_flow_in(flow_in),
            source=attrs.make_str(source, "source"),
        )
        self._in(shape_to_prepend, req.shape_to_prepend, temps, np.int32)
        return self._op(
            "TensorArrayGradWithShape",
            req,
            lambda r: TensorArrayGradV3Output(_handle(r.grad_handle), _flow(r.flow_out)),
            temps,
        )

    # ------------------------------------------------------------------ StopGradient
    def StopGradient(self, input, name=None, *, keep=False):  # noqa: A002 - TF's name
        temps = self._staging()
        req = pb.StopGradientRequest(keep_outputs=keep)
        self._in(input, req.input, temps)
        temps.output_dtype = dtype_of(input)
        return self._op("StopGradient", req, lambda r: self._out(r.output), temps)

    # ------------------------------------------------------------------ LSTM
    def _lstm(self, rpc: str, req: Any, values: dict, names: tuple[str, ...], parse):
        temps = self._staging()
        self._in(values.pop("seq_len_max"), req.seq_len_max, temps, np.int64)
        inputs = _matching(values[field] for field in names)
        for field, value in zip(names, inputs):
            self._in(value, getattr(req, field), temps)
        # T: every input has it now (or the server refuses the op); an unknown
        # placeholder's (x from an earlier batch step) is any other input's.
        temps.output_dtype = next((d for d in map(dtype_of, inputs) if d is not None), None)
        if not req.keep_outputs:
            temps.output_sizes = _lstm_output_sizes(rpc, values)
        return self._op(rpc, req, parse, temps)

    def _lstm_out(self, r) -> LSTMActivations:
        return LSTMActivations(*(self._out(getattr(r, k)) for k in LSTMActivations._fields))

    def _lstm_grad_out(self, r) -> LSTMGrads:
        return LSTMGrads(*(self._out(getattr(r, k)) for k in LSTMGrads._fields))

    def BlockLSTMV2(
        self, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, cell_clip=0.0,
        use_peephole=False, name=None, *, keep=False,
    ) -> LSTMActivations:  # fmt: skip
        """Gate layout IFCO; ``keep=True`` keeps the seven outputs on the server."""
        values = dict(locals())
        req = lstm_pb2.BlockLSTMV2Request(
            cell_clip=attrs.make_float(cell_clip, "cell_clip", 0.0),
            use_peephole=attrs.make_bool(use_peephole, "use_peephole", False),
            keep_outputs=keep,
        )
        return self._lstm("BlockLSTMV2", req, values, _LSTM_INPUTS, self._lstm_out)

    def BlockLSTM(
        self, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, forget_bias=1.0,
        cell_clip=3.0, use_peephole=False, name=None, *, keep=False,
    ) -> LSTMActivations:  # fmt: skip
        """The V1 op: gate layout ICFO, with forget bias."""
        values = dict(locals())
        req = lstm_pb2.BlockLSTMRequest(
            forget_bias=attrs.make_float(forget_bias, "forget_bias", 1.0),
            cell_clip=attrs.make_float(cell_clip, "cell_clip", 3.0),
            use_peephole=attrs.make_bool(use_peephole, "use_peephole", False),
            keep_outputs=keep,
        )
        return self._lstm("BlockLSTM", req, values, _LSTM_INPUTS, self._lstm_out)

    def BlockLSTMGradV2(
        self, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h,
        cs_grad, h_grad, use_peephole, name=None, *, keep=False,
    ) -> LSTMGrads:  # fmt: skip
        """Backward over the whole sequence (IFCO). Any input may be a ``TensorRef``.

        TensorFlow's kernel semantics: it has no ``cell_clip`` attribute, so a cell the
        forward clipped passes gradient as if unclipped (``client.gradient_tape()``
        masks clipped cells: the true derivative)."""
        values = dict(locals())
        req = lstm_pb2.BlockLSTMGradRequest(
            use_peephole=attrs.make_bool(use_peephole, "use_peephole"), keep_outputs=keep
        )
        return self._lstm("BlockLSTMGradV2", req, values, _LSTM_GRAD_INPUTS, self._lstm_grad_out)

    def BlockLSTMGrad(
        self, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h,
        cs_grad, h_grad, use_peephole, name=None, *, keep=False,
    ) -> LSTMGrads:  # fmt: skip
        """The V1 backward (ICFO), with TensorFlow's kernel semantics: the forward's
        ``cell_clip`` is ignored (the gradient tape masks clipped cells)."""
        values = dict(locals())
        req = lstm_pb2.BlockLSTMGradRequest(
            use_peephole=attrs.make_bool(use_peephole, "use_peephole"), keep_outputs=keep
        )
        return self._lstm("BlockLSTMGrad", req, values, _LSTM_GRAD_INPUTS, self._lstm_grad_out)


def _matching(values: Any) -> list[Any]:
    """An LSTM op's inputs, which share one type (``T``), converted as eager
    TensorFlow converts them (``args_to_matching_eager``): ``T`` is the dtype of the
    first tensor among the inputs (a ``TensorRef`` or ``TapedArray``), else of the
    first input, and every other value — Python numbers, lists, arrays — converts to
    it (a float16 tensor or ``x`` makes float32 or float64 arrays float16, as
    tf.raw_ops does, rounding). Lists of floats with a float16 ``x`` were float32 and
    the op was refused (found by a review helper). A tensor of another dtype is
    refused by the server, as TensorFlow refuses it; so is a value of another kind
    (bool, complex, string), and anything when ``T`` is not a float. Another
    framework's tensor counts as a tensor (``_is_foreign_tensor``)."""
    values = list(values)
    foreign = [_is_foreign_tensor(v) for v in values]
    arrays = [None if isinstance(v, _TENSORS + (StepOutput,)) else to_array(v) for v in values]
    dtype = next(
        (
            np.dtype(v.dtype) if a is None else a.dtype
            for v, a, f in zip(values, arrays, foreign)
            if isinstance(v, _TENSORS) or f or (isinstance(v, StepOutput) and v.dtype is not None)
        ),
        None,
    )
    out: list[Any] = []
    for value, array, is_tensor in zip(values, arrays, foreign):
        if array is None:
            out.append(value)
            continue
        if dtype is None:
            dtype = array.dtype
        elif (
            not is_tensor
            and array.dtype != dtype
            and array.dtype.kind in "iuf"
            and dtype.kind == "f"
        ):
            if is_plain_python(value):
                array = np.asarray(value, dtype)  # from the Python numbers, rounded once
            else:
                array = array.astype(dtype)
        out.append(array)
    return out


def dtype_of(value: Any) -> np.dtype | None:
    """The dtype ``value`` has as an op input, where the SDK knows it (a batch
    placeholder's may be unknown: None)."""
    if isinstance(value, StepOutput):
        return value.dtype
    try:
        return dtypes.normalize(value.dtype if hasattr(value, "dtype") else to_array(value).dtype)
    except (TypeError, ValueError, dtypes.UnsupportedDTypeError):
        return None


_TENSORS = (TensorRef, TapedArray)


def _is_foreign_tensor(value: Any) -> bool:
    """Another framework's tensor (TensorFlow, torch, CuPy): a tensor to TensorFlow's
    conversion too, so it sets ``T`` and is not converted (one of another dtype is
    refused, as TensorFlow refuses it). Found by a review helper: a float16 x array
    among float32 ``tf.constant``s computed in float16 (TF: float32)."""
    return (
        not isinstance(value, (np.ndarray, np.generic, *_TENSORS))
        and hasattr(value, "dtype")
        and (hasattr(value, "__array__") or hasattr(value, "__dlpack__"))
    )


def _lstm_output_sizes(rpc: str, values: dict) -> tuple[int, ...]:
    """The bytes of each output of an LSTM op, from its inputs' shapes and dtype (none
    where one is not known here: a placeholder of a batch step, a malformed input)."""
    try:
        steps, batch, inputs = _shape(values["x"])
        units = _shape(values["cs_prev"])[1]
        itemsize = np.dtype(getattr(values["x"], "dtype", np.float32)).itemsize
    except (TypeError, ValueError, IndexError):
        return ()
    if rpc in ("BlockLSTMV2", "BlockLSTM"):
        return (steps * batch * units * itemsize,) * 7
    sizes = (steps * batch * inputs, batch * units, batch * units, (inputs + units) * 4 * units)
    return tuple(n * itemsize for n in (*sizes, units, units, units, 4 * units))


def _shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, StepOutput):
        raise ValueError("a batch placeholder: its shape is the server's")
    return tuple(int(n) for n in getattr(value, "shape", None) or np.shape(value))


def _releases_unsent(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an op: if building its request fails (a bad argument after an input was
    already placed in shared memory or uploaded), what it staged is released (leases
    back to the pool, uploads deleted) instead of being held until the client closes."""

    @functools.wraps(method)
    def op(self: RawOps, *args: Any, **kwargs: Any) -> Any:
        unsent = self._unsent()
        mark = len(unsent)
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            for staging in unsent[mark:]:
                self._client._clean_up(staging)
            raise
        finally:
            del unsent[mark:]

    return op


for _name, _method in list(vars(RawOps).items()):
    if _name[:1].isupper() and callable(_method):
        setattr(RawOps, _name, _releases_unsent(_method))
