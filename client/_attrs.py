"""Op attributes checked and converted as ``tf.raw_ops`` converts them.

TensorFlow's eager op wrappers convert each attribute with one of a few functions
(``tensorflow/python/eager/execute.py``: ``make_bool``, ``make_str``, ``make_float``,
``make_shape``, ``make_type``) before the op runs, and raise ``TypeError`` or
``ValueError`` there, in the caller's process. The SDK does the same, with the same
rules and messages, so that a program moved from ``tf.raw_ops`` fails (or not) where it
did: ``dynamic_size=1`` is a ``TypeError`` (not a true value), ``element_shape=[-1, 2]``
a ``ValueError`` (``None`` is the unknown dimension; ``-1`` only on the wire), a
``cell_clip`` given as an int is a float.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from gradserve import dtypes

#: TensorFlow's ``DataType`` enum values (``types.proto``) of the dtypes the service
#: supports: ``dtype=1`` is float32 to ``tf.raw_ops``.
TF_DATA_TYPES: dict[int, Any] = {
    1: np.float32,
    2: np.float64,
    3: np.int32,
    4: np.uint8,
    5: np.int16,
    6: np.int8,
    7: dtypes.STRING,
    8: np.complex64,
    9: np.int64,
    10: np.bool_,
    14: "bfloat16",
    17: np.uint16,
    18: np.complex128,
    19: np.float16,
    22: np.uint32,
    23: np.uint64,
}


def make_bool(value: Any, arg_name: str) -> bool:
    """A ``bool`` attribute: only ``True`` or ``False`` (not 1, not ``np.True_``)."""
    if not isinstance(value, bool):
        raise TypeError(f"Expected bool for argument '{arg_name}' not {value!r}.")
    return value


def make_str(value: Any, arg_name: str) -> str:
    """A ``string`` attribute: ``str`` or ``bytes`` (UTF-8)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if not isinstance(value, str):
        raise TypeError(f"Expected string for argument '{arg_name}' not {value!r}.")
    return value


def make_float(value: Any, arg_name: str) -> float:
    """A ``float`` attribute: any real number (an int too, a NumPy scalar), not a
    string."""
    if not isinstance(value, (numbers.Real, np.integer, np.floating)):
        raise TypeError(f"Expected float for argument '{arg_name}' not {value!r}.")
    return float(value)


def make_type(value: Any, arg_name: str) -> Any:
    """A ``type`` attribute: what ``dtypes.normalize`` takes, or one of TensorFlow's
    ``DataType`` numbers (``dtype=1`` is float32)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        if int(value) not in TF_DATA_TYPES:
            raise dtypes.UnsupportedDTypeError(
                f"'{arg_name}': DataType {int(value)} is not a dtype the service supports"
            )
        return dtypes.normalize(TF_DATA_TYPES[int(value)])
    return value


def make_shape(value: Any, arg_name: str) -> list[int | None] | None:
    """A ``shape`` attribute as ``tensor_shape.as_shape`` reads it: None (unknown rank),
    a sequence (or array) of dimensions each an integer >= 0 or None, one integer (a
    shape of one dimension), or a ``tf.TensorShape``. Returns its dimensions, None
    for an unknown rank."""
    try:
        return _dims(value)
    except TypeError as e:
        raise TypeError(f"Error converting {arg_name} to a TensorShape: {e}.") from None
    except ValueError as e:
        raise ValueError(f"Error converting {arg_name} to a TensorShape: {e}.") from None


def _dims(value: Any) -> list[int | None] | None:
    if value is None:
        return None
    if hasattr(value, "as_list") and hasattr(value, "rank"):  # a tf.TensorShape
        return None if value.rank is None else [_dimension(d) for d in value.as_list()]
    if isinstance(value, (str, bytes)):
        raise TypeError(f"Dimension value must be integer or None, got {value!r}")
    try:
        items = list(value)
    except TypeError:  # one dimension
        return [_dimension(value)]
    return [_dimension(d) for d in items]


def _dimension(value: Any) -> int | None:
    """``tensor_shape.as_dimension``'s value: None, or an integer >= 0."""
    if value is None:
        return None
    if hasattr(value, "value") and not isinstance(value, np.generic):  # a Dimension
        value = value.value
        if value is None:
            return None
    try:
        n = int(value.__index__())
    except AttributeError:
        raise TypeError(
            "Dimension value must be integer or None or have an __index__ method, got "
            f"value '{value!r}' with type '{type(value)!r}'"
        ) from None
    if n < 0:
        raise ValueError(f"Dimension {n} must be >= 0")
    return n
