"""The wire codec: NumPy arrays to ``Tensor`` messages and back.

Nothing else serialises tensors. Decoding never copies: the array is a
read-only view (``np.frombuffer``) of the received bytes, which is also why
arrays held by the server are treated as immutable. Encoding copies once
(``tobytes``). Every malformed message — unknown dtype, negative dims, content
length that does not match the shape — is an ``InvalidArgumentError``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from gradserve import dtypes, shapes
from gradserve.errors import InvalidArgumentError
from gradserve.v1 import tensor_pb2

_BIG_ENDIAN_HOST = sys.byteorder == "big"

__all__ = [
    "dtype_to_enum",
    "dtype_from_enum",
    "encode",
    "decode",
    "encode_chunks",
    "serialize",
    "serialize_with_values",
    "Serialized",
    "reply_parser",
    "ReplyParser",
    "Reply",
    "WireContent",
    "decode_chunks",
    "ChunkAssembler",
    "element_count",
    "encode_shape",
    "decode_shape",
]


#: Wire enum <-> NumPy dtype, from the proto's names: DT_FLOAT32 is float32.
_ENUM_BY_DTYPE: dict[np.dtype[Any], Any] = {  # values: tensor_pb2.DType
    dt: tensor_pb2.DType.Value(f"DT_{dtypes.name(dt).upper()}") for dt in dtypes.SUPPORTED
}
#: A string element's length prefix on the wire.
_LENGTH_BYTES = 8
_DTYPE_BY_ENUM: dict[int, np.dtype[Any]] = {enum: dt for dt, enum in _ENUM_BY_DTYPE.items()}


def dtype_to_enum(dtype: dtypes.DTypeLike) -> Any:
    """The wire enum of anything ``dtypes.normalize`` takes."""
    return _ENUM_BY_DTYPE[dtypes.normalize(dtype)]


def dtype_from_enum(enum: int, *, field: str = "dtype") -> np.dtype:
    """The NumPy dtype of a wire enum; DT_INVALID or an unknown number is an
    ``UnsupportedDTypeError`` (INVALID_ARGUMENT) naming ``field``."""
    try:
        return _DTYPE_BY_ENUM[enum]
    except KeyError:
        raise dtypes.UnsupportedDTypeError(
            f"{field}: unknown or unset dtype enum value {enum}", field=field
        ) from None


def element_count(shape: Sequence[int], *, field: str = "tensor", itemsize: int = 1) -> int:
    """Number of elements of a wire shape (see ``shapes.num_elements``)."""
    return shapes.num_elements(shape, itemsize, what=field)


def encode(array: np.ndarray, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """A ``Tensor`` message holding ``array`` (little-endian, C order)."""
    array = np.asarray(array)
    dtype = dtypes.normalize(array.dtype)
    msg = out if out is not None else tensor_pb2.Tensor()
    msg.dtype = _ENUM_BY_DTYPE[dtype]
    msg.shape[:] = array.shape
    msg.content = _content(array, dtype)
    return msg


def _content(array: np.ndarray, dtype: np.dtype[Any]) -> bytes:
    """The wire bytes of ``array``: little-endian C-order elements, or for strings
    each element's 8-byte little-endian length and bytes."""
    if dtype == dtypes.STRING:
        parts: list[bytes] = []
        for element in array.flat:
            data = _string_bytes(element)
            parts += (len(data).to_bytes(_LENGTH_BYTES, "little"), data)
        return b"".join(parts)
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and _BIG_ENDIAN_HOST):
        array = array.astype(dtype.newbyteorder("<"))
    return array.tobytes(order="C")


def _string_bytes(element: Any) -> bytes:
    if isinstance(element, bytes):
        return element
    if isinstance(element, str):
        return element.encode()
    raise InvalidArgumentError(
        f"a string tensor holds bytes or str, not {type(element).__name__}: {element!r}"
    )


def _strings(content: bytes | memoryview, shape: tuple[int, ...], field: str) -> np.ndarray:
    """The read-only object array of ``bytes`` that string ``content`` encodes."""
    count = element_count(shape, field=field, itemsize=dtypes.STRING_ELEMENT_BYTES)
    view = memoryview(content)
    if len(view) < count * _LENGTH_BYTES:  # before allocating ``count`` references
        raise InvalidArgumentError(
            f"{field}: shape {list(shape)} of strings needs at least "
            f"{count * _LENGTH_BYTES} bytes but the content has {len(view)}",
            field=field,
        )
    out = np.empty(count, dtypes.STRING)
    pos = 0
    for index in range(count):
        length = int.from_bytes(view[pos : pos + _LENGTH_BYTES], "little")
        pos += _LENGTH_BYTES
        if pos + length > len(view):
            raise InvalidArgumentError(
                f"{field}: string element {index} runs past the content", field=field
            )
        out[index] = bytes(view[pos : pos + length])
        pos += length
    if pos != len(view):
        raise InvalidArgumentError(
            f"{field}: {len(view) - pos} bytes after the last string element", field=field
        )
    array = out.reshape(shape)
    array.flags.writeable = False
    return array


def decode(msg: tensor_pb2.Tensor | WireTensor, *, field: str = "tensor") -> np.ndarray:
    """A read-only array viewing the message's bytes; validates dtype and size."""
    dtype = dtype_from_enum(msg.dtype, field=field)
    shape = tuple(msg.shape)
    if dtype == dtypes.STRING:
        return _strings(msg.content, shape, field)
    count = element_count(shape, field=field, itemsize=dtype.itemsize)
    content = msg.content
    expected = count * dtype.itemsize
    if len(content) != expected:
        raise InvalidArgumentError(
            f"{field}: shape {list(shape)} of {dtype} needs {expected} bytes "
            f"but the content has {len(content)}",
            field=field,
        )
    array = np.frombuffer(content, dtype=dtype.newbyteorder("<"), count=count)
    if not array.flags.aligned:  # a view of received bytes another writer did not align
        array = array.copy()
        array.flags.writeable = False
    return array.reshape(shape)


class WireContent:
    """A tensor's wire bytes, ready to be cut into chunks (``chunks``): building them
    is the costly part (a pass over every string), cutting them is cheap."""

    def __init__(self, array: np.ndarray) -> None:
        array = np.asarray(array)
        dtype = dtypes.normalize(array.dtype)
        self.dtype = _ENUM_BY_DTYPE[dtype]
        self.shape = array.shape
        self.content_bytes = 0
        if dtype == dtypes.STRING:
            self.data = memoryview(_content(array, dtype))
            self.content_bytes = len(self.data)
        elif array.size:
            little = np.ascontiguousarray(array.astype(dtype.newbyteorder("<"), copy=False))
            self.data = memoryview(little.reshape(-1).view(np.uint8).data)
        else:
            self.data = memoryview(b"")

    def chunks(self, chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
        """Chunks of ``chunk_bytes``; the first carries dtype and shape. One copy per
        chunk (the ``bytes`` of a slice)."""
        step, raw = max(1, chunk_bytes), self.data
        yield tensor_pb2.TensorChunk(
            dtype=self.dtype,
            shape=self.shape,
            data=bytes(raw[:step]),
            content_bytes=self.content_bytes,
        )
        for start in range(step, len(raw), step):
            yield tensor_pb2.TensorChunk(data=bytes(raw[start : start + step]))

    def encoded_chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        """The same chunks as ``chunks``, already serialized: each is its header (the
        first chunk's dtype, shape and content length) and its data field, joined in
        one copy of the data, with no message object in between (a ``TensorChunk``
        costs two more copies: its ``bytes`` slice and ``SerializeToString``). Send
        them with an identity serializer; they parse as ``TensorChunk``."""
        step, raw = max(1, chunk_bytes), self.data
        head = tensor_pb2.TensorChunk(
            dtype=self.dtype, shape=self.shape, content_bytes=self.content_bytes
        ).SerializeToString()
        yield _with_data(head, raw[:step])
        for start in range(step, len(raw), step):
            yield _with_data(b"", raw[start : start + step])


def _with_data(head: bytes, data: memoryview) -> bytes:
    """``head`` followed by the serialized field ``data = data`` (``TensorChunk``'s 3)."""
    if not len(data):
        return head
    return b"".join((head, length_delimited(3, len(data)), data))


def _varint_bytes(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(number: int, size: int) -> bytes:
    """The key and length of field ``number`` holding ``size`` bytes."""
    return _varint_bytes(number << 3 | 2) + _varint_bytes(size)


class Serialized:
    """A response already serialized: ``serialize`` (the server's response
    serializer) takes its ``SerializeToString``, the call's record its ``ByteSize``."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data

    def ByteSize(self) -> int:
        return len(self.data)


#: Smaller inline outputs are set in the message: for them the few microseconds of
#: building their fields by hand cost more than the copies saved.
ONE_COPY_MIN_BYTES = 16 * 1024


def inlines_in_one_copy(array: np.ndarray) -> bool:
    """Whether ``serialize_with_values`` should take ``array``: numeric (strings are
    encoded element by element into a message anyway) and not small."""
    return array.dtype != dtypes.STRING and array.nbytes >= ONE_COPY_MIN_BYTES


def serialize_with_values(message: Any, values: Sequence[tuple[int, np.ndarray]]) -> Serialized:
    """``message`` serialized with, after it, for each ``(number, array)``, its
    ``TensorOutput`` field ``number`` holding ``value = encode(array)``; numeric arrays
    only (``inlines_in_one_copy``).

    A parser merges a message field that occurs twice, so the bytes read back as
    ``message`` with those values set (and any field the output already had, such as
    its ``tape_id``). Each array's bytes are copied once, by the final join: setting
    the field and serializing the message copy them three times (``tobytes``, the
    field, ``SerializeToString``), 10 ms of a 2-3 ms memcpy for the 11.5 MB of a
    (50, 32, 256) LSTM forward's outputs on the project's machine. Each content
    starts ``CONTENT_ALIGNMENT``-aligned in the message (``Tensor.padding``)."""
    parts: list[bytes | memoryview] = [message.SerializeToString()]
    offset = len(parts[0])
    for number, array in values:

        def wrap(tensor_size: int, number: int = number) -> list[bytes]:
            value_field = length_delimited(1, tensor_size)  # TensorOutput.value
            return [length_delimited(number, len(value_field) + tensor_size), value_field]

        field = _tensor_parts(WireContent(array), offset, wrap)
        offset += sum(len(part) for part in field)
        parts += field
    return Serialized(b"".join(parts))


#: Where ``serialize_tensor`` and ``serialize_with_values`` start a tensor's content in
#: the message: NumPy's ``frombuffer`` of a content that is not aligned to its item
#: size makes arrays that every later ufunc and GEMM takes its slow path on (1.2-2.1x
#: slower here). Python's ``bytes`` of a message this size start 16-byte aligned.
CONTENT_ALIGNMENT = 16
#: ``Tensor.padding``'s key: field 15, length-delimited.
_PADDING_KEY = _varint_bytes(15 << 3 | 2)
#: The longest ``Tensor.padding`` a writer here needs (near a varint boundary); the
#: parsers leave a longer one to protobuf, which copies the content out of it (a view
#: would keep the padding in memory, uncharged, as long as the tensor).
MAX_PADDING_BYTES = 2 * CONTENT_ALIGNMENT - 1
#: The ``Tensor.padding`` fields to choose from: none, then 0 to 31 bytes of it.
_PADDINGS = [
    b"",
    *(_PADDING_KEY + _varint_bytes(n) + bytes(n) for n in range(MAX_PADDING_BYTES + 1)),
]


def _tensor_parts(
    content: WireContent, offset: int, wrap: Callable[[int], list[bytes]]
) -> list[bytes | memoryview]:
    """A ``Tensor`` message's parts, after ``wrap(its size)`` (the fields that hold
    it), placed at ``offset`` of a message: its content starts ``CONTENT_ALIGNMENT``-
    aligned there, with the shortest ``padding`` that does it."""
    head = tensor_pb2.Tensor(dtype=content.dtype, shape=content.shape).SerializeToString()
    data = content.data
    data_field = length_delimited(3, len(data)) if len(data) else b""
    # The padding that aligns the content if the fields before it keep their size. A
    # padding can only make them longer, by a byte for each length that holds it and
    # crosses a varint boundary (``wrap``'s two at most), so the search starts two
    # bytes short of that padding: at most five tries, not up to 33.
    unpadded = len(head) + len(data_field) + len(data)
    start = offset + sum(map(len, wrap(unpadded))) + len(head) + len(data_field)
    need = -start % CONTENT_ALIGNMENT
    if need == 1:  # a padding field is 0 or at least 2 bytes
        need += CONTENT_ALIGNMENT
    for padding in _PADDINGS[max(0, need - 4) :]:  # _PADDINGS[k], k >= 1, is k + 1 bytes
        tensor_size = len(head) + len(padding) + len(data_field) + len(data)
        before = wrap(tensor_size)
        start = offset + sum(map(len, before)) + len(head) + len(padding) + len(data_field)
        if not len(data) or start % CONTENT_ALIGNMENT == 0:
            return [*before, head, padding, data_field, data]
    raise AssertionError("no padding aligns the content")  # pragma: no cover


def encode_chunks(array: np.ndarray, chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    """``array`` as a stream of chunks of ``chunk_bytes`` (see ``WireContent``)."""
    return WireContent(array).chunks(chunk_bytes)


class ChunkAssembler:
    """Builds the array a chunk stream carries, one chunk at a time (so that a sync
    iterator and an asyncio stream share it). Every malformed stream (no chunk, bad
    dtype or shape, too little or too much data, a later chunk whose dtype, shape or
    content length, where set, are not the first one's) is an InvalidArgumentError.

    ``before_allocating(nbytes)`` runs once the size is known (from the first chunk)
    and before the buffer exists, with the bytes the finished array will hold
    (``dtypes.nbytes``): a memory budget can refuse the stream there.
    ``allocate(nbytes)`` gives the buffer the chunks fill: a 1-D uint8 array (the
    server's comes warm from a cache of freed ones).
    """

    def __init__(
        self,
        *,
        before_allocating: Callable[[int], None] = lambda nbytes: None,
        allocate: Callable[[int], np.ndarray] = lambda nbytes: np.empty(nbytes, np.uint8),
        field: str = "stream",
    ) -> None:
        self.field = field
        self._allocate = allocate
        self._before_allocating = before_allocating
        self._buffer: np.ndarray | None = None
        self._dtype: np.dtype[Any] | None = None
        self._shape: tuple[int, ...] = ()
        self._header: tuple[int, int] = (0, 0)  # the first chunk's dtype enum, content_bytes
        self.filled = 0
        self.nbytes = 0

    def add(self, chunk: tensor_pb2.TensorChunk) -> None:
        field = self.field
        if self._buffer is not None:
            self._check_header(chunk)
        else:
            self._header = (int(chunk.dtype), int(chunk.content_bytes))
            self._dtype = dtype_from_enum(chunk.dtype, field=field)
            self._shape = tuple(chunk.shape)
            if self._dtype == dtypes.STRING:
                count = element_count(
                    self._shape, field=field, itemsize=dtypes.STRING_ELEMENT_BYTES
                )
                self.nbytes = chunk.content_bytes
                if self.nbytes < count * _LENGTH_BYTES:
                    raise InvalidArgumentError(
                        f"{field}: {count} strings need at least {count * _LENGTH_BYTES} "
                        f"bytes of content, the stream declares {self.nbytes}",
                        field=field,
                    )
                # What the strings will hold (``dtypes.nbytes``): their bytes (the
                # content less its length prefixes) and each element's own cost.
                charge = self.nbytes + count * (dtypes.STRING_ELEMENT_BYTES - _LENGTH_BYTES)
            else:
                itemsize = self._dtype.itemsize
                count = element_count(self._shape, field=field, itemsize=itemsize)
                self.nbytes = charge = count * itemsize
            self._before_allocating(charge)
            self._buffer = self._allocate(self.nbytes)
        data = chunk.data
        end = self.filled + len(data)
        if end > self.nbytes:
            kind = "?" if self._dtype is None else dtypes.name(self._dtype)
            raise InvalidArgumentError(
                f"{field}: more data than shape {list(self._shape)} of {kind} holds "
                f"({self.nbytes} bytes)",
                field=field,
            )
        self._buffer[self.filled : end] = np.frombuffer(data, np.uint8)
        self.filled = end

    def _check_header(self, chunk: tensor_pb2.TensorChunk) -> None:
        """A later chunk may leave the header out (the SDK does), not contradict it."""
        dtype, content_bytes = self._header
        assert self._dtype is not None  # (the first chunk set it)
        if (
            (chunk.dtype and chunk.dtype != dtype)
            or (len(chunk.shape) and tuple(chunk.shape) != self._shape)
            or (chunk.content_bytes and chunk.content_bytes != content_bytes)
        ):
            raise InvalidArgumentError(
                f"{self.field}: a chunk's dtype, shape or content length differs from the "
                f"first chunk's ({dtypes.name(self._dtype)}, {list(self._shape)}, "
                f"{content_bytes} content bytes): only the first chunk says them",
                field=self.field,
            )

    @property
    def whole(self) -> bool:
        """The chunks so far carry all the bytes their first chunk declared."""
        return self._buffer is not None and self.filled == self.nbytes

    def finish(self) -> np.ndarray:
        """The read-only array, once the stream has ended."""
        field = self.field
        if self._buffer is None or self._dtype is None:
            raise InvalidArgumentError(f"{field}: the stream carried no chunk", field=field)
        if self.filled != self.nbytes:
            raise InvalidArgumentError(
                f"{field}: the stream ended after {self.filled} of {self.nbytes} bytes",
                field=field,
            )
        if self._dtype == dtypes.STRING:
            return _strings(self._buffer.data, self._shape, field)
        array = self._buffer.view(self._dtype.newbyteorder("<")).reshape(self._shape)
        array.flags.writeable = False
        return array


def serialize(message: Any) -> bytes:
    """A message's wire bytes; ``bytes`` pass as they are (already serialized, as
    ``WireContent.encoded_chunks`` makes them)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def decode_chunks(
    chunks: Iterable[tensor_pb2.TensorChunk],
    *,
    before_allocating: Callable[[int], None] = lambda nbytes: None,
    allocate: Callable[[int], np.ndarray] = lambda nbytes: np.empty(nbytes, np.uint8),
    field: str = "stream",
) -> np.ndarray:
    """The read-only array a chunk stream carries (see ``ChunkAssembler``)."""
    assembler = ChunkAssembler(before_allocating=before_allocating, allocate=allocate, field=field)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def encode_shape(shape: shapes.PartialShape, out=None) -> tensor_pb2.PartialShape:
    """A ``PartialShape`` message; ``None`` is unknown rank, ``None`` dims are -1."""
    msg = out if out is not None else tensor_pb2.PartialShape()
    if shape is None:
        msg.unknown_rank = True
    else:
        msg.dims[:] = [-1 if d is None else d for d in shape]
    return msg


def decode_shape(msg: tensor_pb2.PartialShape, present: bool = True) -> shapes.PartialShape:
    """The partial shape of a message; an absent field means unknown rank."""
    if not present or msg.unknown_rank:
        return None
    return shapes.make(list(msg.dims))


# ------------------------------------------------ the fast paths of one-message tensors


def serialize_tensor(array: np.ndarray) -> bytes:
    """``encode(array).SerializeToString()`` with one copy of a numeric array's bytes
    instead of three (``tobytes``, the message field, the serialization), its content
    ``CONTENT_ALIGNMENT``-aligned in the message (``Tensor.padding``)."""
    if array.dtype == dtypes.STRING:
        return encode(array).SerializeToString()
    return b"".join(_tensor_parts(WireContent(array), 0, lambda size: []))


class WireTensor:
    """A serialized ``Tensor``'s dtype, shape and content, the content a view of the
    received bytes: ``decode`` takes it as it takes the message, and ``ByteSize`` is
    the serialized size, as the message's (the server's received-bytes metric)."""

    __slots__ = ("content", "dtype", "shape", "size")

    def __init__(self, dtype: int, shape: tuple[int, ...], content: memoryview, size: int) -> None:
        self.dtype = dtype
        self.shape = shape
        self.content = content
        self.size = size

    def ByteSize(self) -> int:  # noqa: N802 - protobuf's name
        return self.size


class WireChunk:
    """A serialized ``TensorChunk``, its data a view of the received bytes:
    ``decode_chunks`` takes it as it takes the message."""

    __slots__ = ("content_bytes", "data", "dtype", "shape")

    def __init__(
        self, dtype: int, shape: tuple[int, ...], data: memoryview, content_bytes: int
    ) -> None:
        self.dtype = dtype
        self.shape = shape
        self.data = data
        self.content_bytes = content_bytes


class _UnusualError(Exception):
    """Something ``parse_tensor`` leaves to protobuf."""


def _varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]  # IndexError past the end: unusual
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise _UnusualError


def _key_or_length(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """A field key or length: a varint of at most 5 bytes below 2**31 (protobuf refuses
    longer ones; rarer ones it takes are left to it)."""
    value, end = _varint(data, pos)
    if end - pos > 5 or value >= 1 << 31:
        raise _UnusualError
    return value, end


def _fields(data: bytes | memoryview, last: int) -> tuple[int, tuple[int, ...], memoryview, int]:
    """dtype (1), shape (2), bytes (3) and, if ``last`` is 4, content_bytes (4) of a
    serialized ``Tensor`` or ``TensorChunk``, the bytes a view of ``data``; raises
    ``_UnusualError`` for anything but the plain encoding of those fields as protobuf
    writes it (unknown or repeated fields, negative numbers, data cut short), but a
    ``Tensor``'s ``padding`` of up to ``MAX_PADDING_BYTES``, skipped. The server parses
    requests with it on its event loop: more than ``shapes.MAX_RANK`` shape fields or
    dims (a loop turn of Python each; protobuf reads them in C) are unusual too."""
    view = memoryview(data)
    end = len(data)
    dtype, count, content = 0, 0, view[:0]
    shape: list[int] = []
    seen: set[int] = set()
    shape_fields = 0  # a loop turn each, even an empty packed one (no dim)
    pos = 0
    try:
        while pos < end:
            key, pos = _key_or_length(data, pos)
            number, wire_type = key >> 3, key & 7
            if number == 2:
                shape_fields += 1
                if shape_fields > shapes.MAX_RANK:
                    raise _UnusualError
            elif number in seen:
                raise _UnusualError
            seen.add(number)
            if number == 1 and wire_type == 0:
                dtype, pos = _varint(data, pos)
            elif number == 2 and wire_type == 2:  # packed dims
                size, pos = _key_or_length(data, pos)
                stop = pos + size
                while pos < stop and len(shape) <= shapes.MAX_RANK:
                    dim, pos = _varint(data, pos)
                    shape.append(dim)
                if pos != stop:
                    raise _UnusualError
            elif number == 2 and wire_type == 0:
                dim, pos = _varint(data, pos)
                shape.append(dim)
            elif number in (3, 15) and wire_type == 2:
                if number == 15 and last != 3:
                    raise _UnusualError  # padding is a Tensor's
                size, pos = _key_or_length(data, pos)
                if pos + size > end or (number == 15 and size > MAX_PADDING_BYTES):
                    raise _UnusualError
                if number == 3:
                    content = view[pos : pos + size]
                pos += size
            elif number == 4 and last == 4 and wire_type == 0:
                count, pos = _varint(data, pos)
            else:
                raise _UnusualError
    except IndexError:
        raise _UnusualError from None
    if len(shape) > shapes.MAX_RANK:
        raise _UnusualError
    if dtype >= 1 << 31 or count >= 1 << 63 or any(dim >= 1 << 63 for dim in shape):
        raise _UnusualError  # negative numbers: protobuf's own values and errors
    return dtype, tuple(shape), content, count


def parse_tensor(data: bytes) -> WireTensor | tensor_pb2.Tensor:
    """A serialized ``Tensor`` (a response deserializer), its content not copied out
    of ``data``: ``Tensor.FromString`` copies it in and reading the field copies it
    out, two passes over every byte of a get. What ``_fields`` finds unusual is
    parsed by protobuf instead, which raises or decodes as it always did."""
    try:
        dtype, shape, content, _ = _fields(data, 3)
    except _UnusualError:
        return tensor_pb2.Tensor.FromString(data)
    return WireTensor(dtype, shape, content, len(data))


def parse_chunk(data: bytes) -> WireChunk | tensor_pb2.TensorChunk:
    """A serialized ``TensorChunk`` (GetTensor's response deserializer), as
    ``parse_tensor`` parses a ``Tensor``."""
    try:
        dtype, shape, content, count = _fields(data, 4)
    except _UnusualError:
        return tensor_pb2.TensorChunk.FromString(data)
    return WireChunk(dtype, shape, content, count)


# ------------------------------------------------ op replies: inline outputs as views

#: Replies below this size are parsed by protobuf alone: scanning them here would cost
#: more than the copies it saves.
REPLY_VIEW_MIN_BYTES = 64 * 1024


class InlineOutput:
    """A reply's ``TensorOutput`` whose inline ``value`` is a ``WireTensor`` (a view of
    the received bytes); every other field is the message's."""

    __slots__ = ("_message", "value")

    def __init__(self, message: tensor_pb2.TensorOutput, value: WireTensor) -> None:
        self._message = message
        self.value = value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # unset slots (a copy made without __init__)
            raise AttributeError(name)
        return getattr(self._message, name)

    def __repr__(self) -> str:
        return f"InlineOutput({self._message!r}, content of {len(self.value.content)} bytes)"


class Reply:
    """An op's reply parsed by ``reply_parser``: the message, but its top-level inline
    outputs come as ``InlineOutput``. Everything else is the message's own; its
    outputs' ``value`` holds dtype and shape, without the content."""

    __slots__ = ("_message", "_nbytes", "_values")

    def __init__(self, message: Any, values: dict[str, WireTensor], nbytes: int) -> None:
        self._message = message
        self._values = values
        self._nbytes = nbytes

    def ByteSize(self) -> int:
        """The size of the reply as received (the message's own lacks the contents)."""
        return self._nbytes

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # unset slots (a copy made without __init__)
            raise AttributeError(name)
        value = getattr(self._message, name)
        tensor = self._values.get(name)
        if tensor is None or value.WhichOneof("result") != "value":  # a later ref wins
            return value
        return InlineOutput(value, tensor)

    def __repr__(self) -> str:
        return f"Reply({self._message!r}, views of {sorted(self._values)})"


def reply_parser(message_type: Any) -> Callable[[bytes], Any]:
    """A response deserializer for ``message_type``: a ``ReplyParser`` where it has
    top-level inline outputs, else ``message_type.FromString``."""
    names = {
        f.number: f.name
        for f in message_type.DESCRIPTOR.fields
        if f.message_type is tensor_pb2.TensorOutput.DESCRIPTOR and not f.is_repeated
    }
    return ReplyParser(message_type, names) if names else message_type.FromString


class ReplyParser:
    """Parses an op's reply leaving the content of its top-level inline outputs
    (``TensorOutput.value``) in the received bytes: protobuf copies it into the
    message and reading the field copies it out again, two passes over every byte
    (5.6 ms of the 11.5 MB of a (50, 32, 256) LSTM forward's outputs here). Each
    array ``decode`` then makes is a read-only view of the reply's bytes, which stay
    in memory while any of them lives (as outputs that come through shared memory
    keep their region). What ``_split_values`` finds unusual, and small replies, are
    parsed by protobuf alone."""

    def __init__(self, message_type: Any, names: dict[int, str]) -> None:
        self.message_type = message_type
        self.names = names  # output field names by number

    def __call__(self, data: bytes) -> Any:
        if len(data) < REPLY_VIEW_MIN_BYTES:
            return self.message_type.FromString(data)
        try:
            rest, values = _split_values(data, self.names)
        except _UnusualError:
            return self.message_type.FromString(data)
        message = self.message_type.FromString(rest)
        return Reply(message, values, len(data)) if values else message


def _split_values(data: bytes, names: dict[int, str]) -> tuple[bytes, dict[str, WireTensor]]:
    """``data`` without the content of the inline values of the top-level outputs
    ``names`` (by field number), and those values. Each such value stays in the bytes
    returned as its dtype and shape; raises ``_UnusualError`` for any encoding but
    the plain one (a value in two pieces, an unknown wire type, data cut short)."""
    view = memoryview(data)
    end = len(data)
    parts: list[bytes | memoryview] = []
    values: dict[str, WireTensor] = {}
    valued: set[int] = set()  # the outputs that carried a value
    pos = 0
    try:
        while pos < end:
            start = pos
            key, pos = _key_or_length(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                size, pos = _key_or_length(data, pos)
                stop = pos + size
                if stop > end:
                    raise _UnusualError
                found = _output_without_content(view[pos:stop]) if number in names else None
                pos = stop
                if found is not None:  # a value: one per output, as protobuf would merge
                    if number in valued:
                        raise _UnusualError
                    valued.add(number)
                if found is not None and found is not _SMALL_VALUE:
                    output, value = found
                    values[names[number]] = value
                    parts += (length_delimited(number, len(output)), output)
                    continue
            else:
                raise _UnusualError
            if pos > end:
                raise _UnusualError
            parts.append(view[start:pos])
    except IndexError:
        raise _UnusualError from None
    return b"".join(parts), values


#: ``_output_without_content``'s answer for a value it leaves to protobuf.
_SMALL_VALUE: Any = object()


def _output_without_content(data: memoryview) -> tuple[bytes, WireTensor] | Any | None:
    """A serialized ``TensorOutput`` with its ``value`` reduced to dtype and shape, and
    that value; None where it has no value; ``_SMALL_VALUE`` for a value under
    ``ONE_COPY_MIN_BYTES``, left to protobuf (a small output that outlives the others
    should not keep the whole reply in memory)."""
    end = len(data)
    parts: list[bytes | memoryview] = []
    value = None
    pos = 0
    while pos < end:
        start = pos
        key, pos = _key_or_length(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type != 2:
            raise _UnusualError  # TensorOutput's fields are all length-delimited
        size, pos = _key_or_length(data, pos)
        stop = pos + size
        if stop > end:
            raise _UnusualError
        if number == 1:  # value
            if value is not None:
                raise _UnusualError
            dtype, shape, content, _ = _fields(data[pos:stop], 3)
            if len(content) < ONE_COPY_MIN_BYTES:
                return _SMALL_VALUE
            value = WireTensor(dtype, shape, content, stop - pos)
            enum: Any = dtype  # DType is an open enum: any value parses
            placeholder = tensor_pb2.Tensor(dtype=enum, shape=shape)
            head = placeholder.SerializeToString()
            parts += (length_delimited(1, len(head)), head)
        else:
            parts.append(data[start:stop])
        pos = stop
    return None if value is None else (b"".join(parts), value)
