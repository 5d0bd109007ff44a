"""The CuPy (CUDA) backend of ``kernels.lstm``: ``lstm.cu`` as RawKernels, GEMMs in cuBLAS.

One ``RawModule`` for the LSTM kernel family, compiled lazily once per device
with ``name_expressions`` generated from the dtype table. Shapes and dtypes are
checked by the caller before any launch; launches go on the current stream
with no host synchronisation.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy
import numpy as np

from gradserve.kernels import cuda_source

#: The arrays of this backend (``cupy.ndarray``; CuPy ships no type information).
Array = Any
Offsets = tuple[int, int, int, int]

xp = cupy
name = "cuda"

THREADS = 256
MAX_BLOCKS = 65535


@functools.cache
def _module(device_id: int) -> cupy.RawModule:
    """The LSTM RawModule, compiled once per device (CuPy caches the binary on disk too)."""
    module = cupy.RawModule(
        code=cuda_source.SOURCE.read_text(),
        options=("--std=c++14",),
        name_expressions=cuda_source.name_expressions(),
    )
    module.compile()
    return module


@functools.cache
def _kernel_on(device_id: int, name: str) -> cupy.RawKernel:
    return _module(device_id).get_function(name)


def _kernel(kernel: str, dtype: np.dtype[Any]) -> cupy.RawKernel:
    """The compiled kernel for this dtype on the current device (looked up once, not
    on every time step)."""
    return _kernel_on(cupy.cuda.Device().id, cuda_source.kernel_name(kernel, dtype))


def _launch(kernel: str, dtype: np.dtype[Any], cells: int, args: tuple[Any, ...]) -> None:
    blocks = max(1, min(MAX_BLOCKS, (cells + THREADS - 1) // THREADS))
    _kernel(kernel, dtype)(grid=(blocks,), block=(THREADS,), args=args)


def asarray(a: Any, dtype: np.dtype[Any]) -> Array:
    return cupy.ascontiguousarray(cupy.asarray(a, dtype=dtype))


def cast(a: Array, dtype: np.dtype[Any]) -> Array:
    return a.astype(dtype, copy=False)


def to_host(a: Any) -> np.ndarray:
    """``a`` in host memory: an explicit device-to-host copy (CuPy refuses implicit ones)."""
    host: np.ndarray = cupy.asnumpy(a)
    return host


def pool_bytes() -> dict[str, int]:
    """CuPy's default memory pool: bytes "used" by live GPU arrays, and "held" from
    the driver (used plus free blocks the pool keeps for reuse)."""
    pool = cupy.get_default_memory_pool()
    return {"used": pool.used_bytes(), "held": pool.total_bytes()}


def to_device(a: Any) -> Array:
    """``a`` in GPU memory, same dtype and shape (no copy if it is there already)."""
    return cupy.asarray(a)


def fwd_step(gates_h: Array, b: Array, cs_prev: Array, wci: Array, wcf: Array, wco: Array,
             i: Array, cs: Array, f: Array, o: Array, ci: Array, co: Array, h: Array,
             offsets: Offsets, forget_bias: float, cell_clip: float,
             use_peephole: bool) -> None:  # fmt: skip
    batch, units = cs_prev.shape
    scalar = gates_h.dtype.type
    _launch("lstm_fwd_step", gates_h.dtype, batch * units, (
        gates_h, b, cs_prev, wci, wcf, wco, i, cs, f, o, ci, co, h,
        np.int32(batch), np.int32(units), *(np.int32(v) for v in offsets),
        scalar(forget_bias), scalar(cell_clip), np.int32(bool(use_peephole)),
    ))  # fmt: skip


def bwd_step(cs_prev: Array, i: Array, f: Array, o: Array, ci: Array, co: Array,
             cs_grad: Array, h_grad: Array, dh_carry: Array, dcs_carry: Array, wci: Array,
             wcf: Array, wco: Array, dgates: Array, offsets: Offsets,
             use_peephole: bool) -> None:  # fmt: skip
    batch, units = i.shape
    _launch("lstm_bwd_step", i.dtype, batch * units, (
        cs_prev, i, f, o, ci, co, cs_grad, h_grad, dh_carry, dcs_carry, wci, wcf, wco, dgates,
        np.int32(batch), np.int32(units), *(np.int32(v) for v in offsets),
        np.int32(bool(use_peephole)),
    ))  # fmt: skip
