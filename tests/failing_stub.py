"""A client's gRPC stub that fails chosen calls first: for tests of what the SDK does
when an attempt fails (repeats, regions kept or renewed, housekeeping)."""

from __future__ import annotations

import collections
from typing import Any

from gradserve import protocol


class FailingStub:
    """``real``, except that each attempt of an RPC named in ``failures`` first raises
    the next of its errors (``Client._stub = FailingStub(client._stub, {...})``).
    Counts the attempts per RPC and records the output region each one named."""

    def __init__(self, real: Any, failures: dict[str, list[BaseException]]) -> None:
        self.real = real
        self.failures = {rpc: list(errors) for rpc, errors in failures.items()}
        self.attempts: collections.Counter[str] = collections.Counter()
        self.regions: dict[str, list[str | None]] = collections.defaultdict(list)

    def __getattr__(self, rpc: str) -> Any:
        method = getattr(self.real, rpc)

        def call(request: Any, metadata: Any = None, timeout: Any = None) -> Any:
            self.attempts[rpc] += 1
            named = dict(metadata or ()).get(protocol.OUTPUT_REGION_METADATA_KEY)
            self.regions[rpc].append(named)
            if self.failures.get(rpc):
                raise self.failures[rpc].pop(0)
            return method(request, metadata=metadata, timeout=timeout)

        return call
