"""A ``kernels.lstm`` backend whose fused steps are the CUDA source run on the CPU.

NumPy for everything else (it *is* ``backend_numpy`` with two functions
swapped), so running the algorithm through it and through ``backend_numpy``
isolates the kernels' arithmetic.
"""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess
import types

import numpy as np

from gradserve.kernels import backend_numpy

KERNELS = pathlib.Path(backend_numpy.__file__).parent
SHIM = pathlib.Path(__file__).with_name("host_shim.cpp")
CTYPES = {
    np.dtype(np.float32): ("float", ctypes.c_float),
    np.dtype(np.float64): ("double", ctypes.c_double),
}


def build(out_dir: pathlib.Path) -> ctypes.CDLL:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler")
    lib = out_dir / "liblstm_shim.so"
    subprocess.run(
        [
            compiler,
            "-O2",
            "-std=c++14",
            "-shared",
            "-fPIC",
            f"-I{KERNELS}",
            "-x",
            "c++",
            str(SHIM),
            "-o",
            str(lib),
        ],
        check=True,
    )
    return ctypes.CDLL(str(lib))


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    assert a.flags.c_contiguous, "kernels take contiguous arrays"
    return ctypes.c_void_p(a.ctypes.data)


def make_backend(lib: ctypes.CDLL) -> types.SimpleNamespace:
    # Arrays first, then the options: the CUDA kernels' argument order (lstm.cu).
    def fwd_step(*args):
        *arrays, offsets, forget_bias, cell_clip, use_peephole = args
        name, scalar = CTYPES[arrays[0].dtype]
        batch, units = arrays[2].shape  # cs_prev
        getattr(lib, f"fwd_step_{name}")(
            *map(_ptr, arrays), batch, units, *offsets,
            scalar(forget_bias), scalar(cell_clip), int(use_peephole),
        )  # fmt: skip

    def bwd_step(*args):
        *arrays, offsets, use_peephole = args
        name, _ = CTYPES[arrays[0].dtype]
        batch, units = arrays[0].shape  # cs_prev
        getattr(lib, f"bwd_step_{name}")(
            *map(_ptr, arrays), batch, units, *offsets, int(use_peephole)
        )

    backend = types.SimpleNamespace(
        **{k: getattr(backend_numpy, k) for k in ("xp", "asarray", "cast", "to_host", "to_device")}
    )
    backend.name = "host-shim"
    backend.fwd_step, backend.bwd_step = fwd_step, bwd_step
    return backend
