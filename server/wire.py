"""Per-call translation between wire messages and arrays, inside one session.

``CallIO`` resolves a ``TensorInput`` (inline value or resident id) to an
array and fills a ``TensorOutput`` (inline, or kept in the session when the
request asked to keep outputs or the value is over the caller's inline limit).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from gradserve import codec, dtypes
from gradserve.errors import InvalidArgumentError
from gradserve.server import observability
from gradserve.server.sessions import Session
from gradserve.v1 import tensor_array_pb2, tensor_pb2


def _never_stop() -> None:
    return None


class CallIO:
    """Inputs and outputs of one op call in ``session``.

    ``backend`` is the array backend ops compute on; ``check_alive`` raises
    once the call is cancelled or past its deadline (long ops call it between
    steps).
    """

    def __init__(
        self,
        session: Session,
        inline_limit: int,
        backend=None,
        check_alive: Callable[[], None] = _never_stop,
    ) -> None:
        self.session = session
        self.inline_limit = inline_limit
        self.backend = backend
        self.check_alive = check_alive

    def input(self, msg: tensor_pb2.TensorInput, field: str) -> np.ndarray:
        which = msg.WhichOneof("source")
        if which == "value":
            started = time.perf_counter()
            array = codec.decode(msg.value, field=field)
            observability.add_decode_time(time.perf_counter() - started)
            return array
        if which == "ref":
            return self.session.get(msg.ref)
        raise InvalidArgumentError(f"input '{field}' is required", field=field)

    def output(self, array: np.ndarray, out: tensor_pb2.TensorOutput, keep: bool) -> None:
        array = np.asarray(array)
        transient = not keep and array.nbytes > self.inline_limit
        if keep or transient:
            tensor_id = self.session.put(array)
            ref = out.ref
            ref.id = tensor_id
            ref.dtype = dtypes.to_enum(array.dtype)
            ref.shape[:] = array.shape
            ref.transient = transient
        else:
            started = time.perf_counter()
            codec.encode(array, out.value)
            observability.add_encode_time(time.perf_counter() - started)


def handle_id(msg: tensor_array_pb2.TensorArrayHandle, field: str = "handle") -> str:
    if not msg.id:
        raise InvalidArgumentError(f"'{field}' is required", field=field)
    return msg.id


def dtype_of(enum: int, field: str = "dtype") -> np.dtype:
    try:
        return dtypes.from_enum(enum)
    except dtypes.UnsupportedDTypeError as e:
        raise InvalidArgumentError(f"{field}: {e}", field=field) from None
