"""Sessions: the unit of server-side state, ownership and routing.

A session owns its TensorArrays, their gradient arrays (keyed by forward
handle and ``source``) and its resident tensors. Ids are random 128+ bit
tokens; a handle or tensor id is looked up only inside its own session, so one
from another session is simply not found. Closing a session, or letting it sit
idle past its TTL, frees everything in it.

Locking: the store's lock guards only the id table; each session has its own
lock guarding its tables; each TensorArray has its own lock. Order is always
store -> session -> array, and no array lock is held while taking a session
lock, so ops on different arrays (and sessions) run concurrently.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterable

import numpy as np

from gradserve.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from gradserve.server.tensor_array import TensorArray


def new_token(nbytes: int = 16) -> str:
    """An unguessable id: ``nbytes`` random bytes, URL-safe text."""
    return secrets.token_urlsafe(nbytes)


class Session:
    """All state of one client session. Thread-safe."""

    def __init__(self, session_id: str, *, max_tensor_bytes: int | None = None) -> None:
        self.id = session_id
        self.max_tensor_bytes = max_tensor_bytes
        self.last_used = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self._name_counter = 0
        self._arrays: dict[str, TensorArray] = {}
        self._grads: dict[tuple[str, str], str] = {}
        self._resident: dict[str, np.ndarray] = {}

    def touch(self) -> None:
        self.last_used = time.monotonic()

    # ---------------------------------------------------------------- arrays
    def create_tensor_array(self, *, tensor_array_name: str, **attrs) -> tuple[str, TensorArray]:
        """A new forward TensorArray; returns its handle id and the array.

        Its name is ``tensor_array_name`` (or "TensorArrayV3") plus a counter,
        as TensorFlow names arrays, so messages read like TensorFlow's.
        """
        with self._lock:
            self._check_open()
            self._name_counter += 1
            name = f"{tensor_array_name or 'TensorArrayV3'}_{self._name_counter}"
            ta = TensorArray(name=name, max_output_bytes=self.max_tensor_bytes, **attrs)
            handle = new_token()
            self._arrays[handle] = ta
            return handle, ta

    def tensor_array(self, handle: str) -> TensorArray:
        with self._lock:
            ta = self._arrays.get(handle)
        if ta is None:
            raise NotFoundError(
                f"TensorArray handle {handle!r} does not exist in this session",
                reason="TENSOR_ARRAY_NOT_FOUND",
                field="handle",
            )
        return ta

    def grad_array(
        self, handle: str, source: str, shape_to_prepend: tuple[int, ...] = ()
    ) -> tuple[str, TensorArray]:
        """TensorArrayGradV3's lookup-or-create of the gradient of ``handle`` for ``source``.

        The same (handle, source) always returns the same gradient array (a
        later ``shape_to_prepend`` is ignored, as in TensorFlow); a new source
        makes a separate one.
        """
        forward = self.tensor_array(handle)
        if forward.is_grad:
            raise InvalidArgumentError(
                f"Wrong input container. _tensor_array_grads{forward.name}: "
                "TensorArrayGradV3 takes a forward TensorArray, not a gradient array",
                field="handle",
            )
        with self._lock:
            self._check_open()
            key = (handle, source)
            grad_handle = self._grads.get(key) or new_token()

            def lookup() -> TensorArray | None:
                return self._arrays.get(grad_handle) if key in self._grads else None

            def register(grad: TensorArray) -> None:
                self._arrays[grad_handle] = grad
                self._grads[key] = grad_handle

            grad = forward.make_grad(
                name=f"{forward.name}@{source}",
                shape_to_prepend=shape_to_prepend,
                lookup=lookup,
                register=register,
            )
            return grad_handle, grad

    # ---------------------------------------------------------------- tensors
    def put(self, array: np.ndarray) -> str:
        """Keep ``array`` (never mutated afterwards) in the session; returns its id."""
        if self.max_tensor_bytes is not None and array.nbytes > self.max_tensor_bytes:
            raise ResourceExhaustedError(
                f"tensor of {array.nbytes} bytes is over the server's max tensor size of "
                f"{self.max_tensor_bytes} bytes",
                reason="TENSOR_TOO_LARGE",
            )
        tensor_id = new_token()
        with self._lock:
            self._check_open()
            self._resident[tensor_id] = array
        return tensor_id

    def get(self, tensor_id: str) -> np.ndarray:
        with self._lock:
            array = self._resident.get(tensor_id)
        if array is None:
            raise NotFoundError(
                f"resident tensor {tensor_id!r} does not exist in this session",
                reason="TENSOR_NOT_FOUND",
                field="ref",
            )
        return array

    def delete(self, tensor_ids: Iterable[str]) -> int:
        with self._lock:
            return sum(self._resident.pop(t, None) is not None for t in tensor_ids)

    def stats(self) -> dict[str, int]:
        """Counts and bytes held, for tests and metrics."""
        with self._lock:
            arrays = list(self._arrays.values())
            resident = list(self._resident.values())
        return {
            "tensor_arrays": len(arrays),
            "resident_tensors": len(resident),
            "bytes": sum(a.nbytes for a in resident) + sum(t.nbytes() for t in arrays),
        }

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Free everything; later use of this session object fails."""
        with self._lock:
            self._closed = True
            arrays = list(self._arrays.values())
            self._arrays.clear()
            self._grads.clear()
            self._resident.clear()
        for ta in arrays:
            ta.close()

    def _check_open(self) -> None:
        if self._closed:
            raise NotFoundError(f"session {self.id!r} is closed", reason="SESSION_NOT_FOUND")


class SessionStore:
    """Every open session, by id; expires idle ones."""

    def __init__(self, *, idle_timeout: float = 3600.0, max_tensor_bytes: int | None = None):
        self.idle_timeout = idle_timeout
        self.max_tensor_bytes = max_tensor_bytes
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def create(self) -> Session:
        session = Session(new_token(24), max_tensor_bytes=self.max_tensor_bytes)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The open session ``session_id`` (refreshing its idle timer)."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise NotFoundError(
                "session not found: it was closed, expired, or never existed "
                "(pass the id CreateSession returned in 'x-gradserve-session' metadata)",
                reason="SESSION_NOT_FOUND",
            )
        session.touch()
        return session

    def close(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise NotFoundError("session not found", reason="SESSION_NOT_FOUND")
        session.close()

    def expire_idle(self, now: float | None = None) -> int:
        """Close sessions unused for longer than the idle timeout; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [s for s in self._sessions.values() if now - s.last_used > self.idle_timeout]
            for s in stale:
                del self._sessions[s.id]
        for s in stale:
            s.close()
        return len(stale)

    def close_all(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            s.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
