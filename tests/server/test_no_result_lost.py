"""No result that was computed is lost to a message limit, in either direction.

The server budgets the inline bytes of a whole response (a Batch is one response):
outputs that do not fit come back as transient tensors the SDK streams. The SDK
budgets a whole request: inputs that do not fit are uploaded first.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

import gradserve
from gradserve import protocol
from gradserve.errors import ConversionError, InvalidArgumentError
from gradserve.kernels import backend_numpy
from gradserve.lstm_signature import LSTMActivations
from gradserve.server import run_server
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
from gradserve.v1 import service_pb2, service_pb2_grpc
from tests.kernels import lstm_cases
from tests.kernels.lstm_cases import INPUTS, random_case

MIB = 1 << 20


@pytest.fixture(scope="module")
def small_messages():
    """A server whose unary messages are capped at 1 MiB each way."""
    with run_server(device="cpu", max_message_bytes=MIB) as server:
        yield server


def connect(server, **kw) -> gradserve.Client:
    return gradserve.Client(f"127.0.0.1:{server.port}", timeout=60, **kw)


def values(n: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    return [rng.standard_normal(count).astype(np.float32) for _ in range(n)]


def test_batch_of_clearing_reads_over_the_limit_returns_every_value(small_messages):
    # The reproduction: four clearing reads of 800 kB under a 1 MiB limit
    # cleared the values, then failed the response with RESOURCE_EXHAUSTED.
    written = values(4, 200_000)
    with connect(small_messages) as client:
        ta = client.tensor_array(np.float32, size=4)
        for index, value in enumerate(written):
            ta.write(index, value)
        batch = client.batch()
        for index in range(4):
            batch.raw_ops.TensorArrayReadV3(ta.handle, index, ta.flow, np.float32)
        got = batch.run()
        client.keep_alive()  # the next call deletes the transient outputs fetched
        session = small_messages.store.get(client.session_id)
    # The values left the array, and nothing transient stayed behind: only its records.
    assert session.budget.used == session.record_bytes()
    for want, value in zip(written, got):
        np.testing.assert_array_equal(value, want)


def test_batch_over_the_limit_with_default_flags_returns_every_value(server, client):
    # 66 clearing reads of ~4 MiB under the default 256 MiB limit (the SDK's own
    # stream threshold is raised so that they are asked for inline).
    written = values(66, MIB - 16)
    with gradserve.Client(f"127.0.0.1:{server.port}", timeout=120, stream_threshold=1 << 30) as big:
        ta = big.tensor_array(np.float32, size=len(written))
        batch = big.batch()
        for index, value in enumerate(written):
            batch.raw_ops.TensorArrayWriteV3(ta.handle, index, value, ta.flow)
        for index in range(len(written)):
            batch.raw_ops.TensorArrayReadV3(ta.handle, index, ta.flow, np.float32)
        got = batch.run()[len(written) :]
        big.keep_alive()  # the next call deletes the transient outputs fetched
        session = server.store.get(big.session_id)
        assert session.budget.used == session.record_bytes()  # no value: the records
    for want, value in zip(written, got):
        np.testing.assert_array_equal(value, want)


def test_lstm_whose_outputs_together_pass_the_limit_returns_them_all(small_messages):
    # Seven outputs of 256 kB each: each fits in a message, together they do not.
    case = random_case(
        np.random.default_rng(3), steps=16, batch=16, inputs=8, units=256, dtype=np.float32
    )
    want = lstm_cases.forward(backend_numpy, *(case[k] for k in INPUTS), seq_len_max=16)
    with connect(small_messages) as client:
        got = client.raw_ops.BlockLSTMV2(np.int64(16), *(case[k] for k in INPUTS))
        assert isinstance(got, LSTMActivations)
        held = small_messages.store.get(client.session_id).budget.used
    assert held == 0
    for name in LSTMActivations._fields:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_client_with_a_small_limit_sends_an_input_larger_than_it(small_messages):
    value = np.arange(2 * MIB // 4, dtype=np.float32)  # 2 MiB, under the 4 MiB threshold
    with connect(small_messages, max_message_bytes=MIB) as client:
        out = client.raw_ops.StopGradient(value)
    np.testing.assert_array_equal(out, value)


def test_batch_whose_inputs_together_pass_the_limit_uploads_what_does_not_fit(
    small_messages,
):
    written = values(5, 100_000)  # 400 kB each, 2 MB in one request
    with connect(small_messages, max_message_bytes=MIB) as client:
        ta = client.tensor_array(np.float32, size=5)
        batch = client.batch()
        for index, value in enumerate(written):
            batch.raw_ops.TensorArrayWriteV3(ta.handle, index, value, ta.flow)
        batch.run()
        np.testing.assert_array_equal(ta.stack(), np.stack(written))


@pytest.mark.parametrize("server_deletes_named_ids", [True, False], ids=["named", "DeleteTensor"])
def test_a_batch_dropped_unrun_has_its_uploads_deleted_by_the_next_call(
    small_messages, server_deletes_named_ids
):
    # Inputs past the request limit are uploaded as they are recorded; a batch dropped
    # before run() (the worker's loop raised between the two) held their bytes in the
    # session until it ended. The next call deletes them: named in its metadata, or,
    # to a server that does not delete named ids (an older one), by a DeleteTensor.
    with connect(small_messages, max_message_bytes=MIB, shared_memory=False) as client:
        client._server_deletes_fetched = server_deletes_named_ids
        budget = small_messages.store.get(client.session_id).budget
        for _ in range(3):
            batch = client.batch()
            for value in values(3, 300_000):  # 1.2 MB each: each one uploaded
                batch.raw_ops.StopGradient(value)
            assert budget.used >= 3 * 1_200_000
            del batch  # (reference counting: no garbage collection needed)
            client.keep_alive()
            assert budget.used == 0
        # A client of a session it did not create, closed with a batch still
        # referenced: nothing can run that batch, and the session stays (helper-75:
        # its uploads stayed with it).
        with connect(
            small_messages, session_id=client.session_id, max_message_bytes=MIB,
            shared_memory=False,
        ) as attached:  # fmt: skip
            attached._server_deletes_fetched = server_deletes_named_ids
            orphan = attached.batch()
            orphan.raw_ops.StopGradient(values(1, 300_000)[0])
            assert budget.used >= 1_200_000
        assert budget.used == 0
        del orphan
        # One still referenced keeps its uploads, and runs.
        batch = client.batch()
        kept = values(1, 300_000)[0]
        batch.raw_ops.StopGradient(kept)
        client.keep_alive()
        np.testing.assert_array_equal(batch.run()[0], kept)
        client.keep_alive()
        assert budget.used == 0


def test_batch_steps_naming_outputs_of_earlier_requests_fit_their_requests(
    small_messages,
):
    # Six copies of 300 kB go in two requests; six more steps name their outputs,
    # which go back by value. Measured as references (a few bytes each), those six
    # went in one request of 1.8 MB that gRPC refused (RESOURCE_EXHAUSTED).
    written = values(6, 75_000)
    with connect(small_messages, max_message_bytes=MIB, shared_memory=False) as client:
        batch = client.batch()
        copies = [batch.raw_ops.StopGradient(value) for value in written]
        for copy in copies:
            batch.raw_ops.StopGradient(copy)
        got = batch.run()
    for want, first, second in zip(written, got[:6], got[6:]):
        np.testing.assert_array_equal(first, want)
        np.testing.assert_array_equal(second, want)


def test_an_earlier_output_named_by_later_requests_is_uploaded_once(small_messages):
    # A gathered output over the stream threshold goes to later requests as an
    # upload: two steps in two later requests that name it name one upload.
    parts = values(2, 75_000)  # gathered: 600 kB, over the threshold
    inline = values(6, 100_000)  # 400 kB each, under it: two fill a request
    with connect(
        small_messages, max_message_bytes=MIB, stream_threshold=512 * 1024, shared_memory=False
    ) as client:
        ta = client.tensor_array(np.float32, size=2)
        for index, part in enumerate(parts):
            ta.write(index, part)
        uploads = []
        put = client.put
        client.put = lambda array: uploads.append(array.nbytes) or put(array)
        batch = client.batch()
        gathered = batch.raw_ops.TensorArrayGatherV3(ta.handle, [0, 1], ta.flow, np.float32)
        for pair in (inline[:2], inline[2:4], inline[4:]):
            for value in pair:
                batch.raw_ops.StopGradient(value)
            batch.raw_ops.StopGradient(gathered)
        got = batch.run()
    assert uploads == [600_000]  # was one per step of a later request naming it
    for step in (3, 6, 9):
        np.testing.assert_array_equal(got[step], np.stack(parts))


def test_a_later_request_sends_by_value_what_a_spent_tape_held(small_messages):
    # The gradient step released the tape; the copy, in the next request, named the
    # read by its tape id, which the server no longer had (NOT_FOUND; a batch fuzzer).
    # One by one, the read's TapedArray is no longer held and goes by value.
    big = np.ones(200_000, np.float32)  # 800 kB: one a request
    with connect(small_messages, max_message_bytes=MIB, shared_memory=False) as client:
        w = client.put(np.array([1.0, 2.0], np.float32))
        batch = client.batch()
        with client.gradient_tape() as tape:
            h, f = batch.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
            batch.raw_ops.TensorArrayWriteV3(h, 0, w, f)
            x = batch.raw_ops.TensorArrayReadV3(h, 0, f, np.float32)
            batch.gradient(tape, x, [w])
            h2, f2 = batch.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
            batch.raw_ops.TensorArrayWriteV3(h2, 0, big, f2)
            batch.raw_ops.TensorArrayWriteV3(h2, 1, big, f2)  # the next request
            batch.raw_ops.StopGradient(x)
        got = batch.run()
    np.testing.assert_array_equal(got[-1], [1.0, 2.0])


def test_a_step_that_fails_as_its_request_is_built_reports_its_step(small_messages):
    # A step naming an earlier request's None gradient fails in the SDK, as the op
    # does alone (ConversionError); it had no .step and no .results, though the steps
    # of the earlier request ran, and the step before it in its own request ran not.
    big = np.ones(200_000, np.float32)
    with connect(small_messages, max_message_bytes=MIB, shared_memory=False) as client:
        w = client.put(np.array([1.0, 2.0], np.float32))
        u = client.put(np.array([3.0], np.float32))  # not connected: a None gradient
        batch = client.batch()
        with client.gradient_tape() as tape:
            h, f = batch.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
            batch.raw_ops.TensorArrayWriteV3(h, 0, w, f)
            x = batch.raw_ops.TensorArrayReadV3(h, 0, f, np.float32)
        _, none = batch.gradient(tape, x, [w, u])
        h2, f2 = batch.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
        batch.raw_ops.TensorArrayWriteV3(h2, 0, big, f2)
        batch.raw_ops.TensorArrayWriteV3(h2, 1, big, f2)  # the next request
        batch.raw_ops.StopGradient(none)
        with pytest.raises(ConversionError) as info:
            batch.run()
    assert info.value.step == 7 and len(info.value.results) == 7


@pytest.mark.parametrize(
    "later, message",
    [
        ("read", "Batch step 3 (TensorArrayReadV3): "),
        (
            "handle",
            "Batch step 3 (StopGradient): input 'input' names step 2's 'handle', a "
            "TensorArray handle, not a tensor",
        ),
    ],
)
def test_a_failed_step_of_a_later_request_is_numbered_in_the_batch(small_messages, later, message):
    # Steps 1 to 3 go in the second request. The server numbered steps in its request:
    # the message said "Batch step 2" where .step was 3 (a batch fuzzer); and (handle)
    # step 3's reference to step 2 was "step 1" (fixed by BatchRequest.first_step).
    big = np.ones(200_000, np.float32)
    with connect(small_messages, max_message_bytes=MIB, shared_memory=False) as client:
        h, f = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
        batch = client.batch()
        batch.raw_ops.TensorArrayWriteV3(h, 0, big, f)
        batch.raw_ops.TensorArrayWriteV3(h, 1, big, f)  # the next request
        if later == "read":
            batch.raw_ops.TensorArraySizeV3(h, f)
            batch.raw_ops.TensorArrayReadV3(h, 5, f, np.float32)
        else:
            h2, _ = batch.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
            batch.raw_ops.StopGradient(h2)
        with pytest.raises(InvalidArgumentError) as info:
            batch.run()
    assert info.value.step == 3 and len(info.value.results) == 3
    assert str(info.value).startswith(message), str(info.value)


def test_a_handle_named_as_a_tensor_by_a_later_request_is_refused_at_its_step(
    small_messages,
):
    # It was an AttributeError ('tape_id') with no .step; in one request the server
    # refuses it with this message.
    big = np.ones(200_000, np.float32)
    with connect(small_messages, max_message_bytes=MIB, shared_memory=False) as client:
        batch = client.batch()
        h, f = batch.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
        batch.raw_ops.TensorArrayWriteV3(h, 0, big, f)
        batch.raw_ops.TensorArrayWriteV3(h, 1, big, f)  # the next request
        batch.raw_ops.StopGradient(h)
        with pytest.raises(
            InvalidArgumentError, match="a TensorArray handle, not a tensor"
        ) as info:
            batch.run()
    assert info.value.step == 3 and len(info.value.results) == 3
    assert str(info.value).startswith("Batch step 3 (StopGradient): input 'input' names step 0")


def test_a_tensor_named_as_a_handle_by_a_later_request_is_refused_at_its_step(
    small_messages,
):
    # The mirror image of a handle named as a tensor: an AttributeError ('id').
    big = np.ones(200_000, np.float32)
    with connect(small_messages, max_message_bytes=MIB, shared_memory=False) as client:
        h, f = client.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
        batch = client.batch()
        copy = batch.raw_ops.StopGradient(np.ones(2, np.float32))
        batch.raw_ops.TensorArrayWriteV3(h, 0, big, f)
        batch.raw_ops.TensorArrayWriteV3(h, 1, big, f)  # the next request
        batch.raw_ops.TensorArraySizeV3(copy, f)
        with pytest.raises(
            InvalidArgumentError, match="a tensor, not a TensorArray handle"
        ) as info:
            batch.run()
    assert info.value.step == 3 and len(info.value.results) == 3


def test_a_gradient_placeholder_has_its_sources_dtype(client):
    # An LSTM step given a gradient as x takes T from it, as from the float32 array it
    # is one by one: the float64 arrays beside it were left float64 and refused.
    T, B, I, H = 2, 1, 2, 2  # noqa: N806, E741
    z, p = np.zeros((B, H)), np.zeros(H)
    w, b = np.full((I + H, 4 * H), 0.1), np.zeros(4 * H)
    x = client.put(np.ones((T, B, I), np.float32))
    batch = client.batch()
    with client.gradient_tape(persistent=True) as tape:
        h, f = batch.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
        batch.raw_ops.TensorArrayWriteV3(h, 0, x, f)
        read = batch.raw_ops.TensorArrayReadV3(h, 0, f, np.float32)
        (grad,) = batch.gradient(tape, read, [x])
        batch.raw_ops.BlockLSTMV2(np.int64(T), grad, z, z, w, p, p, p, b)
    got = batch.run()[-1]
    tape.release()
    want = client.raw_ops.BlockLSTMV2(
        np.int64(T), np.ones((T, B, I), np.float32), z, z, w, p, p, p, b
    )
    assert got.h.dtype == np.float32
    np.testing.assert_array_equal(got.h, want.h)


def test_a_batch_steps_flow_is_the_value_the_op_returns(client):
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    batch = client.batch()
    placeholder = batch.raw_ops.TensorArrayWriteV3(h, 0, [1.0], 1.5)
    assert placeholder == np.float32(1.5)  # was 0.0; the call returns its flow_in
    assert batch.run() == [np.float32(1.5)]


def test_the_server_keeps_to_the_clients_response_budget(server):
    # The server allows 256 MiB, the client's channel only 1 MiB: the response
    # still fits the client.
    value = np.arange(3 * 100_000, dtype=np.float32)  # 1.2 MB
    with gradserve.Client(
        f"127.0.0.1:{server.port}", timeout=60, max_message_bytes=MIB, stream_threshold=1 << 30
    ) as client:
        ref = client.put(value)
        out = client.raw_ops.StopGradient(ref)
    np.testing.assert_array_equal(out, value)


def test_get_tensor_with_delete_after_keeps_the_tensor_until_the_last_chunk(server, client):
    # A reader that breaks off keeps its result: the tensor is deleted only after the
    # last chunk was sent, so it can be fetched again.
    value = np.arange(64 * MIB // 4, dtype=np.float32)  # more than HTTP/2 windows buffer
    ref = client.put(value)
    metadata = ((protocol.SESSION_METADATA_KEY, client.session_id),)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = service_pb2_grpc.GradServeStub(channel)
        request = service_pb2.GetTensorRequest(id=ref.id, chunk_bytes=MIB, delete_after=True)
        stream = stub.GetTensor(request, metadata=metadata)
        next(stream)  # one chunk, then the reader goes away
        stream.cancel()
    np.testing.assert_array_equal(client.get(ref), value)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = service_pb2_grpc.GradServeStub(channel)
        chunks = list(stub.GetTensor(request, metadata=metadata))
    assert sum(len(c.data) for c in chunks) == value.nbytes
    assert client.delete(ref) == 0  # read to the end: deleted


@pytest.mark.parametrize("late", ["before the reply", "while it is sent"])
def test_a_get_whose_reply_misses_its_deadline_deletes_nothing(monkeypatch, late):
    """GetTensorInline with ``delete_after`` deleted the tensor as it read it: a reply
    that then missed the client's deadline lost the tensor. Now it is deleted only
    once the call has ended with its reply sent in time. "while it is sent": the
    handler's own check passes (made a no-op here, as when the deadline falls while a
    large reply is still being sent: a review helper lost 71 of 120 gets of 128 MiB
    so), and only the end of the call shows the deadline passed."""
    from gradserve.server.transport import servicer_part
    from gradserve.server.transport.lanes import Lane

    if late == "while it is sent":
        monkeypatch.setattr(servicer_part, "check_reply_in_time", lambda context: None)

    run = Lane.run

    async def late_run(self, fn, principal=None):
        result = await run(self, fn, principal)
        time.sleep(0.4)  # the event loop held past the client's deadline
        return result

    value = np.arange(MIB // 2, dtype=np.float32)  # 2 MiB: read on a lane
    with run_server(device="cpu") as server, connect(server) as client:
        ref = client.put(value)
        request = service_pb2.GetTensorRequest(id=ref.id, delete_after=True)
        monkeypatch.setattr(Lane, "run", late_run)
        with pytest.raises(gradserve.errors.DeadlineExceededError):
            client._call("GetTensorInline", request, timeout=0.2)
        time.sleep(0.5)  # the handler ends (its loop held) before the patches go
        monkeypatch.undo()
        np.testing.assert_array_equal(client.get(ref), value)


def test_a_transient_output_stays_until_the_client_holds_it_all(server, client, monkeypatch):
    """The SDK fetches a transient output without having the server delete it as the
    last chunk leaves (a stream broken after that would lose it): fetched again, it is
    still there; the client's next call deletes it, before that call runs."""
    value = np.arange(3 * MIB // 4, dtype=np.float32)
    ref = client.put(value)
    budget = server.store.get(client.session_id).budget
    monkeypatch.setattr(client._fetched, "_flush_seconds", 60.0)  # only calls delete it
    np.testing.assert_array_equal(client._fetch(ref.id, delete_after=True), value)
    # A repeat (the first attempt's end never arrived) finds it whole.
    np.testing.assert_array_equal(client._fetch(ref.id, delete_after=True), value)
    assert budget.used == value.nbytes + TENSOR_RECORD_BYTES
    client.keep_alive()
    assert budget.used == 0 and len(client._fetched) == 0


def test_with_a_server_that_does_not_delete_fetched_ids_the_fetch_deletes(server, client):
    assert client._server_deletes_fetched  # this server says it does (KeepAlive)
    client._server_deletes_fetched = False  # as an older server would say
    ref = client.put(np.ones(1000, np.float32))
    client._fetch(ref.id, delete_after=True)
    assert len(client._fetched) == 0 and client.delete(ref) == 0  # deleted as sent


def test_more_fetched_ids_than_a_call_carries_are_all_gone_before_it_runs(
    server, client, monkeypatch
):
    monkeypatch.setattr(client._fetched, "_flush_seconds", 60.0)  # only calls delete them
    refs = [client.put(np.ones(256, np.float32)) for _ in range(protocol.MAX_FETCHED_IDS + 36)]
    for ref in refs:
        client._fetched.add(ref.id)
    budget = server.store.get(client.session_id).budget
    assert budget.used == len(refs) * (1024 + TENSOR_RECORD_BYTES)
    client.keep_alive()  # carries 64; the other 36 went just before it
    assert budget.used == 0 and len(client._fetched) == 0


def test_a_client_that_makes_no_call_deletes_what_it_fetched_soon(server, client):
    value = np.ones(MIB, np.float32)
    ref = client.put(value)
    budget = server.store.get(client.session_id).budget
    np.testing.assert_array_equal(client._fetch(ref.id, delete_after=True), value)
    end = time.monotonic() + 10
    while budget.used and time.monotonic() < end:
        time.sleep(0.05)
    assert budget.used == 0  # DeleteTensor after FLUSH_SECONDS without a call


def test_a_call_that_fails_gives_its_fetched_ids_to_the_next(server, client, monkeypatch):
    monkeypatch.setattr(client._fetched, "_flush_seconds", 60.0)  # only calls delete it
    ref = client.put(np.ones(1000, np.float32))
    budget = server.store.get(client.session_id).budget
    client._fetched.add(ref.id)
    with pytest.raises(gradserve.errors.NotFoundError):  # names no such tensor
        client._call("GetTensorInline", service_pb2.GetTensorRequest(id="nosuch"))
    assert budget.used == 0  # deleted as the call arrived, before it failed
    assert len(client._fetched) == 1  # given back all the same: a repeat is harmless
    client.keep_alive()
    assert len(client._fetched) == 0


def test_many_small_results_past_the_limit_all_come_back(small_messages):
    # Thousands of 100-byte clearing reads: the tensors fit, their encoding does
    # not. The server stops before the step that would not fit (RESPONSE_FULL) and
    # the SDK sends the rest in another Batch; the writes were split the same way.
    written = [np.full(25, k, np.float32) for k in range(9800)]
    with connect(small_messages, max_message_bytes=MIB) as client:
        ta = client.tensor_array(np.float32, size=len(written))
        batch = client.batch()
        for index, value in enumerate(written):
            batch.raw_ops.TensorArrayWriteV3(ta.handle, index, value, ta.flow)
        assert len(batch.run()) == len(written)
        for index in range(len(written)):
            batch.raw_ops.TensorArrayReadV3(ta.handle, index, ta.flow, np.float32)
        got = batch.run()
        session = small_messages.store.get(client.session_id)
        assert session.budget.used == session.record_bytes()  # no value: the records
    assert len(got) == len(written)
    for want, value in zip(written, got):
        np.testing.assert_array_equal(value, want)


def test_a_batch_of_handles_past_the_limit_returns_every_handle(small_messages):
    with connect(small_messages, max_message_bytes=MIB) as client:
        batch = client.batch()
        for _ in range(25_000):  # ~50 bytes of handle each: 1.2 MB of results
            batch.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
        handles = [out.handle for out in batch.run()]
        assert len(set(h.id for h in handles)) == 25_000
        # Every handle names a live array.
        assert client.raw_ops.TensorArraySizeV3(handles[-1], 0.0) == 1


def test_an_op_that_fails_on_its_outputs_leaves_none_behind():
    # Seven 256 kB outputs must go transient (1 MiB messages), but the session may
    # hold only two of them: the op fails and keeps none of the ones it stored.
    case = random_case(
        np.random.default_rng(3), steps=16, batch=16, inputs=8, units=256, dtype=np.float32
    )
    with run_server(device="cpu", max_message_bytes=MIB, max_session_bytes=MIB) as server:
        with connect(server) as client:
            with pytest.raises(gradserve.errors.ResourceExhaustedError, match="session"):
                client.raw_ops.BlockLSTMV2(np.int64(16), *(case[k] for k in INPUTS))
            assert server.store.get(client.session_id).budget.used == 0


def test_transient_outputs_left_by_a_failed_parse_are_deleted(server, client):
    # A reply whose transient outputs cannot all be fetched (the fetch broke off for
    # good) does not leave them holding the session's bytes.
    from gradserve.client._client import transient_ids

    kept = client.put(np.ones(10, np.float32))
    left = client.put(np.ones(10, np.float32))
    reply = service_pb2.BatchResponse()
    for ref, transient in ((kept, False), (left, True)):
        out = reply.results.add().tensor_array_read_v3.value.ref
        out.id, out.transient = ref.id, transient
    assert transient_ids(reply) == [left.id]

    def fails(_reply):
        raise gradserve.errors.UnavailableError("the fetch broke off")

    with pytest.raises(gradserve.errors.UnavailableError):
        client._parse(reply, fails)
    assert client.delete(left) == 0 and client.delete(kept) == 1
