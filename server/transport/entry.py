"""The server process's entry point (``gradserve`` and ``python -m gradserve.server``).

It sets what must be set before NumPy loads its BLAS and before gRPC's core starts,
then runs the CLI. Importing
``cli`` loads NumPy (through ``config``), so nothing here may import it first.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import MutableMapping

#: OpenBLAS's worker threads spin for 2**N CPU cycles after each BLAS call before
#: they sleep (``OPENBLAS_THREAD_TIMEOUT``, 4-30). OpenBLAS's default, 28, is about
#: 0.1 s: after every LSTM op each worker thread burnt a core's time for that long,
#: CPU that a container's quota counts. 20 is about 0.35 ms, longer than the
#: elementwise work between two steps' GEMMs, so the threads still spin through an op
#: and sleep soon after it (README, "BLAS threads").
BLAS_THREAD_TIMEOUT = "20"


#: gRPC's C core writes its own log lines to stderr, from its own threads, past our
#: log writer (``log_writer``). Left to its default (grpcio 1.85 logs at INFO), it
#: wrote a line of about 210 bytes for every failed TLS handshake: anyone who could
#: connect wrote to our stderr, and once a pipe nobody read was full (about 300
#: handshakes), the core's thread blocked in that write, new connections hung and
#: SIGTERM never ended the process. ERROR keeps the core's real failures.
GRPC_CORE_VERBOSITY = "ERROR"


def quiet_idle_blas_threads(environ: MutableMapping[str, str]) -> None:
    """``OPENBLAS_THREAD_TIMEOUT`` for this process, unless the operator set one."""
    environ.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)


def quiet_grpc_core(environ: MutableMapping[str, str]) -> None:
    """``GRPC_VERBOSITY`` for this process, unless the operator set one (read when
    gRPC's core starts: before the first server or channel). Set but empty counts as
    not set, as gRPC reads it (its default)."""
    if not environ.get("GRPC_VERBOSITY"):
        environ["GRPC_VERBOSITY"] = GRPC_CORE_VERBOSITY


def main(argv: list[str] | None = None) -> int:
    # A fatal signal (SIGSEGV in a native library, SIGABRT from an operator or a test
    # whose server would not exit) writes every thread's Python stack to stderr.
    faulthandler.enable()
    quiet_idle_blas_threads(os.environ)
    quiet_grpc_core(os.environ)
    from gradserve.server.transport.cli import main as cli_main

    return cli_main(argv)
