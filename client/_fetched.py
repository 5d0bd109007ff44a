"""Transient outputs this client has read in full, deleted on the server by its next call.

An op's outputs that do not fit its response stay on the server as *transient*
tensors, which the SDK streams back (GetTensor). Deleting one as its last chunk
leaves the server (``GetTensorRequest.delete_after``) loses it when the connection
breaks after that and before the client holds it all: the repeat finds nothing, and
a result that was computed is gone. So the SDK fetches without deleting and, once it
holds the whole value, names the id in the metadata of its next call
(``x-gradserve-fetched``), which the server deletes before it runs that call. That
costs no round trip, and the op that follows never finds the session's budget held
by values already fetched. Ids that no call carried within ``FLUSH_SECONDS`` (the
worker went on computing on its own) are deleted with DeleteTensor. A call that
fails gives its ids back for the next one: deleting twice is harmless, since an id
is never reused.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gradserve.errors import GradserveError
from gradserve.protocol import MAX_FETCHED_IDS

log = logging.getLogger(__name__)

#: Ids waiting longer than this for a call to carry them are deleted by a call of
#: their own.
FLUSH_SECONDS = 0.25


class Fetched:
    """Ids fetched and not yet deleted; ``delete(ids)`` deletes them (a DeleteTensor)."""

    def __init__(
        self, delete: Callable[[list[str]], object], flush_seconds: float = FLUSH_SECONDS
    ) -> None:
        self._delete = delete
        self._flush_seconds = flush_seconds
        self._lock = threading.Lock()
        self._ids: list[str] = []
        self._added = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, tensor_id: str) -> None:
        with self._lock:
            self._ids.append(tensor_id)
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(
                    target=self._flush_when_idle, name="gradserve-fetched", daemon=True
                )
                self._thread.start()
        self._added.set()

    def take(self, limit: int = MAX_FETCHED_IDS) -> list[str]:
        """Up to ``limit`` ids, now the caller's to send (or ``give_back``)."""
        with self._lock:
            ids, self._ids = self._ids[:limit], self._ids[limit:]
        return ids

    def give_back(self, ids: list[str]) -> None:
        """Ids of a call that failed: the next call carries them."""
        if ids:
            with self._lock:
                self._ids[:0] = ids
            self._added.set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def flush(self) -> None:
        """Delete every id now (a call per ``MAX_FETCHED_IDS``); one that fails is
        logged, and the session's close or idle timeout frees what it held."""
        while ids := self.take():
            try:
                self._delete(ids)
            except GradserveError as e:
                log.debug("could not delete %d fetched tensor(s): %s", len(ids), e)
                return

    def close(self) -> None:
        self._closed.set()
        self._added.set()

    def _flush_when_idle(self) -> None:
        while not self._closed.is_set():
            self._added.wait()
            self._added.clear()
            # Give the worker's next call the chance to carry them.
            if self._closed.wait(self._flush_seconds):
                return
            self.flush()
