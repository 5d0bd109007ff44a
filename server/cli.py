"""``gradserve serve …`` and ``python -m gradserve.server …``."""

from __future__ import annotations

import argparse
import logging
import sys

from gradserve import protocol
from gradserve.server.app import serve
from gradserve.server.config import ServerConfig


def build_parser() -> argparse.ArgumentParser:
    defaults = ServerConfig()
    parser = argparse.ArgumentParser(prog="gradserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the gRPC server until SIGTERM/SIGINT")
    p.add_argument("--host", default=defaults.host, help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=defaults.port, help="0 picks a free port")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=defaults.device,
        help="where the LSTM math runs; auto uses CUDA when CuPy finds a GPU",
    )
    p.add_argument("--workers", type=int, default=defaults.workers, help="RPC threads")
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=protocol.DEFAULT_MAX_MESSAGE_BYTES,
        help="ceiling of one unary message (default %(default)s)",
    )
    p.add_argument(
        "--max-tensor-bytes",
        type=int,
        default=defaults.max_tensor_bytes,
        help="largest tensor the server holds or builds (default %(default)s)",
    )
    p.add_argument(
        "--session-ttl",
        type=float,
        default=defaults.session_ttl,
        help="seconds before an idle session is closed (default %(default)s)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=defaults.grace,
        help="seconds in-flight RPCs get on shutdown (default %(default)s)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    h = sub.add_parser("health", help="exit 0 if the server at HOST:PORT reports SERVING")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=int, default=defaults.port)
    h.add_argument("--timeout", type=float, default=3.0)
    return parser


def check_health(host: str, port: int, timeout: float) -> int:
    """0 when the standard gRPC health service says SERVING, else 1 (for healthchecks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as e:
            print(f"unhealthy: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if serving else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "health":
        return check_health(args.host, args.port, args.timeout)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        device=args.device,
        workers=args.workers,
        max_message_bytes=args.max_message_bytes,
        max_tensor_bytes=args.max_tensor_bytes,
        session_ttl=args.session_ttl,
        grace=args.grace,
    )
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
