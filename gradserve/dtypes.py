"""The one table of element types: wire enum, NumPy dtype, TensorFlow name."""

from __future__ import annotations

import numpy as np

from gradserve.v1 import tensor_pb2

DTypeLike = np.dtype | type | str | int

# (wire enum, NumPy dtype, TensorFlow's DataTypeString used in its messages)
_TABLE: tuple[tuple[int, np.dtype, str], ...] = (
    (tensor_pb2.DT_BOOL, np.dtype(np.bool_), "bool"),
    (tensor_pb2.DT_INT8, np.dtype(np.int8), "int8"),
    (tensor_pb2.DT_INT16, np.dtype(np.int16), "int16"),
    (tensor_pb2.DT_INT32, np.dtype(np.int32), "int32"),
    (tensor_pb2.DT_INT64, np.dtype(np.int64), "int64"),
    (tensor_pb2.DT_UINT8, np.dtype(np.uint8), "uint8"),
    (tensor_pb2.DT_UINT16, np.dtype(np.uint16), "uint16"),
    (tensor_pb2.DT_UINT32, np.dtype(np.uint32), "uint32"),
    (tensor_pb2.DT_UINT64, np.dtype(np.uint64), "uint64"),
    (tensor_pb2.DT_FLOAT16, np.dtype(np.float16), "half"),
    (tensor_pb2.DT_FLOAT32, np.dtype(np.float32), "float"),
    (tensor_pb2.DT_FLOAT64, np.dtype(np.float64), "double"),
    (tensor_pb2.DT_COMPLEX64, np.dtype(np.complex64), "complex64"),
    (tensor_pb2.DT_COMPLEX128, np.dtype(np.complex128), "complex128"),
)

_BY_ENUM = {enum: dt for enum, dt, _ in _TABLE}
_ENUM_BY_DTYPE = {dt: enum for enum, dt, _ in _TABLE}
_TF_NAME = {dt: name for _, dt, name in _TABLE}
_ALIASES = {name: dt for _, dt, name in _TABLE} | {str(dt): dt for _, dt, _ in _TABLE}

SUPPORTED: tuple[np.dtype, ...] = tuple(dt for _, dt, _ in _TABLE)


class UnsupportedDTypeError(ValueError):
    """A dtype (or wire enum) gradserve does not carry."""


def from_enum(enum: int) -> np.dtype:
    """NumPy dtype of a wire enum value; raises for DT_INVALID and unknown numbers."""
    try:
        return _BY_ENUM[enum]
    except KeyError:
        raise UnsupportedDTypeError(f"unknown or unset dtype enum value {enum}") from None


def to_enum(dtype: DTypeLike) -> int:
    """Wire enum of anything NumPy understands as a dtype, or a TensorFlow name."""
    dt = normalize(dtype)
    return _ENUM_BY_DTYPE[dt]


def normalize(dtype: DTypeLike) -> np.dtype:
    """A supported native NumPy dtype from a dtype, type, NumPy or TensorFlow name."""
    if dtype in _ENUM_BY_DTYPE and isinstance(dtype, np.dtype) and dtype.isnative:
        return dtype  # the hot path: already one of ours
    if isinstance(dtype, str) and dtype in _ALIASES:
        return _ALIASES[dtype]
    if hasattr(dtype, "as_numpy_dtype"):  # a tf.DType, without importing TensorFlow
        dtype = dtype.as_numpy_dtype
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise UnsupportedDTypeError(f"not a dtype: {dtype!r}") from None
    dt = dt.newbyteorder("=")
    if dt not in _ENUM_BY_DTYPE:
        raise UnsupportedDTypeError(f"dtype {dt} is not supported")
    return dt


def tf_name(dtype: np.dtype) -> str:
    """TensorFlow's DataTypeString ("float", "double", "half", ...) for messages."""
    return _TF_NAME.get(np.dtype(dtype), str(dtype))
