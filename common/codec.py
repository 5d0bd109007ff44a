"""The wire codec: NumPy arrays to ``Tensor`` messages and back.

Nothing else serialises tensors. Decoding never copies: the array is a
read-only view (``np.frombuffer``) of the received bytes, which is also why
arrays held by the server are treated as immutable. Encoding copies once
(``tobytes``). Every malformed message — unknown dtype, negative dims, content
length that does not match the shape — is an ``InvalidArgumentError``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np

from gradserve import dtypes, shapes
from gradserve.errors import InvalidArgumentError
from gradserve.v1 import tensor_pb2

_BIG_ENDIAN_HOST = sys.byteorder == "big"

__all__ = ["encode", "decode", "element_count", "encode_shape", "decode_shape"]


#: NumPy refuses a shape whose non-zero dims multiply past this many bytes, even
#: when another dim is 0 and the array would hold nothing.
_MAX_ARRAY_BYTES = np.iinfo(np.intp).max


def element_count(shape: Sequence[int], *, field: str = "tensor", itemsize: int = 1) -> int:
    """Number of elements of a wire shape; every dim non-negative and the shape one
    NumPy can represent."""
    for d in shape:
        if d < 0:
            raise InvalidArgumentError(
                f"{field}: shape {list(shape)} has a negative dimension", field=field
            )
    if math.prod(d for d in shape if d) * itemsize > _MAX_ARRAY_BYTES:
        raise InvalidArgumentError(f"{field}: shape {list(shape)} is too large", field=field)
    return math.prod(shape)


def encode(array: np.ndarray, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """A ``Tensor`` message holding ``array`` (little-endian, C order)."""
    array = np.asarray(array)
    dtype = dtypes.normalize(array.dtype)
    msg = out if out is not None else tensor_pb2.Tensor()
    msg.dtype = dtypes.to_enum(dtype)
    msg.shape[:] = array.shape
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and _BIG_ENDIAN_HOST):
        array = array.astype(dtype.newbyteorder("<"))
    msg.content = array.tobytes(order="C")
    return msg


def decode(msg: tensor_pb2.Tensor, *, field: str = "tensor") -> np.ndarray:
    """A read-only array viewing the message's bytes; validates dtype and size."""
    try:
        dtype = dtypes.from_enum(msg.dtype)
    except dtypes.UnsupportedDTypeError as e:
        raise InvalidArgumentError(f"{field}: {e}", field=field) from None
    shape = tuple(msg.shape)
    count = element_count(shape, field=field, itemsize=dtype.itemsize)
    content = msg.content
    expected = count * dtype.itemsize
    if len(content) != expected:
        raise InvalidArgumentError(
            f"{field}: shape {list(shape)} of {dtype} needs {expected} bytes "
            f"but the content has {len(content)}",
            field=field,
        )
    return np.frombuffer(content, dtype=dtype.newbyteorder("<"), count=count).reshape(shape)


def encode_shape(shape: shapes.PartialShape, out=None) -> tensor_pb2.PartialShape:
    """A ``PartialShape`` message; ``None`` is unknown rank, ``None`` dims are -1."""
    msg = out if out is not None else tensor_pb2.PartialShape()
    if shape is None:
        msg.unknown_rank = True
    else:
        msg.dims[:] = [-1 if d is None else d for d in shape]
    return msg


def decode_shape(msg: tensor_pb2.PartialShape, present: bool = True) -> shapes.PartialShape:
    """The partial shape of a message; an absent field means unknown rank."""
    if not present or msg.unknown_rank:
        return None
    return shapes.make(list(msg.dims))
