"""Security: bearer tokens, principals owning sessions, TLS and mutual TLS — each refusal
with the right code, against real servers on loopback."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import gradserve
from gradserve.errors import NotFoundError, UnauthenticatedError, UnavailableError
from gradserve.server import ServerConfig, run_server, start
from gradserve.server.transport.app import ConfigError
from gradserve.server.transport.auth import TokenTable
from gradserve.server.transport.cli import check_health
from tests.server.certs import make_pki
from tests.server.h2_probe import unfinished_call

TOKENS = "# principal:token\nalice:tok-alice-1234\nbob:tok-bob-5678\n"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(TOKENS)
    return str(path)


@pytest.fixture(scope="module")
def auth_server(token_file):
    with run_server(token_file=token_file, device="cpu") as s:
        yield f"127.0.0.1:{s.port}"


def test_no_token_is_unauthenticated(auth_server):
    with pytest.raises(UnauthenticatedError, match="bearer token"):
        gradserve.Client(auth_server)


def test_wrong_token_is_unauthenticated(auth_server):
    with pytest.raises(UnauthenticatedError):
        gradserve.Client(auth_server, token="tok-alice-123")  # a prefix of a real one


def test_right_token_works_and_health_needs_none(auth_server):
    with gradserve.Client(auth_server, token="tok-alice-1234") as client:
        np.testing.assert_array_equal(client.stop_gradient(np.arange(3)), np.arange(3))
    with grpc.insecure_channel(auth_server) as channel:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_another_principals_session_is_not_found(auth_server):
    with gradserve.Client(auth_server, token="tok-alice-1234") as alice:
        ta = alice.tensor_array(np.float32, size=1).write(0, [1.0])
        with pytest.raises(NotFoundError) as info:
            gradserve.Client(auth_server, token="tok-bob-5678", session_id=alice.session_id)
        assert info.value.reason == "SESSION_NOT_FOUND"
        # ... exactly as for an id that never existed
        with pytest.raises(NotFoundError) as never:
            gradserve.Client(auth_server, token="tok-bob-5678", session_id="no-such-session")
        assert str(never.value) == str(info.value)
        assert alice.raw_ops.TensorArraySizeV3(ta.handle, 0.0) == 1


def test_token_table_parsing(tmp_path):
    path = tmp_path / "t"
    path.write_text("alice:a\n\n# comment\nbob: b \n")
    table = TokenTable.from_file(path)
    assert table.principal_for("a") == "alice" and table.principal_for("b") == "bob"
    assert table.principal_for("c") is None
    path.write_text("no-colon\n")
    with pytest.raises(ValueError, match="principal:token"):
        TokenTable.from_file(path)
    # The owner of sessions made without a token file: restored from a snapshot, they
    # became the token's principal's (a review helper).
    path.write_text("alice:a\n anonymous :x\n")
    with pytest.raises(ValueError, match="2: the principal name 'anonymous' is reserved"):
        TokenTable.from_file(path)


def test_public_address_without_tokens_refuses_to_start():
    with pytest.raises(ConfigError, match="--token-file"):
        start(ServerConfig(host="0.0.0.0", port=0, device="cpu"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    pems = make_pki()
    paths = {}
    for role, pem in pems.items():
        (folder / f"{role}.crt").write_bytes(pem.cert)
        (folder / f"{role}.key").write_bytes(pem.key)
        paths[role] = (str(folder / f"{role}.crt"), str(folder / f"{role}.key"))
    return pems, paths


def test_tls(pki):
    pems, paths = pki
    with run_server(tls_cert=paths["server"][0], tls_key=paths["server"][1], device="cpu") as s:
        target = f"127.0.0.1:{s.port}"
        with gradserve.Client(target, root_certificates=pems["ca"].cert) as client:
            assert client.stop_gradient(np.ones(2)).sum() == 2
        with pytest.raises(UnavailableError):  # plaintext client, TLS server
            gradserve.Client(target, retries=0, timeout=5)


def test_mutual_tls(pki):
    pems, paths = pki
    with run_server(
        tls_cert=paths["server"][0],
        tls_key=paths["server"][1],
        tls_client_ca=paths["ca"][0],
        device="cpu",
    ) as s:
        target = f"127.0.0.1:{s.port}"
        with pytest.raises(UnavailableError):  # no client certificate
            gradserve.Client(target, root_certificates=pems["ca"].cert, retries=0, timeout=5)
        with gradserve.Client(
            target,
            root_certificates=pems["ca"].cert,
            private_key=pems["client"].key,
            certificate_chain=pems["client"].cert,
        ) as client:
            assert client.stop_gradient(np.ones(2)).sum() == 2
        # ``gradserve health`` too: with a client certificate (it had no way to give one).
        ask = (s.port, 5.0, paths["ca"][0])
        assert check_health("127.0.0.1", *ask) == 1  # refused without one
        assert check_health("127.0.0.1", *ask, *paths["client"]) == 0
        assert check_health("127.0.0.1", *ask, paths["client"][0]) == 2  # no key


def test_tls_with_tokens_together(pki, token_file):
    pems, paths = pki
    with run_server(
        tls_cert=paths["server"][0], tls_key=paths["server"][1], token_file=token_file, device="cpu"
    ) as s:
        target = f"127.0.0.1:{s.port}"
        with pytest.raises(UnauthenticatedError):
            gradserve.Client(target, root_certificates=pems["ca"].cert)
        with gradserve.Client(
            target, root_certificates=pems["ca"].cert, token="tok-bob-5678"
        ) as client:
            assert client.keep_alive() > 0


@pytest.mark.parametrize("method", ["PutTensorInline", "PutTensor", "CreateSession"])
def test_a_call_without_a_valid_token_is_refused_before_its_message_arrives(auth_server, method):
    """gRPC reads a unary call's whole message before its handler runs; the token is
    now checked where gRPC picks the handler, so a caller without a valid token can no
    longer make the server buffer a message declared 100 MiB long that never ends (a
    review helper held 766 MiB that way). Before, the call stayed open, waiting."""
    port = int(auth_server.rsplit(":", 1)[1])
    for token in (None, "tok-alice-123"):
        assert unfinished_call(port, method, token) == grpc.StatusCode.UNAUTHENTICATED.value[0]
    with gradserve.Client(auth_server, token="tok-bob-5678") as client:  # serves on
        np.testing.assert_array_equal(client.stop_gradient(np.arange(2)), np.arange(2))


def test_refusals_of_every_kind_of_call_carry_the_status_details(auth_server):
    """The refusal handler takes a unary request as a stream it never reads; the
    client still gets UNAUTHENTICATED with its reason, whatever the method's kind."""
    from grpc_status import rpc_status

    from gradserve.v1 import service_pb2, service_pb2_grpc, tensor_pb2

    with grpc.insecure_channel(auth_server) as channel:
        stub = service_pb2_grpc.GradServeStub(channel)
        bad = (("authorization", "Bearer nope"),)
        calls = [
            lambda: stub.GetTensor(service_pb2.GetTensorRequest(id="x"), metadata=bad).next(),
            lambda: stub.PutTensor(iter([tensor_pb2.TensorChunk()]), metadata=bad),
            lambda: stub.DeleteTensor(service_pb2.DeleteTensorRequest(), metadata=bad),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            status = rpc_status.from_call(info.value)
            assert status is not None and "UNAUTHENTICATED" in str(status.details)
