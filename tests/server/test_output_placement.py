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

import contextlib
import os
from multiprocessing import shared_memory

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradserve import protocol
from gradserve.errors import ResourceExhaustedError
from gradserve.server import run_server
from gradserve.server.core import regions
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
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
    irreversible=st.booleans(),
)
def test_what_is_paid_for_ahead_is_what_emit_keeps(
    server, region_object, outputs, inline_budget, inline_limit, with_region, region_used,
    irreversible,
):  # fmt: skip
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
        predicted = io._staying(arrays, keeps, irreversible)

        kept, in_region = [], set()
        for n, (array, keep) in enumerate(outputs):
            out = tensor_pb2.TensorOutput()
            io.emit(array, out, f"out{n}", keep)
            where = out.WhichOneof("result")
            assert (where == "ref") >= keep  # a kept output is kept
            assert where != "shared" or array.dtype != object  # strings: never in a region
            if where == "ref":
                kept.append(array)
            elif where == "shared":
                in_region.add(id(array))
        # Every output kept was paid for ahead, at what it is charged (no alias here).
        paid = {id(a): (forecast, full) for a, forecast, full in predicted}
        assert all(id(a) in paid for a in kept)
        assert session.budget.used == sum(paid[id(a)][1] for a in kept)
        assert all(session.charge_of(a) == paid[id(a)][1] for a in kept)
        assert all(forecast == full for _, forecast, full in predicted)
        # Exactly those, but for an op that cannot be undone with a region: outputs
        # written into it are listed too if they would not have fitted inline had it
        # failed, and outputs after one are paid for as if it went inline (room the
        # response might lose); the surplus is given back when the op ends.
        if not (with_region and irreversible):
            assert [id(a) for a, _, _ in predicted] == [id(a) for a in kept]
    finally:
        server.store.close(session.id)


def test_an_output_whose_region_failed_goes_inline_if_the_response_has_room(server, region_object):
    """Predicted for the region, it was paid nothing ahead: when the region write fails
    (the worker shrank its region) it goes inline whatever the client's inline limit,
    not kept, if the response has room, so that an op that changed state (a read that
    cleared its element) is not refused for want of room to keep it."""
    import mmap

    shm = region_object[2]
    with _call_with_region(server, region_object) as (session, io):
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


@contextlib.contextmanager
def _call_with_region(server, region_object):
    """A fresh session with ``region_object`` registered as "out", and a call whose
    output region it is (inline limit 1 KiB): (session, call)."""
    key, nonce, _ = region_object
    session = server.store.create()
    try:
        io = CallIO(session, server.servicer.compute, inline_budget=1 << 20, inline_limit=1024)
        session.regions.register("out", key, REGION_BYTES, nonce)
        io.shared_out = shm_wire.OutputArena(session, "out")
        yield session, io
    finally:
        server.store.close(session.id)


@pytest.mark.parametrize("inline_budget", [1 << 22, 10_000])
def test_gradients_lose_nothing_to_a_failed_region(region_object, inline_budget):
    """Gradients on a non-persistent tape, its two 8 KB gradients meant for the
    region, the region shrunk under it, 4 KiB of room in the session (beside the ones
    the sweep starts from). With room in the
    response both come inline (before, the second was kept unpaid: refused after the
    tape was released, both lost). Without, the gradients are paid for ahead as if the
    region failed: refused before the tape is released, which the call may repeat."""
    import mmap

    from gradserve.server.transport import tape_handlers
    from gradserve.v1 import tape_pb2

    key, nonce, shm = region_object
    with run_server(port=0, device="cpu", max_session_bytes=1 << 20) as server:
        session = server.store.create()
        n = 2000  # 8000 bytes each
        y1, y2 = (session.put(np.ones(n, np.float32)) for _ in range(2))
        tape = session.start_tape(persistent=False, watch_accessed_variables=False)
        session.watch(tape, [y1, y2])
        # With room in the response, room for the ones the sweep starts from too (they
        # are charged while it runs; here they become the results). Without, refused
        # either way before the tape is released.
        seeds = 2 * n * 4 if inline_budget > 1 << 20 else 0
        room = session.budget.limit - session.budget.used - 1024 - 4096 - seeds
        session.put(np.zeros(room // 4, np.float32))
        io = CallIO(
            session, server.servicer.compute, inline_budget=inline_budget, inline_limit=1024
        )
        session.regions.register("out", key, REGION_BYTES, nonce)
        io.shared_out = shm_wire.OutputArena(session, "out")
        ref = lambda i: tensor_pb2.TensorInput(ref=i)  # noqa: E731
        request = tape_pb2.GradientsRequest(
            tape_id=tape.id, targets=[ref(y1), ref(y2)], sources=[ref(y1), ref(y2)]
        )
        try:
            os.ftruncate(shm._fd, mmap.PAGESIZE)  # the worker shrinks its region
            if inline_budget > 1 << 20:
                reply = io.run(tape_handlers.Gradients, request)
                assert [g.WhichOneof("result") for g in reply.gradients] == ["value", "value"]
            else:
                with pytest.raises(ResourceExhaustedError):
                    io.run(tape_handlers.Gradients, request)
                assert session.tape(tape.id) is tape  # not released: nothing lost
        finally:
            os.ftruncate(shm._fd, REGION_BYTES)
        server.store.close(session.id)


@pytest.mark.parametrize("free, read", [(512, False), (3 * TENSOR_RECORD_BYTES, True)])
def test_a_clearing_read_meant_for_the_region_pays_as_if_it_failed(region_object, free, read):
    """The read clears its element: its output, meant for the region, is paid for as
    if the region failed and the value did not fit inline (the element's bytes are
    the read's credit; its record, the budget). Without room for that it is refused
    before the clear; with room, the region shrunk under it, it comes transient
    (before: refused after the clear, the element lost)."""
    import mmap

    from gradserve import codec
    from gradserve.server.core.ops import tensor_array_ops
    from gradserve.server.transport import tensor_array_handlers
    from gradserve.v1 import tensor_array_pb2

    key, nonce, shm = region_object
    value = np.arange(1500, dtype=np.float32)  # 6000 bytes: fits the region, not inline
    with run_server(port=0, device="cpu", max_session_bytes=1 << 20) as server:
        session = server.store.create()
        handle, ta = tensor_array_ops.create(
            session, size=np.int32(1), dtype=np.dtype(np.float32), element_shape=None,
            dynamic_size=False, clear_after_read=True, identical_element_shapes=False,
            tensor_array_name="",
        )  # fmt: skip
        ta.write(0, value)
        room = session.budget.limit - session.budget.used - 1024 - free
        session.put(np.zeros(room // 4, np.float32))
        io = CallIO(session, server.servicer.compute, inline_budget=2000)
        session.regions.register("out", key, REGION_BYTES, nonce)
        io.shared_out = shm_wire.OutputArena(session, "out")
        request = tensor_array_pb2.TensorArrayReadV3Request(
            handle=tensor_array_pb2.TensorArrayHandle(id=handle),
            dtype=codec.dtype_to_enum(np.dtype(np.float32)),
        )
        codec.encode(np.int32(0), request.index.value)
        try:
            os.ftruncate(shm._fd, mmap.PAGESIZE)  # the worker shrinks its region
            if read:
                reply = io.run(tensor_array_handlers.TensorArrayReadV3, request)
            else:
                with pytest.raises(ResourceExhaustedError):
                    io.run(tensor_array_handlers.TensorArrayReadV3, request)
        finally:
            os.ftruncate(shm._fd, REGION_BYTES)
        if read:
            assert reply.value.ref.transient
            np.testing.assert_array_equal(session.get(reply.value.ref.id), value)
        else:
            np.testing.assert_array_equal(ta.read(0), value)  # not cleared
        server.store.close(session.id)


def test_an_output_region_the_os_refuses_to_write_is_dropped_as_one_that_shrank(
    server, region_object, monkeypatch
):
    """A full /dev/shm refuses a write into pages the region never had (ENOSPC): that
    error escaped untyped, so the call failed INTERNAL after a clearing read or
    Gradients had changed state, and the result was lost (found by a review helper).
    It is now a typed error (reason REGION_NO_SPACE), and the output goes inline."""
    import errno

    with _call_with_region(server, region_object) as (session, io):
        array = np.arange(2000, dtype=np.float32)

        def no_space(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwritev", no_space)
        out = tensor_pb2.TensorOutput()
        io.emit(array, out, "out", False)
        assert out.WhichOneof("result") == "value"
        assert io.shared_out.broken
        with pytest.raises(ResourceExhaustedError, match="/dev/shm is full") as info:
            session.regions.write("out", 64, array, "tensor")
        assert info.value.reason == "REGION_NO_SPACE"
        monkeypatch.setattr(os, "preadv", no_space)
        with pytest.raises(ResourceExhaustedError, match="reading shared memory region"):
            session.regions.read("out", 64, np.dtype(np.float32), array.shape, "tensor")
