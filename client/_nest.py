"""Nested structures of tensors, as ``tf.nest`` flattens and packs them.

``tape.gradient`` takes targets and sources as TensorFlow does: one tensor, or lists,
tuples (named tuples too) and mappings of them, nested; the gradients come back in the
sources' structure. Mappings flatten in sorted key order (TensorFlow's rule, so that
two dicts with the same keys line up whatever order they were built in) and pack back
in their own key order.

Leaves are everything else, including the SDK's own named tuples (``StepOutput``, a
batch placeholder; ``TensorArrayHandle``), which stand for one tensor each, and NumPy
arrays.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gradserve.client._types import StepOutput, TensorArrayHandle

_LEAF_TUPLES = (StepOutput, TensorArrayHandle)


def is_nested(value: Any) -> bool:
    """A list, tuple or mapping to look into (not a tensor)."""
    if isinstance(value, _LEAF_TUPLES):
        return False
    return isinstance(value, (list, tuple, Mapping))


def _sorted_keys(mapping: Mapping[Any, Any]) -> list[Any]:
    try:
        return sorted(mapping)
    except TypeError:
        raise TypeError("nested structures support only mappings with sortable keys") from None


def _children(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [value[k] for k in _sorted_keys(value)]
    return list(value)


def flatten(structure: Any) -> list[Any]:
    """The leaves of ``structure`` in ``tf.nest.flatten``'s order."""
    return list(_leaves(structure))


def _leaves(value: Any) -> Iterator[Any]:
    if not is_nested(value):
        yield value
        return
    for child in _children(value):
        yield from _leaves(child)


def flatten_up_to(shallow: Any, value: Any) -> list[Any] | None:
    """``value``'s subtrees at the leaf positions of ``shallow`` (TensorFlow's
    ``nest.flatten_up_to``), or None where ``value`` does not have ``shallow``'s
    structure: an output gradient given for each target of a nested ``target`` may be a
    Python list itself, which ``flatten`` would take apart."""
    if not is_nested(shallow):
        return [value]
    if isinstance(shallow, Mapping):
        if not isinstance(value, Mapping) or set(value) != set(shallow):
            return None
    elif not isinstance(value, (list, tuple)) or isinstance(value, _LEAF_TUPLES):
        return None
    elif len(value) != len(shallow):
        return None
    out: list[Any] = []
    for s, v in zip(_children(shallow), _children(value)):
        part = flatten_up_to(s, v)
        if part is None:
            return None
        out.extend(part)
    return out


def pack_like(structure: Any, flat: Sequence[Any]) -> Any:
    """``flat`` (as many values as ``structure`` has leaves) in ``structure``'s shape:
    lists, tuples and named tuples of their own type, mappings with their own keys in
    their own order."""
    it = iter(flat)
    packed = _pack(structure, it)
    if next(it, _END) is not _END:
        raise ValueError("more values than the structure has leaves")
    return packed


_END = object()


def _pack(structure: Any, it: Iterator[Any]) -> Any:
    if not is_nested(structure):
        value = next(it, _END)
        if value is _END:
            raise ValueError("fewer values than the structure has leaves")
        return value
    if isinstance(structure, Mapping):
        by_key = {k: _pack(structure[k], it) for k in _sorted_keys(structure)}
        if isinstance(structure, collections.defaultdict):
            out: Any = collections.defaultdict(structure.default_factory)
        else:
            try:
                out = type(structure)()
                out.update({})
            except (TypeError, AttributeError):  # a read-only or exotic mapping
                out = {}
        for k in structure:
            out[k] = by_key[k]
        return out
    items = [_pack(child, it) for child in structure]
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*items)  # a named tuple
    return type(structure)(items)
