"""One array held under several ids is charged once.

StopGradient returns its input itself (tensors held by the server are never
mutated): kept, or held by a tape, the output of a resident tensor is the same array
under a new id. It was charged again, so a session could not keep StopGradient of a
tensor over half its limit, and held twice the memory it used in its budget. Now
the new id is an *alias*: it shares the tensor's bytes, and only its record
(``TENSOR_RECORD_BYTES``, charged for every id) is charged besides. An id's record
goes when nothing names the id any more, the bytes when nothing holds the tensor.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradserve
from gradserve.errors import NotFoundError, ResourceExhaustedError
from gradserve.server import run_server
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES, Session
from gradserve.server.core.tape import RECORD_BYTES

R = TENSOR_RECORD_BYTES
BIG = 600 << 10  # over half of the 1 MiB sessions below


@pytest.fixture(scope="module")
def tight():
    with run_server(port=0, device="cpu", max_session_bytes=1 << 20) as server:
        yield server


@pytest.fixture
def client(tight):
    with gradserve.Client(f"127.0.0.1:{tight.port}", shared_memory=False) as c:
        yield c


def used(server, client) -> int:
    return server.store.get(client.session_id).budget.used


def test_stop_gradient_of_a_resident_tensor_kept_is_charged_once(tight, client):
    value = np.arange(BIG // 4, dtype=np.float32)
    x = client.put(value)
    out = client.raw_ops.StopGradient(x, keep=True)
    assert out.id != x.id
    assert used(tight, client) == BIG + 2 * R  # before: refused, over the 1 MiB limit
    client.delete(x)  # the output stays, and so do its bytes
    assert used(tight, client) == BIG + R
    np.testing.assert_array_equal(client.get(out), value)
    client.delete(out)
    assert used(tight, client) == 0
    with pytest.raises(NotFoundError):
        client.get(out)


def test_many_kept_aliases_cost_a_record_each(tight, client):
    x = client.put(np.ones(BIG // 4, np.float32))
    batch = client.batch()
    for _ in range(100):
        batch.raw_ops.StopGradient(x, keep=True)
    outs = batch.run()
    assert used(tight, client) == BIG + 101 * R
    client.delete(*outs)
    assert used(tight, client) == BIG + R


def test_a_tape_holds_stop_gradient_of_a_resident_tensor_as_an_alias(tight, client):
    value = np.arange(BIG // 4, dtype=np.float32)
    x = client.put(value)
    with client.gradient_tape(persistent=True) as tape:
        out = client.raw_ops.StopGradient(x)
    np.testing.assert_array_equal(out, value)
    assert used(tight, client) == BIG + 2 * R + RECORD_BYTES
    client.delete(x)
    # The tape holds it under both ids: x (the op's input) and its own alias.
    assert used(tight, client) == BIG + 2 * R + RECORD_BYTES
    tape.release()
    client.keep_alive()
    assert used(tight, client) == 0


def test_ops_that_pay_ahead_pay_an_alias_its_record(tight, client):
    """A TensorArray read and Gradients pay for keeping their outputs before they run
    (a result is never refused after the op changed state): an output that is an
    array the session holds (an element written from a resident tensor; a gradient
    that is the given output gradient itself) is paid its record, not its bytes, so
    it fits a session that could not hold it twice."""
    n = 345 << 10
    x = client.put(np.ones(n // 4, np.float32))
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32, clear_after_read=False)
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
    before = used(tight, client)  # x, and the element (the array charges its own)
    assert before > (1 << 20) - n
    out = client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32, keep=True)
    assert used(tight, client) == before + R
    client.delete(out, x)
    client.raw_ops.TensorArrayCloseV3(h)
    assert used(tight, client) < 4 * R  # the closed array's records

    m = 400 << 10
    g = client.put(np.full(m // 4, 2.0, np.float32))
    y = client.put(np.ones(m // 4, np.float32))
    with client.gradient_tape(persistent=True) as tape:
        tape.watch(y)
    before = used(tight, client)
    assert before + m > 1 << 20
    grad = tape.gradient(y, y, output_gradients=g, keep=True)  # g itself
    assert used(tight, client) == before + R
    np.testing.assert_array_equal(client.get(grad), np.full(m // 4, 2.0, np.float32))


@contextlib.contextmanager
def _original_goes_at_the_forecast(session, original: str, leave: int):
    """Another call deletes ``original`` and fills the room it freed but ``leave``
    bytes just as an op forecasts what keeping an alias of it will cost
    (``Session.keeping_charges``)."""
    forecast = Session.keeping_charges
    filler: list[str] = []

    def racing(self, array, nbytes=None):
        charges = forecast(self, array, nbytes)
        if not filler:
            self.delete([original])
            room = self.budget.limit - self.budget.used
            filler.append(self.put(np.zeros((room - R - leave) // 4, np.float32)))
        return charges

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Session, "keeping_charges", racing)
        yield
    session.delete(filler)


def test_a_read_that_clears_an_alias_pays_it_in_full_before_the_clear(tight, client):
    """The read's credit (the element it clears) pays what the forecast (a record)
    may be short of: if the original goes meanwhile the read is refused before it
    clears the element, never after (before: refused after, the element lost)."""
    n = 300 << 10
    x = client.put(np.arange(n // 4, dtype=np.float32))
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)  # clear_after_read
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
    session = tight.store.get(client.session_id)
    with _original_goes_at_the_forecast(session, x.id, leave=R // 2):
        with pytest.raises(ResourceExhaustedError):
            client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32, keep=True)
    value = client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32)  # still there
    np.testing.assert_array_equal(value, np.arange(n // 4, dtype=np.float32))


def test_gradients_pin_an_alias_until_it_is_kept(tight, client):
    """A gradient that is a held array (the given output gradient itself) is paid its
    record and pinned: the original deleted meanwhile, the result is still kept as an
    alias (before: refused after the non-persistent tape was released, lost)."""
    m = 300 << 10
    g = client.put(np.full(m // 4, 2.0, np.float32))
    y = client.put(np.ones(m // 4, np.float32))
    with client.gradient_tape() as tape:
        tape.watch(y)
    session = tight.store.get(client.session_id)
    with _original_goes_at_the_forecast(session, g.id, leave=R + R // 2):
        grad = tape.gradient(y, y, output_gradients=g, keep=True)
    np.testing.assert_array_equal(client.get(grad), np.full(m // 4, 2.0, np.float32))


# --------------------------------------------------------------------- the domain
SIZES = st.sampled_from([0, 4, 400, 4000])
STEP = st.one_of(
    st.tuples(st.just("put"), SIZES),
    st.tuples(st.just("alias"), st.integers(0, 50)),
    st.tuples(st.just("delete"), st.integers(0, 50)),
    st.tuples(st.just("tape holds"), st.integers(0, 50)),
    st.tuples(st.just("tape alias"), st.integers(0, 50)),
    st.tuples(st.just("release"), st.integers(0, 50)),
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(STEP, max_size=40))
def test_each_held_array_is_charged_its_bytes_once_and_a_record_per_id(steps):
    """Resident ids and their aliases, tapes holding them (by id, or an alias of
    their own), deletes and releases in any order: the budget holds each array's
    bytes once while anything holds it, and a record for each id while anything
    names it; nothing once all is let go."""
    session = Session("s")
    ids: list[str] = []  # the id table, as the test keeps it
    tapes: list[tuple[Any, list[str]]] = []  # each tape, and the ids it holds

    def pick(n: int, among: list) -> Any:
        return among[n % len(among)] if among else None

    for op, arg in steps:
        if op == "put":
            ids.append(session.put(np.full(arg // 4, 1.0, np.float32)))
        elif op == "alias" and (t := pick(arg, ids)) is not None:
            ids.append(session.put(session.get(t)))
        elif op == "delete" and (t := pick(arg, ids)) is not None:
            assert session.delete([t]) == 1
            ids.remove(t)
        elif op in ("tape holds", "tape alias") and (t := pick(arg, ids)) is not None:
            tape = session.start_tape(persistent=True, watch_accessed_variables=False)
            if op == "tape holds":
                assert session.hold_for_tape(tape, t)
                tapes.append((tape, [t]))
            else:
                alias = session.keep_for_tapes([tape], session.get(t))
                assert alias is not None
                tapes.append((tape, [alias]))
        elif op == "release" and (held := pick(arg, tapes)) is not None:
            session.release_tape(held[0].id)
            tapes.remove(held)
        named = {*ids, *(t for _, held in tapes for t in held)}
        arrays = {id(a): a for a in (_held_array(session, tapes, t) for t in named)}
        assert session.budget.used == sum(a.nbytes for a in arrays.values()) + R * len(named)
    for t in ids:
        session.delete([t])
    for tape, _ in tapes:
        session.release_tape(tape.id)
    assert session.budget.used == 0
    session.close()


def _held_array(session: Session, tapes: list, tensor_id: str) -> np.ndarray:
    """The array ``tensor_id`` names, in the id table or on a tape."""
    try:
        return session.get(tensor_id)
    except NotFoundError:
        return next(
            held[tensor_id] for tape, _ in tapes if (held := tape.held) and tensor_id in held
        ).array
