"""Fixtures of the scale-out tests: replicas as processes behind a real proxy.

nginx and HAProxy come from the system's packages (``.ci/run`` installs them). Where
they are missing the proxy tests are skipped, except in CI (``$CI`` set), where a
missing proxy is a failure."""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.scaleout.cluster import Replica
from tests.scaleout.proxies import HAPROXY, NGINX, HAProxy, Nginx, have

PROXIES = {"nginx": (Nginx, NGINX), "haproxy": (HAProxy, HAPROXY)}


def proxy_class(kind: str):
    cls, binary = PROXIES[kind]
    if not have(binary):
        if os.environ.get("CI"):
            pytest.fail(f"{binary} is missing in CI: .ci/run installs it with apt")
        pytest.skip(f"{binary} is not installed (apt-get install {kind}; .ci/run does)")
    return cls


class Cluster:
    """Replicas r0..r{n-1} and one proxy routing to them."""

    def __init__(self, workdir, proxy_kind: str, n: int = 3, *flags: str) -> None:
        self.workdir = workdir
        self.flags = flags
        self.proxy = proxy_class(proxy_kind)(workdir)
        self.replicas: dict[str, Replica] = {}
        self.routes: dict[str, int] = {}
        self.create: list[int] = []
        try:
            for i in range(n):
                self.add(f"r{i}", route=False)
            self.route()
        except BaseException:  # stop what started: nothing outlives a failed setup
            self.stop()
            raise

    def add(self, name: str, *, route: bool = True) -> Replica:
        replica = Replica(name, self.workdir, *self.flags).start()
        self.replicas[name] = replica
        self.routes[name] = replica.port
        self.create.append(replica.port)
        if route:
            self.route()
        return replica

    def route(self) -> None:
        self.proxy.route(dict(self.routes), list(self.create))

    def stop(self) -> None:
        """Stop the proxy and every replica, each even if another failed to stop."""
        with contextlib.ExitStack() as stack:
            stack.callback(self.proxy.stop)
            for replica in self.replicas.values():
                if replica.proc is not None and replica.proc.poll() is None:
                    stack.callback(replica.stop)


@pytest.fixture
def make_cluster(tmp_path):
    made: list[Cluster] = []

    def make(proxy_kind: str, n: int = 3, *flags: str) -> Cluster:
        # A directory each: two clusters' replicas r0 must not share a state dir.
        workdir = tmp_path / f"cluster{len(made)}"
        workdir.mkdir()
        cluster = Cluster(workdir, proxy_kind, n, *flags)
        made.append(cluster)
        return cluster

    yield make
    with contextlib.ExitStack() as stack:  # every cluster, even if one fails to stop
        for cluster in made:
            stack.callback(cluster.stop)
