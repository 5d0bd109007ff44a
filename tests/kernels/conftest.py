"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from gradserve.kernels import lstm_cpu, native
from tests.kernels.lstm_cases import require_native


@pytest.fixture
def step_kernel(request):
    """Run the test's forwards and backwards with the elementwise pass of the parameter
    (a ``native.Mode``; ``test_lstm_cpu_native.py`` checks that the compiled step runs
    when asked for)."""
    mode = request.param
    if mode is native.Mode.NATIVE:
        require_native()
    token = lstm_cpu.STEP_KERNEL.set(mode)
    yield mode
    lstm_cpu.STEP_KERNEL.reset(token)
