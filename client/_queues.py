"""Queues that finalizers append to: a garbage collection runs a finalizer on any
thread, inside whatever the thread was doing (maybe holding a lock it would take), so
a finalizer only appends to a ``collections.deque`` (atomic), and a later call takes
what is there (``take_all``)."""

from __future__ import annotations

import collections
from typing import TypeVar

T = TypeVar("T")


def take_all(queue: collections.deque[T]) -> list[T]:
    """Every item of ``queue``, taken one at a time (never by iterating it: a finalizer
    may append meanwhile, or another taker take some first)."""
    items: list[T] = []
    while True:
        try:
            items.append(queue.popleft())
        except IndexError:
            return items
