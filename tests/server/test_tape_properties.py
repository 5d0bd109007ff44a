"""The gradient tape against two independent references.

1. Random TensorArray / StopGradient programs (the golden recorder's ``ProgramMaker``,
   from seeds Hypothesis draws): the tape's gradient equals the one a worker gets by
   driving today's raw gradient ops by hand through the SDK — ``TensorArrayGradV3``
   with a source of its own, then, in reverse program order, what TensorFlow's
   registered gradients do (``tensor_array_grad.py``): a read's gradient written to
   the grad array, a write's read from it, gather <-> scatter, concat <-> split with
   the forward's lengths; StopGradient, size and close pass nothing. None-ness follows
   ``tf.gradients``: a tensor gets a gradient when an op that consumes it passes one
   (a write passes one whenever its flow does, zeros for an element nobody read).
2. BlockLSTM (V1) and BlockLSTMV2 in float64 through the tape, fed from and into
   TensorArrays, against central finite differences of the forward, with and
   without peepholes, with ``cell_clip`` active (some cells clip: checked) or off,
   for ``h`` and ``cs`` targets. With the clip active the TensorFlow-kernel gradient
   (the raw ``BlockLSTMGrad*`` ops, which ignore the clip) is shown to be off.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import gradserve
from gradserve import errors
from tests.golden.record_tape_programs import ProgramMaker
from tests.golden.trace_format import resolve, tensor_value
from tests.server.test_tape_golden import gradient, run_forward, run_step


# ------------------------------------------------------------------ random programs
class HandDriven:
    """The reference: a program's gradient from the raw gradient ops, driven by hand
    on a forward run without a tape (so nothing is shared with the tape's run)."""

    def __init__(self, client, program: dict, source: str) -> None:
        self.client = client
        self.ops = client.raw_ops
        self.program = program
        self.source = source
        self.env: dict = {}
        for step in program["ops"]:
            run_step(client, step, self.env)
        self.grad_arrays: dict[str, tuple] = {}  # forward array name -> (handle, flow)

    def grad_array(self, array: str, flow) -> tuple:
        if array not in self.grad_arrays:
            self.grad_arrays[array] = tuple(
                self.ops.TensorArrayGradV3(self.env[array], flow, self.source)
            )
        return self.grad_arrays[array]

    def _size(self, array: str, flow) -> int:
        return int(self.ops.TensorArraySizeV3(self.grad_array(array, flow)[0], flow))

    def gradient(self, call: dict) -> list:
        dtype = np.dtype(self.program["dtype"])
        grads: dict[str, np.ndarray] = {}
        flows: set[str] = set()  # flows that carry gradient

        def add(name: str, g) -> None:
            g = np.asarray(g)
            grads[name] = grads[name] + g if name in grads else g

        # As tf.gradients, only the ops on a path from a source run their gradient
        # (an op no source reaches is not differentiated, e.g. on a closed array).
        reached = set(call["sources"])
        for step in self.program["ops"]:
            args = step["args"]
            inputs = (
                []
                if step["op"] == "StopGradient"
                else [v[1:] for v in args.values() if isinstance(v, str) and v.startswith("$")]
            )
            if any(i in reached for i in inputs):
                reached.update(step["out"])
        seeds = call["output_gradients"]
        for k, target in enumerate(call["targets"]):
            shape = np.shape(self.value(target))
            add(target, np.ones(shape, dtype) if seeds is None else tensor_value(seeds[k]))
        for step in reversed(self.program["ops"]):
            op, args, out = step["op"], step["args"], step["out"]
            array = args.get("handle", "$")[1:]
            flow_in = args.get("flow_in", "$")[1:]
            if not any(o in reached for o in out):
                continue
            if op in ("TensorArrayReadV3", "TensorArrayGatherV3", "TensorArrayConcatV3"):
                if out[0] not in grads:
                    continue
                g_handle, g_flow = self.grad_array(array, self.env[flow_in])
                given = resolve(args, self.env)
                if op == "TensorArrayReadV3":
                    self.ops.TensorArrayWriteV3(g_handle, given["index"], grads[out[0]], g_flow)
                elif op == "TensorArrayGatherV3":
                    self.ops.TensorArrayScatterV3(g_handle, given["indices"], grads[out[0]], g_flow)
                else:  # the forward's lengths
                    lengths = self.env[out[1]]
                    self.ops.TensorArraySplitV3(g_handle, grads[out[0]], lengths, g_flow)
                flows.add(flow_in)
            elif op in ("TensorArrayWriteV3", "TensorArrayScatterV3", "TensorArraySplitV3"):
                if out[0] not in flows:
                    continue
                flows.add(flow_in)
                value = args["value"]
                if not isinstance(value, str):
                    continue  # a constant
                g_handle, g_flow = self.grad_array(array, self.env[out[0]])
                given = resolve(args, self.env)
                if op == "TensorArrayWriteV3":
                    g = self.ops.TensorArrayReadV3(g_handle, given["index"], g_flow, dtype)
                elif self._size(array, g_flow) == 0:  # ours: the empty gradient (README)
                    g = np.zeros(np.shape(self.value(value[1:])), dtype)
                elif op == "TensorArrayScatterV3":
                    g = self.ops.TensorArrayGatherV3(g_handle, given["indices"], g_flow, dtype)
                else:
                    g = self.ops.TensorArrayConcatV3(g_handle, g_flow, dtype).value
                add(value[1:], g)
        out = []
        for s in call["sources"]:
            if s in grads:
                out.append(np.asarray(grads[s]))
            elif call["unconnected_gradients"] == "zero":
                out.append(np.zeros(np.shape(self.value(s)), dtype))
            else:
                out.append(None)
        return out

    def value(self, name: str) -> np.ndarray:
        value = self.env[name]
        return value.numpy() if isinstance(value, gradserve.TensorRef) else np.asarray(value)


def _same(got: list, want: list, dtype: str) -> None:
    assert len(got) == len(want)
    tol = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-12}[dtype]
    for k, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), (k, g, w)
        if w is not None:
            g = np.asarray(g)
            assert (g.dtype, g.shape) == (w.dtype, w.shape), (k, g, w)
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"source {k}")


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    kind=st.sampled_from(["ta", "ta", "stop", "stop", "size0"]),
    dtype=st.sampled_from(["float32", "float64", "float16"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_tape_equals_hand_driven_gradient_ops(target, kind, dtype, seed):
    """The program comes from a seed, not from Hypothesis's own draws: those shrink
    towards programs of one or two ops, which exercise little (a failure still
    reproduces from the kind, dtype and seed Hypothesis prints)."""
    program = ProgramMaker(np.random.default_rng(seed), kind, dtype).program()
    assume(program is not None)
    with gradserve.Client(target, timeout=60) as client:
        persistent = len(program["gradients"]) > 1
        tape = client.gradient_tape(persistent=persistent)
        env = run_forward(client, program, tape)
        for n, call in enumerate(program["gradients"]):
            got = gradient(tape, env, call)
            try:
                want = HandDriven(client, program, f"by_hand_{n}").gradient(call)
            except errors.GradserveError as e:
                assert type(got) is type(e), (call, got, e)
                continue
            assert not isinstance(got, Exception), (call, got, want)
            _same(got, want, dtype)
        if persistent:
            tape.release()


# ------------------------------------------------------------------ LSTM, finite differences
T, B, N_IN, H = 3, 2, 2, 2
SOURCES = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")


def _inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"x": (T, B, N_IN), "cs_prev": (B, H), "h_prev": (B, H), "w": (N_IN + H, 4 * H),
              "wci": (H,), "wcf": (H,), "wco": (H,), "b": (4 * H,)}  # fmt: skip
    values = {k: rng.standard_normal(s) for k, s in shapes.items()}
    values["b"] += 1.0  # open the gates: cell states grow past a clip
    return values


def _forward(client, op: str, inputs: dict, attrs: dict, seq_len_max: int = T):
    return getattr(client.raw_ops, op)(
        np.int64(seq_len_max), *(inputs[k] for k in SOURCES), **attrs
    )


def _pre_clip(inputs: dict, acts) -> np.ndarray:
    """Each cell state before the clip: i * ci + f * cs[t-1] (cs[t-1] as stored)."""
    before = np.concatenate([inputs["cs_prev"][None], np.asarray(acts.cs)[:-1]])
    return np.asarray(acts.i) * np.asarray(acts.ci) + np.asarray(acts.f) * before


def _choose_clip(client, op: str, inputs: dict, attrs: dict, length: int) -> tuple[float, int]:
    """A clip that some cells pass and some do not, none within 1e-3 of it (so the
    finite differences never cross it); and how many cells it clips."""
    free = _pre_clip(inputs, _forward(client, op, inputs, {**attrs, "cell_clip": -1.0}, length))
    for q in (0.5, 0.6, 0.4, 0.7, 0.3):
        clip = float(np.quantile(np.abs(free), q))
        pre = np.abs(
            _pre_clip(inputs, _forward(client, op, inputs, {**attrs, "cell_clip": clip}, length))
        )
        clipped = int(np.sum(pre > clip))
        if np.min(np.abs(pre - clip)) > 1e-3 and 2 <= clipped <= pre.size - 2:
            return clip, clipped
    raise AssertionError("no clip found that clips some cells away from the boundary")


@pytest.mark.parametrize("op", ["BlockLSTM", "BlockLSTMV2"])
@pytest.mark.parametrize("use_peephole", [False, True])
@pytest.mark.parametrize("clip", ["active", "off", "short"])
def test_lstm_tape_matches_finite_differences(client, op, use_peephole, clip):
    """``short``: seq_len_max = T - 1 (clip active); the steps past it give nothing."""
    rng = np.random.default_rng(
        [int(use_peephole), ["active", "off", "short"].index(clip), len(op), 15]
    )
    inputs = _inputs(rng)
    attrs = {"use_peephole": use_peephole}
    if op == "BlockLSTM":
        attrs["forget_bias"] = 0.5
    seq_len_max = T - 1 if clip == "short" else T
    clipped = 0
    attrs["cell_clip"] = -1.0 if op == "BlockLSTM" else 0.0  # off
    if clip != "off":
        attrs["cell_clip"], clipped = _choose_clip(client, op, inputs, attrs, seq_len_max)
    gy_h, gy_cs = rng.standard_normal((T, B, H)), rng.standard_normal((T, B, H))

    # Through the tape: x scattered into an array and stacked, h_prev written and read
    # back, h split into uneven blocks and concatenated, cs a target as it is.
    with client.gradient_tape(persistent=True) as tape:
        refs = {k: client.put(v) for k, v in inputs.items()}
        raw = client.raw_ops
        xs, flow = raw.TensorArrayV3(size=T, dtype=np.float64, element_shape=[B, N_IN])
        flow = raw.TensorArrayScatterV3(xs, np.arange(T, dtype=np.int32), refs["x"], flow)
        x = raw.TensorArrayGatherV3(xs, np.arange(T, dtype=np.int32), flow, np.float64)
        hp, hflow = raw.TensorArrayV3(size=1, dtype=np.float64)
        hflow = raw.TensorArrayWriteV3(hp, 0, refs["h_prev"], hflow)
        h_prev = raw.TensorArrayReadV3(hp, 0, hflow, np.float64)
        args = {**refs, "x": x, "h_prev": h_prev}
        acts = _forward(client, op, args, attrs, seq_len_max)
        hs, oflow = raw.TensorArrayV3(size=2, dtype=np.float64)
        oflow = raw.TensorArraySplitV3(hs, acts.h, np.array([1, T - 1], np.int64), oflow)
        h = raw.TensorArrayConcatV3(hs, oflow, np.float64).value
    sources = [refs[k] for k in SOURCES]
    taped = {
        "h": tape.gradient([h], sources, output_gradients=[gy_h]),
        "cs": tape.gradient([acts.cs], sources, output_gradients=[gy_cs]),
        "both": tape.gradient([h, acts.cs], sources, output_gradients=[gy_h, gy_cs]),
    }
    tape.release()
    np.testing.assert_allclose(h, _forward(client, op, inputs, attrs, seq_len_max).h)

    # Central differences of the forward, one pair of runs per input element.
    eps = 1e-6
    losses = {"h": lambda a: np.sum(gy_h * a.h), "cs": lambda a: np.sum(gy_cs * a.cs)}
    losses["both"] = lambda a: losses["h"](a) + losses["cs"](a)
    numeric = {key: [np.zeros_like(inputs[k]) for k in SOURCES] for key in losses}
    for n, name in enumerate(SOURCES):
        for index in np.ndindex(inputs[name].shape):
            runs = []
            for sign in (1, -1):
                moved = {k: v.copy() for k, v in inputs.items()}
                moved[name][index] += sign * eps
                runs.append(_forward(client, op, moved, attrs, seq_len_max))
            for key, loss in losses.items():
                numeric[key][n][index] = (loss(runs[0]) - loss(runs[1])) / (2 * eps)
    for key in losses:
        assert max(float(np.max(np.abs(g))) for g in numeric[key]) > 0.01  # not vacuous
        for n, name in enumerate(SOURCES):
            np.testing.assert_allclose(
                taped[key][n], numeric[key][n], rtol=1e-6, atol=1e-7,
                err_msg=f"{op} peephole={use_peephole} clip={clip}: d {key} / d {name}",
            )  # fmt: skip

    worst = max(
        float(np.max(np.abs(np.asarray(taped[k][n]) - numeric[k][n]), initial=0.0))
        for k in losses for n in range(len(SOURCES))
    )  # fmt: skip
    print(f"{op} peephole={use_peephole} clip={clip}: {clipped} cells clipped, "
          f"max |tape - finite differences| {worst:.2e}")  # fmt: skip
    if clip == "off":
        return
    # Cells did clip, and the gradient that ignores the clip (TensorFlow's kernels,
    # our raw BlockLSTMGrad ops) is off: the masking above was needed.
    assert clipped >= 2
    fwd = _forward(client, op, inputs, attrs, seq_len_max)
    grad_op = {"BlockLSTM": "BlockLSTMGrad", "BlockLSTMV2": "BlockLSTMGradV2"}[op]
    unmasked = getattr(client.raw_ops, grad_op)(
        np.int64(seq_len_max), *(inputs[k] for k in SOURCES), *fwd,
        gy_cs, gy_h, use_peephole=use_peephole,
    )  # fmt: skip
    off = max(float(np.max(np.abs(u - g))) for u, g in zip(unmasked, numeric["both"]))
    print(f"  the gradient ignoring the clip is off by up to {off:.3f}")
    assert off > 1e-3, off
