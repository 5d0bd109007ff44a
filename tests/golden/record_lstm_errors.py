"""Record what TensorFlow does with malformed LSTM inputs, into ``lstm_bad_inputs.json``.

For each of BlockLSTM, BlockLSTMV2, BlockLSTMGrad and BlockLSTMGradV2: one valid call,
then every input one rank too high, one too low, each dimension one too large, and
``seq_len_max`` as a vector, negative and past T. Each case is a one-step trace in the
golden trace format, run by ``tf_record``. A malformed case that TensorFlow does not
reject (it runs on, reading out of bounds, or it dies; which one varies from run to run)
is marked ``{"tf_unchecked": true}``. TensorFlow is never a dependency of gradserve: install it by
hand to re-record, e.g.

    python3 -m venv /tmp/tf && /tmp/tf/bin/pip install "tensorflow-cpu==2.21.*" numpy
    /tmp/tf/bin/python tests/golden/record_lstm_errors.py

The test replaying them (``tests/server/test_lstm_rpc.py``) wants TensorFlow's error,
word for word, where TensorFlow reports one, and INVALID_ARGUMENT where it does not.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
from tf_record import record, worker
from trace_format import filled, tensor

OUT = pathlib.Path(__file__).parent / "lstm_bad_inputs.json"
STEPS, BATCH, INPUTS, UNITS = 3, 2, 4, 5
SHAPES = {
    "x": (STEPS, BATCH, INPUTS),
    "cs_prev": (BATCH, UNITS),
    "h_prev": (BATCH, UNITS),
    "w": (INPUTS + UNITS, 4 * UNITS),
    "wci": (UNITS,),
    "wcf": (UNITS,),
    "wco": (UNITS,),
    "b": (4 * UNITS,),
}
ACTIVATIONS = ("i", "cs", "f", "o", "ci", "co", "h", "cs_grad", "h_grad")
OPS = ("BlockLSTMV2", "BlockLSTM", "BlockLSTMGradV2", "BlockLSTMGrad")


def _values(shape: tuple) -> dict:
    """One value throughout: values do not matter to these checks."""
    return filled(shape, "float32", 0.5)


def _shape_changes(shape: tuple) -> dict[str, tuple]:
    changes = {"rank+1": (*shape, 1)}
    if len(shape) > 1:
        changes["rank-1"] = shape[:-1]
    for axis in range(len(shape)):
        changes[f"dim{axis}+1"] = tuple(d + (k == axis) for k, d in enumerate(shape))
    return changes


def _is_valid(name: str) -> bool:
    """The unchanged call, and a forward with a longer x (x defines T there)."""
    return name.endswith("_valid") or (name.endswith("_x_dim0+1") and "Grad" not in name)


def make_cases() -> dict[str, list[dict]]:
    cases = {}
    for op in OPS:
        shapes = dict(SHAPES)
        if "Grad" in op:
            shapes.update({k: (STEPS, BATCH, UNITS) for k in ACTIVATIONS})
        valid = {k: _values(s) for k, s in shapes.items()}
        variants = {"valid": ({}, STEPS)}
        for name, shape in shapes.items():
            for what, changed in _shape_changes(shape).items():
                variants[f"{name}_{what}"] = ({name: _values(changed)}, STEPS)
        variants["seq_len_max_vector"] = ({}, [STEPS])
        variants["seq_len_max_negative"] = ({}, -1)
        variants["seq_len_max_past_T"] = ({}, STEPS + 1)
        for label, (change, seq_len_max) in variants.items():
            args = {"seq_len_max": tensor(np.array(seq_len_max, np.int64))}
            args.update({**valid, **change})
            args["use_peephole"] = True
            cases[f"{op}_{label}"] = [{"op": op, "args": args}]
    return cases


def main() -> None:
    import tensorflow as tf

    recorded = record(make_cases())
    for name, (step,) in recorded.items():
        # Malformed input that TensorFlow does not check: it reads out of bounds, and
        # whether it then runs on or dies changes from run to run. One label for both.
        if not _is_valid(name) and "error" not in step["expect"]:
            step["expect"] = {"tf_unchecked": True}
    unchecked = sum("tf_unchecked" in t[0]["expect"] for t in recorded.values())
    meta = {"recorded_with": f"tensorflow {tf.__version__}", "traces": recorded}
    OUT.write_text(json.dumps(meta, separators=(",", ":")) + "\n")
    print(f"{len(recorded)} cases ({unchecked} unchecked by TensorFlow) written to {OUT}")


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main()
