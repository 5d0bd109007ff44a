"""What holds an array's memory, for tests of zero-copy paths."""

from __future__ import annotations

import numpy as np


def memory_owner(array: np.ndarray) -> object:
    """The object whose memory ``array`` views, through views and memoryviews: the
    received ``bytes`` of a wire view, a ``Pinned`` region of a zero-copy get, or the
    array itself when it owns its data."""
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base
