"""Gradient tapes: the ops a session ran while a tape recorded, for ``gradients``.

A tape is the server-side half of ``tf.GradientTape``. Every op that runs under
it (the client names the tape in its request) appends a ``Record``: which
tensors it read and wrote, by key, and what its registered gradient will need.
Keys are tensor ids (resident tensors and the tape's own outputs) and, for a
TensorArray, one *flow* key per version of its contents (``flow_key``): a write
makes a new version, a read reads the current one. Flow keys are how TensorFlow
orders TensorArray gradients too (its ``flow`` tensors), so the reverse sweep
visits a read's gradient before the gradient of the write that it read.

A tape *holds* what its backward pass needs (``Session.hold_for_tape``): the
values of every op output (the client may pass them on to later ops by id, as
it passes a ``tf.Tensor``) and the inputs of ops whose gradient reads them
(BlockLSTM's). Held tensors stay charged to the session's byte budget until the
tape is released, even if the client deletes the resident tensor meanwhile.

``Recorder`` is one op's recording: it holds values as the op runs (so a tape
over the budget fails the op with RESOURCE_EXHAUSTED), and either commits the
record once the op has succeeded or lets go of everything it held.

Frameworks build on this shape: a tape is just records plus held tensors, so an
adapter (a PyTorch ``autograd.Function``, a Keras layer) records a forward under
a tape and asks ``Gradients`` for the backward.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from gradserve.server.core.budget import MemoryBudget
    from gradserve.server.core.sessions import Session, TensorArg, TensorReservation


class HeldBytes(Protocol):
    """Bytes an op's call already holds in the budget for some of its values (region
    copies of its inputs): ``take`` hands them over for ``value`` (None if none are
    held), ``give_back`` returns what a holder did not take."""

    def take(self, value: Any) -> TensorReservation | None: ...

    def give_back(self, value: Any, reservation: TensorReservation) -> None: ...

    def paid_for(self, value: Any, charge: int) -> None:
        """``charge`` for keeping ``value`` is in the budget already (paid for a tape
        released since): the call keeps ``value`` on it, or gives it back."""
        ...

    def hold_pins(self, tensor_ids: list[str]) -> None:
        """Ids the op's outputs got on the tapes, pinned for the call
        (``Recorder._pinned``): the call lets go of them (``Session.let_go_ids``) when
        nothing of it may name them any more."""
        ...


class Payments:
    """Budget bytes paid ahead for outputs an op will hold (``tensor_array.HandOut``),
    by output object: one payment each time an output is handed out (an output handed
    out twice, a source named twice in Gradients, is held twice). Not thread-safe: one
    op's."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self._by_id: dict[int, tuple[Any, int, int]] = {}  # id -> (output, charge, times)

    def pay(self, charges: Sequence[tuple[Any, int, int]], credit: int) -> int:
        """Reserve ``charges`` ((output, forecast, full) each: what keeping it should
        cost and what it costs at most, ``Session.keeping_charges``), using ``credit``
        bytes the op gives back to the budget anyway (``HandOut``); returns the credit
        used. The credit pays first for what a forecast may be short of (an output
        forecast as an alias, whose original may be deleted before it is kept): a
        read that clears an element a resident tensor shares is then paid in full at
        no cost, and keeping its output can never be refused after the clear."""
        left = credit
        paid = []
        for value, forecast, full in charges:
            extra = min(full - forecast, left)
            left -= extra
            paid.append((value, forecast + extra))
        forecasts = sum(forecast for _, forecast, _ in charges)
        from_credit = min(left, forecasts)
        self.budget.reserve(forecasts - from_credit)
        for value, charge in paid:
            self.add(value, charge)
        return credit - left + from_credit

    def add(self, value: Any, charge: int) -> None:
        _, _, times = self._by_id.get(id(value), (value, charge, 0))
        self._by_id[id(value)] = (value, charge, times + 1)

    def take(self, value: Any) -> int | None:
        """One payment for ``value`` (its charge), or None if none is left."""
        entry = self._by_id.get(id(value))
        if entry is None:
            return None
        _, charge, times = entry
        if times == 1:
            del self._by_id[id(value)]
        else:
            self._by_id[id(value)] = (value, charge, times - 1)
        return charge

    def release_all(self) -> None:
        """Give back what no output took."""
        entries, self._by_id = self._by_id, {}
        self.budget.release(sum(charge * times for _, charge, times in entries.values()))


#: The most tapes one session may have alive at once.
MAX_TAPES_PER_SESSION = 64

#: Bytes charged to the session, per tape, for each op a tape records: its
#: ``Record`` and the tape's entries for it (about 240 measured: 15.5 KB per op
#: on 64 tapes). The host copies a record keeps (indices, lengths) are charged
#: besides, by their size. Uncharged, one Batch of 10,000 StopGradient steps (160 KB)
#: on 64 tapes held 154 MB under a 1 MiB session.
RECORD_BYTES = 256


def record_cost(saved: Mapping[str, Any]) -> int:
    """What one tape is charged for a record that keeps ``saved``."""
    return RECORD_BYTES + sum(v.nbytes for v in saved.values() if isinstance(v, np.ndarray))


#: Stand-ins in ``Record.inputs``/``outputs`` for a TensorArray's flow keys,
#: resolved when the record is committed (``Tape.commit``).
FLOW_IN = "\x00flow-in"
FLOW_OUT = "\x00flow-out"


def flow_key(handle: str, version: int) -> str:
    """The key of version ``version`` of TensorArray ``handle``'s contents."""
    return f"ta:{handle}#{version}"


@dataclasses.dataclass(frozen=True)
class Record:
    """One op as recorded.

    ``inputs`` are the keys of its differentiable inputs in the order its gradient
    function returns their gradients (None: a constant, sent inline); ``outputs``
    the keys of its outputs in the order its gradient function takes theirs.
    ``saved`` is what the gradient function needs besides (held tensor ids, small
    host arrays such as an index, attributes).
    """

    op: str
    inputs: tuple[str | None, ...]
    outputs: tuple[str | None, ...]
    saved: Mapping[str, Any]


class Tape:
    """One tape's state; its containers change only under the owning session's lock
    (``Session``'s tape methods), so ``Session`` stays the one place that counts
    held bytes."""

    def __init__(self, tape_id: str, *, persistent: bool, watch_accessed_variables: bool):
        self.id = tape_id
        self.persistent = persistent
        self.watch_accessed_variables = watch_accessed_variables
        #: Tensors held for the backward pass, by id (``sessions._Kept``).
        self.held: dict[str, Any] = {}
        #: How many ops (recorded, or still running) hold each id of ``held``: a failed
        #: op lets go of its own holds only (``Session.release_held``). One entry per
        #: id let a failed op take off the tape a tensor that another op, recorded
        #: meanwhile, needed (found by a review helper).
        self.holds: dict[str, int] = {}
        #: Keys of tensors that recorded ops produced: differentiable.
        self.outputs: set[str] = set()
        #: Tensors watched (``WatchTensors``, or read by a recorded op when
        #: ``watch_accessed_variables``): differentiable sources, each with when it
        #: became watched, the number of records before it (``gradients.recorded``:
        #: TensorFlow records an op only if one of its inputs is watched, or an
        #: output of a recorded op, when it runs).
        self.watched_at: dict[str, int] = {}
        self.records: list[Record] = []
        #: Bytes charged for ``records`` (``record_cost`` each), released with the tape.
        self.record_bytes = 0
        self.released = False
        #: The current version of each TensorArray's contents (``flow_key``).
        self.flow_versions: dict[str, int] = {}
        #: Held by an op on a TensorArray from before it runs until its record is
        #: committed, so records are in the order the ops ran (a read recorded before
        #: the write it read would lose the write's gradient).
        self.order = threading.Lock()

    def revived(self) -> Tape:
        """A live tape under this id that takes over everything this one holds and
        recorded (caller holds the session's lock). This object stays released for
        good: an op that began while it was spent (``Session.spend_tape``) reserved
        nothing for it and took no holds on it, and must not commit onto it when the
        spend is undone (a review helper: the record's bytes came off the budget
        unreserved)."""
        new = Tape(
            self.id,
            persistent=self.persistent,
            watch_accessed_variables=self.watch_accessed_variables,
        )
        new.held, self.held = self.held, {}
        new.holds, self.holds = self.holds, {}
        new.outputs, self.outputs = self.outputs, set()
        new.watched_at, self.watched_at = self.watched_at, {}
        new.records, self.records = self.records, []
        new.record_bytes, self.record_bytes = self.record_bytes, 0
        new.flow_versions, self.flow_versions = self.flow_versions, {}
        self.released = True
        return new

    def commit(self, op: str, inputs: tuple[str | None, ...], outputs: tuple[str | None, ...],
               saved: Mapping[str, Any]) -> None:  # fmt: skip
        """Append a record, resolving its flow stand-ins (caller holds the session
        lock)."""
        handle = saved.get("handle")
        if handle is not None:
            version = self.flow_versions.get(handle, 0)
            inputs = tuple(flow_key(handle, version) if k == FLOW_IN else k for k in inputs)
            if FLOW_OUT in outputs:
                self.flow_versions[handle] = version + 1
                outputs = tuple(
                    flow_key(handle, version + 1) if k == FLOW_OUT else k for k in outputs
                )
        self.outputs.update(k for k in outputs if k is not None and not k.startswith("ta:"))
        self.records.append(Record(op, inputs, outputs, saved))


class Recorder:
    """The recording of one op on the tapes its call named.

    The op's handler calls ``arg`` for each input and ``output`` for each output as
    it runs, then ``record``; the call's end either ``commit``s (the op succeeded)
    or ``rollback``s (it failed: every tensor held for it is let go of).
    """

    def __init__(
        self,
        session: Session,
        tapes: list[Tape],
        *,
        ordered: bool = False,
        held: HeldBytes | None = None,
    ) -> None:
        """``ordered``: the op changes or reads state whose order matters (a
        TensorArray): it runs holding the tapes' ``order`` locks (by id, so two ops
        never wait on each other), until ``commit`` or ``rollback``. ``held``: what the
        call already holds for its values; a value the tapes keep takes that charge
        over (counted once)."""
        self.session = session
        self.held = held
        self.tapes = list({id(t): t for t in tapes}.values())  # each tape once
        #: Reserved in the budget for this op's records and outputs, and the part of it
        #: paid ahead (``prepay``) that no record has used yet.
        self._reserved = self._prepaid = 0
        self._locked: list[Tape] = []
        if ordered:
            for tape in sorted(self.tapes, key=lambda t: t.id):
                tape.order.acquire()
                self._locked.append(tape)
        self._held: list[tuple[Tape, str]] = []
        #: Ids this op's tensors got on the tapes, held for the call as well until the
        #: op ends: another call may release the tapes before the reply names them
        #: (``Session.publish``), and the value must not go with them.
        self._pinned: list[str] = []
        self._pending: list[tuple[str, tuple[str | None, ...], tuple[str | None, ...],
                                  Mapping[str, Any], int]] = []  # fmt: skip
        self._watch: set[str] = set()
        #: Outputs paid for ahead (``pay_for_outputs``).
        self._paid = Payments(session.budget)

    def arg(self, value: TensorArg, *, hold: bool = False) -> tuple[str | None, str | None]:
        """An input's (differentiable key, held id).

        A tensor passed by id is differentiable under its id, and held as it is:
        deleting it does not take it from the tape, which charges no more bytes for
        it. One the client keeps (put, or kept) is watched when the tape watches
        accessed variables, as TensorFlow watches variables; another tape's output
        (a ``TapedArray``) is an intermediate, which TensorFlow does not watch. A
        value sent inline is a constant (key None); with ``hold`` (its gradient needs
        the value) the tape keeps it under a new id, charged to the session.
        """
        from gradserve.server.core.sessions import Resident

        if isinstance(value, Resident):
            if self.session.is_variable(value.id):
                self._watch.add(value.id)
            for tape in self.tapes:
                if self.session.hold_for_tape(tape, value.id):
                    self._held.append((tape, value.id))
            return value.id, value.id if hold else None
        if not hold:
            return None, None
        return None, self._keep(value)

    def prepay(self, *copies: np.ndarray) -> None:
        """Reserve the op's record on every live tape now, with the host copies of
        ``copies`` it will keep (``small``): called before an op that changes state,
        so that a session without room refuses the op before the change, not after
        (``record`` then reserves nothing more)."""
        cost = (RECORD_BYTES + sum(c.nbytes for c in copies)) * self._live_tapes()
        self.session.budget.reserve(cost)
        self._reserved += cost
        self._prepaid += cost

    def pay_for_outputs(self, outputs: Sequence[Any], credit: int) -> int | None:
        """Reserve now what holding ``outputs`` on the live tapes will cost (each is
        charged once, however many tapes hold it), ``credit`` bytes of it out of what
        the op gives back (``tensor_array.HandOut``; returns the credit used): called
        by an op that changes state before its outputs are held (a TensorArray read
        that clears its element), so that no room refuses it while it can still be
        undone. Only the budget's lock is taken (the op holds a TensorArray's). None
        when no tape is live (nothing will hold them here)."""
        if not self._live_tapes():
            return None
        charges = [(v, *self.session.keeping_charges(v)) for v in outputs]
        return self._paid.pay(charges, credit)

    def output(self, value: Any) -> str | None:
        """Hold an op output on every tape; returns its tape id (None if every tape was
        released while the op ran: then there is nothing to record it on)."""
        return self._keep(value)

    def _keep(self, value: Any) -> str | None:
        paid = self._paid.take(value)
        reserved = None
        if paid is None and self.held is not None:
            reserved = self.held.take(value)
        held = None
        try:
            held = self.session.keep_for_tapes(self.tapes, value, reserved, paid=paid, pin=True)
        finally:
            if held is None and reserved is not None and self.held is not None:
                self.held.give_back(value, reserved)  # no live tape took it over
            if held is None and paid is not None:  # (the tapes were released meanwhile)
                if self.held is not None:
                    self.held.paid_for(value, paid)  # the call may keep it on that
                else:
                    self.session.budget.release(paid)
        if held is not None:
            self._held += [(tape, held) for tape in self.tapes]
            self._pinned.append(held)
        return held

    def record(self, op: str, inputs: tuple[str | None, ...], outputs: tuple[str | None, ...],
               saved: Mapping[str, Any]) -> None:  # fmt: skip
        cost = record_cost(saved)
        more = cost * self._live_tapes() - self._prepaid
        if more > 0:
            self.session.budget.reserve(more)
            self._reserved += more
        self._prepaid = max(0, -more)
        self._pending.append((op, inputs, outputs, saved, cost))

    def commit(self) -> None:
        """The op succeeded: its records join the tapes, which take over their charge."""
        try:
            charged = self.session.commit_records(self.tapes, self._pending, self._watch)
            self._held, self._pending = [], []
            self._give_back(self._reserved - charged)
        finally:
            self._let_go_pins()
            self._unlock()

    def rollback(self) -> None:
        """The op failed: nothing of it stays on any tape."""
        held, self._held, self._pending = self._held, [], []
        try:
            self.session.release_held(held)
            self._give_back(self._reserved)
        finally:
            self._let_go_pins()
            self._unlock()

    def _let_go_pins(self) -> None:
        pinned, self._pinned = self._pinned, []
        if not pinned:
            return
        if self.held is not None:
            self.held.hold_pins(pinned)  # (a Batch's later steps may name them)
        else:
            self.session.let_go_ids(pinned)

    def _live_tapes(self) -> int:
        """How many of the tapes may take a record (one released meanwhile takes none:
        ``commit`` gives back what was reserved for it)."""
        return sum(not tape.released for tape in self.tapes)

    def _give_back(self, nbytes: int) -> None:
        self._paid.release_all()
        self._reserved = self._prepaid = 0
        self.session.budget.release(nbytes)

    def _unlock(self) -> None:
        locked, self._locked = self._locked, []
        for tape in locked:
            tape.order.release()


def small(value: Any) -> np.ndarray:
    """A small argument (index, indices, lengths) kept in a record, as a host copy."""
    return np.array(value, copy=True)
