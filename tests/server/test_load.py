"""32 concurrent clients, mixed ops, bounded time: no unexpected error, every result
exact, and the server holds nothing once the sessions close."""

from __future__ import annotations

import time

from gradserve.server import run_server
from tests.load import run_load


def test_mixed_load():
    with run_server(device="cpu") as server:
        _check_load(server)


def _check_load(server):
    report = run_load(f"127.0.0.1:{server.port}", clients=32, seconds=4.0)
    print("\nload:", report.summary())
    assert report.errors == []
    assert report.ops > 32
    for _ in range(50):  # sessions close as the clients exit
        if len(server.store) == 0:
            break
        time.sleep(0.1)
    assert server.store.budget.used == 0
