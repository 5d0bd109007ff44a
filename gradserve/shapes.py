"""TensorFlow's PartialTensorShape, as plain Python: ``None`` or a tuple of dims.

``None`` is unknown rank; inside a tuple, ``None`` is an unknown dimension.
The functions reproduce TensorFlow's merge and compatibility rules and its
``DebugString`` spelling, because error messages quote shapes that way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from gradserve.errors import InvalidArgumentError

PartialShape = tuple[int | None, ...] | None


def make(dims: Sequence[int | None] | None) -> PartialShape:
    """A partial shape from ``None`` or a sequence whose ``-1``/``None`` are unknown."""
    if dims is None:
        return None
    out: list[int | None] = []
    for d in dims:
        if d is None or d == -1:
            out.append(None)
        elif int(d) < -1:
            raise InvalidArgumentError(f"shape dimension {d} must be >= -1")
        else:
            out.append(int(d))
    return tuple(out)


def is_fully_defined(shape: PartialShape) -> bool:
    return shape is not None and all(d is not None for d in shape)


def is_compatible(partial: PartialShape, shape: Sequence[int | None]) -> bool:
    """TensorFlow's PartialTensorShape::IsCompatibleWith against a shape."""
    if partial is None:
        return True
    if len(partial) != len(shape):
        return False
    return all(p is None or s is None or p == s for p, s in zip(partial, shape))


def merge(a: PartialShape, b: PartialShape) -> PartialShape:
    """TensorFlow's PartialTensorShape::MergeWith; raises InvalidArgumentError."""
    if a is None:
        return b
    if b is None:
        return a
    if len(a) != len(b):
        raise InvalidArgumentError(
            f"PartialTensorShape: Incompatible ranks during merge: {len(a)} vs. {len(b)}"
        )
    out = []
    for x, y in zip(a, b):
        if x is not None and y is not None and x != y:
            raise InvalidArgumentError(
                f"PartialTensorShape: Incompatible shapes during merge: "
                f"{debug_string(a)} vs. {debug_string(b)}"
            )
        out.append(x if x is not None else y)
    return tuple(out)


#: NumPy refuses a shape whose non-zero dims multiply past this many bytes, even when
#: another dim is 0 and the array would hold nothing.
_MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)


def _max_rank() -> int:
    try:
        np.empty((1,) * 64)
    except ValueError:
        return 32
    return 64


#: The most dims a NumPy array has (64 in NumPy 2, 32 before): a wire shape with more
#: can be no tensor here (TensorFlow allows 254).
MAX_RANK = _max_rank()


def num_elements(shape: Sequence[int], itemsize: int = 1, *, what: str = "tensor") -> int:
    """Elements of a shape that is to become an array: every dim non-negative, and a
    shape NumPy can represent; otherwise InvalidArgumentError naming ``what``."""
    if len(shape) > MAX_RANK:
        raise InvalidArgumentError(
            f"{what}: a shape of {len(shape)} dimensions (at most {MAX_RANK})", field=what
        )
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(
            f"{what}: shape {list(shape)} has a negative dimension", field=what
        )
    if math.prod(d for d in shape if d) * itemsize > _MAX_ARRAY_BYTES:
        raise InvalidArgumentError(f"{what}: shape {list(shape)} is too large", field=what)
    return math.prod(shape)


def debug_string(shape: PartialShape | Sequence[int]) -> str:
    """``[2,?,3]``, ``[]`` or ``<unknown>``, as TensorFlow prints shapes."""
    if shape is None:
        return "<unknown>"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"
