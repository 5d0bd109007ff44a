"""Session snapshots (``server.core.persistence``): a round trip keeps every bit and
flag; a corrupt, truncated, foreign or newer file is reported and skipped, never
half-loaded; a write that runs out of space leaves the previous file intact."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from gradserve import dtypes
from gradserve.errors import FailedPreconditionError, NotFoundError
from gradserve.server.core import persistence
from gradserve.server.core.sessions import (
    TENSOR_RECORD_BYTES,
    HandedOutReply,
    Session,
    SessionStore,
)


def populated(store: SessionStore, principal: str = "alice", seed: int = 0):
    """A session with a bit of everything: arrays of several dtypes (strings and
    bfloat16 too), read, cleared and unwritten slots, a grad array with summed writes,
    a closed array, resident tensors."""
    rng = np.random.default_rng(seed)
    s = store.create(principal)
    h, ta = s.create_tensor_array(
        tensor_array_name="fwd",
        dtype=np.float32,
        size=4,
        element_shape=(3,),
        clear_after_read=False,
    )
    ta.write(0, rng.standard_normal(3).astype(np.float32))
    ta.write(2, rng.standard_normal(3).astype(np.float32))
    ta.read(0)
    g, grad = s.grad_array(h, "gradients")
    grad.write(0, np.ones(3, np.float32))
    grad.write(0, np.full(3, 0.25, np.float32))
    g2, grad2 = s.grad_array(h, "other")
    grad2.read(2)  # clears: the flag must survive
    h3, strings = s.create_tensor_array(
        tensor_array_name="", dtype=dtypes.STRING, size=2, dynamic_size=True
    )
    strings.write(3, np.array([b"a\x00b", "\u00e9".encode(), b""], dtype=object))
    h4, bf = s.create_tensor_array(
        tensor_array_name="bf",
        dtype=np.dtype(ml_dtypes.bfloat16),
        size=1,
        identical_element_shapes=True,
    )
    bf.write(0, rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16))
    h5, closed = s.create_tensor_array(tensor_array_name="c", dtype=np.int64, size=1)
    closed.close()
    s.put(rng.integers(-5, 5, (2, 3)).astype(np.int8))
    s.put(np.array([[1 + 2j]], np.complex128))
    s.put(np.array([b"kept"], dtype=object))
    s.put(np.zeros((0, 7), np.float64))
    s.put(s.get(s.put(rng.standard_normal(5).astype(np.float32))))  # one array, two ids
    return s


def same(a, b) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and (
            list(a.flat) == list(b.flat) if a.dtype == dtypes.STRING else a.tobytes() == b.tobytes()
        )
    )


def assert_same_state(x, y) -> None:
    assert (x.id, x.principal, x.name_counter) == (y.id, y.principal, y.name_counter)
    assert abs(x.idle_seconds_left - y.idle_seconds_left) < 5
    assert x.grads == y.grads and x.resident.keys() == y.resident.keys()
    for k in x.resident:
        assert same(x.resident[k], y.resident[k]), k
    assert x.arrays.keys() == y.arrays.keys()
    for handle, a in x.arrays.items():
        b = y.arrays[handle]
        fields = [f for f in vars(a) if f != "slots"]
        assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
        assert a.slots.keys() == b.slots.keys()
        for i, sa in a.slots.items():
            sb = b.slots[i]
            assert (sa.shape, sa.written, sa.read, sa.cleared) == (
                sb.shape,
                sb.written,
                sb.read,
                sb.cleared,
            )
            assert (sa.value is None) == (sb.value is None)
            if sa.value is not None:
                assert same(sa.value, sb.value)


def test_round_trip_keeps_every_bit_flag_owner_and_byte(tmp_path):
    store = SessionStore(replica_id="r1", max_session_bytes=1 << 20)
    sessions = [populated(store, principal, seed) for seed, principal in enumerate("ab" * 3)]
    report = persistence.write_snapshot(store.export_states(), tmp_path)
    assert (report.written, report.failed) == (6, 0) and report.bytes > 0
    before = {s.id: s.export_state(store.idle_timeout) for s in sessions}

    other = SessionStore(replica_id="r2", max_session_bytes=1 << 20)  # an adopter
    restored = persistence.restore_dir(other, tmp_path)
    assert (restored.restored, restored.rejected) == (6, 0)
    assert not list(tmp_path.iterdir())  # held by the server now, not on disk
    for s in sessions:
        back = other.get(s.id, s.principal)  # same id, same owner
        assert back.budget.used == s.budget.used > 0
        assert_same_state(before[s.id], back.export_state(other.idle_timeout))
    assert other.budget.used == store.budget.used
    assert other.principal_budget("a").used == store.principal_budget("a").used
    with pytest.raises(Exception, match="session not found"):
        other.get(sessions[0].id, "b")  # another principal: as if it did not exist


def test_a_restored_array_behaves_as_before(tmp_path):
    store = SessionStore()
    s = store.create()
    h, ta = s.create_tensor_array(
        tensor_array_name="t", dtype=np.float32, size=2, element_shape=(2,)
    )
    ta.write(0, np.ones(2, np.float32))
    ta.read(0)  # clear_after_read: a second read fails
    persistence.write_snapshot(store.export_states(), tmp_path)
    back = SessionStore()
    persistence.restore_dir(back, tmp_path)
    again = back.get(s.id).tensor_array(h)
    with pytest.raises(Exception, match="twice because it was cleared"):
        again.read(0)
    with pytest.raises(Exception, match="already been read"):
        again.write(0, np.ones(2, np.float32))
    assert np.array_equal(again.read(1), np.zeros(2, np.float32))  # unwritten: zeros
    _, t2 = back.get(s.id).create_tensor_array(tensor_array_name="t", dtype=np.float32, size=1)
    assert t2.name == "t_2"  # the name counter came back too


@pytest.mark.parametrize(
    "damage",
    ["flip a payload byte", "truncate", "foreign file", "newer version", "empty"],
)
def test_a_bad_file_is_reported_and_skipped_never_half_loaded(tmp_path, damage, caplog):
    store = SessionStore()
    good, bad = populated(store, seed=1), populated(store, seed=2)
    persistence.write_snapshot(store.export_states(), tmp_path)
    path = tmp_path / persistence.file_name(bad.id)
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-3] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "foreign file":
        data = bytearray(b"PK\x03\x04 not a snapshot at all" * 4)
    elif damage == "newer version":
        data[8] = persistence.FORMAT_VERSION + 1
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    back = SessionStore()
    report = persistence.restore_dir(back, tmp_path)
    assert (report.restored, report.rejected) == (1, 1)
    assert len(back) == 1 and back.get(good.id, "alice")
    assert back.budget.used == good.budget.used  # nothing of the bad one charged
    assert path.with_name(path.name + persistence.REJECTED_SUFFIX).exists()
    assert "skipped" in caplog.text and path.name in caplog.text


def test_a_file_set_aside_before_is_kept(tmp_path):
    """A second bad file of the same session is set aside next to the first one,
    not over it: both stay for a person to look at."""
    store = SessionStore()
    s = populated(store)
    path = tmp_path / persistence.file_name(s.id)
    for junk in (b"first damage", b"second damage"):
        path.write_bytes(junk)
        assert persistence.restore_dir(SessionStore(), tmp_path).rejected == 1
        assert not path.exists()
    aside = path.with_name(path.name + persistence.REJECTED_SUFFIX)
    assert aside.read_bytes() == b"first damage"
    assert aside.with_name(aside.name + ".1").read_bytes() == b"second damage"


def test_a_directory_that_cannot_be_made_fails_every_session_and_raises_nothing(tmp_path):
    """Its parent replaced by a file: each session counts as not saved (the server's
    exit code 1), where the error used to escape the shutdown (exit code 2) and, in a
    periodic snapshot, count no failure."""
    store = SessionStore()
    populated(store, seed=1), populated(store, seed=2)
    (tmp_path / "parent").write_bytes(b"a file, not a directory")
    report = persistence.write_snapshot(store.export_states(), tmp_path / "parent" / "state")
    assert (report.written, report.failed) == (0, 2)
    assert "Not a directory" in report.errors[0]


def test_one_server_per_directory(tmp_path):
    held = persistence.lock_directory(tmp_path / "state")
    try:
        with pytest.raises(persistence.DirectoryInUseError, match=f"pid {os.getpid()}"):
            persistence.lock_directory(tmp_path / "state")
    finally:
        os.close(held)
    os.close(persistence.lock_directory(tmp_path / "state"))  # free again


def test_one_array_under_two_ids_is_written_once_and_restored_as_one(tmp_path):
    """An array and its alias (StopGradient of a resident tensor, kept) are charged
    once, with a record per id: written twice and read back as two arrays, a session
    that held one 600 KiB array under two ids did not fit its 1 MiB limit again."""
    store = SessionStore(max_session_bytes=1 << 20)
    s = store.create()
    first = s.put(np.arange(150 << 10, dtype=np.float32))
    second = s.put(s.get(first))
    assert s.budget.used == (600 << 10) + 2 * TENSOR_RECORD_BYTES
    report = persistence.write_snapshot(store.export_states(), tmp_path)
    assert report.bytes < (1200 << 10)
    other = SessionStore(max_session_bytes=1 << 20)
    assert persistence.restore_dir(other, tmp_path).restored == 1
    back = other.get(s.id)
    assert back.budget.used == s.budget.used
    assert back.get(first) is back.get(second)
    np.testing.assert_array_equal(back.get(second), np.arange(150 << 10, dtype=np.float32))
    back.delete([first])  # its record goes; the array stays, as the alias's
    assert back.budget.used == (600 << 10) + TENSOR_RECORD_BYTES
    np.testing.assert_array_equal(back.get(second), np.arange(150 << 10, dtype=np.float32))
    back.delete([second])
    assert back.budget.used == 0


def test_a_restored_session_charges_what_the_live_one_did(tmp_path):
    """After its first id is deleted an alias holds the array alone; and distinct
    tensors of no bytes, written one after another at one offset, stay distinct."""
    store = SessionStore()
    s = store.create()
    first = s.put(np.ones(1000, np.float32))
    s.put(s.get(first))
    s.delete([first])
    empties = [s.put(np.zeros(0, np.float32)) for _ in range(2)]
    persistence.write_snapshot(store.export_states(), tmp_path)
    other = SessionStore()
    persistence.restore_dir(other, tmp_path)
    back = other.get(s.id)
    assert back.budget.used == s.budget.used == 4000 + 3 * TENSOR_RECORD_BYTES
    assert back.get(empties[0]) is not back.get(empties[1])
    back.delete(empties[:1])
    s.delete(empties[:1])
    assert back.budget.used == s.budget.used


def test_restore_over_a_byte_limit_charges_nothing(tmp_path):
    store = SessionStore()
    s = populated(store)
    persistence.write_snapshot(store.export_states(), tmp_path)
    tight = SessionStore(max_server_bytes=s.budget.used - 1)
    report = persistence.restore_dir(tight, tmp_path)
    assert report.rejected == 1 and len(tight) == 0 and tight.budget.used == 0


def test_a_full_disk_fails_cleanly_and_keeps_the_previous_file(tmp_path, monkeypatch):
    store = SessionStore()
    s = store.create()
    s.put(np.ones(10, np.float32))
    persistence.write_snapshot(store.export_states(), tmp_path)
    old = (tmp_path / persistence.file_name(s.id)).read_bytes()
    s.put(np.ones(1 << 16, np.float32))
    written = [0]
    real = persistence._write_all

    def fill_up(fh, data, digest):
        written[0] += 1
        if written[0] > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fh, data, digest)

    monkeypatch.setattr(persistence, "_write_all", fill_up)
    report = persistence.write_snapshot(store.export_states(), tmp_path)
    assert (report.written, report.failed) == (0, 1) and "No space left" in report.errors[0]
    assert [p.name for p in tmp_path.iterdir()] == [persistence.file_name(s.id)]
    assert (tmp_path / persistence.file_name(s.id)).read_bytes() == old
    assert persistence.read_session(tmp_path / persistence.file_name(s.id)).resident


def test_a_restored_session_whose_write_fails_keeps_its_file_as_restored(tmp_path, monkeypatch):
    """Without periodic snapshots a restore sets the files aside: a crash then loses
    the sessions (no older state comes back), but a snapshot that cannot write one
    puts its file back, as a failed write keeps the previous file. The file used to be
    removed at the restore: the session was then in no file at all (exit code 1)."""
    store = SessionStore()
    kept, grown = store.create(), store.create()
    kept.put(np.ones(3, np.float32))
    grown.put(np.ones(5, np.float32))
    persistence.write_snapshot(store.export_states(), tmp_path)
    old = (tmp_path / persistence.file_name(grown.id)).read_bytes()

    back = SessionStore()
    report = persistence.restore_dir(back, tmp_path, remove=False)
    assert report.restored == 2
    persistence.set_aside(report.files)  # (the server serves them now)
    assert not list(persistence.snapshot_files(tmp_path))  # not restored a second time
    back.get(grown.id).put(np.ones(1 << 16, np.float32))
    real = persistence.write_session

    def full_for_grown(state, path, to_host):
        if state.id == grown.id:  # any failure, its encoding's too (a GPU copy)
            raise RuntimeError("cudaErrorIllegalAddress")
        return real(state, path, to_host)

    monkeypatch.setattr(persistence, "write_session", full_for_grown)
    report = persistence.write_snapshot(back.export_states(), tmp_path)
    assert (report.written, report.failed) == (1, 1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(persistence.file_name(s.id) for s in (kept, grown))
    assert (tmp_path / persistence.file_name(grown.id)).read_bytes() == old


def test_what_a_crash_left_set_aside_is_not_restored(tmp_path):
    store = SessionStore()
    store.create()
    persistence.write_snapshot(store.export_states(), tmp_path)
    report = persistence.restore_dir(SessionStore(), tmp_path, remove=False)
    persistence.set_aside(report.files)
    # (a crash here: no snapshot) the next start clears what was set aside, restores nothing
    persistence.clear_set_aside(tmp_path)
    assert persistence.restore_dir(SessionStore(), tmp_path).restored == 0
    assert list(tmp_path.iterdir()) == []


@contextlib.contextmanager
def small_filesystem(path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` for the block (root only: the test is
    skipped where it cannot mount)."""
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    if done.returncode != 0:
        pytest.skip("no permission to mount a tmpfs here (a container without CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)])


def test_a_snapshot_larger_than_a_real_small_filesystem(tmp_path):
    """The same on a 1 MiB tmpfs (root only: mount)."""
    with small_filesystem(tmp_path / "small", "1m") as mount:
        store = SessionStore()
        small, big = store.create(), store.create()
        small.put(np.ones(1000, np.float32))
        assert persistence.write_snapshot(store.export_states(), mount).written == 2
        before = {p.name: p.read_bytes() for p in mount.iterdir()}
        big.put(np.ones(1 << 19, np.float32))  # 2 MiB on a 1 MiB filesystem
        report = persistence.write_snapshot(store.export_states(), mount)
        assert (report.written, report.failed) == (1, 1)
        after = {p.name: p.read_bytes() for p in mount.iterdir()}
        assert after.keys() == before.keys()  # no temporary file left behind
        big_file = persistence.file_name(big.id)
        assert after[big_file] == before[big_file]  # the previous snapshot of it, intact
        back = SessionStore()
        assert persistence.restore_dir(back, mount).restored == 2
        assert back.get(small.id).budget.used == 4000 + TENSOR_RECORD_BYTES
        assert back.get(big.id).budget.used == 0  # its previous file: before the big put


def test_a_full_state_disk_still_takes_its_lock(tmp_path):
    """A server must come up on a full state disk to restore from it: writing the pid
    into a new lock file failed (ENOSPC) and the start with it. Root only (mount)."""
    with small_filesystem(tmp_path / "small", "64k") as mount:
        with pytest.raises(OSError), open(mount / "filler", "wb") as fh:
            while True:
                fh.write(bytes(4096))
                fh.flush()
        held = persistence.lock_directory(mount)
        try:
            with pytest.raises(persistence.DirectoryInUseError):
                persistence.lock_directory(mount)
        finally:
            os.close(held)


def test_tapes_are_not_persisted_and_the_rest_is(tmp_path, caplog):
    store = SessionStore()
    s = populated(store)
    s.start_tape(persistent=True, watch_accessed_variables=True)
    report = persistence.write_snapshot(store.export_states(), tmp_path)
    assert (report.written, report.tapes_dropped) == (1, 1)
    assert "tape(s) not persisted" in caplog.text
    back = SessionStore()
    assert persistence.restore_dir(back, tmp_path).restored == 1
    restored = back.get(s.id, "alice")
    assert restored.budget.used == s.budget.used and not restored._tapes


def test_a_session_busy_at_a_snapshot_keeps_its_whole_ttl():
    """A call running is not idle time: a session busy past its TTL (a long upload)
    was saved with no time left, and after a crash its restore expired it at once
    (a review helper)."""
    store = SessionStore()
    s = populated(store)
    ended = s.call_started()
    s.last_used -= 100.0  # the call began long ago
    assert s.export_state(idle_timeout=60.0).idle_seconds_left == 60.0
    ended()
    assert s.export_state(idle_timeout=60.0).idle_seconds_left == pytest.approx(60.0, abs=1)
    s.last_used -= 100.0
    assert s.export_state(idle_timeout=60.0).idle_seconds_left == 0.0


def test_a_tape_spent_by_a_gradient_not_yet_replied_is_lost_not_released(tmp_path):
    """A gradient's reply that a restart cut off never reached the client, which
    asks again: the tape it spent is restored as lost (``TAPE_LOST``, as a live one),
    not as released; one released for good stays released."""
    store = SessionStore()
    s = populated(store)
    spent = s.start_tape(persistent=False, watch_accessed_variables=True)
    gone = s.start_tape(persistent=False, watch_accessed_variables=True)
    assert s.spend_tape(spent) and s.spend_tape(gone)
    s.free_spent_tape(gone)
    state = s.export_state(idle_timeout=60.0)
    assert spent.id in state.lost_tapes and spent.id not in state.released_tapes
    assert gone.id in state.released_tapes and gone.id not in state.lost_tapes
    report = persistence.write_snapshot(store.export_states(), tmp_path)
    assert report.tapes_dropped == 1
    back = SessionStore()
    assert persistence.restore_dir(back, tmp_path).restored == 1
    restored = back.get(s.id, "alice")
    with pytest.raises(NotFoundError, match="was lost"):
        restored.tape(spent.id)
    with pytest.raises(FailedPreconditionError, match="released"):
        restored.tape(gone.id)


def test_a_tape_that_spans_a_restart_is_lost_not_started_again_empty(tmp_path):
    """The SDK proposes its tape's id on every call (``+ID``: start it if it does not
    exist). After a restart the tape, not in the snapshot, was started again empty
    under that id, and ``tape.gradient`` gave the gradient of what came after the
    restart alone: None, or zeros (a review helper). Now the restored session
    refuses the id (``TAPE_LOST``), across a second restart too; a released id stays
    released; a new tape works."""
    import socket

    import gradserve
    from gradserve.errors import FailedPreconditionError, NotFoundError
    from gradserve.server import run_server

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with run_server(host="127.0.0.1", port=port, state_dir=str(tmp_path), grace=0):
        client = gradserve.Client(f"127.0.0.1:{port}", keepalive=False, shared_memory=False)
        w = client.put(np.arange(3, dtype=np.float32))
        with client.gradient_tape() as spent:
            h0, f0 = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
            r0 = client.raw_ops.TensorArrayReadV3(
                h0, 0, client.raw_ops.TensorArrayWriteV3(h0, 0, w, f0), np.float32
            )
        spent.gradient(r0, w)
        tape = client.gradient_tape(persistent=True)
        tape.__enter__()
        h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32, clear_after_read=False)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, w, flow)
    for _ in range(2):  # restarts
        with run_server(host="127.0.0.1", port=port, state_dir=str(tmp_path), grace=0):
            with pytest.raises(NotFoundError, match="was lost") as info:
                client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32)
            assert info.value.reason == "TAPE_LOST"
            with pytest.raises(FailedPreconditionError, match="released"):
                gradserve.Client(
                    f"127.0.0.1:{port}", session_id=client.session_id, keepalive=False
                )._call("ReleaseTape", _release(spent.id), tapes=[])
    with run_server(host="127.0.0.1", port=port, state_dir=str(tmp_path), grace=0):
        assert tape.release() == 0  # (a finally: release() must not hide the error)
        tape.__exit__(None, None, None)
        with client.gradient_tape() as fresh:
            y = client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32)  # (its write: not here)
            h2, f2 = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
            f2 = client.raw_ops.TensorArrayWriteV3(h2, 0, w, f2)
            z = client.raw_ops.TensorArrayReadV3(h2, 0, f2, np.float32)
        assert fresh.gradient([y, z], [w]) == [pytest.approx(np.ones(3, np.float32))]
        client.close()


def _release(tape_id):
    from gradserve.v1 import tape_pb2

    return tape_pb2.ReleaseTapeRequest(tape_id=tape_id)


def test_gpu_tensors_are_saved_through_the_hosts_copy(tmp_path):
    """A resident tensor on the GPU (CuPy's stand-in, which refuses an implicit host
    conversion as CuPy does) is written through ``Compute.to_host``'s copy and comes
    back as a host array that a later LSTM op moves to the GPU again."""
    from tests.kernels import fake_cupy

    with fake_cupy.installed(None) as cupy:
        from gradserve.kernels.compute import Compute

        store = SessionStore()
        s = store.create()
        host = np.arange(12, dtype=np.float32).reshape(3, 4)
        tensor_id = s.put(cupy.asarray(host))
        with pytest.raises(TypeError):
            np.asarray(s.get(tensor_id))  # as CuPy: no implicit copy
        compute = Compute(sys.modules["gradserve.kernels.backend_cuda"])
        report = persistence.write_snapshot(store.export_states(), tmp_path, compute.to_host)
        assert report.written == 1
    back = SessionStore()
    persistence.restore_dir(back, tmp_path)
    got = back.get(s.id).get(tensor_id)
    assert isinstance(got, np.ndarray) and got.tobytes() == host.tobytes()


# ------------------------------------------------------------ hostile files (review)
def _crafted(meta: dict, data: bytes = b"") -> bytes:
    """A file that passes magic, version, length and checksum (a checksum is no MAC:
    whoever writes the contents writes it too)."""
    import hashlib
    import json
    import struct

    m = json.dumps(meta).encode()
    payload = struct.pack("<Q", len(m)) + m + data
    digest = hashlib.sha256(payload).digest()
    header = persistence._HEADER.pack(
        persistence.MAGIC, persistence.FORMAT_VERSION, 0, len(payload), digest
    )
    return header + payload


def _meta(**kw) -> dict:
    return {
        "id": kw.get("id", "r0.crafted"),
        "principal": "anonymous",
        "name_counter": 0,
        "idle_seconds_left": 100,
        "arrays": kw.get("arrays", []),
        "grads": kw.get("grads", []),
        "resident": kw.get("resident", []),
    }


def test_a_string_count_past_its_bytes_is_refused_before_allocating(tmp_path):
    bomb = {"dtype": "string", "shape": [1 << 40], "offset": 0, "nbytes": 0}
    (tmp_path / "a.gss").write_bytes(_crafted(_meta(resident=[{"id": "t", "value": bomb}])))
    with pytest.raises(persistence.SnapshotError, match="strings cannot fit"):
        persistence.read_session(tmp_path / "a.gss")


def test_contents_no_op_could_make_are_refused(tmp_path):
    slot = {
        "index": 99,
        "shape": [3, 3],
        "written": True,
        "read": False,
        "cleared": False,
        "value": {"dtype": "int8", "shape": [2], "offset": 0, "nbytes": 2},
    }
    array = {
        "handle": "h",
        "name": "ta",
        "dtype": "float32",
        "size": 100,
        "element_shape": [7],
        "identical_element_shapes": False,
        "dynamic_size": False,
        "clear_after_read": False,
        "multiple_writes_aggregate": False,
        "is_grad": False,
        "marked_size": -1,
        "gradients_disallowed": False,
        "closed": False,
        "slots": [slot],
    }
    data = np.arange(2, dtype=np.int8).tobytes()
    (tmp_path / "b.gss").write_bytes(_crafted(_meta(arrays=[array]), data))
    store = SessionStore()
    report = persistence.restore_dir(store, tmp_path)
    assert (report.restored, report.rejected) == (0, 1)
    assert "int8 value in a float32 array" in report.errors[0]
    assert store.budget.used == 0


def test_restored_tensors_own_their_memory(tmp_path):
    store = SessionStore()
    session = store.create()
    big, small = np.ones(1 << 20, np.float32), np.arange(4, dtype=np.float32)
    ids = session.put(big), session.put(small)
    persistence.write_snapshot(store.export_states(), tmp_path)
    restored = SessionStore()
    persistence.restore_dir(restored, tmp_path)
    value = restored.get(session.id).get(ids[1])
    np.testing.assert_array_equal(value, small)
    assert value.base is None or value.base.nbytes == small.nbytes  # no view of the file


def test_a_session_keeps_its_most_recently_closed_arrays_only():
    """A closed array's handle still says "already been closed" (TensorFlow's error),
    but a session that makes and closes an array per training step must not grow for
    ever: past ``MAX_CLOSED_ARRAYS`` the oldest closed ones are forgotten, records and
    charges included. A grad array of a forgotten forward stays an array of its own,
    and the session still round-trips through a snapshot."""
    from gradserve.errors import InvalidArgumentError, NotFoundError
    from gradserve.server.core.sessions import MAX_CLOSED_ARRAYS

    store = SessionStore()
    s = store.create()
    first, ta = s.create_tensor_array(tensor_array_name="fwd", dtype=np.float32, size=1)
    ta.write(0, np.ones(2, np.float32))
    grad_handle, grad = s.grad_array(first, "gradients")
    s.close_tensor_array(first)
    handles = [first]
    for _ in range(MAX_CLOSED_ARRAYS):
        h, _ = s.create_tensor_array(tensor_array_name="", dtype=np.float32, size=1)
        s.close_tensor_array(h)
        handles.append(h)
    with pytest.raises(NotFoundError, match="does not exist"):
        s.tensor_array(first).size()  # the oldest closed one is forgotten
    with pytest.raises(InvalidArgumentError, match="already been closed"):
        s.tensor_array(handles[1]).size()  # the rest say so, as in TensorFlow
    grad.write(0, np.ones(2, np.float32))  # its grad array lives on
    assert s.budget.used == s.record_bytes() + 8
    assert len(list(s._arrays)) == MAX_CLOSED_ARRAYS + 1  # the closed ones and the grad
    assert s.budget.used < 300 * 1024  # however many were closed before
    (state,) = store.export_states()
    back = SessionStore()
    back.restore(state)
    (again,) = back.export_states()
    assert_same_state(again, state)
    assert back.get(s.id).budget.used == s.budget.used
    assert len(back.get(s.id)._closed_arrays) == MAX_CLOSED_ARRAYS  # and it goes on bounded
    store.close(s.id)
    assert store.budget.used == 0


def test_a_fifo_named_like_a_session_file_is_refused_not_waited_on(tmp_path):
    """Opening a FIFO blocks until a writer comes: one named ``*.gss`` in the state
    directory (or the adopt directory) hung the restore, or the adoption and then the
    drain, which SIGTERM could not end (found by a review helper). A session file is
    now opened without blocking and must be a regular file."""
    import threading

    fifo = tmp_path / f"session-fifo{persistence.SUFFIX}"
    os.mkfifo(fifo)
    outcome = []

    def read() -> None:
        try:
            persistence.read_session(fifo)
        except persistence.SnapshotError as e:
            outcome.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # (a blocked open: let the thread go before failing)
        with open(fifo, "wb"):
            pass
        pytest.fail("read_session waited on a FIFO")
    assert outcome and "not a regular file" in outcome[0]


def test_a_snapshot_sees_a_clearing_read_whole_or_not_at_all(monkeypatch):
    """A read clears its element, then keeps its output: a snapshot taken between the
    two steps held neither, so after a crash the value was gone from both (found by a
    review helper with --snapshot-interval 0.02). The snapshot now waits for the op
    (``SnapshotGate``)."""
    import threading

    import gradserve
    from gradserve.server import run_server
    from gradserve.server.core.ops import tensor_array_ops as ta_ops

    read = ta_ops.read
    states = []

    def read_then_snapshot(session, *args):
        value = read(session, *args)  # the element is cleared now
        snapshot = threading.Thread(target=lambda: states.append(session.export_state(60.0)))
        snapshot.start()
        snapshot.join(0.3)  # (with the gate it waits for this op, which is not done)
        return value

    monkeypatch.setattr(ta_ops, "read", read_then_snapshot)
    with run_server(host="127.0.0.1", port=0) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}") as client:
            h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
            flow = client.raw_ops.TensorArrayWriteV3(h, 0, np.arange(3, dtype=np.float32), flow)
            kept = client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32, keep=True)
            deadline = time.monotonic() + 10
            while not states and time.monotonic() < deadline:
                time.sleep(0.01)
    assert states, "the snapshot did not finish"
    np.testing.assert_array_equal(states[0].resident[kept.id], [0.0, 1.0, 2.0])


def test_a_snapshot_waits_for_ops_inside_the_gate_but_not_forever():
    """An op inside the gate holds a snapshot back; one that does not end within the
    timeout lets the snapshot go on (the final snapshot of a drain must not hang on a
    stuck op). Ops that come while a snapshot waits are not held back: each would hold
    a lane thread, and light ops of every session stalled behind one slow op."""
    import threading

    from gradserve.server.core.snapshot_gate import SnapshotGate

    gate = SnapshotGate()
    with gate.op():
        with gate.snapshot(timeout=0.2) as whole:
            pass
        assert not whole  # the op was still inside: it went on after the timeout
    inside = gate.op()
    inside.__enter__()
    snapshot_done = []

    def snapshot() -> None:
        with gate.snapshot(timeout=5) as whole:
            snapshot_done.append(whole)

    taker = threading.Thread(target=snapshot)
    taker.start()
    time.sleep(0.1)
    with gate.op():  # another op, while the snapshot waits: not held back
        assert snapshot_done == []
    inside.__exit__(None, None, None)
    taker.join(5)
    assert snapshot_done == [True]


def test_a_restored_session_forgets_the_closed_arrays_in_the_order_they_were_closed(
    tmp_path, monkeypatch
):
    """A session keeps the most recently closed arrays (``MAX_CLOSED_ARRAYS``); a
    restored one ordered them as they were made, not closed, and so forgot another
    array first: its handle was NOT_FOUND where the live session said "already
    closed" (found by a review helper). The close order is in the snapshot now."""
    from gradserve.server.core import sessions

    monkeypatch.setattr(sessions, "MAX_CLOSED_ARRAYS", 2)
    store = SessionStore()
    s = store.create()
    first, _ = s.create_tensor_array(tensor_array_name="", dtype=np.float32, size=1)
    second, _ = s.create_tensor_array(tensor_array_name="", dtype=np.float32, size=1)
    s.close_tensor_array(second)
    s.close_tensor_array(first)
    persistence.write_snapshot(store.export_states(), tmp_path)
    back = SessionStore()
    persistence.restore_dir(back, tmp_path)
    for session in (s, back.get(s.id)):
        third, _ = session.create_tensor_array(tensor_array_name="", dtype=np.float32, size=1)
        session.close_tensor_array(third)  # past the limit: the first closed goes
        with pytest.raises(Exception, match="does not exist"):
            session.tensor_array(second)
        assert session.tensor_array(first).closed  # still known: "already closed"


def test_a_snapshot_that_stopped_waiting_for_an_op_says_so(tmp_path, monkeypatch, caplog):
    """A snapshot that waited its time for an op and went on was written without a
    word: an operator could not tell that a file may hold an op half done."""
    from gradserve.server.core import snapshot_gate

    monkeypatch.setattr(snapshot_gate, "SNAPSHOT_WAIT_SECONDS", 0.05)
    store = SessionStore()
    stuck, calm = store.create(), store.create()
    with stuck.changing():
        states = store.export_states()
    assert {s.id: s.torn for s in states} == {stuck.id: True, calm.id: False}
    with caplog.at_level("WARNING", logger=persistence.__name__):
        report = persistence.write_snapshot(states, tmp_path)
    assert (report.written, report.torn) == (2, 1)
    assert "1 session(s) taken while an op still changed them" in caplog.text


def test_a_snapshot_does_not_wait_for_gradients(monkeypatch):
    """Gradients inside the snapshot gate (61e7079) starved snapshots: two overlapping
    calls in one session kept the gate from emptying, and each snapshot waited its
    10 s and was torn anyway (a review helper: 3 snapshots in 6 s, 2 torn, against
    202 and 0). A snapshot now goes on while Gradients runs."""
    import threading

    import gradserve
    from gradserve.server import run_server
    from gradserve.server.transport import tape_handlers

    real = tape_handlers.gradients.gradients
    taken_during_the_op = []
    states = []

    def gradients_then_snapshot(session, *args, **kw):
        grads = real(session, *args, **kw)
        snapshot = threading.Thread(target=lambda: states.append(session.export_state(60.0)))
        snapshot.start()
        snapshot.join(0.3)  # (with the gate it waits for this op, which is not done)
        taken_during_the_op.append(bool(states))
        return grads

    monkeypatch.setattr(tape_handlers.gradients, "gradients", gradients_then_snapshot)
    with run_server(host="127.0.0.1", port=0) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}") as client:
            x = client.put(np.ones(3, np.float32))
            with client.gradient_tape() as tape:
                h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
                flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
                r = client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32)
            np.testing.assert_array_equal(tape.gradient(r, x), np.ones(3, np.float32))
            deadline = time.monotonic() + 10
            while not states and time.monotonic() < deadline:
                time.sleep(0.01)
    assert taken_during_the_op == [True] and not states[0].torn


def test_the_state_directory_and_its_files_are_the_servers_own(tmp_path):
    """Session files hold session ids and every tensor's bytes: at the usual umask the
    server made the directory 0755 and the files 0644, readable by any local user
    (a review helper). Now 0700 and 0600; a file left by an earlier server is made
    private when it is written again."""
    import stat as stat_mod

    old = os.umask(0o022)
    try:
        directory = tmp_path / "state"
        os.close(persistence.lock_directory(directory))
        (directory / persistence.LOCK_NAME).chmod(0o644)  # as an earlier server left it
        os.close(persistence.lock_directory(directory))
        store = SessionStore()
        s = populated(store)
        stale = directory / persistence.file_name(s.id)
        stale.write_bytes(b"old")
        stale.chmod(0o644)
        assert persistence.write_snapshot(store.export_states(), directory).written == 1
    finally:
        os.umask(old)

    def mode(path):
        return stat_mod.S_IMODE(path.stat().st_mode)

    assert mode(directory) == 0o700
    assert mode(directory / persistence.LOCK_NAME) == 0o600
    files = list(persistence.snapshot_files(directory))
    assert [mode(f) for f in files] == [0o600]


def test_a_grad_map_entry_that_names_no_grad_array_is_refused():
    """A hand-edited grad map (an array named as its own gradient, a review helper's)
    is refused at restore: no TensorArrayGradV3 makes such an entry."""
    store = SessionStore()
    s = populated(store)
    state = s.export_state(idle_timeout=60)
    (forward, source), _ = next(iter(state.grads.items()))
    state.grads = {(forward, source): forward}
    back = SessionStore()
    with pytest.raises(ValueError, match="not a grad array"):
        Session.from_state(
            state,
            idle_timeout=60,
            max_tensor_bytes=None,
            max_tensor_array_size=None,
            budget=back.budget,
        )
    assert back.budget.used == 0


def test_a_session_ended_while_a_snapshot_runs_leaves_no_file(tmp_path, monkeypatch):
    """The snapshot exported the session, which closed before its file was written:
    the file it writes goes once it has written (``StateKeeper.forget``)."""
    from gradserve.server.transport import replicas
    from gradserve.server.transport.config import ServerConfig

    store = SessionStore()
    keeper = replicas.StateKeeper(
        ServerConfig(state_dir=str(tmp_path), snapshot_interval=60.0), store, _HostCompute()
    )
    store.on_ended = keeper.forget
    ending, staying = store.create(), store.create()
    write_snapshot = persistence.write_snapshot

    def closing_meanwhile(states, directory, to_host):
        store.close(ending.id)  # after the export, before the write
        return write_snapshot(states, directory, to_host)

    monkeypatch.setattr(persistence, "write_snapshot", closing_meanwhile)
    report = keeper.snapshot()
    assert report.written == 2
    assert sorted(p.name for p in tmp_path.glob("*.gss")) == [persistence.file_name(staying.id)]
    store.close(staying.id)  # and between snapshots, at once
    assert not list(tmp_path.glob("*.gss"))


class _HostCompute:
    @staticmethod
    def to_host(array):
        return np.asarray(array)


def test_handed_out_outputs_survive_a_restart_only_until_their_client_would_have_come(tmp_path):
    """Outputs handed out to be fetched (transient) were saved as any tensor: after a
    crash with periodic snapshots, those the client had already fetched and deleted
    came back, charged for ever (a review helper: 64 MiB over the live session, and
    734 of 916 later gathers refused by its byte limit). They come back marked, as one
    reply left at the restore: fetched ones hold no drain, and all are deleted if no
    client comes for them (a fetched one is kept: the stream that read it may have
    broken before its client had all of it, another helper)."""
    store = SessionStore()
    s = store.create()
    fetched, waiting, kept = (s.put(np.full(1000, n, np.float32)) for n in range(3))
    reply = HandedOutReply()
    for tensor_id in (fetched, waiting):
        s.handed_out(tensor_id, reply)
    s.replied(reply)
    s.fetched(fetched)
    persistence.write_snapshot(store.export_states(), tmp_path)
    other = SessionStore()
    persistence.restore_dir(other, tmp_path)
    back = other.get(s.id)
    np.testing.assert_array_equal(back.get(fetched), np.full(1000, 0, np.float32))
    np.testing.assert_array_equal(back.get(waiting), np.full(1000, 1, np.float32))
    assert back.unfetched_outputs(5.0) == 1  # (a drain right after the restart waits)
    now = time.monotonic()
    assert back.expire_handed_out(300.0, 30.0, now + 29) == 0
    assert back.expire_handed_out(300.0, 30.0, now + 31) == 1  # read out: its client has it
    with pytest.raises(NotFoundError):
        back.get(fetched)
    assert back.expire_handed_out(300.0, 30.0, now + 299) == 0
    assert back.expire_handed_out(300.0, 30.0, now + 301) == 1
    with pytest.raises(NotFoundError):
        back.get(waiting)
    np.testing.assert_array_equal(back.get(kept), np.full(1000, 2, np.float32))  # never handed out
    assert back.budget.used == 4000 + TENSOR_RECORD_BYTES


def test_a_replys_outputs_are_deleted_together_once_nobody_has_come_for_them():
    """A reply's outputs age together, from the last one read out: the SDK fetches
    them one after another (two at a time), and expiry deleted the ones not yet begun
    while their client still read the others (a review helper)."""
    store = SessionStore()
    s = store.create()
    first, second = s.put(np.ones(10, np.float32)), s.put(np.ones(10, np.float32))
    reply = HandedOutReply()
    s.handed_out(first, reply)
    s.handed_out(second, reply)
    now = time.monotonic()
    assert s.expire_handed_out(300.0, 30.0, now + 3600) == 0  # the reply still on its way
    s.replied(reply)
    now = time.monotonic()
    ended = s.being_read(first)  # a call reads one of them out, however slowly
    assert s.expire_handed_out(300.0, 30.0, now + 301) == 0
    ended()  # their age counts from here
    s.fetched(first)
    now = time.monotonic()
    assert s.expire_handed_out(300.0, 30.0, now + 29) == 0
    assert s.expire_handed_out(300.0, 30.0, now + 31) == 1  # the one read out
    assert s.expire_handed_out(300.0, 30.0, now + 299) == 0
    assert store.expire_idle(now + 301) == 0 and len(store) == 1
    for gone in (first, second):
        with pytest.raises(NotFoundError):
            s.get(gone)


def _peak_bytes(work) -> int:
    """The most memory Python and NumPy held at once while ``work()`` ran."""
    tracemalloc.start()
    try:
        with contextlib.suppress(persistence.SnapshotError):
            work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_file_whose_size_its_header_does_not_give_is_refused_before_it_is_read(tmp_path):
    """The whole file was read into one buffer before its header was checked: a sparse
    file of 3 GB (4 KiB on disk) named like a session took 3 GB at every start, and one
    larger than memory would have the server killed at each (a review helper)."""
    store = SessionStore()
    store.create().put(np.ones(10, np.float32))
    persistence.write_snapshot(store.export_states(), tmp_path)
    (path,) = persistence.snapshot_files(tmp_path)
    with open(path, "r+b") as fh:
        fh.truncate(256 << 20)  # sparse: nothing more on disk
    peak = _peak_bytes(lambda: persistence.read_session(path))
    with pytest.raises(persistence.SnapshotError, match="truncated or padded"):
        persistence.read_session(path)
    assert peak < 16 << 20, peak


def test_a_restore_holds_the_session_once_not_its_file_besides(tmp_path):
    """Each tensor is read into its own array: the file's buffer and every tensor's
    copy of it took twice the session's size at the peak (a review helper: a 1 GiB
    session took 2.1 GB to restore, 1.15 GB to hold)."""
    store = SessionStore()
    session = store.create()
    values = [np.full(4 << 20, n, np.float32) for n in range(4)]  # 64 MiB
    for value in values:
        session.put(value)
    persistence.write_snapshot(store.export_states(), tmp_path)
    (path,) = persistence.snapshot_files(tmp_path)
    got: list[Any] = []
    peak = _peak_bytes(lambda: got.append(persistence.read_session(path)))
    assert sorted(float(a[0]) for a in got[0].resident.values()) == [0, 1, 2, 3]
    assert peak < 80 << 20, peak  # 64 MiB of tensors, and little else


def test_links_planted_in_the_state_directory_are_never_written_through(tmp_path):
    """The lock file and each temporary file were opened through any link someone
    with write access to the directory planted there: the server (root in the image)
    truncated and wrote the files they named (a review helper)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    state = tmp_path / "state"
    state.mkdir()
    (state / persistence.LOCK_NAME).symlink_to(victim)
    with pytest.raises(OSError):
        persistence.lock_directory(state)
    (state / persistence.LOCK_NAME).unlink()
    store = SessionStore()
    session = store.create()
    session.put(np.ones(3, np.float32))
    temp = state / f"{persistence.TEMP_PREFIX}{persistence.file_name(session.id)}"
    temp.symlink_to(victim)
    report = persistence.write_snapshot(store.export_states(), state)
    assert report.written == 1 and victim.read_bytes() == b"precious"
    (path,) = persistence.snapshot_files(state)
    assert not path.is_symlink() and persistence.read_session(path).id == session.id


def test_a_tensor_larger_than_one_read_is_read_in_pieces(tmp_path, monkeypatch):
    """Linux reads at most 2 GiB at a time: a valid snapshot with a string tensor
    past that was refused (one ``pread`` short of it: a review helper). Here reads
    give at most 1000 bytes each."""
    real_pread, real_preadv = os.pread, os.preadv

    def pread(fd, n, offset):
        return real_pread(fd, min(n, 1000), offset)

    def preadv(fd, buffers, offset):
        return real_preadv(fd, [memoryview(buffers[0])[:1000]], offset)

    store = SessionStore()
    session = store.create()
    strings = np.array([b"x" * 3000, b"", b"y" * 1500], dtypes.STRING)
    numbers = np.arange(5000, dtype=np.float32)
    ids = session.put(strings), session.put(numbers)
    persistence.write_snapshot(store.export_states(), tmp_path)
    (path,) = persistence.snapshot_files(tmp_path)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    back = persistence.read_session(path)
    assert list(back.resident[ids[0]]) == list(strings)
    np.testing.assert_array_equal(back.resident[ids[1]], numbers)


def test_a_file_changed_after_its_checksum_was_computed_is_refused(tmp_path, monkeypatch):
    """The checksum is computed before the tensors are read: bytes changed in place
    between the two were restored unchecked (a review helper: NaNs)."""
    store = SessionStore()
    store.create().put(np.ones(3, np.float32))
    persistence.write_snapshot(store.export_states(), tmp_path)
    (path,) = persistence.snapshot_files(tmp_path)
    checked = persistence._checked_payload

    def then_changed(name, fd):
        payload = checked(name, fd)
        with open(path, "r+b") as fh:
            fh.seek(-4, os.SEEK_END)
            fh.write(b"\xff\xff\xff\xff")
        return payload

    monkeypatch.setattr(persistence, "_checked_payload", then_changed)
    with pytest.raises(persistence.SnapshotError, match="changed while it was read"):
        persistence.read_session(path)


def test_a_client_deletes_again_what_a_restart_from_an_older_snapshot_brought_back(tmp_path):
    """A crash after a snapshot brings back the outputs a client fetched and deleted
    since, holding its session's bytes for up to 5 minutes (those not yet fetched at
    the snapshot; a review helper: 730 gathers of a live client refused after a
    restart). A call that failed UNAVAILABLE (the server was down) has the SDK carry
    the ids it deleted lately again: gone at its first call after the restart."""
    import threading

    import gradserve
    from gradserve.server import run_server

    state = tmp_path / "state"
    state.mkdir()
    value = np.arange(100_000, dtype=np.float32)
    with run_server(device="cpu") as first:
        port = first.port
        client = gradserve.Client(
            f"127.0.0.1:{port}", stream_threshold=1024, timeout=30, shared_memory=False, retries=20
        )
        ta = client.tensor_array(np.float32, size=1)
        ta.write(0, value)
        read = ta.read(0)  # handed out and fetched: deleted by the next call
        np.testing.assert_array_equal(read, value)
        session = first.store.get(client.session_id)
        (output,) = session.export_state(60.0).fetched
        persistence.write_snapshot(first.store.export_states(), state)  # still held
        assert client.raw_ops.TensorArraySizeV3(ta.handle, ta.flow) == 1  # deletes it
        with pytest.raises(NotFoundError):
            session.get(output)
    # The server "crashed" after that call: its last snapshot holds the output.
    answer: list[Any] = []
    call = threading.Thread(target=lambda: answer.append(client.keep_alive()))
    call.start()  # UNAVAILABLE (refused) until the restart, and repeated
    end = time.monotonic() + 10  # the outage seen before the restart (not a fixed wait)
    while not client._fetched.out_of_reach and time.monotonic() < end:
        time.sleep(0.01)
    assert client._fetched.out_of_reach
    with run_server(device="cpu", port=port, state_dir=str(state)) as second:
        call.join(30)
        assert answer, "the call did not get through after the restart"
        with pytest.raises(NotFoundError):
            second.store.get(client.session_id).get(output)
        client.close()
