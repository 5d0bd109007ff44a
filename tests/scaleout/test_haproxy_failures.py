"""HAProxy answers a call it could not forward in gRPC's terms (deploy/haproxy's config,
the part the tests' config takes as is): once its retries find the replica still
refusing connections, UNAVAILABLE with reason NOT_FORWARDED, which the SDK repeats
even for a write. Its own 503 page carried no gRPC status: behind the shipped config a
write whose replica restarted for longer than the retries last (about 30 s: a slow
restore, a rescheduled pod) was reported as "outcome unknown" (helper-71)."""

from __future__ import annotations

import re

import pytest

from gradserve.errors import NOT_FORWARDED_REASON
from tests.scaleout import proxies, workload
from tests.scaleout.proxies import HAPROXY_CONFIG, assert_not_forwarded_details, template_part


def test_the_configs_error_details_agree_with_its_message_and_the_sdk():
    part = template_part("failed calls", HAPROXY_CONFIG)
    (line,) = [x for x in part.splitlines() if x.strip().startswith("http-error")]
    assert "status 503 " in line  # HAProxy's "no server could take it", never a forward
    message = re.search(r'hdr grpc-message "([^"]*)"', line).group(1)
    blob = re.search(r'hdr grpc-status-details-bin "([^"]*)"', line).group(1)
    assert re.search(r"hdr grpc-status 14\b", line)
    assert_not_forwarded_details(message, blob)


@pytest.mark.scaleout
def test_a_write_while_its_replica_is_down_past_the_retries_is_repeated_not_left_unknown(
    make_cluster, monkeypatch
):
    """Behind HAProxy, the replica down for longer than its retries (one here, 30 s
    in the shipped config): NOT_FORWARDED, and the SDK's repeats land the write once
    the replica is back."""
    monkeypatch.setattr(proxies.HAProxy, "retries", 1)
    cluster = make_cluster("haproxy", 1)
    workload.write_through_a_restart(
        cluster.proxy.target, cluster.replicas["r0"], NOT_FORWARDED_REASON
    )
