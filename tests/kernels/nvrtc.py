"""Compile CUDA C to a cubin with NVRTC through ctypes: no GPU, driver or CuPy needed.

Finds libnvrtc in the ``nvidia-cuda-nvrtc`` wheel (``nvidia/cu*/lib``) or on the
system library path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os


def find_library() -> str | None:
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations) if spec else []:
        found = sorted(glob.glob(os.path.join(root, "cu*", "lib", "libnvrtc.so*")))
        found = [f for f in found if "builtins" not in f]
        if found:
            return found[0]
    return ctypes.util.find_library("nvrtc")


class NvrtcError(RuntimeError):
    pass


def compile_cubin(
    source: str, name_expressions: list[str], arch: str = "sm_90", options: tuple[str, ...] = ()
) -> tuple[bytes, dict[str, str]]:
    """(cubin, {name expression: lowered name}); raises NvrtcError with the log."""
    path = find_library()
    if path is None:
        raise FileNotFoundError("libnvrtc not found (pip install nvidia-cuda-nvrtc)")
    lib = ctypes.CDLL(path)
    prog = ctypes.c_void_p()

    def check(status: int, what: str) -> None:
        if status != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")

    check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        for expr in name_expressions:
            check(lib.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        opts = [f"-arch={arch}".encode(), *(o.encode() for o in options)]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        status = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(log.value.decode(errors="replace"))
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        lowered = {}
        for expr in name_expressions:
            name = ctypes.c_char_p()
            check(
                lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(name)),
                "nvrtcGetLoweredName",
            )
            lowered[expr] = name.value.decode()
        return cubin.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
