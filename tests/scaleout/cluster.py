"""Replicas as real processes (``python -m gradserve.server``), each with its own state
directory and a fixed port, so that a restart comes back where the proxy sends it."""

from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import threading
import urllib.request

from tests.scaleout.proxies import free_port
from tests.server_process import stop_process


class Replica:
    def __init__(self, name: str, workdir: pathlib.Path, *flags: str) -> None:
        self.name = name
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.state_dir = workdir / f"state-{name}"
        self.flags = flags
        self.proc: subprocess.Popen | None = None
        self.metrics_port = 0
        self.output: list[str] = []

    def start(self) -> Replica:
        command = [sys.executable, "-m", "gradserve.server", "serve", "--device", "cpu"]
        command += ["--port", str(self.port), "--replica-id", self.name, "--metrics-port", "0"]
        command += ["--state-dir", str(self.state_dir), "--workers", "4", "--grace", "5"]
        command += ["--max-sessions-per-principal", "none", "--max-sessions", "4096", *self.flags]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        while line := self.proc.stdout.readline():
            self.output.append(line)
            match = re.search(r"listening on .*metrics on :(\d+)", line)
            if match:
                self.metrics_port = int(match.group(1))
                break
        else:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"replica {self.name} did not start:\n{''.join(self.output)}")
        proc = self.proc
        threading.Thread(target=lambda: self.output.extend(proc.stdout), daemon=True).start()
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the replica and wait for it; returns its exit code. One that has not
        exited within a minute is killed (and the wait raises): a test never leaves a
        replica behind."""
        assert self.proc is not None
        return stop_process(self.proc, sig, 60)

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
            text = r.read().decode()
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(match.group(1)) if match else float("nan")

    def log(self) -> str:
        return "".join(self.output)
