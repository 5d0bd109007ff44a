"""nginx answers a call it could not pass on in gRPC's terms (deploy/nginx's template,
the part the tests' config takes as is): UNAVAILABLE with reason NOT_FORWARDED when
no byte of it reached a replica, which the SDK repeats even for a write (it cannot
have run); a plain UNAVAILABLE when the replica went away during the call, which the
SDK reports as outcome unknown for a write."""

from __future__ import annotations

import re
import socket
import threading
import time

import numpy as np
import pytest

import gradserve
from gradserve.client._client import OUTCOME_UNKNOWN
from gradserve.errors import NOT_FORWARDED_REASON, UnavailableError
from tests.scaleout import workload
from tests.scaleout.proxies import assert_not_forwarded_details, template_part


def test_the_templates_error_details_agree_with_its_message_and_the_sdk():
    part = template_part("failed calls (server)")
    message = re.search(r'grpc-message "([^"]*)" always;', part).group(1)
    blob = re.search(r'grpc-status-details-bin "([^"]*)" always;', part).group(1)
    assert_not_forwarded_details(message, blob)


@pytest.mark.scaleout
def test_a_write_while_its_replica_restarts_is_repeated_not_left_unknown(make_cluster):
    """Behind nginx, nothing listening: NOT_FORWARDED (no byte reached a replica)."""
    cluster = make_cluster("nginx", 1)
    workload.write_through_a_restart(
        cluster.proxy.target, cluster.replicas["r0"], NOT_FORWARDED_REASON
    )


@pytest.mark.scaleout
def test_a_streamed_put_while_its_replica_restarts_is_sent_whole_again(make_cluster):
    """A repeat of a client stream sends every chunk again: the first attempt used up
    the chunks it got to send."""
    cluster = make_cluster("nginx", 1)
    r0 = cluster.replicas["r0"]
    c = gradserve.Client(cluster.proxy.target, keepalive=False, retries=10, shared_memory=False)
    value = np.random.default_rng(0).standard_normal((1024, 1100)).astype(np.float32)
    assert value.nbytes > c.stream_threshold  # a PutTensor stream, in chunks
    assert r0.stop() == 0
    restarted = threading.Timer(1.0, r0.start)
    restarted.start()
    try:
        ref = c.put(value)
    finally:
        restarted.join()
    assert np.array_equal(c.get(ref), value)


class _Vanishing:
    """A "replica" that takes each connection, reads what comes and closes it: every
    call reaches a server, which goes away before answering."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(10)
        self.port = self.sock.getsockname()[1]
        self.received = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(2)
                got, end = 0, time.monotonic() + 2
                while time.monotonic() < end and got < 100:
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        break
                    if not data:
                        break
                    got += len(data)
                self.received += got

    def close(self) -> None:
        self.sock.close()


@pytest.mark.scaleout
def test_a_write_whose_replica_vanished_mid_call_says_its_outcome_is_unknown(make_cluster):
    cluster = make_cluster("nginx", 1)
    c = gradserve.Client(cluster.proxy.target, keepalive=False, retries=3)
    ta = c.tensor_array(np.float32, size=2, element_shape=(3,))
    vanishing = _Vanishing()
    try:
        cluster.routes["r0"] = vanishing.port  # r0's sessions now reach the vanishing one
        cluster.route()
        with pytest.raises(UnavailableError, match="^" + re.escape(OUTCOME_UNKNOWN)) as lost:
            ta.write(0, np.ones(3, np.float32))
        assert vanishing.received > 0  # the call did reach it
        assert lost.value.reason != NOT_FORWARDED_REASON
        assert "may or may not have run" in str(lost.value)
    finally:
        vanishing.close()


class _Blackhole:
    """An address that neither takes a connection nor refuses one, as a pod's address
    does once the pod is gone (packets dropped): a listener whose accept queue is full,
    so that Linux drops the SYNs that come."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.port = self.sock.getsockname()[1]
        self.filler = socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def close(self) -> None:
        self.filler.close()
        self.sock.close()


@pytest.mark.scaleout
def test_a_replica_that_takes_no_connection_is_not_forwarded_within_seconds(make_cluster):
    """nginx waited its default 60 s for the connection, and every call of the
    replica's sessions with it; the template's 2 s end the call NOT_FORWARDED, which
    the SDK repeats after its backoff (here: no repeats)."""
    cluster = make_cluster("nginx", 1)
    c = gradserve.Client(cluster.proxy.target, keepalive=False, retries=0, timeout=30)
    ta = c.tensor_array(np.float32, size=2, element_shape=(3,))
    hole = _Blackhole()
    try:
        cluster.routes["r0"] = hole.port
        cluster.route()
        started = time.monotonic()
        with pytest.raises(UnavailableError) as refused:
            ta.write(0, np.ones(3, np.float32))
        assert time.monotonic() - started < 10
        assert refused.value.reason == NOT_FORWARDED_REASON
    finally:
        hole.close()
