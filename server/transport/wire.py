"""Per-call translation between wire messages and arrays, inside one session.

``CallIO`` turns a ``TensorInput`` into an op argument (a decoded array, or a
``Resident`` id the op resolves) and fills a ``TensorOutput``: inline, or kept
in the session when the request asked to keep outputs, or as a *transient*
resident tensor (fetched by stream, then deleted) when the value would not fit
in the response. The response's inline bytes are budgeted per call (a ``Batch``
is one call): every output that fits goes inline, the rest go transient, so a
response never grows past ``--max-message-bytes`` after its side effects ran.

Resident tensors live where the ops that use them compute: on a CUDA server the
LSTM ops' outputs are kept as GPU arrays, and a tensor uploaded with PutTensor
moves to the GPU the first time an LSTM op reads it, so a backward that names
activations or weights by id reads them without a host round trip. Only what
crosses the wire, or feeds an op that computes on the host (TensorArray,
StopGradient), is copied to host memory, through ``host_array``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gradserve import codec, dtypes, protocol
from gradserve.errors import InvalidArgumentError, ResourceExhaustedError
from gradserve.kernels.compute import Compute
from gradserve.server.core.sessions import (
    HandedOutReply,
    Resident,
    Session,
    TensorArg,
    TensorReservation,
)
from gradserve.server.core.tape import Payments, Recorder, Tape
from gradserve.server.core.tensor_array import Cleared, HandOut
from gradserve.server.transport import observability, shm_wire
from gradserve.v1 import tensor_array_pb2, tensor_pb2

log = logging.getLogger(__name__)


#: The most tensors and records a spent tape may hold to be freed on the event loop as
#: the reply is made (``CallIO.reply_made``): a fraction of a millisecond.
FREE_ON_REPLY_MAX = 1024


def _each(fn: Callable[[Tape], Any], tapes: Sequence[Tape]) -> None:
    for tape in tapes:
        fn(tape)


def _never_stop() -> None:
    return None


_UNLIMITED = 1 << 62

#: Encoded size of a ``TensorOutput`` holding a ref (id, dtype, shape): an upper bound
#: for ranks up to 8.
REF_BYTES = 160


#: Responses at least this large are serialized on the op's thread, not gRPC's event
#: loop (``CallIO._serialized``); smaller ones cost less than the hand-over.
SERIALIZED_ON_OP_THREAD_MIN_BYTES = 256 * 1024


class Where(enum.Enum):
    """Where an op's output goes (``CallIO._placement``)."""

    REGION = "the call's output region"
    INLINE = "inline, in the response"
    KEPT = "kept in the session (the request asked to keep it)"
    TRANSIENT = "by reference, fetched and then deleted (too large to go inline)"


@dataclasses.dataclass(frozen=True)
class Placement:
    """An output's place, and what it takes of the response and the session."""

    where: Where
    #: Bytes it adds to the response: its encoding inline, else a reference.
    response_bytes: int
    #: Its bytes (0 in the output region: not computed, nothing is held).
    nbytes: int = 0
    #: In the output region: the offset just past it.
    region_end: int | None = None

    @property
    def stays(self) -> bool:
        """The session holds it once the op ends (kept or transient)."""
        return self.where in (Where.KEPT, Where.TRANSIENT)


class CallIO:
    """Inputs and outputs of one call (one op, or every step of a Batch) in ``session``.

    ``response_left`` is how many bytes the response may still grow by: an output
    goes inline only if it fits (counting its encoding), and is sent transient
    otherwise; ``settle`` replaces the estimates of a finished Batch step by its
    result's exact size. An output is also sent transient when it alone is at least
    ``inline_limit`` bytes (the client's ``x-gradserve-inline-limit``: it streams
    large tensors). ``check_alive`` raises once the call is cancelled or past its
    deadline (long ops call it between steps). ``run`` runs one op so that a failure
    leaves no output of it behind.

    ``tapes`` are the gradient tapes the call records on (``x-gradserve-tape``):
    each op then gets a ``recorder`` that commits with it or rolls back with it.
    In a Batch, ``step`` is the running step's index and every step's outputs stay
    at hand (``produced``), so a later step's input can name them
    (``StepOutput``) without a round trip.
    """

    #: Same-host workers: the region this call writes its returned outputs into
    #: (``x-gradserve-output-region``), set by the servicer.
    shared_out: shm_wire.OutputArena | None = None
    #: A unary op's own response: its inline outputs by field number, serialized
    #: with it in one copy when the op ends (``codec.serialize_with_values``). None
    #: where the response goes into another message (a Batch step's).
    inline_values: list[tuple[int, np.ndarray]] | None = None
    #: The response ``output`` wrote to: the one ``inline_values`` belong to.
    _inline_owner: Any = None

    def __init__(
        self,
        session: Session,
        compute: Compute,
        *,
        inline_budget: int,
        inline_limit: int | None = None,
        inline_tensor_budget: int | None = None,
        check_alive: Callable[[], None] = _never_stop,
        tapes: list[Tape] | None = None,
    ) -> None:
        self.session = session
        self.compute = compute
        self.response_left = inline_budget
        self.inline_limit = inline_budget if inline_limit is None else inline_limit
        #: The tensor bytes the response may still carry inline (the server's
        #: ``--max-inline-reply-bytes``), apart from ``response_left``, which also
        #: counts refs and ids and says when a Batch's response is full: a cap on
        #: tensors must not end a Batch of refs after a step (a review helper: a cap
        #: of 0 ran a batch of 3,000 kept outputs as 3,000 calls).
        self.inline_left = _UNLIMITED if inline_tensor_budget is None else inline_tensor_budget
        self.check_alive = check_alive
        self._kept: list[str] = []  # ids stored by the op running now
        self._arrays_of_op: list[str] = []  # TensorArrays the op running now made
        #: TensorArrays this call made: forgotten with its outputs
        #: (``forget_outputs``), since only its response named them.
        self.arrays_made: list[str] = []
        #: What the running op's clearing reads cleared (``TensorArray.read``'s
        #: ``cleared``), and the call's: put back if its response is lost.
        self.cleared_by_op: list[Cleared] = []
        self.cleared: list[Cleared] = []
        #: Non-persistent tapes the running op's gradient computation spent
        #: (``tape_spent``), and the call's: freed once its reply is made in time
        #: (``reply_made``), live again if it is not (``Session.spend_tape``).
        self._spent_by_op: list[Tape] = []
        self.spent_tapes: list[Tape] = []
        #: Spent tapes too large to free as the reply is made, freed once the call
        #: has ended with it in time (``after_reply``).
        self._free_after_reply: list[Tape] = []
        #: Every id this call stored (kept or transient outputs): if the call ends
        #: without its response reaching the client, they are deleted
        #: (``forget_outputs``), since nobody else knows them.
        self.stored: list[str] = []
        #: The transient outputs the response hands out (``Session.handed_out``).
        self.handed_out: HandedOutReply | None = None
        self._over = False  # the call ended without its response: store nothing more
        #: The handler returned its response (``servicer._call_over``: a call that
        #: ended before it did had no response to name what the op stored).
        self.replied = False
        self._lock = threading.Lock()
        self.tapes = tapes or []
        #: The running op's recording, when the call names tapes.
        self.recorder: Recorder | None = None
        #: In a Batch: the running step, and each step's outputs by field name (an
        #: op argument, or a TensorArray handle id).
        self.step: int | None = None
        self.produced: dict[int, dict[str, TensorArg | str]] = {}
        #: The ids under which steps kept outputs no tape holds (``produced`` has
        #: their arrays, which later ops take as values), by (step, field): what a
        #: later step that must name a tensor (a watch, a gradient's target or
        #: source) names, as a later request does by the reply's ref.
        self.kept_ids: dict[tuple[int, str], str] = {}
        #: What messages add to a step's index: the batch-wide index of the request's
        #: first step (``BatchRequest.first_step``).
        self.first_step = 0
        #: Region copies made for op inputs, by ``id``: (copy, reservation, the Batch
        #: step that made it).
        self._copies: dict[int, tuple[np.ndarray, TensorReservation, int | None]] = {}
        #: The keys of ``_copies`` made (or given back) while the running op ran: what
        #: ``_after_op`` looks at. Scanning all of ``_copies`` there cost a Batch of n
        #: steps, each a step's output held until the Batch ends, O(n^2): 16,000
        #: StopGradient steps of one region (240 KB) took 7.6 s against 2.5 inline.
        self._copies_of_op: list[int] = []
        #: Outputs of the running op whose keeping it paid for before it changed state
        #: (``hand_out_for``). What no output used is given back when the op ends.
        self._paid_outputs = Payments(session.budget)
        #: Held tensors the running op's outputs are (``hand_out_for``'s ``pin``).
        self._pinned: list[Any] = []
        #: Tape ids of earlier Batch steps' outputs, pinned until the call ends
        #: (``hold_pins``): a later step may name one after another call released
        #: its tape (it was NOT_FOUND).
        self._step_pins: list[str] = []
        self._op_running = False  # ``run`` is running an op
        self._ended = False  # the call is over (``end``)

    def run(
        self, handler: Callable[[CallIO, Any], Any], request: Any, ordered: bool = False
    ) -> Any:
        """``handler(self, request)``; if it raises, the outputs it already stored in the
        session (kept or transient) are deleted: a failed op hands out no id, so none
        may stay behind holding bytes. ``ordered`` (a TensorArray op): under tapes, the
        op is recorded in the order it ran relative to other ordered ops
        (``Recorder``), and no snapshot of the session sees it half done
        (``Session.changing``). The heavy ops stay outside the gate: an LSTM op's one
        change is keeping its outputs, and Gradients inside it (61e7079) kept the gate
        from emptying when two overlapped, so every snapshot waited its 10 s and was
        torn anyway (found by a review helper); one taken mid-Gradients may hold its
        grad arrays under a source no call will use again."""
        with self.session.changing() if ordered else contextlib.nullcontext():
            return self._run(handler, request, ordered)

    def _run(self, handler: Callable[[CallIO, Any], Any], request: Any, ordered: bool) -> Any:
        self._kept = []
        self._arrays_of_op = []
        self.cleared_by_op = []
        self._spent_by_op = []
        recorder = None
        if self.tapes:
            recorder = Recorder(self.session, self.tapes, ordered=ordered, held=self)
        self.recorder = recorder
        with self._lock:
            self._op_running = True
        try:
            response = handler(self, request)
            if self.inline_values is not None:  # a unary op's own response
                response = self._serialized(response)
            if recorder is not None:
                recorder.commit()
            with self._lock:
                if not self._over:
                    self.stored += self._kept
                    self.arrays_made += self._arrays_of_op
                    self.cleared += self.cleared_by_op
                    self.spent_tapes += self._spent_by_op
                    return response
            # The call ended while the op ran: no one will learn these ids.
            self._undo(self._kept, self._arrays_of_op, self.cleared_by_op, self._spent_by_op)
            return response
        except BaseException:
            if recorder is not None:
                recorder.rollback()
            self._undo(self._kept, self._arrays_of_op, self.cleared_by_op, self._spent_by_op)
            if self.step is not None:
                self.produced.pop(self.step, None)
                for key in [k for k in self.kept_ids if k[0] == self.step]:
                    del self.kept_ids[key]
            raise
        finally:
            self._kept = []
            self._arrays_of_op = []
            self.cleared_by_op = []
            self._spent_by_op = []
            if self.inline_values:  # serialized, or the op failed: none for a next op
                self.inline_values.clear()
            self.recorder = None
            self._after_op()

    def _serialized(self, response: Any) -> Any:
        """A unary op's response, serialized here on the op's thread when it is
        large: gRPC serializes what a handler returns on the event loop, where every
        call of the server waits for it (helper-77: a session's 128 MiB gradients held
        another's KeepAlive 0.8 s)."""
        if self.inline_values:
            return self._with_inline_values(response)
        if response.ByteSize() < SERIALIZED_ON_OP_THREAD_MIN_BYTES:
            return response
        started = time.perf_counter()
        serialized = codec.Serialized(response.SerializeToString())
        observability.add_encode_time(time.perf_counter() - started)
        return serialized

    def _with_inline_values(self, response: Any) -> codec.Serialized:
        """``response`` serialized with its deferred inline outputs, here on the op's
        thread (the event loop only passes the bytes on)."""
        if response is not self._inline_owner:  # a handler's slip, never the client's
            raise RuntimeError("the handler returned another message than its outputs'")
        started = time.perf_counter()
        serialized = codec.serialize_with_values(response, self.inline_values or [])
        observability.add_encode_time(time.perf_counter() - started)
        return serialized

    def forget_outputs(self) -> Callable[[], None] | None:
        """The call's response did not reach the client: what the op still running
        stores is undone as it ends, and the returned work (None: nothing to do)
        deletes what the call stored, forgets the TensorArrays it made and puts back
        what its reads cleared. That work takes TensorArray locks, which a long op
        (a large scatter) on the same array holds: run it on a lane, not on the event
        loop (a review helper stalled every call of the server 2.9 s so)."""
        with self._lock:
            self._over = True
            stored, self.stored = self.stored, []
            arrays, self.arrays_made = self.arrays_made, []
            cleared, self.cleared = self.cleared, []
            spent, self.spent_tapes = self.spent_tapes, []
            spent += self._free_after_reply
            self._free_after_reply = []
        if not (stored or arrays or cleared or spent):
            return None
        return functools.partial(self._undo, stored, arrays, cleared, spent)

    def reply_made(self) -> None:
        """The handler replies, in time (``check_reply_in_time`` passed): the tapes the
        call's gradient computations spent are freed now, before the client hears
        back (its next call finds their bytes free, as when the computation released
        them at once), but only small ones (``FREE_ON_REPLY_MAX`` tensors and
        records): this runs on the event loop, just before the reply, and a long free
        there could hold the reply past its deadline and lose the gradients it frees
        the tape for (a review helper). A larger one is freed once the call has ended
        (``after_reply``)."""
        with self._lock:
            self.replied = True
            spent, self.spent_tapes = self.spent_tapes, []
            large = [t for t in spent if len(t.held) + len(t.records) > FREE_ON_REPLY_MAX]
            self._free_after_reply += large
        for tape in spent:
            if tape not in large:
                self.session.free_spent_tape(tape)

    def after_reply(self, reply_in_time: bool) -> Callable[[], None] | None:
        """The call ended with its reply made: the work (None: nothing to do) that
        frees the large spent tapes ``reply_made`` left if the reply went out in
        time, or makes them live again if sending it took past the deadline (the
        client got DEADLINE_EXCEEDED and asks again)."""
        with self._lock:
            tapes, self._free_after_reply = self._free_after_reply, []
        if not tapes:
            return None
        if reply_in_time:
            return functools.partial(_each, self.session.free_spent_tape, tapes)
        return functools.partial(_each, self.session.unspend_tape, tapes)

    def tape_spent(self, tape: Tape) -> None:
        """The running op's gradient computation spent ``tape`` (``Session.spend_tape``)."""
        self._spent_by_op.append(tape)

    def _undo(
        self,
        stored: list[str],
        arrays: list[str],
        cleared: list[Cleared],
        spent: Sequence[Tape] = (),
    ) -> None:
        """Delete the outputs ``stored`` and the TensorArrays ``arrays`` made by ops whose
        results reach no one, then put back what their clearing reads cleared (latest
        first; the outputs, deleted first, mostly held those bytes), and make the tapes
        their gradient computations ``spent`` live again, all inside the snapshot gate
        (a snapshot between the delete and the put-back held neither).
        Past the budget an element stays cleared: another call took the room, or a
        tape holds the read's output (the same array, charged to the tape until it is
        released, and to the array again)."""
        with self.session.changing():
            if stored:
                self.session.delete(stored)
            if arrays:
                self.session.forget_tensor_arrays(arrays)
            for read in reversed(cleared):
                try:
                    read.put_back()
                except ResourceExhaustedError:
                    log.warning("a cleared TensorArray element could not be put back: no room")
            for tape in spent:
                self.session.unspend_tape(tape)

    def made_array(self, handle: str) -> None:
        """The running op made TensorArray ``handle``, which only its response names."""
        self._arrays_of_op.append(handle)

    def settle(self, before: int, result_bytes: int) -> None:
        """After a Batch step: the response grew by ``result_bytes`` (its result, and
        the few bytes that wrap it) since ``response_left`` was ``before``."""
        self.response_left = before - result_bytes - 8

    def prepay_record(self, *copies: np.ndarray) -> None:
        """Before an op that changes state, under tapes: its record is paid now
        (``Recorder.prepay``)."""
        if self.recorder is not None:
            self.recorder.prepay(*copies)

    def hand_out_for(
        self,
        keep: bool | Sequence[bool],
        record_copies: Callable[[Sequence[Any]], Sequence[Any]] | None = None,
        *,
        irreversible: bool = False,
    ) -> HandOut:
        """What an op that changes state calls with its outputs before it is done
        (``TensorArray.read``, ``gradients``): holding them is paid for there, so that a
        session without room refuses the op while it can be undone. A read used to clear
        its element and then be refused for keeping the value (a kept or transient
        output, or one a tape holds), and the element was lost. Under live tapes the
        tapes pay (a kept or transient ref shares their tensor), with the op's record
        and the copies of ``record_copies(outputs)`` it keeps (``Recorder.prepay``);
        else the outputs ``emit`` will keep are paid for: ``keep`` (one flag, or one per
        output), or too large to go inline, where ``emit`` would place them.

        An output the session holds already is paid its record only (an alias,
        ``Session.keeping_charges``). An op that cannot be undone once it hands out
        must not be refused after, so it pays more:

        - ``irreversible`` (Gradients on a non-persistent tape, which it releases; it
          hands out holding no lock of an array's): such outputs are pinned until the
          op ends, so that another call deleting the original (or releasing the tape
          that held it) cannot make keeping them cost more than was paid.
        - A TensorArray op that gives credit (it cleared what it gives back) hands out
          under its array's lock, where the session's may not be taken (it is taken
          before an array's, never after): it pins nothing, and its credit pays in
          full instead (``Payments.pay``).
        - Both pay for outputs meant for the call's output region as if the region
          failed (``_staying``)."""

        def hand_out(outputs: Sequence[Any], credit: int) -> int:
            if irreversible:
                self._pinned += self.session.pin(outputs)
            if self.recorder is not None:
                if record_copies is not None:
                    self.recorder.prepay(*record_copies(outputs))
                used = self.recorder.pay_for_outputs(outputs, credit)
                if used is not None:
                    return used
            keeps = [keep] * len(outputs) if isinstance(keep, bool) else keep
            # An op that gives credit cleared what it gives back: it cannot be undone.
            staying = self._staying(outputs, keeps, irreversible or credit > 0)
            return self._paid_outputs.pay(staying, credit)

        return hand_out

    def _staying(
        self, outputs: Sequence[Any], keeps: Sequence[bool], irreversible: bool = False
    ) -> list[tuple[Any, int, int]]:
        """(output, forecast, full charge: ``Payments.pay``) for each of ``outputs`` that
        ``emit`` may keep in the session: ``_placement`` in turn, as ``emit`` will
        place them.

        An output meant for the call's output region stays only if the region fails
        (the worker shrinks or removes it) as ``emit`` writes: ``emit`` then places
        it inline if the response has room, else transient. For an op that cannot
        be undone (``irreversible``) it is listed if it would not fit inline, and
        counted in the response at its inline size otherwise, so that the outputs
        after it are paid for as ``emit`` would place them then; what goes unused is
        given back when the op ends. Any other op that fits the session is never
        refused for it: a failed region then fails it cleanly, undone."""
        staying, left, inline = [], self.response_left, self.inline_left
        offset = self.shared_out.offset if self.shared_out is not None else 0
        for a, keep in zip(outputs, keeps):
            place = self._placement(a, keep, left, offset, inline)
            if place.region_end is not None:  # the region's, unless it fails
                offset = place.region_end
                if not irreversible:
                    left -= place.response_bytes
                    continue
                nbytes = dtypes.nbytes(a)
                size = protocol.encoded_size(nbytes, a.ndim)
                if size <= left - REF_BYTES:
                    left -= size
                    continue
                staying.append((a, *self.session.keeping_charges(a, nbytes)))
                left -= REF_BYTES
                continue
            left -= place.response_bytes
            if place.where is Where.INLINE:
                inline -= place.response_bytes
            if place.stays:
                staying.append((a, *self.session.keeping_charges(a, place.nbytes)))
        return staying

    def _inline_limit(self) -> int:
        """The client's inline limit; none once the call's output region failed (the
        worker shrank or removed it: it is not used again in this call). The op paid
        nothing ahead for keeping outputs meant for the region, and one that changed
        state (a read that cleared its element, Gradients on a tape it released) must
        not be refused now for want of room to keep them: each goes inline if the
        response has room for it at all."""
        if self._region_failed():
            return _UNLIMITED
        return self.inline_limit

    def _region_failed(self) -> bool:
        """The call's output region failed: its outputs go inline where the response
        has room at all, whatever the inline limits (``_inline_limit``)."""
        return self.shared_out is not None and self.shared_out.broken

    def paid_for(self, value: Any, charge: int) -> None:
        self._paid_outputs.add(value, charge)

    def hold_pins(self, tensor_ids: list[str]) -> None:
        """The op's pins of its tape outputs (``Recorder._pinned``): let go of now, or,
        in a Batch that goes on, when the call ends (a later step may name them)."""
        with self._lock:
            if self.step is not None and not self._ended:
                self._step_pins += tensor_ids
                return
        self.session.let_go_ids(tensor_ids)

    def _placement(
        self,
        array: Any,
        keep: bool,
        response_left: int,
        offset: int,
        inline_left: int | None = None,
    ) -> Placement:
        """Where ``emit`` puts output ``array`` (the one definition, so that what an op
        pays for ahead, ``_staying``, is what ``emit`` then keeps): not kept, into the
        call's output region from ``offset`` if it fits there; else inline if it fits
        the ``response_left`` bytes the response may still grow by and the
        ``inline_left`` tensor bytes (default ``self.inline_left``), and is under the
        inline limit (``_inline_limit``; without limits, as it, once the region
        failed); else by reference (kept, or transient: fetched, then deleted)."""
        if not keep and self.shared_out is not None:
            end = self.shared_out.end_of(array, offset)
            if end is not None:
                return Placement(Where.REGION, REF_BYTES, region_end=end)
        nbytes = dtypes.nbytes(array)  # a pass over a string tensor
        size = protocol.encoded_size(nbytes, array.ndim)
        if keep:
            return Placement(Where.KEPT, REF_BYTES, nbytes)
        tensors_left = self.inline_left if inline_left is None else inline_left
        if (
            nbytes >= self._inline_limit()
            or size > response_left - REF_BYTES
            or (size > tensors_left and not self._region_failed())
        ):
            return Placement(Where.TRANSIENT, REF_BYTES, nbytes)
        return Placement(Where.INLINE, size, nbytes)

    def tensor(self, msg: tensor_pb2.TensorInput, field: str) -> TensorArg:
        """An op argument: the inline value decoded, or the resident tensor's id."""
        which = msg.WhichOneof("source")
        if which == "value":
            started = time.perf_counter()
            array = codec.decode(msg.value, field=field)
            observability.add_decode_time(time.perf_counter() - started)
            return array
        if which == "ref":
            return Resident(msg.ref)
        if which == "shared":  # a copy: the worker may overwrite its region afterwards
            return self._region_copy(msg.shared, field)
        if which == "step_output":
            value = self._step_output(msg.step_output, field)
            if isinstance(value, str):
                raise InvalidArgumentError(
                    f"input '{field}' names step {self.step_shown(msg.step_output.step)}'s "
                    f"'{msg.step_output.field}', a TensorArray handle, not a tensor",
                    field=field,
                )
            return value
        raise InvalidArgumentError(f"input '{field}' is required", field=field)

    def _region_copy(self, msg: tensor_pb2.SharedTensor, field: str) -> np.ndarray:
        """A copy of the tensor ``msg`` names in one of the session's regions. Its bytes
        are reserved in the session's budget before the copy is allocated and held until
        the op ends (in a Batch, a copy that is a step's output until the Batch ends);
        an op that keeps the copy as an output (``_keep``), stores it (``hand_over``)
        or holds it on a tape (``take``) charges it once. Without this a call
        naming one small region in each of its inputs made the server allocate inputs
        times --max-tensor-bytes that no budget counted."""
        dtype = codec.dtype_from_enum(msg.dtype, field=f"{field}.dtype")
        nbytes = self.session.regions.nbytes(dtype, msg.shape, field)
        reservation = self.session.reserve_tensor(nbytes)
        try:
            array = shm_wire.read_tensor(self.session, msg, field)
        except BaseException:
            reservation.release()
            raise
        with self._lock:
            self._copies[id(array)] = (array, reservation, self.step)
            self._copies_of_op.append(id(array))
        return array

    def _after_op(self) -> None:
        """An op ended: give back the budget of its region copies that no output kept
        (``_region_copy``). In a Batch that goes on, a copy that is a step's output stays
        held (a later step may name it) until the Batch ends."""
        self._paid_outputs.release_all()
        if self._pinned:
            pinned, self._pinned = self._pinned, []
            self.session.let_go(pinned)
        pins: list[str] = []
        with self._lock:
            self._op_running = False
            made, self._copies_of_op = self._copies_of_op, []
            if self.step is None or self._ended:
                done, self._copies = list(self._copies.values()), {}
                pins, self._step_pins = self._step_pins, []
            else:  # this step's copies but its outputs (held: only earlier steps' outputs)
                outputs = {id(v) for v in self.produced.get(self.step, {}).values()}
                gone = [k for k in dict.fromkeys(made) if k in self._copies and k not in outputs]
                done = [self._copies.pop(k) for k in gone]
        for _, reservation, _ in done:
            reservation.release()
        if pins:
            self.session.let_go_ids(pins)

    def end(self) -> None:
        """The call is over (its response sent, or the call cancelled, its op perhaps
        still running): release the region copies and the steps' pins now, or when
        that op ends."""
        with self._lock:
            self._ended = True
            if self._op_running:
                return  # ``_after_op`` releases them
            done, self._copies = list(self._copies.values()), {}
            pins, self._step_pins = self._step_pins, []
        for _, reservation, _ in done:
            reservation.release()
        if pins:
            self.session.let_go_ids(pins)

    def hand_over(self, value: TensorArg) -> None:
        """The op stores input ``value`` itself and charges it as stored (a TensorArray
        write): a region copy stops being held for the call, so it is counted once."""
        reservation = self.take(value)
        if reservation is not None:
            reservation.release()

    def take(self, value: Any) -> TensorReservation | None:
        """The reservation of region copy ``value``, for a holder that takes its charge
        over (``tape.HeldBytes``); None if ``value`` is no held copy."""
        with self._lock:
            copy = self._copies.pop(id(value), None)
        return None if copy is None else copy[1]

    def give_back(self, value: Any, reservation: TensorReservation) -> None:
        """A reservation ``take`` handed out that no holder took over."""
        with self._lock:
            self._copies[id(value)] = (value, reservation, self.step)
            self._copies_of_op.append(id(value))

    def _keep(self, array: Any, nbytes: int) -> str:
        """``array`` kept in the session under a new id: a region copy on the bytes
        already reserved for it, anything else on what the op paid for it ahead
        (``hand_out_for``), the rest charged now."""
        reservation = self.take(array)
        if reservation is not None:
            return reservation.keep(array)
        return self.session.put(array, nbytes, paid=self._paid_outputs.take(array))

    def step_shown(self, step: int) -> int:
        """A step of this request as messages number it: in the caller's whole batch."""
        return self.first_step + step

    def _step_output(self, ref: tensor_pb2.StepOutput, field: str) -> TensorArg | str:
        """What an earlier step of this Batch produced as ``ref.field``."""
        if self.step is None:
            raise InvalidArgumentError(
                f"input '{field}' names a step's output: only a Batch step may",
                field=field,
            )
        if not 0 <= ref.step < self.step:
            raise InvalidArgumentError(
                f"input '{field}' names step {self.step_shown(ref.step)}: a step may name "
                f"only earlier steps (this is step {self.step_shown(self.step)})",
                field=field,
            )
        outputs = self.produced.get(ref.step, {})
        if ref.field not in outputs:
            names = ", ".join(sorted(outputs)) or "none"
            raise InvalidArgumentError(
                f"input '{field}' names output '{ref.field}' of step "
                f"{self.step_shown(ref.step)}, which has no such output (its outputs: {names})",
                field=field,
            )
        return outputs[ref.field]

    def host(self, arg: TensorArg) -> np.ndarray:
        """An op argument's value in host memory."""
        return host_array(self.compute, self.session.resolve(arg))

    def handle(self, msg: tensor_array_pb2.TensorArrayHandle, field: str = "handle") -> str:
        """A TensorArray handle id: as sent, or (in a Batch) made by an earlier step."""
        if msg.HasField("from_step"):
            value = self._step_output(msg.from_step, field)
            if not isinstance(value, str):
                raise InvalidArgumentError(
                    f"'{field}' names step {self.step_shown(msg.from_step.step)}'s "
                    f"'{msg.from_step.field}', a tensor, not a TensorArray handle",
                    field=field,
                )
            return value
        return handle_id(msg, field)

    def named(self, msg: tensor_pb2.TensorInput, field: str) -> TensorArg:
        """``tensor``, but an earlier step's output that step kept is named by its id
        (a tensor of the session), not taken as its value."""
        if msg.WhichOneof("source") == "step_output":
            ref = msg.step_output
            kept = self.kept_ids.get((ref.step, ref.field))
            if kept is not None and 0 <= ref.step < (self.step or 0):
                return Resident(kept)
        return self.tensor(msg, field)

    def produce(self, field: str, value: TensorArg | str) -> None:
        """In a Batch, remember the running step's output ``field`` for later steps."""
        if self.step is not None:
            self.produced.setdefault(self.step, {})[field] = value

    def input(self, msg: tensor_pb2.TensorInput, field: str) -> np.ndarray:
        """The input as a host array (for ops that compute on the host)."""
        return host_array(self.compute, self.session.resolve(self.tensor(msg, field)))

    def output(
        self,
        array: Any,
        response: Any,
        field: str,
        keep: bool,
        tape_id: str | None = None,
    ) -> None:
        """``response.field``: kept (as it is, host or device array), inline (from host
        memory) when it fits the response, else transient. ``tape_id``: a tape holds
        the output under that id, which the response carries and a kept or transient
        ref shares (one tensor, charged once). ``response`` is the handler's own."""
        number = response.DESCRIPTOR.fields_by_name[field].number
        self._inline_owner = response
        self.emit(array, getattr(response, field), field, keep, tape_id, number)

    def emit(
        self,
        array: Any,
        out: tensor_pb2.TensorOutput,
        field: str,
        keep: bool,
        tape_id: str | None = None,
        number: int | None = None,
    ) -> None:
        """``output`` into the message ``out`` (an element of a repeated field), which
        later Batch steps name ``field``. ``number``: ``out`` is the response's own
        field of that number, whose inline value may be serialized with the response
        (``inline_values``)."""
        if not hasattr(array, "__cuda_array_interface__"):  # scalars, lists: as NumPy
            array = np.asarray(array)
        self.produce(field, Resident(tape_id) if tape_id else array)
        if tape_id:
            out.tape_id = tape_id
            self.response_left -= len(tape_id) + 4
        arena = self.shared_out
        offset = arena.offset if arena is not None else 0
        place = self._placement(array, keep, self.response_left, offset)
        if place.where is Where.REGION and arena is not None:
            if arena.write(host_array(self.compute, array), out):
                self.response_left -= place.response_bytes
                return
            # The region failed (the worker shrank or removed it): placed without it.
            place = self._placement(array, keep, self.response_left, offset)
        self.response_left -= place.response_bytes
        if place.where is Where.INLINE:
            self.inline_left -= place.response_bytes
        if place.where is not Where.INLINE:
            ref = out.ref
            if tape_id and self.session.publish(tape_id):
                ref.id = tape_id
            else:
                ref.id = self._keep(array, place.nbytes)
            self._kept.append(ref.id)
            if place.where is Where.KEPT and not tape_id and self.step is not None:
                self.kept_ids[(self.step, field)] = ref.id
            ref.dtype = codec.dtype_to_enum(array.dtype)
            ref.shape[:] = array.shape
            ref.transient = place.where is Where.TRANSIENT
            if ref.transient:
                if self.handed_out is None:
                    self.handed_out = HandedOutReply()
                self.session.handed_out(ref.id, self.handed_out)
            return
        array = host_array(self.compute, array)
        if (
            number is not None
            and self.inline_values is not None
            and codec.inlines_in_one_copy(array)
        ):
            self.inline_values.append((number, array))
            return
        started = time.perf_counter()
        codec.encode(array, out.value)
        observability.add_encode_time(time.perf_counter() - started)


def host_array(compute: Compute, array: Any) -> np.ndarray:
    """``array`` in host memory (a copy only if it is a device array)."""
    return compute.to_host(array)


def handle_id(msg: tensor_array_pb2.TensorArrayHandle, field: str = "handle") -> str:
    if not msg.id:
        raise InvalidArgumentError(f"'{field}' is required", field=field)
    return msg.id


def dtype_of(enum: int, field: str = "dtype") -> np.dtype:
    """The dtype a request names, or INVALID_ARGUMENT naming the field."""
    return codec.dtype_from_enum(enum, field=field)
