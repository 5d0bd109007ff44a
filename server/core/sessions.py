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

import contextlib
import dataclasses
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

import numpy as np

from gradserve import dtypes
from gradserve.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from gradserve.server.core.budget import MemoryBudget
from gradserve.server.core.tensor_array import TensorArray

#: The principal of every session when authentication is off.
ANONYMOUS = "anonymous"

#: A tensor as the session keeps it: a NumPy array, or a device (CuPy) array once an
#: op that computes on the GPU has read or produced it.
Array = Any


@dataclasses.dataclass(frozen=True)
class Resident:
    """An op argument named by the id of a tensor the session keeps.

    The op resolves it (``Session.resolve``) only once it needs the value, so that it
    can validate before moving a tensor to the device (``Session.place``) and return a
    stored tensor itself where its semantics allow (StopGradient).
    """

    id: str


#: An op's tensor argument: a value that came with the request, or a resident tensor.
TensorArg = np.ndarray | Resident


@dataclasses.dataclass
class _Kept:
    """A resident tensor and the streams reading it."""

    array: Array
    #: The bytes charged for it (``dtypes.nbytes``, counted once: for strings, a pass).
    nbytes: int
    #: Streams (GetTensor) reading it now: its bytes stay charged while any does.
    readers: int = 0
    #: Deleted (or its session closed) while read: the last reader releases its bytes.
    dropped: bool = False


def new_token(nbytes: int = 16) -> str:
    """An unguessable id: ``nbytes`` random bytes, URL-safe text."""
    return secrets.token_urlsafe(nbytes)


class Session:
    """All state of one client session, owned by one principal. Thread-safe.

    ``budget`` counts the bytes the session holds (resident tensors and
    TensorArray values) against the per-session limit and, through its parent,
    the server-wide one.
    """

    def __init__(
        self,
        session_id: str,
        *,
        principal: str = ANONYMOUS,
        max_tensor_bytes: int | None = None,
        max_tensor_array_size: int | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.id = session_id
        self.principal = principal
        self.max_tensor_bytes = max_tensor_bytes
        self.max_tensor_array_size = max_tensor_array_size
        self.budget = budget or MemoryBudget(None, f"session {session_id[:8]}")
        self.last_used = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self._name_counter = 0
        self._arrays: dict[str, TensorArray] = {}
        self._grads: dict[tuple[str, str], str] = {}
        self._resident: dict[str, _Kept] = {}
        #: Bytes held for tensors still arriving (``reserve_tensor``).
        self._reservations: set[TensorReservation] = set()

    def touch(self) -> None:
        self.last_used = time.monotonic()

    # ---------------------------------------------------------------- arrays
    def create_tensor_array(
        self, *, tensor_array_name: str, **attrs: Any
    ) -> tuple[str, TensorArray]:
        """A new forward TensorArray; returns its handle id and the array.

        Its name is ``tensor_array_name`` (or "TensorArrayV3") plus a counter,
        as TensorFlow names arrays, so messages read like TensorFlow's.
        """
        with self._lock:
            self._check_open()
            self._name_counter += 1
            name = f"{tensor_array_name or 'TensorArrayV3'}_{self._name_counter}"
            ta = TensorArray(
                name=name,
                max_output_bytes=self.max_tensor_bytes,
                max_size=self.max_tensor_array_size,
                budget=self.budget,
                **attrs,
            )
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
    def check_tensor_bytes(self, nbytes: int) -> None:
        """Refuse a single tensor over the server's max tensor size."""
        if self.max_tensor_bytes is not None and nbytes > self.max_tensor_bytes:
            raise ResourceExhaustedError(
                f"tensor of {nbytes} bytes is over the server's max tensor size of "
                f"{self.max_tensor_bytes} bytes (--max-tensor-bytes)",
                reason="TENSOR_TOO_LARGE",
            )

    def put(self, array: Array, nbytes: int | None = None) -> str:
        """Keep ``array`` (never mutated afterwards) in the session; returns its id.

        Its size (``nbytes``: ``dtypes.nbytes(array)``, if the caller has it) is
        checked and its bytes charged to the session's budget.
        """
        nbytes = dtypes.nbytes(array) if nbytes is None else nbytes
        with self.reserve_tensor(nbytes) as reservation:
            return reservation.keep(array)

    def reserve_tensor(self, nbytes: int) -> TensorReservation:
        """Hold ``nbytes`` of the budget for a tensor that is still to be made (a
        stream still arriving), so that the budget refuses it before anything is
        allocated. Use as a context manager: what is not kept is released on exit."""
        self.check_tensor_bytes(nbytes)
        with self._lock:
            self._check_open()
            self.budget.reserve(nbytes)
            reservation = TensorReservation(self, nbytes)
            self._reservations.add(reservation)
        return reservation

    def _keep_reserved(self, reservation: TensorReservation, array: Array) -> str:
        """``array`` kept on ``reservation``'s bytes; raises (keeping nothing) once the
        session is closed, whose ``close`` released the reservation."""
        tensor_id = new_token()
        with self._lock:
            self._check_open()
            self._reservations.discard(reservation)
            self._resident[tensor_id] = _Kept(array, reservation.nbytes)
        return tensor_id

    def _give_up(self, reservation: TensorReservation) -> None:
        """Release a reservation not kept (unless ``close`` released it already)."""
        with self._lock:
            if reservation not in self._reservations:
                return
            self._reservations.discard(reservation)
        self.budget.release(reservation.nbytes)

    def resolve(self, arg: TensorArg) -> Array:
        """The value of an op argument: the array itself, or the resident tensor as kept
        (host or device array)."""
        return self.get(arg.id) if isinstance(arg, Resident) else arg

    def place(self, arg: TensorArg, to_device: Callable[[Array], Array]) -> Array:
        """The argument where the op computes: a resident tensor moved there and kept
        there (``get_placed``); a request's own value is the op's to convert."""
        return self.get_placed(arg.id, to_device) if isinstance(arg, Resident) else arg

    def get(self, tensor_id: str) -> Array:
        with self._lock:
            return self._kept(tensor_id).array

    def _kept(self, tensor_id: str) -> _Kept:
        """(caller holds ``_lock``)"""
        kept = self._resident.get(tensor_id)
        if kept is None:
            raise NotFoundError(
                f"resident tensor {tensor_id!r} does not exist in this session",
                reason="TENSOR_NOT_FOUND",
                field="ref",
            )
        return kept

    @contextlib.contextmanager
    def reading(self, tensor_id: str) -> Iterator[Array]:
        """The tensor, for a stream that reads it out: its bytes stay charged until the
        stream ends, even if the tensor is deleted (or the session closed) meanwhile,
        because the stream keeps the memory alive until then."""
        with self._lock:
            kept = self._kept(tensor_id)
            kept.readers += 1
        try:
            yield kept.array
        finally:
            with self._lock:
                kept.readers -= 1
                release = kept.dropped and kept.readers == 0
            if release:
                self.budget.release(kept.nbytes)

    def get_placed(self, tensor_id: str, place: Callable[[Any], Any]) -> Any:
        """The tensor as ``place`` puts it (on the GPU, for a CUDA server's ops), and
        kept there for later calls.

        A tensor is immutable, so the placed copy replaces the stored one rather than
        sitting beside it: its bytes stay charged once, and a weight put once is
        copied to the GPU once however many calls read it. Host consumers copy it
        back, as they do with the GPU outputs of ops.
        """
        with self._lock:
            kept = self._kept(tensor_id)
            array = kept.array
        placed = place(array)
        if placed is not array:
            with self._lock:
                if self._resident.get(tensor_id) is kept and kept.array is array:
                    kept.array = placed  # not deleted or placed meanwhile
        return placed

    def delete(self, tensor_ids: Iterable[str]) -> int:
        """Drop tensors; returns how many existed. Bytes of one still being read out
        are released when its last reader ends."""
        with self._lock:
            dropped = [k for k in (self._resident.pop(t, None) for t in tensor_ids) if k]
            freed = self._drop(dropped)
        self.budget.release(freed)
        return len(dropped)

    @staticmethod
    def _drop(dropped: Iterable[_Kept]) -> int:
        """Mark tensors gone; returns the bytes free now (caller holds ``_lock``)."""
        freed = 0
        for kept in dropped:
            if kept.readers:
                kept.dropped = True
            else:
                freed += kept.nbytes
        return freed

    # ---------------------------------------------------------------- lifecycle
    @property
    def closed(self) -> bool:
        """True once closed: streams of this session stop at their next chunk."""
        return self._closed

    def close(self) -> int:
        """Free everything, reservations of tensors still arriving included; later use
        of this session object fails. Returns the bytes freed."""
        with self._lock:
            self._closed = True
            arrays = list(self._arrays.values())
            freed = self._drop(self._resident.values())
            freed += sum(r.nbytes for r in self._reservations)
            self._arrays.clear()
            self._grads.clear()
            self._resident.clear()
            self._reservations.clear()
        self.budget.release(freed)
        for ta in arrays:  # each releases its own bytes
            freed += ta.nbytes()
            ta.close()
        return freed

    def _check_open(self) -> None:
        if self._closed:
            raise NotFoundError(f"session {self.id!r} is closed", reason="SESSION_NOT_FOUND")


class TensorReservation:
    """Budget bytes held for one tensor until it is kept (``keep``) or given up (on
    leaving the ``with`` block without keeping it, whatever the reason)."""

    def __init__(self, session: Session, nbytes: int) -> None:
        self.session = session
        self.nbytes = nbytes
        self._open = True

    def keep(self, array: Array) -> str:
        """Keep ``array`` (of the reserved size) in the session under a new id."""
        if array.dtype != dtypes.STRING and array.nbytes != self.nbytes:
            raise ValueError(f"reserved {self.nbytes} bytes, got an array of {array.nbytes}")
        tensor_id = self.session._keep_reserved(self, array)
        self._open = False
        return tensor_id

    def __enter__(self) -> TensorReservation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._open:
            self._open = False
            self.session._give_up(self)


class SessionStore:
    """Every open session, by id: creation limits, ownership, idle expiry, draining."""

    def __init__(
        self,
        *,
        idle_timeout: float = 3600.0,
        max_tensor_bytes: int | None = None,
        max_tensor_array_size: int | None = None,
        max_sessions: int | None = None,
        max_sessions_per_principal: int | None = None,
        max_session_bytes: int | None = None,
        max_principal_bytes: int | None = None,
        max_server_bytes: int | None = None,
        on_release: Callable[[int], None] | None = None,
    ):
        self.idle_timeout = idle_timeout
        self.max_tensor_bytes = max_tensor_bytes
        self.max_tensor_array_size = max_tensor_array_size
        self.max_sessions = max_sessions
        self.max_sessions_per_principal = max_sessions_per_principal
        self.max_session_bytes = max_session_bytes
        self.max_principal_bytes = max_principal_bytes
        self.budget = MemoryBudget(
            max_server_bytes, "server (--max-server-bytes)", on_release=on_release
        )
        #: Each principal's bytes, all its sessions together, inside the server's.
        self._principals: dict[str, MemoryBudget] = {}
        self._principal_lock = threading.Lock()
        self.expired = 0  # sessions closed by the idle timeout, for metrics
        self.draining = False
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def create(self, principal: str = ANONYMOUS) -> Session:
        """A new session for ``principal``; refused past the session limits or while draining."""
        with self._lock:
            if self.draining:
                raise UnavailableError(
                    "the server is shutting down and accepts no new sessions",
                    reason="DRAINING",
                )
            if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
                raise ResourceExhaustedError(
                    f"the server holds its limit of {self.max_sessions} sessions "
                    "(--max-sessions); close one or retry later",
                    reason="TOO_MANY_SESSIONS",
                )
            owned = sum(s.principal == principal for s in self._sessions.values())
            limit = self.max_sessions_per_principal
            if limit is not None and owned >= limit:
                raise ResourceExhaustedError(
                    f"principal {principal!r} holds its limit of {limit} sessions "
                    "(--max-sessions-per-principal)",
                    reason="TOO_MANY_SESSIONS_FOR_PRINCIPAL",
                )
            session_id = new_token(24)
            session = Session(
                session_id,
                principal=principal,
                max_tensor_bytes=self.max_tensor_bytes,
                max_tensor_array_size=self.max_tensor_array_size,
                budget=MemoryBudget(
                    self.max_session_bytes,
                    "session (--max-session-bytes)",
                    parent=self.principal_budget(principal),
                ),
            )
            self._sessions[session_id] = session
        return session

    def principal_budget(self, principal: str) -> MemoryBudget:
        """The bytes ``principal`` holds in all its sessions, against
        ``--max-principal-bytes``. One per principal that ever opened a session: the
        token file bounds how many there are."""
        with self._principal_lock:
            budget = self._principals.get(principal)
            if budget is None:
                budget = MemoryBudget(
                    self.max_principal_bytes,
                    f"principal {principal!r} (--max-principal-bytes)",
                    parent=self.budget,
                )
                self._principals[principal] = budget
            return budget

    def get(self, session_id: str, principal: str = ANONYMOUS) -> Session:
        """The open session ``session_id`` of ``principal`` (refreshing its idle timer).

        Another principal's session is reported exactly as a missing one.
        """
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or not secrets.compare_digest(
            session.principal.encode(), principal.encode()
        ):
            raise NotFoundError(
                "session not found: it was closed, expired, or never existed "
                "(pass the id CreateSession returned in 'x-gradserve-session' metadata)",
                reason="SESSION_NOT_FOUND",
            )
        session.touch()
        return session

    def close(self, session_id: str, principal: str = ANONYMOUS) -> None:
        session = self.get(session_id, principal)
        with self._lock:
            self._sessions.pop(session_id, None)
        session.close()

    def expire_idle(self, now: float | None = None) -> int:
        """Close sessions unused for longer than the idle timeout; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [s for s in self._sessions.values() if now - s.last_used > self.idle_timeout]
            for s in stale:
                del self._sessions[s.id]
            self.expired += len(stale)
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
