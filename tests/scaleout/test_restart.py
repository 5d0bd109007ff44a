"""A replica restarted with the same --state-dir serves every session again (issue 16):
100 sessions with TensorArrays, gradient arrays and resident tensors, two owners;
SIGTERM; restart; every session reattaches by id with bit-identical state, byte
budgets and owners intact."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest

from gradserve.errors import SessionLostError
from gradserve.server.core import persistence
from tests.scaleout import workload
from tests.scaleout.cluster import Replica
from tests.scaleout.test_persistence import assert_same_state

pytestmark = [pytest.mark.slow, pytest.mark.scaleout]

TOKENS = {"alice": "token-of-alice", "bob": "token-of-bob"}


def _states(directory):
    return {s.id: s for s in map(persistence.read_session, directory.glob("*.gss"))}


def test_100_sessions_come_back_bit_identical_after_sigterm(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{p}:{t}\n" for p, t in TOKENS.items()))
    replica = Replica("r0", tmp_path, "--token-file", str(token_file)).start()
    rng = np.random.default_rng(16)
    sessions = []
    for i in range(100):
        owner = "alice" if i % 2 else "bob"
        c = workload.client(replica.target, token=TOKENS[owner])
        x = rng.standard_normal((2, 5)).astype(np.float32)
        h, flow = c.raw_ops.TensorArrayV3(size=3, dtype=np.float32, clear_after_read=False)
        flow = c.raw_ops.TensorArrayWriteV3(h, 0, x[0], flow)
        flow = c.raw_ops.TensorArrayWriteV3(h, 1, x[1], flow)
        g, gflow = c.raw_ops.TensorArrayGradV3(h, flow, source="gradients")
        c.raw_ops.TensorArrayWriteV3(g, 1, x[0], gflow)
        c.raw_ops.TensorArrayWriteV3(g, 1, x[1], gflow)
        ref = c.put(rng.integers(0, 1 << 30, (3, 4)).astype(np.int64))
        sessions.append((c.session_id, owner, h, flow, g, gflow, x, ref.id, ref.numpy()))
        c._channel.close()  # left open on the server: it is the server's state under test
    held = replica.metric("gradserve_bytes_held")
    assert replica.metric("gradserve_sessions_open") == 100 and held > 0

    assert replica.stop() == 0, replica.log()
    first = _states(replica.state_dir)
    assert len(first) == 100
    replica.start()  # restores, then SIGTERM again: the same state, written again
    assert replica.metric("gradserve_sessions_restored_total") == 100
    assert replica.metric("gradserve_bytes_held") == held
    assert replica.stop() == 0
    second = _states(replica.state_dir)
    assert first.keys() == second.keys()
    for session_id in first:
        assert_same_state(first[session_id], second[session_id])

    replica.start()
    assert replica.metric("gradserve_bytes_held") == held
    for session_id, owner, h, flow, g, gflow, x, ref_id, kept in sessions:
        intruder = "alice" if owner == "bob" else "bob"
        with pytest.raises(SessionLostError):  # another principal: as if it did not exist
            workload.client(replica.target, session_id=session_id, token=TOKENS[intruder])
        c = workload.client(replica.target, session_id=session_id, token=TOKENS[owner])
        got = [c.raw_ops.TensorArrayReadV3(h, i, flow, np.float32) for i in (0, 1)]
        assert got[0].tobytes() == x[0].tobytes() and got[1].tobytes() == x[1].tobytes()
        summed = c.raw_ops.TensorArrayReadV3(g, 1, gflow, np.float32)
        assert summed.tobytes() == (x[0] + x[1]).tobytes()
        assert c.get(ref_id).tobytes() == kept.tobytes()
        c.close()  # reattached: leaves the session open
    assert replica.stop() == 0


def test_a_crash_loses_only_what_came_after_the_last_periodic_snapshot(tmp_path):
    replica = Replica("r0", tmp_path, "--snapshot-interval", "0.2").start()
    c = workload.client(replica.target)
    h, flow = c.raw_ops.TensorArrayV3(size=2, dtype=np.float32, clear_after_read=False)
    flow = c.raw_ops.TensorArrayWriteV3(h, 0, np.ones(3, np.float32), flow)
    seen = replica.metric("gradserve_snapshots_total")
    end = time.monotonic() + 30
    while replica.metric("gradserve_snapshots_total") < seen + 2 and time.monotonic() < end:
        time.sleep(0.05)  # a snapshot that began after the write has finished
    replica.stop(signal.SIGKILL)
    replica.start()
    again = workload.client(replica.target, session_id=c.session_id)
    assert np.array_equal(again.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32), np.ones(3))
    replica.stop(signal.SIGKILL)  # again at once: the restored files are still there
    replica.start()
    third = workload.client(replica.target, session_id=c.session_id)
    assert np.array_equal(third.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32), np.ones(3))
    assert replica.stop() == 0


def test_a_session_closed_or_expired_does_not_come_back_after_a_crash(tmp_path):
    """With periodic snapshots, a session closed (or expired) after the last one came
    back after a crash, holding its bytes and its principal's session places until
    its TTL (helper-71: alice locked out by --max-sessions-per-principal). Its file
    goes when it ends."""
    replica = Replica("r0", tmp_path, "--snapshot-interval", "0.2", "--session-ttl", "2").start()
    closed, expired, kept = (workload.client(replica.target) for _ in range(3))
    for c in (closed, expired, kept):
        c.put(np.ones(1000, np.float32))
    seen = replica.metric("gradserve_snapshots_total")
    end = time.monotonic() + 30
    while replica.metric("gradserve_snapshots_total") < seen + 2 and time.monotonic() < end:
        time.sleep(0.05)  # all three are in a snapshot
    assert len(list(replica.state_dir.glob("*.gss"))) == 3
    closed.close()
    end = time.monotonic() + 30
    while replica.metric("gradserve_sessions_open") > 1 and time.monotonic() < end:
        kept.keep_alive()  # ``expired`` sits idle past its TTL
        time.sleep(0.2)
    assert replica.metric("gradserve_sessions_open") == 1
    replica.stop(signal.SIGKILL)  # at once: no snapshot since
    assert [p.name for p in replica.state_dir.glob("*.gss")] == [
        persistence.file_name(kept.session_id)
    ]
    replica.start()
    assert replica.metric("gradserve_sessions_restored_total") == 1
    assert replica.stop() == 0


def test_a_snapshot_that_does_not_fit_fails_cleanly(tmp_path):
    """SIGTERM with more to save than the state dir's filesystem holds (a 1 MiB tmpfs):
    the replica says so and exits 1, and leaves no partial file behind."""
    state = tmp_path / "state-r0"
    state.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(state)])
    if mounted.returncode != 0:
        pytest.skip("no permission to mount a tmpfs here")
    try:
        replica = Replica("r0", tmp_path).start()
        c = workload.client(replica.target)
        c.put(np.ones(1 << 19, np.float32))  # 2 MiB
        assert replica.stop() == 1
        assert "NOT saved" in replica.log() and "No space left" in replica.log()
        assert [p.name for p in state.iterdir()] == [persistence.LOCK_NAME]  # no partial file
    finally:
        subprocess.run(["umount", str(state)])
