"""Warm host buffers (``gradserve.warm_buffers``): a freed large tensor's buffer is
reused by the next tensor of its size, never while any view of it lives, within the
cache's byte limit and idle time; and over the real RPC path, tensors put into
reused buffers read back exactly (shared memory and streamed puts alike)."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import gradserve
from gradserve.server import run_server
from gradserve.server.core.sessions import SessionStore
from gradserve.warm_buffers import MIN_BYTES, PAGE, WarmBuffers

MIB = 1 << 20


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_a_freed_buffer_is_reused_for_the_same_size():
    cache = WarmBuffers(64 * MIB)
    first = cache.empty(8 * MIB)
    where = address(first)
    del first
    second = cache.empty(8 * MIB)
    assert address(second) == where
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_buffer_is_not_reused_while_a_view_of_it_lives():
    cache = WarmBuffers(64 * MIB)
    first = cache.empty(8 * MIB)
    first[:] = 1
    view = first.view(np.float32).reshape(-1, 1024)[3:]
    view.flags.writeable = False
    where = address(first)
    del first
    gc.collect()
    assert cache.cached_bytes == 0
    second = cache.empty(8 * MIB)
    assert address(second) != where
    second[:] = 2
    assert np.all(view.view(np.uint8) == 1)
    del view
    assert cache.cached_bytes == 8 * MIB


def test_sizes_round_to_pages():
    cache = WarmBuffers(64 * MIB)
    first = cache.empty(8 * MIB - 5)
    assert first.nbytes == 8 * MIB - 5
    where = address(first)
    del first
    assert address(cache.empty(8 * MIB - PAGE + 1)) == where


def test_small_buffers_and_a_zero_limit_bypass_the_cache():
    cache = WarmBuffers(64 * MIB)
    small = cache.empty(MIN_BYTES - 1)
    assert small.base is None
    del small
    off = WarmBuffers(0)
    big = off.empty(8 * MIB)
    assert big.base is None
    del big
    assert cache.cached_bytes == off.cached_bytes == 0
    assert cache.hits == cache.misses == off.hits == off.misses == 0


def test_the_limit_drops_the_least_recently_freed():
    cache = WarmBuffers(20 * MIB)
    a, b, c = cache.empty(8 * MIB), cache.empty(8 * MIB), cache.empty(6 * MIB)
    where_b = address(b)
    del a
    del b
    del c
    # a (8) + b (8) + c (6) = 22 MiB > 20: a, freed first, went.
    assert cache.cached_bytes == 14 * MIB
    held = cache.empty(8 * MIB)
    assert address(held) == where_b
    again = cache.empty(8 * MIB)  # a's buffer is gone: a new one
    assert cache.misses == 4
    assert address(again) != where_b


def test_a_buffer_larger_than_the_limit_is_not_kept():
    cache = WarmBuffers(6 * MIB)
    big = cache.empty(8 * MIB)
    del big
    assert cache.cached_bytes == 0


def test_idle_buffers_expire():
    cache = WarmBuffers(64 * MIB, idle_seconds=10.0)
    first = cache.empty(8 * MIB)
    del first
    assert cache.cached_bytes == 8 * MIB
    assert cache.expire_idle(now=time.monotonic() + 5) == 0
    assert cache.expire_idle(now=time.monotonic() + 11) == 8 * MIB
    assert cache.cached_bytes == 0


def test_the_session_reaper_expires_idle_buffers():
    store = SessionStore(host_cache_bytes=64 * MIB)
    store.buffers.idle_seconds = 0.0
    buf = store.buffers.empty(8 * MIB)
    del buf
    assert store.buffers.cached_bytes == 8 * MIB
    store.expire_idle()
    assert store.buffers.cached_bytes == 0


# ------------------------------------------------------------ the real RPC path
@pytest.fixture(scope="module")
def cached_server():
    with run_server(host_cache_bytes=256 * MIB) as server:
        yield server


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "stream"])
def test_puts_into_reused_buffers_read_back_exactly(cached_server, shared_memory):
    buffers = cached_server.store.buffers
    buffers.clear()  # what an earlier test freed
    rng = np.random.default_rng(0)
    with gradserve.Client(
        f"127.0.0.1:{cached_server.port}", timeout=60, shared_memory=shared_memory
    ) as client:
        if shared_memory:
            assert client._shm is not None
        shape = (3 * MIB // 4 + 1, 2)  # 6 MiB + 8 bytes of float32
        first_value = rng.standard_normal(shape).astype(np.float32)
        first = client.put(first_value)
        hits = buffers.hits
        second_value = rng.standard_normal(shape).astype(np.float32)
        second = client.put(second_value)  # the first is alive: a new buffer
        assert buffers.hits == hits
        np.testing.assert_array_equal(client.get(first), first_value)
        client.delete(first)
        third_value = rng.standard_normal(shape).astype(np.float32)
        third = client.put(third_value)  # the first's buffer, reused
        assert buffers.hits == hits + 1
        np.testing.assert_array_equal(client.get(second), second_value)
        np.testing.assert_array_equal(client.get(third), third_value)
        out = client.raw_ops.StopGradient(input=third)
        np.testing.assert_array_equal(out, third_value)
        client.delete(second, third)


def test_typed_arrays_come_from_the_cache():
    cache = WarmBuffers(64 * MIB)
    first = cache.array((100, 64, 512), np.float32)  # 12.5 MiB
    assert first.shape == (100, 64, 512) and first.dtype == np.float32
    where = address(first)
    del first
    again = cache.array((100, 64, 512), np.float32)
    assert address(again) == where
    small = cache.array((3, 4), np.float64)  # small: plain np.empty, not counted
    assert small.shape == (3, 4) and small.dtype == np.float64
    assert (cache.hits, cache.misses) == (1, 1)


def test_the_servers_lstm_outputs_and_gradients_reuse_warm_buffers(cached_server):
    # Large enough (each output 4 MiB+) for the cache: the second forward's outputs
    # and the second backward's gradients reuse the first's freed buffers, and the
    # results are unchanged.
    buffers = cached_server.store.buffers
    buffers.clear()
    steps, batch, units = 8, 256, 512
    rng = np.random.default_rng(1)
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    inputs = (
        r(steps, batch, units), r(batch, units), r(batch, units), r(2 * units, 4 * units),
        r(units), r(units), r(units), r(4 * units),
    )  # fmt: skip
    length = np.int64(steps)
    with gradserve.Client(
        f"127.0.0.1:{cached_server.port}", timeout=60, shared_memory=False
    ) as client:
        refs = [client.put(a) for a in inputs]
        kept = client.raw_ops.BlockLSTMV2(length, *refs, use_peephole=True, keep=True)
        first = [client.get(k) for k in kept]
        grads_first = client.raw_ops.BlockLSTMGradV2(
            length, *refs, *kept, kept[1], kept[6], use_peephole=True
        )
        client.delete(*kept)
        hits = buffers.hits
        kept = client.raw_ops.BlockLSTMV2(length, *refs, use_peephole=True, keep=True)
        assert buffers.hits >= hits + 7
        for k, want in zip(kept, first):
            np.testing.assert_array_equal(client.get(k), want)
        grads = client.raw_ops.BlockLSTMGradV2(
            length, *refs, *kept, kept[1], kept[6], use_peephole=True
        )
        for got, want in zip(grads, grads_first):
            np.testing.assert_array_equal(got, want)
        client.delete(*kept, *refs)


def test_buffers_over_the_limit_are_never_wrapped_and_drops_are_reported():
    dropped = []
    cache = WarmBuffers(10 * MIB, on_drop=dropped.append)
    big = cache.empty(16 * MIB)
    assert big.base is None  # over the limit: plain memory, freed as usual
    a, b = cache.empty(6 * MIB), cache.empty(6 * MIB)
    del a
    del b  # 12 MiB > 10: the first is dropped at once, without a collecting call
    assert dropped == [6 * MIB]
    cache.idle_seconds = 0.0
    cache.expire_idle(now=time.monotonic() + 1)
    assert dropped == [6 * MIB, 6 * MIB]
    assert cache.cached_bytes == 0
