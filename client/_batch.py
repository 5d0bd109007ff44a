"""``client.batch()``: many ops, one round trip (the ``Batch`` RPC).

Ops recorded on ``batch.raw_ops`` run in order on the server when ``run()`` is
called; the server stops at the first failing step. Steps before it stay
applied (each step is atomic); the raised error carries ``.step`` (its
index) and ``.results`` (the results of the steps that ran). A batch too large
for one message goes in several, in order, with the same semantics.

Dataflow: recording an op returns placeholders for its outputs (``StepOutput``:
step index and output name), which later ops of the same batch take as inputs,
TensorArray handles included, so a whole forward pass (and its ``gradient``)
is one round trip. The server resolves them; nothing crosses the wire between
steps.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from google.protobuf.message import Message

from gradserve import protocol, wire_fields
from gradserve.client import _nest as nest
from gradserve.client._errors import typed_error
from gradserve.client._raw_ops import RawOps, Staging, Submit
from gradserve.client._types import StepOutput
from gradserve.errors import (
    FailedPreconditionError,
    GradserveError,
    InvalidArgumentError,
    NotFoundError,
)
from gradserve.lstm_signature import LSTMActivations, LSTMGrads
from gradserve.protocol import BATCH_FIELDS
from gradserve.v1 import service_pb2, tape_pb2, tensor_array_pb2, tensor_pb2

_METHODS = service_pb2.DESCRIPTOR.services_by_name["GradServe"].methods_by_name
#: The ops whose flow output is their flow input (the others' is 0.0).
_FLOW_THROUGH = frozenset({"TensorArrayWriteV3", "TensorArrayScatterV3", "TensorArraySplitV3"})
_NAMED_OUTPUTS = (tensor_pb2.TensorOutput.DESCRIPTOR, tensor_array_pb2.TensorArrayHandle.DESCRIPTOR)
#: Tensors one watch step names (each a few fields): within a request's field limit.
WATCH_STEP_TENSORS = 8192
_BATCH_IDS = itertools.count(1)


def placeholders(
    rpc: str,
    step: int,
    dtype: np.dtype | None = None,
    request: Message | None = None,
    batch: int | None = None,
) -> Any:
    """What recording ``rpc`` as step ``step`` returns: its outputs as ``StepOutput``s
    in the order the typed call returns them (one output: the output itself).
    ``dtype``: that of its tensor outputs, where known (a concat's lengths: int64).
    A flow is the value the op returns (its ``flow_in``, or 0.0), as the call gives
    it, not a placeholder: it orders nothing on the server."""
    fields = _METHODS[rpc].output_type.fields
    flow = np.float32(getattr(request, "flow_in", 0.0) if rpc in _FLOW_THROUGH else 0.0)
    outs = [
        StepOutput(step, f.name, _output_dtype(f, dtype), batch)
        if f.message_type in _NAMED_OUTPUTS
        else flow
        for f in fields
    ]  # fmt: skip
    if rpc in ("BlockLSTMV2", "BlockLSTM"):
        return LSTMActivations(*outs)
    if rpc in ("BlockLSTMGradV2", "BlockLSTMGrad"):
        return LSTMGrads(*outs)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _known_dtype(value: Any) -> np.dtype | None:
    """The dtype of a tensor the SDK knows it of (an array, a ``TensorRef``, a
    placeholder that carries one), else None."""
    dtype = getattr(value, "dtype", None)
    return np.dtype(dtype) if dtype is not None else None


def _output_dtype(field: Any, dtype: np.dtype | None) -> np.dtype | None:
    if field.message_type is not tensor_pb2.TensorOutput.DESCRIPTOR:
        return None  # a TensorArray handle
    return np.dtype(np.int64) if field.name == "lengths" else dtype


def _recorder(batch: Batch) -> Submit:
    """``batch._record``, held weakly. The batch holds its ``raw_ops``, and so do the
    parse functions of its steps; a strong reference back made a cycle, so a batch
    dropped without ``run()`` kept what its steps name (the tapes of their inputs,
    their shared-memory leases) until Python's cycle collector ran, where TensorFlow
    frees at once. A ``raw_ops`` kept without its batch records nothing: nothing could
    run it."""
    record = weakref.WeakMethod(batch._record)
    client = batch._client

    def submit(rpc: str, request: Message, parse: Callable[[Any], Any], temps: Staging) -> Any:
        method = record()
        if method is None:
            client._clean_up(list(temps))  # its uploads and leases (helper-72)
            raise ReferenceError(
                "this batch was dropped: keep the Batch that client.batch() returned, to "
                "run() the ops recorded on its raw_ops"
            )
        return method(rpc, request, parse, temps)

    return submit


class Batch:
    """A list of ops to run with as few ``Batch`` RPCs as the message limits allow.

    Steps go in one request while they fit both ends' message limits, in more
    otherwise, in order; a server whose response fills up stops before a step
    (reason ``RESPONSE_FULL``) and the rest goes in the next request. Either way the
    steps run in order and stop at the first failure, as in one RPC. A step that
    names an output of a step sent in an earlier request gets that output as the
    earlier reply carried it (by id, or its value).
    """

    def __init__(self, client) -> None:
        self._client = client
        #: (rpc, request, parse, the tapes it records on: those recording when it was
        #: added, in the recording they were in then (``Recorded``), wherever and
        #: whenever ``run()`` is called).
        self._steps: list[tuple[str, Message, Callable[[Any], Any], tuple[Any, ...]]] = []
        self._temps: list[str] = []
        #: The tapes holding inputs its steps name by tape id (``Staging.tapes_named``).
        self._tapes_named: list[Any] = []
        #: Those inputs by id, with the recordings that held each (``_released_inputs``).
        self._outputs_named: dict[str, tuple[Any, tuple[Any, ...]]] = {}
        #: The recordings the batch needs alive when it runs, by id: the last step that
        #: names an output of one, or asks one for gradients (``needs``).
        self._last_need: dict[str, int] = {}
        #: While ``run()`` goes: the same of the steps it runs, and the first step of
        #: the request it is at.
        self._running_need: dict[str, int] = {}
        self._run_from = 0
        #: The Gradients steps, each with the recording it asks (a non-persistent one is
        #: released by it, once it ran).
        self._releases: list[tuple[int, Any]] = []
        self.raw_ops = RawOps(client, _recorder(self), client._staging)
        #: What this batch's placeholders carry (``StepOutput.batch``).
        self._id = next(_BATCH_IDS)

    def _record(self, rpc: str, request: Message, parse, temps: Staging) -> Any:
        try:
            self._check_own(temps.placeholders)
        except BaseException as e:
            self._client._clean_up(list(temps), failure=e)  # (its uploads go)
            raise
        tapes = tuple(t.recorded() for t in self._client._recording.tapes)
        self._steps.append((rpc, request, parse, tapes))
        self._temps.extend(temps)
        self._name(temps.tapes_named, len(self._steps) - 1)
        for value, lives in temps.outputs_named:
            self._outputs_named[value.tape_id] = (value, lives)
        return placeholders(rpc, len(self._steps) - 1, temps.output_dtype, request, self._id)

    def _check_own(self, values: Any) -> None:
        """Refuse a placeholder of another batch among ``values`` (nested): it would
        name this batch's step of that index (a review helper: silently)."""
        for value in nest.flatten(values):
            if isinstance(value, StepOutput) and value.batch not in (None, self._id):
                raise InvalidArgumentError(
                    f"a placeholder of another batch (step {value.step}'s '{value.field}'): "
                    "a batch's steps take the outputs of its own earlier steps; run that "
                    "batch first and pass its result"
                )

    def _name(self, tapes: list[Any], step: int) -> None:
        """Step ``step`` names outputs of ``tapes``' current recordings by id."""
        self._tapes_named += tapes
        for tape in tapes:
            self._last_need[tape.id] = step

    def needs(self) -> set[str]:
        """The ids of the recordings that steps not yet run ask for gradients or name
        outputs of: the client releases none of them (reset, left by entering the tape
        again) before (``_release_dropped``). A recording its tape has left is not
        needed for steps merely recorded on it: nothing could ask it for their
        gradients (``_recorded_on``)."""
        later = {i for i, last in self._running_need.items() if last >= self._run_from}
        return later | self._last_need.keys()

    @staticmethod
    def _recorded_on(tapes: tuple[Any, ...], needed: set[str]) -> list[Any]:
        """The recordings a request records on: of its first step's, those not
        released, that are their tapes' current ones or that a step of a batch not yet
        run (this one's from here included) needs (``needs``: a reset's, one a
        non-persistent tape's gradient step ended). One its tape left that nothing will
        ask was started on the server for nothing (a loop of resets in one batch ran
        into the session's 64 tapes: helper-73), and one the caller released (by
        ``release()`` or its gradient) cannot be asked: the steps run unrecorded, as
        they would have run before that (they were refused: helper-74)."""
        return [
            r for r in tapes if not r.life.released and (r.tape.life is r.life or r.id in needed)
        ]

    def gradient(
        self,
        tape,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients="none",
        *,
        keep: bool = False,
    ) -> list[StepOutput]:
        """``tape.gradient`` as a step: targets, sources and output gradients may be
        outputs of earlier steps, in nested structures as ``tape.gradient`` takes them.
        Returns one placeholder per source, in a list (for one source too) or the
        sources' tuple or dict structure; ``run()`` returns the gradients so as this
        step's result."""
        tape._require_id()
        self._check_own((target, sources, output_gradients))
        built = tape.gradients_request(
            target, sources, output_gradients, unconnected_gradients, keep=keep
        )
        self._temps.extend(built["temps"])
        self._name(built["tapes_named"], len(self._steps))
        request = built["message"]
        recorded = tape.recorded()
        # In the order op steps name them, so that a gradient step goes in their
        # request (a nested tape's gradient began a request of its own: helper-74).
        tapes = tuple(t.recorded() for t in self._client._recording.tapes)
        if recorded not in tapes:
            tapes = (recorded, *tapes)

        def shaped(flat: list[Any]) -> Any:
            return nest.pack_like(sources, flat) if nest.is_nested(sources) else flat

        self._steps.append(
            (
                "Gradients",
                request,
                lambda r: shaped([tape.decode(g) for g in r.gradients]),
                tapes,
            )
        )
        step = len(self._steps) - 1
        self._releases.append((step, recorded))
        self._last_need[recorded.id] = step
        tape.end_in_batch()  # a non-persistent tape's recording ends here
        # A gradient has its source's dtype (an LSTM step given one takes its T).
        dtypes_ = [_known_dtype(source) for source in nest.flatten(sources)]
        return shaped(
            [StepOutput(step, f"gradients[{n}]", d, self._id) for n, d in enumerate(dtypes_)]
        )

    def watch(self, tape, tensor) -> None:
        """``tape.watch`` as a step: it takes effect where it stands among the batch's
        steps (ops before it that read the tensor pass it no gradient, as in
        TensorFlow, where a direct ``tape.watch`` takes effect before all of them), and
        it may watch outputs of earlier steps that are kept or held by a tape. Its
        result in ``run()`` is None; ``WATCH_STEP_TENSORS`` tensors a step. As
        ``tape.watch``, it records nothing while no tape records on this thread."""
        tape._require_id()

        def steps(tensors: list[Any], held: Callable[[], None]) -> None:
            self._check_own(tensors)
            for t in tensors:
                if isinstance(t, StepOutput) and self._released_before_run(t):
                    raise FailedPreconditionError(
                        f"batch.watch: step {t.step}'s '{t.field}' is held only by tapes "
                        "that an earlier step's gradient releases (or that were released): "
                        "when this watch runs the server holds it no more; keep it "
                        "(keep=True), or watch it before that gradient step"
                    )
            recorded = tape.recorded()
            # In the order op steps name them (as a gradient step): in their request.
            tapes = tuple(t.recorded() for t in self._client._recording.tapes)
            if recorded not in tapes:
                tapes = (recorded, *tapes)
            # A step each ``WATCH_STEP_TENSORS``, within a request's field limit (one
            # step of 40,000 was refused, the whole batch with it: a review helper).
            for start in range(0, max(len(tensors), 1), WATCH_STEP_TENSORS):
                part = tensors[start : start + WATCH_STEP_TENSORS]
                request, named, outputs = tape.watch_request(part)
                index = len(self._steps)
                self._name(named, index)
                for value, lives in outputs:
                    self._outputs_named[value.tape_id] = (value, lives)
                last = start + WATCH_STEP_TENSORS >= len(tensors)
                parse = (lambda r: held()) if last else (lambda r: None)
                self._steps.append(("WatchTensors", request, parse, tapes))
                self._last_need[recorded.id] = index

        tape.watch_each(tensor, steps, step_outputs=True)

    def _released_before_run(self, output: StepOutput) -> bool:
        """Whether every recording that holds step ``output.step``'s outputs is
        released, or ends at a gradient step of this batch added since, and the step
        does not keep them: a later step can name them no more (the server: NOT_FOUND).
        A recording another batch's gradient step ends may still hold them when this
        batch runs: not judged here."""
        if not 0 <= output.step < len(self._steps):
            return False  # (the server says what is wrong with it)
        _, request, _, tapes = self._steps[output.step]
        if getattr(request, "keep_outputs", False):
            return False
        # A gradient step's outputs are recorded on the other tapes only, not on the
        # recording it asks (a review helper: accepted, then NOT_FOUND at the run).
        asked = {id(r) for step, r in self._releases if step == output.step}
        holders = [r for r in tapes if id(r) not in asked]
        if not holders:
            return False  # (no tape holds it: it goes by value, refused as that)
        # Only a non-persistent recording ends at its gradient step (a persistent
        # tape's output was refused: a review helper).
        ending = {
            id(r.life) for step, r in self._releases if step > output.step and not r.tape.persistent
        }
        return all(r.life.released or id(r.life) in ending for r in holders)

    def __len__(self) -> int:
        return len(self._steps)

    def __del__(self) -> None:
        """A batch dropped without ``run()``: its inputs' shared-memory leases go back
        to the client's pool, its uploads (inputs past the request limit or the
        stream threshold, not in shared memory) to the client's queue of ids to
        delete, which its next call empties, and the tapes its gradient steps would
        have ended may ask again. It takes no lock and makes no RPC: a garbage
        collection runs it inside whatever call it interrupts."""
        for _, recorded in getattr(self, "_releases", ()):
            recorded.life.ending = False
        client = getattr(self, "_client", None)
        temps = getattr(self, "_temps", None)
        if client is None or not temps:
            return
        shm = client._shm
        uploads = shm.release_temps(temps, later=True) if shm is not None else temps
        client._dropped_uploads.extend(uploads)

    def _abandon(self) -> list[str]:
        """Its client is closing (a client of a session it does not own: the session
        stays): nothing can run it any more. Its leases go back; returns its uploads'
        ids, for the client to delete (they held the session's bytes)."""
        temps, self._temps = self._temps, []
        shm = self._client._shm
        return shm.release_temps(temps) if shm is not None else temps

    def run(self) -> list[Any]:
        """Run every recorded op; returns their results in order (like the typed calls)."""
        steps, self._steps = self._steps, []
        temps, self._temps = self._temps, []
        tapes_named, self._tapes_named = self._tapes_named, []  # noqa: F841 - alive till the end
        outputs_named, self._outputs_named = self._outputs_named, {}
        self._running_need, self._last_need, self._run_from = self._last_need, {}, 0
        releases, self._releases = self._releases, []
        results: list[Any] = []
        replies: list[Message] = []  # each step's typed result, for later requests
        failure: BaseException | None = None
        earlier = _Earlier(self._client, steps, results, temps)
        earlier.released = _released_inputs(outputs_named)
        recordings = {r for *_, tapes in steps for r in tapes}  # (once: not per request)
        recovered_at = -1  # the step last repeated with the regions registered again
        error: GradserveError | None = None
        try:
            start = 0
            while start < len(steps):
                try:
                    # A step that names an earlier request's output may fail here, as
                    # the op would on its own (ConversionError) or its upload would.
                    request = self._request(steps, start, replies, earlier)
                    self._run_from = start
                    needed = self._client._needed_by_batches()
                    tapes = self._recorded_on(steps[start][3], needed)
                    for step in range(start, start + len(request.steps)):
                        earlier.recorded_on[step] = tapes
                    reply = self._client._call("Batch", request, tapes=tapes)
                except BaseException as e:
                    failure = e
                    if isinstance(e, GradserveError) and results:
                        # The requests before this one ran: their results (kept
                        # tensors' ids among them) are the caller's, as a failed
                        # step's are; they were dropped, held until the session ended.
                        e.step = start if e.step is None else e.step
                        e.results = results
                    raise
                parsers = [parse for _, _, parse, _ in steps[start:]]
                results += self._client._parse(
                    reply, lambda r, ps=parsers: [self._one(p, x) for p, x in zip(ps, r.results)]
                )
                replies += [getattr(r, r.WhichOneof("op")) for r in reply.results]
                releases = _release_ran(releases, len(results))
                # What the steps run so far alone needed goes now, not at the end.
                self._run_from = len(results)
                needed = self._client._needed_by_batches()
                _release_left(recordings, needed, self._client._dropped_tapes)
                if not reply.HasField("failed_step"):
                    start += len(request.steps)
                    continue
                if reply.error.reason == "RESPONSE_FULL" and reply.failed_step > 0:
                    start += reply.failed_step  # not run: goes in the next request
                    continue
                failed = start + reply.failed_step
                error = typed_error(
                    reply.error.code,
                    _renumbered(reply.error.message, reply.failed_step, start),
                    reason=reply.error.reason,
                    step=failed,
                    results=results,
                )
                if failed != recovered_at and self._recover(error):
                    # The server lost the regions its inputs are in (it restarted, or
                    # took the session over): the step changed nothing; from it again.
                    start = recovered_at = failed
                    continue
                raise error
        finally:
            for _, recorded in _release_ran(releases, len(results)):
                recorded.life.ending = False  # its step did not run: the tape may ask again
            self._client._clean_up(temps, failure=failure)
            self._running_need, self._run_from = {}, 0
            needed = self._client._needed_by_batches()
            _release_left(recordings, needed, self._client._dropped_tapes)
            # (a cycle through the frames of the error raised kept the tapes until a GC)
            failure = error = None
        return results

    def _recover(self, error: GradserveError) -> bool:
        """Whether ``error`` says the server does not know a region the step's inputs
        are in, and the client registered its regions again (``_call_recovering``)."""
        shm = self._client._shm
        return isinstance(error, NotFoundError) and shm is not None and shm.recover(error)

    def _request(
        self, steps: list, start: int, replies: list[Message], earlier: _Earlier
    ) -> service_pb2.BatchRequest:
        """The steps from ``start`` that fit in one request (at least one), in bytes
        and in the server's field limit, and record on the same tapes, their step
        references made relative to the request. A step is measured once its
        references to earlier requests are values: a reference is a few bytes, the
        value an earlier reply carried up to a message's worth. Such a value goes
        inline where it fits the step alone in a request (one that does not fit
        this one begins the next), uploaded only where it does not."""
        request = service_pb2.BatchRequest(first_step=start)
        left = self._client.request_budget - request.ByteSize()
        fields_left = protocol.MAX_REQUEST_FIELDS - 1
        for rpc, op_request, _, tapes in steps[start:]:
            if request.steps and tapes != steps[start][3]:
                break
            step = getattr(request.steps.add(), BATCH_FIELDS[rpc])
            step.CopyFrom(op_request)
            if start or earlier.released:
                room = Staging(max(0, self._client.request_budget - op_request.ByteSize() - 16))
                try:
                    _rebase(step, start, replies, earlier, room)
                except GradserveError as e:
                    if len(request.steps) > 1:  # the steps before it run first, as alone
                        del request.steps[-1]
                        break
                    e.step = start if e.step is None else e.step
                    if not e.message.startswith("Batch step "):  # as the server says it
                        e.message = f"Batch step {e.step} ({rpc}): {e.message}"
                        e.args = (e.message,)
                    raise
            size = step.ByteSize() + 16
            fields = wire_fields.message_fields(step) + 2  # with the step and its op's key
            if len(request.steps) > 1 and (size > left or fields > fields_left):
                del request.steps[-1]  # the next request begins with it
                break
            left -= size
            fields_left -= fields
        return request

    @staticmethod
    def _one(parse: Callable[[Any], Any], result: Any) -> Any:
        """``parse`` of a step's result (the oneof inside ``BatchResult``)."""
        return parse(getattr(result, result.WhichOneof("op")))


def _released_inputs(named: dict[str, tuple[Any, tuple[Any, ...]]]) -> dict[str, Any]:
    """Of the op outputs steps name by their tape ids, those whose recordings were all
    released (by ``release()``, or a tape's own gradient) between the step's recording
    and ``run()``: the server holds them no more, and they go by value, as the op run
    at that time would have taken them (they were NOT_FOUND). A recording merely left
    (a reset) is held for the batch, and still records what flows from them."""
    return {
        tape_id: value
        for tape_id, (value, lives) in named.items()
        if lives and all(life.released for life in lives)
    }


def _release_ran(releases: list[tuple[int, Any]], ran: int) -> list[tuple[int, Any]]:
    """Mark the recordings of the Gradients steps that ran (``step < ran``) as their
    step left them (a non-persistent one released: a later request of the same batch
    does not name it, or the server would refuse it); returns the rest."""
    for step, recorded in releases:
        if step < ran:
            recorded.done()
    return [(step, recorded) for step, recorded in releases if step >= ran]


def _release_left(recordings: set[Any], needed: set[str], queue: Any) -> None:
    """Queue for release the ``recordings`` a run's steps were on that their tapes
    have left since (reset, or entered again), that nothing released and nothing
    ``needed``: their finalizers ran when the tapes left them, before this run started
    them (or while it needed them). Each once."""
    for recorded in recordings:
        life = recorded.life
        if (
            recorded.tape.life is not life
            and not life.released
            and life.proposed
            and life.tape_id not in needed
        ):
            if not life.queued:  # (its finalizer may have queued it when the tape left)
                life.queued = True
                queue.append(life.tape_id)
            life.released = True  # as far as later steps go: its outputs go by value


class _Earlier:
    """Outputs of steps sent in earlier requests, as the SDK parsed them."""

    def __init__(self, client, steps: list, results: list, temps: list) -> None:
        self.client, self.steps, self.results, self.temps = client, steps, results, temps
        #: The upload (or shared-memory copy) that carries an earlier output, by
        #: (step, field), or a released one (``released``), by its tape id: a step that
        #: goes in a later request after all (the field or byte limit, a full
        #: response), or another step that names the same output, names it again
        #: instead of copying it twice. Freed with the batch's other uploads and leases.
        self.copies: dict[Any, tensor_pb2.TensorInput] = {}
        #: The recordings each step sent was recorded on (``Batch._recorded_on``).
        self.recorded_on: dict[int, list[Any]] = {}
        #: Outputs named by tape id whose recordings the caller released before the
        #: run, by id: sent by value (``_released_inputs``).
        self.released: dict[str, Any] = {}

    def tape_holds(self, step: int) -> bool:
        """Whether a recording that step ``step`` was recorded on still holds its
        outputs (one whose gradient step ran in an earlier request released them: they
        go by value, as a released tape's ``TapedArray`` does; by id the server had
        them no more, a batch fuzzer found; nor may one the step was not recorded on
        count: helper-74)."""
        return any(not r.life.released for r in self.recorded_on.get(step, ()))

    def encode_released(self, msg: tensor_pb2.TensorInput, room: Staging) -> None:
        """The value of the released output ``msg`` names, into ``msg`` (once for all
        the steps that name it: helper-78 saw one upload per step)."""
        tape_id = msg.ref
        self._encode_once(tape_id, lambda: np.asarray(self.released[tape_id]), msg, room)

    def encode(self, step: int, field: str, msg: tensor_pb2.TensorInput, room: Staging) -> None:
        """The value of ``field`` of step ``step`` into ``msg`` (a transient output was
        fetched and deleted when its reply was parsed: it goes by value again)."""

        def value() -> Any:
            parsed = self.results[step]
            name, _, index = field.partition("[")
            if index:  # a gradients step's result may be in its sources' structure
                return nest.flatten(parsed)[int(index.rstrip("]"))]
            if isinstance(parsed, tuple) and hasattr(parsed, name):
                return getattr(parsed, name)
            return parsed

        self._encode_once((step, field), value, msg, room)

    def _encode_once(
        self, key: Any, value: Callable[[], Any], msg: tensor_pb2.TensorInput, room: Staging
    ) -> None:
        """``value()`` into ``msg``: inline where it fits ``room`` (what a request of the
        step alone has left), else uploaded, or copied into a region, once per ``key``
        (later steps name that copy)."""
        if (copy := self.copies.get(key)) is not None:
            msg.CopyFrom(copy)
            return
        staging = Staging(room.inline_left)
        self.client.encode_input(value(), msg, staging)
        room.inline_left = staging.inline_left
        if msg.WhichOneof("source") != "value":  # uploaded, or copied into a region
            self.copies[key] = tensor_pb2.TensorInput()
            self.copies[key].CopyFrom(msg)
        self.temps.extend(staging)


def _rebase(
    message: Message, start: int, replies: list[Message], earlier: _Earlier, room: Staging
) -> None:
    """Make the step references in ``message`` relative to a request that begins at
    step ``start``; one naming a step of an earlier request becomes what that
    step's reply carried (a tensor id, or the value the SDK received, inline within
    ``room``)."""
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        # A gradient's targets and sources must name tensors (by value, INVALID_ARGUMENT:
        # helper-79): one whose recording was released goes by its id all the same, and
        # the server answers as for any tensor of that id (NOT_FOUND where none holds
        # it; a source no tape here saw is None, as in TensorFlow).
        named_only = isinstance(
            message, (tape_pb2.GradientsRequest, tape_pb2.WatchTensorsRequest)
        ) and field.name != ("output_gradients")
        watching = isinstance(message, tape_pb2.WatchTensorsRequest)
        for item in [value] if isinstance(value, Message) else value:
            if isinstance(item, tensor_pb2.TensorInput) and item.WhichOneof("source") == "ref":
                if item.ref in earlier.released and watching:
                    raise FailedPreconditionError(
                        f"'{field.name}' names an output whose tapes were all released "
                        "before this watch ran (release(), or a non-persistent tape's "
                        "gradient): the server holds it no more; watch it before, or "
                        "directly with tape.watch, which adopts it"
                    )
                if item.ref in earlier.released and not named_only:
                    earlier.encode_released(item, room)
            elif isinstance(item, tensor_pb2.TensorInput) and item.HasField("step_output"):
                ref = item.step_output
                if ref.step >= start:
                    ref.step -= start
                    continue
                out = _output(replies[ref.step], ref.field)
                if not isinstance(out, tensor_pb2.TensorOutput):  # as the server says it
                    raise InvalidArgumentError(
                        f"input '{field.name}' names step {ref.step}'s '{ref.field}', a "
                        "TensorArray handle, not a tensor"
                    )
                if out.tape_id and (earlier.tape_holds(ref.step) or named_only):
                    item.ref = out.tape_id  # held by the tape: differentiable onwards
                elif out.WhichOneof("result") == "ref" and not out.ref.transient:
                    item.ref = out.ref.id
                elif named_only:  # as the server says it of a value in the same request
                    raise InvalidArgumentError(
                        f"'{field.name}' must name a tensor of the session or tape (a ref, "
                        "or in a Batch a step's output), not carry a value: a value sent "
                        f"inline has no gradient (step {ref.step}'s '{ref.field}' went by "
                        "value)"
                    )
                else:
                    earlier.encode(ref.step, ref.field, item, room)
            elif isinstance(item, tensor_array_pb2.TensorArrayHandle) and item.HasField(
                "from_step"
            ):
                ref = item.from_step
                if ref.step >= start:
                    ref.step -= start
                    continue
                made = _output(replies[ref.step], ref.field)
                if not isinstance(made, tensor_array_pb2.TensorArrayHandle):  # as the server
                    raise InvalidArgumentError(
                        f"'{field.name}' names step {ref.step}'s '{ref.field}', a tensor, not "
                        "a TensorArray handle"
                    )
                item.ClearField("from_step")
                item.id, item.name = made.id, made.name
            else:
                _rebase(item, start, replies, earlier, room)


def _renumbered(message: str, failed: int, start: int) -> str:
    """The server's "Batch step N (Op): ..." of a request that began at step ``start``,
    numbered in the whole batch, as the error's ``step`` is: a server that predates
    ``BatchRequest.first_step`` numbers it in the request (one that reads it has,
    and its N is never ``failed`` then)."""
    prefix = f"Batch step {failed} "
    if start and message.startswith(prefix):
        return f"Batch step {start + failed} " + message[len(prefix) :]
    return message


def _output(reply: Message, field: str) -> Any:
    """``reply.field``, or an element for a name like ``gradients[2]``."""
    name, _, index = field.partition("[")
    value = getattr(reply, name)
    return value[int(index.rstrip("]"))] if index else value
