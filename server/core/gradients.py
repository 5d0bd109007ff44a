"""Reverse-mode differentiation of what a tape recorded (``tape.gradient``).

The sweep is TensorFlow's ``tf.gradients``: keep the recorded ops that lie
between the sources and the targets, visit them in reverse order, call each
op's registered gradient with the gradients of its outputs, and sum the
gradients of a tensor used more than once. The registered gradients are
TensorFlow's (``python/ops/tensor_array_grad.py``, ``array_grad.py``,
``rnn_grad.py``), run on the same core ops a client would drive by hand:

* TensorArray ops route gradients through ``TensorArrayGradV3`` arrays keyed by
  (forward handle, source), named by a source unique to the computation
  (``Session.new_gradient_source``): read <-> write, gather <-> scatter,
  concat <-> split (with the recorded lengths). The grad array's rules (size
  freeze, aggregation, clear after read, zeros for unwritten elements) are the
  core's, so they are TensorFlow's. The arrays are the computation's own
  (``Sweep.grads``): a client's TensorArrayGradV3 never gets one, even under the
  same source, where TensorFlow's graph would share it (a client's array made
  under that name while a computation ran was shared, then dropped with it).
* ``StopGradient`` records no differentiable input: it blocks.
* ``BlockLSTM`` -> ``BlockLSTMGrad``, ``BlockLSTMV2`` -> ``BlockLSTMGradV2``.

Where TensorFlow's registration is wrong this is right, and says so: the LSTM
gradient masks cells the forward clipped (TensorFlow's kernels ignore
``cell_clip``); TensorFlow registers the V1 kernel for BlockLSTMV2; a gradient
reaching an LSTM's ``i, f, o, ci, co`` outputs is UNIMPLEMENTED here (unless it
is zeros), where TensorFlow silently drops it; a split or scatter into a size-0
TensorArray has an empty gradient here, where TensorFlow raises.

A failed computation changes nothing: the grad arrays it made are dropped and
the forward arrays it froze get their dynamic size back (unless a client's grad
array, or another computation that succeeded, froze them meanwhile:
``Session.gradient_ended``). A successful one drops its grad arrays too (nothing
can name them).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gradserve import dtypes
from gradserve.errors import InvalidArgumentError, UnimplementedError
from gradserve.kernels.compute import Compute
from gradserve.lstm_signature import LSTMActivations, LSTMInputs, LSTMOutputGrads
from gradserve.server.core.grad_registry import GradRegistry
from gradserve.server.core.ops import lstm_ops
from gradserve.server.core.ops import tensor_array_ops as ta_ops
from gradserve.server.core.sessions import Resident, Session, TensorArg
from gradserve.server.core.tape import Record, Tape
from gradserve.server.core.tensor_array import HandOut

#: The gradient that reached a TensorArray flow key: only its presence matters
#: (TensorFlow's flow gradients are dummy floats that order the grad ops).
FLOW = object()

#: What one can differentiate: floating point (bfloat16 included, which NumPy files
#: under kind "V") and complex, TensorFlow's trainable types.
DIFFERENTIABLE = frozenset(
    dtypes.normalize(name)
    for name in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")
)


@dataclasses.dataclass
class Sweep:
    """One gradient computation in progress."""

    session: Session
    compute: Compute
    source: str
    check: Callable[[], None] | None
    #: Forward TensorArrays whose grad array this made (their dynamic sizing before
    #: it is the session's to know: ``Session.gradient_froze``).
    frozen: set[str] = dataclasses.field(default_factory=set)
    #: The grad arrays this made: its own, out of reach of any TensorArrayGradV3.
    grads: GradRegistry = dataclasses.field(default_factory=GradRegistry)

    def grad_array(self, handle: str) -> str:
        """``ta.grad(source)``: the grad array's handle (made on first use)."""
        if handle not in self.frozen:
            dynamic_size = self.session.tensor_array(handle).dynamic_size
            self.session.gradient_froze(id(self), handle, dynamic_size)
            self.frozen.add(handle)
        grad_handle, _ = ta_ops.grad(self.session, handle, self.source, registry=self.grads)
        return grad_handle

    def host(self, value: Any) -> np.ndarray:
        return self.compute.to_host(value)  # type: ignore[no-any-return]

    def value(self, tensor_id: str) -> Any:
        return self.session.resolve(Resident(tensor_id))


GradFn = Callable[[Sweep, Record, list[Any]], list[Any]]


def _index(record: Record, name: str) -> np.ndarray:
    return record.saved[name]  # type: ignore[no-any-return]


def _read_grad(sweep: Sweep, record: Record, grads: list[Any]) -> list[Any]:
    """TensorArrayReadV3: write the gradient into the grad array at ``index``."""
    g = sweep.grad_array(record.saved["handle"])
    ta_ops.write(sweep.session, g, _index(record, "index"), sweep.host(grads[0]))
    return [FLOW]


def _write_grad(sweep: Sweep, record: Record, grads: list[Any]) -> list[Any]:
    """TensorArrayWriteV3: the value's gradient is the grad array's element."""
    g = sweep.grad_array(record.saved["handle"])
    value = ta_ops.read(sweep.session, g, _index(record, "index"), record.saved["dtype"])
    return [value, FLOW]


def _gather_grad(sweep: Sweep, record: Record, grads: list[Any]) -> list[Any]:
    """TensorArrayGatherV3: scatter the gradient into the grad array."""
    g = sweep.grad_array(record.saved["handle"])
    ta_ops.scatter(sweep.session, g, _index(record, "indices"), sweep.host(grads[0]))
    return [FLOW]


def _scatter_grad(sweep: Sweep, record: Record, grads: list[Any]) -> list[Any]:
    """TensorArrayScatterV3: gather the value's gradient from the grad array."""
    indices = _index(record, "indices")
    if record.saved["value_shape"][0] == 0:
        # TensorFlow raises here although the forward ran; the gradient is empty.
        return [np.zeros(record.saved["value_shape"], record.saved["dtype"]), FLOW]
    g = sweep.grad_array(record.saved["handle"])
    value = ta_ops.gather(
        sweep.session,
        g,
        indices,
        record.saved["dtype"],
        record.saved["value_shape"][1:],
        sweep.check,
    )
    return [value, FLOW]


def _concat_grad(sweep: Sweep, record: Record, grads: list[Any]) -> list[Any]:
    """TensorArrayConcatV3: split the gradient into the grad array by ``lengths``."""
    g = sweep.grad_array(record.saved["handle"])
    ta_ops.split(sweep.session, g, sweep.host(grads[0]), _index(record, "lengths"))
    return [FLOW]


def _split_grad(sweep: Sweep, record: Record, grads: list[Any]) -> list[Any]:
    """TensorArraySplitV3: the value's gradient is the grad array concatenated."""
    if record.saved["value_shape"][0] == 0:  # as for scatter: TensorFlow raises
        return [np.zeros(record.saved["value_shape"], record.saved["dtype"]), FLOW]
    g = sweep.grad_array(record.saved["handle"])
    value, _ = ta_ops.concat(
        sweep.session, g, record.saved["dtype"], record.saved["value_shape"][1:], sweep.check
    )
    return [value, FLOW]


def _lstm_grad(sweep: Sweep, record: Record, grads: list[Any]) -> list[Any]:
    """BlockLSTM(V2): the matching grad op with the forward's ``cell_clip`` (clipped
    cells pass no gradient). Only ``cs`` and ``h`` take gradients, as in TensorFlow.
    A gate output's gradient of zeros adds nothing, and passes: a TensorArray holding
    a gate beside ``h`` gives it one when only ``h``'s element is read (TensorFlow's
    zeros for an element never read), and TensorFlow's answer is then exact."""
    outputs = LSTMActivations(*grads)
    for name in ("i", "f", "o", "ci", "co"):
        gate_grad = getattr(outputs, name)
        if gate_grad is not None and np.any(sweep.host(gate_grad)):
            raise UnimplementedError(
                f"the gradient of {record.op}'s output '{name}' is not implemented: only "
                "'cs' and 'h' carry gradients into the LSTM (TensorFlow's registered "
                "gradient silently drops the others'; gradserve refuses one that is not zeros)",
                reason="GRADIENT_NOT_IMPLEMENTED",
            )
    held = record.saved["held"]
    activations = LSTMActivations(*(Resident(k) for k in record.saved["activations"]))
    output_grads = LSTMOutputGrads(
        *(
            g if g is not None else np.zeros_like(sweep.host(sweep.value(k)))
            for g, k in ((outputs.cs, activations.cs.id), (outputs.h, activations.h.id))
        )
    )
    result = lstm_ops.backward(
        sweep.session,
        sweep.compute,
        record.saved["variant"],
        LSTMInputs(*(Resident(k) for k in held)),
        activations,  # type: ignore[arg-type]
        output_grads,
        record.saved["seq_len_max"],
        use_peephole=record.saved["use_peephole"],
        cell_clip=record.saved["cell_clip"],
        check=sweep.check,
    )
    return list(result)


def _second_order(sweep: Sweep, record: Record, grads: list[Any]) -> list[Any]:
    raise UnimplementedError(
        f"the gradient of {record.op} (a gradient of a gradient) is not implemented: "
        "gradserve's tapes are first order only",
        reason="SECOND_ORDER_GRADIENT",
    )


#: Registered gradients by op. Ops recorded with no differentiable input
#: (StopGradient, TensorArrayV3, the size of an array) need none.
GRADIENTS: dict[str, GradFn] = {
    "TensorArrayReadV3": _read_grad,
    "TensorArrayWriteV3": _write_grad,
    "TensorArrayGatherV3": _gather_grad,
    "TensorArrayScatterV3": _scatter_grad,
    "TensorArrayConcatV3": _concat_grad,
    "TensorArraySplitV3": _split_grad,
    "BlockLSTM": _lstm_grad,
    "BlockLSTMV2": _lstm_grad,
    "BlockLSTMGrad": _second_order,
    "BlockLSTMGradV2": _second_order,
    "Gradients": _second_order,
}


def recorded(records: Sequence[Record], watched_at: dict[str, int]) -> list[Record]:
    """The records TensorFlow's tape would hold (``ShouldRecord``): an op's, if one of
    its inputs was on the tape when it ran, watched by then (``watched_at``: a watch
    is not retroactive) or an output of an op recorded before it. Once recorded, an
    op passes gradients to all its inputs, a key watched later included. Every op
    was counted before: ``tape.watch(x)`` after a TensorArray write of ``x`` gave
    ``x`` the gradient through it, where TensorFlow gives None (found by a review
    helper). StopGradient, which passes no gradient, is recorded by its input
    (``saved["input"]``), as TensorFlow records it; TensorArrayV3 has none (its size,
    a constant in TensorFlow)."""
    watches = sorted(watched_at.items(), key=lambda item: item[1])
    on_tape: set[str] = set()
    kept, n = [], 0
    for index, record in enumerate(records):
        while n < len(watches) and watches[n][1] <= index:
            on_tape.add(watches[n][0])
            n += 1
        reads = record.inputs
        if record.op == "StopGradient":
            reads = (record.saved.get("input"),)
        if any(k in on_tape for k in reads if k is not None):
            kept.append(record)
            on_tape.update(k for k in record.outputs if k is not None)
    return kept


def _between(records: Sequence[Record], sources: set[str], targets: set[str]) -> list[Record]:
    """The records on a path from a source to a target, in recorded order (as
    TensorFlow's ``_PendingCount`` keeps the ops between ``xs`` and ``ys``)."""
    reached = set(sources)
    forward = []
    for record in records:
        if any(k in reached for k in record.inputs if k is not None):
            forward.append(record)
            reached.update(k for k in record.outputs if k is not None)
    needed = set(targets)
    between = []
    for record in reversed(forward):
        if any(k in needed for k in record.outputs if k is not None):
            between.append(record)
            needed.update(k for k in record.inputs if k is not None)
    between.reverse()
    return between


def _add(a: Any, b: Any, compute: Compute) -> Any:
    if a is FLOW or b is FLOW:
        return FLOW
    if type(a) is not type(b):
        a, b = compute.to_host(a), compute.to_host(b)
    return a + b


def _describe(tensor_id: str) -> str:
    return f"{tensor_id[:12]}…" if len(tensor_id) > 12 else tensor_id


def check_differentiable(array: Any, what: str, tensor_id: str) -> None:
    dtype = np.dtype(array.dtype)
    if dtype not in DIFFERENTIABLE:
        raise InvalidArgumentError(
            f"{what} {_describe(tensor_id)!r} has dtype {dtypes.tf_name(dtype)}: gradients "
            "are defined for floating-point and complex tensors only",
            field=what,
        )


def gradients(
    session: Session,
    compute: Compute,
    tape: Tape,
    targets: Sequence[str],
    sources: Sequence[str],
    output_gradients: Sequence[TensorArg | None] | None,
    *,
    unconnected_zero: bool,
    check: Callable[[], None] | None = None,
    hand_out: HandOut | None = None,
    spent: Callable[[Tape], None] | None = None,
) -> tuple[list[Any], str]:
    """d(sum of targets, weighted by ``output_gradients``)/d(each source) over what
    ``tape`` recorded; returns (one array or None per source, the grad source used).
    ``hand_out`` gets the gradients before a non-persistent tape is released (the
    tapes around this one pay for holding them: without room, the call is refused
    while the tape can still be asked again).

    Targets must be tensors the tape produced or watches; sources any tensor of the
    session or tape (one the targets do not depend on gets None, or zeros with
    ``unconnected_zero``). No targets: no source depends on them (TensorFlow: None
    for each). A None output gradient: its target contributes nothing (TensorFlow
    passes the None to the gradient functions, which it crashes or aborts in unless
    they pass it on). INVALID_ARGUMENT for a target not recorded, a dtype that
    is not floating point, or output gradients that do not match their targets; a
    released tape is FAILED_PRECONDITION. Nothing changes in the session unless it
    succeeds; a non-persistent tape is released once it has. ``spent``: the caller
    frees that tape's holdings once the results reached their client, or makes it live
    again if they did not (``Session.spend_tape``); it is told of the tape here.
    """
    records, unknown, differentiable, watched_at = session.tape_snapshot(tape, targets, sources)
    if unknown:
        raise InvalidArgumentError(
            f"target {_describe(unknown[0])!r} was not computed under this tape (nor is "
            "it watched by it): only outputs of ops recorded on the tape can be "
            "differentiated",
            field="targets",
        )
    target_values = []
    for tensor_id in targets:
        value = session.resolve(Resident(tensor_id))
        check_differentiable(value, "target", tensor_id)
        target_values.append(value)
    source_values = []
    for tensor_id in sources:
        value = session.resolve(Resident(tensor_id))
        check_differentiable(value, "source", tensor_id)
        source_values.append(value)
    # Ones of each target's shape (no output gradients given) are memory the sweep
    # holds: charged before they are made (helper-77: 2,000 targets of 2 MiB each,
    # named in one small request, made 4 GB of ones past a 32 MiB budget), each until
    # its record's gradient takes it, the rest until the results are handed out (what
    # keeps them from then pays for them).
    seed_bytes = _ones_bytes(targets, target_values) if targets and not output_gradients else {}
    seeds_held = sum(seed_bytes.values())
    session.budget.reserve(seeds_held)
    try:
        # No targets: nothing to seed, whatever output gradients came (TensorFlow ignores
        # them too, and gives None per source).
        grads: dict[str, Any] = (
            _seeds(session, targets, target_values, output_gradients, compute) if targets else {}
        )

        between = _between(recorded(records, watched_at), differentiable, set(targets))
        source = session.new_gradient_source()
        sweep = Sweep(session, compute, source, check)
        source_set = set(sources)
        try:
            for record in reversed(between):
                if check is not None:
                    check()
                # The ones of a record's outputs are let go as its gradient function
                # takes them: before it runs where it keeps them as they are (a read's
                # writes them into its gradient array, which pays for them: held until
                # the sweep ended, they were charged twice, helper-78), after it where
                # it copies them (held only until it began, they were charged to no
                # one while it ran and the sweep kept them: helper-79); a gradient no
                # later record needs goes then too.
                kept = _keeps_its_gradient(record)
                if kept:
                    seeds_held -= _let_go(session, seed_bytes, record.outputs)
                _backpropagate(record, grads, sweep, compute)
                for key in record.outputs:
                    if key is not None and key not in source_set:
                        grads.pop(key, None)
                if not kept:
                    seeds_held -= _let_go(session, seed_bytes, record.outputs)
            results: list[Any] = []
            for tensor_id, value in zip(sources, source_values):
                g = grads.get(tensor_id) if tensor_id in differentiable else None
                if g is None and unconnected_zero:
                    g = np.zeros(value.shape, value.dtype)
                results.append(g)
            # Host results as arrays (a sum of 0-d arrays is a NumPy scalar, which
            # ``emit`` would make a new array of: a different object than was paid for).
            results = [g if g is None or hasattr(g, "__cuda_array_interface__") else np.asarray(g)
                       for g in results]  # fmt: skip
            session.budget.release(seeds_held)  # (those that are results: hand_out pays)
            seeds_held = 0
            if hand_out is not None:
                hand_out([g for g in results if g is not None], 0)
        except BaseException:
            session.gradient_ended(id(sweep), sweep.frozen, succeeded=False)
            raise
        finally:
            session.drop_grad_arrays(source, sweep.grads)
    finally:
        session.budget.release(seeds_held)
    session.gradient_ended(id(sweep), sweep.frozen, succeeded=True)
    if spent is None or tape.persistent:
        session.gradient_done(tape)
    elif session.spend_tape(tape):
        spent(tape)
    return results, source


def _backpropagate(record: Record, grads: dict[str, Any], sweep: Sweep, compute: Compute) -> None:
    """One record's gradient function, given its outputs' gradients in ``grads``; adds
    what it gives its inputs there."""
    out_grads = [grads.get(k) if k is not None else None for k in record.outputs]
    if all(g is None for g in out_grads):
        return
    fn = GRADIENTS.get(record.op)
    if fn is None:
        return  # no differentiable inputs (its inputs are never reached)
    for key, g in zip(record.inputs, fn(sweep, record, out_grads)):
        if key is None or g is None:
            continue
        grads[key] = _add(grads[key], g, compute) if key in grads else g


def _keeps_its_gradient(record: Record) -> bool:
    """Whether the record's gradient function keeps its output's gradient itself, not
    a copy: a read's writes it into the gradient array; a gather's scatter and a
    concat's split do when it is one piece (``tensor_array._own_piece``). (Written
    into a slot already written, it is summed into a new array instead: for that
    while, charged to no one.)"""
    if record.op == "TensorArrayReadV3":
        return True
    if record.op == "TensorArrayGatherV3":
        return len(_index(record, "indices")) == 1
    if record.op == "TensorArrayConcatV3":  # (an empty piece takes none of it)
        return int(np.count_nonzero(_index(record, "lengths"))) <= 1
    return False


def _let_go(session: Session, seed_bytes: dict[str, int], keys: Sequence[str | None]) -> int:
    """Release the charge for the ones of ``keys``; returns the bytes released."""
    released = sum(seed_bytes.pop(k, 0) for k in keys if k is not None)
    session.budget.release(released)
    return released


def _ones_bytes(targets: Sequence[str], values: Sequence[Any]) -> dict[str, int]:
    """The bytes of the ones ``_seeds`` makes, per distinct target."""
    return {t: int(v.nbytes) for t, v in dict(zip(targets, values)).items()}


def _seeds(
    session: Session,
    targets: Sequence[str],
    values: Sequence[Any],
    output_gradients: Sequence[TensorArg | None] | None,
    compute: Compute,
) -> dict[str, Any]:
    """Each target's output gradient, summed where a target comes more than once:
    ones of its shape and dtype (as TensorFlow) when none are given, else the given
    ones, one per target of its shape and dtype (None: none from that target).

    Without output gradients a target named m times gets m (the derivative of the
    sum), one array: a list of m arrays of ones, all alive at once, let a 5 KB call
    naming one 1 MiB target 200 times hold 151 MB that no budget counted."""
    if not output_gradients:
        counts = collections.Counter(targets)
        value_of = dict(zip(targets, values))  # (a target's value, once)
        return {t: np.full(v.shape, counts[t], v.dtype) for t, v in value_of.items()}
    if len(output_gradients) != len(targets):
        raise InvalidArgumentError(
            f"{len(output_gradients)} output gradients for {len(targets)} targets: "
            "give one per target, or none",
            field="output_gradients",
        )
    seeds: dict[str, Any] = {}
    for n, (arg, target, value) in enumerate(zip(output_gradients, targets, values)):
        if arg is None:
            continue  # this target contributes nothing
        seed = session.resolve(arg)
        if np.dtype(seed.dtype) != np.dtype(value.dtype) or tuple(seed.shape) != tuple(value.shape):
            raise InvalidArgumentError(
                f"output_gradients[{n}] is {dtypes.tf_name(seed.dtype)} {list(seed.shape)} but "
                f"its target {_describe(target)!r} is {dtypes.tf_name(value.dtype)} "
                f"{list(value.shape)}: they must match",
                field="output_gradients",
            )
        seeds[target] = _add(seeds[target], seed, compute) if target in seeds else seed
    return seeds
