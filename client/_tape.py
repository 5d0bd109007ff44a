"""``client.gradient_tape()``: ``tf.GradientTape`` whose tape lives in the server.

Inside ``with client.gradient_tape() as tape:`` every op the client runs (through
``client.raw_ops``, the ``tensor_array`` layer or a ``batch()``) is recorded in
the session; ``tape.gradient(targets, sources)`` then asks the server for the
gradients (the ``Gradients`` RPC), which it computes with TensorFlow's
registered gradients. Op outputs come back as ``TapedArray`` values that also
carry the tape's id for them; resident tensors (``client.put``) read under the
tape are watched, as ``tf.Variable``s are.
"""

from __future__ import annotations

import collections
import contextlib
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from gradserve import protocol
from gradserve.client import _nest as nest
from gradserve.client._types import StepOutput, TapedArray, TapeRefs, TensorRef, tape_refs
from gradserve.errors import TapeReleasedError
from gradserve.v1 import tape_pb2, tensor_pb2

_UNCONNECTED = {
    "none": tape_pb2.UNCONNECTED_NONE,
    "zero": tape_pb2.UNCONNECTED_ZERO,
}


class Recording(threading.local):
    """The tapes recording on this thread (TensorFlow's tapes are per thread too)."""

    def __init__(self) -> None:
        self.tapes: list[GradientTape] = []
        #: The tapes the last call on this thread named (its outputs belong to them),
        #: weakly: they pin no tape the program dropped.
        self.call_tapes: TapeRefs = ()

    @staticmethod
    def ids(tapes: Any) -> str:
        """The ``x-gradserve-tape`` header naming ``tapes``."""
        return ",".join(dict.fromkeys(t.header() for t in tapes))


class _Life:
    """One recording of a tape, as its finalizer reads it (the tape itself is gone by
    then): its id, whether the server started it (``started``: a call naming it
    succeeded; ``proposed``: one was sent, and the server may have started it even
    if the call failed), released it, or will when a batch runs (``ending``)."""

    __slots__ = ("ending", "proposed", "queued", "released", "started", "tape_id")

    def __init__(self) -> None:
        self.tape_id: str | None = None
        self.released = False
        self.started = False
        self.proposed = False
        self.ending = False
        #: In the client's queue of tapes to release (once is enough).
        self.queued = False

    def header(self, persistent: bool, watch_accessed_variables: bool) -> str:
        """This recording's entry in ``x-gradserve-tape`` (``GradientTape.header``)."""
        if self.started:
            return str(self.tape_id)
        return f"+{self.tape_id}.{int(persistent)}{int(watch_accessed_variables)}"


def _dropped(queue: collections.deque[str], life: _Life) -> None:
    """A recording's finalizer (any thread, any time: it only appends): one the server
    may hold goes to the client's queue of tapes to release (``Client._release_dropped``;
    a call that failed may have started it: releasing one it did not is NOT_FOUND,
    logged)."""
    if (life.started or life.proposed) and not life.released and life.tape_id is not None:
        life.queued = True
        queue.append(life.tape_id)


class Recorded:
    """A tape as a call names it: in the recording ``life`` of ``tape``. A batch's step
    keeps the recording it was added in, whatever the tape does before ``run()``
    (reset, entered again after its gradient): the step is recorded on that one, and
    ops added after a reset are not (helper-72: they were all recorded on the tape's
    current recording, and the gradient took in what TensorFlow forgets)."""

    __slots__ = ("life", "tape")

    def __init__(self, tape: GradientTape, life: _Life) -> None:
        self.tape, self.life = tape, life

    @property
    def id(self) -> str | None:
        return self.life.tape_id

    def header(self) -> str:
        return self.life.header(self.tape.persistent, self.tape.watch_accessed_variables)

    def done(self) -> None:
        """Its Gradients step ran: a non-persistent recording is released by it (and
        no longer waits in the client's queue of tapes to release: its ReleaseTape
        failed, logged, once per loop iteration: helper-74)."""
        if not self.tape.persistent:
            self.life.released = True
            if self.tape._life is self.life:
                self.tape._stop()
            if self.life.queued:
                with contextlib.suppress(ValueError):
                    self.tape._client._dropped_tapes.remove(self.life.tape_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Recorded) and other.tape is self.tape and other.life is self.life

    def __hash__(self) -> int:
        return hash((id(self.tape), id(self.life)))


class GradientTape:
    """A gradient tape in the client's session, used the way ``tf.GradientTape`` is.

    ``persistent=False`` (the default): one ``gradient`` call, after which the server
    releases everything the tape held. ``persistent=True``: any number, until
    ``release()``, or until the tape is garbage collected (as TensorFlow frees one; the
    client's next call releases it), or the session ends. Its outputs (``TapedArray``)
    do not keep it alive. Everything a tape holds counts against the session's byte
    budget, and a session holds at most 64 tapes.
    """

    def __init__(
        self, client: Any, persistent: bool = False, watch_accessed_variables: bool = True
    ):
        self._client = client
        self.persistent = persistent
        self.watch_accessed_variables = watch_accessed_variables
        with client._tapes_lock:  # (made directly too: a closing client releases it)
            client._tapes.add(self)
        self._life = _Life()
        self._finalizer: weakref.finalize | None = None
        #: In its ``with`` block (on some thread), not stopped by a gradient call.
        self._entered = False

    @property
    def id(self) -> str | None:  # noqa: A003 - the SDK's name for it since the start
        """The current recording's id (None before the tape is first entered)."""
        return self._life.tape_id

    @id.setter  # noqa: A003
    def id(self, value: str | None) -> None:
        self._life.tape_id = value

    @property
    def life(self) -> _Life:
        """The current recording."""
        return self._life

    def recorded(self) -> Recorded:
        """The tape in its current recording, as a batch's step keeps it."""
        return Recorded(self, self._life)

    @property
    def released(self) -> bool:
        """Released: by ``release()``, or (non-persistent) by its gradient call, or
        about to be by a batch's gradient step (``end_in_batch``)."""
        return self._life.released or self._life.ending

    # ---------------------------------------------------------------- recording
    def end_in_batch(self) -> None:
        """A batch's gradient step on this tape ends a non-persistent recording, as
        ``gradient`` does: nothing more is recorded on it, another gradient is refused,
        and the tape entered again records afresh (one loop's iterations in one batch:
        helper-72). The server releases the recording when the batch runs that step;
        until then it holds it for the batch (``Client._release_dropped``)."""
        if not self.persistent:
            self._life.ending = True
            self._stop()

    def done(self) -> None:
        """The server ran a gradient computation on this tape: a non-persistent tape
        is released by it (as a batch's gradient step releases its recording)."""
        self.recorded().done()

    def __enter__(self) -> GradientTape:
        if self._entered:  # on this thread or another (TensorFlow's flag is the tape's)
            raise ValueError(  # TensorFlow's words and class
                "Tape is still recording, This can happen if you try to re-enter an "
                "already-active tape."
            )
        if self.released or self.id is None:
            # Entered again after its (non-persistent) gradient call, it records afresh,
            # as ``tf.GradientTape`` does: a training loop may reuse one tape object.
            self._record_afresh()
        self._client._recording.tapes.append(self)
        self._entered = True
        return self

    def reset(self) -> None:
        """Forget what was recorded and go on recording afresh, as
        ``tf.GradientTape.reset`` (inside the ``with`` block; TensorFlow's ValueError
        outside). What the tape held is released before the client's next call, and
        its outputs so far go to later ops by value."""
        if self not in self._client._recording.tapes:  # (inside stop_recording too)
            raise ValueError("Tape is not recording.")
        self._record_afresh()

    def _record_afresh(self) -> None:
        """A new recording under a new id, proposed here and started by the server
        with the first call that names it (``header``: a tape costs no round trip of
        its own). The id is new so that the outputs of the last recording stay its
        own (``TapedArray.live_tapes``); that recording's finalizer runs now, queueing
        it for release if the server holds it unreleased (one finalizer per recording
        kept until the tape went would pile up in a loop)."""
        if self._finalizer is not None:
            self._finalizer()
        self._life = _Life()
        self._life.tape_id = secrets.token_urlsafe(16)
        self._finalizer = weakref.finalize(self, _dropped, self._client._dropped_tapes, self._life)

    def header(self) -> str:
        """This tape's entry in ``x-gradserve-tape``: "+ID.PW" starts it if the server
        does not have it yet (P, W: persistent, watch_accessed_variables), until a call
        naming it has succeeded (``started``); then "ID", which a server that no longer
        has it (restarted without it, or another replica) refuses. Proposed every
        time, a tape lost that way was started again empty under its id, and gave
        the gradients of what came after alone."""
        return self._life.header(self.persistent, self.watch_accessed_variables)

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _stop(self) -> None:
        self._entered = False
        tapes = self._client._recording.tapes
        if self in tapes:
            tapes.remove(self)

    @contextmanager
    def stop_recording(self) -> Iterator[None]:
        """Ops inside the block are not recorded on this tape."""
        tapes = self._client._recording.tapes
        if self not in tapes:
            raise RuntimeError("stop_recording: the tape is not recording")
        tapes.remove(self)
        try:
            yield
        finally:
            tapes.append(self)

    def watch(self, tensor: Any) -> None:
        """Watch resident tensors (``TensorRef``) or tape outputs (``TapedArray``), one or
        a nested structure of them: they become sources one can differentiate with
        respect to. An output whose tapes were released or dropped is held by this
        tape from now on (``_adopt``), as TensorFlow watches any tensor; the tape holds
        what it watches. As in TensorFlow, nothing is watched while no tape records on
        this thread (outside every tape's block, or inside ``stop_recording``). The
        watch takes effect now, before the steps of a batch not yet run: to watch
        among a batch's steps (or an output of one), ``batch.watch(tape, tensor)``."""
        self._require_id()
        self.watch_each(tensor, self._watch_now)

    def _watch_now(self, tensors: list[Any], held: Callable[[], None]) -> None:
        ids = [_tensor_id(t, "watch") for t in tensors]
        part = protocol.MAX_REQUEST_FIELDS - 1  # ids a request may hold beside the tape's
        for start in range(0, max(len(ids), 1), part):
            request = tape_pb2.WatchTensorsRequest(tape_id=self.id, ids=ids[start : start + part])
            self._client._call("WatchTensors", request, tapes=[self])
        held()

    def watch_each(
        self,
        tensor: Any,
        send: Callable[[list[Any], Callable[[], None]], None],
        *,
        step_outputs: bool = False,
    ) -> None:
        """``tensor`` flattened, checked and ``send(tensors, held)``: by ``watch`` now, or
        by a batch's watch step (``step_outputs``: a batch step's outputs may be watched
        there). ``held()``, called once the server watches them, notes that this tape
        holds the ``TapedArray``s among them too."""
        tensors = nest.flatten(tensor)
        bad = next((n for n, t in enumerate(tensors) if not _watchable(t, step_outputs)), None)
        if bad is not None:
            # TensorFlow watches the tensors before the first that is none, then raises.
            if bad:
                self.watch_each(tensors[:bad], send, step_outputs=step_outputs)
            hint = (
                "a batch step's output: watch it among the batch's steps, with "
                "batch.watch(tape, ...)"
                if isinstance(tensors[bad], StepOutput)
                else "watch a TensorRef from client.put or an op's keep=True, or an op "
                "output computed under a tape"
            )
            raise ValueError(
                f"Passed in object {tensors[bad]} of type {type(tensors[bad]).__name__!r}, not "
                f"tf.Tensor or tf.Variable or ExtensionType. (gradserve: {hint})"
            )
        if not self._client._recording.tapes:
            # TensorFlow 2.21 watches nothing while no tape records on the thread
            # (outside every tape's block, or inside ``stop_recording``): the
            # gradient is None (a review helper; it was watched here).
            return
        for t in tensors:
            if isinstance(t, TapedArray) and t.tape_id is not None and not t.held:
                self._adopt(t)

        def held() -> None:  # this tape holds it too now, whatever becomes of its own
            for t in tensors:
                if isinstance(t, TapedArray) and self not in t.live_tapes():
                    t._tapes += tape_refs([self])

        send(tensors, held)

    def watch_request(
        self, tensors: list[Any]
    ) -> tuple[tape_pb2.WatchTensorsRequest, list[Any], list[tuple[Any, tuple[Any, ...]]]]:
        """A batch's watch step: the ``WatchTensorsRequest`` naming ``tensors`` (by id,
        or by step output), the tapes whose outputs it names (held for the batch), and
        those outputs with the recordings that hold them now (``Staging.outputs_named``:
        the batch tells one they all released before it ran)."""
        msg = tape_pb2.WatchTensorsRequest(tape_id=self.id)
        for t in tensors:
            _name(t, msg.tensors.add(), "watch")
        outputs = [
            (t, tuple(tape.life for tape in t.live_tapes()))
            for t in tensors
            if isinstance(t, TapedArray)
        ]
        named = [tape for t, _ in outputs for tape in t.live_tapes()]
        return msg, named, outputs

    def _adopt(self, output: TapedArray) -> None:
        """Give ``output``, an output the server no longer holds (its tapes were
        released or dropped), to this tape: its value goes to the server once more, as
        the output of a ``StopGradient`` recorded on this tape alone, and ``output``
        takes that output's id. Later ops then name it by id, so this tape sees it flow
        on, and it is held while this tape is (TensorFlow watches such a tensor as any
        other; it was a ``TypeError`` here)."""
        recording = self._client._recording
        recording.tapes, others = [self], recording.tapes
        try:
            held = self._client.raw_ops.StopGradient(input=np.asarray(output))
        finally:
            recording.tapes = others
        if getattr(held, "tape_id", None) is None:
            # This tape was released meanwhile (another thread), and the op ran
            # unrecorded: TensorFlow's watch of a released tape is an error too (a
            # review helper: AttributeError on the plain array).
            raise TapeReleasedError(
                "this gradient tape was released while it watched the tensor (by another "
                "thread): nothing was watched"
            )
        output.tape_id, output._tapes = held.tape_id, held._tapes

    # ---------------------------------------------------------------- gradients
    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = "none",
        *,
        keep: bool = False,
    ) -> Any:
        """d target / d sources, as ``tf.GradientTape.gradient``.

        ``target``: a tape output (``TapedArray`` or kept ``TensorRef``), or lists,
        tuples and dicts of them, nested (``tf.nest``'s structures, ``_nest``);
        ``sources``: likewise (the result has the sources' structure);
        ``output_gradients``: one array per target (default: ones, as TensorFlow), None
        for a target that contributes nothing: a flat list, or the target's structure;
        ``unconnected_gradients``: "none" (None for a source the targets do not depend
        on) or "zero". ``keep=True`` keeps the gradients in the session (``TensorRef``).
        """
        self._require_id()
        request = self.gradients_request(
            target, sources, output_gradients, unconnected_gradients, keep=keep
        )
        temps = request.pop("temps")
        failure: BaseException | None = None
        try:
            # Named with the other tapes recording here: on those the call is recorded
            # (its results have no gradient there: tapes are first order).
            tapes = [self, *(t for t in self._client._recording.tapes if t is not self)]
            reply = self._client._call_recovering("Gradients", request["message"], tapes=tapes)
        except BaseException as e:
            failure = e  # no reply: the server may still read its inputs
            raise
        finally:
            self._client._clean_up(temps, failure=failure)
            failure = None  # (a cycle through its frames kept this tape until a GC)
        self.done()
        grads = self._client._parse(reply, lambda r: [self.decode(g) for g in r.gradients])
        return nest.pack_like(sources, grads)

    def gradients_request(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any,
        unconnected_gradients: Any,
        *,
        keep: bool,
    ) -> dict[str, Any]:
        """The ``GradientsRequest`` (and its temporary uploads) for ``gradient`` or a
        ``batch().gradient`` step."""
        targets = nest.flatten(target)
        source_list = nest.flatten(sources)
        mode = getattr(unconnected_gradients, "value", unconnected_gradients)
        if mode not in _UNCONNECTED:
            raise ValueError(f"unconnected_gradients must be 'none' or 'zero', got {mode!r}")
        msg = tape_pb2.GradientsRequest(
            tape_id=self.id, unconnected_gradients=_UNCONNECTED[mode], keep_outputs=keep
        )
        for t in targets:
            _name(t, msg.targets.add(), "target")
        released = [
            isinstance(s, TapedArray) and s.tape_id is not None and not s.held for s in source_list
        ]
        for s, gone in zip(source_list, released):
            if not gone:
                _name(s, msg.sources.add(), "source")  # (raises before any upload)
            else:
                msg.sources.add()
        temps = self._client._staging()
        try:
            for n, (s, gone) in enumerate(zip(source_list, released)):
                if gone:
                    # The output of recordings released or dropped (one before a reset
                    # among them): no tape here saw it, so TensorFlow gives it None
                    # (zeros with "zero"). Its value goes as a temporary tensor the
                    # server names a source of no record: it was a TypeError.
                    ref = self._client.put(np.asarray(s))
                    temps.append(ref.id)
                    msg.sources[n].ref = ref.id
            if output_gradients is not None:
                for seed in _seeds(target, output_gradients):
                    entry = msg.output_gradients.add()  # left unset for None
                    if seed is not None:
                        self._client.encode_input(seed, entry, temps)
        except BaseException as e:  # what was uploaded goes (a review helper: it stayed)
            self._client._clean_up(list(temps), failure=e)
            raise
        named = [
            t for v in (*targets, *source_list) if isinstance(v, TapedArray) for t in v.live_tapes()
        ]
        return {"message": msg, "temps": list(temps), "tapes_named": temps.tapes_named + named}

    def decode(self, out: tensor_pb2.TensorOutput) -> Any:
        if out.WhichOneof("result") is None:
            return None
        return self._client.decode_output(out)

    def release(self) -> int:
        """Free everything the tape holds on the server; returns the bytes freed."""
        self._stop()
        life = self._life
        if life.released or self.id is None or self._client._closed:
            # (closed: the client's close released it, with its session or on its own;
            # a ``finally: tape.release()`` after ``close()`` raised CancelledError for
            # a tape that recorded nothing: helper-78)
            life.released = True
            return 0
        return self.release_on_server()

    def release_on_server(self) -> int:
        """``release``'s call (also the closing client's, for the tapes it leaves in a
        session it did not create)."""
        life = self._life
        # Sent even if no call named this recording yet ("+ID": the server marks it
        # released without starting it): a call of another thread may be naming it
        # now, and the server then refuses that call, as after any release.
        life.released, life.ending = True, False  # (a batch's gradient step: refused)
        reply = self._client._call(
            "ReleaseTape", tape_pb2.ReleaseTapeRequest(tape_id=self.id), tapes=[self]
        )
        return int(reply.released_bytes)

    def _require_id(self) -> None:
        if self.id is None:
            raise RuntimeError("use the tape in a 'with client.gradient_tape() as tape:' block")
        if self.released:
            raise TapeReleasedError(
                "this gradient tape was released: a non-persistent GradientTape can only be "
                "used to compute one set of gradients (use persistent=True for several, or "
                "enter it again to record afresh)"
            )

    def __repr__(self) -> str:
        state = "released" if self.released else "persistent" if self.persistent else "live"
        return f"GradientTape(id={(self.id or '')[:8]}…, {state})"


def _seeds(target: Any, output_gradients: Any) -> list[Any]:
    """The output gradients, one per flattened target: in the target's nested
    structure, or a flat list, or one value for a lone target. Matched against the
    target's structure rather than flattened through, so that a seed may be a Python
    list (``tf.nest`` takes that apart too: given ``[[1.0, 2.0]]`` for one target of
    shape [2], TensorFlow 2.21 seeds it with 1.0 alone and returns a scalar)."""
    if nest.is_nested(target):
        matched = nest.flatten_up_to(target, output_gradients)
        if matched is not None:
            return matched
    return list(output_gradients) if _is_list(output_gradients) else [output_gradients]


def _is_list(value: Any) -> bool:
    """A list or tuple of tensors (a ``StepOutput`` placeholder is one tensor)."""
    return isinstance(value, (list, tuple)) and not isinstance(value, StepOutput)


def _watchable(value: Any, step_outputs: bool = False) -> bool:
    """What ``tape.watch`` takes: a tensor the server holds or held (and in a batch's
    watch step, an earlier step's output). A value the client has (a NumPy array, a
    Python number) is TensorFlow's NumPy array or constant, not a tensor:
    TensorFlow's ValueError."""
    return (
        isinstance(value, TensorRef)
        or (isinstance(value, TapedArray) and bool(value.tape_id))
        or (step_outputs and isinstance(value, StepOutput))
    )


def _tensor_id(value: Any, what: str) -> str:
    if isinstance(value, TapedArray) and value.tape_id is not None:
        if value.held:
            return value.tape_id
        raise TypeError(
            f"{what}: the tapes that computed it were released or dropped, and the server "
            "holds it no more; watch it on a live tape first (tape.watch), or put it in "
            "the session with client.put"
        )
    if isinstance(value, TensorRef):
        return value.id
    raise TypeError(
        f"{what}: expected a tensor held by the server (a TensorRef from client.put or an "
        f"op's keep=True, or an op output computed under a tape), got {type(value).__name__}; "
        "put a value in the session with client.put first"
    )


def _name(value: Any, msg: tensor_pb2.TensorInput, what: str) -> None:
    """Fill a target's or source's ``TensorInput``: by id, or by Batch step output."""
    if isinstance(value, StepOutput):
        msg.step_output.step, msg.step_output.field = value.step, value.field
    else:
        msg.ref = _tensor_id(value, what)
