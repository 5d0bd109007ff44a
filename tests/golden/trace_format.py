"""The golden trace format: how a step's tensors are written, read back and compared.

A trace is a list of steps ``{op, args, out?, expect}`` (see README.md). In ``args``,
``"$name"`` is an earlier step's output and ``{"array", "dtype", "shape"}`` a tensor
(``{"fill", "dtype", "shape"}``: every element ``fill``). The ``record_*.py`` scripts
write traces with ``tensor``/``filled`` (and a result with ``result``); the tests replay
them with ``resolve`` (and ``expected``) and compare TensorFlow's error messages through
``normalise``. One place for the format, imported by both (this module needs nothing but
NumPy, and ml_dtypes for bfloat16).

Values are nested lists (``ndarray.tolist()``), by dtype:

* every number type: JSON numbers; ``dtype`` is NumPy's name (``"float32"``, ``"int64"``).
* ``"bfloat16"`` (``ml_dtypes.bfloat16``, TensorFlow's NumPy type): each element as the
  float it is (exact: a bfloat16 is a float64 with fewer bits), ``Infinity``/``-Infinity``
  for the infinities as Python's ``json`` writes and reads them (no trace holds a NaN).
* ``"string"`` (NumPy object arrays of ``bytes``, as ``tf.Tensor.numpy()`` returns them):
  each element's bytes as the text whose code points are those bytes (latin-1), so ASCII
  reads as itself and ``b"\\xff"`` is ``"\\u00ff"`` in the file. (``fill`` likewise.)
"""

from __future__ import annotations

import re

import numpy as np

#: The format's name of string tensors (NumPy's would be "object").
STRING = "string"


def dtype_of(name: str) -> np.dtype:
    """The NumPy dtype a trace's ``dtype`` names."""
    if name == STRING:
        return np.dtype(object)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype_name(dtype: np.dtype) -> str:
    """The trace's name of a NumPy dtype (bytes, str and object arrays are strings)."""
    dtype = np.dtype(dtype)
    return STRING if dtype.kind in "OSU" else dtype.name


def _text(item) -> str:
    if isinstance(item, str):
        item = item.encode()
    return bytes(item).decode("latin-1")


def _map(f, nested):
    return [_map(f, x) for x in nested] if isinstance(nested, list) else f(nested)


def encode(a: np.ndarray) -> list | float | int | bool | str:
    """An array's elements as JSON (nested lists); strings as latin-1 text."""
    a = np.asarray(a)
    if a.dtype.kind in "OSU":
        return _map(_text, a.tolist())
    return a.tolist()


def decode(value, dtype: str, shape: list[int]) -> np.ndarray:
    """The array ``encode`` wrote, of trace dtype ``dtype`` and shape ``shape`` (a
    zero-size array's nested list loses its shape)."""
    dt = dtype_of(dtype)
    if dt != np.dtype(object):
        return np.asarray(value, dtype=dt).reshape(shape)
    out = np.empty(int(np.prod(shape, dtype=np.int64)), dtype=object)
    flat = np.asarray(value, dtype=object).reshape(-1) if out.size else []
    for i, item in enumerate(flat):
        out[i] = item.encode("latin-1")
    return out.reshape(shape)


def tensor(a: np.ndarray) -> dict:
    """A tensor argument in the trace format."""
    a = np.asarray(a)
    return {"array": encode(a), "dtype": dtype_name(a.dtype), "shape": list(a.shape)}


def result(a: np.ndarray, dtype: str | None = None) -> dict:
    """A tensor result as a step's ``expect``: ``{"value", "dtype", "shape"}``."""
    a = np.asarray(a)
    name = dtype_name(a.dtype) if dtype is None else dtype
    return {"value": encode(a), "dtype": name, "shape": list(a.shape)}


def expected(expect: dict) -> np.ndarray:
    """The array a step's ``{"value", "dtype", "shape"}`` expectation stands for."""
    return decode(expect["value"], expect["dtype"], expect["shape"])


def filled(shape: tuple, dtype: str, fill: float) -> dict:
    """A tensor argument of one repeated value."""
    return {"fill": fill, "dtype": dtype, "shape": list(shape)}


def tensor_value(spec: dict) -> np.ndarray:
    """The array a tensor argument stands for."""
    if "fill" in spec:
        if spec["dtype"] == STRING:
            return (
                decode([spec["fill"]], STRING, [1])
                .repeat(int(np.prod(spec["shape"], dtype=np.int64)))
                .reshape(spec["shape"])
            )
        return np.full(spec["shape"], spec["fill"], dtype=dtype_of(spec["dtype"]))
    return decode(spec["array"], spec["dtype"], spec["shape"])


def resolve(args: dict, env: dict) -> dict:
    """A step's arguments as values: earlier outputs from ``env``, tensors as arrays."""
    out = {}
    for key, value in args.items():
        if isinstance(value, str) and value.startswith("$"):
            out[key] = env[value[1:]]
        elif isinstance(value, dict) and "dtype" in value:
            out[key] = tensor_value(value)
        else:
            out[key] = value
    return out


def same_tensor(got, want: np.ndarray) -> bool:
    """Exactly the same tensor: dtype, shape and bytes (every bit of a float, so -0.0 is
    not 0.0); for strings, every element ``bytes`` and equal."""
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if want.dtype == np.dtype(object):
        return all(type(g) is bytes and g == w for g, w in zip(got.flat, want.flat))
    return got.tobytes() == want.tobytes()


def normalise(message: str) -> str:
    """TF's message without its location wrapping, with array names made generic."""
    message = re.sub(r"^[^}]*\}\}\s*", "", message)  # also a truncated prefix
    message = re.sub(r"\s*\[Op:\w+\]( name: .*)?$", "", message)
    # Also inside TF's grad container names: "_tensor_array_gradsta_0@s".
    return re.sub(r"(ta|TensorArrayV3)_\d+", "ta_N", message)
