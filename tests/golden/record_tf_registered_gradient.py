"""Record TensorFlow's *registered* gradient of BlockLSTMV2 into ``tf_registered_gradient.npz``.

``tf.GradientTape`` over ``tf.raw_ops.BlockLSTMV2`` differentiates through the gradient
function TensorFlow registers for the op, which runs the V1 kernel (ICFO gate layout)
on V2's (IFCO) activations: the result is wrong. This records it, with the inputs and
the output gradients fed in (loss = sum(h * h_grad) + sum(cs * cs_grad)), so that
``test_lstm_gradcheck`` can show on TensorFlow's own numbers what it computes and that
gradserve's BlockLSTMGradV2 agrees with finite differences instead. TensorFlow is never
a dependency of gradserve: install it by hand to re-record (``make golden``).
"""

from __future__ import annotations

import pathlib

import numpy as np

OUT = pathlib.Path(__file__).parent / "tf_registered_gradient.npz"
INPUTS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")
STEPS, BATCH, IN, UNITS = 4, 2, 3, 5


def main() -> None:
    import tensorflow as tf

    rng = np.random.default_rng(2026)
    shapes = {"x": (STEPS, BATCH, IN), "cs_prev": (BATCH, UNITS), "h_prev": (BATCH, UNITS),
              "w": (IN + UNITS, 4 * UNITS), "wci": (UNITS,), "wcf": (UNITS,), "wco": (UNITS,),
              "b": (4 * UNITS,), "cs_grad": (STEPS, BATCH, UNITS),
              "h_grad": (STEPS, BATCH, UNITS)}  # fmt: skip
    case = {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}
    variables = {k: tf.Variable(case[k]) for k in INPUTS}
    with tf.GradientTape() as tape:
        out = tf.raw_ops.BlockLSTMV2(seq_len_max=np.int64(STEPS), **variables, use_peephole=True)
        loss = tf.reduce_sum(out[6] * case["h_grad"]) + tf.reduce_sum(out[1] * case["cs_grad"])
    grads = tape.gradient(loss, variables)
    np.savez(
        OUT, seq_len_max=np.int64(STEPS), use_peephole=np.bool_(True), **case,
        **{f"tf_{k}_grad": grads[k].numpy() for k in INPUTS},
    )  # fmt: skip
    print(f"TensorFlow {tf.__version__}'s registered BlockLSTMV2 gradient written to {OUT}")


if __name__ == "__main__":
    main()
