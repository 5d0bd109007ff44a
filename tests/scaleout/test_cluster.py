"""Replicas behind a real nginx and a real HAProxy on loopback (issue 16): placement,
a replica killed, a rolling restart under load, scaling 3 -> 4 -> 3, proxy overhead.

Each test prints its figures (``pytest tests/scaleout -m slow -s`` shows them)."""

from __future__ import annotations

import collections
import concurrent.futures
import shutil
import signal
import statistics
import threading
import time

import grpc
import numpy as np
import pytest

from gradserve.errors import SessionLostError
from tests.scaleout import workload
from tests.scaleout.workload import Load, one_session, verify

pytestmark = [pytest.mark.slow, pytest.mark.scaleout]

BOTH = pytest.mark.parametrize("proxy", ["nginx", "haproxy"])


def prefix(session_id: str) -> str:
    return session_id.split(".", 1)[0]


@BOTH
def test_1000_sessions_each_reach_their_replica(make_cluster, proxy):
    """1,000 sessions created through the proxy, each writing, reading and taking a
    gradient array (every call after CreateSession routed on the id's prefix): no
    SESSION_NOT_FOUND, every result right, and the sessions spread over the replicas."""
    cluster = make_cluster(proxy)
    channels = [grpc.insecure_channel(cluster.proxy.target) for _ in range(8)]
    sessions = 1000

    def run(seed: int) -> str:
        c = one_session(cluster.proxy.target, channels[seed % 8], seed)
        return c.session_id

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(run, range(sessions)))  # any error (SessionLostError) fails here
    split = collections.Counter(prefix(i) for i in ids)
    print(f"\n[{proxy}] {sessions} sessions, split by replica: {dict(sorted(split.items()))}")
    assert sum(split.values()) == sessions and set(split) == set(cluster.replicas)
    for name, replica in cluster.replicas.items():  # each replica holds its own sessions
        assert replica.metric("gradserve_sessions_open") == split[name]
        assert min(split.values()) >= sessions // 6  # round robin: about a third each
    for ch in channels:
        ch.close()


@BOTH
def test_a_killed_replica_loses_only_its_own_sessions(make_cluster, proxy):
    """SIGKILL one replica: the others' sessions carry on without an error, new sessions
    go to the survivors, and the dead one's sessions, once it is back without their state
    (as its supervisor restarts it), raise SessionLostError within the call's deadline."""
    cluster = make_cluster(proxy)
    target = cluster.proxy.target
    channel = grpc.insecure_channel(target)
    clients = [one_session(target, channel, seed) for seed in range(30)]
    victim = cluster.replicas["r1"]
    victim.stop(signal.SIGKILL)

    survivors = [c for c in clients if prefix(c.session_id) != "r1"]
    lost = [c for c in clients if prefix(c.session_id) == "r1"]
    assert survivors and lost
    for c in survivors:  # no error at all
        c.raw_ops.TensorArraySizeV3(*_first_array(c))
    new = [workload.client(target, channel) for _ in range(12)]
    assert all(prefix(c.session_id) in ("r0", "r2") for c in new), [c.session_id for c in new]

    restart = threading.Timer(1.0, victim.start)  # back, with nothing saved (SIGKILL)
    restart.start()
    deadline = 30.0
    try:
        for c in lost:
            started = time.monotonic()
            with pytest.raises(SessionLostError) as info:
                c.keep_alive()  # safe: retried through the window, then NOT_FOUND
            assert time.monotonic() - started < deadline
            assert "session lost" in str(info.value) and "restarted" in str(info.value)
    finally:
        restart.join()
    print(
        f"\n[{proxy}] killed r1: {len(lost)} sessions lost (SessionLostError), "
        f"{len(survivors)} unaffected, {len(new)} new sessions all on r0/r2"
    )
    for c in survivors + new:
        c.close()
    channel.close()


def _first_array(c):
    h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    return h, flow


@BOTH
def test_rolling_restart_under_load_loses_nothing(make_cluster, proxy):
    """Restart r0, r1, r2 one at a time (SIGTERM: drain, snapshot; start again with the
    same --state-dir) while 8 client threads write and read back: no session lost, no
    wrong result. Prints the longest call stall."""
    cluster = make_cluster(proxy)
    with Load(cluster.proxy.target, threads=8, sessions_each=4) as load:
        time.sleep(0.5)
        for name, replica in cluster.replicas.items():
            held = replica.metric("gradserve_sessions_open")
            assert replica.stop() == 0, replica.log()
            replica.start()
            assert replica.metric("gradserve_sessions_restored_total") == held, name
            time.sleep(0.5)
    tally = load.tally
    for stream in load.all_streams():
        verify(stream)
    load.close()
    print(
        f"\n[{proxy}] rolling restart of 3 replicas under 8 clients: {tally.calls} steps, "
        f"lost {tally.lost}, wrong {tally.wrong}, writes of unknown outcome resolved "
        f"{tally.unknown_outcome}, longest stall {tally.longest_stall:.2f}s"
    )
    assert tally.lost == 0 and tally.wrong == 0, tally.errors[:5]
    assert not tally.errors, tally.errors[:5]
    assert tally.calls > 24


@BOTH
def test_scale_up_and_down_hands_sessions_over(make_cluster, proxy):
    """3 -> 4 replicas: r3 takes only new sessions. 4 -> 3 under load: r3 leaves the
    create pool, drains and snapshots on SIGTERM; r0 adopts its files (SIGHUP); only
    then does the proxy send prefix r3 to r0. No live session is lost."""
    cluster = make_cluster(proxy)
    r3 = cluster.add("r3")
    with Load(cluster.proxy.target, threads=4, sessions_each=6, seed0=100) as load:
        on_r3 = [s for s in load.all_streams() if prefix(s.client.session_id) == "r3"]
        assert on_r3, "round robin over 4 replicas gave r3 no session"
        time.sleep(0.5)
        # Scale down: no new sessions to r3; r3 drains and snapshots its sessions.
        cluster.create.remove(r3.port)
        cluster.route()
        held = r3.metric("gradserve_sessions_open")
        assert r3.stop() == 0, r3.log()
        # The survivor adopts them (here by moving the files; in Kubernetes, a job
        # copies the removed pod's volume), then the proxy routes r3 -> r0.
        r0 = cluster.replicas["r0"]
        adopt = r0.state_dir / "adopt"
        adopt.mkdir(parents=True, exist_ok=True)
        for f in r3.state_dir.glob("*.gss"):
            shutil.move(str(f), adopt / f.name)
        r0.proc.send_signal(signal.SIGHUP)
        end = time.monotonic() + 30
        while r0.metric("gradserve_sessions_adopted_total") < held and time.monotonic() < end:
            time.sleep(0.1)
        assert r0.metric("gradserve_sessions_adopted_total") == held, r0.log()[-3000:]
        cluster.routes["r3"] = r0.port
        cluster.route()
        time.sleep(1.0)
    tally = load.tally
    for stream in load.all_streams():
        verify(stream)
    load.close()
    print(
        f"\n[{proxy}] scale 3->4->3: {len(on_r3)} live sessions of r3 adopted by r0, "
        f"{tally.calls} steps, lost {tally.lost}, wrong {tally.wrong}, unknown-outcome "
        f"writes resolved {tally.unknown_outcome}, longest stall {tally.longest_stall:.2f}s"
    )
    assert tally.lost == 0 and tally.wrong == 0 and not tally.errors, tally.errors[:5]


def test_proxy_overhead(make_cluster):
    """Small-op latency (TensorArraySizeV3) direct to a replica and through each proxy:
    figures only (printed), no timing assertion."""
    nginx = make_cluster("nginx")
    haproxy = make_cluster("haproxy")
    report = {}
    for name, target in (
        ("direct", nginx.replicas["r0"].target),
        ("nginx", nginx.proxy.target),
        ("haproxy", haproxy.proxy.target),
    ):
        c = workload.client(target)
        h, flow = c.raw_ops.TensorArrayV3(size=3, dtype=np.float32)
        times = []
        for i in range(400):
            started = time.perf_counter()
            c.raw_ops.TensorArraySizeV3(h, flow)
            if i >= 50:  # warm
                times.append(time.perf_counter() - started)
        report[name] = statistics.median(times) * 1e3
        c.close()
        c._channel.close()
    print(
        "\nsmall-op p50 (TensorArraySizeV3, 350 calls): "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in report.items())
        + f"; overhead nginx +{report['nginx'] - report['direct']:.3f} ms, "
        f"haproxy +{report['haproxy'] - report['direct']:.3f} ms"
    )
    assert all(v > 0 for v in report.values())
