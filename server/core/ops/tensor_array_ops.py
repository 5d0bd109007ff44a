"""TensorArray*V3 ops: TensorFlow's op-kernel checks, then the state machine.

The order of checks follows tensor_array_ops.cc, so the first error a bad
call meets is the one TensorFlow reports.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gradserve import dtypes, shapes
from gradserve.errors import InvalidArgumentError
from gradserve.server.core.grad_registry import GradRegistry
from gradserve.server.core.ops import args
from gradserve.server.core.sessions import Session
from gradserve.server.core.tensor_array import Cleared, HandOut, TensorArray


def _check_write_dtype(ta: TensorArray, value: np.ndarray) -> None:
    if value.dtype != ta.dtype:
        raise InvalidArgumentError(
            f"TensorArray dtype is {dtypes.tf_name(ta.dtype)} but Op is trying to write dtype "
            f"{dtypes.tf_name(value.dtype)}.",
            field="value",
        )


def _check_read_dtype(ta: TensorArray, dtype: np.dtype) -> None:
    if dtype != ta.dtype:
        raise InvalidArgumentError(
            f"TensorArray dtype is {dtypes.tf_name(ta.dtype)} but Op requested dtype "
            f"{dtypes.tf_name(dtype)}.",
            field="dtype",
        )


def create(
    session: Session,
    *,
    size: np.ndarray,
    dtype: np.dtype,
    element_shape: shapes.PartialShape,
    dynamic_size: bool,
    clear_after_read: bool,
    identical_element_shapes: bool,
    tensor_array_name: str,
) -> tuple[str, TensorArray]:
    """TensorArrayV3 -> (handle id, array). Flow out is always 0.0."""
    args.short_name(tensor_array_name, "tensor_array_name")
    n = args.int32_scalar(size, "size", "TensorArray size must be scalar, but had shape: ")
    if n < 0:
        raise InvalidArgumentError("Size should be >= 0.", field="size")
    return session.create_tensor_array(
        tensor_array_name=tensor_array_name,
        dtype=dtype,
        size=n,
        element_shape=element_shape,
        identical_element_shapes=identical_element_shapes,
        dynamic_size=dynamic_size,
        clear_after_read=clear_after_read,
    )


def write(session: Session, handle: str, index: np.ndarray, value: np.ndarray) -> None:
    i = args.int32_scalar(index, "index", "TensorArray index must be scalar, but had shape: ")
    ta = session.tensor_array(handle)
    _check_write_dtype(ta, value)
    ta.write(i, value)


def read(
    session: Session,
    handle: str,
    index: np.ndarray,
    dtype: np.dtype,
    hand_out: HandOut | None = None,
    cleared: list[Cleared] | None = None,
) -> np.ndarray:
    i = args.int32_scalar(index, "index", "TensorArray index must be scalar, but had shape: ")
    ta = session.tensor_array(handle)
    _check_read_dtype(ta, dtype)
    return ta.read(i, hand_out, cleared)


def gather(
    session: Session,
    handle: str,
    indices: np.ndarray,
    dtype: np.dtype,
    element_shape: shapes.PartialShape,
    check: Callable[[], None] | None = None,
    hand_out: HandOut | None = None,
    cleared: list[Cleared] | None = None,
) -> np.ndarray:
    ta = session.tensor_array(handle)
    _check_read_dtype(ta, dtype)
    ta.check_element_shape(element_shape)  # (TensorFlow's order: before the indices)
    idx = args.int_vector(
        indices, "indices", "Expected indices to be a vector, but received shape: "
    )
    return ta.gather(idx, element_shape, check, hand_out, cleared)


def scatter(session: Session, handle: str, indices: np.ndarray, value: np.ndarray) -> None:
    ta = session.tensor_array(handle)
    _check_write_dtype(ta, value)
    if value.ndim == 0:
        raise InvalidArgumentError(
            "Input value for unpack must be at least a vector but received shape: []",
            field="value",
        )
    ta.size()  # closed: refused before the indices are looked at (TensorFlow's order)
    idx = args.int_vector(
        indices, "indices", "Expected indices to be a vector, but received shape: "
    )
    ta.scatter(idx, value)


def concat(
    session: Session,
    handle: str,
    dtype: np.dtype,
    element_shape_except0: shapes.PartialShape,
    check: Callable[[], None] | None = None,
    hand_out: HandOut | None = None,
    cleared: list[Cleared] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    ta = session.tensor_array(handle)
    _check_read_dtype(ta, dtype)
    return ta.concat(element_shape_except0, check, hand_out, cleared)


def split(session: Session, handle: str, value: np.ndarray, lengths: np.ndarray) -> None:
    ta = session.tensor_array(handle)
    n = args.int_vector(
        lengths, "lengths", "Expected lengths to be a vector, received shape: ", bits=64
    )
    if value.ndim == 0:
        raise InvalidArgumentError(
            "Expected value to be at least a vector, but received shape: []", field="value"
        )
    if sum(n) != value.shape[0]:
        raise InvalidArgumentError(
            f"Expected sum of lengths to be equal to values.shape[0], but sum of lengths is "
            f"{sum(n)} and value's shape is: {shapes.debug_string(value.shape)}",
            field="lengths",
        )
    ta.size()  # closed: refused here, as TensorFlow's split refuses it
    # TensorFlow 2.21 aborts the process on a negative length here (a CHECK in
    # TensorShape::set_dim): refused instead, in its style.
    for i, length in enumerate(n):
        if length < 0:
            raise InvalidArgumentError(
                f"Expected lengths to be non-negative, but lengths[{i}] is {length}",
                field="lengths",
            )
    ta.split(n, value, before_write=lambda: _check_write_dtype(ta, value))


def size(session: Session, handle: str) -> np.ndarray:
    return np.array(session.tensor_array(handle).size(), dtype=np.int32)


def close(session: Session, handle: str) -> None:
    session.close_tensor_array(handle)


def grad(
    session: Session,
    handle: str,
    source: str,
    shape_to_prepend: np.ndarray | None = None,
    *,
    registry: GradRegistry | None = None,
) -> tuple[str, TensorArray]:
    """TensorArrayGradV3 (``shape_to_prepend`` None) or TensorArrayGradWithShape;
    ``registry``: a gradient computation's own (``Session.grad_array``)."""
    args.short_name(source, "source")
    session.grad_source(handle)  # (TensorFlow's order: before shape_to_prepend)
    prepend: tuple[int, ...] = ()
    if shape_to_prepend is not None:
        # TensorFlow's TensorShapeUtils::MakeShape, and its words.
        dims = args.int_vector(
            shape_to_prepend,
            "shape_to_prepend",
            "shape must be a vector of {int32,int64}, got shape ",
            bits=64,
        )
        for d in dims:
            if d < 0:
                raise InvalidArgumentError(f"Dimension {d} must be >= 0", field="shape_to_prepend")
        prepend = tuple(dims)
    return session.grad_array(handle, source, prepend, registry=registry)
