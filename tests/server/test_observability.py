"""Prometheus metrics and per-RPC structured logs with request ids."""

from __future__ import annotations

import json
import logging
import re
import urllib.request

import numpy as np
import pytest

import gradserve
from gradserve.server import run_server
from gradserve.server.core.sessions import TENSOR_RECORD_BYTES
from gradserve.server.transport.observability import JsonFormatter


@pytest.fixture(scope="module")
def metered():
    with run_server(device="cpu", metrics_port=0, session_ttl=3600) as s:
        yield s


def scrape(server) -> str:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback
        return response.read().decode()


def value(text: str, pattern: str) -> float:
    match = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.M)
    assert match, pattern
    return float(match.group(1))


def test_metrics(metered):
    # Byte counts of the wire: shared memory would move the tensors elsewhere.
    with gradserve.Client(f"127.0.0.1:{metered.port}", shared_memory=False) as client:
        for _ in range(3):
            client.stop_gradient(np.arange(1000.0))
        client.put(np.ones(256))
        client.delete(client.put(np.ones(1 << 20)))  # 8 MiB: its buffer is kept warm
        with pytest.raises(gradserve.errors.NotFoundError):
            client.get("missing")
        text = scrape(metered)
        assert value(text, 'gradserve_rpcs_total{code="OK",method="StopGradient"}') == 3
        assert value(text, 'gradserve_rpcs_total{code="NOT_FOUND",method="GetTensor"}') == 1
        for phase in ("decode", "compute", "encode"):
            assert (
                value(text, f'gradserve_rpc_seconds_count{{method="StopGradient",phase="{phase}"}}')
                == 3
            )
        assert value(text, 'gradserve_received_bytes_total{method="StopGradient"}') > 3 * 8000
        assert value(text, 'gradserve_sent_bytes_total{method="StopGradient"}') > 3 * 8000
        # A unary put's tensor is parsed as a view (``app.VIEW_PARSERS``), still counted.
        assert 2048 < value(text, 'gradserve_received_bytes_total{method="PutTensorInline"}') < 2100
        assert value(text, 'gradserve_received_bytes_total{method="PutTensor"}') >= 8 << 20
        assert value(text, "gradserve_sessions_open") == 1
        assert value(text, "gradserve_bytes_held") == 2048 + TENSOR_RECORD_BYTES
        assert value(text, "gradserve_host_cache_bytes") == 8 << 20
        assert value(text, 'gradserve_device_info{device="cpu"}') == 1
        assert value(text, "gradserve_sessions_expired_total") == 0
    assert value(scrape(metered), "gradserve_sessions_open") == 0


def test_request_id_is_logged_and_returned(metered, caplog):
    caplog.set_level(logging.DEBUG, logger="gradserve.rpc")
    with gradserve.Client(f"127.0.0.1:{metered.port}") as client:
        client.stop_gradient(np.ones(1))
        with pytest.raises(gradserve.errors.InvalidArgumentError) as info:
            client.raw_ops.TensorArrayV3(size=-1, dtype=np.float32)
    assert re.fullmatch(r"[0-9a-f]{16}", info.value.request_id)
    failed = [r for r in caplog.records if r.levelno == logging.INFO and r.name == "gradserve.rpc"]
    assert any(r.fields["request_id"] == info.value.request_id for r in failed)
    line = json.loads(JsonFormatter().format(failed[-1]))
    assert line["method"] == "TensorArrayV3" and line["code"] == "INVALID_ARGUMENT"
    assert line["request_id"] == info.value.request_id and "Size should be >= 0" in line["message"]
    ok = [r for r in caplog.records if r.levelno == logging.DEBUG and r.name == "gradserve.rpc"]
    assert any(r.fields["method"] == "StopGradient" for r in ok)


def test_unauthenticated_refusals_are_counted(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:s3cret-token\n")
    with run_server(device="cpu", metrics_port=0, token_file=str(tokens)) as server:
        target = f"127.0.0.1:{server.port}"
        for token in (None, "wrong"):
            with pytest.raises(gradserve.errors.UnauthenticatedError):
                gradserve.Client(target, token=token)
        with gradserve.Client(target, token="s3cret-token") as client:
            client.stop_gradient(np.ones(3))
        text = scrape(server)
        assert (
            value(text, 'gradserve_rpcs_total{code="UNAUTHENTICATED",method="CreateSession"}') == 2
        )
        assert value(text, 'gradserve_rpcs_total{code="OK",method="StopGradient"}') == 1
