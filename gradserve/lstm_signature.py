"""The block LSTM ops' tensors, named and ordered once.

TensorFlow's ``BlockLSTMV2`` takes ``seq_len_max`` and the eight ``LSTMInputs``
and returns the seven ``LSTMActivations``; ``BlockLSTMGradV2`` takes
``seq_len_max``, the inputs, the activations and the two ``LSTMOutputGrads`` and
returns the eight ``LSTMGrads`` (the V1 pair alike). These tuples are the
signature: the kernels take and return them, the server's op layer validates
them, the transport fills the request and response fields of the same names,
and the SDK returns them. A test checks them against ``lstm.proto``'s fields.

Each tuple is generic in what it holds: NumPy or CuPy arrays in the kernels,
arrays or resident-tensor ids in the server, arrays or ``TensorRef`` in the SDK.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


class LSTMInputs(NamedTuple, Generic[T]):
    """The forward's tensors: ``x`` [T, B, I], states [B, H], ``w`` [I + H, 4H] with
    rows [x; h], peephole weights [H], bias [4H]."""

    x: T
    cs_prev: T
    h_prev: T
    w: T
    wci: T
    wcf: T
    wco: T
    b: T


class LSTMActivations(NamedTuple, Generic[T]):
    """The forward's seven outputs, each [T, B, H], in TensorFlow's output order."""

    i: T
    cs: T
    f: T
    o: T
    ci: T
    co: T
    h: T


class LSTMOutputGrads(NamedTuple, Generic[T]):
    """Gradients of the loss with respect to the forward's ``cs`` and ``h`` outputs."""

    cs_grad: T
    h_grad: T


class LSTMGrads(NamedTuple, Generic[T]):
    """The backward's eight outputs: one gradient per ``LSTMInputs`` field, same order."""

    x_grad: T
    cs_prev_grad: T
    h_prev_grad: T
    w_grad: T
    wci_grad: T
    wcf_grad: T
    wco_grad: T
    b_grad: T


#: Field names of the backward's tensor arguments after ``seq_len_max``, in order.
GRAD_ARGUMENTS: tuple[str, ...] = (
    LSTMInputs._fields + LSTMActivations._fields + LSTMOutputGrads._fields
)
