"""Wiring of the gRPC server: servicer, TLS, health, reflection, metrics, shutdown.

The server is ``grpc.aio`` on an event loop of its own thread: a call waiting on
a slow client, a compute slot or the network costs a suspended coroutine, not a
thread; blocking work runs on the servicer's bounded lanes. The GradServe
service's handlers are built from its descriptor with lenient deserializers, so
a request that does not parse is INVALID_ARGUMENT (``boundary.Unparsed``)
rather than a logged traceback. Health and reflection are registered beside it
and pass through no lane and no admission limit.

``run_server`` is a context manager (tests and embedding): it yields the running
``Server`` with its bound port and stops it on exit. ``serve`` runs until
SIGTERM/SIGINT, then drains: health NOT_SERVING, every new call refused with
UNAVAILABLE, idle streams ended with UNAVAILABLE, calls in flight get ``--grace``
seconds to finish (only one still running then is cancelled), and returns (exit
code 0).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import faulthandler
import functools
import logging
import os
import pathlib
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gradserve import codec, heap
from gradserve.errors import InvalidArgumentError
from gradserve.kernels.compute import Compute, compute_for
from gradserve.kernels.device import select_device
from gradserve.kernels.native import NativeBuildError
from gradserve.server.core import persistence
from gradserve.server.core.sessions import SessionStore
from gradserve.server.transport import boundary
from gradserve.server.transport.admission import Admission
from gradserve.server.transport.auth import TokenTable, is_loopback
from gradserve.server.transport.config import CPU_STEP_KERNELS, LSTM_FORMULATIONS, ServerConfig
from gradserve.server.transport.lanes import Lane
from gradserve.server.transport.memory import Trimmer
from gradserve.server.transport.observability import Metrics, Observer
from gradserve.server.transport.replicas import StateKeeper, register_metrics
from gradserve.server.transport.servicer import GradServeServicer
from gradserve.server.transport.streams import StreamLimits

log = logging.getLogger(__name__)

SERVICE = boundary.SERVICE
SERVICE_NAME = SERVICE.full_name


#: The interpreter's thread switch interval while serving (Python's default: 5 ms).
SWITCH_INTERVAL_SECONDS = 0.001

#: How long past ``--grace`` a stop waits for the drain and gRPC's own shutdown
#: (which cancels what is left once the grace has passed) before it goes on without
#: them: the sessions are saved (``--state-dir``) and freed, and the threads' stacks
#: logged, rather than the process hanging after SIGTERM until it is killed
#: (one clean-clone CI run saw a server not exit within 30 s of SIGTERM, grace 2 s;
#: never reproduced).
STOP_SLACK_SECONDS = 5.0

#: How long past that a SIGTERMed server may take to save its sessions
#: (``--state-dir``) and free them before ``serve``'s watchdog ends the process (exit
#: code 1, every thread's stack on stderr): a thread stuck holding a session's lock
#: (a fault elsewhere) left the save or the freeing waiting for ever. Plus a second
#: for every ``SAVE_BYTES_PER_SECOND`` the sessions hold (a save ran at about 0.5
#: GiB/s here): a large server's last snapshot is not cut short.
STOP_SAVE_SECONDS = 120.0
SAVE_BYTES_PER_SECOND = 50 << 20

#: No watchdog past this (``--grace inf``: the operator waits as long as it takes).
WATCHDOG_MAX_SECONDS = 30 * 24 * 3600.0


class ConfigError(ValueError):
    """Settings that cannot start a server (e.g. no auth on a public address)."""


@dataclasses.dataclass
class Server:
    """A started server and what tests need to reach into."""

    port: int
    store: SessionStore
    device: str
    config: ServerConfig
    servicer: GradServeServicer
    metrics: Metrics | None = None
    metrics_port: int | None = None
    trimmer: Trimmer | None = None
    stopped: threading.Event = dataclasses.field(default_factory=threading.Event)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _grpc: Any = None
    _health: Any = None
    _reaper: Any = None
    keeper: StateKeeper | None = None
    _stop_snapshots: threading.Event = dataclasses.field(default_factory=threading.Event)

    def stop(self, grace: float | None = None) -> None:
        """Drain (new calls refused with UNAVAILABLE, health NOT_SERVING), give calls
        in flight ``grace`` seconds, stop, free every session."""
        if self.stopped.is_set() or self._loop is None:
            return
        self.stopped.set()
        grace = self.config.grace if grace is None else grace
        stopping = asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop)
        bound = grace + STOP_SLACK_SECONDS  # (--grace inf: none; a wait of inf raises)
        try:
            stopping.result(timeout=bound if bound < WATCHDOG_MAX_SECONDS else None)
        except concurrent.futures.TimeoutError:
            log.error(
                "the drain and gRPC's shutdown had not ended %.1fs past the %.1fs grace: "
                "going on without them. Threads:\n%s",
                STOP_SLACK_SECONDS,
                grace,
                thread_stacks(),
            )
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.servicer.light.shutdown()
        self.servicer.heavy.shutdown()
        self.servicer.replies.shutdown(wait=False)
        self._stop_snapshots.set()
        if self.keeper is not None and self.keeper.enabled:
            self.keeper.wait_for_adoption()  # the sessions it adopts are saved too
            try:
                self.keeper.snapshot(final=True)  # drained: each as its last call left it
            finally:
                self.keeper.release()
        self.store.close_all()

    async def _stop(self, grace: float) -> None:
        started = time.monotonic()
        self.store.draining = True
        await self._health.enter_graceful_shutdown()
        admission = self.servicer.admission

        def unfetched() -> int:
            return self.store.unfetched_outputs(admission.FETCH_PATIENCE_SECONDS)

        finished = await admission.drain(grace, unfetched)
        if finished and (left := unfetched()):
            log.warning("%d output(s) handed out were not fetched within the %.1fs grace",
                        left, grace)  # fmt: skip
        if not finished:
            log.warning(
                "%d call(s) still running after the %.1fs grace: cancelled",
                admission.in_flight,
                grace,
            )
        if self._reaper is not None:
            self._reaper.cancel()
        # Calls that returned may still be sending their responses: let them finish.
        await self._grpc.stop(max(0.1, grace - (time.monotonic() - started)))


def watch_stop(grace: float, held_bytes: int) -> None:
    """The last resort of a stop: every thread's stack to stderr, then exit code 1
    (sessions maybe not saved), once the stop has taken ``grace`` and the slack and
    the time to save ``held_bytes``; none if that is unbounded (``--grace inf`` made
    ``faulthandler`` raise, and the stop never began: sessions lost, a review helper)."""
    seconds = grace + STOP_SLACK_SECONDS + STOP_SAVE_SECONDS + held_bytes / SAVE_BYTES_PER_SECOND
    if seconds < WATCHDOG_MAX_SECONDS:  # (False for inf and NaN too)
        faulthandler.dump_traceback_later(seconds, exit=True, file=2)  # stderr


def thread_stacks() -> str:
    """Every thread's Python stack, for a log line that says where a stop hung."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"-- {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
    )


def _store(config: ServerConfig, trimmer: Trimmer) -> SessionStore:
    return SessionStore(
        idle_timeout=config.session_ttl,
        max_tensor_bytes=config.max_tensor_bytes,
        max_tensor_array_size=config.max_tensor_array_size,
        max_sessions=config.max_sessions,
        max_sessions_per_principal=config.sessions_per_principal(),
        max_session_bytes=config.max_session_bytes,
        max_principal_bytes=config.principal_bytes(),
        max_server_bytes=config.max_server_bytes,
        on_release=trimmer.released,
        replica_id=config.replica_id,
        host_cache_bytes=config.host_cache_bytes,
    )


def _compute(config: ServerConfig, device: str, store: SessionStore) -> Compute:
    if config.cuda_graphs and device != "cuda":
        log.warning("--cuda-graphs on has no effect on device %s: the LSTM runs eagerly", device)
    if config.lstm_formulation not in (None, *LSTM_FORMULATIONS):
        raise ConfigError(
            f"--lstm-formulation {config.lstm_formulation!r}: expected one of "
            f"{', '.join(LSTM_FORMULATIONS)}, or None (auto)"
        )
    if config.lstm_formulation is not None and device != "cpu":
        log.warning("--lstm-formulation has no effect on device %s: it is the CPU's", device)
    elif config.lstm_formulation is not None:
        log.info("LSTM forward formulation: %s for every shape", config.lstm_formulation)
    if config.cpu_step_kernel not in CPU_STEP_KERNELS:
        raise ConfigError(
            f"--cpu-step-kernel {config.cpu_step_kernel!r}: expected one of "
            f"{', '.join(CPU_STEP_KERNELS)}"
        )
    if config.cpu_step_kernel != "auto" and device != "cpu":
        log.warning("--cpu-step-kernel has no effect on device %s: it is the CPU's", device)
    try:
        return compute_for(
            device,
            cuda_graphs=config.cuda_graphs and device == "cuda",
            graph_cache_bytes=config.cuda_graph_cache_bytes,
            host_empty=store.buffers.array,
            share_blas_threads=config.share_blas_threads,
            lstm_formulation=config.lstm_formulation if device == "cpu" else None,
            cpu_step_kernel=config.cpu_step_kernel,
        )
    except NativeBuildError as e:  # (its message names the flag)
        raise ConfigError(str(e)) from None


def _tokens(config: ServerConfig) -> TokenTable | None:
    if config.token_file:
        return TokenTable.from_file(config.token_file)
    if not is_loopback(config.host):
        raise ConfigError(
            f"refusing to serve {config.host} without authentication: pass --token-file "
            "(authentication is off only on a loopback address)"
        )
    return None


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


#: Requests whose tensor bytes are read where gRPC received them: protobuf's parse
#: copies a ``bytes`` field in and reading it copies it out again, two passes over
#: every byte of a put (the SDK parses GetTensor's replies the same way). The put
#: keeps a view of the request (``PutTensorInline``) or copies each chunk once into
#: its buffer (``PutTensor``). What the parser finds unusual goes to protobuf.
VIEW_PARSERS: dict[str, Callable[[bytes], Any]] = {
    "PutTensorInline": codec.parse_tensor,
    "PutTensor": codec.parse_chunk,
}


def service_handler(servicer: GradServeServicer) -> grpc.GenericRpcHandler:
    """The GradServe service's method handlers, from its descriptor: each method's
    kind, messages and servicer coroutine, with a deserializer that never raises.
    With a token file, a call without a valid token gets a refusal that reads no
    message (``boundary.TokenGate``)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in SERVICE.methods:
        request = message_factory.GetMessageClass(method.input_type)
        parse = VIEW_PARSERS.get(method.name, request.FromString)
        kind = "_".join(
            "stream" if streaming else "unary"
            for streaming in (method.client_streaming, method.server_streaming)
        )
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=boundary.lenient(
                parse, method.input_type, servicer.request_freed, stream=method.client_streaming
            ),
            # Messages, or bytes already serialized (GetTensor's chunks): as they are.
            response_serializer=codec.serialize,
        )
    if servicer.tokens is None:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
    return boundary.TokenGate(servicer, handlers)


def _room_left(store: SessionStore, principal: str) -> tuple[int | None, int | None]:
    """The bytes ``principal``'s budget, and the server's, have left (None: no limit):
    how much of its clients' unread replies the server takes (``Admission``)."""
    mine, server = store.principal_budget(principal), store.budget
    return (
        None if mine.limit is None else mine.limit - mine.used,
        None if server.limit is None else server.limit - server.used,
    )


def start(config: ServerConfig) -> Server:
    """Build, bind and start a server for ``config`` on its own event-loop thread;
    raises if it cannot."""
    heap.keep_warm()  # messages and outputs reuse warm memory (gradserve/heap.py)
    credentials = _credentials(config)
    tokens = _tokens(config)
    several = tokens is not None and len(tokens.principals) > 1
    try:
        calls_per_principal = config.rpcs_per_principal()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cap = config.max_inline_reply_bytes
    if cap is not None and not 0 <= cap < 1 << 63:  # (KeepAlive says it as an int64)
        raise ConfigError(f"--max-inline-reply-bytes {cap}: from 0 to 2**63-1 (or none)")
    device = select_device(config.device)
    trimmer = Trimmer()
    try:
        store = _store(config, trimmer)
    except InvalidArgumentError as e:
        raise ConfigError(f"--replica-id: {e}") from None
    compute = _compute(config, device, store)
    keeper = StateKeeper(config, store, compute)
    store.on_ended = keeper.forget  # a session closed or expired leaves no file behind
    try:
        keeper.restore()  # before serving: a restored session is never reported missing
    except persistence.DirectoryInUseError as e:
        raise ConfigError(f"--state-dir: {e}") from None
    metrics = Metrics(store, compute) if config.metrics_port is not None else None
    servicer = GradServeServicer(
        store,
        compute=compute,
        # With several principals, the light lane keeps its last thread, and admission
        # its last slots, for a principal with nothing there; the compute lane, a slot
        # per core, keeps none.
        light=Lane(
            "light",
            config.workers,
            reserve_last_thread=several,
            max_per_principal=light_ops_per_principal() if several else None,
        ),
        heavy=Lane(
            "compute",
            config.slots(device),
            config.max_queued_compute,
            quantum=config.compute_quantum,
            max_paused=paused_ops(tokens, config.slots(device)),
        ),
        admission=Admission(
            config.max_concurrent_rpcs,
            config.max_streams,
            config.streams_per_principal(),
            max_calls_per_principal=calls_per_principal,
            reserve_for_newcomers=several,
            reply_room=functools.partial(_room_left, store),
            reply_allowance=config.max_message_bytes,
        ),
        tokens=tokens,
        observer=Observer(metrics),
        stream_limits=StreamLimits(
            config.stream_idle_timeout, config.stream_min_rate, config.stream_rate_grace
        ),
        max_message_bytes=config.max_message_bytes,
        max_inline_reply_bytes=config.max_inline_reply_bytes,
        request_freed=trimmer.released,
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gradserve-loop", daemon=True)
    thread.start()
    server = Server(0, store, device, config, servicer, metrics, None, trimmer, keeper=keeper)
    if metrics is not None:
        register_metrics(metrics.registry, keeper, servicer)
    server._loop, server._thread = loop, thread
    try:
        asyncio.run_coroutine_threadsafe(_start(server, credentials), loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        keeper.release()
        raise
    if metrics is not None:
        from prometheus_client import start_http_server

        assert config.metrics_port is not None  # metrics exist only with a port
        try:
            http, _ = start_http_server(
                config.metrics_port, addr=config.host, registry=metrics.registry
            )
        except BaseException:  # (its port taken): stop what started, save what it holds
            server.stop(grace=0)
            raise
        server.metrics_port = http.server_port
    keeper.serving()  # only now: a start that failed above restores the same files again
    if config.snapshot_interval is not None and config.state_dir is not None:
        threading.Thread(
            target=keeper.run_periodically,
            args=(server._stop_snapshots,),
            name="gradserve-snapshots",
            daemon=True,
        ).start()
    return server


async def _start(server: Server, credentials: grpc.ServerCredentials | None) -> None:
    config = server.config
    grpc_server = grpc.aio.server(options=config.grpc_options())
    grpc_server.add_generic_rpc_handlers((service_handler(server.servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), grpc_server
    )
    address = f"{config.host}:{config.port}"
    if credentials is None:
        port = grpc_server.add_insecure_port(address)
    else:
        port = grpc_server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind {address}")
    await grpc_server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.port, server._grpc, server._health = port, grpc_server, health_servicer
    server._reaper = asyncio.ensure_future(_reap(server))


#: Heavy ops paused at once for other principals' at most (each keeps a thread).
MAX_PAUSED_OPS = 256


def paused_ops(tokens: TokenTable | None, slots: int) -> int:
    """Heavy ops that may be paused at once (``--compute-quantum``): one per principal
    (one of each at most is), so that every principal's op takes its turn; a job
    pauses past it only for a paused one (``lanes.Lane``). Two per slot at least."""
    principals = len(tokens.principals) if tokens is not None else 1
    return max(2 * slots, min(principals, MAX_PAUSED_OPS))


def light_ops_per_principal() -> int:
    """With several principals, the light ops one principal runs at once: two per
    core (``lanes.Lane.max_per_principal``: more of them only slowed the others)."""
    return max(2, 2 * (os.cpu_count() or 1))


#: The TTL reaper's name on the light lane: no principal's (a token file's names
#: have no colon), so it never shares a tenant's count there.
REAPER = "gradserve:reaper"


async def _reap(server: Server) -> None:
    """Close idle sessions every few seconds until the server stops."""
    period = max(0.05, min(30.0, server.config.session_ttl / 4))
    while True:
        await asyncio.sleep(period)
        expired = await server.servicer.light.run(server.store.expire_idle, REAPER)
        if expired:
            log.info("closed %d idle session(s)", expired)


@contextlib.contextmanager
def run_server(config: ServerConfig | None = None, **overrides: Any) -> Iterator[Server]:
    """Start a server (``port=0`` by default: any free port) and stop it on exit."""
    config = dataclasses.replace(config or ServerConfig(port=0), **overrides)
    server = start(config)
    try:
        yield server
    finally:
        server.stop(grace=0)


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit code (0; 1 when the
    snapshot to ``--state-dir`` could not save every session)."""
    # Compute threads run Python between NumPy calls while holding the GIL; a short
    # switch interval lets the event loop (health, small calls) in sooner.
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    # The handlers come first: a SIGTERM while the server starts, or just after (its
    # sessions restored from --state-dir and their files set aside), must drain and
    # save them, not end the process as SIGTERM's default does. A SIGHUP then adopts
    # once it has started.
    stop, adopt_asked = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    signal.signal(signal.SIGHUP, lambda signum, frame: adopt_asked.set())
    server = start(config)
    extra = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
    print(f"listening on {config.host}:{server.port} (device: {server.device}{extra})", flush=True)
    # Wake up now and then: a signal that lands on another thread (gRPC's) runs its
    # Python handler only once the main thread runs Python again.
    while not stop.wait(0.2):
        if adopt_asked.is_set():  # SIGHUP: adopt the sessions in --adopt-dir
            adopt_asked.clear()
            if server.keeper is not None:
                threading.Thread(target=server.keeper.adopt, name="gradserve-adopt").start()
    log.info("draining: health NOT_SERVING, new calls refused, %.1fs grace", config.grace)
    watch_stop(config.grace, server.store.budget.used)
    server.stop()
    last = server.keeper.last if server.keeper is not None else None
    return 1 if last is not None and last.failed else 0  # 1: sessions were not saved
