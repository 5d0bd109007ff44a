"""The gradserve server, in two layers.

- ``gradserve.server.core``: the domain — sessions and their budgets, the
  TensorArray state machine, op semantics. NumPy and the shared error, dtype and
  shape modules only: no gRPC, no protobuf (``make lint`` enforces it).
- ``gradserve.server.transport``: gRPC — servicer, op handlers, error boundary,
  admission, auth, app and CLI; it translates messages and calls the core.

``run_server`` (embedding, tests), ``start``, ``serve``, ``Server`` and
``ServerConfig`` are loaded from the transport on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradserve.server.transport.app import Server, run_server, serve, start
    from gradserve.server.transport.config import ServerConfig

_LAZY = {
    "Server": "gradserve.server.transport.app",
    "run_server": "gradserve.server.transport.app",
    "serve": "gradserve.server.transport.app",
    "start": "gradserve.server.transport.app",
    "ServerConfig": "gradserve.server.transport.config",
}

__all__ = ["Server", "ServerConfig", "run_server", "serve", "start"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradserve.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
