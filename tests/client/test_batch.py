"""The Batch RPC: many ops, one round trip, stop at the first failure."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve import protocol, wire_fields
from gradserve.errors import InvalidArgumentError


def test_batch_runs_in_order_and_returns_typed_results(client):
    h, flow = client.raw_ops.TensorArrayV3(size=100, dtype=np.float32)
    batch = client.batch()
    for t in range(100):
        batch.raw_ops.TensorArrayWriteV3(h, t, np.full(3, t, np.float32), flow)
    batch.raw_ops.TensorArraySizeV3(h, flow)
    batch.raw_ops.TensorArrayGatherV3(h, [5, 99], flow, np.float32)
    results = batch.run()
    assert len(results) == 102
    assert results[100] == 100
    np.testing.assert_array_equal(results[101], [[5, 5, 5], [99, 99, 99]])


def test_batch_stops_at_first_failure_and_says_where(client):
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
    batch = client.batch()
    batch.raw_ops.TensorArrayWriteV3(h, 0, np.ones(1, np.float32), flow)
    batch.raw_ops.TensorArrayWriteV3(h, 0, np.ones(1, np.float32), flow)  # fails
    batch.raw_ops.TensorArrayWriteV3(h, 1, np.ones(1, np.float32), flow)  # never runs
    with pytest.raises(InvalidArgumentError) as info:
        batch.run()
    assert info.value.step == 1
    assert len(info.value.results) == 1
    assert "Batch step 1 (TensorArrayWriteV3)" in str(info.value)
    assert "already been written to" in str(info.value)
    # Step 0 applied, step 2 did not run.
    np.testing.assert_array_equal(client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32), [1])
    with pytest.raises(InvalidArgumentError, match="not fully defined"):
        client.raw_ops.TensorArrayReadV3(h, 1, flow, np.float32)


def test_empty_batch(client):
    assert client.batch().run() == []


def test_placeholders_carry_the_dtypes_the_sdk_knows(client):
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
    batch = client.batch()
    ta, flow2 = batch.raw_ops.TensorArrayV3(2, np.float64)
    assert ta.dtype is None  # a TensorArray handle, not a tensor
    assert batch.raw_ops.TensorArrayReadV3(h, 0, flow, "half").dtype == np.float16
    value, lengths = batch.raw_ops.TensorArrayConcatV3(h, flow, np.float32)
    assert (value.dtype, lengths.dtype) == (np.float32, np.int64)
    assert batch.raw_ops.StopGradient([1.0, 2.0]).dtype == np.float32  # as TF converts
    assert batch.raw_ops.StopGradient(batch.raw_ops.StopGradient(ta)).dtype is None
    unknown = batch.raw_ops.StopGradient(ta)  # x of a dtype the SDK does not know
    w = np.zeros((2, 4), np.float64)
    out = batch.raw_ops.BlockLSTMV2(np.int64(1), unknown, *[np.zeros((1, 1))] * 2, w,
                                    *[np.zeros(1)] * 3, np.zeros(4))  # fmt: skip
    assert out.h.dtype == np.float64  # T from the inputs the SDK knows


def test_a_batch_of_more_fields_than_one_request_may_hold_is_split(client):
    # The server refuses a request of more than MAX_REQUEST_FIELDS fields unparsed;
    # the SDK sends a batch in as many requests as that needs.
    h, flow = client.raw_ops.TensorArrayV3(size=6000, dtype=np.int32)
    batch = client.batch()
    for t in range(6000):
        batch.raw_ops.TensorArrayWriteV3(h, t, np.int32(t), flow)
    batch.raw_ops.TensorArrayGatherV3(h, np.arange(6000), flow, np.int32)
    fields = sum(wire_fields.message_fields(request) + 2 for _, request, *_ in batch._steps)
    assert fields > protocol.MAX_REQUEST_FIELDS
    np.testing.assert_array_equal(batch.run()[-1], np.arange(6000))
