"""Every resource limit: RESOURCE_EXHAUSTED naming the limit, nothing half-allocated,
other clients still served, memory back to zero when sessions close."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import tracemalloc
import types
from collections.abc import Iterator

import numpy as np
import pytest

import gradserve
from gradserve.errors import ResourceExhaustedError
from gradserve.server import run_server
from gradserve.server.core.budget import MemoryBudget
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
from gradserve.server.transport.lanes import Lane

KIB = 1024


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits") / "tokens"
    path.write_text("a:token-a\nb:token-b\n")
    return str(path)


@pytest.fixture(scope="module")
def small(tokens):
    with run_server(
        device="cpu",
        token_file=tokens,
        max_sessions=3,
        max_sessions_per_principal=2,
        max_session_bytes=1024 * KIB,
        max_server_bytes=1536 * KIB,
        max_principal_bytes=None,  # these tests are about the session and server limits
        max_tensor_bytes=600 * KIB,
        max_tensor_array_size=100,
        max_message_bytes=2048 * KIB,
    ) as s:
        yield s


def connect(server, principal="a", **kw):
    return gradserve.Client(f"127.0.0.1:{server.port}", token=f"token-{principal}", **kw)


def f32(kib: int) -> np.ndarray:
    return np.ones(kib * KIB // 4, np.float32)


def test_without_a_token_file_the_session_limit_is_the_servers():
    """Without a token file every client is the same anonymous principal: its limit of
    sessions (64 by default) was every client's together, under ``--max-sessions``.
    As the stream and byte quotas of a principal, it now applies only with principals
    (found by a review helper)."""
    with run_server(device="cpu", max_sessions=4, max_sessions_per_principal=2) as s:
        clients = [gradserve.Client(f"127.0.0.1:{s.port}") for _ in range(4)]
        try:
            with pytest.raises(ResourceExhaustedError, match="--max-sessions\\b"):
                gradserve.Client(f"127.0.0.1:{s.port}")
        finally:
            for c in clients:
                c.close()


def test_session_limits(small):
    a1, a2 = connect(small), connect(small)
    try:
        with pytest.raises(ResourceExhaustedError, match="--max-sessions-per-principal") as info:
            connect(small)
        assert info.value.reason == "TOO_MANY_SESSIONS_FOR_PRINCIPAL"
        b1 = connect(small, "b")
        with pytest.raises(ResourceExhaustedError, match="--max-sessions\\)") as info:
            connect(small, "b")
        assert info.value.reason == "TOO_MANY_SESSIONS"
        b1.close()
        connect(small, "b").close()  # a slot is free again
    finally:
        a1.close()
        a2.close()


def test_tensor_size_limit(small):
    with connect(small) as client:
        with pytest.raises(ResourceExhaustedError, match="--max-tensor-bytes"):
            client.put(f32(700))
        assert small.store.get(client.session_id, "a").budget.used == 0


def test_session_bytes_limit_is_all_or_nothing(small):
    with connect(small) as client:
        client.put(f32(400))
        # (infer_shape=False: an unwritten element is refused, not read as zeros)
        ta = client.tensor_array(np.float32, size=3, infer_shape=False).write(0, f32(400))
        session = small.store.get(client.session_id, "a")
        before = session.budget.used
        with pytest.raises(ResourceExhaustedError, match="--max-session-bytes") as info:
            ta.write(1, f32(400))
        assert info.value.reason == "MEMORY_LIMIT"
        with pytest.raises(ResourceExhaustedError, match="--max-session-bytes"):
            client.put(f32(400))
        assert session.budget.used == before
        assert ta.size() == 3
        with pytest.raises(ValueError, match="partially known TensorShape <unknown>"):
            ta.read(1)  # the refused write left no trace (unwritten, no shape known)
        np.testing.assert_array_equal(ta.read(0), f32(400))  # clear_after_read frees it
        ta.write(1, f32(400))  # ... so this fits now
    assert small.store.budget.used == 0


def test_server_bytes_limit(small):
    with connect(small) as a, connect(small, "b") as b:
        a.put(f32(500))
        a.put(f32(500))
        with pytest.raises(ResourceExhaustedError, match="--max-server-bytes"):
            b.put(f32(600))
        b.put(f32(300))  # what fits still fits
        assert small.store.budget.used == 1300 * KIB + 3 * TENSOR_RECORD_BYTES
    assert small.store.budget.used == 0


def test_tensor_array_size_limit(small):
    with connect(small) as client:
        with pytest.raises(ResourceExhaustedError, match="--max-tensor-array-size"):
            client.tensor_array(np.float32, size=101)
        ta = client.tensor_array(np.float32, size=0, dynamic_size=True)
        ta.write(99, [1.0])
        with pytest.raises(ResourceExhaustedError, match="size 101 is over"):
            ta.write(100, [1.0])
        assert ta.size() == 100


def test_streamed_put_is_refused_before_allocating(small):
    with connect(small, stream_threshold=64 * KIB, chunk_bytes=64 * KIB) as client:
        client.put(f32(500))
        client.put(f32(500))
        with pytest.raises(ResourceExhaustedError, match="--max-session-bytes"):
            client.put(f32(300))
        assert small.store.get(client.session_id, "a").budget.used == 1000 * KIB + 2 * (
            TENSOR_RECORD_BYTES
        )


def test_memory_budget_nesting():
    server = MemoryBudget(100, "server")
    a, b = MemoryBudget(80, "a", server), MemoryBudget(80, "b", server)
    a.reserve(60)
    with pytest.raises(ResourceExhaustedError, match="server"):
        b.reserve(50)
    assert (a.used, b.used, server.used) == (60, 0, 60)
    with pytest.raises(ResourceExhaustedError, match="a:"):
        a.reserve(30)
    a.release(60)
    assert (a.used, server.used) == (0, 0)


def test_compute_lane_refuses_past_the_queue_and_never_runs_more_than_its_threads():
    async def scenario():
        lane = Lane("compute", threads=1, max_waiting=1)
        release = threading.Event()
        running = []

        def work():
            running.append(1)
            assert len(running) == 1, "two calls ran on a one-thread lane"
            release.wait(5)
            running.pop()
            return "done"

        first = asyncio.ensure_future(lane.run(work))
        second = asyncio.ensure_future(lane.run(work))  # waits for the slot
        await asyncio.sleep(0.1)
        with pytest.raises(ResourceExhaustedError, match="compute queue full") as info:
            await lane.run(work)
        assert info.value.reason == "COMPUTE_QUEUE_FULL"
        assert lane.running == 1 and lane.waiting == 1
        first.cancel()  # its client went away: the work still holds the thread
        await asyncio.sleep(0.1)
        assert not second.done() and lane.running == 1
        release.set()
        assert await second == "done"
        assert lane.running == 0 and lane.waiting == 0
        lane.shutdown()

    asyncio.run(scenario())


def wait_until(condition, timeout=30.0):
    """Poll the server's state until ``condition`` holds (not a fixed sleep: how long
    the long call takes to get there depends on the machine)."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the server never got there"
        time.sleep(0.005)


def lstm_args(steps=10):
    """An LSTM call's inputs (tiny cells: 100,000 steps compute for a second or two with
    NumPy's passes, about 0.05 s in FUSED's compiled calls of several steps)."""
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return [np.int64(steps), r(steps, 2, 4), r(2, 4), r(2, 4), r(8, 16), r(4), r(4), r(4), r(16)]


@contextlib.contextmanager
def compute_held(server):
    """The server's compute lane's thread held by a job of the test (no RPC) until
    the block ends: LSTM calls wait (or are refused), deterministically. Calls that
    computed for a second or two raced here: with the server in this process, its
    compute thread could finish before this process's next call was sent."""
    release = threading.Event()
    blocker = asyncio.run_coroutine_threadsafe(
        server.servicer.heavy.run(lambda: release.wait(60)), server._loop
    )
    heavy = server.servicer.heavy
    wait_until(lambda: heavy.free == 0)
    try:
        yield
    finally:
        release.set()
        blocker.result(10)


def test_compute_queue_over_rpc():
    with run_server(device="cpu", compute_slots=1, max_queued_compute=0) as server:
        target = f"127.0.0.1:{server.port}"
        with gradserve.Client(target, shared_memory=False) as client:
            with compute_held(server):
                with pytest.raises(ResourceExhaustedError, match="compute queue full"):
                    client.raw_ops.BlockLSTMV2(*lstm_args())
                assert client.stop_gradient(np.ones(1))[0] == 1  # light ops are not gated
            assert len(client.raw_ops.BlockLSTMV2(*lstm_args())) == 7  # served again


def test_max_concurrent_rpcs():
    with run_server(device="cpu", max_concurrent_rpcs=2, compute_slots=1) as server:
        target = f"127.0.0.1:{server.port}"
        # No shared memory, no background keep-alive, inputs inline: the LSTM call is
        # each client's only RPC, so two in flight are the two LSTM calls (waiting for
        # the held compute lane).
        with (
            gradserve.Client(target, shared_memory=False, keepalive=False) as a,
            gradserve.Client(target, shared_memory=False, keepalive=False) as b,
        ):
            calls = [
                threading.Thread(target=c.raw_ops.BlockLSTMV2, args=lstm_args()) for c in (a, b)
            ]
            with compute_held(server):
                for t in calls:
                    t.start()
                admission = server.servicer.admission
                wait_until(lambda: admission.in_flight - admission.streams >= 2)
                with pytest.raises(ResourceExhaustedError):
                    a.stop_gradient(np.ones(1))
            for t in calls:
                t.join()
            assert a.stop_gradient(np.ones(1))[0] == 1


def test_idle_sessions_expire_unless_kept_alive():
    with run_server(device="cpu", session_ttl=0.4) as server:
        target = f"127.0.0.1:{server.port}"
        idle = gradserve.Client(target, keepalive=False)
        idle.put(np.ones(1000))
        kept = gradserve.Client(target)  # keeps itself alive in the background
        time.sleep(1.5)
        with pytest.raises(gradserve.errors.NotFoundError):
            idle.keep_alive()
        assert kept.stop_gradient(np.ones(1))[0] == 1
        assert len(server.store) == 1 and server.store.expired >= 1
        assert server.store.budget.used == 0
        kept.close()


def test_a_session_with_a_call_running_is_not_idle(monkeypatch):
    """A call that runs past the TTL with nothing else on its session (an op taking
    long, no keep-alive) keeps its session: idle was counted from each call's start,
    and the session was closed under the call, its result lost (a review helper: a
    slow upload and a 3 s LSTM, each NOT_FOUND "the session was closed"). After the
    call ends the TTL counts again."""
    from gradserve.server.core.sessions import Session

    put = Session.put

    def slow_put(self, *args, **kwargs):
        time.sleep(1.5)  # over three TTLs
        return put(self, *args, **kwargs)

    monkeypatch.setattr(Session, "put", slow_put)
    with run_server(device="cpu", session_ttl=0.4) as server:
        target = f"127.0.0.1:{server.port}"
        with gradserve.Client(target, keepalive=False, shared_memory=False) as client:
            ref = client.put(np.arange(1000.0))
            monkeypatch.undo()
            np.testing.assert_array_equal(ref.numpy(), np.arange(1000.0))
            assert server.store.expired == 0
            time.sleep(1.5)  # now idle
            with pytest.raises(gradserve.errors.NotFoundError):
                client.keep_alive()
            assert server.store.expired == 1


def test_a_call_ending_while_the_reaper_looks_does_not_expire_its_session():
    """The reaper read a session's last use, then whether a call ran: a call that ran
    past the TTL and ended between the two reads looked idle for its whole run, and
    its session was expired at once, its reply's ids lost (a review helper: 14,336 of
    8.3 million such ends). Both are now read together (``Session.idle_since``)."""
    from gradserve.server.core.sessions import SessionStore

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads change hands between any two bytecodes
    store = SessionStore(idle_timeout=10.0)
    stop = threading.Event()

    def reaper():
        while not stop.is_set():
            store.expire_idle()

    thread = threading.Thread(target=reaper)
    thread.start()
    try:
        expired = 0
        for _ in range(20):
            session = store.create()
            for _ in range(2000):
                end = session.call_started()
                session.last_used -= 100.0  # it has run for 100 s, past the TTL
                end()  # it ends now: idle for no time
                if session.closed:
                    break
            try:
                store.close(session.id)
            except gradserve.errors.NotFoundError:
                expired += 1  # the reaper closed it
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert expired == 0


def test_tensor_arrays_of_nothing_fill_the_session_budget_too():
    """Arrays and slots cost server memory of their own (~600 and ~220 bytes): a
    session of 1 MB made 600,000 arrays (390 MB) through Batch, and grad arrays by
    distinct sources, charged nothing. Now each is charged, and refused past the limit;
    closing the session frees them all."""
    with run_server(port=0, device="cpu", max_session_bytes=1 << 20) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            batch = client.batch()
            for _ in range(2000):
                batch.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
            with pytest.raises(ResourceExhaustedError, match="max-session-bytes") as info:
                batch.run()
            assert 900 < info.value.step < 1000  # about 1 KiB each
            session = server.store.get(client.session_id)
            assert session.budget.used == session.record_bytes() <= 1 << 20
            h, flow = info.value.results[0]
            with pytest.raises(ResourceExhaustedError, match="max-session-bytes"):
                for n in range(200):  # a grad array per source: charged as well
                    client.raw_ops.TensorArrayGradV3(h, flow, source=f"s{n}")
        assert server.store.budget.used == 0


def test_an_lstm_holds_its_outputs_in_the_budget_while_it_makes_them():
    """Seven outputs (and a backward's gate gradients) are allocated before anything
    keeps them: they count against the session's bytes while the op runs, so a session
    cannot make the server allocate 7x --max-tensor-bytes per call past its budget."""
    steps, batch, units = 10, 4, 8
    out_bytes = steps * batch * units * 4  # float32
    f32 = np.float32
    args = [
        np.int64(steps),
        np.zeros((steps, batch, units), f32),
        np.zeros((batch, units), f32),
        np.zeros((batch, units), f32),
        np.zeros((2 * units, 4 * units), f32),
        *(np.zeros(units, f32) for _ in range(3)),
        np.zeros(4 * units, f32),
    ]
    limit = 7 * out_bytes - 1
    with run_server(port=0, device="cpu", max_session_bytes=limit) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            with pytest.raises(ResourceExhaustedError, match="max-session-bytes"):
                client.raw_ops.BlockLSTMV2(*args)
            assert server.store.get(client.session_id).budget.used == 0
    with run_server(port=0, device="cpu", max_session_bytes=7 * out_bytes) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            assert client.raw_ops.BlockLSTMV2(*args).h.shape == (steps, batch, units)
            assert server.store.get(client.session_id).budget.used == 0  # given back


def test_a_long_session_that_makes_and_closes_an_array_per_step_never_runs_out():
    """Closed arrays stay charged (their handles still say "already closed"), but only
    the most recent few hundred: a session of 1 MiB ran out after 991 steps."""
    with run_server(port=0, device="cpu", max_session_bytes=1 << 20) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            for _ in range(3000):
                batch = client.batch()
                h, flow = batch.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
                batch.raw_ops.TensorArrayCloseV3(h)
                batch.run()
            assert server.store.get(client.session_id).budget.used < 300 * 1024


def test_an_op_that_makes_many_slot_records_is_refused_as_it_goes():
    """A read of an unwritten slot makes its record (and, for an element shape with no
    elements, a value of no bytes). A concat of a million such elements, a 45-byte
    call, made a million records (436 MB, 13.6 s) before the budget saw any of them
    at its end. Now the op reserves as it grows, and is refused within a few thousand
    reads; the array is as it was."""
    from gradserve.server.core.sessions import SessionStore
    from gradserve.server.core.tensor_array import SLOT_BYTES

    store = SessionStore(max_session_bytes=1 << 20)
    session = store.create()
    _, ta = session.create_tensor_array(
        tensor_array_name="", dtype=np.float32, size=1 << 20, element_shape=(0,),
        clear_after_read=False,
    )  # fmt: skip
    before = session.budget.used
    reads = []
    with pytest.raises(ResourceExhaustedError, match="max-session-bytes"):
        ta.concat((), check=lambda: reads.append(None))
    assert len(reads) * 1024 <= 2 * (1 << 20) // SLOT_BYTES  # checks: one per 1024 reads
    assert session.budget.used == before
    assert ta.record_bytes() == before
    store.close(session.id)
    assert store.budget.used == 0


def test_tensors_of_no_bytes_are_charged_their_records():
    """A tensor costs the server its array object and id table entry whatever its
    values: charged by values alone, tensors of no elements were free, and 150,000 of
    them fitted in a 1 MiB session (three Batches of kept StopGradient outputs). Each
    tensor is charged ``TENSOR_RECORD_BYTES`` besides its bytes now."""
    with run_server(port=0, device="cpu", max_session_bytes=1 << 20) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            batch = client.batch()
            for _ in range(2000):
                batch.raw_ops.StopGradient(np.zeros(0, np.float32), keep=True)
            with pytest.raises(ResourceExhaustedError, match="max-session-bytes") as info:
                batch.run()
            assert info.value.step == (1 << 20) // TENSOR_RECORD_BYTES
            session = server.store.get(client.session_id)
            assert session.budget.used == info.value.step * TENSOR_RECORD_BYTES
            client.delete(*info.value.results)
            assert session.budget.used == 0


def test_a_drain_ends_a_stalled_stream_and_not_a_moving_one(monkeypatch):
    """Once the server drains, a stream waiting for its next chunk was ended at the
    first poll (0.5 s), so a put sending a chunk every 0.7 s, far above the minimum
    rate, was cut off (found by a review helper). A stream now ends in a drain only
    once it has moved nothing for ``DRAIN_IDLE_SECONDS``."""
    from gradserve.errors import UnavailableError
    from gradserve.server.transport import streams

    monkeypatch.setattr(streams, "_POLL_SECONDS", 0.02)
    monkeypatch.setattr(streams, "DRAIN_IDLE_SECONDS", 0.3)

    class Open:
        closed = False

    pace = streams.Pace(streams.StreamLimits(), Open(), "PutTensor", lambda: True)

    async def chunk_after(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "chunk"

    async def scenario() -> None:
        for _ in range(3):  # a chunk every 0.15 s: moving, 7 polls apart
            assert await pace.wait(chunk_after(0.15)) == "chunk"
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="moved nothing for 0.3 s"):
            await pace.wait(chunk_after(10))
        assert 0.3 <= time.monotonic() - started < 5

    asyncio.run(scenario())


def test_a_stream_whose_client_reads_nothing_is_cancelled_not_aborted(monkeypatch):
    """A reader that stops reading its socket (a frozen worker) leaves the server's
    write pending; at the idle timeout the boundary's ``context.abort`` then failed
    inside gRPC (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, a traceback logged per reader:
    found by a review helper). Pace marks an error raised behind a pending send, and
    the boundary cancels that call instead of aborting it."""
    import contextlib as ctx
    import types

    from gradserve.errors import DeadlineExceededError
    from gradserve.server.transport import boundary, streams
    from gradserve.v1 import service_pb2

    monkeypatch.setattr(streams, "_POLL_SECONDS", 0.02)

    class Open:
        closed = False

    limits = streams.StreamLimits(idle_timeout=0.1)

    async def never() -> None:
        await asyncio.sleep(60)

    async def stuck(sending: bool) -> DeadlineExceededError:
        with pytest.raises(DeadlineExceededError) as info:
            await streams.Pace(limits, Open(), "GetTensor").wait(never(), sending=sending)
        return info.value

    assert streams.status_stuck(asyncio.run(stuck(sending=True)))
    assert not streams.status_stuck(asyncio.run(stuck(sending=False)))

    aborted = []

    class Context:
        async def abort(self, *args):
            aborted.append(args)
            raise RuntimeError("aborted")

        def add_done_callback(self, callback):
            pass

    record = types.SimpleNamespace(request_id="r", code=None, message=None)
    servicer = types.SimpleNamespace(
        observer=types.SimpleNamespace(call=lambda *a: ctx.nullcontext(record)),
        admission=types.SimpleNamespace(enter=lambda *a, **k: None, exit=lambda *a, **k: None),
        principal=lambda context: "p",
    )

    def handler(error):
        async def GetTensor(self, request, context):
            raise error

        return boundary.guarded(GetTensor)

    request = service_pb2.GetTensorRequest(id="t")
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(handler(asyncio.run(stuck(True)))(servicer, request, Context()))
    assert aborted == [] and record.message.startswith("GetTensor: no data")
    with pytest.raises(RuntimeError, match="aborted"):  # a status that can go: aborted
        asyncio.run(handler(asyncio.run(stuck(False)))(servicer, request, Context()))
    assert len(aborted) == 1


@contextlib.contextmanager
def _peak_allocated() -> Iterator[list[int]]:
    """The most bytes Python and NumPy allocated at once in the block (this process:
    the server runs in it), from when the block began."""
    tracemalloc.start()
    peak: list[int] = []
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def test_a_joined_output_is_charged_before_it_is_made():
    """A gather or concat allocated its output before the budget saw it, bounded only
    by one output's byte limit: four gathers of one 1 MiB element 1,000 times each
    took 4 GB at once of a server whose sessions had 32 MiB (helper-77). Each is
    refused before it allocates now, and one that fits is made."""
    element = np.ones(64 * KIB, np.float32)  # 256 KiB
    with run_server(port=0, device="cpu", max_session_bytes=4096 * KIB) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            ta = client.tensor_array(np.float32, size=12, clear_after_read=False)
            for index in range(12):  # 3 MiB held
                ta.write(index, element)
            used = server.store.get(client.session_id).budget.used
            with _peak_allocated() as peak:
                with pytest.raises(ResourceExhaustedError, match="max-session-bytes"):
                    ta.gather([0] * 64)  # 16 MiB
                with pytest.raises(ResourceExhaustedError, match="max-session-bytes"):
                    ta.concat()  # 3 MiB more
            assert peak[0] < 2048 * KIB
            assert server.store.get(client.session_id).budget.used == used
            np.testing.assert_array_equal(ta.gather([0, 11]), [element, element])


def test_the_ones_a_gradient_seeds_its_targets_with_are_charged_before_they_are_made():
    """Ones of each distinct target's shape, made before the sweep: 2,000 targets of
    2 MiB (outputs of one tensor, a few bytes each in the budget), named in one small
    request, made 4 GB of ones past a 32 MiB budget (helper-77)."""
    x_value = np.ones(64 * KIB, np.float32)  # 256 KiB
    with run_server(port=0, device="cpu", max_session_bytes=4096 * KIB) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            x = client.put(x_value)
            with client.gradient_tape() as tape:
                copies = [client.raw_ops.StopGradient(x) for _ in range(64)]  # 16 MiB of ones
                y = client.raw_ops.StopGradient(x)
            with _peak_allocated() as peak:
                with pytest.raises(ResourceExhaustedError, match="max-session-bytes"):
                    tape.gradient(copies, x)
            assert peak[0] < 2048 * KIB
            assert tape.gradient(y, y).shape == x_value.shape  # (not released: asked again)


@pytest.mark.parametrize("program", ["read", "stack of four", "concat of [0, N]"])
def test_the_ones_of_a_gradient_are_charged_once_and_while_they_live(program):
    """Charged through the whole sweep, the ones were charged twice where a gradient
    array or the results took them: a gradient through one read of a 1 MiB element
    needed 3.25 MiB of budget, 2.25 before they were charged at all (helper-78). Let go
    before the gradient function ran, they were charged to no one while a stack's
    gradient copied them into its gradient array, and the sweep kept them to its end:
    9 MiB of budget took the gradient of a stack of four (13 MiB in use, helper-79).
    Each is let go as its record's gradient takes it (a concat's split of an empty
    piece and the whole keeps the whole: helper-80 saw it charged twice), or once it
    has copied it."""
    element = np.ones(256 * KIB, np.float32)  # 1 MiB
    writes = 4 if program == "stack of four" else 1

    def gradient_fits(limit: int) -> bool:
        with run_server(port=0, device="cpu", max_session_bytes=limit) as server:
            with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
                x = client.put(element)
                with client.gradient_tape() as tape:
                    if program == "concat of [0, N]":
                        ta = client.tensor_array(np.float32, size=2, infer_shape=False)
                        y = ta.write(0, np.zeros(0, np.float32)).write(1, x).concat()
                    else:
                        ta = client.tensor_array(np.float32, size=writes)
                        for index in range(writes):
                            ta.write(index, x)
                        y = ta.read(0) if writes == 1 else ta.stack()
                try:
                    g = tape.gradient(y, x)
                except ResourceExhaustedError:
                    return False
                np.testing.assert_array_equal(g, np.full_like(element, writes))
                return True

    # What is in use: x, y (held by the tape) and, while the sweep runs, y's ones and
    # its gradient array's copy of them (a read's keeps them as they are).
    in_use = {
        "read": 2304 * KIB,
        "stack of four": 13 * 1024 * KIB + 16 * KIB,
        "concat of [0, N]": 3 * 1024 * KIB + 16 * KIB,
    }[program]
    assert gradient_fits(in_use)
    if program == "stack of four":  # (the others: less leaves the forward no room)
        assert not gradient_fits(in_use - 512 * KIB)


MIB = 1024 * KIB


@pytest.mark.parametrize("then", ["put", "write"])
def test_outputs_their_client_read_out_give_way_to_its_next_tensors(then, monkeypatch):
    """A client deletes the outputs it fetched by its next call (the SDK does); until
    then, or for 30 s after a restore from a snapshot older than its deletes, they
    held the session's bytes and its next tensors were refused (a review helper:
    730 refused gathers after a restart). Read out in full, they give way to a
    reservation that needs their bytes: by a put (``reserve_tensor``) and by an op
    that reserves under its array's lock (the budget's ``reclaim``)."""
    from gradserve.server.core import sessions

    monkeypatch.setattr(sessions, "RECLAIM_AFTER_SECONDS", 0.0)  # (no wait for a repeat)
    written = [np.full(200_000, float(i), np.float32) for i in range(2)]  # 800 kB each
    with run_server(device="cpu", max_message_bytes=MIB, max_session_bytes=2 * MIB) as server:
        target = f"127.0.0.1:{server.port}"
        # Every output over 64 KiB is handed out to be fetched.
        with gradserve.Client(target, stream_threshold=64 * KIB) as reader:
            ta = reader.tensor_array(np.float32, size=2)
            for index, value in enumerate(written):
                ta.write(index, value)
            batch = reader.batch()
            for index in range(2):
                batch.raw_ops.TensorArrayReadV3(ta.handle, index, ta.flow, np.float32)
            got = batch.run()  # 1.6 MB handed out, read out, not yet deleted
            # Their deletes lost (as to a restart): neither the reader's next call
            # nor its idle flush deletes them before the reclaim could (a review
            # helper: on a slow machine the flush could, and the test then passed
            # without a reclaim).
            assert len(reader._fetched.take(limit=100)) == 2
            session = server.store.get(reader.session_id)
            assert session.budget.used > 1_600_000
            # Another client of the session (or the same one after a restore) does
            # not name them for deletion.
            # (over the wire: an input through shared memory is a put's reservation)
            with gradserve.Client(
                target, session_id=reader.session_id, shared_memory=False
            ) as other:
                value = np.arange(225_000, dtype=np.float32)  # 900 kB: inline
                if then == "put":
                    ref = other.put(value)
                    np.testing.assert_array_equal(other.get(ref), value)
                else:
                    other_ta = other.tensor_array(np.float32, size=1)
                    other_ta.write(0, value)
                    np.testing.assert_array_equal(other_ta.read(0), value)
                assert session.budget.used < 1_600_000
    for want, value in zip(written, got):
        np.testing.assert_array_equal(value, want)


def test_only_outputs_read_out_a_while_ago_and_not_being_read_give_way(monkeypatch):
    """What its client has not read out in full, or reads now, or read out less than
    ``RECLAIM_AFTER_SECONDS`` ago (its fetch may be repeated: the call's status may
    not have reached it), is never deleted to make room, nor anything for a
    reservation that would not fit anyway: the reservation is refused as before."""
    from gradserve.server.core import sessions
    from gradserve.server.core.sessions import HandedOutReply, SessionStore

    clock = [1000.0]
    monkeypatch.setattr(sessions, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    store = SessionStore(max_session_bytes=4 * MIB)
    session = store.create()
    unread, reading, read_out = (
        session.put(np.zeros(KIB * KIB // 4, np.float32)) for _ in range(3)
    )
    for tensor_id in (unread, reading, read_out):
        session.handed_out(tensor_id, HandedOutReply())
    session.fetched(read_out)
    session.fetched(reading)
    with pytest.raises(ResourceExhaustedError, match="session"):
        session.reserve_tensor(MIB)  # read out just now: its fetch may be repeated
    clock[0] += sessions.RECLAIM_AFTER_SECONDS + 1
    with pytest.raises(ResourceExhaustedError, match="session"):
        session.reserve_tensor(4 * MIB)  # could never fit: nothing deleted for it
    assert session.get(read_out) is not None
    reader_done = session.being_read(reading)
    session.reserve_tensor(MIB).release()  # room once the one read out gave way
    assert session.get(unread) is not None and session.get(reading) is not None
    with pytest.raises(ResourceExhaustedError, match="session"):
        session.reserve_tensor(2 * MIB)
    reader_done()  # its call ended: read out, and read by nobody
    clock[0] += sessions.RECLAIM_AFTER_SECONDS + 1
    session.reserve_tensor(2 * MIB).release()
    with pytest.raises(ResourceExhaustedError, match="session"):
        session.reserve_tensor(3 * MIB)  # the unread one stays
    assert session.get(unread) is not None
    # A reservation made while the session's lock is held elsewhere does not wait
    # for it: the budget's reclaim gives up (no deadlock), and the refusal stands.
    session.fetched(unread)
    clock[0] += sessions.RECLAIM_AFTER_SECONDS + 1
    with session._lock:
        with pytest.raises(ResourceExhaustedError):
            session.budget.reserve(3 * MIB)
    session.budget.reserve(3 * MIB)
    assert session.budget.used == 3 * MIB


def test_an_output_kept_for_a_tape_makes_room_as_a_put_does(monkeypatch):
    """``keep_for_tapes`` reserves under the session's lock, where the budget's
    reclaim gives up: it frees the outputs read out and tries once more, as
    ``reserve_tensor`` does (a review helper: refused where a put fitted)."""
    from gradserve.server.core import sessions
    from gradserve.server.core.sessions import HandedOutReply, SessionStore

    monkeypatch.setattr(sessions, "RECLAIM_AFTER_SECONDS", 0.0)
    store = SessionStore(max_session_bytes=2 * MIB)
    session = store.create()
    out = session.put(np.zeros(MIB // 4, np.float32))
    session.handed_out(out, HandedOutReply())
    session.fetched(out)
    tape = session.start_tape(persistent=True, watch_accessed_variables=False)
    kept = session.keep_for_tapes([tape], np.ones(MIB // 4 + KIB, np.float32))
    assert kept is not None
    with pytest.raises(gradserve.errors.NotFoundError):
        session.get(out)
    session.close()
    assert store.budget.used == 0


@pytest.mark.parametrize("then", ["new array", "grad array", "alias"])
def test_records_made_under_the_sessions_lock_make_room_as_a_put_does(then, monkeypatch):
    """A new TensorArray, a new grad array and a put of an array the session holds
    already (an alias: its id's record alone) reserve under the session's lock, where
    the budget's reclaim gives up: refused with outputs read out holding the bytes,
    where a put fitted. They free those outputs and try once more, as ``put`` does."""
    from gradserve.server.core import sessions
    from gradserve.server.core.sessions import HandedOutReply, SessionStore

    monkeypatch.setattr(sessions, "RECLAIM_AFTER_SECONDS", 0.0)
    store = SessionStore(max_session_bytes=2 * MIB, max_tensor_array_size=1000)
    session = store.create()
    forward, _ = session.create_tensor_array(tensor_array_name="", dtype=np.float32, size=2)
    x = session.put(np.ones(4, np.float32))
    out = session.put(np.zeros(MIB // 4, np.float32))
    session.handed_out(out, HandedOutReply())
    session.fetched(out)
    room = session.budget.limit - session.budget.used
    session.put(np.zeros(room - sessions.TENSOR_RECORD_BYTES - 500, np.uint8))  # 500 left
    if then == "new array":
        with pytest.raises(ResourceExhaustedError, match="1000"):  # not the budget's:
            session.create_tensor_array(tensor_array_name="", dtype=np.float32, size=1001)
        assert session.get(out) is not None  # nothing given way for it
        session.create_tensor_array(tensor_array_name="", dtype=np.float32, size=2)
    elif then == "grad array":
        session.grad_array(forward, "gradients")
    else:
        session.put(session.get(x))
    with pytest.raises(gradserve.errors.NotFoundError):
        session.get(out)  # it gave way
    session.close()
    assert store.budget.used == 0


def test_outputs_that_share_one_array_give_way_together_and_never_for_a_refusal_above(
    monkeypatch,
):
    """Room is judged over every limit a refusal may come from, and an array two
    read-out ids name counts once both go (a review helper: the gradients of one
    source asked twice were judged to free their records only, and a reclaim that
    would have made room was skipped; a server limit refused after they were
    deleted)."""
    from gradserve.server.core import sessions
    from gradserve.server.core.sessions import HandedOutReply, SessionStore

    monkeypatch.setattr(sessions, "RECLAIM_AFTER_SECONDS", 0.0)
    store = SessionStore(max_session_bytes=2 * MIB)
    session = store.create()
    first = session.put(np.zeros(MIB // 4, np.float32))
    second = session.put(session.get(first))  # the same array under a second id
    for tensor_id in (first, second):
        session.handed_out(tensor_id, HandedOutReply())
        session.fetched(tensor_id)
    session.reserve_tensor(MIB + MIB // 2).release()
    for tensor_id in (first, second):
        with pytest.raises(gradserve.errors.NotFoundError):
            session.get(tensor_id)

    store = SessionStore(max_server_bytes=2 * MIB)  # no session limit: the server's
    session = store.create()
    out = session.put(np.zeros(MIB // 4, np.float32))
    session.handed_out(out, HandedOutReply())
    session.fetched(out)
    with pytest.raises(ResourceExhaustedError, match="server"):
        session.reserve_tensor(2 * MIB)  # would not fit even without it
    assert session.get(out) is not None
    session.reserve_tensor(MIB).release()  # fits once it went
    with pytest.raises(gradserve.errors.NotFoundError):
        session.get(out)
