"""Server settings, one dataclass, filled from the command line or by tests."""

from __future__ import annotations

import dataclasses

from gradserve import protocol


@dataclasses.dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    #: Where the array math runs: "auto" (CUDA when usable), "cpu" or "cuda".
    device: str = "auto"
    #: Threads serving RPCs.
    workers: int = 16
    #: Ceiling of one unary message, each direction.
    max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES
    #: Largest single tensor the server will hold or build.
    max_tensor_bytes: int = 4 * 1024**3
    #: Idle sessions are closed after this many seconds.
    session_ttl: float = 3600.0
    #: Seconds in-flight RPCs get to finish on SIGTERM/SIGINT.
    grace: float = 10.0
