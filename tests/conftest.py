"""Shared fixtures: a real gradserve server on loopback and clients of it."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

import gradserve
from gradserve.errors import DeadlineExceededError
from gradserve.server import run_server

# Property tests draw the same examples on every run (derandomized): a CI failure
# reproduces, and no run passes by luck. `--hypothesis-profile explore` draws afresh.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("ci")

#: The device the test server computes on; `make gpu-check` sets it to "cuda".
DEVICE = os.environ.get("GRADSERVE_TEST_DEVICE", "cpu")
#: `make gpu-check` also runs the served LSTM tests with CUDA graphs on ("1").
CUDA_GRAPHS = os.environ.get("GRADSERVE_TEST_CUDA_GRAPHS", "0") == "1"


class DeadlineOnCall:
    """A long op's ``check`` callback that counts its calls and raises
    DeadlineExceededError on call ``n``, as a deadline passing mid-op would."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.n:
            raise DeadlineExceededError("deadline exceeded")


@pytest.fixture(scope="session")
def server():
    """One in-process server on a free loopback port for the whole test run."""
    with run_server(
        host="127.0.0.1",
        port=0,
        device=DEVICE,
        cuda_graphs=CUDA_GRAPHS,
        max_tensor_bytes=1 << 30,
    ) as s:
        assert s.device == DEVICE
        yield s


@pytest.fixture(scope="session")
def target(server) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture
def client(target):
    """A client with its own fresh session, closed after the test."""
    with gradserve.Client(target, timeout=120) as c:
        yield c
