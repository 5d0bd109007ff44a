"""The gradient tape over the real RPC path: recording, the reverse sweep's rules,
errors that change nothing, memory held and freed, and dataflow Batch.

Values are checked against answers worked out by hand (TensorFlow's registered
gradients are linear maps here) or finite differences; the TensorFlow oracle
replays are in ``test_tape_golden.py``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import weakref

import numpy as np
import pytest

import gradserve
from gradserve import protocol
from gradserve.client import TensorRef
from gradserve.client._types import TapedArray, tape_refs
from gradserve.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TapeReleasedError,
    UnimplementedError,
)
from gradserve.server import run_server
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
from gradserve.server.core.tape import MAX_TAPES_PER_SESSION, RECORD_BYTES
from gradserve.v1 import tensor_pb2

F32 = np.float32


def session_of(server, client):
    return server.store.get(client.session_id)


def used(server, client) -> int:
    return session_of(server, client).budget.used


def _ta(client, size=3, **kw):
    kw.setdefault("element_shape", [2])
    return client.raw_ops.TensorArrayV3(size=size, dtype=F32, **kw)


# ----------------------------------------------------------------- recording
def test_without_a_tape_nothing_is_recorded(client, server):
    h, flow = _ta(client)
    client.raw_ops.TensorArrayWriteV3(h, 0, np.ones(2, F32), flow)
    r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    assert type(r) is np.ndarray  # no tape id
    assert not session_of(server, client)._tapes


def test_outputs_under_a_tape_carry_ids_and_flow_on_by_id(client):
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
        assert isinstance(r, TapedArray) and r.tape_id
        # r goes on by id: the second array's gradient reaches x through it.
        h2, flow2 = _ta(client)
        flow2 = client.raw_ops.TensorArrayWriteV3(h2, 1, r, flow2)
        r2 = client.raw_ops.TensorArrayReadV3(h2, 1, flow2, F32)
    assert type(r * 2) is not TapedArray or (r * 2).tape_id is None
    (g,) = tape.gradient(r2, [x], output_gradients=[np.array([3.0, 5.0], F32)])
    np.testing.assert_array_equal(g, [3.0, 5.0])


def test_fetching_or_deleting_an_output_keeps_what_the_backward_needs(client):
    x = client.put(np.array([1.0, -1.0], F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        kept = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32, keep=True)
    assert isinstance(kept, TensorRef)
    kept.numpy()
    client.delete(kept, x)  # the tape still holds both
    (g,) = tape.gradient(kept, [x])
    np.testing.assert_array_equal(g, [1.0, 1.0])  # default output gradient: ones


# ----------------------------------------------------------------- the sweep's rules
def test_several_reads_of_one_element_sum_into_its_gradient(client):
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client, clear_after_read=False)
        flow = client.raw_ops.TensorArrayWriteV3(h, 1, x, flow)
        a = client.raw_ops.TensorArrayReadV3(h, 1, flow, F32)
        b = client.raw_ops.TensorArrayReadV3(h, 1, flow, F32)
    g = tape.gradient([a, b], x, output_gradients=[np.ones(2, F32), np.full(2, 10, F32)])
    np.testing.assert_array_equal(g, [11.0, 11.0])


def test_a_target_named_several_times_counts_as_often(client):
    """d(r + r + r)/dx = 3 dr/dx, as in TensorFlow: with ones as output gradients
    (one seed of 3, not three arrays of ones alive at once) and with given ones
    (summed)."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True) as tape:
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
        h2, flow2 = _ta(client)
        flow2 = client.raw_ops.TensorArrayWriteV3(h2, 0, x, flow2)
        q = client.raw_ops.TensorArrayReadV3(h2, 0, flow2, F32)
    np.testing.assert_array_equal(tape.gradient([r, r, q, r], x), [4.0, 4.0])
    given = [np.array([1.0, 2.0], F32), np.array([10.0, 20.0], F32), np.array([5.0, 5.0], F32)]
    np.testing.assert_array_equal(tape.gradient([r, q, r], x, output_gradients=given), [16, 27])


def test_gather_scatter_and_uneven_concat_split(client):
    v = client.put(np.arange(10, dtype=F32).reshape(5, 2))
    with client.gradient_tape() as tape:
        h, flow = _ta(client, size=5)
        flow = client.raw_ops.TensorArrayScatterV3(h, [4, 0, 2, 1, 3], v, flow)
        g4 = client.raw_ops.TensorArrayGatherV3(h, [0, 4], flow, F32, element_shape=[2])
        s = client.put(np.arange(12, dtype=F32).reshape(6, 2))
        h2, flow2 = client.raw_ops.TensorArrayV3(size=3, dtype=F32, element_shape=None)
        flow2 = client.raw_ops.TensorArraySplitV3(h2, s, np.array([1, 3, 2]), flow2)
        cat, lengths = client.raw_ops.TensorArrayConcatV3(h2, flow2, F32)
    np.testing.assert_array_equal(lengths, [1, 3, 2])
    dg4 = np.array([[1, 2], [3, 4]], F32)
    dcat = np.arange(12, dtype=F32).reshape(6, 2) * 10
    gv, gs = tape.gradient([g4, cat], [v, s], output_gradients=[dg4, dcat])
    # scatter put v[1] at 0 and v[0] at 4; the gather read 0 and 4.
    expect = np.zeros((5, 2), F32)
    expect[1], expect[0] = dg4[0], dg4[1]
    np.testing.assert_array_equal(gv, expect)
    np.testing.assert_array_equal(gs, dcat)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "complex64"])
def test_every_trainable_dtype_is_differentiable(client, dtype):
    """bfloat16 (NumPy kind "V", not "f") and complex are as differentiable as in
    TensorFlow; the gradient comes back in the source's dtype."""
    from gradserve import dtypes

    dt = dtypes.normalize(dtype)
    x = client.put(np.array([1.5, -2.0], dt))
    with client.gradient_tape() as tape:
        h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=dt, element_shape=[2])
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, dt)
    g = tape.gradient(r, x, output_gradients=np.array([3.0, 0.5], dt))
    assert g.dtype == dt
    np.testing.assert_array_equal(g.astype(np.complex128), [3.0, 0.5])


def test_unread_elements_get_zero_gradient(client):
    v = client.put(np.ones((3, 2), F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayScatterV3(h, [0, 1, 2], v, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 2, flow, F32)
    np.testing.assert_array_equal(tape.gradient(r, v), [[0, 0], [0, 0], [1, 1]])


def test_stop_gradient_blocks_and_a_path_around_it_carries(client):
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True) as tape:
        stopped = client.raw_ops.StopGradient(x)
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, stopped, flow)
        r0 = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
        h2, flow2 = _ta(client)
        flow2 = client.raw_ops.TensorArrayWriteV3(h2, 0, stopped, flow2)
        flow2 = client.raw_ops.TensorArrayWriteV3(h2, 1, x, flow2)
        r1 = client.raw_ops.TensorArrayReadV3(h2, 1, flow2, F32)
    assert tape.gradient(r0, x) is None
    np.testing.assert_array_equal(
        tape.gradient(r0, x, unconnected_gradients="zero"), np.zeros(2, F32)
    )
    np.testing.assert_array_equal(tape.gradient([r0, r1], x), [1.0, 1.0])
    np.testing.assert_array_equal(tape.gradient(r0, stopped), [1.0, 1.0])
    tape.release()


def test_each_gradient_call_has_its_own_source(client, server):
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True) as tape:
        h, flow = _ta(client, clear_after_read=False)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    first = tape.gradient(r, x)
    second = tape.gradient(r, x)  # a shared accumulator would give 2
    np.testing.assert_array_equal(first, [1.0, 1.0])
    np.testing.assert_array_equal(second, [1.0, 1.0])
    # The grad arrays of both computations are gone; the forward is frozen (TF).
    session = session_of(server, client)
    assert not session._grads
    assert session.tensor_array(h.id).dynamic_size is False
    tape.release()


def test_size_zero_split_has_an_empty_gradient(client):
    """TensorFlow raises here although the forward works; the gradient is empty."""
    s = client.put(np.zeros((0, 2), F32))
    y = client.put(np.ones(2, F32))
    with client.gradient_tape() as tape:
        h, flow = client.raw_ops.TensorArrayV3(size=0, dtype=F32, dynamic_size=True)
        flow = client.raw_ops.TensorArraySplitV3(h, s, np.zeros(0, np.int64), flow)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, y, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    gs, gy = tape.gradient(r, [s, y])
    assert gs.shape == (0, 2) and gs.dtype == F32
    np.testing.assert_array_equal(gy, [1.0, 1.0])


# ----------------------------------------------------------------- the LSTM
def _lstm_inputs(client, rng, T=4, B=2, I=3, H=3, dtype=np.float64):  # noqa: N803, E741
    x = client.put(rng.standard_normal((T, B, I)).astype(dtype))
    w = client.put((rng.standard_normal((I + H, 4 * H)) * 0.7).astype(dtype))
    b = client.put((rng.standard_normal(4 * H) * 0.5).astype(dtype))
    z = np.zeros((B, H), dtype)
    p = np.zeros(H, dtype)
    return [np.int64(T), x, z, z, w, p, p, p, b]


def test_lstm_gate_outputs_as_targets_are_unimplemented_not_zeros(client):
    args = _lstm_inputs(client, np.random.default_rng(1))
    with client.gradient_tape(persistent=True) as tape:
        acts = client.raw_ops.BlockLSTMV2(*args)
    for name in ("i", "f", "o", "ci", "co"):
        with pytest.raises(UnimplementedError, match=f"output '{name}'"):
            tape.gradient(getattr(acts, name), args[4])
    assert tape.gradient(acts.cs, args[4]).shape == args[4].shape
    tape.release()


def test_a_gate_output_beside_h_in_a_tensor_array_passes_zeros_not_an_error(client):
    """A gate written into a TensorArray beside ``h``, only ``h``'s element read: the
    gate's gradient is the grad array's zeros, which add nothing (TensorFlow's answer,
    from a graph, is exact there). It was UNIMPLEMENTED (a review helper)."""
    args = _lstm_inputs(client, np.random.default_rng(11))
    with client.gradient_tape(persistent=True) as tape:
        acts = client.raw_ops.BlockLSTMV2(*args)
        h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float64)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, acts.i, flow)
        flow = client.raw_ops.TensorArrayWriteV3(h, 1, acts.h, flow)
        y = client.raw_ops.TensorArrayReadV3(h, 1, flow, np.float64)
        g, gflow = client.raw_ops.TensorArrayV3(size=2, dtype=np.float64)
        gflow = client.raw_ops.TensorArrayWriteV3(g, 0, acts.i, gflow)
        gflow = client.raw_ops.TensorArrayWriteV3(g, 1, acts.h, gflow)
        both = client.raw_ops.TensorArrayGatherV3(g, [0, 1], gflow, np.float64)
    through_h = tape.gradient(acts.h, args[4])
    np.testing.assert_array_equal(tape.gradient(y, args[4]), through_h)
    with pytest.raises(UnimplementedError, match="output 'i'"):  # i's element read: ones
        tape.gradient(both, args[4])
    tape.release()


def test_lstm_clipped_cells_get_the_true_gradient(client):
    """TensorFlow's kernels pass gradient straight through a clipped cell; the tape's
    matches central finite differences (float64), for V1 and V2."""
    rng = np.random.default_rng(7)
    args = _lstm_inputs(client, rng, T=5, H=4)
    args[4] = client.put(args[4].numpy() * 4)  # large weights: cells saturate
    for op, clip in (("BlockLSTM", 0.6), ("BlockLSTMV2", 0.6)):
        fn = getattr(client.raw_ops, op)
        with client.gradient_tape() as tape:
            acts = fn(*args, cell_clip=clip)
        cs = np.asarray(acts.cs)
        assert (np.abs(cs) >= clip).any() and (np.abs(cs) < clip).any()
        dh = rng.standard_normal(np.asarray(acts.h).shape)
        (gw,) = tape.gradient(acts.h, [args[4]], output_gradients=[dh])
        w = args[4].numpy()
        values = [a.numpy() if isinstance(a, TensorRef) else a for a in args]

        def loss(wv, values=values, fn=fn, clip=clip, dh=dh):
            vals = list(values)
            vals[4] = wv
            return float((np.asarray(fn(*vals, cell_clip=clip).h) * dh).sum())

        eps = 1e-6
        for idx in [(0, 0), (2, 5), (5, 9), (6, 15)]:
            wp, wm = w.copy(), w.copy()
            wp[idx] += eps
            wm[idx] -= eps
            fd = (loss(wp) - loss(wm)) / (2 * eps)
            assert abs(fd - gw[idx]) < 1e-6 * max(1.0, abs(fd)), (op, idx, fd, gw[idx])


def test_a_gradient_of_a_gradient_is_unimplemented(client):
    args = _lstm_inputs(client, np.random.default_rng(2))
    acts = client.raw_ops.BlockLSTMV2(*args, keep=True)
    h = acts.h.numpy()
    with client.gradient_tape() as tape:
        grads = client.raw_ops.BlockLSTMGradV2(
            *args, *acts, np.zeros_like(h), np.ones_like(h), use_peephole=False
        )
    with pytest.raises(UnimplementedError, match="gradient of a gradient"):
        tape.gradient(grads.w_grad, args[4])


# ----------------------------------------------------------------- errors change nothing
@pytest.fixture
def recorded(client):
    x = client.put(np.array([1.0, 2.0], F32))
    n = client.put(np.array([1, 2], np.int32))
    with client.gradient_tape(persistent=True) as tape:
        h, flow = _ta(client, clear_after_read=False)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    yield tape, x, n, r, h
    if not tape.released:
        tape.release()


def test_tapes_dropped_unreleased_are_released_by_the_next_call(client, server):
    """TensorFlow frees a tape its program drops, whatever of its outputs the program
    keeps; a loop of persistent tapes never released (and of non-persistent ones never
    asked) failed at the 65th with RESOURCE_EXHAUSTED, the session's tape limit, and
    then still did where it kept an output or a slice of one (review helpers)."""
    x = client.put(np.ones(3, F32))
    kept = []
    for step in range(MAX_TAPES_PER_SESSION + 6):
        with client.gradient_tape(persistent=step % 2 == 0) as tape:
            h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32)
            flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
            r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
        if step % 2 == 0:
            np.testing.assert_array_equal(tape.gradient(r, x), np.ones(3, F32))
        kept.append(r if step % 3 else r[:2])  # an output, or a view of one
        del tape, r
        gc.collect()
    client.keep_alive()
    assert len(session_of(server, client)._tapes) <= 1  # (the last one, if persistent)
    assert not any(isinstance(k, TapedArray) and k.held for k in kept)
    assert all(np.array_equal(k, np.ones(len(k), F32)) for k in kept)


def test_a_tape_dropped_after_a_batch_named_its_output_lives_until_the_batch_ran(client):
    # The step named the output by its tape's id; the tape, dropped before run(), was
    # released by run()'s own call first, and the step failed NOT_FOUND (a review
    # helper). The batch keeps the tapes its steps name until it has run.
    w = client.put(np.array([1.0, 2.0], F32))
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32)
    with client.gradient_tape(persistent=True) as tape:
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, w, flow)
        y = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    batch = client.batch()
    batch.raw_ops.StopGradient(y)
    del tape
    gc.collect()
    np.testing.assert_array_equal(batch.run()[0], [1.0, 2.0])
    gc.collect()
    assert not y.held  # and then it goes
    np.testing.assert_array_equal(client.raw_ops.StopGradient(y), [1.0, 2.0])  # by value


def test_a_batch_dropped_unrun_lets_go_of_its_tapes_at_once(client, server):
    """A batch recorded and dropped without run() is freed by reference counting, and
    with it the tapes its steps named: the client's next call releases them (it was in
    a reference cycle through its raw_ops, and kept them until a garbage collection)."""
    w = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True) as tape:
        y = _copy(client, w)
    batch = client.batch()
    ops = batch.raw_ops
    ops.StopGradient(y)
    gone, tape_id = weakref.ref(batch), tape.id
    gc.disable()
    try:
        del tape, batch
        assert gone() is None
        client.keep_alive()  # the next call releases the dropped tape
        assert tape_id not in session_of(server, client)._tapes
        with pytest.raises(ReferenceError, match="keep the Batch"):
            ops.StopGradient(np.ones(2, F32))
    finally:
        gc.enable()
    # An input it uploaded first (past the request limit) is deleted (helper-72).
    with gradserve.Client(
        f"127.0.0.1:{server.port}", max_message_bytes=1 << 20, shared_memory=False
    ) as small:
        ops = small.batch().raw_ops
        with pytest.raises(ReferenceError):
            ops.StopGradient(np.ones(1 << 20, F32))
        small.keep_alive()
        assert server.store.get(small.session_id).budget.used == 0


@pytest.mark.parametrize(
    "value", [np.ones(2, F32), 1.0, [1.0], None, "x"], ids=["numpy", "float", "list", "None", "str"]
)
def test_watching_what_is_not_a_tensor_is_tensorflows_value_error(client, server, value):
    # tensorflow 2.21: ValueError "Passed in object ... not tf.Tensor or tf.Variable or
    # ExtensionType." for each of these (it was a TypeError here), the object as str()
    # prints it; nothing is sent. In a list, the tensors before it are watched
    # (helper-75: TensorFlow watches one at a time), those after it are not.
    x, z = client.put(np.ones(2, F32)), client.put(np.ones(2, F32))
    with client.gradient_tape(watch_accessed_variables=False) as tape:
        with pytest.raises(ValueError, match="not tf.Tensor or tf.Variable") as refused:
            tape.watch(value)
        element = value[0] if isinstance(value, list) else value  # (as TensorFlow flattens)
        assert f"object {element} of type '{type(element).__name__}'" in str(refused.value)
        assert tape.id not in session_of(server, client)._tapes
        with pytest.raises(ValueError, match="not tf.Tensor"):
            tape.watch([x, value, z])
        h, flow = _ta(client, size=2)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        flow = client.raw_ops.TensorArrayWriteV3(h, 1, z, flow)
        y = client.raw_ops.TensorArrayGatherV3(h, [0, 1], flow, F32)
    gx, gz = tape.gradient(y, [x, z])
    np.testing.assert_array_equal(gx, [1.0, 1.0])
    assert gz is None


def test_an_output_of_a_dropped_tape_is_watched_as_tensorflow_watches_it(client, server):
    """Its tape gone, the server no longer holds it (watching its id was NOT_FOUND,
    then a TypeError): watched, it is held by the watching tape (only: another tape
    recording beside it does not hold it), goes to later ops by id, and is a source
    with its true gradient, as a TensorFlow tensor of a freed tape is."""
    w = client.put(np.array([1.0, 2.0], F32))
    h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=F32)
    with client.gradient_tape() as tape:
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, w, flow)
        y = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    del tape
    gc.collect()
    client.keep_alive()
    assert not y.held
    with client.gradient_tape() as beside, client.gradient_tape() as other:
        other.watch(y)
        assert y.held and y.live_tapes() == [other]
        flow = client.raw_ops.TensorArrayWriteV3(h, 1, y, flow)
        z = client.raw_ops.TensorArrayReadV3(h, 1, flow, F32)
    assert y.tape_id in session_of(server, client).tape(other.id).held
    np.testing.assert_array_equal(y, [1.0, 2.0])
    np.testing.assert_array_equal(z, [1.0, 2.0])
    assert beside.gradient(z, y) is None  # it did not watch y (TensorFlow: None)
    grad = other.gradient(z, y, output_gradients=np.array([3.0, 5.0], F32))
    np.testing.assert_array_equal(grad, [3.0, 5.0])  # d(read(write(y)))/dy = seed


def _copy(client, value):
    """A differentiable copy of ``value`` (a TensorArray written and read)."""
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32)
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, value, flow)
    return client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)


def test_an_output_another_tape_watched_stays_a_source_after_its_own_tape_goes(client):
    # B watched x, computed under A; A's gradient released A. The SDK took x for a
    # value no tape held (a TypeError), though B held it (a review helper).
    p = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape() as a:
        x = _copy(client, p)
    with client.gradient_tape(persistent=True) as b:
        b.watch(x)
        y = _copy(client, x)
    np.testing.assert_array_equal(a.gradient(x, p), [1.0, 1.0])
    assert x.held
    np.testing.assert_array_equal(b.gradient(y, x), [1.0, 1.0])
    b.release()


def test_a_failed_call_naming_a_tapes_output_does_not_pin_the_tape(client, server):
    # The call's staging kept the tapes it named alive; held by the exception's frames,
    # it kept a dropped tape on the server until a garbage collection (a review helper).
    p = client.put(np.array([1.0, 2.0], F32))
    gc.collect()
    gc.disable()
    try:
        with client.gradient_tape(persistent=True) as tape:
            x = _copy(client, p)
        h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32)
        client.raw_ops.TensorArrayCloseV3(h)
        with pytest.raises(InvalidArgumentError):
            client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)  # closed: refused
        del tape
        client.keep_alive()
        client.keep_alive()
        assert not session_of(server, client)._tapes
    finally:
        gc.enable()


def _state(server, client):
    s = session_of(server, client)
    return used(server, client), s._grads.as_dict(), len(s._resident), len(s._tapes)


def test_errors_name_the_tensor_and_change_nothing(client, server, recorded):
    tape, x, n, r, _ = recorded
    before = _state(server, client)
    with pytest.raises(InvalidArgumentError, match="was not computed under this tape"):
        tape.gradient(n, x)  # a resident tensor the tape never read
    with pytest.raises(InvalidArgumentError, match="source .* has dtype int32"):
        tape.gradient(r, [x, n])
    with pytest.raises(InvalidArgumentError, match=r"output_gradients\[0\] is float \[3\]"):
        tape.gradient(r, x, output_gradients=[np.ones(3, F32)])
    with pytest.raises(InvalidArgumentError, match=r"output_gradients\[0\] is double"):
        tape.gradient(r, x, output_gradients=[np.ones(2)])
    assert _state(server, client) == before
    np.testing.assert_array_equal(tape.gradient(r, x), [1.0, 1.0])  # still usable


def test_a_released_tape_is_a_failed_precondition_and_tensorflows_runtime_error(client, server):
    """TensorFlow raises RuntimeError for a non-persistent tape's second gradient call:
    the error is that too (TapeReleasedError), from the SDK and from the server."""
    x = client.put(np.array([1.0], F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client, element_shape=[1])
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    tape.gradient(r, x)
    for err in (FailedPreconditionError, RuntimeError, TapeReleasedError):
        with pytest.raises(err, match="released"):
            tape.gradient(r, x)
    # Also when the SDK does not know (another client of the same session).
    with gradserve.Client(f"127.0.0.1:{server.port}", session_id=client.session_id) as other:
        stale = other.gradient_tape()
        stale.id = tape.id
        r = TapedArray.wrap(np.asarray(r), r.tape_id, tape_refs([stale]))  # its own
        with pytest.raises(TapeReleasedError, match="was released") as caught:
            stale.gradient(r, x)
        assert isinstance(caught.value, RuntimeError)
        assert caught.value.reason == "TAPE_RELEASED" and caught.value.field == "tape_id"


def test_a_tape_entered_again_after_its_gradient_records_afresh(client):
    """As tf.GradientTape: one non-persistent tape object reused by a training loop,
    entered again after each gradient call (TensorFlow 2.21 starts a new recording;
    it was refused here). The outputs of the last recording stay released: by value
    to later ops, not watchable."""
    tape = client.gradient_tape()
    x = client.put(np.array([1.0, 2.0], F32))
    grads, outs = [], []
    for scale in (1.0, 3.0):
        with tape:
            tape.watch(x)
            h, flow = _ta(client, element_shape=[2])
            flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
            r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
        outs.append(r)
        grads.append(tape.gradient(r, x, output_gradients=np.full(2, scale, F32)))
        assert tape.released
    np.testing.assert_array_equal(grads[0], [1.0, 1.0])
    np.testing.assert_array_equal(grads[1], [3.0, 3.0])
    assert not outs[0].held and not outs[1].held
    with tape:  # a third recording: the first outputs are not its own
        y = client.raw_ops.StopGradient(input=outs[1])  # goes by value
    np.testing.assert_array_equal(y, [1.0, 2.0])
    assert y.live_tapes() == [tape] and y.held and not outs[1].held


def test_a_reused_tape_leaves_one_finalizer_and_is_released_when_dropped(client, server):
    """Each recording of a reused tape registers its finalizer; a spent recording's
    goes (a loop of a million steps would have kept a million), and the last one
    still releases the tape once the program drops it."""
    x = client.put(np.array([1.0], F32))
    tape = client.gradient_tape()
    before = len(weakref.finalize._registry)
    for _ in range(5):
        with tape:
            tape.watch(x)
            r = client.raw_ops.StopGradient(input=x)
        tape.gradient(r, x)
    with tape:
        client.raw_ops.StopGradient(input=x)
    assert len(weakref.finalize._registry) == before + 1
    live = tape.id
    assert live in session_of(server, client)._tapes
    del tape, r
    gc.collect()
    client.put(np.zeros(1, F32))  # the next call releases it
    assert live not in session_of(server, client)._tapes


def test_reset_forgets_the_recording_and_records_afresh(client, server):
    """tf.GradientTape.reset: inside the block, what was recorded is forgotten (the
    server releases it before the next call) and recording goes on; outside, ValueError."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(watch_accessed_variables=False) as tape:
        tape.watch(x)
        before = _copy(client, x)
        first = tape.id
        tape.reset()
        assert tape.id != first and not before.held
        tape.watch(x)
        assert first not in session_of(server, client)._tapes  # released before that call
        after = _copy(client, x)
        y = _copy(client, before)  # by value: a constant now
    # Only `after` depends on x (kept, the first recording would give y's ones too).
    np.testing.assert_array_equal(tape.gradient([after, y], x), [1.0, 1.0])
    with pytest.raises(ValueError, match="not recording"):
        tape.reset()


def test_a_source_from_before_a_reset_or_a_released_tape_gets_no_gradient(client, server):
    """TensorFlow 2.21: ``y = x * 2; tape.reset(); ...; tape.gradient(z, y)`` is None
    (zeros with ``unconnected_gradients="zero"``), and so for a source computed under
    a tape released since: no tape here saw it. It was a TypeError (the server holds
    it no more); its value now goes as a temporary tensor that no record names. A
    target from before the reset stays an error (a target not recorded on the tape,
    as the README lists)."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True) as tape:
        tape.watch(x)
        y = _copy(client, x)
        tape.reset()
        tape.watch(x)
        z = _copy(client, x)
    assert not y.held
    gx, gy = tape.gradient(z, [x, y])
    np.testing.assert_array_equal(gx, [1.0, 1.0])
    assert gy is None
    gy = tape.gradient(z, y, unconnected_gradients="zero")
    np.testing.assert_array_equal(gy, [0.0, 0.0])
    batch = client.batch()
    batch.gradient(tape, z, [y, x])
    assert batch.run()[0][0] is None
    with pytest.raises(TypeError, match="released or dropped"):
        tape.gradient(y, x)
    resident = len(session_of(server, client)._resident)
    with pytest.raises(TypeError, match="expected a tensor"):  # a view has no tape id
        tape.gradient(z, [y, y[:1]])
    assert len(session_of(server, client)._resident) == resident  # nothing uploaded left
    with client.gradient_tape() as spent:
        spent.watch(x)
        a = _copy(client, x)
    spent.gradient(a, x)  # released by its gradient
    with client.gradient_tape() as fresh:
        fresh.watch(x)
        b = _copy(client, x)
    assert fresh.gradient(b, [x, a]) == [pytest.approx([1.0, 1.0]), None]
    tape.release()


def test_a_placeholder_of_another_batch_is_refused_as_it_is_recorded(client, server):
    """A ``StepOutput`` names a step by its index: batch A's placeholder given to batch
    B named B's step of that index, silently (a review helper). It carries its batch
    now: B refuses it in an op (its uploads deleted), a handle, a gradient, a watch."""
    x = client.put(np.array([1.0, 2.0], F32))
    first, second = client.batch(), client.batch()
    h, flow = first.raw_ops.TensorArrayV3(size=1, dtype=F32)
    y = _batch_copy(first, x)
    _batch_copy(second, x)
    resident = len(session_of(server, client)._resident)
    big = np.ones(1 << 20, F32)  # uploaded before the placeholder is looked at
    with pytest.raises(InvalidArgumentError, match="another batch"):
        second.raw_ops.StopGradient(y)
    with pytest.raises(InvalidArgumentError, match="another batch"):
        second.raw_ops.TensorArrayWriteV3(h, 0, big, flow)
    assert len(session_of(server, client)._resident) == resident
    with client.gradient_tape() as tape:
        with pytest.raises(InvalidArgumentError, match="another batch"):
            second.gradient(tape, y, x)
        with pytest.raises(InvalidArgumentError, match="another batch"):
            second.watch(tape, y)
    assert len(second) == 3
    np.testing.assert_array_equal(second.run()[2], [1.0, 2.0])
    np.testing.assert_array_equal(first.run()[3], [1.0, 2.0])


def _batch_copy(batch, value):
    h, flow = batch.raw_ops.TensorArrayV3(size=1, dtype=F32)
    flow = batch.raw_ops.TensorArrayWriteV3(h, 0, value, flow)
    return batch.raw_ops.TensorArrayReadV3(h, 0, flow, F32)


def test_a_batch_step_records_on_the_recording_it_was_added_in(client):
    """helper-72: steps added before a reset were recorded on the recording after it
    (the tape's id at run()), so the gradient took in what TensorFlow forgets; and a
    loop reusing one tape, its iterations in one batch, failed TapeReleasedError."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True, watch_accessed_variables=False) as tape:
        tape.watch(x)
        batch = client.batch()
        first = _batch_copy(batch, x)  # before the reset: forgotten
        tape.reset()
        tape.watch(x)
        _batch_copy(batch, first)  # after it, from `first`: no path to x
        _batch_copy(batch, x)  # after it, from x
        results = batch.run()
    assert tape.gradient(results[5], x) is None  # [1, 1] when `first` was recorded
    np.testing.assert_array_equal(tape.gradient(results[8], x), [1.0, 1.0])

    tape = client.gradient_tape()  # two iterations of a loop, one batch
    batch = client.batch()
    grads = []
    for scale in (1.0, 2.0):
        with tape:
            tape.watch(x)
            r = _batch_copy(batch, x)
            grads.append(batch.gradient(tape, r, x, output_gradients=np.full(2, scale, F32)))
    results = batch.run()
    np.testing.assert_array_equal(results[3][0], [1.0, 1.0])
    np.testing.assert_array_equal(results[7][0], [2.0, 2.0])
    with pytest.raises(TapeReleasedError):  # each recording asked once, as TensorFlow
        batch.gradient(tape, r, x)


def test_a_watch_step_takes_effect_where_it_stands_among_the_batch_steps(client):
    """``batch.watch(tape, x)``: ops before it read x unwatched and pass it no gradient,
    as in TensorFlow (2.21 eager: ``y1 = tf.identity(x); tape.watch(x); y2 =
    tf.identity(x)`` gives None for y1, ones for y2). A direct ``tape.watch`` runs at
    once, before every step of a batch not yet run, so it could not place a watch
    between two steps: both got ones."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True, watch_accessed_variables=False) as tape:
        batch = client.batch()
        _batch_copy(batch, x)  # steps 0-2: before the watch
        assert batch.watch(tape, x) is None  # step 3
        _batch_copy(batch, x)  # steps 4-6
        results = batch.run()
    assert results[3] is None
    assert tape.gradient(results[2], x) is None
    np.testing.assert_array_equal(tape.gradient(results[6], x), [1.0, 1.0])


def test_a_watch_step_watches_an_earlier_steps_output(client):
    """A batch step's output kept (or held by a tape) may be watched among the
    steps, by its placeholder; later steps that read it are differentiable with
    respect to it. A direct ``tape.watch`` of a placeholder is TensorFlow's
    ValueError, pointing to ``batch.watch``; a watch step naming an output that went
    by value (neither kept nor held) is refused at its step, changing nothing."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True, watch_accessed_variables=False) as tape:
        batch = client.batch()
        h, flow = batch.raw_ops.TensorArrayV3(size=1, dtype=F32)
        flow = batch.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        y = batch.raw_ops.TensorArrayReadV3(h, 0, flow, F32, keep=True)  # step 2
        with pytest.raises(ValueError, match=r"batch\.watch\(tape"):
            tape.watch(y)
        batch.watch(tape, [y])
        _batch_copy(batch, y)
        results = batch.run()
    y_ref = results[2]
    assert isinstance(y_ref, TensorRef)
    np.testing.assert_array_equal(tape.gradient(results[6], y_ref), [1.0, 1.0])
    assert tape.gradient(results[6], x) is None  # x itself was never watched

    batch = client.batch()
    h, flow = batch.raw_ops.TensorArrayV3(size=1, dtype=F32)
    flow = batch.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
    by_value = batch.raw_ops.TensorArrayReadV3(h, 0, flow, F32)  # no tape: a value
    with client.gradient_tape(watch_accessed_variables=False) as tape:
        batch.watch(tape, by_value)
        with pytest.raises(InvalidArgumentError, match="must name a tensor") as caught:
            batch.run()
    assert caught.value.step == 3
    assert len(caught.value.results) == 3  # the steps before it ran


def test_watch_steps_of_many_tensors_and_of_outputs_kept_in_the_same_request(client):
    """A watch of more tensors than one request's fields takes several steps (one of
    40,000 was refused, and the whole batch with it); an output a step kept under no
    tape is watched by its id in the same request too (it was refused as a value
    there, and watched from a later request: a review helper)."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True, watch_accessed_variables=False) as tape:
        batch = client.batch()
        y = batch.raw_ops.StopGradient(x, keep=True)  # x unwatched: untaped, kept
        batch.watch(tape, y)
        batch.watch(tape, [x] * 20_000)
        assert len(batch) == 5  # 8,192 a step
        _batch_copy(batch, y)
        results = batch.run()
    assert isinstance(results[0], TensorRef) and results[1:5] == [None] * 4
    np.testing.assert_array_equal(tape.gradient(results[7], results[0]), [1.0, 1.0])
    assert tape.gradient(results[7], x) is None  # y was computed before x was watched


def test_a_watch_step_names_an_output_kept_by_an_untaped_step_of_its_request(client, server):
    """The protocol: a request naming no tape, whose step keeps an output, then a
    watch step on a tape started before: the output is watched by its id (it was
    taken as its value, refused; from a later request the SDK names its id, watched:
    a review helper). The SDK splits such steps; another client may not."""
    from gradserve.v1 import service_pb2, service_pb2_grpc, tensor_array_pb2

    x = client.put(np.array([1.0, 2.0], F32))
    tape = client.gradient_tape(persistent=True, watch_accessed_variables=False)
    with tape:
        tape.watch(x)  # started on the server
    request = service_pb2.BatchRequest()
    request.steps.add().stop_gradient.CopyFrom(
        tensor_array_pb2.StopGradientRequest(
            input=tensor_pb2.TensorInput(ref=x.id), keep_outputs=True
        )
    )
    watch = request.steps.add().watch_tensors
    watch.tape_id = tape.id
    kept = watch.tensors.add().step_output
    kept.step, kept.field = 0, "output"
    stub = service_pb2_grpc.GradServeStub(client._channel)
    metadata = ((gradserve.protocol.SESSION_METADATA_KEY, client.session_id),)
    reply = stub.Batch(request, metadata=metadata)
    assert not reply.HasField("failed_step"), reply.error.message
    kept_id = reply.results[0].stop_gradient.output.ref.id
    assert kept_id in session_of(server, client).tape(tape.id).watched_at


def test_a_watch_step_refuses_what_it_cannot_watch_before_sending_it(client):
    """Found by a review helper: an output that went by value, carried by an upload
    in a later request, was watched silently (a temporary upload, deleted after the
    batch); one whose tapes were all released before the watch ran was NOT_FOUND. Both
    are refused at the watch step now, the steps before it run."""
    x = client.put(np.arange(4096, dtype=F32))
    batch = client.batch()
    by_value = _batch_copy(batch, x)  # no tape: a value
    saved, client.request_budget = client.request_budget, 2000  # it travels as an upload
    try:
        with client.gradient_tape(watch_accessed_variables=False) as tape:
            batch.watch(tape, by_value)
            with pytest.raises(InvalidArgumentError, match="went by value") as caught:
                batch.run()
    finally:
        client.request_budget = saved
    assert caught.value.step == 3 and len(caught.value.results) == 3

    with client.gradient_tape(persistent=True) as first:
        first.watch(x)
        y = _copy(client, x)
    with client.gradient_tape(persistent=True) as second:
        batch = client.batch()
        batch.watch(second, y)
        first.release()
        with pytest.raises(FailedPreconditionError, match="released before this watch"):
            batch.run()
        second.watch(y)  # directly, it is adopted: held by this tape alone
        z = _copy(client, y)
    np.testing.assert_array_equal(second.gradient(z, y), np.ones(4096, F32))

    # An output of a step whose tape this batch's gradient step releases before the
    # watch: refused as it is added (the run was NOT_FOUND at the watch step).
    batch = client.batch()
    with client.gradient_tape() as spent:
        spent.watch(x)
        y = _batch_copy(batch, x)
    batch.gradient(spent, y, x)
    with client.gradient_tape() as other:
        with pytest.raises(FailedPreconditionError, match="keep=True"):
            batch.watch(other, y)
    assert len(batch.run()) == 4

    # A persistent tape's gradient step ends nothing (it was refused), and a gradient
    # step's own outputs are held by the other tapes only (accepted: NOT_FOUND).
    batch = client.batch()
    with client.gradient_tape(persistent=True) as kept_on:
        kept_on.watch(x)
        y = _batch_copy(batch, x)
    batch.gradient(kept_on, y, x)
    with client.gradient_tape(persistent=True, watch_accessed_variables=False) as other:
        batch.watch(other, y)
        _batch_copy(batch, y)
    results = batch.run()
    np.testing.assert_array_equal(other.gradient(results[-1], results[2]), np.ones(4096, F32))
    with client.gradient_tape() as outer:
        batch = client.batch()
        with client.gradient_tape() as inner:
            inner.watch(x)
            y = _batch_copy(batch, x)
        (g,) = batch.gradient(inner, y, x)  # recorded on outer
    batch.gradient(outer, g, x)  # ends outer, the only holder of g
    with client.gradient_tape() as other:
        with pytest.raises(FailedPreconditionError, match="keep=True"):
            batch.watch(other, g)


def test_a_tape_holds_what_it_watches_and_watches_only_while_a_tape_records(client):
    """A tape holds the tensors it watches: an output of another tape, watched and
    then released by its own, was NOT_FOUND to the ops that read it next (a review
    helper). And as in TensorFlow 2.21, a watch while no tape records on the thread
    (after the block, inside ``stop_recording``) watches nothing: the gradient is
    None there (it was watched)."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True) as first:
        first.watch(x)
        y = _copy(client, x)
    with client.gradient_tape(persistent=True, watch_accessed_variables=False) as second:
        second.watch(y)
        first.release()
        z = _copy(client, y)
    np.testing.assert_array_equal(second.gradient(z, y), [1.0, 1.0])

    with client.gradient_tape(persistent=True, watch_accessed_variables=False) as tape:
        with tape.stop_recording():
            tape.watch(x)
        inside = _copy(client, x)
    tape.watch(x)  # after the block
    with tape:
        after = _copy(client, x)
    assert tape.gradient(inside, x) is None
    assert tape.gradient(after, x) is None


def test_a_loop_of_resets_in_one_batch_holds_only_what_it_needs(client, server):
    """helper-73: every recording a batch's steps were on was started when it ran and
    held to its end: 70 resets in one batch ran into the session's 64 tapes. One that
    nothing asks for gradients or names outputs of is not recorded on; one a gradient
    step asks is released once the run is past that step; each is released once."""
    x = client.put(np.array([1.0, 2.0], F32))
    steps = MAX_TAPES_PER_SESSION + 6
    with client.gradient_tape(persistent=True) as tape:
        batch = client.batch()
        for _ in range(steps):
            batch.raw_ops.StopGradient(x)
            tape.reset()
    assert len(batch.run()) == steps
    with client.gradient_tape(persistent=True) as tape:  # x read: watched
        batch = client.batch()
        for _ in range(steps):
            batch.gradient(tape, _batch_copy(batch, x), x)
            tape.reset()
    results = batch.run()
    np.testing.assert_array_equal(results[-1][0], [1.0, 1.0])
    assert len(client._dropped_tapes) == len(set(client._dropped_tapes))
    client.keep_alive()
    assert len(session_of(server, client)._tapes) <= 1  # (the last, persistent)


def test_a_batch_gradient_not_run_leaves_the_tape_to_ask(client, server):
    """helper-73: a non-persistent tape's batch.gradient ended its recording when
    recorded; the batch dropped unrun, the tape refused its own gradient and release()
    freed nothing."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape() as tape:
        y = _copy(client, x)
    batch = client.batch()
    batch.gradient(tape, y, x)
    assert tape.released
    del batch
    assert not tape.released
    np.testing.assert_array_equal(tape.gradient(y, x), [1.0, 1.0])
    with client.gradient_tape() as tape:
        y = _copy(client, x)
    batch = client.batch()
    batch.gradient(tape, y, x)
    assert tape.release() > 0  # it frees what it holds; the batch's step is refused
    with pytest.raises(TapeReleasedError):
        batch.run()
    client.keep_alive()
    assert not session_of(server, client)._tapes


def test_batches_keep_what_another_batch_needs(client, server):
    """helper-74: a loop re-entering a tape writes into a TensorArray in one batch and
    reads it and asks the gradient in another; the first ran, did not record on the
    recording (it alone did not need it) and marked it released: None for [1, 1]."""
    x = client.put(np.array([1.0, 2.0], F32))
    tape = client.gradient_tape(watch_accessed_variables=False)
    writes, reads = client.batch(), client.batch()
    asked = []
    for _ in range(2):
        with tape:
            tape.watch(x)
            h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32)
            writes.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
            r = reads.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
            asked.append(reads.gradient(tape, r, x)[0].step)
    writes.run()
    results = reads.run()
    for step in asked:
        np.testing.assert_array_equal(results[step][0], [1.0, 1.0])
    del tape, writes, reads
    gc.collect()
    client.keep_alive()
    client.keep_alive()
    assert not session_of(server, client)._tapes and not client._dropped_tapes


def test_an_output_of_a_recording_a_step_was_not_recorded_on_goes_by_value(client):
    """helper-74: a later request named by id an output of a step whose recording it
    was not recorded on (left, nothing needing it), as if that recording held it:
    NOT_FOUND where the op run directly takes the value."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape() as outer:
        with client.gradient_tape(persistent=True) as inner:
            batch = client.batch()
            y = _batch_copy(batch, x)  # on outer and inner
            batch.gradient(outer, y, x)  # outer's recording ends; the tapes change
            inner.reset()  # y's recording on inner: left, needed by nothing
            batch.raw_ops.StopGradient(y)  # a later request: by value
    results = batch.run()
    np.testing.assert_array_equal(results[3][0], [1.0, 1.0])
    np.testing.assert_array_equal(results[4], [1.0, 2.0])


def test_no_release_is_sent_for_a_recording_a_gradient_step_released(client, caplog):
    """helper-74: a loop's recordings, queued when the tape was entered again, were
    released by their batch gradient steps and then sent a ReleaseTape each, which
    failed (logged twice)."""
    x = client.put(np.array([1.0, 2.0], F32))
    tape = client.gradient_tape(watch_accessed_variables=False)
    batch = client.batch()
    for _ in range(3):
        with tape:
            tape.watch(x)  # a direct call: the recording is on the server
            batch.gradient(tape, _batch_copy(batch, x), x)
    with caplog.at_level(logging.INFO, logger="gradserve.client"):
        batch.run()
        client.keep_alive()
    assert not client._dropped_tapes
    assert not [r for r in caplog.records if "could not release" in r.getMessage()]


def test_a_reset_on_another_thread_does_not_release_what_a_batch_just_named(client):
    """helper-74: another thread's call, between reading what batches need and
    releasing the queued tapes, released a recording a batch had just named and whose
    tape was reset: the batch failed TAPE_RELEASED in 58-114 of 200 runs."""
    x = client.put(np.array([1.0, 2.0], F32))
    stop = threading.Event()

    def calls():
        while not stop.is_set():
            client.keep_alive()

    other = threading.Thread(target=calls)
    other.start()
    try:
        for _ in range(100):
            with client.gradient_tape(persistent=True) as tape:
                y = _copy(client, x)
                dropped = [client.gradient_tape(persistent=True) for _ in range(8)]
                for junk in dropped:
                    with junk:
                        junk.watch(x)
                del junk, dropped  # at once: queued, released by the other thread
                time.sleep(0.003)  # (which begins releasing them)
                batch = client.batch()
                batch.raw_ops.StopGradient(y)  # names y by id: needs the recording
                tape.reset()  # queued
            np.testing.assert_array_equal(batch.run()[0], [1.0, 2.0])
            tape.release()
    finally:
        stop.set()
        other.join()


def test_a_failed_batch_or_gradient_keeps_no_tape_alive(client, server):
    """helper-74: the error raised and the frames of run() or gradient() made a cycle
    (``failure``, ``error``) that held the tape the program dropped until a GC."""
    x = client.put(np.array([1.0, 2.0], F32))
    gc.disable()
    try:
        tape = client.gradient_tape(persistent=True)
        batch = client.batch()
        with tape:
            _copy(client, x)
            h, flow = batch.raw_ops.TensorArrayV3(size=1, dtype=F32)
            batch.raw_ops.TensorArrayReadV3(h, 5, flow, F32)
        with pytest.raises(InvalidArgumentError):
            batch.run()
        with pytest.raises(InvalidArgumentError):
            tape.gradient(x, x, output_gradients=np.ones(3, F32))
        del tape, batch
        client.keep_alive()
        assert not session_of(server, client)._tapes
    finally:
        gc.enable()


def test_a_reset_recording_lives_until_the_batches_naming_it_have_run(client, server):
    """helper-72: reset() queued the recording's release, and the batch's own call made
    it first: a step naming its output by id failed NOT_FOUND. Released after."""
    with client.gradient_tape(persistent=True) as tape:
        y = _copy(client, np.array([1.0, 2.0], F32))
        batch = client.batch()
        batch.raw_ops.StopGradient(y)
        old = tape.id
        tape.reset()
    np.testing.assert_array_equal(batch.run()[0], [1.0, 2.0])
    client.keep_alive()
    assert old not in session_of(server, client)._tapes


def test_recordings_whose_calls_failed_are_released_too(client, server):
    """A failed call started the tape it proposed on the server, while the SDK counted
    it started only on success: a reset (or a dropped tape) left it there, and 64
    resets locked the session's tapes (helper-72)."""
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32)
    tape = client.gradient_tape()
    with tape:
        for _ in range(MAX_TAPES_PER_SESSION + 6):
            with pytest.raises(InvalidArgumentError):
                client.raw_ops.TensorArrayReadV3(h, 5, flow, F32)
            tape.reset()
    client.keep_alive()
    assert len(session_of(server, client)._tapes) <= 1


def test_entering_a_tape_another_thread_records_on_is_a_value_error(client):
    """TensorFlow's flag is the tape's, not the thread's (helper-72)."""
    errors = []
    with client.gradient_tape() as tape:

        def enter():
            try:
                with tape:
                    pass
            except ValueError as e:
                errors.append(e)

        worker = threading.Thread(target=enter)
        worker.start()
        worker.join()
    assert len(errors) == 1 and "still recording" in str(errors[0])


def test_entering_a_recording_tape_again_is_tensorflows_value_error(client):
    with client.gradient_tape() as tape:
        with pytest.raises(ValueError, match="already-active tape"):
            with tape:
                pass
        assert client._recording.tapes == [tape]


def test_a_failed_gradient_rolls_back_its_grad_arrays_and_the_freeze(client, server):
    """The sweep makes a grad array (freezing the forward's size) for the TensorArray
    read, then fails at the LSTM (a gate output as target): nothing stays."""
    args = _lstm_inputs(client, np.random.default_rng(5))
    with client.gradient_tape(persistent=True) as tape:
        acts = client.raw_ops.BlockLSTMV2(*args)
        h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float64, dynamic_size=True)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, acts.h, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float64)
    before = _state(server, client)
    with pytest.raises(UnimplementedError, match="output 'i'"):
        tape.gradient([r, acts.i], args[4])
    assert _state(server, client) == before
    assert session_of(server, client).tensor_array(h.id).dynamic_size is True
    assert tape.gradient(r, args[4]).shape == args[4].shape  # and the tape goes on
    tape.release()


def test_a_none_output_gradient_means_its_target_contributes_nothing(client):
    """TensorFlow's eager tape passes the None to the gradient functions (a ValueError
    in most, an abort in its aggregation); the meaning it has where it works is that
    of a zero seed. Before, INVALID_ARGUMENT."""
    rng = np.random.default_rng(11)
    args = _lstm_inputs(client, rng)
    with client.gradient_tape(persistent=True) as tape:
        acts = client.raw_ops.BlockLSTMV2(*args)
    g_cs = rng.standard_normal(acts.cs.shape)
    sources = [args[1], args[4]]
    got = tape.gradient([acts.h, acts.cs], sources, output_gradients=[None, g_cs])
    want = tape.gradient(
        [acts.h, acts.cs], sources, output_gradients=[np.zeros(acts.h.shape), g_cs]
    )
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert np.abs(got[1]).sum() > 0
    assert tape.gradient([acts.h], sources, output_gradients=[None]) == [None, None]
    zeros = tape.gradient(acts.h, args[4], output_gradients=[None], unconnected_gradients="zero")
    np.testing.assert_array_equal(zeros, np.zeros(args[4].shape))
    with pytest.raises(InvalidArgumentError, match="2 output gradients for 1 targets"):
        tape.gradient(acts.h, args[4], output_gradients=[None, None])
    tape.release()


def test_no_targets_give_none_for_each_source_and_release_the_tape(client):
    """As TensorFlow: ``tape.gradient([], x)`` is None, one per source for a list
    (zeros with unconnected_gradients="zero"); a non-persistent tape is then spent.
    Before, INVALID_ARGUMENT."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True) as tape:
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
    assert tape.gradient([], x) is None
    assert tape.gradient([], [x, x]) == [None, None]
    np.testing.assert_array_equal(
        tape.gradient([], x, unconnected_gradients="zero"), np.zeros(2, F32)
    )
    # Output gradients with no targets are ignored, as TensorFlow 2.21 ignores them
    # (it was INVALID_ARGUMENT: 1 output gradients for 0 targets).
    assert tape.gradient([], x, output_gradients=[np.ones(2, F32)]) is None
    np.testing.assert_array_equal(
        tape.gradient([], [x], [np.ones(2, F32)], unconnected_gradients="zero")[0],
        np.zeros(2, F32),
    )
    with client.gradient_tape() as once:
        client.raw_ops.TensorArrayWriteV3(h, 1, x, flow)
    assert once.gradient([], x) is None
    with pytest.raises(FailedPreconditionError, match="released"):
        once.gradient([], x)


def test_a_users_grad_array_under_the_sweeps_source_is_neither_shared_nor_dropped(
    client, server, monkeypatch
):
    """Another call of the session makes TensorArrayGradV3(source="gradients") and
    writes 100 into it while a tape.gradient, which named its arrays "gradients", has
    not made its own yet. The sweep shared the user's array (dx 101, not 1) and then
    dropped it with its own (found by a review helper)."""
    import threading

    from gradserve.server.core import gradients

    sweep_waits, user_done = threading.Event(), threading.Event()
    read_grad = gradients.GRADIENTS["TensorArrayReadV3"]

    def held_read_grad(sweep, record, grads):
        assert sweep.source == "gradients"
        sweep_waits.set()
        assert user_done.wait(10)
        return read_grad(sweep, record, grads)

    monkeypatch.setitem(gradients.GRADIENTS, "TensorArrayReadV3", held_read_grad)
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    failures = []

    def user():
        try:
            assert sweep_waits.wait(10)
            with gradserve.Client(
                f"127.0.0.1:{server.port}", session_id=client.session_id
            ) as other:
                g, g_flow = other.raw_ops.TensorArrayGradV3(h, flow, source="gradients")
                other.raw_ops.TensorArrayWriteV3(g, 0, np.full(2, 100.0, F32), g_flow)
                user_done.set()
                failures.append(g)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
            user_done.set()

    thread = threading.Thread(target=user)
    thread.start()
    dx = tape.gradient(r, x)
    thread.join(10)
    (g,) = failures
    assert not isinstance(g, BaseException), g
    np.testing.assert_array_equal(dx, [1.0, 1.0])
    same, _ = client.raw_ops.TensorArrayGradV3(h, flow, source="gradients")
    assert same.id == g.id  # the user's array is still there, by its handle
    np.testing.assert_array_equal(client.raw_ops.TensorArrayReadV3(g, 0, flow, F32), [100.0, 100.0])


def test_a_snapshot_during_a_gradient_sees_the_forward_arrays_as_before_it(
    client, server, monkeypatch
):
    """A gradient computation makes grad arrays, which switch off the forward
    arrays' dynamic sizing; a snapshot taken meanwhile (a drain's last one, while the
    call runs past --grace and is then rolled back) froze them for good in the
    restored session. It now sees them as before the computation; after it, frozen
    (as TensorFlow leaves them)."""
    from gradserve.server.core import gradients

    seen = []
    read_grad = gradients.GRADIENTS["TensorArrayReadV3"]

    def read_grad_then_snapshot(sweep, record, grads):
        out = read_grad(sweep, record, grads)
        handle = record.saved["handle"]
        seen.append(sweep.session.export_state(60.0).arrays[handle].dynamic_size)
        assert sweep.session.tensor_array(handle).dynamic_size is False
        if len(seen) == 2:  # a client's grad array made meanwhile freezes it for good
            sweep.session.grad_array(handle, "mine")
            seen.append(sweep.session.export_state(60.0).arrays[handle].dynamic_size)
        return out

    monkeypatch.setitem(gradients.GRADIENTS, "TensorArrayReadV3", read_grad_then_snapshot)
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client, dynamic_size=True)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    np.testing.assert_array_equal(tape.gradient(r, x), [1.0, 1.0])
    assert seen == [True]
    session = session_of(server, client)
    assert session.export_state(60.0).arrays[h.id].dynamic_size is False
    assert not session._frozen_by_gradients
    with client.gradient_tape() as tape:  # another array, and a client's grad array
        h, flow = _ta(client, dynamic_size=True)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    np.testing.assert_array_equal(tape.gradient(r, x), [1.0, 1.0])
    assert seen == [True, True, False]


def test_a_tape_the_server_no_longer_has_is_not_started_again_empty(client, server):
    """The SDK proposes its tape ("+ID": start it if missing) only until a call naming
    it succeeded. Proposed every time, a tape the server lost (a restart past the ids
    it remembers as lost: a review helper, after five restarts of 64 tapes) was started
    again empty, and gave the gradient of what came after alone."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape(persistent=True) as tape:
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        session_of(server, client)._tapes.pop(tape.id)  # (as a server that lost it)
        with pytest.raises(NotFoundError, match="does not exist") as info:
            client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
        assert info.value.reason == "TAPE_NOT_FOUND"


# ----------------------------------------------------------------- memory
def test_a_non_persistent_tape_frees_what_it_held_after_gradient(client, server):
    args = _lstm_inputs(client, np.random.default_rng(3), T=8, B=4, I=5, H=6)
    before = used(server, client)
    with client.gradient_tape() as tape:
        acts = client.raw_ops.BlockLSTMV2(*args[:2], np.zeros((4, 6)), np.zeros((4, 6)), *args[4:])
    held = used(server, client) - before
    # Seven outputs, the two inline initial states and three inline peephole
    # weights (the resident inputs are charged already), each with its tensor record,
    # and the op's record (with its copy of seq_len_max).
    values = 7 * 8 * 4 * 6 * 8 + 2 * 4 * 6 * 8 + 3 * 6 * 8
    assert held == values + 12 * TENSOR_RECORD_BYTES + RECORD_BYTES + 8
    assert session_of(server, client).record_bytes() == RECORD_BYTES + 8
    tape.gradient(acts.h, args[4])
    assert used(server, client) == before


def test_a_persistent_tape_frees_on_release_and_session_close(target):
    with run_server(host="127.0.0.1", port=0, max_session_bytes=1 << 20) as srv:
        with gradserve.Client(f"127.0.0.1:{srv.port}") as c:
            x = c.put(np.ones(1000, F32))
            base = srv.store.get(c.session_id).budget.used
            with c.gradient_tape(persistent=True) as tape:
                h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=F32)
                flow = c.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
                r = c.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
            tape.gradient(r, x)
            tape.gradient(r, x)
            session = srv.store.get(c.session_id)
            # + the read's output the tape holds (x itself: an alias, its record only), and
            # the records
            assert session.budget.used == base + TENSOR_RECORD_BYTES + session.record_bytes()
            # that output, and the records of TensorArrayV3, the write and the read
            assert tape.release() == TENSOR_RECORD_BYTES + 3 * RECORD_BYTES + 2 * 4
            assert session.budget.used == base + session.record_bytes()
            with c.gradient_tape(persistent=True):
                c.raw_ops.StopGradient(x)
        assert srv.store.budget.used == 0  # the session's close freed the live tape


def test_a_tape_over_the_byte_budget_is_refused_and_the_session_goes_on(target):
    # 128 KiB for tensors, 12 KiB for records: the array's (``tensor_array.SLOT_BYTES``...),
    # the tensors' (``TENSOR_RECORD_BYTES``) and the tape's (``tape.RECORD_BYTES``)
    with run_server(host="127.0.0.1", port=0, max_session_bytes=140 * 1024) as srv:
        with gradserve.Client(f"127.0.0.1:{srv.port}") as c:
            x = c.put(np.ones(4096, F32))  # 16 KiB
            with c.gradient_tape() as tape:
                h, flow = c.raw_ops.TensorArrayV3(size=8, dtype=F32, clear_after_read=False)
                flow = c.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
                reads = []
                with pytest.raises(ResourceExhaustedError, match="--max-session-bytes"):
                    for _ in range(8):  # each gather's output is held: 16 KiB more (a
                        # read's would be the element, x itself: an alias, its record)
                        reads.append(c.raw_ops.TensorArrayGatherV3(h, [0], flow, F32))
            assert len(reads) == 6  # x, the element and six reads fill 128 KiB
            # the six outputs (each with its record), and 8 op records
            assert tape.release() == 6 * (16384 + TENSOR_RECORD_BYTES) + 8 * RECORD_BYTES + 7 * 4
            session = srv.store.get(c.session_id)
            # x, the element
            assert session.budget.used == 2 * 16384 + TENSOR_RECORD_BYTES + session.record_bytes()
            with c.gradient_tape() as tape:
                flow = c.raw_ops.TensorArrayWriteV3(h, 1, x, flow)
                r = c.raw_ops.TensorArrayReadV3(h, 1, flow, F32)
            np.testing.assert_array_equal(tape.gradient(r, x), np.ones(4096, F32))


def test_what_tapes_record_is_charged_and_freed_with_them(target):
    """Each op a tape records costs the session ``RECORD_BYTES`` per tape (its record
    and the tape's entries for it), paid before the op runs. Uncharged, one Batch of
    10,000 StopGradient steps of a scalar on 64 tapes (160 KB) held 154 MB under a
    1 MiB session; now it is refused once the records fill the budget, the session
    goes on, and releasing the tapes frees it all."""
    with run_server(host="127.0.0.1", port=0, max_session_bytes=1 << 20) as srv:
        with gradserve.Client(f"127.0.0.1:{srv.port}") as c:
            x = c.put(np.float32(1))
            session = srv.store.get(c.session_id)
            with contextlib.ExitStack() as stack:
                tapes = [stack.enter_context(c.gradient_tape(persistent=True)) for _ in range(8)]
                batch = c.batch()
                for _ in range(2000):
                    batch.raw_ops.StopGradient(x)
                with pytest.raises(ResourceExhaustedError, match="--max-session-bytes") as info:
                    batch.run()
            step = info.value.step  # each step: 8 records and 8 tapes' alias of x
            per_step = 8 * RECORD_BYTES + TENSOR_RECORD_BYTES
            assert (1 << 20) // per_step - 2 <= step <= (1 << 20) // per_step
            assert session.record_bytes() == 8 * RECORD_BYTES * step
            held = 4 + TENSOR_RECORD_BYTES * (1 + step)  # x, and each step's output (x)
            assert session.budget.used == held + session.record_bytes()
            for tape in tapes:
                tape.release()
            assert session.budget.used == 4 + TENSOR_RECORD_BYTES
            assert c.raw_ops.StopGradient(x) == 1  # and the session goes on


@contextlib.contextmanager
def _one_element(limit: int, holder: str):
    """A server whose sessions hold ``limit`` bytes, a client (outputs over 16 KB sent
    by reference for the "transient" ``holder``), its session, and a TensorArray of
    one element of 32 KB: (client, session, handle, flow, value)."""
    with run_server(host="127.0.0.1", port=0, max_session_bytes=limit) as srv:
        threshold = 16 * 1024 if holder == "transient" else 1 << 20
        with gradserve.Client(f"127.0.0.1:{srv.port}", stream_threshold=threshold) as c:
            value = np.arange(8000, dtype=F32)
            h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=F32)
            flow = c.raw_ops.TensorArrayWriteV3(h, 0, value, flow)
            yield c, srv.store.get(c.session_id), h, flow, value


def _fill_to(client, session, limit: int, room: int):
    """Put a filler tensor that leaves ``room`` bytes of the session's ``limit``."""
    filler = limit - session.budget.used - room - TENSOR_RECORD_BYTES
    return client.put(np.zeros(filler, np.uint8))


@pytest.mark.parametrize("holder", ["tape", "keep", "transient"])
@pytest.mark.parametrize("op", ["read", "gather", "concat"])
def test_a_read_without_room_for_its_output_loses_no_element(target, op, holder):
    """A read clears its element (clear_after_read) before its output is held: by a
    tape, kept (``keep=True``) or sent by reference (too large to go inline). When
    holding it had no room (with its record, it needs more than the element freed),
    the call was refused after the clearing, and the element was gone (a second read:
    "cleared after a previous read"). Holding it is now paid for while the read can
    still be undone, so the read needs room for its output until it is done."""
    limit = 128 * 1024
    with _one_element(limit, holder) as (c, session, h, flow, value):
        filler = _fill_to(c, session, limit, room=600)  # a record fits, no more
        before = session.budget.used
        keep = holder == "keep"

        def read():
            if op == "read":
                return c.raw_ops.TensorArrayReadV3(h, 0, flow, F32, keep=keep)
            if op == "gather":
                return c.raw_ops.TensorArrayGatherV3(h, [0], flow, F32, keep=keep)
            return c.raw_ops.TensorArrayConcatV3(h, flow, F32, keep=keep)[0]

        with contextlib.ExitStack() as stack:
            if holder == "tape":
                stack.enter_context(c.gradient_tape())
            with pytest.raises(ResourceExhaustedError, match="--max-session-bytes"):
                read()
        assert session.budget.used == before
        c.delete(filler)
        got = read()
        got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
        np.testing.assert_array_equal(got.reshape(-1), value)  # still there


@pytest.mark.parametrize("holder", ["tape", "keep", "transient"])
def test_a_read_that_frees_its_element_needs_room_only_for_the_difference(target, holder):
    """A read that clears its element gives its bytes back as it ends: its output
    takes them over (``TensorArray._hand_out``), so an element of more than half the
    session is read and held, as before outputs were paid for ahead."""
    limit = 1 << 20
    with run_server(host="127.0.0.1", port=0, max_session_bytes=limit) as srv:
        threshold = 64 * 1024 if holder == "transient" else 1 << 30
        with gradserve.Client(f"127.0.0.1:{srv.port}", stream_threshold=threshold) as c:
            value = np.arange(150_000, dtype=F32)  # 600 KB of a 1 MiB session
            h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=F32)
            flow = c.raw_ops.TensorArrayWriteV3(h, 0, value, flow)
            with contextlib.ExitStack() as stack:
                if holder == "tape":
                    stack.enter_context(c.gradient_tape())
                got = c.raw_ops.TensorArrayReadV3(h, 0, flow, F32, keep=holder == "keep")
                got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
                np.testing.assert_array_equal(got, value)


def test_gradients_of_a_target_only_its_tape_held_under_another_tape(target):
    """An outer tape started after the target was recorded: Gradients released the
    inner (non-persistent) tape, then held the target on the outer one and found it
    gone (NOT_FOUND), the gradients lost with the tape. The outer tapes now hold the
    inputs before."""
    with run_server(host="127.0.0.1", port=0) as srv:
        with gradserve.Client(f"127.0.0.1:{srv.port}") as c:
            x = c.put(np.ones(3, F32))
            with c.gradient_tape() as inner:
                h, flow = _ta(c, size=1, element_shape=[3])
                flow = c.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
                r = c.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
            with c.gradient_tape() as outer:
                np.testing.assert_array_equal(inner.gradient(r, x), np.ones(3, F32))
            outer.release()


def test_a_source_named_twice_is_paid_for_twice(target):
    """Two gradients of one object (a source named twice) are held twice: paid for
    once, the second was refused after the non-persistent tape was released."""
    limit = 128 * 1024
    with run_server(host="127.0.0.1", port=0, max_session_bytes=limit) as srv:
        with gradserve.Client(f"127.0.0.1:{srv.port}") as c:
            x = c.put(np.ones(4000, F32))
            session = srv.store.get(c.session_id)
            with c.gradient_tape() as tape:
                tape.watch(x)
                filler = _fill_to(c, session, limit, room=16000 + TENSOR_RECORD_BYTES + 2000)
                with pytest.raises(ResourceExhaustedError, match="--max-session-bytes"):
                    tape.gradient(x, [x, x], keep=True)  # one fits, two do not
                c.delete(filler)
                gx, gx2 = tape.gradient(x, [x, x], keep=True)
            np.testing.assert_array_equal(gx.numpy(), np.ones(4000, F32))
            c.delete(gx, gx2)


def test_a_tape_released_by_another_call_during_a_read_loses_no_element(target, monkeypatch):
    """Another call releases the tape after a clearing read's output was held on it,
    before the reply published the tape's tensor as the kept output: that tensor was
    gone (NOT_FOUND), and the element with it. The call now keeps the value itself."""
    from gradserve.server.core.ops import recording

    record_read = recording.read
    with run_server(host="127.0.0.1", port=0) as srv:
        with gradserve.Client(f"127.0.0.1:{srv.port}") as c:
            value = np.arange(1000, dtype=F32)
            h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=F32)
            flow = c.raw_ops.TensorArrayWriteV3(h, 0, value, flow)
            session = srv.store.get(c.session_id)

            def read_then_release(rec, *args):
                out = record_read(rec, *args)
                session.release_tape(rec.tapes[0].id)  # (as ReleaseTape on another thread)
                return out

            monkeypatch.setattr(recording, "read", read_then_release)
            with c.gradient_tape(persistent=True):
                kept = c.raw_ops.TensorArrayReadV3(h, 0, flow, F32, keep=True)
            np.testing.assert_array_equal(kept.numpy(), value)


@pytest.mark.parametrize("holder", ["keep", "transient"])
def test_a_tape_released_during_a_read_at_the_limit_loses_no_element(target, monkeypatch, holder):
    """As above, with the bytes the release freed taken at once by another call (the
    session at its limit): the reply kept the value itself, had no room, and the read
    was refused with its element cleared. The call now holds the tapes' tensor until
    its op ends (``Session.let_go_ids``), so the release frees nothing under it."""
    from gradserve.server.core.ops import recording

    record_read = recording.read
    limit = 128 * 1024
    with _one_element(limit, holder) as (c, session, h, flow, value):
        fillers = []

        def read_release_fill(rec, *args):
            out = record_read(rec, *args)
            session.release_tape(rec.tapes[0].id)  # (as ReleaseTape on another thread)
            room = limit - session.budget.used - TENSOR_RECORD_BYTES
            fillers.append(session.put(np.zeros(room, np.uint8)))  # (another call's)
            return out

        monkeypatch.setattr(recording, "read", read_release_fill)
        with c.gradient_tape(persistent=True):
            got = c.raw_ops.TensorArrayReadV3(h, 0, flow, F32, keep=holder == "keep")
        np.testing.assert_array_equal(got.numpy() if holder == "keep" else got, value)
        if holder == "keep":
            c.delete(got)
        session.delete(fillers)
        c.put(np.zeros(1, F32))  # a call: it deletes the transient output fetched
        assert session.budget.used == session.record_bytes() + 4 + TENSOR_RECORD_BYTES


@pytest.mark.parametrize("op", ["write", "scatter", "split"])
def test_a_stored_input_deleted_by_another_call_fails_the_op_before_the_array(
    target, monkeypatch, op
):
    """Another call deletes the resident input of a write (scatter, split) under a
    tape as the op runs: the op wrote, then failed holding the input on the tape
    (NOT_FOUND), and the array kept the element of a failed call (a retry: "already
    been written to"). The tape now holds the input before the array changes, so the
    op goes through (found by a review helper)."""
    from gradserve.server.core.ops import tensor_array_ops as ta_ops

    with run_server(host="127.0.0.1", port=0) as srv:
        with gradserve.Client(f"127.0.0.1:{srv.port}") as c:
            value = np.arange(6, dtype=F32).reshape(1, 6)
            x = c.put(value if op != "write" else value[0])
            h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=F32)
            session = srv.store.get(c.session_id)
            store = getattr(ta_ops, op)

            def delete_then_store(*args):
                session.delete([x.id])  # (as DeleteTensor on another thread)
                return store(*args)

            monkeypatch.setattr(ta_ops, op, delete_then_store)
            with c.gradient_tape() as tape:
                if op == "write":
                    flow = c.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
                elif op == "scatter":
                    flow = c.raw_ops.TensorArrayScatterV3(h, [0], x, flow)
                else:
                    flow = c.raw_ops.TensorArraySplitV3(h, x, np.array([1], np.int64), flow)
                read = c.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
            np.testing.assert_array_equal(np.reshape(read, -1), value.reshape(-1))
            grad = np.reshape(tape.gradient(read, x), -1)
            np.testing.assert_array_equal(grad, np.ones(value.size, F32))


def test_a_write_under_a_tape_without_room_for_its_record_writes_nothing(target):
    """A write's record (and its copy of the index) was reserved after the write: a
    session without room refused the call with the element written, and the retry
    found it "already been written to"."""
    limit = 64 * 1024
    with run_server(host="127.0.0.1", port=0, max_session_bytes=limit) as srv:
        with gradserve.Client(f"127.0.0.1:{srv.port}") as c:
            x = c.put(np.ones(100, F32))
            h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=F32, element_shape=[100])
            session = srv.store.get(c.session_id)
            filler = _fill_to(c, session, limit, room=100)
            with c.gradient_tape() as tape:
                with pytest.raises(ResourceExhaustedError, match="--max-session-bytes"):
                    c.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
                assert c.raw_ops.TensorArraySizeV3(h, flow) == 1  # recording nothing: no charge
                c.delete(filler)
                flow = c.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
                r = c.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
            np.testing.assert_array_equal(tape.gradient(r, x), np.ones(100, F32))


def test_gradients_whose_outer_tape_has_no_room_leave_the_inner_tape_to_ask_again(target):
    """Gradients on a non-persistent tape released it, then held the gradients on the
    outer tapes of the call: without room there, the call failed with the tape gone.
    The outer tapes now pay first. (The room fits the sweep, whose grad array is
    charged, but not the zeros of the unconnected source ``z``, which only the outer
    tape holds.)"""
    limit = 256 * 1024
    with run_server(host="127.0.0.1", port=0, max_session_bytes=limit) as srv:
        with gradserve.Client(f"127.0.0.1:{srv.port}") as c:
            x = c.put(np.ones(4000, F32))
            z = c.put(np.ones(20000, F32))
            session = srv.store.get(c.session_id)
            with c.gradient_tape(persistent=True) as outer:
                with c.gradient_tape() as inner:
                    h, flow = _ta(c, size=1, element_shape=[4000])
                    flow = c.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
                    r = c.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
                filler = _fill_to(c, session, limit, room=24000)
                with pytest.raises(ResourceExhaustedError, match="--max-session-bytes"):
                    inner.gradient(r, [x, z], unconnected_gradients="zero")
                c.delete(filler)
                gx, gz = inner.gradient(r, [x, z], unconnected_gradients="zero")
            np.testing.assert_array_equal(gx, np.ones(4000, F32))
            np.testing.assert_array_equal(gz, np.zeros(20000, F32))
            outer.release()


# ----------------------------------------------------------------- dataflow Batch
def test_a_whole_forward_and_its_gradient_in_one_batch(client):
    rng = np.random.default_rng(4)
    T, B, I, H = 3, 2, 3, 4  # noqa: N806, E741
    xs = rng.standard_normal((T, B, I))
    w = client.put(rng.standard_normal((I + H, 4 * H)) * 0.5)
    b = client.put(np.zeros(4 * H))
    z, p = np.zeros((B, H)), np.zeros(H)
    dh = rng.standard_normal((T, B, H))
    with client.gradient_tape() as tape:
        batch = client.batch()
        ops = batch.raw_ops
        x_ta, flow = ops.TensorArrayV3(size=T, dtype=np.float64, element_shape=[B, I])
        flow = ops.TensorArraySplitV3(x_ta, xs.reshape(T * B, I), np.full(T, B), flow)
        x = ops.TensorArrayGatherV3(x_ta, np.arange(T), flow, np.float64, element_shape=[B, I])
        acts = ops.BlockLSTMV2(np.int64(T), x, z, z, w, p, p, p, b)
        grads = batch.gradient(tape, acts.h, [w, b], output_gradients=[dh])
        results = batch.run()
    assert isinstance(grads[0], tuple)
    gw, gb = results[-1]
    # The same gradient, step by step over the wire.
    ref = client.raw_ops.BlockLSTMV2(np.int64(T), xs.reshape(T, B, I), z, z, w, p, p, p, b)
    back = client.raw_ops.BlockLSTMGradV2(
        np.int64(T), xs.reshape(T, B, I), z, z, w, p, p, p, b, *ref, np.zeros_like(dh), dh,
        use_peephole=False,
    )  # fmt: skip
    np.testing.assert_allclose(gw, back.w_grad, rtol=1e-12)
    np.testing.assert_allclose(gb, back.b_grad, rtol=1e-12)


def test_step_references_are_checked(client):
    batch = client.batch()
    r = batch.raw_ops.StopGradient(np.ones(2, F32))
    batch.raw_ops.TensorArrayReadV3(r, 0, 0.0, F32)  # a tensor where a handle goes
    with pytest.raises(InvalidArgumentError, match="a tensor, not a TensorArray handle") as e:
        batch.run()
    assert e.value.step == 1
    batch = client.batch()
    h, _ = batch.raw_ops.TensorArrayV3(size=1, dtype=F32)
    batch.raw_ops.StopGradient(h)
    with pytest.raises(InvalidArgumentError, match="a TensorArray handle, not a tensor"):
        batch.run()


def test_targets_and_sources_nest_as_tf_nest_nests_them(client):
    """Lists, tuples, named tuples and dicts, nested, as ``tf.GradientTape.gradient``
    takes them: dicts flatten in sorted key order and come back in their own order.
    TensorFlow 2.21 eager, the same program on variables x = [1, 2], z = [3, 4] with
    y1 = 2x, y2 = z * x: ``gradient({"b": y1, "a": y2}, {"z": z, "x": x},
    output_gradients={"b": [1, 0], "a": [0, 1]})`` gives {"z": [0, 2], "x": [1, 0] * 2
    + [0, 1] * z}; here the same structure with y1 = x, y2 = z (reads of a TensorArray)
    so each gradient is its seed. Before, a dict or nested source was refused
    (TypeError) and a nested target INVALID_ARGUMENT."""
    import collections

    x = client.put(np.array([1.0, 2.0], F32))
    z = client.put(np.array([3.0, 4.0], F32))
    with client.gradient_tape(persistent=True) as tape:
        h, flow = _ta(client, clear_after_read=False)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        flow = client.raw_ops.TensorArrayWriteV3(h, 1, z, flow)
        y1 = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
        y2 = client.raw_ops.TensorArrayReadV3(h, 1, flow, F32)
    seeds = {"b": np.array([1.0, 0.0], F32), "a": np.array([0.0, 5.0], F32)}
    got = tape.gradient({"b": y1, "a": y2}, {"z": z, "x": x}, output_gradients=seeds)
    assert list(got) == ["z", "x"]
    np.testing.assert_array_equal(got["z"], seeds["a"])
    np.testing.assert_array_equal(got["x"], seeds["b"])
    pair = collections.namedtuple("pair", "second first")
    got = tape.gradient((y1, [y2]), pair(second=x, first=[z, (x,)]))
    assert type(got) is pair and type(got.first) is list and type(got.first[1]) is tuple
    np.testing.assert_array_equal(got.second, [1.0, 1.0])
    np.testing.assert_array_equal(got.first[0], [1.0, 1.0])
    np.testing.assert_array_equal(got.first[1][0], [1.0, 1.0])
    # A nested target's seeds: in its structure, or flat; a seed may be a Python list.
    for given in ([[2.0, 3.0], [[4.0, 5.0]]], [[2.0, 3.0], [4.0, 5.0]]):
        g = tape.gradient([y1, [y2]], [x, z], output_gradients=given)
        np.testing.assert_array_equal(g[0], [2.0, 3.0])
        np.testing.assert_array_equal(g[1], [4.0, 5.0])
    assert tape.gradient([y1, y2], {}) == {}
    assert tape.gradient([y1, y2], []) == []
    tape.release()
    # The same in a batch: a dict of placeholders, a dict as the step's result, and a
    # later step that names one of its gradients.
    with client.gradient_tape() as tape:
        batch = client.batch()
        ops = batch.raw_ops
        h, flow = ops.TensorArrayV3(size=2, dtype=F32, element_shape=[2])
        flow = ops.TensorArrayWriteV3(h, 0, x, flow)
        y = ops.TensorArrayReadV3(h, 0, flow, F32)
        grads = batch.gradient(tape, {"y": y}, {"x": x, "z": z})
        ops.StopGradient(grads["x"])
        results = batch.run()
    assert list(grads) == ["x", "z"] and results[-2]["z"] is None
    np.testing.assert_array_equal(results[-2]["x"], [1.0, 1.0])
    np.testing.assert_array_equal(results[-1], [1.0, 1.0])


def test_a_spent_tape_is_released_to_calls_and_freed_by_release_or_close(client, server):
    """A tape spent by a gradient whose reply is not yet made (``Session.spend_tape``)
    is released to every call, but its bytes stay charged until the reply frees it;
    a client's release frees it at once, as does the session's close, and neither
    can be undone by the call's end (``unspend_tape`` then finds nothing)."""
    session = session_of(server, client)
    x = client.put(np.ones(2, F32))
    base = used(server, client)
    tapes = []
    for _ in range(2):
        with client.gradient_tape() as tape:
            h, flow = _ta(client)
            client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        tapes.append((tape, session.tape(tape.id)))
    held = used(server, client)
    for _, t in tapes:
        assert session.spend_tape(t)
    with pytest.raises(FailedPreconditionError, match="released"):
        tapes[0][0].gradient(x, x)
    assert used(server, client) == held
    freed = session.release_tape(tapes[0][1].id)
    assert freed > 0 and used(server, client) == held - freed
    session.unspend_tape(tapes[0][1])
    with pytest.raises(FailedPreconditionError, match="released"):
        session.tape(tapes[0][1].id)
    spent = tapes[1][1]
    records = list(spent.records)
    session.unspend_tape(spent)  # live again, as another object: ``spent`` stays released
    revived = session.tape(spent.id)
    assert revived is not spent and spent.released and not revived.released
    assert revived.records == records and not spent.records and not spent.held
    assert used(server, client) == held - freed  # the same bytes, held by the revived tape
    assert session.spend_tape(revived)
    assert session.close() > 0
    session.unspend_tape(revived)
    assert not session._tapes and not session._spent_tapes
    assert session.budget.used == 0 and base > 0


@pytest.mark.parametrize("big", ["input", "output"])
def test_outputs_stay_on_the_tape_when_inputs_are_uploaded_or_outputs_fetched(target, big):
    """An input sent by its own upload (at or past ``stream_threshold``, without
    shared memory), or an output fetched by its own call (transient), is a call nested
    in the op's: it set the thread's "tapes of the last call" to none, the op's outputs
    came back tied to no tape, went on by value, and the gradient was silently None
    (a review helper: the README's LSTM example with x of 4.9 MB)."""
    rng = np.random.default_rng(3)
    T, B, I, H = 4, 2, 3, 5  # noqa: N806, E741
    xs = rng.standard_normal((T, B, I)).astype(F32)
    w = rng.standard_normal((I + H, 4 * H)).astype(F32) * 0.3
    z, p, b = np.zeros((B, H), F32), np.zeros(H, F32), np.zeros(4 * H, F32)
    grads = {}
    for threshold in (1 << 30, 64):
        kwargs = {"stream_threshold": threshold, "shared_memory": False}
        if big == "output":
            kwargs["max_message_bytes"] = 64 * 1024  # outputs come back transient
            xs_big = np.repeat(xs, 300, axis=0)  # 1,200 steps: 24 KB per output
        else:
            xs_big = xs
        with gradserve.Client(target, **kwargs) as c:
            w_ref = c.put(w)
            with c.gradient_tape() as tape:
                acts = c.raw_ops.BlockLSTMV2(np.int64(len(xs_big)), xs_big, z, z, w_ref, p, p, p, b)
                assert isinstance(acts.h, TapedArray) and acts.h.held
                h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=F32)
                flow = c.raw_ops.TensorArrayWriteV3(h, 0, acts.h, flow)
                last = c.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
            grads[threshold] = tape.gradient(last, w_ref)
    assert grads[64] is not None and np.abs(grads[64]).sum() > 0
    np.testing.assert_allclose(grads[64], grads[1 << 30], rtol=1e-6)


def test_a_target_that_is_a_source_gets_its_output_gradient(client):
    """d v / d v is v's output gradient whether or not the tape recorded anything, as
    in TensorFlow 2.21 (``gradient(v, [v, w])`` on a tape that saw nothing is
    ``[ones, None]``, also with ``watch_accessed_variables=False``); summed with what
    flows to v through recorded ops. It was INVALID_ARGUMENT ("not computed under
    this tape"), which a target that is neither recorded nor a source still is (a
    review helper's comparison)."""
    v = client.put(np.array([1.0, 2.0], F32))
    w = client.put(np.array([3.0], F32))
    with client.gradient_tape(persistent=True) as tape:
        pass
    got = tape.gradient(v, [v, w])
    np.testing.assert_array_equal(got[0], [1.0, 1.0])
    assert got[1] is None
    seeds = [np.array([2.0, 3.0], F32)]
    np.testing.assert_array_equal(tape.gradient([v], v, output_gradients=seeds), seeds[0])
    with pytest.raises(InvalidArgumentError, match="was not computed under this tape"):
        tape.gradient(w, v)
    tape.release()
    with client.gradient_tape(watch_accessed_variables=False) as unwatched:
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, v, flow)
        y = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    np.testing.assert_array_equal(unwatched.gradient([y, v], v), [1.0, 1.0])  # y: unwatched
    with client.gradient_tape() as watched:
        h, flow = _ta(client)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, v, flow)
        y = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    np.testing.assert_array_equal(watched.gradient([y, v], v), [2.0, 2.0])


def test_an_op_begun_while_its_tape_was_spent_records_nothing_when_it_comes_back(client, server):
    """An op that began under a tape a gradient had spent reserved nothing for it and
    took no holds on it; when the gradient's reply is lost and the tape comes back, the
    op must not commit onto it. It did (the tape object was made live again): its
    record's bytes came off the budget unreserved when the tape was freed, and the
    record named an input the tape did not hold (a review helper). The tape comes
    back as a new object; the op's stays released."""
    from gradserve.server.core.sessions import Resident
    from gradserve.server.core.tape import Recorder

    session = session_of(server, client)
    x = client.put(np.ones(2, F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client)
        client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
    old = session.tape(tape.id)
    assert session.spend_tape(old)
    recorder = Recorder(session, [old])  # an op of another call, begun now
    key, _ = recorder.arg(Resident(x.id))
    recorder.record("StopGradient", (key,), (None,), {})
    before = used(server, client)
    session.unspend_tape(old)  # the gradient's reply was lost
    recorder.commit()
    revived = session.tape(tape.id)
    assert [r.op for r in revived.records] == ["TensorArrayV3", "TensorArrayWriteV3"]
    assert used(server, client) == before
    freed = session.release_tape(tape.id)
    assert used(server, client) == before - freed
    client.delete(x)
    assert used(server, client) == session.record_bytes() + 8  # the array: records, element


# ----------------------------------------------------------------- review regressions
def test_a_tape_named_twice_in_the_header_is_one_tape(client, server):
    """Naming one tape twice (as an id and as a start) once leaked its bytes past the
    session's close and doubled its gradients."""
    from gradserve import protocol
    from gradserve.v1 import tensor_array_pb2 as pb

    x = client.put(np.ones(3, F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client, element_shape=[3])
        client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
    twice = f"{tape.id},{tape.header()},{tape.header()}"
    request = pb.TensorArrayReadV3Request(handle=pb.TensorArrayHandle(id=h.id), dtype=11)
    request.index.value.CopyFrom(_encoded(np.int32(0)))
    reply = client._stub.TensorArrayReadV3(
        request, metadata=(*client._metadata, (protocol.TAPE_METADATA_KEY, twice))
    )
    r = TapedArray.wrap(np.ones(3, F32), reply.value.tape_id, tape_refs([tape]))
    np.testing.assert_array_equal(tape.gradient(r, x), np.ones(3, F32))
    # x (the read cleared the element; r let go of), and the records
    assert (
        used(server, client) == 12 + TENSOR_RECORD_BYTES + session_of(server, client).record_bytes()
    )


def _encoded(value):
    from gradserve import codec
    from gradserve.v1 import tensor_pb2

    msg = tensor_pb2.Tensor()
    codec.encode(np.asarray(value), msg)
    return msg


def test_tape_outputs_are_read_only(client):
    with client.gradient_tape():
        r = client.raw_ops.StopGradient(np.ones(2, F32))
    with pytest.raises(ValueError, match="read-only"):
        r *= 10
    assert np.array(r).flags.writeable and (r * 10).tape_id is None


def test_a_failed_batch_gradient_leaves_a_non_persistent_tape_usable(client, server):
    x = client.put(np.ones(3, F32))
    with client.gradient_tape() as tape:
        h, flow = _ta(client, element_shape=[3])
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    batch = client.batch()
    batch.gradient(tape, r, x, output_gradients=np.ones(2, F32))  # wrong shape
    with pytest.raises(InvalidArgumentError):
        batch.run()
    assert not tape.released
    np.testing.assert_array_equal(tape.gradient(r, x), np.ones(3, F32))
    assert tape.released and not session_of(server, client)._tapes


def test_a_tape_that_recorded_nothing_releases_cleanly(client, server):
    with client.gradient_tape(persistent=True) as tape:
        pass
    assert tape.release() == 0
    with gradserve.Client(f"127.0.0.1:{server.port}") as closing:
        with closing.gradient_tape(persistent=True) as tape:
            pass
    assert tape.release() == 0  # after close() too (helper-78: CancelledError)
    # A client of a session it did not create releases its tapes as it closes: the
    # session stays, and they held its bytes until it ended (helper-79).
    w = client.put(np.ones(1 << 16, F32))
    with gradserve.Client(f"127.0.0.1:{server.port}", session_id=client.session_id) as attached:
        with attached.gradient_tape(persistent=True) as tape:
            _copy(attached, w)
        with attached.gradient_tape(persistent=True) as dropped:
            _copy(attached, w)
            first = dropped.id
            dropped.reset()  # its first recording waits for a call to release it: none comes
        assert {tape.id, first} <= set(session_of(server, client)._tapes)
    assert not {tape.id, first} & set(session_of(server, client)._tapes)
    assert tape.release() == 0
    with gradserve.Client(f"127.0.0.1:{server.port}", session_id=client.session_id) as attached:
        made = gradserve.GradientTape(attached, persistent=True)  # as tf.GradientTape()
        with made:
            _copy(attached, w)
        assert made.id in session_of(server, client)._tapes
    assert made.id not in session_of(server, client)._tapes  # (helper-80: it stayed)
    # At the session's limit too: no call named it, so the server has nothing to
    # release (its ReleaseTape started it only to release it, and was refused).
    w = client.put(np.ones(2, F32))
    held = []
    for _ in range(MAX_TAPES_PER_SESSION):
        held.append(client.gradient_tape(persistent=True))
        with held[-1]:
            client.raw_ops.StopGradient(w)
    with client.gradient_tape(persistent=True) as idle:
        batch = client.batch()
        batch.raw_ops.StopGradient(w)  # recorded on it, not yet sent
    assert idle.release() == 0
    assert len(session_of(server, client)._tapes) == MAX_TAPES_PER_SESSION
    assert not isinstance(batch.run()[0], TapedArray)  # ran unrecorded
    # Released all the same (a call of another thread may have been naming it): a
    # gradient step asking it is refused as after any release, not NOT_FOUND.
    with client.gradient_tape(persistent=True) as idle:
        batch = client.batch()
        batch.gradient(idle, w, w)
    assert idle.release() == 0
    with pytest.raises(TapeReleasedError):
        batch.run()
    assert len(session_of(server, client)._tapes) == MAX_TAPES_PER_SESSION
    # Another thread's batch that read the recording as unreleased just before:
    # refused, not started behind the release (helper-75: a tape no one released).
    with client.gradient_tape(persistent=True) as racing:
        batch = client.batch()
        batch.raw_ops.StopGradient(w)
    assert racing.release() == 0
    racing.life.released = False  # (what the other thread read)
    with pytest.raises(TapeReleasedError):
        batch.run()
    assert len(session_of(server, client)._tapes) == MAX_TAPES_PER_SESSION
    for tape in held:
        tape.release()
    assert not session_of(server, client)._tapes


def test_gradients_of_gradients_under_an_outer_tape_are_unimplemented(client):
    x = client.put(np.ones(2, F32))
    with client.gradient_tape(persistent=True) as outer:
        with client.gradient_tape() as inner:
            h, flow = _ta(client)
            flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
            r = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
        g = inner.gradient(r, x)
    assert isinstance(g, TapedArray) and g.tape_id
    with pytest.raises(UnimplementedError, match="first order"):
        outer.gradient(g, x)
    outer.release()


def test_batch_steps_record_on_the_tapes_active_when_added(client):
    x = client.put(np.ones(2, F32))
    with client.gradient_tape() as tape:
        batch = client.batch()
        h, flow = batch.raw_ops.TensorArrayV3(size=1, dtype=F32)
        flow = batch.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        batch.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    r = batch.run()[-1]  # run after the block: recorded all the same
    np.testing.assert_array_equal(tape.gradient(r, x), [1.0, 1.0])


def test_a_split_batch_passes_earlier_transient_outputs_by_value(target):
    with gradserve.Client(target, max_message_bytes=80 * 1024, shared_memory=False) as c:
        big = np.arange(6000, dtype=F32)  # 24 KB: transient in its response
        batch = c.batch()
        y = batch.raw_ops.StopGradient(c.put(big))
        for _ in range(6):  # fill the first request
            batch.raw_ops.StopGradient(np.ones(900, F32))
        batch.raw_ops.StopGradient(y)  # names step 0 from a later request
        np.testing.assert_array_equal(batch.run()[-1], big)


def test_a_split_batch_names_a_gradient_of_a_dict_of_sources_by_value(target):
    """A later request names a gradient of an earlier one whose sources were a dict
    (its result a dict): the placeholder's index is in the flattened order."""
    with gradserve.Client(target, max_message_bytes=80 * 1024, shared_memory=False) as c:
        x = c.put(np.arange(2, dtype=F32))
        with c.gradient_tape() as tape:
            batch = c.batch()
            h, flow = batch.raw_ops.TensorArrayV3(size=1, dtype=F32, element_shape=[2])
            flow = batch.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
            y = batch.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
            seed = np.arange(2, dtype=F32) + 7
            grads = batch.gradient(tape, y, {"x": x, "a": x}, output_gradients=seed)
            for _ in range(6):  # fill the first request
                batch.raw_ops.StopGradient(np.ones(900, F32))
            batch.raw_ops.StopGradient(grads["x"])  # names it from a later request
            batch.raw_ops.StopGradient(grads["a"])
            results = batch.run()
    np.testing.assert_array_equal(results[-1], seed)
    np.testing.assert_array_equal(results[-2], seed)


def test_a_batch_recorded_under_a_tape_released_before_it_runs_runs_unrecorded(client, server):
    """A recording the caller released (``release()``, or its gradient) cannot be
    asked again: the steps recorded on it run unrecorded, as they would have run
    before the release, in every request of a split batch alike (they were refused,
    where the same ops run directly succeed: helper-74; an earlier review saw a split
    batch's later requests leave it out while its first named it)."""
    with client.gradient_tape(persistent=True) as tape:
        batch = client.batch()
        batch.raw_ops.StopGradient(np.ones(2, F32))
    tape.release()
    out = batch.run()[0]
    np.testing.assert_array_equal(out, [1.0, 1.0])
    assert not isinstance(out, TapedArray)
    assert not session_of(server, client)._tapes
    with client.gradient_tape() as tape:  # and after the tape's own gradient
        x = client.put(np.array([1.0, 2.0], F32))
        batch = client.batch()
        y = _batch_copy(batch, x)
        z = _copy(client, x)
        np.testing.assert_array_equal(tape.gradient(z, x), [1.0, 1.0])
        batch.raw_ops.StopGradient(y)
    np.testing.assert_array_equal(batch.run()[-1], [1.0, 2.0])


@pytest.mark.parametrize("how", ["release()", "its gradient"])
def test_a_batch_takes_by_value_an_output_whose_recording_was_released_before_it_ran(server, how):
    """A step named a tape output by id when it was added; the caller released its
    recording before run() (``release()``, or a non-persistent tape's gradient): the
    server holds it no more, and the step was NOT_FOUND, where the op run at that time
    would have taken it. It goes by value now: inline, or uploaded where it does not fit
    (a 1 MiB request limit), in a batch's first request and in a later one, uploaded
    once (helper-78: once per step). A gradient step's targets and sources are not
    values: one released is NOT_FOUND, as before."""
    with gradserve.Client(
        f"127.0.0.1:{server.port}", max_message_bytes=1 << 20, shared_memory=False
    ) as client:
        big = np.arange(300_000, dtype=F32)  # 1.2 MB: uploaded
        small = np.array([1.0, 2.0], F32)
        x = client.put(small)
        with client.gradient_tape(persistent=how == "release()") as tape:
            tape.watch(x)
            y, y_big = _copy(client, x), _copy(client, big)
            batch = client.batch()
            batch.raw_ops.StopGradient(y)
            batch.raw_ops.StopGradient(y_big)
            second = np.zeros(250_000, F32)  # fills a request: the rest go in the next
            batch.raw_ops.StopGradient(second)
            batch.raw_ops.StopGradient(y)
            batch.raw_ops.StopGradient(y_big)
        if how == "release()":
            tape.release()
        else:
            np.testing.assert_array_equal(tape.gradient(y, x), [1.0, 1.0])
        assert not session_of(server, client)._tapes  # released on the server
        uploads: list[int] = []
        put = client.put
        client.put = lambda value: uploads.append(np.asarray(value).nbytes) or put(value)
        try:
            got = batch.run()
        finally:
            del client.put
        for out, want in zip(got, [small, big, second, small, big]):
            np.testing.assert_array_equal(out, want)
        assert uploads == [big.nbytes]
        client.keep_alive()
        assert list(session_of(server, client)._resident) == [x.id]  # no upload left
        # A recording merely left (a reset) is held for the batch: its outputs still go
        # by id, and what flows from them is recorded on it.
        with client.gradient_tape(persistent=True) as tape:
            y = _copy(client, x)
            batch = client.batch()
            z = _batch_copy(batch, y)
            batch.gradient(tape, z, y)
            tape.reset()
        np.testing.assert_array_equal(batch.run()[-1][0], [1.0, 1.0])
        tape.release()
        with client.gradient_tape(persistent=True) as other:
            y = _copy(client, x)
        with client.gradient_tape(persistent=True) as tape:
            batch = client.batch()
            z = _batch_copy(batch, y)  # by value, once released
            batch.gradient(tape, z, y)  # a source: named, or nothing
        other.release()
        with pytest.raises(NotFoundError, match="does not exist"):
            batch.run()
        tape.release()


@pytest.mark.parametrize("a_released_first", [False, True])
def test_a_batch_gradients_sources_from_a_released_recording_are_named_not_sent(
    client, a_released_first
):
    """A source that is an earlier step's output whose recording a gradient step of the
    same batch released went by value, which a gradient's sources may not be
    (INVALID_ARGUMENT, helper-79). It goes by its id: c never watched y nor saw x
    flow into z, so both are None, as in TensorFlow's eager tape."""
    x = client.put(np.array([1.0, 2.0], F32))
    batch = client.batch()
    with client.gradient_tape() as a:
        a.watch(x)
        y = _batch_copy(batch, x)
    with client.gradient_tape(persistent=True) as c:
        c.watch(x)
        z = _batch_copy(batch, y)
        if a_released_first:
            batch.gradient(a, y, x)
        batch.gradient(c, z, [y, x])
    assert batch.run()[-1] == [None, None]
    c.release()


def test_a_failed_op_takes_off_a_tape_only_the_holds_it_took(server):
    """Two ops under one tape hold the same resident tensor: the first (still running)
    holds it, the second finds it held and is recorded, then the first fails. Its
    rollback took the tensor off the tape, and the second's record was left without
    it: once the client deleted it, the tape's gradient was NOT_FOUND (found by a
    review helper). Holds are counted per op now."""
    session = server.store.create()
    try:
        x = session.put(np.array([1.0, 2.0], F32))
        tape = session.start_tape(persistent=True, watch_accessed_variables=True)
        assert session.hold_for_tape(tape, x)  # op A, running
        assert session.hold_for_tape(tape, x)  # op B, recorded
        held = session.budget.used
        session.release_held([(tape, x)])  # op A failed
        session.delete([x])  # the client's
        assert x in tape.held and session.budget.used == held  # B's hold keeps it
        np.testing.assert_array_equal(session.get(x), [1.0, 2.0])
        session.release_held([(tape, x)])  # (were B to fail too: gone with its last hold)
        assert x not in tape.held and session.budget.used == session.record_bytes()
    finally:
        server.store.close(session.id)


def test_a_watch_charges_a_record_per_tensor_new_to_the_tape(server):
    """What a watch adds to a tape (its entries, its hold) is charged as a record,
    until the tape goes; past the session's limit the watch is refused and changes
    nothing (a review helper: 64 tapes watching 4,094 ids took 39 MB of the server's
    memory for a 4 MiB session)."""
    from gradserve.server.core.sessions import TENSOR_RECORD_BYTES, SessionStore

    store = SessionStore(max_session_bytes=64 * 1024)
    session = store.create()
    x = session.put(np.array([1.0, 2.0], F32))
    ids = [x] + [session.put(session.get(x)) for _ in range(9)]  # ten ids, one array
    tape = session.start_tape(persistent=True, watch_accessed_variables=False)
    before = session.budget.used
    session.watch(tape, ids)
    session.watch(tape, ids)  # nothing new
    assert session.budget.used - before == 10 * RECORD_BYTES
    room = session.budget.limit - session.budget.used
    session.put(np.zeros(room - TENSOR_RECORD_BYTES - 5 * RECORD_BYTES, np.uint8))
    other = session.start_tape(persistent=True, watch_accessed_variables=False)
    used = session.budget.used
    with pytest.raises(ResourceExhaustedError):
        session.watch(other, ids)  # ten records, room for five
    assert session.budget.used == used and not other.watched_at and not other.held
    session.release_tape(tape.id)
    assert session.budget.used == used - 10 * RECORD_BYTES
    session.watch(other, ids[:5])
    session.close()
    assert store.budget.used == 0


def test_a_watch_that_adopts_an_output_of_a_tape_released_meanwhile_is_tape_released(
    client, monkeypatch
):
    """Watching an output whose tapes are gone adopts it (a StopGradient recorded on
    the watching tape); released by another thread meanwhile, the tape records nothing
    and the op gives a plain value: an AttributeError escaped (a review helper's
    threads, 6 times in 25 s). Forced here: the op returns what it then returns."""
    x = client.put(np.array([1.0, 2.0], F32))
    with client.gradient_tape() as first:
        first.watch(x)
        y = _copy(client, x)
    first.release()
    raw_ops = client.raw_ops
    monkeypatch.setattr(
        type(raw_ops), "StopGradient", lambda self, **kw: np.asarray(kw["input"]).copy()
    )
    with client.gradient_tape() as second:
        with pytest.raises(TapeReleasedError, match="released while it watched"):
            second.watch(y)


def test_a_watch_holds_on_its_own_beside_a_running_ops_hold(server):
    """A watch of a tensor a running op holds for the tape takes a hold of its own:
    the op's failure took the tensor off the tape with the op's hold, and the watched
    tensor, deleted by its client, was gone from the tape (a review helper)."""
    session = server.store.create()
    try:
        x = session.put(np.array([1.0, 2.0], F32))
        tape = session.start_tape(persistent=True, watch_accessed_variables=False)
        assert session.hold_for_tape(tape, x)  # an op, running
        session.watch(tape, [x])
        session.release_held([(tape, x)])  # the op failed
        session.delete([x])  # the client's
        assert x in tape.held and x in tape.watched_at
        np.testing.assert_array_equal(session.get(x), [1.0, 2.0])
        session.release_tape(tape.id)
        assert session.budget.used == session.record_bytes()
    finally:
        server.store.close(session.id)


@pytest.mark.parametrize("watch", ["after", "before", "between", "after, on a flow"])
def test_a_watch_passes_gradients_only_from_ops_recorded_after_it(client, watch):
    """TensorFlow records an op only if one of its inputs is on the tape when it runs,
    watched or an output of a recorded op (``tape.watch`` is not retroactive), and a
    recorded op passes gradients to all its inputs. Two writes of ``x`` then a
    gather: watched after, ``x`` gets None; before, twos; between, ones (only the
    second write was recorded). Watched after, but written on the flow of a write of
    a watched ``w``: ones (tensorflow 2.21 in a tf.function, whose TensorArrays are
    these ops; an eager TensorArray is a list, whose gather alone is recorded). The
    tape gave the gradient through writes of ``x`` recorded before any watch (found
    by review helpers)."""
    x = client.put(np.array([1.0, 2.0], F32))
    w = client.put(np.array([3.0, 4.0], F32))
    with client.gradient_tape(watch_accessed_variables=False) as tape:
        if watch == "before":
            tape.watch(x)
        h, flow = client.raw_ops.TensorArrayV3(size=2, dtype=F32)
        if watch == "after, on a flow":
            tape.watch(w)
            flow = client.raw_ops.TensorArrayWriteV3(h, 0, w, flow)
        else:
            flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        if watch == "between":
            tape.watch(x)
        flow = client.raw_ops.TensorArrayWriteV3(h, 1, x, flow)
        both = client.raw_ops.TensorArrayGatherV3(h, [0, 1], flow, F32)
        if watch.startswith("after"):
            tape.watch(x)
    grad = tape.gradient(both, x)
    expected = {"before": [2.0, 2.0], "between": [1.0, 1.0]}.get(watch)
    expected = [1.0, 1.0] if watch == "after, on a flow" else expected
    if expected is None:
        assert grad is None
    else:
        np.testing.assert_array_equal(grad, expected)


def test_a_batch_step_names_an_earlier_steps_tape_output_after_the_tape_went(monkeypatch):
    """A Batch step names an earlier step's output by its tape id (an inline output
    the tape holds); another call released the tape between the steps, and the later
    step was NOT_FOUND, though this call computed the value (found by a review
    helper). The call now holds its steps' tape outputs until the Batch ends."""
    from gradserve.server.transport import servicer as servicer_module

    run = servicer_module.GradServeServicer._run
    released = []

    async def run_then_release(self, op, io, request):
        result = await run(self, op, io, request)
        if op.rpc == "TensorArrayReadV3" and io.step is not None:
            for tape in io.tapes:  # (as ReleaseTape from another call, between the steps)
                released.append(io.session.release_tape(tape.id))
        return result

    monkeypatch.setattr(servicer_module.GradServeServicer, "_run", run_then_release)
    with run_server(device="cpu") as server:
        with gradserve.Client(f"127.0.0.1:{server.port}", shared_memory=False) as client:
            x = client.put(np.array([1.0, 2.0], F32))
            session = server.store.get(client.session_id)
            with client.gradient_tape(persistent=True):
                batch = client.batch()
                ops = batch.raw_ops
                h, flow = ops.TensorArrayV3(size=1, dtype=F32)
                flow = ops.TensorArrayWriteV3(h, 0, x, flow)
                read = ops.TensorArrayReadV3(h, 0, flow, F32)
                h2, flow2 = ops.TensorArrayV3(size=1, dtype=F32)
                ops.TensorArrayWriteV3(h2, 0, read, flow2)  # names step 2's tape output
                results = batch.run()
            assert released
            (h2, _), flow2 = results[3], results[4]
            again = client.raw_ops.TensorArrayReadV3(h2, 0, flow2, F32)
            np.testing.assert_array_equal(again, [1.0, 2.0])
            client.delete(x)
            assert session.budget.used == session.record_bytes()  # the pins let go


@pytest.mark.parametrize("kept", [False, True])
def test_another_tapes_output_is_an_intermediate_not_a_watched_variable(client, kept):
    """``watch_accessed_variables`` watches variables (here: tensors the client
    keeps), not intermediates. ``z``, an output of tape ``a``, written under tape
    ``b`` on a fresh array: TensorFlow 2.21 (a tf.function, its TensorArrays these
    ops) records no write of ``z`` on ``b``, so ``b.gradient(y, [z, v])`` is
    ``[None, ones]``. ``z`` was watched like a resident tensor and got ones (found by
    a review helper)."""
    x = client.put(np.array([1.0, 2.0], F32))
    v = client.put(np.array([3.0, 4.0], F32))
    with client.gradient_tape(persistent=True) as a:
        h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        z = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32, keep=kept)
    assert isinstance(z, TensorRef if kept else TapedArray)  # kept: resident, still a's
    with client.gradient_tape() as b:
        h2, flow2 = client.raw_ops.TensorArrayV3(size=2, dtype=F32)
        flow2 = client.raw_ops.TensorArrayWriteV3(h2, 0, z, flow2)
        flow2 = client.raw_ops.TensorArrayWriteV3(h2, 1, v, flow2)
        y = client.raw_ops.TensorArrayGatherV3(h2, [0, 1], flow2, F32)
    gz, gv = b.gradient(y, [z, v])
    assert gz is None
    np.testing.assert_array_equal(gv, [1.0, 1.0])
    # Under its own tape, z is an output of a recorded op: connected, not watched.
    np.testing.assert_array_equal(a.gradient(z, x), [1.0, 1.0])
    a.release()


def test_watching_more_tensors_than_one_request_may_hold(client):
    # The server refuses a request of more than MAX_REQUEST_FIELDS fields; the SDK
    # watches in as many requests as that needs (a review helper: 70,000 in one
    # call was refused).
    x = client.put(np.array([1.0, 2.0], F32))
    others = [client.put(np.zeros(1, F32))] * protocol.MAX_REQUEST_FIELDS
    with client.gradient_tape(watch_accessed_variables=False) as tape:
        tape.watch([*others, x])
        h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=F32)
        flow = client.raw_ops.TensorArrayWriteV3(h, 0, x, flow)
        read = client.raw_ops.TensorArrayReadV3(h, 0, flow, F32)
    np.testing.assert_array_equal(tape.gradient(read, x), [1.0, 1.0])
