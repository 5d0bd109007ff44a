"""Which gradient array TensorArrayGradV3 made for which (forward handle, ``source``).

TensorFlow keeps the grad arrays in the resource manager under the forward array's
name and the source (``tensor_array_ops.cc``, ``TensorArrayGradOp``). A session here
keeps them in a ``GradRegistry``, indexed three ways so that what a session does often
costs what it touches, not what the session holds:

- the lookup of TensorArrayGradV3: by key;
- forgetting an array (``Session.close_tensor_array`` past its closed arrays' bound):
  the keys that name it, as forward or as grad;
- a gradient computation's end (``Session.drop_grad_arrays``) and the choice of a
  fresh source (``Session.new_gradient_source``): by source.

A single dict scanned for each of the last two made every close past the bound cost
the number of grad arrays in the session: a client with 100,000 arrays and their
grads closing them one by one held the session's lock (and the interpreter) for
O(n^2) dict steps.

Not thread-safe: the session's lock guards it, as it guards the session's other
tables.
"""

from __future__ import annotations

from collections.abc import Iterable

#: (forward array's handle, source).
GradKey = tuple[str, str]


class GradRegistry:
    """(forward handle, source) -> grad array handle, with its reverse indexes."""

    def __init__(self, entries: Iterable[tuple[GradKey, str]] = ()) -> None:
        self._grad_of: dict[GradKey, str] = {}
        #: Forward or grad handle -> the keys that name it.
        self._keys_naming: dict[str, set[GradKey]] = {}
        #: Source -> its keys.
        self._keys_of_source: dict[str, set[GradKey]] = {}
        for key, grad in entries:
            self.add(key, grad)

    def __len__(self) -> int:
        return len(self._grad_of)

    def __contains__(self, key: object) -> bool:
        return key in self._grad_of

    def get(self, key: GradKey) -> str | None:
        return self._grad_of.get(key)

    def as_dict(self) -> dict[GradKey, str]:
        return dict(self._grad_of)

    def has_source(self, source: str) -> bool:
        return source in self._keys_of_source

    def add(self, key: GradKey, grad: str) -> None:
        """Register ``grad`` as the gradient array of ``key`` (replacing any other)."""
        if key in self._grad_of:
            self._remove(key)
        forward, source = key
        self._grad_of[key] = grad
        for handle in (forward, grad):
            self._keys_naming.setdefault(handle, set()).add(key)
        self._keys_of_source.setdefault(source, set()).add(key)

    def forget_array(self, handle: str) -> None:
        """Drop every entry naming ``handle``, as forward or as grad (the arrays stay:
        a forgotten forward's grad is an array of its own from then on)."""
        for key in list(self._keys_naming.get(handle, ())):
            self._remove(key)

    def pop_grads_of(self, forward: str) -> list[str]:
        """Drop every entry of ``forward`` (as forward array); returns their grad
        handles."""
        keys = [key for key in self._keys_naming.get(forward, ()) if key[0] == forward]
        return [self._remove(key) for key in keys]

    def pop_source(self, source: str) -> list[str]:
        """Drop every entry of ``source``; returns their grad handles."""
        keys = list(self._keys_of_source.get(source, ()))
        return [self._remove(key) for key in keys]

    def clear(self) -> None:
        self._grad_of.clear()
        self._keys_naming.clear()
        self._keys_of_source.clear()

    def _remove(self, key: GradKey) -> str:
        grad = self._grad_of.pop(key)
        forward, source = key
        for index, name in (
            (self._keys_naming, forward),
            (self._keys_naming, grad),
            (self._keys_of_source, source),
        ):
            keys = index.get(name)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del index[name]
        return grad
