"""Fuzz every RPC with hypothesis: random well-typed requests built from the proto
descriptors (wild dtypes, shapes that do not match content, negative and huge dims,
unknown enums, stray ids) and random bytes as raw messages.

Pass: the server never dies, every reply is a well-formed status, and no reply is
an unexpected-exception INTERNAL. ``GRADSERVE_FUZZ_EXAMPLES`` sets the number of
examples per test (default 150); the count of cases that ran is printed.
"""

from __future__ import annotations

import logging
import os

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradserve
from gradserve import protocol
from gradserve.server import run_server
from gradserve.v1 import service_pb2, tensor_pb2

EXAMPLES = int(os.environ.get("GRADSERVE_FUZZ_EXAMPLES", "150"))
SERVICE = service_pb2.DESCRIPTOR.services_by_name["GradServe"]
UNARY = [m for m in SERVICE.methods if not m.client_streaming and not m.server_streaming]
COUNT = {"cases": 0}

INTS = st.one_of(st.integers(-3, 40), st.sampled_from([-(2**31), 2**31 - 1, -1, 2**40]))
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", "gradients", "ta", "\x00"]))

F = FieldDescriptor


@st.composite
def tensors(draw):
    """Tensor messages: sometimes consistent, often not."""
    dtype = draw(st.one_of(st.integers(0, 16), st.just(tensor_pb2.DT_FLOAT32)))
    shape = draw(
        st.lists(st.one_of(st.integers(0, 4), st.sampled_from([-1, 2**40, 2**62])), max_size=4)
    )
    itemsize = {1: 1, 2: 1, 6: 1, 3: 2, 7: 2, 10: 2, 4: 4, 8: 4, 11: 4}.get(dtype, 8)
    count = int(np.prod([d for d in shape if 0 <= d <= 4] or [1]))
    exact = draw(st.booleans())
    size = count * itemsize if exact else draw(st.integers(0, 64))
    return tensor_pb2.Tensor(
        dtype=dtype, shape=shape, content=draw(st.binary(min_size=size, max_size=size))
    )


@st.composite
def messages(draw, descriptor, depth=0):
    msg_class = _class_of(descriptor)
    msg = msg_class()
    if descriptor.full_name == "gradserve.v1.Tensor":
        return draw(tensors())
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        repeated = field.is_repeated
        values = draw(st.lists(_values(field, depth), min_size=1, max_size=3 if repeated else 1))
        if repeated:
            if field.type == F.TYPE_MESSAGE:
                for v in values:
                    getattr(msg, field.name).add().CopyFrom(v)
            else:
                getattr(msg, field.name).extend(values)
        elif field.type == F.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(values[0])
        else:
            setattr(msg, field.name, values[0])
    return msg


def _values(field, depth):
    if field.type == F.TYPE_MESSAGE:
        if depth > 3:
            return st.just(_class_of(field.message_type)())
        return messages(field.message_type, depth + 1)
    if field.type == F.TYPE_ENUM:
        return st.integers(-5, 40)
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return FLOATS
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_STRING:
        return TEXT
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=32)
    if field.type in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
        return st.integers(0, 2**32 - 1)
    if field.type in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.integers(-(2**31), 2**31 - 1)
    return INTS


def _class_of(descriptor):
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


class Tracebacks(logging.Handler):
    """Counts log records that carry a traceback (an unexpected error)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


TRACEBACKS = Tracebacks()


@pytest.fixture(scope="module")
def fuzz_target():
    logging.getLogger().addHandler(TRACEBACKS)
    with run_server(
        device="cpu",
        max_tensor_bytes=64 << 20,
        max_message_bytes=8 << 20,
        max_tensor_array_size=1 << 16,
        max_session_bytes=256 << 20,
        max_sessions=None,
        max_sessions_per_principal=None,
    ) as server:
        target = f"127.0.0.1:{server.port}"
        with gradserve.Client(target) as client:
            channel = grpc.insecure_channel(target)
            yield server, client, channel
            channel.close()
    logging.getLogger().removeHandler(TRACEBACKS)
    print(f"\nfuzz: {COUNT['cases']} cases ran against every RPC")


def check_reply(call):
    COUNT["cases"] += 1
    try:
        call()
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        # Garbage is the client's mistake (INVALID_ARGUMENT), never the server's.
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), details


def metadata_for(server, valid: bool):
    """A fresh session per example (a fuzzed CloseSession may close it), or a bad id."""
    session = server.store.create().id if valid else "not-a-session"
    return ((protocol.SESSION_METADATA_KEY, session),)


SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SETTINGS
@given(data=st.data())
def test_random_typed_requests(fuzz_target, data):
    server, client, channel = fuzz_target
    method = data.draw(st.sampled_from(UNARY))
    request = data.draw(messages(method.input_type))
    valid = data.draw(st.integers(0, 9)) > 0
    call = channel.unary_unary(
        f"/{SERVICE.full_name}/{method.name}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=_class_of(method.output_type).FromString,
    )
    check_reply(lambda: call(request, metadata=metadata_for(server, valid), timeout=30))


@SETTINGS
@given(data=st.data())
def test_random_bytes_as_requests(fuzz_target, data):
    server, client, channel = fuzz_target
    method = data.draw(st.sampled_from(list(SERVICE.methods)))
    raw = data.draw(st.binary(max_size=64))
    path = f"/{SERVICE.full_name}/{method.name}"
    md = metadata_for(server, True)
    if method.client_streaming:
        call = channel.stream_unary(path)
        check_reply(lambda: call(iter([raw, raw]), metadata=md, timeout=30))
    elif method.server_streaming:
        call = channel.unary_stream(path)
        check_reply(lambda: list(call(raw, metadata=md, timeout=30)))
    else:
        call = channel.unary_unary(path)
        check_reply(lambda: call(raw, metadata=md, timeout=30))


@SETTINGS
@given(
    chunks=st.lists(messages(tensor_pb2.TensorChunk.DESCRIPTOR), max_size=4),
    get=messages(service_pb2.GetTensorRequest.DESCRIPTOR),
)
def test_random_streams(fuzz_target, chunks, get):
    server, client, channel = fuzz_target
    md = metadata_for(server, True)
    put = channel.stream_unary(
        f"/{SERVICE.full_name}/PutTensor",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=tensor_pb2.ResidentTensor.FromString,
    )
    check_reply(lambda: put(iter(chunks), metadata=md, timeout=30))
    fetch = channel.unary_stream(
        f"/{SERVICE.full_name}/GetTensor",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=tensor_pb2.TensorChunk.FromString,
    )
    check_reply(lambda: list(fetch(get, metadata=md, timeout=30)))


def test_server_survived_the_fuzzing(fuzz_target):
    server, client, _ = fuzz_target
    server.store.close_all()  # the fuzzed sessions (the client's too)
    client = gradserve.Client(f"127.0.0.1:{server.port}")
    np.testing.assert_array_equal(client.stop_gradient(np.arange(4)), np.arange(4))
    assert client.health() == "SERVING"
    assert not TRACEBACKS.records, [r.getMessage() for r in TRACEBACKS.records[:3]]
