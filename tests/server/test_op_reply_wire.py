"""Op replies in one copy each way (issue 17): the server appends large inline outputs
to the serialized reply by hand (``codec.serialize_with_values``), the SDK leaves
them in the received bytes (``codec.reply_parser``). Both must mean exactly what
protobuf writes and reads, for every dtype and every kind of output around them."""

from __future__ import annotations

import random

import numpy as np
import pytest
from google.protobuf.message import DecodeError

import gradserve
from gradserve import codec, dtypes
from gradserve.v1 import lstm_pb2, tensor_pb2
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


@pytest.mark.parametrize(("array", "name"), NUMERIC, ids=[i for _, i in NUMERIC])
def test_values_serialized_with_the_reply_read_as_protobuf_writes_them(array, name):
    """The appended fields merge into the outputs protobuf already wrote (the tape id)."""
    values = {"i": array, "h": array, "o": np.arange(3.0)}
    base = reply_with({})
    data = codec.serialize_with_values(
        base, [(NUMBER[k], v) for k, v in values.items()]
    ).SerializeToString()
    assert lstm_pb2.BlockLSTMResponse.FromString(data) == reply_with(values)


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
        if which == "value":
            a, b = _decoded(mine.value), _decoded(theirs.value)
            if isinstance(b, type):  # protobuf's merge of two values: invalid
                assert a is b
            else:
                assert isinstance(a, np.ndarray) and a.dtype == b.dtype and same(a, b)
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


@pytest.mark.parametrize("seed", range(60))
def test_parsed_replies_read_as_protobuf_reads_them(seed, monkeypatch):
    monkeypatch.setattr(codec, "REPLY_VIEW_MIN_BYTES", 0)
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


def test_small_replies_are_protobufs_own():
    data = reply_with({"i": np.arange(4.0)}).SerializeToString()
    assert len(data) < codec.REPLY_VIEW_MIN_BYTES
    reply = codec.reply_parser(lstm_pb2.BlockLSTMResponse)(data)
    assert isinstance(reply, lstm_pb2.BlockLSTMResponse)


def _unusual() -> list[bytes]:
    """Encodings a parser must take but ``_split_values`` leaves to protobuf."""
    value = codec.encode(np.arange(4, dtype=np.int32))
    output = tensor_pb2.TensorOutput(value=value).SerializeToString()
    twice_in_one = tensor_pb2.TensorOutput(value=value).SerializeToString() * 2
    field_1 = b"\x0a" + bytes([len(output)])  # BlockLSTMResponse.i, one-byte length
    return [
        field_1 + output + field_1 + output,  # the same output's value twice: merged
        b"\x0a" + bytes([len(twice_in_one)]) + twice_in_one,  # two values in one output
        field_1 + output + b"\x40\x01",  # an unknown varint field (8)
        field_1 + output + b"\x0a\x02\x18\x01",  # a varint inside a TensorOutput
        field_1 + output[:-2],  # cut short
        field_1 + output + b"\x0b",  # a group start: protobuf refuses it
    ]


@pytest.mark.parametrize("data", _unusual())
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
def test_an_lstm_forward_over_tcp_comes_in_one_copy_each_way(target, monkeypatch):
    """The server serializes the large outputs with the reply; the SDK's arrays are
    views of the one reply it received, equal to the kernel's outputs."""
    from gradserve.kernels import backend_numpy, lstm
    from tests.benchmarks.bench_lstm import make_inputs

    appended = []
    serialize = codec.serialize_with_values

    def spy(message, values):
        appended.append([number for number, _ in values])
        return serialize(message, values)

    monkeypatch.setattr(codec, "serialize_with_values", spy)
    inputs, _, _ = make_inputs(6, 4, 256)  # each output 24 KiB
    want = lstm.block_lstm_forward(
        backend_numpy, lstm.LSTMInputs(*inputs), seq_len_max=6, use_peephole=True
    )
    with gradserve.Client(target, shared_memory=False) as c:
        got = c.raw_ops.BlockLSTMV2(np.int64(6), *inputs, use_peephole=True)
    assert appended == [list(range(1, 8))]
    bases = set()
    for mine, theirs in zip(got, want, strict=True):
        np.testing.assert_array_equal(mine, theirs)
        assert not mine.flags.writeable
        owner = mine.base
        while isinstance(owner, np.ndarray):
            owner = owner.base
        assert isinstance(owner, memoryview) and isinstance(owner.obj, bytes)
        bases.add(id(owner.obj))  # the reply's bytes
    assert len(bases) == 1


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
