"""Op attributes and integer inputs are checked as ``tf.raw_ops`` checks them, in the
caller's process, with TensorFlow's exception classes and messages.

Every case below was run through ``tf.raw_ops`` in TensorFlow 2.21 (CPU, eager); the
expected class and message are what it raised, or None where it accepted the value.
Before, the SDK took ``dynamic_size=1`` and ``np.True_`` as true, ``element_shape=[-1, 2]``
as an unknown dimension, refused ``dtype=1`` (TensorFlow's DataType number of float32),
and failed with bare Python errors ("'int' object is not iterable") or with the
server's INVALID_ARGUMENT for a Python float index.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gradserve.dtypes import UnsupportedDTypeError
from gradserve.errors import InvalidArgumentError

F32 = np.float32

TENSOR_ARRAY_CASES = [
    # (TensorArrayV3 keyword arguments, exception class or None, message start)
    ({"element_shape": -1}, ValueError,
     "Error converting element_shape to a TensorShape: Dimension -1 must be >= 0."),
    ({"element_shape": [-1, 2]}, ValueError,
     "Error converting element_shape to a TensorShape: Dimension -1 must be >= 0."),
    ({"element_shape": [2.0]}, TypeError,
     "Error converting element_shape to a TensorShape: Dimension value must be integer or "
     "None or have an __index__ method, got value '2.0' with type '<class 'float'>'"),
    ({"element_shape": [None, 2]}, None, None),
    ({"element_shape": 3}, None, None),
    ({"element_shape": np.array([2, 3])}, None, None),
    ({"dtype": 1}, None, None),
    ({"dtype": 7}, None, None),  # DT_STRING
    ({"dtype": "float32"}, None, None),
    ({"dtype": float}, None, None),
    ({"dtype": True}, None, None),  # DataType 1
    ({"dtype": 1.0}, None, None),
    ({"dtype": "float32_ref"}, None, None),
    ({"dtype": np.dtype(">f4")}, None, None),
    ({"dtype": int}, TypeError, "Expected DataType for argument 'dtype' not <class 'int'>."),
    ({"dtype": str}, TypeError, "Expected DataType for argument 'dtype' not <class 'str'>."),
    ({"dtype": "f4"}, TypeError, "Expected DataType for argument 'dtype' not 'f4'."),
    ({"dtype": "int"}, TypeError, "Expected DataType for argument 'dtype' not 'int'."),
    ({"dtype": None}, TypeError, "Expected DataType for argument 'dtype' not None."),
    ({"dtype": 101}, InvalidArgumentError,
     "AttrValue must not have reference type value of float_ref"),
    ({"dtype": 200}, InvalidArgumentError, "AttrValue has invalid DataType enum: 200"),
    ({"dtype": False}, InvalidArgumentError, "AttrValue has invalid DataType"),
    ({"dynamic_size": 1}, TypeError, "Expected bool for argument 'dynamic_size' not 1."),
    ({"dynamic_size": np.True_}, TypeError,
     "Expected bool for argument 'dynamic_size' not np.True_."),
    ({"clear_after_read": 0}, TypeError,
     "Expected bool for argument 'clear_after_read' not 0."),
    ({"tensor_array_name": 3}, TypeError,
     "Expected string for argument 'tensor_array_name' not 3."),
    ({"size": 2.0}, TypeError, "Cannot convert 2.0 to EagerTensor of dtype int32"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "error", "message"), TENSOR_ARRAY_CASES)
def test_tensor_array_attributes_as_tf_raw_ops(client, kwargs, error, message):
    args = {"size": 2, "dtype": F32, **kwargs}
    if error is None:
        handle, _ = client.raw_ops.TensorArrayV3(**args)
        assert handle.id
        return
    with pytest.raises(error) as info:
        client.raw_ops.TensorArrayV3(**args)
    assert str(info.value).startswith(message)


def test_an_element_shape_and_dtype_given_as_tf_gives_them_reach_the_array(client):
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=2, element_shape=3)  # float64, [3]
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, np.ones(3), flow)
    with pytest.raises(Exception, match=r"\[3\]"):
        client.raw_ops.TensorArrayWriteV3(h, 1, np.ones(4), flow)
    value = client.raw_ops.TensorArrayReadV3(h, 0, flow, dtype=2)
    assert value.dtype == np.float64 and value.shape == (3,)
    with pytest.raises(UnsupportedDTypeError, match="'qint8' is a TensorFlow dtype"):
        client.raw_ops.TensorArrayV3(size=2, dtype="qint8")
    with pytest.raises(UnsupportedDTypeError, match="float8_e4m3fn'> is a TensorFlow dtype"):
        client.raw_ops.TensorArrayV3(size=2, dtype=ml_dtypes.float8_e4m3fn)


def test_python_float_as_a_dtype_is_float32(client):
    # TensorFlow's as_dtype maps Python's float to float32 (NumPy's np.dtype(float) is
    # float64, which the SDK gave before: a write of [1.0, 2.0] was then refused).
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=float)
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, [1.0, 2.0], flow)
    assert client.raw_ops.TensorArrayReadV3(h, 0, flow, dtype=float).dtype == np.float32
    assert client.tensor_array(float, size=1).dtype == np.float32


def test_other_ops_attributes_and_integer_inputs(client):
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=F32)
    with pytest.raises(TypeError, match="^Cannot convert 0.0 to EagerTensor of dtype int32"):
        client.raw_ops.TensorArrayReadV3(h, 0.0, flow, F32)
    with pytest.raises(TypeError, match=r"^Cannot convert \[0, 1.5\] to EagerTensor"):
        client.raw_ops.TensorArrayGatherV3(h, [0, 1.5], flow, F32)
    with pytest.raises(TypeError, match="^Expected string for argument 'source' not 3."):
        client.raw_ops.TensorArrayGradV3(h, flow, source=3)
    z = lambda *s: np.zeros(s, F32)  # noqa: E731
    lstm = (np.int64(1), z(1, 1, 1), z(1, 1), z(1, 1), z(2, 4), z(1), z(1), z(1), z(4))
    with pytest.raises(TypeError, match="^Expected bool for argument 'use_peephole' not 1."):
        client.raw_ops.BlockLSTMV2(*lstm, use_peephole=1)
    with pytest.raises(TypeError, match="^Expected float for argument 'cell_clip' not '1'."):
        client.raw_ops.BlockLSTMV2(*lstm, cell_clip="1")
    with pytest.raises(TypeError, match="^Cannot convert 1.0 to EagerTensor of dtype int64"):
        client.raw_ops.BlockLSTMV2(1.0, *lstm[1:])
    assert client.raw_ops.BlockLSTMV2(*lstm, cell_clip=1).h.shape == (1, 1, 1)  # int: a float


def test_none_for_an_attribute_with_a_default_is_the_default(client):
    # TensorFlow's op wrappers read None as the attribute's default; the SDK raised
    # TypeError (a review helper's comparison, TensorFlow 2.21).
    none = dict.fromkeys(
        ("dynamic_size", "clear_after_read", "identical_element_shapes", "tensor_array_name")
    )
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32, **none)
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, [1.0], flow)
    with pytest.raises(InvalidArgumentError, match="array is not resizeable"):
        client.raw_ops.TensorArrayWriteV3(h, 1, [1.0], flow)  # dynamic_size: False
    client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    with pytest.raises(InvalidArgumentError, match="cleared after a previous read"):
        client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)  # clear_after_read: True
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(F32)  # noqa: E731
    lstm = (np.int64(2), r(2, 1, 2), r(1, 2), r(1, 2), r(4, 8), r(2), r(2), r(2), r(8))
    defaults = client.raw_ops.BlockLSTM(*lstm)
    nones = client.raw_ops.BlockLSTM(*lstm, forget_bias=None, cell_clip=None, use_peephole=None)
    np.testing.assert_array_equal(nones.h, defaults.h)
    v2 = client.raw_ops.BlockLSTMV2(*lstm, cell_clip=None, use_peephole=None)
    np.testing.assert_array_equal(v2.h, client.raw_ops.BlockLSTMV2(*lstm).h)
    with pytest.raises(TypeError, match="^Expected bool for argument 'use_peephole' not None."):
        client.raw_ops.BlockLSTMGradV2(*lstm, *v2, v2.cs, v2.h, use_peephole=None)  # no default


def test_empty_lists_for_integer_inputs_take_the_inputs_type(client):
    # TensorFlow converts [] to the input's int32 (int64 for lengths); the SDK refused
    # it as a Python float (NumPy's [] is float64).
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=F32, element_shape=[2])
    flow = client.raw_ops.TensorArrayScatterV3(h, [], np.zeros((0, 2), F32), flow)
    got = client.raw_ops.TensorArrayGatherV3(h, [], flow, F32, element_shape=[2])
    assert got.shape == (0, 2) and got.dtype == F32
    g, gflow = client.raw_ops.TensorArrayGradWithShape(h, flow, [], source="s")
    assert client.raw_ops.TensorArraySizeV3(g, gflow) == 2
    e, eflow = client.raw_ops.TensorArrayV3(size=0, dtype=F32)
    eflow = client.raw_ops.TensorArraySplitV3(e, np.zeros((0,), F32), [], eflow)
    assert client.raw_ops.TensorArraySizeV3(e, eflow) == 0


# (call on an array `h` with flow `flow`, TensorFlow 2.21's exception class, its message)
MALFORMED_CASES = [
    (lambda r, h, f: r.TensorArraySizeV3(h, None), ValueError,
     "Attempt to convert a value (None) with an unsupported type (<class 'NoneType'>) to a "
     "Tensor."),
    (lambda r, h, f: r.TensorArraySizeV3(h, "0"), TypeError,
     "Cannot convert '0' to EagerTensor of dtype float"),
    (lambda r, h, f: r.TensorArrayReadV3(None, 0, f, F32), ValueError,
     "Attempt to convert a value (None) with an unsupported type (<class 'NoneType'>) to a "
     "Tensor."),
    (lambda r, h, f: r.TensorArrayReadV3("abc", 0, f, F32), TypeError,
     "Cannot convert 'abc' to EagerTensor of dtype resource"),
    (lambda r, h, f: r.TensorArraySizeV3(f, h), ValueError,  # swapped
     "Failed to convert a NumPy array to a Tensor (Unexpected numpy data type)."),
    (lambda r, h, f: r.TensorArrayWriteV3(h, None, [1.0], f), ValueError,
     "Attempt to convert a value (None) with an unsupported type (<class 'NoneType'>) to a "
     "Tensor."),
    (lambda r, h, f: r.TensorArrayReadV3(h, "0", f, F32), TypeError,
     "Cannot convert '0' to EagerTensor of dtype int32"),
    (lambda r, h, f: r.TensorArraySizeV3(h, 0j), TypeError,
     "Cannot convert 0j to EagerTensor of dtype float"),
    (lambda r, h, f: r.TensorArrayV3(size=None, dtype=F32), ValueError,
     "Attempt to convert a value (None) with an unsupported type (<class 'NoneType'>) to a "
     "Tensor."),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), MALFORMED_CASES)
def test_malformed_arguments_raise_tensorflows_classes(client, call, error, message):
    # They raised AttributeError, TypeError("object of type 'NoneType' has no len()"),
    # or the server's INVALID_ARGUMENT (a review helper's comparison).
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32)
    with pytest.raises(error) as info:
        call(client.raw_ops, h, flow)
    assert str(info.value) == message


def test_a_flow_converts_as_a_float_tensor(client):
    # TensorFlow takes any float tensor as a flow (an array, a list, a NumPy float64);
    # the SDK took Python floats only.
    h, flow = client.raw_ops.TensorArrayV3(size=3, dtype=F32)
    for index, given in enumerate((np.array(0.0), [0.0], np.float64(1.5))):
        out = client.raw_ops.TensorArrayWriteV3(h, index, [1.0], given)
        assert type(out) is np.float32
