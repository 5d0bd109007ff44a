"""gradserve: TensorFlow's gradient ops (TensorArray, StopGradient, BlockLSTM) as a gRPC service.

``gradserve.Client`` is the SDK entry point; ``gradserve.errors`` holds the
exception classes (named like TensorFlow's); ``gradserve.server`` runs the
service; ``gradserve.kernels`` holds the array math.

The SDK names below are loaded on first use (PEP 562), so importing a layer
that needs none of them — the server's domain core, the kernels — loads no
gRPC and no SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gradserve import errors
    from gradserve.client import (
        Client,
        GradientTape,
        StepOutput,
        TapedArray,
        TensorArray,
        TensorArrayHandle,
        TensorRef,
    )

#: Public name -> the module that defines it.
_LAZY = {
    "Client": "gradserve.client",
    "GradientTape": "gradserve.client",
    "StepOutput": "gradserve.client",
    "TapedArray": "gradserve.client",
    "TensorArray": "gradserve.client",
    "TensorArrayHandle": "gradserve.client",
    "TensorRef": "gradserve.client",
    "errors": "gradserve.errors",
}

__all__ = [
    "Client",
    "GradientTape",
    "StepOutput",
    "TapedArray",
    "TensorArray",
    "TensorArrayHandle",
    "TensorRef",
    "errors",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradserve' has no attribute {name!r}")
    value = importlib.import_module(module)
    return value if name == "errors" else getattr(value, name)


def __dir__() -> list[str]:
    return sorted(__all__)
