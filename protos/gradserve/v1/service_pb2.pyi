from gradserve.v1 import tensor_pb2 as _tensor_pb2
from gradserve.v1 import lstm_pb2 as _lstm_pb2
from gradserve.v1 import tensor_array_pb2 as _tensor_array_pb2
from gradserve.v1 import tape_pb2 as _tape_pb2
from gradserve.v1 import shared_memory_pb2 as _shared_memory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id", "idle_timeout_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    idle_timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., idle_timeout_seconds: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("idle_timeout_seconds", "max_message_bytes", "deletes_fetched", "max_inline_reply_bytes")
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELETES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    MAX_INLINE_REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    idle_timeout_seconds: float
    max_message_bytes: int
    deletes_fetched: bool
    max_inline_reply_bytes: int
    def __init__(self, idle_timeout_seconds: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., deletes_fetched: _Optional[bool] = ..., max_inline_reply_bytes: _Optional[int] = ...) -> None: ...

class GetTensorRequest(_message.Message):
    __slots__ = ("id", "chunk_bytes", "delete_after")
    ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELETE_AFTER_FIELD_NUMBER: _ClassVar[int]
    id: str
    chunk_bytes: int
    delete_after: bool
    def __init__(self, id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., delete_after: _Optional[bool] = ...) -> None: ...

class DeleteTensorRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteTensorResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class BatchStep(_message.Message):
    __slots__ = ("tensor_array_v3", "tensor_array_write_v3", "tensor_array_read_v3", "tensor_array_gather_v3", "tensor_array_scatter_v3", "tensor_array_concat_v3", "tensor_array_split_v3", "tensor_array_size_v3", "tensor_array_close_v3", "tensor_array_grad_v3", "tensor_array_grad_with_shape", "stop_gradient", "block_lstm_v2", "block_lstm_grad_v2", "block_lstm", "block_lstm_grad", "gradients", "watch_tensors")
    TENSOR_ARRAY_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_WRITE_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_READ_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_GATHER_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_SCATTER_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_CONCAT_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_SPLIT_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_SIZE_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_CLOSE_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_GRAD_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_GRAD_WITH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    STOP_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LSTM_V2_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LSTM_GRAD_V2_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LSTM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LSTM_GRAD_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    WATCH_TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensor_array_v3: _tensor_array_pb2.TensorArrayV3Request
    tensor_array_write_v3: _tensor_array_pb2.TensorArrayWriteV3Request
    tensor_array_read_v3: _tensor_array_pb2.TensorArrayReadV3Request
    tensor_array_gather_v3: _tensor_array_pb2.TensorArrayGatherV3Request
    tensor_array_scatter_v3: _tensor_array_pb2.TensorArrayScatterV3Request
    tensor_array_concat_v3: _tensor_array_pb2.TensorArrayConcatV3Request
    tensor_array_split_v3: _tensor_array_pb2.TensorArraySplitV3Request
    tensor_array_size_v3: _tensor_array_pb2.TensorArraySizeV3Request
    tensor_array_close_v3: _tensor_array_pb2.TensorArrayCloseV3Request
    tensor_array_grad_v3: _tensor_array_pb2.TensorArrayGradV3Request
    tensor_array_grad_with_shape: _tensor_array_pb2.TensorArrayGradWithShapeRequest
    stop_gradient: _tensor_array_pb2.StopGradientRequest
    block_lstm_v2: _lstm_pb2.BlockLSTMV2Request
    block_lstm_grad_v2: _lstm_pb2.BlockLSTMGradRequest
    block_lstm: _lstm_pb2.BlockLSTMRequest
    block_lstm_grad: _lstm_pb2.BlockLSTMGradRequest
    gradients: _tape_pb2.GradientsRequest
    watch_tensors: _tape_pb2.WatchTensorsRequest
    def __init__(self, tensor_array_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayV3Request, _Mapping]] = ..., tensor_array_write_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayWriteV3Request, _Mapping]] = ..., tensor_array_read_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayReadV3Request, _Mapping]] = ..., tensor_array_gather_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayGatherV3Request, _Mapping]] = ..., tensor_array_scatter_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayScatterV3Request, _Mapping]] = ..., tensor_array_concat_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayConcatV3Request, _Mapping]] = ..., tensor_array_split_v3: _Optional[_Union[_tensor_array_pb2.TensorArraySplitV3Request, _Mapping]] = ..., tensor_array_size_v3: _Optional[_Union[_tensor_array_pb2.TensorArraySizeV3Request, _Mapping]] = ..., tensor_array_close_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayCloseV3Request, _Mapping]] = ..., tensor_array_grad_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayGradV3Request, _Mapping]] = ..., tensor_array_grad_with_shape: _Optional[_Union[_tensor_array_pb2.TensorArrayGradWithShapeRequest, _Mapping]] = ..., stop_gradient: _Optional[_Union[_tensor_array_pb2.StopGradientRequest, _Mapping]] = ..., block_lstm_v2: _Optional[_Union[_lstm_pb2.BlockLSTMV2Request, _Mapping]] = ..., block_lstm_grad_v2: _Optional[_Union[_lstm_pb2.BlockLSTMGradRequest, _Mapping]] = ..., block_lstm: _Optional[_Union[_lstm_pb2.BlockLSTMRequest, _Mapping]] = ..., block_lstm_grad: _Optional[_Union[_lstm_pb2.BlockLSTMGradRequest, _Mapping]] = ..., gradients: _Optional[_Union[_tape_pb2.GradientsRequest, _Mapping]] = ..., watch_tensors: _Optional[_Union[_tape_pb2.WatchTensorsRequest, _Mapping]] = ...) -> None: ...

class BatchResult(_message.Message):
    __slots__ = ("tensor_array_v3", "tensor_array_write_v3", "tensor_array_read_v3", "tensor_array_gather_v3", "tensor_array_scatter_v3", "tensor_array_concat_v3", "tensor_array_split_v3", "tensor_array_size_v3", "tensor_array_close_v3", "tensor_array_grad_v3", "tensor_array_grad_with_shape", "stop_gradient", "block_lstm_v2", "block_lstm_grad_v2", "block_lstm", "block_lstm_grad", "gradients", "watch_tensors")
    TENSOR_ARRAY_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_WRITE_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_READ_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_GATHER_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_SCATTER_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_CONCAT_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_SPLIT_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_SIZE_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_CLOSE_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_GRAD_V3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ARRAY_GRAD_WITH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    STOP_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LSTM_V2_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LSTM_GRAD_V2_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LSTM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LSTM_GRAD_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    WATCH_TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensor_array_v3: _tensor_array_pb2.TensorArrayV3Response
    tensor_array_write_v3: _tensor_array_pb2.TensorArrayWriteV3Response
    tensor_array_read_v3: _tensor_array_pb2.TensorArrayReadV3Response
    tensor_array_gather_v3: _tensor_array_pb2.TensorArrayGatherV3Response
    tensor_array_scatter_v3: _tensor_array_pb2.TensorArrayScatterV3Response
    tensor_array_concat_v3: _tensor_array_pb2.TensorArrayConcatV3Response
    tensor_array_split_v3: _tensor_array_pb2.TensorArraySplitV3Response
    tensor_array_size_v3: _tensor_array_pb2.TensorArraySizeV3Response
    tensor_array_close_v3: _tensor_array_pb2.TensorArrayCloseV3Response
    tensor_array_grad_v3: _tensor_array_pb2.TensorArrayGradV3Response
    tensor_array_grad_with_shape: _tensor_array_pb2.TensorArrayGradWithShapeResponse
    stop_gradient: _tensor_array_pb2.StopGradientResponse
    block_lstm_v2: _lstm_pb2.BlockLSTMResponse
    block_lstm_grad_v2: _lstm_pb2.BlockLSTMGradResponse
    block_lstm: _lstm_pb2.BlockLSTMResponse
    block_lstm_grad: _lstm_pb2.BlockLSTMGradResponse
    gradients: _tape_pb2.GradientsResponse
    watch_tensors: _tape_pb2.WatchTensorsResponse
    def __init__(self, tensor_array_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayV3Response, _Mapping]] = ..., tensor_array_write_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayWriteV3Response, _Mapping]] = ..., tensor_array_read_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayReadV3Response, _Mapping]] = ..., tensor_array_gather_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayGatherV3Response, _Mapping]] = ..., tensor_array_scatter_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayScatterV3Response, _Mapping]] = ..., tensor_array_concat_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayConcatV3Response, _Mapping]] = ..., tensor_array_split_v3: _Optional[_Union[_tensor_array_pb2.TensorArraySplitV3Response, _Mapping]] = ..., tensor_array_size_v3: _Optional[_Union[_tensor_array_pb2.TensorArraySizeV3Response, _Mapping]] = ..., tensor_array_close_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayCloseV3Response, _Mapping]] = ..., tensor_array_grad_v3: _Optional[_Union[_tensor_array_pb2.TensorArrayGradV3Response, _Mapping]] = ..., tensor_array_grad_with_shape: _Optional[_Union[_tensor_array_pb2.TensorArrayGradWithShapeResponse, _Mapping]] = ..., stop_gradient: _Optional[_Union[_tensor_array_pb2.StopGradientResponse, _Mapping]] = ..., block_lstm_v2: _Optional[_Union[_lstm_pb2.BlockLSTMResponse, _Mapping]] = ..., block_lstm_grad_v2: _Optional[_Union[_lstm_pb2.BlockLSTMGradResponse, _Mapping]] = ..., block_lstm: _Optional[_Union[_lstm_pb2.BlockLSTMResponse, _Mapping]] = ..., block_lstm_grad: _Optional[_Union[_lstm_pb2.BlockLSTMGradResponse, _Mapping]] = ..., gradients: _Optional[_Union[_tape_pb2.GradientsResponse, _Mapping]] = ..., watch_tensors: _Optional[_Union[_tape_pb2.WatchTensorsResponse, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("steps", "first_step")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[BatchStep]
    first_step: int
    def __init__(self, steps: _Optional[_Iterable[_Union[BatchStep, _Mapping]]] = ..., first_step: _Optional[int] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("results", "failed_step", "error")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[BatchResult]
    failed_step: int
    error: StepError
    def __init__(self, results: _Optional[_Iterable[_Union[BatchResult, _Mapping]]] = ..., failed_step: _Optional[int] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...
