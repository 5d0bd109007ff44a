"""Many client threads at once: shared arrays stay consistent, results exact."""

from __future__ import annotations

import threading

import numpy as np

import gradserve

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
