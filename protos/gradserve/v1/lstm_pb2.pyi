from gradserve.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockLSTMV2Request(_message.Message):
    __slots__ = ("seq_len_max", "x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b", "cell_clip", "use_peephole", "keep_outputs")
    SEQ_LEN_MAX_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    CS_PREV_FIELD_NUMBER: _ClassVar[int]
    H_PREV_FIELD_NUMBER: _ClassVar[int]
    W_FIELD_NUMBER: _ClassVar[int]
    WCI_FIELD_NUMBER: _ClassVar[int]
    WCF_FIELD_NUMBER: _ClassVar[int]
    WCO_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    CELL_CLIP_FIELD_NUMBER: _ClassVar[int]
    USE_PEEPHOLE_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    seq_len_max: _tensor_pb2.TensorInput
    x: _tensor_pb2.TensorInput
    cs_prev: _tensor_pb2.TensorInput
    h_prev: _tensor_pb2.TensorInput
    w: _tensor_pb2.TensorInput
    wci: _tensor_pb2.TensorInput
    wcf: _tensor_pb2.TensorInput
    wco: _tensor_pb2.TensorInput
    b: _tensor_pb2.TensorInput
    cell_clip: float
    use_peephole: bool
    keep_outputs: bool
    def __init__(self, seq_len_max: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., x: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., cs_prev: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., h_prev: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., w: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., wci: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., wcf: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., wco: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., b: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., cell_clip: _Optional[float] = ..., use_peephole: _Optional[bool] = ..., keep_outputs: _Optional[bool] = ...) -> None: ...

class BlockLSTMRequest(_message.Message):
    __slots__ = ("seq_len_max", "x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b", "cell_clip", "use_peephole", "forget_bias", "keep_outputs")
    SEQ_LEN_MAX_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    CS_PREV_FIELD_NUMBER: _ClassVar[int]
    H_PREV_FIELD_NUMBER: _ClassVar[int]
    W_FIELD_NUMBER: _ClassVar[int]
    WCI_FIELD_NUMBER: _ClassVar[int]
    WCF_FIELD_NUMBER: _ClassVar[int]
    WCO_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    CELL_CLIP_FIELD_NUMBER: _ClassVar[int]
    USE_PEEPHOLE_FIELD_NUMBER: _ClassVar[int]
    FORGET_BIAS_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    seq_len_max: _tensor_pb2.TensorInput
    x: _tensor_pb2.TensorInput
    cs_prev: _tensor_pb2.TensorInput
    h_prev: _tensor_pb2.TensorInput
    w: _tensor_pb2.TensorInput
    wci: _tensor_pb2.TensorInput
    wcf: _tensor_pb2.TensorInput
    wco: _tensor_pb2.TensorInput
    b: _tensor_pb2.TensorInput
    cell_clip: float
    use_peephole: bool
    forget_bias: float
    keep_outputs: bool
    def __init__(self, seq_len_max: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., x: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., cs_prev: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., h_prev: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., w: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., wci: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., wcf: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., wco: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., b: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., cell_clip: _Optional[float] = ..., use_peephole: _Optional[bool] = ..., forget_bias: _Optional[float] = ..., keep_outputs: _Optional[bool] = ...) -> None: ...

class BlockLSTMResponse(_message.Message):
    __slots__ = ("i", "cs", "f", "o", "ci", "co", "h")
    I_FIELD_NUMBER: _ClassVar[int]
    CS_FIELD_NUMBER: _ClassVar[int]
    F_FIELD_NUMBER: _ClassVar[int]
    O_FIELD_NUMBER: _ClassVar[int]
    CI_FIELD_NUMBER: _ClassVar[int]
    CO_FIELD_NUMBER: _ClassVar[int]
    H_FIELD_NUMBER: _ClassVar[int]
    i: _tensor_pb2.TensorOutput
    cs: _tensor_pb2.TensorOutput
    f: _tensor_pb2.TensorOutput
    o: _tensor_pb2.TensorOutput
    ci: _tensor_pb2.TensorOutput
    co: _tensor_pb2.TensorOutput
    h: _tensor_pb2.TensorOutput
    def __init__(self, i: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., cs: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., f: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., o: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., ci: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., co: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., h: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ...) -> None: ...

class BlockLSTMGradRequest(_message.Message):
    __slots__ = ("seq_len_max", "x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b", "i", "cs", "f", "o", "ci", "co", "h", "cs_grad", "h_grad", "use_peephole", "keep_outputs")
    SEQ_LEN_MAX_FIELD_NUMBER: _ClassVar[int]
    X_FIELD_NUMBER: _ClassVar[int]
    CS_PREV_FIELD_NUMBER: _ClassVar[int]
    H_PREV_FIELD_NUMBER: _ClassVar[int]
    W_FIELD_NUMBER: _ClassVar[int]
    WCI_FIELD_NUMBER: _ClassVar[int]
    WCF_FIELD_NUMBER: _ClassVar[int]
    WCO_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    I_FIELD_NUMBER: _ClassVar[int]
    CS_FIELD_NUMBER: _ClassVar[int]
    F_FIELD_NUMBER: _ClassVar[int]
    O_FIELD_NUMBER: _ClassVar[int]
    CI_FIELD_NUMBER: _ClassVar[int]
    CO_FIELD_NUMBER: _ClassVar[int]
    H_FIELD_NUMBER: _ClassVar[int]
    CS_GRAD_FIELD_NUMBER: _ClassVar[int]
    H_GRAD_FIELD_NUMBER: _ClassVar[int]
    USE_PEEPHOLE_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    seq_len_max: _tensor_pb2.TensorInput
    x: _tensor_pb2.TensorInput
    cs_prev: _tensor_pb2.TensorInput
    h_prev: _tensor_pb2.TensorInput
    w: _tensor_pb2.TensorInput
    wci: _tensor_pb2.TensorInput
    wcf: _tensor_pb2.TensorInput
    wco: _tensor_pb2.TensorInput
    b: _tensor_pb2.TensorInput
    i: _tensor_pb2.TensorInput
    cs: _tensor_pb2.TensorInput
    f: _tensor_pb2.TensorInput
    o: _tensor_pb2.TensorInput
    ci: _tensor_pb2.TensorInput
    co: _tensor_pb2.TensorInput
    h: _tensor_pb2.TensorInput
    cs_grad: _tensor_pb2.TensorInput
    h_grad: _tensor_pb2.TensorInput
    use_peephole: bool
    keep_outputs: bool
    def __init__(self, seq_len_max: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., x: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., cs_prev: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., h_prev: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., w: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., wci: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., wcf: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., wco: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., b: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., i: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., cs: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., f: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., o: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., ci: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., co: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., h: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., cs_grad: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., h_grad: _Optional[_Union[_tensor_pb2.TensorInput, _Mapping]] = ..., use_peephole: _Optional[bool] = ..., keep_outputs: _Optional[bool] = ...) -> None: ...

class BlockLSTMGradResponse(_message.Message):
    __slots__ = ("x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad", "b_grad")
    X_GRAD_FIELD_NUMBER: _ClassVar[int]
    CS_PREV_GRAD_FIELD_NUMBER: _ClassVar[int]
    H_PREV_GRAD_FIELD_NUMBER: _ClassVar[int]
    W_GRAD_FIELD_NUMBER: _ClassVar[int]
    WCI_GRAD_FIELD_NUMBER: _ClassVar[int]
    WCF_GRAD_FIELD_NUMBER: _ClassVar[int]
    WCO_GRAD_FIELD_NUMBER: _ClassVar[int]
    B_GRAD_FIELD_NUMBER: _ClassVar[int]
    x_grad: _tensor_pb2.TensorOutput
    cs_prev_grad: _tensor_pb2.TensorOutput
    h_prev_grad: _tensor_pb2.TensorOutput
    w_grad: _tensor_pb2.TensorOutput
    wci_grad: _tensor_pb2.TensorOutput
    wcf_grad: _tensor_pb2.TensorOutput
    wco_grad: _tensor_pb2.TensorOutput
    b_grad: _tensor_pb2.TensorOutput
    def __init__(self, x_grad: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., cs_prev_grad: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., h_prev_grad: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., w_grad: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., wci_grad: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., wcf_grad: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., wco_grad: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ..., b_grad: _Optional[_Union[_tensor_pb2.TensorOutput, _Mapping]] = ...) -> None: ...
