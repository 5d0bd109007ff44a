from gradserve.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorArrayHandle(_message.Message):
    __slots__ = ("id", "name", "from_step")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    from_step: _tensor_pb2.StepOutput
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., from_step: _Optional[_Union[_tensor_pb2.StepOutput, _Mapping]] = ...) -> None: ...

class TensorArrayV3Request(_message.Message):
    __slots__ = ("size", "dtype", "element_shape", "dynamic_size", "clear_after_read", "identical_element_shapes", "tensor_array_name")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_AFTER_READ_FIELD_NUMBER: _ClassVar[int]
    IDENTICAL_ELEMENT_SHAPES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_NAME_FIELD_NUMBER: _ClassVar[int]
    size: _tensor_pb2.TensorInput
    dtype: _tensor_pb2.DType
    element_shape: _tensor_pb2.PartialShape
    dynamic_size: bool
    clear_after_read: bool
    identical_element_shapes: bool
    tensor_array_name: str
    def __init__(self, size: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., element_shape: _Optional[_Union[_tensor_pb2.PartialShape, _Mapping]] = ..., dynamic_size: _Optional[bool] = ..., clear_after_read: _Optional[bool] = ..., identical_element_shapes: _Optional[bool] = ..., tensor_array_name: _Optional[str] = ...) -> None: ...

class TensorArrayV3Response(_message.Message):
    __slots__ = ("handle", "flow")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    flow: float
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., flow: _Optional[float] = ...) -> None: ...

class TensorArrayWriteV3Request(_message.Message):
    __slots__ = ("handle", "index", "value", "flow_in")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOW_IN_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    index: _tensor_pb2.TensorInput
    value: _tensor_pb2.TensorInput
    flow_in: float
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., index: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., value: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., flow_in: _Optional[float] = ...) -> None: ...

class TensorArrayWriteV3Response(_message.Message):
    __slots__ = ("flow_out",)
    FLOW_OUT_FIELD_NUMBER: _ClassVar[int]
    flow_out: float
    def __init__(self, flow_out: _Optional[float] = ...) -> None: ...

class TensorArrayReadV3Request(_message.Message):
    __slots__ = ("handle", "index", "flow_in", "dtype", "keep_outputs")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FLOW_IN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    index: _tensor_pb2.TensorInput
    flow_in: float
    dtype: _tensor_pb2.DType
    keep_outputs: bool
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., index: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., flow_in: _Optional[float] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., keep_outputs: _Optional[bool] = ...) -> None: ...

class TensorArrayReadV3Response(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: _tensor_pb2.TensorOutput
    def __init__(self, value: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ...) -> None: ...

class TensorArrayGatherV3Request(_message.Message):
    __slots__ = ("handle", "indices", "flow_in", "dtype", "element_shape", "keep_outputs")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    FLOW_IN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    indices: _tensor_pb2.TensorInput
    flow_in: float
    dtype: _tensor_pb2.DType
    element_shape: _tensor_pb2.PartialShape
    keep_outputs: bool
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., indices: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., flow_in: _Optional[float] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., element_shape: _Optional[_Union[_tensor_pb2.PartialShape, _Mapping]] = ..., keep_outputs: _Optional[bool] = ...) -> None: ...

class TensorArrayGatherV3Response(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: _tensor_pb2.TensorOutput
    def __init__(self, value: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ...) -> None: ...

class TensorArrayScatterV3Request(_message.Message):
    __slots__ = ("handle", "indices", "value", "flow_in")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOW_IN_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    indices: _tensor_pb2.TensorInput
    value: _tensor_pb2.TensorInput
    flow_in: float
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., indices: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., value: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., flow_in: _Optional[float] = ...) -> None: ...

class TensorArrayScatterV3Response(_message.Message):
    __slots__ = ("flow_out",)
    FLOW_OUT_FIELD_NUMBER: _ClassVar[int]
    flow_out: float
    def __init__(self, flow_out: _Optional[float] = ...) -> None: ...

class TensorArrayConcatV3Request(_message.Message):
    __slots__ = ("handle", "flow_in", "dtype", "element_shape_except0", "keep_outputs")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FLOW_IN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_SHAPE_EXCEPT0_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    flow_in: float
    dtype: _tensor_pb2.DType
    element_shape_except0: _tensor_pb2.PartialShape
    keep_outputs: bool
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., flow_in: _Optional[float] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., element_shape_except0: _Optional[_Union[_tensor_pb2.PartialShape, _Mapping]] = ..., keep_outputs: _Optional[bool] = ...) -> None: ...

class TensorArrayConcatV3Response(_message.Message):
    __slots__ = ("value", "lengths")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    value: _tensor_pb2.TensorOutput
    lengths: _tensor_pb2.TensorOutput
    def __init__(self, value: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., lengths: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ...) -> None: ...

class TensorArraySplitV3Request(_message.Message):
    __slots__ = ("handle", "value", "lengths", "flow_in")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    FLOW_IN_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    value: _tensor_pb2.TensorInput
    lengths: _tensor_pb2.TensorInput
    flow_in: float
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., value: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., lengths: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., flow_in: _Optional[float] = ...) -> None: ...

class TensorArraySplitV3Response(_message.Message):
    __slots__ = ("flow_out",)
    FLOW_OUT_FIELD_NUMBER: _ClassVar[int]
    flow_out: float
    def __init__(self, flow_out: _Optional[float] = ...) -> None: ...

class TensorArraySizeV3Request(_message.Message):
    __slots__ = ("handle", "flow_in")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FLOW_IN_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    flow_in: float
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., flow_in: _Optional[float] = ...) -> None: ...

class TensorArraySizeV3Response(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: _tensor_pb2.TensorOutput
    def __init__(self, size: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ...) -> None: ...

class TensorArrayCloseV3Request(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ...) -> None: ...

class TensorArrayCloseV3Response(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorArrayGradV3Request(_message.Message):
    __slots__ = ("handle", "flow_in", "source")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FLOW_IN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    flow_in: float
    source: str
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., flow_in: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class TensorArrayGradV3Response(_message.Message):
    __slots__ = ("grad_handle", "flow_out")
    GRAD_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FLOW_OUT_FIELD_NUMBER: _ClassVar[int]
    grad_handle: TensorArrayHandle
    flow_out: float
    def __init__(self, grad_handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., flow_out: _Optional[float] = ...) -> None: ...

class TensorArrayGradWithShapeRequest(_message.Message):
    __slots__ = ("handle", "flow_in", "shape_to_prepend", "source")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FLOW_IN_FIELD_NUMBER: _ClassVar[int]
    SHAPE_TO_PREPEND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    handle: TensorArrayHandle
    flow_in: float
    shape_to_prepend: _tensor_pb2.TensorInput
    source: str
    def __init__(self, handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., flow_in: _Optional[float] = ..., shape_to_prepend: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., source: _Optional[str] = ...) -> None: ...

class TensorArrayGradWithShapeResponse(_message.Message):
    __slots__ = ("grad_handle", "flow_out")
    GRAD_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FLOW_OUT_FIELD_NUMBER: _ClassVar[int]
    grad_handle: TensorArrayHandle
    flow_out: float
    def __init__(self, grad_handle: _Optional[_Union[TensorArrayHandle, _Mapping]] = ..., flow_out: _Optional[float] = ...) -> None: ...

class StopGradientRequest(_message.Message):
    __slots__ = ("input", "keep_outputs")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    input: _tensor_pb2.TensorInput
    keep_outputs: bool
    def __init__(self, input: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., keep_outputs: _Optional[bool] = ...) -> None: ...

class StopGradientResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: _tensor_pb2.TensorOutput
    def __init__(self, output: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ...) -> None: ...
