"""The wire codec: bit-exact round trips and rejection of malformed tensors."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve import codec, dtypes, shapes
from gradserve.errors import InvalidArgumentError
from gradserve.v1 import tensor_pb2


def sample(dtype: np.dtype, shape) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype == dtypes.STRING:  # byte strings of 0-4 bytes, any byte values
        count = int(np.prod(shape))
        return np.array([rng.bytes(k % 5) for k in range(count)] + [None], object)[:-1].reshape(
            shape
        )
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)  # arbitrary bits: NaN payloads, -0.0, ...


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 4)])
def test_round_trip_is_bit_exact(dtype, shape):
    x = sample(dtype, shape)
    msg = tensor_pb2.Tensor.FromString(codec.encode(x).SerializeToString())
    y = codec.decode(msg)
    assert y.dtype == x.dtype and y.shape == x.shape
    if dtype == dtypes.STRING:
        assert y.tolist() == x.tolist()
    else:
        assert y.tobytes() == x.tobytes()


def test_strings_travel_as_utf8_bytes_in_chunks_of_any_size():
    x = np.array([["é", b"\0\xff"], ["", "tensor"]], object)
    want = [[b"\xc3\xa9", b"\0\xff"], [b"", b"tensor"]]
    assert codec.decode(codec.encode(x)).tolist() == want
    for chunk in (1, 3, 64):
        chunks = list(codec.encode_chunks(x, chunk))
        assert chunks[0].content_bytes == 4 * 8 + 2 + 2 + 0 + 6
        assert codec.decode_chunks(chunks).tolist() == want
    # Charged: each element's bytes and its cost as an object (not the 8-byte prefix).
    content = chunks[0].content_bytes
    assert dtypes.nbytes(codec.decode(codec.encode(x))) == content + 4 * (
        dtypes.STRING_ELEMENT_BYTES - 8
    )
    reserved = []
    codec.decode_chunks(chunks, before_allocating=reserved.append)
    assert reserved == [dtypes.nbytes(codec.decode(codec.encode(x)))]


def test_a_huge_empty_string_shape_is_invalid_argument_not_a_crash():
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DT_STRING, shape=[0, 2**62], content=b"")
    with pytest.raises(InvalidArgumentError, match="too large"):
        codec.decode(msg)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "needs at least 16 bytes"),
        ((3).to_bytes(8, "little") + b"ab" + (0).to_bytes(8, "little"), "runs past"),
        ((0).to_bytes(8, "little") * 2 + b"x", "after the last string"),
    ],
)
def test_malformed_string_content_is_refused(content, match):
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DT_STRING, shape=[2], content=content)
    with pytest.raises(InvalidArgumentError, match=match):
        codec.decode(msg)


def test_a_string_stream_declaring_too_little_content_is_refused_before_allocating():
    first = tensor_pb2.TensorChunk(dtype=tensor_pb2.DT_STRING, shape=[10**9], content_bytes=8)
    with pytest.raises(InvalidArgumentError, match="need at least"):
        codec.decode_chunks([first])


def test_decode_is_a_read_only_view():
    y = codec.decode(codec.encode(np.arange(4.0)))
    assert not y.flags.writeable


def test_big_endian_input_is_sent_little_endian():
    x = np.arange(3, dtype=">i4")
    msg = codec.encode(x)
    assert msg.content == np.arange(3, dtype="<i4").tobytes()
    np.testing.assert_array_equal(codec.decode(msg), x)


def test_non_contiguous_input():
    x = np.arange(12.0).reshape(3, 4)[:, ::2]
    np.testing.assert_array_equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize(
    "msg, match",
    [
        (tensor_pb2.Tensor(dtype=0, shape=[1], content=b"\0"), "unknown or unset dtype"),
        (tensor_pb2.Tensor(dtype=99, shape=[1], content=b"\0"), "unknown or unset dtype"),
        (
            tensor_pb2.Tensor(dtype=tensor_pb2.DT_FLOAT32, shape=[2], content=b"\0" * 4),
            "needs 8 bytes",
        ),
        (tensor_pb2.Tensor(dtype=tensor_pb2.DT_FLOAT32, shape=[-1], content=b""), "negative"),
        (
            tensor_pb2.Tensor(dtype=tensor_pb2.DT_FLOAT32, shape=[2**40, 2**40], content=b""),
            "too large",
        ),
        (  # found by the fuzzer: no elements, yet NumPy cannot represent the shape
            tensor_pb2.Tensor(dtype=tensor_pb2.DT_FLOAT32, shape=[0, 2**40, 2**40], content=b""),
            "too large",
        ),
    ],
)
def test_malformed_tensors_are_invalid_argument(msg, match):
    with pytest.raises(InvalidArgumentError, match=match):
        codec.decode(msg, field="value")


def test_unsupported_dtype_is_refused_on_encode():
    # An error of gradserve.errors (INVALID_ARGUMENT), not a bare ValueError.
    with pytest.raises(InvalidArgumentError, match="not supported"):
        codec.encode(np.array([1], "datetime64[D]"))


@pytest.mark.parametrize("shape", [None, (), (2, None, 3)])
def test_partial_shape_round_trip(shape):
    msg = tensor_pb2.PartialShape.FromString(codec.encode_shape(shape).SerializeToString())
    assert codec.decode_shape(msg) == shape


def test_shape_merge_and_debug_string():
    assert shapes.merge((2, None), (None, 3)) == (2, 3)
    assert shapes.debug_string((2, None)) == "[2,?]"
    assert shapes.debug_string(None) == "<unknown>"
    with pytest.raises(InvalidArgumentError, match="Incompatible ranks"):
        shapes.merge((1,), (1, 2))


def test_tf_dtype_names():
    assert dtypes.tf_name(np.dtype(np.float32)) == "float"
    assert dtypes.normalize("float") == np.float32
    assert dtypes.normalize("half") == np.float16


@pytest.mark.parametrize("shape", [(), (0,), (5, 3)], ids=str)
@pytest.mark.parametrize("chunk_bytes", [1, 7, 1 << 20])
def test_chunk_stream_round_trip(shape, chunk_bytes):
    x = sample(np.dtype(np.float64), shape)
    chunks = [
        tensor_pb2.TensorChunk.FromString(c.SerializeToString())
        for c in codec.encode_chunks(x, chunk_bytes)
    ]
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    assert len(chunks) == max(1, -(-x.nbytes // chunk_bytes))
    y = codec.decode_chunks(chunks)
    assert y.tobytes() == x.tobytes() and y.shape == x.shape and not y.flags.writeable


def test_chunk_stream_budget_refuses_before_allocating():
    asked = []

    def refuse(nbytes):
        asked.append(nbytes)
        raise InvalidArgumentError("no room")

    huge = tensor_pb2.TensorChunk(dtype=tensor_pb2.DT_FLOAT64, shape=[1 << 40])
    with pytest.raises(InvalidArgumentError, match="no room"):
        codec.decode_chunks([huge], before_allocating=refuse)
    assert asked == [8 << 40]  # a buffer of 8 TiB was never attempted


@pytest.mark.parametrize(
    "chunks, match",
    [
        ([], "no chunk"),
        ([tensor_pb2.TensorChunk(dtype=99, shape=[1], data=b"\0")], "unknown or unset dtype"),
        (
            [tensor_pb2.TensorChunk(dtype=tensor_pb2.DT_INT8, shape=[2], data=b"\0")],
            "ended after 1",
        ),
        (
            [
                tensor_pb2.TensorChunk(dtype=tensor_pb2.DT_INT8, shape=[1], data=b"\0"),
                tensor_pb2.TensorChunk(data=b"\0"),
            ],
            "more data",
        ),
        *(
            (
                [
                    tensor_pb2.TensorChunk(dtype=tensor_pb2.DT_FLOAT32, shape=[2], data=bytes(4)),
                    tensor_pb2.TensorChunk(**later, data=bytes(4)),
                ],
                "differs from the first chunk's",
            )
            for later in (
                {"dtype": tensor_pb2.DT_INT32},  # the same bytes, another dtype
                {"shape": [1, 2]},
                {"content_bytes": 8},
            )
        ),
    ],
)
def test_malformed_chunk_streams(chunks, match):
    with pytest.raises(InvalidArgumentError, match=match):
        codec.decode_chunks(chunks)


def test_a_later_chunk_may_repeat_the_header():
    head = {"dtype": tensor_pb2.DT_FLOAT32, "shape": [2]}
    one = np.float32(1).tobytes()
    chunks = [tensor_pb2.TensorChunk(**head, data=one), tensor_pb2.TensorChunk(**head, data=one)]
    np.testing.assert_array_equal(codec.decode_chunks(chunks), np.ones(2, np.float32))
