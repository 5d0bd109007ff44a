"""Every dtype through a real server, bit for bit: inline, resident, and streamed."""

from __future__ import annotations

import numpy as np
import pytest

import gradserve
from gradserve import dtypes
from gradserve.errors import InvalidArgumentError
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES


def arbitrary_bits(dtype: np.dtype, shape) -> np.ndarray:
    if dtype == dtypes.STRING:  # any bytes, of several lengths (a large one included)
        rng = np.random.default_rng(1)
        items = [rng.bytes(k * 7 % 11) for k in range(int(np.prod(shape)))]
        if items:
            items[0] = rng.bytes(5 << 20)  # 5 MiB: streamed, not inline
        out = np.empty(len(items), object)
        out[:] = items
        return out.reshape(shape)
    raw = np.random.default_rng(1).integers(0, 256, int(np.prod(shape)) * dtype.itemsize, np.uint8)
    if dtype == np.bool_:
        raw %= 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0), (5,), (3, 4)], ids=str)
def test_stop_gradient_is_bit_exact(client, dtype, shape):
    x = arbitrary_bits(dtype, shape)
    y = client.raw_ops.StopGradient(input=x)
    if x.ndim == 0:  # as TensorFlow's .numpy() gives it: a NumPy scalar, or bytes
        assert type(y) is (bytes if x.dtype == dtypes.STRING else x.dtype.type)
        y = np.array(y, dtype=x.dtype)
    assert y.dtype == x.dtype and y.shape == x.shape and same(y, x)
    assert same(np.array(client.stop_gradient(x), dtype=x.dtype), x)


def test_scalar_outputs_come_as_tensorflows_numpy_gives_them(client):
    # np.float32(1.5) and b"ab", as TensorFlow's .numpy(); they were 0-d arrays: a
    # string one had no .decode(), none could be a dict key (a review helper).
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype="string")
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, b"ab", flow)
    read = client.raw_ops.TensorArrayReadV3(h, 0, flow, "string")
    assert type(read) is bytes and read.decode() == "ab"
    value = client.raw_ops.StopGradient(np.float32(1.5))
    assert type(value) is np.float32 and {value: 1}[np.float32(1.5)] == 1
    with client.gradient_tape():  # a tape's output keeps its id: a 0-d TapedArray
        taped = client.raw_ops.StopGradient(np.float32(1.5))
    assert taped.ndim == 0 and taped.tape_id is not None
    kept = client.raw_ops.StopGradient(b"ab", keep=True).numpy()  # TensorFlow's name
    assert type(kept) is bytes and kept == b"ab"
    assert type(client.put(np.float32(2.0)).numpy()) is np.float32


def test_the_tensor_array_layer_casts_numpy_values_as_tensorflow_does(client):
    # tf.TensorArray.write (TensorFlow 2.21) casts NumPy values as NumPy casts them
    # (np.float64(1.5) into int32 is 1), strings and numbers never into each other, and
    # refuses a tensor of another dtype; the layer refused NumPy scalars of another
    # dtype once op outputs became NumPy scalars (a review helper).
    target = client.tensor_array(np.int32, size=3)
    target.write(0, np.float64(1.5)).write(1, np.array(2.7)).write(2, np.True_)
    assert target.stack().tolist() == [1, 2, 1]
    with pytest.raises(InvalidArgumentError, match="trying to write dtype double"):
        client.tensor_array(np.float32, size=1).write(0, client.put(np.float64(1.5)))
    with pytest.raises(InvalidArgumentError, match="trying to write dtype float"):
        client.tensor_array("string", size=1).write(0, np.float32(1.5))
    # Python values as a preferred dtype takes them: bools and ints into any number,
    # floats into floats (TensorFlow refuses 1.5 into int32, and 2 into bool).
    floats = client.tensor_array(np.float32, size=2).write(0, 2).write(1, True).stack()
    assert floats.tolist() == [2.0, 1.0] and floats.dtype == np.float32
    with pytest.raises(InvalidArgumentError, match="trying to write dtype float"):
        client.tensor_array(np.int32, size=1).write(0, 1.5)
    with pytest.raises(InvalidArgumentError, match="trying to write dtype int32"):
        client.tensor_array(np.bool_, size=1).write(0, 2)


def same(y: np.ndarray, x: np.ndarray) -> bool:
    """Bit for bit (strings: element by element)."""
    if x.dtype == dtypes.STRING:
        return y.dtype == x.dtype and y.tolist() == x.tolist()
    return y.tobytes() == x.tobytes()


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED, ids=str)
def test_resident_put_get_and_kept_outputs(client, dtype):
    x = arbitrary_bits(dtype, (3, 2))
    ref = client.put(x)
    assert ref.shape == (3, 2) and ref.dtype == dtype
    kept = client.raw_ops.StopGradient(input=ref, keep=True)
    assert isinstance(kept, gradserve.TensorRef)
    assert same(kept.numpy(), x)
    assert client.delete(ref, kept) == 2


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED, ids=str)
def test_a_rank_one_value_scatters_into_scalar_elements(client, dtype):
    # Each element of a rank-1 value is a 0-d array: a string one was a bare bytes
    # object, and the scatter failed INTERNAL (a review helper).
    x = arbitrary_bits(dtype, (3,))
    h, flow = client.raw_ops.TensorArrayV3(size=3, dtype=dtype)
    flow = client.raw_ops.TensorArrayScatterV3(h, [2, 0, 1], x, flow)
    assert same(client.raw_ops.TensorArrayGatherV3(h, [2, 0, 1], flow, dtype), x)


def test_string_dtype_names(client):
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype="float64")
    client.raw_ops.TensorArrayWriteV3(h, 0, np.array([1.5]), flow)
    assert client.raw_ops.TensorArrayReadV3(h, 0, flow, "double").dtype == np.float64


def test_over_100_mib_streams_both_ways(server, target):
    x = np.random.default_rng(2).standard_normal(14 * 1024 * 1024)  # 112 MiB of float64
    with gradserve.Client(target, stream_threshold=8 * 1024 * 1024, timeout=300) as client:
        y = client.raw_ops.StopGradient(input=x)
        assert y.tobytes() == x.tobytes()
        ref = client.put(x)
        assert client.get(ref).tobytes() == x.tobytes()
        # Temporary uploads and transient outputs were cleaned up: only ``ref`` is held.
        used = server.store.get(client.session_id).budget.used
        assert used == ref.nbytes + TENSOR_RECORD_BYTES
