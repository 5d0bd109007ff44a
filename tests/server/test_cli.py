"""The real process: CLI flags, 'listening on', health, reflection, SIGTERM exit 0."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import gradserve
from gradserve.server import run_server
from gradserve.server.transport.cli import build_parser
from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def process():
    server = ServerProcess("--grace", "2")
    assert server.first_line.startswith(f"listening on {server.target}")
    yield server
    if server.proc.poll() is None:
        server.proc.kill()


def test_health_serving(process):
    target = process.target
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "gradserve.v1.GradServe"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_health_subcommand(process):
    target = process.target
    port = target.rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "gradserve.server", "health", "--port", port],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and "SERVING" in done.stdout


def test_reflection_lists_services(process):
    target = process.target
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(stub.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {"gradserve.v1.GradServe", "grpc.health.v1.Health"} <= names


def test_op_through_sdk(process):
    target = process.target
    with gradserve.Client(target) as client:
        np.testing.assert_array_equal(client.stop_gradient(np.eye(2)), np.eye(2))


def test_sigterm_exits_zero(process):
    process.proc.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0


def test_a_second_server_on_a_taken_port_fails_to_start():
    """gRPC's default SO_REUSEPORT let it start and share the port: the kernel split
    connections between the two servers, and a session's calls met the one that does
    not hold it (SessionLostError: a review helper)."""
    first = ServerProcess()
    try:
        port = first.target.rsplit(":", 1)[1]
        proc = subprocess.run(
            [sys.executable, "-m", "gradserve.server", "serve", "--port", port, "--device", "cpu"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode != 0 and f"127.0.0.1:{port}" in proc.stderr, proc.stderr
        assert "listening" not in proc.stdout
        assert first.proc.poll() is None
    finally:
        first.stop()


def test_help_says_which_limits_take_none():
    """The README said every limit takes none; --max-message-bytes, --session-ttl and
    others refuse it (a review helper). --help marks those that take it."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    marked = {a.dest for a in serve._actions if a.help and "none: unlimited" in a.help}
    assert {"max_sessions", "max_tensor_bytes", "max_server_bytes", "max_streams"} <= marked
    assert not marked & {"max_message_bytes", "session_ttl", "host_cache_bytes"}
    assert not marked & {"metrics_port", "state_dir", "stream_min_rate"}  # none: off
    for dest in marked:
        flag = f"--{dest.replace('_', '-')}"
        assert getattr(build_parser().parse_args(["serve", flag, "none"]), dest) is None


def test_cuda_without_gpu_fails_fast():
    if gradserve.kernels.device.cuda_unavailable_reason() is None:
        pytest.skip("a GPU is present")
    proc = subprocess.run(
        [sys.executable, "-m", "gradserve.server", "--port", "0", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "--device cuda" in proc.stderr


def test_cuda_graphs_flag_is_on_or_off():
    parser = build_parser()
    assert parser.parse_args(["serve"]).cuda_graphs is False
    assert parser.parse_args(["serve", "--cuda-graphs", "on"]).cuda_graphs is True
    assert parser.parse_args(["serve", "--cuda-graphs", "off"]).cuda_graphs is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--cuda-graphs", "maybe"])


def test_cuda_graphs_on_a_cpu_server_warn_and_run_eagerly(caplog):
    with caplog.at_level(logging.WARNING), run_server(device="cpu", cuda_graphs=True) as server:
        with gradserve.Client(f"127.0.0.1:{server.port}") as client:
            x = np.ones((2, 1, 1), np.float32)
            s = np.zeros((1, 1), np.float32)
            out = client.raw_ops.BlockLSTMV2(
                np.int64(2),
                x,
                s,
                s,
                np.ones((2, 4), np.float32),
                *[np.zeros(1, np.float32)] * 3,
                np.zeros(4, np.float32),
            )
            assert out.h.shape == (2, 1, 1)
    assert "--cuda-graphs on has no effect on device cpu" in caplog.text
