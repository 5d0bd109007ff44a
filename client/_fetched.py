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

A server that crashed and restarted from its last snapshot (``--state-dir``) holds
again what was deleted after that snapshot, against the session's byte limit, until
it expires there (5 minutes for an output not yet read out when the snapshot was
taken). So the ids calls carried in the last ``RESEND_SECONDS`` are remembered, and
carried again by the next call that gets through after one failed UNAVAILABLE
(``resend_recent``, once per outage: ``reachable`` ends it): the connection broke,
and the server may have restarted.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable

from gradserve.errors import GradserveError, SessionLostError, UnavailableError
from gradserve.protocol import MAX_FETCHED_IDS

log = logging.getLogger(__name__)

#: Ids waiting longer than this for a call to carry them are deleted by a call of
#: their own.
FLUSH_SECONDS = 0.25
#: How long the ids a call carried are carried again after a call fails UNAVAILABLE
#: (``Fetched.resend_recent``): longer than a snapshot interval and a restart take.
RESEND_SECONDS = 120.0
#: At most this many are remembered (the oldest go first).
MAX_REMEMBERED = 1024
#: The longest pause between the idle flush's tries while its deletes fail.
MAX_FLUSH_PAUSE_SECONDS = 30.0


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
        #: Ids already taken to be deleted, and when first taken (``resend_recent``).
        self._taken: collections.OrderedDict[str, float] = collections.OrderedDict()
        #: ``resend_recent`` ran since a call last got through (``reachable``).
        self._resent = False
        self._added = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, *tensor_ids: str) -> None:
        with self._lock:
            self._ids.extend(tensor_ids)
            self._start_flush_locked()
        self._added.set()

    def _start_flush_locked(self) -> None:
        if self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(
                target=self._flush_when_idle, name="gradserve-fetched", daemon=True
            )
            self._thread.start()

    def take(self, limit: int = MAX_FETCHED_IDS) -> list[str]:
        """Up to ``limit`` ids, now the caller's to send (or ``give_back``)."""
        with self._lock:
            if not self._ids:  # (every call asks: most find none)
                return []
            ids, self._ids = self._ids[:limit], self._ids[limit:]
            now = time.monotonic()
            for tensor_id in ids:
                self._taken.setdefault(tensor_id, now)
            while len(self._taken) > MAX_REMEMBERED:
                self._taken.popitem(last=False)
        return ids

    def resend_recent(self) -> None:
        """A call failed UNAVAILABLE: the server may have restarted from a snapshot
        taken before it deleted the ids taken in the last ``RESEND_SECONDS``; the next
        call carries them again (deleting twice is harmless: an id is never reused).
        Once until a call gets through (``reachable``): repeated by each failed
        attempt, and by the idle flush's own failed deletes, it had the flush try four
        times a second while the server was down (a review helper). If no call comes,
        the idle flush deletes them, trying again after pauses that double."""
        now = time.monotonic()
        with self._lock:
            if self._resent:
                return
            self._resent = True
            while self._taken and now - next(iter(self._taken.values())) > RESEND_SECONDS:
                self._taken.popitem(last=False)
            pending = set(self._ids)
            again = [t for t in self._taken if t not in pending]
            self._ids.extend(again)
            self._taken.clear()  # remembered again, from now, once a call takes them
            if again:
                self._start_flush_locked()
        if again:
            self._added.set()

    def reachable(self) -> None:
        """A call got through: a later UNAVAILABLE is another outage."""
        self._resent = False

    @property
    def out_of_reach(self) -> bool:
        """A call failed UNAVAILABLE and none got through since: what a call cannot
        carry waits for the idle flush, which backs off, not for a DeleteTensor
        before each attempt (a review helper: ten failed a second, each warned)."""
        return self._resent

    def give_back(self, ids: list[str], *, wake: bool = True) -> None:
        """Ids of a call that failed: the next call carries them (or, with ``wake``,
        the idle flush, if no call comes)."""
        if ids:
            with self._lock:
                pending = set(self._ids)  # (``resend_recent`` may have put them back)
                self._ids[:0] = [t for t in ids if t not in pending]
            if wake:
                self._added.set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def flush(self) -> bool:
        """Delete every id now (DeleteTensor); if that fails, the ids wait for the
        next call to carry them, or the idle flush's next try. Returns whether none
        is left waiting."""
        ids = self.take(limit=len(self))
        delete = self._delete()
        if not ids or delete is None:
            return True
        try:
            delete(ids)
        except SessionLostError:
            return True  # gone with their session: nothing left to delete
        except GradserveError as e:
            log.warning("could not delete %d fetched tensor(s) yet: %s", len(ids), e)
            self.give_back(ids, wake=False)  # the next call carries them
            # Only a server out of reach is tried again (a review helper: any
            # other refusal was tried every 30 s for the client's life).
            return not isinstance(e, UnavailableError)
        return True

    def close(self) -> None:
        self._closed.set()
        self._added.set()

    def _flush_when_idle(self) -> None:
        """Ids no call carried within ``flush_seconds`` are deleted here; a delete
        that failed (the server down) is tried again after pauses doubling up to
        ``MAX_FLUSH_PAUSE_SECONDS``, until a call or a try deletes them: a client
        idle through a restart deletes again what the restart brought back
        (``resend_recent``), and a server down is not asked four times a second."""
        pause = 0.0  # after a failed delete: doubles, up to MAX_FLUSH_PAUSE_SECONDS
        while not self._closed.is_set() and self._delete() is not None:
            if pause:
                if self._closed.wait(pause):
                    return
            else:
                if not self._added.wait(5.0):
                    continue  # to notice a client that was dropped without close()
                self._added.clear()
                # Give the worker's next call the chance to carry them.
                if self._closed.wait(self._flush_seconds):
                    return
            if self.flush():
                pause = 0.0
            else:
                pause = min(2 * (pause or self._flush_seconds), MAX_FLUSH_PAUSE_SECONDS)
