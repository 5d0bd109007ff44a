"""Small value types the SDK hands out: resident tensor refs, TensorArray handles."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from gradserve.client._client import Client


class TensorArrayHandle(NamedTuple):
    """A TensorArray in the session: ``id`` is the key, ``name`` TensorFlow's name."""

    id: str
    name: str


class TensorRef:
    """A tensor held in the session; usable anywhere an array is accepted.

    ``numpy()`` fetches it; ``delete()`` frees it on the server.
    """

    __slots__ = ("id", "dtype", "shape", "_client")

    def __init__(self, client: Client, tensor_id: str, dtype: np.dtype, shape: tuple[int, ...]):
        self.id = tensor_id
        self.dtype = dtype
        self.shape = shape
        self._client = client

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def numpy(self) -> np.ndarray:
        return self._client.get(self)

    def delete(self) -> None:
        self._client.delete(self)

    def __repr__(self) -> str:
        return f"TensorRef(id={self.id[:8]}…, dtype={self.dtype}, shape={self.shape})"
