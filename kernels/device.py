"""Which device the math runs on: ``--device auto|cpu|cuda``."""

from __future__ import annotations


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device: all mean "no"
        return False


def select_device(requested: str) -> str:
    """Resolve ``requested`` to "cpu" or "cuda"; "cuda" without a GPU is an error."""
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        if not cuda_available():
            raise RuntimeError("--device cuda: CuPy is not installed or sees no CUDA device")
        return "cuda"
    if requested == "auto":
        return "cuda" if cuda_available() else "cpu"
    raise ValueError(f"unknown device {requested!r}: expected auto, cpu or cuda")
