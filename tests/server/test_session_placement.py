"""``Session.get_placed``: a resident tensor moves to where ops compute, once, charged once."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve.errors import NotFoundError
from gradserve.server.core.budget import MemoryBudget
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES, Session


class Placed(np.ndarray):
    """Stands for a device array: a distinct type, same bytes."""


def place(array):
    return array if isinstance(array, Placed) else np.array(array).view(Placed)


@pytest.fixture
def session():
    return Session("s" * 24, budget=MemoryBudget(1 << 20, "test"))


def test_placed_copy_replaces_the_host_array_and_is_reused(session):
    tensor_id = session.put(np.arange(6.0))
    calls = []

    def counting(array):
        calls.append(type(array))
        return place(array)

    first = session.get_placed(tensor_id, counting)
    second = session.get_placed(tensor_id, counting)
    assert isinstance(first, Placed) and second is first
    assert calls == [np.ndarray, Placed]  # copied once; the second read finds it placed
    assert session.get(tensor_id) is first
    np.testing.assert_array_equal(first, np.arange(6.0))
    assert session.budget.used == 48 + TENSOR_RECORD_BYTES  # one copy's bytes, not two
    session.delete([tensor_id])
    assert session.budget.used == 0


def test_host_placement_changes_nothing(session):
    array = np.ones(3)
    tensor_id = session.put(array)
    assert session.get_placed(tensor_id, lambda a: a) is array
    assert session.get(tensor_id) is array


def test_a_tensor_deleted_while_being_placed_stays_deleted(session):
    tensor_id = session.put(np.ones(4))

    def delete_then_place(array):
        session.delete([tensor_id])  # another call deletes it meanwhile
        return place(array)

    assert isinstance(session.get_placed(tensor_id, delete_then_place), Placed)
    with pytest.raises(NotFoundError):
        session.get(tensor_id)
    assert session.budget.used == 0


def test_unknown_id_is_not_found(session):
    with pytest.raises(NotFoundError):
        session.get_placed("nope", place)
