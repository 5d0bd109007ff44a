"""Where a long op may pause.

A long op (an LSTM, a gradient sweep) calls its ``check`` between steps. The check
raises once the op should stop (its deadline passed, its client went away); on a
server whose compute lane shares its slots between principals it may also *pause*
the op: give its slot to another principal's waiting op and block until its turn
comes again (``server/transport/lanes.py``), so one long op does not hold a slot
for as long as it runs. A pause is harmless where the op holds nothing another op
needs. Code that calls a check while it holds a lock (a TensorArray's gather or
concat, under the array's lock: another op of the session, given a slot, would wait
for the lock while holding that slot; the CUDA graph cache's build lock, which any
op's first call of a shape takes) or while it times itself (a timed run of the CPU
forward measuring its formulations) does it inside ``unpaused()``: the check may
still raise there, but never pauses.

What an op holds that others could use while it is paused it lends: code that holds
such a thing registers how to give it back and take it again with ``lent()`` (the
BLAS threads an op's share divides: a paused op kept its share from the op computing
in its place), and the lane wraps each pause in ``paused()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

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


@contextlib.contextmanager
def lent(give_back: Callable[[], None], take_again: Callable[[], None]) -> Iterator[None]:
    """In the block, a pause of this thread's op calls ``give_back`` before it waits
    and ``take_again`` once it goes on."""
    stack = _lent_stack()
    stack.append((give_back, take_again))
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """A pause of this thread's op: what it holds is lent in the block (last
    registered first), and taken again after, however the pause ends."""
    stack = list(_lent_stack())
    given: list[Callable[[], None]] = []
    try:
        for give_back, take_again in reversed(stack):
            give_back()
            given.append(take_again)
        yield
    finally:
        for take_again in reversed(given):
            take_again()


def _lent_stack() -> list[tuple[Callable[[], None], Callable[[], None]]]:
    stack = getattr(_state, "lent", None)
    if stack is None:
        stack = _state.lent = []
    return stack
