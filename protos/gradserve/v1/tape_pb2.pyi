from gradserve.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UnconnectedGradients(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNCONNECTED_NONE: _ClassVar[UnconnectedGradients]
    UNCONNECTED_ZERO: _ClassVar[UnconnectedGradients]
UNCONNECTED_NONE: UnconnectedGradients
UNCONNECTED_ZERO: UnconnectedGradients

class StartTapeRequest(_message.Message):
    __slots__ = ("persistent", "watch_accessed_variables")
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    WATCH_ACCESSED_VARIABLES_FIELD_NUMBER: _ClassVar[int]
    persistent: bool
    watch_accessed_variables: bool
    def __init__(self, persistent: _Optional[bool] = ..., watch_accessed_variables: _Optional[bool] = ...) -> None: ...

class StartTapeResponse(_message.Message):
    __slots__ = ("tape_id",)
    TAPE_ID_FIELD_NUMBER: _ClassVar[int]
    tape_id: str
    def __init__(self, tape_id: _Optional[str] = ...) -> None: ...

class WatchTensorsRequest(_message.Message):
    __slots__ = ("tape_id", "ids", "tensors")
    TAPE_ID_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tape_id: str
    ids: _containers.RepeatedScalarFieldContainer[str]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorInput]
    def __init__(self, tape_id: _Optional[str] = ..., ids: _Optional[_Iterable[str]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorInput, _Mapping]]] = ...) -> None: ...

class WatchTensorsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseTapeRequest(_message.Message):
    __slots__ = ("tape_id",)
    TAPE_ID_FIELD_NUMBER: _ClassVar[int]
    tape_id: str
    def __init__(self, tape_id: _Optional[str] = ...) -> None: ...

class ReleaseTapeResponse(_message.Message):
    __slots__ = ("released_bytes",)
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    released_bytes: int
    def __init__(self, released_bytes: _Optional[int] = ...) -> None: ...

class GradientsRequest(_message.Message):
    __slots__ = ("tape_id", "targets", "sources", "output_gradients", "unconnected_gradients", "keep_outputs")
    TAPE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    UNCONNECTED_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    tape_id: str
    targets: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorInput]
    sources: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorInput]
    output_gradients: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorInput]
    unconnected_gradients: UnconnectedGradients
    keep_outputs: bool
    def __init__(self, tape_id: _Optional[str] = ..., targets: _Optional[_Iterable[_Union[_tensor_pb2.TensorInput, _Mapping]]] = ..., sources: _Optional[_Iterable[_Union[_tensor_pb2.TensorInput, _Mapping]]] = ..., output_gradients: _Optional[_Iterable[_Union[_tensor_pb2.TensorInput, _Mapping]]] = ..., unconnected_gradients: _Optional[_Union[UnconnectedGradients, str]] = ..., keep_outputs: _Optional[bool] = ...) -> None: ...

class GradientsResponse(_message.Message):
    __slots__ = ("gradients", "source")
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    gradients: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorOutput]
    source: str
    def __init__(self, gradients: _Optional[_Iterable[_Union[_tensor_pb2.TensorOutput, _Mapping]]] = ..., source: _Optional[str] = ...) -> None: ...
