"""Shutting down never loses what the server holds: a log reader that stops reading
blocks neither calls nor the drain (``log_writer``); a SIGTERM while the server starts
drains and saves the sessions it restored; a drain waits for an adoption (SIGHUP) in
progress, so that every adopted session is saved or still in the adopt dir."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import math
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

import gradserve
from gradserve import codec, protocol
from gradserve.server.core import persistence
from gradserve.server.core.sessions import HandedOutReply, SessionStore
from gradserve.server.transport.admission import Admission
from gradserve.server.transport.app import (
    STOP_SLACK_SECONDS,
    ConfigError,
    run_server,
    watch_stop,
)
from gradserve.server.transport.log_writer import LogWriter
from gradserve.v1 import service_pb2, service_pb2_grpc, tensor_array_pb2
from gradserve.v1 import shared_memory_pb2 as shm_pb2
from tests.server_process import ServerProcess

SERVE = [sys.executable, "-m", "gradserve.server", "serve", "--port", "0", "--device", "cpu"]


def _port(proc: subprocess.Popen) -> int:
    while line := proc.stdout.readline():
        if line.startswith(b"listening on"):
            return int(line.split(b":")[1].split()[0])
    raise AssertionError(f"no 'listening on' line; exit code {proc.wait(30)}")


def test_a_log_reader_that_stops_reading_blocks_no_call_and_not_the_drain(tmp_path):
    """Each failed call logs a line at INFO. Once stdout/stderr's pipe is full (64 KiB
    here: a few hundred lines), writing the next line blocks; that used to happen on
    the event loop, so no call was answered, and SIGTERM's drain never began. A
    warning Python writes itself (NumPy's, a float16 gradient that overflows, written
    while the array's lock is held) blocked the same way: the last snapshot then
    waited on that lock for ever."""
    state = tmp_path / "state"
    serve = [*SERVE, "--state-dir", str(state), "--grace", "1"]
    proc = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        port = _port(proc)  # and from here on nobody reads the pipe
        target = f"127.0.0.1:{port}"
        with grpc.insecure_channel(target) as channel:
            stub = service_pb2_grpc.GradServeStub(channel)
            lost = ((protocol.SESSION_METADATA_KEY, "no-such-session-" + "x" * 200),)
            for call in range(2000):  # about 600 KB of log lines
                try:
                    stub.KeepAlive(service_pb2.KeepAliveRequest(), metadata=lost, timeout=5)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.NOT_FOUND, (call, e.code())
        client = gradserve.Client(target, shared_memory=False, timeout=10)
        h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float16)
        g, gflow = client.raw_ops.TensorArrayGradV3(h, flow, source="s")
        big = np.array([60000], np.float16)
        client.raw_ops.TensorArrayWriteV3(g, 0, big, gflow)
        client.raw_ops.TensorArrayWriteV3(g, 0, big, gflow)  # sums to inf: NumPy warns
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # drained, saved and exited, the pipe still unread
        assert len(list(persistence.snapshot_files(state))) == 1
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_failed_tls_handshakes_do_not_wedge_a_server_whose_log_is_not_read(tmp_path):
    """gRPC's core writes its own lines to stderr from its own threads; at its default
    verbosity one for every failed TLS handshake. Behind a pipe nobody read, about 300
    connections of garbage filled it: the core's thread blocked in the write, later
    handshakes hung and SIGTERM did not end the process. The server now starts the core
    at ERROR (``entry.quiet_grpc_core``) unless told otherwise."""
    import os
    import socket

    from tests.server.certs import make_pki

    pki = make_pki()
    for name in ("server", "ca"):
        (tmp_path / f"{name}.crt").write_bytes(pki[name].cert)
        (tmp_path / f"{name}.key").write_bytes(pki[name].key)
    serve = [*SERVE, "--grace", "1", "--tls-cert", str(tmp_path / "server.crt")]
    serve += ["--tls-key", str(tmp_path / "server.key")]
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    proc = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        port = _port(proc)  # and from here on nobody reads the pipe
        for attempt in range(1000):  # ~210 KB of log lines at gRPC's default verbosity
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(b"\x16\x03\x01\x00\x05not a TLS client hello" * 4)
                conn.settimeout(5)
                try:
                    conn.recv(64)  # the server's alert, or its close
                except TimeoutError:
                    pytest.fail(f"handshake {attempt} not answered in 5 s")
                except OSError:
                    pass
        creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"].cert)
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_the_operator_chooses_grpc_core_verbosity():
    from gradserve.server.transport import entry

    environ = {}
    entry.quiet_grpc_core(environ)
    assert environ == {"GRPC_VERBOSITY": "ERROR"}
    environ = {"GRPC_VERBOSITY": "DEBUG"}
    entry.quiet_grpc_core(environ)
    assert environ == {"GRPC_VERBOSITY": "DEBUG"}
    environ = {"GRPC_VERBOSITY": ""}  # gRPC reads empty as its default (INFO)
    entry.quiet_grpc_core(environ)
    assert environ == {"GRPC_VERBOSITY": "ERROR"}


class _Blocked(logging.Handler):
    """A handler whose writes block until ``go`` is set (a pipe nobody reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.records: list[logging.LogRecord] = []

    @property
    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]

    def emit(self, record: logging.LogRecord) -> None:
        self.go.wait()
        self.records.append(record)


def test_records_past_the_queue_are_dropped_counted_and_reported():
    target = _Blocked()
    writer = LogWriter(target, capacity=3)
    log = logging.getLogger("test_shutdown.dropping")
    log.propagate = False
    log.addHandler(writer.queue_handler)
    try:
        for i in range(10):
            log.warning("line %d", i)  # returns at once, however full the queue
        assert 6 <= writer.dropped <= 7  # 3 queued, one perhaps taken by the writer
        target.go.set()
        time.sleep(0.2)  # the queue drains
        log.warning("after")
        assert writer.close(5)
    finally:
        log.removeHandler(writer.queue_handler)
    assert target.lines[-1] == "after"
    assert (
        target.lines[-2]
        == f"{writer.dropped} log record(s) dropped: the log's reader was not reading"
    )
    assert target.lines[0] == "line 0"


def test_an_exception_reaches_the_writer_as_text():
    """Its message as logged, its traceback apart (``exc_text``, formatted when it was
    queued), for the writer's formatter: a JSON line's "exception" field."""
    target = _Blocked()
    target.go.set()
    writer = LogWriter(target)
    log = logging.getLogger("test_shutdown.exception")
    log.propagate = False
    log.addHandler(writer.queue_handler)
    try:
        try:
            raise ValueError("the cause")
        except ValueError:
            log.exception("failed: %s", "this")
        assert writer.close(5)
    finally:
        log.removeHandler(writer.queue_handler)
    assert target.lines == ["failed: this"]  # not the traceback folded into it
    (record,) = target.records
    assert record.exc_info is None  # (a traceback object does not outlive its thread well)
    assert record.exc_text.endswith("ValueError: the cause")


def test_a_sigterm_while_starting_drains_and_saves_the_restored_sessions(tmp_path):
    """SIGTERM's default (ending the process) applied until the server had its
    handlers, after it started: once the restored files were set aside (the files
    were removed then), that lost every restored session. Now a SIGTERM that lands
    during the start, here right after the restore, drains and saves them: exit 0."""
    state = tmp_path / "state"
    first = ServerProcess("--state-dir", str(state))
    value = np.arange(6, dtype=np.float32)
    client = gradserve.Client(first.target, shared_memory=False)
    ref = client.put(value)
    session_id = client.session_id
    assert first.stop() == 0  # the session still open: saved
    with contextlib.suppress(gradserve.errors.GradserveError):
        client.close()
    assert len(list(persistence.snapshot_files(state))) == 1

    signalled = textwrap.dedent(
        """
        import os, signal, sys
        from gradserve.server.core import persistence
        real = persistence.restore_dir
        def restore_then_sigterm(*args, **kwargs):
            report = real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)
            return report
        persistence.restore_dir = restore_then_sigterm
        from gradserve.server.transport.entry import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    second = subprocess.run(
        [sys.executable, "-c", signalled, *SERVE[3:], "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored 1 session(s)" in second.stderr

    _assert_restored(state, session_id, ref, value)


def _assert_restored(state, session_id: str, ref, value: np.ndarray) -> None:
    """A server started on ``state`` serves session ``session_id`` with ``ref``'s value."""
    server = ServerProcess("--state-dir", str(state))
    try:
        with gradserve.Client(server.target, session_id=session_id, shared_memory=False) as c:
            np.testing.assert_array_equal(c.get(ref.id), value)
    finally:
        assert server.stop() == 0


def test_a_drain_waits_for_an_adoption_and_loses_none_of_its_sessions(tmp_path, monkeypatch):
    """SIGTERM during a SIGHUP adoption: the adoption stops after its current file
    and the snapshot after the drain waits for it, so every session is either saved
    in the state dir or still in the adopt dir. It used to go on restoring (and then
    delete its files) after the final snapshot: those sessions were in no file."""
    state, adopt = tmp_path / "state", tmp_path / "adopt"
    other = SessionStore(replica_id="gone")
    ids = {other.create().id for _ in range(40)}
    persistence.write_snapshot(other.export_states(), adopt)
    _slow_reads(monkeypatch)  # 40 files: 0.8 s, a window for the drain to begin
    with run_server(state_dir=str(state), adopt_dir=str(adopt), grace=0) as server:
        adoption = _adoption_under_way(server, sessions_in=3)
        server.stop()
        adoption.join(10)
    saved = {persistence.read_session(p).id for p in persistence.snapshot_files(state)}
    left = {persistence.read_session(p).id for p in persistence.snapshot_files(adopt)}
    assert saved | left == ids
    assert saved and left  # it did stop midway, and what it adopted was saved
    assert not saved & left


def _slow_reads(monkeypatch) -> None:
    """Each session file takes 20 ms more to read: an adoption lasts long enough to act
    while it runs."""
    real = persistence.read_session

    def slow_read(path):
        time.sleep(0.02)
        return real(path)

    monkeypatch.setattr(persistence, "read_session", slow_read)


def _adoption_under_way(server, sessions_in: int) -> threading.Thread:
    """An adoption (SIGHUP's) on a thread of its own, once ``sessions_in`` sessions are
    in (waited for, not guessed at how fast files go)."""
    adoption = threading.Thread(target=server.keeper.adopt)
    adoption.start()
    deadline = time.monotonic() + 10
    while len(server.store) < sessions_in and time.monotonic() < deadline:
        time.sleep(0.005)
    return adoption


def _on_another_filesystem(monkeypatch, directory, but_to: str | None = None) -> None:
    """Renames out of ``directory`` fail as they do across filesystems (EXDEV), but
    those to a name ending ``but_to`` (a rename in place)."""
    import errno
    import pathlib

    real_replace = pathlib.Path.replace

    def replace(self, target):
        in_place = but_to is not None and str(target).endswith(but_to)
        if self.parent == directory and not in_place:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_replace(self, target)

    monkeypatch.setattr(pathlib.Path, "replace", replace)


def _files_of(directory) -> dict[str, bytes]:
    return {
        persistence.read_session(p).id: p.read_bytes()
        for p in persistence.snapshot_files(directory)
    }


def test_an_adopted_session_whose_last_write_fails_keeps_its_file(tmp_path, monkeypatch):
    """Adoption used to remove the adopted files at once: a session the final
    snapshot could not write (a full disk, a GPU copy that failed) was then in no file
    at all. Its file now moves into the state dir as the server's own restored files
    do, and is put back there when its write fails."""
    state, adopt = tmp_path / "state", tmp_path / "adopt"
    other = SessionStore(replica_id="gone")
    kept, failing = other.create(), other.create()
    failing.put(np.arange(4, dtype=np.float32))
    persistence.write_snapshot(other.export_states(), adopt)
    adopted = _files_of(adopt)
    real = persistence.write_session

    def fails_for(state_, path, to_host):
        if state_.id == failing.id:
            raise persistence.SnapshotError("No space left on device")
        return real(state_, path, to_host)

    with run_server(state_dir=str(state), adopt_dir=str(adopt), grace=0) as server:
        assert server.keeper.adopt().restored == 2
        assert not list(persistence.snapshot_files(adopt))
        server.store.get(failing.id).put(np.ones(3, np.float32))  # used since
        monkeypatch.setattr(persistence, "write_session", fails_for)
    assert server.keeper.last.failed == 1
    saved = _files_of(state)
    assert saved.keys() == {kept.id, failing.id}
    assert saved[failing.id] == adopted[failing.id]  # as adopted: its last good state
    assert sorted(p.name for p in state.iterdir() if not p.name.startswith(".")) == sorted(
        persistence.file_name(i) for i in (kept.id, failing.id)
    )


def test_adopted_files_from_another_filesystem_are_copied_in(tmp_path, monkeypatch):
    """``--adopt-dir`` on another filesystem than ``--state-dir``: a rename cannot move
    a file there (EXDEV), so it is copied, synced and renamed, then removed."""
    state, adopt = tmp_path / "state", tmp_path / "adopt"
    other = SessionStore(replica_id="gone")
    ids = {other.create().id for _ in range(3)}
    persistence.write_snapshot(other.export_states(), adopt)
    adopted = _files_of(adopt)
    _on_another_filesystem(monkeypatch, adopt)
    with run_server(state_dir=str(state), adopt_dir=str(adopt), grace=0) as server:
        assert server.keeper.adopt().restored == 3
        assert list(adopt.iterdir()) == [adopt / persistence.LOCK_NAME]
        aside = sorted(state.glob(f"*{persistence.RESTORED_SUFFIX}"))
        assert {persistence.read_session(p).id: p.read_bytes() for p in aside} == adopted
        assert not list(state.glob(f"{persistence.TEMP_PREFIX}*"))
    assert _files_of(state).keys() == ids  # the final snapshot, and nothing set aside left
    assert not list(state.glob(f"*{persistence.RESTORED_SUFFIX}"))


def test_a_file_a_snapshot_wrote_since_the_restore_is_not_replaced(tmp_path):
    """With periodic snapshots, one may write an adopted session between its restore
    and the move of its file: that file is newer, and the adopted one only removed."""
    state, adopt = tmp_path / "state", tmp_path / "adopt"
    other = SessionStore(replica_id="gone")
    session = other.create()
    persistence.write_snapshot(other.export_states(), adopt)
    back = SessionStore()
    report = persistence.restore_dir(back, adopt, remove=False)
    back.get(session.id).put(np.ones(2, np.float32))
    persistence.write_snapshot(back.export_states(), state)  # the periodic one
    newer = _files_of(state)
    persistence.take_over(report.files, state, aside=False)
    assert _files_of(state) == newer
    assert not list(persistence.snapshot_files(adopt))


def test_an_adopted_file_that_cannot_be_moved_is_never_adopted_twice(tmp_path, monkeypatch):
    """A move that failed midway (another filesystem, then a full disk) stopped there:
    the files after it stayed in the adopt dir, and the next adoption read sessions
    this server already served again (a closed one came back). Each file is now tried
    on its own, and one that cannot be moved is set aside where it is."""
    import errno
    import shutil

    state, adopt = tmp_path / "state", tmp_path / "adopt"
    other = SessionStore(replica_id="gone")
    ids = [other.create().id for _ in range(3)]
    persistence.write_snapshot(other.export_states(), adopt)
    real_copy = shutil.copyfileobj
    copies = []

    def second_copy_fails(source, target, *args):
        copies.append(source.name)
        if len(copies) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_copy(source, target, *args)

    _on_another_filesystem(monkeypatch, adopt, but_to=persistence.ADOPTED_SUFFIX)
    monkeypatch.setattr(shutil, "copyfileobj", second_copy_fails)
    with run_server(state_dir=str(state), adopt_dir=str(adopt), grace=0) as server:
        assert server.keeper.adopt().restored == 3
        assert len(copies) == 3  # the third was tried after the second failed
        assert not list(persistence.snapshot_files(adopt))
        (kept,) = adopt.glob(f"*{persistence.ADOPTED_SUFFIX}")
        server.store.close(persistence.read_session(kept).id)
        again = server.keeper.adopt()
        assert (again.restored, again.rejected) == (0, 0)  # nothing read a second time
        open_ids = {s.id for s in server.store.export_states()}
    assert open_ids == set(ids) - {persistence.read_session(kept).id}
    assert _files_of(state).keys() == open_ids


def test_a_drain_during_the_copies_from_another_filesystem_copies_no_more(tmp_path, monkeypatch):
    """Copying adopted files across filesystems can take long; a drain that begins
    meanwhile stops it (the last snapshot, which comes next, writes the sessions):
    those files are removed, not copied."""
    adopt, state = tmp_path / "adopt", tmp_path / "state"
    state.mkdir()
    other = SessionStore(replica_id="gone")
    for _ in range(3):
        other.create()
    persistence.write_snapshot(other.export_states(), adopt)
    files = list(persistence.snapshot_files(adopt))
    _on_another_filesystem(monkeypatch, adopt)
    drained = iter([False, True, True])  # the drain begins after the first copy
    assert persistence.take_over(files, state, aside=True, stop=lambda: next(drained)) == []
    assert not list(persistence.snapshot_files(adopt))
    assert [p.name for p in state.iterdir()] == [files[0].name + persistence.RESTORED_SUFFIX]


def test_a_sighup_during_an_adoption_reads_the_directory_again(tmp_path, monkeypatch):
    """A SIGHUP while an adoption runs was dropped (a warning): files moved into the
    adopt dir meanwhile waited for the next one. Now the adoption goes over the
    directory once more when it ends."""
    state, adopt = tmp_path / "state", tmp_path / "adopt"
    first, second = SessionStore(replica_id="gone"), SessionStore(replica_id="gone2")
    early = {first.create().id for _ in range(20)}
    late = second.create().id
    persistence.write_snapshot(first.export_states(), adopt)
    _slow_reads(monkeypatch)
    with run_server(state_dir=str(state), adopt_dir=str(adopt), grace=0) as server:
        adoption = _adoption_under_way(server, sessions_in=2)
        (state_,) = second.export_states()
        persistence.write_session(state_, adopt)  # a file arrives, then the SIGHUP
        assert server.keeper.adopt() is None  # returns at once: the running one reads again
        adoption.join(30)
        assert not adoption.is_alive()
        assert {s.id for s in server.store.export_states()} == early | {late}
        assert server.keeper.adopted == 21
    assert _files_of(state).keys() == early | {late}


def test_a_sighup_adopts_and_the_drain_saves_what_it_adopted(tmp_path):
    state, adopt = tmp_path / "state", tmp_path / "adopt"
    other = SessionStore(replica_id="gone")
    session_id = other.create().id
    persistence.write_snapshot(other.export_states(), adopt)
    server = ServerProcess("--state-dir", str(state), "--adopt-dir", str(adopt))
    try:
        server.proc.send_signal(signal.SIGHUP)
        assert server.wait_for("gradserve_sessions_open", 1) == 1
        assert not list(persistence.snapshot_files(adopt))
    finally:
        assert server.stop() == 0
    assert [persistence.read_session(p).id for p in persistence.snapshot_files(state)] == [
        session_id
    ]


def test_a_second_server_on_the_same_state_dir_is_refused(tmp_path):
    """A snapshot removes the files of the sessions it does not hold: two servers on
    one state dir deleted each other's sessions (both exiting 0)."""
    state = str(tmp_path / "state")
    first = ServerProcess("--state-dir", state)
    try:
        second = subprocess.run(
            [*SERVE, "--state-dir", state], capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2
        assert f"server that is running (pid {first.proc.pid})" in second.stderr
    finally:
        assert first.stop() == 0
    again = ServerProcess("--state-dir", state)  # free once the first has stopped
    assert again.stop() == 0


def test_adoption_leaves_a_running_servers_files_alone(tmp_path):
    live, survivor = tmp_path / "live", tmp_path / "survivor"
    with run_server(state_dir=str(live)) as running:
        running.store.create()
        running.keeper.snapshot()  # its file, which it still serves
        with run_server(state_dir=str(survivor), adopt_dir=str(live)) as adopter:
            assert adopter.keeper.adopt() is None
            assert len(adopter.store) == 0
        assert len(list(persistence.snapshot_files(live))) == 1
        with pytest.raises(ConfigError, match="--state-dir: .* server that is running"):
            with run_server(state_dir=str(live)):
                pass


def test_a_start_that_fails_after_the_restore_keeps_every_session(tmp_path):
    """The restore sets its files aside only once the server serves: a start that
    failed later (its port, or its metrics port, taken) used to leave them set aside,
    and the next start removed them."""
    import socket

    state = str(tmp_path / "state")
    first = ServerProcess("--state-dir", state)
    client = gradserve.Client(first.target, shared_memory=False)
    ref = client.put(np.arange(3, dtype=np.float32))
    session_id = client.session_id
    assert first.stop() == 0
    with contextlib.suppress(gradserve.errors.GradserveError):
        client.close()
    for flag in ("--port", "--metrics-port"):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = str(taken.getsockname()[1])
            command = [*SERVE, "--state-dir", state, "--metrics-port", "0", flag, port]
            failed = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert failed.returncode == 2, failed.stderr
        assert len(list(persistence.snapshot_files(state))) == 1, flag
    again = ServerProcess("--state-dir", state)
    try:
        with gradserve.Client(again.target, session_id=session_id, shared_memory=False) as c:
            np.testing.assert_array_equal(c.get(ref.id), np.arange(3, dtype=np.float32))
    finally:
        assert again.stop() == 0


def test_no_snapshot_after_the_final_one(tmp_path):
    """A periodic snapshot that began just before the drain waits for the final one's
    lock; run after it, it found the sessions closing and removed their files."""
    state = tmp_path / "state"
    with run_server(state_dir=str(state)) as server:
        server.store.create()
        keeper = server.keeper
        server.stop()
        assert len(list(persistence.snapshot_files(state))) == 1
        assert keeper.snapshot() is None  # a late periodic one: nothing done
        assert len(list(persistence.snapshot_files(state))) == 1


def test_warnings_and_a_threads_exception_go_through_the_log_writer():
    script = textwrap.dedent(
        """
        import threading, warnings
        from gradserve.server.transport.cli import configure_logging
        writer = configure_logging("info", "json")
        warnings.warn("a warning")
        t = threading.Thread(target=lambda: 1 / 0, name="doomed")
        t.start(); t.join()
        assert writer.close(5)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [line["logger"] for line in lines] == ["py.warnings", "gradserve"]
    assert "UserWarning: a warning" in lines[0]["message"]
    assert lines[1]["message"] == "uncaught exception in thread doomed"
    assert "ZeroDivisionError" in lines[1]["exception"]


def test_handed_out_outputs_hold_a_drain_only_while_their_client_is_about_it():
    """A drain waits for the outputs a reply handed out (transient) until their client
    fetches or deletes them, but not for a client that went away: one whose reply left
    and whose session has had no call for FETCH_PATIENCE_SECONDS counts none. While
    the reply is on its way it counts, however long that takes (a helper's client
    reading it at 150 KB/s lost its output when the patience counted from the op's
    end)."""
    store = SessionStore()
    session = store.create()
    out, other = session.put(np.ones(4, np.float32)), session.put(np.ones(4, np.float32))
    reply = HandedOutReply()
    session.handed_out(out, reply)
    session.handed_out("no-such-id", reply)  # nothing held: nothing to wait for
    used = session.last_used
    assert session.unfetched_outputs(5.0, now=used + 60) == 1  # its reply not yet gone
    session.replied(reply)
    left = time.monotonic()
    assert session.unfetched_outputs(5.0, now=left + 4.9) == 1
    assert session.unfetched_outputs(5.0, now=left + 5.1) == 0  # its client went away
    ended = session.call_started()
    assert session.unfetched_outputs(5.0, now=session.last_used + 60) == 1  # a call runs
    ended()
    assert store.unfetched_outputs(5.0) == 1
    session.fetched(out)
    assert store.unfetched_outputs(5.0) == 0
    session.handed_out(other, HandedOutReply())
    session.delete([other])
    assert store.unfetched_outputs(5.0) == 0
    again = session.put(np.ones(4, np.float32))
    session.handed_out(again, HandedOutReply())
    session.close()
    assert session.unfetched_outputs(5.0) == 0


@pytest.mark.parametrize("read", ["GetTensor", "GetTensorInline", "GetSharedTensor"])
def test_every_read_of_a_handed_out_output_ends_the_drains_wait(read, tmp_path):
    """Only GetTensor marked a transient output fetched: one read with GetTensorInline
    (a client of its own, not the SDK) or into a shared-memory region held a drain
    for FETCH_PATIENCE_SECONDS, or the whole grace if shorter (a review helper)."""
    with run_server(port=0, device="cpu") as server:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        stub = service_pb2_grpc.GradServeStub(channel)
        session = stub.CreateSession(service_pb2.CreateSessionRequest()).session_id
        metadata = ((protocol.SESSION_METADATA_KEY, session),)
        request = tensor_array_pb2.StopGradientRequest()
        x = np.arange(1024, dtype=np.float32)
        codec.encode(x, request.input.value)
        inline_limit = ((protocol.INLINE_LIMIT_METADATA_KEY, "16"),)
        reply = stub.StopGradient(request, metadata=metadata + inline_limit)
        assert reply.output.ref.transient
        tensor_id = reply.output.ref.id
        assert server.store.unfetched_outputs(5.0) == 1
        get = service_pb2.GetTensorRequest(id=tensor_id)
        if read == "GetTensor":
            got = codec.decode_chunks(stub.GetTensor(get, metadata=metadata), field="x")
        elif read == "GetTensorInline":
            got = codec.decode(stub.GetTensorInline(get, metadata=metadata), field="x")
        else:
            key = f"gradserve_test_{os.getpid()}_{secrets.token_hex(4)}"
            region = shared_memory.SharedMemory(key, create=True, size=64 + x.nbytes)
            try:
                nonce = secrets.token_bytes(16)
                region.buf[:16] = nonce
                register = shm_pb2.RegisterSharedMemoryRequest(
                    name="r", key=key, byte_size=64 + x.nbytes, nonce=nonce
                )
                stub.RegisterSharedMemory(register, metadata=metadata)
                into = shm_pb2.GetSharedTensorRequest(id=tensor_id, region="r", offset=64)
                stub.GetSharedTensor(into, metadata=metadata)
                got = np.frombuffer(region.buf[64:], np.float32).copy()
            finally:
                region.close()
                region.unlink()
        np.testing.assert_array_equal(got, x)
        deadline = time.monotonic() + 5  # (marked as gRPC ends the call)
        while server.store.unfetched_outputs(60.0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.store.unfetched_outputs(60.0) == 0
        channel.close()


def test_a_drain_waits_for_unfetched_outputs_within_its_timeout():
    admission = Admission(None)

    async def drain(timeout: float, fetched_after: float | None) -> tuple[bool, float]:
        left = [1]
        if fetched_after is not None:
            asyncio.get_running_loop().call_later(fetched_after, left.clear)
        started = time.monotonic()
        finished = await admission.drain(timeout, lambda: len(left))
        return finished, time.monotonic() - started

    finished, took = asyncio.run(drain(5.0, fetched_after=0.6))
    assert finished and 0.6 <= took < 2.0, took  # until the fetch, not to the timeout
    finished, took = asyncio.run(drain(0.8, fetched_after=None))
    assert finished and 0.8 <= took < 2.0, took  # never fetched: the timeout ends it


def _serve_patched(patch: str, *flags: str) -> subprocess.Popen:
    """The server's own entry point in a process, after ``patch`` (Python) ran."""
    run = "from gradserve.server.transport.entry import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", f"import sys\n{patch}\n{run}\n", *SERVE[3:], *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_a_thread_left_running_does_not_keep_a_stopped_server_alive():
    """The server stopped, the interpreter's exit waited for every thread that was not
    a daemon (a library's, an executor's stuck in its work): a SIGTERMed server never
    exited. It leaves once it has stopped: its sessions saved and freed, its log out."""
    stray = "import threading\nthreading.Thread(target=threading.Event().wait).start()"
    proc = _serve_patched(stray, "--grace", "1")
    try:
        _port(proc)
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_grpc_shutdown_that_hangs_stops_the_server_and_saves_its_sessions(tmp_path):
    """gRPC's own shutdown (``grpc.aio.Server.stop``) is awaited without a bound of its
    own: one that never ended left a SIGTERMed server running for ever, its sessions
    unsaved. The stop goes on STOP_SLACK_SECONDS past the grace and logs where every
    thread was."""
    hang = textwrap.dedent(
        """
        import asyncio
        from grpc.aio import _server
        async def never(self, grace):
            await asyncio.sleep(3600)
        _server.Server.stop = never
        """
    )
    state = tmp_path / "state"
    proc = _serve_patched(hang, "--grace", "1", "--state-dir", str(state))
    try:
        target = f"127.0.0.1:{_port(proc)}"
        client = gradserve.Client(target, shared_memory=False)
        value = np.arange(5, dtype=np.float32)
        ref, session_id = client.put(value), client.session_id
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 0, log
        assert time.monotonic() - started < 1 + STOP_SLACK_SECONDS + 10
        assert "going on without them" in log and "gradserve-loop" in log, log
    finally:
        proc.kill()
        proc.wait()
    _assert_restored(state, session_id, ref, value)


def test_a_thread_stuck_holding_a_sessions_lock_cannot_keep_a_stopped_server_alive():
    """A call stuck holding its session's lock (a fault elsewhere, made here) ran
    past the grace and was cancelled, and then freeing the sessions waited for that
    lock for ever: the SIGTERMed server never exited (a review helper). A watchdog
    armed at SIGTERM ends it STOP_SAVE_SECONDS past the grace and slack, with every
    thread's stack, exit code 1."""
    stuck = textwrap.dedent(
        """
        import threading
        from gradserve.server.core import sessions
        from gradserve.server.transport import app
        app.STOP_SLACK_SECONDS, app.STOP_SAVE_SECONDS = 1.0, 1.0
        real = sessions.Session.delete
        def delete(self, ids):
            ids = list(ids)
            if ids == ["stuck"]:
                with self._lock:
                    print("stuck", flush=True)
                    threading.Event().wait()
            return real(self, ids)
        sessions.Session.delete = delete
        """
    )
    proc = _serve_patched(stuck, "--grace", "1")
    try:
        target = f"127.0.0.1:{_port(proc)}"
        client = gradserve.Client(target, shared_memory=False, retries=0, timeout=60)

        def delete_stuck() -> None:
            with contextlib.suppress(gradserve.errors.GradserveError):
                client.delete("stuck")

        threading.Thread(target=delete_stuck, daemon=True).start()
        # SIGTERM once the call holds the lock (after a fixed wait, a call slower to
        # arrive was refused by the drain, and the server exited 0: a review helper).
        head = b""
        give_up = threading.Timer(30, proc.kill)  # (then the log ends: no hang here)
        give_up.start()
        try:
            while b"stuck" not in head:
                line = proc.stdout.readline()
                assert line, head.decode()
                head += line
        finally:
            give_up.cancel()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 1, log
        assert time.monotonic() - started < 20
        assert "Timeout (0:00:03)!" in log and "in delete" in log, log
    finally:
        proc.kill()
        proc.wait()


def test_an_unbounded_grace_arms_no_stop_watchdog():
    """``--grace inf``: the watchdog's timeout was out of ``faulthandler``'s range,
    which raised before the stop began; the SIGTERMed server exited 1 with its
    sessions unsaved (a review helper)."""
    try:
        for grace in (math.inf, math.nan, 1e12):
            watch_stop(grace, 0)
        watch_stop(1.0, 1 << 40)  # a large server's save: armed, and in range
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_a_sigterm_with_an_unbounded_grace_drains_and_saves(tmp_path):
    """``--grace inf`` (calls take as long as they take): the stop's bounded waits
    raised OverflowError, and the server exited 1 with its sessions unsaved."""
    server = ServerProcess("--grace", "inf", "--state-dir", str(tmp_path))
    client = gradserve.Client(server.target, shared_memory=False, retries=0)
    client.put(np.arange(3, dtype=np.float32))
    assert server.stop() == 0
    assert len(list(persistence.snapshot_files(tmp_path))) == 1
