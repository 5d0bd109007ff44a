"""The SDK through a replica's restart window: a call the server refused unrun
(UNAVAILABLE, reason DRAINING) is repeated whatever it is; a write that failed
UNAVAILABLE otherwise is not repeated and says its outcome is unknown; a call the server
or a proxy ended CANCELLED (gRPC does so to calls a server shutting down had not yet
handed over) counts as UNAVAILABLE; a session the server does not hold is
SessionLostError, saying why."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

import gradserve
from gradserve.errors import (
    UNRUN_REASONS,
    AbortedError,
    CancelledError,
    Code,
    NotFoundError,
    SessionLostError,
    UnavailableError,
)


class Refused(grpc.RpcError):
    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str = "",
        message: str = "refused",
        domain: str = "gradserve",
    ):
        self._code, self._message = code, message
        status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
        if reason:
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=domain))
            status.details.append(detail)
        self._trailing = (("grpc-status-details-bin", status.SerializeToString()),)

    def code(self):
        return self._code

    def details(self):
        return self._message

    def trailing_metadata(self):
        return self._trailing


def failing(times: int, error: grpc.RpcError):
    calls = []

    def attempt():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "done"

    return attempt, calls


def test_a_write_refused_while_draining_is_repeated(client, monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    attempt, calls = failing(2, Refused(grpc.StatusCode.UNAVAILABLE, "DRAINING"))
    assert client._with_retries(attempt, safe=False) == "done" and len(calls) == 3


def test_only_gradserves_own_reasons_say_a_call_did_not_run(client, monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    for reason in UNRUN_REASONS:
        attempt, calls = failing(1, Refused(grpc.StatusCode.UNAVAILABLE, reason))
        assert client._with_retries(attempt, safe=False) == "done" and len(calls) == 2
        other = Refused(grpc.StatusCode.UNAVAILABLE, reason, domain="example.com")
        attempt, calls = failing(1, other)
        with pytest.raises(UnavailableError, match="^outcome unknown") as info:
            client._with_retries(attempt, safe=False)
        assert len(calls) == 1 and info.value.reason == ""


def test_a_write_lost_in_flight_is_not_repeated_and_says_so(client):
    attempt, calls = failing(1, Refused(grpc.StatusCode.UNAVAILABLE, message="502"))
    with pytest.raises(UnavailableError, match="^outcome unknown: .*not repeated") as info:
        client._with_retries(attempt, safe=False)
    assert len(calls) == 1 and "502" in str(info.value)


def test_a_call_the_server_cancelled_counts_as_unavailable(client, monkeypatch):
    """What gRPC core sends for a call received but not handed over at shutdown
    (grpc/grpc#41785): repeated when safe; otherwise outcome unknown, not repeated."""
    monkeypatch.setattr("time.sleep", lambda s: None)
    cancelled = Refused(grpc.StatusCode.CANCELLED, message="CANCELLED")
    attempt, calls = failing(2, cancelled)
    assert client._with_retries(attempt, safe=True) == "done" and len(calls) == 3
    attempt, calls = failing(1, cancelled)
    with pytest.raises(UnavailableError, match="^outcome unknown: .*CANCELLED") as info:
        client._with_retries(attempt, safe=False)
    assert len(calls) == 1 and info.value.code == Code.UNAVAILABLE
    for gone in ("Channel closed!", "Channel deallocated!"):  # gRPC's, when a channel goes
        attempt, calls = failing(1, Refused(grpc.StatusCode.CANCELLED, message=gone))
        with pytest.raises(CancelledError, match="channel was closed"):
            client._with_retries(attempt, safe=True)
        assert len(calls) == 1
    attempt, calls = failing(1, Refused(grpc.StatusCode.ABORTED, message="aborted"))
    with pytest.raises(AbortedError):  # other codes are the server's answer, as before
        client._with_retries(attempt, safe=True)
    assert len(calls) == 1


def test_a_session_not_held_is_session_lost_with_the_reasons(client):
    attempt, _ = failing(1, Refused(grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND", "gone"))
    with pytest.raises(SessionLostError) as info:
        client._with_retries(attempt, safe=True)
    assert isinstance(info.value, NotFoundError) and info.value.reason == "SESSION_NOT_FOUND"
    for why in ("restarted without", "crashed", "--session-ttl", "does not hold it", "gone"):
        assert why in str(info.value)
    attempt, _ = failing(1, Refused(grpc.StatusCode.NOT_FOUND, "TENSOR_NOT_FOUND"))
    with pytest.raises(NotFoundError) as other:  # an array or tensor: not the session
        client._with_retries(attempt, safe=True)
    assert not isinstance(other.value, SessionLostError)


def test_reattaching_to_an_unknown_session_is_session_lost(target):
    with pytest.raises(SessionLostError, match="session lost"):
        gradserve.Client(target, session_id="r9.nosuchsession", keepalive=False)


def test_closing_the_client_under_a_call_cancels_it_and_every_later_call(target):
    """``close`` from another thread ends the call in flight (gRPC: CANCELLED "Channel
    closed!"): CancelledError, not a repeat nor "outcome unknown"; later calls too."""
    owner = gradserve.Client(target, keepalive=False)
    c = gradserve.Client(target, session_id=owner.session_id, keepalive=False, retries=0)
    ended: dict[str, BaseException] = {}

    def long_call() -> None:
        ones = lambda *s: np.ones(s, np.float32)  # noqa: E731
        try:
            c.raw_ops.BlockLSTMV2(
                np.int64(150_000),
                ones(150_000, 1, 1),
                *(ones(1, 1), ones(1, 1), ones(2, 4)),
                *(ones(1), ones(1), ones(1), ones(4)),
            )
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            ended["error"] = e

    caller = threading.Thread(target=long_call)
    caller.start()
    time.sleep(0.5)
    c.close()
    caller.join(30)
    assert isinstance(ended.get("error"), CancelledError), ended
    with pytest.raises(CancelledError, match="closed"):
        c.keep_alive()
    owner.keep_alive()  # the session is the owner's, and open
    owner.close()
