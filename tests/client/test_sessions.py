"""Sessions: isolation, reattach, close frees everything, ids unguessable."""

from __future__ import annotations

import numpy as np
import pytest

import gradserve
from gradserve import protocol
from gradserve.errors import InvalidArgumentError, NotFoundError


def test_handle_from_another_session_is_not_found(target):
    with gradserve.Client(target) as a, gradserve.Client(target) as b:
        h, flow = a.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
        ref = a.put(np.ones(3))
        with pytest.raises(NotFoundError) as info:
            b.raw_ops.TensorArraySizeV3(h, flow)
        assert info.value.reason == "TENSOR_ARRAY_NOT_FOUND"
        with pytest.raises(NotFoundError):
            b.get(ref.id)
        assert a.raw_ops.TensorArraySizeV3(h, flow) == 1


def test_reattach_keeps_state_and_does_not_close(target):
    with gradserve.Client(target) as owner:
        ta = owner.tensor_array(np.float32, size=2).write(0, [1.0, 2.0])
        with gradserve.Client(target, session_id=owner.session_id) as worker:
            assert not worker.owns_session
            np.testing.assert_array_equal(
                worker.raw_ops.TensorArrayReadV3(ta.handle, 0, 0.0, np.float32), [1.0, 2.0]
            )
        owner.keep_alive()  # still open after the reattached client exited


def test_close_frees_everything(server, target):
    client = gradserve.Client(target)
    client.tensor_array(np.float32, size=1).write(0, [1.0])
    client.put(np.zeros(10))
    session = server.store.get(client.session_id)
    assert session.budget.used > 0
    client.close()
    assert session.budget.used == 0
    with pytest.raises(NotFoundError) as info:
        gradserve.Client(target, session_id=client.session_id)
    assert info.value.reason == "SESSION_NOT_FOUND"


def test_ids_are_long_and_distinct(target):
    with gradserve.Client(target) as a, gradserve.Client(target) as b:
        assert a.session_id != b.session_id and len(a.session_id) >= 22
        h1, _ = a.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
        h2, _ = a.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
        assert h1.id != h2.id and len(h1.id) >= 22  # >= 128 random bits, base64


def test_idle_session_expires(server, target):
    client = gradserve.Client(target)
    session = server.store.get(client.session_id)
    session.last_used -= server.store.idle_timeout + 1
    assert server.store.expire_idle() >= 1
    with pytest.raises(NotFoundError):
        client.keep_alive()


def test_missing_session_metadata(target):
    import grpc

    from gradserve.v1 import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GradServeStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.KeepAlive(service_pb2.KeepAliveRequest())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_error_carries_field_violation(client):
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    with pytest.raises(InvalidArgumentError) as info:
        client.raw_ops.TensorArrayWriteV3(h, 0, np.ones(2), flow)  # float64 into float32
    assert info.value.field == "value"
    assert "TensorArray dtype is float but Op is trying to write dtype double" in str(info.value)


def test_deleting_more_ids_than_one_request_may_hold(client):
    # The server refuses a request of more than MAX_REQUEST_FIELDS fields unparsed;
    # the SDK sends the ids in as many requests as that needs.
    kept = client.put(np.arange(3))
    ids = [f"gone-{i}" for i in range(protocol.MAX_REQUEST_FIELDS)] + [kept.id]
    assert client.delete(*ids) == 1
