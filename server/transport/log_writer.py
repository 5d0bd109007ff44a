"""The server's log lines, written by a thread of their own.

A log line is a write to stderr, and stderr is often a pipe: a container runtime's,
a supervisor's, a test harness's. When its reader stops reading (stopped, frozen,
busy) the pipe fills (64 KiB on Linux) and the next write blocks until it reads
again. Written on the thread that logs, that blocked the event loop inside its
handler's lock (every failed call logs a line at INFO), so no call was answered,
health checks included; and SIGTERM's "draining" line then waited on the same lock,
so the server never drained, never saved its sessions, and had to be killed.

So records are handed to a bounded queue, never waiting (``logging.handlers``'s
``QueueHandler``), and one daemon thread writes them. While the reader does not
read, that thread is the only one blocked; records beyond the queue's room are
counted and dropped, and a warning says how many once there is room again. At exit
``close`` gives the thread a few seconds to write what is queued; if the reader is
still not reading, ``cli.main`` leaves the process without flushing stderr (which would
block as well), its state already saved.
"""

from __future__ import annotations

import copy
import logging
import logging.handlers
import queue
import threading

#: Records waiting to be written, at most (beyond: dropped and counted).
QUEUE_RECORDS = 10_000


class LogWriter:
    """``handler`` (the one that writes) fed from a bounded queue by one thread; log
    through ``queue_handler``."""

    def __init__(self, handler: logging.Handler, capacity: int = QUEUE_RECORDS) -> None:
        self._queue: queue.Queue[logging.LogRecord | None] = queue.Queue(capacity)
        self._handler = handler
        self.queue_handler = _Enqueue(self._queue)
        self._thread = threading.Thread(target=self._write, name="gradserve-log", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Records dropped so far because the queue was full."""
        return self.queue_handler.dropped

    def _write(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                self._handler.handle(record)
            except Exception:  # noqa: BLE001 - a record that cannot be written is lost alone
                pass

    def close(self, timeout: float) -> bool:
        """Write what is queued, within ``timeout`` seconds; whether all of it was."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()


class _Enqueue(logging.handlers.QueueHandler):
    """Puts records on the queue without ever waiting; counts what did not fit."""

    def __init__(self, records: queue.Queue[logging.LogRecord | None]) -> None:
        super().__init__(records)
        self.dropped = 0
        self._reported = 0
        self._lock = threading.Lock()

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """The record with its message merged and its traceback as text (the writing
        thread formats it later, when its arguments may have changed), its other
        attributes (``fields``) kept for the writer's formatter."""
        record = copy.copy(record)
        record.msg = record.message = record.getMessage()
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.exc_info = None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        with self._lock:
            try:
                if self.dropped > self._reported:
                    self.queue.put_nowait(self._dropped_record())
                    self._reported = self.dropped
                self.queue.put_nowait(record)
            except queue.Full:
                self.dropped += 1

    def _dropped_record(self) -> logging.LogRecord:
        lost = self.dropped - self._reported
        return logging.LogRecord(
            "gradserve.log", logging.WARNING, __file__, 0,
            f"{lost} log record(s) dropped: the log's reader was not reading",
            None, None,
        )  # fmt: skip
