"""Unit tests of the pure TensorArray state machine (no server)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gradserve.errors import InvalidArgumentError, ResourceExhaustedError, UnimplementedError
from gradserve.server.core.tensor_array import ARRAY_BYTES, SLOT_BYTES, TensorArray
from tests.conftest import DeadlineOnCall

F32 = np.float32


def make(size=3, **kw) -> TensorArray:
    kw.setdefault("dtype", np.dtype(F32))
    return TensorArray(name="ta_1", size=size, **kw)


def v(*values) -> np.ndarray:
    return np.array(values, F32)


def test_write_read_and_clear_after_read():
    ta = make()
    ta.write(1, v(1, 2))
    np.testing.assert_array_equal(ta.read(1), v(1, 2))
    with pytest.raises(InvalidArgumentError, match="cleared after a previous read"):
        ta.read(1)


def test_read_many_without_clear():
    ta = make(clear_after_read=False)
    ta.write(0, v(3))
    for _ in range(3):
        np.testing.assert_array_equal(ta.read(0), v(3))


def test_write_after_read_is_refused():
    ta = make(clear_after_read=False)
    ta.write(0, v(3))
    ta.read(0)
    with pytest.raises(InvalidArgumentError, match="because it has already been read"):
        ta.write(0, v(4))


def test_negative_and_out_of_range_indices():
    ta = make(size=2)
    with pytest.raises(InvalidArgumentError, match="Tried to write to index -1"):
        ta.write(-1, v(1))
    with pytest.raises(
        InvalidArgumentError, match="Tried to read from index 2 but array size is: 2"
    ):
        ta.read(2)


def test_dynamic_size_grows_on_write():
    ta = make(size=0, dynamic_size=True)
    ta.write(4, v(1))
    assert ta.size() == 5


def test_failed_write_does_not_grow_a_dynamic_array():
    ta = make(size=0, dynamic_size=True, element_shape=(2,))
    with pytest.raises(InvalidArgumentError, match="incompatible"):
        ta.write(7, v(1, 2, 3))
    assert ta.size() == 0


def test_identical_element_shapes_learns_shape_from_first_write():
    ta = make(identical_element_shapes=True)
    ta.write(0, v(1, 2))
    assert ta.element_shape == (2,)
    with pytest.raises(InvalidArgumentError, match="inferred element shape: \\[2\\]"):
        ta.write(1, v(1, 2, 3))


def test_unwritten_read_zeros_when_shape_known():
    ta = make(element_shape=(2, 2))
    np.testing.assert_array_equal(ta.read(1), np.zeros((2, 2), F32))


def test_partial_element_shape_is_not_enough_for_zeros():
    ta = make(element_shape=(2, None))
    with pytest.raises(InvalidArgumentError, match="not fully defined: \\[2,\\?\\]"):
        ta.read(0)


def test_scatter_is_all_or_nothing():
    ta = make(size=3)
    ta.write(2, v(9, 9))
    with pytest.raises(InvalidArgumentError, match="already been written"):
        ta.scatter([0, 1, 2], np.ones((3, 2), F32))
    # TensorFlow would have kept indices 0 and 1; nothing changed here.
    ta.write(0, v(5, 5))
    ta.write(1, v(6, 6))
    np.testing.assert_array_equal(ta.gather([0, 1, 2], None), [[5, 5], [6, 6], [9, 9]])


def test_gather_failure_does_not_clear_earlier_reads():
    ta = make(size=2)
    ta.write(0, v(1))
    with pytest.raises(InvalidArgumentError, match="not yet been written|not fully defined"):
        ta.gather([0, 1], None)
    np.testing.assert_array_equal(ta.read(0), v(1))  # not cleared by the failed gather


def test_gather_empty_needs_full_shape():
    ta = make(size=0)
    with pytest.raises(UnimplementedError):
        ta.gather([], None)
    assert ta.gather([], (3,)).shape == (0, 3)


def test_gather_merges_element_shape():
    ta = make(size=1, element_shape=(None, 2))
    with pytest.raises(InvalidArgumentError, match="Incompatible shapes during merge"):
        ta.gather([0], (3, 3))
    ta.write(0, np.ones((4, 2), F32))
    assert ta.gather([0], (4, None)).shape == (1, 4, 2)
    assert ta.element_shape == (4, 2)


def test_concat_and_lengths():
    ta = make(size=3)
    ta.split([1, 0, 2], np.arange(6, dtype=F32).reshape(3, 2))
    value, lengths = ta.concat(None)
    np.testing.assert_array_equal(value, np.arange(6, dtype=F32).reshape(3, 2))
    assert lengths.tolist() == [1, 0, 2] and lengths.dtype == np.int64


def test_concat_rejects_scalars_and_inconsistent_shapes():
    ta = make(size=1)
    ta.write(0, np.array(1, F32))
    with pytest.raises(InvalidArgumentError, match="Concat saw a scalar shape at index 0"):
        ta.concat(None)
    ta = make(size=2)
    ta.write(0, np.ones((1, 2), F32))
    ta.write(1, np.ones((1, 3), F32))
    with pytest.raises(InvalidArgumentError, match="inconsistent shapes"):
        ta.concat(None)


def test_split_size_must_match_unless_dynamic():
    ta = make(size=2)
    with pytest.raises(
        InvalidArgumentError, match="not equal to the size of lengths \\(2 vs. 3\\)"
    ):
        ta.split([1, 1, 1], np.ones((3, 1), F32))
    grow = make(size=0, dynamic_size=True)
    grow.split([1, 1, 1], np.ones((3, 1), F32))
    assert grow.size() == 3


def test_close_then_use():
    ta = make()
    ta.close()
    with pytest.raises(InvalidArgumentError, match="has already been closed"):
        ta.size()
    ta.close()  # closing twice is fine, as in TensorFlow


def test_grad_sums_writes_and_freezes_forward_size():
    fwd = make(size=1, dynamic_size=True)
    fwd.write(2, v(1, 2))
    grad = fwd.make_grad(name="ta_1@g")
    assert grad.size() == 3 and not fwd.dynamic_size
    with pytest.raises(InvalidArgumentError, match="not resizeable and size is: 3"):
        fwd.write(5, v(0, 0))
    grad.write(2, v(1, 1))
    grad.write(2, v(2, 3))
    grad.write(2, v(0.5, 0.5))
    np.testing.assert_array_equal(grad.read(2), v(3.5, 4.5))


def test_grad_needs_exact_shape_to_aggregate():
    fwd = make(size=1)
    fwd.write(0, v(1, 2))
    grad = fwd.make_grad(name="g")
    with pytest.raises(InvalidArgumentError, match="Could not aggregate to TensorArray index 0"):
        grad.write(0, v(1, 2, 3))


def test_grad_soft_copy_reads_zeros_of_forward_shape():
    fwd = make(size=2)
    fwd.write(0, np.ones((2, 3), F32))
    grad = fwd.make_grad(name="g")
    np.testing.assert_array_equal(grad.read(0), np.zeros((2, 3), F32))
    with pytest.raises(InvalidArgumentError, match="not fully defined"):
        grad.read(1)  # never written forward: shape unknown


def test_grad_concat_of_unwritten_elements_is_zeros():
    """TensorFlow 2.21 kills its process here (SIGSEGV, seen by hand and in
    record_tensor_array_traces.py); a grad array's unwritten elements of a known shape
    are zeros for Concat as for Read and Gather."""
    fwd = make(size=2, element_shape=(1, 2))
    grad = fwd.make_grad(name="g")
    grad.write(1, np.array([[3, 4]], F32))
    value, lengths = grad.concat(None)
    np.testing.assert_array_equal(value, [[0, 0], [3, 4]])
    assert value.dtype == F32 and lengths.tolist() == [1, 1]


def test_gather_of_no_indices_ignores_close():
    """As TensorFlow: a gather of nothing reads nothing, so a closed array answers."""
    ta = make(size=0)
    ta.close()
    assert ta.gather([], (2,)).shape == (0, 2)
    with pytest.raises(UnimplementedError):
        ta.gather([], None)
    with pytest.raises(InvalidArgumentError, match="already been closed"):
        ta.gather([0], (2,))


def test_grad_with_shape_prepends():
    fwd = make(size=1, element_shape=(3,))
    fwd.write(0, v(1, 2, 3))
    grad = fwd.make_grad(name="g", shape_to_prepend=(2,))
    assert grad.element_shape == (2, 3)
    np.testing.assert_array_equal(grad.read(0), np.zeros((2, 3), F32))


def test_grad_of_closed_forward_changes_nothing():
    fwd = make(size=1, dynamic_size=True)
    fwd.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        fwd.make_grad(name="g")
    assert fwd.dynamic_size  # TensorFlow would have switched it off anyway


def test_grad_array_read_past_end_grows_it():
    fwd = make(size=1, element_shape=(2,))
    grad = fwd.make_grad(name="g")
    np.testing.assert_array_equal(grad.read(3), np.zeros(2, F32))
    assert grad.size() == 4


def test_output_byte_limit():
    ta = make(size=3, element_shape=(1000,), max_output_bytes=1000)
    with pytest.raises(ResourceExhaustedError, match="max tensor size"):
        ta.read(0)


def test_huge_size_costs_nothing_until_used():
    ta = make(size=2**31 - 1)
    ta.write(2**31 - 2, v(1))
    assert ta.size() == 2**31 - 1
    assert ta.nbytes() == 4 + ta.record_bytes()
    assert ta.record_bytes() == ARRAY_BYTES + 2 * len("ta_1") + SLOT_BYTES  # one slot


def test_gather_checks_between_reads_and_leaves_array_unchanged():
    from gradserve.errors import DeadlineExceededError
    from gradserve.server.core.tensor_array import CHECK_EVERY

    n = 3 * CHECK_EVERY
    ta = make(size=n, element_shape=(1,))
    check = DeadlineOnCall(3)
    with pytest.raises(DeadlineExceededError):
        ta.gather(list(range(n)), None, check)
    assert check.calls == 3
    assert ta.nbytes() == ta.record_bytes() == ARRAY_BYTES + 2 * len("ta_1")  # rolled back
    np.testing.assert_array_equal(ta.read(0), [0.0])  # index 0 was not cleared


def test_unrepresentable_empty_shape_is_invalid_argument():
    """Found by the fuzzer: NumPy refuses [0, 2**40, 2**40] although it holds nothing."""
    ta = make(size=0)
    with pytest.raises(InvalidArgumentError, match="is too large"):
        ta.gather([], (2**40, 2**40))
    with pytest.raises(InvalidArgumentError, match="is too large"):
        ta.concat((2**40, 2**40))


def test_what_an_array_holds_is_charged_to_its_budget_records_included():
    """Values and the records of the array and its slots: 600,000 arrays of a few bytes,
    or slots holding empty values, used to take server memory no budget saw."""
    from gradserve.server.core.budget import MemoryBudget

    budget = MemoryBudget(None, "session")
    ta = make(size=4, budget=budget)
    own = ARRAY_BYTES + 2 * len("ta_1")
    assert budget.used == own
    ta.write(0, np.zeros(0, F32))  # an empty value: its slot still costs
    ta.write(1, v(1, 2))
    assert budget.used == own + 2 * SLOT_BYTES + 8 == ta.nbytes()
    g = ta.make_grad(
        name="ta_1@s", shape_to_prepend=(), lookup=lambda: None, register=lambda g: None
    )
    assert (
        budget.used == own + 2 * SLOT_BYTES + 8 + ARRAY_BYTES + 2 * len("ta_1@s") + 2 * SLOT_BYTES
    )
    g.discard()
    ta.close()  # the values and slots go; the array's own record stays with its handle
    assert budget.used == own
    assert ta.discard() == own and budget.used == 0

    tight = MemoryBudget(own - 1, "session")
    with pytest.raises(ResourceExhaustedError, match="pass the limit"):
        make(budget=tight)
    assert tight.used == 0
    room = MemoryBudget(own + SLOT_BYTES, "session")
    full = make(budget=room)
    full.write(0, np.zeros(0, F32))
    with pytest.raises(ResourceExhaustedError, match="pass the limit"):
        full.write(1, np.zeros(0, F32))  # a slot more than the limit holds
    assert room.used == own + SLOT_BYTES and full.record_bytes() == room.used


@pytest.mark.parametrize("op", ["split", "scatter"])
def test_a_stored_piece_does_not_keep_the_whole_input_alive(op):
    """Each element is charged its own bytes, so it must hold only those: a view of
    the input kept all of it alive (a review helper: split [1, N-1] of 48 MiB, the
    large element read and cleared, left 48 MiB held against a 192-byte charge)."""
    value = np.arange(12, dtype=F32).reshape(4, 3)
    ta = make(size=2)
    if op == "split":
        ta.split([1, 3], value)
    else:
        ta.scatter([0, 1], value[:2].copy())
    first = ta.read(0)
    np.testing.assert_array_equal(first.reshape(-1)[:3], [0, 1, 2])
    assert first.base is None or first.base.nbytes == first.nbytes  # not a view of the input


def test_put_back_undoes_a_clearing_read_exactly():
    """``Cleared.put_back`` (a read whose output reached no one): a written element
    comes back readable once, an unwritten one read as zeros is unwritten again, its
    slot record's bytes released; a non-clearing read notes nothing; a closed array
    takes nothing back."""
    from gradserve.server.core.budget import MemoryBudget

    budget = MemoryBudget(None, "session")
    ta = make(size=3, element_shape=(2,), budget=budget)
    ta.write(0, np.ones(2, np.float32))
    empty = budget.used
    cleared: list = []
    np.testing.assert_array_equal(ta.read(0, cleared=cleared), [1, 1])
    np.testing.assert_array_equal(ta.read(1, cleared=cleared), [0, 0])  # unwritten: zeros
    assert [c.put_back() for c in reversed(cleared)] == [1, 1]
    assert budget.used == empty
    np.testing.assert_array_equal(ta.read(0), [1, 1])
    with pytest.raises(InvalidArgumentError, match="twice"):
        ta.read(0)
    ta.write(1, np.full(2, 5, np.float32))  # unwritten again: writable
    assert cleared[0].put_back() == 0  # nothing cleared by that read any more

    kept = make(size=1, clear_after_read=False)
    kept.write(0, np.ones(1, np.float32))
    noted: list = []
    kept.read(0, cleared=noted)
    assert noted == []

    ta.close()
    assert cleared[1].put_back() == 0


@pytest.mark.parametrize(
    "edit, says",
    [
        (dict(size=2**40), "not an int32"),
        (dict(marked_size=2**62), "marked size"),
        (dict(slot=dict(index=7)), "outside its size"),
        (dict(slot=dict(read=True, written=False, value=None)), "read but never written"),
        (dict(slot=dict(read=True, cleared=True)), "cleared, but not by a read"),
        (dict(slot=dict(value=None)), "written without a value"),
    ],
)
def test_a_state_no_ops_could_make_is_refused(edit, says):
    """A hand-edited snapshot (its checksum made again) is refused, naming what is
    wrong: a review helper restored a size of 2**40 (the size op then failed INTERNAL,
    a concat ran to the deadline) and the other states below."""
    ta = make(size=3, dynamic_size=True)
    ta.write(1, v(1, 2))
    state = ta.export_state()
    slot_edit = edit.pop("slot", None)
    state = dataclasses.replace(state, **edit)
    if slot_edit is not None:
        index = slot_edit.pop("index", 1)
        state.slots = {index: dataclasses.replace(state.slots[1], **slot_edit)}
    with pytest.raises(ValueError, match=says):
        TensorArray.from_state(state)
    TensorArray.from_state(ta.export_state())  # (the unedited one is fine)


def test_a_gradient_array_read_past_its_end_stays_within_int32():
    """A gradient array read past its end grows to the index + 1: at index 2**31 - 1,
    without a size limit, to 2**31, which its size op could not return (INTERNAL) and
    a snapshot of which restore refused (the session lost; a review helper)."""
    forward = make(size=1, element_shape=(1,))
    grad = forward.make_grad(name="ta_1@g")
    with pytest.raises(InvalidArgumentError, match="exceed int32"):
        grad.read(2**31 - 1)
    np.testing.assert_array_equal(grad.read(2**31 - 2), [0])
    assert grad.size() == 2**31 - 1
    TensorArray.from_state(grad.export_state())
