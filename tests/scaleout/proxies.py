"""Real nginx and HAProxy in front of replicas on loopback, configured as
``deploy/`` configures them: CreateSession (no session header) to any replica, every
later call routed on the replica prefix of ``x-gradserve-session`` (the id's part
before the first dot) through a map that an operator edits to hand a removed
replica's prefix to the survivor that adopted its sessions."""

from __future__ import annotations

import base64
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import textwrap
import time

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


def have(binary: str) -> bool:
    return os.path.exists(binary) and os.access(binary, os.X_OK)


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


_PORTS = random.Random()
#: Ports handed out in this process: two picks before either is bound differ.
_HANDED: set[int] = set()


def free_port() -> int:
    """A port that a replica or proxy started later can bind: free now, and outside
    the ephemeral range, so that no outgoing connection (the tests' clients open
    hundreds) takes it between now and then. A port from ``bind(0)`` came from that
    range, and a setup once failed so and left its replicas running."""
    low, _ = _ephemeral_ports()
    first = 10_000 if low > 12_000 else 1_024
    for _ in range(200):
        port = _PORTS.randrange(first, low)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    with socket.socket() as s:  # no free port below the range: any free one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


class Proxy:
    """A proxy process: ``route(prefixes, create)`` writes its config and (re)loads it.

    ``prefixes`` maps a replica prefix to the port of the replica serving it (a removed
    replica's prefix maps to its adopter's port); ``create`` lists the ports that take
    new sessions."""

    name = "proxy"

    def __init__(self, workdir: pathlib.Path) -> None:
        self.dir = workdir / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        path = self.dir / "error.log"
        return path.read_text() if path.exists() else ""


#: deploy/nginx's template, whose marked parts (how a failed call is answered) the
#: tests' config takes as they are.
NGINX_TEMPLATE = (
    pathlib.Path(__file__).resolve().parents[2] / "deploy/nginx/gradserve.conf.template"
)


#: deploy/haproxy's config, whose marked part (how a call not forwarded is answered)
#: the tests' config takes as it is.
HAPROXY_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "deploy/haproxy/haproxy.cfg"


def template_part(name: str, path: pathlib.Path = NGINX_TEMPLATE) -> str:
    """The lines of a shipped config between ``# BEGIN name`` and ``# END name``."""
    text = path.read_text()
    begin, end = f"# BEGIN {name}\n", f"# END {name}"
    start = text.index(begin) + len(begin)
    return text[start : text.index(end, start)].rstrip(" ")


def assert_not_forwarded_details(message: str, blob: str) -> None:
    """A proxy's answer to a call it did not forward: ``blob`` (grpc-status-details-bin)
    is a google.rpc.Status of UNAVAILABLE with ``message`` (its grpc-message) and an
    ErrorInfo the SDK reads as NOT_FORWARDED."""
    from google.rpc import code_pb2, error_details_pb2, status_pb2

    from gradserve.errors import NOT_FORWARDED_REASON
    from gradserve.protocol import ERROR_DOMAIN

    status = status_pb2.Status.FromString(base64.b64decode(blob))
    assert status.code == code_pb2.UNAVAILABLE and status.message == message
    (detail,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info) and info.reason == NOT_FORWARDED_REASON
    assert info.domain == ERROR_DOMAIN


class Nginx(Proxy):
    name = "nginx"

    def config(self, prefixes: dict[str, int], create: list[int]) -> str:
        upstreams = "".join(
            f"    upstream gs_{port} {{ server 127.0.0.1:{port} max_fails=0; keepalive 32; }}\n"
            for port in sorted({*prefixes.values(), *create})
        )
        pool = "".join(f"        server 127.0.0.1:{p};\n" for p in create)
        routes = "".join(f"        {prefix} gs_{port};\n" for prefix, port in prefixes.items())
        return f"""# rendered by tests/scaleout/proxies.py like deploy/nginx/gradserve.conf
daemon off;
worker_processes 1;
pid {self.dir}/nginx.pid;
error_log {self.dir}/error.log warn;
worker_shutdown_timeout 10s;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {self.dir}/body;
    proxy_temp_path {self.dir}/proxy;
    fastcgi_temp_path {self.dir}/fastcgi;
    uwsgi_temp_path {self.dir}/uwsgi;
    scgi_temp_path {self.dir}/scgi;
    # The replica prefix: the session id up to its first dot ("" without a session).
    map $http_x_gradserve_session $gs_replica {{
        "~^(?<prefix>[a-z0-9-]+)\\." $prefix;
        default "";
    }}
    # Replica prefix -> upstream. No session header: any replica (gs_create).
    # A prefix that no replica serves goes to gs_create too: SESSION_NOT_FOUND.
    map $gs_replica $gs_upstream {{
{routes}        default gs_create;
    }}
{textwrap.indent(template_part("failed calls (http)"), "    ")}
{upstreams}    upstream gs_create {{
{pool}        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{self.port} http2;
        client_max_body_size 0;
{textwrap.indent(template_part("timeouts"), "    ")}        location / {{
            grpc_pass grpc://$gs_upstream;
            grpc_next_upstream error timeout;
        }}
{textwrap.indent(template_part("failed calls (server)"), "    ")}    }}
}}
"""

    def route(self, prefixes: dict[str, int], create: list[int]) -> None:
        conf = self.dir / "nginx.conf"
        conf.write_text(self.config(prefixes, create))
        check = subprocess.run(
            [NGINX, "-t", "-q", "-c", str(conf), "-p", str(self.dir)],
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0, check.stderr
        if self.proc is None:
            self.proc = subprocess.Popen(
                [NGINX, "-c", str(conf), "-p", str(self.dir)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_port(self.port)
        else:  # a graceful reload: new workers take the config, old ones finish
            self.proc.send_signal(signal.SIGHUP)
            time.sleep(0.5)


class HAProxy(Proxy):
    """HAProxy in master-worker mode. A new replica (a new backend) is a reload; every
    other change goes through the runtime API, which applies at once to connections
    already open (a reload would leave them on the old process and its old routes) and
    to calls held for a retry: a prefix handed to another replica is its backend's
    server given the adopter's address."""

    name = "haproxy"
    #: How many times a call is tried again on a refused connection (one a second).
    retries = 30

    def __init__(self, workdir: pathlib.Path) -> None:
        super().__init__(workdir)
        self.socket = self.dir / "admin.sock"
        self._routes: dict[str, int] = {}
        self._create: list[int] = []
        self._home: dict[str, int] = {}  # where each prefix's replica was first

    def config(self, prefixes: dict[str, int], create: list[int]) -> str:
        (self.dir / "replicas.map").write_text(
            "".join(f"{prefix} be_{prefix}\n" for prefix in prefixes)
        )
        # Each replica's backend: the replica, and a spare server that takes its
        # prefix over when a survivor adopts its sessions (``route``).
        backends = "".join(
            f"backend be_{prefix}\n    option redispatch 1\n"
            f"    server {prefix} 127.0.0.1:{self._home.get(prefix, port)} proto h2\n"
            f"    server adopter 127.0.0.1:{port} proto h2 disabled\n"
            for prefix, port in prefixes.items()
        )
        pool = "".join(
            f"    server c{port} 127.0.0.1:{port} proto h2 check inter 1s fall 1 rise 1\n"
            for port in create
        )
        return f"""# rendered by tests/scaleout/proxies.py like deploy/haproxy/haproxy.cfg
global
    maxconn 4096
    hard-stop-after 15s
    stats socket {self.socket} mode 600 level admin
defaults
    mode http
    timeout connect 1s
    timeout client 1h
    timeout server 1h
    # A replica restarting refuses connections: hold the call and try again (every
    # second, up to 30 times). A refused connection never carried the request.
    retries {self.retries}
    retry-on conn-failure
{template_part("failed calls", HAPROXY_CONFIG)}frontend grpc
    bind 127.0.0.1:{self.port} proto h2
    # Route on the replica prefix of the session id; no session header, or a prefix
    # no replica serves: any replica.
    use_backend %[req.hdr(x-gradserve-session),field(1,.),map({self.dir}/replicas.map,be_create)] if {{ req.hdr(x-gradserve-session) -m found }}
    default_backend be_create
backend be_create
    balance roundrobin
    option redispatch 1
{pool}{backends}"""

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket))
            s.sendall(line.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()

    def route(self, prefixes: dict[str, int], create: list[int]) -> None:
        for prefix, port in prefixes.items():
            self._home.setdefault(prefix, port)
        conf = self.dir / "haproxy.cfg"
        conf.write_text(self.config(prefixes, create))
        check = subprocess.run(
            [HAPROXY, "-c", "-q", "-f", str(conf)], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr
        if self.proc is None:
            self.proc = subprocess.Popen(
                [HAPROXY, "-W", "-f", str(conf)],
                stdout=open(self.dir / "error.log", "ab"),  # noqa: SIM115 - closed with the process
                stderr=subprocess.STDOUT,
            )
            wait_port(self.port)
        elif set(prefixes) - set(self._routes) or set(create) - set(self._create):
            self.proc.send_signal(signal.SIGUSR2)  # a new backend: master-worker reload
            time.sleep(0.5)
        else:
            for port in set(self._create) - set(create):  # out of the create pool
                assert self.command(f"set server be_create/c{port} state maint") == "\n"
            for prefix, port in prefixes.items():  # a prefix handed to its adopter
                if self._routes.get(prefix) != port:
                    # Calls held for a retry are redispatched to the adopter.
                    out = self.command(f"set server be_{prefix}/adopter addr 127.0.0.1 port {port}")
                    assert "changed" in out or "no need" in out, out
                    assert self.command(f"set server be_{prefix}/adopter state ready") == "\n"
                    assert self.command(f"set server be_{prefix}/{prefix} state maint") == "\n"
        self._routes, self._create = dict(prefixes), list(create)
