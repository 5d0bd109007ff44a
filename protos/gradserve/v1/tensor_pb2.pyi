from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DT_INVALID: _ClassVar[DType]
    DT_BOOL: _ClassVar[DType]
    DT_INT8: _ClassVar[DType]
    DT_INT16: _ClassVar[DType]
    DT_INT32: _ClassVar[DType]
    DT_INT64: _ClassVar[DType]
    DT_UINT8: _ClassVar[DType]
    DT_UINT16: _ClassVar[DType]
    DT_UINT32: _ClassVar[DType]
    DT_UINT64: _ClassVar[DType]
    DT_FLOAT16: _ClassVar[DType]
    DT_FLOAT32: _ClassVar[DType]
    DT_FLOAT64: _ClassVar[DType]
    DT_COMPLEX64: _ClassVar[DType]
    DT_COMPLEX128: _ClassVar[DType]
    DT_BFLOAT16: _ClassVar[DType]
    DT_STRING: _ClassVar[DType]
DT_INVALID: DType
DT_BOOL: DType
DT_INT8: DType
DT_INT16: DType
DT_INT32: DType
DT_INT64: DType
DT_UINT8: DType
DT_UINT16: DType
DT_UINT32: DType
DT_UINT64: DType
DT_FLOAT16: DType
DT_FLOAT32: DType
DT_FLOAT64: DType
DT_COMPLEX64: DType
DT_COMPLEX128: DType
DT_BFLOAT16: DType
DT_STRING: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "content", "padding")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    content: bytes
    padding: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., content: _Optional[bytes] = ..., padding: _Optional[bytes] = ...) -> None: ...

class ResidentTensor(_message.Message):
    __slots__ = ("id", "dtype", "shape", "transient")
    ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_FIELD_NUMBER: _ClassVar[int]
    id: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    transient: bool
    def __init__(self, id: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., transient: _Optional[bool] = ...) -> None: ...

class TensorInput(_message.Message):
    __slots__ = ("value", "ref", "step_output", "shared")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    STEP_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    value: Tensor
    ref: str
    step_output: StepOutput
    shared: SharedTensor
    def __init__(self, value: _Optional[_Union[Tensor, _Mapping]] = ..., ref: _Optional[str] = ..., step_output: _Optional[_Union[StepOutput, _Mapping]] = ..., shared: _Optional[_Union[SharedTensor, _Mapping]] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("step", "field")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    step: int
    field: str
    def __init__(self, step: _Optional[int] = ..., field: _Optional[str] = ...) -> None: ...

class TensorOutput(_message.Message):
    __slots__ = ("value", "ref", "shared", "tape_id")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    TAPE_ID_FIELD_NUMBER: _ClassVar[int]
    value: Tensor
    ref: ResidentTensor
    shared: SharedTensor
    tape_id: str
    def __init__(self, value: _Optional[_Union[Tensor, _Mapping]] = ..., ref: _Optional[_Union[ResidentTensor, _Mapping]] = ..., shared: _Optional[_Union[SharedTensor, _Mapping]] = ..., tape_id: _Optional[str] = ...) -> None: ...

class PartialShape(_message.Message):
    __slots__ = ("unknown_rank", "dims")
    UNKNOWN_RANK_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    unknown_rank: bool
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, unknown_rank: _Optional[bool] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("dtype", "shape", "data", "content_bytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CONTENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    content_bytes: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., content_bytes: _Optional[int] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("region", "offset", "dtype", "shape")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...
