"""The server process's entry point (``gradserve`` and ``python -m gradserve.server``).

It sets what must be set before NumPy loads its BLAS, then runs the CLI. Importing
``cli`` loads NumPy (through ``config``), so nothing here may import it first.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: OpenBLAS's worker threads spin for 2**N CPU cycles after each BLAS call before
#: they sleep (``OPENBLAS_THREAD_TIMEOUT``, 4-30). OpenBLAS's default, 28, is about
#: 0.1 s: after every LSTM op each worker thread burnt a core's time for that long,
#: CPU that a container's quota counts. 20 is about 0.35 ms, longer than the
#: elementwise work between two steps' GEMMs, so the threads still spin through an op
#: and sleep soon after it (README, "BLAS threads").
BLAS_THREAD_TIMEOUT = "20"


def quiet_idle_blas_threads(environ: MutableMapping[str, str]) -> None:
    """``OPENBLAS_THREAD_TIMEOUT`` for this process, unless the operator set one."""
    environ.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)


def main(argv: list[str] | None = None) -> int:
    quiet_idle_blas_threads(os.environ)
    from gradserve.server.transport.cli import main as cli_main

    return cli_main(argv)
