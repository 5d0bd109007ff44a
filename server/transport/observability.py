"""Metrics and per-RPC logs.

Prometheus metrics (prometheus-client, one registry per server so that many
servers can live in one process): RPCs by method and status code, latency
histograms split into decode, compute and encode time, bytes in and out,
sessions open, bytes held, compute device, expired sessions, on CUDA the GPU
memory pool (used and held bytes), and with ``--cuda-graphs on`` the captured
plans (count, GPU bytes, captures, replays).

Logs: one line per RPC at DEBUG and one per failed RPC at INFO, carrying a
request id taken from ``x-request-id`` metadata (the SDK sends one per call)
or made up, and echoed back in trailing metadata. ``JsonFormatter`` turns
records into one JSON object per line.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from gradserve.errors import Code
from gradserve.kernels.compute import Compute
from gradserve.protocol import REQUEST_ID_KEY

log = logging.getLogger("gradserve.rpc")

#: The record of the RPC being served, for CallIO to add decode/encode time to.
current_call: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar(
    "gradserve_call", default=None
)

_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100)


@dataclasses.dataclass
class CallRecord:
    method: str
    request_id: str
    started: float
    decode_seconds: float = 0.0
    encode_seconds: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    code: Code = Code.OK
    message: str = ""


class Metrics:
    """The server's Prometheus metrics, in their own registry."""

    def __init__(self, store, compute) -> None:
        """``compute``: the server's ``kernels.compute.Compute`` (device, GPU pool, graphs)."""
        device, graphs = compute.name, compute.graphs
        self.registry = CollectorRegistry()
        r = self.registry
        self.rpcs = Counter(
            "gradserve_rpcs",
            "RPCs served, by method and status code",
            ["method", "code"],
            registry=r,
        )
        self.seconds = Histogram(
            "gradserve_rpc_seconds",
            "RPC time by phase",
            ["method", "phase"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.bytes_in = Counter("gradserve_received_bytes", "request bytes", ["method"], registry=r)
        self.bytes_out = Counter("gradserve_sent_bytes", "response bytes", ["method"], registry=r)
        Gauge("gradserve_sessions_open", "open sessions", registry=r).set_function(
            lambda: len(store)
        )
        Gauge("gradserve_bytes_held", "bytes held in all sessions", registry=r).set_function(
            lambda: store.budget.used
        )
        Gauge(
            "gradserve_host_cache_bytes",
            "freed large-tensor buffers kept warm for reuse (--host-cache-bytes)",
            registry=r,
        ).set_function(lambda: store.buffers.cached_bytes)
        Gauge(
            "gradserve_device_info", "compute device of this server", ["device"], registry=r
        ).labels(device=device).set(1)
        r.register(_ExpiredSessions(store))
        if compute.pool_bytes() is not None:
            pool = Gauge(
                "gradserve_gpu_pool_bytes",
                "GPU memory of CuPy's pool: used by live arrays, held from the driver",
                ["state"],
                registry=r,
            )
            for state in ("used", "held"):
                pool.labels(state=state).set_function(
                    functools.partial(_pool_bytes, compute, state)
                )
        if graphs is not None:
            Gauge("gradserve_cuda_graph_plans", "captured LSTM plans", registry=r).set_function(
                lambda: len(graphs)
            )
            Gauge(
                "gradserve_cuda_graph_bytes", "GPU bytes held by captured plans", registry=r
            ).set_function(lambda: graphs.nbytes)
            r.register(_GraphCounts(graphs))


def _pool_bytes(compute: Compute, state: str) -> float:
    pool = compute.pool_bytes()
    return 0.0 if pool is None else float(pool[state])


class _ExpiredSessions:
    def __init__(self, store) -> None:
        self._store = store

    def collect(self):
        family = CounterMetricFamily(
            "gradserve_sessions_expired", "sessions closed by the idle timeout (evictions)"
        )
        family.add_metric([], self._store.expired)
        yield family


class _GraphCounts:
    def __init__(self, graphs) -> None:
        self._graphs = graphs

    def collect(self):
        for name, what, value in (
            ("gradserve_cuda_graph_captures", "LSTM calls captured as CUDA graphs", "captures"),
            ("gradserve_cuda_graph_replays", "LSTM calls served by a graph replay", "replays"),
        ):
            family = CounterMetricFamily(name, what)
            family.add_metric([], getattr(self._graphs, value))
            yield family


class Observer:
    """Times, counts and logs every RPC; ``metrics`` may be None (metrics off)."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics

    @contextlib.contextmanager
    def call(self, method: str, context: Any) -> Iterator[CallRecord]:
        request_id = _request_id(context)
        record = CallRecord(method, request_id, time.perf_counter())
        token = current_call.set(record)
        try:
            yield record
        finally:
            current_call.reset(token)
            self._finish(record)

    @property
    def counts_bytes(self) -> bool:
        """Whether anyone (metrics, DEBUG logs) reads the byte counts: they cost a pass."""
        return self.metrics is not None or log.isEnabledFor(logging.DEBUG)

    def _finish(self, record: CallRecord) -> None:
        code, message = record.code, record.message
        ok = code is Code.OK
        if ok and self.metrics is None and not log.isEnabledFor(logging.DEBUG):
            return  # the hot path: nothing to record
        total = time.perf_counter() - record.started
        compute = max(0.0, total - record.decode_seconds - record.encode_seconds)
        if self.metrics is not None:
            m = self.metrics
            m.rpcs.labels(record.method, code.name).inc()
            m.seconds.labels(record.method, "decode").observe(record.decode_seconds)
            m.seconds.labels(record.method, "compute").observe(compute)
            m.seconds.labels(record.method, "encode").observe(record.encode_seconds)
            m.bytes_in.labels(record.method).inc(record.bytes_in)
            m.bytes_out.labels(record.method).inc(record.bytes_out)
        fields = {
            "request_id": record.request_id,
            "method": record.method,
            "code": code.name,
            "ms": round(total * 1e3, 3),
            "bytes_in": record.bytes_in,
            "bytes_out": record.bytes_out,
        }
        if ok:
            log.debug("rpc", extra={"fields": fields})
        else:
            log.info("rpc failed: %s", message, extra={"fields": fields})


def add_decode_time(seconds: float) -> None:
    record = current_call.get()
    if record is not None:
        record.decode_seconds += seconds


def add_encode_time(seconds: float) -> None:
    record = current_call.get()
    if record is not None:
        record.encode_seconds += seconds


def _request_id(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and 0 < len(value) <= 128:
            return value
    return secrets.token_hex(8)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:  # (``log_writer`` formats it before queueing the record)
            out["exception"] = record.exc_text
        return json.dumps(out)
