"""LSTM test inputs: the TensorFlow golden cases and random cases, and how to compare."""

from __future__ import annotations

import json
import pathlib

import numpy as np

GOLDEN = pathlib.Path(__file__).parents[1] / "golden" / "lstm"
INDEX = json.loads((GOLDEN / "lstm_index.json").read_text())
INPUTS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")
OUTPUTS = ("i", "cs", "f", "o", "ci", "co", "h")
OUTPUT_GRADS = ("cs_grad", "h_grad")  # the backward's inputs after the activations
GRADS = (
    "x_grad",
    "cs_prev_grad",
    "h_prev_grad",
    "w_grad",
    "wci_grad",
    "wcf_grad",
    "wco_grad",
    "b_grad",
)
# Past seq_len_max TensorFlow leaves these uninitialised: compare only before it.
UNINITIALISED_PAST_END = ("i", "f", "o", "ci", "co")
TOLERANCE = {"float16": 2e-2, "float32": 5e-5, "float64": 1e-12}


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / f"{name}.npz") as data:
        return {k: data[k] for k in data.files}


def scaled_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max(1, max |want|): the issue's measure."""
    if want.size == 0:
        return 0.0
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max()
    return float(diff / max(1.0, float(np.abs(want.astype(np.float64)).max())))


def random_case(
    rng: np.random.Generator,
    steps=4,
    batch=2,
    inputs=3,
    units=3,
    dtype=np.float64,
    seq_len_max=None,
    scale=0.5,
) -> dict:
    def r(*shape):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    case = {
        "seq_len_max": np.int64(steps if seq_len_max is None else seq_len_max),
        "x": r(steps, batch, inputs),
        "cs_prev": r(batch, units),
        "h_prev": r(batch, units),
        "w": r(inputs + units, 4 * units),
        "wci": r(units),
        "wcf": r(units),
        "wco": r(units),
        "b": r(4 * units),
        "cs_grad": r(steps, batch, units),
        "h_grad": r(steps, batch, units),
    }
    return case
