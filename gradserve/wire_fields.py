"""How many fields a serialized message holds, counted without parsing it.

Protobuf's parser turns every field into an object or an array element of its
own: a 10 MB ``BatchRequest`` of empty steps took 220 MB and 0.16 s to parse,
a ``DeleteTensorRequest`` of one-letter ids the same, with Python's lock held all
along. At the server's 256 MiB message limit that is ~6 GB and seconds of an event
loop every call waits on. The server therefore counts a request's fields before
parsing it (``check_field_count``: on the event loop up to ``boundary.LOOP_FIELDS``,
past that after admission, on a lane) and refuses one holding more than
``protocol.MAX_REQUEST_FIELDS``; the SDK splits deletes, watches and batches to
stay under it.

The count walks the wire format as the message's descriptor says: a
length-delimited field of message type is entered, one of bytes or strings is
skipped whole (a tensor's content costs one step, whatever its size), and a packed
run of numbers counts each element. Data the walk cannot follow to its end is
refused as malformed, groups included: protobuf reads an unknown group, and a
count that stopped at one let it parse millions of fields behind it (a review
helper). Counting costs a turn of Python per field, 0.2-0.4 us; the varint
helpers of ``codec`` (a tensor's few fields, where anything unusual is left to
protobuf) would refuse less and cost a call per field.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from gradserve import protocol

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


class MalformedError(ValueError):
    """The message's bytes are not protobuf's wire format as this walk follows it."""


_KINDS: dict[Any, dict[int, Any]] = {}


def _kinds(descriptor: Any) -> dict[int, Any]:
    """Field number -> the kinds of the message to enter (a dict), the width of a
    packed run's numbers (0 for varints), or None (bytes, a string). Made once per
    message type, its message fields resolved to their own kinds (a dict lookup per
    field entered, not a call)."""
    kinds = _KINDS.get(descriptor)
    if kinds is not None:
        return kinds
    kinds = _KINDS[descriptor] = {}  # before the fields: a type may contain itself
    for field in descriptor.fields:
        if field.type == _MESSAGE:
            kinds[field.number] = _kinds(field.message_type)
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


def check_field_count(
    data: bytes | memoryview, descriptor: Any, limit: int = protocol.MAX_REQUEST_FIELDS
) -> None:
    """Raise ``TooManyFieldsError`` if ``data``, a serialized message of
    ``descriptor``'s type, holds more than ``limit`` fields."""
    if len(data) > limit:  # a field takes a byte at least: a shorter one cannot
        count_fields(data, descriptor, limit)


def count_fields(
    data: bytes | memoryview, descriptor: Any, limit: int = protocol.MAX_REQUEST_FIELDS
) -> int:
    """The fields of ``data``, a serialized message of ``descriptor``'s type, at every
    depth; raises ``TooManyFieldsError`` as soon as they pass ``limit``, and
    ``MalformedError`` for data the walk cannot follow to its end (a count that
    stopped there would let the parser read the rest unseen)."""
    view = data if isinstance(data, bytes) else memoryview(data).cast("B")
    count = 0
    stack = [(_kinds(descriptor), 0, len(view))]
    while stack:
        kinds, pos, end = stack.pop()
        while pos < end:
            key = view[pos]
            pos += 1
            if key & 0x80:
                key, pos = _varint_rest(view, pos, end, key, 5)
            count += 1
            if count > limit:
                raise _too_many(limit)
            wire_type = key & 7
            # Each varint's first byte is read here, not in a function: a call per
            # field made the count 20% slower (27 -> 33 ms for 64,500 fields).
            if wire_type == 2 and key > 7:
                if pos >= end:
                    raise MalformedError("a length cut short")
                length = view[pos]
                pos += 1
                if length & 0x80:
                    length, pos = _varint_rest(view, pos, end, length, 5)
                stop = pos + length
                if stop > end:
                    raise MalformedError("a length past the end of its message")
                kind = kinds.get(key >> 3)
                if kind is None or not length:
                    pass  # bytes, a string, a field this version does not know, empty
                elif kind.__class__ is dict:
                    stack.append((kind, pos, stop))
                else:
                    # A packed run of numbers, each an element: fixed-width ones, or
                    # varints of 1 to 10 bytes, each ending in a byte below 0x80.
                    if kind:
                        count += length // kind
                    elif length > 10 * (limit - count):
                        count += -(-length // 10)  # at least this many: over the limit
                    else:
                        run = np.frombuffer(view, np.uint8, length, pos)
                        count += int(np.count_nonzero(run < 0x80))
                    if count > limit:
                        raise _too_many(limit)
                pos = stop
            elif key < 8:
                raise MalformedError("field number 0")
            elif wire_type == 0:
                if pos >= end:
                    raise MalformedError("a varint cut short")
                byte = view[pos]
                pos += 1
                if byte & 0x80:
                    _, pos = _varint_rest(view, pos, end, byte, 10)
            elif wire_type == 1 or wire_type == 5:
                pos += 8 if wire_type == 1 else 4
                if pos > end:
                    raise MalformedError("a fixed-width number cut short")
            else:  # groups (none in our protocol: protobuf reads unknown ones), 6, 7
                raise MalformedError(f"wire type {wire_type}")
    return count


def _varint_rest(
    view: bytes | memoryview, pos: int, end: int, first: int, most: int
) -> tuple[int, int]:
    """A varint of at most ``most`` bytes whose first byte, ``first``, was read; its
    value and where it ends. Keys and lengths take 5 bytes at most (protobuf refuses
    longer ones, and a walk of 10-byte keys took twice as long), numbers 10."""
    value = first & 0x7F
    shift = 7
    while True:
        if pos >= end:
            raise MalformedError("a varint cut short")
        if shift >= 7 * most:
            raise MalformedError(f"a varint of more than {most} bytes")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


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
