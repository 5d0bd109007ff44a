"""``gradserve serve …`` / ``gradserve health …`` (also ``python -m gradserve.server``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import threading
from typing import Any

from gradserve.server.transport.config import CPU_STEP_KERNELS, LSTM_FORMULATIONS, ServerConfig
from gradserve.server.transport.log_writer import LogWriter

#: Seconds the log's thread gets at exit to write what is queued.
LOG_DRAIN_SECONDS = 5.0


def _optional(kind, none: str = "unlimited"):
    """A flag value of ``kind``, or None for "none"/"off"/"unlimited"; ``none`` says
    what None means, for ``--help``."""

    def parse(text: str):
        return None if text.lower() in ("none", "off", "unlimited") else kind(text)

    parse.__name__ = kind.__name__
    parse.none_is = none  # type: ignore[attr-defined]
    return parse


def _auto(kind):
    """A flag value of ``kind``, or None for "auto" (the server decides)."""

    def parse(text: str):
        return None if text.lower() == "auto" else kind(text)

    parse.__name__ = kind.__name__
    parse.none_means = "auto"  # type: ignore[attr-defined]
    return parse


def _shown(kind, default) -> str:
    """A flag's default as ``--help`` shows it ("auto" for an ``_auto`` flag's None)."""
    return str(getattr(kind, "none_means", None) if default is None else default)


def _on_off(text: str) -> bool:
    """ "on"/"off" (also true/false, yes/no, 1/0)."""
    value = text.lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


_on_off.__name__ = "on|off"


def _formulation(text: str) -> str | None:
    """ "auto" (None: measured per shape) or one of ``LSTM_FORMULATIONS``."""
    value = text.lower()
    if value == "auto":
        return None
    if value not in LSTM_FORMULATIONS:
        raise argparse.ArgumentTypeError(
            f"expected auto or one of {', '.join(LSTM_FORMULATIONS)}, got {text!r}"
        )
    return value


_formulation.__name__ = "formulation"
_formulation.none_means = "auto"  # type: ignore[attr-defined]


def _step_kernel(text: str) -> str:
    """One of ``CPU_STEP_KERNELS``."""
    value = text.lower()
    if value not in CPU_STEP_KERNELS:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(CPU_STEP_KERNELS)}, got {text!r}"
        )
    return value


_step_kernel.__name__ = "step kernel"

# (config field, value type, help). Flags are the field names with dashes.
SERVE_FLAGS = [
    ("host", str, "address to bind; a non-loopback address needs --token-file"),
    ("port", int, "port to bind; 0 picks a free port"),
    (
        "device",
        str,
        "auto | cpu | cuda: where the LSTM math runs (auto: CUDA when CuPy sees a GPU)",
    ),
    (
        "cuda_graphs",
        _on_off,
        "on | off: replay whole LSTM calls as CUDA graphs (--device cuda; off: the eager loop)",
    ),
    ("cuda_graph_cache_bytes", int, "GPU bytes the captured CUDA-graph plans may hold"),
    ("workers", int, "threads computing light ops (waiting calls take none)"),
    ("token_file", str, "bearer tokens, one 'principal:token' per line"),
    ("tls_cert", str, "PEM certificate chain: serve TLS"),
    ("tls_key", str, "PEM private key of --tls-cert"),
    ("tls_client_ca", str, "PEM CA bundle: require client certificates (mutual TLS)"),
    ("max_message_bytes", int, "ceiling of one unary message, each direction"),
    (
        "max_inline_reply_bytes",
        _optional(int, none="the message limit alone"),
        "tensor bytes one reply carries inline; larger outputs go as transient tensors, "
        "streamed (a large reply holds the server's other calls while it is copied)",
    ),
    ("max_tensor_bytes", _optional(int), "largest tensor the server holds or builds"),
    ("max_tensor_array_size", _optional(int), "most elements of one TensorArray"),
    ("max_sessions", _optional(int), "open sessions, all principals together"),
    (
        "max_sessions_per_principal",
        _optional(int),
        "open sessions of one principal (with a token file)",
    ),
    ("max_session_bytes", _optional(int), "bytes one session may hold"),
    ("max_server_bytes", _optional(int), "bytes all sessions may hold (default: half of RAM)"),
    (
        "max_principal_bytes",
        _optional(int),
        "bytes all sessions of one principal may hold (-1: half of --max-server-bytes "
        "with --token-file, else none)",
    ),
    ("session_ttl", float, "seconds before an idle session is closed"),
    (
        "host_cache_bytes",
        int,
        "bytes of freed large-tensor buffers kept warm for reuse (0: off)",
    ),
    ("max_concurrent_rpcs", _optional(int), "calls in flight; more get RESOURCE_EXHAUSTED"),
    (
        "max_concurrent_rpcs_per_principal",
        _optional(int),
        "calls in flight of one principal (-1: half of --max-concurrent-rpcs with "
        "--token-file, else none)",
    ),
    ("max_streams", _optional(int), "PutTensor/GetTensor streams open, all principals"),
    ("max_streams_per_principal", _optional(int), "streams open of one principal"),
    (
        "compute_slots",
        _auto(int),
        "heavy ops (LSTM) computing at once; auto: on the CPU, cores // BLAS threads "
        "(one op per core with --share-blas-threads on)",
    ),
    (
        "share_blas_threads",
        _on_off,
        "on | off: CPU LSTM ops computing at once divide the BLAS threads (on: more "
        "throughput under concurrent calls, but an op's last bits depend on the load)",
    ),
    (
        "lstm_formulation",
        _formulation,
        "auto | concat | hoisted | hoisted-t: the CPU LSTM forward's GEMMs (auto: the "
        "fastest, measured per shape; fixed: every replica and restart computes the "
        "same bits)",
    ),
    (
        "cpu_step_kernel",
        _step_kernel,
        "auto | native | numpy: the CPU LSTM forward's elementwise pass in float32 "
        "(native: compiled here with the host's C compiler, refused start without one; "
        "auto: native where it builds; the two differ in the last bits)",
    ),
    ("max_queued_compute", int, "heavy ops waiting for a slot; more get RESOURCE_EXHAUSTED"),
    (
        "compute_quantum",
        _optional(float, "never"),
        "seconds a heavy op computes before it lends its slot to another principal's "
        "waiting op, between its steps (it goes on at its next turn); 0: never",
    ),
    ("stream_idle_timeout", _optional(float, "never"), "end a stream after this many idle seconds"),
    (
        "stream_min_rate",
        _optional(float, "no minimum"),
        "bytes/s a stream must average after the grace",
    ),
    ("stream_rate_grace", float, "seconds before --stream-min-rate applies"),
    ("keepalive_time", float, "seconds between keepalive pings"),
    ("keepalive_timeout", float, "seconds to wait for a keepalive ack"),
    (
        "max_connection_age",
        _optional(float, "never"),
        "recycle connections after this many seconds",
    ),
    ("max_connection_age_grace", float, "grace for in-flight RPCs when a connection is recycled"),
    ("grace", float, "seconds in-flight RPCs get on SIGTERM/SIGINT"),
    ("metrics_port", _optional(int, "no metrics"), "serve Prometheus metrics on this port"),
    (
        "replica_id",
        _optional(str, "bare random session ids"),
        "this replica's identity (a DNS label), stamped into its session ids for a proxy "
        "to route on; default: $GRADSERVE_REPLICA_ID, else $HOSTNAME's first label",
    ),
    (
        "state_dir",
        _optional(str, "sessions are not saved"),
        "write sessions here on SIGTERM, restore them on start",
    ),
    (
        "snapshot_interval",
        _optional(float, "on SIGTERM only"),
        "also snapshot every this many seconds",
    ),
    (
        "adopt_dir",
        _optional(str, "<state-dir>/adopt"),
        "on SIGHUP adopt the session files here (<state-dir>/adopt)",
    ),
]


#: ``--replica-id``'s default: read from the environment (``default_replica_id``).
_FROM_ENVIRONMENT = "$HOSTNAME"


def default_replica_id() -> str | None:
    """``$GRADSERVE_REPLICA_ID``, else the first label of ``$HOSTNAME`` (a StatefulSet
    pod's name, ``gradserve-2``), lowercased; None when neither is a DNS label."""
    from gradserve.errors import InvalidArgumentError
    from gradserve.server.core.sessions import check_replica_id

    for raw in (os.environ.get("GRADSERVE_REPLICA_ID"), os.environ.get("HOSTNAME")):
        if raw:
            try:
                return check_replica_id(raw.split(".")[0].lower())
            except InvalidArgumentError:
                continue
    return None


def build_parser() -> argparse.ArgumentParser:
    defaults = ServerConfig()
    parser = argparse.ArgumentParser(prog="gradserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gRPC server until SIGTERM/SIGINT")
    for field, kind, text in SERVE_FLAGS:
        default = _FROM_ENVIRONMENT if field == "replica_id" else getattr(defaults, field)
        extra: dict[str, Any] = {"choices": ("auto", "cpu", "cuda")} if field == "device" else {}
        serve.add_argument(
            f"--{field.replace('_', '-')}",
            dest=field,
            type=kind,
            default=default,
            help=f"{text} (default: {_shown(kind, default)}"
            + (f"; none: {kind.none_is})" if hasattr(kind, "none_is") else ")"),
            **extra,
        )
    serve.add_argument("--log-level", default="INFO", help="DEBUG logs one line per RPC")
    serve.add_argument("--log-format", choices=("text", "json"), default="text")
    health = sub.add_parser("health", help="exit 0 if the server at HOST:PORT reports SERVING")
    health.add_argument("--host", default="127.0.0.1")
    health.add_argument("--port", type=int, default=defaults.port)
    health.add_argument("--timeout", type=float, default=3.0)
    health.add_argument("--tls-ca", default=None, help="PEM CA of a TLS server")
    health.add_argument(
        "--tls-cert",
        default=None,
        help="PEM client certificate, for a server that requires one (--tls-client-ca)",
    )
    health.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    return parser


def check_health(
    host: str,
    port: int,
    timeout: float,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> int:
    """0 when the standard gRPC health service says SERVING, else 1 (for healthchecks).
    A server that requires client certificates (mutual TLS) is asked with ``tls_cert``
    and ``tls_key`` (it refused the check without one: a review helper)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"{host}:{port}"
    if (tls_cert is None) != (tls_key is None):
        print("--tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    if tls_ca or tls_cert:

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as fh:
                return fh.read()

        credentials = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
        channel = grpc.secure_channel(target, credentials)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as e:
            print(f"unhealthy: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def configure_logging(level: str, fmt: str) -> LogWriter:
    """Log to stderr from a thread of its own (``log_writer``: a reader that stops
    reading blocks that thread only); returns it, to ``close`` at exit."""
    handler = logging.StreamHandler()
    if fmt == "json":
        from gradserve.server.transport.observability import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    writer = LogWriter(handler)
    logging.basicConfig(level=level.upper(), handlers=[writer.queue_handler], force=True)
    # What Python itself would write to stderr goes through it as well: warnings (a
    # NumPy overflow warning, written while a TensorArray's lock was held, hung the
    # drain behind a full pipe) and the exceptions that end a thread.
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_exception
    return writer


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:  # as threading's own hook
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("gradserve").error(
        "uncaught exception in thread %s",
        name,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "health":
        return check_health(
            args.host, args.port, args.timeout, args.tls_ca, args.tls_cert, args.tls_key
        )
    writer = configure_logging(args.log_level, args.log_format)
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    config = ServerConfig(**{k: v for k, v in vars(args).items() if k in fields})
    if args.replica_id == _FROM_ENVIRONMENT:
        config.replica_id = default_replica_id()
    from gradserve.server.transport.app import ConfigError, serve

    try:
        code = serve(config)
    except (ConfigError, RuntimeError, OSError) as e:
        print(f"gradserve: {e}", file=sys.stderr)
        code = 2
    except BaseException:  # written out first: the lines that say what went wrong
        writer.close(LOG_DRAIN_SECONDS)
        raise
    if writer.close(LOG_DRAIN_SECONDS):
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
    # else stderr's reader is not reading: flushing it would block as well.
    # The server has stopped: its sessions are saved (or the exit code says not) and
    # freed, its log written. Leave now: the interpreter's exit would wait for every
    # thread a library left that is not a daemon, and gRPC's own cleanup, which a
    # SIGTERMed server must never hang on (``app.STOP_SLACK_SECONDS``).
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
