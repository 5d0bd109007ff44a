"""Shared-memory tensors in op calls: ``SharedTensor`` inputs read, outputs written.

The transport half of ``core.regions``: a ``TensorInput.shared`` is read into a new
array (``CallIO.tensor``), and when the call names an output region
(``x-gradserve-output-region``), the outputs it returns are written there one after
another (``OutputArena``) instead of inline. An output that does not fit, a string,
or one whose region broke meanwhile (truncated, unlinked) comes back as usual —
inline or transient — so a result is never lost to the region.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradserve import codec, dtypes, protocol
from gradserve.errors import GradserveError
from gradserve.protocol import OUTPUT_REGION_METADATA_KEY
from gradserve.server.core.sessions import Session
from gradserve.v1 import tensor_pb2

#: Outputs start at multiples of this in an output region (cache lines, SIMD loads).
ALIGN = 64


def read_tensor(session: Session, msg: tensor_pb2.SharedTensor, field: str) -> np.ndarray:
    """A copy of the tensor ``msg`` names in one of ``session``'s regions."""
    dtype = codec.dtype_from_enum(msg.dtype, field=f"{field}.dtype")
    return session.regions.read(msg.region, msg.offset, dtype, tuple(msg.shape), field)


def fill(msg: tensor_pb2.SharedTensor, region: str, offset: int, array: Any) -> None:
    msg.region = region
    msg.offset = offset
    msg.dtype = codec.dtype_to_enum(array.dtype)
    msg.shape[:] = array.shape


class OutputArena:
    """The region a call writes its returned outputs into, after its nonce."""

    def __init__(self, session: Session, region: str) -> None:
        self.session = session
        self.region = region
        self.size = session.regions.byte_size(region)  # NOT_FOUND now, not per output
        self.offset = protocol.SHM_RESERVED_BYTES  # past the region's nonce
        self.broken = False

    def end_of(self, array: Any, offset: int) -> int | None:
        """Where ``array`` would end if written at the first aligned offset from
        ``offset``; None if it would not be written (``write``'s refusals but a failure
        of the region itself)."""
        if self.broken or array.dtype == dtypes.STRING:
            return None
        start = -(-offset // ALIGN) * ALIGN
        return start + array.nbytes if start + array.nbytes <= self.size else None

    def write(self, array: np.ndarray, out: tensor_pb2.TensorOutput) -> bool:
        """Write host array ``array`` at the next free offset and point ``out`` at it;
        False (nothing written) when it does not fit, is a string tensor, or the region
        failed (it is then not used again in this call)."""
        end = self.end_of(array, self.offset)
        if end is None:
            return False
        start = end - array.nbytes
        try:
            self.session.regions.write(self.region, start, array, "output")
        except GradserveError:
            self.broken = True
            return False
        self.offset = start + array.nbytes
        fill(out.shared, self.region, start, array)
        return True


def output_arena(session: Session, metadata: dict[str, str]) -> OutputArena | None:
    """The call's output region, if its metadata names one."""
    name = metadata.get(OUTPUT_REGION_METADATA_KEY)
    return OutputArena(session, name) if name else None
