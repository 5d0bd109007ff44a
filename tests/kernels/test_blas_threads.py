"""The BLAS threads divided among the LSTM ops computing at once (``blas_threads``):
the division itself, the real library's count through threadpoolctl, and two CPU
forwards computing together through ``Compute``."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import threadpoolctl

from gradserve.kernels import blas_threads, lstm
from gradserve.kernels.blas_threads import BLAS, BlasThreads
from gradserve.kernels.compute import compute_for
from gradserve.kernels.lstm_cpu import blas_threads as plan_threads


class FakeLibrary:
    """A BLAS library as threadpoolctl controls one: its count, and every change."""

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
    assert lib.changes[-2:] == [8, 8]


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


def test_the_count_between_ops_is_the_callers():
    """A count set while no op computes (threadpool_limits in a benchmark) is the one
    the next ops divide and the last one restores."""
    lib = FakeLibrary(4)
    blas = BlasThreads(lambda: [lib])
    with blas.share(), blas.share():
        pass
    lib.threads = 2
    with blas.share(), blas.share():
        assert lib.threads == 1
    assert lib.threads == 2


def test_no_library_found_changes_nothing():
    blas = BlasThreads(lambda: [])
    with blas.share(), blas.share():
        assert blas.count() is None


def test_the_real_library():
    """NumPy's BLAS, through threadpoolctl: two ops at 2 threads get one each."""
    if BLAS.count() is None:
        pytest.skip("threadpoolctl finds no BLAS library in this NumPy")
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        with BLAS.share():
            assert _library_threads() == 2
            with BLAS.share():
                assert _library_threads() == 1
            assert _library_threads() == 2
        assert _library_threads() == 2


def _library_threads() -> int:
    return max(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")


def test_two_forwards_computing_together_each_get_one_thread():
    """Two CPU LSTM forwards through ``Compute``, held together inside their step loops
    (``check`` runs between steps): each sees one of the two threads, and what it
    computes is what it computes alone, to rounding."""
    if BLAS.count() is None:
        pytest.skip("threadpoolctl finds no BLAS library in this NumPy")
    compute = compute_for("cpu")
    rng = np.random.default_rng(0)
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    steps, batch, units = 4, 3, 5
    inputs = lstm.LSTMInputs(
        r(steps, batch, units), r(batch, units), r(batch, units), r(2 * units, 4 * units),
        r(units), r(units), r(units), r(4 * units),
    )  # fmt: skip
    attrs = dict(seq_len_max=steps, use_peephole=True)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        alone = compute.lstm_forward(inputs, **attrs)
        together = threading.Barrier(2, timeout=30)
        seen: list[int | None] = []
        results: list[lstm.LSTMActivations] = []

        def check() -> None:
            if len(seen) < 2:
                together.wait()  # both ops are inside their step loops now
                seen.append(plan_threads())
                together.wait()

        def run() -> None:
            results.append(compute.lstm_forward(inputs, check=check, **attrs))

        workers = [threading.Thread(target=run) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert seen == [1, 1]
        assert len(results) == 2
        for result in results:
            for got, want in zip(result, alone):
                # Not bit for bit: at one thread the planner may choose another
                # formulation, which sums in another order.
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert _library_threads() == 2


def test_the_server_divides_them():
    assert compute_for("cpu").blas is blas_threads.BLAS
