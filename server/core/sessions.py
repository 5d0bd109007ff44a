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

import collections
import contextlib
import dataclasses
import functools
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from gradserve import dtypes
from gradserve.errors import (
    DRAINING_REASON,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TapeReleasedError,
    UnavailableError,
)
from gradserve.server.core.budget import MemoryBudget
from gradserve.server.core.grad_registry import GradRegistry
from gradserve.server.core.regions import RegionTable
from gradserve.server.core.snapshot_gate import SnapshotGate
from gradserve.server.core.tape import MAX_TAPES_PER_SESSION, RECORD_BYTES, Tape
from gradserve.server.core.tensor_array import (
    TensorArray,
    TensorArrayState,
    array_record_bytes,
)
from gradserve.warm_buffers import DEFAULT_LIMIT_BYTES, WarmBuffers

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


@dataclasses.dataclass(eq=False)
class _Kept:
    """A tensor the session holds, and how many hold it.

    Its bytes are charged once, however many hold it, and released when the last
    holder lets go: its entry in the id table (a resident tensor), a stream reading
    it out (GetTensor), each gradient tape that keeps it for a backward pass. Each id
    that names it is charged a record besides (``Session._ids``), released when
    nothing names that id any more: the same array kept under another id (an *alias*:
    StopGradient of a resident tensor, kept or held by a tape) costs only that.
    """

    array: Array
    #: Its bytes as charged (``dtypes.nbytes``, counted once: for strings, a pass).
    nbytes: int
    #: Holders: each entry naming it (in the id table, on each tape), each stream
    #: reading it, each op that pinned it (``Session.pin``).
    refs: int = 1


T = TypeVar("T")

#: A handed-out output still in its session this long after its reply left (or
#: after one of the reply's outputs was last read out), never read out itself, is
#: deleted (``Session.expire_handed_out``): the SDK fetches each at once.
HANDED_OUT_MAX_AGE_SECONDS = 300.0

#: One read out in full is deleted this long after (sooner if its session is short
#: of bytes: ``Session.reclaim_read_out``): the SDK deletes it by its next call.
#: After a crash the client may have deleted it already (the snapshot was older):
#: restored, it held the session's bytes, refusing the client's next ops, for the
#: whole HANDED_OUT_MAX_AGE_SECONDS (a review helper: 395 refused gathers); a client
#: whose stream broke after its last chunk asks again within seconds.
FETCHED_MAX_AGE_SECONDS = 30.0


#: One read out in full gives way to a reservation short of bytes only this long
#: after its reading (``Session.reclaim_read_out``): its client repeats a fetch whose
#: call ended on the server but whose status never reached it (the connection
#: broke) within its first retry pauses (a review helper: a repeat found nothing).
RECLAIM_AFTER_SECONDS = 5.0


class HandedOutReply:
    """The outputs one reply handed out for its client to fetch (*transient*
    outputs: they did not fit it), which the client fetches one after another: they
    age together, from the last sign of their client (``Session.expire_handed_out``).
    """

    __slots__ = ("readers", "since")

    def __init__(self, since: float | None = None) -> None:
        #: When the reply left gRPC (or the session was restored with them), or one of
        #: them was last read out; None while the reply is on its way.
        self.since = since
        #: Calls reading one of them out now (``Session.being_read``).
        self.readers = 0


@dataclasses.dataclass(slots=True)
class _HandedOut:
    """An output a reply handed out, until its client deletes it."""

    reply: HandedOutReply
    #: Read out in full, in time: its client has it (most likely: a stream's last
    #: chunks may still be on their way), and deletes it by its next call.
    fetched: bool = False


#: Bytes charged for each tensor a session holds besides its values: the array
#: object (a view of the request it came in, which it keeps alive), its entry in the
#: id table, its id (about 830 measured for a scalar put by ``PutTensorInline``).
#: Charged by values alone, a tensor of no elements cost nothing: 150,000 of them
#: fitted in a session of 1 MiB (three Batches), and a scalar was charged 4 bytes.
TENSOR_RECORD_BYTES = 1024


def tensor_charge(nbytes: int) -> int:
    """What holding a tensor of ``nbytes`` costs a session's budget: its bytes and its
    record."""
    return nbytes + TENSOR_RECORD_BYTES


#: Closed TensorArrays a session keeps (``Session.close_tensor_array``): their records
#: stay charged (about 1 KiB each), so at most a quarter MiB of a session's budget.
MAX_CLOSED_ARRAYS = 256


def new_token(nbytes: int = 16) -> str:
    """An unguessable id: ``nbytes`` random bytes, URL-safe text."""
    return secrets.token_urlsafe(nbytes)


#: A replica identity: a DNS label (what a StatefulSet pod name or a compose service
#: name is), so that it can name a proxy's upstream; no dot, which ends it in an id.
_REPLICA_ID = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def check_replica_id(replica_id: str) -> str:
    """``replica_id`` if it is a DNS label (lowercase letters, digits, inner dashes,
    at most 63), else ``InvalidArgumentError``."""
    if not _REPLICA_ID.fullmatch(replica_id):
        raise InvalidArgumentError(
            f"replica id {replica_id!r} is not a DNS label: lowercase letters, digits and "
            "inner dashes, 1 to 63 of them (it prefixes session ids, up to a dot)"
        )
    return replica_id


def replica_of(session_id: str) -> str | None:
    """The replica a session id names (the part before the first dot), if any."""
    head, dot, _ = session_id.partition(".")
    return head if dot else None


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
        buffers: WarmBuffers | None = None,
    ) -> None:
        self.id = session_id
        self.principal = principal
        self.max_tensor_bytes = max_tensor_bytes
        self.max_tensor_array_size = max_tensor_array_size
        self.budget = budget or MemoryBudget(None, f"session {session_id[:8]}")
        self.last_used = time.monotonic()
        #: Calls on this session still running (``call_started``): it is not idle.
        self._calls = 0
        self._calls_lock = threading.Lock()
        self._lock = threading.Lock()
        #: Ops that change the session in steps, against its snapshot (``changing``).
        self._gate = SnapshotGate()
        self._closed = False
        self._name_counter = 0
        self._arrays: dict[str, TensorArray] = {}
        self._grads = GradRegistry()
        #: Grad arrays a gradient computation made in a registry of its own
        #: (``grad_array``'s ``registry``): no TensorArrayGradV3 can name them, and a
        #: snapshot leaves them out (the computation drops them when it ends).
        self._private_grads: set[str] = set()
        #: Forward arrays a running gradient computation froze (made a grad array of,
        #: which switches dynamic sizing off), with their dynamic sizing before, one
        #: per computation: a snapshot exports them as before (the computation's grad
        #: arrays are not in it either), or a drain's last snapshot, taken while one
        #: ran past --grace and was then rolled back, froze them for good.
        self._frozen_by_gradients: dict[str, dict[int, bool]] = {}
        #: Handles of closed arrays, oldest first: at most ``MAX_CLOSED_ARRAYS`` kept.
        self._closed_arrays: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._resident: dict[str, _Kept] = {}
        #: Every tensor the session holds (in the id table, or on a tape), by the
        #: identity of its array: an op whose output is a held array itself
        #: (StopGradient of a resident tensor) keeps it as an alias, not charged again.
        self._by_array: dict[int, _Kept] = {}
        #: Each id of a held tensor, and how many entries name it (in the id table,
        #: on tapes): its record (``TENSOR_RECORD_BYTES``) stays charged until the last
        #: of them goes (``_entry_gone``).
        self._ids: dict[str, int] = {}
        #: Ids an op's call holds until the op ends (``keep_for_tapes(pin=True)``), and
        #: how many times: the tensor, its record and its id stay while a call that
        #: recorded it has still to reply, even if every tape that held it is released
        #: (``let_go_ids``).
        self._call_held: dict[str, tuple[_Kept, int]] = {}
        #: Bytes held for tensors still arriving (``reserve_tensor``).
        self._reservations: set[TensorReservation] = set()
        #: Live gradient tapes by id, and the ids of released ones (for a clear error).
        self._tapes: dict[str, Tape] = {}
        self._released_tapes: dict[str, None] = {}
        #: Non-persistent tapes a gradient computation used up (``spend_tape``), by id:
        #: released to every call, but what they hold is freed only once the results
        #: reached the client (``free_spent_tape``), or they come back if they did not
        #: (``unspend_tape``); released at once, a tape whose gradients' reply was
        #: lost had to be recorded again.
        self._spent_tapes: dict[str, Tape] = {}
        #: Ids of the tapes that were live when the snapshot this session was
        #: restored from was taken (``SessionState.lost_tapes``): snapshots do not keep
        #: tapes, and a client proposing one again (``start_tape``'s ``tape_id``) would
        #: have started an empty tape under it and got gradients of only what came
        #: after the restart (found by a review helper). Bounded as released ones.
        self._lost_tapes: dict[str, None] = {}
        #: Gradients computations so far: each gets its own grad-array ``source``.
        self._gradient_sources = 0
        #: The outputs ops' replies handed out to be fetched, by id, until deleted
        #: (``handed_out``): a drain waits for their fetches (``unfetched_outputs``),
        #: a snapshot keeps them marked, and those no client came for are deleted
        #: (``expire_handed_out``). A lock of its own: the drain reads it on the
        #: event loop, which must never wait for the session's.
        self._handed: dict[str, _HandedOut] = {}
        self._handed_lock = threading.Lock()
        # A reservation refused for want of bytes first frees the outputs its
        # client has read out already (``reclaim_read_out``).
        self.budget.reclaim = self._reclaim_without_waiting
        #: Same-host shared-memory regions the worker registered (``regions``), each at
        #: most the session's byte limit; closed with the session.
        self.regions = RegionTable(
            session_id,
            max_region_bytes=self.budget.limit,
            max_tensor_bytes=max_tensor_bytes,
            buffers=buffers,
        )

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def call_started(self) -> Callable[[], None]:
        """A call on this session began: until it ends (the function returned, which
        does it once however often it is called) the session is not idle, however
        long it runs. Idle was counted from each call's start, and a call running past
        the TTL with no other on its session (a long LSTM, a slow upload) had the
        session closed under it, its result lost (a review helper)."""
        with self._calls_lock:
            self._calls += 1
            self.last_used = time.monotonic()
        ended = False

        def end() -> None:
            nonlocal ended
            with self._calls_lock:
                if ended:
                    return
                ended = True
                self._calls -= 1
                self.last_used = time.monotonic()

        return end

    def idle_since(self) -> float | None:
        """When it was last used, or None while a call on it runs: read together, so
        that a call ending between the two reads (its long run past the TTL seen, and
        then no call running) does not make it look idle for that long (a review
        helper: 14,336 of 8.3 million such ends expired their session at once)."""
        with self._calls_lock:
            return None if self._calls else self.last_used

    # ---------------------------------------------------------------- arrays
    def create_tensor_array(
        self, *, tensor_array_name: str, **attrs: Any
    ) -> tuple[str, TensorArray]:
        """A new forward TensorArray; returns its handle id and the array.

        Its name is ``tensor_array_name`` (or "TensorArrayV3") plus a counter,
        as TensorFlow names arrays, so messages read like TensorFlow's.
        """
        prefix = tensor_array_name or "TensorArrayV3"

        def next_name() -> str:
            return f"{prefix}_{self._name_counter + 1}"

        def create() -> tuple[str, TensorArray]:
            with self._lock:
                self._check_open()
                ta = TensorArray(
                    name=next_name(),
                    max_output_bytes=self.max_tensor_bytes,
                    max_size=self.max_tensor_array_size,
                    budget=self.budget,
                    **attrs,
                )
                self._name_counter += 1  # (a refused one takes no number)
                handle = new_token()
                self._arrays[handle] = ta
                return handle, ta

        return self._reclaiming(create, lambda: array_record_bytes(next_name()))

    def close_tensor_array(self, handle: str) -> None:
        """TensorArrayCloseV3. The closed array stays, so that its handle says "already
        closed" as in TensorFlow, but only the ``MAX_CLOSED_ARRAYS`` most recently
        closed ones: older ones are forgotten (their handles then do not exist, their
        records' bytes are released). TensorFlow frees a closed array with its step or
        its handle; kept for ever, a session that makes an array per training step
        grew by one record (and a budget charge) per step, and a session of 1 MiB ran
        out after 991 steps."""
        ta = self.tensor_array(handle)
        ta.close()
        with self._lock:
            if self._closed or self._arrays.get(handle) is not ta:
                return
            self._closed_arrays[handle] = None
            self._closed_arrays.move_to_end(handle)
            forgotten = []
            while len(self._closed_arrays) > MAX_CLOSED_ARRAYS:
                old, _ = self._closed_arrays.popitem(last=False)
                forgotten.append(self._arrays.pop(old, None))
                self._grads.forget_array(old)  # (a grad of it stays, an array of its own)
        for gone in forgotten:
            if gone is not None:
                gone.discard()

    def forget_tensor_arrays(self, handles: Sequence[str]) -> None:
        """Remove forward arrays no client can name, with their grad arrays, and free
        their bytes: made by a call whose response never reached its client (the
        handle was only in it), each stayed charged until the session closed."""
        gone = []
        with self._lock:
            for handle in handles:
                for h in (handle, *self._grads.pop_grads_of(handle)):
                    self._closed_arrays.pop(h, None)
                    ta = self._arrays.pop(h, None)
                    if ta is not None:
                        gone.append(ta)
        for ta in gone:
            ta.discard()

    def record_bytes(self) -> int:
        """Bytes charged for records, not values: this session's TensorArrays' (the
        arrays and their slots: ``TensorArray.record_bytes``) and its live tapes' (the
        ops they recorded: ``tape.record_cost``)."""
        with self._lock:
            arrays = list(self._arrays.values())
            tapes = sum(tape.record_bytes for tape in self._tapes.values())
            tapes += sum(tape.record_bytes for tape in self._spent_tapes.values())
        return tapes + sum(ta.record_bytes() for ta in arrays)

    def tensor_array(self, handle: str) -> TensorArray:
        with self._lock:
            ta = self._arrays.get(handle)
            if ta is None:
                self._check_open()  # gone with its session, not on its own
        if ta is None:
            raise NotFoundError(
                f"TensorArray handle {handle!r} does not exist in this session",
                reason="TENSOR_ARRAY_NOT_FOUND",
                field="handle",
            )
        return ta

    def grad_source(self, handle: str) -> TensorArray:
        """The forward array ``handle`` names, checked as TensorArrayGradV3 checks it
        first: a gradient array is the wrong container (TensorFlow's words, alone),
        a closed one is refused."""
        forward = self.tensor_array(handle)
        if forward.is_grad:
            raise InvalidArgumentError(
                f"Wrong input container. _tensor_array_grads{forward.name}", field="handle"
            )
        forward.size()  # (closed: refused)
        return forward

    def grad_array(
        self,
        handle: str,
        source: str,
        shape_to_prepend: tuple[int, ...] = (),
        *,
        registry: GradRegistry | None = None,
    ) -> tuple[str, TensorArray]:
        """TensorArrayGradV3's lookup-or-create of the gradient of ``handle`` for ``source``.

        The same (handle, source) always returns the same gradient array (a
        later ``shape_to_prepend`` is ignored, as in TensorFlow); a new source
        makes a separate one. ``registry``: a gradient computation's own, instead
        of the session's (``drop_grad_arrays``).
        """
        forward = self.grad_source(handle)
        name = f"{forward.name}@{source}"
        lookup_or_make = functools.partial(
            self._grad_array_once, forward, handle, source, name, shape_to_prepend, registry
        )
        return self._reclaiming(lookup_or_make, lambda: forward.grad_charge(name))

    def _grad_array_once(
        self,
        forward: TensorArray,
        handle: str,
        source: str,
        name: str,
        shape_to_prepend: tuple[int, ...],
        registry: GradRegistry | None,
    ) -> tuple[str, TensorArray]:
        """``grad_array``'s lookup-or-create under the session's lock; a refusal changes
        nothing (``TensorArray.make_grad``), so ``_reclaiming`` may try it again."""
        with self._lock:
            self._check_open()
            key = (handle, source)
            grads = self._grads if registry is None else registry
            grad_handle = grads.get(key) or new_token()

            def lookup() -> TensorArray | None:
                return self._arrays.get(grad_handle) if key in grads else None

            def register(grad: TensorArray) -> None:
                self._arrays[grad_handle] = grad
                grads.add(key, grad_handle)
                if registry is not None:
                    self._private_grads.add(grad_handle)
                else:
                    self._frozen_for_good(handle)

            grad = forward.make_grad(
                name=name, shape_to_prepend=shape_to_prepend, lookup=lookup, register=register
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

    def put(self, array: Array, nbytes: int | None = None, *, paid: int | None = None) -> str:
        """Keep ``array`` (never mutated afterwards) in the session; returns its id.

        Its size (``nbytes``: ``dtypes.nbytes(array)``, if the caller has it) is
        checked and its bytes charged to the session's budget, with its id's record;
        an array the session holds already is not charged again (an alias: its id's
        record only). ``paid``: bytes an op reserved in the budget for keeping it before
        it changed state (``keeping_charges``), which the session takes over, reserving
        or giving back the difference; all given back if the put fails.
        """
        nbytes = dtypes.nbytes(array) if nbytes is None else nbytes

        def alias_put() -> str | None:
            with self._lock:
                self._check_open()
                alias = self._alias_locked(array, 1, paid)
                if alias is None:
                    return None
                kept, tensor_id = alias
                self._resident[tensor_id] = kept
                return tensor_id

        try:
            tensor_id = self._reclaiming(alias_put, lambda: TENSOR_RECORD_BYTES - (paid or 0))
            if tensor_id is not None:
                return tensor_id
            reservation = self.reserve_tensor(nbytes, paid=paid)
        except BaseException:
            if paid:
                self.budget.release(paid)
            raise
        with reservation:
            return reservation.keep(array)

    def reserve_tensor(self, nbytes: int, *, paid: int | None = None) -> TensorReservation:
        """Hold ``nbytes`` of the budget for a tensor that is still to be made (a
        stream still arriving), with its id's record, so that the budget refuses it
        before anything is allocated. Use as a context manager: what is not kept is
        released on exit. ``paid``: bytes of it reserved already (``put``); nothing is
        reserved if the rest is refused."""
        self.check_tensor_bytes(nbytes)

        def reserve() -> TensorReservation:
            with self._lock:
                self._check_open()
                reservation = TensorReservation(self, nbytes)
                self._settle_locked(reservation.charged, paid)
                self._reservations.add(reservation)
            return reservation

        return self._reclaiming(reserve, lambda: tensor_charge(nbytes) - (paid or 0))

    def _reclaiming(self, attempt: Callable[[], T], needed: Callable[[], int]) -> T:
        """``attempt()``, which reserves under the session's lock (where the budget's
        own ``reclaim`` gives up) and changes nothing when refused: refused by a
        budget, it is tried once more if ``reclaim_read_out(needed())`` freed anything.
        Used by every reservation made under that lock: tensors (``reserve_tensor``,
        a put's alias record), ``keep_for_tapes``, new TensorArrays and grad arrays."""
        try:
            return attempt()
        except ResourceExhaustedError as e:
            if e.reason != "MEMORY_LIMIT" or not self.reclaim_read_out(needed()):
                raise
        return attempt()

    def keeping_charges(self, array: Array, nbytes: int | None = None) -> tuple[int, int]:
        """What keeping ``array`` under a new id will cost, and at most: its id's record
        alone if the session holds the array itself (an alias), else, as at most,
        ``tensor_charge`` (of its ``nbytes``, if the caller has them). For an op that
        pays ahead (a TensorArray read, Gradients) under a lock of its own, so it takes
        none: the first is a forecast, and ``put`` / ``keep_for_tapes`` settle the
        difference if the held tensor went meanwhile."""
        full = tensor_charge(dtypes.nbytes(array) if nbytes is None else nbytes)
        return (TENSOR_RECORD_BYTES if self._held(array) else full), full

    def pin(self, arrays: Iterable[Array]) -> list[_Kept]:
        """Of ``arrays``, the tensors the session holds (each array itself), held once
        more until the caller lets go of them (``let_go``): an op's outputs, paid for
        ahead as aliases (``keeping_charges``), stay aliases until they are kept."""
        with self._lock:
            pinned = [kept for kept in map(self._held, arrays) if kept is not None]
            for kept in pinned:
                kept.refs += 1
            return pinned

    def _held(self, array: Array) -> _Kept | None:
        """The tensor the session holds that is ``array`` itself, if any. One lookup
        (atomic): ``keeping_charges`` reads it without the lock, as a forecast."""
        kept = self._by_array.get(id(array))
        return kept if kept is not None and kept.array is array and kept.refs > 0 else None

    def _settle_locked(self, charge: int, paid: int | None) -> None:
        """Hold ``charge`` in the budget, of which ``paid`` is held already: reserve
        the rest (RESOURCE_EXHAUSTED past a limit, reserving nothing) or give back the
        surplus. (caller holds ``_lock``)"""
        if paid is None or paid < charge:
            self.budget.reserve(charge - (paid or 0))
        elif paid > charge:
            self.budget.release(paid - charge)

    def _keep_reserved(self, reservation: TensorReservation, array: Array) -> str:
        """``array`` kept on ``reservation``'s bytes; raises (keeping nothing) once the
        session is closed, whose ``close`` released the reservation."""
        tensor_id = new_token()
        with self._lock:
            self._check_open()
            self._reservations.discard(reservation)
            kept = self._held_anew(_Kept(array, reservation.nbytes), tensor_id, 1)
            self._resident[tensor_id] = kept
        return tensor_id

    def _held_anew(self, kept: _Kept, tensor_id: str, entries: int) -> _Kept:
        """``kept``, a tensor the session did not hold, indexed by its array, and
        named by ``tensor_id`` in ``entries`` places (its record charged by the
        caller). (caller holds ``_lock``)"""
        self._by_array[id(kept.array)] = kept
        self._ids[tensor_id] = entries
        return kept

    def _alias_locked(
        self, array: Array, entries: int, paid: int | None, tensor_id: str | None = None
    ) -> tuple[_Kept, str] | None:
        """If the session holds ``array`` itself: the held tensor and a new id for it
        (``tensor_id``, else a new token), for the caller to file in ``entries`` places
        (the id table, or each tape), the id's record (``TENSOR_RECORD_BYTES``) charged
        now (``paid`` of it held already: ``_settle_locked``); else None, changing
        nothing. (caller holds ``_lock``)"""
        kept = self._held(array)
        if kept is None:
            return None
        self._settle_locked(TENSOR_RECORD_BYTES, paid)
        tensor_id = new_token() if tensor_id is None else tensor_id
        kept.refs += entries
        self._ids[tensor_id] = entries
        return kept, tensor_id

    def _entry_added(self, tensor_id: str) -> None:
        """Another entry names ``tensor_id`` (caller holds ``_lock``)."""
        self._ids[tensor_id] += 1

    def _entry_gone(self, tensor_id: str) -> int:
        """An entry naming ``tensor_id`` went: the bytes of its record, if it was the
        last (caller holds ``_lock``)."""
        left = self._ids[tensor_id]
        if left > 1:
            self._ids[tensor_id] = left - 1
            return 0
        del self._ids[tensor_id]
        return TENSOR_RECORD_BYTES

    def _give_up(self, reservation: TensorReservation) -> None:
        """Release a reservation not kept (unless ``close`` released it already)."""
        with self._lock:
            if reservation not in self._reservations:
                return
            self._reservations.discard(reservation)
        self.budget.release(reservation.charged)

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
        """A resident tensor, or one a tape or a call holds (caller holds ``_lock``)."""
        kept = self._resident.get(tensor_id)
        if kept is None:
            for tape in self._tapes.values():
                kept = tape.held.get(tensor_id)
                if kept is not None:
                    return kept  # type: ignore[no-any-return]
            if tensor_id in self._call_held:
                return self._call_held[tensor_id][0]
            self._check_open()
            raise NotFoundError(
                f"resident tensor {tensor_id!r} does not exist in this session",
                reason="TENSOR_NOT_FOUND",
                field="ref",
            )
        return kept

    @contextlib.contextmanager
    def holding(self, nbytes: int) -> Iterator[None]:
        """``nbytes`` charged to the budget while the block runs: memory an op allocates
        for itself (its outputs and scratch) before anything keeps it; past a limit,
        ``RESOURCE_EXHAUSTED`` before anything is allocated."""
        self.budget.reserve(nbytes)
        try:
            yield
        finally:
            self.budget.release(nbytes)

    @contextlib.contextmanager
    def reading(self, tensor_id: str) -> Iterator[Array]:
        """The tensor, for a stream that reads it out: its bytes stay charged until the
        stream ends, even if the tensor is deleted (or the session closed) meanwhile,
        because the stream keeps the memory alive until then."""
        with self._lock:
            kept = self._kept(tensor_id)
            kept.refs += 1
        try:
            yield kept.array
        finally:
            self.let_go([kept])

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
                if kept.refs > 0 and kept.array is array:
                    kept.array = placed  # not let go of or placed meanwhile
                    if self._by_array.get(id(array)) is kept:
                        del self._by_array[id(array)]
                    self._by_array[id(placed)] = kept
        return placed

    def handed_out(self, tensor_id: str, reply: HandedOutReply) -> None:
        """``reply`` hands out ``tensor_id`` for its client to fetch (a transient
        output), which it does once it has the reply: until it has read it out
        (``fetched``) or deleted it, a drain waits for it."""
        with self._lock, self._handed_lock:
            if tensor_id in self._resident:
                self._handed[tensor_id] = _HandedOut(reply)

    def being_read(self, tensor_id: str) -> Callable[[], None]:
        """A call that reads ``tensor_id`` out began: until it ends (the function
        returned, which does it once), the outputs of the reply that handed it out do
        not age (``expire_handed_out``). The call, not the handler's reading: a client
        reading slowly gets the last chunks from gRPC's buffers long after the handler
        wrote them (a review helper: the next output of the reply was deleted)."""
        with self._handed_lock:
            handed = self._handed.get(tensor_id)
            if handed is None:
                return lambda: None
            reply = handed.reply
            reply.readers += 1
        done = False

        def end() -> None:
            nonlocal done
            with self._handed_lock:
                if not done:
                    done = True
                    reply.readers -= 1
                    reply.since = time.monotonic()

        return end

    def replied(self, reply: HandedOutReply) -> None:
        """``reply`` has left (gRPC is done with its call): its client's patience
        (``unfetched_outputs``) and its outputs' age count from now."""
        with self._handed_lock:
            if reply.since is None:
                reply.since = time.monotonic()

    def fetched(self, tensor_id: str) -> None:
        """A read gave ``tensor_id`` out in full, in time."""
        with self._handed_lock:
            handed = self._handed.get(tensor_id)
            if handed is not None:
                handed.fetched = True
                handed.reply.since = time.monotonic()

    def unfetched_outputs(self, patience: float, now: float | None = None) -> int:
        """How many handed-out outputs its client has still to fetch, if it is still
        about it: their reply is on its way, a call on the session runs, or their
        reply left, one of its outputs was read out, or a call ended less than
        ``patience`` seconds ago. A client that went away (crashed between the reply
        and its fetches) holds no drain up; its outputs go with the session."""
        since = self.idle_since()
        now = time.monotonic() if now is None else now
        with self._handed_lock:
            return sum(
                1 for h in self._handed.values()
                if not h.fetched and (
                    since is None
                    or h.reply.since is None
                    or now - max(h.reply.since, since) < patience
                )
            )  # fmt: skip

    def expire_handed_out(
        self, max_age: float, fetched_max_age: float, now: float | None = None
    ) -> int:
        """Delete the outputs of each reply that left, and of which none was read out
        since, more than ``max_age`` seconds ago (``fetched_max_age`` for one read out
        itself), none of whose outputs a call reads now; returns how many. The SDK fetches a reply's outputs at once, one after
        another, and deletes each by its next call: those still here are ones no
        client will come for (it crashed, or had them before the crash that restored
        this session from a snapshot), and held the session's bytes until the session
        closed (a review helper: 64 MiB of them restored after a SIGKILL refused every
        later gather of a client that kept its session)."""
        now = time.monotonic() if now is None else now
        with self._handed_lock:
            stale = [
                tensor_id for tensor_id, h in self._handed.items()
                if h.reply.since is not None
                and not h.reply.readers
                and now - h.reply.since > (fetched_max_age if h.fetched else max_age)
            ]  # fmt: skip
        return self.delete(stale) if stale else 0

    def reclaim_read_out(self, nbytes: int, *, wait: bool = True) -> int:
        """Make room for ``nbytes`` more: delete the handed-out outputs read out in full
        more than ``RECLAIM_AFTER_SECONDS`` ago that no call reads now, unless even
        that leaves too little room under the session's limits (then nothing); returns
        the bytes freed. Their client has them, and deletes them by its next call
        (``expire_handed_out`` does it 30 s after their reading otherwise); until then
        they refused that client's next ops, most of all after a restore from a
        snapshot older than its deletes (a review helper: 730 refused gathers in the
        seconds after a restart). ``wait=False``: gives up (0) if another holds the
        session's lock: called by a reservation being made, which may hold it, or
        other locks."""
        if not self._lock.acquire(blocking=wait):
            return 0
        try:
            now = time.monotonic()
            with self._handed_lock:
                read_out = [
                    tensor_id for tensor_id, h in self._handed.items()
                    if h.fetched and not h.reply.readers
                    and h.reply.since is not None
                    and now - h.reply.since > RECLAIM_AFTER_SECONDS
                ]  # fmt: skip
            if not read_out or not self._room_once_freed(read_out, nbytes):
                return 0  # nothing to free, or hopeless: keep them
            _, freed = self._delete_locked(read_out)
        finally:
            self._lock.release()
        self.budget.release(freed)
        return freed

    def _room_once_freed(self, tensor_ids: list[str], nbytes: int) -> bool:
        """Whether deleting ``tensor_ids`` leaves room for ``nbytes`` more under the
        session's limit and each above it (its principal's, the server's): a refusal
        may come from any of them (a review helper: deleted, and refused anyway). A
        tensor's bytes count if every holder of it goes, as two ids of one array (the
        gradients of one source asked twice) both do. (caller holds ``_lock``)"""
        freed = 0
        ids_of: dict[int, int] = collections.Counter()
        kept_by_key: dict[int, _Kept] = {}
        for tensor_id in tensor_ids:
            kept = self._resident.get(tensor_id)
            if kept is None:
                continue
            ids_of[id(kept)] += 1
            kept_by_key[id(kept)] = kept
            if self._ids.get(tensor_id) == 1:
                freed += TENSOR_RECORD_BYTES
        freed += sum(k.nbytes for key, k in kept_by_key.items() if ids_of[key] >= k.refs)
        budget: MemoryBudget | None = self.budget
        while budget is not None:
            if budget.limit is not None and budget.limit - budget.used + freed < nbytes:
                return False
            budget = budget.parent
        return True

    def _reclaim_without_waiting(self, nbytes: int) -> bool:
        return self.reclaim_read_out(nbytes, wait=False) > 0

    def delete(self, tensor_ids: Iterable[str]) -> int:
        """Drop tensors; returns how many existed. Bytes of one still being read out
        are released when its last reader ends."""
        with self._lock:
            gone, freed = self._delete_locked(tensor_ids)
        self.budget.release(freed)
        return gone

    def _delete_locked(self, tensor_ids: Iterable[str]) -> tuple[int, int]:
        """Drop tensors: how many existed, and the bytes free now, for the caller to
        release once it let go of ``_lock`` (which it holds)."""
        gone = [(t, k) for t in tensor_ids if (k := self._resident.pop(t, None)) is not None]
        with self._handed_lock:
            for tensor_id, _ in gone:
                self._handed.pop(tensor_id, None)
        freed = self._drop(k for _, k in gone) + sum(self._entry_gone(t) for t, _ in gone)
        return len(gone), freed

    def _drop(self, dropped: Iterable[_Kept]) -> int:
        """One holder fewer for each; returns the bytes free now (caller holds
        ``_lock``): a tensor still read out, or kept by a tape, stays charged."""
        freed = 0
        for kept in dropped:
            kept.refs -= 1
            if kept.refs == 0:
                freed += kept.nbytes
                if self._by_array.get(id(kept.array)) is kept:
                    del self._by_array[id(kept.array)]
        return freed

    def let_go(self, held: Iterable[_Kept]) -> int:
        """A holder other than the id table (a stream, a tape) lets go of ``held``;
        returns the bytes released."""
        with self._lock:
            freed = self._drop(held)
        self.budget.release(freed)
        return freed

    # ---------------------------------------------------------------- tapes
    def start_tape(
        self, *, persistent: bool, watch_accessed_variables: bool, tape_id: str | None = None
    ) -> Tape:
        """A new tape; with ``tape_id`` (a client's proposal, so that its first op
        starts the tape without a round trip of its own) the tape of that id, made
        if it does not exist yet. A released id is FAILED_PRECONDITION."""
        if tape_id is not None:
            _check_proposed_id(tape_id)
            with self._lock:
                existing = self._tapes.get(tape_id)
            if existing is not None:
                return existing
            if tape_id in self._released_tapes or tape_id in self._lost_tapes:
                return self.tape(tape_id)  # raises: released, or lost
        with self._lock:
            self._check_open()
            if tape_id is not None and tape_id in self._tapes:
                return self._tapes[tape_id]
            if len(self._tapes) + len(self._spent_tapes) >= MAX_TAPES_PER_SESSION:
                raise ResourceExhaustedError(
                    f"the session has {MAX_TAPES_PER_SESSION} live gradient tapes, the most "
                    "it may; release one (a non-persistent tape is released by its first "
                    "gradient call)",
                    reason="TOO_MANY_TAPES",
                )
            tape = Tape(
                tape_id or new_token(),
                persistent=persistent,
                watch_accessed_variables=watch_accessed_variables,
            )
            self._tapes[tape.id] = tape
            return tape

    def tape(self, tape_id: str) -> Tape:
        """A live tape; FAILED_PRECONDITION for a released one, NOT_FOUND (reason
        ``TAPE_LOST``) for one a restore did not bring back."""
        with self._lock:
            tape = self._tapes.get(tape_id)
            released = tape_id in self._released_tapes
            lost = tape_id in self._lost_tapes
            if tape is None:
                self._check_open()
        if tape is not None:
            return tape
        if lost:
            raise NotFoundError(
                f"gradient tape {tape_id!r} was lost when its session was restored from a "
                "snapshot (a server restart, or its replica leaving): snapshots do not keep "
                "tapes. Start a new tape and run the forward pass again",
                reason="TAPE_LOST",
                field="tape_id",
            )
        if released:
            raise TapeReleasedError(
                f"gradient tape {tape_id!r} was released: a non-persistent tape is released "
                "by its first gradient call (use persistent=True for several), a persistent "
                "one when it is released or its session ends",
                field="tape_id",
            )
        raise NotFoundError(
            f"gradient tape {tape_id!r} does not exist in this session",
            reason="TAPE_NOT_FOUND",
            field="tape_id",
        )

    def release_tape(self, tape_id: str, *, proposed: bool = False) -> int:
        """Let go of everything the tape holds; returns the bytes that freed (0 for a
        tape a restore lost: it holds nothing, and a client's ``finally: release()``
        must not fail on it, hiding the error that brought it there).

        ``proposed``: the client proposed the id and may not have started it (no call
        naming it reached the session yet). One the session never had is marked
        released without being started (a call proposing it later is refused, as
        after any release): started only to be released, it counted against the
        session's tapes, and at their limit the release was refused."""
        if proposed:
            _check_proposed_id(tape_id)
        with self._lock:
            if tape_id in self._lost_tapes:
                return 0
            known = tape_id in self._tapes or tape_id in self._spent_tapes
            if proposed and not known and tape_id not in self._released_tapes:
                self._check_open()
                self._note_released_locked(tape_id)
                return 0
            spent = self._spent_tapes.pop(tape_id, None)
        if spent is not None:  # (a client's release after a gradient it did not get)
            return self._free(spent)
        tape = self.tape(tape_id)
        with self._lock:
            if self._tapes.pop(tape_id, None) is None:
                return 0  # released meanwhile
            self._note_released_locked(tape_id)
            freed = self._release_tape_locked(tape)
        self.budget.release(freed)
        return freed

    def _note_released_locked(self, tape_id: str) -> None:
        self._released_tapes[tape_id] = None
        while len(self._released_tapes) > 4 * MAX_TAPES_PER_SESSION:
            del self._released_tapes[next(iter(self._released_tapes))]

    def spend_tape(self, tape: Tape) -> bool:
        """A gradient computation on the non-persistent ``tape`` succeeded: the tape is
        released to every call from now on (TensorFlow's one ``gradient`` call), but
        keeps what it holds until its caller frees it (``free_spent_tape``, once the
        results reached the client) or gives it back (``unspend_tape``, if they did
        not). False if it was released meanwhile."""
        with self._lock:
            if self._tapes.get(tape.id) is not tape:
                return False
            del self._tapes[tape.id]
            tape.released = True
            self._note_released_locked(tape.id)
            self._spent_tapes[tape.id] = tape
            return True

    def free_spent_tape(self, tape: Tape) -> int:
        """Free what a spent tape holds (unless it went meanwhile); the bytes freed."""
        with self._lock:
            if self._spent_tapes.get(tape.id) is not tape:
                return 0
            del self._spent_tapes[tape.id]
        return self._free(tape)

    def _free(self, spent: Tape) -> int:
        with self._lock:
            freed = self._release_tape_locked(spent)
        self.budget.release(freed)
        return freed

    def unspend_tape(self, tape: Tape) -> None:
        """The results of the computation that spent ``tape`` never reached the client:
        the tape is live again, for the client to ask again (unless it was freed
        meanwhile: released by the client, or its session closed)."""
        with self._lock:
            if self._closed or self._spent_tapes.get(tape.id) is not tape:
                return
            del self._spent_tapes[tape.id]
            self._released_tapes.pop(tape.id, None)
            self._tapes[tape.id] = tape.revived()  # (``tape`` stays released)

    def _release_tape_locked(self, tape: Tape) -> int:
        tape.released = True
        held, tape.held = tape.held, {}
        tape.holds.clear()
        tape.records.clear()
        records, tape.record_bytes = tape.record_bytes, 0
        return self._drop(held.values()) + sum(map(self._entry_gone, held)) + records

    def is_variable(self, tensor_id: str) -> bool:
        """Whether ``tensor_id`` is a variable to a tape that watches accessed
        variables: a tensor the client keeps (put it, or kept an op's output) that no
        live tape recorded as an op's output. An id only a tape (or a call) holds, or
        a kept output of a tape's op, is an intermediate (found by a review helper:
        TF 2.21 gives None for both)."""
        with self._lock:
            return tensor_id in self._resident and not any(
                tensor_id in tape.outputs for tape in self._tapes.values()
            )

    def hold_for_tape(self, tape: Tape, tensor_id: str) -> bool:
        """``tape`` holds the tensor ``tensor_id`` (resident, or held by a tape) for one
        more op, until the tape is released (or the op fails: ``release_held``); False
        if the tape was released meanwhile (an op that ran under it is not failed for
        that: it has changed the session)."""
        with self._lock:
            self._check_open()
            if tape.released:
                return False
            if tensor_id in tape.held:
                tape.holds[tensor_id] += 1
                return True
            kept = self._kept(tensor_id)
            kept.refs += 1
            tape.held[tensor_id] = kept
            tape.holds[tensor_id] = 1
            self._entry_added(tensor_id)
            return True

    @staticmethod
    def charge_of(array: Array) -> int:
        """What holding ``array`` costs the budget (``tensor_charge``)."""
        return tensor_charge(dtypes.nbytes(array))

    def keep_for_tapes(
        self,
        tapes: list[Tape],
        array: Array,
        reserved: TensorReservation | None = None,
        *,
        paid: int | None = None,
        pin: bool = False,
    ) -> str | None:
        """Hold ``array`` on every live tape of ``tapes`` under a new id, charged once
        to the session's budget (RESOURCE_EXHAUSTED past a limit); None if every one
        was released meanwhile. ``reserved``: bytes already held for ``array`` (a
        region copy's), which the tapes take over instead of charging them again; left
        as it is when no tape is live. ``paid``: its charge, already reserved in the
        budget (``Recorder.pay_for_outputs``), which the tapes take over; the caller
        releases it when no tape is live. ``pin``: the caller holds the new id too,
        until it lets go of it (``let_go_ids``): an op's output, which its reply names
        (``publish``) after another call may have released the tapes."""
        if not hasattr(array, "__cuda_array_interface__"):
            array = np.asarray(array)
        charge = self.charge_of(array)

        def needed() -> int:  # (an alias is charged its record only)
            alias = reserved is None and self._held(array) is not None
            return (TENSOR_RECORD_BYTES if alias else charge) - (paid or 0)

        return self._reclaiming(
            lambda: self._keep_for_tapes(tapes, array, charge, reserved, paid, pin), needed
        )

    def _keep_for_tapes(
        self,
        tapes: list[Tape],
        array: Array,
        charge: int,
        reserved: TensorReservation | None,
        paid: int | None,
        pin: bool,
    ) -> str | None:
        """``keep_for_tapes``, once: refused, it changed nothing."""
        with self._lock:
            self._check_open()
            live = list({id(t): t for t in tapes if not t.released}.values())
            if not live:
                return None
            alias = None if reserved is not None else self._alias_locked(array, len(live), paid)
            if alias is not None:
                kept, tensor_id = alias
                for tape in live:
                    tape.held[tensor_id] = kept
                    tape.holds[tensor_id] = 1
                if pin:
                    self._pin_id_locked(tensor_id, kept)
                return tensor_id
            if reserved is not None and reserved in self._reservations:
                self._reservations.discard(reserved)  # its bytes are the tapes' now
                reserved.taken_over()
                charge = reserved.charged
            else:
                self._settle_locked(charge, paid)
            tensor_id = new_token()
            kept = _Kept(array, charge - TENSOR_RECORD_BYTES, refs=len(live))
            self._held_anew(kept, tensor_id, len(live))
            for tape in live:
                tape.held[tensor_id] = kept
                tape.holds[tensor_id] = 1
            if pin:
                self._pin_id_locked(tensor_id, kept)
            return tensor_id

    def _pin_id_locked(self, tensor_id: str, kept: _Kept) -> None:
        """A call holds ``tensor_id`` (``kept``) once more. (caller holds ``_lock``)"""
        kept.refs += 1
        self._entry_added(tensor_id)
        self._call_held[tensor_id] = (kept, self._call_held.get(tensor_id, (kept, 0))[1] + 1)

    def let_go_ids(self, tensor_ids: Iterable[str]) -> int:
        """A call lets go of ids it held (``keep_for_tapes(pin=True)``); returns the
        bytes released. After ``close``, which released the ids' records, only the
        tensors' own bytes are."""
        freed = 0
        with self._lock:
            for tensor_id in tensor_ids:
                kept, holds = self._call_held.pop(tensor_id)
                if holds > 1:
                    self._call_held[tensor_id] = (kept, holds - 1)
                freed += self._drop((kept,))
                if not self._closed:
                    freed += self._entry_gone(tensor_id)
        self.budget.release(freed)
        return freed

    def release_held(self, held: list[tuple[Tape, str]]) -> None:
        """Tapes let go of the holds they took for an op that failed; a tensor goes
        from a tape with its last hold (another op may hold it too)."""
        with self._lock:
            gone = []
            for tape, tensor_id in held:
                holds = tape.holds.get(tensor_id, 0) - 1
                if holds > 0:
                    tape.holds[tensor_id] = holds
                    continue
                tape.holds.pop(tensor_id, None)
                kept = tape.held.pop(tensor_id, None)
                if kept is not None:
                    gone.append((tensor_id, kept))
            freed = self._drop(k for _, k in gone) + sum(self._entry_gone(i) for i, _ in gone)
        self.budget.release(freed)

    def commit_records(self, tapes: list[Tape], records: list[Any], watch: set[str]) -> int:
        """An op's records join the tapes it ran under (those not released meanwhile),
        each charged its ``cost`` (reserved by the caller); returns the bytes the tapes
        took over."""
        charged = 0
        with self._lock:
            for tape in tapes:
                if tape.released:
                    continue
                if tape.watch_accessed_variables:  # read by the op: watched as it ran
                    self._watch_locked(tape, watch)
                for op, inputs, outputs, saved, cost in records:
                    tape.commit(op, inputs, outputs, saved)
                    tape.record_bytes += cost
                    charged += cost
        return charged

    @staticmethod
    def _watch_locked(tape: Tape, tensor_ids: Iterable[str]) -> None:
        """(caller holds ``_lock``)"""
        for tensor_id in tensor_ids:
            tape.watched_at.setdefault(tensor_id, len(tape.records))

    def watch(self, tape: Tape, tensor_ids: Iterable[str]) -> None:
        """``tape.watch``: the tensors (which must exist) become differentiable sources,
        held by the tape from now on, as any tensor it recorded: a TensorFlow tape keeps
        what it watches, and an output of another tape released after the watch was
        NOT_FOUND to the ops that read it next (a review helper). Each tensor new to
        the tape is charged a record (``RECORD_BYTES``) until the tape goes: 64 tapes
        watching 4,094 ids took 39 MB of a 4 MiB session's server uncharged (a review
        helper)."""
        with self._lock:
            self._check_tape_live(tape)
            tensor_ids = list(dict.fromkeys(tensor_ids))
            kept = [self._kept(tensor_id) for tensor_id in tensor_ids]
            cost = RECORD_BYTES * sum(
                1 for t in tensor_ids if t not in tape.held and t not in tape.watched_at
            )
            if cost:
                self.budget.reserve(cost)  # refused: nothing changed
                tape.record_bytes += cost
            for tensor_id, tensor in zip(tensor_ids, kept):
                if tensor_id in tape.held:
                    # A hold of its own: a running op's hold, released if that op
                    # fails (``release_held``), must not take the watch's with it.
                    tape.holds[tensor_id] += 1
                    continue
                tensor.refs += 1
                tape.held[tensor_id] = tensor
                tape.holds[tensor_id] = 1
                self._entry_added(tensor_id)
            self._watch_locked(tape, tensor_ids)

    def publish(self, tensor_id: str) -> bool:
        """Give a tensor a tape holds an entry in the id table as well (a kept or
        transient output of an op run under a tape): one tensor, charged once. False
        when nothing holds it any more (its tape was released by another call since
        the op ran): the caller keeps the value itself."""
        with self._lock:
            self._check_open()
            try:
                kept = self._kept(tensor_id)
            except NotFoundError:
                return False
            if self._resident.get(tensor_id) is not kept:
                if tensor_id not in self._resident:
                    self._entry_added(tensor_id)
                kept.refs += 1
                self._resident[tensor_id] = kept
            return True

    def new_gradient_source(self) -> str:
        """The ``source`` one gradient computation names its grad arrays by:
        "gradients", then "gradients_1", ... (TensorFlow's name scopes), skipping any
        the session's grad arrays use, so that a message naming one is not mistaken
        for a user's. The arrays themselves are the computation's own
        (``grad_array``'s ``registry``), whatever the name."""
        with self._lock:
            while True:
                n = self._gradient_sources
                self._gradient_sources += 1
                source = "gradients" if n == 0 else f"gradients_{n}"
                if not self._grads.has_source(source):
                    return source

    def drop_grad_arrays(self, source: str, registry: GradRegistry | None = None) -> None:
        """Remove every gradient array made for ``source`` (and free its bytes): those
        of ``registry`` (a gradient computation's own) where given, else the
        session's. A computation dropped its source from the session's registry, and
        with it a user's TensorArrayGradV3 array made under that name while it ran
        (found by a review helper), which it had also shared."""
        with self._lock:
            handles = (self._grads if registry is None else registry).pop_source(source)
            arrays = [self._arrays.pop(handle, None) for handle in handles]
            for handle in handles:
                self._closed_arrays.pop(handle, None)
                self._private_grads.discard(handle)
        for ta in arrays:
            if ta is not None:
                ta.discard()  # gone from the session: its records too

    def tape_snapshot(
        self, tape: Tape, targets: Sequence[str], sources: Sequence[str]
    ) -> tuple[list[Any], list[str], set[str], dict[str, int]]:
        """A live tape's records as of now, the ``targets`` it neither produced nor
        watches and that are not sources either (not differentiable: the caller's
        error), the ``sources`` it did or that are targets too (d target / d target is
        its output gradient, recorded or not, as TensorFlow has it: ``gradient(v, v)``
        on a tape that saw nothing is ones), and when each watched key was watched
        (``Tape.watched_at``).
        Only the records are copied (references): copying the tape's sets of produced
        and watched keys as well cost a gradient call, even one refused for its
        target, time in their size under this lock."""
        with self._lock:
            self._check_tape_live(tape)

            def on_tape(key: str) -> bool:
                return key in tape.outputs or key in tape.watched_at

            source_set = set(sources)
            unknown = [t for t in targets if not on_tape(t) and t not in source_set]
            if unknown:
                return [], unknown, set(), {}
            differentiable = {k for k in sources if on_tape(k)} | (source_set & set(targets))
            return list(tape.records), [], differentiable, dict(tape.watched_at)

    def gradient_done(self, tape: Tape) -> None:
        """A gradient computation on ``tape`` succeeded: a non-persistent tape is
        released (TensorFlow's tapes allow one ``gradient`` call unless persistent).
        A caller that can tell whether the results reached their client spends it
        instead (``spend_tape``)."""
        if not tape.persistent:
            self.release_tape(tape.id)

    def gradient_froze(self, computation: int, handle: str, dynamic_size: bool) -> None:
        """Gradient computation ``computation`` (an id of its own) is about to make a grad
        array of ``handle``, whose dynamic sizing was ``dynamic_size`` (see
        ``_frozen_by_gradients``)."""
        with self._lock:
            self._frozen_by_gradients.setdefault(handle, {})[computation] = dynamic_size

    def gradient_ended(self, computation: int, frozen: Iterable[str], succeeded: bool) -> None:
        """``computation`` ended. One that succeeded froze ``frozen`` for good (as
        TensorFlow leaves them): the snapshots of computations still running see them
        frozen too. One that failed gives them their dynamic sizing back, unless a
        client's grad array or another computation that succeeded froze them
        meanwhile."""
        thawed = []
        with self._lock:
            for handle in frozen:
                before = self._frozen_by_gradients.get(handle)
                if before is None or computation not in before:
                    continue
                dynamic_size = before.pop(computation)
                if not succeeded and dynamic_size:
                    thawed.append(self._arrays.get(handle))
                if not before:
                    del self._frozen_by_gradients[handle]
                elif succeeded:
                    before.update(dict.fromkeys(before, False))
        for ta in thawed:
            if ta is not None:
                ta.restore_dynamic_size(True)

    def _frozen_for_good(self, handle: str) -> None:
        """(caller holds ``_lock``) A client's grad array of ``handle`` froze it for good."""
        before = self._frozen_by_gradients.get(handle)
        if before is not None:
            before.update(dict.fromkeys(before, False))

    def _check_tape_live(self, tape: Tape) -> None:
        """(caller holds ``_lock``)"""
        self._check_open()
        if tape.released:
            raise TapeReleasedError(f"gradient tape {tape.id!r} was released while the op ran")

    # ---------------------------------------------------------------- snapshots
    def changing(self) -> contextlib.AbstractContextManager[None]:
        """Around an op that may change the session in steps (a clearing read: the
        element, then its output): no snapshot sees it half done (``SnapshotGate``)."""
        return self._gate.op()

    def export_state(self, idle_timeout: float, now: float | None = None) -> SessionState:
        """Everything this session holds, for a snapshot (``server.core.persistence``),
        between ops that change it in steps (``changing``).

        Tensors still arriving are not part of it (their upload fails and is repeated).
        Gradient tapes are not persisted (a restored session has none; a call naming
        one gets the tape's NOT_FOUND): they are counted in ``tapes_dropped`` so that
        the snapshot can say so.
        """
        now = time.monotonic() if now is None else now
        with self._gate.snapshot() as whole:
            with self._lock:
                arrays = {h: a for h, a in self._arrays.items() if h not in self._private_grads}
                grads = self._grads.as_dict()
                with self._handed_lock:
                    handed_out = [t for t, h in self._handed.items() if not h.fetched]
                    fetched = [t for t, h in self._handed.items() if h.fetched]
                resident = {t: kept.array for t, kept in self._resident.items()}
                counter = self._name_counter
                # A call running is not idle time: a restart gives it the whole TTL (a
                # session busy past its TTL was saved with none left, and expired at
                # once after a crash; a review helper).
                since = self.idle_since()  # both read at once, as the reaper does
                idle = 0.0 if since is None else now - since
                remaining = max(0.0, idle_timeout - idle)
                tapes = len(self._tapes) + len(self._spent_tapes)
                # A spent tape's gradients have not reached the client yet: lost, as
                # a live one, if this snapshot is restored (the client asks again).
                lost_tapes = _latest([*self._lost_tapes, *self._tapes, *self._spent_tapes])
                released_tapes = [t for t in self._released_tapes if t not in self._spent_tapes]
                closed_order = list(self._closed_arrays)
                unfrozen = {h: all(b.values()) for h, b in self._frozen_by_gradients.items()}
            exported = {h: ta.export_state() for h, ta in arrays.items()}
            for handle, dynamic_size in unfrozen.items():
                if handle in exported:
                    exported[handle] = dataclasses.replace(
                        exported[handle], dynamic_size=dynamic_size
                    )
        return SessionState(
            id=self.id,
            principal=self.principal,
            name_counter=counter,
            idle_seconds_left=remaining,
            arrays=exported,
            grads=grads,
            resident=resident,
            tapes_dropped=tapes,
            lost_tapes=lost_tapes,
            released_tapes=released_tapes,
            closed_order=closed_order,
            handed_out=handed_out,
            fetched=fetched,
            torn=not whole,
        )

    @classmethod
    def from_state(
        cls,
        state: SessionState,
        *,
        idle_timeout: float,
        max_tensor_bytes: int | None,
        max_tensor_array_size: int | None,
        budget: MemoryBudget,
        buffers: WarmBuffers | None = None,
    ) -> Session:
        """The session ``state`` describes, by the same id, owner and handles, every
        byte charged to ``budget``; raises (charging nothing) past a limit."""
        session = cls(
            state.id,
            principal=state.principal,
            max_tensor_bytes=max_tensor_bytes,
            max_tensor_array_size=max_tensor_array_size,
            budget=budget,
            buffers=buffers,
        )
        session._name_counter = state.name_counter
        session._lost_tapes = dict.fromkeys(_latest(state.lost_tapes))
        session._released_tapes = dict.fromkeys(_latest(state.released_tapes))
        session.last_used = time.monotonic() - max(0.0, idle_timeout - state.idle_seconds_left)
        try:
            for handle, ta_state in state.arrays.items():
                session._arrays[handle] = TensorArray.from_state(
                    ta_state,
                    max_output_bytes=max_tensor_bytes,
                    max_size=max_tensor_array_size,
                    budget=budget,
                )
            for tensor_id, array in state.resident.items():
                alias = session._alias_locked(array, 1, None, tensor_id)  # one array, two ids
                if alias is not None:
                    session._resident[tensor_id] = alias[0]
                    continue
                nbytes = dtypes.nbytes(array)
                budget.reserve(tensor_charge(nbytes))
                kept = session._held_anew(_Kept(array, nbytes), tensor_id, 1)
                session._resident[tensor_id] = kept
        except BaseException:
            session.close()  # releases what was charged
            raise
        for (forward, source), grad in state.grads.items():
            if forward not in session._arrays or grad not in session._arrays:
                session.close()
                raise ValueError(f"grad array of {forward!r} for {source!r}: no such array")
            if session._arrays[forward].is_grad or not session._arrays[grad].is_grad:
                session.close()
                raise ValueError(f"grad array of {forward!r} for {source!r}: not a grad array")
        session._grads = GradRegistry(state.grads.items())
        closed = [h for h, ta in session._arrays.items() if ta.closed]
        if state.closed_order is not None and set(state.closed_order) == set(closed):
            closed = state.closed_order  # (a restored session forgot another array first)
        for handle in closed:
            session._closed_arrays[handle] = None
        # Restored as one reply: their client's patience, and their age, count from
        # now (fetched ones too: the client may not have had all of one).
        restored = HandedOutReply(since=time.monotonic())
        for tensor_ids, fetched in ((state.handed_out, False), (state.fetched, True)):
            for tensor_id in tensor_ids:
                if tensor_id in session._resident:
                    session._handed[tensor_id] = _HandedOut(restored, fetched)
        return session

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
            for tape in [*self._tapes.values(), *self._spent_tapes.values()]:
                freed += self._release_tape_locked(tape)
            self._tapes.clear()
            self._spent_tapes.clear()
            freed += sum(r.charged for r in self._reservations)
            self._arrays.clear()
            self._grads.clear()
            self._private_grads.clear()
            self._closed_arrays.clear()
            freed += TENSOR_RECORD_BYTES * len(self._ids)  # the ids left: the table's
            self._ids.clear()
            self._resident.clear()
            with self._handed_lock:
                self._handed.clear()
            self._by_array.clear()
            self._reservations.clear()
        self.budget.release(freed)
        self.regions.close()
        for ta in arrays:  # each releases its own bytes
            freed += ta.discard(session_closed=True)
        return freed

    def _check_open(self) -> None:
        """SESSION_NOT_FOUND once closed. A lookup that misses checks it first: a
        call racing CloseSession (or the TTL) learns that its session is gone, not
        that a handle or tensor it holds does not exist."""
        if self._closed:
            raise NotFoundError(f"session {self.id!r} is closed", reason="SESSION_NOT_FOUND")


@dataclasses.dataclass
class SessionState:
    """A session's whole state (``Session.export_state``), what a snapshot holds."""

    id: str
    principal: str
    #: The counter that numbers TensorArray names ("TensorArrayV3_7").
    name_counter: int
    #: Seconds left before the idle timeout would have closed it.
    idle_seconds_left: float
    arrays: dict[str, TensorArrayState]
    #: (forward handle, source) -> gradient array handle.
    grads: dict[tuple[str, str], str]
    #: Resident tensors (host arrays in a snapshot) by id.
    resident: dict[str, Array]
    #: Gradient tapes the session had, which snapshots do not keep.
    tapes_dropped: int = 0
    #: Ids of those tapes (and of those lost by earlier restores), so that the
    #: restored session refuses them (``TAPE_LOST``), and of the released ones.
    lost_tapes: list[str] = dataclasses.field(default_factory=list)
    released_tapes: list[str] = dataclasses.field(default_factory=list)
    #: Handles of the closed arrays in the order they were closed (the oldest is
    #: forgotten first, ``MAX_CLOSED_ARRAYS``); None: in the order they were made (a
    #: snapshot from before this was kept).
    closed_order: list[str] | None = None
    #: Ids of the resident tensors that are outputs handed out and not yet fetched
    #: (``Session.handed_out``), and of those fetched, not yet deleted: the restored
    #: session deletes them if no client comes for them (after a crash the client
    #: may have deleted them already: restored for good, they were charged for ever).
    handed_out: list[str] = dataclasses.field(default_factory=list)
    fetched: list[str] = dataclasses.field(default_factory=list)
    #: Taken with ops still changing it after ``snapshot_gate.SNAPSHOT_WAIT_SECONDS`` (an op that
    #: hangs must not stop the drain's snapshot): one of them may be half in it.
    #: Not written: the snapshot's report says so.
    torn: bool = False


def _latest(tape_ids: Sequence[str]) -> list[str]:
    """The last ``4 * MAX_TAPES_PER_SESSION`` ids (the bound of released ones)."""
    return list(tape_ids)[-4 * MAX_TAPES_PER_SESSION :]


def _check_proposed_id(tape_id: str) -> None:
    """A client-proposed id: URL-safe characters, long enough to be unguessable."""
    if not 16 <= len(tape_id) <= 64 or not all(c.isalnum() or c in "-_" for c in tape_id):
        raise InvalidArgumentError(
            f"tape id {tape_id[:70]!r} is not 16 to 64 URL-safe characters "
            "(letters, digits, '-', '_')",
            field="tape_id",
        )


class TensorReservation:
    """Budget bytes held for one tensor until it is kept (``keep``) or given up (on
    leaving the ``with`` block without keeping it, whatever the reason)."""

    def __init__(self, session: Session, nbytes: int) -> None:
        self.session = session
        #: The tensor's bytes; ``charged``, what the budget holds for it.
        self.nbytes = nbytes
        self.charged = tensor_charge(nbytes)
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
        self.release()

    def release(self) -> None:
        """Give the bytes back unless kept (idempotent)."""
        if self._open:
            self._open = False
            self.session._give_up(self)

    def taken_over(self) -> None:
        """(the session, under its lock) Another holder counts these bytes now."""
        self._open = False


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
        replica_id: str | None = None,
        host_cache_bytes: int = DEFAULT_LIMIT_BYTES,
    ):
        #: This replica's identity, stamped into every session id it creates
        #: (``<replica>.<random>``) so that a proxy routes a session's calls to the
        #: replica that made it (``check_replica_id``); None: bare random ids.
        self.replica_id = check_replica_id(replica_id) if replica_id else None
        self.restored = 0  # sessions restored from snapshots (start or adoption), for metrics
        #: Told the id of each session closed by its client or expired (``_ended``).
        self.on_ended: Callable[[str], None] | None = None
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
        #: Warm host buffers for large tensors read from shared memory or streams,
        #: shared by every session (``warm_buffers``).
        self.buffers = WarmBuffers(host_cache_bytes, on_drop=on_release)

    def create(self, principal: str = ANONYMOUS) -> Session:
        """A new session for ``principal``; refused past the session limits or while draining."""
        with self._lock:
            if self.draining:
                raise UnavailableError(
                    "the server is shutting down and accepts no new sessions",
                    reason=DRAINING_REASON,
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
            if self.replica_id:
                session_id = f"{self.replica_id}.{session_id}"
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
                buffers=self.buffers,
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
            here = f" on replica {self.replica_id!r}" if self.replica_id else ""
            raise NotFoundError(
                f"session not found{here}: it was closed, expired, or never existed here "
                "(its replica restarted without its state, or the call was routed to a "
                "replica that does not hold it; pass the id CreateSession returned in "
                "'x-gradserve-session' metadata)",
                reason="SESSION_NOT_FOUND",
            )
        session.touch()
        return session

    def close(self, session_id: str, principal: str = ANONYMOUS) -> None:
        session = self.get(session_id, principal)
        with self._lock:
            self._sessions.pop(session_id, None)
        session.close()
        self._ended(session_id)

    def expire_idle(self, now: float | None = None) -> int:
        """Close sessions unused for longer than the idle timeout, none with a call
        running; returns how many. Also deletes the outputs handed out that no client
        came for (``Session.expire_handed_out``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [
                s
                for s in self._sessions.values()
                if (since := s.idle_since()) is not None and now - since > self.idle_timeout
            ]
            for s in stale:
                del self._sessions[s.id]
            self.expired += len(stale)
        for s in stale:
            s.close()
            self._ended(s.id)
        for s in self.sessions():
            s.expire_handed_out(HANDED_OUT_MAX_AGE_SECONDS, FETCHED_MAX_AGE_SECONDS, now)
        self.buffers.expire_idle(now)
        return len(stale)

    def _ended(self, session_id: str) -> None:
        """A session closed by its client or expired is gone for good: ``on_ended``
        (the state keeper: its snapshot file goes, so that a restart after a crash
        does not bring it back). Not at shutdown (``close_all``): the drain's snapshot
        keeps the sessions."""
        if self.on_ended is not None:
            self.on_ended(session_id)

    def sessions(self) -> list[Session]:
        """The open sessions, now."""
        with self._lock:
            return list(self._sessions.values())

    def export_states(self) -> list[SessionState]:
        """Every open session's state (``Session.export_state``), for a snapshot."""
        return [s.export_state(self.idle_timeout) for s in self.sessions()]

    def restore(self, state: SessionState) -> Session:
        """Serve the session ``state`` describes under its own id (whatever replica made
        it: a survivor adopts a removed replica's sessions), its bytes charged again to
        its principal and the server. Refused, changing nothing, if the id is taken or
        a byte limit would pass; the session and principal counts are not enforced, so
        that a restart under lower limits loses nothing it can hold."""
        with self._lock:
            if state.id in self._sessions:
                raise InvalidArgumentError(f"session {state.id[:12]}… is already open here")
        session = Session.from_state(
            state,
            idle_timeout=self.idle_timeout,
            max_tensor_bytes=self.max_tensor_bytes,
            max_tensor_array_size=self.max_tensor_array_size,
            budget=MemoryBudget(
                self.max_session_bytes,
                "session (--max-session-bytes)",
                parent=self.principal_budget(state.principal),
            ),
            buffers=self.buffers,
        )
        with self._lock:
            if state.id in self._sessions:  # restored twice at once
                session.close()
                raise InvalidArgumentError(f"session {state.id[:12]}… is already open here")
            self._sessions[state.id] = session
            self.restored += 1
        return session

    def unfetched_outputs(self, patience: float) -> int:
        """Outputs handed out and not yet fetched, in every session whose client is
        still about it (``Session.unfetched_outputs``)."""
        now = time.monotonic()
        return sum(s.unfetched_outputs(patience, now) for s in self.sessions())

    def close_all(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            s.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
