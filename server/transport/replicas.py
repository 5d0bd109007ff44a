"""One replica among several: its state directory, adoption, and the metrics to scale on.

``StateKeeper`` runs the snapshots of ``server.core.persistence`` for a server: the
restore on start, the one after the drain on SIGTERM, the periodic ones
(``--snapshot-interval``), and the adoption of another replica's files on SIGHUP
(``--adopt-dir``). It keeps the figures an operator reads
(``gradserve_snapshot_*``, ``gradserve_sessions_restored_total``).

``register_metrics`` adds to a server's registry what a HorizontalPodAutoscaler or an
operator scales on besides sessions and bytes held: calls in flight, LSTM ops waiting
for a compute slot, and the limits they are measured against.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import threading
import time
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gradserve.kernels.compute import Compute
from gradserve.server.core import persistence
from gradserve.server.core.sessions import SessionStore
from gradserve.server.transport.config import ServerConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StateKeeper:
    """Snapshots and restores of one server's sessions (a no-op without a state dir)."""

    config: ServerConfig
    store: SessionStore
    compute: Compute
    last: persistence.SnapshotReport | None = None
    snapshots: int = 0
    failures: int = 0
    adopted: int = 0
    rejected: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    #: Held while an adoption runs: the snapshot after the drain waits for it.
    _adopting: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    #: None when no adoption runs; else whether a SIGHUP came since its pass began.
    _adopt_asked: bool | None = None
    _directory_lock: int | None = None  # the state dir's lock file, held while serving
    _restored_files: list[pathlib.Path] = dataclasses.field(default_factory=list)  # set aside
    _finished: bool = False  # the final snapshot is written: no other after it
    #: Sessions ended (closed, expired) since the running snapshot began: their files
    #: go after it too, as it may have written them (``forget``).
    _ended: set[str] = dataclasses.field(default_factory=set)
    _ended_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def forget(self, session_id: str) -> None:
        """A session its client closed, or that expired, is gone for good: its file
        goes now, not at the next snapshot (with ``--snapshot-interval``, a crash
        before that brought it back, holding its bytes and its principal's session
        places until its TTL: helper-71). A snapshot running meanwhile may write it
        again; it removes it once it has written (``snapshot``)."""
        if self.config.state_dir is None:
            return
        with self._ended_lock:
            self._ended.add(session_id)
        persistence.remove_session_file(self.config.state_dir, session_id)

    def serving(self) -> None:
        """The server has started: set the restored files aside (``restore``)."""
        persistence.set_aside(self._restored_files)
        self._restored_files = []

    def release(self) -> None:
        """Let go of the state dir (after the last snapshot): another server may take it."""
        if self._directory_lock is not None:
            os.close(self._directory_lock)
            self._directory_lock = None

    @property
    def enabled(self) -> bool:
        return self.config.state_dir is not None

    def restore(self) -> persistence.RestoreReport | None:
        """On start: take the state dir (``persistence.lock_directory``: refused with
        ``DirectoryInUseError`` while another server holds it) and serve again every
        session it holds."""
        if self.config.state_dir is None:
            return None
        if self._directory_lock is None:
            self._directory_lock = persistence.lock_directory(self.config.state_dir)
        # With periodic snapshots the files stay (a crash before the next one restores
        # them again); without, they are set aside once the server serves (a crash
        # then loses the sessions, rather than bringing back a state older than what
        # clients have since done; a snapshot whose write of one fails puts its file
        # back). Not before: a start that fails after the restore keeps them all.
        if self.config.snapshot_interval is None:
            persistence.clear_set_aside(self.config.state_dir)
        report = persistence.restore_dir(self.store, self.config.state_dir, remove=False)
        if self.config.snapshot_interval is None:
            self._restored_files = report.files
        self.rejected += report.rejected
        if report.restored or report.rejected:
            log.info(
                "restored %d session(s) from %s (%d file(s) rejected)",
                report.restored,
                self.config.state_dir,
                report.rejected,
            )
        return report

    def adopt(self) -> persistence.RestoreReport | None:
        """On SIGHUP: serve the sessions whose files are in the adopt dir (a removed
        replica's), by their own ids; the proxy may route their prefix here after.

        A SIGHUP while an adoption runs makes it go over the directory once more when
        it ends (files may have arrived meanwhile); it used to be dropped, with a
        warning, and files moved in during an adoption waited for the next SIGHUP.
        Returns the report of the first pass that read the directory (None if none
        did)."""
        directory = self.config.adopt_path()
        if directory is None:
            log.warning("SIGHUP: nothing to adopt (no --state-dir or --adopt-dir)")
            return None
        with self._lock:
            if self._adopt_asked is not None:
                self._adopt_asked = True
                log.info("SIGHUP while an adoption runs: the directory is read again after it")
                return None
            self._adopt_asked = False
        first: persistence.RestoreReport | None = None
        try:
            with self._adopting:
                while True:
                    report = self._adopt_once(directory)
                    first = report if first is None else first
                    with self._lock:
                        if not self._adopt_asked or self.store.draining:
                            self._adopt_asked = None
                            return first
                        self._adopt_asked = False
        except BaseException:
            with self._lock:
                self._adopt_asked = None
            raise

    def _adopt_once(self, directory: str) -> persistence.RestoreReport | None:
        if self.store.draining:  # its files stay for the replica that comes up next
            log.warning("SIGHUP while shutting down: nothing adopted")
            return None
        # Never the files of a server that still runs (it holds its directory's lock).
        try:
            held = persistence.lock_directory(directory)
        except (persistence.DirectoryInUseError, OSError) as e:
            log.error("SIGHUP: nothing adopted: %s", e)
            return None
        try:
            # A drain that begins meanwhile stops it after the file it is reading
            # (the files not read stay for the replica that comes up next); the
            # snapshot after the drain waits for it (``wait_for_adoption``), so
            # every session adopted is in it.
            state_dir = self.config.state_dir
            report = persistence.restore_dir(
                self.store, directory, remove=state_dir is None, stop=lambda: self.store.draining
            )
            with self._lock:  # no snapshot meanwhile (``persistence.take_over``)
                self.adopted += report.restored
                self.rejected += report.rejected
                if state_dir is not None and report.files:
                    errors = persistence.take_over(
                        report.files,
                        state_dir,
                        aside=self.config.snapshot_interval is None,
                        stop=lambda: self.store.draining,
                    )
                    for error in errors:
                        log.error(
                            "adopted session file not moved into %s (%s): set aside as "
                            "*%s in %s; its session is served here and is saved by the next "
                            "snapshot",
                            state_dir,
                            error,
                            persistence.ADOPTED_SUFFIX,
                            directory,
                        )
        finally:
            os.close(held)
        log.info(
            "adopted %d session(s) from %s (%d file(s) rejected)%s",
            report.restored,
            directory,
            report.rejected,
            "; stopped by the drain, the rest left there" if report.stopped else "",
        )
        if report.restored and self.config.snapshot_interval is not None:
            self.snapshot()  # in this replica's own state dir at once, not a period later
        return report

    def wait_for_adoption(self) -> None:
        """Return once no adoption runs (one that started before the drain ends soon:
        it stops after its current file)."""
        with self._adopting:
            pass

    def snapshot(self, *, final: bool = False) -> persistence.SnapshotReport | None:
        """Write every open session to the state dir (one at a time: a periodic one and
        the one at shutdown never interleave). After the ``final`` one (the drain's),
        none: a periodic one that began just before the drain and waited for this lock
        would find the sessions closing and remove their files."""
        if self.config.state_dir is None:
            return None
        with self._lock:
            if self._finished:
                return None
            self._finished = final
            started = time.monotonic()
            with self._ended_lock:
                self._ended.clear()  # (closed before the export: not in it)
            states = self.store.export_states()  # (waits for TensorArray ops inside)
            report = persistence.write_snapshot(states, self.config.state_dir, self.compute.to_host)
            with self._ended_lock:
                ended, self._ended = self._ended, set()
            for session_id in ended:  # ended while this snapshot ran
                persistence.remove_session_file(self.config.state_dir, session_id)
            report.seconds = time.monotonic() - started  # the wait included
            self.last = report
            self.snapshots += 1
            self.failures += report.failed
        level = logging.ERROR if report.failed else logging.INFO
        log.log(
            level,
            "snapshot: %d session(s), %d bytes in %.3fs to %s%s",
            report.written,
            report.bytes,
            report.seconds,
            self.config.state_dir,
            f"; {report.failed} NOT saved" if report.failed else "",
        )
        return report

    def run_periodically(self, stop: threading.Event) -> None:
        """Snapshot every ``--snapshot-interval`` seconds until ``stop`` is set."""
        interval = self.config.snapshot_interval
        if interval is None or self.config.state_dir is None:
            return
        while not stop.wait(interval):
            try:
                self.snapshot()
            except Exception:  # noqa: BLE001 - logged; the next period tries again
                log.exception("periodic snapshot failed")


class _ReplicaCollector:
    """The scale-out figures, read at scrape time."""

    def __init__(self, keeper: StateKeeper, servicer: Any) -> None:
        self.keeper = keeper
        self.servicer = servicer

    def collect(self) -> Any:
        keeper, servicer = self.keeper, self.servicer
        admission, heavy = servicer.admission, servicer.heavy

        def gauge(name: str, what: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, what)
            family.add_metric([], value)
            return family

        def counter(name: str, what: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, what)
            family.add_metric([], value)
            return family

        yield gauge(
            "gradserve_rpcs_in_flight", "GradServe calls being served now", admission.in_flight
        )
        if admission.max_calls is not None:
            yield gauge(
                "gradserve_rpcs_in_flight_limit", "--max-concurrent-rpcs", admission.max_calls
            )
        yield gauge("gradserve_streams_open", "PutTensor/GetTensor streams open", admission.streams)
        yield gauge(
            "gradserve_compute_queue_depth", "LSTM ops waiting for a compute slot", heavy.waiting
        )
        yield gauge("gradserve_compute_slots", "--compute-slots", heavy.threads)
        yield gauge(
            "gradserve_compute_running", "LSTM ops computing now", heavy.running - heavy.paused
        )
        yield gauge(
            "gradserve_compute_paused",
            "heavy ops (LSTM, Gradients) paused for another principal's (--compute-quantum)",
            heavy.paused,
        )
        yield counter(
            "gradserve_compute_pauses",
            "heavy ops (LSTM, Gradients) paused for another principal's, and resumed",
            heavy.pauses_total,
        )
        yield gauge(
            "gradserve_draining", "1 while the replica drains (SIGTERM)", int(admission.draining)
        )
        store: SessionStore = keeper.store
        if store.max_sessions is not None:
            yield gauge("gradserve_sessions_limit", "--max-sessions", store.max_sessions)
        if store.budget.limit is not None:
            yield gauge("gradserve_bytes_limit", "--max-server-bytes", store.budget.limit)
        yield counter(
            "gradserve_sessions_restored",
            "sessions restored from snapshots (at start and by adoption)",
            store.restored,
        )
        yield counter(
            "gradserve_sessions_adopted", "sessions adopted from --adopt-dir", keeper.adopted
        )
        yield counter(
            "gradserve_snapshot_files_rejected",
            "snapshot files that did not check out (corrupt, foreign, truncated)",
            keeper.rejected,
        )
        if keeper.enabled:
            yield counter("gradserve_snapshots", "snapshots written", keeper.snapshots)
            yield counter(
                "gradserve_snapshot_failures", "sessions a snapshot could not save", keeper.failures
            )
            last = keeper.last
            yield gauge(
                "gradserve_snapshot_seconds",
                "time of the last snapshot",
                last.seconds if last else 0,
            )
            yield gauge(
                "gradserve_snapshot_bytes", "bytes of the last snapshot", last.bytes if last else 0
            )
            yield gauge(
                "gradserve_snapshot_sessions",
                "sessions in the last snapshot",
                last.written if last else 0,
            )


def register_metrics(registry: Any, keeper: StateKeeper, servicer: Any) -> None:
    """Add the scale-out figures to a server's Prometheus ``registry``."""
    registry.register(_ReplicaCollector(keeper, servicer))
