"""The gradserve client SDK."""

from gradserve.client._batch import Batch
from gradserve.client._client import Client
from gradserve.client._tape import GradientTape
from gradserve.client._tensor_array import TensorArray
from gradserve.client._types import StepOutput, TapedArray, TensorArrayHandle, TensorRef

__all__ = [
    "Batch",
    "Client",
    "GradientTape",
    "StepOutput",
    "TapedArray",
    "TensorArray",
    "TensorArrayHandle",
    "TensorRef",
]
