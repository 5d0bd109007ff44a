"""Per-call translation between wire messages and arrays, inside one session.

``CallIO`` resolves a ``TensorInput`` (inline value or resident id) to an
array and fills a ``TensorOutput`` (inline, or kept in the session when the
request asked to keep outputs or the value is over the caller's inline limit).

Resident tensors live where the ops that use them compute: on a CUDA server the
LSTM ops' outputs are kept as GPU arrays, and a tensor uploaded with PutTensor
moves to the GPU the first time an LSTM op reads it, so a backward that names
activations or weights by id reads them without a host round trip. Only what
crosses the wire, or feeds an op that computes on the host (TensorArray,
StopGradient), is copied to host memory, through ``host_array``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from gradserve import codec, dtypes
from gradserve.errors import InvalidArgumentError
from gradserve.server.transport import observability
from gradserve.server.core.sessions import Session
from gradserve.v1 import tensor_array_pb2, tensor_pb2


def _never_stop() -> None:
    return None


class CallIO:
    """Inputs and outputs of one op call in ``session``.

    ``compute`` is what ops compute with (``kernels.compute.Compute``); ``check_alive`` raises
    once the call is cancelled or past its deadline (long ops call it between
    steps).
    """

    def __init__(
        self,
        session: Session,
        inline_limit: int,
        compute=None,
        check_alive: Callable[[], None] = _never_stop,
    ) -> None:
        self.session = session
        self.inline_limit = inline_limit
        self.compute = compute
        self.check_alive = check_alive

    def input(self, msg: tensor_pb2.TensorInput, field: str, *, as_kept: bool = False):
        """The input as a host array; with ``as_kept``, for ops that compute on the
        backend, a resident tensor comes as the session keeps it (host or GPU array)."""
        which = msg.WhichOneof("source")
        if which == "value":
            started = time.perf_counter()
            array = codec.decode(msg.value, field=field)
            observability.add_decode_time(time.perf_counter() - started)
            return array
        if which == "ref":
            array = self.session.get(msg.ref)
            return array if as_kept else host_array(self.compute, array)
        raise InvalidArgumentError(f"input '{field}' is required", field=field)

    def place(self, msgs: dict[str, tensor_pb2.TensorInput], inputs: dict) -> dict:
        """``inputs`` with the resident ones moved to the compute device and kept there,
        so a tensor put once is copied to the GPU once (``Session.get_placed``).

        Ops call this after validating, so an input they refuse is not moved."""
        if self.compute is None:
            return inputs
        placed = dict(inputs)
        for name, msg in msgs.items():
            if msg.WhichOneof("source") == "ref":
                placed[name] = self.session.get_placed(msg.ref, self.compute.to_device)
        return placed

    def output(self, array, out: tensor_pb2.TensorOutput, keep: bool) -> None:
        """Kept (as it is, host or device array) or encoded inline (from host memory)."""
        if not hasattr(array, "__cuda_array_interface__"):  # scalars, lists: as NumPy
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
            array = host_array(self.compute, array)
            started = time.perf_counter()
            codec.encode(array, out.value)
            observability.add_encode_time(time.perf_counter() - started)


def host_array(compute, array) -> np.ndarray:
    """``array`` in host memory (a copy only if it is a device array); ``compute`` is
    anything with ``to_host`` (a ``Compute`` or a backend module), or None."""
    return np.asarray(array) if compute is None else compute.to_host(array)


def handle_id(msg: tensor_array_pb2.TensorArrayHandle, field: str = "handle") -> str:
    if not msg.id:
        raise InvalidArgumentError(f"'{field}' is required", field=field)
    return msg.id


def dtype_of(enum: int, field: str = "dtype") -> np.dtype:
    try:
        return dtypes.from_enum(enum)
    except dtypes.UnsupportedDTypeError as e:
        raise InvalidArgumentError(f"{field}: {e}", field=field) from None
