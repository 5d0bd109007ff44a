"""The one table of element types: NumPy dtype and TensorFlow name.

``bfloat16`` is ``ml_dtypes.bfloat16`` (TensorFlow's and JAX's NumPy type: its
arithmetic rounds each float32 result, as TensorFlow's does). ``string`` tensors
are NumPy object arrays of ``bytes`` (``str`` is stored UTF-8 encoded), as
``tf.Tensor.numpy()`` returns them; their bytes are ``nbytes`` below, not
``ndarray.nbytes`` (which counts only the pointers).

No wire types here (the domain imports this module): the codec derives the wire
enum of each dtype from ``tensor.proto``'s ``DataType`` names (``DT_FLOAT32`` is
``float32``), and a test checks that every entry has one.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
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
    (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    (np.dtype(object), "string"),
)

#: The dtype of string tensors: NumPy object arrays of ``bytes``.
STRING: np.dtype[Any] = np.dtype(object)

#: Bytes charged per string element besides its content: the array's reference to it
#: and the ``bytes`` object's own header (what an element really costs in memory).
STRING_ELEMENT_BYTES = 8 + sys.getsizeof(b"")

#: The range of TensorFlow's int32 indices, sizes and lengths.
INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)

SUPPORTED: tuple[np.dtype[Any], ...] = tuple(dt for dt, _ in _TABLE)
_TF_NAME = dict(_TABLE)
_ALIASES = (
    {name: dt for dt, name in _TABLE}
    | {str(dt): dt for dt in SUPPORTED}
    | {"float16": np.dtype(np.float16), "str": STRING, "bytes": STRING}
)

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "STRING",
    "SUPPORTED",
    "name",
    "nbytes",
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
    if dt.kind in "SUO":  # bytes, str and object arrays all become byte strings
        return STRING
    dt = dt.newbyteorder("=")
    if dt not in _TF_NAME:
        raise UnsupportedDTypeError(f"dtype {dt} is not supported")
    return dt


def tf_name(dtype: DTypeLike) -> str:
    """TensorFlow's DataTypeString ("float", "double", "half", ...) for messages."""
    return _TF_NAME.get(np.dtype(dtype), str(dtype))


def name(dtype: DTypeLike) -> str:
    """gradserve's name of a supported dtype: NumPy's ("float32", "bfloat16"), and
    "string" for the object arrays of strings."""
    dt = normalize(dtype)
    return "string" if dt == STRING else str(dt)


def nbytes(array: Any) -> int:
    """The bytes a tensor holds: its buffer, or for strings their content plus a
    reference each (what a budget must charge)."""
    if array.dtype != STRING:
        return int(array.nbytes)
    return int(array.size) * STRING_ELEMENT_BYTES + sum(len(x) for x in array.flat)
