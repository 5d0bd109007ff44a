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

import ml_dtypes
import numpy as np

from gradserve import dtypes
from gradserve.errors import InvalidArgumentError

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
#: TensorFlow's dtypes the service does not serve, by number and name: refused as
#: unsupported (``UnsupportedDTypeError``), where a value TensorFlow takes for no dtype
#: is a ``TypeError``.
_TF_UNSUPPORTED: dict[int, str] = {
    11: "qint8", 12: "quint8", 13: "qint32", 15: "qint16", 16: "quint16", 20: "resource",
    21: "variant", 24: "float8_e5m2", 25: "float8_e4m3fn", 26: "float8_e4m3fnuz",
    27: "float8_e4m3b11fnuz", 28: "float8_e5m2fnuz", 29: "int4", 30: "uint4", 31: "int2",
    32: "uint2", 33: "float4_e2m1fn",
}  # fmt: skip
_REF = 100  # a reference dtype's number: its base's + 100 (``DType.base_dtype``)
_UNSUPPORTED = object()


def _tf_dtype_table() -> dict[Any, Any]:
    """What ``tf.as_dtype`` looks a value up in (``_ANY_TO_TF`` in TensorFlow 2.21's
    ``dtypes.py``): DataType numbers (reference ones too), TensorFlow's type names
    (with ``_ref`` and the aliases ``half``, ``float``, ``double``), Python's ``float``,
    ``bool`` and ``object``, and NumPy's scalar types."""
    table: dict[Any, Any] = {}
    for number, dtype in TF_DATA_TYPES.items():
        dt = dtypes.normalize(dtype)
        table[number] = table[number + _REF] = dt
        name = dtypes.name(dt)
        table[name] = table[name + "_ref"] = dt
        table[np.dtype(dt).type] = dt
    for number, name in _TF_UNSUPPORTED.items():
        table[number] = table[number + _REF] = _UNSUPPORTED
        table[name] = table[name + "_ref"] = _UNSUPPORTED
    for alias, dtype in (("half", np.float16), ("float", np.float32), ("double", np.float64)):
        table[alias] = table[alias + "_ref"] = np.dtype(dtype)
    table.update({float: np.dtype(np.float32), bool: np.dtype(np.bool_)})
    for string_type in (object, np.bytes_, np.str_):
        table[string_type] = dtypes.STRING
    table[np.longlong], table[np.ulonglong] = np.dtype(np.int64), np.dtype(np.uint64)
    for name in _TF_UNSUPPORTED.values():  # ml_dtypes' float8, int4, ...: TensorFlow's too
        if (numpy_type := getattr(ml_dtypes, name, None)) is not None:
            table[numpy_type] = _UNSUPPORTED
    return table


_TF_DTYPES = _tf_dtype_table()


def make_bool(value: Any, arg_name: str, default: bool | None = None) -> bool:
    """A ``bool`` attribute: only ``True`` or ``False`` (not 1, not ``np.True_``); None
    is the attribute's ``default`` where it has one (as TensorFlow's op wrappers
    read None)."""
    if value is None and default is not None:
        return default
    if not isinstance(value, bool):
        raise TypeError(f"Expected bool for argument '{arg_name}' not {value!r}.")
    return value


def make_str(value: Any, arg_name: str, default: str | None = None) -> str:
    """A ``string`` attribute: ``str`` or ``bytes`` (UTF-8); None is ``default``."""
    if value is None and default is not None:
        return default
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if not isinstance(value, str):
        raise TypeError(f"Expected string for argument '{arg_name}' not {value!r}.")
    return value


def make_float(value: Any, arg_name: str, default: float | None = None) -> float:
    """A ``float`` attribute: any real number (an int too, a NumPy scalar), not a
    string; None is ``default``."""
    if value is None and default is not None:
        return default
    if not isinstance(value, (numbers.Real, np.integer, np.floating)):
        raise TypeError(f"Expected float for argument '{arg_name}' not {value!r}.")
    return float(value)


def make_type(value: Any, arg_name: str) -> np.dtype[Any]:
    """A ``type`` attribute as ``tf.as_dtype`` reads it: a TensorFlow ``DType``, a NumPy
    dtype or scalar type, one of TensorFlow's names ("float32", "float", "half",
    "string", ...), a ``DataType`` number (``dtype=1`` is float32, and so is ``True``),
    or Python's ``float`` (float32), ``bool`` or ``object`` (string). Anything else is
    TensorFlow's ``TypeError`` (``int``, ``str``, ``"f4"``, ``None``); a TensorFlow dtype
    the service does not serve is ``UnsupportedDTypeError``. A Python ``int`` (or
    ``bool``) is taken as a number as it is, as TensorFlow's eager fast path takes it:
    a reference type's number (101) or no type's (0, ``False``, 200) is TensorFlow's
    ``InvalidArgumentError``."""
    if type(value) in (int, bool):
        _check_number(value)
    found = _lookup(value)
    if found is None:
        raise TypeError(f"Expected DataType for argument '{arg_name}' not {value!r}.")
    if found is _UNSUPPORTED:
        raise dtypes.UnsupportedDTypeError(
            f"'{arg_name}': {value!r} is a TensorFlow dtype the service does not support"
        )
    return found


def _check_number(number: int) -> None:
    name = _TF_DTYPES.get(number - _REF)
    if name is not None and name is not _UNSUPPORTED:
        ref_name = "string" if name == dtypes.STRING else dtypes.tf_name(name)
        raise InvalidArgumentError(
            f"AttrValue must not have reference type value of {ref_name}_ref"
        )
    if number not in _TF_DTYPES:
        raise InvalidArgumentError(
            "AttrValue has invalid DataType" + (f" enum: {number}" if number else "")
        )


def _lookup(value: Any) -> Any:
    """``tf.as_dtype``'s steps in its order; None where TensorFlow raises."""
    number = getattr(value, "as_datatype_enum", None)  # a tf.DType (TensorFlow unimported)
    if isinstance(number, int):
        return _TF_DTYPES.get(number)
    if isinstance(value, np.dtype):
        if value.kind == "T":  # NumPy's StringDType
            return dtypes.STRING
        if (found := _TF_DTYPES.get(value.type)) is not None:
            return found
    try:
        if (found := _TF_DTYPES.get(value)) is not None:
            return found
    except TypeError:  # unhashable
        pass
    if hasattr(value, "dtype"):  # an array, or anything with a dtype
        try:
            return _TF_DTYPES.get(np.dtype(value.dtype).type)
        except TypeError:
            return None
    return None


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
