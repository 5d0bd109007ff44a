"""Hostile and broken input: each gets the right status, and the server keeps serving."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

import gradserve
from gradserve import protocol
from gradserve.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnimplementedError,
)
from gradserve.server.transport import boundary
from gradserve.v1 import service_pb2, tensor_array_pb2, tensor_pb2


@pytest.fixture
def stub_call(client, target):
    """Call an RPC with a hand-built request (bypassing the SDK's own checks)."""
    channel = grpc.insecure_channel(target)
    md = ((protocol.SESSION_METADATA_KEY, client.session_id),)

    def call(rpc: str, request, response_cls):
        method = channel.unary_unary(
            f"/gradserve.v1.GradServe/{rpc}",
            request_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        return method(request, metadata=md, timeout=10)

    yield call
    channel.close()


def assert_code(fn, code: grpc.StatusCode):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    return info.value.details()


@pytest.fixture(autouse=True)
def server_still_answers(client):
    yield
    np.testing.assert_array_equal(client.stop_gradient(np.arange(3)), np.arange(3))


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff", b"\x0a\x05abc", b"\x08" + b"\xff" * 11])
def test_malformed_proto_bytes(stub_call, garbage, caplog):
    # A client's mistake: INVALID_ARGUMENT naming the message, no traceback logged
    # (gRPC's own deserializer answered INTERNAL with a traceback per request).
    for rpc in ("TensorArrayWriteV3", "StopGradient", "Batch"):
        details = assert_code(
            lambda rpc=rpc: stub_call(rpc, garbage, service_pb2.BatchResponse),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert "does not parse as gradserve.v1." in details
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_unknown_dtype_enum(stub_call):
    request = tensor_array_pb2.StopGradientRequest()
    request.input.value.dtype = 77
    request.input.value.shape[:] = [1]
    request.input.value.content = b"\0"
    details = assert_code(
        lambda: stub_call("StopGradient", request, tensor_array_pb2.StopGradientResponse),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "unknown or unset dtype enum value 77" in details


def test_content_does_not_match_shape(stub_call):
    request = tensor_array_pb2.StopGradientRequest()
    request.input.value.CopyFrom(
        tensor_pb2.Tensor(dtype=tensor_pb2.DT_FLOAT32, shape=[2**62, 4], content=b"")
    )
    assert_code(
        lambda: stub_call("StopGradient", request, tensor_array_pb2.StopGradientResponse),
        grpc.StatusCode.INVALID_ARGUMENT,
    )


def test_missing_input_and_handle(stub_call):
    assert_code(
        lambda: stub_call(
            "StopGradient",
            tensor_array_pb2.StopGradientRequest(),
            tensor_array_pb2.StopGradientResponse,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert_code(
        lambda: stub_call(
            "TensorArraySizeV3",
            tensor_array_pb2.TensorArraySizeV3Request(),
            tensor_array_pb2.TensorArraySizeV3Response,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )


def test_empty_batch_step(stub_call):
    request = service_pb2.BatchRequest()
    request.steps.add()
    reply = stub_call("Batch", request, service_pb2.BatchResponse)
    assert reply.failed_step == 0 and reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.mark.parametrize("size", [-1, -(2**31)])
def test_negative_size(client, size):
    with pytest.raises(InvalidArgumentError, match="Size should be >= 0"):
        client.raw_ops.TensorArrayV3(size=size, dtype=np.float32)


def test_huge_size_is_cheap_but_huge_reads_are_refused(server, client):
    limit = server.config.max_tensor_array_size
    with pytest.raises(ResourceExhaustedError, match="--max-tensor-array-size") as info:
        client.raw_ops.TensorArrayV3(size=2**31 - 1, dtype=np.float32)
    assert info.value.reason == "TENSOR_ARRAY_TOO_LARGE"
    h, flow = client.raw_ops.TensorArrayV3(size=limit, dtype=np.float32, element_shape=[1024, 1024])
    assert client.raw_ops.TensorArraySizeV3(h, flow) == limit
    with pytest.raises(ResourceExhaustedError, match="max tensor size"):
        client.raw_ops.TensorArrayConcatV3(h, flow, np.float32)


@pytest.mark.parametrize("size", [np.int64(2**40), 2**40], ids=repr)
def test_size_over_int32(client, size):
    """TensorFlow wraps it (to 0): refused."""
    with pytest.raises(InvalidArgumentError, match="does not fit in int32"):
        client.raw_ops.TensorArrayV3(size=size, dtype=np.float32)


@pytest.mark.parametrize("size", [2**63, -(2**63) - 1, 2**70, [2**70]], ids=repr)
def test_a_python_int_past_int64_is_tensorflows_value_error(client, size):
    """As TensorFlow 2.21 refuses it (a review helper: 2**63 was an
    InvalidArgumentError that no ValueError handler caught; past it a TypeError once)."""
    with pytest.raises(ValueError, match="^Can't convert Python sequence with out-of-range"):
        client.raw_ops.TensorArrayV3(size=size, dtype=np.float32)


def test_non_scalar_index_and_float_index(client):
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="index must be scalar, but had shape: \\[2\\]"):
        client.raw_ops.TensorArrayWriteV3(
            h, np.array([0, 1], np.int32), np.ones(1, np.float32), flow
        )
    with pytest.raises(InvalidArgumentError, match="must be an integer tensor"):
        client.raw_ops.TensorArrayReadV3(
            gradserve.TensorArrayHandle(h.id, h.name), client.put(np.float32(0)), flow, np.float32
        )


def test_unknown_handle_and_tensor_id(client):
    fake = gradserve.TensorArrayHandle("no-such-handle", "ta_0")
    with pytest.raises(NotFoundError):
        client.raw_ops.TensorArraySizeV3(fake, 0.0)
    with pytest.raises(NotFoundError):
        client.get("no-such-tensor")


def test_grad_of_grad_is_refused(client):
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    g, gflow = client.raw_ops.TensorArrayGradV3(h, flow, "gradients")
    with pytest.raises(InvalidArgumentError, match="Wrong input container"):
        client.raw_ops.TensorArrayGradV3(g, gflow, "gradients")


def test_empty_gather_with_unknown_shape_is_unimplemented(client):
    h, flow = client.raw_ops.TensorArrayV3(size=0, dtype=np.float32)
    with pytest.raises(UnimplementedError):
        client.raw_ops.TensorArrayGatherV3(h, np.zeros(0, np.int32), flow, np.float32)


def test_split_with_negative_lengths(client):
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        client.raw_ops.TensorArraySplitV3(h, np.ones((2, 1), np.float32), [3, -1], flow)


def test_input_over_the_channel_limit_is_uploaded_not_refused(target):
    # Before the request budget, a 4 MiB input on a 1 MiB channel failed with
    # RESOURCE_EXHAUSTED; now the SDK streams it and passes it by reference.
    value = np.arange(1 << 19, dtype=np.float64)  # 4 MiB
    small = gradserve.Client(target, max_message_bytes=1 << 20, stream_threshold=1 << 30)
    with small:
        np.testing.assert_array_equal(small.stop_gradient(value), value)


def test_put_stream_with_wrong_length(client, target):
    chunks = [tensor_pb2.TensorChunk(dtype=tensor_pb2.DT_FLOAT32, shape=[4], data=b"\0" * 8)]
    with grpc.insecure_channel(target) as channel:
        put = channel.stream_unary(
            "/gradserve.v1.GradServe/PutTensor",
            request_serializer=tensor_pb2.TensorChunk.SerializeToString,
            response_deserializer=tensor_pb2.ResidentTensor.FromString,
        )
        md = ((protocol.SESSION_METADATA_KEY, client.session_id),)
        assert_code(lambda: put(iter(chunks), metadata=md), grpc.StatusCode.INVALID_ARGUMENT)
        too_much = [chunks[0], tensor_pb2.TensorChunk(data=b"\0" * 16)]
        assert_code(lambda: put(iter(too_much), metadata=md), grpc.StatusCode.INVALID_ARGUMENT)
        empty = []
        assert_code(lambda: put(iter(empty), metadata=md), grpc.StatusCode.INVALID_ARGUMENT)


def _packed_dims(count: int) -> bytes:
    """A ``Tensor``'s shape field (2) of ``count`` dims of 1, packed."""
    run = b"\x01" * count
    return b"\x12" + _varint(len(run)) + run


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


_TOO_MANY = protocol.MAX_REQUEST_FIELDS + 1


@pytest.mark.parametrize(
    ("rpc", "request_bytes"),
    [
        ("DeleteTensor", b"\x0a\x01x" * _TOO_MANY),  # one-letter ids
        ("Batch", b"\x0a\x00" * _TOO_MANY),  # empty steps
        ("Gradients", b"\x12\x00" * _TOO_MANY),  # empty targets
        ("PutTensorInline", b"\x08\x01" + _packed_dims(_TOO_MANY)),  # a packed shape
        ("PutTensorInline", b"\x08\x01" + b"\x10\x01" * _TOO_MANY),  # dims one field each
        # A step's op's input's inline tensor's dims: counted at every depth.
        (
            "Batch",
            service_pb2.BatchRequest(
                steps=[
                    service_pb2.BatchStep(
                        stop_gradient=tensor_array_pb2.StopGradientRequest(
                            input=tensor_pb2.TensorInput(
                                value=tensor_pb2.Tensor(dtype=1, shape=[1] * _TOO_MANY)
                            )
                        )
                    )
                ]
            ),
        ),
    ],
    ids=["ids", "steps", "targets", "packed-dims", "unpacked-dims", "nested"],
)
def test_a_request_of_too_many_fields_is_refused_before_it_is_parsed(stub_call, rpc, request_bytes):
    # Parsing turns each field into an object of tens of bytes, with the event loop
    # and Python's lock held: 256 MiB of empty Batch steps would take ~6 GB and
    # seconds. Such a request is refused unparsed, and the server serves on.
    details = assert_code(
        lambda: stub_call(rpc, request_bytes, service_pb2.BatchResponse),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    assert f"more than {protocol.MAX_REQUEST_FIELDS} fields" in details


def test_a_request_at_the_field_limit_is_served(stub_call):
    request = service_pb2.DeleteTensorRequest(ids=["x"] * protocol.MAX_REQUEST_FIELDS)
    assert stub_call("DeleteTensor", request, service_pb2.DeleteTensorResponse).deleted == 0


def test_a_group_does_not_hide_the_fields_behind_it(stub_call):
    # protobuf reads an unknown group and then everything after it: a count that
    # stopped at the group let 20 million ids be parsed unseen (a review helper).
    request = b"\x7b\x7c" + b"\x0a\x01x" * _TOO_MANY
    details = assert_code(
        lambda: stub_call("DeleteTensor", request, service_pb2.DeleteTensorResponse),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "wire type 3" in details


def test_a_request_of_many_fields_is_parsed_off_the_event_loop(stub_call, monkeypatch):
    # Counting a request's fields costs a turn of Python each (~27 ms for a Batch of
    # 4,300 writes): past LOOP_FIELDS it is counted and parsed once the call is
    # admitted, on the light lane, not on the loop every call waits on.
    threads: list[str] = []
    parse = boundary.Deferred.parse
    monkeypatch.setattr(
        boundary.Deferred,
        "parse",
        lambda self: threads.append(threading.current_thread().name) or parse(self),
    )
    few = service_pb2.DeleteTensorRequest(ids=["x"] * (boundary.LOOP_FIELDS // 2))
    many = service_pb2.DeleteTensorRequest(ids=["x"] * (boundary.LOOP_FIELDS + 1))
    assert stub_call("DeleteTensor", few, service_pb2.DeleteTensorResponse).deleted == 0
    assert threads == []
    assert stub_call("DeleteTensor", many, service_pb2.DeleteTensorResponse).deleted == 0
    assert len(threads) == 1 and threads[0].startswith("gradserve-light")


def _closed(client, **kwargs):
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32, **kwargs)
    client.raw_ops.TensorArrayCloseV3(h)
    return h, flow


#: Calls wrong in two ways, and the error TensorFlow 2.21's kernels give for each
#: (``tf.raw_ops`` in eager mode, recorded): its checks' order, found by a review
#: helper's differential fuzz (each was the other error here).
CHECK_ORDER = {
    "scatter on a closed array, indices a matrix": (
        lambda c, h, f: c.raw_ops.TensorArrayScatterV3(
            h, np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), f
        ),
        "has already been closed.",
    ),
    "split on a closed array, a negative length": (
        lambda c, h, f: c.raw_ops.TensorArraySplitV3(
            h, np.ones((2, 1), np.float32), np.array([3, -1], np.int64), f
        ),
        "has already been closed.",
    ),
    "gradient with shape of a closed array, a negative dimension": (
        lambda c, h, f: c.raw_ops.TensorArrayGradWithShape(h, f, np.array([-1], np.int32), "g"),
        "has already been closed.",
    ),
}


@pytest.mark.parametrize("case", sorted(CHECK_ORDER))
def test_checks_come_in_tensorflows_order(client, case):
    call, message = CHECK_ORDER[case]
    h, flow = _closed(client)
    with pytest.raises(InvalidArgumentError, match=message):
        call(client, h, flow)


def test_a_gather_merges_its_element_shape_before_it_looks_at_the_indices(client):
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32, element_shape=[3])
    with pytest.raises(
        InvalidArgumentError, match=r"Incompatible shapes during merge: \[3\] vs. \[2\]"
    ):
        client.raw_ops.TensorArrayGatherV3(h, np.int32(0), flow, np.float32, element_shape=[2])


def test_a_gradient_of_a_gradient_array_is_tensorflows_error_word_for_word(client):
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    g, gflow = client.raw_ops.TensorArrayGradV3(h, flow, "s")
    for call in (
        lambda: client.raw_ops.TensorArrayGradV3(g, gflow, "s"),
        lambda: client.raw_ops.TensorArrayGradWithShape(g, gflow, np.int32(3), "s"),
        lambda: client.raw_ops.TensorArrayGradWithShape(g, gflow, np.array([-1], np.int32), "s"),
    ):
        with pytest.raises(InvalidArgumentError) as raised:
            call()
        assert str(raised.value) == f"Wrong input container. _tensor_array_grads{g.name}"


def test_a_gather_refused_for_its_indices_leaves_the_element_shape_as_it_was(client):
    """TensorFlow merges a gather's element_shape before it refuses its indices, and
    keeps it; gradserve checks it there (TensorFlow's error first) but applies nothing
    of a refused op (README, "Semantics")."""
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="Expected indices to be a vector"):
        client.raw_ops.TensorArrayGatherV3(h, np.int32(0), flow, np.float32, element_shape=[2])
    client.raw_ops.TensorArrayWriteV3(h, 0, np.ones(3, np.float32), flow)  # [3] still taken
