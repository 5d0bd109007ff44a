"""A CUDA server keeps LSTM outputs on the GPU: what crosses between host and device.

Runs the real server on ``--device cuda`` against the stand-in cupy (device
arrays in host memory, kernels from the host shim, every host<->device copy
counted), so CI shows that a forward kept in the session and a backward that
names its activations by id copy only the inputs sent inline to the GPU and only
the results sent inline back.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import gradserve
from gradserve.errors import InvalidArgumentError
from gradserve.kernels import backend_numpy
from gradserve.server import run_server
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
from tests.kernels import fake_cupy, lstm_cases, shim_backend
from tests.kernels.lstm_cases import GRADS, INPUTS, OUTPUT_GRADS, OUTPUTS, random_case


@pytest.fixture(scope="module")
def cuda_server(tmp_path_factory):
    lib = shim_backend.build(tmp_path_factory.mktemp("shim"))
    with fake_cupy.installed(lib) as fake, run_server(device="cuda") as server:
        assert server.device == "cuda"
        yield server, fake


@pytest.fixture
def cuda_client(cuda_server):
    server, fake = cuda_server
    with gradserve.Client(f"127.0.0.1:{server.port}", timeout=60) as c:
        for copies in fake.transfers.values():
            copies.clear()
        yield c, server, fake


CASE = random_case(
    np.random.default_rng(11), steps=5, batch=3, inputs=4, units=6, dtype=np.float32, scale=0.5
)
ARGS = [CASE["seq_len_max"], *(CASE[k] for k in INPUTS)]


def shapes(copies) -> list[tuple[int, ...]]:
    return sorted(shape for shape, _ in copies)


def test_forward_kept_and_backward_by_id_copy_only_wire_tensors(cuda_client):
    client, server, fake = cuda_client
    want_out = lstm_cases.forward(
        backend_numpy, *(CASE[k] for k in INPUTS), seq_len_max=5, use_peephole=True
    )
    want_grads = lstm_cases.backward(
        backend_numpy,
        *(CASE[k] for k in INPUTS),
        *want_out,
        CASE["cs_grad"],
        CASE["h_grad"],
        seq_len_max=5,
        use_peephole=True,
    )

    kept = client.raw_ops.BlockLSTMV2(*ARGS, use_peephole=True, keep=True)
    session = server.store.get(client.session_id)
    assert all(isinstance(session.get(ref.id), fake_cupy.DeviceArray) for ref in kept)
    assert shapes(fake.transfers["to_device"]) == shapes((CASE[k].shape, 0) for k in INPUTS)
    assert fake.transfers["to_host"] == []  # the seven activations stayed on the GPU

    fake.transfers["to_device"].clear()
    grads = client.raw_ops.BlockLSTMGradV2(
        *ARGS, *kept, CASE["cs_grad"], CASE["h_grad"], use_peephole=True
    )
    inline = [CASE[k] for k in (*INPUTS, *OUTPUT_GRADS)]
    assert shapes(fake.transfers["to_device"]) == shapes((a.shape, 0) for a in inline)
    assert shapes(fake.transfers["to_host"]) == shapes((g.shape, 0) for g in want_grads)
    for k in GRADS:
        np.testing.assert_allclose(getattr(grads, k), getattr(want_grads, k), atol=1e-5)

    fake.transfers["to_host"].clear()
    np.testing.assert_allclose(kept.h.numpy(), want_out.h, atol=1e-6)  # GetTensor
    assert shapes(fake.transfers["to_host"]) == [want_out.h.shape]


def test_weights_put_once_are_copied_to_the_gpu_once(cuda_client):
    client, server, fake = cuda_client
    weights = {k: client.put(CASE[k]) for k in INPUTS if k != "x"}
    session = server.store.get(client.session_id)
    held = session.budget.used
    assert fake.transfers["to_device"] == []  # PutTensor itself keeps host memory
    args = [CASE["seq_len_max"], CASE["x"], *(weights[k] for k in INPUTS if k != "x")]

    kept = client.raw_ops.BlockLSTMV2(*args, use_peephole=True, keep=True)
    grads = client.raw_ops.BlockLSTMGradV2(
        *args, *kept, CASE["cs_grad"], CASE["h_grad"], use_peephole=True
    )
    copied = shapes(fake.transfers["to_device"])
    # Each weight once (at the forward); x and the output gradients each time they are sent.
    want = [CASE[k].shape for k in weights] + [CASE["x"].shape] * 2
    assert copied == sorted(want + [CASE["h_grad"].shape] * 2)
    assert all(isinstance(session.get(ref.id), fake_cupy.DeviceArray) for ref in weights.values())
    # Charged once (each tensor with its record)
    assert session.budget.used == held + sum(ref.nbytes + TENSOR_RECORD_BYTES for ref in kept)

    want_grads = lstm_cases.backward(
        backend_numpy,
        *(CASE[k] for k in INPUTS),
        *lstm_cases.forward(
            backend_numpy, *(CASE[k] for k in INPUTS), seq_len_max=5, use_peephole=True
        ),
        CASE["cs_grad"],
        CASE["h_grad"],
        seq_len_max=5,
        use_peephole=True,
    )
    for k in GRADS:
        np.testing.assert_allclose(getattr(grads, k), getattr(want_grads, k), atol=1e-5)
    np.testing.assert_array_equal(weights["w"].numpy(), CASE["w"])  # read back from the GPU
    for ref in (*weights.values(), *kept):
        ref.delete()
    assert session.budget.used == 0


def test_a_refused_input_by_id_stays_in_host_memory(cuda_client):
    client, server, fake = cuda_client
    wrong_w = client.put(CASE["w"][:-1])  # one row short
    args = [CASE["seq_len_max"], *(CASE[k] for k in INPUTS)]
    args[INPUTS.index("w") + 1] = wrong_w
    with pytest.raises(InvalidArgumentError, match="w.dim_size"):
        client.raw_ops.BlockLSTMV2(*args)
    session = server.store.get(client.session_id)
    assert not isinstance(session.get(wrong_w.id), fake_cupy.DeviceArray)
    assert fake.transfers["to_device"] == []  # validated before anything moved


def test_device_resident_tensor_feeds_host_ops(cuda_client):
    client, _, _ = cuda_client
    kept = client.raw_ops.BlockLSTMV2(*ARGS, keep=True)
    h = kept.h.numpy()
    ta = client.tensor_array(np.float32, size=1)
    ta.write(0, kept.h)  # a TensorArray element from a GPU-resident tensor
    np.testing.assert_array_equal(ta.read(0), h)
    same = client.raw_ops.StopGradient(input=kept.cs)
    np.testing.assert_array_equal(same, kept.cs.numpy())


def test_kept_outputs_are_charged_and_freed(cuda_client):
    client, server, _ = cuda_client
    kept = client.raw_ops.BlockLSTMV2(*ARGS, keep=True)
    session = server.store.get(client.session_id)
    nbytes = sum(ref.nbytes for ref in kept)
    assert nbytes == 7 * CASE["h_grad"].nbytes
    assert session.budget.used == nbytes + 7 * TENSOR_RECORD_BYTES
    for ref in kept:
        ref.delete()
    assert session.budget.used == 0
    assert session.budget.used == 0


def test_fake_cupy_is_gone_after_use(tmp_path):
    import gradserve.kernels as package

    before = sys.modules.get("cupy"), package.__dict__.get("backend_cuda")
    with fake_cupy.installed(shim_backend.build(tmp_path)) as fake:
        inside = sys.modules["gradserve.kernels.backend_cuda"]
        assert inside.cupy is fake
    assert (sys.modules.get("cupy"), package.__dict__.get("backend_cuda")) == before
    assert sys.modules.get("gradserve.kernels.backend_cuda") is not inside


def test_outputs_match_numpy_for_every_output(cuda_client):
    client, _, _ = cuda_client
    got = client.raw_ops.BlockLSTMV2(*ARGS, cell_clip=0.4)
    want = lstm_cases.forward(
        backend_numpy, *(CASE[k] for k in INPUTS), seq_len_max=5, cell_clip=0.4
    )
    for k in OUTPUTS:
        np.testing.assert_allclose(getattr(got, k), getattr(want, k), atol=1e-6)


def test_gpu_pool_metric_shows_kept_outputs_and_their_release(tmp_path):
    import gc
    import re
    import urllib.request

    def used(server) -> float:
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
            text = r.read().decode()
        return float(re.search(r'^gradserve_gpu_pool_bytes\{state="used"\} (\S+)$', text, re.M)[1])

    lib = shim_backend.build(tmp_path)
    with (
        fake_cupy.installed(lib),
        run_server(device="cuda", metrics_port=0) as server,
        gradserve.Client(f"127.0.0.1:{server.port}", timeout=60) as client,
    ):
        before = used(server)
        kept = client.raw_ops.BlockLSTMV2(*ARGS, keep=True)
        outputs = sum(ref.nbytes for ref in kept)
        gc.collect()
        assert used(server) - before >= outputs  # the seven outputs live in GPU memory
        client.delete(*kept)
        gc.collect()
        assert used(server) - before < outputs  # and are freed with their refs


def test_cuda_graphs_server_replays_right_results(tmp_path):
    """``--cuda-graphs on`` on the stand-in, whose stream capture records the work and
    whose graphs replay it: later calls of a shape are replays (no host copies inside a
    capture, or the capture would fail and the calls run eagerly), with the results of
    their own inputs."""
    import re
    import urllib.request

    def metric(server, name: str) -> float:
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
            return float(re.search(rf"^{name} (\S+)$", r.read().decode(), re.M)[1])

    lib = shim_backend.build(tmp_path)
    with (
        fake_cupy.installed(lib),
        run_server(device="cuda", cuda_graphs=True, metrics_port=0) as server,
        gradserve.Client(f"127.0.0.1:{server.port}", timeout=60) as client,
    ):
        for seed in (21, 22, 23):
            case = random_case(
                np.random.default_rng(seed), steps=5, batch=3, inputs=4, units=6,
                dtype=np.float32, scale=0.5,
            )  # fmt: skip
            args = [case["seq_len_max"], *(case[k] for k in INPUTS)]
            kept = client.raw_ops.BlockLSTMV2(*args, use_peephole=True, keep=True)
            grads = client.raw_ops.BlockLSTMGradV2(
                *args, *kept, case["cs_grad"], case["h_grad"], use_peephole=True
            )
            want = lstm_cases.forward(
                backend_numpy, *(case[k] for k in INPUTS), seq_len_max=5, use_peephole=True
            )
            want_grads = lstm_cases.backward(
                backend_numpy, *(case[k] for k in INPUTS), *want, case["cs_grad"],
                case["h_grad"], seq_len_max=5, use_peephole=True,
            )  # fmt: skip
            for k in OUTPUTS:
                np.testing.assert_allclose(getattr(kept, k).numpy(), getattr(want, k), atol=1e-5)
            for k in GRADS:
                np.testing.assert_allclose(getattr(grads, k), getattr(want_grads, k), atol=1e-5)
            client.delete(*kept)
        assert metric(server, "gradserve_cuda_graph_captures_total") == 2  # forward, backward
        assert metric(server, "gradserve_cuda_graph_replays_total") == 4
