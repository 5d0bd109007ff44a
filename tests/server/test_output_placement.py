"""What an op pays for ahead is what ``emit`` keeps.

An op that changes state (a read that clears its element, Gradients on a tape it then
releases) pays for keeping its outputs before it changes anything
(``CallIO.hand_out_for``), from ``CallIO._staying``'s prediction of where ``emit``
will put each one: the call's output region, inline, or kept in the session. A
prediction that kept too little would let the op change state and then be refused
for keeping its output (the result lost); one that kept too much would refuse an op
that fits. Here the prediction meets ``emit`` itself on random outputs: sizes around
the response's budget, the client's inline limit and the region's room, kept or not,
strings (which never go into a region).
"""

from __future__ import annotations

import os
from multiprocessing import shared_memory

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradserve import protocol
from gradserve.server import run_server
from gradserve.server.core import regions
from gradserve.server.transport import shm_wire
from gradserve.server.transport.wire import CallIO
from gradserve.v1 import tensor_pb2

REGION_BYTES = 1 << 14


@pytest.fixture(scope="module")
def region_object():
    """One shared-memory object; each example registers it with a fresh session."""
    name = f"{regions.KEY_PREFIX}test_{os.urandom(8).hex()}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=REGION_BYTES)
    nonce = os.urandom(32)
    shm.buf[:32] = nonce
    yield name, nonce, shm
    shm.close()
    shm.unlink()


OUTPUT = st.one_of(
    st.integers(0, 3000).map(lambda n: np.arange(n, dtype=np.float32)),
    st.integers(0, 40).map(lambda n: np.array(["x" * n] * 3, dtype=object)),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    outputs=st.lists(st.tuples(OUTPUT, st.booleans()), min_size=1, max_size=6),
    inline_budget=st.integers(0, 20_000),
    inline_limit=st.integers(1, 20_000),
    with_region=st.booleans(),
    region_used=st.integers(protocol.SHM_RESERVED_BYTES, REGION_BYTES),
)
def test_what_is_paid_for_ahead_is_what_emit_keeps(
    server, region_object, outputs, inline_budget, inline_limit, with_region, region_used
):
    session = server.store.create()
    try:
        io = CallIO(
            session,
            server.servicer.compute,
            inline_budget=inline_budget,
            inline_limit=inline_limit,
        )
        if with_region:
            key, nonce, _ = region_object
            session.regions.register("out", key, REGION_BYTES, nonce)
            io.shared_out = shm_wire.OutputArena(session, "out")
            io.shared_out.offset = region_used  # earlier outputs of the call took this
        arrays = [a for a, _ in outputs]
        keeps = [k for _, k in outputs]
        predicted = io._staying(arrays, keeps)

        kept = []
        for n, (array, keep) in enumerate(outputs):
            out = tensor_pb2.TensorOutput()
            io.emit(array, out, f"out{n}", keep)
            where = out.WhichOneof("result")
            assert (where == "ref") >= keep  # a kept output is kept
            assert where != "shared" or array.dtype != object  # strings: never in a region
            if where == "ref":
                kept.append(array)
        assert [id(a) for a, _, _ in predicted] == [id(a) for a in kept]
        # Each is charged what was paid for it ahead (none is an alias here).
        assert all(forecast == full for _, forecast, full in predicted)
        assert session.budget.used == sum(full for _, _, full in predicted)
        assert all(session.charge_of(a) == full for a, _, full in predicted)
    finally:
        server.store.close(session.id)


def test_an_output_whose_region_failed_goes_inline_if_the_response_has_room(server, region_object):
    """Predicted for the region, it was paid nothing ahead: when the region write fails
    (the worker shrank its region) it goes inline whatever the client's inline limit,
    not kept, if the response has room, so that an op that changed state (a read that
    cleared its element) is not refused for want of room to keep it."""
    import mmap

    key, nonce, shm = region_object
    session = server.store.create()
    try:
        io = CallIO(session, server.servicer.compute, inline_budget=1 << 20, inline_limit=1024)
        session.regions.register("out", key, REGION_BYTES, nonce)
        io.shared_out = shm_wire.OutputArena(session, "out")
        array = np.arange(2000, dtype=np.float32)  # 8 KB: fits the region, over the limit
        assert io._staying([array], [False]) == []
        try:
            os.ftruncate(shm._fd, mmap.PAGESIZE)  # the worker shrinks its region
            out = tensor_pb2.TensorOutput()
            io.emit(array, out, "out", False)
        finally:
            os.ftruncate(shm._fd, REGION_BYTES)
        assert out.WhichOneof("result") == "value"
        assert session.budget.used == 0
    finally:
        server.store.close(session.id)


def test_after_the_region_failed_every_output_of_the_call_may_go_inline(region_object):
    """Gradients, its two gradients meant for the region, the region shrunk under it
    and 4 KiB of room in the session: both come inline (before, the second was kept
    unpaid, refused after the non-persistent tape was released: both lost)."""
    key, nonce, shm = region_object
    with run_server(port=0, device="cpu", max_session_bytes=1 << 20) as server:
        _gradients_after_the_region_failed(server, key, nonce, shm)


def _gradients_after_the_region_failed(server, key, nonce, shm) -> None:
    import mmap

    from gradserve.server.transport import tape_handlers
    from gradserve.v1 import tape_pb2

    session = server.store.create()
    try:
        n = 2000  # 8000 bytes each
        y1, y2 = (session.put(np.ones(n, np.float32)) for _ in range(2))
        tape = session.start_tape(persistent=False, watch_accessed_variables=False)
        session.watch(tape, [y1, y2])
        room = 4096
        session.put(
            np.zeros((session.budget.limit - session.budget.used - 1024 - room) // 4, np.float32)
        )
        io = CallIO(session, server.servicer.compute, inline_budget=1 << 22, inline_limit=1024)
        session.regions.register("out", key, REGION_BYTES, nonce)
        io.shared_out = shm_wire.OutputArena(session, "out")
        ref = lambda i: tensor_pb2.TensorInput(ref=i)  # noqa: E731
        request = tape_pb2.GradientsRequest(
            tape_id=tape.id, targets=[ref(y1), ref(y2)], sources=[ref(y1), ref(y2)]
        )
        try:
            os.ftruncate(shm._fd, mmap.PAGESIZE)  # the worker shrinks its region
            reply = io.run(tape_handlers.Gradients, request)
        finally:
            os.ftruncate(shm._fd, REGION_BYTES)
        assert [g.WhichOneof("result") for g in reply.gradients] == ["value", "value"]
    finally:
        server.store.close(session.id)
