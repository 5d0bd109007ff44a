"""The golden trace format: how a step's tensors are written, read back and compared.

A trace is a list of steps ``{op, args, out?, expect}`` (see README.md). In ``args``,
``"$name"`` is an earlier step's output and ``{"array", "dtype", "shape"}`` a tensor
(``{"fill", "dtype", "shape"}``: every element ``fill``). The ``record_*.py`` scripts
write traces with ``tensor``/``filled``; the tests replay them with ``resolve`` and
compare TensorFlow's error messages through ``normalise``. One place for the format,
imported by both (this module needs nothing but NumPy).
"""

from __future__ import annotations

import re

import numpy as np


def tensor(a: np.ndarray) -> dict:
    """A tensor argument in the trace format."""
    a = np.asarray(a)
    return {"array": a.tolist(), "dtype": a.dtype.name, "shape": list(a.shape)}


def filled(shape: tuple, dtype: str, fill: float) -> dict:
    """A tensor argument of one repeated value."""
    return {"fill": fill, "dtype": dtype, "shape": list(shape)}


def tensor_value(spec: dict) -> np.ndarray:
    """The array a tensor argument stands for."""
    if "fill" in spec:
        return np.full(spec["shape"], spec["fill"], dtype=spec["dtype"])
    return np.asarray(spec["array"], dtype=spec["dtype"]).reshape(spec["shape"])


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


def normalise(message: str) -> str:
    """TF's message without its location wrapping, with array names made generic."""
    message = re.sub(r"^[^}]*\}\}\s*", "", message)  # also a truncated prefix
    message = re.sub(r"\s*\[Op:\w+\]( name: .*)?$", "", message)
    # Also inside TF's grad container names: "_tensor_array_gradsta_0@s".
    return re.sub(r"(ta|TensorArrayV3)_\d+", "ta_N", message)
