"""StopGradient: the identity in the forward pass; it blocks gradients (for the
roadmap's autodiff, which records that it has no gradient)."""

from __future__ import annotations

import numpy as np


def stop_gradient(value: np.ndarray) -> np.ndarray:
    """The input itself, bit for bit: arrays held by the server are never mutated, so
    no copy is needed."""
    return value
