"""Bearer-token authentication: a server interceptor and the token file it checks.

Token file: one ``principal:token`` per line (``#`` comments and blank lines
ignored). Only SHA-256 digests of the tokens are kept in memory, and a
presented token is compared against every digest with ``hmac.compare_digest``
so that timing reveals nothing about how close a guess was.

The interceptor reads ``authorization: Bearer <token>`` metadata. A missing
or wrong token ends the call with UNAUTHENTICATED; a good one runs the
handler with the caller's principal in ``current_principal``. Health checks
and reflection stay open, so that orchestrators can probe the server.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ipaddress
import pathlib
from collections.abc import Callable

import grpc

from gradserve.errors import Code
from gradserve.server.core.sessions import ANONYMOUS
from gradserve.server.transport.observability import Observer

#: The authenticated principal of the call being served.
current_principal: contextvars.ContextVar[str] = contextvars.ContextVar(
    "gradserve_principal", default=ANONYMOUS
)

OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


class TokenTable:
    """principal by token digest, loaded from a token file."""

    def __init__(self, entries: dict[bytes, str]) -> None:
        if not entries:
            raise ValueError("the token file names no principal:token pair")
        self._entries = list(entries.items())

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


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every call's bearer token; sets ``current_principal`` for the handler."""

    def __init__(self, tokens: TokenTable, observer: Observer | None = None) -> None:
        self._tokens = tokens
        self._observer = observer

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_SERVICES):
            return handler
        principal = self._authenticate(handler_call_details.invocation_metadata or ())
        if principal is None:
            return _refusal(handler, handler_call_details.method.rpartition("/")[2], self._observer)
        return _with_principal(handler, principal)

    def _authenticate(self, metadata) -> str | None:
        for key, value in metadata:
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer" and token:
                    return self._tokens.principal_for(token.strip())
        return None


_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _handler_like(handler, wrap: Callable[[Callable], Callable]):
    """A handler of the same kind as ``handler`` whose behaviour is ``wrap(behaviour)``."""
    for kind in _KINDS:
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            make = getattr(grpc, f"{kind}_rpc_method_handler")
            return make(
                wrap(behaviour),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


REFUSAL = "missing or invalid bearer token: send 'authorization: Bearer <token>' metadata"


def _refusal(handler, method: str, observer: Observer | None):
    def wrap(_behaviour):
        def refuse(request, context):
            if observer is not None:
                observer.refused(method, Code.UNAUTHENTICATED, REFUSAL)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        return refuse

    return _handler_like(handler, wrap)


def _with_principal(handler, principal: str):
    def wrap(behaviour):
        if handler.response_streaming:

            def streaming(request, context):
                token = current_principal.set(principal)
                try:
                    yield from behaviour(request, context)
                finally:
                    current_principal.reset(token)

            return streaming

        def unary(request, context):
            token = current_principal.set(principal)
            try:
                return behaviour(request, context)
            finally:
                current_principal.reset(token)

        return unary

    return _handler_like(handler, wrap)
