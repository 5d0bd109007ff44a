"""A training worker whose LSTM runs in gradserve: learn to predict noisy sine waves.

Per training step:

1. The step's inputs (batch, initial state, weights) are put in the session
   once, and both LSTM calls name them by id. ``BlockLSTMV2`` runs the forward
   in the service and keeps its seven outputs there (``keep=True``), so the
   activations never cross the wire.
2. The per-step hidden states go into a TensorArray on the server (unstacked
   from the resident ``h``), and the worker stacks them once to run its dense
   head and the loss.
3. The worker writes each step's dL/dh into the TensorArray's gradient array
   (``ta.grad("gradients")``) in one ``Batch`` round trip, then gathers them
   into a resident tensor on the server.
4. ``BlockLSTMGradV2`` takes the kept activations and that gradient by id and
   returns the weight gradients; the worker applies SGD with momentum.

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
    raw = client.raw_ops
    # Sent once, read by the forward and the backward (on a GPU server they move
    # to GPU memory at the first read, and stay there).
    zeros = client.put(np.zeros((BATCH, UNITS), np.float32))
    peep = client.put(np.zeros(UNITS, np.float32))
    x_ref, w, b = client.put(x), client.put(params["w"]), client.put(params["b"])
    lstm_args = [np.int64(STEPS), x_ref, zeros, zeros, w, peep, peep, peep, b]
    acts = raw.BlockLSTMV2(*lstm_args, keep=True)  # seven TensorRefs

    # Hidden states into a TensorArray, server-side; the head reads them once.
    ta = client.tensor_array(
        np.float32, size=STEPS, clear_after_read=False, element_shape=[BATCH, UNITS]
    ).unstack(acts.h)
    h = ta.stack()  # [T, B, H]
    pred = h @ params["w_out"] + params["b_out"]
    err = pred - y
    loss = float(np.mean(err**2))
    d_pred = 2 * err / err.size
    grads = {"w_out": np.einsum("tb,tbh->h", d_pred, h), "b_out": d_pred.sum()}

    # dL/dh per step into the gradient TensorArray, one round trip for all steps.
    grad_ta = ta.grad("gradients")
    batch = client.batch()
    for t in range(STEPS):
        d_h = (d_pred[t][:, None] * params["w_out"][None, :]).astype(np.float32)
        batch.raw_ops.TensorArrayWriteV3(grad_ta.handle, t, d_h, grad_ta.flow)
    batch.run()
    h_grad = raw.TensorArrayGatherV3(
        grad_ta.handle, np.arange(STEPS, dtype=np.int32), grad_ta.flow, np.float32, keep=True
    )

    lstm_grads = raw.BlockLSTMGradV2(
        *lstm_args, *acts, np.zeros_like(h), h_grad, use_peephole=False
    )
    grads["w"], grads["b"] = lstm_grads.w_grad, lstm_grads.b_grad

    # Free this step's server-side state.
    client.delete(*acts, h_grad, zeros, peep, x_ref, w, b)
    ta.close()
    grad_ta.close()
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
