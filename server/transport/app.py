"""Wiring of the gRPC server: servicer, auth, TLS, health, reflection, metrics, shutdown.

``run_server`` is a context manager (tests and embedding): it yields the
running ``Server`` with its bound port and stops it on exit. ``serve`` runs
until SIGTERM/SIGINT, then turns health to NOT_SERVING, refuses new sessions,
lets in-flight RPCs finish within the grace period, and returns (exit code 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import signal
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gradserve.kernels.compute import compute_for
from gradserve.kernels.device import select_device
from gradserve.server.core.sessions import SessionStore
from gradserve.server.transport.admission import ComputeGate
from gradserve.server.transport.auth import AuthInterceptor, TokenTable, is_loopback
from gradserve.server.transport.config import ServerConfig
from gradserve.server.transport.observability import Metrics, Observer
from gradserve.server.transport.servicer import GradServeServicer
from gradserve.v1 import service_pb2, service_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["GradServe"].full_name


class ConfigError(ValueError):
    """Settings that cannot start a server (e.g. no auth on a public address)."""


@dataclasses.dataclass
class Server:
    """A started server and what tests need to reach into."""

    grpc_server: grpc.Server
    port: int
    store: SessionStore
    health: health.HealthServicer
    device: str
    config: ServerConfig
    metrics: Metrics | None = None
    metrics_port: int | None = None
    stopped: threading.Event = dataclasses.field(default_factory=threading.Event)

    def stop(self, grace: float | None = None) -> None:
        """Health to NOT_SERVING and no new sessions, then stop accepting; in-flight
        RPCs get ``grace`` seconds; then every session is freed."""
        self.stopped.set()
        self.store.draining = True
        self.health.enter_graceful_shutdown()
        self.grpc_server.stop(self.config.grace if grace is None else grace).wait()
        self.store.close_all()


def _store(config: ServerConfig) -> SessionStore:
    return SessionStore(
        idle_timeout=config.session_ttl,
        max_tensor_bytes=config.max_tensor_bytes,
        max_tensor_array_size=config.max_tensor_array_size,
        max_sessions=config.max_sessions,
        max_sessions_per_principal=config.max_sessions_per_principal,
        max_session_bytes=config.max_session_bytes,
        max_server_bytes=config.max_server_bytes,
    )


def _compute(config: ServerConfig, device: str):
    if config.cuda_graphs and device != "cuda":
        log.warning("--cuda-graphs on has no effect on device %s: the LSTM runs eagerly", device)
    return compute_for(
        device,
        cuda_graphs=config.cuda_graphs and device == "cuda",
        graph_cache_bytes=config.cuda_graph_cache_bytes,
    )


def _interceptors(config: ServerConfig, observer: Observer) -> list[grpc.ServerInterceptor]:
    if config.token_file:
        return [AuthInterceptor(TokenTable.from_file(config.token_file), observer)]
    if not is_loopback(config.host):
        raise ConfigError(
            f"refusing to serve {config.host} without authentication: pass --token-file "
            "(authentication is off only on a loopback address)"
        )
    return []


def _credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not (config.tls_cert or config.tls_key):
        if config.tls_client_ca:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (config.tls_cert and config.tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    key = pathlib.Path(config.tls_key).read_bytes()
    cert = pathlib.Path(config.tls_cert).read_bytes()
    client_ca = pathlib.Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def start(config: ServerConfig) -> Server:
    """Build, bind and start a server for ``config``; raises if it cannot."""
    credentials = _credentials(config)
    device = select_device(config.device)
    store = _store(config)
    compute = _compute(config, device)
    metrics = Metrics(store, compute) if config.metrics_port is not None else None
    observer = Observer(metrics)
    interceptors = _interceptors(config, observer)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="gradserve"),
        interceptors=interceptors,
        options=config.grpc_options(),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    servicer = GradServeServicer(
        store,
        compute=compute,
        observer=observer,
        compute_gate=ComputeGate(config.compute_slots, config.max_queued_compute),
        max_message_bytes=config.max_message_bytes,
    )
    service_pb2_grpc.add_GradServeServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{config.host}:{config.port}"
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind {address}")
    metrics_port = None
    if metrics is not None:
        from prometheus_client import start_http_server

        assert config.metrics_port is not None  # metrics exist only with a port
        http, _ = start_http_server(
            config.metrics_port, addr=config.host, registry=metrics.registry
        )
        metrics_port = http.server_port
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = Server(server, port, store, health_servicer, device, config, metrics, metrics_port)
    _start_reaper(running)
    return running


def _start_reaper(server: Server) -> None:
    """Close idle sessions every few seconds until the server stops."""
    period = max(0.05, min(30.0, server.config.session_ttl / 4))

    def reap() -> None:
        while not server.stopped.wait(period):
            expired = server.store.expire_idle()
            if expired:
                log.info("closed %d idle session(s)", expired)

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
    extra = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
    print(f"listening on {config.host}:{server.port} (device: {server.device}{extra})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    stop.wait()
    log.info("shutting down: health NOT_SERVING, no new sessions, %.1fs grace", config.grace)
    server.stop()
    return 0
