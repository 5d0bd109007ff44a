"""The SDK's retry policy: UNAVAILABLE is retried with backoff for calls that are safe to
repeat, never for writes; other codes are never retried."""

from __future__ import annotations

import grpc
import pytest

from gradserve.client._client import _safe_to_repeat
from gradserve.errors import InvalidArgumentError, UnavailableError
from gradserve.v1 import lstm_pb2, service_pb2, tensor_array_pb2


class FakeRpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return f"fake {self._code.name}"

    def trailing_metadata(self):
        return ()


def flaky(failures: int, code=grpc.StatusCode.UNAVAILABLE):
    calls = []

    def attempt():
        calls.append(1)
        if len(calls) <= failures:
            raise FakeRpcError(code)
        return "done"

    return attempt, calls


def test_safe_calls_are_retried_until_they_succeed(client, monkeypatch):
    monkeypatch.setattr(client, "_pause", lambda s, **k: None)
    attempt, calls = flaky(2)
    assert client._with_retries(attempt, safe=True) == "done"
    assert len(calls) == 3


def test_retries_stop_after_the_budget(client, monkeypatch):
    monkeypatch.setattr(client, "_pause", lambda s, **k: None)
    attempt, calls = flaky(10)
    with pytest.raises(UnavailableError):
        client._with_retries(attempt, safe=True)
    assert len(calls) == client.retries + 1


def test_unsafe_calls_and_other_codes_are_not_retried(client):
    attempt, calls = flaky(1)
    with pytest.raises(UnavailableError):
        client._with_retries(attempt, safe=False)
    attempt, calls2 = flaky(1, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(InvalidArgumentError):
        client._with_retries(attempt, safe=True)
    assert len(calls) == len(calls2) == 1


def test_backoff_grows(client, monkeypatch):
    sleeps = []
    monkeypatch.setattr(client, "_pause", lambda s, **k: sleeps.append(s))
    attempt, _ = flaky(3)
    client._with_retries(attempt, safe=True)
    assert len(sleeps) == 3 and sleeps[0] < sleeps[2] and sleeps[2] >= 0.4


def test_which_calls_are_safe():
    assert _safe_to_repeat("KeepAlive", service_pb2.KeepAliveRequest())
    assert _safe_to_repeat("TensorArraySizeV3", tensor_array_pb2.TensorArraySizeV3Request())
    assert _safe_to_repeat("StopGradient", tensor_array_pb2.StopGradientRequest())
    assert not _safe_to_repeat(
        "StopGradient", tensor_array_pb2.StopGradientRequest(keep_outputs=True)
    )
    assert _safe_to_repeat("BlockLSTMGradV2", lstm_pb2.BlockLSTMGradRequest())
    for rpc in (
        "TensorArrayWriteV3",
        "TensorArrayReadV3",
        "TensorArrayScatterV3",
        "TensorArrayGatherV3",
        "CreateSession",
        "CloseSession",
        "Batch",
    ):
        assert not _safe_to_repeat(rpc, service_pb2.BatchRequest())
