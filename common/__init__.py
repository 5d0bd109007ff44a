"""gradserve: TensorFlow's gradient ops (TensorArray, StopGradient, BlockLSTM) as a gRPC service.

``gradserve.Client`` is the SDK entry point; ``gradserve.errors`` holds the
exception classes (named like TensorFlow's); ``gradserve.server`` runs the
service; ``gradserve.kernels`` holds the array math.
"""

from gradserve import errors
from gradserve.client import Client, TensorArray, TensorArrayHandle, TensorRef

__version__ = "0.1.0"

__all__ = ["Client", "TensorArray", "TensorArrayHandle", "TensorRef", "errors", "__version__"]
