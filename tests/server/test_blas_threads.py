"""The server process's BLAS threads sleep soon after an op (``entry.BLAS_THREAD_TIMEOUT``).

OpenBLAS's worker threads spin about 0.1 s after each BLAS call by default; a server
that let them burnt a core's time for that long after every LSTM op, CPU that a
container's quota counts. The server's entry point sets a short
timeout unless the operator set one. Checked on the real process: the CPU time it
uses while idle after an op, with its default and with a long timeout the operator set
(the control, which also shows that an operator's value is kept).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import gradserve
from gradserve.server.transport import entry
from tests.server_process import ServerProcess


def test_default_set_unless_the_operator_set_one():
    environ: dict[str, str] = {}
    entry.quiet_idle_blas_threads(environ)
    assert environ == {"OPENBLAS_THREAD_TIMEOUT": entry.BLAS_THREAD_TIMEOUT}
    environ = {"OPENBLAS_THREAD_TIMEOUT": "28"}
    entry.quiet_idle_blas_threads(environ)
    assert environ == {"OPENBLAS_THREAD_TIMEOUT": "28"}


def test_entry_sets_it_before_the_cli_loads_numpy():
    """The entry module loads no NumPy: OpenBLAS reads its environment as it loads."""
    code = "import sys, gradserve.server.transport.entry; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_console_script_enters_there():
    """``gradserve`` (the Docker image's command) runs ``entry.main``, not the CLI's."""
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="gradserve")
    assert script.value == "gradserve.server.transport.entry:main"


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_cpu_after_ops(monkeypatch, timeout: str | None) -> list[float]:
    """Seconds of CPU the server used in the 0.3 s after each of 3 LSTM forwards
    (outputs kept: nothing crosses the wire after the reply), each."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    if timeout is None:
        monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", timeout)
    server = ServerProcess()
    rng = np.random.default_rng(0)
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    steps, batch, units = 20, 32, 256  # GEMMs large enough for OpenBLAS to thread
    args = [np.int64(steps), r(steps, batch, units), r(batch, units), r(batch, units)]
    args += [r(2 * units, 4 * units), r(units), r(units), r(units), r(4 * units)]
    used = []
    try:
        with gradserve.Client(server.target, shared_memory=False) as client:
            refs = [client.put(a) for a in args]
            for _ in range(3):
                outputs = client.raw_ops.BlockLSTMV2(*refs, use_peephole=True, keep=True)
                before = _cpu_seconds(server.proc.pid)
                time.sleep(0.3)
                used.append(_cpu_seconds(server.proc.pid) - before)
                client.delete(*outputs)
    finally:
        server.stop()
    return used


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs /proc and two CPUs (OpenBLAS runs one thread on one)",
)
def test_blas_threads_sleep_soon_after_an_op(monkeypatch):
    # The control: an operator's value, kept. 30 spins about 0.36 s, through the whole
    # window (OpenBLAS's default, 28, spins about 0.1 s: too close to a loaded
    # machine's noise).
    # Of three windows each, the most for the control and the least for the default:
    # a loaded machine takes CPU from a spinning thread (it yields) and adds its own.
    spinning = max(_idle_cpu_after_ops(monkeypatch, "30"))
    assert spinning > 0.05, f"the control did not spin ({spinning * 1e3:.0f} ms of CPU)"
    quiet = min(_idle_cpu_after_ops(monkeypatch, None))
    assert quiet < 0.03, f"{quiet * 1e3:.0f} ms of CPU while idle"


class _Blas:
    """A BLAS thread count, as ``blas_threads.BLAS`` reports one."""

    def __init__(self, threads):
        self.threads = threads

    def count(self):
        return self.threads


@pytest.mark.parametrize(
    ("cores", "threads", "share", "device", "slots"),
    [
        (4, 4, False, "cpu", 1),  # every op on all 4 threads: one at a time
        (4, 2, False, "cpu", 2),
        (4, 1, False, "cpu", 4),
        (4, None, False, "cpu", 4),  # no BLAS found: a slot per core
        (3, 2, False, "cpu", 1),
        (4, 4, True, "cpu", 4),  # the ops divide the threads
        (4, 4, False, "cuda", 4),
    ],
)
def test_compute_slots_by_default_hold_the_cores(monkeypatch, cores, threads, share, device, slots):
    """Slots times BLAS threads stays within the cores: more oversubscribed them
    (README, "BLAS threads")."""
    from gradserve.kernels import blas_threads
    from gradserve.server import ServerConfig

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(blas_threads, "BLAS", _Blas(threads))
    assert ServerConfig(share_blas_threads=share).slots(device) == slots
    assert ServerConfig(compute_slots=3, share_blas_threads=share).slots(device) == 3


def test_compute_slots_flag():
    from gradserve.server.transport.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).compute_slots is None
    assert parse(["serve", "--compute-slots", "auto"]).compute_slots is None
    assert parse(["serve", "--compute-slots", "3"]).compute_slots == 3
    assert parse(["serve", "--share-blas-threads", "on"]).share_blas_threads is True
