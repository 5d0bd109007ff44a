"""The wire's copy-saving paths (issue 17): tensors serialized and parsed by hand must
be byte for byte what protobuf writes and reads; put and get keep their one round
trip, their budgets, their errors and their metrics whichever thread serves them."""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest

import gradserve
from gradserve import codec, dtypes
from gradserve.codec import WireChunk, WireTensor, parse_chunk, parse_tensor, serialize_tensor
from gradserve.errors import GradserveError, InvalidArgumentError, ResourceExhaustedError
from gradserve.server import run_server
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
from gradserve.server.transport import tensor_handlers
from gradserve.v1 import service_pb2, tensor_pb2
from tests.server import test_inline_tensors

KIB, MIB = 1 << 10, 1 << 20


def arrays():
    """Every dtype, and the shapes that differ on the wire (none, empty, several dims)."""
    for dtype in dtypes.SUPPORTED:
        if dtype == dtypes.STRING:
            yield np.array([[b"a", b""], [b"xyz", b"\x00" * 300]], dtype=object)
            yield np.array(b"one", dtype=object)
            continue
        yield np.arange(24).reshape(2, 3, 4).astype(dtype)
        yield np.zeros((0, 5), dtype)
        yield np.asarray(np.ones((), dtype))
    yield np.arange(1000, dtype=">f8")  # big-endian: little-endian on the wire
    yield np.arange(60, dtype=np.float32).reshape(6, 10)[:, ::3]  # not contiguous
    yield np.ones((1,) * 9 + (200_000,), np.int16)  # many dims, a long content length


ARRAYS = list(arrays())
IDS = [f"{a.dtype}{list(a.shape)}" for a in ARRAYS]


def same(out: np.ndarray, value: np.ndarray) -> bool:
    value = np.asarray(value)
    return out.shape == value.shape and list(out.flat) == list(value.flat)


@pytest.mark.parametrize("array", ARRAYS, ids=IDS)
def test_serialized_tensors_are_what_protobuf_writes(array):
    """The same message (but ``padding``), its content aligned in the bytes."""
    data = serialize_tensor(array)
    parsed = tensor_pb2.Tensor.FromString(data)
    assert parsed.padding == bytes(len(parsed.padding))
    parsed.ClearField("padding")
    assert parsed == codec.encode(array)
    if array.dtype != dtypes.STRING and array.size:
        start = data.index(parsed.content, len(data) - len(parsed.content))
        assert start % codec.CONTENT_ALIGNMENT == 0
    served = codec.Serialized(data)  # GetTensorInline's reply
    assert served.SerializeToString() == data and served.ByteSize() == len(data)


@pytest.mark.parametrize("array", ARRAYS, ids=IDS)
def test_parsed_tensors_are_what_protobuf_reads(array):
    data = codec.encode(array).SerializeToString()
    parsed = parse_tensor(data)
    assert isinstance(parsed, WireTensor)  # the plain encoding: no protobuf message
    out = codec.decode(parsed)
    assert out.dtype == codec.decode(tensor_pb2.Tensor.FromString(data)).dtype
    assert same(out, array)
    assert not out.flags.writeable  # as codec.decode of a message


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
@pytest.mark.parametrize("array", ARRAYS, ids=IDS)
def test_parsed_chunks_are_what_protobuf_reads(array, chunk):
    encoded = list(codec.WireContent(array).encoded_chunks(chunk))
    parsed = [parse_chunk(c) for c in encoded]
    assert all(isinstance(p, WireChunk) for p in parsed)
    theirs = [tensor_pb2.TensorChunk.FromString(c) for c in encoded]
    for mine, their in zip(parsed, theirs, strict=True):
        assert (mine.dtype, mine.shape, bytes(mine.data), mine.content_bytes) == (
            their.dtype,
            tuple(their.shape),
            their.data,
            their.content_bytes,
        )
    assert same(codec.decode_chunks(parsed), array)


def _unusual() -> list[bytes]:
    ok = codec.encode(np.arange(4, dtype=np.int32)).SerializeToString()
    negative_dim = tensor_pb2.Tensor(dtype=tensor_pb2.DT_INT32, shape=[-1], content=b"")
    negative_dtype = tensor_pb2.Tensor(dtype=-3, shape=[1], content=b"\0" * 4)  # type: ignore[arg-type]
    unpacked = b"\x08\x04" + b"\x10\x02\x10\x02" + b"\x1a\x10" + bytes(16)  # dims unpacked
    return [
        ok + b"\x28\x01",  # an unknown field (5)
        ok + b"\x08\x0b",  # dtype twice: protobuf keeps the last
        ok[:-3],  # cut short
        negative_dim.SerializeToString(),
        negative_dtype.SerializeToString(),
        unpacked,
        b"\xff" * 11,  # a varint that never ends
    ]


@pytest.mark.parametrize("data", _unusual())
def test_anything_unusual_is_left_to_protobuf(data):
    """Same value or same error class as protobuf and ``codec.decode`` give."""
    try:
        expected: object = codec.decode(tensor_pb2.Tensor.FromString(data))
    except Exception as e:  # noqa: BLE001 - compared below
        expected = type(e)
    try:
        got: object = codec.decode(parse_tensor(data))
    except Exception as e:  # noqa: BLE001 - compared below
        got = type(e)
    if isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == expected.dtype
        assert same(got, expected)
    else:
        assert got is expected


def test_a_broken_get_stream_is_still_data_loss_or_invalid():
    with pytest.raises(InvalidArgumentError):
        codec.decode_chunks([parse_chunk(b"\x08\x0b\x12\x01\x04\x1a\x02ab")])  # 2 of 16 bytes


# ------------------------------------------------------------------------- served
# The wire client (no shared memory) and the RPC spy of the unary fast paths' tests.
client = test_inline_tensors.client
calls = test_inline_tensors.calls


def streams(client, monkeypatch) -> list[str]:
    """GetTensor streams ``client`` opens from now on (``_fetch`` calls the stub)."""
    seen: list[str] = []
    fetch = client._fetch

    def spy(tensor_id, **kwargs):
        seen.append(tensor_id)
        return fetch(tensor_id, **kwargs)

    monkeypatch.setattr(client, "_fetch", spy)
    return seen


@pytest.mark.parametrize("nbytes", [4, 64 * KIB, 256 * KIB, 256 * KIB + 1, MIB, 4 * MIB - 8])
def test_below_the_threshold_a_put_and_a_get_are_one_unary_call_each(client, monkeypatch, nbytes):
    seen, opened = calls(client, monkeypatch), streams(client, monkeypatch)
    value = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    ref = client.put(value)
    out = client.get(ref)
    assert seen == ["PutTensorInline", "GetTensorInline"] and opened == []
    assert np.array_equal(out, value)


def test_at_the_threshold_both_stream(client, monkeypatch):
    seen, opened = calls(client, monkeypatch), streams(client, monkeypatch)
    value = np.arange(MIB, dtype=np.float32)  # 4 MiB
    ref = client.put(value)
    out = client.get(ref)
    assert seen == ["PutTensor"] and opened == [ref.id]
    assert np.array_equal(out, value) and not out.flags.writeable


@pytest.mark.parametrize(
    "nbytes", [tensor_handlers.ON_LOOP_BYTES, tensor_handlers.ON_LOOP_BYTES + 8]
)
def test_either_side_of_the_event_loop_limit(client, monkeypatch, nbytes):
    """Served on the event loop or on the lane: the same values, the same errors."""
    seen = calls(client, monkeypatch)
    value = np.random.default_rng(1).standard_normal(nbytes // 8)
    ref = client.put(value)
    assert np.array_equal(client.get(ref), value)
    request = service_pb2.GetTensorRequest(id=ref.id, delete_after=True)
    assert np.array_equal(codec.decode(client._call("GetTensorInline", request)), value)
    assert client.delete(ref) == 0  # deleted after it was sent
    with pytest.raises(gradserve.errors.NotFoundError):
        client._call("GetTensorInline", request)
    assert seen[:2] == ["PutTensorInline", "GetTensorInline"]


def test_a_declared_size_that_lies_is_refused(client):
    """A tensor declaring a small shape with more content: INVALID_ARGUMENT, nothing kept."""
    lie = tensor_pb2.Tensor(dtype=tensor_pb2.DT_FLOAT32, shape=[2], content=bytes(4 * 1000))
    with pytest.raises(InvalidArgumentError):
        client._call("PutTensorInline", lie.SerializeToString())
    bad = tensor_pb2.Tensor(dtype=tensor_pb2.DT_FLOAT32, shape=[-2], content=b"")
    with pytest.raises(GradserveError):
        client._call("PutTensorInline", bad.SerializeToString())


def test_strings_are_put_on_the_lane_and_fetched_by_stream(client, monkeypatch):
    seen, opened = calls(client, monkeypatch), streams(client, monkeypatch)
    value = np.array([b"x" * 1000, b"", "é".encode()] * 10, dtype=object)
    ref = client.put(value)
    out = client.get(ref)
    assert list(out) == list(value)
    assert seen == ["PutTensorInline"] and opened == [ref.id]


def test_the_session_budget_holds_on_the_fast_path():
    with run_server(device="cpu", max_session_bytes=256 * KIB) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as c:
            first = c.put(np.zeros(160 * KIB, np.uint8))
            with pytest.raises(ResourceExhaustedError) as err:
                c.put(np.zeros(160 * KIB, np.uint8))
            assert err.value.reason == "MEMORY_LIMIT"
            assert server.store.budget.used == 160 * KIB + TENSOR_RECORD_BYTES
            c.delete(first)
            assert server.store.budget.used == 0
            assert c.get(c.put(np.ones(160 * KIB, np.uint8))).sum() == 160 * KIB


def test_metrics_count_the_bytes_of_a_serialized_get():
    with run_server(device="cpu", metrics_port=0) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as c:
            ref = c.put(np.ones(1000, np.float64))
            assert c.get(ref).sum() == 1000
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback
                text = response.read().decode()
    pattern = r'^gradserve_sent_bytes_total\{method="GetTensorInline"\} ([0-9.e+]+)$'
    match = re.search(pattern, text, re.M)
    assert match and float(match.group(1)) >= 8000
    ok = r'^gradserve_rpcs_total\{code="OK",method="GetTensorInline"\} 1.0$'
    assert re.search(ok, text, re.M)
