"""Array math of the ops, on NumPy (CPU) or CuPy (CUDA), and device selection."""

from gradserve.kernels.device import select_device

__all__ = ["select_device"]
