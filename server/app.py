"""Wiring of the gRPC server: servicer, health, reflection, shutdown.

``run_server`` is a context manager (tests and embedding): it yields the
running ``Server`` with its bound port and stops it on exit. ``serve`` runs
until SIGTERM/SIGINT, then turns health to NOT_SERVING, lets in-flight RPCs
finish within the grace period, and returns (exit code 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gradserve import protocol
from gradserve.kernels import select_device
from gradserve.kernels.backends import get_backend
from gradserve.server.config import ServerConfig
from gradserve.server.servicer import GradServeServicer
from gradserve.server.sessions import SessionStore
from gradserve.v1 import service_pb2, service_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["GradServe"].full_name


@dataclasses.dataclass
class Server:
    """A started server and what tests need to reach into."""

    grpc_server: grpc.Server
    port: int
    store: SessionStore
    health: health.HealthServicer
    device: str
    config: ServerConfig
    stopped: threading.Event = dataclasses.field(default_factory=threading.Event)

    def stop(self, grace: float | None = None) -> None:
        """Health to NOT_SERVING, then stop accepting; in-flight RPCs get ``grace`` s."""
        self.stopped.set()
        self.health.enter_graceful_shutdown()
        self.grpc_server.stop(self.config.grace if grace is None else grace).wait()
        self.store.close_all()


def start(config: ServerConfig) -> Server:
    """Build, bind and start a server for ``config``; raises if the port is taken."""
    device = select_device(config.device)
    store = SessionStore(idle_timeout=config.session_ttl, max_tensor_bytes=config.max_tensor_bytes)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="gradserve"),
        options=protocol.channel_options(config.max_message_bytes),
    )
    service_pb2_grpc.add_GradServeServicer_to_server(
        GradServeServicer(
            store, backend=get_backend(device), max_message_bytes=config.max_message_bytes
        ),
        server,
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = Server(server, port, store, health_servicer, device, config)
    _start_reaper(running)
    return running


def _start_reaper(server: Server) -> None:
    """Close idle sessions every few seconds until the server stops."""
    period = max(0.05, min(30.0, server.config.session_ttl / 4))

    def reap() -> None:
        while not server.stopped.wait(period):
            server.store.expire_idle()

    threading.Thread(target=reap, name="gradserve-reaper", daemon=True).start()


@contextlib.contextmanager
def run_server(config: ServerConfig | None = None, **overrides) -> Iterator[Server]:
    """Start a server (``port=0`` by default: any free port) and stop it on exit."""
    config = dataclasses.replace(config or ServerConfig(port=0), **overrides)
    server = start(config)
    try:
        yield server
    finally:
        server.stop(grace=0)


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit code (0)."""
    server = start(config)
    print(f"listening on {config.host}:{server.port} (device: {server.device})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    stop.wait()
    log.info("shutting down: health NOT_SERVING, %.1fs grace", config.grace)
    server.stop()
    return 0
