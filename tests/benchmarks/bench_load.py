"""Load benchmark (``make bench``): 32 concurrent clients, mixed ops, against a server
in its own process; prints ops/s and p50/p99 latency, checks every result and that the
server holds no bytes once the sessions close."""

from __future__ import annotations

import argparse
import os

from tests.load import run_load
from tests.server_process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    server = ServerProcess()
    try:
        report = run_load(server.target, clients=args.clients, seconds=args.seconds)
        print(
            f"# gradserve load benchmark: {os.cpu_count()} CPUs, server and clients on one "
            "machine, loopback"
        )
        print("load:", report.summary())
        for e in report.errors[:5]:
            print("  error:", e)
        held = server.wait_for("gradserve_bytes_held", 0)
        sessions = server.wait_for("gradserve_sessions_open", 0)
        print(f"after the clients closed: {held:.0f} bytes held, {sessions:.0f} sessions open")
    finally:
        print(f"server exit code on SIGTERM: {server.stop()}")


if __name__ == "__main__":
    main()
