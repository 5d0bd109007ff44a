"""TensorFlow 1.x graph-mode ``tf.gradients``, replayed through the gradient tape.

``tests/golden/tape_programs.json`` (by ``record_tape_programs.py``, whose docstring
describes the format) holds a few hundred seeded random programs — TensorArray ops of
every kind, StopGradient, BlockLSTM (V1) chains through TensorArrays — and TensorFlow's
gradients of each, or its error. Each program runs here under
``client.gradient_tape()`` on a real server (persistent where it has two gradient
calls), and every gradient must match TensorFlow's: None or not, dtype, shape, and
value within the dtype's tolerance; an error must be TensorFlow's class with
TensorFlow's message. Where ours differs from TensorFlow on purpose (README), the
recording says what ours answers (``ours``): the empty gradient of a split or scatter
into a size-0 array (TensorFlow: UNIMPLEMENTED), and UNIMPLEMENTED naming the gate where
a target is one of the LSTM's i, f, o, ci, co (TensorFlow: silent zeros).

The last test prints the count replayed and the worst error per dtype (also written to
``results/tape_golden.json``).
"""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest

from gradserve import errors
from tests.golden.trace_format import dtype_of, expected, resolve, tensor_value

GOLDEN = pathlib.Path(__file__).parents[1] / "golden" / "tape_programs.json"
RECORDING = json.loads(GOLDEN.read_text())
PROGRAMS: dict[str, dict] = RECORDING["programs"]
RESULTS = pathlib.Path(__file__).parents[2] / "results" / "tape_golden.json"

pytestmark = pytest.mark.golden

#: (rtol, atol) per dtype. TensorArray-only programs sum small multiples of 1/4 and
#: are exact in every dtype; the LSTM's float32 kernels differ from TensorFlow's
#: (Eigen) in rounding only.
TOLERANCE = {"float16": (1e-3, 1e-3), "float32": (2e-5, 2e-6), "float64": (1e-12, 1e-12)}

#: What was compared: programs, gradient calls, gradients (values), None gradients,
#: errors, calls where ours differs on purpose; the worst |got - want| per dtype, and where.
STATS: dict = {
    "programs": 0, "calls": 0, "gradients": 0, "nones": 0, "errors": 0, "ours": 0, "worst": {}
}  # fmt: skip


# ------------------------------------------------------------------ the replayer
def run_step(client, step: dict, env: dict) -> None:
    """One recorded step through the SDK (``Put``: ``client.put``); its outputs into
    ``env`` by the names in ``step["out"]``."""
    args = resolve(step["args"], env)
    if step["op"] == "Put":
        outputs = [client.put(args["value"])]
    else:
        if "dtype" in args:
            args["dtype"] = dtype_of(args["dtype"])
        out = getattr(client.raw_ops, step["op"])(**args)
        outputs = [] if out is None else list(out) if isinstance(out, tuple) else [out]
    env.update(zip(step["out"], outputs, strict=True))


def run_forward(client, program: dict, tape) -> dict:
    """The program's ops, recorded on ``tape`` (entered here); the outputs by name.

    A resident tensor that is a target is watched: ``tf.gradients`` takes any tensor
    as a target, a tape only the ones it computed or watches (ours refuses others with
    INVALID_ARGUMENT, where ``tf.GradientTape`` would ignore them)."""
    env: dict = {}
    targets = {t for call in program["gradients"] for t in call["targets"]}
    with tape:
        for step in program["ops"]:
            run_step(client, step, env)
            if step["op"] == "Put" and step["out"][0] in targets:
                tape.watch(env[step["out"][0]])
    return env


def gradient(tape, env: dict, call: dict) -> list | errors.GradserveError:
    """One recorded gradient call on ``tape``: the gradients, or the error raised."""
    seeds = call["output_gradients"]
    try:
        return tape.gradient(
            [env[t] for t in call["targets"]],
            [env[s] for s in call["sources"]],
            output_gradients=None if seeds is None else [tensor_value(g) for g in seeds],
            unconnected_gradients=call["unconnected_gradients"],
        )
    except errors.GradserveError as e:
        return e


def replay(client, program: dict) -> list:
    """The program under a tape, then each gradient call: gradients or errors."""
    persistent = len(program["gradients"]) > 1
    tape = client.gradient_tape(persistent=persistent)
    env = run_forward(client, program, tape)
    try:
        return [gradient(tape, env, call) for call in program["gradients"]]
    finally:
        if persistent:
            tape.release()


# ------------------------------------------------------------------ comparing
def _generic(message: str) -> str:
    """Array names made generic, as the recording writes them: ``ta1_21`` -> ``ta1_N``."""
    return re.sub(r"\b(ta\d+)_\d+", r"\1_N", message).strip()


def compare_gradients(got: list, want: list, dtype: str, where: str) -> list[str]:
    """Differences between ``got`` and the recorded ``want`` (None-ness, dtype, shape,
    values within ``TOLERANCE``); updates ``STATS``."""
    if not isinstance(got, list) or len(got) != len(want):
        return [f"{where}: expected {len(want)} gradients, got {got!r}"]
    problems = []
    rtol, atol = TOLERANCE[dtype]
    for k, (g, w) in enumerate(zip(got, want)):
        at = f"{where} source {k}"
        if w is None or g is None:
            STATS["nones"] += w is None and g is None
            if (w is None) != (g is None):
                problems.append(
                    f"{at}: expected {'None' if w is None else 'a gradient'}, got {g!r}"
                )
            continue
        w = expected(w)
        g = np.asarray(g)
        if g.dtype != w.dtype or g.shape != w.shape:
            problems.append(
                f"{at}: expected {w.dtype}{list(w.shape)}, got {g.dtype}{list(g.shape)}"
            )
            continue
        STATS["gradients"] += 1
        err = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)), initial=0.0))
        if (
            err > STATS["worst"].get(w.dtype.name, (0.0, ""))[0]
            or w.dtype.name not in STATS["worst"]
        ):
            STATS["worst"][w.dtype.name] = (err, at)
        if not np.allclose(g, w, rtol=rtol, atol=atol):
            problems.append(f"{at}: values differ by up to {err:.3g}:\n got {g!r}\nwant {w!r}")
    return problems


def compare_error(got, want: dict, where: str) -> list[str]:
    cls = getattr(errors, want["error"])
    if not isinstance(got, cls):
        return [f"{where}: expected {want['error']}, got {got!r}"]
    STATS["errors"] += 1
    if "output" in want:  # ours: UNIMPLEMENTED naming the LSTM gate
        if not re.search(rf"\b{want['output']}\b", got.message):
            return [f"{where}: the error does not name output {want['output']!r}: {got.message}"]
        return []
    if want["message"] not in _generic(got.message):
        return [f"{where}: TensorFlow said {want['message']!r}, ours {got.message!r}"]
    return []


def check_program(name: str, program: dict, outcomes: list) -> list[str]:
    problems = []
    for n, (call, got) in enumerate(zip(program["gradients"], outcomes, strict=True)):
        where = f"{name} call {n}"
        want = call.get("ours", call["expect"])
        STATS["calls"] += 1
        STATS["ours"] += "ours" in call
        if "error" in want:
            problems += compare_error(got, want, where)
        elif isinstance(got, Exception):
            problems.append(f"{where}: expected gradients, got {got!r}")
        else:
            problems += compare_gradients(got, want["grads"], program["dtype"], where)
    return problems


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_tape_matches_tf_gradients(client, name):
    program = PROGRAMS[name]
    problems = check_program(name, program, replay(client, program))
    STATS["programs"] += 1
    assert not problems, "\n".join(problems)


def test_recording_covers_the_issue():
    """What the recording must hold for the replays above to mean something."""
    ops = {s["op"] for p in PROGRAMS.values() for s in p["ops"]}
    assert ops >= {"TensorArrayV3", "TensorArrayWriteV3", "TensorArrayReadV3",
                   "TensorArrayGatherV3", "TensorArrayScatterV3", "TensorArrayConcatV3",
                   "TensorArraySplitV3", "TensorArraySizeV3", "TensorArrayCloseV3",
                   "StopGradient", "BlockLSTM", "Put"}  # fmt: skip
    calls = [c for p in PROGRAMS.values() for c in p["gradients"]]
    grads = [g for c in calls if "grads" in c["expect"] for g in c["expect"]["grads"]]
    assert {p["dtype"] for p in PROGRAMS.values()} == {"float16", "float32", "float64"}
    assert sum(len(p["gradients"]) == 2 for p in PROGRAMS.values()) >= 50  # persistent
    assert sum(g is None for g in grads) >= 50 and sum(g is not None for g in grads) >= 400
    assert sum(c["unconnected_gradients"] == "zero" for c in calls) >= 30
    assert sum(c["output_gradients"] is not None for c in calls) >= 100
    assert sum("error" in c["expect"] for c in calls) >= 10
    # Repeated reads of one element (clear_after_read=False) and uneven splits.
    assert any(
        len([s for s in p["ops"] if s["op"] == "TensorArrayReadV3"])
        > len(
            {
                (s["args"]["handle"], s["args"]["index"])
                for s in p["ops"]
                if s["op"] == "TensorArrayReadV3"
            }
        )  # fmt: skip
        for p in PROGRAMS.values()
    )
    assert any(
        len(set(s["args"]["lengths"]["array"])) > 1
        for p in PROGRAMS.values() for s in p["ops"] if s["op"] == "TensorArraySplitV3"
    )  # fmt: skip


def test_zz_summary():
    """Runs after the replays (file order): all of them ran; prints the figures."""
    if STATS["programs"] != len(PROGRAMS):
        pytest.skip("not every program was replayed in this run (selection or -x)")
    worst = {k: {"abs_error": v[0], "at": v[1]} for k, v in sorted(STATS["worst"].items())}
    summary = {**STATS, "worst": worst, "recorded_with": RECORDING["recorded_with"]}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\ntape golden: {json.dumps(summary)}")
    assert STATS["calls"] == sum(len(p["gradients"]) for p in PROGRAMS.values())
