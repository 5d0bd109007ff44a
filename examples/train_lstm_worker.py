"""A training worker whose LSTM runs in gradserve: learn to predict noisy sine waves.

Per training step, two round trips besides uploading the weights:

1. Under a gradient tape, one ``Batch`` runs the whole forward in the service:
   ``BlockLSTMV2`` on the step's inputs, its hidden states unstacked into a
   TensorArray and stacked back for the worker's dense head (the TensorArray is
   there to show that gradients flow through it; a worker could read ``acts.h``
   directly). Later steps of the batch name earlier steps' outputs, so nothing
   crosses the wire between them; the tape records every op on the server.
2. The worker computes its head and loss, then asks the tape for the gradients
   of the weights given dL/dh: the server runs TensorFlow's registered
   gradients backwards (gather -> scatter -> BlockLSTMGradV2) and frees what the
   tape held.

Run ``make demo`` (starts a local server), or point it at one:
``python examples/train_lstm_worker.py --target 127.0.0.1:50051``.
"""

from __future__ import annotations

import argparse

import numpy as np

import gradserve

STEPS, BATCH, UNITS = 24, 32, 24


def make_batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sine waves with random frequency and phase, plus noise; target: the next value."""
    t = np.arange(STEPS + 1, dtype=np.float32)
    freq = rng.uniform(0.1, 0.4, size=(1, BATCH)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=(1, BATCH)).astype(np.float32)
    wave = np.sin(freq * t[:, None] + phase) + 0.05 * rng.standard_normal((STEPS + 1, BATCH))
    wave = wave.astype(np.float32)
    return wave[:-1, :, None], wave[1:]  # x: [T, B, 1], y: [T, B]


def init_params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    scale = 1 / np.sqrt(1 + UNITS)
    return {
        "w": (rng.standard_normal((1 + UNITS, 4 * UNITS)) * scale).astype(np.float32),
        "b": np.zeros(4 * UNITS, np.float32),
        "w_out": (rng.standard_normal(UNITS) * 0.1).astype(np.float32),
        "b_out": np.zeros((), np.float32),
    }


def train_step(client: gradserve.Client, params: dict, x: np.ndarray, y: np.ndarray) -> tuple:
    """One forward/backward through the service; returns (loss, grads)."""
    w, b = client.put(params["w"]), client.put(params["b"])  # the sources
    zeros, peep = np.zeros((BATCH, UNITS), np.float32), np.zeros(UNITS, np.float32)
    with client.gradient_tape() as tape:
        forward = client.batch()
        ops = forward.raw_ops
        acts = ops.BlockLSTMV2(np.int64(STEPS), x, zeros, zeros, w, peep, peep, peep, b)
        ta, flow = ops.TensorArrayV3(size=STEPS, dtype=np.float32, element_shape=[BATCH, UNITS])
        flow = ops.TensorArrayScatterV3(ta, np.arange(STEPS), acts.h, flow)
        ops.TensorArrayGatherV3(ta, np.arange(STEPS), flow, np.float32)
        results = forward.run()
    ta_handle, _ = results[1]
    h = results[-1]  # [T, B, H], held by the tape
    pred = h @ params["w_out"] + params["b_out"]
    err = pred - y
    loss = float(np.mean(err**2))
    d_pred = 2 * err / err.size
    grads = {"w_out": np.einsum("tb,tbh->h", d_pred, h), "b_out": d_pred.sum()}
    d_h = (d_pred[..., None] * params["w_out"]).astype(np.float32)
    grads["w"], grads["b"] = tape.gradient(h, [w, b], output_gradients=d_h)
    # The tape let go of everything when it answered; free the step's own state.
    client.raw_ops.TensorArrayCloseV3(ta_handle)
    client.delete(w, b)
    return loss, grads


def train(
    target: str,
    iterations: int = 150,
    lr: float = 0.5,
    seed: int = 0,
    log_every: int = 10,
    quiet: bool = False,
) -> list[float]:
    """Train; returns the loss of every iteration."""
    rng = np.random.default_rng(seed)
    params = init_params(rng)
    velocity = {k: np.zeros_like(v) for k, v in params.items()}
    losses = []
    with gradserve.Client(target) as client:
        for it in range(iterations):
            x, y = make_batch(rng)
            loss, grads = train_step(client, params, x, y)
            losses.append(loss)
            for k in params:
                velocity[k] = 0.9 * velocity[k] - lr * grads[k]
                params[k] = (params[k] + velocity[k]).astype(np.float32)
            if not quiet and (it % log_every == 0 or it == iterations - 1):
                print(f"step {it:4d}  loss {loss:.4f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    losses = train(args.target, args.iterations, args.lr)
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"mean loss of the first 10 steps {first:.4f}, of the last 10 {last:.4f}")


if __name__ == "__main__":
    main()
