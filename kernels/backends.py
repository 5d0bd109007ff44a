"""The array backend for a device name: NumPy for "cpu", CuPy kernels for "cuda"."""

from __future__ import annotations

from types import ModuleType


def get_backend(device: str) -> ModuleType:
    """The backend module (``xp``, ``fwd_step``, ``bwd_step``, ...) for ``device``."""
    if device == "cuda":
        from gradserve.kernels import backend_cuda

        return backend_cuda
    if device == "cpu":
        from gradserve.kernels import backend_numpy

        return backend_numpy
    raise ValueError(f"unknown device {device!r}")
