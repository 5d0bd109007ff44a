"""Record the BlockLSTM / BlockLSTMGrad (V1: ICFO gates, forget_bias) golden cases.

The shared goldens in ``lstm/`` cover BlockLSTMV2 only. This script records the V1
pair the same way, from TensorFlow itself, into ``lstm_v1/``. TensorFlow is never a
dependency of gradserve: install it by hand to re-record, e.g.

    python3 -m venv /tmp/tf && /tmp/tf/bin/pip install "tensorflow-cpu==2.21.*" numpy
    /tmp/tf/bin/python tests/golden/record_lstm_v1.py

One difference from ``lstm/``: past ``seq_len_max`` TensorFlow leaves i, f, o, ci and co
uninitialised; here those entries are zeroed before saving and before the backward
is fed them, so that a re-recording gives the same files.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import tensorflow as tf

OUT = pathlib.Path(__file__).parent / "lstm_v1"
INPUTS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")
OUTPUTS = ("i", "cs", "f", "o", "ci", "co", "h")
GRADS = ("x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad",
         "b_grad")  # fmt: skip
PAST_END_GARBAGE = ("i", "f", "o", "ci", "co")

# (T, B, I, H, seq_len_max, use_peephole, cell_clip, forget_bias, dtype, weight scale)
CASES = [
    (5, 3, 4, 6, 5, True, 3.0, 1.0, "float32", 1.0),  # the op's defaults
    (7, 2, 3, 5, 4, True, 0.2, 1.0, "float32", 3.0),  # the clip bites; seq_len_max < T
    (6, 4, 8, 16, 6, False, 0.0, 0.5, "float32", 1.0),  # no clip, another forget bias
    (4, 3, 5, 2, 0, True, 3.0, 1.0, "float32", 1.0),  # seq_len_max = 0
    (6, 3, 4, 8, 6, True, 3.0, 1.0, "float16", 1.0),
    (10, 4, 8, 16, 7, True, -1.0, -0.5, "float32", 2.0),  # negative clip: none
]


def record(index: int, case: tuple, rng: np.random.Generator) -> dict:
    steps, batch, inputs, units, length, peephole, clip, forget_bias, dtype, scale = case

    def r(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(dtype)

    d = {
        "x": r(steps, batch, inputs),
        "cs_prev": r(batch, units),
        "h_prev": r(batch, units),
        "w": r(inputs + units, 4 * units, s=scale / np.sqrt(inputs + units)),
        "wci": r(units, s=0.5),
        "wcf": r(units, s=0.5),
        "wco": r(units, s=0.5),
        "b": r(4 * units, s=0.5),
    }
    seq_len_max = np.int64(length)
    out = tf.raw_ops.BlockLSTM(
        seq_len_max=seq_len_max, **d, forget_bias=forget_bias, cell_clip=clip,
        use_peephole=peephole,
    )  # fmt: skip
    out = {k: v.numpy() for k, v in zip(OUTPUTS, out)}
    for k in PAST_END_GARBAGE:
        out[k][length:] = 0
    d.update(out)
    d["cs_grad"], d["h_grad"] = r(steps, batch, units), r(steps, batch, units)
    grads = tf.raw_ops.BlockLSTMGrad(
        seq_len_max=seq_len_max, **{k: d[k] for k in INPUTS + OUTPUTS},
        cs_grad=d["cs_grad"], h_grad=d["h_grad"], use_peephole=peephole,
    )  # fmt: skip
    d.update({k: v.numpy() for k, v in zip(GRADS, grads)})
    name = f"lstm_v1_{index:02d}"
    np.savez(
        OUT / f"{name}.npz", seq_len_max=seq_len_max, use_peephole=np.bool_(peephole),
        cell_clip=np.float32(clip), forget_bias=np.float32(forget_bias), **d,
    )  # fmt: skip
    return {
        "name": name, "op": "BlockLSTM", "T": steps, "B": batch, "I": inputs, "H": units,
        "seq_len_max": length, "use_peephole": peephole, "cell_clip": clip,
        "forget_bias": forget_bias, "dtype": dtype,
    }  # fmt: skip


def main() -> None:
    OUT.mkdir(exist_ok=True)
    rng = np.random.default_rng(2026)
    index = [record(n, case, rng) for n, case in enumerate(CASES)]
    meta = {"recorded_with": f"tensorflow {tf.__version__}", "cases": index}
    (OUT / "lstm_v1_index.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{len(index)} cases written to {OUT} with TensorFlow {tf.__version__}")


if __name__ == "__main__":
    main()
