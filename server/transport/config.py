"""Server settings, one dataclass, filled from the command line or by tests.

Every limit has a default sized for a shared machine and a flag to change it;
None means unlimited.
"""

from __future__ import annotations

import dataclasses
import os

from gradserve import protocol
from gradserve.kernels import blas_threads, lstm_cpu, native
from gradserve.kernels.cuda_graphs import DEFAULT_CACHE_BYTES
from gradserve.warm_buffers import DEFAULT_LIMIT_BYTES as DEFAULT_HOST_CACHE_BYTES

#: ``--max-inline-reply-bytes``' default: the stall a reply this large causes other
#: calls (16-25 ms at the 90th percentile here while a client pulls them without
#: pause) is a few times a small call's, and the SDK's inline outputs (4 MiB each)
#: fit four to a reply.
DEFAULT_MAX_INLINE_REPLY_BYTES = 16 * 1024 * 1024

#: ``max_principal_bytes`` and ``max_concurrent_rpcs_per_principal`` default: half of
#: the server's limit, where there are principals (a token file).
SERVER_FRACTION = -1


def _half_of_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return None


#: ``--lstm-formulation``'s values (besides auto).
LSTM_FORMULATIONS = tuple(form.value for form in lstm_cpu.Formulation)
#: ``--cpu-step-kernel``'s values.
CPU_STEP_KERNELS = tuple(mode.value for mode in native.Mode)


@dataclasses.dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    #: Where the array math runs: "auto" (CUDA when usable), "cpu" or "cuda".
    device: str = "auto"
    #: Replay whole LSTM calls as CUDA graphs (``--device cuda`` only), keeping at
    #: most this many GPU bytes in captured plans.
    cuda_graphs: bool = False
    cuda_graph_cache_bytes: int = DEFAULT_CACHE_BYTES
    #: Threads computing light ops (TensorArray ops, copies); waiting calls take none.
    workers: int = 16

    # --- security
    #: ``principal:token`` lines; without it, the server only binds to loopback.
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: CA bundle for client certificates: mutual TLS when set.
    tls_client_ca: str | None = None

    # --- limits
    #: Ceiling of one unary message, each direction.
    max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES
    #: Tensor bytes one reply carries inline (None: up to the message limit); larger
    #: outputs go as transient tensors, streamed (``ServicerPart.reply_budget``).
    max_inline_reply_bytes: int | None = DEFAULT_MAX_INLINE_REPLY_BYTES
    #: Largest single tensor the server will hold or build.
    max_tensor_bytes: int | None = 4 * 1024**3
    #: Most elements (indices) one TensorArray may have.
    max_tensor_array_size: int | None = 1 << 24
    max_sessions: int | None = 1024
    max_sessions_per_principal: int | None = 64
    #: Bytes one session may hold (resident tensors and TensorArray values).
    max_session_bytes: int | None = 8 * 1024**3
    #: Bytes all sessions together may hold: half the machine's memory by default.
    max_server_bytes: int | None = dataclasses.field(default_factory=_half_of_memory)
    #: Bytes all sessions of one principal may hold; by default half of
    #: ``max_server_bytes`` (``SERVER_FRACTION``), so one tenant cannot starve another.
    max_principal_bytes: int | None = SERVER_FRACTION
    #: Idle sessions are closed after this many seconds.
    session_ttl: float = 3600.0
    #: Bytes of freed large-tensor buffers kept warm for reuse (0: none); outside
    #: every byte budget above, and given back after a minute unused.
    host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES

    # --- admission control and connections
    #: GradServe calls in flight at once (health excluded); more are refused with
    #: RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int | None = 256
    #: Of those, the calls of one principal (``SERVER_FRACTION``: half, with a token
    #: file), so one tenant flooding slow calls never holds every slot.
    max_concurrent_rpcs_per_principal: int | None = SERVER_FRACTION
    #: Streams (PutTensor, GetTensor) open at once, all principals and one principal:
    #: a stalled stream costs no thread, but a call and the data gRPC buffers for it.
    max_streams: int | None = 1024
    max_streams_per_principal: int | None = 512
    #: Heavy ops (LSTM) computing at once (None: as many as the cores hold, ``slots``),
    #: and how many may wait for a slot.
    compute_slots: int | None = None
    #: On the CPU, LSTM ops computing at once divide the BLAS threads (more throughput
    #: under concurrent calls; an op's last bits then depend on how many compute beside
    #: it). Off: every op computes with all of them, bit for bit the same under load.
    share_blas_threads: bool = False
    #: On the CPU, the LSTM forward's GEMM formulation ("concat", "hoisted",
    #: "hoisted-t": ``kernels/lstm_cpu.py``) for every shape. None: the one measured
    #: fastest on the first call of a shape, which another process may measure
    #: otherwise, so replicas (or a restart) could differ in the last bits.
    lstm_formulation: str | None = None
    #: On the CPU, the LSTM forward's elementwise pass in float32 (``kernels/native.py``):
    #: "auto" (the step compiled here with the host's C compiler, else NumPy's),
    #: "native" (compiled, or the server does not start), "numpy". The two give other
    #: last bits: replicas meant to agree bit for bit name one.
    cpu_step_kernel: str = "auto"
    max_queued_compute: int = 64
    #: A heavy op that has computed this long (seconds) gives its slot to another
    #: principal's waiting op at its next step, and goes on when its turn comes again
    #: (None: it keeps the slot until it ends; ``lanes.Lane``).
    compute_quantum: float | None = 0.05
    #: A stream (PutTensor, GetTensor) ends when no chunk moves for this long, or when
    #: after ``stream_rate_grace`` seconds it averages under ``stream_min_rate`` bytes/s.
    stream_idle_timeout: float | None = 30.0
    stream_min_rate: float | None = 256 * 1024
    stream_rate_grace: float = 10.0
    keepalive_time: float = 60.0
    keepalive_timeout: float = 20.0
    #: Connections are recycled after this long (None: never), with this grace.
    max_connection_age: float | None = None
    max_connection_age_grace: float = 30.0

    # --- lifecycle and observability
    #: Seconds calls in flight get to finish on SIGTERM/SIGINT (new ones are refused).
    grace: float = 10.0
    #: Serve Prometheus metrics on this port (None: off).
    metrics_port: int | None = None

    # --- replicas and state (README, "Running several replicas")
    #: This replica's identity, stamped into the ids of the sessions it creates
    #: (``<replica>.<random>``) for a proxy to route on; None: bare random ids.
    replica_id: str | None = None
    #: Write every session here on SIGTERM (after the drain) and restore them on start.
    state_dir: str | None = None
    #: Also snapshot every this many seconds while serving (None: only on SIGTERM).
    snapshot_interval: float | None = None
    #: On SIGHUP, adopt (restore and serve) the session files found here, such as a
    #: removed replica's; default ``<state_dir>/adopt``.
    adopt_dir: str | None = None

    def adopt_path(self) -> str | None:
        """Where SIGHUP looks for sessions to adopt."""
        if self.adopt_dir is not None:
            return self.adopt_dir
        return os.path.join(self.state_dir, "adopt") if self.state_dir else None

    def slots(self, device: str) -> int:
        """``compute_slots`` resolved for the resolved ``device``. By default, on the
        CPU, as many ops as the cores hold when each computes with all the BLAS threads
        (``OPENBLAS_NUM_THREADS``, else one per core): ``cores // threads``. More would
        oversubscribe the cores: at (100, 64, 512) on 2 cores and 2 BLAS threads, 2-4
        clients got 5.3-6.1 ops/s from a slot per core against 7.0-8.0 from one slot
        (README, "BLAS threads"). Ops that divide the threads (``share_blas_threads``),
        and GPU ops, get a slot per core."""
        if self.compute_slots is not None:
            return self.compute_slots
        cores = max(1, os.cpu_count() or 1)
        if device != "cpu" or self.share_blas_threads:
            return cores
        return max(1, cores // (blas_threads.BLAS.count() or 1))

    def principal_bytes(self) -> int | None:
        """``max_principal_bytes`` resolved: by default half the server's budget where
        there are principals (a token file); without one every session is the same
        anonymous principal, whose quota would only halve the server."""
        if self.max_principal_bytes != SERVER_FRACTION:
            return self.max_principal_bytes
        if self.token_file is None or self.max_server_bytes is None:
            return None
        return self.max_server_bytes // 2

    def sessions_per_principal(self) -> int | None:
        """``max_sessions_per_principal`` where there are principals (a token file):
        without one every client is the same anonymous principal, and 64 sessions of
        one local client locked every other out while ``--max-sessions`` had room."""
        return self.max_sessions_per_principal if self.token_file else None

    def rpcs_per_principal(self) -> int | None:
        """``max_concurrent_rpcs_per_principal`` resolved: by default half of
        ``max_concurrent_rpcs`` where there are principals (a token file)."""
        limit = self.max_concurrent_rpcs_per_principal
        if limit != SERVER_FRACTION:
            if limit is not None and limit < 1:
                raise ValueError(
                    f"--max-concurrent-rpcs-per-principal {limit}: at least 1 (or none, "
                    "or -1 for half of --max-concurrent-rpcs)"
                )
            return limit
        if self.token_file is None or self.max_concurrent_rpcs is None:
            return None
        return max(1, self.max_concurrent_rpcs // 2)

    def streams_per_principal(self) -> int | None:
        """``max_streams_per_principal`` where there are principals (a token file)."""
        return self.max_streams_per_principal if self.token_file else None

    def grpc_options(self) -> list[tuple[str, int]]:
        options = protocol.channel_options(self.max_message_bytes) + [
            ("grpc.keepalive_time_ms", int(self.keepalive_time * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout * 1000)),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # gRPC sets SO_REUSEPORT by default: a second server on a taken port started
            # and the kernel split connections between the two, so a session's calls
            # met a server that does not hold it (found by a review helper). Off: the
            # second one fails to start.
            ("grpc.so_reuseport", 0),
        ]
        if self.max_connection_age is not None:
            options += [
                ("grpc.max_connection_age_ms", int(self.max_connection_age * 1000)),
                ("grpc.max_connection_age_grace_ms", int(self.max_connection_age_grace * 1000)),
            ]
        return options
