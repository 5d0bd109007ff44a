"""Bearer-token authentication: the token file, and who a call's token names.

Token file: one ``principal:token`` per line (``#`` comments and blank lines
ignored). Only SHA-256 digests of the tokens are kept in memory, and a
presented token is compared against every digest with ``hmac.compare_digest``
so that timing reveals nothing about how close a guess was.

``boundary.TokenGate`` reads ``authorization: Bearer <token>`` metadata on every
GradServe call (``principal_of``) before gRPC reads its message, and
``boundary.guarded`` again in the handler. A missing or wrong token ends the call
with UNAUTHENTICATED; a good one runs the handler with the caller's principal in
``current_principal``. Health checks and reflection are other services and stay
open, so that orchestrators can probe the server.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ipaddress
import pathlib
from collections.abc import Iterable
from typing import Any

from gradserve.server.core.sessions import ANONYMOUS

#: The authenticated principal of the call being served.
current_principal: contextvars.ContextVar[str] = contextvars.ContextVar(
    "gradserve_principal", default=ANONYMOUS
)


class TokenTable:
    """principal by token digest, loaded from a token file."""

    def __init__(self, entries: dict[bytes, str]) -> None:
        if not entries:
            raise ValueError("the token file names no principal:token pair")
        self._entries = list(entries.items())
        #: The principals the file names (several tokens may name one).
        self.principals = frozenset(entries.values())

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> TokenTable:
        entries: dict[bytes, str] = {}
        for number, raw in enumerate(pathlib.Path(path).read_text().splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            principal, sep, token = line.partition(":")
            if not sep or not principal.strip() or not token.strip():
                raise ValueError(f"{path}:{number}: expected 'principal:token'")
            if principal.strip() == ANONYMOUS:
                # The owner of every session made without a token file: restored from
                # a snapshot, they would be this principal's (a review helper).
                raise ValueError(
                    f"{path}:{number}: the principal name {ANONYMOUS!r} is reserved (the "
                    "owner of sessions served without a token file)"
                )
            entries[_digest(token.strip())] = principal.strip()
        return cls(entries)

    def principal_for(self, token: str) -> str | None:
        """The principal owning ``token``, or None; constant time in the token's content."""
        digest = _digest(token)
        found = None
        for known, principal in self._entries:
            if hmac.compare_digest(known, digest):
                found = principal
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


REFUSAL = "missing or invalid bearer token: send 'authorization: Bearer <token>' metadata"


def principal_of(tokens: TokenTable, metadata: Iterable[tuple[str, Any]]) -> str | None:
    """The principal whose bearer token the call carries, or None."""
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return tokens.principal_for(token.strip())
    return None
