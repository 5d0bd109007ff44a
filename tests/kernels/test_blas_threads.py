"""The BLAS threads divided among the LSTM ops computing at once (``blas_threads``):
the division itself, the real library's count through threadpoolctl, and two CPU
forwards computing together through ``Compute``."""

from __future__ import annotations

import contextlib
import glob
import os
import threading

import numpy as np
import pytest
import threadpoolctl

from gradserve import pauses
from gradserve.kernels import backend_numpy, blas_threads, lstm, lstm_cpu
from gradserve.kernels.blas_threads import BlasThreads
from gradserve.kernels.compute import Compute, compute_for
from gradserve.kernels.lstm_cpu import Formulation


class FakeLibrary:
    """A BLAS library as threadpoolctl controls one: its count, and every change."""

    threading_layer = "pthreads"

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.changes: list[int] = []

    def get_num_threads(self) -> int:
        return self.threads

    def set_num_threads(self, threads: int) -> None:
        self.threads = threads
        self.changes.append(threads)


def test_ops_divide_the_threads_and_the_last_one_restores_them():
    lib = FakeLibrary(8)
    blas = BlasThreads(lambda: [lib])
    with blas.share():
        assert lib.threads == 8
        with blas.share():
            assert lib.threads == 4
            with blas.share():
                assert lib.threads == 2
        assert lib.threads == 8
        second = blas.share()
        second.__enter__()
        assert lib.threads == 4
    assert lib.threads == 8  # the op that started second computes alone now: all
    second.__exit__(None, None, None)
    assert lib.threads == 8
    assert lib.changes == [4, 2, 4, 8, 4, 8]  # only changes are set


def test_a_paused_op_lends_its_share_to_those_computing():
    """A paused op (``--compute-quantum``) computes nothing: the op computing in its
    place gets its threads, and it takes its share again when it goes on, however
    its pause ends (a deadline passing while it waits raises there)."""
    lib = FakeLibrary(8)
    blas = BlasThreads(lambda: [lib])
    seen = []

    def paused_op():  # (on a thread of its own, as on a lane: pauses are per thread)
        with blas.share():
            seen.append(lib.threads)
            with pauses.paused():
                seen.append(lib.threads)
            seen.append(lib.threads)
            with pytest.raises(TimeoutError), pauses.paused():
                raise TimeoutError
            seen.append(lib.threads)

    with blas.share():
        op = threading.Thread(target=paused_op)
        op.start()
        op.join()
        assert seen == [4, 8, 4, 4]
        assert lib.threads == 8
    assert lib.threads == 8


def test_at_least_one_thread_each():
    lib = FakeLibrary(2)
    blas = BlasThreads(lambda: [lib])
    with blas.share(), blas.share(), blas.share():
        assert lib.threads == 1
    assert lib.threads == 2


def test_a_failing_op_gives_its_share_back():
    lib = FakeLibrary(4)
    blas = BlasThreads(lambda: [lib])
    with blas.share():
        with pytest.raises(RuntimeError), blas.share():
            raise RuntimeError("the op failed")
        assert lib.threads == 4
    assert lib.threads == 4


def test_the_count_is_the_one_the_first_op_found():
    """The server owns the count: one set between ops (by an embedding process's
    ``threadpool_limits`` that recorded a divided count, say) is replaced at the next
    op and the first op's count put back, so the server never stays at a share."""
    lib = FakeLibrary(4)
    blas = BlasThreads(lambda: [lib])
    with blas.share(), blas.share():
        assert lib.threads == 2
    lib.threads = 1
    with blas.share():
        assert lib.threads == 4
    assert lib.threads == 4


def test_a_failing_set_leaves_no_op_counted():
    class Refusing(FakeLibrary):
        def set_num_threads(self, threads: int) -> None:
            raise OSError("refused")

    lib = Refusing(4)
    blas = BlasThreads(lambda: [lib])
    with blas.share():  # alone: the count as it is, nothing set
        with pytest.raises(OSError), blas.share():
            pass
        assert blas._running == 1


def test_a_per_thread_count_is_left_alone():
    """OpenBLAS on OpenMP keeps a count per calling thread: a set would reach only the
    thread of the op that starts or ends, so nothing is set."""
    lib = FakeLibrary(4)
    lib.threading_layer = "openmp"
    blas = BlasThreads(lambda: [lib])
    with blas.share(), blas.share():
        assert lib.threads == 4
    assert lib.changes == []


def test_plans_are_keyed_by_the_process_count():
    """While ops divide the threads, an op's plan is keyed by the process's count, not
    its share; outside ops, by the count as it is."""
    lib = FakeLibrary(4)
    blas = BlasThreads(lambda: [lib])
    assert blas.plan_count() == 4
    with blas.share(), blas.share():
        assert lib.threads == 2 and blas.plan_count() == 4
    lib.threads = 1  # a caller's limit around a kernel call of its own
    assert blas.plan_count() == 1


def test_no_library_found_changes_nothing():
    blas = BlasThreads(lambda: [])
    with blas.share(), blas.share():
        assert blas.count() is None


def _real() -> BlasThreads:
    """A fresh count over NumPy's real BLAS, its first op's count the caller's limit.
    Skipped only where NumPy bundles no BLAS threadpoolctl can see."""
    blas = BlasThreads()
    if blas.count() is None:
        bundled = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
        assert not glob.glob(os.path.join(bundled, "*openblas*")), "NumPy's OpenBLAS not found"
        pytest.skip("threadpoolctl finds no BLAS library in this NumPy")
    return blas


def test_the_real_library():
    """NumPy's BLAS, through threadpoolctl: two ops at 2 threads get one each."""
    with process_count(2):
        blas = _real()
        with blas.share():
            assert _library_threads() == 2
            with blas.share():
                assert _library_threads() == 1
            assert _library_threads() == 2
        assert _library_threads() == 2


@contextlib.contextmanager
def process_count(threads: int):
    """NumPy's BLAS at ``threads`` in the block, set as a server process has it: by no
    thread that keeps threadpoolctl's hold (``threadpool_limits`` would keep it, and
    then the ops' threads could not divide the count)."""
    libs = threadpoolctl.ThreadpoolController().lib_controllers
    blas = [lib for lib in libs if lib.user_api == "blas"]
    before = [lib.get_num_threads() for lib in blas]

    def set_all(counts):
        for lib, count in zip(blas, counts):
            lib.set_num_threads(count)
            let_go = getattr(lib, "clear_controlling_thread", None)  # threadpoolctl 3.8
            if let_go is not None:
                let_go()

    set_all([threads] * len(blas))
    try:
        yield
    finally:
        set_all(before)


def _library_threads() -> int:
    return max(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")


@pytest.mark.parametrize("op", ["forward", "backward"])
def test_two_ops_computing_together_each_get_one_thread(op, monkeypatch):
    """Two CPU LSTM ops through ``Compute``, held together inside their step loops
    (``check`` runs between steps): each sees one of the two threads, and its plan is
    the one of the process's count."""
    rng = np.random.default_rng(0)
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    steps, batch, units = 4, 3, 5
    inputs = lstm.LSTMInputs(
        r(steps, batch, units), r(batch, units), r(batch, units), r(2 * units, 4 * units),
        r(units), r(units), r(units), r(4 * units),
    )  # fmt: skip
    attrs = dict(seq_len_max=steps, use_peephole=True)
    activations = lstm.block_lstm_forward(backend_numpy, inputs, **attrs)
    grads = lstm.LSTMOutputGrads(r(steps, batch, units), r(steps, batch, units))
    with process_count(2):
        blas = _real()
        monkeypatch.setattr(blas_threads, "BLAS", blas)  # the server's, as it starts
        compute = compute_for("cpu", share_blas_threads=True)
        # The plans: CONCAT at the process's 2 threads, HOISTED at 1. They sum in
        # different orders: had the key followed the share, the ops computing together
        # would have used HOISTED and differed from the op alone in the last bits.
        key = (batch, units, units, "<f4")
        monkeypatch.setattr(lstm_cpu, "PLANNER", lstm_cpu.Planner())
        for threads, form in ((2, Formulation.CONCAT), (1, Formulation.HOISTED)):
            timings = {f: 1.0 for f in Formulation} | {form: 0.5}
            lstm_cpu.PLANNER.record((*key, threads, True), timings)

        def call(**more):
            if op == "forward":
                return compute.lstm_forward(inputs, **attrs, **more)
            return compute.lstm_backward(inputs, activations, grads, **attrs, **more)

        alone = call()
        together = threading.Barrier(2, timeout=30)
        seen: list[int | None] = []
        results: list[tuple] = []

        def check() -> None:
            if len(seen) < 2:
                together.wait()  # both ops are inside their step loops now
                seen.append((blas.count(), lstm_cpu.blas_threads()))
                together.wait()

        def run() -> None:
            results.append(call(check=check))

        workers = [threading.Thread(target=run) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert seen == [(1, 2), (1, 2)]  # each op's share; the plan's count
        assert len(results) == 2
        # Bit for bit: the same plan. (At this size OpenBLAS splits no GEMM between its
        # threads either; at larger ones the share changes the last bits, which is why
        # sharing is off by default.)
        for result in results:
            for got, want in zip(result, alone):
                np.testing.assert_array_equal(got, want)
        assert _library_threads() == 2


def test_sharing_is_off_unless_asked():
    """Off by default: every op computes with all the threads, its bits independent of
    the load. ``--share-blas-threads on`` reaches ``Compute`` through the server."""
    assert compute_for("cpu").blas is None
    assert compute_for("cpu", share_blas_threads=True).blas is blas_threads.BLAS
    from gradserve.server import ServerConfig, run_server

    for share in (False, True):
        config = ServerConfig(port=0, device="cpu", share_blas_threads=share)
        with run_server(config) as server:
            assert (server.servicer.compute.blas is blas_threads.BLAS) is share


def test_a_shape_is_planned_once_however_many_calls_come():
    """Calls of one shape that come while its first call measures wait for that choice
    (each choosing for itself, they computed other bits); a failed measurement leaves
    the next call to measure."""
    planner = lstm_cpu.Planner()
    key = (1, 2, 3, "<f4", 2, True)
    started, release = threading.Event(), threading.Event()
    measured: list[int] = []

    def measure() -> dict:
        measured.append(1)
        started.set()
        release.wait(30)
        return {f: float(i) for i, f in enumerate(Formulation)}

    chosen: list = []
    first = threading.Thread(target=lambda: chosen.append(planner.plan(key, measure)))
    first.start()
    started.wait(30)
    second = threading.Thread(target=lambda: chosen.append(planner.plan(key, measure)))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waiting for the first call's choice
    release.set()
    first.join(30)
    second.join(30)
    assert measured == [1] and chosen == [list(Formulation)[0]] * 2

    def failing() -> dict:
        raise TimeoutError("the call's deadline passed while it measured")

    other = (4, 5, 6, "<f4", 2, True)
    with pytest.raises(TimeoutError):
        planner.plan(other, failing)
    assert planner.plan(other, measure) == list(Formulation)[0]


def test_only_numpys_own_library_is_set(monkeypatch):
    """Where NumPy's wheel bundles its BLAS, another BLAS in the process (SciPy's,
    torch's) keeps its count; without a bundled one, every BLAS found is NumPy's
    candidate."""
    site = os.path.dirname(os.path.dirname(os.path.realpath(np.__file__)))
    bundled = os.path.join(site, "numpy.libs")
    own, other = FakeLibrary(2), FakeLibrary(1)
    own.user_api = other.user_api = "blas"
    own.filepath = os.path.join(bundled, "libscipy_openblas64_-x.so")
    other.filepath = "/opt/other/libopenblas.so"

    class Controller:
        def __init__(self, libs):
            self.lib_controllers = libs

    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", lambda: Controller([own, other]))
    assert blas_threads._blas_libraries() == [own]
    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", lambda: Controller([other]))
    assert blas_threads._blas_libraries() == [other]


def test_each_op_thread_may_divide_after_another_did():
    """threadpoolctl (3.8) heeds only the thread that set the count first, until it
    lets go or ends; a server's compute threads live on between ops. So an op whose
    thread set the count lets go, or the next op on another thread could not divide."""
    with process_count(2):
        blas = _real()
        done = threading.Event()
        seen: list[int | None] = []

        def op(finished: threading.Event) -> None:
            with blas.share():
                seen.append(blas.count())
            finished.set()
            done.wait(30)  # the thread lives on, as a lane's does

        long_in, long_out = threading.Event(), threading.Event()

        def long_op() -> None:
            with blas.share():
                long_in.set()
                long_out.wait(30)
            done.wait(30)

        threads = [threading.Thread(target=long_op)]
        threads[0].start()
        long_in.wait(30)
        for _ in range(2):  # one after the other, each beside the long op
            finished = threading.Event()
            threads.append(threading.Thread(target=op, args=(finished,)))
            threads[-1].start()
            finished.wait(30)
        long_out.set()
        done.set()
        for t in threads:
            t.join(30)
        assert seen == [1, 1]
        assert _library_threads() == 2


def test_by_default_ops_together_compute_the_bits_of_one_alone(monkeypatch):
    """Without sharing, two forwards held together compute exactly what one computes
    alone, at a size where OpenBLAS splits the GEMMs between its threads (shared, each
    would compute with one thread and differ in the last bits: the control)."""
    rng = np.random.default_rng(2)
    steps, batch, units = 8, 32, 256
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    inputs = lstm.LSTMInputs(
        r(steps, batch, units), r(batch, units), r(batch, units), r(2 * units, 4 * units),
        r(units), r(units), r(units), r(4 * units),
    )  # fmt: skip
    attrs = dict(seq_len_max=steps, use_peephole=True)

    def together(compute) -> list:
        barrier = threading.Barrier(2, timeout=30)
        held: list[int] = []
        results: list = []

        def check() -> None:
            if len(held) < 2:
                barrier.wait()
                held.append(1)
                barrier.wait()

        def run() -> None:
            results.append(compute.lstm_forward(inputs, check=check, **attrs))

        workers = [threading.Thread(target=run) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert len(results) == 2
        return results

    def differs(results, alone) -> bool:
        return any(not np.array_equal(g, w) for res in results for g, w in zip(res, alone))

    # One plan for both counts (a measuring op would wait for the other at the barrier):
    # what differs between them is then the threads' split of the GEMMs alone.
    monkeypatch.setattr(lstm_cpu, "PLANNER", lstm_cpu.Planner())
    for threads in (1, 2):
        timings = {f: 1.0 for f in Formulation} | {Formulation.CONCAT: 0.5}
        lstm_cpu.PLANNER.record((batch, units, units, "<f4", threads, True), timings)
    with process_count(2):
        _real()
        compute = compute_for("cpu")
        alone = compute.lstm_forward(inputs, **attrs)
        assert not differs(together(compute), alone)
        if _bits_follow_the_thread_count():  # else no split shows in the bits
            shared = Compute(backend_numpy, blas=BlasThreads())
            shared.blas.start()
            assert differs(together(shared), alone), "the control: shared ops computed alike"


def _bits_follow_the_thread_count() -> bool:
    """Whether NumPy's BLAS gives other bits for this test's GEMM with one thread than
    with two. OpenBLAS's Haswell kernels do; its SkylakeX kernels (what an AVX-512 CPU
    gets unless ``OPENBLAS_CORETYPE`` says otherwise) split the work so that each
    element sums alike however many threads compute."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((32, 512)).astype(np.float32)
    b = rng.standard_normal((512, 1024)).astype(np.float32)
    with process_count(1):
        one = a @ b
    with process_count(2):
        two = a @ b
    return not np.array_equal(one, two)
