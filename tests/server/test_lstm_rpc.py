"""The LSTM ops served: goldens over RPC, resident activations, validation, deadlines."""

from __future__ import annotations

import json
import pathlib
import time

import grpc
import numpy as np
import pytest

import gradserve
from gradserve import errors
from gradserve.errors import DeadlineExceededError, InvalidArgumentError, ResourceExhaustedError
from gradserve.kernels import backend_numpy, lstm
from gradserve.kernels.compute import Compute
from gradserve.lstm_signature import LSTMInputs
from gradserve.server import run_server
from gradserve.server.core.ops import lstm_ops
from gradserve.server.core.sessions import Session
from tests.conftest import DeadlineOnCall
from tests.golden.trace_format import normalise, resolve
from tests.kernels import lstm_cases
from tests.kernels.lstm_cases import (
    GRAD_OP,
    GRADS,
    INDEX,
    INPUTS,
    OUTPUT_GRADS,
    OUTPUTS,
    TOLERANCE,
    UNINITIALISED_PAST_END,
    golden,
    random_case,
    scaled_error,
)


@pytest.mark.golden
@pytest.mark.parametrize("name", [c["name"] for c in INDEX])
def test_golden_over_rpc_with_resident_activations(client, name):
    d = golden(name)
    tol, length = TOLERANCE[str(d["x"].dtype)], int(d["seq_len_max"])
    args = [d["seq_len_max"], *(d[k] for k in INPUTS)]
    # Attributes at the op's default are left out, so the SDK's defaults meet TF's too.
    defaults = (
        {"cell_clip": 3.0, "forget_bias": 1.0} if d["op"] == "BlockLSTM" else {"cell_clip": 0.0}
    )
    attrs = {k: float(d[k]) for k in defaults if float(d[k]) != defaults[k]}
    kept = getattr(client.raw_ops, d["op"])(
        *args, **attrs, use_peephole=bool(d["use_peephole"]), keep=True
    )
    assert all(isinstance(v, gradserve.TensorRef) for v in kept)
    for k in OUTPUTS:
        got = getattr(kept, k).numpy()
        end = length if k in UNINITIALISED_PAST_END else None
        assert scaled_error(got[:end], d[k][:end]) < tol, k
    grads = getattr(client.raw_ops, GRAD_OP[d["op"]])(
        *args, *kept, d["cs_grad"], d["h_grad"], use_peephole=bool(d["use_peephole"])
    )
    for k in GRADS:
        assert getattr(grads, k).dtype == d[k].dtype
        assert scaled_error(getattr(grads, k), d[k]) < tol, k


class ByteCounter(grpc.UnaryUnaryClientInterceptor):
    """Counts serialized request and response bytes of every unary call."""

    def __init__(self):
        self.sent = self.received = 0

    def intercept_unary_unary(self, continuation, details, request):
        self.sent += request.ByteSize()
        response = continuation(details, request)
        self.received += response.result().ByteSize()
        return response


def test_round_trip_moves_no_activations(target):
    steps, batch, units = 50, 8, 32
    case = random_case(
        np.random.default_rng(1),
        steps=steps,
        batch=batch,
        inputs=units,
        units=units,
        dtype=np.float32,
    )
    counter = ByteCounter()
    channel = grpc.intercept_channel(grpc.insecure_channel(target), counter)
    # Counts the bytes on the wire: shared memory would move them elsewhere.
    with gradserve.Client(target, channel=channel, shared_memory=False) as client:
        args = [case["seq_len_max"], *(case[k] for k in INPUTS)]
        kept = client.raw_ops.BlockLSTMV2(*args, use_peephole=True, keep=True)
        grads = client.raw_ops.BlockLSTMGradV2(
            *args, *kept, case["cs_grad"], case["h_grad"], use_peephole=True
        )
    nbytes = lambda names: sum(case[k].nbytes for k in names)  # noqa: E731
    payload = (
        2 * nbytes(INPUTS)  # x, states and weights, in both calls
        + nbytes(OUTPUT_GRADS)  # output gradients
        + sum(g.nbytes for g in grads)
    )  # results
    activations = 7 * steps * batch * units * 4
    moved = counter.sent + counter.received
    overhead = moved - payload
    assert 0 <= overhead < 8192, (moved, payload)  # ids, shapes, headers only
    assert activations > 10 * overhead


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seq_len_max": np.int64(6)}, "seq_len_max must be between 0 and 5 but is 6"),
        ({"seq_len_max": np.int64(-1)}, "seq_len_max must be between 0 and 5 but is -1"),
        ({"seq_len_max": np.array([5])}, "`seq_len_max_tensor` must be rank 0 but is rank 1"),
        ({"x": np.zeros((5, 2), np.float32)}, "x must be 3D"),
        ({"cs_prev": np.zeros((3, 4), np.float32)}, "cs_prev.dims\\(0\\) != batch_size: 3 vs. 2"),
        ({"h_prev": np.zeros((2, 5), np.float32)}, "h_prev.dims\\(1\\) != cell_size: 5 vs. 4"),
        ({"w": np.zeros((6, 16), np.float32)}, "w.dim_size\\(0\\) != input_size \\+ cell_size"),
        ({"w": np.zeros((7, 12), np.float32)}, "w.dim_size\\(1\\) != cell_size \\* 4: 12 vs. 16"),
        ({"wcf": np.zeros(3, np.float32)}, "wcf.dim_size\\(0\\) != cell_size: 3 vs. 4"),
        ({"b": np.zeros(15, np.float32)}, "b.dim_size\\(0\\) != cell_size \\* 4"),
        (  # tensors (an array converts to T, the first tensor's, as in eager TensorFlow)
            {"x": ("by id", None), "b": ("by id", np.zeros(16, np.float64))},
            "Input 'b' of 'BlockLSTMV2' Op has type float64 that does not match type float32",
        ),
        (
            {"x": np.zeros((5, 2, 3), np.int32)},
            "Value for attr 'T' of int32 is not in the list of allowed values: half, float",
        ),
    ],
)
def test_bad_inputs_are_invalid_argument_and_server_survives(client, change, message):
    case = random_case(
        np.random.default_rng(2), steps=5, batch=2, inputs=3, units=4, dtype=np.float32
    )
    for k, v in change.items():
        if isinstance(v, tuple):  # ("by id", the value, or None for the case's own)
            case[k] = client.put(case[k] if v[1] is None else v[1])
        else:
            case[k] = v
    with pytest.raises(InvalidArgumentError, match=message):
        client.raw_ops.BlockLSTMV2(case["seq_len_max"], *(case[k] for k in INPUTS))
    assert client.stop_gradient(np.ones(2)).sum() == 2  # still serving


BAD_INPUTS = json.loads(
    (pathlib.Path(__file__).parents[1] / "golden" / "lstm_bad_inputs.json").read_text()
)["traces"]


# TensorFlow's attribute defaults (golden/raw_ops_signatures.json) and gate layouts: the
# ok-cases leave every attribute but use_peephole at its default.
_DEFAULT_ATTRS = {
    "BlockLSTMV2": {"forget_bias": 0.0, "cell_clip": 0.0},
    "BlockLSTM": {"forget_bias": 1.0, "cell_clip": 3.0},
}
_LAYOUT = {**lstm_cases.LAYOUT, **{GRAD_OP[op]: lstm_cases.LAYOUT[op] for op in GRAD_OP}}


def numpy_kernel(op: str, kwargs: dict):
    """What ``gradserve.kernels``' NumPy LSTM computes for a recorded call of ``op``."""
    attrs = {
        "seq_len_max": int(kwargs["seq_len_max"]),
        "use_peephole": kwargs["use_peephole"],
        "layout": _LAYOUT[op],
    }
    if op in _DEFAULT_ATTRS:
        tensors = [kwargs[k] for k in INPUTS]
        return lstm_cases.forward(backend_numpy, *tensors, **attrs, **_DEFAULT_ATTRS[op])
    tensors = [kwargs[k] for k in INPUTS + OUTPUTS + OUTPUT_GRADS]
    return lstm_cases.backward(backend_numpy, *tensors, **attrs)


@pytest.mark.golden
@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_malformed_inputs_as_tensorflow_reports_them(client, name):
    """Every rank and dimension of every input of the four LSTM ops one off, and
    seq_len_max out of range, recorded from TensorFlow 2.21 (golden/record_lstm_errors.py).
    Where TensorFlow rejects a call, ours gives its error class and words; where it does
    not (it reads out of bounds, and runs on or dies), ours is INVALID_ARGUMENT. Where
    TensorFlow accepted it, the recording holds no values (``{"ok": true}``): the served
    outputs must be the NumPy kernel's on the same inputs."""
    (step,) = BAD_INPUTS[name]
    op = getattr(client.raw_ops, step["op"])
    kwargs = resolve(step["args"], {})
    expect = step["expect"]
    if "ok" in expect:
        got = op(**kwargs)
        want = numpy_kernel(step["op"], kwargs)
        assert list(got._fields) == list(want._fields)
        for k, w in want._asdict().items():
            g = getattr(got, k)
            assert (g.dtype, g.shape) == (w.dtype, w.shape), k
            assert np.abs(w).max() > 0, k  # not a comparison of zeros
            assert scaled_error(g, w) < TOLERANCE[str(w.dtype)], k
    elif "tf_unchecked" in expect:
        with pytest.raises(InvalidArgumentError):
            op(**kwargs)
    else:
        with pytest.raises(getattr(errors, expect["error"])) as info:
            op(**kwargs)
        assert normalise(expect["message"]) in normalise(str(info.value))
    assert client.stop_gradient(np.ones(2)).sum() == 2  # still serving


def test_grad_shapes_are_checked(client):
    case = random_case(
        np.random.default_rng(2), steps=5, batch=2, inputs=3, units=4, dtype=np.float32
    )
    args = [case["seq_len_max"], *(case[k] for k in INPUTS)]
    out = client.raw_ops.BlockLSTMV2(*args)
    with pytest.raises(InvalidArgumentError, match="h_grad must be \\[T, B, H\\]"):
        client.raw_ops.BlockLSTMGradV2(
            *args, *out, case["cs_grad"], case["h_grad"][:4], use_peephole=False
        )


def test_check_between_steps_stops_the_op_and_keeps_nothing():
    case = random_case(np.random.default_rng(4), steps=6, dtype=np.float32)
    check = DeadlineOnCall(3)
    with pytest.raises(DeadlineExceededError):
        lstm_ops.forward(
            Session("s"),
            Compute(backend_numpy),
            lstm_ops.V2,
            LSTMInputs(*(case[k] for k in INPUTS)),
            case["seq_len_max"],
            use_peephole=False,
            check=check,
        )
    assert check.calls == 3


def test_deadline_over_rpc_leaves_session_unchanged():
    # ~100k steps take about a second with NumPy's passes (FUSED's calls of several
    # steps: a tenth of that); the deadline passes within the first few thousand.
    case = random_case(
        np.random.default_rng(6), steps=100_000, batch=4, inputs=8, units=8, dtype=np.float32
    )
    with run_server(device="cpu", cpu_step_kernel="numpy") as server:
        target = f"127.0.0.1:{server.port}"
        with gradserve.Client(target, timeout=0.2) as client:
            with pytest.raises(DeadlineExceededError):
                client.raw_ops.BlockLSTMV2(
                    case["seq_len_max"], *(case[k] for k in INPUTS), keep=True
                )
            session = server.store.get(client.session_id)
            time.sleep(0.5)  # let the server thread notice and stop
            assert session.budget.used == 0


def test_lstm_in_a_batch(client):
    case = random_case(np.random.default_rng(8), steps=3, dtype=np.float64)
    batch = client.batch()
    batch.raw_ops.BlockLSTMV2(case["seq_len_max"], *(case[k] for k in INPUTS))
    batch.raw_ops.StopGradient(np.arange(3))
    (out, sg) = batch.run()
    want = lstm_cases.forward(backend_numpy, *(case[k] for k in INPUTS), seq_len_max=3)
    np.testing.assert_allclose(out.h, want.h, rtol=0, atol=1e-12)  # a ulp apart on CUDA


def test_out_of_memory_is_resource_exhausted_and_server_survives(client, server, monkeypatch):
    """A failed allocation (NumPy's MemoryError; CuPy's OutOfMemoryError is one too)
    is RESOURCE_EXHAUSTED, with nothing kept, and the next call is served."""
    case = random_case(np.random.default_rng(3), dtype=np.float32)
    args = [case["seq_len_max"], *(case[k] for k in INPUTS)]

    def out_of_memory(*a, **k):
        raise MemoryError("Out of memory allocating 52,428,800 bytes")

    monkeypatch.setattr(lstm, "block_lstm_forward", out_of_memory)
    with pytest.raises(ResourceExhaustedError, match="out of memory") as info:
        client.raw_ops.BlockLSTMV2(*args, keep=True)
    assert info.value.reason == "OUT_OF_MEMORY"
    assert server.store.get(client.session_id).budget.used == 0
    monkeypatch.undo()
    assert client.raw_ops.BlockLSTMV2(*args).h.shape == case["h_grad"].shape


@pytest.mark.parametrize("empty", ["T", "B", "I", "H"])
def test_zero_size_dimensions(client, empty):
    """An empty T, B, I or H is a valid call with exact results. TensorFlow 2.21 returns
    uninitialised memory for w_grad when B = 0 and for x_grad when H = 0 (seen by hand);
    ours are the true gradients: sums over nothing, zero."""
    sizes = {"T": 3, "B": 2, "I": 3, "H": 4, empty: 0}
    case = random_case(
        np.random.default_rng(4), steps=sizes["T"], batch=sizes["B"], inputs=sizes["I"],
        units=sizes["H"], dtype=np.float32,
    )  # fmt: skip
    args = [case["seq_len_max"], *(case[k] for k in INPUTS)]
    out = client.raw_ops.BlockLSTMV2(*args, use_peephole=True)
    grads = client.raw_ops.BlockLSTMGradV2(
        *args, *out, case["cs_grad"], case["h_grad"], use_peephole=True
    )
    if empty == "I":
        # x then adds nothing to the gates: the same as one input column of zeros.
        padded = dict(case, x=np.zeros((3, 2, 1), np.float32))
        padded["w"] = np.concatenate([np.ones((1, 16), np.float32), case["w"]])
        want_out = lstm_cases.forward(
            backend_numpy, *(padded[k] for k in INPUTS), seq_len_max=3, use_peephole=True
        )
        want = lstm_cases.backward(
            backend_numpy, *(padded[k] for k in INPUTS), *want_out, case["cs_grad"],
            case["h_grad"], seq_len_max=3, use_peephole=True,
        )._replace(x_grad=np.zeros((3, 2, 0), np.float32))  # fmt: skip
        want = want._replace(w_grad=want.w_grad[1:])
        for k in OUTPUTS:
            np.testing.assert_allclose(getattr(out, k), getattr(want_out, k), rtol=1e-6)
        assert np.abs(want.w_grad).max() > 0  # the comparison below is not of zeros
    else:
        want = lstm.LSTMGrads(*(np.zeros_like(case[k]) for k in INPUTS))
        for k in OUTPUTS:
            assert getattr(out, k).shape == (sizes["T"], sizes["B"], sizes["H"])
    for k, got in grads._asdict().items():
        assert got.dtype == np.float32 and got.shape == getattr(want, k).shape, k
        np.testing.assert_allclose(got, getattr(want, k), rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("empty", ["B", "H"])
def test_a_sequence_with_no_batch_or_no_units_costs_no_steps(client, empty):
    """With B or H zero no step has anything to compute; the steps used to be looped
    over anyway, ~8 us each, so a request of a few hundred bytes with ``seq_len_max``
    2**31-1 held a compute slot for about five hours. The answer is all zeros (the
    outputs and the gradients of a sequence with no gate element), within a deadline
    that the old loop would have run past by hours."""
    steps = 2**31 - 1
    batch, inputs, units = (0, 3, 4) if empty == "B" else (2, 0, 0)
    f32 = np.float32
    x = np.zeros((steps, batch, inputs), f32)  # no bytes: B or I is zero
    cs0 = h0 = np.zeros((batch, units), f32)
    w, peep, b = (
        np.ones((inputs + units, 4 * units), f32),
        np.ones(units, f32),
        np.ones(4 * units, f32),
    )
    args = [np.int64(steps), x, cs0, h0, w, peep, peep, peep, b]
    client.timeout = 60.0  # seconds, each call
    out = client.raw_ops.BlockLSTMV2(*args, use_peephole=True)
    assert all(getattr(out, k).shape == (steps, batch, units) for k in OUTPUTS)
    zeros = np.zeros((steps, batch, units), f32)
    grads = client.raw_ops.BlockLSTMGradV2(*args, *out, zeros, zeros, use_peephole=True)
    want = lstm.LSTMGrads(x, cs0, h0, w, peep, peep, peep, b)
    for k, got in grads._asdict().items():
        assert got.shape == getattr(want, k).shape, k
        assert not got.any(), k


@pytest.mark.parametrize("first", ["array", "ref", "ref, arrays", "array, arrays"])
def test_lstm_inputs_given_as_lists_take_the_type_of_the_first_tensor(client, first):
    """An LSTM op's inputs share one type, T: TensorFlow converts Python (and NumPy)
    values to the dtype of its first tensor input, else of its first value (eager
    ``args_to_matching_eager``), so lists with a float16 ``x`` are float16. Each was
    converted on its own (float32) and the op refused (found by a review helper)."""
    rng = np.random.default_rng(0)
    steps, batch, units = 3, 2, 4
    x = rng.standard_normal((steps, batch, units)).astype(np.float16)
    w = (rng.standard_normal((2 * units, 4 * units)) * 0.3).astype(np.float16)
    zeros = [[0.0] * units] * batch
    peep = [0.1] * units
    args = [zeros, zeros, w.tolist(), peep, peep, peep, [0.0] * (4 * units)]
    if first.endswith("arrays"):  # float32 arrays after a float16 x: converted too
        args = [np.asarray(a, np.float32) for a in args]
    x_arg = client.put(x) if first.startswith("ref") else x
    got = client.raw_ops.BlockLSTMV2(np.int64(steps), x_arg, *args, use_peephole=True)
    half = [np.asarray(a, np.float16) for a in args]
    want = client.raw_ops.BlockLSTMV2(np.int64(steps), x, *half, use_peephole=True)
    assert got.h.dtype == np.float16
    np.testing.assert_array_equal(got.h, want.h)


class _ForeignTensor:
    """Another framework's tensor as the SDK sees it: a dtype and ``__array__``."""

    def __init__(self, array):
        self._array = array
        self.dtype = array.dtype

    def __array__(self, dtype=None, copy=None):
        return self._array if dtype is None else self._array.astype(dtype)


def test_another_frameworks_tensors_set_t_and_are_not_converted(client):
    """TensorFlow counts its tensors (and torch's) as tensors when it infers ``T``:
    a float16 ``x`` array among float32 ``tf.constant``s computes in float32, and a
    float16 ``tf.constant`` x among float32 ones is refused (TF 2.21 eager; found by a
    review helper: we computed both in float16)."""
    steps, batch, units = 2, 1, 2
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    rest = [z(batch, units), z(batch, units), np.full((2 * units, 4 * units), 0.1, np.float32)]
    rest += [z(units), z(units), z(units), z(4 * units)]
    x16 = np.full((steps, batch, units), 0.1, np.float16)
    got = client.raw_ops.BlockLSTMV2(np.int64(steps), x16, *map(_ForeignTensor, rest))
    assert got.h.dtype == np.float32
    with pytest.raises(InvalidArgumentError, match="does not match type float16"):
        client.raw_ops.BlockLSTMV2(np.int64(steps), _ForeignTensor(x16), *map(_ForeignTensor, rest))


@pytest.mark.parametrize("source", ["gather", "stop-gradient", "lstm"])
def test_a_batch_steps_output_sets_t_as_a_tensor(client, source):
    """In a batch, an earlier step's output is a tensor of a known dtype: a float16
    ``x`` gathered from a TensorArray (or passed on through StopGradient, or another
    LSTM step's ``h``) makes the float64 arrays beside it float16, as the
    direct call does (found by a review helper: the step was refused, "Input
    'cs_prev' of 'BlockLSTMV2' Op has type float64 that does not match type float16")."""
    steps, batch, units = 3, 2, 4
    rng = np.random.default_rng(5)
    x = rng.standard_normal((steps, batch, units)).astype(np.float16)
    args = [np.zeros((batch, units)), np.zeros((batch, units))]
    args += [rng.standard_normal((2 * units, 4 * units)) * 0.3]
    args += [np.zeros(units), np.zeros(units), np.zeros(units), np.zeros(4 * units)]
    want = client.raw_ops.BlockLSTMV2(np.int64(steps), x, *args)
    b = client.batch()
    if source == "lstm":
        x_step = b.raw_ops.BlockLSTMV2(np.int64(steps), x, *args).h
        want = client.raw_ops.BlockLSTMV2(np.int64(steps), want.h, *args)
    else:
        ta, flow = b.raw_ops.TensorArrayV3(steps, np.float16)
        flow = b.raw_ops.TensorArrayScatterV3(ta, np.arange(steps), x, flow)
        x_step = b.raw_ops.TensorArrayGatherV3(ta, np.arange(steps), flow, np.float16)
        if source == "stop-gradient":
            x_step = b.raw_ops.StopGradient(x_step)
    assert x_step.dtype == np.float16
    got = b.raw_ops.BlockLSTMV2(np.int64(steps), x_step, *args)
    assert all(out.dtype == np.float16 for out in got)
    result = b.run()[-1]
    assert result.h.dtype == np.float16
    np.testing.assert_array_equal(result.h, want.h)
