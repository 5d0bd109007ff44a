"""Tensors move through memory touched before (``gradserve.heap``), and a put keeps
the bytes gRPC received (``app.VIEW_PARSERS``): the page faults and copies the wire
paid per call, checked where they were paid."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import gradserve
from gradserve import codec, heap, protocol, shapes, warm_buffers
from gradserve.errors import InvalidArgumentError, ResourceExhaustedError
from gradserve.server import run_server
from gradserve.v1 import tensor_pb2
from tests.memory_owner import memory_owner
from tests.server_process import ServerProcess

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
glibc_linux = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not os.path.exists("/proc/self/stat"),
    reason="glibc's malloc and /proc: the thresholds and the fault counts",
)


def minor_faults(pid: int | str = "self") -> int:
    """Minor page faults of a process so far (/proc/PID/stat, field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


# A get's pattern in the SDK: gRPC's reply bytes, protobuf's copy of them, the field
# read out of it, all freed at once: glibc gave the pages back every time.
_PATTERN = textwrap.dedent(
    """
    import sys
    import numpy as np
    from gradserve import codec, heap
    from gradserve.v1 import tensor_pb2
    from tests.server.test_warm_heap import minor_faults
    warm = sys.argv[1] == "warm"
    if warm:
        assert heap.keep_warm() and heap.keep_warm()  # once; later calls cheap and True
    raw = codec.serialize_tensor(np.ones(1 << 20, np.float32))  # 4 MiB
    for _ in range(3):
        codec.decode(tensor_pb2.Tensor.FromString(raw))
    before = minor_faults()
    for _ in range(20):
        codec.decode(tensor_pb2.Tensor.FromString(raw))
    print((minor_faults() - before) / 20)
    """
)


def _faults_per_decode(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _PATTERN, mode], capture_output=True, text=True, check=True
    )
    return float(out.stdout)


@glibc_linux
def test_keep_warm_reuses_the_pages_of_freed_buffers():
    pages = 4 * MIB // PAGE
    warm, default = _faults_per_decode("warm"), _faults_per_decode("default")
    # glibc's own thresholds fault about every page of it twice over on each decode;
    # kept warm, only a few (Python's small objects).
    assert warm < pages / 16, f"{warm} faults per 4 MiB decode kept warm ({default} without)"


@glibc_linux
def test_a_served_put_and_get_reuse_warm_memory_on_both_sides():
    """The server process (its entry point) and the SDK (``Client``) keep their heaps
    warm: a 1 MiB unary put and get fault in some pages, not the 256 per MiB
    (times the copies) that fresh memory costs. The faults are the whole process's:
    in the test run's process, other tests' threads fault pages too (a clean-clone CI
    run measured 137 per put and get once, 0-48 alone), so the quietest of three
    rounds counts; fresh memory faults every page in every round."""
    value = np.arange(MIB // 4, dtype=np.float32)
    server = ServerProcess()
    server_faults, client_faults = [], []
    try:
        with gradserve.Client(server.target, shared_memory=False) as client:
            for _ in range(5):  # warm-up: the heaps grow to their working size
                client.get(ref := client.put(value))
                client.delete(ref)
            for _round in range(3):
                server_before, client_before = minor_faults(server.proc.pid), minor_faults()
                for _ in range(20):
                    ref = client.put(value)
                    assert np.array_equal(client.get(ref), value)
                    client.delete(ref)
                server_faults.append((minor_faults(server.proc.pid) - server_before) / 20)
                client_faults.append((minor_faults() - client_before) / 20)
    finally:
        server.stop()
    server_faults, client_faults = min(server_faults), min(client_faults)
    pages = MIB // PAGE
    assert server_faults < pages / 2, f"server: {server_faults} faults per 1 MiB put and get"
    assert client_faults < pages / 2, f"client: {client_faults} faults per 1 MiB put and get"


def test_a_unary_put_keeps_the_bytes_grpc_received(server, target):
    """No copy on the server: the session holds a view of the request itself."""
    value = np.random.default_rng(0).standard_normal((256, 512))  # 1 MiB
    with gradserve.Client(target, shared_memory=False) as client:
        ref = client.put(value)
        kept = server.store.get(client.session_id).get(ref.id)
        owner = memory_owner(kept)
        assert isinstance(owner, bytes) and 0 < len(owner) - value.nbytes < 64
        assert not kept.flags.writeable and kept.ctypes.data % 16 == 0
        assert np.array_equal(client.get(ref), value)


@pytest.mark.parametrize("rank", [shapes.MAX_RANK, shapes.MAX_RANK + 1, 100_000])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_a_long_shape_is_left_to_protobuf(rank, packed):
    """``_fields`` reads shapes of up to ``MAX_RANK`` dims: a longer one (a Python
    loop per dim on the server's event loop) goes to protobuf's C parser, and no
    tensor has it."""
    shape = [1] * (rank - 1) + [3]
    content = np.arange(3, dtype=np.float32).tobytes()
    if packed:
        data = tensor_pb2.Tensor(dtype=tensor_pb2.DT_FLOAT32, shape=shape, content=content)
        raw = data.SerializeToString()
    else:  # each dim its own varint field, as an older writer may send them
        raw = b"\x08" + bytes([tensor_pb2.DT_FLOAT32])
        raw += b"".join(b"\x10" + bytes([d]) for d in shape)
        raw += b"\x1a" + bytes([len(content)]) + content
    parsed = codec.parse_tensor(raw)
    expected = tensor_pb2.Tensor.FromString(raw)
    assert list(parsed.shape) == shape
    if rank <= shapes.MAX_RANK:
        assert isinstance(parsed, codec.WireTensor)
        assert np.array_equal(codec.decode(parsed), codec.decode(expected))
    else:
        assert isinstance(parsed, tensor_pb2.Tensor) and parsed == expected
        with pytest.raises(InvalidArgumentError, match=f"{rank} dimensions"):
            codec.decode(parsed)


@pytest.mark.parametrize("rpc", ["PutTensorInline", "PutTensor"])
@pytest.mark.parametrize("rank", [shapes.MAX_RANK, shapes.MAX_RANK + 1, 100_000])
def test_a_put_of_too_many_dims_is_refused_and_the_server_serves_on(target, rpc, rank):
    shape = [1] * (rank - 1) + [2]
    content = np.arange(2, dtype=np.float32).tobytes()
    with gradserve.Client(target, shared_memory=False) as client:
        if rpc == "PutTensorInline":
            request: object = tensor_pb2.Tensor(
                dtype=tensor_pb2.DT_FLOAT32, shape=shape, content=content
            ).SerializeToString()
        else:
            chunk = tensor_pb2.TensorChunk(
                dtype=tensor_pb2.DT_FLOAT32, shape=shape, data=content, content_bytes=8
            ).SerializeToString()
            request = lambda: iter([chunk])  # noqa: E731 - a request stream
        if rank <= shapes.MAX_RANK:
            reply = client._call(rpc, request)
            assert list(reply.shape) == shape
            assert np.array_equal(
                client.get(reply.id), np.arange(2, dtype=np.float32).reshape(shape)
            )
        elif rank > protocol.MAX_REQUEST_FIELDS:  # refused before it is parsed
            with pytest.raises(ResourceExhaustedError, match=r"more than \d+ fields"):
                client._call(rpc, request)
        else:
            with pytest.raises(InvalidArgumentError, match=f"{rank} dimensions"):
                client._call(rpc, request)
        assert np.array_equal(client.get(client.put(np.ones(3))), np.ones(3))


LARGE = heap.MMAP_THRESHOLD_BYTES + 8 * PAGE  # above what a warm heap serves


def test_the_sdk_fetches_large_tensors_into_buffers_it_reuses(target):
    """Above the heap's 32 MiB, a fetched tensor's buffer is kept once the array is
    gone and serves the next fetch of that size; never while a view of it lives."""
    value = np.random.default_rng(2).integers(0, 255, LARGE, dtype=np.uint8)
    with gradserve.Client(target, shared_memory=False) as client:
        ref = client.put(value)
        first = client.get(ref)
        second = client.get(ref)  # ``first`` lives: a buffer of its own
        assert client._buffers.hits == 0 and not np.shares_memory(first, second)
        address = first.ctypes.data
        del first
        third = client.get(ref)  # ``first``'s buffer, warm
        assert client._buffers.hits == 1 and third.ctypes.data == address
        assert np.array_equal(second, value) and np.array_equal(third, value)
        assert not third.flags.writeable
        del second, third
        assert client._buffers.cached_bytes >= 2 * LARGE
    assert client._buffers.cached_bytes == 0  # ``close`` drops them


def test_a_client_without_a_cache_keeps_nothing(target):
    value = np.ones(LARGE, np.uint8)
    with gradserve.Client(target, shared_memory=False, host_cache_bytes=0) as client:
        ref = client.put(value)
        for _ in range(2):
            assert np.array_equal(client.get(ref), value)
        assert client._buffers.hits == 0 and client._buffers.cached_bytes == 0


def _empty_shape_fields(count: int) -> bytes:
    """A float32 ``Tensor`` of shape [3] whose shape comes after ``count`` empty packed
    shape fields (valid protobuf: each adds no dim)."""
    content = np.arange(3, dtype=np.float32).tobytes()
    raw = b"\x08" + bytes([tensor_pb2.DT_FLOAT32]) + b"\x12\x00" * count
    return raw + b"\x12\x01\x03\x1a" + bytes([len(content)]) + content


@pytest.mark.parametrize("count", [shapes.MAX_RANK - 1, shapes.MAX_RANK, 500_000])
def test_many_shape_fields_are_left_to_protobuf(count):
    """Each shape field is a turn of ``_fields``' loop even when it adds no dim: past
    ``MAX_RANK`` of them (a hostile request's, megabytes of them on the server's event
    loop), protobuf parses the message, to the same tensor."""
    raw = _empty_shape_fields(count)
    parsed = codec.parse_tensor(raw)
    assert isinstance(parsed, codec.WireTensor) == (count + 1 <= shapes.MAX_RANK)
    assert list(parsed.shape) == [3]
    assert np.array_equal(codec.decode(parsed), np.arange(3, dtype=np.float32))


def test_a_request_of_many_empty_shape_fields_is_put_as_protobuf_reads_it(target):
    with gradserve.Client(target, shared_memory=False) as client:
        reply = client._call("PutTensorInline", _empty_shape_fields(60_000))
        assert np.array_equal(client.get(reply.id), np.arange(3, dtype=np.float32))
        with pytest.raises(ResourceExhaustedError, match="more than 65536 fields"):
            client._call("PutTensorInline", _empty_shape_fields(500_000))


@pytest.mark.parametrize("padding", [codec.MAX_PADDING_BYTES, codec.MAX_PADDING_BYTES + 1, MIB])
def test_a_long_padding_is_not_kept_with_the_tensor(server, target, padding):
    """A view keeps its whole request in memory, and the session is charged for the
    content alone: a padding longer than any writer here needs goes to protobuf,
    whose copy of the content is all that stays."""
    content = np.arange(4, dtype=np.float32).tobytes()
    raw = tensor_pb2.Tensor(
        dtype=tensor_pb2.DT_FLOAT32, shape=[4], content=content, padding=bytes(padding)
    ).SerializeToString()
    parsed = codec.parse_tensor(raw)
    assert isinstance(parsed, codec.WireTensor) == (padding <= codec.MAX_PADDING_BYTES)
    with gradserve.Client(target, shared_memory=False) as client:
        reply = client._call("PutTensorInline", raw)
        kept = server.store.get(client.session_id).get(reply.id)
        assert len(memory_owner(kept)) < len(content) + 64
        assert np.array_equal(kept, np.arange(4, dtype=np.float32))


def test_a_client_keeps_the_heap_warm_unless_told_not_to(target, monkeypatch):
    """The fault test above cannot tell on the client's side once something else in
    the test process set the thresholds (the LSTM kernels do): this one can."""
    called: list[bool] = []
    monkeypatch.setattr(heap, "keep_warm", lambda: called.append(True) or True)
    with gradserve.Client(target, shared_memory=False):
        assert called == [True]
    with gradserve.Client(target, shared_memory=False, keep_heap_warm=False):
        assert called == [True]


def test_an_array_held_past_close_leaves_nothing_in_the_cache(target):
    value = np.ones(LARGE, np.uint8)
    with gradserve.Client(target, shared_memory=False) as client:
        held = client.get(client.put(value))
    assert client._buffers.cached_bytes == 0
    del held  # its buffer returns to a closed client's cache: dropped
    assert client._buffers.cached_bytes == 0


def test_idle_buffers_expire_at_the_next_fetch_without_a_keepalive(target):
    value = np.ones(LARGE, np.uint8)
    with gradserve.Client(target, shared_memory=False, keepalive=False) as client:
        ref = client.put(value)
        client.get(ref)
        assert client._buffers.cached_bytes >= LARGE
        client._buffers.idle_seconds = 0.0
        small = client.put(np.ones(4))
        client.get(small)  # a unary get: no fetch, nothing expires
        assert client._buffers.cached_bytes >= LARGE
        client._fetch(small.id, delete_after=False)  # any fetch expires idle buffers
        assert client._buffers.cached_bytes == 0


def test_idle_buffers_expire_by_the_keepalive_thread():
    with run_server(host="127.0.0.1", port=0, device="cpu", session_ttl=0.3) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            client.get(client.put(np.ones(LARGE, np.uint8)))
            assert client._buffers.cached_bytes >= LARGE
            client._buffers.idle_seconds = 0.0
            deadline = time.monotonic() + 10
            while client._buffers.cached_bytes and time.monotonic() < deadline:
                time.sleep(0.02)
            assert client._buffers.cached_bytes == 0


@pytest.fixture
def no_glibc(monkeypatch):
    """This process seen as one without glibc (musl, macOS, Windows), the heap's
    cached lookups redone on both sides of the test."""
    monkeypatch.setattr(platform, "libc_ver", lambda *args, **kwargs: ("", ""))
    heap._glibc.cache_clear()
    heap._set_thresholds.cache_clear()
    yield
    monkeypatch.undo()
    heap._glibc.cache_clear()
    heap._set_thresholds.cache_clear()
    heap.keep_warm()


def test_without_glibc_the_heap_is_left_alone_and_a_client_still_works(no_glibc, target):
    assert heap.keep_warm() is False and not heap.is_warm() and not heap.can_trim()
    heap.trim()  # nothing to do, nothing raised
    with gradserve.Client(target, shared_memory=False) as client:
        assert client._buffers.min_bytes == warm_buffers.MIN_BYTES  # no warm heap below 32 MiB
        assert np.array_equal(client.get(client.put(np.arange(5.0))), np.arange(5.0))


def test_a_long_packed_shape_is_read_no_further_than_max_rank(monkeypatch):
    """The bound is on the work, not only on the result: a packed shape of 100,000
    dims is given up after ``MAX_RANK`` of them, not read to its end."""
    raw = tensor_pb2.Tensor(
        dtype=tensor_pb2.DT_FLOAT32, shape=[1] * 100_000, content=b""
    ).SerializeToString()
    calls = 0
    varint = codec._varint

    def counting(data, pos):
        nonlocal calls
        calls += 1
        return varint(data, pos)

    monkeypatch.setattr(codec, "_varint", counting)
    assert isinstance(codec.parse_tensor(raw), tensor_pb2.Tensor)
    assert calls <= shapes.MAX_RANK + 8  # the dims read, the dtype's and lengths'
