"""A stand-in ``cupy`` module: NumPy arrays, and a ``RawModule`` whose kernels are the
host-shim build of ``kernels/lstm.cu``.

Importing ``gradserve.kernels.backend_cuda`` against it runs that module's real
Python code — RawModule set-up, name expressions, argument order and scalar
types of every launch — on the CPU, so a marshalling mistake fails in CI rather
than on the first GPU run.
"""

from __future__ import annotations

import ctypes
import re
import types

import numpy as np


def make_fake_cupy(shim_lib: ctypes.CDLL) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    for name in ("asarray", "ascontiguousarray", "zeros", "empty", "matmul", "ndarray"):
        setattr(cupy, name, getattr(np, name))
    cupy.asnumpy = np.asarray
    compiled: list[dict] = []
    lookups: list[str] = []

    class RawKernel:
        def __init__(self, expression: str) -> None:
            kernel, ctype = re.fullmatch(r"(\w+)<(\w+)>", expression).groups()
            short = kernel.removeprefix("lstm_")
            self.function = getattr(shim_lib, f"{short}_{ctype}")
            self.scalar = ctypes.c_float if ctype == "float" else ctypes.c_double
            self.launches = 0

        def __call__(self, grid, block, args):
            assert len(grid) == 1 and len(block) == 1 and grid[0] >= 1 and block[0] >= 1
            converted = []
            for a in args:
                if isinstance(a, np.ndarray):
                    assert a.flags.c_contiguous
                    converted.append(ctypes.c_void_p(a.ctypes.data))
                elif isinstance(a, np.int32):
                    converted.append(int(a))
                elif isinstance(a, (np.float32, np.float64)):
                    expected = np.float32 if self.scalar is ctypes.c_float else np.float64
                    assert type(a) is expected, f"scalar {type(a)} for a {self.scalar} kernel"
                    converted.append(self.scalar(a))
                else:
                    raise TypeError(f"unexpected kernel argument {type(a)}")
            self.launches += 1
            self.function(*converted)

    class RawModule:
        def __init__(self, code, options=(), name_expressions=()):
            assert "lstm_fwd_step" in code
            self.names = list(name_expressions)
            compiled.append({"options": options, "names": self.names})

        def compile(self):
            return None

        def get_function(self, name):
            assert name in self.names, name
            lookups.append(name)
            return RawKernel(name)

    class Device:
        id = 0

    cupy.RawModule = RawModule
    cupy.cuda = types.SimpleNamespace(Device=Device)
    cupy.compiled = compiled
    cupy.lookups = lookups
    return cupy
