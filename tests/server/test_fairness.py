"""Fairness between principals: RPC slots, the compute queue and both lanes.

A hostile tenant (a review helper's ``fairness_lstm.py``, ``fairness_light.py``) took
every ``--max-concurrent-rpcs`` slot (the other principal: 0 calls served of 266),
every ``--max-queued-compute`` place (0 of 120), and every light thread (a 4-float
write waited 590 ms instead of 1.1 ms). Lane tests run on an event loop of their own
with jobs the test holds; the RPC tests hold the server's lanes the same way, so no
test depends on how long an op takes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradserve
from gradserve import pauses
from gradserve.errors import DeadlineExceededError, ResourceExhaustedError
from gradserve.server import run_server
from gradserve.server.transport.admission import Admission
from gradserve.server.transport.app import ConfigError, light_ops_per_principal
from gradserve.server.transport.lanes import Lane, pause_point
from tests.server.test_limits import lstm_args, wait_until
from tests.server_process import ServerProcess


class Jobs:
    """Jobs on a lane that run until the test releases them, in the order they ran."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.started: list[str] = []
        self._release: dict[str, threading.Event] = {}

    def submit(self, name: str, principal: str) -> asyncio.Future[str]:
        release = self._release[name] = threading.Event()

        def work() -> str:
            self.started.append(name)
            assert release.wait(10), f"{name} never released"
            return name

        return asyncio.ensure_future(self.lane.run(work, principal))

    async def finish(self, name: str, job: asyncio.Future[str]) -> None:
        self._release[name].set()
        assert await job == name

    def release_all(self) -> None:
        for event in self._release.values():
            event.set()


async def settle() -> None:
    """Let the loop hand out threads and the threads start their jobs."""
    for _ in range(5):
        await asyncio.sleep(0.02)


def test_a_freed_thread_goes_to_the_principal_served_least_not_the_oldest_call():
    async def scenario():
        lane = Lane("compute", threads=1)
        jobs = Jobs(lane)
        first = jobs.submit("a1", "a")
        await settle()
        backlog = {f"a{i}": jobs.submit(f"a{i}", "a") for i in range(2, 6)}
        other = jobs.submit("b1", "b")
        await settle()
        assert jobs.started == ["a1"] and lane.waiting == 5
        await jobs.finish("a1", first)
        await settle()
        assert jobs.started == ["a1", "b1"], "b waited behind a's whole backlog"
        await jobs.finish("b1", other)
        for name, job in backlog.items():
            await settle()
            await jobs.finish(name, job)
        assert jobs.started == ["a1", "b1", "a2", "a3", "a4", "a5"]
        assert (lane.free, lane.waiting, lane.running) == (1, 0, 0)
        lane.shutdown()

    asyncio.run(scenario())


def test_principals_with_backlogs_take_turns():
    async def scenario():
        lane = Lane("compute", threads=1)
        jobs = Jobs(lane)
        first = jobs.submit("x", "a")
        await settle()
        waiting = {}
        for i in range(3):  # a queues all its calls first
            waiting[f"a{i}"] = jobs.submit(f"a{i}", "a")
        for i in range(3):
            waiting[f"b{i}"] = jobs.submit(f"b{i}", "b")
        await settle()
        await jobs.finish("x", first)
        while len(jobs.started) < 7:
            await settle()
            await jobs.finish(jobs.started[-1], waiting[jobs.started[-1]])
        assert jobs.started == ["x", "b0", "a0", "b1", "a1", "b2", "a2"]
        lane.shutdown()

    asyncio.run(scenario())


def test_a_full_queue_gives_the_newest_place_of_the_fullest_principal_to_another():
    async def scenario():
        lane = Lane("compute", threads=1, max_waiting=3)
        jobs = Jobs(lane)
        running = jobs.submit("a1", "a")
        await settle()
        waiting = {name: jobs.submit(name, "a") for name in ("a2", "a3", "a4")}
        await settle()
        other = jobs.submit("b1", "b")
        await settle()
        with pytest.raises(ResourceExhaustedError, match="went to another principal") as info:
            await waiting.pop("a4")
        assert info.value.reason == "COMPUTE_QUEUE_FULL"
        assert (lane.waiting_of("a"), lane.waiting_of("b")) == (2, 1)
        # a, with the most places, is refused; so is b, with one place fewer than a
        # (taking another would only turn the imbalance round).
        for name, principal in (("a5", "a"), ("b2", "b")):
            with pytest.raises(ResourceExhaustedError, match="compute queue full"):
                await jobs.submit(name, principal)
        assert lane.waiting == 3
        await jobs.finish("a1", running)
        await settle()
        assert jobs.started == ["a1", "b1"]
        jobs.release_all()
        assert await other == "b1"
        assert [await job for job in waiting.values()] == ["a2", "a3"]
        assert (lane.free, lane.waiting) == (1, 0)
        lane.shutdown()

    asyncio.run(scenario())


def test_one_principal_alone_still_fills_the_queue():
    async def scenario():
        lane = Lane("compute", threads=1, max_waiting=2)
        jobs = Jobs(lane)
        held = [jobs.submit(name, "a") for name in ("a1", "a2", "a3")]
        await settle()
        assert lane.waiting == 2
        with pytest.raises(ResourceExhaustedError, match="compute queue full"):
            await jobs.submit("a4", "a")
        jobs.release_all()
        assert [await job for job in held] == ["a1", "a2", "a3"]
        lane.shutdown()

    asyncio.run(scenario())


def test_the_last_free_thread_is_kept_for_a_principal_with_nothing_running():
    async def scenario():
        lane = Lane("light", threads=3, reserve_last_thread=True)
        jobs = Jobs(lane)
        held = [jobs.submit(name, "a") for name in ("a1", "a2", "a3")]
        await settle()
        assert sorted(jobs.started) == ["a1", "a2"] and lane.waiting_of("a") == 1
        small = jobs.submit("b1", "b")
        await settle()
        assert "b1" in jobs.started, "b's op waited for one of a's"
        await jobs.finish("b1", small)
        jobs.release_all()
        assert sorted([await job for job in held]) == ["a1", "a2", "a3"]
        assert (lane.free, lane.running) == (3, 0)
        lane.shutdown()

    asyncio.run(scenario())


def test_without_the_reserve_one_principal_takes_every_thread():
    async def scenario():
        lane = Lane("light", threads=3)
        jobs = Jobs(lane)
        held = [jobs.submit(name, "a") for name in ("a1", "a2", "a3")]
        await settle()
        assert sorted(jobs.started) == ["a1", "a2", "a3"]
        jobs.release_all()
        await asyncio.gather(*held)
        lane.shutdown()

    asyncio.run(scenario())


def test_a_call_cancelled_after_its_turn_came_passes_the_thread_on():
    async def scenario():
        lane = Lane("compute", threads=1)
        jobs = Jobs(lane)
        first = jobs.submit("a1", "a")
        await settle()
        given_up = jobs.submit("b1", "b")
        after = jobs.submit("c1", "c")
        await settle()
        hand_out = lane._hand_out

        def hand_out_then_cancel():  # b1's client leaves as its turn comes
            hand_out()
            if lane.holding("b"):
                given_up.cancel()

        lane._hand_out = hand_out_then_cancel
        await jobs.finish("a1", first)
        await settle()
        assert given_up.cancelled()
        assert jobs.started == ["a1", "c1"]
        await jobs.finish("c1", after)
        assert (lane.free, lane.waiting, lane.running) == (1, 0, 0)
        lane.shutdown()

    asyncio.run(scenario())


@settings(max_examples=40, deadline=None)
@given(
    threads=st.integers(1, 3),
    max_waiting=st.one_of(st.none(), st.integers(0, 4)),
    reserve=st.booleans(),
    cap=st.one_of(st.none(), st.integers(1, 3)),
    quantum=st.sampled_from([None, 0.002]),
    plan=st.lists(
        st.tuples(st.sampled_from("abc"), st.sampled_from(["finish", "cancel", "leave", "stop"])),
        min_size=1,
        max_size=12,
    ),
)
def test_any_schedule_ends_with_every_thread_free_and_never_runs_more_than_threads(
    threads, max_waiting, reserve, cap, quantum, plan
):
    """Jobs compute in steps with a check between them (which pauses them where the
    lane has a quantum); "stop": the job's call ends (its deadline) at its next
    check, paused or not."""

    async def scenario():
        lane = Lane(
            "lane",
            threads,
            max_waiting,
            reserve_last_thread=reserve,
            max_per_principal=cap,
            quantum=quantum,
        )
        running = []
        peak = [0]
        release, stop = threading.Event(), threading.Event()

        def work(fate):
            def still_wanted():
                if fate == "stop" and stop.is_set():
                    raise DeadlineExceededError("deadline exceeded")

            def computing():
                running.append(1)
                peak[0] = max(peak[0], len(running))

            computing()
            while not release.wait(0.001):
                try:
                    still_wanted()
                finally:
                    running.pop()  # (computing no more once paused, or stopped)
                pause_point(still_wanted)  # (raises when it gives up its wait)
                computing()
            running.pop()

        calls = []
        for principal, fate in plan:
            call = asyncio.ensure_future(lane.run(functools.partial(work, fate), principal))
            calls.append((call, fate))
            await asyncio.sleep(0)
            if fate == "cancel":
                call.cancel()
            assert lane.free >= 0 and lane.waiting >= 0
        await settle()
        stop.set()
        await settle()
        release.set()
        for call, _ in calls:
            try:
                await call
            except (asyncio.CancelledError, ResourceExhaustedError, DeadlineExceededError):
                pass
        await settle()
        assert peak[0] <= threads
        assert (lane.free, lane.waiting, lane.running, lane.paused) == (threads, 0, 0, 0)
        assert not lane._holding and not lane._queues and not lane._paused
        lane.shutdown()

    asyncio.run(scenario())


# --- pauses: a long job lends its turn to another principal (--compute-quantum)


class Steps:
    """Jobs that compute in steps (a check between each, as the LSTM's), until the
    test releases them; ``log`` says what ran, in order."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.log: list[str] = []
        self._release: dict[str, threading.Event] = {}

    def submit(self, name, principal, steps=None, still_wanted=lambda: None, pausing=True):
        release = self._release[name] = threading.Event()

        def work():
            self.log.append(f"{name} starts")
            step = 0
            while not release.is_set() if steps is None else step < steps:
                time.sleep(0.001)
                step += 1
                still_wanted()  # (as servicer.Liveness: then, maybe, a pause)
                if pausing and pause_point(still_wanted):
                    self.log.append(f"{name} resumes")
            self.log.append(f"{name} ends")
            return name

        return asyncio.ensure_future(self.lane.run(work, principal))

    def release(self, name):
        self._release[name].set()

    def run(self, scenario):
        """Run ``scenario(self)`` on a loop of its own; whatever it asserts, no job
        is left computing after it."""

        async def main():
            try:
                await scenario(self)
            finally:
                for event in self._release.values():
                    event.set()
                self.lane.shutdown()

        asyncio.run(main())


def test_a_long_job_lends_its_turn_to_another_principal_and_resumes_before_its_own():
    async def scenario(jobs):
        lane = jobs.lane
        long = jobs.submit("a1", "a")
        await settle()
        own_next = jobs.submit("a2", "a", steps=1)
        other = jobs.submit("b1", "b", steps=3)
        assert await other == "b1"  # a1 runs until released: without a pause, never
        assert not long.done()
        jobs.release("a1")
        assert await long == "a1" and await own_next == "a2"
        assert jobs.log == [
            "a1 starts", "b1 starts", "b1 ends", "a1 resumes", "a1 ends", "a2 starts", "a2 ends"
        ]  # fmt: skip
        assert lane.pauses_total == 1
        assert (lane.free, lane.waiting, lane.running, lane.paused) == (1, 0, 0, 0)

    Steps(Lane("compute", threads=1, quantum=0.01)).run(scenario)


async def computes_to_its_end(jobs, first, then):
    """Job ``first`` (principal: its first letter, 30 steps) computes to its end while
    ``then`` (one step) waits."""
    long = jobs.submit(first, first[0], steps=30)
    await settle()
    other = jobs.submit(then, then[0], steps=1)
    assert await long == first and await other == then
    assert jobs.log[-4:] == [f"{first} starts", f"{first} ends", f"{then} starts", f"{then} ends"]


def test_without_a_quantum_a_long_job_keeps_its_turn():
    async def scenario(jobs):
        await computes_to_its_end(jobs, "a1", "b1")
        assert jobs.lane.pauses_total == 0

    Steps(Lane("compute", threads=1, quantum=None)).run(scenario)


def test_a_job_paused_whose_call_ends_gives_up_its_wait_and_holds_no_turn():
    async def scenario(jobs):
        lane = jobs.lane
        over = threading.Event()

        def still_wanted():
            if over.is_set():
                raise DeadlineExceededError("deadline exceeded")

        long = jobs.submit("a1", "a", still_wanted=still_wanted)
        await settle()
        other = jobs.submit("b1", "b", pausing=False)  # (b1 keeps its turn)
        while lane.paused != 1:
            await asyncio.sleep(0.005)
        over.set()  # a1's deadline passes while b1 computes
        with pytest.raises(DeadlineExceededError):
            await long
        assert (lane.paused, lane.free, lane.running) == (0, 0, 1)
        jobs.release("b1")
        assert await other == "b1"
        await settle()
        assert (lane.free, lane.waiting, lane.running, lane.paused) == (1, 0, 0, 0)
        assert jobs.log == ["a1 starts", "b1 starts", "b1 ends"]

    Steps(Lane("compute", threads=1, quantum=0.01)).run(scenario)


def test_a_job_does_not_pause_for_its_own_principal_nor_for_a_call_not_begun_at_the_limit():
    async def scenario(jobs):
        lane = jobs.lane
        await computes_to_its_end(jobs, "a1", "a2")
        # b1 pauses for c; then, the one paused place taken, c1 and b1 take turns
        # while d1, not begun, waits for one of them to end.
        b1 = jobs.submit("b1", "b")
        await settle()
        c1 = jobs.submit("c1", "c", steps=30)
        d1 = jobs.submit("d1", "d", steps=1)
        assert await c1 == "c1" and await d1 == "d1"
        jobs.release("b1")
        assert await b1 == "b1"
        log = jobs.log[4:]
        assert log[:2] == ["b1 starts", "c1 starts"] and "b1 resumes" in log[2:-5]
        assert log[-5:] == ["c1 ends", "d1 starts", "d1 ends", "b1 resumes", "b1 ends"]
        assert lane.pauses_total >= 2 and (lane.free, lane.running, lane.paused) == (1, 0, 0)

    Steps(Lane("compute", threads=1, quantum=0.005, max_paused=1)).run(scenario)


def test_at_the_pause_limit_the_paused_jobs_take_turns_with_the_one_computing():
    """slots 1, two paused at most, three principals: the job computing when two
    were paused could not pause and ran to its end, over and over, while the paused
    ones had a quantum each (helper-81: 14, 2 and 7 ops in 15 s; 10 each without
    pauses). Now it pauses for a paused one."""

    async def scenario(jobs):
        lane = jobs.lane
        calls = [jobs.submit("a1", "a")]
        await settle()
        calls += [jobs.submit("b1", "b"), jobs.submit("c1", "c")]
        end = time.monotonic() + 10
        while min(jobs.log.count(f"{p}1 resumes") for p in "abc") < 2:
            assert time.monotonic() < end, [jobs.log.count(f"{p}1 resumes") for p in "abc"]
            await asyncio.sleep(0.01)
        assert lane.paused == 2
        for name in ("a1", "b1", "c1"):
            jobs.release(name)
        assert [await call for call in calls] == ["a1", "b1", "c1"]
        assert (lane.free, lane.running, lane.paused) == (1, 0, 0)

    Steps(Lane("compute", threads=1, quantum=0.005, max_paused=2)).run(scenario)


def test_at_the_pause_limit_a_call_not_begun_does_not_stop_the_paused_taking_turns():
    """Past the limit the turn went to a paused job only if it was the next in turn
    overall, and a principal never served sorts first: with one waiting, the job
    computing ran to its end while the paused ones waited (helper-82). Now the paused
    ones take turns; the new call waits for an end."""

    async def scenario(jobs):
        calls = [jobs.submit("a1", "a")]
        await settle()
        calls.append(jobs.submit("b1", "b"))
        while "b1 starts" not in jobs.log:
            await asyncio.sleep(0.005)
        calls.append(jobs.submit("c1", "c", steps=1))
        end = time.monotonic() + 10
        while min(jobs.log.count(f"{p}1 resumes") for p in "ab") < 3:
            assert time.monotonic() < end, jobs.log
            await asyncio.sleep(0.01)
        assert "c1 starts" not in jobs.log
        jobs.release("a1")
        assert await calls[0] == "a1" and await calls[2] == "c1"
        jobs.release("b1")
        assert await calls[1] == "b1"

    Steps(Lane("compute", threads=1, quantum=0.005, max_paused=1)).run(scenario)


def test_a_job_does_not_pause_when_nobody_may_take_its_turn():
    """With the last thread kept for a principal with nothing running, a's job paused
    for b, whose next call could not take the thread (b runs one): the thread sat
    idle and a's job waited for a's other one to end (helper-82)."""

    async def scenario(jobs):
        lane = jobs.lane
        calls = [jobs.submit(name, name[0]) for name in ("a1", "a2", "b1")]
        await settle()
        calls.append(jobs.submit("b2", "b"))  # may not take the last thread: b runs b1
        await asyncio.sleep(0.3)
        assert lane.paused == 0 and lane.free == 0
        assert jobs.log.count("b2 starts") == 0
        for name in ("a1", "a2", "b1", "b2"):
            jobs.release(name)
        assert [await call for call in calls] == ["a1", "a2", "b1", "b2"]
        assert (lane.free, lane.running, lane.paused, lane.waiting) == (3, 0, 0, 0)
        assert not lane._holding and lane.pauses_total == 0

    Steps(Lane("light", threads=3, reserve_last_thread=True, quantum=0.01, max_paused=3)).run(
        scenario
    )


def test_a_job_whose_turn_would_come_straight_back_does_not_pause():
    """Two threads, a and b computing, b's next call waiting: a's turn would go back
    to a (b holds more), so a computes on, its place in turn unmoved (it paused and
    took its turn straight back, every quantum)."""

    async def scenario(jobs):
        lane = jobs.lane
        calls = [jobs.submit("a1", "a"), jobs.submit("b1", "b")]
        await settle()
        calls.append(jobs.submit("b2", "b", steps=1))
        await asyncio.sleep(0.2)
        assert "a1 resumes" not in jobs.log and "b2 starts" not in jobs.log
        for name in ("a1", "b1", "b2"):
            jobs.release(name)
        assert [await call for call in calls] == ["a1", "b1", "b2"]
        assert lane.pauses_total == 0 and (lane.free, lane.running, lane.paused) == (2, 0, 0)

    Steps(Lane("compute", threads=2, quantum=0.005)).run(scenario)


def test_a_call_waiting_for_anothers_measure_of_its_shape_lets_it_go_on():
    """The first CPU forward of a shape measures its formulations and may pause
    between its timed runs; a call of the same shape given its turn waited for the
    measurement without a check, holding the turn the measurer waited for: for ever
    without a deadline (helper-82). It checks, and so pauses, while it waits."""
    from gradserve.kernels import backend_numpy, lstm, lstm_cpu
    from gradserve.lstm_signature import LSTMInputs
    from tests.kernels.lstm_cases import INPUTS, random_case

    case = random_case(np.random.default_rng(0), 60, 3, 7, 5, np.float32)
    inputs = LSTMInputs(*(case[k] for k in INPUTS))

    def check():  # as servicer.Liveness, with no deadline
        if pauses.may_pause():
            pause_point(lambda: None)

    def forward(busy):
        def work():
            t0 = time.monotonic()
            while time.monotonic() - t0 < busy:  # the op's earlier work: past its quantum
                pass
            return lstm.block_lstm_forward(backend_numpy, inputs, seq_len_max=60, check=check)

        return work

    async def scenario():
        lane = Lane("compute", 1, quantum=0.05)
        first = asyncio.ensure_future(lane.run(forward(0.06), "a"))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(lane.run(forward(0.0), "b"))
        try:
            done, _ = await asyncio.wait([first, second], timeout=20)
            assert len(done) == 2, "a call waited for a measurement that waited for it"
        finally:
            lane.shutdown()
        for a, b in zip(first.result(), second.result()):
            np.testing.assert_array_equal(a, b)

    saved = lstm_cpu.PLANNER
    lstm_cpu.PLANNER = lstm_cpu.Planner()  # a shape nobody measured yet
    try:
        asyncio.run(scenario())
    finally:
        lstm_cpu.PLANNER = saved


def test_the_server_lets_one_op_per_principal_pause(tokens, tmp_path):
    many = tmp_path / "many"
    many.write_text("".join(f"p{i}:token-{i}\n" for i in range(300)))
    for token_file, slots, paused in ((tokens, 1, 2), (tokens, 3, 6), (str(many), 1, 256)):
        with run_server(device="cpu", token_file=token_file, compute_slots=slots) as server:
            assert server.servicer.heavy.max_paused == paused


def test_a_tensor_arrays_check_under_its_lock_never_pauses():
    """Paused holding the array's lock, the job would make another op of its session,
    given the turn, wait for the lock while holding the turn (``gradserve.pauses``)."""
    from gradserve.server.core.tensor_array import TensorArray

    array = TensorArray(name="t", dtype=np.dtype(np.float32), size=4, clear_after_read=False)
    for i in range(4):
        array.write(i, np.ones(2, np.float32))
    seen = []
    array.gather(list(range(4)) * 300, (2,), check=lambda: seen.append(pauses.may_pause()))
    assert seen and not any(seen)
    assert pauses.may_pause()


# --- over the real RPC path, with a token file


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("fairness") / "tokens"
    path.write_text("a:token-a\nb:token-b\n")
    return str(path)


def connect(server, principal, **kw):
    return gradserve.Client(
        f"127.0.0.1:{server.port}",
        token=f"token-{principal}",
        shared_memory=False,
        keepalive=False,
        **kw,
    )


def hold(server, lane, principal, count):
    """``count`` jobs of ``principal`` holding the server's ``lane`` until the
    returned event is set."""
    release = threading.Event()
    jobs = [
        asyncio.run_coroutine_threadsafe(
            lane.run(lambda: release.wait(60), principal), server._loop
        )
        for _ in range(count)
    ]
    return release, jobs


def test_one_principal_cannot_hold_every_rpc_slot(tokens):
    with run_server(
        device="cpu", token_file=tokens, max_concurrent_rpcs=4, compute_slots=1
    ) as server:
        heavy, admission = server.servicer.heavy, server.servicer.admission
        release, blocker = hold(server, heavy, "test", 1)
        wait_until(lambda: heavy.free == 0)
        with connect(server, "a") as a, connect(server, "b") as b:
            pool = concurrent.futures.ThreadPoolExecutor(2)
            slow = [pool.submit(a.raw_ops.BlockLSTMV2, *lstm_args()) for _ in range(2)]
            wait_until(lambda: heavy.waiting == 2)
            with pytest.raises(ResourceExhaustedError, match="per-principal") as info:
                a.stop_gradient(np.ones(1))
            assert info.value.reason == "TOO_MANY_CALLS_FOR_PRINCIPAL"
            assert b.stop_gradient(np.ones(1))[0] == 1  # two slots are left, for b
            release.set()
            assert [len(call.result(30)) for call in slow] == [7, 7]
            blocker[0].result(10)
            pool.shutdown()
        wait_until(lambda: admission.in_flight == 0)
        assert not admission._calls_of


@contextlib.contextmanager
def server_apart(*flags):
    """A server in a process of its own: in this one, a compute thread stepping a tiny
    LSTM in Python and the test's clients all contend for one GIL, and a call's
    many hand-overs of it took seconds (b's call was not even queued after 5 s)."""
    server = ServerProcess(*flags)
    try:
        yield server
    finally:
        server.stop()


def test_a_long_lstm_lends_the_compute_slot_to_another_principals_call(tokens):
    """An LSTM of 300,000 steps (a 163-byte request) held the only compute slot for
    8.5 s while another tenant's small one waited (a review helper). Here a's op would
    compute for many seconds; b's call is answered while it does, and a's ends at its
    deadline with the slot free."""
    # NumPy's passes: an op of tiny cells that computes for seconds (FUSED's compiled
    # calls of several steps took 0.5 s for 1,000,000 of them, inside a's deadline)
    flags = ("--token-file", tokens, "--compute-slots", "1", "--compute-quantum", "0.02",
             "--cpu-step-kernel", "numpy")  # fmt: skip
    with server_apart(*flags) as server:
        with (
            # a's deadline well inside its op's time (1,000,000 steps: about 10 s with
            # NumPy's passes)
            gradserve.Client(server.target, token="token-a", timeout=2) as a,
            gradserve.Client(server.target, token="token-b", timeout=60) as b,
        ):
            alone = b.raw_ops.BlockLSTMV2(*lstm_args())  # nobody waits: no pause
            pool = concurrent.futures.ThreadPoolExecutor(1)
            long = pool.submit(a.raw_ops.BlockLSTMV2, *lstm_args(1_000_000))
            wait_until(lambda: server.metric("gradserve_compute_running") == 1)
            shared = b.raw_ops.BlockLSTMV2(*lstm_args())
            assert not long.done(), "b's call waited for a's to end"
            assert server.metric("gradserve_compute_pauses_total") >= 1
            for got, expected in zip(shared, alone):
                np.testing.assert_array_equal(got, expected)
            with pytest.raises(DeadlineExceededError):
                long.result(30)
            pool.shutdown()
        wait_until(lambda: server.metric("gradserve_compute_running") == 0)
        assert server.metric("gradserve_compute_paused") == 0


def test_the_compute_lane_lends_its_slots_by_default_and_never_with_the_quantum_off(tokens):
    from gradserve.server.transport.cli import build_parser

    assert build_parser().parse_args(["serve", "--compute-quantum", "off"]).compute_quantum is None
    with run_server(device="cpu", token_file=tokens) as server:
        assert server.servicer.heavy.quantum == 0.05 and server.servicer.light.quantum is None
    with run_server(device="cpu", token_file=tokens, compute_quantum=None) as server:
        assert server.servicer.heavy.quantum is None and server.servicer.heavy.max_paused == 0


def test_lstms_paused_many_times_compute_what_they_compute_alone(tokens):
    flags = ("--token-file", tokens, "--compute-slots", "1", "--compute-quantum", "0.001")
    with server_apart(*flags) as server:
        with (
            gradserve.Client(server.target, token="token-a", timeout=60) as a,
            gradserve.Client(server.target, token="token-b", timeout=60) as b,
        ):
            # Long enough that each call computes while the other is sent, however fast
            # the steps: with the compiled step 20,000 took 0.1 s, and under load one
            # call could end before the other came.
            inputs = lstm_args(80_000)
            alone = [a.raw_ops.BlockLSTMV2(*inputs) for _ in range(2)]
            assert server.metric("gradserve_compute_pauses_total") == 0
            for got, expected in zip(*alone):
                np.testing.assert_array_equal(got, expected)
            pool = concurrent.futures.ThreadPoolExecutor(2)
            calls = [pool.submit(c.raw_ops.BlockLSTMV2, *inputs) for c in (a, b)]
            for call in calls:
                for got, expected in zip(call.result(60), alone[0]):
                    np.testing.assert_array_equal(got, expected)
            pool.shutdown()
            assert server.metric("gradserve_compute_pauses_total") >= 2
            assert server.metric("gradserve_compute_running") == 0


def test_another_principal_takes_a_place_in_a_full_compute_queue(tokens):
    with run_server(
        device="cpu", token_file=tokens, compute_slots=1, max_queued_compute=2
    ) as server:
        heavy = server.servicer.heavy
        release, blocker = hold(server, heavy, "test", 1)
        wait_until(lambda: heavy.free == 0)
        with connect(server, "a") as a, connect(server, "b") as b:
            pool = concurrent.futures.ThreadPoolExecutor(3)
            first = pool.submit(a.raw_ops.BlockLSTMV2, *lstm_args())
            wait_until(lambda: heavy.waiting == 1)
            second = pool.submit(a.raw_ops.BlockLSTMV2, *lstm_args())
            wait_until(lambda: heavy.waiting == 2)
            other = pool.submit(b.raw_ops.BlockLSTMV2, *lstm_args())
            with pytest.raises(ResourceExhaustedError, match="another principal") as info:
                second.result(30)
            assert info.value.reason == "COMPUTE_QUEUE_FULL"
            release.set()
            assert len(other.result(30)) == 7 and len(first.result(30)) == 7
            blocker[0].result(10)
            pool.shutdown()


def test_a_flood_of_slow_light_ops_leaves_a_thread_for_another_principal(tokens):
    with run_server(device="cpu", token_file=tokens, workers=3) as server:
        light = server.servicer.light
        release, held = hold(server, light, "a", 3)
        try:
            wait_until(lambda: light.holding("a") == 2 and light.waiting_of("a") == 1)
            with connect(server, "b", timeout=10) as b:
                # Without the reserve this call waited for one of a's jobs: never.
                assert b.stop_gradient(np.ones(1))[0] == 1
        finally:
            release.set()
        for job in held:
            job.result(10)


def test_two_principals_flooding_leave_a_slot_for_a_third():
    """Each flooder within its half of the slots, two together took them all, and a
    third principal was refused 299 times of 300 (found by a review helper). The last
    slots (one in sixteen) go only to a principal with nothing in flight."""
    admission = Admission(16, 8, max_calls_per_principal=8, reserve_for_newcomers=True)
    assert (admission.calls_reserved, admission.streams_reserved) == (1, 1)
    for principal, calls in (("a", 8), ("c", 7)):
        for _ in range(calls):
            admission.enter(principal)
    with pytest.raises(ResourceExhaustedError, match="kept for principals with none") as info:
        admission.enter("c")  # c has calls in flight: the last slot is not for it
    assert info.value.reason == "TOO_MANY_CALLS"
    admission.enter("b")  # b has none: it gets the slot kept
    with pytest.raises(ResourceExhaustedError, match="the server's limit"):
        admission.enter("d")
    for _ in range(7):  # streams: the same rule
        admission.enter("a", stream=True)
    with pytest.raises(ResourceExhaustedError, match="kept for principals with none open"):
        admission.enter("a", stream=True)
    admission.enter("b", stream=True)
    for principal, calls in (("a", 8), ("c", 7), ("b", 1)):
        for _ in range(calls):
            admission.exit(principal)
    for principal, streams in (("a", 7), ("b", 1)):
        for _ in range(streams):
            admission.exit(principal, stream=True)
    assert admission.in_flight == 0 and not admission._calls_of and not admission._streams_of


def test_one_principal_or_none_reserves_nothing(tmp_path):
    """A reserve for other principals only wastes threads and slots where there are
    none (a lone tenant's 64 MiB gathers ran one at a time on two light threads)."""
    one = tmp_path / "one"
    one.write_text("a:token-a\na:token-a2\n")  # two tokens, one principal
    two = tmp_path / "two"
    two.write_text("a:token-a\nb:token-b\n")
    for token_file, reserved in ((None, 0), (str(one), 0), (str(two), 1)):
        with run_server(device="cpu", token_file=token_file, workers=2) as server:
            assert server.servicer.light._reserve == reserved, token_file
            assert server.servicer.admission.calls_reserved == (reserved and 256 // 16)


@pytest.mark.parametrize("cap", [0, -2])
def test_a_per_principal_call_cap_below_one_is_refused_at_start(tokens, cap):
    with pytest.raises(ConfigError, match="at least 1"):
        with run_server(device="cpu", token_file=tokens, max_concurrent_rpcs_per_principal=cap):
            pass


def test_a_principal_runs_at_most_its_share_of_light_ops_at_once():
    """A thread given was not all another principal's small op needed: it contends
    for the cores and the GIL with every op running (b's 4-float write: 143 ms at a
    median behind 15 of a's 64 MiB gathers, 10 ms behind 4). Past its share a
    principal's ops wait, with threads free."""

    async def scenario():
        lane = Lane("light", threads=6, max_per_principal=2)
        jobs = Jobs(lane)
        held = [jobs.submit(f"a{i}", "a") for i in range(3)]
        await settle()
        assert sorted(jobs.started) == ["a0", "a1"]
        assert lane.waiting_of("a") == 1 and lane.free == 4
        other = jobs.submit("b0", "b")
        await settle()
        assert "b0" in jobs.started
        jobs.release_all()
        assert await other == "b0"
        assert sorted([await job for job in held]) == ["a0", "a1", "a2"]
        assert (lane.free, lane.waiting) == (6, 0)
        lane.shutdown()

    asyncio.run(scenario())


def test_the_light_share_applies_with_several_principals_only(tmp_path):
    two = tmp_path / "two"
    two.write_text("a:token-a\nb:token-b\n")
    with run_server(device="cpu", token_file=str(two)) as server:
        assert server.servicer.light.max_per_principal == light_ops_per_principal()
    with run_server(device="cpu") as server:
        assert server.servicer.light.max_per_principal is None
