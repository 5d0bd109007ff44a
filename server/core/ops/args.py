"""Checks of the small integer tensors ops take (index, indices, lengths, size)."""

from __future__ import annotations

import numpy as np

from gradserve import dtypes, shapes
from gradserve.errors import InvalidArgumentError


def _integers(x: np.ndarray, what: str) -> np.ndarray:
    if x.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{what} must be an integer tensor, but had dtype {dtypes.tf_name(x.dtype)}", field=what
        )
    return x


def int32_scalar(x: np.ndarray, what: str, message: str) -> int:
    """A scalar int32 input; ``message`` is TensorFlow's prefix for a non-scalar."""
    _integers(x, what)
    if x.ndim != 0:
        raise InvalidArgumentError(f"{message}{shapes.debug_string(x.shape)}", field=what)
    value = int(x)
    if not dtypes.INT32_MIN <= value <= dtypes.INT32_MAX:
        raise InvalidArgumentError(f"{what} {value} does not fit in int32", field=what)
    return value


def int_vector(x: np.ndarray, what: str, message: str, *, bits: int = 32) -> list[int]:
    """An integer vector input; ``message`` is TensorFlow's prefix for a non-vector."""
    _integers(x, what)
    if x.ndim != 1:
        raise InvalidArgumentError(f"{message}{shapes.debug_string(x.shape)}", field=what)
    values = x.astype(np.int64).tolist() if x.dtype != np.uint64 else [int(v) for v in x]
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    for v in values:
        if not lo <= v <= hi:
            raise InvalidArgumentError(f"{what} value {v} does not fit in int{bits}", field=what)
    return values


#: Longest ``tensor_array_name`` or gradient ``source``. TensorFlow has no limit; a
#: service needs one, since names are kept, echoed in messages and grow (a grad
#: array is named ``name@source``).
MAX_NAME_CHARS = 1024


def short_name(name: str, what: str) -> None:
    """Refuse a name longer than ``MAX_NAME_CHARS``."""
    if len(name) > MAX_NAME_CHARS:
        raise InvalidArgumentError(
            f"{what} has {len(name)} characters; at most {MAX_NAME_CHARS} are allowed",
            field=what,
        )
