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
