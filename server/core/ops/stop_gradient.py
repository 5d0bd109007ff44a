"""StopGradient: the identity in the forward pass; it blocks gradients (for the
roadmap's autodiff, which records that it has no gradient)."""

from __future__ import annotations

from typing import Any

from gradserve.server.core.sessions import Session, TensorArg


def stop_gradient(session: Session, value: TensorArg) -> Any:
    """The input itself, bit for bit, where it is: tensors held by the server are
    never mutated, so a resident tensor (host or GPU array) is returned as the same
    object, with no copy; the caller encodes it for the wire or keeps it."""
    return session.resolve(value)
