"""TensorFlow's TensorArray as a pure state machine (no gRPC, no sessions).

Invariants, as in tensorflow/core/kernels/tensor_array.h:

* write-once per index for a forward array; a gradient array instead *sums*
  repeated writes to one index (its values are partial gradients of the many
  reads of that index in the forward pass), with exact shape equality;
* read-many, unless ``clear_after_read``: then a read drops the value and a
  second read of that index fails;
* an index that has been read can no longer be written;
* thread-safe: every public method takes the array's lock;
* closable: ``close`` drops every value; later use fails.

One deliberate difference: TensorFlow applies a multi-index op (scatter, split,
gather with clear_after_read) index by index and keeps what it did before the
first failing index. Here a failing call changes nothing: each public method
runs inside a journal that restores every touched slot and field on error.

Values are NumPy arrays that are never mutated in place (an aggregated write
allocates the sum), so a journal entry is a shallow copy of the slot record and
a stored array can be shared with the session's resident tensors.

Slots live in a dict keyed by index, so ``size`` can be any int32 without
allocating per-slot state; an absent key is an unwritten slot.

What an array holds is charged to its memory budget: its values' bytes, and what
its own records take (``ARRAY_BYTES`` for the array, ``SLOT_BYTES`` per slot
record). Without the second, a session whose budget was a megabyte made 600,000
arrays of a few bytes each (390 MB of server memory), or as many slots holding
empty values: nothing a budget saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from gradserve import dtypes, pauses, shapes
from gradserve.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnimplementedError,
)
from gradserve.server.core.budget import MemoryBudget

#: Multi-index reads call their ``check`` (deadline, cancellation) this often.
CHECK_EVERY = 1024
#: Bytes charged for one array's own records, besides twice its name (its name, and
#: a gradient array's source in its session's index); measured at about 610.
ARRAY_BYTES = 1024


def array_record_bytes(name: str) -> int:
    """What an array named ``name`` charges its budget for its own records."""
    return ARRAY_BYTES + 2 * len(name)


#: Bytes charged for one slot record (its ``_Slot``, shape, dict entry: about 220).
SLOT_BYTES = 256
#: An op that grows an array reserves in the budget as it goes, once it has grown by
#: this much since its last reservation, not only when it ends: a concat of a
#: million unwritten empty elements (a 45-byte call) made a million slot records,
#: 436 MB and 13.6 s, before the budget saw any of it.
RESERVE_AHEAD_BYTES = 64 * 1024


#: Given an op's outputs before the op is done (``TensorArray.read``), and the bytes
#: the op gives back to the budget when it ends (a cleared element's); raising undoes
#: the op. Returns how many of those bytes it took over, to pay for keeping the outputs
#: (the op gives back that much less): a read that clears its element needs room only
#: for what its output costs beyond the element's bytes.
HandOut = Callable[[Sequence[np.ndarray], int], int]


@dataclasses.dataclass
class _Slot:
    """The state of one index."""

    #: The value; ``None`` while written means zeros of ``shape`` not yet
    #: materialised (a gradient array's soft copy) or dropped by a clearing read.
    value: np.ndarray | None = None
    #: Shape of the value (or of the implied zeros).
    shape: tuple[int, ...] = ()
    #: A value (or a shape standing for zeros) has been written.
    written: bool = False
    #: The index has been read; it can no longer be written.
    read: bool = False
    #: Read with clear_after_read: the value is gone; reading again fails.
    cleared: bool = False

    @property
    def holds_values(self) -> bool:
        """A write to this written slot adds to it (else it stands for zeros: replaced)."""
        return self.value is not None and self.value.size > 0


#: A slot record, by its public name (snapshots build them).
Slot = _Slot


@dataclasses.dataclass
class Cleared:
    """What a read with ``clear_after_read`` cleared: its array, and the slots it
    touched as they were before, by index (None: no slot). ``put_back`` undoes the
    read where its output reached no one (its reply was lost to a deadline or a
    cancel): the values were the output's alone, and were lost with it."""

    array: TensorArray
    before: dict[int, _Slot | None]

    def put_back(self) -> int:
        """``TensorArray.put_back``, once (a later read may clear the elements again):
        the number of elements put back."""
        before, self.before = self.before, {}
        return self.array.put_back(before)


class TensorArray:
    """One TensorArray or gradient TensorArray.

    Parameters mirror TensorFlow's constructor. ``name`` is the unique name
    TensorFlow prints in messages ("ta_3", "ta_3@gradients");
    ``max_output_bytes`` bounds every tensor the array allocates (zeros for an
    unwritten read, a gather or concat result).
    """

    def __init__(
        self,
        *,
        name: str,
        dtype: np.dtype,
        size: int,
        element_shape: shapes.PartialShape = None,
        identical_element_shapes: bool = False,
        dynamic_size: bool = False,
        clear_after_read: bool = True,
        multiple_writes_aggregate: bool = False,
        is_grad: bool = False,
        marked_size: int = -1,
        max_output_bytes: int | None = None,
        max_size: int | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        if size < 0:
            raise InvalidArgumentError("Size should be >= 0.")
        if max_size is not None and size > max_size:
            raise _too_many_elements(name, size, max_size)
        self.name = name
        self.dtype = np.dtype(dtype)
        self.is_grad = is_grad
        self.identical_element_shapes = identical_element_shapes
        self.clear_after_read = clear_after_read
        self.multiple_writes_aggregate = multiple_writes_aggregate
        self.max_output_bytes = max_output_bytes
        self.max_size = max_size
        self._budget = budget
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._size = size
        self._element_shape = element_shape
        self._dynamic_size = dynamic_size
        self._marked_size = marked_size
        self._gradients_disallowed = False
        self._closed = False
        #: Closed with its session (``discard(session_closed=True)``), not by
        #: TensorArrayCloseV3 nor forgotten by a live session.
        self._discarded = False
        self._journal: dict[int, _Slot | None] | None = None
        #: During an op (``_atomic``): the bytes held when it began, those reserved
        #: since, ahead of its end (``_grew``), and those it will give back that its
        #: outputs took over (``_hand_out``).
        self._op_start_nbytes = 0
        self._reserved_ahead = 0
        self._handed_over = 0
        self._own_bytes = array_record_bytes(name)  # held until ``discard``
        if budget is not None:
            budget.reserve(self._own_bytes)  # past a limit: raises, nothing made
        #: Charged to ``budget``: the values' bytes and the records' (module docstring).
        self._nbytes = self._own_bytes

    # ------------------------------------------------------------------ journal
    _FIELDS = (
        "_size",
        "_element_shape",
        "_dynamic_size",
        "_marked_size",
        "_gradients_disallowed",
        "_nbytes",
    )

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        """Hold the lock; on any exception restore every slot and field touched.

        On success the change in bytes held is charged to the memory budget;
        if that passes a limit, the whole operation is rolled back as well.
        """
        # (a check called under the lock must not pause: gradserve.pauses)
        with self._lock, pauses.unpaused():
            saved = {f: getattr(self, f) for f in self._FIELDS}
            self._journal = {}
            self._op_start_nbytes, self._reserved_ahead, self._handed_over = self._nbytes, 0, 0
            try:
                yield
                if self._budget is not None:
                    change = self._nbytes - saved["_nbytes"] - self._reserved_ahead
                    self._budget.adjust(change + self._handed_over)
            except BaseException:
                for f, v in saved.items():
                    setattr(self, f, v)
                for index, old in self._journal.items():
                    if old is None:
                        self._slots.pop(index, None)
                    else:
                        self._slots[index] = old
                if self._budget is not None:
                    self._budget.release(self._reserved_ahead)
                raise
            finally:
                self._journal = None
                self._reserved_ahead = self._handed_over = 0

    def _hand_out(self, hand_out: HandOut | None, outputs: Sequence[np.ndarray]) -> None:
        """The op's last step (``HandOut``): ``hand_out`` may take over the bytes it
        gives back. (Only an op that shrinks gives any: its end then releases, which
        cannot fail, so what was handed over is always counted.)"""
        if hand_out is None:
            return
        pending = self._nbytes - self._op_start_nbytes - self._reserved_ahead
        credit = max(0, -pending) if self._budget is not None else 0
        self._handed_over = hand_out(outputs, credit)

    def _grew(self) -> None:
        """Within an op: reserve what it has added since its last reservation, once
        that reaches ``RESERVE_AHEAD_BYTES`` (past a limit this raises, and ``_atomic``
        undoes the op)."""
        ahead = self._nbytes - self._op_start_nbytes - self._reserved_ahead
        if self._budget is not None and self._journal is not None and ahead >= RESERVE_AHEAD_BYTES:
            self._budget.reserve(ahead)
            self._reserved_ahead += ahead

    def _slot_for_update(self, index: int) -> _Slot:
        """The slot at ``index``, created if absent, journaled before first change."""
        slot = self._slots.get(index)
        if self._journal is not None and index not in self._journal:
            self._journal[index] = dataclasses.replace(slot) if slot is not None else None
        if slot is None:
            slot = self._slots[index] = _Slot()
            self._nbytes += SLOT_BYTES  # (``_atomic`` charges it, or undoes both)
            self._grew()
        return slot

    # ------------------------------------------------------------------ queries
    @property
    def element_shape(self) -> shapes.PartialShape:
        with self._lock:
            return self._element_shape

    @property
    def dynamic_size(self) -> bool:
        with self._lock:
            return self._dynamic_size

    def check_element_shape(self, element_shape: shapes.PartialShape) -> None:
        """InvalidArgumentError if ``element_shape`` does not merge with the array's
        (TensorFlow's ``SetElemShape``'s error), changing nothing: the op that gave it
        merges it if it succeeds (TensorFlow keeps it even if the op then fails: a
        deliberate difference, README "Semantics")."""
        with self._lock:
            shapes.merge(self._element_shape, element_shape)

    def size(self) -> int:
        """TensorArraySizeV3. Fails once closed."""
        with self._lock:
            self._check_open()
            return self._size

    def nbytes(self) -> int:
        """Bytes charged now: values held (zeros not yet materialised count 0) and the
        array's and its slots' records."""
        with self._lock:
            return self._nbytes

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def record_bytes(self) -> int:
        """Bytes charged for the array's and its slots' records (``nbytes`` less values)."""
        with self._lock:
            return self._own_bytes + SLOT_BYTES * len(self._slots)

    def _set_value(self, slot: _Slot, value: np.ndarray | None) -> None:
        """Store ``value`` in ``slot``, keeping the byte count."""
        old = dtypes.nbytes(slot.value) if slot.value is not None else 0
        self._nbytes += (dtypes.nbytes(value) if value is not None else 0) - old
        slot.value = value
        self._grew()

    def _grow_to(self, size: int) -> None:
        if self.max_size is not None and size > self.max_size:
            raise _too_many_elements(self.name, size, self.max_size)
        if size > dtypes.INT32_MAX:  # (a size is an int32: a read of index 2**31 - 1 of a
            # gradient array made it 2**31 without --max-tensor-array-size, and its size
            # op then failed INTERNAL, its snapshot was refused: a review helper)
            raise InvalidArgumentError(
                f"TensorArray {self.name}: index {size - 1} would make its size exceed int32"
            )
        self._size = size

    # ------------------------------------------------------------------ writes
    def write(self, index: int, value: np.ndarray) -> None:
        """TensorArrayWriteV3.

        Preconditions: open; ``0 <= index`` and, unless dynamic, ``index < size``;
        value shape compatible with the element shape; index not yet read; not
        yet written unless this is a gradient (aggregating) array, whose repeated
        writes need exactly the existing shape.
        Side effects: the value is stored (or summed); a dynamic array grows to
        ``index + 1``; an identical-shapes array learns its element shape.
        """
        with self._atomic():
            self._check_open()
            self._write_locked(index, value)

    def scatter(self, indices: Sequence[int], value: np.ndarray) -> None:
        """TensorArrayScatterV3: ``value[i]`` to ``indices[i]``, all or nothing."""
        with self._atomic():
            self._check_open()
            if len(indices) != value.shape[0]:
                raise InvalidArgumentError(
                    f"Expected len(indices) == values.shape[0], but saw: "
                    f"{len(indices)} vs. {value.shape[0]}"
                )
            max_index = max(indices, default=-1)
            size = self._size
            if self._dynamic_size and size < max_index + 1:
                size = max_index + 1
            if max_index >= size:
                raise InvalidArgumentError(
                    f"Max scatter index must be < array size ({max_index} vs. {size})"
                )
            for i, index in enumerate(indices):
                self._write_locked(int(index), _own_piece(value[i, ...], value))

    def split(
        self,
        lengths: Sequence[int],
        value: np.ndarray,
        before_write: Callable[[], None] | None = None,
    ) -> None:
        """TensorArraySplitV3: consecutive row blocks of ``value`` to indices 0..n-1.

        ``before_write`` (the op's dtype check) runs after the size check, where
        TensorFlow's split op checks the dtype, so a call wrong in both ways gets
        TensorFlow's error.
        """
        with self._atomic():
            self._check_open()
            n = len(lengths)
            size = self._size
            if self._dynamic_size and size < n:
                size = n
            if size != n:
                raise InvalidArgumentError(
                    f"TensorArray's size is not equal to the size of lengths ({size} vs. "
                    f"{n}), and the TensorArray is not marked as dynamically resizeable"
                )
            if before_write is not None:
                before_write()
            if not self.is_grad:
                self._marked_size = n
            start = 0
            for index, length in enumerate(lengths):
                self._write_locked(index, _own_piece(value[start : start + length], value))
                start += length

    def _write_locked(self, index: int, value: np.ndarray) -> None:
        if index < 0 or (not self._dynamic_size and index >= self._size):
            raise InvalidArgumentError(
                f"TensorArray {self.name}: Tried to write to index {index} but array is "
                f"not resizeable and size is: {self._size}"
            )
        if index > dtypes.INT32_MAX - 1:
            raise InvalidArgumentError(f"TensorArray {self.name}: index {index} exceeds int32")
        if value.dtype != self.dtype:
            raise InvalidArgumentError(
                f"TensorArray {self.name}: Could not write to TensorArray index {index} "
                f"because the value dtype is {dtypes.tf_name(value.dtype)} but TensorArray "
                f"dtype is {dtypes.tf_name(self.dtype)}."
            )
        if not shapes.is_compatible(self._element_shape, value.shape):
            raise InvalidArgumentError(
                f"TensorArray {self.name}: Could not write to TensorArray index {index} "
                f"because the value shape is {shapes.debug_string(value.shape)} which is "
                f"incompatible with the TensorArray's inferred element shape: "
                f"{shapes.debug_string(self._element_shape)} (consider setting "
                f"infer_shape=False)."
            )
        existing = self._slots.get(index)
        if existing is not None and existing.read:
            raise InvalidArgumentError(
                f"TensorArray {self.name}: Could not write to TensorArray index {index} "
                f"because it has already been read."
            )
        if existing is not None and existing.written and not self.multiple_writes_aggregate:
            raise InvalidArgumentError(
                f"TensorArray {self.name}: Could not write to TensorArray index {index} "
                f"because it has already been written to."
            )
        if existing is not None and existing.written and value.shape != existing.shape:
            raise InvalidArgumentError(
                f"TensorArray {self.name}: Could not aggregate to TensorArray index {index} "
                f"because the existing shape is {shapes.debug_string(existing.shape)} but "
                f"the new input shape is {shapes.debug_string(value.shape)}."
            )
        adds = existing is not None and existing.written and existing.holds_values
        if adds and (value.dtype.kind == "b" or value.dtype == dtypes.STRING):
            # TensorFlow sums repeated gradient writes of number types only.
            raise InvalidArgumentError(
                f"tensor_array::AddToTensor type not supported: {dtypes.tf_name(value.dtype)}"
            )
        # Every check passed: mutate.
        if self.identical_element_shapes and not shapes.is_fully_defined(self._element_shape):
            self._element_shape = tuple(value.shape)
        if self._dynamic_size and index >= self._size:
            self._grow_to(index + 1)
        slot = self._slot_for_update(index)
        if not slot.written:
            self._set_value(slot, value)
            slot.shape, slot.written = tuple(value.shape), True
        elif not adds:
            self._set_value(slot, value)  # the stored "value" was only a shape: zeros
        else:
            self._set_value(slot, slot.value + value)  # never in place: see module docstring
            self._gradients_disallowed = True

    # ------------------------------------------------------------------ reads
    def read(
        self,
        index: int,
        hand_out: HandOut | None = None,
        cleared: list[Cleared] | None = None,
    ) -> np.ndarray:
        """TensorArrayReadV3.

        Preconditions: open; ``0 <= index < size`` (a gradient array also reads
        past its size, as zeros); written, or the element shape (or, for a
        gradient array, the copied forward shape) fully known, giving zeros;
        not cleared by an earlier read.
        Side effects: marks the index read; with clear_after_read drops the value.
        ``hand_out``, if given, gets the op's outputs before the op is done: should it
        raise (a gradient tape that has no room in the budget to hold them), the op is
        undone as if it had never run (a cleared element comes back). ``cleared`` gets
        what a clearing read cleared (``Cleared``)."""
        with self._atomic():
            self._check_open()
            value = self._read_locked(index)
            self._hand_out(hand_out, (value,))
            self._note_cleared(cleared)
            return value

    def gather(
        self,
        indices: Sequence[int],
        element_shape: shapes.PartialShape,
        check: Callable[[], None] | None = None,
        hand_out: HandOut | None = None,
        cleared: list[Cleared] | None = None,
    ) -> np.ndarray:
        """TensorArrayGatherV3: the values at ``indices`` stacked on a new axis 0.

        ``check`` runs every ``CHECK_EVERY`` reads (deadline, cancellation); if
        it raises, the array is left as it was. ``hand_out``, ``cleared``: as for
        ``read``."""
        with self._atomic():
            out = self._gather_locked(indices, element_shape, check)
            self._hand_out(hand_out, (out,))
            self._note_cleared(cleared)
            return out

    def _gather_locked(
        self,
        indices: Sequence[int],
        element_shape: shapes.PartialShape,
        check: Callable[[], None] | None,
    ) -> np.ndarray:
        # As TensorFlow: a gather of no indices reads nothing, so it succeeds (or
        # fails on the shape) even on a closed array.
        self._element_shape = shapes.merge(self._element_shape, element_shape)
        if len(indices) == 0:
            if not shapes.is_fully_defined(element_shape):
                raise UnimplementedError(
                    f"TensorArray has size zero, but element shape "
                    f"{shapes.debug_string(element_shape)} is not fully defined. "
                    "Currently only static shapes are supported when packing zero-size "
                    "TensorArrays."
                )
            return self._zeros((0, *fully_defined(element_shape)))
        self._check_open()
        values = self._read_many(indices, check)
        first = values[0].shape
        if not shapes.is_compatible(element_shape, first):
            raise InvalidArgumentError(
                f"TensorArray was passed element_shape {shapes.debug_string(element_shape)} "
                f"which does not match the Tensor at index 0: {shapes.debug_string(first)}"
            )
        if len(values) * int(np.prod(first)) == 0:
            # TensorFlow allocates the output from element 0's shape and, when it
            # holds no element, returns it before comparing the other shapes.
            return self._zeros((len(values), *first))
        for i, v in enumerate(values[1:], start=1):
            if v.shape != first:
                raise InvalidArgumentError(
                    f"TensorArray has inconsistent shapes.  Index 0 has shape: "
                    f"{shapes.debug_string(first)} but index {i} has shape: "
                    f"{shapes.debug_string(v.shape)}"
                )
        with self._charged_while_made(values):
            return np.stack(values)

    def concat(
        self,
        element_shape_except0: shapes.PartialShape,
        check: Callable[[], None] | None = None,
        hand_out: HandOut | None = None,
        cleared: list[Cleared] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """TensorArrayConcatV3: every value joined on axis 0, and their lengths (int64).

        ``hand_out``, ``cleared``: as for ``read``."""
        with self._atomic():
            value, lengths = self._concat_locked(element_shape_except0, check)
            self._hand_out(hand_out, (value, lengths))
            self._note_cleared(cleared)
            return value, lengths

    def _concat_locked(
        self, element_shape_except0: shapes.PartialShape, check: Callable[[], None] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        self._check_open()
        # A gradient array concatenates as many elements as its forward was
        # split into (TensorFlow's marked size); -1 (never split) means all.
        n = self._marked_size if self.is_grad and self._marked_size >= 0 else self._size
        if n == 0:
            if not shapes.is_fully_defined(element_shape_except0):
                raise UnimplementedError(
                    f"TensorArray has size zero, but element_shape_except0 "
                    f"{shapes.debug_string(element_shape_except0)} is not fully defined. "
                    "Currently only static shapes are supported when concatenating "
                    "zero-size TensorArrays."
                )
            return self._zeros((0, *fully_defined(element_shape_except0))), np.zeros(0, np.int64)
        values = self._read_many(range(n), check)
        except0 = None
        for i, v in enumerate(values):
            if v.ndim == 0:
                raise InvalidArgumentError(
                    f"Concat saw a scalar shape at index {i} but requires at least "
                    "vectors.  Did you mean to call pack?"
                )
            if i == 0:
                except0 = v.shape[1:]
                if not shapes.is_compatible(element_shape_except0, except0):
                    raise InvalidArgumentError(
                        f"TensorArray was passed element_shape_except0 "
                        f"{shapes.debug_string(element_shape_except0)} but index 0 has "
                        f"(excepting dimension 0) shape: {shapes.debug_string(except0)} "
                        "which does not match."
                    )
            elif v.shape[1:] != except0:
                raise InvalidArgumentError(
                    f"TensorArray has inconsistent shapes.  Index 0 has (excepting "
                    f"dimension 0) shape: {shapes.debug_string(except0)} but index {i} "
                    f"has (excepting dimension 0) shape: {shapes.debug_string(v.shape[1:])}"
                )
        lengths = np.array([v.shape[0] for v in values], dtype=np.int64)
        with self._charged_while_made(values):
            return np.concatenate(values), lengths

    @contextlib.contextmanager
    def _charged_while_made(self, values: Sequence[np.ndarray]) -> Iterator[None]:
        """The bytes of an output joined from ``values`` (gather, concat), charged to
        the budget while it is made: past the budget, refused before it is allocated.
        Only the byte limit of one output bounded it: four gathers of one 1 MiB
        element 1,000 times each took 4 GB at once of a server whose sessions had
        32 MiB (helper-77), before each was refused. What keeps the output (a tape,
        the session) charges it after."""
        nbytes = sum(dtypes.nbytes(v) for v in values)
        if self._budget is None or not nbytes:
            yield
            return
        self._budget.reserve(nbytes)
        try:
            yield
        finally:
            self._budget.release(nbytes)

    def _note_cleared(self, cleared: list[Cleared] | None) -> None:
        """Within a read: what it cleared (the journal holds the slots before it)."""
        if cleared is not None and self.clear_after_read and self._journal:
            cleared.append(Cleared(self, dict(self._journal)))

    def put_back(self, before: dict[int, _Slot | None]) -> int:
        """Undo a clearing read whose output reached no one (``Cleared``): each slot it
        cleared that is still cleared gets its record from ``before`` back, its value
        charged again. Nothing else can have changed such a slot (a read or a write
        of a cleared index fails), so this is the state as if the read never ran. A
        closed array takes nothing back; past the budget nothing is put back (raises).
        Returns the number of elements put back."""
        with self._atomic():
            if self._closed:
                return 0
            count = 0
            for index, old in before.items():
                slot = self._slots.get(index)
                if slot is None or not slot.cleared:
                    continue
                slot = self._slot_for_update(index)
                count += 1
                if old is None:  # an unwritten index read as zeros: unwritten again
                    self._set_value(slot, None)
                    del self._slots[index]
                    self._nbytes -= SLOT_BYTES
                    continue
                self._set_value(slot, old.value)
                slot.shape, slot.written = old.shape, old.written
                slot.read, slot.cleared = old.read, old.cleared
            return count

    def _read_many(
        self, indices: Sequence[int], check: Callable[[], None] | None = None
    ) -> list[np.ndarray]:
        """Read each index in turn, refusing before allocation once the values
        (which the caller joins into one output) would pass the byte limit."""
        values, spent = [], 0
        for count, index in enumerate(indices):
            if check is not None and count % CHECK_EVERY == 0:
                check()
            value = self._read_locked(int(index), spent)
            spent += dtypes.nbytes(value)
            self._check_output_bytes((spent // self.dtype.itemsize,))
            values.append(value)
        return values

    def _read_locked(self, index: int, spent: int = 0) -> np.ndarray:
        if index < 0 or (not self.is_grad and index >= self._size):
            raise InvalidArgumentError(
                f"Tried to read from index {index} but array size is: {self._size}"
            )
        slot = self._slots.get(index)
        if slot is None or not slot.written:
            shape = self._zeros_shape_for_unwritten(index, slot)
            if index >= self._size:
                # A gradient array read past its end grows it (TensorFlow marks
                # the new slots written with the element shape; an unwritten
                # slot of a fully-defined element shape reads the same zeros).
                self._grow_to(index + 1)
            slot = self._slot_for_update(index)
            slot.shape, slot.written = shape, True
        else:
            slot = self._slot_for_update(index)
        if slot.cleared:
            raise InvalidArgumentError(
                f"TensorArray {self.name}: Could not read index {index} twice because it was "
                "cleared after a previous read (perhaps try setting clear_after_read = false?)."
            )
        value = slot.value
        if value is None or value.size == 0:
            self._check_output_bytes(slot.shape, spent)
            value = self._zeros(slot.shape)
            self._set_value(slot, value)
        if self.clear_after_read:
            self._set_value(slot, None)
            slot.cleared = True
        slot.read = True
        return value

    def _zeros_shape_for_unwritten(self, index: int, slot: _Slot | None) -> tuple[int, ...]:
        if self.is_grad and slot is not None and len(slot.shape) > 0:
            return slot.shape
        if not shapes.is_fully_defined(self._element_shape):
            raise InvalidArgumentError(
                f"TensorArray {self.name}: Could not read from TensorArray index {index}.  "
                f"Furthermore, the element shape is not fully defined: "
                f"{shapes.debug_string(self._element_shape)}.  It is possible you are working "
                "with a resizeable TensorArray and stop_gradients is not allowing the "
                "gradients to be written.  If you set the full element_shape property on the "
                "forward TensorArray, the proper all-zeros tensor will be returned instead of "
                "incurring this error."
            )
        return tuple(self._element_shape)  # type: ignore[arg-type]

    def _zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        """Zeros of ``shape``, once ``shapes.num_elements`` accepts it (a shape NumPy
        cannot represent, even with no elements, is the caller's error)."""
        shapes.num_elements(shape, self.dtype.itemsize, what=f"TensorArray {self.name}")
        if self.dtype == dtypes.STRING:
            if int(np.prod(shape)) > 0:  # TensorFlow has no zeros of strings
                raise InvalidArgumentError("tensor_array::TensorSetZero type not supported: string")
            return np.empty(shape, dtypes.STRING)
        return np.zeros(shape, self.dtype)

    def _check_output_bytes(self, shape: Sequence[int], spent: int = 0) -> None:
        """Refuse (before allocating) a result over the byte limit, counting
        ``spent`` bytes already gathered for the same output."""
        if self.max_output_bytes is None:
            return
        nbytes = spent + int(np.prod(shape, dtype=object)) * self.dtype.itemsize
        if nbytes > self.max_output_bytes:
            raise ResourceExhaustedError(
                f"TensorArray {self.name}: the result would take over {nbytes} bytes, "
                f"more than the server's max tensor size of {self.max_output_bytes} bytes",
                reason="TENSOR_TOO_LARGE",
            )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """TensorArrayCloseV3: drop every value and slot; any later op but close fails.
        The array's own record stays (and stays charged): its handle still names it."""
        with self._lock:
            self._slots.clear()
            self._closed = True
            if self._budget is not None:
                self._budget.release(self._nbytes - self._own_bytes)
            self._nbytes = self._own_bytes

    def discard(self, *, session_closed: bool = False) -> int:
        """Close it and release everything it was charged (its session is closing, or
        forgets it); returns the bytes released. ``session_closed``: an op that still
        holds it is told its session is gone, not that the array was closed."""
        with self._lock:
            freed, self._nbytes = self._nbytes, 0
            self._own_bytes = 0
            self._slots.clear()
            self._closed = True
            self._discarded = session_closed
        if self._budget is not None:
            self._budget.release(freed)
        return freed

    def grad_charge(self, name: str) -> int:
        """What ``make_grad`` reserves for a new gradient array named ``name``: its own
        records and one per slot of this array (an estimate: slots may come meanwhile)."""
        return array_record_bytes(name) + SLOT_BYTES * len(self._slots)

    def make_grad(
        self,
        *,
        name: str,
        shape_to_prepend: tuple[int, ...] = (),
        lookup: Callable[[], TensorArray | None] = lambda: None,
        register: Callable[[TensorArray], None] = lambda ta: None,
    ) -> TensorArray:
        """Create this array's gradient array (TensorArrayGradV3 / WithShape).

        Side effects on this (forward) array: dynamic sizing is switched off for
        good, so the gradient's size stays the forward's size. The gradient
        array aggregates writes, clears after read, has this array's size,
        marked size, identical-shapes flag and element shape (``shape_to_prepend``
        in front when known), and holds a zero "soft copy" of the shape of every
        index written here. After the checks (which run on every call, as in
        TensorFlow), ``lookup`` may return the gradient array made by an earlier
        call, which is returned unchanged; otherwise ``register`` publishes the
        new one, under this array's lock. If anything raises, nothing changed.
        """
        with self._atomic():
            self._dynamic_size = False
            self._check_open()
            if self._gradients_disallowed:
                raise InvalidArgumentError(
                    f"Unable to create a gradients TensorArray for {self.name}.  Perhaps you "
                    "used the multiple_writes_aggregate flag on a previous write?  Gradient "
                    "calculation is impossible when multiple writes are performed to the "
                    "same index."
                )
            existing = lookup()
            if existing is not None:
                return existing
            element_shape = (
                None if self._element_shape is None else (*shape_to_prepend, *self._element_shape)
            )
            grad = TensorArray(
                name=name,
                dtype=self.dtype,
                size=self._size,
                element_shape=element_shape,
                identical_element_shapes=self.identical_element_shapes,
                dynamic_size=False,
                clear_after_read=True,
                multiple_writes_aggregate=True,
                is_grad=True,
                marked_size=self._marked_size,
                max_output_bytes=self.max_output_bytes,
                max_size=self.max_size,
                budget=self._budget,
            )
            # At most one record per slot, reserved before the slots are looked at: a
            # call refused for want of room costs no pass over them (33 ms at a
            # million slots, each time it was repeated).
            budget = grad._budget
            reserved = SLOT_BYTES * len(self._slots)
            try:
                if budget is not None:
                    budget.reserve(reserved)
            except BaseException:
                grad.discard()  # it was never published
                raise
            written = [i for i, slot in self._slots.items() if slot.written]
            if budget is not None:
                budget.release(reserved - SLOT_BYTES * len(written))
            for index in written:
                shape = (*shape_to_prepend, *self._slots[index].shape)
                grad._slots[index] = _Slot(shape=shape, written=True)
            grad._nbytes += SLOT_BYTES * len(written)
            register(grad)
            return grad

    # ------------------------------------------------------------------ snapshots
    def export_state(self) -> TensorArrayState:
        """Everything this array is, for a snapshot (``server.core.persistence``): its
        attributes and every slot record. Values are shared, not copied (they are
        never mutated)."""
        with self._lock:
            return TensorArrayState(
                name=self.name,
                dtype=self.dtype,
                size=self._size,
                element_shape=self._element_shape,
                identical_element_shapes=self.identical_element_shapes,
                dynamic_size=self._dynamic_size,
                clear_after_read=self.clear_after_read,
                multiple_writes_aggregate=self.multiple_writes_aggregate,
                is_grad=self.is_grad,
                marked_size=self._marked_size,
                gradients_disallowed=self._gradients_disallowed,
                closed=self._closed,
                slots={i: dataclasses.replace(slot) for i, slot in self._slots.items()},
            )

    @classmethod
    def from_state(
        cls,
        state: TensorArrayState,
        *,
        max_output_bytes: int | None = None,
        max_size: int | None = None,
        budget: MemoryBudget | None = None,
    ) -> TensorArray:
        """The array ``state`` describes, its values' bytes charged to ``budget`` (which
        raises, charging nothing, past a limit). A state that no sequence of ops could
        have made (a file whose checksum was written with bad contents) is refused
        with ValueError, naming what is wrong."""
        _check_state(state)
        ta = cls(
            name=state.name,
            dtype=state.dtype,
            size=0,
            element_shape=state.element_shape,
            identical_element_shapes=state.identical_element_shapes,
            dynamic_size=state.dynamic_size,
            clear_after_read=state.clear_after_read,
            multiple_writes_aggregate=state.multiple_writes_aggregate,
            is_grad=state.is_grad,
            marked_size=state.marked_size,
            max_output_bytes=max_output_bytes,
            max_size=max_size,
            budget=budget,
        )
        ta._size = state.size  # as it was, even past a since-lowered --max-tensor-array-size
        ta._gradients_disallowed = state.gradients_disallowed
        ta._closed = state.closed
        ta._slots = {i: dataclasses.replace(slot) for i, slot in state.slots.items()}
        nbytes = sum(dtypes.nbytes(s.value) for s in ta._slots.values() if s.value is not None)
        nbytes += SLOT_BYTES * len(ta._slots)
        if budget is not None:
            try:
                budget.reserve(nbytes)
            except BaseException:
                ta.discard()
                raise
        ta._nbytes += nbytes
        return ta

    def restore_dynamic_size(self, dynamic_size: bool) -> None:
        """Undo ``make_grad``'s switching off of dynamic sizing: a gradient
        computation that failed rolls back what it changed."""
        with self._lock:
            self._dynamic_size = dynamic_size

    def _check_open(self) -> None:
        if self._discarded:  # an op that found the array as its session closed
            raise NotFoundError(
                f"TensorArray {self.name}: its session was closed", reason="SESSION_NOT_FOUND"
            )
        if self._closed:
            raise InvalidArgumentError(f"TensorArray {self.name} has already been closed.")


@dataclasses.dataclass
class TensorArrayState:
    """A TensorArray's whole state (``TensorArray.export_state``): what a snapshot
    writes and ``TensorArray.from_state`` rebuilds. ``slots`` maps an index to its
    record (value, shape and the written/read/cleared flags)."""

    name: str
    dtype: np.dtype
    size: int
    element_shape: shapes.PartialShape
    identical_element_shapes: bool
    dynamic_size: bool
    clear_after_read: bool
    multiple_writes_aggregate: bool
    is_grad: bool
    marked_size: int
    gradients_disallowed: bool
    closed: bool
    slots: dict[int, _Slot]


def _check_state(state: TensorArrayState) -> None:
    """The invariants every TensorArray keeps, checked on a state read from a file.
    (A review helper restored hand-made ones: a size past int32, whose size op then
    failed INTERNAL and whose concat ran to the deadline; an index past a dynamic
    array's size; a cleared slot still holding its value; a read of an unwritten
    index.)"""
    if not 0 <= state.size <= dtypes.INT32_MAX:
        raise ValueError(f"TensorArray {state.name}: size {state.size} is not an int32 >= 0")
    if not -1 <= state.marked_size <= dtypes.INT32_MAX:
        raise ValueError(f"TensorArray {state.name}: marked size {state.marked_size} is invalid")
    for index, slot in state.slots.items():
        where = f"TensorArray {state.name}, index {index}"
        if not 0 <= index < state.size:  # (a write or read past the end grows the size)
            raise ValueError(f"{where}: outside its size {state.size}")
        if slot.read and not slot.written:  # (a read of an unwritten index writes zeros)
            raise ValueError(f"{where}: read but never written")
        if slot.cleared and (slot.value is not None or not slot.read):
            raise ValueError(f"{where}: cleared, but not by a read that took its value")
        if slot.written and slot.value is None and not slot.cleared and not state.is_grad:
            raise ValueError(f"{where}: written without a value (only a gradient array's are)")
        if slot.value is None:
            continue
        if slot.value.dtype != state.dtype:
            raise ValueError(f"{where}: a {slot.value.dtype} value in a {state.dtype} array")
        if tuple(slot.value.shape) != tuple(slot.shape):
            raise ValueError(f"{where}: value of shape {slot.value.shape}, slot says {slot.shape}")
        if not slot.written:
            raise ValueError(f"{where}: holds a value but is not written")


def _too_many_elements(name: str, size: int, limit: int) -> ResourceExhaustedError:
    return ResourceExhaustedError(
        f"TensorArray {name}: size {size} is over the server's limit of {limit} elements "
        "per TensorArray (--max-tensor-array-size)",
        reason="TENSOR_ARRAY_TOO_LARGE",
    )


def fully_defined(shape: shapes.PartialShape) -> tuple[int, ...]:
    """The dims of a shape that ``shapes.is_fully_defined`` has accepted."""
    assert shape is not None and all(d is not None for d in shape)
    return tuple(d for d in shape if d is not None)


def _own_piece(piece: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """A scattered or split element as an array of its own, unless it is all of
    ``whole``: a view would keep every byte of the input alive while the session is
    charged only the element's (found by a review helper: split with lengths [1, N-1],
    the large element read and cleared, held 48 MiB per array against a 192-byte
    charge, past --max-session-bytes)."""
    return piece if piece.nbytes == whole.nbytes else piece.copy()
