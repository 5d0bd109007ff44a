"""Python values to arrays, the way ``tf.convert_to_tensor`` converts them.

``client.raw_ops`` mirrors ``tf.raw_ops``, so an argument must mean what it means to
TensorFlow: ``1.5`` is a float32, ``1`` an int32, ``[[4.0, 5.0]]`` a float32 matrix.
``np.asarray`` reads them as float64 and int64 instead, and the server then refuses
to write them into a float32 or int32 TensorArray. ``to_array`` follows TensorFlow
2.21's eager conversion (``PySeqToTFE_TensorHandle``), recorded in
``tests/golden/python_conversions.json`` and replayed by
``tests/client/test_conversion.py``:

* Objects offering ``__array__`` (NumPy arrays and scalars, tf/torch tensors),
  ``__array_interface__`` or ``__array_struct__`` keep their dtype. TensorFlow stops
  here; the SDK also takes ``__dlpack__`` objects (``np.from_dlpack``, copied to the
  host where the producer can) and CuPy-style ``.get()`` for device arrays whose
  ``__array__`` refuses. Text arrays (``U``, ``S``, object arrays of ``bytes``/``str``)
  become string tensors: object arrays of ``bytes``, ``str`` encoded UTF-8.
* Everything else is a Python scalar or a nested sequence. Its dtype is inferred from
  its *first* leaf (the path of first elements): a float is float32 (``np.float64``
  float64, ``np.float16`` float16, other NumPy floats float32), a bool bool, an int
  (Python or NumPy) int32, int64 when some value does not fit int32, float32 when a
  float follows; a complex complex128; ``bytes``/``str`` string. Each leaf must then
  convert to that dtype in TensorFlow's way (an int or bool where a float is expected
  is fine, a bool where an int is expected too, but not an int where a bool is); an
  int beyond int64 and a float beyond float32 are refused (an int beyond float32
  becomes inf). An empty sequence on the first path is float32 of its shape, whatever
  follows it. Inner levels may be any iterable, as in TensorFlow.
* Refusals raise ``InvalidArgumentError`` with TensorFlow's message (TensorFlow raises
  ``ValueError``); NumPy dtypes TensorFlow does not carry raise ``UnsupportedDTypeError``.
  Either way before any request is sent.

Large nested lists of plain ints and floats convert through NumPy in one step; other
leaves go one by one, in TensorFlow's order, since which refusal wins depends on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from gradserve import dtypes
from gradserve.errors import ConversionError, InvalidArgumentError, UnsupportedDTypeError

__all__ = ["to_array"]

# TensorFlow's messages (tensorflow/python/lib/core/py_seq_tensor.cc).
RECTANGULAR = "Can't convert non-rectangular Python sequence to Tensor."
MIXED_TYPES = "Can't convert Python sequence with mixed types to Tensor."
OUT_OF_RANGE = "Can't convert Python sequence with out-of-range integer to Tensor."
OUT_OF_RANGE_DOUBLE = (
    "Can't convert Python sequence with a value out of range for a double-precision float."
)
BAD_UNICODE = "Error converting unicode string while converting Python sequence to Tensor."
NOT_AN_ARRAY = "Value returned by __array__ is not a NumPy array"
# Not errors: the int32 pass asks for an int64 or a float32 pass instead.
_FOUND_INT64 = "found int64"
_FOUND_FLOAT = "found float"

_INT32 = np.iinfo(np.int32)
_INT64 = np.iinfo(np.int64)
# NumPy dtypes TensorFlow refuses, by its names for them (ndarray_tensor.cc).
_NPY_NAMES = {
    np.dtype(np.longdouble): "NPY_LONGDOUBLE",
    np.dtype(np.clongdouble): "NPY_CLONGDOUBLE",
}

Leaf = Any
Converted = tuple[list[Any] | np.ndarray | None, str | None]  # (values, error)


def to_array(value: Any, dtype: dtypes.DTypeLike | None = None) -> np.ndarray:
    """``value`` as the array ``tf.convert_to_tensor(value)`` would hold.

    ``dtype`` is for the integer index inputs (indices, sizes, lengths), which the
    caller then casts with its own range check (``_as_integer_input``): there a plain
    Python value is read as ``np.asarray`` reads it, so that path is unchanged;
    array-like objects convert the same either way.
    """
    if type(value) is np.ndarray:  # subclasses go through __array__, as in TensorFlow
        return _from_ndarray(value)
    array = _array_protocols(value)
    if array is not None:
        return _from_ndarray(array)
    if dtype is not None:
        if value is None:
            raise ConversionError(unsupported_type(value))
        array = np.asarray(value)
        if array.dtype == object:  # ints past int64 are the caller's; nothing else is
            for item in array.flat:  # a Decimal, a Fraction, a None in a list
                if not isinstance(item, int):
                    raise ConversionError(unsupported_type(item))
        return array
    return _from_python(value)


def cannot_convert(value: Any, dtype: dtypes.DTypeLike | str) -> str:
    """TensorFlow's message for a value it will not convert to a tensor of ``dtype``
    (a dtype, or the name of one the service has no NumPy type for: "resource")."""
    name = dtype if isinstance(dtype, str) else dtypes.tf_name(dtypes.normalize(dtype))
    return f"Cannot convert {value!r} to EagerTensor of dtype {name}"


def unsupported_type(value: Any) -> str:
    """TensorFlow's message for a value it cannot convert to a tensor at all."""
    return f"Attempt to convert a value ({value!r}) with an unsupported type ({type(value)!r}) to a Tensor."


def is_plain_python(value: Any) -> bool:
    """A plain Python value (a number, a list of them), not an array-like object."""
    return not (
        isinstance(value, (np.ndarray, np.generic))
        or hasattr(value, "__array__")
        or hasattr(value, "__dlpack__")
    )


# ------------------------------------------------------------------ array-like objects
def _array_protocols(value: Any) -> np.ndarray | None:
    """The ndarray an array-like object offers, or None for plain Python values."""
    if isinstance(value, np.generic):
        return np.asarray(value)  # NumPy scalars keep their dtype, as in TensorFlow
    has_array = hasattr(value, "__array__")
    has_dlpack = hasattr(value, "__dlpack__")
    if has_array:
        try:
            array = value.__array__()
        except (TypeError, ValueError, RuntimeError, AttributeError) as e:
            # A device array (CuPy, CUDA torch) that will not convert implicitly.
            fallback = _from_dlpack(value) if has_dlpack else None
            if fallback is None:
                fallback = _from_get(value)
            if fallback is None:
                raise InvalidArgumentError(
                    f"cannot convert {type(value).__name__} to an array: {e}"
                ) from e
            return fallback
        if not isinstance(array, np.ndarray):
            raise InvalidArgumentError(NOT_AN_ARRAY)
        return array
    if hasattr(value, "__array_interface__") or hasattr(value, "__array_struct__"):
        return np.asarray(value)
    if has_dlpack:
        array = _from_dlpack(value)
        if array is None:
            array = _from_get(value)
        if array is None:
            raise InvalidArgumentError(
                f"cannot convert {type(value).__name__} to an array through __dlpack__"
            )
        return array
    return None


def _from_dlpack(value: Any) -> np.ndarray | None:
    """``np.from_dlpack``: shared memory where it can, else a host copy if the
    producer makes one; None when neither works."""
    try:
        return np.from_dlpack(value)
    except (TypeError, ValueError, RuntimeError, BufferError, AttributeError):
        pass
    try:  # a device array: ask the producer for a host copy (DLPack 1.0's dl_device)
        return np.from_dlpack(value, device="cpu", copy=True)
    except (TypeError, ValueError, RuntimeError, BufferError, AttributeError):
        return None


def _from_get(value: Any) -> np.ndarray | None:
    """CuPy's ``.get()`` (a host copy), without importing CuPy; None if absent."""
    get = getattr(value, "get", None)
    if not callable(get):
        return None
    try:
        array = get()
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return None
    return array if isinstance(array, np.ndarray) else None


def _from_ndarray(array: np.ndarray) -> np.ndarray:
    """The array with its dtype, text as string tensors; TensorFlow's refusals."""
    kind = array.dtype.kind
    if kind in "US":
        return _strings(array, lambda x: x)
    if kind == "O":
        return _strings(array, _object_string)
    if kind == "M" or kind == "m":
        name = "NPY_DATETIME" if kind == "M" else "NPY_TIMEDELTA"
        raise UnsupportedDTypeError(_numpy_refusal(f"Unsupported numpy type: {name}"))
    if array.dtype in _NPY_NAMES:
        raise UnsupportedDTypeError(
            _numpy_refusal(f"Unsupported numpy type: {_NPY_NAMES[array.dtype]}")
        )
    if array.dtype.type is np.void:
        detail = "Unexpected" if array.dtype.fields is None else "Unsupported"
        raise UnsupportedDTypeError(_numpy_refusal(f"{detail} numpy data type"))
    if not array.dtype.isnative:
        return array.astype(array.dtype.newbyteorder("="))
    return array


def _numpy_refusal(detail: str) -> str:
    return f"Failed to convert a NumPy array to a Tensor ({detail})."


def _object_string(item: Any) -> Any:
    if isinstance(item, bytes | str):
        return item
    raise ConversionError(_numpy_refusal(f"Unsupported object type {_tp_name(item)}"))


def _strings(array: np.ndarray, check: Callable[[Any], Any]) -> np.ndarray:
    """An object array of ``bytes`` (``str`` encoded UTF-8) of ``array``'s shape."""
    out = np.empty(array.shape, dtype=dtypes.STRING)
    flat = out.reshape(-1)
    for i, item in enumerate(array.reshape(-1).tolist()):
        item = check(item)
        if isinstance(item, str):
            try:
                item = item.encode("utf-8")
            except UnicodeEncodeError:
                raise ConversionError(
                    _numpy_refusal("Unable to convert element to UTF-8")
                ) from None
        flat[i] = bytes(item)
    return out


def _tp_name(obj: Any) -> str:
    """The type's C ``tp_name``, which TensorFlow's messages print: the bare name for
    classes defined in Python and builtins, ``module.name`` for extension types."""
    t = type(obj)
    heap_type = bool(t.__flags__ & (1 << 9))  # Py_TPFLAGS_HEAPTYPE
    if heap_type or t.__module__ == "builtins":
        return t.__name__
    return f"{t.__module__}.{t.__name__}"


# ------------------------------------------------------------------ Python values
def _from_python(value: Any) -> np.ndarray:
    shape, kind = _infer(value)
    if kind is None:  # an empty sequence on the first path
        return np.zeros(shape, dtype=np.float32)
    if shape:
        leaves, structure_error = _flatten(value, shape)
    else:
        leaves, structure_error = [_scalar(value)], None

    def run(convert: Callable[[Leaf], Any]) -> Converted:
        values: list[Any] = []
        append = values.append
        for leaf in leaves:
            out = convert(leaf)
            if isinstance(out, _Error):
                return None, out.message
            append(out)
        return (None, structure_error) if structure_error else (values, None)

    result_dtype: np.dtype[Any]
    if kind == "int":
        result_dtype, values, error = _run_ints(leaves, structure_error, run)
    elif kind in _FLOATS:
        result_dtype = np.dtype(_FLOATS[kind])
        values, error = _run_floats(leaves, structure_error, run, _FLOATS[kind])
    else:
        result_dtype = np.dtype(_OTHER[kind][0])
        values, error = run(_OTHER[kind][1])
    if error is not None or values is None:
        raise ConversionError(error or RECTANGULAR)
    if result_dtype == dtypes.STRING:
        out = np.empty(len(values), dtype=dtypes.STRING)
        out[:] = values
        return out.reshape(shape)
    return np.asarray(values, dtype=result_dtype).reshape(shape)


def _is_sequence(obj: Any) -> bool:
    """Python's ``PySequence_Check``: lists, tuples, ranges, ``bytearray``, ndarrays,
    classes with ``__getitem__``; not dicts, nor NumPy scalars (checked first)."""
    if isinstance(obj, list | tuple):
        return True
    return not isinstance(obj, dict | np.generic) and hasattr(type(obj), "__getitem__")


def _scalar(obj: Any) -> Any:
    """A zero-dimensional ndarray as its NumPy scalar; anything else as it is."""
    if isinstance(obj, np.ndarray) and obj.ndim == 0:
        return obj[()]
    return obj


def _infer(value: Any) -> tuple[tuple[int, ...], str | None]:
    """Shape and dtype kind from the first leaf: down the first elements."""
    shape: list[int] = []
    obj = value
    while True:
        obj = _scalar(obj)
        if isinstance(obj, bytes | str):
            return tuple(shape), "string"
        if _is_sequence(obj):
            try:
                length = len(obj)
            except TypeError as e:
                raise ConversionError(str(e)) from None
            shape.append(length)
            if length == 0:
                return tuple(shape), None
            obj = _first(obj)
            continue
        kind = _leaf_kind(obj)
        if kind is None:
            raise ConversionError(unsupported_type(obj))
        return tuple(shape), kind


def _first(seq: Any) -> Any:
    """``seq[0]``, or the first element iterated when indexing by 0 fails."""
    try:
        return seq[0]
    except (IndexError, KeyError, TypeError, ValueError):
        pass
    name = type(seq).__name__
    try:
        return next(iter(seq))
    except StopIteration:
        raise ConversionError(
            f"Cannot infer dtype of a {name} object since it is an empty sequence"
        ) from None
    except TypeError as e:
        raise ConversionError(f"Cannot infer dtype of a {name} object: {e}") from None


def _leaf_kind(obj: Any) -> str | None:
    # Order matters: np.float64 is a float, bool an int, np.complex128 a complex.
    if isinstance(obj, np.float64):
        return "double"
    if isinstance(obj, np.float16):
        return "half"
    if isinstance(obj, float | np.floating):
        return "float"
    if isinstance(obj, bool | np.bool_):
        return "bool"
    if isinstance(obj, int | np.integer):
        return "int"
    if isinstance(obj, complex | np.complexfloating):
        return "complex"
    return None


def _flatten(value: Any, shape: tuple[int, ...]) -> tuple[list[Leaf], str | None]:
    """The leaves in order, up to the first place the nesting departs from ``shape``
    (then also that error). Inner levels may be any iterable, as in TensorFlow."""
    leaves: list[Leaf] = []
    last = len(shape) - 1

    def walk(obj: Any, depth: int) -> bool:
        if isinstance(obj, list | tuple):
            items = obj
        else:
            try:
                items = list(obj)
            except TypeError:
                return False
        if len(items) != shape[depth]:
            return False
        if depth == last:
            leaves.extend(map(_scalar, items))
            return True
        return all(walk(item, depth + 1) for item in items)

    ok = walk(value, 0)
    return leaves, None if ok else RECTANGULAR


# ------------------------------------------------------------------ leaf converters
class _Error:
    """A leaf converter's refusal: TensorFlow's message, or a retry marker."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


_ERR_MIXED = _Error(MIXED_TYPES)
_ERR_RANGE = _Error(OUT_OF_RANGE)
_ERR_RANGE_DOUBLE = _Error(OUT_OF_RANGE_DOUBLE)
_ERR_INT64 = _Error(_FOUND_INT64)
_ERR_FLOAT = _Error(_FOUND_FLOAT)
_ERR_UNICODE = _Error(BAD_UNICODE)


def _int64(v: Leaf) -> int | _Error:
    if isinstance(v, int | np.integer):  # bool too: an int to Python
        i = int(v)
        return i if _INT64.min <= i <= _INT64.max else _ERR_RANGE
    if isinstance(v, float | np.floating):
        return _ERR_FLOAT
    return _ERR_MIXED


def _int32(v: Leaf) -> int | _Error:
    i = _int64(v)
    if isinstance(i, int) and not _INT32.min <= i <= _INT32.max:
        return _ERR_INT64
    return i


def _run_ints(
    leaves: list[Leaf],
    structure_error: str | None,
    run: Callable[[Callable[[Leaf], Any]], Converted],
) -> tuple[np.dtype[Any], list[Any] | np.ndarray | None, str | None]:
    """TensorFlow's passes for an int first leaf: int32; int64 if a value needs it;
    float32 if a float turns up (in that order, each pass stopping at its first error)."""
    kinds = set(map(type, leaves))
    if structure_error is None and kinds <= _PLAIN_NUMBERS:  # the passes' outcome at once
        end = len(leaves)
        if kinds != {int}:  # the passes read ints up to the first float
            end = next(i for i, x in enumerate(leaves) if type(x) is not int)
        ints = leaves[:end]
        low, high = min(ints), max(ints)  # leaves[0] is an int: not empty
        if low < _INT64.min or high > _INT64.max:
            return np.dtype(np.int32), None, OUT_OF_RANGE
        if end < len(leaves):
            return np.dtype(np.float32), *_run_floats(leaves, None, run, np.float32)
        wide = low < _INT32.min or high > _INT32.max
        return np.dtype(np.int64 if wide else np.int32), ints, None
    result_dtype: np.dtype[Any] = np.dtype(np.int32)
    values, error = run(_int32)
    if error == _FOUND_INT64:
        result_dtype = np.dtype(np.int64)
        values, error = run(_int64)
    if error == _FOUND_FLOAT:
        result_dtype = np.dtype(np.float32)
        values, error = _run_floats(leaves, structure_error, run, np.float32)
    return result_dtype, values, error


def _float_converter(target: type[np.floating[Any]]) -> Callable[[Leaf], Any]:
    """TensorFlow's ``ConvertOneFloat<T>``: a float that overflows ``target`` is an
    error, an int that does is not (it becomes inf); half rounds through float32."""
    via32 = target is np.float16

    def narrow(d: float) -> Any:
        return target(np.float32(d)) if via32 else target(d)

    def convert(v: Leaf) -> Any:
        if isinstance(v, float):
            out = narrow(v)
            if math.isinf(out) and math.isfinite(v):
                return _ERR_RANGE_DOUBLE
            return out
        if isinstance(v, int):
            try:
                return narrow(float(v))
            except OverflowError:
                return _ERR_RANGE_DOUBLE
        if isinstance(v, np.floating):
            return convert(float(v))
        if isinstance(v, np.integer):
            return convert(int(v))
        return _ERR_MIXED

    def quiet(v: Leaf) -> Any:
        with np.errstate(over="ignore"):
            return convert(v)

    return quiet


def _run_floats(
    leaves: list[Leaf],
    structure_error: str | None,
    run: Callable[[Callable[[Leaf], Any]], Converted],
    target: type[np.floating[Any]],
) -> Converted:
    """A float pass; vectorised when every leaf is a Python int or float."""
    kinds = set(map(type, leaves))
    if structure_error is not None or not kinds <= _PLAIN_NUMBERS:
        return run(_FLOAT_CONVERTERS[target])
    try:
        source = np.array(leaves, dtype=np.float64)
    except OverflowError:  # an int beyond any double
        return None, OUT_OF_RANGE_DOUBLE
    with np.errstate(over="ignore"):
        if target is np.float16:
            out = source.astype(np.float32).astype(np.float16)  # as Eigen::half(double)
        else:
            out = source.astype(target)
    overflow = np.flatnonzero(np.isinf(out) & np.isfinite(source))
    # A float that overflows is refused; an int that does becomes inf.
    if any(type(leaves[i]) is not int for i in overflow):
        return None, OUT_OF_RANGE_DOUBLE
    return out, None


#: Leaf types whose conversions NumPy vectorises exactly (not bool: it is no float).
_PLAIN_NUMBERS: set[type] = {int, float, np.float64}
_FLOATS: dict[str, type[np.floating[Any]]] = {
    "float": np.float32,
    "double": np.float64,
    "half": np.float16,
}
_FLOAT_CONVERTERS = {t: _float_converter(t) for t in _FLOATS.values()}


def _complex(v: Leaf) -> complex | _Error:
    if isinstance(v, complex | np.complexfloating):
        return complex(v)
    d = _FLOAT_CONVERTERS[np.float64](v)
    return d if isinstance(d, _Error) else complex(float(d), 0.0)


def _bool(v: Leaf) -> bool | _Error:
    if v is True or v is False or isinstance(v, np.bool_):
        return bool(v)
    return _ERR_MIXED


def _string(v: Leaf) -> bytes | _Error:
    if isinstance(v, bytes):
        return bytes(v)
    if isinstance(v, str):
        try:
            return v.encode("utf-8")
        except UnicodeEncodeError:
            return _ERR_UNICODE
    return _ERR_MIXED


_OTHER: dict[str, tuple[Any, Callable[[Leaf], Any]]] = {
    "complex": (np.complex128, _complex),
    "bool": (np.bool_, _bool),
    "string": (dtypes.STRING, _string),
}
