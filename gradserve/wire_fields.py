"""How many fields a serialized message holds, counted without parsing it.

Protobuf's parser turns every field into an object or an array element of its
own: a 10 MB ``BatchRequest`` of empty steps took 220 MB and 0.16 s to parse,
a ``DeleteTensorRequest`` of one-letter ids the same, with Python's lock held all
along. At the server's 256 MiB message limit that is ~6 GB and seconds of an event
loop every call waits on. The server therefore counts a request's fields first
(``check_field_count``) and refuses one holding more than ``MAX_REQUEST_FIELDS``; the
SDK splits what it sends (deletes, batches) to stay under it.

The count walks the wire format as the message's descriptor says: a
length-delimited field of message type is entered, one of bytes or strings is
skipped whole (a tensor's content costs one step, whatever its size), and a packed
run of numbers counts each element. Malformed data stops the walk; the parser that
follows refuses it as it always did.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from gradserve import protocol

#: Counting costs a turn of Python per field, ~20 ms for a request at the limit on a
#: 2-core machine; what the SDK sends stays far below it (a tensor is ~6 fields
#: whatever its size), splitting deletes and batches that would not.
MAX_REQUEST_FIELDS = protocol.MAX_REQUEST_FIELDS

_MESSAGE = FieldDescriptor.TYPE_MESSAGE
_FIXED_WIDTHS = {
    FieldDescriptor.TYPE_DOUBLE: 8,
    FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_FLOAT: 4,
    FieldDescriptor.TYPE_FIXED32: 4,
    FieldDescriptor.TYPE_SFIXED32: 4,
}
_LENGTH_DELIMITED = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, _MESSAGE)


class TooManyFieldsError(ValueError):
    """The message holds more fields than the limit allows."""


def _kinds(descriptor: Any) -> dict[int, Any]:
    """Field number -> the message descriptor to enter, a fixed width (a packed run of
    fixed-width numbers), 0 (a packed run of varints) or None (bytes, a string)."""
    kinds: dict[int, Any] = {}
    for field in descriptor.fields:
        if field.type == _MESSAGE:
            kinds[field.number] = field.message_type
        elif field.type in _LENGTH_DELIMITED:
            kinds[field.number] = None
        else:
            kinds[field.number] = _FIXED_WIDTHS.get(field.type, 0)
    return kinds


def _too_many(limit: int) -> TooManyFieldsError:
    return TooManyFieldsError(
        f"the request holds more than {limit} fields (elements of repeated fields "
        "included): send it in parts"
    )


_KINDS: dict[Any, dict[int, Any]] = {}


def _kinds_of(descriptor: Any) -> dict[int, Any]:
    kinds = _KINDS.get(descriptor)
    if kinds is None:
        kinds = _KINDS[descriptor] = _kinds(descriptor)
    return kinds


def check_field_count(
    data: bytes | memoryview, descriptor: Any, limit: int = MAX_REQUEST_FIELDS
) -> None:
    """Raise ``TooManyFieldsError`` if ``data``, a serialized message of
    ``descriptor``'s type, holds more than ``limit`` fields."""
    if len(data) > limit:  # a field takes a byte at least: a shorter one cannot
        count_fields(data, descriptor, limit)


def count_fields(data: bytes | memoryview, descriptor: Any, limit: int = MAX_REQUEST_FIELDS) -> int:
    """The fields of ``data``, a serialized message of ``descriptor``'s type, at every
    depth; raises ``TooManyFieldsError`` as soon as they pass ``limit``. Stops at
    malformed data (counting what it saw): the parser refuses it."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    count = 0
    stack = [(_kinds_of(descriptor), 0, len(view))]
    while stack:
        kinds, pos, end = stack.pop()
        while pos < end:
            # The key: a varint.
            byte = view[pos]
            pos += 1
            key = byte & 0x7F
            shift = 7
            while byte & 0x80:
                if pos >= end or shift > 63:
                    return count
                byte = view[pos]
                pos += 1
                key |= (byte & 0x7F) << shift
                shift += 7
            count += 1
            if count > limit:
                raise _too_many(limit)
            wire_type = key & 7
            if wire_type == 0:
                while pos < end and view[pos] & 0x80:
                    pos += 1
                pos += 1
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                byte = view[pos] if pos < end else 0
                pos += 1
                length = byte & 0x7F
                shift = 7
                while byte & 0x80:
                    if pos >= end or shift > 63:
                        return count
                    byte = view[pos]
                    pos += 1
                    length |= (byte & 0x7F) << shift
                    shift += 7
                stop = pos + length
                if stop > end:
                    return count
                kind = kinds.get(key >> 3)
                if kind is None or not length:
                    pass  # bytes, a string, a field this version does not know, empty
                elif isinstance(kind, int):
                    # A packed run of numbers, each an element: fixed-width ones, or
                    # varints, of 1 to 10 bytes each, each ending in a byte below 0x80.
                    if kind:
                        count += length // kind
                    elif length > 10 * (limit - count):
                        count += length // 10
                    else:
                        run = np.frombuffer(view, np.uint8, length, pos)
                        count += int(np.count_nonzero(run < 0x80))
                    if count > limit:
                        raise _too_many(limit)
                else:
                    stack.append((_kinds_of(kind), pos, stop))
                pos = stop
            else:
                return count  # groups: none in our protocol; the parser decides
        if pos > end:
            return count
    return count


def message_fields(message: Any) -> int:
    """The fields ``count_fields`` counts in ``message`` serialized, from the message
    object (the SDK's split of a batch: no serializing)."""
    count = 0
    for field, value in message.ListFields():
        if field.type == _MESSAGE:
            items = value if field.is_repeated else (value,)
            count += sum(1 + message_fields(item) for item in items)
        elif not field.is_repeated:
            count += 1
        elif field.type in _LENGTH_DELIMITED:
            count += len(value)
        else:
            count += 1 + len(value)  # packed: a key, then its elements
    return count
