"""Faults, against a server in its own process: a client killed mid-call, a client
that never closes its session, SIGTERM under load."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import gradserve
from gradserve.client._errors import DROPPED
from gradserve.errors import GradserveError, UnavailableError
from gradserve.server.core import tensor_array
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
from tests.server.test_limits import lstm_args
from tests.server_process import ServerProcess


@pytest.fixture
def short_ttl_server():
    server = ServerProcess("--session-ttl", "1")
    yield server
    assert server.stop() == 0


KILLED_CLIENT = textwrap.dedent("""
    import sys, numpy as np, gradserve
    c = gradserve.Client(sys.argv[1], keepalive=False)
    c.put(np.ones(100_000))
    r = lambda *s: np.ones(s, np.float32)
    print("calling", flush=True)
    c.raw_ops.BlockLSTMV2(np.int64(400_000), r(400_000, 1, 1), r(1, 1), r(1, 1), r(2, 4),
                          r(1), r(1), r(1), r(4))
""")


def test_client_killed_mid_call(short_ttl_server):
    server = short_ttl_server
    client = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, server.target], stdout=subprocess.PIPE, text=True
    )
    assert client.stdout.readline().strip() == "calling"
    time.sleep(0.5)
    client.kill()
    client.wait()
    with gradserve.Client(server.target) as other:  # still serving
        np.testing.assert_array_equal(other.stop_gradient(np.arange(3)), np.arange(3))
    # The dead client's session expires (TTL 1 s) and its 800 kB are freed.
    assert server.wait_for("gradserve_sessions_open", 0) == 0
    assert server.metric("gradserve_bytes_held") == 0
    assert server.metric("gradserve_sessions_expired_total") >= 1


def test_client_that_never_closes(short_ttl_server):
    server = short_ttl_server
    leaky = gradserve.Client(server.target, keepalive=False)
    leaky.put(np.ones(50_000))
    ta = leaky.tensor_array(np.float64, size=2)
    ta.write(0, np.ones(1000))
    # Values, and the records of the tensor, the array (name "TensorArrayV3_1") and
    # its one slot.
    records = tensor_array.ARRAY_BYTES + 2 * len(ta.handle.name) + tensor_array.SLOT_BYTES
    records += TENSOR_RECORD_BYTES
    assert server.metric("gradserve_bytes_held") == 408_000 + records
    assert server.wait_for("gradserve_bytes_held", 0) == 0
    assert server.metric("gradserve_sessions_open") == 0


def test_sigterm_under_load():
    server = ServerProcess("--grace", "20")
    stop_load = threading.Event()
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def load(k):
        try:
            with gradserve.Client(server.target, retries=0) as c:
                while not stop_load.is_set():
                    try:
                        v = np.full(8, k, np.float32)
                        assert c.stop_gradient(v).tobytes() == v.tobytes()
                        key = "ok"
                    except UnavailableError as e:
                        # The server stopped taking new calls (refused before it ran:
                        # safe to repeat elsewhere). Nothing is ever CANCELLED (which
                        # the SDK would report as UNAVAILABLE, saying so).
                        key = "CANCELLED" if DROPPED in e.message else "refused"
                    except GradserveError as e:
                        key = type(e).__name__
                    with lock:
                        outcomes[key] = outcomes.get(key, 0) + 1
                    if key != "ok":
                        return
        except GradserveError as e:
            with lock:
                outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1

    threads = [threading.Thread(target=load, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    long_result = {}

    def long_call():
        with gradserve.Client(server.target, retries=0) as c:
            r = lambda *s: np.ones(s, np.float32)  # noqa: E731
            long_result["h"] = c.raw_ops.BlockLSTMV2(
                np.int64(150_000),
                r(150_000, 1, 1),
                r(1, 1),
                r(1, 1),
                r(2, 4),
                r(1),
                r(1),
                r(1),
                r(4),
            ).h

    in_flight = threading.Thread(target=long_call)
    in_flight.start()
    # Computing before the signal (a fixed sleep raced the 32 load threads here).
    assert server.wait_for("gradserve_compute_running", 1) == 1
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    with pytest.raises(UnavailableError):
        gradserve.Client(server.target, retries=0, timeout=5)  # no new sessions
    in_flight.join(30)
    assert long_result["h"].shape == (150_000, 1, 1)  # the in-flight op completed
    stop_load.set()
    for t in threads:
        t.join(30)
    assert server.proc.wait(30) == 0
    assert outcomes.get("ok", 0) > 0
    assert set(outcomes) <= {"ok", "refused", "UnavailableError"}, outcomes  # no CANCELLED


def test_a_drain_waits_for_a_slow_client_to_fetch_what_its_reply_handed_out():
    """An output that does not fit its reply waits on the server for the client's
    GetTensor. The drain stopped the server QUIET_SECONDS (0.25 s) after the op's call
    ended: a client that fetched later than that (its process busy) found nothing
    listening, and the result was lost. The drain now waits, within --grace, until
    the outputs handed out are fetched."""
    server = ServerProcess("--grace", "20")
    try:
        # 1 MiB messages: StopGradient's 4 MiB output goes back by GetTensor.
        with gradserve.Client(
            server.target, retries=0, shared_memory=False, max_message_bytes=1 << 20
        ) as c:
            x = np.arange(1 << 20, dtype=np.float32)
            fetch, fetches = c._fetch, []

            def fetch_late(tensor_id, **kwargs):
                if not fetches:
                    server.proc.send_signal(signal.SIGTERM)
                    assert server.wait_for("gradserve_draining", 1) == 1
                    time.sleep(1.0)  # past the 0.25 s quiet time, within the 5 s patience
                fetches.append(tensor_id)
                return fetch(tensor_id, **kwargs)

            c._fetch = fetch_late
            np.testing.assert_array_equal(c.raw_ops.StopGradient(input=x), x)
            assert len(fetches) == 1
        assert server.proc.wait(30) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_an_op_that_ends_in_a_drain_gets_its_streamed_outputs_to_its_client():
    """Outputs that do not fit the reply come back by GetTensor calls after it. A
    drain refused those (every new call was): the op completed, and its results were
    lost (UNAVAILABLE, then "failed to connect" once the server had stopped). Reading
    and deleting what only this replica holds is admitted while it drains."""
    # NumPy's passes: 150,000 steps of tiny cells compute for a second or so, long
    # enough to see the op running (FUSED's compiled calls of several steps: 0.08 s)
    server = ServerProcess("--grace", "20", "--cpu-step-kernel", "numpy")
    try:
        with gradserve.Client(server.target, retries=0, shared_memory=False) as c:
            args = lstm_args(150_000)  # seven 4.8 MB outputs: more than one reply holds
            alone = c.raw_ops.BlockLSTMV2(*args)
            result = {}
            call = threading.Thread(target=lambda: result.update(out=c.raw_ops.BlockLSTMV2(*args)))
            call.start()
            assert server.wait_for("gradserve_compute_running", 1) == 1
            server.proc.send_signal(signal.SIGTERM)
            call.join(30)
            assert "out" in result, "the op's outputs were lost"
            for got, expected in zip(result["out"], alone):
                np.testing.assert_array_equal(got, expected)
        assert server.proc.wait(30) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
