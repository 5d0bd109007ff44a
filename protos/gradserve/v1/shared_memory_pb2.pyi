from gradserve.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "key", "byte_size", "nonce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    byte_size: int
    nonce: bytes
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., byte_size: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = ("unregistered",)
    UNREGISTERED_FIELD_NUMBER: _ClassVar[int]
    unregistered: int
    def __init__(self, unregistered: _Optional[int] = ...) -> None: ...

class PutSharedTensorRequest(_message.Message):
    __slots__ = ("tensor",)
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.SharedTensor
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.SharedTensor, _Mapping]] = ...) -> None: ...

class GetSharedTensorRequest(_message.Message):
    __slots__ = ("id", "region", "offset", "delete_after")
    ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DELETE_AFTER_FIELD_NUMBER: _ClassVar[int]
    id: str
    region: str
    offset: int
    delete_after: bool
    def __init__(self, id: _Optional[str] = ..., region: _Optional[str] = ..., offset: _Optional[int] = ..., delete_after: _Optional[bool] = ...) -> None: ...

class GetSharedTensorResponse(_message.Message):
    __slots__ = ("tensor",)
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.SharedTensor
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.SharedTensor, _Mapping]] = ...) -> None: ...
