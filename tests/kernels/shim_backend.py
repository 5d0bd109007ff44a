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
    def fwd_step(
        gates_h,
        b,
        cs_prev,
        wci,
        wcf,
        wco,
        i,
        cs,
        f,
        o,
        ci,
        co,
        h,
        offsets,
        forget_bias,
        cell_clip,
        use_peephole,
    ):
        name, scalar = CTYPES[gates_h.dtype]
        batch, units = cs_prev.shape
        getattr(lib, f"fwd_step_{name}")(
            *map(_ptr, (gates_h, b, cs_prev, wci, wcf, wco, i, cs, f, o, ci, co, h)),
            batch,
            units,
            *offsets,
            scalar(forget_bias),
            scalar(cell_clip),
            int(use_peephole),
        )

    def bwd_step(
        cs_prev,
        i,
        f,
        o,
        ci,
        co,
        cs_grad,
        h_grad,
        dh_carry,
        dcs_carry,
        wci,
        wcf,
        wco,
        dgates,
        offsets,
        use_peephole,
    ):
        name, _ = CTYPES[i.dtype]
        batch, units = i.shape
        getattr(lib, f"bwd_step_{name}")(
            *map(
                _ptr,
                (
                    cs_prev,
                    i,
                    f,
                    o,
                    ci,
                    co,
                    cs_grad,
                    h_grad,
                    dh_carry,
                    dcs_carry,
                    wci,
                    wcf,
                    wco,
                    dgates,
                ),
            ),
            batch,
            units,
            *offsets,
            int(use_peephole),
        )

    backend = types.SimpleNamespace(
        **{
            k: getattr(backend_numpy, k)
            for k in ("xp", "compute_dtype", "asarray", "cast", "to_host")
        }
    )
    backend.name = "host-shim"
    backend.fwd_step, backend.bwd_step = fwd_step, bwd_step
    return backend
