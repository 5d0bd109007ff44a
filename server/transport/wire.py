"""Per-call translation between wire messages and arrays, inside one session.

``CallIO`` turns a ``TensorInput`` into an op argument (a decoded array, or a
``Resident`` id the op resolves) and fills a ``TensorOutput``: inline, or kept
in the session when the request asked to keep outputs, or as a *transient*
resident tensor (fetched by stream, then deleted) when the value would not fit
in the response. The response's inline bytes are budgeted per call (a ``Batch``
is one call): every output that fits goes inline, the rest go transient, so a
response never grows past ``--max-message-bytes`` after its side effects ran.

Resident tensors live where the ops that use them compute: on a CUDA server the
LSTM ops' outputs are kept as GPU arrays, and a tensor uploaded with PutTensor
moves to the GPU the first time an LSTM op reads it, so a backward that names
activations or weights by id reads them without a host round trip. Only what
crosses the wire, or feeds an op that computes on the host (TensorArray,
StopGradient), is copied to host memory, through ``host_array``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gradserve import codec, dtypes, protocol
from gradserve.errors import InvalidArgumentError
from gradserve.kernels.compute import Compute
from gradserve.server.core.sessions import Resident, Session, TensorArg
from gradserve.server.transport import observability
from gradserve.v1 import tensor_array_pb2, tensor_pb2


def _never_stop() -> None:
    return None


#: Encoded size of a ``TensorOutput`` holding a ref (id, dtype, shape): an upper bound
#: for ranks up to 8.
REF_BYTES = 160


class CallIO:
    """Inputs and outputs of one call (one op, or every step of a Batch) in ``session``.

    ``response_left`` is how many bytes the response may still grow by: an output
    goes inline only if it fits (counting its encoding), and is sent transient
    otherwise; ``settle`` replaces the estimates of a finished Batch step by its
    result's exact size. An output is also sent transient when it alone is at least
    ``inline_limit`` bytes (the client's ``x-gradserve-inline-limit``: it streams
    large tensors). ``check_alive`` raises once the call is cancelled or past its
    deadline (long ops call it between steps). ``run`` runs one op so that a failure
    leaves no output of it behind.
    """

    def __init__(
        self,
        session: Session,
        compute: Compute,
        *,
        inline_budget: int,
        inline_limit: int | None = None,
        check_alive: Callable[[], None] = _never_stop,
    ) -> None:
        self.session = session
        self.compute = compute
        self.response_left = inline_budget
        self.inline_limit = inline_budget if inline_limit is None else inline_limit
        self.check_alive = check_alive
        self._kept: list[str] = []  # ids stored by the op running now
        #: Every id this call stored (kept or transient outputs): if the call ends
        #: without its response reaching the client, they are deleted
        #: (``forget_outputs``), since nobody else knows them.
        self.stored: list[str] = []
        self._over = False  # the call ended without its response: store nothing more
        self._lock = threading.Lock()

    def run(self, handler: Callable[[CallIO, Any], Any], request: Any) -> Any:
        """``handler(self, request)``; if it raises, the outputs it already stored in the
        session (kept or transient) are deleted: a failed op hands out no id, so none
        may stay behind holding bytes."""
        self._kept = []
        try:
            response = handler(self, request)
            with self._lock:
                if not self._over:
                    self.stored += self._kept
                    return response
            # The call ended while the op ran: no one will learn these ids.
            self.session.delete(self._kept)
            return response
        except BaseException:
            self.session.delete(self._kept)
            raise
        finally:
            self._kept = []

    def forget_outputs(self) -> None:
        """Delete what this call stored, and what its op still stores: its response did
        not reach the client."""
        with self._lock:
            self._over = True
            stored, self.stored = self.stored, []
        if stored:
            self.session.delete(stored)

    def settle(self, before: int, result_bytes: int) -> None:
        """After a Batch step: the response grew by ``result_bytes`` (its result, and
        the few bytes that wrap it) since ``response_left`` was ``before``."""
        self.response_left = before - result_bytes - 8

    def tensor(self, msg: tensor_pb2.TensorInput, field: str) -> TensorArg:
        """An op argument: the inline value decoded, or the resident tensor's id."""
        which = msg.WhichOneof("source")
        if which == "value":
            started = time.perf_counter()
            array = codec.decode(msg.value, field=field)
            observability.add_decode_time(time.perf_counter() - started)
            return array
        if which == "ref":
            return Resident(msg.ref)
        raise InvalidArgumentError(f"input '{field}' is required", field=field)

    def input(self, msg: tensor_pb2.TensorInput, field: str) -> np.ndarray:
        """The input as a host array (for ops that compute on the host)."""
        return host_array(self.compute, self.session.resolve(self.tensor(msg, field)))

    def output(self, array: Any, out: tensor_pb2.TensorOutput, keep: bool) -> None:
        """Kept (as it is, host or device array), inline (from host memory) when it fits
        the response, else transient."""
        if not hasattr(array, "__cuda_array_interface__"):  # scalars, lists: as NumPy
            array = np.asarray(array)
        nbytes = dtypes.nbytes(array)  # a pass over a string tensor: once
        size = protocol.encoded_size(nbytes, array.ndim)
        transient = not keep and (
            nbytes >= self.inline_limit or size > self.response_left - REF_BYTES
        )
        if keep or transient:
            ref = out.ref
            ref.id = self.session.put(array, nbytes)
            self._kept.append(ref.id)
            ref.dtype = codec.dtype_to_enum(array.dtype)
            ref.shape[:] = array.shape
            ref.transient = transient
            self.response_left -= REF_BYTES
            return
        self.response_left -= size
        array = host_array(self.compute, array)
        started = time.perf_counter()
        codec.encode(array, out.value)
        observability.add_encode_time(time.perf_counter() - started)


def host_array(compute: Compute, array: Any) -> np.ndarray:
    """``array`` in host memory (a copy only if it is a device array)."""
    return compute.to_host(array)


def handle_id(msg: tensor_array_pb2.TensorArrayHandle, field: str = "handle") -> str:
    if not msg.id:
        raise InvalidArgumentError(f"'{field}' is required", field=field)
    return msg.id


def dtype_of(enum: int, field: str = "dtype") -> np.dtype:
    """The dtype a request names, or INVALID_ARGUMENT naming the field."""
    return codec.dtype_from_enum(enum, field=field)
