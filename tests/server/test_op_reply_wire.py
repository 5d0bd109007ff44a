"""Op replies in one copy each way (issue 17): the server appends large inline outputs
to the serialized reply by hand (``codec.serialize_with_values``), the SDK leaves
them in the received bytes (``codec.reply_parser``). Both must mean exactly what
protobuf writes and reads, for every dtype and every kind of output around them."""

from __future__ import annotations

import contextlib
import copy
import random

import numpy as np
import pytest
from google.protobuf.message import DecodeError

import gradserve
from gradserve import codec, dtypes
from gradserve.v1 import lstm_pb2, tensor_pb2
from tests.memory_owner import memory_owner
from tests.server.test_wire_fast import ARRAYS, IDS, same

NUMERIC = [(a, i) for a, i in zip(ARRAYS, IDS, strict=True) if a.dtype != dtypes.STRING]
FIELDS = [f.name for f in lstm_pb2.BlockLSTMResponse.DESCRIPTOR.fields]  # i .. h
NUMBER = {f.name: f.number for f in lstm_pb2.BlockLSTMResponse.DESCRIPTOR.fields}
#: A long tape id, and an output that is more than a value: what the reply may carry.
TAPE_ID = "t" * 200


def reply_with(values: dict[str, np.ndarray]) -> lstm_pb2.BlockLSTMResponse:
    """A BlockLSTMResponse as protobuf writes it: ``values`` inline, ``cs`` a ref,
    ``h`` with a tape id."""
    reply = lstm_pb2.BlockLSTMResponse()
    reply.cs.ref.id, reply.cs.ref.transient = "ref-id", True
    reply.h.tape_id = TAPE_ID
    for name, array in values.items():
        codec.encode(array, getattr(reply, name).value)
    return reply


def without_padding(reply: lstm_pb2.BlockLSTMResponse) -> lstm_pb2.BlockLSTMResponse:
    """``reply`` with every value's ``padding`` checked (zeros, at most 31 bytes) and
    cleared."""
    for name in FIELDS:
        if getattr(reply, name).WhichOneof("result") != "value":
            continue  # (clearing a field of an unset value would set it)
        value = getattr(reply, name).value
        assert value.padding == bytes(len(value.padding)) and len(value.padding) <= 31
        value.ClearField("padding")
    return reply


@pytest.mark.parametrize(("array", "name"), NUMERIC, ids=[i for _, i in NUMERIC])
def test_values_serialized_with_the_reply_read_as_protobuf_writes_them(array, name):
    """The appended fields merge into the outputs protobuf already wrote (the tape id);
    every content starts aligned in the message."""
    values = {"i": array, "h": array, "o": np.arange(3.0)}
    base = reply_with({})
    data = codec.serialize_with_values(
        base, [(NUMBER[k], v) for k, v in values.items()]
    ).SerializeToString()
    parsed = lstm_pb2.BlockLSTMResponse.FromString(data)
    for k in values:
        content = getattr(parsed, k).value.content
        if content:
            assert _offsets(data, content) & {
                o for o in range(0, len(data), codec.CONTENT_ALIGNMENT)
            }
    assert without_padding(parsed) == reply_with(values)


def _offsets(data: bytes, part: bytes) -> set[int]:
    """Where ``part`` occurs in ``data``."""
    found, start = set(), data.find(part)
    while start >= 0:
        found.add(start)
        start = data.find(part, start + 1)
    return found


def _random_reply(rng: random.Random) -> tuple[bytes, lstm_pb2.BlockLSTMResponse]:
    """A reply whose outputs are each absent, inline (any dtype, with or without a tape
    id), a ref or a shared-memory tensor, serialized by protobuf or, for numeric
    values, by ``serialize_with_values``."""
    reply = lstm_pb2.BlockLSTMResponse()
    appended = []
    for name in FIELDS:
        out = getattr(reply, name)
        kind = rng.choice(["absent", "value", "value", "ref", "shared"])
        if rng.random() < 0.3:
            out.tape_id = f"tape-{name}"
        if kind == "value":
            array = rng.choice(ARRAYS)
            if array.dtype != dtypes.STRING and rng.random() < 0.5:
                appended.append((NUMBER[name], array))
            else:
                codec.encode(array, out.value)
        elif kind == "ref":
            out.ref.id, out.ref.dtype, out.ref.shape[:] = "r", tensor_pb2.DT_FLOAT32, [2, 3]
        elif kind == "shared":
            out.shared.region, out.shared.offset = "region", 4096
    data = codec.serialize_with_values(reply, appended).SerializeToString()
    return data, lstm_pb2.BlockLSTMResponse.FromString(data)


def assert_same_reply(got, want: lstm_pb2.BlockLSTMResponse) -> None:
    """``got`` (what ``reply_parser`` made) reads as ``want`` (protobuf's parse) through
    every accessor the SDK uses."""
    assert [f.name for f, _ in got.ListFields()] == [f.name for f, _ in want.ListFields()]
    for name in FIELDS:
        mine, theirs = getattr(got, name), getattr(want, name)
        which = theirs.WhichOneof("result")
        assert mine.WhichOneof("result") == which
        assert mine.tape_id == theirs.tape_id
        a, b = _decoded(mine.value), _decoded(theirs.value)  # unset: the default's error
        if isinstance(b, type):  # or protobuf's merge of two values: invalid
            assert a is b
        else:
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype and same(a, b)
        if which == "value":
            assert (mine.value.dtype, tuple(mine.value.shape)) == (
                theirs.value.dtype,
                tuple(theirs.value.shape),
            )
        elif which is not None:
            assert getattr(mine, which) == getattr(theirs, which)


def _decoded(value) -> np.ndarray | type:
    """``codec.decode(value)``, or the class of what it raised."""
    try:
        return codec.decode(value)
    except Exception as e:  # noqa: BLE001 - compared by the caller
        return type(e)


@pytest.mark.parametrize("views_from", [0, codec.ONE_COPY_MIN_BYTES])
@pytest.mark.parametrize("seed", range(40))
def test_parsed_replies_read_as_protobuf_reads_them(seed, views_from, monkeypatch):
    """``views_from``: the smallest value the parser leaves in the reply's bytes."""
    monkeypatch.setattr(codec, "REPLY_VIEW_MIN_BYTES", 0)
    monkeypatch.setattr(codec, "ONE_COPY_MIN_BYTES", views_from)
    data, want = _random_reply(random.Random(seed))
    assert_same_reply(codec.reply_parser(lstm_pb2.BlockLSTMResponse)(data), want)


def test_inline_outputs_are_views_of_the_received_bytes():
    big = np.arange(1 << 16, dtype=np.float32)
    data = codec.serialize_with_values(reply_with({}), [(1, big), (7, big + 1)])
    data = data.SerializeToString()
    reply = codec.reply_parser(lstm_pb2.BlockLSTMResponse)(data)
    assert isinstance(reply, codec.Reply)
    for name, want in (("i", big), ("h", big + 1)):
        out = codec.decode(getattr(reply, name).value)
        assert np.array_equal(out, want) and not out.flags.writeable
        assert np.shares_memory(out, np.frombuffer(data, np.uint8))
    assert reply.h.tape_id == TAPE_ID and reply.cs.ref.id == "ref-id"
    assert reply.ByteSize() == len(data)  # as received, as the message's would be


@pytest.mark.parametrize("nbytes", [2_097_124, 2_097_129, (1 << 21) - 7])
def test_padding_past_a_length_boundary_still_aligns(nbytes):
    """Where the padding pushes a length past a varint boundary (2**21 here), the
    shortest padding that aligns is longer than 17 bytes; it is still found."""
    array = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    data = codec.serialize_tensor(array)
    assert (len(data) - nbytes) % codec.CONTENT_ALIGNMENT == 0  # the content comes last
    assert np.array_equal(codec.decode(tensor_pb2.Tensor.FromString(data)), array)
    data = codec.serialize_with_values(reply_with({}), [(5, array)]).SerializeToString()
    assert (len(data) - nbytes) % codec.CONTENT_ALIGNMENT == 0
    out = codec.decode(codec.reply_parser(lstm_pb2.BlockLSTMResponse)(data).ci.value)
    assert out.flags.aligned and np.array_equal(out, array)
    assert np.shares_memory(out, np.frombuffer(data, np.uint8))


def test_a_content_that_is_not_aligned_is_copied_aligned():
    """What another writer sent unaligned is copied once: NumPy's slow path otherwise."""
    data = b"\0" + np.arange(1000, dtype=np.float64).tobytes()
    view = memoryview(data)[1:]
    out = codec.decode(codec.WireTensor(tensor_pb2.DT_FLOAT64, (10, 100), view, len(view)))
    assert out.flags.aligned and not out.flags.writeable
    assert np.array_equal(out.reshape(-1), np.arange(1000.0))
    aligned = memoryview(np.arange(1000, dtype=np.float64).tobytes())
    kept = codec.decode(codec.WireTensor(tensor_pb2.DT_FLOAT64, (1000,), aligned, len(aligned)))
    assert np.shares_memory(kept, np.frombuffer(aligned.obj, np.uint8))  # no copy


def test_a_proxy_copies_and_prints(monkeypatch):
    monkeypatch.setattr(codec, "REPLY_VIEW_MIN_BYTES", 0)
    big = np.arange(1 << 14, dtype=np.float32)
    data = codec.serialize_with_values(reply_with({}), [(1, big)]).SerializeToString()
    reply = codec.reply_parser(lstm_pb2.BlockLSTMResponse)(data)
    assert "Reply(" in repr(reply) and "InlineOutput(" in repr(reply.i)
    copied = copy.copy(reply)
    assert np.array_equal(codec.decode(copied.i.value), big)


def test_small_replies_are_protobufs_own():
    data = reply_with({"i": np.arange(4.0)}).SerializeToString()
    assert len(data) < codec.REPLY_VIEW_MIN_BYTES
    reply = codec.reply_parser(lstm_pb2.BlockLSTMResponse)(data)
    assert isinstance(reply, lstm_pb2.BlockLSTMResponse)


def _unusual() -> list[bytes]:
    """Encodings a parser must take (or refuse) as protobuf does, values large enough
    for ``_split_values`` to take them."""
    value = codec.encode(np.arange(1 << 13, dtype=np.int32))  # 32 KiB
    output = tensor_pb2.TensorOutput(value=value).SerializeToString()
    ref = tensor_pb2.TensorOutput(ref=tensor_pb2.ResidentTensor(id="r")).SerializeToString()

    def field_1(body: bytes) -> bytes:  # BlockLSTMResponse.i
        return b"\x0a" + codec._varint_bytes(len(body)) + body

    small = tensor_pb2.TensorOutput(value=codec.encode(np.arange(4, dtype=np.int32)))
    small_output = small.SerializeToString()
    size = codec._varint_bytes(len(output))  # the same number in 6 bytes:
    over_long = bytes(b | 0x80 for b in size) + b"\x80" * (5 - len(size)) + b"\x00"
    return [
        field_1(output) + field_1(output),  # the same output's value twice: merged
        field_1(output * 2),  # two values in one output
        field_1(output) + field_1(small_output),  # a large and a small value: merged
        field_1(small_output) + field_1(output),
        field_1(output) + field_1(ref),  # a later ref clears the value
        field_1(output + ref),  # the same within one occurrence
        field_1(output) + b"\x40\x01",  # an unknown varint field (8)
        field_1(output) + b"\x0a\x02\x18\x01",  # a varint inside a TensorOutput
        field_1(output)[:-2],  # cut short
        field_1(output) + b"\x0b",  # a group start: protobuf refuses it
        b"\x0a" + over_long + output,  # a length in 6 bytes: protobuf refuses it
    ]


UNUSUAL = _unusual()


@pytest.mark.parametrize("data", UNUSUAL, ids=[f"unusual{n}" for n in range(len(UNUSUAL))])
def test_anything_unusual_is_left_to_protobuf(data, monkeypatch):
    """The same reply, or the same error, as protobuf's own parse."""
    monkeypatch.setattr(codec, "REPLY_VIEW_MIN_BYTES", 0)
    parse = codec.reply_parser(lstm_pb2.BlockLSTMResponse)
    try:
        want = lstm_pb2.BlockLSTMResponse.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            parse(data)
        return
    assert_same_reply(parse(data), want)


def test_replies_without_outputs_at_the_top_are_protobufs_own():
    assert codec.reply_parser(tensor_pb2.ResidentTensor) == tensor_pb2.ResidentTensor.FromString


# ------------------------------------------------------------------ over the real path
@pytest.mark.parametrize("taped", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_lstm_forward_over_tcp_comes_in_one_copy_each_way(target, monkeypatch, dtype, taped):
    """The server serializes the large outputs with the reply; the SDK's arrays are
    aligned read-only views of the one reply it received, equal to the kernel's
    outputs (under a tape too, where each output's tape id shifts the contents)."""
    from gradserve.kernels import backend_numpy, lstm
    from tests.benchmarks.bench_lstm import make_inputs

    appended = []
    serialize = codec.serialize_with_values

    def spy(message, values):
        appended.append([number for number, _ in values])
        return serialize(message, values)

    monkeypatch.setattr(codec, "serialize_with_values", spy)
    inputs, _, _ = make_inputs(6, 4, 256)  # each output 24 or 48 KiB
    inputs = [np.asarray(a, dtype) for a in inputs]
    want = lstm.block_lstm_forward(
        backend_numpy, lstm.LSTMInputs(*inputs), seq_len_max=6, use_peephole=True
    )
    with gradserve.Client(target, shared_memory=False) as c:
        with c.gradient_tape() if taped else contextlib.nullcontext():
            got = c.raw_ops.BlockLSTMV2(np.int64(6), *inputs, use_peephole=True)
    assert appended == [list(range(1, 8))]
    owners = set()
    for mine, theirs in zip(got, want, strict=True):
        np.testing.assert_array_equal(mine, theirs)
        assert mine.flags.aligned and not mine.flags.writeable
        assert bool(getattr(mine, "tape_id", None)) == taped
        owners.add(id(memory_owner(mine)))  # the reply's bytes
    assert len(owners) == 1 and isinstance(memory_owner(got[0]), bytes)


def test_small_and_large_outputs_of_one_reply_and_tape_ids(target):
    """TensorArrayConcatV3: a large value serialized by hand beside small lengths set in
    the message; under a tape both carry their tape ids."""
    rows = [np.full((2, 4096), k, np.float32) for k in range(3)]
    with gradserve.Client(target, shared_memory=False) as c:
        ops = c.raw_ops
        ta = ops.TensorArrayV3(size=3, dtype=np.float32)
        flow = ta.flow
        for k, row in enumerate(rows):
            flow = ops.TensorArrayWriteV3(ta.handle, k, row, flow)
        with c.gradient_tape():
            value, lengths = ops.TensorArrayConcatV3(ta.handle, flow, np.float32)
        np.testing.assert_array_equal(value, np.concatenate(rows))
        np.testing.assert_array_equal(lengths, [2, 2, 2])
        assert value.tape_id and lengths.tape_id and value.tape_id != lengths.tape_id
        # The small output has bytes of its own: it does not keep the reply alive.
        assert (
            len(memory_owner(value)) > value.nbytes and len(memory_owner(lengths)) == lengths.nbytes
        )


def test_a_handler_that_returns_another_message_is_an_internal_slip(server):
    """The values belong to the message ``output`` wrote to: appended to another they
    would land in fields of another meaning, so the call fails instead."""
    from gradserve.server.transport.wire import CallIO

    session = server.store.create()
    try:
        io = CallIO(session, server.servicer.compute, inline_budget=1 << 24)
        io.inline_values = []
        big = np.arange(1 << 14, dtype=np.float32)

        def handler(io, request):
            io.output(big, lstm_pb2.BlockLSTMResponse(), "h", False)
            return lstm_pb2.BlockLSTMResponse()

        with pytest.raises(RuntimeError, match="another message"):
            io.run(handler, None)
        assert io.inline_values == []  # nothing left for a later op of the call

        def right(io, request):
            reply = lstm_pb2.BlockLSTMResponse()
            io.output(big, reply, "h", False)
            return reply

        data = io.run(right, None).SerializeToString()
        got = lstm_pb2.BlockLSTMResponse.FromString(data)
        assert np.array_equal(codec.decode(got.h.value), big)
    finally:
        server.store.close(session.id, session.principal)


@pytest.mark.parametrize("nbytes", [99_941, 99_942, 99_958, 99_999, 100_000])
def test_a_get_at_the_edge_of_the_inline_budget_comes_back(target, nbytes):
    """The SDK budgets a unary get as the server does (``encoded_size``), and a server
    that budgets it larger still says USE_GET_TENSOR: then it streams it."""
    value = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    budget = 100_000  # the client's inline budget: its limit less the message overhead
    max_bytes = budget + gradserve.protocol.MESSAGE_OVERHEAD_BYTES
    with gradserve.Client(target, shared_memory=False, max_message_bytes=max_bytes) as c:
        ref = c.put(value)
        assert np.array_equal(c.get(ref), value)


def test_a_get_the_server_budgets_larger_is_streamed(target, monkeypatch):
    """A client whose budget of a tensor is smaller than the server's (another version's
    ``encoded_size``) is refused USE_GET_TENSOR, and streams the tensor instead."""
    import types

    from gradserve.client import _client

    shim = types.SimpleNamespace(**vars(gradserve.protocol))
    shim.encoded_size = lambda nbytes, ndim: nbytes  # no room for tags: too small
    monkeypatch.setattr(_client, "protocol", shim)
    value = np.arange(99_999, dtype=np.uint64).astype(np.uint8)
    max_bytes = 100_000 + gradserve.protocol.MESSAGE_OVERHEAD_BYTES
    with gradserve.Client(target, shared_memory=False, max_message_bytes=max_bytes) as c:
        assert np.array_equal(c.get(c.put(value)), value)


@pytest.mark.parametrize("number", [1, 300])
def test_the_padding_is_the_shortest_that_aligns(number):
    """Against every padding tried in turn, around the lengths where a varint grows
    (the one that holds the output and the one that holds its value both may)."""

    def wrap(size: int) -> list[bytes]:
        value = codec.length_delimited(1, size)
        return [codec.length_delimited(number, len(value) + size), value]

    for size in [*range(90, 130), *range(16_330, 16_390)]:
        content = codec.WireContent(np.zeros(size, np.uint8))
        head = len(tensor_pb2.Tensor(dtype=content.dtype, shape=content.shape).SerializeToString())
        for offset in range(0, 32, 3):
            parts = codec._tensor_parts(content, offset, wrap)
            chosen = parts[-3]
            shortest = next(
                p
                for p in codec._PADDINGS
                if (
                    offset
                    + sum(map(len, wrap(head + len(p) + len(parts[-2]) + size)))
                    + head
                    + len(p)
                    + len(parts[-2])
                )
                % codec.CONTENT_ALIGNMENT
                == 0
            )
            assert chosen == shortest, (size, offset)


def test_large_batch_and_gradients_replies_reach_grpc_serialized(monkeypatch):
    """gRPC serializes a handler's reply on the event loop, where every call of the
    server waits: a session pulling 128 MiB Batch or Gradients replies held another's
    KeepAlive 0.7-0.9 s a call (helper-77). A large reply reaches gRPC's serializer
    as bytes made on another thread (``codec.Serialized``); the values are those the
    protobuf message would carry."""
    from gradserve.server import run_server

    seen: list[tuple[str, object]] = []
    serialize = codec.serialize

    def recording(message):
        data = serialize(message)
        if len(data) >= 256 * 1024:
            seen.append((type(message).__name__, message))
        return data

    monkeypatch.setattr(codec, "serialize", recording)
    value = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    with run_server(device="cpu") as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            handle = client.tensor_array(np.float32, size=3).handle
            batch = client.batch()
            batch.raw_ops.StopGradient(value)
            batch.raw_ops.TensorArraySizeV3(handle, 0.0)
            batch.raw_ops.StopGradient(value[::-1])
            batch.raw_ops.TensorArrayReadV3(handle, 0, 0.0, np.float32)  # unwritten: fails
            with pytest.raises(gradserve.errors.InvalidArgumentError) as failed:
                batch.run()
            got = failed.value.results
            assert same(got[0], value) and got[1] == 3 and same(got[2], value[::-1])
            assert failed.value.step == 3
            x = client.put(value)
            with client.gradient_tape() as tape:
                h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
                flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
                y = client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32)
            assert same(tape.gradient(y, x), np.ones_like(value))
    kinds = [name for name, _ in seen]  # (bytes: a stream's chunks, serialized as made)
    assert {"BatchResponse", "GradientsResponse"} & {type(m).__name__ for _, m in seen} == set()
    assert kinds.count("Serialized") >= 3 and set(kinds) <= {"Serialized", "bytes"}, kinds


@pytest.mark.parametrize("cap", ["default", "none"])
def test_a_reply_carries_no_more_inline_than_the_servers_inline_reply_bytes(cap):
    """``--max-inline-reply-bytes`` (16 MiB by default) bounds the tensors a reply
    carries inline, whatever the client's budget: the outputs beyond are transient
    (the SDK streams them), and a get beyond it is USE_GET_TENSOR. A reply's bytes
    are copied holding Python's lock, and a client pulling 128 MiB replies held every
    other call of the server (p90 150-380 ms; ``make bench``, hostile section 8).
    ``none``: the message limit alone, as before."""
    import grpc

    from gradserve.server import run_server
    from gradserve.v1 import service_pb2, service_pb2_grpc, tensor_array_pb2

    value = np.arange(5 << 20, dtype=np.float32)  # 20 MiB
    flags = {} if cap == "default" else {"max_inline_reply_bytes": None}
    with run_server(device="cpu", **flags) as server:
        target = f"127.0.0.1:{server.port}"
        # The SDK, asking for outputs up to 64 MiB inline, gets the value either way.
        with gradserve.Client(target, shared_memory=False, stream_threshold=64 << 20) as c:
            ref = c.put(value)
            assert same(c.raw_ops.StopGradient(ref), value)
            assert same(c.get(ref), value)
            limits = gradserve.protocol.channel_options()
            # A client of its own, asking for everything inline.
            metadata = (
                (gradserve.protocol.SESSION_METADATA_KEY, c.session_id),
                (gradserve.protocol.RESPONSE_BUDGET_METADATA_KEY, str(200 << 20)),
                (gradserve.protocol.INLINE_LIMIT_METADATA_KEY, str(200 << 20)),
            )
            with grpc.insecure_channel(target, options=limits) as channel:
                stub = service_pb2_grpc.GradServeStub(channel)
                request = tensor_array_pb2.StopGradientRequest(
                    input=tensor_pb2.TensorInput(ref=ref.id)
                )
                out = stub.StopGradient(request, metadata=metadata).output
                get = service_pb2.GetTensorRequest(id=ref.id)
                if cap == "none":
                    assert same(codec.decode(out.value), value)
                    assert same(codec.decode(stub.GetTensorInline(get, metadata=metadata)), value)
                    return
                assert out.WhichOneof("result") == "ref" and out.ref.transient
                fetched = b"".join(
                    chunk.data
                    for chunk in stub.GetTensor(
                        service_pb2.GetTensorRequest(id=out.ref.id), metadata=metadata
                    )
                )
                assert fetched == value.tobytes()
                with pytest.raises(grpc.RpcError) as refused:
                    stub.GetTensorInline(get, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "USE_GET_TENSOR" in str(refused.value.trailing_metadata())


def test_the_inline_cap_counts_tensors_only_and_never_splits_a_batch_of_refs(monkeypatch):
    """``--max-inline-reply-bytes`` limits the tensors inline, not the refs and ids of a
    reply: it lowered the whole response's budget, so a Batch of kept outputs was
    RESPONSE_FULL after each step below 4 KiB (a review helper: a cap of 0 ran 3,000
    steps as 3,000 calls, 35 s). Under a cap of 0 every output comes by reference, and
    the batch is one call."""
    from gradserve.server import run_server

    with run_server(device="cpu", max_inline_reply_bytes=0) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            calls = []
            call = client._call
            monkeypatch.setattr(
                client, "_call", lambda rpc, *a, **k: calls.append(rpc) or call(rpc, *a, **k)
            )
            batch = client.batch()
            for n in range(300):
                batch.raw_ops.StopGradient(np.full(2, n, np.float32), keep=True)
            batch.raw_ops.StopGradient(np.arange(3, dtype=np.float32))  # by reference too
            results = batch.run()
            assert calls.count("Batch") == 1
            assert all(isinstance(r, gradserve.client.TensorRef) for r in results[:300])
            assert same(results[300], np.arange(3, dtype=np.float32))
            assert same(results[299].numpy(), np.full(2, 299, np.float32))


def test_a_get_past_the_servers_inline_cap_streams_without_asking_inline(monkeypatch):
    """KeepAlive names the server's ``--max-inline-reply-bytes``: an SDK whose own
    inline limit is larger streams a get past the cap at once, instead of a
    GetTensorInline refused USE_GET_TENSOR first (a review helper)."""
    from gradserve.server import run_server

    value = np.arange(3 << 20, dtype=np.float32)  # 12 MiB
    with run_server(device="cpu", max_inline_reply_bytes=8 << 20) as server:
        with gradserve.Client(
            f"127.0.0.1:{server.port}", shared_memory=False, stream_threshold=64 << 20
        ) as client:
            ref = client.put(value)
            calls = []
            call = client._call
            monkeypatch.setattr(
                client, "_call", lambda rpc, *a, **k: calls.append(rpc) or call(rpc, *a, **k)
            )
            assert same(client.get(ref), value)
            assert "GetTensorInline" not in calls
            small = client.put(value[:1000])
            assert same(client.get(small), value[:1000])
            assert calls.count("GetTensorInline") == 1  # under the cap: inline


def test_no_inline_limit_a_client_names_lifts_the_servers_cap():
    """The cap held unless the client's ``x-gradserve-inline-limit`` equalled the
    value standing for a failed output region (2**62): then the cap was lifted."""
    import grpc

    from gradserve.server import run_server
    from gradserve.v1 import service_pb2_grpc, tensor_array_pb2

    value = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    with run_server(device="cpu", max_inline_reply_bytes=1 << 20) as server:
        target = f"127.0.0.1:{server.port}"
        with gradserve.Client(target, shared_memory=False) as c:
            ref = c.put(value)
            with grpc.insecure_channel(target) as channel:
                stub = service_pb2_grpc.GradServeStub(channel)
                for limit in (str(1 << 62), str(1 << 30)):
                    metadata = (
                        (gradserve.protocol.SESSION_METADATA_KEY, c.session_id),
                        (gradserve.protocol.INLINE_LIMIT_METADATA_KEY, limit),
                    )
                    request = tensor_array_pb2.StopGradientRequest(
                        input=tensor_pb2.TensorInput(ref=ref.id)
                    )
                    out = stub.StopGradient(request, metadata=metadata).output
                    assert out.WhichOneof("result") == "ref" and out.ref.transient, limit
                    c.delete(out.ref.id)


@pytest.mark.parametrize("cap", [-1, 1 << 63])
def test_an_inline_cap_out_of_range_is_refused_at_start(cap):
    """KeepAlive says the cap as an int64: a cap of 2**63 started, and every KeepAlive
    then failed INTERNAL, so no SDK client could connect (a review helper)."""
    from gradserve.server import run_server
    from gradserve.server.transport.app import ConfigError

    with pytest.raises(ConfigError, match="max-inline-reply-bytes"):
        with run_server(device="cpu", max_inline_reply_bytes=cap):
            pass


def test_a_malformed_response_budget_is_refused_by_every_rpc_alike():
    """GetTensorInline read ``x-gradserve-response-budget`` only when it was digits and
    otherwise ignored it, where an op's call refused it: INVALID_ARGUMENT in both now,
    and a negative budget leaves room for nothing inline in both."""
    import grpc

    from gradserve.server import run_server
    from gradserve.v1 import service_pb2, service_pb2_grpc, tensor_array_pb2

    value = np.arange(1000, dtype=np.float32)
    with run_server(device="cpu") as server:
        target = f"127.0.0.1:{server.port}"
        with gradserve.Client(target, shared_memory=False) as c:
            ref = c.put(value)
            with grpc.insecure_channel(target) as channel:
                stub = service_pb2_grpc.GradServeStub(channel)
                get = service_pb2.GetTensorRequest(id=ref.id)
                op = tensor_array_pb2.StopGradientRequest(input=tensor_pb2.TensorInput(ref=ref.id))
                for budget, code in (
                    ("lots", grpc.StatusCode.INVALID_ARGUMENT),
                    ("1e9", grpc.StatusCode.INVALID_ARGUMENT),
                    ("-5", None),  # room for nothing inline
                ):
                    metadata = (
                        (gradserve.protocol.SESSION_METADATA_KEY, c.session_id),
                        (gradserve.protocol.RESPONSE_BUDGET_METADATA_KEY, budget),
                    )
                    if code is None:
                        out = stub.StopGradient(op, metadata=metadata).output
                        assert out.WhichOneof("result") == "ref", budget
                        c.delete(out.ref.id)
                        code = grpc.StatusCode.RESOURCE_EXHAUSTED  # USE_GET_TENSOR
                    else:
                        with pytest.raises(grpc.RpcError) as refused:
                            stub.StopGradient(op, metadata=metadata)
                        assert refused.value.code() == code, budget
                    with pytest.raises(grpc.RpcError) as refused:
                        stub.GetTensorInline(get, metadata=metadata)
                    assert refused.value.code() == code, budget
            assert same(c.get(ref), value)  # nothing else changed
