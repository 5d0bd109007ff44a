"""A replica stamps its identity into the ids of the sessions it creates, which is
what the proxy routes on; the identity is a DNS label, from the flag or the pod name."""

from __future__ import annotations

import pytest

from gradserve.errors import InvalidArgumentError
from gradserve.server.core.sessions import SessionStore, check_replica_id, replica_of
from gradserve.server.transport import cli
from gradserve.server.transport.app import ConfigError, run_server


def test_session_ids_carry_the_replica_and_128_random_bits_or_more():
    store = SessionStore(replica_id="gradserve-2")
    ids = {store.create().id for _ in range(50)}
    assert len(ids) == 50
    for session_id in ids:
        replica, random_part = session_id.split(".", 1)
        assert replica == replica_of(session_id) == "gradserve-2"
        assert len(random_part) * 6 >= 128 and "." not in random_part
    assert replica_of(SessionStore().create().id) is None  # no identity: bare ids


@pytest.mark.parametrize("bad", ["", "R1", "a.b", "-a", "a-", "a_b", "x" * 64, "a b"])
def test_a_replica_id_must_be_a_dns_label(bad):
    with pytest.raises(InvalidArgumentError, match="DNS label"):
        check_replica_id(bad)


def test_a_bad_replica_id_stops_the_server_from_starting():
    with pytest.raises(ConfigError, match="--replica-id"), run_server(replica_id="Bad.Id"):
        pass


def test_the_default_identity_is_the_pod_name(monkeypatch):
    monkeypatch.delenv("GRADSERVE_REPLICA_ID", raising=False)
    monkeypatch.setenv("HOSTNAME", "gradserve-3.gradserve.ns.svc.cluster.local")
    assert cli.default_replica_id() == "gradserve-3"
    monkeypatch.setenv("GRADSERVE_REPLICA_ID", "r7")
    assert cli.default_replica_id() == "r7"
    monkeypatch.setenv("GRADSERVE_REPLICA_ID", "not_a_label")
    monkeypatch.setenv("HOSTNAME", "Not_A_Label_Either")
    assert cli.default_replica_id() is None
    args = cli.build_parser().parse_args(["serve", "--replica-id", "none"])
    assert args.replica_id is None
