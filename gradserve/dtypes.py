"""The one table of element types: NumPy dtype and TensorFlow name.

No wire types here (the domain imports this module): the codec derives the wire
enum of each dtype from ``tensor.proto``'s ``DataType`` names (``DT_FLOAT32`` is
``float32``), and a test checks that every entry has one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradserve.errors import UnsupportedDTypeError

DTypeLike = np.dtype[Any] | type | str

# (NumPy dtype, TensorFlow's DataTypeString used in its messages)
_TABLE: tuple[tuple[np.dtype[Any], str], ...] = (
    (np.dtype(np.bool_), "bool"),
    (np.dtype(np.int8), "int8"),
    (np.dtype(np.int16), "int16"),
    (np.dtype(np.int32), "int32"),
    (np.dtype(np.int64), "int64"),
    (np.dtype(np.uint8), "uint8"),
    (np.dtype(np.uint16), "uint16"),
    (np.dtype(np.uint32), "uint32"),
    (np.dtype(np.uint64), "uint64"),
    (np.dtype(np.float16), "half"),
    (np.dtype(np.float32), "float"),
    (np.dtype(np.float64), "double"),
    (np.dtype(np.complex64), "complex64"),
    (np.dtype(np.complex128), "complex128"),
)

#: The range of TensorFlow's int32 indices, sizes and lengths.
INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)

SUPPORTED: tuple[np.dtype[Any], ...] = tuple(dt for dt, _ in _TABLE)
_TF_NAME = dict(_TABLE)
_ALIASES = {name: dt for dt, name in _TABLE} | {str(dt): dt for dt in SUPPORTED}

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "SUPPORTED",
    "DTypeLike",
    "UnsupportedDTypeError",
    "normalize",
    "tf_name",
]


def normalize(dtype: DTypeLike) -> np.dtype[Any]:
    """A supported native NumPy dtype from a dtype, type, NumPy or TensorFlow name."""
    if isinstance(dtype, np.dtype) and dtype.isnative and dtype in _TF_NAME:
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
    if dt not in _TF_NAME:
        raise UnsupportedDTypeError(f"dtype {dt} is not supported")
    return dt


def tf_name(dtype: DTypeLike) -> str:
    """TensorFlow's DataTypeString ("float", "double", "half", ...) for messages."""
    return _TF_NAME.get(np.dtype(dtype), str(dtype))
