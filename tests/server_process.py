"""A gradserve server in its own process (``python -m gradserve.server``), for fault
tests and benchmarks: its address, its metrics, SIGTERM."""

from __future__ import annotations

import collections
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request


class ServerProcess:
    """``python -m gradserve.server serve --port 0 --device cpu --metrics-port 0 *flags``:
    this interpreter's, or (benchmarks comparing checkouts) ``python`` run in ``cwd``
    with ``env``."""

    def __init__(
        self,
        *flags: str,
        python: str = sys.executable,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        command = [python, "-m", "gradserve.server", "serve", "--port", "0"]
        command += ["--device", "cpu", "--metrics-port", "0", *flags]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env
        )
        # Log lines may come first (a restore from --state-dir): read up to "listening".
        pattern = re.compile(r"listening on 127\.0\.0\.1:(\d+).*metrics on :(\d+)")
        self.log_head: list[str] = []
        while (line := self.proc.stdout.readline()) and not pattern.search(line):
            self.log_head.append(line)
        self.first_line = line
        match = pattern.search(line)
        if not match:  # never leave a server behind
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("".join(self.log_head) + line)
        self.target = f"127.0.0.1:{match.group(1)}"
        self.metrics_port = int(match.group(2))
        #: The last lines it logged, for a failure's message (``wait``).
        self.log_tail: collections.deque[str] = collections.deque(maxlen=400)
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            self.log_tail.append(line)

    def wait(self, timeout: float) -> int:
        """Its exit code, once it exits within ``timeout`` seconds. Else it is made to
        dump its threads' stacks (SIGABRT: the server enables ``faulthandler``) and
        killed, and the AssertionError carries the end of its log."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            time.sleep(0.5)  # (the reader takes in the dump)
            log = "".join(self.log_tail)
            raise AssertionError(f"not exited within {timeout}s; its log ends:\n{log}") from None

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
            text = r.read().decode()
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    def wait_for(self, name: str, want: float, timeout: float = 10.0) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = self.metric(name)
            if got == want:
                return got
            time.sleep(0.1)
        return self.metric(name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(30)


def stop_process(proc: subprocess.Popen, sig: int, timeout: float) -> int:
    """Send ``sig`` and return the exit code; a process that has not exited within
    ``timeout`` seconds is killed (and the wait raises): a test never leaves a server
    behind."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
