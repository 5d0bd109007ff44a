"""Where a long op may pause.

A long op (an LSTM, a gradient sweep) calls its ``check`` between steps. The check
raises once the op should stop (its deadline passed, its client went away); on a
server whose compute lane shares its slots between principals it may also *pause*
the op: give its slot to another principal's waiting op and block until its turn
comes again (``server/transport/lanes.py``), so one long op does not hold a slot
for as long as it runs. A pause is harmless where the op holds nothing another op
needs. Code that calls a check while it holds a lock (a TensorArray's gather or
concat, under the array's lock: another op of the session, given a slot, would wait
for the lock while holding that slot) or while it times itself (the CPU forward
measuring its formulations) does it inside ``unpaused()``: the check may still
raise there, but never pauses.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


@contextlib.contextmanager
def unpaused() -> Iterator[None]:
    """Checks called on this thread inside the block never pause."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def may_pause() -> bool:
    """Whether a check called on this thread now may pause its op."""
    return getattr(_state, "depth", 0) == 0
