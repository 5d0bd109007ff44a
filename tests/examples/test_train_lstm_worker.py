"""The example worker trains for real against the test server: its loss falls."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

from gradserve.server.core import tensor_array

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "train_lstm_worker.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_lstm_worker", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loss_decreases(server, target):
    losses = load_example().train(target, iterations=40, quiet=True)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_worker_leaves_nothing_behind(server, target):
    example = load_example()
    import gradserve

    rng = np.random.default_rng(0)
    params = example.init_params(rng)
    with gradserve.Client(target) as client:
        x, y = example.make_batch(rng)
        example.train_step(client, params, x, y)
        session = server.store.get(client.session_id)
        held, records = session.budget.used, session.record_bytes()
    # No tensor: only the record of the TensorArray it closed (its handle still names
    # it, as in TensorFlow), which holds no slot.
    assert held == records == tensor_array.ARRAY_BYTES + 2 * len("TensorArrayV3_1")
