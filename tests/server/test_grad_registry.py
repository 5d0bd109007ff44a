"""The grad-array registry of a session (``server.core.grad_registry``) against the
plain dict it replaced, scanned as that dict was, and in the session that uses it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradserve.errors import NotFoundError
from gradserve.server.core.grad_registry import GradRegistry
from gradserve.server.core.sessions import MAX_CLOSED_ARRAYS, SessionStore

HANDLES = st.sampled_from([f"h{n}" for n in range(6)])
SOURCES = st.sampled_from(["gradients", "gradients_1", "s"])
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), HANDLES, SOURCES, HANDLES),
        st.tuples(st.just("forget"), HANDLES),
        st.tuples(st.just("pop"), SOURCES),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(STEPS)
def test_the_registry_answers_as_a_scanned_dict(steps):
    """Every lookup, removal and source question answered by the indexes is the one a
    scan of the whole dict gives (the session's code before the indexes)."""
    reg, model = GradRegistry(), {}
    for step in steps:
        if step[0] == "add":
            _, forward, source, grad = step
            if forward == grad:
                continue  # a forward array is never its own grad
            reg.add((forward, source), grad)
            model[(forward, source)] = grad
        elif step[0] == "forget":
            handle = step[1]
            reg.forget_array(handle)
            model = {k: g for k, g in model.items() if handle not in (k[0], g)}
        else:
            source = step[1]
            popped = reg.pop_source(source)
            assert sorted(popped) == sorted(g for k, g in model.items() if k[1] == source)
            model = {k: g for k, g in model.items() if k[1] != source}
        assert reg.as_dict() == model
        assert len(reg) == len(model)
        for source in ("gradients", "gradients_1", "s"):
            assert reg.has_source(source) == any(k[1] == source for k in model)
    assert GradRegistry(model.items()).as_dict() == model


def test_forgetting_a_forward_keeps_its_grad_array_and_frees_the_source():
    """Past ``MAX_CLOSED_ARRAYS`` a closed forward is forgotten: its grad array lives on
    as an array of its own, and its source counts as in use no more."""
    store = SessionStore()
    s = store.create()
    first, _ = s.create_tensor_array(tensor_array_name="fwd", dtype=np.float32, size=1)
    source = s.new_gradient_source()
    assert source == "gradients"
    grad_handle, grad = s.grad_array(first, source)
    assert s.new_gradient_source() == "gradients_1"
    s.close_tensor_array(first)
    for _ in range(MAX_CLOSED_ARRAYS):
        h, _ = s.create_tensor_array(tensor_array_name="", dtype=np.float32, size=1)
        s.close_tensor_array(h)
    with pytest.raises(NotFoundError):
        s.grad_array(first, source)
    assert s.tensor_array(grad_handle) is grad
    assert len(s._grads) == 0
    s._gradient_sources = 0
    assert s.new_gradient_source() == "gradients"  # no array holds it any more
    store.close(s.id)
    assert store.budget.used == 0


def test_dropping_a_source_removes_its_grad_arrays_only():
    store = SessionStore()
    s = store.create()
    forwards = [
        s.create_tensor_array(tensor_array_name="", dtype=np.float32, size=2)[0] for _ in range(3)
    ]
    mine = [s.grad_array(h, "gradients")[0] for h in forwards]
    other = s.grad_array(forwards[0], "gradients_1")[0]
    s.drop_grad_arrays("gradients")
    for handle in mine:
        with pytest.raises(NotFoundError):
            s.tensor_array(handle)
    assert s.grad_array(forwards[0], "gradients_1")[0] == other
    assert s._grads.as_dict() == {(forwards[0], "gradients_1"): other}
    store.close(s.id)
    assert store.budget.used == 0


def test_a_computations_own_grad_arrays_are_apart_from_the_sessions():
    """``registry``: a gradient computation's grad arrays. A TensorArrayGradV3 under
    the same source gets another array; dropping the computation's leaves the user's;
    a snapshot taken meanwhile leaves the computation's out (restored, no one could
    name them)."""
    store = SessionStore()
    s = store.create()
    forward, _ = s.create_tensor_array(tensor_array_name="", dtype=np.float32, size=2)
    own = GradRegistry()
    sweeps, _ = s.grad_array(forward, "gradients", registry=own)
    users, _ = s.grad_array(forward, "gradients")
    assert sweeps != users
    assert s.grad_array(forward, "gradients", registry=own)[0] == sweeps
    state = s.export_state(idle_timeout=60)
    assert set(state.arrays) == {forward, users}
    assert state.grads == {(forward, "gradients"): users}
    s.drop_grad_arrays("gradients", own)
    with pytest.raises(NotFoundError):
        s.tensor_array(sweeps)
    assert s.grad_array(forward, "gradients")[0] == users
    store.close(s.id)
    assert store.budget.used == 0
