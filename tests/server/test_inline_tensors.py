"""The wire's fast paths: unary put/get below the stream threshold, and chunks the
codec serializes itself (they must parse as the messages they replace)."""

from __future__ import annotations

import numpy as np
import pytest

import gradserve
from gradserve import codec, dtypes
from gradserve.errors import ResourceExhaustedError
from gradserve.v1 import service_pb2, tensor_pb2


@pytest.fixture
def client(target):
    with gradserve.Client(target, timeout=60, shared_memory=False) as c:
        yield c


def calls(client, monkeypatch) -> list[str]:
    """The RPC names ``client`` calls from now on."""
    seen: list[str] = []
    call = client._call

    def spy(rpc, *args, **kwargs):
        seen.append(rpc)
        return call(rpc, *args, **kwargs)

    monkeypatch.setattr(client, "_call", spy)
    return seen


def test_small_tensors_take_one_unary_call_each_way(client, monkeypatch):
    seen = calls(client, monkeypatch)
    value = np.arange(1000, dtype=np.float64)
    ref = client.put(value)
    out = client.get(ref)
    assert seen == ["PutTensorInline", "GetTensorInline"]
    assert out.dtype == value.dtype and np.array_equal(out, value)


def test_large_tensors_stream(target, monkeypatch):
    with gradserve.Client(target, shared_memory=False, stream_threshold=4096) as c:
        seen = calls(c, monkeypatch)
        value = np.arange(10_000, dtype=np.float32)
        assert np.array_equal(c.get(c.put(value)), value)
        assert seen == ["PutTensor"]  # GetTensor goes through _fetch's own stub call


@pytest.mark.parametrize("dtype", dtypes.SUPPORTED, ids=dtypes.name)
def test_every_dtype_by_unary_put_and_get(client, dtype):
    value = (
        np.arange(24).reshape(2, 3, 4).astype(dtype)
        if dtype != dtypes.STRING
        else (np.array([[b"a", b""], [b"xyz", b"\x00"]], dtype=object))
    )
    out = client.get(client.put(value))
    assert out.shape == value.shape and list(out.flat) == list(value.flat)


def test_get_inline_refuses_what_would_not_fit(client):
    ref = client.put(np.ones(100_000, np.float32))  # 400 KB
    md = (*client._metadata[:-1], ("x-gradserve-response-budget", "1000"))
    with pytest.raises(ResourceExhaustedError) as err:
        client._call("GetTensorInline", service_pb2.GetTensorRequest(id=ref.id), metadata=md)
    assert err.value.reason == "USE_GET_TENSOR"
    assert client.get(ref).shape == (100_000,)  # still there


def test_get_inline_delete_after(client):
    ref = client.put(np.ones(10, np.int32))
    request = service_pb2.GetTensorRequest(id=ref.id, delete_after=True)
    assert codec.decode(client._call("GetTensorInline", request)).tolist() == [1] * 10
    assert client.delete(ref) == 0


@pytest.mark.parametrize("chunk", [7, 4096, 65536, 1 << 20])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(30_000, dtype=np.float64),
        np.zeros((0, 3), np.int8),
        np.float32(2.5),
        np.array([b"ab", b"c" * 200], dtype=object),
    ],
    ids=["large", "empty", "scalar", "strings"],
)
def test_serialized_chunks_parse_as_the_messages(array, chunk):
    content = codec.WireContent(np.asarray(array))
    mine = [tensor_pb2.TensorChunk.FromString(c) for c in content.encoded_chunks(chunk)]
    theirs = list(content.chunks(chunk))
    assert mine == theirs
    out = codec.decode_chunks(mine)
    assert out.shape == np.shape(array) and list(out.flat) == list(np.asarray(array).flat)


def test_transient_outputs_are_fetched_two_at_a_time(target, monkeypatch):
    with gradserve.Client(target, shared_memory=False, stream_threshold=1) as c:
        values = [np.full(1 << 20, k, np.float32) for k in range(3)]  # 4 MiB each
        refs = [c.put(v) for v in values]
        taken = []
        take = c._prefetcher.take
        monkeypatch.setattr(c._prefetcher, "take", lambda i: taken.append(i) or take(i))
        b = c.batch()
        for ref in refs:
            b.raw_ops.StopGradient(input=ref)
        outs = b.run()
        assert len(taken) == 3
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))
        assert c._prefetcher._started == {}


def test_an_older_server_without_unary_put_and_get_means_streams(client, monkeypatch):
    call = client._call

    def older(rpc, *args, **kwargs):
        if rpc in ("PutTensorInline", "GetTensorInline"):
            raise gradserve.errors.UnimplementedError("Method not found!")
        return call(rpc, *args, **kwargs)

    monkeypatch.setattr(client, "_call", older)
    value = np.arange(100, dtype=np.int64)
    assert np.array_equal(client.get(client.put(value)), value)
    assert not client._unary_tensors
