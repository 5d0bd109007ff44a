"""What a group of RPCs defined apart from ``servicer.py`` may use of the servicer.

``GradServeServicer`` is assembled from such groups (``shm_handlers``,
``tensor_handlers``); each inherits this, so the attributes and the session lookup
it relies on are declared once.
"""

from __future__ import annotations

from typing import Any

from gradserve.server.core.sessions import Session


class ServicerPart:
    """Provided by ``GradServeServicer``."""

    light: Any
    compute: Any
    max_message_bytes: int

    def _session(self, context: Any) -> Session:  # pragma: no cover - the servicer's
        raise NotImplementedError
