"""Python values convert as TensorFlow converts them.

The replay holds ``gradserve.client._convert.to_array`` to the table that
``golden/record_python_conversions.py`` recorded from ``tf.convert_to_tensor``: each
case's dtype (TensorFlow's "string" is an object array of ``bytes``), shape and values,
or TensorFlow's refusal message (TensorFlow raises ``ValueError``; the SDK raises
``ConversionError``, an ``InvalidArgumentError`` and a ``ValueError``). The behaviour tests send such values to a real server.
"""

from __future__ import annotations

import json
import math
import pathlib
import warnings
from decimal import Decimal
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from gradserve.client._convert import to_array
from gradserve.errors import ConversionError, InvalidArgumentError

SCOPE = {"np": np, "ml_dtypes": ml_dtypes}  # what a case's source may name
TABLE = json.loads(
    (pathlib.Path(__file__).parents[1] / "golden" / "python_conversions.json").read_text()
)


def _decode(x: Any, dtype: str) -> Any:
    """An element of the table's nested lists back as Python (see the recorder)."""
    if dtype == "string":
        return x.encode("latin-1") if isinstance(x, str) else [_decode(v, dtype) for v in x]
    if dtype.startswith("complex"):
        if x and isinstance(x[0], list):
            return [_decode(v, dtype) for v in x]
        return complex(_decode(x[0], "float64"), _decode(x[1], "float64"))
    if isinstance(x, list):
        return [_decode(v, dtype) for v in x]
    return float(x) if isinstance(x, str) else x


def _expected(expect: dict) -> np.ndarray:
    dtype, shape = expect["dtype"], tuple(expect["shape"])
    value = _decode(expect["value"], dtype)
    if dtype == "string":
        out = np.empty(math.prod(shape), dtype=object)
        out[:] = np.array(value, dtype=object).reshape(-1) if shape else [value]
        return out.reshape(shape)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    return np.array(value, dtype=np_dtype).reshape(shape)


@pytest.mark.golden
def test_table_matches_raw_ops():
    """Every case converts the same through a raw op's typed input (checked when
    recording), so the table is what ``tf.raw_ops`` does with the value too."""
    assert TABLE["raw_ops_disagree"] == []


@pytest.mark.golden
@pytest.mark.parametrize("case", TABLE["cases"], ids=[c["value"] for c in TABLE["cases"]])
def test_converts_as_tensorflow(case):
    with np.errstate(over="ignore"):  # np.float16(70000.0) warns as it is built
        value = eval(case["value"], SCOPE)  # the recorder's source, our own file
    expect = case["expect"]
    if "error" in expect:
        with pytest.raises(InvalidArgumentError) as info:
            to_array(value)
        assert str(info.value) == expect["message"]
        assert isinstance(info.value, ValueError)  # TensorFlow's class
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warnings leak to the caller
        got = to_array(value)
    assert isinstance(got, np.ndarray)
    want = _expected(expect)
    assert got.shape == want.shape
    if expect["dtype"] == "string":
        assert got.dtype == object
        assert all(type(x) is bytes for x in got.flat)
        assert got.tolist() == want.tolist()
        return
    assert got.dtype.name == expect["dtype"]
    assert got.dtype.isnative
    np.testing.assert_array_equal(got, want, strict=True)
    assert np.array_equal(np.signbit(got.real), np.signbit(want.real))  # -0.0 stays


# ------------------------------------------------------------------ behaviour
class HasArray:
    """A foreign tensor type that offers ``__array__`` only (as torch/TF tensors do)."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self._array if dtype is None else self._array.astype(dtype)


class HasDlpack:
    """A foreign tensor type that offers only DLPack (delegating to a NumPy array)."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()


class DeviceArray:
    """A CuPy-like device array: ``__array__`` refuses, ``.get()`` copies to the host."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed")

    def get(self) -> np.ndarray:
        return self._array.copy()


def test_float_list_written_into_float32_array(client):
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, [[4.0, 5.0]], flow)
    got = client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [[4.0, 5.0]])


def test_python_int_written_into_int32_array(client):
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.int32)
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, 1, flow)
    flow = client.raw_ops.TensorArrayWriteV3(h, 1, [2, 3], flow)
    first = client.raw_ops.TensorArrayReadV3(h, 0, flow, np.int32)
    assert first.dtype == np.int32 and first.shape == () and first == 1
    np.testing.assert_array_equal(client.raw_ops.TensorArrayReadV3(h, 1, flow, "int32"), [2, 3])


def test_float64_still_refused_by_float32_array(client):
    """NumPy arrays keep their dtype: float64 data is not silently narrowed."""
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="trying to write dtype double"):
        client.raw_ops.TensorArrayWriteV3(h, 0, np.float64(1.0), flow)


@pytest.mark.parametrize("wrap", [HasArray, HasDlpack, DeviceArray])
def test_array_like_objects_are_tensor_arguments(client, wrap):
    x = np.array([[1.5, -2.0], [0.25, 3.0]], np.float32)
    np.testing.assert_array_equal(client.stop_gradient(wrap(x)), x, strict=True)
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, wrap(x), flow)
    np.testing.assert_array_equal(client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32), x)


def test_put_converts_python_values(client):
    ref = client.put([1.5, 2.0])
    assert ref.dtype == np.float32 and ref.shape == (2,)
    np.testing.assert_array_equal(client.get(ref), np.array([1.5, 2.0], np.float32))
    assert client.put(HasDlpack(np.arange(3, dtype=np.int16))).dtype == np.int16


def test_refusals_are_invalid_argument_before_any_rpc():
    with pytest.raises(InvalidArgumentError, match="non-rectangular"):
        to_array([[1.0, 2.0], [3.0]])
    with pytest.raises(InvalidArgumentError, match="out-of-range integer"):
        to_array(2**63)


def test_integer_index_path_unchanged():
    """With a dtype (index inputs) Python values read as NumPy reads them; the SDK's
    range-checked cast (``_as_integer_input``) does the rest, as before."""
    assert to_array(5, np.int32).dtype == np.int64
    assert to_array(HasArray(np.array(3, np.int16)), np.int32).dtype == np.int16


@pytest.mark.parametrize(
    "value",
    [Decimal(2), Fraction(5, 2), [Decimal(1)], [1, None]],
    ids=["dec", "frac", "list", "none"],
)
def test_an_integer_input_refuses_what_tensorflow_cannot_convert(client, value):
    """TensorFlow 2.21's ValueError "Attempt to convert a value (Decimal('2')) with an
    unsupported type" for a size or index (recorded under /tmp/tf; "Can't convert
    Python sequence with mixed types" for [1, None]); it was a TypeError from the
    encoder here ("object of type 'decimal.Decimal' has no len()")."""
    with pytest.raises(ConversionError, match="with an unsupported type") as info:
        client.raw_ops.TensorArrayV3(size=value, dtype=np.float32)
    assert isinstance(info.value, ValueError)
    handle, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
    with pytest.raises(ConversionError, match="with an unsupported type"):
        client.raw_ops.TensorArrayWriteV3(handle, value, np.ones(1, np.float32), flow)


def test_large_nested_lists_convert_in_bulk():
    rows = np.random.default_rng(0).standard_normal((300, 300))
    got = to_array(rows.tolist())
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, rows.astype(np.float32))
    ints = to_array([list(range(300))] * 300)
    assert ints.dtype == np.int32 and ints.shape == (300, 300)
