"""Counting a message's fields from its bytes, without parsing it (the server's
refusal of requests that would parse into millions of objects)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradserve import codec, wire_fields
from gradserve.v1 import service_pb2, tape_pb2, tensor_array_pb2, tensor_pb2

BIG = 1 << 40


def _tensor(shape: list[int]) -> tensor_pb2.Tensor:
    return codec.encode(np.zeros(shape, np.float32))


def test_counts_as_the_wire_has_them():
    # dtype, the shape's key and each dim, content: what protobuf makes objects of.
    tensor = _tensor([2, 3, 4])
    assert wire_fields.count_fields(tensor.SerializeToString(), tensor.DESCRIPTOR, BIG) == 6
    ids = service_pb2.DeleteTensorRequest(ids=["a", "bb", ""])
    assert wire_fields.count_fields(ids.SerializeToString(), ids.DESCRIPTOR, BIG) == 3
    # The step, its op, the op's input, the input's value, and the value's six.
    batch = service_pb2.BatchRequest(
        steps=[
            service_pb2.BatchStep(
                stop_gradient=tensor_array_pb2.StopGradientRequest(
                    input=tensor_pb2.TensorInput(value=tensor)
                )
            )
        ]  # fmt: skip
    )
    assert wire_fields.count_fields(batch.SerializeToString(), batch.DESCRIPTOR, BIG) == 10


def test_a_tensors_content_is_one_field_whatever_its_size():
    tensor = _tensor([1024, 1024])
    assert wire_fields.count_fields(tensor.SerializeToString(), tensor.DESCRIPTOR, 10) == 5


def test_refuses_past_the_limit_and_not_at_it():
    request = service_pb2.DeleteTensorRequest(ids=["x"] * 100)
    data = request.SerializeToString()
    assert wire_fields.count_fields(data, request.DESCRIPTOR, 100) == 100
    with pytest.raises(wire_fields.TooManyFieldsError, match="more than 99 fields"):
        wire_fields.count_fields(data, request.DESCRIPTOR, 99)
    wire_fields.check_field_count(data, request.DESCRIPTOR, 100)
    with pytest.raises(wire_fields.TooManyFieldsError):
        wire_fields.check_field_count(data, request.DESCRIPTOR, 99)


@pytest.mark.parametrize(
    "data",
    [
        b"\xff",  # a key cut short
        b"\x0a\x05ab",  # a length past the end
        b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a length of 11 bytes
        b"\x08" + b"\xff" * 10 + b"\x01",  # a varint of 11 bytes
        b"\x8a\x80\x80\x80\x80\x00\x00",  # a key of 6 bytes (protobuf refuses it too)
        b"\x0a\x80\x80\x80\x80\x80\x00",  # a length of 6 bytes
        b"\x09\x00\x00",  # a fixed64 cut short
        b"\x00\x00",  # field number 0
        b"\x0e\x00",  # wire type 6
    ],
)
def test_malformed_data_is_refused(data):
    with pytest.raises(wire_fields.MalformedError):
        wire_fields.count_fields(data, service_pb2.BatchRequest.DESCRIPTOR, BIG)


def test_a_group_is_refused_not_skipped():
    # protobuf reads an unknown group (field 15 here, or a known field sent as one)
    # and then everything behind it: a count that stopped at the group let it parse
    # 20 million ids unseen (a review helper).
    ids = b"\x0a\x01x" * 100
    for group in (b"\x7b\x7c", b"\x0b\x0c"):
        with pytest.raises(wire_fields.MalformedError, match="wire type 3"):
            wire_fields.count_fields(group + ids, service_pb2.DeleteTensorRequest.DESCRIPTOR, 99)


def test_a_malformed_step_is_refused_wherever_it_is():
    # A later step's malformation once ended the whole walk before the earlier
    # steps, still on the walk's stack, were counted (a review helper).
    many = tape_pb2.GradientsRequest(targets=[tensor_pb2.TensorInput()] * 100)
    request = service_pb2.BatchRequest(steps=[service_pb2.BatchStep(gradients=many)])
    data = request.SerializeToString() + b"\x0a\x02\x09\x00"  # a step cut short inside
    with pytest.raises(wire_fields.MalformedError):
        wire_fields.count_fields(data, request.DESCRIPTOR, BIG)


def test_a_packed_run_past_the_limit_is_refused_without_counting_it():
    # 10 bytes a varint at most: a run longer than 10 per field left is over the
    # limit, rounding up (rounding down let 655,359 one-byte dims pass as 65,536).
    run = b"\x01" * (10 * 100 + 1)
    data = b"\x12" + bytes([len(run) & 0x7F | 0x80, len(run) >> 7]) + run
    with pytest.raises(wire_fields.TooManyFieldsError):
        wire_fields.count_fields(data, tensor_pb2.Tensor.DESCRIPTOR, 101)


_shapes = st.lists(st.integers(0, 3), max_size=4)
_inputs = st.one_of(
    _shapes.map(lambda shape: tensor_pb2.TensorInput(value=_tensor(shape))),
    st.text(max_size=5).map(lambda ref: tensor_pb2.TensorInput(ref=ref)),
    st.integers(0, 300).map(
        lambda step: tensor_pb2.TensorInput(step_output=tensor_pb2.StepOutput(step=step, field="h"))
    ),
)
_steps = st.one_of(
    _inputs.map(
        lambda x: service_pb2.BatchStep(stop_gradient=tensor_array_pb2.StopGradientRequest(input=x))
    ),  # fmt: skip
    st.tuples(st.lists(_inputs, max_size=3), st.lists(_inputs, max_size=3)).map(
        lambda ts: service_pb2.BatchStep(
            gradients=tape_pb2.GradientsRequest(tape_id="t", targets=ts[0], sources=ts[1])
        )
    ),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_steps, max_size=6))
def test_the_bytes_and_the_message_object_count_alike(steps):
    # The server counts bytes, the SDK (splitting a batch) counts message objects.
    request = service_pb2.BatchRequest(steps=steps)
    counted = wire_fields.count_fields(request.SerializeToString(), request.DESCRIPTOR, BIG)
    assert counted == wire_fields.message_fields(request)
