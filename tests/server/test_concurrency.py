"""Many client threads at once: shared arrays stay consistent, results exact."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gradserve
from gradserve.errors import Code, InvalidArgumentError, NotFoundError, SessionLostError
from gradserve.server.core.sessions import SessionStore
from gradserve.v1 import service_pb2

THREADS = 16
PER_THREAD = 25


def run_threads(fn) -> list[BaseException]:
    failures: list[BaseException] = []

    def guarded(k):
        try:
            fn(k)
        except BaseException as e:  # noqa: BLE001 - collected and asserted on
            failures.append(e)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return failures


def test_shared_array_each_index_written_exactly_once(target):
    with gradserve.Client(target) as owner:
        n = THREADS * PER_THREAD
        ta = owner.tensor_array(np.float64, size=n, clear_after_read=False)
        wins = np.zeros(n, int)

        def worker(k):
            with gradserve.Client(target, session_id=owner.session_id) as c:
                for i in range(n):  # every thread races for every index
                    if (i + k) % 4:
                        continue
                    try:
                        c.raw_ops.TensorArrayWriteV3(ta.handle, i, np.array([i, k], float), 0.0)
                        wins[i] += 1
                    except gradserve.errors.InvalidArgumentError as e:
                        assert "already been written to" in str(e)

        assert run_threads(worker) == []
        assert (wins == 1).all()  # exactly one writer won each index
        stacked = ta.stack()
        np.testing.assert_array_equal(stacked[:, 0], np.arange(n))


def test_gradient_aggregation_under_contention(target):
    with gradserve.Client(target) as owner:
        fwd = owner.tensor_array(np.float64, size=4)
        for i in range(4):
            fwd.write(i, np.zeros(3))
        grad = fwd.grad("gradients")

        def worker(k):
            with gradserve.Client(target, session_id=owner.session_id) as c:
                for j in range(PER_THREAD):
                    # Same source from every thread: the same grad array.
                    g, flow = c.raw_ops.TensorArrayGradV3(fwd.handle, 0.0, "gradients")
                    assert g.id == grad.handle.id
                    c.raw_ops.TensorArrayWriteV3(g, j % 4, np.full(3, 1.0), flow)

        assert run_threads(worker) == []
        total = sum(grad.read(i).sum() for i in range(4))
        assert total == THREADS * PER_THREAD * 3


def test_separate_sessions_in_parallel(target):
    def worker(k):
        with gradserve.Client(target) as c:
            ta = c.tensor_array(np.int64, size=PER_THREAD)
            for i in range(PER_THREAD):
                ta.write(i, np.array([k, i]))
            got = ta.stack()
            np.testing.assert_array_equal(got, [[k, i] for i in range(PER_THREAD)])

    assert run_threads(worker) == []


def test_a_call_that_finds_its_session_closed_is_told_so_not_that_its_handle_is_missing():
    """A call racing CloseSession (or the TTL) got past the session lookup, then found
    its TensorArray, tensor or tape gone: it said TENSOR_ARRAY_NOT_FOUND,
    TENSOR_NOT_FOUND or "has already been closed" (44 of 240 racing calls, in a review
    helper's ``close_error_codes.py``), which the SDK cannot tell from a wrong handle.
    Each lookup, and an array the call already held, now says SESSION_NOT_FOUND."""
    store = SessionStore()
    session = store.create()
    handle, held = session.create_tensor_array(
        tensor_array_name="", dtype=np.float32, size=2, clear_after_read=False
    )
    held.write(0, np.ones(3, np.float32))
    tensor = session.put(np.ones(3, np.float32))
    tape = session.start_tape(persistent=True, watch_accessed_variables=False)
    store.close(session.id)
    for lookup in (
        lambda: session.tensor_array(handle),
        lambda: session.get(tensor),
        lambda: session.tape(tape.id),
        lambda: held.read(0),
        lambda: held.write(1, np.ones(3, np.float32)),
    ):
        with pytest.raises(NotFoundError) as info:
            lookup()
        assert info.value.reason == "SESSION_NOT_FOUND"
    # Regions too: the SDK answers REGION_NOT_FOUND by registering again.
    for lookup in (
        lambda: session.regions.byte_size("r"),
        lambda: session.regions.unregister("r"),
    ):
        with pytest.raises(NotFoundError) as info:
            lookup()
        assert info.value.reason == "SESSION_NOT_FOUND"
    # An array closed by TensorArrayCloseV3, or forgotten by a live session (past
    # MAX_CLOSED_ARRAYS), is still TensorFlow's INVALID_ARGUMENT, not a lost session.
    live = store.create()
    handle, _ = live.create_tensor_array(tensor_array_name="", dtype=np.float32, size=1)
    array = live.tensor_array(handle)
    live.close_tensor_array(handle)
    with pytest.raises(InvalidArgumentError, match="has already been closed"):
        array.read(0)
    forgotten, _ = live.create_tensor_array(tensor_array_name="", dtype=np.float32, size=1)
    gone = live.tensor_array(forgotten)
    gone.discard()  # as the session forgets an old closed array
    with pytest.raises(InvalidArgumentError, match="has already been closed"):
        gone.read(0)
    store.close(live.id)


def test_a_batch_step_that_finds_its_session_gone_raises_session_lost(target):
    """The SDK built a Batch step's error from its code alone: SESSION_NOT_FOUND was a
    plain NotFoundError there, not SessionLostError as for any other call."""
    with gradserve.Client(target) as client:
        real = client._call

        def session_closed_at_step_0(rpc, request, **kw):
            if rpc != "Batch":
                return real(rpc, request, **kw)
            reply = service_pb2.BatchResponse(failed_step=0)
            reply.error.code = Code.NOT_FOUND
            reply.error.message = "Batch step 0 (StopGradient): session 'x' is closed"
            reply.error.reason = "SESSION_NOT_FOUND"
            return reply

        client._call = session_closed_at_step_0
        batch = client.batch()
        batch.raw_ops.StopGradient(np.ones(1))
        with pytest.raises(SessionLostError, match="session lost") as info:
            batch.run()
        assert info.value.step == 0 and info.value.reason == "SESSION_NOT_FOUND"
