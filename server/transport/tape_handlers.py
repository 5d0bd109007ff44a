"""The gradient-tape RPCs: ``Gradients`` and ``WatchTensors`` (ops: also Batch
steps) and the tape's life cycle (start, release), translated to ``core.gradients``
and the session's tape methods."""

from __future__ import annotations

from gradserve.errors import InvalidArgumentError
from gradserve.server.core import gradients
from gradserve.server.core.ops import recording
from gradserve.server.core.sessions import Resident, Session
from gradserve.server.transport.wire import CallIO
from gradserve.v1 import tape_pb2, tensor_pb2


def _tensor_id(io: CallIO, msg: tensor_pb2.TensorInput, field: str) -> str:
    """A target's, source's or watched tensor's id: a tensor named by ref (or by an
    earlier step: held by a tape, or kept)."""
    arg = io.named(msg, field)
    if not isinstance(arg, Resident):
        raise InvalidArgumentError(
            f"'{field}' must name a tensor of the session or tape (a ref, or in a Batch a "
            "step's output), not carry a value: a value sent inline has no gradient",
            field=field,
        )
    return arg.id


def Gradients(io: CallIO, req: tape_pb2.GradientsRequest) -> tape_pb2.GradientsResponse:
    """tape.gradient(targets, sources, output_gradients). On the other tapes the call
    names it is recorded as an op with no gradient, so differentiating its results
    there is a clear UNIMPLEMENTED (gradients of gradients are out of scope)."""
    tape = io.session.tape(req.tape_id)
    targets = [_tensor_id(io, t, f"targets[{n}]") for n, t in enumerate(req.targets)]
    sources = [_tensor_id(io, s, f"sources[{n}]") for n, s in enumerate(req.sources)]
    seeds = [
        None if g.WhichOneof("source") is None else io.tensor(g, f"output_gradients[{n}]")
        for n, g in enumerate(req.output_gradients)
    ]
    outer = [t for t in io.tapes if t is not tape]
    args = [Resident(k) for k in targets + sources]
    if io.recorder is not None:
        io.recorder.tapes = outer  # (the op is recorded on the other tapes only)
    if io.recorder is not None and outer:
        # Before a non-persistent tape is released: the op's record is paid, and the
        # other tapes hold its inputs (one only that tape held is gone after).
        io.prepay_record()
        keys = tuple(io.recorder.arg(a)[0] for a in args)
    grads, source = gradients.gradients(
        io.session,
        io.compute,
        tape,
        targets,
        sources,
        seeds,
        unconnected_zero=req.unconnected_gradients == tape_pb2.UNCONNECTED_ZERO,
        check=io.check_alive,
        hand_out=io.hand_out_for(req.keep_outputs, irreversible=not tape.persistent),
        spent=io.tape_spent,
    )
    tape_ids: list[str | None] = [None] * len(grads)
    if io.recorder is not None and outer:
        present = [n for n, g in enumerate(grads) if g is not None]
        ids = recording.no_gradient(io.recorder, "Gradients", keys, [grads[n] for n in present])
        for n, tape_id in zip(present, ids):
            tape_ids[n] = tape_id
    resp = tape_pb2.GradientsResponse(source=source)
    for n, g in enumerate(grads):
        out = resp.gradients.add()
        if g is not None:
            io.emit(g, out, f"gradients[{n}]", req.keep_outputs, tape_ids[n])
    return resp


def start_tape(session: Session, req: tape_pb2.StartTapeRequest) -> tape_pb2.StartTapeResponse:
    tape = session.start_tape(
        persistent=req.persistent, watch_accessed_variables=req.watch_accessed_variables
    )
    return tape_pb2.StartTapeResponse(tape_id=tape.id)


def WatchTensors(io: CallIO, req: tape_pb2.WatchTensorsRequest) -> tape_pb2.WatchTensorsResponse:
    """tape.watch: the tensors named (``ids``, and ``tensors`` by ref or by an earlier
    Batch step's output) become sources of the tape from here on. An op, so that a
    Batch orders it among its steps: ops that ran before it read them unwatched."""
    tape = io.session.tape(req.tape_id)
    named = [_tensor_id(io, t, f"tensors[{n}]") for n, t in enumerate(req.tensors)]
    io.session.watch(tape, [*req.ids, *named])
    return tape_pb2.WatchTensorsResponse()


def release_tape(
    session: Session, req: tape_pb2.ReleaseTapeRequest, *, proposed: bool = False
) -> tape_pb2.ReleaseTapeResponse:
    """``proposed``: the call's tape header proposes the id ("+ID.PW")."""
    released = session.release_tape(req.tape_id, proposed=proposed)
    return tape_pb2.ReleaseTapeResponse(released_bytes=released)
