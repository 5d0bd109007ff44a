"""Transient outputs this client has read in full, deleted on the server by its next call.

An op's outputs that do not fit its response stay on the server as *transient*
tensors, which the SDK streams back (GetTensor). Deleting one as its last chunk
leaves the server (``GetTensorRequest.delete_after``) loses it when the connection
breaks after that and before the client holds it all: the repeat finds nothing, and
a result that was computed is gone. So, when the server says it can (``KeepAlive``'s
``deletes_fetched``; an older server still gets ``delete_after``), the SDK fetches
without deleting and, once it holds the whole value, names the id in the metadata of
its next call (``x-gradserve-fetched``, ``MAX_FETCHED_IDS`` at most; more are deleted
with DeleteTensor just before that call), which the server deletes before it runs
that call. That costs no round trip, and the next op of this client never finds the
session's budget held by values it already fetched. (Another client attached to the
same session may: until this one makes a call, or for ``FLUSH_SECONDS``.) Ids that
no call carried within ``FLUSH_SECONDS`` (the worker went on computing on its own)
are deleted with DeleteTensor. A call or a DeleteTensor that fails gives its ids back
for the next call: deleting twice is harmless, since an id is never reused.

The uploads of a batch dropped without ``run()`` take the same way
(``Client._delete_dropped_uploads``): no other call needs them either.
"""

from __future__ import annotations

import logging
import threading
import weakref
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
        # Weakly: the flush thread must not keep an unclosed client alive.
        self._delete = weakref.WeakMethod(delete)
        self._flush_seconds = flush_seconds
        self._lock = threading.Lock()
        self._ids: list[str] = []
        self._added = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, *tensor_ids: str) -> None:
        with self._lock:
            self._ids.extend(tensor_ids)
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

    def give_back(self, ids: list[str], *, wake: bool = True) -> None:
        """Ids of a call that failed: the next call carries them (or, with ``wake``,
        the idle flush, if no call comes)."""
        if ids:
            with self._lock:
                self._ids[:0] = ids
            if wake:
                self._added.set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def flush(self) -> None:
        """Delete every id now (DeleteTensor); if that fails, the ids wait for the
        next call to carry them."""
        ids = self.take(limit=len(self))
        delete = self._delete()
        if not ids or delete is None:
            return
        try:
            delete(ids)
        except GradserveError as e:
            log.warning("could not delete %d fetched tensor(s) yet: %s", len(ids), e)
            self.give_back(ids, wake=False)  # the next call carries them

    def close(self) -> None:
        self._closed.set()
        self._added.set()

    def _flush_when_idle(self) -> None:
        while not self._closed.is_set() and self._delete() is not None:
            if not self._added.wait(5.0):
                continue  # to notice a client that was dropped without close()
            self._added.clear()
            # Give the worker's next call the chance to carry them.
            if self._closed.wait(self._flush_seconds):
                return
            self.flush()
