"""``gradserve.TensorArray``: a ``tf.TensorArray``-style object living on the server."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from gradserve import dtypes, shapes
from gradserve.client import _attrs as attrs
from gradserve.client._convert import to_array
from gradserve.client._types import TapedArray, TensorArrayHandle, TensorRef
from gradserve.errors import InvalidArgumentError, OutOfRangeError


class TensorArray:
    """A TensorArray in the client's session, used the way ``tf.TensorArray`` is.

    Methods that change the array return ``self`` (so ``ta = ta.write(i, x)``
    reads like TensorFlow code). The ``element_shape`` given is passed to gather and
    concat as TensorFlow's wrapper does. Values that are not arrays are
    converted with the array's dtype.

    As ``tf.TensorArray`` in eager mode: a write (or a scatter's elements) of a shape
    incompatible with ``element_shape`` is a ``ValueError``, and with ``infer_shape``
    (the default) each written shape is merged into ``element_shape``, so unwritten
    elements read, stack and concat as zeros of it (they were refused: the element
    shape was not fully defined). ``unstack`` and ``split`` neither check nor merge,
    as TensorFlow's.
    """

    def __init__(
        self,
        client,
        dtype: dtypes.DTypeLike,
        size: int = 0,
        dynamic_size: bool = False,
        clear_after_read: bool = True,
        tensor_array_name: str = "",
        element_shape: Sequence[int | None] | None = None,
        identical_element_shapes: bool = False,
        *,
        infer_shape: bool = True,
        handle: TensorArrayHandle | None = None,
        flow: float = 0.0,
    ) -> None:
        self._client = client
        self.dtype = attrs.make_type(dtype, "dtype")  # as tf.TensorArray reads it
        #: As made (a gradient array is not dynamic): which indices are out of it.
        #: None (an array from a handle, unless dynamic_size=True was said): unknown,
        #: so an index past the end is left to the op.
        self._dynamic_size = dynamic_size if handle is None or dynamic_size else None
        self.infer_shape = infer_shape
        #: The element shape given, which gathers and concats pass (the inferred one
        #: would hold the elements of an ``unstack`` or ``split`` to it there, which
        #: TensorFlow does not: helper-78).
        self._given_shape: shapes.PartialShape = (
            None if element_shape is None else shapes.make(element_shape)
        )
        #: The element shape given, merged with those written (``infer_shape``).
        self.element_shape = self._given_shape
        #: The element shape the server's array was last told (it knows the one it
        #: was made with), for unwritten elements (``_shape_known``).
        self._shape_told = self.element_shape
        if handle is None:
            handle, flow = client.raw_ops.TensorArrayV3(
                size=size,
                dtype=self.dtype,
                element_shape=element_shape,
                dynamic_size=dynamic_size,
                clear_after_read=clear_after_read,
                identical_element_shapes=identical_element_shapes,
                tensor_array_name=tensor_array_name,
            )
        self.handle = handle
        self.flow = flow

    @property
    def _ops(self):
        return self._client.raw_ops

    def _value(self, value):
        """A value to write as ``tf.TensorArray.write`` converts it (TensorFlow 2.21,
        recorded): a tensor the server holds (``TensorRef``, a live tape's output) as
        it is, refused if of another dtype; a NumPy value cast to the array's dtype as
        NumPy casts (``np.float64(1.5)`` into int32 is 1); a Python value converted as
        a tensor of the array's dtype where TensorFlow's preferred dtype takes it (bools
        and ints into any number, floats into floats and complex), else as TensorFlow
        converts it alone, and refused (``1.5`` into int32, ``2`` into bool). Strings
        and numbers never go into each other."""
        if isinstance(value, TensorRef) or (isinstance(value, TapedArray) and value.held):
            return value
        numpy_value = isinstance(value, (np.ndarray, np.generic))
        array = np.asarray(value) if numpy_value else to_array(value)
        if _is_string(array.dtype) != (self.dtype == dtypes.STRING):
            return array  # refused by the op, with TensorFlow's message
        if numpy_value or _widens(array.dtype, self.dtype):
            return array.astype(self.dtype, copy=False)
        return array

    def write(self, index: int, value) -> TensorArray:
        value = self._value(value)  # (an array, a TensorRef or a TapedArray: it has a shape)
        dtype_matches = self._dtype_matches(value)
        try:
            shape = self._checked_shape(value.shape) if dtype_matches else None
        except ValueError:
            self._check_indices([index])
            raise
        if not dtype_matches or _local_index(index) < 0:  # (the op's dtype error: the index first)
            self._check_indices([index])
        with _eager_errors():
            self.flow = self._ops.TensorArrayWriteV3(self.handle, index, value, self.flow)
        if shape is not None:
            self._merge_shape(shape)
        return self

    def _check_indices(self, indices: Sequence[int] | np.ndarray[Any, Any]) -> None:
        """TensorFlow's eager array checks each index before the value's dtype and
        shape, element after element: the first index out of the array, in order, is
        its OutOfRangeError, before the dtype's or the shape's error (a review
        helper). Called where a write will be refused: the array's size costs a call
        only there."""
        size = None
        for index in (_local_index(i) for i in indices):
            if index < 0:
                raise OutOfRangeError(_WRITE_NEGATIVE.format(index))
            if self._dynamic_size is False:
                size = self.size() if size is None else size
                if index >= size:
                    raise OutOfRangeError(_WRITE_PAST.format(index, size))

    def _dtype_matches(self, value) -> bool:
        """Whether ``value`` (converted) has the array's dtype. TensorFlow checks the
        dtype before the shape: a value wrong in both is its InvalidArgumentError,
        which the op gives here, not the shape's ValueError (helper-76)."""
        return bool(value.dtype == self.dtype)

    def _checked_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """TensorFlow's ValueError for an element of a shape the array's element shape
        does not take (its words, its shape spelling)."""
        shape = tuple(int(d) for d in shape)
        if not shapes.is_compatible(self.element_shape, shape):
            raise ValueError(
                f"Incompatible shape for value ({_tf_shape(shape)}), expected "
                f"({_tf_shape(self.element_shape)})"
            )
        return shape

    def _merge_shape(self, shape: tuple[int, ...]) -> None:
        if self.infer_shape:
            self.element_shape = shapes.merge(self.element_shape, shape)

    def read(self, index: int) -> np.ndarray:
        with _eager_errors():
            return self._shape_known(
                lambda: self._ops.TensorArrayReadV3(self.handle, index, self.flow, self.dtype)
            )

    def _shape_known(self, op: Callable[[], Any]) -> Any:
        """``op()`` (a read, gather or concat). Refused for an unwritten element whose
        shape the server does not know, while the inferred element shape is fully
        defined: the server is told it, and ``op`` runs again (it changed nothing), so
        the element reads as zeros of that shape. Not fully defined: TensorFlow's eager
        array's ValueError."""
        try:
            return op()
        except InvalidArgumentError as e:
            known = self.element_shape
            if "not fully defined" not in str(e):
                raise
            if not shapes.is_fully_defined(known):  # TensorFlow's eager array's error
                raise ValueError(
                    f"Cannot convert a partially known TensorShape {_tf_shape(known)} to a Tensor."
                ) from None
            if known == self._shape_told:
                raise
        self._gather(np.zeros(0, np.int32), known)  # a gather of nothing merges it there
        self._shape_told = known
        return op()

    def gather(self, indices: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray:
        if len(indices) == 0:  # its shape is the one the op passes (helper-79: refused)
            return self._gather(indices, self.element_shape)
        return self._shape_known(lambda: self._gather(indices, self._given_shape))

    def _gather(self, indices: Any, element_shape: shapes.PartialShape) -> np.ndarray:
        return self._ops.TensorArrayGatherV3(
            self.handle, np.asarray(indices, np.int32), self.flow, self.dtype, element_shape
        )

    def stack(self) -> np.ndarray:
        return self.gather(np.arange(self.size(), dtype=np.int32))

    def scatter(self, indices: Sequence[int] | np.ndarray[Any, Any], value) -> TensorArray:
        indices = np.asarray(indices, np.int32)
        value = self._value(value)
        shape = tuple(value.shape)
        dtype_matches = self._dtype_matches(value)
        # Eager writes element by element (index, dtype, shape): only the first index
        # comes before the value's dtype and shape; a 0-d value fails before any index.
        first = indices[:1] if len(shape) else indices[:0]
        try:
            checked = len(indices) and len(shape) and dtype_matches
            element = self._checked_shape(shape[1:]) if checked else None
        except ValueError:
            self._check_indices(first)
            raise
        if not dtype_matches:
            self._check_indices(first)
        elif len(shape) and (indices < 0).any():
            self._check_indices(indices)
        try:
            with _eager_errors():
                self.flow = self._ops.TensorArrayScatterV3(self.handle, indices, value, self.flow)
        except OutOfRangeError:  # the op names its largest index; the eager array, the first
            self._check_indices(indices)
            raise
        if element is not None:
            self._merge_shape(element)
        return self

    def unstack(self, value) -> TensorArray:
        value = self._value(value)
        self.flow = self._ops.TensorArrayScatterV3(
            self.handle, np.arange(value.shape[0], dtype=np.int32), value, self.flow
        )
        return self

    def concat(self) -> np.ndarray:
        except0 = None if self._given_shape is None else self._given_shape[1:]
        return self._shape_known(
            lambda: self._ops.TensorArrayConcatV3(self.handle, self.flow, self.dtype, except0).value
        )

    def split(self, value, lengths: Sequence[int]) -> TensorArray:
        self.flow = self._ops.TensorArraySplitV3(
            self.handle, self._value(value), np.asarray(lengths, np.int64), self.flow
        )
        return self

    def size(self) -> int:
        return int(self._ops.TensorArraySizeV3(self.handle, self.flow))

    def close(self) -> None:
        self._ops.TensorArrayCloseV3(self.handle)

    def grad(self, source: str, flow: float | None = None) -> TensorArray:
        """The gradient TensorArray for ``source`` (the same one for the same source)."""
        handle, grad_flow = self._ops.TensorArrayGradV3(
            self.handle, self.flow if flow is None else flow, source
        )
        grad = TensorArray(
            self._client,
            self.dtype,
            element_shape=self.element_shape,
            infer_shape=self.infer_shape,
            handle=handle,
            flow=grad_flow,
        )
        grad._dynamic_size = False  # a gradient array never grows
        return grad

    def __repr__(self) -> str:
        return f"TensorArray(name={self.handle.name!r}, dtype={self.dtype})"


#: TensorFlow's eager array's words for an index out of it (trailing spaces included).
_WRITE_NEGATIVE = "Writing to negative indices (index {0}) is not allowed."
_WRITE_PAST = "Tried to write to index {0} but array is not resizeable and size is: {1} "
_READ_NEGATIVE = "Reading from negative indices (index {0}) is not allowed."
_READ_PAST = "Tried to read from index {0} but array size is: {1} "

#: The op's errors for an index out of the array (index, size), and the eager array's
#: words for a negative index and one past the end.
_OUT_OF_RANGE = (
    (
        re.compile(
            r"Tried to write to index (-?\d+) but array is not resizeable and size is: (\d+)"
        ),
        _WRITE_NEGATIVE,
        _WRITE_PAST,
    ),
    (
        re.compile(r"Max scatter index must be < array size \((-?\d+) vs\. (\d+)\)"),
        _WRITE_NEGATIVE,
        _WRITE_PAST,
    ),
    (
        re.compile(r"Tried to read from index (-?\d+) but array size is: (\d+)"),
        _READ_NEGATIVE,
        _READ_PAST,
    ),
)


@contextmanager
def _eager_errors() -> Iterator[None]:
    """An index out of the array as TensorFlow's eager ``tf.TensorArray`` reports it:
    ``OutOfRangeError``, where the op (as TensorFlow's graph kernels) gives an
    ``InvalidArgumentError`` (a review helper's differential fuzz)."""
    try:
        yield
    except InvalidArgumentError as e:
        for pattern, negative, past in _OUT_OF_RANGE:
            found = pattern.search(str(e))
            if found:
                index, size = int(found.group(1)), int(found.group(2))
                words = negative if index < 0 else past
                raise OutOfRangeError(words.format(index, size)) from None
        raise


def _local_index(index: Any) -> int:
    """An index as a number; one the server holds (a TensorRef) is left to the op
    (0: never refused here)."""
    return 0 if isinstance(index, TensorRef) else int(index)


def _tf_shape(shape: shapes.PartialShape) -> str:
    """A shape as TensorFlow's ``TensorShape`` prints it: ``(2,)``, ``(None, 3)``,
    ``<unknown>``."""
    if shape is None:
        return "<unknown>"
    dims = ", ".join("None" if d is None else str(d) for d in shape)
    return f"({dims},)" if len(shape) == 1 else f"({dims})"


def _is_string(dtype: np.dtype) -> bool:
    return dtype == dtypes.STRING or dtype.kind in "SU"


_BFLOAT16 = dtypes.normalize("bfloat16")


def _kind(dtype: np.dtype) -> str:
    return "f" if dtype == _BFLOAT16 else dtype.kind


def _widens(source: np.dtype, target: np.dtype) -> bool:
    """Whether TensorFlow converts a Python value of ``source``'s kind to ``target``
    as a preferred dtype: bools and ints to any number, floats to floats and
    complex, complex to complex."""
    allowed = {"b": "biufc", "i": "iufc", "f": "fc", "c": "c"}.get(_kind(source), "")
    return _kind(target) in allowed
