"""``kernels.cuda_graphs``: the plan cache behind ``--cuda-graphs on``, on the stand-in cupy.

CUDA's own stream capture runs only on a GPU (``make gpu-check`` runs the LSTM
tests through it); here a capture that replays by recomputing ``fn`` into the
outputs it first returned stands in for it, so everything around the graph is
checked: static inputs refreshed on every call, results that are copies (a later
call never changes an earlier result), one plan per shape and attributes, the
LRU bound, the eager fallback, deadline checks.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from gradserve import pauses
from gradserve.kernels import backend_numpy, cuda_graphs, lstm
from tests.kernels import fake_cupy, lstm_cases, shim_backend
from tests.kernels.lstm_cases import INPUTS, random_case


class RecomputeCapture:
    """``capture(fn)``: run ``fn`` once for its outputs; ``replay()`` recomputes into them."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail: Exception | None = None

    def __call__(self, fn):
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        outputs = fn()

        def replay():
            for dst, src in zip(outputs, fn()):
                dst[...] = src

        return replay, outputs


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    lib = shim_backend.build(tmp_path_factory.mktemp("shim"))
    with fake_cupy.installed(lib):
        yield sys.modules["gradserve.kernels.backend_cuda"]


@pytest.fixture
def capture():
    return RecomputeCapture()


def case(seed, **kw):
    c = random_case(np.random.default_rng(seed), steps=4, batch=3, inputs=2, units=5, **kw)
    return [c[k] for k in INPUTS], c


def forward_numpy(arrays, **attrs):
    return lstm_cases.forward(backend_numpy, *arrays, **attrs)


def host(result):
    """Device results as host arrays: an explicit copy, as CuPy demands."""
    assert all(isinstance(a, fake_cupy.DeviceArray) for a in result)
    return [a.get() for a in result]


def test_replays_follow_new_inputs_and_return_copies(backend, capture):
    cache = cuda_graphs.GraphCache(backend, capture)
    attrs = dict(seq_len_max=3, use_peephole=True, cell_clip=0.5)
    results = []
    for seed in (1, 2, 3):
        arrays, _ = case(seed)
        results.append(
            (cache.forward(lstm.LSTMInputs(*arrays), **attrs), forward_numpy(arrays, **attrs))
        )
    assert (capture.calls, cache.captures, cache.replays, len(cache)) == (1, 1, 2, 1)
    for got, want in results:  # the first result was not overwritten by the replays
        for g, w in zip(host(got), want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


def test_the_first_call_of_a_shape_never_pauses_while_it_holds_the_build_lock(backend, capture):
    """Paused there (``--compute-quantum``), another principal's op given the slot
    would wait for the lock while holding the slot the paused one waits for
    (helper-81: every heavy op of the server hung). Its check still runs (deadline)."""
    cache = cuda_graphs.GraphCache(backend, capture)
    arrays, _ = case(6)
    seen = []
    cache.forward(
        lstm.LSTMInputs(*arrays), check=lambda: seen.append(pauses.may_pause()), seq_len_max=4
    )
    assert seen and not any(seen)
    seen.clear()
    cache.forward(
        lstm.LSTMInputs(*arrays), check=lambda: seen.append(pauses.may_pause()), seq_len_max=4
    )
    assert seen == [True]  # a replay: one check, before it, where it may pause


def test_backward_through_a_plan(backend, capture):
    cache = cuda_graphs.GraphCache(backend, capture)
    for seed in (4, 5):
        arrays, c = case(seed)
        acts = forward_numpy(arrays, seq_len_max=4)
        rest = [*arrays, *acts, c["cs_grad"], c["h_grad"]]
        got = cache.backward(
            lstm.LSTMInputs(*arrays),
            acts,
            lstm.LSTMOutputGrads(c["cs_grad"], c["h_grad"]),
            seq_len_max=4,
        )
        want = lstm_cases.backward(backend_numpy, *rest, seq_len_max=4)
        for g, w in zip(host(got), want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
    assert (cache.captures, cache.replays) == (1, 1)


def test_one_plan_per_shape_dtype_and_attributes(backend, capture):
    cache = cuda_graphs.GraphCache(backend, capture)
    arrays, _ = case(6)
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4)
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=3)  # another length: another graph
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4, use_peephole=True)
    cache.forward(lstm.LSTMInputs(*case(6, dtype=np.float32)[0]), seq_len_max=4)
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4)
    assert (cache.captures, cache.replays, len(cache)) == (4, 1, 4)


def test_inputs_already_on_the_device_are_copied_on_the_device(backend, capture):
    cupy = backend.cupy
    cache = cuda_graphs.GraphCache(backend, capture)
    arrays, _ = case(7)
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4)
    cupy.transfers["to_device"].clear()
    on_device = [cupy.asarray(a) for a in arrays]
    uploads = len(cupy.transfers["to_device"])
    got = cache.forward(lstm.LSTMInputs(*on_device), seq_len_max=4)
    assert len(cupy.transfers["to_device"]) == uploads  # no host round trip for the replay
    assert all(isinstance(a, fake_cupy.DeviceArray) for a in got)
    np.testing.assert_allclose(host(got)[6], forward_numpy(arrays, seq_len_max=4).h, atol=1e-12)


def test_lru_keeps_the_cache_under_its_bytes(backend, capture):
    arrays, _ = case(8)
    cache = cuda_graphs.GraphCache(backend, capture, max_bytes=10**9)
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4)
    one_plan = cache.nbytes
    assert one_plan >= sum(a.nbytes for a in arrays)  # at least its static inputs
    cache = cuda_graphs.GraphCache(backend, capture, max_bytes=2 * one_plan)
    for length in (4, 3, 2):
        cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=length)
    assert len(cache) == 2 and cache.nbytes <= 2 * one_plan
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4)  # evicted first: built again
    assert cache.captures == 4


def test_plan_count_and_eager_memory_are_bounded(backend, capture, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_PLANS", 2)
    monkeypatch.setattr(cuda_graphs, "MAX_EAGER_KEYS", 2)
    arrays, _ = case(13)
    cache = cuda_graphs.GraphCache(backend, capture)
    for length in (4, 3, 2):
        cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=length)
    assert len(cache) == 2
    capture.fail = RuntimeError("not capturable")
    for length in (1, 0, 4, 3, 2):
        cache = cuda_graphs.GraphCache(backend, capture) if length == 1 else cache
        cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=length)
    assert len(cache._eager) == 2


def test_too_big_or_not_capturable_runs_eagerly_and_stays_right(backend, capture):
    arrays, _ = case(9)
    want = forward_numpy(arrays, seq_len_max=4)
    tiny = cuda_graphs.GraphCache(backend, capture, max_bytes=1)
    capture.fail = RuntimeError("operation not permitted when stream is capturing")
    failing = cuda_graphs.GraphCache(backend, capture)
    for cache in (tiny, failing):
        for _ in range(2):
            got = cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4)
            for g, w in zip(host(got), want):
                np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
        assert len(cache) == 0 and cache.replays == 0
    assert capture.calls == 2  # one capture attempt per cache; then eager without trying


def test_out_of_memory_while_capturing_is_retried_later(backend, capture):
    arrays, _ = case(12)
    want = forward_numpy(arrays, seq_len_max=4)
    cache = cuda_graphs.GraphCache(backend, capture)
    capture.fail = MemoryError("out of memory allocating 52,428,800 bytes")
    got = cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4)  # served by the eager run
    np.testing.assert_allclose(host(got)[6], want.h, atol=1e-12)
    capture.fail = None
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4)  # memory again: captured now
    assert (capture.calls, cache.captures, len(cache)) == (2, 1, 1)


def test_deadline_checked_before_a_replay_and_per_step_otherwise(backend, capture):
    cache = cuda_graphs.GraphCache(backend, capture)
    arrays, _ = case(10)
    checks = []
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4, check=lambda: checks.append(1))
    assert len(checks) == 4  # the eager first run: once per step
    checks.clear()
    cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4, check=lambda: checks.append(1))
    assert len(checks) == 1

    def expired():
        raise TimeoutError("deadline")

    with pytest.raises(TimeoutError):
        cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4, check=expired)
    assert cache.replays == 1  # the expired call never launched


def test_compute_for_builds_the_graph_runner_only_for_cuda(backend):
    from gradserve.kernels.compute import compute_for

    eager = compute_for("cuda")
    graphed = compute_for("cuda", cuda_graphs=True, graph_cache_bytes=123)
    assert eager.graphs is None and eager.backend is backend
    assert isinstance(graphed.graphs, cuda_graphs.GraphCache)
    assert isinstance(graphed.graphs.capture, cuda_graphs.StreamCapture)
    assert graphed.graphs.max_bytes == 123
    with pytest.raises(ValueError, match="--device cuda"):
        compute_for("cpu", cuda_graphs=True)


def test_stream_capture_ends_a_failed_capture(backend, monkeypatch):
    cuda = backend.cupy.cuda
    streams = []

    def recording_stream(**kw):
        streams.append(cuda_stream(**kw))
        return streams[-1]

    cuda_stream = cuda.Stream
    monkeypatch.setattr(cuda, "Stream", recording_stream)
    capture = cuda_graphs.StreamCapture(backend.cupy)

    def broken():
        raise RuntimeError("not capturable")

    with pytest.raises(RuntimeError, match="not capturable"):
        capture(broken)
    assert not streams[-1].capturing  # the stream is usable again
    replay, outputs = capture(lambda: ("out",))
    assert outputs == ("out",) and not streams[-1].capturing
    replay()


def test_plans_show_in_the_metrics(backend, capture):
    from prometheus_client import generate_latest

    from gradserve.kernels.compute import Compute
    from gradserve.server.core.sessions import SessionStore
    from gradserve.server.transport.observability import Metrics

    cache = cuda_graphs.GraphCache(backend, capture)
    arrays, _ = case(11)
    for _ in range(3):
        cache.forward(lstm.LSTMInputs(*arrays), seq_len_max=4)
    compute = Compute(backend, cache)
    text = generate_latest(Metrics(SessionStore(), compute).registry).decode()
    assert "gradserve_cuda_graph_plans 1.0" in text
    assert f"gradserve_cuda_graph_bytes {float(cache.nbytes)}" in text
    assert "gradserve_cuda_graph_captures_total 1.0" in text
    assert "gradserve_cuda_graph_replays_total 2.0" in text


def test_stream_capture_of_the_lstm_replays_on_the_stand_in(backend):
    """``StreamCapture`` itself, on the stand-in's capture: work under capture is recorded,
    not run (the capture's outputs hold garbage until a replay), and a replay recomputes
    every step from the refreshed static inputs, forward and backward, float16 too."""
    cache = cuda_graphs.GraphCache(backend, cuda_graphs.StreamCapture(backend.cupy))
    for dtype in (np.float64, np.float16):
        for seed in (14, 15, 16):
            arrays, c = case(seed, dtype=dtype)
            attrs = dict(seq_len_max=3, use_peephole=True, cell_clip=0.5)
            got = cache.forward(lstm.LSTMInputs(*arrays), **attrs)
            want = forward_numpy(arrays, **attrs)
            grads = cache.backward(
                lstm.LSTMInputs(*arrays),
                lstm.LSTMActivations(*want),
                lstm.LSTMOutputGrads(c["cs_grad"], c["h_grad"]),
                seq_len_max=3,
                use_peephole=True,
            )
            want_grads = lstm_cases.backward(
                backend_numpy, *arrays, *want, c["cs_grad"], c["h_grad"],
                seq_len_max=3, use_peephole=True,
            )  # fmt: skip
            tol = 1e-3 if dtype == np.float16 else 1e-12
            for g, w in zip(host(got) + host(grads), [*want, *want_grads]):
                np.testing.assert_allclose(g, w, rtol=0, atol=tol)
    assert (cache.captures, cache.replays, len(cache._eager)) == (4, 8, 0)


def test_stream_capture_refuses_host_copies_and_the_cache_runs_eagerly(backend):
    """CUDA refuses synchronous host copies in a capture: so does the stand-in, and a call
    whose capture fails is served eagerly (as on a GPU)."""
    cupy = backend.cupy
    capture = cuda_graphs.StreamCapture(cupy)
    device = cupy.zeros(3)
    for host_work in (lambda: cupy.asarray(np.ones(3)), device.get, lambda: float(device[0])):
        with pytest.raises(RuntimeError, match="StreamCapture"):
            capture(host_work)
    replay, (doubled,) = capture(lambda: (device * 2.0,))
    assert np.isnan(doubled.get()).all()  # captured, not run
    device += 1.0
    replay()
    assert doubled.get().tolist() == [2.0, 2.0, 2.0]
