"""The CUDA kernel source and the instantiations gradserve compiles (no CuPy needed)."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

SOURCE = pathlib.Path(__file__).with_name("lstm.cu")

#: NumPy dtype -> the CUDA C type the kernels are instantiated for. float16
#: computes in float32, so it needs no instantiation of its own.
CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}

KERNELS = ("lstm_fwd_step", "lstm_bwd_step")


def name_expressions() -> list[str]:
    """Every ``kernel<type>`` the RawModule compiles."""
    return [f"{k}<{c}>" for k in KERNELS for c in CTYPES.values()]


def kernel_name(kernel: str, dtype: np.dtype[Any] | type) -> str:
    return f"{kernel}<{CTYPES[np.dtype(dtype)]}>"
