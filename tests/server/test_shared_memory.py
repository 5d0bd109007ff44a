"""Same-host shared memory over the real RPC path: regions registered with a session,
tensors passed and returned by (region, offset, dtype, shape), and every way a worker
can break a region under the server (it must answer with an error and serve on)."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from multiprocessing import shared_memory

import grpc
import ml_dtypes
import numpy as np
import pytest

import gradserve
from gradserve import codec, dtypes, protocol
from gradserve.client import _shm
from gradserve.errors import (
    NOT_CONNECTED_REASON,
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    GradserveError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from gradserve.server import run_server
from gradserve.server.core import regions
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
from gradserve.server.core.tape import RECORD_BYTES
from gradserve.server.transport import shm_wire
from gradserve.v1 import lstm_pb2, service_pb2, tensor_array_pb2, tensor_pb2
from gradserve.v1 import shared_memory_pb2 as pb
from tests.failing_stub import FailingStub
from tests.memory_owner import memory_owner

NUMERIC = [dt for dt in dtypes.SUPPORTED if dt != dtypes.STRING]


@pytest.fixture
def shm_client(target):
    with gradserve.Client(target, timeout=60, shared_memory=True) as c:
        yield c


@pytest.fixture
def wire_client(target):
    with gradserve.Client(target, timeout=60, shared_memory=False) as c:
        yield c


class Regions:
    """POSIX shared-memory objects made by a test, unlinked after it."""

    def __init__(self) -> None:
        self.made: list[shared_memory.SharedMemory] = []

    def make(self, size: int) -> shared_memory.SharedMemory:
        name = f"{regions.KEY_PREFIX}test_{os.urandom(8).hex()}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.made.append(shm)
        return shm

    def register(self, client, size: int = 1 << 20, name: str | None = None):
        """A new object of ``size`` bytes, registered with ``client``'s session."""
        shm = self.make(size)
        nonce = os.urandom(32)
        shm.buf[:32] = nonce
        request = pb.RegisterSharedMemoryRequest(
            name=name or shm.name, key=shm.name, byte_size=size, nonce=nonce
        )
        client._call("RegisterSharedMemory", request)
        return shm

    def close(self) -> None:
        for shm in self.made:
            with contextlib.suppress(BufferError, OSError):
                shm.close()
            with contextlib.suppress(OSError):
                shm.unlink()


@pytest.fixture
def objects():
    made = Regions()
    yield made
    made.close()


def sample(dtype: np.dtype, shape=(3, 5)) -> np.ndarray:
    rng = np.random.default_rng(7)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    values = rng.standard_normal(shape) * 100
    values.flat[0] = np.nan
    values.flat[1] = -np.inf
    return (
        values.astype(np.float32).astype(dtype)
        if dtype == ml_dtypes.bfloat16
        else (values.astype(dtype))
    )


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def shared(
    shm, dtype, shape, offset: int = protocol.SHM_RESERVED_BYTES, name: str | None = None
) -> tensor_pb2.TensorInput:
    msg = tensor_pb2.TensorInput()
    msg.shared.region = name or shm.name
    msg.shared.offset = offset
    msg.shared.dtype = codec.dtype_to_enum(dtype)
    msg.shared.shape[:] = shape
    return msg


def write(shm, array: np.ndarray, offset: int = protocol.SHM_RESERVED_BYTES) -> None:
    shm.buf[offset : offset + array.nbytes] = array.tobytes()


def put_shared(client, msg: tensor_pb2.TensorInput):
    return client._call("PutSharedTensor", pb.PutSharedTensorRequest(tensor=msg.shared))


# ---------------------------------------------------------------- same values as the wire
@pytest.mark.parametrize("dtype", NUMERIC, ids=dtypes.name)
def test_every_dtype_equals_the_wire(shm_client, wire_client, dtype):
    assert shm_client._shm is not None and wire_client._shm is None
    value = sample(np.dtype(dtype), (64, 300))  # large enough to go by shared memory
    for c in (shm_client, wire_client):
        ref = c.put(value)
        assert same_bits(c.get(ref), value)
        assert same_bits(c.raw_ops.StopGradient(input=value), value)
        assert same_bits(c.raw_ops.StopGradient(input=ref), value)
        h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=dtype)
        flow = c.raw_ops.TensorArrayWriteV3(h, 0, value, flow)
        assert same_bits(c.raw_ops.TensorArrayReadV3(h, 0, flow, dtype), value)


def test_small_and_empty_tensors(shm_client):
    for value in (np.float32(3.5), np.zeros((0, 4), np.float64), np.arange(3, dtype=np.int8)):
        ref = shm_client.put(value)
        assert same_bits(shm_client.get(ref), np.asarray(value))
        assert same_bits(shm_client.raw_ops.StopGradient(input=value), np.asarray(value))


def test_strings_stay_on_the_wire(shm_client, objects):
    value = np.array([b"a", b"bc" * 40000, "d\u00e9"], dtype=object)
    out = shm_client.raw_ops.StopGradient(input=value)
    assert list(out) == [b"a", b"bc" * 40000, "d\u00e9".encode()]
    assert list(shm_client.get(shm_client.put(value))) == list(out)
    shm = objects.register(shm_client)
    with pytest.raises(InvalidArgumentError, match="string tensors cannot"):
        put_shared(shm_client, shared(shm, dtypes.STRING, [1]))


def test_outputs_come_back_through_the_region(shm_client, server):
    value = np.arange(1 << 16, dtype=np.float32)
    ref = shm_client.put(value)
    lease = shm_client._shm.output_lease()
    try:
        md = shm_client._shm.output_metadata(lease, shm_client._metadata)
        reply = shm_client._call(
            "StopGradient",
            tensor_array_pb2.StopGradientRequest(input=tensor_pb2.TensorInput(ref=ref.id)),
            metadata=md,
        )
        assert reply.output.WhichOneof("result") == "shared"
        assert reply.output.shared.region == lease.out.name
        assert same_bits(shm_client._shm.read_output(reply.output), value)
    finally:
        lease.release()


def test_outputs_that_do_not_fit_the_region_come_as_usual(target, objects):
    with gradserve.Client(target, shared_memory=True) as c:
        small = objects.register(c, 4096, name="tiny")
        value = np.arange(4096, dtype=np.float32)  # 16 KiB: over the region
        md = (*c._metadata, (protocol.OUTPUT_REGION_METADATA_KEY, "tiny"))
        req = tensor_array_pb2.StopGradientRequest()
        codec.encode(value, req.input.value)
        reply = c._call("StopGradient", req, metadata=md)
        assert reply.output.WhichOneof("result") == "value"
        assert same_bits(codec.decode(reply.output.value), value)
        assert bytes(small.buf[32:64]) == bytes(32)  # nothing written there


def test_lstm_inputs_in_shared_memory_give_the_wire_results(shm_client, wire_client):
    rng = np.random.default_rng(3)
    steps, batch, inputs, units = 5, 32, 128, 64

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    args = dict(
        seq_len_max=np.int64(steps),
        x=r(steps, batch, inputs),
        cs_prev=r(batch, units),
        h_prev=r(batch, units),
        w=r(inputs + units, 4 * units) * 0.1,
        wci=r(units),
        wcf=r(units),
        wco=r(units),
        b=r(4 * units),
    )
    by_shm = shm_client.raw_ops.BlockLSTMV2(**args, use_peephole=True)
    by_wire = wire_client.raw_ops.BlockLSTMV2(**args, use_peephole=True)
    for a, b in zip(by_shm, by_wire):
        assert same_bits(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- copies where TF needs them
def test_overwriting_the_region_after_a_write_changes_nothing_stored(shm_client, objects):
    shm = objects.register(shm_client)
    value = np.arange(1000, dtype=np.float32)
    write(shm, value)
    h, flow = shm_client.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
    req = tensor_array_pb2.TensorArrayWriteV3Request(
        handle=tensor_array_pb2.TensorArrayHandle(id=h.id, name=h.name),
        value=shared(shm, np.float32, [1000]),
        flow_in=flow,
    )
    codec.encode(np.array(0, np.int32), req.index.value)
    shm_client._call("TensorArrayWriteV3", req)
    ref = put_shared(shm_client, shared(shm, np.float32, [1000]))
    write(shm, np.full(1000, -1, np.float32))  # the worker reuses its region
    assert same_bits(shm_client.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32), value)
    assert same_bits(shm_client.get(ref.id), value)


# ---------------------------------------------------------------- isolation and validation
def test_another_sessions_region_is_not_found(target, objects):
    with gradserve.Client(target, shared_memory=False) as a:
        with gradserve.Client(target, shared_memory=False) as b:
            shm = objects.register(a, name="mine")
            write(shm, np.ones(4, np.float32))
            assert same_bits(
                a.get(put_shared(a, shared(shm, np.float32, [4], name="mine")).id),
                np.ones(4, np.float32),
            )
            with pytest.raises(NotFoundError) as err:
                put_shared(b, shared(shm, np.float32, [4], name="mine"))
            assert err.value.reason == "REGION_NOT_FOUND"
            # Nor can b register a's object, even knowing its name and first bytes.
            nonce = bytes(shm.buf[:32])
            request = pb.RegisterSharedMemoryRequest(
                name="theirs", key=shm.name, byte_size=1 << 20, nonce=nonce
            )
            with pytest.raises(FailedPreconditionError, match="another session"):
                b._call("RegisterSharedMemory", request)


def test_region_descriptors_are_bounded_for_the_whole_server(target, objects, monkeypatch):
    """Each registration holds a descriptor: sessions times regions per session could
    take every descriptor of the server, which then accepted no connection (one
    object under many names in many sessions, found by a review helper). The server
    holds at most ``MAX_OPEN_REGIONS`` (half its open-file limit), all sessions
    together, and refuses more with RESOURCE_EXHAUSTED; closing a session frees its."""
    monkeypatch.setattr(regions, "MAX_OPEN_REGIONS", regions._open_regions + 3)
    with gradserve.Client(target, shared_memory=False) as a:
        with gradserve.Client(target, shared_memory=False) as b:
            shm = objects.register(a, name="r0")
            nonce = bytes(shm.buf[:32])
            request = pb.RegisterSharedMemoryRequest(
                name="r1", key=shm.name, byte_size=1 << 20, nonce=nonce
            )
            a._call("RegisterSharedMemory", request)  # the object again: a descriptor more
            objects.register(b)
            with pytest.raises(ResourceExhaustedError, match="all sessions together") as err:
                objects.register(a)
            assert err.value.reason == "SERVER_REGIONS_FULL"
        objects.register(a, name="again")  # b's session closed: its descriptor with it
        a._call("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(name="r1"))
        objects.register(a, name="once_more")


def test_a_server_out_of_descriptors_says_so(objects, monkeypatch):
    """Out of descriptors, the first open of a registration (/dev/shm itself) failed
    EMFILE and was answered "the server has no /dev/shm" (found by a review helper)."""
    import errno

    shm = objects.make(4096)
    nonce = os.urandom(32)
    shm.buf[:32] = nonce
    table = regions.RegionTable("s", max_region_bytes=None, max_tensor_bytes=None)
    real_open = os.open

    def no_descriptors(path, *args, **kwargs):
        if path == regions.SHM_DIR:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_descriptors)
    with pytest.raises(ResourceExhaustedError) as err:
        table.register("r", shm.name, 4096, nonce)
    assert err.value.reason == "SERVER_REGIONS_FULL"
    monkeypatch.setattr(os, "open", real_open)
    table.register("r", shm.name, 4096, nonce)  # (nothing was left counted)
    table.close()


@pytest.mark.parametrize(
    "key",
    ["../etc/passwd", "a/b", "..", ".", "", "x" * 129, "sp ace", "nul\x00", "é", "psm_1234"],
)
def test_bad_keys_are_refused(wire_client, key):
    request = pb.RegisterSharedMemoryRequest(name="r", key=key, byte_size=64, nonce=b"n" * 32)
    with pytest.raises(InvalidArgumentError, match="key"):
        wire_client._call("RegisterSharedMemory", request)


def test_bad_registrations_are_refused(wire_client, objects):
    shm = objects.make(4096)
    nonce = os.urandom(32)
    shm.buf[:32] = nonce

    def register(**fields):
        base = dict(name="r", key=shm.name, byte_size=4096, nonce=nonce)
        wire_client._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(**(base | fields)))

    with pytest.raises(InvalidArgumentError, match="name"):
        register(name="a/b")
    with pytest.raises(InvalidArgumentError, match="nonce"):
        register(nonce=b"short")
    with pytest.raises(FailedPreconditionError, match="nonce"):
        register(nonce=os.urandom(32))
    with pytest.raises(InvalidArgumentError, match="fewer than"):
        register(byte_size=8192)
    with pytest.raises(NotFoundError, match="cannot open"):
        register(key="gradserve_no_such_object")
    register()
    with pytest.raises(AlreadyExistsError):
        register()


def test_symlinks_and_directories_under_dev_shm_are_refused(wire_client, objects, tmp_path):
    shm = objects.make(4096)
    nonce = os.urandom(32)
    shm.buf[:32] = nonce
    link = f"gradserve_test_link_{os.getpid()}"
    folder = f"gradserve_test_dir_{os.getpid()}"
    os.symlink(f"/dev/shm/{shm.name}", f"/dev/shm/{link}")
    os.mkdir(f"/dev/shm/{folder}")
    try:
        for key, error in ((link, NotFoundError), (folder, GradserveError)):
            request = pb.RegisterSharedMemoryRequest(name="r", key=key, byte_size=4096, nonce=nonce)
            with pytest.raises(error):
                wire_client._call("RegisterSharedMemory", request)
    finally:
        os.unlink(f"/dev/shm/{link}")
        os.rmdir(f"/dev/shm/{folder}")


def test_tensors_outside_the_region_are_refused(wire_client, objects):
    shm = objects.register(wire_client, 4096)
    for offset, shape in ((4000, [100]), (-8, [1]), (64, [1009]), (64, [1 << 40, 1 << 40])):
        with pytest.raises(InvalidArgumentError):
            put_shared(wire_client, shared(shm, np.float32, shape, offset=offset))
    assert put_shared(wire_client, shared(shm, np.float32, [1008])).shape == [1008]


def test_no_tensor_is_read_or_written_over_a_regions_nonce(wire_client, objects):
    """The first ``SHM_RESERVED_BYTES`` of a region hold the nonce that registered
    it, which only its owner knows: a put from there read it into a tensor, a get
    wrote over it (a review helper; the README said never). Refused, the nonce intact;
    the server's bound (``regions.RESERVED_BYTES``) is the SDK's."""
    from gradserve.server.core import regions

    assert regions.RESERVED_BYTES == protocol.SHM_RESERVED_BYTES
    shm = objects.register(wire_client, 4096)
    nonce = bytes(shm.buf[:64])
    ref = wire_client.put(np.ones(4, np.float32))
    for offset in (0, 48, 63):
        with pytest.raises(InvalidArgumentError, match="hold its nonce"):
            put_shared(wire_client, shared(shm, np.float32, [4], offset=offset))
        request = pb.GetSharedTensorRequest(id=ref.id, region=shm.name, offset=offset)
        with pytest.raises(InvalidArgumentError, match="hold its nonce"):
            wire_client._call("GetSharedTensor", request)
    assert bytes(shm.buf[:64]) == nonce
    assert put_shared(wire_client, shared(shm, np.float32, [4], offset=64)).shape == [4]


def test_region_sizes_are_bounded_by_the_session(objects):
    with run_server(host="127.0.0.1", port=0, device="cpu", max_session_bytes=1 << 20) as s:
        with gradserve.Client(f"127.0.0.1:{s.port}", shared_memory=False) as c:
            objects.register(c, 1 << 20)
            with pytest.raises(ResourceExhaustedError, match="REGION|limit"):
                objects.register(c, (1 << 20) + 4096)


def _stop_gradient(client, msg: tensor_pb2.TensorInput, keep: bool = False):
    request = tensor_array_pb2.StopGradientRequest(input=msg, keep_outputs=keep)
    return client._call("StopGradient", request).output


def test_op_inputs_read_from_regions_count_against_the_session_budget(objects):
    """One 512 KiB region named by three inputs of one call is 1.5 MiB of copies: past
    a 1 MiB session they are refused before the third is allocated, and the budget is
    whole again after the call (before, the copies were allocated uncounted and the
    call failed only later, on the LSTM's shapes)."""
    kib = 1024
    limit = 1024 * kib + 2 * TENSOR_RECORD_BYTES  # two copies fit, with their records
    with run_server(host="127.0.0.1", port=0, device="cpu", max_session_bytes=limit) as s:
        with gradserve.Client(f"127.0.0.1:{s.port}", shared_memory=False) as c:
            shm = objects.register(c, 512 * kib + 4096)
            budget = s.store.get(c.session_id).budget
            region = shared(shm, np.float32, [128 * kib], offset=4096)
            request = lstm_pb2.BlockLSTMV2Request(x=region, cs_prev=region, h_prev=region)
            codec.encode(np.int64(1), request.seq_len_max.value)
            with pytest.raises(ResourceExhaustedError, match="limit"):
                c._call("BlockLSTMV2", request)
            assert budget.used == 0
            steps = [
                service_pb2.BatchStep(
                    stop_gradient=tensor_array_pb2.StopGradientRequest(input=region)
                )
                for _ in range(3)
            ]
            reply = c._call("Batch", service_pb2.BatchRequest(steps=steps))
            assert reply.failed_step == 2 and reply.error.reason == "MEMORY_LIMIT"
            assert budget.used == 0
            assert _stop_gradient(c, region).HasField("value")  # within the budget: runs
            assert budget.used == 0


@contextlib.contextmanager
def _tight_session(objects):
    """A server whose sessions hold 1 MiB, a client, and 640 KiB of float32 in one of
    its regions: (server, client, value, the TensorInput naming it)."""
    with run_server(host="127.0.0.1", port=0, device="cpu", max_session_bytes=1 << 20) as s:
        with gradserve.Client(f"127.0.0.1:{s.port}", shared_memory=False) as c:
            shm = objects.register(c, 768 << 10)
            value = np.arange(160 << 10, dtype=np.float32)
            write(shm, value, offset=4096)
            yield s, c, value, shared(shm, np.float32, value.shape, offset=4096)


def test_a_kept_region_copy_is_charged_once(objects):
    """StopGradient keeps its input itself: the copy read out of the region is charged
    once, as the kept output, not once more as the input while the call runs."""
    with _tight_session(objects) as (s, c, value, region):
        out = _stop_gradient(c, region, keep=True)
        budget = s.store.get(c.session_id).budget
        assert budget.used == value.nbytes + TENSOR_RECORD_BYTES
        assert same_bits(c.get(out.ref.id), value)
        c.delete(out.ref.id)
        c.keep_alive()  # a call, after which the server has deleted it
        assert budget.used == 0


def test_a_region_copy_written_to_a_tensor_array_is_charged_once(objects):
    """The array charges the element it stores; the call's hold on the copy ends there."""
    with _tight_session(objects) as (s, c, value, region):
        h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
        req = tensor_array_pb2.TensorArrayWriteV3Request(
            handle=tensor_array_pb2.TensorArrayHandle(id=h.id, name=h.name),
            value=region,
            flow_in=flow,
        )
        codec.encode(np.array(0, np.int32), req.index.value)
        c._call("TensorArrayWriteV3", req)
        session = s.store.get(c.session_id)
        assert session.budget.used == value.nbytes + session.record_bytes()
        assert same_bits(c.raw_ops.TensorArrayReadV3(h, 0, flow, np.float32), value)


def test_a_region_copy_held_by_a_tape_is_charged_once(objects):
    """The tape holds StopGradient's output (the copy) and charges it: the call's hold
    on the copy ends there, so the op fits the session as an inline value does."""
    with _tight_session(objects) as (s, c, value, region):
        with c.gradient_tape(persistent=True) as tape:
            assert same_bits(codec.decode(_stop_gradient(c, region).value), value)
            used = s.store.get(c.session_id).budget.used
            assert used == value.nbytes + TENSOR_RECORD_BYTES + RECORD_BYTES
        tape.release()
        c.keep_alive()
        assert s.store.get(c.session_id).budget.used == 0


def test_a_copy_no_tape_takes_stays_charged_to_the_call(objects, monkeypatch):
    """The tape is released (by another call) while a Batch records on it: no tape
    takes the step outputs' copies, which the Batch still holds, so they stay charged
    until it ends."""
    read = shm_wire.read_tensor
    seen: list[int] = []
    state: dict[str, str] = {}

    def spy(session, msg, field):
        if not seen:
            session.release_tape(state["tape"])
        array = read(session, msg, field)
        seen.append(session.budget.used)
        return array

    monkeypatch.setattr(shm_wire, "read_tensor", spy)
    with _tight_session(objects) as (s, c, value, region):
        small = shared_input(region, [25 << 10])  # 100 KiB
        step = tensor_array_pb2.StopGradientRequest(input=small)
        request = service_pb2.BatchRequest(
            steps=[service_pb2.BatchStep(stop_gradient=step) for _ in range(3)]
        )
        with c.gradient_tape(persistent=True) as tape:
            state["tape"] = tape.id
            c.keep_alive()  # the tape starts on the server
            assert len(c._call("Batch", request).results) == 3
        assert seen == [n * ((100 << 10) + TENSOR_RECORD_BYTES) for n in (1, 2, 3)]
        c.keep_alive()
        assert s.store.get(c.session_id).budget.used == 0


def test_a_batch_gives_back_each_steps_input_copies_that_are_not_outputs(objects):
    """An LSTM's x read from a region is garbage once its step ends: three such steps
    fit a Batch in a session that holds only two of the copies at once."""
    steps, batch, inputs, units = 100, 32, 32, 1  # x: 400 KiB
    with run_server(host="127.0.0.1", port=0, device="cpu", max_session_bytes=1 << 20) as s:
        with gradserve.Client(f"127.0.0.1:{s.port}", shared_memory=False) as c:
            x = np.ones((steps, batch, inputs), np.float32)
            shm = objects.register(c, 512 << 10)
            write(shm, x, offset=4096)
            step = lstm_pb2.BlockLSTMV2Request(x=shared(shm, np.float32, x.shape, offset=4096))
            for name, shape in dict(
                cs_prev=(batch, units), h_prev=(batch, units), w=(inputs + units, 4 * units),
                wci=(units,), wcf=(units,), wco=(units,), b=(4 * units,),
            ).items():  # fmt: skip
                codec.encode(np.zeros(shape, np.float32), getattr(step, name).value)
            codec.encode(np.int64(steps), step.seq_len_max.value)
            request = service_pb2.BatchRequest(
                steps=[service_pb2.BatchStep(block_lstm_v2=step) for _ in range(3)]
            )
            reply = c._call("Batch", request)
            assert not reply.HasField("failed_step") and len(reply.results) == 3
            assert s.store.get(c.session_id).budget.used == 0


def test_a_call_that_ends_before_its_op_keeps_the_copies_charged_until_the_op_ends(
    objects, monkeypatch
):
    """Past its deadline the call is over for gRPC, but its op still holds the copies it
    read: they stay charged until the op itself ends."""
    read = shm_wire.read_tensor
    reading = threading.Event()
    go_on = threading.Event()

    def slow_read(session, msg, field):
        array = read(session, msg, field)
        if field == "cs_prev":
            reading.set()
            go_on.wait(10)
        return array

    monkeypatch.setattr(shm_wire, "read_tensor", slow_read)
    with _tight_session(objects) as (s, c, value, region):
        request = lstm_pb2.BlockLSTMV2Request(x=region, cs_prev=shared_input(region, [8, 4]))
        codec.encode(np.int64(1), request.seq_len_max.value)
        with pytest.raises(DeadlineExceededError):
            c._call("BlockLSTMV2", request, timeout=0.3)
        assert reading.wait(10)
        budget = s.store.get(c.session_id).budget
        # the op runs on: both copies held
        assert budget.used == value.nbytes + 8 * 4 * 4 + 2 * TENSOR_RECORD_BYTES
        go_on.set()
        deadline = time.monotonic() + 10
        while budget.used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.used == 0


def shared_input(region: tensor_pb2.TensorInput, shape) -> tensor_pb2.TensorInput:
    """The same place in the same region, as another shape."""
    msg = tensor_pb2.TensorInput()
    msg.CopyFrom(region)
    msg.shared.shape[:] = shape
    return msg


# ---------------------------------------------------------------- a region broken under the server
def test_truncated_or_unlinked_region_is_an_error_and_the_server_serves_on(shm_client, objects):
    shm = objects.register(shm_client, 1 << 20)
    write(shm, np.ones(1000, np.float32))
    truncate(shm, 1024)  # the worker shrinks it
    with pytest.raises(FailedPreconditionError) as err:
        put_shared(shm_client, shared(shm, np.float32, [1000]))
    assert err.value.reason == "REGION_TRUNCATED"
    ref = shm_client.put(np.ones(10, np.float32))
    with pytest.raises(FailedPreconditionError):
        shm_client._call(
            "GetSharedTensor", pb.GetSharedTensorRequest(id=ref.id, region=shm.name, offset=4096)
        )
    truncate(shm, 1 << 20)  # grown back: usable again
    assert put_shared(shm_client, shared(shm, np.float32, [1000])).id
    shm.unlink()  # the worker removes it
    with pytest.raises(NotFoundError) as err:
        put_shared(shm_client, shared(shm, np.float32, [1000]))
    assert err.value.reason == "REGION_UNLINKED"
    with pytest.raises(NotFoundError, match="not registered"):  # dropped from the session
        put_shared(shm_client, shared(shm, np.float32, [1000]))
    assert same_bits(shm_client.raw_ops.StopGradient(input=np.arange(5.0)), np.arange(5.0))


def test_region_truncated_while_calls_run_gives_errors_never_a_crash(shm_client, objects):
    size = 16 << 20
    shm = objects.register(shm_client, size)
    ref = shm_client.put(np.ones(size // 4 - 16, np.float32))  # (past the nonce)
    stop = threading.Event()

    def vandal():
        fd = os.open(f"/dev/shm/{shm.name}", os.O_RDWR)
        while not stop.is_set():
            os.ftruncate(fd, 4096)
            os.ftruncate(fd, size)
        os.close(fd)

    thread = threading.Thread(target=vandal)
    thread.start()
    outcomes = set()
    try:
        for _ in range(20):
            for call in (
                lambda: put_shared(shm_client, shared(shm, np.float32, [size // 4 - 16])),
                lambda: shm_client._call(
                    "GetSharedTensor",
                    pb.GetSharedTensorRequest(id=ref.id, region=shm.name, offset=64),
                ),
            ):
                try:
                    call()
                    outcomes.add("ok")
                except FailedPreconditionError:
                    outcomes.add("truncated")
    finally:
        stop.set()
        thread.join()
    assert outcomes <= {"ok", "truncated"}
    assert same_bits(shm_client.raw_ops.StopGradient(input=np.arange(3)), np.arange(3))


def test_output_region_broken_before_the_outputs_returns_them_inline(target, objects):
    with gradserve.Client(target, shared_memory=True) as c:
        shm = objects.register(c, 1 << 20, name="out")
        truncate(shm, 0)
        md = (*c._metadata, (protocol.OUTPUT_REGION_METADATA_KEY, "out"))
        req = tensor_array_pb2.StopGradientRequest()
        codec.encode(np.arange(100, dtype=np.float32), req.input.value)
        reply = c._call("StopGradient", req, metadata=md)
        assert reply.output.WhichOneof("result") == "value"  # never lost to the region


def test_a_read_into_the_output_region_is_not_charged_as_kept(objects):
    """A read that clears its element pays ahead for the outputs the call will keep
    (``CallIO.hand_out_for``), not for those it writes into the call's output region:
    counted as kept, a read of a large element into the region was refused though
    nothing was to stay in the session."""
    limit = 1 << 20
    with run_server(host="127.0.0.1", port=0, device="cpu", max_session_bytes=limit) as s:
        with gradserve.Client(
            f"127.0.0.1:{s.port}", shared_memory=False, stream_threshold=64 << 10
        ) as c:
            objects.register(c, 700_000, name="out")
            value = np.arange(150_000, dtype=np.float32)  # more than half the session
            h, flow = c.raw_ops.TensorArrayV3(size=1, dtype=np.float32)
            write = tensor_array_pb2.TensorArrayWriteV3Request(flow_in=flow)
            write.handle.id = h.id
            codec.encode(np.array(0, np.int32), write.index.value)
            codec.encode(value, write.value.value)
            c._call("TensorArrayWriteV3", write)
            md = (*c._metadata, (protocol.OUTPUT_REGION_METADATA_KEY, "out"))
            read = tensor_array_pb2.TensorArrayReadV3Request(
                flow_in=flow, dtype=codec.dtype_to_enum(np.float32)
            )
            read.handle.id = h.id
            codec.encode(np.array(0, np.int32), read.index.value)
            reply = c._call("TensorArrayReadV3", read, metadata=md)
            assert reply.value.WhichOneof("result") == "shared"


# ---------------------------------------------------------------- lifetime
def test_regions_are_closed_with_their_session_and_on_expiry(objects):
    with run_server(host="127.0.0.1", port=0, device="cpu") as s:
        target = f"127.0.0.1:{s.port}"
        c = gradserve.Client(target, shared_memory=True, keepalive=False)
        shm = objects.register(c)
        table = s.store.get(c.session_id).regions
        assert len(table) == 2 and _server_fds(shm.name) == 1
        c.close()
        assert len(table) == 0 and _server_fds(shm.name) == 0
        d = gradserve.Client(target, shared_memory=False, keepalive=False)
        shm = objects.register(d)
        assert _server_fds(shm.name) == 1
        assert s.store.expire_idle(now=float("inf")) >= 1
        assert _server_fds(shm.name) == 0
        d.close()


def test_client_unlinks_its_regions_on_close(target):
    with gradserve.Client(target, shared_memory=True) as c:
        c.put(np.ones(1 << 20, np.float32))
        names = list(c._shm.pool._all)
    assert names and not any(os.path.exists(f"/dev/shm/{n}") for n in names)


# ---------------------------------------------------------------- another host
def test_a_server_that_cannot_open_the_region_means_the_wire(target, monkeypatch, tmp_path):
    monkeypatch.setattr(regions, "SHM_DIR", str(tmp_path))  # the server's /dev/shm is elsewhere
    with gradserve.Client(target) as c:  # "auto"
        assert c._shm is None
        value = np.arange(1 << 18, dtype=np.float32)
        assert same_bits(c.get(c.put(value)), value)
        assert same_bits(c.raw_ops.StopGradient(input=value), value)
    with pytest.raises(NotFoundError, match="cannot open"):
        gradserve.Client(target, shared_memory=True)


def test_a_server_that_opens_another_object_of_that_name_means_the_wire(
    target, monkeypatch, tmp_path
):
    monkeypatch.setattr(regions, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(_shm.secrets, "token_hex", lambda n: "f" * 2 * n)
    (tmp_path / f"gradserve_{'f' * 24}").write_bytes(bytes(2 << 20))  # another host's object
    with gradserve.Client(target) as c:
        assert c._shm is None
        assert same_bits(c.raw_ops.StopGradient(input=np.arange(4.0)), np.arange(4.0))
    with pytest.raises(FailedPreconditionError, match="nonce"):
        gradserve.Client(target, shared_memory=True)


def truncate(shm: shared_memory.SharedMemory, size: int) -> None:
    """The worker resizes its object under the server."""
    fd = os.open(f"/dev/shm/{shm.name}", os.O_RDWR)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _server_fds(key: str) -> int:
    """Descriptors the in-process server holds on /dev/shm/<key>: those of this process
    less the test's own two (SharedMemory's, and its mapping's duplicate)."""
    count = -2
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/dev/shm/{key}"):
                count += 1
    return count


def test_regions_the_server_lost_are_registered_again(server, shm_client):
    # A server restored from a snapshot knows the session but holds no region.
    value = np.arange(1 << 16, dtype=np.float32)
    ref = shm_client.put(value)
    table = server.store.get(shm_client.session_id).regions
    table.unregister()
    assert same_bits(shm_client.raw_ops.StopGradient(input=value), value)
    assert len(table) >= 1
    table.unregister()
    assert same_bits(shm_client.get(ref), value)
    table.unregister()
    assert same_bits(shm_client.get(shm_client.put(value)), value)


def test_a_batch_and_a_gradient_register_the_regions_the_server_lost(server, shm_client):
    """As an op: a Batch step whose input is in a region the server does not know
    (restarted from a snapshot, or a session taken over) and a tape.gradient whose
    output gradient is failed REGION_NOT_FOUND, and again on every try (a review
    helper). The step changed nothing: the batch goes on from it."""
    value = np.arange(1 << 16, dtype=np.float32)
    table = server.store.get(shm_client.session_id).regions
    w = shm_client.put(np.zeros_like(value))
    h, flow = shm_client.raw_ops.TensorArrayV3(size=2, dtype=np.float32)
    batch = shm_client.batch()
    flow = batch.raw_ops.TensorArrayWriteV3(h, 0, np.ones(2, np.float32), flow)
    batch.raw_ops.StopGradient(input=value)  # step 1: its input in a region
    table.unregister()
    results = batch.run()
    assert results[0] == flow and same_bits(results[1], value)
    assert len(table) >= 1
    with shm_client.gradient_tape() as tape:
        flow = shm_client.raw_ops.TensorArrayWriteV3(h, 1, w, flow)
        r = shm_client.raw_ops.TensorArrayReadV3(h, 1, flow, np.float32)
    table.unregister()
    assert same_bits(tape.gradient(r, w, output_gradients=2 * value), 2 * value)
    assert len(table) >= 1


# ------------------------------------------------------------ review regressions
def test_no_tensor_is_placed_over_a_regions_nonce(shm_client):
    """Data over the nonce would let anyone who guesses it register the region once
    the server forgets its owner (a restart); the SDK and the server both start after
    ``SHM_RESERVED_BYTES``."""
    pool = shm_client._shm.pool
    value = np.full(1 << 16, 7, np.float32)
    ref = shm_client.put(value)
    np.testing.assert_array_equal(shm_client.get(ref), value)
    shm_client.raw_ops.StopGradient(value)  # input placed, output written by the server
    for region in pool._all.values():
        assert bytes(region.buf[: len(region.nonce)]) == region.nonce


def test_regions_of_a_call_that_got_no_reply_are_never_reused(target):
    """The server may still read its inputs or write its outputs after the client's
    deadline: those regions are discarded, not leased to the next call."""
    from tests.server.test_limits import lstm_args

    # (300,000 steps of tiny cells: FUSED's compiled calls of several steps compute
    # them in about 0.15 s, so the deadline is far shorter)
    with gradserve.Client(target, timeout=0.05, shared_memory=True) as c:
        pool = c._shm.pool
        discarded: list = []
        discard = pool.discard
        pool.discard = lambda regions: (discarded.extend(regions), discard(regions))
        with pytest.raises(DeadlineExceededError):
            c.raw_ops.BlockLSTMV2(*lstm_args(300_000))
        assert discarded, "the call's regions were discarded"
        names = {r.name for r in discarded}
        assert not names & set(pool._all) and not names & {r.name for r in pool._free}
        assert c.stop_gradient(np.ones(3))[0] == 1  # and the client goes on
        held = sum(r.size for r in pool._all.values())
        assert pool._held == held, "discarded regions no longer count against the pool"


def test_a_short_timeout_does_not_cut_the_unregistering_of_a_calls_regions(target):
    """The regions of a call that ran past the client's timeout are dropped with an
    UnregisterSharedMemory of its own, given at least ``HOUSEKEEPING_TIMEOUT_SECONDS``:
    under the client's 2 ms the server kept them, and after 64 the session refused
    every new region (a review helper)."""
    from gradserve.client import _client
    from tests.server.test_limits import lstm_args

    with gradserve.Client(target, timeout=0.05, shared_memory=True) as c:
        real, timeouts = c._stub, []

        class Recording:
            def __getattr__(self, name):
                method = getattr(real, name)
                if name != "UnregisterSharedMemory":
                    return method

                def unregister(body, *, metadata=None, timeout=None):
                    timeouts.append(timeout)
                    return method(body, metadata=metadata, timeout=timeout)

                return unregister

        c._stub = Recording()
        try:
            with pytest.raises(DeadlineExceededError):
                c.raw_ops.BlockLSTMV2(*lstm_args(300_000))
        finally:
            c._stub = real
        assert timeouts and min(timeouts) >= _client.HOUSEKEEPING_TIMEOUT_SECONDS
        assert c.stop_gradient(np.ones(3))[0] == 1


def leased(pool) -> set[str]:
    """Regions of the pool neither free nor held by arrays: leased to a call."""
    return set(pool._all) - {r.name for r in pool._free} - pool._pinned


def test_an_op_whose_request_cannot_be_built_gives_its_leases_back(shm_client):
    pool = shm_client._shm.pool
    big = np.ones((4, 64, 256), np.float32)  # placed in a region before ``b`` fails
    for _ in range(_shm.MAX_REGIONS + 4):
        with pytest.raises((TypeError, ValueError, InvalidArgumentError)):
            shm_client.raw_ops.BlockLSTMV2(
                np.int64(4), big, *[np.ones((64, 64), np.float32)] * 2,
                np.ones((320, 256), np.float32), *[np.ones(64, np.float32)] * 3,
                np.array([object()]),
            )  # fmt: skip
        assert not leased(pool)
    value = np.arange(1 << 16, dtype=np.float32)
    lease = shm_client._shm.output_lease()  # and calls still get regions
    try:
        assert shm_client._shm.output_metadata(lease, ()) is not None
    finally:
        lease.release()
    assert same_bits(shm_client.raw_ops.StopGradient(input=value), value)


def test_a_batch_dropped_unrun_gives_its_leases_back(shm_client):
    pool = shm_client._shm.pool
    batch = shm_client.batch()
    batch.raw_ops.StopGradient(input=np.ones(1 << 16, np.float32))
    assert leased(pool)
    del batch
    gc.collect()
    shm_client.raw_ops.StopGradient(input=np.ones(1 << 16, np.float32))  # takes them back
    assert not leased(pool)


def test_a_batch_collected_inside_the_pools_lock_does_not_deadlock(shm_client):
    """A batch in a reference cycle goes when the cyclic collector runs, at any
    allocation, so maybe inside the pool's lock on the same thread, where giving its
    lease back took that lock again (helper-75: the client hung). It only appends
    now; the next lease takes the region back."""
    pool = shm_client._shm.pool
    batch = shm_client.batch()
    batch.raw_ops.StopGradient(input=np.ones(1 << 16, np.float32))
    batch.cycle = batch  # only the cyclic collector frees it
    del batch
    collected = threading.Event()

    def collect_inside_the_lock():
        with pool._lock:
            gc.collect()
        collected.set()

    threading.Thread(target=collect_inside_the_lock, daemon=True).start()
    assert collected.wait(20), "deadlocked"
    assert leased(pool)  # given back, not yet taken back
    value = np.arange(1 << 16, dtype=np.float32)
    np.testing.assert_array_equal(shm_client.raw_ops.StopGradient(input=value), value)
    assert not leased(pool)


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset (simulated)"

    def trailing_metadata(self):
        return ()


def test_a_repeated_call_writes_into_a_fresh_output_region(shm_client):
    """An attempt that got no reply may still write into the region it named: the
    repeat names another, and the first is never leased again."""
    pool = shm_client._shm.pool
    real = shm_client._stub
    stub = FailingStub(real, {"StopGradient": [_Unavailable()]})
    value = np.arange(1 << 18, dtype=np.float32)
    shm_client._stub = stub
    try:
        got = shm_client.raw_ops.StopGradient(input=value)
    finally:
        shm_client._stub = real
    named = stub.regions["StopGradient"]
    assert len(named) == 2 and None not in named and named[0] != named[1]
    assert named[0] not in pool._all  # discarded: unregistered and unlinked
    assert not os.path.exists(f"/dev/shm/{named[0]}")
    assert same_bits(got, value)


class _NotSent(_Unavailable):
    def details(self):
        return "failed to connect to all addresses; last error: refused (simulated)"


@pytest.mark.parametrize("own_channel", [True, False], ids=["own-channel", "callers-channel"])
def test_a_call_grpc_never_sent_keeps_its_output_region(target, own_channel):
    """Repeated after gRPC sent nothing (NOT_CONNECTED: tried every 0.1 s while the
    server is down), a call names the same region: no server saw it, and a fresh
    one per try would create and register a region ten times a second. On a caller's
    channel gRPC's word is not trusted (its retry policy may have sent the call): a
    fresh region each time, as after any attempt that may have reached the server."""
    channel = None if own_channel else grpc.insecure_channel(target)
    c = gradserve.Client(target, channel=channel, shared_memory=True, keepalive=False)
    pool = c._shm.pool
    real = c._stub
    stub = FailingStub(real, {"StopGradient": [_NotSent(), _NotSent()]})
    value = np.arange(1 << 18, dtype=np.float32)
    c._stub = stub
    try:
        got = c.raw_ops.StopGradient(input=value)
        held = set(pool._all)
    finally:
        c._stub = real
        c.close()
        if channel is not None:
            channel.close()
    named = stub.regions["StopGradient"]
    assert len(named) == 3 and None not in named and same_bits(got, value)
    if own_channel:
        assert len(set(named)) == 1 and named[0] in held
    else:
        assert len(set(named)) == 3


def test_puts_and_gets_through_regions_are_repeated_as_on_the_wire(shm_client, monkeypatch):
    """Only the pool's own calls (registering, dropping regions) are tried once: a put
    or get through a region that gRPC never sent is repeated."""
    real = shm_client._stub
    twice = [_NotSent(), _NotSent()]
    stub = FailingStub(real, {"PutSharedTensor": twice, "GetSharedTensor": twice})
    monkeypatch.setattr(shm_client, "_pause", lambda s: None)
    value = np.arange(1 << 16, dtype=np.float32)
    shm_client._stub = stub
    try:
        ref = shm_client.put(value)
        got = shm_client.get(ref)
    finally:
        shm_client._stub = real
    attempts = stub.attempts
    assert attempts["PutSharedTensor"] == 3 and attempts["GetSharedTensor"] == 3, attempts
    assert same_bits(got, value)


def test_a_call_to_a_server_that_is_down_costs_one_retry_budget_and_no_region():
    """Every attempt unsent: the SDK's housekeeping inside the call (registering a new
    region, unregistering, deleting) is tried once each, so the pauses add up to one
    retry budget (it was one per nested call: 5.7 s at retries=3), and the regions it
    held are kept: no server saw them."""
    with run_server(device="cpu") as server:
        c = gradserve.Client(
            f"127.0.0.1:{server.port}", shared_memory=True, keepalive=False, retries=3
        )
        value = np.ones(1 << 16, np.float32)
        c.raw_ops.StopGradient(input=value)  # regions made and registered
        held = set(c._shm.pool._all)
    real, pauses = c._stub, []
    stub = FailingStub(real, {})
    calls = stub.attempts
    c._stub = stub
    c._pause = pauses.append
    try:
        with pytest.raises(UnavailableError) as down:  # in the regions it holds
            c.raw_ops.StopGradient(input=value)
        assert down.value.reason == NOT_CONNECTED_REASON
        assert held <= set(c._shm.pool._all)  # nothing discarded
        pauses.clear()
        with pytest.raises(UnavailableError) as down:  # a new region: to register
            c.raw_ops.StopGradient(input=np.ones(1 << 20, np.float32))
        assert down.value.reason == NOT_CONNECTED_REASON
        assert calls["RegisterSharedMemory"]  # housekeeping was tried
        assert sum(pauses) <= 2 * (0.1 + 0.2 + 0.4) + 1e-9  # retries=3: one budget
    finally:
        c._stub = real
        c.close()


def test_a_gradient_call_without_a_reply_discards_its_leases(target):
    with gradserve.Client(target, shared_memory=True) as c:
        x = c.put(np.linspace(-1, 1, 1 << 16).astype(np.float32))
        with c.gradient_tape() as tape:
            tape.watch(x)
            y = c.raw_ops.StopGradient(input=x)
        discarded: list = []
        discard = c._shm.pool.discard
        c._shm.pool.discard = lambda regions: (discarded.extend(regions), discard(regions))

        def no_reply(*args, **kwargs):
            raise DeadlineExceededError("deadline (simulated)")

        c._call = no_reply  # shadows the method until deleted
        try:
            with pytest.raises(DeadlineExceededError):
                tape.gradient(y, x, output_gradients=[np.ones(1 << 16, np.float32)])
        finally:
            del c._call
        assert discarded, "the output gradient's region was discarded, not reused"


def test_reading_from_a_forgotten_region_is_a_clean_error(shm_client):
    msg = tensor_pb2.SharedTensor(
        region="gone", offset=64, dtype=codec.dtype_to_enum(np.dtype(np.float32)), shape=[4]
    )
    with pytest.raises(GradserveError, match="is gone"):
        shm_client._shm.pool.read(msg)


# ------------------------------------------------------------ zero-copy get
def pinned_region(array: np.ndarray) -> str:
    held = memory_owner(array)
    assert isinstance(held, _shm.Pinned), f"not zero-copy: {type(held)}"
    return held.region


def large(dtype: np.dtype) -> np.ndarray:
    """A sample of ``dtype`` of 1 MiB: large enough for a zero-copy get."""
    return sample(dtype, ((_shm.ZERO_COPY_MIN_BYTES // dtype.itemsize) // 64, 64))


def mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(f"/dev/shm/{name}" in line for line in maps)


@pytest.mark.parametrize("dtype", NUMERIC, ids=dtypes.name)
def test_zero_copy_get_equals_the_wire(shm_client, wire_client, dtype):
    value = large(np.dtype(dtype))
    by_shm = shm_client.get(shm_client.put(value))
    assert pinned_region(by_shm) in shm_client._shm.pool._all
    assert by_shm.flags.writeable
    assert same_bits(by_shm, value)
    assert same_bits(by_shm, wire_client.get(wire_client.put(value)))


def test_small_gets_are_copies(shm_client):
    for value in (np.arange(1000, dtype=np.float32), np.zeros((0, 3))):
        got = shm_client.get(shm_client.put(value))
        assert not isinstance(memory_owner(got), _shm.Pinned) and same_bits(got, value)
    assert not shm_client._shm.pool._pinned


def test_a_region_is_not_reused_while_its_array_lives(shm_client):
    first_value = np.arange(1 << 18, dtype=np.float32)
    other = np.full(1 << 18, -2, np.float32)
    first = shm_client.get(shm_client.put(first_value))
    name = pinned_region(first)
    view = first[7:][::3]  # a view keeps it too, after the array itself is gone
    del first
    gc.collect()
    ref = shm_client.put(other)
    for _ in range(20):  # gets, puts and op calls use other regions meanwhile
        got = shm_client.get(ref)
        assert pinned_region(got) != name and same_bits(got, other)
        shm_client.delete(shm_client.put(other))
        assert same_bits(shm_client.raw_ops.StopGradient(input=other), other)
        del got
    assert same_bits(view, first_value[7:][::3])
    assert name in shm_client._shm.pool._pinned
    assert name not in {r.name for r in shm_client._shm.pool._free}


def test_a_region_is_reused_once_its_array_is_gone(shm_client):
    value = np.arange(1 << 18, dtype=np.float32)
    ref = shm_client.put(value)
    got = shm_client.get(ref)
    name = pinned_region(got)
    del got
    gc.collect()
    again = shm_client.get(ref)
    assert pinned_region(again) == name and same_bits(again, value)
    assert shm_client._shm.pool._pinned == {name}


def test_writing_into_a_returned_array_changes_nothing_on_the_server(shm_client):
    value = np.arange(1 << 18, dtype=np.float32)
    ref = shm_client.put(value)
    got = shm_client.get(ref)
    got[...] = -1
    got[:10] += 5
    assert same_bits(shm_client.get(ref), value)
    assert same_bits(shm_client.raw_ops.StopGradient(input=ref), value)
    assert same_bits(got[10:], np.full(value.size - 10, -1, np.float32))


def test_arrays_past_their_share_of_the_pool_are_copies(shm_client):
    value = np.arange(1 << 18, dtype=np.float32)
    ref = shm_client.put(value)
    kept = [shm_client.get(ref) for _ in range(_shm.MAX_PINNED_REGIONS + 2)]
    held = [isinstance(memory_owner(a), _shm.Pinned) for a in kept]
    assert held == [True] * _shm.MAX_PINNED_REGIONS + [False, False]
    assert all(same_bits(a, value) for a in kept)
    lease = _shm.Lease(shm_client._shm.pool)  # puts and op inputs still have regions
    try:
        assert lease.place(value, tensor_pb2.SharedTensor())
    finally:
        lease.release()
    assert same_bits(shm_client.raw_ops.StopGradient(input=value), value)


def test_closing_the_client_leaves_live_arrays_mapped_until_they_go(target):
    value = np.arange(1 << 18, dtype=np.float32)
    c = gradserve.Client(target, shared_memory=True)
    got = c.get(c.put(value))
    view = got[::-1]
    name = pinned_region(got)
    c.close()
    assert not os.path.exists(f"/dev/shm/{name}")  # unlinked with the client
    assert mapped(name) and same_bits(got, value) and same_bits(view, value[::-1])
    got[0] = 9  # still the caller's memory
    del got
    gc.collect()
    assert mapped(name) and view[-1] == 9
    del view
    gc.collect()
    assert not mapped(name)  # unmapped once the last view went


def test_gets_from_threads_with_arrays_dropped_anywhere(shm_client):
    values = [np.full(1 << 18, i, np.float32) for i in range(4)]
    refs = [shm_client.put(v) for v in values]
    errors: list = []

    def work(i: int) -> None:
        try:
            kept = []
            for n in range(15):
                got = shm_client.get(refs[i])
                assert same_bits(got, values[i])
                kept.append(got)
                if n % 3 == 0:
                    kept.clear()
                    gc.collect()  # finalizers run here, maybe while others hold the pool
            assert all(same_bits(a, values[i]) for a in kept)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    gc.collect()
    assert same_bits(shm_client.get(refs[0]), values[0])


def test_large_reads_split_in_parts_give_the_bytes_or_a_truncation_error(shm_client, objects):
    size = 2 * regions.PARALLEL_READ_BYTES
    assert regions._parallel_parts(size - 4096) > 1 or (os.cpu_count() or 1) == 1
    shm = objects.register(shm_client, size)
    value = np.random.default_rng(1).integers(0, 255, size - 4096, np.uint8)
    write(shm, value, offset=4096)
    ref = put_shared(shm_client, shared(shm, np.uint8, [value.size], offset=4096))
    assert same_bits(shm_client.get(ref.id), value)
    truncate(shm, size - regions.MIN_PART_BYTES)  # only the last part runs short
    with pytest.raises(FailedPreconditionError) as err:
        put_shared(shm_client, shared(shm, np.uint8, [value.size], offset=4096))
    assert err.value.reason == "REGION_TRUNCATED"
    truncate(shm, size)
    assert put_shared(shm_client, shared(shm, np.uint8, [value.size], offset=4096)).id


# ------------------------------------------------------------ zero-copy op outputs
def lstm_args(steps: int = 32, batch: int = 32, units: int = 256) -> dict:
    """An LSTM whose seven outputs are 1 MiB each (a view each, when zero-copy)."""
    rng = np.random.default_rng(5)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return dict(
        seq_len_max=np.int64(steps),
        x=r(steps, batch, units),
        cs_prev=r(batch, units),
        h_prev=r(batch, units),
        w=r(2 * units, 4 * units) * 0.05,
        wci=r(units),
        wcf=r(units),
        wco=r(units),
        b=r(4 * units),
    )


def test_op_outputs_come_back_as_views_of_one_region(shm_client, wire_client):
    args = lstm_args()
    by_shm = shm_client.raw_ops.BlockLSTMV2(**args, use_peephole=True)
    by_wire = wire_client.raw_ops.BlockLSTMV2(**args, use_peephole=True)
    names = {pinned_region(a) for a in by_shm}
    assert len(names) == 1 and names <= set(shm_client._shm.pool._pinned)
    for a, b in zip(by_shm, by_wire):
        assert a.flags.writeable and same_bits(a, b)
    assert not shm_client._shm.pool._open_pins  # only the arrays hold the region


def test_the_output_region_returns_when_the_last_output_goes(shm_client):
    args = lstm_args()
    outs = list(shm_client.raw_ops.BlockLSTMV2(**args, use_peephole=True))
    h = outs[-1].copy()
    name = pinned_region(outs[-1])
    kept = outs.pop()  # one output of seven keeps the whole region
    del outs
    gc.collect()
    assert name in shm_client._shm.pool._pinned
    again = shm_client.raw_ops.BlockLSTMV2(**args, use_peephole=True)
    assert pinned_region(again[-1]) != name  # the call had another region
    assert same_bits(kept, h) and same_bits(again[-1], h)
    del kept, again
    gc.collect()
    shm_client.raw_ops.StopGradient(input=np.ones(3))  # the pool takes returns back
    assert name not in shm_client._shm.pool._pinned
    assert name in {r.name for r in shm_client._shm.pool._free}


def test_writing_into_op_outputs_changes_no_later_call(shm_client):
    args = lstm_args()
    first = shm_client.raw_ops.BlockLSTMV2(**args, use_peephole=True)
    want = [a.copy() for a in first]
    for a in first:
        a[...] = np.nan
    second = shm_client.raw_ops.BlockLSTMV2(**args, use_peephole=True)
    assert all(same_bits(a, b) for a, b in zip(second, want))
    assert all(np.isnan(a).all() for a in first)  # still the caller's own memory


def test_small_op_outputs_are_copies(shm_client):
    value = np.arange(1 << 16, dtype=np.float32)  # 256 KiB: under the zero-copy floor
    got = shm_client.raw_ops.StopGradient(input=value)
    assert not isinstance(memory_owner(got), _shm.Pinned) and same_bits(got, value)
    assert not shm_client._shm.pool._pinned


def test_op_outputs_past_the_pinned_share_are_copies_and_correct(shm_client):
    args = lstm_args()
    want = shm_client.raw_ops.BlockLSTMV2(**args, use_peephole=True)
    want = [a.copy() for a in want]
    gc.collect()
    kept = [
        shm_client.raw_ops.BlockLSTMV2(**args, use_peephole=True)
        for _ in range(_shm.MAX_PINNED_REGIONS + 2)
    ]
    held = [isinstance(memory_owner(outs[0]), _shm.Pinned) for outs in kept]
    assert held == [True] * _shm.MAX_PINNED_REGIONS + [False, False]
    for outs in kept:
        assert all(same_bits(a, b) for a, b in zip(outs, want))


def test_op_outputs_survive_the_client(target):
    args = lstm_args()
    c = gradserve.Client(target, shared_memory=True)
    outs = c.raw_ops.BlockLSTMV2(**args, use_peephole=True)
    want = [a.copy() for a in outs]
    name = pinned_region(outs[0])
    c.close()
    assert mapped(name) and all(same_bits(a, b) for a, b in zip(outs, want))
    del outs
    gc.collect()
    assert not mapped(name)


def test_small_outputs_beside_large_ones_are_copies(shm_client):
    """A kept bias gradient (4 KiB) holds no region: only large outputs are views."""
    args = lstm_args()
    acts = shm_client.raw_ops.BlockLSTMV2(**args, use_peephole=True, keep=True)
    grad = np.ones((32, 32, 256), np.float32)
    grads = shm_client.raw_ops.BlockLSTMGradV2(*args.values(), *acts, grad, grad, use_peephole=True)
    assert isinstance(memory_owner(grads.x_grad), _shm.Pinned)
    for small in (grads.b_grad, grads.wci_grad, grads.cs_prev_grad):
        assert not isinstance(memory_owner(small), _shm.Pinned)
    b_grad = grads.b_grad
    del grads
    gc.collect()
    shm_client.raw_ops.StopGradient(input=np.ones(3))  # the pool takes returns back
    assert not shm_client._shm.pool._pinned and b_grad.shape == (1024,)


def test_an_lstm_call_leases_a_region_for_its_outputs_up_front(target, wire_client):
    """The LSTM ops' output sizes follow from their inputs: even the first call of a
    shape finds its outputs in its region (views), not on the wire."""
    args = lstm_args(steps=48)  # 1.5 MiB per output: past any region made before
    with gradserve.Client(target, shared_memory=True) as c:
        outs = c.raw_ops.BlockLSTMV2(**args, use_peephole=True)
        assert len({pinned_region(a) for a in outs}) == 1
        grad = np.ones((48, 32, 256), np.float32)
        grads = c.raw_ops.BlockLSTMGradV2(*args.values(), *outs, grad, grad, use_peephole=True)
        assert isinstance(memory_owner(grads.x_grad), _shm.Pinned)
        want = wire_client.raw_ops.BlockLSTMGradV2(
            *args.values(), *outs, grad, grad, use_peephole=True
        )
        assert all(same_bits(a, b) for a, b in zip(grads, want))


def test_a_batch_copies_an_earlier_requests_output_once_however_many_steps_name_it(
    shm_client,
):
    # A resident input, its copy (one request), then eight steps under a tape (the
    # next request) naming that copy: it goes into shared memory once, where it went
    # once per step, all eight held until the batch ended (a review helper).
    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    ref = shm_client.put(x)
    copies = []
    encode = shm_client._shm.encode_input

    def counting(array, msg, temps):
        placed = encode(array, msg, temps)
        copies.extend([array.nbytes] if placed else [])
        return placed

    shm_client._shm.encode_input = counting
    batch = shm_client.batch()
    copy = batch.raw_ops.StopGradient(ref)
    with shm_client.gradient_tape():  # other tapes: another request
        for _ in range(8):
            batch.raw_ops.StopGradient(copy)
    got = batch.run()
    assert copies == [x.nbytes]
    assert all(np.array_equal(value, x) for value in got)
