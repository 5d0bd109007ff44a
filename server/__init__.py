"""The gradserve gRPC server: ``run_server`` for embedding, ``serve`` for the CLI."""

from gradserve.server.app import Server, run_server, serve, start
from gradserve.server.config import ServerConfig

__all__ = ["Server", "ServerConfig", "run_server", "serve", "start"]
