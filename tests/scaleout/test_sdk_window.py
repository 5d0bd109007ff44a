"""The SDK through a replica's restart window: a call the server refused unrun
(UNAVAILABLE, reason DRAINING), or that gRPC could not send (reason NOT_CONNECTED: the
client's own channel connected to no address), is repeated whatever it is; a write
that failed UNAVAILABLE otherwise is not repeated and says its outcome is unknown; a
call the server or a proxy ended CANCELLED (gRPC does so to calls a server shutting
down had not yet handed over) counts as UNAVAILABLE; a session the server does not
hold is SessionLostError, saying why."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

import gradserve
from gradserve.client._client import CONNECT_POLL_SECONDS, OUTCOME_UNKNOWN
from gradserve.errors import (
    NOT_CONNECTED_REASON,
    UNRUN_REASONS,
    AbortedError,
    CancelledError,
    Code,
    NotFoundError,
    SessionLostError,
    UnavailableError,
)
from gradserve.server import run_server
from tests.failing_stub import FailingStub
from tests.scaleout import workload
from tests.scaleout.cluster import Replica


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
    monkeypatch.setattr(client, "_pause", lambda s, **k: None)
    attempt, calls = failing(2, Refused(grpc.StatusCode.UNAVAILABLE, "DRAINING"))
    assert client._with_retries(attempt, safe=False) == "done" and len(calls) == 3


def test_only_gradserves_own_reasons_say_a_call_did_not_run(client, monkeypatch):
    monkeypatch.setattr(client, "_pause", lambda s, **k: None)
    for reason in UNRUN_REASONS:
        attempt, calls = failing(1, Refused(grpc.StatusCode.UNAVAILABLE, reason))
        assert client._with_retries(attempt, safe=False) == "done" and len(calls) == 2
        other = Refused(grpc.StatusCode.UNAVAILABLE, reason, domain="example.com")
        attempt, calls = failing(1, other)
        with pytest.raises(UnavailableError, match="^outcome unknown") as info:
            client._with_retries(attempt, safe=False)
        assert len(calls) == 1 and info.value.reason == ""


UNSENT = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: refused"


def test_a_call_grpc_could_not_send_is_repeated_whatever_it_is(client, monkeypatch):
    """gRPC fails a call at once, unsent, while the client's channel connects to no
    address (pick_first's transient failure) or resolves none: reason NOT_CONNECTED,
    repeated like DRAINING. Through each backoff pause it is tried again every
    CONNECT_POLL_SECONDS, so the repeat goes soon after the server is back; the
    pauses add up to the backoff's, and then it says the server was not reached."""
    pauses: list[float] = []
    monkeypatch.setattr(client, "_pause", pauses.append)
    unresolved = "errors resolving gs.invalid:1: [field:hostname lookup error: not found]"
    for message in (UNSENT, unresolved, "DNS resolution failed for gs.invalid:1: C-ares"):
        pauses.clear()
        attempt, calls = failing(2, Refused(grpc.StatusCode.UNAVAILABLE, message=message))
        assert client._with_retries(attempt, safe=False) == "done" and len(calls) == 3
        assert len(pauses) == 2 and max(pauses) <= CONNECT_POLL_SECONDS
    pauses.clear()
    attempt, calls = failing(10**6, Refused(grpc.StatusCode.UNAVAILABLE, message=UNSENT))
    with pytest.raises(UnavailableError) as info:  # still down: said so, not "unknown"
        client._with_retries(attempt, safe=False)
    assert info.value.reason == NOT_CONNECTED_REASON
    assert not str(info.value).startswith(OUTCOME_UNKNOWN)
    backoff = sum(0.1 * 2**i for i in range(client.retries))  # each pause times 1-2
    assert backoff - 1e-9 <= sum(pauses) <= 2 * backoff + 1e-9
    assert max(pauses) <= CONNECT_POLL_SECONDS and len(calls) == len(pauses) + 1
    assert len(calls) > 2 * (client.retries + 1)  # polled through the pauses
    for other in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED):
        attempt, calls = failing(1, Refused(other, message=UNSENT))
        with pytest.raises(gradserve.errors.GradserveError) as info:
            client._with_retries(attempt, safe=False)  # only UNAVAILABLE is gRPC's unsent
        assert info.value.reason == "" and len(calls) == 1
    quoted = Refused(grpc.StatusCode.UNAVAILABLE, message="upstream: " + UNSENT)
    attempt, calls = failing(1, quoted)  # a message that quotes it is not gRPC's own
    with pytest.raises(UnavailableError, match="^outcome unknown"):
        client._with_retries(attempt, safe=False)
    assert len(calls) == 1


def test_retries_are_not_negative_and_none_follows_close(client, monkeypatch):
    """A negative budget is refused (it once repeated forever); once ``close`` has
    ended a pause (from another thread), the call is not tried again."""
    with pytest.raises(ValueError, match="retries"):
        gradserve.Client(client.target, retries=-1)
    monkeypatch.setattr(client, "_pause", lambda s: client._closing.set())
    attempt, calls = failing(5, Refused(grpc.StatusCode.UNAVAILABLE, message=UNSENT))
    with pytest.raises(UnavailableError):
        client._with_retries(attempt, safe=False)
    assert len(calls) == 1
    client._closing.clear()


def test_a_rejected_certificate_is_not_repeated(client, monkeypatch):
    monkeypatch.setattr(client, "_pause", lambda s, **k: None)
    for why in (
        "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
        "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: self signed certificate",
        "Peer name gradserve.example is not in peer certificate",
    ):
        message = UNSENT.replace("refused", why)
        for safe in (True, False):
            attempt, calls = failing(1, Refused(grpc.StatusCode.UNAVAILABLE, message=message))
            with pytest.raises(UnavailableError) as info:
                client._with_retries(attempt, safe=safe)
            assert len(calls) == 1 and info.value.reason == NOT_CONNECTED_REASON
    dying = UNSENT.replace("refused", "Tls handshake failed: Socket closed")
    attempt, calls = failing(1, Refused(grpc.StatusCode.UNAVAILABLE, message=dying))
    assert client._with_retries(attempt, safe=False) == "done" and len(calls) == 2


def test_on_a_callers_channel_not_connected_is_not_known_unsent(target, monkeypatch):
    """A channel the caller made may carry a retry policy that sent the call before
    its last attempt found the server gone: a write is then not repeated."""
    channel = grpc.insecure_channel(target, options=gradserve.Client.channel_options())
    with gradserve.Client(target, channel=channel, keepalive=False) as c:
        attempt, calls = failing(1, Refused(grpc.StatusCode.UNAVAILABLE, message=UNSENT))
        with pytest.raises(UnavailableError, match="^outcome unknown") as info:
            c._with_retries(attempt, safe=False)
        assert len(calls) == 1 and info.value.reason == ""
    channel.close()


@pytest.mark.parametrize("owner", [True, False])
def test_close_does_not_wait_out_a_server_that_is_down(monkeypatch, owner):
    """``close`` repeats nothing: the owner's CloseSession, a joined client's
    UnregisterSharedMemory of its regions (the server's idle timeout frees both)."""
    with run_server(device="cpu") as server:
        target = f"127.0.0.1:{server.port}"
        first = gradserve.Client(target, shared_memory=False, keepalive=False)
        joined = gradserve.Client(
            target, session_id=first.session_id, shared_memory=True, keepalive=False
        )
        joined.put(np.ones(1 << 16, np.float32))  # 256 KiB: through a region
        assert joined._shm is not None and joined._shm.pool._all  # registered
    c, other = (first, joined) if owner else (joined, first)
    c.retries = 8
    waits = []
    monkeypatch.setattr(c, "_pause", lambda s, **k: waits.append(s))
    c.close()
    assert waits == []
    monkeypatch.undo()
    other.retries = 0
    other.close()


def test_close_ends_the_pauses_between_attempts():
    with run_server(device="cpu") as server:
        c = gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False)
    returned = []
    pause = threading.Thread(target=lambda: returned.append(c._pause(60.0)))
    pause.start()
    time.sleep(0.3)
    c.close()
    pause.join(10.0)
    assert returned == [None]  # returned, early


def test_close_ends_the_wait_of_a_call_on_another_thread():
    """A write waiting to repeat (the server is down) ends soon after ``close`` from
    another thread: its retry budget (16-32 s at 8) is not waited out."""
    with run_server(device="cpu") as server:
        c = gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False, retries=8)
    ended: dict[str, BaseException] = {}

    def write() -> None:
        try:
            c.put(np.ones(3, np.float32))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            ended["error"] = e

    caller = threading.Thread(target=write)
    caller.start()
    time.sleep(1.0)  # past its first waits
    assert caller.is_alive()
    c.close()
    caller.join(5.0)
    assert not caller.is_alive()
    error = ended["error"]  # cancelled in an attempt, or unsent when its pause ended
    assert isinstance(error, CancelledError) or (
        isinstance(error, UnavailableError) and error.reason == NOT_CONNECTED_REASON
    ), ended


def test_the_channel_retries_connecting_at_least_once_a_second():
    """``Client.channel_options``: reconnect backoff from 0.1 s, at most 1 s (plus 20%
    jitter). gRPC's own (1 s, growing 1.6x to 120 s) tries 3 times in 3 s; these 7."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def accept() -> None:  # every connection closed at once: a failed attempt
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(time.monotonic())
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    channel = grpc.insecure_channel(target, options=gradserve.Client.channel_options())
    try:
        ready = grpc.channel_ready_future(channel)  # keeps it connecting
        with pytest.raises(grpc.FutureTimeoutError):
            ready.result(timeout=3.0)
        ready.cancel()
    finally:
        channel.close()
        listener.close()
    assert len(accepted) >= 5, accepted


def test_a_client_is_not_refused_for_another_clients_dead_server():
    """gRPC shares a connection per address among a process's channels, backoff and
    all: a Client made just after a server (re)started where another Client had seen
    a dead one failed at once with the old "Connection refused". Each Client now has
    its own."""
    with run_server(device="cpu") as first:
        port = first.port
        old = gradserve.Client(f"127.0.0.1:{port}", shared_memory=False, retries=0)
    try:
        for _ in range(3):  # the old channel in reconnect backoff
            with pytest.raises(UnavailableError) as down:
                old.put(np.ones(3, np.float32))
            assert down.value.reason == NOT_CONNECTED_REASON
        with run_server(device="cpu", port=port):
            with gradserve.Client(f"127.0.0.1:{port}", shared_memory=False, retries=0) as new:
                assert np.array_equal(new.get(new.put(np.arange(3))), np.arange(3))
    finally:
        old.close()


@pytest.mark.slow
def test_a_write_while_the_server_restarts_is_repeated_not_left_unknown(tmp_path):
    """Straight to a server (no proxy) that restarts with its --state-dir: a write sent
    while nothing listens was never sent (NOT_CONNECTED), so it is repeated through the
    window, not reported as of unknown outcome."""
    replica = Replica("r0", tmp_path).start()
    try:
        workload.write_through_a_restart(replica.target, replica, NOT_CONNECTED_REASON)
    finally:
        replica.stop()


def test_a_write_lost_in_flight_is_not_repeated_and_says_so(client):
    attempt, calls = failing(1, Refused(grpc.StatusCode.UNAVAILABLE, message="502"))
    with pytest.raises(UnavailableError, match="^outcome unknown: .*not repeated") as info:
        client._with_retries(attempt, safe=False)
    assert len(calls) == 1 and "502" in str(info.value)


def test_a_call_the_server_cancelled_counts_as_unavailable(client, monkeypatch):
    """What gRPC core sends for a call received but not handed over at shutdown
    (grpc/grpc#41785): repeated when safe; otherwise outcome unknown, not repeated."""
    monkeypatch.setattr(client, "_pause", lambda s, **k: None)
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


def test_a_call_the_server_never_answered_deletes_its_uploads_once(target, monkeypatch):
    """A large input goes up first (PutTensor); if the op then fails unsent (the server
    went down), deleting that upload is tried once: the server may well be down, and
    each try polls (the session's idle timeout frees it otherwise)."""
    c = gradserve.Client(target, shared_memory=False, keepalive=False)
    real, down = c._stub, [Refused(grpc.StatusCode.UNAVAILABLE, message=UNSENT)] * 1000
    stub = FailingStub(real, {"StopGradient": down, "DeleteTensor": down})
    attempts = stub.attempts
    monkeypatch.setattr(c, "_pause", lambda s: None)
    c._stub = stub
    try:
        with pytest.raises(UnavailableError) as down:
            c.raw_ops.StopGradient(input=np.ones(1 << 20, np.float32))  # 4 MiB: uploaded
        assert down.value.reason == NOT_CONNECTED_REASON
        assert attempts["PutTensor"] == 1 and attempts["StopGradient"] > 1
        assert attempts["DeleteTensor"] == 1, attempts
    finally:
        c._stub = real
        c.close()
