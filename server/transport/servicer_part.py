"""What a group of RPCs defined apart from ``servicer.py`` may use of the servicer.

``GradServeServicer`` is assembled from such groups (``shm_handlers``,
``tensor_handlers``); each inherits this, so the attributes and the session lookup
it relies on are declared once.
"""

from __future__ import annotations

import threading
from typing import Any

from gradserve.server.core.sessions import Session


class ServicerPart:
    """Provided by ``GradServeServicer``."""

    light: Any
    compute: Any
    max_message_bytes: int

    def _session(self, context: Any) -> Session:  # pragma: no cover - the servicer's
        raise NotImplementedError


class ForgottenUnlessReplied:
    """The id a unary put keeps, deleted if its response never reaches the client.

    The put runs on a lane, which finishes what it started when the call is cancelled
    or passes its deadline (``lanes.Lane.run`` shields it); the tensor it then kept
    had an id nobody would learn, its bytes charged until the session closed. As an
    op's outputs (``servicer._call_over``), it is deleted when the call ends before
    the handler replied (gRPC's aio server ends a call past its deadline with
    ``cancelled()`` False, the handler still waiting on its lane) or cancelled; or as
    the lane keeps it, if the call ended first."""

    def __init__(self, session: Session, context: Any) -> None:
        self._session = session
        self._lock = threading.Lock()
        self._over = False
        self._replied = False
        self._ids: list[str] = []
        context.add_done_callback(self._call_over)

    def kept(self, tensor_id: str) -> str:
        """``tensor_id`` was kept (on the lane): deleted now if the call is over."""
        with self._lock:
            if not self._over:
                self._ids.append(tensor_id)
                return tensor_id
        self._session.delete([tensor_id])
        return tensor_id

    def replied(self) -> None:
        """The handler returns the response, with the id."""
        self._replied = True

    def _call_over(self, context: Any) -> None:
        if self._replied and not context.cancelled():
            return
        with self._lock:
            self._over = True
            ids, self._ids = self._ids, []
        self._session.delete(ids)
