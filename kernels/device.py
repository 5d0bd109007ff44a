"""Which device the math runs on: ``--device auto|cpu|cuda``."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: The reason when CuPy is simply absent: the normal state of a CPU install.
NOT_INSTALLED = "CuPy is not installed (pip install 'gradserve[cuda]')"


def cuda_unavailable_reason() -> str | None:
    """None when CuPy imports and sees at least one CUDA device; else why not.

    Any failure counts, not only a missing CuPy: an installed CuPy can also fail
    to import (its kernel cache directory not writable, a broken CUDA library),
    and the server must say so rather than die with a traceback.
    """
    try:
        import cupy
    except ImportError:
        return NOT_INSTALLED
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"CuPy failed to import: {type(exc).__name__}: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device: all mean "no"
        return f"CuPy sees no CUDA device: {exc}"
    return None if count > 0 else "CuPy sees no CUDA device"


def select_device(requested: str) -> str:
    """Resolve ``requested`` to "cpu" or "cuda"; "cuda" without a usable GPU is an error.

    ``auto`` falls back to the CPU, with a warning naming the reason when CuPy is
    installed but unusable (a GPU image that silently served on the CPU would
    be found only by its speed).
    """
    if requested == "cpu":
        return "cpu"
    if requested not in ("cuda", "auto"):
        raise ValueError(f"unknown device {requested!r}: expected auto, cpu or cuda")
    reason = cuda_unavailable_reason()
    if reason is None:
        return "cuda"
    if requested == "cuda":
        raise RuntimeError(f"--device cuda: {reason}")
    if reason != NOT_INSTALLED:
        log.warning("--device auto: serving on the CPU because %s", reason)
    return "cpu"
